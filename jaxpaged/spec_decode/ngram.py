"""The n-gram (prompt lookup) proposer: host numpy, no JAX, run for every speculating sequence every step.

For a sequence of L tokens (prompt and output so far), find the longest suffix of n tokens, n from
`prompt_lookup_max` down to `prompt_lookup_min`, that occurred earlier in the sequence, take its most recent earlier
occurrence, and propose the (up to) k tokens that followed it. A sequence that quotes, edits or repeats its input
gets those tokens accepted; one with no match proposes nothing and decodes one token as usual.

    proposals, counts = propose_batch(token_rows, lengths, k=4, min_n=2, max_n=5)
    # token_rows [B, W] int32 (row b's tokens in [:lengths[b]], anything after), lengths [B]
    # proposals [B, k] int32 (-1 after counts[b]), counts [B] int32 in 0..k

How, without a loop over positions: an occurrence is named by the position c of its last token (c <= L - 2, so at
least one token follows it). Candidates are the positions holding the sequence's last token (one comparison over
the row); for each candidate, the match length is the number of consecutive j = 0, 1, ... with
tokens[c - j] == tokens[L - 1 - j], counted up to max_n by max_n - 1 vectorised comparisons over the candidates
(usually few: a token's earlier occurrences). The chosen occurrence maximises (min(match, max_n), c) among those with
match >= min_n: the longest n first, then the most recent. The batch form takes the rows of a persistent input batch
as they are ([B, W] with lengths) and loops over nothing but the max_n - 1 comparisons.
"""

from __future__ import annotations

import numpy as np


def propose_batch(token_rows: np.ndarray, lengths: np.ndarray, *, k: int, min_n: int, max_n: int,
                  limits: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray]:
    """Proposals of B sequences at once.

    token_rows [B, W] integer: row b's tokens are token_rows[b, :lengths[b]] (the rest is ignored).
    lengths [B] integer in 0..W.
    limits [B] integer or None: at most this many proposals for row b (room left before max_tokens or the context
    length); None: k.
    Returns (proposals [B, k] int32 with -1 after each row's count, counts [B] int32)."""
    if not 1 <= min_n <= max_n:
        raise ValueError(f"need 1 <= min_n <= max_n, got min_n={min_n}, max_n={max_n}")
    token_rows = np.ascontiguousarray(token_rows)  # [B, W]; a persistent batch's rows are already
    lengths = np.asarray(lengths, np.int64)  # [B]
    num_rows, full_width = token_rows.shape
    proposals = np.full((num_rows, k), -1, np.int32)  # [B, k]
    counts = np.zeros(num_rows, np.int32)  # [B]
    if num_rows == 0 or k <= 0:
        return proposals, counts
    width = int(lengths.max())
    if width < min_n + 1:  # no row has a suffix of min_n tokens and an earlier token after a match
        return proposals, counts
    flat = token_rows.reshape(-1)  # [B * W] a view: row b starts at b * W
    ends = np.arange(num_rows) * full_width + lengths - 1  # [B] flat position of each row's last token
    last = flat[np.maximum(ends, 0)]  # [B]
    # Candidate ends c holding the row's last token, found over the columns any row may use; those outside a row's
    # own [0, L - 2] (its padding or its last token) and rows shorter than min_n + 1 are dropped after, on the few.
    hits = np.flatnonzero(token_rows[:, :width - 1] == last[:, None])  # [N] in the [B, width - 1] block
    b, c = np.divmod(hits, width - 1)
    keep = (c < lengths[b] - 1) & (lengths[b] >= min_n + 1)
    b, c = b[keep], c[keep]
    if b.size == 0:
        return proposals, counts
    at, suffix = b * full_width + c, ends[b]  # [N] flat positions of the candidate and of its row's last token
    # Level j keeps the candidates whose match is longer than j; a row's deepest level and its last (most recent)
    # candidate there are the longest n (capped at max_n) and its most recent occurrence. Candidates drop out as
    # levels go, so the work follows the matches, not the rows' lengths.
    level = np.zeros(num_rows, np.int64)  # [B] longest match found so far (0: none)
    best = np.zeros(num_rows, np.int64)  # [B] its occurrence's end c
    for j in range(1, max_n + 1):
        last_of_row = np.flatnonzero(np.concatenate((b[1:] != b[:-1], [True])))  # candidates sorted by (b, c)
        level[b[last_of_row]] = j
        best[b[last_of_row]] = c[last_of_row]
        if j == max_n:
            break
        # match > j: tokens j back from the candidate and from the row's end agree (and the candidate has them)
        alive = c >= j
        b, c, at, suffix = b[alive], c[alive], at[alive], suffix[alive]
        alive = flat[at - j] == flat[suffix - j]
        if not alive.any():
            break
        b, c, at, suffix = b[alive], c[alive], at[alive], suffix[alive]
    found = level >= min_n
    if not found.any():
        return proposals, counts
    follow = np.where(found, best + 1, 0)  # [B] first position after the chosen occurrence
    room = np.where(found, lengths - follow, 0)  # [B] tokens after it
    if limits is not None:
        room = np.minimum(room, np.maximum(np.asarray(limits, np.int64), 0))
    room = np.minimum(room, k)
    valid = np.arange(k)[None, :] < room[:, None]  # [B, k]
    take = (np.arange(num_rows) * full_width + follow)[:, None] + np.arange(k)[None, :]  # [B, k] flat positions
    proposals[valid] = flat[take[valid]]
    counts[:] = room
    return proposals, counts


def propose(tokens: np.ndarray, *, k: int, min_n: int, max_n: int) -> np.ndarray:
    """Proposals for one sequence: tokens [L] integer -> [n] int32, n in 0..k. The same levels as `propose_batch`,
    with the bookkeeping of one row only (a few numpy calls when the last token is rare)."""
    if not 1 <= min_n <= max_n:
        raise ValueError(f"need 1 <= min_n <= max_n, got min_n={min_n}, max_n={max_n}")
    tokens = np.asarray(tokens)  # [L]
    length = tokens.shape[0]
    if length < min_n + 1 or k <= 0:
        return np.zeros(0, np.int32)
    candidates = np.flatnonzero(tokens[:length - 1] == tokens[length - 1])  # [N] occurrence ends c, ascending
    n = 1 if candidates.size else 0  # every candidate matches n tokens
    while n and n < max_n:
        older = candidates[candidates >= n]
        longer = older[tokens[older - n] == tokens[length - 1 - n]]
        if longer.size == 0:
            break
        candidates, n = longer, n + 1
    if n < min_n:
        return np.zeros(0, np.int32)
    follow = int(candidates[-1]) + 1  # after the most recent occurrence of the longest suffix
    return tokens[follow:follow + k].astype(np.int32)
