"""Multi-host serving on one machine: two `server.py` processes joined by jax.distributed (gloo collectives), each
with 2 fake CPU devices (XLA_FLAGS set in the child's environment before JAX starts), one tensor-parallel mesh of 4.

Tolerance: the same text as one process with 4 fake devices at tp 4 with the same options (greedy; seeded sampling
with n=2, which copies a shared partial block: a COPY_BLOCKS op; three long greedy generations in a 12-block pool,
which preempt by swapping: READ_BLOCKS and WRITE_BLOCKS ops); chosen tokens' log-probs within 1e-4 (float32; the
reductions of the two runs may be ordered differently).
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request

import numpy as np
import pytest

from jaxpaged.parallel import multihost
from jaxpaged.parallel.multihost import DistributedConfig, Header, Op
from tests import ROOT

pytestmark = pytest.mark.slow  # starts processes or loads a real model: docs/testing.md

LOGPROB_TOL = 1e-4
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


def needs_default_model():
    from jaxpaged.loader import default_model_path

    try:
        default_model_path()
    except FileNotFoundError as e:
        pytest.skip(str(e))


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


def start_pair(log_dir, heartbeat_s: int = 100, extra: list[str] | None = None,
               command: tuple[str, ...] = ("server.py",)) -> tuple[Proc, Proc, int]:
    """Process 0 (serving on a free port) and process 1, joined through a free coordinator port given by the
    environment; the other options are flags."""
    coordinator, http = free_port(), free_port()
    procs = []
    for pid in (0, 1):
        env = {"JAXPAGED_COORDINATOR_ADDRESS": f"127.0.0.1:{coordinator}", "JAXPAGED_NUM_PROCESSES": "2",
               "JAXPAGED_PROCESS_ID": str(pid)}
        args = [*ENGINE, "--distributed-heartbeat-timeout", str(heartbeat_s), *(extra or [])]
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


REQUESTS = [
    {"prompt": ["The capital of France is", "def fibonacci(n):"], "max_tokens": 12, "temperature": 0,
     "logprobs": 1},
    {"prompt": "Once upon a time", "max_tokens": 10, "temperature": 0.8, "seed": 3, "n": 2, "logprobs": 1},
    # 3 x 5 blocks do not fit 11: sequences are swapped out to the host and back
    {"prompt": ["Tell me about dogs.", "List the planets.", "Why is the sky blue?"], "max_tokens": 48,
     "temperature": 0, "ignore_eos": True, "logprobs": 1},
]


def stats(port: int) -> dict:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/stats", timeout=10) as r:
        return json.loads(r.read())


@pytest.fixture(scope="module")
def servers(tmp_path_factory):
    """Two processes x 2 devices at tp 4, and one process with 4 devices at tp 4 (the reference)."""
    needs_default_model()
    log_dir = tmp_path_factory.mktemp("multihost")
    p0, p1, port = start_pair(log_dir)
    ref_port = free_port()
    ref = Proc("single", log_dir, 4, [*SERVER, "--port", str(ref_port)], {})
    try:
        wait_healthy(port, [p0, p1])
        wait_healthy(ref_port, [ref])
        yield p0, p1, port, ref, ref_port
    finally:
        for p in (p0, p1, ref):
            p.kill()


def test_two_processes_generate_what_one_process_generates(servers):
    _, _, port, _, ref_port = servers
    for body in REQUESTS:
        got, want = complete(port, body), complete(ref_port, body)
        assert [c["text"] for c in got["choices"]] == [c["text"] for c in want["choices"]], body
        assert all(c["text"] for c in got["choices"])
        for a, b in zip(got["choices"], want["choices"], strict=True):
            assert a["logprobs"]["tokens"] == b["logprobs"]["tokens"]
            diff = np.abs(np.asarray(a["logprobs"]["token_logprobs"]) - np.asarray(b["logprobs"]["token_logprobs"]))
            assert diff.max() < LOGPROB_TOL
    for p in (port, ref_port):
        assert stats(p)["preemptions_swap"] > 0


def test_sigterm_to_process_0_stops_both_processes_cleanly(servers):
    p0, p1, port, _, _ = servers
    for body in REQUESTS[1:]:  # steps, a copy of the shared partial block, swaps out and in, before the stop
        complete(port, body)
    p0.popen.send_signal(signal.SIGTERM)
    assert p0.wait(60) == 0, p0.text()[-3000:]
    assert p1.wait(60) == 0, p1.text()[-3000:]
    counts = {op: int(n) for n, op in (item.split() for item in p1.text().split("worker done: ")[1].splitlines()[0]
                                       .split(", "))}
    assert counts["STEP"] > 0 and counts["COPY_BLOCKS"] > 0 and counts["STOP"] == 1
    assert counts["READ_BLOCKS"] > 0 and counts["WRITE_BLOCKS"] > 0


@pytest.mark.parametrize("when", ["idle", "in_a_request"])
def test_process_0_exits_with_an_error_when_process_1_dies(tmp_path, when):
    """SIGKILL to process 1. Idle: the coordination service misses its heartbeats and ends process 0 (non-zero, the
    reason in its log). In a request: the step's collective fails at once, the request gets an error, the engine is
    dead, and the heartbeat timeout ends process 0 as well. Within the heartbeat timeout plus detection, not never."""
    import threading

    needs_default_model()
    p0, p1, port = start_pair(tmp_path, heartbeat_s=5)
    try:
        wait_healthy(port, [p0, p1])
        complete(port, REQUESTS[0])
        answer: list = []
        if when == "in_a_request":
            def long_request():
                try:
                    answer.append(complete(port, {"prompt": "Count:", "max_tokens": 120, "ignore_eos": True}))
                except (urllib.error.URLError, OSError) as e:  # HTTP 500, or the connection ends with process 0
                    answer.append(e)

            thread = threading.Thread(target=long_request, daemon=True)
            thread.start()
            time.sleep(3)  # some decode steps in
        t0 = time.monotonic()
        p1.popen.kill()
        rc = p0.wait(KILL_BOUND_S)
        elapsed = time.monotonic() - t0
        log = p0.text()
        assert rc != 0, log[-3000:]
        assert "heartbeat" in log or "unhealthy" in log, log[-3000:]
        if when == "in_a_request":
            thread.join(30)
            assert len(answer) == 1 and isinstance(answer[0], Exception), answer  # an error, not 120 tokens
        print(f"{when}: process 0 exited {rc} {elapsed:.1f} s after process 1 was killed (heartbeat timeout 5 s)")
    finally:
        p0.kill()
        p1.kill()


def test_process_1_exits_with_an_error_when_process_0_dies(tmp_path):
    """SIGKILL to process 0: process 1, waiting for the next op in a collective, gets the error and exits 1."""
    needs_default_model()
    p0, p1, port = start_pair(tmp_path, heartbeat_s=5)
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
    p0, p1, _ = start_pair(tmp_path, command=cli)
    try:
        assert p0.wait(STARTUP_S) == 0, p0.text()[-3000:]
        assert p1.wait(60) == 0, p1.text()[-3000:]
        assert "### The capital of France is\n" in p0.text() and "[6 tokens in" in p0.text()
        assert "### " not in p1.text() and "worker done: 6 STEP" in p1.text()  # one prefill, then 5 decode steps
    finally:
        p0.kill()
        p1.kill()


def test_a_mesh_must_span_every_process(tmp_path):
    """tensor_parallel_size 2 with two processes of 2 devices would leave process 1 out: both refuse before loading
    the model, naming the field and the size to use. Process 1 may instead be ended by the coordination service
    when process 0 (its host) has already left; either way it exits non-zero and does not hang."""
    needs_default_model()
    p0, p1, _ = start_pair(tmp_path, extra=["--tensor-parallel-size", "2"])
    message = "tensor_parallel_size=2: with 2 processes the mesh spans every device, so use tensor_parallel_size=4"
    try:
        assert p0.wait(STARTUP_S) == 2, p0.text()[-3000:]
        assert message in p0.text() and "loading" not in p0.text().split(message)[0].split("global devices")[-1]
        rc = p1.wait(STARTUP_S)
        assert (rc == 2 and message in p1.text()) or (rc != 0 and "coordination service" in p1.text()), \
            p1.text()[-3000:]
    finally:
        p0.kill()
        p1.kill()


# ---- options ----------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("kwargs,message", [
    (dict(num_processes=2, process_id=2, coordinator_address="h:1"),
     r"distributed_process_id=2 must be in \[0, distributed_num_processes=2\)"),
    (dict(num_processes=2, process_id=-1, coordinator_address="h:1"), r"distributed_process_id=-1 must be in"),
    (dict(num_processes=0), r"distributed_num_processes=0 must be >= 1"),
    (dict(num_processes=2, process_id=1), r"distributed_coordinator_address is required"),
    (dict(num_processes=2, coordinator_address="10.0.0.1"), r"distributed_coordinator_address='10.0.0.1' must be "
                                                            r"host:port"),
    (dict(heartbeat_timeout=0), r"distributed_heartbeat_timeout=0 must be >= 1"),
])
def test_bad_process_options_name_the_field(kwargs, message):
    with pytest.raises(ValueError, match=message):
        DistributedConfig(**kwargs)


def test_engine_options_check_the_processes_before_loading():
    from jaxpaged.engine.setup import EngineConfig

    with pytest.raises(ValueError, match=r"distributed_process_id=3 must be in \[0, distributed_num_processes=2\)"):
        EngineConfig(distributed_num_processes=2, distributed_process_id=3, distributed_coordinator_address="h:1")


def test_environment_fills_unset_options():
    env = {"JAXPAGED_COORDINATOR_ADDRESS": "10.0.0.1:1234", "JAXPAGED_NUM_PROCESSES": "4",
           "JAXPAGED_PROCESS_ID": "3"}
    config = DistributedConfig.resolve(None, None, None, 10, 60, environ=env)
    assert (config.coordinator_address, config.num_processes, config.process_id) == ("10.0.0.1:1234", 4, 3)
    assert DistributedConfig.resolve(None, 2, 1, 10, 60, environ=env).num_processes == 2  # an option wins
    assert not DistributedConfig.resolve(None, None, None, 10, 60, environ={}).enabled
    with pytest.raises(ValueError, match=r"\$JAXPAGED_PROCESS_ID='x' must be an integer"):
        DistributedConfig.resolve(None, None, None, 10, 60, environ={**env, "JAXPAGED_PROCESS_ID": "x"})
    with pytest.raises(ValueError, match="distributed_process_id=4 must be in"):
        DistributedConfig.resolve(None, None, None, 10, 60, environ={**env, "JAXPAGED_PROCESS_ID": "4"})


def test_server_refuses_a_bad_process_id_before_loading(tmp_path):
    p = Proc("bad", tmp_path, 1, [*SERVER, "--distributed-num-processes", "2", "--distributed-process-id", "2",
                                  "--distributed-coordinator-address", "127.0.0.1:1"], {})
    try:
        assert p.wait(60) == 2
        assert "distributed_process_id=2 must be in [0, distributed_num_processes=2)" in p.text()
    finally:
        p.kill()


def test_an_engine_asked_for_processes_needs_them_joined():
    """LLM(distributed_num_processes=2) in a process that never called jaxpaged.parallel.multihost.initialize."""
    from jaxpaged import LLM

    with pytest.raises(ValueError, match="call jaxpaged.parallel.multihost.initialize"):
        LLM(distributed_num_processes=2, distributed_coordinator_address="127.0.0.1:1")


def test_a_failed_op_across_processes_kills_the_engine_even_with_its_pool_intact():
    """Single process, a runner that says it is multi-host: a step that raises (a collective failing) leaves the
    processes out of step, so the engine is dead, not just the step's requests failed."""
    from jaxpaged import SamplingParams
    from jaxpaged.engine.llm_engine import Engine, EngineDeadError
    from jaxpaged.engine.setup import EngineConfig
    from tests.tiny import random_params, tiny_config

    config = tiny_config()
    engine = Engine(config, random_params(config), None,
                    EngineConfig(dtype="float32", max_num_seqs=4, max_num_batched_tokens=64, max_model_len=64,
                                 block_size=8, num_blocks=40, precompile=False, show_progress=False))

    def collective_fails(inputs, rows):
        raise RuntimeError("UNKNOWN: Gloo all-reduce failed: Connection closed by peer")

    engine.runner.multihost = True
    engine.runner.dispatch = collective_fails
    engine.add_request("r", [3, 4, 5], SamplingParams(max_tokens=4))
    with pytest.raises(EngineDeadError, match="a device op failed across processes: RuntimeError: UNKNOWN: Gloo"):
        engine.step()
    assert engine.runner.pool_alive()  # dead all the same
    with pytest.raises(EngineDeadError):
        engine.step()


# ---- the wire -----------------------------------------------------------------------------------------------------


def test_a_step_crosses_the_wire_unchanged():
    import ml_dtypes

    from jaxpaged.worker.input_batch import StepInputs, StepLayout

    layout = StepLayout(32, 4, 8, 16, None)
    buf = layout.empty()
    layout.view(buf, "token_ids")[:5] = [5, 6, 7, 8, 9]
    inputs = StepInputs(layout, buf, want_logprobs=True)
    meta, arrays = multihost.step_to_wire(inputs)
    header, payload = multihost.pack(Op.STEP, arrays, meta)
    decoded = Header.decode(header.encode())
    assert decoded == header and payload.dtype == np.int32 and payload.size & (payload.size - 1) == 0
    got = multihost.step_from_wire(decoded.meta, multihost.unpack(decoded, payload))
    assert got.layout == layout and got.want_logprobs and got.extras == {}
    assert np.array_equal(got.buf, buf)

    # a decode step of 64 rows, vocabulary 49152, with one constrained row: its bitmask goes whole (384 KiB)
    decode = StepLayout(64, 64, 128, 1, 512)
    bitmask = np.full((64, 1536), -1, np.int32)
    bitmask[1, 5] = 0
    inputs = StepInputs(decode, decode.empty(), {"bitmask": bitmask})
    meta, arrays = multihost.step_to_wire(inputs)
    header, payload = multihost.pack(Op.STEP, arrays, meta)
    assert payload.nbytes <= 2**20
    got = multihost.step_from_wire(header.meta, multihost.unpack(Header.decode(header.encode()), payload))
    assert got.layout == decode and list(got.extras) == ["bitmask"] and np.array_equal(got.extras["bitmask"], bitmask)
    # without it, the step is its buffer alone (mostly block tables)
    plain = multihost.pack(Op.STEP, *reversed(multihost.step_to_wire(StepInputs(decode, decode.empty()))))[1]
    assert plain.nbytes <= 2**16

    k = np.random.default_rng(0).standard_normal((2, 3, 4, 1, 8)).astype(ml_dtypes.bfloat16)
    header, payload = multihost.pack(Op.WRITE_BLOCKS, (np.arange(3, dtype=np.int32), k, k))
    idx, k2, _ = multihost.unpack(Header.decode(header.encode()), payload)
    assert idx.tolist() == [0, 1, 2] and k2.dtype == k.dtype and np.array_equal(k2, k)


def test_too_many_arrays_for_the_header_is_an_error():
    header = Header(Op.STEP, leaves=tuple(("int32", (1,), False) for _ in range(40)))
    with pytest.raises(ValueError, match="40 arrays do not fit"):
        header.encode()


def test_only_process_0_schedules():
    with pytest.raises(RuntimeError, match="process 0 schedules"):
        multihost.WorkerLoop(runner=None)
