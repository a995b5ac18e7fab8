"""The sampler's penalties (presence, frequency, repetition) on CPU: XLA's version (`sampler._penalize`, dense
[S, V] counts built by scatters) beside the native kernel the engine uses where its matmuls run natively
(`pallas_kernels/cpu_native/penalties.cc`: each row's seen tokens visited), in one run, on the same inputs, with
their results compared bit for bit.

Rows S of a decode step, each with a history of --history tokens (prompt, then --outputs of them generated) in the
fixed [S, max_model_len] array the step passes, logits [S, V] at SmolLM2's vocabulary (49152) and Gemma 3's (262144);
every row penalized (presence 0.5, frequency 0.5, repetition 1.1). Each version is jitted, warmed up, then timed as
the median of --samples samples of --reps back-to-back calls. tcmalloc is preloaded, as the entry points do (without
it each call's fresh [S, V] buffers cost page faults that both versions pay).

    python benchmarks/penalties.py       # -> benchmarks/results/penalties.json
"""

from __future__ import annotations

import argparse
import os

from common import RESULTS_DIR, cpu_name, print_table, time_call, write_json

from jaxpaged.runtime.tcmalloc import tcmalloc_loaded, use_tcmalloc


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 16, 64, 256])
    ap.add_argument("--vocab", type=int, nargs="+", default=[49152, 262144])
    ap.add_argument("--max-model-len", type=int, default=2048)
    ap.add_argument("--history", type=int, default=1100, help="tokens each row has seen")
    ap.add_argument("--outputs", type=int, default=100, help="of which generated")
    ap.add_argument("--samples", type=int, default=9)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--out", default=os.path.join(RESULTS_DIR, "penalties.json"))
    args = ap.parse_args()
    use_tcmalloc()  # may re-execute this process with tcmalloc preloaded

    import jax
    import jax.numpy as jnp
    import numpy as np

    from jaxpaged.worker import sampler
    from pallas_kernels import cpu_native

    if not cpu_native.available("penalties"):
        raise SystemExit(f"the native penalties kernel is unavailable: {cpu_native.unavailable_reason('penalties')}")
    rng = np.random.default_rng(0)
    rows = []
    for vocab in args.vocab:
        for s in args.rows:
            m = sampler.SamplingMetadata.padding(s, vocab, args.max_model_len)
            m.seen_tokens[:, :args.history] = rng.integers(0, vocab, (s, args.history))
            m.output_start[:] = args.history - args.outputs
            m.presence_penalty[:], m.frequency_penalty[:], m.repetition_penalty[:] = 0.5, 0.5, 1.1
            m.penalized = np.array(True)
            m = jax.tree.map(jnp.asarray, m)
            logits = jnp.asarray(rng.standard_normal((s, vocab), np.float32))
            row = {"rows": s, "vocab": vocab}
            results = {}
            for name, native in (("xla", False), ("native", True)):
                fn = jax.jit(lambda x, m, native=native: sampler._penalize(x, m, native))
                results[name] = np.asarray(fn(logits, m))
                row[f"{name}_ms"] = 1e3 * time_call(fn, (logits, m), warmup=2, samples=args.samples, reps=args.reps)
            row["speedup"] = row["xla_ms"] / row["native_ms"]
            row["same_bits"] = bool(np.array_equal(results["xla"].view(np.int32), results["native"].view(np.int32)))
            rows.append(row)
            print(row, flush=True)

    cpu = cpu_name()
    print(f"\nCPU: {cpu}, {os.cpu_count()} cores; allocator: {'tcmalloc' if tcmalloc_loaded() else 'system'}")
    print(f"every row penalized, {args.history} tokens seen ({args.outputs} generated), max_model_len "
          f"{args.max_model_len}")
    print_table(rows, [("vocab", "V", "d"), ("rows", "rows", "d"), ("xla_ms", "XLA ms", ".3f"),
                       ("native_ms", "native ms", ".3f"), ("speedup", "XLA / native", ".1f"),
                       ("same_bits", "same bits", "")])
    write_json(args.out, {"cpu": cpu, "allocator": "tcmalloc" if tcmalloc_loaded() else "system",
                          "command": "python benchmarks/penalties.py", "history": args.history,
                          "outputs": args.outputs, "max_model_len": args.max_model_len, "rows": rows})


if __name__ == "__main__":
    main()
