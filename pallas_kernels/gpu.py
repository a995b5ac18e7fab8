"""Ragged paged attention for GPUs, in Pallas (Triton lowering). Same contract as `reference.py`.

Grid: (num_tiles, num_kv_heads). A tile is `tile_size` consecutive query tokens of one sequence (the host starts
every prefill segment at a multiple of the tile; decode batches use tile 1). One program takes one tile and one
kv head, with all the q heads that read that kv head (GQA), and walks the sequence's blocks through the block
table with an online softmax in float32, reading each K/V block once per (tile, kv head).

Arrays (the wrapper builds the kernel's views):
  q               [T, Hq, D]             -> per program [R, D]: the tile's tokens x the group's q heads, rows padded
                                            to R = max(16, next power of 2) (Triton's dot wants >= 16 and 2^k rows)
  k_cache/v_cache [L, NB, BS, Hkv, D]    whole pool in global memory; a program loads [C, D] chunks of C = max(BS,
                                            16) tokens (C / BS blocks gathered through the block table)
  block_tables    [S, W] int32, context_lens [S] int32, positions [T] int32 (-1 = padding), layer int32
  output          [T, Hq, D]             0 for padding tokens
Slots at or beyond a sequence's context length are masked in the scores *and* zeroed in V: an unused slot may
hold NaN, and 0 x NaN = NaN in p @ V.

Why Triton and not Mosaic GPU: the Triton lowering takes dynamic gathers through a block table in plain loads
and runs in `interpret=True` on CPU with the same code; it is deprecated from JAX 0.11 (a warning at lowering)
but present in both 0.10.2 (here) and 0.11.x (the lent GPU). A Mosaic GPU port is the follow-up.
Supported: head_dim 64 and 128 (any power of 2 from 16), block sizes 8, 16, 32, any GQA group (padded rows).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

SUPPORTED_BLOCK_SIZES = (8, 16, 32)
NEG_INF = -1e30


def _next_pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


def _kernel(tile_seq_ref, layer_ref, block_tables_ref, context_lens_ref, row_pos_ref, q_ref, k_ref, v_ref, o_ref,
            *, scale: float, block_size: int, chunk: int, sliding_window: int | None):
    # q_ref [R, D]; row_pos_ref [R] (position of the row's token, -1 for padding rows); o_ref [R, D]
    tile, head = pl.program_id(0), pl.program_id(1)
    seq = tile_seq_ref[tile]
    layer = layer_ref[0]
    ctx = context_lens_ref[seq]
    q = q_ref[...].astype(jnp.float32) * scale
    pos = row_pos_ref[...]
    rows, head_dim = q.shape
    blocks_per_chunk = chunk // block_size
    # Causal: no row of the tile looks past its largest position, so later chunks are never read.
    limit = jnp.minimum(ctx, jnp.max(pos) + 1)
    num_chunks = pl.cdiv(jnp.maximum(limit, 0), chunk)

    def body(c, carry):
        acc, m_prev, l_prev = carry
        first = c * blocks_per_chunk
        idx = jnp.minimum(first + jnp.arange(blocks_per_chunk), block_tables_ref.shape[1] - 1)
        blocks = block_tables_ref[seq, idx]  # [C / BS]
        k = k_ref[layer, blocks, :, head, :].reshape(chunk, head_dim).astype(jnp.float32)
        v = v_ref[layer, blocks, :, head, :].reshape(chunk, head_dim).astype(jnp.float32)
        kv_pos = c * chunk + jnp.arange(chunk)
        in_ctx = kv_pos < ctx
        v = jnp.where(in_ctx[:, None], v, 0.0)
        s = jax.lax.dot_general(q, k, (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32)  # [R, C]
        mask = in_ctx[None, :] & (kv_pos[None, :] <= pos[:, None])
        if sliding_window is not None:
            mask &= kv_pos[None, :] > pos[:, None] - sliding_window
        s = jnp.where(mask, s, NEG_INF)
        m_next = jnp.maximum(m_prev, s.max(axis=-1))
        p = jnp.where(mask, jnp.exp(s - m_next[:, None]), 0.0)
        correction = jnp.exp(m_prev - m_next)
        l_next = l_prev * correction + p.sum(axis=-1)
        acc = acc * correction[:, None] + jax.lax.dot_general(
            p, v, (((1,), (0,)), ((), ())), preferred_element_type=jnp.float32)
        return acc, m_next, l_next

    init = (jnp.zeros((rows, head_dim), jnp.float32), jnp.full((rows,), NEG_INF, jnp.float32),
            jnp.zeros((rows,), jnp.float32))
    acc, _, denom = jax.lax.fori_loop(0, num_chunks, body, init)
    out = acc / jnp.where(denom == 0.0, 1.0, denom)[:, None]  # padding rows (nothing visible) stay 0
    o_ref[...] = out.astype(o_ref.dtype)


def ragged_paged_attention_gpu(q, k_cache, v_cache, layer, block_tables, context_lens, query_start_loc, positions,
                               *, scale: float, tile_size: int = 1, sliding_window: int | None = None,
                               soft_cap: float | None = None, decode_blocks: int | None = None,
                               interpret: bool = False, num_warps: int = 4, num_stages: int = 2):
    """Same arguments and result as `ragged_paged_attention_reference` (decode_blocks is accepted and unused:
    this kernel already reads only the blocks each sequence uses)."""
    del decode_blocks
    if soft_cap is not None:
        raise ValueError("soft_cap is not supported by the Pallas GPU kernel; use the reference backend")
    num_tokens, num_q_heads, head_dim = q.shape
    _, _, block_size, num_kv_heads, kv_dim = k_cache.shape
    if block_size not in SUPPORTED_BLOCK_SIZES:
        raise ValueError(f"block_size={block_size} is not supported by the Pallas GPU kernel; use "
                         f"{', '.join(map(str, SUPPORTED_BLOCK_SIZES))}")
    if head_dim != kv_dim or head_dim < 16 or head_dim & (head_dim - 1):
        raise ValueError(f"head_dim={head_dim} is not supported by the Pallas GPU kernel: it needs a power of 2 "
                         ">= 16 (64 and 128 are the tested ones)")
    if num_q_heads % num_kv_heads:
        raise ValueError(f"{num_q_heads} q heads are not a multiple of {num_kv_heads} kv heads")
    if num_tokens % tile_size:
        raise ValueError(f"num_tokens={num_tokens} must be a multiple of tile_size={tile_size}")
    group = num_q_heads // num_kv_heads
    num_tiles = num_tokens // tile_size
    rows = max(16, _next_pow2(tile_size * group))
    chunk = max(block_size, 16)

    tile_start = jnp.arange(num_tiles, dtype=jnp.int32) * tile_size
    tile_seq = jnp.clip(jnp.searchsorted(query_start_loc, tile_start, side="right") - 1, 0,
                        block_tables.shape[0] - 1).astype(jnp.int32)
    # [NT, Hkv, R, D]: rows are (token in tile, q head in group), padded
    qt = q.reshape(num_tiles, tile_size, num_kv_heads, group, head_dim).transpose(0, 2, 1, 3, 4)
    qt = qt.reshape(num_tiles, num_kv_heads, tile_size * group, head_dim)
    qt = jnp.pad(qt, ((0, 0), (0, 0), (0, rows - tile_size * group), (0, 0)))
    row_pos = jnp.repeat(positions.reshape(num_tiles, tile_size), group, axis=1)
    row_pos = jnp.pad(row_pos, ((0, 0), (0, rows - tile_size * group)), constant_values=-1)  # [NT, R]

    whole = lambda shape: pl.BlockSpec(shape, lambda t, h: (0,) * len(shape))  # noqa: E731
    kernel = functools.partial(_kernel, scale=scale, block_size=block_size, chunk=chunk,
                               sliding_window=sliding_window)
    from jax.experimental.pallas import triton as plt

    out = pl.pallas_call(
        kernel,
        grid=(num_tiles, num_kv_heads),
        in_specs=[
            whole(tile_seq.shape), whole((1,)), whole(block_tables.shape), whole(context_lens.shape),
            pl.BlockSpec((None, rows), lambda t, h: (t, 0)),
            pl.BlockSpec((None, None, rows, head_dim), lambda t, h: (t, h, 0, 0)),
            whole(k_cache.shape), whole(v_cache.shape),
        ],
        out_specs=pl.BlockSpec((None, None, rows, head_dim), lambda t, h: (t, h, 0, 0)),
        out_shape=jax.ShapeDtypeStruct((num_tiles, num_kv_heads, rows, head_dim), q.dtype),
        compiler_params=plt.CompilerParams(num_warps=num_warps, num_stages=num_stages),
        interpret=interpret,
        name="ragged_paged_attention",
    )(tile_seq, jnp.asarray(layer, jnp.int32).reshape(1), block_tables.astype(jnp.int32),
      context_lens.astype(jnp.int32), row_pos.astype(jnp.int32), qt, k_cache, v_cache)
    out = out[:, :, : tile_size * group].reshape(num_tiles, num_kv_heads, tile_size, group, head_dim)
    return out.transpose(0, 2, 1, 3, 4).reshape(num_tokens, num_q_heads, head_dim)
