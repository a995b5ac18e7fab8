"""Random quantized weights for tests: every format the engine keeps, in the plain layout (codes and scales as
loaders store them), for the native kernel's tests and the jnp path's.

    qw = random_weight(np.random.default_rng(0), "q4_1", layers=2, k=50, n=70)  # a stacked [2, 50, 70] weight
"""

from __future__ import annotations

import numpy as np

from jaxpaged.models import quant

# (bits, scale mode): what each format is stored as
FORMS = {"int8": (8, quant.CHANNEL), "q8_0": (8, quant.BLOCK_SYM), "q4_0": (4, quant.BLOCK_SYM),
         "q4_1": (4, quant.BLOCK_F16), "q8_1": (8, quant.BLOCK_F16), "q4_k": (4, quant.BLOCK_F32),
         "q8_k": (8, quant.BLOCK_F32)}


def random_weight(rng, fmt: str, layers: int, k: int, n: int) -> quant.QuantizedWeight:
    """Random codes and scales (plain layout) of a stacked [layers, K, N] weight."""
    bits, mode = FORMS[fmt]
    kp = -(-k // 32) * 32
    u = rng.integers(0, 2 ** bits, size=(layers, n, kp), dtype=np.uint8)
    codes = u if bits == 8 else (u.reshape(layers, n, -1, 32)[..., :16] | (u.reshape(layers, n, -1, 32)[..., 16:] << 4)
                                 ).astype(np.uint8).reshape(layers, n, kp // 2)
    s = rng.random((layers, n, kp // 32)).astype(np.float32) * 0.02 + 1e-3
    if mode == quant.CHANNEL:
        scales = s[..., 0]
    elif mode == quant.BLOCK_SYM:
        scales = s.astype(np.float16)
    else:
        mins = -rng.random(s.shape).astype(np.float32) * 0.1
        scales = np.stack([s, mins], -1).astype(np.float16 if mode == quant.BLOCK_F16 else np.float32)
    return quant.QuantizedWeight(codes, scales, bits, mode, (layers, k, n), compute_dtype="bfloat16")


def f64(a) -> np.ndarray:
    return np.asarray(a, np.float64)


# ---- the Pallas quantized matmuls' tests (tests/kernels/test_gpu_qmatmul.py, test_tpu_qmatmul.py) -------------------

BLOCK_FORMATS = ["q8_0", "q4_0", "q4_1", "q4_k", "q8_1", "q8_k"]  # every kept format with per-block scales
LAYERS, LAYER = 3, 1  # a stacked weight of LAYERS, the kernels asked for LAYER


def kernel_args(qw: quant.QuantizedWeight) -> dict:
    return dict(bits=qw.bits, pair=qw.scale_mode in (quant.BLOCK_F16, quant.BLOCK_F32))


def layered_weight(fmt: str, k: int, n: int, seed: int) -> quant.QuantizedWeight:
    """A stacked [LAYERS, K, N] weight whose other layers' scales are NaN: reading any layer but LAYER shows."""
    import jax
    import jax.numpy as jnp

    qw = random_weight(np.random.default_rng(seed), fmt, LAYERS, k, n)
    scales = np.full_like(qw.scales, np.nan)
    scales[LAYER] = qw.scales[LAYER]
    return jax.tree.map(jnp.asarray, qw.replace(scales=scales))


def check_layer_product(qw: quant.QuantizedWeight, x, got) -> None:
    """got equals x times LAYER's weights rounded to x's dtype up to float32 sum order, and x times the float32
    weights up to that rounding (bf16: 2^-8 of each weight)."""
    import jax.numpy as jnp

    w32 = f64(quant.dequantize(qw, np.float32, LAYER))  # [K, N]
    w_x = f64(quant.dequantize(qw, np.float32, LAYER).astype(x.dtype))
    xs = f64(x)
    got = np.asarray(got)
    assert got.shape == (x.shape[0], qw.n) and got.dtype == np.float32
    scale = np.abs(xs) @ np.abs(w32) + 1e-30
    np.testing.assert_array_less(np.abs(got - xs @ w_x), 8 * np.finfo(np.float32).eps * np.sqrt(qw.k) * scale)
    rounding = 2.0 ** -8 if x.dtype == jnp.bfloat16 else 1e-6
    np.testing.assert_array_less(np.abs(got - xs @ w32), rounding * scale)


def check_engine_branch(branch, fmt: str) -> None:
    """`branch` (one of quant's platform matmuls: (x, codes, scales, layer=, qw=), its kernel run by the interpreter)
    gives the dequantize-then-dot branch's product on LAYER of a stacked weight, from the stacked arrays."""
    import functools

    import jax
    import jax.numpy as jnp

    qw = layered_weight(fmt, 96, 40, seed=11)
    x = jnp.asarray(np.random.default_rng(12).standard_normal((5, qw.k)), jnp.bfloat16)
    got = jax.jit(functools.partial(branch, qw=qw))(x, qw.codes, qw.scales, layer=jnp.int32(LAYER))
    want = quant._dense_matmul(x, qw.codes[LAYER], qw.scales[LAYER], qw=qw)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-5)
