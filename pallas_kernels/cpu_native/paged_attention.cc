// Native CPU ragged paged attention, an XLA FFI custom call (built and registered by native.py).
//
// Any ragged batch: sequence s owns the query tokens [query_start_loc[s], query_start_loc[s + 1]) (one for a
// decode, a chunk of its prompt for a prefill), and every query token attends causally to its sequence's cache,
// which already holds this step's K/V (the engine writes them first). The rules are those of
// pallas_kernels/reference.py; layouts (row-major, C order):
//   q               [T, Hq, D]            float32 or bfloat16   queries of the step's tokens
//   k_cache/v_cache [L, NB, BS, Hkv, D]   q's dtype, or fp8     the whole stacked pool (no per-layer slice);
//                                         (float8_e4m3fn, float8_e5m2: its values are k_cache * k_scale, ...)
//   layer           [] int32                                    which layer of the pool to read
//   block_tables    [S, W] int32                                logical -> physical block of each sequence
//   context_lens    [S] int32                                   cached tokens of sequence s (0: padding sequence)
//   query_start_loc [S + 1] int32                               sequence s's queries are tokens [qsl[s], qsl[s+1])
//   positions       [T] int32                                   absolute position of each token (-1: padding)
//   prompt_lens     [S] int32                                   prompt tokens of sequence s (-1: not given)
//   kv_scales       [2] float32                                 (k_scale, v_scale): 1 for pools that are not fp8
//   attributes      scale (f32), sliding_window (i64, 0 = none), soft_cap (f32, 0 = none)
//   out             [T, Hq, D]            q's dtype             0 on rows that no real sequence owns
//
// Query head h reads kv head h / G, G = Hq / Hkv. Sequence s's query at position p sees the cached positions
// [lo, hi) with hi = min(context_lens[s], p + 1, W * BS) and lo = max(0, p - sliding_window + 1) (0 without a
// window): only the blocks and offsets of that range are read, so pool slots outside the context (which may hold
// NaN) are never touched, and a prefill token reads only the blocks up to its own position (causal: no masked
// work). Block ids are clipped to [0, NB) and the layer to [0, L), so nothing is read out of bounds; a token that
// no sequence owns, or with position -1, gives a 0 row.
//
// Work items. Which path a query token takes depends on the token alone, never on how its sequence's tokens were cut
// into steps: its prompt tokens (positions < prompt_lens[s]) run in tiles, its other tokens (a decode, or a verified
// token and its proposals) one per token. So a prompt token gives the same bits as one chunk of a long prompt, as the
// short tail after a prefix-cache hit, or in whatever chunk the step's token budget left it, and a generated token
// the same bits in a decode step, a verifying step or a recompute after preemption (both paths are exact per row:
// a row's sums run over the same keys in the same order whatever else the tile or step holds). Without prompt_lens
// (-1) a sequence with at most kMaxPerTokenRun tokens this step runs per token, a longer one in tiles.
// A per-token item (a "decode") is one token and a range of its kv heads (all of
// them when the batch has enough tokens to keep every thread busy, so each block is read as one contiguous run;
// else one kv head per item): the item's query vectors are loaded once (as float32), then the sequence's blocks are
// walked through its block table; per block the (query heads) x (offsets in range) scores, an online softmax
// (running max m and sum l per query head, float32) and acc += p @ V in float32. A prompt chunk (several tokens of
// one sequence) is cut into tiles of 16 query tokens (AttendTile), one work item per tile and kv head, claimed
// before the decodes, longest context first (no thread is left alone with a long tile at the end of a mixed
// step): each block is converted to float32 once per tile and kv head (K transposed), the scores of four (token,
// query head) rows at a time are vectors over the block's offsets, and each row then gets the same online-softmax
// update, with offsets past its own position weighing 0. Over a bfloat16 pool, decode items take AttendItemFast
// and prompt tiles AttendTileFast (AVX512_BF16 dot products; the tile's rows in the lanes) on CPUs that have it.
// Items are claimed from an atomic counter (work_queue.h) by the calling thread
// and by helper tasks on XLA's intra-op thread pool (FFI ThreadPool); the caller works too and then waits only for
// items that were claimed, so it is correct with a pool of any size, including none. The inner loops are written
// over fixed-width lane arrays so that g++ -O3 vectorises them without -ffast-math; exp(score - max) is a
// vectorisable polynomial (ExpNonPositive, ~2e-7 relative error), the rescale factors use std::exp, NaN and inf
// propagate.
//
// An fp8 pool (pallas_kernels/fp8.py) is read as it is, a byte per element, and converted where it is used: to
// float32 by a 256-entry table (AttendItem, AttendTile), or, for the bfloat16 dot-product paths, 32 elements at a
// time to bfloat16 in registers (Fp8ToBf16x32: every fp8 value is exact in bfloat16). Its scales are folded: the
// softmax scale is multiplied by k_scale and each output row by v_scale.

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>  // the AVX-512 paths below, each under the macros of the instructions it uses
#endif

#include <algorithm>
#include <atomic>
#include <cmath>
#include <condition_variable>
#include <cstdint>
#include <cstring>
#include <memory>
#include <mutex>
#include <string>
#include <type_traits>
#include <vector>

#include "vec_math.h"
#include "work_queue.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;
#if defined(__AVX512F__)
using jaxpaged_native::Exp16NonPositive;
#endif
using jaxpaged_native::RunOnPool;
using jaxpaged_native::WorkQueue;

namespace {

constexpr int kLanes = 8;  // 8 measured faster than 16 for head_dim 64 (cheaper lane sum)

inline float ToFloat(float x) { return x; }
inline float ToFloat(uint16_t bf16) {
  uint32_t bits = static_cast<uint32_t>(bf16) << 16;
  float f;
  std::memcpy(&f, &bits, sizeof(f));
  return f;
}

// fp8 pool elements as their raw bits: float8_e4m3fn (4 exponent bits, bias 7, no infinity, NaN = S.1111.111) and
// float8_e5m2 (5 exponent bits, bias 15, IEEE-like: infinities and NaNs).
struct Fp8E4M3 {
  uint8_t bits;
};
struct Fp8E5M2 {
  uint8_t bits;
};
template <typename T>
constexpr bool kIsFp8 = std::is_same_v<T, Fp8E4M3> || std::is_same_v<T, Fp8E5M2>;

// The value of fp8 bits b with kExp exponent bits and 7 - kExp mantissa bits; kFn: no infinities, only S.1..1.1..1
// is NaN (e4m3fn).
template <int kExp, bool kFn>
float DecodeFp8(uint8_t b) {
  constexpr int kMan = 7 - kExp, kBias = (1 << (kExp - 1)) - 1, kTop = (1 << kExp) - 1;
  const int e = (b >> kMan) & kTop, m = b & ((1 << kMan) - 1);
  const float sign = (b & 0x80) ? -1.0f : 1.0f;
  if (kFn ? (e == kTop && m == (1 << kMan) - 1) : e == kTop) return !kFn && m == 0 ? sign * INFINITY : NAN;
  if (e == 0) return sign * std::ldexp(static_cast<float>(m), 1 - kBias - kMan);  // subnormal
  return sign * std::ldexp(static_cast<float>((1 << kMan) | m), e - kBias - kMan);
}

// Every value of one fp8 format: as float32 (the scalar paths) and, for the 128 non-negative bit patterns, as
// bfloat16 bits (exact; NaN as 0x7FC0), four 64-byte rows for Fp8ToBf16x32's two-register permutes.
struct Fp8Table {
  float value[256];
  alignas(64) uint16_t bf16[128];
  template <typename Decode>
  explicit Fp8Table(Decode decode) {
    for (int b = 0; b < 256; ++b) value[b] = decode(static_cast<uint8_t>(b));
    for (int b = 0; b < 128; ++b) {
      uint32_t bits;
      std::memcpy(&bits, &value[b], sizeof(bits));
      bf16[b] = std::isnan(value[b]) ? 0x7FC0 : static_cast<uint16_t>(bits >> 16);  // exact: <= 3 mantissa bits
    }
  }
};
const Fp8Table kE4M3Table(DecodeFp8<4, true>);
const Fp8Table kE5M2Table(DecodeFp8<5, false>);
inline const Fp8Table& TableOf(Fp8E4M3) { return kE4M3Table; }
inline const Fp8Table& TableOf(Fp8E5M2) { return kE5M2Table; }

inline float ToFloat(Fp8E4M3 x) { return kE4M3Table.value[x.bits]; }
inline float ToFloat(Fp8E5M2 x) { return kE5M2Table.value[x.bits]; }

inline void FromFloat(float x, float* out) { *out = x; }
inline void FromFloat(float x, uint16_t* out) {  // round to nearest even, NaN stays NaN
  uint32_t bits;
  std::memcpy(&bits, &x, sizeof(bits));
  if (std::isnan(x)) {
    *out = static_cast<uint16_t>((bits >> 16) | 0x40);
    return;
  }
  bits += 0x7FFF + ((bits >> 16) & 1);
  *out = static_cast<uint16_t>(bits >> 16);
}

// sum_d a[d] * b[d], a float32, b float32 or bf16: partial sums in kLanes lanes (vectorised by g++ without
// -ffast-math: the order of additions is written out), then the lanes in order.
template <typename T>
inline float Dot(const float* a, const T* b, int64_t n) {
  float lanes[kLanes] = {0};
  int64_t d = 0;
  for (; d + kLanes <= n; d += kLanes) {
    for (int l = 0; l < kLanes; ++l) lanes[l] += a[d + l] * ToFloat(b[d + l]);
  }
  float sum = 0.0f;
  for (int l = 0; l < kLanes; ++l) sum += lanes[l];
  for (; d < n; ++d) sum += a[d] * ToFloat(b[d]);
  return sum;
}

// exp(x) for x <= 0 (scores minus their running max), vectorisable: 2^n * e^r with n = round(x / ln 2),
// |r| <= ln 2 / 2, e^r by Cephes' expf polynomial (relative error ~2e-7). Below -87 it returns ~1e-38 instead of
// a denormal or 0 (irrelevant next to the max's weight 1); NaN stays NaN.
inline float ExpNonPositive(float x) {
  x = x < -87.0f ? -87.0f : x;
  const float n = std::floor(x * 1.44269504088896341f + 0.5f);
  const float r = (x - n * 0.693359375f) - n * -2.12194440e-4f;
  float poly = 1.9875691500e-4f;
  poly = poly * r + 1.3981999507e-3f;
  poly = poly * r + 8.3334519073e-3f;
  poly = poly * r + 4.1665795894e-2f;
  poly = poly * r + 1.6666665459e-1f;
  poly = poly * r + 5.0000001201e-1f;
  poly = poly * r * r + r + 1.0f;
  const int32_t bits = (static_cast<int32_t>(n) + 127) << 23;
  float scale;
  std::memcpy(&scale, &bits, sizeof(scale));
  return poly * scale;
}

// acc[d] += p * v[d]
template <typename T>
inline void Axpy(float* __restrict acc, float p, const T* __restrict v, int64_t n) {
  for (int64_t d = 0; d < n; ++d) acc[d] += p * ToFloat(v[d]);
}

struct Problem {
  int64_t num_tokens, num_q_heads, head_dim;
  int64_t num_layers, num_blocks, block_size, num_kv_heads;
  int64_t num_seqs, width;
  int64_t layer;
  const int32_t* block_tables;
  const int32_t* context_lens;
  const int32_t* query_start_loc;
  const int32_t* positions;
  const int32_t* prompt_lens;  // [S]; -1: not given (tiles by run length)
  float scale;             // the softmax scale times k_scale
  float v_scale;           // each output row is multiplied by it
  int64_t sliding_window;  // 0: none
  float soft_cap;          // 0: none

  // Element offset in k_cache / v_cache of kv head kh at offset 0 of sequence s's b-th block in `layer` (the
  // physical id clipped to the pool). Offset j of the block is row_stride = num_kv_heads * head_dim further per j.
  int64_t BlockStart(int64_t s, int64_t b, int64_t kh) const {
    const int64_t physical = std::clamp<int64_t>(block_tables[s * width + b], 0, num_blocks - 1);
    return ((layer * num_blocks + physical) * block_size * num_kv_heads + kh) * head_dim;
  }
};

// The cache positions [lo, hi) that query token `token` of sequence s sees (hi <= lo: none; see the header).
inline void VisibleRange(const Problem& p, int64_t s, int64_t token, int64_t* lo, int64_t* hi) {
  const int64_t context = p.context_lens[s], pos = p.positions[token];
  *hi = context <= 0 || pos < 0 ? 0 : std::min({context, pos + 1, p.width * p.block_size});
  *lo = p.sliding_window > 0 ? std::max<int64_t>(0, pos - p.sliding_window + 1) : 0;
}

// Rows of a pool to prefetch: `rows` rows from `first` on, row_stride elements apart.
struct Rows {
  const void* first = nullptr;
  int64_t rows = 0;
};

// The rows an item reads first in `pool`: the offsets of its first block in [lo, hi) of kv heads [kh0, ...).
template <typename TKV>
inline Rows FirstRows(const Problem& p, const TKV* pool, int64_t s, int64_t token, int64_t kh0) {
  int64_t lo, hi;
  VisibleRange(p, s, token, &lo, &hi);
  if (hi <= lo) return {};
  const int64_t BS = p.block_size, first = lo / BS;
  return {pool + p.BlockStart(s, first, kh0) + (lo - first * BS) * p.num_kv_heads * p.head_dim,
          std::min<int64_t>(BS, hi - first * BS) - (lo - first * BS)};
}

// Per-thread scratch, sized for one work item of `heads` query heads.
struct Scratch {
  std::vector<float> q, acc, scores, m, l;
  Scratch(int64_t heads, int64_t head_dim, int64_t block_size)
      : q(heads * head_dim), acc(heads * head_dim), scores(heads * block_size), m(heads), l(heads) {}
};

// One work item: query token `token` of sequence s, kv heads [kh0, kh1) and their query heads [kh0 * G, kh1 * G)
// (H of them, contiguous in q and out). Writes out[token, kh0 * G : kh1 * G]. Per block, the rows of the item's
// kv heads are contiguous (a whole block when the item has every kv head). q and out are T, the pool TKV (T, or fp8).
template <typename T, typename TKV>
void AttendItem(const Problem& p, const T* q, const TKV* k_cache, const TKV* v_cache, T* out, int64_t s,
                int64_t token, int64_t kh0, int64_t kh1, Scratch& scratch) {
  const int64_t D = p.head_dim, BS = p.block_size, Hkv = p.num_kv_heads;
  const int64_t G = p.num_q_heads / Hkv;
  const int64_t H = (kh1 - kh0) * G;
  const int64_t context = p.context_lens[s];
  if (context <= 0) return;  // padding sequence: its rows stay 0
  const int64_t pos = p.positions[token];
  if (pos < 0) return;  // padding token
  const int64_t hi = std::min({context, pos + 1, p.width * BS});  // exclusive
  const int64_t lo = p.sliding_window > 0 ? std::max<int64_t>(0, pos - p.sliding_window + 1) : 0;
  if (hi <= lo) return;  // nothing visible: 0, as the reference
  const float scale = p.scale, soft_cap = p.soft_cap;

  float* qf = scratch.q.data();
  float* acc = scratch.acc.data();
  float* scores = scratch.scores.data();  // [H, BS]
  float* m = scratch.m.data();
  float* l = scratch.l.data();
  const T* q_rows = q + (token * p.num_q_heads + kh0 * G) * D;
  for (int64_t i = 0; i < H * D; ++i) qf[i] = ToFloat(q_rows[i]);
  std::fill(acc, acc + H * D, 0.0f);
  std::fill(m, m + H, -INFINITY);
  std::fill(l, l + H, 0.0f);

  const int64_t row_stride = Hkv * D;  // between offsets of one block
  for (int64_t b = lo / BS; b * BS < hi; ++b) {
    const int64_t block_start = p.BlockStart(s, b, kh0);
    const TKV* k_block = k_cache + block_start;
    const TKV* v_block = v_cache + block_start;
    const int64_t j0 = std::max<int64_t>(lo - b * BS, 0), j1 = std::min<int64_t>(hi - b * BS, BS);
    const int64_t n = j1 - j0;

    // scores[h * BS + j] for j in [0, n), offset j0 + j; query head h reads kv head kh0 + h / G
    for (int64_t j = 0; j < n; ++j) {
      const TKV* k_row = k_block + (j0 + j) * row_stride;
      for (int64_t h = 0; h < H; ++h) scores[h * BS + j] = Dot(qf + h * D, k_row + (h / G) * D, D) * scale;
    }
    if (soft_cap > 0.0f) {
      for (int64_t h = 0; h < H; ++h)
        for (int64_t j = 0; j < n; ++j) scores[h * BS + j] = soft_cap * std::tanh(scores[h * BS + j] / soft_cap);
    }
    // Online softmax: rescale what came before by exp(m_old - m_new), then p = exp(score - m_new).
    for (int64_t h = 0; h < H; ++h) {
      float* sh = scores + h * BS;
      float block_max = sh[0];
      for (int64_t j = 1; j < n; ++j) block_max = std::max(block_max, sh[j]);
      const float m_new = std::max(m[h], block_max);
      const float alpha = m[h] == -INFINITY ? 0.0f : std::exp(m[h] - m_new);
      float sum = 0.0f;
      for (int64_t j = 0; j < n; ++j) sh[j] = ExpNonPositive(sh[j] - m_new);
      for (int64_t j = 0; j < n; ++j) sum += sh[j];
      l[h] = l[h] * alpha + sum;
      m[h] = m_new;
      if (alpha != 1.0f) {
        float* acc_h = acc + h * D;
        for (int64_t d = 0; d < D; ++d) acc_h[d] *= alpha;
      }
    }
    // acc[h] += sum_j p[h, j] * V[j]
    for (int64_t j = 0; j < n; ++j) {
      const TKV* v_row = v_block + (j0 + j) * row_stride;
      for (int64_t h = 0; h < H; ++h) Axpy(acc + h * D, scores[h * BS + j], v_row + (h / G) * D, D);
    }
  }
  T* out_rows = out + (token * p.num_q_heads + kh0 * G) * D;
  for (int64_t h = 0; h < H; ++h) {
    const float inv = l[h] > 0.0f ? p.v_scale / l[h] : 0.0f;
    for (int64_t d = 0; d < D; ++d) FromFloat(acc[h * D + d] * inv, out_rows + h * D + d);
  }
}

#if defined(__AVX512BF16__)
// ---- bfloat16 decode items with AVX-512 (AVX512_BF16): the same rules and results as AttendItem up to float32
// summation order. Per kv head and chunk of 16 block offsets: the scores of its G query heads are dot products of
// bf16 pairs (VDPBF16PS: exact products, float32 sums; one 16-lane vector per offset, then the 16 vectors' lane
// sums in one vector, offset t in lane t), the online softmax runs on those vectors, and the chunk's V rows are
// converted to float32 once for all G heads. AttendItem converts every K and V element to float32 per query head.
constexpr bool kFastDecode = true;

// Lane t of the result = the sum of v[t]'s 16 lanes (v is overwritten).
inline __m512 LaneSums16(__m512* v) {
  for (int k = 0; k < 8; ++k)  // per 128-bit lane: (a0+a2, b0+b2, a1+a3, b1+b3)
    v[k] = _mm512_add_ps(_mm512_unpacklo_ps(v[2 * k], v[2 * k + 1]), _mm512_unpackhi_ps(v[2 * k], v[2 * k + 1]));
  for (int k = 0; k < 4; ++k) {  // per 128-bit lane: the four vectors' sums over that lane
    const __m512d a = _mm512_castps_pd(v[2 * k]), b = _mm512_castps_pd(v[2 * k + 1]);
    v[k] = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(a, b)), _mm512_castpd_ps(_mm512_unpackhi_pd(a, b)));
  }
  for (int k = 0; k < 2; ++k)  // 128-bit lanes 0+1 and 2+3 of two such vectors
    v[k] = _mm512_add_ps(_mm512_shuffle_f32x4(v[2 * k], v[2 * k + 1], 0x88),
                         _mm512_shuffle_f32x4(v[2 * k], v[2 * k + 1], 0xDD));
  return _mm512_add_ps(_mm512_shuffle_f32x4(v[0], v[1], 0x88), _mm512_shuffle_f32x4(v[0], v[1], 0xDD));
}

// kPairPs (VPERMW's index) pairs the two halves of one vector: VCVTNE2PS2BF16's output, first key in the lower half.
alignas(64) constexpr uint16_t kPairPs[32] = {0, 16, 1, 17, 2, 18, 3, 19, 4, 20, 5, 21, 6, 22, 7, 23,
                                              8, 24, 9, 25, 10, 26, 11, 27, 12, 28, 13, 29, 14, 30, 15, 31};

// Two V rows a, b of 32 bfloat16 are interleaved into bf16 pairs (one per dimension) with VPUNPCKLWD / VPUNPCKHWD,
// which pair elements within each 128-bit lane: pair j of the low result is dimension 8 (j / 4) + j % 4, of the high
// one 8 (j / 4) + 4 + j % 4. So the 32 pairs of a chunk are in this order (low's 16, then high's): kDimOrder[k] is
// where dimension k is. AttendItemFast's float32 sums come out in that order and are put back with VPERMT2PS;
// AttendTileFast reads each dimension's pair where it is.
alignas(64) constexpr int32_t kDimOrder[32] = {0, 1, 2, 3, 16, 17, 18, 19, 4, 5, 6, 7, 20, 21, 22, 23,
                                               8, 9, 10, 11, 24, 25, 26, 27, 12, 13, 14, 15, 28, 29, 30, 31};

// 32 consecutive pool elements as 32 bfloat16 (one vector): a load for a bfloat16 pool; for an fp8 pool, 32 bytes
// widened to 16-bit lanes, each lane's magnitude (its low 7 bits) looked up in the format's 128-entry bfloat16 table
// (two VPERMT2W of 64 entries, picked by bit 6) and its sign bit moved to bit 15. Exact, NaN and infinity included.
inline __m512i LoadBf16x32(const uint16_t* p) { return _mm512_loadu_si512(p); }
template <typename F8, std::enable_if_t<kIsFp8<F8>, int> = 0>
inline __m512i LoadBf16x32(const F8* p) {
  const uint16_t* table = TableOf(F8{}).bf16;
  const __m512i x = _mm512_cvtepu8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
  // VPERMT2W reads an index's low 6 bits: bit 5 picks the second table register, bits 0-4 the entry.
  const __m512i low = _mm512_permutex2var_epi16(_mm512_load_si512(table), x, _mm512_load_si512(table + 32));
  const __m512i high = _mm512_permutex2var_epi16(_mm512_load_si512(table + 64), x, _mm512_load_si512(table + 96));
  const __m512i magnitude = _mm512_mask_blend_epi16(_mm512_test_epi16_mask(x, _mm512_set1_epi16(0x40)), low, high);
  return _mm512_or_si512(magnitude, _mm512_slli_epi16(_mm512_and_si512(x, _mm512_set1_epi16(0x80)), 8));
}

// Per-thread scratch of AttendItemFast: H = (kv heads of the item) x G query heads; `span` cache positions.
struct FastScratch {
  std::vector<float> acc, top, sum, scores;  // [H, D], [H, 16], [H, 16], [H, span + 16]
  std::vector<int32_t> vp, pp;               // a chunk's V row pairs [8, D] and one kv head's weight pairs [G, 2, 8]
  FastScratch(int64_t heads, int64_t head_dim)
      : acc(heads * head_dim), top(heads * 16), sum(heads * 16), vp(8 * head_dim), pp(heads * 16) {}
};

// Asks for the cache lines of rows [0, rows) of a block, bytes [0, span) of each, `stride` bytes apart, into L2
// (the T1 hint): a block's ~200 lines asked into L1 (T0) held the core's few L1 miss buffers, so the prefetches
// themselves stalled and the loads behind them waited (`perf` put a quarter of the decode kernel's time on the
// prefetch instructions); into L2 is faster wherever the pool comes from memory (README, "Attention kernels on CPU").
inline void PrefetchRows(const void* first, int64_t rows, int64_t stride, int64_t span) {
  const char* base = reinterpret_cast<const char*>(first);
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t at = 0; at < span; at += 64) _mm_prefetch(base + r * stride + at, _MM_HINT_T1);
}

// PrefetchRows issued a few lines at a time between pieces of the work on the block before: issued at once they
// queued behind the core's miss buffers, and the core waited on the prefetch instructions instead of working
// (README, "Attention kernels on CPU").
class SpreadPrefetch {
 public:
  // Rows [0, rows) at `first`, bytes [0, span) of each, `stride` bytes apart, spread over `pieces` Step()s.
  void Start(const void* first, int64_t rows, int64_t stride, int64_t span, int64_t pieces) {
    base_ = reinterpret_cast<const char*>(first), rows_ = rows, stride_ = stride, span_ = span, row_ = at_ = 0;
    per_step_ = (rows * ((span + 63) / 64) + pieces - 1) / std::max<int64_t>(pieces, 1);
  }
  void Stop() { row_ = rows_; }
  void Step() {
    for (int64_t i = 0; i < per_step_ && row_ < rows_; ++i) {
      _mm_prefetch(base_ + row_ * stride_ + at_, _MM_HINT_T1);
      if ((at_ += 64) >= span_) at_ = 0, ++row_;
    }
  }

 private:
  const char* base_ = nullptr;
  int64_t rows_ = 0, stride_ = 0, span_ = 0, per_step_ = 0, row_ = 0, at_ = 0;
};

// acc [GT, D] (the GT query heads of one kv head, float32, each 32 dimensions in kDimOrder) += sum over key pairs t
// of weight pair t . V pair row t (vp [npairs, D] dwords, two keys' values per dimension), each weight as two
// bfloat16 pairs, hi and lo (pp[g * 16 + t], pp[g * 16 + 8 + t]). Each V pair row is loaded once for the GT heads,
// whose sums stay in registers over the chunk. pf.Step() GT times, spread over it.
template <int DC, int GT>
inline void PairsPV(const int32_t* vp, int npairs, const int32_t* pp, float* acc, SpreadPrefetch& pf) {
  constexpr int64_t D = 16 * DC;
  __m512 a[GT][DC];
  for (int g = 0; g < GT; ++g)
    for (int c = 0; c < DC; ++c) a[g][c] = _mm512_loadu_ps(acc + g * D + 16 * c);
  int steps = 0;
  for (int t = 0; t < npairs; ++t) {
    __m512bh vt[DC];
    for (int c = 0; c < DC; ++c) vt[c] = (__m512bh)_mm512_loadu_si512(vp + t * D + 16 * c);
    for (int g = 0; g < GT; ++g) {
      const __m512bh w_hi = (__m512bh)_mm512_set1_epi32(pp[g * 16 + t]);
      const __m512bh w_lo = (__m512bh)_mm512_set1_epi32(pp[g * 16 + 8 + t]);
      for (int c = 0; c < DC; ++c) a[g][c] = _mm512_dpbf16_ps(_mm512_dpbf16_ps(a[g][c], w_hi, vt[c]), w_lo, vt[c]);
    }
    for (const int due = (t + 1) * GT / npairs; steps < due; ++steps) pf.Step();  // spread over the pairs
  }
  for (; steps < GT; ++steps) pf.Step();
  for (int g = 0; g < GT; ++g)
    for (int c = 0; c < DC; ++c) _mm512_storeu_ps(acc + g * D + 16 * c, a[g][c]);
}

// PairsPV for the G of this model where its sums and V's pairs fit the 32 vector registers; false: not here.
template <int DC>
inline bool PairsPVIfFits(int64_t G, const int32_t* vp, int npairs, const int32_t* pp, float* acc, SpreadPrefetch& pf) {
  if constexpr (DC == 4) {
    switch (G) {
      case 1: return PairsPV<4, 1>(vp, npairs, pp, acc, pf), true;
      case 2: return PairsPV<4, 2>(vp, npairs, pp, acc, pf), true;
      case 3: return PairsPV<4, 3>(vp, npairs, pp, acc, pf), true;
      case 4: return PairsPV<4, 4>(vp, npairs, pp, acc, pf), true;
    }
  } else if constexpr (DC == 8) {
    switch (G) {
      case 1: return PairsPV<8, 1>(vp, npairs, pp, acc, pf), true;
      case 2: return PairsPV<8, 2>(vp, npairs, pp, acc, pf), true;
    }
  }
  return false;
}

// AttendItem for bfloat16, head_dim D = 16 * DC (DC even), in two passes over the sequence's blocks: the first
// reads K and keeps every score (one dot-product instruction per 32 dimensions and key, then a transposing lane
// sum) and each head's maximum; the second reads V and adds exp(score - max) V to float32 sums, the keys in pairs
// (VDPBF16PS: V's two rows interleaved per dimension, each weight as the sum of two bfloat16 so that it keeps
// float32's precision). Against an online softmax this does no rescaling and no horizontal reduction per chunk of
// keys. In each pass the rows of the block two ahead are prefetched while one block is worked on (the pool is far
// larger than the caches, and block tables jump around in it). The pool is bfloat16 or fp8 (TKV): K and V rows are
// loaded 32 elements at a time as bfloat16 (LoadBf16x32), so an fp8 pool is converted in registers.
template <int DC, typename TKV>
void AttendItemFast(const Problem& p, const uint16_t* q, const TKV* k_cache, const TKV* v_cache,
                    uint16_t* out, int64_t s, int64_t token, int64_t kh0, int64_t kh1, Rows next,
                    FastScratch& scratch) {
  constexpr int64_t kBytes = sizeof(TKV);
  constexpr int64_t D = 16 * DC;
  constexpr int QC = DC / 2;  // 32-element chunks of a head's bf16 row
  const int64_t BS = p.block_size, Hkv = p.num_kv_heads, G = p.num_q_heads / Hkv;
  const int64_t H = (kh1 - kh0) * G;
  int64_t lo, hi;
  VisibleRange(p, s, token, &lo, &hi);
  if (hi <= lo) return;
  const __m512 scale = _mm512_set1_ps(p.scale);
  const float soft_cap = p.soft_cap;
  const int64_t row_stride = Hkv * D;
  const uint16_t* q_rows = q + (token * p.num_q_heads + kh0 * G) * D;  // [H, D]
  const int64_t first = lo / BS, last = (hi - 1) / BS;
  const int64_t span = (last + 1 - first) * BS + 16;  // scores of cache positions first * BS + i, i < span
  if (static_cast<int64_t>(scratch.scores.size()) < H * span) scratch.scores.resize(H * span);
  float *acc = scratch.acc.data(), *top = scratch.top.data(), *sum = scratch.sum.data();
  float* scores = scratch.scores.data();
  int32_t *vp = scratch.vp.data(), *pp = scratch.pp.data();
  std::fill(acc, acc + H * D, 0.0f);
  std::fill(top, top + H * 16, -INFINITY);
  std::fill(sum, sum + H * 16, 0.0f);
  auto block_start = [&](int64_t b) { return p.BlockStart(s, b, kh0); };
  // Both passes walk the same chunks: up to 16 offsets [j, j + n) of block b, in range [lo, hi). While the last
  // block is worked on, `then` is prefetched: what the next pass (or the thread's next item) reads first.
  auto for_each_chunk = [&](const TKV* pool, Rows then, auto work) {
    SpreadPrefetch prefetch;
    for (int64_t b = first; b <= last; ++b) {
      const int64_t start = block_start(b);
      const int64_t j0 = std::max<int64_t>(lo - b * BS, 0), j1 = std::min<int64_t>(hi - b * BS, BS);
      const int64_t steps = (j1 - j0 + 15) / 16 * (kh1 - kh0) * G;
      // Two blocks ahead (one ahead left the V loads waiting: README, "Attention kernels on CPU"); the block after the
      // first is asked for at once.
      auto rows_of = [&](int64_t c) { return std::min<int64_t>(BS, hi - c * BS); };
      if (b == first && b + 1 <= last)
        PrefetchRows(pool + block_start(b + 1), rows_of(b + 1), row_stride * kBytes, (kh1 - kh0) * D * kBytes);
      if (b + 2 <= last) {
        prefetch.Start(pool + block_start(b + 2), rows_of(b + 2), row_stride * kBytes, (kh1 - kh0) * D * kBytes,
                       steps);
      } else if (b == last && then.rows > 0) {
        prefetch.Start(then.first, then.rows, row_stride * kBytes, (kh1 - kh0) * D * kBytes, steps);
      } else {
        prefetch.Stop();
      }
      for (int64_t j = j0; j < j1; j += 16) {
        const int n = static_cast<int>(std::min<int64_t>(16, j1 - j));
        work(pool + start + j * row_stride, n, static_cast<__mmask16>((1u << n) - 1), (b - first) * BS + j, prefetch);
      }
    }
  };

  // Pass 1: scores[g, i] = scale * q_g . k_i (or its soft cap), -inf past the chunk's n; top[g] their lane maxima.
  for_each_chunk(k_cache, FirstRows(p, v_cache, s, token, kh0), [&](const TKV* rows, int n, __mmask16 valid,
                                                                      int64_t i, SpreadPrefetch& pf) {
    for (int64_t kh = 0; kh < kh1 - kh0; ++kh) {
      const TKV* k_rows = rows + kh * D;
      for (int64_t g = kh * G; g < (kh + 1) * G; ++g) {
        __m512bh qv[QC];
        for (int c = 0; c < QC; ++c) qv[c] = (__m512bh)_mm512_loadu_si512(q_rows + g * D + 32 * c);
        __m512 dots[16];
        for (int t = 0; t < 16; ++t) {
          __m512 d = _mm512_setzero_ps();
          if (t < n)
            for (int c = 0; c < QC; ++c)
              d = _mm512_dpbf16_ps(d, qv[c], (__m512bh)LoadBf16x32(k_rows + t * row_stride + 32 * c));
          dots[t] = d;
        }
        __m512 x = _mm512_mul_ps(LaneSums16(dots), scale);
        if (soft_cap > 0.0f) {
          alignas(64) float w[16];
          _mm512_store_ps(w, x);
          for (int t = 0; t < 16; ++t) w[t] = soft_cap * std::tanh(w[t] / soft_cap);
          x = _mm512_load_ps(w);
        }
        x = _mm512_mask_mov_ps(_mm512_set1_ps(-INFINITY), valid, x);
        _mm512_storeu_ps(scores + g * span + i, x);
        _mm512_storeu_ps(top + g * 16, _mm512_max_ps(x, _mm512_loadu_ps(top + g * 16)));
        pf.Step();
      }
    }
  });
  for (int64_t g = 0; g < H; ++g) _mm512_storeu_ps(top + g * 16, _mm512_set1_ps(_mm512_reduce_max_ps(_mm512_loadu_ps(top + g * 16))));

  // Pass 2: e = exp(score - max) (0 past n), sum[g] += e, acc[g] += sum_t e_t V_t.
  for_each_chunk(v_cache, next, [&](const TKV* rows, int n, __mmask16 valid, int64_t i, SpreadPrefetch& pf) {
    const int npairs = (n + 1) / 2;
    for (int64_t kh = 0; kh < kh1 - kh0; ++kh) {
      const TKV* v_rows = rows + kh * D;
      for (int64_t g = kh * G; g < (kh + 1) * G; ++g) {  // the weights of keys (2i, 2i + 1) as bf16 pairs, hi and lo
        const __m512 e = _mm512_maskz_mov_ps(
            valid, Exp16NonPositive(_mm512_sub_ps(_mm512_loadu_ps(scores + g * span + i), _mm512_loadu_ps(top + g * 16))));
        _mm512_storeu_ps(sum + g * 16, _mm512_add_ps(e, _mm512_loadu_ps(sum + g * 16)));
        const __m256bh e_hi = _mm512_cvtneps_pbh(e);
        const __m512 rest = _mm512_sub_ps(e, _mm512_cvtpbh_ps(e_hi));
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(pp + (g - kh * G) * 16), (__m256i)e_hi);
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(pp + (g - kh * G) * 16 + 8), (__m256i)_mm512_cvtneps_pbh(rest));
      }
      for (int t = 0; t < npairs; ++t) {  // V's rows (2t, 2t + 1) interleaved; an odd n's last key pairs with itself
        const TKV* r0 = v_rows + 2 * t * row_stride;
        const TKV* r1 = 2 * t + 1 < n ? r0 + row_stride : r0;
        for (int c = 0; c < QC; ++c) {  // dimensions in kDimOrder (one-cycle unpacks; undone at the end)
          const __m512i a = LoadBf16x32(r0 + 32 * c), b = LoadBf16x32(r1 + 32 * c);
          _mm512_storeu_si512(vp + t * D + 32 * c, _mm512_unpacklo_epi16(a, b));
          _mm512_storeu_si512(vp + t * D + 32 * c + 16, _mm512_unpackhi_epi16(a, b));
        }
      }
      if (PairsPVIfFits<DC>(G, vp, npairs, pp, acc + kh * G * D, pf)) continue;
      for (int64_t g = kh * G; g < (kh + 1) * G; ++g) {
        __m512 a[DC], r[DC];
        for (int c = 0; c < DC; ++c) a[c] = _mm512_loadu_ps(acc + g * D + 16 * c), r[c] = _mm512_setzero_ps();
        const int32_t* w = pp + (g - kh * G) * 16;
        for (int t = 0; t < npairs; ++t) {
          const __m512bh w_hi = (__m512bh)_mm512_set1_epi32(w[t]), w_lo = (__m512bh)_mm512_set1_epi32(w[8 + t]);
          for (int c = 0; c < DC; ++c) {
            const __m512bh vt = (__m512bh)_mm512_loadu_si512(vp + t * D + 16 * c);
            a[c] = _mm512_dpbf16_ps(a[c], w_hi, vt);
            r[c] = _mm512_dpbf16_ps(r[c], w_lo, vt);
          }
        }
        for (int c = 0; c < DC; ++c) _mm512_storeu_ps(acc + g * D + 16 * c, _mm512_add_ps(a[c], r[c]));
        pf.Step();
      }
    }
  });
  uint16_t* out_rows = out + (token * p.num_q_heads + kh0 * G) * D;
  const __m512i order[2] = {_mm512_load_si512(kDimOrder), _mm512_load_si512(kDimOrder + 16)};
  for (int64_t g = 0; g < H; ++g) {
    const float l = _mm512_reduce_add_ps(_mm512_loadu_ps(sum + g * 16));
    const __m512 inv = _mm512_set1_ps(l > 0.0f ? p.v_scale / l : 0.0f);
    for (int c = 0; c < DC; c += 2) {  // acc's 32 dimensions of chunk c / 2 back in order
      const __m512 a = _mm512_loadu_ps(acc + g * D + 16 * c), b = _mm512_loadu_ps(acc + g * D + 16 * c + 16);
      for (int m = 0; m < 2; ++m)
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(out_rows + g * D + 16 * (c + m)),
                            (__m256i)_mm512_cvtneps_pbh(_mm512_mul_ps(_mm512_permutex2var_ps(a, order[m], b), inv)));
    }
  }
}

// The fast item where it applies (bfloat16 queries, a bfloat16 or fp8 pool, head_dim 64, 128 or 256); false: use
// AttendItem.
template <typename TKV>
inline bool AttendItemFastIfAny(const Problem& p, const uint16_t* q, const TKV* k, const TKV* v,
                                uint16_t* out, int64_t s, int64_t token, int64_t kh0, int64_t kh1, Rows next,
                                std::unique_ptr<FastScratch>& scratch) {
  if (p.head_dim != 64 && p.head_dim != 128 && p.head_dim != 256) return false;
  if (!scratch) scratch = std::make_unique<FastScratch>(p.num_q_heads, p.head_dim);  // room for every kv head
  if (p.head_dim == 64) AttendItemFast<4>(p, q, k, v, out, s, token, kh0, kh1, next, *scratch);
  if (p.head_dim == 128) AttendItemFast<8>(p, q, k, v, out, s, token, kh0, kh1, next, *scratch);
  if (p.head_dim == 256) AttendItemFast<16>(p, q, k, v, out, s, token, kh0, kh1, next, *scratch);
  return true;
}
#else
struct FastScratch {};
template <typename TKV>
inline bool AttendItemFastIfAny(const Problem&, const uint16_t*, const TKV*, const TKV*, uint16_t*, int64_t,
                                int64_t, int64_t, int64_t, Rows, std::unique_ptr<FastScratch>&) {
  return false;
}
#endif

constexpr int64_t kTile = 16;  // query tokens of one sequence per prefill work item
// Without prompt_lens, a sequence with at most this many query tokens in a step runs them one per token (a decode,
// or a verified token and up to 16 proposals), a longer run in tiles.
constexpr int64_t kMaxPerTokenRun = 17;

// Per-thread scratch of a tile item: `rows` = tokens x query heads, and one kv head's block in float32.
struct TileScratch {
  std::vector<float> q, acc, m, l, kt, vf, s, scores;
  std::vector<int64_t> row_ids;
  std::vector<const float*> row_ptrs;
  TileScratch(int64_t rows, int64_t head_dim, int64_t block_size)
      : q(rows * head_dim), acc(rows * head_dim), m(rows), l(rows), kt(head_dim * block_size),
        vf(block_size * head_dim), s(block_size), scores(rows * block_size), row_ids(rows), row_ptrs(rows) {}
};

// One (token, query head) row of a tile against one block of BSC offsets, of which [j0, j1) are visible:
// s = q . kt (vectorised over the offsets), the online-softmax update of (m, l, acc), acc += p @ vf. Offsets outside
// [j0, j1) weigh exactly 0 (their kt and vf columns may be zeros, never read as values).
template <int BSC>
inline void TileScores(const float* const* rows, int64_t num_rows, const float* __restrict kt, int64_t D,
                       float* __restrict scores) {
  // Four rows at a time: four independent accumulator chains, each kt row loaded once for the four. A last group
  // of fewer rows repeats its last row (computed, not stored), so every row's sums run through this same loop: a
  // row's scores do not depend on how many rows the tile has.
  for (int64_t r = 0; r < num_rows; r += 4) {
    float a0[BSC] = {0}, a1[BSC] = {0}, a2[BSC] = {0}, a3[BSC] = {0};
    const int64_t last = num_rows - 1;
    const float *q0 = rows[r], *q1 = rows[std::min(r + 1, last)], *q2 = rows[std::min(r + 2, last)],
                *q3 = rows[std::min(r + 3, last)];
    for (int64_t d = 0; d < D; ++d) {
      const float* __restrict kd = kt + d * BSC;
      const float x0 = q0[d], x1 = q1[d], x2 = q2[d], x3 = q3[d];
      for (int j = 0; j < BSC; ++j) {
        a0[j] += x0 * kd[j];
        a1[j] += x1 * kd[j];
        a2[j] += x2 * kd[j];
        a3[j] += x3 * kd[j];
      }
    }
    const float* chains[4] = {a0, a1, a2, a3};
    for (int64_t i = 0; i < 4 && r + i < num_rows; ++i)
      for (int j = 0; j < BSC; ++j) scores[(r + i) * BSC + j] = chains[i][j];
  }
}

template <int BSC>
inline void TileRow(const float* __restrict sc, const float* __restrict vf, float* __restrict acc, float* m,
                    float* l, int64_t D, int64_t j0, int64_t j1, float scale, float soft_cap) {
  float x[BSC];
  if (soft_cap > 0.0f) {
    for (int j = 0; j < BSC; ++j) x[j] = soft_cap * std::tanh(sc[j] * scale / soft_cap);
  } else {
    for (int j = 0; j < BSC; ++j) x[j] = sc[j] * scale;
  }
  for (int j = 0; j < BSC; ++j) x[j] = (j >= j0 && j < j1) ? x[j] : -INFINITY;
  float block_max = -INFINITY;
  for (int j = 0; j < BSC; ++j) block_max = std::max(block_max, x[j]);
  const float m_new = std::max(*m, block_max);
  const float alpha = *m == -INFINITY ? 0.0f : std::exp(*m - m_new);
  float pj[BSC];
  for (int j = 0; j < BSC; ++j) pj[j] = ExpNonPositive(x[j] - m_new);
  for (int j = 0; j < BSC; ++j) pj[j] = (j >= j0 && j < j1) ? pj[j] : 0.0f;
  float sum = 0.0f;
  for (int j = 0; j < BSC; ++j) sum += pj[j];
  *l = *l * alpha + sum;
  *m = m_new;
  if (alpha != 1.0f)
    for (int64_t d = 0; d < D; ++d) acc[d] *= alpha;
  for (int j = 0; j < BSC; ++j) {
    const float p = pj[j];
    const float* __restrict vj = vf + j * D;
    for (int64_t d = 0; d < D; ++d) acc[d] += p * vj[d];
  }
}

// TileRow for a block size that is not 8, 16 or 32 (s: scratch of BS floats).
inline void TileRowAny(const float* qr, const float* kt, const float* vf, float* acc, float* m, float* l, int64_t D,
                       int64_t BS, int64_t j0, int64_t j1, float scale, float soft_cap, float* s) {
  for (int64_t j = 0; j < BS; ++j) s[j] = 0.0f;
  for (int64_t d = 0; d < D; ++d)
    for (int64_t j = 0; j < BS; ++j) s[j] += qr[d] * kt[d * BS + j];
  float block_max = -INFINITY;
  for (int64_t j = j0; j < j1; ++j) {
    float v = s[j] * scale;
    if (soft_cap > 0.0f) v = soft_cap * std::tanh(v / soft_cap);
    s[j] = v;
    block_max = std::max(block_max, v);
  }
  const float m_new = std::max(*m, block_max);
  const float alpha = *m == -INFINITY ? 0.0f : std::exp(*m - m_new);
  float sum = 0.0f;
  for (int64_t j = j0; j < j1; ++j) {
    s[j] = ExpNonPositive(s[j] - m_new);
    sum += s[j];
  }
  *l = *l * alpha + sum;
  *m = m_new;
  if (alpha != 1.0f)
    for (int64_t d = 0; d < D; ++d) acc[d] *= alpha;
  for (int64_t j = j0; j < j1; ++j)
    for (int64_t d = 0; d < D; ++d) acc[d] += s[j] * vf[j * D + d];
}

// The cached range [lo[r], hi[r]) that each of a tile's tokens toks[0, nt) of sequence s sees (AttendItem's rules;
// [0, 0) for padding or nothing visible) and their union [first, last); false when no token sees anything.
inline bool TileRanges(const Problem& p, int64_t s, const int32_t* toks, int64_t nt, int64_t* lo, int64_t* hi,
                       int64_t* first, int64_t* last) {
  const int64_t context = p.context_lens[s];
  *first = INT64_MAX, *last = 0;
  if (context <= 0) return false;
  for (int64_t r = 0; r < nt; ++r) {
    const int64_t pos = p.positions[toks[r]];
    hi[r] = pos < 0 ? 0 : std::min({context, pos + 1, p.width * p.block_size});
    lo[r] = p.sliding_window > 0 ? std::max<int64_t>(0, pos - p.sliding_window + 1) : 0;
    if (hi[r] <= lo[r]) lo[r] = hi[r] = 0;  // padding, or nothing visible: a 0 row
    else *first = std::min(*first, lo[r]), *last = std::max(*last, hi[r]);
  }
  return *last > 0;
}

// A tile item: the nt query tokens toks[0, nt) of sequence s (a prompt chunk), kv heads [kh0, kh1). Each block is
// read once for the whole tile: one kv head's keys are converted to float32 and transposed (kt [D, BS]) and its
// values converted (vf [BS, D]); then every (token, query head) row of that kv head gets its scores as a
// vector over the block's offsets (s[j] = sum_d q[d] kt[d, j]), its online-softmax update and acc += p @ vf.
// Rows keep the rules of AttendItem: token r sees [lo_r, hi_r) of the cache, masked offsets weigh exactly 0.
template <typename T, typename TKV>
void AttendTile(const Problem& p, const T* q, const TKV* k_cache, const TKV* v_cache, T* out, int64_t s,
                const int32_t* toks, int64_t nt, int64_t kh0, int64_t kh1, TileScratch& sc) {
  const int64_t D = p.head_dim, BS = p.block_size, Hkv = p.num_kv_heads;
  const int64_t G = p.num_q_heads / Hkv;
  const int64_t H = (kh1 - kh0) * G;  // query heads of the item, per token
  int64_t lo[kTile], hi[kTile], first, last;
  if (!TileRanges(p, s, toks, nt, lo, hi, &first, &last)) return;
  const float scale = p.scale, soft_cap = p.soft_cap;
  float* qf = sc.q.data();
  float* acc = sc.acc.data();
  float* m = sc.m.data();
  float* l = sc.l.data();
  float* kt = sc.kt.data();
  float* vf = sc.vf.data();
  float* sj = sc.s.data();
  float* scores = sc.scores.data();  // [rows of one kv head, BS]
  int64_t* row_ids = sc.row_ids.data();
  const float** row_ptrs = sc.row_ptrs.data();
  for (int64_t r = 0; r < nt; ++r) {
    const T* q_rows = q + (toks[r] * p.num_q_heads + kh0 * G) * D;
    for (int64_t i = 0; i < H * D; ++i) qf[r * H * D + i] = ToFloat(q_rows[i]);
  }
  std::fill(acc, acc + nt * H * D, 0.0f);
  std::fill(m, m + nt * H, -INFINITY);
  std::fill(l, l + nt * H, 0.0f);

  const int64_t row_stride = Hkv * D;
  for (int64_t b = first / BS; b * BS < last; ++b) {
    const int64_t jlo = std::max<int64_t>(first - b * BS, 0), jhi = std::min<int64_t>(last - b * BS, BS);
    for (int64_t kh = kh0; kh < kh1; ++kh) {
      const int64_t base = p.BlockStart(s, b, kh);
      // Offsets nobody sees are zeros here (the pool may hold anything there, NaN included).
      for (int64_t j = 0; j < BS; ++j) {
        const bool live = j >= jlo && j < jhi;
        const TKV* k_row = k_cache + base + j * row_stride;
        const TKV* v_row = v_cache + base + j * row_stride;
        for (int64_t d = 0; d < D; ++d) {
          kt[d * BS + j] = live ? ToFloat(k_row[d]) : 0.0f;
          vf[j * D + d] = live ? ToFloat(v_row[d]) : 0.0f;
        }
      }
      // This kv head's rows of the tile: token r, query head (kh - kh0) * G + g.
      int64_t num_rows = 0;
      for (int64_t r = 0; r < nt; ++r)
        if (std::min<int64_t>(hi[r] - b * BS, BS) > std::max<int64_t>(lo[r] - b * BS, 0))
          for (int64_t g = 0; g < G; ++g) {
            row_ids[num_rows] = r * H + (kh - kh0) * G + g;
            row_ptrs[num_rows++] = qf + (r * H + (kh - kh0) * G + g) * D;
          }
      if (BS == 8 || BS == 16 || BS == 32) {
        if (BS == 8) TileScores<8>(row_ptrs, num_rows, kt, D, scores);
        if (BS == 16) TileScores<16>(row_ptrs, num_rows, kt, D, scores);
        if (BS == 32) TileScores<32>(row_ptrs, num_rows, kt, D, scores);
      }
      for (int64_t i = 0; i < num_rows; ++i) {
        const int64_t row = row_ids[i], r = row / H;
        const int64_t j0 = std::max<int64_t>(lo[r] - b * BS, 0), j1 = std::min<int64_t>(hi[r] - b * BS, BS);
        switch (BS) {  // the block size as a constant, so the loops over offsets vectorise
          case 8: TileRow<8>(scores + i * BS, vf, acc + row * D, m + row, l + row, D, j0, j1, scale, soft_cap); break;
          case 16: TileRow<16>(scores + i * BS, vf, acc + row * D, m + row, l + row, D, j0, j1, scale, soft_cap); break;
          case 32: TileRow<32>(scores + i * BS, vf, acc + row * D, m + row, l + row, D, j0, j1, scale, soft_cap); break;
          default: TileRowAny(qf + row * D, kt, vf, acc + row * D, m + row, l + row, D, BS, j0, j1, scale, soft_cap, sj);
        }
      }
    }
  }
  for (int64_t r = 0; r < nt; ++r) {
    T* out_rows = out + (toks[r] * p.num_q_heads + kh0 * G) * D;
    for (int64_t h = 0; h < H; ++h) {
      const int64_t row = r * H + h;
      const float inv = l[row] > 0.0f ? p.v_scale / l[row] : 0.0f;
      for (int64_t d = 0; d < D; ++d) FromFloat(acc[row * D + d] * inv, out_rows + h * D + d);
    }
  }
}

#if defined(__AVX512BF16__)
// ---- bfloat16 prompt tiles with AVX-512 (AVX512_BF16): AttendTile's rules and results up to float32 summation
// order (and the exponential's approximation). The rows of a kv head, (token, query head) pairs of the tile, lie in
// the lanes of up to kMaxRowVectors vectors: their queries are transposed once per item ([D/2, rows] bf16 pairs),
// so a key's scores for 16 rows are D/2 VDPBF16PS with the key's pair broadcast (no key transposes, no lane sums),
// and the online softmax (maxima, exponentials, sums) is per lane, with each row's visible range [lo, hi) as a
// lane mask per key. acc += p @ V takes keys in pairs, also by VDPBF16PS: the rows' weights of two keys rounded to
// bfloat16 and interleaved in each lane, against a broadcast pair of V values (the two keys' rows interleaved once
// per chunk), with acc [D, rows] in float32 (rows in the lanes again). More rows per kv head than that (G > 8):
// AttendTile.

constexpr int kMaxRowVectors = 8;  // AttendTileFast: at most 8 x 16 (token, query head) rows per kv head

// Per-thread scratch of AttendTileFast: `rows` = one kv head's (token, query head) rows, in vectors of 16.
struct TileFastScratch {
  std::vector<float> acc, m, l, p, alpha;  // [D, rows] (rows in lanes), [rows], [rows], [16, rows], [rows]
  std::vector<int32_t> qt;                 // one kv head's queries, transposed: [D/2, rows of the kv head]
  std::vector<int32_t> vp, pp;             // a chunk's V row pairs [8, D] and weight pairs [8, rows], bf16 x 2
  std::vector<uint16_t> kc, vc;            // an fp8 pool's chunk of K and V rows as bfloat16, [16, D] each
  TileFastScratch(int64_t rows, int64_t head_dim)
      : acc(rows * head_dim), m(rows), l(rows), p(16 * rows), alpha(rows), qt(head_dim / 2 * rows),
        vp(8 * head_dim), pp(8 * rows), kc(16 * head_dim), vc(16 * head_dim) {}
};

// n rows of D pool elements, `stride` elements apart, as bfloat16 rows [n, D] (dst): an fp8 pool's chunk, converted
// once per tile and kv head (each key is then read by every row of the tile).
template <typename TKV>
inline void RowsToBf16(const TKV* src, int64_t stride, int n, int64_t D, uint16_t* dst) {
  for (int t = 0; t < n; ++t)
    for (int64_t c = 0; c < D; c += 32) _mm512_storeu_si512(dst + t * D + c, LoadBf16x32(src + t * stride + c));
}

// acc[d] = alpha * acc[d] + sum_j pp[j] . vp[j][d] for every head dimension d, each a vector of the NV x 16 rows
// (acc [D, NV * 16]): pp [npairs, NV] holds the rows' weights of keys (2j, 2j + 1) as bfloat16 pairs per lane, vp
// [npairs, D] the two keys' V values as one bfloat16 pair per dimension. DB dimensions at a time, their NV x DB sums
// in registers.
template <int NV, int DC>
inline void ChunkPVPairs(const int32_t* pp, int npairs, const int32_t* __restrict vp, const float* alpha,
                         float* acc) {
  constexpr int64_t D = 16 * DC, W = 16 * NV;
  constexpr int DB = NV <= 3 ? 8 : NV <= 6 ? 4 : 2;
  __m512 al[NV];
  for (int v = 0; v < NV; ++v) al[v] = _mm512_loadu_ps(alpha + 16 * v);
  for (int64_t d0 = 0; d0 < D; d0 += DB) {
    __m512 a[DB][NV];
    int64_t at[DB];  // where dimension d0 + i's pair is in a row of vp (kDimOrder within each 32)
    for (int i = 0; i < DB; ++i) at[i] = ((d0 + i) & ~int64_t{31}) + kDimOrder[(d0 + i) & 31];
    for (int i = 0; i < DB; ++i)
      for (int v = 0; v < NV; ++v) a[i][v] = _mm512_mul_ps(al[v], _mm512_loadu_ps(acc + (d0 + i) * W + 16 * v));
    for (int j = 0; j < npairs; ++j) {
      __m512bh w[NV];
      for (int v = 0; v < NV; ++v) w[v] = (__m512bh)_mm512_loadu_si512(pp + j * W + 16 * v);
      for (int i = 0; i < DB; ++i) {
        const __m512bh b = (__m512bh)_mm512_set1_epi32(vp[j * D + at[i]]);
        for (int v = 0; v < NV; ++v) a[i][v] = _mm512_dpbf16_ps(a[i][v], w[v], b);
      }
    }
    for (int i = 0; i < DB; ++i)
      for (int v = 0; v < NV; ++v) _mm512_storeu_ps(acc + (d0 + i) * W + 16 * v, a[i][v]);
  }
}

// Scores of keys [t0, t0 + KT) of a chunk (rows `stride` elements apart, as bf16 pairs) against NV vectors of 16
// query rows (qt [DP][NV * 16] dwords): s[t][v] lane i = q_(16 v + i) . k_t. Per pair of head dimensions, one
// broadcast of the key's pair and NV dot-product instructions: no transposes, no lane sums.
template <int KT, int NV, int DP>
inline void KeyScores(const uint16_t* keys, int64_t stride, int t0, int n, const int32_t* __restrict qt,
                      __m512 (*s)[kMaxRowVectors]) {
  __m512 a[KT][NV];
  for (int t = 0; t < KT; ++t)
    for (int v = 0; v < NV; ++v) a[t][v] = _mm512_setzero_ps();
  const int32_t* k32[KT];
  for (int t = 0; t < KT; ++t)  // offsets past n read key t0 again (their scores are masked out)
    k32[t] = reinterpret_cast<const int32_t*>(keys + (t0 + t < n ? t0 + t : t0) * stride);
  for (int dp = 0; dp < DP; ++dp)
    for (int t = 0; t < KT; ++t) {
      const __m512bh kb = (__m512bh)_mm512_set1_epi32(k32[t][dp]);
      for (int v = 0; v < NV; ++v)
        a[t][v] = _mm512_dpbf16_ps(a[t][v], kb, (__m512bh)_mm512_loadu_si512(qt + dp * NV * 16 + 16 * v));
    }
  for (int t = 0; t < KT; ++t)
    for (int v = 0; v < NV; ++v) s[t0 + t][v] = a[t][v];
}

// One kv head's rows (NV vectors of 16 (token, query head) rows) over one chunk of n <= 16 offsets starting at
// cache position c0: scores, the online softmax with the rows in the lanes (maxima, exponentials and sums are
// per-lane, no horizontal reductions), then acc += p @ V four rows at a time.
template <int NV, int DC>
inline void ChunkRowsT(const Problem& p, const uint16_t* k_rows, const uint16_t* v_rows, int64_t stride, int n,
                       int64_t c0, const int32_t* qt, const __m512i* row_lo, const __m512i* row_hi, int64_t nrows,
                       TileFastScratch& sc) {
  constexpr int64_t D = 16 * DC, DP = D / 2;
  __m512 s[16][kMaxRowVectors];
  constexpr int KT = NV <= 4 ? 4 : 2;  // KT x NV accumulators
  int t = 0;
  for (; t + KT <= n; t += KT) KeyScores<KT, NV, DP>(k_rows, stride, t, n, qt, s);
  for (; t < n; ++t) KeyScores<1, NV, DP>(k_rows, stride, t, n, qt, s);
  float* pm = sc.p.data();  // [16][NV * 16]
  const int64_t ps = NV * 16;
  for (int v = 0; v < NV; ++v) {
    __mmask16 valid[16];
    __m512 mx = _mm512_set1_ps(-INFINITY);
    for (int u = 0; u < n; ++u) {
      const __m512i pos = _mm512_set1_epi32(static_cast<int32_t>(c0 + u));
      valid[u] = _mm512_cmpge_epi32_mask(pos, row_lo[v]) & _mm512_cmplt_epi32_mask(pos, row_hi[v]);
      __m512 x = _mm512_mul_ps(s[u][v], _mm512_set1_ps(p.scale));
      if (p.soft_cap > 0.0f) {
        alignas(64) float w[16];
        _mm512_store_ps(w, x);
        for (int i = 0; i < 16; ++i) w[i] = p.soft_cap * std::tanh(w[i] / p.soft_cap);
        x = _mm512_load_ps(w);
      }
      s[u][v] = x;
      mx = _mm512_mask_max_ps(mx, valid[u], mx, x);
    }
    float* m = sc.m.data() + 16 * v;
    float* l = sc.l.data() + 16 * v;
    const __m512 m_old = _mm512_loadu_ps(m), m_new = _mm512_max_ps(mx, m_old);
    // rows that have seen nothing yet keep m = -inf: shift by 0 there (their weights are all 0)
    const __mmask16 seen = _mm512_cmp_ps_mask(m_new, _mm512_set1_ps(-INFINITY), _CMP_NEQ_OQ);
    const __m512 shift = _mm512_maskz_mov_ps(seen, m_new);
    const __m512 alpha = _mm512_mask_mov_ps(_mm512_set1_ps(1.0f), seen, Exp16NonPositive(_mm512_sub_ps(m_old, shift)));
    __m512 sum = _mm512_setzero_ps();
    for (int u = 0; u < n; ++u) {
      const __m512 e = _mm512_maskz_mov_ps(valid[u], Exp16NonPositive(_mm512_sub_ps(s[u][v], shift)));
      _mm512_storeu_ps(pm + u * ps + 16 * v, e);
      sum = _mm512_add_ps(sum, e);
    }
    _mm512_storeu_ps(l, _mm512_fmadd_ps(_mm512_loadu_ps(l), alpha, sum));
    _mm512_storeu_ps(m, m_new);
    _mm512_storeu_ps(sc.alpha.data() + 16 * v, alpha);
  }
  // Keys in pairs: V's rows 2j and 2j + 1 interleaved per dimension, and the rows' weights of the two keys as
  // bfloat16 pairs per lane; an odd n pairs its last key with a zero weight on that key's own V row (finite).
  const int npairs = (n + 1) / 2;
  int32_t* vp = sc.vp.data();  // [npairs, D], each 32 dimensions' pairs in kDimOrder
  for (int j = 0; j < npairs; ++j) {
    const uint16_t* r0 = v_rows + 2 * j * stride;
    const uint16_t* r1 = 2 * j + 1 < n ? r0 + stride : r0;
    for (int64_t c = 0; c < D / 32; ++c) {
      const __m512i a = _mm512_loadu_si512(r0 + 32 * c), b = _mm512_loadu_si512(r1 + 32 * c);
      _mm512_storeu_si512(vp + j * D + 32 * c, _mm512_unpacklo_epi16(a, b));
      _mm512_storeu_si512(vp + j * D + 32 * c + 16, _mm512_unpackhi_epi16(a, b));
    }
  }
  int32_t* pp = sc.pp.data();  // [npairs, NV * 16]
  const __m512i ps_idx = _mm512_load_si512(kPairPs);
  for (int j = 0; j < npairs; ++j)
    for (int v = 0; v < NV; ++v) {
      const __m512 p0 = _mm512_loadu_ps(pm + 2 * j * ps + 16 * v);
      const __m512 p1 = 2 * j + 1 < n ? _mm512_loadu_ps(pm + (2 * j + 1) * ps + 16 * v) : _mm512_setzero_ps();
      _mm512_storeu_si512(pp + j * ps + 16 * v,
                          _mm512_permutexvar_epi16(ps_idx, (__m512i)_mm512_cvtne2ps_pbh(p1, p0)));
    }
  ChunkPVPairs<NV, DC>(pp, npairs, vp, sc.alpha.data(), sc.acc.data());
}

// f(std::integral_constant<int, nv>{}) for a run-time nv in [1, N].
template <int N, typename F>
void WithVectorsUpTo(int64_t nv, F f) {
  if constexpr (N > 0) {
    if (nv == N) return f(std::integral_constant<int, N>{});
    WithVectorsUpTo<N - 1>(nv, f);
  }
}
template <typename F>
void WithVectors(int64_t nv, F f) { WithVectorsUpTo<kMaxRowVectors>(nv, f); }

// AttendTile for a bfloat16 pool, head_dim D = 16 * DC: per kv head of the item, its G query heads x the tile's
// tokens are the rows (48 for G = 3: three vectors of 16; at most kMaxRowVectors), walked over the sequence's blocks in chunks of
// 16 offsets (ChunkRowsT). AttendTile's rules and results up to float32 summation order and the exponential's
// approximation. An fp8 pool's chunks are converted to bfloat16 rows first (RowsToBf16).
template <int DC, typename TKV>
void AttendTileFast(const Problem& p, const uint16_t* q, const TKV* k_cache, const TKV* v_cache,
                    uint16_t* out, int64_t s, const int32_t* toks, int64_t nt, int64_t kh0, int64_t kh1,
                    TileFastScratch& sc) {
  constexpr int64_t kBytes = sizeof(TKV);
  constexpr int64_t D = 16 * DC, DP = D / 2;
  const int64_t BS = p.block_size, Hkv = p.num_kv_heads, G = p.num_q_heads / Hkv;
  int64_t lo[kTile], hi[kTile], first, last;
  if (!TileRanges(p, s, toks, nt, lo, hi, &first, &last)) return;
  const int64_t nrows = nt * G, nv = (nrows + 15) / 16;  // one kv head's rows: token-major (token r, head g)
  const int64_t row_stride = Hkv * D;
  alignas(64) int32_t lo32[16 * kMaxRowVectors], hi32[16 * kMaxRowVectors];
  for (int64_t i = 0; i < 16 * nv; ++i) {
    lo32[i] = i < nrows ? static_cast<int32_t>(lo[i / G]) : 0;
    hi32[i] = i < nrows ? static_cast<int32_t>(hi[i / G]) : 0;
  }
  __m512i row_lo[kMaxRowVectors], row_hi[kMaxRowVectors];
  for (int64_t v = 0; v < nv; ++v) row_lo[v] = _mm512_load_si512(lo32 + 16 * v), row_hi[v] = _mm512_load_si512(hi32 + 16 * v);
  for (int64_t kh = kh0; kh < kh1; ++kh) {
    float *acc = sc.acc.data(), *m = sc.m.data(), *l = sc.l.data();
    std::fill(acc, acc + 16 * nv * D, 0.0f);  // [D, 16 nv]: the rows in the lanes
    std::fill(m, m + 16 * nv, -INFINITY);
    std::fill(l, l + 16 * nv, 0.0f);
    int32_t* qt = sc.qt.data();  // [DP][16 nv]
    for (int64_t i = 0; i < 16 * nv; ++i) {
      const int32_t* qr = i < nrows ? reinterpret_cast<const int32_t*>(
                                          q + (toks[i / G] * p.num_q_heads + kh * G + i % G) * D)
                                    : nullptr;
      for (int64_t dp = 0; dp < DP; ++dp) qt[dp * 16 * nv + i] = qr ? qr[dp] : 0;
    }
    auto block_start = [&](int64_t b) { return p.BlockStart(s, b, kh); };
    for (int64_t b = first / BS; b * BS < last; ++b) {
      const int64_t start = block_start(b);
      if ((b + 1) * BS < last) {  // as in AttendItemFast: the next block's rows of this kv head, while this one runs
        const int64_t next = block_start(b + 1);
        PrefetchRows(k_cache + next, BS, row_stride * kBytes, D * kBytes);
        PrefetchRows(v_cache + next, BS, row_stride * kBytes, D * kBytes);
      }
      // Chunks of 16 offsets on a fixed grid (multiples of 16 in the block), whatever the tile's first visible
      // position: a row's sums then run over the same chunks in any tile (a sliding window makes `first` depend on
      // the tile's other rows). The offsets before `first` are in the sequence's context (finite) and weigh 0.
      const int64_t jlo = std::max<int64_t>(first - b * BS, 0) & ~int64_t{15};
      const int64_t jhi = std::min<int64_t>(last - b * BS, BS);
      for (int64_t j = jlo; j < jhi; j += 16) {
        const int n = static_cast<int>(std::min<int64_t>(16, jhi - j));
        const uint16_t *k_rows, *v_rows;
        int64_t stride = row_stride;
        if constexpr (std::is_same_v<TKV, uint16_t>) {
          k_rows = k_cache + start + j * row_stride;
          v_rows = v_cache + start + j * row_stride;
        } else {
          RowsToBf16(k_cache + start + j * row_stride, row_stride, n, D, sc.kc.data());
          RowsToBf16(v_cache + start + j * row_stride, row_stride, n, D, sc.vc.data());
          k_rows = sc.kc.data(), v_rows = sc.vc.data(), stride = D;
        }
        WithVectors(nv, [&](auto v) {
          ChunkRowsT<v, DC>(p, k_rows, v_rows, stride, n, b * BS + j, qt, row_lo, row_hi, nrows, sc);
        });
      }
    }
    alignas(64) float row[D];
    for (int64_t i = 0; i < nrows; ++i) {
      const float sum = l[i];
      const __m512 inv = _mm512_set1_ps(sum > 0.0f ? p.v_scale / sum : 0.0f);
      for (int64_t d = 0; d < D; ++d) row[d] = acc[d * 16 * nv + i];
      uint16_t* o = out + (toks[i / G] * p.num_q_heads + kh * G + i % G) * D;
      for (int c = 0; c < DC; ++c)
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(o + 16 * c),
                            (__m256i)_mm512_cvtneps_pbh(_mm512_mul_ps(_mm512_load_ps(row + 16 * c), inv)));
    }
  }
}

// The fast tile where it applies (bfloat16 queries, a bfloat16 or fp8 pool, head_dim 64, 128 or 256); false: use
// AttendTile.
template <typename TKV>
inline bool AttendTileFastIfAny(const Problem& p, const uint16_t* q, const TKV* k, const TKV* v,
                                uint16_t* out, int64_t s, const int32_t* toks, int64_t nt, int64_t kh0, int64_t kh1,
                                std::unique_ptr<TileFastScratch>& scratch) {
  if (p.head_dim != 64 && p.head_dim != 128 && p.head_dim != 256) return false;
  if (p.num_q_heads / p.num_kv_heads * kTile > 16 * kMaxRowVectors) return false;  // rows of a kv head: AttendTile
  if (!scratch) scratch = std::make_unique<TileFastScratch>(16 * kMaxRowVectors, p.head_dim);
  if (p.head_dim == 64) AttendTileFast<4>(p, q, k, v, out, s, toks, nt, kh0, kh1, *scratch);
  if (p.head_dim == 128) AttendTileFast<8>(p, q, k, v, out, s, toks, nt, kh0, kh1, *scratch);
  if (p.head_dim == 256) AttendTileFast<16>(p, q, k, v, out, s, toks, nt, kh0, kh1, *scratch);
  return true;
}
#else
struct TileFastScratch {};
template <typename TKV>
inline bool AttendTileFastIfAny(const Problem&, const uint16_t*, const TKV*, const TKV*, uint16_t*, int64_t,
                                const int32_t*, int64_t, int64_t, int64_t, std::unique_ptr<TileFastScratch>&) {
  return false;
}
#endif

// A unit of work before the kv-head split: one decode token (AttendItem), or up to kTile consecutive query tokens of
// one sequence (AttendTile): tokens[start, start + count) of the state's token list, all of sequence `seq`.
struct Unit {
  int32_t seq, start, count;
  bool tile;  // prompt tokens (AttendTile); else one token (AttendItem)
};

// One call's work (work_queue.h): every item is a unit's range of kv heads. q and out are T, the pool TKV.
template <typename T, typename TKV>
struct ParallelAttention {
  // bfloat16 queries over a bfloat16 or fp8 pool: the AVX512_BF16 items where the CPU has them
  static constexpr bool kBf16Dots = std::is_same_v<T, uint16_t> && (std::is_same_v<TKV, uint16_t> || kIsFp8<TKV>);
  Problem p;
  const T* q;
  const TKV *k, *v;
  T* out;
  std::vector<int32_t> tokens;  // the real query tokens, grouped by sequence, in order
  std::vector<Unit> units;
  struct Item {
    int32_t unit, kh0, kh1;  // units[unit]'s kv heads [kh0, kh1)
  };
  std::vector<Item> items;  // in the order they are claimed
  int64_t max_kv_per_item;  // the most kv heads of an item (scratch sizes)
  WorkQueue work;           // total = items.size()

  void Drain() {
    int64_t i = work.Claim();
    if (i >= work.total) return;  // nothing left: return before reading anything
    const int64_t heads = max_kv_per_item * (p.num_q_heads / p.num_kv_heads);
    Scratch scratch(heads, p.head_dim, p.block_size);
    std::unique_ptr<TileScratch> tile;
    std::unique_ptr<FastScratch> fast;
    std::unique_ptr<TileFastScratch> fast_tile;
    while (i < work.total) {
      // The thread's next item is claimed now, so that a decode item can prefetch what it reads first while this
      // one finishes (else every item started on a cold block).
      const int64_t next_item = work.Claim();
      const int64_t kh0 = items[i].kh0, kh1 = items[i].kh1;
      const Unit& u = units[items[i].unit];
      if (!u.tile) {
        bool done_fast = false;
        if constexpr (kBf16Dots) {
          Rows next;
          if (next_item < work.total && !units[items[next_item].unit].tile) {
            const Unit& n = units[items[next_item].unit];
            next = FirstRows(p, k, n.seq, tokens[n.start], items[next_item].kh0);
          }
          done_fast = AttendItemFastIfAny(p, q, k, v, out, u.seq, tokens[u.start], kh0, kh1, next, fast);
        }
        if (!done_fast) AttendItem(p, q, k, v, out, u.seq, tokens[u.start], kh0, kh1, scratch);
      } else {
        bool done_fast = false;
        if constexpr (kBf16Dots)
          done_fast = AttendTileFastIfAny(p, q, k, v, out, u.seq, tokens.data() + u.start, u.count, kh0, kh1,
                                          fast_tile);
        if (!done_fast) {
          if (!tile) tile = std::make_unique<TileScratch>(kTile * heads, p.head_dim, p.block_size);
          AttendTile(p, q, k, v, out, u.seq, tokens.data() + u.start, u.count, kh0, kh1, *tile);
        }
      }
      work.Finish();
      i = next_item;
    }
  }
};

template <typename T, typename TKV>
ffi::Error Run(ffi::ThreadPool pool, const Problem& p, const T* q, const TKV* k, const TKV* v, T* out) {
  std::memset(out, 0, sizeof(T) * p.num_tokens * p.num_q_heads * p.head_dim);
  if (p.num_seqs == 0) return ffi::Error::Success();
  const int64_t threads = std::max<int64_t>(pool.num_threads(), 1);

  auto state = std::make_shared<ParallelAttention<T, TKV>>();
  state->p = p;
  state->q = q;
  state->k = k;
  state->v = v;
  state->out = out;
  // The real query tokens of each sequence (a token claimed by two sequences' ranges goes to the first), cut into
  // units: its prompt tokens into tiles of kTile tokens, its others a unit per token (see the header; without
  // prompt_lens, a sequence with at most kMaxPerTokenRun tokens this step runs per token, a longer run in tiles).
  std::vector<bool> taken(p.num_tokens, false);
  for (int64_t s = 0; s < p.num_seqs; ++s) {
    if (p.context_lens[s] <= 0) continue;
    const int64_t t0 = std::max<int64_t>(p.query_start_loc[s], 0);
    const int64_t t1 = std::min<int64_t>(p.query_start_loc[s + 1], p.num_tokens);
    const int64_t start = static_cast<int64_t>(state->tokens.size());
    for (int64_t t = t0; t < t1; ++t)
      if (!taken[t] && p.positions[t] >= 0) {
        taken[t] = true;
        state->tokens.push_back(static_cast<int32_t>(t));
      }
    const int64_t end = static_cast<int64_t>(state->tokens.size());
    int64_t split = start;  // tokens [start, split) run in tiles, [split, end) one per token
    if (p.prompt_lens[s] >= 0) {
      while (split < end && p.positions[state->tokens[split]] < p.prompt_lens[s]) ++split;
    } else if (end - start > kMaxPerTokenRun) {
      split = end;
    }
    for (int64_t u = start; u < split; u += kTile)
      state->units.push_back({static_cast<int32_t>(s), static_cast<int32_t>(u),
                              static_cast<int32_t>(std::min(kTile, split - u)), true});
    for (int64_t u = split; u < end; ++u)
      state->units.push_back({static_cast<int32_t>(s), static_cast<int32_t>(u), 1, false});
  }
  const int64_t num_units = static_cast<int64_t>(state->units.size());
  if (num_units == 0) return ffi::Error::Success();
  // Prompt tiles first, one item per kv head, longest context first: they are the long items (a tile walks its
  // kv heads one after the other anyway), and a thread that takes one last while the others have run out of
  // decodes would leave them idle (a mixed step: a chunk of a long prompt beside many decodes). Then decodes:
  // whole units (every kv head: each block is read as one contiguous run) when there are enough of them to balance
  // the threads (8 items per thread); else each unit's kv heads split over several items.
  std::vector<int32_t> tiles, decodes;
  for (int64_t u = 0; u < num_units; ++u) (state->units[u].tile ? tiles : decodes).push_back(u);
  std::stable_sort(tiles.begin(), tiles.end(), [&](int32_t a, int32_t b) {
    return p.context_lens[state->units[a].seq] > p.context_lens[state->units[b].seq];
  });
  for (int32_t u : tiles)
    for (int32_t kh = 0; kh < p.num_kv_heads; ++kh) state->items.push_back({u, kh, kh + 1});
  const int64_t num_decodes = static_cast<int64_t>(decodes.size());
  const int64_t splits =
      num_decodes ? std::clamp<int64_t>((8 * threads + num_decodes - 1) / num_decodes, 1, p.num_kv_heads) : 1;
  const int64_t kv_per_item = (p.num_kv_heads + splits - 1) / splits;
  for (int32_t u : decodes)
    for (int64_t kh = 0; kh < p.num_kv_heads; kh += kv_per_item)
      state->items.push_back({u, static_cast<int32_t>(kh),
                              static_cast<int32_t>(std::min<int64_t>(kh + kv_per_item, p.num_kv_heads))});
  state->max_kv_per_item = num_decodes ? kv_per_item : 1;
  state->work.total = static_cast<int64_t>(state->items.size());
  RunOnPool(pool, state);
  return ffi::Error::Success();
}

ffi::Error PagedAttentionImpl(ffi::ThreadPool pool, ffi::AnyBuffer q, ffi::AnyBuffer k_cache,
                                    ffi::AnyBuffer v_cache, ffi::Buffer<ffi::S32> layer,
                                    ffi::Buffer<ffi::S32> block_tables, ffi::Buffer<ffi::S32> context_lens,
                                    ffi::Buffer<ffi::S32> query_start_loc, ffi::Buffer<ffi::S32> positions,
                                    ffi::Buffer<ffi::S32> prompt_lens, ffi::Buffer<ffi::F32> kv_scales, float scale, int64_t sliding_window,
                                    float soft_cap, ffi::Result<ffi::AnyBuffer> out) {
  auto qd = q.dimensions(), kd = k_cache.dimensions(), vd = v_cache.dimensions();
  auto td = block_tables.dimensions();
  if (qd.size() != 3 || kd.size() != 5 || vd.size() != 5 || td.size() != 2)
    return ffi::Error::InvalidArgument("paged_attention: q must be [T, Hq, D], the pools [L, NB, BS, Hkv, D]"
                                       " and block_tables [S, W]");
  for (int i = 0; i < 5; ++i)
    if (kd[i] != vd[i]) return ffi::Error::InvalidArgument("paged_attention: k_cache and v_cache differ");
  Problem p;
  p.num_tokens = qd[0];
  p.num_q_heads = qd[1];
  p.head_dim = qd[2];
  p.num_layers = kd[0];
  p.num_blocks = kd[1];
  p.block_size = kd[2];
  p.num_kv_heads = kd[3];
  p.num_seqs = td[0];
  p.width = td[1];
  if (kd[4] != p.head_dim || p.num_kv_heads <= 0 || p.num_q_heads % p.num_kv_heads != 0)
    return ffi::Error::InvalidArgument("paged_attention: head_dim or head counts do not match");
  if (context_lens.element_count() != static_cast<size_t>(p.num_seqs) ||
      query_start_loc.element_count() != static_cast<size_t>(p.num_seqs + 1) ||
      positions.element_count() != static_cast<size_t>(p.num_tokens) || layer.element_count() != 1 ||
      prompt_lens.element_count() != static_cast<size_t>(p.num_seqs) || kv_scales.element_count() != 2)
    return ffi::Error::InvalidArgument("paged_attention: context_lens, query_start_loc, positions, prompt_lens or "
                                       "kv_scales has the wrong length");
  const auto pool_type = k_cache.element_type();
  const bool fp8 = pool_type == ffi::DataType::F8E4M3FN || pool_type == ffi::DataType::F8E5M2;
  if (q.element_type() != out->element_type() || v_cache.element_type() != pool_type ||
      (!fp8 && pool_type != q.element_type()))
    return ffi::Error::InvalidArgument("paged_attention: q and the output need one dtype, and the pools q's or an fp8 "
                                       "one");
  if (p.num_blocks <= 0 || p.num_layers <= 0)
    return ffi::Error::InvalidArgument("paged_attention: empty pool");
  p.layer = std::clamp<int64_t>(layer.typed_data()[0], 0, p.num_layers - 1);
  p.block_tables = block_tables.typed_data();
  p.context_lens = context_lens.typed_data();
  p.query_start_loc = query_start_loc.typed_data();
  p.positions = positions.typed_data();
  p.prompt_lens = prompt_lens.typed_data();
  // fp8 scales, folded: q . (k * k_scale) = (q . k) * k_scale, and v_scale on each output row.
  p.scale = scale * kv_scales.typed_data()[0];
  p.v_scale = kv_scales.typed_data()[1];
  p.sliding_window = sliding_window;
  p.soft_cap = soft_cap;
  // bfloat16 and fp8 as their raw bits (ffi.h maps uint16_t to U16, so typed_data<uint16_t> would assert).
  auto run = [&](auto* q_data, auto* out_data) -> ffi::Error {
    using T = std::remove_pointer_t<decltype(q_data)>;
    switch (pool_type) {
      case ffi::DataType::F8E4M3FN:
        return Run(pool, p, q_data, k_cache.reinterpret_data<Fp8E4M3>(), v_cache.reinterpret_data<Fp8E4M3>(),
                   out_data);
      case ffi::DataType::F8E5M2:
        return Run(pool, p, q_data, k_cache.reinterpret_data<Fp8E5M2>(), v_cache.reinterpret_data<Fp8E5M2>(),
                   out_data);
      default:
        return Run(pool, p, q_data, k_cache.reinterpret_data<T>(), v_cache.reinterpret_data<T>(), out_data);
    }
  };
  switch (q.element_type()) {
    case ffi::DataType::F32:
      return run(q.typed_data<float>(), out->typed_data<float>());
    case ffi::DataType::BF16:
      return run(q.reinterpret_data<uint16_t>(), out->reinterpret_data<uint16_t>());
    default:
      return ffi::Error::InvalidArgument("paged_attention: q must be float32 or bfloat16");
  }
}

// The output buffer of an aliased pool update: the pool's own memory (input_output_aliases), or, should XLA hand
// over a distinct buffer, that buffer with the pool copied into it first.
inline char* InPlace(const ffi::AnyBuffer& pool, ffi::Result<ffi::AnyBuffer>& out) {
  char* data = static_cast<char*>(out->untyped_data());
  if (data != pool.untyped_data()) std::memcpy(data, pool.untyped_data(), pool.size_bytes());
  return data;
}

// The K/V write: k_new, v_new [T, Hkv, D] into row `slot_mapping[t]` (block * BS + offset) of `layer` of the
// pools [L, NB, BS, Hkv, D], in the pools' own dtype (XLA CPU's scatter has no 16-bit path and converts a bf16
// pool to float32 and back, whole, around every write). The outputs alias the pools (input_output_aliases), so
// the write is in place; if XLA ever hands over distinct output buffers, the pools are copied into them first.
// Slots outside the pool are skipped. Rows are copied by memcpy: the new K/V already have the pool's dtype.
ffi::Error KvWriteImpl(ffi::AnyBuffer k_cache, ffi::AnyBuffer v_cache, ffi::Buffer<ffi::S32> layer,
                       ffi::AnyBuffer k_new, ffi::AnyBuffer v_new, ffi::Buffer<ffi::S32> slot_mapping,
                       ffi::Result<ffi::AnyBuffer> k_out, ffi::Result<ffi::AnyBuffer> v_out) {
  auto kd = k_cache.dimensions(), vd = v_cache.dimensions(), nd = k_new.dimensions(), wd = v_new.dimensions();
  if (kd.size() != 5 || vd.size() != 5 || nd.size() != 3 || wd.size() != 3 ||
      !std::equal(kd.begin(), kd.end(), vd.begin()) || !std::equal(nd.begin(), nd.end(), wd.begin()))
    return ffi::Error::InvalidArgument("kv_write: the pools must be [L, NB, BS, Hkv, D] and the new K/V [T, Hkv, D]");
  if (nd[1] != kd[3] || nd[2] != kd[4] || slot_mapping.element_count() != static_cast<size_t>(nd[0]) ||
      layer.element_count() != 1)
    return ffi::Error::InvalidArgument("kv_write: the new K/V, slot_mapping and the pools do not fit");
  const auto dtype = k_cache.element_type();
  if (v_cache.element_type() != dtype || k_new.element_type() != dtype || v_new.element_type() != dtype ||
      k_out->element_type() != dtype || v_out->element_type() != dtype)
    return ffi::Error::InvalidArgument("kv_write: the pools and the new K/V need one dtype");
  if (kd[0] <= 0 || kd[1] <= 0 || k_cache.element_count() == 0) return ffi::Error::Success();
  const size_t elem = k_cache.size_bytes() / k_cache.element_count();
  const size_t row = static_cast<size_t>(kd[3] * kd[4]) * elem;  // one token of one layer
  const int64_t slots = kd[1] * kd[2];
  const int64_t l = std::clamp<int64_t>(layer.typed_data()[0], 0, kd[0] - 1);
  const int32_t* slot = slot_mapping.typed_data();
  const ffi::AnyBuffer* src[2] = {&k_cache, &v_cache};
  const ffi::AnyBuffer* add[2] = {&k_new, &v_new};
  ffi::Result<ffi::AnyBuffer>* dst[2] = {&k_out, &v_out};
  char* base[2];
  for (int i = 0; i < 2; ++i) base[i] = InPlace(*src[i], *dst[i]) + static_cast<size_t>(l * slots) * row;
  // The destination rows are scattered over a pool far larger than the caches: each copy's stores would wait for
  // their lines one row after another. Asked for first (for writing), the lines arrive together.
  for (int64_t t = 0; t < nd[0]; ++t)
    if (slot[t] >= 0 && slot[t] < slots)
      for (int i = 0; i < 2; ++i)
        for (size_t at = 0; at < row; at += 64) __builtin_prefetch(base[i] + static_cast<size_t>(slot[t]) * row + at, 1);
  for (int i = 0; i < 2; ++i) {
    const char* rows = static_cast<const char*>(add[i]->untyped_data());
    for (int64_t t = 0; t < nd[0]; ++t)
      if (slot[t] >= 0 && slot[t] < slots)
        std::memcpy(base[i] + static_cast<size_t>(slot[t]) * row, rows + t * row, row);
  }
  return ffi::Error::Success();
}

// Whole blocks, every layer: k_blocks, v_blocks [L, N, BS, Hkv, D] into blocks dst [N] of the pools (copy-on-write
// copies and swap-ins), in place through aliasing as kv_write is, in any dtype. Block ids outside the pool are
// skipped; a repeated id gets the last of its blocks.
ffi::Error SetBlocksImpl(ffi::AnyBuffer k_cache, ffi::AnyBuffer v_cache, ffi::Buffer<ffi::S32> dst,
                         ffi::AnyBuffer k_blocks, ffi::AnyBuffer v_blocks, ffi::Result<ffi::AnyBuffer> k_out,
                         ffi::Result<ffi::AnyBuffer> v_out) {
  auto kd = k_cache.dimensions(), vd = v_cache.dimensions(), bd = k_blocks.dimensions(), wd = v_blocks.dimensions();
  if (kd.size() != 5 || vd.size() != 5 || bd.size() != 5 || wd.size() != 5 ||
      !std::equal(kd.begin(), kd.end(), vd.begin()) || !std::equal(bd.begin(), bd.end(), wd.begin()))
    return ffi::Error::InvalidArgument("set_blocks: the pools and the blocks must be [L, NB or N, BS, Hkv, D]");
  if (bd[0] != kd[0] || bd[2] != kd[2] || bd[3] != kd[3] || bd[4] != kd[4] ||
      dst.element_count() != static_cast<size_t>(bd[1]))
    return ffi::Error::InvalidArgument("set_blocks: the blocks, dst and the pools do not fit");
  const auto dtype = k_cache.element_type();
  if (v_cache.element_type() != dtype || k_blocks.element_type() != dtype || v_blocks.element_type() != dtype ||
      k_out->element_type() != dtype || v_out->element_type() != dtype)
    return ffi::Error::InvalidArgument("set_blocks: the pools and the blocks need one dtype");
  if (k_cache.element_count() == 0) return ffi::Error::Success();
  const size_t elem = k_cache.size_bytes() / k_cache.element_count();
  const size_t block = static_cast<size_t>(kd[2] * kd[3] * kd[4]) * elem;
  const int64_t nb = kd[1], n = bd[1];
  const int32_t* ids = dst.typed_data();
  const ffi::AnyBuffer* src[2] = {&k_cache, &v_cache};
  const ffi::AnyBuffer* add[2] = {&k_blocks, &v_blocks};
  ffi::Result<ffi::AnyBuffer>* out_buf[2] = {&k_out, &v_out};
  for (int i = 0; i < 2; ++i) {
    char* out = InPlace(*src[i], *out_buf[i]);
    const char* blocks = static_cast<const char*>(add[i]->untyped_data());
    for (int64_t l = 0; l < kd[0]; ++l)
      for (int64_t j = 0; j < n; ++j)
        if (ids[j] >= 0 && ids[j] < nb)
          std::memcpy(out + static_cast<size_t>(l * nb + ids[j]) * block, blocks + static_cast<size_t>(l * n + j) * block,
                      block);
  }
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxpagedPagedAttention, PagedAttentionImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::AnyBuffer>()          // q
                                  .Arg<ffi::AnyBuffer>()          // k_cache
                                  .Arg<ffi::AnyBuffer>()          // v_cache
                                  .Arg<ffi::Buffer<ffi::S32>>()   // layer
                                  .Arg<ffi::Buffer<ffi::S32>>()   // block_tables
                                  .Arg<ffi::Buffer<ffi::S32>>()   // context_lens
                                  .Arg<ffi::Buffer<ffi::S32>>()   // query_start_loc
                                  .Arg<ffi::Buffer<ffi::S32>>()   // positions
                                  .Arg<ffi::Buffer<ffi::S32>>()   // prompt_lens
                                  .Arg<ffi::Buffer<ffi::F32>>()   // kv_scales
                                  .Attr<float>("scale")
                                  .Attr<int64_t>("sliding_window")
                                  .Attr<float>("soft_cap")
                                  .Ret<ffi::AnyBuffer>());        // out

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxpagedKvWrite, KvWriteImpl,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::AnyBuffer>()          // k_cache
                                  .Arg<ffi::AnyBuffer>()          // v_cache
                                  .Arg<ffi::Buffer<ffi::S32>>()   // layer
                                  .Arg<ffi::AnyBuffer>()          // k_new
                                  .Arg<ffi::AnyBuffer>()          // v_new
                                  .Arg<ffi::Buffer<ffi::S32>>()   // slot_mapping
                                  .Ret<ffi::AnyBuffer>()          // k_cache, aliased
                                  .Ret<ffi::AnyBuffer>());        // v_cache, aliased

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxpagedSetBlocks, SetBlocksImpl,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::AnyBuffer>()          // k_cache
                                  .Arg<ffi::AnyBuffer>()          // v_cache
                                  .Arg<ffi::Buffer<ffi::S32>>()   // dst
                                  .Arg<ffi::AnyBuffer>()          // k_blocks
                                  .Arg<ffi::AnyBuffer>()          // v_blocks
                                  .Ret<ffi::AnyBuffer>()          // k_cache, aliased
                                  .Ret<ffi::AnyBuffer>());        // v_cache, aliased
