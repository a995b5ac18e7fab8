"""Kept-quantized weights on GPU and TPU: does XLA's compiler put the dequantization inside the dot?

Compiled for devices that are not here (deviceless AOT), from ShapeDtypeStructs: nothing is allocated or run.
  * TPU v5e: libtpu's compile-only client (skipped when the `libtpu` package is not importable). The block formats
    XLA TPU does not fuse run the Pallas Mosaic kernel pallas_kernels/tpu_qmatmul.py there.
  * GPU H100: the CUDA PJRT plugin with benchmarks/target_configs/h100_sxm.txtpb (skipped when no plugin compiles
    for it here: `jax-cuda12-plugin` and the nvidia wheels' ptxas are not the project's dependencies). Without a
    driver, run with JAX_PLATFORMS=cpu, or the plugin's start-up fails (cuInit) and the GPU tests skip:
    `JAX_PLATFORMS=cpu /work/fusion-venv/bin/python -m pytest tests/kernels/test_quant_fusion.py` (a venv made as
    docs/quantization.md says).
What is compiled is the engine's layer loop (`layer_glu` / `layer_matmul` over a stacked quantized weight in a
fori_loop, as the models call them). A weight counts as fused when the fusion that runs its dot takes the uint8
codes and no full-width [N, K] float operand, and the module's temporary buffers stay under one [N, K] bf16 weight.
benchmarks/quant_fusion.py measures the same at real shapes for every format (docs/quantization.md has the table).
"""

from __future__ import annotations

import os

import jax
import jax.numpy as jnp
import pytest

from jaxpaged.models import quant
from jaxpaged.models.matmul import layer_glu, layer_matmul
from tests import ROOT
from tests.hlo_checks import dot_ops, full_width_writes
from tests.quant_weights import FORMS

LAYERS, K, N, ROWS = 4, 256, 512, 8
KEPT = ["int8", "q8_0", "q4_0", "q4_1", "q4_k"]  # the formats the engine keeps from files or makes (int8)


@pytest.fixture(scope="module")
def tpu_device():
    pytest.importorskip("libtpu")
    from jax.experimental import topologies

    return topologies.get_topology_desc(platform="tpu", topology_name="v5e:2x2").devices[0]


@pytest.fixture(scope="module")
def gpu_device():
    from jax.experimental import topologies

    with open(os.path.join(ROOT, "benchmarks", "target_configs", "h100_sxm.txtpb")) as f:
        config = f.read()
    try:
        return topologies.get_topology_desc(platform="cuda", topology="1x1x1", target_config=config).devices[0]
    except Exception as e:  # no CUDA plugin here (the project's own environment has none)
        pytest.skip(f"no deviceless CUDA compile here: {type(e).__name__}: {str(e)[:120]}")


def abstract_weight(fmt: str, sharding, k: int = K, n: int = N):
    """A stacked [LAYERS, K, N] weight as the engine keeps it (plain layout), as ShapeDtypeStructs."""
    bits, mode = FORMS[fmt]
    blocks = k // quant.BLOCK
    scales = {quant.CHANNEL: ((LAYERS, n), jnp.float32), quant.BLOCK_SYM: ((LAYERS, n, blocks), jnp.float16),
              quant.BLOCK_F16: ((LAYERS, n, blocks, 2), jnp.float16),
              quant.BLOCK_F32: ((LAYERS, n, blocks, 2), jnp.float32)}[mode]
    return quant.QuantizedWeight(jax.ShapeDtypeStruct((LAYERS, n, k * bits // 8), jnp.uint8, sharding=sharding),
                                 jax.ShapeDtypeStruct(*scales, sharding=sharding), bits, mode, (LAYERS, k, n),
                                 compute_dtype="bfloat16")


def compile_layer_loop(device, fmt: str, kind: str, rows: int = ROWS):
    """The models' layer loop around one gated pair (`glu`) or one matrix, compiled for `device`."""
    sharding = jax.sharding.SingleDeviceSharding(device)
    ws = [abstract_weight(fmt, sharding) for _ in range(2 if kind == "glu" else 1)]

    def run(x, *ws):
        def body(i, acc):
            return acc + (layer_glu(x, ws[0], ws[1], i, "silu") if kind == "glu" else layer_matmul(x, ws[0], i))
        return jax.lax.fori_loop(0, LAYERS, body, jnp.zeros((x.shape[0], N), x.dtype))

    x = jax.ShapeDtypeStruct((rows, K), jnp.bfloat16, sharding=sharding)
    return jax.jit(run).lower(x, *ws).compile()


# ---- TPU (v5e) ------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("kind", ["glu", "matmul"])
@pytest.mark.parametrize("fmt", ["int8", "q4_0", "q4_1", "q4_k"])
def test_tpu_dot_fusion_reads_the_codes_and_no_full_width_weight_exists(tpu_device, fmt, kind):
    """On TPU the layer loop's matmul fusion reads the uint8 codes (dynamic-sliced inside it) and dequantizes them
    itself: no instruction writes an [N, K] float array, and the module's temporaries stay under one [N, K] bf16."""
    compiled = compile_layer_loop(tpu_device, fmt, kind)
    hlo = compiled.as_text()
    assert full_width_writes(hlo, N, K) == []
    readers = [op for op in dot_ops(hlo) if op.reads_codes(N, K, FORMS[fmt][0])]
    assert len(readers) == (2 if kind == "glu" else 1)
    assert all(op.full_width_operands(N, K) == [] for op in readers)
    assert "convolution" in readers[0].inner_ops and "convert" in readers[0].inner_ops
    assert compiled.memory_analysis().temp_size_in_bytes < N * K * 2


@pytest.mark.parametrize("rows", [1, 8, 100])
@pytest.mark.parametrize("kind", ["glu", "matmul"])
@pytest.mark.parametrize("fmt", ["q8_0", "q4_0", "q4_1", "q4_k"])
def test_tpu_block_formats_run_the_pallas_kernel_on_the_stacked_codes(tpu_device, fmt, kind, rows):
    """Where XLA TPU would write the weight at full width (Q8_0 at every row count, the 4-bit formats above
    `quant.NIBBLE_MAX_ROWS`), each matrix's product is one Pallas Mosaic kernel call (pallas_kernels/tpu_qmatmul.py)
    whose codes operand is the whole stack (the loop's parameter, not a dynamic-slice), nothing writes an [N, K]
    float array, and the temporaries stay under a quarter of one [N, K] bf16 weight. Below the threshold the 4-bit
    formats keep `_nibble_matmul` (the test above)."""
    if FORMS[fmt][0] == 4 and rows <= quant.NIBBLE_MAX_ROWS:
        pytest.skip("fused by XLA (_nibble_matmul): the test above")
    compiled = compile_layer_loop(tpu_device, fmt, kind, rows=rows)
    hlo = compiled.as_text()
    assert full_width_writes(hlo, N, K) == []
    calls = [op for op in dot_ops(hlo) if op.kind == "custom-call tpu_custom_call"]
    assert len(calls) == (2 if kind == "glu" else 1)
    for op in calls:
        (codes,) = [o for o in op.operands if o.dtype == "u8"]
        assert codes.size == LAYERS * N * K * FORMS[fmt][0] // 8
    assert compiled.memory_analysis().temp_size_in_bytes < N * K * 2 // 4


def test_tpu_q8_0_without_the_kernel_broadcasts_its_block_scales_to_full_width(tpu_device, monkeypatch):
    """Why Q8_0 has a kernel on TPU: dequantize-then-dot (`quant._dense_matmul`) compiled by XLA TPU (libtpu 0.0.42):
    the float16 block scales are converted and broadcast to an [N, K] float32 array of their own before the dot (the
    codes themselves are read inside the fusion). If this fails, XLA fuses it now: the kernel may no longer be
    needed (docs/quantization.md, "Where it is multiplied")."""
    def dense(x, qw, codes, scales, layer=None):
        codes, scales = (codes, scales) if layer is None else (codes[layer], scales[layer])
        return quant._dense_matmul(x, codes, scales, qw=qw)

    monkeypatch.setattr(quant, "_plain_matmul", dense)
    hlo = compile_layer_loop(tpu_device, "q8_0", "matmul").as_text()
    writes = full_width_writes(hlo, N, K)
    assert writes and all(w.startswith("f32[") and " broadcast " in w for w in writes)


# ---- GPU (H100) -----------------------------------------------------------------------------------------------------


def test_gpu_one_row_product_reads_the_codes(gpu_device):
    """At one row XLA GPU turns int8's product into a reduction, and its fusion dequantizes the codes itself."""
    hlo = compile_layer_loop(gpu_device, "int8", "matmul", rows=1).as_text()
    assert full_width_writes(hlo, N, K) == []
    assert any(op.reads_codes(N, K, 8) and "reduce" in op.inner_ops for op in dot_ops(hlo))


@pytest.mark.parametrize("rows", [1, 8, 100])  # (not 256: [256, N] activations would look like an [N, K] weight)
@pytest.mark.parametrize("kind", ["glu", "matmul"])
@pytest.mark.parametrize("fmt", ["q8_0", "q4_0", "q4_1", "q4_k"])
def test_gpu_block_formats_run_the_pallas_kernel_on_the_stacked_codes(gpu_device, fmt, kind, rows):
    """The GGUF block formats on CUDA (`quant._kernel_matmul`, pallas_kernels/gpu_qmatmul.py), compiled for an H100
    (Triton -> PTX inside XLA's compile): each matrix's product is one Triton custom call whose operand is the whole
    stack of codes (a bitcast of the loop's parameter, not a dynamic-slice or a fusion's output), nothing writes an
    [N, K] float array, and the module's temporaries are the kernels' float32 outputs (M padded to its tile) plus
    less than a quarter of one [N, K] bf16 weight."""
    from pallas_kernels.gpu_qmatmul import tiles
    from tests.hlo_checks import TRITON_CALL_TARGETS

    compiled = compile_layer_loop(gpu_device, fmt, kind, rows=rows)
    hlo = compiled.as_text()
    assert full_width_writes(hlo, N, K) == []
    calls = [op for op in dot_ops(hlo) if op.kind.removeprefix("custom-call ") in TRITON_CALL_TARGETS]
    assert len(calls) == (2 if kind == "glu" else 1)
    for op in calls:
        (codes,) = [o for o in op.operands if o.dtype == "u8"]
        assert codes.size == LAYERS * N * K * FORMS[fmt][0] // 8
        assert codes.producer in ("parameter", "get-tuple-element", "while") or codes.producer.startswith("param")
    tm = tiles(rows)[0]
    outputs = len(calls) * -(-rows // tm) * tm * N * 4
    assert compiled.memory_analysis().temp_size_in_bytes < outputs + N * K * 2 // 4


def test_gpu_int8_gemm_reads_signed_codes(gpu_device):
    """int8 per channel on CUDA (`quant._signed_channel_matmul`): the Triton GEMM fusion reads int8 codes and no
    float [N, K] array is written. What is written first is the layer's codes as signed int8 (u ^ 128: one byte per
    weight, half a bf16 weight; codes stored signed at load would spare it)."""
    compiled = compile_layer_loop(gpu_device, "int8", "matmul")
    hlo = compiled.as_text()
    assert full_width_writes(hlo, N, K) == []
    gemms = [op for op in dot_ops(hlo) if op.reads_codes(N, K, 8)]
    assert len(gemms) == 1 and "triton" in gemms[0].kind
    assert any(o.dtype == "s8" and o.size == N * K for o in gemms[0].operands)
    assert compiled.memory_analysis().temp_size_in_bytes < N * K * 2


@pytest.mark.parametrize("fmt", ["q8_0", "q4_0", "q4_1", "q4_k"])
def test_gpu_gemm_without_the_kernel_takes_a_full_width_weight_written_by_another_fusion(gpu_device, fmt,
                                                                                         monkeypatch):
    """Why the block formats have a kernel on CUDA: dequantize-then-dot (`quant._dense_matmul`, what every other
    platform runs) compiled by XLA GPU (jaxlib 0.10.2, H100) at 8 rows: the Triton GEMM fusion takes a bf16 [N, K]
    weight that a loop fusion wrote from the uint8 codes (its GEMM fusion accepts only a bare convert of signed s8 /
    s4 codes, and block scales cannot wait until after the dot). If this fails, XLA fuses it now: the kernel may
    no longer be needed (docs/quantization.md, "Where it is multiplied")."""
    def dense(x, qw, codes, scales, layer=None):
        codes, scales = (codes, scales) if layer is None else (codes[layer], scales[layer])
        return quant._dense_matmul(x, codes, scales, qw=qw)

    monkeypatch.setattr(quant, "_plain_matmul", dense)
    compiled = compile_layer_loop(gpu_device, fmt, "matmul")
    hlo = compiled.as_text()
    writes = full_width_writes(hlo, N, K)
    assert writes and all(w.startswith("bf16[") for w in writes)
    gemms = [op for op in dot_ops(hlo) if op.full_width_operands(N, K)]
    assert gemms and all("triton" in op.kind and not op.reads_codes(N, K, FORMS[fmt][0]) for op in gemms)
    assert compiled.memory_analysis().temp_size_in_bytes >= N * K * 2


def test_gpu_gemm_fuses_a_bare_signed_int8_convert(gpu_device):
    """The contrast that shows what the GEMM fusion does take: x @ convert(s8 codes) with the scale after the dot,
    one [N, K] int8 matrix, reads the codes inside the Triton GEMM and writes no full-width array."""
    sharding = jax.sharding.SingleDeviceSharding(gpu_device)

    def product(x, q, s):
        w = q.astype(jnp.bfloat16)
        return jax.lax.dot_general(x, w, (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32) * s

    args = (jax.ShapeDtypeStruct((ROWS, K), jnp.bfloat16, sharding=sharding),
            jax.ShapeDtypeStruct((N, K), jnp.int8, sharding=sharding),
            jax.ShapeDtypeStruct((N,), jnp.float32, sharding=sharding))
    hlo = jax.jit(product).lower(*args).compile().as_text()
    assert full_width_writes(hlo, N, K) == []
    assert any("triton" in op.kind and op.reads_codes(N, K, 8) for op in dot_ops(hlo))
