"""Sampling on device and stop conditions, on a tiny in-memory model."""

from __future__ import annotations

import numpy as np
import pytest

from jaxpaged import LLM, SamplingParams
from jaxpaged.engine.detokenizer import Detokenizer
from tests.tiny import random_params, random_prompts, tiny_config

CONFIG = tiny_config()


@pytest.fixture(scope="module")
def llm():
    return LLM.from_params(CONFIG, random_params(CONFIG), None, dtype="float32", max_num_seqs=8,
                           max_num_batched_tokens=128, max_model_len=128, block_size=8, num_blocks=200,
                           precompile=False, show_progress=False)


def ids(prompts):
    return [{"prompt_token_ids": p} for p in prompts]


def tokens(outs):
    return [o.outputs[0].token_ids for o in outs]


def test_seeded_request_is_the_same_alone_and_in_any_batch(llm):
    prompts = ids(random_prompts(6, 4, 30, seed=1))
    seeded = SamplingParams(temperature=1.0, top_p=0.9, top_k=20, max_tokens=16, seed=1234, ignore_eos=True)
    alone = tokens(llm.generate(prompts[:1], seeded, use_tqdm=False))[0]
    others = [SamplingParams(temperature=0.7, max_tokens=n, seed=None, ignore_eos=True) for n in (3, 9, 16, 5, 12)]
    batched = tokens(llm.generate(prompts, [seeded] + others, use_tqdm=False))
    assert batched[0] == alone
    shuffled = tokens(llm.generate(prompts[3:] + prompts[:1], others[2:] + [seeded], use_tqdm=False))
    assert shuffled[-1] == alone


def test_different_seeds_give_different_samples(llm):
    prompt = ids(random_prompts(1, 10, 10, seed=2))
    outs = [tokens(llm.generate(prompt, SamplingParams(temperature=1.5, max_tokens=16, seed=s, ignore_eos=True),
                                use_tqdm=False))[0] for s in range(4)]
    assert len({tuple(o) for o in outs}) > 1


def test_top_k_1_is_greedy(llm):
    prompts = ids(random_prompts(4, 5, 20, seed=3))
    greedy = tokens(llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True),
                                 use_tqdm=False))
    top1 = tokens(llm.generate(prompts, SamplingParams(temperature=2.0, top_k=1, max_tokens=12, seed=7,
                                                       ignore_eos=True), use_tqdm=False))
    assert top1 == greedy


def test_tiny_top_p_is_greedy(llm):
    prompts = ids(random_prompts(3, 5, 20, seed=4))
    greedy = tokens(llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True),
                                 use_tqdm=False))
    nucleus = tokens(llm.generate(prompts, SamplingParams(temperature=1.0, top_p=1e-6, max_tokens=10, seed=3,
                                                          ignore_eos=True), use_tqdm=False))
    assert nucleus == greedy


def test_sampled_tokens_follow_the_model_distribution():
    """Empirical frequencies of the first token match softmax(logits / T) (chi-square-like bound)."""
    import jax.numpy as jnp

    from jaxpaged.worker import sampler

    vocab, rows = 24, 4000
    logits = np.tile(np.linspace(-3.0, 1.5, vocab, dtype=np.float32), (rows, 1))
    s = sampler.SamplingMetadata.padding(rows, vocab)
    s.temperature, s.seed_lo = jnp.full(rows, 0.8), jnp.arange(rows, dtype=jnp.uint32)
    got = np.bincount(np.asarray(sampler.sample(jnp.asarray(logits), s).tokens), minlength=vocab) / rows
    p = np.exp(logits[0] / 0.8)
    p /= p.sum()
    assert np.abs(got - p).max() < 0.03
    s.top_k = jnp.full(rows, 2, jnp.int32)
    got = np.asarray(sampler.sample(jnp.asarray(logits), s).tokens)
    assert set(np.unique(got)) <= {vocab - 1, vocab - 2}
    s.top_k, s.min_p = jnp.full(rows, -1, jnp.int32), jnp.full(rows, 0.5)
    got = np.asarray(sampler.sample(jnp.asarray(logits), s).tokens)
    keep = np.flatnonzero(p >= 0.5 * p.max())
    assert set(np.unique(got)) <= set(keep.tolist())


def test_max_tokens_and_stop_token_ids(llm):
    prompt = ids(random_prompts(1, 8, 8, seed=5))
    free = tokens(llm.generate(prompt, SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True),
                               use_tqdm=False))[0]
    assert len(free) == 20
    stop_at = free[5]
    first = free.index(stop_at)
    out = llm.generate(prompt, SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True,
                                              stop_token_ids=[stop_at]), use_tqdm=False)[0].outputs[0]
    assert out.token_ids == free[: first + 1]
    assert out.finish_reason == "stop" and out.stop_reason == stop_at


def test_eos_stops_unless_ignored_and_min_tokens_bans_it(llm):
    prompt = ids(random_prompts(1, 8, 8, seed=6))
    free = tokens(llm.generate(prompt, SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True),
                               use_tqdm=False))[0]
    eos = free[3]
    # one set, shared by the engine (banning), its input processor (stop ids) and its output processor (stopping)
    eos_ids = llm.engine.eos_token_ids
    assert llm.engine.inputs.eos_token_ids is eos_ids
    saved = set(eos_ids)
    eos_ids.clear()
    eos_ids.add(eos)
    try:
        out = llm.generate(prompt, SamplingParams(temperature=0.0, max_tokens=20), use_tqdm=False)[0].outputs[0]
        assert out.token_ids == free[: free.index(eos) + 1] and out.finish_reason == "stop"
        out = llm.generate(prompt, SamplingParams(temperature=0.0, max_tokens=20, min_tokens=10),
                           use_tqdm=False)[0].outputs[0]
        assert eos not in out.token_ids[:10] and len(out.token_ids) >= 10
    finally:
        eos_ids.clear()
        eos_ids.update(saved)


class _ByteTokenizer:
    """Token i decodes to byte i (UTF-8 joined), like a byte-level BPE's fallback tokens."""

    def decode(self, ids, skip_special_tokens=True):
        return bytes(ids).decode("utf-8", errors="replace")


def test_detokenizer_never_splits_a_multibyte_character():
    text = "héllo 世界 🙂!"
    data = list(text.encode())
    d = Detokenizer(_ByteTokenizer())
    seen = []
    for i in range(1, len(data) + 1):
        d.add(data[:i])
        seen.append(d.text)
        assert "\ufffd" not in d.text
        assert text.startswith(d.text)
    assert seen[-1] == text


def test_stop_string_is_cut_and_held_back_while_streaming():
    d = Detokenizer(_ByteTokenizer(), stop=["END"])
    data = list(b"abc ENDxyz")
    shown = []
    for i in range(1, len(data) + 1):
        d.add(data[:i])
        if d.check_stop(1):
            break
        shown.append(d.visible_text(finished=False))
    assert d.stopped_on == "END" and d.text == "abc "
    assert all("abc ".startswith(s) for s in shown)


def native_kernels() -> bool:
    from pallas_kernels import cpu_native

    return cpu_native.available("argmax")


def exact_thresholds(logits: np.ndarray, k: np.ndarray, top_p: np.ndarray) -> np.ndarray:
    """The filter's threshold per row by its definition, in float64: the value of the last token of the row sorted
    in descending order that lies within the top k and within the nucleus (the smallest prefix whose mass reaches
    top_p; everything at top_p >= 1)."""
    out = np.empty(logits.shape[0], np.float32)
    for row, (x, kk, p) in enumerate(zip(logits, k, top_p, strict=True)):
        order = np.sort(x)[::-1]
        probs = np.exp(order.astype(np.float64) - order[0])
        probs /= probs.sum()
        before = np.cumsum(probs) - probs
        out[row] = order[max(int(np.sum(((before < p) | (p >= 1.0)) & (np.arange(x.size) < kk))), 1) - 1]
    return out


def native_top_p(logits, k, top_p):
    from pallas_kernels import cpu_native

    return cpu_native.top_p_threshold_native(logits, k, top_p)[:, None]


@pytest.mark.parametrize("way", ["search", pytest.param("native", marks=pytest.mark.skipif(
    "not native_kernels()", reason="the native CPU kernels could not be built"))])
def test_the_searched_top_k_top_p_threshold_is_the_sorted_ones(way):
    """The CPU's ways to the filter's threshold, XLA's bisection (`_threshold_by_search`) and the native kernel's
    radix select, against the sort other platforms run (`_threshold_by_sort`) and a numpy rendering of the
    definition: rows with ties (logits on a 0.25 grid), banned tokens (-inf), peaked and flat rows, top-k from 1 to
    the vocabulary and top-p from 1e-6 to 1. Random rows put no prefix's mass within float32 rounding of p, where
    they may part."""
    import functools

    import jax
    import jax.numpy as jnp

    from jaxpaged.worker.sampler import _filter, _threshold_by_search, _threshold_by_sort

    _threshold_by_search = native_top_p if way == "native" else _threshold_by_search  # noqa: N806 (the way tested)
    _filter = functools.partial(_filter, native=way == "native")

    rng = np.random.default_rng(0)
    rows, vocab = 96, 300
    logits = np.round(rng.standard_normal((rows, vocab)) * rng.choice([0.3, 2.0, 8.0], (rows, 1)) * 4) / 4
    logits[rng.random((rows, vocab)) < 0.1] = -np.inf
    logits = logits.astype(np.float32)
    k = rng.choice([1, 2, 7, 50, vocab], rows).astype(np.int32)
    top_p = rng.choice([1e-6, 0.3, 0.9, 0.95, 0.999, 1.0], rows).astype(np.float32)
    args = (jnp.asarray(logits), jnp.asarray(k), jnp.asarray(top_p))
    searched = np.asarray(jax.jit(_threshold_by_search)(*args))[:, 0]
    np.testing.assert_array_equal(searched, np.asarray(jax.jit(_threshold_by_sort)(*args))[:, 0])
    np.testing.assert_array_equal(searched, exact_thresholds(logits, k, top_p))
    # the filter keeps every token at or above the threshold, and only those
    kept = np.asarray(jax.jit(_filter)(*args, jnp.zeros(rows, jnp.float32))) > -np.inf
    np.testing.assert_array_equal(kept, (logits >= searched[:, None]) & (logits > -np.inf))


@pytest.mark.skipif("not native_kernels()", reason="the native CPU kernels could not be built")
def test_the_native_top_p_threshold_at_a_real_vocabulary_and_its_bad_input():
    """At SmolLM2's vocabulary (the kernel's vector path, its float32 partial sums flushed every 1024 tokens) the
    native threshold equals the float64 definition at least as often as XLA's sort does, and differs from the sort
    only in a row or two (where a prefix's mass is within rounding of p); rows that filter nothing keep every token;
    the wrapper names what it cannot take."""
    import jax
    import jax.numpy as jnp

    from jaxpaged.worker.sampler import _threshold_by_sort
    from pallas_kernels.cpu_native import top_p_threshold_native

    rng = np.random.default_rng(3)
    rows, vocab = 12, 49152
    logits = (rng.standard_normal((rows, vocab)) * 3).astype(np.float32)
    k = np.full(rows, vocab, np.int32)
    k[:3] = [1, 40, 1000]
    top_p = np.full(rows, 0.95, np.float32)
    top_p[3:6] = [0.5, 0.99, 1.0]
    args = (jnp.asarray(logits), jnp.asarray(k), jnp.asarray(top_p))
    native = np.asarray(jax.jit(top_p_threshold_native)(*args))
    sort = np.asarray(jax.jit(_threshold_by_sort)(*args))[:, 0]
    exact = exact_thresholds(logits, k, top_p)
    assert np.sum(native == exact) >= np.sum(sort == exact) and np.sum(native != sort) <= 2
    np.testing.assert_array_equal(native[:3], np.sort(logits[:3], axis=-1)[np.arange(3), vocab - k[:3]])  # top-k
    assert native[5] == logits[5].min()  # top-p 1, no top-k: every token kept
    for bad, match in ((args[0].astype(jnp.bfloat16), "logits must be .S, V. float32"),
                       (args[0][0], "logits must be .S, V. float32")):
        with pytest.raises(ValueError, match=match):
            top_p_threshold_native(bad, *args[1:])
    with pytest.raises(ValueError, match="k and top_p must be .12."):
        top_p_threshold_native(args[0], args[1][:5], args[2])


@pytest.mark.skipif("not native_kernels()", reason="the native CPU kernels could not be built")
def test_the_native_gumbel_draw_is_xla_s_noise_bit_for_bit_and_refuses_bad_input():
    """The native Gumbel-max draw adds the noise jax.random.gumbel draws from each row's key, bit for bit: with x the
    negated XLA noise every sum is exactly 0 (the first index wins), so a single noise value above XLA's would move
    the token; on random logits its tokens are XLA's draw's (SmolLM2's vocabulary, temperatures 0.1 to 5, tokens
    banned, a row with one drawable token); keys of another PRNG, or threefry's bits unpartitioned, take XLA's path; bad
    input is refused by name."""
    import jax
    import jax.numpy as jnp

    from jaxpaged.worker import sampler
    from pallas_kernels.cpu_native import available, gumbel_argmax_native

    if not available("gumbel"):
        pytest.skip("the native Gumbel kernel could not be built")
    rows, vocab = 16, 49152
    keys = sampler._row_keys(jnp.arange(rows, dtype=jnp.uint32), jnp.full(rows, 7, jnp.uint32),
                             jnp.arange(rows, dtype=jnp.int32) * 3)
    data = jax.random.key_data(keys)
    draw = jax.jit(gumbel_argmax_native)
    xla_noise = sampler._gumbel(keys, vocab)
    np.testing.assert_array_equal(np.asarray(draw(-xla_noise, data)), np.zeros(rows))  # all tied at exactly 0
    rng = np.random.default_rng(4)
    x = rng.standard_normal((rows, vocab)) * rng.choice([0.1, 1.0, 5.0], (rows, 1))
    x[rng.random((rows, vocab)) < 0.2] = -np.inf
    x[3, :] = -np.inf
    x[3, 777] = 0.0
    x = jnp.asarray(x.astype(np.float32))
    xla = np.asarray(jax.jit(lambda x, k: sampler._argmax(x + sampler._gumbel(k, vocab)))(x, keys))
    np.testing.assert_array_equal(np.asarray(draw(x, data)), xla)
    assert xla[3] == 777
    np.testing.assert_array_equal(np.asarray(jax.jit(lambda x, k: sampler._draw(x, k, True))(x, keys)), xla)
    rbg = jax.vmap(lambda i: jax.random.key(i, impl="rbg"))(jnp.arange(rows, dtype=jnp.uint32))
    np.testing.assert_array_equal(  # (the kernel knows threefry's partitionable bits only)
        np.asarray(jax.jit(lambda x, k: sampler._draw(x, k, True))(x, rbg)),
        np.asarray(jax.jit(lambda x, k: sampler._argmax(x + sampler._gumbel(k, vocab)))(x, rbg)))
    with jax.threefry_partitionable(False):
        unpartitioned = np.asarray(jax.jit(lambda x, k: sampler._argmax(x + sampler._gumbel(k, vocab)))(x, keys))
        np.testing.assert_array_equal(np.asarray(jax.jit(lambda x, k: sampler._draw(x, k, True))(x, keys)),
                                      unpartitioned)
    assert (unpartitioned != xla).any()  # (other bits: the case is not vacuous)
    with pytest.raises(ValueError, match="x must be .S, V. float32"):
        gumbel_argmax_native(x.astype(jnp.bfloat16), data)
    with pytest.raises(ValueError, match="keys must be .16, 2. uint32"):
        gumbel_argmax_native(x, data[:4])
    with pytest.raises(ValueError, match="keys must be .16, 2. uint32"):
        gumbel_argmax_native(x, data.astype(jnp.int32))


@pytest.mark.parametrize("native", [False, pytest.param(True, marks=pytest.mark.skipif(
    "not native_kernels()", reason="the native CPU kernels could not be built"))], ids=["xla", "native"])
def test_the_samplers_argmax_is_jnp_argmax_with_ties_and_masked_rows(native):
    """The sampler's argmax (chunked in XLA, or the native kernel's one pass) picks what jnp.argmax picks: the first
    of tied maxima, and index 0 of a row masked to -inf everywhere."""
    import functools

    import jax.numpy as jnp

    from jaxpaged.worker.sampler import _argmax

    _argmax = functools.partial(_argmax, native=native)

    rng = np.random.default_rng(0)
    x = rng.standard_normal((16, 1000)).astype(np.float32)
    x[3, [7, 500, 999]] = 10.0  # ties: the first wins
    x[4] = -np.inf
    x[5, :] = 1.0
    x[6, -1] = 99.0
    np.testing.assert_array_equal(np.asarray(_argmax(jnp.asarray(x))), np.argmax(x, axis=-1))
    # Chunked: ties in different chunks and at a chunk's edges, a maximum in the last (full) chunk, vocab a multiple
    # of the chunk width; a NaN row still gives an index in range.
    y = rng.standard_normal((8, 1024)).astype(np.float32)
    y[0, [127, 128]] = 5.0
    y[1, [900, 300, 301]] = 5.0
    y[2, 1023] = 5.0
    y[3, :] = -np.inf
    y[4, [0, 1023]] = 5.0
    y[5, 17] = np.nan
    got = np.asarray(_argmax(jnp.asarray(y)))
    ok = np.arange(8) != 5
    np.testing.assert_array_equal(got[ok], np.argmax(y, axis=-1)[ok])
    assert 0 <= got[5] < 1024
    # Every width around the native kernel's 64-element groups and a step's whole vocabulary.
    for vocab in (1, 15, 63, 64, 65, 200, 49152):
        z = rng.standard_normal((5, vocab)).astype(np.float32)
        z[1] = z[1].max()  # the whole row tied
        z[2, -1] = z[2].max() + 1.0
        np.testing.assert_array_equal(np.asarray(_argmax(jnp.asarray(z))), np.argmax(z, axis=-1))


@pytest.mark.skipif("not native_kernels()", reason="the native CPU kernels could not be built")
def test_native_argmax_sampler_gives_the_same_tokens_and_refuses_bad_input():
    """sample(native=True) gives sample()'s tokens for greedy and seeded rows alike; the kernel names what it
    cannot take."""
    import functools

    import jax
    import jax.numpy as jnp

    from jaxpaged.worker import sampler
    from jaxpaged.worker.sampler import SamplingMetadata
    from pallas_kernels.cpu_native import argmax_native

    rows, vocab = 6, 3000
    logits = jnp.asarray(np.random.default_rng(2).standard_normal((rows, vocab)).astype(np.float32) * 3)
    s = SamplingMetadata.padding(rows, vocab_size=vocab)
    s.temperature[:] = [0.0, 1.0, 0.0, 0.7, 1.3, 0.0]
    s.seed_lo[:] = np.arange(rows) + 11
    xla, native = (np.asarray(jax.jit(functools.partial(sampler.sample, native=n))(logits, s).tokens)
                   for n in (False, True))
    np.testing.assert_array_equal(native, xla)
    # with top-p and top-k: the native threshold too (the same tokens as XLA's bisection)
    s.top_p[:], s.top_k[:] = [1.0, 0.9, 1.0, 0.5, 1.0, 1.0], [0, 0, 0, 0, 5, 0]
    filtered = [np.asarray(jax.jit(functools.partial(sampler.sample, native=n))(logits, s).tokens)
                for n in (False, True)]
    np.testing.assert_array_equal(filtered[1], filtered[0])
    top5 = np.argsort(-np.asarray(logits)[4])[:5]
    assert filtered[1][4] in top5
    greedy = s.temperature == 0.0
    np.testing.assert_array_equal(native[greedy], np.argmax(np.asarray(logits), axis=-1)[greedy])
    assert (native[~greedy] != np.argmax(np.asarray(logits), axis=-1)[~greedy]).any()  # the seeded rows did draw
    with pytest.raises(ValueError, match="x must be .S, V. float32"):
        argmax_native(logits.astype(jnp.bfloat16))
    with pytest.raises(ValueError, match="x must be .S, V. float32"):
        argmax_native(logits[0])


def logprobs_kernel() -> bool:
    from pallas_kernels import cpu_native

    return cpu_native.available("logprobs")


def float64_logprobs(logits: np.ndarray) -> np.ndarray:
    x = logits.astype(np.float64)
    top = x.max(axis=-1, keepdims=True)
    return x - top - np.log(np.exp(x - top).sum(axis=-1, keepdims=True))


@pytest.mark.parametrize("native", [False, pytest.param(True, marks=pytest.mark.skipif(
    "not logprobs_kernel()", reason="the native logprobs kernel could not be built"))], ids=["xla", "native"])
def test_the_samplers_logprobs_are_the_float64_log_softmax_and_lax_top_k(native):
    """`sampler.logprobs` (XLA, or the native kernel's two passes): the ranks count the logits at or above the token's
    (vLLM's); the top tokens are jax.lax.top_k of the logits
    exactly (ties by ascending index, -0 below +0, NaN first), their log-probs and the chosen token's within 1e-5 of
    the float64 log-softmax (2e-6 natively: its sum is float64), for rows that insert at every token (ascending), the
    widths around the kernel's 16-lane groups, Gemma's vocabulary, and a speculative step's [S, K + 1, V]."""
    import functools

    import jax
    import jax.numpy as jnp

    from jaxpaged.sampling_params import MAX_LOGPROBS
    from jaxpaged.worker import sampler

    fn = jax.jit(functools.partial(sampler.logprobs, native=native))
    tol = 2e-6 if native else 1e-5

    def check(x, tokens):
        out = fn(jnp.asarray(x), jnp.asarray(tokens))
        chosen, ids, vals = out.logprobs, out.top_ids, out.top_logprobs
        picked = np.take_along_axis(x, np.asarray(tokens)[..., None], -1)  # the rank counts the logits at or above
        np.testing.assert_array_equal(np.asarray(out.ranks), np.sum(x >= picked, axis=-1))
        want_ids = np.asarray(jax.lax.top_k(jnp.asarray(x), MAX_LOGPROBS)[1])
        np.testing.assert_array_equal(np.asarray(ids), want_ids)
        ref = float64_logprobs(x)
        finite = np.isfinite(x).all(axis=-1)
        np.testing.assert_allclose(np.asarray(vals)[finite], np.take_along_axis(ref, want_ids, -1)[finite],
                                   atol=tol, rtol=tol)
        np.testing.assert_allclose(np.asarray(chosen)[finite],
                                   np.take_along_axis(ref, np.asarray(tokens)[..., None], -1)[..., 0][finite],
                                   atol=tol, rtol=tol)
        return np.asarray(chosen), np.asarray(vals)

    rng = np.random.default_rng(4)
    x = (rng.standard_normal((8, 3001)) * 3).astype(np.float32)
    x[0, [5, 9, 2000, 3000]] = 15.0  # tied maxima: ascending index
    x[1, :] = 1.0  # the whole row tied: log(1 / V) everywhere
    x[2, [10, 2999]] = [0.0, -0.0]  # a zero of each sign, ranked +0 first
    x[2, :2990] = -30.0
    x[3] = np.sort(x[3])  # every token enters the top k
    x[4, -1] = 100.0  # the maximum in the scalar tail: every other log-prob below -80
    x[5, :20] = 50.0  # the first k tokens are the answer
    x[6, 3] = -np.inf  # a masked token: its log-prob -inf
    x[7, ::3] = np.nan  # a NaN: the top ids still lax.top_k's (NaN first), the log-probs NaN
    tokens = np.array([9, 0, 2999, 3000, 3000, 19, 3, 1], np.int32)
    chosen, vals = check(x, tokens)
    assert np.allclose(vals[1], -np.log(3001)) and chosen[6] == -np.inf and np.isnan(vals[7]).all()
    for vocab in (20, 21, 31, 32, 33, 63, 64, 65, 49152, 262144):
        z = (rng.standard_normal((3, vocab)) * 3).astype(np.float32)
        check(z, rng.integers(0, vocab, 3).astype(np.int32))
    spec = (rng.standard_normal((2, 3, 3000)) * 3).astype(np.float32)
    check(spec, rng.integers(0, 3000, (2, 3)).astype(np.int32))


@pytest.mark.skipif("not logprobs_kernel()", reason="the native logprobs kernel could not be built")
def test_native_logprobs_give_xla_s_tokens_and_refuse_bad_input():
    """sample(native=True) returns the XLA path's tokens and top ids, and log-probs within 1e-5 of them; the kernel
    names what it cannot take (shapes, dtypes, k), and a token outside the vocabulary gets NaN, not a stray read."""
    import functools

    import jax
    import jax.numpy as jnp

    from jaxpaged.worker import sampler
    from pallas_kernels.cpu_native import logprobs_native

    logits = jnp.asarray(np.random.default_rng(5).standard_normal((6, 3000)).astype(np.float32) * 3)
    s = sampler.SamplingMetadata.padding(6, vocab_size=3000)
    s.temperature[:] = [0.0, 1.0, 0.0, 0.7, 1.3, 0.0]
    s.seed_lo[:] = np.arange(6) + 3
    s.want_logprobs = np.array(True)
    xla, native = (jax.jit(functools.partial(sampler.sample, native=n))(logits, s) for n in (False, True))
    np.testing.assert_array_equal(np.asarray(native.tokens), np.asarray(xla.tokens))
    np.testing.assert_array_equal(np.asarray(native.lp.top_ids), np.asarray(xla.lp.top_ids))
    np.testing.assert_array_equal(np.asarray(native.lp.ranks), np.asarray(xla.lp.ranks))
    np.testing.assert_allclose(np.asarray(native.lp.logprobs), np.asarray(xla.lp.logprobs), atol=1e-5)
    np.testing.assert_allclose(np.asarray(native.lp.top_logprobs), np.asarray(xla.lp.top_logprobs), atol=1e-5)
    chosen, ranks, _, _ = logprobs_native(logits, jnp.array([-1, 3000, 0, 1, 2, 3], jnp.int32), 20)
    assert np.isnan(np.asarray(chosen)[:2]).all() and np.isfinite(np.asarray(chosen)[2:]).all()
    assert (np.asarray(ranks)[:2] == 0).all() and (np.asarray(ranks)[2:] >= 1).all()  # an id outside V: no rank
    with pytest.raises(ValueError, match=r"logits must be \[S, V\] float32"):
        logprobs_native(logits.astype(jnp.bfloat16), jnp.zeros(6, jnp.int32), 20)
    with pytest.raises(ValueError, match=r"tokens must be \[6\]"):
        logprobs_native(logits, jnp.zeros(5, jnp.int32), 20)
    with pytest.raises(ValueError, match=r"k must be an int in \[1, min\(V, 64\)\] = \[1, 15\], got 16"):
        logprobs_native(jnp.zeros((2, 15), jnp.float32), jnp.zeros(2, jnp.int32), 16)
    with pytest.raises(ValueError, match="k must be an int"):
        logprobs_native(logits, jnp.zeros(6, jnp.int32), 65)


@pytest.mark.skipif("not native_kernels()", reason="the native CPU kernels could not be built")
def test_native_penalties_are_xla_s_bits_and_refuse_bad_input():
    """penalties.cc gives the XLA penalties' bits: every row's mix of repeats in prompt and output, a pending token
    (new or already seen), padding, ids past the vocabulary (ignored, as XLA's scatter drops them), rows without
    penalties, negative and zero penalties, logits of either sign, +0.0, -0.0 and -inf; each kernel argument's shape
    is checked by name."""
    import jax
    import jax.numpy as jnp

    from jaxpaged.worker import sampler
    from pallas_kernels.cpu_native import available, penalties_native

    if not available("penalties"):
        pytest.skip("the native penalties kernel could not be built")
    rng = np.random.default_rng(5)
    rows, vocab, max_len = 24, 700, 96
    logits = rng.standard_normal((rows, vocab)).astype(np.float32) * 4
    logits[:, :50] = 0.0
    logits[:, 50:60] = -np.inf
    logits[:, 60:70] = -0.0  # kept as -0.0 where no generated token loses anything
    s = sampler.SamplingMetadata.padding(rows, vocab, max_len)
    for r in range(rows):
        n = int(rng.integers(0, max_len + 1))
        s.seen_tokens[r, :n] = rng.integers(0, 80 if r % 2 else vocab, n)  # odd rows: many repeats
        if r % 5 == 3 and n:
            s.seen_tokens[r, rng.integers(0, n)] = vocab + 7  # past the vocabulary
        s.output_start[r] = rng.integers(0, n + 1)
        s.pending_tokens[r] = -1 if r % 3 == 0 else rng.integers(0, 80)
    s.presence_penalty[:] = rng.uniform(-2, 2, rows)
    s.frequency_penalty[:] = rng.uniform(-2, 2, rows)
    s.repetition_penalty[:] = rng.uniform(0.5, 2.0, rows)
    s.presence_penalty[::4], s.frequency_penalty[::4], s.repetition_penalty[::4] = 0.0, 0.0, 1.0  # no penalties
    s.repetition_penalty[1::4] = 1.0  # only presence and frequency
    s.presence_penalty[2::4] = s.frequency_penalty[2::4] = 0.0  # only repetition
    xla, native = (np.asarray(jax.jit(lambda x, s, n=n: sampler._penalize(x, s, n))(jnp.asarray(logits), s))
                   for n in (False, True))
    np.testing.assert_array_equal(native.view(np.int32), xla.view(np.int32))
    changed = (xla != logits).any(axis=-1)
    assert not changed[::4].any() and changed[1::4].any() and changed[2::4].any()
    args = (jnp.asarray(logits), s.seen_tokens, s.output_start, s.pending_tokens, s.presence_penalty,
            s.frequency_penalty, s.repetition_penalty)
    for i, bad, message in ((0, logits.astype(np.float16), "logits must be .S, V. float32"),
                            (1, s.seen_tokens[:3], "seen must have 24 rows"),
                            (1, s.seen_tokens.astype(np.float32), "seen must be int32"),
                            (2, s.output_start[:3], "output_start must be .24."),
                            (6, s.repetition_penalty[None], "repetition must be .24.")):
        with pytest.raises(ValueError, match=message):
            penalties_native(*args[:i], jnp.asarray(bad), *args[i + 1:])
