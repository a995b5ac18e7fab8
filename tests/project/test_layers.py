"""The package's layers import one way: entrypoints -> engine -> worker -> core, with parallel -> worker, and core
(host bookkeeping: requests, block pool, scheduler) free of JAX. Read from the source (AST), function-level imports
included, so an import hidden inside a function cannot close a cycle."""

from __future__ import annotations

import ast
import pathlib

from tests import ROOT

PACKAGE = ROOT / "jaxpaged"

# layer -> the jaxpaged layers it may import (besides itself and the shared top-level modules)
ALLOWED = {
    "core": set(),
    "worker": {"core", "models"},
    "models": {"worker", "loader"},  # models: the attention seam (worker.attention); gemma3 reads loader.layout
    "loader": {"models", "parallel"},  # a sharded checkpoint restores into the tensor-parallel layout
    "parallel": {"worker", "core", "models"},
    # engine: runtime for the compilation cache, spec_decode for speculative decoding's host side
    "engine": {"core", "worker", "models", "parallel", "loader", "spec_decode", "runtime"},
    "spec_decode": {"core", "worker", "models", "loader"},
    "entrypoints": {"core", "worker", "models", "parallel", "loader", "engine", "runtime", "spec_decode"},
    "runtime": set(),
}
# top-level modules every layer may use
SHARED = {"config", "sampling_params", "outputs", "chat", "client_json", "__init__"}
NO_JAX = ("jax", "jaxlib", "flax", "pallas_kernels", "numpy")  # core holds plain Python


def imports(path: pathlib.Path, module_level_only: bool = False) -> list[tuple[str, int]]:
    """(imported module, line) for every import in the file."""
    tree = ast.parse(path.read_text())
    nodes = tree.body if module_level_only else list(ast.walk(tree))
    out = []
    for node in nodes:
        if isinstance(node, ast.Import):
            out += [(a.name, node.lineno) for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            out += [(node.module, node.lineno)]
            out += [(f"{node.module}.{a.name}", node.lineno) for a in node.names if node.module == "jaxpaged"]
    return out


def layer_of(module: str) -> str | None:
    """'jaxpaged.worker.sampler' -> 'worker'; a shared top-level module -> None."""
    parts = module.split(".")
    if parts[0] != "jaxpaged" or len(parts) < 2 or parts[1] in SHARED:
        return None
    if not (PACKAGE / parts[1]).is_dir():  # a name the package exports (`from jaxpaged import LLM`)
        return None
    return parts[1]


def test_every_layer_imports_only_the_layers_below_it():
    wrong = []
    for path in sorted(PACKAGE.rglob("*.py")):
        rel = path.relative_to(ROOT).with_suffix("")
        layer = layer_of(".".join(rel.parts))
        if layer is None:
            continue
        assert layer in ALLOWED, f"{rel}: a layer the layering rules do not know ({layer}); add it to ALLOWED"
        for module, line in imports(path):
            target = layer_of(module)
            if target is not None and target != layer and target not in ALLOWED[layer]:
                wrong.append(f"{rel}.py:{line} ({layer}) imports {module} ({target})")
    assert not wrong, "imports against the layering:\n" + "\n".join(wrong)


def test_core_imports_no_jax_even_through_what_it_imports():
    """Module-level imports of core and of every jaxpaged module they reach: none is JAX, flax or numpy."""
    seen, todo, found = set(), [p for p in (PACKAGE / "core").glob("*.py")], []
    while todo:
        path = todo.pop()
        if path in seen:
            continue
        seen.add(path)
        for module, line in imports(path, module_level_only=True):
            if module.split(".")[0] in NO_JAX:
                found.append(f"{path.relative_to(ROOT)}:{line} imports {module}")
            if module.startswith("jaxpaged.") and module.split(".")[1] not in ("__init__",):
                target = ROOT.joinpath(*module.split("."))
                for candidate in (target.with_suffix(".py"), target / "__init__.py"):
                    if candidate.exists() and candidate.parent != PACKAGE.parent:
                        todo.append(candidate)
    assert not found, "core reaches JAX:\n" + "\n".join(found)


def test_the_rules_catch_an_inverted_import(tmp_path):
    """The check itself: a worker module importing the engine is reported."""
    bad = tmp_path / "bad.py"
    bad.write_text("def f():\n    from jaxpaged.engine.llm_engine import Engine\n")
    (module, _), = [(m, n) for m, n in imports(bad) if m.startswith("jaxpaged")]
    assert layer_of(module) == "engine" and "engine" not in ALLOWED["worker"]


def test_no_test_module_imports_another():
    """What tests share lives in helper modules (tests/tiny.py, tests/server/harness.py, ...), so each test module
    runs alone and a helper's change is visible in one place."""
    tests = ROOT / "tests"
    wrong = [f"{path.relative_to(ROOT)}:{line} imports {name}"
             for path in sorted(tests.rglob("*.py"))
             for name, line in imports(path)
             if name.startswith("tests.") and name.rsplit(".", 1)[-1].startswith("test_")]
    assert not wrong, wrong
