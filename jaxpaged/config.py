"""Configuration dataclasses, one per concern, validated where they are built.

Names follow vLLM where it has one, so users carry their habits over.
"""

from __future__ import annotations

import dataclasses
import re
from typing import Any

# Model and pool dtype option names. The Pallas and native kernels take a subset (pallas_kernels.validation.
# KERNEL_DTYPES), checked when the engine picks its attention backend.
SUPPORTED_DTYPES = ("float32", "bfloat16", "float16")
# The pool's also takes vLLM's 8-bit float names: "fp8" (= "fp8_e4m3", float8_e4m3fn) and "fp8_e5m2"
# (jaxpaged/worker/kv_quant.py).
# the pool: a model dtype, or float8 under vLLM's names (pallas_kernels.fp8 maps them to dtypes)
KV_CACHE_DTYPES = ("auto", *SUPPORTED_DTYPES, "fp8", "fp8_e4m3", "fp8_e5m2")

LAYER_TYPES = ("full_attention", "sliding_attention")
HIDDEN_ACTS = ("silu", "gelu_pytorch_tanh")

_UNITS = {"": 1, "b": 1, "k": 1000, "kb": 1000, "m": 1000**2, "mb": 1000**2, "g": 1000**3, "gb": 1000**3,
          "kib": 1024, "mib": 1024**2, "gib": 1024**3, "tib": 1024**4}


def parse_bytes(value: int | float | str, name: str = "size") -> int:
    """`2147483648`, `"2GiB"`, `"512MiB"`, `"1.5GB"` -> bytes."""
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        if value <= 0:
            raise ValueError(f"{name}={value!r} must be positive")
        return int(value)
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*", str(value))
    if not m or m.group(2).lower() not in _UNITS:
        raise ValueError(f"{name}={value!r} is not a size; write bytes or e.g. '2GiB', '512MiB'")
    n = int(float(m.group(1)) * _UNITS[m.group(2).lower()])
    if n <= 0:
        raise ValueError(f"{name}={value!r} must be positive")
    return n


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """Architecture of a Llama-family decoder (Llama 2/3, Mistral, Qwen2, Qwen3, SmolLM2)."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    # HF-style dict, e.g. {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
    # "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}, or None.
    rope_scaling: dict[str, Any] | None = None
    max_position_embeddings: int = 2048
    tie_word_embeddings: bool = False
    attention_bias: bool = False  # Qwen2: biases on q, k, v projections
    qk_norm: bool = False  # Qwen3: RMSNorm over each head's q and k before RoPE
    sliding_window: int | None = None  # Mistral: each token sees the last `sliding_window` positions
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    architecture: str = "llama"
    # Gemma 3 (the defaults keep every Llama-family model as it was):
    # per layer "sliding_attention" or "full_attention"; None: `sliding_window` (if any) applies to every layer
    layer_types: tuple[str, ...] | None = None
    rope_local_theta: float | None = None  # RoPE base of sliding layers, which ignore rope_scaling; None: rope_theta
    query_pre_attn_scalar: float | None = None  # attention scale is this ** -0.5; None: head_dim ** -0.5
    hidden_act: str = "silu"  # of the gated MLP: "silu" (SwiGLU) or "gelu_pytorch_tanh" (GeGLU)
    embedding_multiplier: float = 1.0  # token embeddings are scaled by this (Gemma: sqrt(hidden_size))
    rms_norm_unit_offset: bool = False  # Gemma: RMSNorm scales by (1 + weight); weights stored as HF stores them
    post_norms: bool = False  # Gemma: RMSNorm on the attention and MLP outputs before each residual add
    final_logit_softcapping: float | None = None  # logits -> cap * tanh(logits / cap)
    # the sampling values of the model's generation_config.json that requests leaving them unset take (vLLM's
    # generation_config="auto"): some of temperature, top_p, top_k, min_p, repetition_penalty, max_tokens
    generation_defaults: dict[str, float | int] | None = None

    def __post_init__(self):
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"num_heads={self.num_heads} must be a multiple of num_kv_heads={self.num_kv_heads}")
        for field in ("vocab_size", "hidden_size", "intermediate_size", "num_layers", "head_dim"):
            if getattr(self, field) <= 0:
                raise ValueError(f"ModelConfig.{field}={getattr(self, field)} must be positive")
        if self.layer_types is not None:
            # A tuple whatever came in (JSON gives a list), so configs compare and hash equal after a round trip.
            object.__setattr__(self, "layer_types", tuple(self.layer_types))
            bad = sorted(set(self.layer_types) - set(LAYER_TYPES))
            if bad or len(self.layer_types) != self.num_layers:
                raise ValueError(f"ModelConfig.layer_types must list one of {', '.join(LAYER_TYPES)} per layer "
                                 f"(num_layers={self.num_layers}); got {len(self.layer_types)} entries"
                                 + (f" with unknown {bad}" if bad else ""))
            if "sliding_attention" in self.layer_types and not self.sliding_window:
                raise ValueError("ModelConfig.layer_types has sliding_attention layers but sliding_window="
                                 f"{self.sliding_window}; give the window size")
        if self.hidden_act not in HIDDEN_ACTS:
            raise ValueError(f"ModelConfig.hidden_act={self.hidden_act!r} is not supported; use one of "
                             f"{', '.join(HIDDEN_ACTS)}")
        for field in ("query_pre_attn_scalar", "final_logit_softcapping", "rope_local_theta"):
            value = getattr(self, field)
            if value is not None and value <= 0:
                raise ValueError(f"ModelConfig.{field}={value} must be positive or None")

    def layer_window(self, layer: int) -> int | None:
        """The sliding window of `layer` (None: it attends to its whole context)."""
        if self.layer_types is not None and self.layer_types[layer] != "sliding_attention":
            return None
        return self.sliding_window

    def __hash__(self):  # rope_scaling is a dict; hash what identifies the architecture
        return hash((self.vocab_size, self.hidden_size, self.num_layers, self.num_heads, self.num_kv_heads,
                     self.head_dim, self.architecture))


@dataclasses.dataclass(frozen=True)
class CacheConfig:
    """The KV block pool."""

    block_size: int = 16
    # Bytes of K and V for the whole pool on CPU; on GPU/TPU `gpu_memory_utilization` decides when this is None.
    kv_cache_memory: int | str | None = None
    gpu_memory_utilization: float = 0.9
    num_blocks: int | None = None  # overrides both budgets (tests use it to force a tiny pool)
    enable_prefix_caching: bool = True
    swap_space: float = 0.0  # GiB of host memory for swapped-out blocks; 0 disables swapping
    preemption_mode: str = "recompute"  # "recompute" | "swap"
    cache_dtype: str = "auto"  # "auto": the model dtype, but float32 on CPU for 16-bit models; or fp8 (kv_quant)

    def __post_init__(self):
        from pallas_kernels.validation import SUPPORTED_BLOCK_SIZES  # the kernels' list (they import JAX)

        if self.block_size not in SUPPORTED_BLOCK_SIZES:
            raise ValueError(f"block_size={self.block_size} is not supported: the attention kernels take "
                             f"{', '.join(map(str, SUPPORTED_BLOCK_SIZES))}")
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise ValueError(f"gpu_memory_utilization={self.gpu_memory_utilization} must be in (0, 1]")
        if self.kv_cache_memory is not None:
            object.__setattr__(self, "kv_cache_memory", parse_bytes(self.kv_cache_memory, "kv_cache_memory"))
        if self.num_blocks is not None and self.num_blocks < 2:
            raise ValueError(f"num_blocks={self.num_blocks} must be at least 2 (block 0 is the null block)")
        if self.swap_space < 0:
            raise ValueError(f"swap_space={self.swap_space} must be >= 0 (GiB)")
        if self.preemption_mode not in ("recompute", "swap"):
            raise ValueError(f"preemption_mode={self.preemption_mode!r} must be 'recompute' or 'swap'")
        if self.cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(f"kv_cache_dtype={self.cache_dtype!r} is not supported; use one of "
                             f"{', '.join(KV_CACHE_DTYPES)}")
        if self.preemption_mode == "swap" and self.swap_space <= 0:
            raise ValueError("preemption_mode='swap' needs swap_space > 0 (GiB of host memory)")


@dataclasses.dataclass(frozen=True)
class SchedulerConfig:
    """Budgets of one engine step."""

    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048
    max_model_len: int | None = None  # None: min(model's max_position_embeddings, 4096)
    # Prefill tokens per step while other sequences are decoding (None: max_num_batched_tokens). A decoding stream
    # waits one prefill step between two tokens, so this bounds its inter-token latency.
    max_prefill_tokens_while_decoding: int | None = None
    # While sequences decode, a step that also runs prompt tokens may delay their next token by at most this many
    # decode steps' time minus one (the scheduler's StepPacer adapts the prompt-token bound to measured step times,
    # with max_prefill_tokens_while_decoding as its ceiling). None: the fixed bound alone.
    max_decode_slowdown: float | None = None
    # "fcfs": requests in arrival order; "priority": by their priority (lower first), then arrival
    policy: str = "fcfs"

    def __post_init__(self):
        if self.policy not in ("fcfs", "priority"):
            raise ValueError(f"scheduling_policy={self.policy!r} must be 'fcfs' or 'priority'")
        if self.max_num_seqs < 1:
            raise ValueError(f"max_num_seqs={self.max_num_seqs} must be >= 1")
        if self.max_num_batched_tokens < 16:
            raise ValueError(f"max_num_batched_tokens={self.max_num_batched_tokens} must be >= 16")
        chunk = self.max_prefill_tokens_while_decoding
        if chunk is not None and not 16 <= chunk <= self.max_num_batched_tokens:
            raise ValueError(f"max_prefill_tokens_while_decoding={chunk} must be in [16, max_num_batched_tokens="
                             f"{self.max_num_batched_tokens}]")
        if self.max_decode_slowdown is not None and not self.max_decode_slowdown > 1.0:
            raise ValueError(f"max_decode_slowdown={self.max_decode_slowdown} must be > 1 (or None)")
        if self.max_model_len is not None and self.max_model_len < 1:
            raise ValueError(f"max_model_len={self.max_model_len} must be >= 1")
