"""The model module of each architecture the loaders produce, and its `nnx.State` from a params pytree.

    config.architecture == "gemma3"  -> jaxpaged.models.gemma3.Gemma3ForCausalLM
    anything else (llama, qwen2, qwen3, mistral, smollm2)  -> jaxpaged.models.llama.LlamaForCausalLM

Both hold their parameters in `jaxpaged.loader.layout`'s layout, so `nnx.to_pure_dict(state)` is the loader's dict.
"""

from __future__ import annotations

import numpy as np
from flax import nnx

from jaxpaged.config import ModelConfig


def module_class(config: ModelConfig) -> type[nnx.Module]:
    if config.architecture == "gemma3":
        from jaxpaged.models.gemma3 import Gemma3ForCausalLM

        return Gemma3ForCausalLM
    from jaxpaged.models.llama import LlamaForCausalLM

    return LlamaForCausalLM


def abstract_model(config: ModelConfig) -> nnx.Module:
    """The architecture's module with ShapeDtypeStructs for parameters (nothing allocated)."""
    cls = module_class(config)
    return nnx.eval_shape(lambda: cls(config, rngs=nnx.Rngs(0)))


def param_state(config: ModelConfig, params: dict | nnx.State) -> nnx.State:
    """The architecture's module state holding `params` (layout dict or State; arrays kept as they are).
    Raises ValueError naming a missing, extra or misshapen tensor."""
    return _split_with(config, params)[1]


def from_params(config: ModelConfig, params: dict | nnx.State) -> nnx.Module:
    """The architecture's module with the given parameters."""
    return nnx.merge(*_split_with(config, params))


def _split_with(config: ModelConfig, params: dict | nnx.State) -> tuple[nnx.GraphDef, nnx.State]:
    if isinstance(params, nnx.State):
        params = nnx.to_pure_dict(params)
    graphdef, state = nnx.split(abstract_model(config))
    _check_tree(params, nnx.to_pure_dict(state), "")
    nnx.replace_by_pure_dict(state, params)
    return graphdef, state


def _check_tree(got: dict, want: dict, where: str) -> None:
    missing, extra = sorted(set(want) - set(got)), sorted(set(got) - set(want))
    if missing or extra:
        raise ValueError(f"params{where}: missing {missing}, unexpected {extra} for this config")
    for key, w in want.items():
        if isinstance(w, dict):
            _check_tree(got[key], w, f"{where}/{key}")
        elif tuple(np.shape(got[key])) != tuple(w.shape):
            raise ValueError(f"params{where}/{key} has shape {tuple(np.shape(got[key]))}, expected {tuple(w.shape)}")
