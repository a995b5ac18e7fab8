"""The cache of converted GGUF files: one jaxpaged checkpoint per (file name, size, mtime).

Converting a GGUF is slow (dequantizing every tensor, and building a fast tokenizer from its vocabulary), so the
first load writes the float32 params, config and tokenizer under the cache directory and later loads read them; with
quantization="gguf", the kept-quantized params in an entry of their own.
"""

from __future__ import annotations

import hashlib
import logging
import os
import shutil

import jax

from jaxpaged.loader.checkpoint import is_checkpoint, read_checkpoint, write_checkpoint

logger = logging.getLogger(__name__)

CACHE_ENV = "JAXPAGED_CACHE_DIR"


def cache_root(cache_dir: str | None) -> str:
    """`cache_dir`, else $JAXPAGED_CACHE_DIR, else `checkpoints/` under the current directory."""
    return cache_dir or os.environ.get(CACHE_ENV) or os.path.join(os.getcwd(), "checkpoints")


# The converted copy's format version for quantization="gguf" (its quantized weights' layout): a new version gets a
# new entry instead of misreading an old one.
QUANTIZED_VERSION = 1


def cache_path(gguf_path: str, cache_dir: str | None, quantized: bool = False) -> str:
    """A changed file (size or mtime) gets a new entry; the old one stays until deleted by hand. quantized: the
    entry of its kept-quantized form (`quantization="gguf"`), beside the float32 one."""
    st = os.stat(gguf_path)
    name = os.path.basename(gguf_path)
    key = hashlib.sha256(f"{name}:{st.st_size}:{st.st_mtime_ns}".encode()).hexdigest()[:12]
    suffix = f"-gguf{QUANTIZED_VERSION}" if quantized else ""
    return os.path.join(cache_root(cache_dir), f"{name.removesuffix('.gguf')}-{key}{suffix}")


def load_gguf_cached(path: str, cache_dir: str | None, quantized: bool = False):
    """(config, params, tokenizer) for a GGUF file, converting it on the first call: float32 params, or with
    `quantized` its matrices kept in their quantized formats (`gguf_quant.load_gguf_quantized`)."""
    from jaxpaged.loader.tokenizer import directory_tokenizer, gguf_tokenizer

    cached = cache_path(path, cache_dir, quantized)
    if is_checkpoint(cached):
        logger.info("loading %s from its converted copy %s", path, cached)
        config, params = read_checkpoint(cached)
        return config, params, directory_tokenizer(cached)
    from gguf import GGUFReader

    from jaxpaged.loader.gguf_file import load_gguf
    from jaxpaged.loader.gguf_quant import load_gguf_quantized

    logger.info("converting %s (first load; the result is cached in %s)", path, cached)
    reader = GGUFReader(path)  # parsed once for the tensors and the chat template
    config, params = load_gguf_quantized(path, reader) if quantized else load_gguf(path, reader)
    tokenizer = gguf_tokenizer(path, reader)
    del reader
    if jax.process_count() > 1:
        # Orbax saves collectively (process 0 writes what all processes hold), so a process of a multi-host run
        # saving on its own would leave an entry without params; each process converts the file instead.
        logger.info("not caching the converted model: this is one of %d processes", jax.process_count())
        return config, params, tokenizer
    if os.path.isdir(cached) and not is_checkpoint(cached):  # the cache's own name, left incomplete: replace it
        logger.warning("replacing %s, which is not a whole checkpoint", cached)
        shutil.rmtree(cached, ignore_errors=True)
    try:
        write_checkpoint(cached, config, params, tokenizer)
    except OSError as e:  # a read-only cache must not stop the model from loading
        logger.warning("could not cache the converted model in %s: %s", cached, e)
    return config, params, tokenizer
