"""Rotary position embedding of a layer's queries and keys, Hugging Face's convention (rotate the two halves).

    q, k = rope_qk(q, k, cos, sin)   # q [T, Hq, D], k [T, Hk, D]; cos, sin [T, 1, D/2] float32

Pure JAX (the halves in float32, rounded once to the input's dtype), unless the step is traced inside
`native_matmul` with a bfloat16 model (jaxpaged/models/matmul.py): then one native call for both tensors
(`cpu_native.rope_native`, the same numbers), where XLA CPU runs a fusion per tensor.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxpaged.models.matmul import uses_native


def rope(x: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
    """x [T, H, D]; cos, sin [T, 1, D/2] float32: each head's halves (x1, x2) -> (x1 cos - x2 sin, x2 cos + x1 sin)."""
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half].astype(jnp.float32), x[..., half:].astype(jnp.float32)
    return jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1).astype(x.dtype)


def rope_qk(q: jax.Array, k: jax.Array, cos: jax.Array, sin: jax.Array) -> tuple[jax.Array, jax.Array]:
    """(rope(q), rope(k)) for q [T, Hq, D] and k [T, Hk, D]."""
    if uses_native(q.reshape(q.shape[0], -1), k, "rope") and q.dtype == k.dtype:
        from pallas_kernels.cpu_native import rope_native

        return rope_native(q, k, cos, sin)
    return rope(q, cos, sin), rope(k, cos, sin)
