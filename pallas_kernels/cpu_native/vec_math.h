// Vectorised float32 math on 16 AVX-512 lanes (only where the compiler targets AVX-512F), scalar bfloat16
// conversions, the floats' order-preserving keys and the first-maximum order of the argmax kernels (everywhere),
// shared by the native kernels.
#ifndef JAXPAGED_CPU_NATIVE_VEC_MATH_H_
#define JAXPAGED_CPU_NATIVE_VEC_MATH_H_

#if defined(__AVX512F__)
#include <immintrin.h>
#endif

#include <cmath>
#include <cstdint>
#include <cstring>

namespace jaxpaged_native {

// bfloat16 (its bits as uint16_t) <-> float32, scalar.
inline float Bf16ToFloat(uint16_t v) {
  const uint32_t bits = static_cast<uint32_t>(v) << 16;
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}

inline uint16_t FloatToBf16(float f) {  // round to nearest even; NaN stays NaN
  uint32_t bits;
  std::memcpy(&bits, &f, 4);
  if ((bits & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((bits >> 16) | 0x40u);
  return static_cast<uint16_t>((bits + 0x7fffu + ((bits >> 16) & 1u)) >> 16);
}

// float32 -> uint32 whose unsigned order is the floats' total order: the signed integer order of the bits with the
// negatives' magnitudes flipped (-NaN < -inf < ... < -0 < +0 < ... < +inf < NaN), jax.lax.top_k's order. FromOrderKey
// inverts it.
inline uint32_t OrderKey(float x) {
  uint32_t bits;
  std::memcpy(&bits, &x, sizeof(bits));
  return (bits & 0x80000000u) ? ~bits : (bits | 0x80000000u);
}

inline float FromOrderKey(uint32_t key) {
  const uint32_t bits = (key & 0x80000000u) ? (key & 0x7FFFFFFFu) : ~key;
  float x;
  std::memcpy(&x, &bits, sizeof(x));
  return x;
}

// (value, index) a replaces (value, index) b where it is larger, or equal with a smaller index: jnp.argmax's first
// maximum, whatever order the candidates come in.
inline bool Better(float a, int64_t ia, float b, int64_t ib) { return a > b || (a == b && ia < ib); }

#if defined(__AVX512F__)
// Folds 16 lanes of running (maximum, index) pairs into (best, at) by Better.
inline void FoldLanes16(__m512 m, __m512i idx, float& best, int64_t& at) {
  alignas(64) float mv[16];
  alignas(64) int32_t iv[16];
  _mm512_store_ps(mv, m);
  _mm512_store_si512(reinterpret_cast<__m512i*>(iv), idx);
  for (int i = 0; i < 16; ++i)
    if (Better(mv[i], iv[i], best, at)) best = mv[i], at = iv[i];
}

// 2^n * e^r with n = round(x / ln 2), |r| <= ln 2 / 2, e^r by Cephes' expf polynomial (relative error ~2e-7), for
// x in [-87, 88] (the callers clamp); NaN stays NaN.
inline __m512 Exp16InRange(__m512 x) {
  const __m512 n = _mm512_roundscale_ps(_mm512_fmadd_ps(x, _mm512_set1_ps(1.44269504088896341f), _mm512_set1_ps(0.5f)),
                                        _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
  __m512 poly = _mm512_set1_ps(1.9875691500e-4f);
  poly = _mm512_fmadd_ps(poly, r, _mm512_set1_ps(1.3981999507e-3f));
  poly = _mm512_fmadd_ps(poly, r, _mm512_set1_ps(8.3334519073e-3f));
  poly = _mm512_fmadd_ps(poly, r, _mm512_set1_ps(4.1665795894e-2f));
  poly = _mm512_fmadd_ps(poly, r, _mm512_set1_ps(1.6666665459e-1f));
  poly = _mm512_fmadd_ps(poly, r, _mm512_set1_ps(5.0000001201e-1f));
  poly = _mm512_add_ps(_mm512_fmadd_ps(poly, _mm512_mul_ps(r, r), r), _mm512_set1_ps(1.0f));
  const __m512i bits = _mm512_slli_epi32(_mm512_add_epi32(_mm512_cvtps_epi32(n), _mm512_set1_epi32(127)), 23);
  return _mm512_mul_ps(poly, _mm512_castsi512_ps(bits));
}

// x with the lanes below `bound` (kCmp = _CMP_GT_OQ: above it) set to it; NaN lanes keep NaN.
template <int kCmp = _CMP_LT_OQ>
inline __m512 Clamp16(__m512 x, float bound) {
  return _mm512_mask_mov_ps(x, _mm512_cmp_ps_mask(x, _mm512_set1_ps(bound), kCmp), _mm512_set1_ps(bound));
}

// exp(x) for x <= 0 (scores minus their running max): below -87 it returns ~1e-38 instead of a denormal or 0.
inline __m512 Exp16NonPositive(__m512 x) { return Exp16InRange(Clamp16(x, -87.0f)); }

// exp(x) for any x: as Exp16NonPositive up to x = 88, inf above 88.72 (float32's largest exp), exp(88) in between.
inline __m512 Exp16(__m512 x) {
  const __mmask16 over = _mm512_cmp_ps_mask(x, _mm512_set1_ps(88.72f), _CMP_GT_OQ);
  const __m512 e = Exp16InRange(Clamp16<_CMP_GT_OQ>(Clamp16(x, -87.0f), 88.0f));
  return _mm512_mask_mov_ps(e, over, _mm512_set1_ps(INFINITY));
}

// tanh(x) on 16 lanes: sign(x) (1 - e) / (1 + e) with e = exp(-2 |x|) <= 1. NaN stays NaN.
inline __m512 Tanh16(__m512 x) {
  const __m512 e = Exp16NonPositive(_mm512_mul_ps(_mm512_set1_ps(-2.0f), _mm512_abs_ps(x)));
  const __m512 t = _mm512_div_ps(_mm512_sub_ps(_mm512_set1_ps(1.0f), e), _mm512_add_ps(_mm512_set1_ps(1.0f), e));
  return _mm512_mask_sub_ps(t, _mm512_cmp_ps_mask(x, _mm512_setzero_ps(), _CMP_LT_OQ), _mm512_setzero_ps(), t);
}
#endif

}  // namespace jaxpaged_native

#endif  // JAXPAGED_CPU_NATIVE_VEC_MATH_H_
