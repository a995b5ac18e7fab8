"""Hugging Face directories: config.json (+ generation_config.json) and model.safetensors or a sharded
model.safetensors.index.json -> ModelConfig and params (layout in `jaxpaged.loader.layout`)."""

from __future__ import annotations

import json
import os

import numpy as np

from jaxpaged.config import ModelConfig
from jaxpaged.loader.layout import assemble

SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2")
INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"

# our name -> the per-layer suffix after "model.layers.{i}."
_LAYER_TENSORS = {
    "attn_norm": "input_layernorm.weight", "wq": "self_attn.q_proj.weight", "wk": "self_attn.k_proj.weight",
    "wv": "self_attn.v_proj.weight", "wo": "self_attn.o_proj.weight", "bq": "self_attn.q_proj.bias",
    "bk": "self_attn.k_proj.bias", "bv": "self_attn.v_proj.bias", "mlp_norm": "post_attention_layernorm.weight",
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


def _rope(cfg: dict) -> tuple[float, dict | None]:
    """(rope_theta, rope_scaling) from transformers 4.x (`rope_theta`, `rope_scaling` with "type" or "rope_type")
    or 5.x (`rope_parameters` holding both) configs. Scaling "default" means none."""
    rope = dict(cfg.get("rope_parameters") or cfg.get("rope_scaling") or {})
    if "type" in rope:
        rope.setdefault("rope_type", rope.pop("type"))
        rope.pop("type", None)
    theta = cfg.get("rope_theta") or rope.pop("rope_theta", None) or 10000.0
    rope.pop("rope_theta", None)
    return float(theta), (rope if rope.get("rope_type", "default") != "default" else None)


def _sliding_window(cfg: dict, model_type: str) -> int | None:
    window = cfg.get("sliding_window")
    if model_type == "mistral" or window is None:
        return window
    if model_type != "qwen2":
        return None
    # Qwen2 slides only in layers >= max_window_layers, and only with use_sliding_window (5.x: layer_types)
    types = cfg.get("layer_types")
    if types is None:
        if not cfg.get("use_sliding_window", False):
            return None
        start = cfg.get("max_window_layers", 0)
        types = ["sliding_attention" if i >= start else "full_attention" for i in range(cfg["num_hidden_layers"])]
    if "sliding_attention" not in types:
        return None
    if set(types) != {"sliding_attention"}:
        raise ValueError(f"layer_types={types} mixes sliding and full attention layers; jaxpaged applies one "
                         "sliding_window to every layer")
    return window


def model_config_from_hf(cfg: dict, generation_cfg: dict | None = None) -> ModelConfig:
    model_type = cfg.get("model_type")
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise ValueError(f"unsupported architecture model_type={model_type!r}; supported: "
                         f"{', '.join(SUPPORTED_MODEL_TYPES)}")
    if cfg.get("mlp_bias"):
        raise ValueError("mlp_bias=true is not supported (the MLP has no biases in jaxpaged)")
    gen = generation_cfg or {}
    theta, scaling = _rope(cfg)
    heads = cfg["num_attention_heads"]
    bos = _token_ids(gen.get("bos_token_id"), cfg.get("bos_token_id"))
    return ModelConfig(
        vocab_size=cfg["vocab_size"], hidden_size=cfg["hidden_size"], intermediate_size=cfg["intermediate_size"],
        num_layers=cfg["num_hidden_layers"], num_heads=heads,
        num_kv_heads=cfg.get("num_key_value_heads") or heads,
        head_dim=cfg.get("head_dim") or cfg["hidden_size"] // heads, rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
        rope_theta=theta, rope_scaling=scaling, max_position_embeddings=cfg.get("max_position_embeddings", 2048),
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        attention_bias=bool(cfg.get("attention_bias") or model_type == "qwen2"),  # Qwen2 always has q/k/v biases
        sliding_window=_sliding_window(cfg, model_type),
        bos_token_id=bos[0] if bos else None,
        eos_token_ids=_token_ids(gen.get("eos_token_id"), cfg.get("eos_token_id")), architecture=model_type)


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
    return model_config_from_hf(_read_json(os.path.join(directory, "config.json")),
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
