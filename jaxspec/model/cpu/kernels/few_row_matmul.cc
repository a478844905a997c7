// jaxspec's CPU kernels for products of a few rows with a weight matrix, as XLA FFI
// handlers: y[n, o] = sum_i x[n, i] * w[o, i] for x [rows, in] (any rows) and
// w [out, in], float32, row-major (JaxspecFewRowMatmul); and its int8 form for int8
// drafts (JaxspecFewRowMatmulInt8, below). A decode step multiplies 1..9 positions by each
// weight matrix; XLA:CPU runs 2..9 rows several times slower than one row (its
// matrix-matrix path), while this kernel reads w once and keeps every row in registers,
// so k rows cost little more than one (jaxspec.model.cpu.matmul; docs/performance.md).
//
// Exactness: every output accumulates over i in the same order (one vector accumulator
// per output, lane i % kLanes, then a fixed horizontal sum, then the scalar tail),
// whatever the number of rows, the register blocking or the thread split, so row n of
// a k-row product is bit-identical to the one-row product of x[n].
//
// AVX2 + FMA, and where built for AVX-512 (-mavx512f, -mavx512bw, -mavx512vnni) 16-lane
// float32 products and VNNI int8 products; jaxspec.model.cpu.matmul builds it on first
// use for the widest of the two this CPU has.

#include <immintrin.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <vector>

#include "float_vectors.h"
#include "spin_pool.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

// The float32 products' vectors (float_vectors.h): 16 lanes where built for AVX-512
// (32 vector registers, so register blocks of more rows), else 8 lanes of AVX2.
using jaxspec_kernels::Fma;
using jaxspec_kernels::HorizontalSum;
using jaxspec_kernels::kVecLanes;
using jaxspec_kernels::Load;
using jaxspec_kernels::Vec;
using jaxspec_kernels::Zero;

constexpr int64_t kLanes = 8;  // AVX2 lanes of the int8 path's activation quantization
// Rows of one float32 register-block sweep (more run as groups of at most this many, each
// its own product), and the most rows of an int8 call (jaxspec.model.cpu.matmul.
// INT8_CALL_ROWS).
constexpr int64_t kMaxRows = 128;
constexpr int64_t kOutputsPerTask = 64;  // outputs per thread at least (fewer: fewer threads)
constexpr int64_t kFloatsPerLine = 16;  // 64-byte cache lines
constexpr int64_t kLineBytes = 64;

// Accumulates w rows o..o+R-1 against x rows n..n+C-1 over i in [0, in8) into
// acc[r * kMaxRows + n + c]: R x C accumulators in registers, each w vector loaded once
// for C rows. Meanwhile w rows o+R+r for r = pass, pass + passes, ... (this pass's
// share of the next output block) are fetched into L2, so that the next output block
// computes on cached w instead of waiting for memory.
template <int R, int C>
inline void Block(const float* x, const float* w, Vec* acc, int64_t in, int64_t in8,
                  int64_t o, int64_t n, int pass = 0, int passes = 1) {
  Vec a[R][C];
  const float* wr[R];
  const float* xc[C];
  for (int r = 0; r < R; ++r) wr[r] = w + (o + r) * in;
  for (int c = 0; c < C; ++c) xc[c] = x + (n + c) * in;
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < C; ++c) a[r][c] = Zero();
  for (int64_t i = 0; i < in8; i += kVecLanes) {
    if (i % kFloatsPerLine == 0) {
      // Prefetches never fault: past the last row of w they fetch nothing useful.
      for (int r = pass; r < R; r += passes)
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
template <int R, int C>
inline void BlockOf(int count, const float* x, const float* w, Vec* acc, int64_t in,
                    int64_t in8, int64_t o, int64_t n, int pass = 0, int passes = 1) {
  if constexpr (C > 1) {
    if (count < C)
      return BlockOf<R, C - 1>(count, x, w, acc, in, in8, o, n, pass, passes);
  }
  Block<R, C>(x, w, acc, in, in8, o, n, pass, passes);
}

// y[:, o..o+R) for all rows, C rows of x at a time.
template <int R, int C>
void OutputBlock(const float* x, const float* w, float* y, int64_t rows, int64_t in,
                 int64_t out, int64_t o) {
  static_assert(C >= 1 && C <= kMaxRows, "blocks of 1..kMaxRows rows");
  Vec acc[R * kMaxRows];
  const int64_t in8 = in - in % kVecLanes;
  // Rows in passes of (nearly) equal size, 16 rows as 4 x 4 rather than 5 + 5 + 5 + 1,
  // each pass prefetching its share of the next output block's w rows: the fetch is spread
  // over the whole block's compute instead of crowding its first pass (a 16-row product
  // of the target's decoder ~15% faster, measured in steps of the main pair).
  const int passes = static_cast<int>((rows + C - 1) / C);
  const int64_t per_pass = (rows + passes - 1) / passes;
  for (int pass = 0; pass < passes; ++pass) {
    const int64_t n = pass * per_pass;
    const int count = static_cast<int>(std::min<int64_t>(per_pass, rows - n));
    BlockOf<R, C>(count, x, w, acc, in, in8, o, n, pass, passes);
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

// y[:, begin..end). The register blocks (outputs x rows) were the fastest measured:
// with AVX2 (16 vector registers) 4 x 1, 4 x 2 and 3 x 4 for 1, 2 and 3..32 rows; with
// AVX-512 (32) 4 x 1, 4 x 2 and 4 x 5 (a 9-position verify step in two passes: 3 x 9
// in one pass, 3 x 8, 4 x 4, 4 x 6, 5 x 5 and 6 x 4 were all slower).
#if defined(__AVX512F__)
constexpr int kManyRowsR = 4, kManyRowsC = 5;
#else
constexpr int kManyRowsR = 3, kManyRowsC = 4;
#endif
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
    o = OutputBlocks<kManyRowsR, kManyRowsC>(x, w, y, rows, in, out, o, end);
    OutputBlocks<1, kManyRowsC>(x, w, y, rows, in, out, o, end);
  }
}


using jaxspec_kernels::Helpers;
using jaxspec_kernels::SpinPool;

// JAXSPEC_KERNEL_THREADS=pool hands parts to XLA's intra-op pool instead (no helper
// threads of the kernel's own).
bool UseSpinPool() {
  const char* setting = std::getenv("JAXSPEC_KERNEL_THREADS");
  return !(setting && std::strcmp(setting, "pool") == 0);
}

// Runs outputs(begin, end) over [0, out) in parts (multiples of 8 outputs, at least
// kOutputsPerTask each) on the calling thread and the helpers.
template <typename OutputRange>
void SplitOverHelpers(const ffi::ThreadPool& pool, int64_t out, const OutputRange& outputs,
                      int64_t multiple) {
  SpinPool& helpers = Helpers(pool);
  const int64_t parts = std::max<int64_t>(1, std::min<int64_t>(helpers.num_helpers() + 1,
                                                               out / kOutputsPerTask));
  const int64_t per_part = (out / parts + multiple - 1) / multiple * multiple;
  helpers.Run(parts, [&](int64_t p) {
    const int64_t begin = std::min(out, p * per_part);
    const int64_t end = p + 1 == parts ? out : std::min(out, begin + per_part);
    outputs(begin, end);
  });
}

// Runs outputs(begin, end) over [0, out): in one part when out is small, else in one
// part per thread (multiples of 8 outputs, at least kOutputsPerTask each) on the kernel's
// helpers, or with JAXSPEC_KERNEL_THREADS=pool on parts claimed from a shared counter by
// the calling thread and by tasks on XLA's intra-op pool. A pool task that starts after
// every part is claimed does nothing (never touches `outputs`), so the call never waits
// on a thread that is busy elsewhere.
struct Parts {
  std::atomic<int64_t> next{0};
  std::atomic<int64_t> finished{0};
};

// multiple: every part but the last starts and ends at a multiple of it (8, or the int8
// tiles' kInt8TileOutputs).
template <typename OutputRange>
void SplitOutputs(ffi::ThreadPool& pool, int64_t out, const OutputRange& outputs,
                  int64_t multiple = 8) {
  const int64_t num_parts =
      std::max<int64_t>(1, std::min<int64_t>(pool.num_threads(), out / kOutputsPerTask));
  if (num_parts == 1) return outputs(0, out);
  if (UseSpinPool()) return SplitOverHelpers(pool, out, outputs, multiple);
  auto parts = std::make_shared<Parts>();
  const int64_t per_part = (out / num_parts + multiple - 1) / multiple * multiple;
  auto run = [parts, num_parts, per_part, out, &outputs]() {
    for (int64_t p; (p = parts->next.fetch_add(1)) < num_parts;) {
      const int64_t begin = std::min(out, p * per_part);
      const int64_t end = p + 1 == num_parts ? out : std::min(out, begin + per_part);
      outputs(begin, end);
      parts->finished.fetch_add(1, std::memory_order_release);
    }
  };
  for (int64_t t = 1; t < num_parts; ++t) pool.Schedule([run]() { run(); });
  run();
  while (parts->finished.load(std::memory_order_acquire) < num_parts) _mm_pause();
}

// ---- int8 weights and int8 activations (JaxspecFewRowMatmulInt8) ----
// y[n, o] = float(sum_i xq[n, i] * w[o, i]) * scale[o] * xs[n] for int8 w [out, in] with
// a float32 scale per output (jaxspec.model.quantization), where each row of x is
// quantized on the fly: xs[n] = max_i |x[n, i]| / 127 (1 for a zero row) and
// xq[n, i] = round-half-even(x[n, i] / xs[n]). The sums are exact int32 arithmetic, so a
// row's result depends on that row alone: bit-identical whatever rows share the product.
// AVX2: 32 products per maddubs (|xq| as u8 times w with xq's sign; |products| <= 2 * 127
// * 127 never saturate int16), four times the weights per instruction of widening int8
// to float32. On CPU the step of an int8 draft is then bound by memory, not arithmetic.

constexpr int64_t kInt8Lanes = 32;
constexpr int64_t kInt8PaddedTo = 64;  // a multiple of either build's int8 vector bytes
constexpr int64_t kInt8PrefetchBytes = 8192;
constexpr float kInt8Max = 127.0f;

// x's rows quantized to int8, zero-padded to a multiple of kInt8PaddedTo.
struct QuantizedRows {
  int64_t padded = 0;
  std::vector<int8_t> value;  // [rows, padded]
  std::vector<uint8_t> magnitude;  // |value|
  float scale[kMaxRows] = {};
  int32_t total[kMaxRows] = {};  // sum of each row's values (the VNNI path's offset)
  // With activations quantized per `group` inputs (QuantizeGroups; the tiled form only):
  // each group's scale and sum of values, [rows, groups], and the scale / total above
  // unused.
  int64_t group = 0, groups = 0;
  std::vector<float> group_scale;
  std::vector<int32_t> group_total;
};

inline int32_t HorizontalSumInt(__m256i v) {
  __m128i q = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
  q = _mm_add_epi32(q, _mm_shuffle_epi32(q, _MM_SHUFFLE(1, 0, 3, 2)));
  q = _mm_add_epi32(q, _mm_shuffle_epi32(q, _MM_SHUFFLE(2, 3, 0, 1)));
  return _mm_cvtsi128_si32(q);
}

// x[first, last) quantized over its own largest magnitude: *scale = max |x| / 127 (1 for
// zeros), value = round(x / scale) clipped to [-127, 127], magnitude = |value|, *total =
// the values' sum. Vectorized where it can be: _mm256_div_ps divides exactly as the scalar
// division does and _mm256_round_ps rounds half to even as nearbyint does, so every lane
// equals the scalar tail's result (and jaxspec.model.cpu.matmul.quantize_activations).
void QuantizeSpan(const float* x, int64_t first, int64_t last, int8_t* value,
                  uint8_t* magnitude, float* scale_out, int32_t* total_out) {
  const __m256 sign_bit = _mm256_set1_ps(-0.0f);
  const __m256 top = _mm256_set1_ps(kInt8Max), bottom = _mm256_set1_ps(-kInt8Max);
  const int64_t vector_end = first + (last - first) / kLanes * kLanes;
  __m256 peaks = _mm256_setzero_ps();
  for (int64_t i = first; i < vector_end; i += kLanes)
    peaks = _mm256_max_ps(peaks, _mm256_andnot_ps(sign_bit, _mm256_loadu_ps(x + i)));
  float lanes[kLanes];
  _mm256_storeu_ps(lanes, peaks);
  float peak = 0.0f;
  for (float lane : lanes) peak = std::max(peak, lane);
  for (int64_t i = vector_end; i < last; ++i) peak = std::max(peak, std::fabs(x[i]));
  const float scale = peak > 0.0f ? peak / kInt8Max : 1.0f;
  const __m256 scales = _mm256_set1_ps(scale);
  __m256i totals = _mm256_setzero_si256();
  for (int64_t i = first; i < vector_end; i += kLanes) {
    __m256 v = _mm256_round_ps(_mm256_div_ps(_mm256_loadu_ps(x + i), scales),
                               _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    v = _mm256_min_ps(top, _mm256_max_ps(bottom, v));
    const __m256i ints = _mm256_cvtps_epi32(v);
    totals = _mm256_add_epi32(totals, ints);
    alignas(32) int32_t stored[kLanes];
    _mm256_store_si256(reinterpret_cast<__m256i*>(stored), ints);
    for (int64_t k = 0; k < kLanes; ++k) {
      value[i + k] = static_cast<int8_t>(stored[k]);
      magnitude[i + k] = static_cast<uint8_t>(std::abs(stored[k]));
    }
  }
  int32_t total = HorizontalSumInt(totals);
  for (int64_t i = vector_end; i < last; ++i) {
    const float v = std::min(kInt8Max, std::max(-kInt8Max, std::nearbyint(x[i] / scale)));
    value[i] = static_cast<int8_t>(v);
    magnitude[i] = static_cast<uint8_t>(std::fabs(v));
    total += value[i];
  }
  *scale_out = scale;
  *total_out = total;
}

// q's values and magnitudes zeroed for `rows` rows of `in` inputs (padded), in groups of
// `group` inputs (0: one scale a row). The buffers keep their capacity from call to call.
void ResetQuantizedRows(int64_t rows, int64_t in, int64_t group, QuantizedRows* q) {
  q->padded = (in + kInt8PaddedTo - 1) / kInt8PaddedTo * kInt8PaddedTo;
  q->value.assign(rows * q->padded, 0);
  q->magnitude.assign(rows * q->padded, 0);
  q->group = group;
}

// Each row over its own largest magnitude (QuantizeSpan).
void QuantizeRows(const float* x, int64_t rows, int64_t in, QuantizedRows* q) {
  ResetQuantizedRows(rows, in, 0, q);
  for (int64_t m = 0; m < rows; ++m)
    QuantizeSpan(x + m * in, 0, in, &q->value[m * q->padded], &q->magnitude[m * q->padded],
                 &q->scale[m], &q->total[m]);
}

// Each row's inputs in groups of `group` (the last one shorter where in is not a multiple),
// each group over its own largest magnitude: scale = max |x| / 127 over the group (1 for
// a zero group), value = round(x / scale), rounded as QuantizeRows rounds
// (jaxspec.model.cpu.matmul.quantize_activations with a group). Outliers then coarsen
// only their own group's values.
void QuantizeGroups(const float* x, int64_t rows, int64_t in, int64_t group,
                    QuantizedRows* q) {
  ResetQuantizedRows(rows, in, group, q);
  q->groups = (in + group - 1) / group;
  q->group_scale.assign(rows * q->groups, 1.0f);
  q->group_total.assign(rows * q->groups, 0);
  for (int64_t m = 0; m < rows; ++m)
    for (int64_t g = 0; g < q->groups; ++g)
      QuantizeSpan(x + m * in, g * group, std::min(in, (g + 1) * group),
                   &q->value[m * q->padded], &q->magnitude[m * q->padded],
                   &q->group_scale[m * q->groups + g], &q->group_total[m * q->groups + g]);
}

// Whole output blocks at least kInt8PrefetchBytes ahead: one block of int8 rows is a
// quarter of the float32 bytes, too few in flight to hide memory latency.
inline int64_t Int8AheadBytes(int R, int64_t in) {
  const int64_t blocks_ahead = (kInt8PrefetchBytes + R * in - 1) / (R * in);
  return blocks_ahead * R * in;
}

#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
// AVX-512 VNNI: 64 products per dpbusd, which multiplies unsigned by signed bytes: the
// weights are offset to unsigned (w + 128, an exclusive or of the sign bit) and each
// row's sum corrected by 128 times the sum of its values, exact in int32 as the AVX2
// path's sums are, so both builds give every int8 product bit for bit alike.
template <int R, int C, bool kPrefetch>
inline void Int8Block(const QuantizedRows& xq, const int8_t* w, int32_t* sums, int64_t in,
                      int64_t o, int64_t n) {
  constexpr int64_t kBytes = 64;
  const __m512i offset = _mm512_set1_epi8(static_cast<char>(0x80));
  __m512i a[R][C];
  const int8_t* wr[R];
  for (int r = 0; r < R; ++r) wr[r] = w + (o + r) * in;
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < C; ++c) a[r][c] = _mm512_setzero_si512();
  const int64_t ahead = Int8AheadBytes(R, in);
  for (int64_t i = 0; i < in; i += kBytes) {
    if (kPrefetch) {
      for (int r = 0; r < R; ++r)
        _mm_prefetch(reinterpret_cast<const char*>(wr[r] + ahead + i), _MM_HINT_T1);
    }
    // The last chunk of a row is loaded under a mask (zeros past `in`); x is zero-padded,
    // so those lanes add nothing.
    const __mmask64 mask = in - i >= kBytes ? ~__mmask64{0} : (__mmask64{1} << (in - i)) - 1;
    __m512i wv[R];
    for (int r = 0; r < R; ++r)
      wv[r] = _mm512_xor_si512(_mm512_maskz_loadu_epi8(mask, wr[r] + i), offset);
    for (int c = 0; c < C; ++c) {
      const __m512i xv = _mm512_loadu_si512(&xq.value[(n + c) * xq.padded + i]);
      for (int r = 0; r < R; ++r) a[r][c] = _mm512_dpbusd_epi32(a[r][c], wv[r], xv);
    }
  }
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < C; ++c)
      sums[r * kMaxRows + n + c] = _mm512_reduce_add_epi32(a[r][c]) - 128 * xq.total[n + c];
}
#else
// Integer sums of w rows o..o+R-1 against quantized rows n..n+C-1 into
// sums[r * kMaxRows + n + c]; with kPrefetch (the first rows of an output block), the
// weights Int8AheadBytes ahead are fetched into L2 meanwhile.
template <int R, int C, bool kPrefetch>
inline void Int8Block(const QuantizedRows& xq, const int8_t* w, int32_t* sums, int64_t in,
                      int64_t o, int64_t n) {
  const int64_t in32 = in - in % kInt8Lanes;
  const __m256i ones = _mm256_set1_epi16(1);
  __m256i a[R][C];
  const int8_t* wr[R];
  for (int r = 0; r < R; ++r) wr[r] = w + (o + r) * in;
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < C; ++c) a[r][c] = _mm256_setzero_si256();
  const int64_t ahead = Int8AheadBytes(R, in);
  for (int64_t i = 0; i < in32; i += kInt8Lanes) {
    if (kPrefetch && i % kLineBytes == 0) {
      for (int r = 0; r < R; ++r)
        _mm_prefetch(reinterpret_cast<const char*>(wr[r] + ahead + i), _MM_HINT_T1);
    }
    __m256i wv[R];
    for (int r = 0; r < R; ++r) wv[r] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(wr[r] + i));
    for (int c = 0; c < C; ++c) {
      const int64_t at = (n + c) * xq.padded + i;
      const __m256i mag = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(&xq.magnitude[at]));
      const __m256i sgn = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(&xq.value[at]));
      for (int r = 0; r < R; ++r) {
        const __m256i pairs = _mm256_maddubs_epi16(mag, _mm256_sign_epi8(wv[r], sgn));
        a[r][c] = _mm256_add_epi32(a[r][c], _mm256_madd_epi16(pairs, ones));
      }
    }
  }
  for (int r = 0; r < R; ++r) {
    for (int c = 0; c < C; ++c) {
      const int8_t* xv = &xq.value[(n + c) * xq.padded];
      int32_t s = HorizontalSumInt(a[r][c]);
      for (int64_t i = in32; i < in; ++i) s += static_cast<int32_t>(wr[r][i]) * xv[i];
      sums[r * kMaxRows + n + c] = s;
    }
  }
}
#endif

template <int R, int C, bool kPrefetch>
inline void Int8BlockOf(int count, const QuantizedRows& xq, const int8_t* w, int32_t* sums,
                        int64_t in, int64_t o, int64_t n) {
  if constexpr (C > 1) {
    if (count < C) return Int8BlockOf<R, C - 1, kPrefetch>(count, xq, w, sums, in, o, n);
  }
  Int8Block<R, C, kPrefetch>(xq, w, sums, in, o, n);
}

template <int R, int C>
int64_t Int8OutputBlocks(const QuantizedRows& xq, const int8_t* w, const float* scale,
                         float* y, int64_t rows, int64_t in, int64_t out, int64_t o,
                         int64_t end) {
  int32_t sums[R * kMaxRows];
  for (; o + R <= end; o += R) {
    for (int64_t n = 0; n < rows;) {
      const int count = static_cast<int>(std::min<int64_t>(C, rows - n));
      if (n == 0) {
        Int8BlockOf<R, C, true>(count, xq, w, sums, in, o, n);
      } else {
        Int8BlockOf<R, C, false>(count, xq, w, sums, in, o, n);
      }
      n += count;
    }
    for (int r = 0; r < R; ++r)
      for (int64_t m = 0; m < rows; ++m)
        y[m * out + o + r] = static_cast<float>(sums[r * kMaxRows + m]) * scale[o + r] *
                             xq.scale[m];
  }
  return o;
}

// Register blocks (outputs x rows) for 3+ rows: 2 x 4 with AVX2, 4 x 5 with VNNI.
#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
constexpr int kInt8ManyRowsR = 4, kInt8ManyRowsC = 5;
#else
constexpr int kInt8ManyRowsR = 2, kInt8ManyRowsC = 4;
#endif
void Int8Outputs(const QuantizedRows& xq, const int8_t* w, const float* scale, float* y,
                 int64_t rows, int64_t in, int64_t out, int64_t begin, int64_t end) {
  int64_t o = begin;
  if (rows == 1) {
    o = Int8OutputBlocks<4, 1>(xq, w, scale, y, rows, in, out, o, end);
  } else if (rows == 2) {
    o = Int8OutputBlocks<4, 2>(xq, w, scale, y, rows, in, out, o, end);
  } else {
    o = Int8OutputBlocks<kInt8ManyRowsR, kInt8ManyRowsC>(xq, w, scale, y, rows, in, out, o,
                                                         end);
  }
  Int8OutputBlocks<1, 1>(xq, w, scale, y, rows, in, out, o, end);
}

// ---- Tiled int8 weights: outputs in the vector lanes ----
// w [out / 64, in / 4, 64, 4] (jaxspec.model.quantization.tile_int8): tile t holds outputs
// 64t..64t+63, and for each group of 4 inputs their 4 weights of each output side by
// side, so one 64-byte vector holds 16 outputs x 4 inputs and one dpbusd adds 4
// products to each of 16 outputs' sums, with x's 4 values broadcast: no sum across
// lanes at the end, which in the [out, in] form costs as much as the products over an
// input of 512. A tile is 64 * in contiguous bytes, read once per C rows. The sums are
// the same exact int32 sums, so the results equal the [out, in] form's bit for bit.
constexpr int64_t kInt8TileOutputs = 64;
constexpr int64_t kInt8TileInputs = 4;

#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
constexpr bool kInt8Tiles = true;

// Adds to a[t][r][c] the products of T tiles' input groups [first, last) (4 inputs a group)
// with rows n..n+C-1, the weights offset to unsigned; each group's weights fetched
// kInt8PrefetchBytes ahead.
template <int C, int T>
inline void Int8TileSums(const QuantizedRows& xq, const int8_t* tile, int64_t in,
                         int64_t first, int64_t last, int64_t n,
                         __m512i (&a)[T][kInt8TileOutputs / 16][C]) {
  constexpr int R = kInt8TileOutputs / 16;
  const __m512i offset = _mm512_set1_epi8(static_cast<char>(0x80));
  const int64_t tile_bytes = kInt8TileOutputs * in;
  constexpr int64_t ahead = kInt8PrefetchBytes;
  for (int64_t g = first; g < last; ++g) {
    const int8_t* wg = tile + g * kInt8TileOutputs * kInt8TileInputs;
    __m512i wv[T][R];
    for (int t = 0; t < T; ++t)
      for (int r = 0; r < R; ++r) {
        _mm_prefetch(reinterpret_cast<const char*>(wg + t * tile_bytes + ahead + 64 * r),
                     _MM_HINT_T1);
        wv[t][r] = _mm512_xor_si512(_mm512_loadu_si512(wg + t * tile_bytes + 64 * r), offset);
      }
    for (int c = 0; c < C; ++c) {
      int32_t x4;
      std::memcpy(&x4, &xq.value[(n + c) * xq.padded + g * kInt8TileInputs], sizeof(x4));
      const __m512i xv = _mm512_set1_epi32(x4);
      for (int t = 0; t < T; ++t)
        for (int r = 0; r < R; ++r) a[t][r][c] = _mm512_dpbusd_epi32(a[t][r][c], wv[t][r], xv);
    }
  }
}

// Outputs of T tiles from output o (64 T of them, 4 vectors a tile) for rows n..n+C-1
// into y: the tiles' bytes stream side by side (T > 1 for a single row, whose few
// products per byte leave memory the limit).
template <int C, int T>
inline void Int8TileRows(const QuantizedRows& xq, const int8_t* tile, const float* scale,
                         float* y, int64_t in, int64_t out, int64_t o, int64_t n) {
  constexpr int R = kInt8TileOutputs / 16;
  __m512i a[T][R][C];
  for (int t = 0; t < T; ++t)
    for (int r = 0; r < R; ++r)
      for (int c = 0; c < C; ++c) a[t][r][c] = _mm512_setzero_si512();
  Int8TileSums<C, T>(xq, tile, in, 0, in / kInt8TileInputs, n, a);
  for (int c = 0; c < C; ++c) {
    const __m512i correction = _mm512_set1_epi32(128 * xq.total[n + c]);
    const __m512 row_scale = _mm512_set1_ps(xq.scale[n + c]);
    for (int t = 0; t < T; ++t)
      for (int r = 0; r < R; ++r) {
        const int64_t first = o + t * kInt8TileOutputs + 16 * r;
        const __m512 sums = _mm512_cvtepi32_ps(_mm512_sub_epi32(a[t][r][c], correction));
        // (float(sum) * scale[o]) * xs[n], as the [out, in] form rounds it.
        const __m512 values =
            _mm512_mul_ps(_mm512_mul_ps(sums, _mm512_loadu_ps(scale + first)), row_scale);
        _mm512_storeu_ps(y + (n + c) * out + first, values);
      }
  }
}

// Int8TileRows with activations quantized per group (QuantizeGroups): each group's exact
// int32 sums, corrected for the offset, are converted to float and added times the
// group's scale, in the order of the groups (one fused multiply-add each); the outputs
// are those sums times scale[o]. Blocks as Int8TileRows's (5 rows, or 1 row over 2 tiles).
template <int C, int T>
inline void Int8TileRowsGrouped(const QuantizedRows& xq, const int8_t* tile,
                                const float* scale, float* y, int64_t in, int64_t out,
                                int64_t o, int64_t n) {
  constexpr int R = kInt8TileOutputs / 16;
  // The float sums live in memory (touched once a group), leaving the registers to the
  // integer sums and the weights.
  alignas(64) float f[T][R][C][16] = {};
  const int64_t quads = in / kInt8TileInputs, quads_a_group = xq.group / kInt8TileInputs;
  for (int64_t first = 0, k = 0; first < quads; first += quads_a_group, ++k) {
    const int64_t last = std::min(quads, first + quads_a_group);
    // Each group's sums start at minus its offset's correction (128 times the sum of its
    // values), so that they end exact.
    __m512i a[T][R][C];
    for (int c = 0; c < C; ++c) {
      const __m512i start = _mm512_set1_epi32(-128 * xq.group_total[(n + c) * xq.groups + k]);
      for (int t = 0; t < T; ++t)
        for (int r = 0; r < R; ++r) a[t][r][c] = start;
    }
    Int8TileSums<C, T>(xq, tile, in, first, last, n, a);
    for (int c = 0; c < C; ++c) {
      const __m512 group_scale = _mm512_set1_ps(xq.group_scale[(n + c) * xq.groups + k]);
      for (int t = 0; t < T; ++t)
        for (int r = 0; r < R; ++r)
          _mm512_store_ps(f[t][r][c], _mm512_fmadd_ps(_mm512_cvtepi32_ps(a[t][r][c]), group_scale,
                                                      _mm512_load_ps(f[t][r][c])));
    }
  }
  for (int c = 0; c < C; ++c)
    for (int t = 0; t < T; ++t)
      for (int r = 0; r < R; ++r) {
        const int64_t first = o + t * kInt8TileOutputs + 16 * r;
        _mm512_storeu_ps(y + (n + c) * out + first,
                         _mm512_mul_ps(_mm512_load_ps(f[t][r][c]), _mm512_loadu_ps(scale + first)));
      }
}

// The row kernel for the activations' quantization: per group (Int8TileRowsGrouped) or
// one scale a row (Int8TileRows).
template <bool Grouped, int C, int T>
inline void Int8TileRowsFor(const QuantizedRows& xq, const int8_t* tile, const float* scale,
                            float* y, int64_t in, int64_t out, int64_t o, int64_t n) {
  if constexpr (Grouped) {
    Int8TileRowsGrouped<C, T>(xq, tile, scale, y, in, out, o, n);
  } else {
    Int8TileRows<C, T>(xq, tile, scale, y, in, out, o, n);
  }
}

// Int8TileRowsFor over `count` <= C rows from row n.
template <bool Grouped, int C>
inline void Int8TileRowsOf(int count, const QuantizedRows& xq, const int8_t* tile,
                           const float* scale, float* y, int64_t in, int64_t out, int64_t o,
                           int64_t n) {
  if constexpr (C > 1) {
    if (count < C)
      return Int8TileRowsOf<Grouped, C - 1>(count, xq, tile, scale, y, in, out, o, n);
  }
  Int8TileRowsFor<Grouped, C, 1>(xq, tile, scale, y, in, out, o, n);
}

template <bool Grouped>
void Int8TiledOutputsFor(const QuantizedRows& xq, const int8_t* w, const float* scale,
                         float* y, int64_t rows, int64_t in, int64_t out, int64_t begin,
                         int64_t end) {
  constexpr int C = 5;  // 4 x 5 accumulators and 4 weight vectors of the 32 registers
  int64_t o = begin;
  if (rows == 1) {  // two tiles side by side: one tile alone streamed ~10% slower
    for (; o + 2 * kInt8TileOutputs <= end; o += 2 * kInt8TileOutputs)
      Int8TileRowsFor<Grouped, 1, 2>(xq, w + o * in, scale, y, in, out, o, 0);
  }
  for (; o < end; o += kInt8TileOutputs) {
    for (int64_t n = 0; n < rows; n += C)
      Int8TileRowsOf<Grouped, C>(static_cast<int>(std::min<int64_t>(C, rows - n)), xq,
                                 w + o * in, scale, y, in, out, o, n);
  }
}

// Outputs [begin, end) (multiples of kInt8TileOutputs) of tiled w for every row.
void Int8TiledOutputs(const QuantizedRows& xq, const int8_t* w, const float* scale, float* y,
                      int64_t rows, int64_t in, int64_t out, int64_t begin, int64_t end) {
  if (xq.group > 0) {  // activations quantized per group
    Int8TiledOutputsFor<true>(xq, w, scale, y, rows, in, out, begin, end);
  } else {
    Int8TiledOutputsFor<false>(xq, w, scale, y, rows, in, out, begin, end);
  }
}
#else
constexpr bool kInt8Tiles = false;  // jaxspec.model.cpu.matmul tiles for AVX-512 VNNI only

void Int8TiledOutputs(const QuantizedRows&, const int8_t*, const float*, float*, int64_t,
                      int64_t, int64_t, int64_t, int64_t) {}
#endif


// ---- Tiled float32 weights: outputs in the vector lanes ----
// w [out / 16, in, 16] (jaxspec.model.cpu.matmul.tile_kernel): tile t holds outputs
// 16t..16t+15 and, for each input i, their 16 weights side by side, so one vector holds
// 16 outputs' weights of one input and one FMA adds x[n, i] times them to 16 outputs'
// sums, x[n, i] broadcast. Each output has one accumulator lane, summed over i in input
// order (one FMA an input), whatever the rows, the register blocks or the thread split:
// row n of a k-row product is bit-identical to the one-row product of x[n]. No sum across
// lanes, and each weight vector is loaded once for up to 12 rows, so a verify step's
// rows cost less compute than the [out, in] form's (results/kernels/
// float32_lanes_prototype.json). The sums differ from the [out, in] form's by float32
// rounding (another order of summation).
constexpr int64_t kFloatTileOutputs = 16;
#if defined(__AVX512F__)
constexpr bool kFloatTiles = true;
// Lines of a tile's stream fetched ahead of its loads (2 KB): the hardware's prefetch
// alone left the stream short of memory's bandwidth at 5-10 rows.
constexpr int64_t kTilePrefetchInputs = 32;

// y[n + c, 16 (t + r) + l] for r < R, c < C: R tiles against rows n..n+C-1 of x.
template <int R, int C>
inline void TileBlock(const float* x, const float* tiles, float* y, int64_t in, int64_t out,
                      int64_t t, int64_t n) {
  __m512 acc[R][C];
  const float* tile[R];
  const float* xc[C];
  for (int r = 0; r < R; ++r) tile[r] = tiles + (t + r) * in * kFloatTileOutputs;
  for (int c = 0; c < C; ++c) xc[c] = x + (n + c) * in;
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < C; ++c) acc[r][c] = _mm512_setzero_ps();
  for (int64_t i = 0; i < in; ++i) {
    __m512 w[R];
    for (int r = 0; r < R; ++r) {
      // Prefetches never fault: past a tile's end they fetch the next tile's lines.
      _mm_prefetch(reinterpret_cast<const char*>(
                       tile[r] + (i + kTilePrefetchInputs) * kFloatTileOutputs),
                   _MM_HINT_T0);
      w[r] = _mm512_loadu_ps(tile[r] + i * kFloatTileOutputs);
    }
    for (int c = 0; c < C; ++c) {
      const __m512 xv = _mm512_set1_ps(xc[c][i]);
      for (int r = 0; r < R; ++r) acc[r][c] = _mm512_fmadd_ps(w[r], xv, acc[r][c]);
    }
  }
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < C; ++c)
      _mm512_storeu_ps(y + (n + c) * out + (t + r) * kFloatTileOutputs, acc[r][c]);
}

// TileBlock<R, count> for count in 1..C.
template <int R, int C>
inline void TileBlockOf(int count, const float* x, const float* tiles, float* y, int64_t in,
                        int64_t out, int64_t t, int64_t n) {
  if constexpr (C > 1) {
    if (count < C) return TileBlockOf<R, C - 1>(count, x, tiles, y, in, out, t, n);
  }
  TileBlock<R, C>(x, tiles, y, in, out, t, n);
}

// Tiles [begin, end) of R at a time against every row, in passes of (nearly) equal size
// of at most C rows each.
template <int R, int C>
int64_t TileBlocks(const float* x, const float* tiles, float* y, int64_t rows, int64_t in,
                   int64_t out, int64_t t, int64_t end) {
  const int64_t passes = (rows + C - 1) / C;
  const int64_t per_pass = (rows + passes - 1) / passes;
  for (; t + R <= end; t += R)
    for (int64_t n = 0; n < rows; n += per_pass)
      TileBlockOf<R, C>(static_cast<int>(std::min(per_pass, rows - n)), x, tiles, y, in, out,
                        t, n);
  return t;
}

// y[:, 16 begin..16 end) for all rows. The register blocks (tiles x rows) were the
// fastest measured: 8 x 1 for one row (eight sums in flight hide the FMA's latency),
// 4 x 6 for 2..6 rows, 2 x 12 for more (a 10-position verify step in one pass).
void TiledOutputs(const float* x, const float* tiles, float* y, int64_t rows, int64_t in,
                  int64_t out, int64_t begin, int64_t end) {
  int64_t t = begin;
  if (rows == 1) {
    t = TileBlocks<8, 1>(x, tiles, y, rows, in, out, t, end);
  } else if (rows <= 6) {
    t = TileBlocks<4, 6>(x, tiles, y, rows, in, out, t, end);
  } else {
    t = TileBlocks<2, 12>(x, tiles, y, rows, in, out, t, end);
  }
  TileBlocks<1, 12>(x, tiles, y, rows, in, out, t, end);
}
#else
constexpr bool kFloatTiles = false;  // jaxspec.model.cpu.matmul tiles for AVX-512 only
void TiledOutputs(const float*, const float*, float*, int64_t, int64_t, int64_t, int64_t,
                  int64_t) {}
#endif

// ---- One or several weight matrices against the same rows (JaxspecFewRowMatmul,
// JaxspecFewRowMatmul2/3 and their int8 forms) ----
// A layer's query, key and value projections, and the MLP's two input projections, read
// the same activations: one call computes them all, their outputs taken end to end and
// split among the threads like one product's. Every output is computed exactly as in a
// call of its own (outputs never depend on each other), so the results equal separate
// calls bit for bit; a decode step saves a call and a thread hand-off per extra matrix,
// and the int8 form quantizes the rows once.

// f(k, begin, end) for the part of outputs [begin, end) of the concatenation that falls
// in matrix k (outputs [offset_k, offset_k + out[k])), in matrix k's own numbering.
template <int N, typename PerMatrix>
void OverMatrices(const int64_t (&out)[N], int64_t begin, int64_t end, const PerMatrix& f) {
  int64_t offset = 0;
  for (int k = 0; k < N; ++k) {
    const int64_t first = std::max(begin, offset), last = std::min(end, offset + out[k]);
    if (first < last) f(k, first - offset, last - offset);
    offset += out[k];
  }
}

// ---- Rows that need no product ----
// Every handler takes `active` (int32 [rows], nonzero: compute the row): a decode step of a
// batch whose rows have ended computes only the rows still decoding, their outputs
// exactly as in a product of all rows (a row's result depends on its own values alone),
// the others' zeros. Once the products are compute-bound (several rows, each over the
// step's positions) a finished row then costs nothing.
// Each handler keeps one per thread (thread_local, as OnActiveRows' buffers), so a call
// allocates nothing once its thread has seen as many rows.
struct ActiveRows {
  int64_t count = 0;
  std::vector<int64_t> index;  // computed row i is row index[i] of x and y
};

// Whether every row is active; else the active ones in `active_rows`.
bool AllActive(const int32_t* active, int64_t rows, ActiveRows* active_rows) {
  active_rows->count = 0;
  active_rows->index.resize(rows);
  for (int64_t n = 0; n < rows; ++n)
    if (active[n] != 0) active_rows->index[active_rows->count++] = n;
  return active_rows->count == rows;
}

// compute(x rows [count, in], count, y[k] [count, out[k]]) on the active rows of xp, its
// outputs in y's rows and zeros in the others. Active rows that follow one another (a
// verify step's positions up to a row's last proposed one, at batch 1) are computed where
// they stand; others are gathered, computed and scattered.
template <int N, typename Compute>
void OnActiveRows(const ActiveRows& active_rows, const float* xp, int64_t rows, int64_t in,
                  const int64_t (&out)[N], float* const (&y)[N], const Compute& compute) {
  const int64_t count = active_rows.count;
  const int64_t first = count > 0 ? active_rows.index[0] : 0;
  if (count > 0 && active_rows.index[count - 1] == first + count - 1) {
    float* y_run[N];
    for (int k = 0; k < N; ++k) y_run[k] = y[k] + first * out[k];
    compute(xp + first * in, count, y_run);
    for (int k = 0; k < N; ++k) {
      std::fill(y[k], y_run[k], 0.0f);
      std::fill(y_run[k] + count * out[k], y[k] + rows * out[k], 0.0f);
    }
    return;
  }
  thread_local std::vector<float> x_rows, y_rows[N];
  x_rows.resize(count * in);
  for (int64_t i = 0; i < count; ++i)
    std::memcpy(&x_rows[i * in], xp + active_rows.index[i] * in, in * sizeof(float));
  float* y_ptrs[N];
  for (int k = 0; k < N; ++k) {
    y_rows[k].resize(count * out[k]);
    y_ptrs[k] = y_rows[k].data();
  }
  if (count > 0) compute(x_rows.data(), count, y_ptrs);
  for (int k = 0; k < N; ++k) {
    for (int64_t n = 0, i = 0; n < rows; ++n) {
      float* row = y[k] + n * out[k];
      if (i < count && active_rows.index[i] == n) {
        std::memcpy(row, &y_rows[k][i++ * out[k]], out[k] * sizeof(float));
      } else {
        std::fill(row, row + out[k], 0.0f);
      }
    }
  }
}

// More than kMaxRows rows run as groups of nearly equal size, one product each over a
// thread's outputs (its weights then in cache for the next group): a row's result never
// depends on the other rows, so every row is its one-row product's bit for bit whatever
// the rows (a decode step of any width; jaxspec.model.cpu.matmul.decode_step).
template <int N>
void ComputeMatmuls(ffi::ThreadPool& pool, const float* xp, int64_t rows, int64_t in,
                    const float* const (&w)[N], const int64_t (&out)[N], float* const (&y)[N],
                    bool tiled = false) {
  int64_t total = 0;
  for (int k = 0; k < N; ++k) total += out[k];
  const int64_t groups = (rows + kMaxRows - 1) / kMaxRows;
  const int64_t per_group = (rows + groups - 1) / groups;
  SplitOutputs(pool, total, [&](int64_t begin, int64_t end) {
    OverMatrices<N>(out, begin, end, [&](int k, int64_t first, int64_t last) {
      for (int64_t n = 0; n < rows; n += per_group) {
        const int64_t count = std::min(per_group, rows - n);
        if (tiled) {
          TiledOutputs(xp + n * in, w[k], y[k] + n * out[k], count, in, out[k],
                       first / kFloatTileOutputs, last / kFloatTileOutputs);
        } else {
          Outputs(xp + n * in, w[k], y[k] + n * out[k], count, in, out[k], first, last);
        }
      }
    });
  }, tiled ? kFloatTileOutputs : 8);
}

// The float32 matrices' outputs and input: all [out_k, in], or all tiled
// [out_k / 16, in, 16] (the AVX-512 build only).
template <int N>
ffi::Error FloatShapes(const ffi::Buffer<ffi::F32>* const (&w)[N], int64_t (&out)[N],
                       int64_t* in, bool* tiled) {
  *tiled = w[0]->dimensions().size() == 3;
  for (int k = 0; k < N; ++k) {
    const ffi::Span<const int64_t> dims = w[k]->dimensions();
    if (!*tiled) {
      if (dims.size() != 2) return ffi::Error::InvalidArgument("w must be [out, in] or tiled");
      out[k] = dims[0];
    } else {
      if (!kFloatTiles)
        return ffi::Error::InvalidArgument("tiled float32 weights need the AVX-512 build");
      if (dims.size() != 3 || dims[2] != kFloatTileOutputs)
        return ffi::Error::InvalidArgument("tiled w must be [out / 16, in, 16]");
      out[k] = dims[0] * kFloatTileOutputs;
    }
    if (k == 0) *in = dims[1];
    if (dims[1] != *in) return ffi::Error::InvalidArgument("the matrices' inputs differ");
  }
  return ffi::Error::Success();
}

template <int N>
ffi::Error ManyMatmuls(ffi::ThreadPool& pool, const ffi::Buffer<ffi::F32>& x,
                       const ffi::Buffer<ffi::F32>* const (&w)[N],
                       const ffi::Buffer<ffi::S32>& active,
                       ffi::ResultBuffer<ffi::F32>* const (&y)[N]) {
  int64_t out[N], in = 0;
  bool tiled = false;
  if (ffi::Error error = FloatShapes<N>(w, out, &in, &tiled); error.failure()) return error;
  const ffi::Span<const int64_t> x_dims = x.dimensions();
  if (x_dims.size() < 1 || x_dims.back() != in)
    return ffi::Error::InvalidArgument("x [..., in] does not match w's in");
  const int64_t rows = in == 0 ? 0 : x.element_count() / in;
  if (active.element_count() != rows)
    return ffi::Error::InvalidArgument("active must hold one flag per row of x");
  float* y_ptrs[N];
  const float* w_ptrs[N];
  for (int k = 0; k < N; ++k) {
    y_ptrs[k] = (*y[k])->typed_data();
    w_ptrs[k] = w[k]->typed_data();
    if (in == 0) std::fill(y_ptrs[k], y_ptrs[k] + rows * out[k], 0.0f);
  }
  if (in == 0) return ffi::Error::Success();
  thread_local ActiveRows active_rows;
  if (AllActive(active.typed_data(), rows, &active_rows)) {
    ComputeMatmuls<N>(pool, x.typed_data(), rows, in, w_ptrs, out, y_ptrs, tiled);
  } else {
    OnActiveRows<N>(active_rows, x.typed_data(), rows, in, out, y_ptrs,
                    [&](const float* xp, int64_t count, float* const (&yp)[N]) {
                      ComputeMatmuls<N>(pool, xp, count, in, w_ptrs, out, yp, tiled);
                    });
  }
  return ffi::Error::Success();
}

template <int N>
void ComputeMatmulsInt8(ffi::ThreadPool& pool, const float* xp, int64_t rows, int64_t in,
                        const int8_t* const (&w)[N], const float* const (&scale)[N],
                        const int64_t (&out)[N], float* const (&y)[N], bool tiled,
                        int64_t group) {
  // The calling thread's buffers, reused: every part that reads them finishes before
  // this call returns (a pool task that starts later claims no part and reads nothing).
  // The helpers reach them through this pointer (a thread_local named inside the lambda
  // would be each helper's own).
  thread_local QuantizedRows quantized;
  const QuantizedRows* xq = &quantized;
  if (group > 0) {
    QuantizeGroups(xp, rows, in, group, &quantized);
  } else {
    QuantizeRows(xp, rows, in, &quantized);
  }
  int64_t total = 0;
  for (int k = 0; k < N; ++k) total += out[k];
  SplitOutputs(pool, total, [&](int64_t begin, int64_t end) {
    OverMatrices<N>(out, begin, end, [&](int k, int64_t first, int64_t last) {
      if (tiled) {
        Int8TiledOutputs(*xq, w[k], scale[k], y[k], rows, in, out[k], first, last);
      } else {
        Int8Outputs(*xq, w[k], scale[k], y[k], rows, in, out[k], first, last);
      }
    });
  }, tiled ? kInt8TileOutputs : 8);
}

// The int8 matrices' outputs and input (all [out_k, in], or all tiled [out_k / 64, in / 4,
// 64, 4]) and the rows of x [..., in].
template <int N>
ffi::Error Int8Shapes(const ffi::Buffer<ffi::F32>& x, const ffi::Buffer<ffi::S8>* const (&w)[N],
                      int64_t (&out)[N], int64_t* in, int64_t* rows, bool* tiled) {
  *tiled = w[0]->dimensions().size() == 4;
  for (int k = 0; k < N; ++k) {
    const ffi::Span<const int64_t> dims = w[k]->dimensions();
    if (!*tiled) {
      if (dims.size() != 2) return ffi::Error::InvalidArgument("w must be [out, in] or tiled");
      out[k] = dims[0];
      if (k == 0) *in = dims[1];
      if (dims[1] != *in) return ffi::Error::InvalidArgument("the matrices' inputs differ");
      continue;
    }
    if (!kInt8Tiles)
      return ffi::Error::InvalidArgument("tiled int8 weights need the AVX-512 VNNI build");
    if (dims.size() != 4 || dims[2] != kInt8TileOutputs || dims[3] != kInt8TileInputs)
      return ffi::Error::InvalidArgument("tiled int8 w must be [out / 64, in / 4, 64, 4]");
    out[k] = dims[0] * kInt8TileOutputs;
    if (k == 0) *in = dims[1] * kInt8TileInputs;
    if (dims[1] * kInt8TileInputs != *in)
      return ffi::Error::InvalidArgument("the matrices' inputs differ");
  }
  const ffi::Span<const int64_t> x_dims = x.dimensions();
  if (x_dims.size() < 1 || x_dims.back() != *in)
    return ffi::Error::InvalidArgument("x [..., in] does not match w's in");
  *rows = *in == 0 ? 0 : x.element_count() / *in;
  if (*rows > kMaxRows) return ffi::Error::InvalidArgument("x has more than 128 rows (kMaxRows)");
  return ffi::Error::Success();
}

template <int N>
ffi::Error ManyMatmulsInt8(ffi::ThreadPool& pool, const ffi::Buffer<ffi::F32>& x,
                           const ffi::Buffer<ffi::S8>* const (&w)[N],
                           const ffi::Buffer<ffi::F32>* const (&scale)[N],
                           const ffi::Buffer<ffi::S32>& active,
                           ffi::ResultBuffer<ffi::F32>* const (&y)[N], int64_t group) {
  int64_t out[N], in = 0, rows = 0;
  bool tiled = false;
  if (ffi::Error error = Int8Shapes<N>(x, w, out, &in, &rows, &tiled); error.failure())
    return error;
  if (group != 0 && (!tiled || group < 0 || group % kInt8TileInputs != 0))
    return ffi::Error::InvalidArgument(
        "activation_group must be 0, or a positive multiple of 4 with tiled weights");
  if (active.element_count() != rows)
    return ffi::Error::InvalidArgument("active must hold one flag per row of x");
  float* y_ptrs[N];
  const int8_t* w_ptrs[N];
  const float* scale_ptrs[N];
  for (int k = 0; k < N; ++k) {
    if (scale[k]->element_count() != out[k])
      return ffi::Error::InvalidArgument("scale must be [out] for w [out, in]");
    y_ptrs[k] = (*y[k])->typed_data();
    w_ptrs[k] = w[k]->typed_data();
    scale_ptrs[k] = scale[k]->typed_data();
    if (in == 0) std::fill(y_ptrs[k], y_ptrs[k] + rows * out[k], 0.0f);
  }
  if (in == 0) return ffi::Error::Success();
  thread_local ActiveRows active_rows;
  if (AllActive(active.typed_data(), rows, &active_rows)) {
    ComputeMatmulsInt8<N>(pool, x.typed_data(), rows, in, w_ptrs, scale_ptrs, out, y_ptrs,
                          tiled, group);
  } else {
    OnActiveRows<N>(active_rows, x.typed_data(), rows, in, out, y_ptrs,
                    [&](const float* xp, int64_t count, float* const (&yp)[N]) {
                      ComputeMatmulsInt8<N>(pool, xp, count, in, w_ptrs, scale_ptrs, out, yp,
                                            tiled, group);
                    });
  }
  return ffi::Error::Success();
}

ffi::Error FewRowMatmul(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x,
                        ffi::Buffer<ffi::F32> w, ffi::Buffer<ffi::S32> active,
                        ffi::ResultBuffer<ffi::F32> y) {
  return ManyMatmuls<1>(pool, x, {&w}, active, {&y});
}

ffi::Error FewRowMatmulInt8(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x,
                            ffi::Buffer<ffi::S8> w, ffi::Buffer<ffi::F32> scale,
                            ffi::Buffer<ffi::S32> active, ffi::ResultBuffer<ffi::F32> y,
                            int64_t activation_group) {
  return ManyMatmulsInt8<1>(pool, x, {&w}, {&scale}, active, {&y}, activation_group);
}

ffi::Error FewRowMatmul2(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x,
                         ffi::Buffer<ffi::F32> w0, ffi::Buffer<ffi::F32> w1,
                         ffi::Buffer<ffi::S32> active, ffi::ResultBuffer<ffi::F32> y0,
                         ffi::ResultBuffer<ffi::F32> y1) {
  return ManyMatmuls<2>(pool, x, {&w0, &w1}, active, {&y0, &y1});
}

ffi::Error FewRowMatmul3(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x,
                         ffi::Buffer<ffi::F32> w0, ffi::Buffer<ffi::F32> w1,
                         ffi::Buffer<ffi::F32> w2, ffi::Buffer<ffi::S32> active,
                         ffi::ResultBuffer<ffi::F32> y0, ffi::ResultBuffer<ffi::F32> y1,
                         ffi::ResultBuffer<ffi::F32> y2) {
  return ManyMatmuls<3>(pool, x, {&w0, &w1, &w2}, active, {&y0, &y1, &y2});
}

ffi::Error FewRowMatmulInt8x2(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x,
                              ffi::Buffer<ffi::S8> w0, ffi::Buffer<ffi::F32> s0,
                              ffi::Buffer<ffi::S8> w1, ffi::Buffer<ffi::F32> s1,
                              ffi::Buffer<ffi::S32> active, ffi::ResultBuffer<ffi::F32> y0,
                              ffi::ResultBuffer<ffi::F32> y1, int64_t activation_group) {
  return ManyMatmulsInt8<2>(pool, x, {&w0, &w1}, {&s0, &s1}, active, {&y0, &y1},
                            activation_group);
}

ffi::Error FewRowMatmulInt8x3(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x,
                              ffi::Buffer<ffi::S8> w0, ffi::Buffer<ffi::F32> s0,
                              ffi::Buffer<ffi::S8> w1, ffi::Buffer<ffi::F32> s1,
                              ffi::Buffer<ffi::S8> w2, ffi::Buffer<ffi::F32> s2,
                              ffi::Buffer<ffi::S32> active, ffi::ResultBuffer<ffi::F32> y0,
                              ffi::ResultBuffer<ffi::F32> y1, ffi::ResultBuffer<ffi::F32> y2,
                              int64_t activation_group) {
  return ManyMatmulsInt8<3>(pool, x, {&w0, &w1, &w2}, {&s0, &s1, &s2}, active,
                            {&y0, &y1, &y2}, activation_group);
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxspecFewRowMatmul, FewRowMatmul,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()  // active
                                  .Ret<ffi::Buffer<ffi::F32>>());

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxspecFewRowMatmulInt8, FewRowMatmulInt8,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::S8>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()  // active
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Attr<int64_t>("activation_group"));

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxspecFewRowMatmul2, FewRowMatmul2,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()  // active
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>());

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxspecFewRowMatmul3, FewRowMatmul3,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()  // active
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>());

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxspecFewRowMatmulInt8x2, FewRowMatmulInt8x2,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::S8>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::S8>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()  // active
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Attr<int64_t>("activation_group"));

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxspecFewRowMatmulInt8x3, FewRowMatmulInt8x3,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::S8>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::S8>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::S8>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()  // active
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Attr<int64_t>("activation_group"));
