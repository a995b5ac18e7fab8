"""vLLM's --reasoning-parser: a thinking model's <think> ... </think> goes to the chat message's reasoning_content,
the rest to its content, the same streamed as whole."""

from __future__ import annotations

import pytest

from jaxpaged.entrypoints.openai.reasoning_parsers import REASONING_PARSERS, reasoning_parser
from tests.server.harness import MODEL, Server, post

OUTPUTS = ["<think>\nweigh it up\n</think>\n\nThe answer is 4.", "plain answer", "weighing</think>answer",
           "  <think>a</think", "<think>never closed", "<thi", "", "\n<think></think>x</think>y", "a </thin b"]


def streamed(parser, text: str, opened: bool) -> tuple[str, str]:
    """What a stream shows when `text` arrives one character at a time: each side's deltas joined, checking that
    neither side ever takes back what it showed."""
    shown = ("", "")
    for i in range(len(text) + 1):
        now = parser.split(text[:i], opened, done=i == len(text))
        assert now[0].startswith(shown[0]) and now[1].startswith(shown[1]), (text, i, shown, now)
        shown = now
    return shown


@pytest.mark.parametrize("name", list(REASONING_PARSERS))
@pytest.mark.parametrize("opened", [False, True])
def test_a_stream_splits_as_the_whole_text_does(name, opened):
    parser = REASONING_PARSERS[name]
    for text in OUTPUTS:
        assert streamed(parser, text, opened) == parser.split(text, opened, done=True), text


def test_what_each_parser_calls_reasoning():
    r1, qwen3 = REASONING_PARSERS["deepseek_r1"], REASONING_PARSERS["qwen3"]
    both = "<think>\nweigh it up\n</think>\n\nThe answer is 4."
    assert r1.split(both, False, True) == qwen3.split(both, False, True) == ("\nweigh it up\n", "\n\nThe answer is 4.")
    assert r1.split("weighing</think>answer", False, True) == ("weighing", "answer")  # <think> was in the prompt
    assert qwen3.split("weighing</think>answer", False, True) == ("", "weighing</think>answer")  # did not think
    assert qwen3.split("weighing</think>answer", True, True) == ("weighing", "answer")  # the prompt opened it
    assert r1.split("never closed", False, True) == ("never closed", "")
    assert r1.split("half </thi", False, False) == ("half ", "")  # held until it is known whether a tag comes
    assert qwen3.opens_in_prompt("<|im_start|>assistant\n<think>\n") and not qwen3.opens_in_prompt("assistant\n")
    assert reasoning_parser(None) is None
    with pytest.raises(ValueError, match="^reasoning_parser='r2'; choose one of deepseek_r1, qwen3"):
        reasoning_parser("r2")


@pytest.fixture(scope="module")
def server(model_dir, tmp_path_factory):
    srv = Server(model_dir, tmp_path_factory.mktemp("logs") / "server.log", "--reasoning-parser", "deepseek_r1")
    yield srv
    srv.stop()


def test_the_server_gives_reasoning_apart_streamed_or_not(server):
    """The tiny model writes no </think>: with deepseek_r1 all of its output is reasoning, the text a completion of
    the same prompt gives; streamed, the reasoning deltas add up to it. A constrained output (a named tool) is the
    constraint's: content, as without a parser."""
    chat = {"model": MODEL, "messages": [{"role": "user", "content": "Think."}], "max_tokens": 8, "temperature": 0,
            "ignore_eos": True}
    status, out = post(f"{server.url}/v1/chat/completions", chat)
    assert status == 200, out
    message = out["choices"][0]["message"]
    status, tok = post(f"{server.url}/tokenize", {"model": MODEL, "messages": chat["messages"]})
    status, plain = post(f"{server.url}/v1/completions", {"model": MODEL, "prompt": tok["tokens"], "max_tokens": 8,
                                                          "temperature": 0, "ignore_eos": True})
    assert message["reasoning_content"] == plain["choices"][0]["text"] and message["content"] == ""
    client = server.client()
    chunks = list(client.chat.completions.create(stream=True, **{k: v for k, v in chat.items() if k != "ignore_eos"},
                                                 extra_body={"ignore_eos": True}))
    deltas = [c.choices[0].delta for c in chunks if c.choices]
    assert "".join(getattr(d, "reasoning_content", None) or "" for d in deltas) == message["reasoning_content"]
    assert not any(d.content for d in deltas)
    tool = {"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {
        "x": {"type": "integer"}}, "required": ["x"]}}}
    status, named = post(f"{server.url}/v1/chat/completions", {**chat, "max_tokens": 20, "tools": [tool],
                                                               "tool_choice": {"type": "function",
                                                                               "function": {"name": "f"}}})
    assert status == 200 and "reasoning_content" not in named["choices"][0]["message"], named
