"""Builds the native CPU kernels, one shared library per kernel, on first use, and registers their XLA FFI targets.

    available("attention")          # built and registered (builds it on the first call); False with a reason
    unavailable_reason("matmul")    # '' when available, else why (a missing instruction set, a build error)
    statuses()                      # every kernel's KernelStatus, the missing ones built in parallel
    python -m pallas_kernels.cpu_native --build    # prebuilds them all and prints each one's status

A kernel is one entry of KERNELS: its C++ sources in this directory, the XLA FFI handlers they export (each
registered as the target of the same name in snake case: JaxpagedMatmulGlu -> "jaxpaged_matmul_glu"), and the
instruction sets it cannot run without, as the macros the compiler predefines for them (`needs`). A kernel whose
`needs` the compiler does not target (an Arm machine, an x86 CPU without AVX-512, or JAXPAGED_NATIVE_MARCH) is
reported unavailable without building; a build error disables only the kernel that has it.

The build: `g++ -std=c++17 -O3 -march=native -fno-math-errno -fPIC -shared` (on Arm `-mcpu=native`) against
`jax.ffi.include_dir()`, into `$JAXPAGED_NATIVE_CACHE` (default ~/.cache/jaxpaged/native) as
`jaxpaged_<kernel>-<hash>.so`, the hash covering the kernel's sources and every header here, the compiler and its
version, the flags, the jaxlib version, `platform.machine()` and, for -march=native, the CPU's flags (such code must
not move to an older CPU). It is written to a temporary file and renamed into place, so concurrent builds are safe.
Environment: `$JAXPAGED_CXX` picks the compiler; `$JAXPAGED_NATIVE_MARCH` replaces the target (`-march=<value>`, e.g.
x86-64-v2 for an x86 CPU without AVX-512); `JAXPAGED_NATIVE=0` disables every kernel.
"""

from __future__ import annotations

import concurrent.futures
import ctypes
import dataclasses
import functools
import hashlib
import logging
import os
import platform
import re
import shutil
import subprocess
import tempfile
import threading
import time

logger = logging.getLogger(__name__)

HERE = os.path.dirname(os.path.abspath(__file__))
BASE_FLAGS = ("-std=c++17", "-O3", "-fno-math-errno", "-fPIC", "-shared")


@dataclasses.dataclass(frozen=True)
class Kernel:
    """One native library: `sources` (.cc files of this directory) export the FFI handlers `symbols`; `needs` are
    the macros the compiler must predefine for its flags (the instruction sets the kernel has no other path for)."""

    name: str
    sources: tuple[str, ...]
    symbols: tuple[str, ...]
    needs: tuple[str, ...] = ()
    what: str = ""


# Adding a kernel is one entry here (and its Python wrapper, which calls jax.ffi.ffi_call(target_name(symbol))).
KERNELS: dict[str, Kernel] = {k.name: k for k in (
    Kernel("attention", ("paged_attention.cc",), ("JaxpagedPagedAttention", "JaxpagedKvWrite", "JaxpagedSetBlocks"),
           what="ragged paged attention and its K/V pool writes"),
    Kernel("matmul", ("matmul.cc",), ("JaxpagedMatmul", "JaxpagedMatmulGlu"), needs=("__AVX512F__", "__AVX512BF16__"),
           what="bfloat16 layer matmuls and gated MLPs"),
    Kernel("norm", ("norm.cc",), ("JaxpagedRmsNorm", "JaxpagedAddRound"), what="bfloat16 RMSNorm and residual adds"),
    Kernel("rope", ("rope.cc",), ("JaxpagedRope",), what="bfloat16 rotary embedding"),
    Kernel("argmax", ("argmax.cc",), ("JaxpagedArgmax",), what="the sampler's argmax"),
    Kernel("penalties", ("penalties.cc",), ("JaxpagedPenalties",),
           what="the sampler's repetition, frequency and presence penalties"),
    Kernel("top_p", ("top_p.cc",), ("JaxpagedTopPThreshold",), what="the sampler's top-k / top-p threshold"),
    Kernel("gumbel", ("gumbel.cc",), ("JaxpagedGumbelArgmax",), what="the sampler's Gumbel-max draw"),
    Kernel("logprobs", ("logprobs.cc",), ("JaxpagedLogprobs",), what="the log-probs a step returns (top-k, chosen)"),
    Kernel("qmatmul", ("qmatmul.cc",), ("JaxpagedQMatmul", "JaxpagedQMatmulGlu", "JaxpagedQMatmul3"),
           what="matmuls that read int8 / GGUF-quantized weights (VNNI where the CPU has it)"),
)}


def target_name(symbol: str) -> str:
    """The FFI target a handler symbol is registered as: JaxpagedMatmulGlu -> 'jaxpaged_matmul_glu'."""
    return re.sub(r"(?<!^)(?=[A-Z])", "_", symbol).lower()


@dataclasses.dataclass(frozen=True)
class KernelStatus:
    """A kernel's state in this process: ok (built and registered) with its library's path, or the reason why not;
    skipped: not built for an expected reason (the compiler does not target an instruction set it needs, or
    JAXPAGED_NATIVE=0), not a failure. built_seconds: how long this process spent compiling it (0.0: cached, or not
    built)."""

    name: str
    ok: bool
    reason: str = ""
    path: str = ""
    built_seconds: float = 0.0
    skipped: bool = False


class Skipped(RuntimeError):
    """An expected reason not to build a kernel (logged at INFO, not as a failure)."""


class UnsupportedTarget(Skipped):
    """The compiler's target lacks an instruction set the kernel needs."""


_status: dict[str, KernelStatus] = {}
_libraries: dict[str, ctypes.CDLL] = {}  # kept loaded while the process runs
_registered: set[str] = set()
_warned: set[str] = set()  # failure reasons already logged as warnings
_locks = {name: threading.Lock() for name in KERNELS}


def cache_dir() -> str:
    return os.environ.get("JAXPAGED_NATIVE_CACHE") or os.path.expanduser("~/.cache/jaxpaged/native")


def target_flag() -> str:
    """The instruction-set flag of every build: -march=$JAXPAGED_NATIVE_MARCH if set, else this CPU's."""
    march = os.environ.get("JAXPAGED_NATIVE_MARCH", "").strip()
    if march:
        return f"-march={march}"
    # g++ and clang take -mcpu=native on Arm; clang has no -march=native there
    return "-mcpu=native" if platform.machine().lower() in ("aarch64", "arm64") else "-march=native"


def flags() -> tuple[str, ...]:
    return (*BASE_FLAGS, target_flag())


def _cpu_flags() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith(("flags", "Features")):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor()


@functools.cache
def _compiler(name: str) -> tuple[str, str]:
    """(path, version text) of the compiler; RuntimeError when it is not on PATH."""
    path = shutil.which(name)
    if path is None:
        raise RuntimeError(f"no C++ compiler: {name!r} is not on PATH (set JAXPAGED_CXX)")
    version = subprocess.run([path, "--version"], capture_output=True, text=True, timeout=60).stdout
    return path, version


@functools.cache
def _predefined_macros(compiler_path: str, target: str) -> frozenset[str]:
    """The macros the compiler predefines for C++ at `target` (e.g. __AVX512BF16__ under -march=native on a CPU
    that has it): what the sources' #if guards see."""
    result = subprocess.run([compiler_path, "-x", "c++", "-std=c++17", target, "-dM", "-E", os.devnull],
                            capture_output=True, text=True, timeout=60)
    if result.returncode != 0:
        raise RuntimeError(f"{compiler_path} {target} -dM -E failed: {result.stderr.strip()[-2000:]}")
    return frozenset(line.split()[1] for line in result.stdout.splitlines() if line.startswith("#define "))


def _missing(kernel: Kernel, compiler_path: str) -> list[str]:
    if not kernel.needs:
        return []
    defined = _predefined_macros(compiler_path, target_flag())
    return [macro for macro in kernel.needs if macro not in defined]


def _headers() -> list[str]:
    return sorted(name for name in os.listdir(HERE) if name.endswith(".h"))


def library_path(kernel: Kernel) -> str:
    """Where `kernel`'s library is cached for the current compiler, flags and CPU (it may not exist yet)."""
    import jaxlib

    compiler_path, version = _compiler(os.environ.get("JAXPAGED_CXX") or "g++")
    key = hashlib.sha256()
    for name in (*kernel.sources, *_headers()):  # the key covers what the build reads
        with open(os.path.join(HERE, name), "rb") as f:
            key.update(name.encode() + b"\0" + f.read())
        key.update(b"\0")
    cpu = _cpu_flags() if target_flag().endswith("=native") else ""
    # jaxlib's version stands for its FFI headers, not their path: a fresh venv (a new clone's) reuses the build
    for part in (compiler_path, version, " ".join(flags()), jaxlib.__version__, platform.machine(), cpu):
        key.update(part.encode())
        key.update(b"\0")
    return os.path.join(cache_dir(), f"jaxpaged_{kernel.name}-{key.hexdigest()[:24]}.so")


def build_library(kernel: Kernel) -> tuple[str, float]:
    """(path of `kernel`'s library, seconds spent compiling it: 0.0 when cached). Raises RuntimeError when its
    instruction sets are not targeted or the build fails."""
    compiler_path, _ = _compiler(os.environ.get("JAXPAGED_CXX") or "g++")
    missing = _missing(kernel, compiler_path)
    if missing:
        names = ", ".join(m.strip("_") for m in missing)
        compiler = os.path.basename(compiler_path)
        raise UnsupportedTarget(f"needs {names}, which {compiler} {target_flag()} does not target (this CPU lacks it, "
                                "or JAXPAGED_NATIVE_MARCH leaves it out)")
    path = library_path(kernel)
    if os.path.exists(path):
        return path, 0.0
    import jax

    directory = os.path.dirname(path)
    os.makedirs(directory, exist_ok=True)
    logger.info("building the native CPU kernel %r (%s) with %s %s, once (10-60 s), into the cache "
                "%s", kernel.name, kernel.what, os.path.basename(compiler_path), target_flag(), directory)
    start = time.perf_counter()
    fd, tmp = tempfile.mkstemp(prefix=f".jaxpaged_{kernel.name}-", suffix=".so", dir=directory)
    os.close(fd)
    try:
        cmd = [compiler_path, *flags(), "-I", jax.ffi.include_dir(), "-I", HERE,
               *(os.path.join(HERE, s) for s in kernel.sources), "-o", tmp]
        result = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
        if result.returncode != 0:
            raise RuntimeError(f"{' '.join(cmd)} failed ({result.returncode}):\n{result.stderr[-4000:]}")
        os.replace(tmp, path)  # atomic: a concurrent build of the same key writes the same bytes
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    seconds = time.perf_counter() - start
    logger.info("built the native CPU kernel %r in %.1f s: %s", kernel.name, seconds, path)
    return path, seconds


def _load(kernel: Kernel) -> KernelStatus:
    if os.environ.get("JAXPAGED_NATIVE", "1") == "0":
        raise Skipped("disabled by JAXPAGED_NATIVE=0")
    if platform.system() not in ("Linux", "Darwin"):
        raise RuntimeError(f"unsupported OS {platform.system()}")
    import jax

    path, seconds = build_library(kernel)
    lib = ctypes.CDLL(path)
    for symbol in kernel.symbols:
        target = target_name(symbol)
        if target not in _registered:  # XLA's registry keeps the first library's handler for a name
            jax.ffi.register_ffi_target(target, jax.ffi.pycapsule(getattr(lib, symbol)), platform="cpu")
            _registered.add(target)
    _libraries[kernel.name] = lib
    return KernelStatus(kernel.name, True, path=path, built_seconds=seconds)


def status(name: str) -> KernelStatus:
    """Kernel `name`'s status, building and registering it on the first call (a failure is logged once)."""
    if name not in KERNELS:
        raise ValueError(f"no native CPU kernel {name!r}; the kernels are {', '.join(KERNELS)}")
    with _locks[name]:
        if name not in _status:
            kernel = KERNELS[name]
            try:
                _status[name] = _load(kernel)
            except Exception as e:  # noqa: BLE001 - any failure means: this kernel is not used
                skipped = isinstance(e, Skipped)
                reason = str(e) if skipped else f"{type(e).__name__}: {e}"
                _status[name] = KernelStatus(name, False, reason=reason, skipped=skipped)
                # an instruction set this CPU lacks is expected (the engine's start-up line says it); a build that
                # fails is not, and is told once per reason (no compiler: once, not once per kernel)
                (logger.debug if skipped or reason in _warned else logger.warning)(
                    "native CPU kernel %r unavailable (%s); its pure-JAX / XLA path is used", name, reason)
                _warned.add(reason)
        return _status[name]


def available(kernel: str | None = None) -> bool:
    """Whether `kernel` is built and registered (building it on the first call); None: every kernel in KERNELS."""
    if kernel is None:
        return all(s.ok for s in statuses().values())
    return status(kernel).ok


def unavailable_reason(kernel: str | None = None) -> str:
    """Why `kernel` is unavailable ('' when it is available); None: the reasons of every unavailable kernel."""
    if kernel is None:
        return "; ".join(f"{s.name}: {s.reason}" for s in statuses().values() if not s.ok)
    return status(kernel).reason


def library(kernel: str) -> ctypes.CDLL:
    """The loaded library of an available kernel (for its plain C entry points)."""
    if not available(kernel):
        raise RuntimeError(f"the native CPU kernel {kernel!r} is unavailable: {unavailable_reason(kernel)}")
    return _libraries[kernel]


def statuses() -> dict[str, KernelStatus]:
    """Every kernel's status; the ones not yet loaded are built side by side (one g++ per core)."""
    todo = [name for name in KERNELS if name not in _status]
    if len(todo) > 1:
        with concurrent.futures.ThreadPoolExecutor(max_workers=min(len(todo), os.cpu_count() or 1)) as pool:
            list(pool.map(status, todo))
    return {name: status(name) for name in KERNELS}


def describe(in_use: tuple[str, ...] | list[str]) -> str:
    """One line for a start-up log: the kernels running natively (`in_use`, those available), the ones built but
    not used by this engine, and the unavailable ones with their reasons (first line of each)."""
    all_status = statuses()
    used = [n for n in KERNELS if n in in_use and all_status[n].ok]
    idle = [n for n in KERNELS if n not in in_use and all_status[n].ok]
    reasons = {s.reason for s in all_status.values() if not s.ok}
    if not used and not idle and len(reasons) == 1:  # all off for one reason (JAXPAGED_NATIVE=0, no compiler)
        return f"native CPU kernels in use: none ({reasons.pop().splitlines()[0]})"
    missing = [f"{n} ({s.reason.splitlines()[0]})" for n, s in all_status.items() if not s.ok]
    for name, uses_amx in (("matmul", "JaxpagedMatmulUsesAmx"), ("qmatmul", "JaxpagedQMatmulUsesAmx")):
        if name in used and getattr(library(name), uses_amx)():
            used[used.index(name)] = f"{name} (AMX)"
    parts = [f"native CPU kernels in use: {', '.join(used) or 'none'}"]
    if idle:
        parts.append(f"built, not used by this engine: {', '.join(idle)}")
    if missing:
        parts.append(f"unavailable: {'; '.join(missing)}")
    return "; ".join(parts)
