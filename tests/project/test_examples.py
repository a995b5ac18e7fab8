"""Every script in examples/ runs, each in its own process as a newcomer would run it, on a tiny random-weight model
(the offline one also on the default SmolLM2, slow) with a few tokens; each test checks what its example claims."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests import ROOT
from tests.default_model import default_model
from tests.server.harness import free_port, get
from tests.tiny_hf import make_tiny_hf_model

pytestmark = pytest.mark.slow  # starts processes or loads a real model: docs/testing.md

EXAMPLES = ROOT / "examples"
OUTPUT = re.compile(r"^'(?P<prompt>.*)' -> .* \[(?P<n>\d+) tokens, (?P<reason>stop|length)\]$", re.MULTILINE)


def env() -> dict:
    # This checkout's jaxpaged, wherever the interpreter's installed copy points.
    return {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}


def run_example(name: str, *args: str, timeout: float = 300) -> str:
    result = subprocess.run([sys.executable, str(EXAMPLES / name), *args], cwd=ROOT, env=env(), capture_output=True,
                            text=True, timeout=timeout)
    assert result.returncode == 0, f"{name} failed:\n{result.stdout[-2000:]}\n{result.stderr[-4000:]}"
    return result.stdout


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> str:
    return make_tiny_hf_model(tmp_path_factory.mktemp("tiny_model"), "llama")


def test_every_example_has_a_test():
    tested = set(re.findall(r'"(\w+\.py)"', Path(__file__).read_text()))
    assert {p.name for p in EXAMPLES.glob("*.py")} <= tested


def _check_batch_output(out: str, max_tokens: int) -> None:
    sections = out.split("--- ")[1:]
    assert [s.splitlines()[0] for s in sections] == ["greedy", "sampled"], out
    for section in sections:
        rows = list(OUTPUT.finditer(section))
        assert [r["prompt"] for r in rows] == ["The capital of France is", "Here is a short poem about the sea:",
                                               "def fibonacci(n):", "The three primary colours are"], section
        assert all(1 <= int(r["n"]) <= max_tokens and (r["reason"] == "stop" or int(r["n"]) == max_tokens)
                   for r in rows), section
    assert re.search(r"KV pool: \d+ blocks of 16 tokens", out), out


def test_offline_generate_on_a_tiny_model(model_dir):
    _check_batch_output(run_example("offline_generate.py", "--model", model_dir, "--max-tokens", "4"), 4)


def test_offline_generate_on_the_default_model():
    """As a newcomer runs it: no --model, the SmolLM2 GGUF installed by pip (converted once for the suite)."""
    default_model()
    _check_batch_output(run_example("offline_generate.py", "--max-tokens", "8"), 8)


def test_chat_answers_each_conversation_and_the_follow_up_reuses_the_prefix(model_dir):
    out = run_example("chat.py", "--model", model_dir, "--max-tokens", "4")
    assert re.findall(r"^user: (.*)$", out, re.MULTILINE) == [
        "What is the tallest mountain on Earth?", "Give me one tip for writing clear Python.", "And how high is it?"]
    assert len(re.findall(r"^assistant: ", out, re.MULTILINE)) == 3
    cached = int(re.search(r"served from the prefix cache: (\d+)", out)[1])
    assert cached >= 16 and cached % 16 == 0, out  # whole blocks of the first turn's prompt


def test_bring_your_own_model_matches_its_dense_forward():
    out = run_example("bring_your_own_model.py")
    rows = re.findall(r"^prompt \[.*\] -> \[(.*)\] \(dense forward agrees: (\w+)\)$", out, re.MULTILINE)
    assert len(rows) == 2 and all(len(tokens.split(",")) == 8 and agrees == "True" for tokens, agrees in rows), out


def test_tensor_parallel_runs_over_two_fake_cpu_devices(model_dir):
    out = run_example("tensor_parallel.py", "--model", model_dir, "--max-tokens", "4")
    assert "devices: [CpuDevice(id=0), CpuDevice(id=1)]" in out, out
    assert "the KV pool lives on: ['cpu:0', 'cpu:1']" in out, out
    assert len(re.findall(r"^'.*' -> .+$", out, re.MULTILINE)) == 2, out


def test_openai_client_streams_and_gets_json_that_fits_the_schema(model_dir, tmp_path):
    """The example against a server started as `python -m jaxpaged.entrypoints.openai.api_server`."""
    port = free_port()
    log = open(tmp_path / "server.log", "w")  # noqa: SIM115 (closed below)
    server = subprocess.Popen(
        [sys.executable, "-m", "jaxpaged.entrypoints.openai.api_server", "--model", model_dir, "--port", str(port),
         "--dtype", "float32", "--no-precompile", "--max-model-len", "512", "--kv-cache-memory", "8MiB"],
        cwd=ROOT, env=env(), stdout=log, stderr=subprocess.STDOUT)
    try:
        deadline = time.time() + 240
        while True:
            assert server.poll() is None and time.time() < deadline, (tmp_path / "server.log").read_text()[-3000:]
            try:
                if get(f"http://127.0.0.1:{port}/health")[0] == 200:
                    break
            except OSError:
                time.sleep(0.5)
        out = run_example("openai_client.py", "--base-url", f"http://127.0.0.1:{port}/v1", "--max-tokens", "6")
    finally:
        server.send_signal(signal.SIGTERM)
        try:
            server.wait(30)
        except subprocess.TimeoutExpired:
            server.kill()
            server.wait()
        log.close()
    streamed = re.search(r"^streamed: (.*)\nstructured: ", out, re.MULTILINE | re.DOTALL)
    assert streamed and streamed[1], out  # some text arrived, chunk by chunk
    city = json.loads(re.search(r"^structured: (.*)$", out, re.MULTILINE)[1])
    assert sorted(city) == ["city", "country", "population_millions"], city
    assert isinstance(city["city"], str) and len(city["city"]) <= 24
    assert isinstance(city["country"], str) and len(city["country"]) <= 24
    assert type(city["population_millions"]) is int and 0 <= city["population_millions"] <= 50
