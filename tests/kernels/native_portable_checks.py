"""Checks run in a child process by tests/kernels/test_native_portable.py, whose environment builds the native CPU
kernels for another target (JAXPAGED_NATIVE_MARCH, e.g. x86-64-v2: no AVX, no AVX-512): a process registers one library
per FFI target, so the portable build cannot share a process with this machine's own.

    python -m tests.kernels.native_portable_checks kernels  # each portable kernel against pure JAX; 1 on a mismatch
    python -m tests.kernels.native_portable_checks engine   # a tiny engine's greedy tokens and start-up line, as JSON
"""

from __future__ import annotations

import json
import logging
import sys

import jax
import jax.numpy as jnp
import numpy as np


def check_status() -> None:
    from pallas_kernels import cpu_native

    for name in ("attention", "norm", "rope", "argmax", "penalties", "top_p", "gumbel", "logprobs"):
        assert cpu_native.available(name), (name, cpu_native.unavailable_reason(name))
    reason = cpu_native.unavailable_reason("matmul")
    assert not cpu_native.available("matmul") and "AVX512BF16" in reason, reason
    assert not cpu_native.matmul_is_fast()
    x = jnp.zeros((2, 4), jnp.bfloat16)
    try:
        cpu_native.matmul_native(x, jnp.zeros((4, 32), jnp.bfloat16))
    except RuntimeError as e:
        assert "'matmul' is unavailable" in str(e) and "AVX512BF16" in str(e), e
    else:
        raise AssertionError("matmul_native ran without its kernel")


def check_attention() -> None:
    """The portable attention against pallas_kernels/reference.py and the float64 dense answer: decodes, prompts
    and chunks, a mixed batch, a window and a soft cap, float32 and bfloat16 (NaN-poisoned pools)."""
    from pallas_kernels.cpu_native import paged_attention_native
    from pallas_kernels.reference import ragged_paged_attention_reference
    from tests.kernels.attention_cases import GEMMA3_HEADS, build_case, decode_case, prefill_case, tolerance

    for dtype in (jnp.float32, jnp.bfloat16):
        cases = [
            (decode_case([1, 16, 17, 77, 1], num_q_heads=6, num_kv_heads=2, block_size=16, num_padding_seqs=2,
                         num_padding_tokens=3, seed=1, dtype=dtype), {}),
            (prefill_case([(45, 45), (90, 27), (16, 16), (3, 3)], num_q_heads=6, num_kv_heads=2, head_dim=128,
                          block_size=8, seed=2, dtype=dtype), {}),
            (build_case([(7, 1), (40, 40), (100, 1), (64, 30), (129, 17)], tile_size=1, num_q_heads=4,
                        num_kv_heads=4, block_size=32, num_padding_seqs=1, num_padding_tokens=4, seed=3,
                        dtype=dtype), {}),
            (prefill_case([(70, 70), (33, 5)], seed=4, dtype=dtype, **GEMMA3_HEADS),
             dict(sliding_window=21, soft_cap=30.0)),
        ]
        for case, extra in cases:
            got = np.asarray(paged_attention_native(*case.args, **case.kwargs(**extra)).astype(jnp.float32))
            want = np.asarray(ragged_paged_attention_reference(*case.args, **case.kwargs(**extra))
                              .astype(jnp.float32))
            assert not np.isnan(got).any()
            np.testing.assert_allclose(got, want, **tolerance(dtype))
            np.testing.assert_allclose(got, case.expected(**extra), **tolerance(dtype))
            assert not got[~case.valid_tokens].any()  # rows that no sequence owns are 0


def check_pool_writes() -> None:
    from pallas_kernels.cpu_native import set_blocks_native, write_kv_native
    from pallas_kernels.reference import write_kv_reference

    rng = np.random.default_rng(5)
    shape = (3, 10, 4, 2, 8)  # [L, NB, BS, Hkv, D]
    for dtype in (jnp.float32, jnp.bfloat16):
        k, v = (jnp.asarray(rng.standard_normal(shape), dtype) for _ in range(2))
        k_new, v_new = (jnp.asarray(rng.standard_normal((5, 2, 8)), dtype) for _ in range(2))
        slots = jnp.asarray([4, 0, 39, 17, 22], jnp.int32)
        got = jax.jit(write_kv_native)(k, v, 1, k_new, v_new, slots)
        want = write_kv_reference(k, v, 1, k_new, v_new, slots)
        for g, w in zip(got, want, strict=True):
            np.testing.assert_array_equal(np.asarray(g, np.float32), np.asarray(w, np.float32))
        blocks = jnp.asarray(rng.standard_normal((3, 2, 4, 2, 8)), dtype)
        k2, v2 = jax.jit(set_blocks_native)(k, v, jnp.asarray([7, 2], jnp.int32), blocks, -blocks)
        np.testing.assert_array_equal(np.asarray(k2[:, [7, 2]], np.float32), np.asarray(blocks, np.float32))
        np.testing.assert_array_equal(np.asarray(v2[:, [7, 2]], np.float32), -np.asarray(blocks, np.float32))


def check_norm_rope_argmax() -> None:
    """norm.cc, rope.cc, argmax.cc, penalties.cc and logprobs.cc's portable paths against the models' and the
    sampler's pure-JAX functions compiled by XLA (log-probs: against the float64 log-softmax)."""
    from jaxpaged.models.norm import rms_norm
    from jaxpaged.models.rope import rope
    from jaxpaged.worker import sampler
    from pallas_kernels import cpu_native

    rng = np.random.default_rng(6)
    for t, h in ((1, 64), (7, 100), (300, 576)):
        x, delta = (jnp.asarray(rng.standard_normal((t, h)), jnp.bfloat16) for _ in range(2))
        w = jnp.asarray(1.0 + rng.standard_normal((2, h)) * 0.1, jnp.bfloat16)
        want_plain = jax.jit(lambda x, w: rms_norm(x, w[1], 1e-6))(x, w)
        want_sum = jax.jit(lambda x, d, w: rms_norm(x + d, w[0], 1e-6))(x, delta, w)
        _, got_plain = cpu_native.rms_norm_native(x, w, 1, 1e-6)
        s, got_sum = cpu_native.rms_norm_native(x, w, 0, 1e-6, delta=delta)
        np.testing.assert_array_equal(np.asarray(s), np.asarray(x, np.float32) + np.asarray(delta, np.float32))
        for got, want in ((got_plain, want_plain), (got_sum, want_sum)):
            got, want = np.asarray(got, np.float32), np.asarray(want, np.float32)
            # the float32 order of the mean's sum differs: one bf16 rounding step apart, rarely
            np.testing.assert_allclose(got, want, rtol=2 ** -7)
            assert np.mean(got != want) < 0.02
        added = cpu_native.add_round_native(s, delta)
        np.testing.assert_array_equal(np.asarray(added, np.float32),
                                      np.asarray((s.astype(jnp.bfloat16) + delta).astype(jnp.bfloat16), np.float32))
    for t, hq, hk, d in ((1, 4, 2, 8), (70, 9, 3, 64)):
        q, k = (jnp.asarray(rng.standard_normal((t, hh, d)) * 2, jnp.bfloat16) for hh in (hq, hk))
        angles = rng.integers(0, 4000, (t, 1, 1)) * (10000.0 ** -(np.arange(d // 2) / (d // 2)))
        cos, sin = jnp.asarray(np.cos(angles), jnp.float32), jnp.asarray(np.sin(angles), jnp.float32)
        want = jax.jit(lambda q, k, c, s: (rope(q, c, s), rope(k, c, s)))(q, k, cos, sin)
        got = cpu_native.rope_native(q, k, cos, sin)
        for g, w in zip(got, want, strict=True):  # each a fused multiply-add, rounded once: XLA's numbers
            np.testing.assert_array_equal(np.asarray(g, np.float32), np.asarray(w, np.float32))
    logits = rng.standard_normal((5, 3001)).astype(np.float32)
    logits[1, [7, 2900]] = 50.0  # a tie: the first wins
    logits[2] = -np.inf  # a masked row: 0
    logits[3, ::2] = np.nan  # NaN is never the maximum
    got = np.asarray(cpu_native.argmax_native(jnp.asarray(logits)))
    want = np.argmax(np.where(np.isnan(logits), -np.inf, logits), axis=-1)
    np.testing.assert_array_equal(got, want)
    # log-probs: lax.top_k's order (NaN first, ties by index), the float64 log-softmax's values
    finite = np.where(np.isfinite(logits), logits, -30.0).astype(np.float32)
    for x in (logits, finite):
        chosen, ranks, vals, ids = cpu_native.logprobs_native(jnp.asarray(x), jnp.arange(5, dtype=jnp.int32), 20)
        np.testing.assert_array_equal(np.asarray(ranks), np.sum(x >= x[np.arange(5), np.arange(5)][:, None], -1))
        np.testing.assert_array_equal(np.asarray(ids), np.asarray(jax.lax.top_k(jnp.asarray(x), 20)[1]))
    x64 = finite.astype(np.float64)
    ref = x64 - x64.max(-1, keepdims=True) - np.log(np.exp(x64 - x64.max(-1, keepdims=True)).sum(-1, keepdims=True))
    np.testing.assert_allclose(np.asarray(vals), np.take_along_axis(ref, np.asarray(ids), -1), atol=2e-6, rtol=2e-6)
    np.testing.assert_allclose(np.asarray(chosen), ref[np.arange(5), np.arange(5)], atol=2e-6, rtol=2e-6)
    s = sampler.SamplingMetadata.padding(5, 3001, 40)
    s.seen_tokens[:, :30] = rng.integers(0, 60, (5, 30))
    s.output_start[:], s.pending_tokens[:] = [0, 10, 20, 30, 5], [-1, 3, 59, -1, 2]
    s.presence_penalty[:], s.frequency_penalty[:], s.repetition_penalty[:] = 0.5, -0.3, [1.0, 1.3, 0.8, 2.0, 1.1]
    logits = jnp.asarray(rng.standard_normal((5, 3001)).astype(np.float32))
    want, got = (np.asarray(jax.jit(lambda x, s, n=n: sampler._penalize(x, s, n))(logits, s)) for n in (False, True))
    np.testing.assert_array_equal(got.view(np.int32), want.view(np.int32))


def check_sampler_draws() -> None:
    """top_p.cc's and gumbel.cc's portable paths against the sampler's XLA versions: the threshold as the
    bisection's, the draw's tokens as XLA's Gumbel-max (its logarithm here without fused multiply-adds, within an
    ulp of XLA's: a token could part only on a tie within rounding)."""
    from jaxpaged.worker import sampler
    from pallas_kernels import cpu_native

    rng = np.random.default_rng(7)
    rows, vocab = 24, 3001
    logits = np.round(rng.standard_normal((rows, vocab)) * rng.choice([0.3, 2.0, 8.0], (rows, 1)) * 4) / 4
    logits[rng.random((rows, vocab)) < 0.1] = -np.inf
    logits = jnp.asarray(logits.astype(np.float32))
    k = jnp.asarray(rng.choice([1, 7, 50, vocab], rows).astype(np.int32))
    top_p = jnp.asarray(rng.choice([1e-6, 0.5, 0.95, 1.0], rows).astype(np.float32))
    want = np.asarray(jax.jit(sampler._threshold_by_search)(logits, k, top_p))[:, 0]
    np.testing.assert_array_equal(np.asarray(cpu_native.top_p_threshold_native(logits, k, top_p)), want)
    keys = sampler._row_keys(jnp.arange(rows, dtype=jnp.uint32), jnp.zeros(rows, jnp.uint32),
                             jnp.arange(rows, dtype=jnp.int32))
    want = np.asarray(jax.jit(lambda x, k: sampler._argmax(x + sampler._gumbel(k, vocab)))(logits, keys))
    got = np.asarray(cpu_native.gumbel_argmax_native(logits, jax.random.key_data(keys)))
    np.testing.assert_array_equal(got, want)


def engine() -> dict:
    """Greedy tokens of a tiny float32 model through the native attention backend, and the engine's start-up line
    about the native kernels."""
    from tests.tiny import greedy_tokens, random_params, random_prompts, tiny_config

    lines: list[str] = []

    class Keep(logging.Handler):
        def emit(self, record):
            lines.append(record.getMessage())

    logger = logging.getLogger("jaxpaged.engine.setup")
    logger.setLevel(logging.INFO)
    logger.addHandler(Keep())
    config = tiny_config(hidden=48, heads=6, kv_heads=2, head_dim=16, layers=2)
    tokens = greedy_tokens(config, random_params(config), random_prompts(4, 3, 30, seed=9),
                           attention_backend="native", max_tokens=12)
    return {"tokens": tokens, "native_line": [line for line in lines if line.startswith("native CPU kernels")]}


def main(what: str) -> None:
    if what == "kernels":
        check_status()
        check_attention()
        check_pool_writes()
        check_norm_rope_argmax()
        check_sampler_draws()
        print("ok")
    elif what == "engine":
        print(json.dumps(engine()))
    else:
        raise SystemExit(f"unknown check {what!r}: kernels or engine")


if __name__ == "__main__":
    main(sys.argv[1])
