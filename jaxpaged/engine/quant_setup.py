"""The engine's side of weight quantization at start-up: quantize or check the model for `EngineConfig.quantization`,
lay quantized weights out for the kernel that multiplies them, and describe the weights (start-up log, stats()).

Where the products run: on a CPU whose native quantized matmul has its AVX-512 VNNI path (`native_quantized`), by
that kernel (pallas_kernels/cpu_native/qmatmul.cc) from the panel layout; on CUDA the GGUF block formats by the
Pallas Triton kernel (pallas_kernels/gpu_qmatmul.py) from the plain layout; on TPU Q8_0 (and the 4-bit formats
above `quant.NIBBLE_MAX_ROWS` rows) by the Pallas Mosaic kernel (pallas_kernels/tpu_qmatmul.py); elsewhere (the
rest on TPU, other CPUs, int8 on GPU) the plain layout is dequantized by `jnp` inside the jitted step, next to XLA's
dot (`jaxpaged.models.quant.qmatmul`).
"""

from __future__ import annotations

import logging

import jax
from flax import nnx

from jaxpaged.models.quant import is_quantized, weight_summary
from jaxpaged.models.quantize import prepare_for_device as _prepare
from jaxpaged.models.quantize import quantize

logger = logging.getLogger(__name__)

GGUF_FORMATS = ("q8_0", "q4_0", "q4_1", "q4_k", "q8_1", "q8_k")
# The formats whose dequantization XLA's compiler for a backend does not fuse into a decode step's dot, as its
# compiled HLO shows (deviceless compiles for H100/H200 and TPU v5e/v6e, benchmarks/quant_fusion.py): it writes
# each layer's weight at full width, then the dot reads it. None now: on GPU int8 is fused into XLA's GEMM and the
# block formats run the Pallas Triton kernel (compiled for H100 and H200); on TPU int8 and the 4-bit formats up to
# NIBBLE_MAX_ROWS rows are fused by XLA, and Q8_0 (every row count) and the 4-bit formats above run the Pallas
# Mosaic kernel, which dequantizes in VMEM (compiled for v5e and v6e).
NOT_FUSED = {"gpu": (), "tpu": ()}  # the kept formats compiled there


def native_quantized() -> bool:
    """Whether quantized products run by the native CPU kernel here (CPU backend, its VNNI path built)."""
    if jax.default_backend() != "cpu":
        return False
    from pallas_kernels.cpu_native.quantized import qmatmul_is_fast

    return qmatmul_is_fast()


def _native_way() -> str:
    from pallas_kernels.cpu_native.quantized import qmatmul_uses_amx

    return "VPDPBUSD, AMX tiles for blocks of 16 rows" if qmatmul_uses_amx() else "VPDPBUSD"


def _quantized_leaves(tree) -> list:
    return [x for x in jax.tree.leaves(tree, is_leaf=is_quantized) if is_quantized(x)]


def quantize_model(model: nnx.Module, quantization: str | None) -> None:
    """"int8": quantizes the model in place (`jaxpaged.quantize`; weights already quantized stay as they are).
    "gguf": checks that the model holds a GGUF file's quantized weights (ValueError otherwise). None: nothing."""
    if quantization == "int8":
        quantize(model, "int8")
    elif quantization == "gguf":
        kept = [x for x in _quantized_leaves(nnx.state(model)) if x.format != "int8"]
        if not kept:
            raise ValueError("quantization='gguf' keeps the quantized tensors of a GGUF file, and this model holds "
                             "none: load a .gguf file (or a checkpoint saved from one with quantization='gguf'), or "
                             "use quantization='int8'")


def prepare_for_device(params, dtype):
    """The split params with every quantized weight in the layout its products run from, on the device."""
    return _prepare(params, native_quantized(), dtype)


def describe_weights(state, quantization: str | None, tensor_parallel: bool = False) -> dict:
    """{"quantization", "weight_bytes", "weight_format", "weight_formats": {format: bytes}} of the engine's state,
    logged once: what the weights occupy as the devices hold them (panel padding included; split or not, each
    array counts once)."""
    summary = weight_summary(state)
    quantized = [name for name in summary["weight_formats"] if name in GGUF_FORMATS + ("int8",)]
    fmt = "+".join(quantized) if quantized else next(iter(summary["weight_formats"]), "none")
    where = ""
    if quantized:
        where = f"; products by the native CPU kernel (int8 activations, {_native_way()})" if native_quantized() \
            else "; dequantized inside the step next to XLA's dot"
        if jax.default_backend() == "gpu":
            parts = []
            if "int8" in quantized:
                parts.append("int8 by the Pallas W8A8 kernel in decode-sized steps (int8 activations per block of 32, "
                             "as the native CPU kernel), XLA's dot above")
            if set(quantized) & set(GGUF_FORMATS):
                parts.append("GGUF block formats by the Pallas GPU kernel (dequantized in registers)")
            where = "; on CUDA " + "; ".join(parts)
        if jax.default_backend() == "tpu" and set(quantized) & set(GGUF_FORMATS):
            where = "; GGUF block formats by the Pallas TPU kernel (dequantized in VMEM; 4-bit up to 64 rows fused " \
                    "by XLA), int8 next to XLA's dot"
        if tensor_parallel:
            where = ("; tensor parallel: each device's shard dequantized inside the step next to XLA's dot"
                     if jax.default_backend() == "cpu" else where + " (tensor parallel: on each device's shard)")
    logger.info("weights: %.1f MiB (%s), quantization=%s%s", summary["weight_bytes"] / 2**20,
                ", ".join(f"{k} {v / 2**20:.1f} MiB" for k, v in summary["weight_formats"].items()), quantization,
                where)
    unfused = unfused_formats(quantized, jax.default_backend())
    if unfused:
        logger.warning("XLA's %s compiler does not fuse the dequantization of %s into the dot: each layer's weight "
                       "is written at full width, then read, in every step (docs/quantization.md, \"Where it is "
                       "multiplied\"); quantization=None dequantizes once at load, quantization='int8' is fused",
                       jax.default_backend(), ", ".join(unfused))
    return {"quantization": quantization, "weight_bytes": summary["weight_bytes"], "weight_format": fmt,
            "weight_formats": summary["weight_formats"]}


def unfused_formats(formats, backend: str) -> list[str]:
    """The quantized formats among `formats` whose products on `backend` ("cpu", "gpu", "tpu") XLA does not fuse."""
    return [f for f in formats if f in NOT_FUSED.get(backend, ())]


__all__ = ["native_quantized", "quantize_model", "prepare_for_device", "describe_weights", "is_quantized"]
