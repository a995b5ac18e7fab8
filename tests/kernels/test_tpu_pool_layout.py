"""The K/V pool's device format (jaxpaged/worker/kv_pool.py, `pool_format`): row-major on TPU, the default elsewhere.

The Pallas TPU kernel's custom call takes the pool [L, NB, BS, Hkv, D] row-major; XLA's default TPU layout for
head_dim 64 is not row-major, and the compiled step would then copy the whole pool around every kernel call. On TPU
the engine allocates the pool row-major and compiles its step, block copy and swap-in write with the pool in and out
in that format. Checked two ways without a TPU:
  * libtpu's compile-only client (skipped when the `libtpu` package is not importable): the engine's own jitted step
    for a tiny bfloat16 Llama with SmolLM2's head shape (3 kv heads of 64), attention backend pallas_tpu, lowered
    and compiled for a TPU v5e device from ShapeDtypeStructs (nothing allocated, nothing run). With the format the
    step holds no copy of the pool and one kernel launch in its layer loop's body; without it (the contrast) the
    same step copies the pool. The padded block bytes the KV budget counts are XLA's.
  * on CPU: `pool_format` is None, the engine's pool keeps the default layout and logical block bytes, and the TPU
    code path (explicit formats through every jitted pool function) runs end to end with a CPU row-major format and
    gives the default path's tokens.
"""

from __future__ import annotations

import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.experimental.layout import Format

from jaxpaged import SamplingParams
from jaxpaged.engine import setup as engine_setup
from jaxpaged.models import families
from jaxpaged.worker import model_runner
from jaxpaged.worker.attention import KVPool, PagedAttention
from jaxpaged.worker.input_batch import StepLayout
from jaxpaged.worker.kv_pool import (
    ROW_MAJOR_POOL,
    _copy_blocks,
    _write_blocks,
    jit_pool_update,
    pool_block_bytes,
    pool_format,
)
from jaxpaged.worker.step import jit_step, lower_step
from pallas_kernels.attention import paged_attention
from tests.hlo_checks import TPU_KERNEL, computations_with, pool_copies
from tests.kernels.tpu_step import BLOCK_SIZE, NUM_BLOCKS, STEP_SHAPES, TINY
from tests.tiny import random_params, random_prompts, tiny_config, tiny_llm

# --- TPU, compile only (libtpu) -------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def tpu_device():
    pytest.importorskip("libtpu")
    from jax.experimental import topologies

    return topologies.get_topology_desc(platform="tpu", topology_name="v5e:2x2").devices[0]


def compile_tpu_step(device, fmt: Format | None, shape: tuple) -> tuple[str, tuple[int, ...]]:
    """The engine's step, for `device`, from abstract arguments: (compiled HLO text, pool shape)."""
    config = tiny_config(**TINY)
    sharding = jax.sharding.SingleDeviceSharding(device)

    def abstract(x, where=sharding):
        return jax.ShapeDtypeStruct(np.shape(x), jnp.bfloat16 if x.dtype == np.float32 else x.dtype, sharding=where)

    graphdef, state = nnx.split(families.from_params(config, random_params(config)))
    leaves, treedef = jax.tree.flatten(jax.tree.map(abstract, state))  # bfloat16, as build_runner casts them
    pool_shape = (config.num_layers, NUM_BLOCKS, BLOCK_SIZE, config.num_kv_heads, config.head_dim)
    pool = jax.ShapeDtypeStruct(pool_shape, jnp.bfloat16, sharding=fmt or sharding)
    layout = StepLayout(*shape)
    s = layout.num_seqs

    def ints(*dims):
        return jax.ShapeDtypeStruct(dims, jnp.int32, sharding=sharding)

    # What attention_backend("auto") gives on a TPU.
    attn = PagedAttention("pallas_tpu", functools.partial(paged_attention, implementation="pallas_tpu"))
    step_fn = jit_step(graphdef, treedef, attn, fmt, max_rows=s)
    extras = (ints(s, 3), ints(s, 64), ints(s, 300), jax.ShapeDtypeStruct((s, 300), jnp.float32, sharding=sharding))
    lowered = lower_step(step_fn, tuple(leaves), KVPool(pool, pool), ints(s), layout, extras)
    return lowered.compile().as_text(), pool_shape


@pytest.mark.parametrize("shape", list(STEP_SHAPES), ids=list(STEP_SHAPES))
def test_tpu_step_with_the_row_major_pool_never_copies_it(tpu_device, shape):
    fmt = pool_format(tpu_device)
    assert fmt is not None and fmt.layout.major_to_minor == (0, 1, 2, 3, 4)
    hlo, pool_shape = compile_tpu_step(tpu_device, fmt, STEP_SHAPES[shape])
    assert pool_copies(hlo, pool_shape) == []
    # The pool arguments keep XLA's row-major order (tiled) in the entry computation's layout.
    entry_layout = hlo.splitlines()[0]
    assert entry_layout.count(f"bf16[{','.join(map(str, pool_shape))}]{{4,3,2,1,0:T(") == 4  # 2 in, 2 out
    # The layer loop stays a while loop: one kernel launch in its body, run once per layer.
    assert hlo.count(TPU_KERNEL) == 1
    (body,) = computations_with(hlo, TPU_KERNEL)
    assert re.search(rf"while\(.*body=%{re.escape(body)}[,\s]", hlo)


def test_tpu_step_in_the_default_layout_copies_the_pool(tpu_device):
    """The contrast: the same step without the format (XLA's default TPU layout) copies the pool."""
    hlo, pool_shape = compile_tpu_step(tpu_device, None, STEP_SHAPES["decode"])
    assert pool_copies(hlo, pool_shape) != []


@pytest.mark.parametrize("fn, num_args", [(_copy_blocks, 3), (_write_blocks, 4)], ids=["copy", "write"])
def test_tpu_block_copy_and_swap_in_keep_the_row_major_pool(tpu_device, fn, num_args):
    fmt = pool_format(tpu_device)
    pool = jax.ShapeDtypeStruct((2, NUM_BLOCKS, BLOCK_SIZE, 3, 64), jnp.bfloat16, sharding=fmt)
    idx = jax.ShapeDtypeStruct((8,), jnp.int32, sharding=fmt.sharding)
    blocks = jax.ShapeDtypeStruct((2, 8, BLOCK_SIZE, 3, 64), jnp.bfloat16, sharding=fmt.sharding)
    args = (KVPool(pool, pool), idx, idx) if num_args == 3 else (KVPool(pool, pool), idx, blocks, blocks)
    compiled = jit_pool_update(fn, fmt, num_args).lower(*args).compile()
    assert pool_copies(compiled.as_text(), pool.shape) == []
    assert [f.layout.major_to_minor for f in jax.tree.leaves(compiled.output_formats)] == [(0, 1, 2, 3, 4)] * 2


def test_tpu_block_bytes_count_the_tile_padding(tpu_device):
    """XLA tiles the row-major bfloat16 (Hkv, D) = (3, 64) as (4, 128): a block takes 8/3 of its logical bytes.

    The expected value is tile arithmetic on the tiling XLA reports for the allocated pool."""
    fmt = pool_format(tpu_device)
    config = tiny_config(**TINY)
    shape = (config.num_layers, NUM_BLOCKS, BLOCK_SIZE, 3, 64)
    zeros = jax.jit(functools.partial(jnp.zeros, shape, jnp.bfloat16), out_shardings=fmt).lower().compile()
    (rows, lanes), *_ = zeros.output_formats.layout.tiling
    assert (rows, lanes) == (4, 128)
    padded = 2 * config.num_layers * BLOCK_SIZE * rows * lanes * 2  # K and V, bfloat16
    assert pool_block_bytes(config, BLOCK_SIZE, jnp.bfloat16, fmt) == padded
    assert padded * 3 == pool_block_bytes(config, BLOCK_SIZE, jnp.bfloat16, None) * 8


# --- CPU ------------------------------------------------------------------------------------------------------------


def test_pool_format_is_the_default_layout_off_tpu():
    assert pool_format(jax.devices("cpu")[0]) is None


def test_block_bytes_are_the_logical_bytes_on_cpu():
    config = tiny_config(layers=3, kv_heads=2, head_dim=8)
    logical = 2 * 3 * 16 * 2 * 8 * 4  # K and V x L x BS x Hkv x D x float32
    assert pool_block_bytes(config, 16, jnp.float32, None) == logical
    # The measured path (XLA's allocation) agrees where the format adds no padding.
    row_major_cpu = Format(ROW_MAJOR_POOL, jax.sharding.SingleDeviceSharding(jax.devices("cpu")[0]))
    assert pool_block_bytes(config, 16, jnp.float32, row_major_cpu) == logical


def _generate(llm):
    prompts = [{"prompt_token_ids": p} for p in random_prompts(3, 5, 30, seed=4)]
    outputs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True), use_tqdm=False)
    return [o.outputs[0].token_ids for o in outputs]


def test_cpu_engine_keeps_the_default_pool_layout():
    llm = tiny_llm()
    runner = llm.engine.runner
    assert runner.pool_format is None
    default = jnp.zeros(runner.kv_pool.shape, runner.kv_pool.dtype).format
    assert runner.kv_pool.k.format == runner.kv_pool.v.format == default
    assert runner.block_bytes == 2 * 2 * 8 * 2 * 8 * 4
    _generate(llm)
    assert runner.kv_pool.k.format == runner.kv_pool.v.format == default


def test_the_explicit_pool_format_path_runs_on_cpu(monkeypatch):
    """The TPU code path (pool allocated in a format, step / copy / write compiled with it in and out) with a CPU
    row-major format: same tokens as the default path, the pool keeps its format and buffers, blocks copy and swap."""
    expected = _generate(tiny_llm())

    def row_major(device, sharding=None):
        return Format(ROW_MAJOR_POOL, jax.sharding.SingleDeviceSharding(device))

    monkeypatch.setattr(model_runner, "pool_format", row_major)
    monkeypatch.setattr(engine_setup, "pool_format", row_major)
    llm = tiny_llm()
    runner = llm.engine.runner
    assert runner.pool_format is not None
    pointer = runner.kv_pool.k.unsafe_buffer_pointer()
    assert _generate(llm) == expected
    assert runner.kv_pool.k.format.layout.major_to_minor == (0, 1, 2, 3, 4)
    assert runner.kv_pool.k.unsafe_buffer_pointer() == pointer  # donated and aliased: no second pool

    k_host = np.asarray(runner.kv_pool.k[:, 3])
    runner.copy_blocks([(3, 7)])
    np.testing.assert_array_equal(np.asarray(runner.kv_pool.k[:, 7]), k_host)
    blocks = np.arange(2 * 8 * 2 * 8, dtype=np.float32).reshape(2, 1, 8, 2, 8)
    runner.write_blocks([9], blocks, -blocks)
    k, v = runner.read_blocks([9])
    np.testing.assert_array_equal(k, blocks)
    np.testing.assert_array_equal(v, -blocks)
    assert runner.kv_pool.k.unsafe_buffer_pointer() == pointer
