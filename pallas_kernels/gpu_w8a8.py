"""x @ W^T with int8 weights (per output channel) and int8 activations (per block of 32), on the int8 tensor cores of
GPUs: a Pallas kernel on the Triton backend. The engine does not run it: on an H200 (2026-11-27,
benchmarks/results/device_h200_20261127_2230/) it was 1.1-1.8x slower than gpu_qmatmul.py's weight-only int8
(`channel=True`, bf16 tensor cores) at each of Llama-3-8B's decode products, at its own tiles and three others, and
two of its product tests failed there with bf16 inputs (rows off by one activation code's worth, cause not known);
it stays as a way of benchmarks/gpu_layer_matmul.py --int8.

Why it was written: at a decode batch of 256 sequences an H100's or H200's layer matmuls are bound by their FLOPs,
not by reading their weights (benchmarks/gpu_throughput.py --floors), so int8 weights multiplied in bf16
(gpu_qmatmul.py's `channel=True`) save little there. The int8 tensor cores do twice bf16's operations a second. The
activations are quantized as the native CPU kernel quantizes them
(`pallas_kernels.cpu_native.quantized.quantize_activations`, the Q8_0 scheme of llama.cpp): per block of 32 values,
d = max|x| / 127, q = round-half-even(x * (1 / d)), all in float32 and to the bit (`div127`); so a GPU's products
are the CPU kernel's numbers, up to the order of the float32 sum.

This module knows nothing of the engine: raw arrays and static shapes.

Shapes (L layers, N output columns, K input features, Kp = K rounded up to 32, B = Kp / 32):
  x        [M, K]         bf16 or f32 (quantized by `quantize_blocks` first: xq [M, Kp] int8, xd [M, B] float32)
  codes    [L, N, Kp]     uint8, u = q + 128 of the weight's int8 q (jaxpaged.models.quant.quantize_int8's layout)
  scales   [L, N]         float32 per output channel: w[n, k] = scales[n] * (codes[n, k] - 128)
  layer    int32 scalar   which layer of the stack (2-D codes [N, Kp]: one layer, pass 0)
  result   [M, N]         float32: sum_b xd[m, b] * (sum_{k in b} xq[m, k] * q[n, k]), times scales[n]

Inside the kernel (flat views, so `layer` selects rows and nothing is sliced outside): xq_ref [M, Kp], xd_ref
[M, B], codes_ref [L * N, Kp] (row layer * N + n), scales_ref [1, L * N], o_ref [S * Mp, Np] float32 (M and N padded
to whole tiles; split s's partial sums at rows s * Mp + m). Grid (Mp / tm, Np / tn, S) as gpu_qmatmul.py's. A program
walks its share of the B blocks: loads xq [tm, 32], xd [tm] and the codes [tn, 32] (masked past M, N and K), makes
the codes signed (u - 128), multiplies on the int8 tensor cores into int32 (exact: 32 products of at most 127 x 127),
and adds that times xd to its float32 [tm, tn] accumulator; the column scales multiply the sum at the end.
Tiles: tm, tn and the warps of `gpu_qmatmul.tiles(M)`, K steps of one block. Reasoned, not tuned.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels import gpu_qmatmul as split_k
from pallas_kernels.gpu_qmatmul import BLOCK, MIN_DOT_DIM


def div127(a: jax.Array) -> jax.Array:
    """a / 127 correctly rounded in float32 (a >= 0 finite), as C++'s `a / 127.0f`. XLA computes a division by a
    constant as a product with the rounded reciprocal, one rounding off for some a (and then a q at a tie one off), so:
    d0 = a * (1/127), within one unit in the last place of the quotient, then of d0 and its two neighbours the one
    whose residual a - 127 c is smallest. Each residual is exact, as (a - 128 c) + c: 128 c is exact, and each
    subtraction is of numbers within a factor of two of each other (Sterbenz). No quotient is a tie between two
    floats (127 c would need more than 24 bits). d0 goes through an optimization barrier, or XLA would fold 128 d0 into
    a (128 / 127), a product rounded once more."""
    d0 = jax.lax.optimization_barrier(a * jnp.float32(1.0 / 127.0))
    best, best_err = d0, jnp.abs((a - 128.0 * d0) + d0)
    for c in (jnp.nextafter(d0, jnp.float32(jnp.inf)), jnp.nextafter(d0, jnp.float32(0.0))):
        err = jnp.abs((a - 128.0 * c) + c)
        best, best_err = jnp.where(err < best_err, c, best), jnp.minimum(err, best_err)
    return best


def quantize_blocks(x: jax.Array) -> tuple[jax.Array, jax.Array]:
    """x [M, K] -> (xq [M, Kp] int8, xd [M, B] float32): per block of 32, d = max|x| / 127 and q = round-half-even
    (x * (1 / d)) in float32 (0 where the block is all zeros), as the native CPU kernel computes them."""
    m, k = x.shape
    kp = -(-k // BLOCK) * BLOCK
    xb = jnp.pad(x.astype(jnp.float32), ((0, 0), (0, kp - k))).reshape(m, kp // BLOCK, BLOCK)
    d = div127(jnp.max(jnp.abs(xb), axis=-1))  # [M, B]
    inv = jnp.where(d != 0, 1.0 / jnp.where(d != 0, d, 1.0), 0.0).astype(jnp.float32)
    q = jnp.round(xb * inv[..., None]).astype(jnp.int8)  # jnp.round: half to even, as np.rint
    return q.reshape(m, kp), d


def _w8a8_kernel(layer_ref, xq_ref, xd_ref, codes_ref, scales_ref, o_ref, *, m: int, n: int, blocks: int, tm: int,
                 tn: int, num_splits: int):
    """One [tm, tn] output tile's partial sum over one split of the K blocks (module docstring: shapes, grid)."""
    # rows of x [tm]; output columns [tn], rows of the weight
    split, rows, row_ok, cols, col_ok = split_k.output_tile(m, n, tm, tn)
    layer = layer_ref[0]
    w_rows = layer * n + cols  # [tn] rows of the flat codes
    j = jnp.arange(BLOCK, dtype=jnp.int32)  # [32]

    def body(b, acc):
        kk = b * BLOCK + j  # [32] k of block b (every block is whole: Kp is a multiple of 32)
        xq = plgpu.load(xq_ref.at[rows[:, None], kk[None, :]], mask=row_ok[:, None], other=0)  # [tm, 32] int8
        xd = plgpu.load(xd_ref.at[rows[:, None], jnp.full((1, 1), b, jnp.int32)], mask=row_ok[:, None],
                        other=0)  # [tm, 1] float32
        u = plgpu.load(codes_ref.at[w_rows[:, None], kk[None, :]], mask=col_ok[:, None], other=128)  # [tn, 32]
        wq = (u.astype(jnp.int32) - 128).astype(jnp.int8)
        part = jax.lax.dot_general(xq, wq, (((1,), (1,)), ((), ())), preferred_element_type=jnp.int32)
        return acc + part.astype(jnp.float32) * xd

    acc = split_k.split_k_sum(body, blocks, num_splits, split, tm, tn)
    acc = acc * plgpu.load(scales_ref.at[jnp.zeros((1,), jnp.int32)[:, None], w_rows[None, :]],
                           mask=col_ok[None, :], other=0).astype(jnp.float32)
    split_k.store_partial(o_ref, acc, split, tm, tn)


def w8a8_matmul_gpu(x: jax.Array, codes: jax.Array, scales: jax.Array, layer: jax.Array | int = 0, *,
                    interpret: bool = False, tile: tuple[int, int, int] | None = None, num_splits: int | None = None,
                    num_stages: int = 3) -> jax.Array:
    """x [M, K] @ (scales * (codes - 128))[layer]^T -> [M, N] float32, x quantized per block of 32 to int8 first
    (module docstring). tile: (tm, tn, num_warps) instead of `gpu_qmatmul.tiles(M)`'s (powers of two >= 16);
    num_splits: splits of the K blocks (None: `gpu_qmatmul.default_splits`). interpret=True runs Pallas' interpreter
    (any backend, CPU included)."""
    if x.ndim != 2:
        raise ValueError(f"x must be [M, K], got shape {x.shape}")
    if codes.ndim == 2:
        codes, scales = codes[None], scales[None]
    if codes.ndim != 3 or codes.dtype != jnp.uint8 or codes.shape[2] % BLOCK:
        raise ValueError(f"codes must be uint8 [L, N, Kp] with Kp a multiple of {BLOCK}, got {codes.dtype} "
                         f"{codes.shape}")
    num_layers, n, kp = codes.shape
    m, k = x.shape
    if not kp - BLOCK < k <= kp:
        raise ValueError(f"x has K={k} columns but codes hold Kp={kp} (K must round up to it)")
    if tuple(scales.shape) != (num_layers, n):
        raise ValueError(f"scales must be [{num_layers}, {n}] (one per layer and output column), got "
                         f"{list(scales.shape)}")
    tm, tn, num_warps = tile or (lambda t: (t[0], t[1], t[3]))(split_k.tiles(m))
    if min(tm, tn) < MIN_DOT_DIM or any(v & (v - 1) for v in (tm, tn)):
        raise ValueError(f"tile={tile}: tm and tn must be powers of two >= {MIN_DOT_DIM}")
    blocks = kp // BLOCK
    mp, np_ = pl.cdiv(m, tm) * tm, pl.cdiv(n, tn) * tn
    if num_splits is None:
        num_splits = split_k.default_splits((mp // tm) * (np_ // tn), blocks, mp * np_ * 4, n * (kp + 4))
    if num_splits < 1:
        raise ValueError(f"num_splits={num_splits} must be >= 1")
    xq, xd = quantize_blocks(x)
    kernel = functools.partial(_w8a8_kernel, m=m, n=n, blocks=blocks, tm=tm, tn=tn, num_splits=num_splits)
    return split_k.call_split_k(kernel, layer, xq, xd, codes.reshape(num_layers * n, kp),
                                scales.astype(jnp.float32).reshape(1, num_layers * n), m=m, n=n,
                                tile=(tm, tn, BLOCK, num_warps), num_splits=num_splits, num_stages=num_stages,
                                interpret=interpret, name="w8a8_matmul")
