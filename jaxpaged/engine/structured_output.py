"""Structured output on the host: grammars (JSON schema, regex, choice, Lark/GBNF) compiled by llguidance, one
matcher per sequence, and the token bitmask each step hands the sampler.

A spec reaches llguidance in this process only after `grammar_guard` has checked it: input limits, then a compile,
a compile against the tokenizer and a first token mask in a worker process with a smaller stack, so a spec that
would crash, exhaust or stall llguidance is a ValueError naming the field before any request is queued.
A grammar is compiled once per (kind, spec) and kept in a bounded LRU as a fresh matcher; each sequence gets a
`deep_copy` of it (n > 1 samples each their own) and advances it with every token it appends, once: preemption
keeps a sequence's tokens and its matcher, so recompute never replays tokens into it. A grammar that still fails
while generating raises `GrammarError`, which fails its own request with a short message.
The bitmask is [ceil(V / 32)] int32 per row, bit j of word i allowing token 32 i + j (llguidance's layout).
"""

from __future__ import annotations

import collections
import copy
import functools
import threading
import time

import numpy as np

from jaxpaged import client_json
from jaxpaged.engine import grammar_guard
from jaxpaged.engine.grammar_worker import check_mask_time, parser_limits, short_error

MAX_CACHED_GRAMMARS = 256


class GrammarError(ValueError):
    """A request's grammar failed while generating (its matcher is in an error state): the request's own fault."""


def bitmask_words(vocab_size: int) -> int:
    return (vocab_size + 31) // 32


@functools.lru_cache(maxsize=64)
def grammar(kind: str, spec: str) -> str:
    """The llguidance grammar of one spec (kind is a `StructuredOutputsParams` field name), compiled and validated in
    the grammar worker. Raises ValueError naming the field when the spec is invalid, over the limits, or too costly.
    """
    field = f"structured_outputs.{kind}"
    value = spec
    if kind == "choice":
        value = client_json.loads(spec, field)
        if not isinstance(value, list):
            raise ValueError(f"{field} must be a list of strings")
    if kind != "json_object":
        grammar_guard.check_limits(field, kind, value)
    return grammar_guard.workers().grammar(field, kind, spec)


def validate(kind: str, spec: str) -> None:
    grammar(kind, spec)


def tokenizer_json(tokenizer) -> str:
    """A fast Hugging Face tokenizer as the JSON that llguidance's `LLTokenizer` reads (as `llguidance.hf` does it)."""
    from transformers import PreTrainedTokenizerFast

    if not isinstance(tokenizer, PreTrainedTokenizerFast):
        raise ValueError("structured_outputs needs a fast (Rust) Hugging Face tokenizer; this model's is "
                         f"{type(tokenizer).__name__}")
    backend = copy.copy(tokenizer.backend_tokenizer)
    backend.no_padding()
    backend.no_truncation()
    return backend.to_str()


class GrammarCache:
    """Fresh matchers per (kind, spec) for one tokenizer; `matcher` hands out copies to advance. Thread-safe, so the
    server can `prepare` a grammar on a worker thread and the engine thread finds it compiled."""

    def __init__(self, tokenizer, vocab_size: int, eos_token_ids: list[int], maxsize: int = MAX_CACHED_GRAMMARS):
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.eos_token_ids = sorted(eos_token_ids)
        self.maxsize = maxsize
        self._templates: collections.OrderedDict[tuple[str, str], object] = collections.OrderedDict()
        self._lltok = None
        self._tokenizer_key: str | None = None
        self._lock = threading.Lock()  # the template LRU (held for lookups only)
        self._tokenizer_lock = threading.Lock()  # building the tokenizer takes seconds: not under `_lock`
        self.compiles = 0  # for tests: grammars built, not served from the cache

    def warm_up(self) -> None:
        """Builds the tokenizer here and in a grammar worker (seconds for a large vocabulary), and the template of
        `json_object`, so the first structured-output request does not wait for them."""
        self.prepare("json_object", "True")

    def _ll_tokenizer(self):
        with self._tokenizer_lock:
            if self._lltok is None:
                from llguidance import LLTokenizer

                text = tokenizer_json(self.tokenizer)
                self._lltok = LLTokenizer(text, n_vocab=self.vocab_size, eos_token=self.eos_token_ids)
                self._tokenizer_key = grammar_guard.workers().register_tokenizer(text, self.vocab_size,
                                                                                 self.eos_token_ids)
            return self._lltok

    def prepare(self, kind: str, spec: str) -> object:
        """The compiled template of a spec, built if it is not cached. Raises ValueError naming the field if the grammar
        is invalid, over the limits, or fails against this tokenizer."""
        from llguidance import LLMatcher

        key = (kind, spec)
        with self._lock:
            template = self._templates.get(key)
            if template is not None:
                self._templates.move_to_end(key)
                return template
        g = grammar(kind, spec)
        lltok = self._ll_tokenizer()
        field = f"structured_outputs.{kind}"
        grammar_guard.workers().check_matcher(field, self._tokenizer_key, g)
        # The worker compiled this very grammar on a smaller stack: here it cannot overflow.
        template = LLMatcher(lltok, g, log_level=0, limits=parser_limits())
        if template.is_error():
            raise ValueError(f"{field} is invalid: {short_error(template.get_error())}")
        with self._lock:
            self.compiles += 1
            self._templates[key] = template
            if len(self._templates) > self.maxsize:
                self._templates.popitem(last=False)
        return template

    def evict(self, kind: str, spec: str) -> None:
        """Drops the template of a grammar that failed while generating: the lexer states its matchers built (shared
        with the template; up to ~75 MiB when a regex hits llguidance's limit) go with it."""
        with self._lock:
            self._templates.pop((kind, spec), None)

    def matcher(self, kind: str, spec: str):
        """A new matcher at the grammar's start. Raises ValueError naming the field if the grammar is invalid."""
        return self.prepare(kind, spec).deep_copy()


def fill_bitmask(matcher, out: np.ndarray) -> None:
    """The tokens `matcher` allows next, into out [ceil(V / 32)] int32 (contiguous). GrammarError if the grammar
    cannot go on (e.g. it allows no token the tokenizer has, or hit a parser limit), or if the mask took more than
    `grammar_worker.MAX_MASK_CPU_S` of this thread's CPU time (wall time would count the other threads' turns)."""
    start = time.thread_time()
    matcher.unsafe_compute_mask_ptr(out.ctypes.data, out.nbytes)
    if matcher.is_error():
        raise GrammarError(f"structured output: the grammar failed while generating: "
                           f"{short_error(matcher.get_error())}")
    try:
        check_mask_time(time.thread_time() - start, "a token mask")
    except ValueError as e:
        raise GrammarError(f"structured output: {e}") from None


def advance(matcher, token: int) -> None:
    """Feeds a sampled token to the matcher; GrammarError (a short message, no parser state) if it is refused."""
    if not matcher.consume_token(token):
        raise GrammarError(f"structured output: the grammar rejects token {token}: {short_error(matcher.get_error())}")


def _word_bits(token_ids) -> tuple[np.ndarray, np.ndarray]:
    """Each token id's word in a [ceil(V / 32)] bitmask and its bit there (uint32)."""
    ids = np.asarray(list(token_ids), np.int64)
    return ids // 32, np.uint32(1) << (ids % 32).astype(np.uint32)


def allow(mask: np.ndarray, token_ids) -> None:
    """Sets the bits of `token_ids` in mask [ceil(V / 32)] int32."""
    words, bits = _word_bits(token_ids)
    np.bitwise_or.at(mask.view(np.uint32), words, bits)


def ban(mask: np.ndarray, token_ids) -> None:
    """Clears the bits of `token_ids` in mask [ceil(V / 32)] int32."""
    words, bits = _word_bits(token_ids)
    np.bitwise_and.at(mask.view(np.uint32), words, ~bits)
