"""The model's layer matmuls on CPU, bfloat16: XLA's dot of the layer's slice against the native kernel, by rows.

For each weight shape of SmolLM2-135M (q/o [576, 576], k/v [576, 192], gate/up [576, 1536], down [1536, 576]), and
for the gated MLP's first half (silu(x @ gate) * (x @ up): XLA's two dots and activation against the native
one-pass `cpu_native.matmul_glu_native`), stacked over 30 layers as the engine holds them, a jitted `fori_loop`
over the layers computes x [M, K] @ w[i] as the model's step does (`jaxpaged.models.matmul.layer_matmul`,
`layer_glu`), with the step's XLA options (`step_compiler_options`): XLA slices w[i] and runs its dot; the native
kernel reads w[i] in place (`cpu_native.matmul_native`), from the weight as stored and from the weight prepacked in
the kernel's panel layout (`cpu_native.prepack_weight`, what the engine holds on such a CPU). On a CPU with AMX-BF16
the kernel's default is its AMX path, and a fourth column times its AVX-512 path on the same prepacked weight
(JAXPAGED_NATIVE_AMX=0). The outputs are compared (the fraction of values equal to XLA's): on AMD Zen 4 XLA's dot
and the AVX-512 path accumulated the same pairs of products with VDPBF16PS, bitwise equal; AMX tiles and XLA on an
Intel Xeon sum in other orders. The engine uses the native
kernel up to `step.NATIVE_MATMUL_ROWS` rows, which this table is there to justify. Median of --runs calls
after one warm-up.

    python benchmarks/matmul.py [--rows 16 48 64 128 256 512 1024 2048]   # -> benchmarks/results/matmul.json
"""

from __future__ import annotations

import argparse
import contextlib
import os

import jax
import jax.numpy as jnp
import numpy as np
from common import write_json
from step_anatomy import cpu_name, device_ms

from jaxpaged.models.matmul import matmul
from jaxpaged.worker.step import NATIVE_MATMUL_ROWS
from pallas_kernels.cpu_native import (
    matmul_glu_native,
    matmul_is_fast,
    matmul_native,
    matmul_uses_amx,
    prepack_weight,
)

SHAPES = {"q, o": (576, 576), "k, v": (576, 192), "gate, up": (576, 1536), "down": (1536, 576),
          "gated MLP": (576, 1536)}  # the last: silu(x @ gate) * (x @ up), the weights a (gate, up) pair
GLU = "gated MLP"


@contextlib.contextmanager
def amx_off(off: bool):
    """The native kernel's AVX-512 path instead of its AMX one while `off` (it reads JAXPAGED_NATIVE_AMX per call)."""
    before = os.environ.get("JAXPAGED_NATIVE_AMX")
    if off:
        os.environ["JAXPAGED_NATIVE_AMX"] = "0"
    try:
        yield
    finally:
        if off and before is None:
            os.environ.pop("JAXPAGED_NATIVE_AMX")
        elif off:
            os.environ["JAXPAGED_NATIVE_AMX"] = before
XLA_OPTIONS = {"xla_disable_hlo_passes": "while-loop-invariant-code-motion"}  # the bf16 step's (model_runner)


def layer_loop(mm, layers: int):
    """A jitted loop over the layers computing x @ w[i] each time (only a column of each result is kept)."""
    def run(x, w):
        def body(i, acc):
            return acc + mm(x, w, i)[:, :1].astype(jnp.float32)
        return jax.lax.fori_loop(0, layers, body, jnp.zeros((x.shape[0], 1), jnp.float32))
    return jax.jit(run)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", type=int, nargs="+", default=[16, 48, 64, 128, 256, 512, 1024, 2048])
    ap.add_argument("--layers", type=int, default=30)
    ap.add_argument("--runs", type=int, default=10)
    ap.add_argument("--out", default="benchmarks/results/matmul.json")
    args = ap.parse_args()
    if not matmul_is_fast():
        raise SystemExit("the native matmul has no AVX512_BF16 path on this CPU (or could not be built): nothing to "
                         "compare")
    rng = np.random.default_rng(0)
    kernels = {  # name -> (XLA's, the native kernel's): x [M, K], w [L, K, N] (or a (gate, up) pair), layer i
        "matmul": (lambda x, w, i: matmul(x, w[i]), lambda x, w, i: matmul_native(x, w, i)),
        "glu": (lambda x, w, i: jax.nn.silu(matmul(x, w[0][i])) * matmul(x, w[1][i]),
                lambda x, w, i: matmul_glu_native(x, w[0], w[1], i, "silu"))}
    loops = {kind: (layer_loop(xla_mm, args.layers), layer_loop(native_mm, args.layers))
             for kind, (xla_mm, native_mm) in kernels.items()}
    amx = matmul_uses_amx()
    timed = [("xla", False, False), ("native", False, False), ("prepacked", True, False)]
    if amx:
        timed.append(("prepacked_avx512", True, True))  # (label, prepacked weight, AMX off)
    results = []
    for name, (k, n) in SHAPES.items():
        kind = "glu" if name == GLU else "matmul"
        (xla_mm, native_mm), (xla, native) = kernels[kind], loops[kind]

        def stacked(k=k, n=n):
            return jnp.asarray(rng.standard_normal((args.layers, k, n)) / np.sqrt(k), jnp.bfloat16)

        w = (stacked(), stacked()) if kind == "glu" else stacked()
        packed = jax.tree.map(prepack_weight, w)
        for m in args.rows:
            x = jnp.asarray(rng.standard_normal((m, k)), jnp.bfloat16)
            want = xla_mm(x, w, 3)
            same = min(float(jnp.mean(want == native_mm(x, w, 3))), float(jnp.mean(want == native_mm(x, packed, 3))))
            row = {"weights": name, "K": k, "N": n, "rows": m, "equal_to_xla": round(same, 4)}
            for label, prepacked, off in timed:
                weight, fn = (packed if prepacked else w), (native if label != "xla" else xla)
                with amx_off(off):
                    ms = device_ms(fn.lower(x, weight).compile(compiler_options=XLA_OPTIONS), x, weight,
                                   runs=args.runs)
                row[f"{label}_ms"] = ms
                row[f"{label}_GFLOPs"] = 2 * m * k * n * args.layers * (2 if kind == "glu" else 1) / ms / 1e6
            row["speedup"] = row["xla_ms"] / row["prepacked_ms"]  # the engine's (prepacked, default path) over XLA's
            results.append(row)
            print(f"{name:<9} K={k:<5} N={n:<5} rows={m:<5} " + "  ".join(
                f"{label} {row[label + '_ms']:8.2f} ms ({row[label + '_GFLOPs']:5.0f} GFLOP/s)" for label, *_ in timed)
                + f"  equal to XLA: {row['equal_to_xla']}", flush=True)
    cpu = cpu_name()
    labels = " / ".join(label for label, *_ in timed)
    print(f"\nCPU: {cpu}; {args.layers} layers per call; the engine's native limit: {NATIVE_MATMUL_ROWS} rows; "
          f"native path: {'AMX' if amx else 'AVX-512'}")
    print("| rows | " + " | ".join(f"{s} {labels} ms" for s in SHAPES) + " |")
    print("|---" * (len(SHAPES) + 1) + "|")
    for m in args.rows:
        cells = [" / ".join(f"{r[label + '_ms']:.1f}" for label, *_ in timed) for r in results if r["rows"] == m]
        print(f"| {m} | " + " | ".join(cells) + " |")
    write_json(args.out, {"cpu": cpu, "layers": args.layers, "native_matmul_rows": NATIVE_MATMUL_ROWS,
                          "native_path": "amx" if amx else "avx512", "results": results})


if __name__ == "__main__":
    main()
