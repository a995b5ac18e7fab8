"""Continuous batching: which sequences run in the next step, and who is preempted when the pool runs dry.

Policy (first-come-first-served), in one of two forms picked by the attention backend:
- Mixed steps (`mixed_steps=True`, vLLM v1's policy; the native CPU kernel, whose cost does not depend on how a
  step's tokens are laid out): every step runs one token of every decoding sequence first, then prompt chunks (and
  recomputed requests) in arrival order with the token budget that is left. A running stream gets a token every
  step, whatever prompts arrive.
- Separate steps (the other backends): a step is either a prefill step or a decode step. Prefill steps run prompt
  chunks in arrival order under the token budget; decode steps run one token of every running sequence. Waiting
  prefills go first, so new requests join the running batch at the next step, but never twice in a row while
  running sequences wait for a token: a decode step comes between. The two kinds stay apart because those kernels
  pad each prefill sequence to query tiles of `PREFILL_TILE` tokens: a decode in a prefill step would cost a tile.
- `max_prefill_tokens_while_decoding` bounds the prompt tokens of a step that also has (or keeps waiting) decoding
  sequences, and so the time between a stream's tokens. With `max_decode_slowdown` that bound is a ceiling, and the
  bound in force follows the step times the engine reports (`StepPacer`): such a step may delay a stream's next
  token by at most (slowdown - 1) decode steps, however long the prompt's context has grown. On mixed steps a
  paced chunk is any number of tokens (the pacer's bound goes in 4s, below a tile where a machine needs it). With
  asynchronous scheduling a step's time is known after the next step was scheduled: each bound applies a step later.
- A prompt longer than the token budget is chunked over several prefill steps.
- When a decode cannot get a block, the newest running request is preempted whole: its blocks are freed and it
  is recomputed later (default), or swapped to the host pool when `preemption_mode="swap"`. Preempted requests
  go back ahead of every request that arrived after them, so earlier requests are never starved by later ones.
- `policy="priority"` (vLLM's priority scheduling) orders all of the above by (priority, arrival) instead of arrival
  alone: the waiting queue admits the lowest priority value first, and preemption takes the running request with
  the highest value, the newest among equals; a swapped request comes back before the waiting ones that come after
  it in that order (under fcfs: all of them).

Asynchronous scheduling: `schedule` commits the step it returns at once (num_computed_tokens advanced, a placeholder
counted for every token the step samples), so the next step can be scheduled before this one's tokens reach the
host. A sequence that has all the tokens max_tokens and max_model_len allow is not scheduled again (it finishes when
its last token arrives); one with a placeholder is never prefilled (a recompute waits for its token). The step
output carries diffs for the runner's persistent rows: sequences that left the running set, block tables that
changed.

Speculative decoding: a decoding sequence with proposed tokens (`Sequence.spec_tokens`, set by the engine) runs them
after its last token, as one chunk of 1 + n tokens (fewer when the budget or its length limit runs out), and a step
holding such a chunk is prefill-shaped; slots for the draft loop's writes are allocated past the chunk
(`spec_lookahead`), and the engine truncates back to what was accepted.

Host cost: a decode step touches each running sequence once, with an allocation that is a few comparisons unless
the sequence needs a new block (`BlockManager.allocate_slots`'s fast path); counts the step loop needs (seats
taken) are kept as they change rather than summed per step.
"""

from __future__ import annotations

import bisect
import dataclasses
import logging
import statistics
from collections import deque

from jaxpaged.config import CacheConfig, SchedulerConfig
from jaxpaged.core.block_manager import BlockManager
from jaxpaged.core.request import Sequence, SequenceStatus
from jaxpaged.core.sched_output import SchedulerOutput

logger = logging.getLogger(__name__)

PREFILL_TILE = 16  # prefill segments start at multiples of this many tokens (see pallas_kernels/reference.py)


def round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


PACED_CHUNK_UNIT = 4  # mixed steps: the pacer's bound is a multiple of this many tokens (and at least this many)
PACER_WINDOW = 8  # the step times the pacer estimates from: the last this many of each kind


@dataclasses.dataclass
class StepPacer:
    """The prompt-token bound of steps that run while sequences decode, kept so that such a step delays a stream's
    next token by at most (slowdown - 1) decode steps: a mixed step may take `slowdown` decode steps, a prefill step
    between two decode steps (separate steps) slowdown - 1.

    It learns from the step times the engine reports (`observe`). The reference is a decode-only step of as many
    decode rows as the paced step has (a decode step's time grows with its rows on CPU, once the weights' pass stops
    hiding them; a row count not seen yet takes the nearest fewer rows', or without any the fewest rows'): the median
    of the last PACER_WINDOW such steps, a typical step measured as the paced ones are, with the same noise (the
    host's other work on the same cores). From each paced step the pacer takes its excess time over that reference
    per prompt token, taken as proportional to the step's prompt tokens (their matmul rows and attention; a chunk
    deeper into a long prompt costs more per token), and estimates the upper median of the last PACER_WINDOW: a step's
    noise adds time to the step, not to each token, and divided by a small chunk's few tokens one slow step in eight
    would otherwise set the estimate. The next bound is the tokens that fit the allowed excess (slowdown - 1 reference
    steps), in multiples of `unit` (PREFILL_TILE for separate steps, whose prefill segments take whole tiles;
    PACED_CHUNK_UNIT for mixed steps, laid out token by token), at least one unit, at most `ceiling`, and at most
    twice the last bound.

    Not the fastest decode step, nor the largest excess: a typical paced step would then count the noise and rows
    that every step carries as its prompt tokens' cost, which, divided by a small chunk's tokens, holds chunks at a
    unit or two, and prompts that keep arriving queue for seconds (docs/benchmarks.md#serving)."""

    ceiling: int  # max_prefill_tokens_while_decoding (or the token budget)
    slowdown: float
    mixed_steps: bool
    bound: int = dataclasses.field(init=False)  # the prompt tokens a paced step may carry now; starts at ceiling
    # decode rows -> seconds of the last decode-only steps with that many rows
    decode_times: dict[int, deque] = dataclasses.field(init=False)
    rows_seen: list[int] = dataclasses.field(init=False)  # decode_times' keys, sorted
    excess_per_token: deque = dataclasses.field(init=False)  # seconds per prompt token of the last paced steps

    def __post_init__(self):
        self.bound = self.ceiling
        self.decode_times, self.rows_seen = {}, []
        self.excess_per_token = deque(maxlen=PACER_WINDOW)

    @property
    def unit(self) -> int:
        return PACED_CHUNK_UNIT if self.mixed_steps else PREFILL_TILE

    def decode_s(self, rows: int) -> float | None:
        """A decode-only step's time at `rows` decode rows: the median of the last ones with the most rows up to
        `rows`, else of the fewest rows seen (None before any)."""
        if not self.rows_seen:
            return None
        i = bisect.bisect_right(self.rows_seen, rows)
        return statistics.median_high(self.decode_times[self.rows_seen[max(i - 1, 0)]])

    def observe(self, out: SchedulerOutput, seconds: float) -> None:
        if out.prompt_tokens == 0:
            if out.seqs:
                rows = len(out.seqs)
                if rows not in self.decode_times:
                    self.decode_times[rows] = deque(maxlen=PACER_WINDOW)
                    bisect.insort(self.rows_seen, rows)
                self.decode_times[rows].append(seconds)
            return
        decode_s = self.decode_s(out.num_decodes)
        if not out.paced or decode_s is None:
            return
        excess = seconds - decode_s if self.mixed_steps else seconds
        self.excess_per_token.append(max(excess, 0.0) / out.prompt_tokens)
        per_token = statistics.median_high(self.excess_per_token)
        allowed = (self.slowdown - 1.0) * decode_s
        target = self.ceiling if per_token <= 0 else min(self.ceiling, allowed / per_token)
        target = min(target, 2 * self.bound)
        self.bound = max(self.unit, int(target) // self.unit * self.unit)
        logger.debug("pacer: %d prompt tokens in %.1f ms (decode step of %d rows %.1f ms): next bound %d",
                     out.prompt_tokens, 1e3 * seconds, out.num_decodes, 1e3 * decode_s, self.bound)


class Scheduler:
    def __init__(self, scheduler_config: SchedulerConfig, cache_config: CacheConfig, block_manager: BlockManager,
                 mixed_steps: bool = False):
        self.config = scheduler_config
        self.mixed_steps = mixed_steps
        self.pacer: StepPacer | None = None
        if scheduler_config.max_decode_slowdown is not None:
            ceiling = scheduler_config.max_prefill_tokens_while_decoding or scheduler_config.max_num_batched_tokens
            self.pacer = StepPacer(ceiling, scheduler_config.max_decode_slowdown, mixed_steps)
        self.cache_config = cache_config
        self.block_manager = block_manager
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []  # in `_order`: arrival (priority first under priority scheduling)
        self.swapped: list[Sequence] = []  # in `_order`
        self.num_preemptions = {"recompute": 0, "swap": 0}
        self._last_was_prefill = False
        # Running sequences plus the seats their requests will take when they fork: the n - 1 samples of a parent
        # that has not forked yet, the beam_width - 1 beams of a beam search before its first step. Admission counts
        # them all, so forks that come later never push a step past max_num_seqs.
        self.seats_taken = 0
        self._removed: list[int] = []  # seq ids that left the running set since the last step (the runner's diff)
        # Running sequences that may be in prefill: a sequence is only ever in prefill after it entered the running
        # set (admitted, forked, swapped in), so those are the ones to look at, not every running sequence at every
        # step (`_prefilling`); the ones found decoding leave it.
        self._entered: dict[int, Sequence] = {}
        self.missed_prefills = 0  # sequences in prefill found by the decode loop instead (tests expect none)

    # ---- queue management -------------------------------------------------------------------------------------

    def add(self, seq: Sequence) -> None:
        seq.status = SequenceStatus.WAITING
        if self.config.policy == "priority" and self.waiting and _order(seq) < _order(self.waiting[-1]):
            self._insert_in_order(self.waiting, seq)
        else:
            self.waiting.append(seq)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running or self.swapped)

    def fork(self, parent: Sequence, children: list[Sequence]) -> None:
        """Children made by `parent.fork` (n > 1 samples, beams) share all its blocks (the last one is copied on
        write) and run from the next step. A parent preempted meanwhile (a beam whose group chose the next beams
        after it had given its own candidates and been preempted) has no blocks on the device: its children are
        recomputed."""
        for child in children:
            if parent.status is SequenceStatus.RUNNING:
                self.block_manager.fork(parent.seq_id, child.seq_id)
                child.num_computed_tokens = parent.num_computed_tokens
            else:
                child.num_computed_tokens = 0
            child.status = SequenceStatus.RUNNING
            self._insert_running(child)

    def finish(self, seq: Sequence, reason: str) -> None:
        """Removes a sequence from whichever queue holds it and frees its blocks (cached blocks stay reusable)."""
        status = seq.status
        seq.status, seq.finish_reason = SequenceStatus.FINISHED, reason
        if status is SequenceStatus.RUNNING:
            self._remove_running(seq)
        elif status is SequenceStatus.SWAPPED:
            self.swapped.remove(seq)
        elif status is SequenceStatus.WAITING and seq in self.waiting:
            self.waiting.remove(seq)
        # Blocks that filled with tokens known only after their last allocation (asynchronous scheduling) join the
        # prefix cache now, as they would have at allocation with a synchronous step.
        if reason != "error":
            self.block_manager.cache_full_blocks(seq.seq_id, seq.token_ids)
        self.block_manager.free(seq.seq_id)

    # ---- one step -----------------------------------------------------------------------------------------------

    def schedule(self) -> SchedulerOutput | None:
        out = SchedulerOutput(is_prefill=True)
        self._swap_in(out)
        if self.mixed_steps:
            self._schedule_decodes(out)
            num_decodes, verifies = len(out.seqs), out.is_prefill and bool(out.seqs)
            self._schedule_prefills(out, self.config.max_num_batched_tokens - sum(out.num_new_tokens))
            out.is_prefill = len(out.seqs) > num_decodes or verifies
        else:
            # After a prefill step, running sequences that wait for a token get a decode step before the next
            # prefill, so a long queue of prompts never stalls the streams already running for more than one step.
            decodes_waiting = self._last_was_prefill and any(decodable(s) for s in self.running)
            if not decodes_waiting:
                self._schedule_prefills(out, self.config.max_num_batched_tokens)
            if not out.seqs:
                out.is_prefill = False
                self._schedule_decodes(out)
            self._last_was_prefill = out.is_prefill and bool(out.seqs)
        out.blocks_to_copy = self.block_manager.pop_copies()
        if not out.seqs and not (out.blocks_to_swap_in or out.blocks_to_swap_out):
            return None
        self._commit(out)
        return out

    def _commit(self, out: SchedulerOutput) -> None:
        """The step is decided: its sequences' computed tokens advance now, and each one it samples for counts a
        placeholder until the token reaches the host; the runner's diffs are handed over. (Decodes were committed as
        they were scheduled, `_schedule_decodes`: they lead the step's rows; the prompt chunks after them are
        committed here.)"""
        for i in range(len(out.starts), len(out.seqs)):
            _commit_row(out, out.seqs[i], out.num_new_tokens[i])
        out.removed, self._removed = self._removed, []
        out.changed_tables = self.block_manager.pop_changed_tables()

    def _swap_in(self, out: SchedulerOutput) -> None:
        # Swapped requests arrived before every waiting one (under fcfs): bring them back first; under priority
        # scheduling, not before a waiting request that comes first (`_waiting_first`).
        while (self.swapped and not self._waiting_first()
               and self.seats_taken + _seats(self.swapped[0]) <= self.config.max_num_seqs):
            seq = self.swapped[0]
            if not self.block_manager.can_swap_in([seq.seq_id], self._swap_in_headroom(seq)):
                break
            out.blocks_to_swap_in += self.block_manager.swap_in([seq.seq_id])
            self.swapped.pop(0)
            seq.status = SequenceStatus.RUNNING
            self._insert_running(seq)

    def _swap_in_headroom(self, seq: Sequence) -> int:
        """Blocks that must stay free beside `seq` swapped back in. Under priority scheduling a request that comes
        after every running one would be the first preempted when one of them needs a block: it comes back only with
        a block free for each of them, or it would go out and in again every step. Otherwise none (under fcfs it
        arrived before them: they would go first)."""
        if self.config.policy != "priority" or not self.running or _order(seq) < _order(self.running[-1]):
            return 0
        return len(self.running)

    def _waiting_first(self) -> bool:
        """Under priority scheduling, whether the first waiting request comes before the first swapped one (a lower
        priority value, or an equal one and an earlier arrival); under fcfs never (swapped requests arrived first)."""
        return (self.config.policy == "priority" and bool(self.waiting) and bool(self.swapped)
                and _order(self.waiting[0]) < _order(self.swapped[0]))

    def observe_step(self, out: SchedulerOutput, seconds: float) -> None:
        """The engine reports how long a scheduled step took on the device (for the pacer)."""
        if self.pacer is not None:
            self.pacer.observe(out, seconds)

    def _schedule_prefills(self, out: SchedulerOutput, budget: int) -> None:
        bound = self.pacer.bound if self.pacer is not None else self.config.max_prefill_tokens_while_decoding
        if bound is not None:
            # the sequences whose next token waits for this step: its decodes (mixed steps; they were decodable
            # before they were committed), else the rows of the decode step that comes next (separate steps; the
            # running set, near enough, and counted without a pass over it)
            if out.seqs:
                out.num_decodes = len(out.seqs)
            elif any(decodable(s) for s in self.running):
                out.num_decodes = len(self.running)
            if out.num_decodes:
                out.paced = True
                budget = min(budget, bound)
        # Mixed steps lay a step's tokens out one after another, so a paced chunk may be any number of tokens (the
        # pacer's bound can be below a tile on a slow machine); elsewhere a segment takes whole tiles.
        unit = 1 if self.mixed_steps and out.paced else PREFILL_TILE
        # Running sequences still in prefill (a chunked or recomputed prompt, or forked samples) continue before
        # new ones start; they may preempt newer requests for room, as decodes do (`_prefilling` finds them among
        # the sequences that entered the running set lately). A parent ready to fork is one of them.
        prefilling = self._prefilling()
        forks = [s for s in prefilling if s.fork_pending and s.num_uncomputed_tokens == 1]
        for seq in forks:
            self._fork(seq, out)
        if forks:  # the children joined the running set, in prefill
            prefilling = self._prefilling()
        for seq in prefilling:
            if seq.status is SequenceStatus.RUNNING:
                budget = self._try_prefill(seq, budget, out, preempt=True, unit=unit)
            if budget < unit:
                return
        while self.waiting and (not self.swapped or self._waiting_first()) and budget >= unit:
            seq = self.waiting[0]
            if seq.num_placeholders or self.seats_taken + _seats(seq) > self.config.max_num_seqs:
                return  # a preempted sequence whose last token is still on the device waits for it
            # (a request that wants its prompt's log-probs computes every prompt token: no prefix-cache hit)
            if (seq.num_computed_tokens == 0 and self.cache_config.enable_prefix_caching
                    and seq.params.prompt_logprobs is None):
                hit = self.block_manager.take_cached_prefix(seq.seq_id, seq.token_ids)
                seq.num_computed_tokens = hit
                if seq.num_preemptions == 0:
                    seq.num_cached_prompt_tokens = hit
            if seq.fork_pending and seq.num_uncomputed_tokens == 1:
                # Nothing to prefill before the fork (a 1-token prompt, or a prefix-cache hit): fork now.
                if not self.block_manager.allocate_slots(seq.seq_id, seq.token_ids, seq.num_computed_tokens):
                    self._unadmit(seq)
                    return
                self._admit(seq)
                for s in [seq, *self._fork(seq, out)]:
                    budget = self._try_prefill(s, budget, out, preempt=False, unit=unit)
                continue
            new_budget = self._try_prefill(seq, budget, out, preempt=False, unit=unit)
            if new_budget == budget:  # no room in the pool: FCFS, so nobody behind it goes first
                self._unadmit(seq)
                return
            budget = new_budget
            self._admit(seq)

    def _admit(self, seq: Sequence) -> None:
        self.waiting.remove(seq)
        seq.status = SequenceStatus.RUNNING
        self._insert_running(seq)

    def _unadmit(self, seq: Sequence) -> None:
        """Gives back the prefix-cache blocks a waiting request took before it turned out not to fit."""
        self.block_manager.free(seq.seq_id)
        seq.num_computed_tokens = 0

    def _fork(self, parent: Sequence, out: SchedulerOutput) -> list[Sequence]:
        """n > 1: the parent's prompt is in the cache but for its last token; children share all its blocks."""
        children = [parent.fork(sample_index=i) for i in range(1, parent.fork_pending + 1)]
        self.seats_taken -= parent.fork_pending  # the children take those seats now, as running sequences
        parent.fork_pending = 0
        self.fork(parent, children)
        out.forked.append((parent, children))
        return children

    def _try_prefill(self, seq: Sequence, budget: int, out: SchedulerOutput, preempt: bool,
                     unit: int = PREFILL_TILE) -> int:
        """Schedules as much of the sequence's missing tokens as the budget allows; returns the budget left."""
        num_new = min(seq.num_uncomputed_tokens - (1 if seq.fork_pending else 0), budget)
        # Budgets count unit-padded tokens, so the padded batch never exceeds the largest compiled shape.
        if round_up(num_new, unit) > budget:
            num_new = (budget // unit) * unit
        if num_new <= 0:
            return budget
        num_tokens = seq.num_computed_tokens + num_new
        if num_tokens == seq.num_tokens:  # the chunk samples: the draft loop may write past it
            num_tokens = min(num_tokens + seq.spec_lookahead, seq.token_limit)
        if preempt:
            if not self._allocate_or_preempt(seq, num_tokens, out):
                return budget
        elif not self.block_manager.allocate_slots(seq.seq_id, seq.token_ids, num_tokens):
            return budget
        out.add(seq, num_new)
        out.prompt_tokens += num_new
        return budget - round_up(num_new, unit)

    def _schedule_decodes(self, out: SchedulerOutput) -> None:
        """One token of every decoding sequence (and the proposals it verifies), oldest first, each committed as it
        is scheduled (`_commit_row`, inline for a plain decode): this loop runs for every running sequence at every
        step, so it reads each sequence once, and a slot in the block a sequence writes now and holds alone (the
        block manager's `writable`) is taken in place, without a call."""
        bm = self.block_manager
        allocate, writable, slots = bm.allocate_slots, bm.writable.get, bm.seq_tokens
        out.is_prefill = False  # until a sequence verifies proposals: then the step is prefill-shaped
        budget, per_row = self._verify_budget()
        seqs, starts = out.seqs, out.starts
        running = SequenceStatus.RUNNING
        for seq in list(self.running):  # oldest first
            tokens = seq.token_ids
            num_tokens = len(tokens) + seq.num_placeholders
            start = seq.num_computed_tokens
            # `decodable`, inline
            if (num_tokens - start != 1 or num_tokens == seq.num_prompt_tokens
                    or num_tokens >= seq.token_limit or seq.status is not running):
                # a prompt in prefill, a beam waiting for its group, one that has all its tokens, preempted
                if ((num_tokens - start > 1 or num_tokens == seq.num_prompt_tokens) and seq.status is running
                        and seq.seq_id not in self._entered):  # in prefill, unseen by `_prefilling`: never stall it
                    self._entered[seq.seq_id] = seq
                    self.missed_prefills += 1
                continue
            spec = seq.spec_tokens
            if not spec and not seq.spec_lookahead:  # a plain decode: one slot, most often in a block it holds
                seq_id = seq.seq_id
                if num_tokens <= writable(seq_id, 0):  # BlockManager.allocate_slots's fast path, inline
                    have = slots[seq_id]
                    if have < num_tokens:
                        slots[seq_id] = num_tokens
                        bm.num_device_tokens += num_tokens - have
                    ok = True
                else:
                    ok = allocate(seq_id, tokens, num_tokens)
                if not ok:  # preemption may take rows out of the step: every row's fields complete first
                    _filled(out)
                    ok = self._allocate_or_preempt(seq, num_tokens, out)
                if ok:
                    # `_commit_row` of one new token that samples, inline; its constant fields (1 new token,
                    # samples, no proposals) are filled in for all such rows at once (`_filled`)
                    seqs.append(seq)
                    starts.append(start)
                    seq.num_computed_tokens = num_tokens
                    seq.num_placeholders += 1
                continue
            _filled(out)
            if spec:  # speculative decoding: verify the proposals too, as far as the budget and the length allow
                keep = max(0, min(len(spec), seq.token_limit - num_tokens - 1, budget, per_row))
                del spec[keep:]
                out.is_prefill = out.is_prefill or keep > 0
            want = num_tokens + len(spec)
            if seq.spec_lookahead:
                want = min(want + seq.spec_lookahead, seq.token_limit)
            if allocate(seq.seq_id, seq.token_ids, want) or self._allocate_or_preempt(seq, want, out):
                out.add(seq, 1 + len(spec))
                _commit_row(out, seq, 1 + len(spec))
                budget -= len(spec)
            else:
                spec.clear()  # preempted: its proposals go with it
        _filled(out)

    def _verify_budget(self) -> tuple[int, int]:
        """(proposed tokens a decode step may verify in all, per sequence). Mixed steps lay tokens out one by one:
        the token budget past one token per running sequence. Separate steps pad every sequence of a prefill-shaped
        step to a query tile: proposals only when every running sequence's tile fits the budget, and then at most
        a tile's worth (last token + 15) per sequence."""
        budget = self.config.max_num_batched_tokens - len(self.running)
        if self.mixed_steps:
            return max(budget, 0), budget
        if len(self.running) * PREFILL_TILE > self.config.max_num_batched_tokens:
            return 0, 0
        return (PREFILL_TILE - 1) * len(self.running), PREFILL_TILE - 1

    def _allocate_or_preempt(self, seq: Sequence, num_tokens: int, out: SchedulerOutput) -> bool:
        """Gives `seq` slots for `num_tokens` tokens, preempting the newest running requests (the last in
        `_order`: under priority scheduling, the lowest priority's newest) until it fits.

        Returns False when `seq` itself was the newest and got preempted.
        """
        while not self.block_manager.allocate_slots(seq.seq_id, seq.token_ids, num_tokens):
            victim = self.running[-1]
            out.drop(victim)  # first: a decode of this step committed already goes back to before it
            self._preempt(victim, out)
            if victim is seq:
                return False
        return True

    # ---- preemption ---------------------------------------------------------------------------------------------

    def _preempt(self, seq: Sequence, out: SchedulerOutput) -> None:
        self._remove_running(seq)
        seq.num_preemptions += 1
        seq.draft_loop_from = -1  # its draft K/V is rebuilt by its recompute, or moved by a swap: never assumed
        blocks = len(self.block_manager.block_table(seq.seq_id))
        use_swap = self.cache_config.preemption_mode == "swap" and self.block_manager.can_swap_out([seq.seq_id])
        if use_swap:
            out.blocks_to_swap_out += self.block_manager.swap_out([seq.seq_id])
            seq.status = SequenceStatus.SWAPPED
            self._insert_in_order(self.swapped, seq)
            self.num_preemptions["swap"] += 1
        else:
            self.block_manager.free(seq.seq_id)
            seq.num_computed_tokens = 0
            seq.draft_stale = False  # its recompute writes a draft's K/V again, unless that step skips the draft
            seq.status = SequenceStatus.WAITING
            if self.config.policy == "priority":
                self._insert_in_order(self.waiting, seq)
            else:
                self.waiting.appendleft(seq)  # older than everything still waiting
            self.num_preemptions["recompute"] += 1
        out.preempted.append(seq)
        logger.info("preempted request %s (%s, %d blocks, %d tokens)", seq.request_id,
                    "swap" if use_swap else "recompute", blocks, seq.num_tokens)

    def _insert_running(self, seq: Sequence) -> None:
        self.seats_taken += _seats(seq)
        self._insert_in_order(self.running, seq)
        self._entered[seq.seq_id] = seq

    def _prefilling(self) -> list[Sequence]:
        """The running sequences in prefill (`Sequence.is_prefill`, inline), in running order, from those that
        entered the running set since they were last seen decoding."""
        running = SequenceStatus.RUNNING
        found = [s for s in self._entered.values() if s.status is running and (
            len(s.token_ids) + s.num_placeholders - s.num_computed_tokens > 1
            or len(s.token_ids) + s.num_placeholders == s.num_prompt_tokens)]
        if len(found) != len(self._entered):
            self._entered = {s.seq_id: s for s in found}
        found.sort(key=_order)
        return found

    def check_invariants(self) -> None:
        """Raises AssertionError where the scheduler's own bookkeeping disagrees with its queues (tests)."""
        scanned = [s for s in self.running if s.is_prefill]
        assert self.missed_prefills == 0 and all(s.seq_id in self._entered for s in scanned), (
            f"running sequences in prefill that `_prefilling` did not see ({self.missed_prefills} found late): "
            f"{[s.seq_id for s in scanned if s.seq_id not in self._entered]}")

    def _remove_running(self, seq: Sequence) -> None:
        self.running.remove(seq)
        self.seats_taken -= _seats(seq)
        self._removed.append(seq.seq_id)

    @staticmethod
    def _insert_in_order(queue: list[Sequence] | deque[Sequence], seq: Sequence) -> None:
        queue.insert(bisect.bisect(queue, _order(seq), key=_order), seq)


def _filled(out: SchedulerOutput) -> None:
    """Plain decode rows scheduled since the last call get their constant fields: one new token, which samples, no
    proposals (`_schedule_decodes` appends only their sequence and start)."""
    k = len(out.seqs) - len(out.num_new_tokens)
    if k:
        out.num_new_tokens += [1] * k
        out.samples += [True] * k
        out.num_spec += [0] * k
        out.drafts += [False] * k


def _commit_row(out: SchedulerOutput, seq: Sequence, n: int) -> None:
    """Commits one scheduled row of n new tokens: its computed tokens advance, and a row that samples counts a
    placeholder until its token reaches the host."""
    start = seq.num_computed_tokens
    out.starts.append(start)
    end = seq.num_computed_tokens = start + n
    extra = end - len(seq.token_ids) - seq.num_placeholders  # proposed tokens verified here (if >= 0)
    if extra >= 0:
        seq.num_placeholders += 1
        out.samples.append(True)
        out.num_spec.append(extra)
        out.drafts.append(seq.spec_lookahead > 0)
    else:
        out.samples.append(False)
        out.num_spec.append(0)
        out.drafts.append(False)


def _order(seq: Sequence) -> tuple[int, float, int]:
    """Where a sequence goes in the scheduler's queues: by priority (0 for every request under fcfs), then arrival."""
    return seq.priority, seq.arrival_time, seq.seq_id


def _seats(seq: Sequence) -> int:
    """The running seats a sequence takes: itself and the forks its request will make."""
    return 1 + seq.fork_pending + seq.extra_beams


def decodable(seq: Sequence) -> bool:
    """Its cache holds everything but the last sampled token, and it may have another token."""
    num_tokens = len(seq.token_ids) + seq.num_placeholders
    return (num_tokens - seq.num_computed_tokens == 1 and num_tokens != seq.num_prompt_tokens
            and num_tokens < seq.token_limit)
