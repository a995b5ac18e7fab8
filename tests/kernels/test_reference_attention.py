"""The pure-JAX reference (THE contract) against dense attention, over ragged batches laid out as the host does.

Every case's pool is NaN wherever no real context lives (other layers, spare blocks, the tail of each last block),
its sequences' blocks are a shuffled draw from the pool, and unused block-table entries point at random blocks.
Tolerances: float32 2e-5, bfloat16 2e-2 (inputs and outputs rounded to bf16; softmax in float32 everywhere).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.reference import dense_causal_attention, ragged_paged_attention_reference, write_kv_reference
from tests.kernels.attention_cases import (
    GEMMA3_HEADS,
    build_case,
    decode_case,
    dense_attention_np,
    prefill_case,
    tolerance,
)

reference = jax.jit(ragged_paged_attention_reference,
                    static_argnames=("scale", "tile_size", "sliding_window", "soft_cap", "decode_blocks"))

BLOCK = 8
WIDTH = 6  # the longest context is WIDTH * BLOCK = 48 tokens: a full block table
# Lengths that hit the edges: 1 token, exactly a block, a block + 1, the table's maximum, one in between.
DECODE_LENS = [1, BLOCK, BLOCK + 1, WIDTH * BLOCK, 29]
# (context_len, q_len): whole prompts (one exactly a tile, one of 1 token) and chunked-prefill steps.
PREFILL_SEQS = [(20, 20), (16, 16), (1, 1), (41, 17), (48, 5)]
GROUPS = [(4, 4), (6, 2), (8, 1)]  # (q heads, kv heads): GQA ratios 1, 3, 8
DTYPES = [jnp.float32, jnp.bfloat16]


dense = jax.jit(dense_causal_attention, static_argnames="scale")


def assert_matches_dense(case, out, **masking):
    """Rows of real tokens equal float64 dense attention over their sequence's own K/V; padding rows are 0.

    The float64 oracle is checked against `dense_causal_attention` below (and directly in one batch test); it is
    used everywhere else because it costs nothing, where a jitted dense call per sequence length costs a compile.
    """
    out = np.asarray(out.astype(jnp.float32))
    assert out.shape == case.q.shape and not np.isnan(out).any()
    np.testing.assert_allclose(out, case.expected(**masking), **tolerance(case.dtype))
    np.testing.assert_array_equal(out[~case.valid_tokens], 0.0)


@pytest.mark.parametrize("dtype", DTYPES, ids=["f32", "bf16"])
def test_reference_matches_dense_causal_attention_sequence_by_sequence(dtype):
    case = build_case([(1, 1), (BLOCK, 1), (BLOCK + 1, 1), (WIDTH * BLOCK, 17), (20, 20)], num_q_heads=6,
                      num_kv_heads=2, block_size=BLOCK, width=WIDTH, tile_size=1, dtype=dtype, num_padding_seqs=1,
                      num_padding_tokens=2, seed=10)
    out = np.asarray(reference(*case.args, **case.kwargs()).astype(jnp.float32))
    for (_, q_len), start, k, v in zip(case.seqs, case.token_starts, case.k_dense, case.v_dense, strict=True):
        want = dense(case.q[start:start + q_len], jnp.asarray(k, dtype), jnp.asarray(v, dtype), scale=case.scale)
        np.testing.assert_allclose(out[start:start + q_len], np.asarray(want.astype(jnp.float32)),
                                   **tolerance(dtype))
    np.testing.assert_array_equal(out[~case.valid_tokens], 0.0)


def _id(group):
    return f"{group[0]}q{group[1]}kv"


@pytest.mark.parametrize("dtype", DTYPES, ids=["f32", "bf16"])
@pytest.mark.parametrize("heads", GROUPS, ids=_id)
def test_reference_matches_dense_on_a_ragged_decode_batch(heads, dtype):
    case = decode_case(DECODE_LENS, num_q_heads=heads[0], num_kv_heads=heads[1], block_size=BLOCK, width=WIDTH,
                       dtype=dtype, num_padding_seqs=2, num_padding_tokens=2, seed=1)
    assert_matches_dense(case, reference(*case.args, **case.kwargs()))


@pytest.mark.parametrize("dtype", DTYPES, ids=["f32", "bf16"])
@pytest.mark.parametrize("heads", GROUPS, ids=_id)
def test_reference_flat_decode_blocks_match_dense(heads, dtype):
    case = decode_case(DECODE_LENS, num_q_heads=heads[0], num_kv_heads=heads[1], block_size=BLOCK, width=WIDTH,
                       dtype=dtype, num_padding_seqs=2, num_padding_tokens=2, seed=2)
    assert_matches_dense(case, reference(*case.args, **case.kwargs(decode_blocks=case.decode_blocks)))


@pytest.mark.parametrize("dtype", DTYPES, ids=["f32", "bf16"])
@pytest.mark.parametrize("heads", GROUPS, ids=_id)
def test_reference_matches_dense_on_prefill_tiles_with_chunked_prefill(heads, dtype):
    case = prefill_case(PREFILL_SEQS, num_q_heads=heads[0], num_kv_heads=heads[1], block_size=BLOCK, width=WIDTH,
                        dtype=dtype, num_padding_seqs=1, num_padding_tokens=16, seed=3)
    assert case.tile_size == 16 and all(s % 16 == 0 for s in case.token_starts)
    assert_matches_dense(case, reference(*case.args, **case.kwargs()))


@pytest.mark.parametrize("window", [None, 7], ids=["full", "window7"])
@pytest.mark.parametrize("dtype", DTYPES, ids=["f32", "bf16"])
def test_reference_gemma3_heads_one_kv_head_and_head_dim_256(dtype, window):
    """Gemma 3's shapes (GQA 4:1 onto a single kv head, head_dim 256) on decode (both paths) and prefill tiles,
    for its global layers (no window) and local ones (a window shorter than the contexts)."""
    decode = decode_case(DECODE_LENS, **GEMMA3_HEADS, block_size=BLOCK, width=WIDTH, dtype=dtype,
                         num_padding_seqs=1, num_padding_tokens=1, seed=30)
    for extra in ({}, {"decode_blocks": decode.decode_blocks}):
        out = reference(*decode.args, **decode.kwargs(sliding_window=window, **extra))
        assert_matches_dense(decode, out, sliding_window=window)
    prefill = prefill_case(PREFILL_SEQS, **GEMMA3_HEADS, block_size=BLOCK, width=WIDTH, dtype=dtype,
                           num_padding_seqs=1, seed=31)
    assert_matches_dense(prefill, reference(*prefill.args, **prefill.kwargs(sliding_window=window)),
                         sliding_window=window)


def test_reference_takes_the_window_as_a_traced_value():
    """A layer loop over interleaved local and global layers (Gemma 3) can index a per-layer window table: the
    reference takes the window traced, and a window longer than any context is the same as none. (The Pallas and
    native kernels take it static only: it is a constant of the kernel body or an FFI attribute.)"""
    case = decode_case(DECODE_LENS, **GEMMA3_HEADS, block_size=BLOCK, width=WIDTH, num_padding_seqs=1, seed=32)
    windows = jnp.asarray([7, 2**30], jnp.int32)  # [layers] local, global

    @jax.jit
    def per_layer(windows, *args):
        return [ragged_paged_attention_reference(*args, **case.kwargs(sliding_window=windows[i],
                                                                      decode_blocks=case.decode_blocks))
                for i in range(2)]

    local, global_ = per_layer(windows, *case.args)
    assert_matches_dense(case, local, sliding_window=7)
    assert_matches_dense(case, global_)


def test_numpy_oracle_agrees_with_dense_causal_attention():
    """The float64 oracle used for windows and soft caps is itself checked against the contract's dense function."""
    rng = np.random.default_rng(0)
    q, k, v = (rng.standard_normal(s).astype(np.float32) for s in ((5, 6, 16), (13, 2, 16), (13, 2, 16)))
    want = dense_causal_attention(jnp.asarray(q), jnp.asarray(k), jnp.asarray(v), scale=0.25)
    np.testing.assert_allclose(dense_attention_np(q, k, v, scale=0.25), np.asarray(want), rtol=1e-5, atol=1e-5)
    want_bf16 = dense_causal_attention(*(jnp.asarray(x, jnp.bfloat16) for x in (q, k, v)), scale=0.25)
    rounded = [np.asarray(jnp.asarray(x, jnp.bfloat16).astype(jnp.float32)) for x in (q, k, v)]
    np.testing.assert_allclose(dense_attention_np(*rounded, scale=0.25), np.asarray(want_bf16.astype(jnp.float32)),
                               **tolerance(jnp.bfloat16))
    # A window as wide as the context changes nothing; a window of 1 sees only the token itself.
    np.testing.assert_allclose(dense_attention_np(q, k, v, scale=0.25, sliding_window=13), np.asarray(want),
                               rtol=1e-5, atol=1e-5)
    own = np.repeat(v[-5:], 3, axis=1)
    np.testing.assert_allclose(dense_attention_np(q, k, v, scale=0.25, sliding_window=1), own, rtol=1e-6)


@pytest.mark.parametrize("window", [1, 7, 20])
def test_reference_sliding_window_on_prefill_and_decode(window):
    prefill = prefill_case(PREFILL_SEQS, num_q_heads=6, num_kv_heads=2, block_size=BLOCK, width=WIDTH, seed=4)
    assert_matches_dense(prefill, reference(*prefill.args, **prefill.kwargs(sliding_window=window)),
                         sliding_window=window)

    decode = decode_case(DECODE_LENS, num_q_heads=6, num_kv_heads=2, block_size=BLOCK, width=WIDTH,
                         num_padding_seqs=1, seed=5)
    for extra in ({}, {"decode_blocks": decode.decode_blocks}):
        out = reference(*decode.args, **decode.kwargs(sliding_window=window, **extra))
        assert_matches_dense(decode, out, sliding_window=window)


def test_reference_soft_cap_matches_the_oracle():
    case = prefill_case(PREFILL_SEQS, num_q_heads=4, num_kv_heads=2, block_size=BLOCK, width=WIDTH, seed=6)
    case.q = case.q * 8  # large logits, so the cap matters
    out = reference(*case.args, **case.kwargs(soft_cap=5.0))
    np.testing.assert_allclose(np.asarray(out), case.expected(soft_cap=5.0), **tolerance(jnp.float32))
    assert np.abs(np.asarray(out) - case.expected()).max() > 1e-2  # the cap changed the answer


def test_poisoned_slots_never_reach_the_output():
    case = decode_case([3, 9, 17], num_q_heads=4, num_kv_heads=2, block_size=BLOCK, num_padding_seqs=1,
                       num_padding_tokens=1, seed=7)
    pool = np.asarray(case.v_cache)
    last_block = int(case.block_tables[0, 0])
    assert np.isnan(pool[case.layer, last_block, 3:]).all()  # the tail of sequence 0's only block is NaN
    assert np.isnan(pool[1 - case.layer]).all()  # and so is the other layer
    for extra in ({}, {"decode_blocks": case.decode_blocks}):
        out = np.asarray(reference(*case.args, **case.kwargs(**extra)))
        assert np.isfinite(out).all()
        np.testing.assert_allclose(out, case.expected(), **tolerance(jnp.float32))


def test_write_kv_reference_writes_exactly_the_addressed_slots():
    rng = np.random.default_rng(8)
    layers, blocks, bs, hkv, d = 3, 7, 4, 2, 8
    k_pool = rng.standard_normal((layers, blocks, bs, hkv, d)).astype(np.float32)
    v_pool = rng.standard_normal((layers, blocks, bs, hkv, d)).astype(np.float32)
    slots = rng.choice(blocks * bs, size=5, replace=False).astype(np.int32)
    k_new = rng.standard_normal((5, hkv, d)).astype(np.float32)
    v_new = rng.standard_normal((5, hkv, d)).astype(np.float32)
    k_out, v_out = jax.jit(write_kv_reference)(jnp.asarray(k_pool), jnp.asarray(v_pool), 1, jnp.asarray(k_new),
                                               jnp.asarray(v_new), jnp.asarray(slots))
    want_k, want_v = k_pool.copy(), v_pool.copy()
    for i, slot in enumerate(slots):
        want_k[1, slot // bs, slot % bs] = k_new[i]
        want_v[1, slot // bs, slot % bs] = v_new[i]
    np.testing.assert_array_equal(np.asarray(k_out), want_k)
    np.testing.assert_array_equal(np.asarray(v_out), want_v)
    changed = (np.asarray(k_out) != k_pool).any(axis=(-1, -2))  # [L, NB, BS]
    assert changed.sum() == len(slots) and changed[1].reshape(-1)[slots].all()


def test_write_kv_reference_casts_to_the_pool_dtype():
    pool = jnp.zeros((1, 2, 4, 1, 8), jnp.bfloat16)
    new = jnp.full((1, 1, 8), 1.0 / 3.0, jnp.float32)
    k_out, _ = write_kv_reference(pool, pool, 0, new, new, jnp.asarray([5], jnp.int32))
    assert k_out.dtype == jnp.bfloat16
    assert float(k_out[0, 1, 1, 0, 0]) == float(jnp.bfloat16(1.0 / 3.0))


def test_build_case_lays_out_the_batch_as_the_host_does():
    """The helper's own promises, which every attention test relies on."""
    case = prefill_case([(20, 20), (41, 17)], num_q_heads=4, num_kv_heads=2, block_size=BLOCK, num_padding_seqs=2,
                        num_padding_tokens=3, seed=9)
    qsl = np.asarray(case.query_start_loc)
    np.testing.assert_array_equal(qsl, [0, 32, 64, 64, 64])  # segments padded to 16-token tiles
    assert case.num_tokens == 80 and case.num_tokens % 16 == 0
    pos = np.asarray(case.positions)
    np.testing.assert_array_equal(pos[:20], np.arange(20))
    np.testing.assert_array_equal(pos[32:49], np.arange(24, 41))
    assert (pos[20:32] == -1).all() and (pos[49:] == -1).all()
    tables = np.asarray(case.block_tables)
    used = np.concatenate([tables[0, :3], tables[1, :6]])
    assert len(set(used.tolist())) == 9 and 0 not in used  # distinct, never the null block
    assert not (np.diff(used) == 1).all()  # shuffled, not one contiguous run
    np.testing.assert_array_equal(np.asarray(case.context_lens), [20, 41, 0, 0])


def test_reference_lowers_without_a_while_loop():
    """A GPU's host waits on the device at every iteration of an XLA while loop (gpu.py's SEQUENCE_SEARCH says so):
    the tile -> sequence and flat block -> sequence searches are unrolled."""
    case = prefill_case(PREFILL_SEQS, num_q_heads=6, num_kv_heads=2, block_size=BLOCK, seed=3)
    assert "stablehlo.while" not in reference.lower(*case.args, **case.kwargs()).as_text()
    case = decode_case(DECODE_LENS, num_q_heads=6, num_kv_heads=2, block_size=BLOCK, width=WIDTH, seed=3)
    assert "stablehlo.while" not in reference.lower(*case.args, **case.kwargs()).as_text()  # tile path
    flat = reference.lower(*case.args, **case.kwargs(decode_blocks=case.decode_blocks)).as_text()
    assert "stablehlo.while" not in flat  # the flat-block decode path
