"""The seam between the runner, the model and the attention kernels: the KV pool, the per-step attention metadata,
and the one attention protocol every backend implements.

    attn(q, k, v, kv_pool, layer, md, *, scale=None, sliding_window=None, soft_cap=None) -> (out, kv_pool)

  q        [T, Hq, D]   the step's queries (RoPE applied), any float dtype
  k, v     [T, Hkv, D]  the step's new keys and values (RoPE applied to k)
  kv_pool  KVPool       the whole stacked pool, donated to the step
  layer    int32 scalar the model layer (traced inside the layer loop)
  md       AttentionMetadata
  out      [T, Hq, D]   q's dtype; 0 on padding tokens
The backend writes k and v into the pool at `md.slot_mapping` and then attends through the block tables, so a kernel
may fuse the write with the read later without the model changing. A model calls `attn` once per layer and never
touches the pool otherwise.

Everything here is a pytree: `KVPool` and `AttentionMetadata` are registered dataclasses, with the fields that pick
a compiled program (`tile_size`, `decode_blocks`) marked static, so the jitted step takes them as ordinary arguments.
The runner builds the metadata from numpy (`ModelRunner.prepare`); the same dataclass carries device arrays inside
the step. `pallas_kernels` knows nothing of these types: the adapters below unpack them into the kernels' arguments.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import math
from collections.abc import Callable, Hashable
from typing import Protocol

import jax
import jax.numpy as jnp
import numpy as np

from jaxpaged.worker.kv_quant import rotate
from pallas_kernels.fp8 import is_fp8, to_pool_dtype
from pallas_kernels.reference import write_kv_reference

logger = logging.getLogger(__name__)

ATTENTION_BACKENDS = ("auto", "reference", "pallas", "native")


@functools.partial(jax.tree_util.register_dataclass, data_fields=["k", "v"], meta_fields=[])
@dataclasses.dataclass
class KVPool:
    """The paged K/V cache of every layer, allocated once: k, v [L, NB, BS, Hkv, D] (layer, block, offset in the
    block, kv head, dim), float32, 16-bit or fp8 (jaxpaged/worker/kv_quant.py). Block 0 is the null block padding
    tokens write into. Passed into the jitted step donated and returned from it, so XLA updates it in place."""

    k: jax.Array
    v: jax.Array

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(self.k.shape)

    @property
    def dtype(self):
        return self.k.dtype

    def write(self, layer: jax.Array | int, k_new: jax.Array, v_new: jax.Array, slot_mapping: jax.Array,
              writer: Callable | None = None, k_scale: float | jax.Array = 1.0,
              v_scale: float | jax.Array = 1.0) -> KVPool:
        """The pool with k_new, v_new [T, Hkv, D] written at the flat slots [T] of `layer` (in place when the pool is
        carried through the layer loop of a donated step), by `writer` (`write_kv_reference`'s contract; default
        that: XLA's scatter). An fp8 pool gets k_new / k_scale and v_new / v_scale, saturated and rounded here, as
        they are written (`pallas_kernels.fp8.to_pool_dtype`)."""
        if is_fp8(self.dtype):
            k_new, v_new = to_pool_dtype(k_new, self.dtype, k_scale), to_pool_dtype(v_new, self.dtype, v_scale)
        k, v = (writer or write_kv_reference)(self.k, self.v, layer, k_new, v_new, slot_mapping)
        return KVPool(k, v)


@functools.partial(
    jax.tree_util.register_dataclass,
    data_fields=["positions", "slot_mapping", "block_tables", "context_lens", "query_start_loc", "logits_indices",
                 "prompt_lens"],
    meta_fields=["tile_size", "decode_blocks"])
@dataclasses.dataclass
class AttentionMetadata:
    """Where a step's T tokens (S sequences, block-table width W) sit in their sequences and in the pool.

    numpy on the host (built by `ModelRunner.prepare`), device arrays inside the jitted step. The static fields are
    part of the compiled program's identity: a change of either compiles (or picks) another program.
    """

    positions: jax.Array  # [T] int32, absolute position in the sequence; -1 = padding token
    slot_mapping: jax.Array  # [T] int32, flat pool slot (block * BS + offset) of each token's K/V; padding -> null
    block_tables: jax.Array  # [S, W] int32, logical -> physical block of each sequence
    context_lens: jax.Array  # [S] int32, tokens in the cache once this step's K/V are written (0 = padding row)
    query_start_loc: jax.Array  # [S + 1] int32, sequence s owns tokens [qsl[s], qsl[s + 1])
    logits_indices: jax.Array  # [S] int32, the token whose hidden state gives sequence s's next-token logits
    tile_size: int  # static: tokens per query tile: 16 for prefill steps (segments start at multiples), 1 for decode
    # and for the mixed steps of a backend that `mixes_steps`
    decode_blocks: int | None  # static: flat K/V block count of a decode-only step; None for prefill
    # [S] int32, each sequence's prompt length, for a kernel that `takes_prompt_lens`; None: not known
    prompt_lens: jax.Array | None = None

    @property
    def shape_key(self) -> tuple:
        """(tokens, sequences, block-table width, tile, decode blocks): one compiled step per key."""
        return (len(self.positions), len(self.context_lens), self.block_tables.shape[1], self.tile_size,
                self.decode_blocks)


class AttentionBackend(Protocol):
    def __call__(self, q: jax.Array, k: jax.Array, v: jax.Array, kv_pool: KVPool, layer: jax.Array | int,
                 md: AttentionMetadata, *, scale: float | None = None, sliding_window: int | None = None,
                 soft_cap: float | None = None) -> tuple[jax.Array, KVPool]: ...


# A kernel of `pallas_kernels`: (q, k_cache, v_cache, layer, block_tables, context_lens, query_start_loc, positions,
# *, scale, tile_size, sliding_window, soft_cap, decode_blocks) -> out, as `ragged_paged_attention_reference`.
Kernel = Callable[..., jax.Array]


@dataclasses.dataclass(frozen=True)
class KernelGeometry:
    """A model's attention as a kernel sees it, beside a step's shape (`PagedAttention.kernel_variant`)."""

    num_q_heads: int
    num_kv_heads: int
    block_size: int
    head_dim: int
    kv_itemsize: int  # bytes of a pool element (1 for fp8)


def same_work(num_tokens, num_seqs, width, tile_size, decode_blocks, geometry) -> int:
    """The native CPU kernel's variant: it reads only the blocks a sequence uses, whatever the tables' width."""
    return 0


def width_not_blocks(num_tokens, num_seqs, width, tile_size, decode_blocks, geometry) -> int:
    """The TPU kernel's variant: its decode work follows the table width, not decode_blocks."""
    return width if decode_blocks is None else 0


def gpu_splits(num_tokens, num_seqs, width, tile_size, decode_blocks, geometry: KernelGeometry) -> int:
    """The GPU kernel's variant: its flash-decoding split count (the one static choice that follows the shapes)."""
    from pallas_kernels.gpu import kv_splits

    return kv_splits(num_tokens, num_seqs, width, tile_size, decode_blocks, **dataclasses.asdict(geometry))


@dataclasses.dataclass(frozen=True)
class PagedAttention:
    """A backend over one ragged paged-attention kernel: writes the new K/V with `KVPool.write`, then runs `kernel`.

    `name` says which (for logs and tests); `dtypes` are the pool / query dtypes and `head_dims` the head sizes the
    kernel takes (None: any), checked when the engine is built (`refusal`) rather than at trace time.
    """

    name: str
    kernel: Kernel
    dtypes: tuple[np.dtype, ...] | None = None
    head_dims: tuple[int, ...] | None = None
    # What of a step's static shape the kernel's work follows: (num_tokens, num_seqs, width, tile_size,
    # decode_blocks, KernelGeometry) -> a hashable. Shapes that differ only in block-table width or decode_blocks
    # and give equal values run the same kernel work, so the runner compiles one of them, the widest (its tables
    # hold the others'). None: all of it (the reference gathers decode_blocks blocks and reads whole tables).
    kernel_variant: Callable[..., Hashable] | None = None
    # Whether the kernel's cost does not depend on how a step's tokens are laid out (the native CPU kernel works per
    # query token): prompt chunks then run at query tile 1 beside decodes in one step (the scheduler's mixed steps).
    # The reference and the Pallas kernels pad prompts to query tiles, so they keep prefill and decode steps apart.
    mixes_steps: bool = False
    # The K/V write (`write_kv_reference`'s contract); None: XLA's scatter. XLA CPU's scatter converts a 16-bit pool
    # to float32 and back, whole, around every write, so on CPU a 16-bit pool needs a native write (`writes_16bit`).
    kv_write: Callable | None = None
    # Whole-block writes for copy-on-write and swap-in, (k, v, dst [N], k_blocks, v_blocks [L, N, BS, Hkv, D]) ->
    # (k, v); None: XLA's scatter (same 16-bit caveat on CPU).
    block_write: Callable | None = None
    # An fp8 pool's per-layer scales (`kv_quant.KVScales`, set by the engine for an fp8 kv_cache_dtype): K and V are
    # divided by them as they are written and the kernel multiplies them back. None: no scales (not fp8, or 1.0).
    kv_scales: object | None = None
    # Whether the kernel takes `prompt_lens` (the native CPU kernel: prompt tokens in query tiles, the others one
    # token at a time, so a token's bits do not depend on how its sequence was cut into steps: the same tokens after
    # a prefix-cache hit, in any chunking, when verified or recomputed).
    takes_prompt_lens: bool = False

    @property
    def writes_16bit(self) -> bool:
        """Whether a 16-bit (or fp8) pool is written in place at the cost of the rows written on this platform."""
        return self.kv_write is not None or jax.default_backend() != "cpu"

    def __call__(self, q, k, v, kv_pool: KVPool, layer, md: AttentionMetadata, *, scale=None, sliding_window=None,
                 soft_cap=None):
        scales = {}
        if self.kv_scales is not None and is_fp8(kv_pool.dtype):
            k_scale, v_scale = self.kv_scales.at(layer)
            scales = dict(k_scale=k_scale, v_scale=v_scale)
            if self.kv_scales.rotate_keys:  # the pool holds H k, so the kernel gets H q (jaxpaged/worker/kv_quant.py)
                q, k = rotate(q), rotate(k, jnp.float32)
        kv_pool = kv_pool.write(layer, k, v, md.slot_mapping, self.kv_write, **scales)
        scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
        out = self.kernel(q, kv_pool.k, kv_pool.v, layer, md.block_tables, md.context_lens, md.query_start_loc,
                          md.positions, scale=scale, tile_size=md.tile_size, sliding_window=sliding_window,
                          soft_cap=soft_cap, decode_blocks=md.decode_blocks, **scales,
                          **({"prompt_lens": md.prompt_lens} if self.takes_prompt_lens else {}))
        return out, kv_pool

    def refusal(self, head_dim: int, *dtypes) -> str | None:
        """Why the kernel cannot run a model of `head_dim` with `dtypes` (the model's, the pool's); None if it can.
        Every kernel reads fp8 pools (pallas_kernels/fp8.py)."""
        for dtype in dtypes:
            if is_fp8(dtype):
                continue
            if self.dtypes is not None and np.dtype(dtype) not in self.dtypes:
                return (f"attention backend {self.name!r} takes {', '.join(d.name for d in self.dtypes)}, "
                        f"not {np.dtype(dtype).name}")
        if self.head_dims is not None and head_dim not in self.head_dims:
            return (f"attention backend {self.name!r} takes head_dim {', '.join(map(str, self.head_dims))}, "
                    f"not {head_dim}")
        return None


def attention_backend(backend: str = "auto") -> PagedAttention:
    """The paged-attention backend by option name: Pallas on GPU and TPU; on CPU ('auto') the native ragged kernel
    (pallas_kernels/cpu_native, built with g++ on first use) for every step, or the pure-JAX reference when the
    native kernel cannot be built (the reason is logged).

    'native' is the CPU path with the native kernel required (an error names why it is unavailable). 'pallas' on
    CPU runs the GPU kernel in the Pallas interpreter (slow; tests use it on tiny models)."""
    if backend not in ATTENTION_BACKENDS:
        raise ValueError(f"attention_backend={backend!r}; use one of {', '.join(ATTENTION_BACKENDS)}")
    platform = jax.default_backend()
    if backend in ("auto", "native") and platform == "cpu":
        from pallas_kernels import cpu_native

        if cpu_native.available("attention"):
            strict = backend == "native"
            return PagedAttention("native" if strict else "native_else_reference",
                                  functools.partial(cpu_native.native_else_reference, strict=strict),
                                  kernel_variant=same_work, mixes_steps=True, kv_write=cpu_native.write_kv_native,
                                  block_write=cpu_native.set_blocks_native, takes_prompt_lens=True)
        if backend == "native":
            raise ValueError(f"attention_backend='native' is unavailable: "
                             f"{cpu_native.unavailable_reason('attention')}")
        logger.info("native CPU attention unavailable (%s); using the reference",
                    cpu_native.unavailable_reason("attention"))
        backend = "reference"
    if backend == "native":
        raise ValueError(f"attention_backend='native' is the CPU kernel; the platform is {platform!r}")
    if backend == "auto":
        backend = "pallas" if platform in ("gpu", "cuda", "tpu") else "reference"
    if backend == "reference":
        from pallas_kernels.reference import ragged_paged_attention_reference

        return PagedAttention("reference", ragged_paged_attention_reference)
    from pallas_kernels.attention import paged_attention
    from pallas_kernels.validation import KERNEL_DTYPES

    implementation = {"tpu": "pallas_tpu", "gpu": "pallas_gpu", "cuda": "pallas_gpu"}.get(platform,
                                                                                          "pallas_interpret")
    if implementation == "pallas_tpu":
        from pallas_kernels.tpu import SUPPORTED_HEAD_DIMS
    else:
        from pallas_kernels.gpu import SUPPORTED_HEAD_DIMS
    variant = width_not_blocks if implementation == "pallas_tpu" else gpu_splits
    return PagedAttention(implementation, functools.partial(paged_attention, implementation=implementation),
                          KERNEL_DTYPES, SUPPORTED_HEAD_DIMS, kernel_variant=variant)


__all__ = ["ATTENTION_BACKENDS", "AttentionBackend", "AttentionMetadata", "KVPool", "KernelGeometry", "PagedAttention",
           "attention_backend"]
