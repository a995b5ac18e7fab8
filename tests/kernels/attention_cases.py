"""Builds ragged paged-attention inputs with a known answer, for the reference's and the kernels' tests.

    case = build_case([(37, 1), (16, 1), (1, 1)], num_q_heads=6, num_kv_heads=2, block_size=8)   # a decode batch
    out = ragged_paged_attention_reference(*case.args, **case.kwargs())
    np.testing.assert_allclose(np.asarray(out, np.float32), case.expected(), **tolerance(case.dtype))

A sequence is (context_len, q_len): its queries are the last q_len of context_len cached positions (q_len ==
context_len is a whole prefill, q_len == 1 a decode, anything between a chunked-prefill step). The pool is laid out
as the host would: physical blocks are a shuffled, non-contiguous draw from the pool (block 0, the null block, is
never used), each segment of the token axis starts at a multiple of tile_size and its tail up to the next multiple
is padding (position -1), padding sequences have context_len 0, and padding tokens may follow the last segment.
With poison=True every pool slot no real context uses (other layers, unused blocks, the tail of each sequence's
last block) is NaN, and the unused block-table entries point at random blocks, other sequences' included.
With kv_dtype an fp8 dtype the pool holds fp8(x / scale) (pallas_kernels/fp8.py) and the dense copies the values it
means, fp8 * scale, so `expected()` is attention over the dequantized K/V.

The answer, `case.expected()`, is computed independently in float64 numpy from the per-sequence dense K/V
(`case.k_dense[i]`, `case.v_dense[i]`, [context_len, Hkv, D]), so it shares no code with any implementation.
"""

from __future__ import annotations

import dataclasses
import math

import jax.numpy as jnp
import numpy as np

from pallas_kernels.fp8 import is_fp8, to_pool_dtype

# Tolerances against the float64 answer (and between implementations), per dtype. bf16 outputs are rounded to 8
# mantissa bits and kernels may round softmax weights to bf16 before the p @ V dot.
TOLERANCES = {
    np.dtype(jnp.float32): dict(rtol=2e-5, atol=2e-5),
    np.dtype(jnp.bfloat16): dict(rtol=2e-2, atol=2e-2),
}


# Gemma 3 270M's attention: 4 query heads sharing one kv head (GQA 4:1), head_dim 256 (build_case keywords)
GEMMA3_HEADS = dict(num_q_heads=4, num_kv_heads=1, head_dim=256)


def tolerance(dtype) -> dict:
    return TOLERANCES[np.dtype(dtype)]


@dataclasses.dataclass
class AttentionCase:
    q: jnp.ndarray  # [T, Hq, D] dtype
    k_cache: jnp.ndarray  # [L, NB, BS, Hkv, D] dtype
    v_cache: jnp.ndarray  # [L, NB, BS, Hkv, D] dtype
    layer: int
    block_tables: jnp.ndarray  # [S, W] int32
    context_lens: jnp.ndarray  # [S] int32
    query_start_loc: jnp.ndarray  # [S + 1] int32
    positions: jnp.ndarray  # [T] int32, -1 on padding tokens
    tile_size: int
    scale: float
    seqs: list[tuple[int, int]]  # (context_len, q_len) of the real sequences, in batch order
    token_starts: list[int]  # first token of each real sequence's segment
    k_dense: list[np.ndarray]  # per real sequence [context_len, Hkv, D] float32 (values as stored in the pool)
    v_dense: list[np.ndarray]
    k_scale: float = 1.0  # an fp8 pool's scales (the pool holds K / k_scale)
    v_scale: float = 1.0

    @property
    def args(self) -> tuple:
        return (self.q, self.k_cache, self.v_cache, self.layer, self.block_tables, self.context_lens,
                self.query_start_loc, self.positions)

    def kwargs(self, **extra) -> dict:
        scales = dict(k_scale=self.k_scale, v_scale=self.v_scale) if is_fp8(self.k_cache.dtype) else {}
        return dict(scale=self.scale, tile_size=self.tile_size, **scales, **extra)

    @property
    def dtype(self):
        return self.q.dtype

    @property
    def num_tokens(self) -> int:
        return self.q.shape[0]

    @property
    def block_size(self) -> int:
        return self.k_cache.shape[2]

    @property
    def valid_tokens(self) -> np.ndarray:
        """[T] bool: tokens that are real queries (position >= 0)."""
        return np.asarray(self.positions) >= 0

    @property
    def decode_blocks(self) -> int:
        """The flat block count a decode step would pass (blocks in use, rounded up to a power of two)."""
        used = sum(-(-c // self.block_size) for c in np.asarray(self.context_lens).tolist())
        return 1 << max(used - 1, 0).bit_length()

    def expected(self, *, sliding_window: int | None = None, soft_cap: float | None = None) -> np.ndarray:
        """[T, Hq, D] float32 answer from float64 dense attention per sequence; 0 on padding tokens."""
        q = np.asarray(self.q.astype(jnp.float32), np.float64)
        out = np.zeros(q.shape, np.float64)
        for (_, q_len), start, k, v in zip(self.seqs, self.token_starts, self.k_dense, self.v_dense, strict=True):
            out[start:start + q_len] = dense_attention_np(q[start:start + q_len], k, v, scale=self.scale,
                                                          sliding_window=sliding_window, soft_cap=soft_cap)
        return out.astype(np.float32)


def dense_attention_np(q, k, v, *, scale, sliding_window=None, soft_cap=None) -> np.ndarray:
    """One sequence, float64: q [Tq, Hq, D] are the last Tq positions of k, v [Tk, Hkv, D]. Returns [Tq, Hq, D]."""
    q, k, v = (np.asarray(x, np.float64) for x in (q, k, v))
    tq, hq, _ = q.shape
    tk, hkv, _ = k.shape
    k = np.repeat(k, hq // hkv, axis=1)
    v = np.repeat(v, hq // hkv, axis=1)
    s = np.einsum("qhd,khd->hqk", q, k) * scale
    if soft_cap is not None:
        s = soft_cap * np.tanh(s / soft_cap)
    q_pos = np.arange(tk - tq, tk)[:, None]
    kv_pos = np.arange(tk)[None, :]
    visible = kv_pos <= q_pos
    if sliding_window is not None:
        visible &= kv_pos > q_pos - sliding_window
    s = np.where(visible[None], s, -np.inf)
    p = np.exp(s - s.max(axis=-1, keepdims=True))
    p /= p.sum(axis=-1, keepdims=True)
    return np.einsum("hqk,khd->qhd", p, v)


def build_case(
    seqs: list[tuple[int, int]],
    *,
    num_q_heads: int = 4,
    num_kv_heads: int = 2,
    head_dim: int = 64,
    block_size: int = 16,
    tile_size: int = 1,
    dtype=jnp.float32,
    num_layers: int = 2,
    layer: int = 1,
    width: int | None = None,
    num_padding_seqs: int = 0,
    num_padding_tokens: int = 0,
    spare_blocks: int = 3,
    poison: bool = True,
    seed: int = 0,
    kv_dtype=None,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
) -> AttentionCase:
    """A ragged batch of `seqs` ((context_len, q_len) each) over a freshly filled pool; see the module docstring.
    q is `dtype`, the pool `kv_dtype` (default: dtype; an fp8 dtype stores K / k_scale and V / v_scale).

    width defaults to the blocks of the longest context; num_padding_tokens is added after the last segment and
    rounded so the token count is a multiple of tile_size.
    """
    for ctx, q_len in seqs:
        if not 1 <= q_len <= ctx:
            raise ValueError(f"sequence (context_len={ctx}, q_len={q_len}) needs 1 <= q_len <= context_len")
    rng = np.random.default_rng(seed)
    blocks_per_seq = [-(-ctx // block_size) for ctx, _ in seqs]
    width = width or max(blocks_per_seq + [1])
    if max(blocks_per_seq + [0]) > width:
        raise ValueError(f"width={width} is too small for {max(blocks_per_seq)} blocks")
    num_blocks = 1 + sum(blocks_per_seq) + spare_blocks  # block 0 is the null block

    # Values as the pool stores them (cast to dtype), the dense copies are those same values in float32.
    fill = np.nan if poison else 0.0
    k_pool = np.full((num_layers, num_blocks, block_size, num_kv_heads, head_dim), fill, np.float32)
    v_pool = np.full_like(k_pool, fill)
    if not poison:
        k_pool[...] = rng.standard_normal(k_pool.shape)
        v_pool[...] = rng.standard_normal(v_pool.shape)

    kv_dtype = jnp.dtype(dtype if kv_dtype is None else kv_dtype)
    fp8 = is_fp8(kv_dtype)

    def as_stored(x, scale=1.0):
        """(what the pool holds, the value it means), float32."""
        if not fp8:
            held = np.asarray(jnp.asarray(x, kv_dtype).astype(jnp.float32))
            return held, held
        held = np.asarray(to_pool_dtype(jnp.asarray(x, jnp.float32), kv_dtype, scale).astype(jnp.float32))
        return held, held * np.float32(scale)

    physical = rng.permutation(np.arange(1, num_blocks))  # shuffled: sequences' blocks are not contiguous
    num_seqs = len(seqs) + num_padding_seqs
    tables = rng.integers(0, num_blocks, size=(num_seqs, width)).astype(np.int32)  # unused entries: any block
    k_dense, v_dense = [], []
    used = 0
    for i, (ctx, _) in enumerate(seqs):
        ids = physical[used:used + blocks_per_seq[i]]
        used += blocks_per_seq[i]
        tables[i, :len(ids)] = ids
        k_held, k = as_stored(rng.standard_normal((ctx, num_kv_heads, head_dim)), k_scale)
        v_held, v = as_stored(rng.standard_normal((ctx, num_kv_heads, head_dim)), v_scale)
        pos = np.arange(ctx)
        k_pool[layer, ids[pos // block_size], pos % block_size] = k_held
        v_pool[layer, ids[pos // block_size], pos % block_size] = v_held
        k_dense.append(k)
        v_dense.append(v)

    # Token axis: each segment starts at a multiple of tile_size; its tail to the next multiple is padding.
    starts, qsl, positions = [], [0], []
    for ctx, q_len in seqs:
        starts.append(qsl[-1])
        length = -(-q_len // tile_size) * tile_size
        positions += list(range(ctx - q_len, ctx)) + [-1] * (length - q_len)
        qsl.append(qsl[-1] + length)
    qsl += [qsl[-1]] * num_padding_seqs
    num_tokens = -(-(len(positions) + num_padding_tokens) // tile_size) * tile_size
    num_tokens = max(num_tokens, tile_size)
    positions += [-1] * (num_tokens - len(positions))

    q = rng.standard_normal((num_tokens, num_q_heads, head_dim)).astype(np.float32)
    context_lens = [ctx for ctx, _ in seqs] + [0] * num_padding_seqs
    return AttentionCase(
        q=jnp.asarray(q, dtype), k_cache=jnp.asarray(k_pool, kv_dtype), v_cache=jnp.asarray(v_pool, kv_dtype),
        layer=layer, block_tables=jnp.asarray(tables), context_lens=jnp.asarray(context_lens, jnp.int32),
        query_start_loc=jnp.asarray(qsl, jnp.int32), positions=jnp.asarray(positions, jnp.int32),
        tile_size=tile_size, scale=1.0 / math.sqrt(head_dim), seqs=list(seqs), token_starts=starts,
        k_dense=k_dense, v_dense=v_dense, k_scale=k_scale, v_scale=v_scale)


def decode_case(context_lens: list[int], **kwargs) -> AttentionCase:
    """A decode batch: one query per sequence (the last position), tile_size 1."""
    return build_case([(c, 1) for c in context_lens], tile_size=1, **kwargs)


def prefill_case(seqs: list[tuple[int, int]], **kwargs) -> AttentionCase:
    """A prefill batch with 16-token tiles: whole prompts (q_len == context_len) and chunks (q_len < context_len)."""
    return build_case(seqs, tile_size=16, **kwargs)


def shape_args(*, block_size: int = 16, head_dim: int = 64, q_heads: int = 2, kv_heads: int = 1,
               dtype=jnp.float32) -> tuple:
    """Positional arguments of a one-sequence, two-token batch with the given shapes (zeros): for argument checks."""
    k = jnp.zeros((1, 4, block_size, kv_heads, head_dim), dtype)  # [L, NB, BS, Hkv, D]
    q = jnp.zeros((2, q_heads, head_dim), dtype)
    return (q, k, k, 0, jnp.zeros((1, 2), jnp.int32), jnp.zeros(1, jnp.int32), jnp.zeros(2, jnp.int32),
            jnp.zeros(2, jnp.int32))
