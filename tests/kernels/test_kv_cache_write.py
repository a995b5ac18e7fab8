"""The K/V cache write stays in place: no copy of the pool per step.

The step function writes each layer's new K/V rows into the pool carried through the layer loop (XLA's scatter,
`.at[slots].set`, for the reference backend; the native CPU kernel's aliased write for 'auto' on CPU), and the pool
arguments are donated. Shown two ways, on CPU (the platform tests run on), for both writes:
  * the compiled HLO of every step shape aliases the pool inputs to the pool outputs (`input_output_alias`) and has
    no `copy` of a pool-shaped array;
  * at run time the pool keeps its device buffer: the step's output pool is the input's memory, and the input
    array is deleted (donated), so an engine step never holds two pools.
The block copy (copy-on-write) and swap-in write functions are held to the same rule.
"""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxpaged import SamplingParams
from pallas_kernels.cpu_native import native
from tests.hlo_checks import pool_copies
from tests.tiny import random_prompts, tiny_llm

# XLA CPU has no 16-bit scatter: what these tests check (the native write, the float32 pool) exists on CPU alone.
cpu_only = pytest.mark.skipif(jax.default_backend() != "cpu", reason="the CPU backend's 16-bit pool rules")


@pytest.fixture(scope="module", params=["auto", "reference"])
def llm(request):
    return tiny_llm(attention_backend=request.param)


def test_every_step_shape_writes_the_pool_in_place(llm):
    runner = llm.engine.runner
    llm.generate([{"prompt_token_ids": p} for p in random_prompts(3, 5, 30, seed=1)],
                 SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True), use_tqdm=False)
    executables = runner._executables
    assert len(executables) >= 2, "expected a prefill and a decode shape"
    # Arguments are flattened: the params' leaves first, then the pool's K and V.
    pool_params = {len(jax.tree.leaves(runner.params)), len(jax.tree.leaves(runner.params)) + 1}
    for key, executable in executables.items():
        hlo = executable.as_text()
        aliased = {int(p) for p in re.findall(r"\{\d+\}: \((\d+), \{\}", hlo.splitlines()[0])}
        assert pool_params <= aliased, (key, hlo.splitlines()[0][:200])
        assert pool_copies(hlo, runner.kv_pool.shape) == [], key


def test_the_pool_keeps_its_buffer_across_steps_and_block_copies(llm):
    runner = llm.engine.runner
    k_before, v_before = runner.kv_pool.k, runner.kv_pool.v
    pointers = (k_before.unsafe_buffer_pointer(), v_before.unsafe_buffer_pointer())
    outputs = llm.generate([{"prompt_token_ids": random_prompts(1, 20, 20, seed=2)[0]}],
                           SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True), use_tqdm=False)
    assert len(outputs[0].outputs[0].token_ids) == 3
    assert k_before.is_deleted() and v_before.is_deleted()  # donated to the step
    assert (runner.kv_pool.k.unsafe_buffer_pointer(), runner.kv_pool.v.unsafe_buffer_pointer()) == pointers

    # Copy-on-write block copies and swap-in writes: in place too, and they do what they say.
    k_host = np.asarray(runner.kv_pool.k[:, 3])
    runner.copy_blocks([(3, 7)])
    np.testing.assert_array_equal(np.asarray(runner.kv_pool.k[:, 7]), k_host)
    blocks = np.arange(2 * 1 * 8 * 2 * 8, dtype=np.float32).reshape(2, 1, 8, 2, 8)
    runner.write_blocks([9], blocks, -blocks)
    np.testing.assert_array_equal(np.asarray(runner.kv_pool.v[:, 9:10]), -blocks)
    assert (runner.kv_pool.k.unsafe_buffer_pointer(), runner.kv_pool.v.unsafe_buffer_pointer()) == pointers


# --- the pool's dtype ------------------------------------------------------------------------------------------------


def _pool_converts(runner) -> list[str]:
    dims = ",".join(map(str, runner.kv_pool.shape))
    hlo = "\n".join(e.as_text() for e in runner._executables.values())
    return [line for line in hlo.splitlines() if f"[{dims}]" in line and " convert(" in line]


def _generate_and_check_no_pool_convert_or_copy(llm) -> None:
    runner = llm.engine.runner
    outs = llm.generate([{"prompt_token_ids": random_prompts(1, 12, 12, seed=3)[0]}],
                        SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True), use_tqdm=False)
    assert len(outs[0].outputs[0].token_ids) == 3
    assert _pool_converts(runner) == []
    for key, executable in runner._executables.items():
        assert pool_copies(executable.as_text(), runner.kv_pool.shape) == [], key


@cpu_only
@pytest.mark.skipif(not native.available("attention"), reason="the native CPU kernels are not built here")
def test_a_bfloat16_model_on_cpu_gets_a_bfloat16_pool_written_in_place_by_the_native_kernel():
    """The native CPU backend writes K/V rows and whole blocks itself (XLA CPU has no 16-bit scatter), so 'auto'
    gives a bfloat16 model a bfloat16 pool: no pool-sized convert or copy in any step, the same buffer after steps,
    block copies and swap-in writes, and the values written are the values asked for."""
    llm = tiny_llm(dtype="bfloat16")
    runner = llm.engine.runner
    assert runner.attn.kv_write is not None
    assert runner.kv_pool.dtype == jnp.bfloat16 and runner.params["embed"].dtype == jnp.bfloat16
    pointers = (runner.kv_pool.k.unsafe_buffer_pointer(), runner.kv_pool.v.unsafe_buffer_pointer())
    _generate_and_check_no_pool_convert_or_copy(llm)
    k_host = np.asarray(runner.kv_pool.k[:, 1])
    assert np.abs(k_host.astype(np.float32)).sum() > 0  # the prompt's K is in block 1
    runner.copy_blocks([(1, 7)])
    np.testing.assert_array_equal(np.asarray(runner.kv_pool.k[:, 7]), k_host)
    blocks = np.arange(2 * 1 * 8 * 2 * 8, dtype=np.float32).reshape(2, 1, 8, 2, 8)
    runner.write_blocks([9], blocks, -blocks)
    np.testing.assert_array_equal(np.asarray(runner.kv_pool.v[:, 9:10]).astype(np.float32), -blocks)
    assert (runner.kv_pool.k.unsafe_buffer_pointer(), runner.kv_pool.v.unsafe_buffer_pointer()) == pointers


@cpu_only
def test_without_the_native_write_a_bfloat16_model_on_cpu_gets_a_float32_pool():
    """XLA CPU has no 16-bit float scatter: with the reference backend a bfloat16 pool would be converted to
    float32 and back around every write, so kv_cache_dtype='auto' keeps the pool in float32 there, and the step
    then has no pool-sized convert."""
    llm = tiny_llm(dtype="bfloat16", attention_backend="reference")
    runner = llm.engine.runner
    assert runner.kv_pool.dtype == jnp.float32 and runner.params["embed"].dtype == jnp.bfloat16
    _generate_and_check_no_pool_convert_or_copy(llm)

    # The contrast that makes 'auto' necessary: an explicit bfloat16 pool on CPU is converted around the write.
    explicit = tiny_llm(dtype="bfloat16", kv_cache_dtype="bfloat16", attention_backend="reference")
    assert explicit.engine.runner.kv_pool.dtype == jnp.bfloat16
    explicit.generate([{"prompt_token_ids": [5, 6, 7]}], SamplingParams(max_tokens=1), use_tqdm=False)
    hlo = "\n".join(e.as_text() for e in explicit.engine.runner._executables.values())
    dims = ",".join(map(str, explicit.engine.runner.kv_pool.shape))
    assert [line for line in hlo.splitlines() if f"f32[{dims}]" in line]


def test_cache_dtype_resolution_and_bad_values():
    from jaxpaged.engine.setup import resolve_cache_dtype

    assert resolve_cache_dtype("auto", "bfloat16", "cpu", writes_16bit=False) == jnp.float32
    assert resolve_cache_dtype("auto", "float16", "cpu", writes_16bit=False) == jnp.float32
    assert resolve_cache_dtype("auto", "bfloat16", "cpu", writes_16bit=True) == jnp.bfloat16
    assert resolve_cache_dtype("auto", "bfloat16", "gpu", writes_16bit=True) == jnp.bfloat16
    assert resolve_cache_dtype("auto", "float32", "tpu", writes_16bit=True) == jnp.float32
    assert resolve_cache_dtype("bfloat16", "float32", "cpu", writes_16bit=False) == jnp.bfloat16
    with pytest.raises(ValueError, match="kv_cache_dtype='int8' is not supported"):
        tiny_llm(kv_cache_dtype="int8")
