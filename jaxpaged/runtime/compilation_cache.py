"""JAX's persistent compilation cache: compiled step programs written to disk, so the next start skips XLA.

It is a process-wide `jax.config` setting, so the library turns it on only when asked (`EngineConfig`'s
`compilation_cache_dir` set); the entry points (`jaxpaged serve`, server.py, `jaxpaged generate`) own their
process and ask for it by default (`default_directory`).
"""

from __future__ import annotations

import os


def default_directory() -> str:
    """Where the entry points keep compiled programs: $JAXPAGED_COMPILATION_CACHE, else ~/.cache/jaxpaged/xla."""
    return os.environ.get("JAXPAGED_COMPILATION_CACHE") or os.path.expanduser("~/.cache/jaxpaged/xla")


def enable_compilation_cache(directory: str) -> str:
    """Turns JAX's persistent cache on in `directory` (created if missing) for every compilation of this process,
    however short: a step shape compiles in about a second, below JAX's default threshold, and there are dozens."""
    import jax

    os.makedirs(directory, exist_ok=True)
    jax.config.update("jax_compilation_cache_dir", directory)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
    return directory
