"""The step shapes an engine compiles: one per kernel variant (`PagedAttention.kernel_variant`).

A step's block-table width and a decode step's flat block count are rounded up to buckets; where two buckets give
the attention kernel the same work (the GPU kernel: the same flash-decoding split count; the native CPU kernel:
always), the runner keeps only the larger, so start-up compiles fewer shapes and a step runs the kernel it ran
before. Built without compiling anything (precompile=False): these check the runner's bucket lists."""

import types

import jax
import jax.numpy as jnp
import pytest
from flax import nnx

from jaxpaged import LLM
from jaxpaged.config import ModelConfig
from jaxpaged.models.llama import LlamaForCausalLM
from jaxpaged.parallel.tensor_parallel import ShardedAttention
from jaxpaged.worker.attention import KernelGeometry, attention_backend, gpu_splits
from jaxpaged.worker.step import pick_bucket, pow2_buckets
from pallas_kernels import cpu_native


def runner_for(backend: str, num_heads: int = 32, num_kv_heads: int = 8, head_dim: int = 64, **options):
    """A runner at Llama-3.2-1B's attention geometry (one narrow layer), issue #29's engine settings."""
    config = ModelConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_layers=1, num_heads=num_heads,
                         num_kv_heads=num_kv_heads, head_dim=head_dim, max_position_embeddings=2048,
                         eos_token_ids=(1,))
    model = LlamaForCausalLM(config, rngs=nnx.Rngs(0), dtype=jnp.float32)
    llm = LLM.from_model(model, None, dtype="float32", precompile=False, max_num_seqs=256,
                         max_num_batched_tokens=8192, max_model_len=2048, kv_cache_memory="64MiB",
                         attention_backend=backend, show_progress=False, **options)
    return llm.engine.runner


def splits(runner, num_tokens, num_seqs, width, tile, decode_blocks) -> int:
    config = runner.config
    geometry = KernelGeometry(config.num_heads, config.num_kv_heads, runner.block_size, config.head_dim,
                              jnp.dtype(runner.kv_pool.k.dtype).itemsize)
    return gpu_splits(num_tokens, num_seqs, width, tile, decode_blocks, geometry)


@pytest.mark.parametrize("heads", [(32, 8, 64), (9, 3, 64), (8, 1, 128)], ids=["gqa4-d64", "gqa3-d64", "mqa-d128"])
def test_gpu_kernel_steps_round_up_to_a_shape_with_the_same_split_count(heads):
    """Every block count and width a step could need rounds up to a kept bucket that holds it and gives the GPU
    kernel the split count its own bucket gave; and fewer shapes are compiled."""
    runner = runner_for("pallas", *heads)  # the GPU kernel (run by Pallas' interpreter off a GPU)
    for s in runner.decode_buckets:
        most = s * runner.max_width
        kept = runner.flat_block_buckets(s)
        for blocks in pow2_buckets(min(max(s, 16), most), most):
            chosen = pick_bucket(kept, blocks)
            assert chosen >= blocks
            assert splits(runner, s, s, runner.max_width, 1, chosen) == splits(runner, s, s, runner.max_width, 1,
                                                                                 blocks)
    for t in runner.prefill_buckets:
        seqs, tile = runner._prefill_seqs(t), runner.prefill_tile
        kept = runner.prefill_widths(t)
        for width in runner.width_buckets:
            chosen = pick_bucket(kept, width)
            assert chosen >= width
            assert splits(runner, t, seqs, chosen, tile, None) == splits(runner, t, seqs, width, tile, None)
    uncollapsed = sum(len(pow2_buckets(min(max(s, 16), s * runner.max_width), s * runner.max_width))
                      for s in runner.decode_buckets) + len(runner.prefill_buckets) * len(runner.width_buckets)
    assert len(runner.all_shapes()) < uncollapsed


def test_gpu_decode_batches_that_never_split_compile_one_block_count():
    """From 128 programs (16 sequences x 8 kv heads) the GPU kernel never splits a context: one shape per batch. At
    Llama-3.2-1B's geometry that leaves a quarter of the 133 shapes that issue #29's run compiled (~3.5 s each on an
    H200)."""
    runner = runner_for("pallas")
    assert len(runner.all_shapes()) < 133 / 3
    assert {s: len(runner.flat_block_buckets(s)) for s in runner.decode_buckets if s >= 16} == \
        {s: 1 for s in runner.decode_buckets if s >= 16}
    assert len(runner.flat_block_buckets(4)) > 1  # 32 programs: splits follow the context


def test_the_reference_keeps_every_bucket():
    """The reference gathers decode_blocks blocks and reads whole tables: nothing is merged."""
    runner = runner_for("reference")
    assert runner.flat_block_buckets(64) == pow2_buckets(64, 64 * runner.max_width)
    assert runner.prefill_widths(runner.prefill_buckets[0]) == runner.width_buckets


@pytest.mark.skipif(jax.default_backend() != "cpu" or not cpu_native.available("attention"),
                    reason="needs the native CPU kernel (a CPU backend)")
def test_the_native_kernel_compiles_full_tables_only():
    """The native CPU kernel reads only the blocks a sequence uses: one width and one block count per step size."""
    runner = runner_for("native")
    for t in runner.prefill_buckets:
        assert runner.prefill_widths(t) == [runner.max_width]
    for s in runner.decode_buckets:
        assert runner.flat_block_buckets(s) == [s * runner.max_width]


def test_tensor_parallel_variants_see_one_devices_heads():
    """Under tensor parallelism the kernel runs on Hq / tp and Hkv / tp heads: its variant is taken there."""
    inner = attention_backend("pallas")
    sharded = ShardedAttention(inner, types.SimpleNamespace(size=4))
    geometry = KernelGeometry(32, 8, 16, 64, 2)
    local = KernelGeometry(8, 2, 16, 64, 2)
    for shape in [(8, 8, 128, 1, 64), (16, 16, 128, 1, 2048), (64, 4, 32, 16, None)]:
        assert sharded.kernel_variant(*shape, geometry) == inner.kernel_variant(*shape, local)
    assert sharded.kernel_variant(16, 16, 128, 1, 2048, geometry) != inner.kernel_variant(16, 16, 128, 1, 2048,
                                                                                          geometry)
