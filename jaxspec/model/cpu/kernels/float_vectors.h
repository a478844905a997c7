// Float32 vectors for jaxspec's CPU kernels: 16 lanes with AVX-512 (built with -mavx512f
// where the CPU has it: 32 vector registers), else 8 lanes of AVX2 + FMA. A kernel's
// result depends on the build (the lanes of its sums), never on the rows beside a row.
#ifndef JAXSPEC_CPU_KERNELS_FLOAT_VECTORS_H_
#define JAXSPEC_CPU_KERNELS_FLOAT_VECTORS_H_

#include <immintrin.h>

#include <cstdint>

namespace jaxspec_kernels {

#if defined(__AVX512F__)
using Vec = __m512;
constexpr int64_t kVecLanes = 16;
inline Vec Load(const float* p) { return _mm512_loadu_ps(p); }
inline void Store(float* p, Vec v) { _mm512_storeu_ps(p, v); }
inline Vec Fma(Vec a, Vec b, Vec c) { return _mm512_fmadd_ps(a, b, c); }
inline Vec Zero() { return _mm512_setzero_ps(); }
inline Vec Broadcast(float value) { return _mm512_set1_ps(value); }
inline Vec Add(Vec a, Vec b) { return _mm512_add_ps(a, b); }
inline Vec Sub(Vec a, Vec b) { return _mm512_sub_ps(a, b); }
inline Vec Mul(Vec a, Vec b) { return _mm512_mul_ps(a, b); }
inline Vec Max(Vec a, Vec b) { return _mm512_max_ps(a, b); }
inline Vec Div(Vec a, Vec b) { return _mm512_div_ps(a, b); }
inline __mmask16 FirstLanes(int64_t count) {
  return count >= 16 ? static_cast<__mmask16>(0xffff)
                     : static_cast<__mmask16>((1u << (count > 0 ? count : 0)) - 1u);
}
// The first `count` lanes of p (all where count >= kVecLanes), 0 in the others; reads
// nothing past them.
inline Vec LoadFirst(const float* p, int64_t count) {
  return count >= 16 ? _mm512_loadu_ps(p) : _mm512_maskz_loadu_ps(FirstLanes(count), p);
}
// v in the first `count` lanes, `fill` in the others.
inline Vec KeepFirst(Vec v, int64_t count, float fill) {
  return _mm512_mask_blend_ps(FirstLanes(count), _mm512_set1_ps(fill), v);
}
// Lanes where a < b hold `fill`, the others v.
inline Vec FillWhereLess(Vec v, Vec a, Vec b, float fill) {
  return _mm512_mask_blend_ps(_mm512_cmp_ps_mask(a, b, _CMP_LT_OQ), v, _mm512_set1_ps(fill));
}
inline Vec Round(Vec v) {
  return _mm512_roundscale_ps(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
}
// 2^n for integral n in [-126, 127] held as floats.
inline Vec TwoToThe(Vec n) {
  return _mm512_castsi512_ps(_mm512_slli_epi32(
      _mm512_add_epi32(_mm512_cvtps_epi32(n), _mm512_set1_epi32(127)), 23));
}
inline __m256 Halves(Vec v) {
  return _mm256_add_ps(_mm512_castps512_ps256(v),
                       _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(v), 1)));
}
inline __m256 MaxHalves(Vec v) {
  return _mm256_max_ps(_mm512_castps512_ps256(v),
                       _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(v), 1)));
}
// The lane sums of vectors[0..15], vector j's in lane j: pairs, then quadruples, then the
// 128-bit quarters added by a fixed tree (each sum's order depends on nothing else).
inline Vec SumEachVector(const Vec* vectors) {
  Vec pairs[8], quads[4], halves[2];
  for (int j = 0; j < 8; ++j)
    pairs[j] = _mm512_add_ps(_mm512_unpacklo_ps(vectors[2 * j], vectors[2 * j + 1]),
                             _mm512_unpackhi_ps(vectors[2 * j], vectors[2 * j + 1]));
  for (int j = 0; j < 4; ++j) {
    const __m512d a = _mm512_castps_pd(pairs[2 * j]), b = _mm512_castps_pd(pairs[2 * j + 1]);
    quads[j] = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(a, b)),
                             _mm512_castpd_ps(_mm512_unpackhi_pd(a, b)));
  }
  for (int j = 0; j < 2; ++j)
    halves[j] = _mm512_add_ps(_mm512_shuffle_f32x4(quads[2 * j], quads[2 * j + 1], 0x88),
                              _mm512_shuffle_f32x4(quads[2 * j], quads[2 * j + 1], 0xdd));
  return _mm512_add_ps(_mm512_shuffle_f32x4(halves[0], halves[1], 0x88),
                       _mm512_shuffle_f32x4(halves[0], halves[1], 0xdd));
}
#else
using Vec = __m256;
constexpr int64_t kVecLanes = 8;
inline Vec Load(const float* p) { return _mm256_loadu_ps(p); }
inline void Store(float* p, Vec v) { _mm256_storeu_ps(p, v); }
inline Vec Fma(Vec a, Vec b, Vec c) { return _mm256_fmadd_ps(a, b, c); }
inline Vec Zero() { return _mm256_setzero_ps(); }
inline Vec Broadcast(float value) { return _mm256_set1_ps(value); }
inline Vec Add(Vec a, Vec b) { return _mm256_add_ps(a, b); }
inline Vec Sub(Vec a, Vec b) { return _mm256_sub_ps(a, b); }
inline Vec Mul(Vec a, Vec b) { return _mm256_mul_ps(a, b); }
inline Vec Max(Vec a, Vec b) { return _mm256_max_ps(a, b); }
inline Vec Div(Vec a, Vec b) { return _mm256_div_ps(a, b); }
inline __m256i FirstLanes(int64_t count) {
  const __m256i lanes = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
  const int32_t bound = count > 8 ? 8 : (count > 0 ? static_cast<int32_t>(count) : 0);
  return _mm256_cmpgt_epi32(_mm256_set1_epi32(bound), lanes);
}
inline Vec LoadFirst(const float* p, int64_t count) {
  return count >= 8 ? _mm256_loadu_ps(p) : _mm256_maskload_ps(p, FirstLanes(count));
}
inline Vec KeepFirst(Vec v, int64_t count, float fill) {
  return _mm256_blendv_ps(_mm256_set1_ps(fill), v, _mm256_castsi256_ps(FirstLanes(count)));
}
inline Vec FillWhereLess(Vec v, Vec a, Vec b, float fill) {
  return _mm256_blendv_ps(v, _mm256_set1_ps(fill), _mm256_cmp_ps(a, b, _CMP_LT_OQ));
}
inline Vec Round(Vec v) {
  return _mm256_round_ps(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
}
inline Vec TwoToThe(Vec n) {
  return _mm256_castsi256_ps(_mm256_slli_epi32(
      _mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23));
}
inline __m256 Halves(Vec v) { return v; }
inline __m256 MaxHalves(Vec v) { return v; }
// The lane sums of vectors[0..7], vector j's in lane j (a fixed tree, as above).
inline Vec SumEachVector(const Vec* vectors) {
  Vec pairs[4], quads[2];
  for (int j = 0; j < 4; ++j)
    pairs[j] = _mm256_add_ps(_mm256_unpacklo_ps(vectors[2 * j], vectors[2 * j + 1]),
                             _mm256_unpackhi_ps(vectors[2 * j], vectors[2 * j + 1]));
  for (int j = 0; j < 2; ++j) {
    const __m256d a = _mm256_castps_pd(pairs[2 * j]), b = _mm256_castps_pd(pairs[2 * j + 1]);
    quads[j] = _mm256_add_ps(_mm256_castpd_ps(_mm256_unpacklo_pd(a, b)),
                             _mm256_castpd_ps(_mm256_unpackhi_pd(a, b)));
  }
  return _mm256_add_ps(_mm256_permute2f128_ps(quads[0], quads[1], 0x20),
                       _mm256_permute2f128_ps(quads[0], quads[1], 0x31));
}
#endif

inline float HorizontalSum(Vec vector) {
  const __m256 v = Halves(vector);
  __m128 q = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  q = _mm_add_ps(q, _mm_movehl_ps(q, q));
  q = _mm_add_ss(q, _mm_movehdup_ps(q));
  return _mm_cvtss_f32(q);
}

inline float HorizontalMax(Vec vector) {
  const __m256 v = MaxHalves(vector);
  __m128 q = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  q = _mm_max_ps(q, _mm_movehl_ps(q, q));
  q = _mm_max_ss(q, _mm_movehdup_ps(q));
  return _mm_cvtss_f32(q);
}

// exp(x) lane by lane for x <= 0 (softmax's shifted logits): Cephes' single-precision
// polynomial (relative error ~2e-7); exactly 0 below kExpFloor, so a masked logit
// (T5's additive -1e10) always weighs exactly 0.
constexpr float kExpFloor = -87.0f;
inline Vec ExpNonPositive(Vec x) {
  const Vec clamped = Max(x, Broadcast(kExpFloor));
  const Vec n = Round(Mul(clamped, Broadcast(1.44269504088896341f)));
  Vec r = Sub(clamped, Mul(n, Broadcast(0.693359375f)));
  r = Sub(r, Mul(n, Broadcast(-2.12194440e-4f)));
  Vec y = Broadcast(1.9875691500e-4f);
  y = Fma(y, r, Broadcast(1.3981999507e-3f));
  y = Fma(y, r, Broadcast(8.3334519073e-3f));
  y = Fma(y, r, Broadcast(4.1665795894e-2f));
  y = Fma(y, r, Broadcast(1.6666665459e-1f));
  y = Fma(y, r, Broadcast(5.0000001201e-1f));
  y = Fma(y, Mul(r, r), Add(r, Broadcast(1.0f)));
  return FillWhereLess(Mul(y, TwoToThe(n)), x, Broadcast(kExpFloor), 0.0f);
}

}  // namespace jaxspec_kernels

#endif  // JAXSPEC_CPU_KERNELS_FLOAT_VECTORS_H_
