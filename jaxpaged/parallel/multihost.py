"""Multi-host serving: several processes joined by `jax.distributed`, one tensor-parallel mesh over all their
devices, one SPMD program.

    process 0   scheduler, block manager, server; before each device op its runner (`MultihostRunner`) announces
                the op and its host arrays to the other processes (`StepBroadcaster`)
    process k   `run_worker(runner)`: receive an op, run the same ModelRunner op on its devices, repeat until `stop`

    from jaxpaged import LLM
    from jaxpaged.parallel import multihost
    from jaxpaged.engine.setup import EngineConfig
    options = dict(tensor_parallel_size=8, distributed_coordinator_address="10.0.0.1:1234",
                   distributed_num_processes=2, distributed_process_id=k)
    multihost.initialize(EngineConfig(**options).distributed_config())   # before any other JAX use
    llm = LLM(model, **options)                                             # every process: same weights, same mesh
    if k != 0:
        multihost.run_worker(llm.engine.runner)                           # until process 0 says stop
    else:
        llm.generate(...); multihost.stop_workers(llm.engine.runner)

Every process must enter the same jitted call with the same shapes in the same order: the all-reduces inside a
tensor-parallel step complete only when every device of the mesh takes part. So the only thing that crosses
processes outside the step is what process 0 decided: each op's numpy arrays. They travel by
`jax.experimental.multihost_utils.broadcast_one_to_all` (a psum over every device, process 0 contributing the data),
in two messages: a fixed-size int32 header (op, the op's integers such as a step's layout, each array's dtype and
shape) and one int32 payload holding every array's bytes, padded to a power of two so a few payload shapes are
compiled. A step is its one packed input buffer (`worker.input_batch.StepLayout`; tens of KiB for a decode step of
64 sequences, mostly its block tables), plus a bitmask or seen tokens only when a row needs them; an array of one
repeated value travels as that one value. The sampled tokens a step feeds the next one stay on every process's
devices (each process runs the same steps), so nothing of them crosses processes.

Failure: `jax.distributed` runs a coordination service with heartbeats. If a process dies, a collective in flight
fails at once (gloo on CPU: "Connection closed by peer"), and an idle process is terminated by the coordination
service once the dead one has missed heartbeats for `heartbeat_timeout` seconds
(tests/parallel/test_multihost_lifecycle.py measures it). Nobody waits forever.
"""

from __future__ import annotations

import dataclasses
import enum
import logging
import os
import re

import numpy as np

from jaxpaged.worker.input_batch import EXTRAS, StepInputs, StepLayout, StepRows
from jaxpaged.worker.model_runner import ModelRunner

logger = logging.getLogger(__name__)

ENV = {"coordinator_address": "JAXPAGED_COORDINATOR_ADDRESS", "num_processes": "JAXPAGED_NUM_PROCESSES",
       "process_id": "JAXPAGED_PROCESS_ID"}


@dataclasses.dataclass(frozen=True)
class DistributedConfig:
    """How this process joins the others (EngineConfig's `distributed_*` options, with environment fallbacks).

    coordinator_address: host:port of process 0's coordination service (every process gives the same one).
    num_processes: 1 = a single process (nothing is initialized).
    process_id: this process, in [0, num_processes); 0 schedules and serves.
    heartbeat_timeout: seconds after which a silent process is declared dead and the others are stopped.
    initialization_timeout: seconds the processes have to find each other at start-up.
    """

    coordinator_address: str | None = None
    num_processes: int = 1
    process_id: int = 0
    heartbeat_timeout: int = 100
    initialization_timeout: int = 300

    def __post_init__(self):
        if self.num_processes < 1:
            raise ValueError(f"distributed_num_processes={self.num_processes} must be >= 1")
        if not 0 <= self.process_id < self.num_processes:
            raise ValueError(f"distributed_process_id={self.process_id} must be in [0, distributed_num_processes="
                             f"{self.num_processes}), i.e. 0 to {self.num_processes - 1}")
        for name in ("heartbeat_timeout", "initialization_timeout"):
            if getattr(self, name) < 1:
                raise ValueError(f"distributed_{name}={getattr(self, name)} must be >= 1 second")
        if self.num_processes > 1:
            if not self.coordinator_address:
                raise ValueError(f"distributed_coordinator_address is required with distributed_num_processes="
                                 f"{self.num_processes}: host:port of process 0, the same on every process "
                                 f"(or ${ENV['coordinator_address']})")
            if not re.fullmatch(r"[^\s:]+:\d{1,5}|\[[0-9a-fA-F:]+\]:\d{1,5}", self.coordinator_address):
                raise ValueError(f"distributed_coordinator_address={self.coordinator_address!r} must be host:port, "
                                 "e.g. 10.0.0.1:1234")

    @property
    def enabled(self) -> bool:
        return self.num_processes > 1

    @classmethod
    def resolve(cls, coordinator_address: str | None, num_processes: int | None, process_id: int | None,
                heartbeat_timeout: int, initialization_timeout: int,
                environ: dict[str, str] | None = None) -> DistributedConfig:
        """The options as given, each None one from its environment variable ($JAXPAGED_COORDINATOR_ADDRESS,
        $JAXPAGED_NUM_PROCESSES, $JAXPAGED_PROCESS_ID), else the single-process default."""
        environ = os.environ if environ is None else environ

        def number(name: str, value: int | None, default: int) -> int:
            if value is not None:
                return value
            text = environ.get(ENV[name])
            if text is None or text == "":
                return default
            try:
                return int(text)
            except ValueError:
                raise ValueError(f"${ENV[name]}={text!r} must be an integer (distributed_{name})") from None

        return cls(coordinator_address=coordinator_address or environ.get(ENV["coordinator_address"]) or None,
                   num_processes=number("num_processes", num_processes, 1),
                   process_id=number("process_id", process_id, 0),
                   heartbeat_timeout=heartbeat_timeout, initialization_timeout=initialization_timeout)


def initialize(config: DistributedConfig, cpu_collectives: str | None = "gloo") -> None:
    """Joins the other processes (`jax.distributed.initialize`); call it before any other JAX use. A no-op for one
    process. `cpu_collectives` sets `jax_cpu_collectives_implementation`, a process-wide setting, so only an entry
    point (server.py, the CLI) asks for it; without it, CPU devices of different processes cannot reduce."""
    if not config.enabled:
        return
    import jax

    if cpu_collectives is not None:
        jax.config.update("jax_cpu_collectives_implementation", cpu_collectives)
    logger.info("joining %d processes as process %d (coordinator %s)", config.num_processes, config.process_id,
                config.coordinator_address)
    jax.distributed.initialize(config.coordinator_address, config.num_processes, config.process_id,
                               initialization_timeout=config.initialization_timeout,
                               heartbeat_timeout_seconds=config.heartbeat_timeout)
    logger.info("process %d of %d: %d local / %d global devices", jax.process_index(), jax.process_count(),
                jax.local_device_count(), jax.device_count())


def check_joined(config: DistributedConfig) -> None:
    """The engine's options agree with what this process joined (a ValueError naming the field otherwise)."""
    import jax

    if not config.enabled:
        if jax.process_count() > 1:
            raise ValueError(f"this process is one of {jax.process_count()} (jax.distributed is initialized) but "
                             "distributed_num_processes=1")
        return
    if not jax.distributed.is_initialized():
        raise ValueError(f"distributed_num_processes={config.num_processes}: call "
                         "jaxpaged.parallel.multihost.initialize(config) before any JAX use (server.py and the CLI "
                         "do it from their flags)")
    if (jax.process_count(), jax.process_index()) != (config.num_processes, config.process_id):
        raise ValueError(f"distributed_num_processes={config.num_processes}, distributed_process_id="
                         f"{config.process_id} but jax.distributed joined process {jax.process_index()} of "
                         f"{jax.process_count()}")


def check_mesh_spans_processes(tensor_parallel_size: int) -> None:
    """With several processes every one runs the same program on its devices, so the mesh must span them all: a
    ValueError naming the field and the size to use otherwise (before the model loads, so every process refuses
    at once rather than one of them being ended by the coordination service while it still loads)."""
    import jax

    if jax.process_count() > 1 and tensor_parallel_size != jax.device_count():
        raise ValueError(f"tensor_parallel_size={tensor_parallel_size}: with {jax.process_count()} processes the "
                         f"mesh spans every device, so use tensor_parallel_size={jax.device_count()} "
                         f"({jax.local_device_count()} per process)")


def shutdown() -> None:
    """Leaves the group (a barrier with the other processes) if this process joined one."""
    import jax

    if jax.distributed.is_initialized():
        jax.distributed.shutdown()


# ---- the wire: one header and one payload per op ----------------------------------------------------------------


class Op(enum.IntEnum):
    STEP = 1  # ModelRunner.dispatch: StepInputs
    COPY_BLOCKS = 2  # (src [N], dst [N]) int32
    READ_BLOCKS = 3  # (blocks [N],) int32; the gather is a collective, so every process runs it
    WRITE_BLOCKS = 4  # (blocks [N] int32, k [L, N, BS, Hkv, D], v [L, N, BS, Hkv, D])
    STOP = 5  # no arrays: the worker loop returns


HEADER_LEN = 256  # int32 words: op, payload words, leaf count, META_LEN words, then per leaf dtype + shape
META_LEN = 10  # the op's integers, the last word their count
_FIXED = 3 + META_LEN
MAX_NDIM = 5
_LEAF = 3 + MAX_NDIM  # dtype code, ndim, constant (1: one value repeated, sent once), dims
DTYPES = ("bool", "int8", "uint8", "int16", "uint16", "int32", "uint32", "int64", "uint64", "float16", "bfloat16",
          "float32", "float64", "float8_e4m3fn", "float8_e5m2")
MIN_PAYLOAD_WORDS = 1024


@dataclasses.dataclass(frozen=True)
class Header:
    """What an op carries: the op, up to META_LEN integers of its own (a step's layout and flags) and each array's
    dtype, shape and whether it is one repeated value (sent once), in order."""

    op: Op
    meta: tuple[int, ...] = ()
    payload_words: int = 0
    leaves: tuple[tuple[str, tuple[int, ...], bool], ...] = ()

    def encode(self) -> np.ndarray:
        """[HEADER_LEN] int32."""
        if _FIXED + _LEAF * len(self.leaves) > HEADER_LEN:
            raise ValueError(f"{len(self.leaves)} arrays do not fit a {HEADER_LEN}-word header")
        if len(self.meta) > META_LEN - 1:
            raise ValueError(f"{len(self.meta)} op integers do not fit the header's {META_LEN - 1}")
        out = np.zeros(HEADER_LEN, np.int32)
        out[:3] = int(self.op), self.payload_words, len(self.leaves)
        out[3:3 + len(self.meta)] = self.meta
        out[3 + META_LEN - 1] = len(self.meta)
        for i, (dtype, shape, constant) in enumerate(self.leaves):
            if len(shape) > MAX_NDIM:
                raise ValueError(f"an array of {len(shape)} dimensions exceeds the header's {MAX_NDIM}")
            row = out[_FIXED + _LEAF * i:_FIXED + _LEAF * (i + 1)]
            row[0], row[1], row[2] = DTYPES.index(dtype), len(shape), constant
            row[3:3 + len(shape)] = shape
        return out

    @classmethod
    def decode(cls, words: np.ndarray) -> Header:
        op, payload_words, n = (int(x) for x in words[:3])
        num_meta = int(words[3 + META_LEN - 1])
        meta = tuple(int(x) for x in words[3:3 + num_meta])
        leaves = []
        for i in range(n):
            row = words[_FIXED + _LEAF * i:_FIXED + _LEAF * (i + 1)]
            leaves.append((DTYPES[int(row[0])], tuple(int(d) for d in row[3:3 + int(row[1])]), bool(row[2])))
        return cls(Op(op), meta, payload_words, tuple(leaves))


def _payload_words(nbytes: int) -> int:
    """int32 words of a payload of nbytes: a power of two, at least MIN_PAYLOAD_WORDS."""
    words = max(MIN_PAYLOAD_WORDS, -(-nbytes // 4))
    return 1 << (words - 1).bit_length()


def pack(op: Op, arrays: list | tuple, meta: tuple[int, ...] = ()) -> tuple[Header, np.ndarray]:
    """An op's numpy arrays (and its integers) as (header, payload [words] int32)."""
    leaves = [np.asarray(x) for x in arrays]  # tobytes() is C order
    constant = [x.size > 1 and bool(np.all(x == x.flat[0])) for x in leaves]
    raw = b"".join((x.flat[:1] if c else x).tobytes() for x, c in zip(leaves, constant, strict=True))
    words = _payload_words(len(raw))
    payload = np.zeros(words * 4, np.uint8)
    payload[:len(raw)] = np.frombuffer(raw, np.uint8)
    header = Header(op, tuple(meta), words,
                    tuple((x.dtype.name, x.shape, c) for x, c in zip(leaves, constant, strict=True)))
    return header, payload.view(np.int32)


def unpack(header: Header, payload: np.ndarray) -> list[np.ndarray]:
    """The arrays process 0 packed, each of the header's dtype and shape."""
    import jax.numpy as jnp

    raw = np.asarray(payload).view(np.uint8)
    leaves, offset = [], 0
    for dtype, shape, constant in header.leaves:
        dt = np.dtype(jnp.dtype(dtype))
        if constant:
            leaves.append(np.full(shape, raw[offset:offset + dt.itemsize].view(dt)[0], dt))
            offset += dt.itemsize
            continue
        n = int(np.prod(shape, dtype=np.int64)) * dt.itemsize
        leaves.append(raw[offset:offset + n].view(dt).reshape(shape).copy())
        offset += n
    return leaves


def step_to_wire(inputs: StepInputs) -> tuple[tuple[int, ...], list[np.ndarray]]:
    """A step's (integers, arrays): its layout, which of the sampler's large arrays it has (bit i: EXTRAS[i]), whether
    it wants log-probs, and the arrays."""
    lay = inputs.layout
    present = [e.name for e in EXTRAS if e.name in inputs.extras]
    flags = sum(1 << i for i, e in enumerate(EXTRAS) if e.name in inputs.extras)
    meta = (lay.num_tokens, lay.num_seqs, lay.width, lay.tile_size,
            -1 if lay.decode_blocks is None else lay.decode_blocks, flags, int(inputs.want_logprobs), lay.spec_width,
            int(lay.prompt_scores))
    return meta, [inputs.buf] + [inputs.extras[name] for name in present]


def step_from_wire(meta: tuple[int, ...], arrays: list[np.ndarray]) -> StepInputs:
    t, s, w, tile, blocks, flags, want_logprobs, spec_width, scores = meta
    layout = StepLayout(t, s, w, tile, None if blocks < 0 else blocks, spec_width, prompt_scores=bool(scores))
    names = [e.name for i, e in enumerate(EXTRAS) if flags >> i & 1]
    return StepInputs(layout, arrays[0], dict(zip(names, arrays[1:], strict=True)), bool(want_logprobs))


class StepBroadcaster:
    """Process 0's side: announce an op (header, then payload) to every process; then the caller runs it too."""

    def __init__(self):
        import jax

        if jax.process_index() != 0:
            raise RuntimeError(f"process {jax.process_index()} of {jax.process_count()} does not schedule: it runs "
                               "process 0's ops through jaxpaged.parallel.multihost.run_worker")
        self.ops = 0

    def announce(self, op: Op, arrays=(), meta: tuple[int, ...] = ()) -> None:
        from jax.experimental import multihost_utils

        header, payload = pack(op, arrays, meta)
        multihost_utils.broadcast_one_to_all(header.encode())
        if op is not Op.STOP:
            multihost_utils.broadcast_one_to_all(payload)
        self.ops += 1

    def stop(self) -> None:
        """The workers' loops return."""
        self.announce(Op.STOP)


class MultihostRunner(ModelRunner):
    """The runner of a mesh that spans processes. On process 0 every device op is announced to the other processes
    first (they run the same op, so the step's collectives meet); on the others it is driven by `WorkerLoop`."""

    def __init__(self, *args, **kwargs):
        import jax

        super().__init__(*args, **kwargs)
        self.broadcaster = StepBroadcaster() if jax.process_index() == 0 else None

    def _announce(self, op: Op, arrays=(), meta: tuple[int, ...] = ()) -> None:
        if self.broadcaster is None:
            StepBroadcaster()  # raises: this process does not schedule
        self.broadcaster.announce(op, arrays, meta)

    def dispatch(self, inputs: StepInputs, rows: StepRows):
        meta, arrays = step_to_wire(inputs)
        self._announce(Op.STEP, arrays, meta)
        return super().dispatch(inputs, rows)

    def copy_block_arrays(self, src: np.ndarray, dst: np.ndarray) -> None:
        self._announce(Op.COPY_BLOCKS, (src, dst))
        super().copy_block_arrays(src, dst)

    def read_blocks(self, blocks) -> tuple[np.ndarray, np.ndarray]:
        idx = np.asarray(blocks, np.int32)
        self._announce(Op.READ_BLOCKS, (idx,))
        return super().read_blocks(idx)

    def write_blocks(self, blocks, k_blocks: np.ndarray, v_blocks: np.ndarray) -> None:
        idx = np.asarray(blocks, np.int32)
        self._announce(Op.WRITE_BLOCKS, (idx, np.asarray(k_blocks), np.asarray(v_blocks)))
        super().write_blocks(idx, k_blocks, v_blocks)


class WorkerLoop:
    """A process other than 0: receive each op process 0 announces and run it on this process's devices through
    the plain runner's methods (the same jitted functions, so the mesh's collectives meet)."""

    def __init__(self, runner: ModelRunner):
        import jax

        if jax.process_index() == 0:
            raise RuntimeError("process 0 schedules; run_worker is for the other processes")
        self.runner = runner
        self.ops = {op: 0 for op in Op}

    def receive(self) -> tuple[Header, list[np.ndarray]]:
        from jax.experimental import multihost_utils

        header = Header.decode(multihost_utils.broadcast_one_to_all(np.zeros(HEADER_LEN, np.int32)))
        if header.op is Op.STOP:
            return header, []
        payload = multihost_utils.broadcast_one_to_all(np.zeros(header.payload_words, np.int32))
        return header, unpack(header, payload)

    def run(self) -> dict[Op, int]:
        """Runs ops until `stop`; returns how many of each it ran."""
        runner = self.runner
        while True:
            header, arrays = self.receive()
            self.ops[header.op] += 1
            if header.op is Op.STOP:
                logger.info("process 0 said stop after %d steps", self.ops[Op.STEP])
                return self.ops
            if header.op is Op.STEP:
                ModelRunner.dispatch(runner, step_from_wire(header.meta, arrays), None)
            elif header.op is Op.COPY_BLOCKS:
                ModelRunner.copy_block_arrays(runner, *arrays)
            elif header.op is Op.READ_BLOCKS:
                ModelRunner.read_blocks(runner, *arrays)
            else:
                ModelRunner.write_blocks(runner, *arrays)


def run_worker(runner) -> dict[Op, int]:
    """The loop of a process other than 0, until process 0 broadcasts `stop` (its server stopped)."""
    import jax

    logger.info("process %d of %d: running process 0's steps", jax.process_index(), jax.process_count())
    return WorkerLoop(runner).run()


def stop_workers(runner) -> bool:
    """Process 0, once its engine thread has stopped: tells the workers to return. False if it could not (a process
    is already gone)."""
    broadcaster = getattr(runner, "broadcaster", None)
    if broadcaster is None:
        return True
    try:
        broadcaster.stop()
        return True
    except Exception:  # a worker died: the collective fails; the coordination service ends the rest
        logger.exception("could not tell the other processes to stop")
        return False


__all__ = ["DistributedConfig", "Header", "MultihostRunner", "Op", "StepBroadcaster", "WorkerLoop", "check_joined",
           "check_mesh_spans_processes", "initialize", "pack", "run_worker", "shutdown", "step_from_wire",
           "step_to_wire", "stop_workers", "unpack"]
