"""One position's log-probs (`{token id: Logprob}`, vLLM's shape) against a reference log-softmax row."""

from __future__ import annotations

import numpy as np

from jaxpaged import Logprob


def check_entries(entries: dict[int, Logprob], token: int, ref: np.ndarray, k: int, tol: float,
                  tokenizer=None) -> None:
    """entries: the position's dict, for `token` (the sampled or prompt token) and the top k; ref [V]: the
    reference log-probs of that position (float64). Checks vLLM's layout: `token` first, then the top k ranked 1..k
    in order; every log-prob within `tol` of the reference; `token`'s rank that of its reference value (ties within
    `tol` either way); decoded_token the token decoded alone (None without a tokenizer)."""
    assert next(iter(entries)) == token, entries
    assert all(isinstance(e, Logprob) for e in entries.values()), entries
    for i, e in entries.items():
        assert abs(e.logprob - ref[i]) < tol, (i, e, ref[i])
        assert e.decoded_token == (None if tokenizer is None else tokenizer.decode([i])), (i, e)
    top = sorted((e.rank, i) for i, e in entries.items() if i != token or e.rank <= k)
    assert [r for r, _ in top] == list(range(1, k + 1)), entries
    values = [ref[i] for _, i in top]
    assert all(a >= b - 2 * tol for a, b in zip(values, values[1:], strict=False)), values
    assert set(np.argsort(-ref)[:k].tolist()) == {i for _, i in top} or np.sort(ref)[-k] - np.sort(ref)[-k - 1] < tol
    v = ref[token]
    assert int(np.sum(ref > v + tol)) + 1 <= entries[token].rank <= int(np.sum(ref >= v - tol)), (
        token, entries[token], int(np.sum(ref >= v)))
