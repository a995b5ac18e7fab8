"""kv_cache_dtype="fp8" / "fp8_e4m3" / "fp8_e5m2" through the engine, on tiny in-memory models (bfloat16 weights, the
CPU default): the names, the budget in fp8 bytes, the start-up log and stats, accuracy against a bfloat16 pool
(teacher-forced log-probs through the paged path, jaxpaged/worker/scoring.py, and greedy tokens), and prefix caching,
copy-on-write, swapping and tensor parallelism unchanged with an fp8 pool; bad values are ValueErrors naming
kv_cache_dtype before anything loads.
"""

from __future__ import annotations

import logging

import jax.numpy as jnp
import numpy as np
import pytest

from jaxpaged import LLM, SamplingParams
from jaxpaged.engine.setup import EngineConfig
from jaxpaged.worker import kv_quant
from jaxpaged.worker.scoring import score_text
from tests.tiny import random_params, random_prompts, tiny_config

CONFIG = tiny_config(hidden=64, layers=2, heads=4, kv_heads=2, head_dim=16)
PARAMS = random_params(CONFIG)
BS = 8


def make_llm(kv_cache_dtype: str, **kw) -> LLM:
    opts = dict(dtype="bfloat16", max_num_seqs=8, max_num_batched_tokens=128, max_model_len=128, block_size=BS,
                num_blocks=120, precompile=False, show_progress=False, kv_cache_dtype=kv_cache_dtype)
    opts.update(kw)
    return LLM.from_params(CONFIG, PARAMS, None, **opts)


def tokens(outs):
    return [[c.token_ids for c in o.outputs] for o in outs]


@pytest.mark.parametrize("name, dtype", [("fp8", jnp.float8_e4m3fn), ("fp8_e4m3", jnp.float8_e4m3fn),
                                         ("fp8_e5m2", jnp.float8_e5m2)])
def test_vllm_fp8_names_give_an_fp8_pool_of_one_byte_per_element(name, dtype):
    llm = make_llm(name)
    assert llm.engine.runner.kv_pool.dtype == dtype
    s = llm.stats()
    assert s["kv_cache_dtype"] == jnp.dtype(dtype).name
    assert s["kv_bytes_per_token"] == 2 * CONFIG.num_layers * CONFIG.num_kv_heads * CONFIG.head_dim * 1
    assert make_llm("bfloat16").stats()["kv_bytes_per_token"] == 2 * s["kv_bytes_per_token"]


def test_the_same_budget_holds_twice_the_tokens_of_bfloat16_and_four_times_float32():
    blocks = {kv: make_llm(kv, num_blocks=None, kv_cache_memory="1MiB").engine.runner.num_blocks
              for kv in ("float32", "bfloat16", "fp8", "fp8_e5m2")}
    assert blocks["fp8"] == blocks["fp8_e5m2"] == 2 * blocks["bfloat16"] == 4 * blocks["float32"]


def test_start_up_log_names_the_format_and_its_bytes_per_token(caplog):
    with caplog.at_level(logging.INFO, logger="jaxpaged.engine.setup"):
        make_llm("fp8")
    line = next(r.getMessage() for r in caplog.records if r.getMessage().startswith("KV cache format"))
    assert "float8_e4m3fn" in line and "scales k 1, v 1" in line and "Hadamard" in line and "448" in line
    assert f"{2 * 2 * 2 * 16} bytes per token" in line


# ---- accuracy against a bfloat16 pool --------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def scored():
    ids = np.random.default_rng(0).integers(2, CONFIG.vocab_size, 400)
    return {kv: score_text(make_llm(kv).engine.runner, ids, window=128, chunk=32, bos_token_id=1)
            for kv in ("float32", "bfloat16", "fp8", "fp8_e5m2")}


def test_teacher_forced_logprobs_of_an_fp8_pool_stay_close_to_bfloat16(scored):
    """Every next token of 400 scored through the paged path: a bfloat16 model's K/V are exact in a float32 pool, so
    that one matches bfloat16 exactly; fp8 moves the log-probs and rarely the top-1 choice, e5m2 (2 mantissa bits)
    more than e4m3 (3). This random model's logits are steep (perplexity ~1e19), so a nat moves easily: measured
    mean |d logprob| 0.29 (e4m3) and 0.52 (e5m2), top-1 agreement 97.8% and 97.0%. A pool read back wrongly (a lost
    scale or rotation, misread bytes) agrees at chance, ~1%."""
    base = scored["bfloat16"]
    assert len(base.logprobs) == 400
    np.testing.assert_array_equal(scored["float32"].logprobs, base.logprobs)
    diffs = {}
    for kv, mean_tol, agree in (("fp8", 0.45, 0.95), ("fp8_e5m2", 0.8, 0.93)):
        diffs[kv] = np.abs(scored[kv].logprobs - base.logprobs).mean()
        assert 0 < diffs[kv] < mean_tol, (kv, diffs[kv])
        assert np.mean(scored[kv].greedy == base.greedy) >= agree, kv
        assert abs(scored[kv].perplexity / base.perplexity - 1) < 0.1, kv
    assert diffs["fp8"] < diffs["fp8_e5m2"]


def test_fp8_greedy_tokens_mostly_match_bfloat16():
    prompts = [{"prompt_token_ids": p} for p in random_prompts(6, 5, 40, seed=3)]
    params = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
    want = tokens(make_llm("bfloat16").generate(prompts, params, use_tqdm=False))
    got = tokens(make_llm("fp8").generate(prompts, params, use_tqdm=False))
    first_equal = sum(g[0][0] == w[0][0] for g, w in zip(got, want, strict=True))
    equal = sum(a == b for g, w in zip(got, want, strict=True) for a, b in zip(g[0], w[0], strict=True))
    assert first_equal >= 5 and equal >= 0.6 * 60, (first_equal, equal)


# ---- the pool's machinery with fp8 blocks ----------------------------------------------------------------------------

def shared_prefix_prompts():
    prefix = random_prompts(1, 32, 32, seed=11)[0]
    tails = random_prompts(3, 1, 20, seed=12)
    return [{"prompt_token_ids": p} for p in (prefix + [7], prefix + tails[0], prefix[:24] + tails[1],
                                              prefix + tails[2])]


@pytest.mark.parametrize("kv", ["fp8", "fp8_e5m2"])
def test_prefix_caching_on_and_off_give_the_same_outputs_with_an_fp8_pool(kv):
    prompts = shared_prefix_prompts()
    params = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
    off = make_llm(kv, enable_prefix_caching=False)
    want = [tokens(off.generate([p], params, use_tqdm=False))[0] for p in prompts]
    on = make_llm(kv)
    got = [tokens(on.generate([p], params, use_tqdm=False))[0] for p in prompts]
    assert got == want
    assert on.stats()["prefix_cache_hits"] >= (4 + 3 + 4) * BS  # the fp8 blocks of the prefix were reused
    on.engine.block_manager.check_invariants()


def test_copy_on_write_copies_fp8_blocks():
    """n=4 samples share the prompt's blocks; each gets its own copy of the partly filled last block (a native block
    copy of fp8 bytes) and must then continue exactly as a one-sample request drawing from its seed stream."""
    prompt = [{"prompt_token_ids": random_prompts(1, 61, 61, seed=3)[0]}]  # 8 blocks, the last one partly filled
    params = SamplingParams(n=4, temperature=1.0, max_tokens=6, seed=42, ignore_eos=True)
    llm = make_llm("fp8", enable_prefix_caching=False)
    samples = tokens(llm.generate(prompt, params, use_tqdm=False))[0]
    assert llm.stats()["cow_copies"] >= 3 and len({tuple(s) for s in samples}) > 1
    for i, sample in enumerate(samples):  # sample i draws from seed + i * the engine's stream stride
        seed = (42 + i * 0x9E3779B97F4A7C15) % 2**63
        alone = SamplingParams(n=1, temperature=1.0, max_tokens=6, seed=seed, ignore_eos=True)
        assert tokens(make_llm("fp8").generate(prompt, alone, use_tqdm=False))[0][0] == sample, i


def test_swapping_fp8_blocks_out_and_back_gives_the_same_outputs():
    prompts = [{"prompt_token_ids": p} for p in random_prompts(10, 20, 60, seed=8)]
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    want = tokens(make_llm("fp8").generate(prompts, params, use_tqdm=False))
    llm = make_llm("fp8", num_blocks=23, swap_space=0.01, preemption_mode="swap", enable_prefix_caching=False)
    assert tokens(llm.generate(prompts, params, use_tqdm=False)) == want
    s = llm.stats()
    assert s["preemptions_swap"] > 0 and s["swapped_out_blocks"] > 0 and s["swapped_in_blocks"] > 0
    assert s["num_used"] == 0 and s["num_cpu_used"] == 0
    # the host pool holds the swapped blocks in fp8: half the bytes of bfloat16 per block
    assert llm.engine.runner.host_block_bytes * 2 == make_llm("bfloat16").engine.runner.host_block_bytes


# ---- bad input -------------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("value", ["fp4", "int8", "float8", "FP8", 8])
def test_an_unknown_kv_cache_dtype_fails_before_the_model_loads(value):
    with pytest.raises((ValueError, TypeError), match="kv_cache_dtype"):
        LLM("/no/such/model.gguf", kv_cache_dtype=value)  # the path is never opened
    with pytest.raises((ValueError, TypeError), match="kv_cache_dtype"):
        EngineConfig(kv_cache_dtype=value)


def test_e4m3_on_a_gpu_before_ada_is_refused_naming_the_option():
    with pytest.raises(ValueError, match="kv_cache_dtype='fp8'.*compute capability 8.9.*fp8_e5m2"):
        kv_quant.check_kv_cache_dtype("fp8", platform="gpu", device_kind="NVIDIA A100", compute_capability="8.0")
    with pytest.raises(ValueError, match="kv_cache_dtype='fp8_e4m3'"):
        kv_quant.check_kv_cache_dtype("fp8_e4m3", platform="cuda", compute_capability="7.5")
    kv_quant.check_kv_cache_dtype("fp8_e5m2", platform="gpu", compute_capability="8.0")  # Triton converts e5m2
    kv_quant.check_kv_cache_dtype("fp8", platform="gpu", compute_capability="9.0")
    kv_quant.check_kv_cache_dtype("fp8", platform="cpu")


def test_the_cli_flag_offers_the_fp8_names():
    import argparse

    from jaxpaged.entrypoints.cli import add_engine_args

    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    assert parser.parse_args(["--kv-cache-dtype", "fp8_e5m2"]).kv_cache_dtype == "fp8_e5m2"
    with pytest.raises(SystemExit):
        parser.parse_args(["--kv-cache-dtype", "fp4"])


# ---- the format's choices ------------------------------------------------------------------------------------------

def test_key_rotation_is_orthogonal_and_chosen_per_model():
    """H is orthogonal, so (H q) . (H k) = q . k; keys are rotated for models whose keys are not RMS-normalised per
    head, and where head_dim is a power of two (kv_quant's docstring has the measurements)."""
    from dataclasses import replace

    from jaxpaged.worker.attention import attention_backend

    h = kv_quant.hadamard(64)
    np.testing.assert_allclose(h @ h.T, np.eye(64), atol=1e-6)
    x = jnp.asarray(np.random.default_rng(0).standard_normal((5, 3, 64)), jnp.float32)
    y = jnp.asarray(np.random.default_rng(1).standard_normal((5, 3, 64)), jnp.float32)
    np.testing.assert_allclose(np.asarray(jnp.sum(kv_quant.rotate(x) * kv_quant.rotate(y), -1)),
                               np.asarray(jnp.sum(x * y, -1)), rtol=1e-5, atol=1e-5)
    attn = attention_backend("reference")
    fp8 = jnp.float8_e4m3fn
    assert kv_quant.with_scales(attn, fp8, 2, 64).kv_scales.rotate_keys
    assert not kv_quant.with_scales(attn, fp8, 2, 64, keys_normalized=True).kv_scales.rotate_keys
    assert not kv_quant.with_scales(attn, fp8, 2, 80).kv_scales.rotate_keys  # not a power of two
    assert kv_quant.with_scales(attn, jnp.bfloat16, 2, 64).kv_scales is None  # only fp8 pools are scaled
    assert kv_quant.keys_normalized(replace(CONFIG, architecture="gemma3"))
    assert kv_quant.keys_normalized(replace(CONFIG, qk_norm=True)) and not kv_quant.keys_normalized(CONFIG)
    with pytest.raises(ValueError, match="finite and positive"):
        kv_quant.KVScales((1.0, 0.0), (1.0, 1.0))
