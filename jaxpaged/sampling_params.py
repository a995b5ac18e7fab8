"""Per-request sampling options, shaped like vLLM's `SamplingParams`."""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass
class SamplingParams:
    """How one request samples and when it stops.

    temperature 0 is greedy. top_k <= 0 and top_p = 1 and min_p = 0 disable those filters. A request with a `seed`
    gives the same tokens whatever else is in the batch (its PRNG key depends only on the seed and the position).
    """

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0
    seed: int | None = None
    max_tokens: int | None = 16  # None: up to the context length
    min_tokens: int = 0
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    include_stop_str_in_output: bool = False
    logprobs: int | None = None  # return the chosen token's logprob (and the top-k ones if > 0)
    skip_special_tokens: bool = True

    def __post_init__(self):
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop or [])
        self.stop_token_ids = list(self.stop_token_ids or [])
        if self.n < 1:
            raise ValueError(f"n={self.n} must be >= 1")
        if self.temperature < 0:
            raise ValueError(f"temperature={self.temperature} must be >= 0 (0 is greedy)")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p={self.top_p} must be in (0, 1]")
        if self.top_k is None:
            self.top_k = -1
        if not isinstance(self.top_k, int) or (self.top_k < -1):
            raise ValueError(f"top_k={self.top_k} must be -1 or 0 (disabled) or a positive integer")
        if not 0.0 <= self.min_p <= 1.0:
            raise ValueError(f"min_p={self.min_p} must be in [0, 1]")
        if self.max_tokens is not None and self.max_tokens < 1:
            raise ValueError(f"max_tokens={self.max_tokens} must be >= 1")
        if self.min_tokens < 0:
            raise ValueError(f"min_tokens={self.min_tokens} must be >= 0")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise ValueError(f"min_tokens={self.min_tokens} must be <= max_tokens={self.max_tokens}")
        if self.seed is not None and not 0 <= self.seed < 2**63:
            raise ValueError(f"seed={self.seed} must be in [0, 2**63)")
        if self.logprobs is not None and not 0 <= self.logprobs <= 20:
            raise ValueError(f"logprobs={self.logprobs} must be in [0, 20]")
        if any(not s for s in self.stop):
            raise ValueError("stop strings must be non-empty")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0
