"""Prompt tokenization for the HTTP API, off the event loop.

Tokenizing a few megabytes of text takes seconds; on the event loop that would stall every other client (and
`/health`). `PromptTokenizer` runs encoding and chat templating on one worker thread with its own copy of the
tokenizer: the engine thread decodes with the engine's tokenizer and the event loop decodes logprob tokens with the
`AsyncEngine`'s copy, and a fast tokenizer's Rust object must not be used from two threads at once.

Before any tokenizing, a prompt is measured in characters against `max_chars`: by default max_model_len times the
longest token's length, so a longer prompt provably cannot fit the context and is refused without the work.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import functools

from jaxpaged.chat import apply_chat_template
from jaxpaged.entrypoints.async_engine import _private_copy

FALLBACK_CHARS_PER_TOKEN = 16  # for a tokenizer whose vocabulary cannot be listed


def longest_token_chars(tokenizer) -> int:
    """The most characters one token of `tokenizer` stands for (an upper bound: a byte-level BPE token's string has
    one character per byte, and a byte decodes to at most one character)."""
    try:
        vocab = tokenizer.get_vocab()
        return max(1, max(len(t) for t in vocab))
    except Exception:  # not a transformers tokenizer, or an empty vocabulary
        return FALLBACK_CHARS_PER_TOKEN


def default_max_prompt_chars(tokenizer, max_model_len: int) -> int:
    """The longest prompt, in characters, that could still fit in `max_model_len` tokens."""
    return max_model_len * (longest_token_chars(tokenizer) if tokenizer is not None else FALLBACK_CHARS_PER_TOKEN)


class PromptTokenizer:
    """`encode`, `apply_chat_template` and `decode` as coroutines that run on one worker thread."""

    def __init__(self, tokenizer, max_model_len: int, max_chars: int | None = None, chat_template: str | None = None):
        """chat_template: a Jinja template used instead of the tokenizer's (--chat-template)."""
        if max_chars is not None and max_chars < 1:
            raise ValueError(f"max_prompt_chars={max_chars} must be >= 1")
        self._tokenizer = _private_copy(tokenizer)
        self.chat_template = chat_template
        self.max_chars = max_chars or default_max_prompt_chars(tokenizer, max_model_len)
        # One worker: requests are tokenized one at a time, each with the whole tokenizer to itself.
        self._pool = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="jaxpaged-tokenizer")

    @property
    def bos_token_id(self) -> int | None:
        """The token the tokenizer puts first (kept first when a prompt is truncated), if any."""
        return getattr(self._tokenizer, "bos_token_id", None)

    async def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return await self._run(self._encode, text, add_special_tokens)

    async def decode(self, token_ids: list[int]) -> str:
        """The text of `token_ids`, special tokens included (so that decode inverts encode)."""
        return await self._run(self._decode, token_ids)

    async def apply_chat_template(self, conversation: list[dict], add_generation_prompt: bool = True,
                                  tools: list[dict] | None = None, *, continue_final_message: bool = False,
                                  chat_template_kwargs: dict | None = None) -> list[int]:
        return await self._run(functools.partial(
            apply_chat_template, continue_final_message=continue_final_message,
            chat_template_kwargs=chat_template_kwargs, chat_template=self.chat_template), self._tokenizer, conversation,
            add_generation_prompt, tools)

    async def token_strs(self, token_ids: list[int]) -> list[str]:
        """Each token's vocabulary entry (vLLM's `token_strs`: byte-level pieces as the vocabulary spells them)."""
        return await self._run(lambda: list(self._tokenizer.convert_ids_to_tokens(token_ids)))

    def close(self) -> None:
        """Drops queued work; a tokenization already running finishes on its own."""
        self._pool.shutdown(wait=False, cancel_futures=True)

    def _encode(self, text: str, add_special_tokens: bool) -> list[int]:
        if self._tokenizer is None:
            raise ValueError("this model has no tokenizer: send token ids")
        return list(self._tokenizer(text, add_special_tokens=add_special_tokens)["input_ids"])

    def _decode(self, token_ids: list[int]) -> str:
        if self._tokenizer is None:
            raise ValueError("this model has no tokenizer to decode with")
        return self._tokenizer.decode(token_ids, skip_special_tokens=False)

    async def _run(self, fn, *args):
        return await asyncio.get_running_loop().run_in_executor(self._pool, fn, *args)


__all__ = ["PromptTokenizer", "default_max_prompt_chars", "longest_token_chars"]
