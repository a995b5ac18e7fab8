"""jaxpaged checkpoints: one directory holding params/ (the model's `nnx.State`, saved by Orbax as a Flax user saves
one), model_config.json (ModelConfig fields) and the tokenizer's files (save_pretrained).

This is both the cache of converted GGUF files (`checkpoints/` by default) and a format users write with
`jaxpaged.loader.save_checkpoint`, e.g. after fine-tuning. Quantized weights are stored as they are: their codes and
scales in params/, their format in quantization.json. The config is `model_config.json`, not `config.json`,
so the directory is never mistaken for a Hugging Face one (transformers reads config.json when loading a tokenizer).
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import shutil

import jax
import numpy as np
from flax import nnx

from jaxpaged.config import ModelConfig
from jaxpaged.models import families
from jaxpaged.models.quant import QuantizedWeight, is_quantized

logger = logging.getLogger(__name__)

CONFIG_NAME = "model_config.json"
PARAMS_DIR = "params"
QUANTIZATION_NAME = "quantization.json"  # path -> static fields of each QuantizedWeight (its arrays are in params/)


def is_checkpoint(directory: str) -> bool:
    return os.path.isfile(os.path.join(directory, CONFIG_NAME)) and os.path.isdir(os.path.join(directory, PARAMS_DIR))


def _quiet_orbax() -> None:
    logging.getLogger("absl").setLevel(logging.WARNING)  # orbax logs every step of a save at INFO


def _pure_numpy(tree):
    """A restored tree as the nested dict of numpy arrays of `nnx.to_pure_dict`: Orbax gives a saved nnx.State
    back, untargeted, with each variable as {"value": array}; checkpoints written before the state was saved
    directly hold the arrays themselves."""
    if isinstance(tree, dict):
        if set(tree) == {"value"} and not isinstance(tree["value"], dict):
            return np.asarray(tree["value"])
        return {k: _pure_numpy(v) for k, v in tree.items()}
    return np.asarray(tree)


def write_checkpoint(directory: str, config: ModelConfig, params: dict | nnx.State, tokenizer=None) -> None:
    """Writes into a private temporary directory, then renames it into place, so a half-written checkpoint is
    never mistaken for a whole one (the GGUF cache relies on this when a conversion is interrupted)."""
    import orbax.checkpoint as ocp

    _quiet_orbax()
    directory = os.path.abspath(directory)
    if os.path.isdir(directory) and os.listdir(directory) and not is_checkpoint(directory):
        raise ValueError(f"{directory} exists and is not a jaxpaged checkpoint; refusing to overwrite it")
    tmp, old = f"{directory}.tmp-{os.getpid()}", f"{directory}.old-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    os.makedirs(tmp)
    try:
        with ocp.StandardCheckpointer() as ckpt:
            # numpy leaves: restores without devices
            state = families.param_state(config, jax.tree.map(np.asarray, params))
            ckpt.save(os.path.join(tmp, PARAMS_DIR), state)
        with open(os.path.join(tmp, CONFIG_NAME), "w") as f:
            json.dump(dataclasses.asdict(config), f, indent=1)
        quantized = quantized_meta(nnx.to_pure_dict(state) if isinstance(state, nnx.State) else state)
        if quantized:
            with open(os.path.join(tmp, QUANTIZATION_NAME), "w") as f:
                json.dump(quantized, f, indent=1)
        if tokenizer is not None:
            tokenizer.save_pretrained(tmp)
        if os.path.isdir(directory):
            os.replace(directory, old)
        os.replace(tmp, directory)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
        shutil.rmtree(old, ignore_errors=True)


def read_config(directory: str) -> ModelConfig:
    with open(os.path.join(directory, CONFIG_NAME)) as f:
        cfg = json.load(f)
    known = {f.name for f in dataclasses.fields(ModelConfig)}
    unknown = sorted(set(cfg) - known)
    if unknown:
        logger.warning("%s: ignoring fields this jaxpaged does not know: %s", directory, ", ".join(unknown))
    cfg = {k: v for k, v in cfg.items() if k in known}
    cfg["eos_token_ids"] = tuple(cfg.get("eos_token_ids") or ())
    return ModelConfig(**cfg)


def quantized_meta(params: dict, prefix: str = "") -> dict:
    """{"layers/wq": QuantizedWeight.meta(), ...} for the quantized weights of a params dict (saved as they are: the
    codes and scales as arrays, the format beside them in quantization.json)."""
    out = {}
    for key, value in params.items():
        path = f"{prefix}{key}"
        if is_quantized(value):
            if value.layout != "plain":
                raise ValueError(f"{path}: a checkpoint stores quantized weights in the plain layout, not "
                                 f"{value.layout!r} (the engine's own copy for the native kernel)")
            out[path] = value.meta()
        elif isinstance(value, dict):
            out.update(quantized_meta(value, f"{path}/"))
    return out


def _restore_quantized(directory: str, params: dict) -> dict:
    """params with the arrays of each weight listed in quantization.json put back into a QuantizedWeight."""
    meta_path = os.path.join(directory, QUANTIZATION_NAME)
    if not os.path.isfile(meta_path):
        return params
    with open(meta_path) as f:
        quantized = json.load(f)
    for path, meta in quantized.items():
        *parents, name = path.split("/")
        node = params
        for key in parents:
            node = node[key]
        arrays = node[name].get("value", node[name])  # Orbax gives a saved nnx variable back as {"value": ...}
        node[name] = QuantizedWeight.from_meta(meta, arrays["codes"], arrays["scales"])
    return params


def is_quantized_checkpoint(directory: str) -> bool:
    return os.path.isfile(os.path.join(directory, QUANTIZATION_NAME))


def quantized_formats(directory: str) -> set[str]:
    """The formats of a checkpoint's quantized weights ("int8", "q4_k", ...), read from quantization.json alone."""
    from jaxpaged.models.quant import FORMATS

    if not is_quantized_checkpoint(directory):
        return set()
    with open(os.path.join(directory, QUANTIZATION_NAME)) as f:
        return {FORMATS[(m["bits"], m["scale_mode"])] for m in json.load(f).values()}


def read_checkpoint_sharded(directory: str, dtype, mesh) -> tuple[ModelConfig, dict] | None:
    """(config, params as a nested dict of jax.Arrays already split over `mesh`): Orbax reads each device's shard
    of each tensor straight into it (in `dtype`), so no device ever holds a whole split tensor. None when the model's
    heads do not split evenly over the mesh (they are rearranged on the host first: `read_checkpoint`)."""
    import orbax.checkpoint as ocp
    from jax.sharding import NamedSharding

    from jaxpaged.parallel import tensor_parallel

    _quiet_orbax()
    config = read_config(directory)
    if not tensor_parallel.HeadLayout.plan(config.num_heads, config.num_kv_heads, mesh.size).is_plain_split or \
            is_quantized_checkpoint(directory):
        return None
    _, abstract = nnx.split(families.abstract_model(config))
    pure = nnx.to_pure_dict(abstract)
    specs = tensor_parallel.llama_partition_specs(pure, mesh.size)
    nnx.replace_by_pure_dict(abstract, jax.tree.map(
        lambda x, spec: jax.ShapeDtypeStruct(x.shape, dtype, sharding=NamedSharding(mesh, spec)), pure, specs,
        is_leaf=lambda x: isinstance(x, tensor_parallel.P)))
    with ocp.StandardCheckpointer() as ckpt:
        state = ckpt.restore(os.path.join(os.path.abspath(directory), PARAMS_DIR), abstract)
    return config, nnx.to_pure_dict(state)


def read_checkpoint(directory: str) -> tuple[ModelConfig, dict]:
    """(config, params as a nested dict of numpy arrays in the dtype they were saved in, quantized weights as
    `QuantizedWeight`s; `families.param_state` makes it the module's state). Restored untargeted, so each array
    keeps its saved dtype."""
    import orbax.checkpoint as ocp

    _quiet_orbax()
    config = read_config(directory)
    with ocp.StandardCheckpointer() as ckpt:
        params = ckpt.restore(os.path.join(os.path.abspath(directory), PARAMS_DIR))
    return config, _restore_quantized(directory, _pure_numpy(params))
