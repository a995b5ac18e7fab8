"""One client must never break another: hostile values are refused before anything is queued, many n>1 requests
wait for seats instead of overflowing a step, and a request with many prompts neither starves running streams
nor gets a 429 it could never get past. A real `server.py` process on a tiny random-weight model."""

from __future__ import annotations

import asyncio
import json
import time

import aiohttp
import pytest

from tests.server.harness import MODEL, Server, get, post, still_serves
from tests.tiny_hf import TINY_VOCAB, make_tiny_hf_model

pytestmark = pytest.mark.slow  # starts processes or loads a real model: docs/testing.md

MAX_WAITING = 24
MAX_PROMPTS = 20


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    model_dir = make_tiny_hf_model(tmp_path_factory.mktemp("tiny_model"), "llama")
    srv = Server(model_dir, tmp_path_factory.mktemp("logs") / "server.log", "--max-waiting", str(MAX_WAITING),
                 "--max-prompts-per-request", str(MAX_PROMPTS))
    yield srv
    srv.stop()


def completion(**kw) -> dict:
    return {"model": MODEL, "prompt": "Once upon a time", "max_tokens": 4, "temperature": 0, "ignore_eos": True,
            **kw}


def chat(**kw) -> dict:
    return {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4, **kw}


HOSTILE = [
    ({"top_k": 2147483648}, "top_k"), ({"top_k": 2**70}, "top_k"),
    ({"stop_token_ids": [1099511627776], "min_tokens": 1}, "stop_token_ids"),
    ({"stop_token_ids": [TINY_VOCAB]}, "stop_token_ids"), ({"stop_token_ids": [-1]}, "stop_token_ids"),
    ({"seed": 2**63}, "seed"), ({"max_tokens": 2**40}, "max_tokens"), ({"n": 10**9}, "n"),
]


async def stream_text(session: aiohttp.ClientSession, url: str, body: dict) -> tuple[str, list[float]]:
    """The streamed text of choice 0 and the arrival time of every chunk."""
    text, times = "", []
    async with session.post(url, json={**body, "stream": True}) as resp:
        assert resp.status == 200, await resp.text()
        async for line in resp.content:
            line = line.strip()
            if not line.startswith(b"data: ") or line == b"data: [DONE]":
                continue
            event = json.loads(line[6:])
            assert "error" not in event, event
            times.append(time.monotonic())
            text += event["choices"][0].get("text") or ""
    return text, times


@pytest.mark.parametrize("endpoint", ["completions", "chat/completions"])
def test_hostile_values_are_400_and_do_not_touch_other_streams(server, endpoint):
    url = f"{server.url}/v1/completions"
    victim = completion(prompt="The lighthouse keeper kept", max_tokens=24)
    alone = post(url, victim)[1]["choices"][0]["text"]
    make = completion if endpoint == "completions" else chat

    async def run():
        async with aiohttp.ClientSession() as session:
            streaming = asyncio.create_task(stream_text(session, url, victim))
            answers = []
            for fields, param in HOSTILE:
                async with session.post(f"{server.url}/v1/{endpoint}", json=make(**fields)) as resp:
                    answers.append((resp.status, (await resp.json())["error"]["param"], param))
            return (await streaming)[0], answers

    text, answers = asyncio.run(run())
    assert all(status == 400 and got == want for status, got, want in answers), answers
    assert text == alone
    still_serves(server)


def test_concurrent_n_gt_1_requests_wait_for_seats(server):
    """The server runs max_num_seqs=16 sequences; 9 requests of n=4 (36 sequences) arrive at once."""
    url = f"{server.url}/v1/completions"

    async def run():
        async with aiohttp.ClientSession() as session:
            async def one(i):
                async with session.post(url, json=completion(prompt=f"Story {i}:", n=4, max_tokens=6,
                                                             temperature=1.0, seed=i)) as resp:
                    return resp.status, await resp.json()

            return await asyncio.gather(*(one(i) for i in range(9)))

    results = asyncio.run(run())
    assert all(status == 200 for status, _ in results), [b for s, b in results if s != 200][:1]
    assert all(len(body["choices"]) == 4 and body["usage"]["completion_tokens"] == 24 for _, body in results)
    still_serves(server)


def test_too_many_prompts_in_one_request_is_400_naming_prompt(server):
    status, body = post(f"{server.url}/v1/completions", completion(prompt=["hi"] * (MAX_PROMPTS + 1)))
    assert status == 400 and body["error"]["param"] == "prompt"
    assert str(MAX_PROMPTS) in body["error"]["message"]


def test_more_prompts_than_can_ever_wait_is_400_not_429(tmp_path_factory):
    """A request that could never fit the waiting queue must not be told to retry."""
    model_dir = make_tiny_hf_model(tmp_path_factory.mktemp("tiny_model_small_queue"), "llama")
    srv = Server(model_dir, tmp_path_factory.mktemp("logs") / "server.log", "--max-waiting", "4")
    try:
        status, body = post(f"{srv.url}/v1/completions", completion(prompt=["hi"] * 5))
        assert status == 400 and body["error"]["param"] == "prompt" and "max_waiting=4" in body["error"]["message"]
        stats = get(f"{srv.url}/stats")[1]
        assert stats["num_waiting"] == 0 and stats["num_pending_adds"] == 0  # nothing half-queued
        assert post(f"{srv.url}/v1/completions", completion(prompt=["hi"] * 4))[0] == 200
    finally:
        srv.stop()


def test_many_prompts_do_not_stall_a_running_stream(server):
    """While one request's prompts are prefilled (several prefill steps), a stream that was already running keeps
    getting tokens. Before the fix it got none until every prompt had been admitted."""
    url = f"{server.url}/v1/completions"
    words = "the keeper wrote down every ship that passed the rock in the long winter nights".split()

    def load(first: str) -> dict:  # MAX_PROMPTS prompts of ~116 tokens: two per prefill step of 256 tokens
        return completion(prompt=[first + " ".join(words[(i + k) % len(words)] for k in range(34))
                                  for i in range(MAX_PROMPTS)], max_tokens=1)

    # Compiles the step shapes of such a load, so the timing below is of steps alone; other prompts than the timed
    # ones, which must not come from the prefix cache.
    assert post(url, load("Then "))[0] == 200

    async def run():
        async with aiohttp.ClientSession() as session:
            times: list[float] = []
            started = asyncio.Event()

            async def stream():
                body = completion(prompt="Tell me", max_tokens=100, stream=True)
                async with session.post(url, json=body) as resp:
                    async for line in resp.content:
                        if line.startswith(b"data: {"):
                            times.append(time.monotonic())
                            started.set()

            task = asyncio.create_task(stream())
            await started.wait()
            t0 = time.monotonic()
            async with session.post(url, json=load("Now ")) as resp:
                assert resp.status == 200
            t1 = time.monotonic()
            await task
            return [t for t in times if t0 < t < t1], len(times), [round(t - t0, 3) for t in times], t1 - t0

    during, total, rel, load_s = asyncio.run(run())
    assert len(during) >= 3, (len(during), total, rel, load_s)


@pytest.mark.parametrize("raw, param", [
    (b'{"model":"tiny","prompt":"x","temperature":1e999}', "temperature"),
    (b'{"model":"tiny","prompt":"x","temperature":Infinity}', "temperature"),
    (b'{"model":"tiny","prompt":"x","top_p":NaN}', "top_p"),
    (b'{"model":"tiny","prompt":[3.0,4]}', "prompt"), (b'{"model":"tiny","prompt":[true,4]}', "prompt"),
    (b'{"model":"tiny","prompt":"x","max_tokens":3.5}', "max_tokens"),
    (b'{"model":"tiny","prompt":"x","stop_token_ids":[1.5]}', "stop_token_ids.0"),
    (b'{"model":"tiny","messages":[{"role":"wizard","content":"hi"}]}', "messages.0.role"),
    (b'{"model":"tiny","messages":[{"role":"user","content":"hi \\ud800"}]}', "messages.0.content"),  # lone surrogates
    (b'{"model":"tiny","prompt":"x","stop":["a","\\udc00b"]}', "stop.1"),
])
def test_garbage_numbers_and_roles_are_400_naming_the_field(server, raw, param):
    path = "chat/completions" if b"messages" in raw else "completions"
    status, body = post(f"{server.url}/v1/{path}", raw)
    assert status == 400 and body["error"]["param"] == param, body
    _, stats = get(f"{server.url}/stats")  # refused before anything was queued: nothing holds a block or a slot
    assert stats["num_in_flight"] == stats["num_waiting"] == stats["num_running"] == stats["num_used"] == 0, stats


def test_a_lone_surrogate_escape_is_named_and_a_surrogate_pair_is_text():
    """A \\uD800-\\uDFFF escape outside a pair is not a character: a 400 that says so and names the field holding it
    (a key: no field); a pair is the character it encodes."""
    from jaxpaged.entrypoints.openai.protocol import CompletionRequest, OpenAIError, parse_body

    body = parse_body(CompletionRequest, b'{"model":"tiny","prompt":"smile \\ud83d\\ude00"}')
    assert body.prompt == "smile \U0001F600"
    for raw, param in [(b'{"model":"tiny","prompt":"\\ud83d"}', "prompt"),
                       (b'{"model":"tiny","prompt":"\\ud83d\\u0041"}', "prompt"),
                       (b'{"model":"tiny","prompt":"x","\\ude00":1}', None)]:
        with pytest.raises(OpenAIError, match="must be half of a surrogate pair") as e:
            parse_body(CompletionRequest, raw)
        assert e.value.param == param and e.value.status == 400
