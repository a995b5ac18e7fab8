"""The W8A8 GPU kernel (pallas_kernels/gpu_w8a8.py, a way of benchmarks/gpu_layer_matmul.py; the engine does not
run it): int8 weights per channel times activations quantized to int8 per block of 32, as the native CPU kernel
quantizes them. Its activations are the CPU kernel's, bit for bit (float32 inputs and bf16 ones, whose quotients fall
near a rounding tie far more often); its product is the float64 product of the activations it was given, up to
float32 rounding, at ragged shapes, K splits and another tile (so a GPU's failure says whether the activations or
the kernel's sum went wrong); compiled for the GPU where JAX's default backend is one, else in Pallas' interpreter;
lowered for CUDA without a GPU (Triton's static rules, the stack passed whole)."""

from __future__ import annotations

import functools
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxpaged.models import quant
from pallas_kernels import gpu_w8a8
from pallas_kernels.cpu_native.quantized import quantize_activations
from tests.hlo_checks import TRITON_CALL_TARGETS

INTERPRET = jax.default_backend() != "gpu"


def weight(k: int, n: int, layers: int = 3, seed: int = 0) -> quant.QuantizedWeight:
    w = np.random.default_rng(seed).standard_normal((layers, k, n)).astype(np.float32) * 0.05
    return quant.quantize_int8(jnp.asarray(w))


def reference(x: jax.Array, qw: quant.QuantizedWeight, layer: int) -> np.ndarray:
    """The product in float64 of the kernel's quantized activations (`quantize_blocks`' q * d per block, on the
    backend that runs the kernel) and the int8 weight."""
    q, d = (np.asarray(a) for a in gpu_w8a8.quantize_blocks(x))
    m, kp = q.shape
    xq = (q.reshape(m, kp // 32, 32).astype(np.float64) * d[..., None]).reshape(m, kp)
    w = (np.asarray(qw.codes[layer], np.float64) - 128) * np.asarray(qw.scales[layer], np.float64)[:, None]  # [N, Kp]
    return xq @ w.T


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=["f32", "bf16"])
def test_the_activations_are_the_native_cpu_kernels(dtype):
    """q and d bit for bit, an all-zero block (d = 0, q = 0) and K not a multiple of 32 included; bf16 inputs put
    many quotients x / d near a tie of the rounding, where an inexact reciprocal would change q."""
    x = np.array(jnp.asarray(np.random.default_rng(1).standard_normal((64, 1000)) * 3, dtype), np.float32)
    x[1, 32:64] = 0
    q, d = quantize_activations(x)
    got_q, got_d = jax.jit(gpu_w8a8.quantize_blocks)(jnp.asarray(x, dtype))
    np.testing.assert_array_equal(np.asarray(got_q), q)
    np.testing.assert_array_equal(np.asarray(got_d), d)
    assert got_q.dtype == jnp.int8 and got_q.shape == (64, 1024) and d[1, 1] == 0


def test_div127_is_the_correctly_rounded_quotient():
    """Every float32 of [1, 2) (the quotient's rounding repeats in each binade) and random ones over 60 binades, zero
    included: C++'s a / 127.0f, which XLA's own division by a constant (a product with 1/127) misses for 4% of them."""
    a = np.concatenate([np.arange(0x3F800000, 0x40000000, dtype=np.uint32).view(np.float32),
                        np.random.default_rng(0).uniform(0, 1, 1 << 20).astype(np.float32) ** 8 * 1e12,
                        np.zeros(3, np.float32)])
    got = np.asarray(jax.jit(gpu_w8a8.div127)(jnp.asarray(a)))
    np.testing.assert_array_equal(got, a / np.float32(127.0))
    assert (np.asarray(jax.jit(lambda v: v / 127.0)(jnp.asarray(a))) != got).mean() > 0.01  # what it is for


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32], ids=["bf16", "f32"])
@pytest.mark.parametrize("k, n, m", [(96, 48, 1), (570, 200, 9), (64, 300, 40)])
def test_the_product_is_the_quantized_activations_times_the_layer(k, n, m, dtype):
    """Against the float64 product of the same int8 values: float32 rounding of each block's exact int32 sum times
    its scale, and of the running sum. Other layers' scales are NaN: only the layer asked for is read."""
    qw = weight(k, n, seed=k + m)
    qw = quant.QuantizedWeight(qw.codes, qw.scales.at[0].set(jnp.nan).at[2].set(jnp.nan), qw.bits, qw.scale_mode,
                               qw.shape, qw.table, compute_dtype=qw.compute_dtype, sources=qw.sources)
    x = jnp.asarray(np.random.default_rng(m).standard_normal((m, k)), dtype)
    got = np.asarray(jax.jit(functools.partial(gpu_w8a8.w8a8_matmul_gpu, interpret=INTERPRET))(
        x, qw.codes, qw.scales, jnp.int32(1)))
    want = reference(x, qw, 1)
    assert got.shape == (m, n) and np.isfinite(got).all()
    np.testing.assert_allclose(got, want, rtol=0, atol=4e-7 * np.abs(want).max() * np.sqrt(k / 32))


def test_k_splits_and_another_tile_give_the_same_product():
    qw = weight(1024, 96, seed=7)
    x = jnp.asarray(np.random.default_rng(8).standard_normal((24, 1024)), jnp.bfloat16)
    want = reference(x, qw, 2)
    for kwargs in ({"num_splits": 4}, {"tile": (32, 64, 4)}, {"num_splits": 3, "tile": (16, 16, 4)}):
        got = np.asarray(gpu_w8a8.w8a8_matmul_gpu(x, qw.codes, qw.scales, 2, interpret=INTERPRET, **kwargs))
        np.testing.assert_allclose(got, want, rtol=0, atol=2e-6 * np.abs(want).max(), err_msg=str(kwargs))


@pytest.mark.parametrize("change, message", [
    ({"x": np.zeros((2, 3, 96))}, r"x must be \[M, K\]"),
    ({"codes": "int8"}, "codes must be uint8"),
    ({"x": np.zeros((2, 40))}, "x has K=40 columns but codes hold Kp=96"),
    ({"scales": np.ones((3, 48, 3), np.float32)}, r"scales must be \[3, 48\]"),
    ({"tile": (8, 64, 4)}, "tm and tn must be powers of two >= 16"),
    ({"num_splits": 0}, "num_splits=0 must be >= 1"),
])
def test_bad_arguments_are_refused_naming_them(change, message):
    qw = weight(96, 48)
    args = {"x": jnp.zeros((2, 96), jnp.bfloat16), "codes": qw.codes, "scales": qw.scales}
    for key, value in change.items():
        args[key] = qw.codes.astype(jnp.int8) if isinstance(value, str) else value
    kwargs = {k: v for k, v in args.items() if k in ("tile", "num_splits")}
    with pytest.raises(ValueError, match=message):
        gpu_w8a8.w8a8_matmul_gpu(jnp.asarray(args["x"]), args["codes"], args["scales"], 0, interpret=True, **kwargs)


@pytest.mark.parametrize("m", [1, 64, 256])
def test_it_lowers_for_cuda_with_the_stack_whole(m):
    """jax.export for CUDA runs the Pallas -> Triton lowering (its static rules: dots of at least 16 in each
    dimension, power-of-two blocks): one Triton call that takes the stacked codes, not a slice of them."""
    from jax import export

    qw = weight(4096, 1024, layers=4)
    checks = [export.DisabledSafetyCheck.custom_call(t) for t in TRITON_CALL_TARGETS]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        exported = export.export(jax.jit(gpu_w8a8.w8a8_matmul_gpu), platforms=["cuda"], disabled_checks=checks)(
            jax.ShapeDtypeStruct((m, 4096), jnp.bfloat16), qw.codes, qw.scales, jnp.int32(2))
    module = exported.mlir_module()
    assert sum(module.count(f"@{t}(") for t in TRITON_CALL_TARGETS) == 1
    assert "tensor<4096x4096xui8>" in module and "dynamic_slice" not in module
