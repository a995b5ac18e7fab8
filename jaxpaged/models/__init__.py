"""Models as `flax.nnx` modules behind one contract (`jaxpaged.models.contract`)."""

from jaxpaged.models.contract import CausalLM, ModelSpec, check_model

__all__ = ["CausalLM", "ModelSpec", "check_model"]
