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
Output            [T, Hq, D]                 q's dtype; 0 on padding tokens.

Query head h reads kv head h // (Hq // Hkv) (GQA/MQA). Token t of sequence s sees the cached positions
p < context_lens[s] with p <= positions[t] (causal), and p > positions[t] - sliding_window when a window is set.
Softmax runs in float32 whatever the input dtype.

`tile_size` groups consecutive tokens into tiles that share one gather of their sequence's K/V: 1 for a
decode-only batch (one token per sequence), 16 for prefill batches, whose segments the host then starts at
multiples of 16. Cost is (T / tile_size) gathers of W * BS cached tokens: per-sequence cost for decodes,
and no per-sequence padding of queries for prefills.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

NEG_INF = -1e30


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
) -> jax.Array:
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
    seq = jnp.searchsorted(query_start_loc, tile_start, side="right") - 1
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
    scores = jnp.einsum("ntkgd,nckd->nkgtc", qt.astype(jnp.float32), k.astype(jnp.float32)) * scale
    if soft_cap is not None:
        scores = soft_cap * jnp.tanh(scores / soft_cap)
    scores = jnp.where(mask[:, None, None, :, :], scores, NEG_INF)
    scores_max = jnp.max(scores, axis=-1, keepdims=True)
    p = jnp.exp(scores - scores_max)
    p = jnp.where(mask[:, None, None, :, :], p, 0.0)
    denom = jnp.sum(p, axis=-1, keepdims=True)
    p = p / jnp.where(denom == 0.0, 1.0, denom)  # fully masked rows (padding) give 0
    out = jnp.einsum("nkgtc,nckd->ntkgd", p, v.astype(jnp.float32))
    return out.reshape(num_tokens, num_q_heads, head_dim).astype(q.dtype)


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
    the null block 0, which no sequence ever reads as real context.
    """
    block_size = k_cache.shape[2]
    blocks = slot_mapping // block_size
    offsets = slot_mapping % block_size
    k_cache = k_cache.at[layer, blocks, offsets].set(k_new.astype(k_cache.dtype))
    v_cache = v_cache.at[layer, blocks, offsets].set(v_new.astype(v_cache.dtype))
    return k_cache, v_cache


def dense_causal_attention(q: jax.Array, k: jax.Array, v: jax.Array, *, scale: float) -> jax.Array:
    """One sequence, no paging: q [Tq, Hq, D] are the last Tq positions of k, v [Tk, Hkv, D]. For tests."""
    tq, hq, _ = q.shape
    tk, hkv, _ = k.shape
    group = hq // hkv
    k = jnp.repeat(k, group, axis=1).astype(jnp.float32)
    v = jnp.repeat(v, group, axis=1).astype(jnp.float32)
    s = jnp.einsum("qhd,khd->hqk", q.astype(jnp.float32), k) * scale
    q_pos = jnp.arange(tk - tq, tk)
    mask = jnp.arange(tk)[None, :] <= q_pos[:, None]
    s = jnp.where(mask[None], s, NEG_INF)
    p = jax.nn.softmax(s, axis=-1)
    return jnp.einsum("hqk,khd->qhd", p, v).astype(q.dtype)
