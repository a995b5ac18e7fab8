"""The K/V pool's format: the `kv_cache_dtype` names, fp8 pools and their per-layer scales, bytes per token.

`kv_cache_dtype` takes vLLM's names: "auto", a float dtype ("float32", "bfloat16", "float16"), or an 8-bit float,
"fp8" / "fp8_e4m3" (float8_e4m3fn: 3 mantissa bits, finite range +-448) or "fp8_e5m2" (2 mantissa bits, +-57344).
An fp8 pool holds K / k_scale and V / v_scale per layer, saturated and rounded as they are written, and every
attention kernel reads it back times the scale (pallas_kernels/fp8.py states the rule). The scales are vLLM's
per-tensor ones: one float32 for K and one for V per layer, 1.0 unless given (vLLM's default without a calibrated
checkpoint). A scale of 1.0 is safe for the shipped models: over 1,500 tokens of `pydoc_data.topics`, SmolLM2-135M's
largest |K| is 22 and |V| 15, Gemma 3 270M's |K| 108 and |V| 157, inside e4m3's 448; anything larger saturates
(never NaN), and `benchmarks/quality.py` measures what the format costs in perplexity.

Keys are rotated before they are quantized (where head_dim is a power of two and the model does not normalise its
keys, see below): the pool holds fp8(H k / k_scale)
and the kernel is given H q, H the normalised Hadamard matrix of head_dim (orthogonal, so (H q) . (H k) = q . k:
the attention is unchanged but for rounding; values are not rotated). fp8 rounds each element to 3 mantissa bits
(e4m3), so a score's error is about sum_c q_c k_c eps_c, large where q and k put their weight on the same few
channels, as SmolLM2's do (over half of its keys' energy is a per-channel offset); the rotation spreads every
vector over all channels. Measured with benchmarks/quality.py's scoring on 4,096 tokens of SmolLM2 (K and V in
e4m3, scale 1): perplexity +1.6% over bfloat16 without it, +0.97% with it (e5m2: +7.4%, +2.7%); on 16,384 tokens
+0.65% with it. A model whose keys pass an RMSNorm per head (Gemma 3's k_norm, Qwen3's) has no such offsets, and
there the rotation measured worse: Gemma 3 270M on 16,384 tokens, +0.85% without, +1.07% with; so those models
store their keys as they are. vLLM stores keys unrotated; QuaRot-style rotations are what its rotated checkpoints
do for the same reason.

The scales and the rotation are fixed when the engine is built, so they are constants of the compiled step (not
arguments), and the pool is the same pytree in every format: swap, copy-on-write, prefix caching and tensor
parallelism move fp8 blocks as they move any others.
"""

from __future__ import annotations

import dataclasses
import logging

import jax
import jax.numpy as jnp
import numpy as np

from jaxpaged.config import KV_CACHE_DTYPES, SUPPORTED_DTYPES
from pallas_kernels.fp8 import FP8_NAMES, fp8_max, is_fp8

logger = logging.getLogger(__name__)


def pool_dtype_of(name: str) -> np.dtype:
    """The pool dtype a `kv_cache_dtype` name (not "auto") stands for."""
    if name in FP8_NAMES:
        return np.dtype(FP8_NAMES[name])
    if name in SUPPORTED_DTYPES:
        return np.dtype(jnp.dtype(name))
    raise ValueError(f"kv_cache_dtype={name!r} is not supported; use one of {', '.join(KV_CACHE_DTYPES)}")


def check_kv_cache_dtype(name: str, platform: str | None = None, device_kind: str | None = None,
                         compute_capability: str | None = None) -> None:
    """Raises ValueError naming kv_cache_dtype when the option is unknown, or names an fp8 format the platform's
    attention kernel cannot read: the Pallas GPU kernel is compiled by Triton, whose float8_e4m3fn needs compute
    capability 8.9 (Ada, Hopper) or later. Called when the options are checked, before any model is loaded."""
    if name != "auto":
        pool_dtype_of(name)
    if name not in FP8_NAMES or platform not in ("gpu", "cuda") or compute_capability is None:
        return
    if FP8_NAMES[name] == jnp.dtype(jnp.float8_e4m3fn) and _version(compute_capability) < (8, 9):
        raise ValueError(f"kv_cache_dtype={name!r} (float8_e4m3fn) needs a GPU of compute capability 8.9 or later "
                         f"for the Pallas (Triton) kernel; {device_kind or 'this GPU'} has {compute_capability}: use "
                         "kv_cache_dtype='fp8_e5m2', or a 16-bit cache")


def check_for_this_platform(name: str) -> None:
    """`check_kv_cache_dtype` for the default device (it initialises the JAX backend, which loading does anyway)."""
    if name not in FP8_NAMES:
        if name != "auto":
            pool_dtype_of(name)
        return
    device = jax.devices()[0]
    check_kv_cache_dtype(name, device.platform, getattr(device, "device_kind", None),
                         getattr(device, "compute_capability", None))


def _version(text: str) -> tuple[int, ...]:
    try:
        return tuple(int(x) for x in str(text).split("."))
    except ValueError:
        return (0,)


@dataclasses.dataclass(frozen=True)
class KVScales:
    """An fp8 pool's per-layer scales: the pool holds K / k[layer] and V / v[layer]. Hashable: a static part of the
    attention backend, so the scales are constants of the compiled step."""

    k: tuple[float, ...]
    v: tuple[float, ...]
    rotate_keys: bool = True  # store H k and attend with H q (module docstring); needs a power-of-two head_dim

    def __post_init__(self):
        if len(self.k) != len(self.v) or not self.k:
            raise ValueError(f"KVScales needs one k and one v scale per layer, got {len(self.k)} and {len(self.v)}")
        for value in (*self.k, *self.v):
            if not (np.isfinite(value) and value > 0):
                raise ValueError(f"fp8 K/V scales must be finite and positive, got {value}")

    @classmethod
    def uniform(cls, num_layers: int, k: float = 1.0, v: float = 1.0, rotate_keys: bool = True) -> KVScales:
        return cls((float(k),) * num_layers, (float(v),) * num_layers, rotate_keys)

    def at(self, layer) -> tuple[float | jax.Array, float | jax.Array]:
        """(k_scale, v_scale) of `layer` (an int or a traced int32): Python floats when every layer shares them
        (folded into the program), else float32 scalars gathered from a constant per-layer table."""
        def pick(scales: tuple[float, ...]):
            if len(set(scales)) == 1:
                return scales[0]
            return jnp.asarray(scales, jnp.float32)[layer]

        return pick(self.k), pick(self.v)


def hadamard(n: int) -> np.ndarray:
    """The normalised Hadamard matrix of order n (a power of two), float32: symmetric, orthogonal, entries
    +-1/sqrt(n) (Sylvester's construction)."""
    if n < 1 or n & (n - 1):
        raise ValueError(f"a Hadamard matrix of order {n}: the order must be a power of two")
    h = np.ones((1, 1))
    while h.shape[0] < n:
        h = np.block([[h, h], [h, -h]])
    return (h / np.sqrt(n)).astype(np.float32)


def rotate(x: jax.Array, out_dtype=None) -> jax.Array:
    """x [..., D] @ H_D in float32 (multiplied in float32 on every platform), returned in out_dtype (default x's)."""
    h = jnp.asarray(hadamard(x.shape[-1]))
    y = jnp.matmul(x.astype(jnp.float32), h, precision=jax.lax.Precision.HIGHEST)
    return y.astype(out_dtype or x.dtype)


def with_scales(attn, pool_dtype, num_layers: int, head_dim: int | None = None, scales: KVScales | None = None,
                keys_normalized: bool = False):
    """The attention backend (a `PagedAttention`) with an fp8 pool's scales (default: 1.0 for every layer, vLLM's
    without calibration, and keys rotated where head_dim is a power of two and the model does not RMS-normalise
    its keys: module docstring); unchanged for other pools."""
    if not is_fp8(pool_dtype):
        return attn
    pow2 = head_dim is not None and head_dim > 0 and not head_dim & (head_dim - 1)
    scales = scales or KVScales.uniform(num_layers, rotate_keys=pow2 and not keys_normalized)
    if scales.rotate_keys and not pow2:
        raise ValueError(f"KVScales.rotate_keys needs a power-of-two head_dim, got {head_dim}")
    if len(scales.k) != num_layers:
        raise ValueError(f"KVScales has {len(scales.k)} layers, the model {num_layers}")
    return dataclasses.replace(attn, kv_scales=scales)


def keys_normalized(config) -> bool:
    """Whether a model RMS-normalises each key head before attention (Qwen3's qk_norm, Gemma 3's k_norm)."""
    return bool(getattr(config, "qk_norm", False)) or getattr(config, "architecture", "") == "gemma3"


def kv_bytes_per_token(num_layers: int, num_kv_heads: int, head_dim: int, dtype) -> int:
    """Bytes of K and V one token takes in the pool, all layers (logical: no device tile padding)."""
    return 2 * num_layers * num_kv_heads * head_dim * np.dtype(dtype).itemsize


def describe(dtype, scales: KVScales | None) -> str:
    """The pool's format for the start-up log, e.g. "float8_e4m3fn (scales k 1, v 1; saturates at +-448)"."""
    name = np.dtype(dtype).name
    if not is_fp8(dtype) or scales is None:
        return name

    def span(values):
        lo, hi = min(values), max(values)
        return f"{lo:g}" if lo == hi else f"{lo:g}-{hi:g}"

    rotated = ", keys Hadamard-rotated" if scales.rotate_keys else ""
    return f"{name} (scales k {span(scales.k)}, v {span(scales.v)}{rotated}; saturates at +-{fp8_max(dtype):g})"


def warn_without_saving(spec, block_size: int, pool_dtype, block_bytes: int, fmt) -> None:
    """Logs a warning when an fp8 pool's block takes as many device bytes as a bfloat16 one: on TPU the row-major
    pool's (Hkv, D) tile is padded, more for 8-bit types ((4, 128) against bfloat16's (2, 128)), so a model with one
    kv head of 256 (Gemma 3 270M) gains nothing on a v5e (SmolLM2's (3, 64) and (8, 128) do halve: measured with
    libtpu's compile-only client)."""
    if not is_fp8(pool_dtype) or fmt is None:
        return
    from jaxpaged.worker.kv_pool import pool_block_bytes

    bf16 = pool_block_bytes(spec, block_size, jnp.bfloat16, fmt)
    if block_bytes >= bf16:
        logger.warning("kv_cache_dtype %s: a block takes %d bytes on this device, as many as bfloat16's (%d): the "
                       "device pads the pool's (kv heads, head_dim) tile more for 8-bit types; fp8 saves no memory "
                       "here", np.dtype(pool_dtype).name, block_bytes, bf16)


def kv_stats(runner) -> dict:
    """What `Engine.stats()` reports of the pool's format: its dtype and the bytes one token takes in one device's
    pool (the unit `kv_cache_memory` is divided by; TPU tile padding included)."""
    return {"kv_cache_dtype": np.dtype(runner.kv_pool.dtype).name,
            "kv_bytes_per_token": runner.block_bytes // runner.block_size}


__all__ = ["KVScales", "KV_CACHE_DTYPES", "check_for_this_platform", "check_kv_cache_dtype", "describe",
           "hadamard", "keys_normalized", "kv_bytes_per_token", "kv_stats", "pool_dtype_of", "rotate",
           "warn_without_saving",
           "with_scales"]
