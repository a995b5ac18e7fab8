"""CPU process settings: does a setting outside the engine (XLA's threads, a preloaded allocator) change step time?

Each setting runs in its own process (they must be set before JAX starts), the settings alternate, and each runs
--rounds times; a run times one prefill step (the workload's largest) and one decode step (the most frequent) of
the throughput workload (median of 5 runs each, `step_anatomy.device_ms`). Prints a table and writes JSON.

    python benchmarks/cpu_settings.py                    # bfloat16 (this CPU's auto), 2 rounds
    python benchmarks/cpu_settings.py --dtype float32
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys

from common import write_json
from step_anatomy import cpu_name

from jaxpaged.runtime.tcmalloc import CANDIDATES, tcmalloc_path

TCMALLOC = tcmalloc_path() or CANDIDATES[0]
SETTINGS = {
    "glibc malloc": {"LD_PRELOAD": ""},
    "tcmalloc preloaded (the entry points' default)": {"LD_PRELOAD": TCMALLOC},
    "XLA single-threaded Eigen": {"XLA_FLAGS": "--xla_cpu_multi_thread_eigen=false"},
    "OMP_NUM_THREADS=1": {"OMP_NUM_THREADS": "1"},
}


def one_run(dtype: str) -> dict:
    """In the child: one prefill and one decode step time, ms."""
    from step_anatomy import capture_batches, device_ms

    from jaxpaged import LLM

    llm = LLM(dtype=dtype, show_progress=False, enable_prefix_caching=False, precompile=False)
    prefill, decode, _ = capture_batches(llm, 64, 3)
    runner = llm.engine.runner
    out = {}
    for kind, batch in (("prefill", prefill), ("decode", decode)):
        step = runner._executable(batch)

        def full(_, step=step, batch=batch):
            result, runner.kv_pool = step(runner.params, runner.kv_pool, batch.token_ids, batch.attn, batch.sampling)
            return result

        out[f"{kind}_ms"] = device_ms(full, None, runs=5)
        out[f"{kind}_shape"] = str(batch.shape_key)
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--settings", default=",".join(SETTINGS), help="comma-separated names of: " + ", ".join(SETTINGS))
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--out", default="benchmarks/results/cpu_settings.json")
    args = ap.parse_args()
    if args.child:
        print("RESULT " + json.dumps(one_run(args.dtype)), flush=True)
        return
    names = [n for n in args.settings.split(",") if n]
    if not os.path.exists(TCMALLOC):
        names = [n for n in names if "tcmalloc" not in n]
        print(f"{TCMALLOC} not found: skipping the tcmalloc setting (apt-get install libtcmalloc-minimal4)")
    runs: dict[str, list[dict]] = {n: [] for n in names}
    here = os.path.dirname(os.path.abspath(__file__))
    for r in range(args.rounds):
        for name in names:
            env = {**os.environ, **SETTINGS[name]}
            proc = subprocess.run([sys.executable, os.path.abspath(__file__), "--child", "--dtype", args.dtype],
                                  env=env, cwd=os.path.dirname(here), capture_output=True, text=True, check=False)
            line = next((ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")), None)
            if line is None:
                raise SystemExit(f"{name}: child failed:\n{proc.stderr[-3000:]}")
            runs[name].append(json.loads(line[7:]))
            print(f"round {r + 1} {name}: {runs[name][-1]}", flush=True)
    rows = []
    for name in names:
        rows.append({"setting": name, "env": SETTINGS[name],
                     "prefill_ms": statistics.median(x["prefill_ms"] for x in runs[name]),
                     "decode_ms": statistics.median(x["decode_ms"] for x in runs[name]),
                     "prefill_shape": runs[name][0]["prefill_shape"], "decode_shape": runs[name][0]["decode_shape"],
                     "runs": runs[name]})
    cpu = cpu_name()
    print(f"\n{cpu}, {os.cpu_count()} cores, dtype {args.dtype}, median of {args.rounds} rounds (alternating)")
    print("setting | prefill step ms | decode step ms")
    print("--- | --- | ---")
    for r in rows:
        print(f"{r['setting']} | {r['prefill_ms']:.1f} | {r['decode_ms']:.1f}")
    write_json(args.out, {"cpu": cpu, "dtype": args.dtype, "rows": rows})


if __name__ == "__main__":
    main()
