"""fp8 K/V pools in the kernels (pallas_kernels/fp8.py): the saturating write, the reference and the native CPU kernel
reading float8_e4m3fn / float8_e5m2 pools with per-layer scales, against float64 dense attention over the dequantized
K/V (tests/kernels/attention_cases.py builds the pool as fp8(K / k_scale) and the dense copy as fp8 * k_scale).

Pools are NaN wherever no real context lives (fp8 has a NaN bit pattern: 0x7F for e4m3fn), so an unused slot read by
mistake reaches the output. The native kernel converts fp8 two ways (a 256-entry table on its float32 paths, 32 elements
at a time to bfloat16 in registers on its AVX512_BF16 paths): every finite value of both formats is checked to come out
exact on each path. Tolerances as the q dtype's (tests/kernels/attention_cases.py): fp8 rounding happened when the pool
was built, so both sides see the same values.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from pallas_kernels import fp8
from pallas_kernels.cpu_native import native
from pallas_kernels.reference import ragged_paged_attention_reference, write_kv_reference
from tests.kernels.attention_cases import GEMMA3_HEADS, build_case, decode_case, prefill_case, tolerance

E4M3, E5M2 = jnp.float8_e4m3fn, jnp.float8_e5m2
FP8 = [E4M3, E5M2]
STATIC = ("scale", "tile_size", "sliding_window", "soft_cap", "decode_blocks")
reference = jax.jit(ragged_paged_attention_reference, static_argnames=STATIC)
# The native kernel is a CPU custom call: where JAX's default backend is a GPU or TPU, the engine never runs it (and
# these tests' arrays live on that device).
needs_native = pytest.mark.skipif(jax.default_backend() != "cpu" or not native.available(),
                                  reason="the native CPU kernel runs on a CPU backend, built")


def fp8_id(dtype) -> str:
    return jnp.dtype(dtype).name


def check(case, out, **masking):
    out = np.asarray(out.astype(jnp.float32))
    assert not np.isnan(out).any(), "NaN from an unused (poisoned) pool slot reached the output"
    np.testing.assert_allclose(out, case.expected(**masking), **tolerance(case.dtype))
    np.testing.assert_array_equal(out[~case.valid_tokens], 0.0)


# ---- the write: saturating, round to nearest even --------------------------------------------------------------------

@pytest.mark.parametrize("dtype", FP8, ids=fp8_id)
def test_writes_saturate_instead_of_overflowing(dtype):
    limit = fp8.fp8_max(dtype)
    x = jnp.array([0.0, 1.0, -3.3, limit, 1.5 * limit, -1e9, jnp.inf, -jnp.inf], jnp.float32)
    got = np.asarray(fp8.to_pool_dtype(x, dtype).astype(jnp.float32))
    # XLA's own convert overflows (NaN for e4m3fn, inf for e5m2); the pool must hold the largest finite value.
    np.testing.assert_array_equal(got[3:], [limit, limit, -limit, limit, -limit])
    want = np.asarray(np.asarray(x[:3]).astype(ml_dtypes.finfo(dtype).dtype).astype(np.float32))
    np.testing.assert_array_equal(got[:3], want)  # in range: ml_dtypes' round-to-nearest-even
    assert np.isnan(np.asarray(fp8.to_pool_dtype(jnp.array([jnp.nan]), dtype).astype(jnp.float32))).all()


@pytest.mark.parametrize("dtype", FP8, ids=fp8_id)
def test_scaled_write_stores_k_over_the_scale(dtype):
    x = jnp.asarray(np.random.default_rng(0).standard_normal((64,)) * 100, jnp.float32)
    stored = fp8.to_pool_dtype(x, dtype, 8.0)
    np.testing.assert_array_equal(np.asarray(stored), np.asarray(fp8.to_pool_dtype(x / 8.0, dtype)))
    back = np.asarray(fp8.dequantize(stored, 8.0))
    np.testing.assert_allclose(back, np.asarray(x), rtol=2.0 ** -(jnp.finfo(dtype).nmant + 1) + 1e-7, atol=1e-6)


@pytest.mark.parametrize("dtype", FP8, ids=fp8_id)
def test_reference_write_saturates_into_an_fp8_pool(dtype):
    pool = jnp.zeros((2, 3, 4, 1, 2), dtype)
    k_new = jnp.array([[[1e6, -0.3]]], jnp.float32)
    k, v = write_kv_reference(pool, pool, 1, k_new, -k_new, jnp.array([5], jnp.int32))
    limit = fp8.fp8_max(dtype)
    np.testing.assert_array_equal(np.asarray(k[1, 1, 1, 0].astype(jnp.float32)),
                                  [limit, float(jnp.asarray(-0.3, dtype).astype(jnp.float32))])
    assert float(v[1, 1, 1, 0, 0].astype(jnp.float32)) == -limit
    assert float(jnp.abs(k.astype(jnp.float32)).sum()) == pytest.approx(limit + 0.3, rel=0.07)  # nothing else


# ---- the reference over fp8 pools ------------------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", FP8, ids=fp8_id)
@pytest.mark.parametrize("q_dtype", [jnp.float32, jnp.bfloat16], ids=["q-f32", "q-bf16"])
def test_reference_reads_fp8_pools_times_their_scales(dtype, q_dtype):
    heads = dict(num_q_heads=6, num_kv_heads=2, head_dim=32, block_size=8, dtype=q_dtype, kv_dtype=dtype,
                 k_scale=0.375, v_scale=2.5)
    dec = decode_case([1, 8, 9, 30], num_padding_seqs=1, num_padding_tokens=2, seed=1, **heads)
    check(dec, reference(*dec.args, **dec.kwargs()))
    check(dec, reference(*dec.args, **dec.kwargs(decode_blocks=dec.decode_blocks)))  # the flat-block decode path
    pre = prefill_case([(20, 20), (41, 17), (30, 1)], seed=2, **heads)
    check(pre, reference(*pre.args, **pre.kwargs()))
    check(pre, reference(*pre.args, **pre.kwargs(sliding_window=7, soft_cap=5.0)), sliding_window=7, soft_cap=5.0)


def test_reference_scales_may_be_traced_per_layer():
    case = decode_case([5, 17], kv_dtype=E4M3, k_scale=0.5, v_scale=4.0)
    scales = jnp.array([[9.0, 9.0], [0.5, 4.0]], jnp.float32)  # layer 1 is the case's layer

    @jax.jit
    def run(layer):
        return ragged_paged_attention_reference(*case.args[:3], layer, *case.args[4:], scale=case.scale,
                                                k_scale=scales[layer, 0], v_scale=scales[layer, 1])

    check(case, run(jnp.int32(1)))


# ---- the native CPU kernel over fp8 pools ----------------------------------------------------------------------------

HEADS = [  # (q heads, kv heads, head_dim): SmolLM2 (decode and tile fast paths), Gemma 3, GQA 4 at 128, a generic 32
    (9, 3, 64), (4, 1, 256), (8, 2, 128), (4, 2, 32)]
native_fn = jax.jit(native.paged_attention_native, static_argnames=STATIC)


@needs_native
@pytest.mark.parametrize("kind", ["decode", "prefill", "mixed"])
@pytest.mark.parametrize("q_dtype", [jnp.bfloat16, jnp.float32], ids=["q-bf16", "q-f32"])
@pytest.mark.parametrize("dtype", FP8, ids=fp8_id)
@pytest.mark.parametrize("heads", HEADS, ids=lambda h: f"{h[0]}q{h[1]}kv-d{h[2]}")
def test_native_kernel_matches_dense_and_reference_on_fp8_pools(heads, dtype, q_dtype, kind):
    hq, hkv, d = heads
    kw = dict(num_q_heads=hq, num_kv_heads=hkv, head_dim=d, block_size=16, dtype=q_dtype, kv_dtype=dtype,
              k_scale=0.25, v_scale=3.0, seed=hq + d)
    if kind == "decode":
        case = decode_case([1, 16, 17, 40, 70], num_padding_seqs=1, num_padding_tokens=1, **kw)
    elif kind == "prefill":
        case = prefill_case([(20, 20), (41, 17), (64, 5)], **kw)
    else:  # decodes beside prompt chunks in one batch, as the engine's mixed steps
        case = build_case([(20, 20), (41, 1), (7, 1), (64, 5)], **kw)
    out = native_fn(*case.args, **case.kwargs())
    check(case, out)
    ref = np.asarray(reference(*case.args, **case.kwargs()).astype(jnp.float32))
    np.testing.assert_allclose(np.asarray(out.astype(jnp.float32)), ref, **tolerance(q_dtype))


@needs_native
def test_native_kernel_sliding_window_and_soft_cap_on_an_fp8_pool():
    case = prefill_case([(40, 40), (70, 9)], **GEMMA3_HEADS, dtype=jnp.bfloat16, kv_dtype=E4M3, k_scale=2.0)
    check(case, native_fn(*case.args, **case.kwargs(sliding_window=11, soft_cap=3.0)), sliding_window=11,
          soft_cap=3.0)


def finite_values(dtype) -> np.ndarray:
    """Every finite value of an fp8 format (each bit pattern once; 254 for e4m3fn, 248 for e5m2), float32."""
    values = np.arange(256, dtype=np.uint8).view(ml_dtypes.finfo(dtype).dtype).astype(np.float32)
    return values[np.isfinite(values)]


@needs_native
@pytest.mark.parametrize("q_dtype", [jnp.bfloat16, jnp.float32], ids=["bf16-registers", "f32-table"])
@pytest.mark.parametrize("dtype", FP8, ids=fp8_id)
def test_native_kernel_converts_every_fp8_value_exactly(dtype, q_dtype):
    """A query that sees one key only gets that key's V row back exactly (softmax weight 1; every fp8 value is exact
    in bfloat16). The row holds every finite value of the format: a decode (the per-token item) and the first token
    of a prompt tile (the tile item) read it through each of the kernel's conversions."""
    values = finite_values(dtype)
    d = 256
    row = np.zeros(d, np.float32)
    row[:len(values)] = values
    pool = np.full((1, 3, 16, 1, d), np.nan, np.float32)  # [L, NB, BS, Hkv, D]; NaN where nothing lives
    pool[0, 1, 0, 0] = row  # block 1, offset 0: the first (and for the decode only) position
    pool[0, 1, 1, 0] = 0.0
    v = jnp.asarray(pool, dtype)
    k = jnp.asarray(np.where(np.isnan(pool), np.nan, 0.0), dtype)  # scores 0: one visible key gets weight 1
    tables = jnp.array([[1]], jnp.int32)
    q = jnp.ones((2, 4, d), q_dtype)
    # decode: token 0 at position 0, context 1
    out = native_fn(q[:1], k, v, 0, tables, jnp.array([1], jnp.int32), jnp.array([0, 1], jnp.int32),
                    jnp.array([0], jnp.int32), scale=0.0625)
    np.testing.assert_array_equal(np.asarray(out.astype(jnp.float32))[0], np.tile(row, (4, 1)))
    # a prompt of 2 tokens (a tile): token 0 sees position 0 only
    out = native_fn(q, k, v, 0, tables, jnp.array([2], jnp.int32), jnp.array([0, 2], jnp.int32),
                    jnp.array([0, 1], jnp.int32), scale=0.0625)
    np.testing.assert_array_equal(np.asarray(out.astype(jnp.float32))[0], np.tile(row, (4, 1)))


@needs_native
@pytest.mark.parametrize("dtype", FP8, ids=fp8_id)
def test_native_writes_and_block_copies_keep_fp8_bytes(dtype):
    rng = np.random.default_rng(3)
    pool = jnp.zeros((2, 5, 4, 2, 8), dtype)
    k_new = jnp.asarray(rng.standard_normal((3, 2, 8)) * 300, jnp.bfloat16)  # some beyond e4m3's 448
    v_new = jnp.asarray(rng.standard_normal((3, 2, 8)), jnp.bfloat16)
    slots = jnp.array([5, 0, 19], jnp.int32)
    k, v = jax.jit(native.write_kv_native)(pool, pool, 1, k_new, v_new, slots)
    k_ref, v_ref = write_kv_reference(pool, pool, 1, k_new, v_new, slots)
    assert k.dtype == dtype
    np.testing.assert_array_equal(np.asarray(k).view(np.uint8), np.asarray(k_ref).view(np.uint8))
    np.testing.assert_array_equal(np.asarray(v).view(np.uint8), np.asarray(v_ref).view(np.uint8))
    # copy-on-write / swap-in: whole blocks, every layer, byte for byte
    k2, v2 = native.set_blocks_native(k, v, jnp.array([3], jnp.int32), k[:, 1:2], v[:, 1:2])
    np.testing.assert_array_equal(np.asarray(k2[:, 3]).view(np.uint8), np.asarray(k[:, 1]).view(np.uint8))
    np.testing.assert_array_equal(np.asarray(v2[:, 3]).view(np.uint8), np.asarray(v[:, 1]).view(np.uint8))


@needs_native
def test_native_auto_backend_takes_fp8_pools_natively():
    """native_else_reference (the engine's CPU attention) sends an fp8 pool to the native kernel with the queries as
    they are (bfloat16 or float32), not to the reference."""
    case = decode_case([5, 17], dtype=jnp.bfloat16, kv_dtype=E5M2, v_scale=2.0)
    fn = functools.partial(native.native_else_reference, **case.kwargs())
    assert native.target_name("JaxpagedPagedAttention") in str(jax.make_jaxpr(fn)(*case.args))
    check(case, jax.jit(fn)(*case.args))


@needs_native
def test_native_kernel_refuses_a_pool_of_another_dtype_than_q_unless_fp8():
    case = decode_case([5], dtype=jnp.float32)
    with pytest.raises(ValueError, match="one dtype"):
        native.paged_attention_native(case.q, case.k_cache.astype(jnp.bfloat16), case.v_cache.astype(jnp.bfloat16),
                                      *case.args[3:], scale=0.1)
    with pytest.raises(ValueError, match="one dtype"):
        native.paged_attention_native(case.q, case.k_cache.astype(E4M3), case.v_cache.astype(E5M2),
                                      *case.args[3:], scale=0.1)


# ---- the Pallas kernels over fp8 pools: interpreted here, lowered for their devices --------------------------------

@pytest.mark.parametrize("dtype", FP8, ids=fp8_id)
@pytest.mark.parametrize("impl", ["pallas_interpret", "pallas_tpu_interpret"], ids=["gpu", "tpu"])
def test_pallas_kernels_read_fp8_pools(impl, dtype):
    from pallas_kernels.attention import paged_attention

    extra = {"chunk_tokens": 32} if impl == "pallas_tpu_interpret" else {}
    fn = jax.jit(functools.partial(paged_attention, implementation=impl, **extra), static_argnames=STATIC)
    kw = dict(num_q_heads=9, num_kv_heads=3, head_dim=64, block_size=16, dtype=jnp.bfloat16, kv_dtype=dtype,
              k_scale=0.5, v_scale=2.0)
    dec = decode_case([1, 16, 17, 40], num_padding_seqs=1, seed=5, **kw)
    check(dec, fn(*dec.args, **dec.kwargs(decode_blocks=dec.decode_blocks)))
    pre = prefill_case([(20, 20), (41, 17)], seed=6, **{**kw, **GEMMA3_HEADS})
    check(pre, fn(*pre.args, **pre.kwargs()))


@pytest.mark.parametrize("dtype", FP8, ids=fp8_id)
@pytest.mark.parametrize("heads", [(9, 3, 64), (4, 1, 256)], ids=["smollm2", "gemma3"])
def test_pallas_kernels_lower_for_cuda_and_tpu_with_fp8_pools(heads, dtype):
    """jax.export runs the Pallas -> Triton and Pallas -> Mosaic TPU lowerings on fp8 pools (the fp8 loads and their
    conversion to bfloat16 in the kernel); the device compile itself needs the device."""
    import warnings

    from jax import export

    from pallas_kernels.attention import paged_attention
    from tests.hlo_checks import TRITON_CALL_TARGETS

    hq, hkv, d = heads
    sds = jax.ShapeDtypeStruct
    pool = sds((2, 64, 16, hkv, d), dtype)
    args = (sds((32, hq, d), jnp.bfloat16), pool, pool, sds((), jnp.int32), sds((32, 8), jnp.int32),
            sds((32,), jnp.int32), sds((33,), jnp.int32), sds((32,), jnp.int32), sds((), jnp.float32),
            sds((), jnp.float32))

    def fn(implementation):
        def call(q, k, v, layer, tables, lens, qsl, pos, k_scale, v_scale):
            return paged_attention(q, k, v, layer, tables, lens, qsl, pos, scale=d ** -0.5, decode_blocks=64,
                                   k_scale=k_scale, v_scale=v_scale, implementation=implementation)
        return jax.jit(call)

    checks = [export.DisabledSafetyCheck.custom_call(t) for t in TRITON_CALL_TARGETS]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        cuda = export.export(fn("pallas_gpu"), platforms=["cuda"], disabled_checks=checks)(*args)
    assert "f8E" in cuda.mlir_module()  # the kernel takes the fp8 pool as it is
    device = jax.sharding.AbstractDevice(device_kind="TPU v5 lite", num_cores=1, platform="tpu")
    with jax.sharding.use_abstract_mesh(jax.sharding.AbstractMesh((1,), ("x",), abstract_device=device)):
        tpu_exported = export.export(fn("pallas_tpu"), platforms=["tpu"])(*args)
    assert tpu_exported.mlir_module().count("@tpu_custom_call(") == 1


# ---- TPU, compile only (libtpu's compile-only client; skipped without the libtpu package) ------------------------

@pytest.fixture(scope="module")
def v5e():
    pytest.importorskip("libtpu")
    from jax.experimental import topologies

    return topologies.get_topology_desc(platform="tpu", topology_name="v5e:2x2").devices[0]


@pytest.mark.parametrize("dtype", FP8, ids=fp8_id)
@pytest.mark.parametrize("shape", ["decode", "prefill"])
def test_tpu_step_with_an_fp8_pool_compiles_without_copying_it(v5e, shape, dtype):
    """The engine's whole step (the scaled, key-rotating fp8 write by XLA's scatter, the Pallas TPU kernel reading
    fp8) compiled by libtpu for a v5e with the row-major pool: one kernel launch, no copy of the pool."""
    from flax import nnx

    from jaxpaged.models import families
    from jaxpaged.worker.attention import KVPool, PagedAttention
    from jaxpaged.worker.input_batch import StepLayout
    from jaxpaged.worker.kv_pool import pool_format
    from jaxpaged.worker.kv_quant import KVScales
    from jaxpaged.worker.step import jit_step, lower_step
    from pallas_kernels.attention import paged_attention
    from tests.hlo_checks import TPU_KERNEL, pool_copies
    from tests.kernels.tpu_step import BLOCK_SIZE, NUM_BLOCKS, STEP_SHAPES, TINY
    from tests.tiny import random_params, tiny_config

    config = tiny_config(**TINY)
    sharding = jax.sharding.SingleDeviceSharding(v5e)
    fmt = pool_format(v5e)
    graphdef, state = nnx.split(families.from_params(config, random_params(config)))
    leaves, treedef = jax.tree.flatten(jax.tree.map(
        lambda x: jax.ShapeDtypeStruct(x.shape, jnp.bfloat16 if x.dtype == np.float32 else x.dtype,
                                       sharding=sharding), state))
    pool_shape = (config.num_layers, NUM_BLOCKS, BLOCK_SIZE, config.num_kv_heads, config.head_dim)
    pool = jax.ShapeDtypeStruct(pool_shape, dtype, sharding=fmt)
    layout = StepLayout(*STEP_SHAPES[shape])
    s = layout.num_seqs

    def arg(*dims, dt=jnp.int32):
        return jax.ShapeDtypeStruct(dims, dt, sharding=sharding)

    extras = (arg(s, 3), arg(s, 64), arg(s, 300), arg(s, 300, dt=jnp.float32))
    attn = PagedAttention("pallas_tpu", functools.partial(paged_attention, implementation="pallas_tpu"),
                          kv_scales=KVScales((0.5, 2.0), (1.0, 4.0)))  # per-layer scales: a traced gather
    step_fn = jit_step(graphdef, treedef, attn, fmt, max_rows=s)
    hlo = lower_step(step_fn, tuple(leaves), KVPool(pool, pool), arg(s), layout, extras).compile().as_text()
    assert hlo.count(TPU_KERNEL) == 1
    assert pool_copies(hlo, pool_shape) == []
    dims = ",".join(map(str, pool_shape))  # nor converts the whole pool around the write (XLA CPU's fp8 scatter does)
    assert not [line for line in hlo.splitlines() if f"[{dims}]" in line and " convert(" in line]
