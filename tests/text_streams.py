"""Feeding a `Detokenizer` one token at a time, for the detokenizer tests of every tokenizer (SmolLM2's in
tests/engine/test_detokenizer.py, Gemma 3's in tests/models/test_gemma3_270m.py)."""

from __future__ import annotations

import types

from jaxpaged.engine.detokenizer import Detokenizer

# accents, CJK, an emoji (4 UTF-8 bytes: byte-level BPE splits it over tokens), symbols, markup, whitespace runs
TEXT = "Héllo, wörld! 世界 🙂🙂 naïve café — ∑x² ≤ 3 <b>bold</b>\n\n\tend   spaced"


def streamed(tokenizer, ids: list[int], **options) -> tuple[Detokenizer, list[str]]:
    """The text after each token, fed one at a time."""
    d = Detokenizer(tokenizer, **options)
    texts = []
    for i in range(1, len(ids) + 1):
        d.add(ids[:i])
        texts.append(d.text)
    return d, texts


def python_way(tokenizer):
    """The same tokenizer without its Rust object in sight: the Detokenizer takes the Python way."""
    return types.SimpleNamespace(decode=tokenizer.decode)
