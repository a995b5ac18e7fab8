"""Options of vLLM's server: --reasoning-parser (a thinking model's <think> ... </think> goes to the chat message's
reasoning_content, the rest to its content, the same streamed as whole), --chat-template (a template of one's own; a
request's own is refused) and vLLM's flags that change nothing here (accepted, and start-up says why)."""

from __future__ import annotations

import pytest

from jaxpaged.engine.reasoning import REASONING_PARSERS, reasoning_parser
from tests.server.harness import MODEL, Server, assert_idle, post

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


TEMPLATE = ("{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }}\n{% endfor %}"
            "{% if add_generation_prompt %}[assistant] {% endif %}")


@pytest.fixture(scope="module")
def server(model_dir, tmp_path_factory):
    logs = tmp_path_factory.mktemp("logs")
    (logs / "template.jinja").write_text(TEMPLATE)
    srv = Server(model_dir, logs / "server.log", "--reasoning-parser", "deepseek_r1",
                 "--chat-template", str(logs / "template.jinja"))
    yield srv
    srv.stop()


def test_the_servers_chat_template_is_the_one_given_and_a_requests_own_is_refused(server, tokenizer):
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Think."}]
    status, tok = post(f"{server.url}/tokenize", {"model": MODEL, "messages": messages})
    want = tokenizer("[system] Be brief.\n[user] Think.\n[assistant] ", add_special_tokens=False)["input_ids"]
    assert status == 200 and tok["tokens"] == want, tok
    for path in ("/tokenize", "/v1/chat/completions"):
        status, out = post(f"{server.url}{path}", {"model": MODEL, "messages": messages, "chat_template": TEMPLATE})
        assert status == 400 and out["error"]["param"] == "chat_template", out
    assert_idle(server.url)


def test_a_bad_chat_template_is_refused_naming_the_flag(tokenizer, tmp_path):
    import subprocess
    import sys

    from jaxpaged.chat import check_chat_template, load_chat_template
    from tests import ROOT

    (tmp_path / "t.jinja").write_text(TEMPLATE)
    assert load_chat_template(str(tmp_path / "t.jinja")) == TEMPLATE == load_chat_template(TEMPLATE)
    with pytest.raises(ValueError, match="^--chat-template 'no template' is neither a file nor a Jinja template"):
        load_chat_template("no template")
    for broken in ("{% if %}", "{{ messages[0]['nope'] + 1 }}", "{{ raise_exception('no system role') }}"):
        with pytest.raises(ValueError, match="^the chat template fails on a one-message conversation"):
            check_chat_template(broken, tokenizer)
    run = subprocess.run([sys.executable, str(ROOT / "server.py"), "--chat-template", "no template",
                          "--trust-remote-code", "--enforce-eager"], cwd=ROOT, capture_output=True, text=True,
                         timeout=120)
    assert run.returncode == 2 and "error: --chat-template 'no template'" in run.stderr, run.stderr
    # vLLM's flags without effect here: accepted, each named at start-up with why
    assert "--trust-remote-code changes nothing here: jaxpaged runs no code from a checkpoint" in run.stderr
    assert "--enforce-eager changes nothing here" in run.stderr and "--disable-log-stats" not in run.stderr


def test_vllm_flags_without_effect_are_accepted():
    from jaxpaged.entrypoints.openai.api_server import VLLM_FLAGS_WITHOUT_EFFECT, parse_args

    flags = [f"--{name.replace('_', '-')}" for name in VLLM_FLAGS_WITHOUT_EFFECT]
    args = parse_args([*flags, "--tool-call-parser", "hermes"])
    assert all(getattr(args, name) for name in VLLM_FLAGS_WITHOUT_EFFECT)
    with pytest.raises(SystemExit):  # vLLM's rule: auto tool choice needs a parser
        parse_args(["--enable-auto-tool-choice"])
