// jaxspec's CPU kernel for products of a few rows with a weight matrix, as an XLA FFI
// handler: y[n, o] = sum_i x[n, i] * w[o, i] for x [rows, in] (rows <= kMaxRows) and
// w [out, in], float32, row-major. A decode step multiplies 1..9 positions by each
// weight matrix; XLA:CPU runs 2..9 rows several times slower than one row (its
// matrix-matrix path), while this kernel reads w once and keeps every row in registers,
// so k rows cost little more than one (jaxspec.model.cpu_matmul; docs/design.md).
//
// Exactness: every output accumulates over i in the same order (one vector accumulator
// per output, lane i % kLanes, then a fixed horizontal sum, then the scalar tail),
// whatever the number of rows, the register blocking or the thread split, so row n of
// a k-row product is bit-identical to the one-row product of x[n].
//
// AVX2 + FMA; jaxspec.model.cpu_matmul builds it on first use where the CPU has both.

#include <immintrin.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <memory>

#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

using Vec = __m256;
constexpr int64_t kLanes = 8;
inline Vec Load(const float* p) { return _mm256_loadu_ps(p); }
inline Vec Fma(Vec a, Vec b, Vec c) { return _mm256_fmadd_ps(a, b, c); }
inline Vec Zero() { return _mm256_setzero_ps(); }
inline float HorizontalSum(Vec v) {
  __m128 q = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  q = _mm_add_ps(q, _mm_movehl_ps(q, q));
  q = _mm_add_ss(q, _mm_movehdup_ps(q));
  return _mm_cvtss_f32(q);
}
constexpr int64_t kMaxRows = 16;  // jaxspec.model.cpu_matmul.MAX_ROWS
constexpr int64_t kOutputsPerTask = 64;  // outputs per thread at least (fewer: fewer threads)
constexpr int64_t kFloatsPerLine = 16;  // 64-byte cache lines

// Accumulates w rows o..o+R-1 against x rows n..n+C-1 over i in [0, in8) into
// acc[r * kMaxRows + n + c]: R x C accumulators in registers, each w vector loaded once
// for C rows. With kPrefetch (the first block of an output block), w rows o+R..o+2R-1,
// the next output block's, are fetched into L2 meanwhile: the later blocks of this output
// block and the next output block then compute on cached w instead of waiting for memory.
template <int R, int C, bool kPrefetch>
inline void Block(const float* x, const float* w, Vec* acc, int64_t in, int64_t in8,
                  int64_t o, int64_t n) {
  Vec a[R][C];
  const float* wr[R];
  const float* xc[C];
  for (int r = 0; r < R; ++r) wr[r] = w + (o + r) * in;
  for (int c = 0; c < C; ++c) xc[c] = x + (n + c) * in;
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < C; ++c) a[r][c] = Zero();
  for (int64_t i = 0; i < in8; i += kLanes) {
    if (kPrefetch && i % kFloatsPerLine == 0) {
      // Prefetches never fault: past the last row of w they fetch nothing useful.
      for (int r = 0; r < R; ++r)
        _mm_prefetch(reinterpret_cast<const char*>(wr[r] + R * in + i), _MM_HINT_T1);
    }
    Vec wv[R];
    for (int r = 0; r < R; ++r) wv[r] = Load(wr[r] + i);
    for (int c = 0; c < C; ++c) {
      const Vec u = Load(xc[c] + i);
      for (int r = 0; r < R; ++r) a[r][c] = Fma(wv[r], u, a[r][c]);
    }
  }
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < C; ++c) acc[r * kMaxRows + n + c] = a[r][c];
}

// Block<R, count> for count in 1..C.
template <int R, int C, bool kPrefetch>
inline void BlockOf(int count, const float* x, const float* w, Vec* acc, int64_t in,
                    int64_t in8, int64_t o, int64_t n) {
  if constexpr (C >= 4) {
    if (count == 4) return Block<R, 4, kPrefetch>(x, w, acc, in, in8, o, n);
  }
  if constexpr (C >= 3) {
    if (count == 3) return Block<R, 3, kPrefetch>(x, w, acc, in, in8, o, n);
  }
  if constexpr (C >= 2) {
    if (count == 2) return Block<R, 2, kPrefetch>(x, w, acc, in, in8, o, n);
  }
  Block<R, 1, kPrefetch>(x, w, acc, in, in8, o, n);
}

// y[:, o..o+R) for all rows, C rows of x at a time.
template <int R, int C>
void OutputBlock(const float* x, const float* w, float* y, int64_t rows, int64_t in,
                 int64_t out, int64_t o) {
  static_assert(C >= 1 && C <= 4, "blocks of 1..4 rows");
  Vec acc[R * kMaxRows];
  const int64_t in8 = in - in % kLanes;
  for (int64_t n = 0; n < rows;) {
    const int count = static_cast<int>(std::min<int64_t>(C, rows - n));
    if (n == 0) {
      BlockOf<R, C, true>(count, x, w, acc, in, in8, o, n);
    } else {
      BlockOf<R, C, false>(count, x, w, acc, in, in8, o, n);
    }
    n += count;
  }
  for (int r = 0; r < R; ++r) {
    const float* wr = w + (o + r) * in;
    for (int64_t m = 0; m < rows; ++m) {
      const float* xm = x + m * in;
      float s = HorizontalSum(acc[r * kMaxRows + m]);
      for (int64_t i = in8; i < in; ++i) s = std::fma(wr[i], xm[i], s);
      y[m * out + o + r] = s;
    }
  }
}

template <int R, int C>
int64_t OutputBlocks(const float* x, const float* w, float* y, int64_t rows, int64_t in,
                     int64_t out, int64_t o, int64_t end) {
  for (; o + R <= end; o += R) OutputBlock<R, C>(x, w, y, rows, in, out, o);
  return o;
}

// y[:, begin..end). The register blocks (outputs x rows: 4 x 1, 4 x 2, 3 x 4) were the
// fastest measured on AVX2 (16 vector registers) for 1, 2 and 3..16 rows.
void Outputs(const float* x, const float* w, float* y, int64_t rows, int64_t in,
             int64_t out, int64_t begin, int64_t end) {
  int64_t o = begin;
  if (rows == 1) {
    o = OutputBlocks<4, 1>(x, w, y, rows, in, out, o, end);
    OutputBlocks<1, 1>(x, w, y, rows, in, out, o, end);
  } else if (rows == 2) {
    o = OutputBlocks<4, 2>(x, w, y, rows, in, out, o, end);
    OutputBlocks<1, 2>(x, w, y, rows, in, out, o, end);
  } else {
    o = OutputBlocks<3, 4>(x, w, y, rows, in, out, o, end);
    OutputBlocks<1, 4>(x, w, y, rows, in, out, o, end);
  }
}

// Splits the outputs into parts claimed from a shared counter by the calling thread and
// by tasks on XLA's intra-op pool. A task that starts after every part is claimed does
// nothing, so the call never waits on a thread that is busy elsewhere.
struct Parts {
  std::atomic<int64_t> next{0};
  std::atomic<int64_t> finished{0};
};

void RunParts(const std::shared_ptr<Parts>& parts, int64_t num_parts, const float* x,
              const float* w, float* y, int64_t rows, int64_t in, int64_t out) {
  const int64_t per_part = (out / num_parts + 7) / 8 * 8;
  for (int64_t p; (p = parts->next.fetch_add(1)) < num_parts;) {
    const int64_t begin = std::min(out, p * per_part);
    const int64_t end = p + 1 == num_parts ? out : std::min(out, begin + per_part);
    Outputs(x, w, y, rows, in, out, begin, end);
    parts->finished.fetch_add(1, std::memory_order_release);
  }
}

ffi::Error FewRowMatmul(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x,
                        ffi::Buffer<ffi::F32> w, ffi::ResultBuffer<ffi::F32> y) {
  const auto w_dims = w.dimensions();
  if (w_dims.size() != 2) return ffi::Error::InvalidArgument("w must be [out, in]");
  const int64_t out = w_dims[0], in = w_dims[1];
  const auto x_dims = x.dimensions();
  if (x_dims.size() < 1 || x_dims.back() != in)
    return ffi::Error::InvalidArgument("x [..., in] does not match w [out, in]");
  const int64_t rows = in == 0 ? 0 : x.element_count() / in;
  if (rows > kMaxRows) return ffi::Error::InvalidArgument("x has more than 16 rows");
  const float* xp = x.typed_data();
  const float* wp = w.typed_data();
  float* yp = y->typed_data();
  if (in == 0) {
    std::fill(yp, yp + rows * out, 0.0f);
    return ffi::Error::Success();
  }
  // One part for the calling thread and one for each other thread of the pool.
  const int64_t num_parts =
      std::max<int64_t>(1, std::min<int64_t>(pool.num_threads(), out / kOutputsPerTask));
  if (num_parts == 1) {
    Outputs(xp, wp, yp, rows, in, out, 0, out);
    return ffi::Error::Success();
  }
  auto parts = std::make_shared<Parts>();
  for (int64_t t = 1; t < num_parts; ++t)
    pool.Schedule([=]() { RunParts(parts, num_parts, xp, wp, yp, rows, in, out); });
  RunParts(parts, num_parts, xp, wp, yp, rows, in, out);
  while (parts->finished.load(std::memory_order_acquire) < num_parts) _mm_pause();
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxspecFewRowMatmul, FewRowMatmul,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>());
