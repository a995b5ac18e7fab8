// Native CPU Gumbel-max draw of one token per row, an XLA FFI custom call (built and registered by native.py).
//
//   JaxpagedGumbelArgmax
//     x     [S, V]  float32   a step's logits, temperature-scaled and filtered (-inf: not drawable)
//     keys  [S, 2]  uint32    each row's threefry2x32 key (jax.random.key_data of the row's key)
//     out   [S]     int32     argmax_j x[s, j] + g[s, j], the first of tied maxima (NaN never the maximum; a row with
//                             nothing finite gives 0), where g[s] is jax.random.gumbel(key s, (V,), float32)'s noise:
//                             u from the row key's partitionable threefry bits (jax_threefry_partitionable, the
//                             default: token j's counter is (0, j), its bits the two output words xor-ed), as
//                             jax.random.uniform(minval=float32's tiny) makes them, and g = -log(-log(u)) with XLA
//                             CPU's logarithm: the noise bit for bit, and the token jnp.argmax(x + noise) picks
//
// Why: XLA CPU draws the noise with a rolled loop of threefry rounds, then takes the logarithms, adds, and the argmax
// reads the sum back: ~26 ms of a 48-row decode step of SmolLM2 (49152 tokens), a quarter of the step. Here each row
// is one pass: 16 tokens at a time through the 20 threefry rounds, the logarithms and the running (maximum, index)
// pairs, nothing written but the token. Rows are split over XLA's intra-op pool.

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#endif

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <memory>

#include "vec_math.h"
#include "work_queue.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;
using jaxpaged_native::DrainRanges;
using jaxpaged_native::RunUnits;
using jaxpaged_native::WorkQueue;

namespace {

constexpr int64_t kRowsPerItem = 1;
constexpr float kTiny = 1.17549435e-38f;  // float32's smallest normal: jax.random.gumbel's minval

// ---- scalar: threefry2x32 on one counter, the uniform, the noise ----------------------------------------------------

inline uint32_t Rotl(uint32_t v, int r) { return (v << r) | (v >> (32 - r)); }

// The two output words of threefry2x32(key, (x0, x1)), 20 rounds, xor-ed (JAX's 32-bit random bits).
inline uint32_t ThreefryBits(uint32_t k0, uint32_t k1, uint32_t x0, uint32_t x1) {
  static constexpr int kRot[2][4] = {{13, 15, 26, 6}, {17, 29, 16, 24}};
  const uint32_t ks[3] = {k0, k1, k0 ^ k1 ^ 0x1BD11BDAu};
  x0 += ks[0];
  x1 += ks[1];
  for (int i = 0; i < 5; ++i) {
    for (int r : kRot[i % 2]) {
      x0 += x1;
      x1 = Rotl(x1, r);
      x1 ^= x0;
    }
    x0 += ks[(i + 1) % 3];
    x1 += ks[(i + 2) % 3] + static_cast<uint32_t>(i + 1);
  }
  return x0 ^ x1;
}

// jax.random.uniform's float32 from 32 random bits, with minval = tiny, maxval = 1: the mantissa's 23 bits over
// [1, 2) minus 1, then f * (1 - tiny) + tiny = f + tiny (1 - tiny rounds to 1), at least tiny. For f > 0 that is f.
inline float Uniform(uint32_t bits) {
  const uint32_t one_bits = (bits >> 9) | 0x3F800000u;
  float f;
  std::memcpy(&f, &one_bits, sizeof(f));
  f -= 1.0f;
  return f > 0.0f ? f : kTiny;
}

// XLA CPU's logarithm (jaxlib 0.10: Eigen's plog, Cephes' polynomial, with the fused multiply-adds XLA's compiler
// forms), for normal positive x: x = m 2^e with m in [sqrt(1/2), sqrt(2)), a polynomial in m - 1, and e's share in
// two constants. Bit for bit XLA's where the CPU has FMA (every AVX-512 one); elsewhere within an ulp.
constexpr float kSqrtHalf = 0.707106781186547524f;
constexpr float kP[9] = {7.0376836292e-2f,  -1.1514610310e-1f, 1.1676998740e-1f,
                         -1.2420140846e-1f, 1.4249322787e-1f,  -1.6668057665e-1f,
                         2.0000714765e-1f,  -2.4999993993e-1f, 3.3333331174e-1f};
constexpr float kLog2Lo = -2.12194440e-4f, kLog2Hi = 0.693359375f;

inline float Fma(float a, float b, float c) {
#if defined(__FMA__) || defined(__aarch64__)
  return std::fma(a, b, c);
#else
  return a * b + c;
#endif
}

inline float LogScalar(float x) {
  uint32_t bits;
  std::memcpy(&bits, &x, sizeof(bits));
  float e = static_cast<float>(static_cast<int32_t>(bits >> 23) - 127) + 1.0f;
  const uint32_t m_bits = (bits & 0x807FFFFFu) | 0x3F000000u;  // the mantissa over [0.5, 1)
  float m;
  std::memcpy(&m, &m_bits, sizeof(m));
  if (m < kSqrtHalf) {
    e -= 1.0f;
    m = (m - 1.0f) + m;
  } else {
    m = m - 1.0f;
  }
  const float x2 = m * m, x3 = x2 * m;
  float y = Fma(kP[0], m, kP[1]), y1 = Fma(kP[3], m, kP[4]), y2 = Fma(kP[6], m, kP[7]);
  y = Fma(y, m, kP[2]);
  y1 = Fma(y1, m, kP[5]);
  y2 = Fma(y2, m, kP[8]);
  y = Fma(y, x3, y1);
  y = Fma(y, x3, y2);
  y = Fma(y, x3, kLog2Lo * e);
  m = m - x2 * 0.5f;
  m = m + y;
  return Fma(kLog2Hi, e, m);
}

inline float Gumbel(uint32_t bits) { return -LogScalar(-LogScalar(Uniform(bits))); }

#if defined(__AVX512F__)
// ---- the same on 16 lanes -----------------------------------------------------------------------------------------

template <int R>
inline void Round16(__m512i& x0, __m512i& x1) {
  x0 = _mm512_add_epi32(x0, x1);
  x1 = _mm512_rol_epi32(x1, R);
  x1 = _mm512_xor_si512(x1, x0);
}

inline void Rounds16(__m512i& x0, __m512i& x1, bool first) {
  if (first) {
    Round16<13>(x0, x1), Round16<15>(x0, x1), Round16<26>(x0, x1), Round16<6>(x0, x1);
  } else {
    Round16<17>(x0, x1), Round16<29>(x0, x1), Round16<16>(x0, x1), Round16<24>(x0, x1);
  }
}

inline __m512i ThreefryBits16(uint32_t k0, uint32_t k1, __m512i x1) {
  const uint32_t ks[3] = {k0, k1, k0 ^ k1 ^ 0x1BD11BDAu};
  __m512i x0 = _mm512_set1_epi32(static_cast<int>(ks[0]));  // the counter's high word, 0, plus ks[0]
  x1 = _mm512_add_epi32(x1, _mm512_set1_epi32(static_cast<int>(ks[1])));
  for (int i = 0; i < 5; ++i) {
    Rounds16(x0, x1, i % 2 == 0);
    x0 = _mm512_add_epi32(x0, _mm512_set1_epi32(static_cast<int>(ks[(i + 1) % 3])));
    x1 = _mm512_add_epi32(x1, _mm512_set1_epi32(static_cast<int>(ks[(i + 2) % 3] + static_cast<uint32_t>(i + 1))));
  }
  return _mm512_xor_si512(x0, x1);
}

inline __m512 Uniform16(__m512i bits) {
  const __m512 f = _mm512_sub_ps(
      _mm512_castsi512_ps(_mm512_or_si512(_mm512_srli_epi32(bits, 9), _mm512_set1_epi32(0x3F800000))),
      _mm512_set1_ps(1.0f));
  return _mm512_mask_blend_ps(_mm512_cmp_ps_mask(f, _mm512_setzero_ps(), _CMP_GT_OQ), _mm512_set1_ps(kTiny), f);
}

// LogScalar on 16 lanes.
inline __m512 Log16(__m512 x) {
  const __m512i bits = _mm512_castps_si512(x);
  __m512 e = _mm512_add_ps(
      _mm512_cvtepi32_ps(_mm512_sub_epi32(_mm512_srli_epi32(bits, 23), _mm512_set1_epi32(127))), _mm512_set1_ps(1.0f));
  __m512 m = _mm512_castsi512_ps(_mm512_or_si512(_mm512_and_si512(bits, _mm512_set1_epi32(0x807FFFFF)),
                                                 _mm512_set1_epi32(0x3F000000)));
  const __mmask16 small = _mm512_cmp_ps_mask(m, _mm512_set1_ps(kSqrtHalf), _CMP_LT_OQ);
  const __m512 one = _mm512_set1_ps(1.0f);
  e = _mm512_mask_sub_ps(e, small, e, one);
  m = _mm512_mask_add_ps(_mm512_sub_ps(m, one), small, _mm512_sub_ps(m, one), m);
  const __m512 x2 = _mm512_mul_ps(m, m), x3 = _mm512_mul_ps(x2, m);
  __m512 y = _mm512_fmadd_ps(_mm512_set1_ps(kP[0]), m, _mm512_set1_ps(kP[1]));
  __m512 y1 = _mm512_fmadd_ps(_mm512_set1_ps(kP[3]), m, _mm512_set1_ps(kP[4]));
  __m512 y2 = _mm512_fmadd_ps(_mm512_set1_ps(kP[6]), m, _mm512_set1_ps(kP[7]));
  y = _mm512_fmadd_ps(y, m, _mm512_set1_ps(kP[2]));
  y1 = _mm512_fmadd_ps(y1, m, _mm512_set1_ps(kP[5]));
  y2 = _mm512_fmadd_ps(y2, m, _mm512_set1_ps(kP[8]));
  y = _mm512_fmadd_ps(y, x3, y1);
  y = _mm512_fmadd_ps(y, x3, y2);
  y = _mm512_fmadd_ps(y, x3, _mm512_mul_ps(_mm512_set1_ps(kLog2Lo), e));
  m = _mm512_sub_ps(m, _mm512_mul_ps(x2, _mm512_set1_ps(0.5f)));
  m = _mm512_add_ps(m, y);
  return _mm512_fmadd_ps(_mm512_set1_ps(kLog2Hi), e, m);
}

inline __m512 Gumbel16(__m512i bits) {
  const __m512 minus = _mm512_set1_ps(-0.0f);
  return _mm512_xor_ps(Log16(_mm512_xor_ps(Log16(Uniform16(bits)), minus)), minus);
}
#endif

int32_t RowDraw(const float* x, int64_t v, uint32_t k0, uint32_t k1) {
  float best = -std::numeric_limits<float>::infinity();
  int64_t at = 0;
  int64_t j = 0;
#if defined(__AVX512F__)
  if (v >= 16) {
    __m512 m = _mm512_set1_ps(best);
    __m512i idx = _mm512_setzero_si512();
    __m512i pos = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    const __m512i step = _mm512_set1_epi32(16);
    for (; j + 16 <= v; j += 16) {
      const __m512 y = _mm512_add_ps(_mm512_loadu_ps(x + j), Gumbel16(ThreefryBits16(k0, k1, pos)));
      const __mmask16 larger = _mm512_cmp_ps_mask(y, m, _CMP_GT_OQ);  // strict: a lane keeps its first maximum
      m = _mm512_mask_mov_ps(m, larger, y);
      idx = _mm512_mask_mov_epi32(idx, larger, pos);
      pos = _mm512_add_epi32(pos, step);
    }
    jaxpaged_native::FoldLanes16(m, idx, best, at);
  }
#endif
  for (; j < v; ++j) {
    const float y = x[j] + Gumbel(ThreefryBits(k0, k1, 0u, static_cast<uint32_t>(j)));
    if (y > best) best = y, at = j;  // later indices: only a strictly larger value wins
  }
  return static_cast<int32_t>(at);
}

struct ParallelDraw {
  const float* x;
  const uint32_t* keys;
  int32_t* out;
  int64_t rows, v, per_item;
  WorkQueue work;
  void Drain() {
    DrainRanges(work, rows, per_item, [&](int64_t lo, int64_t hi) {
      for (int64_t r = lo; r < hi; ++r) out[r] = RowDraw(x + r * v, v, keys[2 * r], keys[2 * r + 1]);
    });
  }
};

ffi::Error GumbelArgmaxImpl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::U32> keys,
                            ffi::Result<ffi::Buffer<ffi::S32>> out) {
  const auto d = x.dimensions();
  const auto dk = keys.dimensions();
  if (d.size() != 2 || dk.size() != 2 || dk[0] != d[0] || dk[1] != 2 ||
      out->element_count() != static_cast<size_t>(d[0]))
    return ffi::Error::InvalidArgument("gumbel_argmax: x must be [S, V], keys [S, 2] and out [S]");
  if (d[1] >= (int64_t{1} << 31)) return ffi::Error::InvalidArgument("gumbel_argmax: V must be below 2^31");
  auto state = std::make_shared<ParallelDraw>();
  state->x = x.typed_data();
  state->keys = keys.typed_data();
  state->out = out->typed_data();
  state->rows = d[0];
  state->v = d[1];
  RunUnits(pool, state, d[0], kRowsPerItem, 2);
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxpagedGumbelArgmax, GumbelArgmaxImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()    // x
                                  .Arg<ffi::Buffer<ffi::U32>>()    // keys
                                  .Ret<ffi::Buffer<ffi::S32>>());  // out
