"""A request's state on the host: its tokens, how many are in the KV cache, and why it stopped."""

from __future__ import annotations

import dataclasses
import enum
import itertools
import time

from jaxpaged.sampling_params import SamplingParams


class SequenceStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    SWAPPED = "swapped"
    FINISHED = "finished"


_seq_ids = itertools.count()


@dataclasses.dataclass(eq=False)
class Sequence:
    """One sequence of one request (n = 1).

    `num_computed_tokens` counts the tokens whose K/V are in the pool; the rest of `token_ids` still has to go
    through the model (a prompt, a chunk of it, or the last sampled token).
    """

    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    arrival_time: float = dataclasses.field(default_factory=time.monotonic)
    seq_id: int = dataclasses.field(default_factory=lambda: next(_seq_ids))
    output_token_ids: list[int] = dataclasses.field(default_factory=list)
    output_logprobs: list[float] = dataclasses.field(default_factory=list)
    output_top_logprobs: list[dict[int, float]] = dataclasses.field(default_factory=list)
    num_computed_tokens: int = 0
    num_cached_prompt_tokens: int = 0  # prefix-cache hit of the first prefill
    status: SequenceStatus = SequenceStatus.WAITING
    finish_reason: str | None = None  # "stop" | "length" | "abort"
    stop_reason: int | str | None = None  # the stop string or stop token id that ended it
    num_preemptions: int = 0
    sample_index: int = 0  # which of the request's n samples this is
    # n > 1: the parent prefills all but the last prompt token, then forks this many children that share its blocks
    fork_pending: int = 0
    # beam search: running slots the request will take once its beams fork (beam_width - 1 before the first step)
    extra_beams: int = 0
    cum_logprob: float = 0.0  # beam search: the beam's accumulated log-probability
    first_token_time: float | None = None

    def fork(self, *, sample_index: int = 0, output_token_ids: list[int] | None = None,
             cum_logprob: float = 0.0) -> Sequence:
        """A new sequence of the same request with this one's prompt, its computed tokens (the K/V it will share
        through `Scheduler.fork`) and the given outputs: an n > 1 sample (`sample_index`), or a beam."""
        return Sequence(self.request_id, list(self.prompt_token_ids), self.params, arrival_time=self.arrival_time,
                        output_token_ids=list(output_token_ids or []), num_computed_tokens=self.num_computed_tokens,
                        num_cached_prompt_tokens=self.num_cached_prompt_tokens, sample_index=sample_index,
                        cum_logprob=cum_logprob)

    @property
    def token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def num_uncomputed_tokens(self) -> int:
        return self.num_tokens - self.num_computed_tokens

    @property
    def is_prefill(self) -> bool:
        """More than the last sampled token is missing from the cache (a prompt, or a recomputed request)."""
        return self.num_uncomputed_tokens > 1 or not self.output_token_ids

    @property
    def finished(self) -> bool:
        return self.status is SequenceStatus.FINISHED
