"""The Pallas GPU matmul of a stacked weight's layer (pallas_kernels/gpu_matmul.py) against XLA's dot of the sliced
layer: compiled for the GPU where JAX's default backend is one, else in interpret mode; lowered for CUDA without a
GPU (jax.export: Triton's static checks, and the stack passed whole, not sliced); and the engine's use of it
(`jaxpaged.models.quant.gpu_layer_kernel`, on by the step on CUDA without a mesh): the same tokens.

Shapes are small (interpret mode runs every program of the grid in turn) but cover what the kernel masks: K not a
multiple of the K tile, N not a multiple of the N tile, M padded to whole tiles, and K split over programs."""

from __future__ import annotations

import functools
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxpaged.models import matmul, quant
from jaxpaged.worker import step as step_module
from pallas_kernels import gpu_matmul
from tests.hlo_checks import TRITON_CALL_TARGETS

INTERPRET = jax.default_backend() != "gpu"


def stack(rng, dtype, layers=3, k=200, n=100):
    return jnp.asarray(rng.standard_normal((layers, k, n)), dtype)


def xla(x, w, layer):
    precision = jax.lax.Precision.HIGHEST if x.dtype == jnp.float32 else None
    return jnp.dot(x, w[layer], precision=precision, preferred_element_type=jnp.float32)


def check(got, want, dtype):
    # the same float32 products and sums in another order; bf16 inputs are exact in float32
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-4 * float(jnp.abs(want).max()))


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32], ids=["bf16", "f32"])
@pytest.mark.parametrize("m", [1, 7, 64, 300])
def test_kernel_is_x_times_the_layer(dtype, m):
    rng = np.random.default_rng(m)
    w = stack(rng, dtype)
    x = jnp.asarray(rng.standard_normal((m, 200)), dtype)
    got = jax.jit(functools.partial(gpu_matmul.layer_matmul_gpu, interpret=INTERPRET))(x, w, jnp.int32(2))
    assert got.shape == (m, 100) and got.dtype == jnp.float32
    check(got, xla(x, w, 2), dtype)


def test_wide_products_of_many_rows_take_the_large_tiles_and_the_same_numbers():
    """`layer_tiles`: 128 x 128 tiles from 129 rows at N >= WIDE_N (what an H200 timed faster at Llama-3-8B's gate/up),
    `tiles(M)` elsewhere; the product at that default tile equals XLA's."""
    from pallas_kernels.gpu_qmatmul import tiles

    assert gpu_matmul.layer_tiles(256, gpu_matmul.WIDE_N) == (128, 128, 64, 8)
    assert gpu_matmul.layer_tiles(128, 14336) == tiles(128) and gpu_matmul.layer_tiles(256, 4096) == tiles(256)
    rng = np.random.default_rng(3)
    w = jnp.asarray(rng.standard_normal((2, 64, gpu_matmul.WIDE_N)) * 0.05, jnp.bfloat16)
    x = jnp.asarray(rng.standard_normal((130, 64)), jnp.bfloat16)
    got = jax.jit(functools.partial(gpu_matmul.layer_matmul_gpu, interpret=INTERPRET))(x, w, jnp.int32(1))
    check(got, xla(x, w, 1), jnp.bfloat16)


@pytest.mark.parametrize("splits", [2, 3])
def test_k_split_over_programs_sums_to_the_product(splits):
    rng = np.random.default_rng(splits)
    w, x = stack(rng, jnp.float32, k=600), jnp.asarray(rng.standard_normal((5, 600)), jnp.float32)
    got = gpu_matmul.layer_matmul_gpu(x, w, 1, num_splits=splits, tile=(16, 32, 32, 4), interpret=INTERPRET)
    check(got, xla(x, w, 1), jnp.float32)


def test_a_two_dimensional_weight_is_one_layer():
    rng = np.random.default_rng(0)
    w, x = stack(rng, jnp.bfloat16, layers=1), jnp.asarray(rng.standard_normal((4, 200)), jnp.bfloat16)
    check(gpu_matmul.layer_matmul_gpu(x, w[0], interpret=INTERPRET), xla(x, w, 0), jnp.bfloat16)


@pytest.mark.parametrize("change, message", [
    ({"x": jnp.zeros((2, 3, 200))}, "x must be"),
    ({"w": jnp.zeros((3, 199, 100), jnp.bfloat16)}, "K = x's 200"),
    ({"w": jnp.zeros((3, 200, 100), jnp.float32)}, "one dtype"),
    ({"tile": (16, 24, 32, 4)}, "powers of two"),
    ({"num_splits": 0}, "num_splits=0"),
])
def test_bad_arguments_are_clear_errors(change, message):
    args = {"x": jnp.zeros((2, 200), jnp.bfloat16), "w": jnp.zeros((3, 200, 100), jnp.bfloat16)}
    args.update(change)
    with pytest.raises(ValueError, match=message):
        gpu_matmul.layer_matmul_gpu(args.pop("x"), args.pop("w"), 0, interpret=True, **args)


@pytest.mark.parametrize("m", [1, 256])
def test_kernel_lowers_for_cuda_without_a_gpu(m):
    """At Llama-3-8B's down projection [14336 -> 4096] of a 32-layer stack: one Triton launch on the whole stack (a
    bitcast to its flat view, no slice of it)."""
    from jax import export

    sds = jax.ShapeDtypeStruct
    args = (sds((m, 14336), jnp.bfloat16), sds((32, 14336, 4096), jnp.bfloat16), sds((), jnp.int32))
    checks = [export.DisabledSafetyCheck.custom_call(t) for t in TRITON_CALL_TARGETS]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)  # "jax-pallas-triton" from JAX 0.11
        module = export.export(jax.jit(gpu_matmul.layer_matmul_gpu), platforms=["cuda"],
                               disabled_checks=checks)(*args).mlir_module()
    assert sum(module.count(f"@{t}(") for t in TRITON_CALL_TARGETS) == 1
    assert "dynamic_slice" not in module and "tensor<458752x4096xbf16>" in module


# ---- the engine's layer loop ---------------------------------------------------------------------------------------


def _layer_loop(w, rows: int, kernel_rows: int, platform: str) -> str:
    """The models' layer loop (fori_loop over the stack, `layer_matmul`) under `gpu_layer_kernel(kernel_rows)`,
    lowered for `platform`."""
    from jax import export

    def run(x, w):
        with quant.gpu_layer_kernel(kernel_rows):
            def body(i, acc):
                return acc + matmul.layer_matmul(x, w, i)
            return jax.lax.fori_loop(0, w.shape[0], body, jnp.zeros((x.shape[0], w.shape[2]), x.dtype))

    checks = [export.DisabledSafetyCheck.custom_call(t) for t in TRITON_CALL_TARGETS]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        exported = export.export(jax.jit(run), platforms=[platform], disabled_checks=checks)
        return exported(jax.ShapeDtypeStruct((rows, w.shape[1]), w.dtype), w).mlir_module()


def test_the_layer_loop_reads_the_stack_in_place_up_to_the_row_limit():
    """Within the limit each layer's product is the kernel on the whole stack (no dynamic-slice of the weight);
    above it, or with the kernel off, XLA's dot of the sliced layer, as before."""
    w = jax.ShapeDtypeStruct((4, 256, 512), jnp.bfloat16)
    inside = _layer_loop(w, 8, 8, "cuda")
    assert sum(inside.count(f"@{t}(") for t in TRITON_CALL_TARGETS) == 1 and "dynamic_slice" not in inside
    for rows, limit in [(16, 8), (8, 0)]:
        outside = _layer_loop(w, rows, limit, "cuda")
        assert not any(f"@{t}(" in outside for t in TRITON_CALL_TARGETS) and "dynamic_slice" in outside


def test_the_step_turns_the_kernel_on_only_on_a_gpu(monkeypatch):
    assert step_module.gpu_layer_matmul_rows(None) == (step_module.GPU_LAYER_MATMUL_ROWS
                                                         if jax.default_backend() == "gpu" else 0)
    monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
    assert step_module.gpu_layer_matmul_rows(None) == step_module.GPU_LAYER_MATMUL_ROWS
    # a tensor-parallel mesh too: each device's kernel multiplies its shard (quant.on_shards)
    assert step_module.gpu_layer_matmul_rows(object()) == step_module.GPU_LAYER_MATMUL_ROWS


def test_an_engine_whose_steps_run_the_kernel_gives_the_same_tokens(monkeypatch):
    """The engine with the kernel on (as on CUDA; here the interpreter runs it) against the same engine without:
    the same greedy tokens and near log-probs (float32 sums in another order)."""
    from jaxpaged import SamplingParams
    from jaxpaged.worker import model_runner
    from tests.tiny import random_params, random_prompts, tiny_config, tiny_llm

    config = tiny_config()
    params = random_params(config, seed=11)
    prompts = [{"prompt_token_ids": p} for p in random_prompts(3, 4, 12, seed=2)]
    greedy = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True, logprobs=1)

    def run():
        outs = tiny_llm(config, params, attention_backend="reference").generate(prompts, greedy, use_tqdm=False)
        return [o.outputs[0] for o in outs]

    plain = run()
    calls, kernel_fn = [], gpu_matmul.layer_matmul_gpu

    def interpreted(*args, **kwargs):
        calls.append(args[0].shape)
        return kernel_fn(*args, interpret=True, **kwargs)

    monkeypatch.setattr(model_runner, "gpu_layer_matmul_rows", lambda mesh: 64)
    monkeypatch.setattr(gpu_matmul, "layer_matmul_gpu", interpreted)
    kernel = run()
    assert calls  # the steps were traced with the kernel
    for a, b in zip(plain, kernel, strict=True):
        assert a.token_ids == b.token_ids
        np.testing.assert_allclose([lp[t].logprob for lp, t in zip(a.logprobs, a.token_ids, strict=True)],
                                   [lp[t].logprob for lp, t in zip(b.logprobs, b.token_ids, strict=True)], atol=1e-4)


# ---- benchmarks/gpu_layer_matmul.py: what it times computes the same products; without a GPU it times nothing ----

def test_the_benchmarks_ways_compute_the_same_products(monkeypatch):
    """Each way the benchmark times (XLA on weights of their own, XLA on the sliced stack, the kernel at its tiles and
    at another, the int8 kernels, XLA's int8 GEMMs on signed weights of their own) gives XLA's product, here in the
    interpreter: a benchmark of wrong products would pick tiles for nothing."""
    from tests import ROOT

    monkeypatch.syspath_prepend(str(ROOT / "benchmarks"))
    import gpu_layer_matmul as bench

    from pallas_kernels import gpu_qmatmul, gpu_w8a8

    monkeypatch.setattr(bench, "layer_matmul_gpu", functools.partial(gpu_matmul.layer_matmul_gpu, interpret=INTERPRET))
    monkeypatch.setattr(bench, "qmatmul_gpu", functools.partial(gpu_qmatmul.qmatmul_gpu, interpret=INTERPRET))
    monkeypatch.setattr(bench, "w8a8_matmul_gpu", functools.partial(gpu_w8a8.w8a8_matmul_gpu, interpret=INTERPRET))
    w = stack(np.random.default_rng(3), jnp.bfloat16, layers=3, k=64, n=96) * 0.05
    own = [w[i] + 0 for i in range(3)]
    x = jnp.asarray(np.random.default_rng(4).standard_normal((16, 64)), jnp.bfloat16)
    fns = bench.ways([(16, 32, 32, 4)], int8=True)
    assert set(fns) == {"XLA own", "XLA sliced", "kernel", "kernel 16,32,32,4", "int8 kernel", "int8 w8a8 kernel",
                        "int8 w8a8 kernel 16,32,4", "int8 XLA own", "int8 XLA w8a8 own"}
    want = np.asarray(sum(jnp.dot(x, w[i], preferred_element_type=jnp.float32) for i in range(3)))
    q8 = quant.quantize_int8(w)
    own8 = bench.signed_layers(q8, 64)
    for way, fn in fns.items():
        got = np.asarray(fn(x, own8 if way.startswith("int8 XLA") else q8 if way.startswith("int8") else w, own))
        tol = 2e-2 if way.startswith("int8") else 1e-5
        np.testing.assert_allclose(got, want, atol=tol * np.abs(want).max(), err_msg=way)


def test_the_layer_matmul_benchmark_says_it_needs_a_gpu_and_exits_0():
    import os
    import subprocess
    import sys

    from tests import ROOT

    if jax.default_backend() == "gpu":
        pytest.skip("on a GPU the benchmark times its products (benchmarks/device_checks.sh runs it)")
    result = subprocess.run([sys.executable, "benchmarks/gpu_layer_matmul.py"], cwd=ROOT, capture_output=True,
                            text=True, timeout=120, env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert result.returncode == 0 and "needs a GPU" in result.stdout and "nothing timed" in result.stdout
