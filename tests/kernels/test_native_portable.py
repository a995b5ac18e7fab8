"""The native CPU kernels built for an x86 CPU without AVX-512 (JAXPAGED_NATIVE_MARCH=x86-64-v2: SSE4.2, no AVX): the
portable kernels (attention and its pool writes, norm, rope, the sampler's argmax, penalties, top-p threshold and
Gumbel draw, the quantized matmul) build and give pure JAX's numbers (the quantized matmul's plain loops:
tests/kernels/test_quantized_matmul.py), the engine's greedy tokens through them equal the reference backend's, and
the AVX-512-only matmul reports itself unavailable with the reason instead of disabling the others.

The builds (~10-60 s of g++ on 2 cores) are shared by the module: `python -m pallas_kernels.cpu_native --build` fills a
cache of their own (beside the native cache, `-x86-64-v2`) and each check runs in a child process that finds them
there (tests/kernels/native_portable_checks.py says why a child process). A library's name holds the hash of its
sources, headers, compiler and flags, so a run builds what changed since the last one (a fresh machine: all of them)
and checks exactly what these sources build."""

from __future__ import annotations

import json
import os
import platform
import re
import shutil
import subprocess
import sys

import pytest

from tests import ROOT

PORTABLE = ("attention", "norm", "rope", "argmax", "penalties", "top_p", "gumbel", "logprobs", "qmatmul")

pytestmark = [
    pytest.mark.slow,  # builds the native kernels for another target
    pytest.mark.skipif(platform.machine() not in ("x86_64", "AMD64"), reason="-march=x86-64-v2 is an x86 target"),
    pytest.mark.skipif(shutil.which(os.environ.get("JAXPAGED_CXX") or "g++") is None, reason="no C++ compiler"),
]


def run(env: dict, *args: str, timeout: int = 900) -> subprocess.CompletedProcess:
    result = subprocess.run([sys.executable, *args], cwd=ROOT, env=env, capture_output=True, text=True,
                            timeout=timeout)
    assert result.returncode == 0, f"{args} exited {result.returncode}:\n{result.stdout}\n{result.stderr[-6000:]}"
    return result


def kernel_lines(out: str) -> dict[str, str]:
    """The --build report: kernel name -> what follows it on its line."""
    return dict(line.split(maxsplit=1) for line in out.splitlines() if line.startswith("  "))


@pytest.fixture(scope="module")
def portable():
    """(environment of a child process that uses the x86-64-v2 build, the prebuild's printed status)."""
    from pallas_kernels.cpu_native.build import cache_dir

    env = {k: v for k, v in os.environ.items() if not k.startswith("JAXPAGED_NATIVE")}
    env.update(JAXPAGED_NATIVE_MARCH="x86-64-v2", JAXPAGED_NATIVE_CACHE=f"{cache_dir()}-x86-64-v2", JAX_PLATFORMS="cpu")
    built = run(env, "-m", "pallas_kernels.cpu_native", "--build", timeout=1200)
    return env, built.stdout


def libraries(out: str) -> dict[str, str]:
    """The --build report's library path of each portable kernel."""
    return {name: line.rsplit("; ", 1)[1] for name, line in kernel_lines(out).items() if name in PORTABLE}


def test_prebuild_builds_the_portable_kernels_and_reports_the_matmul_unavailable(portable):
    env, out = portable
    assert "-march=x86-64-v2" in out and env["JAXPAGED_NATIVE_CACHE"] in out
    lines = kernel_lines(out)
    assert set(lines) == {*PORTABLE, "matmul"}, out
    for name in PORTABLE:  # built now, or by an earlier run from these very sources and flags (the name's hash)
        assert re.fullmatch(r"native \((built in [\d.]+ s|cached)\): .*", lines[name]), lines[name]
    assert lines["matmul"].startswith("unavailable: ") and "AVX512BF16" in lines["matmul"], lines["matmul"]
    # a second run finds every library in the cache
    again = kernel_lines(run(env, "-m", "pallas_kernels.cpu_native", "--build").stdout)
    assert all(again[name].startswith("native (cached): ") for name in PORTABLE), again
    for name, path in libraries(out).items():
        assert os.path.dirname(path) == env["JAXPAGED_NATIVE_CACHE"] and os.path.isfile(path), path
        assert os.path.basename(path).startswith(f"jaxpaged_{name}-") and path.endswith(".so"), path


def test_portable_libraries_hold_no_avx_instructions(portable):
    """What x86-64-v2 promises: no instruction on ymm or zmm registers (AVX, AVX2, AVX-512) in any library."""
    objdump = shutil.which("objdump")
    if objdump is None:
        pytest.skip("no objdump")
    _, out = portable
    for name, path in libraries(out).items():
        text = subprocess.run([objdump, "-d", path], capture_output=True, text=True, timeout=120).stdout
        assert "xmm" in text, name  # SSE vectors: the portable loops are vectorised
        assert not re.search(r"%[yz]mm\d", text), f"{name} uses AVX registers"


def test_portable_kernels_give_the_pure_jax_numbers(portable):
    """Attention against pallas_kernels/reference.py and a float64 answer (decodes, prompts, chunks, a mixed batch,
    window and soft cap, float32 and bfloat16 over NaN-poisoned pools), the pool writes against the reference
    scatter, norm / rope / argmax against the models' pure-JAX functions (tests/kernels/native_portable_checks.py)."""
    env, _ = portable
    assert run(env, "-m", "tests.kernels.native_portable_checks", "kernels").stdout.strip().endswith("ok")


def test_engine_on_the_portable_kernels_gives_the_reference_backend_s_tokens(portable):
    from tests.tiny import greedy_tokens, random_params, random_prompts, tiny_config

    env, _ = portable
    child = json.loads(run(env, "-m", "tests.kernels.native_portable_checks", "engine").stdout.strip().splitlines()[-1])
    config = tiny_config(hidden=48, heads=6, kv_heads=2, head_dim=16, layers=2)
    want = greedy_tokens(config, random_params(config), random_prompts(4, 3, 30, seed=9),
                         attention_backend="reference", max_tokens=12)
    assert child["tokens"] == want
    # the start-up line: attention runs natively, the others are built (a float32 model uses none of them) but for
    # the matmul, which says why not
    (line,) = child["native_line"]
    assert line.startswith("native CPU kernels in use: attention;"), line
    assert "built, not used by this engine: norm, rope, argmax, penalties, top_p, gumbel, logprobs" in line, line
    assert "unavailable: matmul (" in line, line


@pytest.mark.skipif(shutil.which("aarch64-linux-gnu-g++") is None,
                    reason="no aarch64 cross compiler (Debian's g++-aarch64-linux-gnu)")
def test_portable_kernels_compile_for_arm(monkeypatch, tmp_path):
    """The same sources compile for a 64-bit Arm CPU (plain C++ that g++ vectorises with NEON; at -O0 here, to
    keep the test short: what fails on Arm is an x86 intrinsic or instruction, which every level rejects); the
    matmul is refused before compiling, naming the instruction sets it lacks. This machine cannot run them."""
    import concurrent.futures

    import jax

    from pallas_kernels.cpu_native import build

    def compile_for_arm(name: str) -> str:
        out = str(tmp_path / f"{name}.o")
        cmd = ["aarch64-linux-gnu-g++", "-std=c++17", "-O0", "-march=armv8-a", "-fPIC", "-c", "-I",
               jax.ffi.include_dir(), "-I", build.HERE, *(os.path.join(build.HERE, s)
                                                          for s in build.KERNELS[name].sources), "-o", out]
        result = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
        assert result.returncode == 0, f"{name}: {result.stderr[-4000:]}"
        return out

    with concurrent.futures.ThreadPoolExecutor(max_workers=os.cpu_count() or 1) as pool:
        objects = list(pool.map(compile_for_arm, PORTABLE))
    for path in objects:
        with open(path, "rb") as f:
            header = f.read(20)
        assert header[:4] == b"\x7fELF" and int.from_bytes(header[18:20], "little") == 183, path  # EM_AARCH64
    monkeypatch.setenv("JAXPAGED_CXX", "aarch64-linux-gnu-g++")
    monkeypatch.setenv("JAXPAGED_NATIVE_MARCH", "armv8-a")
    with pytest.raises(build.UnsupportedTarget, match="needs AVX512F, AVX512BF16, which aarch64-linux-gnu-g"):
        build.build_library(build.KERNELS["matmul"])
