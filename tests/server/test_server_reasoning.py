"""A thinking model behind `server.py --reasoning-parser deepseek_r1` (a tiny random model whose vocabulary has
<think> and </think> as tokens): a structured output or a named tool's arguments are constrained after </think>
only, so the reasoning comes back in `reasoning_content` and the content (or the call) fits the schema, whole and
streamed, as vLLM answers."""

from __future__ import annotations

import json
from pathlib import Path

import jsonschema
import pytest

from tests.server.harness import MODEL, Server, assert_idle
from tests.tiny_hf import EOS_ID, TINY_VOCAB, make_tiny_thinking_model

pytestmark = pytest.mark.slow  # starts processes or loads a real model: docs/testing.md

END = TINY_VOCAB + 1  # </think> in make_tiny_thinking_model's tokenizer
SCHEMA = {"type": "object", "properties": {"answer": {"type": "integer", "minimum": 0, "maximum": 99}},
          "required": ["answer"], "additionalProperties": False}
# </think> made likely so the random model's reasoning ends within a few dozen tokens; EOS held back meanwhile
BIAS = {str(END): 14.0, str(EOS_ID): -100.0}
MESSAGES = [{"role": "user", "content": "What is the answer?"}]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    model_dir = Path(make_tiny_thinking_model(tmp_path_factory.mktemp("thinking")))
    srv = Server(model_dir, tmp_path_factory.mktemp("logs") / "server.log", "--max-model-len", "512",
                 "--reasoning-parser", "deepseek_r1")
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def client(server):
    return server.client()


def test_json_schema_constrains_the_content_after_the_reasoning(server, client):
    rf = {"type": "json_schema", "json_schema": {"name": "answer", "schema": SCHEMA}}
    chat = client.chat.completions.create(model=MODEL, messages=MESSAGES, n=3, temperature=1.0, seed=3,
                                          max_tokens=200, response_format=rf, logit_bias=BIAS)
    for c in chat.choices:
        reasoning = c.message.model_extra["reasoning_content"]
        assert reasoning and not reasoning.lstrip().startswith("{"), c  # sampled freely, not the schema's
        jsonschema.validate(json.loads(c.message.content), SCHEMA)
        assert c.finish_reason == "stop", c
    assert_idle(server.url)


def test_a_named_tool_s_arguments_stream_after_the_reasoning(server, client):
    tools = [{"type": "function", "function": {"name": "give_answer", "parameters": SCHEMA}}]
    stream = client.chat.completions.create(model=MODEL, messages=MESSAGES, temperature=1.0, seed=5, max_tokens=200,
                                            tools=tools, logit_bias=BIAS, stream=True,
                                            tool_choice={"type": "function", "function": {"name": "give_answer"}})
    reasoning, arguments, names, order, finish = [], [], [], [], None
    for chunk in stream:
        for c in chunk.choices:
            delta = c.delta
            if (delta.model_extra or {}).get("reasoning_content"):
                reasoning.append(delta.model_extra["reasoning_content"])
                order.append("reasoning")
            for call in delta.tool_calls or []:
                names.append(call.function.name)
                arguments.append(call.function.arguments or "")
                order.append("call")
            finish = c.finish_reason or finish
    assert "".join(reasoning) and "</think>" not in "".join(reasoning)
    assert order == sorted(order, key=lambda kind: kind == "call")  # the reasoning, then the call
    assert names[0] == "give_answer" and not any(names[1:])  # the id and name once, then arguments
    jsonschema.validate(json.loads("".join(arguments)), SCHEMA)
    assert finish == "stop"
    assert_idle(server.url)
