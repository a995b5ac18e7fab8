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

from jaxpaged.models import gemma3
from tests.models.gemma3_cases import CASES, VOCAB, hf_model, ours

PROMPT_LEN, NEW_TOKENS = 12, 16
# float32 with different summation orders over 5 layers; logits are O(10)
LOGIT_ATOL = 1e-4

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
