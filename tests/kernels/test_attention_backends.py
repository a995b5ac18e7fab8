"""The attention protocol of jaxpaged/attention.py: `attn(q, k, v, kv_pool, layer, md) -> (out, kv_pool)`.

A backend writes the step's new K/V into the pool itself and then attends through the block tables. Checked on a
case with a known answer (tests/kernels/attention_cases.py): the new tokens' K/V are taken out of the pool (their slots
zeroed), handed to the backend with the slot mapping the runner would build, and the backend must put them back
exactly and give the float64 answer. Also: the dtypes a kernel backend cannot take are refused when the engine is
built, not at trace time.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxpaged import SamplingParams
from jaxpaged.engine import setup as engine_setup
from jaxpaged.worker.attention import AttentionMetadata, KVPool, attention_backend
from tests.kernels.attention_cases import build_case, tolerance
from tests.tiny import tiny_llm


def split_new_kv(case):
    """(pool with the step's new slots zeroed, k_new, v_new [T, Hkv, D], slot_mapping [T]) for `case`."""
    bs = case.block_size
    k, v = np.array(case.k_cache), np.array(case.v_cache)
    tables, qsl = np.asarray(case.block_tables), np.asarray(case.query_start_loc)
    positions = np.asarray(case.positions)
    num_tokens, hkv, d = case.num_tokens, k.shape[3], k.shape[4]
    k_new, v_new = np.zeros((num_tokens, hkv, d), k.dtype), np.zeros((num_tokens, hkv, d), v.dtype)
    slots = np.zeros(num_tokens, np.int32)  # padding tokens write into the null block 0
    for s in range(len(case.seqs)):
        for t in range(qsl[s], qsl[s + 1]):
            if positions[t] < 0:
                continue
            block, offset = tables[s, positions[t] // bs], positions[t] % bs
            slots[t] = block * bs + offset
            k_new[t], v_new[t] = k[case.layer, block, offset], v[case.layer, block, offset]
            k[case.layer, block, offset] = v[case.layer, block, offset] = 0
    return KVPool(jnp.asarray(k), jnp.asarray(v)), jnp.asarray(k_new), jnp.asarray(v_new), jnp.asarray(slots)


@pytest.mark.parametrize("backend, seqs, tile", [
    ("reference", [(37, 21), (16, 16), (9, 1)], 16),  # prefill chunks, a whole prefill and a one-token chunk
    ("auto", [(37, 1), (16, 1), (1, 1)], 1),  # a decode batch: the native CPU kernel when it builds
], ids=["reference-prefill", "auto-decode"])
def test_the_backend_writes_the_new_kv_then_attends(backend, seqs, tile):
    case = build_case(seqs, num_q_heads=6, num_kv_heads=2, head_dim=16, block_size=8, tile_size=tile)
    pool, k_new, v_new, slots = split_new_kv(case)
    decode_blocks = case.decode_blocks if tile == 1 else None
    md = AttentionMetadata(positions=case.positions, slot_mapping=slots, block_tables=case.block_tables,
                           context_lens=case.context_lens, query_start_loc=case.query_start_loc,
                           logits_indices=jnp.zeros(len(seqs), jnp.int32), tile_size=tile,
                           decode_blocks=decode_blocks)
    attn = attention_backend(backend)
    out, written = jax.jit(attn, donate_argnums=(3,))(case.q, k_new, v_new, pool, case.layer, md)
    # Every block but the null block 0 (where padding tokens write) is the original pool again, NaN poison included
    np.testing.assert_array_equal(np.asarray(written.k)[:, 1:], np.asarray(case.k_cache)[:, 1:])
    np.testing.assert_array_equal(np.asarray(written.v)[:, 1:], np.asarray(case.v_cache)[:, 1:])
    valid = case.valid_tokens
    np.testing.assert_allclose(np.asarray(out, np.float32)[valid], case.expected()[valid], **tolerance(case.dtype))


ON_CPU = jax.default_backend() == "cpu"
PALLAS = "pallas_interpret" if ON_CPU else "pallas_gpu" if jax.default_backend() == "gpu" else "pallas_tpu"


def test_a_dtype_the_kernel_cannot_take_is_refused_when_the_engine_is_built():
    # float16 weights on CPU get a float32 pool, which the reference takes; the Pallas kernels take f32 and bf16 only
    pool = tiny_llm(dtype="float16", attention_backend="reference").engine.runner.kv_pool
    assert pool.dtype == (jnp.float32 if ON_CPU else jnp.float16)
    with pytest.raises(ValueError, match=f"'{PALLAS}' takes float32, bfloat16, not float16"):
        tiny_llm(dtype="float16", attention_backend="pallas")


def test_a_head_dim_the_kernel_cannot_take_is_refused_by_name_and_auto_runs_the_reference(monkeypatch):
    """The tiny model's head_dim 8 is below the Pallas kernels' smallest: attention_backend='pallas' is an error when
    the engine is built; under 'auto' (Pallas on GPU / TPU, faked here where the platform is CPU) the engine runs
    the reference and answers."""
    with pytest.raises(ValueError, match=f"'{PALLAS}' takes head_dim 16, .*not 8; .*attention_backend='reference'"):
        tiny_llm(attention_backend="pallas")
    real = engine_setup.attention_backend
    monkeypatch.setattr(engine_setup, "attention_backend", lambda name: real("pallas" if name == "auto" else name))
    llm = tiny_llm()
    assert llm.engine.runner.attn.name == "reference"
    out = llm.generate([{"prompt_token_ids": [1, 2, 3]}], SamplingParams(max_tokens=2, temperature=0.0),
                       use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 2
