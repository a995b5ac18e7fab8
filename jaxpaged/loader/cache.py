"""The cache of converted GGUF files: one jaxpaged checkpoint per (file name, size, mtime).

Converting a GGUF is slow (dequantizing every tensor, and building a fast tokenizer from its vocabulary), so the
first load writes the float32 params, config and tokenizer under the cache directory and later loads read them.
"""

from __future__ import annotations

import hashlib
import logging
import os

from jaxpaged.loader.checkpoint import is_checkpoint, read_checkpoint, write_checkpoint

logger = logging.getLogger(__name__)

CACHE_ENV = "JAXPAGED_CACHE_DIR"


def cache_root(cache_dir: str | None) -> str:
    """`cache_dir`, else $JAXPAGED_CACHE_DIR, else `checkpoints/` under the current directory."""
    return cache_dir or os.environ.get(CACHE_ENV) or os.path.join(os.getcwd(), "checkpoints")


def cache_path(gguf_path: str, cache_dir: str | None) -> str:
    """A changed file (size or mtime) gets a new entry; the old one stays until deleted by hand."""
    st = os.stat(gguf_path)
    name = os.path.basename(gguf_path)
    key = hashlib.sha256(f"{name}:{st.st_size}:{st.st_mtime_ns}".encode()).hexdigest()[:12]
    return os.path.join(cache_root(cache_dir), f"{name.removesuffix('.gguf')}-{key}")


def load_gguf_cached(path: str, cache_dir: str | None):
    """(config, float32 params, tokenizer) for a GGUF file, converting it on the first call."""
    from jaxpaged.loader.tokenizer import directory_tokenizer, gguf_tokenizer

    cached = cache_path(path, cache_dir)
    if is_checkpoint(cached):
        logger.info("loading %s from its converted copy %s", path, cached)
        config, params = read_checkpoint(cached)
        return config, params, directory_tokenizer(cached)
    from jaxpaged.loader.gguf_file import load_gguf

    logger.info("converting %s (first load; the result is cached in %s)", path, cached)
    config, params = load_gguf(path)
    tokenizer = gguf_tokenizer(path)
    try:
        write_checkpoint(cached, config, params, tokenizer)
    except OSError as e:  # a read-only cache must not stop the model from loading
        logger.warning("could not cache the converted model in %s: %s", cached, e)
    return config, params, tokenizer
