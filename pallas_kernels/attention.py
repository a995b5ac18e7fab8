"""One entry point for ragged paged attention; the implementation is chosen by name.

  "reference"          pure JAX (any platform; the CPU path)
  "pallas_gpu"         the Pallas Triton kernel, compiled for the GPU
  "pallas_interpret"   the same kernel run by the Pallas interpreter on any platform (slow; for tests)
All take the arguments of `ragged_paged_attention_reference` (see reference.py for every layout).
"""

from __future__ import annotations

IMPLEMENTATIONS = ("reference", "pallas_gpu", "pallas_interpret")


def paged_attention(*args, implementation: str = "reference", **kwargs):
    if implementation == "reference":
        from pallas_kernels.reference import ragged_paged_attention_reference

        return ragged_paged_attention_reference(*args, **kwargs)
    if implementation in ("pallas_gpu", "pallas_interpret"):
        from pallas_kernels.gpu import ragged_paged_attention_gpu

        return ragged_paged_attention_gpu(*args, interpret=implementation == "pallas_interpret", **kwargs)
    raise ValueError(f"implementation={implementation!r}; use one of {', '.join(IMPLEMENTATIONS)}")
