"""Native CPU kernels: C++ called through XLA's FFI (not Pallas), each built with g++ on first use into its own library
(build.py): ragged paged attention and its pool writes (paged_attention.cc), and a bf16 matmul reading a stacked
layer weight in place, plain or as a gated MLP's act(x @ w_gate) * (x @ w_up) (matmul.cc, AVX512_BF16 only; on AMX
tiles where the CPU has AMX-BF16), from a weight as stored or prepacked in its panel layout; a bf16 model's RMSNorm
and residual adds (norm.cc) and rotary embedding (rope.cc); the sampler's argmax (argmax.cc), penalties
(penalties.cc), top-k / top-p threshold (top_p.cc), Gumbel-max draw (gumbel.cc) and log-probs (logprobs.cc).
`available(kernel)` says which ones run here; `python -m pallas_kernels.cpu_native --build` prebuilds them
(README.md)."""

from pallas_kernels.cpu_native.build import KERNELS, KernelStatus, describe, statuses
from pallas_kernels.cpu_native.native import (
    PANEL,
    add_round_native,
    argmax_native,
    available,
    gumbel_argmax_native,
    logprobs_native,
    matmul_glu_native,
    matmul_is_fast,
    matmul_native,
    matmul_uses_amx,
    native_else_reference,
    paged_attention_native,
    penalties_native,
    prepack_weight,
    rms_norm_native,
    rope_native,
    set_blocks_native,
    top_p_threshold_native,
    unavailable_reason,
    unpack_weight,
    write_kv_native,
)

__all__ = ["KERNELS", "KernelStatus", "PANEL", "add_round_native", "argmax_native", "available", "describe",
           "gumbel_argmax_native", "logprobs_native",
           "matmul_glu_native", "matmul_is_fast", "matmul_native", "matmul_uses_amx", "native_else_reference",
           "paged_attention_native",
           "penalties_native", "prepack_weight", "rms_norm_native", "rope_native", "set_blocks_native", "statuses",
           "top_p_threshold_native", "unavailable_reason", "unpack_weight", "write_kv_native"]
