"""jaxpaged: PagedAttention LLM inference on JAX."""

from jaxpaged.engine import Engine
from jaxpaged.engine.beam_search import BeamSearchOutput, BeamSearchParams, BeamSearchSequence
from jaxpaged.engine.setup import EngineConfig
from jaxpaged.entrypoints.llm import LLM
from jaxpaged.models.quantize import quantize
from jaxpaged.outputs import CompletionOutput, RequestOutput
from jaxpaged.sampling_params import RequestOutputKind, SamplingParams

__all__ = ["LLM", "BeamSearchOutput", "BeamSearchParams", "BeamSearchSequence", "CompletionOutput", "Engine",
           "EngineConfig", "RequestOutput", "RequestOutputKind", "SamplingParams", "quantize"]
