"""`InputProcessor`: a request checked and tokenized into a `Request`, not yet queued (vLLM v1's `Processor`).

    inputs = InputProcessor(tokenizer, model_config.vocab_size, eos_token_ids, max_model_len, max_num_seqs, ...)
    req = inputs.request("r1", "Hello", SamplingParams(max_tokens=8))     # ValueError / TypeError naming the field
    req = inputs.beam_request("r2", [1, 2, 3], BeamSearchParams(beam_width=4, max_tokens=16))

Everything a caller can get wrong about one request is found here, before anything is queued: the prompt's form
and token ids, the sampling parameters against this model and engine (vocabulary, `max_num_seqs`, the pool a beam
search needs), a structured-output spec (compiled, or refused, by the grammar cache) and bad words (tokenized). The
engine then only queues what this returns (`Engine.enqueue`), so a batch of requests is all or nothing.
"""

from __future__ import annotations

import time

import numpy as np

from jaxpaged.core.request import Request, Sequence
from jaxpaged.engine.beam_search import BeamSearchParams, BeamState
from jaxpaged.engine.reasoning import ANSWER, ReasoningParser, ThinkTokens, think_tokens
from jaxpaged.engine.structured_output import GrammarCache, allow, bitmask_words
from jaxpaged.sampling_params import RequestOutputKind, SamplingParams
from jaxpaged.spec_decode.config import SpeculativeConfig
from jaxpaged.worker.sampler import MAX_BANNED, MAX_LOGPROBS


class InputProcessor:
    def __init__(self, tokenizer, vocab_size: int, eos_token_ids: set[int], max_model_len: int, max_num_seqs: int,
                 grammars: GrammarCache, *, num_blocks: int, block_size: int, spec: SpeculativeConfig | None = None,
                 drafts: bool = False, seed: int | None = None, policy: str = "fcfs",
                 default_params: SamplingParams | None = None, reasoning: ReasoningParser | None = None):
        """`num_blocks`, `block_size`: the KV pool's (a beam search must fit in it); `spec`: the engine's speculative
        decoding, `drafts` whether it proposes with a draft model (a row then keeps room for its proposals);
        `seed`: where the seeds of requests without one come from; `policy`: the scheduling policy (a request's
        priority means something under "priority" only); `default_params`: what a request without sampling
        parameters samples with (`Engine.default_sampling_params`); `reasoning`: the engine's reasoning parser (a
        request's grammar then waits for the end of its reasoning, `think_tokens`)."""
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.eos_token_ids = eos_token_ids  # the engine's set, not a copy
        self.max_model_len = max_model_len
        self.max_num_seqs = max_num_seqs
        self.grammars = grammars
        self.num_blocks, self.block_size = num_blocks, block_size
        self.spec, self.drafts = spec, drafts
        self._rng = np.random.default_rng(seed)
        self.policy = policy
        self.default_params = default_params or SamplingParams()
        self.reasoning = reasoning
        self._think: tuple[object, ThinkTokens | None] | None = None  # (tokenizer, its tags' ids)

    def think_tokens(self) -> ThinkTokens | None:
        """The reasoning parser's tags as this tokenizer's token ids (None: no parser, or no single-token tags)."""
        if self.reasoning is None:
            return None
        if self._think is None or self._think[0] is not self.tokenizer:  # (the tokenizer can be replaced)
            self._think = (self.tokenizer, think_tokens(self.reasoning, self.tokenizer))
        return self._think[1]

    def request(self, request_id: str, prompt: str | list[int] | dict, params: SamplingParams | None = None,
                arrival_time: float | None = None, priority: int = 0) -> Request:
        """A request with its first sequence (n > 1 forks after the prompt). Raises ValueError / TypeError naming the
        problem."""
        params = self.default_params if params is None else params
        if not isinstance(params, SamplingParams):
            raise TypeError(f"sampling_params must be a SamplingParams, got {type(params).__name__} {params!r}")
        self.check_priority(priority)
        text, token_ids = self.tokenize(prompt)
        if params.truncate_prompt_tokens is not None:
            tokenized = isinstance(prompt, str) or (isinstance(prompt, dict) and "prompt_token_ids" not in prompt)
            token_ids = truncate_prompt(token_ids, truncation_length(params.truncate_prompt_tokens, self.max_model_len),
                                        getattr(self.tokenizer, "bos_token_id", None) if tokenized else None)
        self.check_prompt(token_ids)
        params.check_against_model(self.vocab_size)
        if len(params.stop_token_ids) + len(self.eos_token_ids) > MAX_BANNED and params.min_tokens:
            raise ValueError(f"min_tokens with more than {MAX_BANNED} EOS + stop_token_ids is not supported")
        if params.n > self.max_num_seqs:
            raise ValueError(f"n={params.n} exceeds max_num_seqs={self.max_num_seqs}")
        if params.prompt_logprobs is not None and self.spec is not None:
            raise ValueError("prompt_logprobs is not supported with speculative decoding")
        arrival = arrival_time or time.monotonic()
        seed = params.seed if params.seed is not None else int(self._rng.integers(0, 2**63))
        so = params.structured_outputs
        grammar = self.grammars.matcher(so.kind, so.spec) if so is not None else None
        bad_words_ids = self.bad_words_ids(params.bad_words)
        stop_ids = frozenset(params.stop_token_ids) | (frozenset() if params.ignore_eos
                                                       else frozenset(self.eos_token_ids))
        if params.allowed_token_ids is not None and params.min_tokens and set(params.allowed_token_ids) <= stop_ids:
            raise ValueError("allowed_token_ids holds only EOS and stop tokens, which min_tokens bans: no token could "
                             "be generated")
        parent = Sequence(request_id, token_ids, params, max_model_len=self.max_model_len, arrival_time=arrival,
                          fork_pending=params.n - 1, stop_ids=stop_ids, priority=priority)
        allowed = None
        if params.allowed_token_ids is not None:
            allowed = np.zeros(bitmask_words(self.vocab_size), np.int32)
            allow(allowed, params.allowed_token_ids)
        req = Request(request_id, text, [parent], seed, arrival, grammar=grammar, bad_words_ids=bad_words_ids,
                      allowed_mask=allowed, prompt_logprobs=None if params.prompt_logprobs is None else [None],
                      streams=params.output_kind != RequestOutputKind.FINAL_ONLY or bool(params.stop))
        think = self.think_tokens() if grammar is not None else None
        if think is not None:  # the grammar constrains the answer after the reasoning
            req.think = think
            req.think_start = think.start_mode(self.tokenizer.decode(token_ids[-8:], skip_special_tokens=False))
        else:
            req.think_start = ANSWER
        # Speculates unless its logits need processing beyond temperature/top-k/top-p (verification applies no
        # penalties, bias or bans: those requests decode one token a step).
        req.speculates = (self.spec is not None and not req.needs_host_tokens and not params.logit_bias
                          and not bad_words_ids and allowed is None and not params.has_penalties)
        if req.speculates and self.drafts:
            parent.spec_lookahead = self.spec.num_speculative_tokens
        return req

    def beam_request(self, request_id: str, prompt: str | list[int] | dict, params: BeamSearchParams) -> Request:
        """A beam search; its one output holds the beam_width best hypotheses."""
        if not isinstance(params, BeamSearchParams):
            raise TypeError(f"params must be a BeamSearchParams, got {type(params).__name__}")
        state = BeamState(params, frozenset(self.eos_token_ids))
        if state.num_candidates > MAX_LOGPROBS:
            raise ValueError(f"beam_width={params.beam_width} needs {state.num_candidates} candidates per beam; "
                             f"at most {MAX_LOGPROBS} are computed")
        if params.beam_width > self.max_num_seqs:
            raise ValueError(f"beam_width={params.beam_width} exceeds max_num_seqs={self.max_num_seqs}")
        text, token_ids = self.tokenize(prompt)
        self.check_prompt(token_ids)
        if len(token_ids) + params.max_tokens > self.max_model_len:
            raise ValueError(f"prompt ({len(token_ids)} tokens) + max_tokens={params.max_tokens} exceeds "
                             f"max_model_len={self.max_model_len}")
        # The beams wait for each other at every step: a beam that has given its candidates holds its blocks until
        # every other beam of the request has given its own, so the pool must hold all of them at full length,
        # each on blocks of its own (as they are once preempted and recomputed), or the request could never end.
        blocks = params.beam_width * -(-(len(token_ids) + params.max_tokens) // self.block_size)
        if blocks > self.num_blocks - 1:
            raise ValueError(f"beam_width={params.beam_width} beams of prompt ({len(token_ids)} tokens) + "
                             f"max_tokens={params.max_tokens} need {blocks} KV blocks; the pool has "
                             f"{self.num_blocks - 1}: lower beam_width or max_tokens, or give the KV cache more memory")
        # Greedy rows with the top-20 log-probs: the host picks the beams from those.
        sp = SamplingParams(temperature=0.0, max_tokens=None, logprobs=MAX_LOGPROBS, ignore_eos=True)
        parent = Sequence(request_id, token_ids, sp, max_model_len=self.max_model_len,
                          extra_beams=params.beam_width - 1)
        return Request(request_id, text, [parent], 0, parent.arrival_time, beam=state)

    def check_priority(self, priority) -> None:
        if isinstance(priority, bool) or not isinstance(priority, (int, np.integer)):
            raise TypeError(f"priority must be an integer, got {type(priority).__name__}")
        if not -2**63 <= priority < 2**63:
            raise ValueError(f"priority={priority} must fit in 64 bits")
        if priority and self.policy != "priority":
            raise ValueError(f"priority={priority} needs scheduling_policy='priority' (this engine's is "
                             f"{self.policy!r})")

    def bad_words_ids(self, words: list[str]) -> list[list[int]]:
        """Each bad word's tokens, alone and after a space (vLLM's rule: a word is banned at the start of the text and
        in its middle)."""
        if not words:
            return []
        if self.tokenizer is None:
            raise ValueError("bad_words needs a tokenizer; this engine has none")
        out: list[list[int]] = []
        for word in words:
            for prefix in ("", " "):
                ids = list(self.tokenizer.encode(prefix + word.lstrip(), add_special_tokens=False))
                if ids and ids not in out:
                    out.append(ids)
        return out

    def check_prompt(self, token_ids: list[int]) -> None:
        if not token_ids:
            raise ValueError("the prompt is empty: it must have at least one token")
        if min(token_ids) < 0 or max(token_ids) >= self.vocab_size:
            raise ValueError(f"prompt token ids must be in [0, {self.vocab_size}); got one outside")
        if len(token_ids) >= self.max_model_len:
            raise ValueError(f"the prompt is {len(token_ids)} tokens, longer than the context: max_model_len="
                             f"{self.max_model_len} leaves no room to generate")

    def tokenize(self, prompt) -> tuple[str | None, list[int]]:
        """(text or None, token ids) of a prompt: a string, a list or 1-D array of token ids, or a dict with
        'prompt' or 'prompt_token_ids'."""
        if isinstance(prompt, dict):
            unknown = set(prompt) - {"prompt", "prompt_token_ids"}
            if unknown:
                raise ValueError(f"a dict prompt takes 'prompt' or 'prompt_token_ids'; unknown key(s) "
                                 f"{', '.join(map(repr, sorted(unknown)))}")
            if "prompt_token_ids" in prompt:
                return prompt.get("prompt"), token_ids_of(prompt["prompt_token_ids"], "prompt_token_ids")
            if "prompt" not in prompt:
                raise ValueError("a dict prompt needs 'prompt' or 'prompt_token_ids'")
            prompt = prompt["prompt"]
            if not isinstance(prompt, str):
                raise TypeError(f"'prompt' must be a string, got {type(prompt).__name__}")
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError("this engine has no tokenizer: pass {'prompt_token_ids': [...]}")
            return prompt, list(self.tokenizer(prompt)["input_ids"])
        if isinstance(prompt, (list, tuple, np.ndarray)):
            return None, token_ids_of(prompt, "prompt")
        raise TypeError(f"a prompt must be a string, a list of token ids or a dict; got {type(prompt).__name__}")


def truncation_length(truncate_prompt_tokens: int, max_model_len: int) -> int:
    """How many prompt tokens vLLM's truncate_prompt_tokens keeps: k, or max_model_len for -1; ValueError above it."""
    keep = max_model_len if truncate_prompt_tokens == -1 else truncate_prompt_tokens
    if keep > max_model_len:
        raise ValueError(f"truncate_prompt_tokens={keep} is greater than max_model_len={max_model_len}")
    return keep


def truncate_prompt(token_ids: list[int], keep: int, bos_token_id: int | None = None) -> list[int]:
    """The prompt's last `keep` tokens; a first token equal to `bos_token_id` (one the tokenizer added) stays first, as
    Hugging Face's left truncation keeps it."""
    if len(token_ids) <= keep:
        return token_ids
    if bos_token_id is not None and keep > 1 and token_ids[0] == bos_token_id:
        return token_ids[:1] + token_ids[len(token_ids) - keep + 1:]
    return token_ids[len(token_ids) - keep:]


def token_ids_of(ids, field: str) -> list[int]:
    """Token ids exactly as given: ints only (no bools, floats or strings, which int() would quietly convert)."""
    if isinstance(ids, np.ndarray):
        if ids.ndim != 1 or not np.issubdtype(ids.dtype, np.integer):
            raise TypeError(f"{field} must be a 1-D array of integers, got {ids.dtype} with shape {ids.shape}")
        return [int(t) for t in ids]
    if not isinstance(ids, (list, tuple)):
        raise TypeError(f"{field} must be a list of token ids, got {type(ids).__name__}")
    for t in ids:
        if isinstance(t, bool) or not isinstance(t, (int, np.integer)):
            raise TypeError(f"{field} must hold integer token ids; got {type(t).__name__} {t!r}")
    return [int(t) for t in ids]
