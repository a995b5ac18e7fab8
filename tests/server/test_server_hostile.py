"""One request must never take the server down (issue #28): a hostile client's requests against a real `server.py`
process (the tiny random-weight model of tests/server/test_server.py, on 127.0.0.1). Each gets its own 4xx after a
bounded time, with a short message that leaks no internals; the process lives, /health answers and no KV block leaks."""

from __future__ import annotations

import gzip
import json
import socket
import threading
import time
import zlib
from pathlib import Path

import pytest

from tests.server.harness import (
    MODEL,
    PROMPT,
    Server,
    connect,
    get,
    http_bytes,
    post,
    read_until_closed,
    wait_for,
)
from tests.tiny_hf import make_tiny_hf_model

pytestmark = pytest.mark.slow  # starts processes or loads a real model: docs/testing.md

WRITE_TIMEOUT = 2.0
BODY_LIMIT = 4_000_000
MAX_MODEL_LEN = 4096
# Markers of internals a client must never see: llguidance's state dumps and grammars, Python tracebacks.
LEAKS = ("<state>", "</grammar>", '"grammars"', "Traceback", "lark_grammar", "EngineStepError", "File \"")


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    model_dir = Path(make_tiny_hf_model(tmp_path_factory.mktemp("tiny_model"), "llama",
                                         max_position_embeddings=MAX_MODEL_LEN))
    srv = Server(model_dir, tmp_path_factory.mktemp("logs") / "hostile.log", "--max-body-bytes", str(BODY_LIMIT),
                 "--max-model-len", str(MAX_MODEL_LEN), "--kv-cache-memory", "48MiB",
                 "--write-timeout", str(WRITE_TIMEOUT))
    yield srv
    srv.stop()


def stats(server: Server) -> dict:
    status, body = get(f"{server.url}/stats")
    assert status == 200, body
    return body


def alive_and_well(server: Server) -> None:
    assert server.proc.poll() is None, server.log()
    assert get(f"{server.url}/health") == (200, {"status": "ok"})
    status, body = post(f"{server.url}/v1/completions", {"model": MODEL, "prompt": "Hello", "max_tokens": 2,
                                                         "temperature": 0, "ignore_eos": True})
    assert status == 200 and body["usage"]["completion_tokens"] == 2, body
    wait_for(lambda: (s := stats(server))["num_used"] == 0 and s["num_running"] == 0 and s["num_waiting"] == 0,
             30, "every KV block free")


def assert_client_error(status: int, body: dict, param: str | None) -> None:
    assert status == 400, (status, str(body)[:500])
    err = body["error"]
    assert err["type"] == "invalid_request_error" and err["param"] == param, err
    assert len(err["message"]) < 600 and not any(leak in err["message"] for leak in LEAKS), err["message"]


def defs_chain(n: int, link=lambda nxt: {"$ref": nxt}) -> dict:
    defs = {f"d{i}": link(f"#/$defs/d{i + 1}") for i in range(n)}
    defs[f"d{n}"] = {"type": "string"}
    return {"$ref": "#/$defs/d0", "$defs": defs}


def lark_chain(n: int) -> str:
    return "start: r0\n" + "\n".join(f"r{i}: r{i + 1}" for i in range(n)) + f'\nr{n}: "a"\n'


def object_link(nxt: str) -> dict:
    return {"type": "object", "properties": {"a": {"$ref": nxt}}, "required": ["a"]}


CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
CMPL = {"model": MODEL, "prompt": PROMPT, "max_tokens": 4}
TOOL = {"type": "function", "function": {"name": "f", "parameters": defs_chain(3000)}}
# Each of these overflowed llguidance's stack on the event-loop thread: a segfault of the whole server.
CHAINS = {
    "lark rules": ("/v1/completions", {**CMPL, "guided_grammar": lark_chain(3000)}, "guided_grammar"),
    "$defs": ("/v1/chat/completions", {**CHAT, "response_format": {
        "type": "json_schema", "json_schema": {"name": "x", "schema": defs_chain(3000)}}}, "response_format"),
    "tool parameters": ("/v1/chat/completions", {**CHAT, "tools": [TOOL], "tool_choice": {
        "type": "function", "function": {"name": "f"}}}, "tools"),
    # Within every input limit, yet deep enough to overflow a small stack: the worker process takes the crash.
    "object chain within the limits": ("/v1/completions", {**CMPL, "guided_json": defs_chain(250, object_link)},
                                       "guided_json"),
    "guided_json text": ("/v1/completions", {**CMPL, "guided_json": json.dumps(defs_chain(3000))}, "guided_json"),
}


@pytest.mark.parametrize("name", list(CHAINS))
def test_a_chain_of_rules_or_references_gets_its_own_400_and_the_server_lives(server, name):
    path, body, param = CHAINS[name]
    t0 = time.monotonic()
    status, answer = post(f"{server.url}{path}", body)
    assert_client_error(status, answer, param)
    assert time.monotonic() - t0 < 10
    alive_and_well(server)


DEEP = "[" * 5000 + "]" * 5000


def chat_with_arguments(arguments: str) -> list[dict]:
    return [{"role": "user", "content": "call it"},
            {"role": "assistant", "content": None, "tool_calls": [
                {"id": "c1", "type": "function", "function": {"name": "f", "arguments": arguments}}]},
            {"role": "tool", "tool_call_id": "c1", "content": "done"}]


@pytest.mark.parametrize("path,body,param", [
    ("/v1/completions", {**CMPL, "guided_json": DEEP}, "guided_json"),
    ("/v1/completions", {**CMPL, "structured_outputs": {"json": DEEP}}, "structured_outputs"),
    ("/v1/chat/completions", {**CHAT, "messages": chat_with_arguments(DEEP)},
     "messages.1.tool_calls.0.function.arguments"),
    ("/tokenize", {"model": MODEL, "messages": chat_with_arguments(DEEP)},
     "messages.1.tool_calls.0.function.arguments"),
])
def test_deeply_nested_json_in_a_string_field_is_a_400_naming_the_field(server, path, body, param):
    log_start = len(server.log_path.read_bytes())
    status, answer = post(f"{server.url}{path}", body)
    assert_client_error(status, answer, param)
    log = server.log_path.read_bytes()[log_start:].decode(errors="replace")
    assert "Traceback" not in log and " ERROR " not in log, log[-2000:]
    alive_and_well(server)


def test_tool_call_arguments_that_are_plain_text_still_reach_the_template(server):
    status, body = post(f"{server.url}/tokenize", {"model": MODEL, "messages": chat_with_arguments("not json")})
    assert status == 200 and body["count"] > 0, body


# A regex whose language is empty: llguidance accepts it, but no first token exists. After a literal of its own, the
# grammar has first tokens and fails only once the literal is generated (the engine's 8th step, with this tokenizer).
EMPTY = "[^\\x00-\\U0010FFFF]"
MIDWAY = f'start: "abcdefghij" x\nx: /{EMPTY}/'


@pytest.mark.parametrize("stream", [False, True])
def test_a_grammar_with_no_first_token_is_a_400_before_it_is_queued(server, stream):
    failed_before = stats(server)["failed_requests"]
    status, answer = post(f"{server.url}/v1/completions", {**CMPL, "guided_regex": EMPTY, "stream": stream})
    assert_client_error(status, answer, "guided_regex")
    assert stats(server)["failed_requests"] == failed_before  # never queued
    alive_and_well(server)


def sse_events(raw: str) -> list:
    return [json.loads(line[6:]) if line[6:] != "[DONE]" else "[DONE]"
            for line in raw.split("\n") if line.startswith("data: ")]


def test_a_grammar_that_fails_while_generating_fails_its_own_request_only(server):
    failing = {**CMPL, "guided_grammar": MIDWAY, "max_tokens": 30, "temperature": 0}
    normal = {**CMPL, "max_tokens": 64, "temperature": 0, "ignore_eos": True, "stream": True}
    answers: dict = {}
    thread = threading.Thread(target=lambda: answers.update(normal=post(f"{server.url}/v1/completions", normal)))
    thread.start()
    status, answer = post(f"{server.url}/v1/completions", failing)  # after its first token: its own 400
    assert_client_error(status, answer, "guided_grammar")
    assert "grammar" in answer["error"]["message"]
    status, answer = post(f"{server.url}/v1/completions", {**failing, "stream": True})
    assert status == 200
    events = sse_events(answer["raw"])
    errors = [e for e in events if isinstance(e, dict) and "error" in e]
    assert len(errors) == 1 and events[-1] == "[DONE]", events
    assert_client_error(400, errors[0], "guided_grammar")
    thread.join()
    status, answer = answers["normal"]
    events = sse_events(answer["raw"])
    assert status == 200 and events[-1] == "[DONE]" and not any("error" in e for e in events[:-1]), events[-3:]
    assert sum(len(e["choices"][0]["text"]) > 0 for e in events[:-1]) > 10
    alive_and_well(server)


def test_health_answers_while_megabytes_of_grammar_arrive(server):
    latencies: list[float] = []
    stop = threading.Event()

    def poll():
        while not stop.is_set():
            t0 = time.monotonic()
            assert get(f"{server.url}/health")[0] == 200
            latencies.append(time.monotonic() - t0)
            time.sleep(0.02)

    poller = threading.Thread(target=poll)
    poller.start()
    answers = []
    specs = [{"guided_regex": "(ab|cd)*" * 300_000}, {"guided_choice": [f"c{i}" * 4000 for i in range(200)]},
             {"guided_grammar": "start: " + " | ".join(f'"{i}"' for i in range(300_000))}]
    threads = [threading.Thread(target=lambda s=s: answers.append(post(f"{server.url}/v1/completions", {**CMPL, **s})))
               for s in specs]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    stop.set()
    poller.join()
    for status, answer in answers:
        assert_client_error(status, answer, answer.get("error", {}).get("param"))
    assert max(latencies) < 0.5, sorted(latencies)[-5:]
    alive_and_well(server)


@pytest.mark.parametrize("rcvbuf", [None, 64 * 2**20])
def test_a_stream_whose_client_never_reads_is_aborted_after_the_write_timeout(server, rcvbuf):
    """However large the socket buffers: the client keeps the kernel's default receive buffer, or asks for the
    largest the kernel gives (8 MiB here), and reads nothing; the stream's megabytes of output take several times the
    timeout to generate, all of which the buffers of old absorbed (the server's send buffer autotunes to 4 MiB)."""
    n, max_tokens = 16, MAX_MODEL_LEN - 64
    flood = {**CMPL, "n": n, "max_tokens": max_tokens, "ignore_eos": True, "temperature": 1.0, "stream": True}
    before = stats(server)
    sock = socket.socket()
    if rcvbuf is not None:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, rcvbuf)
    sock.connect(("127.0.0.1", int(server.url.rsplit(":", 1)[1])))
    try:
        sock.sendall(http_bytes("POST", "/v1/completions", json.dumps(flood).encode()))
        wait_for(lambda: stats(server)["generation_tokens"] > before["generation_tokens"], 60, "the first tokens")
        t0 = time.monotonic()
        after = wait_for(lambda: s if (s := stats(server))["num_in_flight"] == 0 and s["num_used"] == 0 else None,
                         60, "the stream being aborted and its blocks freed")
        freed_after = time.monotonic() - t0
    finally:
        sock.close()
    generated = after["generation_tokens"] - before["generation_tokens"]
    # Cut short: a stream that finished into the buffers would have generated every token (ignore_eos); the
    # whole stream takes about three times the timeout on this project's CPU.
    assert generated < n * max_tokens * 0.8, generated
    # The timeout, plus while the client's window still grows (TCP opens a large buffer to a client step by step).
    assert freed_after < WRITE_TIMEOUT + 6, freed_after
    alive_and_well(server)


def test_a_stream_read_slowly_but_steadily_is_not_aborted(server):
    """Reading progress, not speed: a client that reads a little every second keeps its stream."""
    flood = {**CMPL, "n": 2, "max_tokens": 300, "ignore_eos": True, "temperature": 1.0, "stream": True}
    with connect(server, rcvbuf=4096) as sock:
        sock.sendall(http_bytes("POST", "/v1/completions", json.dumps(flood).encode()))
        data = b""
        deadline = time.monotonic() + 120
        while b"data: [DONE]" not in data and time.monotonic() < deadline:
            chunk = sock.recv(2048)
            if not chunk:
                break
            data += chunk
            time.sleep(WRITE_TIMEOUT / 8)
    assert b"data: [DONE]" in data, data[-300:]
    alive_and_well(server)


def test_a_body_that_says_gzip_but_is_not_is_a_400_and_one_warning_line(server):
    log_start = len(server.log_path.read_bytes())
    raw = json.dumps({**CMPL}).encode()
    for body in (raw, b"not gzip at all " * 4, gzip.compress(raw)[:10] + b"\xff" * 40):
        with connect(server) as sock:
            sock.sendall(http_bytes("POST", "/v1/completions", body, {"Content-Encoding": "gzip",
                                                                      "Connection": "close"}))
            data, _ = read_until_closed(sock, 30)
        head, _, answer = data.partition(b"\r\n\r\n")
        assert head.startswith(b"HTTP/1.1 400"), data[:300]
        assert_client_error(400, json.loads(answer), None)
    status, body = post(f"{server.url}/v1/completions", gzip.compress(raw), {"Content-Encoding": "gzip"})
    assert status == 200, body  # a real gzip body is read as before
    time.sleep(0.5)
    log = server.log_path.read_bytes()[log_start:].decode(errors="replace")
    warnings = [line for line in log.splitlines() if "gzip" in line]
    assert len(warnings) == 3 and all(" WARNING " in w for w in warnings), log
    assert "Traceback" not in log and " ERROR " not in log, log


def raw_deflate(data: bytes) -> bytes:
    compressor = zlib.compressobj(wbits=-15)
    return compressor.compress(data) + compressor.flush()


def test_a_compressed_body_that_breaks_off_is_a_400_at_once_even_after_its_headers(server):
    """A deflate body that did not end as a deflate stream, sent after its headers (as clients that write headers
    and body separately do), waited for the rest until --body-timeout (30 s) and was answered 408."""
    raw = json.dumps({**CMPL}).encode()
    bodies = {"deflate": [b"junk", zlib.compress(raw)[:-3], raw_deflate(raw)[:-2], zlib.compress(raw) + b"x"],
              "gzip": [gzip.compress(raw)[:-8]], "br": [raw]}
    for encoding, cases in bodies.items():
        for body in cases:
            request = http_bytes("POST", "/v1/completions", body, {"Content-Encoding": encoding,
                                                                   "Connection": "close"})
            head_end = request.index(b"\r\n\r\n") + 4
            with connect(server) as sock:
                sock.sendall(request[:head_end])
                time.sleep(0.3)  # the headers reach the handler before the body
                sock.sendall(request[head_end:])
                data, seconds = read_until_closed(sock, 30)
            head, _, answer = data.partition(b"\r\n\r\n")
            assert head.startswith(b"HTTP/1.1 400") and seconds < 5, (encoding, body[:20], seconds, data[:300])
            assert_client_error(400, json.loads(answer), None)
    for body in (zlib.compress(raw), raw_deflate(raw)):  # both forms of deflate are read as before
        status, answer = post(f"{server.url}/v1/completions", body, {"Content-Encoding": "deflate"})
        assert status == 200, answer
    alive_and_well(server)


@pytest.mark.parametrize("key", [" 7", "7 ", "1_0", "\u0663", "07", "+7", "-1", "7.0", "", "0x7", "1e2",
                                 "9" * 5000])
def test_logit_bias_keys_must_be_canonical_token_ids(server, key):
    status, body = post(f"{server.url}/v1/completions", {**CMPL, "logit_bias": {key: 1.0}})
    assert_client_error(status, body, "logit_bias")


def test_canonical_logit_bias_keys_are_served(server):
    status, body = post(f"{server.url}/v1/completions", {**CMPL, "temperature": 0, "logit_bias": {"7": 100.0,
                                                                                                    "0": -1.0}})
    assert status == 200 and body["usage"]["completion_tokens"] >= 1, body



class _FailingStream:
    """Stands in for a RequestStream whose request failed inside the engine."""

    def __init__(self, error: BaseException):
        self.error = error

    def __aiter__(self):
        return self

    async def __anext__(self):
        raise self.error

    async def aclose(self):
        pass


@pytest.mark.parametrize("error,status,code", [
    ("step", 500, "engine_step_error"),
    ("grammar", 400, "grammar_failed"),
])
def test_an_engine_failure_reaches_the_client_without_internals(error, status, code):
    import asyncio

    from jaxpaged.entrypoints.async_engine import EngineStepError, RequestGrammarError
    from jaxpaged.entrypoints.openai.protocol import OpenAIError
    from jaxpaged.entrypoints.openai.serving import _Context

    internals = 'ValueError: boom\n<state>{"rows": 1}</state><grammar>{"grammars": [{"lark_grammar": "..."}]}'
    exc = EngineStepError(f"internal engine error: {internals}") if error == "step" else \
        RequestGrammarError("structured output: the grammar failed while generating: NoExtensionBias")
    ctx = _Context("cmpl-1", MODEL, 0, 1, [], [_FailingStream(exc)], None, "response_format")

    async def read():
        async for _ in ctx.merged():
            pass

    with pytest.raises(OpenAIError) as e:
        asyncio.run(read())
    assert e.value.status == status and e.value.code == code
    assert e.value.param == ("response_format" if error == "grammar" else None)  # the field whose grammar failed
    assert not any(leak in e.value.message for leak in LEAKS) and "boom" not in e.value.message, e.value.message


TOOL = {"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {}}}}


@pytest.mark.parametrize("body, field", [
    ({"prompt": "x", "guided_regex": "a+"}, "guided_regex"),
    ({"prompt": "x", "response_format": {"type": "json_object"}}, "response_format"),
    ({"prompt": "x", "structured_outputs": {"choice": ["a"]}}, "structured_outputs"),
    ({"prompt": "x", "response_format": {"type": "text"}}, None),
    ({"messages": [{"role": "user", "content": "x"}], "tools": [TOOL], "tool_choice": "required"}, "tools"),
    ({"messages": [{"role": "user", "content": "x"}], "tools": [TOOL], "guided_choice": ["a"]}, "guided_choice"),
])
def test_a_grammar_is_blamed_on_the_field_that_set_it(body, field):
    """The param of a grammar that fails while generating (grammar_failed) is the request field it came from: the
    one `structured_output_request` names, which the server passes on to the request's context."""
    from jaxpaged.entrypoints.openai.protocol import ChatCompletionRequest, CompletionRequest

    request = (ChatCompletionRequest if "messages" in body else CompletionRequest).model_validate(
        {"model": MODEL, **body})
    assert request.structured_output_request()[1] == field
