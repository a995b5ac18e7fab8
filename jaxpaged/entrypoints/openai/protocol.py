"""The OpenAI API's request bodies as pydantic models, and its error shape. No HTTP library, no engine.

Bodies are validated in strict JSON mode: `"max_tokens": "5"` is a type error, as with OpenAI. Unknown fields are
ignored (clients send `user` and the like); fields we do not implement are refused when set to anything but their
neutral value, with a 400 that names the field.
"""

from __future__ import annotations

import json
import re
from typing import Literal, TypeVar

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from jaxpaged import client_json
from jaxpaged.chat import TemplateOptionError, check_template_options
from jaxpaged.engine.grammar_guard import GrammarBusyError
from jaxpaged.sampling_params import MAX_LOGPROBS, MAX_N, SamplingParams, StructuredOutputsParams

# A logit_bias key is a token id written as OpenAI writes it: canonical ASCII decimal (no sign, space, "_" or
# leading zero), so two keys can never name the same token.
_TOKEN_ID_KEY = re.compile(r"0|[1-9][0-9]{0,9}")


class OpenAIError(Exception):
    """An error the API answers with `{"error": {"message", "type", "param", "code"}}` and `status`."""

    def __init__(self, message: str, status: int = 400, type: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.message, self.status, self.type, self.param, self.code = message, status, type, param, code

    def body(self) -> dict:
        return error_body(self.message, self.type, self.param, self.code)


def error_body(message: str, type: str = "invalid_request_error", param: str | None = None,
               code: str | None = None) -> dict:
    return {"error": {"message": message, "type": type, "param": param, "code": code}}


class _Body(BaseModel):
    # allow_inf_nan: "1e999" and "Infinity" parse as inf; no float field of the API means that
    model_config = ConfigDict(extra="ignore", strict=True, allow_inf_nan=False)

    def check_unsupported(self) -> None:
        """Refuses values the body parses but this server does not implement (OpenAIError naming the field)."""


_B = TypeVar("_B", bound=_Body)


class StreamOptions(_Body):
    include_usage: bool = False
    continuous_usage_stats: bool = False  # vLLM's: with include_usage, every chunk carries the usage so far


class JsonSchemaFormat(_Body):
    name: str | None = None
    description: str | None = None
    schema_: dict | None = Field(None, alias="schema")
    strict: bool | None = None


class ResponseFormat(_Body):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


# what a field the body leaves unset samples with when the model sets no default (max_tokens None: up to the context)
_OPENAI_DEFAULTS = {"temperature": 1.0, "top_p": 1.0, "top_k": -1, "min_p": 0.0, "repetition_penalty": 1.0,
                    "max_tokens": None}


class _SamplingRequest(_Body):
    """The sampling fields both endpoints share (OpenAI's names; top_k, min_p and the rest as vLLM extends them)."""

    model: str | None = None
    n: int = Field(1, ge=1, le=MAX_N)
    max_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    top_k: int | None = Field(None, ge=-1)
    min_p: float | None = Field(None, ge=0.0, le=1.0)
    seed: int | None = Field(None, ge=0, lt=2**63)
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    user: str | None = None
    response_format: ResponseFormat | None = None
    # vLLM's extensions
    bad_words: list[str] | None = None
    structured_outputs: dict | None = None
    guided_json: dict | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    min_tokens: int = Field(0, ge=0)
    ignore_eos: bool = False
    stop_token_ids: list[int] | None = None
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    truncate_prompt_tokens: int | None = Field(None, ge=-1)  # the prompt's last k tokens; -1: max_model_len
    allowed_token_ids: list[int] | None = None
    priority: int = Field(0, ge=-2**63, lt=2**63)  # lower first, with --scheduling-policy priority
    # each prompt token's log-prob, rank and text, and the top k's (vLLM's; not streamed, as vLLM)
    prompt_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    return_token_ids: bool = False  # the prompt's and each choice's token ids in the response (vLLM's)
    return_tokens_as_token_ids: bool = False  # log-probs' tokens written "token_id:<id>" (vLLM's)

    def check_unsupported(self) -> None:
        if self.stream_options is not None and not self.stream:
            raise OpenAIError("stream_options is only allowed when stream is true", param="stream_options")
        if self.prompt_logprobs is not None and self.stream:
            raise OpenAIError("prompt_logprobs is not available when stream is true (as in vLLM); on "
                              "/v1/completions, echo with logprobs streams the prompt's log-probs in the first chunk",
                              param="prompt_logprobs")
        if self.truncate_prompt_tokens == 0:
            raise OpenAIError("truncate_prompt_tokens must be -1 (the context length) or >= 1 (tokens kept), not 0",
                              param="truncate_prompt_tokens")

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)

    @property
    def continuous_usage(self) -> bool:
        """Every chunk carries its request's usage so far (vLLM's stream_options.continuous_usage_stats)."""
        return self.include_usage and self.stream_options.continuous_usage_stats

    @property
    def sets_structured_output(self) -> bool:
        """Whether `structured_output_request` has a grammar to check (which can take a while: not on the event
        loop)."""
        rf = self.response_format
        return (rf is not None and rf.type != "text") or self.structured_outputs is not None or any(
            getattr(self, f"guided_{kind}") is not None for kind in ("json", "regex", "choice", "grammar"))

    def structured_output_request(self) -> tuple[StructuredOutputsParams | None, str | None]:
        """The one structured-output constraint the body sets (response_format, structured_outputs or a guided_*
        field) and the field that set it; two at once is a 400."""
        given: list[tuple[str, dict]] = []
        rf = self.response_format
        if rf is not None and rf.type == "json_object":
            given.append(("response_format", {"json_object": True}))
        elif rf is not None and rf.type == "json_schema":
            if rf.json_schema is None or rf.json_schema.schema_ is None:
                raise OpenAIError("response_format of type 'json_schema' needs json_schema.schema",
                                  param="response_format")
            given.append(("response_format", {"json": rf.json_schema.schema_}))
        if self.structured_outputs is not None:
            given.append(("structured_outputs", self.structured_outputs))
        for kind in ("json", "regex", "choice", "grammar"):
            value = getattr(self, f"guided_{kind}")
            if value is not None:
                given.append((f"guided_{kind}", {kind: value}))
        if not given:
            return None, None
        if len(given) > 1:
            raise OpenAIError(f"{given[0][0]} and {given[1][0]} both constrain the output; set one",
                              param=given[1][0])
        param, spec = given[0]
        return _structured(spec, param), param

    def sampling_params(self, max_tokens: int | None, logprobs: int | None,
                        structured: StructuredOutputsParams | None = None, prompt_logprobs: int | None = None,
                        defaults: dict | None = None) -> SamplingParams:
        """defaults: the model's values (`AsyncEngine.generation_defaults`, SamplingParams' names) of the fields the
        body leaves unset: temperature, top_p, top_k, min_p, repetition_penalty, max_tokens."""
        d = {**_OPENAI_DEFAULTS, **(defaults or {})}

        def given(field: str, value):
            return d[field] if value is None else value

        if structured is None:
            structured = self.structured_output_request()[0]
        bias = None
        if self.logit_bias is not None:
            bad = next((k for k in self.logit_bias if not _TOKEN_ID_KEY.fullmatch(k)), None)
            if bad is not None:
                raise OpenAIError(f"logit_bias keys must be token ids written in decimal digits without sign, spaces "
                                  f"or leading zeros (\"7\", not \"07\"); got {bad[:20]!r}", param="logit_bias")
            bias = {int(k): v for k, v in self.logit_bias.items()}
        try:
            return SamplingParams(
                n=self.n, temperature=given("temperature", self.temperature), top_p=given("top_p", self.top_p),
                top_k=given("top_k", self.top_k), min_p=given("min_p", self.min_p), seed=self.seed,
                max_tokens=given("max_tokens", max_tokens), min_tokens=self.min_tokens,
                stop=self.stop, stop_token_ids=self.stop_token_ids, ignore_eos=self.ignore_eos,
                include_stop_str_in_output=self.include_stop_str_in_output, logprobs=logprobs,
                skip_special_tokens=self.skip_special_tokens,
                presence_penalty=self.presence_penalty or 0.0, frequency_penalty=self.frequency_penalty or 0.0,
                repetition_penalty=given("repetition_penalty", self.repetition_penalty),
                logit_bias=bias, bad_words=self.bad_words, allowed_token_ids=self.allowed_token_ids,
                structured_outputs=structured, prompt_logprobs=prompt_logprobs)
        except (TypeError, ValueError) as e:  # SamplingParams names the field first: "min_tokens=5 must be <= ..."
            field = re.match(r"[a-z_]+", str(e))
            raise OpenAIError(str(e), param=field.group(0) if field else None) from e


class CompletionRequest(_SamplingRequest):
    """POST /v1/completions."""

    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = Field(16, ge=1)
    logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    echo: bool = False
    best_of: int | None = Field(None, ge=1)
    suffix: str | None = None

    def check_unsupported(self) -> None:
        super().check_unsupported()
        if self.best_of is not None and self.best_of != self.n:
            raise OpenAIError(f"best_of={self.best_of} is not supported; leave it unset or equal to n",
                              param="best_of", code="unsupported_parameter")
        if self.suffix:
            raise OpenAIError("suffix is not supported by this server", param="suffix", code="unsupported_parameter")

    def prompts(self) -> list[str | list[int]]:
        """The prompts as a list: one string, strings, one token list, or token lists."""
        p = self.prompt
        if isinstance(p, str):
            return [p]
        if not p:
            raise OpenAIError("prompt must not be empty", param="prompt")
        if isinstance(p[0], int):
            return [list(p)]
        return list(p)


class TextPart(_Body):
    type: Literal["text"]
    text: str


class FunctionCall(_Body):
    name: str
    arguments: str


class ToolCallMessage(_Body):
    id: str | None = None
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(_Body):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCallMessage] | None = None
    tool_call_id: str | None = None

    def as_template_message(self, index: int = 0) -> dict:
        """The message as a chat template reads it; `index` (its place in `messages`) names a bad field."""
        content = self.content if isinstance(self.content, str) or self.content is None else \
            "".join(part.text for part in self.content)
        role = "system" if self.role == "developer" else self.role
        message = {"role": role, "content": content or ""}
        if self.name:
            message["name"] = self.name
        if self.tool_call_id:
            message["tool_call_id"] = self.tool_call_id
        if self.tool_calls:
            # Templates iterate over the arguments as a mapping (as transformers' own examples pass them).
            message["tool_calls"] = [{"id": c.id, "type": "function", "function": {
                "name": c.function.name,
                "arguments": _json_or_text(c.function.arguments, f"messages.{index}.tool_calls.{j}.function.arguments"),
            }} for j, c in enumerate(self.tool_calls)]
        return message


def _json_or_text(text: str, param: str):
    """Tool call arguments as JSON when they are JSON (as vLLM hands them to templates), else the text itself;
    nested too deeply to hand on safely, a 400 naming the field."""
    try:
        return client_json.loads(text, param)
    except client_json.TooDeepError as e:
        raise OpenAIError(str(e), param=param) from None
    except ValueError:
        return text


def _structured(spec: dict, param: str, what: str = "") -> StructuredOutputsParams:
    """The constraint one field sets, checked (limits, then the grammar worker); errors name the field."""
    try:
        return StructuredOutputsParams(**spec)
    except GrammarBusyError as e:
        raise OpenAIError(str(e), status=429, type="server_overloaded", param=param, code="grammar_busy") from e
    except (TypeError, ValueError) as e:
        raise OpenAIError(f"{param}: {what}{e}", param=param) from e


class FunctionDefinition(_Body):
    name: str = Field(pattern=r"^[a-zA-Z0-9_-]{1,64}$")
    description: str | None = None
    parameters: dict | None = None
    strict: bool | None = None

    @field_validator("parameters")
    @classmethod
    def _an_object(cls, v: dict | None) -> dict | None:
        """A call's arguments are a JSON object (as OpenAI requires of the schema): a schema of another type made
        calls whose arguments were a bare string or number."""
        if v is not None and "type" in v and v["type"] != "object":
            raise ValueError(f'must be a JSON schema of type "object", got type {str(v["type"])[:40]!r}')
        return v


class Tool(_Body):
    type: Literal["function"]
    function: FunctionDefinition

    def as_template_tool(self) -> dict:
        return {"type": "function", "function": self.function.model_dump(exclude_none=True)}


class NamedFunction(_Body):
    name: str


class NamedToolChoice(_Body):
    type: Literal["function"]
    function: NamedFunction


class _ChatTemplateOptions(_Body):
    """vLLM's chat template options, on a body with `messages` and `add_generation_prompt`."""

    continue_final_message: bool = False  # the last message (the assistant's) is continued, not closed
    chat_template_kwargs: dict | None = None  # more variables for the template, e.g. {"enable_thinking": false}
    chat_template: str | None = None  # vLLM's per-request template: refused (a client's Jinja would run here)

    @field_validator("chat_template_kwargs")
    @classmethod
    def _not_too_deep(cls, v):
        if v is not None and client_json.depth(v, client_json.MAX_DEPTH) > client_json.MAX_DEPTH:
            raise ValueError(f"is nested more than {client_json.MAX_DEPTH} levels deep")
        return v

    def check_template_options(self) -> None:
        if self.chat_template is not None:
            raise OpenAIError("chat_template in a request is not accepted: a client's template would run on the "
                              "server (vLLM refuses it too unless told to trust it); start the server with "
                              "--chat-template", param="chat_template", code="unsupported_parameter")
        if self.messages is None:
            return
        last = self.messages[-1].role
        try:
            check_template_options("system" if last == "developer" else last, self.add_generation_prompt,
                                   self.continue_final_message, self.chat_template_kwargs)
        except TemplateOptionError as e:
            raise OpenAIError(str(e), param=e.param) from None


class ChatCompletionRequest(_ChatTemplateOptions, _SamplingRequest):
    """POST /v1/chat/completions."""

    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    tools: list[Tool] | None = Field(None, max_length=128)
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    add_generation_prompt: bool = True

    def check_unsupported(self) -> None:
        super().check_unsupported()
        self.check_template_options()
        if self.tool_choice not in (None, "none") and not self.tools:
            raise OpenAIError("tool_choice needs tools: there is no function to call", param="tool_choice")
        names = [t.function.name for t in self.tools or []]
        if len(set(names)) != len(names):
            raise OpenAIError("tools must have distinct function names", param="tools")
        if isinstance(self.tool_choice, NamedToolChoice) and self.tool_choice.function.name not in names:
            raise OpenAIError(f"tool_choice names function {self.tool_choice.function.name!r}, which is not in "
                              f"tools ({', '.join(names)})", param="tool_choice")
        if self.top_logprobs and not self.logprobs:
            raise OpenAIError("top_logprobs needs logprobs=true", param="top_logprobs")

    @property
    def tool_mode(self) -> str:
        """"none", "auto", "required" or "named" (the default: "auto" with tools, "none" without)."""
        if not self.tools or self.tool_choice == "none":
            return "none"
        if isinstance(self.tool_choice, NamedToolChoice):
            return "named"
        return self.tool_choice or "auto"

    @property
    def sets_structured_output(self) -> bool:
        return super().sets_structured_output or self.tool_mode in ("required", "named")

    def template_tools(self) -> list[dict] | None:
        return [t.as_template_tool() for t in self.tools] if self.tools else None

    def structured_output_request(self) -> tuple[StructuredOutputsParams | None, str | None]:
        """tool_choice "required" or a named function constrains the output to valid calls of the tools."""
        from jaxpaged.entrypoints.openai.tool_parsers import parameters_schema, required_schema

        structured, param = super().structured_output_request()
        mode = self.tool_mode
        if mode not in ("required", "named"):
            return structured, param
        if structured is not None:
            raise OpenAIError(f"tool_choice={mode!r} already constrains the output; {param} cannot be set with it",
                              param=param)
        tools = [t.as_template_tool() for t in self.tools]
        if mode == "named":
            chosen = next(t for t in tools if t["function"]["name"] == self.tool_choice.function.name)
            schema = parameters_schema(chosen["function"])
        else:
            schema = required_schema(tools)
        return _structured({"json": schema}, "tools", "a function's parameters are not a valid JSON schema: "), "tools"

    @property
    def requested_max_tokens(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    @property
    def engine_logprobs(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None


class TokenizeRequest(_ChatTemplateOptions):
    """POST /tokenize, vLLM's shape: a `prompt` string, or chat `messages` rendered by the chat template."""

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = Field(None, min_length=1)
    add_generation_prompt: bool = True
    add_special_tokens: bool | None = None  # vLLM's defaults: true for a prompt; chat templates add their own
    return_token_strs: bool = False

    def check_unsupported(self) -> None:
        if (self.prompt is None) == (self.messages is None):
            raise OpenAIError("send either 'prompt' (a string) or 'messages' (a chat), not both or neither",
                              param="prompt" if self.prompt is None else "messages")
        if self.messages is not None and self.add_special_tokens:
            raise OpenAIError("add_special_tokens=true is not supported with messages: the chat template places "
                              "the special tokens", param="add_special_tokens", code="unsupported_parameter")
        self.check_template_options()


class DetokenizeRequest(_Body):
    """POST /detokenize: token ids back to text."""

    model: str | None = None
    tokens: list[int]


def parse_body(model: type[_B], raw: bytes) -> _B:
    """Validates a JSON body; every failure is an OpenAIError (400) naming the field."""
    if not raw.strip():
        raise OpenAIError("the request body is empty; send a JSON object")
    try:
        body = model.model_validate_json(raw)
    except ValidationError as e:
        raise _validation_error(e, raw) from None
    body.check_unsupported()
    return body


def _validation_error(e: ValidationError, raw: bytes = b"") -> OpenAIError:
    err = e.errors(include_url=False)[0]
    if err["type"] == "json_invalid":
        if "surrogate" in err["msg"] or "hex escape" in err["msg"]:
            return _lone_surrogate_error(raw, err["msg"])
        return OpenAIError(f"the request body is not valid JSON: {err['msg']}")
    if err["type"] == "model_type" and not err["loc"]:
        return OpenAIError("the request body must be a JSON object")
    # Union members appear in loc as their type names ("str", "list[int]"); the field path is what users need.
    loc = [str(x) for x in err["loc"] if isinstance(x, int) or ("[" not in str(x) and str(x) not in _TYPE_NAMES)]
    param = ".".join(loc) or None
    if err["type"] == "missing":
        return OpenAIError(f"'{param}' is a required property", param=param)
    if err["type"] == "model_type":  # a field that must be an object, e.g. "stream_options": 5
        return OpenAIError(f"'{param}' must be a JSON object", param=param)
    union = sum(1 for x in e.errors(include_url=False) if x["loc"][:1] == err["loc"][:1]) > 1
    message = f"invalid type for '{param}'" if union else f"'{param}': {err['msg']}"
    return OpenAIError(message, param=param)


def _lone_surrogate_error(raw: bytes, msg: str) -> OpenAIError:
    """A \\uD800-\\uDFFF escape that is not half of a surrogate pair: not a character, so not text a tokenizer takes.
    Python's json module accepts it; the first string holding one names the field."""
    message = ("the request body is not valid JSON: a \\uD800-\\uDFFF escape must be half of a surrogate pair "
               f"(a lone surrogate is not a character): {msg}")
    try:
        doc = json.loads(raw)
    except (ValueError, RecursionError):
        return OpenAIError(message)
    stack: list[tuple[list[str], object]] = [([], doc)]
    while stack:
        path, node = stack.pop()
        items = node.items() if isinstance(node, dict) else enumerate(node) if isinstance(node, list) else ()
        for key, value in reversed(list(items)):
            if isinstance(key, str) and any(0xD800 <= ord(c) <= 0xDFFF for c in key):
                return OpenAIError(message, param=".".join(path) or None)
            stack.append((path + [str(key)], value))
        if isinstance(node, str) and any(0xD800 <= ord(c) <= 0xDFFF for c in node):
            return OpenAIError(message, param=".".join(path) or None)
    return OpenAIError(message)


_TYPE_NAMES = {"str", "int", "float", "bool", "dict", "list", "none", "literal", "TextPart", "ChatMessage",
               "NamedToolChoice", "Tool", "ToolCallMessage"}

__all__ = ["ChatCompletionRequest", "ChatMessage", "CompletionRequest", "DetokenizeRequest", "OpenAIError",
           "TokenizeRequest", "error_body", "parse_body"]
