"""x @ W^T for GGUF-style block-quantized weights on GPUs: a Pallas kernel on the Triton backend that dequantizes W
tile by tile in registers, never writing it to global memory at full width.

Why a kernel: XLA GPU (jaxlib 0.10.2) fuses into its Triton GEMM only a bare convert of signed s8 / s4 codes, with
any scale applied after the dot. GGUF's block formats need a per-32 scale (and min) before the dot, so XLA writes
the layer's weight at full width in bf16 with a separate fusion, then runs the GEMM on it: every layer of every step
(benchmarks/quant_fusion.py, docs/quantization.md "Where it is multiplied"). Here the weight's codes and scales are
the only weight bytes that leave global memory. Triton rather than Mosaic GPU for gpu.py's reasons (its module
docstring): every CUDA GPU JAX supports, `interpret=True` on CPU, and `jax.export(platforms=['cuda'])` lowers it
without a GPU, checking Triton's static rules (power-of-two blocks, dots of at least 16 in every dimension).

This module knows nothing of the engine: raw arrays and static format fields.

Shapes (L layers, N output columns, K input features, Kp = K rounded up to a multiple of 32, B = Kp / 32 blocks):
  x       [M, K]                 bf16 or f32
  codes   [L, N, Kp * bits / 8]  uint8; bits 8: one code per byte; bits 4: per block of 32, byte j (0..15) holds
                                 k = j in its low nibble and k = j + 16 in its high nibble (GGUF's order)
  scales  [L, N, B]              f16 or f32, `pair=False`: w = s * (u - offset) (offset 128 for 8 bits, 8 for 4)
          [L, N, B, 2]           f16 or f32, `pair=True`: (s, m), w = s * u + m
  layer   int32 scalar           which layer of the stack (a 2-D codes [N, ...] is one layer: pass 0)
  result  [M, N]                 float32: sum_k x[m, k] * w[n, k]
Each weight is computed in float32 exactly as `jaxpaged.models.quant._values_plain` does, rounded to x's dtype,
and multiplied on the tensor cores with float32 accumulation (f32 x: IEEE f32 dots, not TF32): the numbers of
dequantize-then-dot in x's dtype, up to the order of the float32 sum.

Inside the kernel (flat views: free reshapes, no copy, so `layer` selects rows and nothing is sliced outside):
  x_ref       [M, K]
  codes_ref   [L * N, Kp * bits / 8]      row layer * N + n
  scales_ref  [L * N, B] or [L * N, 2 B]  (s, m) of block b at columns 2 b, 2 b + 1
  o_ref       [S * Mp, Np] float32        M and N padded to whole tiles (sliced off outside: no masked store);
                                          split s's partial sums at rows s * Mp + m (S = 1: the result)

Grid (Mp / tm, Np / tn, S), the M tile fastest, so programs that share an N tile (one stretch of the weight) run
together and the second reads it from L2. One program walks its share of K in steps of tk (a power of two, whole
blocks of 32; S splits take ceil(steps / S) consecutive steps each, the last ones fewer or none):
loads x [tm, tk] and the codes [tn, tk * bits / 8] (rows past N, columns past K, masked: never read), the step's
block scales [tn, tk / 32] once, repeated over their blocks' codes in registers (`scale_load="gather"` instead loads
them per code, from the cache: 1.8-5.3x slower on an H200), dequantizes in float32, rounds to x's
dtype, and
accumulates x_tile @ w_tile^T [tm, tn] in float32. A 4-bit tile is not unpacked into k order: its low nibbles are
k = 32 b + j and its high ones k = 32 b + 16 + j, so x is loaded as the two matching column sets and each half is
its own dot (x is small and in L2; the codes are read once, contiguously).

Tiles (`tiles`, static from M): decode (M <= 16) 16 x 64 x 128 (Triton's dots need every dimension >= 16, so M is
padded to 16 rows, masked); up to 64 rows M rounded up to a power of two; up to 256 rows 64 x 128 x 64; prefill
128 x 128 x 64 with 8 warps.

Split K (`default_splits`): a decode batch of Llama-3-8B's down projection (N = 4096) has 64 N tiles, so 64 programs,
too few to keep an H100's 132 SMs loading (a memory-bound product needs many loads in flight). Where the grid has
fewer than TARGET_PROGRAMS programs, K is split S ways (a power of two, each split keeping at least MIN_SPLIT_STEPS
steps), and XLA sums the S float32 partials [S, Mp, Np]; S stops growing where writing and reading the partials would
move more than a quarter of the weight's bytes (so it splits decode batches, not prefill chunks). Reasoned, not
tuned; timed at one row on an H200 (benchmarks/gpu_qmatmul.py, docs/quantization.md).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

BLOCK = 32  # k per quantization block
MIN_DOT_DIM = 16  # Triton's tensor-core dots need every dimension >= 16
# Split K while the grid has fewer programs than this (about four resident on each of an H100's 132 SMs, as
# gpu.py's flash-decoding splits), keeping at least MIN_SPLIT_STEPS K steps a split, up to MAX_SPLITS.
TARGET_PROGRAMS = 512
MIN_SPLIT_STEPS = 8
MAX_SPLITS = 16


def _next_pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


def offset(bits: int) -> int:
    """The code of weight zero in the symmetric formats (Q8_0: 128, Q4_0: 8)."""
    return 128 if bits == 8 else 8


def tiles(m: int) -> tuple[int, int, int, int]:
    """(tm, tn, tk, num_warps) for an M-row product: powers of two, tm, tn >= 16, tk a multiple of 32 (whole
    blocks, and its 4-bit half tk / 2 >= 16). Decode batches are memory-bound (small M tiles, many N tiles), prefill
    chunks compute-bound (bigger tiles reuse each loaded weight tile over more rows)."""
    if m <= 64:
        return max(MIN_DOT_DIM, _next_pow2(m)), 64, 128, 4
    if m <= 256:
        return 64, 128, 64, 4
    return 128, 128, 64, 8


def default_splits(num_programs: int, steps: int, partial_bytes: int, weight_bytes: int) -> int:
    """K splits for a grid of `num_programs` (M tiles x N tiles) walking `steps` K steps: a power of two, 1 where
    the grid already fills the device. partial_bytes: one split's float32 output [Mp, Np]; weight_bytes: the
    layer's codes and scales (the partials' write and read stay under a quarter of them)."""
    splits = 1
    while (splits < MAX_SPLITS and num_programs * splits < TARGET_PROGRAMS
           and steps >= 2 * splits * MIN_SPLIT_STEPS and 2 * (2 * splits) * partial_bytes <= weight_bytes // 4):
        splits *= 2
    return splits


def split_k_sum(body, steps, num_splits: int, split, tm: int, tn: int) -> jax.Array:
    """Inside a kernel: the [tm, tn] float32 accumulation of acc = body(step, acc) over this program's share of
    `steps` K steps: all of them, or split `split`'s of num_splits (ceil(steps / S) consecutive steps each, the last
    ones fewer or none: then zeros)."""
    zeros = jnp.zeros((tm, tn), jnp.float32)
    if num_splits == 1:
        return jax.lax.fori_loop(0, steps, body, zeros)
    per_split = pl.cdiv(steps, num_splits)
    lo = jnp.minimum(split * per_split, steps)
    return jax.lax.fori_loop(lo, jnp.minimum(lo + per_split, steps), body, zeros)


def output_tile(m: int, n: int, tm: int, tn: int) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array, jax.Array]:
    """Inside a split-K kernel (`call_split_k`'s grid): this program's (split, rows [tm] of x, rows < M, output
    columns [tn], columns < N)."""
    rows = pl.program_id(0) * tm + jnp.arange(tm, dtype=jnp.int32)
    cols = pl.program_id(1) * tn + jnp.arange(tn, dtype=jnp.int32)
    return pl.program_id(2), rows, rows < m, cols, cols < n


def store_partial(o_ref, acc: jax.Array, split, tm: int, tn: int) -> None:
    """Inside a split-K kernel: this program's [tm, tn] float32 sum at split's rows of o_ref [S * Mp, Np]."""
    rows_out = pl.num_programs(0) * tm  # Mp
    o_ref[pl.ds(split * rows_out + pl.program_id(0) * tm, tm), pl.ds(pl.program_id(1) * tn, tn)] = acc


def call_split_k(kernel, layer, *operands, m: int, n: int, tile: tuple[int, int, int, int], num_splits: int,
                 num_stages: int, interpret: bool, name: str) -> jax.Array:
    """Runs a split-K matmul kernel (kernel(layer_ref, *operand refs, o_ref)) over the grid (Mp / tm, Np / tn, S)
    into [S * Mp, Np] float32 partial sums, and returns the [M, N] result: the splits summed, the padding cut."""
    tm, tn, _, num_warps = tile
    mp, np_ = pl.cdiv(m, tm) * tm, pl.cdiv(n, tn) * tn
    out = pl.pallas_call(
        kernel,
        grid=(mp // tm, np_ // tn, num_splits),
        out_shape=jax.ShapeDtypeStruct((num_splits * mp, np_), jnp.float32),
        compiler_params=plgpu.CompilerParams(num_warps=num_warps, num_stages=num_stages),
        interpret=interpret,
        name=name,
    )(jnp.asarray(layer, jnp.int32).reshape(1), *operands)
    if num_splits > 1:
        out = jnp.sum(out.reshape(num_splits, mp, np_), axis=0)
    return out if (mp, np_) == (m, n) else out[:m, :n]


def _qmatmul_kernel(layer_ref, x_ref, codes_ref, scales_ref, o_ref, *, m: int, n: int, k: int, bits: int,
                    pair: bool, blocks: int, tm: int, tn: int, tk: int, num_splits: int, scale_load: str,
                    precision, channel: bool = False):
    """One [tm, tn] output tile's partial sum over one split of K (module docstring: shapes, grid)."""
    # rows of x [tm]; output columns [tn], rows of the weight
    split, rows, row_ok, cols, col_ok = output_tile(m, n, tm, tn)
    layer = layer_ref[0]
    row_bytes = blocks * BLOCK * bits // 8
    w_rows = layer * n + cols  # [tn] rows of the flat codes / scales
    width = tk * bits // 8  # code bytes of one step
    nb = tk // BLOCK  # blocks of one step
    per_block = width // nb  # code bytes of a block: 32 (8 bits) or 16 (4 bits)
    j = jnp.arange(width, dtype=jnp.int32)  # [width]
    zero = float(offset(bits))

    def load_scales(step, byte, ok):
        """The scale (and min) of each code byte of a step, float32 [tn, width] (0 where masked). "broadcast":
        the step's nb scales of each row loaded once, [tn, nb], and repeated over their blocks' bytes in registers;
        "gather": loaded per byte (the same address for a block's bytes, served by the cache)."""
        if scale_load == "broadcast":
            b = step * nb + jnp.arange(nb, dtype=jnp.int32)  # [nb] blocks of the step
            ok_b = col_ok[:, None] & (b < blocks)[None, :]

            def load(col):  # [nb] columns of the flat scales -> [tn, width]
                v = plgpu.load(scales_ref.at[w_rows[:, None], col[None, :]], mask=ok_b, other=0)
                v = jnp.broadcast_to(v.astype(jnp.float32)[:, :, None], (tn, nb, per_block))
                return v.reshape(tn, width)
        else:
            b = byte // per_block  # [width] block of each byte

            def load(col):
                v = plgpu.load(scales_ref.at[w_rows[:, None], col[None, :]], mask=ok, other=0)
                return v.astype(jnp.float32)
        return (load(2 * b), load(2 * b + 1)) if pair else (load(b), None)

    def dequant(u, s, mn):
        """float32 weights [tn, width] of codes u (uint8 values), as `_values_plain` computes them."""
        u = u.astype(jnp.float32)
        return u * s + mn if pair else (u - zero) * s

    def dot(xs, w):  # [tm, c] @ [tn, c]^T -> [tm, tn] float32
        return jax.lax.dot_general(xs, w.astype(xs.dtype), (((1,), (1,)), ((), ())), precision=precision,
                                   preferred_element_type=jnp.float32)

    def load_x(kk):  # x [tm, len(kk)], zero past K and past M
        mask = row_ok[:, None] & (kk < k)[None, :]
        return plgpu.load(x_ref.at[rows[:, None], kk[None, :]], mask=mask, other=0)

    def body(step, acc):
        byte = step * width + j  # [width] byte columns of the codes
        ok = col_ok[:, None] & (byte < row_bytes)[None, :]  # [tn, width]
        u = plgpu.load(codes_ref.at[w_rows[:, None], byte[None, :]], mask=ok, other=0)  # [tn, width] uint8
        if channel:  # u - 128, exact in x's dtype; the column's scale multiplies the sum
            return acc + dot(load_x(byte), u.astype(jnp.float32) - zero)
        s, mn = load_scales(step, byte, ok)
        if bits == 8:
            return acc + dot(load_x(byte), dequant(u, s, mn))
        k_low = byte // 16 * BLOCK + byte % 16  # [width]: k of each byte's low nibble; its high one is k + 16
        acc = acc + dot(load_x(k_low), dequant(u & 15, s, mn))
        return acc + dot(load_x(k_low + BLOCK // 2), dequant(u >> 4, s, mn))

    acc = split_k_sum(body, pl.cdiv(blocks * BLOCK, tk), num_splits, split, tm, tn)
    if channel:  # scales_ref [1, L * N]: each column's scale, applied to its sum
        acc = acc * plgpu.load(scales_ref.at[jnp.zeros((1,), jnp.int32)[:, None], w_rows[None, :]],
                               mask=col_ok[None, :], other=0).astype(jnp.float32)
    store_partial(o_ref, acc, split, tm, tn)


def qmatmul_gpu(x: jax.Array, codes: jax.Array, scales: jax.Array, layer: jax.Array | int = 0, *, bits: int,
                pair: bool, interpret: bool = False, tile: tuple[int, int, int, int] | None = None,
                num_splits: int | None = None, scale_load: str = "broadcast", num_stages: int = 3,
                channel: bool = False) -> jax.Array:
    """x [M, K] @ the dequantized weight of `layer` [N, K], transposed -> [M, N] float32 (module docstring).

    bits: 8 or 4; pair: scales hold (s, m) per block (Q4_1, Q4_K) rather than s alone (Q8_0, Q4_0). tile: (tm, tn,
    tk, num_warps) instead of `tiles(M)` (powers of two, tm and tn >= 16, tk a multiple of 32). num_splits: K
    splits (None: `default_splits`). scale_load: "broadcast" or "gather", how a step's block scales reach its codes
    (`_qmatmul_kernel`'s load_scales). channel: int8 per output channel (bits 8), scales [L, N] float32, w = s *
    (u - 128): the kernel multiplies x by u - 128 (exact in x's dtype) and each column's sum by its scale, as XLA's
    int8 GEMM does (`quant._signed_channel_matmul`): the engine's int8 decode steps on CUDA (faster than
    `gpu_w8a8.py`'s int8 tensor cores on an H200, `benchmarks/gpu_layer_matmul.py --int8`). interpret=True runs
    Pallas' interpreter (any backend, CPU included).
    """
    if bits not in (4, 8):
        raise ValueError(f"bits={bits} is not supported; use 4 or 8")
    if x.ndim != 2:
        raise ValueError(f"x must be [M, K], got shape {x.shape}")
    if codes.ndim == 2:
        codes = codes[None]
        scales = scales[None]
    num_layers, n, row_bytes = codes.shape
    m, k = x.shape
    blocks = row_bytes * 8 // bits // BLOCK
    if codes.dtype != jnp.uint8 or row_bytes * 8 != blocks * BLOCK * bits:
        raise ValueError(f"codes must be uint8 [L, N, Kp * bits / 8] with Kp a multiple of {BLOCK}, got "
                         f"{codes.dtype} {codes.shape} for bits={bits}")
    if not blocks * BLOCK - BLOCK < k <= blocks * BLOCK:
        raise ValueError(f"x has K={k} columns but codes hold {blocks} blocks of {BLOCK} (K must round up to "
                         f"{blocks * BLOCK})")
    if channel and (bits != 8 or pair):
        raise ValueError(f"channel=True is int8 per channel: bits=8, pair=False (got bits={bits}, pair={pair})")
    want = (num_layers, n) if channel else (num_layers, n, blocks, 2) if pair else (num_layers, n, blocks)
    if tuple(scales.shape) != want:
        raise ValueError(f"scales must be {list(want)} for pair={pair}, channel={channel}, got "
                         f"{list(scales.shape)}")
    tm, tn, tk, num_warps = tile or tiles(m)
    if tk % BLOCK or min(tm, tn) < MIN_DOT_DIM or any(v & (v - 1) for v in (tm, tn, tk)):
        raise ValueError(f"tile={tile}: tm, tn, tk must be powers of two, tm and tn >= {MIN_DOT_DIM}, tk a "
                         f"multiple of {BLOCK}")
    mp, np_ = pl.cdiv(m, tm) * tm, pl.cdiv(n, tn) * tn
    steps = pl.cdiv(blocks * BLOCK, tk)
    if num_splits is None:
        weight_bytes = n * (row_bytes + scales.size // num_layers * scales.dtype.itemsize // n)
        num_splits = default_splits((mp // tm) * (np_ // tn), steps, mp * np_ * 4, weight_bytes)
    if num_splits < 1:
        raise ValueError(f"num_splits={num_splits} must be >= 1")
    if scale_load not in ("broadcast", "gather"):
        raise ValueError(f"scale_load={scale_load!r} is not supported; use 'broadcast' or 'gather'")
    # float32 inputs are multiplied in float32 (IEEE): Triton's default for them is TF32, ~1e-3 off.
    precision = jax.lax.Precision.HIGHEST if x.dtype == jnp.float32 else None
    kernel = functools.partial(_qmatmul_kernel, m=m, n=n, k=k, bits=bits, pair=pair, blocks=blocks, tm=tm, tn=tn,
                               tk=tk, num_splits=num_splits, scale_load=scale_load, precision=precision,
                               channel=channel)
    return call_split_k(kernel, layer, x, codes.reshape(num_layers * n, row_bytes),
                        scales.reshape(1, num_layers * n) if channel else scales.reshape(num_layers * n, -1),
                        m=m, n=n, tile=(tm, tn, tk, num_warps), num_splits=num_splits, num_stages=num_stages,
                        interpret=interpret,
                        name="qmatmul_int8" if channel else f"qmatmul_q{bits}{'_pair' if pair else ''}")


def qmatmul_reference(x: jax.Array, codes: jax.Array, scales: jax.Array, layer: jax.Array | int = 0, *, bits: int,
                      pair: bool) -> jax.Array:
    """The kernel's contract in plain jnp: layer's weight dequantized in float32 [N, K], rounded to x's dtype, one
    dot with float32 accumulation -> [M, N] float32 (writes the weight at full width: for tests)."""
    if codes.ndim == 3:
        codes, scales = codes[layer], scales[layer]
    n = codes.shape[0]
    if bits == 8:
        u = codes
    else:
        c = codes.reshape(n, -1, BLOCK // 2)  # [N, B, 16]
        u = jnp.concatenate([c & 15, c >> 4], axis=-1).reshape(n, -1)
    ub = u.astype(jnp.float32).reshape(n, -1, BLOCK)  # [N, B, 32]
    if pair:
        w = ub * scales[..., 0:1].astype(jnp.float32) + scales[..., 1:2].astype(jnp.float32)
    else:
        w = (ub - float(offset(bits))) * scales.astype(jnp.float32)[..., None]
    w = w.reshape(n, -1)[:, :x.shape[1]].astype(x.dtype)  # [N, K]
    precision = jax.lax.Precision.HIGHEST if x.dtype == jnp.float32 else None
    return jax.lax.dot_general(x, w, (((1,), (1,)), ((), ())), precision=precision,
                               preferred_element_type=jnp.float32)
