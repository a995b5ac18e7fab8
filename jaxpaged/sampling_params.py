"""Per-request sampling options, shaped like vLLM's `SamplingParams`.

Every field is checked when the object is built (types, ranges, finiteness), so the Python API and the HTTP server
share one set of rules and nothing bad reaches a step: a wrong type is a TypeError, a value out of range a
ValueError, and both messages start with the field's name. What needs the model (token ids below the vocabulary
size) is checked by `check_against_model`, which the engine calls before it queues the request.
"""

from __future__ import annotations

import dataclasses
import enum
import math
import numbers

MAX_N = 128  # samples per request
MAX_LOGPROBS = 20  # the sampler computes the top-k log-probs at this fixed width, so `logprobs` never changes a shape
MAX_STOP_STRINGS = 16
MAX_STOP_STRING_CHARS = 1024
MAX_STOP_TOKEN_IDS = 256
MAX_TOKENS = 2**31 - 1  # the device batch holds token counts as int32
MAX_TOP_K = 2**31 - 1
MAX_SEED = 2**63
MAX_LOGIT_BIAS = 300  # entries; the sampler holds them at this fixed width
MAX_BAD_WORDS = 64
MAX_ALLOWED_TOKEN_IDS = 1 << 18  # as many as the largest vocabularies hold
MAX_BAD_WORD_CHARS = 256
MAX_PENALTY = 2.0  # presence / frequency penalties, as OpenAI bounds them
# Temperatures below this are greedy: logits / 1e-300 overflows float32 and the argmax is what such a request means.
GREEDY_TEMPERATURE = 1e-5
# The sampler holds temperature and repetition_penalty in float32: a value past float32's range becomes inf or 0 there,
# and a logit that is -inf (banned, or outside a grammar) divided by an infinite temperature is NaN, which the argmax
# can pick. Beyond these bounds a distribution is flat (or a penalty total) to float32 precision anyway.
MAX_TEMPERATURE = 1e6
REPETITION_PENALTY_RANGE = (1e-6, 1e6)


def _int(name: str, value, lo: int, hi: int, none_ok: bool = False) -> None:
    """An int (bool and float are refused: `n=2.5` and `max_tokens=True` are mistakes) in [lo, hi]."""
    if value is None and none_ok:
        return
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise TypeError(f"{name}={value!r} must be an integer, not {type(value).__name__}")
    if not lo <= value <= hi:
        raise ValueError(f"{name}={value} must be in [{lo}, {hi}]")


def _float(name: str, value) -> float:
    """A finite real number (an int is fine); returns it as a float."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"{name}={value!r} must be a number, not {type(value).__name__}")
    value = float(value)
    if not math.isfinite(value):
        raise ValueError(f"{name}={value} must be finite")
    return value


def _bool(name: str, value) -> None:
    if not isinstance(value, bool):
        raise TypeError(f"{name}={value!r} must be True or False, not {type(value).__name__}")


STRUCTURED_KINDS = ("json", "regex", "choice", "grammar", "json_object")
MAX_CHOICES = 256


@dataclasses.dataclass
class StructuredOutputsParams:
    """Constrains the output to a grammar (vLLM's names): exactly one of a JSON schema (a dict or its JSON text),
    a regex, a list of choices, a Lark / GBNF grammar, or `json_object=True` (any JSON object).

    The spec is checked here: input limits (size, nesting, $refs, definitions, rules; `grammar_guard`), then the
    grammar engine (llguidance) in a worker process, so an invalid or too costly schema is a ValueError that names
    the field: "structured_outputs.json: ..."."""

    json: dict | str | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None

    def __post_init__(self):
        given = [k for k in STRUCTURED_KINDS if getattr(self, k) not in (None, False)]
        if len(given) != 1:
            raise ValueError(f"structured_outputs must set exactly one of {', '.join(STRUCTURED_KINDS)}; "
                             f"got {', '.join(given) or 'none'}")
        kind = given[0]
        value = getattr(self, kind)
        if kind == "json" and not isinstance(value, (dict, str)):
            raise TypeError(f"structured_outputs.json must be a JSON schema (a dict or its JSON text), "
                            f"not {type(value).__name__}")
        if kind in ("regex", "grammar") and (not isinstance(value, str) or not value):
            raise TypeError(f"structured_outputs.{kind} must be a non-empty string")
        if kind == "choice":
            if not isinstance(value, (list, tuple)) or not value or len(value) > MAX_CHOICES:
                raise ValueError(f"structured_outputs.choice must be a list of 1 to {MAX_CHOICES} strings")
            if not all(isinstance(c, str) and c for c in value):
                raise TypeError("structured_outputs.choice must hold non-empty strings")
            self.choice = list(value)
        if kind == "json_object" and value is not True:
            raise TypeError(f"structured_outputs.json_object must be True or unset, not {value!r}")
        from jaxpaged.engine.grammar_guard import check_limits
        from jaxpaged.engine.structured_output import validate

        # The limits first, on the value as given: a schema dict nested 10,000 deep never reaches json.dumps.
        if kind != "json_object":
            check_limits(f"structured_outputs.{kind}", kind, value)
        validate(self.kind, self.spec)

    @property
    def kind(self) -> str:
        return next(k for k in STRUCTURED_KINDS if getattr(self, k) not in (None, False))

    @property
    def spec(self) -> str:
        """The spec as one string (the grammar cache's key with `kind`)."""
        import json as _json

        value = getattr(self, self.kind)
        if self.kind == "json" and isinstance(value, str):
            return value
        return _json.dumps(value, sort_keys=True) if self.kind in ("json", "choice") else str(value)


class RequestOutputKind(enum.IntEnum):
    """What each `RequestOutput` of a request carries (vLLM's names): everything so far, only what is new since the
    previous output, or one output when the request finishes (what `LLM.generate` asks for)."""

    CUMULATIVE = 0
    DELTA = 1
    FINAL_ONLY = 2


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
    # vLLM's: each prompt token's logprob given the tokens before it (the first has none), and the top-k ones
    prompt_logprobs: int | None = None
    skip_special_tokens: bool = True
    detokenize: bool = True  # vLLM's: False gives token ids only (text ""), saving the decoding
    presence_penalty: float = 0.0  # OpenAI's: minus this for every token generated at least once
    frequency_penalty: float = 0.0  # minus this times how often each token was generated
    repetition_penalty: float = 1.0  # HF's: logits of prompt or generated tokens divided (> 0) or multiplied by it
    logit_bias: dict[int, float] | None = None  # token id -> added to its logit, in [-100, 100]
    bad_words: list[str] | None = None  # words whose tokens may not be generated
    allowed_token_ids: list[int] | None = None  # vLLM's: only these tokens may be generated
    structured_outputs: StructuredOutputsParams | None = None
    output_kind: RequestOutputKind = RequestOutputKind.CUMULATIVE
    # vLLM's: only the prompt's last k tokens are kept (a BOS the tokenizer put first stays first); -1: max_model_len
    truncate_prompt_tokens: int | None = None

    def __post_init__(self):
        _int("n", self.n, 1, MAX_N)
        self.temperature = _float("temperature", self.temperature)
        if not 0 <= self.temperature <= MAX_TEMPERATURE:
            raise ValueError(f"temperature={self.temperature} must be in [0, {MAX_TEMPERATURE:g}] (0 is greedy)")
        if self.temperature < GREEDY_TEMPERATURE:
            self.temperature = 0.0
        self.top_p = _float("top_p", self.top_p)
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p={self.top_p} must be in (0, 1]")
        if self.top_k is None:
            self.top_k = -1
        _int("top_k", self.top_k, -1, MAX_TOP_K)  # -1 and 0 disable it
        self.min_p = _float("min_p", self.min_p)
        if not 0.0 <= self.min_p <= 1.0:
            raise ValueError(f"min_p={self.min_p} must be in [0, 1]")
        _int("seed", self.seed, 0, MAX_SEED - 1, none_ok=True)
        _int("max_tokens", self.max_tokens, 1, MAX_TOKENS, none_ok=True)
        _int("min_tokens", self.min_tokens, 0, MAX_TOKENS)
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise ValueError(f"min_tokens={self.min_tokens} must be <= max_tokens={self.max_tokens}")
        _int("logprobs", self.logprobs, 0, MAX_LOGPROBS, none_ok=True)
        _int("prompt_logprobs", self.prompt_logprobs, 0, MAX_LOGPROBS, none_ok=True)
        for name in ("ignore_eos", "include_stop_str_in_output", "skip_special_tokens", "detokenize"):
            _bool(name, getattr(self, name))
        self.stop = self._stop_strings(self.stop)
        if self.stop and not self.detokenize:
            raise ValueError("detokenize=False cannot look for stop strings: they are found in the text")
        self.stop_token_ids = self._stop_token_ids(self.stop_token_ids)
        for name in ("presence_penalty", "frequency_penalty"):
            value = _float(name, getattr(self, name))
            if not -MAX_PENALTY <= value <= MAX_PENALTY:
                raise ValueError(f"{name}={value} must be in [-{MAX_PENALTY}, {MAX_PENALTY}]")
            setattr(self, name, value)
        self.repetition_penalty = _float("repetition_penalty", self.repetition_penalty)
        lo, hi = REPETITION_PENALTY_RANGE
        if not lo <= self.repetition_penalty <= hi:
            raise ValueError(f"repetition_penalty={self.repetition_penalty} must be in [{lo:g}, {hi:g}] (1 is off)")
        self.logit_bias = self._logit_bias(self.logit_bias)
        self.bad_words = self._bad_words(self.bad_words)
        self.allowed_token_ids = self._allowed_token_ids(self.allowed_token_ids)
        if isinstance(self.structured_outputs, dict):
            self.structured_outputs = StructuredOutputsParams(**self.structured_outputs)
        if self.structured_outputs is not None and not isinstance(self.structured_outputs, StructuredOutputsParams):
            raise TypeError(f"structured_outputs must be a StructuredOutputsParams, "
                            f"not {type(self.structured_outputs).__name__}")
        _int("output_kind", self.output_kind, 0, len(RequestOutputKind) - 1)
        self.output_kind = RequestOutputKind(self.output_kind)
        _int("truncate_prompt_tokens", self.truncate_prompt_tokens, -1, MAX_TOKENS, none_ok=True)
        if self.truncate_prompt_tokens == 0:
            raise ValueError("truncate_prompt_tokens=0 must be -1 (the context length) or >= 1 (tokens kept)")

    @staticmethod
    def _stop_strings(stop) -> list[str]:
        if stop is None:
            return []
        if isinstance(stop, str):
            stop = [stop]
        if not isinstance(stop, (list, tuple)):
            raise TypeError(f"stop={stop!r} must be a string or a list of strings")
        if len(stop) > MAX_STOP_STRINGS:
            raise ValueError(f"stop has {len(stop)} strings; at most {MAX_STOP_STRINGS} are allowed")
        for s in stop:
            if not isinstance(s, str):
                raise TypeError(f"stop strings must be str, got {type(s).__name__} {s!r}")
            if not s:
                raise ValueError("stop strings must be non-empty")
            if len(s) > MAX_STOP_STRING_CHARS:
                raise ValueError(f"stop strings must be at most {MAX_STOP_STRING_CHARS} characters")
        return list(stop)

    @staticmethod
    def _stop_token_ids(ids) -> list[int]:
        if ids is None:
            return []
        if not isinstance(ids, (list, tuple)):
            raise TypeError(f"stop_token_ids={ids!r} must be a list of token ids")
        if len(ids) > MAX_STOP_TOKEN_IDS:
            raise ValueError(f"stop_token_ids has {len(ids)} ids; at most {MAX_STOP_TOKEN_IDS} are allowed")
        for t in ids:
            _int("stop_token_ids", t, 0, 2**31 - 1)
        return [int(t) for t in ids]

    @staticmethod
    def _logit_bias(bias) -> dict[int, float]:
        if bias is None:
            return {}
        if not isinstance(bias, dict):
            raise TypeError(f"logit_bias={bias!r} must be a dict of token id -> bias")
        if len(bias) > MAX_LOGIT_BIAS:
            raise ValueError(f"logit_bias has {len(bias)} entries; at most {MAX_LOGIT_BIAS} are allowed")
        out = {}
        for t, b in bias.items():
            _int("logit_bias", t, 0, 2**31 - 1)
            b = _float("logit_bias", b)
            if not -100.0 <= b <= 100.0:
                raise ValueError(f"logit_bias[{t}]={b} must be in [-100, 100]")
            out[int(t)] = b
        return out

    @staticmethod
    def _bad_words(words) -> list[str]:
        if words is None:
            return []
        if isinstance(words, str) or not isinstance(words, (list, tuple)):
            raise TypeError(f"bad_words={words!r} must be a list of strings")
        if len(words) > MAX_BAD_WORDS:
            raise ValueError(f"bad_words has {len(words)} strings; at most {MAX_BAD_WORDS} are allowed")
        for w in words:
            if not isinstance(w, str) or not w.strip():
                raise ValueError(f"bad_words must hold non-blank strings, got {w!r}")
            if len(w) > MAX_BAD_WORD_CHARS:
                raise ValueError(f"bad_words strings must be at most {MAX_BAD_WORD_CHARS} characters")
        return list(words)

    @staticmethod
    def _allowed_token_ids(ids) -> list[int] | None:
        if ids is None:
            return None
        if not isinstance(ids, (list, tuple)):
            raise TypeError(f"allowed_token_ids must be a list of token ids, got {type(ids).__name__}")
        if not 1 <= len(ids) <= MAX_ALLOWED_TOKEN_IDS:
            raise ValueError(f"allowed_token_ids must hold 1 to {MAX_ALLOWED_TOKEN_IDS} token ids, got {len(ids)}")
        if all(type(t) is int for t in ids):  # the common case, checked in bulk (a long list reaches the event loop)
            lo, hi = min(ids), max(ids)
            if lo < 0 or hi > 2**31 - 1:
                raise ValueError(f"allowed_token_ids must be in [0, 2**31), got {lo if lo < 0 else hi}")
            return list(ids)
        for t in ids:  # names the first value that is not an int in range
            _int("allowed_token_ids", t, 0, 2**31 - 1)
        return [int(t) for t in ids]

    def check_against_model(self, vocab_size: int) -> None:
        """What needs the model: every token id must name a token of its vocabulary."""
        bad = [t for t in self.stop_token_ids if t >= vocab_size]
        if bad:
            raise ValueError(f"stop_token_ids must be in [0, {vocab_size}) (the vocabulary); got {bad[0]}")
        bad = [t for t in self.logit_bias if t >= vocab_size]
        if bad:
            raise ValueError(f"logit_bias token ids must be in [0, {vocab_size}) (the vocabulary); got {bad[0]}")
        if self.allowed_token_ids and max(self.allowed_token_ids) >= vocab_size:
            raise ValueError(f"allowed_token_ids must be in [0, {vocab_size}) (the vocabulary); got "
                             f"{max(self.allowed_token_ids)}")

    @property
    def has_penalties(self) -> bool:
        return self.presence_penalty != 0 or self.frequency_penalty != 0 or self.repetition_penalty != 1

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0
