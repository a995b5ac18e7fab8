"""Reading compiled HLO text in tests (and benchmarks/tensor_parallel.py, benchmarks/quant_fusion.py): copies of the
K/V pool, where an instruction lives, the computations a loop body reaches, the ops that run a matmul and what their
weight operand is (a quantized weight's codes, or a full-width array another fusion wrote)."""

from __future__ import annotations

import dataclasses
import math
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


# ---- where a matmul's weight comes from (compiled GPU / TPU HLO) ---------------------------------------------------

INTEGER_TYPES = ("u8", "s8", "u4", "s4")
GEMM_CALL_TARGETS = ("__cublas$gemm", "__cublas$lt$matmul", "__cudnn$")


@dataclasses.dataclass(frozen=True)
class Operand:
    name: str  # the instruction in the calling computation, bitcasts and copies followed back to what wrote it
    dtype: str  # HLO element type: bf16, f32, u8, ...
    dims: tuple[int, ...]
    producer: str  # the producer's opcode (and fusion kind): "parameter", "fusion kLoop", "dynamic-slice", ...

    @property
    def size(self) -> int:
        return math.prod(self.dims)


@dataclasses.dataclass(frozen=True)
class DotOp:
    """One instruction of a top-level computation (the entry or a loop body) that runs a matmul: a fusion whose
    computations hold a dot, a convolution (TPU) or a reduce (a matrix-vector product at one row), a library GEMM
    call, or a Pallas kernel's custom call (Triton on GPU, Mosaic on TPU)."""

    name: str
    kind: str  # "fusion kCustom __triton_gemm", "custom-call __cublas$gemm", "fusion kOutput", ...
    computation: str  # the top-level computation it is in
    operands: tuple[Operand, ...]
    inner_ops: tuple[str, ...]  # the opcodes inside it (every computation it reaches), sorted

    def reads_codes(self, n: int, k: int, bits: int) -> bool:
        """Whether integer codes of an [N, K] weight (or of a stack of them) are among its operands."""
        return any(o.dtype in INTEGER_TYPES and o.size >= n * k * bits // 8 for o in self.operands)

    def full_width_operands(self, n: int, k: int) -> list[Operand]:
        """Floating-point operands of exactly N * K elements (any shape): a weight at full width."""
        return [o for o in self.operands if o.dtype not in INTEGER_TYPES and o.size == n * k]


def _type_and_rest(text: str) -> tuple[str, str]:
    """'bf16[8,16]{1,0} dot(...)...' or '(f32[2], u8[4]) custom-call(...)' -> (the type, the rest)."""
    if text.startswith("("):
        depth = 0
        for i, ch in enumerate(text):
            depth += ch == "("
            depth -= ch == ")"
            if depth == 0:
                return text[:i + 1], text[i + 1:].lstrip()
    head, _, rest = text.partition(" ")
    return head, rest


def _array_type(type_text: str) -> tuple[str, tuple[int, ...]]:
    """'bf16[8,16]{1,0:T(8,128)}' -> ('bf16', (8, 16)); a tuple type gives its first element's."""
    m = re.search(r"(\w+)\[([\d,]*)\]", type_text)
    if not m:
        return type_text, ()
    return m.group(1), tuple(int(d) for d in m.group(2).split(",") if d)


def _instructions(lines: list[str]) -> dict[str, dict]:
    """{name: {"type", "opcode", "operands", "line"}} of one computation's instruction lines."""
    out = {}
    for line in lines:
        m = re.match(r"\s*(?:ROOT )?%(\S+) = (.*)$", line)
        if not m:
            continue
        type_text, rest = _type_and_rest(m.group(2))
        op = re.match(r"([\w\-$]+)\((.*?)\)(?:,|$)", rest)
        if not op:
            continue
        operands = re.findall(r"%([\w.\-]+)", op.group(2))
        out[m.group(1)] = {"type": type_text, "opcode": op.group(1), "operands": operands, "line": line}
    return out


def _producer(insts: dict[str, dict], name: str) -> tuple[str, str]:
    """(name, opcode and kind) of what wrote `name`, looking through bitcasts, copies and get-tuple-elements."""
    while name in insts and insts[name]["opcode"] in ("bitcast", "copy", "get-tuple-element", "copy-done") \
            and insts[name]["operands"]:
        name = insts[name]["operands"][0]
    if name not in insts:
        return name, "parameter"
    inst = insts[name]
    kind = re.search(r"kind=(\w+)", inst["line"])
    return name, inst["opcode"] + (f" {kind.group(1)}" if inst["opcode"] == "fusion" and kind else "")


def dot_ops(hlo: str) -> list[DotOp]:
    """The matmuls of a compiled module, each as the top-level instruction that runs it (see `DotOp`)."""
    comps = computations(hlo)
    called = set()
    for lines in comps.values():
        for line in lines:
            called.update(re.findall(r"(?:calls|to_apply)=%([\w.\-]+)", line))
    out = []
    for top in (name for name in comps if name not in called):
        insts = _instructions(comps[top])
        for name, inst in insts.items():
            line = inst["line"]
            target = re.search(r'custom_call_target="([^"]+)"', line)
            if inst["opcode"] == "custom-call" and target and target.group(1).startswith(GEMM_CALL_TARGETS):
                kind, inner = f"custom-call {target.group(1)}", ("custom-call",)
            elif inst["opcode"] == "custom-call" and target and target.group(1) in TRITON_CALL_TARGETS:
                # a Pallas GPU kernel (its dot is inside the Triton IR, not in HLO): counted as a matmul where a
                # caller asks what reads a weight's codes (dot_ops of a module without quantized matmuls has none)
                kind, inner = f"custom-call {target.group(1)}", ("custom-call", "triton")
            elif inst["opcode"] == "custom-call" and target and target.group(1) == "tpu_custom_call":
                # a Pallas TPU (Mosaic) kernel, the same way: a module's quantized matmuls may be one
                kind, inner = "custom-call tpu_custom_call", ("custom-call", "mosaic")
            elif inst["opcode"] == "fusion":
                callee = re.search(r"calls=%([\w.\-]+)", line).group(1)
                inner = sorted({i["opcode"] for c in reachable(comps, callee)
                                for i in _instructions(comps[c]).values()})
                if not {"dot", "convolution", "reduce"} & set(inner):
                    continue
                fusion_kind = re.search(r"kind=(\w+)", line).group(1)
                backend = re.search(r'"kind":"(\w+)"', line)
                kind = f"fusion {fusion_kind}" + (f" {backend.group(1)}" if backend else "")
            elif inst["opcode"] in ("dot", "convolution"):
                kind, inner = inst["opcode"], (inst["opcode"],)
            else:
                continue
            operands = []
            for operand in inst["operands"]:
                producer, what = _producer(insts, operand)
                dtype, dims = _array_type(insts[operand]["type"] if operand in insts else "")
                operands.append(Operand(producer, dtype, dims, what))
            out.append(DotOp(name, kind, top, tuple(operands), tuple(inner)))
    return out


def full_width_writes(hlo: str, n: int, k: int) -> list[str]:
    """Instructions of the top-level computations that write a floating-point array of N * K elements (a weight
    dequantized to full width, or its scales broadcast to it), as "type opcode %name"; bitcasts, parameters and
    tuples are not writes. "S(1)" marks a buffer XLA TPU assigned to memory space 1 (its layout says so)."""
    comps = computations(hlo)
    called = {c for lines in comps.values() for line in lines
              for c in re.findall(r"(?:calls|to_apply)=%([\w.\-]+)", line)}
    out = []
    for top in (name for name in comps if name not in called):
        for name, inst in _instructions(comps[top]).items():
            if inst["type"].startswith("(") or inst["opcode"] in ("parameter", "bitcast", "get-tuple-element",
                                                                   "copy-start", "copy-done", "constant"):
                continue
            dtype, dims = _array_type(inst["type"])
            if dtype not in INTEGER_TYPES and dtype != "pred" and math.prod(dims) == n * k and dims:
                kind = re.search(r"kind=(\w+)", inst["line"])
                where = " S(1)" if "S(1)" in inst["type"] else ""
                out.append(f"{dtype}[{','.join(map(str, dims))}]{where} {inst['opcode']}"
                           f"{' ' + kind.group(1) if kind else ''} %{name}")
    return out


def weight_fused(hlo: str, n: int, k: int, bits: int) -> bool:
    """Whether the quantized [N, K] weight's dequantization runs inside the matmul: an op that runs a dot (or the
    reduce of a one-row product) reads its integer codes, and nothing writes an [N, K] float array."""
    return not full_width_writes(hlo, n, k) and any(op.reads_codes(n, k, bits) for op in dot_ops(hlo))
