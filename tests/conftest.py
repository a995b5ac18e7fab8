"""Shared fixtures. Tiny on-disk models live in tests/tiny_hf.py; this re-exports its helpers so tests can write

    from tests.conftest import make_tiny_hf_model      (or: from tests.tiny_hf import ...)
    path = make_tiny_hf_model(tmp_path, "qwen2")        # kinds: llama, llama_tied, llama3, qwen2, qwen3, mistral

or use the `tiny_hf_model` fixture: `path = tiny_hf_model("mistral", sliding_window=16)`.
"""

from __future__ import annotations

import os

# Before anything loads OpenMP (torch does, for the transformers references): its idle threads sleep instead of
# spinning. `make test` runs more workers than cores, and spinning threads burned the CPU the other workers needed
# (tests/models/test_default_model_parity.py alone: 84 s of CPU spinning, 52 s passive, on 2 cores). The processes
# the tests start inherit it. Our native kernels do not use OpenMP.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import pytest  # noqa: E402

from jaxpaged.runtime.compilation_cache import default_directory, enable_compilation_cache  # noqa: E402
from tests.tiny_hf import KINDS, TINY_VOCAB, make_tiny_hf_model, make_tiny_tokenizer, write_tiny_gguf  # noqa: E402

__all__ = ["KINDS", "TINY_VOCAB", "make_tiny_hf_model", "make_tiny_tokenizer", "write_tiny_gguf"]


def pytest_configure(config):
    # The test session owns its process, as the server and CLI do: JAX's persistent compilation cache keeps a rerun's
    # engines from compiling their steps again (the library turns it on only when asked; test_public_api.py checks
    # that in a fresh process). The processes the tests start (tensor-parallel workers, examples, native-kernel
    # checks) get it through JAX's own environment variables.
    directory = enable_compilation_cache(default_directory())
    os.environ.update(JAX_COMPILATION_CACHE_DIR=directory, JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0",
                      JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES="0")


@pytest.fixture
def tiny_hf_model(tmp_path):
    """Factory: tiny_hf_model(kind="llama", **kw) -> a fresh directory under this test's tmp_path."""
    counter = iter(range(1_000_000))

    def make(kind: str = "llama", **kwargs) -> str:
        return make_tiny_hf_model(tmp_path / f"{kind}-{next(counter)}", kind, **kwargs)

    return make


# The folders whose slow modules take longest (processes in pairs, real models), in that order.
LONGEST_FIRST = ("parallel", "models", "spec_decode", "server", "project", "kernels")


def pytest_collection_modifyitems(config, items):
    """The slow tier first, its longest folders first: with `-n` (pytest-xdist, `make test`) each worker takes whole
    modules in this order, so the longest start early instead of leaving one worker running alone at the end."""
    def rank(item) -> tuple[bool, int]:
        folder = item.path.parent.name
        return item.get_closest_marker("slow") is None, LONGEST_FIRST.index(folder) if folder in LONGEST_FIRST else 9

    items.sort(key=rank)
