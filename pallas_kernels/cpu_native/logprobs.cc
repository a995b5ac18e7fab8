// Native CPU log-probs of a step's rows: each row's top K and its sampled token's, an XLA FFI custom call (built and
// registered by native.py).
//
//   JaxpagedLogprobs
//     logits   [S, V]  float32   a step's logits, as the model gave them
//     tokens   [S]     int32     the token sampled in each row, in [0, V) (another index gives NaN)
//     chosen   [S]     float32   log p(tokens[r]) of each row
//     ranks    [S]     int32     how many logits of the row are >= tokens[r]'s, itself included (0 for a NaN one)
//     values   [S, K]  float32   each row's K largest log-probs, largest first, 1 <= K <= min(V, 64)
//     indices  [S, K]  int32     their tokens: jax.lax.top_k(logits, K)'s indices exactly (its total order of floats:
//                                NaN above +inf, -0 below +0, equal logits by ascending index)
//
// A log-prob is (logit - m) - lse in float32, m the row's maximum and lse = log(sum_j exp(logit_j - m)), the sum taken
// in float64 (within ~1e-6 of the float64 log-softmax; XLA's float32 sum, jaxpaged.worker.sampler's other path, is
// within ~1e-5), so the ranking by logit is the ranking by log-prob.
//
// Why: XLA CPU's log-softmax and TopK of a 256-row step of SmolLM2's vocabulary took ~52 ms whenever a row asked for
// log-probs (benchmarks/sampler_draw.py): the [S, V] log-probs written, then sorted. Here a row is two passes and
// writes nothing of size V: the top K of the logits, 16 keys at a time compared with the K-th key so far (a lane
// strictly above it is inserted into the K sorted ones; random rows insert ~K ln(V / K) tokens in all), then the sum
// of the exponentials, which also counts the logits at or above the token's (its rank). Rows are split over XLA's
// intra-op pool.

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#endif

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <memory>

#include "vec_math.h"
#include "work_queue.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;
using jaxpaged_native::DrainRanges;
using jaxpaged_native::OrderKey;
using jaxpaged_native::RunUnits;
using jaxpaged_native::WorkQueue;

namespace {

constexpr int64_t kRowsPerItem = 1;
constexpr int64_t kMaxK = 64;

// The K largest keys of a row in descending order, equal keys by ascending index; `Offer` takes a row's tokens in
// ascending index order: any key while fewer than K are held, then only keys above keys[K - 1].
struct TopKeys {
  int64_t k, size;
  uint32_t keys[kMaxK];
  int32_t* at;  // [K]
  void Offer(uint32_t key, int32_t index) {
    int64_t pos = size < k ? size++ : k - 1;
    for (; pos > 0 && keys[pos - 1] < key; --pos) keys[pos] = keys[pos - 1], at[pos] = at[pos - 1];
    keys[pos] = key, at[pos] = index;
  }
};

// The top K of a row of logits into `indices` (jax.lax.top_k's order).
void RowTopK(const float* x, int64_t v, int64_t k, int32_t* indices) {
  TopKeys top{k, 0, {}, indices};
  int64_t j = 0;
  for (; j < k; ++j) top.Offer(OrderKey(x[j]), static_cast<int32_t>(j));
#if defined(__AVX512F__)
  const __m512i sign = _mm512_set1_epi32(static_cast<int32_t>(0x80000000u));
  for (; j + 16 <= v; j += 16) {  // 16 keys as OrderKey makes them, compared unsigned with the K-th
    const __m512i bits = _mm512_loadu_si512(x + j);
    const __mmask16 negative = _mm512_cmplt_epi32_mask(bits, _mm512_setzero_si512());
    const __m512i key = _mm512_mask_xor_epi32(_mm512_or_si512(bits, sign), negative, bits, _mm512_set1_epi32(-1));
    __mmask16 above = _mm512_cmpgt_epu32_mask(key, _mm512_set1_epi32(static_cast<int32_t>(top.keys[k - 1])));
    while (above) {  // in lane order, ascending index; each insertion raises the K-th key
      const int lane = __builtin_ctz(above);
      const uint32_t lane_key = OrderKey(x[j + lane]);
      if (lane_key > top.keys[k - 1]) top.Offer(lane_key, static_cast<int32_t>(j + lane));
      above &= above - 1;
    }
  }
#endif
  for (; j < v; ++j) {
    const uint32_t key = OrderKey(x[j]);
    if (key > top.keys[k - 1]) top.Offer(key, static_cast<int32_t>(j));
  }
}

// sum_j exp(x[j] - m) in float64, for x[j] <= m (below exp(-87) a term is ~1e-38, not 0: V of them add < 1e-32 to a
// sum of at least 1); and, in the same pass, how many x[j] >= t (`*at_or_above`; NaN compares false).
double SumExp(const float* x, float m, int64_t v, float t, int64_t* at_or_above) {
  double sum = 0.0;
  int64_t count = 0;
  int64_t j = 0;
#if defined(__AVX512F__)
  const __m512 mv = _mm512_set1_ps(m);
  const __m512 tv = _mm512_set1_ps(t);
  __m512 acc = _mm512_setzero_ps();  // per 16-element block in float32, then every 64 blocks' sum in float64
  for (; j + 16 <= v; j += 16) {
    const __m512 xj = _mm512_loadu_ps(x + j);
    acc = _mm512_add_ps(acc, jaxpaged_native::Exp16NonPositive(_mm512_sub_ps(xj, mv)));
    count += __builtin_popcount(_mm512_cmp_ps_mask(xj, tv, _CMP_GE_OQ));
    if ((j & 1023) == 1008) {
      sum += _mm512_reduce_add_ps(acc);
      acc = _mm512_setzero_ps();
    }
  }
  sum += _mm512_reduce_add_ps(acc);
#endif
  for (; j < v; ++j) {
    sum += std::exp(static_cast<double>(x[j]) - m);
    count += x[j] >= t;
  }
  *at_or_above = count;
  return sum;
}

void RowLogprobs(const float* x, int64_t v, int64_t k, int32_t token, float* chosen, int32_t* rank, float* values,
                 int32_t* indices) {
  RowTopK(x, v, k, indices);
  const float m = x[indices[0]];  // the row's maximum (a NaN or inf in the row makes every log-prob NaN, as in XLA)
  const bool valid = token >= 0 && token < v;
  int64_t at_or_above = 0;
  const float lse = static_cast<float>(
      std::log(SumExp(x, m, v, valid ? x[token] : std::numeric_limits<float>::quiet_NaN(), &at_or_above)));
  for (int64_t i = 0; i < k; ++i) values[i] = (x[indices[i]] - m) - lse;
  *chosen = valid ? (x[token] - m) - lse : std::numeric_limits<float>::quiet_NaN();
  *rank = static_cast<int32_t>(at_or_above);
}

struct ParallelLogprobs {
  const float* logits;
  const int32_t* tokens;
  float* chosen;
  int32_t* ranks;
  float* values;
  int32_t* indices;
  int64_t rows, v, k, per_item;
  WorkQueue work;
  void Drain() {
    DrainRanges(work, rows, per_item, [&](int64_t lo, int64_t hi) {
      for (int64_t r = lo; r < hi; ++r)
        RowLogprobs(logits + r * v, v, k, tokens[r], chosen + r, ranks + r, values + r * k, indices + r * k);
    });
  }
};

ffi::Error LogprobsImpl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> logits, ffi::Buffer<ffi::S32> tokens,
                        ffi::Result<ffi::Buffer<ffi::F32>> chosen, ffi::Result<ffi::Buffer<ffi::S32>> ranks,
                        ffi::Result<ffi::Buffer<ffi::F32>> values, ffi::Result<ffi::Buffer<ffi::S32>> indices) {
  const auto d = logits.dimensions();
  const auto dv = values->dimensions();
  const auto di = indices->dimensions();
  if (d.size() != 2 || dv.size() != 2 || di.size() != 2 || dv[0] != d[0] || di[0] != d[0] || di[1] != dv[1])
    return ffi::Error::InvalidArgument("logprobs: logits must be [S, V], values and indices [S, K]");
  if (tokens.element_count() != static_cast<size_t>(d[0]) || chosen->element_count() != static_cast<size_t>(d[0]) ||
      ranks->element_count() != static_cast<size_t>(d[0]))
    return ffi::Error::InvalidArgument("logprobs: tokens, chosen and ranks must be [S]");
  if (dv[1] < 1 || dv[1] > kMaxK || dv[1] > d[1])
    return ffi::Error::InvalidArgument("logprobs: K must be in [1, min(V, 64)]");
  if (d[1] >= (int64_t{1} << 31)) return ffi::Error::InvalidArgument("logprobs: V must be below 2^31");
  auto state = std::make_shared<ParallelLogprobs>();
  state->logits = logits.typed_data();
  state->tokens = tokens.typed_data();
  state->chosen = chosen->typed_data();
  state->ranks = ranks->typed_data();
  state->values = values->typed_data();
  state->indices = indices->typed_data();
  state->rows = d[0];
  state->v = d[1];
  state->k = dv[1];
  RunUnits(pool, state, d[0], kRowsPerItem, 2);
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxpagedLogprobs, LogprobsImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()    // logits
                                  .Arg<ffi::Buffer<ffi::S32>>()    // tokens
                                  .Ret<ffi::Buffer<ffi::F32>>()    // chosen
                                  .Ret<ffi::Buffer<ffi::S32>>()    // ranks
                                  .Ret<ffi::Buffer<ffi::F32>>()    // values
                                  .Ret<ffi::Buffer<ffi::S32>>());  // indices
