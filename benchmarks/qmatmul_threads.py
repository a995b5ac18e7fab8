"""How the native quantized matmul shares a decode step's small products between threads: an A/B in one process.

One bf16 `LLM` and one gguf `LLM` (SmolLM2-135M Q4_1 + Q8_0 embedding) in one process; each round runs bf16 once and
the gguf model once per variant of the kernel's work sharing at <= 8 rows (chosen per round through
JaxpagedQMatmulSetExperiment, the variants in a rotated order each round), 64 greedy tokens after a 32-token prompt.
Per variant: median batch-1 tok/s, its spread (min, max), the device wait per step, and the ratio to the same round's
bf16 run (median, min, max over rounds): the goal must hold round after round, not on average.

    PYTHONPATH=. python benchmarks/qmatmul_threads.py --rounds 9
Writes benchmarks/results/qmatmul_threads.json (or --out), with lscpu's CPU name and the load average.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

from common import print_table, write_json
from quantization import build
from step_anatomy import cpu_name
from workload import workload_prompts

# name: (threads, split, prefetch bytes, spin us); threads 0 XLA's pool, 1 the caller alone, 2 our spinning helper
VARIANTS = {
    "pool, 16-group items": (0, 0, 0, 100),
    "caller alone": (1, 0, 0, 100),
    "own spinning helper": (2, 0, 0, 100),
    "pool, even split": (0, 1, 0, 100),
    "own helper, even split": (2, 1, 0, 100),
    "pool, prefetch 1 KiB": (0, 0, 1024, 100),
    "pool, prefetch 4 KiB": (0, 0, 4096, 100),
    "pool, prefetch 8 KiB": (0, 0, 8192, 100),
    "pool, prefetch 4 KiB to L2": (0, 0, -4096, 100),
    "pool, prefetch 16 KiB to L2": (0, 0, -16384, 100),
}


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=9)
    ap.add_argument("--decode-tokens", type=int, default=64)
    ap.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=list(VARIANTS))
    ap.add_argument("--out", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "results",
                                                  "qmatmul_threads.json"))
    args = ap.parse_args()
    args.max_num_seqs, args.max_model_len, args.kv_cache_memory = 64, 1024, "1GiB"
    from jaxpaged import SamplingParams
    from pallas_kernels.cpu_native import build as native_build

    lib = native_build.library("qmatmul")
    load_before = os.getloadavg()
    print(f"CPU: {cpu_name()}; load average {load_before[0]:.1f} ({os.cpu_count()} cores)", flush=True)
    llms = {"bf16": build(None, None, args), "gguf": build(None, "gguf", args)}
    decode = SamplingParams(temperature=0.0, max_tokens=args.decode_tokens, ignore_eos=True)
    prompt = {"prompt_token_ids": workload_prompts(llms["bf16"].tokenizer, 1, seed=1, min_len=32, max_len=32)[0]}

    def run(llm):
        before = llm.stats()
        t0 = time.perf_counter()
        out = llm.generate([prompt], decode, use_tqdm=False)
        wall = time.perf_counter() - t0
        after = llm.stats()
        steps = max(after["steps"] - before["steps"], 1)
        return (args.decode_tokens / wall, 1e3 * (after["device_wait_s"] - before["device_wait_s"]) / steps,
                out[0].outputs[0].token_ids)

    names = args.variants
    for name in names:  # warm-up, and every variant must give the same tokens (the work sharing changes no number)
        lib.JaxpagedQMatmulSetExperiment(*VARIANTS[name])
        run(llms["gguf"])
    run(llms["bf16"])
    per = {name: {"tok_s": [], "device_ms": [], "ratio": []} for name in ["bf16", *names]}
    tokens = {}
    for r in range(args.rounds):
        base, base_dev, _ = run(llms["bf16"])
        per["bf16"]["tok_s"].append(base)
        per["bf16"]["device_ms"].append(base_dev)
        per["bf16"]["ratio"].append(1.0)
        for name in names[r % len(names):] + names[:r % len(names)]:
            lib.JaxpagedQMatmulSetExperiment(*VARIANTS[name])
            tok_s, dev, toks = run(llms["gguf"])
            tokens.setdefault(name, toks)
            if toks != tokens[name]:
                raise SystemExit(f"{name}: different tokens from one round to the next")
            per[name]["tok_s"].append(tok_s)
            per[name]["device_ms"].append(dev)
            per[name]["ratio"].append(tok_s / base)
    lib.JaxpagedQMatmulSetExperiment(*VARIANTS[names[0]])
    if len({tuple(t) for t in tokens.values()}) != 1:
        raise SystemExit("the variants gave different tokens")
    rows = []
    for name, m in per.items():
        rows.append({"variant": name, "tok_s": statistics.median(m["tok_s"]), "tok_s_min": min(m["tok_s"]),
                     "tok_s_max": max(m["tok_s"]), "device_ms": statistics.median(m["device_ms"]),
                     "device_ms_max": max(m["device_ms"]), "ratio": statistics.median(m["ratio"]),
                     "ratio_min": min(m["ratio"]), "ratio_max": max(m["ratio"]), "samples": m})
    print(f"\nBatch-1 decode, {args.decode_tokens} greedy tokens, {args.rounds} rounds (gguf variants against the same "
          "round's bf16 run)")
    print_table(rows, [("variant", "variant", "s"), ("tok_s", "tok/s median", ".1f"), ("tok_s_min", "min", ".1f"),
                       ("tok_s_max", "max", ".1f"), ("device_ms", "device ms/step", ".2f"),
                       ("device_ms_max", "max", ".2f"), ("ratio", "x bf16 median", ".2f"),
                       ("ratio_min", "min", ".2f"), ("ratio_max", "max", ".2f")])
    write_json(args.out, {"cpu": cpu_name(), "load_average_before": load_before,
                          "load_average_after": os.getloadavg(), "args": vars(args), "rows": rows})


if __name__ == "__main__":
    main()
