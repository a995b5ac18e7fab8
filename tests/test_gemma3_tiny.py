"""Gemma 3's dense reference forward (jaxpaged.models.gemma3) against transformers' Gemma3ForCausalLM on tiny
random-weight text models, float32 on CPU: all-position logits and greedy tokens (transformers' generate runs its
own KV cache, sliding layers included).

The configs make every Gemma detail visible: a sliding window shorter than the sequence, sliding and full layers
with different rope bases, GQA 4:1 with a single kv head, head_dim != hidden / heads, a query scale that is not
head_dim ** -0.5, and norm weights far from 0 (Gemma scales by 1 + w). The second case adds final logit
soft-capping, linear rope scaling on the full layers and an untied LM head. (Gemma 3 has no attention soft-capping:
transformers keeps `attn_logit_softcapping` in the config but never applies it, nor does llama.cpp.)
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
import transformers

from jaxpaged.config import ModelConfig
from jaxpaged.loader.layout import assemble
from jaxpaged.models import gemma3

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
PROMPT_LEN, NEW_TOKENS = 12, 16
# float32 with different summation orders over 5 layers; logits are O(10)
LOGIT_ATOL = 1e-4

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


def prompt() -> list[int]:
    return np.random.default_rng(1).integers(3, VOCAB, size=PROMPT_LEN).tolist()


@pytest.mark.parametrize("case", sorted(CASES))
def test_all_position_logits_match_transformers(case):
    model = hf_model(case)
    config, params = ours(model)
    ids = prompt() * 2  # 24 tokens: several times the window of 5
    with torch.no_grad():
        want = model(torch.tensor([ids])).logits[0].numpy()  # [T, V]
    with jax.default_matmul_precision("highest"):  # float32 products on GPU / TPU too, as the engine's float32 step
        hidden = gemma3.forward_dense(params, jnp.asarray(ids, jnp.int32), config=config)
        got = np.asarray(gemma3.logits(params, hidden, config=config))
    assert np.abs(want).max() > 1.0  # logits are spread, so the tolerance is meaningful
    np.testing.assert_allclose(got, want, rtol=0, atol=LOGIT_ATOL)


@pytest.mark.parametrize("case", sorted(CASES))
def test_greedy_tokens_match_transformers_generate(case):
    model = hf_model(case)
    config, params = ours(model)
    ids = prompt()
    with torch.no_grad():
        out = model.generate(torch.tensor([ids]), max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS,
                             do_sample=False, pad_token_id=0)
    want = out[0, len(ids):].tolist()
    assert gemma3.greedy(params, ids, NEW_TOKENS, config=config) == want


def test_sliding_window_changes_the_answer():
    """The window bites in these configs: with a window longer than the sequence (same layers, same rope bases) the
    last position's logits differ."""
    config, params = ours(hf_model("base"))
    ids = jnp.asarray(prompt() * 2, jnp.int32)
    windowed = gemma3.logits(params, gemma3.forward_dense(params, ids, config=config)[-1:], config=config)
    unwindowed_config = dataclasses.replace(config, sliding_window=10_000)
    unwindowed = gemma3.logits(params, gemma3.forward_dense(params, ids, config=unwindowed_config)[-1:],
                               config=unwindowed_config)
    assert np.abs(np.asarray(windowed) - np.asarray(unwindowed)).max() > 1e-2


def test_gguf_layer_pattern_follows_llama_cpp():
    """Absent from the file: llama.cpp's gemma3 default (every 6th layer global), which is transformers' too."""
    from jaxpaged.loader.gguf_file import _gemma3_layer_types

    want = tuple(transformers.Gemma3TextConfig(num_hidden_layers=18).layer_types)
    assert _gemma3_layer_types(None, 18) == want
    assert _gemma3_layer_types(6, 18) == want
    assert _gemma3_layer_types([True, False, True], 3) == ("sliding_attention", "full_attention", "sliding_attention")
    with pytest.raises(ValueError, match="sliding_window_pattern"):
        _gemma3_layer_types([True, False], 3)


def test_the_llama_module_refuses_a_gemma_config():
    """The Llama module refuses a Gemma config, naming what it lacks, rather than running Gemma's weights through
    Llama's layers (the engine serves Gemma 3 with Gemma3ForCausalLM, picked by jaxpaged.models.families)."""
    from jaxpaged.models import llama

    config, _ = ours(hf_model("base"))
    with pytest.raises(ValueError, match="architecture='gemma3' cannot run as LlamaForCausalLM.*post_norms"):
        llama.abstract_model(config)


def test_bad_gemma_config_fields_are_named():
    config, _ = ours(hf_model("base"))
    with pytest.raises(ValueError, match="layer_types"):
        dataclasses.replace(config, layer_types=("sliding_attention",))
    with pytest.raises(ValueError, match="layer_types.*unknown"):
        dataclasses.replace(config, layer_types=("local",) * config.num_layers)
    with pytest.raises(ValueError, match="sliding_window"):
        dataclasses.replace(config, sliding_window=None)
    with pytest.raises(ValueError, match="hidden_act"):
        dataclasses.replace(config, hidden_act="relu")
    with pytest.raises(ValueError, match="query_pre_attn_scalar"):
        dataclasses.replace(config, query_pre_attn_scalar=0.0)
    # a JSON round trip gives a list; the config keeps a tuple so it still compares equal
    assert dataclasses.replace(config, layer_types=list(config.layer_types)) == config
