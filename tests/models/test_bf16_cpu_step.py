"""A 16-bit model on CPU runs its weights in 16 bits: the compiled step converts no weight to float32 outside the
fusion that slices one layer, and a tied LM head is kept transposed (issue #11, "bfloat16 that pays")."""

from __future__ import annotations

import re

import jax.numpy as jnp
import numpy as np

from jaxpaged import SamplingParams
from jaxpaged.worker.step import step_compiler_options
from tests.tiny import random_params, random_prompts, tiny_config, tiny_llm

# A vocabulary no activation shares a shape with; tied embeddings (SmolLM2's case).
CONFIG = tiny_config(vocab_size=136, hidden=32, layers=3, heads=4, kv_heads=2, head_dim=8, tie_word_embeddings=True)


def top_level_f32_outputs(hlo: str) -> set[str]:
    """Shapes of float32 values materialised by the program itself: instructions of the entry and control-flow
    computations (fusion bodies excluded: a convert fused with a slice only touches the slice)."""
    fused = set(re.findall(r"calls=(%[\w.\-]+)", hlo))
    shapes, current = set(), None
    for line in hlo.splitlines():
        header = re.match(r"(?:ENTRY )?(%[\w.\-]+) .*\{$", line)
        if header:
            current = header.group(1)
            continue
        if current is not None and current not in fused:
            shapes.update(re.findall(r"= f32\[([\d,]+)\]", line))
    return shapes


def weight_shapes(params) -> set[str]:
    import jax

    return {",".join(map(str, x.shape)) for x in jax.tree.leaves(params) if x.ndim >= 2}


def generate(llm, n: int = 2, max_tokens: int = 4):
    prompts = random_prompts(n, 5, 20, vocab=CONFIG.vocab_size, seed=1)
    sp = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    return [o.outputs[0].token_ids for o in llm.generate([{"prompt_token_ids": p} for p in prompts], sp,
                                                         use_tqdm=False)]


def test_bfloat16_steps_convert_no_weight_to_float32():
    llm = tiny_llm(CONFIG, random_params(CONFIG), dtype="bfloat16")
    generate(llm)
    runner = llm.engine.runner
    assert step_compiler_options(runner.params)  # the option that keeps the conversion inside the layer's slice
    weights = weight_shapes(runner.params)
    assert runner._executables  # a prefill and a decode shape at least
    for key, executable in runner._executables.items():
        assert not weights & top_level_f32_outputs(executable.as_text()), key


def test_the_check_sees_a_hoisted_conversion():
    """The contrast: compiled without the step's options, XLA hoists the stacked weights' float32 conversion out of
    the layer loop, and the check above finds it. (Qwen3's per-head q/k norm weights are sliced by XLA: where the
    native CPU kernels run, they read every other stacked weight themselves.)"""
    config = tiny_config(vocab_size=136, hidden=32, layers=3, heads=4, kv_heads=2, head_dim=8,
                         tie_word_embeddings=True, qk_norm=True)
    params = random_params(config)
    params["layers"]["q_norm"] = params["layers"]["k_norm"] = np.full((3, 8), 1.1, np.float32)
    llm = tiny_llm(config, params, dtype="bfloat16")
    generate(llm, n=1, max_tokens=2)
    runner = llm.engine.runner
    layout = next(lay for lay in runner.all_layouts() if lay.key in runner._executables)
    hlo = runner.lower(layout).compile().as_text()
    assert weight_shapes(runner.params) & top_level_f32_outputs(hlo)


def test_a_tied_head_is_kept_transposed_in_16_bits_on_cpu_only():
    params = random_params(CONFIG)
    bf16 = tiny_llm(CONFIG, params, dtype="bfloat16").engine.runner.params
    head_t = np.asarray(bf16["head_t"][...].astype(jnp.float32))
    embed = np.asarray(bf16["embed"][...].astype(jnp.float32))
    assert bf16["head_t"][...].dtype == jnp.bfloat16 and head_t.shape == (CONFIG.hidden_size, CONFIG.vocab_size)
    np.testing.assert_array_equal(head_t, embed.T)
    assert "head_t" not in tiny_llm(CONFIG, params).engine.runner.params  # float32: the dot is fast either way
    untied = tiny_config(vocab_size=136, hidden=32, layers=3, heads=4, kv_heads=2, head_dim=8)
    assert "head_t" not in tiny_llm(untied, random_params(untied), dtype="bfloat16").engine.runner.params


def test_the_fast_bfloat16_step_gives_the_tokens_and_logprobs_of_the_plain_one(monkeypatch):
    """The transposed head and the compile option change where XLA converts, not what the step computes: the same
    greedy tokens and log-probs (to bfloat16 rounding of the logits) as the step without them."""
    from jaxpaged.models import llama
    from jaxpaged.worker import model_runner

    params = random_params(CONFIG)
    prompts = random_prompts(3, 5, 20, vocab=CONFIG.vocab_size, seed=1)
    sp = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True, logprobs=3)

    def run():
        outs = tiny_llm(CONFIG, params, dtype="bfloat16").generate([{"prompt_token_ids": p} for p in prompts], sp,
                                                                   use_tqdm=False)
        return [o.outputs[0] for o in outs]

    fast = run()
    monkeypatch.setattr(llama, "keep_transposed_head", lambda model, dtype: None)
    monkeypatch.setattr(model_runner, "step_compiler_options", lambda params, gpu_loop="kernel": {})
    plain = run()
    for f, p in zip(fast, plain, strict=True):
        assert f.token_ids == p.token_ids
        np.testing.assert_allclose(f.cumulative_logprob, p.cumulative_logprob, atol=5e-2)


def test_auto_dtype_is_bfloat16_where_bfloat16_dots_are_native(monkeypatch):
    from jaxpaged.engine import setup as engine_setup

    assert engine_setup.resolve_dtype("float16", "cpu") == "float16"  # an explicit dtype is kept
    assert engine_setup.resolve_dtype("auto", "gpu") == engine_setup.resolve_dtype("auto", "tpu") == "bfloat16"
    monkeypatch.setattr(engine_setup, "cpu_has_bf16_dots", lambda: False)
    assert engine_setup.resolve_dtype("auto", "cpu") == "float32"
    monkeypatch.setattr(engine_setup, "cpu_has_bf16_dots", lambda: True)
    assert engine_setup.resolve_dtype("auto", "cpu") == "bfloat16"
    llm = tiny_llm(CONFIG, random_params(CONFIG), dtype="auto")
    assert llm.engine.runner.params["embed"][...].dtype == jnp.bfloat16


def test_this_cpus_flags_decide_auto():
    from jaxpaged.engine import setup as engine_setup

    with open("/proc/cpuinfo") as f:
        native = any(flag in f.read().split() for flag in ("avx512_bf16", "amx_bf16", "bf16"))
    assert engine_setup.cpu_has_bf16_dots() == native
    assert engine_setup.resolve_dtype("auto", "cpu") == ("bfloat16" if native else "float32")
