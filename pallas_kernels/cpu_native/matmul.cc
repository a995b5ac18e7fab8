// Native CPU bf16 matmul over a stacked layer weight, an XLA FFI custom call (built and registered by native.py).
//
//   x      [M, K]        bfloat16   activations (K even)
//   w      [K, N] or [L, K, N]  bfloat16   weights as stored for x @ w; a stacked [L, K, N] is read at `layer`
//                                   in place (no per-layer slice is copied); or prepacked [L, N/32, K/2, 64]:
//                                   each panel already in the layout described below (native.py's prepack_weight)
//   layer  [] int32                 which of the L matrices (ignored for a [K, N] w; clipped to [0, L))
//   rows   [] int32                 how many rows of x are real (clipped to [0, M]): only those are multiplied, the
//                                   others are a bucketed step's padding and get zeros
//   out    [M, N]        bfloat16 or float32   x @ w accumulated in float32 (bf16 out: rounded to nearest even)
//
// Why: XLA CPU's bf16 dot packs the whole weight matrix into its own layout on every call. A decode step's few
// rows do little work per weight, so that packing (a read and a write of every weight, every step) is a large part
// of the step (at prefill sizes the two run at about the same rate, and here the bf16 result is written
// directly). Here each worker takes panels of 32 output columns, interleaves the panel's rows in pairs
// ([K/2, 32, 2], what VDPBF16PS multiplies) into a buffer that stays in its L1/L2 cache, and runs every row of x
// over it in blocks of kRows rows: per pair of k, two loads of packed weights and 2 x kRows dot-product
// instructions, the x pair broadcast from memory. Every weight is read from memory once per call.
//
// A prepacked weight skips the packing: its panels are laid out that way once, at load, each one contiguous run
// of K * 64 bytes. Packing on every call reads 64 bytes of each weight row with a stride of N * 2 bytes and writes
// them back; on the 2-core AMD EPYC this was measured on, that ran at ~17 GB/s against ~40 GB/s for a plain
// stream, which is most of a decode step's matmul time (benchmarks/matmul.py, "prepacked" column).
//
// JaxpagedMatmulGlu is the first half of a gated MLP in one pass: out = act(x @ w_gate) * (x @ w_up), with
// w_gate, w_up [K, N] or [L, K, N] and act SiLU (0) or GELU-tanh (1). Each worker packs the same 32 output columns
// of both weights and runs them in blocks of kGluRows rows, with two gate and two up accumulators per row. The
// roundings are the unfused bf16 model's: each product, then act(gate), then the product of the two are rounded to
// bfloat16 (act in float32). XLA would write both [M, N] products and read them back for the activation's fusion.
//
// Panels are claimed by the calling thread and by helper tasks on XLA's intra-op thread pool (work_queue.h).
// Without AVX512_BF16 the kernel is a plain loop (correct, slow): native.py asks `JaxpagedMatmulIsFast` and does
// not pick this kernel then.

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>  // the AVX-512 paths below, each under the macros of the instructions it uses
#endif

#include <algorithm>
#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <cstdlib>
#include <cmath>
#include <cstring>
#include <memory>
#include <mutex>
#include <string>
#include <type_traits>

#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AVX512BF16__)
#define JAXPAGED_MATMUL_AMX 1  // the AMX path below
#include "amx.h"
#endif

#include "vec_math.h"
#include "work_queue.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;
using jaxpaged_native::Bf16ToFloat;
using jaxpaged_native::FloatToBf16;
using jaxpaged_native::RunOnPool;
using jaxpaged_native::WorkQueue;
#if defined(JAXPAGED_MATMUL_AMX)
using jaxpaged_native::AmxWanted;
using jaxpaged_native::TileConfig;
#endif
#if defined(__AVX512F__)
using jaxpaged_native::Exp16;
using jaxpaged_native::Tanh16;
#endif

namespace {

constexpr int64_t kPanel = 32;  // output columns per work item (two 16-lane float32 accumulators per row)
constexpr int kRows = 12;       // rows of x per register block: 24 accumulators + 2 weight registers
constexpr int kGluRows = 6;     // a GLU's: 6 rows x (2 gate + 2 up) accumulators + 4 weight registers

enum Activation : int64_t { kSilu = 0, kGeluTanh = 1 };

struct Problem {
  const uint16_t* x;  // [M, K]
  const uint16_t* w;  // [K, N] (this layer's)
  void* out;          // [M, N]
  bool out_f32;
  int64_t m, k, n;
  const uint16_t* w_up = nullptr;  // GLU only: [K, N] (this layer's); w is then the gate's
  int64_t act = kSilu;             // GLU only
  bool prepacked = false;          // w (and w_up) are already PackPanel's layout, panel after panel (see Setup)
};

// Element (kk, j) of a weight, in either layout: [K, N], or prepacked [N / 32][K / 2][2 halves][16][2].
inline uint16_t WeightAt(const Problem& p, const uint16_t* w, int64_t kk, int64_t j) {
  if (!p.prepacked) return w[kk * p.n + j];
  return w[((j / kPanel) * (p.k / 2) + kk / 2) * 64 + (j % kPanel) / 16 * 32 + (j % 16) * 2 + kk % 2];
}

inline float R(float f) { return Bf16ToFloat(FloatToBf16(f)); }  // rounded to bfloat16

// ActBf16's operations one value at a time (the portable path)
inline float Activate(int64_t act, float g) {
  if (act == kSilu) return R(g * R(1.0f / R(1.0f + R(std::exp(-g)))));
  const float inner = R(g + R(R(R(g * g) * g) * 0.0446777344f));
  return R(g * R(R(R(std::tanh(R(inner * 0.796875f))) + 1.0f) * 0.5f));
}

// Columns [c0, c0 + width) of every row, by a plain loop: the portable path and reference.
void PanelPlain(const Problem& p, int64_t c0, int64_t width) {
  for (int64_t r = 0; r < p.m; ++r) {
    float acc[kPanel] = {};
    for (int64_t kk = 0; kk < p.k; ++kk) {
      const float a = Bf16ToFloat(p.x[r * p.k + kk]);
      for (int64_t j = 0; j < width; ++j) acc[j] += a * Bf16ToFloat(WeightAt(p, p.w, kk, c0 + j));
    }
    if (p.w_up) {  // GLU: acc holds the gate; the up product, then act(gate) * up from bf16-rounded products
      float up[kPanel] = {};
      for (int64_t kk = 0; kk < p.k; ++kk) {
        const float a = Bf16ToFloat(p.x[r * p.k + kk]);
        for (int64_t j = 0; j < width; ++j) up[j] += a * Bf16ToFloat(WeightAt(p, p.w_up, kk, c0 + j));
      }
      for (int64_t j = 0; j < width; ++j)
        acc[j] = Activate(p.act, R(acc[j])) * R(up[j]);
    }
    for (int64_t j = 0; j < width; ++j) {
      if (p.out_f32)
        static_cast<float*>(p.out)[r * p.n + c0 + j] = acc[j];
      else
        static_cast<uint16_t*>(p.out)[r * p.n + c0 + j] = FloatToBf16(acc[j]);
    }
  }
}

#if defined(__AVX512BF16__)
constexpr bool kFast = true;

// packed [K/2][2][16] int32 lanes: lane j of half h of pair kp holds (w[2kp][c0 + 16h + j], w[2kp + 1][...]).
void PackPanel(const Problem& p, const uint16_t* w, int64_t c0, int64_t width, __m512i* packed) {
  const __mmask32 mask = width >= 32 ? ~__mmask32(0) : ((__mmask32(1) << width) - 1);
  alignas(64) static const uint16_t kLo[32] = {0, 32, 1, 33, 2, 34, 3, 35, 4, 36, 5, 37, 6, 38, 7, 39,
                                               8, 40, 9, 41, 10, 42, 11, 43, 12, 44, 13, 45, 14, 46, 15, 47};
  alignas(64) static const uint16_t kHi[32] = {16, 48, 17, 49, 18, 50, 19, 51, 20, 52, 21, 53, 22, 54, 23, 55,
                                               24, 56, 25, 57, 26, 58, 27, 59, 28, 60, 29, 61, 30, 62, 31, 63};
  const __m512i lo = _mm512_load_si512(kLo), hi = _mm512_load_si512(kHi);
  for (int64_t kp = 0; kp < p.k / 2; ++kp) {
    const __m512i a = _mm512_maskz_loadu_epi16(mask, w + (2 * kp) * p.n + c0);
    const __m512i b = _mm512_maskz_loadu_epi16(mask, w + (2 * kp + 1) * p.n + c0);
    _mm512_store_si512(packed + 2 * kp, _mm512_permutex2var_epi16(a, lo, b));
    _mm512_store_si512(packed + 2 * kp + 1, _mm512_permutex2var_epi16(a, hi, b));
  }
}

// The lanes of a panel's 16-column half h (0 or 1) that are columns of the output: the first width - 16 h of them.
inline __mmask16 HalfMask(int64_t width, int64_t h) {
  return static_cast<__mmask16>((1u << std::clamp<int64_t>(width - 16 * h, 0, 16)) - 1);
}

// 16 float32 values to out's elements [at, at + 16) where `mask` has a lane: as they are, or rounded to bfloat16.
inline void Store16(const Problem& p, int64_t at, __mmask16 mask, __m512 v) {
  if (p.out_f32)
    _mm512_mask_storeu_ps(static_cast<float*>(p.out) + at, mask, v);
  else
    _mm256_mask_storeu_epi16(static_cast<uint16_t*>(p.out) + at, mask, (__m256i)_mm512_cvtneps_pbh(v));
}

// Register blocks are kept out of line (noinline): inlined into the work loop, g++ kept the accumulators of an 8-row
// GLU tail on the stack, a store per product (benchmarks/matmul.py, gated MLP at 32 rows).
template <int R>
__attribute__((noinline)) void RowBlock(const Problem& p, const __m512i* packed, int64_t r0, int64_t c0,
                                        int64_t width) {
  __m512 acc[R][2];
#pragma GCC unroll 16
  for (int r = 0; r < R; ++r) acc[r][0] = acc[r][1] = _mm512_setzero_ps();
  const int32_t* xr = reinterpret_cast<const int32_t*>(p.x + r0 * p.k);  // bf16 pairs
  const int64_t pairs = p.k / 2;
  for (int64_t kp = 0; kp < pairs; ++kp) {
    const __m512bh w0 = (__m512bh)_mm512_loadu_si512(packed + 2 * kp);
    const __m512bh w1 = (__m512bh)_mm512_loadu_si512(packed + 2 * kp + 1);
#pragma GCC unroll 16
    for (int r = 0; r < R; ++r) {
      const __m512bh a = (__m512bh)_mm512_set1_epi32(xr[r * pairs + kp]);
      acc[r][0] = _mm512_dpbf16_ps(acc[r][0], a, w0);
      acc[r][1] = _mm512_dpbf16_ps(acc[r][1], a, w1);
    }
  }
  const __mmask16 m_lo = HalfMask(width, 0), m_hi = HalfMask(width, 1);
#pragma GCC unroll 16
  for (int r = 0; r < R; ++r) {
    const int64_t at = (r0 + r) * p.n + c0;
    Store16(p, at, m_lo, acc[r][0]);
    if (m_hi) Store16(p, at + 16, m_hi, acc[r][1]);
  }
}

// f(std::integral_constant<int, rows>{}) for a run-time rows in [1, R]: the register block for a tail of rows.
template <int R, typename F>
void WithRows(int64_t rows, F f) {
  if constexpr (R > 0) {
    if (rows == R) return f(std::integral_constant<int, R>{});
    WithRows<R - 1>(rows, f);
  }
}

// The panel of columns [c0, c0 + width) as PackPanel lays it out: packed into `buffer`, or where it already is.
const __m512i* PanelOf(const Problem& p, const uint16_t* w, int64_t c0, int64_t width, __m512i* buffer) {
  if (p.prepacked) return reinterpret_cast<const __m512i*>(w + c0 * p.k);
  PackPanel(p, w, c0, width, buffer);
  return buffer;
}

void Panel(const Problem& p, int64_t c0, int64_t width, __m512i* buffer) {
  const __m512i* packed = PanelOf(p, p.w, c0, width, buffer);
  int64_t r = 0;
  for (; r + kRows <= p.m; r += kRows) RowBlock<kRows>(p, packed, r, c0, width);
  if (r < p.m) WithRows<kRows - 1>(p.m - r, [&](auto rows) { RowBlock<rows>(p, packed, r, c0, width); });
}

inline __m512 RoundToBf16(__m512 v) {  // float32 -> nearest-even bfloat16 -> float32
  const __m256i h = (__m256i)_mm512_cvtneps_pbh(v);
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}

// act(g) for a bf16 g as JAX computes it in bfloat16 (jax.nn.silu, jax.nn.gelu(approximate=True)): every operation
// in float32 and its result rounded to bfloat16, in JAX's order, so the native MLP has the unfused model's numbers
// (up to exp and tanh's float32 approximations).
inline __m512 ActBf16(int64_t act, __m512 g) {
  const __m512 one = _mm512_set1_ps(1.0f);
  if (act == kSilu) {  // g * (1 / (1 + exp(-g)))
    const __m512 e = RoundToBf16(Exp16(_mm512_sub_ps(_mm512_setzero_ps(), g)));
    const __m512 sigmoid = RoundToBf16(_mm512_div_ps(one, RoundToBf16(_mm512_add_ps(one, e))));
    return RoundToBf16(_mm512_mul_ps(g, sigmoid));
  }
  // g * (0.5 * (1 + tanh(c * (g + a * g^3)))), with c = sqrt(2 / pi) and a = 0.044715 rounded to bfloat16
  const __m512 g3 = RoundToBf16(_mm512_mul_ps(RoundToBf16(_mm512_mul_ps(g, g)), g));
  const __m512 inner = RoundToBf16(_mm512_add_ps(g, RoundToBf16(_mm512_mul_ps(g3, _mm512_set1_ps(0.0446777344f)))));
  const __m512 t = RoundToBf16(Tanh16(RoundToBf16(_mm512_mul_ps(inner, _mm512_set1_ps(0.796875f)))));
  const __m512 cdf = RoundToBf16(_mm512_mul_ps(RoundToBf16(_mm512_add_ps(t, one)), _mm512_set1_ps(0.5f)));
  return RoundToBf16(_mm512_mul_ps(g, cdf));
}

// GLU rows [r0, r0 + R) of the panel's 32 columns from c0 (width of them): gate and up packed as PackPanel's. Per
// pair of k, both 64-byte halves of both weights (two contiguous 128-byte runs) and one broadcast per row feed 4 x R
// dot products. (Two passes over 16-column halves with 2 x 12 accumulators each, the first version, ran at ~83%
// of the plain matmul's rate: benchmarks/matmul.py's "gated MLP" row.)
template <int R>
__attribute__((noinline)) void GluRowBlock(const Problem& p, const __m512i* gate, const __m512i* up, int64_t r0,
                                           int64_t c0, int64_t width) {
  __m512 g[R][2], u[R][2];
#pragma GCC unroll 16
  for (int r = 0; r < R; ++r) g[r][0] = g[r][1] = u[r][0] = u[r][1] = _mm512_setzero_ps();
  const int32_t* xr = reinterpret_cast<const int32_t*>(p.x + r0 * p.k);  // bf16 pairs
  const int64_t pairs = p.k / 2;
  for (int64_t kp = 0; kp < pairs; ++kp) {
    const __m512bh g0 = (__m512bh)_mm512_loadu_si512(gate + 2 * kp);
    const __m512bh g1 = (__m512bh)_mm512_loadu_si512(gate + 2 * kp + 1);
    const __m512bh u0 = (__m512bh)_mm512_loadu_si512(up + 2 * kp);
    const __m512bh u1 = (__m512bh)_mm512_loadu_si512(up + 2 * kp + 1);
#pragma GCC unroll 16
    for (int r = 0; r < R; ++r) {
      const __m512bh a = (__m512bh)_mm512_set1_epi32(xr[r * pairs + kp]);
      g[r][0] = _mm512_dpbf16_ps(g[r][0], a, g0);
      g[r][1] = _mm512_dpbf16_ps(g[r][1], a, g1);
      u[r][0] = _mm512_dpbf16_ps(u[r][0], a, u0);
      u[r][1] = _mm512_dpbf16_ps(u[r][1], a, u1);
    }
  }
  for (int64_t h = 0; h < 2 && 16 * h < width; ++h) {  // the panel's two 16-column halves
    const __mmask16 mask = HalfMask(width, h);
    for (int r = 0; r < R; ++r) {
      const __m512 y = _mm512_mul_ps(ActBf16(p.act, RoundToBf16(g[r][h])), RoundToBf16(u[r][h]));
      Store16(p, (r0 + r) * p.n + c0 + 16 * h, mask, y);
    }
  }
}

void GluPanel(const Problem& p, int64_t c0, int64_t width, __m512i* buffer) {
  const __m512i* gate = PanelOf(p, p.w, c0, width, buffer);
  const __m512i* up = PanelOf(p, p.w_up, c0, width, buffer + p.k);
  int64_t r = 0;
  for (; r + kGluRows <= p.m; r += kGluRows) GluRowBlock<kGluRows>(p, gate, up, r, c0, width);
  if (r < p.m) WithRows<kGluRows - 1>(p.m - r, [&](auto rows) { GluRowBlock<rows>(p, gate, up, r, c0, width); });
}

#if defined(JAXPAGED_MATMUL_AMX)
// The AMX path (CPUs with AMX-BF16: Intel Xeon from Sapphire Rapids on). One TDPBF16PS multiplies a 16 x 32 tile of
// x by a 32 x 16 tile of weights (16 pairs of k, VNNI-interleaved as the packed panel already is: a B tile is one
// 64-byte half of 16 consecutive 128-byte pair rows, stride 128) into a 16 x 16 float32 tile: 8,192 products in one
// instruction, where VDPBF16PS does 32. Each panel's 32 columns are two B tiles; rows of x go in blocks of 16, two
// blocks at a time, so the 8 tile registers are: 4 accumulators (2 row blocks x 2 halves), 2 of x, 2 of weights.
// A GLU runs the panel's halves one after the other: accumulators gate and up for 2 row blocks, 2 of x, 1 of gate
// weights, 1 of up weights.
//
// Every row of a call goes through the same instructions in the same order of k (a partial last block of rows is
// read from a zero-padded copy), so a row's result does not depend on how many rows share the call (the engine's
// batch invariance). It needs K % 32 == 0 (every model dimension here); other K run the AVX-512 path, for all rows.

// Every tile 64 bytes wide: float32 accumulators 16 x 16, x 16 x 32 bf16, weights 16 pairs x 16 columns. With
// fewer than 16 rows in all (`rows` < 16, a decode step of a few sequences), the first block's x and accumulator
// tiles are configured `rows` high and x is read in place: a short tile takes fewer cycles, and each row's products
// are the same instructions as in a full one.
void ConfigureTiles(int64_t rows) {
  TileConfig c;
  for (int t = 0; t < 8; ++t) c.colsb[t] = 64, c.rows[t] = 16;
  if (rows < 16) c.rows[0] = c.rows[1] = c.rows[4] = static_cast<uint8_t>(rows);
  _tile_loadconfig(&c);
}

// Where row block b of x starts (16 rows, stride K): in x, or, for a partial last block, in the zero-padded copy.
struct RowBlocks {
  const uint16_t* x;
  const uint16_t* tail;  // [16, K]: rows [16 * full, M) of x, then zeros; x itself when M < 16; null when M % 16 == 0
  int64_t k, full, total;  // x's row length; blocks wholly in x; all blocks
  const uint16_t* operator[](int64_t b) const { return b < full ? x + b * 16 * k : tail; }
};

// Rows [r0, r0 + n) of a [32, 32]-float buffer of accumulators (two row blocks x two halves), to out's columns
// [c0, c0 + width).
void StoreRows(const Problem& p, const float* acc, int64_t r0, int64_t n, int64_t c0, int64_t width) {
  const __mmask16 m_lo = HalfMask(width, 0), m_hi = HalfMask(width, 1);
  for (int64_t r = 0; r < n; ++r) {
    const int64_t at = (r0 + r) * p.n + c0;
    Store16(p, at, m_lo, _mm512_load_ps(acc + r * 32));
    if (m_hi) Store16(p, at + 16, m_hi, _mm512_load_ps(acc + r * 32 + 16));
  }
}

// The weights' tile loads wait on memory when the panel is not in cache (a decode step reads each weight once):
// the 16 pair rows kAmxAhead blocks of k ahead are prefetched (for a GLU half, `w` is offset by 64 bytes into its
// 128-byte rows, so both of a row's cache lines are asked for).
constexpr int64_t kAmxAhead = 4;
inline void PrefetchWeights(const char* w) {
  const char* row = reinterpret_cast<const char*>(reinterpret_cast<uintptr_t>(w) & ~uintptr_t{127});
  for (int r = 0; r < 16; ++r) {
    _mm_prefetch(row + r * 128, _MM_HINT_T0);
    _mm_prefetch(row + r * 128 + 64, _MM_HINT_T0);
  }
}

// x's row blocks at a0 and (kTwo) a1 times two weight tiles, each 16 pair rows of 64 bytes at stride 128 from
// w6 and w7 (the two halves of a panel, or the same half of a GLU's gate and up): accumulator 0 = a0 x w6,
// 1 = a0 x w7, 2 = a1 x w6, 3 = a1 x w7, stored as floats at out[t] with `stride` bytes per row.
template <bool kTwo>
__attribute__((noinline)) void AmxRowBlocks(const Problem& p, const char* w6, const char* w7, const uint16_t* a0,
                                            const uint16_t* a1, float* const (&out)[4], int64_t stride) {
  const int64_t x_stride = p.k * 2;  // bytes per row of x
  const bool apart = w7 != w6 + 64;  // two weights (a GLU's): prefetch the rows of both
  _tile_zero(0);
  _tile_zero(1);
  if (kTwo) {
    _tile_zero(2);
    _tile_zero(3);
  }
  const int64_t kbs = p.k / 32;
  for (int64_t kb = 0; kb < kbs; ++kb) {
    const int64_t at = kb * 16 * 128;
    if (kb + kAmxAhead < kbs) {
      PrefetchWeights(w6 + at + kAmxAhead * 16 * 128);
      if (apart) PrefetchWeights(w7 + at + kAmxAhead * 16 * 128);
    }
    _tile_loadd(6, w6 + at, 128);
    _tile_loadd(7, w7 + at, 128);
    _tile_loadd(4, a0 + kb * 32, x_stride);
    _tile_dpbf16ps(0, 4, 6);
    _tile_dpbf16ps(1, 4, 7);
    if (kTwo) {
      _tile_loadd(5, a1 + kb * 32, x_stride);
      _tile_dpbf16ps(2, 5, 6);
      _tile_dpbf16ps(3, 5, 7);
    }
  }
  _tile_stored(0, out[0], stride);
  _tile_stored(1, out[1], stride);
  if (kTwo) {
    _tile_stored(2, out[2], stride);
    _tile_stored(3, out[3], stride);
  }
}

// Row blocks two at a time over a panel's two halves: acc [32][32] floats (rows of two blocks x 32 columns).
template <bool kTwo>
void AmxPanelRows(const Problem& p, const char* packed, const uint16_t* a0, const uint16_t* a1, float* acc) {
  float* const out[4] = {acc, acc + 16, acc + 16 * 32, acc + 16 * 32 + 16};
  AmxRowBlocks<kTwo>(p, packed, packed + 64, a0, a1, out, 128);
}

void AmxPanel(const Problem& p, const RowBlocks& rows, int64_t c0, int64_t width, __m512i* buffer) {
  const char* packed = reinterpret_cast<const char*>(PanelOf(p, p.w, c0, width, buffer));
  alignas(64) float acc[32 * 32];
  for (int64_t b = 0; b < rows.total; b += 2) {
    const bool two = b + 1 < rows.total;
    if (two)
      AmxPanelRows<true>(p, packed, rows[b], rows[b + 1], acc);
    else
      AmxPanelRows<false>(p, packed, rows[b], nullptr, acc);
    StoreRows(p, acc, b * 16, std::min<int64_t>(p.m - b * 16, 32), c0, width);
  }
}

void AmxGluPanel(const Problem& p, const RowBlocks& rows, int64_t c0, int64_t width, __m512i* buffer) {
  const char* gate = reinterpret_cast<const char*>(PanelOf(p, p.w, c0, width, buffer));
  const char* up = reinterpret_cast<const char*>(PanelOf(p, p.w_up, c0, width, buffer + p.k));
  alignas(64) float g[32 * 16], u[32 * 16];
  for (int64_t h = 0; h < 2 && 16 * h < width; ++h) {
    const __mmask16 mask = HalfMask(width, h);
    for (int64_t b = 0; b < rows.total; b += 2) {
      // the half's gate into g and up into u, [32][16] each
      float* const out[4] = {g, u, g + 16 * 16, u + 16 * 16};
      if (b + 1 < rows.total)
        AmxRowBlocks<true>(p, gate + 64 * h, up + 64 * h, rows[b], rows[b + 1], out, 64);
      else
        AmxRowBlocks<false>(p, gate + 64 * h, up + 64 * h, rows[b], nullptr, out, 64);
      const int64_t n = std::min<int64_t>(p.m - b * 16, 32);
      for (int64_t r = 0; r < n; ++r) {
        const __m512 y = _mm512_mul_ps(ActBf16(p.act, RoundToBf16(_mm512_load_ps(g + r * 16))),
                                       RoundToBf16(_mm512_load_ps(u + r * 16)));
        Store16(p, (b * 16 + r) * p.n + c0 + 16 * h, mask, y);
      }
    }
  }
}
#endif
#else
constexpr bool kFast = false;
#endif

struct ParallelMatmul {
  Problem p;
  bool amx = false;  // the AMX path (decided once per call, in Run, so that every worker takes the same)
  WorkQueue work;

  void Drain() {
    int64_t i = work.Claim();
    if (i >= work.total) return;
#if defined(__AVX512BF16__)
    // K/2 pairs x 2 halves of 64 bytes (x 2 weights for a GLU), 64-byte aligned
    std::unique_ptr<void, void (*)(void*)> buffer(std::aligned_alloc(64, p.k * (p.w_up ? 128 : 64)), std::free);
    __m512i* packed = static_cast<__m512i*>(buffer.get());
#endif
#if defined(JAXPAGED_MATMUL_AMX)
    std::unique_ptr<uint16_t[]> tail;
    RowBlocks rows{p.x, nullptr, p.k, p.m / 16, (p.m + 15) / 16};
    if (amx) {
      if (p.m < 16) {  // one short block, read in place
        rows.tail = p.x;
      } else if (p.m % 16) {  // the partial last block of rows, zero-padded to 16
        tail.reset(new uint16_t[16 * p.k]());
        std::memcpy(tail.get(), p.x + rows.full * 16 * p.k, (p.m % 16) * p.k * sizeof(uint16_t));
        rows.tail = tail.get();
      }
      ConfigureTiles(p.m);  // tile configuration is per thread
    }
#endif
    for (; i < work.total; i = work.Claim()) {
      const int64_t c0 = i * kPanel, width = std::min(kPanel, p.n - c0);
#if defined(JAXPAGED_MATMUL_AMX)
      if (amx) {
        if (p.w_up)
          AmxGluPanel(p, rows, c0, width, packed);
        else
          AmxPanel(p, rows, c0, width, packed);
        work.Finish();
        continue;
      }
#endif
#if defined(__AVX512BF16__)
      if (p.w_up)
        GluPanel(p, c0, width, packed);
      else
        Panel(p, c0, width, packed);
#else
      PanelPlain(p, c0, width);
#endif
      work.Finish();
    }
#if defined(JAXPAGED_MATMUL_AMX)
    if (amx) _tile_release();  // back to the init state: cheaper context switches for this worker
#endif
  }
};

// Checks the shapes and dtypes and fills `p` (w and w_up at `layer`); an error names what does not fit.
// Only the first `rows` rows of x are multiplied (clipped to [0, M]); the rest of out is zeros (a bucketed step's
// padding rows).
ffi::Error Setup(const char* name, ffi::AnyBuffer x, ffi::AnyBuffer w, const ffi::AnyBuffer* w_up, int32_t layer,
                 int32_t rows, ffi::Result<ffi::AnyBuffer>& out, Problem& p) {
  auto xd = x.dimensions(), wd = w.dimensions(), od = out->dimensions();
  auto fail = [&](const std::string& what) { return ffi::Error::InvalidArgument(std::string(name) + ": " + what); };
  if (xd.size() != 2 || wd.size() < 2 || wd.size() > 4 || od.size() != 2)
    return fail("x must be [M, K], w [K, N], [L, K, N] or prepacked [L, N/32, K/2, 64], out [M, N]");
  const bool prepacked = wd.size() == 4;
  if (prepacked && wd[3] != 2 * kPanel) return fail("a prepacked w must be [L, N/32, K/2, 64]");
  const int64_t m = xd[0], k = xd[1];
  const int64_t n = prepacked ? wd[1] * kPanel : wd[wd.size() - 1], w_k = prepacked ? 2 * wd[2] : wd[wd.size() - 2];
  if (w_k != k || od[0] != m || od[1] != n) return fail("the shapes of x, w and out do not fit");
  if (w_up && !std::equal(wd.begin(), wd.end(), w_up->dimensions().begin(), w_up->dimensions().end()))
    return fail("w_gate and w_up must have one shape");
  if (k % 2) return fail("K must be even");
  if (x.element_type() != ffi::BF16 || w.element_type() != ffi::BF16 || (w_up && w_up->element_type() != ffi::BF16))
    return fail("x and the weights must be bfloat16");
  const auto ot = out->element_type();
  if (ot != ffi::BF16 && ot != ffi::F32) return fail("out must be bfloat16 or float32");
  const int64_t offset = wd.size() >= 3 && wd[0] > 0 ? std::clamp<int64_t>(layer, 0, wd[0] - 1) * k * n : 0;
  p.prepacked = prepacked;
  p.x = static_cast<const uint16_t*>(x.untyped_data());
  p.w = static_cast<const uint16_t*>(w.untyped_data()) + offset;
  if (w_up) p.w_up = static_cast<const uint16_t*>(w_up->untyped_data()) + offset;
  p.out = out->untyped_data();
  p.out_f32 = ot == ffi::F32;
  p.m = std::clamp<int64_t>(rows, 0, m), p.k = k, p.n = n;
  const size_t row_bytes = n * (p.out_f32 ? 4 : 2);
  std::memset(static_cast<char*>(p.out) + p.m * row_bytes, 0, (m - p.m) * row_bytes);
  return ffi::Error::Success();
}

ffi::Error Run(ffi::ThreadPool pool, std::shared_ptr<ParallelMatmul> state) {
  const Problem& p = state->p;
  if (p.m == 0 || p.n == 0) return ffi::Error::Success();
  if (p.k == 0) {  // empty sums: 0, and act(0) * 0 = 0
    std::memset(p.out, 0, p.m * p.n * (p.out_f32 ? 4 : 2));
    return ffi::Error::Success();
  }
  state->work.total = (p.n + kPanel - 1) / kPanel;
#if defined(JAXPAGED_MATMUL_AMX)
  state->amx = p.k % 32 == 0 && AmxWanted();
#endif
  RunOnPool(pool, state);
  return ffi::Error::Success();
}

ffi::Error MatmulImpl(ffi::ThreadPool pool, ffi::AnyBuffer x, ffi::AnyBuffer w, ffi::Buffer<ffi::S32> layer,
                      ffi::Buffer<ffi::S32> rows, ffi::Result<ffi::AnyBuffer> out) {
  auto state = std::make_shared<ParallelMatmul>();
  if (auto e = Setup("matmul", x, w, nullptr, layer.typed_data()[0], rows.typed_data()[0], out, state->p);
      e.failure())
    return e;
  return Run(pool, state);
}

ffi::Error MatmulGluImpl(ffi::ThreadPool pool, ffi::AnyBuffer x, ffi::AnyBuffer w_gate, ffi::AnyBuffer w_up,
                         ffi::Buffer<ffi::S32> layer, ffi::Buffer<ffi::S32> rows, int64_t act,
                         ffi::Result<ffi::AnyBuffer> out) {
  if (act != kSilu && act != kGeluTanh) return ffi::Error::InvalidArgument("matmul_glu: act must be 0 or 1");
  auto state = std::make_shared<ParallelMatmul>();
  state->p.act = act;
  if (auto e = Setup("matmul_glu", x, w_gate, &w_up, layer.typed_data()[0], rows.typed_data()[0], out, state->p);
      e.failure())
    return e;
  return Run(pool, state);
}

}  // namespace

extern "C" int JaxpagedMatmulIsFast() { return kFast ? 1 : 0; }

// 1 when a call with K % 32 == 0 takes the AMX path now (built for AMX, granted by the kernel, not turned off).
extern "C" int JaxpagedMatmulUsesAmx() {
#if defined(JAXPAGED_MATMUL_AMX)
  return AmxWanted() ? 1 : 0;
#else
  return 0;
#endif
}

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxpagedMatmul, MatmulImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::AnyBuffer>()          // x
                                  .Arg<ffi::AnyBuffer>()          // w
                                  .Arg<ffi::Buffer<ffi::S32>>()   // layer
                                  .Arg<ffi::Buffer<ffi::S32>>()   // rows
                                  .Ret<ffi::AnyBuffer>());        // out

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxpagedMatmulGlu, MatmulGluImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::AnyBuffer>()          // x
                                  .Arg<ffi::AnyBuffer>()          // w_gate
                                  .Arg<ffi::AnyBuffer>()          // w_up
                                  .Arg<ffi::Buffer<ffi::S32>>()   // layer
                                  .Arg<ffi::Buffer<ffi::S32>>()   // rows
                                  .Attr<int64_t>("act")
                                  .Ret<ffi::AnyBuffer>());        // out
