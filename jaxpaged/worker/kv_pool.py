"""The KV pool on the device: its allocation, its device format, its bytes per block, and whole-block updates
(copy-on-write copies and swap-ins) as jitted functions that take the pool donated.

The pool's device layout (`pool_format`): on TPU the pool is allocated, and passes through every jitted function
that takes it (the step, the block copy, the swap-in write), in an explicit row-major format, the layout the Pallas
TPU kernel's custom call takes; a pool in XLA's default TPU layout for head_dim 64 would be copied whole, in and
out, on every step. Row-major TPU tiles pad the pool's (Hkv, D) dimensions, so a block's HBM bytes are measured from
XLA (`pool_block_bytes`) rather than counted. CPU and GPU keep their default layouts (already row-major).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental.layout import Format, Layout
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from jaxpaged.models.contract import ModelSpec
from jaxpaged.worker.attention import KVPool


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


ROW_MAJOR_POOL = Layout(major_to_minor=(0, 1, 2, 3, 4))  # of [L, NB, BS, Hkv, D]


def pool_format(device: jax.Device, sharding: NamedSharding | None = None) -> Format | NamedSharding | None:
    """The K/V pool's explicit format on `device`: row-major on TPU, None (the default layout) elsewhere.

    The Pallas TPU kernel's custom call takes the pool row-major, and XLA's default TPU layout for head_dim 64 puts
    the block axis minor-most: every step would copy both pools to row-major and back (pallas_kernels/tpu.py, "The
    pool's HBM layout"). CPU and GPU default layouts are row-major already.

    Under tensor parallelism `sharding` is the pool's split by kv head (`tensor_parallel.pool_sharding`): that
    sharding, in the row-major format on TPU.
    """
    if sharding is not None:
        return Format(ROW_MAJOR_POOL, sharding) if device.platform == "tpu" else sharding
    if device.platform != "tpu":
        return None
    return Format(ROW_MAJOR_POOL, jax.sharding.SingleDeviceSharding(device))


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


