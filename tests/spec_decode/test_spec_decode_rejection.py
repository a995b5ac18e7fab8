"""The verification sampler (`jaxpaged.worker.rejection_sampler`): greedy rows equal argmax decoding, sampled rows emit
the target's distribution at every position (chi-square over many seeded rows on an 8-token vocabulary, with a draft
distribution far from the target's and with an n-gram-style one-hot draft), rows with no proposals equal the plain
sampler token for token, and seeded rows are reproducible and batch-invariant."""

from __future__ import annotations

import dataclasses
import math

import jax
import numpy as np
import pytest

from jaxpaged.worker.rejection_sampler import rejection_sample
from jaxpaged.worker.sampler import SamplingMetadata, sample


def params(num_rows, temperature=0.0, top_k=-1, top_p=1.0, min_p=0.0, seed=0, step=0) -> dict:
    """Per-row sampling arrays; scalars are broadcast, seeds differ per row (seed + row)."""
    def full(value, dtype):
        return np.broadcast_to(np.asarray(value, dtype), (num_rows,)).copy()

    return dict(temperature=full(temperature, np.float32), top_k=full(top_k, np.int32),
                top_p=full(top_p, np.float32), min_p=full(min_p, np.float32),
                seed_lo=(np.uint32(seed) + np.arange(num_rows, dtype=np.uint32)), seed_hi=full(7, np.uint32),
                step=full(step, np.int32))


@jax.jit
def verify_with_q(logits, drafts, num_draft, q, p):
    return rejection_sample(logits, drafts, num_draft, q, **p)


@jax.jit
def verify_one_hot(logits, drafts, num_draft, p):
    return rejection_sample(logits, drafts, num_draft, None, **p)


def verify(logits, drafts, num_draft, q, p):
    out = verify_one_hot(logits, drafts, num_draft, p) if q is None else verify_with_q(logits, drafts, num_draft, q, p)
    return np.asarray(out.tokens), np.asarray(out.num_accepted)


def plain(logits, p) -> np.ndarray:
    """The plain sampler's tokens for logits [S, V] with the same per-row parameters."""
    s = SamplingMetadata.padding(logits.shape[0], logits.shape[1])
    s = dataclasses.replace(s, **{name: value for name, value in p.items()})
    return np.asarray(jax.jit(sample)(logits, s).tokens)


def target_probs(logits, temperature, top_k=-1, top_p=1.0) -> np.ndarray:
    """The target distribution, computed here independently: softmax(logits / T), top-k, then the top-p nucleus
    (smallest prefix of the sorted distribution whose mass reaches top_p), renormalised. logits [V] -> [V]."""
    z = logits.astype(np.float64) / temperature
    probs = np.exp(z - z.max())
    probs /= probs.sum()
    order = np.argsort(-probs, kind="stable")
    keep = np.zeros_like(probs, bool)
    if top_k > 0:
        keep[order[:top_k]] = True
    else:
        keep[:] = True
    mass_before = np.cumsum(probs[order]) - probs[order]
    keep[order[mass_before >= top_p]] = False
    probs = np.where(keep, probs, 0.0)
    return probs / probs.sum()


def assert_distribution(tokens: np.ndarray, probs: np.ndarray, what: str) -> None:
    """Chi-square goodness of fit at p < 1e-4 (Wilson-Hilferty quantile), and no token of probability 0."""
    counts = np.bincount(tokens, minlength=len(probs))
    n = counts.sum()
    support = probs > 0
    assert counts[~support].sum() == 0, f"{what}: emitted tokens the target gives probability 0: {counts}"
    expected = n * probs[support]
    assert expected.min() >= 5, f"{what}: too few samples ({n}) for the test"
    stat = float(((counts[support] - expected) ** 2 / expected).sum())
    df = int(support.sum()) - 1
    z = 3.719  # one-sided normal quantile of 1e-4
    critical = df * (1 - 2 / (9 * df) + z * math.sqrt(2 / (9 * df))) ** 3
    assert stat < critical, f"{what}: chi2={stat:.1f} >= {critical:.1f} (df={df}); counts {counts}, want {expected}"


# Every test below but the statistical ones uses this one shape, so each jitted function compiles once.
ROWS, DEPTH, WIDE = 24, 3, 64  # rows, proposals per row (k), vocabulary

# ------------------------------------------------------------------------------------------------------ greedy


@pytest.mark.parametrize("with_q", [False, True], ids=["one_hot", "draft_probs"])
def test_greedy_rows_accept_while_the_draft_is_the_argmax(with_q):
    rng = np.random.default_rng(0)
    num_rows, k, vocab = ROWS, DEPTH, WIDE
    logits = rng.normal(size=(num_rows, k + 1, vocab)).astype(np.float32)
    argmax = logits.argmax(-1)  # [S, k + 1]
    agree = rng.integers(0, k + 1, size=num_rows)  # the draft equals the argmax at its first `agree` positions
    drafts = argmax[:, :k].copy()
    for s in range(num_rows):
        if agree[s] < k:
            drafts[s, agree[s]] = (argmax[s, agree[s]] + 1 + rng.integers(vocab - 1)) % vocab
    num_draft = rng.integers(0, k + 1, size=num_rows).astype(np.int32)
    q = rng.dirichlet(np.ones(vocab), size=(num_rows, k)).astype(np.float32) if with_q else None
    tokens, accepted = verify(logits, drafts.astype(np.int32), num_draft, q, params(num_rows))
    want = np.minimum(agree, num_draft)
    np.testing.assert_array_equal(accepted, want)
    for s in range(num_rows):
        np.testing.assert_array_equal(tokens[s, :want[s] + 1], argmax[s, :want[s] + 1])
        assert (tokens[s, want[s] + 1:] == -1).all()


def test_greedy_with_filters_is_still_the_argmax():
    rng = np.random.default_rng(1)
    logits = rng.normal(size=(ROWS, DEPTH + 1, WIDE)).astype(np.float32)
    drafts = logits.argmax(-1)[:, :DEPTH].astype(np.int32)
    p = params(ROWS, top_k=3, top_p=0.5, min_p=0.2)
    tokens, accepted = verify(logits, drafts, np.full(ROWS, DEPTH, np.int32), None, p)
    np.testing.assert_array_equal(accepted, DEPTH)
    np.testing.assert_array_equal(tokens, logits.argmax(-1))


# ------------------------------------------------------------------------------------------------------ sampled

VOCAB, K, DRAWS = 8, 3, 100_000


def sampled_case(seed: int):
    rng = np.random.default_rng(seed)
    base = (rng.normal(size=(K + 1, VOCAB)) * 1.5).astype(np.float32)  # the target's logits at each position
    return rng, base


def mixture(rng, probs: np.ndarray, size: int) -> np.ndarray:
    """Draws from half `probs`, half uniform: proposals the target often accepts, and often rejects."""
    vocab = len(probs)
    return rng.choice(vocab, size=size, p=0.5 * probs + 0.5 / vocab)


@pytest.mark.parametrize("filters", [dict(temperature=0.8), dict(temperature=1.3, top_k=5),
                                     dict(temperature=1.0, top_p=0.8)], ids=["temperature", "top_k", "top_p"])
def test_sampled_rows_emit_the_target_distribution_with_a_different_draft(filters):
    rng, base = sampled_case(2)
    want = [target_probs(base[j], filters["temperature"], filters.get("top_k", -1), filters.get("top_p", 1.0))
            for j in range(K + 1)]
    # The draft's q: its own random logits, half mixed with uniform (so it gives mass to tokens p filters out).
    q_rows = np.exp(rng.normal(size=(K, VOCAB)) * 2.0)
    q_rows = 0.5 * q_rows / q_rows.sum(-1, keepdims=True) + 0.5 / VOCAB
    drafts = np.stack([rng.choice(VOCAB, size=DRAWS, p=q_rows[j]) for j in range(K)], axis=1).astype(np.int32)
    logits = np.broadcast_to(base, (DRAWS, K + 1, VOCAB))
    q = np.broadcast_to(q_rows.astype(np.float32), (DRAWS, K, VOCAB))
    tokens, accepted = verify(logits, drafts, np.full(DRAWS, K, np.int32), q, params(DRAWS, seed=11, **filters))
    for j in range(K + 1):
        emitted = tokens[:, j][accepted >= j]  # position j is emitted when the j proposals before it were accepted
        assert_distribution(emitted, want[j], f"position {j}")
    # The first proposal is accepted with probability sum_x min(p(x), q(x)) (Leviathan et al., Theorem 3.5 / 3.8).
    rate = float(np.mean(accepted >= 1))
    expected = float(np.minimum(want[0], q_rows[0]).sum())
    assert abs(rate - expected) < 4 * math.sqrt(expected * (1 - expected) / DRAWS) + 1e-3


def test_sampled_rows_emit_the_target_distribution_with_a_one_hot_draft():
    """An n-gram-style proposer: each row's proposals are fixed tokens (q one-hot), some likely under p, some not;
    rows propose 0..k tokens."""
    rng, base = sampled_case(3)
    want = [target_probs(base[j], 1.0) for j in range(K + 1)]
    drafts = np.stack([mixture(rng, want[j], DRAWS) for j in range(K)], axis=1).astype(np.int32)
    num_draft = rng.integers(0, K + 1, size=DRAWS).astype(np.int32)
    logits = np.broadcast_to(base, (DRAWS, K + 1, VOCAB))
    tokens, accepted = verify(logits, drafts, num_draft, None, params(DRAWS, temperature=1.0, seed=5))
    assert (accepted <= num_draft).all()
    for j in range(K + 1):
        emitted = tokens[:, j][accepted >= j]
        assert_distribution(emitted, want[j], f"position {j}")
    # a one-hot proposal d is accepted with probability p(d)
    for token in range(VOCAB):
        rows = (num_draft >= 1) & (drafts[:, 0] == token)
        rate = float(np.mean(accepted[rows] >= 1))
        assert abs(rate - want[0][token]) < 4 * math.sqrt(want[0][token] * (1 - want[0][token]) / rows.sum()) + 1e-3


# ---------------------------------------------------------------------------------------- plain sampling, seeds


def mixed_params(num_rows: int, seed: int = 0, step: int = 3) -> dict:
    """Greedy rows, plain temperature rows, and rows with each filter."""
    p = params(num_rows, seed=seed, step=step)
    kinds = np.arange(num_rows) % 5
    p["temperature"] = np.where(kinds == 0, 0.0, np.where(kinds == 1, 0.7, 1.2)).astype(np.float32)
    p["top_k"] = np.where(kinds == 2, 4, -1).astype(np.int32)
    p["top_p"] = np.where(kinds == 3, 0.7, 1.0).astype(np.float32)
    p["min_p"] = np.where(kinds == 4, 0.1, 0.0).astype(np.float32)
    return p


@pytest.mark.parametrize("with_q", [False, True], ids=["one_hot", "draft_probs"])
def test_rows_without_proposals_are_plain_sampling(with_q):
    rng = np.random.default_rng(4)
    num_rows, k, vocab = ROWS, DEPTH, WIDE
    logits = (rng.normal(size=(num_rows, k + 1, vocab)) * 2).astype(np.float32)
    drafts = rng.integers(0, vocab, size=(num_rows, k)).astype(np.int32)  # ignored: nothing proposed
    q = rng.dirichlet(np.ones(vocab), size=(num_rows, k)).astype(np.float32) if with_q else None
    p = mixed_params(num_rows)
    tokens, accepted = verify(logits, drafts, np.zeros(num_rows, np.int32), q, p)
    np.testing.assert_array_equal(accepted, 0)
    np.testing.assert_array_equal(tokens[:, 0], plain(logits[:, 0], p))
    assert (tokens[:, 1:] == -1).all()


def test_one_hot_proposals_reproduce_plain_sampling_token_for_token():
    """With a deterministic proposer, the emitted tokens are exactly what the plain sampler draws at each token
    index: proposals equal to them are all accepted, and the first one that differs is replaced by it."""
    rng = np.random.default_rng(5)
    num_rows, k, vocab = ROWS, DEPTH, WIDE
    logits = (rng.normal(size=(num_rows, k + 1, vocab)) * 2).astype(np.float32)
    p = mixed_params(num_rows, seed=9, step=17)
    plain_tokens = np.stack([plain(logits[:, j], {**p, "step": p["step"] + j}) for j in range(k + 1)], axis=1)
    tokens, accepted = verify(logits, plain_tokens[:, :k].astype(np.int32), np.full(num_rows, k, np.int32), None, p)
    np.testing.assert_array_equal(accepted, k)
    np.testing.assert_array_equal(tokens, plain_tokens)
    miss = rng.integers(0, k, size=num_rows)  # now each row's proposal at `miss` is some other token
    drafts = plain_tokens[:, :k].copy()
    drafts[np.arange(num_rows), miss] = (drafts[np.arange(num_rows), miss] + 1) % vocab
    tokens, accepted = verify(logits, drafts.astype(np.int32), np.full(num_rows, k, np.int32), None, p)
    np.testing.assert_array_equal(accepted, miss)
    for s in range(num_rows):
        np.testing.assert_array_equal(tokens[s, :miss[s] + 1], plain_tokens[s, :miss[s] + 1])


@pytest.mark.parametrize("with_q", [False, True], ids=["one_hot", "draft_probs"])
def test_seeded_rows_are_reproducible_and_batch_invariant(with_q):
    rng = np.random.default_rng(6)
    num_rows, k, vocab = ROWS, DEPTH, WIDE
    logits = rng.normal(size=(num_rows, k + 1, vocab)).astype(np.float32)
    q = rng.dirichlet(np.ones(vocab) * 0.3, size=(num_rows, k)).astype(np.float32) if with_q else None
    drafts = (np.stack([[rng.choice(vocab, p=q[s, j]) for j in range(k)] for s in range(num_rows)]) if with_q
              else logits.argmax(-1)[:, :k]).astype(np.int32)
    num_draft = rng.integers(0, k + 1, size=num_rows).astype(np.int32)
    p = mixed_params(num_rows, seed=123)
    first = verify(logits, drafts, num_draft, q, p)
    again = verify(logits, drafts, num_draft, q, p)
    np.testing.assert_array_equal(first[0], again[0])
    # Half of the rows again, in another order, beside rows they were not batched with before (same shape).
    keep = rng.permutation(num_rows)[: num_rows // 2]
    order = np.concatenate([keep, rng.permutation(num_rows)[: num_rows - len(keep)]])
    strangers = np.arange(num_rows) >= len(keep)
    logits2, p2 = logits[order].copy(), {name: value[order].copy() for name, value in p.items()}
    logits2[strangers] = rng.normal(size=logits2[strangers].shape)  # the new neighbours have other logits...
    p2["seed_lo"][strangers] += 77  # ...and other seeds
    sub = verify(logits2, drafts[order], num_draft[order], None if q is None else q[order], p2)
    np.testing.assert_array_equal(sub[0][~strangers], first[0][keep])
    np.testing.assert_array_equal(sub[1][~strangers], first[1][keep])
    other = verify(logits, drafts, num_draft, q, {**p, "seed_lo": p["seed_lo"] + 1000})
    sampled = p["temperature"] > 0
    assert (other[0][sampled] != first[0][sampled]).any()
    np.testing.assert_array_equal(other[0][~sampled], first[0][~sampled])  # greedy rows have no randomness


def test_shapes_are_checked():
    logits = np.zeros((2, 3, 5), np.float32)
    with pytest.raises(ValueError, match=r"draft_tokens has shape \(2, 3\), expected \(2, 2\)"):
        rejection_sample(logits, np.zeros((2, 3), np.int32), np.zeros(2, np.int32), None, **params(2))
    with pytest.raises(ValueError, match=r"draft_probs has shape \(2, 2, 4\), expected \(2, 2, 5\)"):
        rejection_sample(logits, np.zeros((2, 2), np.int32), np.zeros(2, np.int32), np.zeros((2, 2, 4), np.float32),
                         **params(2))
