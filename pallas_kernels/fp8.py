"""8-bit float K/V pools: the formats, and the one rule by which K/V are stored in them and read back.

A pool in an fp8 dtype holds round(x / scale) saturated to the format's finite range, where x is a K or V row as the
model computed it and `scale` is one float32 per pool (K or V) and layer (vLLM's per-tensor `k_scale` / `v_scale`);
every kernel reads it back as fp8_value * scale, computing in float32 (or bfloat16 where the kernel's dots run in
bfloat16: every fp8 value is exact in bfloat16). Rounding is to nearest even (XLA's convert). Saturation, not
overflow: float8_e4m3fn has no infinity, so XLA's convert would turn |x| > 448 into NaN, and one NaN in the cache
poisons every later token of its sequence; float8_e5m2 would give inf. vLLM saturates the same way.

Kernels fold the scales rather than multiply every element: q . (k * k_scale) = (q . k) * k_scale and
sum_j p_j (v_j * v_scale) = (sum_j p_j v_j) * v_scale, so a kernel multiplies its softmax scale by k_scale and its
output by v_scale (the reference dequantizes explicitly, as the readable statement of the rule).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

# vLLM's names for kv_cache_dtype -> the pool's dtype ("fp8" is e4m3, as on CUDA).
FP8_NAMES = {"fp8": jnp.dtype(jnp.float8_e4m3fn), "fp8_e4m3": jnp.dtype(jnp.float8_e4m3fn),
             "fp8_e5m2": jnp.dtype(jnp.float8_e5m2)}
FP8_DTYPES = (jnp.dtype(jnp.float8_e4m3fn), jnp.dtype(jnp.float8_e5m2))


def is_fp8(dtype) -> bool:
    return np.dtype(dtype) in FP8_DTYPES


def fp8_max(dtype) -> float:
    """The largest finite value of an fp8 dtype: 448 for e4m3fn, 57344 for e5m2."""
    return float(jnp.finfo(dtype).max)


def to_pool_dtype(x: jax.Array, dtype, scale: float | jax.Array = 1.0) -> jax.Array:
    """x as a pool of `dtype` stores it: for fp8, x / scale (float32) saturated to the finite range, then rounded;
    for other dtypes a plain cast (scale must then be 1)."""
    if not is_fp8(dtype):
        return x.astype(dtype)
    limit = fp8_max(dtype)
    return jnp.clip(x.astype(jnp.float32) / scale, -limit, limit).astype(dtype)


def dequantize(x: jax.Array, scale: float | jax.Array = 1.0) -> jax.Array:
    """A pool's values as float32: x * scale (x any float dtype; scale 1 for pools that are not fp8)."""
    x = x.astype(jnp.float32)
    return x if isinstance(scale, (int, float)) and scale == 1.0 else x * scale


__all__ = ["FP8_DTYPES", "FP8_NAMES", "dequantize", "fp8_max", "is_fp8", "to_pool_dtype"]
