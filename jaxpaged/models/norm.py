"""The models' RMSNorm, and a decoder layer's norms and residual adds over stacked weights (native where the step's
matmuls are).

    x = rms_norm(x, weight, eps)                          # Hugging Face's: normalise in float32, cast back, scale
    x = rms_norm(x, weight, eps, unit_offset=True)        # Gemma's: scale by (1 + weight) in float32, then cast
    x = layer_rms_norm(h, w, layer, eps)                  # rms_norm(h, w[layer]) of a stacked w [L, H]
    s, x = layer_add_rms_norm(h, delta, w, layer, eps)    # s = h + delta; x = rms_norm(s, w[layer])
    h = residual_add(s, delta)                            # s + delta, in delta's dtype

Each is pure JAX (s in h's dtype), unless the step is traced inside `native_matmul` with a bfloat16 model
(jaxpaged/models/matmul.py): then they are norm.cc's calls (`cpu_native.rms_norm_native`, `add_round_native`), and s
is float32. Their numbers are those of the step XLA compiles from the pure-JAX layer, which keeps the sum h + delta in
float32 for the norm after it and rounds it to bfloat16 before the next residual add; only the float32 summation
order of the norm's mean differs. Every norm of a native step runs natively, the LM head's and the heads' q/k norms
too: XLA's fused norm sums a row's squares in an order that depends on how many rows the step has, so a row's bits
(and, rarely, a close greedy choice) would depend on the batch it ran in. XLA CPU also runs each norm as four to six
small fusions (benchmarks/step_anatomy.py's per-operation profile); natively a decode layer's norm is one call over a
few rows.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxpaged.models.matmul import uses_native


def rms_norm(x: jax.Array, weight: jax.Array, eps: float, unit_offset: bool = False) -> jax.Array:
    """x [T, ..., H] normalised over its last axis, as Hugging Face does: in float32, cast back, then scaled by
    weight [H] (Llama's); unit_offset: scaled by (1 + weight) in float32, then cast back (Gemma's). Natively inside a
    native step, each of its rows [.., H] summed the same way whatever the step."""
    if x.ndim > 1 and weight.ndim == 1 and uses_native(x.reshape(x.shape[0], -1), weight, "norm"):
        from pallas_kernels.cpu_native import rms_norm_native

        out = rms_norm_native(x.reshape(-1, x.shape[-1]), weight, 0, eps, unit_offset=unit_offset)[1]
        return out.reshape(x.shape)
    xf = x.astype(jnp.float32)
    xf = xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + eps)
    if unit_offset:
        return (xf * (1.0 + weight.astype(jnp.float32))).astype(x.dtype)
    return weight * xf.astype(x.dtype)


def layer_rms_norm(h: jax.Array, weight: jax.Array, layer: jax.Array | int, eps: float) -> jax.Array:
    """rms_norm(h [T, H], weight[layer], eps) for weight [L, H] stacked over layers."""
    if uses_native(h, weight, "norm"):
        from pallas_kernels.cpu_native import rms_norm_native

        return rms_norm_native(h, weight, layer, eps)[1]
    return rms_norm(h, weight[layer], eps)


def layer_add_rms_norm(h: jax.Array, delta: jax.Array, weight: jax.Array, layer: jax.Array | int,
                       eps: float) -> tuple[jax.Array, jax.Array]:
    """(s, rms_norm(s, weight[layer], eps)) with s = h + delta [T, H] (float32 natively, else h's dtype)."""
    if uses_native(h, weight, "norm") and delta.dtype == h.dtype:
        from pallas_kernels.cpu_native import rms_norm_native

        return rms_norm_native(h, weight, layer, eps, delta=delta)
    s = h + delta
    return s, rms_norm(s, weight[layer], eps)


def residual_add(s: jax.Array, delta: jax.Array) -> jax.Array:
    """s + delta in delta's dtype, for the s of `layer_add_rms_norm` (natively a float32 s, rounded to bfloat16
    first, as XLA's step rounds the residual)."""
    if s.dtype == jnp.float32 and uses_native(delta, delta, "norm"):
        from pallas_kernels.cpu_native import add_round_native

        return add_round_native(s, delta)
    return (s + delta).astype(delta.dtype)
