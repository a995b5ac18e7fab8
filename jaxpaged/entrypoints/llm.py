"""`LLM`: the offline, batch API, shaped like vLLM's."""

from __future__ import annotations

import dataclasses
import itertools
import logging
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING, Unpack, cast

from flax import nnx

from jaxpaged.chat import apply_chat_template
from jaxpaged.config import ModelConfig
from jaxpaged.core.request import Request
from jaxpaged.engine.beam_search import BeamSearchOutput, BeamSearchParams, BeamSearchSequence
from jaxpaged.engine.llm_engine import Engine
from jaxpaged.engine.options import EngineOptions
from jaxpaged.engine.output_processor import RequestState
from jaxpaged.engine.setup import EngineConfig
from jaxpaged.outputs import RequestOutput
from jaxpaged.sampling_params import RequestOutputKind, SamplingParams

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

logger = logging.getLogger(__name__)

_ENGINE_FIELDS = {f.name for f in dataclasses.fields(EngineConfig)}


def engine_config(options: dict, config: EngineConfig | None = None) -> EngineConfig:
    """`config` (default: `EngineConfig()`) with `options` replacing its fields; an option EngineConfig does not
    have is a ValueError naming it, and each value is checked as EngineConfig checks it."""
    unknown = set(options) - _ENGINE_FIELDS
    if unknown:
        raise ValueError(f"unknown engine option(s): {', '.join(sorted(unknown))}; "
                         f"known: {', '.join(sorted(_ENGINE_FIELDS))}")
    if config is None:
        return EngineConfig(**options)
    if not isinstance(config, EngineConfig):
        raise TypeError(f"config must be an EngineConfig, not {type(config).__name__}")
    return dataclasses.replace(config, **options) if options else config


def load_engine(model: str | None = None, config: EngineConfig | None = None,
                **options: Unpack[EngineOptions]) -> Engine:
    """Checks the options, loads the model (a path, or None for the default) and builds the engine: what `LLM()` and
    the server's `AsyncEngine.from_options` share."""
    from jaxpaged.loader import load_model

    config = engine_config(dict(options), config)  # before loading: a bad option fails in a moment, not after it
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


# A prompt: text, or a dict {"prompt": text} / {"prompt_token_ids": [...]}
Prompt = str | dict


def _as_list(prompts: Prompt | Sequence[Prompt]) -> list[Prompt]:
    if isinstance(prompts, (str, dict)):
        return [prompts]
    if not isinstance(prompts, (list, tuple)):
        raise TypeError(f"prompts must be a string, a dict or a list of them, got {type(prompts).__name__}")
    return list(prompts)


class LLM:
    """Generates text for many prompts at once through one continuously batched engine.

    LLM()                                   the embedded default model (SmolLM2-135M-Instruct)
    LLM(model="dir_or.gguf", block_size=16, max_num_seqs=64, kv_cache_memory="2GiB", dtype="float32")
    LLM(model="dir_or.gguf", config=EngineConfig(...), seed=1)     keywords replace the config's fields
    LLM.from_params(model_config, params, tokenizer, ...)   an in-memory params pytree (e.g. after fine-tuning)
    LLM.from_model(module, tokenizer=..., ...)              any flax.nnx module that follows the model contract

    The engine options are `EngineConfig`'s fields (`EngineOptions` types them for checkers and IDEs); an unknown
    one is a ValueError naming it, before anything loads. Building an LLM changes no process-wide setting: JAX's
    persistent compilation cache is turned on only with `compilation_cache_dir`.
    """

    engine: Engine

    def __init__(self, model: str | None = None, *, config: EngineConfig | None = None,
                 **options: Unpack[EngineOptions]) -> None:
        self.engine = load_engine(model, config, **options)
        self._ids = itertools.count()

    @classmethod
    def from_params(cls, model_config: ModelConfig, params: dict | nnx.State,
                    tokenizer: PreTrainedTokenizerBase | None = None, *, config: EngineConfig | None = None,
                    **options: Unpack[EngineOptions]) -> LLM:
        """A built-in architecture (`jaxpaged.models.families`: the Llama family, Gemma 3) from its `ModelConfig` and
        parameters in the loader's layout: a nested dict of arrays or an `nnx.State` (e.g. `nnx.state(module,
        nnx.Param)` after fine-tuning). The caller's params are not changed. Without a tokenizer, prompts are token
        ids (`{"prompt_token_ids": [...]}`) and outputs carry no text."""
        return cls._wrap(Engine(model_config, params, tokenizer, engine_config(dict(options), config)))

    @classmethod
    def from_model(cls, model: nnx.Module, tokenizer: PreTrainedTokenizerBase | None = None, *,
                   config: EngineConfig | None = None, **options: Unpack[EngineOptions]) -> LLM:
        """Serves your own `nnx.Module`: it follows the contract of `jaxpaged.models.contract` (called as
        `model(token_ids, kv_pool, md, attn) -> (hidden, kv_pool)`, with `model.logits(hidden)` and a `config`
        holding the `ModelSpec` fields). Engine options as for `LLM(...)`; `dtype` casts its parameters.
        The module is left as it was: the engine splits it into its own state (sharing unchanged arrays), so the
        caller may keep training or calling it."""
        return cls._wrap(Engine.from_model(model, tokenizer, engine_config(dict(options), config)))

    @classmethod
    def _wrap(cls, engine: Engine) -> LLM:
        self = cls.__new__(cls)
        self.engine = engine
        self._ids = itertools.count()
        return self

    @property
    def tokenizer(self) -> PreTrainedTokenizerBase | None:
        return self.engine.tokenizer

    def get_tokenizer(self) -> PreTrainedTokenizerBase | None:
        """The tokenizer prompts are encoded with (vLLM's name; the same as `tokenizer`)."""
        return self.tokenizer

    def get_default_sampling_params(self) -> SamplingParams:
        """What `generate` and `chat` sample with when given no SamplingParams (vLLM's name): vLLM's defaults, over
        which the model's generation_config.json sets its temperature, top_p, top_k, min_p, repetition_penalty and
        max_tokens (unless the engine was built with generation_config="vllm")."""
        return self.engine.default_sampling_params

    def generate(self, prompts: Prompt | Sequence[Prompt],
                 sampling_params: SamplingParams | list[SamplingParams] | None = None,
                 use_tqdm: bool = True, priority: list[int] | None = None) -> list[RequestOutput]:
        """Runs every prompt to completion; outputs come back in input order.

        prompts: a string, a list of strings, or dicts {"prompt_token_ids": [...]} / {"prompt": "..."}.
        priority: one per prompt, lower first (with scheduling_policy="priority", as vLLM's).
        A prompt that is bad input raises ValueError before anything runs.
        """
        prompts = _as_list(prompts)
        if sampling_params is None or isinstance(sampling_params, SamplingParams):
            sampling_params = [sampling_params or self.get_default_sampling_params()] * len(prompts)
        elif not isinstance(sampling_params, (list, tuple)):
            raise TypeError(f"sampling_params must be a SamplingParams or a list of them, got "
                            f"{type(sampling_params).__name__} {sampling_params!r}")
        if len(sampling_params) != len(prompts):
            raise ValueError(f"{len(sampling_params)} sampling params for {len(prompts)} prompts")
        if priority is None:
            priority = [0] * len(prompts)
        elif not isinstance(priority, (list, tuple)) or len(priority) != len(prompts):
            raise ValueError(f"priority must be a list of one integer per prompt ({len(prompts)}), got {priority!r}")
        ids = [f"gen-{next(self._ids)}" for _ in prompts]
        # One output per request, when it finishes: no cumulative copies of every request at every step, and its
        # text decoded once then (unless it has stop strings to look for).
        return self._run(self._add_all([self.engine.make_request(rid, prompt, _final_only(params), priority=p)
                                        for rid, prompt, params, p in zip(ids, prompts, sampling_params, priority,
                                                                          strict=True)]),
                         use_tqdm)

    def _add_all(self, requests: list[Request]) -> list[Request]:
        """Queues requests that all passed their checks (a bad one raised while they were made, before any was
        queued, so nothing is left behind)."""
        for req in requests:
            self.engine.enqueue(req)
        return requests

    def _run(self, requests: list[Request], use_tqdm: bool) -> list[RequestOutput]:
        """Steps the engine until every request finished; the output processor (a `RequestState` per request)
        turns the engine's token ids into outputs and stops sequences at their stop strings."""
        from tqdm.auto import tqdm

        states = {r.request_id: RequestState(self.tokenizer, r.request_id, r.prompt, r.seqs[0].prompt_token_ids,
                                             r.params, r.arrival_time) for r in requests}
        done: dict[str, RequestOutput] = {}
        bar = tqdm(total=len(states), desc="generating", disable=not use_tqdm)
        try:
            while len(done) < len(states) and self.engine.has_unfinished_requests():
                for out in self.engine.step():
                    state = states.get(out.request_id)
                    if state is None or out.request_id in done:
                        continue
                    if out.error is not None:
                        raise RequestFailedError(f"request {out.request_id} failed: {out.error}")
                    result = state.update(out)
                    stopped = state.take_stopped()
                    if stopped:
                        self.engine.stop_sequences(out.request_id, stopped)
                    if state.finished:
                        done[out.request_id] = result if result is not None else state.output()
                        bar.update(1)
        finally:
            bar.close()
            # An error (or Ctrl-C) leaves nothing of this call queued: the LLM stays usable.
            for rid in set(states) - set(done):
                self.engine.abort_request(rid)
        return [done[r.request_id] for r in requests]

    def beam_search(self, prompts: Prompt | Sequence[Prompt], params: BeamSearchParams,
                    use_tqdm: bool = True) -> list[BeamSearchOutput]:
        """Beam search per prompt, returned as vLLM does: each output's `sequences` are the beam_width hypotheses,
        best first, with the prompt's tokens and text included."""
        prompts = _as_list(prompts)
        ids = [f"beam-{next(self._ids)}" for _ in prompts]
        requests = self._add_all([self.engine.make_beam_request(rid, prompt, params)
                                  for rid, prompt in zip(ids, prompts, strict=True)])
        return [self._beam_output(out) for out in self._run(requests, use_tqdm)]

    def _beam_output(self, out: RequestOutput) -> BeamSearchOutput:
        def text(tokens: list[int]) -> str | None:
            return None if self.tokenizer is None else self.tokenizer.decode(tokens, skip_special_tokens=True)

        return BeamSearchOutput([
            BeamSearchSequence(tokens=out.prompt_token_ids + o.token_ids, logprobs=[], cum_logprob=o.cumulative_logprob,
                               text=text(out.prompt_token_ids + o.token_ids), finish_reason=o.finish_reason,
                               stop_reason=o.stop_reason)
            for o in out.outputs])

    def chat(self, messages: list[dict] | list[list[dict]], sampling_params: SamplingParams | None = None,
             use_tqdm: bool = True, add_generation_prompt: bool = True,
             tools: list[dict] | None = None, *, continue_final_message: bool = False,
             chat_template_kwargs: dict | None = None, chat_template: str | None = None) -> list[RequestOutput]:
        """messages: one conversation [{"role", "content"}, ...] or a list of them; uses the chat template.
        tools: OpenAI function definitions, rendered by the template (as vLLM's `LLM.chat`; the text is returned as
        generated: constrain it with `SamplingParams(structured_outputs=...)` to get a valid call).
        continue_final_message: the last message, the assistant's, is continued (add_generation_prompt=False);
        chat_template_kwargs: more variables for the template, e.g. {"enable_thinking": False} for Qwen3;
        chat_template: a Jinja template used instead of the tokenizer's (vLLM's)."""
        if not isinstance(messages, (list, tuple)) or not messages:
            raise TypeError("messages must be a conversation (a list of {'role', 'content'} dicts) or a list of them")
        conversations = cast(list[list[dict]], [messages] if isinstance(messages[0], dict) else messages)
        prompts = [{"prompt_token_ids": self.apply_chat_template(
            conv, add_generation_prompt, tools, continue_final_message=continue_final_message,
            chat_template_kwargs=chat_template_kwargs, chat_template=chat_template)} for conv in conversations]
        return self.generate(prompts, sampling_params, use_tqdm)

    def apply_chat_template(self, conversation: list[dict], add_generation_prompt: bool = True,
                            tools: list[dict] | None = None, *, continue_final_message: bool = False,
                            chat_template_kwargs: dict | None = None, chat_template: str | None = None) -> list[int]:
        return apply_chat_template(self.tokenizer, conversation, add_generation_prompt, tools,
                                   continue_final_message=continue_final_message,
                                   chat_template_kwargs=chat_template_kwargs, chat_template=chat_template)

    def stats(self) -> dict:
        return self.engine.stats()


def _final_only(params):
    """The caller's params asking for the final output only (their own object is left as it is); anything that is
    not a SamplingParams goes through unchanged for `make_request` to refuse."""
    if not isinstance(params, SamplingParams):
        return params
    return dataclasses.replace(params, output_kind=RequestOutputKind.FINAL_ONLY)
