"""The native CPU ragged paged-attention kernel (pallas_kernels/cpu_native) against a float64 dense oracle and the
engine: decode batches, prefill batches (whole prompts and chunks), and both in one batch.

Skips only where the kernel cannot be built (no g++), with the reason; CI has g++, so it runs there.
"""

from __future__ import annotations

import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.cpu_native import build, native
from pallas_kernels.reference import ragged_paged_attention_reference
from tests.kernels.attention_cases import (
    GEMMA3_HEADS,
    build_case,
    decode_case,
    dense_attention_np,
    prefill_case,
    tolerance,
)

pytestmark = pytest.mark.skipif(not native.available("attention"),
                                reason=f"native CPU kernel unavailable: {native.unavailable_reason('attention')}")
TARGET = "jaxpaged_paged_attention"  # the FFI target of paged_attention.cc's attention handler


def run_native(case, **extra):
    return native.paged_attention_native(*case.args, **case.kwargs(decode_blocks=case.decode_blocks, **extra))


def check(case, **extra):
    out = np.asarray(run_native(case, **extra).astype(jnp.float32))
    assert out.shape == case.q.shape and out.dtype == np.float32
    assert not np.isnan(out).any()
    np.testing.assert_allclose(out, case.expected(**extra), **tolerance(case.dtype))
    # Rows no real sequence owns are exactly 0.
    assert not out[~case.valid_tokens].any()


# bfloat16 decodes of head_dim 64, 128 and 256 take the kernel's AVX-512 path where the CPU has AVX512_BF16
DTYPES = pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=["f32", "bf16"])


@DTYPES
@pytest.mark.parametrize("block_size", [8, 16, 32])
@pytest.mark.parametrize("heads", [(4, 4), (6, 2), (8, 1), (18, 1)], ids=["gqa1", "gqa3", "gqa8", "gqa18"])
def test_ragged_lengths_block_sizes_and_gqa(block_size, heads, dtype):
    num_q_heads, num_kv_heads = heads
    lens = [1, block_size, block_size + 1, 5 * block_size - 3, 1]
    check(decode_case(lens, num_q_heads=num_q_heads, num_kv_heads=num_kv_heads, block_size=block_size,
                      num_padding_seqs=2, num_padding_tokens=3, seed=block_size, dtype=dtype))


@DTYPES
@pytest.mark.parametrize("head_dim", [8, 64, 128, 256])
def test_head_dims(head_dim, dtype):
    check(decode_case([3, 33, 100], head_dim=head_dim, num_q_heads=6, num_kv_heads=2, seed=head_dim, dtype=dtype))


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=["f32", "bf16"])
@pytest.mark.parametrize("window", [None, 40], ids=["full", "window40"])
def test_gemma3_heads_one_kv_head_and_head_dim_256(dtype, window):
    """Gemma 3: 4 query heads on one kv head, head_dim 256; its global layers and its local (windowed) ones."""
    extra = {} if window is None else {"sliding_window": window}
    check(decode_case([1, 16, 17, 150, 33], **GEMMA3_HEADS, block_size=16, dtype=dtype, num_padding_seqs=1,
                      num_padding_tokens=1, seed=43), **extra)


def test_bfloat16():
    check(decode_case([1, 17, 70], dtype=jnp.bfloat16, num_q_heads=6, num_kv_heads=2))


@pytest.mark.parametrize("extra", [dict(sliding_window=1), dict(sliding_window=7), dict(sliding_window=40),
                                   dict(soft_cap=2.5), dict(sliding_window=9, soft_cap=1.5)],
                         ids=lambda e: "-".join(f"{k}={v}" for k, v in e.items()))
@DTYPES
def test_sliding_window_and_soft_cap(extra, dtype):
    check(decode_case([1, 8, 23, 64], num_q_heads=6, num_kv_heads=2, block_size=8, num_padding_seqs=1, dtype=dtype),
          **extra)


def test_layer_index_and_one_sequence_of_max_length():
    check(decode_case([512], num_layers=4, layer=3, block_size=16))
    check(decode_case([512], num_layers=4, layer=0, block_size=16))


def test_matches_reference_with_random_pool_values():
    case = decode_case([5, 31, 64, 2], poison=False, num_q_heads=6, num_kv_heads=3, block_size=8, seed=7)
    kw = case.kwargs(decode_blocks=case.decode_blocks)
    want = ragged_paged_attention_reference(*case.args, **kw)
    np.testing.assert_allclose(np.asarray(run_native(case)), np.asarray(want), rtol=2e-5, atol=2e-5)


def test_bfloat16_decodes_match_the_reference_to_a_rounding_step():
    """The AVX-512 bf16 decode path against the pure-JAX reference on the same bf16 inputs: one bf16 rounding step
    of the output apart at most (float32 sums in another order)."""
    case = decode_case([5, 31, 64, 2, 300], poison=False, num_q_heads=9, num_kv_heads=3, block_size=16, seed=8,
                       dtype=jnp.bfloat16)
    kw = case.kwargs(decode_blocks=case.decode_blocks)
    want = np.asarray(ragged_paged_attention_reference(*case.args, **kw).astype(jnp.float32))
    got = np.asarray(run_native(case).astype(jnp.float32))
    np.testing.assert_allclose(got, want, rtol=2 ** -7, atol=1e-3)
    assert np.mean(got == want) > 0.9


def test_out_of_range_block_ids_are_clipped_not_read_out_of_bounds():
    case = decode_case([20], block_size=8, poison=False)
    num_blocks = case.k_cache.shape[1]
    kw = case.kwargs(decode_blocks=4)

    def with_table(**entries):
        tables = case.block_tables
        for index, value in entries.items():
            tables = tables.at[0, int(index[1:])].set(value)
        args = list(case.args)
        args[4] = tables
        return args

    # Too large: clipped to NB - 1, as jnp indexing (the reference) does.
    out = native.paged_attention_native(*with_table(b1=10_000), **kw)
    want = ragged_paged_attention_reference(*with_table(b1=10_000), **kw)
    np.testing.assert_allclose(np.asarray(out), np.asarray(want), rtol=2e-5, atol=2e-5)
    # Negative: clipped to 0 (jnp would wrap around; the kernel never reads before the pool).
    out = native.paged_attention_native(*with_table(b2=-5, b1=num_blocks + 3), **kw)
    want = native.paged_attention_native(*with_table(b2=0, b1=num_blocks - 1), **kw)
    np.testing.assert_array_equal(np.asarray(out), np.asarray(want))


def test_jitted_inside_fori_loop_over_layers_and_no_pool_copy():
    num_layers = 3
    c = decode_case([9, 40, 17, 1], num_layers=num_layers, layer=0, block_size=8, num_q_heads=6, num_kv_heads=2,
                    num_padding_seqs=1)
    # Layer l holds layer 0's values transformed (NaN poison stays NaN): k * (1 + l / 2), v + l.
    k = jnp.stack([c.k_cache[0] * (1 + i / 2) for i in range(num_layers)])
    v = jnp.stack([c.v_cache[0] + i for i in range(num_layers)])

    @jax.jit
    def all_layers(q, k, v, tables, lens, qsl, pos):
        def body(i, acc):
            out = native.paged_attention_native(q, k, v, i, tables, lens, qsl, pos, scale=c.scale,
                                                       decode_blocks=c.decode_blocks)
            return acc.at[i].set(out)
        return jax.lax.fori_loop(0, num_layers, body, jnp.zeros((num_layers, *q.shape), q.dtype))

    args = (c.q, k, v, c.block_tables, c.context_lens, c.query_start_loc, c.positions)
    out = np.asarray(all_layers(*args))
    q = np.asarray(c.q, np.float64)
    for i in range(num_layers):
        want = np.zeros_like(q)
        for start, kd, vd in zip(c.token_starts, c.k_dense, c.v_dense, strict=True):
            want[start:start + 1] = dense_attention_np(q[start:start + 1], kd * (1 + i / 2), vd + i, scale=c.scale)
        np.testing.assert_allclose(out[i], want, **tolerance(c.dtype))
    hlo = all_layers.lower(*args).compile().as_text()
    assert TARGET in hlo
    pool = ",".join(map(str, k.shape))
    assert f"f32[{pool}]" in hlo
    assert not re.search(rf"f32\[{pool}\]\S* copy\(", hlo), "the pool is copied around the custom call"


# --- prefill and mixed batches ----------------------------------------------------------------------------------


@DTYPES  # bf16 tiles take the AVX-512 tile path where the CPU has AVX512_BF16, but for gqa18 (> 128 rows per kv head)
@pytest.mark.parametrize("block_size", [4, 8, 16, 32])  # 8 / 16 / 32: the kernel's unrolled tile paths; 4: generic
@pytest.mark.parametrize("heads", [(4, 4), (6, 2), (8, 1), (18, 1)], ids=["gqa1", "gqa3", "gqa8", "gqa18"])
def test_prefill_whole_prompts_and_chunks(block_size, heads, dtype):
    """Whole prompts (q_len == context) and chunks of longer ones (q_len < context: the chunk's tokens attend to the
    cached part and causally to each other), 16-token tiles with padding between segments; the kernel cuts each
    sequence's run of tokens into work items of 16 query tokens, so runs of 20, 33 and 37 tokens span several."""
    num_q_heads, num_kv_heads = heads
    check(prefill_case([(20, 20), (33, 5), (1, 1), (100, 37), (block_size, block_size)], num_q_heads=num_q_heads,
                       num_kv_heads=num_kv_heads, block_size=block_size, num_padding_seqs=2, num_padding_tokens=5,
                       seed=block_size, dtype=dtype))


@DTYPES
def test_mixed_decodes_and_prefill_chunks_without_tile_padding(dtype):
    """One batch of decodes (q_len 1) and prefill chunks packed back to back (tile 1): the layout a mixed step has."""
    check(build_case([(7, 1), (40, 40), (100, 1), (64, 30), (3, 1), (129, 17)], tile_size=1, num_q_heads=6,
                     num_kv_heads=2, block_size=16, num_padding_seqs=1, num_padding_tokens=4, seed=11, dtype=dtype))


@pytest.mark.parametrize("head_dim", [64, 128, 256])
def test_bfloat16_prefills_match_the_reference_to_a_rounding_step(head_dim):
    """The AVX-512 bf16 tile path against the pure-JAX reference on the same bf16 inputs (chunks that start
    mid-block, a block size of 8 so a 16-offset chunk spans blocks, a sliding window). Its p @ V multiplies the
    softmax weights rounded to bfloat16 (as the Pallas GPU kernel and FlashAttention-style kernels do), each off by
    at most 2^-9 relative, which moves an output by at most 2^-9 of the largest |V|: one bf16 rounding step of the
    output plus twice that apart at most, and most outputs bitwise equal."""
    for extra, block_size in (({}, 16), ({}, 8), (dict(sliding_window=21), 16)):
        case = prefill_case([(45, 45), (90, 27), (16, 16), (3, 3)], poison=False, num_q_heads=6, num_kv_heads=2,
                            head_dim=head_dim, block_size=block_size, seed=9, dtype=jnp.bfloat16)
        want = ragged_paged_attention_reference(*case.args, **case.kwargs(**extra)).astype(jnp.float32)
        got = native.paged_attention_native(*case.args, **case.kwargs(**extra)).astype(jnp.float32)
        got, want = np.asarray(got)[case.valid_tokens], np.asarray(want)[case.valid_tokens]
        v_max = float(np.abs(np.asarray(case.v_cache.astype(jnp.float32))).max())
        np.testing.assert_allclose(got, want, rtol=2 ** -8, atol=2 ** -8 * v_max)
        assert np.mean(got == want) > 0.6, extra


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=["f32", "bf16"])
@pytest.mark.parametrize("extra", [{}, dict(sliding_window=5), dict(sliding_window=40, soft_cap=2.0)],
                         ids=["full", "window5", "window40-cap"])
def test_prefill_windows_soft_cap_and_gemma3_heads(dtype, extra):
    check(prefill_case([(50, 50), (90, 20), (17, 17)], **GEMMA3_HEADS, block_size=16, dtype=dtype,
                       num_padding_seqs=1, seed=5), **extra)


def test_prefill_matches_the_reference_with_random_pool_values():
    case = prefill_case([(20, 20), (70, 33), (5, 5)], poison=False, num_q_heads=6, num_kv_heads=3, block_size=8,
                        seed=3)
    want = np.asarray(ragged_paged_attention_reference(*case.args, **case.kwargs()))
    got = np.asarray(run_native(case))
    np.testing.assert_allclose(got[case.valid_tokens], want[case.valid_tokens], rtol=2e-5, atol=2e-5)


def test_auto_dispatch_uses_native_for_every_batch_and_reference_for_float16():
    fn = functools.partial(native.native_else_reference)
    case = prefill_case([(20, 20), (33, 5)], block_size=8)
    out = fn(*case.args, **case.kwargs())
    np.testing.assert_allclose(np.asarray(out)[case.valid_tokens], case.expected()[case.valid_tokens],
                               **tolerance(case.dtype))
    jaxpr = str(jax.make_jaxpr(functools.partial(fn, **case.kwargs()))(*case.args))
    assert TARGET in jaxpr
    dec = decode_case([5, 17])
    jaxpr = str(jax.make_jaxpr(functools.partial(fn, **dec.kwargs(decode_blocks=dec.decode_blocks)))(*dec.args))
    assert TARGET in jaxpr
    half = decode_case([5, 17], dtype=jnp.float16)
    out = fn(*half.args, **half.kwargs(decode_blocks=half.decode_blocks))
    np.testing.assert_allclose(np.asarray(out, np.float32), half.expected(), rtol=2e-2, atol=2e-2)
    jaxpr = str(jax.make_jaxpr(functools.partial(fn, **half.kwargs(decode_blocks=half.decode_blocks)))(*half.args))
    assert TARGET not in jaxpr


@pytest.mark.parametrize("change, message", [
    (dict(dtype=jnp.float16), "float32 or bfloat16"),
    (dict(k_dtype=jnp.bfloat16), "one dtype"),
    (dict(q_heads=3), "multiple of Hkv"),
    (dict(float_tables=True), "block_tables must be int32"),
    (dict(sliding_window=0), "sliding_window"),
    (dict(short_positions=True), "positions"),
])
def test_bad_input_raises_value_error(change, message):
    case = decode_case([5, 17], dtype=change.pop("dtype", jnp.float32))
    q, k, v, layer, tables, lens, qsl, pos = case.args
    kw = case.kwargs(decode_blocks=case.decode_blocks)
    if "sliding_window" in change:
        kw["sliding_window"] = change.pop("sliding_window")
    if change.pop("k_dtype", None) is not None:
        k = k.astype(jnp.bfloat16)
    if (heads := change.pop("q_heads", None)) is not None:
        q = q[:, :heads]
    if change.pop("float_tables", False):
        tables = tables.astype(jnp.float32)
    if change.pop("short_positions", False):
        pos = pos[:-1]
    with pytest.raises(ValueError, match=message):
        native.paged_attention_native(q, k, v, layer, tables, lens, qsl, pos, **kw)


def test_engine_native_backend_gives_the_reference_tokens():
    from jaxpaged.worker.attention import attention_backend
    from tests.tiny import greedy_tokens, random_params, random_prompts, tiny_config

    config = tiny_config(hidden=48, heads=6, kv_heads=2, head_dim=16, layers=2)
    params = random_params(config)
    prompts = random_prompts(4, 3, 30, seed=9)
    assert (greedy_tokens(config, params, prompts, attention_backend="native", max_tokens=12)
            == greedy_tokens(config, params, prompts, attention_backend="reference", max_tokens=12))
    assert attention_backend("auto").kernel.func is native.native_else_reference  # CPU: native for every step


def test_unavailable_kernel_falls_back_on_auto_and_names_the_reason_on_native(monkeypatch):
    from jaxpaged.worker.attention import attention_backend

    monkeypatch.setitem(build._status, "attention",
                        build.KernelStatus("attention", False, reason="RuntimeError: no C++ compiler (test)"))
    assert attention_backend("auto").kernel is ragged_paged_attention_reference
    with pytest.raises(ValueError, match="native.*unavailable: RuntimeError: no C\\+\\+ compiler"):
        attention_backend("native")


def test_build_failure_is_reported_not_raised(monkeypatch, tmp_path):
    monkeypatch.setenv("JAXPAGED_CXX", "no-such-compiler-jaxpaged")
    monkeypatch.setenv("JAXPAGED_NATIVE_CACHE", str(tmp_path))
    with pytest.raises(RuntimeError, match="no-such-compiler-jaxpaged"):
        build.build_library(build.KERNELS["argmax"])
    # through status() (on a copy of this process's statuses): the failed kernel is reported with its reason, and
    # the others stay as they were
    monkeypatch.setattr(build, "_status", {k: v for k, v in build._status.items() if k != "argmax"})
    assert not build.available("argmax") and "no-such-compiler-jaxpaged" in build.unavailable_reason("argmax")
    assert build.available("attention")


# ---- the native K/V row write and block write ---------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16, jnp.float16])
def test_kv_write_equals_the_reference_scatter_in_place_in_any_dtype(dtype):
    """write_kv_native against write_kv_reference: the same pools after writing rows (padding rows at slot 0,
    slots outside the pool skipped by the native write), inside a jitted layer loop over a donated pool, with no
    pool-sized copy and the input buffer reused."""
    from pallas_kernels.reference import write_kv_reference
    from tests.hlo_checks import pool_copies

    rng = np.random.default_rng(0)
    shape = (3, 10, 4, 2, 8)  # [L, NB, BS, Hkv, D]
    k0, v0 = (jnp.asarray(rng.standard_normal(shape), dtype) for _ in range(2))
    k_new, v_new = (jnp.asarray(rng.standard_normal((6, 2, 8)), dtype) for _ in range(2))
    slots = jnp.asarray([5, 17, 0, 39, 2, 0], jnp.int32)

    def loop(write, k, v):
        def body(i, kv):
            return write(*kv, i, k_new * (i + 1).astype(dtype), v_new, slots)
        return jax.lax.fori_loop(0, shape[0], body, (k, v))

    want = jax.jit(functools.partial(loop, write_kv_reference))(k0, v0)
    step = jax.jit(functools.partial(loop, native.write_kv_native), donate_argnums=(0, 1))
    assert pool_copies(step.lower(k0, v0).compile().as_text(), shape) == []
    k, v = jnp.array(k0), jnp.array(v0)
    pointer = k.unsafe_buffer_pointer()
    got = step(k, v)
    assert got[0].unsafe_buffer_pointer() == pointer and k.is_deleted()
    for a, b in zip(got, want, strict=True):
        np.testing.assert_array_equal(np.asarray(a.astype(jnp.float32)), np.asarray(b.astype(jnp.float32)))
    # An out-of-range slot is skipped, not written out of bounds.
    bad = native.write_kv_native(k0, v0, 1, k_new, v_new, jnp.asarray([-1, 40, 10**6, 3, 3, 3], jnp.int32))
    np.testing.assert_array_equal(np.asarray(bad[0][1].reshape(40, 2, 8)[3]), np.asarray(k_new[5]))
    unchanged = np.ones(40, bool)
    unchanged[3] = False
    np.testing.assert_array_equal(np.asarray(bad[0][1].reshape(40, 2, 8)[unchanged]),
                                  np.asarray(k0[1].reshape(40, 2, 8)[unchanged]))


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_set_blocks_writes_whole_blocks_of_every_layer(dtype):
    rng = np.random.default_rng(1)
    shape = (3, 10, 4, 2, 8)
    k0, v0 = (jnp.asarray(rng.standard_normal(shape), dtype) for _ in range(2))
    blocks = jnp.asarray(rng.standard_normal((3, 3, 4, 2, 8)), dtype)
    dst = jnp.asarray([7, 2, 99], jnp.int32)  # 99: outside the pool, skipped
    k, v = native.set_blocks_native(k0, v0, dst, blocks, -blocks)
    want_k, want_v = np.array(k0.astype(jnp.float32)), np.array(v0.astype(jnp.float32))
    b = np.asarray(blocks.astype(jnp.float32))
    want_k[:, [7, 2]], want_v[:, [7, 2]] = b[:, :2], -b[:, :2]
    np.testing.assert_array_equal(np.asarray(k.astype(jnp.float32)), want_k)
    np.testing.assert_array_equal(np.asarray(v.astype(jnp.float32)), want_v)


def test_kv_and_block_writes_refuse_mismatched_shapes():
    pool = jnp.zeros((2, 4, 4, 2, 8))
    with pytest.raises(ValueError, match="must be \\[T, Hkv, D\\]"):
        native.write_kv_native(pool, pool, 0, jnp.zeros((3, 1, 8)), jnp.zeros((3, 1, 8)), jnp.zeros(3, jnp.int32))
    with pytest.raises(ValueError, match="slot_mapping"):
        native.write_kv_native(pool, pool, 0, jnp.zeros((3, 2, 8)), jnp.zeros((3, 2, 8)), jnp.zeros(4, jnp.int32))
    with pytest.raises(ValueError, match="k_blocks"):
        native.set_blocks_native(pool, pool, jnp.zeros(2, jnp.int32), jnp.zeros((2, 3, 4, 2, 8)),
                                 jnp.zeros((2, 3, 4, 2, 8)))


# ---- a token's bits do not depend on how its sequence was cut into steps (prompt_lens) ------------------------------

class OneSequence:
    """One sequence of N positions over a random pool (its blocks shuffled), its queries fixed per position, and a
    second sequence decoding beside it in every call (so the batch around the tokens changes too)."""

    def __init__(self, dtype, kv_dtype, heads, head_dim, block_size, n=45, seed=0):
        rng = np.random.default_rng(seed)
        hq, hkv = heads
        self.n, self.bs, self.dtype = n, block_size, dtype
        width = -(-n // block_size)
        num_blocks = 2 * width + 3
        self.q = rng.standard_normal((n, hq, head_dim)).astype(np.float32)
        pool = rng.standard_normal((2, 1, num_blocks, block_size, hkv, head_dim)).astype(np.float32)
        self.k, self.v = (jnp.asarray(p, kv_dtype) for p in pool)
        blocks = rng.permutation(np.arange(1, num_blocks))
        self.tables = np.stack([blocks[:width], blocks[width:2 * width]]).astype(np.int32)

    def attend(self, positions, context, prompt_len, sliding_window=None, prompt_lens=True):
        """Rows of `positions` (consecutive) of the sequence with `context` tokens cached, then a padding token and the
        other sequence's decode at position 20."""
        positions = list(positions)
        t = len(positions)
        q = np.concatenate([self.q[positions], np.zeros_like(self.q[:1]), self.q[20:21]])
        pos = np.array(positions + [-1, 20], np.int32)
        qsl = np.array([0, t, t + 2], np.int32)
        lens = np.array([context, 21], np.int32)
        kw = dict(prompt_lens=np.array([prompt_len, 5], np.int32)) if prompt_lens else {}
        out = native.paged_attention_native(jnp.asarray(q, self.dtype), self.k, self.v, 0, self.tables, lens, qsl, pos,
                                            scale=0.125, sliding_window=sliding_window, **kw)
        return np.asarray(out.astype(jnp.float32))[:t]


@pytest.mark.parametrize("kind", ["bf16", "f32", "fp8"])
@pytest.mark.parametrize("shape", [((6, 2), 64, 16), ((4, 4), 32, 8)], ids=["gqa3-d64-bs16", "gqa1-d32-bs8"])
@pytest.mark.parametrize("sliding_window", [None, 19], ids=["full", "window19"])
def test_a_prompt_token_gives_the_same_bits_in_any_chunk(kind, shape, sliding_window):
    """A prompt's rows whole, as the tail after a prefix-cache hit (1, 5 or 16 tokens), or as a middle chunk: bit for
    bit the same (prompt tokens always run in query tiles; the tile's other rows never change a row's sums)."""
    dtype, kv_dtype = {"bf16": (jnp.bfloat16,) * 2, "f32": (jnp.float32,) * 2,
                       "fp8": (jnp.bfloat16, jnp.float8_e4m3fn)}[kind]
    heads, head_dim, block_size = shape
    s = OneSequence(dtype, kv_dtype, heads, head_dim, block_size)
    whole = s.attend(range(45), 45, 45, sliding_window)
    assert np.isfinite(whole).all()
    for lo, hi in [(44, 45), (40, 45), (29, 45), (16, 33), (3, 7)]:
        part = s.attend(range(lo, hi), hi, 45, sliding_window)
        np.testing.assert_array_equal(part, whole[lo:hi], err_msg=f"prompt rows {lo}..{hi - 1}")


@pytest.mark.parametrize("kind", ["bf16", "f32"])
def test_a_generated_token_gives_the_same_bits_verified_or_decoded(kind):
    """Positions past the prompt (a verified token and its proposals, or a recompute's generated tokens) run one token
    at a time, as a decode step runs them."""
    dtype = {"bf16": jnp.bfloat16, "f32": jnp.float32}[kind]
    s = OneSequence(dtype, dtype, (6, 2), 64, 16, seed=3)
    together = s.attend(range(24, 45), 45, 24)  # 21 tokens past a 24-token prompt: more than one tile
    for i, p in enumerate(range(24, 45)):
        np.testing.assert_array_equal(s.attend([p], p + 1, 24), together[i:i + 1], err_msg=f"position {p}")


def test_prompt_lens_must_have_a_row_per_sequence():
    s = OneSequence(jnp.float32, jnp.float32, (4, 4), 32, 8)
    with pytest.raises(ValueError, match="prompt_lens"):
        native.paged_attention_native(jnp.asarray(s.q[:2]), s.k, s.v, 0, s.tables, np.array([2, 0], np.int32),
                                      np.array([0, 2, 2], np.int32), np.array([0, 1], np.int32), scale=0.125,
                                      prompt_lens=np.array([2], np.int32))
