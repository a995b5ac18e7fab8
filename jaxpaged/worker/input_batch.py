"""The persistent input batch: a row per running sequence, kept between steps, and one step's inputs packed into one
int32 buffer from those rows, vectorized.

Rows live in preallocated numpy arrays of `max_rows` (= max_num_seqs) rows: block tables, sampling parameters,
the last token known on the host, and where a sampled token still on the device sits in the previous step's output.
Each step's `SchedulerOutput` changes them by its diffs alone (rows of sequences that left, new rows, changed block
tables), then `build` lays out the step: positions, slot mapping, query starts and the sampling fields come from
numpy over the step's rows, with no Python loop over decoding sequences (a prompt chunk's token ids are copied from
its sequence, one slice per chunk).

One buffer per step (`StepLayout` gives each field's offset; the float fields travel as their int32 bits): the host
sends one array, and the jitted step slices it into `AttentionMetadata` and `SamplingMetadata` on the device. The
sampler's large per-row arrays (a grammar's bitmask, penalties' token history, logit bias: `EXTRAS`) travel only in a
step that has a row using them; other steps pass the runner's device-resident neutral arrays.

A decoding row's input token comes from the host (`last_token`) when the host knows it, or from the previous step's
sampled tokens on the device (`inflight`: asynchronous scheduling), chosen on the device by `token_src`.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np

from jaxpaged.core.request import Sequence
from jaxpaged.core.sched_output import SchedulerOutput
from jaxpaged.sampling_params import MAX_LOGIT_BIAS
from jaxpaged.worker.attention import AttentionMetadata
from jaxpaged.worker.sampler import MAX_BANNED, SamplingMetadata


@dataclasses.dataclass(frozen=True)
class StepLayout:
    """A compiled step's shape and the offsets of its fields in the packed int32 buffer.

    T tokens, S sequence rows, block-table width W; `tile_size` and `decode_blocks` are AttentionMetadata's static
    fields. Fields, in order (S-long unless said): token_ids [T], token_src [T], positions [T], slot_mapping [T],
    block_tables [S * W], context_lens, query_start_loc [S + 1], logits_indices, top_k, seed_lo, seed_hi, step,
    output_start, banned [S * MAX_BANNED], flags [3] (want_logprobs, penalized, constrained), then float32 bits:
    temperature, top_p, min_p, presence, frequency, repetition penalties.

    A verifying step (speculative decoding, `spec_width` K > 0) takes logits at K + 1 positions of each sequence
    (logits_indices [S * (K + 1)]: a row's chunk positions, the last repeated) and four more fields: draft_tokens
    [S * K] (the proposals it verifies, -1 after its num_draft [S]), emit_pos [S] (the position of the first token
    the row emits: accepted proposals, then the target's), draft_flag [S] (the draft loop proposes for the row),
    draft_run [1] (a separate draft model must run over the step's tokens: some row's chunk is not one its draft
    loop already wrote one step earlier).

    A scoring step (`prompt_scores`: some row wants its prompt's log-probs) takes one more field, score_targets [T]:
    for each token row, the prompt token that follows it (whose log-prob the step returns), -1 elsewhere.
    """

    num_tokens: int  # T
    num_seqs: int  # S
    width: int  # W
    tile_size: int
    decode_blocks: int | None
    spec_width: int = 0  # K: proposals a row may verify (0: a plain step)
    draft_kv: bool = True  # a separate draft model runs over the step's tokens and proposes (False: not at all)
    prompt_scores: bool = False  # the step also returns each token row's next prompt token's log-prob (and top-k)

    @property
    def key(self) -> tuple:
        return (self.num_tokens, self.num_seqs, self.width, self.tile_size, self.decode_blocks, self.spec_width,
                self.draft_kv, self.prompt_scores)

    @functools.cached_property
    def offsets(self) -> dict[str, tuple[int, int]]:
        t, s, k = self.num_tokens, self.num_seqs, self.spec_width
        sizes = [("token_ids", t), ("token_src", t), ("positions", t), ("slot_mapping", t),
                 ("block_tables", s * self.width), ("context_lens", s), ("query_start_loc", s + 1),
                 ("logits_indices", s * (k + 1)), ("top_k", s), ("seed_lo", s), ("seed_hi", s), ("step", s),
                 ("output_start", s), ("banned", s * MAX_BANNED), ("flags", 3),
                 ("temperature", s), ("top_p", s), ("min_p", s), ("presence_penalty", s), ("frequency_penalty", s),
                 ("repetition_penalty", s)]
        if k:
            sizes += [("draft_tokens", s * k), ("num_draft", s), ("emit_pos", s), ("draft_flag", s), ("draft_run", 1)]
        if self.prompt_scores:
            sizes.append(("score_targets", t))
        out, o = {}, 0
        for name, n in sizes:
            out[name] = (o, o + n)
            o += n
        return out

    @property
    def size(self) -> int:
        return max(hi for _, hi in self.offsets.values())

    def empty(self) -> np.ndarray:
        """An all-padding buffer [size] int32: every field at its neutral value (no token, greedy, nothing banned)."""
        buf = np.zeros(self.size, np.int32)
        for name in ("positions", "top_k", "banned"):
            self.view(buf, name)[:] = -1
        self.view(buf, "token_src")[:] = -1
        self.view(buf, "top_p", np.float32)[:] = 1.0
        self.view(buf, "repetition_penalty", np.float32)[:] = 1.0
        if self.spec_width:
            self.view(buf, "draft_tokens")[:] = -1
            self.view(buf, "draft_run")[:] = 1
        if self.prompt_scores:
            self.view(buf, "score_targets")[:] = -1
        return buf

    def view(self, buf: np.ndarray, name: str, dtype=np.int32) -> np.ndarray:
        lo, hi = self.offsets[name]
        return buf[lo:hi].view(dtype) if dtype is not np.int32 else buf[lo:hi]

    def spec_fields(self, buf: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array]:
        """Inside a verifying step: (draft_tokens [S, K], num_draft [S], emit_pos [S], draft_flag [S] bool)."""
        s, k = self.num_seqs, self.spec_width

        def field(name):
            lo, hi = self.offsets[name]
            return buf[lo:hi]

        return (field("draft_tokens").reshape(s, k), field("num_draft"), field("emit_pos"),
                field("draft_flag") != 0)

    def score_targets(self, buf: jax.Array) -> jax.Array:
        """Inside a scoring step: score_targets [T] int32."""
        lo, hi = self.offsets["score_targets"]
        return buf[lo:hi]

    def draft_run(self, buf: jax.Array) -> jax.Array:
        """Inside a verifying step: whether a separate draft model runs over the step's tokens (bool scalar)."""
        lo, _ = self.offsets["draft_run"]
        return buf[lo] != 0

    def unpack(self, buf: jax.Array, extras: tuple[jax.Array, ...]
               ) -> tuple[jax.Array, jax.Array, AttentionMetadata, SamplingMetadata]:
        """Inside the jitted step: (host token ids [T], token_src [T], attention metadata, sampling metadata, whose
        pending_tokens the step sets from token_src); `extras` are the EXTRAS arrays, in order."""
        bitmask, seen_tokens, bias_ids, bias_values = extras
        s = self.num_seqs

        def field(name, dtype=jnp.int32, shape=None):
            lo, hi = self.offsets[name]
            x = buf[lo:hi]
            if dtype != jnp.int32:
                x = jax.lax.bitcast_convert_type(x, dtype)
            return x.reshape(shape) if shape is not None else x

        flags = field("flags")
        md = AttentionMetadata(
            positions=field("positions"), slot_mapping=field("slot_mapping"),
            block_tables=field("block_tables", shape=(s, self.width)), context_lens=field("context_lens"),
            query_start_loc=field("query_start_loc"), logits_indices=field("logits_indices"),
            tile_size=self.tile_size, decode_blocks=self.decode_blocks, prompt_lens=field("output_start"))
        sm = SamplingMetadata(
            temperature=field("temperature", jnp.float32), top_p=field("top_p", jnp.float32),
            top_k=field("top_k"), min_p=field("min_p", jnp.float32), seed_lo=field("seed_lo", jnp.uint32),
            seed_hi=field("seed_hi", jnp.uint32), step=field("step"), want_logprobs=flags[0] != 0,
            banned=field("banned", shape=(s, MAX_BANNED)), bitmask=bitmask, constrained=flags[2] != 0,
            presence_penalty=field("presence_penalty", jnp.float32),
            frequency_penalty=field("frequency_penalty", jnp.float32),
            repetition_penalty=field("repetition_penalty", jnp.float32), seen_tokens=seen_tokens,
            output_start=field("output_start"), pending_tokens=jnp.full(s, -1, jnp.int32), penalized=flags[1] != 0,
            bias_ids=bias_ids, bias_values=bias_values)
        return field("token_ids"), field("token_src"), md, sm


@dataclasses.dataclass(frozen=True)
class Extra:
    """One of the sampler's large per-row arrays: [S, width] of `dtype`, `neutral` in rows that do not use it."""

    name: str
    dtype: type
    neutral: int | float


# bitmask [S, ceil(V / 32)] (structured output, bad words; all ones: any token), seen_tokens [S, max_model_len]
# (penalties; -1: none), bias_ids / bias_values [S, MAX_LOGIT_BIAS] (logit_bias; id -1: none)
EXTRAS = (Extra("bitmask", np.int32, -1), Extra("seen_tokens", np.int32, -1), Extra("bias_ids", np.int32, -1),
          Extra("bias_values", np.float32, 0.0))


def extra_shapes(num_seqs: int, vocab_size: int, max_len: int) -> tuple[tuple[int, int], ...]:
    """The EXTRAS' shapes for a step of num_seqs rows."""
    return ((num_seqs, (vocab_size + 31) // 32), (num_seqs, max_len), (num_seqs, MAX_LOGIT_BIAS),
            (num_seqs, MAX_LOGIT_BIAS))


@dataclasses.dataclass
class StepInputs:
    """One step's host inputs: the packed buffer, and those of the EXTRAS a row of the step uses (the others: the
    step takes the runner's device-resident neutral arrays, and nothing of that size travels)."""

    layout: StepLayout
    buf: np.ndarray  # [layout.size] int32
    extras: dict[str, np.ndarray] = dataclasses.field(default_factory=dict)  # EXTRAS name -> [S, width]
    want_logprobs: bool = False
    # Every row is greedy and asks for nothing else (no penalty, bias, ban, mask or log-probs): a step compiled
    # without its sampler (jaxpaged.worker.step's split_sampler) has its output in its argmax.
    greedy_only: bool = False


@dataclasses.dataclass
class StepRows:
    """What the engine needs back from a laid-out step: which sequence each step row is, and which rows sample."""

    seqs: list[Sequence]  # step row i is seqs[i]
    seq_ids: np.ndarray  # [n] int64
    rows: np.ndarray  # [n] int32: their rows in the persistent batch
    samples: np.ndarray  # [n] bool
    step_id: int
    # a scoring step: (sequence, first position, first token row, count) of each prompt chunk it scores; token row
    # r0 + j holds position start + j, scored against the prompt token at start + j + 1
    scored: list[tuple[Sequence, int, int, int]] = dataclasses.field(default_factory=list)


class InputBatch:
    """The running sequences' rows, and the layout of each step from them (see the module docstring)."""

    def __init__(self, max_rows: int, max_width: int, block_size: int, truncate_tables: bool = False):
        self.max_rows = max_rows
        self.max_width = max_width
        self.block_size = block_size
        # contiguous allocation (a benchmark's model of pre-paged systems): tables hold blocks past the context
        self.truncate_tables = truncate_tables
        self.row_of: dict[int, int] = {}  # seq_id -> row
        self._histories: dict[int, np.ndarray] = {}  # row -> a penalized row's tokens as int32 (`_history`)
        self._free_rows = list(range(max_rows - 1, -1, -1))
        r = max_rows
        self.seq_id = np.full(r, -1, np.int64)
        self.block_tables = np.zeros((r, max_width), np.int32)  # [R, W]
        self.num_prompt = np.zeros(r, np.int32)
        self.last_token = np.zeros(r, np.int32)  # the row's last token, when the host knows it
        self.inflight = np.full(r, -1, np.int32)  # index of its last token in the previous step's output, or -1
        self.inflight_step = np.full(r, -1, np.int64)
        # sampling parameters
        self.temperature = np.zeros(r, np.float32)
        self.top_p = np.ones(r, np.float32)
        self.top_k = np.full(r, -1, np.int32)
        self.min_p = np.zeros(r, np.float32)
        self.seed_lo = np.zeros(r, np.uint32)
        self.seed_hi = np.zeros(r, np.uint32)
        self.min_tokens = np.zeros(r, np.int32)
        self.banned = np.full((r, MAX_BANNED), -1, np.int32)  # banned below min_tokens: EOS and stop token ids
        self.presence = np.zeros(r, np.float32)
        self.frequency = np.zeros(r, np.float32)
        self.repetition = np.ones(r, np.float32)
        self.penalized = np.zeros(r, bool)
        self.logprobs = np.zeros(r, bool)
        self.has_bias = np.zeros(r, bool)
        self.bias_ids = np.full((r, MAX_LOGIT_BIAS), -1, np.int32)
        self.bias_values = np.zeros((r, MAX_LOGIT_BIAS), np.float32)
        self._step_id = 0
        self.added_rows: list[int] = []  # rows given to new sequences since `take_added_rows`
        # the last `apply`'s sequences and rows: a decode step of the same sequences (most steps) reuses the rows
        self._last_step: tuple[list[Sequence], np.ndarray] = ([], np.zeros(0, np.int32))

    # ---- the diffs ----------------------------------------------------------------------------------------------

    def apply_diffs(self, out: SchedulerOutput) -> None:
        """The scheduler's diffs, once for every SchedulerOutput, whether or not its step runs (the scheduler hands
        each diff over once: a step whose requests all failed must not take them along): rows of sequences that left
        go; the changed tables of sequences that hold rows are copied (a sequence without a row gets its table when
        it gets one, `rows`)."""
        for seq_id in out.removed:
            self.remove(seq_id)
        for seq_id, table in out.changed_tables.items():
            row = self.row_of.get(seq_id)
            if row is not None:
                self._set_table(row, table)

    def rows(self, out: SchedulerOutput, tables: dict, seed_of: Callable[[Sequence], int]) -> np.ndarray:
        """The step's rows, [n] int32 (`build` takes them), after `apply_diffs`: the step's new sequences get rows
        (their table from `tables`, the block manager's seq_id -> table, and their seed from `seed_of`)."""
        last_seqs, last_rows = self._last_step
        if out.seqs == last_seqs:  # the same sequences as the step before (identity), no row freed since: same rows
            return last_rows
        found = [self.row_of.get(seq.seq_id, -1) for seq in out.seqs]  # one pass over the step's sequences
        if -1 in found:
            for i, seq in enumerate(out.seqs):
                if found[i] == -1:
                    found[i] = self.add(seq, tables[seq.seq_id], seed_of(seq))
        rows = np.array(found, np.int32)
        self._last_step = (list(out.seqs), rows)
        return rows

    def add(self, seq: Sequence, table: list[int], seed: int) -> int:
        if not self._free_rows:
            raise RuntimeError(f"the input batch has no free row (max_rows={self.max_rows})")
        row = self._free_rows.pop()
        self.added_rows.append(row)
        self.row_of[seq.seq_id] = row
        self.seq_id[row] = seq.seq_id
        self._histories.pop(row, None)
        self._set_table(row, table)
        self.num_prompt[row] = seq.num_prompt_tokens
        self.last_token[row] = seq.token_ids[-1]
        self.inflight[row] = -1
        p = seq.params
        self.temperature[row], self.top_p[row], self.top_k[row], self.min_p[row] = (p.temperature, p.top_p,
                                                                                     p.top_k, p.min_p)
        self.seed_lo[row], self.seed_hi[row] = seed & 0xFFFFFFFF, (seed >> 32) & 0xFFFFFFFF
        # Below min_tokens the tokens that would end it (EOS, stop ids) may not be sampled, unless a grammar decides
        # when to end.
        banned = [] if p.structured_outputs is not None or not p.min_tokens else sorted(seq.stop_ids)
        self.min_tokens[row] = p.min_tokens
        self.banned[row] = -1
        self.banned[row, :len(banned)] = banned[:MAX_BANNED]
        self.presence[row], self.frequency[row] = p.presence_penalty, p.frequency_penalty
        self.repetition[row], self.penalized[row] = p.repetition_penalty, p.has_penalties
        self.logprobs[row] = p.logprobs is not None
        self.bias_ids[row], self.bias_values[row] = -1, 0.0
        self.has_bias[row] = bool(p.logit_bias)
        if p.logit_bias:
            self.bias_ids[row, :len(p.logit_bias)] = list(p.logit_bias)
            self.bias_values[row, :len(p.logit_bias)] = list(p.logit_bias.values())
        return row

    def take_added_rows(self) -> list[int]:
        added, self.added_rows = self.added_rows, []
        return added

    def remove(self, seq_id: int) -> None:
        row = self.row_of.pop(seq_id, None)
        if row is not None:
            self.seq_id[row] = -1
            self._histories.pop(row, None)
            self.inflight[row] = -1
            self._free_rows.append(row)
            self._last_step = ([], np.zeros(0, np.int32))  # a row may now hold another sequence

    @property
    def num_free_rows(self) -> int:
        return len(self._free_rows)

    def _set_table(self, row: int, table: list[int]) -> None:
        n = len(table)
        self.block_tables[row, :n] = table
        self.block_tables[row, n:] = 0

    # ---- tokens back from the device -----------------------------------------------------------------------------

    def tokens_arrived(self, rows: StepRows, tokens: np.ndarray) -> None:
        """A step's sampled tokens [n] reached the host: rows that still hold the same sequences know their last
        token now; the ones whose last token is still that step's (not a newer step's) stop reading it from the
        device."""
        r, ok = rows.rows, rows.samples & (self.seq_id[rows.rows] == rows.seq_ids)
        r, toks = r[ok], tokens[ok]
        self.last_token[r] = toks
        self.inflight[r[self.inflight_step[r] == rows.step_id]] = -1

    # ---- one step -----------------------------------------------------------------------------------------------

    def build(self, out: SchedulerOutput, layout: StepLayout, rows: np.ndarray | None = None
              ) -> tuple[StepInputs, StepRows]:
        """The step's packed inputs in `layout` (chosen by the runner's buckets for this step's counts); `rows`: the
        step's rows as `apply` returned them (looked up when not given)."""
        n = len(out.seqs)
        bs = self.block_size
        if rows is None:
            row_of = self.row_of
            rows = np.fromiter((row_of[s.seq_id] for s in out.seqs), np.int32, n)
        starts = np.asarray(out.starts, np.int32)
        if out.is_prefill:
            num_new = np.asarray(out.num_new_tokens, np.int32)
            samples = np.asarray(out.samples, bool)
        else:  # a decode step: every row runs its last token and samples the next (Scheduler._schedule_decodes)
            num_new = np.ones(n, np.int32)
            samples = np.ones(n, bool)
        ctx = starts + num_new
        buf = layout.empty()

        def put(name, values, dtype=np.int32):
            layout.view(buf, name, dtype)[:len(values)] = values

        # token layout: segment i starts at a multiple of the tile
        tile = layout.tile_size
        lengths = -(-num_new // tile) * tile if tile > 1 else num_new
        seg_start = np.zeros(n + 1, np.int32)
        np.cumsum(lengths, out=seg_start[1:])
        decode_only = not out.is_prefill
        if decode_only:  # one token per row, rows laid out 0..n-1
            tok_row = np.arange(n, dtype=np.int32)
            tok_idx = tok_row
            positions = starts
        else:
            tok_row = np.repeat(np.arange(n, dtype=np.int32), num_new)
            offset = np.arange(tok_row.size, dtype=np.int32) - np.repeat(np.cumsum(num_new) - num_new, num_new)
            tok_idx = seg_start[tok_row] + offset  # where each real token sits in the step
            positions = starts[tok_row] + offset
        row_of_tok = rows[tok_row]
        # token ids: a row's last token from the host or the device, the rest of a prompt chunk from its sequence
        last = samples & (num_new == 1)
        token_ids = np.empty(tok_row.size, np.int32)
        token_src = np.full(tok_row.size, -1, np.int32)
        if decode_only:
            token_ids[:] = self.last_token[rows]
            token_src[:] = self.inflight[rows]
        else:
            dense_first = np.cumsum(num_new) - num_new  # index of each row's first token in tok_row order
            for i in np.flatnonzero(~last):
                s, m, seq = int(starts[i]), int(num_new[i]), out.seqs[i]
                chunk = seq.token_ids[s:s + m]
                if len(chunk) < m:  # a verifying row: its last token, then the proposals
                    chunk = chunk + seq.spec_tokens[:m - len(chunk)]
                token_ids[dense_first[i]:dense_first[i] + m] = chunk
            li = np.flatnonzero(last)
            token_ids[dense_first[li]] = self.last_token[rows[li]]
            token_src[dense_first[li]] = self.inflight[rows[li]]
        ids = layout.view(buf, "token_ids")
        src = layout.view(buf, "token_src")
        ids[tok_idx], src[tok_idx] = token_ids, token_src
        layout.view(buf, "positions")[tok_idx] = positions
        slots = self.block_tables[row_of_tok, positions // bs] * bs + positions % bs
        layout.view(buf, "slot_mapping")[tok_idx] = slots
        # sequences
        w = layout.width
        tables = layout.view(buf, "block_tables").reshape(layout.num_seqs, w)[:n]  # [n, w], the step's own columns
        np.take(self.block_tables[:, :w], rows, axis=0, out=tables)
        if self.truncate_tables:
            tables[np.arange(w)[None, :] >= (-(-ctx // bs))[:, None]] = 0
        put("context_lens", ctx)
        qsl = layout.view(buf, "query_start_loc")
        qsl[:n + 1] = seg_start
        qsl[n + 1:] = seg_start[-1]
        num_spec = np.asarray(out.num_spec, np.int32) if layout.spec_width else np.zeros(n, np.int32)
        last_row = seg_start[:-1] + num_new - 1
        if layout.spec_width:  # K + 1 logits rows per sequence: its verified positions, then its last one repeated
            k = layout.spec_width
            first = last_row - num_spec  # the row's last token, where its first new token is sampled
            put("logits_indices", np.minimum(first[:, None] + np.arange(k + 1)[None, :], last_row[:, None]).ravel())
            drafts = layout.view(buf, "draft_tokens").reshape(layout.num_seqs, k)
            for i in np.flatnonzero(num_spec):
                drafts[i, :num_spec[i]] = out.seqs[i].spec_tokens[:num_spec[i]]
            put("num_draft", num_spec)
            put("emit_pos", ctx - num_spec)
            put("draft_flag", np.asarray(out.drafts, np.int32))
            # A row whose chunk (its last token, then proposals) starts where its draft loop began writing one step
            # earlier has its draft K/V: the loop wrote those tokens there (the step's own loop rewrites the last
            # accepted one beside the new token). Any other row (a prompt chunk, a first proposal) needs the run.
            looped = np.fromiter((seq.draft_loop_from for seq in out.seqs), np.int64, n)
            covered = samples & (num_new == 1 + num_spec) & (starts == looped)
            layout.view(buf, "draft_run")[0] = not covered.all()
        else:
            put("logits_indices", last_row)
        # sampling: each row's parameters; the token being sampled (the first, verifying rows) is output `step`
        step = ctx - num_spec - self.num_prompt[rows]
        put("top_k", self.top_k[rows])
        put("seed_lo", self.seed_lo[rows].view(np.int32))
        put("seed_hi", self.seed_hi[rows].view(np.int32))
        put("step", step)
        put("output_start", self.num_prompt[rows])
        below_min = step < self.min_tokens[rows]
        banning = below_min.any()  # (a row still in its prompt is below it too, and bans what it has to ban)
        if banning:
            bans = np.where(below_min[:, None], self.banned[rows], -1)
            layout.view(buf, "banned").reshape(layout.num_seqs, MAX_BANNED)[:n] = bans
            banning = (bans >= 0).any()
        extras = {}
        if self.has_bias[rows].any():
            extras["bias_ids"] = np.full((layout.num_seqs, MAX_LOGIT_BIAS), -1, np.int32)
            extras["bias_values"] = np.zeros((layout.num_seqs, MAX_LOGIT_BIAS), np.float32)
            extras["bias_ids"][:n], extras["bias_values"][:n] = self.bias_ids[rows], self.bias_values[rows]
        put("temperature", self.temperature[rows], np.float32)
        put("top_p", self.top_p[rows], np.float32)
        put("min_p", self.min_p[rows], np.float32)
        penalized = bool(self.penalized[rows].any())
        if penalized:
            put("presence_penalty", self.presence[rows], np.float32)
            put("frequency_penalty", self.frequency[rows], np.float32)
            put("repetition_penalty", self.repetition[rows], np.float32)
        want_logprobs = bool(self.logprobs[rows].any())
        layout.view(buf, "flags")[:2] = want_logprobs, penalized
        # The rows that sample will read their last token from this step's output (row i of it) until it arrives.
        self._step_id += 1
        sampled_rows = rows[samples]
        self.inflight[sampled_rows] = np.flatnonzero(samples).astype(np.int32)
        self.inflight_step[sampled_rows] = self._step_id
        step_rows = StepRows(list(out.seqs), self.seq_id[rows].copy(), rows, samples, self._step_id)
        greedy_only = not (want_logprobs or penalized or extras or banning
                           or (self.temperature[rows] > 0).any())
        return StepInputs(layout, buf, extras, want_logprobs, greedy_only), step_rows

    def seen_tokens(self, out: SchedulerOutput, layout: StepLayout, max_len: int) -> np.ndarray:
        """[S, max_len] int32 of the penalized rows' tokens on the host (prompt, then output; -1 padding). A row's last
        token may not be here yet (asynchronous scheduling): the step adds it (`SamplingMetadata.pending_tokens`)."""
        seen = np.full((layout.num_seqs, max_len), -1, np.int32)
        for i, seq in enumerate(out.seqs):
            if seq.params.has_penalties:
                tokens = self._history(self.row_of[seq.seq_id], seq)
                seen[i, :len(tokens)] = tokens
        return seen

    def _history(self, row: int, seq: Sequence) -> np.ndarray:
        """seq's tokens (the row's sequence) as int32: kept from the last step and extended by the tokens appended
        since (a sequence's tokens are only appended), so a step converts only those."""
        arr, n = self._histories.get(row), len(seq.token_ids)
        if arr is None or len(arr) > n:
            arr = np.asarray(seq.token_ids, np.int32)
        elif len(arr) < n:
            arr = np.concatenate([arr, np.asarray(seq.token_ids[len(arr):], np.int32)])
        self._histories[row] = arr
        return arr

    def check_tables(self, tables: dict) -> None:
        """Raises AssertionError where a row's block table differs from the block manager's (tests)."""
        for seq_id, row in self.row_of.items():
            table = tables.get(seq_id, [])
            got = self.block_tables[row, :len(table)].tolist()
            assert got == list(table), f"seq {seq_id}: row {row} holds {got}, the pool says {table}"
