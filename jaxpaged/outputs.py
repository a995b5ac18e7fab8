"""What a request gives back, shaped like vLLM's `RequestOutput`."""

from __future__ import annotations

import dataclasses
from typing import NamedTuple


@dataclasses.dataclass(slots=True)
class Logprob:
    """One token's entry in a log-probs dict (vLLM's `Logprob`): its log-prob under the model's distribution, its rank
    there (1 = the most likely; ties count as ahead) and its text alone (`tokenizer.decode([id])`; None with
    `detokenize=False`)."""

    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


# per position: {token id: Logprob} of the position's token and the top k (vLLM's SampleLogprobs, PromptLogprobs)
SampleLogprobs = list[dict[int, Logprob]]
PromptLogprobs = list[dict[int, Logprob] | None]  # None for the first prompt token


class PositionLogprobs(NamedTuple):
    """One position's log-probs as the engine hands them over (the output processor makes the `Logprob` dict, with
    each token's text, off the engine's thread): the position's token, its log-prob and rank, and the top k."""

    token: int
    logprob: float
    rank: int
    top_ids: list[int]  # [k], most likely first (ranks 1..k)
    top_logprobs: list[float]  # [k]

    def entries(self, texts: dict[int, str] | None = None) -> dict[int, Logprob]:
        """{token id: Logprob}: the token's entry first, then the top k's (vLLM's order; the token's entry is the
        top's when it is among them); `texts`: each token's decoded_token (None: not decoded)."""
        text = (lambda i: None) if texts is None else texts.get
        out = {self.token: Logprob(self.logprob, self.rank, text(self.token))}
        for rank, (i, value) in enumerate(zip(self.top_ids, self.top_logprobs, strict=True), start=1):
            out[i] = Logprob(value, rank, text(i))
        return out


@dataclasses.dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None = None
    logprobs: SampleLogprobs | None = None  # per token: the chosen token's entry first, then the top k's
    finish_reason: str | None = None  # "stop" | "length" | "abort" | "error"
    stop_reason: int | str | None = None

    def finished(self) -> bool:
        """Whether this sequence has ended (vLLM's method)."""
        return self.finish_reason is not None


@dataclasses.dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    num_cached_tokens: int = 0  # prompt tokens served from the prefix cache
    metrics: dict[str, float] = dataclasses.field(default_factory=dict)  # arrival, first_token, finished times
    error: str | None = None  # set when the request failed inside the engine (the other requests went on)
    # SamplingParams.prompt_logprobs: per prompt token, its entry and the top k's given the tokens before it
    prompt_logprobs: PromptLogprobs | None = None


@dataclasses.dataclass(slots=True)
class SeqDelta:
    """What one sequence of a request gained since its previous `EngineOutput`: token ids (no text; the output
    processor detokenizes), their log-probs when asked for, and why it finished."""

    index: int  # the sample's index (n > 1) or the hypothesis' rank (beam search)
    token_ids: list[int]
    top_logprobs: list[PositionLogprobs] | None = None  # each new token's log-prob, rank and top k
    finish_reason: str | None = None  # "stop" | "length" | "abort" | "error"
    stop_reason: int | str | None = None
    cumulative_logprob: float | None = None  # beam search: the hypothesis' sum


@dataclasses.dataclass(slots=True)
class EngineOutput:
    """What one engine step did for one request: the engine's side of `RequestOutput`, before detokenization and
    stop strings (`jaxpaged.engine.output_processor`)."""

    request_id: str
    deltas: list[SeqDelta]
    finished: bool
    num_cached_tokens: int = 0
    first_token_time: float | None = None
    error: str | None = None  # the request failed inside the engine (the other requests went on)
    prompt_logprobs: list[PositionLogprobs | None] | None = None  # once, complete (SamplingParams.prompt_logprobs)
