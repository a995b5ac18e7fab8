"""The sampler's top-k / top-p threshold on CPU: the rows sorted (`sampler._threshold_by_sort`, what GPUs and TPUs
run: XLA's sort of the vocabulary) beside the ways the engine runs on a CPU, XLA's bisection
(`sampler._threshold_by_search`) and the native kernel's radix select (`cpu_native.top_p_threshold_native`, in steps
whose matmuls run natively), in one run, on the same logits, with their thresholds compared.

Rows S of a decode step, logits [S, V] at SmolLM2's vocabulary (49152) and Gemma 3's (262144), standard normal times
--scale (at 3, the nucleus of p = 0.95 holds thousands of tokens: the float32 sums then part at a row's boundary
now and then); every row asks for top-p --top-p, and with --top-k also top-k. Each version is jitted, warmed up, then
timed as the median of --samples samples of --reps back-to-back calls; the rows where the two thresholds differ, and
where each equals the definition computed in float64, are counted.

    python benchmarks/top_p.py       # -> benchmarks/results/top_p.json
"""

from __future__ import annotations

import argparse
import os

from common import RESULTS_DIR, cpu_name, print_table, time_call, write_json


def exact_thresholds(logits, k, top_p: float):
    """The threshold per row by the definition, in float64: the value of the last token of the smallest prefix of
    the row sorted in descending order whose mass reaches top_p, within the top k."""
    import numpy as np

    out = np.empty(logits.shape[0], np.float32)
    for i, (x, kk) in enumerate(zip(logits, k, strict=True)):
        order = np.sort(x)[::-1]
        probs = np.exp(order.astype(np.float64) - order[0])
        probs /= probs.sum()
        before = np.cumsum(probs) - probs
        out[i] = order[max(int(np.sum((before < top_p) & (np.arange(x.size) < kk))), 1) - 1]
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 16, 48, 256])
    ap.add_argument("--vocab", type=int, nargs="+", default=[49152, 262144])
    ap.add_argument("--top-p", type=float, default=0.95)
    ap.add_argument("--top-k", type=int, default=0, help="> 0: every row also asks for top-k")
    ap.add_argument("--scale", type=float, default=3.0, help="the logits' standard deviation")
    ap.add_argument("--samples", type=int, default=5)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--out", default=os.path.join(RESULTS_DIR, "top_p.json"))
    args = ap.parse_args()

    import jax
    import jax.numpy as jnp
    import numpy as np

    from jaxpaged.worker import sampler
    from pallas_kernels import cpu_native

    ways = {"sort": sampler._threshold_by_sort, "search": sampler._threshold_by_search}
    if jax.default_backend() != "cpu":
        print(f"(on {jax.default_backend()}: the native CPU kernel left out)")
    elif cpu_native.available("top_p"):
        ways["native"] = lambda x, k, p: cpu_native.top_p_threshold_native(x, k, p)[:, None]
    else:
        print(f"(no native kernel: {cpu_native.unavailable_reason('top_p')})")
    rng = np.random.default_rng(0)
    rows = []
    for vocab in args.vocab:
        for s in args.rows:
            logits = jnp.asarray(rng.standard_normal((s, vocab), np.float32) * args.scale)
            k = jnp.full((s,), args.top_k if args.top_k > 0 else vocab, jnp.int32)
            top_p = jnp.full((s,), args.top_p, jnp.float32)
            row = {"rows": s, "vocab": vocab}
            results = {}
            for name, fn in ways.items():
                fn = jax.jit(fn)
                results[name] = np.asarray(fn(logits, k, top_p))
                row[f"{name}_ms"] = 1e3 * time_call(fn, (logits, k, top_p), warmup=1, samples=args.samples,
                                                    reps=args.reps)
            exact = exact_thresholds(np.asarray(logits), np.asarray(k), args.top_p)
            for name in ways:  # rows whose threshold is the float64 definition's; rows that differ from the sort's
                row[f"{name}_exact"] = int(np.sum(results[name][:, 0] == exact))
                row[f"{name}_differ"] = int(np.sum(results["sort"] != results[name]))
            row["kept_mean"] = float(np.mean(np.sum(np.asarray(logits) >= results["sort"], axis=-1)))
            rows.append(row)
            print(row, flush=True)

    cpu, device = cpu_name(), jax.devices()[0].device_kind
    print(f"\nCPU: {cpu}, {os.cpu_count()} cores; run on {device}; top-p {args.top_p}"
          f"{f', top-k {args.top_k}' if args.top_k > 0 else ''}, logits N(0, {args.scale}^2)")
    columns = [("vocab", "V", "d"), ("rows", "rows", "d")]
    columns += [(f"{name}_ms", f"{name} ms", ".2f") for name in ways]
    columns += [(f"{name}_differ", f"{name} != sort", "d") for name in ways if name != "sort"]
    columns += [(f"{name}_exact", f"{name} = float64", "d") for name in ways]
    print_table(rows, columns + [("kept_mean", "tokens kept", ".0f")])
    write_json(args.out, {"cpu": cpu, "device": device, "command": "python benchmarks/top_p.py", "top_p": args.top_p,
                          "top_k": args.top_k, "scale": args.scale, "rows": rows})


if __name__ == "__main__":
    main()
