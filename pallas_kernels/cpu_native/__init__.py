"""Native CPU decode attention (an XLA FFI custom call built from paged_decode.cc with g++ on first use)."""

from pallas_kernels.cpu_native.native import (
    available,
    native_decode_else_reference,
    paged_decode_attention_native,
    unavailable_reason,
)

__all__ = ["available", "native_decode_else_reference", "paged_decode_attention_native",
           "unavailable_reason"]
