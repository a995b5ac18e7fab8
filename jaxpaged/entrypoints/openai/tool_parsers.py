"""Tool calls in a chat model's output text, as vLLM's `--tool-call-parser` names them, and the JSON schemas that
make `tool_choice` "required" / a named function a structured-output constraint (so the call is always valid).

    hermes   <tool_call>{"name": ..., "arguments": {...}}</tool_call> blocks (Qwen 2.5+, Hermes, many others);
             the text outside them is the message content
    llama3_json  the whole output is {"name": ..., "parameters": {...}} (or several joined by ";"), optionally
             after <|python_tag|>
"""

from __future__ import annotations

import dataclasses
import json
import re
import uuid


@dataclasses.dataclass
class ToolCall:
    name: str
    arguments: str  # JSON text

    def as_openai(self, index: int | None = None) -> dict:
        call = {"id": f"chatcmpl-tool-{uuid.uuid4().hex[:24]}", "type": "function",
                "function": {"name": self.name, "arguments": self.arguments}}
        return call if index is None else {"index": index, **call}


def _call(obj, args_keys: tuple[str, ...]) -> ToolCall | None:
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    args = next((obj[k] for k in args_keys if k in obj), {})
    return ToolCall(obj["name"], args if isinstance(args, str) else json.dumps(args, ensure_ascii=False))


class HermesToolParser:
    _BLOCK = re.compile(r"<tool_call>(.*?)(?:</tool_call>|$)", re.DOTALL)

    def extract(self, text: str) -> tuple[str | None, list[ToolCall]]:
        """(content, calls); the text is content alone when a block does not parse."""
        if "<tool_call>" not in text:
            return text, []
        calls = []
        for m in self._BLOCK.finditer(text):
            try:
                call = _call(json.loads(m.group(1).strip()), ("arguments", "parameters"))
            except (ValueError, RecursionError):  # RecursionError: a model's output nested thousands deep
                return text, []
            if call is None:
                return text, []
            calls.append(call)
        content = self._BLOCK.sub("", text).strip()
        return content or None, calls


class Llama3JsonToolParser:
    def extract(self, text: str) -> tuple[str | None, list[ToolCall]]:
        body = text.strip().removeprefix("<|python_tag|>").strip()
        if not body.startswith("{"):
            return text, []
        calls = []
        decoder = json.JSONDecoder()
        pos = 0
        while pos < len(body):
            try:
                obj, end = decoder.raw_decode(body, pos)
                call = _call(obj, ("parameters", "arguments"))
            except (ValueError, RecursionError):
                return text, []
            if call is None:
                return text, []
            calls.append(call)
            pos = end
            while pos < len(body) and body[pos] in " \n\t;":
                pos += 1
        return None, calls


TOOL_PARSERS = {"hermes": HermesToolParser, "llama3_json": Llama3JsonToolParser}


def tool_parser(name: str | None):
    if name is None:
        return None
    if name not in TOOL_PARSERS:
        raise ValueError(f"tool_call_parser={name!r}; choose one of {', '.join(TOOL_PARSERS)}")
    return TOOL_PARSERS[name]()


def parameters_schema(function: dict) -> dict:
    return function.get("parameters") or {"type": "object", "properties": {}}


_DATA_KEYWORDS = frozenset({"const", "enum", "default", "examples"})  # their values are data, not schemas


def _rebased(schema, base: str):
    """The schema with each local `$ref` ("#" and a JSON pointer into the schema) pointing into `base`, the place the
    schema now has in a larger one."""
    if isinstance(schema, dict):
        return {k: (base + v[1:] if k == "$ref" and isinstance(v, str) and v.startswith("#")
                    else v if k in _DATA_KEYWORDS else _rebased(v, base)) for k, v in schema.items()}
    if isinstance(schema, list):
        return [_rebased(v, base) for v in schema]
    return schema


def required_schema(tools: list[dict]) -> dict:
    """tool_choice "required": a non-empty JSON array of {"name", "parameters"} calls of the given functions. Each
    function's parameters schema sits in the array schema's `$defs` (tool0, tool1, ...) with its local references
    rebased there, so "#/$defs/City", as pydantic writes it, still means the function's own."""
    defs = {f"tool{i}": _rebased(parameters_schema(t["function"]), f"#/$defs/tool{i}") for i, t in enumerate(tools)}
    return {"type": "array", "minItems": 1, "$defs": defs, "items": {"anyOf": [
        {"type": "object", "properties": {"name": {"const": t["function"]["name"]},
                                          "parameters": {"$ref": f"#/$defs/tool{i}"}},
         "required": ["name", "parameters"], "additionalProperties": False} for i, t in enumerate(tools)]}}


def calls_from_required(text: str) -> list[ToolCall]:
    """The calls of a "required" output (a JSON array, valid by construction); ValueError if it is cut short."""
    try:
        return [ToolCall(c["name"], json.dumps(c["parameters"], ensure_ascii=False)) for c in json.loads(text)]
    except RecursionError:  # a function without parameters schema lets the model nest as deep as max_tokens
        raise ValueError("the tool calls are nested too deeply to parse") from None
