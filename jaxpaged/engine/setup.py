"""Start-up: the engine's options, the KV pool's size, the compilation cache and the attention backend."""

from __future__ import annotations

import dataclasses
import logging

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxpaged.config import KV_CACHE_DTYPES, SUPPORTED_DTYPES, CacheConfig, SchedulerConfig, parse_bytes
from jaxpaged.engine.reasoning import REASONING_PARSERS
from jaxpaged.models.contract import ModelSpec
from jaxpaged.parallel.multihost import DistributedConfig
from jaxpaged.runtime.compilation_cache import enable_compilation_cache
from jaxpaged.spec_decode.config import SpeculativeConfig
from jaxpaged.worker import kv_quant
from jaxpaged.worker.attention import ATTENTION_BACKENDS, PagedAttention, attention_backend
from jaxpaged.worker.kv_pool import pool_block_bytes, pool_format
from jaxpaged.worker.model_runner import DraftModel, ModelRunner
from pallas_kernels.validation import SUPPORTED_BLOCK_SIZES

logger = logging.getLogger(__name__)

DEFAULT_CPU_KV_MEMORY = "1GiB"


def _option(default, help: str, choices: tuple | None = None):
    """An engine option: its default, the help its CLI flag shows and the values it takes (jaxpaged/cli.py makes
    every flag from these, so options and flags cannot drift apart)."""
    return dataclasses.field(default=default, metadata={"help": help, "choices": choices})


@dataclasses.dataclass(frozen=True)
class EngineConfig:
    """Every engine option, with vLLM's names where it has one. Checked when built, before any model is loaded."""

    dtype: str = _option("auto", "weights and activations (matmuls accumulate in float32); auto: bfloat16 on GPU, "
                                 "TPU and CPUs with bfloat16 dot instructions, else float32",
                         ("auto", *SUPPORTED_DTYPES))
    kv_cache_dtype: str = _option("auto", "the K/V pool's dtype; auto: dtype, but float32 on CPU for 16-bit dtypes; "
                                          "fp8 (= fp8_e4m3) or fp8_e5m2: 8-bit floats with a scale per layer, half "
                                          "the bytes of bfloat16 per token", KV_CACHE_DTYPES)
    block_size: int = _option(16, "tokens per KV block", SUPPORTED_BLOCK_SIZES)
    kv_cache_memory: int | str | None = _option(None, f"bytes of K+V for the pool on each device, e.g. 2GiB (CPU "
                                                      f"default: {DEFAULT_CPU_KV_MEMORY})")
    gpu_memory_utilization: float = _option(0.9, "GPU/TPU: fraction of each device's memory for weights, "
                                                 "activations and the pool")
    num_blocks: int | None = _option(None, "force the pool's size in blocks (overrides both memory budgets)")
    enable_prefix_caching: bool = _option(True, "reuse the KV blocks of equal prompt prefixes")
    swap_space: float = _option(0.0, "GiB of host memory for swapped-out blocks")
    preemption_mode: str = _option("recompute", "what preemption does with a request's blocks",
                                   ("recompute", "swap"))
    scheduling_policy: str = _option("fcfs", "which requests run first: fcfs (arrival order), or priority (each "
                                             "request's priority, lower first, then arrival; the lowest runs out "
                                             "first when the pool is short)", ("fcfs", "priority"))
    generation_config: str = _option("auto", "request defaults: auto (the model's generation_config.json sets the "
                                             "temperature, top_p, top_k, min_p, repetition_penalty and max_tokens "
                                             "of requests that leave them unset, as vLLM does), or vllm (vLLM's own "
                                             "defaults, whatever the model says)", ("auto", "vllm"))
    reasoning_parser: str | None = _option(
        None, "a thinking model's <think> ... </think> (vLLM's names): the server gives it as a chat message's "
              "reasoning_content, the rest as its content, and a request's structured output constrains only what "
              "follows </think> (deepseek_r1: reasoning first, its <think> in the prompt; qwen3: only when the "
              "model starts a think block)", (None, *REASONING_PARSERS))
    max_num_seqs: int = _option(64, "sequences per step")
    max_num_batched_tokens: int = _option(2048, "tokens per prefill step; longer prompts are chunked")
    max_prefill_tokens_while_decoding: int | None = _option(
        None, "prefill tokens per step while other sequences decode (default: max_num_batched_tokens, for "
              "throughput; server.py's default: 128, at most max_num_batched_tokens); a decoding stream waits one "
              "prefill step between tokens, so a smaller value bounds its inter-token latency")
    max_decode_slowdown: float | None = _option(
        None, "while sequences decode, the gap between their tokens when a step also prefills, at most this many "
              "decode steps: the prefill bound follows measured step times (max_prefill_tokens_while_decoding is "
              "its ceiling). Default: off; server.py's: 1.7, where 0 turns it off")
    max_model_len: int | None = _option(None, "context length (default: min(the model's, 2048))")
    attention_backend: str = _option("auto", "paged-attention implementation", ATTENTION_BACKENDS)
    tensor_parallel_size: int = _option(1, "devices the model is split over (Megatron-style, one mesh axis); must "
                                           "divide the number of devices")
    distributed_coordinator_address: str | None = _option(
        None, "multi-host: host:port of process 0's coordination service, the same on every process (default: "
              "$JAXPAGED_COORDINATOR_ADDRESS)")
    distributed_num_processes: int | None = _option(
        None, "multi-host: processes joined by jax.distributed (default: $JAXPAGED_NUM_PROCESSES, else 1); the mesh "
              "spans all their devices, so tensor_parallel_size must equal the total device count")
    distributed_process_id: int | None = _option(
        None, "multi-host: this process, 0 to num_processes - 1; 0 schedules and serves, the others run its steps "
              "(default: $JAXPAGED_PROCESS_ID, else 0)")
    distributed_heartbeat_timeout: int = _option(
        100, "multi-host: seconds of silence after which a process is declared dead and every process stops")
    distributed_initialization_timeout: int = _option(
        300, "multi-host: seconds the processes have to find each other at start-up")
    seed: int = _option(0, "seeds the per-request seeds of requests that give none")
    speculative_config: dict | SpeculativeConfig | None = _option(
        None, "speculative decoding, vLLM's keys: {\"method\": \"ngram\", \"num_speculative_tokens\": 4, "
              "\"prompt_lookup_max\": 4} (prompt lookup), or {\"draft_num_layers\": 8, \"num_speculative_tokens\": "
              "4} (a draft made of the model's own first layers), or {\"model\": PATH, \"quantization\": \"gguf\", "
              "\"num_speculative_tokens\": 3} (a draft model, e.g. the default GGUF kept 4-bit); JSON on the "
              "command line")
    async_scheduling: bool = _option(True, "schedule and dispatch each step before reading the previous one's "
                                           "tokens, so the device never waits for the host (beam search runs "
                                           "synchronously; grammars and multi-token bad words too, except on a GPU)")
    precompile: bool = _option(True, "compile every step shape at start-up (else lazily, when first used)")
    show_progress: bool = _option(True, "progress bars for start-up compilation")
    compilation_cache_dir: str | None = _option(
        None, "turn on JAX's persistent compilation cache in this directory (a process-wide jax.config setting, so "
              "the library leaves it off unless asked; `jaxpaged serve`, server.py and `jaxpaged generate` default to "
              "$JAXPAGED_COMPILATION_CACHE, else ~/.cache/jaxpaged/xla)")
    # "paged" allocates a block when the last one fills; "contiguous" reserves max_model_len slots per request up
    # front, the scheme of systems before PagedAttention (for the memory-waste benchmark)
    quantization: str | None = _option(
        None, "weights: None (full width in dtype; a GGUF file is dequantized at load), int8 (the layer matmuls and "
              "the LM head int8 per output channel), gguf (a GGUF file's Q8_0/Q4_0/Q4_1/Q4_K tensors kept as they "
              "are); quantized weights stay quantized in device memory and are dequantized inside the matmul",
        (None, "int8", "gguf"))
    kv_allocation: str = _option("paged", "paged, or contiguous (reserve max_model_len per request; benchmarks)",
                                 ("paged", "contiguous"))

    def __post_init__(self):
        for f in dataclasses.fields(self):
            _check_option(f.name, getattr(self, f.name), f.type, f.metadata["choices"])
        if self.seed < 0:
            raise ValueError(f"seed={self.seed} must be >= 0")
        if self.tensor_parallel_size < 1:
            raise ValueError(f"tensor_parallel_size={self.tensor_parallel_size} must be >= 1")
        # The per-concern configs check their ranges; build them now so a bad value fails before any loading.
        self.speculative()
        self.distributed_config()
        self.cache_config()
        self.scheduler_config(self.max_model_len)
        kv_quant.check_for_this_platform(self.kv_cache_dtype)  # an fp8 format this device's kernel cannot read

    @property
    def model_dtype(self) -> str:
        """`dtype` with "auto" resolved for this platform (`resolve_dtype`)."""
        return resolve_dtype(self.dtype)

    def speculative(self) -> SpeculativeConfig | None:
        """`speculative_config` as a checked SpeculativeConfig (None: no speculative decoding)."""
        return SpeculativeConfig.coerce(self.speculative_config)

    def distributed_config(self) -> DistributedConfig:
        """The multi-host options, each unset one from its environment variable (jaxpaged.parallel.multihost)."""
        return DistributedConfig.resolve(self.distributed_coordinator_address, self.distributed_num_processes,
                                         self.distributed_process_id, self.distributed_heartbeat_timeout,
                                         self.distributed_initialization_timeout)

    def cache_config(self) -> CacheConfig:
        return CacheConfig(block_size=self.block_size, kv_cache_memory=self.kv_cache_memory,
                           gpu_memory_utilization=self.gpu_memory_utilization, num_blocks=self.num_blocks,
                           enable_prefix_caching=self.enable_prefix_caching, swap_space=self.swap_space,
                           preemption_mode=self.preemption_mode, cache_dtype=self.kv_cache_dtype)

    def scheduler_config(self, max_model_len: int) -> SchedulerConfig:
        return SchedulerConfig(max_num_seqs=self.max_num_seqs, max_num_batched_tokens=self.max_num_batched_tokens,
                               max_prefill_tokens_while_decoding=self.max_prefill_tokens_while_decoding,
                               max_decode_slowdown=self.max_decode_slowdown, max_model_len=max_model_len,
                               policy=self.scheduling_policy)


_TYPES = {"int": int, "float": (int, float), "str": str, "bool": bool, "None": type(None), "dict": dict,
          "SpeculativeConfig": SpeculativeConfig}


def _check_option(name: str, value, annotation: str, choices: tuple | None) -> None:
    """Type and choice of one option, from its annotation ("int | None", "float", ...)."""
    allowed = [_TYPES[t.strip()] for t in annotation.split("|")]
    flat = tuple(t for a in allowed for t in (a if isinstance(a, tuple) else (a,)))
    if (isinstance(value, bool) and bool not in flat) or not isinstance(value, flat):
        raise TypeError(f"{name}={value!r} must be {annotation}, not {type(value).__name__}")
    if choices is not None and value not in choices:
        raise ValueError(f"{name}={value!r} is not supported; use one of {', '.join(map(str, choices))}")


def cpu_has_bf16_dots() -> bool:
    """Whether this CPU multiplies bfloat16 natively (x86 AVX512-BF16 or AMX-BF16, Arm BF16)."""
    try:
        with open("/proc/cpuinfo") as f:
            flags = next((line.split(":", 1)[1].split() for line in f if line.startswith(("flags", "Features"))), [])
    except OSError:
        return False
    return bool({"avx512_bf16", "amx_bf16", "bf16"} & set(flags))


def resolve_dtype(requested: str, platform: str | None = None) -> str:
    """The model dtype for `requested`: itself, or for "auto" bfloat16 on GPU and TPU and on CPUs with bfloat16 dot
    instructions, float32 on other CPUs (XLA would emulate bfloat16 dots there, slower than float32). On a CPU
    with native bfloat16 the throughput workload runs faster in bfloat16 than in float32 (benchmarks/throughput.py
    in README), so "auto" never picks the slower one."""
    if requested != "auto":
        return requested
    platform = platform or jax.default_backend()
    return "bfloat16" if platform != "cpu" or cpu_has_bf16_dots() else "float32"


def resolve_cache_dtype(requested: str, model_dtype, platform: str, writes_16bit: bool) -> jnp.dtype:
    """The K/V pool's dtype: `requested`, or for "auto" the model dtype, except float32 on CPU for 16-bit floats
    when the attention backend has no native K/V write (`writes_16bit` False: the pure-JAX reference).

    XLA CPU has no bfloat16/float16 scatter: it converts the whole pool to float32 and back around every K/V write,
    two copies of the pool per layer per step (a SmolLM2 decode step of 16 sequences: 6.0 s instead of 0.39 s,
    benchmarks/profile_steps.py in README). The native CPU backend writes rows in place in any dtype; without it a
    float32 pool costs twice the bytes per block and keeps the write in place; the weights stay in `dtype`.
    """
    model_dtype = jnp.dtype(model_dtype)
    slow_16bit = platform == "cpu" and not writes_16bit
    if requested != "auto":
        dtype = jnp.dtype(kv_quant.pool_dtype_of(requested))
        if slow_16bit and dtype.itemsize <= 2:
            logger.warning("kv_cache_dtype=%s on CPU without the native kernel: XLA CPU converts the whole pool to "
                           "float32 (float16 for fp8) and back on every K/V write (very slow); kv_cache_dtype='auto' "
                           "keeps a float32 pool", requested)
        return dtype
    if slow_16bit and model_dtype.itemsize == 2:
        return jnp.dtype(jnp.float32)
    return model_dtype


def choose_attention(backend: str, cache_dtype: str, model_dtype, head_dim: int) -> tuple[PagedAttention, jnp.dtype]:
    """The attention backend and the pool dtype for a model. A kernel that cannot take the model's head_dim or dtypes
    is an error naming why when asked for by name; under 'auto' the engine runs the reference instead (logged)."""
    attn = attention_backend(backend)
    pool_dtype = resolve_cache_dtype(cache_dtype, model_dtype, jax.default_backend(), attn.writes_16bit)
    refusal = attn.refusal(head_dim, model_dtype, pool_dtype)
    if refusal is None:
        return attn, pool_dtype
    if backend != "auto":
        raise ValueError(f"{refusal}; choose another dtype or attention_backend='reference'")
    logger.warning("attention_backend auto: %s; running the pure-JAX reference instead", refusal)
    attn = attention_backend("reference")
    return attn, resolve_cache_dtype(cache_dtype, model_dtype, jax.default_backend(), attn.writes_16bit)


def _kv_budget_bytes(cache: CacheConfig, block_bytes: int) -> int:
    if cache.kv_cache_memory is not None:
        return cache.kv_cache_memory
    device = jax.devices()[0]
    if device.platform == "cpu":
        return parse_bytes(DEFAULT_CPU_KV_MEMORY)
    stats = device.memory_stats() or {}
    limit = stats.get("bytes_limit")
    if not limit:
        raise ValueError(f"cannot read {device.platform} memory size; pass kv_cache_memory explicitly")
    in_use = stats.get("bytes_in_use", 0)  # the weights, already on the device
    # Activation peak: the largest step's temporaries, measured below by the caller's warm-up margin.
    activation_margin = int(0.05 * limit)
    budget = int(limit * cache.gpu_memory_utilization) - in_use - activation_margin
    if budget < block_bytes * 2:
        raise ValueError(f"no memory left for the KV cache: device has {limit / 2**30:.1f} GiB, weights use "
                         f"{in_use / 2**30:.1f} GiB, gpu_memory_utilization={cache.gpu_memory_utilization}; raise "
                         "it or use a smaller model")
    return budget


def split_model(model: nnx.Module, dtype, quantization: str | None = None) -> tuple[nnx.GraphDef, nnx.State]:
    """`nnx.split` once, at load: (graphdef, state) with floating-point parameters (`nnx.Param`) cast to `dtype` and
    every array on the default device. Other variables (e.g. a model's own constant buffers) keep their dtype.

    On CPU with a 16-bit dtype, the Llama family and Gemma 3 with tied embeddings first get a transposed copy of
    the LM head (`llama.keep_transposed_head`: XLA CPU converts a transposed 16-bit weight to float32 every step),
    and where every step's matmuls run by the native CPU kernel (`model_runner.native_matmul_rows`), their stacked
    bfloat16 layer matrices and the LM head are prepacked in its layout (`models.matmul.prepack_layer_weights`,
    `prepack_head`). `model` itself is left as it was.

    quantization="int8" quantizes the model first (`jaxpaged.quantize`); quantized weights (that, or a GGUF's kept
    formats) are laid out for the native quantized matmul where it runs (`quant_setup.native_quantized`)."""
    from jaxpaged.engine import quant_setup
    from jaxpaged.models import gemma3, llama
    from jaxpaged.models.matmul import prepack_head, prepack_layer_weights
    from jaxpaged.worker.step import native_matmul_rows

    built_in = isinstance(model, (llama.LlamaForCausalLM, gemma3.Gemma3ForCausalLM))
    tied_16bit = (built_in and model.config.tie_word_embeddings and jax.default_backend() == "cpu"
                  and jnp.dtype(dtype).itemsize == 2)
    prepack = built_in and jnp.dtype(dtype) == jnp.bfloat16 and native_matmul_rows(None) > 0
    if tied_16bit or prepack or quantization == "int8":
        # The caller's module stays as it was (`LLM.from_model`): quantization and the transposed head go on a copy,
        # which shares the arrays.
        model = nnx.clone(model)
    quant_setup.quantize_model(model, quantization)
    if tied_16bit and not quant_setup.is_quantized(model.embed[...]):  # a quantized tied head needs no transpose
        llama.keep_transposed_head(model, dtype)
    if prepack and getattr(model, "head_t", None) is not None:
        model.head_t = llama.TransposedHead(prepack_head(model.head_t[...]))
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)

    def cast(x):
        if quant_setup.is_quantized(x):
            return x  # quant_setup.prepare_for_device places it
        return jnp.asarray(x, dtype) if jnp.issubdtype(jnp.result_type(x), jnp.floating) else jnp.asarray(x)

    params = quant_setup.prepare_for_device(jax.tree.map(cast, params, is_leaf=quant_setup.is_quantized), dtype)
    if prepack:
        pure = prepack_layer_weights(nnx.to_pure_dict(params))
        if "lm_head" in pure:
            pure["lm_head"] = prepack_head(pure["lm_head"])
        nnx.replace_by_pure_dict(params, pure)
    return graphdef, nnx.merge_state(params, jax.tree.map(jnp.asarray, rest))


def split_model_tensor_parallel(model: nnx.Module, dtype, mesh, quantization: str | None = None):
    """The Llama-family or Gemma 3 `model` split over `mesh`: (graphdef, state, config) with heads laid out by
    `jaxpaged.parallel.tensor_parallel.HeadLayout` (config's head counts are the layout's slots) and every parameter
    placed straight into its shards (cast on the host first, so no device ever holds a whole split tensor). Both
    modules hold the loader's layout (`jaxpaged.loader.layout`), which is what the Megatron split names; Gemma 3's
    extra tensors (per-head q/k norms, post-attention and post-MLP norms) are per head_dim or per hidden unit and stay
    replicated. quantization="int8" quantizes the model first, as `split_model` does; quantized weights (that, or a
    GGUF's kept formats) are split as they are stored (`tensor_parallel`'s docstring)."""
    from jaxpaged.engine import quant_setup
    from jaxpaged.models import families, gemma3, llama
    from jaxpaged.parallel import tensor_parallel

    if not isinstance(model, (llama.LlamaForCausalLM, gemma3.Gemma3ForCausalLM)):
        raise ValueError(f"tensor_parallel_size > 1 splits the built-in modules (LlamaForCausalLM, "
                         f"Gemma3ForCausalLM); {type(model).__name__} is served with tensor_parallel_size=1")
    config, tp = model.config, mesh.size
    layout = tensor_parallel.HeadLayout.plan(config.num_heads, config.num_kv_heads, tp)
    (logger.info if layout.is_plain_split else logger.warning)(
        "tensor parallel %d: %s", tp, layout.describe(config.num_heads, config.num_kv_heads))
    if quantization == "int8":
        model = nnx.clone(model)  # the caller's module stays as it was (`LLM.from_model`)
    quant_setup.quantize_model(model, quantization)
    params = nnx.to_pure_dict(nnx.state(model, nnx.Param))
    if not layout.is_plain_split:
        params = tensor_parallel.expand_llama_params(jax.tree.map(np.asarray, params), layout, config.head_dim)
    specs = tensor_parallel.llama_partition_specs(params, tp)
    if all(_placed_as(x, mesh, spec, dtype) for x, spec in zip(
            jax.tree.leaves(params), jax.tree.leaves(specs, is_leaf=lambda s: isinstance(s, tensor_parallel.P)),
            strict=True)):
        placed = params  # restored straight into these shardings (an Orbax checkpoint)
    else:
        placed = tensor_parallel.place(params, specs, mesh, dtype)
    config = dataclasses.replace(config, num_heads=layout.num_heads, num_kv_heads=layout.num_kv_heads)
    graphdef, state = nnx.split(families.from_params(config, placed))
    return graphdef, state, config


def _placed_as(x, mesh, spec, dtype) -> bool:
    from jax.sharding import NamedSharding

    return isinstance(x, jax.Array) and x.dtype == dtype and x.sharding.is_equivalent_to(NamedSharding(mesh, spec),
                                                                                         x.ndim)


def build_runner(model: nnx.Module, config: EngineConfig):
    """Splits the model, sizes the pool, validates that a max-length sequence fits, and builds the ModelRunner
    (multi-host: the runner that announces each device op to the other processes first)."""
    model_config = model.config
    tp, mesh = config.tensor_parallel_size, None
    if tp > 1:
        from jaxpaged.parallel import tensor_parallel

        tensor_parallel.check_tensor_parallel_size(tp)
        mesh = tensor_parallel.make_mesh(tp)
    from jaxpaged.parallel.multihost import check_mesh_spans_processes

    check_mesh_spans_processes(tp)
    cache = config.cache_config()
    max_model_len = config.max_model_len or min(model_config.max_position_embeddings, 2048)
    if max_model_len > model_config.max_position_embeddings:
        raise ValueError(f"max_model_len={max_model_len} exceeds the model's context of "
                         f"{model_config.max_position_embeddings} tokens")
    spec_width, draft_layers = speculation(config.speculative(), model)
    sched = config.scheduler_config(max_model_len)
    if config.compilation_cache_dir is not None:  # asked for: it changes jax.config for the whole process
        enable_compilation_cache(config.compilation_cache_dir)

    dtype = jnp.dtype(config.model_dtype)
    if config.dtype == "auto":
        logger.info("dtype auto: %s on %s%s", dtype.name, jax.default_backend(),
                    " (bfloat16 dot instructions)" if dtype == jnp.bfloat16 and jax.default_backend() == "cpu" else "")
    if mesh is None:
        graphdef, state = split_model(model, dtype, config.quantization)
    else:
        graphdef, state, model_config = split_model_tensor_parallel(model, dtype, mesh, config.quantization)
    attn, cache_dtype = choose_attention(config.attention_backend, cache.cache_dtype, dtype, model_config.head_dim)
    draft, draft_config = draft_model(config.speculative(), model, config, dtype, attn, cache_dtype)
    attn = kv_quant.with_scales(attn, cache_dtype, model_config.num_layers, model_config.head_dim,  # fp8 scales
                                keys_normalized=kv_quant.keys_normalized(model_config))
    # One device's bytes of a K + V block: on TPU with the row-major pool's tile padding (2.67x for SmolLM2 in
    # bfloat16); under tensor parallelism its share of the kv heads (the budget is per device, as vLLM's).
    device_spec = dataclasses.replace(model_config, num_kv_heads=model_config.num_kv_heads // tp) if tp > 1 \
        else model_config
    fmt = pool_format(jax.devices()[0])
    block_bytes = pool_block_bytes(device_spec, cache.block_size, cache_dtype, fmt)
    kv_quant.warn_without_saving(device_spec, cache.block_size, cache_dtype, block_bytes, fmt)
    # A draft model's pool has a block for each of the target's: the budget pays for both.
    draft_block_bytes = pool_block_bytes(draft_config, cache.block_size, cache_dtype, fmt) if draft else 0
    if cache.num_blocks is not None:
        num_blocks = cache.num_blocks
    else:
        num_blocks = _kv_budget_bytes(cache, block_bytes + draft_block_bytes) // (block_bytes + draft_block_bytes)
    usable = num_blocks - 1  # block 0 is the null block that padding writes into
    blocks_per_seq = -(-max_model_len // cache.block_size)
    if usable < blocks_per_seq:
        raise ValueError(
            f"the KV pool holds {usable} blocks ({usable * cache.block_size} tokens) but one sequence of "
            f"max_model_len={max_model_len} needs {blocks_per_seq} blocks of {cache.block_size}; give it more memory "
            f"(kv_cache_memory, at least {(blocks_per_seq + 1) * block_bytes / 2**20:.1f} MiB) or lower max_model_len")
    logger.info("KV pool: %d blocks of %d tokens (%.1f MiB) = %d tokens, %.1f sequences of max_model_len=%d",
                usable, cache.block_size, num_blocks * block_bytes / 2**20, usable * cache.block_size,
                usable / blocks_per_seq, max_model_len)
    logger.info("KV cache format: %s, %d bytes per token (K and V, all layers, on each device)",
                kv_quant.describe(cache_dtype, getattr(attn, "kv_scales", None)), block_bytes // cache.block_size)
    if jax.default_backend() == "cpu":
        _log_native_kernels(attn.name, dtype, mesh, config.quantization is not None)
    sharding = None
    runner_class = ModelRunner
    if mesh is not None:
        from jaxpaged.parallel import multihost
        from jaxpaged.parallel.tensor_parallel import ShardedAttention, pool_sharding

        attn = ShardedAttention(attn, mesh)
        sharding = pool_sharding(mesh)
        if any(d.process_index != jax.process_index() for d in mesh.devices.flat):
            runner_class = multihost.MultihostRunner
    runner = runner_class(graphdef, state, model_config, num_blocks=num_blocks, block_size=cache.block_size,
                          max_model_len=max_model_len, max_num_seqs=sched.max_num_seqs,
                          max_num_batched_tokens=sched.max_num_batched_tokens, attn=attn, cache_dtype=cache_dtype,
                          block_bytes=block_bytes, mesh=mesh, pool_sharding=sharding,
                          truncate_tables=config.kv_allocation == "contiguous", spec_width=spec_width,
                          draft_layers=draft_layers, draft=draft)
    if mesh is not None:
        _log_device_bytes(runner)
    from jaxpaged.engine import quant_setup

    # Engine.stats() reports it
    runner.weight_info = quant_setup.describe_weights(state, config.quantization, tensor_parallel=mesh is not None)
    return runner, cache, sched, max_model_len


def speculation(spec: SpeculativeConfig | None, model: nnx.Module) -> tuple[int, int]:
    """(proposals a step may verify per sequence, layers of the self-speculative draft; 0 for none) for the model.
    The draft of `draft_num_layers` is the model's own first layers (the built-in models' `num_layers=` call): same
    weights, same KV pool. A draft model (`speculative_config.model`) is `draft_model`'s."""
    if spec is None:
        return 0, 0
    if spec.method == "ngram" or spec.model is not None:
        return spec.num_speculative_tokens, 0
    from jaxpaged.models import gemma3, llama

    if not isinstance(model, (llama.LlamaForCausalLM, gemma3.Gemma3ForCausalLM)):
        raise ValueError(f"speculative_config.draft_num_layers makes a draft of a built-in model's first layers "
                         f"(LlamaForCausalLM, Gemma3ForCausalLM), not {type(model).__name__}; use method='ngram'")
    spec.check_target(model.config.num_layers)
    return spec.num_speculative_tokens, spec.draft_num_layers


def draft_model(spec: SpeculativeConfig | None, model: nnx.Module, config: EngineConfig, dtype, base_attn,
                cache_dtype) -> tuple[DraftModel | None, ModelSpec | None]:
    """The separate draft model of `speculative_config.model` (a path or a module with the target's vocabulary),
    split as the target is, with an attention backend of its own shapes; (None, None) without one."""
    if spec is None or spec.model is None:
        return None, None
    from jaxpaged.spec_decode.draft import load_draft

    if config.tensor_parallel_size > 1:
        raise ValueError("speculative_config.model: a draft model runs with tensor_parallel_size=1 (use "
                         "draft_num_layers or method='ngram' under tensor parallelism)")
    draft = load_draft(spec, model, config.model_dtype)  # the vocabulary checked before its weights load
    refusal = base_attn.refusal(draft.config.head_dim, dtype, cache_dtype)
    if refusal is not None:
        raise ValueError(f"speculative_config.model: {refusal}")
    graphdef, state = split_model(draft, dtype, spec.quantization)
    attn = kv_quant.with_scales(base_attn, cache_dtype, draft.config.num_layers, draft.config.head_dim,
                                keys_normalized=kv_quant.keys_normalized(draft.config))
    return DraftModel(graphdef, state, draft.config, attn), draft.config


def _log_native_kernels(attention: str, dtype, mesh, quantized: bool = False) -> None:
    """One INFO line: which native CPU kernels (pallas_kernels/cpu_native) this engine's steps run, which are built
    but unused, which are unavailable here and why. The attention kernel with a native backend; the sampler's argmax,
    penalties, top-k / top-p threshold and Gumbel draw where the layer matmuls run natively (`native_matmul_rows`),
    and those matmuls, the norms and rope with a bfloat16 model; the quantized matmul with quantized weights and no
    tensor-parallel mesh."""
    from jaxpaged.engine import quant_setup
    from jaxpaged.worker.step import native_matmul_rows
    from pallas_kernels import cpu_native

    in_use = ["attention"] if attention in ("native", "native_else_reference") else []
    if native_matmul_rows(mesh) > 0:
        in_use += ["argmax", "penalties", "top_p", "gumbel", "logprobs"]
        in_use += ["matmul", "norm", "rope"] if jnp.dtype(dtype) == jnp.bfloat16 else []
    if quantized and quant_setup.native_quantized() and mesh is None:  # a mesh: XLA's dot (partitioned_products)
        in_use.append("qmatmul")
    logger.info("%s", cpu_native.describe(in_use))


def _log_device_bytes(runner: ModelRunner) -> None:
    from jaxpaged.parallel.tensor_parallel import per_device_bytes

    weights, pool = per_device_bytes(runner.params), per_device_bytes(runner.kv_pool)
    for device in runner.mesh.devices.flat:
        if device in weights:  # this process's devices
            logger.info("tensor parallel: %s holds %.1f MiB of weights and %.1f MiB of KV pool", device,
                        weights[device] / 2**20, pool.get(device, 0) / 2**20)


__all__ = ["EngineConfig", "build_runner"]
