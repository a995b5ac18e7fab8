"""The model module of each architecture the loaders produce, and its `nnx.State` from a params pytree.

    config.architecture == "gemma3"  -> jaxpaged.models.gemma3.Gemma3ForCausalLM
    anything else (llama, qwen2, qwen3, mistral, smollm2)  -> jaxpaged.models.llama.LlamaForCausalLM

Both hold their parameters in `jaxpaged.loader.layout`'s layout, so `nnx.to_pure_dict(state)` is the loader's dict.
"""

from __future__ import annotations

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
    from jaxpaged.models.llama import _check_tree

    if isinstance(params, nnx.State):
        params = nnx.to_pure_dict(params)
    graphdef, state = nnx.split(abstract_model(config))
    _check_tree(params, nnx.to_pure_dict(state), "")
    nnx.replace_by_pure_dict(state, params)
    return graphdef, state
