// Native CPU top-k / top-p threshold of each row of a step's logits, an XLA FFI custom call (built and registered by
// native.py).
//
//   JaxpagedTopPThreshold
//     logits  [S, V]  float32   a step's logits, temperature-scaled
//     k       [S]     int32     each row's top-k, in [1, V] (V: no top-k)
//     top_p   [S]     float32   each row's top-p, in (0, 1] (>= 1: no top-p)
//     out     [S]     float32   each row's threshold: the sampler keeps the tokens whose logit is at or above it.
//                               The value of the last token of the row sorted in descending order that lies within
//                               the top k and within the nucleus (the smallest prefix whose mass reaches top_p, its
//                               first token always); ties all kept. As jaxpaged.worker.sampler._threshold_by_sort,
//                               except where a prefix's mass is within rounding of top_p (the masses here are summed
//                               in float64, there in float32). A row without a finite maximum gives its maximum.
//
// Why: XLA CPU sorts a row of SmolLM2's 49152 logits in ~10 ms, and its bisection (`_threshold_by_search`: 32
// passes over the row) still took ~1/3 of a sampled decode step of 48 rows. Here a row is a radix select: after a
// pass for its maximum and one for exp(logit - maximum), three passes put the row's tokens into bins by 11, 11 and
// 10 bits of their order-preserving keys, from the top bits down, each pass only the tokens of the bin the previous
// one chose, with each bin's token count and mass; walking the bins from the largest keys down finds the bin where
// the kept prefix ends (its count reaches k or its mass p), and the last pass's bin is one key: the threshold. Rows
// are split over XLA's intra-op pool.

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#endif

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <memory>
#include <vector>

#include "vec_math.h"
#include "work_queue.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;
using jaxpaged_native::DrainRanges;
using jaxpaged_native::FromOrderKey;
using jaxpaged_native::OrderKey;
using jaxpaged_native::RunUnits;
using jaxpaged_native::WorkQueue;

namespace {

constexpr int64_t kRowsPerItem = 1;

float RowMax(const float* x, int64_t v) {
  float m = -std::numeric_limits<float>::infinity();
  int64_t j = 0;
#if defined(__AVX512F__)
  __m512 acc = _mm512_set1_ps(m);
  for (; j + 16 <= v; j += 16) acc = _mm512_max_ps(_mm512_loadu_ps(x + j), acc);  // a NaN of x: acc kept
  m = _mm512_reduce_max_ps(acc);
#endif
  for (; j < v; ++j) m = x[j] > m ? x[j] : m;
  return m;
}

// e[j] = exp(x[j] - m) for x[j] <= m (below exp(-87) a token's weight is ~1e-38, not 0: no count changes, and V of
// them add under 1e-32 to a mass of at least 1). Returns their sum, in float64.
double Exponentials(const float* x, float m, int64_t v, float* e) {
  double sum = 0.0;
  int64_t j = 0;
#if defined(__AVX512F__)
  const __m512 mv = _mm512_set1_ps(m);
  __m512 acc = _mm512_setzero_ps();  // per 16-element block in float32, then each block's sum in float64
  for (; j + 16 <= v; j += 16) {
    const __m512 y = jaxpaged_native::Exp16NonPositive(_mm512_sub_ps(_mm512_loadu_ps(x + j), mv));
    _mm512_storeu_ps(e + j, y);
    acc = _mm512_add_ps(acc, y);
    if ((j & 1023) == 1008) {  // every 64 blocks: float32 partial sums of at most 64 terms of <= 1 each
      sum += _mm512_reduce_add_ps(acc);
      acc = _mm512_setzero_ps();
    }
  }
  sum += _mm512_reduce_add_ps(acc);
#endif
  for (; j < v; ++j) sum += (e[j] = std::exp(std::max(x[j] - m, -87.0f)));
  return sum;
}

struct Bins {
  static constexpr int kMax = 2048;
  int32_t count[kMax];
  double mass[kMax];
};

// The threshold of one row (see the header). `e` is scratch of V floats.
float RowThreshold(const float* x, int64_t v, int32_t k, float top_p, float* e, Bins& bins) {
  const float m = RowMax(x, v);
  const bool everything = !(top_p < 1.0f);
  if (k >= v && everything) {  // no filter for this row: its smallest logit keeps every token
    float lo = std::numeric_limits<float>::infinity();
    for (int64_t j = 0; j < v; ++j) lo = std::min(lo, x[j]);
    return lo;
  }
  if (!std::isfinite(m)) return m;  // every logit -inf (or one is +inf: the mass is all its)
  const double target = static_cast<double>(top_p) * Exponentials(x, m, v, e);
  // The kept prefix ends at the largest key t such that the tokens above t are fewer than k and weigh less than
  // target, while those at or above t are k or more, or weigh target or more. Bins narrow t from the top bits down.
  int64_t above_count = 0;
  double above_mass = 0.0;
  uint32_t prefix = 0;  // t's bits chosen so far
  constexpr int kShifts[3] = {21, 10, 0};
  constexpr int kWidths[3] = {11, 11, 10};
  for (int level = 0; level < 3; ++level) {
    const int shift = kShifts[level], nbins = 1 << kWidths[level];
    const uint32_t high_mask = level == 0 ? 0u : ~((uint32_t{1} << (shift + kWidths[level])) - 1u);
    std::fill(bins.count, bins.count + nbins, 0);
    std::fill(bins.mass, bins.mass + nbins, 0.0);
    for (int64_t j = 0; j < v; ++j) {
      const uint32_t key = OrderKey(x[j]);
      if ((key & high_mask) != prefix) continue;
      const uint32_t b = (key >> shift) & (nbins - 1);
      bins.count[b] += 1;
      bins.mass[b] += e[j];
    }
    int b = nbins - 1;
    for (; b > 0; --b) {  // bin 0 takes the rest: the prefix then ends at the row's smallest key or within bin 0
      const int64_t c = above_count + bins.count[b];
      const double w = above_mass + bins.mass[b];
      if (bins.count[b] > 0 && (c >= k || (!everything && w >= target))) break;
      above_count = c;
      above_mass = w;
    }
    prefix |= static_cast<uint32_t>(b) << shift;
    if (level == 2 && b > 0) return FromOrderKey(prefix);  // a key that a token holds
  }
  // The last level's bin 0 was taken (the prefix ends at a key with those bits, or every token is kept): the smallest
  // logit at or above t.
  float threshold = std::numeric_limits<float>::infinity();
  for (int64_t j = 0; j < v; ++j)
    if (OrderKey(x[j]) >= prefix) threshold = std::min(threshold, x[j]);
  return threshold;
}

struct ParallelThreshold {
  const float* logits;
  const int32_t* k;
  const float* top_p;
  float* out;
  int64_t rows, v, per_item;
  WorkQueue work;

  void Drain() {
    thread_local std::vector<float> e;
    thread_local std::unique_ptr<Bins> bins;
    if (static_cast<int64_t>(e.size()) < v) e.resize(v);
    if (!bins) bins = std::make_unique<Bins>();
    DrainRanges(work, rows, per_item, [&](int64_t lo, int64_t hi) {
      for (int64_t r = lo; r < hi; ++r) out[r] = RowThreshold(logits + r * v, v, k[r], top_p[r], e.data(), *bins);
    });
  }
};

ffi::Error TopPThresholdImpl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> logits, ffi::Buffer<ffi::S32> k,
                             ffi::Buffer<ffi::F32> top_p, ffi::Result<ffi::Buffer<ffi::F32>> out) {
  const auto d = logits.dimensions();
  if (d.size() != 2) return ffi::Error::InvalidArgument("top_p_threshold: logits must be [S, V]");
  const size_t s = static_cast<size_t>(d[0]);
  if (k.element_count() != s || top_p.element_count() != s || out->element_count() != s)
    return ffi::Error::InvalidArgument("top_p_threshold: k, top_p and out must be [S]");
  if (d[1] >= (int64_t{1} << 31)) return ffi::Error::InvalidArgument("top_p_threshold: V must be below 2^31");
  auto state = std::make_shared<ParallelThreshold>();
  state->logits = logits.typed_data();
  state->k = k.typed_data();
  state->top_p = top_p.typed_data();
  state->out = out->typed_data();
  state->rows = d[0];
  state->v = d[1];
  RunUnits(pool, state, d[0], kRowsPerItem, 2);
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxpagedTopPThreshold, TopPThresholdImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()    // logits
                                  .Arg<ffi::Buffer<ffi::S32>>()    // k
                                  .Arg<ffi::Buffer<ffi::F32>>()    // top_p
                                  .Ret<ffi::Buffer<ffi::F32>>());  // out
