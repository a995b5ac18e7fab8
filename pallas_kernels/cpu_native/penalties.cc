// Native CPU repetition, frequency and presence penalties on a step's logits, an XLA FFI custom call (built and
// registered by native.py).
//
//   JaxpagedPenalties
//     logits        [S, V]  float32   a step's logits
//     seen          [S, L]  int32     each row's tokens, prompt then output; -1 = padding
//     output_start  [S]     int32     index in `seen` of the row's first output token
//     pending       [S]     int32     an output token of the row not in `seen` (-1 = none)
//     presence      [S]     float32   OpenAI's presence penalty (0 = off)
//     frequency     [S]     float32   OpenAI's frequency penalty (0 = off)
//     repetition    [S]     float32   Hugging Face's repetition penalty (1 = off)
//     out           [S, V]  float32   the logits penalized, bit for bit as jaxpaged.worker.sampler's XLA version:
//                                     a token seen anywhere (prompt, output, pending) is multiplied by
//                                     1 / `repetition` where positive and by `repetition` otherwise, then a token
//                                     generated count > 0 times loses frequency * count + presence; ids outside
//                                     [0, V) are ignored
//
// Why: XLA builds each row's token counts as dense [S, V] arrays (scatters into zeros, then several passes over
// them), so the cost grows with the vocabulary though a row touches at most L of its V logits. Here each row is
// copied once, then only its seen tokens are visited: twice each, once to count them into a per-thread table of V
// counters and once to penalize the logit and clear the counter. A row without penalties is only copied. Rows are
// split over XLA's intra-op pool.

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <memory>
#include <vector>

#include "work_queue.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;
using jaxpaged_native::DrainRanges;
using jaxpaged_native::RunUnits;
using jaxpaged_native::WorkQueue;

namespace {

constexpr int64_t kRowsPerItem = 4;

struct ParallelPenalties {
  const float* logits;
  const int32_t* seen;
  const int32_t* output_start;
  const int32_t* pending;
  const float* presence;
  const float* frequency;
  const float* repetition;
  float* out;
  int64_t rows, v, l, per_item;
  WorkQueue work;

  // A token's visit: (its output occurrences + 1), 0 while unseen; every touched entry is back to 0 after a row.
  static std::vector<int32_t>& Counters(int64_t v) {
    thread_local std::vector<int32_t> counters;
    if (static_cast<int64_t>(counters.size()) < v) counters.assign(v, 0);
    return counters;
  }

  void Count(int32_t* counts, int32_t t, bool output) const {
    if (t < 0 || t >= v) return;
    counts[t] = std::max(counts[t], 1) + (output ? 1 : 0);
  }

  // The same float operations, in the same order, as sampler._penalize; each token once (its counter cleared).
  void Penalize(float* row, int32_t* counts, int32_t t, float rep, float freq, float pres) const {
    if (t < 0 || t >= v || counts[t] == 0) return;
    const float c = static_cast<float>(counts[t] - 1);
    counts[t] = 0;
    float x = row[t];
    x = x > 0.0f ? x * (1.0f / rep) : x * rep;
    if (c > 0.0f) x = x - (freq * c + pres);
    row[t] = x;
  }

  void Row(int64_t r) const {
    float* row = out + r * v;
    if (row != logits + r * v) std::memcpy(row, logits + r * v, sizeof(float) * v);
    const float rep = repetition[r], freq = frequency[r], pres = presence[r];
    if (rep == 1.0f && freq == 0.0f && pres == 0.0f) return;  // exact: x / 1, x * 1 and x - 0 are x
    int32_t* counts = Counters(v).data();
    const int32_t* ids = seen + r * l;
    const int64_t start = output_start[r];
    for (int64_t j = 0; j < l; ++j) Count(counts, ids[j], j >= start);
    Count(counts, pending[r], true);
    for (int64_t j = 0; j < l; ++j) Penalize(row, counts, ids[j], rep, freq, pres);
    Penalize(row, counts, pending[r], rep, freq, pres);
  }

  void Drain() {
    DrainRanges(work, rows, per_item, [&](int64_t lo, int64_t hi) {
      for (int64_t r = lo; r < hi; ++r) Row(r);
    });
  }
};

ffi::Error PenaltiesImpl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> logits, ffi::Buffer<ffi::S32> seen,
                         ffi::Buffer<ffi::S32> output_start, ffi::Buffer<ffi::S32> pending,
                         ffi::Buffer<ffi::F32> presence, ffi::Buffer<ffi::F32> frequency,
                         ffi::Buffer<ffi::F32> repetition, ffi::Result<ffi::Buffer<ffi::F32>> out) {
  const auto d = logits.dimensions();
  const auto ds = seen.dimensions();
  if (d.size() != 2 || ds.size() != 2 || ds[0] != d[0])
    return ffi::Error::InvalidArgument("penalties: logits must be [S, V] and seen [S, L]");
  const size_t s = static_cast<size_t>(d[0]);
  if (output_start.element_count() != s || pending.element_count() != s || presence.element_count() != s ||
      frequency.element_count() != s || repetition.element_count() != s || out->element_count() != s * d[1])
    return ffi::Error::InvalidArgument("penalties: the per-row arguments must be [S] and out [S, V]");
  auto state = std::make_shared<ParallelPenalties>();
  state->logits = logits.typed_data();
  state->seen = seen.typed_data();
  state->output_start = output_start.typed_data();
  state->pending = pending.typed_data();
  state->presence = presence.typed_data();
  state->frequency = frequency.typed_data();
  state->repetition = repetition.typed_data();
  state->out = out->typed_data();
  state->rows = d[0];
  state->v = d[1];
  state->l = ds[1];
  RunUnits(pool, state, d[0], kRowsPerItem, 2);
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxpagedPenalties, PenaltiesImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()    // logits
                                  .Arg<ffi::Buffer<ffi::S32>>()    // seen
                                  .Arg<ffi::Buffer<ffi::S32>>()    // output_start
                                  .Arg<ffi::Buffer<ffi::S32>>()    // pending
                                  .Arg<ffi::Buffer<ffi::F32>>()    // presence
                                  .Arg<ffi::Buffer<ffi::F32>>()    // frequency
                                  .Arg<ffi::Buffer<ffi::F32>>()    // repetition
                                  .Ret<ffi::Buffer<ffi::F32>>());  // out
