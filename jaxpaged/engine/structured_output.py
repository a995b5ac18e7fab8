"""Structured output on the host: grammars (JSON schema, regex, choice, Lark/GBNF) compiled by llguidance, one
matcher per sequence, and the token bitmask each step hands the sampler.

A grammar is compiled once per (kind, spec) and kept in a bounded LRU as a fresh matcher; each sequence gets a
`deep_copy` of it (n > 1 samples each their own) and advances it with every token it appends, once: preemption
keeps a sequence's tokens and its matcher, so recompute never replays tokens into it.
The bitmask is [ceil(V / 32)] int32 per row, bit j of word i allowing token 32 i + j (llguidance's layout).
"""

from __future__ import annotations

import collections
import functools
import json

import numpy as np

# Compact JSON (no free whitespace between tokens): a weak model otherwise fills its budget with blanks.
JSON_OPTIONS = {"whitespace_flexible": False}
MAX_CACHED_GRAMMARS = 256


def bitmask_words(vocab_size: int) -> int:
    return (vocab_size + 31) // 32


@functools.lru_cache(maxsize=MAX_CACHED_GRAMMARS)
def grammar(kind: str, spec: str) -> str:
    """The llguidance grammar of one spec (kind is a `StructuredOutputsParams` field name). Raises ValueError
    naming the field when the spec is invalid."""
    from llguidance import LLMatcher, grammar_from

    field = f"structured_outputs.{kind}"
    try:
        if kind == "json":
            schema = json.loads(spec)
            if not isinstance(schema, dict):
                raise ValueError("a JSON schema must be an object")
            g = LLMatcher.grammar_from_json_schema(schema, defaults=JSON_OPTIONS)
        elif kind == "json_object":
            g = LLMatcher.grammar_from_json_schema({"type": "object"}, defaults=JSON_OPTIONS)
        elif kind == "regex":
            g = LLMatcher.grammar_from_regex(spec)
        elif kind == "choice":
            g = grammar_from("choice", spec)
        elif kind == "grammar":
            g = grammar_from("grammar", spec)
        else:
            raise ValueError(f"unknown kind {kind!r}")
    except ValueError as e:
        raise ValueError(f"{field} is invalid: {e}") from None
    is_error, messages = LLMatcher.validate_grammar_with_warnings(g)
    if is_error:
        raise ValueError(f"{field} is invalid: {messages[0].strip()}")
    return g


def validate(kind: str, spec: str) -> None:
    grammar(kind, spec)


class GrammarCache:
    """Fresh matchers per (kind, spec) for one tokenizer; `matcher` hands out copies to advance."""

    def __init__(self, tokenizer, vocab_size: int, eos_token_ids: list[int], maxsize: int = MAX_CACHED_GRAMMARS):
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.eos_token_ids = sorted(eos_token_ids)
        self.maxsize = maxsize
        self._templates: collections.OrderedDict[tuple[str, str], object] = collections.OrderedDict()
        self._lltok = None
        self.compiles = 0  # for tests: grammars built, not served from the cache

    def _ll_tokenizer(self):
        if self._lltok is None:
            import llguidance.hf
            from transformers import PreTrainedTokenizerFast

            if not isinstance(self.tokenizer, PreTrainedTokenizerFast):
                raise ValueError("structured_outputs needs a fast (Rust) Hugging Face tokenizer; this model's is "
                                 f"{type(self.tokenizer).__name__}")
            self._lltok = llguidance.hf.from_tokenizer(self.tokenizer, n_vocab=self.vocab_size,
                                                       eos_token=self.eos_token_ids)
        return self._lltok

    def matcher(self, kind: str, spec: str):
        """A new matcher at the grammar's start. Raises ValueError naming the field if the grammar is invalid."""
        from llguidance import LLMatcher

        key = (kind, spec)
        template = self._templates.get(key)
        if template is None:
            template = LLMatcher(self._ll_tokenizer(), grammar(kind, spec), log_level=0)
            if template.is_error():
                raise ValueError(f"structured_outputs.{kind} is invalid: {template.get_error()}")
            self.compiles += 1
            self._templates[key] = template
            if len(self._templates) > self.maxsize:
                self._templates.popitem(last=False)
        else:
            self._templates.move_to_end(key)
        return template.deep_copy()


def fill_bitmask(matcher, out: np.ndarray) -> None:
    """The tokens `matcher` allows next, into out [ceil(V / 32)] int32 (contiguous)."""
    matcher.unsafe_compute_mask_ptr(out.ctypes.data, out.nbytes)


def ban(mask: np.ndarray, token_ids) -> None:
    """Clears the bits of `token_ids` in mask [ceil(V / 32)] int32."""
    ids = np.asarray(list(token_ids), np.int64)
    if ids.size:
        words = mask.view(np.uint32)
        np.bitwise_and.at(words, ids // 32, ~(np.uint32(1) << (ids % 32).astype(np.uint32)))
