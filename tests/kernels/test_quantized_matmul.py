"""The native matmul by quantized weights (pallas_kernels/cpu_native/qmatmul.cc) against numpy: every format (int8
per channel, Q8_0, Q4_0, Q4_1, Q4_K's float32 scales, 8-bit codes with a float16 or float32 min), odd sizes, 1 to
130 rows, stacked layers, live rows, both ways to multiply (int8 activations with VPDPBUSD, or on a CPU with AMX-INT8
TDPBSUD for blocks of 16 rows; bf16 dequantized in registers), the fused gated MLP, its plain-loop build (no
AVX-512), and its errors. The weights are random codes and
scales; the reference dequantizes them in numpy (`quant.dequantize`) and multiplies in float64."""

from __future__ import annotations

import ctypes
import functools
import shutil
import subprocess

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxpaged.models import quant
from jaxpaged.models.matmul import ACTIVATIONS
from pallas_kernels.cpu_native import native
from pallas_kernels.cpu_native.quantized import (
    qmatmul3_native,
    qmatmul_glu_native,
    qmatmul_has_bf16_dot,
    qmatmul_is_fast,
    qmatmul_native,
    qmatmul_uses_amx,
    quantize_activations,
    reference_int8,
)
from tests import ROOT
from tests.quant_weights import FORMS, f64, random_weight

pytestmark = pytest.mark.skipif(not native.available("qmatmul"), reason="no native quantized matmul here")

# M, K, N: one row; K not a multiple of 32; N not a multiple of 16 or 64; rows past the 8-row register block and the
# 128-row work chunk
SHAPES = [(1, 64, 64), (3, 50, 70), (13, 576, 192), (64, 96, 33), (130, 160, 129)]


def panels(qw):
    return jax.tree.map(jnp.asarray, quant.to_panels(qw))


@pytest.mark.parametrize("fmt", list(FORMS))
def test_panel_layout_holds_the_same_weights(fmt):
    qw = random_weight(np.random.default_rng(1), fmt, 2, 50, 70)
    p = quant.to_panels(qw)
    assert p.codes.shape[-3] % 4 == 0 and p.codes.shape[-3] * 16 >= 70  # groups of 16 columns, a multiple of 4
    for layer in (0, 1):
        np.testing.assert_array_equal(np.asarray(quant.dequantize(p, np.float32, layer)),
                                      np.asarray(quant.dequantize(qw, np.float32, layer)))


@pytest.mark.parametrize("fmt", list(FORMS))
@pytest.mark.parametrize("m, k, n", SHAPES)
def test_int8_way_is_the_product_of_the_quantized_activations(fmt, m, k, n):
    """mode "int8": x quantized per 32 (the kernel's rule, `quantize_activations`) times the dequantized weight,
    up to float32 summation order; x bf16 or float32, out bf16 or float32."""
    rng = np.random.default_rng(m * 7 + k)
    qw = random_weight(rng, fmt, 3, k, n)
    p = panels(qw)
    x32 = rng.standard_normal((m, k)).astype(np.float32)
    for x in (jnp.asarray(x32, jnp.bfloat16), jnp.asarray(x32)):
        for layer in (0, 2):
            w = np.asarray(quant.dequantize(qw, np.float32, layer))  # [K, N]
            want = reference_int8(np.asarray(x, np.float32), w)
            bound = 1e-5 * (np.abs(np.asarray(x, np.float64)) @ np.abs(f64(w))) + 1e-6
            got = np.asarray(quant.qmatmul(x, p, layer, jnp.float32, mode="int8"))
            assert got.shape == (m, n)
            assert np.all(np.abs(got - want) <= bound), (layer, np.max(np.abs(got - want) - bound))
            out = quant.qmatmul(x, p, layer, mode="int8")  # in x's dtype: the float32 result rounded
            assert out.dtype == x.dtype
            np.testing.assert_allclose(np.asarray(out, np.float32), got.astype(x.dtype).astype(np.float32),
                                       rtol=2 ** -7, atol=1e-6)


def test_int8_activations_lose_at_most_half_a_step_per_block():
    """The error of the int8 way against the exact product is the activations' rounding: |x - q d| <= d / 2 per
    element, d = max|x| / 127 of its block of 32."""
    rng = np.random.default_rng(3)
    x = rng.standard_normal((5, 576)).astype(np.float32)
    q, d = quantize_activations(x)
    err = np.abs(x - (q.astype(np.float32).reshape(5, -1, 32) * d[..., None]).reshape(5, -1))
    assert np.all(err <= np.repeat(d, 32, axis=1) / 2 * (1 + 1e-6))
    assert np.all(np.abs(q) <= 127)


@pytest.mark.skipif(not qmatmul_has_bf16_dot(), reason="no AVX512_BF16 here")
@pytest.mark.parametrize("fmt", list(FORMS))
@pytest.mark.parametrize("m, k, n", SHAPES)
def test_bf16_way_is_the_bf16_weight_times_x(fmt, m, k, n):
    """mode "bf16": the weight dequantized in float32 and rounded to bfloat16 (what a model dequantized at load in
    bfloat16 holds), times bf16 x, float32 accumulation; XLA's dequantize-and-dot of the plain layout gives the same."""
    rng = np.random.default_rng(m + k * 3)
    qw = random_weight(rng, fmt, 2, k, n)
    x = jnp.asarray(rng.standard_normal((m, k)), jnp.bfloat16)
    w = f64(jnp.asarray(quant.dequantize(qw, np.float32, 1), jnp.bfloat16))
    want = f64(x) @ w
    bound = 4 * np.finfo(np.float32).eps * np.sqrt(k) * (np.abs(f64(x)) @ np.abs(w)) + 1e-30
    got = np.asarray(quant.qmatmul(x, panels(qw), 1, jnp.float32, mode="bf16"))
    assert np.all(np.abs(got - want) <= bound)
    xla = np.asarray(quant.qmatmul(x, jax.tree.map(jnp.asarray, qw), 1, jnp.float32))  # the plain layout: XLA
    assert np.all(np.abs(xla - want) <= bound)


@pytest.mark.parametrize("fmt", ["int8", "q4_1", "q4_k"])
def test_only_the_live_rows_are_computed_and_the_rest_are_zeros(fmt):
    rng = np.random.default_rng(5)
    p = panels(random_weight(rng, fmt, 2, 64, 96))
    x = jnp.asarray(rng.standard_normal((9, 64)), jnp.bfloat16)
    full = np.asarray(quant.qmatmul(x, p, 1, jnp.float32))
    for rows in (0, 1, 4, 9, 20):
        got = np.asarray(jax.jit(lambda x, r: quant.qmatmul(x, p, 1, jnp.float32, rows=r))(x, jnp.int32(rows)))
        live = min(rows, 9)
        np.testing.assert_array_equal(got[:live], full[:live])
        assert not got[live:].any()


def test_a_two_dimensional_weight_and_a_table():
    """One matrix [K, N] (no layer axis), and a table [N, K] (an embedding as the LM head: x @ table.T)."""
    rng = np.random.default_rng(6)
    w = rng.standard_normal((96, 80)).astype(np.float32)
    x = jnp.asarray(rng.standard_normal((4, 96)), jnp.bfloat16)
    for qw in (quant.quantize_int8(w), quant.quantize_int8(w.T, table=True)):
        dense = np.asarray(quant.dequantize(qw, np.float32))
        dense = dense if not qw.table else dense.T  # [K, N]
        got = np.asarray(quant.qmatmul(x, panels(qw), None, jnp.float32))
        want = reference_int8(np.asarray(x, np.float32), dense)
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("fmt", ["int8", "q8_0", "q4_1", "q4_k"])
@pytest.mark.parametrize("activation", ["silu", "gelu_tanh"])
@pytest.mark.parametrize("m", [1, 13, 70])
def test_fused_gated_mlp_equals_two_products_and_the_bf16_activation(fmt, activation, m):
    """act(x @ gate) * (x @ up) in one call: the unfused bf16 computation's roundings (each product, act's steps,
    the product); act's float32 exp/tanh approximations may move a value by one bf16 step."""
    rng = np.random.default_rng(m)
    gate, up = (panels(random_weight(rng, fmt, 2, 96, 130)) for _ in range(2))
    x = jnp.asarray(rng.standard_normal((m, 96)), jnp.bfloat16)
    got = np.asarray(quant.qglu(x, gate, up, 1, activation), np.float32)
    want = np.asarray(ACTIVATIONS[activation](quant.qmatmul(x, gate, 1)) * quant.qmatmul(x, up, 1), np.float32)
    assert got.shape == (m, 130)
    np.testing.assert_allclose(got, want, rtol=2 ** -7, atol=1e-6)
    assert np.mean(got == want) > 0.98


@pytest.mark.parametrize("fmt", ["int8", "q8_0", "q4_0", "q4_1", "q4_k"])
@pytest.mark.parametrize("m", [1, 13, 130])
def test_three_products_in_one_call_equal_three_calls(fmt, m):
    """q, k, v in one call (`quant.qmatmul3`: x quantized once, the three weights' columns shared out as one call's
    work): exactly the three single calls' numbers, each of its own N, on the live rows only (zeros after)."""
    rng = np.random.default_rng(11 + m)
    ws = [panels(random_weight(rng, fmt, 2, 100, n)) for n in (130, 33, 64)]
    x = jnp.asarray(rng.standard_normal((m, 100)), jnp.bfloat16)
    for rows in (m, max(m - 5, 0)):
        got = jax.jit(lambda x, r: quant.qmatmul3(x, tuple(ws), 1, rows=r))(x, jnp.int32(rows))
        for w, y in zip(ws, got, strict=True):
            assert y.shape == (m, w.n) and y.dtype == jnp.bfloat16
            want = np.asarray(quant.qmatmul(x, w, 1, rows=rows), np.float32)
            np.testing.assert_array_equal(np.asarray(y, np.float32), want)
            assert not np.asarray(y, np.float32)[rows:].any()


@pytest.mark.skipif(not qmatmul_uses_amx(), reason="no AMX-INT8 path on this CPU")
@pytest.mark.parametrize("fmt", list(FORMS))
def test_amx_tiles_give_the_vnni_path_s_bits(fmt, monkeypatch):
    """Mode "int8" on AMX tiles (blocks of 16 rows; the default on an AMX-INT8 CPU) and on VPDPBUSD alone
    (JAXPAGED_NATIVE_AMX=0, read per call): the same integer dot products scaled by the same float32 operations, so
    the same bits, for plain products, the fused gated MLP and three products in one call; at 16 rows, at 37 (two
    blocks and 5 rows left to the VNNI path), past the 128-row work chunk, with K of one block and an odd one."""
    rng = np.random.default_rng(5)
    for m, k in ((16, 32), (37, 96), (150, 160), (48, 50)):
        gate, up = (panels(random_weight(rng, fmt, 2, k, 130)) for _ in range(2))
        small = panels(random_weight(rng, fmt, 2, k, 33))
        x = jnp.asarray(rng.standard_normal((m, k)), jnp.bfloat16)
        runs = []
        for amx in ("1", "0"):
            monkeypatch.setenv("JAXPAGED_NATIVE_AMX", amx)
            assert qmatmul_uses_amx() == (amx == "1")
            runs.append([np.asarray(y, np.float32) for y in (
                quant.qmatmul(x, gate, 1, jnp.float32), quant.qmatmul(x, gate, 0),
                quant.qglu(x, gate, up, 1, "silu"), *quant.qmatmul3(x, (gate, small, up), 0, rows=m - 3))])
        for got, want in zip(*runs, strict=True):
            np.testing.assert_array_equal(got, want)
        w = np.asarray(quant.dequantize(gate, np.float32, 1))
        bound = 1e-5 * (np.abs(np.asarray(x, np.float64)) @ np.abs(f64(w))) + 1e-6
        assert np.all(np.abs(runs[0][0] - reference_int8(np.asarray(x, np.float32), w)) <= bound)


def test_the_start_up_line_names_the_amx_path_when_it_runs(monkeypatch):
    from pallas_kernels.cpu_native import build

    want = "qmatmul (AMX)" if qmatmul_uses_amx() else "qmatmul"
    assert build.describe(["qmatmul"]).startswith(f"native CPU kernels in use: {want};")
    monkeypatch.setenv("JAXPAGED_NATIVE_AMX", "0")
    assert build.describe(["qmatmul"]).startswith("native CPU kernels in use: qmatmul;")


def test_a_wide_product_shares_several_groups_per_item():
    """A wide N (an LM head) at a decode step's few rows, whose work items are runs of 16 groups of 16 columns, the
    last one short: every column is still x's quantized product with the weight, the partly padded group too."""
    rng = np.random.default_rng(12)
    qw = random_weight(rng, "q8_0", 1, 64, 16 * 64 * 2 + 5)
    x = jnp.asarray(rng.standard_normal((2, 64)), jnp.bfloat16)
    w = np.asarray(quant.dequantize(qw, np.float32, 0))
    got = np.asarray(quant.qmatmul(x, panels(qw), 0, jnp.float32))
    want = reference_int8(np.asarray(x, np.float32), w)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


def test_bad_arguments_raise_naming_the_problem():
    rng = np.random.default_rng(7)
    p = quant.to_panels(random_weight(rng, "q4_1", 2, 64, 64))
    x = jnp.zeros((2, 64), jnp.bfloat16)
    kw = dict(n=64, bits=4, scale_mode=quant.BLOCK_F16)
    with pytest.raises(ValueError, match="mode"):
        qmatmul_native(x, p.codes, p.scales, 0, mode="fp4", **kw)
    with pytest.raises(ValueError, match="x must be"):
        qmatmul_native(jnp.zeros((2, 64), jnp.float16), p.codes, p.scales, 0, **kw)
    with pytest.raises(ValueError, match="do not fit"):
        qmatmul_native(jnp.zeros((2, 128), jnp.bfloat16), p.codes, p.scales, 0, **kw)
    with pytest.raises(ValueError, match="codes must be"):
        qmatmul_native(x, p.codes, p.scales, 0, n=64, bits=8, scale_mode=quant.BLOCK_F16)
    with pytest.raises(ValueError, match="activation"):
        qmatmul_glu_native(x, (p.codes, p.scales), (p.codes, p.scales), 0, activation="relu", **kw)
    with pytest.raises(ValueError, match="three"):
        qmatmul3_native(x, ((p.codes, p.scales),) * 2, 0, ns=(64, 64), bits=4, scale_mode=quant.BLOCK_F16)
    one = quant.to_panels(random_weight(rng, "q4_1", 1, 64, 64))
    with pytest.raises(ValueError, match="stacked alike"):
        qmatmul3_native(x, ((p.codes, p.scales),) * 2 + ((one.codes[0], one.scales[0]),), 0, ns=(64,) * 3,
                        bits=4, scale_mode=quant.BLOCK_F16)
    with pytest.raises(Exception, match="scales"):  # the kernel's own check: float32 scales for a float16 mode
        jax.block_until_ready(qmatmul_native(x, p.codes, jnp.asarray(p.scales, jnp.float32), 0, **kw))


# ---- the plain-loop build: what a CPU without AVX-512 VNNI runs ----------------------------------------------------

@functools.cache
def _portable_target() -> str:
    """qmatmul.cc built for baseline x86-64 (no AVX-512: the plain loops) and registered under a test target."""
    import os
    import tempfile

    source = os.path.join(os.path.dirname(native.__file__), "qmatmul.cc")
    path = os.path.join(tempfile.mkdtemp(prefix="qmatmul-portable-"), "qmatmul_portable.so")
    subprocess.run([shutil.which("g++") or "g++", "-std=c++17", "-O2", "-march=x86-64", "-fPIC", "-shared", "-isystem",
                    jax.ffi.include_dir(), source, "-o", path], check=True, capture_output=True, timeout=300)
    lib = ctypes.CDLL(path)
    assert lib.JaxpagedQMatmulIsFast() == 0
    jax.ffi.register_ffi_target("jaxpaged_qmatmul_portable_test", jax.ffi.pycapsule(lib.JaxpagedQMatmul),
                                platform="cpu")
    _portable_target.lib = lib  # keep it loaded
    return "jaxpaged_qmatmul_portable_test"


@pytest.mark.skipif(not qmatmul_is_fast() or shutil.which("g++") is None, reason="needs g++ and the fast build")
@pytest.mark.parametrize("fmt", ["int8", "q4_0", "q4_1", "q4_k", "q8_1"])
@pytest.mark.parametrize("mode", [0, 1])
def test_plain_loop_build_gives_the_vector_paths_numbers(fmt, mode):
    rng = np.random.default_rng(11)
    qw = random_weight(rng, fmt, 2, 80, 70)
    p = panels(qw)
    x = jnp.asarray(rng.standard_normal((10, 80)), jnp.bfloat16)
    call = jax.ffi.ffi_call(_portable_target(), jax.ShapeDtypeStruct((10, 70), jnp.float32))
    got = np.asarray(call(x, p.codes, p.scales, jnp.int32(1), jnp.int32(7), bits=np.int64(qw.bits),
                          scale_mode=np.int64(qw.scale_mode), mode=np.int64(mode)))
    want = np.asarray(quant.qmatmul(x, p, 1, jnp.float32, rows=7, mode="int8" if mode == 0 else "bf16"))
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
    assert not got[7:].any()


def test_many_calls_over_several_row_chunks_all_finish():
    """Calls of 300 rows run in 3 chunks and 2 phases over XLA's thread pool, whose helpers may start late; every
    call must finish (a subprocess with a time limit, so a hang fails instead of stalling the suite)."""
    script = """
import jax, jax.numpy as jnp, numpy as np
from jaxpaged.models import quant

rng = np.random.default_rng(0)
w = rng.standard_normal((2, 96, 200)).astype(np.float32)
qw = jax.tree.map(jnp.asarray, quant.to_panels(quant.quantize_int8(w)))
x = jnp.asarray(rng.standard_normal((300, 96)), jnp.bfloat16)
f = jax.jit(lambda x: quant.qmatmul(x, qw, 1))
want = np.asarray(f(x))
for _ in range(300):
    assert np.array_equal(np.asarray(f(x)), want)
print("ok")
"""
    import sys

    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert result.returncode == 0 and result.stdout.strip().endswith("ok"), result.stderr[-2000:]
