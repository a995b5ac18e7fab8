"""A request's state on the host: its sequences, their tokens, how many are in the KV cache, and why they stopped.

A sequence's tokens live in one list, the prompt first, each sampled token appended once it is known on the host.
With asynchronous scheduling a sampled token can still be on the device when the next step is scheduled: the
sequence then counts it as a *placeholder* (`num_placeholders`), so the scheduler sees its true length and the next
step reads the token from the device, and the host appends the value a step later (`resolve`).
"""

from __future__ import annotations

import dataclasses
import enum
import itertools
import time

from jaxpaged.outputs import PositionLogprobs
from jaxpaged.sampling_params import SamplingParams


class SequenceStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    SWAPPED = "swapped"
    FINISHED = "finished"


_seq_ids = itertools.count()


@dataclasses.dataclass(eq=False, slots=True)
class Sequence:
    """One sequence of one request (one of n samples, or one beam).

    `num_computed_tokens` counts the tokens whose K/V are in the pool (or written by a step already dispatched); the
    rest still has to go through the model (a prompt, a chunk of it, or the last sampled token).
    """

    request_id: str
    token_ids: list[int]  # the prompt, then every output token known on the host (appended, never rebuilt)
    params: SamplingParams
    num_prompt_tokens: int = -1  # default: all of token_ids
    max_model_len: int | None = None  # with max_tokens, where the sequence stops for length (`token_limit`)
    arrival_time: float = dataclasses.field(default_factory=time.monotonic)
    seq_id: int = dataclasses.field(default_factory=lambda: next(_seq_ids))
    num_placeholders: int = 0  # sampled tokens the device has and the host does not yet (async scheduling)
    output_top_logprobs: list[PositionLogprobs] = dataclasses.field(default_factory=list)
    num_computed_tokens: int = 0
    num_cached_prompt_tokens: int = 0  # prefix-cache hit of the first prefill
    status: SequenceStatus = SequenceStatus.WAITING
    finish_reason: str | None = None  # "stop" | "length" | "abort" | "error"
    stop_reason: int | str | None = None  # the stop token id that ended it
    num_preemptions: int = 0
    sample_index: int = 0  # which of the request's n samples this is
    priority: int = 0  # the priority scheduling policy's: lower runs first (then arrival)
    # n > 1: the parent prefills all but the last prompt token, then forks this many children that share its blocks
    fork_pending: int = 0
    # beam search: running slots the request will take once its beams fork (beam_width - 1 before the first step)
    extra_beams: int = 0
    cum_logprob: float = 0.0  # beam search: the beam's accumulated log-probability
    first_token_time: float | None = None
    # Token ids that end it once it has min_tokens outputs: EOS (unless ignore_eos) and stop_token_ids (the engine's)
    stop_ids: frozenset[int] = frozenset()
    num_emitted: int = 0  # output tokens already handed out in the engine's outputs (deltas start after them)
    # Speculative decoding: tokens proposed to follow the last token, verified by the next step; and the slots past
    # the step's tokens that the step's draft loop writes into (a draft model's proposals for the step after)
    spec_tokens: list[int] = dataclasses.field(default_factory=list)
    spec_lookahead: int = 0
    # a separate draft model skipped some of its tokens (a decode step without the draft's run): the draft's K/V
    # has holes, so the sequence does not speculate with it again
    draft_stale: bool = False
    # a separate draft model's loop in the last verifying step wrote its K/V from this position on (-1: none), so a
    # step whose chunk starts here needs no draft run over it (`InputBatch.build`: the draft_run flag)
    draft_loop_from: int = -1
    token_limit: int = 0  # set in __post_init__: the length at which it stops for max_tokens or max_model_len

    def __post_init__(self):
        if self.num_prompt_tokens < 0:
            self.num_prompt_tokens = len(self.token_ids)
        limit = self.max_model_len if self.max_model_len is not None else 1 << 62
        if self.params.max_tokens is not None:
            limit = min(limit, self.num_prompt_tokens + self.params.max_tokens)
        self.token_limit = limit

    def fork(self, *, sample_index: int = 0, output_token_ids: list[int] | None = None,
             cum_logprob: float = 0.0) -> Sequence:
        """A new sequence of the same request with this one's prompt, its computed tokens (the K/V it will share
        through `Scheduler.fork`) and the given outputs: an n > 1 sample (`sample_index`), or a beam."""
        tokens = self.token_ids[:self.num_prompt_tokens] + list(output_token_ids or [])
        return Sequence(self.request_id, tokens, self.params, num_prompt_tokens=self.num_prompt_tokens,
                        max_model_len=self.max_model_len, arrival_time=self.arrival_time,
                        num_computed_tokens=self.num_computed_tokens,
                        num_cached_prompt_tokens=self.num_cached_prompt_tokens, sample_index=sample_index,
                        cum_logprob=cum_logprob, stop_ids=self.stop_ids, draft_stale=self.draft_stale,
                        priority=self.priority)

    def resolve(self, token: int) -> None:
        """The oldest placeholder's value has reached the host."""
        self.token_ids.append(token)
        self.num_placeholders -= 1

    @property
    def prompt_token_ids(self) -> list[int]:
        return self.token_ids[:self.num_prompt_tokens]

    @property
    def output_token_ids(self) -> list[int]:
        """The known output tokens (a copy)."""
        return self.token_ids[self.num_prompt_tokens:]

    @property
    def num_tokens(self) -> int:
        """Prompt, known outputs and placeholders."""
        return len(self.token_ids) + self.num_placeholders

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) + self.num_placeholders - self.num_prompt_tokens

    @property
    def num_uncomputed_tokens(self) -> int:
        return self.num_tokens - self.num_computed_tokens

    @property
    def is_prefill(self) -> bool:
        """More than the last sampled token is missing from the cache (a prompt, or a recomputed request)."""
        return self.num_uncomputed_tokens > 1 or self.num_tokens == self.num_prompt_tokens

    @property
    def at_limit(self) -> bool:
        """It has all the tokens max_tokens / max_model_len allow: finished, whatever its last token turns out to be."""
        return self.num_tokens >= self.token_limit

    @property
    def finished(self) -> bool:
        return self.status is SequenceStatus.FINISHED


@dataclasses.dataclass(eq=False)
class Request:
    """One request: its sequences (one, n samples once forked, or the live beams) and what the engine keeps for it.

    `grammar`, `matchers` and `beam` are the engine's (structured output, beam search); this module only holds them.
    """

    request_id: str
    prompt: str | None
    seqs: list[Sequence]
    seed: int
    arrival_time: float
    beam: object | None = None  # engine.beam_search.BeamState
    beam_results: dict[int, list[tuple[int, float]]] = dataclasses.field(default_factory=dict)  # seq_id -> top
    grammar: object | None = None  # structured output: a fresh matcher, copied for each sequence
    matchers: dict[int, object] = dataclasses.field(default_factory=dict)  # seq_id -> its advancing matcher
    # A thinking model's grammar (reasoning_parser): the tags' token ids (engine.reasoning.ThinkTokens), the phase a
    # sequence starts in, each sequence's phase once it moved, and the output index where its answer (which the
    # grammar constrains) starts. Without a gate every sequence is in its answer from its first token.
    think: object | None = None
    think_start: str = "answer"
    think_phase: dict[int, str] = dataclasses.field(default_factory=dict)  # seq_id -> phase
    answer_from: dict[int, int] = dataclasses.field(default_factory=dict)  # seq_id -> output index
    bad_words_ids: list[list[int]] = dataclasses.field(default_factory=list)  # token sequences not to generate
    allowed_mask: object | None = None  # allowed_token_ids as a bitmask [ceil(V / 32)] int32 (the engine's)
    # prompt_logprobs: one entry per prompt position scored so far (None for the first token), complete at
    # num_prompt_tokens entries; None when not asked for
    prompt_logprobs: list[PositionLogprobs | None] | None = None
    prompt_logprobs_sent: bool = False  # handed out in an output already
    # Its new tokens go out after every step (output kind not FINAL_ONLY, or stop strings for the output processor
    # to look for); else once, when it finishes.
    streams: bool = True
    speculates: bool = False  # speculative decoding may propose tokens for its sequences

    # Each step's input depends on the previous step's token on the host (a grammar's bitmask, bad words of several
    # tokens, beam selection): its steps run synchronously. (Penalties do not: the step counts the token the host
    # has not seen yet, `SamplingMetadata.pending_tokens`.) Set once, when it is made.
    needs_host_tokens: bool = dataclasses.field(init=False)
    # Of those, it needs them only for its next bitmask (a grammar, bad words), not to lay out the step: where the
    # sampler runs apart from the step (a GPU), the engine computes that bitmask after dispatching the step.
    masks_need_tokens: bool = dataclasses.field(init=False)
    # Its sampled tokens need nothing but appending and the stop checks (no beams, grammar or log-probs): the step
    # loop's fast path.
    plain: bool = dataclasses.field(init=False)

    def __post_init__(self):
        p = self.params
        self.needs_host_tokens = (self.beam is not None or self.grammar is not None
                                  or any(len(w) > 1 for w in self.bad_words_ids))
        self.masks_need_tokens = self.needs_host_tokens and self.beam is None
        self.plain = self.beam is None and self.grammar is None and p.logprobs is None and p.prompt_logprobs is None

    @property
    def params(self) -> SamplingParams:
        return self.seqs[0].params

    def seed_of(self, seq: Sequence) -> int:
        """Sample i of a seeded request draws from its own stream, reproducibly."""
        return (self.seed + seq.sample_index * 0x9E3779B97F4A7C15) % 2**63

    @property
    def finished(self) -> bool:
        return all(s.finished for s in self.seqs)
