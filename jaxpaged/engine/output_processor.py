"""What a request gives back, from the tokens its sequences sample: log-probs, incremental detokenization, the stop
conditions (EOS, stop tokens, stop strings, length) and the output kinds (cumulative, deltas, final only).

The engine schedules and executes; it hands every sampled token to `OutputProcessor.add_token`, which says whether
(and why) the sequence finished, and asks `request_output` for a request's `RequestOutput`. Structured output's
grammar matchers stay with the engine (they also build the next step's token bitmask); the engine tells
`add_token` when a grammar allows nothing more.
"""

from __future__ import annotations

import time

from jaxpaged.core.request import Sequence
from jaxpaged.engine.detokenizer import Detokenizer
from jaxpaged.outputs import CompletionOutput, RequestOutput
from jaxpaged.sampling_params import RequestOutputKind, SamplingParams


class OutputProcessor:
    def __init__(self, tokenizer, eos_token_ids: set[int], max_model_len: int):
        self.tokenizer = tokenizer
        self.eos_token_ids = eos_token_ids
        self.max_model_len = max_model_len

    def detokenizer(self, params: SamplingParams) -> Detokenizer:
        """A sequence's incremental detokenizer, holding back text that may be the start of a stop string."""
        return Detokenizer(self.tokenizer, params.skip_special_tokens, params.stop, params.include_stop_str_in_output)

    def decode(self, token_ids: list[int]) -> str:
        return self.tokenizer.decode(token_ids, skip_special_tokens=True) if self.tokenizer is not None else ""

    def add_token(self, seq: Sequence, detok: Detokenizer, token: int, result: dict, row: int,
                  grammar_stopped: bool = False) -> tuple[str | None, int | str | None]:
        """Appends `token` (and its log-probs from the step's `result`, row `row`) to `seq`, detokenizes it, and
        returns (finish reason, stop reason): ("stop", None) for EOS or a grammar that allows nothing more, ("stop",
        the token or string) for a stop token or stop string, ("length", None) at max_tokens or the context length,
        (None, None) while it goes on. EOS and stops count only from min_tokens on."""
        p = seq.params
        seq.output_token_ids.append(token)
        if p.logprobs is not None:
            seq.output_logprobs.append(float(result["logprobs"][row]))
            top = {int(t): float(lp) for t, lp in zip(result["top_ids"][row][:p.logprobs],
                                                      result["top_logprobs"][row][:p.logprobs], strict=True)}
            top[token] = float(result["logprobs"][row])
            seq.output_top_logprobs.append(top)
        before = len(detok.text)
        detok.add(seq.output_token_ids)
        num_out = len(seq.output_token_ids)
        if num_out >= p.min_tokens:
            if not p.ignore_eos and token in self.eos_token_ids:
                return "stop", None
            if token in p.stop_token_ids:
                return "stop", token
            if detok.check_stop(len(detok.text) - before) is not None:
                return "stop", detok.stopped_on
        if grammar_stopped:
            return "stop", None
        if (p.max_tokens is not None and num_out >= p.max_tokens) or seq.num_tokens >= self.max_model_len:
            return "length", None
        return None, None

    def request_output(self, request_id: str, prompt: str | None, seqs: list[Sequence],
                       detokenizers: list[Detokenizer], sent: dict[int, tuple[int, int]],
                       arrival_time: float) -> RequestOutput:
        """The request's output now, in its output kind. sent: seq_id -> (tokens, characters) already given out,
        which DELTA outputs start after and update."""
        finished = all(s.finished for s in seqs)
        delta = seqs[0].params.output_kind == RequestOutputKind.DELTA
        outs = []
        for i, (seq, detok) in enumerate(zip(seqs, detokenizers, strict=True)):
            logprobs = seq.output_top_logprobs if seq.params.logprobs is not None else None
            cum = float(sum(seq.output_logprobs)) if seq.params.logprobs is not None else None
            text, tokens = detok.visible_text(seq.finished), seq.output_token_ids
            if delta:  # what is new since this sequence's previous output
                sent_tokens, sent_chars = sent.get(seq.seq_id, (0, 0))
                sent[seq.seq_id] = (len(tokens), max(sent_chars, len(text)))
                text, tokens = text[sent_chars:], tokens[sent_tokens:]
                logprobs = logprobs[sent_tokens:] if logprobs is not None else None
            outs.append(CompletionOutput(i, text, list(tokens), cum, logprobs, seq.finish_reason, seq.stop_reason))
        seq0 = seqs[0]
        metrics = {"arrival_time": arrival_time, "first_token_time": seq0.first_token_time or 0.0}
        if finished:
            metrics["finished_time"] = time.monotonic()
        return RequestOutput(request_id, prompt, list(seq0.prompt_token_ids), outs, finished,
                             seq0.num_cached_prompt_tokens, metrics)
