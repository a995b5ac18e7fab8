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

from jaxpaged.sampling_params import MAX_LOGPROBS

MAX_BANNED = 8  # EOS / stop token ids masked while a request is below its min_tokens


@functools.partial(
    jax.tree_util.register_dataclass,
    data_fields=["temperature", "top_p", "top_k", "min_p", "seed_lo", "seed_hi", "step", "want_logprobs", "banned"],
    meta_fields=[])
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
    want_logprobs: jax.Array  # [] bool, any row wants top-k log-probs
    banned: jax.Array  # [S, MAX_BANNED] int32, token ids that may not be sampled; -1 = none


@functools.partial(jax.tree_util.register_dataclass,
                   data_fields=["tokens", "logprobs", "top_ids", "top_logprobs"], meta_fields=[])
@dataclasses.dataclass
class SamplerOutput:
    tokens: jax.Array  # [S] int32
    logprobs: jax.Array  # [S] float32, of the chosen token under the model's distribution
    top_ids: jax.Array  # [S, MAX_LOGPROBS] int32 (zeros unless want_logprobs)
    top_logprobs: jax.Array  # [S, MAX_LOGPROBS] float32


def _row_keys(seed_lo: jax.Array, seed_hi: jax.Array, step: jax.Array) -> jax.Array:
    def one(lo, hi, s):
        key = jax.random.fold_in(jax.random.key(lo), hi)
        return jax.random.fold_in(key, s)

    return jax.vmap(one)(seed_lo, seed_hi, step)


def _filter(logits: jax.Array, top_k: jax.Array, top_p: jax.Array, min_p: jax.Array) -> jax.Array:
    """Masks (to -inf) tokens outside top-k, the top-p nucleus and the min-p floor. logits [S, V] float32."""
    vocab = logits.shape[-1]
    sorted_logits = jnp.sort(logits, axis=-1)[:, ::-1]  # [S, V] descending
    # top-k: the k-th largest value is the threshold; k <= 0 disables.
    k = jnp.where(top_k <= 0, vocab, jnp.minimum(top_k, vocab))
    kth = jnp.take_along_axis(sorted_logits, (k - 1)[:, None], axis=-1)  # [S, 1]
    # top-p: keep the smallest prefix of the sorted distribution whose mass reaches p (the first token always).
    probs = jax.nn.softmax(sorted_logits, axis=-1)
    mass_before = jnp.cumsum(probs, axis=-1) - probs
    # top_p == 1 keeps everything exactly: rounding in the cumulative sum must not drop a row's tail tokens just
    # because another row of the batch turned filtering on.
    in_nucleus = (mass_before < top_p[:, None]) | (top_p[:, None] >= 1.0)
    keep_sorted = in_nucleus & (jnp.arange(vocab)[None, :] < k[:, None])
    num_keep = jnp.maximum(jnp.sum(keep_sorted, axis=-1), 1)
    threshold = jnp.take_along_axis(sorted_logits, (num_keep - 1)[:, None], axis=-1)
    threshold = jnp.maximum(threshold, kth)
    # min-p: tokens whose probability is below min_p times the top token's.
    floor = sorted_logits[:, :1] + jnp.log(jnp.maximum(min_p, 1e-30))[:, None]
    threshold = jnp.where(min_p[:, None] > 0, jnp.maximum(threshold, floor), threshold)
    return jnp.where(logits >= threshold, logits, -jnp.inf)


def sample(logits: jax.Array, s: SamplingMetadata) -> SamplerOutput:
    """Picks one token per row. logits [S, V] float32."""
    rows = jnp.arange(logits.shape[0])[:, None]
    banned = s.banned
    logits = logits.at[rows, jnp.maximum(banned, 0)].min(jnp.where(banned >= 0, -jnp.inf, jnp.inf))
    greedy = s.temperature <= 0.0
    temp = jnp.where(greedy, 1.0, s.temperature)
    scaled = logits / temp[:, None]
    needs_filter = jnp.any(~greedy & ((s.top_k > 0) | (s.top_p < 1.0) | (s.min_p > 0.0)))
    scaled = jax.lax.cond(needs_filter, lambda x: _filter(x, s.top_k, s.top_p, s.min_p), lambda x: x, scaled)
    keys = _row_keys(s.seed_lo, s.seed_hi, s.step)
    gumbel = jax.vmap(lambda k: jax.random.gumbel(k, (logits.shape[-1],), jnp.float32))(keys)
    sampled = jnp.argmax(scaled + gumbel, axis=-1)
    tokens = jnp.where(greedy, jnp.argmax(logits, axis=-1), sampled).astype(jnp.int32)

    logp = jax.nn.log_softmax(logits, axis=-1)
    chosen = jnp.take_along_axis(logp, tokens[:, None], axis=-1)[:, 0]

    def top(lp):
        vals, ids = jax.lax.top_k(lp, MAX_LOGPROBS)
        return ids.astype(jnp.int32), vals

    def no_top(lp):
        n = lp.shape[0]
        return jnp.zeros((n, MAX_LOGPROBS), jnp.int32), jnp.zeros((n, MAX_LOGPROBS), jnp.float32)

    top_ids, top_lps = jax.lax.cond(s.want_logprobs, top, no_top, logp)
    return SamplerOutput(tokens, chosen, top_ids, top_lps)
