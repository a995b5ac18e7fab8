// Native CPU rotary position embedding of a bfloat16 layer's queries and keys, an XLA FFI custom call (built and
// registered by native.py).
//
//   q    [T, Hq, D]  bfloat16   queries; D even
//   k    [T, Hk, D]  bfloat16   keys
//   cos  [T, D/2]    float32    per token (any leading shape of T * D/2 elements)
//   sin  [T, D/2]    float32
//   q_out, k_out     bfloat16   each head's row x = [x1, x2] (halves) as [x1 cos - x2 sin, x2 cos + x1 sin]
//
// Hugging Face's convention (rotate_half), with the numbers of XLA's fusion of the models' pure-JAX rope
// (jaxpaged/models/rope.py): the halves in float32, x1 cos - x2 sin as fma(x1, cos, -(x2 sin)) and x2 cos + x1 sin as
// fma(x2, cos, x1 sin) (XLA CPU contracts each into one fused multiply-add), then one rounding to bfloat16. XLA CPU runs
// that as one fusion per tensor; this is one call for both, with the same numbers. Tokens are split over XLA's
// intra-op pool only when there are many (a prefill).

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>  // the AVX-512 paths below, each under the macros of the instructions it uses
#endif

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <memory>

#include "vec_math.h"
#include "work_queue.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;
using jaxpaged_native::DrainRanges;
using jaxpaged_native::Bf16ToFloat;
using jaxpaged_native::FloatToBf16;
using jaxpaged_native::RunUnits;
using jaxpaged_native::WorkQueue;

namespace {

void RopeRows(const uint16_t* x, uint16_t* out, int64_t tokens, int64_t heads, int64_t half, const float* cos,
              const float* sin) {
  for (int64_t t = 0; t < tokens; ++t) {
    const float* c = cos + t * half;
    const float* s = sin + t * half;
    for (int64_t h = 0; h < heads; ++h) {
      const uint16_t* x1 = x + (t * heads + h) * 2 * half;
      const uint16_t* x2 = x1 + half;
      uint16_t* o1 = out + (t * heads + h) * 2 * half;
      uint16_t* o2 = o1 + half;
      int64_t j = 0;
#if defined(__AVX512F__) && defined(__AVX512BF16__)
      auto load = [](const uint16_t* p) {
        return _mm512_castsi512_ps(
            _mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))), 16));
      };
      for (; j + 16 <= half; j += 16) {
        const __m512 a = load(x1 + j), b = load(x2 + j), cj = _mm512_loadu_ps(c + j), sj = _mm512_loadu_ps(s + j);
        const __m512 r1 = _mm512_fmsub_ps(a, cj, _mm512_mul_ps(b, sj));
        const __m512 r2 = _mm512_fmadd_ps(b, cj, _mm512_mul_ps(a, sj));
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(o1 + j), (__m256i)_mm512_cvtneps_pbh(r1));
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(o2 + j), (__m256i)_mm512_cvtneps_pbh(r2));
      }
#endif
      for (; j < half; ++j) {
        const float a = Bf16ToFloat(x1[j]), b = Bf16ToFloat(x2[j]);
        const float p2 = b * s[j], p4 = a * s[j];
        o1[j] = FloatToBf16(std::fma(a, c[j], -p2));
        o2[j] = FloatToBf16(std::fma(b, c[j], p4));
      }
    }
  }
}

constexpr int64_t kTokensPerItem = 64;  // tokens per work item; a call with no more runs on the caller alone

struct Problem {
  const uint16_t *q, *k;
  uint16_t *q_out, *k_out;
  const float *cos, *sin;
  int64_t q_heads, k_heads, half;

  void Tokens(int64_t t0, int64_t t1) const {  // tokens [t0, t1) of both tensors
    const int64_t D = 2 * half;
    RopeRows(q + t0 * q_heads * D, q_out + t0 * q_heads * D, t1 - t0, q_heads, half, cos + t0 * half, sin + t0 * half);
    RopeRows(k + t0 * k_heads * D, k_out + t0 * k_heads * D, t1 - t0, k_heads, half, cos + t0 * half, sin + t0 * half);
  }
};

struct ParallelRope {
  Problem p;
  int64_t tokens, per_item;
  WorkQueue work;
  void Drain() {
    DrainRanges(work, tokens, per_item, [&](int64_t lo, int64_t hi) { p.Tokens(lo, hi); });
  }
};

ffi::Error RopeImpl(ffi::ThreadPool pool, ffi::AnyBuffer q, ffi::AnyBuffer k, ffi::Buffer<ffi::F32> cos,
                    ffi::Buffer<ffi::F32> sin, ffi::Result<ffi::AnyBuffer> q_out, ffi::Result<ffi::AnyBuffer> k_out) {
  const auto qd = q.dimensions(), kd = k.dimensions();
  if (qd.size() != 3 || kd.size() != 3 || qd[0] != kd[0] || qd[2] != kd[2] || qd[2] % 2)
    return ffi::Error::InvalidArgument("rope: q and k must be [T, H, D] with one T and one even D");
  if (q.element_type() != ffi::BF16 || k.element_type() != ffi::BF16)
    return ffi::Error::InvalidArgument("rope: q and k must be bfloat16");
  const int64_t T = qd[0], half = qd[2] / 2;
  if (cos.element_count() != T * half || sin.element_count() != T * half)
    return ffi::Error::InvalidArgument("rope: cos and sin must have T * D/2 elements");
  auto state = std::make_shared<ParallelRope>();
  state->p = {static_cast<const uint16_t*>(q.untyped_data()), static_cast<const uint16_t*>(k.untyped_data()),
              static_cast<uint16_t*>(q_out->untyped_data()), static_cast<uint16_t*>(k_out->untyped_data()),
              cos.typed_data(), sin.typed_data(), qd[1], kd[1], half};
  state->tokens = T;
  RunUnits(pool, state, T, kTokensPerItem, kTokensPerItem + 1);
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxpagedRope, RopeImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::AnyBuffer>()         // q
                                  .Arg<ffi::AnyBuffer>()         // k
                                  .Arg<ffi::Buffer<ffi::F32>>()  // cos
                                  .Arg<ffi::Buffer<ffi::F32>>()  // sin
                                  .Ret<ffi::AnyBuffer>()         // q_out
                                  .Ret<ffi::AnyBuffer>());       // k_out
