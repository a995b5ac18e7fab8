"""Native CPU ragged paged attention (an XLA FFI custom call built from paged_attention.cc with g++ on first use)."""

from pallas_kernels.cpu_native.native import (
    available,
    native_else_reference,
    paged_attention_native,
    set_blocks_native,
    unavailable_reason,
    write_kv_native,
)

__all__ = ["available", "native_else_reference", "paged_attention_native", "set_blocks_native", "unavailable_reason",
           "write_kv_native"]
