"""Tokenizers: transformers builds them from a GGUF's metadata or from a directory's tokenizer files."""

from __future__ import annotations

import logging
import os

logger = logging.getLogger(__name__)

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")


def gguf_tokenizer(path: str, reader=None):
    """Slow (seconds: transformers parses the file and converts its vocabulary to a fast tokenizer). reader: the
    file's `gguf.GGUFReader`, if the caller parsed it already (for the chat template; transformers parses on its
    own)."""
    from transformers import AutoTokenizer

    from jaxpaged.loader.gguf_file import chat_template_of

    tokenizer = AutoTokenizer.from_pretrained(os.path.dirname(os.path.abspath(path)),
                                              gguf_file=os.path.basename(path))
    if not getattr(tokenizer, "chat_template", None):
        tokenizer.chat_template = chat_template_of(path, reader)
    return tokenizer


def directory_tokenizer(directory: str):
    """The directory's tokenizer, or None (with a warning) when it has no tokenizer files."""
    if not any(os.path.exists(os.path.join(directory, f)) for f in TOKENIZER_FILES):
        logger.warning("%s has no tokenizer files (%s): prompts must be token ids", directory,
                       ", ".join(TOKENIZER_FILES))
        return None
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(directory)
