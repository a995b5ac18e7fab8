"""x @ W[layer] for a weight stacked over layers, on GPUs: a Pallas kernel on the Triton backend that reads the layer's
matrix where it lies in the stack.

Why a kernel: a model whose layers run in a loop over stacked weights multiplies by W[layer], a dynamic slice of the
stack, and XLA GPU (jaxlib 0.10.2, compiled for an H200) writes that slice to a buffer of its own before its GEMM
reads it (a `dynamic_slice_fusion` copy), and merges the q, k, v (and gate, up) products by concatenating their
weights, another copy: every layer's weights cross memory three times a step instead of once
(benchmarks/gpu_step_hlo.py reads this from the compiled step). Decode steps are bound by reading the weights, so
that is up to three times their cost. Here the kernel's loads index the stack at the layer: the weight's bytes are
read once, by the product. Triton rather than Mosaic GPU for gpu.py's reasons.

This module knows nothing of the engine: raw arrays and static shapes.

Shapes (L layers, K input features, N output columns):
  x       [M, K]       bf16 or f32
  w       [L, K, N]    x's dtype (x @ w[layer]); a 2-D [K, N] is one layer: pass 0
  layer   int32 scalar which layer of the stack
  result  [M, N]       float32: sum_k x[m, k] * w[layer, k, n], products on the tensor cores with float32
                       accumulation (f32 x: IEEE f32 dots, not TF32)

Inside the kernel: w_ref is the flat view [L * K, N] (a free reshape), row layer * K + k; o_ref [S * Mp, Np] float32,
M and N padded to whole tiles (sliced off outside), split s's partial sums at rows s * Mp + m (S = 1: the result).
Grid (Mp / tm, Np / tn, S), the M tile fastest, so the programs that share an N tile (one stretch of the weight) run
together and the later ones read it from L2. One program walks its share of K in steps of tk: x [tm, tk] and
w [tk, tn] (rows past K, columns past N and rows past M masked: never read), acc += x @ w.
Tiles and K splits: `layer_tiles` (`gpu_qmatmul.tiles`, but 128 x 128 tiles for wide products of more than 128
rows) and `gpu_qmatmul.default_splits` (K split where the grid is small). Timed on an H200 at Llama-3-8B's decode
products of 256 rows (docs/benchmarks.md, "End to end on a GPU"), not tuned beyond that.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels.gpu_qmatmul import (
    MIN_DOT_DIM,
    call_split_k,
    default_splits,
    output_tile,
    split_k_sum,
    store_partial,
    tiles,
)

WIDE_N = 8192  # output columns from which products of more than 128 rows take 128 x 128 tiles


def layer_tiles(m: int, n: int) -> tuple[int, int, int, int]:
    """(tm, tn, tk, num_warps) for an [M, K] @ [K, N] product: `gpu_qmatmul.tiles(M)`, except 128 x 128 tiles and 8
    warps for more than 128 rows and N >= WIDE_N. On an H200 at 256 rows (benchmarks/gpu_layer_matmul.py, 8 layers a
    call): Llama-3-8B's gate/up (N 14336) 69 us a product against 90 with tiles(M); its down, q/o and k/v (N 4096,
    4096, 1024) within 7% of tiles(M) (down 1% faster, q/o and k/v 6-7% slower), so they keep it."""
    if m > 128 and n >= WIDE_N:
        return 128, 128, 64, 8
    return tiles(m)


def _matmul_kernel(layer_ref, x_ref, w_ref, o_ref, *, m: int, n: int, k: int, tm: int, tn: int, tk: int,
                   num_splits: int, precision):
    """One [tm, tn] output tile's partial sum over one split of K (module docstring: shapes, grid)."""
    split, rows, row_ok, cols, col_ok = output_tile(m, n, tm, tn)  # rows of x [tm]; output columns [tn]
    layer = layer_ref[0]
    ks = jnp.arange(tk, dtype=jnp.int32)  # [tk]

    def body(step, acc):
        kk = step * tk + ks  # [tk] k of this step
        k_ok = kk < k
        xs = plgpu.load(x_ref.at[rows[:, None], kk[None, :]], mask=row_ok[:, None] & k_ok[None, :], other=0)
        ws = plgpu.load(w_ref.at[(layer * k + kk)[:, None], cols[None, :]], mask=k_ok[:, None] & col_ok[None, :],
                        other=0)  # [tk, tn] of the layer's rows of the flat stack
        return acc + jax.lax.dot(xs, ws, precision=precision, preferred_element_type=jnp.float32)

    acc = split_k_sum(body, pl.cdiv(k, tk), num_splits, split, tm, tn)
    store_partial(o_ref, acc, split, tm, tn)


def layer_matmul_gpu(x: jax.Array, w: jax.Array, layer: jax.Array | int = 0, *, interpret: bool = False,
                     tile: tuple[int, int, int, int] | None = None, num_splits: int | None = None,
                     num_stages: int = 3) -> jax.Array:
    """x [M, K] @ w[layer] [K, N] -> [M, N] float32 (module docstring). tile: (tm, tn, tk, num_warps) instead of
    `layer_tiles(M, N)` (powers of two, each >= 16); num_splits: K splits (None: `default_splits`).
    interpret=True runs Pallas' interpreter (any backend, CPU included)."""
    if x.ndim != 2:
        raise ValueError(f"x must be [M, K], got shape {x.shape}")
    if w.ndim == 2:
        w = w[None]
    if w.ndim != 3 or w.shape[1] != x.shape[1]:
        raise ValueError(f"w must be [L, K, N] (or [K, N]) with K = x's {x.shape[1]} columns, got shape {w.shape}")
    if w.dtype != x.dtype:
        raise ValueError(f"w ({w.dtype}) and x ({x.dtype}) must have one dtype")
    num_layers, k, n = w.shape
    m = x.shape[0]
    tm, tn, tk, num_warps = tile or layer_tiles(m, n)
    if min(tm, tn, tk) < MIN_DOT_DIM or any(v & (v - 1) for v in (tm, tn, tk)):
        raise ValueError(f"tile={tile}: tm, tn, tk must be powers of two >= {MIN_DOT_DIM}")
    mp, np_ = pl.cdiv(m, tm) * tm, pl.cdiv(n, tn) * tn
    steps = pl.cdiv(k, tk)
    if num_splits is None:
        num_splits = default_splits((mp // tm) * (np_ // tn), steps, mp * np_ * 4, k * n * w.dtype.itemsize)
    if num_splits < 1:
        raise ValueError(f"num_splits={num_splits} must be >= 1")
    # float32 inputs are multiplied in float32 (IEEE): Triton's default for them is TF32, ~1e-3 off.
    precision = jax.lax.Precision.HIGHEST if x.dtype == jnp.float32 else None
    kernel = functools.partial(_matmul_kernel, m=m, n=n, k=k, tm=tm, tn=tn, tk=tk, num_splits=num_splits,
                               precision=precision)
    return call_split_k(kernel, layer, x, w.reshape(num_layers * k, n), m=m, n=n, tile=(tm, tn, tk, num_warps),
                        num_splits=num_splits, num_stages=num_stages, interpret=interpret, name="layer_matmul")
