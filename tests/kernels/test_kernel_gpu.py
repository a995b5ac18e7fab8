"""The Pallas GPU kernel (gpu.py) against float64 dense attention and the reference: compiled for the GPU where JAX's
default backend is one, else in interpret mode (it lowers for CUDA without a GPU:
tests/kernels/test_attention_backends.py).

Pools are small on purpose: interpret-mode cost grows with grid steps x pool size. Each case's pool is NaN wherever no
real context lives (tests/kernels/attention_cases.py). Tolerances: float32 2e-5, bfloat16 2e-2.
"""

from __future__ import annotations

import functools
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental import pallas as pl

import pallas_kernels.gpu as gpu
from pallas_kernels.attention import IMPLEMENTATIONS, paged_attention
from tests.hlo_checks import TRITON_CALL_TARGETS
from tests.kernels.attention_cases import GEMMA3_HEADS, build_case, decode_case, prefill_case, shape_args, tolerance

ON_GPU = jax.default_backend() == "gpu"
INTERPRET = not ON_GPU  # the interpreter on CPU / TPU hosts, the compiled Triton kernel on a GPU
STATIC = ("scale", "tile_size", "sliding_window", "soft_cap", "decode_blocks")
kernel = jax.jit(functools.partial(paged_attention, implementation="pallas_interpret" if INTERPRET else "pallas_gpu"),
                   static_argnames=STATIC)
reference = jax.jit(functools.partial(paged_attention, implementation="reference"), static_argnames=STATIC)

# (context_len, q_len): whole prompts (one exactly a tile, one a single token), chunked-prefill steps, a decode.
PREFILL_SEQS = [(20, 20), (16, 16), (1, 1), (41, 17), (64, 5), (30, 1)]


def check(case, out, **masking):
    """Valid rows match float64 dense attention, padding rows are exactly 0, and no NaN anywhere."""
    out = np.asarray(out.astype(jnp.float32))
    assert out.shape == case.q.shape
    assert not np.isnan(out).any(), "NaN from unused pool slots (or an unwritten row) reached the output"
    np.testing.assert_allclose(out, case.expected(**masking), **tolerance(case.dtype))
    np.testing.assert_array_equal(out[~case.valid_tokens], 0.0)


DECODE_CONFIGS = [  # (q heads, kv heads, head_dim, block_size)
    (6, 2, 64, 16),  # GQA 3, not a power of two
    (8, 1, 128, 32),  # GQA 8, head_dim 128, block 32
    (4, 4, 64, 8),  # GQA 1, block 8
    (4, 1, 256, 16),  # Gemma 3: GQA 4 onto one kv head, head_dim 256
]


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=["f32", "bf16"])
@pytest.mark.parametrize("config", DECODE_CONFIGS, ids=lambda c: f"{c[0]}q{c[1]}kv-d{c[2]}-bs{c[3]}")
def test_kernel_matches_dense_on_a_ragged_decode_batch(config, dtype):
    hq, hkv, d, bs = config
    lens = [1, bs, bs + 1, 64, 29]  # 1 token, exactly a block, a block + 1, a full block table (64 tokens)
    case = decode_case(lens, num_q_heads=hq, num_kv_heads=hkv, head_dim=d, block_size=bs, dtype=dtype,
                       num_padding_seqs=2, num_padding_tokens=2, seed=hq + bs)
    check(case, kernel(*case.args, **case.kwargs(decode_blocks=case.decode_blocks)))


PREFILL_CONFIGS = [  # (q heads, kv heads, head_dim, block_size)
    (6, 2, 64, 8),  # GQA 3: 16 tokens x 4 padded heads = 64 rows per program
    (8, 1, 128, 16),  # GQA 8: 16 x 8 = 128 rows, the largest tile
    (32, 1, 64, 32),  # GQA 32: a 16-token tile runs as four 4-token programs
    (4, 1, 256, 16),  # Gemma 3: 16 tokens x 4 heads = 64 rows of head_dim 256
]


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=["f32", "bf16"])
@pytest.mark.parametrize("config", PREFILL_CONFIGS, ids=lambda c: f"{c[0]}q{c[1]}kv-d{c[2]}-bs{c[3]}")
def test_kernel_matches_dense_on_prefill_tiles_with_chunked_prefill(config, dtype):
    hq, hkv, d, bs = config
    case = prefill_case(PREFILL_SEQS, num_q_heads=hq, num_kv_heads=hkv, head_dim=d, block_size=bs, dtype=dtype,
                        num_padding_seqs=1, num_padding_tokens=16, seed=hq * bs)
    check(case, kernel(*case.args, **case.kwargs()))


def test_kernel_agrees_with_the_reference():
    case = prefill_case(PREFILL_SEQS, num_q_heads=6, num_kv_heads=2, block_size=16, num_padding_seqs=1, seed=11)
    np.testing.assert_allclose(np.asarray(kernel(*case.args, **case.kwargs())),
                               np.asarray(reference(*case.args, **case.kwargs())), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("window", [1, 7, 40])
def test_kernel_sliding_window(window):
    prefill = prefill_case(PREFILL_SEQS, num_q_heads=6, num_kv_heads=2, block_size=8, seed=12)
    check(prefill, kernel(*prefill.args, **prefill.kwargs(sliding_window=window)), sliding_window=window)
    decode = decode_case([1, 8, 9, 64, 29], num_q_heads=6, num_kv_heads=2, block_size=8, num_padding_seqs=1, seed=13)
    check(decode, kernel(*decode.args, **decode.kwargs(sliding_window=window)), sliding_window=window)


def test_kernel_soft_cap():
    case = prefill_case(PREFILL_SEQS[:4], num_q_heads=4, num_kv_heads=2, block_size=16, seed=14)
    case.q = case.q * 8  # large logits, so the cap matters
    check(case, kernel(*case.args, **case.kwargs(soft_cap=5.0)), soft_cap=5.0)


def test_kernel_reads_the_given_layer_of_the_stacked_pool():
    case = decode_case([5, 33], num_q_heads=4, num_kv_heads=2, block_size=16, num_layers=3, layer=2, seed=15)
    check(case, kernel(*case.args, **case.kwargs()))
    # Layer 0 holds only NaN, so the same batch read from layer 0 gives NaN on every real token.
    case.layer = 0
    assert np.isnan(np.asarray(kernel(*case.args, **case.kwargs()))[case.valid_tokens]).all()


def _poisoned_pallas_call(real_pallas_call):
    """pallas_call whose output buffers start as NaN (aliased to NaN inputs), as uninitialised GPU memory may."""

    def pallas_call(body, *, out_shape, **kwargs):
        shapes = out_shape if isinstance(out_shape, tuple) else (out_shape,)

        def run(*args):
            def body_with_init(*refs):
                split = len(refs) - 2 * len(shapes)
                body(*refs[:split], *refs[split + len(shapes):])  # inputs, then the outputs (not the NaN inits)

            aliases = {len(args) + i: i for i in range(len(shapes))}
            call = real_pallas_call(body_with_init, out_shape=out_shape, input_output_aliases=aliases, **kwargs)
            return call(*args, *(jnp.full(s.shape, jnp.nan, s.dtype) for s in shapes))

        return run

    return pallas_call


@pytest.mark.parametrize("splits", [1, 4])
def test_every_output_row_is_written(monkeypatch, splits):
    """With the output buffers poisoned, rows of real and padding tokens alike come back finite (written)."""
    monkeypatch.setattr(gpu.pl, "pallas_call", _poisoned_pallas_call(pl.pallas_call))
    case = build_case([(170, 1), (9, 9), (40, 3)], num_q_heads=6, num_kv_heads=2, block_size=8, tile_size=1,
                      num_padding_seqs=2, num_padding_tokens=3, seed=16)
    check(case, gpu.ragged_paged_attention_gpu(*case.args, **case.kwargs(), num_kv_splits=splits, interpret=INTERPRET))
    # The poison is real: a kernel that writes nothing leaves every row NaN.
    monkeypatch.setattr(gpu, "_paged_attention_kernel", lambda *refs, **_: None)
    out = gpu.ragged_paged_attention_gpu(*case.args, **case.kwargs(), num_kv_splits=splits, interpret=INTERPRET)
    assert np.isnan(np.asarray(out)).all()


# Contexts of several 64-token chunks, so that every split has work, some splits none (1 chunk, 3 splits), and
# shares end mid-block.
SPLIT_DECODE_LENS = [1, 8, 9, 64, 65, 150, 257]


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=["f32", "bf16"])
@pytest.mark.parametrize("splits", [2, 3, 16])
def test_kernel_splits_a_decode_context_over_programs(splits, dtype):
    """Flash-decoding: each split's partial softmax, merged by log-sum-exp, equals attention over the whole context."""
    case = decode_case(SPLIT_DECODE_LENS, num_q_heads=6, num_kv_heads=2, head_dim=64, block_size=16, dtype=dtype,
                       num_padding_seqs=1, num_padding_tokens=1, seed=20 + splits)
    check(case, gpu.ragged_paged_attention_gpu(*case.args, **case.kwargs(), num_kv_splits=splits, interpret=INTERPRET))


def test_split_prefill_tiles_and_sliding_window():
    """Splits apply to prefill tiles too, and a window's lower edge (tile_lo > 0) is split like the rest."""
    prefill = prefill_case([(150, 20), (100, 100), (70, 1)], num_q_heads=4, num_kv_heads=2, block_size=8,
                           num_padding_seqs=1, seed=23)
    check(prefill, gpu.ragged_paged_attention_gpu(*prefill.args, **prefill.kwargs(), num_kv_splits=4,
                                                  interpret=INTERPRET))
    decode = decode_case(SPLIT_DECODE_LENS, num_q_heads=4, num_kv_heads=2, block_size=8, seed=24)
    out = gpu.ragged_paged_attention_gpu(*decode.args, **decode.kwargs(sliding_window=100), num_kv_splits=4,
                                         interpret=INTERPRET)
    check(decode, out, sliding_window=100)


@pytest.mark.parametrize("splits", [1, 4])
def test_kernel_gemma3_heads_with_a_sliding_window(splits):
    """Gemma 3's local layers: one kv head, head_dim 256, a window shorter than the contexts, with and without
    flash-decoding splits (a split may lie wholly outside the window)."""
    prefill = prefill_case([(150, 20), (40, 40), (70, 1)], **GEMMA3_HEADS, block_size=16, num_padding_seqs=1,
                           seed=40)
    check(prefill, gpu.ragged_paged_attention_gpu(*prefill.args, **prefill.kwargs(sliding_window=33),
                                                  num_kv_splits=splits, interpret=INTERPRET), sliding_window=33)
    decode = decode_case(SPLIT_DECODE_LENS, **GEMMA3_HEADS, block_size=16, num_padding_seqs=1, seed=41)
    check(decode, gpu.ragged_paged_attention_gpu(*decode.args, **decode.kwargs(sliding_window=100),
                                                 num_kv_splits=splits, interpret=INTERPRET), sliding_window=100)


def test_default_splits_fill_the_device_only_when_the_batch_does_not(monkeypatch):
    assert gpu.default_kv_splits(num_programs=8 * 8, chunks_per_seq=128) == 8  # batch 8 x 8 kv heads: 512 programs
    assert gpu.default_kv_splits(num_programs=2, chunks_per_seq=1000) == gpu.MAX_KV_SPLITS
    assert gpu.default_kv_splits(num_programs=64, chunks_per_seq=3) == 2  # every split keeps a chunk
    assert gpu.default_kv_splits(num_programs=64, chunks_per_seq=1) == 1
    assert gpu.default_kv_splits(num_programs=128 * 8, chunks_per_seq=128) == 1  # a big batch fills the device
    assert gpu.default_kv_splits(num_programs=32 * 8, chunks_per_seq=128) == 1  # the merge costs more (H100)
    assert gpu.default_kv_splits(num_programs=100, chunks_per_seq=128) == 8  # doubled until 512 programs or more
    # The wrapper estimates a sequence's chunks from decode_blocks (blocks in use) when given, else the table width.
    case = decode_case([5, 9], num_q_heads=2, num_kv_heads=1, block_size=16, width=64, seed=25)
    seen = []
    monkeypatch.setattr(gpu, "default_kv_splits", lambda n, chunks: seen.append((n, chunks)) or 1)
    gpu.ragged_paged_attention_gpu(*case.args, **case.kwargs(), interpret=INTERPRET)
    gpu.ragged_paged_attention_gpu(*case.args, **case.kwargs(decode_blocks=2), interpret=INTERPRET)
    assert seen == [(2, 64 * 16 // 64), (2, 1)]  # 2 tiles x 1 kv head; 16 chunks of the table, 1 in use
    with pytest.raises(ValueError, match="num_kv_splits=0 must be >= 1"):
        gpu.ragged_paged_attention_gpu(*case.args, **case.kwargs(), num_kv_splits=0, interpret=INTERPRET)


@pytest.mark.parametrize("change, message", [
    (dict(block_size=12), "block_size=12 is not supported.*8, 16, 32"),
    (dict(head_dim=48), "head_dim=48 is not supported.*64, 128"),
], ids=["block_size", "head_dim"])
def test_unsupported_shapes_are_clear_errors(change, message):
    with pytest.raises(ValueError, match=message):
        gpu.ragged_paged_attention_gpu(*shape_args(**change), scale=0.1, interpret=INTERPRET)


def test_token_count_must_be_a_multiple_of_the_tile():
    case = decode_case([3], num_q_heads=2, num_kv_heads=1, block_size=16, num_padding_tokens=2)
    with pytest.raises(ValueError, match="num_tokens=3 must be a multiple of tile_size=16"):
        gpu.ragged_paged_attention_gpu(*case.args, scale=0.1, tile_size=16, interpret=INTERPRET)


def test_dispatcher_names_its_implementations():
    case = decode_case([3, 20], num_q_heads=4, num_kv_heads=2, block_size=16, seed=17)
    np.testing.assert_allclose(np.asarray(paged_attention(*case.args, **case.kwargs(), implementation="reference")),
                               case.expected(), **tolerance(jnp.float32))
    with pytest.raises(ValueError, match="implementation='cuda' is not known.*pallas_gpu"):
        paged_attention(*case.args, **case.kwargs(), implementation="cuda")
    assert {"reference", "pallas_gpu", "pallas_tpu", "pallas_interpret"} <= set(IMPLEMENTATIONS)


# The custom call Pallas' Triton lowering emits: XLA's Triton call up to jaxlib 0.10.2, a precompiled kernel after.
ENGINE_SHAPES = [  # (q heads, kv heads, head_dim): SmolLM2-135M, a Llama-3-8B-like model, Gemma 3 270M; block 16
    (9, 3, 64),
    (32, 8, 128),
    (4, 1, 256),
]


@pytest.mark.parametrize("tile_size, num_tokens, num_seqs, splits",
                         [(1, 32, 32, None), (1, 4, 4, 8), (16, 256, 16, None)],
                         ids=["decode", "decode-split", "prefill"])
@pytest.mark.parametrize("heads", ENGINE_SHAPES, ids=lambda h: f"{h[0]}q{h[1]}kv-d{h[2]}")
def test_kernel_lowers_for_cuda_without_a_gpu(heads, tile_size, num_tokens, num_seqs, splits):
    """jax.export(platforms=['cuda']) runs the Pallas -> Triton lowering, which enforces Triton's static rules."""
    from jax import export

    hq, hkv, d = heads
    layers, blocks, block_size, width = 2, 64, 16, 8
    sds = jax.ShapeDtypeStruct
    pool = sds((layers, blocks, block_size, hkv, d), jnp.bfloat16)
    args = (sds((num_tokens, hq, d), jnp.bfloat16), pool, pool, sds((), jnp.int32),
            sds((num_seqs, width), jnp.int32), sds((num_seqs,), jnp.int32), sds((num_seqs + 1,), jnp.int32),
            sds((num_tokens,), jnp.int32))
    fn = jax.jit(functools.partial(paged_attention, scale=d ** -0.5, tile_size=tile_size,
                                   decode_blocks=64 if tile_size == 1 else None, num_kv_splits=splits,
                                   implementation="pallas_gpu"))
    # Triton calls carry no serialization-compatibility guarantee; only the lowering is wanted here.
    checks = [export.DisabledSafetyCheck.custom_call(t) for t in TRITON_CALL_TARGETS]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)  # "jax-pallas-triton" from JAX 0.11
        exported = export.export(fn, platforms=["cuda"], disabled_checks=checks)(*args)
    module = exported.mlir_module()
    assert exported.platforms == ("cuda",)
    assert sum(module.count(f"@{t}(") for t in TRITON_CALL_TARGETS) == 1  # one launch for the whole batch
    # No XLA while loop around it: a GPU's host waits on the device at every iteration of one (gpu.SEQUENCE_SEARCH).
    assert "stablehlo.while" not in module


def test_engine_with_the_pallas_backend_gives_the_reference_tokens():
    from tests.tiny import greedy_tokens, random_params, random_prompts, tiny_config

    config = tiny_config(hidden=48, heads=6, kv_heads=2, head_dim=16, layers=1)
    params = random_params(config)
    prompts = random_prompts(3, 3, 20, seed=9)
    assert (greedy_tokens(config, params, prompts, attention_backend="pallas", max_tokens=6)
            == greedy_tokens(config, params, prompts, attention_backend="reference", max_tokens=6))
