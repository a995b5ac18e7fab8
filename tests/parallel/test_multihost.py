"""Multi-host serving on one machine: two `server.py` processes joined by jax.distributed (gloo collectives), each
with 2 fake CPU devices (XLA_FLAGS set in the child's environment before JAX starts), one tensor-parallel mesh of 4.

Tolerance: the same text as one process with 4 fake devices at tp 4 with the same options (greedy; seeded sampling
with n=2, which copies a shared partial block: a COPY_BLOCKS op; three long greedy generations in a 12-block pool,
which preempt by swapping: READ_BLOCKS and WRITE_BLOCKS ops); chosen tokens' log-probs within 1e-4 (float32; the
reductions of the two runs may be ordered differently). Processes that die, peers that never come and the CLI
across processes: test_multihost_lifecycle.py.
"""

from __future__ import annotations

import signal

import numpy as np
import pytest

from jaxpaged.parallel import multihost
from jaxpaged.parallel.multihost import DistributedConfig, Header, Op
from tests.parallel.multihost_procs import (
    REQUESTS,
    SERVER,
    STARTUP_S,
    Proc,
    complete,
    free_port,
    start_pair,
    stats,
    tiny_model,
    wait_healthy,
)

pytestmark = pytest.mark.slow  # starts processes or loads a real model: docs/testing.md

LOGPROB_TOL = 1e-4

@pytest.fixture(scope="module")
def servers(tmp_path_factory):
    """Two processes x 2 devices at tp 4, and one process with 4 devices at tp 4 (the reference)."""
    log_dir = tmp_path_factory.mktemp("multihost")
    model = tiny_model(log_dir / "model")
    p0, p1, port = start_pair(log_dir, model)
    ref_port = free_port()
    ref = Proc("single", log_dir, 4, [*SERVER, "--port", str(ref_port), "--model", model], {})
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
            got_lp, want_lp = a["logprobs"]["token_logprobs"], b["logprobs"]["token_logprobs"]
            assert [x is None for x in got_lp] == [x is None for x in want_lp]  # an echoed prompt's first token
            diff = np.abs(np.asarray([x or 0.0 for x in got_lp]) - np.asarray([x or 0.0 for x in want_lp]))
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


def test_a_mesh_must_span_every_process(tmp_path):
    """tensor_parallel_size 2 with two processes of 2 devices would leave process 1 out: both refuse before loading
    the model, naming the field and the size to use. Process 1 may instead be ended by the coordination service
    when process 0 (its host) has already left; either way it exits non-zero and does not hang."""
    p0, p1, _ = start_pair(tmp_path, tiny_model(tmp_path / "model"), extra=["--tensor-parallel-size", "2"])
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
    scoring = StepLayout(32, 4, 8, 16, None, prompt_scores=True)  # prompt_logprobs: its flag and targets cross too
    meta, arrays = multihost.step_to_wire(StepInputs(scoring, scoring.empty()))
    assert multihost.step_from_wire(meta, arrays).layout == scoring

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
