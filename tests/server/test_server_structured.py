"""Structured output, sampling controls and tool calling through the official `openai` client against a real
`server.py` process on a tiny random-weight model: the grammar mask makes even a random model's output valid."""

from __future__ import annotations

import json
import re
from pathlib import Path

import jsonschema
import openai
import pytest

from tests.server.harness import MODEL, Server, assert_idle, post
from tests.tiny_hf import make_tiny_hf_model

pytestmark = pytest.mark.slow  # starts processes or loads a real model: docs/testing.md

SCHEMA = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 8},
        "unit": {"enum": ["celsius", "fahrenheit"]},
        "days": {"type": "array", "items": {"type": "integer", "minimum": 1, "maximum": 7}, "maxItems": 3},
        "where": {"type": "object", "properties": {"lat": {"type": "integer", "minimum": -90, "maximum": 90}},
                  "required": ["lat"], "additionalProperties": False},
    },
    "required": ["city", "unit", "days", "where"],
    "additionalProperties": False,
}
TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "description": "Weather in a city",
                                      "parameters": SCHEMA}},
    {"type": "function", "function": {"name": "get_time", "parameters": {
        "type": "object", "properties": {"tz": {"enum": ["UTC", "CET"]}}, "required": ["tz"],
        "additionalProperties": False}}},
]
MESSAGES = [{"role": "user", "content": "What is the weather in Paris?"}]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    model_dir = Path(make_tiny_hf_model(tmp_path_factory.mktemp("tiny_model"), "llama"))
    srv = Server(model_dir, tmp_path_factory.mktemp("logs") / "server.log", "--max-model-len", "512",
                 "--tool-call-parser", "hermes")
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def client(server):
    return server.client()


def test_response_format_json_schema_on_chat_and_completions(client):
    rf = {"type": "json_schema", "json_schema": {"name": "weather", "schema": SCHEMA}}
    chat = client.chat.completions.create(model=MODEL, messages=MESSAGES, n=4, temperature=1.0, seed=1,
                                          max_tokens=200, response_format=rf)
    for c in chat.choices:
        assert c.finish_reason == "stop"
        jsonschema.validate(json.loads(c.message.content), SCHEMA)
    cmpl = client.completions.create(model=MODEL, prompt="Weather:", n=4, temperature=1.0, seed=2, max_tokens=200,
                                     extra_body={"response_format": rf})
    for c in cmpl.choices:
        jsonschema.validate(json.loads(c.text), SCHEMA)


def test_json_object_guided_and_structured_outputs_fields(client):
    chat = client.chat.completions.create(model=MODEL, messages=MESSAGES, temperature=1.0, seed=3, max_tokens=300,
                                          response_format={"type": "json_object"})
    if chat.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(chat.choices[0].message.content), dict)
    regex = r"[0-9]{3}-[a-z]{2,4}"
    out = client.completions.create(model=MODEL, prompt="id:", n=3, temperature=1.0, seed=4, max_tokens=30,
                                    extra_body={"guided_regex": regex})
    assert all(re.fullmatch(regex, c.text) for c in out.choices)
    choices = ["yes", "no", "not sure"]
    out = client.completions.create(model=MODEL, prompt="ok?", n=5, temperature=1.0, seed=5, max_tokens=10,
                                    extra_body={"guided_choice": choices})
    assert all(c.text in choices for c in out.choices)
    out = client.completions.create(model=MODEL, prompt="ok?", n=3, temperature=1.0, seed=6, max_tokens=10,
                                    extra_body={"structured_outputs": {"choice": choices}})
    assert all(c.text in choices for c in out.choices)
    out = client.completions.create(model=MODEL, prompt="x", n=2, temperature=1.0, seed=7, max_tokens=120,
                                    extra_body={"guided_json": SCHEMA})
    for c in out.choices:
        jsonschema.validate(json.loads(c.text), SCHEMA)


@pytest.mark.parametrize("extra, param", [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nope"}}}},
     "response_format"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}}, "response_format"),
    ({"response_format": {"type": "xml"}}, "response_format.type"),
    ({"guided_regex": "[a-"}, "guided_regex"),
    ({"guided_choice": []}, "guided_choice"),
    ({"guided_grammar": "start: ???"}, "guided_grammar"),
    ({"guided_json": {"$ref": "#/missing"}}, "guided_json"),
    ({"guided_regex": "a", "guided_choice": ["a"]}, "guided_choice"),
    ({"structured_outputs": {"regex": 5}}, "structured_outputs"),
    ({"presence_penalty": 3.0}, "presence_penalty"),
    ({"frequency_penalty": -2.5}, "frequency_penalty"),
    ({"repetition_penalty": 0}, "repetition_penalty"),
    ({"logit_bias": {"abc": 1}}, "logit_bias"),
    ({"logit_bias": {"5": 500}}, "logit_bias"),
    ({"logit_bias": {"99999999": 1}}, "logit_bias"),
    ({"bad_words": [""]}, "bad_words"),
    ({"allowed_token_ids": []}, "allowed_token_ids"),
    ({"allowed_token_ids": [99999999]}, "allowed_token_ids"),
    ({"allowed_token_ids": ["5"]}, "allowed_token_ids.0"),
    ({"priority": 1}, "priority"),  # this server schedules fcfs
    ({"priority": 1.5}, "priority"),
    ({"prompt_logprobs": 1, "stream": True}, "prompt_logprobs"),  # not streamed (vLLM's rule)
    ({"prompt_logprobs": 21}, "prompt_logprobs"),
    ({"prompt_logprobs": -1}, "prompt_logprobs"),  # vLLM's "the whole vocabulary": at most 20 here
    ({"prompt_logprobs": True}, "prompt_logprobs"),
])
def test_bad_structured_and_sampling_fields_are_400_naming_the_field(server, extra, param):
    for path, body in (("/v1/completions", {"prompt": "hi"}), ("/v1/chat/completions", {"messages": MESSAGES})):
        status, out = post(f"{server.url}{path}", {"model": MODEL, "max_tokens": 5, **body, **extra})
        assert status == 400, out
        assert out["error"]["param"] == param, out
    assert_idle(server.url)


def test_sampling_controls_over_http(client, server):
    tok_id = 77
    out = client.completions.create(model=MODEL, prompt="hi", max_tokens=8, temperature=1.0, seed=0,
                                    logit_bias={str(tok_id): 100}, extra_body={"ignore_eos": True})
    status, raw = post(f"{server.url}/v1/completions", {"model": MODEL, "prompt": "hi", "max_tokens": 8,
                                                         "logit_bias": {str(tok_id): 100}, "ignore_eos": True,
                                                         "logprobs": 0})
    assert status == 200 and out.choices[0].text == raw["choices"][0]["text"]
    assert len(set(raw["choices"][0]["logprobs"]["tokens"])) == 1
    kwargs = dict(model=MODEL, prompt="The lighthouse keeper", max_tokens=24, temperature=0.0)
    free = client.completions.create(**kwargs).choices[0].text
    penalized = [client.completions.create(**kwargs, presence_penalty=1.5, frequency_penalty=1.0,
                                           extra_body={"repetition_penalty": 1.5}).choices[0].text for _ in range(2)]
    assert penalized[0] == penalized[1] != free
    stop = client.completions.create(**kwargs, stop=["(.*", "[a-z]+"]).choices[0]
    assert stop.text == free and stop.finish_reason == "length"


def test_allowed_token_ids_over_http(server):
    """vLLM's allowed_token_ids: every generated token is one of them; with a grammar that allows none of them, the
    request is a 400 in the grammar's words (the request's own fault), not a server error."""
    allowed = list(range(60, 70))
    status, raw = post(f"{server.url}/v1/completions", {"model": MODEL, "prompt": "hi", "max_tokens": 8,
                                                         "temperature": 1.0, "seed": 3, "ignore_eos": True,
                                                         "logprobs": 3, "allowed_token_ids": allowed})
    assert status == 200, raw
    texts = set()
    for t in allowed:
        status, one = post(f"{server.url}/detokenize", {"tokens": [t]})
        texts.add(one["prompt"])
    chosen = raw["choices"][0]["logprobs"]["tokens"]
    assert len(chosen) == 8 and set(chosen) <= texts, (chosen, texts)
    status, out = post(f"{server.url}/v1/chat/completions", {"model": MODEL, "messages": MESSAGES, "max_tokens": 4,
                                                             "allowed_token_ids": allowed, "guided_regex": "[0-9]+"})
    assert status == 400 and out["error"]["code"] == "grammar_failed" and "no token" in out["error"]["message"], out


def test_named_tool_choice_gives_a_valid_call_and_streams_the_same(client):
    choice = {"type": "function", "function": {"name": "get_weather"}}
    kwargs = dict(model=MODEL, messages=MESSAGES, tools=TOOLS, tool_choice=choice, temperature=1.0, seed=11,
                  max_tokens=200)
    out = client.chat.completions.create(**kwargs)
    msg = out.choices[0].message
    (call,) = msg.tool_calls
    assert call.type == "function" and call.function.name == "get_weather" and call.id
    jsonschema.validate(json.loads(call.function.arguments), SCHEMA)
    name, args, ids = None, "", set()
    for chunk in client.chat.completions.create(**kwargs, stream=True):
        for c in chunk.choices:
            for tc in c.delta.tool_calls or []:
                assert tc.index == 0
                ids |= {tc.id} if tc.id else set()
                name = tc.function.name or name
                args += tc.function.arguments or ""
    assert name == "get_weather" and len(ids) == 1
    assert args == call.function.arguments


def test_required_tool_choice_calls_one_of_the_tools(client):
    out = client.chat.completions.create(model=MODEL, messages=MESSAGES, tools=TOOLS, tool_choice="required",
                                         temperature=1.0, seed=12, max_tokens=300, n=3)
    schemas = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
    for c in out.choices:
        if c.finish_reason == "length":
            continue
        assert c.finish_reason == "tool_calls" and c.message.tool_calls
        for call in c.message.tool_calls:
            jsonschema.validate(json.loads(call.function.arguments), schemas[call.function.name])
    streamed = client.chat.completions.create(model=MODEL, messages=MESSAGES, tools=TOOLS, tool_choice="required",
                                              temperature=1.0, seed=12, max_tokens=300, n=3, stream=True)
    calls: dict[int, list] = {}
    for chunk in streamed:
        for c in chunk.choices:
            for tc in c.delta.tool_calls or []:
                calls.setdefault(c.index, []).append((tc.function.name, tc.function.arguments))
    for c in out.choices:
        if c.finish_reason == "tool_calls":
            assert calls[c.index] == [(t.function.name, t.function.arguments) for t in c.message.tool_calls]


def test_tool_choice_none_and_auto_give_plain_content(client):
    for choice in ("none", "auto"):
        out = client.chat.completions.create(model=MODEL, messages=MESSAGES, tools=TOOLS, tool_choice=choice,
                                             temperature=0.0, max_tokens=10)
        assert out.choices[0].message.tool_calls is None and isinstance(out.choices[0].message.content, str)
    plain = client.chat.completions.create(model=MODEL, messages=MESSAGES, temperature=0.0, max_tokens=10)
    assert out.choices[0].message.content == plain.choices[0].message.content  # the tiny template ignores tools


@pytest.mark.parametrize("extra, param", [
    ({"tools": [{"type": "function", "function": {"description": "no name"}}]}, "tools.0.function.name"),
    ({"tools": [{"type": "fn", "function": {"name": "f"}}]}, "tools.0.type"),
    ({"tools": [{"type": "function", "function": {"name": "bad name!"}}]}, "tools.0.function.name"),
    ({"tools": TOOLS + [{"type": "function", "function": {"name": "s", "parameters": {"type": "string"}}}]},
     "tools.2.function.parameters"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "nope"}}}],
      "tool_choice": "required"}, "tools.0.function.parameters"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {
        "x": {"type": "nope"}}}}}], "tool_choice": "required"}, "tools"),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
    ({"tools": TOOLS, "tool_choice": "sometimes"}, "tool_choice"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"tools": TOOLS + TOOLS[:1]}, "tools"),
    ({"tools": TOOLS, "tool_choice": "required", "response_format": {"type": "json_object"}}, "response_format"),
])
def test_bad_tools_are_400_naming_the_field(server, extra, param):
    status, out = post(f"{server.url}/v1/chat/completions", {"model": MODEL, "messages": MESSAGES, **extra})
    assert status == 400, out
    assert out["error"]["param"] == param, out


def test_bad_tools_through_the_client_raise_bad_request(client):
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(model=MODEL, messages=MESSAGES, tools=TOOLS,
                                       tool_choice={"type": "function", "function": {"name": "missing"}})


def test_tool_call_parsers():
    from jaxpaged.entrypoints.openai.tool_parsers import HermesToolParser, Llama3JsonToolParser

    text = 'Let me look.<tool_call>\n{"name": "get_time", "arguments": {"tz": "UTC"}}\n</tool_call>'
    content, calls = HermesToolParser().extract(text)
    assert content == "Let me look." and [(c.name, json.loads(c.arguments)) for c in calls] == [
        ("get_time", {"tz": "UTC"})]
    assert HermesToolParser().extract("<tool_call>{not json</tool_call>") == ("<tool_call>{not json</tool_call>", [])
    content, calls = Llama3JsonToolParser().extract(
        '<|python_tag|>{"name": "a", "parameters": {"x": 1}}; {"name": "b", "parameters": {}}')
    assert content is None and [(c.name, json.loads(c.arguments)) for c in calls] == [("a", {"x": 1}), ("b", {})]
    assert Llama3JsonToolParser().extract("hello") == ("hello", [])


def _tool_with_defs(name: str, city: dict) -> dict:
    """A function whose parameters use `$defs` and local references, as pydantic's model_json_schema() writes them."""
    return {"type": "function", "function": {"name": name, "parameters": {
        "$defs": {"City": city}, "type": "object", "additionalProperties": False, "required": ["city"],
        "properties": {"city": {"$ref": "#/$defs/City"}, "next": {"$ref": "#"},
                       "note": {"const": {"$ref": "#/not/a/reference"}}}}}}


DEFS_TOOLS = [_tool_with_defs("by_name", {"type": "object", "required": ["name"], "additionalProperties": False,
                                          "properties": {"name": {"type": "string", "maxLength": 12}}}),
              _tool_with_defs("by_zip", {"type": "object", "required": ["zip"], "additionalProperties": False,
                                         "properties": {"zip": {"type": "integer"}}})]


def test_required_tool_choice_keeps_each_functions_own_references():
    """tool_choice "required" nests every function's parameters in one array schema: a function's "#/$defs/City"
    must still mean its own City (two functions here have different ones), "#" its own root, and a `const` holding
    a "$ref" key stays data. It was resolved against the array schema: a 400 for pydantic-style parameters."""
    from jaxpaged.engine.structured_output import grammar
    from jaxpaged.entrypoints.openai.tool_parsers import required_schema

    schema = required_schema(DEFS_TOOLS)
    jsonschema.Draft202012Validator.check_schema(schema)
    valid = jsonschema.Draft202012Validator(schema).is_valid
    call = {"name": "by_name", "parameters": {"city": {"name": "Paris"}, "next": {"city": {"name": "Lyon"}}}}
    assert valid([call]) and valid([{"name": "by_zip", "parameters": {"city": {"zip": 75001}}}])
    assert not valid([{"name": "by_name", "parameters": {"city": {"zip": 75001}}}])
    assert not valid([{"name": "by_zip", "parameters": {"city": {"zip": 1}, "next": {"city": {"name": "x"}}}}])
    assert schema["$defs"]["tool0"]["properties"]["note"] == {"const": {"$ref": "#/not/a/reference"}}
    grammar("json", json.dumps(schema))  # llguidance resolves them too


def test_required_tool_choice_with_defs_gives_calls_valid_for_their_own_function(client):
    out = client.chat.completions.create(model=MODEL, messages=MESSAGES, tools=DEFS_TOOLS, tool_choice="required",
                                         temperature=1.0, seed=3, max_tokens=300, n=2)
    schemas = {t["function"]["name"]: t["function"]["parameters"] for t in DEFS_TOOLS}
    calls = [call for c in out.choices if c.finish_reason == "tool_calls" for call in c.message.tool_calls]
    assert calls, [c.finish_reason for c in out.choices]
    for call in calls:
        jsonschema.validate(json.loads(call.function.arguments), schemas[call.function.name])
