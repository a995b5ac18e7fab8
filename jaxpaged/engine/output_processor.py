"""What a request gives its caller, from the engine's token ids: text (incremental detokenization), stop strings,
log-probs and the output kinds (cumulative, deltas, final only). It runs off the engine's step path: in the server's
reader tasks, or in `LLM.generate` after each step.

One `RequestState` per request folds the engine's `EngineOutput`s into `RequestOutput`s. Text is decoded as tokens
arrive only where someone reads it as it grows (streamed outputs) or a stop string must be found; a request that
wants its final output alone and has no stop string is decoded once, when it finishes. A stop string ends a sequence
here, as its tokens arrive: `take_stopped` then gives the caller the sequences to stop in the engine
(`Engine.stop_sequences`; the engine may have run a step or two past the stop string: those tokens are dropped).
"""

from __future__ import annotations

import dataclasses
import time

from jaxpaged.engine.detokenizer import Detokenizer
from jaxpaged.outputs import (
    CompletionOutput,
    EngineOutput,
    Logprob,
    PositionLogprobs,
    PromptLogprobs,
    RequestOutput,
    SampleLogprobs,
    SeqDelta,
)
from jaxpaged.sampling_params import RequestOutputKind, SamplingParams


@dataclasses.dataclass
class _SeqState:
    token_ids: list[int] = dataclasses.field(default_factory=list)
    top_logprobs: SampleLogprobs | None = None
    logprob_sum: float = 0.0  # of its tokens' log-probs (cumulative_logprob)
    detokenizer: Detokenizer | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    cumulative_logprob: float | None = None  # beam search: the hypothesis' sum
    sent_tokens: int = 0  # DELTA: tokens and characters already given out
    sent_chars: int = 0


class RequestState:
    """One request's output as its caller sees it (see the module docstring)."""

    def __init__(self, tokenizer, request_id: str, prompt: str | None, prompt_token_ids: list[int],
                 params: SamplingParams, arrival_time: float):
        self.tokenizer = tokenizer
        self.request_id = request_id
        self.prompt = prompt
        self.prompt_token_ids = prompt_token_ids
        self.params = params
        self.arrival_time = arrival_time
        self.kind = params.output_kind
        # decoded as it grows: someone reads it as it grows, or a stop string must be found in it
        self.incremental = params.detokenize and (self.kind != RequestOutputKind.FINAL_ONLY or bool(params.stop))
        self.seqs: dict[int, _SeqState] = {}
        self.finished = False
        self._stopped: list[int] = []  # sequences a stop string ended here that the engine has not been told of
        self.num_cached_tokens = 0
        self.first_token_time: float | None = None
        self.error: str | None = None
        self.prompt_logprobs: PromptLogprobs | None = None
        self._token_texts: dict[int, str] = {}  # token id -> its text alone (log-probs' decoded_token)

    def update(self, out: EngineOutput) -> RequestOutput | None:
        """Folds one engine output in; returns what the caller should see now (None: nothing for FINAL_ONLY yet)."""
        self.num_cached_tokens = out.num_cached_tokens or self.num_cached_tokens
        self.first_token_time = self.first_token_time or out.first_token_time
        if out.prompt_logprobs is not None and self.prompt_logprobs is None:
            self.prompt_logprobs = [None if e is None else self._decoded(e) for e in out.prompt_logprobs]
        for delta in out.deltas:
            self._add(delta)
        if out.error is not None:
            self.error = out.error
        ended = len(self.seqs) >= self.params.n and all(s.finish_reason is not None for s in self.seqs.values())
        self.finished = self.finished or out.finished or ended
        if self.kind == RequestOutputKind.FINAL_ONLY and not self.finished:
            return None
        return self.output()

    def _add(self, delta: SeqDelta) -> None:
        seq = self.seqs.get(delta.index)
        if seq is None:
            seq = self.seqs[delta.index] = _SeqState()
            if self.params.logprobs is not None:
                seq.top_logprobs = []
            if self.incremental and self.tokenizer is not None:
                p = self.params
                seq.detokenizer = Detokenizer(self.tokenizer, p.skip_special_tokens, p.stop,
                                              p.include_stop_str_in_output)
        if delta.cumulative_logprob is not None:
            seq.cumulative_logprob = delta.cumulative_logprob
        if seq.finish_reason is not None and seq.finish_reason != "error":
            return  # ended here by a stop string: what the engine ran past it is dropped
        last = len(delta.token_ids) - 1
        for j, token in enumerate(delta.token_ids):
            seq.token_ids.append(token)
            if seq.top_logprobs is not None and delta.top_logprobs is not None:
                position = delta.top_logprobs[j]
                seq.logprob_sum += position.logprob
                seq.top_logprobs.append(self._decoded(position))
            if seq.detokenizer is None:
                continue
            detok = seq.detokenizer
            before = len(detok.text)
            detok.add(seq.token_ids)
            # EOS and stop tokens (the engine's "stop" on the last token) take precedence over a stop string
            token_stop = j == last and delta.finish_reason == "stop"
            if (not token_stop and len(seq.token_ids) >= self.params.min_tokens
                    and detok.check_stop(len(detok.text) - before) is not None):
                seq.finish_reason, seq.stop_reason = "stop", detok.stopped_on
                if delta.finish_reason is None:
                    self._stopped.append(delta.index)
                return
        if delta.finish_reason is not None:
            seq.finish_reason, seq.stop_reason = delta.finish_reason, delta.stop_reason

    def _decoded(self, position: PositionLogprobs) -> dict[int, Logprob]:
        """A position's `Logprob` dict, each token's text in it (vLLM's decoded_token: the token decoded alone) unless
        nothing is decoded (detokenize=False, no tokenizer)."""
        if self.tokenizer is None or not self.params.detokenize:
            return position.entries()
        texts = self._token_texts
        for i in (position.token, *position.top_ids):
            if i not in texts:
                texts[i] = self.tokenizer.decode([i])
        return position.entries(texts)

    def take_stopped(self) -> list[int]:
        """Indices of the sequences a stop string ended since the last call, which the engine still runs."""
        stopped, self._stopped = self._stopped, []
        return stopped

    def output(self) -> RequestOutput:
        """The request's output now, in its output kind."""
        delta = self.kind == RequestOutputKind.DELTA
        outs = []
        for index in sorted(self.seqs):
            seq = self.seqs[index]
            done = seq.finish_reason is not None
            text = self._text(seq, done)
            tokens, logprobs = seq.token_ids, seq.top_logprobs
            cum = seq.cumulative_logprob if seq.cumulative_logprob is not None else (
                seq.logprob_sum if seq.top_logprobs is not None else None)
            if delta:  # what is new since this sequence's previous output
                sent_tokens, sent_chars = seq.sent_tokens, seq.sent_chars
                seq.sent_tokens, seq.sent_chars = len(tokens), max(sent_chars, len(text))
                text, tokens = text[sent_chars:], tokens[sent_tokens:]
                logprobs = logprobs[sent_tokens:] if logprobs is not None else None
            outs.append(CompletionOutput(index, text, list(tokens), cum, list(logprobs) if logprobs is not None
                                         else None, seq.finish_reason, seq.stop_reason))
        metrics = {"arrival_time": self.arrival_time, "first_token_time": self.first_token_time or 0.0}
        if self.finished:
            metrics["finished_time"] = time.monotonic()
        return RequestOutput(self.request_id, self.prompt, list(self.prompt_token_ids), outs, self.finished,
                             self.num_cached_tokens, metrics, self.error, self.prompt_logprobs)

    def _text(self, seq: _SeqState, done: bool) -> str:
        if seq.detokenizer is not None:
            return seq.detokenizer.visible_text(done)
        if self.tokenizer is None or not seq.token_ids or not self.params.detokenize:
            return ""
        return self.tokenizer.decode(seq.token_ids, skip_special_tokens=self.params.skip_special_tokens)


__all__ = ["RequestState"]
