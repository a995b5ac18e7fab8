"""Multi-host processes' lives (two `server.py` or CLI processes joined by jax.distributed, 2 fake CPU devices each):
a process that dies ends the other with an error within the heartbeat timeout, idle or in a request; a process
whose peers never come gives up; the CLI generates across two processes and both exit 0. The servers run a tiny
random model (`tiny_model`); the CLI runs the default model."""

from __future__ import annotations

import json
import time

import pytest

from tests.parallel.multihost_procs import (
    KILL_BOUND_S,
    REQUESTS,
    SERVER,
    STARTUP_S,
    Proc,
    complete,
    free_port,
    needs_default_model,
    start_pair,
    stream_lines,
    tiny_model,
    wait_healthy,
)

pytestmark = pytest.mark.slow  # starts processes or loads a real model: docs/testing.md


@pytest.mark.parametrize("when", ["idle", "in_a_request"])
def test_process_0_exits_with_an_error_when_process_1_dies(tmp_path, when):
    """SIGKILL to process 1. Idle: the coordination service misses its heartbeats and ends process 0 (non-zero, the
    reason in its log). In a request: the step's collective fails at once, the request gets an error, the engine is
    dead, and the heartbeat timeout ends process 0 as well. Within the heartbeat timeout plus detection, not never."""
    import threading

    p0, p1, port = start_pair(tmp_path, tiny_model(tmp_path / "model"), heartbeat_s=5)
    try:
        wait_healthy(port, [p0, p1])
        complete(port, REQUESTS[0])
        lines: list = []
        if when == "in_a_request":  # killed once the first token has streamed: mid-generation
            first_token = threading.Event()
            thread = threading.Thread(target=stream_lines, daemon=True, args=(
                port, {"prompt": "Count:", "max_tokens": 120, "ignore_eos": True}, first_token, lines))
            thread.start()
            assert first_token.wait(60), "no token streamed within 60 s"
        t0 = time.monotonic()
        p1.popen.kill()
        rc = p0.wait(KILL_BOUND_S)
        elapsed = time.monotonic() - t0
        log = p0.text()
        assert rc != 0, log[-3000:]
        assert "heartbeat" in log or "unhealthy" in log, log[-3000:]
        if when == "in_a_request":
            thread.join(30)
            assert not thread.is_alive()
            events = [json.loads(line) for line in lines if isinstance(line, str) and line != "[DONE]"]
            finished = [c for e in events for c in e.get("choices", []) if c.get("finish_reason")]
            # an error event, or the stream cut (an exception, or the connection closed before `data: [DONE]`)
            ended_badly = isinstance(lines[-1], Exception) or any("error" in e for e in events) or "[DONE]" not in lines
            assert not finished and ended_badly, lines[-5:]  # not 120 tokens
        print(f"{when}: process 0 exited {rc} {elapsed:.1f} s after process 1 was killed (heartbeat timeout 5 s)")
    finally:
        p0.kill()
        p1.kill()


def test_process_1_exits_with_an_error_when_process_0_dies(tmp_path):
    """SIGKILL to process 0: process 1, waiting for the next op in a collective, gets the error and exits 1."""
    p0, p1, port = start_pair(tmp_path, tiny_model(tmp_path / "model"), heartbeat_s=5)
    try:
        wait_healthy(port, [p0, p1])
        p0.popen.kill()
        assert p1.wait(KILL_BOUND_S) == 1, p1.text()[-3000:]
        assert "process 0 is gone; this worker stops" in p1.text()
    finally:
        p0.kill()
        p1.kill()


def test_a_process_whose_peers_never_come_exits_with_an_error(tmp_path):
    """Process 0 alone, distributed_initialization_timeout 5 s: jax.distributed gives up (DEADLINE_EXCEEDED while
    registering) and the process ends non-zero, ~10 s here, without loading anything."""
    env = {"JAXPAGED_COORDINATOR_ADDRESS": f"127.0.0.1:{free_port()}", "JAXPAGED_NUM_PROCESSES": "2",
           "JAXPAGED_PROCESS_ID": "0"}
    p = Proc("alone", tmp_path, 2, [*SERVER, "--distributed-initialization-timeout", "5"], env)
    try:
        t0 = time.monotonic()
        assert p.wait(60) != 0
        assert "DEADLINE_EXCEEDED" in p.text() and "loaded in" not in p.text()
        print(f"alone: exited after {time.monotonic() - t0:.1f} s")
    finally:
        p.kill()


def test_the_cli_generates_across_two_processes(tmp_path):
    """`python -m jaxpaged.entrypoints.cli generate` on both processes: process 0 prints the text, both exit 0."""
    needs_default_model()
    cli = ("-m", "jaxpaged.entrypoints.cli", "generate", "--prompt", "The capital of France is", "--raw",
           "--max-tokens", "6")
    p0, p1, _ = start_pair(tmp_path, None, command=cli)
    try:
        assert p0.wait(STARTUP_S) == 0, p0.text()[-3000:]
        assert p1.wait(60) == 0, p1.text()[-3000:]
        assert "### The capital of France is\n" in p0.text() and "[6 tokens in" in p0.text()
        assert "### " not in p1.text() and "worker done: 6 STEP" in p1.text()  # one prefill, then 5 decode steps
    finally:
        p0.kill()
        p1.kill()
