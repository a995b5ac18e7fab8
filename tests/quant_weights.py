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
