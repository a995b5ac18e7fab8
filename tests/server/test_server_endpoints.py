"""vLLM's small endpoints (/tokenize, /detokenize, /version, `echo`, /v1/models' max_model_len) and the pool view
(/pool, the page at /) against a real `server.py` process with an API key, on the tiny model of test_server.py."""

from __future__ import annotations

import json
import threading
import time
from importlib import metadata

import pytest

from tests.server.harness import MODEL, PROMPT, Server, assert_idle, post, request

pytestmark = pytest.mark.slow  # starts processes or loads a real model: docs/testing.md

KEY = "endpoints-key"
AUTH = {"Authorization": f"Bearer {KEY}"}
MAX_MODEL_LEN = 512
CHAT = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": PROMPT}]


@pytest.fixture(scope="module")
def server(model_dir, tmp_path_factory):
    srv = Server(model_dir, tmp_path_factory.mktemp("logs") / "server.log", "--api-key", KEY,
                 "--max-model-len", str(MAX_MODEL_LEN), "--max-prompt-chars", "5000")
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def client(server):
    return server.client(KEY)


def call(server, method: str, path: str, body: dict | None = None, auth: bool = True) -> tuple[int, dict]:
    return request(method, server.url + path, json.dumps(body).encode() if body is not None else None,
                   AUTH if auth else None)


def assert_400(status_body: tuple[int, dict], param: str) -> dict:
    status, body = status_body
    assert status == 400, body
    assert body["error"]["param"] == param and body["error"]["type"] == "invalid_request_error", body
    return body["error"]


# ---- /tokenize and /detokenize ------------------------------------------------------------------------------------

def test_tokenize_then_detokenize_round_trips(server, tokenizer):
    for text in (PROMPT, "  two  spaces, (brackets) and\nnewlines.", "caf\u00e9 \u2013 \u00fcber"):
        status, tok = call(server, "POST", "/tokenize", {"model": MODEL, "prompt": text, "add_special_tokens": False})
        assert status == 200, tok
        assert tok["tokens"] == tokenizer(text, add_special_tokens=False)["input_ids"]
        assert tok["count"] == len(tok["tokens"]) and tok["max_model_len"] == MAX_MODEL_LEN
        status, detok = call(server, "POST", "/detokenize", {"model": MODEL, "tokens": tok["tokens"]})
        assert status == 200 and detok == {"prompt": text}, detok


def test_tokenize_counts_what_completions_feeds_the_model(server, client):
    status, tok = call(server, "POST", "/tokenize", {"prompt": PROMPT, "return_token_strs": True})
    assert status == 200, tok
    usage = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=1).usage
    assert tok["count"] == usage.prompt_tokens
    assert len(tok["token_strs"]) == tok["count"] and all(isinstance(s, str) and s for s in tok["token_strs"])
    # the ids themselves: sent back as a token prompt, the model sees the same prompt
    usage_ids = client.completions.create(model=MODEL, prompt=tok["tokens"], max_tokens=1).usage
    assert usage_ids.prompt_tokens == tok["count"]


def test_tokenize_of_a_chat_equals_the_chat_endpoints_prompt_tokens(server, client):
    status, tok = call(server, "POST", "/tokenize", {"model": MODEL, "messages": CHAT})
    assert status == 200, tok
    usage = client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=1).usage
    assert tok["count"] == usage.prompt_tokens
    status, bare = call(server, "POST", "/tokenize", {"messages": CHAT, "add_generation_prompt": False})
    assert status == 200 and bare["count"] < tok["count"]
    assert tok["tokens"][:bare["count"]] == bare["tokens"]  # the generation prompt is a suffix


def test_continue_final_message_leaves_the_assistants_message_open(server, client, tokenizer):
    """vLLM's continue_final_message: the chat's last message, the assistant's, is continued; its tokens are the closed
    message's without what the template adds after it. The chat endpoint feeds the model the same prompt."""
    begun = CHAT + [{"role": "assistant", "content": "The answer is"}]
    status, closed = call(server, "POST", "/tokenize", {"messages": begun, "add_generation_prompt": False})
    assert status == 200, closed
    status, open_ = call(server, "POST", "/tokenize", {"messages": begun, "add_generation_prompt": False,
                                                        "continue_final_message": True})
    assert status == 200, open_
    n = open_["count"]
    assert n < closed["count"] and open_["tokens"] == closed["tokens"][:n]
    assert tokenizer.decode(open_["tokens"]).endswith("The answer is")
    status, body = call(server, "POST", "/v1/chat/completions", {
        "model": MODEL, "messages": begun, "add_generation_prompt": False, "continue_final_message": True,
        "chat_template_kwargs": {"unused_by_this_template": True}, "max_tokens": 2})
    assert status == 200 and body["usage"]["prompt_tokens"] == n, body


def test_truncate_prompt_tokens_keeps_the_prompts_end(server, tokenizer):
    """vLLM's truncate_prompt_tokens: a text prompt longer than --max-prompt-chars and the context is answered from
    its last k tokens (the ids /tokenize gives for the text's end); token prompts and chats likewise."""
    words = " ".join(f"w{i}" for i in range(1500))  # ~7,000 characters, thousands of tokens
    tail = tokenizer(words[-600:])["input_ids"]
    status, body = call(server, "POST", "/v1/completions", {"model": MODEL, "prompt": words, "max_tokens": 1,
                                                            "truncate_prompt_tokens": 40, "echo": True})
    assert status == 200 and body["usage"]["prompt_tokens"] == 40, body
    assert body["choices"][0]["text"].startswith(words)  # echo gives the prompt as sent
    status, body = call(server, "POST", "/v1/completions", {"model": MODEL, "prompt": tail[-50:], "max_tokens": 1,
                                                            "truncate_prompt_tokens": 30, "logprobs": 0})
    assert status == 200 and body["usage"]["prompt_tokens"] == 30, body
    chat = [{"role": "user", "content": words[:3000]}]
    status, body = call(server, "POST", "/v1/chat/completions", {"model": MODEL, "messages": chat, "max_tokens": 1,
                                                                 "truncate_prompt_tokens": -1})
    assert status == 400 and body["error"]["param"] == "messages"  # -1 keeps all 512: no room to generate
    status, body = call(server, "POST", "/v1/chat/completions", {"model": MODEL, "messages": chat, "max_tokens": 1,
                                                                 "truncate_prompt_tokens": 100})
    assert status == 200 and body["usage"]["prompt_tokens"] == 100, body
    for value in (0, -2, MAX_MODEL_LEN + 1, "5", 1.5):
        assert_400(call(server, "POST", "/v1/completions", {"model": MODEL, "prompt": "hi",
                                                            "truncate_prompt_tokens": value}), "truncate_prompt_tokens")


def test_bad_chat_template_options_are_400_naming_the_field(server):
    begun = CHAT + [{"role": "assistant", "content": "The answer is"}]
    for path in ("/tokenize", "/v1/chat/completions"):
        assert_400(call(server, "POST", path, {"model": MODEL, "messages": begun, "continue_final_message": True}),
                   "continue_final_message")  # add_generation_prompt is true by default
        assert_400(call(server, "POST", path, {"model": MODEL, "messages": CHAT, "continue_final_message": True,
                                               "add_generation_prompt": False}), "continue_final_message")
        too_deep = {"a": json.loads("[" * 80 + "]" * 80)}
        for kwargs in ({"tokenize": False}, {"messages": []}, [1], "x", too_deep):
            assert_400(call(server, "POST", path, {"model": MODEL, "messages": CHAT, "chat_template_kwargs": kwargs}),
                       "chat_template_kwargs")


def test_bad_tokenize_and_detokenize_values_are_400_naming_the_field(server, tokenizer):
    vocab = len(tokenizer)
    err = assert_400(call(server, "POST", "/detokenize", {"tokens": [1, vocab]}), "tokens")
    assert f"tokens[1]={vocab}" in err["message"]
    assert_400(call(server, "POST", "/detokenize", {"tokens": [-1]}), "tokens")
    assert_400(call(server, "POST", "/detokenize", {"tokens": "12"}), "tokens")
    assert_400(call(server, "POST", "/detokenize", {"tokens": [True]}), "tokens.0")
    assert_400(call(server, "POST", "/detokenize", {}), "tokens")
    assert_400(call(server, "POST", "/tokenize", {}), "prompt")
    assert_400(call(server, "POST", "/tokenize", {"prompt": "a", "messages": CHAT}), "messages")
    assert_400(call(server, "POST", "/tokenize", {"prompt": 5}), "prompt")
    assert_400(call(server, "POST", "/tokenize", {"messages": []}), "messages")
    assert_400(call(server, "POST", "/tokenize", {"messages": [{"role": "bot", "content": "x"}]}), "messages.0.role")
    assert_400(call(server, "POST", "/tokenize", {"messages": CHAT, "add_special_tokens": True}), "add_special_tokens")
    err = assert_400(call(server, "POST", "/tokenize", {"prompt": "x" * 5001}), "prompt")  # --max-prompt-chars
    assert "5001 characters" in err["message"]
    status, body = call(server, "POST", "/tokenize", {"model": "nope", "prompt": "a"})
    assert status == 404 and body["error"]["param"] == "model"


def test_tokenize_reports_prompts_longer_than_the_context_without_refusing(server):
    text = "x " * 2400  # within --max-prompt-chars, beyond max_model_len tokens
    status, tok = call(server, "POST", "/tokenize", {"prompt": text})
    assert status == 200 and tok["count"] > tok["max_model_len"] == MAX_MODEL_LEN


# ---- /version, /v1/models, auth -----------------------------------------------------------------------------------

def test_version_is_the_package_version(server):
    assert call(server, "GET", "/version") == (200, {"version": metadata.version("jaxpaged")})


def test_models_list_max_model_len(client):
    (card,) = client.models.list().data
    assert card.id == MODEL and card.model_extra["max_model_len"] == MAX_MODEL_LEN


@pytest.mark.parametrize("method,path", [("POST", "/tokenize"), ("POST", "/detokenize"), ("GET", "/version"),
                                         ("GET", "/pool")])
def test_new_routes_need_the_key(server, method, path):
    status, body = call(server, method, path, {"prompt": "a", "tokens": [1]} if method == "POST" else None,
                        auth=False)
    assert status == 401 and body["error"]["code"] == "missing_api_key"


def test_the_page_is_served_without_the_key_and_holds_no_data(server):
    status, body = request("GET", server.url + "/")
    page = body["raw"]
    assert status == 200 and page.startswith("<!doctype html>") and "/v1/chat/completions" in page and "/pool" in page
    assert KEY not in page and MODEL not in page


# ---- echo ---------------------------------------------------------------------------------------------------------

def test_echo_prepends_the_prompt_streamed_and_not(client, tokenizer):
    kw = dict(model=MODEL, max_tokens=8, temperature=0, extra_body={"ignore_eos": True})
    plain = client.completions.create(prompt=PROMPT, **kw).choices[0].text
    echoed = client.completions.create(prompt=PROMPT, echo=True, **kw)
    assert echoed.choices[0].text == PROMPT + plain
    streamed = "".join(c.choices[0].text for c in client.completions.create(prompt=PROMPT, echo=True, stream=True,
                                                                             **kw) if c.choices)
    assert streamed == PROMPT + plain
    # a token prompt is echoed as its decoded text
    ids = tokenizer(PROMPT)["input_ids"]
    by_ids = client.completions.create(prompt=ids, echo=True, **kw).choices[0].text
    assert by_ids == tokenizer.decode(ids, skip_special_tokens=False) + plain


def test_echo_with_logprobs_scores_the_prompt(client, tokenizer):
    """OpenAI's legacy scoring (what lm-eval-harness's loglikelihood asks): echo with logprobs gives every prompt
    token its log-prob given the ones before it (the first has none), then the completion's; position j's top
    tokens are those a completion of the first j tokens ranks first, streamed or not."""
    ids = tokenizer(PROMPT)["input_ids"]
    n = len(ids)
    kw = dict(model=MODEL, max_tokens=1, temperature=0, logprobs=2)
    lp = client.completions.create(prompt=ids, echo=True, **kw).choices[0].logprobs
    assert len(lp.tokens) == n + 1 and lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    assert all(v <= 0 for v in lp.token_logprobs[1:])
    for j in (1, n // 2, n - 1):
        alone = client.completions.create(prompt=ids[:j], **kw).choices[0].logprobs.top_logprobs[0]
        assert alone.keys() <= lp.top_logprobs[j].keys()
        assert all(abs(lp.top_logprobs[j][t] - v) < 1e-3 for t, v in alone.items()), (j, alone, lp.top_logprobs[j])
    plain = client.completions.create(prompt=ids, **kw).choices[0].logprobs
    assert lp.tokens[n:] == plain.tokens and abs(lp.token_logprobs[n] - plain.token_logprobs[0]) < 1e-3
    streamed = [c for c in client.completions.create(prompt=ids, echo=True, stream=True, **kw) if c.choices]
    assert streamed[0].choices[0].logprobs.token_logprobs[:n] == lp.token_logprobs[:n]


def test_vllm_prompt_logprobs_over_http(server, tokenizer):
    """vLLM's prompt_logprobs field: per prompt position None (the first) or {token id: {logprob, rank,
    decoded_token}}, the prompt's token first, then the top k ranked 1..k; the same log-probs as echo with logprobs
    gives, whose top it does not widen. Chat puts them on the response, completions on each choice."""
    ids = tokenizer(PROMPT)["input_ids"]
    n = len(ids)
    body = {"model": MODEL, "prompt": ids, "max_tokens": 1, "temperature": 0}
    status, out = call(server, "POST", "/v1/completions", {**body, "prompt_logprobs": 3, "echo": True, "logprobs": 1})
    assert status == 200, out
    choice = out["choices"][0]
    got, legacy = choice["prompt_logprobs"], choice["logprobs"]
    assert len(got) == n and got[0] is None and legacy["token_logprobs"][0] is None
    for j in range(1, n):
        entries = list(got[j].items())
        assert entries[0][0] == str(ids[j]) and entries[0][1]["decoded_token"] == tokenizer.decode([ids[j]])
        assert abs(entries[0][1]["logprob"] - legacy["token_logprobs"][j]) < 1e-6
        ranks = sorted(e["rank"] for t, e in entries if t != str(ids[j]) or e["rank"] <= 3)
        assert ranks == [1, 2, 3] and entries[0][1]["rank"] >= 1
        assert entries[0][1]["rank"] == 1 + sum(e["logprob"] > entries[0][1]["logprob"] + 1e-6 for _, e in entries
                                                if e["rank"] <= 3) or entries[0][1]["rank"] > 3
        assert len(legacy["top_logprobs"][j]) <= 2  # logprobs=1: the top one and the prompt's token
    status, chat = call(server, "POST", "/v1/chat/completions", {"model": MODEL, "max_tokens": 1, "prompt_logprobs": 0,
                                                                 "messages": CHAT})
    assert status == 200, chat
    scored = chat["prompt_logprobs"]
    assert len(scored) == chat["usage"]["prompt_tokens"] and scored[0] is None
    assert all(len(e) == 1 and next(iter(e.values()))["rank"] >= 1 for e in scored[1:])  # k = 0: the token alone
    assert "prompt_logprobs" not in chat["choices"][0]


def test_vllm_return_token_ids_and_tokens_as_token_ids(server, client, tokenizer):
    """vLLM's return_token_ids: the prompt's ids (per completions choice; on the chat response) and each choice's
    generated ids, whole or, streamed, the prompt's in the first chunk and each chunk's new ids (adding up to the
    whole); return_tokens_as_token_ids writes log-probs' tokens as `token_id:<id>`."""
    ids = tokenizer(PROMPT)["input_ids"]
    kw = dict(model=MODEL, max_tokens=6, temperature=0, extra_body={"return_token_ids": True, "ignore_eos": True})
    choice = client.completions.create(prompt=ids, **kw).choices[0]
    assert choice.prompt_token_ids == ids and len(choice.token_ids) == 6
    assert tokenizer.decode(choice.token_ids, skip_special_tokens=True).startswith(choice.text)  # (a split UTF-8
    # character at the end is not text yet)
    chunks = [c.choices[0] for c in client.completions.create(prompt=ids, stream=True, **kw) if c.choices]
    assert chunks[0].prompt_token_ids == ids and all(getattr(c, "prompt_token_ids", None) is None for c in chunks[1:])
    assert [t for c in chunks for t in c.token_ids] == choice.token_ids

    chat = client.chat.completions.create(messages=CHAT, **kw)
    status, tok = call(server, "POST", "/tokenize", {"model": MODEL, "messages": CHAT})
    assert status == 200 and chat.prompt_token_ids == tok["tokens"]
    assert tokenizer.decode(chat.choices[0].token_ids, skip_special_tokens=True).startswith(
        chat.choices[0].message.content)
    stream = list(client.chat.completions.create(messages=CHAT, stream=True, **kw))
    assert stream[0].prompt_token_ids == tok["tokens"]
    assert [t for c in stream for ch in c.choices for t in (getattr(ch, "token_ids", None) or [])] == \
        chat.choices[0].token_ids

    as_ids = {"return_tokens_as_token_ids": True, "ignore_eos": True}
    lp = client.completions.create(prompt=ids, model=MODEL, max_tokens=4, temperature=0, logprobs=2,
                                   extra_body={**as_ids, "return_token_ids": True}).choices[0]
    assert lp.logprobs.tokens == [f"token_id:{t}" for t in lp.token_ids]
    assert all(all(k.startswith("token_id:") for k in top) for top in lp.logprobs.top_logprobs)
    content = client.chat.completions.create(messages=CHAT, model=MODEL, max_tokens=4, temperature=0, logprobs=True,
                                             top_logprobs=2, extra_body=as_ids).choices[0].logprobs.content
    assert all(c.token.startswith("token_id:") and all(t.token.startswith("token_id:") for t in c.top_logprobs)
               for c in content)
    for bad in ({"return_token_ids": "yes"}, {"return_tokens_as_token_ids": 1}):
        assert_400(call(server, "POST", "/v1/completions", {"model": MODEL, "prompt": "hi", **bad}), next(iter(bad)))
    assert_idle(server.url, AUTH)


# ---- /pool --------------------------------------------------------------------------------------------------------

def pool(server, **query) -> dict:
    qs = "&".join(f"{k}={v}" for k, v in query.items())
    status, view = call(server, "GET", "/pool" + (f"?{qs}" if qs else ""))
    assert status == 200, view
    return view


def test_pool_shows_a_running_request_then_its_cached_prefix(server, client):
    before = pool(server)
    total = before["device"]["num_blocks"]
    assert sum(before["device"]["counts"].values()) == total and before["requests"] == []
    stream = client.completions.create(model=MODEL, prompt=PROMPT * 4, max_tokens=340, n=2, temperature=1.0,
                                       stream=True, extra_body={"ignore_eos": True})
    first = next(iter(stream))
    deadline, seen = time.time() + 60, None
    while time.time() < deadline and seen is None:
        view = pool(server)
        mine = [i for i, r in enumerate(view["requests"]) if r["id"] == first.id]
        if mine and view["device"]["counts"]["shared"] > 0:
            seen = view, mine[0]
    assert seen is not None, "the request never showed in /pool"
    view, index = seen
    d = view["device"]
    owned = [s for s, o in zip(d["state"], d["owner"], strict=True) if o == index]
    assert owned and set(owned) <= {1, 2}  # used or shared
    assert view["requests"][index]["num_seqs"] == 2 and view["num_running"] >= 2
    for _ in stream:  # let it finish
        pass
    deadline = time.time() + 30
    while time.time() < deadline:
        after = pool(server)
        if not after["requests"]:
            break
        time.sleep(0.1)
    counts = after["device"]["counts"]
    assert after["requests"] == [] and counts["used"] == counts["shared"] == 0
    assert counts["cached"] > 0 and counts["free"] + counts["cached"] == total


def test_pool_is_bounded_and_max_cells_is_checked(server):
    view = pool(server, max_cells=5)
    d = view["device"]
    assert len(d["state"]) <= 5 and d["downsampled"] and d["blocks_per_cell"] * len(d["state"]) >= d["num_blocks"]
    for bad in ("0", "4097", "x", "-1", "1.5", "9" * 4301, "0" * 10 + "5"):
        assert_400(call(server, "GET", f"/pool?max_cells={bad}"), "max_cells")


def test_many_pool_watchers_do_not_stall_a_stream(server, client):
    """8 clients polling /pool as fast as they can (they share one view per 0.2 s, drawn between steps) while a
    stream runs: every poll answers and the stream completes."""
    stop = threading.Event()
    polls = []

    def watch():
        while not stop.is_set():
            polls.append(call(server, "GET", "/pool")[0])

    threads = [threading.Thread(target=watch) for _ in range(8)]
    for t in threads:
        t.start()
    try:
        out = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=64, temperature=0,
                                        extra_body={"ignore_eos": True}, timeout=60)
    finally:
        stop.set()
        for t in threads:
            t.join(30)
    assert out.usage.completion_tokens == 64 and polls and set(polls) == {200}
    assert post(f"{server.url}/v1/completions", {"prompt": "a"})[0] == 401  # still keyed (sanity)

