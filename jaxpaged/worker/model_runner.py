"""From a `SchedulerOutput` to one padded numpy batch, and from that batch to sampled tokens on device.

Every array the jitted step sees is padded up to a bucket, so XLA compiles a few shapes once (at start-up) and a
request's length never reaches a jitted shape:
  decode steps   tokens = sequences = S in `decode_buckets`; block tables at the full width; the K/V read as a
                 flat list of B blocks, B in `flat_block_buckets(S)` (the blocks in use, rounded up)
  prefill steps  tokens T in `prefill_buckets`, sequences min(max_num_seqs, T / tile), block-table width W in
                 `width_buckets`, tile 16; or tile 1 when the attention `mixes_steps` (then a prefill step may
                 carry decodes too, every sequence's tokens start right after the previous one's, and S is T / 2
                 but at the largest T: a step with more sequences than that takes a larger T)

The pool's device layout (`pool_format`): on TPU the pool is allocated, and passes through every jitted function
that takes it (the step, the block copy, the swap-in write), in an explicit row-major format, the layout the Pallas
TPU kernel's custom call takes; a pool in XLA's default TPU layout for head_dim 64 would be copied whole, in and
out, on every step. Row-major TPU tiles pad the pool's (Hkv, D) dimensions, so a block's HBM bytes are measured from
XLA (`pool_block_bytes`) rather than counted. CPU and GPU keep their default layouts (already row-major).
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.experimental.layout import Format, Layout
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from jaxpaged.core.scheduler import PREFILL_TILE, SchedulerOutput, round_up
from jaxpaged.models.contract import ModelSpec
from jaxpaged.models.matmul import native_matmul
from jaxpaged.worker import sampler
from jaxpaged.worker.attention import AttentionBackend, AttentionMetadata, KVPool
from jaxpaged.worker.sampler import SamplerOutput, SamplingMetadata

logger = logging.getLogger(__name__)


NATIVE_MATMUL_ROWS = 1 << 20  # every step's: benchmarks/matmul.py compares the native kernel with XLA's dot by rows


def pow2_buckets(lo: int, hi: int) -> list[int]:
    """Powers of two from lo up to hi, with hi itself as the last bucket."""
    out, b = [], lo
    while b < hi:
        out.append(b)
        b *= 2
    return out + [hi]


def batch_buckets(lo: int, hi: int) -> list[int]:
    """Sequence counts of decode steps: powers of two from lo, with the 1.5x points between them from 16 up (24, 48,
    96, ...), so a batch is padded by at most a third above 16 rows (a decode step costs per row), and hi last."""
    out = []
    for b in pow2_buckets(lo, hi):
        if b >= 32 and b // 4 * 3 > (out[-1] if out else 0):
            out.append(b // 4 * 3)
        out.append(b)
    return sorted(set(x for x in out if x <= hi))


def pick_bucket(buckets: list[int], n: int) -> int:
    for b in buckets:
        if b >= n:
            return b
    raise ValueError(f"{n} exceeds the largest bucket {buckets[-1]}")


@functools.partial(jax.tree_util.register_dataclass, data_fields=["token_ids", "attn", "sampling"], meta_fields=[])
@dataclasses.dataclass
class Batch:
    """One step's device inputs, numpy, padded: T tokens, S sequences, block-table width W."""

    token_ids: np.ndarray  # [T] int32
    attn: AttentionMetadata  # numpy fields
    sampling: SamplingMetadata  # numpy fields

    @property
    def shape_key(self) -> tuple:
        return self.attn.shape_key


def _step(state: nnx.State, kv_pool: KVPool, token_ids, md: AttentionMetadata, sm: SamplingMetadata, *,
          graphdef: nnx.GraphDef, attn: AttentionBackend, mesh: Mesh | None = None,
          native_matmul_rows: int = 0) -> tuple[SamplerOutput, KVPool]:
    model = nnx.merge(graphdef, state)  # inside the trace: the module's arrays are the step's arguments
    # Rows from query_start_loc[-1] on are padding (the step's token bucket): the native matmuls skip them.
    with native_matmul(native_matmul_rows, live_rows=(token_ids.shape[0], md.query_start_loc[-1])):
        hidden, kv_pool = model(token_ids, kv_pool, md, attn)  # [T, H]
    # The LM head runs only on the rows that need logits: one per sequence, not one per token; natively, only on
    # the step's sequences (the rest of S is padding: context length 0).
    num_seqs = jnp.sum(md.context_lens > 0, dtype=jnp.int32)
    with native_matmul(native_matmul_rows, live_rows=(md.logits_indices.shape[0], num_seqs)):
        logits = model.logits(hidden[md.logits_indices])  # [S, V] f32
    if mesh is not None and logits.shape[-1] % mesh.size == 0:
        # Tensor parallel: the LM head's output stays split over the vocabulary (so XLA does not gather the head
        # instead), then the sampler gets the whole rows: the same sampling code, and the same tokens, at every tp.
        logits = jax.lax.with_sharding_constraint(logits, NamedSharding(mesh, P(None, mesh.axis_names[0])))
        logits = jax.lax.with_sharding_constraint(logits, NamedSharding(mesh, P()))
    return sampler.sample(logits, sm, native=native_matmul_rows > 0), kv_pool


def _copy_blocks(kv_pool: KVPool, src, dst, *, set_blocks=None) -> KVPool:
    """Copy-on-write: block dst <- block src in every layer. src, dst [N] int32 (padding: 0 -> 0). set_blocks: the
    attention backend's native block write (`PagedAttention.block_write`), or None for XLA's scatter."""
    if set_blocks is not None:
        return KVPool(*set_blocks(kv_pool.k, kv_pool.v, dst, kv_pool.k[:, src], kv_pool.v[:, src]))
    return KVPool(kv_pool.k.at[:, dst].set(kv_pool.k[:, src]), kv_pool.v.at[:, dst].set(kv_pool.v[:, src]))


def _write_blocks(kv_pool: KVPool, dst, k_blocks, v_blocks, *, set_blocks=None) -> KVPool:
    """Swap-in: k/v_blocks [L, N, BS, Hkv, D] go to device blocks dst [N]."""
    if set_blocks is not None:
        return KVPool(*set_blocks(kv_pool.k, kv_pool.v, dst, k_blocks, v_blocks))
    return KVPool(kv_pool.k.at[:, dst].set(k_blocks), kv_pool.v.at[:, dst].set(v_blocks))


# ---- the pool's device format ----------------------------------------------------------------------------------------

ROW_MAJOR_POOL = Layout(major_to_minor=(0, 1, 2, 3, 4))  # of [L, NB, BS, Hkv, D]


def pool_format(device: jax.Device, mesh: Mesh | None = None) -> Format | NamedSharding | None:
    """The K/V pool's explicit format on `device`: row-major on TPU, None (the default layout) elsewhere.

    The Pallas TPU kernel's custom call takes the pool row-major, and XLA's default TPU layout for head_dim 64 puts
    the block axis minor-most: every step would copy both pools to row-major and back (pallas_kernels/tpu.py, "The
    pool's HBM layout"). CPU and GPU default layouts are row-major already.

    With a tensor-parallel `mesh`, the pool is split by kv head over it (`tensor_parallel.POOL_SPEC`): its
    NamedSharding, in the row-major format on TPU.
    """
    if mesh is not None:
        from jaxpaged.parallel.tensor_parallel import pool_sharding

        sharding = pool_sharding(mesh)
        return Format(ROW_MAJOR_POOL, sharding) if device.platform == "tpu" else sharding
    if device.platform != "tpu":
        return None
    return Format(ROW_MAJOR_POOL, jax.sharding.SingleDeviceSharding(device))


def native_matmul_rows(mesh: Mesh | None) -> int:
    """The most rows a step's layer matmuls run by the native CPU kernel (`jaxpaged.models.matmul`), 0 for none:
    on a CPU with AVX512_BF16 without a tensor-parallel mesh, up to NATIVE_MATMUL_ROWS: every step, decode and
    prefill (at 256-2048 rows the kernel runs within a few percent of XLA's dot rate, and a prefill step is faster
    with it: no weight slices copied, bf16 results written instead of float32 ones)."""
    if mesh is not None or jax.default_backend() != "cpu":
        return 0
    from pallas_kernels import cpu_native

    return NATIVE_MATMUL_ROWS if cpu_native.matmul_is_fast() else 0


def jit_step(graphdef: nnx.GraphDef, attn: AttentionBackend, fmt: Format | NamedSharding | None,
             mesh: Mesh | None = None, param_shardings=None, native_rows: int = 0):
    """The jitted step: (state, kv_pool, token_ids, attn_md, sampling_md) -> (SamplerOutput, kv_pool), for the model
    `graphdef` (from `nnx.split` at load) and the attention backend `attn`; bfloat16 layer matmuls of at most
    native_rows rows by the native CPU kernel (`native_matmul_rows`).

    The pool is donated. With a pool format, the pool comes in and goes out in it, and the other arguments and
    outputs live on its device. With a tensor-parallel mesh, the parameters keep their shardings, the pool its
    split by kv head, and the host batch and the sampler's output are replicated over the mesh.
    """
    step = functools.partial(_step, graphdef=graphdef, attn=attn, mesh=mesh, native_matmul_rows=native_rows)
    if mesh is not None:
        rep, pool = NamedSharding(mesh, P()), KVPool(fmt, fmt)
        return jax.jit(step, donate_argnums=(1,), in_shardings=(param_shardings, pool, rep, rep, rep),
                       out_shardings=(rep, pool))
    if fmt is None:
        return jax.jit(step, donate_argnums=(1,))
    device = fmt.sharding
    pool = KVPool(fmt, fmt)
    return jax.jit(step, donate_argnums=(1,), in_shardings=(device, pool, device, device, device),
                   out_shardings=(device, pool))


def jit_pool_update(fn, fmt: Format | NamedSharding | None, num_args: int, mesh: Mesh | None = None):
    """jit of fn(kv_pool, *indices_and_blocks) -> kv_pool, the pool donated and kept in `fmt`."""
    if fmt is None:
        return jax.jit(fn, donate_argnums=(0,))
    pool = KVPool(fmt, fmt)
    other = NamedSharding(mesh, P()) if mesh is not None else fmt.sharding
    return jax.jit(fn, donate_argnums=(0,), in_shardings=(pool, *(other,) * (num_args - 1)), out_shardings=pool)


def _zeros_in(shape: tuple[int, ...], dtype, fmt: Format | NamedSharding):
    """A jitted function returning zeros created in `fmt` (jnp.zeros then device_put would first hold a pool in the
    default layout beside the one in `fmt`)."""
    return jax.jit(functools.partial(jnp.zeros, shape, dtype), out_shardings=fmt)


def zeros_pool(shape: tuple[int, ...], dtype, fmt: Format | NamedSharding | None) -> KVPool:
    """A zero-filled pool, K and V [L, NB, BS, Hkv, D], in `fmt` if given."""
    def zeros():
        return jnp.zeros(shape, dtype) if fmt is None else _zeros_in(shape, dtype, fmt)()

    return KVPool(zeros(), zeros())


def pool_block_bytes(config: ModelSpec, block_size: int, dtype, fmt: Format | None) -> int:
    """Device bytes of one block of the K and V pools together, all layers.

    Default layout: the logical 2 * L * BS * Hkv * D * itemsize. With a format: XLA's own count, the output bytes
    of the compiled allocation of a 2-block pool minus a 1-block pool (compile only, nothing is allocated), so the
    padding of the format's tiles is counted: on TPU v5e a row-major bfloat16 (Hkv, D) = (3, 64) is tiled
    (4, 128), 2.67x the logical bytes.
    """
    per_block = config.num_layers * block_size * config.num_kv_heads * config.head_dim * jnp.dtype(dtype).itemsize
    if fmt is None:
        return 2 * per_block

    def allocated(num_blocks: int) -> int:
        shape = (config.num_layers, num_blocks, block_size, config.num_kv_heads, config.head_dim)
        return _zeros_in(shape, dtype, fmt).lower().compile().memory_analysis().output_size_in_bytes

    return 2 * (allocated(2) - allocated(1))


def dummy_batch(t: int, s: int, w: int, tile: int, decode_blocks: int | None, vocab_size: int = 0,
                max_len: int = 0) -> Batch:
    """An all-padding batch of one step shape: T tokens, S sequences, block-table width W; the sampling metadata's
    bitmask covers vocab_size tokens and its seen-token rows hold max_len (the model's, fixed at start-up)."""
    attn = AttentionMetadata(
        positions=np.full(t, -1, np.int32), slot_mapping=np.zeros(t, np.int32), block_tables=np.zeros((s, w), np.int32),
        context_lens=np.zeros(s, np.int32), query_start_loc=np.zeros(s + 1, np.int32),
        logits_indices=np.zeros(s, np.int32), tile_size=tile, decode_blocks=decode_blocks)
    sampling = SamplingMetadata.padding(s, vocab_size, max_len)
    return Batch(np.zeros(t, np.int32), attn, sampling)


def step_compiler_options(params) -> dict[str, str]:
    """XLA options for compiling the step: on CPU with 16-bit parameters, no while-loop invariant code motion.

    XLA CPU slices a layer's weights out of the stacked [L, ...] arrays in float32 (it has no 16-bit dynamic-slice),
    and the invariant-code-motion pass hoists that conversion out of the layer loop: every step then converts every
    stacked weight to float32 and back (a bfloat16 decode step of 64 sequences: 346 ms instead of 153 ms,
    benchmarks/step_anatomy.py). Without the pass the conversion stays fused with the slice of one layer. Options are
    per executable: nothing process-wide changes."""
    sixteen_bit = any(jnp.issubdtype(x.dtype, jnp.floating) and jnp.dtype(x.dtype).itemsize == 2
                      for x in jax.tree.leaves(params))
    if jax.default_backend() != "cpu" or not sixteen_bit:
        return {}
    return {"xla_disable_hlo_passes": "while-loop-invariant-code-motion"}


def step_matmul_precision(params) -> str | None:
    """'highest' for a float32 model, so its matmuls multiply in float32: XLA's default on GPU rounds float32 inputs
    to TF32 (logits ~1e-3 off transformers' float32) and on TPU to bfloat16. None (the default) for 16-bit models.
    On CPU it changes nothing."""
    floats = [x.dtype for x in jax.tree.leaves(params) if jnp.issubdtype(x.dtype, jnp.floating)]
    return "highest" if floats and all(jnp.dtype(d) == jnp.float32 for d in floats) else None


def lower_step(step_fn, params, kv_pool: KVPool, batch: Batch):
    """Lowers the step for one batch shape; the arguments may be arrays or jax.ShapeDtypeStructs. The matmul
    precision is set for this trace only (`step_matmul_precision`), not process-wide."""
    with jax.default_matmul_precision(step_matmul_precision(params)):
        return step_fn.lower(params, kv_pool, batch.token_ids, batch.attn, batch.sampling)


class ModelRunner:
    """Device state (the model's split state, the KV pool, compiled steps) and the host batch building.

    graphdef, state: the model split once at load (`nnx.split`); `config` its `ModelSpec` fields (pool shape)."""

    def __init__(self, graphdef: nnx.GraphDef, state: nnx.State, config: ModelSpec, *, num_blocks: int,
                 block_size: int, max_model_len: int, max_num_seqs: int, max_num_batched_tokens: int,
                 attn: AttentionBackend, cache_dtype, block_bytes: int, mesh: Mesh | None = None):
        self.config = config
        self.graphdef = graphdef
        self.params = state
        self.block_size = block_size
        self.max_model_len = max_model_len
        self.num_blocks = num_blocks
        shape = (config.num_layers, num_blocks, block_size, config.num_kv_heads, config.head_dim)
        self.mesh = mesh  # tensor parallel: the pool split by kv head over it, the params as they were placed
        # None off TPU without a mesh
        self.pool_format = pool_format(jax.devices()[0]) if mesh is None else pool_format(jax.devices()[0], mesh)
        # One block of K and V, all layers: in one device's memory (`pool_block_bytes` of the pool format, tile
        # padding included, as the KV budget counted it; per device under tensor parallelism) and swapped out to the
        # host (logical bytes, all heads).
        self.block_bytes = block_bytes
        self.host_block_bytes = pool_block_bytes(config, block_size, cache_dtype, None)
        # Zero-filled: unused slots never hold NaN (the attention masks V as well, for pools that do).
        self.kv_pool = zeros_pool(shape, cache_dtype, self.pool_format)  # K, V [L, NB, BS, Hkv, D]
        max_width = -(-max_model_len // block_size)
        self.max_width = max_width
        self.width_buckets = pow2_buckets(min(4, max_width), max_width)
        self.decode_buckets = batch_buckets(min(4, max_num_seqs), max_num_seqs)
        self.max_prefill_tokens = round_up(max_num_batched_tokens, PREFILL_TILE)
        self.prefill_buckets = pow2_buckets(min(64, self.max_prefill_tokens), self.max_prefill_tokens)
        self.max_num_seqs = max_num_seqs
        param_shardings = jax.tree.map(lambda x: x.sharding, state) if mesh is not None else None
        self.attn = attn
        self.prefill_tile = 1 if getattr(attn, "mixes_steps", False) else PREFILL_TILE
        self._step_fn = jit_step(graphdef, attn, self.pool_format, mesh, param_shardings, native_matmul_rows(mesh))
        # The backend's native block write where it has one (CPU: XLA's scatter into a 16-bit pool converts it whole);
        # under tensor parallelism XLA's scatter, which works on the sharded pool as it is.
        set_blocks = getattr(attn, "block_write", None) if mesh is None else None
        self._copy_fn = jit_pool_update(functools.partial(_copy_blocks, set_blocks=set_blocks), self.pool_format,
                                        num_args=3, mesh=mesh)
        self._write_fn = jit_pool_update(functools.partial(_write_blocks, set_blocks=set_blocks), self.pool_format,
                                         num_args=4, mesh=mesh)
        self._executables: dict[tuple, object] = {}  # shape_key -> AOT-compiled step
        self.warmed_up = False
        # Multi-host (jaxpaged.parallel.multihost): the mesh spans other processes' devices, so the host arrays become
        # global (replicated) arrays, and process 0 announces every device op to the others before running it.
        self.multihost = mesh is not None and any(d.process_index != jax.process_index() for d in mesh.devices.flat)
        self.broadcaster = None
        if self.multihost:
            from jaxpaged.parallel import multihost

            self._replicated = NamedSharding(mesh, P())
            # the swap-out read: the pool's heads live on several processes, so they are gathered in a collective
            self._read_fn = jax.jit(lambda pool, idx: (pool.k[:, idx], pool.v[:, idx]),
                                    out_shardings=(self._replicated, self._replicated))
            if jax.process_index() == 0:
                self.broadcaster = multihost.StepBroadcaster()

    # ---- shapes -------------------------------------------------------------------------------------------------

    def flat_block_buckets(self, num_seqs: int) -> list[int]:
        """Block counts a decode step of num_seqs is compiled for: powers of two up to every row at full width, or
        only that when the attention's cost does not follow the count (`reads_flat_blocks`)."""
        most = num_seqs * self.max_width
        if not getattr(self.attn, "reads_flat_blocks", True):
            return [most]
        return pow2_buckets(min(max(num_seqs, 16), most), most)

    def all_shapes(self) -> list[tuple]:
        """Every (tokens, seqs, width, tile, decode_blocks) the engine can produce."""
        shapes = [(s, s, self.max_width, 1, b) for s in self.decode_buckets for b in self.flat_block_buckets(s)]
        shapes += [(t, self._prefill_seqs(t), w, self.prefill_tile, None) for t in self.prefill_buckets
                   for w in self.width_buckets]
        return shapes

    def _prefill_seqs(self, num_tokens: int) -> int:
        """The sequence rows S of a prefill step of T = num_tokens: T / tile (each sequence takes at least a tile), but
        with tile 1 (mixed steps) T / 2 below the largest T. S rows cost whatever the step's sequences are (the LM
        head's output and the sampler run over all of them), and a mixed step is mostly a few chunks beside decodes:
        a step with more sequences than that takes the next T (benchmarks/step_anatomy.py --mixed-chunk)."""
        mixed_below_largest = self.prefill_tile == 1 and num_tokens < self.max_prefill_tokens
        return max(1, min(self.max_num_seqs, num_tokens // (2 if mixed_below_largest else self.prefill_tile)))

    def _prefill_bucket(self, num_tokens: int, num_seqs: int) -> int:
        """The smallest prefill T that holds num_tokens tokens and num_seqs sequences."""
        for t in self.prefill_buckets:
            if t >= num_tokens and self._prefill_seqs(t) >= num_seqs:
                return t
        largest = self.prefill_buckets[-1]
        raise ValueError(f"{num_tokens} tokens of {num_seqs} sequences exceed the largest prefill bucket "
                         f"({largest} tokens, {self._prefill_seqs(largest)} sequences)")

    def warm_up(self, progress: bool = True) -> float:
        """Compiles (or loads from the persistent cache) every shape, running none; returns seconds spent."""
        from tqdm.auto import tqdm

        t0 = time.perf_counter()
        for shape in tqdm(self.all_shapes(), desc="compiling step shapes", disable=not progress):
            self._executable(dummy_batch(*shape, **self._sampling_dims))
        self.warmed_up = True
        return time.perf_counter() - t0

    def _executable(self, batch: Batch):
        key = batch.shape_key
        if key not in self._executables:
            if self.warmed_up:
                logger.warning("compiling a new step shape after start-up: %s", key)
            lowered = lower_step(self._step_fn, self.params, self.kv_pool, batch)
            self._executables[key] = lowered.compile(compiler_options=step_compiler_options(self.params))
        return self._executables[key]

    @property
    def _sampling_dims(self) -> dict:
        return {"vocab_size": self.config.vocab_size, "max_len": self.max_model_len}

    @property
    def compiled_shapes(self) -> set[tuple]:
        return set(self._executables)

    # ---- one step -----------------------------------------------------------------------------------------------

    def prepare(self, out: SchedulerOutput, block_tables: list[list[int]], seeds: list[int],
                banned: list[list[int]], bitmasks: list[np.ndarray | None] | None = None) -> Batch:
        """Lays the scheduled sequences out as one padded batch.

        block_tables, seeds (63-bit), banned (token ids not to sample this step), bitmasks (the tokens allowed,
        [ceil(V / 32)] int32, None = all): one per scheduled sequence.
        """
        bs = self.block_size
        n = len(out.scheduled)
        tile = self.prefill_tile if out.is_prefill else 1
        lengths = [round_up(s.num_new_tokens, tile) for s in out.scheduled]
        blocks = [-(-(s.seq.num_computed_tokens + s.num_new_tokens) // bs) for s in out.scheduled]
        if out.is_prefill:
            num_tokens = self._prefill_bucket(sum(lengths), n)
            num_seqs = self._prefill_seqs(num_tokens)
            width, decode_blocks = pick_bucket(self.width_buckets, max(blocks)), None
        else:
            num_tokens = num_seqs = pick_bucket(self.decode_buckets, n)
            width, decode_blocks = self.max_width, pick_bucket(self.flat_block_buckets(num_seqs), sum(blocks))

        b = dummy_batch(num_tokens, num_seqs, width, tile, decode_blocks, **self._sampling_dims)
        a, sm = b.attn, b.sampling
        start = 0
        for i, (sched, length) in enumerate(zip(out.scheduled, lengths, strict=True)):
            seq, m = sched.seq, sched.num_new_tokens
            first = seq.num_computed_tokens
            table = np.asarray(block_tables[i], np.int32)
            pos = np.arange(first, first + m, dtype=np.int32)
            b.token_ids[start:start + m] = seq.token_ids[first:first + m]
            a.positions[start:start + m] = pos
            a.slot_mapping[start:start + m] = table[pos // bs] * bs + pos % bs
            a.block_tables[i, :blocks[i]] = table[:blocks[i]]  # a table may hold reserved blocks beyond the context
            a.context_lens[i] = first + m
            a.query_start_loc[i] = start
            a.logits_indices[i] = start + m - 1
            p = seq.params
            sm.temperature[i], sm.top_p[i], sm.top_k[i], sm.min_p[i] = p.temperature, p.top_p, p.top_k, p.min_p
            sm.seed_lo[i], sm.seed_hi[i] = seeds[i] & 0xFFFFFFFF, (seeds[i] >> 32) & 0xFFFFFFFF
            sm.step[i] = len(seq.output_token_ids)
            sm.banned[i, :len(banned[i])] = banned[i][:sampler.MAX_BANNED]
            if bitmasks is not None and bitmasks[i] is not None:
                sm.bitmask[i], sm.constrained = bitmasks[i], np.array(True)
            if p.has_penalties:
                seen = seq.token_ids
                sm.seen_tokens[i, :len(seen)], sm.output_start[i] = seen, len(seq.prompt_token_ids)
                sm.presence_penalty[i], sm.frequency_penalty[i] = p.presence_penalty, p.frequency_penalty
                sm.repetition_penalty[i], sm.penalized = p.repetition_penalty, np.array(True)
            if p.logit_bias:
                sm.bias_ids[i, :len(p.logit_bias)] = list(p.logit_bias)
                sm.bias_values[i, :len(p.logit_bias)] = list(p.logit_bias.values())
            start += length
        a.query_start_loc[n:] = start
        sm.want_logprobs = np.array(any(s.seq.params.logprobs is not None for s in out.scheduled))
        return b

    def execute(self, batch: Batch) -> dict[str, np.ndarray]:
        """Runs the step; returns numpy tokens [S], logprobs [S], top_ids / top_logprobs [S, 20]."""
        if self.multihost:
            self._announce("STEP", batch)
        return self.execute_local(batch)

    def execute_local(self, batch: Batch) -> dict[str, np.ndarray]:
        """`execute` on this process's devices only (a worker process runs process 0's steps with it)."""
        step = self._executable(batch)
        args = self._inputs(batch.token_ids, batch.attn, batch.sampling)
        result, self.kv_pool = step(self.params, self.kv_pool, *args)
        return {f.name: np.asarray(getattr(result, f.name)) for f in dataclasses.fields(result)}

    def _announce(self, op: str, tree) -> None:
        """Multi-host, process 0: the other processes run the same op (jaxpaged.parallel.multihost)."""
        from jaxpaged.parallel.multihost import Op, StepBroadcaster

        if self.broadcaster is None:
            StepBroadcaster()  # raises: this process does not schedule
        self.broadcaster.announce(Op[op], tree)

    def _inputs(self, *arrays):
        """The host arrays as given, or, multi-host, as global arrays replicated over the mesh (each process
        holds the whole value)."""
        if not self.multihost:
            return arrays
        def to_global(x):
            x = np.asarray(x)
            return jax.make_array_from_process_local_data(self._replicated, x, x.shape)

        return jax.tree.map(to_global, arrays)

    def pool_alive(self) -> bool:
        """False once a donated pool buffer is gone (a step that raised after taking it)."""
        return not (self.kv_pool.k.is_deleted() or self.kv_pool.v.is_deleted())

    # ---- block copies -------------------------------------------------------------------------------------------

    def copy_blocks(self, pairs: list[tuple[int, int]]) -> None:
        """Copy-on-write, before the step that writes into the copies."""
        if not pairs:
            return
        n = pick_bucket(pow2_buckets(8, max(8, self.num_blocks)), len(pairs))
        src, dst = np.zeros(n, np.int32), np.zeros(n, np.int32)
        src[:len(pairs)], dst[:len(pairs)] = zip(*pairs, strict=True)
        if self.multihost:
            self._announce("COPY_BLOCKS", (src, dst))
        self.copy_blocks_local(src, dst)

    def copy_blocks_local(self, src: np.ndarray, dst: np.ndarray) -> None:
        """src, dst [N] int32, padded (0 -> 0)."""
        self.kv_pool = self._copy_fn(self.kv_pool, *self._inputs(src, dst))

    def read_blocks(self, blocks: list[int]) -> tuple[np.ndarray, np.ndarray]:
        """Swap-out: the given device blocks as host arrays [L, N, BS, Hkv, D]."""
        idx = np.asarray(blocks, np.int32)
        if self.multihost:
            self._announce("READ_BLOCKS", (idx,))
        return self.read_blocks_local(idx)

    def read_blocks_local(self, idx: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """idx [N] int32."""
        if not self.multihost:
            return np.asarray(self.kv_pool.k[:, idx]), np.asarray(self.kv_pool.v[:, idx])
        k, v = self._read_fn(self.kv_pool, *self._inputs(idx))
        return np.asarray(k), np.asarray(v)

    def write_blocks(self, blocks: list[int], k_blocks: np.ndarray, v_blocks: np.ndarray) -> None:
        """Swap-in: host arrays [L, N, BS, Hkv, D] into the given device blocks."""
        idx = np.asarray(blocks, np.int32)
        if self.multihost:
            self._announce("WRITE_BLOCKS", (idx, np.asarray(k_blocks), np.asarray(v_blocks)))
        self.write_blocks_local(idx, k_blocks, v_blocks)

    def write_blocks_local(self, idx: np.ndarray, k_blocks: np.ndarray, v_blocks: np.ndarray) -> None:
        """idx [N] int32; k/v_blocks [L, N, BS, Hkv, D]."""
        self.kv_pool = self._write_fn(self.kv_pool, *self._inputs(idx, k_blocks, v_blocks))
