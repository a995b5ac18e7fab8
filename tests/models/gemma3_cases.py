"""Tiny random-weight Gemma 3 models for the tests that check ours against transformers' Gemma3ForCausalLM
(tests/models/test_gemma3_tiny.py says what the configs make visible), and `ours`: our config and params from a
transformers model, mapped by hand here, independently of any loader."""

from __future__ import annotations

import numpy as np
import torch
import transformers

from jaxpaged.config import ModelConfig
from jaxpaged.loader.layout import assemble

VOCAB = 256
BASE = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=5, num_attention_heads=4,
            num_key_value_heads=1, head_dim=32, query_pre_attn_scalar=24, sliding_window=5,
            layer_types=["sliding_attention", "sliding_attention", "full_attention", "sliding_attention",
                         "full_attention"],
            rope_parameters={"full_attention": {"rope_type": "default", "rope_theta": 1e6},
                             "sliding_attention": {"rope_type": "default", "rope_theta": 1e4}},
            max_position_embeddings=256, rms_norm_eps=1e-6, pad_token_id=0, eos_token_id=1, bos_token_id=2)
CASES = {
    "base": {},
    "softcap_scaled_untied": dict(
        final_logit_softcapping=4.0, tie_word_embeddings=False,
        rope_parameters={"full_attention": {"rope_type": "linear", "factor": 4.0, "rope_theta": 1e6},
                         "sliding_attention": {"rope_type": "default", "rope_theta": 1e4}}),
}
LAYER_TYPES = ["sliding_attention", "sliding_attention", "full_attention"] * 2 + ["sliding_attention"]

# HF per-layer suffix -> our layers key (Gemma 3 names its pre-MLP norm pre_feedforward_layernorm; its
# post_attention_layernorm is applied to the attention output, unlike Llama's)
LAYER_MAP = {
    "input_layernorm.weight": "attn_norm", "self_attn.q_proj.weight": "wq", "self_attn.k_proj.weight": "wk",
    "self_attn.v_proj.weight": "wv", "self_attn.o_proj.weight": "wo", "self_attn.q_norm.weight": "q_norm",
    "self_attn.k_norm.weight": "k_norm", "post_attention_layernorm.weight": "post_attn_norm",
    "pre_feedforward_layernorm.weight": "mlp_norm", "post_feedforward_layernorm.weight": "post_mlp_norm",
    "mlp.gate_proj.weight": "w_gate", "mlp.up_proj.weight": "w_up", "mlp.down_proj.weight": "w_down",
}


def hf_model(case: str, **overrides) -> transformers.Gemma3ForCausalLM:
    """Random weights drawn so logits are spread: matrices N(0, 1/fan_in), embeddings N(0, 1) (times
    sqrt(hidden) in the model, so the tied LM head is N(0, 1/hidden)), norm weights N(0, 0.3^2)."""
    cfg = transformers.Gemma3TextConfig(**{**BASE, **CASES[case], **overrides})
    torch.manual_seed(0)
    model = transformers.Gemma3ForCausalLM(cfg).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.normal_(0.0, 0.3)
            elif "embed_tokens" in name:
                p.normal_(0.0, 1.0)
            elif name == "lm_head.weight":
                p.normal_(0.0, cfg.hidden_size ** -0.5)
            else:
                p.normal_(0.0, p.shape[1] ** -0.5)
    return model


def ours(model: transformers.Gemma3ForCausalLM) -> tuple[ModelConfig, dict]:
    """Our config and params from transformers' config and state dict, mapped by hand here (independently of
    any loader). ModelConfig stores rope_scaling for the full layers and rope_local_theta for the sliding ones."""
    cfg = model.config
    full, local = cfg.rope_parameters["full_attention"], cfg.rope_parameters["sliding_attention"]
    scaling = {k: v for k, v in full.items() if k != "rope_theta"}
    config = ModelConfig(
        vocab_size=cfg.vocab_size, hidden_size=cfg.hidden_size, intermediate_size=cfg.intermediate_size,
        num_layers=cfg.num_hidden_layers, num_heads=cfg.num_attention_heads, num_kv_heads=cfg.num_key_value_heads,
        head_dim=cfg.head_dim, rms_norm_eps=cfg.rms_norm_eps, rope_theta=full["rope_theta"],
        rope_scaling=scaling if scaling["rope_type"] != "default" else None,
        max_position_embeddings=cfg.max_position_embeddings, tie_word_embeddings=cfg.tie_word_embeddings,
        qk_norm=True, sliding_window=cfg.sliding_window, architecture="gemma3", layer_types=tuple(cfg.layer_types),
        rope_local_theta=local["rope_theta"], query_pre_attn_scalar=cfg.query_pre_attn_scalar,
        hidden_act=cfg.hidden_activation, embedding_multiplier=cfg.hidden_size ** 0.5, rms_norm_unit_offset=True,
        post_norms=True, final_logit_softcapping=cfg.final_logit_softcapping)
    state = {k: v.numpy() for k, v in model.state_dict().items()}
    globals_ = {"embed": "model.embed_tokens.weight", "final_norm": "model.norm.weight", "lm_head": "lm_head.weight"}
    hf_names = {ours_: hf for hf, ours_ in LAYER_MAP.items()}

    def fetch(name: str, layer: int | None) -> np.ndarray:
        return state[globals_[name] if layer is None else f"model.layers.{layer}.{hf_names[name]}"]

    return config, assemble(config, fetch, np.float32)


def engine_hf_model(case: str) -> transformers.Gemma3ForCausalLM:
    """As hf_model (spread random weights), with 7 layers of period 3 (tests/models/test_gemma3_engine.py)."""
    return hf_model(case, num_hidden_layers=len(LAYER_TYPES), layer_types=LAYER_TYPES)
