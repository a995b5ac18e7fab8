"""Does XLA fuse the dequantization of kept-quantized weights into the dot on GPU and TPU? Compiled, not timed.

No GPU or TPU is needed: each case is compiled for a device that is not here (deviceless AOT) and its compiled HLO
is read. GPU: the CUDA PJRT plugin (`jax-cuda12-plugin`, with the nvidia wheels' ptxas) compiles for the target
configs in benchmarks/target_configs/ (H100 SXM, H200: openxla/xla's device specs). TPU: libtpu's compile-only
client for a v5e / v6e chip (`topologies.get_topology_desc(platform="tpu", ...)`). Install those into a venv of
their own, never into the project's (a CUDA plugin there would change every test):

    python3 -m venv /work/fusion-venv
    /work/fusion-venv/bin/pip install "jax[tpu,cuda12]==0.10.2" flax==0.12.8 pytest
    PYTHONPATH=. /work/fusion-venv/bin/python benchmarks/quant_fusion.py --targets h100 h200 --variants dense uint4
    PYTHONPATH=. /work/fusion-venv/bin/python benchmarks/quant_fusion.py --targets v5e --variants dense --merge

(libtpu allows one process at a time: /tmp/libtpu_lockfile.) What is compiled is the engine's own code: the layer
loop as the models run it (`jax.lax.fori_loop` over a stacked [L, ...] weight, `layer_glu` for a gated MLP's
gate/up pair and `layer_matmul` for its down projection, which call `quant.qglu` / `quant.qmatmul` on a
`QuantizedWeight` in the plain layout), for every format the engine keeps and bf16 as the baseline, at Llama-3-8B's
[4096 -> 14336] gate/up and [14336 -> 4096] down and SmolLM2's [576 -> 1536] gate/up, at M = 1, 8, 256 rows (decode
batches) and 2048 (a prefill chunk).

A case is fused when an op that runs the product (a fusion holding the dot, a TPU convolution, or the reduce a
one-row product becomes; a library GEMM call; or, for the GGUF block formats, the custom call of a Pallas kernel:
on CUDA the Triton kernel pallas_kernels/gpu_qmatmul.py, whose dot XLA compiles from Triton IR, and on TPU the Mosaic
kernel pallas_kernels/tpu_qmatmul.py for Q8_0 and for 4-bit products above `quant.NIBBLE_MAX_ROWS` rows, compiled by
libtpu's Mosaic) reads the weight's integer codes
and no instruction of the entry or the loop body writes a float array of N * K elements (the weight dequantized to
full width, or its scales broadcast to it: `tests/hlo_checks.full_width_writes`). The table also says what XLA made
and the module's temporary bytes (`memory_analysis()`) against one full-width bf16 [N, K] weight (XLA TPU may place
a full-width write in memory space S(1), outside those bytes; at M = 2048 the activations alone can exceed them).

`--variants` compiles other formulations of the same product beside the engine's (`VARIANTS`: `dense` is the
engine's path before the uint4 form and the GPU kernel, dequantize-then-dot on every platform). Writes
benchmarks/results/quant_fusion.json (or --out): versions, target configs, every case with its evidence (the ops'
operands and a few lines of their fused computations); `--merge` keeps the file's cases this run does not compile
again.
"""

from __future__ import annotations

import argparse
import functools
import importlib.metadata
import json
import os
import re
import sys
import time

import jax

jax.config.update("jax_platforms", "cpu")  # a script: the compile-only clients are asked for by name below

import jax.numpy as jnp  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, ROOT)
sys.path.insert(0, HERE)
from common import print_table  # noqa: E402

from jaxpaged.models import quant  # noqa: E402
from jaxpaged.models.matmul import layer_glu, layer_matmul  # noqa: E402
from tests.hlo_checks import (  # noqa: E402
    INTEGER_TYPES,
    computations,
    dot_ops,
    full_width_writes,
    reachable,
    weight_fused,
)

LAYERS = 4  # a stacked weight's layers: the loop is the models' (one body, run once per layer)
SHAPES = {  # name: (K, N, what runs it)
    "llama3-8b gate/up": (4096, 14336, "glu"),
    "llama3-8b down": (14336, 4096, "matmul"),
    "smollm2 gate/up": (576, 1536, "glu"),
}
ROWS = (1, 8, 256, 2048)
FORMATS = ("bf16", "int8", "q8_0", "q4_0", "q4_1", "q4_k")
TARGETS = {  # name: (platform, topology, target config file or None)
    "h100": ("cuda", "1x1x1", "h100_sxm.txtpb"),
    "h200": ("cuda", "1x1x1", "h200.txtpb"),
    "v5e": ("tpu", "v5e:2x2", None),
    "v6e": ("tpu", "v6e:2x2", None),
}
_FORMAT_FIELDS = {"int8": (8, quant.CHANNEL), "q8_0": (8, quant.BLOCK_SYM), "q4_0": (4, quant.BLOCK_SYM),
                  "q4_1": (4, quant.BLOCK_F16), "q4_k": (4, quant.BLOCK_F32)}


@functools.cache
def device(target: str):
    return devices(target, 1)[0]


def devices(target: str, count: int) -> list:
    """`count` devices of `target` with nothing behind them (deviceless compiles); on CUDA, one host's GPUs."""
    from jax.experimental import topologies

    platform, topology, config = TARGETS[target]
    if platform == "tpu":
        return topologies.get_topology_desc(platform="tpu", topology_name=topology).devices[:count]
    with open(os.path.join(HERE, "target_configs", config)) as f:
        return topologies.get_topology_desc(platform="cuda", topology=f"1x1x{count}",
                                            target_config=f.read()).devices


def abstract_weight(fmt: str, k: int, n: int, sharding, layers: int = LAYERS):
    """A stacked [L, K, N] weight of `fmt` as the engine keeps it (plain layout), from ShapeDtypeStructs."""
    def sds(shape, dtype):
        return jax.ShapeDtypeStruct(shape, dtype, sharding=sharding)

    if fmt == "bf16":
        return sds((layers, k, n), jnp.bfloat16)
    bits, mode = _FORMAT_FIELDS[fmt]
    kp = -(-k // quant.BLOCK) * quant.BLOCK
    blocks = kp // quant.BLOCK
    scales = {quant.CHANNEL: sds((layers, n), jnp.float32), quant.BLOCK_SYM: sds((layers, n, blocks), jnp.float16),
              quant.BLOCK_F16: sds((layers, n, blocks, 2), jnp.float16),
              quant.BLOCK_F32: sds((layers, n, blocks, 2), jnp.float32)}[mode]
    return quant.QuantizedWeight(sds((layers, n, kp * bits // 8), jnp.uint8), scales, bits, mode, (layers, k, n),
                                 compute_dtype="bfloat16")


def layer_loop(kind: str):
    """The models' layer loop around one matmul kind: acc += x @ w[layer] (or the gated pair's product)."""
    def run(x, *ws):
        def body(i, acc):
            y = layer_glu(x, ws[0], ws[1], i, "silu") if kind == "glu" else layer_matmul(x, ws[0], i)
            return acc + y
        n = ws[0].shape[-1]
        return jax.lax.fori_loop(0, ws[0].shape[0], body, jnp.zeros((x.shape[0], n), x.dtype))
    return run


def _fused_lines(hlo: str, op) -> list[str]:
    """A few lines of the dot op's fused computations: the dequantizing ones and the dot (the evidence)."""
    comps = computations(hlo)
    callee = re.search(r"calls=%([\w.\-]+)", next((line for lines in comps.values() for line in lines
                                                   if re.match(rf"\s*(?:ROOT )?%{re.escape(op.name)} = ", line)), ""))
    if not callee:
        return []
    keep = []
    for name in sorted(reachable(comps, callee.group(1))):
        for line in comps[name]:
            if re.search(r" (convert|multiply|shift-right-logical|and|dot|convolution|concatenate)\(", line):
                keep.append(re.sub(r", metadata=\{.*", "", line.strip())[:200])
    return keep[:10]


def _what(op) -> str:
    """A matmul op in a few words: its kind, and "reduce" where a one-row product became one."""
    if "custom-call" in op.inner_ops:  # a library GEMM or a Pallas GPU kernel
        return op.kind
    inner = "dot" if "dot" in op.inner_ops else "convolution" if "convolution" in op.inner_ops else "reduce"
    return f"{op.kind} ({inner})"


def compile_case(target: str, fmt: str, shape: str, rows: int, variant: str | None = None) -> dict:
    k, n, kind = SHAPES[shape]
    dev = device(target)
    sharding = jax.sharding.SingleDeviceSharding(dev)
    ws = [abstract_weight(fmt, k, n, sharding) for _ in range(2 if kind == "glu" else 1)]
    x = jax.ShapeDtypeStruct((rows, k), jnp.bfloat16, sharding=sharding)
    start = time.perf_counter()
    with VARIANTS[variant]() if variant else _patched(_ENGINE_PLAIN):
        compiled = jax.jit(layer_loop(kind)).lower(x, *ws).compile()
    seconds = time.perf_counter() - start
    hlo = compiled.as_text()
    bits = 16 if fmt == "bf16" else _FORMAT_FIELDS[fmt][0]
    ops = [op for op in dot_ops(hlo) if op.reads_codes(n, k, bits) or op.full_width_operands(n, k)]
    writes = full_width_writes(hlo, n, k)
    temp = compiled.memory_analysis().temp_size_in_bytes
    full = n * k * 2
    per_op = [{"name": op.name, "kind": op.kind, "computation": op.computation,
               "operands": [f"{o.dtype}[{','.join(map(str, o.dims))}] from {o.producer} %{o.name}"
                            for o in op.operands],
               "reads_codes": op.reads_codes(n, k, bits), "inner_ops": list(op.inner_ops),
               "evidence": _fused_lines(hlo, op)} for op in ops]
    fused = None if fmt == "bf16" else weight_fused(hlo, n, k, bits)
    return {"target": target, "format": fmt, "shape": shape, "k": k, "n": n, "rows": rows,
            "variant": variant or "engine",
            "fused": fused, "made": sorted({_what(op) for op in ops}), "full_width_writes": writes,
            "weight_ops": len(per_op), "temp_bytes": temp, "full_width_bytes": full, "temp_over_full": temp / full,
            "compile_s": round(seconds, 2), "ops": per_op}


# ---- other formulations of the dequantization (--variants) -----------------------------------------------------------

def _dequant(qw, u, s, m):
    """`_values_plain`'s formula, element for element: (u - offset) * s, or u * s + m (m None for the former)."""
    u = u.astype(jnp.float32)
    return (u - float(quant.offset(qw.bits, qw.scale_mode))) * s if m is None else u * s + m


def _scale_and_min(qw, scales):
    """s and m (None where w = (u - offset) * s), float32, shaped [N, 1] (per channel) or [N, B]."""
    if qw.scale_mode == quant.CHANNEL:
        return scales.astype(jnp.float32)[:, None], None
    if qw.scale_mode == quant.BLOCK_SYM:
        return scales.astype(jnp.float32), None
    return scales[..., 0].astype(jnp.float32), scales[..., 1].astype(jnp.float32)


def _blocked(x, qw, codes, scales, layer=None, *, split_nibbles: bool):
    """x @ w with w kept [N, B, 32] (or its nibble halves [N, B, 16]): the dot contracts over (B, 32), so the block
    scales are a broadcast along a dimension of the dot's own operand, and the 4-bit codes are never interleaved
    (x's halves are, which is cheap). Each weight is the value `_values_plain` gives; only the sum's order differs."""
    codes, scales = _layer(codes, scales, layer)
    n, kp = codes.shape[0], codes.shape[1] * 8 // qw.bits
    blocks = kp // quant.BLOCK
    if x.shape[1] != kp:
        x = jnp.pad(x, ((0, 0), (0, kp - x.shape[1])))
    s, m = _scale_and_min(qw, scales)
    s, m = s[..., None], None if m is None else m[..., None]  # [N, B or 1, 1]
    if qw.bits == 8:
        parts = [(x.reshape(-1, blocks, quant.BLOCK), codes.reshape(n, blocks, quant.BLOCK))]
    else:
        c = codes.reshape(n, blocks, quant.BLOCK // 2)  # [N, B, 16]: byte j holds k = j (low) and j + 16 (high)
        xb = x.reshape(-1, blocks, 2, quant.BLOCK // 2)  # [M, B, 2, 16]
        parts = [(xb[:, :, 0], c & 15), (xb[:, :, 1], c >> 4)]
        if not split_nibbles:
            parts = [(xb, jnp.stack([c & 15, c >> 4], axis=2))]  # [N, B, 2, 16]
            s, m = s[..., None], None if m is None else m[..., None]
    y = None
    for xs, u in parts:
        w = _dequant(qw, u, s, m).astype(x.dtype)
        dims = tuple(range(1, xs.ndim))
        part = jax.lax.dot_general(xs, w, ((dims, dims), ((), ())), preferred_element_type=jnp.float32)
        y = part if y is None else y + part
    return y


_ENGINE_PLAIN = quant._plain_matmul


def _layer(codes, scales, layer):
    """The matrix of `layer` (None: codes and scales are one matrix already), sliced as the engine's branches do."""
    return (codes, scales) if layer is None else (codes[layer], scales[layer])


def _dense_everywhere(x, qw, codes, scales, layer=None):
    """The engine's plain path before this comparison: `_values_plain` [N, K] and one dot, on every platform (no
    uint4 form and no Pallas kernel on TPU, no signed int8 form and no Pallas kernel on CUDA)."""
    return quant._dense_matmul(x, *_layer(codes, scales, layer), qw=qw)


def _uint4_everywhere(x, qw, codes, scales, layer=None):
    """The 4-bit formats by `quant._nibble_matmul` on every platform and at every row count (8-bit: the engine's)."""
    if qw.bits == 4:
        return quant._nibble_matmul(x, *_layer(codes, scales, layer), qw=qw)
    return _ENGINE_PLAIN(x, qw, codes, scales, layer)


def _tpu_kernel_everywhere(x, qw, codes, scales, layer=None):
    """The block formats by the Pallas TPU kernel at every row count (the engine keeps `_nibble_matmul` for 4-bit
    products up to NIBBLE_MAX_ROWS rows); int8 per channel: the engine's."""
    if qw.scale_mode == quant.CHANNEL:
        return _ENGINE_PLAIN(x, qw, codes, scales, layer)
    return jax.lax.platform_dependent(
        x, codes, scales, tpu=functools.partial(quant._tpu_kernel_matmul, qw=qw, layer=0 if layer is None else layer),
        default=lambda x, codes, scales: _ENGINE_PLAIN(x, qw, codes, scales, layer))


class _patched:
    """While active, the engine's plain-layout matmul is `fn` (every qmatmul / qglu of the traced function)."""

    def __init__(self, fn):
        self.fn = fn

    def __enter__(self):
        quant._plain_matmul = self.fn

    def __exit__(self, *exc):
        quant._plain_matmul = _ENGINE_PLAIN
        return False


VARIANTS = {  # name: what replaces quant._plain_matmul
    "blocked": lambda: _patched(functools.partial(_blocked, split_nibbles=False)),
    "dense": lambda: _patched(_dense_everywhere),
    "uint4": lambda: _patched(_uint4_everywhere),
    "tpu_kernel": lambda: _patched(_tpu_kernel_everywhere),
}


# ---- what the GEMM fusion takes (--probes): one [N, K] weight, no loop, each a different operand expression --------

PROBE_SHAPE = (8, 576, 1536)  # M, K, N


def _dot(x, w):
    return jax.lax.dot_general(x, w, (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32)


PROBES = {  # name: (codes dtype, product of x [M, K], codes [N, K], scales [N] f32)
    "s8 codes, convert": (jnp.int8, lambda x, c, s: _dot(x, c.astype(x.dtype))),
    "s4 codes, convert": (jnp.int4, lambda x, c, s: _dot(x, c.astype(x.dtype))),
    "u8 codes, convert": (jnp.uint8, lambda x, c, s: _dot(x, c.astype(x.dtype))),
    "u4 codes, convert": (jnp.uint4, lambda x, c, s: _dot(x, c.astype(x.dtype))),
    "u8 codes, - 128 (bf16)": (jnp.uint8, lambda x, c, s: _dot(x, c.astype(x.dtype) - 128)),
    "s8 codes, convert, * scale (bf16)": (
        jnp.int8, lambda x, c, s: _dot(x, c.astype(x.dtype) * s.astype(x.dtype)[:, None])),
    "s8 codes, convert, scale after the dot": (jnp.int8, lambda x, c, s: _dot(x, c.astype(x.dtype)) * s),
    "u8 codes, (u - 128) * scale (f32), bf16": (
        jnp.uint8, lambda x, c, s: _dot(x, ((c.astype(jnp.float32) - 128) * s[:, None]).astype(x.dtype))),
}


def probe(target: str, name: str) -> dict:
    m, k, n = PROBE_SHAPE
    sharding = jax.sharding.SingleDeviceSharding(device(target))
    dtype, fn = PROBES[name]
    args = (jax.ShapeDtypeStruct((m, k), jnp.bfloat16, sharding=sharding),
            jax.ShapeDtypeStruct((n, k), dtype, sharding=sharding),
            jax.ShapeDtypeStruct((n,), jnp.float32, sharding=sharding))
    compiled = jax.jit(fn).lower(*args).compile()
    hlo = compiled.as_text()
    ops = dot_ops(hlo)
    reads = any(o.dtype in INTEGER_TYPES for op in ops for o in op.operands)
    return {"target": target, "probe": name, "m": m, "k": k, "n": n, "reads_codes": reads,
            "full_width_writes": full_width_writes(hlo, n, k), "made": sorted({_what(op) for op in ops}),
            "temp_bytes": compiled.memory_analysis().temp_size_in_bytes}


def versions() -> dict:
    out = {"jax": jax.__version__}
    for dist in ("jaxlib", "libtpu", "jax-cuda12-plugin", "jax-cuda12-pjrt", "nvidia-cuda-nvcc-cu12", "flax"):
        try:
            out[dist] = importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            out[dist] = None
    return out


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--targets", nargs="+", default=list(TARGETS), choices=list(TARGETS))
    parser.add_argument("--formats", nargs="+", default=list(FORMATS), choices=list(FORMATS))
    parser.add_argument("--shapes", nargs="+", default=list(SHAPES), choices=list(SHAPES))
    parser.add_argument("--rows", nargs="+", type=int, default=list(ROWS))
    parser.add_argument("--variants", nargs="*", default=None,
                        help="also compile these formulations of the dequantization (none named: all)")
    parser.add_argument("--out", default=os.path.join(HERE, "results", "quant_fusion.json"))
    parser.add_argument("--probes", action="store_true",
                        help="also compile `PROBES` (one [N, K] weight: which operand expressions the GEMM takes)")
    parser.add_argument("--no-cases", action="store_true", help="only the probes (with --merge: keeps every case)")
    parser.add_argument("--merge", action="store_true",
                        help="keep --out's cases this run does not compile again (one target per run fits the "
                             "machine-wide lock's 8 minutes)")
    args = parser.parse_args()
    variants = [None] + (list(VARIANTS) if args.variants == [] else (args.variants or []))

    cases, failures = [], []
    for target in [] if args.no_cases else args.targets:
        for variant in variants:
            for shape in args.shapes:
                for rows in args.rows:
                    for fmt in args.formats:
                        if variant and fmt == "bf16":
                            continue
                        try:
                            cases.append(compile_case(target, fmt, shape, rows, variant))
                            c = cases[-1]
                            print(f"{target} {c['variant']} {shape} M={rows} {fmt}: fused={c['fused']} "
                                  f"{' + '.join(c['made'])} writes {c['full_width_writes'][:2]} "
                                  f"temp {c['temp_over_full']:.2f} x [N,K] bf16 "
                                  f"({c['compile_s']} s)", flush=True)
                        except Exception as e:  # a target this install cannot compile for: say so, go on
                            failures.append({"target": target, "format": fmt, "shape": shape, "rows": rows,
                                             "variant": variant, "error": f"{type(e).__name__}: {str(e)[:400]}"})
                            print("FAILED", failures[-1], flush=True)

    probes = [probe(t, name) for t in args.targets for name in PROBES] if args.probes else []
    if probes:
        print_table([dict(p, fused_text="yes" if p["reads_codes"] and not p["full_width_writes"] else "NO",
                          made_text=" + ".join(p["made"]), writes=" ".join(p["full_width_writes"]) or "-")
                     for p in probes],
                    [("target", "target", "s"), ("probe", "probe (M, K, N = {}, {}, {})".format(*PROBE_SHAPE), "s"),
                     ("fused_text", "GEMM reads the codes", "s"), ("made_text", "what XLA made", "s"),
                     ("writes", "full-width writes", "s")])
    table = [dict(c, fused_text="-" if c["fused"] is None else ("yes" if c["fused"] else "NO"),
                  made_text=" + ".join(c["made"]), temp_mib=c["temp_bytes"] / 2**20) for c in cases]
    print_table(table, [("target", "target", "s"), ("variant", "variant", "s"), ("shape", "shape", "s"),
                        ("rows", "M", "d"), ("format", "format", "s"), ("fused_text", "fused", "s"),
                        ("made_text", "what XLA made (the weight's dot ops)", "s"),
                        ("weight_ops", "ops reading it", "d"),
                        ("temp_mib", "temp MiB", ".1f"), ("temp_over_full", "temp / [N,K] bf16", ".2f")])
    configs = {}
    for target in args.targets:
        _, topology, config = TARGETS[target]
        if config:
            with open(os.path.join(HERE, "target_configs", config)) as f:
                configs[target] = {"file": f"benchmarks/target_configs/{config}", "text": f.read()}
        else:
            configs[target] = {"topology": topology}
        try:
            configs[target]["device_kind"] = device(target).device_kind
        except Exception as e:
            configs[target]["error"] = str(e)[:400]
    runs = [{"command": " ".join(["python"] + sys.argv), "date_utc": time.strftime("%Y-%m-%d %H:%M", time.gmtime()),
             "targets": args.targets}]
    if args.merge and os.path.exists(args.out):
        with open(args.out) as f:
            old = json.load(f)
        def key(c):
            return c["target"], c["variant"] or "engine", c["shape"], c["rows"], c["format"]

        redone = {key(c) for c in cases + failures}
        cases = [c for c in old["cases"] if key(c) not in redone] + cases
        failures = [c for c in old["failures"] if key(c) not in redone] + failures
        configs = {**{t: c for t, c in old["targets"].items() if t not in args.targets}, **configs}
        if not args.probes:
            probes = old.get("probes", [])
        else:
            probes = [p for p in old.get("probes", []) if p["target"] not in args.targets] + probes
        runs = old.get("runs", []) + runs
    for c in cases:  # the evidence lines of the engine's own cases are kept; the variants' operands say enough
        if c["variant"] != "engine":
            for op in c["ops"]:
                op.pop("evidence", None)
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump({"runs": runs, "what": "compiled HLO of the engine's quantized matmuls for GPU/TPU targets "
                                         "(compile only, no timing)", "versions": versions(), "layers": LAYERS,
                   "targets": configs, "cases": cases, "probes": probes, "failures": failures}, f, indent=1)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
