// jaxspec's CPU kernel for a decode step's attention over the cache, as XLA FFI handlers
// (JaxspecCachedAttention; JaxspecCachedAttentionWrite, which first writes the step's
// keys/values into the cache in place): for each batch row b, head h and query i,
//   out[b, i, h] = sum_s softmax_s(q[b, i, h] . k[b, h, :, s] + bias[b, h|0, i, s]) v[b, h, :, s]
// over the first num_keys[b] key slots only, with keys and values in the cache layout
// [b, h, d, L] (jaxspec.model.cache) and T5's additive mask in `bias` (no 1/sqrt(d)); a
// query whose flag in `active` [b, t] is 0 (a row that ended, a position past a row's
// proposal: jaxspec.model.cpu.matmul.active_rows) gets zeros and writes nothing.
//
// A decode step attends over a cache buffer of max_decode_length + gamma slots, most of
// them past the decoded prefix; XLA computes all of them, with one dot, softmax and dot
// per attention (10-30 us each on the 2-core CPU, as much as a weight product of the
// draft's step). This kernel reads only the prefix (jaxspec.model.cpu.attention).
//
// Exactness: each query's logits, maximum, weights and weighted sums are computed lane
// by lane (slot s in lane s % kVecLanes), over slot blocks in increasing order, then
// summed across lanes in a fixed order; a query never reads another query's values.
// Slots that a query's bias masks (<= kExpFloor after the shift) weigh exactly 0, so
// reading more slots than a query sees adds exact zeros: a query's output is bit-identical
// whatever the other queries of the step and whatever num_keys, as long as num_keys
// covers every slot it sees. A verify step's rows thus equal the baseline's one-row steps.
#include <algorithm>
#include <cstdint>
#include <cstring>
#include <limits>
#include <type_traits>
#include <vector>

#include "float_vectors.h"
#include "spin_pool.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

using jaxspec_kernels::Add;
using jaxspec_kernels::Broadcast;
using jaxspec_kernels::Div;
using jaxspec_kernels::ExpNonPositive;
using jaxspec_kernels::Fma;
using jaxspec_kernels::HorizontalMax;
using jaxspec_kernels::HorizontalSum;
using jaxspec_kernels::KeepFirst;
using jaxspec_kernels::kVecLanes;
using jaxspec_kernels::Load;
using jaxspec_kernels::LoadFirst;
using jaxspec_kernels::Max;
using jaxspec_kernels::Store;
using jaxspec_kernels::SumEachVector;
using jaxspec_kernels::Sub;
using jaxspec_kernels::Vec;
using jaxspec_kernels::Zero;

constexpr int kBlocksAtOnce = 4;  // Slot blocks whose logits accumulate together ...
constexpr int kPartials = 4;  // ... each over head dims d % kPartials apart, then added.
constexpr float kMinusInfinity = -std::numeric_limits<float>::infinity();

struct Shapes {
  int64_t batch, queries, heads, head_dim, slots, bias_heads;
};

// Biased logits of the kCount slot blocks from `first` (lanes past n: -inf) into
// weights; returns their lane-wise maximum. kCount is a template argument and every loop
// over the accumulators unrolled, so that the kCount x kPartials accumulators stay in
// registers: GCC keeps an array in registers only when every access has a constant index
// (with a loop left rolled it stored each accumulator at every step of the loop over d:
// a call up to ~1.2-1.4x slower, results/kernels/cached_attention_unrolled.json).
#define JAXSPEC_UNROLL _Pragma("GCC unroll 16")
template <int kCount>
Vec Logits(const float* q, const float* keys, const float* bias, int64_t head_dim,
           int64_t slots, int64_t n, int64_t first, float* weights) {
  Vec partial[kCount][kPartials];
  JAXSPEC_UNROLL for (int c = 0; c < kCount; ++c)
    JAXSPEC_UNROLL for (int k = 0; k < kPartials; ++k) partial[c][k] = Zero();
  int64_t d = 0;
  for (; d + kPartials <= head_dim; d += kPartials) {
    JAXSPEC_UNROLL for (int k = 0; k < kPartials; ++k) {
      const Vec qd = Broadcast(q[d + k]);
      const float* row = keys + (d + k) * slots;
      JAXSPEC_UNROLL for (int c = 0; c < kCount; ++c) {
        const int64_t slot = (first + c) * kVecLanes;
        partial[c][k] = Fma(qd, LoadFirst(row + slot, n - slot), partial[c][k]);
      }
    }
  }
  for (; d < head_dim; ++d) {  // A head_dim that is not a multiple of kPartials.
    const Vec qd = Broadcast(q[d]);
    JAXSPEC_UNROLL for (int c = 0; c < kCount; ++c) {
      const int64_t slot = (first + c) * kVecLanes;
      partial[c][0] = Fma(qd, LoadFirst(keys + d * slots + slot, n - slot), partial[c][0]);
    }
  }
  Vec peak = Broadcast(kMinusInfinity);
  JAXSPEC_UNROLL for (int c = 0; c < kCount; ++c) {
    const int64_t slot = (first + c) * kVecLanes;
    const Vec logits = Add(Add(partial[c][0], partial[c][1]), Add(partial[c][2], partial[c][3]));
    const Vec biased = KeepFirst(Add(logits, LoadFirst(bias + slot, n - slot)), n - slot,
                                 kMinusInfinity);
    Store(weights + slot, biased);
    peak = Max(peak, biased);
  }
  return peak;
}
#undef JAXSPEC_UNROLL

// out[d] = sum_s weights[s] values[d, s] / total for d in [0, head_dim): kVecLanes dims
// at a time, their lane sums reduced together (SumEachVector); the rest one by one.
void WeightedValues(const float* weights, const float* values, int64_t head_dim,
                    int64_t slots, int64_t n, float total, float* out) {
  const int64_t blocks = (n + kVecLanes - 1) / kVecLanes;
  int64_t d0 = 0;
  for (; d0 + kVecLanes <= head_dim; d0 += kVecLanes) {
    Vec sums[kVecLanes];
    for (int64_t c = 0; c < kVecLanes; ++c) sums[c] = Zero();
    for (int64_t b = 0; b < blocks; ++b) {
      const int64_t slot = b * kVecLanes;
      const Vec weight = Load(weights + slot);
      for (int64_t c = 0; c < kVecLanes; ++c)
        sums[c] = Fma(weight, LoadFirst(values + (d0 + c) * slots + slot, n - slot), sums[c]);
    }
    Store(out + d0, Div(SumEachVector(sums), Broadcast(total)));
  }
  for (; d0 < head_dim; ++d0) {
    Vec sum = Zero();
    for (int64_t b = 0; b < blocks; ++b) {
      const int64_t slot = b * kVecLanes;
      sum = Fma(Load(weights + slot), LoadFirst(values + d0 * slots + slot, n - slot), sum);
    }
    out[d0] = HorizontalSum(sum) / total;
  }
}

// One query of one head over slots [0, n): q [d], keys/values [d, L] (row stride L),
// bias [L] -> out [d]. weights: scratch of at least ceil(n / kVecLanes) vectors.
void AttendOne(const float* q, const float* keys, const float* values, const float* bias,
               int64_t head_dim, int64_t slots, int64_t n, float* weights, float* out) {
  const int64_t blocks = (n + kVecLanes - 1) / kVecLanes;
  Vec peak = Broadcast(kMinusInfinity);
  int64_t first = 0;
  for (; first + kBlocksAtOnce <= blocks; first += kBlocksAtOnce)
    peak = Max(peak, Logits<kBlocksAtOnce>(q, keys, bias, head_dim, slots, n, first, weights));
  switch (blocks - first) {  // The last 1-3 blocks.
    case 3: peak = Max(peak, Logits<3>(q, keys, bias, head_dim, slots, n, first, weights)); break;
    case 2: peak = Max(peak, Logits<2>(q, keys, bias, head_dim, slots, n, first, weights)); break;
    case 1: peak = Max(peak, Logits<1>(q, keys, bias, head_dim, slots, n, first, weights)); break;
    default: break;
  }
  const Vec shift = Broadcast(HorizontalMax(peak));
  Vec total = Zero();
  for (int64_t b = 0; b < blocks; ++b) {
    const Vec weight = ExpNonPositive(Sub(Load(weights + b * kVecLanes), shift));
    Store(weights + b * kVecLanes, weight);
    total = Add(total, weight);
  }
  WeightedValues(weights, values, head_dim, slots, n, HorizontalSum(total), out);
}

ffi::Error CheckShapes(ffi::Span<const int64_t> q, ffi::Span<const int64_t> k,
                       ffi::Span<const int64_t> v, ffi::Span<const int64_t> bias,
                       int64_t num_keys_count, int64_t active_count, Shapes* shapes) {
  if (q.size() != 4 || k.size() != 4 || v.size() != 4 || bias.size() != 4)
    return ffi::Error::InvalidArgument(
        "query [b, t, h, d], keys/values [b, h, d, L] and bias [b, h|1, t, L] are 4-D");
  *shapes = {q[0], q[1], q[2], q[3], k[3], bias[1]};
  if (k[0] != q[0] || k[1] != q[2] || k[2] != q[3])
    return ffi::Error::InvalidArgument("keys [b, h, d, L] do not match query [b, t, h, d]");
  for (int i = 0; i < 4; ++i)
    if (v[i] != k[i]) return ffi::Error::InvalidArgument("values differ in shape from keys");
  if (bias[0] != q[0] || (bias[1] != 1 && bias[1] != q[2]) || bias[2] != q[1] ||
      bias[3] != k[3])
    return ffi::Error::InvalidArgument("bias must be [b, h|1, t, L]");
  if (num_keys_count != q[0]) return ffi::Error::InvalidArgument("num_keys must be [b]");
  if (active_count != q[0] * q[1])
    return ffi::Error::InvalidArgument("active must hold one flag per query [b, t]");
  return ffi::Error::Success();
}

// A step's new keys and values [b, t, h, d], written into the buffers [b, h, d, L] at
// slots starts[b] + 0..t-1 (JaxspecCachedAttentionWrite).
struct SlotWrites {
  const float* keys;
  const float* values;
  const int32_t* starts;
};

// Head h of row b's new keys/values into its columns of the buffers: slots outside the
// buffer are dropped (jaxspec.model.cache.write's semantics), and so are the queries
// `active` [b, t] leaves out: their keys/values come from products that skipped them,
// and their slots are never attended before a later step writes them (a row that ended,
// a position past a row's proposal), while each write to a cold cache line costs as
// much as the attention of a row.
void WriteHeadSlots(const Shapes& s, const SlotWrites& writes, const int32_t* active,
                    int64_t b, int64_t h, float* head_keys, float* head_values) {
  for (int64_t i = 0; i < s.queries; ++i) {
    const int64_t slot = static_cast<int64_t>(writes.starts[b]) + i;
    if (slot < 0 || slot >= s.slots || active[b * s.queries + i] == 0) continue;
    const int64_t row = ((b * s.queries + i) * s.heads + h) * s.head_dim;
    for (int64_t d = 0; d < s.head_dim; ++d) {
      head_keys[d * s.slots + slot] = writes.keys[row + d];
      head_values[d * s.slots + slot] = writes.values[row + d];
    }
  }
}

// The active queries of the (row, head) pairs pairs[begin..end) (pair = row * heads +
// head); a query whose flag in `active` [b, t] is 0 gets zeros and reads nothing. With
// `writes` (Cache = float: buffers the call may write), each pair first writes its head's
// new keys/values (the thread that attends over a head's columns writes them: the lines
// are in its own cache when it reads them); Cache = const float reads only.
template <typename Cache, typename NumKeys>
void AttendPairs(const Shapes& s, const float* qp, Cache* kp, Cache* vp, const float* bp,
                 const NumKeys& num_keys, const int32_t* active, const SlotWrites* writes,
                 const int64_t* pairs, int64_t begin, int64_t end, float* op) {
  thread_local std::vector<float> weights;
  weights.resize(((s.slots + kVecLanes - 1) / kVecLanes) * kVecLanes);
  for (int64_t p = begin; p < end; ++p) {
    const int64_t pair = pairs[p];
    const int64_t b = pair / s.heads, h = pair % s.heads;
    const int64_t n = std::clamp<int64_t>(num_keys(b), 0, s.slots);
    Cache* head_keys = kp + (b * s.heads + h) * s.head_dim * s.slots;
    Cache* head_values = vp + (b * s.heads + h) * s.head_dim * s.slots;
    if constexpr (!std::is_const_v<Cache>) {
      if (writes != nullptr) WriteHeadSlots(s, *writes, active, b, h, head_keys, head_values);
    }
    const int64_t bias_head = s.bias_heads == 1 ? 0 : h;
    for (int64_t i = 0; i < s.queries; ++i) {
      const int64_t row = (b * s.queries + i) * s.heads + h;
      float* result = op + row * s.head_dim;
      if (n == 0 || active[b * s.queries + i] == 0) {
        std::fill(result, result + s.head_dim, 0.0f);
        continue;
      }
      AttendOne(qp + row * s.head_dim, head_keys, head_values,
                bp + ((b * s.bias_heads + bias_head) * s.queries + i) * s.slots,
                s.head_dim, s.slots, n, weights.data(), result);
    }
  }
}

// The attention of every active query over keys/values kp, vp [b, h, d, L], row b reading
// its first min(L, max(0, num_keys(b))) slots, after `writes` (if any; Cache = float);
// the other queries' outputs are zeros. The (row, head) pairs of rows with an
// active query are split in contiguous runs among the calling thread and the kernels'
// helpers (spin_pool.h), so the rows that ended in a batch neither cost time nor leave a
// thread idle; a pair's writes and queries are done by one thread, in the same order
// whatever the split. The rows of zeros go to the caller.
template <typename Cache, typename NumKeys>
void AttendAll(const xla::ffi::ThreadPool& pool, const Shapes& s, const float* qp,
               Cache* kp, Cache* vp, const float* bp, const NumKeys& num_keys,
               const int32_t* active, const SlotWrites* writes, float* op) {
  thread_local std::vector<int64_t> pairs;  // The pairs of rows with an active query.
  pairs.clear();
  for (int64_t b = 0; b < s.batch; ++b) {
    const int32_t* flags = active + b * s.queries;
    if (std::any_of(flags, flags + s.queries, [](int32_t flag) { return flag != 0; })) {
      for (int64_t h = 0; h < s.heads; ++h) pairs.push_back(b * s.heads + h);
    } else {
      float* rows = op + b * s.queries * s.heads * s.head_dim;
      std::fill(rows, rows + s.queries * s.heads * s.head_dim, 0.0f);
    }
  }
  const int64_t count = static_cast<int64_t>(pairs.size());
  if (count == 0) return;
  jaxspec_kernels::SpinPool& helpers = jaxspec_kernels::Helpers(pool);
  const int64_t parts =
      std::max<int64_t>(1, std::min<int64_t>(helpers.num_helpers() + 1, count));
  const int64_t per_part = (count + parts - 1) / parts;
  const int64_t* pair_list = pairs.data();  // This thread's list, read by the helpers.
  helpers.Run(parts, [&](int64_t p) {
    AttendPairs(s, qp, kp, vp, bp, num_keys, active, writes, pair_list, p * per_part,
                std::min(count, (p + 1) * per_part), op);
  });
}

ffi::Error CachedAttention(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> query,
                           ffi::Buffer<ffi::F32> keys, ffi::Buffer<ffi::F32> values,
                           ffi::Buffer<ffi::F32> bias, ffi::Buffer<ffi::S32> num_keys,
                           ffi::Buffer<ffi::S32> active, ffi::ResultBuffer<ffi::F32> out) {
  Shapes s;
  if (ffi::Error error = CheckShapes(query.dimensions(), keys.dimensions(), values.dimensions(),
                                     bias.dimensions(), num_keys.element_count(),
                                     active.element_count(), &s);
      error.failure())
    return error;
  const int32_t* np = num_keys.typed_data();
  AttendAll(pool, s, query.typed_data(), keys.typed_data(), values.typed_data(),
            bias.typed_data(),
            [np](int64_t b) { return static_cast<int64_t>(np[b]); }, active.typed_data(),
            /*writes=*/nullptr, out->typed_data());
  return ffi::Error::Success();
}

// A decode step's self-attention with its cache write (JaxspecCachedAttentionWrite): the
// step's new keys/values [b, t, h, d] go into the buffers at slots starts[b] + 0..t-1, in
// place (the results alias the buffers; copied first only where XLA gave other memory),
// each (row, head)'s columns written just before its queries attend over the first
// starts[b] + t slots; the queries `active` leaves out neither write nor attend.
ffi::Error CachedAttentionWrite(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> query,
                                ffi::Buffer<ffi::F32> new_keys, ffi::Buffer<ffi::F32> new_values,
                                ffi::Buffer<ffi::F32> keys, ffi::Buffer<ffi::F32> values,
                                ffi::Buffer<ffi::F32> bias,
                                ffi::Buffer<ffi::S32> starts, ffi::Buffer<ffi::S32> active,
                                ffi::ResultBuffer<ffi::F32> out,
                                ffi::ResultBuffer<ffi::F32> keys_out,
                                ffi::ResultBuffer<ffi::F32> values_out) {
  Shapes s;
  if (ffi::Error error = CheckShapes(query.dimensions(), keys.dimensions(), values.dimensions(),
                                     bias.dimensions(), starts.element_count(),
                                     active.element_count(), &s);
      error.failure())
    return error;
  if (new_keys.element_count() != query.element_count() ||
      new_values.element_count() != query.element_count())
    return ffi::Error::InvalidArgument("new keys/values must be [b, t, h, d] like query");
  const size_t buffer_bytes = keys.element_count() * sizeof(float);
  float* kp = keys_out->typed_data();
  float* vp = values_out->typed_data();
  if (kp != keys.typed_data()) std::memcpy(kp, keys.typed_data(), buffer_bytes);
  if (vp != values.typed_data()) std::memcpy(vp, values.typed_data(), buffer_bytes);
  const int32_t* sp = starts.typed_data();
  const SlotWrites writes = {new_keys.typed_data(), new_values.typed_data(), sp};
  AttendAll(pool, s, query.typed_data(), kp, vp, bias.typed_data(),
            [sp, &s](int64_t b) { return static_cast<int64_t>(sp[b]) + s.queries; },
            active.typed_data(), &writes, out->typed_data());
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxspecCachedAttention, CachedAttention,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>());

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxspecCachedAttentionWrite, CachedAttentionWrite,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>());
