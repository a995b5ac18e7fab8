"""The n-gram proposer against a naive reference (a Python loop over n and positions), on random and constructed
sequences, one at a time and as a padded batch. The cost per sequence is measured by benchmarks/spec_ngram.py."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from jaxpaged.spec_decode.ngram import propose, propose_batch


def naive(tokens: list[int], k: int, min_n: int, max_n: int) -> list[int]:
    """The definition: n from max_n down to min_n, the most recent earlier occurrence of the last n tokens (one
    that ends before the last token), the up-to-k tokens after it."""
    length = len(tokens)
    for n in range(max_n, min_n - 1, -1):
        if n + 1 > length:
            continue
        suffix = tokens[length - n:]
        for i in range(length - n - 1, -1, -1):
            if tokens[i:i + n] == suffix:
                return tokens[i + n:i + n + k]
    return []


sequences = st.lists(st.integers(0, 4), min_size=0, max_size=60)  # a small vocabulary makes matches frequent
bounds = st.tuples(st.integers(1, 6), st.integers(0, 4)).map(lambda t: (t[0], t[0] + t[1]))


@settings(max_examples=400, deadline=None)
@given(tokens=sequences, k=st.integers(1, 8), lohi=bounds)
def test_single_sequence_matches_the_definition(tokens, k, lohi):
    min_n, max_n = lohi
    got = propose(np.array(tokens, np.int32), k=k, min_n=min_n, max_n=max_n)
    assert got.dtype == np.int32
    assert got.tolist() == naive(tokens, k, min_n, max_n)


@settings(max_examples=150, deadline=None)
@given(batch=st.lists(sequences, min_size=1, max_size=8), k=st.integers(1, 6), lohi=bounds,
       limits=st.lists(st.integers(0, 8), min_size=8, max_size=8), pad=st.integers(0, 5))
def test_batch_equals_each_row_alone(batch, k, lohi, limits, pad):
    min_n, max_n = lohi
    width = max(len(t) for t in batch) + pad
    rows = np.full((len(batch), width), 3, np.int32)  # padding is a real token id: it must be ignored
    for b, t in enumerate(batch):
        rows[b, :len(t)] = t
    lengths = np.array([len(t) for t in batch])
    limit = np.array(limits[:len(batch)])
    proposals, counts = propose_batch(rows, lengths, k=k, min_n=min_n, max_n=max_n, limits=limit)
    assert proposals.shape == (len(batch), k) and counts.dtype == np.int32
    for b, t in enumerate(batch):
        want = naive(t, k, min_n, max_n)[:limit[b]]
        assert counts[b] == len(want)
        assert proposals[b, :counts[b]].tolist() == want
        assert (proposals[b, counts[b]:] == -1).all()


def test_longest_suffix_wins_over_a_more_recent_shorter_one():
    #        0  1  2  3  4  5  6  7  8  9
    tokens = [7, 8, 9, 1, 5, 9, 2, 6, 8, 9]
    # suffix (8, 9) occurs at 1-2 (followed by 1, 5); suffix (9,) occurs more recently at 5 (followed by 2, 6)
    assert propose(np.array(tokens), k=2, min_n=1, max_n=2).tolist() == [1, 5]
    assert propose(np.array(tokens), k=2, min_n=1, max_n=1).tolist() == [2, 6]
    assert propose(np.array(tokens), k=2, min_n=3, max_n=3).tolist() == []


def test_most_recent_occurrence_and_truncation_at_the_end():
    tokens = [4, 5, 1, 4, 5, 2, 3, 4, 5]
    assert propose(np.array(tokens), k=3, min_n=2, max_n=2).tolist() == [2, 3, 4]
    # the continuation of a self-overlapping run stops at the sequence's end
    assert propose(np.array([6, 6, 6, 6]), k=5, min_n=2, max_n=3).tolist() == [6]


def test_quoted_span_is_proposed_from_the_prompt():
    rng = np.random.default_rng(0)
    prompt = rng.integers(100, 50_000, size=2000)
    quote_at = 700
    output = prompt[quote_at:quote_at + 6]  # the answer starts copying a span of the prompt
    tokens = np.concatenate([prompt, output])
    assert propose(tokens, k=5, min_n=3, max_n=5).tolist() == prompt[quote_at + 6:quote_at + 11].tolist()


@pytest.mark.parametrize("lengths", [[0, 1, 2], [1], [0]])
def test_too_short_rows_propose_nothing(lengths):
    rows = np.zeros((len(lengths), 4), np.int32)
    proposals, counts = propose_batch(rows, np.array(lengths), k=3, min_n=1, max_n=2)
    want = [len(naive([0] * n, 3, 1, 2)) for n in lengths]
    assert counts.tolist() == want


def test_bad_bounds_are_refused():
    with pytest.raises(ValueError, match="min_n <= max_n"):
        propose(np.arange(5), k=2, min_n=3, max_n=2)
