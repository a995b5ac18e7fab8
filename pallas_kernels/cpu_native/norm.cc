// Native CPU RMSNorm and residual adds of a bfloat16 model, XLA FFI custom calls (built and registered by native.py).
//
//   JaxpagedRmsNorm: out = w * bf16(s * rsqrt(mean(s * s) + eps)) per row, s = f32(x) + f32(delta)
//     x      [T, H]      bfloat16   the residual stream (or any rows to normalize: a head's q or k per row)
//     delta  [T, H] or [0]  bfloat16   what is added to it first (a layer's attention output); [0]: nothing
//     weight [L, H]      bfloat16   the stacked norm weights, read at `layer` (clipped to [0, L))
//     layer  [] int32
//     eps    attribute (f32)
//     unit_offset attribute (i64)   1: Gemma's norm, out = bf16((s * r) * (1 + f32(w))), all in float32
//     sum    [T, H] or [0]  float32    s, unrounded (only with a delta)
//     out    [T, H]      bfloat16   rounded as the XLA step rounds: s * r to bfloat16, then its product with w
//   JaxpagedAddRound: out = bf16(bf16(s) + f32(delta)), s [T, H] float32, delta [T, H] bfloat16 (the layer's last
//     residual add: s, the sum JaxpagedRmsNorm returned, rounded as the bfloat16 model's residual stream is)
//
// These are the numbers of the step XLA compiles from the models' pure-JAX layer (jaxpaged/models/llama.py): XLA
// keeps the bfloat16 sum h + attention in float32 where it fuses it into the norm after it, and rounds it to
// bfloat16 before the layer's last residual add. Only the float32 summation order of mean(s * s) differs (16 lanes,
// then the lanes in order).
//
// Why: XLA CPU runs these as four to six small fusions per norm (converts, a YNNPACK reduction, rsqrt, a multiply),
// each a separate thunk over a few rows; per decode layer they took about as long as a projection's matmul
// (benchmarks/step_anatomy.py's per-operation profile). A row here is one pass to sum, one to scale. Rows are split
// over XLA's intra-op pool only when there are many (a prefill); a decode step's few rows run on the calling thread.

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>  // the AVX-512 paths below, each under the macros of the instructions it uses
#endif

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <memory>
#include <string>

#include "vec_math.h"
#include "work_queue.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;
using jaxpaged_native::Bf16ToFloat;
using jaxpaged_native::DrainRanges;
using jaxpaged_native::FloatToBf16;
using jaxpaged_native::RunUnits;
using jaxpaged_native::WorkQueue;

namespace {

constexpr int64_t kRowsPerItem = 16;            // rows per work item of a parallel call
constexpr int64_t kParallelElements = 1 << 16;  // calls with fewer elements run on the caller alone

#if defined(__AVX512F__) && defined(__AVX512BF16__)
inline __m512 Load16(const uint16_t* p) {  // 16 bfloat16 -> float32
  return _mm512_castsi512_ps(
      _mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))), 16));
}
inline __m256i Round16(__m512 v) { return (__m256i)_mm512_cvtneps_pbh(v); }  // round to nearest even, NaN stays NaN
inline __m512 Widen16(__m256i v) { return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(v), 16)); }
#endif

struct Problem {
  const uint16_t* x;
  const uint16_t* delta;  // nullptr: none
  const uint16_t* w;      // the layer's [H]
  float eps;
  bool unit_offset;       // Gemma's (1 + w), in float32, one rounding at the end
  float* sum;             // nullptr: not asked for
  uint16_t* out;
  int64_t rows, h;
};

// One row's s = x + delta (into s), and the sum of its squares in float32.
float SumRow(const uint16_t* x, const uint16_t* d, float* s, int64_t H) {
  int64_t j = 0;
  float total = 0.0f;
#if defined(__AVX512F__) && defined(__AVX512BF16__)
  __m512 acc = _mm512_setzero_ps();
  for (; j + 16 <= H; j += 16) {
    __m512 v = Load16(x + j);
    if (d) v = _mm512_add_ps(v, Load16(d + j));
    _mm512_storeu_ps(s + j, v);
    acc = _mm512_fmadd_ps(v, v, acc);
  }
  total = _mm512_reduce_add_ps(acc);
#else
  // The portable path: 16 partial sums written out lane by lane, so g++ -O3 vectorizes them without -ffast-math
  // (SSE, AVX2, NEON), then the lanes in order.
  float lanes[16] = {};
  for (; j + 16 <= H; j += 16) {
    for (int l = 0; l < 16; ++l) s[j + l] = Bf16ToFloat(x[j + l]);
    if (d)
      for (int l = 0; l < 16; ++l) s[j + l] += Bf16ToFloat(d[j + l]);
    for (int l = 0; l < 16; ++l) lanes[l] += s[j + l] * s[j + l];
  }
  for (int l = 0; l < 16; ++l) total += lanes[l];
#endif
  for (; j < H; ++j) {
    s[j] = Bf16ToFloat(x[j]) + (d ? Bf16ToFloat(d[j]) : 0.0f);
    total += s[j] * s[j];
  }
  return total;
}

// o = bf16(w * bf16(s * scale)) over one row; with unit_offset o = bf16((s * scale) * (1 + w)).
void ScaleRow(const float* s, const uint16_t* w, float scale, bool unit_offset, uint16_t* o, int64_t H) {
  int64_t j = 0;
#if defined(__AVX512F__) && defined(__AVX512BF16__)
  const __m512 sc = _mm512_set1_ps(scale), one = _mm512_set1_ps(1.0f);
  for (; j + 16 <= H; j += 16) {
    const __m512 y = _mm512_mul_ps(_mm512_loadu_ps(s + j), sc);
    const __m512 v = unit_offset ? _mm512_mul_ps(y, _mm512_add_ps(one, Load16(w + j)))
                                 : _mm512_mul_ps(Load16(w + j), Widen16(Round16(y)));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(o + j), Round16(v));
  }
#endif
  for (; j < H; ++j) {
    const float y = s[j] * scale;
    o[j] = FloatToBf16(unit_offset ? y * (1.0f + Bf16ToFloat(w[j])) : Bf16ToFloat(w[j]) * Bf16ToFloat(FloatToBf16(y)));
  }
}

// Rows [r0, r1); s goes to the sum output's row, or to `scratch` [H].
void NormRows(const Problem& p, int64_t r0, int64_t r1, float* scratch) {
  const int64_t H = p.h;
  for (int64_t r = r0; r < r1; ++r) {
    float* s = p.sum ? p.sum + r * H : scratch;
    const float total = SumRow(p.x + r * H, p.delta ? p.delta + r * H : nullptr, s, H);
    ScaleRow(s, p.w, 1.0f / std::sqrt(total / static_cast<float>(H) + p.eps), p.unit_offset, p.out + r * H, H);
  }
}

struct ParallelNorm {
  Problem p;
  int64_t per_item;  // rows
  WorkQueue work;
  void Drain() {
    int64_t i = work.Claim();
    if (i >= work.total) return;
    std::unique_ptr<float[]> scratch(new float[p.h]);
    for (; i < work.total; i = work.Claim()) {
      NormRows(p, i * per_item, std::min(p.rows, (i + 1) * per_item), scratch.get());
      work.Finish();
    }
  }
};

ffi::Error RmsNormImpl(ffi::ThreadPool pool, ffi::AnyBuffer x, ffi::AnyBuffer delta, ffi::AnyBuffer weight,
                       ffi::Buffer<ffi::S32> layer, float eps, int64_t unit_offset, ffi::Result<ffi::AnyBuffer> sum,
                       ffi::Result<ffi::AnyBuffer> out) {
  auto fail = [](const std::string& what) { return ffi::Error::InvalidArgument("rms_norm: " + what); };
  const auto xd = x.dimensions(), wd = weight.dimensions();
  if (xd.size() != 2) return fail("x must be [T, H]");
  const int64_t T = xd[0], H = xd[1];
  if (x.element_type() != ffi::BF16 || weight.element_type() != ffi::BF16 || out->element_type() != ffi::BF16)
    return fail("x, weight and out must be bfloat16");
  if (wd.size() != 2 || wd[1] != H) return fail("weight must be [L, H]");
  const bool has_delta = delta.element_count() > 0;
  if (has_delta && (delta.element_type() != ffi::BF16 || delta.element_count() != T * H))
    return fail("delta must be bfloat16 [T, H] or empty");
  if (has_delta != (sum->element_count() > 0)) return fail("sum is [T, H] exactly when delta is");
  if (has_delta && sum->element_type() != ffi::F32) return fail("sum must be float32");
  auto state = std::make_shared<ParallelNorm>();
  Problem& p = state->p;
  p.x = static_cast<const uint16_t*>(x.untyped_data());
  p.delta = has_delta ? static_cast<const uint16_t*>(delta.untyped_data()) : nullptr;
  p.w = static_cast<const uint16_t*>(weight.untyped_data()) + std::clamp<int64_t>(layer.typed_data()[0], 0, wd[0] - 1) * H;
  p.eps = eps;
  p.unit_offset = unit_offset != 0;
  p.sum = has_delta ? static_cast<float*>(sum->untyped_data()) : nullptr;
  p.out = static_cast<uint16_t*>(out->untyped_data());
  p.rows = T, p.h = H;
  if (T == 0 || H == 0) return ffi::Error::Success();
  RunUnits(pool, state, T, kRowsPerItem, kParallelElements / H);
  return ffi::Error::Success();
}

// out = bf16(bf16(s) + f32(delta)) over elements [i0, i1).
void AddRoundRange(const float* s, const uint16_t* delta, uint16_t* out, int64_t i0, int64_t i1) {
#if defined(__AVX512F__) && defined(__AVX512BF16__)
  for (; i0 + 16 <= i1; i0 += 16) {
    const __m512 a = Widen16(Round16(_mm512_loadu_ps(s + i0)));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + i0), Round16(_mm512_add_ps(a, Load16(delta + i0))));
  }
#endif
  for (int64_t i = i0; i < i1; ++i) out[i] = FloatToBf16(Bf16ToFloat(FloatToBf16(s[i])) + Bf16ToFloat(delta[i]));
}

struct ParallelAdd {
  const float* s;
  const uint16_t* delta;
  uint16_t* out;
  int64_t n, per_item;  // elements
  WorkQueue work;
  void Drain() {
    DrainRanges(work, n, per_item, [&](int64_t lo, int64_t hi) { AddRoundRange(s, delta, out, lo, hi); });
  }
};

ffi::Error AddRoundImpl(ffi::ThreadPool pool, ffi::AnyBuffer s, ffi::AnyBuffer delta,
                        ffi::Result<ffi::AnyBuffer> out) {
  if (s.element_type() != ffi::F32 || delta.element_type() != ffi::BF16 || out->element_type() != ffi::BF16)
    return ffi::Error::InvalidArgument("add_round: s must be float32, delta and out bfloat16");
  const int64_t n = s.element_count();
  if (delta.element_count() != n || out->element_count() != n)
    return ffi::Error::InvalidArgument("add_round: s, delta and out must have one shape");
  auto state = std::make_shared<ParallelAdd>();
  state->s = static_cast<const float*>(s.untyped_data());
  state->delta = static_cast<const uint16_t*>(delta.untyped_data());
  state->out = static_cast<uint16_t*>(out->untyped_data());
  state->n = n;
  RunUnits(pool, state, n, kParallelElements, 2 * kParallelElements);
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxpagedRmsNorm, RmsNormImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::AnyBuffer>()         // x
                                  .Arg<ffi::AnyBuffer>()         // delta
                                  .Arg<ffi::AnyBuffer>()         // weight
                                  .Arg<ffi::Buffer<ffi::S32>>()  // layer
                                  .Attr<float>("eps")
                                  .Attr<int64_t>("unit_offset")
                                  .Ret<ffi::AnyBuffer>()         // sum
                                  .Ret<ffi::AnyBuffer>());       // out

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxpagedAddRound, AddRoundImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::AnyBuffer>()         // s
                                  .Arg<ffi::AnyBuffer>()         // delta
                                  .Ret<ffi::AnyBuffer>());       // out
