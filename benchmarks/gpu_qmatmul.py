"""The Pallas GPU quantized matmul (pallas_kernels/gpu_qmatmul.py) against a bf16 dense dot and dequantize-then-dot,
at Llama-3-8B's MLP shapes, on a GPU. Needs one: elsewhere it says so and exits 0 (nothing is timed).

For each weight format (GGUF Q8_0, Q4_0, Q4_1, Q4_K), shape ([4096 -> 14336] gate/up, [14336 -> 4096] down) and row
count M (1, 16, 64, 256: decode batches), three ways to compute x [M, K] @ W_l^T [K, N] -> [M, N] for every layer l
of a stacked weight of --layers layers (distinct weights, together larger than the card's L2, so each product reads
its weight from memory; one jitted call does all L products, unrolled, and sums them, which spreads the host's
dispatch over L products as the engine's layer loop does):
  * bf16        L bf16 weights [N, K] of their own and XLA's GEMM: what a model dequantized at load runs (without
                the engine's dynamic-slice of a stacked weight, so the best case for bf16);
  * dequant+dot each layer's codes dequantized by jnp, then XLA's GEMM (`quant._dense_matmul`, the engine's path on
                GPU before the kernel): XLA writes the [N, K] bf16 weight in a fusion of its own first;
  * kernel      the Pallas kernel on the stacked codes and the layer (the engine's path on CUDA now).
Each is jitted, warmed up, then timed as the median of --samples samples of --reps back-to-back calls
(jax.block_until_ready after each sample). Reported per product (a call's time / L): us, the weight bytes it must
read (bf16: N K 2; the quantized ways: a layer's codes and scales) over the time in GB/s, that as a share of a
measured device copy bandwidth (a read + write of 1 GiB) and of the card's nominal bandwidth where known, and the
kernel's largest difference from dequant+dot relative to the largest |output| (they differ in the float32 sum's
order only). First, a correctness pass at ragged shapes (K, N not multiples of the tiles, M = 7 and 300) checks the
compiled kernel against dequant+dot.

    python benchmarks/gpu_qmatmul.py                       # -> benchmarks/results/gpu_qmatmul.json
    python benchmarks/gpu_qmatmul.py --rows 1 16 --formats q4_k --tiles 16,128,128,4 16,64,256,4   # tile variants
    python benchmarks/gpu_qmatmul.py --scale-loads broadcast        # the engine's kernel only (default: also the
                                                                    # kernel loading its scales per code, "gather")
    python benchmarks/gpu_qmatmul.py --budget-s 55         # stops timing new cases after 55 s (device_checks.sh)
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))
sys.path.insert(0, HERE)
from common import RESULTS_DIR, print_table, time_call, write_json  # noqa: E402

from jaxpaged.models import quant  # noqa: E402
from pallas_kernels.gpu_qmatmul import qmatmul_gpu, tiles  # noqa: E402

SHAPES = {"llama3-8b gate/up": (4096, 14336), "llama3-8b down": (14336, 4096)}  # name: (K, N)
ROWS = (1, 16, 64, 256)
FORMATS = {"q8_0": (8, quant.BLOCK_SYM), "q4_0": (4, quant.BLOCK_SYM), "q4_1": (4, quant.BLOCK_F16),
           "q4_k": (4, quant.BLOCK_F32)}
# Nominal memory bandwidth (GB/s) by device_kind, from the vendors' data sheets: a ceiling, not a measurement.
NOMINAL_GB_S = {"NVIDIA H100 80GB HBM3": 3350, "NVIDIA H100 SXM": 3350, "NVIDIA H100 PCIe": 2000,
                "NVIDIA H200": 4800, "NVIDIA A100-SXM4-80GB": 2039, "NVIDIA A100-SXM4-40GB": 1555}
RAGGED = [("q8_0", 570, 200, 7), ("q4_0", 96, 200, 300), ("q4_1", 570, 200, 300), ("q4_k", 96, 200, 7)]


def random_weight(key, fmt: str, layers: int, k: int, n: int) -> quant.QuantizedWeight:
    """Random codes and scales of a stacked [layers, K, N] weight in the plain layout, made on the device."""
    bits, mode = FORMATS[fmt]
    kp = -(-k // quant.BLOCK) * quant.BLOCK
    kc, ks, km = jax.random.split(key, 3)
    codes = jax.random.randint(kc, (layers, n, kp * bits // 8), 0, 256, jnp.int32).astype(jnp.uint8)
    s = jax.random.uniform(ks, (layers, n, kp // quant.BLOCK), jnp.float32, 1e-3, 2e-2)
    if mode == quant.BLOCK_SYM:
        scales = s.astype(jnp.float16)
    else:
        m = -jax.random.uniform(km, s.shape, jnp.float32, 0.0, 0.1)
        scales = jnp.stack([s, m], -1).astype(jnp.float16 if mode == quant.BLOCK_F16 else jnp.float32)
    return quant.QuantizedWeight(codes, scales, bits, mode, (layers, k, n), compute_dtype="bfloat16")


def add_timing_arguments(parser: argparse.ArgumentParser, reps: int, out: str) -> None:
    """The options the GPU matmul benchmarks share: extra kernel tiles, the timing, a time budget, the JSON file
    (`out` in benchmarks/results/)."""
    parser.add_argument("--tiles", nargs="*", default=[],
                        help="extra kernel tiles to time, each tm,tn,tk,num_warps (default: `tiles(M)` only)")
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--samples", type=int, default=7)
    parser.add_argument("--reps", type=int, default=reps)
    parser.add_argument("--budget-s", type=float, default=None,
                        help="stop starting new cases after this many seconds (what was timed is still written)")
    parser.add_argument("--out", default=os.path.join(RESULTS_DIR, out))


def start_timing(args, script: str, tests: str) -> tuple[dict, list[tuple[int, ...]], float, float] | None:
    """(time_call's timing, the --tiles variants, the device's copy bandwidth in bytes/s, the start's
    perf_counter); None, having said so, where JAX has no GPU (nothing is timed)."""
    if jax.default_backend() != "gpu":
        print(f"benchmarks/{script} needs a GPU (JAX's default backend here is {jax.default_backend()!r}): nothing "
              f"timed. The kernel's correctness on CPU: {tests} (interpret mode).")
        return None
    start = time.perf_counter()
    timing = dict(warmup=args.warmup, samples=args.samples, reps=args.reps)
    tile_variants = [tuple(int(v) for v in t.split(",")) for t in args.tiles]
    return timing, tile_variants, copy_bandwidth(1 << 30, **timing), start


def write_results(args, device, copy_bw: float, timing: dict, rows: list[dict], skipped: list[str], **more) -> None:
    """The run's JSON (--out): the machine and command, the copy bandwidth, the timing, the rows, what was skipped."""
    write_json(args.out, {"machine": f"{device.device_kind} ({device.platform}), jax {jax.__version__}",
                          "command": " ".join(["python"] + sys.argv),
                          "date_utc": time.strftime("%Y-%m-%d %H:%M", time.gmtime()),
                          "copy_bandwidth_gb_s": copy_bw / 1e9, "nominal_gb_s": NOMINAL_GB_S.get(device.device_kind),
                          "timing": timing, "layers": args.layers, **more, "rows": rows, "skipped": skipped})


def copy_bandwidth(num_bytes: int, **timing) -> float:
    """Bytes per second of a read + write of one large array on the device."""
    x = jnp.ones(num_bytes // 4, jnp.float32)
    return 2 * x.nbytes / time_call(jax.jit(lambda a: a + 1.0), (x,), **timing)


def ways(qw: quant.QuantizedWeight, tile_variants, layers=None, scale_loads=("broadcast",)) -> dict:
    """name -> jitted fn(x, w): the sum over `layers` (default: every layer) of x @ layer l's weight, [M, N] float32,
    each product its own op (unrolled); w is the list of dense bf16 weights for "bf16", else qw."""
    pair = qw.scale_mode != quant.BLOCK_SYM
    layers = range(qw.codes.shape[0]) if layers is None else layers

    def summed(product):
        def run(x, w):
            return sum(product(x, w, layer) for layer in layers)
        return jax.jit(run)

    def dense(x, w, layer):
        return jax.lax.dot_general(x, w[layer], (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32)

    def dequant_dot(x, w, layer):
        return quant._dense_matmul(x, w.codes[layer], w.scales[layer], qw=w)

    out = {"bf16": summed(dense), "dequant+dot": summed(dequant_dot)}
    for load in scale_loads:
        for tile in [None] + list(tile_variants):
            name = "kernel" + ("" if tile is None else " {},{},{},{}".format(*tile)) + \
                ("" if load == "broadcast" else f" ({load} scales)")
            out[name] = summed(lambda x, w, layer, tile=tile, load=load: qmatmul_gpu(
                x, w.codes, w.scales, layer, bits=w.bits, pair=pair, tile=tile, scale_load=load))
    return out


def weight_bytes(qw: quant.QuantizedWeight, way: str) -> int:
    """Bytes of weight one call must read: a layer's codes and scales, or a bf16 [N, K]."""
    if way == "bf16":
        return qw.n * qw.k * 2
    return qw.nbytes // qw.codes.shape[0]


def relative_error(got, want) -> float:
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    return float(np.max(np.abs(got - want)) / max(np.max(np.abs(want)), 1e-30))


def ragged_checks() -> list[dict]:
    """The compiled kernel against dequant+dot where tiles are ragged (K, N) and M is padded."""
    rows = []
    for i, (fmt, k, n, m) in enumerate(RAGGED):
        qw = random_weight(jax.random.key(100 + i), fmt, 3, k, n)
        x = jax.random.normal(jax.random.key(200 + i), (m, k), jnp.bfloat16)
        fns = ways(qw, [], layers=[1])
        err = relative_error(fns["kernel"](x, qw), fns["dequant+dot"](x, qw))
        rows.append({"format": fmt, "k": k, "n": n, "m": m, "rel_err": err, "ok": err < 1e-3})
    return rows


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--formats", nargs="+", default=list(FORMATS), choices=list(FORMATS))
    parser.add_argument("--shapes", nargs="+", default=list(SHAPES), choices=list(SHAPES))
    parser.add_argument("--rows", nargs="+", type=int, default=list(ROWS))
    parser.add_argument("--layers", type=int, default=8,
                        help="layers of the stacked weight, each multiplied once a call (8: 264-940 MB of weights, "
                             "beyond an H100's or H200's 50 MB L2)")
    parser.add_argument("--scale-loads", nargs="+", default=["broadcast", "gather"], choices=["broadcast", "gather"],
                        help="the kernel's ways of loading block scales to time (the engine uses broadcast)")
    add_timing_arguments(parser, reps=20, out="gpu_qmatmul.json")
    args = parser.parse_args()
    started = start_timing(args, "gpu_qmatmul.py", "tests/kernels/test_gpu_qmatmul.py")
    if started is None:
        return
    timing, tile_variants, copy_bw, start = started
    device = jax.devices()[0]
    nominal = NOMINAL_GB_S.get(device.device_kind)
    checks = ragged_checks()
    print_table(checks, [("format", "format", "s"), ("k", "K", "d"), ("n", "N", "d"), ("m", "M", "d"),
                         ("rel_err", "kernel vs dequant+dot (rel.)", ".1e"), ("ok", "ok", "")])

    rows, skipped = [], []
    # decode's row counts first: when the budget ends the run, what was timed is what matters most
    for m in sorted(args.rows):
        for shape in args.shapes:
            k, n = SHAPES[shape]
            for fmt in args.formats:
                if args.budget_s is not None and time.perf_counter() - start > args.budget_s:
                    skipped.append(f"{shape} M={m} {fmt}")
                    continue
                qw = random_weight(jax.random.key(m), fmt, args.layers, k, n)
                dense_w = [quant.dequantize(qw, jnp.bfloat16, layer=i).T for i in range(args.layers)]  # L x [N, K]
                x = jax.random.normal(jax.random.key(1), (m, k), jnp.bfloat16)
                fns = ways(qw, tile_variants, scale_loads=args.scale_loads)
                want = fns["dequant+dot"](x, qw)
                for way, fn in fns.items():
                    w = dense_w if way == "bf16" else qw
                    seconds = time_call(fn, (x, w), **timing) / args.layers  # per product
                    gb_s = weight_bytes(qw, way) / seconds / 1e9
                    rows.append({"shape": shape, "k": k, "n": n, "m": m, "format": fmt, "way": way,
                                 "tile": list(tiles(m)) if way == "kernel" else None, "us": seconds * 1e6,
                                 "weight_mb": weight_bytes(qw, way) / 1e6, "gb_s": gb_s,
                                 "of_copy": gb_s * 1e9 / copy_bw, "of_nominal": gb_s / nominal if nominal else None,
                                 "rel_err": relative_error(fn(x, w), want) if way.startswith("kernel") else None})
                del qw, dense_w
    base = {(r["shape"], r["m"], r["format"]): r["us"] for r in rows if r["way"] == "dequant+dot"}
    for r in rows:
        r["x_dequant_dot"] = base[(r["shape"], r["m"], r["format"])] / r["us"]
    print(f"\n{device.device_kind}: copy bandwidth {copy_bw / 1e9:.0f} GB/s, nominal "
          f"{nominal or '?'} GB/s; jax {jax.__version__}; per product, {args.layers} layers a call")
    print_table(rows, [("shape", "shape", "s"), ("m", "M", "d"), ("format", "format", "s"), ("way", "way", "s"),
                       ("us", "us/call", ".1f"), ("weight_mb", "weight MB", ".1f"), ("gb_s", "GB/s", ".0f"),
                       ("of_copy", "of copy bw", ".0%"), ("of_nominal", "of nominal", ".0%"),
                       ("x_dequant_dot", "x dequant+dot", ".2f"), ("rel_err", "rel. err", ".1e")])
    if skipped:
        print(f"not timed (--budget-s {args.budget_s}): {', '.join(skipped)}")
    write_results(args, device, copy_bw, timing, rows, skipped, ragged_checks=checks)
    if not all(c["ok"] for c in checks) or any(r["rel_err"] is not None and r["rel_err"] > 1e-3 for r in rows):
        print("ERROR: the kernel differs from dequant+dot beyond float32 sum-order rounding")
        sys.exit(1)


if __name__ == "__main__":
    main()
