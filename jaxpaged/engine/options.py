"""`EngineOptions`: `EngineConfig`'s fields as keyword arguments, for type checkers and IDEs.

`LLM(model, **options)` (and `LLM.from_model`, `LLM.from_params`, `AsyncEngine.from_options`) annotate their
options as `**options: Unpack[EngineOptions]` (PEP 692), so `LLM("m.gguf", max_num_seqs=8)` is checked and completed
like a keyword argument while the one list of options stays `EngineConfig`. A test asserts that the two hold the
same names and types; an option added to `EngineConfig` is added here too.
"""

from __future__ import annotations

from typing import TypedDict

from jaxpaged.spec_decode.config import SpeculativeConfig


class EngineOptions(TypedDict, total=False):
    """Every `EngineConfig` field, each optional (its default is EngineConfig's); see EngineConfig for their help."""

    dtype: str
    kv_cache_dtype: str
    block_size: int
    kv_cache_memory: int | str | None
    gpu_memory_utilization: float
    num_blocks: int | None
    enable_prefix_caching: bool
    swap_space: float
    preemption_mode: str
    scheduling_policy: str
    generation_config: str
    reasoning_parser: str | None
    max_num_seqs: int
    max_num_batched_tokens: int
    max_prefill_tokens_while_decoding: int | None
    max_decode_slowdown: float | None
    max_model_len: int | None
    attention_backend: str
    tensor_parallel_size: int
    distributed_coordinator_address: str | None
    distributed_num_processes: int | None
    distributed_process_id: int | None
    distributed_heartbeat_timeout: int
    distributed_initialization_timeout: int
    seed: int
    speculative_config: dict | SpeculativeConfig | None
    async_scheduling: bool
    precompile: bool
    show_progress: bool
    compilation_cache_dir: str | None
    kv_allocation: str
    quantization: str | None
