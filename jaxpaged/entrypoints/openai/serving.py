"""OpenAI completions and chat completions on an `AsyncEngine`: validated bodies in, response dicts (or, when
streaming, an async iterator of chunk dicts) out. It knows the API's JSON shapes, not HTTP: `server.py` does the
transport, SSE framing and status codes (every failure here is an `OpenAIError` carrying its status).

Each prompt of a request is one engine request (n choices each); choice index = prompt index * n + sample index,
as in OpenAI's API.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import dataclasses
import logging
import re
import threading
import time
import uuid
from collections.abc import AsyncIterator

from jaxpaged.chat import TemplateOptionError
from jaxpaged.engine.grammar_guard import GrammarBusyError
from jaxpaged.engine.input_processor import truncate_prompt, truncation_length
from jaxpaged.engine.reasoning import ReasoningParser
from jaxpaged.engine.reasoning import reasoning_parser as make_reasoning_parser
from jaxpaged.entrypoints.async_engine import (
    AsyncEngine,
    EngineOverloadedError,
    EngineStepError,
    EngineStoppedError,
    RequestAbortedError,
    RequestGrammarError,
    RequestStream,
)
from jaxpaged.entrypoints.openai.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    OpenAIError,
    TokenizeRequest,
)
from jaxpaged.entrypoints.openai.tokenization import PromptTokenizer
from jaxpaged.entrypoints.openai.tool_parsers import ToolCall, calls_from_required, tool_parser
from jaxpaged.outputs import CompletionOutput, Logprob, RequestOutput
from jaxpaged.sampling_params import MAX_LOGPROBS, StructuredOutputsParams

logger = logging.getLogger(__name__)
# Threads that check and compile structured-output grammars (each waits on a grammar worker process, or compiles
# a checked grammar with the GIL released), so the event loop and the engine thread never do.
GRAMMAR_THREADS = 4
# Structured-output requests queued for those threads (a flood of costly specs waits its turn, up to this many; more
# are answered 429 at once rather than queued without bound).
MAX_GRAMMAR_BACKLOG = 64


@dataclasses.dataclass
class _Prompt:
    text: str | None
    token_ids: list[int]


@dataclasses.dataclass
class _ChoiceState:
    """What one choice's stream has sent so far."""

    chars: int = 0
    tokens: int = 0
    ids: int = 0  # token ids sent (return_token_ids)
    reasoning_chars: int = 0  # reasoning sent (a reasoning parser)
    started: bool = False
    done: bool = False


class OpenAIServing:
    """`max_prompt_chars`: longer string prompts (or chat contents) are refused before tokenizing; the default is
    the longest text that could fit in max_model_len tokens (see `tokenization.py`)."""

    def __init__(self, engine: AsyncEngine, model_names: list[str], max_prompt_chars: int | None = None,
                 max_prompts_per_request: int = 64, tool_call_parser: str | None = None,
                 chat_template: str | None = None):
        if not model_names:
            raise ValueError("model_names must name at least one model")
        self.tool_parser = tool_parser(tool_call_parser)  # None: tool_choice "auto" is refused
        # the engine's option (its grammars wait for </think> too); None: reasoning stays in the content
        self.reasoning_parser = make_reasoning_parser(engine.engine.config.reasoning_parser)
        self.max_prompts_per_request = max_prompts_per_request
        self.engine = engine
        self.model_names = list(model_names)
        self.prompt_tokenizer = PromptTokenizer(engine.tokenizer, engine.max_model_len, max_prompt_chars, chat_template)
        self.created = int(time.time())
        self._token_cache: dict[int, tuple[str, bytes]] = {}
        self._grammar_threads = concurrent.futures.ThreadPoolExecutor(GRAMMAR_THREADS, thread_name_prefix="grammar")
        self._grammar_backlog = 0  # jobs submitted to the grammar threads and not yet finished (even if abandoned)
        self._grammar_lock = threading.Lock()
        self._grammar_threads.submit(self._warm_up_grammars)

    # ---- models -----------------------------------------------------------------------------------------------

    def close(self) -> None:
        self.prompt_tokenizer.close()
        self._grammar_threads.shutdown(wait=False, cancel_futures=True)

    def list_models(self) -> dict:
        return {"object": "list", "data": [self._model_card(name) for name in self.model_names]}

    def get_model(self, name: str) -> dict:
        self._check_model(name)
        return self._model_card(name)

    def _model_card(self, name: str) -> dict:
        return {"id": name, "object": "model", "created": self.created, "owned_by": "jaxpaged",
                "root": self.model_names[0], "max_model_len": self.engine.max_model_len}

    def _check_model(self, name: str | None) -> str:
        if name is None:
            return self.model_names[0]
        if name not in self.model_names:
            raise OpenAIError(f"The model '{name}' does not exist; this server serves "
                              f"{', '.join(repr(n) for n in self.model_names)}", status=404, param="model",
                              code="model_not_found")
        return name

    # ---- the two endpoints ------------------------------------------------------------------------------------

    async def completion(self, body: CompletionRequest) -> dict | ChunkStream:
        model = self._check_model(body.model)
        prompts = []
        if len(body.prompts()) > self.max_prompts_per_request:
            raise OpenAIError(f"prompt holds {len(body.prompts())} prompts; at most {self.max_prompts_per_request} "
                              "are allowed in one request", param="prompt")
        keep = self._truncation(body)
        for p in body.prompts():
            if isinstance(p, str):
                if keep is None:
                    self._check_chars(len(p), "prompt")
                    prompts.append(_Prompt(p, await self._encode(p)))
                else:  # only the text's end is read: 2 max_chars characters hold 2 max_model_len tokens or more
                    ids = await self._encode(p[-2 * self.prompt_tokenizer.max_chars:])
                    prompts.append(_Prompt(p, truncate_prompt(ids, keep, self.prompt_tokenizer.bos_token_id)))
            else:
                prompts.append(_Prompt(None, list(p) if keep is None else truncate_prompt(list(p), keep)))
        max_tokens = self._max_tokens(prompts, body.max_tokens, "prompt")
        structured, grammar_param = await self._structured(body)
        # echo with logprobs: the prompt's tokens get theirs too (OpenAI's legacy scoring, e.g. lm-eval-harness);
        # vLLM's prompt_logprobs asks for them in its own shape
        asked = [k for k in (body.logprobs if body.echo else None, body.prompt_logprobs) if k is not None]
        prompt_logprobs = max(asked) if asked else None
        ctx = await self._start("cmpl", model, body.n, prompts,
                                body.sampling_params(max_tokens, body.logprobs, structured, prompt_logprobs,
                                                     self.engine.generation_defaults),
                                grammar_param, body.priority)
        if body.stream:
            return ChunkStream(self._completion_chunks(ctx, body), ctx)
        finals = await ctx.finals()
        choices, as_ids = [], body.return_tokens_as_token_ids
        for k, out in enumerate(finals):
            echo = self._prompt_text(prompts[k]) if body.echo else ""
            for o in out.outputs:
                lp = None
                if body.logprobs is not None:
                    lp = self._completion_logprobs(o, 0, len(echo), as_ids)
                    if body.echo:
                        lp = _joined(self._prompt_logprobs(prompts[k].token_ids, out.prompt_logprobs, body.logprobs,
                                                           as_ids), lp)
                choice = {"index": k * body.n + o.index, "text": echo + o.text, "logprobs": lp,
                          "finish_reason": o.finish_reason, "stop_reason": o.stop_reason}
                if body.prompt_logprobs is not None:
                    choice["prompt_logprobs"] = _vllm_logprobs(out.prompt_logprobs, body.prompt_logprobs)
                if body.return_token_ids:  # vLLM's
                    choice["prompt_token_ids"], choice["token_ids"] = prompts[k].token_ids, o.token_ids
                choices.append(choice)
        return {"id": ctx.request_id, "object": "text_completion", "created": ctx.created, "model": model,
                "choices": choices, "usage": _usage(finals)}

    async def chat(self, body: ChatCompletionRequest) -> dict | ChunkStream:
        model = self._check_model(body.model)
        if body.tool_mode == "auto" and self.tool_parser is None:
            raise OpenAIError('tool_choice "auto" needs the server started with --tool-call-parser; use "none", '
                              '"required" or a named function', param="tool_choice")
        ids = await self._chat_ids(body, body.template_tools())
        keep = self._truncation(body)
        prompts = [_Prompt(None, ids if keep is None else truncate_prompt(ids, keep))]
        max_tokens = self._max_tokens(prompts, body.requested_max_tokens, "messages",
                                      "max_tokens" if body.max_completion_tokens is None else "max_completion_tokens")
        structured, grammar_param = await self._structured(body)
        ctx = await self._start("chatcmpl", model, body.n, prompts,
                                body.sampling_params(max_tokens, body.engine_logprobs, structured,
                                                     body.prompt_logprobs, self.engine.generation_defaults),
                                grammar_param, body.priority)
        constrained = structured is not None or body.tool_mode in ("required", "named")
        if self.reasoning_parser is not None and (not constrained or self.engine.engine.gates_grammars):
            # (a grammar the engine cannot hold back until </think> constrains the output from its first token:
            # then there is no reasoning to take apart)
            ctx.reasoning = self.reasoning_parser
            ctx.thinking_prompt = ctx.reasoning.opens_in_prompt(self._decode(prompts[0].token_ids[-8:]))
        if body.stream:
            return ChunkStream(self._chat_chunks(ctx, body), ctx)
        (out,) = await ctx.finals()
        choices = []
        for o in out.outputs:
            reasoning, text = ctx.split(o.text, done=True)
            content, calls, finish = self._tool_calls(body, o, text)
            message = {"role": "assistant", "content": content}
            if ctx.reasoning is not None:
                message["reasoning_content"] = reasoning or None
            if calls:
                message["tool_calls"] = [c.as_openai() for c in calls]
            choices.append({"index": o.index, "message": message,
                            "logprobs": self._chat_logprobs(o, 0, body.top_logprobs or 0,
                                                            body.return_tokens_as_token_ids) if body.logprobs else None,
                            "finish_reason": finish, "stop_reason": o.stop_reason,
                            **({"token_ids": o.token_ids} if body.return_token_ids else {})})
        response = {"id": ctx.request_id, "object": "chat.completion", "created": ctx.created, "model": model,
                    "choices": choices, "usage": _usage([out])}
        if body.prompt_logprobs is not None:  # vLLM's: on the response, not per choice
            response["prompt_logprobs"] = _vllm_logprobs(out.prompt_logprobs, body.prompt_logprobs)
        if body.return_token_ids:  # vLLM's
            response["prompt_token_ids"] = prompts[0].token_ids
        return response

    # ---- tokenizer endpoints (vLLM's /tokenize and /detokenize) ----------------------------------------------------

    async def tokenize(self, body: TokenizeRequest) -> dict:
        """The prompt's token ids exactly as /v1/completions (prompt) or /v1/chat/completions (messages) would
        feed them to the model. Not refused for exceeding max_model_len: `count` and `max_model_len` say so."""
        self._check_model(body.model)
        if body.messages is not None:
            ids = await self._chat_ids(body)
        else:
            self._check_chars(len(body.prompt), "prompt")
            add_special = True if body.add_special_tokens is None else body.add_special_tokens
            try:
                ids = await self.prompt_tokenizer.encode(body.prompt, add_special)
            except ValueError as e:
                raise OpenAIError(str(e), param="prompt") from e
        out = {"count": len(ids), "max_model_len": self.engine.max_model_len, "tokens": ids}
        if body.return_token_strs:
            out["token_strs"] = await self.prompt_tokenizer.token_strs(ids)
        return out

    async def detokenize(self, body: DetokenizeRequest) -> dict:
        self._check_model(body.model)
        vocab = self.engine.vocab_size
        for i, t in enumerate(body.tokens):
            if not 0 <= t < vocab:
                raise OpenAIError(f"tokens[{i}]={t} is not a token id of this model: ids are in [0, {vocab})",
                                  param="tokens")
        try:
            return {"prompt": await self.prompt_tokenizer.decode(body.tokens)}
        except ValueError as e:
            raise OpenAIError(str(e), param="tokens") from e

    # ---- streaming ----------------------------------------------------------------------------------------------

    async def _completion_chunks(self, ctx: _Context, body: CompletionRequest) -> AsyncIterator[dict]:
        states: dict[int, _ChoiceState] = {}
        finals: dict[int, RequestOutput] = {}
        usage_key = {"usage": None} if body.include_usage else {}
        async with contextlib.aclosing(ctx.merged()) as merged:
            async for k, out in merged:
                choices = [c for o in out.outputs
                           if (c := self._completion_delta(ctx, body, k, o, states, out.prompt_logprobs))]
                if out.finished:
                    finals[k] = out
                if choices:
                    yield {"id": ctx.request_id, "object": "text_completion", "created": ctx.created,
                           "model": ctx.model, "choices": choices,
                           **({"usage": _usage([out])} if body.continuous_usage else usage_key)}
        if body.include_usage:
            yield {"id": ctx.request_id, "object": "text_completion", "created": ctx.created, "model": ctx.model,
                   "choices": [], "usage": _usage([finals[k] for k in sorted(finals)])}

    def _completion_delta(self, ctx: _Context, body: CompletionRequest, k: int, o: CompletionOutput,
                          states: dict[int, _ChoiceState], prompt_logprobs: list | None = None) -> dict | None:
        """The stream choice for what `o` adds since the last chunk, or None when it adds nothing; the first one
        carries the echoed prompt (and with logprobs, the prompt's)."""
        index = k * body.n + o.index
        st = states.setdefault(index, _ChoiceState())
        if st.done:
            return None
        echo = self._prompt_text(ctx.prompts[k]) if body.echo and not st.started else ""
        delta, new_tokens = o.text[st.chars:], o.token_ids[st.tokens:]
        finished = o.finish_reason is not None
        if not (echo or delta or finished or (new_tokens and body.logprobs is not None)):
            return None
        as_ids = body.return_tokens_as_token_ids
        lp = self._completion_logprobs(o, st.tokens, st.chars, as_ids) if body.logprobs is not None else None
        if lp is not None and echo:
            lp = _joined(self._prompt_logprobs(ctx.prompts[k].token_ids, prompt_logprobs, body.logprobs, as_ids), lp)
        choice = {"index": index, "text": echo + delta, "logprobs": lp, "finish_reason": o.finish_reason,
                  "stop_reason": o.stop_reason}
        if body.return_token_ids and not st.started:  # vLLM's: the prompt's ids in the choice's first chunk
            choice["prompt_token_ids"] = ctx.prompts[k].token_ids
        st.started, st.done = True, finished
        st.chars, st.tokens = max(st.chars, len(o.text)), len(o.token_ids)
        return self._with_token_ids(body, choice, st, o)

    async def _chat_chunks(self, ctx: _Context, body: ChatCompletionRequest) -> AsyncIterator[dict]:
        states: dict[int, _ChoiceState] = {}
        final: RequestOutput | None = None
        usage_key = {"usage": None} if body.include_usage else {}

        def chunk(choices, **extra):
            return {"id": ctx.request_id, "object": "chat.completion.chunk", "created": ctx.created,
                    "model": ctx.model, "choices": choices, **usage_key, **extra}

        prompt = len(ctx.prompts[0].token_ids)
        yield chunk([{"index": i, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                      "finish_reason": None} for i in range(body.n)],
                    **({"usage": _counts(prompt, 0)} if body.continuous_usage else {}),  # cached: not known yet
                    **({"prompt_token_ids": ctx.prompts[0].token_ids} if body.return_token_ids else {}))
        async with contextlib.aclosing(ctx.merged()) as merged:
            async for _, out in merged:
                choices = [c for o in out.outputs if (c := self._chat_delta(ctx, body, o, states))]
                if out.finished:
                    final = out
                if choices:
                    yield chunk(choices, **({"usage": _usage([out])} if body.continuous_usage else {}))
        if body.include_usage and final is not None:
            yield chunk([], usage=_usage([final]))

    def _tool_calls(self, body: ChatCompletionRequest, o: CompletionOutput,
                    text: str) -> tuple[str | None, list[ToolCall], str]:
        """(content, tool calls, finish_reason) of a finished choice whose text, its reasoning taken out, is
        `text`."""
        mode = body.tool_mode
        if mode == "none" or o.finish_reason not in ("stop", "length"):
            return text, [], o.finish_reason
        try:
            if mode == "named":
                return None, [ToolCall(body.tool_choice.function.name, text)], o.finish_reason
            if mode == "required":
                return None, calls_from_required(text), "tool_calls"
        except ValueError:  # cut off by max_tokens before the JSON closed
            return text, [], o.finish_reason
        content, calls = self.tool_parser.extract(text)
        return content, calls, "tool_calls" if calls else o.finish_reason

    def _chat_tool_delta(self, ctx: _Context, body: ChatCompletionRequest, o: CompletionOutput,
                         states: dict[int, _ChoiceState]) -> dict | None:
        """Streaming with tools: a named function's arguments stream as they are generated (after one delta with
        its id and name); "required" and "auto" outputs (and an "auto" one's reasoning) are parsed when the choice
        finishes."""
        st = states.setdefault(o.index, _ChoiceState())
        if st.done:
            return None
        finished = o.finish_reason is not None
        delta: dict = {}
        if body.tool_mode == "named" and o.finish_reason in (None, "stop", "length"):
            reasoning, text = ctx.split(o.text, done=finished)  # (the arguments follow the reasoning, if any)
            if reasoning and reasoning[st.reasoning_chars:]:
                delta["reasoning_content"] = reasoning[st.reasoning_chars:]
            st.reasoning_chars = max(st.reasoning_chars, len(reasoning or ""))
            piece = text[st.chars:]
            # the call (its id and name) starts with the first delta, or after the reasoning with its arguments
            if piece or (not st.started and (ctx.reasoning is None or finished)):
                call = {"index": 0, "function": {"arguments": piece}}
                if not st.started:
                    call = ToolCall(body.tool_choice.function.name, piece).as_openai(index=0)
                delta["tool_calls"] = [call]
                st.started = True
            finish = o.finish_reason
            st.chars = max(st.chars, len(text))
        elif finished:
            reasoning, text = ctx.split(o.text, done=True)
            content, calls, finish = self._tool_calls(body, o, text)
            delta = {"reasoning_content": reasoning} if reasoning else {}
            if content:
                delta["content"] = content
            if calls:
                delta["tool_calls"] = [c.as_openai(index=i) for i, c in enumerate(calls)]
        else:
            return None
        st.done = finished
        st.tokens = len(o.token_ids)
        if body.tool_mode != "named":
            st.chars = max(st.chars, len(o.text))
        if not (delta or finished):
            return None
        lp = (self._chat_logprobs(o, 0, body.top_logprobs or 0, body.return_tokens_as_token_ids)
              if body.logprobs and finished else None)
        return self._with_token_ids(body, {"index": o.index, "delta": delta, "logprobs": lp, "finish_reason": finish,
                                           "stop_reason": o.stop_reason}, st, o)

    def _chat_delta(self, ctx: _Context, body: ChatCompletionRequest, o: CompletionOutput,
                    states: dict[int, _ChoiceState]) -> dict | None:
        if body.tool_mode != "none":
            return self._chat_tool_delta(ctx, body, o, states)
        st = states.setdefault(o.index, _ChoiceState())
        if st.done:
            return None
        finished = o.finish_reason is not None
        reasoning, text = ctx.split(o.text, done=finished)  # st.chars counts the content's characters
        delta = {}
        if reasoning and reasoning[st.reasoning_chars:]:
            delta["reasoning_content"] = reasoning[st.reasoning_chars:]
        if text[st.chars:]:
            delta["content"] = text[st.chars:]
        if not (delta or finished or (o.token_ids[st.tokens:] and body.logprobs)):
            return None
        lp = (self._chat_logprobs(o, st.tokens, body.top_logprobs or 0, body.return_tokens_as_token_ids)
              if body.logprobs else None)
        st.done = finished
        st.chars, st.tokens = max(st.chars, len(text)), len(o.token_ids)
        st.reasoning_chars = max(st.reasoning_chars, len(reasoning or ""))
        return self._with_token_ids(body, {"index": o.index, "delta": delta, "logprobs": lp,
                                           "finish_reason": o.finish_reason, "stop_reason": o.stop_reason}, st, o)

    # ---- helpers ------------------------------------------------------------------------------------------------

    def _warm_up_grammars(self) -> None:
        grammars = getattr(getattr(self.engine, "engine", None), "grammars", None)
        if grammars is None or self.engine.tokenizer is None:
            return
        try:
            grammars.warm_up()
        except Exception as e:  # e.g. a slow tokenizer: structured-output requests will say so themselves
            logger.warning("structured outputs were not warmed up: %s", str(e)[:200])

    async def _structured(self, body: CompletionRequest | ChatCompletionRequest
                          ) -> tuple[StructuredOutputsParams | None, str | None]:
        """The body's structured-output constraint and the field that set it (a grammar that fails while generating
        is blamed on it), checked and its grammar compiled for the engine on a grammar thread: a large or hostile
        spec holds up neither the event loop (/health, other streams) nor the engine thread, which then finds the
        grammar compiled. Errors name the field (400; 429 when the workers are busy)."""
        if not body.sets_structured_output:
            return None, None
        with self._grammar_lock:
            if self._grammar_backlog >= MAX_GRAMMAR_BACKLOG:
                raise OpenAIError(f"{self._grammar_backlog} structured-output requests are waiting for their grammars "
                                  "to be checked; retry later", status=429, type="server_overloaded",
                                  code="grammar_busy")
            self._grammar_backlog += 1
        return await asyncio.get_running_loop().run_in_executor(self._grammar_threads, self._compile_structured, body)

    def _compile_structured(self, body: CompletionRequest | ChatCompletionRequest
                            ) -> tuple[StructuredOutputsParams | None, str | None]:
        try:
            return self._compile_structured_now(body)
        finally:
            with self._grammar_lock:
                self._grammar_backlog -= 1

    def _compile_structured_now(self, body: CompletionRequest | ChatCompletionRequest
                                ) -> tuple[StructuredOutputsParams | None, str | None]:
        structured, param = body.structured_output_request()
        if structured is None:
            return None, None
        try:
            self.engine.engine.grammars.prepare(structured.kind, structured.spec)
        except GrammarBusyError as e:
            raise OpenAIError(str(e), status=429, type="server_overloaded", param=param, code="grammar_busy") from e
        except (TypeError, ValueError) as e:
            raise OpenAIError(f"{param}: {e}", param=param) from e
        return structured, param

    async def _chat_ids(self, body: ChatCompletionRequest | TokenizeRequest, tools: list[dict] | None = None
                        ) -> list[int]:
        """The prompt ids of the body's messages, through the chat template with the body's options."""
        conversation = [m.as_template_message(i) for i, m in enumerate(body.messages)]
        self._check_chars(sum(len(m["content"]) for m in conversation), "messages")
        try:
            return await self.prompt_tokenizer.apply_chat_template(
                conversation, body.add_generation_prompt, tools, continue_final_message=body.continue_final_message,
                chat_template_kwargs=body.chat_template_kwargs)
        except TemplateOptionError as e:
            raise OpenAIError(str(e), param=e.param) from e
        except ValueError as e:
            raise OpenAIError(str(e), param="messages") from e
        except Exception as e:  # the template's own checks (e.g. roles must alternate) raise jinja errors
            raise OpenAIError(f"the chat template rejected the messages: {e}", param="messages") from e

    async def _encode(self, text: str) -> list[int]:
        try:
            return await self.prompt_tokenizer.encode(text)
        except ValueError as e:
            raise OpenAIError(str(e), param="prompt") from e

    def _truncation(self, body: CompletionRequest | ChatCompletionRequest) -> int | None:
        """How many prompt tokens the body's truncate_prompt_tokens keeps (None: no truncation)."""
        if body.truncate_prompt_tokens is None:
            return None
        try:
            return truncation_length(body.truncate_prompt_tokens, self.engine.max_model_len)
        except ValueError as e:
            raise OpenAIError(str(e), param="truncate_prompt_tokens") from e

    def _check_chars(self, chars: int, param: str) -> None:
        """Refuses text too long to fit the context before spending seconds tokenizing it."""
        limit = self.prompt_tokenizer.max_chars
        if chars > limit:
            tokens = self.engine.max_model_len
            raise OpenAIError(
                f"This model's maximum context length is {tokens} tokens. However, your {param} is {chars} "
                f"characters, more than this server tokenizes ({limit} characters, --max-prompt-chars). Please "
                f"reduce the length of the {param}.", param=param, code="context_length_exceeded")

    def _max_tokens(self, prompts: list[_Prompt], max_tokens: int | None, param: str,
                    tokens_param: str = "max_tokens") -> int | None:
        """Refuses prompts (plus max_tokens) beyond the context, as OpenAI words it; `tokens_param` is the field that
        set max_tokens (chat's max_completion_tokens, when given)."""
        limit = self.engine.max_model_len
        what = "messages" if param == "messages" else "prompt"
        for p in prompts:
            n = len(p.token_ids)
            if n == 0:
                raise OpenAIError(f"the {what} is empty: it must have at least one token", param=param)
            if n >= limit:
                raise OpenAIError(
                    f"This model's maximum context length is {limit} tokens. However, your {what} is {n} tokens, "
                    "which leaves no room for the completion. Please reduce the length of the "
                    f"{what}.", param=param, code="context_length_exceeded")
            if max_tokens is not None and n + max_tokens > limit:
                raise OpenAIError(
                    f"This model's maximum context length is {limit} tokens. However, you requested "
                    f"{n + max_tokens} tokens ({n} in the {what}, {max_tokens} in the completion). Please reduce "
                    f"the length of the {what} or completion.", param=tokens_param, code="context_length_exceeded")
        return max_tokens

    async def _start(self, id_prefix: str, model: str, n: int, prompts: list[_Prompt], params,
                     grammar_param: str | None = None, priority: int = 0) -> _Context:
        """Submits the prompts as one OpenAI request, id `<id_prefix>-<hex>`; the context merges their streams.
        grammar_param: the field whose grammar constrains the output."""
        request_id = f"{id_prefix}-{uuid.uuid4().hex}"
        streams = await self._add(request_id, prompts, params, priority)
        return _Context(request_id, model, int(time.time()), n, prompts, streams, self, grammar_param)

    async def _add(self, request_id: str, prompts: list[_Prompt], params, priority: int = 0) -> list[RequestStream]:
        """Queues every prompt of the request in one engine iteration, or none of them."""
        rids = [request_id] if len(prompts) == 1 else [f"{request_id}-{k}" for k in range(len(prompts))]
        try:
            return await self.engine.add_requests(
                [(rid, {"prompt": p.text, "prompt_token_ids": p.token_ids}, params)
                 for rid, p in zip(rids, prompts, strict=True)], priority)
        except BaseException as e:
            if isinstance(e, (ValueError, TypeError)):
                # The engine's checks start with the field they are about ("stop_token_ids must be in ...").
                field = re.match(r"([a-z_]+)\b", str(e))
                param = field.group(1) if field and field.group(1) in CompletionRequest.model_fields else \
                    ("prompt" if len(prompts) > 1 or prompts[0].text else None)
                raise OpenAIError(str(e), param=param) from e
            if isinstance(e, EngineOverloadedError):
                raise OpenAIError(str(e), status=429, type="server_overloaded",
                                  code="too_many_waiting_requests") from e
            if isinstance(e, EngineStoppedError):
                raise OpenAIError(str(e), status=503, type="service_unavailable", code="shutting_down") from e
            raise

    def _prompt_text(self, p: _Prompt) -> str:
        if p.text is not None:
            return p.text
        return self._decode(p.token_ids)

    def _decode(self, ids: list[int]) -> str:
        tok = self.engine.tokenizer
        return tok.decode(ids, skip_special_tokens=False) if tok is not None else ""

    def _token(self, token_id: int, as_id: bool = False) -> tuple[str, bytes]:
        """A token's text for logprobs and its bytes. A token that is only part of a UTF-8 character (byte-level
        BPE splits them) has no text of its own: it is written `bytes:\\xe2\\x80`, as OpenAI does. as_id (vLLM's
        return_tokens_as_token_ids): the text is `token_id:<id>`."""
        cached = self._token_cache.get(token_id)
        if cached is None:
            cached = self._token_cache[token_id] = _token_text(self.engine.tokenizer, token_id)
        return (f"token_id:{token_id}", cached[1]) if as_id else cached

    def _completion_logprobs(self, o: CompletionOutput, start: int, text_offset: int, as_ids: bool) -> dict:
        """OpenAI's legacy logprobs of tokens start.. of one choice."""
        return self._legacy_logprobs(o.token_ids[start:], (o.logprobs or [])[start:], text_offset, MAX_LOGPROBS,
                                     as_ids)

    def _legacy_logprobs(self, token_ids: list[int], entries: list[dict[int, Logprob] | None], offset: int,
                         k: int, as_ids: bool) -> dict:
        """OpenAI's legacy logprobs object of tokens and their {token id: Logprob} entries (None: a token without
        one, an echoed prompt's first), their text starting at character `offset`; each token's top k and itself;
        as_ids: tokens written `token_id:<id>` (vLLM's return_tokens_as_token_ids)."""
        tokens, token_logprobs, top, offsets = [], [], [], []
        for t, entry in zip(token_ids, entries, strict=False):
            s = self._token(t, as_ids)[0]
            tokens.append(s)
            token_logprobs.append(None if entry is None else entry[t].logprob)
            top.append(None if entry is None else {self._token(i, as_ids)[0]: e.logprob for i, e in sorted(
                entry.items(), key=lambda kv: -kv[1].logprob) if e.rank <= k or i == t})
            offsets.append(offset)
            offset += len(s)
        return {"tokens": tokens, "token_logprobs": token_logprobs, "top_logprobs": top, "text_offset": offsets}

    def _prompt_logprobs(self, token_ids: list[int], prompt_logprobs: list | None, k: int, as_ids: bool) -> dict:
        """OpenAI's legacy logprobs of the prompt's tokens (echo with logprobs): the first token has none."""
        return self._legacy_logprobs(token_ids, prompt_logprobs or [None] * len(token_ids), 0, k, as_ids)

    def _chat_logprobs(self, o: CompletionOutput, start: int, top_k: int, as_ids: bool) -> dict:
        content = []
        for t, lps in zip(o.token_ids[start:], (o.logprobs or [])[start:], strict=False):
            s, b = self._token(t, as_ids)
            ranked = sorted(lps.items(), key=lambda kv: -kv[1].logprob)[:top_k]
            content.append({"token": s, "logprob": lps[t].logprob, "bytes": list(b),
                            "top_logprobs": [{"token": self._token(i, as_ids)[0], "logprob": e.logprob,
                                              "bytes": list(self._token(i)[1])} for i, e in ranked]})
        return {"content": content}

    @staticmethod
    def _with_token_ids(body, choice: dict, st: _ChoiceState, o: CompletionOutput) -> dict:
        """A stream chunk's choice with the token ids new since the choice's last chunk (vLLM's return_token_ids)."""
        if body.return_token_ids:
            choice["token_ids"], st.ids = o.token_ids[st.ids:], len(o.token_ids)
        return choice


@dataclasses.dataclass
class _Context:
    request_id: str
    model: str
    created: int
    n: int
    prompts: list[_Prompt]
    streams: list[RequestStream]
    serving: OpenAIServing
    grammar_param: str | None = None  # the field whose grammar constrains the output (named if it fails midway)
    reasoning: ReasoningParser | None = None  # a chat whose outputs' reasoning is taken apart from the content
    thinking_prompt: bool = False  # its prompt ends inside a think block

    def split(self, text: str, done: bool) -> tuple[str | None, str]:
        """(reasoning, content) of a choice's text so far (`ReasoningParser.split`); (None, text) without one."""
        if self.reasoning is None:
            return None, text
        return self.reasoning.split(text, self.thinking_prompt, done)

    async def finals(self) -> list[RequestOutput]:
        finals: dict[int, RequestOutput] = {}
        async with contextlib.aclosing(self.merged()) as merged:
            async for k, out in merged:
                if out.finished:
                    finals[k] = out
        return [finals[k] for k in range(len(self.streams))]

    async def merged(self) -> AsyncIterator[tuple[int, RequestOutput]]:
        """(prompt index, output) from every stream as they come; closing it aborts the unfinished ones."""
        try:
            if len(self.streams) == 1:
                async for out in self.streams[0]:
                    yield 0, out
                return
            # The newest unread item per prompt: outputs are cumulative, so a newer one replaces an older one and a
            # consumer that stops reading (a client that does not read its stream) holds one output per prompt.
            unread: dict[int, RequestOutput | BaseException] = {}
            wakeup = asyncio.Event()

            async def pump(k: int, stream: RequestStream):
                try:
                    async for out in stream:
                        unread[k] = out
                        wakeup.set()
                except Exception as e:
                    unread[k] = e
                    wakeup.set()

            tasks = [asyncio.create_task(pump(k, s)) for k, s in enumerate(self.streams)]
            try:
                remaining = len(self.streams)
                while remaining:
                    while not unread:
                        wakeup.clear()
                        await wakeup.wait()
                    k = next(iter(unread))
                    item = unread.pop(k)
                    if isinstance(item, BaseException):
                        raise item
                    remaining -= item.finished
                    yield k, item
            finally:
                for t in tasks:
                    t.cancel()
        except RequestGrammarError as e:  # the request's own grammar: a client error, in its own words
            raise OpenAIError(str(e), param=self.grammar_param, code="grammar_failed") from e
        except EngineStepError as e:  # the details (state, tracebacks) are in the server log, never in the answer
            logger.error("request %s failed inside the engine: %s", self.request_id, str(e)[:2000])
            raise OpenAIError(f"the engine failed while generating request {self.request_id}; the server log has the "
                              "details", status=500, type="server_error", code="engine_step_error") from e
        except (RequestAbortedError, EngineStoppedError) as e:
            raise OpenAIError(str(e), status=503, type="service_unavailable", code=type(e).__name__) from e
        finally:
            await self.aclose()

    async def aclose(self) -> None:
        for s in self.streams:
            await s.aclose()


class ChunkStream:
    """The chunk dicts of a streamed response. `aclose()` aborts the request even if iteration never began."""

    def __init__(self, chunks: AsyncIterator[dict], ctx: _Context):
        self._chunks, self._ctx = chunks, ctx

    def __aiter__(self) -> ChunkStream:
        return self

    async def __anext__(self) -> dict:
        return await self._chunks.__anext__()

    async def aclose(self) -> None:
        try:
            await self._chunks.aclose()
        finally:
            await self._ctx.aclose()


def _byte_level_alphabet() -> dict[str, int]:
    """GPT-2's byte-level BPE alphabet: printable bytes stand for themselves, the others for chr(256 + k)."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("\xa1"), ord("\xac") + 1),
                 *range(ord("\xae"), ord("\xff") + 1)]
    chars, extra = {}, 0
    for b in range(256):
        if b in printable:
            chars[chr(b)] = b
        else:
            chars[chr(256 + extra)] = b
            extra += 1
    return chars


_BYTE_LEVEL = _byte_level_alphabet()


def _token_text(tokenizer, token_id: int) -> tuple[str, bytes]:
    if tokenizer is None:
        return f"token_id:{token_id}", b""
    text = tokenizer.decode([token_id], skip_special_tokens=False)
    if "\ufffd" not in text:
        return text, text.encode()
    piece = tokenizer.convert_ids_to_tokens(token_id) or ""
    if len(piece) == 6 and piece.startswith("<0x") and piece.endswith(">"):  # SentencePiece byte fallback
        raw = bytes([int(piece[3:5], 16)])
    elif piece and all(c in _BYTE_LEVEL for c in piece):
        raw = bytes(_BYTE_LEVEL[c] for c in piece)
    else:
        return text, text.encode()
    return "bytes:" + "".join(f"\\x{b:02x}" for b in raw), raw


def _vllm_logprobs(entries: list[dict[int, Logprob] | None] | None, k: int) -> list[dict | None]:
    """vLLM's prompt_logprobs in a response: per position None (the first) or {token id: {logprob, rank,
    decoded_token}} of the prompt's token (first) and the top k; -inf written -9999.0 as vLLM does (JSON has no
    infinity)."""
    return [None if entry is None else
            {str(i): {"logprob": max(e.logprob, -9999.0), "rank": e.rank, "decoded_token": e.decoded_token}
             for j, (i, e) in enumerate(entry.items()) if j == 0 or e.rank <= k}
            for entry in entries or []]


def _joined(first: dict, then: dict) -> dict:
    """Two legacy logprobs objects, one after the other."""
    return {key: first[key] + then[key] for key in first}


def _usage(outputs: list[RequestOutput]) -> dict:
    """The usage of the requests' outputs (their tokens so far, for a stream's continuous usage)."""
    return _counts(sum(len(o.prompt_token_ids) for o in outputs),
                   sum(len(c.token_ids) for o in outputs for c in o.outputs), sum(o.num_cached_tokens for o in outputs))


def _counts(prompt: int, completion: int, cached: int | None = None) -> dict:
    usage = {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}
    if cached is not None:
        usage["prompt_tokens_details"] = {"cached_tokens": cached}
    return usage


__all__ = ["ChunkStream", "OpenAIServing"]
