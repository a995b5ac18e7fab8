"""jaxpaged: PagedAttention LLM inference on JAX.

    from jaxpaged import LLM, SamplingParams
    llm = LLM(max_num_seqs=8)                     # the default model; LLM(model="path", **EngineOptions)
    llm.generate(["Hello"], SamplingParams(max_tokens=16))

Bring your own `flax.nnx` model: it follows `CausalLM` (called with a `KVPool`, an `AttentionMetadata` and an
`AttentionBackend`; its `config` has the `ModelSpec` fields) and is served by `LLM.from_model`. Importing jaxpaged,
or building an engine with default options, changes no process-wide setting: `jax.config` is touched only when an
option asks (`compilation_cache_dir`) or an entry point does (`jaxpaged serve`, server.py, `jaxpaged generate`).
"""

from jaxpaged.config import ModelConfig
from jaxpaged.engine import Engine
from jaxpaged.engine.beam_search import BeamSearchOutput, BeamSearchParams, BeamSearchSequence
from jaxpaged.engine.options import EngineOptions
from jaxpaged.engine.setup import EngineConfig
from jaxpaged.entrypoints.llm import LLM
from jaxpaged.models.contract import CausalLM, ModelSpec
from jaxpaged.models.quantize import quantize
from jaxpaged.outputs import CompletionOutput, Logprob, RequestOutput
from jaxpaged.sampling_params import RequestOutputKind, SamplingParams
from jaxpaged.worker.attention import AttentionBackend, AttentionMetadata, KVPool

__all__ = ["LLM", "AttentionBackend", "AttentionMetadata", "BeamSearchOutput", "BeamSearchParams",
           "BeamSearchSequence", "CausalLM", "CompletionOutput", "Engine", "EngineConfig", "EngineOptions", "KVPool",
           "Logprob", "ModelConfig", "ModelSpec", "RequestOutput", "RequestOutputKind", "SamplingParams", "quantize"]
