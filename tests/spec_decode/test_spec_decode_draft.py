"""Draft models (`jaxpaged.spec_decode.draft`): the target's first N layers as a module of its own class, sharing
its embedding, final norm and head; with every layer it gives the target's logits exactly, with fewer it equals
transformers' model cut to those layers (Llama and Gemma 3, float32 on CPU); a draft whose vocabulary differs is
refused naming `speculative_config.model`, before its weights load."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
import transformers
from flax import nnx

from jaxpaged.loader import load_model
from jaxpaged.models import families
from jaxpaged.models.llama import LlamaForCausalLM
from jaxpaged.spec_decode.config import SpeculativeConfig
from jaxpaged.spec_decode.draft import check_draft, load_draft, truncated_draft
from jaxpaged.worker.attention import AttentionMetadata, KVPool, attention_backend
from tests.tiny import random_params, tiny_config

BLOCK = 8
LOGIT_ATOL = 1e-4  # float32, different summation orders than torch's


def forward_logits(model: nnx.Module, ids: list[int]) -> np.ndarray:
    """All-position logits [T, V] of one sequence, as a single prefill through a fresh paged pool with the reference
    attention backend (block 0 is the null block; the sequence takes blocks 1, 2, ...)."""
    c = model.config
    num_tokens = len(ids)
    num_blocks = -(-num_tokens // BLOCK)
    pool = KVPool(jnp.zeros((c.num_layers, num_blocks + 1, BLOCK, c.num_kv_heads, c.head_dim), jnp.float32),
                  jnp.zeros((c.num_layers, num_blocks + 1, BLOCK, c.num_kv_heads, c.head_dim), jnp.float32))
    md = AttentionMetadata(positions=jnp.arange(num_tokens, dtype=jnp.int32),
                           slot_mapping=jnp.arange(num_tokens, dtype=jnp.int32) + BLOCK,
                           block_tables=jnp.arange(1, num_blocks + 1, dtype=jnp.int32)[None, :],
                           context_lens=jnp.array([num_tokens], jnp.int32),
                           query_start_loc=jnp.array([0, num_tokens], jnp.int32),
                           logits_indices=jnp.array([num_tokens - 1], jnp.int32), tile_size=1, decode_blocks=None)
    attn = attention_backend("reference")
    graphdef, state = nnx.split(model)

    @jax.jit
    def run(state, pool, ids, md):
        module = nnx.merge(graphdef, state)
        hidden, _ = module(ids, pool, md, attn)
        return module.logits(hidden)

    with jax.default_matmul_precision("highest"):
        return np.asarray(run(state, pool, jnp.asarray(ids, jnp.int32), md))


def tiny_llama(layers: int = 3, **kw) -> LlamaForCausalLM:
    """Host (numpy) params in the loader's layout; a module's own random init (device arrays) for the variants
    `random_params` does not draw (q/k norms, tied head)."""
    config = tiny_config(layers=layers, **kw)
    if kw.keys() - {"vocab_size"}:
        return LlamaForCausalLM(config, rngs=nnx.Rngs(0))
    return families.from_params(config, random_params(config))


IDS = np.random.default_rng(0).integers(3, 96, size=21).tolist()


@pytest.mark.parametrize("kw", [{}, {"qk_norm": True, "tie_word_embeddings": True}], ids=["llama", "qwen3-tied"])
def test_a_draft_with_every_layer_gives_the_targets_logits(kw):
    target = tiny_llama(3, **kw)
    draft = truncated_draft(target, 3)
    np.testing.assert_array_equal(forward_logits(draft, IDS), forward_logits(target, IDS))


def test_the_draft_shares_the_targets_embedding_norm_and_head():
    target = tiny_llama(3)
    draft = truncated_draft(target, 2)
    assert type(draft) is LlamaForCausalLM and draft.config.num_layers == 2 and target.config.num_layers == 3
    assert draft.embed is target.embed and draft.final_norm is target.final_norm and draft.lm_head is target.lm_head
    # host arrays: the first two layers are a view of the target's stack, not a copy
    wq = draft.layers.wq[...]
    assert wq.shape[0] == 2 and np.shares_memory(wq, target.layers.wq[...])
    np.testing.assert_array_equal(wq, target.layers.wq[...][:2])
    # device arrays: sliced once, the right layers
    target_device = families.from_params(target.config, jax.tree.map(jnp.asarray, nnx.state(target)))
    sliced = truncated_draft(target_device, 1)
    np.testing.assert_array_equal(np.asarray(sliced.layers.w_down[...]), target.layers.w_down[...][:1])
    assert sliced.embed is target_device.embed


def test_fewer_layers_equal_transformers_cut_to_those_layers(tiny_hf_model):
    path = tiny_hf_model("llama", num_hidden_layers=3)
    loaded = load_model(path)
    target = families.from_params(loaded.config, loaded.params)
    draft = load_draft(SpeculativeConfig(num_speculative_tokens=2, draft_num_layers=1), target)
    got = forward_logits(draft, IDS)
    hf = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    hf.model.layers = hf.model.layers[:1]
    hf.config.num_hidden_layers = 1
    with torch.no_grad():
        want = hf(torch.tensor([IDS])).logits[0].numpy()
        full = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)(
            torch.tensor([IDS])).logits[0].numpy()
    assert got.shape == (len(IDS), loaded.config.vocab_size)
    assert np.abs(want - full).max() > 0.1  # the cut changes the answer, so the comparison means something
    np.testing.assert_allclose(got, want, rtol=0, atol=LOGIT_ATOL)


def test_gemma3_draft_keeps_the_first_layer_types():
    from tests.models.gemma3_cases import engine_hf_model as gemma_hf_model
    from tests.models.gemma3_cases import ours

    hf = gemma_hf_model("base")  # 7 layers: sliding, sliding, full, ...
    config, params = ours(hf)
    target = families.from_params(config, params)
    draft = truncated_draft(target, 4)
    assert draft.config.layer_types == tuple(config.layer_types[:4])
    whole = truncated_draft(target, 7)
    np.testing.assert_array_equal(forward_logits(whole, IDS[:13]), forward_logits(target, IDS[:13]))
    hf.model.layers = hf.model.layers[:4]
    hf.config.num_hidden_layers = 4
    hf.config.layer_types = hf.config.layer_types[:4]
    with torch.no_grad():
        want = hf(torch.tensor([IDS])).logits[0].numpy()
    np.testing.assert_allclose(forward_logits(draft, IDS), want, rtol=0, atol=LOGIT_ATOL)


def test_a_draft_module_with_another_vocabulary_is_refused():
    target = tiny_llama(2)
    other = LlamaForCausalLM(tiny_config(vocab_size=100), rngs=nnx.Rngs(0))
    spec = SpeculativeConfig(num_speculative_tokens=2, model=other)
    with pytest.raises(ValueError, match="speculative_config.model has a vocabulary of 100 tokens, the target "
                                         "model 96"):
        load_draft(spec, target)
    same = LlamaForCausalLM(tiny_config(layers=1), rngs=nnx.Rngs(1))
    assert load_draft(SpeculativeConfig(num_speculative_tokens=2, model=same), target) is same


def test_a_draft_path_with_another_vocabulary_is_refused_before_loading(tiny_hf_model, monkeypatch):
    target = tiny_llama(2, vocab_size=384)
    path = tiny_hf_model("llama", vocab_size=400)

    def no_loading(*args, **kw):
        raise AssertionError("the draft's weights were loaded before its vocabulary was checked")

    monkeypatch.setattr("jaxpaged.loader.load_model", no_loading)
    with pytest.raises(ValueError, match="speculative_config.model has a vocabulary of 400 tokens, the target "
                                         "model 384"):
        load_draft(SpeculativeConfig(num_speculative_tokens=2, model=path), target)


def test_a_draft_path_with_the_same_vocabulary_loads(tiny_hf_model):
    target = tiny_llama(2, vocab_size=384)
    draft = load_draft(SpeculativeConfig(num_speculative_tokens=2, model=tiny_hf_model("qwen2")), target)
    assert draft.config.vocab_size == 384 and draft.config.num_layers == 2
    assert forward_logits(draft, IDS[:5]).shape == (5, 384)


def test_bad_drafts_name_the_field(tmp_path):
    target = tiny_llama(2)
    with pytest.raises(ValueError, match="draft_num_layers=3 exceeds the target model's 2 layers"):
        check_draft(SpeculativeConfig(num_speculative_tokens=2, draft_num_layers=3), target.config)
    with pytest.raises(FileNotFoundError, match="speculative_config.model='/no/such/draft'"):
        check_draft(SpeculativeConfig(num_speculative_tokens=2, model="/no/such/draft"), target.config)
    (tmp_path / "notes.txt").write_text("not a model")
    with pytest.raises(ValueError, match="speculative_config.model=.*is a file but not a GGUF file"):
        check_draft(SpeculativeConfig(num_speculative_tokens=2, model=str(tmp_path / "notes.txt")), target.config)

    class NotAModel(nnx.Module):
        def __init__(self):
            self.config = None

    with pytest.raises(TypeError, match="speculative_config.model: NotAModel.config must have the fields"):
        check_draft(SpeculativeConfig(num_speculative_tokens=2, model=NotAModel()), target.config)

    with pytest.raises(TypeError, match="draft_num_layers makes a draft from the built-in modules"):
        truncated_draft(NotAModel(), 1)
    # ngram needs no draft
    check_draft(SpeculativeConfig(num_speculative_tokens=2, method="ngram"), target.config)
