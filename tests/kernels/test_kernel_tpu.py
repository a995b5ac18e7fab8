"""The Pallas TPU kernel (tpu.py) against float64 dense attention and the reference, without a TPU.

Three ways in:
  * `interpret=True` (Pallas' generic interpreter: DMAs complete at once) for the shape and masking sweeps;
  * `pltpu.InterpretParams(detect_races=True)` (the TPU interpreter: DMAs run only when waited on, scratch and
    output buffers start as NaN, a happens-before race detector watches every buffer) on a few tiny batches, to
    catch DMA / semaphore ordering bugs that the first mode hides;
  * lowering: `jax.export(platforms=['tpu'])` under an abstract TPU mesh, which runs the Pallas -> Mosaic lowering
    and its checks ("Loads are only allowed on VMEM and SMEM", ...) at the engine's shapes. When the `libtpu`
    package is importable, the kernel is also compiled by libtpu's compile-only TPU client (Mosaic's own passes,
    VMEM budgets) for a v5e topology; that test is skipped otherwise.

Pools are NaN wherever no real context lives, block tables are shuffled (tests/kernels/attention_cases.py). Most sweeps
run with chunk_tokens=32 so that a context spans several double-buffered chunks and the interpreted kernel compiles
fast; one mixed batch (prefill tiles and decodes) uses the default 128-token chunk. Both interpreters start the output
buffer as NaN, so "no NaN in the output" also proves every row was written. Tolerances: float32 2e-5, bfloat16 2e-2
against the float64 answer (bfloat16 rounds the softmax weights before p @ V); 1e-5 between kernel and reference in
float32.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental.pallas import tpu as pltpu

import pallas_kernels.tpu as tpu
from pallas_kernels.attention import paged_attention
from pallas_kernels.reference import ragged_paged_attention_reference
from tests.kernels.attention_cases import GEMMA3_HEADS, build_case, decode_case, prefill_case, shape_args, tolerance

STATIC = ("scale", "tile_size", "sliding_window", "soft_cap", "decode_blocks", "chunk_tokens", "interpret")
# The interpreted kernel is a large XLA program: without backend optimisation it compiles in half the time.
FAST_COMPILE = {"xla_backend_optimization_level": 0}
kernel = jax.jit(functools.partial(tpu.ragged_paged_attention_tpu, interpret=True), static_argnames=STATIC,
                 compiler_options=FAST_COMPILE)
tpu_interpreted = jax.jit(tpu.ragged_paged_attention_tpu, static_argnames=STATIC, compiler_options=FAST_COMPILE)
reference = jax.jit(ragged_paged_attention_reference, static_argnames=STATIC[:5])
SMALL_CHUNK = 32  # tokens per K/V chunk in the sweeps: several chunks per sequence

# (context_len, q_len): whole prompts (one exactly a tile, one a single token), chunked-prefill steps, a decode.
PREFILL_SEQS = [(20, 20), (16, 16), (1, 1), (41, 17), (64, 5), (30, 1)]


def check(case, out, **masking):
    """Valid rows match float64 dense attention, padding rows are exactly 0, and no NaN anywhere."""
    out = np.asarray(out.astype(jnp.float32))
    assert out.shape == case.q.shape
    assert not np.isnan(out).any(), "NaN from unused pool slots (or an unwritten row) reached the output"
    np.testing.assert_allclose(out, case.expected(**masking), **tolerance(case.dtype))
    np.testing.assert_array_equal(out[~case.valid_tokens], 0.0)


DECODE_CONFIGS = [  # (q heads, kv heads, head_dim, block_size, dtype)
    (9, 3, 64, 16, jnp.float32),  # SmolLM2: GQA 3, not a power of two, 3 kv heads (not a multiple of 8 rows)
    (9, 3, 64, 16, jnp.bfloat16),
    (8, 1, 128, 32, jnp.float32),  # GQA 8 (MQA), head_dim 128, block 32
    (4, 4, 64, 8, jnp.bfloat16),  # GQA 1, block 8
    (4, 1, 256, 16, jnp.float32),  # Gemma 3: GQA 4 onto one kv head, head_dim 256
    (4, 1, 256, 16, jnp.bfloat16),
]


@pytest.mark.parametrize("config", DECODE_CONFIGS, ids=lambda c: f"{c[0]}q{c[1]}kv-d{c[2]}-bs{c[3]}-"
                         f"{jnp.dtype(c[4]).name}")
def test_kernel_matches_dense_on_a_ragged_decode_batch(config):
    hq, hkv, d, bs, dtype = config
    lens = [1, bs, bs + 1, 64, 29]  # 1 token, exactly a block, a block + 1, a full block table (64 tokens)
    case = decode_case(lens, num_q_heads=hq, num_kv_heads=hkv, head_dim=d, block_size=bs, dtype=dtype,
                       num_padding_seqs=2, num_padding_tokens=2, seed=hq + bs)
    check(case, kernel(*case.args, **case.kwargs(decode_blocks=case.decode_blocks), chunk_tokens=SMALL_CHUNK))


PREFILL_CONFIGS = [  # (q heads, kv heads, head_dim, block_size, dtype)
    (9, 3, 64, 16, jnp.float32),  # 16 tokens x 3 heads = 48 rows per kv head
    (8, 1, 128, 8, jnp.bfloat16),  # 16 x 8 = 128 rows, bf16 rows padded to 16
    (32, 1, 64, 32, jnp.float32),  # GQA 32: a 16-token tile runs as two 8-token programs of 256 rows
    (4, 1, 256, 16, jnp.bfloat16),  # Gemma 3: 16 tokens x 4 heads = 64 rows of head_dim 256
]


@pytest.mark.parametrize("config", PREFILL_CONFIGS, ids=lambda c: f"{c[0]}q{c[1]}kv-d{c[2]}-bs{c[3]}-"
                         f"{jnp.dtype(c[4]).name}")
def test_kernel_matches_dense_on_prefill_tiles_with_chunked_prefill(config):
    hq, hkv, d, bs, dtype = config
    case = prefill_case(PREFILL_SEQS, num_q_heads=hq, num_kv_heads=hkv, head_dim=d, block_size=bs, dtype=dtype,
                        num_padding_seqs=1, num_padding_tokens=16, seed=hq * bs)
    check(case, kernel(*case.args, **case.kwargs(), chunk_tokens=SMALL_CHUNK))


def test_kernel_with_the_default_chunk_agrees_with_the_reference():
    """The production chunk (128 tokens, one DMA per block) on a mixed batch: prefill chunks and decodes."""
    case = build_case(PREFILL_SEQS + [(150, 1)], num_q_heads=6, num_kv_heads=2, block_size=16, tile_size=16,
                      num_padding_seqs=1, seed=11)
    out = kernel(*case.args, **case.kwargs())
    check(case, out)
    np.testing.assert_allclose(np.asarray(out), np.asarray(reference(*case.args, **case.kwargs())),
                               rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("window", [1, 40])
def test_kernel_sliding_window(window):
    """The window skips whole blocks at the start of long contexts (tile_lo > 0) and masks inside a block."""
    case = build_case([(64, 1), (9, 1), (50, 17), (1, 1)], num_q_heads=6, num_kv_heads=2, block_size=8,
                      tile_size=1, num_padding_seqs=1, seed=12)
    check(case, kernel(*case.args, **case.kwargs(sliding_window=window), chunk_tokens=16), sliding_window=window)


def test_kernel_gemma3_heads_with_a_sliding_window():
    """Gemma 3's local layers: one kv head, head_dim 256, a window that skips whole chunks of long contexts."""
    case = build_case([(150, 1), (9, 1), (70, 17), (1, 1)], **GEMMA3_HEADS, block_size=16, tile_size=1,
                      num_padding_seqs=1, seed=42)
    check(case, kernel(*case.args, **case.kwargs(sliding_window=40), chunk_tokens=SMALL_CHUNK), sliding_window=40)


def test_kernel_soft_cap():
    case = prefill_case(PREFILL_SEQS[:4], num_q_heads=4, num_kv_heads=2, block_size=16, seed=14)
    case.q = case.q * 8  # large logits, so the cap matters
    check(case, kernel(*case.args, **case.kwargs(soft_cap=5.0), chunk_tokens=SMALL_CHUNK), soft_cap=5.0)


def test_kernel_reads_the_given_layer_of_the_stacked_pool():
    case = decode_case([5, 33], num_q_heads=4, num_kv_heads=2, block_size=16, num_layers=3, layer=2, seed=15)
    check(case, kernel(*case.args, **case.kwargs(), chunk_tokens=SMALL_CHUNK))
    # Layer 0 holds only NaN, so the same batch read from layer 0 gives NaN on every real token.
    case.layer = 0
    assert np.isnan(np.asarray(kernel(*case.args, **case.kwargs(), chunk_tokens=SMALL_CHUNK))[case.valid_tokens]).all()


# --- the TPU interpreter: DMA timing, NaN-filled scratch and outputs, race detection ---------------------------------


@pytest.fixture
def tpu_interpreter():
    """TPU interpret parameters; the interpreter's global state is reset afterwards (it stays dirty after a failure)."""
    from jax._src.pallas.mosaic.interpret import interpret_pallas_call as interpreter_state  # .races: private

    yield pltpu.InterpretParams(detect_races=True, dma_execution_mode="on_wait", uninitialized_memory="nan"), \
        interpreter_state
    pltpu.reset_tpu_interpret_mode_state()


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=["f32", "bf16"])
def test_dma_ordering_under_the_tpu_interpreter(tpu_interpreter, dtype):
    """A padding sequence and tile between real ones, several chunks per context, the next tile's first chunk
    fetched by the previous program: every row is written (outputs start as NaN), nothing races."""
    params, state = tpu_interpreter
    case = build_case([(20, 3), (1, 1), (17, 1)], num_q_heads=6, num_kv_heads=3, head_dim=64, block_size=8,
                      tile_size=4, dtype=dtype, num_padding_seqs=1, num_padding_tokens=4, num_layers=1, layer=0,
                      spare_blocks=1, seed=21)
    out = tpu_interpreted(*case.args, **case.kwargs(), chunk_tokens=16, interpret=params)
    assert not state.races.races_found
    check(case, out)


def test_tpu_interpreter_poisons_unwritten_outputs(tpu_interpreter, monkeypatch):
    """The NaN poison above is real: a kernel that writes nothing leaves every row NaN."""
    params, _ = tpu_interpreter
    case = build_case([(5, 1), (9, 2)], num_q_heads=3, num_kv_heads=1, block_size=8, num_layers=1, layer=0,
                      spare_blocks=0, seed=22)
    monkeypatch.setattr(tpu, "_paged_attention_kernel", lambda *refs, **_: None)
    out = tpu.ragged_paged_attention_tpu(*case.args, **case.kwargs(), interpret=params)
    assert np.isnan(np.asarray(out)).all()


# --- validation ---------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("change, message", [
    (dict(block_size=12), "block_size=12 is not supported.*8, 16, 32"),
    (dict(head_dim=96), "head_dim=96 is not supported.*64, 128, 256"),
    (dict(dtype=jnp.float16), "dtype float16 is not supported.*float32 or bfloat16"),
    (dict(q_heads=4, kv_heads=3), "num_q_heads=4 must be a multiple of num_kv_heads=3"),
], ids=["block_size", "head_dim", "dtype", "heads"])
def test_unsupported_shapes_are_clear_errors(change, message):
    with pytest.raises(ValueError, match=message):
        tpu.ragged_paged_attention_tpu(*shape_args(**change), scale=0.1, interpret=True)


def test_token_count_must_be_a_multiple_of_the_tile():
    case = decode_case([3], num_q_heads=2, num_kv_heads=1, block_size=16, num_padding_tokens=2)
    with pytest.raises(ValueError, match="num_tokens=3 must be a multiple of tile_size=16"):
        tpu.ragged_paged_attention_tpu(*case.args, scale=0.1, tile_size=16, interpret=True)


def test_block_table_must_fit_in_smem():
    case = decode_case([3], num_q_heads=2, num_kv_heads=1, block_size=16)
    wide = jnp.zeros((2, tpu.MAX_TABLE_ENTRIES // 2 + 1), jnp.int32)
    args = list(case.args)
    args[4:7] = wide, jnp.array([3, 0], jnp.int32), jnp.array([0, 1, 1], jnp.int32)
    with pytest.raises(ValueError, match=r"block_tables\(2, 65537\) has 131074 entries.*at most 131072"):
        tpu.ragged_paged_attention_tpu(*args, **case.kwargs(), interpret=True)


def test_chunk_must_be_whole_blocks():
    case = decode_case([3], num_q_heads=2, num_kv_heads=1, block_size=16)
    with pytest.raises(ValueError, match="chunk_tokens=24 must be a positive multiple of block_size=16"):
        tpu.ragged_paged_attention_tpu(*case.args, **case.kwargs(), chunk_tokens=24, interpret=True)


# --- lowering and compiling for TPU without one ---------------------------------------------------------------------

ENGINE_SHAPES = [  # (q heads, kv heads, head_dim): SmolLM2-135M, a Llama-3-8B-like model, Gemma 3 270M; block 16
    (9, 3, 64),
    (32, 8, 128),
    (4, 1, 256),
]
BATCHES = [(1, 32, 32), (16, 256, 16)]  # (tile_size, num_tokens, num_seqs): a decode step and a prefill step


def _engine_args(heads, num_tokens, num_seqs, dtype, *, sharding=None, pool_sharding=None):
    """Abstract arguments at the engine's shapes (pool: 2 layers x 64 blocks of 16 tokens, 8-block tables)."""
    hq, hkv, d = heads
    sds = functools.partial(jax.ShapeDtypeStruct, sharding=sharding)
    pool = jax.ShapeDtypeStruct((2, 64, 16, hkv, d), dtype, sharding=pool_sharding or sharding)
    return (sds((num_tokens, hq, d), dtype), pool, pool, sds((), jnp.int32), sds((num_seqs, 8), jnp.int32),
            sds((num_seqs,), jnp.int32), sds((num_seqs + 1,), jnp.int32), sds((num_tokens,), jnp.int32))


def _engine_fn(heads, tile_size):
    return jax.jit(functools.partial(paged_attention, scale=heads[2] ** -0.5, tile_size=tile_size,
                                     implementation="pallas_tpu"))


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=["f32", "bf16"])
@pytest.mark.parametrize("batch", BATCHES, ids=["decode", "prefill"])
@pytest.mark.parametrize("heads", ENGINE_SHAPES, ids=lambda h: f"{h[0]}q{h[1]}kv-d{h[2]}")
def test_kernel_lowers_for_tpu_without_a_tpu(heads, batch, dtype):
    """jax.export(platforms=['tpu']) runs the Pallas -> Mosaic lowering and its memory-space and shape checks."""
    from jax import export

    tile_size, num_tokens, num_seqs = batch
    device = jax.sharding.AbstractDevice(device_kind="TPU v5 lite", num_cores=1, platform="tpu")
    with jax.sharding.use_abstract_mesh(jax.sharding.AbstractMesh((1,), ("x",), abstract_device=device)):
        exported = export.export(_engine_fn(heads, tile_size), platforms=["tpu"])(
            *_engine_args(heads, num_tokens, num_seqs, dtype))
    assert exported.platforms == ("tpu",)
    assert exported.mlir_module().count("@tpu_custom_call(") == 1  # one launch for the whole batch


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=["f32", "bf16"])
@pytest.mark.parametrize("batch", BATCHES, ids=["decode", "prefill"])
@pytest.mark.parametrize("heads", ENGINE_SHAPES, ids=lambda h: f"{h[0]}q{h[1]}kv-d{h[2]}")
def test_kernel_compiles_for_a_tpu_v5e_without_copying_the_pool(heads, batch, dtype):
    """libtpu's compile-only client runs Mosaic's passes (layouts, VMEM budget) and XLA:TPU on the whole call.

    The pool is given XLA's row-major layout: for head_dim 64 XLA's own default TPU layout puts the block axis
    minor-most, and the kernel's custom call would then copy the whole pool on every call. Needs `libtpu`.
    """
    pytest.importorskip("libtpu")
    from jax.experimental import topologies
    from jax.experimental.layout import Format, Layout

    tile_size, num_tokens, num_seqs = batch
    devices = topologies.get_topology_desc(platform="tpu", topology_name="v5e:2x2").devices
    sharding = jax.sharding.SingleDeviceSharding(devices[0])
    row_major = Format(Layout(major_to_minor=(0, 1, 2, 3, 4)), sharding)
    args = _engine_args(heads, num_tokens, num_seqs, dtype, sharding=sharding, pool_sharding=row_major)
    hlo = _engine_fn(heads, tile_size).lower(*args).compile().as_text()
    pool_shape = ",".join(map(str, args[1].shape))
    assert hlo.count("custom_call_target=\"tpu_custom_call\"") == 1
    assert not [line for line in hlo.splitlines() if f"[{pool_shape}]" in line and " copy(" in line]
