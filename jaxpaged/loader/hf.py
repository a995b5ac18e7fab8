"""Hugging Face directories: config.json (read by `transformers.AutoConfig`) + generation_config.json and
model.safetensors or a sharded model.safetensors.index.json -> ModelConfig and params (layout in
`jaxpaged.loader.layout`)."""

from __future__ import annotations

import json
import os

import numpy as np

from jaxpaged.config import ModelConfig
from jaxpaged.loader.layout import assemble

SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3")
INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"

# our name -> the per-layer suffix after "model.layers.{i}."
_LAYER_TENSORS = {
    "attn_norm": "input_layernorm.weight", "wq": "self_attn.q_proj.weight", "wk": "self_attn.k_proj.weight",
    "wv": "self_attn.v_proj.weight", "wo": "self_attn.o_proj.weight", "bq": "self_attn.q_proj.bias",
    "bk": "self_attn.k_proj.bias", "bv": "self_attn.v_proj.bias", "q_norm": "self_attn.q_norm.weight",
    "k_norm": "self_attn.k_norm.weight", "mlp_norm": "post_attention_layernorm.weight",
    "w_gate": "mlp.gate_proj.weight", "w_up": "mlp.up_proj.weight", "w_down": "mlp.down_proj.weight",
}
_GLOBAL_TENSORS = {"embed": "model.embed_tokens.weight", "final_norm": "model.norm.weight", "lm_head": "lm_head.weight"}


def is_hf_directory(directory: str) -> bool:
    return os.path.isfile(os.path.join(directory, "config.json"))


def _token_ids(*values) -> tuple[int, ...]:
    ids: list[int] = []
    for value in values:
        for i in value if isinstance(value, list) else [value]:
            if isinstance(i, int) and i not in ids:
                ids.append(i)
    return tuple(ids)


def _rope(cfg) -> tuple[float, dict | None]:
    """(rope_theta, rope_scaling) from the config's `rope_parameters`, which transformers fills from either the
    4.x fields (`rope_theta`, `rope_scaling` with "type" or "rope_type") or 5.x's. Scaling "default" means none."""
    rope = dict(cfg.rope_parameters or {})
    theta = float(rope.pop("rope_theta", None) or getattr(cfg, "rope_theta", None) or 10000.0)
    legacy = rope.pop("type", None)
    rope.setdefault("rope_type", legacy or "default")
    return theta, (rope if rope["rope_type"] != "default" else None)


def _sliding_window(cfg, model_type: str) -> int | None:
    window = getattr(cfg, "sliding_window", None)
    if model_type == "mistral" or window is None:
        return window
    if model_type not in ("qwen2", "qwen3"):
        return None
    # Qwen2/3 slide only in the layers transformers marks "sliding_attention" (use_sliding_window and
    # max_window_layers decide which)
    types = getattr(cfg, "layer_types", None) or ["full_attention"] * cfg.num_hidden_layers
    if "sliding_attention" not in types:
        return None
    if set(types) != {"sliding_attention"}:
        raise ValueError(f"layer_types={types} mixes sliding and full attention layers; jaxpaged applies one "
                         "sliding_window to every layer")
    return window


def model_config_from_hf(cfg, generation_cfg: dict | None = None) -> ModelConfig:
    """ModelConfig from a transformers config (`AutoConfig.from_pretrained(directory)`), or a config.json dict
    (given to `AutoConfig.for_model`, so both are read by transformers' own rules)."""
    if isinstance(cfg, dict):
        model_type = cfg.get("model_type")
        if model_type not in SUPPORTED_MODEL_TYPES:
            raise ValueError(f"unsupported architecture model_type={model_type!r}; supported: "
                             f"{', '.join(SUPPORTED_MODEL_TYPES)}")
        from transformers import AutoConfig

        cfg = AutoConfig.for_model(**cfg)
    model_type = cfg.model_type
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise ValueError(f"unsupported architecture model_type={model_type!r}; supported: "
                         f"{', '.join(SUPPORTED_MODEL_TYPES)}")
    if getattr(cfg, "mlp_bias", False):
        raise ValueError("mlp_bias=true is not supported (the MLP has no biases in jaxpaged)")
    gen = generation_cfg or {}
    theta, scaling = _rope(cfg)
    heads = cfg.num_attention_heads
    bos = _token_ids(gen.get("bos_token_id"), cfg.bos_token_id)
    return ModelConfig(
        vocab_size=cfg.vocab_size, hidden_size=cfg.hidden_size, intermediate_size=cfg.intermediate_size,
        num_layers=cfg.num_hidden_layers, num_heads=heads, num_kv_heads=cfg.num_key_value_heads or heads,
        head_dim=getattr(cfg, "head_dim", None) or cfg.hidden_size // heads, rms_norm_eps=float(cfg.rms_norm_eps),
        rope_theta=theta, rope_scaling=scaling, max_position_embeddings=cfg.max_position_embeddings,
        tie_word_embeddings=bool(cfg.tie_word_embeddings),
        # Qwen2 always has q/k/v biases (its config has no attention_bias field)
        attention_bias=bool(getattr(cfg, "attention_bias", False) or model_type == "qwen2"),
        qk_norm=model_type == "qwen3", sliding_window=_sliding_window(cfg, model_type),
        bos_token_id=bos[0] if bos else None,
        eos_token_ids=_token_ids(gen.get("eos_token_id"), cfg.eos_token_id), architecture=model_type,
        generation_defaults=generation_defaults(gen))


# generation_config.json's sampling fields that vLLM takes as request defaults, and their SamplingParams names
_GENERATION_FIELDS = {"temperature": "temperature", "top_p": "top_p", "top_k": "top_k", "min_p": "min_p",
                      "repetition_penalty": "repetition_penalty", "max_new_tokens": "max_tokens"}


def generation_defaults(gen: dict) -> dict[str, float | int] | None:
    """The request defaults a generation_config.json sets (vLLM's generation_config="auto"), as SamplingParams
    fields, checked as SamplingParams checks them (ValueError / TypeError naming the file's field); None if it sets
    none."""
    from jaxpaged.sampling_params import SamplingParams

    found = {ours: gen[theirs] for theirs, ours in _GENERATION_FIELDS.items() if gen.get(theirs) is not None}
    if not found:
        return None
    try:
        SamplingParams(**found)
    except (TypeError, ValueError) as e:
        raise type(e)(f"generation_config.json: {e} (HF's name of max_tokens is max_new_tokens)") from e
    return found


def tensor_files(directory: str) -> list[str]:
    index = os.path.join(directory, INDEX_FILE)
    if os.path.exists(index):
        with open(index) as f:
            names = sorted(set(json.load(f)["weight_map"].values()))
        return [os.path.join(directory, n) for n in names]
    single = os.path.join(directory, SINGLE_FILE)
    if os.path.exists(single):
        return [single]
    raise FileNotFoundError(f"{directory} has config.json but neither {SINGLE_FILE} nor {INDEX_FILE} "
                            "(only safetensors weights are read)")


def _read_json(path: str) -> dict:
    if not os.path.exists(path):
        return {}
    with open(path) as f:
        return json.load(f)


def read_hf_config(directory: str) -> ModelConfig:
    from transformers import AutoConfig

    model_type = _read_json(os.path.join(directory, "config.json")).get("model_type")
    if model_type not in SUPPORTED_MODEL_TYPES:  # before transformers, which may not know it at all
        raise ValueError(f"unsupported architecture model_type={model_type!r} in {directory}; supported: "
                         f"{', '.join(SUPPORTED_MODEL_TYPES)}")
    return model_config_from_hf(AutoConfig.from_pretrained(directory),
                                _read_json(os.path.join(directory, "generation_config.json")))


def load_hf_directory(directory: str, dtype=np.float32) -> tuple[ModelConfig, dict]:
    """Reads tensors lazily from (memory-mapped) safetensors files and casts each to `dtype` as it is placed."""
    from safetensors import safe_open

    config = read_hf_config(directory)
    handles = [safe_open(path, framework="numpy") for path in tensor_files(directory)]
    where = {name: h for h in handles for name in h.keys()}

    def fetch(name: str, layer: int | None) -> np.ndarray:
        key = _GLOBAL_TENSORS[name] if layer is None else f"model.layers.{layer}.{_LAYER_TENSORS[name]}"
        if key not in where:
            raise ValueError(f"missing tensor {key!r} in {directory}")
        return where[key].get_tensor(key)

    return config, assemble(config, fetch, dtype)
