"""Draft models for speculative decoding: the target's own first N layers, or a separate model with the target's
vocabulary, checked before anything is loaded.

    check_draft(spec, target_config)        # ValueError / TypeError naming speculative_config.<field>
    draft = load_draft(spec, target, dtype) # an nnx module on the model contract (jaxpaged.models.contract)
    draft = truncated_draft(target, 8)      # the built-in target's first 8 layers

A truncated draft is a module of the target's own class (`LlamaForCausalLM`, which also serves Qwen2/3, Mistral and
SmolLM2, or `Gemma3ForCausalLM`) whose config says `num_layers = N` (and, for Gemma 3, the first N `layer_types`).
Its embedding, final norm and LM head are the target's own `nnx.Variable` objects (shared, not copied: a
`TransposedHead` kept at load is shared too); its stacked layer parameters [L, ...] are sliced [:N] once, here (a
view of host arrays, a copy of N layers of device arrays). It runs the target's first N layers exactly, then the
target's head, so the draft's logits approximate the target's at a fraction of its cost. It has its own KV pool of N
layers: a pool slice per draft layer, written by the draft's own steps.
"""

from __future__ import annotations

import dataclasses
import os

import jax
from flax import nnx

from jaxpaged.config import ModelConfig
from jaxpaged.spec_decode.config import SpeculativeConfig


def draft_config(config: ModelConfig, num_layers: int) -> ModelConfig:
    """The target's config cut to its first `num_layers` layers."""
    if not 1 <= num_layers <= config.num_layers:
        raise ValueError(f"speculative_config.draft_num_layers={num_layers} must be between 1 and the target model's "
                         f"{config.num_layers} layers")
    layer_types = None if config.layer_types is None else tuple(config.layer_types[:num_layers])
    return dataclasses.replace(config, num_layers=num_layers, layer_types=layer_types)


def _built_in_classes() -> tuple[type, ...]:
    from jaxpaged.models.gemma3 import Gemma3ForCausalLM
    from jaxpaged.models.llama import LlamaForCausalLM

    return LlamaForCausalLM, Gemma3ForCausalLM


def truncated_draft(target: nnx.Module, num_layers: int) -> nnx.Module:
    """A draft of the built-in `target`'s first `num_layers` layers, sharing its embedding, final norm and head."""
    if not isinstance(target, _built_in_classes()):
        raise TypeError(f"speculative_config.draft_num_layers makes a draft from the built-in modules "
                        f"(LlamaForCausalLM, Gemma3ForCausalLM), not {type(target).__name__}; give "
                        "speculative_config.model (a draft with the same vocabulary) instead")
    config = draft_config(target.config, num_layers)
    cls = type(target)
    # The module's structure with nothing allocated; its variables are then replaced by the target's.
    draft = nnx.eval_shape(lambda: cls(config, rngs=nnx.Rngs(0)))
    for name, value in list(vars(target).items()):
        if isinstance(value, nnx.Variable):  # embed, final_norm, lm_head, head_t: the very same objects
            setattr(draft, name, value)
    # Every layer parameter is stacked [L, ...] (a prepacked matrix too: [L, N/32, K/2, 64]): its first N layers.
    nnx.update(draft.layers, jax.tree.map(lambda x: x[:num_layers], nnx.state(target.layers)))
    return draft


def check_vocabulary(target_vocab: int, draft_vocab: int) -> None:
    if draft_vocab != target_vocab:
        raise ValueError(f"speculative_config.model has a vocabulary of {draft_vocab} tokens, the target model "
                         f"{target_vocab}: a draft must share the target's vocabulary (its token ids are the "
                         "target's)")


def read_draft_config(path: str | os.PathLike) -> ModelConfig:
    """The config of the draft at `path` (a GGUF file, a Hugging Face directory or a jaxpaged checkpoint), read
    without loading its weights."""
    from jaxpaged.loader.checkpoint import is_checkpoint, read_config
    from jaxpaged.loader.hf import is_hf_directory, read_hf_config

    path = os.fspath(path)
    if not os.path.exists(path):
        raise FileNotFoundError(f"speculative_config.model={path!r}: no such file or directory")
    if os.path.isfile(path):
        from jaxpaged.loader.gguf_file import is_gguf_file, model_config_from_gguf

        if not is_gguf_file(path):
            raise ValueError(f"speculative_config.model={path!r} is a file but not a GGUF file")
        from gguf import GGUFReader

        return model_config_from_gguf(GGUFReader(path))
    if is_checkpoint(path):
        return read_config(path)
    if is_hf_directory(path):
        return read_hf_config(path)
    raise ValueError(f"speculative_config.model={path!r} is neither a GGUF file, a Hugging Face directory nor a "
                     "jaxpaged checkpoint")


def check_draft(spec: SpeculativeConfig, target_config) -> None:
    """Checks the draft of `spec` against the target (its config: `ModelConfig` or any `ModelSpec`) before anything
    is loaded: the layer count of a truncated draft, the contract and vocabulary of a module, the vocabulary in a
    path's config. Nothing to check for the ngram method."""
    if spec.method != "draft_model":
        return
    if spec.draft_num_layers is not None:
        spec.check_target(target_config.num_layers)
        return
    if isinstance(spec.model, nnx.Module):
        from jaxpaged.models.contract import check_model

        try:
            check_model(spec.model)
        except TypeError as e:
            raise TypeError(f"speculative_config.model: {e}") from None
        check_vocabulary(target_config.vocab_size, spec.model.config.vocab_size)
        return
    check_vocabulary(target_config.vocab_size, read_draft_config(spec.model).vocab_size)


def load_draft(spec: SpeculativeConfig, target: nnx.Module, dtype: str = "float32") -> nnx.Module:
    """The draft module of `spec` for `target` (checked first, `check_draft`): the target's first layers, the given
    module, or the model at the given path loaded in `dtype`."""
    check_draft(spec, target.config)
    if spec.draft_num_layers is not None:
        return truncated_draft(target, spec.draft_num_layers)
    if isinstance(spec.model, nnx.Module):
        return spec.model
    from jaxpaged.loader import load_model
    from jaxpaged.models import families

    loaded = load_model(os.fspath(spec.model), dtype=dtype,
                        quantization="gguf" if spec.quantization == "gguf" else None)
    check_vocabulary(target.config.vocab_size, loaded.config.vocab_size)
    return families.from_params(loaded.config, loaded.params)
