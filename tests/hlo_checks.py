"""Reading compiled HLO text in tests (and benchmarks/tensor_parallel.py): copies of the K/V pool, where an
instruction lives, the computations a loop body reaches."""

from __future__ import annotations

import re

# custom-call targets of a Pallas GPU (Triton) kernel in compiled HLO, and of a Pallas TPU (Mosaic) kernel
TRITON_CALL_TARGETS = ("__gpu$xla.gpu.triton", "triton_kernel_call_ffi")
TPU_KERNEL = 'custom_call_target="tpu_custom_call"'


def pool_copies(hlo: str, pool_shape: tuple[int, ...]) -> list[str]:
    """HLO instructions that copy a pool-shaped array (synchronous or asynchronous copies)."""
    dims = ",".join(map(str, pool_shape))
    return [line.strip()[:160] for line in hlo.splitlines()
            if re.search(rf"\[{dims}\]", line) and re.search(r" copy(-start)?\(", line)]


def computations_with(hlo: str, needle: str) -> list[str]:
    """Names of the HLO computations with an instruction containing `needle`."""
    names, current = [], None
    for line in hlo.splitlines():
        header = re.match(r"(?:ENTRY )?%(\S+) ", line)
        if header:
            current = header.group(1)
        elif needle in line and current not in names:
            names.append(current)
    return names


def computations(hlo: str) -> dict[str, list[str]]:
    """{computation name: its instruction lines}."""
    out, current = {}, None
    for line in hlo.splitlines():
        header = re.match(r"(?:ENTRY )?%(\S+) .*\{$", line)
        if header:
            current = header.group(1)
            out[current] = []
        elif current is not None and line.strip() not in ("}", ""):
            out[current].append(line)
    return out


def reachable(comps: dict[str, list[str]], root: str) -> set[str]:
    """`root` and every computation it calls (fusions, nested loops, conditionals, reducers), transitively."""
    seen, todo = set(), [root]
    while todo:
        name = todo.pop()
        if name in seen or name not in comps:
            continue
        seen.add(name)
        for line in comps[name]:
            todo += re.findall(r"(?:calls|to_apply|body|condition|branch_computations|true_computation|"
                               r"false_computation)=\{?%([\w.\-]+)", line)
            for group in re.findall(r"branch_computations=\{([^}]*)\}", line):
                todo += re.findall(r"%([\w.\-]+)", group)
    return seen


COLLECTIVES = ("all-reduce", "all-gather", "reduce-scatter", "all-to-all", "collective-permute")


def layer_loop_collectives(hlo: str, pool_shape: tuple[int, ...]) -> tuple[dict[str, int], dict[str, int]]:
    """(collectives in the layer loop's body, collectives elsewhere), by op.

    The model's layers run in one `while` (a fori_loop) whose carry holds the pool, so its body is in the HLO once and
    runs once per layer: the collectives of that body, and of everything it calls, are the collectives per layer.
    `pool_shape` is the pool's per-device shape, which picks that loop out of the others (sampling, searches)."""
    comps = computations(hlo)
    dims = ",".join(map(str, pool_shape))
    loops = [re.search(r"body=%([\w.\-]+)", line).group(1) for lines in comps.values() for line in lines
             if " while(" in line and f"[{dims}]" in line.split(" while(")[0]]
    assert len(loops) == 1, f"expected one layer loop carrying a [{dims}] pool, found {loops}"
    body = reachable(comps, loops[0])

    def count(names) -> dict[str, int]:
        return {op: sum(len(re.findall(rf" {op}(?:-start)?\(", line)) for n in names for line in comps[n])
                for op in COLLECTIVES}

    return count(body), count(set(comps) - body)
