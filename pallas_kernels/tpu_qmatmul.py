"""x @ W^T for GGUF-style block-quantized weights on TPUs: a Pallas kernel on the Mosaic TPU backend that
dequantizes W tile by tile in VMEM, never writing it to HBM at full width.

Why a kernel: XLA TPU (libtpu 0.0.42) writes a Q8_0 layer's weight at full width before its dot at every row
count (the float16 block scales are broadcast to an [N, K] float32 array of their own), and the 4-bit formats above
`quant.NIBBLE_MAX_ROWS` rows (benchmarks/quant_fusion.py, docs/quantization.md "Where it is multiplied"). Here the
codes and scales of the chosen layer are the only weight bytes read from HBM, each once per M tile.

Same contract and argument names as `pallas_kernels.gpu_qmatmul.qmatmul_gpu` (L layers, N output columns, K input
features, Kp = K rounded up to a multiple of 32, B = Kp / 32 blocks):
  x       [M, K]                 bf16 or f32
  codes   [L, N, Kp * bits / 8]  uint8; bits 8: one code per byte; bits 4: per block of 32, byte j (0..15) holds
                                 k = j in its low nibble and k = j + 16 in its high nibble (GGUF's order)
  scales  [L, N, B]              f16 or f32, `pair=False`: w = s * (u - offset) (offset 128 for 8 bits, 8 for 4)
          [L, N, B, 2]           f16 or f32, `pair=True`: (s, m), w = s * u + m
  layer   int32 scalar           which layer of the stack (a 2-D codes [N, ...] is one layer: pass 0)
  result  [M, N]                 float32: sum_k x[m, k] * w[n, k]
Each weight is computed in float32 as `jaxpaged.models.quant._values_plain` does, rounded to x's dtype, and
multiplied with float32 accumulation: the numbers of dequantize-then-dot in x's dtype, up to the float32 sum's order.

What the kernel sees (`layer` is scalar-prefetched into SMEM and read by the codes' index map, so the layer's codes
are DMAd straight from the stack, never sliced or copied outside):
  layer_ref   [1] int32 (SMEM)
  x_ref       [tm, Kp]  (8 bits) or [2, tm, Kp / 2] (4 bits: x's columns of the low nibbles, k = 32 b + j, then of
              the high ones, k = 32 b + 16 + j; permuted outside, x is small), zero past K and past M
  codes_ref   [tn, Kp * bits / 8]  uint8, whole rows of the layer's codes; or [Kp * bits / 8, tn] (`codes_kn`:
              the view [L, Kp * bits / 8, N] of the stack, a bitcast where XLA TPU lays the codes out N-minor-most,
              as it does where a row's bytes are not a multiple of 128; then w^T is dequantized and x @ w^T is a
              plain dot)
  scales_ref  [tn, B] the layer's scales s: float32, or float16 as their uint16 bits
  mins_ref    [tn, B] its mins m (pair only), the same way
  o_ref       [tm, tn] float32 of the [Mp, Np] result (M, N padded to whole tiles, sliced off outside)

Scales are the one thing sliced outside (`scales[layer]`, for pairs split into s and m, for float16 bitcast to
uint16: XLA writes one layer's scales, 1/16 of its codes' bytes for Q8_0, 1/8 for Q4_0, 1/4 for Q4_1,
1/2 for Q4_K, and the kernel reads them once more). Why, measured with libtpu 0.0.42's compile-only client:
  * Mosaic takes no float16 operand ("Only arguments with float8..., bfloat16 or 32-bit element types are
    supported") and has no float16 vector loads, so the kernel takes float16 scales as their uint16 bits and
    converts them exactly (`_f16_bits_to_f32`); XLA TPU writes a bitcast-convert out as a new buffer, so on the
    whole stack it would copy every layer's scales per call;
  * XLA TPU's default layout of a scales array depends on its shape: [L, N, B] is row-major where B is a multiple
    of 128 (Llama-3-8B's gate/up, B = 128) but N-minor-most ({1, 2, 0}) where it is not (the down projection,
    B = 448; SmolLM2, B = 18), and [L, N, B, 2] is {2, 3, 1, 0} or {1, 3, 2, 0} alike. The kernel's operands
    are row-major, so a stacked operand would be re-laid out whole (float32 Q4_K scales: a copy of the stack).
Reading them in place would need the kernel to take each layout XLA may pick (N on lanes where it is minor-most);
not done here.

Grid (Mp / tm, Np / tn), both "parallel", N fastest: the x block stays in VMEM while the N tiles stream past, each
codes / scales block is read once per M tile (once in all for a decode batch, M <= tm), and Pallas double-buffers
the next N tile's DMA behind this one's compute. One program walks K in static chunks of CHUNK_K (the last one
shorter): the chunk's codes [tn, c] (c = CHUNK_K * bits / 8 bytes), its block scales [tn, nb] (nb = CHUNK_K / 32)
expanded over their blocks' codes, the dequantized float32 tile [tn, c] rounded to x's dtype, and the dot
x_chunk [tm, c] @ w^T (4 bits: two dots, low and high nibbles, against x's matching column sets).

Why whole K rows per block, not a K grid axis: a block's last dimension must be a multiple of 128 lanes or the
array's whole dimension (Mosaic's tiling), and a K step's block scales are CHUNK_K / 32 = 16 lanes of the [N, B]
scales; a K axis would need K steps of 4096 (128 scales) or a dynamic, unaligned lane slice. With whole rows every
slice is static. VMEM holds two buffers of [tn, Kp * bits / 8] codes (Llama-3-8B's down projection, Q8_0:
2 x 256 x 14336 B = 7 MiB), of the scales and of x [tm, Kp]; `tiles` keeps them under VMEM_BUDGET, and the call asks
Mosaic for a VMEM_LIMIT scoped limit (libtpu's compile checks it: an earlier layout of the pair scales, [tn, 2, B]
padded to 16 sublanes, failed there with "CompileTimeScopedVmemOom" at Llama's down projection, 2048 rows).

The scale expansion: Mosaic restricts reshapes of the lane dimension, so [tn, nb] -> [tn, nb, 32] -> [tn, c] is not
written as a reshape but as a matmul with a 0/1 matrix E [nb, c] (E[b, col] = 1 where col is in block b), on the
MXU (E^T @ s^T, [c, tn], for codes taken N-minor). It must be exact: each scale is split into bfloat16 parts whose
sum is the scale (float16: 2 parts; float32: 3), each part times 0/1 is exact in float32 accumulation, so the
expanded scale equals the stored one (a test checks it). The mins of the pair formats are expanded the same way.
Cost: nb = 16 MACs per weight per part (and per min), against tm per weight for the product itself.

Known limits (no TPU was at hand: checked by Pallas' interpreter, by jax.export's TPU lowering and by libtpu's
compile-only client for v5e and v6e; nothing was run or timed on a TPU, so every speed is unmeasured):
  * a prefill chunk of M rows re-reads the weight Mp / tm times (tm <= 256): compute-bound there anyway;
  * the expansion matmul costs MXU time (above) that a decode product, memory-bound, should hide;
  * the layer's scales are written by XLA before the call (above), and the tiles are reasoned, not tuned.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

BLOCK = 32  # k per quantization block
CHUNK_K = 512  # k per dot inside a program: 16 blocks (a multiple of 128 lanes of x for 8 bits, 256 bytes for 4)
MAX_TM = 256
VMEM_BUDGET = 24 << 20  # bytes of double-buffered blocks `tiles` aims under
VMEM_LIMIT = 48 << 20  # the scoped VMEM limit asked of Mosaic (v5e and v6e have 128 MiB)


def offset(bits: int) -> int:
    """The code of weight zero in the symmetric formats (Q8_0: 128, Q4_0: 8)."""
    return 128 if bits == 8 else 8


def _round_up(v: int, m: int) -> int:
    return -(-v // m) * m


def tiles(m: int, kp: int, n: int, bits: int, x_itemsize: int, pair: bool = False) -> tuple[int, int]:
    """(tm, tn): tm a multiple of 16 sublanes (bf16 x's tile; f32's 8 divides it) up to MAX_TM, tn 256 or 128
    lanes, halved (tm first, down to 16) while the double-buffered x, codes and scales blocks pass VMEM_BUDGET."""
    tm = min(_round_up(max(m, 1), 16), MAX_TM)
    tn = 256 if n > 128 else 128
    row_bytes = kp * bits // 8
    scale_row = _round_up(kp // BLOCK, 128) * 4 * (2 if pair else 1)  # [tn, B] blocks: B padded to 128 lanes

    def need(tm, tn):
        return 2 * (tm * kp * x_itemsize + tn * (row_bytes + scale_row)) + 2 * tm * tn * 4

    while need(tm, tn) > VMEM_BUDGET and tm > 16:
        tm = max(16, tm // 2)
    while need(tm, tn) > VMEM_BUDGET and tn > 128:
        tn //= 2
    return tm, tn


def _bf16_parts(v: jax.Array, count: int) -> list[jax.Array]:
    """bfloat16 arrays whose float32 sum is v exactly (float16 values: 2 parts; float32: 3)."""
    parts, rest = [], v
    for _ in range(count):
        part = rest.astype(jnp.bfloat16)
        parts.append(part)
        rest = rest - part.astype(jnp.float32)
    return parts


def _expansion(rows: int, cols: int, per_block: int) -> jax.Array:
    """E [rows, cols] bfloat16: 1 where row == col // per_block (the block of each code column), else 0."""
    r = jax.lax.broadcasted_iota(jnp.int32, (rows, cols), 0)
    c = jax.lax.broadcasted_iota(jnp.int32, (rows, cols), 1)
    block = jax.lax.div(c, jnp.int32(per_block))  # not `//`: its floor lowers through sign, which asks the device
    return jnp.where(r == block, 1.0, 0.0).astype(jnp.bfloat16)


def codes_kn(row_bytes: int, n: int) -> bool:
    """Whether the kernel takes the codes as [L, Kp * bits / 8, N] (N on lanes): where XLA TPU's default layout of
    [L, N, row_bytes] uint8 puts N minor-most, which it does (libtpu 0.0.42) where row_bytes is not a multiple of
    128 and N is (SmolLM2: 576 and 288 bytes). Taking the codes in their own layout is what keeps XLA from copying
    the whole stack to row-major on every call."""
    return row_bytes % 128 != 0 and n % 128 == 0


def _f16_bits_to_f32(h: jax.Array) -> jax.Array:
    """float16 values given as their uint16 bits -> float32, exactly (subnormals, infinities and NaN included).
    Mosaic has no float16 vector loads on v5e / v6e, so the scales come in as their bits."""
    h = h.astype(jnp.int32)
    exponent = (h >> 10) & 31
    magnitude = (h & 0x7FFF) << 13  # exponent and mantissa in float32's places, exponent still biased by 15
    bits = jnp.where(exponent == 31, magnitude | 0x7F800000, magnitude + (112 << 23))  # rebias 15 -> 127
    v = jax.lax.bitcast_convert_type(bits, jnp.float32)
    v = jnp.where(exponent == 0, (h & 1023).astype(jnp.float32) * 2.0 ** -24, v)  # subnormal: no float32 denormal
    return jnp.where((h & 0x8000) != 0, -v, v)


def _qmatmul_kernel(layer_ref, x_ref, codes_ref, scales_ref, *refs, bits: int, pair: bool, row_bytes: int,
                    scale_parts: int, kn: bool, precision):
    """One [tm, tn] output tile: static chunks over K (module docstring)."""
    del layer_ref  # read by the index maps
    per_block = BLOCK * bits // 8  # code bytes of one block: 32 or 16
    chunk = CHUNK_K * bits // 8  # code bytes of one chunk
    zero = float(offset(bits))
    dtype = x_ref.dtype
    expansions = {}

    def expand(sc, width):
        """sc [tn, nb] float32 -> the scale of each code: [tn, width], or [width, tn] for `kn` codes (exact)."""
        if width not in expansions:
            expansions[width] = _expansion(sc.shape[1], width, per_block)
        e = expansions[width]  # [nb, width]
        out = None
        for part in _bf16_parts(sc, scale_parts):
            if kn:  # E^T [width, nb] @ part^T: contract nb of both
                y = jax.lax.dot_general(e.T, part, (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32)
            else:
                y = jax.lax.dot_general(part, e, (((1,), (0,)), ((), ())), preferred_element_type=jnp.float32)
            out = y if out is None else out + y
        return out

    def dequant(u, s, m):
        """float32 weights [tn, c] of integer codes u, as `_values_plain` computes them."""
        u = u.astype(jnp.float32)
        return u * s + m if pair else (u - zero) * s

    def dot(xs, w):  # [tm, c] @ w^T [tn, c]^T (or w [c, tn] for `kn` codes) -> [tm, tn] float32
        return jax.lax.dot_general(xs, w.astype(dtype), (((1,), (0 if kn else 1,)), ((), ())), precision=precision,
                                   preferred_element_type=jnp.float32)

    mins_ref, o_ref = refs if pair else (None, refs[0])
    acc = jnp.zeros(o_ref.shape, jnp.float32)
    half = scales_ref.dtype == jnp.uint16  # float16 scales, as their bits

    def load(ref):  # -> float32
        v = ref[...]
        return _f16_bits_to_f32(v) if half else v.astype(jnp.float32)

    if pair:  # [tn, B] each
        s_all, m_all = load(scales_ref), load(mins_ref)
    else:
        s_all, m_all = load(scales_ref), None
    for c0 in range(0, row_bytes, chunk):
        width = min(chunk, row_bytes - c0)
        b0, nb = c0 // per_block, width // per_block
        s = expand(s_all[:, b0:b0 + nb], width)  # [tn, width]
        m = expand(m_all[:, b0:b0 + nb], width) if pair else None
        u = (codes_ref[c0:c0 + width, :] if kn else codes_ref[:, c0:c0 + width]).astype(jnp.int32)

        if bits == 8:
            acc = acc + dot(x_ref[:, c0:c0 + width], dequant(u, s, m))
        else:
            acc = acc + dot(x_ref[0, :, c0:c0 + width], dequant(u & 15, s, m))
            acc = acc + dot(x_ref[1, :, c0:c0 + width], dequant(u >> 4, s, m))
    o_ref[...] = acc


def qmatmul_tpu(x: jax.Array, codes: jax.Array, scales: jax.Array, layer: jax.Array | int = 0, *, bits: int,
                pair: bool, interpret: bool = False, tile: tuple[int, int] | None = None) -> jax.Array:
    """x [M, K] @ the dequantized weight of `layer` [N, K], transposed -> [M, N] float32 (module docstring).

    bits: 8 or 4; pair: scales hold (s, m) per block (Q4_1, Q4_K) rather than s alone (Q8_0, Q4_0). tile: (tm, tn)
    instead of `tiles(...)` (tm a multiple of 16, tn of 128). interpret=True runs Pallas' interpreter (CPU included).
    """
    if bits not in (4, 8):
        raise ValueError(f"bits={bits} is not supported; use 4 or 8")
    if x.ndim != 2:
        raise ValueError(f"x must be [M, K], got shape {x.shape}")
    if x.dtype not in (jnp.bfloat16, jnp.float32):
        raise ValueError(f"x must be bfloat16 or float32, got {x.dtype}")
    if codes.ndim == 2:
        codes = codes[None]
        scales = scales[None]
    num_layers, n, row_bytes = codes.shape
    m, k = x.shape
    blocks = row_bytes * 8 // bits // BLOCK
    kp = blocks * BLOCK
    if codes.dtype != jnp.uint8 or row_bytes * 8 != kp * bits:
        raise ValueError(f"codes must be uint8 [L, N, Kp * bits / 8] with Kp a multiple of {BLOCK}, got "
                         f"{codes.dtype} {codes.shape} for bits={bits}")
    if not kp - BLOCK < k <= kp:
        raise ValueError(f"x has K={k} columns but codes hold {blocks} blocks of {BLOCK} (K must round up to {kp})")
    want = (num_layers, n, blocks, 2) if pair else (num_layers, n, blocks)
    if tuple(scales.shape) != want:
        raise ValueError(f"scales must be {list(want)} for pair={pair}, got {list(scales.shape)}")
    if scales.dtype not in (jnp.float16, jnp.float32):
        raise ValueError(f"scales must be float16 or float32, got {scales.dtype}")
    tm, tn = tile or tiles(m, kp, n, bits, x.dtype.itemsize, pair)
    if tm % 16 or tn % 128:
        raise ValueError(f"tile={tile}: tm must be a multiple of 16, tn of 128")
    mp, np_ = _round_up(m, tm), _round_up(n, tn)
    x = jnp.pad(x, ((0, mp - m), (0, kp - k)))  # [Mp, Kp], zeros past M and K
    if bits == 4:  # [2, Mp, Kp / 2]: the columns of the low nibbles' k, then of the high ones'
        x = x.reshape(mp, blocks, 2, BLOCK // 2).transpose(2, 0, 1, 3).reshape(2, mp, kp // 2)
        x_spec = pl.BlockSpec((2, tm, kp // 2), lambda i, j, layer: (0, i, 0))
    else:
        x_spec = pl.BlockSpec((tm, kp), lambda i, j, layer: (i, 0))
    scale_parts = 2 if scales.dtype == jnp.float16 else 3
    layer = jnp.asarray(layer, jnp.int32)
    # The layer's scales only, [N, B] (and its mins [N, B]): a few one-layer-sized XLA ops (module docstring).
    scales = jax.lax.dynamic_index_in_dim(scales, layer, 0, keepdims=False)
    if scales.dtype == jnp.float16:  # Mosaic takes no float16 operand: their uint16 bits
        scales = jax.lax.bitcast_convert_type(scales, jnp.uint16)
    scale_ops = [scales[..., 0], scales[..., 1]] if pair else [scales]
    scale_specs = [pl.BlockSpec((tn, blocks), lambda i, j, layer: (j, 0))] * len(scale_ops)
    precision = jax.lax.Precision.HIGHEST if x.dtype == jnp.float32 else None
    kn = codes_kn(row_bytes, n)
    if kn:  # [L, Kp * bits / 8, N]: the array as XLA TPU lays it out (N minor-most), a bitcast
        codes = jnp.swapaxes(codes, 1, 2)
        codes_spec = pl.BlockSpec((None, row_bytes, tn), lambda i, j, layer: (layer[0], 0, j))
    else:
        codes_spec = pl.BlockSpec((None, tn, row_bytes), lambda i, j, layer: (layer[0], j, 0))
    kernel = functools.partial(_qmatmul_kernel, bits=bits, pair=pair, row_bytes=row_bytes,
                               scale_parts=scale_parts, kn=kn, precision=precision)
    grid_spec = pltpu.PrefetchScalarGridSpec(
        num_scalar_prefetch=1,
        grid=(mp // tm, np_ // tn),
        in_specs=[
            x_spec,
            codes_spec,
            *scale_specs,
        ],
        out_specs=pl.BlockSpec((tm, tn), lambda i, j, layer: (i, j)),
    )
    out = pl.pallas_call(
        kernel,
        grid_spec=grid_spec,
        out_shape=jax.ShapeDtypeStruct((mp, np_), jnp.float32),
        compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel", "parallel"),
                                             vmem_limit_bytes=VMEM_LIMIT),
        interpret=interpret,
        name=f"qmatmul_tpu_q{bits}{'_pair' if pair else ''}",
    )(layer.reshape(1), x, codes, *scale_ops)
    return out if (mp, np_) == (m, n) else out[:m, :n]
