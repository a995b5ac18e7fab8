"""The native CPU bf16 matmul (pallas_kernels/cpu_native/matmul.cc) against exact products and XLA's dot, its
errors, and the engine's use of it: bf16 layer matmuls run natively on a CPU with AVX512_BF16 (never under a
tensor-parallel mesh), with the same greedy tokens as XLA's dot gives. Its gated-MLP form, act(x @ w_gate) *
(x @ w_up) in one pass, against the same activation of its plain products and XLA's unfused bfloat16 computation.
On a CPU with AMX-BF16 the checks that take `path` run on both of the kernel's paths: AMX tiles (the default there)
and AVX-512 (JAXPAGED_NATIVE_AMX=0)."""

from __future__ import annotations

import re

import jax.numpy as jnp
import numpy as np
import pytest

from jaxpaged import SamplingParams
from jaxpaged.models.matmul import ACTIVATIONS, layer_glu, layer_matmul, matmul, native_matmul
from jaxpaged.worker import step as step_module
from pallas_kernels import cpu_native
from tests.tiny import random_params, random_prompts, tiny_config, tiny_llm

pytestmark = pytest.mark.skipif(not cpu_native.available("matmul"),
                                reason=f"native matmul unavailable: {cpu_native.unavailable_reason('matmul')}")
MATMUL_TARGET, GLU_TARGET = "jaxpaged_matmul", "jaxpaged_matmul_glu"  # the FFI targets of matmul.cc's handlers
fast = pytest.mark.skipif(not cpu_native.matmul_is_fast(), reason="no AVX512_BF16 path on this CPU")
PATHS = ["default", "avx512"] if cpu_native.matmul_uses_amx() else ["default"]


@pytest.fixture(params=PATHS)
def path(request, monkeypatch):
    """The kernel's path under test: what this CPU runs by default, and AVX-512 where that default is AMX (the
    kernel reads JAXPAGED_NATIVE_AMX on each call)."""
    if request.param == "avx512":
        monkeypatch.setenv("JAXPAGED_NATIVE_AMX", "0")
        assert not cpu_native.matmul_uses_amx()
    return request.param


def bf16(rng, *shape, scale=1.0):
    return jnp.asarray(rng.standard_normal(shape) * scale, jnp.bfloat16)


def exact(x, w):
    """float64 x @ w and the bound on float32 accumulation error (|x| @ |w| times a few float32 epsilons)."""
    x64, w64 = np.asarray(x, np.float64), np.asarray(w, np.float64)
    return x64 @ w64, 4 * np.finfo(np.float32).eps * (np.abs(x64) @ np.abs(w64)) * np.sqrt(x64.shape[1])


# rows not a multiple of the 12-row register block, columns not a multiple of the 32-column panel
@pytest.mark.parametrize("m, k, n", [(1, 2, 1), (5, 32, 7), (13, 64, 40), (25, 576, 192), (64, 1536, 576),
                                     (130, 96, 97)])
def test_float32_out_is_the_exact_product_within_float32_accumulation(m, k, n, path):
    rng = np.random.default_rng(m * n + k)
    x, w = bf16(rng, m, k), bf16(rng, 3, k, n, scale=k ** -0.5)
    for layer in (0, 2):
        got = np.asarray(cpu_native.matmul_native(x, w, layer, jnp.float32))
        want, bound = exact(x, w[layer])
        assert got.shape == (m, n) and got.dtype == np.float32
        assert np.all(np.abs(got - want) <= bound + 1e-30), layer


@pytest.mark.parametrize("m, k, n", [(3, 8, 33), (48, 576, 1536), (64, 576, 576), (2048, 576, 192)])
def test_bfloat16_out_is_the_float32_result_rounded_to_nearest_even(m, k, n, path):
    rng = np.random.default_rng(k + n)
    x, w = bf16(rng, m, k), bf16(rng, k, n, scale=k ** -0.5)
    f32 = cpu_native.matmul_native(x, w, 0, jnp.float32)
    out = cpu_native.matmul_native(x, w)
    assert out.dtype == jnp.bfloat16
    np.testing.assert_array_equal(np.asarray(out, np.float32), np.asarray(f32.astype(jnp.bfloat16), np.float32))
    # and it is XLA's bf16 dot up to float32 summation order: at most one bf16 rounding step apart
    xla = np.asarray(matmul(x, w), np.float32)
    np.testing.assert_allclose(np.asarray(out, np.float32), xla, rtol=2 ** -7, atol=1e-6)


@fast
def test_a_stacked_weight_is_read_at_its_layer_and_the_layer_is_clipped():
    rng = np.random.default_rng(0)
    x, w = bf16(rng, 4, 16), bf16(rng, 3, 16, 24)
    for layer, want in ((1, 1), (-5, 0), (7, 2)):
        np.testing.assert_array_equal(np.asarray(cpu_native.matmul_native(x, w, layer, jnp.float32)),
                                      np.asarray(cpu_native.matmul_native(x, w[want], 0, jnp.float32)))


@pytest.mark.parametrize("k", [4, 64])  # K % 32: the AMX path where there is one
def test_nan_and_inf_propagate(k, path):
    x = jnp.ones((2, k), jnp.bfloat16).at[0, 1].set(jnp.nan).at[1, 2].set(jnp.inf)
    w = jnp.ones((k, 3), jnp.bfloat16)
    out = np.asarray(cpu_native.matmul_native(x, w, 0, jnp.float32))
    assert np.isnan(out[0]).all() and np.isposinf(out[1]).all()


@pytest.mark.parametrize("x_shape, w_shape, dtype, field", [
    ((4, 7), (7, 8), jnp.bfloat16, "K"),            # odd K
    ((4, 8), (6, 8), jnp.bfloat16, "x must be"),     # K mismatch
    ((4, 8), (8, 8), jnp.float32, "bfloat16"),       # dtype
    ((2, 4, 8), (8, 8), jnp.bfloat16, "x must be"),  # rank
])
def test_bad_arguments_raise_value_error_naming_them(x_shape, w_shape, dtype, field):
    with pytest.raises(ValueError, match=field):
        cpu_native.matmul_native(jnp.zeros(x_shape, dtype), jnp.zeros(w_shape, dtype))
    with pytest.raises(ValueError, match="out_dtype"):
        cpu_native.matmul_native(jnp.zeros((2, 4), jnp.bfloat16), jnp.zeros((4, 8), jnp.bfloat16), 0, jnp.float16)


def test_layer_matmul_uses_the_kernel_only_inside_native_matmul_and_up_to_its_rows():
    import jax

    x, w = jnp.ones((8, 16), jnp.bfloat16), jnp.ones((2, 16, 32), jnp.bfloat16)

    def targets(fn, *args):
        return set(re.findall(r'custom_call_target="(\w+)"', jax.jit(fn).lower(*args).as_text(dialect="hlo")))

    def under(rows):
        def fn(x, w):
            with native_matmul(rows):
                return layer_matmul(x, w, 1)
        return fn

    assert MATMUL_TARGET in targets(under(8), x, w)
    assert MATMUL_TARGET not in targets(under(7), x, w)  # more rows than allowed: XLA's dot
    assert MATMUL_TARGET not in targets(lambda x, w: layer_matmul(x, w, 1), x, w)
    assert MATMUL_TARGET not in targets(under(8), x.astype(jnp.float32), w.astype(jnp.float32))
    np.testing.assert_array_equal(np.asarray(under(8)(x, w), np.float32), np.asarray(matmul(x, w[1]), np.float32))


@fast
@pytest.mark.parametrize("activation", ["silu", "gelu_tanh"])
@pytest.mark.parametrize("m, k, n", [(1, 2, 1), (13, 64, 40), (25, 576, 1536), (130, 96, 97)])
def test_glu_is_the_activation_of_its_products_as_xla_s_unfused_bfloat16_mlp(activation, m, k, n, path):
    """Rows not a multiple of the register or tile blocks, columns not a multiple of the 32-column panel, a stacked
    weight read at its layer: bitwise JAX's bfloat16 act(x @ w_gate) * (x @ w_up) (every operation rounded, as JAX
    does; exp and tanh agree after rounding to bfloat16 on these values) of the plain kernel's products; and XLA's
    unfused computation within a few bfloat16 roundings (XLA's dot sums in its own order, which depends on the CPU:
    on AMD Zen 4 it gave these bits exactly, on an Intel Xeon with AMX it does not)."""
    rng = np.random.default_rng(m + k + n)
    x = bf16(rng, m, k, scale=2.0)
    w_gate, w_up = bf16(rng, 3, k, n, scale=k ** -0.5), bf16(rng, 3, k, n, scale=k ** -0.5)
    got = cpu_native.matmul_glu_native(x, w_gate, w_up, 2, activation)
    assert got.shape == (m, n) and got.dtype == jnp.bfloat16
    products = ACTIVATIONS[activation](cpu_native.matmul_native(x, w_gate, 2)) * cpu_native.matmul_native(x, w_up, 2)
    np.testing.assert_array_equal(np.asarray(got, np.float32), np.asarray(products, np.float32))
    xla = np.asarray(ACTIVATIONS[activation](matmul(x, w_gate[2])) * matmul(x, w_up[2]), np.float32)
    np.testing.assert_allclose(np.asarray(got, np.float32), xla, rtol=2 ** -5, atol=2 ** -8)


@fast
@pytest.mark.parametrize("k, n", [(64, 40), (576, 192), (96, 97)])
def test_a_row_s_result_does_not_depend_on_the_rows_beside_it(k, n, path):
    """The engine's batch invariance rests on this: row r of a call with M rows has the same bits for every M
    (fewer rows than a tile or register block, a partial last block, several blocks), plain and GLU."""
    rng = np.random.default_rng(k + n)
    x, w = bf16(rng, 70, k), bf16(rng, 1, k, n, scale=k ** -0.5)
    full = np.asarray(cpu_native.matmul_native(x, w, 0, jnp.float32))
    glu = np.asarray(cpu_native.matmul_glu_native(x, w, w, 0), np.float32)
    for m in (1, 5, 13, 16, 17, 33, 48):
        np.testing.assert_array_equal(np.asarray(cpu_native.matmul_native(x[:m], w, 0, jnp.float32)), full[:m])
        np.testing.assert_array_equal(np.asarray(cpu_native.matmul_glu_native(x[:m], w, w, 0), np.float32), glu[:m])


@pytest.mark.parametrize("rows", [0, 5, 13, 40, -3])
def test_only_the_live_rows_are_computed_and_the_padding_rows_are_zeros(rows, path):
    """A bucketed step's padding rows (from `rows` on; clipped to [0, M]) come out as zeros and the live ones as
    without the argument, for the plain matmul (bfloat16 and float32 out) and the GLU, with `rows` traced."""
    import jax

    rng = np.random.default_rng(rows + 10)
    x, w, w_up = bf16(rng, 13, 64), bf16(rng, 2, 64, 40), bf16(rng, 2, 64, 40)
    live = min(max(rows, 0), 13)
    for fn in (lambda x, w, w_up, r: cpu_native.matmul_native(x, w, 1, None, r),
               lambda x, w, w_up, r: cpu_native.matmul_native(x, w, 1, jnp.float32, r),
               lambda x, w, w_up, r: cpu_native.matmul_glu_native(x, w, w_up, 1, "silu", r)):
        got = np.asarray(jax.jit(fn)(x, w, w_up, jnp.int32(rows)), np.float32)
        full = np.asarray(fn(x, w, w_up, None), np.float32)
        np.testing.assert_array_equal(got[:live], full[:live])
        assert not got[live:].any()


def test_glu_bad_arguments_raise_value_error_naming_them():
    x, w = jnp.zeros((4, 8), jnp.bfloat16), jnp.zeros((8, 16), jnp.bfloat16)
    with pytest.raises(ValueError, match="activation"):
        cpu_native.matmul_glu_native(x, w, w, 0, "relu")
    with pytest.raises(ValueError, match="w_gate and w_up"):
        cpu_native.matmul_glu_native(x, w, jnp.zeros((8, 8), jnp.bfloat16))
    with pytest.raises(ValueError, match="bfloat16"):
        cpu_native.matmul_glu_native(x.astype(jnp.float32), w.astype(jnp.float32), w.astype(jnp.float32))
    with pytest.raises(ValueError, match="K"):
        cpu_native.matmul_glu_native(jnp.zeros((4, 7), jnp.bfloat16), w[:7], w[:7])


@pytest.mark.parametrize("m", [1, 5, 13, 64])
@pytest.mark.parametrize("k, n", [(64, 96), (576, 192), (1536, 576)])
def test_a_prepacked_weight_gives_the_same_bits_as_the_weight_as_stored(m, k, n, path):
    """`prepack_weight` ([L, K, N] -> [L, N/32, K/2, 64], the kernel's panel layout) and back is the identity; the
    kernels read it in place with the same results as from the stored weight (plain, float32 out, live rows, GLU),
    at every layer."""
    rng = np.random.default_rng(m + k + n)
    x, w, w_up = bf16(rng, m, k), bf16(rng, 2, k, n, scale=k ** -0.5), bf16(rng, 2, k, n, scale=k ** -0.5)
    packed, packed_up = cpu_native.prepack_weight(w), cpu_native.prepack_weight(w_up)
    assert packed.shape == (2, n // 32, k // 2, 64)
    np.testing.assert_array_equal(np.asarray(cpu_native.unpack_weight(packed)), np.asarray(w))
    np.testing.assert_array_equal(cpu_native.unpack_weight(cpu_native.prepack_weight(np.asarray(w))), np.asarray(w))
    for layer in (0, 1):
        for args in ((None, None), (jnp.float32, None), (None, m // 2)):
            np.testing.assert_array_equal(np.asarray(cpu_native.matmul_native(x, packed, layer, *args), np.float32),
                                          np.asarray(cpu_native.matmul_native(x, w, layer, *args), np.float32))
        np.testing.assert_array_equal(
            np.asarray(cpu_native.matmul_glu_native(x, packed, packed_up, layer, "gelu_tanh"), np.float32),
            np.asarray(cpu_native.matmul_glu_native(x, w, w_up, layer, "gelu_tanh"), np.float32))


def test_prepacking_refuses_shapes_it_cannot_lay_out():
    with pytest.raises(ValueError, match="multiple of 32"):
        cpu_native.prepack_weight(jnp.zeros((2, 8, 40), jnp.bfloat16))
    with pytest.raises(ValueError, match="K even"):
        cpu_native.prepack_weight(jnp.zeros((2, 7, 32), jnp.bfloat16))
    with pytest.raises(ValueError, match="prepacked"):  # last axis not 64
        cpu_native.matmul_native(jnp.zeros((2, 8), jnp.bfloat16), jnp.zeros((1, 1, 4, 32), jnp.bfloat16))
    with pytest.raises(ValueError, match="prepacked"):  # K/2 does not fit x
        cpu_native.matmul_native(jnp.zeros((2, 8), jnp.bfloat16), jnp.zeros((1, 1, 3, 64), jnp.bfloat16))


def test_a_prepacked_weight_outside_the_native_kernel_is_unpacked():
    """layer_matmul / layer_glu of a prepacked weight where the kernel does not run (no native_matmul, float32 x):
    XLA's dot of the unpacked layer, the same numbers."""
    rng = np.random.default_rng(3)
    x, w = bf16(rng, 5, 64), bf16(rng, 2, 64, 32)
    packed = cpu_native.prepack_weight(w)
    np.testing.assert_array_equal(np.asarray(layer_matmul(x, packed, 1), np.float32),
                                  np.asarray(matmul(x, w[1]), np.float32))
    np.testing.assert_array_equal(np.asarray(layer_glu(x, packed, packed, 1, "silu"), np.float32),
                                  np.asarray(layer_glu(x, w, w, 1, "silu"), np.float32))
    x32 = x.astype(jnp.float32)
    with native_matmul(64):
        np.testing.assert_allclose(np.asarray(layer_matmul(x32, packed.astype(jnp.float32), 1)),
                                   np.asarray(matmul(x32, w[1].astype(jnp.float32))), rtol=1e-6)


def test_a_prepacked_lm_head_runs_natively_on_its_live_rows_in_float32():
    """head_matmul: a prepacked head inside native_matmul is the native kernel with float32 out (XLA's dot up to
    float32 summation order), zeros past the live rows; outside it, exactly XLA's dot of the unpacked head. A head
    the layout cannot hold (V not a multiple of 32) stays as it is."""
    import jax

    from jaxpaged.models.matmul import head_matmul, prepack_head

    rng = np.random.default_rng(4)
    h, head = bf16(rng, 6, 64), bf16(rng, 64, 160, scale=0.125)
    packed = prepack_head(head)
    assert packed.shape == (1, 5, 32, 64) and prepack_head(head[:, :150]).shape == (64, 150)
    want = np.asarray(jnp.dot(h, head, preferred_element_type=jnp.float32))
    np.testing.assert_array_equal(np.asarray(head_matmul(h, packed)), want)

    def native(h, packed, live):
        with native_matmul(64, live_rows=(6, live)):
            return head_matmul(h, packed)

    hlo = jax.jit(native).lower(h, packed, jnp.int32(4)).as_text(dialect="hlo")
    assert MATMUL_TARGET in hlo
    got = np.asarray(jax.jit(native)(h, packed, jnp.int32(4)))
    assert got.dtype == np.float32
    np.testing.assert_allclose(got[:4], want[:4], rtol=1e-5, atol=1e-5)
    assert not got[4:].any()


def test_layer_glu_is_native_only_inside_native_matmul():
    import jax

    x, w = jnp.ones((8, 16), jnp.bfloat16), jnp.ones((2, 16, 32), jnp.bfloat16)

    def glu(rows):
        def fn(x, w):
            with native_matmul(rows):
                return layer_glu(x, w, w, 1, "silu")
        return fn

    hlo = jax.jit(glu(8)).lower(x, w).as_text(dialect="hlo")
    assert GLU_TARGET in hlo
    assert GLU_TARGET not in jax.jit(glu(0)).lower(x, w).as_text(dialect="hlo")
    np.testing.assert_array_equal(np.asarray(glu(8)(x, w), np.float32), np.asarray(glu(0)(x, w), np.float32))


ENGINE_ROWS = step_module.NATIVE_MATMUL_ROWS
CONFIG = tiny_config(vocab_size=160, hidden=64, layers=3, heads=4, kv_heads=2, head_dim=16)  # V: 5 panels of 32


PARAMS_SEEN: dict[bool, list] = {}


def run(native: bool, monkeypatch):
    from flax import nnx

    from jaxpaged.models.matmul import LAYER_MATRICES

    monkeypatch.setattr(step_module, "NATIVE_MATMUL_ROWS", ENGINE_ROWS if native else 0)
    llm = tiny_llm(CONFIG, random_params(CONFIG), dtype="bfloat16")
    state = nnx.to_pure_dict(llm.engine.runner.params)
    head = state.get("head_t", state.get("lm_head"))
    PARAMS_SEEN[native] = [state["layers"][name] for name in LAYER_MATRICES] + [head]
    prompts = random_prompts(3, 5, 40, vocab=CONFIG.vocab_size, seed=2)
    sp = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, logprobs=1)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], sp, use_tqdm=False)
    hlo = "\n".join(e.as_text() for e in llm.engine.runner._executables.values())
    return outs, hlo


@fast
def test_the_engine_runs_bf16_layer_matmuls_natively_with_xla_s_greedy_tokens(monkeypatch):
    native_outs, native_hlo = run(True, monkeypatch)
    xla_outs, xla_hlo = run(False, monkeypatch)
    # the native run's layer matrices and LM head were prepacked at load (4-D), XLA's kept as stored
    assert {x.ndim for x in PARAMS_SEEN[True]} == {4} and {x.ndim for x in PARAMS_SEEN[False]} == {2, 3}
    assert MATMUL_TARGET in native_hlo and MATMUL_TARGET not in xla_hlo
    assert GLU_TARGET in native_hlo and GLU_TARGET not in xla_hlo
    for a, b in zip(native_outs, xla_outs, strict=True):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        for la, lb in zip(a.outputs[0].logprobs, b.outputs[0].logprobs, strict=True):
            tok = next(iter(la))
            assert abs(la[tok].logprob - lb[tok].logprob) < 0.05  # bf16 activations: rounding may differ by an ulp


def test_no_native_matmul_under_a_mesh_or_off_cpu():
    import jax
    from jax.sharding import Mesh

    assert step_module.native_matmul_rows(Mesh(np.array(jax.devices()[:1]), ("tp",))) == 0
    assert step_module.native_matmul_rows(None) == (step_module.NATIVE_MATMUL_ROWS
                                                             if cpu_native.matmul_is_fast() else 0)


@fast
def test_the_start_up_line_names_the_matmul_s_amx_path_when_it_runs(monkeypatch):
    from pallas_kernels.cpu_native import build

    amx = cpu_native.matmul_uses_amx()
    line = build.describe(["matmul"])
    assert line.startswith("native CPU kernels in use: matmul (AMX);" if amx else "native CPU kernels in use: matmul;")
    monkeypatch.setenv("JAXPAGED_NATIVE_AMX", "0")
    assert not cpu_native.matmul_uses_amx()
    assert build.describe(["matmul"]).startswith("native CPU kernels in use: matmul;")

