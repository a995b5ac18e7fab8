"""The device side of the engine: the model's state, the KV pool, the compiled steps, the persistent input batch,
and each step's dispatch and result.

    runner.apply_diffs(sched_out)                                       the persistent rows updated by its diffs
    runner.prepare(sched_out, tables, seed_of)-> (StepInputs, StepRows)   the step's rows, one buffer
    runner.dispatch(inputs)                   -> StepHandle               queued on the device, nothing waited for
    runner.fetch(handle)                      -> StepResult               the sampled tokens on the host (blocks)

Dispatch and fetch are apart so the engine can queue step N+1 before it waits for step N's tokens (asynchronous
scheduling): the device always has the next step while the host reads the last one's tokens. Each dispatch keeps its
sampled tokens on the device (`prev_tokens`), where the next step's decoding rows read their input tokens, and
starts their copy to the host at once. On a GPU the sampler is an executable of its own (jaxpaged.worker.step), and a
step that needs it has it queued by the next dispatch or by its fetch (`dispatch` says why).
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import functools
import logging
import time
from collections.abc import Callable

import jax
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from jaxpaged.core.request import Sequence
from jaxpaged.core.sched_output import SchedulerOutput
from jaxpaged.core.scheduler import PREFILL_TILE, round_up
from jaxpaged.models import quant
from jaxpaged.models.contract import ModelSpec
from jaxpaged.worker.attention import AttentionBackend, KernelGeometry
from jaxpaged.worker.input_batch import EXTRAS, InputBatch, StepInputs, StepLayout, StepRows, extra_shapes
from jaxpaged.worker.kv_pool import (
    _copy_blocks,
    _write_blocks,
    jit_pool_update,
    pool_block_bytes,
    pool_format,
    zeros_pool,
)
from jaxpaged.worker.sampler import MAX_LOGPROBS, TokenLogprobs
from jaxpaged.worker.step import (
    DraftSpec,
    Unsampled,
    VerifiedOutput,
    batch_buckets,
    gpu_layer_loop,
    gpu_layer_matmul_rows,
    jit_sample_rows,
    jit_step,
    lower_step,
    native_matmul_rows,
    pick_bucket,
    pow2_buckets,
    split_sampler_here,
    step_compiler_options,
)

logger = logging.getLogger(__name__)

# Compiled steps shared by the runners of one process. Tests build many engines of the same tiny model, and a user
# may build an `LLM` twice in a notebook: a runner whose step is built from equal static parts and takes arguments of
# equal shapes, dtypes and shardings takes the executable compiled before instead of tracing, lowering and loading it
# again. The key (`ModelRunner._shared_executable`) holds what the step's trace reads: what `jit_step` closes over,
# compared by value (`value_key`), the layout, every argument's signature, the compiler options and
# `quant.NATIVE_MODE`. Whatever else a step reads while it is traced must join the key. A runner with an unhashable
# part shares nothing.
_SHARED_EXECUTABLES: collections.OrderedDict[tuple, object] = collections.OrderedDict()
# The least recently used go first: an XLA CPU executable of a tiny model holds a few hundred memory maps while it
# lives, and Linux allows a process 65530 by default (vm.max_map_count); a few hundred executables exhausted them.
SHARED_EXECUTABLES_LIMIT = 48


def value_key(x):
    """A hashable key that is equal for equal values: partials and dataclasses by their parts (two engines' backends
    are built anew, equal but not the same objects), the rest as they hash. TypeError where a part cannot hash."""
    if isinstance(x, functools.partial):
        return ("partial", value_key(x.func), value_key(x.args), value_key(sorted(x.keywords.items())))
    if dataclasses.is_dataclass(x) and not isinstance(x, type):
        return (type(x), *(value_key(getattr(x, f.name)) for f in dataclasses.fields(x)))
    if isinstance(x, (tuple, list)):
        return tuple(value_key(v) for v in x)
    hash(x)
    return x


def _signature(tree) -> tuple:
    """(shape, dtype, sharding) of every array of `tree` (jax.Arrays or ShapeDtypeStructs)."""
    return tuple((x.shape, str(x.dtype), getattr(x, "sharding", None)) for x in jax.tree.leaves(tree))


@dataclasses.dataclass
class StepHandle:
    """A dispatched step: its device outputs (not waited for) and what the host needs to read them."""

    rows: StepRows
    tokens: jax.Array  # [max_rows] int32
    lp: TokenLogprobs | None  # [S] ([S, K + 1] verifying), when a row asked for log-probs
    layout: StepLayout
    dispatched_at: float
    verified: VerifiedOutput | None = None  # a verifying step's tokens, counts and proposals
    error: Exception | None = None  # its pending sampler raised (queued by a later dispatch): its fetch raises it
    scores: TokenLogprobs | None = None  # [T] a scoring step's prompt log-probs


@dataclasses.dataclass
class DraftModel:
    """A separate draft model for speculative decoding: split once at load, with its own attention backend (its
    layers, kv heads and head size; fp8 scales of its own) and its own KV pool of the target's num_blocks."""

    graphdef: nnx.GraphDef
    state: nnx.State
    config: ModelSpec
    attn: AttentionBackend


@dataclasses.dataclass
class StepResult:
    """A step's sampled tokens on the host, one per step row (rows that do not sample hold garbage). A verifying
    step (speculative decoding) gives each row num_accepted + 1 tokens, `emitted`, and the draft's proposals."""

    tokens: np.ndarray  # [n] int32: each row's last sampled token
    lp: TokenLogprobs | None = None  # numpy [n] ([n, K + 1] verifying): the tokens' log-probs, when asked for
    emitted: np.ndarray | None = None  # [n, K + 1] int32 verifying: accepted proposals, the target's token, -1
    num_accepted: np.ndarray | None = None  # [n] int32
    proposals: np.ndarray | None = None  # [n, K] int32: the draft loop's, for the next step
    # a scoring step: numpy [T], per token row the next prompt token's log-prob; StepRows.scored says whose
    prompt_scores: TokenLogprobs | None = None


def _score_spans(out: SchedulerOutput, scored: set[int]) -> list[tuple[int, Sequence, int, int]]:
    """(step row, sequence, first position, count) of the prompt positions this step scores: each scored
    sequence's chunk, up to the prompt's second-to-last token (the last one is followed by the first output)."""
    spans = []
    for i, seq in enumerate(out.seqs):
        if seq.seq_id in scored:
            start = out.starts[i]
            count = min(start + out.num_new_tokens[i], seq.num_prompt_tokens - 1) - start
            if count > 0:
                spans.append((i, seq, start, count))
    return spans


def _kernel_variant(attn, config, block_size: int, cache_dtype, draft: DraftModel | None):
    """(T, S, W, tile, decode_blocks) -> what the step's attention kernels' work follows (the target's and a draft
    model's), or None where some kernel's work follows every shape (or the model does not say its query heads)."""
    backends = [(attn, config)] + ([(draft.attn, draft.config)] if draft is not None else [])
    kernels = []  # (variant, geometry) of each
    for backend, spec in backends:
        variant = getattr(backend, "kernel_variant", None)
        num_q_heads = getattr(spec, "num_heads", None)
        if variant is None or num_q_heads is None:
            return None
        kernels.append((variant, KernelGeometry(num_q_heads, spec.num_kv_heads, block_size, spec.head_dim,
                                                jax.numpy.dtype(cache_dtype).itemsize)))

    def variant_of(*shape) -> tuple:
        return tuple(variant(*shape, geometry) for variant, geometry in kernels)

    return variant_of


class ModelRunner:
    """Device state (the model's split state, the KV pool, compiled steps) and the persistent input batch.

    graphdef, state: the model split once at load (`nnx.split`); `config` its `ModelSpec` fields (pool shape).
    pool_sharding: under tensor parallelism, the pool's split over `mesh` (`tensor_parallel.pool_sharding`)."""

    def __init__(self, graphdef: nnx.GraphDef, state: nnx.State, config: ModelSpec, *, num_blocks: int,
                 block_size: int, max_model_len: int, max_num_seqs: int, max_num_batched_tokens: int,
                 attn: AttentionBackend, cache_dtype, block_bytes: int, mesh: Mesh | None = None,
                 pool_sharding: NamedSharding | None = None, truncate_tables: bool = False, spec_width: int = 0,
                 draft_layers: int = 0, draft: DraftModel | None = None):
        self.config = config
        self.graphdef = graphdef
        self.params = state
        # The state's leaves, flattened once: a step call passes them as they are (no pytree traversal per step).
        self.param_leaves, self._treedef = jax.tree.flatten(state)
        self.param_leaves = tuple(self.param_leaves)
        self.block_size = block_size
        self.max_model_len = max_model_len
        self.num_blocks = num_blocks
        shape = (config.num_layers, num_blocks, block_size, config.num_kv_heads, config.head_dim)
        self.mesh = mesh  # tensor parallel: the pool split by kv head over it, the params as they were placed
        self.pool_format = pool_format(jax.devices()[0], pool_sharding)  # None off TPU without a mesh
        # One block of K and V, all layers: in one device's memory (`pool_block_bytes` of the pool format, tile
        # padding included, as the KV budget counted it; per device under tensor parallelism) and swapped out to the
        # host (logical bytes, all heads).
        self.block_bytes = block_bytes
        self.host_block_bytes = pool_block_bytes(config, block_size, cache_dtype, None)
        # Zero-filled: unused slots never hold NaN (the attention masks V as well, for pools that do).
        self.kv_pool = zeros_pool(shape, cache_dtype, self.pool_format)  # K, V [L, NB, BS, Hkv, D]
        # A draft model's pool: the same blocks (one block table addresses both), its own layers and heads.
        self.draft = draft
        self.draft_leaves, self.draft_pool, draft_spec = (), (), None
        if draft is not None:
            leaves, draft_treedef = jax.tree.flatten(draft.state)
            self.draft_leaves = tuple(leaves)
            c = draft.config
            self.draft_pool = zeros_pool((c.num_layers, num_blocks, block_size, c.num_kv_heads, c.head_dim),
                                         cache_dtype, self.pool_format)
            self.host_block_bytes += pool_block_bytes(c, block_size, cache_dtype, None)
            draft_spec = DraftSpec(draft.graphdef, draft_treedef, draft.attn)
        max_width = -(-max_model_len // block_size)
        self.max_width = max_width
        self.width_buckets = pow2_buckets(min(4, max_width), max_width)
        self.decode_buckets = batch_buckets(min(4, max_num_seqs), max_num_seqs)
        self.max_prefill_tokens = round_up(max_num_batched_tokens, PREFILL_TILE)
        self.prefill_buckets = pow2_buckets(min(64, self.max_prefill_tokens), self.max_prefill_tokens)
        self.max_num_seqs = max_num_seqs
        self.attn = attn
        self._variant = _kernel_variant(attn, config, block_size, cache_dtype, draft)
        self._bucket_cache: dict[tuple, list[int]] = {}  # (kind, S or (T, K)) -> block counts or widths
        self.prefill_tile = 1 if getattr(attn, "mixes_steps", False) else PREFILL_TILE
        # speculative decoding: proposals a prefill-shaped step may verify per row (K), and the self-draft's layers
        self.spec_width = spec_width
        self.draft_layers = draft_layers
        # The most sequence rows of any step: the sampled tokens come back padded to this, a fixed shape.
        self.max_rows = max(self.decode_buckets[-1], max(self._prefill_seqs(t) for t in self.prefill_buckets))
        self.input_batch = InputBatch(max_num_seqs, max_width, block_size, truncate_tables)
        leaf_shardings = tuple(x.sharding for x in self.param_leaves) if mesh is not None else None
        # The mesh spans other processes' devices (multi-host): host arrays become global (replicated) arrays, and
        # the swap-out read gathers the pool's heads from every process in a collective.
        self.multihost = mesh is not None and any(d.process_index != jax.process_index() for d in mesh.devices.flat)
        # On a GPU the sampler is an executable of its own, run only for steps that need more than the argmax
        # (jaxpaged.worker.step's docstring says why); elsewhere it is part of the step.
        self.split_sampler = split_sampler_here(self.multihost)
        native_rows = native_matmul_rows(mesh)
        self._gpu_loop = gpu_layer_loop()
        static = (graphdef, self._treedef, attn, self.pool_format, self.max_rows, mesh, leaf_shardings,
                  native_rows, draft_layers, draft_spec, gpu_layer_matmul_rows(mesh), self.split_sampler,
                  self._gpu_loop)
        self._step_fn = jit_step(*static)
        self._sample_fn = jit_sample_rows(self.max_rows, native_rows > 0, mesh)
        self._samplers: dict[int, object] = {}  # S -> the compiled sampler of split steps of S rows
        # a split step's sampler not queued yet: (its handle, its Unsampled output, its EXTRAS, want_logprobs)
        self._pending: tuple | None = None
        try:  # the shared executables' key of this runner's step (None: it shares none)
            self._shared_key = value_key(static)
            hash(self._shared_key)
        except TypeError:
            self._shared_key = None
        # The backend's native block write where it has one (CPU: XLA's scatter into a 16-bit pool converts it whole);
        # under tensor parallelism XLA's scatter, which works on the sharded pool as it is.
        set_blocks = getattr(attn, "block_write", None) if mesh is None else None
        self._copy_fn = jit_pool_update(functools.partial(_copy_blocks, set_blocks=set_blocks), self.pool_format,
                                        num_args=3, mesh=mesh)
        self._write_fn = jit_pool_update(functools.partial(_write_blocks, set_blocks=set_blocks), self.pool_format,
                                         num_args=4, mesh=mesh)
        self._executables: dict[tuple, object] = {}  # layout key -> AOT-compiled step
        self._neutral: dict[int, tuple[jax.Array, ...]] = {}  # S -> the EXTRAS as no row uses them
        self.warmed_up = False
        # where host inputs go: replicated over the mesh, the pool format's device (TPU), else the default device
        if mesh is not None:
            self._device = NamedSharding(mesh, P())
        else:
            self._device = self.pool_format.sharding if self.pool_format is not None else None
        if self.multihost:
            self._read_fn = jax.jit(lambda pool, idx: (pool.k[:, idx], pool.v[:, idx]),
                                    out_shardings=(self._device, self._device))
        self.prev_tokens = self._put(np.zeros(self.max_rows, np.int32))  # [max_rows] the last step's tokens

    @property
    def drafts(self) -> bool:
        """Whether verifying steps propose the next step's tokens on the device (a self-draft or a draft model)."""
        return bool(self.draft_layers) or self.draft is not None

    # ---- shapes -------------------------------------------------------------------------------------------------

    def flat_block_buckets(self, num_seqs: int) -> list[int]:
        """Block counts a decode step of num_seqs is compiled for: powers of two up to every row at full width, one
        per kernel variant (`PagedAttention.kernel_variant`)."""
        key = ("blocks", num_seqs)
        if key not in self._bucket_cache:
            most = num_seqs * self.max_width
            self._bucket_cache[key] = self._one_per_variant(
                pow2_buckets(min(max(num_seqs, 16), most), most),
                lambda b: (num_seqs, num_seqs, self.max_width, 1, b))
        return self._bucket_cache[key]

    def prefill_widths(self, num_tokens: int, spec_width: int = 0) -> list[int]:
        """Block-table widths a prefill-shaped step of T = num_tokens is compiled for: the width buckets, one per
        kernel variant."""
        key = ("widths", num_tokens, spec_width)
        if key not in self._bucket_cache:
            seqs = self._prefill_seqs(num_tokens, spec_width)
            self._bucket_cache[key] = self._one_per_variant(
                self.width_buckets, lambda w: (num_tokens, seqs, w, self.prefill_tile, None))
        return self._bucket_cache[key]

    def _one_per_variant(self, candidates: list[int], shape) -> list[int]:
        """Of ascending candidates (block counts or widths; shape(c) -> (T, S, W, tile, decode_blocks)), the largest
        of each run that gives the kernel the same variant: a step rounds up to it and runs the same kernel work."""
        if self._variant is None:
            return candidates
        kept, last = [], None
        for c in candidates:
            v = self._variant(*shape(c))
            if kept and v == last:
                kept[-1] = c
            else:
                kept.append(c)
            last = v
        return kept

    def all_shapes(self) -> list[tuple]:
        """Every (tokens, seqs, width, tile, decode_blocks, spec_width, draft_kv, prompt_scores) the engine can produce
        and compiles at start-up: all but the scoring ones (prompt_logprobs), which compile when first used."""
        # with a separate draft model, each shape twice: with the draft's run over its tokens and without
        draft_kv = (True, False) if self.draft is not None else (True,)
        shapes = [(s, s, self.max_width, 1, b, 0, d, False) for s in self.decode_buckets
                  for b in self.flat_block_buckets(s) for d in draft_kv]
        # with speculation, prefill-shaped steps twice too: verifying (K + 1 logits rows per sequence), and plain for
        # the steps where no row verifies or drafts (prompts above disable_by_batch_size, a first prefill)
        spec_widths = (self.spec_width, 0) if self.spec_width else (0,)
        shapes += [(t, self._prefill_seqs(t, k), w, self.prefill_tile, None, k, d, False)
                   for k in spec_widths for t in self._token_buckets(k) for w in self.prefill_widths(t, k)
                   for d in draft_kv]
        return shapes

    def _token_buckets(self, spec_width: int = 0) -> list[int]:
        """The T of prefill-shaped steps; a verifying step's (spec_width K > 0, tile 1) also below the smallest
        prefill bucket, from K + 1 up in powers of two: a few sequences verifying K + 1 tokens each run a step of
        their own size, not one of the smallest prompt chunk's."""
        if not spec_width or self.prefill_tile != 1:
            return self.prefill_buckets
        small, t = [], 1 << spec_width.bit_length()  # the smallest power of two >= K + 1
        while t < self.prefill_buckets[0]:
            small.append(t)
            t *= 2
        return small + self.prefill_buckets

    def _prefill_seqs(self, num_tokens: int, spec_width: int = 0) -> int:
        """The sequence rows S of a prefill step of T = num_tokens: T / tile (each sequence takes at least a tile), but
        with tile 1 (mixed steps) T / 2 below the largest T. S rows cost whatever the step's sequences are (the LM
        head's output and the sampler run over all of them), and a mixed step is mostly a few chunks beside decodes:
        a step with more sequences than that takes the next T (benchmarks/step_anatomy.py --mixed-chunk).
        A verifying step (spec_width K > 0, tile 1) below the largest T has T / (K + 1) rows: each takes K + 1
        logits rows, float32 over the vocabulary, and S (K + 1) of them padded by the bucket cost a step its page
        faults (the step's scratch memory is mapped afresh per call once it outgrows the allocator's reuse:
        benchmarks/spec_anatomy.py's page-fault column)."""
        below_largest = self.prefill_tile == 1 and num_tokens < self.max_prefill_tokens
        per_seq = (spec_width + 1 if spec_width else 2) if below_largest else self.prefill_tile
        return max(1, min(self.max_num_seqs, num_tokens // per_seq))

    def _prefill_bucket(self, num_tokens: int, num_seqs: int, spec_width: int = 0) -> int:
        """The smallest prefill T that holds num_tokens tokens and num_seqs sequences (of a verifying layout with
        spec_width K > 0)."""
        for t in self._token_buckets(spec_width):
            if t >= num_tokens and self._prefill_seqs(t, spec_width) >= num_seqs:
                return t
        largest = self.prefill_buckets[-1]
        raise ValueError(f"{num_tokens} tokens of {num_seqs} sequences exceed the largest prefill bucket "
                         f"({largest} tokens, {self._prefill_seqs(largest)} sequences)")

    def layout(self, out: SchedulerOutput) -> StepLayout:
        """The compiled shape a step runs in: its counts rounded up to buckets."""
        n = len(out.seqs)
        bs = self.block_size
        ends = np.asarray(out.starts, np.int64) + np.asarray(out.num_new_tokens, np.int64)  # context lengths
        if out.is_prefill:
            tile = self.prefill_tile
            tokens = int((-(-np.asarray(out.num_new_tokens) // tile) * tile).sum())
            # a verifying layout only where some row verifies proposals or runs the draft loop: it takes K + 1
            # logits rows per sequence (the LM head over K + 1 times the rows) and is read before the next step
            k = self.spec_width if self.spec_width and (any(out.num_spec) or any(out.drafts)) else 0
            num_tokens = self._prefill_bucket(tokens, n, k)
            # a draft loop writes up to K slots past a row's context: the tables cover them
            widest = min(int(-(-(ends.max() + k) // bs)), self.max_width)
            return StepLayout(num_tokens, self._prefill_seqs(num_tokens, k),
                              pick_bucket(self.prefill_widths(num_tokens, k), widest),
                              tile, None, k, out.draft_kv or self.draft is None)
        s = pick_bucket(self.decode_buckets, n)
        blocks = int((-(-ends // bs)).sum())  # the blocks the step's sequences read
        return StepLayout(s, s, self.max_width, 1, pick_bucket(self.flat_block_buckets(s), blocks), 0,
                          out.draft_kv or self.draft is None)

    def all_layouts(self) -> list[StepLayout]:
        return [StepLayout(*shape) for shape in self.all_shapes()]

    def warm_up(self, progress: bool = True) -> float:
        """Compiles (or loads from the persistent cache) every shape, running none; returns seconds spent."""
        from tqdm.auto import tqdm

        t0 = time.perf_counter()
        for layout in tqdm(self.all_layouts(), desc="compiling step shapes", disable=not progress):
            executable = self._executable(layout)
            if self.split_sampler and not layout.spec_width:
                self._sampler(layout.num_seqs, executable.out_info[1])
        self.warmed_up = True
        return time.perf_counter() - t0

    def _extra_shapes(self, num_seqs: int) -> tuple[tuple[int, int], ...]:
        return extra_shapes(num_seqs, self.config.vocab_size, self.max_model_len)

    def lower(self, layout: StepLayout):
        """The step lowered for one layout (for compiling, and for tests that read its HLO)."""
        extras = tuple(jax.ShapeDtypeStruct(shape, e.dtype)
                       for e, shape in zip(EXTRAS, self._extra_shapes(layout.num_seqs), strict=True))
        return lower_step(self._step_fn, self.param_leaves, self.kv_pool, self.prev_tokens, layout, extras,
                          self.draft_leaves, self.draft_pool)

    def _executable(self, layout: StepLayout):
        key = layout.key
        if key not in self._executables:
            self._executables[key] = self._shared_executable(layout)
        return self._executables[key]

    def _sampler(self, num_seqs: int, unsampled: Unsampled):
        """The compiled sampler of split steps of num_seqs rows (`step.sample_rows`): compiled at start-up with the
        steps, else when first needed. unsampled: such a step's `Unsampled` output (arrays or ShapeDtypeStructs)."""
        if num_seqs not in self._samplers:
            if self.warmed_up:
                logger.warning("compiling the sampler of %d rows after start-up", num_seqs)
            extras = tuple(jax.ShapeDtypeStruct(shape, e.dtype, sharding=x.sharding)
                           for e, shape, x in zip(EXTRAS, self._extra_shapes(num_seqs), self._neutral_extras(num_seqs),
                                                  strict=True))
            t0 = time.perf_counter()
            self._samplers[num_seqs] = self._sample_fn.lower(unsampled.logits, unsampled.sampling, extras).compile()
            logger.debug("compiled the sampler of %d rows in %.2f s", num_seqs, time.perf_counter() - t0)
        return self._samplers[num_seqs]

    def _shared_executable(self, layout: StepLayout):
        """This layout's executable: compiled before by a runner of equal key (`_SHARED_EXECUTABLES`), else now."""
        options = step_compiler_options(self.params, self._gpu_loop)
        shared = None
        if self._shared_key is not None:
            shared = (self._shared_key, layout.key, quant.NATIVE_MODE, tuple(sorted(options.items())),
                      self._extra_shapes(layout.num_seqs), _signature((self.param_leaves, self.kv_pool,
                                                                       self.prev_tokens, self.draft_leaves,
                                                                       self.draft_pool)))
            executable = _SHARED_EXECUTABLES.get(shared)
            if executable is not None:
                with contextlib.suppress(KeyError):  # engines in other threads may evict it meanwhile
                    _SHARED_EXECUTABLES.move_to_end(shared)
                return executable
        if self.warmed_up:
            logger.warning("compiling a new step shape after start-up: %s", layout.key)
        t0 = time.perf_counter()
        executable = self.lower(layout).compile(compiler_options=options)
        logger.debug("compiled step shape %s in %.2f s", layout.key, time.perf_counter() - t0)
        if shared is not None:
            _SHARED_EXECUTABLES[shared] = executable
            while len(_SHARED_EXECUTABLES) > SHARED_EXECUTABLES_LIMIT:
                with contextlib.suppress(KeyError):
                    _SHARED_EXECUTABLES.popitem(last=False)
        return executable

    @property
    def compiled_shapes(self) -> set[tuple]:
        return set(self._executables)

    # ---- one step -----------------------------------------------------------------------------------------------

    def apply_diffs(self, out: SchedulerOutput) -> None:
        """The scheduler's diffs (rows of sequences that left, changed block tables) applied to the persistent
        batch: once for every SchedulerOutput, before `prepare` and even when its step does not run."""
        self.input_batch.apply_diffs(out)

    def prepare(self, out: SchedulerOutput, tables: dict, seed_of: Callable[[Sequence], int],
                bitmasks: dict[int, np.ndarray] | None = None, scored: set[int] | None = None
                ) -> tuple[StepInputs, StepRows]:
        """The step's inputs laid out from the persistent batch (`apply_diffs` has applied the step's diffs): its
        new sequences get rows.

        tables: the block manager's seq_id -> block table (read for sequences that get a row); seed_of: the 63-bit
        seed of a sequence that gets a row; bitmasks: seq_id -> [ceil(V / 32)] int32 allowed tokens (structured
        output, bad words), only for the sequences that have one; scored: the sequences whose prompt chunks in this
        step are scored (prompt_logprobs)."""
        step_rows = self.input_batch.rows(out, tables, seed_of)
        spans = _score_spans(out, scored) if scored and out.is_prefill else []
        layout = self.layout(out)
        if spans:  # the same shape, scoring too (`StepLayout.prompt_scores`: compiled when first used)
            layout = dataclasses.replace(layout, prompt_scores=True)
        inputs, rows = self.input_batch.build(out, layout, step_rows)
        if spans:  # each scored chunk's token rows, and the prompt token each is scored against
            targets, qsl = layout.view(inputs.buf, "score_targets"), layout.view(inputs.buf, "query_start_loc")
            for i, seq, start, count in spans:
                r0 = int(qsl[i])
                targets[r0:r0 + count] = seq.token_ids[start + 1:start + 1 + count]
                rows.scored.append((seq, start, r0, count))
        if bitmasks:
            mask = np.full(self._extra_shapes(layout.num_seqs)[0], -1, np.int32)
            for i, seq in enumerate(out.seqs):
                if seq.seq_id in bitmasks:
                    mask[i] = bitmasks[seq.seq_id]
            inputs.extras["bitmask"] = mask
            layout.view(inputs.buf, "flags")[2] = 1
            inputs.greedy_only = False
        if layout.view(inputs.buf, "flags")[1]:  # a row has penalties
            inputs.extras["seen_tokens"] = self.input_batch.seen_tokens(out, layout, self.max_model_len)
        return inputs, rows

    def dispatch(self, inputs: StepInputs, rows: StepRows) -> StepHandle:
        """Queues the step on the device and returns at once; its sampled tokens become the next step's
        `prev_tokens` and start their copy to the host.

        A split step (on a GPU, `step.split_sampler_here`) that needs its sampler leaves it pending: it is queued
        by the next dispatch, first, or by the step's fetch. The sampler's conditionals make the host wait until the
        device has run the step's model, so queued at once it would hold the host there while the device has
        nothing else to do; queued next, the host has laid out the next step meanwhile and queues it right after."""
        self._flush()
        step = self._executable(inputs.layout)
        extras = self._extras(inputs)
        tokens, out, self.kv_pool, self.draft_pool, scores = step(self.param_leaves, self.kv_pool, self.prev_tokens,
                                                                  self._arg(inputs.buf), extras, self.draft_leaves,
                                                                  self.draft_pool)
        handle = StepHandle(rows, tokens, None, inputs.layout, time.perf_counter(), scores=scores)
        if scores is not None:
            scores.copy_to_host_async()
        if isinstance(out, Unsampled) and not inputs.greedy_only:
            self.prev_tokens = tokens  # (the argmax: replaced by the sampler's tokens before any step reads them)
            self._pending = (handle, out, extras, inputs.want_logprobs)
            return handle
        self._finish(handle, tokens, out.greedy if isinstance(out, Unsampled) else out, inputs.want_logprobs)
        return handle

    def sample_pending(self, handle: StepHandle, bitmask: np.ndarray) -> None:
        """Queues the pending sampler of split step `handle` now, with `bitmask` [S, ceil(V / 32)] int32 in place of
        the one the step was laid out with: the engine computes a step's grammar bitmasks after dispatching it,
        once the tokens they depend on (the previous step's) have reached the host (`Engine`: late bitmasks)."""
        if self._pending is None or self._pending[0] is not handle:
            raise RuntimeError("sample_pending: this step has no pending sampler")
        pending, unsampled, extras, want_logprobs = self._pending
        at = [e.name for e in EXTRAS].index("bitmask")
        extras = extras[:at] + (self._arg(bitmask),) + extras[at + 1:]
        self._pending = (pending, unsampled, extras, want_logprobs)
        self._flush()

    def _flush(self) -> None:
        """Queues the pending sampler of the last split step, if any (`dispatch`)."""
        if self._pending is None:
            return
        handle, unsampled, extras, want_logprobs = self._pending
        self._pending = None
        try:
            sample = self._sampler(handle.layout.num_seqs, unsampled)
            tokens, out = sample(unsampled.logits, unsampled.sampling, extras)
        except Exception as e:  # the step's own failure, raised when it is read, not the next step's that queued it
            handle.error = e
            return
        self._finish(handle, tokens, out, want_logprobs)

    def _finish(self, handle: StepHandle, tokens: jax.Array, out, want_logprobs: bool) -> None:
        """A step's sampled tokens (and its verified output or log-probs): the next step's input, and on their way to
        the host."""
        self.prev_tokens = handle.tokens = tokens
        tokens.copy_to_host_async()
        if handle.layout.spec_width:
            handle.verified = out
            for x in (out.tokens, out.num_accepted, out.proposals):
                x.copy_to_host_async()
        if want_logprobs:
            handle.lp = out.lp
            out.lp.copy_to_host_async()

    def fetch(self, handle: StepHandle) -> StepResult:
        """The step's tokens (and log-probs, when asked for) on the host: waits for the step."""
        if self._pending is not None and self._pending[0] is handle:
            self._flush()
        if handle.error is not None:
            raise handle.error
        n = len(handle.rows.seqs)
        result = StepResult(np.asarray(handle.tokens)[:n])
        if handle.lp is not None:
            result.lp = handle.lp.on_host(n)
        if handle.scores is not None:
            result.prompt_scores = handle.scores.on_host()
        if handle.verified is not None:
            v = handle.verified
            result.emitted = np.asarray(v.tokens)[:n]
            result.num_accepted = np.asarray(v.num_accepted)[:n]
            result.proposals = np.asarray(v.proposals)[:n]
        self.input_batch.tokens_arrived(handle.rows, result.tokens)
        return result

    def execute(self, inputs: StepInputs, rows: StepRows) -> StepResult:
        """dispatch then fetch: a synchronous step."""
        return self.fetch(self.dispatch(inputs, rows))

    def _extras(self, inputs: StepInputs) -> tuple:
        """The step's EXTRAS: the rows' own where a row uses them, else device-resident neutral arrays of the step's
        shape (any token allowed, no history, no bias), made once per row count."""
        return tuple(self._arg(inputs.extras[e.name]) if e.name in inputs.extras else neutral
                     for e, neutral in zip(EXTRAS, self._neutral_extras(inputs.layout.num_seqs), strict=True))

    def _neutral_extras(self, num_seqs: int) -> tuple[jax.Array, ...]:
        """The EXTRAS as no row uses them, for steps of num_seqs rows, on the step's device (made once)."""
        if num_seqs not in self._neutral:
            self._neutral[num_seqs] = tuple(self._put(np.full(shape, e.neutral, e.dtype))
                                            for e, shape in zip(EXTRAS, self._extra_shapes(num_seqs), strict=True))
        return self._neutral[num_seqs]

    def _arg(self, x: np.ndarray) -> np.ndarray | jax.Array:
        """A host array as a compiled call's argument: as it is (the call copies it to the device, cheaper than a
        device_put of its own), or multi-host a global array."""
        return self._put(x) if self.multihost else x

    def _put(self, x: np.ndarray) -> jax.Array:
        """A host array on the step's device(s): replicated over the mesh (a global array, multi-host)."""
        if self.multihost:
            return jax.make_array_from_process_local_data(self._device, x, x.shape)
        return jax.device_put(x, self._device)

    def pool_alive(self) -> bool:
        """False once a donated pool buffer is gone (a step that raised after taking it)."""
        pools = (self.kv_pool, self.draft_pool) if self.draft is not None else (self.kv_pool,)
        return not any(p.k.is_deleted() or p.v.is_deleted() for p in pools)

    # ---- block copies -------------------------------------------------------------------------------------------

    def copy_blocks(self, pairs: list[tuple[int, int]]) -> None:
        """Copy-on-write, before the step that writes into the copies."""
        if not pairs:
            return
        n = pick_bucket(pow2_buckets(8, max(8, self.num_blocks)), len(pairs))
        src, dst = np.zeros(n, np.int32), np.zeros(n, np.int32)
        src[:len(pairs)], dst[:len(pairs)] = zip(*pairs, strict=True)
        self.copy_block_arrays(src, dst)

    def copy_block_arrays(self, src: np.ndarray, dst: np.ndarray) -> None:
        """src, dst [N] int32, padded (0 -> 0). A draft model's pool gets the same copies."""
        self.kv_pool = self._copy_fn(self.kv_pool, self._arg(src), self._arg(dst))
        if self.draft is not None:
            self.draft_pool = self._copy_fn(self.draft_pool, self._arg(src), self._arg(dst))

    def read_blocks(self, blocks: list[int] | np.ndarray) -> tuple[np.ndarray, ...]:
        """Swap-out: the given device blocks as host arrays [L, N, BS, Hkv, D]: K and V (then the draft model's K
        and V, with a draft model)."""
        idx = np.asarray(blocks, np.int32)
        if not self.multihost:
            pools = (self.kv_pool, self.draft_pool) if self.draft is not None else (self.kv_pool,)
            return tuple(np.asarray(x[:, idx]) for p in pools for x in (p.k, p.v))
        k, v = self._read_fn(self.kv_pool, self._arg(idx))
        return np.asarray(k), np.asarray(v)

    def write_blocks(self, blocks: list[int] | np.ndarray, k_blocks: np.ndarray, v_blocks: np.ndarray,
                     *draft_blocks: np.ndarray) -> None:
        """Swap-in: host arrays [L, N, BS, Hkv, D] into the given device blocks (`read_blocks`' arrays)."""
        idx = np.asarray(blocks, np.int32)
        self.kv_pool = self._write_fn(self.kv_pool, self._arg(idx), self._arg(np.asarray(k_blocks)),
                                      self._arg(np.asarray(v_blocks)))
        if draft_blocks:
            self.draft_pool = self._write_fn(self.draft_pool, self._arg(idx), *map(self._arg, draft_blocks))


__all__ = ["MAX_LOGPROBS", "ModelRunner", "StepHandle", "StepResult"]
