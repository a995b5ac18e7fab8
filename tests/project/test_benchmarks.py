"""The benchmark scripts still import what they name: every `from X import Y` in benchmarks/ (function-level ones
included, read from the source) whose X is jaxpaged, pallas_kernels or another benchmark module resolves, so a
renamed or moved name fails here rather than when someone runs the script on a borrowed GPU."""

from __future__ import annotations

import ast
import importlib
import sys

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
