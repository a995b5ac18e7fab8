"""The entry points' memory allocator: tcmalloc, preloaded where it is installed.

XLA CPU allocates a step's temporaries anew at every step. glibc's malloc returns large blocks to the kernel when
they are freed and gets them back zero-filled on the next step (the kernel's page clearing shows in a `perf` profile
of a workload); tcmalloc keeps them. `benchmarks/cpu_settings.py` measures both, its table is in README.md.

A library does not change the process it runs in, so `jaxpaged` never does this on import: the entry points
(server.py, the `jaxpaged` CLI, the benchmarks) call `use_tcmalloc()` first thing. The preload only takes effect
when a process starts, so the process executes itself again with LD_PRELOAD set: same pid, same arguments,
same interpreter options, same file descriptors. Nothing happens when tcmalloc is already loaded, when the library
is not installed (Debian/Ubuntu: `libtcmalloc-minimal4`), or with JAXPAGED_MALLOC=system.
"""

from __future__ import annotations

import logging
import os
import sys

logger = logging.getLogger(__name__)

CANDIDATES = ("/usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4",
              "/usr/lib/aarch64-linux-gnu/libtcmalloc_minimal.so.4",
              "/usr/lib64/libtcmalloc_minimal.so.4", "/usr/lib/libtcmalloc_minimal.so.4")
_TRIED = "_JAXPAGED_PRELOAD_TRIED"  # set in the re-executed process: never loop


def tcmalloc_path() -> str | None:
    """The installed tcmalloc library, or None."""
    return next((p for p in CANDIDATES if os.path.exists(p)), None)


def tcmalloc_loaded() -> bool:
    """Whether this process has tcmalloc mapped (Linux: /proc/self/maps)."""
    try:
        with open("/proc/self/maps") as f:
            return "tcmalloc" in f.read()
    except OSError:
        return False


def use_tcmalloc() -> None:
    """Re-executes this process with tcmalloc preloaded if it is installed and not loaded yet; returns otherwise.
    JAXPAGED_MALLOC=system opts out."""
    choice = os.environ.get("JAXPAGED_MALLOC", "tcmalloc")
    if choice not in ("tcmalloc", "system"):
        raise ValueError(f"JAXPAGED_MALLOC must be 'tcmalloc' or 'system', not {choice!r}")
    if choice == "system" or tcmalloc_loaded():
        return
    path = tcmalloc_path()
    if path is None or os.environ.get(_TRIED):
        if os.environ.get(_TRIED):
            logger.warning("tcmalloc was preloaded (%s) but is not loaded; going on with the system allocator", path)
        return
    env = dict(os.environ)
    env["LD_PRELOAD"] = " ".join(filter(None, [path, env.get("LD_PRELOAD", "")]))
    env[_TRIED] = "1"
    # tcmalloc reports every allocation above 1 GiB on stderr by default; a KV pool is one.
    env.setdefault("TCMALLOC_LARGE_ALLOC_REPORT_THRESHOLD", str(1 << 40))
    sys.stdout.flush()
    sys.stderr.flush()
    os.execve(sys.executable, [sys.executable, *sys.orig_argv[1:]], env)
