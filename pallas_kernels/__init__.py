"""Paged-attention kernels and their pure-JAX references. Knows nothing of the engine."""

from pallas_kernels.attention import IMPLEMENTATIONS, paged_attention
from pallas_kernels.reference import (
    dense_causal_attention,
    ragged_paged_attention_reference,
    write_kv_reference,
)

__all__ = ["dense_causal_attention", "ragged_paged_attention_reference", "write_kv_reference", "IMPLEMENTATIONS",
           "paged_attention"]
