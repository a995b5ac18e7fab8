"""Tensor parallelism on 4 fake CPU devices (XLA_FLAGS=--xla_force_host_platform_device_count=4, set in a subprocess
before JAX starts; tests/parallel/tp_worker.py does the serving).

Tolerance: greedy, seeded-sampling (n=2), prefix-cached, preempted and beam-search tokens identical at tp 1, 2 and 4;
log-probs (chosen tokens and beams' cumulative ones) within 1e-4 of tp 1 (float32: only the all-reduce's summation
order differs; measured differences are ~5e-6).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np
import pytest

from jaxpaged.parallel.tensor_parallel import HeadLayout
from tests import ROOT
from tests.default_model import default_model

pytestmark = pytest.mark.slow  # starts processes or loads a real model: docs/testing.md

LOGPROB_TOL = 1e-4


def run_worker(case: str, sizes: str, devices: int = 4, timeout: int = 900) -> dict:
    env = {**os.environ, "XLA_FLAGS": f"--xla_force_host_platform_device_count={devices}", "JAX_PLATFORMS": "cpu"}
    proc = subprocess.run([sys.executable, "-m", "tests.parallel.tp_worker", case, sizes], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(proc.stdout.strip().splitlines()[-1]), proc.stderr


def assert_same_generations(results: dict) -> None:
    base = results["1"]
    for tp, got in results.items():
        for key in ("greedy", "seeded_n2", "penalized", "greedy_again", "beams", "preempted"):
            if key in base:
                assert got[key] == base[key], (tp, key)
        for key in ("greedy_logprobs", "seeded_n2_logprobs", "beam_logprobs", "prompt_logprobs"):
            if key not in base:  # (no prompt_logprobs with speculative decoding)
                continue
            flat = [x for row in _flatten(got[key]) for x in row]
            want = [x for row in _flatten(base[key]) for x in row]
            assert max(abs(a - b) for a, b in zip(flat, want, strict=True)) < LOGPROB_TOL, (tp, key)
        assert got["cached_tokens"] == base["cached_tokens"] and min(base["cached_tokens"]) >= 16
    if "preemptions" in base:
        assert all(r["preemptions"] > 0 for r in results.values())


def _flatten(x):
    if isinstance(x, list) and x and isinstance(x[0], list):
        return [y for item in x for y in _flatten(item)]
    return [x]


@pytest.fixture(scope="module", params=["tiny8", "tiny3", "gemma", "gguf"])
def tiny_results(request):
    return request.param, run_worker(request.param, "1,2,4")[0]


def test_every_tp_size_generates_the_same_tokens(tiny_results):
    """8 kv heads (split 2 and 4 ways), SmolLM2's 9 query / 3 kv heads (replicated, queries padded), a tiny
    Gemma 3 (4 query heads, its 1 kv head replicated; q/k norms, sliding-window layers, soft-capped logits) and a
    model whose layer matrices are GGUF block formats kept quantized (6 query / 3 kv heads of 32: replicated and
    padded on the codes)."""
    assert_same_generations(tiny_results[1])


def test_two_all_reduces_per_layer_and_the_pool_written_in_place(tiny_results):
    """Per layer: the collectives of the layer loop's body (it appears once in the HLO and runs once per layer), two
    all-reduces (after o and after down) and nothing else. Outside the loop: one all-reduce for the vocabulary-split
    embedding lookup and one all-gather of the logits for the sampler (and one of a scoring step's logits, whose
    layout key ends in prompt_scores True: prompt_logprobs). The pool is aliased in to out, never copied.
    (The tiny Gemma's 7 layers of period 3 run as a loop over groups of 3 layers, 6 all-reduces a body, and one
    unrolled tail layer outside the loop, 2 more there.)"""
    case, results = tiny_results
    body_layers, tail_layers = (3, 1) if case == "gemma" else (1, 0)
    for tp in ("2", "4"):
        steps = results[tp]["inspect"]["steps"]
        assert len(steps) >= 2  # prefill and decode shapes
        for key, step in steps.items():
            assert step["per_layer"] == {"all-reduce": 2 * body_layers, "all-gather": 0, "reduce-scatter": 0,
                                         "all-to-all": 0, "collective-permute": 0}, (tp, key)
            assert step["elsewhere"]["all-reduce"] == 1 + 2 * tail_layers, (tp, key)
            scoring = key.rstrip(")").split(", ")[-1] == "True"
            assert step["elsewhere"]["all-gather"] == 1 + scoring, (tp, key)
            assert step["aliased"] and step["pool_copies"] == [], (tp, key)


def test_weights_and_pool_are_split_not_copied(tiny_results):
    """Megatron split: every split tensor has exactly 1/tp of its bytes on each device; norms are replicated; the
    pool is split by kv head with each device holding its heads of every block."""
    case, results = tiny_results
    for tp in (2, 4):
        info = results[str(tp)]["inspect"]
        split = {"embed": "P('tp', None)", "lm_head": "P(None, 'tp')", "wq": "P(None, None, 'tp')",
                 "wk": "P(None, None, 'tp')", "wv": "P(None, None, 'tp')", "w_gate": "P(None, None, 'tp')",
                 "w_up": "P(None, None, 'tp')", "wo": "P(None, 'tp', None)", "w_down": "P(None, 'tp', None)"}
        for path, leaf in info["params"].items():
            name = next((n for n in split if f"['{n}']" in path), None)
            if name is None:
                assert leaf["spec"] == "P()", path
            elif path.endswith((".codes", ".scales")):
                assert_quantized_split(name, path, leaf, tp)
            else:
                assert leaf["spec"] == split[name], path
                assert leaf["max_shard_bytes"] * tp == leaf["bytes"], path
        if case == "gguf":
            assert sum(path.endswith(".codes") for path in info["params"]) == 7
        layers, blocks, bs, slots, dim = info["pool_shape"]
        assert info["pool_spec"] == "P(None, None, None, 'tp', None)" and info["pool_devices"] == tp
        assert info["local_pool"] == [layers, blocks, bs, slots // tp, dim]
        if case == "tiny8":
            assert slots == 8
        elif case in ("tiny3", "gguf"):  # 3 kv heads: 2 per device at tp 2, 1 at tp 4 (one spare slot)
            assert slots // tp == {2: 2, 4: 1}[tp]
        else:  # Gemma's one kv head on every device
            assert slots == tp


def assert_quantized_split(name: str, path: str, leaf: dict, tp: int) -> None:
    """A quantized weight's codes [L, N, K bytes] (a table's [V, K bytes]) and scales [L, N, ...] split as stored: by
    N for the column-split matrices and the vocabulary, by K for o and down (int8's per-channel scales replicated),
    1/tp of the bytes on each device."""
    if name in ("wo", "w_down"):
        if path.endswith(".scales") and len(leaf["shape"]) == 2:  # int8: one scale per output channel
            assert leaf["spec"] == "P()", path
            return
        assert leaf["split_axis"] == 2, path
    else:
        assert leaf["split_axis"] == (0 if name in ("embed", "lm_head") else 1), path
    assert leaf["max_shard_bytes"] * tp == leaf["bytes"], path


@pytest.mark.parametrize("fmt", ["int8", "q8_0", "q4_0", "q4_1", "q4_k"])
@pytest.mark.parametrize("heads,kv,tp", [(9, 3, 2), (9, 3, 4), (6, 3, 4)])
def test_heads_rearranged_on_the_codes_are_the_full_width_weights_rearranged(fmt, heads, kv, tp):
    """Expanding a quantized q / k / v / o into a head layout's slots (kv heads replicated, queries padded) on its
    codes and scales gives exactly the full-width weights expanded: the same weights, a padded head's all zero."""
    from jaxpaged.models import quant
    from jaxpaged.parallel.tensor_parallel import expand_llama_params
    from tests.quant_weights import random_weight

    head_dim, hidden, rng = 32, 64, np.random.default_rng(heads * tp)
    layout = HeadLayout.plan(heads, kv, tp)
    assert not layout.is_plain_split
    layers = {"wq": random_weight(rng, fmt, 2, hidden, heads * head_dim),
              "wk": random_weight(rng, fmt, 2, hidden, kv * head_dim),
              "wv": random_weight(rng, fmt, 2, hidden, kv * head_dim),
              "wo": random_weight(rng, fmt, 2, heads * head_dim, hidden)}
    dense = {name: np.asarray(quant.dequantize(w, np.float32)) for name, w in layers.items()}
    got = expand_llama_params({"layers": layers}, layout, head_dim)["layers"]
    want = expand_llama_params({"layers": dense}, layout, head_dim)["layers"]
    for name in layers:
        assert got[name].shape == want[name].shape, name
        np.testing.assert_array_equal(np.asarray(quant.dequantize(got[name], np.float32)), want[name], err_msg=name)
    assert not np.any(want["wo"][:, np.repeat(np.asarray(layout.q_heads) < 0, head_dim)])  # padded rows are zero


@pytest.mark.parametrize("fmt", ["int8", "q8_0", "q4_1"])
def test_a_weight_splits_by_rows_only_in_whole_blocks_of_32(fmt):
    """By rows (o, down) each device's share of K must be whole blocks of 32 in every format: the GPU kernels take
    int8 codes in blocks too (a share of 48 failed the W8A8 kernel's trace under tp 2, found by a fuzzing run); such
    a weight stays replicated. By columns any N that tp divides splits."""
    from jaxpaged.models.quant import COLUMNS, ROWS, split_axes
    from tests.quant_weights import random_weight

    rng = np.random.default_rng(0)
    assert split_axes(random_weight(rng, fmt, 2, 128, 48), ROWS, 2) == (2, None if fmt == "int8" else 2)
    assert split_axes(random_weight(rng, fmt, 2, 96, 48), ROWS, 2) is None  # 48 inputs a device
    assert split_axes(random_weight(rng, fmt, 2, 96, 48), COLUMNS, 2) == (1, 1)
    assert split_axes(random_weight(rng, fmt, 2, 96, 48), COLUMNS, 4) == (1, 1)


def test_a_block_format_needs_heads_of_whole_blocks():
    """A GGUF block format's o cannot move heads of 8 inputs (its blocks hold 32): a clear error naming the way out."""
    from jaxpaged.parallel.tensor_parallel import expand_llama_params
    from tests.quant_weights import random_weight

    layout = HeadLayout.plan(9, 3, 2)
    wo = random_weight(np.random.default_rng(0), "q4_1", 2, 9 * 8, 32)
    with pytest.raises(ValueError, match="heads of 8 inputs.*blocks of 32.*quantization='int8' or None"):
        expand_llama_params({"layers": {"wo": wo}}, layout, 8)


@pytest.mark.parametrize("heads,kv,tp,per_device,group,padded", [
    (8, 8, 2, 4, 1, 0), (8, 2, 4, 1, 2, 0), (4, 2, 4, 1, 1, 0), (9, 3, 2, 2, 3, 3), (9, 3, 4, 1, 3, 3),
    (4, 1, 4, 1, 1, 0), (32, 8, 8, 1, 4, 0)])
def test_head_layout(heads, kv, tp, per_device, group, padded):
    layout = HeadLayout.plan(heads, kv, tp)
    assert (layout.kv_per_device, layout.group) == (per_device, group)
    assert sum(q < 0 for q in layout.q_heads) == padded
    assert sorted(q for q in layout.q_heads if q >= 0) == list(range(heads))  # every query head exactly once
    g = heads // kv
    for slot, q in enumerate(layout.q_heads):  # each query slot reads the kv slot that holds its kv head
        if q >= 0:
            assert layout.kv_heads[slot // layout.group] == q // g


def test_tensor_parallel_size_must_divide_the_devices():
    from tests.tiny import tiny_llm

    with pytest.raises(ValueError, match="tensor_parallel_size=2 must divide the number of devices"):
        tiny_llm(tensor_parallel_size=2)  # this process has one CPU device
    with pytest.raises(ValueError, match="tensor_parallel_size=0 must be >= 1"):
        tiny_llm(tensor_parallel_size=0)


def test_int8_weights_under_tensor_parallelism():
    """2 fake CPU devices (a subprocess): quantization="int8" on SmolLM2's 9 query / 3 kv heads (kv heads replicated
    and queries padded on the int8 codes) gives tp 1's tokens and log-probs within the tolerance (tp 1 multiplies by
    XLA's dot too: the native kernel's int8 activations give other numbers), its codes split 1/tp each."""
    results, _ = run_worker("smol_int8", "1,2", devices=2)
    assert_same_generations(results)
    params = results["2"]["inspect"]["params"]
    codes = [path for path in params if path.endswith(".codes")]
    assert len(codes) == 8, codes  # q, k, v, o, gate, up, down and the LM head
    for path, leaf in params.items():
        if path.endswith((".codes", ".scales")):
            name = next(n for n in ("wq", "wk", "wv", "wo", "w_gate", "w_up", "w_down", "embed", "lm_head")
                        if f"['{n}']" in path)
            assert_quantized_split(name, path, leaf, 2)


def test_the_gpu_layer_matmul_runs_on_each_devices_shard():
    """2 fake CPU devices (a subprocess), the Pallas GPU layer matmul on (as on CUDA; the interpreter runs it): at
    tp 2 each device's kernel multiplies its shard (shard_map: q/k/v, gate and up by columns on the whole x, o and
    down by rows, their partial products all-reduced), with tp 1's tokens and log-probs within the tolerance, and
    the layer loop keeps its two all-reduces (no weight gathered)."""
    results, _ = run_worker("tiny8_gpukernel", "1,2", devices=2)
    assert_same_generations(results)
    one = {tuple(map(tuple, json.loads(c))) for c in results["1"]["kernel_calls"]}
    two = {tuple(map(tuple, json.loads(c))) for c in results["2"]["kernel_calls"]}
    assert one and two, "the kernel was not traced: the test would prove nothing"
    # [L, K, N] weights: hidden 32, 8 heads of 8 (q, k, v, o: 64 wide), intermediate 64
    assert {w for _, w in one} == {(2, 32, 64), (2, 64, 32)}
    assert {w for _, w in two} == {(2, 32, 32)}  # columns halve N (64 -> 32), rows halve K (64 -> 32)
    assert {x[1] for x, _ in two} == {32}  # x: the whole hidden (columns) or its half of the 64 (rows)
    for key, step in results["2"]["inspect"]["steps"].items():
        assert step["per_layer"]["all-reduce"] == 2 and step["per_layer"]["all-gather"] == 0, key


def test_default_model_at_tp_1_2_and_4():
    """SmolLM2-135M (real weights, 9 query / 3 kv heads: kv heads replicated, query heads padded at tp 2 and 4) at
    tp 1, 2 and 4: the same greedy, seeded n=2, prefix-cached and beam-search tokens, log-probs within 1e-4."""
    default_model()  # converted once, not by the worker
    results, _ = run_worker("default", "1,2,4")
    assert_same_generations(results)


def test_orbax_restores_into_the_mesh_shardings():
    """A checkpoint read at tp 4 comes back as device arrays already split (Orbax reads each shard into its device),
    and the engine serves them as they are: each device holds 1/4 of every split tensor, and the tokens are tp 1's."""
    results, _ = run_worker("ckpt", "1,4")
    assert results["4"]["greedy"] == results["1"]["greedy"]
    assert all("NamedSharding" in s for s in results["4"]["restored_sharded"])
    assert all("None" == s for s in results["1"]["restored_sharded"])  # tp 1: host arrays, as before
    for path, leaf in results["4"]["inspect"]["params"].items():
        if leaf["spec"] != "P()":
            assert leaf["max_shard_bytes"] * 4 == leaf["bytes"], path


def test_tensor_parallel_splits_an_fp8_pool_by_kv_head():
    """2 fake CPU devices (a subprocess): an fp8 pool split by kv head gives tp 1's tokens (greedy, seeded n=2,
    prefix-cached, preempted, beams), its log-probs within 1e-2 of tp 1's (the all-reduce's float32 summation order
    can move a K/V element across an fp8 rounding boundary)."""
    results, _ = run_worker("tiny8_fp8", "1,2", devices=2)
    base, two = results["1"], results["2"]
    for key in ("greedy", "seeded_n2", "greedy_again", "beams", "preempted"):
        assert two[key] == base[key], key
    flat = [x for r in two["greedy_logprobs"] for c in r for x in c]
    want = [x for r in base["greedy_logprobs"] for c in r for x in c]
    assert max(abs(a - b) for a, b in zip(flat, want, strict=True)) < 1e-2
    assert two["inspect"]["pool_dtype"] == "float8_e4m3fn" and "tp" in two["inspect"]["pool_spec"]
    assert two["inspect"]["local_pool"][3] == two["inspect"]["pool_shape"][3] // 2  # half the kv heads each


def test_speculative_decoding_under_tensor_parallelism():
    """2 fake CPU devices (a subprocess): a 1-layer self-draft (every decode step verifies 3 proposals) and n-gram
    speculation give, at tp 2, the tokens of tp 1 and of plain decoding (greedy, seeded n=2, prefix-cached,
    preempted; beams fall back to one token a step), log-probs within 1e-4."""
    results, _ = run_worker("tiny8_spec", "1,2", devices=2)
    base, two = results["1"], results["2"]
    assert_same_generations(results)
    for key in ("greedy", "seeded_n2", "greedy_again", "beams"):
        assert base[key] == base["plain"][key], key
    assert two["ngram_greedy"] == base["ngram_greedy"] == base["plain_ngram_greedy"]
    for got in (base, two):
        assert got["spec"][0] > 0 and got["ngram_spec"][0] > 0, "nothing was proposed: the test would prove nothing"
        assert got["ngram_spec"][1] > 0, "n-gram accepted nothing"
    assert two["spec"] == base["spec"] and two["ngram_spec"] == base["ngram_spec"]


def test_a_split_sampler_under_tensor_parallelism():
    """2 fake CPU devices (a subprocess): with the sampler split from the step (a GPU's way), tp 2 gives tp 1's
    tokens (greedy, seeded n=2, prefix-cached, preempted, beams; log-probs within the tolerance), and tp 1 the fused
    step's (greedy, seeded n=2 and its log-probs, prefix-cached, beams)."""
    results, _ = run_worker("tiny8_split", "1,2", devices=2)
    base = results["1"]
    assert base["split"], "the split was not forced: the test would prove nothing"
    assert_same_generations(results)
    for key in ("greedy", "seeded_n2", "seeded_n2_logprobs", "greedy_again", "beams"):
        assert base[key] == base["fused"][key], key
