"""What the scheduler decided for one step, as the runner needs it: the sequences to run and their token counts, and
what changed since the previous step (rows to drop, block tables that changed, block copies and swaps).

The runner keeps a persistent copy of the running sequences' rows (`jaxpaged.worker.input_batch`) and applies these
changes to it, so a step costs O(what changed) in host work, not O(every row's whole state).
"""

from __future__ import annotations

import dataclasses

from jaxpaged.core.request import Sequence


@dataclasses.dataclass(slots=True)
class ScheduledSeq:
    """One scheduled sequence (a view for callers that walk the step sequence by sequence)."""

    seq: Sequence
    num_new_tokens: int  # tokens [start, start + num_new_tokens) run this step
    start: int  # num_computed_tokens before this step
    samples: bool  # the step's logits give the sequence a new token

    @property
    def is_decode(self) -> bool:
        """One token past the prompt, sampling the next: a decode (else a prompt chunk or a recompute)."""
        return self.num_new_tokens == 1 and self.samples and self.start >= self.seq.num_prompt_tokens


@dataclasses.dataclass
class SchedulerOutput:
    is_prefill: bool  # the step runs prompt tokens (and, in a mixed step, decodes too): the runner's prefill shapes
    # The step's sequences in row order and, per sequence, its new tokens, its computed tokens before the step
    # (`start`) and whether it samples. The scheduler has already advanced num_computed_tokens and added a
    # placeholder for every sampled token (`Sequence.num_placeholders`).
    seqs: list[Sequence] = dataclasses.field(default_factory=list)
    num_new_tokens: list[int] = dataclasses.field(default_factory=list)
    starts: list[int] = dataclasses.field(default_factory=list)
    samples: list[bool] = dataclasses.field(default_factory=list)
    # speculative decoding: proposed tokens each sequence verifies in this step (its new tokens are its last token
    # and these), and whether the step's draft loop proposes for it afterwards (slots allocated ahead for that)
    num_spec: list[int] = dataclasses.field(default_factory=list)
    drafts: list[bool] = dataclasses.field(default_factory=list)
    # a separate draft model runs over the step's tokens (keeping its K/V beside the target's); the engine turns it
    # off for steps where no row may speculate soon (above disable_by_batch_size)
    draft_kv: bool = True
    # diffs since the previous step
    removed: list[int] = dataclasses.field(default_factory=list)  # seq ids that left the running set
    changed_tables: dict[int, list[int]] = dataclasses.field(default_factory=dict)  # seq id -> its whole table
    blocks_to_copy: list[tuple[int, int]] = dataclasses.field(default_factory=list)  # (src, dst) device blocks
    blocks_to_swap_out: list[tuple[int, int]] = dataclasses.field(default_factory=list)  # (device, host)
    blocks_to_swap_in: list[tuple[int, int]] = dataclasses.field(default_factory=list)  # (host, device)
    preempted: list[Sequence] = dataclasses.field(default_factory=list)
    # n > 1: (parent, its new sample sequences) forked this step; the engine adds them to their request's outputs
    forked: list[tuple[Sequence, list[Sequence]]] = dataclasses.field(default_factory=list)
    prompt_tokens: int = 0  # prompt (and recomputed) tokens among the scheduled ones
    paced: bool = False  # the prompt tokens were bounded because sequences wait to decode (the pacer's steps)
    num_decodes: int = 0  # a paced step: the sequences waiting for it to decode (its decode rows, on mixed steps)

    def add(self, seq: Sequence, num_new_tokens: int) -> None:
        self.seqs.append(seq)
        self.num_new_tokens.append(num_new_tokens)

    def drop(self, seq: Sequence) -> None:
        """Takes a sequence about to be preempted out of the step (before the step is committed). Rows committed as
        they were scheduled (the decodes, which lead the rows: `starts` is as long as they are) go back to before
        the step: computed tokens and placeholder."""
        for i in reversed(range(len(self.seqs))):
            if self.seqs[i] is seq:
                if i < len(self.starts):
                    seq.num_computed_tokens = self.starts[i]
                    seq.num_placeholders -= self.samples[i]
                    del self.starts[i], self.samples[i], self.num_spec[i], self.drafts[i]
                del self.seqs[i], self.num_new_tokens[i]

    @property
    def num_tokens(self) -> int:
        return sum(self.num_new_tokens)

    @property
    def scheduled(self) -> list[ScheduledSeq]:
        """The step sequence by sequence (built on demand; the runner reads the lists)."""
        if len(self.starts) != len(self.seqs):
            raise RuntimeError("the step is not committed yet: starts and samples are set by Scheduler.schedule")
        return [ScheduledSeq(*row) for row in zip(self.seqs, self.num_new_tokens, self.starts, self.samples,
                                                  strict=True)]
