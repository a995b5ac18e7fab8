"""The native CPU matmul by quantized weights (qmatmul.cc): its Python entry and a numpy model of its numbers.

    y = qmatmul_native(x, codes, scales, layer, rows, n=N, bits=4, scale_mode=2, mode="int8")
    q, k, v = qmatmul3_native(x, ((cq, sq), (ck, sk), (cv, sv)), layer, rows, ns=(Nq, Nk, Nv), bits=4, scale_mode=2)

x [M, K] bfloat16 or float32; codes and scales in the panel layout of `jaxpaged.models.quant.to_panels` (stacked
[L, ...] and read at `layer` in place, or one matrix); returns [M, N] in out_dtype (default x's). Only the first
`rows` rows (an int32 scalar, traced or not; default all) are multiplied, the rest are zeros. mode "int8" quantizes
each row of x to int8 per block of 32 and multiplies with VPDPBUSD (llama.cpp's way); "bf16" dequantizes the codes to
bfloat16 in registers and multiplies with VDPBF16PS. `reference_int8` is the first in numpy, up to float32
summation order. The build and registration are native.py's.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels.cpu_native import native

MODES = {"int8": 0, "bf16": 1}
CODE_BYTES = {4: 256, 8: 512}


def qmatmul_is_fast() -> bool:
    """Whether the kernel has its AVX-512 VNNI path on this CPU (else plain loops: correct, slow)."""
    return native.available("qmatmul") and bool(native.library("qmatmul").JaxpagedQMatmulIsFast())


def qmatmul_uses_amx() -> bool:
    """Whether mode "int8" multiplies blocks of 16 rows on AMX tiles now (an AMX-INT8 CPU, JAXPAGED_NATIVE_AMX not 0):
    the same numbers as its VNNI path."""
    return qmatmul_is_fast() and bool(native.library("qmatmul").JaxpagedQMatmulUsesAmx())


def qmatmul_has_bf16_dot() -> bool:
    """Whether mode "bf16" has its AVX512_BF16 path here (else plain loops)."""
    return native.available("qmatmul") and bool(native.library("qmatmul").JaxpagedQMatmulHasBf16Dot())


def _check(x, codes, n: int, bits: int, out_dtype) -> None:
    if x.ndim != 2 or x.dtype not in (jnp.bfloat16, jnp.float32):
        raise ValueError(f"x must be [M, K] bfloat16 or float32, got {x.dtype}{list(x.shape)}")
    if out_dtype not in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float32)):
        raise ValueError(f"out_dtype must be bfloat16 or float32, got {out_dtype}")
    if bits not in CODE_BYTES or codes.dtype != jnp.uint8 or codes.ndim not in (3, 4) \
            or codes.shape[-1] != CODE_BYTES[bits]:
        raise ValueError(f"codes must be uint8 [L, G, B, {CODE_BYTES.get(bits)}] or [G, B, ...] for bits={bits}, got "
                         f"{codes.dtype}{list(codes.shape)}")
    groups, blocks = codes.shape[-3], codes.shape[-2]
    if groups % 4 or not (groups - 4) * 16 < n <= groups * 16 or not (blocks - 1) * 32 < x.shape[1] <= blocks * 32:
        raise ValueError(f"codes {list(codes.shape)} do not fit x {list(x.shape)} and n={n}: they need "
                         "ceil(N / 64) * 4 groups of 16 columns and ceil(K / 32) blocks of 32")
    if not native.available("qmatmul"):
        raise RuntimeError(f"the native quantized matmul is unavailable: {native.unavailable_reason('qmatmul')}")


def qmatmul_native(x: jax.Array, codes: jax.Array, scales: jax.Array, layer: jax.Array | int = 0,
                   rows: jax.Array | int | None = None, *, n: int, bits: int, scale_mode: int, mode: str = "int8",
                   out_dtype=None) -> jax.Array:
    """See the module docstring; raises ValueError naming what does not fit."""
    out_dtype = jnp.dtype(out_dtype or x.dtype)
    if mode not in MODES:
        raise ValueError(f"mode must be one of {', '.join(MODES)}, got {mode!r}")
    _check(x, codes, n, bits, out_dtype)
    i32 = native._int32
    call = native._ffi_call("JaxpagedQMatmul", jax.ShapeDtypeStruct((x.shape[0], n), out_dtype))
    return call(x, codes, scales, i32("layer", layer, 0), i32("rows", x.shape[0] if rows is None else rows, 0),
                bits=np.int64(bits), scale_mode=np.int64(scale_mode), mode=np.int64(MODES[mode]))


def qmatmul3_native(x: jax.Array, weights: tuple[tuple[jax.Array, jax.Array], ...], layer: jax.Array | int = 0,
                    rows: jax.Array | int | None = None, *, ns: tuple[int, int, int], bits: int, scale_mode: int,
                    mode: str = "int8", out_dtype=None) -> tuple[jax.Array, jax.Array, jax.Array]:
    """(x @ W0, x @ W1, x @ W2) in one call, each [M, N_i] in out_dtype (default x's): an attention layer's q, k and
    v. weights: three (codes, scales) of one format (bits, scale_mode) and K, with their own N (`ns`); the numbers of
    three `qmatmul_native` calls (x is prepared once, and the three products' columns shared out as one call's)."""
    out_dtype = jnp.dtype(out_dtype or x.dtype)
    if mode not in MODES:
        raise ValueError(f"mode must be one of {', '.join(MODES)}, got {mode!r}")
    if len(weights) != 3 or len(ns) != 3:
        raise ValueError(f"weights and ns must be three, got {len(weights)} and {len(ns)}")
    for (codes, _), n in zip(weights, ns, strict=True):
        _check(x, codes, n, bits, out_dtype)
        if codes.shape[:-3] != weights[0][0].shape[:-3]:
            raise ValueError("the three weights must be stacked alike, got codes "
                             f"{[list(c.shape) for c, _ in weights]}")
    i32 = native._int32
    call = native._ffi_call("JaxpagedQMatmul3", tuple(jax.ShapeDtypeStruct((x.shape[0], n), out_dtype) for n in ns))
    flat = [a for w in weights for a in w]
    return tuple(call(x, *flat, i32("layer", layer, 0), i32("rows", x.shape[0] if rows is None else rows, 0),
                      bits=np.int64(bits), scale_mode=np.int64(scale_mode), mode=np.int64(MODES[mode])))


GLU_ACTIVATIONS = {"silu": 0, "gelu_tanh": 1}


def qmatmul_glu_native(x: jax.Array, gate: tuple[jax.Array, jax.Array], up: tuple[jax.Array, jax.Array],
                       layer: jax.Array | int = 0, rows: jax.Array | int | None = None, *, n: int, bits: int,
                       scale_mode: int, activation: str = "silu") -> jax.Array:
    """act(x @ W_gate) * (x @ W_up) [M, N] in x's dtype, in one call (mode "int8"); gate and up are (codes, scales)
    of one shape and format. With bfloat16 x, rounded as the unfused bfloat16 computation: each product, act's every
    step (JAX's order, float32 exp and tanh approximations), the product."""
    if activation not in GLU_ACTIVATIONS:
        raise ValueError(f"activation must be one of {', '.join(GLU_ACTIVATIONS)}, got {activation!r}")
    if gate[0].shape != up[0].shape or gate[1].shape != up[1].shape:
        raise ValueError(f"the gate's and the up weight's arrays must have one shape, got {gate[0].shape}, "
                         f"{gate[1].shape} and {up[0].shape}, {up[1].shape}")
    _check(x, gate[0], n, bits, x.dtype)
    i32 = native._int32
    call = native._ffi_call("JaxpagedQMatmulGlu", jax.ShapeDtypeStruct((x.shape[0], n), x.dtype))
    return call(x, gate[0], gate[1], up[0], up[1], i32("layer", layer, 0),
                i32("rows", x.shape[0] if rows is None else rows, 0), bits=np.int64(bits),
                scale_mode=np.int64(scale_mode), act=np.int64(GLU_ACTIVATIONS[activation]))


def quantize_activations(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The kernel's int8 activations of x [M, K] (float32 values): (q [M, Kp] int8 per block of 32, d [M, B] float32),
    d = max|x| / 127 per block and q = round-to-nearest-even(x * (1 / d)), in float32 as the kernel computes them."""
    x = np.asarray(x, np.float32)
    m, k = x.shape
    kp = -(-k // 32) * 32
    xb = np.zeros((m, kp), np.float32)
    xb[:, :k] = x
    xb = xb.reshape(m, kp // 32, 32)
    d = (np.max(np.abs(xb), axis=-1) / np.float32(127.0)).astype(np.float32)
    inv = np.where(d != 0, np.float32(1.0) / np.where(d != 0, d, np.float32(1.0)), np.float32(0.0)).astype(np.float32)
    q = np.rint(xb * inv[..., None]).astype(np.int8)
    return q.reshape(m, kp), d


def reference_int8(x: np.ndarray, w: np.ndarray) -> np.ndarray:
    """mode "int8"'s result in float64 for x [M, K] and the dequantized weight w [K, N] (float32): the product of the
    kernel's quantized activations (q * d per block) and w. The kernel equals it up to float32 summation order."""
    q, d = quantize_activations(x)
    m, kp = q.shape
    xq = (q.reshape(m, kp // 32, 32).astype(np.float64) * d[..., None]).reshape(m, kp)[:, :w.shape[0]]
    return xq @ np.asarray(w, np.float64)


__all__ = ["qmatmul_native", "qmatmul3_native", "qmatmul_glu_native",
           "qmatmul_is_fast", "qmatmul_uses_amx", "qmatmul_has_bf16_dot", "quantize_activations",
           "reference_int8"]
