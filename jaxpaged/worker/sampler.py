"""Sampling on device, one row per sequence, every row independent of the others.

Batch invariance: each row's random numbers come from its own key, derived from the request's seed and the index
of the token being sampled, never from the batch. So a seeded (or greedy) request gives the same tokens alone or
in any batch.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np

from jaxpaged.sampling_params import MAX_LOGIT_BIAS, MAX_LOGPROBS

MAX_BANNED = 8  # EOS / stop token ids masked while a request is below its min_tokens

_FIELDS = ["temperature", "top_p", "top_k", "min_p", "seed_lo", "seed_hi", "step", "want_logprobs", "banned",
           "bitmask", "constrained", "presence_penalty", "frequency_penalty", "repetition_penalty", "seen_tokens",
           "output_start", "pending_tokens", "penalized", "bias_ids", "bias_values"]


@functools.partial(jax.tree_util.register_dataclass, data_fields=_FIELDS, meta_fields=[])
@dataclasses.dataclass
class SamplingMetadata:
    """How each of a step's S sequences samples: numpy on the host (built by `ModelRunner.prepare`), device arrays
    inside the jitted step."""

    temperature: jax.Array  # [S] float32, 0 = greedy
    top_p: jax.Array  # [S] float32, 1 = off
    top_k: jax.Array  # [S] int32, <= 0 = off
    min_p: jax.Array  # [S] float32, 0 = off
    seed_lo: jax.Array  # [S] uint32, low half of the request's 64-bit seed
    seed_hi: jax.Array  # [S] uint32
    step: jax.Array  # [S] int32, index of the token being sampled (folded into the row's key)
    want_logprobs: jax.Array  # [] bool, any row wants log-probs (its chosen token's, and the top-k)
    banned: jax.Array  # [S, MAX_BANNED] int32, token ids that may not be sampled; -1 = none
    # Structured output and bad words: bit j of word i allows token 32 i + j; all ones for a free row.
    bitmask: jax.Array  # [S, ceil(V / 32)] int32
    constrained: jax.Array  # [] bool, any row's bitmask is not all ones
    presence_penalty: jax.Array  # [S] float32, 0 = off
    frequency_penalty: jax.Array  # [S] float32, 0 = off
    repetition_penalty: jax.Array  # [S] float32, 1 = off
    # A penalized row's tokens, prompt then output (-1 = padding); fixed width, so no request changes a shape.
    seen_tokens: jax.Array  # [S, max_model_len] int32
    output_start: jax.Array  # [S] int32, index in seen_tokens of the first generated token
    # A row's last output token when the host did not have it for seen_tokens (asynchronous scheduling: the previous
    # step's, still on its way to the host); -1 = none. Penalties count it as well.
    pending_tokens: jax.Array  # [S] int32
    penalized: jax.Array  # [] bool, any row has a penalty
    bias_ids: jax.Array  # [S, MAX_LOGIT_BIAS] int32, -1 = none
    bias_values: jax.Array  # [S, MAX_LOGIT_BIAS] float32

    @classmethod
    def padding(cls, s: int, vocab_size: int = 0, max_len: int = 0) -> SamplingMetadata:
        """Numpy metadata for S rows that sample freely (greedy); the engine fills the scheduled rows."""
        return cls(
            temperature=np.zeros(s, np.float32), top_p=np.ones(s, np.float32), top_k=np.full(s, -1, np.int32),
            min_p=np.zeros(s, np.float32), seed_lo=np.zeros(s, np.uint32), seed_hi=np.zeros(s, np.uint32),
            step=np.zeros(s, np.int32), want_logprobs=np.array(False),
            banned=np.full((s, MAX_BANNED), -1, np.int32),
            bitmask=np.full((s, (vocab_size + 31) // 32), -1, np.int32), constrained=np.array(False),
            presence_penalty=np.zeros(s, np.float32), frequency_penalty=np.zeros(s, np.float32),
            repetition_penalty=np.ones(s, np.float32), seen_tokens=np.full((s, max_len), -1, np.int32),
            output_start=np.zeros(s, np.int32), pending_tokens=np.full(s, -1, np.int32), penalized=np.array(False),
            bias_ids=np.full((s, MAX_LOGIT_BIAS), -1, np.int32), bias_values=np.zeros((s, MAX_LOGIT_BIAS), np.float32))


@functools.partial(jax.tree_util.register_dataclass,
                   data_fields=["logprobs", "ranks", "top_ids", "top_logprobs"], meta_fields=[])
@dataclasses.dataclass
class TokenLogprobs:
    """What a step gives back for tokens whose log-probs were asked for (the sampled ones, a verifying step's emitted
    ones, a scored prompt's), under the model's distribution before any processing. `...` is the tokens' shape:
    [S] for a sampling step, [S, K + 1] for a verifying one, [T] for a scoring one."""

    logprobs: jax.Array  # [...] float32: each token's log-prob
    # [...] int32: how many tokens of the vocabulary have a logit at or above the token's, itself included (vLLM's
    # rank: 1 is the most likely; tokens tied with it count as ahead)
    ranks: jax.Array
    top_ids: jax.Array  # [..., MAX_LOGPROBS] int32: the most likely tokens, most likely first
    top_logprobs: jax.Array  # [..., MAX_LOGPROBS] float32: their log-probs

    @classmethod
    def zeros(cls, lead: tuple[int, ...]) -> TokenLogprobs:
        """What a step gives when no row asked for log-probs."""
        top = (*lead, MAX_LOGPROBS)
        return cls(jnp.zeros(lead, jnp.float32), jnp.zeros(lead, jnp.int32), jnp.zeros(top, jnp.int32),
                   jnp.zeros(top, jnp.float32))

    def on_host(self, n: int | None = None) -> TokenLogprobs:
        """The first n rows (all of them: None) as numpy arrays."""
        return TokenLogprobs(*(np.asarray(x)[:n] for x in (self.logprobs, self.ranks, self.top_ids,
                                                            self.top_logprobs)))

    def copy_to_host_async(self) -> None:
        for x in (self.logprobs, self.ranks, self.top_ids, self.top_logprobs):
            x.copy_to_host_async()


@functools.partial(jax.tree_util.register_dataclass, data_fields=["tokens", "lp"], meta_fields=[])
@dataclasses.dataclass
class SamplerOutput:
    tokens: jax.Array  # [S] int32
    lp: TokenLogprobs  # of the chosen tokens (zeros unless want_logprobs)


def _first_max(x: jax.Array) -> jax.Array:
    """Index of the first maximum of each row, as two plain reductions. x [S, N] -> [S] int32 in [0, N)."""
    n = x.shape[-1]
    top = jnp.max(x, axis=-1, keepdims=True)
    return jnp.minimum(jnp.min(jnp.where(x == top, jnp.arange(n, dtype=jnp.int32), n), axis=-1), n - 1)


def _argmax(x: jax.Array, native: bool = False, width: int = 128) -> jax.Array:
    """jnp.argmax(x, axis=-1) (the first maximum) in chunks of `width` tokens: the first chunk holding the row's
    maximum, then the first maximum inside that chunk. Comparing the whole row with its broadcast maximum (XLA CPU
    materialises that broadcast inside the step) or XLA's fused value-and-index reduce costs several times more
    (benchmarks/step_anatomy.py's sampler column); XLA still reads the rows twice (it folds the chunks' maximum
    into the second reduction), so with `native` (a step whose matmuls run natively on CPU) the native kernel does
    it in one pass (`pallas_kernels.cpu_native.argmax_native`). x [S, V] float32 -> [S] int32; a row holding a NaN
    gives some index in [0, V)."""
    if native:
        from pallas_kernels import cpu_native

        if cpu_native.available("argmax"):
            return cpu_native.argmax_native(x)
    num_rows, vocab = x.shape
    pad = -vocab % width
    blocks = jnp.pad(x, ((0, 0), (0, pad)), constant_values=-jnp.inf).reshape(num_rows, -1, width)  # [S, C, W]
    chunk = _first_max(jnp.max(blocks, axis=-1))  # [S]
    inside = _first_max(jnp.take_along_axis(blocks, chunk[:, None, None], axis=1)[:, 0])  # [S]
    return jnp.minimum(chunk * width + inside, vocab - 1)


def logprobs(logits: jax.Array, tokens: jax.Array, native: bool = False) -> TokenLogprobs:
    """The log-probs a step returns, under the model's distribution: logits [..., V] float32, tokens [...] int32 (each
    row's sampled token) -> the tokens' log-probs and ranks, the MAX_LOGPROBS most likely tokens and their log-probs.

    A log-prob is (logit - max) - log(sum(exp(logit - max))) (jax.nn.log_softmax's formula); the top tokens are
    jax.lax.top_k of the logits, so no [..., V] log-probs are written; a rank counts the logits at or above the
    token's. With `native` (a step whose matmuls run natively on CPU) all of it comes from the native kernel in two
    passes over each row (`pallas_kernels.cpu_native.logprobs_native`: the same tokens and ranks; the sum in float64,
    so the log-probs within ~1e-5 of XLA's float32 sum's)."""
    lead, vocab = logits.shape[:-1], logits.shape[-1]
    if native:
        from pallas_kernels import cpu_native

        if cpu_native.available("logprobs"):
            chosen, ranks, vals, ids = cpu_native.logprobs_native(logits.reshape(-1, vocab), tokens.reshape(-1),
                                                                  MAX_LOGPROBS)
            return TokenLogprobs(chosen.reshape(lead), ranks.reshape(lead), ids.reshape(*lead, -1),
                                 vals.reshape(*lead, -1))
    chosen_logit = jnp.take_along_axis(logits, tokens[..., None], axis=-1)  # [..., 1]
    ranks = jnp.sum(logits >= chosen_logit, axis=-1, dtype=jnp.int32)
    top = jnp.max(logits, axis=-1, keepdims=True)
    lse = jnp.log(jnp.sum(jnp.exp(logits - top), axis=-1, keepdims=True))
    vals, ids = jax.lax.top_k(logits, MAX_LOGPROBS)
    return TokenLogprobs(((chosen_logit - top) - lse)[..., 0], ranks, ids.astype(jnp.int32), (vals - top) - lse)


def _row_keys(seed_lo: jax.Array, seed_hi: jax.Array, step: jax.Array) -> jax.Array:
    def one(lo, hi, s):
        key = jax.random.fold_in(jax.random.key(lo), hi)
        return jax.random.fold_in(key, s)

    return jax.vmap(one)(seed_lo, seed_hi, step)


def _gumbel(keys: jax.Array, vocab: int) -> jax.Array:
    """Standard Gumbel noise, one row of `vocab` per key: keys [N] -> [N, V] float32. argmax(logits + noise) draws
    from softmax(logits); the speculative verifier (jaxpaged.worker.rejection_sampler) draws with the same noise."""
    return jax.vmap(lambda k: jax.random.gumbel(k, (vocab,), jnp.float32))(keys)


def _draw(x: jax.Array, keys: jax.Array, native: bool = False) -> jax.Array:
    """One token per row drawn from softmax(x) by the Gumbel-max trick: argmax(x + `_gumbel` noise of the row's key).
    x [N, V] float32, keys [N] -> [N] int32. With `native` (a step whose matmuls run natively on CPU) the native
    kernel draws the same noise, bit for bit, and its argmax in one pass without writing the noise
    (`pallas_kernels.cpu_native.gumbel_argmax_native`); only for JAX's default keys (threefry2x32, partitionable
    bits), whose bits it reproduces."""
    if native and str(jax.random.key_impl(keys)) == "threefry2x32" and jax.config.jax_threefry_partitionable:
        from pallas_kernels import cpu_native

        if cpu_native.available("gumbel"):
            return cpu_native.gumbel_argmax_native(x, jax.random.key_data(keys))
    return _argmax(x + _gumbel(keys, x.shape[-1]), native)


def _filter(logits: jax.Array, top_k: jax.Array, top_p: jax.Array, min_p: jax.Array,
            native: bool = False) -> jax.Array:
    """Masks (to -inf) tokens outside top-k, the top-p nucleus and the min-p floor. logits [S, V] float32.

    The kept tokens are those at or above a threshold value per row: the value of the last token of the top-k and
    top-p prefix of the row sorted in descending order (the nucleus is the smallest prefix whose mass reaches p, the
    first token always), raised to the min-p floor. On a CPU, XLA's sort of the vocabulary costs ~10 ms a row (16
    rows of SmolLM2's 49152 tokens: 8x the step), so there the threshold is searched for instead
    (`_threshold_by_search`), or with `native` (a step whose matmuls run natively on CPU) found by the native kernel's
    radix select (`pallas_kernels.cpu_native.top_p_threshold_native`); elsewhere the rows are sorted
    (`_threshold_by_sort`: a GPU's radix sort). They differ only where a prefix's mass is within float32 rounding of
    p (their sums run in other orders)."""
    vocab = logits.shape[-1]
    k = jnp.where(top_k <= 0, vocab, jnp.minimum(top_k, vocab))
    threshold = None
    if native:
        from pallas_kernels import cpu_native

        if cpu_native.available("top_p"):
            threshold = cpu_native.top_p_threshold_native(logits, k, top_p)[:, None]
    if threshold is None:
        threshold = jax.lax.platform_dependent(logits, k, top_p, cpu=_threshold_by_search,
                                               default=_threshold_by_sort)
    # min-p: tokens whose probability is below min_p times the top token's.
    floor = jnp.max(logits, axis=-1, keepdims=True) + jnp.log(jnp.maximum(min_p, 1e-30))[:, None]
    threshold = jnp.where(min_p[:, None] > 0, jnp.maximum(threshold, floor), threshold)
    return jnp.where(logits >= threshold, logits, -jnp.inf)


def _threshold_by_sort(logits: jax.Array, k: jax.Array, top_p: jax.Array) -> jax.Array:
    """`_filter`'s top-k / top-p threshold [S, 1] from the rows sorted: logits [S, V], k [S] in [1, V], top_p [S]."""
    vocab = logits.shape[-1]
    sorted_logits = jnp.sort(logits, axis=-1)[:, ::-1]  # [S, V] descending
    kth = jnp.take_along_axis(sorted_logits, (k - 1)[:, None], axis=-1)  # [S, 1]
    probs = jax.nn.softmax(sorted_logits, axis=-1)
    mass_before = jnp.cumsum(probs, axis=-1) - probs
    # top_p == 1 keeps everything exactly: rounding in the cumulative sum must not drop a row's tail tokens just
    # because another row of the batch turned filtering on.
    in_nucleus = (mass_before < top_p[:, None]) | (top_p[:, None] >= 1.0)
    keep_sorted = in_nucleus & (jnp.arange(vocab)[None, :] < k[:, None])
    num_keep = jnp.maximum(jnp.sum(keep_sorted, axis=-1), 1)
    threshold = jnp.take_along_axis(sorted_logits, (num_keep - 1)[:, None], axis=-1)
    return jnp.maximum(threshold, kth)


def _sortable(x: jax.Array) -> jax.Array:
    """float32 -> int32 keys in the floats' order (a float's bits, the negative ones' magnitude bits flipped)."""
    bits = jax.lax.bitcast_convert_type(x, jnp.int32)
    return jnp.where(bits < 0, bits ^ jnp.int32(0x7FFFFFFF), bits)


def _threshold_by_search(logits: jax.Array, k: jax.Array, top_p: jax.Array) -> jax.Array:
    """`_threshold_by_sort`'s threshold without a sort: a bisection over the float32 keys (`_sortable`) for the
    smallest key t at which fewer than k tokens lie above t and their mass is below p (both hold from the row's
    maximum up, so the first key that passes is the last kept token's). 32 halvings of the key range, each a pass
    over the row; the threshold is then the smallest logit at or above t."""
    probs = jax.nn.softmax(logits, axis=-1)
    keys = _sortable(logits)  # [S, V]
    everything = top_p >= 1.0  # as `_threshold_by_sort`: no rounding of the mass drops a tail token

    def search(count: bool):
        def halve(_, bounds):
            lo, hi = bounds  # [S]: the answer lies in [lo, hi]
            mid = (lo >> 1) + (hi >> 1) + (lo & hi & 1)  # floor((lo + hi) / 2) without overflow
            above = keys > mid[:, None]
            passes = (jnp.sum(jnp.where(above, probs, 0.0), axis=-1) < top_p) | everything
            if count:
                passes &= jnp.sum(above, axis=-1) < k
            return jnp.where(passes, lo, mid + 1), jnp.where(passes, mid, hi)

        return lambda: jax.lax.fori_loop(0, 32, halve, (jnp.min(keys, axis=-1), jnp.max(keys, axis=-1)))[1]

    # (counting the tokens above costs a second pass over the rows: only when a row asks for top-k)
    t = jax.lax.cond(jnp.any(k < logits.shape[-1]), search(True), search(False))
    return jnp.min(jnp.where(keys >= t[:, None], logits, jnp.inf), axis=-1, keepdims=True)


def _scale_and_filter(logits: jax.Array, temperature: jax.Array, top_k: jax.Array, top_p: jax.Array,
                      min_p: jax.Array, native: bool = False) -> jax.Array:
    """The sampled rows' distribution as logits: divided by the temperature (greedy rows, temperature <= 0, left as
    they are), then top-k / top-p / min-p, which are skipped when no sampled row asks for them. logits [N, V]
    float32, the parameters [N]."""
    greedy = temperature <= 0.0
    scaled = logits / jnp.where(greedy, 1.0, temperature)[:, None]
    needs_filter = jnp.any(~greedy & ((top_k > 0) | (top_p < 1.0) | (min_p > 0.0)))
    return jax.lax.cond(needs_filter, lambda x: _filter(x, top_k, top_p, min_p, native), lambda x: x, scaled)


def _penalize(logits: jax.Array, s: SamplingMetadata, native: bool = False) -> jax.Array:
    """Repetition (HF: on prompt and output), frequency and presence (OpenAI: on output) penalties, from the rows'
    token counts built here (seen_tokens, and pending_tokens where the host lacked the last one). logits [S, V]
    float32. With `native`, the native CPU kernel gives the same bits visiting only each row's seen tokens
    (`pallas_kernels.cpu_native.penalties_native`); XLA builds dense [S, V] counts."""
    if native:
        from pallas_kernels import cpu_native

        if cpu_native.available("penalties"):
            return cpu_native.penalties_native(logits, s.seen_tokens, s.output_start, s.pending_tokens,
                                               s.presence_penalty, s.frequency_penalty, s.repetition_penalty)
    num_rows, vocab = logits.shape
    rows = jnp.arange(num_rows)[:, None]
    seen = s.seen_tokens  # [S, L]
    valid = seen >= 0
    ids = jnp.maximum(seen, 0)
    is_output = valid & (jnp.arange(seen.shape[1])[None, :] >= s.output_start[:, None])
    counts = jnp.zeros((num_rows, vocab), jnp.float32).at[rows, ids].add(is_output.astype(jnp.float32))
    anywhere = jnp.zeros((num_rows, vocab), jnp.bool_).at[rows, ids].max(valid)
    pending = s.pending_tokens >= 0  # [S] an output token the host had not seen yet
    last = jnp.maximum(s.pending_tokens, 0)
    counts = counts.at[rows[:, 0], last].add(pending.astype(jnp.float32))
    anywhere = anywhere.at[rows[:, 0], last].max(pending)
    rep = s.repetition_penalty[:, None]
    # times the reciprocal, as XLA rewrites a division by a broadcast anyway (and the native kernel does)
    logits = jnp.where(anywhere, jnp.where(logits > 0, logits * (1.0 / rep), logits * rep), logits)
    # only generated tokens lose anything (subtracting a zero would turn a -0.0 logit into +0.0 where the native
    # kernel, which visits only seen tokens, leaves it)
    lose = s.frequency_penalty[:, None] * counts + s.presence_penalty[:, None]
    return jnp.where(counts > 0, logits - lose, logits)


def _apply_bitmask(logits: jax.Array, bitmask: jax.Array) -> jax.Array:
    """-inf where a row's bit is clear. logits [S, V] float32, bitmask [S, W] int32 (tokens past 32 W allowed)."""
    num_rows, vocab = logits.shape
    bits = (bitmask[:, :, None] >> jnp.arange(32, dtype=jnp.int32)) & 1  # [S, W, 32]
    allowed = bits.reshape(num_rows, -1)[:, :vocab] != 0
    allowed = jnp.pad(allowed, ((0, 0), (0, vocab - allowed.shape[1])), constant_values=True)
    return jnp.where(allowed, logits, -jnp.inf)


def process_logits(logits: jax.Array, s: SamplingMetadata, native: bool = False) -> jax.Array:
    """What a request asks of its logits before sampling: penalties, logit_bias, the structured-output / bad-words
    bitmask and the min_tokens bans. logits [S, V] float32; native: the penalties by the native CPU kernel."""
    rows = jnp.arange(logits.shape[0])[:, None]
    banned = s.banned
    logits = jax.lax.cond(s.penalized, lambda x: _penalize(x, s, native), lambda x: x, logits)
    logits = logits.at[rows, jnp.maximum(s.bias_ids, 0)].add(jnp.where(s.bias_ids >= 0, s.bias_values, 0.0))
    logits = jax.lax.cond(s.constrained, lambda x: _apply_bitmask(x, s.bitmask), lambda x: x, logits)
    return logits.at[rows, jnp.maximum(banned, 0)].min(jnp.where(banned >= 0, -jnp.inf, jnp.inf))


def _pick(logits: jax.Array, s: SamplingMetadata, native: bool) -> jax.Array:
    """One token per row of processed logits [S, V] float32 -> [S] int32: the argmax for greedy rows, a Gumbel-max
    draw from the temperature-scaled, filtered distribution for the others.

    Greedy rows pay for no randomness: a step whose rows are all greedy scales, filters and draws nothing over the
    vocabulary. Each row's result is the same either way (its noise comes from its own key), so batch invariance
    holds."""
    greedy = s.temperature <= 0.0

    def draw(x):
        scaled = _scale_and_filter(x, s.temperature, s.top_k, s.top_p, s.min_p, native)
        return _draw(scaled, _row_keys(s.seed_lo, s.seed_hi, s.step), native)

    sampled = jax.lax.cond(jnp.any(~greedy), draw, lambda x: jnp.zeros(x.shape[0], jnp.int32), logits)
    return jnp.where(greedy, _argmax(logits, native), sampled).astype(jnp.int32)


def greedy(logits: jax.Array, native: bool = False) -> SamplerOutput:
    """`sample`'s output for rows that are all greedy and ask for nothing else (no processing, no log-probs): each
    row's argmax, the same token `sample` picks for them, with no conditional (on a GPU every `lax.cond` makes the
    host wait for the device, see jaxpaged.worker.step). logits [S, V] float32."""
    return SamplerOutput(_argmax(logits, native).astype(jnp.int32), TokenLogprobs.zeros(logits.shape[:1]))


def sample(logits: jax.Array, s: SamplingMetadata, native: bool = False) -> SamplerOutput:
    """Picks one token per row. logits [S, V] float32. Log-probs are the model's (before any processing). native:
    the argmaxes, penalties, top-k / top-p thresholds, Gumbel draws and log-probs by the native CPU kernels, for
    steps whose matmuls run natively (the same tokens but where a top-p prefix's mass is within rounding of p; the
    log-probs within ~1e-5, see `logprobs`).

    Only the [S] tokens leave the conditionals: a step where no row asks for processing picks from the logits as they
    are, and one where no row wants log-probs computes no log-softmax, without copying the [S, V] block."""
    raw = logits
    asked = s.penalized | s.constrained | jnp.any(s.bias_ids >= 0) | jnp.any(s.banned >= 0)
    tokens = jax.lax.cond(asked, lambda x: _pick(process_logits(x, s, native), s, native),
                          lambda x: _pick(x, s, native), logits)

    lp = jax.lax.cond(s.want_logprobs, lambda x: logprobs(x, tokens, native),
                      lambda x: TokenLogprobs.zeros(x.shape[:1]), raw)
    return SamplerOutput(tokens, lp)
