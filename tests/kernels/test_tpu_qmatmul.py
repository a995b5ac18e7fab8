"""The Pallas TPU quantized matmul (pallas_kernels/tpu_qmatmul.py) against the weights that
`jaxpaged.models.quant.dequantize` gives, without a TPU:
  * `interpret=True` (Pallas' interpreter on CPU) for the values: every block format, M in {1, 7, 64, 300} (M padded
    to whole tiles of 16 rows or more), K not a multiple of the kernel's K chunk (96: one short chunk; 570: the codes
    padded to 576, a chunk of 512 and a short one; x's last 6 columns do not exist), N not a multiple of the N tile
    (200 against 128: a partial edge block, sliced off outside), the layer of a stacked weight read in place (the
    other layers' scales are NaN). Interpret mode does not pad: the wrapper pads x (zeros past M and K) and the
    output (sliced), never the weight;
  * lowering: `jax.export(platforms=['tpu'])` under an abstract TPU mesh (the Pallas -> Mosaic lowering);
  * compiling: libtpu's compile-only client for v5e and v6e at Llama-3-8B's and SmolLM2's shapes (skipped without
    the `libtpu` package: run in /work/fusion-venv, see tests/kernels/test_quant_fusion.py). What the engine's layer
    loop becomes with the kernel is tests/kernels/test_quant_fusion.py.
"""

from __future__ import annotations

import functools
import math
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxpaged.models import quant
from pallas_kernels import tpu_qmatmul
from tests.hlo_checks import TPU_KERNEL, computations, dot_ops
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


@functools.cache
def run(bits: int, pair: bool, tile=None):
    return jax.jit(functools.partial(tpu_qmatmul.qmatmul_tpu, bits=bits, pair=pair, tile=tile, interpret=True))


@pytest.mark.parametrize("m", [1, 7, 64, 300])
@pytest.mark.parametrize("fmt", BLOCK_FORMATS)
def test_kernel_is_x_times_the_dequantized_layer(fmt, m):
    """K = 96: one chunk of three blocks; N = 200: a partial N tile; M padded to whole tiles."""
    qw = layered_weight(fmt, 96, 200, seed=m)
    x = jnp.asarray(np.random.default_rng(m + 1).standard_normal((m, qw.k)), jnp.bfloat16)
    check_layer_product(qw, x, run(**kernel_args(qw))(x, qw.codes, qw.scales, LAYER))


@pytest.mark.parametrize("fmt", ["q8_0", "q4_0", "q4_1", "q4_k"])
def test_a_ragged_k_over_several_chunks(fmt):
    """K = 570 (18 blocks, codes padded to 576): a chunk of 512 k and one of 64; bf16 and f32 x (f32: multiplied
    with Precision.HIGHEST)."""
    qw = layered_weight(fmt, 570, 200, seed=3)
    rng = np.random.default_rng(4)
    for dtype in (jnp.bfloat16, jnp.float32):
        x = jnp.asarray(rng.standard_normal((9, qw.k)), dtype)
        check_layer_product(qw, x, run(**kernel_args(qw))(x, qw.codes, qw.scales, LAYER))


@pytest.mark.parametrize("fmt", ["q8_0", "q4_0", "q4_1", "q4_k"])
def test_codes_taken_n_minor(fmt):
    """N = 256 with K = 570 (576 or 288 code bytes a row, not a multiple of 128): the kernel takes the codes as
    [L, Kp * bits / 8, N] (`codes_kn`, XLA TPU's layout of them) over two N tiles and two K chunks."""
    qw = layered_weight(fmt, 570, 256, seed=18)
    assert tpu_qmatmul.codes_kn(qw.codes.shape[-1], qw.n)
    x = jnp.asarray(np.random.default_rng(19).standard_normal((5, qw.k)), jnp.bfloat16)
    check_layer_product(qw, x, run(**kernel_args(qw), tile=(16, 128))(x, qw.codes, qw.scales, LAYER))


@pytest.mark.parametrize("fmt", ["q8_0", "q4_k"])
def test_several_m_and_n_tiles(fmt):
    """tile (16, 128): M = 40 is three M tiles, N = 300 three N tiles (the last partial)."""
    qw = layered_weight(fmt, 96, 300, seed=5)
    x = jnp.asarray(np.random.default_rng(6).standard_normal((40, qw.k)), jnp.bfloat16)
    check_layer_product(qw, x, run(**kernel_args(qw), tile=(16, 128))(x, qw.codes, qw.scales, LAYER))


def test_an_unstacked_weight():
    """2-D codes [N, ...] are one layer."""
    qw = layered_weight("q4_0", 64, 48, seed=7)
    x = jnp.asarray(np.random.default_rng(8).standard_normal((3, qw.k)), jnp.bfloat16)
    check_layer_product(qw, x, run(4, False)(x, qw.codes[LAYER], qw.scales[LAYER], 0))


def test_the_layer_is_read_in_place():
    """Reading layer 0 (NaN scales) gives NaN everywhere: the scalar-prefetched layer picks the blocks."""
    qw = layered_weight("q8_0", 64, 48, seed=9)
    x = jnp.ones((2, qw.k), jnp.bfloat16)
    assert np.isnan(np.asarray(run(8, False)(x, qw.codes, qw.scales, 0))).all()
    assert not np.isnan(np.asarray(run(8, False)(x, qw.codes, qw.scales, LAYER))).any()


def test_float16_bits_become_their_float32_values_exactly():
    """Every one of the 65536 float16 bit patterns (normals, subnormals, zeros, infinities, NaN)."""
    bits = np.arange(1 << 16, dtype=np.uint16)
    want = bits.view(np.float16).astype(np.float32)
    got = np.asarray(jax.jit(tpu_qmatmul._f16_bits_to_f32)(jnp.asarray(bits)))
    nan = np.isnan(want)
    assert (np.isnan(got) == nan).all()
    np.testing.assert_array_equal(got[~nan].view(np.uint32), want[~nan].view(np.uint32))  # -0.0 included


def test_scale_expansion_is_exact_for_float16_and_float32_scales():
    """The 0/1-matrix expansion returns each stored scale bit for bit (sums of bfloat16 parts)."""
    rng = np.random.default_rng(10)
    for dtype, parts in ((np.float16, 2), (np.float32, 3)):
        s = (rng.standard_normal((8, 4)) * 10.0 ** rng.integers(-6, 3, (8, 4))).astype(dtype).astype(np.float32)
        e = tpu_qmatmul._expansion(4, 128, 32)
        out = sum(jnp.dot(p, e, preferred_element_type=jnp.float32)
                  for p in tpu_qmatmul._bf16_parts(jnp.asarray(s), parts))
        np.testing.assert_array_equal(np.asarray(out), np.repeat(s, 32, axis=1))


@pytest.mark.parametrize("change, message", [
    (dict(bits=5), "bits=5 is not supported"),
    (dict(pair=True), r"scales must be \[3, 48, 2, 2\] for pair=True"),
    (dict(x_cols=100), "x has K=100 columns but codes hold 2 blocks"),
    (dict(tile=(8, 128)), "tm must be a multiple of 16"),
    (dict(tile=(16, 64)), "tn of 128"),
    (dict(x_dtype=jnp.float16), "x must be bfloat16 or float32"),
])
def test_bad_arguments_are_clear_errors(change, message):
    qw = layered_weight("q8_0", 64, 48, seed=10)
    x = jnp.ones((2, change.pop("x_cols", qw.k)), change.pop("x_dtype", jnp.bfloat16))
    kwargs = dict(bits=8, pair=False) | change
    with pytest.raises(ValueError, match=message):
        tpu_qmatmul.qmatmul_tpu(x, qw.codes, qw.scales, 0, interpret=True, **kwargs)


def test_tiles_fit_the_vmem_budget():
    """At Llama-3-8B's down projection (K = 14336) in bf16 and f32, and small shapes: legal tiles whose
    double-buffered x and codes blocks stay under VMEM_BUDGET."""
    for m in (1, 7, 16, 17, 256, 300, 2048):
        for kp, n, bits, itemsize in ((14336, 4096, 8, 2), (14336, 4096, 4, 4), (4096, 14336, 8, 2), (576, 100, 4, 2)):
            tm, tn = tpu_qmatmul.tiles(m, kp, n, bits, itemsize, pair=True)
            assert tm % 16 == 0 and tn % 128 == 0 and tm <= max(16, -(-m // 16) * 16)
            scales = 2 * -(-kp // 32 // 128) * 128 * 4
            assert 2 * (tm * kp * itemsize + tn * (kp * bits // 8 + scales)) + 2 * tm * tn * 4 \
                <= tpu_qmatmul.VMEM_BUDGET


# ---- lowering and compiling for TPU without one ----------------------------------------------------------------------

BIG = {"llama3-8b gate/up": (4096, 14336), "llama3-8b down": (14336, 4096), "smollm2 gate/up": (576, 1536)}


def _args(fmt: str, k: int, n: int, m: int, layers: int = 4, sharding=None):
    bits, mode = FORMS[fmt]
    sds = functools.partial(jax.ShapeDtypeStruct, sharding=sharding)
    pair = mode != quant.BLOCK_SYM
    scales = sds((layers, n, k // 32, 2) if pair else (layers, n, k // 32),
                 jnp.float32 if mode == quant.BLOCK_F32 else jnp.float16)
    return (sds((m, k), jnp.bfloat16), sds((layers, n, k * bits // 8), jnp.uint8), scales, sds((), jnp.int32))


def _fn(fmt: str):
    bits, mode = FORMS[fmt]
    return jax.jit(functools.partial(tpu_qmatmul.qmatmul_tpu, bits=bits, pair=mode != quant.BLOCK_SYM))


@pytest.mark.parametrize("fmt", ["q8_0", "q4_0", "q4_1", "q4_k"])
@pytest.mark.parametrize("m", [1, 2048])
def test_kernel_lowers_for_tpu_without_a_tpu(fmt, m):
    """jax.export(platforms=['tpu']) runs the Pallas -> Mosaic lowering at Llama-3-8B's down projection: one
    kernel call on the whole stack of codes; the only dynamic-slice is the layer's scales."""
    from jax import export

    device = jax.sharding.AbstractDevice(device_kind="TPU v5 lite", num_cores=1, platform="tpu")
    with jax.sharding.use_abstract_mesh(jax.sharding.AbstractMesh((1,), ("x",), abstract_device=device)):
        module = export.export(_fn(fmt), platforms=["tpu"])(*_args(fmt, 14336, 4096, m)).mlir_module()
    assert module.count("@tpu_custom_call(") == 1
    slices = re.findall(r"stablehlo.dynamic_slice .*-> (tensor<[^>]*>)", module)
    pair = {"q4_1": "x2xf16", "q4_k": "x2xf32"}.get(fmt, "xf16")
    assert slices == [f"tensor<1x4096x448{pair}>"]  # the layer's scales, not its codes


@pytest.fixture(scope="module", params=["v5e", "v6e"])
def tpu_device(request):
    pytest.importorskip("libtpu")
    from jax.experimental import topologies

    return topologies.get_topology_desc(platform="tpu", topology_name=f"{request.param}:2x2").devices[0]


def written_arrays(hlo: str) -> list[tuple[int, str]]:
    """(elements, line) of every array the entry computation writes, but parameters, bitcasts, tuples and XLA TPU's
    moves of a parameter into VMEM (S(1)): cross-program prefetches, async slices of it and their concatenation (in
    its own layout: XLA's placement of a small stack that a kernel reads more than once, not a re-layout)."""
    (entry,) = [name for name in computations(hlo) if f"ENTRY %{name} " in hlo]
    lines = computations(hlo)[entry]
    params = {re.match(r"\s*%\S+ = (\S+) parameter", line).group(1) for line in lines if " parameter(" in line}
    out = []
    for line in lines:
        m = re.match(r"\s*(?:ROOT )?%\S+ = ((\w+)\[([\d,]*)\]\S*) ([\w\-]+)\(", line)
        if not m or m.group(4) in ("parameter", "bitcast", "constant"):
            continue
        if "S(1)" in m.group(1) and (m.group(4) == "slice-done"  # an async slice of a parameter into VMEM
                                     or m.group(1).replace("S(1)", "").replace(":)", ")") in params):
            continue
        out.append((math.prod(int(d) for d in m.group(3).split(",") if d), line.strip()[:160]))
    return out


@pytest.mark.parametrize("m", [1, 8, 256, 2048])
@pytest.mark.parametrize("shape", list(BIG))
@pytest.mark.parametrize("fmt", ["q8_0", "q4_0", "q4_1", "q4_k"])
def test_kernel_compiles_for_tpu_with_no_full_width_weight(tpu_device, fmt, shape, m):
    """libtpu's compile-only client runs Mosaic's passes (layouts, VMEM) and XLA:TPU: one kernel call reading the
    whole uint8 stack, and nothing else written bigger than one layer's scales or an activation-sized array (x
    padded and permuted, the output). Temp bytes alone would not show it: XLA TPU may place a buffer in VMEM
    (S(1)), outside `temp_size_in_bytes`."""
    k, n = BIG[shape]
    sharding = jax.sharding.SingleDeviceSharding(tpu_device)
    compiled = _fn(fmt).lower(*_args(fmt, k, n, m, sharding=sharding)).compile()
    hlo = compiled.as_text()
    assert hlo.count(TPU_KERNEL) == 1
    (call,) = [op for op in dot_ops(hlo) if "tpu_custom_call" in op.kind]
    bits = FORMS[fmt][0]
    assert any(o.dtype == "u8" and o.size == 4 * n * k * bits // 8 for o in call.operands)  # the stack, unsliced
    mp = -(-m // 16) * 16
    limit = max(n * (k // 32) * 2, mp * k, mp * n)  # one layer's (s, m) / x / the output
    assert [line for size, line in written_arrays(hlo) if size > limit] == []
    assert compiled.memory_analysis().temp_size_in_bytes <= n * k * 2 // 8 + 2 * mp * k * 2


# ---- the engine's plain-layout matmul on TPU (jaxpaged.models.quant._plain_matmul) ---------------------------------


@pytest.mark.parametrize("fmt", BLOCK_FORMATS)
def test_the_engine_passes_the_stack_layer_and_format_to_the_kernel(monkeypatch, fmt):
    """quant's TPU branch (`_tpu_kernel_matmul`), the kernel run by the interpreter: the same product as the
    dequantize-then-dot branch the CPU runs, from the stacked arrays and the layer."""
    monkeypatch.setattr(tpu_qmatmul, "qmatmul_tpu", functools.partial(tpu_qmatmul.qmatmul_tpu, interpret=True))
    check_engine_branch(quant._tpu_kernel_matmul, fmt)


@pytest.mark.parametrize("fmt", BLOCK_FORMATS)
def test_on_tpu_the_layer_loop_calls_the_kernel_where_xla_would_not_fuse(fmt):
    """Lowered for TPU, the models' layer loop runs the Mosaic kernel for the 8-bit block formats at any row count
    and for the 4-bit ones above NIBBLE_MAX_ROWS (at or below it, XLA's fused uint4 form); for CPU never."""
    from jax import export

    from jaxpaged.models.matmul import layer_matmul

    qw = jax.tree.map(jnp.asarray, random_weight(np.random.default_rng(13), fmt, 4, 256, 512))

    def lowered(platform, rows):
        def run(x):
            def body(i, acc):
                return acc + layer_matmul(x, qw, i)
            return jax.lax.fori_loop(0, 4, body, jnp.zeros((x.shape[0], qw.n), x.dtype))

        x = jax.ShapeDtypeStruct((rows, qw.k), jnp.bfloat16)
        return export.export(jax.jit(run), platforms=[platform])(x).mlir_module()

    for rows in (8, quant.NIBBLE_MAX_ROWS + 1):
        tpu = lowered("tpu", rows)
        kernel = qw.bits == 8 or rows > quant.NIBBLE_MAX_ROWS
        assert tpu.count("@tpu_custom_call(") == (1 if kernel else 0)
        assert ("xui4>" in tpu) == (not kernel)
        if kernel:
            assert f"tensor<4x512x{256 * qw.bits // 8}xui8>" in tpu
    assert "tpu_custom_call" not in lowered("cpu", 8)


@pytest.mark.parametrize("split", ["columns", "rows"])
@pytest.mark.parametrize("fmt", ["q8_0", "q4_k"])
def test_under_tensor_parallelism_the_kernel_runs_on_each_chips_shard(fmt, split):
    """Compiled for 4 TPU v5e chips (deviceless; skipped without libtpu): inside `partitioned_products`, a layer
    product of a weight split by columns or by rows (`quant.split_specs`, as the engine places it) is the Mosaic
    kernel on each chip's shard, 128 rows (above NIBBLE_MAX_ROWS, so Q4_K takes the kernel too): no gather of the
    codes, and an all-reduce only after a row split."""
    pytest.importorskip("libtpu")
    from jax.experimental import topologies
    from jax.sharding import Mesh, NamedSharding
    from jax.sharding import PartitionSpec as P

    from jaxpaged.models.matmul import layer_matmul

    devices = topologies.get_topology_desc(platform="tpu", topology_name="v5e:2x2").devices
    mesh = Mesh(np.asarray(devices[:4]), ("tp",))
    qw = random_weight(np.random.default_rng(3), fmt, 4, 1024, 1024)
    specs = quant.split_specs(qw, split, 4, "tp")
    qw = qw.replace(**{name: jax.ShapeDtypeStruct(getattr(qw, name).shape, getattr(qw, name).dtype,
                                                  sharding=NamedSharding(mesh, getattr(specs, name)))
                       for name in ("codes", "scales")})
    x = jax.ShapeDtypeStruct((128, 1024), jnp.bfloat16,
                             sharding=NamedSharding(mesh, P() if split == "columns" else P(None, "tp")))

    def run(x, qw):
        with quant.partitioned_products(mesh):
            return layer_matmul(x, qw, 1, split)

    hlo = jax.jit(run).lower(x, qw).compile().as_text()
    assert hlo.count(TPU_KERNEL) >= 1 and not re.search(r" all-gather(-start)?\(", hlo)
    assert len(re.findall(r" all-reduce(-start)?\(", hlo)) == (0 if split == "columns" else 1)
