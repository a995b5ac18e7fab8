"""`SpeculativeConfig`: what `LLM(speculative_config={...})` and the server's flags ask for, checked before anything
loads. Names are vLLM's (`method`, `num_speculative_tokens`, `prompt_lookup_min`, `prompt_lookup_max`, `model`,
`disable_by_batch_size`), so a vLLM user's dict works here as it is; jaxpaged adds `draft_num_layers` (a draft made
from the target's own first layers) and the per-request low-acceptance switch-off.

    SpeculativeConfig.from_dict({"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 3})
    SpeculativeConfig.from_dict({"model": "/path/to/draft", "num_speculative_tokens": 4})   # method inferred
    SpeculativeConfig.from_dict({"draft_num_layers": 8, "num_speculative_tokens": 4})       # the target's 8 layers

Low acceptance, per request (`min_acceptance_rate`, `acceptance_window`, `acceptance_cooldown`): a request whose
accepted / proposed ratio over its last `acceptance_window` verification steps (steps where it proposed at least one
token) is below `min_acceptance_rate` stops proposing for `acceptance_cooldown` of its decode steps, decoding one
token per step meanwhile, then starts over with an empty window (0 = never again). Verifying k rejected tokens costs
k extra query tokens of target compute per step for nothing; a request that has stopped copying its prompt (n-gram)
or that the draft mispredicts wastes them every step. The cooldown lets it come back when its text changes (a
summary that starts quoting). The decision is the gate's (`jaxpaged.spec_decode.gate`); `min_acceptance_rate=0`
(the default) never switches a request off.
"""

from __future__ import annotations

import dataclasses
import os
from typing import Any

MAX_SPECULATIVE_TOKENS = 16  # k above this verifies mostly rejected tokens; it also bounds the step's query width
SPECULATIVE_METHODS = ("ngram", "draft_model")
# vLLM's defaults when neither bound is given (its ngram proposer's "arbitrarily chosen" 5, 5)
DEFAULT_PROMPT_LOOKUP = 5


@dataclasses.dataclass(frozen=True)
class SpeculativeConfig:
    """Speculative decoding: propose `num_speculative_tokens` tokens per sequence per step, verify them in one target
    step. Build it with `from_dict` (or directly); every field is validated here, errors name the field."""

    num_speculative_tokens: int
    # "ngram" (prompt lookup) or "draft_model"; None: "draft_model" when `model` or `draft_num_layers` is given
    # (vLLM infers it from `model`), and `model="ngram"` means the ngram method as in vLLM.
    method: str | None = None
    prompt_lookup_min: int | None = None  # ngram: shortest suffix matched (default: prompt_lookup_max, else 5)
    prompt_lookup_max: int | None = None  # ngram: longest suffix matched (default: prompt_lookup_min, else 5)
    model: Any = None  # draft_model: a model path (str / PathLike) or a flax.nnx module with the target's vocabulary
    draft_num_layers: int | None = None  # draft_model without `model`: the target's own first N layers
    disable_by_batch_size: int | None = None  # no speculation in a step that runs more than this many requests
    min_acceptance_rate: float = 0.0  # per request; 0 = never switch a request off (see the module docstring)
    acceptance_window: int = 32  # verification steps the rate is measured over
    acceptance_cooldown: int = 256  # decode steps a switched-off request waits before trying again; 0 = never
    # a draft model's weights (vLLM's key): None, "int8", or "gguf" (a GGUF draft kept in its file's formats: e.g.
    # the target's own 4-bit file as its draft)
    quantization: str | None = None

    def __post_init__(self):
        k = self.num_speculative_tokens
        _check_int("num_speculative_tokens", k)
        if not 1 <= k <= MAX_SPECULATIVE_TOKENS:
            raise ValueError(f"speculative_config.num_speculative_tokens={k} must be between 1 and "
                             f"{MAX_SPECULATIVE_TOKENS}")
        method = self.method
        if method is not None and not isinstance(method, str):
            raise TypeError(f"speculative_config.method must be a string, got {type(method).__name__}")
        if method == "[ngram]":  # vLLM's older spelling
            method = "ngram"
        if isinstance(self.model, str) and self.model in ("ngram", "[ngram]"):  # vLLM: model="ngram"
            if method not in (None, "ngram"):
                raise ValueError(f"speculative_config.model={self.model!r} names the ngram method, but "
                                 f"method={self.method!r}")
            method = "ngram"
            object.__setattr__(self, "model", None)
        if method is None:
            if self.model is None and self.draft_num_layers is None:
                raise ValueError("speculative_config.method is missing: give method='ngram', or a draft "
                                 "(`model`: a path or an nnx module; or `draft_num_layers`: the target's first layers)")
            method = "draft_model"
        if method not in SPECULATIVE_METHODS:
            raise ValueError(f"speculative_config.method={method!r} is not supported; use one of "
                             f"{', '.join(SPECULATIVE_METHODS)}")
        object.__setattr__(self, "method", method)
        if method == "ngram":
            self._check_ngram()
        else:
            self._check_draft()
        if self.disable_by_batch_size is not None:
            _check_int("disable_by_batch_size", self.disable_by_batch_size)
            if self.disable_by_batch_size < 2:  # as vLLM: 1 would mean never speculating once a second request runs
                raise ValueError(f"speculative_config.disable_by_batch_size={self.disable_by_batch_size} must be "
                                 ">= 2 (or None: never disabled by batch size)")
        rate = self.min_acceptance_rate
        if isinstance(rate, bool) or not isinstance(rate, (int, float)):
            raise TypeError(f"speculative_config.min_acceptance_rate must be a number, got {type(rate).__name__}")
        if not 0.0 <= rate <= 1.0:
            raise ValueError(f"speculative_config.min_acceptance_rate={rate} must be between 0 and 1 (0 = off)")
        object.__setattr__(self, "min_acceptance_rate", float(rate))
        _check_int("acceptance_window", self.acceptance_window)
        if self.acceptance_window < 1:
            raise ValueError(f"speculative_config.acceptance_window={self.acceptance_window} must be >= 1")
        _check_int("acceptance_cooldown", self.acceptance_cooldown)
        if self.acceptance_cooldown < 0:
            raise ValueError(f"speculative_config.acceptance_cooldown={self.acceptance_cooldown} must be >= 0 "
                             "(0 = a switched-off request never speculates again)")
        self._check_quantization()

    def _check_ngram(self) -> None:
        for name in ("model", "draft_num_layers"):
            if getattr(self, name) is not None:
                raise ValueError(f"speculative_config.{name} is for method='draft_model'; the ngram method proposes "
                                 "from the sequence itself and takes no draft model")
        lo, hi = self.prompt_lookup_min, self.prompt_lookup_max
        for name, value in (("prompt_lookup_min", lo), ("prompt_lookup_max", hi)):
            if value is not None:
                _check_int(name, value)
                if value < 1:
                    raise ValueError(f"speculative_config.{name}={value} must be >= 1")
        # vLLM's defaults: one bound given sets the other; none gives 5 and 5.
        lo, hi = (lo if lo is not None else hi), (hi if hi is not None else lo)
        lo, hi = (lo or DEFAULT_PROMPT_LOOKUP), (hi or DEFAULT_PROMPT_LOOKUP)
        if lo > hi:
            raise ValueError(f"speculative_config.prompt_lookup_min={lo} must be <= prompt_lookup_max={hi}")
        object.__setattr__(self, "prompt_lookup_min", lo)
        object.__setattr__(self, "prompt_lookup_max", hi)

    def _check_quantization(self) -> None:
        if self.quantization not in (None, "int8", "gguf"):
            raise ValueError(f"speculative_config.quantization={self.quantization!r}: use None, 'int8' or 'gguf'")
        if self.quantization is not None and self.model is None:
            raise ValueError("speculative_config.quantization is for a draft model (speculative_config.model)")

    def _check_draft(self) -> None:
        for name in ("prompt_lookup_min", "prompt_lookup_max"):
            if getattr(self, name) is not None:
                raise ValueError(f"speculative_config.{name} is for method='ngram', not {self.method!r}")
        model, layers = self.model, self.draft_num_layers
        if model is not None and layers is not None:
            raise ValueError("speculative_config: give either `model` (a separate draft) or `draft_num_layers` "
                             "(the target's own first layers), not both")
        if model is None and layers is None:
            raise ValueError("speculative_config.model is missing: method='draft_model' needs `model` (a path or an "
                             "nnx module) or `draft_num_layers` (the target's first N layers as the draft)")
        if layers is not None:
            _check_int("draft_num_layers", layers)
            if layers < 1:
                raise ValueError(f"speculative_config.draft_num_layers={layers} must be >= 1")
        if model is not None and not isinstance(model, (str, os.PathLike)) and not _is_nnx_module(model):
            raise TypeError("speculative_config.model must be a path (str) or a flax.nnx.Module, got "
                            f"{type(model).__name__}")

    def check_target(self, num_layers: int) -> None:
        """Raises ValueError when `draft_num_layers` exceeds the target's `num_layers` (known once it is loaded)."""
        if self.draft_num_layers is not None and self.draft_num_layers > num_layers:
            raise ValueError(f"speculative_config.draft_num_layers={self.draft_num_layers} exceeds the target "
                             f"model's {num_layers} layers")

    @classmethod
    def from_dict(cls, d: dict) -> SpeculativeConfig:
        """The config from `LLM(speculative_config={...})` / the server's JSON flag. Unknown keys are refused by name
        (a typo must not silently turn speculation off)."""
        if not isinstance(d, dict):
            raise TypeError(f"speculative_config must be a dict (or a SpeculativeConfig), got {type(d).__name__}")
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(str(key) for key in d if key not in known)
        if unknown:
            raise ValueError(f"speculative_config has unknown key(s) {', '.join(map(repr, unknown))}; known keys: "
                             f"{', '.join(sorted(known))}")
        if "num_speculative_tokens" not in d:
            raise ValueError("speculative_config.num_speculative_tokens is missing: how many tokens to propose per "
                             f"step (1 to {MAX_SPECULATIVE_TOKENS})")
        return cls(**d)

    @classmethod
    def coerce(cls, value: SpeculativeConfig | dict | None) -> SpeculativeConfig | None:
        """None, a SpeculativeConfig or a dict (`from_dict`) -> SpeculativeConfig or None."""
        if value is None or isinstance(value, SpeculativeConfig):
            return value
        return cls.from_dict(value)


def _check_int(name: str, value) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"speculative_config.{name} must be an integer, got {type(value).__name__} {value!r}")


def _is_nnx_module(value) -> bool:
    try:
        from flax import nnx
    except ImportError:  # pragma: no cover - flax is a dependency
        return False
    return isinstance(value, nnx.Module)
