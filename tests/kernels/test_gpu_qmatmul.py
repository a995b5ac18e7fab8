"""The Pallas GPU quantized matmul (pallas_kernels/gpu_qmatmul.py) against the weights that
`jaxpaged.models.quant.dequantize` gives: compiled for the GPU where JAX's default backend is one, else in interpret
mode; and lowered for CUDA without a GPU (jax.export), which runs Triton's static checks. Whether XLA then compiles
it for an H100 / H200, and what the engine's layer loop becomes with it, is tests/kernels/test_quant_fusion.py
(deviceless, in a venv with the CUDA plugin).

Shapes are small (interpret mode runs every program of the grid in turn) but cover what the kernel masks: K not a
multiple of the K tile (96, 570), N not a multiple of the N tile (200), M padded to whole tiles (1, 7, 64, 300),
and the layer of a stacked weight read in place.
"""

from __future__ import annotations

import functools
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxpaged.models import quant
from pallas_kernels import gpu_qmatmul
from tests.hlo_checks import TRITON_CALL_TARGETS
from tests.quant_weights import (
    BLOCK_FORMATS,
    FORMS,
    LAYER,
    check_engine_branch,
    check_layer_product,
    kernel_args,
    layered_weight,
    random_weight,
)

INTERPRET = jax.default_backend() != "gpu"



@functools.cache
def run(bits: int, pair: bool, tile=None, num_splits=None, scale_load="broadcast", channel=False):
    return jax.jit(functools.partial(gpu_qmatmul.qmatmul_gpu, bits=bits, pair=pair, tile=tile, num_splits=num_splits,
                                     scale_load=scale_load, interpret=INTERPRET, channel=channel))


@pytest.mark.parametrize("m", [1, 7, 64, 300])
@pytest.mark.parametrize("fmt", BLOCK_FORMATS)
def test_kernel_is_x_times_the_dequantized_layer(fmt, m):
    """K = 96: three blocks, one step of 128 k whose last 32 are masked; N = 200: a partial N tile; M padded to
    whole tiles of 16 to 128 rows. Every block format, including the 8-bit (s, m) ones of re-quantized types."""
    qw = layered_weight(fmt, 96, 200, seed=m)
    x = jnp.asarray(np.random.default_rng(m + 1).standard_normal((m, qw.k)), jnp.bfloat16)
    check_layer_product(qw, x, run(**kernel_args(qw))(x, qw.codes, qw.scales, LAYER))


@pytest.mark.parametrize("scale_load", ["broadcast", "gather"])
@pytest.mark.parametrize("fmt", ["q8_0", "q4_1"])
def test_a_ragged_k_over_several_k_steps(fmt, scale_load):
    """K = 570 (18 blocks, the codes padded to 576; x's last 6 columns do not exist): five steps of 128 k, the last
    partly past the codes. f32 x is multiplied in IEEE float32. Both ways of loading the block scales."""
    qw = layered_weight(fmt, 570, 200, seed=3)
    rng = np.random.default_rng(4)
    for dtype in (jnp.bfloat16, jnp.float32):
        x = jnp.asarray(rng.standard_normal((9, qw.k)), dtype)
        check_layer_product(qw, x, run(**kernel_args(qw), scale_load=scale_load)(x, qw.codes, qw.scales, LAYER))


@pytest.mark.parametrize("fmt", ["q8_0", "q4_0", "q4_k"])
def test_gathered_scales_give_the_same_numbers(fmt):
    qw = layered_weight(fmt, 96, 200, seed=16)
    x = jnp.asarray(np.random.default_rng(17).standard_normal((7, qw.k)), jnp.bfloat16)
    got = run(**kernel_args(qw), scale_load="gather")(x, qw.codes, qw.scales, LAYER)
    check_layer_product(qw, x, got)
    np.testing.assert_array_equal(np.asarray(got), np.asarray(run(**kernel_args(qw))(x, qw.codes, qw.scales, LAYER)))


@pytest.mark.parametrize("splits", [2, 3, 8])
def test_k_split_over_programs_sums_to_the_product(splits):
    """Split K: K = 570 is 5 steps of 128; 2 and 3 splits share them unevenly, 8 leave splits with none (zeros)."""
    qw = layered_weight("q4_k", 570, 200, seed=14)
    x = jnp.asarray(np.random.default_rng(15).standard_normal((3, qw.k)), jnp.bfloat16)
    check_layer_product(qw, x, run(**kernel_args(qw), num_splits=splits)(x, qw.codes, qw.scales, LAYER))


def test_default_splits_fill_the_device_only_for_small_grids():
    """Llama-3-8B's down projection [14336 -> 4096] in Q4_K (float32 s, m per block) at one row: 64 programs split
    8 ways; with 64 rows the partials' bytes cap it at 4; prefill-sized grids and short K are not split."""
    weight = 4096 * (14336 // 2 + 14336 // 32 * 8)
    assert gpu_qmatmul.default_splits(64, 112, 16 * 4096 * 4, weight) == 8
    assert gpu_qmatmul.default_splits(64, 112, 64 * 4096 * 4, weight) == 4
    assert gpu_qmatmul.default_splits(512, 224, 2048 * 4096 * 4, weight) == 1
    assert gpu_qmatmul.default_splits(24, 5, 16 * 1536 * 4, 1536 * 288) == 1  # SmolLM2: 5 steps of K
    assert gpu_qmatmul.default_splits(2, 10_000, 1, 10**9) == gpu_qmatmul.MAX_SPLITS


@pytest.mark.parametrize("tile", [(16, 16, 32, 4), (32, 128, 256, 4)], ids=["smallest", "wide"])
def test_other_tiles_give_the_same_product(tile):
    """The tile is a free choice: the smallest legal one (one block a step, many programs) and a wide one."""
    qw = layered_weight("q4_k", 96, 200, seed=5)
    x = jnp.asarray(np.random.default_rng(6).standard_normal((20, qw.k)), jnp.bfloat16)
    check_layer_product(qw, x, run(**kernel_args(qw), tile=tile)(x, qw.codes, qw.scales, LAYER))


def test_an_unstacked_weight_and_the_reference():
    """2-D codes [N, ...] are one layer; `qmatmul_reference` is the same contract in jnp."""
    qw = layered_weight("q4_0", 64, 48, seed=7)
    x = jnp.asarray(np.random.default_rng(8).standard_normal((3, qw.k)), jnp.bfloat16)
    got = run(4, False)(x, qw.codes[LAYER], qw.scales[LAYER], 0)
    check_layer_product(qw, x, got)
    ref = gpu_qmatmul.qmatmul_reference(x, qw.codes, qw.scales, LAYER, bits=4, pair=False)
    np.testing.assert_allclose(np.asarray(got), np.asarray(ref), rtol=1e-5, atol=1e-5)


def test_the_layer_is_read_in_place():
    """Reading layer 0 (NaN scales) gives NaN everywhere: the layer operand, not a slice, picks the rows."""
    qw = layered_weight("q8_0", 64, 48, seed=9)
    x = jnp.ones((2, qw.k), jnp.bfloat16)
    assert np.isnan(np.asarray(run(8, False)(x, qw.codes, qw.scales, 0))).all()


@pytest.mark.parametrize("change, message", [
    (dict(bits=5), "bits=5 is not supported"),
    (dict(pair=True), r"scales must be \[3, 48, 2, 2\] for pair=True"),
    (dict(x_cols=100), "x has K=100 columns but codes hold 2 blocks"),
    (dict(tile=(16, 48, 64, 4)), "must be powers of two"),
    (dict(tile=(8, 64, 64, 4)), "tm and tn >= 16"),
    (dict(num_splits=0), "num_splits=0 must be >= 1"),
    (dict(scale_load="shared"), "scale_load='shared' is not supported"),
])
def test_bad_arguments_are_clear_errors(change, message):
    qw = layered_weight("q8_0", 64, 48, seed=10)
    x = jnp.ones((2, change.pop("x_cols", qw.k)), jnp.bfloat16)
    kwargs = dict(bits=8, pair=False) | change
    with pytest.raises(ValueError, match=message):
        gpu_qmatmul.qmatmul_gpu(x, qw.codes, qw.scales, 0, interpret=True, **kwargs)


def test_tiles_are_powers_of_two_and_dot_sized():
    for m in (1, 7, 16, 17, 64, 65, 256, 257, 2048):
        tm, tn, tk, warps = gpu_qmatmul.tiles(m)
        assert all(v & (v - 1) == 0 for v in (tm, tn, tk)) and min(tm, tn, tk // 2) >= 16 and tk % 32 == 0
        assert tm <= max(16, 2 * m) and warps in (4, 8)


@pytest.mark.parametrize("fmt", ["q8_0", "q4_0", "q4_1", "q4_k"])
@pytest.mark.parametrize("m", [1, 64, 2048])
def test_kernel_lowers_for_cuda_without_a_gpu(fmt, m):
    """jax.export(platforms=['cuda']) runs the Pallas -> Triton lowering (Triton's static rules: power-of-two
    blocks), at Llama-3-8B's down projection [14336 -> 4096] of a 32-layer stack: one launch, the stacked codes
    passed whole (a bitcast, no slice), no XLA loop around it."""
    from jax import export

    bits, mode = FORMS[fmt]
    pair = mode != quant.BLOCK_SYM
    k, n, layers = 14336, 4096, 32
    sds = jax.ShapeDtypeStruct
    scales = sds((layers, n, k // 32, 2) if pair else (layers, n, k // 32),
                 jnp.float32 if mode == quant.BLOCK_F32 else jnp.float16)
    args = (sds((m, k), jnp.bfloat16), sds((layers, n, k * bits // 8), jnp.uint8), scales, sds((), jnp.int32))
    fn = jax.jit(functools.partial(gpu_qmatmul.qmatmul_gpu, bits=bits, pair=pair))
    checks = [export.DisabledSafetyCheck.custom_call(t) for t in TRITON_CALL_TARGETS]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)  # "jax-pallas-triton" from JAX 0.11
        module = export.export(fn, platforms=["cuda"], disabled_checks=checks)(*args).mlir_module()
    assert sum(module.count(f"@{t}(") for t in TRITON_CALL_TARGETS) == 1
    assert "stablehlo.while" not in module and "dynamic_slice" not in module


# ---- the engine's plain-layout matmul on CUDA (jaxpaged.models.quant._plain_matmul) ------------------------------


@pytest.mark.parametrize("fmt", BLOCK_FORMATS)
def test_the_engine_passes_the_stack_layer_and_format_to_the_kernel(monkeypatch, fmt):
    """quant's CUDA branch (`_kernel_matmul`), the kernel run by the interpreter: the same product as the
    dequantize-then-dot branch every other platform runs, from the stacked arrays and the layer."""
    monkeypatch.setattr(gpu_qmatmul, "qmatmul_gpu", functools.partial(gpu_qmatmul.qmatmul_gpu, interpret=INTERPRET))
    check_engine_branch(quant._kernel_matmul, fmt)


def _layer_loop_module(qw: quant.QuantizedWeight, platform: str, rows: int = 8, kernel_rows: int = 0,
                       partitioned: bool = False) -> str:
    """The models' layer loop (fori_loop over the stack, `layer_matmul` with no split named) lowered for `platform`,
    inside `quant.gpu_layer_kernel(kernel_rows)` and, if `partitioned`, `quant.partitioned_products` of a mesh."""
    mesh = jax.sharding.Mesh(np.asarray(jax.devices()[:1]), ("tp",)) if partitioned else None
    from jax import export

    from jaxpaged.models.matmul import layer_matmul

    def run(x):
        def body(i, acc):
            return acc + layer_matmul(x, qw, i)
        with quant.gpu_layer_kernel(kernel_rows), quant.partitioned_products(mesh):
            return jax.lax.fori_loop(0, qw.shape[0], body, jnp.zeros((x.shape[0], qw.n), x.dtype))

    checks = [export.DisabledSafetyCheck.custom_call(t) for t in TRITON_CALL_TARGETS]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        exported = export.export(jax.jit(run), platforms=[platform], disabled_checks=checks)
        return exported(jax.ShapeDtypeStruct((rows, qw.k), jnp.bfloat16)).mlir_module()


@pytest.mark.parametrize("fmt", BLOCK_FORMATS)
def test_on_cuda_the_layer_loop_calls_the_kernel_on_the_whole_stack(fmt):
    """Lowered for CUDA, each layer's product is the Triton kernel reading the stacked codes [L, N, ...] (no
    dynamic-slice of them, no [N, K] float weight); lowered for TPU and CPU nothing changes (no Triton call)."""
    qw = jax.tree.map(jnp.asarray, random_weight(np.random.default_rng(13), fmt, 4, 256, 512))
    bits = qw.bits
    cuda = _layer_loop_module(qw, "cuda")
    assert sum(cuda.count(f"@{t}(") for t in TRITON_CALL_TARGETS) == 1
    assert f"tensor<4x512x{256 * bits // 8}xui8>" in cuda and f"tensor<2048x{256 * bits // 8}xui8>" in cuda
    assert "dynamic_slice" not in cuda and "tensor<512x256xbf16>" not in cuda and "tensor<512x256xf32>" not in cuda
    for platform in ("tpu", "cpu"):
        other = _layer_loop_module(qw, platform)
        assert not any(f"@{t}(" in other for t in TRITON_CALL_TARGETS) and "dynamic_slice" in other


@pytest.mark.skipif(not INTERPRET, reason="on a GPU the benchmark times for minutes")
def test_the_benchmark_says_it_needs_a_gpu_and_exits_0():
    import os
    import subprocess
    import sys

    from tests import ROOT

    result = subprocess.run([sys.executable, "benchmarks/gpu_qmatmul.py"], cwd=ROOT, capture_output=True, text=True,
                            timeout=120, env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert result.returncode == 0 and "needs a GPU" in result.stdout and "nothing timed" in result.stdout


# ---- int8 per channel (`channel=True`): quant's CUDA branch in the steps that read a stack in place ---------------


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32], ids=["bf16", "f32"])
@pytest.mark.parametrize("k, m", [(96, 1), (570, 9), (64, 300)])
def test_int8_per_channel_is_x_times_the_layer_scaled_per_column(k, m, dtype):
    """x @ (u - 128) with each column's sum times its scale: the float32 weights' product up to float32 sums (the
    codes are exact in bf16), and `_signed_channel_matmul`'s (the CUDA branch it replaces) up to their order, that
    one's float32 dot at full precision (on an H200 its default TF32 missed by up to 1e-2). Other layers' scales are
    NaN: only LAYER is read."""
    qw = layered_weight("int8", k, 200, seed=k + m)
    x = jnp.asarray(np.random.default_rng(m).standard_normal((m, qw.k)), dtype)
    got = np.asarray(run(8, False, channel=True)(x, qw.codes, qw.scales, LAYER))
    w32 = np.asarray(quant.dequantize(qw, np.float32, LAYER), np.float64)
    xs = np.asarray(x, np.float64)
    scale = np.abs(xs) @ np.abs(w32) + 1e-30
    np.testing.assert_array_less(np.abs(got - xs @ w32), 8 * np.finfo(np.float32).eps * np.sqrt(qw.k) * scale)
    with jax.default_matmul_precision("highest"):  # as the kernel's float32 dots (XLA GPU's default is TF32)
        xla = np.asarray(quant._signed_channel_matmul(x, qw.codes[LAYER], qw.scales[LAYER]))
    np.testing.assert_array_less(np.abs(got - xla), 8 * np.finfo(np.float32).eps * np.sqrt(qw.k) * scale)


@pytest.mark.parametrize("change, message", [({"bits": 4}, "channel=True is int8"),
                                             ({"scales": "blocks"}, r"scales must be \[3, 48\]")])
def test_int8_per_channel_bad_arguments(change, message):
    qw = random_weight(np.random.default_rng(0), "int8", 3, 96, 48)
    scales = np.ones((3, 48, 3), np.float32) if change.get("scales") == "blocks" else qw.scales
    bits = change.get("bits", 8)
    codes = qw.codes[..., :48] if bits == 4 else qw.codes
    with pytest.raises(ValueError, match=message):
        gpu_qmatmul.qmatmul_gpu(jnp.zeros((2, 96), jnp.bfloat16), codes, scales, 0, bits=bits, pair=False,
                                channel=True, interpret=True)


def test_on_cuda_int8_reads_the_stack_in_place_within_the_row_limit():
    """Lowered for CUDA inside `gpu_layer_kernel(rows)` the layer loop's int8 product is the Triton kernel on the
    stacked codes (no dynamic-slice); outside it, or above its rows, XLA's int8 GEMM of the sliced codes."""
    qw = jax.tree.map(jnp.asarray, random_weight(np.random.default_rng(5), "int8", 4, 256, 512))
    inside = _layer_loop_module(qw, "cuda", rows=8, kernel_rows=8)
    assert sum(inside.count(f"@{t}(") for t in TRITON_CALL_TARGETS) == 1 and "dynamic_slice" not in inside
    for rows, limit in [(16, 8), (8, 0)]:
        outside = _layer_loop_module(qw, "cuda", rows=rows, kernel_rows=limit)
        assert not any(f"@{t}(" in outside for t in TRITON_CALL_TARGETS) and "dynamic_slice" in outside


def test_an_int8_engine_on_the_cuda_path_gives_the_xla_paths_tokens(monkeypatch):
    """quantization="int8" with the steps' products on quant's CUDA branch (this kernel with column scales in the
    decode-sized steps, interpreted here; XLA's int8 GEMM in the others) against the same engine on XLA's
    dequantize-then-dot branch: the same greedy tokens, log-probs within float32 summation order's reach."""
    from jaxpaged import SamplingParams
    from jaxpaged.engine import quant_setup
    from jaxpaged.worker import model_runner
    from tests.tiny import random_params, random_prompts, tiny_config, tiny_llm

    config = tiny_config(hidden=64, heads=4, kv_heads=2, head_dim=16, layers=2)
    params = random_params(config, seed=3)
    prompts = [{"prompt_token_ids": p} for p in random_prompts(3, 4, 12, seed=5)]
    greedy = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True, logprobs=1)

    def run_engine():
        llm = tiny_llm(config, params, attention_backend="reference", quantization="int8")
        return [o.outputs[0] for o in llm.generate(prompts, greedy, use_tqdm=False)]

    monkeypatch.setattr(quant_setup, "native_quantized", lambda: False)  # the plain layout, as on a GPU
    xla = run_engine()
    calls, kernel_fn = [], gpu_qmatmul.qmatmul_gpu

    def interpreted(*args, **kwargs):
        calls.append(args[0].shape)
        assert kwargs["channel"]
        return kernel_fn(*args, interpret=True, **kwargs)

    monkeypatch.setattr(model_runner, "gpu_layer_matmul_rows", lambda mesh: 64)
    monkeypatch.setattr(gpu_qmatmul, "qmatmul_gpu", interpreted)
    monkeypatch.setattr(jax.lax, "platform_dependent",  # every platform-dependent branch as on CUDA
                        lambda *args, default, **branches: branches.get("cuda", default)(*args))
    cuda = run_engine()
    assert calls, "the steps were not traced with the kernel"
    for a, b in zip(xla, cuda, strict=True):
        assert a.token_ids == b.token_ids
        np.testing.assert_allclose([lp[t].logprob for lp, t in zip(a.logprobs, a.token_ids, strict=True)],
                                   [lp[t].logprob for lp, t in zip(b.logprobs, b.token_ids, strict=True)], atol=2e-3)


@pytest.mark.parametrize("fmt", ["int8", "q8_0", "q4_k"])
def test_under_tensor_parallelism_the_products_are_xla_dots(fmt):
    """Inside `quant.partitioned_products` (a step traced for a tensor-parallel mesh) a product whose split is not
    named lowers to no Pallas kernel's custom call, which GSPMD would run on whole weights gathered to every device:
    for CUDA (int8 within the W8A8 kernel's row limit too) and TPU, only XLA's dot; outside it the same loop calls
    the kernels. (Named splits run the kernels on each device's shard: tests/parallel/test_tensor_parallel.py.)"""
    qw = jax.tree.map(jnp.asarray, random_weight(np.random.default_rng(7), fmt, 4, 256, 512))
    for platform in ("cuda", "tpu"):
        module = _layer_loop_module(qw, platform, kernel_rows=8, partitioned=True)
        assert not any(f"@{t}(" in module for t in TRITON_CALL_TARGETS) and "tpu_custom_call" not in module, platform
        assert "stablehlo.dot_general" in module, platform
    kernels = _layer_loop_module(qw, "cuda", kernel_rows=8)
    assert sum(kernels.count(f"@{t}(") for t in TRITON_CALL_TARGETS) == 1
    if fmt == "q8_0":  # on TPU, Q8_0 is the Mosaic kernel's at every row count
        assert "tpu_custom_call" in _layer_loop_module(qw, "tpu")
