"""The model and pool shapes at which the engine's step is lowered for a TPU without one
(tests/kernels/test_tpu_pool_layout.py, tests/kernels/test_fp8_kernels.py)."""

# SmolLM2-135M's attention shape (3 kv heads of 64, GQA 3) on 2 layers. A pool of 2048 blocks of 16 tokens (64 MiB
# each, row-major): XLA would prefetch a pool of a few MiB into VMEM (an `S(1)` copy), never one of the engine's size.
TINY = dict(vocab_size=96, hidden=64, layers=2, heads=9, kv_heads=3, head_dim=64)
NUM_BLOCKS, BLOCK_SIZE = 2048, 16
STEP_SHAPES = {  # (tokens, sequences, block-table width, tile, decode_blocks), as ModelRunner.all_shapes() builds
    "decode": (8, 8, 8, 1, 16),
    "prefill": (64, 4, 4, 16, None),
}
