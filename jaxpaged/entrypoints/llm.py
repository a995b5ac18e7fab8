"""`LLM`: the offline, batch API, shaped like vLLM's."""

from __future__ import annotations

import dataclasses
import itertools
import logging
import time

from flax import nnx

from jaxpaged.chat import apply_chat_template
from jaxpaged.config import ModelConfig
from jaxpaged.engine.beam_search import BeamSearchOutput, BeamSearchParams, BeamSearchSequence
from jaxpaged.engine.llm_engine import Engine
from jaxpaged.engine.setup import EngineConfig
from jaxpaged.outputs import RequestOutput
from jaxpaged.sampling_params import RequestOutputKind, SamplingParams

logger = logging.getLogger(__name__)

_ENGINE_FIELDS = {f.name for f in dataclasses.fields(EngineConfig)}


def _engine_config(kwargs: dict) -> EngineConfig:
    unknown = set(kwargs) - _ENGINE_FIELDS
    if unknown:
        raise ValueError(f"unknown engine option(s): {', '.join(sorted(unknown))}; "
                         f"known: {', '.join(sorted(_ENGINE_FIELDS))}")
    return EngineConfig(**kwargs)


def load_engine(model: str | None = None, **engine_options) -> Engine:
    """Checks the options, loads the model (a path, or None for the default) and builds the engine: what `LLM()` and
    the server's `AsyncEngine.from_options` share."""
    from jaxpaged.loader import load_model

    config = _engine_config(engine_options)  # before loading: a bad option fails in a moment, not after the load
    from jaxpaged.parallel import multihost

    multihost.check_joined(config.distributed_config())
    multihost.check_mesh_spans_processes(config.tensor_parallel_size)
    from jaxpaged.loader import check_quantization_source

    check_quantization_source(model, config.quantization)
    t0 = time.perf_counter()
    loaded = load_model(model, dtype=config.model_dtype, tensor_parallel_size=config.tensor_parallel_size,
                        quantization=config.quantization)
    load_s = time.perf_counter() - t0
    engine = Engine(loaded.config, loaded.params, loaded.tokenizer, config)
    engine.startup_times["load_s"] = load_s
    logger.info("model %s loaded in %.1f s", loaded.source, load_s)
    return engine


class RequestFailedError(RuntimeError):
    """A request failed inside the engine (its step or its output processing); the other requests went on."""


def _as_list(prompts) -> list:
    if isinstance(prompts, (str, dict)):
        return [prompts]
    if not isinstance(prompts, (list, tuple)):
        raise TypeError(f"prompts must be a string, a dict or a list of them, got {type(prompts).__name__}")
    return list(prompts)


class LLM:
    """Generates text for many prompts at once through one continuously batched engine.

    LLM()                                   the embedded default model (SmolLM2-135M-Instruct)
    LLM(model="dir_or.gguf", block_size=16, max_num_seqs=64, kv_cache_memory="2GiB", dtype="float32")
    LLM.from_params(model_config, params, tokenizer, ...)   an in-memory params pytree (e.g. after fine-tuning)
    LLM.from_model(module, tokenizer=..., ...)              any flax.nnx module that follows the model contract
    """

    def __init__(self, model: str | None = None, **engine_options):
        self.engine = load_engine(model, **engine_options)
        self._ids = itertools.count()

    @classmethod
    def from_params(cls, model_config: ModelConfig, params: dict, tokenizer=None, **engine_options) -> LLM:
        self = cls.__new__(cls)
        self.engine = Engine(model_config, params, tokenizer, _engine_config(engine_options))
        self._ids = itertools.count()
        return self

    @classmethod
    def from_model(cls, model: nnx.Module, tokenizer=None, **engine_options) -> LLM:
        """Serves your own `nnx.Module`: it follows the contract of `jaxpaged.models.contract` (called as
        `model(token_ids, kv_pool, md, attn) -> (hidden, kv_pool)`, with `model.logits(hidden)` and a `config`
        holding the `ModelSpec` fields). Engine options as for `LLM(...)`; `dtype` casts its parameters."""
        self = cls.__new__(cls)
        self.engine = Engine.from_model(model, tokenizer, _engine_config(engine_options))
        self._ids = itertools.count()
        return self

    @property
    def tokenizer(self):
        return self.engine.tokenizer

    def generate(self, prompts, sampling_params: SamplingParams | list[SamplingParams] | None = None,
                 use_tqdm: bool = True) -> list[RequestOutput]:
        """Runs every prompt to completion; outputs come back in input order.

        prompts: a string, a list of strings, or dicts {"prompt_token_ids": [...]} / {"prompt": "..."}.
        A prompt that is bad input raises ValueError before anything runs.
        """
        prompts = _as_list(prompts)
        if sampling_params is None or isinstance(sampling_params, SamplingParams):
            sampling_params = [sampling_params or SamplingParams()] * len(prompts)
        elif not isinstance(sampling_params, (list, tuple)):
            raise TypeError(f"sampling_params must be a SamplingParams or a list of them, got "
                            f"{type(sampling_params).__name__} {sampling_params!r}")
        if len(sampling_params) != len(prompts):
            raise ValueError(f"{len(sampling_params)} sampling params for {len(prompts)} prompts")
        ids = [f"gen-{next(self._ids)}" for _ in prompts]
        # One output per request, when it finishes: no cumulative copies of every request at every step.
        self._add_all([self.engine.make_request(rid, prompt, _final_only(params))
                       for rid, prompt, params in zip(ids, prompts, sampling_params, strict=True)])
        return self._run(ids, use_tqdm)

    def _add_all(self, requests: list) -> None:
        """Queues requests that all passed their checks (a bad one raised while they were made, before any was
        queued, so nothing is left behind)."""
        for req in requests:
            self.engine.enqueue(req)

    def _run(self, ids: list[str], use_tqdm: bool) -> list[RequestOutput]:
        from tqdm.auto import tqdm

        wanted = set(ids)
        done: dict[str, RequestOutput] = {}
        bar = tqdm(total=len(ids), desc="generating", disable=not use_tqdm)
        try:
            while len(done) < len(ids) and self.engine.has_unfinished_requests():
                for out in self.engine.step():
                    if out.error is not None and out.request_id in wanted:
                        raise RequestFailedError(f"request {out.request_id} failed: {out.error}")
                    if out.finished and out.request_id in wanted:
                        done[out.request_id] = out
                        bar.update(1)
        finally:
            bar.close()
            # An error (or Ctrl-C) leaves nothing of this call queued: the LLM stays usable.
            for rid in wanted - set(done):
                self.engine.abort_request(rid)
        return [done[rid] for rid in ids]

    def beam_search(self, prompts, params: BeamSearchParams, use_tqdm: bool = True) -> list[BeamSearchOutput]:
        """Beam search per prompt, returned as vLLM does: each output's `sequences` are the beam_width hypotheses,
        best first, with the prompt's tokens and text included."""
        prompts = _as_list(prompts)
        ids = [f"beam-{next(self._ids)}" for _ in prompts]
        self._add_all([self.engine.make_beam_request(rid, prompt, params)
                       for rid, prompt in zip(ids, prompts, strict=True)])
        return [self._beam_output(out) for out in self._run(ids, use_tqdm)]

    def _beam_output(self, out: RequestOutput) -> BeamSearchOutput:
        def text(tokens: list[int]) -> str | None:
            return None if self.tokenizer is None else self.tokenizer.decode(tokens, skip_special_tokens=True)

        return BeamSearchOutput([
            BeamSearchSequence(tokens=out.prompt_token_ids + o.token_ids, logprobs=[], cum_logprob=o.cumulative_logprob,
                               text=text(out.prompt_token_ids + o.token_ids), finish_reason=o.finish_reason,
                               stop_reason=o.stop_reason)
            for o in out.outputs])

    def chat(self, messages, sampling_params: SamplingParams | None = None, use_tqdm: bool = True,
             add_generation_prompt: bool = True, tools: list[dict] | None = None) -> list[RequestOutput]:
        """messages: one conversation [{"role", "content"}, ...] or a list of them; uses the chat template.
        tools: OpenAI function definitions, rendered by the template (as vLLM's `LLM.chat`; the text is returned as
        generated: constrain it with `SamplingParams(structured_outputs=...)` to get a valid call)."""
        if not isinstance(messages, (list, tuple)) or not messages:
            raise TypeError("messages must be a conversation (a list of {'role', 'content'} dicts) or a list of them")
        conversations = [messages] if isinstance(messages[0], dict) else messages
        prompts = [{"prompt_token_ids": self.apply_chat_template(conv, add_generation_prompt, tools)}
                   for conv in conversations]
        return self.generate(prompts, sampling_params, use_tqdm)

    def apply_chat_template(self, conversation: list[dict], add_generation_prompt: bool = True,
                            tools: list[dict] | None = None) -> list[int]:
        return apply_chat_template(self.tokenizer, conversation, add_generation_prompt, tools)

    def stats(self) -> dict:
        return self.engine.stats()


def _final_only(params):
    """The caller's params asking for the final output only (their own object is left as it is); anything that is
    not a SamplingParams goes through unchanged for `make_request` to refuse."""
    if not isinstance(params, SamplingParams):
        return params
    return dataclasses.replace(params, output_kind=RequestOutputKind.FINAL_ONLY)
