"""Argument checks every ragged paged-attention kernel shares (the contract of reference.py)."""

from __future__ import annotations

import jax.numpy as jnp

from pallas_kernels.fp8 import FP8_DTYPES

SUPPORTED_BLOCK_SIZES = (8, 16, 32)  # the one list: the engine's block_size option is checked against it
KERNEL_DTYPES = (jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16))  # q and pool dtypes the kernels take
POOL_DTYPES = KERNEL_DTYPES + FP8_DTYPES  # pools may also be fp8 (fp8.py), read with q's dtype or float32


def validate_ragged_inputs(kernel: str, q, k_cache, v_cache, block_tables, context_lens, query_start_loc, positions,
                           tile_size: int, head_dims: tuple[int, ...]) -> None:
    """Raises ValueError naming the bad argument and what `kernel` (e.g. "Pallas GPU kernel") takes instead."""
    if q.ndim != 3 or k_cache.ndim != 5:
        raise ValueError(f"q must be [T, Hq, D] and k_cache [L, NB, BS, Hkv, D]; got q{q.shape}, "
                         f"k_cache{k_cache.shape}")
    if k_cache.shape != v_cache.shape:
        raise ValueError(f"k_cache{k_cache.shape} and v_cache{v_cache.shape} must have the same shape")
    num_tokens, num_q_heads, head_dim = q.shape
    _, _, block_size, num_kv_heads, kv_dim = k_cache.shape
    if head_dim not in head_dims:
        raise ValueError(f"head_dim={head_dim} is not supported by the {kernel}; use one of "
                         f"{', '.join(map(str, head_dims))}")
    if kv_dim != head_dim:
        raise ValueError(f"k_cache head_dim={kv_dim} must equal q's head_dim={head_dim}")
    if block_size not in SUPPORTED_BLOCK_SIZES:
        raise ValueError(f"block_size={block_size} is not supported by the {kernel}; use one of "
                         f"{', '.join(map(str, SUPPORTED_BLOCK_SIZES))}")
    if num_q_heads % num_kv_heads:
        raise ValueError(f"num_q_heads={num_q_heads} must be a multiple of num_kv_heads={num_kv_heads}")
    if jnp.dtype(q.dtype) not in KERNEL_DTYPES:
        raise ValueError(f"q dtype {q.dtype} is not supported by the {kernel}; use float32 or bfloat16")
    if k_cache.dtype != v_cache.dtype:
        raise ValueError(f"k_cache ({k_cache.dtype}) and v_cache ({v_cache.dtype}) need one dtype")
    if jnp.dtype(k_cache.dtype) not in POOL_DTYPES:
        raise ValueError(f"k_cache dtype {k_cache.dtype} is not supported by the {kernel}; use float32, bfloat16, "
                         "float8_e4m3fn or float8_e5m2")
    if tile_size < 1 or num_tokens % tile_size:
        raise ValueError(f"num_tokens={num_tokens} must be a multiple of tile_size={tile_size} (>= 1)")
    num_seqs = block_tables.shape[0]
    if block_tables.ndim != 2 or context_lens.shape != (num_seqs,) or query_start_loc.shape != (num_seqs + 1,):
        raise ValueError(f"block_tables{block_tables.shape} must be [S, W], context_lens{context_lens.shape} [S] "
                         f"and query_start_loc{query_start_loc.shape} [S + 1]")
    if positions.shape != (num_tokens,):
        raise ValueError(f"positions{positions.shape} must be [T] with T={num_tokens}")
