"""The step loop: requests in, scheduled and executed steps, outputs out (detokenized, stopped, beam-searched)."""

from jaxpaged.engine.llm_engine import Engine, EngineDeadError

__all__ = ["Engine", "EngineDeadError"]
