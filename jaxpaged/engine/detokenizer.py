"""Incremental detokenization and stop strings, per sequence, on the host.

Decoding token by token can split a multi-byte character across tokens: the partial bytes decode to U+FFFD.
We decode the tokens since the last emitted text together with the ones before them and hold text back while it
ends in U+FFFD, so emitted text never contains half a character. Text that could be the start of a stop string is
held back too, so what was already streamed is always a prefix of the final text.

A transformers fast tokenizer whose `decode` is its `tokenizers.Tokenizer`'s alone (no clean-up of spaces) is
decoded by that library's `DecodeStream`, which does the same in Rust: one call per token where the Python way makes
two `decode` calls through transformers. Any other tokenizer takes the Python way.
"""

from __future__ import annotations

import dataclasses

try:
    from tokenizers import Tokenizer as _RustTokenizer
    from tokenizers.decoders import DecodeStream
except ImportError:  # tokenizers < 0.21
    DecodeStream = None


def rust_tokenizer(tokenizer):
    """The `tokenizers.Tokenizer` that decodes for `tokenizer`, where its `decode` adds nothing to that object's
    (transformers' clean-up of spaces off); else None."""
    backend = getattr(tokenizer, "_tokenizer", None)
    if DecodeStream is None or not isinstance(backend, _RustTokenizer):
        return None
    return None if getattr(tokenizer, "clean_up_tokenization_spaces", False) else backend


@dataclasses.dataclass
class Detokenizer:
    tokenizer: object
    skip_special_tokens: bool = True
    stop: list[str] = dataclasses.field(default_factory=list)
    include_stop_str_in_output: bool = False
    text: str = ""  # all decoded text so far (complete characters only)
    _prefix_offset: int = 0
    _read_offset: int = 0
    stopped_on: str | None = None
    _rust: object = None  # the tokenizer's `tokenizers.Tokenizer`, where `DecodeStream` decodes for it
    _stream: object = None

    def __post_init__(self):
        self._rust = rust_tokenizer(self.tokenizer)
        if self._rust is not None:
            self._stream = DecodeStream(skip_special_tokens=self.skip_special_tokens)

    def add(self, token_ids: list[int]) -> None:
        """Decodes the newly appended tokens of `token_ids` (the sequence's full output so far)."""
        if self._stream is not None:
            for token in token_ids[self._read_offset:]:
                piece = self._stream.step(self._rust, token)
                if piece:
                    self.text += piece
            self._read_offset = len(token_ids)
            return
        prefix = self._decode(token_ids[self._prefix_offset:self._read_offset])
        full = self._decode(token_ids[self._prefix_offset:])
        if len(full) > len(prefix) and not full.endswith("\ufffd"):
            self.text += full[len(prefix):]
            self._prefix_offset, self._read_offset = self._read_offset, len(token_ids)
        # else: nothing complete yet (an incomplete character or a skipped special token); offsets stay

    def check_stop(self, num_new_chars: int) -> str | None:
        """Looks for a stop string in the newest text; truncates the text at it. Returns the stop string."""
        if not self.stop or self.stopped_on is not None:
            return self.stopped_on
        window_start = max(0, len(self.text) - num_new_chars - max(map(len, self.stop)) + 1)
        best = None
        for s in self.stop:
            i = self.text.find(s, window_start)
            if i >= 0 and (best is None or i < best[0]):
                best = (i, s)
        if best is not None:
            i, s = best
            self.text = self.text[: i + len(s)] if self.include_stop_str_in_output else self.text[:i]
            self.stopped_on = s
        return self.stopped_on

    def visible_text(self, finished: bool) -> str:
        """The text safe to show now: while running, a tail that might begin a stop string is held back."""
        if finished or not self.stop or self.stopped_on is not None:
            return self.text
        hold = max(map(len, self.stop)) - 1
        return self.text[: len(self.text) - hold] if hold else self.text

    def _decode(self, ids: list[int]) -> str:
        if not ids or self.tokenizer is None:  # an engine built without a tokenizer returns token ids only
            return ""
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens)
