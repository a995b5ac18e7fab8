// Native CPU argmax of each row of a float32 matrix, an XLA FFI custom call (built and registered by native.py).
//
//   JaxpagedArgmax
//     x    [S, V]  float32   a step's logits (or logits plus Gumbel noise)
//     out  [S]     int32     the index of each row's first maximum, as jnp.argmax(x, axis=-1) gives it; NaN is
//                            never the maximum here, and a row of NaN / -inf gives 0
//
// Why: the sampler's argmax over a [64, 49152] float32 step of logits ran in XLA CPU as two passes over the
// logits (XLA folds the row maximum back into the index search), 0.7 ms each in a decode step of SmolLM2
// (benchmarks/step_anatomy.py's per-operation profile). Here each row is one pass: 16 lanes x 4 independent
// (maximum, index) pairs, kept by a strict > so that each lane holds its first maximum, then the pairs and the lanes
// merged by value and, among equal values, by the smaller index. Rows are split over XLA's intra-op pool.

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>  // the AVX-512 paths below, each under the macros of the instructions it uses
#endif

#include <algorithm>
#include <cstdint>
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

constexpr int64_t kRowsPerItem = 4;

int32_t RowArgmax(const float* x, int64_t v) {
  float best = -std::numeric_limits<float>::infinity();
  int64_t at = 0;
  int64_t j = 0;
#if defined(__AVX512F__)
  constexpr int kPairs = 4;
  if (v >= 16 * kPairs) {
    __m512 m[kPairs];
    __m512i idx[kPairs];
    const __m512i lane = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    for (int p = 0; p < kPairs; ++p) {
      m[p] = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
      idx[p] = _mm512_setzero_si512();
    }
    __m512i pos = lane;  // indices of the lanes of the group at j
    const __m512i step = _mm512_set1_epi32(16);
    for (; j + 16 * kPairs <= v; j += 16 * kPairs) {
#pragma GCC unroll 4
      for (int p = 0; p < kPairs; ++p) {
        const __m512 y = _mm512_loadu_ps(x + j + 16 * p);
        const __mmask16 larger = _mm512_cmp_ps_mask(y, m[p], _CMP_GT_OQ);  // strict: a lane keeps its first max
        m[p] = _mm512_mask_mov_ps(m[p], larger, y);
        idx[p] = _mm512_mask_mov_epi32(idx[p], larger, pos);
        pos = _mm512_add_epi32(pos, step);
      }
    }
    for (int p = 0; p < kPairs; ++p) jaxpaged_native::FoldLanes16(m[p], idx[p], best, at);
  }
#endif
  for (; j < v; ++j)
    if (x[j] > best) best = x[j], at = j;  // later indices: only a strictly larger value wins
  return static_cast<int32_t>(at);
}

struct ParallelArgmax {
  const float* x;
  int32_t* out;
  int64_t rows, v, per_item;
  WorkQueue work;
  void Drain() {
    DrainRanges(work, rows, per_item, [&](int64_t lo, int64_t hi) {
      for (int64_t r = lo; r < hi; ++r) out[r] = RowArgmax(x + r * v, v);
    });
  }
};

ffi::Error ArgmaxImpl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::Result<ffi::Buffer<ffi::S32>> out) {
  const auto d = x.dimensions();
  if (d.size() != 2 || out->element_count() != static_cast<size_t>(d[0]))
    return ffi::Error::InvalidArgument("argmax: x must be [S, V] and out [S]");
  if (d[1] >= (int64_t{1} << 31)) return ffi::Error::InvalidArgument("argmax: V must be below 2^31");
  auto state = std::make_shared<ParallelArgmax>();
  state->x = x.typed_data();
  state->out = out->typed_data();
  state->rows = d[0];
  state->v = d[1];
  RunUnits(pool, state, d[0], kRowsPerItem, 2);
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxpagedArgmax, ArgmaxImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()    // x
                                  .Ret<ffi::Buffer<ffi::S32>>());  // out
