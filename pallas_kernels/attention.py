"""One entry point for ragged paged attention; the implementation is chosen by name.

    paged_attention(q, k_cache, v_cache, layer, block_tables, context_lens, query_start_loc, positions,
                    scale=..., tile_size=..., sliding_window=..., soft_cap=..., decode_blocks=...,
                    implementation="pallas_gpu")

Every implementation takes the arguments of `ragged_paged_attention_reference` and returns its result (reference.py
states every layout and rule):
  "reference"             pure JAX, any platform (the CPU path)
  "pallas_gpu"            the Pallas kernel of gpu.py (Triton), compiled for a CUDA GPU
  "pallas_tpu"            the Pallas kernel of tpu.py (Mosaic TPU), compiled for a TPU
  "pallas_interpret"      the GPU kernel run by the Pallas interpreter, on any platform (slow; tests, CPU)
  "pallas_tpu_interpret"  the TPU kernel run by the Pallas interpreter, on any platform (slow; tests, CPU)
Kernel modules are imported on first use, so a platform never imports the other's kernel.
"""

from __future__ import annotations

import jax

IMPLEMENTATIONS = ("reference", "pallas_gpu", "pallas_tpu", "pallas_interpret", "pallas_tpu_interpret")


def paged_attention(*args, implementation: str = "reference", **kwargs) -> jax.Array:
    """Ragged paged attention by `implementation` (one of IMPLEMENTATIONS); arguments as the reference's."""
    if implementation == "reference":
        from pallas_kernels.reference import ragged_paged_attention_reference

        return ragged_paged_attention_reference(*args, **kwargs)
    if implementation in ("pallas_gpu", "pallas_interpret"):
        from pallas_kernels.gpu import ragged_paged_attention_gpu

        return ragged_paged_attention_gpu(*args, interpret=implementation == "pallas_interpret", **kwargs)
    if implementation in ("pallas_tpu", "pallas_tpu_interpret"):
        from pallas_kernels.tpu import ragged_paged_attention_tpu

        return ragged_paged_attention_tpu(*args, interpret=implementation == "pallas_tpu_interpret", **kwargs)
    raise ValueError(f"implementation={implementation!r} is not known; use one of {', '.join(IMPLEMENTATIONS)}")
