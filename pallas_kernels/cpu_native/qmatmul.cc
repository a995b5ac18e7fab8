// Native CPU matmul of activations by quantized weights, read in their quantized form: an XLA FFI custom call
// (built and registered by native.py; Python side: quantized.py). Self-contained: no header of the other kernels.
//
//   x       [M, K]               bfloat16 or float32   activations
//   codes   [L, G, B, C] or [G, B, C]   uint8          the weight's codes, panel layout (below); a stacked weight is
//                                                      read at `layer` in place
//   scales  [L, G, ...] or [G, ...]     f32 or f16     per column, or per (column, block of 32 k)
//   layer   [] int32                    which of the L matrices (clipped to [0, L))
//   rows    [] int32                    how many rows of x are real (clipped to [0, M]); the rest of out is zeros
//   out     [M, N]               bfloat16 or float32   x @ W, W [K, N] the dequantized weight
//
// Weights. Column n, k in block b of 32: W[k, n] = s * u + m with u the unsigned code (4 or 8 bits). Scale modes:
//   kChannel    (0)  s per column, float32 [G, 16]; m = -128 s (int8 per output channel: u = q + 128)
//   kBlockSym   (1)  s per (column, block), float16 [G, B, 16]; m = -offset s, offset 8 (4-bit) or 128 (8-bit)
//                    (GGUF Q4_0, Q8_0)
//   kBlockF16   (2)  s, m per (column, block), float16 [G, B, 2, 16] (GGUF Q4_1)
//   kBlockF32   (3)  s, m per (column, block), float32 [G, B, 2, 16] (GGUF Q4_K, whose d * scale is exact only in
//                    float32, and the 8-bit form of mixed or re-quantized stacks)
// Panel layout: columns in groups of 16 (G = ceil(N / 64) * 4, padded columns have zero codes and scales), k in
// blocks of 32 (B = ceil(K / 32); padded k multiply activations of zero). For (group g, block b) the codes are
// C bytes: 8-bit: 8 vectors of 64 bytes, vector q holding byte u(k = 32b + 4q + t, n = 16g + j) at 4j + t; 4-bit:
// 4 vectors, vector q's byte 4j + t holding k = 32b + 4q + t in its low nibble and k = 32b + 16 + 4q + t in its
// high one. So one 64-byte load is 16 columns x 4 consecutive k (x 2 for 4 bits): what VPDPBUSD multiplies.
//
// JaxpagedQMatmulGlu is a gated MLP's first half in one call: out = act(x @ W_gate) * (x @ W_up), both weights of
// one shape and format, act SiLU (0) or GELU-tanh (1), rounded as the unfused bf16 model rounds (each product,
// act's every step, the product) when out is bfloat16; kInt8Dot only. JaxpagedQMatmul3 is x @ W0, x @ W1, x @ W2 (an
// attention layer's q, k, v: one format and K, each its own N) in one call: x prepared once, one sharing of the work.
//
// Two ways to multiply (attr `mode`), measured by benchmarks/quantization.py --kernel:
//   kInt8Dot (0)  as llama.cpp does: each row of x is quantized on the fly to int8 per block of 32 (d = max|x| / 127,
//                 q = round(x / d)), and VPDPBUSD multiplies u (unsigned) by q (signed) 4 k at a time into int32;
//                 per block, out += s * d * dot + m * d * sum(q). The activations lose what int8 per 32 loses
//                 (~0.4% of each block's largest value at most), as llama.cpp's CPU path does for every type.
//                 On a CPU with AMX-INT8 blocks of 16 rows take TDPBSUD instead (the same bits; JAXPAGED_NATIVE_AMX=0
//                 keeps VPDPBUSD for all rows).
//   kBf16Dot (1)  the codes dequantized in registers (s * u + m in float32, rounded to bfloat16, the numbers a
//                 dequantized-at-load bf16 model has) and multiplied by bf16 x with VDPBF16PS.
// Why native: XLA CPU would convert the whole weight to a full-width temporary before its dot on every call (a pass
// over the weight and a write of twice its bytes); here each 64-byte load of codes feeds the dot products directly,
// so a decode step reads 4.5-9 bits per weight instead of 16.
//
// Without AVX-512 (F, BW, VNNI) the kernel is plain loops computing the same numbers (slow): JaxpagedQMatmulIsFast
// says which, and the engine keeps the weight in the portable layout and XLA's dequantize-and-dot then.

#include <algorithm>
#include <atomic>
#include <cmath>
#include <condition_variable>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <mutex>
#include <string>
#include <type_traits>
#include <vector>

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VNNI__)
#include <immintrin.h>
#define JAXPAGED_QMATMUL_VNNI 1
#if defined(__AVX512BF16__) && defined(__AVX512VBMI__)
#define JAXPAGED_QMATMUL_BF16 1
#endif
#if defined(__AMX_TILE__) && defined(__AMX_INT8__)
#define JAXPAGED_QMATMUL_AMX 1  // kInt8Dot's blocks of 16 rows on AMX tiles (below)
#include "amx.h"
#endif
#endif

#include "vec_math.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;
#if JAXPAGED_QMATMUL_VNNI
using jaxpaged_native::Exp16;
using jaxpaged_native::Tanh16;
#endif
#if JAXPAGED_QMATMUL_AMX
using jaxpaged_native::AmxWanted;
using jaxpaged_native::TileConfig;
#endif

namespace {

constexpr int64_t kGroup = 16;         // columns per group (one 16-lane accumulator)
constexpr int64_t kBlock = 32;         // k per block (one scale, one activation scale)
constexpr int64_t kPanelGroups = 4;    // groups per panel (64 columns): G is a multiple of it; a work item's size
constexpr int64_t kStreamRows = 8;     // a product of at most this many rows streams its weight (memory-bound):
constexpr int64_t kStreamGroups = 16;  // its work items are this many groups (256 columns), not a panel's 4
constexpr int64_t kChunkRows = 128;    // rows per work item
constexpr int64_t kAhead = 8;          // at up to kStreamRows rows, codes are prefetched this many blocks ahead
constexpr int kRows = 8;               // rows per register block

enum ScaleMode : int64_t { kChannel = 0, kBlockSym = 1, kBlockF16 = 2, kBlockF32 = 3 };
enum Mode : int64_t { kInt8Dot = 0, kBf16Dot = 1 };
enum Activation : int64_t { kSilu = 0, kGeluTanh = 1 };

// ---- scalar conversions ---------------------------------------------------------------------------------------------

inline float BitsToFloat(uint32_t bits) {
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}

inline uint32_t FloatToBits(float f) {
  uint32_t bits;
  std::memcpy(&bits, &f, 4);
  return bits;
}

inline float Bf16ToFloat(uint16_t v) { return BitsToFloat(static_cast<uint32_t>(v) << 16); }

inline uint16_t FloatToBf16(float f) {  // round to nearest even; NaN stays NaN
  const uint32_t bits = FloatToBits(f);
  if ((bits & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((bits >> 16) | 0x40u);
  return static_cast<uint16_t>((bits + 0x7fffu + ((bits >> 16) & 1u)) >> 16);
}

inline float HalfToFloat(uint16_t h) {  // IEEE binary16 -> float32, exact
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16;
  const uint32_t exp = (h >> 10) & 0x1fu, mant = h & 0x3ffu;
  if (exp == 0) {  // zero or subnormal: mant * 2^-24
    const float v = static_cast<float>(mant) * 5.9604644775390625e-8f;
    return sign ? -v : v;
  }
  if (exp == 31) return BitsToFloat(sign | 0x7f800000u | (mant << 13));
  return BitsToFloat(sign | ((exp + 112) << 23) | (mant << 13));
}

inline int64_t CodeBytes(int bits) { return bits == 4 ? 256 : 512; }

inline int64_t ScaleBytes(int64_t mode) {  // per (group, block); kChannel: per group
  switch (mode) {
    case kChannel: return kGroup * 4;
    case kBlockSym: return kGroup * 2;
    case kBlockF16: return 2 * kGroup * 2;
    default: return 2 * kGroup * 4;
  }
}

// ---- the problem ----------------------------------------------------------------------------------------------------

// An array of n T, uninitialised (phase 1 writes every element it reads), 64-byte aligned: an AMX tile's 32-byte
// row of x must not straddle two cache lines.
template <typename T>
struct AlignedArray {
  std::unique_ptr<T[], void (*)(void*)> ptr{nullptr, std::free};
  void resize(size_t n) { ptr.reset(static_cast<T*>(std::aligned_alloc(64, (n * sizeof(T) + 63) / 64 * 64))); }
  T* data() const { return ptr.get(); }
  T& operator[](size_t i) const { return ptr[i]; }
};

// The activations as the products read them: int8 codes [m, kp], d and d * sum(q) per block [m, blocks], and the sum
// of the latter per row [m] (kInt8Dot); bf16 [m, kp] (kBf16Dot).
struct Activations {
  AlignedArray<int8_t> qx;
  AlignedArray<float> dx, sx, sx_row;
  AlignedArray<uint16_t> xb;
};

struct QState {
  // shapes: x [m_all, k], out [m_all, n]; codes of this layer [groups, blocks, CodeBytes(bits)]
  int64_t m = 0, m_all = 0, k = 0, kp = 0, n = 0, groups = 0, blocks = 0;
  int bits = 4;
  int64_t scale_mode = kBlockF16, mode = kInt8Dot;
  bool amx = false;  // kInt8Dot's full blocks of 16 rows on AMX tiles (decided once per call, in Run)
  const uint8_t* codes = nullptr;
  const uint8_t* scales = nullptr;
  const uint8_t* up_codes = nullptr;  // a gated MLP's (JaxpagedQMatmulGlu): codes and scales are the gate's
  const uint8_t* up_scales = nullptr;
  int64_t act = -1;                   // kSilu, kGeluTanh for a gated MLP
  const void* x = nullptr;
  bool x_f32 = false;
  void* out = nullptr;
  bool out_f32 = false;
  // the activations, prepared by phase 1 (shared by the weights of one JaxpagedQMatmul3 call)
  std::shared_ptr<Activations> a = std::make_shared<Activations>();
  // phase 2's work: per chunk of rows, `col_items` items of `item_groups` groups each over the groups that hold
  // columns (the padded ones are skipped)
  int64_t live_groups = 0, item_groups = 0, col_items = 0;

  float XAt(int64_t r, int64_t kk) const {
    if (kk >= k) return 0.0f;
    return x_f32 ? static_cast<const float*>(x)[r * k + kk] : Bf16ToFloat(static_cast<const uint16_t*>(x)[r * k + kk]);
  }
  const uint8_t* GroupCodes(int64_t g, bool up = false) const {
    return (up ? up_codes : codes) + g * blocks * CodeBytes(bits);
  }
  const uint8_t* BlockScales(int64_t g, int64_t b, bool up = false) const {
    return (up ? up_scales : scales) + (scale_mode == kChannel ? g : g * blocks + b) * ScaleBytes(scale_mode);
  }
};

// s and m of column j of (group g, block b), scalar
inline void ScaleAt(const QState& p, int64_t g, int64_t b, int64_t j, float* s, float* m, bool up = false) {
  const uint8_t* at = p.BlockScales(g, b, up);
  const float offset = p.bits == 4 ? 8.0f : 128.0f;
  switch (p.scale_mode) {
    case kChannel: {
      float v;
      std::memcpy(&v, at + 4 * j, 4);
      *s = v, *m = -128.0f * v;
      return;
    }
    case kBlockSym: {
      uint16_t h;
      std::memcpy(&h, at + 2 * j, 2);
      *s = HalfToFloat(h), *m = -offset * *s;
      return;
    }
    case kBlockF16: {
      uint16_t hs, hm;
      std::memcpy(&hs, at + 2 * j, 2);
      std::memcpy(&hm, at + 2 * (kGroup + j), 2);
      *s = HalfToFloat(hs), *m = HalfToFloat(hm);
      return;
    }
    default:
      std::memcpy(s, at + 4 * j, 4);
      std::memcpy(m, at + 4 * (kGroup + j), 4);
  }
}

// The weight of code u: s * (u - offset) for kChannel and kBlockSym (one rounding, m = -offset s), s * u + m for the
// others (two roundings, as gguf's dequantization of Q4_1 and Q4_K rounds them).
// Not contracted into one FMA (g++ does so by default for C++; clang only within one expression).
#if defined(__GNUC__) && !defined(__clang__)
__attribute__((optimize("fp-contract=off")))
#endif
float Dequantize(const QState& p, int u, float s, float m) {
  if (p.scale_mode == kChannel || p.scale_mode == kBlockSym)
    return static_cast<float>(u - (p.scale_mode == kChannel || p.bits == 8 ? 128 : 8)) * s;
  const float su = static_cast<float>(u) * s;
  return su + m;
}

// code of (k = 32 b + kk, column 16 g + j), scalar
inline int CodeAt(const QState& p, int64_t g, int64_t b, int64_t kk, int64_t j, bool up = false) {
  const uint8_t* c = p.GroupCodes(g, up) + b * CodeBytes(p.bits);
  if (p.bits == 8) return c[(kk / 4) * 64 + j * 4 + kk % 4];
  const int64_t q = (kk % 16) / 4;
  const uint8_t byte = c[q * 64 + j * 4 + kk % 4];
  return kk < 16 ? (byte & 0x0f) : (byte >> 4);
}

// ---- phase 1: the activations ---------------------------------------------------------------------------------------

// Row r quantized per block of 32 (kInt8Dot): d = max|x| / 127, q = round-to-nearest-even(x * (1 / d)), all in float32
// (quantized.py's reference repeats these operations).
[[maybe_unused]] void QuantizeRow(QState& p, int64_t r) {
  int8_t* q = p.a->qx.data() + r * p.kp;
  float total = 0.0f;
  for (int64_t b = 0; b < p.blocks; ++b) {
    float v[kBlock], amax = 0.0f;
    for (int64_t i = 0; i < kBlock; ++i) {
      v[i] = p.XAt(r, b * kBlock + i);
      amax = std::max(amax, std::fabs(v[i]));
    }
    const float d = amax / 127.0f, id = d != 0.0f ? 1.0f / d : 0.0f;
    int sum = 0;
    for (int64_t i = 0; i < kBlock; ++i) {
      const int qi = static_cast<int>(std::nearbyint(v[i] * id));
      q[b * kBlock + i] = static_cast<int8_t>(qi);
      sum += qi;
    }
    p.a->dx[r * p.blocks + b] = d;
    p.a->sx[r * p.blocks + b] = d * static_cast<float>(sum);
    total += p.a->sx[r * p.blocks + b];
  }
  p.a->sx_row[r] = total;
}

#if JAXPAGED_QMATMUL_VNNI
// QuantizeRow's operations on 16 lanes (the same numbers: max, one division, the product rounded to nearest even).
void QuantizeRowVec(QState& p, int64_t r) {
  int8_t* q = p.a->qx.data() + r * p.kp;
  float total = 0.0f;
  for (int64_t b = 0; b < p.blocks; ++b) {
    __m512 v[2];
    for (int h = 0; h < 2; ++h) {
      const int64_t k0 = b * kBlock + 16 * h;
      const int64_t left = std::clamp<int64_t>(p.k - k0, 0, 16);
      const __mmask16 mask = static_cast<__mmask16>((1u << left) - 1);
      if (p.x_f32) {
        v[h] = _mm512_maskz_loadu_ps(mask, static_cast<const float*>(p.x) + r * p.k + k0);
      } else {
        const __m256i raw = _mm256_maskz_loadu_epi16(mask, static_cast<const uint16_t*>(p.x) + r * p.k + k0);
        v[h] = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(raw), 16));
      }
    }
    const float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(v[0]), _mm512_abs_ps(v[1])));
    const float d = amax / 127.0f, id = d != 0.0f ? 1.0f / d : 0.0f;
    const __m512i q0 = _mm512_cvtps_epi32(_mm512_mul_ps(v[0], _mm512_set1_ps(id)));
    const __m512i q1 = _mm512_cvtps_epi32(_mm512_mul_ps(v[1], _mm512_set1_ps(id)));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(q + b * kBlock), _mm512_cvtsepi32_epi8(q0));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(q + b * kBlock + 16), _mm512_cvtsepi32_epi8(q1));
    const int sum = _mm512_reduce_add_epi32(_mm512_add_epi32(q0, q1));
    p.a->dx[r * p.blocks + b] = d;
    p.a->sx[r * p.blocks + b] = d * static_cast<float>(sum);
    total += p.a->sx[r * p.blocks + b];
  }
  p.a->sx_row[r] = total;
}
#endif

void Bf16Row(QState& p, int64_t r) {  // kBf16Dot: x as bf16, zero-padded to kp
  uint16_t* out = p.a->xb.data() + r * p.kp;
  for (int64_t kk = 0; kk < p.kp; ++kk) {
    if (kk >= p.k)
      out[kk] = 0;
    else if (p.x_f32)
      out[kk] = FloatToBf16(static_cast<const float*>(p.x)[r * p.k + kk]);
    else
      out[kk] = static_cast<const uint16_t*>(p.x)[r * p.k + kk];
  }
}

void PrepareRow(QState& p, int64_t r) {
  if (p.mode == kBf16Dot) return Bf16Row(p, r);
#if JAXPAGED_QMATMUL_VNNI
  QuantizeRowVec(p, r);
#else
  QuantizeRow(p, r);
#endif
}

// ---- phase 2, portable: plain loops, the vector paths' numbers up to float32 summation order ----------------------

void StoreValue(const QState& p, int64_t r, int64_t col, float v) {
  if (col >= p.n) return;
  if (p.out_f32)
    static_cast<float*>(p.out)[r * p.n + col] = v;
  else
    static_cast<uint16_t*>(p.out)[r * p.n + col] = FloatToBf16(v);
}

[[maybe_unused]] inline float R(float f) { return Bf16ToFloat(FloatToBf16(f)); }  // rounded to bfloat16

// act(g) as JAX computes it in bfloat16 (jax.nn.silu, jax.nn.gelu(approximate=True)): each operation in float32,
// its result rounded to bfloat16 (`bf16`), in JAX's order; in float32 without the roundings otherwise.
inline float Activate(int64_t act, float g, bool bf16) {
  auto r = [bf16](float v) { return bf16 ? R(v) : v; };
  if (act == kSilu) return r(g * r(1.0f / r(1.0f + r(std::exp(-g)))));
  const float inner = r(g + r(r(r(g * g) * g) * (bf16 ? 0.0446777344f : 0.044715f)));
  return r(g * r(r(r(std::tanh(r(inner * (bf16 ? 0.796875f : 0.7978845608f)))) + 1.0f) * 0.5f));
}

// One output of column (g, j), row r: the weight's (the up weight's with `up`) dot product with the row.
float DotPlain(const QState& p, int64_t r, int64_t g, int64_t j, bool up) {
  float acc = 0.0f, s = 0.0f, m = 0.0f;
  for (int64_t b = 0; b < p.blocks; ++b) {
    ScaleAt(p, g, b, j, &s, &m, up);
    if (p.mode == kInt8Dot) {
      int32_t dot = 0;
      for (int64_t kk = 0; kk < kBlock; ++kk)
        dot += CodeAt(p, g, b, kk, j, up) * static_cast<int32_t>(p.a->qx[r * p.kp + b * kBlock + kk]);
      const float d = p.a->dx[r * p.blocks + b];
      if (p.scale_mode == kChannel) {
        acc = std::fma(static_cast<float>(dot), d, acc);
      } else {
        acc = std::fma(static_cast<float>(dot), s * d, acc);
        acc = std::fma(m, p.a->sx[r * p.blocks + b], acc);
      }
    } else {
      for (int64_t kk = 0; kk < kBlock; ++kk) {
        const float w = Bf16ToFloat(FloatToBf16(Dequantize(p, CodeAt(p, g, b, kk, j, up), s, m)));
        acc += Bf16ToFloat(p.a->xb[r * p.kp + b * kBlock + kk]) * w;
      }
    }
  }
  if (p.mode == kInt8Dot && p.scale_mode == kChannel) acc = s * (acc - 128.0f * p.a->sx_row[r]);
  return acc;
}

[[maybe_unused]] void GroupPlain(const QState& p, int64_t r0, int64_t r1, int64_t g) {
  for (int64_t r = r0; r < r1; ++r) {
    for (int64_t j = 0; j < kGroup; ++j) {
      float y = DotPlain(p, r, g, j, false);
      if (p.act >= 0) {
        const bool bf16 = !p.out_f32;
        const float up = DotPlain(p, r, g, j, true);
        y = Activate(p.act, bf16 ? R(y) : y, bf16) * (bf16 ? R(up) : up);
      }
      StoreValue(p, r, g * kGroup + j, y);
    }
  }
}

#if JAXPAGED_QMATMUL_VNNI
constexpr bool kFast = true;

// f(bits, scale) with the call's format as compile-time constants (std::integral_constant): the vector paths'
// functions are instantiated per format.
template <typename F>
auto WithFormat(const QState& p, F f) {
  auto with_bits = [&](auto bits) {
    switch (p.scale_mode) {
      case kChannel: return f(bits, std::integral_constant<int, kChannel>{});
      case kBlockSym: return f(bits, std::integral_constant<int, kBlockSym>{});
      case kBlockF16: return f(bits, std::integral_constant<int, kBlockF16>{});
      default: return f(bits, std::integral_constant<int, kBlockF32>{});
    }
  };
  return p.bits == 4 ? with_bits(std::integral_constant<int, 4>{}) : with_bits(std::integral_constant<int, 8>{});
}

// The 8 code vectors of (group, block): u8 lanes, vector q holding 16 columns x k = 4q..4q+3 of the block.
template <int Bits>
inline void LoadCodes(const uint8_t* c, __m512i* w) {
  if constexpr (Bits == 8) {
#pragma GCC unroll 8
    for (int q = 0; q < 8; ++q) w[q] = _mm512_loadu_si512(c + 64 * q);
  } else {
    const __m512i low = _mm512_set1_epi8(0x0f);
#pragma GCC unroll 4
    for (int q = 0; q < 4; ++q) {
      const __m512i v = _mm512_loadu_si512(c + 64 * q);
      w[q] = _mm512_and_si512(v, low);
      w[q + 4] = _mm512_and_si512(_mm512_srli_epi16(v, 4), low);
    }
  }
}

// s and m of (group, block) for 16 columns
template <int Bits, int Scale>
inline void LoadScales(const QState& p, int64_t g, int64_t b, bool up, __m512* s, __m512* m) {
  const uint8_t* at = p.BlockScales(g, b, up);
  if constexpr (Scale == kChannel) {
    *s = _mm512_loadu_ps(at);
    *m = _mm512_mul_ps(*s, _mm512_set1_ps(-128.0f));
  } else if constexpr (Scale == kBlockSym) {
    *s = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(at)));
    *m = _mm512_mul_ps(*s, _mm512_set1_ps(Bits == 4 ? -8.0f : -128.0f));
  } else if constexpr (Scale == kBlockF16) {
    *s = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(at)));
    *m = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(at + 32)));
  } else {
    *s = _mm512_loadu_ps(at);
    *m = _mm512_loadu_ps(at + 64);
  }
}

inline void StoreRow(const QState& p, int64_t r, int64_t g, __m512 y) {
  const int64_t c0 = g * kGroup;
  if (c0 >= p.n) return;
  const __mmask16 mask = static_cast<__mmask16>((1u << std::min<int64_t>(p.n - c0, kGroup)) - 1);
  if (p.out_f32)
    _mm512_mask_storeu_ps(static_cast<float*>(p.out) + r * p.n + c0, mask, y);
  else
    _mm256_mask_storeu_epi16(static_cast<uint16_t*>(p.out) + r * p.n + c0, mask,
                             (__m256i)_mm512_cvtneps_pbh(y));
}

// One block's integer dot products `dot` (as float32, exact) of one row with 16 columns, added to the row's acc: by
// d (the row's activation scale of the block) for kChannel, by s * d and m * d * sum(q) for the others; `d` and `sx`
// point at the row's and block's entries of the activations' dx and sx. Both ways of computing the dot products
// (VPDPBUSD, TDPBSUD) end here, so they give the same bits.
template <int Scale>
inline __m512 AddBlock(__m512 acc, __m512 dot, __m512 s, __m512 m, const float* d, const float* sx) {
  if constexpr (Scale == kChannel) return _mm512_fmadd_ps(dot, _mm512_set1_ps(*d), acc);
  acc = _mm512_fmadd_ps(dot, _mm512_mul_ps(s, _mm512_set1_ps(*d)), acc);
  return _mm512_fmadd_ps(m, _mm512_set1_ps(*sx), acc);
}

// kChannel's scale and offset, once per row r at the end: s * (acc - 128 * sum over blocks of d * sum(q)).
inline __m512 FinishChannel(const QState& p, __m512 acc, __m512 s, int64_t r) {
  return _mm512_mul_ps(s, _mm512_sub_ps(acc, _mm512_set1_ps(128.0f * p.a->sx_row[r])));
}

// kInt8Dot: the dot products of rows [r0, r0 + R) with the 16 columns of group g of the weight (the up weight with
// `up`) into acc. Per block: the codes loaded (and unpacked) once, then per row two chains of 4 VPDPBUSD (the row's
// 4-byte groups of q broadcast from memory) and the block's scaling.
template <int R, int Bits, int Scale>
inline void Int8Dots(const QState& p, int64_t r0, int64_t g, bool up, __m512* acc) {
#pragma GCC unroll 16
  for (int r = 0; r < R; ++r) acc[r] = _mm512_setzero_ps();
  const uint8_t* codes = p.GroupCodes(g, up);
  const int8_t* qx = p.a->qx.data();
  const float *dx = p.a->dx.data(), *sx = p.a->sx.data();
  const int64_t step = CodeBytes(Bits);
  __m512 s = _mm512_setzero_ps(), m = _mm512_setzero_ps();
  if constexpr (Scale == kChannel) LoadScales<Bits, Scale>(p, g, 0, up, &s, &m);
  for (int64_t b = 0; b < p.blocks; ++b) {
    if (p.m <= kStreamRows) {  // a pass over the weight: its codes kAhead blocks on asked for now
      const char* next = reinterpret_cast<const char*>(codes + (b + kAhead) * step);
#pragma GCC unroll 8
      for (int64_t line = 0; line < step; line += 64) _mm_prefetch(next + line, _MM_HINT_T0);
    }
    __m512i w[8];
    LoadCodes<Bits>(codes + b * step, w);
    if constexpr (Scale != kChannel) LoadScales<Bits, Scale>(p, g, b, up, &s, &m);
#pragma GCC unroll 16
    for (int r = 0; r < R; ++r) {
      const int32_t* q = reinterpret_cast<const int32_t*>(qx + (r0 + r) * p.kp + b * kBlock);
      __m512i d0 = _mm512_dpbusd_epi32(_mm512_setzero_si512(), w[0], _mm512_set1_epi32(q[0]));
      __m512i d1 = _mm512_dpbusd_epi32(_mm512_setzero_si512(), w[1], _mm512_set1_epi32(q[1]));
      d0 = _mm512_dpbusd_epi32(d0, w[2], _mm512_set1_epi32(q[2]));
      d1 = _mm512_dpbusd_epi32(d1, w[3], _mm512_set1_epi32(q[3]));
      d0 = _mm512_dpbusd_epi32(d0, w[4], _mm512_set1_epi32(q[4]));
      d1 = _mm512_dpbusd_epi32(d1, w[5], _mm512_set1_epi32(q[5]));
      d0 = _mm512_dpbusd_epi32(d0, w[6], _mm512_set1_epi32(q[6]));
      d1 = _mm512_dpbusd_epi32(d1, w[7], _mm512_set1_epi32(q[7]));
      const int64_t at = (r0 + r) * p.blocks + b;
      acc[r] = AddBlock<Scale>(acc[r], _mm512_cvtepi32_ps(_mm512_add_epi32(d0, d1)), s, m, dx + at, sx + at);
    }
  }
  if constexpr (Scale == kChannel) {
#pragma GCC unroll 16
    for (int r = 0; r < R; ++r) acc[r] = FinishChannel(p, acc[r], s, r0 + r);
  }
}

inline __m512 RoundBf16(__m512 v) {  // float32 -> nearest-even bfloat16 -> float32
  const __m256i h = (__m256i)_mm512_cvtneps_pbh(v);
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}

// Activate's operations on 16 lanes (bf16: every result rounded to bfloat16, as JAX's bfloat16 computation).
template <bool Bf16>
inline __m512 ActVec(int64_t act, __m512 g) {
  auto r = [](__m512 v) { return Bf16 ? RoundBf16(v) : v; };
  const __m512 one = _mm512_set1_ps(1.0f);
  if (act == kSilu) {
    const __m512 e = r(Exp16(_mm512_sub_ps(_mm512_setzero_ps(), g)));
    return r(_mm512_mul_ps(g, r(_mm512_div_ps(one, r(_mm512_add_ps(one, e))))));
  }
  const __m512 g3 = r(_mm512_mul_ps(r(_mm512_mul_ps(g, g)), g));
  const __m512 inner = r(_mm512_add_ps(g, r(_mm512_mul_ps(g3, _mm512_set1_ps(Bf16 ? 0.0446777344f : 0.044715f)))));
  const __m512 z = r(_mm512_mul_ps(inner, _mm512_set1_ps(Bf16 ? 0.796875f : 0.7978845608f)));
  const __m512 t = r(Tanh16(z));
  return r(_mm512_mul_ps(g, r(_mm512_mul_ps(r(_mm512_add_ps(t, one)), _mm512_set1_ps(0.5f)))));
}

// A gated MLP's output from its two products: act(gate) * up, each product rounded to bfloat16 first when out is
// bfloat16 (as the unfused bf16 model's are).
inline __m512 GluOut(const QState& p, __m512 gate, __m512 up) {
  if (p.out_f32) return _mm512_mul_ps(ActVec<false>(p.act, gate), up);
  return _mm512_mul_ps(ActVec<true>(p.act, RoundBf16(gate)), RoundBf16(up));
}

// Rows [r0, r0 + R) x group g: the plain product, or with Glu the gated MLP's output.
template <int R, int Bits, int Scale, bool Glu>
__attribute__((noinline)) void Int8Rows(const QState& p, int64_t r0, int64_t g) {
  __m512 acc[R];
  Int8Dots<R, Bits, Scale>(p, r0, g, false, acc);
  if constexpr (Glu) {
    __m512 up[R];
    Int8Dots<R, Bits, Scale>(p, r0, g, true, up);
#pragma GCC unroll 16
    for (int r = 0; r < R; ++r) acc[r] = GluOut(p, acc[r], up[r]);
  }
#pragma GCC unroll 16
  for (int r = 0; r < R; ++r) StoreRow(p, r0 + r, g, acc[r]);
}

#if JAXPAGED_QMATMUL_AMX
// The AMX path (CPUs with AMX-INT8: Intel Xeon from Sapphire Rapids on), for blocks of 16 rows. One TDPBSUD
// multiplies a 16 x 32 tile of x's int8 codes (16 rows, one block of k, read in place from the prepared
// activations) by an 8 x 64-byte tile of the weight's codes (one block of a group: the 8 vectors of 16 columns x 4 k
// that the VNNI path loads, read in place for 8 bits, unpacked for 4) into 16 x 16 int32 dot products: 8,192
// products, where a VPDPBUSD does 64. The scales are per block of 32 k (the activations' always), so each block's
// dot products are stored from their tile and scaled by AddBlock as the VNNI path's are: the same integers (exact
// sums of 32 products of 8 bits) and the same float32 operations on them, so the same bits, and which rows take
// which path (blocks of 16 here, the rest VNNI) changes no row's result. Two row blocks x two groups at a time, so
// the 8 tiles are: 0-3 the dot products (row block i, group j at 2i + j), 4-5 x of the row blocks, 6-7 the codes.
constexpr int64_t kAmxRows = 16;

void ConfigureTiles() {  // per thread
  TileConfig c;
  for (int t = 0; t < 4; ++t) c.rows[t] = kAmxRows, c.colsb[t] = 4 * kGroup;  // int32 [16, 16]
  for (int t = 4; t < 6; ++t) c.rows[t] = kAmxRows, c.colsb[t] = kBlock;      // int8 [16, 32]
  for (int t = 6; t < 8; ++t) c.rows[t] = kBlock / 4, c.colsb[t] = 64;        // u8 [8, 16 x 4]
  _tile_loadconfig(&c);
}

// Where a block's codes tile is read: the codes themselves (8 bits), or their nibbles unpacked into `unpacked`
// (512 bytes, 64-byte aligned).
template <int Bits>
inline const uint8_t* TileCodes(const uint8_t* codes, uint8_t* unpacked) {
  if constexpr (Bits == 8) return codes;
  __m512i v[8];
  LoadCodes<4>(codes, v);
#pragma GCC unroll 8
  for (int q = 0; q < 8; ++q) _mm512_store_si512(unpacked + 64 * q, v[q]);
  return unpacked;
}

// Rows [r0, r0 + 16) (and [r0 + 16, r0 + 32) with TwoRows) x group g (and g + 1 with TwoGroups) of the weight (the
// up weight with `up`), scaled per block into acc [32 rows][2 groups][16 columns] (float32; the first block's
// products are added to zeros, as Int8Dots' are).
template <int Bits, int Scale, bool TwoRows, bool TwoGroups>
__attribute__((noinline)) void AmxDots(const QState& p, int64_t r0, int64_t g, bool up, float* acc) {
  constexpr int kRowBlocks = TwoRows ? 2 : 1, kGroups = TwoGroups ? 2 : 1;
  alignas(64) int32_t dots[2][4][kAmxRows * kGroup];  // blocks of k in turn: [row block * 2 + group]
  alignas(64) uint8_t unpacked[2][2][512];
  const int8_t* x = p.a->qx.data() + r0 * p.kp;
  const float *dx = p.a->dx.data() + r0 * p.blocks, *sx = p.a->sx.data() + r0 * p.blocks;
  const int64_t step = CodeBytes(Bits);
  const uint8_t* codes[2] = {p.GroupCodes(g, up), p.GroupCodes(TwoGroups ? g + 1 : g, up)};
  __m512 s[2], m[2];
  if constexpr (Scale == kChannel) {
    for (int j = 0; j < kGroups; ++j) LoadScales<Bits, Scale>(p, g + j, 0, up, &s[j], &m[j]);
  }
  for (int64_t b = 0; b < p.blocks; ++b) {
    int32_t(*dot)[kAmxRows * kGroup] = dots[b & 1];
    _tile_zero(0);
    if constexpr (TwoGroups) _tile_zero(1);
    if constexpr (TwoRows) _tile_zero(2);
    if constexpr (TwoRows && TwoGroups) _tile_zero(3);
    _tile_loadd(6, TileCodes<Bits>(codes[0] + b * step, unpacked[b & 1][0]), 64);
    if constexpr (TwoGroups) _tile_loadd(7, TileCodes<Bits>(codes[1] + b * step, unpacked[b & 1][1]), 64);
    _tile_loadd(4, x + b * kBlock, p.kp);
    _tile_dpbsud(0, 4, 6);
    if constexpr (TwoGroups) _tile_dpbsud(1, 4, 7);
    if constexpr (TwoRows) {
      _tile_loadd(5, x + kAmxRows * p.kp + b * kBlock, p.kp);
      _tile_dpbsud(2, 5, 6);
      if constexpr (TwoGroups) _tile_dpbsud(3, 5, 7);
    }
    _tile_stored(0, dot[0], 64);
    if constexpr (TwoGroups) _tile_stored(1, dot[1], 64);
    if constexpr (TwoRows) _tile_stored(2, dot[2], 64);
    if constexpr (TwoRows && TwoGroups) _tile_stored(3, dot[3], 64);
    if constexpr (Scale != kChannel) {
      for (int j = 0; j < kGroups; ++j) LoadScales<Bits, Scale>(p, g + j, b, up, &s[j], &m[j]);
    }
    for (int i = 0; i < kRowBlocks; ++i) {
#pragma GCC unroll 16
      for (int r = 0; r < kAmxRows; ++r) {
        const int64_t at = (i * kAmxRows + r) * p.blocks + b;
        const float d_r = dx[at], sx_r = sx[at];  // read once for both groups (acc's stores could alias them)
        for (int j = 0; j < kGroups; ++j) {
          float* a = acc + ((i * kAmxRows + r) * 2 + j) * kGroup;
          const __m512 d = _mm512_cvtepi32_ps(_mm512_load_si512(dot[2 * i + j] + kGroup * r));
          _mm512_store_ps(a, AddBlock<Scale>(b ? _mm512_load_ps(a) : _mm512_setzero_ps(), d, s[j], m[j], &d_r,
                                             &sx_r));
        }
      }
    }
  }
  if constexpr (Scale == kChannel) {
    for (int i = 0; i < kRowBlocks; ++i)
      for (int r = 0; r < kAmxRows; ++r)
        for (int j = 0; j < kGroups; ++j) {
          float* a = acc + ((i * kAmxRows + r) * 2 + j) * kGroup;
          _mm512_store_ps(a, FinishChannel(p, _mm512_load_ps(a), s[j], r0 + i * kAmxRows + r));
        }
  }
}

// AmxDots' blocks and the output (the gated MLP's with p.act >= 0).
template <int Bits, int Scale, bool TwoRows, bool TwoGroups>
void AmxRows(const QState& p, int64_t r0, int64_t g) {
  alignas(64) float acc[2 * kAmxRows * 2 * kGroup], up[2 * kAmxRows * 2 * kGroup];
  AmxDots<Bits, Scale, TwoRows, TwoGroups>(p, r0, g, false, acc);
  if (p.act >= 0) AmxDots<Bits, Scale, TwoRows, TwoGroups>(p, r0, g, true, up);
  for (int64_t r = 0; r < (TwoRows ? 2 : 1) * kAmxRows; ++r) {
    for (int j = 0; j < (TwoGroups ? 2 : 1); ++j) {
      const int64_t at = (r * 2 + j) * kGroup;
      __m512 y = _mm512_load_ps(acc + at);
      if (p.act >= 0) y = GluOut(p, y, _mm512_load_ps(up + at));
      StoreRow(p, r0 + r, g + j, y);
    }
  }
}

// Rows [r0, r1) x `groups` (1 or 2) groups from g: the whole blocks of 16 rows; returns how many rows it did.
template <int Bits, int Scale>
int64_t AmxGroupsOf(const QState& p, int64_t r0, int64_t r1, int64_t g, int64_t groups) {
  int64_t r = r0;
  for (; r + 2 * kAmxRows <= r1; r += 2 * kAmxRows) {
    if (groups == 2)
      AmxRows<Bits, Scale, true, true>(p, r, g);
    else
      AmxRows<Bits, Scale, true, false>(p, r, g);
  }
  if (r + kAmxRows <= r1) {
    if (groups == 2)
      AmxRows<Bits, Scale, false, true>(p, r, g);
    else
      AmxRows<Bits, Scale, false, false>(p, r, g);
    r += kAmxRows;
  }
  return r - r0;
}

int64_t AmxGroups(const QState& p, int64_t r0, int64_t r1, int64_t g, int64_t groups) {
  return WithFormat(p, [&](auto bits, auto scale) { return AmxGroupsOf<bits, scale>(p, r0, r1, g, groups); });
}
#endif

#if JAXPAGED_QMATMUL_BF16
// The weight from its code u (as float32): s * (u - offset) for kChannel and kBlockSym, s * u + m (two roundings)
// otherwise, as `Dequantize` and gguf's own dequantization compute it.
template <int Bits, int Scale>
inline __m512 Dequant(__m512 u, __m512 s, __m512 m) {
  if constexpr (Scale == kChannel || Scale == kBlockSym)
    return _mm512_mul_ps(_mm512_add_ps(u, _mm512_set1_ps(Scale == kChannel || Bits == 8 ? -128.0f : -8.0f)), s);
  else
    // the rounding-mode form keeps g++ (-ffp-contract=fast, its default for C++) from fusing this into one FMA
    return _mm512_add_ps(_mm512_mul_round_ps(u, s, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC), m);
}

// kBf16Dot: rows [r0, r0 + R) x group g. Each code vector (16 columns x 4 k) becomes two vectors of bf16 pairs (16
// columns x 2 k, what VDPBF16PS multiplies): bytes regrouped by pair (VPERMB), widened, s * u + m in float32,
// rounded to bf16 and interleaved; then one VDPBF16PS per row.
template <int R, int Bits, int Scale>
__attribute__((noinline)) void Bf16Rows(const QState& p, int64_t r0, int64_t g) {
  alignas(64) static const uint8_t kPairs[64] = {
      0, 1, 4, 5, 8, 9, 12, 13, 16, 17, 20, 21, 24, 25, 28, 29, 32, 33, 36, 37, 40, 41, 44, 45,
      48, 49, 52, 53, 56, 57, 60, 61, 2, 3, 6, 7, 10, 11, 14, 15, 18, 19, 22, 23, 26, 27, 30, 31,
      34, 35, 38, 39, 42, 43, 46, 47, 50, 51, 54, 55, 58, 59, 62, 63};
  alignas(64) static const uint16_t kInterleave[32] = {0, 16, 1, 17, 2, 18, 3, 19, 4, 20, 5, 21, 6, 22, 7, 23,
                                                       8, 24, 9, 25, 10, 26, 11, 27, 12, 28, 13, 29, 14, 30, 15, 31};
  const __m512i pairs = _mm512_load_si512(kPairs), interleave = _mm512_load_si512(kInterleave);
  const __m512i low16 = _mm512_set1_epi32(0xffff);
  __m512 acc[R];
#pragma GCC unroll 16
  for (int r = 0; r < R; ++r) acc[r] = _mm512_setzero_ps();
  const uint8_t* codes = p.GroupCodes(g);
  __m512 s, m;
  for (int64_t b = 0; b < p.blocks; ++b) {
    __m512i w[8];
    LoadCodes<Bits>(codes + b * CodeBytes(Bits), w);
    LoadScales<Bits, Scale>(p, g, b, false, &s, &m);
    for (int q = 0; q < 8; ++q) {
      const __m512i regrouped = _mm512_permutexvar_epi8(pairs, w[q]);
      for (int h = 0; h < 2; ++h) {  // k = 4q + 2h, 4q + 2h + 1
        const __m512i wide = _mm512_cvtepu8_epi16(h ? _mm512_extracti64x4_epi64(regrouped, 1)
                                                    : _mm512_castsi512_si256(regrouped));
        const __m512 w0 = Dequant<Bits, Scale>(_mm512_cvtepi32_ps(_mm512_and_si512(wide, low16)), s, m);
        const __m512 w1 = Dequant<Bits, Scale>(_mm512_cvtepi32_ps(_mm512_srli_epi32(wide, 16)), s, m);
        const __m512bh wb = (__m512bh)_mm512_permutexvar_epi16(interleave, (__m512i)_mm512_cvtne2ps_pbh(w1, w0));
        const int64_t pair = b * (kBlock / 2) + 2 * q + h;
#pragma GCC unroll 16
        for (int r = 0; r < R; ++r) {
          const int32_t* xr = reinterpret_cast<const int32_t*>(p.a->xb.data() + (r0 + r) * p.kp);
          acc[r] = _mm512_dpbf16_ps(acc[r], (__m512bh)_mm512_set1_epi32(xr[pair]), wb);
        }
      }
    }
  }
#pragma GCC unroll 16
  for (int r = 0; r < R; ++r) StoreRow(p, r0 + r, g, acc[r]);
}
#endif

template <int R, typename F>
void WithRows(int64_t rows, F f) {
  if constexpr (R > 0) {
    if (rows == R) return f(std::integral_constant<int, R>{});
    WithRows<R - 1>(rows, f);
  }
}

template <int Bits, int Scale>
void GroupFast(const QState& p, int64_t r0, int64_t r1, int64_t g) {
  int64_t r = r0;
#if JAXPAGED_QMATMUL_BF16
  if (p.mode == kBf16Dot && p.act >= 0) return GroupPlain(p, r0, r1, g);  // (qmatmul_glu_native asks for kInt8Dot)
  if (p.mode == kBf16Dot) {
    for (; r + kRows <= r1; r += kRows) Bf16Rows<kRows, Bits, Scale>(p, r, g);
    if (r < r1) WithRows<kRows - 1>(r1 - r, [&](auto rows) { Bf16Rows<rows, Bits, Scale>(p, r, g); });
    return;
  }
#else
  if (p.mode == kBf16Dot) return GroupPlain(p, r0, r1, g);
#endif
  if (p.act >= 0) {
    for (; r + kRows <= r1; r += kRows) Int8Rows<kRows, Bits, Scale, true>(p, r, g);
    if (r < r1) WithRows<kRows - 1>(r1 - r, [&](auto rows) { Int8Rows<rows, Bits, Scale, true>(p, r, g); });
    return;
  }
  for (; r + kRows <= r1; r += kRows) Int8Rows<kRows, Bits, Scale, false>(p, r, g);
  if (r < r1) WithRows<kRows - 1>(r1 - r, [&](auto rows) { Int8Rows<rows, Bits, Scale, false>(p, r, g); });
}

void Group(const QState& p, int64_t r0, int64_t r1, int64_t g) {
  WithFormat(p, [&](auto bits, auto scale) { GroupFast<bits, scale>(p, r0, r1, g); });
}
#else
constexpr bool kFast = false;
void Group(const QState& p, int64_t r0, int64_t r1, int64_t g) { GroupPlain(p, r0, r1, g); }
#endif

// ---- work sharing ---------------------------------------------------------------------------------------------------

// The weights of one call: one (JaxpagedQMatmul, JaxpagedQMatmulGlu) or three that multiply the same x
// (JaxpagedQMatmul3), the first one's activations shared by all.
using Parts = std::vector<QState>;

// One phase's work items, shared by the calling thread and helper tasks of XLA's thread pool. Each phase has its own
// counters: a helper that starts late (after its phase ended) finds nothing to claim and touches nothing, and holds
// the state it reads by shared_ptr, so it may outlive the call.
struct PhaseWork {
  std::shared_ptr<Parts> parts;
  int phase = 1;  // 1: the activations, per chunk of rows; 2: the products, per (chunk of rows, part, few groups)
  int64_t total = 0, chunk_items = 0;  // chunk_items: phase 2's items per chunk of rows, over all parts
  std::atomic<int64_t> next{0};
  std::atomic<int64_t> done{0};
  std::mutex mu;
  std::condition_variable cv;

  void Drain() {
    [[maybe_unused]] bool tiles = false;  // this thread's tiles configured
    for (int64_t i = next.fetch_add(1); i < total; i = next.fetch_add(1)) {
      if (phase == 1) {
        QState& p = parts->front();
        const int64_t r0 = i * kChunkRows, r1 = std::min(r0 + kChunkRows, p.m);
        for (int64_t r = r0; r < r1; ++r) PrepareRow(p, r);
      } else {
        int64_t j = i % chunk_items, part = 0;
        while (j >= (*parts)[part].col_items) j -= (*parts)[part++].col_items;
        const QState& p = (*parts)[part];
        const int64_t r0 = (i / chunk_items) * kChunkRows, r1 = std::min(r0 + kChunkRows, p.m);
        const int64_t g0 = j * p.item_groups, g1 = std::min(g0 + p.item_groups, p.live_groups);
#if JAXPAGED_QMATMUL_AMX
        if (p.amx) {  // two groups at a time: their blocks of 16 rows on tiles, the rest VNNI (the same numbers)
          if (!tiles) ConfigureTiles(), tiles = true;
          for (int64_t g = g0; g < g1; g += 2) {
            const int64_t groups = std::min<int64_t>(2, g1 - g), done = AmxGroups(p, r0, r1, g, groups);
            for (int64_t h = g; h < g + groups; ++h) Group(p, r0 + done, r1, h);
          }
        } else
#endif
        for (int64_t g = g0; g < g1; ++g) Group(p, r0, r1, g);
      }
      if (done.fetch_add(1) + 1 == total) {
        std::lock_guard<std::mutex> lock(mu);
        cv.notify_all();
      }
    }
#if JAXPAGED_QMATMUL_AMX
    if (tiles) _tile_release();  // back to the init state: cheaper context switches for this worker
#endif
  }
};

// `items` work items of `phase` on the caller and on helpers of XLA's pool; returns when all are done.
void RunPhase(ffi::ThreadPool& pool, const std::shared_ptr<Parts>& parts, int phase, int64_t items,
              int64_t chunk_items) {
  auto work = std::make_shared<PhaseWork>();
  work->parts = parts, work->phase = phase, work->total = items, work->chunk_items = chunk_items;
  const int64_t helpers = std::min<int64_t>(std::max<int64_t>(pool.num_threads(), 1), items) - 1;
  for (int64_t h = 0; h < helpers; ++h) pool.Schedule([work]() { work->Drain(); });
  work->Drain();
  for (int spin = 0; spin < 4000 && work->done.load(std::memory_order_acquire) < items; ++spin) {
#if JAXPAGED_QMATMUL_VNNI
    _mm_pause();
#endif
  }
  std::unique_lock<std::mutex> lock(work->mu);
  work->cv.wait(lock, [&] { return work->done.load() >= items; });
}

// Checks the shapes and dtypes and fills `p` (codes and scales at `layer`; a gated MLP's up weight, of the same shape
// and format, with up_codes); an error names what does not fit.
ffi::Error Setup(const char* name, ffi::AnyBuffer& x, ffi::Buffer<ffi::U8>& codes, ffi::AnyBuffer& scales,
                 ffi::Buffer<ffi::U8>* up_codes, ffi::AnyBuffer* up_scales, int32_t layer, int32_t rows,
                 int64_t bits, int64_t scale_mode, int64_t mode, ffi::Result<ffi::AnyBuffer>& out, QState& p) {
  auto fail = [name](const std::string& what) { return ffi::Error::InvalidArgument(std::string(name) + ": " + what); };
  auto xd = x.dimensions(), cd = codes.dimensions(), od = out->dimensions();
  if (bits != 4 && bits != 8) return fail("bits must be 4 or 8");
  if (scale_mode < kChannel || scale_mode > kBlockF32) return fail("scale_mode must be 0..3");
  if (mode != kInt8Dot && mode != kBf16Dot) return fail("mode must be 0 or 1");
  if (xd.size() != 2 || od.size() != 2 || (cd.size() != 3 && cd.size() != 4))
    return fail("x must be [M, K], out [M, N] and codes [G, B, C] or [L, G, B, C]");
  const bool stacked = cd.size() == 4;
  const int64_t num_layers = stacked ? cd[0] : 1, groups = cd[stacked], blocks = cd[stacked + 1];
  const int64_t m_all = xd[0], k = xd[1], n = od[1];
  if (cd[stacked + 2] != CodeBytes(bits)) return fail("codes' last dimension must be 256 (4 bits) or 512 (8 bits)");
  if (od[0] != m_all || groups % kPanelGroups || n > groups * kGroup || n <= (groups - kPanelGroups) * kGroup ||
      k > blocks * kBlock || k <= (blocks - 1) * kBlock)
    return fail("the shapes of x, codes and out do not fit: codes need ceil(N / 64) * 4 groups and ceil(K / 32) "
                "blocks");
  const bool f16 = scale_mode == kBlockSym || scale_mode == kBlockF16;
  const int64_t per_layer_scales = (scale_mode == kChannel ? groups : groups * blocks) * ScaleBytes(scale_mode);
  const ffi::AnyBuffer* all_scales[2] = {&scales, up_scales};
  for (const ffi::AnyBuffer* sc : all_scales) {
    if (sc == nullptr) continue;
    if (sc->element_type() != (f16 ? ffi::F16 : ffi::F32))
      return fail("scales must be float16 for scale modes 1 and 2, float32 for 0 and 3");
    if (static_cast<int64_t>(sc->size_bytes()) != num_layers * per_layer_scales)
      return fail("scales do not fit codes and scale_mode");
  }
  if (up_codes && !std::equal(cd.begin(), cd.end(), up_codes->dimensions().begin(), up_codes->dimensions().end()))
    return fail("the gate's and the up weight's codes must have one shape");
  const auto xt = x.element_type(), ot = out->element_type();
  if ((xt != ffi::BF16 && xt != ffi::F32) || (ot != ffi::BF16 && ot != ffi::F32))
    return fail("x and out must be bfloat16 or float32");
  const int64_t l = num_layers > 0 ? std::clamp<int64_t>(layer, 0, num_layers - 1) : 0;
  p.m_all = m_all, p.m = std::clamp<int64_t>(rows, 0, m_all), p.k = k, p.n = n;
  p.kp = blocks * kBlock, p.groups = groups, p.blocks = blocks, p.bits = static_cast<int>(bits);
  p.scale_mode = scale_mode, p.mode = mode;
  const int64_t code_offset = l * groups * blocks * CodeBytes(bits);
  p.codes = codes.typed_data() + code_offset;
  p.scales = static_cast<const uint8_t*>(scales.untyped_data()) + l * per_layer_scales;
  if (up_codes) {
    p.up_codes = up_codes->typed_data() + code_offset;
    p.up_scales = static_cast<const uint8_t*>(up_scales->untyped_data()) + l * per_layer_scales;
  }
  p.x = x.untyped_data(), p.x_f32 = xt == ffi::F32;
  p.out = out->untyped_data(), p.out_f32 = ot == ffi::F32;
  const size_t row_bytes = n * (p.out_f32 ? 4 : 2);
  std::memset(static_cast<char*>(p.out) + p.m * row_bytes, 0, (m_all - p.m) * row_bytes);
  return ffi::Error::Success();
}

ffi::Error Run(ffi::ThreadPool& pool, const std::shared_ptr<Parts>& parts) {
  QState& p = parts->front();  // every part has p's x, rows and format
  if (p.m == 0) return ffi::Error::Success();
  if (p.mode == kInt8Dot) {
    p.a->qx.resize(p.m * p.kp), p.a->dx.resize(p.m * p.blocks), p.a->sx.resize(p.m * p.blocks);
    p.a->sx_row.resize(p.m);
  } else {
    p.a->xb.resize(p.m * p.kp);
  }
  const int64_t row_chunks = (p.m + kChunkRows - 1) / kChunkRows;
  // Work items of consecutive groups of 16 columns (consecutive in memory too). At a few rows the product is a pass
  // over the weight, and a long run of it per item streams faster than a panel's (the prefetchers follow one run,
  // where 2 threads taking small items in turn hop between them), even where 2 threads then share a product unevenly
  // (a 576-column one is 3 items); more rows are compute-bound and take items of one panel, which share evenly
  // (docs/quantization.md has the measurements).
  int64_t chunk_items = 0;
#if JAXPAGED_QMATMUL_AMX
  const bool amx = p.mode == kInt8Dot && p.m >= kAmxRows && AmxWanted();
#else
  const bool amx = false;
#endif
  for (QState& part : *parts) {
    part.a = p.a;
    part.amx = amx;
    part.live_groups = (part.n + kGroup - 1) / kGroup;
    part.item_groups = p.m <= kStreamRows ? kStreamGroups : kPanelGroups;
    part.col_items = (part.live_groups + part.item_groups - 1) / part.item_groups;
    chunk_items += part.col_items;
  }
  if (chunk_items == 0) return ffi::Error::Success();
  if (row_chunks == 1) {  // a decode step's few rows: prepared here, no helper woken for them
    for (int64_t r = 0; r < p.m; ++r) PrepareRow(p, r);
  } else {
    RunPhase(pool, parts, 1, row_chunks, 0);
  }
  RunPhase(pool, parts, 2, row_chunks * chunk_items, chunk_items);
  return ffi::Error::Success();
}

ffi::Error QMatmulImpl(ffi::ThreadPool pool, ffi::AnyBuffer x, ffi::Buffer<ffi::U8> codes, ffi::AnyBuffer scales,
                       ffi::Buffer<ffi::S32> layer, ffi::Buffer<ffi::S32> rows, int64_t bits, int64_t scale_mode,
                       int64_t mode, ffi::Result<ffi::AnyBuffer> out) {
  auto parts = std::make_shared<Parts>(1);
  if (auto e = Setup("qmatmul", x, codes, scales, nullptr, nullptr, layer.typed_data()[0], rows.typed_data()[0],
                     bits, scale_mode, mode, out, parts->front());
      e.failure())
    return e;
  return Run(pool, parts);
}

ffi::Error QMatmulGluImpl(ffi::ThreadPool pool, ffi::AnyBuffer x, ffi::Buffer<ffi::U8> gate_codes,
                          ffi::AnyBuffer gate_scales, ffi::Buffer<ffi::U8> up_codes, ffi::AnyBuffer up_scales,
                          ffi::Buffer<ffi::S32> layer, ffi::Buffer<ffi::S32> rows, int64_t bits, int64_t scale_mode,
                          int64_t act, ffi::Result<ffi::AnyBuffer> out) {
  if (act != kSilu && act != kGeluTanh) return ffi::Error::InvalidArgument("qmatmul_glu: act must be 0 or 1");
  auto parts = std::make_shared<Parts>(1);
  parts->front().act = act;
  if (auto e = Setup("qmatmul_glu", x, gate_codes, gate_scales, &up_codes, &up_scales, layer.typed_data()[0],
                     rows.typed_data()[0], bits, scale_mode, kInt8Dot, out, parts->front());
      e.failure())
    return e;
  return Run(pool, parts);
}

// x @ W0, x @ W1, x @ W2 in one call (an attention layer's q, k and v): the weights of one format and K, each its own N;
// x is prepared once and the three products' columns shared out as one call's.
ffi::Error QMatmul3Impl(ffi::ThreadPool pool, ffi::AnyBuffer x, ffi::Buffer<ffi::U8> codes0, ffi::AnyBuffer scales0,
                        ffi::Buffer<ffi::U8> codes1, ffi::AnyBuffer scales1, ffi::Buffer<ffi::U8> codes2,
                        ffi::AnyBuffer scales2, ffi::Buffer<ffi::S32> layer, ffi::Buffer<ffi::S32> rows, int64_t bits,
                        int64_t scale_mode, int64_t mode, ffi::Result<ffi::AnyBuffer> out0,
                        ffi::Result<ffi::AnyBuffer> out1, ffi::Result<ffi::AnyBuffer> out2) {
  auto parts = std::make_shared<Parts>(3);
  ffi::Buffer<ffi::U8>* codes[3] = {&codes0, &codes1, &codes2};
  ffi::AnyBuffer* scales[3] = {&scales0, &scales1, &scales2};
  ffi::Result<ffi::AnyBuffer>* outs[3] = {&out0, &out1, &out2};
  for (int i = 0; i < 3; ++i) {
    if (auto e = Setup("qmatmul3", x, *codes[i], *scales[i], nullptr, nullptr, layer.typed_data()[0],
                       rows.typed_data()[0], bits, scale_mode, mode, *outs[i], (*parts)[i]);
        e.failure())
      return e;
  }
  if ((*outs[0])->element_type() != (*outs[1])->element_type() ||
      (*outs[0])->element_type() != (*outs[2])->element_type())
    return ffi::Error::InvalidArgument("qmatmul3: the three outputs must have one dtype");
  return Run(pool, parts);
}

}  // namespace

extern "C" int JaxpagedQMatmulIsFast() { return kFast ? 1 : 0; }

// 1 when kInt8Dot's blocks of 16 rows take the AMX path now (built for AMX, granted by the kernel, not turned off).
extern "C" int JaxpagedQMatmulUsesAmx() {
#if JAXPAGED_QMATMUL_AMX
  return AmxWanted() ? 1 : 0;
#else
  return 0;
#endif
}

extern "C" int JaxpagedQMatmulHasBf16Dot() {
#if JAXPAGED_QMATMUL_BF16
  return 1;
#else
  return 0;
#endif
}

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxpagedQMatmul, QMatmulImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::AnyBuffer>()          // x
                                  .Arg<ffi::Buffer<ffi::U8>>()    // codes
                                  .Arg<ffi::AnyBuffer>()          // scales
                                  .Arg<ffi::Buffer<ffi::S32>>()   // layer
                                  .Arg<ffi::Buffer<ffi::S32>>()   // rows
                                  .Attr<int64_t>("bits")
                                  .Attr<int64_t>("scale_mode")
                                  .Attr<int64_t>("mode")
                                  .Ret<ffi::AnyBuffer>());        // out

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxpagedQMatmulGlu, QMatmulGluImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::AnyBuffer>()          // x
                                  .Arg<ffi::Buffer<ffi::U8>>()    // gate codes
                                  .Arg<ffi::AnyBuffer>()          // gate scales
                                  .Arg<ffi::Buffer<ffi::U8>>()    // up codes
                                  .Arg<ffi::AnyBuffer>()          // up scales
                                  .Arg<ffi::Buffer<ffi::S32>>()   // layer
                                  .Arg<ffi::Buffer<ffi::S32>>()   // rows
                                  .Attr<int64_t>("bits")
                                  .Attr<int64_t>("scale_mode")
                                  .Attr<int64_t>("act")
                                  .Ret<ffi::AnyBuffer>());        // out

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxpagedQMatmul3, QMatmul3Impl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::AnyBuffer>()          // x
                                  .Arg<ffi::Buffer<ffi::U8>>()    // codes of W0
                                  .Arg<ffi::AnyBuffer>()          // scales of W0
                                  .Arg<ffi::Buffer<ffi::U8>>()    // W1
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::Buffer<ffi::U8>>()    // W2
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::Buffer<ffi::S32>>()   // layer
                                  .Arg<ffi::Buffer<ffi::S32>>()   // rows
                                  .Attr<int64_t>("bits")
                                  .Attr<int64_t>("scale_mode")
                                  .Attr<int64_t>("mode")
                                  .Ret<ffi::AnyBuffer>()          // x @ W0
                                  .Ret<ffi::AnyBuffer>()          // x @ W1
                                  .Ret<ffi::AnyBuffer>());        // x @ W2
