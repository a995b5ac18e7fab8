"""Verification of proposed tokens on device: pure JAX, jittable, fixed shapes, every row independent of the others.

A speculating sequence s scored k + 1 query tokens in one target step (its last token, then its n_s <= k proposals),
so the target's logits at position j are its next-token distribution after the first j proposals. This module
decides how many proposals each row keeps and which token follows them:

    out = rejection_sample(target_logits, draft_tokens, num_draft, draft_probs, temperature=..., top_k=...,
                           top_p=..., min_p=..., seed_lo=..., seed_hi=..., step=...)
    out.tokens        [S, k + 1] int32: the accepted proposals, then the target's token, then -1
    out.num_accepted  [S] int32 in 0..num_draft: so a row emits num_accepted + 1 tokens

Greedy rows (temperature <= 0) accept while the proposal equals the target's argmax and then emit the argmax, so
they emit exactly the tokens of non-speculative greedy decoding over the same logits.

Sampled rows follow Leviathan et al. 2023 / Chen et al. 2023: p is the target's distribution after temperature and
top-k / top-p / min-p (`jaxpaged.worker.sampler`'s own scaling and filter), q the proposer's. Proposal d at position
j is accepted with probability min(1, p(d) / q(d)); the first rejected position emits a draw from
normalize(max(0, p - q)); when every proposal is accepted, the bonus token is a draw from p at the last position.
Each emitted token is then distributed exactly as p given the tokens before it.

Randomness comes from (seed, token index), never from the batch: position j of a row uses the key the plain sampler
would use for that row's token step + j (`sampler._row_keys`), and its Gumbel noise for draws (`sampler._draw`).
So a row with no proposals emits exactly the token `sampler.sample` would, and a seeded row gives the same tokens
alone or in any batch.

draft_probs=None is a deterministic proposer (n-gram): q is one-hot at the proposal, so the rule above accepts d with
probability p(d) and otherwise draws from p without d. Drawing the target's own token at position j with the
plain sampler's noise and accepting d when they agree does exactly that, and it makes speculation invisible: the
emitted tokens are the ones non-speculative sampling would have drawn, position by position (the same seed gives
the same text with and without speculation, given the same logits). With a draft model's q, acceptance uses a
uniform from the position's key folded with `_ACCEPT_STREAM`, and the token after the last accepted proposal
(correction or bonus) uses the position's Gumbel noise.

What this does not apply: penalties, logit bias, bans and grammar bitmasks (`sampler.process_logits`) depend on the
tokens before each position, so the caller either processes each position's logits with its own context first or
leaves such rows to one token per step. `draft_probs` must be the distribution the proposals were drawn from, after
the same temperature and filters.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp

from jaxpaged.worker.sampler import _argmax, _draw, _row_keys, _scale_and_filter

_ACCEPT_STREAM = 0x5EC0DE  # folded into a position's key for its acceptance uniform (its Gumbel noise uses the key)


@functools.partial(jax.tree_util.register_dataclass, data_fields=["tokens", "num_accepted"], meta_fields=[])
@dataclasses.dataclass
class VerifyOutput:
    tokens: jax.Array  # [S, k + 1] int32: accepted proposals, the target's token after them, then -1
    num_accepted: jax.Array  # [S] int32, proposals kept (the row emits num_accepted + 1 tokens)


def rejection_sample(target_logits: jax.Array, draft_tokens: jax.Array, num_draft: jax.Array,
                     draft_probs: jax.Array | None, *, temperature: jax.Array, top_k: jax.Array, top_p: jax.Array,
                     min_p: jax.Array, seed_lo: jax.Array, seed_hi: jax.Array, step: jax.Array,
                     native: bool = False) -> VerifyOutput:
    """Verifies S rows of up to k proposals each.

    target_logits [S, k + 1, V] float32: position j is the target's next-token logits after the row's first j
      proposals (processed for penalties etc. by the caller if the row has any)
    draft_tokens [S, k] int32: the proposals; entries at j >= num_draft[s] are ignored
    num_draft [S] int32 in 0..k: how many proposals row s made
    draft_probs [S, k, V] float32 or None: the distribution each proposal was drawn from; None for a deterministic
      proposer (one-hot q, e.g. n-gram)
    temperature [S] float32 (<= 0: greedy), top_k [S] int32 (<= 0: off), top_p [S] float32 (1: off),
    min_p [S] float32 (0: off), seed_lo, seed_hi [S] uint32 (the request's seed halves), step [S] int32 (the index
      of the row's first token being sampled: position j samples token step + j)
    native: argmaxes, top-k / top-p thresholds and Gumbel draws by the native CPU kernels (the same tokens but where a
      top-p prefix's mass is within rounding of p; for steps whose matmuls run natively)."""
    num_rows, width, vocab = target_logits.shape  # width = k + 1
    k = width - 1
    if draft_tokens.shape != (num_rows, k):
        raise ValueError(f"draft_tokens has shape {draft_tokens.shape}, expected {(num_rows, k)} from target_logits "
                         f"{target_logits.shape}")
    if draft_probs is not None and draft_probs.shape != (num_rows, k, vocab):
        raise ValueError(f"draft_probs has shape {draft_probs.shape}, expected {(num_rows, k, vocab)}")
    greedy = temperature <= 0.0  # [S]
    positions = jnp.arange(width, dtype=jnp.int32)  # [k + 1]
    proposed = jnp.arange(k)[None, :] < num_draft[:, None]  # [S, k]
    drafts = jnp.where(proposed, draft_tokens, -1).astype(jnp.int32)  # [S, k], -1 where nothing was proposed
    flat = target_logits.reshape(num_rows * width, vocab)  # [S (k + 1), V], row s's positions together

    def per_position(x):  # [S] -> [S (k + 1)], each row's value at each of its positions
        return jnp.repeat(x, width)

    steps = (step[:, None] + positions[None, :]).reshape(-1)  # [S (k + 1)] token index sampled at each position
    target_argmax = _argmax(flat, native).reshape(num_rows, width)  # [S, k + 1]

    def filtered():  # [S (k + 1), V] the sampled rows' p as logits (greedy rows: their logits unscaled)
        return _scale_and_filter(flat, per_position(temperature), per_position(top_k), per_position(top_p),
                                 per_position(min_p), native)

    if draft_probs is None or k == 0:  # (with no proposals at all, q plays no part)
        def draw(_):  # the token the plain sampler would draw at every position
            keys = _row_keys(per_position(seed_lo), per_position(seed_hi), steps)
            return _draw(filtered(), keys, native).reshape(num_rows, width)

        sampled = jax.lax.cond(jnp.any(~greedy), draw, lambda _: jnp.zeros((num_rows, width), jnp.int32), None)
        target = jnp.where(greedy[:, None], target_argmax, sampled)  # [S, k + 1]
        num_accepted = _leading_true(drafts == target[:, :k])
        # Accepted proposals equal the target's tokens, so the row emits the target's tokens up to the first miss.
        tokens = jnp.where(positions[None, :] <= num_accepted[:, None], target, -1)
        return VerifyOutput(tokens.astype(jnp.int32), num_accepted)

    def verify_sampled(_):  # (num_accepted [S], final token [S]) of every row as if it were sampled
        logits = filtered().reshape(num_rows, width, vocab)  # [S, k + 1, V]
        lse = jax.nn.logsumexp(logits, axis=-1)  # [S, k + 1]
        safe = jnp.maximum(drafts, 0)[..., None]  # [S, k, 1]
        p_draft = jnp.exp(jnp.take_along_axis(logits[:, :k], safe, axis=-1)[..., 0] - lse[:, :k])  # [S, k]
        q_draft = jnp.take_along_axis(draft_probs, safe, axis=-1)[..., 0]  # [S, k]
        keys = _row_keys(per_position(seed_lo), per_position(seed_hi), steps).reshape(num_rows, width)
        uniform = jax.vmap(jax.vmap(lambda key: jax.random.uniform(jax.random.fold_in(key, _ACCEPT_STREAM))))(
            keys[:, :k])  # [S, k] in [0, 1)
        # u < p / q, written without the division: q = 0 (a proposal its own q could not give) is accepted iff p > 0
        accepted = _leading_true(proposed & (uniform * q_draft < p_draft))  # [S]
        # The token after the accepted proposals, at position a = accepted: a correction from max(0, p - q) if the
        # row proposed a token there, else the bonus from p; both with position a's Gumbel noise.
        at = accepted[:, None, None]
        row_logits = jnp.take_along_axis(logits, at, axis=1)[:, 0]  # [S, V]
        row_p = jnp.exp(row_logits - jnp.take_along_axis(lse, at[..., 0], axis=1))  # [S, V]
        row_q = jnp.take_along_axis(draft_probs, jnp.minimum(at, k - 1), axis=1)[:, 0]  # [S, V]
        residual = jnp.maximum(row_p - row_q, 0.0)
        # p ~= q in float32 can leave no mass; then p itself (the case has probability ~0 but must not emit junk)
        residual = jnp.where(jnp.sum(residual, axis=-1, keepdims=True) > 0, residual, row_p)
        corrected = accepted < num_draft
        choice = jnp.where(corrected[:, None], jnp.log(residual), row_logits)
        return accepted, _draw(choice, jnp.take_along_axis(keys, accepted[:, None], axis=1)[:, 0], native)

    def nothing_sampled(_):
        return jnp.zeros(num_rows, jnp.int32), jnp.zeros(num_rows, jnp.int32)

    sampled_accepted, sampled_final = jax.lax.cond(jnp.any(~greedy), verify_sampled, nothing_sampled, None)
    greedy_accepted = _leading_true(drafts == target_argmax[:, :k])
    greedy_final = jnp.take_along_axis(target_argmax, greedy_accepted[:, None], axis=1)[:, 0]
    num_accepted = jnp.where(greedy, greedy_accepted, sampled_accepted)  # [S]
    final = jnp.where(greedy, greedy_final, sampled_final)  # [S]
    padded = jnp.concatenate([drafts, jnp.full((num_rows, 1), -1, jnp.int32)], axis=1)  # [S, k + 1]
    tokens = jnp.where(positions[None, :] < num_accepted[:, None], padded,
                       jnp.where(positions[None, :] == num_accepted[:, None], final[:, None], -1))
    return VerifyOutput(tokens.astype(jnp.int32), num_accepted.astype(jnp.int32))


def _leading_true(x: jax.Array) -> jax.Array:
    """Number of leading True values of each row: x [S, k] bool -> [S] int32 in 0..k."""
    return jnp.sum(jnp.cumprod(x.astype(jnp.int32), axis=-1), axis=-1).astype(jnp.int32)
