"""The native CPU RMSNorm, residual add (pallas_kernels/cpu_native/norm.cc) and rotary embedding (rope.cc) of a bf16
decoder layer against the
numbers XLA's compiled step gives for the pure-JAX layer (jaxpaged/models/norm.py), their errors, and the models'
use of them: only inside `native_matmul`, with the same greedy tokens as the pure-JAX step."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxpaged.models.matmul import native_matmul
from jaxpaged.models.norm import layer_add_rms_norm, layer_rms_norm, residual_add, rms_norm
from jaxpaged.models.rope import rope, rope_qk
from pallas_kernels import cpu_native

pytestmark = pytest.mark.skipif(not (cpu_native.available("norm") and cpu_native.available("rope")),
                                reason=f"native norm / rope unavailable: {cpu_native.unavailable_reason('norm')} "
                                       f"{cpu_native.unavailable_reason('rope')}")


def bf16(rng, *shape, scale=1.0, offset=0.0):
    return jnp.asarray(offset + rng.standard_normal(shape) * scale, jnp.bfloat16)


def xla_layer(h, delta, w, down, layer, eps):
    """The pure-JAX layer's norms and adds, compiled by XLA: (first norm, second norm, the layer's output)."""
    x1 = rms_norm(h, w[layer], eps)
    s = h + delta
    return x1, rms_norm(s, w[layer + 1], eps), s + down


def native_layer(h, delta, w, down, layer, eps):
    _, x1 = cpu_native.rms_norm_native(h, w, layer, eps)
    s, x2 = cpu_native.rms_norm_native(h, w, layer + 1, eps, delta=delta)
    return x1, x2, cpu_native.add_round_native(s, down)


def assert_close_bf16(got, want, max_fraction_off: float):
    """Equal, except where the float32 summation order of the mean moved a value by one bfloat16 rounding step."""
    got, want = np.asarray(got, np.float32), np.asarray(want, np.float32)
    off = got != want
    assert off.mean() <= max_fraction_off, off.mean()
    np.testing.assert_allclose(got[off], want[off], rtol=2 ** -7)


# rows below and above the parallel threshold; a width that is not a multiple of the 16 lanes
@pytest.mark.parametrize("t, h", [(1, 64), (7, 100), (64, 576), (512, 576)])
def test_the_native_norms_and_add_are_xla_s_numbers(t, h):
    rng = np.random.default_rng(t * h)
    hidden, delta, down = bf16(rng, t, h, scale=3.0), bf16(rng, t, h), bf16(rng, t, h)
    w = bf16(rng, 4, h, scale=0.1, offset=1.0)
    for layer in (0, 2):
        want = jax.jit(xla_layer, static_argnums=(4, 5))(hidden, delta, w, down, layer, 1e-5)
        got = jax.jit(native_layer, static_argnums=(5,))(hidden, delta, w, down, jnp.int32(layer), 1e-5)
        for g, x in zip(got[:2], want[:2], strict=True):
            assert_close_bf16(g, x, max_fraction_off=1e-3)
        np.testing.assert_array_equal(np.asarray(got[2], np.float32), np.asarray(want[2], np.float32))


def test_the_sum_is_float32_and_unrounded():
    rng = np.random.default_rng(0)
    hidden, delta, w = bf16(rng, 5, 32), bf16(rng, 5, 32, scale=1e-3), bf16(rng, 2, 32)
    s, _ = cpu_native.rms_norm_native(hidden, w, 0, 1e-6, delta=delta)
    want = np.asarray(hidden, np.float32) + np.asarray(delta, np.float32)
    assert s.dtype == jnp.float32
    np.testing.assert_array_equal(np.asarray(s), want)  # exact: a sum of two bfloat16 fits float32
    assert not np.array_equal(want, np.asarray(hidden + delta, np.float32))  # bfloat16 would have rounded it


def test_layer_index_is_clipped_and_nan_stays_in_its_row():
    rng = np.random.default_rng(1)
    hidden, w = bf16(rng, 3, 48), bf16(rng, 2, 48, offset=1.0)
    hidden = hidden.at[1, 5].set(jnp.nan)
    _, out = cpu_native.rms_norm_native(hidden, w, 7, 1e-6)  # layer 7 of 2: the last
    want = rms_norm(hidden, w[1], 1e-6)
    out, want = np.asarray(out, np.float32), np.asarray(want, np.float32)
    assert np.isnan(out[1]).all() and not np.isnan(out[[0, 2]]).any()
    assert_close_bf16(out[[0, 2]], want[[0, 2]], max_fraction_off=0.02)


@pytest.mark.parametrize("call, message", [
    (lambda: cpu_native.rms_norm_native(jnp.ones((2, 8), jnp.float32), jnp.ones((1, 8), jnp.bfloat16), 0, 1e-6),
     "bfloat16"),
    (lambda: cpu_native.rms_norm_native(jnp.ones((2, 8), jnp.bfloat16), jnp.ones((1, 6), jnp.bfloat16), 0, 1e-6),
     "weight"),
    (lambda: cpu_native.rms_norm_native(jnp.ones((2, 8), jnp.bfloat16), jnp.ones((1, 8), jnp.bfloat16), 0, 1e-6,
                                        delta=jnp.ones((3, 8), jnp.bfloat16)), "delta"),
    (lambda: cpu_native.add_round_native(jnp.ones((2, 8), jnp.bfloat16), jnp.ones((2, 8), jnp.bfloat16)), "float32"),
])
def test_bad_arguments_name_the_field(call, message):
    with pytest.raises(ValueError, match=message):
        call()


def test_the_model_functions_go_native_only_inside_native_matmul():
    rng = np.random.default_rng(2)
    hidden, delta, w = bf16(rng, 4, 64), bf16(rng, 4, 64), bf16(rng, 3, 64, offset=1.0)

    def run(h, d):
        s, x = layer_add_rms_norm(h, d, w, 1, 1e-6)
        return layer_rms_norm(h, w, 0, 1e-6), s, x, residual_add(s, d)

    def targets(native_rows: int) -> str:
        def traced(h, d):
            with native_matmul(native_rows):
                return run(h, d)
        return jax.jit(traced).lower(hidden, delta).as_text()

    assert "jaxpaged_rms_norm" in targets(64) and "jaxpaged_add_round" in targets(64)
    assert "jaxpaged_rms_norm" not in targets(0) and "jaxpaged_add_round" not in targets(0)
    assert "jaxpaged_rms_norm" not in targets(2)  # more rows than the native step takes
    with native_matmul(64):
        native = jax.jit(run)(hidden, delta)
    plain = jax.jit(lambda h, d: run(h, d))(hidden, delta)  # another function: jit's cache ignores the context
    assert native[1].dtype == jnp.float32 and plain[1].dtype == jnp.bfloat16
    for got, want in zip((native[0], native[2], native[3]), (plain[0], plain[2], plain[3]), strict=True):
        assert_close_bf16(got, want, max_fraction_off=0.02)


@pytest.mark.parametrize("t, hq, hk, d", [(1, 4, 2, 8), (64, 9, 3, 64), (130, 4, 1, 256), (5, 2, 2, 36)])
def test_native_rope_is_xla_s_numbers(t, hq, hk, d):
    rng = np.random.default_rng(t * d)
    q, k = bf16(rng, t, hq, d, scale=2.0), bf16(rng, t, hk, d, scale=2.0)
    angles = rng.integers(0, 4000, (t, 1, 1)) * (10000.0 ** -(np.arange(d // 2) / (d // 2)))
    cos, sin = jnp.asarray(np.cos(angles), jnp.float32), jnp.asarray(np.sin(angles), jnp.float32)
    want = jax.jit(lambda q, k, c, s: (rope(q, c, s), rope(k, c, s)))(q, k, cos, sin)
    got = jax.jit(cpu_native.rope_native)(q, k, cos, sin)
    for g, w in zip(got, want, strict=True):
        np.testing.assert_array_equal(np.asarray(g, np.float32), np.asarray(w, np.float32))
    with native_matmul(t):
        routed = jax.jit(rope_qk)(q, k, cos, sin)
    for g, w in zip(routed, want, strict=True):
        np.testing.assert_array_equal(np.asarray(g, np.float32), np.asarray(w, np.float32))


def test_rope_bad_arguments_name_the_field():
    q, k = jnp.ones((2, 4, 8), jnp.bfloat16), jnp.ones((2, 2, 8), jnp.bfloat16)
    with pytest.raises(ValueError, match="even D"):
        cpu_native.rope_native(q[..., :7], k[..., :7], jnp.ones((2, 1, 3)), jnp.ones((2, 1, 3)))
    with pytest.raises(ValueError, match="cos"):
        cpu_native.rope_native(q, k, jnp.ones((2, 1, 3)), jnp.ones((2, 1, 4)))
    with pytest.raises(ValueError, match="bfloat16"):
        cpu_native.rope_native(q.astype(jnp.float32), k, jnp.ones((2, 1, 4)), jnp.ones((2, 1, 4)))


def outlier_rows(rng, *shape):
    """bfloat16 rows with three dimensions far larger than the rest, as real residual streams have."""
    x = rng.standard_normal(shape) * 15
    x[..., :3] *= 30
    return jnp.asarray(x, jnp.bfloat16)


@pytest.mark.parametrize("shape", [(512, 576), (256, 4, 64)], ids=["rows", "heads"])
@pytest.mark.parametrize("unit_offset", [False, True], ids=["llama", "gemma"])
def test_rms_norm_in_a_native_step_is_native_and_its_rows_keep_their_bits(shape, unit_offset):
    """`rms_norm` (the LM head's norm, a head's q/k norm, all of Gemma's) inside `native_matmul`: norm.cc's numbers
    (Gemma's (1 + weight) in float32 too), and a row's bits the same alone as beside 15 others, which XLA's fused
    norm does not always keep at this width for rows like these (it sums in another order for other row counts)."""
    rng = np.random.default_rng(3)
    x, w = outlier_rows(rng, *shape), bf16(rng, shape[-1], scale=0.1, offset=0.0 if unit_offset else 1.0)

    def norm(x):
        with native_matmul(16):
            return rms_norm(x, w, 1e-6, unit_offset=unit_offset)

    assert "jaxpaged_rms_norm" in jax.jit(norm).lower(x[:16]).as_text()
    native = jax.jit(norm)
    one = np.concatenate([np.asarray(native(x[i:i + 1]), np.float32) for i in range(shape[0])])
    sixteen = np.concatenate([np.asarray(native(x[i:i + 16]), np.float32) for i in range(0, shape[0], 16)])
    np.testing.assert_array_equal(one, sixteen)
    xla = np.asarray(jax.jit(lambda x: rms_norm(x, w, 1e-6, unit_offset=unit_offset))(x), np.float32)
    assert_close_bf16(sixteen, xla, max_fraction_off=1e-3)
