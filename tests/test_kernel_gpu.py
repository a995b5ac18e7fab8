"""The Pallas GPU kernel in interpret mode against the reference and dense attention; it lowers for CUDA here.

Tolerances: float32 2e-5 absolute, bfloat16 3e-2 (inputs rounded to bf16; softmax in float32 in both).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.attention import paged_attention
from pallas_kernels.reference import dense_causal_attention

TILE = 16


def make_case(rng, *, block_size, kv_heads, group, head_dim, q_lens, ctx_lens, dtype, decode):
    """A ragged batch over a shuffled pool whose unreferenced slots hold NaN."""
    L, nb = 2, 1 + sum(-(-c // block_size) for c in ctx_lens) + 3
    shape = (L, nb, block_size, kv_heads, head_dim)
    k = rng.standard_normal(shape).astype(np.float32)
    v = rng.standard_normal(shape).astype(np.float32)
    width = max(-(-c // block_size) for c in ctx_lens)
    perm = rng.permutation(np.arange(1, nb))
    tables = np.zeros((len(ctx_lens), width), np.int32)
    used = np.zeros(nb, bool)
    start = 0
    for s, c in enumerate(ctx_lens):
        n = -(-c // block_size)
        tables[s, :n] = perm[start:start + n]
        used[tables[s, :n]] = True
        start += n
        last = tables[s, n - 1]
        v[:, last, c - (n - 1) * block_size:] = np.nan  # slots past the context in the last block
    v[:, ~used] = np.nan
    v[:, 0] = np.nan  # the null block
    tile = 1 if decode else TILE
    seg = [max(tile, -(-q // tile) * tile) for q in q_lens]
    T = sum(seg) + (3 if decode else TILE)  # padding tokens past the last segment
    qsl = np.concatenate([[0], np.cumsum(seg)]).astype(np.int32)
    pos = np.full(T, -1, np.int32)
    for s, (q, c) in enumerate(zip(q_lens, ctx_lens, strict=True)):
        pos[qsl[s]:qsl[s] + q] = np.arange(c - q, c)
    q = rng.standard_normal((T, kv_heads * group, head_dim)).astype(np.float32)
    cast = lambda x: jnp.asarray(x, dtype)  # noqa: E731
    return dict(q=cast(q), k=cast(k), v=cast(v), tables=tables, ctx=np.asarray(ctx_lens, np.int32), qsl=qsl,
                pos=pos, tile=tile)


def run(case, implementation, layer=1):
    return paged_attention(case["q"], case["k"], case["v"], layer, jnp.asarray(case["tables"]),
                           jnp.asarray(case["ctx"]), jnp.asarray(case["qsl"]), jnp.asarray(case["pos"]),
                           scale=case["q"].shape[-1] ** -0.5, tile_size=case["tile"], implementation=implementation)


CASES = [  # (block_size, kv_heads, group, head_dim, q_lens, ctx_lens, decode)
    (16, 3, 3, 64, [1, 1, 1, 1], [1, 16, 17, 40], True),        # SmolLM2 heads; length 1, a block, a block + 1
    (8, 2, 1, 64, [1, 1], [8, 9], True),                        # MHA (group 1), block 8
    (32, 1, 8, 128, [1, 1, 1], [5, 32, 70], True),              # group 8, head_dim 128, block 32
    (16, 3, 3, 64, [5, 17, 1], [20, 41, 1], False),             # chunked prefill + a 1-token prompt
    (8, 2, 4, 64, [16, 9], [16, 30], False),                    # prefill exactly a tile; block 8
]


@pytest.mark.parametrize("dtype, tol", [(jnp.float32, 2e-5), (jnp.bfloat16, 3e-2)], ids=["f32", "bf16"])
@pytest.mark.parametrize("case_args", CASES, ids=[f"case{i}" for i in range(len(CASES))])
def test_kernel_matches_reference_and_dense(case_args, dtype, tol):
    bs, kvh, g, d, q_lens, ctx, decode = case_args
    case = make_case(np.random.default_rng(len(ctx) * 7 + bs), block_size=bs, kv_heads=kvh, group=g, head_dim=d,
                     q_lens=q_lens, ctx_lens=ctx, dtype=dtype, decode=decode)
    got = np.asarray(run(case, "pallas_interpret"), np.float32)
    want = np.asarray(run(case, "reference"), np.float32)
    assert not np.isnan(got).any(), "NaN from unused pool slots leaked into the output"
    assert np.abs(got - want).max() < tol
    pad = case["pos"] < 0
    assert np.all(got[pad] == 0)  # padding tokens
    for s, (q, c) in enumerate(zip(q_lens, ctx, strict=True)):  # every valid row, against dense attention
        blocks = case["tables"][s, :-(-c // bs)]
        k = np.asarray(case["k"], np.float32)[1, blocks].reshape(-1, kvh, d)[:c]
        v = np.asarray(case["v"], np.float32)[1, blocks].reshape(-1, kvh, d)[:c]
        rows = slice(case["qsl"][s], case["qsl"][s] + q)
        dense = dense_causal_attention(jnp.asarray(np.asarray(case["q"], np.float32)[rows]), jnp.asarray(k),
                                       jnp.asarray(v), scale=d ** -0.5)
        assert np.abs(got[rows] - np.asarray(dense)).max() < tol


def test_unsupported_block_size_is_a_clear_error():
    case = make_case(np.random.default_rng(0), block_size=16, kv_heads=1, group=1, head_dim=64, q_lens=[1],
                     ctx_lens=[4], dtype=jnp.float32, decode=True)
    k = jnp.zeros((2, 4, 12, 1, 64))
    with pytest.raises(ValueError, match="block_size=12 is not supported.*8, 16, 32"):
        paged_attention(case["q"], k, k, 0, jnp.asarray(case["tables"]), jnp.asarray(case["ctx"]),
                        jnp.asarray(case["qsl"]), jnp.asarray(case["pos"]), scale=0.1, implementation="pallas_gpu")


@pytest.mark.parametrize("heads, kv_heads, head_dim, tile", [(9, 3, 64, 1), (9, 3, 64, 16), (32, 8, 128, 1)])
def test_kernel_lowers_for_cuda_without_a_gpu(heads, kv_heads, head_dim, tile):
    """jax.export to platforms=['cuda'] runs the Pallas->Triton lowering at the engine's shapes."""
    import warnings

    from jax import export

    T, S, W, L, NB, BS = 64, 4, 8, 2, 40, 16
    args = (jax.ShapeDtypeStruct((T, heads, head_dim), jnp.bfloat16),
            jax.ShapeDtypeStruct((L, NB, BS, kv_heads, head_dim), jnp.bfloat16),
            jax.ShapeDtypeStruct((L, NB, BS, kv_heads, head_dim), jnp.bfloat16),
            jax.ShapeDtypeStruct((), jnp.int32), jax.ShapeDtypeStruct((S, W), jnp.int32),
            jax.ShapeDtypeStruct((S,), jnp.int32), jax.ShapeDtypeStruct((S + 1,), jnp.int32),
            jax.ShapeDtypeStruct((T,), jnp.int32))
    fn = jax.jit(lambda *a: paged_attention(*a, scale=0.125, tile_size=tile, implementation="pallas_gpu"))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        # the Triton call has no serialization-compatibility guarantee; we only want the lowering to succeed
        triton_call = export.DisabledSafetyCheck.custom_call("__gpu$xla.gpu.triton")
        exported = export.export(fn, platforms=["cuda"], disabled_checks=[triton_call])(*args)
    assert "__gpu$xla.gpu.triton" in exported.mlir_module()


def test_engine_with_the_pallas_backend_gives_the_reference_tokens():
    from jaxpaged import LLM, SamplingParams
    from tests.tiny import random_params, random_prompts, tiny_config

    config = tiny_config(hidden=48, heads=6, kv_heads=2, head_dim=16, layers=1)
    params = random_params(config)
    prompts = [{"prompt_token_ids": p} for p in random_prompts(3, 3, 20, seed=9)]
    sp = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    opts = dict(max_num_seqs=4, max_num_batched_tokens=64, max_model_len=64, block_size=8, num_blocks=40,
                precompile=False, show_progress=False)
    want = LLM.from_params(config, params, None, attention_backend="reference", **opts).generate(prompts, sp,
                                                                                                use_tqdm=False)
    got = LLM.from_params(config, params, None, attention_backend="pallas", **opts).generate(prompts, sp,
                                                                                            use_tqdm=False)
    assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in want]
