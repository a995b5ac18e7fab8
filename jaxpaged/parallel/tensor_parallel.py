"""Tensor parallelism: a 1-D device mesh, the Megatron split of a Llama-family model's weights, the K/V pool split by
kv head, and attention run per device through `shard_map`.

    mesh = make_mesh(tp)                                  # axis "tp" over the first tp devices (all processes')
    layout = HeadLayout.plan(config.num_heads, config.num_kv_heads, tp)
    config, state = place_llama_state(config, numpy_state, layout, mesh, dtype)   # each device gets its shards only
    attn = ShardedAttention(attention_backend(...), mesh)

The step stays one jitted program in the global view (GSPMD): q/k/v, gate and up are split by columns, o and down by
rows, so each layer's two row-parallel matmuls end in one all-reduce each, and nothing else in a layer talks across
devices. Embedding and LM head are split over the vocabulary; the sampler sees the gathered logits.

Heads. Each device holds `kv_per_device` kv-head slots and `group` query-head slots per kv slot, laid out device by
device; query slot s attends with kv slot s // group, as in any GQA model, so the kernels run unchanged on each
device's slice. When tp divides num_kv_heads and num_heads this is the plain split. Otherwise (SmolLM2: 9 query and
3 kv heads) kv heads are replicated, as vLLM does when tp > num_kv_heads, so each device holds the kv heads its query
heads need, and query heads are padded with zero weights (their output is multiplied by zero rows of o) so every
device has as many. The plan is the one that holds the fewest kv heads per device, then the fewest padded queries.

Quantized weights (`jaxpaged.models.quant.QuantizedWeight`, int8 or a GGUF's kept formats) split the same way, on
their codes and scales as stored ([*lead, N, K bytes], blocks of 32 along K): a column split cuts N (codes and
scales alike), a row split cuts K at block boundaries (whole blocks of 32 per device; int8's per-channel scales
are replicated: they scale the summed output). Heads are rearranged on the codes too, a padded
head's weights made exactly zero (zero scales, or int8's zero code), so nothing is quantized again: the numbers are
tp 1's.

Products. GSPMD splits XLA's dot by the weights' shardings, but not a kernel's custom call (it would gather the
weights to every device). So the step's layer products that run a kernel (the Pallas GPU layer matmul, the Pallas
quantized matmuls) run it on each device's shard through `shard_map` (`quant.on_shards`): by columns on the whole
x, by rows on x's columns, then an all-reduce of the partial products. The models name each product's split
(`matmul.layer_matmul(..., split=ROWS)`); `quant.split_axes` is the one rule for both placement and products.
"""

from __future__ import annotations

import dataclasses
import functools
import logging

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from jaxpaged.models.quant import BLOCK, CHANNEL, COLUMNS, ROWS, QuantizedWeight, is_quantized, split_specs
from jaxpaged.worker.attention import KVPool

logger = logging.getLogger(__name__)

AXIS = "tp"
POOL_SPEC = P(None, None, None, AXIS, None)  # [L, NB, BS, Hkv, D]: each device its kv heads of every block


def make_mesh(tensor_parallel_size: int) -> Mesh:
    """A 1-D mesh named "tp" over `tensor_parallel_size` devices (jax.devices(): every process's, in order)."""
    devices = jax.devices()
    if tensor_parallel_size > len(devices):
        raise ValueError(f"tensor_parallel_size={tensor_parallel_size} exceeds the {len(devices)} devices available "
                         f"({devices[0].platform}); on CPU, XLA_FLAGS=--xla_force_host_platform_device_count=N "
                         "(set before JAX starts) makes N devices")
    return Mesh(np.asarray(devices[:tensor_parallel_size]), (AXIS,))


def check_tensor_parallel_size(tp: int) -> None:
    """tp must divide the number of devices this program sees (local devices times processes)."""
    n = jax.device_count()
    if tp > n or n % tp:
        raise ValueError(f"tensor_parallel_size={tp} must divide the number of devices ({n} "
                         f"{jax.devices()[0].platform} device(s) over {jax.process_count()} process(es)); "
                         f"use one of {', '.join(str(d) for d in range(1, n + 1) if n % d == 0)}")


@dataclasses.dataclass(frozen=True)
class HeadLayout:
    """Where each query and kv head lives across `tp` devices.

    q_heads [tp * kv_per_device * group]: the model's query head in each query slot, -1 for a zero-padded slot.
    kv_heads [tp * kv_per_device]: the model's kv head in each kv slot (a padding slot repeats a head; no real query
    reads it).
    """

    tp: int
    kv_per_device: int
    group: int
    q_heads: tuple[int, ...]
    kv_heads: tuple[int, ...]

    @property
    def num_heads(self) -> int:
        return len(self.q_heads)

    @property
    def num_kv_heads(self) -> int:
        return len(self.kv_heads)

    @property
    def is_plain_split(self) -> bool:
        return self.q_heads == tuple(range(len(self.q_heads))) and self.kv_heads == tuple(range(len(self.kv_heads)))

    @classmethod
    def plan(cls, num_heads: int, num_kv_heads: int, tp: int) -> HeadLayout:
        g = num_heads // num_kv_heads  # the model's query heads per kv head
        kv_per_device = -(-num_kv_heads // tp)
        while True:
            slots = tp * kv_per_device
            # fewest query slots per kv slot such that every kv head's g queries fit in its copies
            for group in range(1, g + 1):
                copies = -(-g // group)
                if num_kv_heads * copies <= slots:
                    break
            else:
                kv_per_device += 1
                continue
            break
        kv_heads, q_heads = [], []
        for h in range(num_kv_heads):
            for c in range(copies):
                kv_heads.append(h)
                for j in range(group):
                    q = c * group + j
                    q_heads.append(h * g + q if q < g else -1)
        while len(kv_heads) < slots:  # spare slots: a copy of head 0 that only padded queries read
            kv_heads.append(0)
            q_heads += [-1] * group
        return cls(tp, kv_per_device, group, tuple(q_heads), tuple(kv_heads))

    def describe(self, num_heads: int, num_kv_heads: int) -> str:
        if self.is_plain_split:
            return (f"{num_heads} query / {num_kv_heads} kv heads split {self.tp} ways: "
                    f"{self.group * self.kv_per_device} / {self.kv_per_device} per device")
        padded = sum(q < 0 for q in self.q_heads)
        return (f"{num_kv_heads} kv heads do not split {self.tp} ways: kv heads replicated as vLLM does, "
                f"{self.kv_per_device} per device ({self.num_kv_heads} slots for {num_kv_heads} heads), "
                f"{self.group * self.kv_per_device} query heads per device ({padded} zero-padded)")


def _expand_heads(w: np.ndarray, heads: tuple[int, ...], head_dim: int, axis: int) -> np.ndarray:
    """w with its `axis` (heads * head_dim) rearranged into the slots `heads` (-1: zeros)."""
    w = np.moveaxis(w, axis, -1)
    split = w.reshape(*w.shape[:-1], -1, head_dim)
    index = np.asarray([max(h, 0) for h in heads])
    out = np.take(split, index, axis=-2)
    out = np.where(np.asarray(heads)[:, None] >= 0, out, np.zeros((), out.dtype))
    return np.moveaxis(out.reshape(*w.shape[:-1], len(heads) * head_dim), -1, axis)


def _slot_index(heads: tuple[int, ...], width: int) -> tuple[np.ndarray, np.ndarray]:
    """(index, real) [len(heads) * width]: for each slot's `width` positions, the model's position it takes (a
    padded slot: head 0's) and whether it is a real head's."""
    index = np.asarray([max(h, 0) * width + j for h in heads for j in range(width)])
    return index, np.repeat(np.asarray(heads) >= 0, width)


def _zero_where_padded(scales: np.ndarray, real: np.ndarray, axis: int) -> np.ndarray:
    return np.where(real.reshape((-1,) + (1,) * (scales.ndim - axis - 1)), scales, np.zeros((), scales.dtype))


def _expand_quantized_columns(qw: QuantizedWeight, heads: tuple[int, ...], head_dim: int) -> QuantizedWeight:
    """A quantized [*lead, K, N] matrix (q, k, v) whose N = heads * head_dim output columns (rows of its codes and
    scales) are rearranged into the slots `heads`; a padded slot's scales are zero, so its weights are exactly zero
    in every format (w = s * (u - offset), or s * u + m with m zero too)."""
    axis = len(qw.lead)  # N in codes [*lead, N, K bytes] and in every scale layout
    index, real = _slot_index(heads, head_dim)
    scales = _zero_where_padded(np.take(qw.scales, index, axis=axis), real, axis)
    return qw.replace(codes=np.take(qw.codes, index, axis=axis), scales=scales,
                      dense_shape=(*qw.dense_shape[:-1], len(index)))


def _expand_quantized_rows(qw: QuantizedWeight, heads: tuple[int, ...], head_dim: int) -> QuantizedWeight:
    """A quantized [*lead, K, N] matrix (o) whose K = heads * head_dim inputs are rearranged into the slots `heads`;
    a padded slot's weights are exactly zero (int8: code 128; the block formats: zero scales). The block formats
    move whole blocks of 32 inputs, so head_dim must be a multiple of 32 (ValueError otherwise)."""
    if qw.scale_mode == CHANNEL:  # one byte per input; K padded with code 128 (weight 0) to a whole block
        index, real = _slot_index(heads, head_dim)
        codes = np.where(real, np.take(qw.codes, index, axis=-1), np.uint8(128))
        codes = np.pad(codes, [(0, 0)] * (codes.ndim - 1) + [(0, -len(index) % BLOCK)], constant_values=128)
        return qw.replace(codes=codes, dense_shape=(*qw.dense_shape[:-2], len(index), qw.dense_shape[-1]))
    if head_dim % BLOCK:
        raise ValueError(f"tensor parallelism moves whole heads of {head_dim} inputs, which a {qw.format} weight's "
                         f"blocks of {BLOCK} do not fit; use quantization='int8' or None")
    blocks, block_bytes = head_dim // BLOCK, BLOCK * qw.bits // 8
    b_index, b_real = _slot_index(heads, blocks)
    byte_index = (b_index[:, None] * block_bytes + np.arange(block_bytes)).reshape(-1)
    axis = len(qw.lead) + 1  # B in the block scale layouts [*lead, N, B(, 2)]
    scales = _zero_where_padded(np.take(qw.scales, b_index, axis=axis), b_real, axis)
    return qw.replace(codes=np.take(qw.codes, byte_index, axis=-1), scales=scales,
                      dense_shape=(*qw.dense_shape[:-2], len(heads) * head_dim, qw.dense_shape[-1]))


def expand_llama_params(params: dict, layout: HeadLayout, head_dim: int) -> dict:
    """The Llama-layout params (nested dict of numpy; quantized weights `QuantizedWeight`s of numpy arrays) with
    heads rearranged into `layout`'s slots (a no-op for a plain split)."""
    if layout.is_plain_split:
        return params
    layers = dict(params["layers"])
    for name, heads, axis in (("wq", layout.q_heads, -1), ("wk", layout.kv_heads, -1), ("wv", layout.kv_heads, -1),
                              ("bq", layout.q_heads, -1), ("bk", layout.kv_heads, -1), ("bv", layout.kv_heads, -1),
                              ("wo", layout.q_heads, 1)):
        w = layers.get(name)
        if w is None:
            continue
        if is_quantized(w):
            expand = _expand_quantized_rows if name == "wo" else _expand_quantized_columns
            layers[name] = expand(w, heads, head_dim)
        else:
            layers[name] = _expand_heads(np.asarray(w), heads, head_dim, axis)
    return {**params, "layers": layers}


# Megatron split of the Llama layout (jaxpaged.loader.layout): name -> how "tp" splits it (absent: replicated). By
# columns: a matrix's outputs N (q/k/v, gate, up, the LM head's vocabulary) and a bias; by rows: its inputs K (o,
# down). The embedding table [V, H] is split over its vocabulary rows.
_SPLIT = {"embed": COLUMNS, "lm_head": COLUMNS, "wq": COLUMNS, "wk": COLUMNS, "wv": COLUMNS, "bq": COLUMNS,
          "bk": COLUMNS, "bv": COLUMNS, "w_gate": COLUMNS, "w_up": COLUMNS, "wo": ROWS, "w_down": ROWS}


def llama_partition_specs(params: dict, tp: int) -> dict:
    """A PartitionSpec per leaf of the Llama-layout params (for a quantized weight, a `QuantizedWeight` holding one
    for its codes and one for its scales), by `quant.split_specs`, the rule the step's products follow too. What tp
    does not split so (a vocabulary of 50257) is left replicated, and said so."""
    def spec(path, x):
        name, where = path[-1].key, "/".join(p.key for p in path)
        split, specs = _SPLIT.get(name), None
        if split is not None:
            if name == "embed" and not is_quantized(x):  # [V, H]: the vocabulary is its rows
                specs = P(AXIS, None) if np.shape(x)[0] % tp == 0 else None
            else:
                specs = split_specs(x, split, tp, AXIS)
            if specs is None:
                logger.warning("%s %s: does not split %d ways by %s (quantized, by rows: in whole blocks of %d "
                               "each); replicated", where, np.shape(x), tp, split, BLOCK)
        if specs is None:  # replicated
            return x.replace(codes=P(), scales=P()) if is_quantized(x) else P()
        return specs

    return jax.tree_util.tree_map_with_path(spec, params, is_leaf=is_quantized)


def place(params: dict, specs: dict, mesh: Mesh, dtype) -> dict:
    """Each leaf cast on the host and put on the mesh with its spec: a device receives only its shard. A quantized
    weight's codes and scales keep their dtypes; its compute dtype becomes `dtype`."""
    def put(x, spec, cast=True):
        x = np.asarray(x)
        if cast and np.issubdtype(x.dtype, np.floating):
            x = x.astype(dtype, copy=False)
        return jax.device_put(x, NamedSharding(mesh, spec))

    def put_leaf(x, spec):
        if is_quantized(x):
            return x.replace(codes=put(x.codes, spec.codes, cast=False), scales=put(x.scales, spec.scales, cast=False),
                             compute_dtype=np.dtype(dtype).name)
        return put(x, spec)

    return jax.tree.map(put_leaf, params, specs, is_leaf=is_quantized)


def pool_sharding(mesh: Mesh) -> NamedSharding:
    return NamedSharding(mesh, POOL_SPEC)


def replicated(mesh: Mesh) -> NamedSharding:
    return NamedSharding(mesh, P())


@dataclasses.dataclass(frozen=True)
class ShardedAttention:
    """An attention backend run on each device's heads through `shard_map`: q [T, Hq, D] and k, v [T, Hkv, D] split
    by head, the pool by kv head, the metadata replicated. The inner backend (reference, native CPU, Pallas) sees a
    one-device problem with Hq / tp query and Hkv / tp kv heads and writes its slice of the pool in place."""

    inner: object
    mesh: Mesh

    @property
    def name(self) -> str:
        return f"{self.inner.name} x tp={self.mesh.size}"

    @property
    def kernel_variant(self):
        """The inner backend's, for one device's heads."""
        inner = getattr(self.inner, "kernel_variant", None)
        if inner is None:
            return None
        tp = self.mesh.size

        def variant(num_tokens, num_seqs, width, tile_size, decode_blocks, geometry):
            local = dataclasses.replace(geometry, num_q_heads=max(1, geometry.num_q_heads // tp),
                                        num_kv_heads=max(1, geometry.num_kv_heads // tp))
            return inner(num_tokens, num_seqs, width, tile_size, decode_blocks, local)

        return variant

    @property
    def mixes_steps(self) -> bool:
        return getattr(self.inner, "mixes_steps", False)

    @property
    def writes_16bit(self) -> bool:
        return getattr(self.inner, "writes_16bit", jax.default_backend() != "cpu")

    def __call__(self, q, k, v, kv_pool: KVPool, layer, md, *, scale=None, sliding_window=None, soft_cap=None):
        heads = P(None, AXIS, None)
        pool = KVPool(POOL_SPEC, POOL_SPEC)
        body = functools.partial(self.inner, scale=scale, sliding_window=sliding_window, soft_cap=soft_cap)
        return jax.shard_map(body, mesh=self.mesh, in_specs=(heads, heads, heads, pool, P(), P()),
                             out_specs=(heads, pool), check_vma=False)(q, k, v, kv_pool, layer, md)


def per_device_bytes(tree) -> dict:
    """{device: bytes of the tree's shards on it}."""
    out: dict = {}
    for x in jax.tree.leaves(tree):
        for shard in x.addressable_shards:
            out[shard.device] = out.get(shard.device, 0) + shard.data.nbytes
    return out


__all__ = ["AXIS", "HeadLayout", "ShardedAttention", "check_tensor_parallel_size", "expand_llama_params",
           "llama_partition_specs", "make_mesh", "per_device_bytes", "place", "pool_sharding", "replicated"]
