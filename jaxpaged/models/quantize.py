"""`jaxpaged.quantize(module, "int8")`: a model's matrices quantized in place, one call.

    model = jaxpaged.quantize(model, "int8")      # then LLM.from_model(model, ...), or LLM.from_model(model,
                                                  # quantization="int8"), which calls it
The built-in modules (`LlamaForCausalLM`, `Gemma3ForCausalLM`): the layers' q/k/v/o/gate/up/down matrices and the LM
head (an untied `lm_head`, or the tied embedding table, whose rows the lookup then dequantizes) become int8 per
output channel (`quant.quantize_int8`); norms, biases and an untied embedding stay full width (a lookup reads T rows
per step, and XLA keeps it off the matmul path). Any other module: each `flax.nnx.Linear` in it becomes a
`QuantizedLinear` (same call, its kernel int8 per output channel, its bias full width); its other arrays are left
as they are, since only code that multiplies through `jaxpaged.models.matmul` can read a quantized weight.

`prepare_for_device(state, native)` is the engine's last step at load: every quantized weight as the native CPU
kernel reads it (`quant.to_panels`) where it runs every product, else as it is, on the device.
"""

from __future__ import annotations

import logging

import jax
import jax.numpy as jnp
from flax import nnx

from jaxpaged.models.matmul import LAYER_MATRICES, linear
from jaxpaged.models.quant import check_method, is_quantized, map_quantized, quantize_int8, to_panels

logger = logging.getLogger(__name__)


class QuantizedLinear(nnx.Module):
    """`nnx.Linear`'s y = x @ kernel + bias with the kernel [K, N] quantized (int8 per output channel)."""

    def __init__(self, kernel, bias=None):
        self.kernel = nnx.Param(kernel)
        self.bias = nnx.Param(bias) if bias is not None else None

    @classmethod
    def from_linear(cls, layer: nnx.Linear) -> QuantizedLinear:
        bias = layer.bias[...] if layer.bias is not None else None
        return cls(quantize_int8(layer.kernel[...]), bias)

    def __call__(self, x: jax.Array) -> jax.Array:
        y = linear(x, self.kernel[...])  # [..., N] in x's dtype
        return y if self.bias is None else y + self.bias[...].astype(y.dtype)


def _built_in(module) -> bool:
    from jaxpaged.models import gemma3, llama

    return isinstance(module, (llama.LlamaForCausalLM, gemma3.Gemma3ForCausalLM))


def _set(param: nnx.Param, value) -> None:
    param.set_value(value)


def quantize(module: nnx.Module, method: str | None = "int8") -> nnx.Module:
    """Quantizes `module` in place (see the module docstring) and returns it. method: "int8" (None: unchanged).
    Raises ValueError for another method, or when the module holds nothing this can quantize."""
    check_method(method)
    if method is None:
        return module
    if method == "gguf":
        raise ValueError("quantization='gguf' keeps a GGUF file's own formats, so it applies to a model loaded from "
                         "a .gguf file (LLM(model='file.gguf', quantization='gguf')); quantize a module with 'int8'")
    count = 0
    if _built_in(module):
        for name in LAYER_MATRICES:
            param = getattr(module.layers, name, None)
            if param is not None and not is_quantized(param[...]):
                _set(param, quantize_int8(param[...]))  # [L, K, N]
                count += 1
        if module.config.tie_word_embeddings:
            if getattr(module, "head_t", None) is not None:
                del module.head_t  # the quantized table is the head now
            if not is_quantized(module.embed[...]):
                _set(module.embed, quantize_int8(module.embed[...], table=True))  # [V, H]
                count += 1
        elif not is_quantized(module.lm_head[...]):
            _set(module.lm_head, quantize_int8(module.lm_head[...]))  # [H, V]
            count += 1
    else:
        for path, sub in list(nnx.iter_modules(module)):
            if not path or not isinstance(sub, nnx.Linear):
                continue
            parent = module
            for key in path[:-1]:
                parent = parent[key] if isinstance(key, int) else getattr(parent, key)
            replacement = QuantizedLinear.from_linear(sub)
            if isinstance(path[-1], int):
                parent[path[-1]] = replacement
            else:
                setattr(parent, path[-1], replacement)
            count += 1
        if count == 0:
            raise ValueError(f"quantization={method!r}: {type(module).__name__} has no flax.nnx.Linear layer (and is "
                             "not a built-in model), so nothing would be quantized")
    logger.info("quantization %s: %d weight(s) of %s quantized", method, count, type(module).__name__)
    return module


def prepare_for_device(state, native: bool, dtype):
    """Every quantized weight of `state` with its compute dtype set to `dtype`, in the native kernel's panel layout
    where `native`, and on the device."""
    def prepare(qw):
        qw = qw.replace(compute_dtype=jnp.dtype(dtype).name)
        return jax.tree.map(jnp.asarray, to_panels(qw) if native else qw)

    return map_quantized(prepare, state)


__all__ = ["QuantizedLinear", "quantize", "prepare_for_device"]
