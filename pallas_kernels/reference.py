"""Pure-JAX ragged paged attention: the reference every kernel is tested against, and the engine's CPU path.

The batch is ragged: the new tokens of all sequences of one step are concatenated on one token axis.

Layouts (the pool layout is chosen once, here, for every backend):
  q               [T, Hq, D]                 queries of the step's tokens, any float dtype
  k_cache/v_cache [L, NB, BS, Hkv, D]        the whole stacked pool: layer, block, offset in block, kv head, dim
  layer           int32 scalar               which layer of the pool to read (no per-layer slice is copied)
  block_tables    [S, W] int32               logical -> physical block of each sequence (padding rows any id)
  context_lens    [S] int32                  tokens in the cache for sequence s once this step's K/V are
                                             written (0 for padding sequences)
  query_start_loc [S + 1] int32              sequence s owns tokens [qsl[s], qsl[s+1]); tokens past qsl[S] are
                                             padding
  positions       [T] int32                  absolute position of each token in its sequence; -1 marks padding
                                             tokens (inside a segment's tail or past qsl[S])
  k_scale/v_scale float or f32 scalar        the pool's values are k_cache * k_scale, v_cache * v_scale (fp8
                                             pools, fp8.py; 1 for the others); may be traced (a per-layer scale)
Output            [T, Hq, D]                 q's dtype; 0 on padding tokens.

Query head h reads kv head h // (Hq // Hkv) (GQA/MQA). Token t of sequence s sees the cached positions
p < context_lens[s] with p <= positions[t] (causal), and p > positions[t] - sliding_window when a window is set.
Softmax runs in float32 whatever the input dtype; K and V are upcast (and scaled) to float32 where they are read.

`tile_size` groups consecutive tokens into tiles that share one gather of their sequence's K/V: 16 for prefill
batches, whose segments the host then starts at multiples of 16. Cost is (T / tile_size) gathers of W * BS
cached tokens, with no per-sequence padding of queries.

`decode_blocks` (static) is for decode-only batches, where sequence s has exactly one query, token qsl[s]: K/V
are read as one flat list of that many blocks, the blocks the sequences actually use (sum of
ceil(context_lens / BS), padded with masked entries), instead of W blocks for every sequence. Each block's
scores get a softmax that spans all blocks of its sequence (segment max and sum), as flash-decoding combines
its splits. Memory read is proportional to the tokens in context, not to the batch's longest context.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from pallas_kernels.fp8 import dequantize, to_pool_dtype

NEG_INF = -1e30
# The reference computes in float32, multiplied in float32: XLA's default on GPU (TF32) and TPU (bfloat16 passes)
# would round the inputs of its dots. On CPU the setting changes nothing.
HIGHEST = jax.lax.Precision.HIGHEST


def ragged_paged_attention_reference(
    q: jax.Array,
    k_cache: jax.Array,
    v_cache: jax.Array,
    layer: jax.Array | int,
    block_tables: jax.Array,
    context_lens: jax.Array,
    query_start_loc: jax.Array,
    positions: jax.Array,
    *,
    scale: float,
    tile_size: int = 1,
    sliding_window: int | None = None,
    soft_cap: float | None = None,
    decode_blocks: int | None = None,
    k_scale: float | jax.Array = 1.0,
    v_scale: float | jax.Array = 1.0,
) -> jax.Array:
    if decode_blocks is not None:
        return _decode_flat_blocks(q, k_cache, v_cache, layer, block_tables, context_lens, query_start_loc,
                                   positions, scale=scale, num_blocks=decode_blocks,
                                   sliding_window=sliding_window, soft_cap=soft_cap, k_scale=k_scale,
                                   v_scale=v_scale)
    num_tokens, num_q_heads, head_dim = q.shape
    _, _, block_size, num_kv_heads, _ = k_cache.shape
    width = block_tables.shape[1]
    group = num_q_heads // num_kv_heads
    if num_tokens % tile_size:
        raise ValueError(f"num_tokens={num_tokens} must be a multiple of tile_size={tile_size}")
    num_tiles = num_tokens // tile_size
    ctx = width * block_size

    # Each tile belongs to the sequence whose segment contains its first token.
    tile_start = jnp.arange(num_tiles, dtype=jnp.int32) * tile_size
    # Unrolled: the default method is a while loop, which a GPU host waits on at each iteration (gpu.py).
    seq = jnp.searchsorted(query_start_loc, tile_start, side="right", method="scan_unrolled") - 1
    seq = jnp.clip(seq, 0, block_tables.shape[0] - 1)  # [NT]

    # [NT, W * BS, Hkv, D]: the tile's sequence's cache, gathered straight from the stacked pool.
    tables = block_tables[seq]  # [NT, W]
    k = k_cache[layer, tables].reshape(num_tiles, ctx, num_kv_heads, head_dim)
    v = v_cache[layer, tables].reshape(num_tiles, ctx, num_kv_heads, head_dim)

    kv_pos = jnp.arange(ctx, dtype=jnp.int32)
    in_context = kv_pos[None, :] < context_lens[seq][:, None]  # [NT, C]
    # Unused slots may hold garbage (NaN): 0 * NaN = NaN in p @ V, so V is zeroed there, not only the logits.
    v = jnp.where(in_context[:, :, None, None], v, jnp.zeros((), v.dtype))

    pos = positions.reshape(num_tiles, tile_size)  # [NT, tq]
    mask = in_context[:, None, :] & (kv_pos[None, None, :] <= pos[:, :, None])  # [NT, tq, C]
    if sliding_window is not None:
        mask &= kv_pos[None, None, :] > pos[:, :, None] - sliding_window

    qt = q.reshape(num_tiles, tile_size, num_kv_heads, group, head_dim)
    scores = jnp.einsum("ntkgd,nckd->nkgtc", qt.astype(jnp.float32), dequantize(k, k_scale),
                        precision=HIGHEST) * scale
    if soft_cap is not None:
        scores = soft_cap * jnp.tanh(scores / soft_cap)
    scores = jnp.where(mask[:, None, None, :, :], scores, NEG_INF)
    scores_max = jnp.max(scores, axis=-1, keepdims=True)
    p = jnp.exp(scores - scores_max)
    p = jnp.where(mask[:, None, None, :, :], p, 0.0)
    denom = jnp.sum(p, axis=-1, keepdims=True)
    p = p / jnp.where(denom == 0.0, 1.0, denom)  # fully masked rows (padding) give 0
    out = jnp.einsum("nkgtc,nckd->ntkgd", p, dequantize(v, v_scale), precision=HIGHEST)
    return out.reshape(num_tokens, num_q_heads, head_dim).astype(q.dtype)


def _decode_flat_blocks(q, k_cache, v_cache, layer, block_tables, context_lens, query_start_loc, positions, *,
                        scale, num_blocks, sliding_window, soft_cap, k_scale, v_scale):
    num_tokens, num_q_heads, head_dim = q.shape
    _, _, block_size, num_kv_heads, _ = k_cache.shape
    num_seqs, width = block_tables.shape
    group = num_q_heads // num_kv_heads

    # Flat block j belongs to sequence seq[j], as its logical block logical[j].
    per_seq = (context_lens + block_size - 1) // block_size  # [S]
    ends = jnp.cumsum(per_seq)  # [S]
    j = jnp.arange(num_blocks, dtype=jnp.int32)
    used = j < ends[-1]
    seq = jnp.clip(jnp.searchsorted(ends, j, side="right", method="scan_unrolled"), 0, num_seqs - 1)  # [NBF]
    logical = jnp.clip(j - (ends[seq] - per_seq[seq]), 0, width - 1)
    physical = jnp.where(used, block_tables[seq, logical], 0)

    k = k_cache[layer, physical]  # [NBF, BS, Hkv, D]
    v = v_cache[layer, physical]
    token = jnp.clip(query_start_loc[seq], 0, num_tokens - 1)
    q_pos = positions[token]  # [NBF]
    qb = q[token].reshape(num_blocks, num_kv_heads, group, head_dim).astype(jnp.float32)
    kv_pos = logical[:, None] * block_size + jnp.arange(block_size)[None, :]  # [NBF, BS]
    mask = used[:, None] & (kv_pos < context_lens[seq][:, None]) & (kv_pos <= q_pos[:, None])
    if sliding_window is not None:
        mask &= kv_pos > q_pos[:, None] - sliding_window

    # Multiply-and-reduce rather than a batched dot: XLA fuses the gather into it, so no gathered copy is written.
    scores = jnp.sum(qb[:, None] * dequantize(k, k_scale)[:, :, :, None, :], axis=-1) * scale  # [NBF, BS, Hkv, G]
    if soft_cap is not None:
        scores = soft_cap * jnp.tanh(scores / soft_cap)
    scores = jnp.where(mask[:, :, None, None], scores, NEG_INF)
    seq_max = jax.ops.segment_max(scores.max(axis=1), seq, num_segments=num_seqs)  # [S, Hkv, G]
    p = jnp.where(mask[:, :, None, None], jnp.exp(scores - seq_max[seq][:, None]), 0.0)
    denom = jax.ops.segment_sum(p.sum(axis=1), seq, num_segments=num_seqs)  # [S, Hkv, G]
    v = jnp.where(mask[:, :, None, None], dequantize(v, v_scale), 0.0)  # unused slots may hold NaN
    partial = jnp.sum(p[..., None] * v[:, :, :, None, :], axis=1)  # [NBF, Hkv, G, D]
    out = jax.ops.segment_sum(partial, seq, num_segments=num_seqs)
    out = out / jnp.where(denom == 0.0, 1.0, denom)[..., None]  # [S, Hkv, G, D]
    # Sequence s's query is token qsl[s]; padding sequences have no token of their own (dropped, or zeros).
    real = per_seq > 0
    rows = jnp.where(real, query_start_loc[:num_seqs], num_tokens)
    result = jnp.zeros((num_tokens, num_q_heads, head_dim), jnp.float32)
    result = result.at[rows].set(out.reshape(num_seqs, num_q_heads, head_dim), mode="drop")
    return result.astype(q.dtype)


def write_kv_reference(
    k_cache: jax.Array,
    v_cache: jax.Array,
    layer: jax.Array | int,
    k_new: jax.Array,
    v_new: jax.Array,
    slot_mapping: jax.Array,
) -> tuple[jax.Array, jax.Array]:
    """Writes the step's new K/V into the pool; in place when the pool is donated / carried in a loop.

    k_new, v_new  [T, Hkv, D]; slot_mapping [T] int32, flat slot = block * BS + offset. Padding tokens point at
    the null block 0, which no sequence ever reads as real context. The rows are cast to the pool's dtype (an fp8
    pool saturates: `fp8.to_pool_dtype`; the caller divides by the pool's scale first, as `KVPool.write` does).
    """
    block_size = k_cache.shape[2]
    blocks = slot_mapping // block_size
    offsets = slot_mapping % block_size
    k_cache = k_cache.at[layer, blocks, offsets].set(to_pool_dtype(k_new, k_cache.dtype))
    v_cache = v_cache.at[layer, blocks, offsets].set(to_pool_dtype(v_new, v_cache.dtype))
    return k_cache, v_cache


def dense_causal_attention(q: jax.Array, k: jax.Array, v: jax.Array, *, scale: float) -> jax.Array:
    """One sequence, no paging: q [Tq, Hq, D] are the last Tq positions of k, v [Tk, Hkv, D]. For tests."""
    tq, hq, _ = q.shape
    tk, hkv, _ = k.shape
    group = hq // hkv
    k = jnp.repeat(k, group, axis=1).astype(jnp.float32)
    v = jnp.repeat(v, group, axis=1).astype(jnp.float32)
    s = jnp.einsum("qhd,khd->hqk", q.astype(jnp.float32), k, precision=HIGHEST) * scale
    q_pos = jnp.arange(tk - tq, tk)
    mask = jnp.arange(tk)[None, :] <= q_pos[:, None]
    s = jnp.where(mask[None], s, NEG_INF)
    p = jax.nn.softmax(s, axis=-1)
    return jnp.einsum("hqk,khd->qhd", p, v, precision=HIGHEST).astype(q.dtype)
