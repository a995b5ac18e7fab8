"""Weight quantization through the engine: `quantization="int8"` on a built-in model and on your own nnx module, the
quantized state in Orbax checkpoints, stats() and the start-up log, where the dequantization happens in the compiled
step, and the errors of bad options. (The kernel's numbers: test_quantized_matmul.py; GGUF formats:
test_gguf_quantized.py.)"""

from __future__ import annotations

import functools
import logging
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import jaxpaged
from jaxpaged import LLM, EngineConfig, SamplingParams
from jaxpaged.engine import quant_setup
from jaxpaged.models import quant
from jaxpaged.models.matmul import layer_matmul
from jaxpaged.models.quantize import QuantizedLinear
from pallas_kernels.cpu_native import native
from tests.quant_weights import f64, random_weight
from tests.tiny import random_params, random_prompts, tiny_config, tiny_llm


def greedy(llm, prompts, max_tokens=12):
    sp = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, logprobs=1)
    return llm.generate([{"prompt_token_ids": p} for p in prompts], sp, use_tqdm=False)


# ---- the format ---------------------------------------------------------------------------------------------------


def test_int8_rounds_each_weight_to_its_channels_grid():
    """Symmetric per output channel: s = max|w| / 127 per column, q = round(w / s) in [-127, 127], w ~ q s within
    s / 2; a table's channels are its rows."""
    rng = np.random.default_rng(0)
    w = (rng.standard_normal((3, 70, 50)) * rng.random((1, 1, 50)) * 4).astype(np.float32)  # [L, K, N]
    qw = quant.quantize_int8(w)
    s = np.abs(w).max(axis=1) / 127  # [L, N]
    np.testing.assert_allclose(np.asarray(qw.scales), s, rtol=1e-6)
    back = np.asarray(quant.dequantize(qw, np.float32))
    assert back.shape == w.shape and qw.shape == w.shape and qw.format == "int8"
    assert np.all(np.abs(back - w) <= s[:, None, :] / 2 * (1 + 1e-5))
    codes = np.asarray(qw.codes)
    assert codes.min() >= 1 and codes.max() <= 255  # q + 128, q in [-127, 127]
    table = quant.quantize_int8(w[0].T, table=True)  # [N, K]: a scale per row
    np.testing.assert_allclose(np.asarray(table.scales), np.abs(w[0]).max(axis=0) / 127, rtol=1e-6)
    # numpy arrays (checkpoints, tests) and device arrays (the engine) quantize to the same bits; a plain division
    # by 127 gave scales 1 ulp apart on some channels, where XLA multiplies by the reciprocal
    on_device = quant.quantize_int8(jnp.asarray(w))
    np.testing.assert_array_equal(np.asarray(on_device.scales), np.asarray(qw.scales))
    np.testing.assert_array_equal(np.asarray(on_device.codes), np.asarray(qw.codes))


@pytest.mark.parametrize("layout", ["plain", "panels"])
def test_embedding_rows_equal_the_dequantized_table(layout):
    rng = np.random.default_rng(1)
    qw = quant.quantize_int8(rng.standard_normal((100, 48)).astype(np.float32), table=True)
    if layout == "panels":
        qw = quant.to_panels(qw)
    ids = jnp.asarray([0, 99, 17, 17, 63], jnp.int32)
    table = np.asarray(quant.dequantize(qw, np.float32))
    np.testing.assert_array_equal(np.asarray(quant.embedding_rows(qw, ids)), table[np.asarray(ids)])


# ---- the engine ---------------------------------------------------------------------------------------------------


def test_int8_engine_agrees_with_bf16_greedy_and_logprobs():
    """A tiny model in bfloat16, its matrices and LM head int8: the same greedy tokens as full width (or the same
    first ones, where a near-tie flips), and the chosen tokens' log-probs close to the float32 model's. (Against
    the bfloat16 model's, bfloat16's own error adds to int8's: 0.062 apart on one prompt where XLA's dot runs the
    products, JAXPAGED_NATIVE=0, each within 0.04 of float32.)"""
    config = tiny_config(hidden=64, layers=2, heads=4, kv_heads=2, head_dim=16)
    params = random_params(config)
    prompts = random_prompts(6, 3, 20)
    base = greedy(tiny_llm(config, params, dtype="bfloat16"), prompts)
    exact = greedy(tiny_llm(config, params, dtype="float32"), prompts)
    llm = tiny_llm(config, params, dtype="bfloat16", quantization="int8")
    got = greedy(llm, prompts)
    same = [a.outputs[0].token_ids == b.outputs[0].token_ids for a, b in zip(got, base, strict=True)]
    assert sum(same) >= 5, same
    for a, b in zip(got, exact, strict=True):
        assert a.outputs[0].token_ids[0] == b.outputs[0].token_ids[0]
        first = a.outputs[0].token_ids[0]
        assert abs(a.outputs[0].logprobs[0][first].logprob - b.outputs[0].logprobs[0][first].logprob) < 0.05
    stats = llm.stats()
    assert stats["quantization"] == "int8" and stats["weight_format"] == "int8"
    assert stats["weight_formats"]["int8"] > 0
    # the engine holds no full-width copy of a quantized matrix
    state = nnx.to_pure_dict(llm.engine.runner.params)
    for name in ("wq", "wk", "wv", "wo", "w_gate", "w_up", "w_down"):
        assert quant.is_quantized(state["layers"][name])
    assert quant.is_quantized(state["lm_head"]) and not quant.is_quantized(state["embed"])  # untied: lookup stays
    layout = "panels" if quant_setup.native_quantized() else "plain"
    assert state["layers"]["wq"].layout == layout


def test_int8_tied_model_quantizes_the_shared_table_and_keeps_no_transposed_copy():
    config = tiny_config(hidden=64, layers=2, heads=4, kv_heads=2, head_dim=16, tie_word_embeddings=True)
    params = random_params(config)
    prompts = random_prompts(3, 4, 10)
    base = greedy(tiny_llm(config, params, dtype="bfloat16"), prompts, 6)
    llm = tiny_llm(config, params, dtype="bfloat16", quantization="int8")
    got = greedy(llm, prompts, 6)
    assert [o.outputs[0].token_ids[0] for o in got] == [o.outputs[0].token_ids[0] for o in base]
    model_state = nnx.to_pure_dict(llm.engine.runner.params)
    assert quant.is_quantized(model_state["embed"]) and model_state["embed"].table
    assert "head_t" not in model_state


def test_float32_model_int8_runs_too():
    config = tiny_config(hidden=64, layers=2, heads=4, kv_heads=2, head_dim=16)
    params = random_params(config)
    prompts = random_prompts(3, 4, 10)
    base = greedy(tiny_llm(config, params, dtype="float32"), prompts, 6)
    got = greedy(tiny_llm(config, params, dtype="float32", quantization="int8"), prompts, 6)
    assert [o.outputs[0].token_ids[0] for o in got] == [o.outputs[0].token_ids[0] for o in base]


def test_startup_log_names_the_weight_bytes_and_format(caplog):
    config = tiny_config(hidden=64, layers=2, heads=4, kv_heads=2, head_dim=16)
    with caplog.at_level(logging.INFO, logger="jaxpaged.engine.quant_setup"):
        llm = tiny_llm(config, random_params(config), dtype="bfloat16", quantization="int8")
    line = next(r.getMessage() for r in caplog.records if r.getMessage().startswith("weights:"))
    assert "quantization=int8" in line and re.search(r"int8 [\d.]+ MiB", line)
    assert llm.stats()["weight_bytes"] == sum(llm.stats()["weight_formats"].values())
    full = tiny_llm(config, random_params(config), dtype="bfloat16").stats()
    assert full["quantization"] is None and full["weight_format"] == "bfloat16"
    assert llm.stats()["weight_bytes"] < full["weight_bytes"]


def test_startup_warns_where_xla_does_not_fuse_the_dequantization(caplog, monkeypatch):
    """Every kept format is fused or run by a Pallas kernel now: on GPU int8 by XLA, the block formats by the Triton
    kernel; on TPU int8 and small 4-bit products by XLA, Q8_0 and larger 4-bit ones by the Mosaic kernel
    (docs/quantization.md), so nothing is warned about and the TPU log names the kernel. Where a backend lists a
    format in `NOT_FUSED`, the start-up log warns, naming it."""
    from jaxpaged.engine import quant_setup

    int8 = _plain_stack(layers=1, k=64, n=32)
    q8 = int8.replace(scale_mode=quant.BLOCK_SYM)
    for backend in ("gpu", "tpu", "cpu"):
        assert quant_setup.unfused_formats(["int8", "q4_0", "q8_0"], backend) == []
    monkeypatch.setattr(jax, "default_backend", lambda: "tpu")
    with caplog.at_level(logging.INFO, logger="jaxpaged.engine.quant_setup"):
        quant_setup.describe_weights({"a": int8, "b": q8}, "gguf")
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING]
    assert "Pallas TPU kernel" in caplog.records[-1].getMessage()
    caplog.clear()
    monkeypatch.setitem(quant_setup.NOT_FUSED, "tpu", ("q8_0",))
    with caplog.at_level(logging.WARNING, logger="jaxpaged.engine.quant_setup"):
        quant_setup.describe_weights({"a": int8}, "int8")
        assert not caplog.records
        quant_setup.describe_weights({"a": int8, "b": q8}, "gguf")
    (record,) = caplog.records
    assert "tpu compiler does not fuse the dequantization of q8_0 into the dot" in record.getMessage()


# ---- your own module -------------------------------------------------------------------------------------------------


def test_quantize_your_own_module_in_one_call():
    """jaxpaged.quantize(module, "int8") turns each nnx.Linear into a QuantizedLinear (kernel int8 per output
    channel, bias full width); LLM.from_model(m, quantization="int8") does it too, and serves it."""
    from tests.models.tiny_gpt import NEW_TOKENS, TinyGPT

    dense = TinyGPT(nnx.Rngs(0))
    prompt = [3, 17, 5, 42, 8]
    sp = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True, logprobs=1)
    want = LLM.from_model(dense, dtype="float32", max_num_seqs=2, max_model_len=64, block_size=8, num_blocks=32,
                          precompile=False).generate([{"prompt_token_ids": prompt}], sp, use_tqdm=False)[0]

    model = TinyGPT(nnx.Rngs(0))
    x = jnp.asarray(np.random.default_rng(0).standard_normal((5, 48)), jnp.float32)
    ref = model.blocks[0].fc(x)
    assert jaxpaged.quantize(model, "int8") is model
    assert isinstance(model.blocks[0].qkv, QuantizedLinear) and isinstance(model.head, QuantizedLinear)
    assert quant.is_quantized(model.blocks[0].fc.kernel[...])
    np.testing.assert_allclose(np.asarray(model.blocks[0].fc(x)), np.asarray(ref), atol=0.05, rtol=0.05)

    llm = LLM.from_model(TinyGPT(nnx.Rngs(0)), dtype="float32", quantization="int8", max_num_seqs=2,
                         max_model_len=64, block_size=8, num_blocks=32, precompile=False)
    got = llm.generate([{"prompt_token_ids": prompt}], sp, use_tqdm=False)[0]
    assert got.outputs[0].token_ids[:4] == want.outputs[0].token_ids[:4]
    first = want.outputs[0].token_ids[0]
    assert abs(got.outputs[0].logprobs[0][first].logprob - want.outputs[0].logprobs[0][first].logprob) < 0.05
    assert llm.stats()["weight_format"] == "int8"


# ---- checkpoints -----------------------------------------------------------------------------------------------------


def test_checkpoint_stores_quantized_weights_as_they_are(tmp_path):
    from jaxpaged.loader import LoadedModel, load_model, save_checkpoint
    from jaxpaged.models import families

    config = tiny_config(hidden=64, layers=2, heads=4, kv_heads=2, head_dim=16)
    params = random_params(config)
    params["layers"]["wq"] = quant.quantize_int8(params["layers"]["wq"])
    params["lm_head"] = quant.quantize_int8(params["lm_head"])
    save_checkpoint(LoadedModel(config, families.param_state(config, params), None, "mem"), str(tmp_path / "ck"))
    assert (tmp_path / "ck" / "quantization.json").is_file()
    back = nnx.to_pure_dict(load_model(str(tmp_path / "ck"), quantization="int8").params)
    for got, want in ((back["layers"]["wq"], params["layers"]["wq"]), (back["lm_head"], params["lm_head"])):
        assert quant.is_quantized(got) and got.meta() == want.meta()
        np.testing.assert_array_equal(np.asarray(got.codes), np.asarray(want.codes))
        np.testing.assert_array_equal(np.asarray(got.scales), np.asarray(want.scales))
    # quantization=None: dequantized at load, as a GGUF is
    full = nnx.to_pure_dict(load_model(str(tmp_path / "ck")).params)
    np.testing.assert_array_equal(full["layers"]["wq"], np.asarray(quant.dequantize(params["layers"]["wq"])))
    with pytest.raises(ValueError, match="plain layout"):  # the engine's own copy for the kernel is not saved
        params["layers"]["wk"] = quant.to_panels(quant.quantize_int8(params["layers"]["wk"]))
        save_checkpoint(LoadedModel(config, families.param_state(config, params), None, "mem"), str(tmp_path / "x"))


def test_loading_a_path_with_int8_quantizes_the_weights_as_from_params_does(tmp_path):
    """LLM(path, quantization="int8", dtype="bfloat16") quantizes the weights the file holds (float32 here), as
    LLM.from_params does the same weights: the same codes and scales, tokens and log-probs. It loaded them rounded to
    bfloat16 first, then quantized them: other codes, other log-probs."""
    from jaxpaged.loader import LoadedModel, save_checkpoint
    from jaxpaged.models import families

    config = tiny_config(hidden=64, layers=2, heads=6, kv_heads=2, head_dim=64, vocab_size=256)
    params = random_params(config, seed=4)  # float32
    save_checkpoint(LoadedModel(config, families.param_state(config, params), None, "mem"), str(tmp_path / "ck"))
    options = dict(dtype="bfloat16", quantization="int8", max_model_len=128, block_size=8, num_blocks=64,
                   precompile=False, show_progress=False)
    loaded = LLM(str(tmp_path / "ck"), **options)
    given = LLM.from_params(config, params, None, **options)
    for name in ("wq", "w_down"):
        got, want = (nnx.to_pure_dict(x.engine.runner.params)["layers"][name] for x in (loaded, given))
        np.testing.assert_array_equal(np.asarray(got.codes), np.asarray(want.codes))
        np.testing.assert_array_equal(np.asarray(got.scales), np.asarray(want.scales))
    prompts = random_prompts(4, 5, 30, vocab=256, seed=3)
    assert [(o.outputs[0].token_ids, o.outputs[0].logprobs) for o in greedy(loaded, prompts)] == \
        [(o.outputs[0].token_ids, o.outputs[0].logprobs) for o in greedy(given, prompts)]


# ---- where the dequantization happens ------------------------------------------------------------------------------


def _plain_stack(layers=4, k=256, n=512):
    w = np.random.default_rng(2).standard_normal((layers, k, n)).astype(np.float32)
    return jax.tree.map(jnp.asarray, quant.quantize_int8(w).replace(compute_dtype="bfloat16"))


def _layer_loop(qw):
    def run(x):
        def body(i, acc):
            return acc + jnp.sum(layer_matmul(x, qw, i), axis=1, keepdims=True)
        return jax.lax.fori_loop(0, qw.shape[0], body, jnp.zeros_like(x[:, :1]))
    return run


@pytest.mark.parametrize("platform", ["cuda", "tpu"])
def test_gpu_tpu_lowering_dequantizes_one_layer_at_a_time_next_to_the_dot(platform):
    """Lowered for CUDA and TPU (jax.export, no device needed): the loop reads the int8 codes and dequantizes one
    layer's [N, K] right before the dot; no full-width copy of the stacked weight ([L, N, K] or [L, K, N] in bf16 or
    f32) exists. (Whether XLA's compiler then fuses the dequantization into the GEMM is decided when it compiles
    for the device: tests/kernels/test_quant_fusion.py, docs/quantization.md "Where it is multiplied".)"""
    qw = _plain_stack()
    x = jax.ShapeDtypeStruct((8, 256), jnp.bfloat16)
    exported = jax.export.export(jax.jit(_layer_loop(qw)), platforms=[platform])(x)
    text = exported.mlir_module()
    assert re.search(r"tensor<4x512x256xui8>", text)  # the codes, as stored
    assert not re.search(r"tensor<4x(512x256|256x512)x(bf16|f32)>", text)
    assert re.search(r"tensor<512x256xbf16>", text) and "dot_general" in text


@pytest.mark.parametrize("fmt", ["q4_0", "q4_1", "q4_k"])
@pytest.mark.parametrize("m, k", [(1, 64), (5, 96), (64, 256)])
def test_nibble_matmul_is_the_dequantized_weight_times_x(fmt, m, k):
    """The 4-bit product XLA TPU fuses (`_nibble_matmul`: the bytes bitcast to uint4 pairs in place, x's columns
    permuted instead), run here on CPU: each weight is the one `quant.dequantize` gives, rounded to x's dtype, and
    the product is that weight times x up to float32 rounding, like the dense form's."""

    rng = np.random.default_rng(m + k)
    qw = jax.tree.map(jnp.asarray, random_weight(rng, fmt, 2, k, 40))
    x = jnp.asarray(rng.standard_normal((m, k)), jnp.bfloat16)
    w = f64(jnp.asarray(quant.dequantize(qw, np.float32, 1), jnp.bfloat16))  # [K, N]
    want = f64(x) @ w
    bound = 4 * np.finfo(np.float32).eps * np.sqrt(k) * (np.abs(f64(x)) @ np.abs(w)) + 1e-30
    codes, scales = qw.codes[1], qw.scales[1]
    for form in (quant._nibble_matmul, quant._dense_matmul):
        got = np.asarray(jax.jit(functools.partial(form, qw=qw))(x, codes, scales))
        assert got.shape == (m, 40) and np.all(np.abs(got - want) <= bound), form.__name__


def test_the_4bit_form_is_chosen_per_platform_and_row_count():
    """Lowered for TPU, a 4-bit product of up to NIBBLE_MAX_ROWS rows bitcasts the codes to uint4 (the form XLA TPU
    fuses into the dot); with more rows it unpacks them to the dense [N, K] weight; for CUDA it is the Pallas kernel
    (pallas_kernels/gpu_qmatmul.py) at any row count."""
    from tests.hlo_checks import TRITON_CALL_TARGETS

    rng = np.random.default_rng(3)

    qw = jax.tree.map(jnp.asarray, random_weight(rng, "q4_1", 2, 256, 512))
    checks = [jax.export.DisabledSafetyCheck.custom_call(t) for t in TRITON_CALL_TARGETS]

    def lowered(platform, rows):
        x = jax.ShapeDtypeStruct((rows, 256), jnp.bfloat16)
        fn = jax.jit(lambda x: layer_matmul(x, qw, 1))
        return jax.export.export(fn, platforms=[platform], disabled_checks=checks)(x).mlir_module()

    assert "xui4>" in lowered("tpu", 8) and "xui4>" in lowered("tpu", quant.NIBBLE_MAX_ROWS)
    assert "xui4>" not in lowered("tpu", quant.NIBBLE_MAX_ROWS + 1)
    for rows in (8, quant.NIBBLE_MAX_ROWS + 1):
        cuda = lowered("cuda", rows)
        assert "xui4>" not in cuda and any(f"@{t}(" in cuda for t in TRITON_CALL_TARGETS)


@pytest.mark.parametrize("m, k", [(1, 64), (5, 72), (64, 256)])
def test_signed_channel_matmul_is_the_float32_weight_times_x(m, k):
    """int8 per channel the way XLA GPU's GEMM fuses (`_signed_channel_matmul`: signed codes, the scale after the
    dot), run here on CPU: x times the float32 weights `quant.dequantize` gives, up to float32 rounding (K = 72 pads
    the codes to 96: the padding is not read)."""

    rng = np.random.default_rng(m + k)
    qw = jax.tree.map(jnp.asarray, quant.quantize_int8(rng.standard_normal((2, k, 40)).astype(np.float32)))
    x = jnp.asarray(rng.standard_normal((m, k)), jnp.bfloat16)
    w = f64(quant.dequantize(qw, np.float32, 1))  # [K, N]
    bound = 4 * np.finfo(np.float32).eps * np.sqrt(k) * (np.abs(f64(x)) @ np.abs(w)) + 1e-30
    got = np.asarray(jax.jit(quant._signed_channel_matmul)(x, qw.codes[1], qw.scales[1]))
    assert got.shape == (m, 40) and np.all(np.abs(got - f64(x) @ w) <= bound)


def test_int8_signed_form_is_lowered_for_cuda_only():
    qw = _plain_stack()

    def lowered(platform):
        fn = jax.jit(lambda x: layer_matmul(x, qw, 1))
        return jax.export.export(fn, platforms=[platform])(jax.ShapeDtypeStruct((8, 256), jnp.bfloat16)).mlir_module()

    assert re.search(r"tensor<512x256xi8>", lowered("cuda"))
    assert not re.search(r"xi8>", lowered("tpu"))


def test_cpu_native_step_reads_the_codes_and_builds_no_full_width_weight():
    if not quant_setup.native_quantized():
        pytest.skip("no native quantized matmul on this CPU")
    qw = jax.tree.map(jnp.asarray, quant.to_panels(_plain_stack()))
    hlo = jax.jit(_layer_loop(qw)).lower(jnp.zeros((8, 256), jnp.bfloat16)).compile().as_text()
    assert native.target_name("JaxpagedQMatmul") in hlo
    assert not re.search(r"(bf16|f32)\[(4,)?(512,256|256,512)\]", hlo)


# ---- bad options --------------------------------------------------------------------------------------------------


def test_unknown_quantization_is_refused_naming_the_option():
    with pytest.raises(ValueError, match="quantization='int4' is not supported"):
        EngineConfig(quantization="int4")
    with pytest.raises(ValueError, match="quantization"):
        LLM(model="/nonexistent.gguf", quantization="awq")  # the option fails before the path is looked at


def test_gguf_quantization_needs_a_gguf_file(tmp_path, monkeypatch):
    import jaxpaged.loader as loader

    def boom(*args, **kwargs):
        raise AssertionError("the model was loaded")

    monkeypatch.setattr(loader, "load_model", boom)
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(ValueError, match="quantization='gguf' keeps the quantized tensors of a GGUF file"):
        LLM(model=str(tmp_path), quantization="gguf")
    # a checkpoint whose quantized weights are all int8 holds no GGUF tensor: refused from its quantization.json,
    # before its weights load (it was refused after)
    from jaxpaged.loader import LoadedModel, save_checkpoint
    from jaxpaged.models import families

    config = tiny_config()
    params = random_params(config)
    params["layers"]["wq"] = quant.quantize_int8(params["layers"]["wq"])
    monkeypatch.undo()
    save_checkpoint(LoadedModel(config, families.param_state(config, params), None, "mem"), str(tmp_path / "ck"))
    monkeypatch.setattr(loader, "load_model", boom)
    with pytest.raises(ValueError, match="quantization='gguf' keeps the quantized tensors of a GGUF file"):
        LLM(model=str(tmp_path / "ck"), quantization="gguf")
    with pytest.raises(ValueError, match="quantization='gguf'"):
        tiny_llm(config, random_params(config), quantization="gguf")


def test_quantize_refuses_what_it_cannot_quantize():
    class NoLinear(nnx.Module):
        def __init__(self):
            self.w = nnx.Param(jnp.ones((4, 4)))

    with pytest.raises(ValueError, match="no flax.nnx.Linear"):
        jaxpaged.quantize(NoLinear(), "int8")
    with pytest.raises(ValueError, match="'gguf' keeps a GGUF file's own formats"):
        jaxpaged.quantize(NoLinear(), "gguf")
    with pytest.raises(ValueError, match="quantization='fp4'"):
        jaxpaged.quantize(NoLinear(), "fp4")
    with pytest.raises(TypeError, match="not indexed"):
        quant.quantize_int8(np.ones((32, 4), np.float32))[0]
