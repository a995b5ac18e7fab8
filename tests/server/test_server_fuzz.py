"""Fuzzing the request schema against a real `server.py` process (issue #28): hypothesis draws completions, chat and
/tokenize bodies over every field (plausible values, wrong types, nested JSON, deep JSON inside string fields,
grammar specs of growing size: $defs chains, nested schemas, long Lark rule chains, large regexes) and sends them
to the tiny random-weight model on 127.0.0.1. Whatever the body: no 5xx, every 4xx is OpenAI's error shape, the
process lives, /health (polled from another process the whole time) answers within 0.5 s, and when the requests
are done every KV block is free."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.server.harness import MODEL, Server, get, request, wait_for
from tests.tiny_hf import make_tiny_hf_model

pytestmark = pytest.mark.slow  # starts processes or loads a real model: docs/testing.md

HEALTH_BOUND_S = 0.5
MAX_BODY = 1_000_000
EXAMPLES = 150


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    model_dir = Path(make_tiny_hf_model(tmp_path_factory.mktemp("tiny_model"), "llama"))
    srv = Server(model_dir, tmp_path_factory.mktemp("logs") / "fuzz.log", "--max-body-bytes", str(MAX_BODY),
                 "--write-timeout", "5", "--tool-call-parser", "hermes")
    yield srv
    srv.stop()


POLLER = textwrap.dedent("""
    import json, select, sys, time, urllib.request
    url, worst = sys.argv[1], []
    while not select.select([sys.stdin], [], [], 0.02)[0]:
        t0 = time.monotonic()
        try:
            with urllib.request.urlopen(url, timeout=30) as r:
                ok = r.status == 200
        except OSError:
            ok = False
        worst.append((time.monotonic() - t0, ok))
    print(json.dumps({"n": len(worst), "max_s": max(w[0] for w in worst), "failed": sum(not w[1] for w in worst)}))
""")


def start_health_poller(server: Server) -> subprocess.Popen:
    """/health polled every 20 ms from another process (this one is busy drawing examples)."""
    return subprocess.Popen([sys.executable, "-c", POLLER, f"{server.url}/health"], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, text=True)


def stop_health_poller(proc: subprocess.Popen) -> dict:
    out, _ = proc.communicate("stop\n", timeout=60)
    return json.loads(out)


# ---- strategies ---------------------------------------------------------------------------------------------------

scalars = st.none() | st.booleans() | st.integers(-2**70, 2**70) | st.floats(allow_nan=False) | st.text(max_size=20)
json_values = st.recursive(scalars, lambda inner: st.lists(inner, max_size=4) |
                           st.dictionaries(st.text(max_size=8), inner, max_size=4), max_leaves=12)
depths = st.integers(1, 400) | st.sampled_from([63, 64, 65, 129, 200, 255, 256, 300])


def deep_text(depth: int, opener: str = "[") -> str:
    closer = {"[": "]", "{": "}"}[opener]
    if opener == "{":
        return '{"a":' * depth + "1" + "}" * depth
    return opener * depth + closer * depth


deep_json_text = st.builds(deep_text, depths, st.sampled_from(["[", "{"]))


def defs_chain(n: int, objects: bool) -> dict:
    def link(nxt: str) -> dict:
        return {"type": "object", "properties": {"a": {"$ref": nxt}}} if objects else {"$ref": nxt}

    defs = {f"d{i}": link(f"#/$defs/d{i + 1}") for i in range(n)}
    defs[f"d{n}"] = {"type": "string"}
    return {"$ref": "#/$defs/d0", "$defs": defs}


def nested_schema(n: int, keyword: str) -> dict:
    schema: dict = {"type": "integer"}
    for _ in range(n):
        schema = {"type": "object", "properties": {"a": schema}} if keyword == "properties" else \
            {keyword: [schema, {"type": "string"}]}
    return schema


def lark_chain(n: int) -> str:
    return "start: r0\n" + "\n".join(f"r{i}: r{i + 1} | \"x{i}\"" for i in range(n)) + f'\nr{n}: "a"\n'


def as_json_text(schema) -> str:
    """A schema as JSON text; one nested past Python's recursion limit as text nested as deep (the server parses it
    without recursion and refuses it as too deep)."""
    try:
        return json.dumps(schema)
    except RecursionError:
        return deep_text(4000, "{")


growing = st.integers(1, 30) | st.integers(30, 600) | st.integers(600, 4000)
schemas = st.one_of(
    json_values,
    st.builds(defs_chain, growing, st.booleans()),
    st.builds(nested_schema, growing, st.sampled_from(["properties", "anyOf", "allOf", "oneOf"])),
    st.fixed_dictionaries({"type": st.sampled_from(["object", "string", "integer", "array", "number", "bogus"])},
                          optional={"enum": st.lists(scalars, max_size=30), "pattern": st.text(max_size=30),
                                    "minLength": st.integers(-5, 10**6), "maxItems": st.integers(-5, 10**6),
                                    "properties": st.dictionaries(st.text(max_size=6), json_values, max_size=5)}),
)
regexes = st.one_of(st.text(alphabet="ab()|*+?[]{}\\.-09^$,", max_size=60),
                    st.builds(lambda k, p: p * k, growing, st.sampled_from(["(ab|cd)*", "[a-z]{1,9}", "(a|b)*a"])),
                    st.just("[^\\x00-\\U0010FFFF]"))
grammars = st.one_of(st.text(max_size=80), st.builds(lark_chain, growing),
                     st.builds(lambda k: "start: " + " | ".join(f'"w{i}"' for i in range(k)), growing),
                     st.builds(lambda k: "start: " + "(" * k + '"a"' + ")" * k, growing),
                     st.just('start: "abcdefghij" x\nx: /[^\\x00-\\U0010FFFF]/'))
choices = st.lists(st.text(max_size=12), max_size=300) | json_values
structured = st.one_of(
    st.fixed_dictionaries({"guided_json": schemas | st.builds(as_json_text, schemas) | deep_json_text | st.text()}),
    st.fixed_dictionaries({"guided_regex": regexes | json_values}),
    st.fixed_dictionaries({"guided_grammar": grammars | json_values}),
    st.fixed_dictionaries({"guided_choice": choices}),
    st.fixed_dictionaries({"structured_outputs": st.dictionaries(
        st.sampled_from(["json", "regex", "choice", "grammar", "json_object", "bogus"]),
        schemas | regexes | st.booleans(), max_size=2) | json_values}),
    st.fixed_dictionaries({"response_format": st.fixed_dictionaries(
        {"type": st.sampled_from(["text", "json_object", "json_schema", "bogus"])},
        optional={"json_schema": st.fixed_dictionaries({}, optional={"name": st.text(max_size=8),
                                                                     "schema": schemas, "strict": st.booleans()})})
        | json_values}),
)

def mostly(valid, wrong=json_values):
    """A field's value: valid nine times in ten, anything else (a wrong type, a wrong range) the tenth."""
    return st.integers(0, 9).flatmap(lambda i: wrong if i == 0 else valid)


strings = st.text(max_size=40)
words = st.text(alphabet="abcdefghij ", min_size=1, max_size=12).filter(str.strip)
token_ids = st.integers(0, 383)
token_id_keys = st.integers(0, 383).map(str) | st.text(alphabet="0123456789 _+-.\u0663x", max_size=8)
wrong_ints = st.sampled_from([-3, 0, 2**31, 2**63, -2**63, 10**30]) | json_values
SAMPLING = {
    "max_tokens": mostly(st.integers(1, 6), wrong_ints),
    "n": mostly(st.integers(1, 3), wrong_ints),
    "temperature": mostly(st.floats(0, 2), st.sampled_from([-1.0, 1e308]) | json_values),
    "top_p": mostly(st.floats(0.01, 1)), "top_k": mostly(st.integers(-1, 50), wrong_ints),
    "min_p": mostly(st.floats(0, 1)), "seed": mostly(st.integers(0, 2**32), wrong_ints),
    "stop": mostly(words | st.lists(words, max_size=4)),
    "stream": mostly(st.booleans()),
    "stream_options": mostly(st.fixed_dictionaries({}, optional={"include_usage": st.booleans(),
                                                                 "continuous_usage_stats": st.booleans()})),
    "presence_penalty": mostly(st.floats(-2, 2)), "frequency_penalty": mostly(st.floats(-2, 2)),
    "repetition_penalty": mostly(st.floats(0.5, 2)),
    "logit_bias": mostly(st.dictionaries(st.integers(0, 383).map(str), st.floats(-100, 100), max_size=4),
                         st.dictionaries(token_id_keys, st.floats(-300, 300), min_size=1, max_size=3) | json_values),
    "user": strings, "bad_words": mostly(st.lists(words, max_size=3)),
    "min_tokens": mostly(st.integers(0, 2), wrong_ints), "ignore_eos": mostly(st.booleans()),
    "stop_token_ids": mostly(st.lists(token_ids, max_size=3), st.lists(wrong_ints, min_size=1, max_size=2)),
    "skip_special_tokens": mostly(st.booleans()), "include_stop_str_in_output": mostly(st.booleans()),
    "truncate_prompt_tokens": mostly(st.integers(-1, 600), wrong_ints),
    "allowed_token_ids": mostly(st.lists(token_ids, min_size=1, max_size=5), st.lists(wrong_ints, max_size=2)),
    "priority": mostly(st.integers(-3, 3), wrong_ints),
}
COMPLETION = {**SAMPLING, "logprobs": mostly(st.integers(0, 5), wrong_ints), "echo": mostly(st.booleans()),
              "best_of": mostly(st.integers(1, 3), wrong_ints), "suffix": mostly(st.none(), strings)}
arguments = st.one_of(deep_json_text, st.builds(json.dumps, json_values), strings)
tool_calls = mostly(st.lists(st.fixed_dictionaries({
    "id": strings, "type": st.just("function"),
    "function": st.fixed_dictionaries({"name": words, "arguments": arguments})}), min_size=1, max_size=2))
message = st.fixed_dictionaries(
    {"role": mostly(st.sampled_from(["system", "developer", "user", "assistant", "tool"]), st.text(max_size=8)),
     "content": mostly(strings | st.none() | st.lists(st.fixed_dictionaries({"type": st.just("text"),
                                                                              "text": strings}), max_size=2))},
    optional={"tool_calls": tool_calls, "tool_call_id": strings, "name": words})
messages = mostly(st.lists(message, min_size=1, max_size=4), st.lists(message, max_size=0) | json_values)
tool_names = st.sampled_from(["f", "g", "h"])
tools = mostly(st.lists(st.fixed_dictionaries({"type": st.just("function"), "function": st.fixed_dictionaries(
    {"name": tool_names}, optional={"parameters": schemas, "description": strings})}), min_size=1, max_size=3,
    unique_by=lambda t: t["function"]["name"]))
CHAT = {
    **SAMPLING, "max_completion_tokens": mostly(st.integers(1, 6), wrong_ints),
    "logprobs": mostly(st.booleans()), "top_logprobs": mostly(st.integers(0, 5), wrong_ints),
    "add_generation_prompt": mostly(st.booleans()), "continue_final_message": mostly(st.booleans()),
    "chat_template_kwargs": mostly(st.dictionaries(st.sampled_from(["enable_thinking", "tools", "x y", "date"]),
                                                   json_values, max_size=2)),
}
tool_choices = st.sampled_from(["none", "auto", "required"]) | st.builds(
    lambda name: {"type": "function", "function": {"name": name}}, tool_names)


@st.composite
def body(draw, required: dict, fields: dict, chat: bool = False) -> dict:
    """The required fields, up to four optional ones, and, two times in three, a structured-output constraint (or,
    on chat, tools with a tool_choice that constrains the output to their schemas)."""
    out = {k: draw(v) for k, v in required.items()}
    for name in draw(st.lists(st.sampled_from(sorted(fields)), max_size=4, unique=True)):
        out[name] = draw(fields[name])
    what = draw(st.sampled_from(["none", "structured", "structured"] + (["tools"] if chat else [])))
    if what == "structured":
        out.update(draw(structured))
    elif what == "tools":
        out["tools"] = draw(tools)
        out["tool_choice"] = draw(mostly(tool_choices))
    return out


prompts = mostly(words | st.lists(token_ids, min_size=1, max_size=20), strings | json_values)
requests = st.one_of(
    st.tuples(st.just("/v1/completions"), body({"model": st.just(MODEL), "prompt": prompts}, COMPLETION)),
    st.tuples(st.just("/v1/chat/completions"), body({"model": st.just(MODEL), "messages": messages}, CHAT, True)),
    st.tuples(st.just("/tokenize"), st.one_of(
        st.fixed_dictionaries({"model": st.just(MODEL), "messages": messages},
                              optional={"add_generation_prompt": st.booleans(), "return_token_strs": st.booleans()}),
        st.fixed_dictionaries({"model": st.just(MODEL), "prompt": mostly(strings)}))),
)


SIZES = [1, 10, 60, 200, 250, 400, 1000, 3000]


def growing_specs() -> list[tuple[str, dict]]:
    """Every kind of spec at every size, from trivial to far past the limits (and past llguidance's stack)."""
    cmpl = {"model": MODEL, "prompt": "The sea", "max_tokens": 4}
    chat = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
    out = []
    for k in SIZES:
        for objects in (False, True):
            out.append(("/v1/completions", {**cmpl, "guided_json": defs_chain(k, objects)}))
        out.append(("/v1/chat/completions", {**chat, "response_format": {
            "type": "json_schema", "json_schema": {"name": "x", "schema": nested_schema(min(k, 120), "properties")}}}))
        out.append(("/v1/completions", {**cmpl, "structured_outputs": {"json": nested_schema(min(k, 120), "anyOf")}}))
        out.append(("/v1/completions", {**cmpl, "guided_grammar": lark_chain(k)}))
        out.append(("/v1/completions", {**cmpl, "guided_regex": "(ab|cd)*" * k}))
        out.append(("/v1/completions", {**cmpl, "guided_json": deep_text(min(k, 250))}))
        out.append(("/v1/chat/completions", {**chat, "tools": [{"type": "function", "function": {
            "name": "f", "parameters": defs_chain(k, True)}}], "tool_choice": {"type": "function",
                                                                                "function": {"name": "f"}}}))
        out.append(("/tokenize", {"model": MODEL, "messages": [
            {"role": "assistant", "content": None, "tool_calls": [
                {"id": "c", "type": "function", "function": {"name": "f", "arguments": deep_text(k, "{")}}]}]}))
    return out


# ---- the test -----------------------------------------------------------------------------------------------------

def check_answer(path: str, status: int, answer: dict) -> None:
    assert status < 500, (path, status, str(answer)[:1000])
    if status >= 400:
        err = answer.get("error", {})
        assert set(err) == {"message", "type", "param", "code"} and err["message"], answer
        assert "Traceback" not in err["message"] and "<state>" not in err["message"], err
    elif "raw" in answer:  # a stream: an error event is the request's own (a grammar), never the server's
        for line in answer["raw"].split("\n"):
            if line.startswith("data: {") and '"error"' in line:
                assert json.loads(line[6:])["error"]["type"] != "server_error", line


def test_fuzzed_requests_never_get_a_5xx_stall_health_or_leak_a_block(server):
    sent = {"n": 0, "by_status": {}}

    @settings(max_examples=EXAMPLES, deadline=None, database=None, derandomize=True,
              suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large, HealthCheck.large_base_example])
    @given(requests)
    def fuzz(case):
        path, payload = case
        try:
            raw = json.dumps(payload).encode()
        except (ValueError, RecursionError):
            return
        if len(raw) > MAX_BODY:
            raw = raw[:MAX_BODY]  # still sent: a truncated body is a 400 too
        status, answer = request("POST", f"{server.url}{path}", raw)
        sent["n"] += 1
        sent["by_status"][status] = sent["by_status"].get(status, 0) + 1
        check_answer(path, status, answer)
        assert server.proc.poll() is None, server.log()

    def send(path: str, payload: dict) -> None:
        status, answer = request("POST", f"{server.url}{path}", json.dumps(payload).encode())
        sent["n"] += 1
        sent["by_status"][status] = sent["by_status"].get(status, 0) + 1
        check_answer(path, status, answer)

    poller = start_health_poller(server)
    t0 = time.monotonic()
    try:
        for path, payload in growing_specs():
            send(path, payload)
        assert server.proc.poll() is None, server.log()
        fuzz()
    finally:
        health = stop_health_poller(poller)
    elapsed = time.monotonic() - t0
    print(f"fuzz: {sent['n']} requests in {elapsed:.1f} s, by status {sent['by_status']}; /health: {health}")
    assert server.proc.poll() is None, server.log()
    assert health["failed"] == 0 and health["n"] > 10 and health["max_s"] < HEALTH_BOUND_S, health
    wait_for(lambda: (s := get(f"{server.url}/stats")[1])["num_used"] == 0 and s["num_running"] == 0
             and s["num_waiting"] == 0 and s["num_in_flight"] == 0, 30, "every KV block free after the fuzz")
    # Both outcomes were exercised: requests served and requests refused, some by a grammar worker that crashed.
    assert sent["by_status"].get(200, 0) >= 20 and sent["by_status"].get(400, 0) >= 40, sent
    assert "grammar worker restarted" in server.log_path.read_text()
