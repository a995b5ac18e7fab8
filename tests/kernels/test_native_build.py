"""The native CPU kernels' build (pallas_kernels/cpu_native/build.py): one table entry per kernel, a cache key that
follows the target, a kernel that cannot build disabling only itself, the prebuild command's report and exit
status, and the start-up line."""

from __future__ import annotations

import os
import re
import threading

import pytest

from pallas_kernels.cpu_native import __main__ as cli
from pallas_kernels.cpu_native import build
from pallas_kernels.cpu_native.build import KERNELS, Kernel, KernelStatus

needs_compiler = pytest.mark.skipif(not build.available("argmax"),
                                    reason=f"no native build here: {build.unavailable_reason('argmax')}")


def test_every_kernel_entry_names_existing_sources_and_distinct_targets():
    targets = [build.target_name(symbol) for kernel in KERNELS.values() for symbol in kernel.symbols]
    assert len(targets) == len(set(targets))
    assert build.target_name("JaxpagedMatmulGlu") == "jaxpaged_matmul_glu"
    assert build.target_name("JaxpagedPagedAttention") == "jaxpaged_paged_attention"
    for kernel in KERNELS.values():
        for source in kernel.sources:
            with open(os.path.join(build.HERE, source)) as f:
                text = f.read()
            for symbol in kernel.symbols:  # the handler the entry registers is defined in its sources
                assert re.search(rf"XLA_FFI_DEFINE_HANDLER_SYMBOL\(\s*{symbol},", text), (kernel.name, symbol)


def test_the_cache_key_follows_the_target_and_is_stable(monkeypatch):
    monkeypatch.delenv("JAXPAGED_NATIVE_MARCH", raising=False)
    native = build.library_path(KERNELS["rope"])
    assert build.library_path(KERNELS["rope"]) == native
    assert os.path.basename(native).startswith("jaxpaged_rope-") and build.target_flag() in ("-march=native",
                                                                                            "-mcpu=native")
    monkeypatch.setenv("JAXPAGED_NATIVE_MARCH", "x86-64-v2")
    assert build.target_flag() == "-march=x86-64-v2" and "-march=x86-64-v2" in build.flags()
    v2 = build.library_path(KERNELS["rope"])
    monkeypatch.setenv("JAXPAGED_NATIVE_MARCH", "x86-64-v3")
    assert len({native, v2, build.library_path(KERNELS["rope"])}) == 3
    assert build.library_path(KERNELS["norm"]) != build.library_path(KERNELS["rope"])


def test_unknown_kernel_is_a_value_error_naming_the_kernels():
    with pytest.raises(ValueError, match="no native CPU kernel 'flash'.*attention, matmul"):
        build.available("flash")


@pytest.mark.skipif(os.environ.get("JAXPAGED_NATIVE") == "0", reason="JAXPAGED_NATIVE=0 disables every kernel first")
def test_missing_instruction_set_skips_the_kernel_without_building(monkeypatch):
    monkeypatch.setitem(KERNELS, "future", Kernel("future", ("rope.cc",), ("JaxpagedRope",),
                                                  needs=("__NO_SUCH_ISA__",)))
    monkeypatch.setitem(build._locks, "future", threading.Lock())
    monkeypatch.setattr(build, "_status", dict(build._status))
    status = build.status("future")
    assert not status.ok and status.skipped and status.path == ""
    assert status.reason.startswith("needs NO_SUCH_ISA, which ") and build.target_flag() in status.reason


@needs_compiler
def test_a_kernel_that_fails_to_build_disables_only_itself_and_the_prebuild_fails(monkeypatch, tmp_path, capsys):
    broken = tmp_path / "broken.cc"
    broken.write_text('#error "this kernel does not compile"\n')
    monkeypatch.setitem(KERNELS, "broken", Kernel("broken", (str(broken),), ("JaxpagedBroken",)))
    monkeypatch.setitem(build._locks, "broken", threading.Lock())
    monkeypatch.setattr(build, "_status", dict(build._status))
    status = build.status("broken")
    assert not status.ok and not status.skipped
    assert "failed" in status.reason and "this kernel does not compile" in status.reason
    assert build.available("argmax") and not build.available()  # None: every kernel of the table
    assert "broken: RuntimeError" in build.unavailable_reason()
    assert not [name for name in os.listdir(build.cache_dir()) if name.startswith(".jaxpaged_broken-")]

    assert cli.main(["--build"]) == 1
    out = capsys.readouterr().out
    assert re.search(r"^  broken\s+unavailable: RuntimeError: .*failed", out, re.M), out
    assert re.search(r"^  argmax\s+native \((cached|built in [\d.]+ s)\): ", out, re.M), out


def test_describe_says_what_runs_what_is_idle_and_why_the_rest_is_not(monkeypatch):
    fake = {name: KernelStatus(name, True, path=f"/x/{name}.so") for name in KERNELS}
    fake["matmul"] = KernelStatus("matmul", False, reason="needs AVX512BF16, which g++ -march=x86-64-v2 ...\nmore",
                                  skipped=True)
    monkeypatch.setattr(build, "_status", fake)
    assert build.describe(["attention", "matmul"]) == (
        "native CPU kernels in use: attention; built, not used by this engine: norm, rope, argmax, penalties, "
        "top_p, gumbel, logprobs, qmatmul; unavailable: matmul (needs AVX512BF16, which g++ -march=x86-64-v2 ...)")
    off = {name: KernelStatus(name, False, reason="disabled by JAXPAGED_NATIVE=0", skipped=True) for name in KERNELS}
    monkeypatch.setattr(build, "_status", off)
    assert build.describe(["attention"]) == "native CPU kernels in use: none (disabled by JAXPAGED_NATIVE=0)"
