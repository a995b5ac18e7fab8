"""The benchmark scripts still import what they name: every `from X import Y` in benchmarks/ (function-level ones
included, read from the source) whose X is jaxpaged, pallas_kernels or another benchmark module resolves, so a
renamed or moved name fails here rather than when someone runs the script on a borrowed GPU."""

from __future__ import annotations

import ast
import importlib
import pathlib
import subprocess
import sys
import time

import pytest

from tests import ROOT

BENCHMARKS = ROOT / "benchmarks"
SCRIPTS = sorted([*BENCHMARKS.glob("*.py"), *(BENCHMARKS / "peers").glob("*.py")])
LOCAL = {p.stem for p in SCRIPTS}  # the scripts import each other by bare name (their folders on sys.path)
CHECKED = ("jaxpaged", "pallas_kernels")


def named_imports(path) -> list[tuple[str, str, int]]:
    """(module, name, line) of every `from module import name` the file makes that this test checks."""
    out = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            root = node.module.split(".")[0]
            if root in CHECKED or node.module in LOCAL:
                out += [(node.module, alias.name, node.lineno) for alias in node.names]
    return out


def test_the_scripts_are_found():
    names = {p.name for p in SCRIPTS}
    assert {"throughput.py", "serving.py", "common.py", "vllm_cpu.py"} <= names


@pytest.mark.parametrize("path", SCRIPTS, ids=lambda p: str(p.relative_to(BENCHMARKS)))
def test_benchmark_imports_resolve(path, monkeypatch):
    monkeypatch.setattr(sys, "path", [str(BENCHMARKS), str(BENCHMARKS / "peers"), *sys.path])
    missing = []
    for module, name, line in named_imports(path):
        mod = importlib.import_module(module)
        if hasattr(mod, name):
            continue
        try:
            importlib.import_module(f"{module}.{name}")  # a submodule
        except ImportError:
            missing.append(f"line {line}: from {module} import {name}")
    assert not missing, f"{path.name}: " + "; ".join(missing)


def _benchmark_module(name: str, monkeypatch):
    monkeypatch.setattr(sys, "path", [str(BENCHMARKS), str(BENCHMARKS / "peers"), *sys.path])
    return importlib.import_module(name)


def test_serving_passes_vllm_only_the_options_it_shares(monkeypatch):
    serving = _benchmark_module("serving", monkeypatch)
    args = "--max-num-seqs 8 --log-level DEBUG --max-model-len=512 --max-decode-slowdown 0 --max-num-batched-tokens 64"
    assert serving.shared_options(args) == ["--max-num-seqs", "8", "--max-model-len=512",
                                            "--max-num-batched-tokens", "64"]
    assert serving.shared_options("") == []


def test_stopping_the_peer_server_ends_its_whole_process_group(monkeypatch, tmp_path):
    """vLLM's engine core is a child of its API server: stop_server ends the group, a child that ignores SIGTERM and
    outlives its parent too."""
    vllm_cpu = _benchmark_module("vllm_cpu", monkeypatch)
    pid_file = tmp_path / "child.pid"
    script = f"bash -c 'trap \"\" TERM; echo $$ > {pid_file}; exec sleep 300' & wait"
    proc = subprocess.Popen(["bash", "-c", script], start_new_session=True)
    for _ in range(100):
        if pid_file.exists() and pid_file.read_text().strip():
            break
        time.sleep(0.05)
    child = int(pid_file.read_text())
    assert vllm_cpu.group_alive(proc.pid)
    vllm_cpu.stop_server(proc, timeout=1)
    assert proc.poll() is not None
    assert not vllm_cpu.group_alive(proc.pid)
    state = pathlib.Path(f"/proc/{child}/stat")
    assert not state.exists() or state.read_text().rsplit(")", 1)[1].split()[0] == "Z"  # gone, or a zombie


def test_a_server_that_exits_or_never_answers_at_start_up_is_an_error_not_a_hang(monkeypatch):
    """common.wait_healthy, which serving.py uses for both servers: the peer's failure becomes its table's note."""
    common = _benchmark_module("common", monkeypatch)
    url = f"http://127.0.0.1:{common.free_port()}"
    with pytest.raises(RuntimeError, match="exited with 3 during start-up"):
        common.wait_healthy(subprocess.Popen(["bash", "-c", "exit 3"]), url, 10, "the peer")
    silent = subprocess.Popen(["sleep", "30"])
    with pytest.raises(RuntimeError, match="did not answer /health within 1 s"):
        common.wait_healthy(silent, url, 1, "the peer")
    assert silent.wait(5) != 0  # killed
