"""Where a step's time goes: per-shape step timings on the throughput workload, next to this machine's numpy
copy bandwidth and fp32 matmul rate (the ceilings the engine's steps are compared with in README.md).

    python benchmarks/profile_steps.py
"""

from __future__ import annotations

import collections
import time

import numpy as np
from common import write_json
from workload import NEW_TOKENS, workload_prompts


def machine_ceilings() -> dict:
    a = np.ones(12_500_000, np.float32)  # 50 MB
    b = np.empty_like(a)
    np.copyto(b, a)
    t = time.perf_counter()
    for _ in range(10):
        np.copyto(b, a)
    copy_gbs = 2 * a.nbytes / ((time.perf_counter() - t) / 10) / 1e9
    w = np.random.rand(576, 1536).astype(np.float32)
    x = np.random.rand(64, 576).astype(np.float32)
    t = time.perf_counter()
    for _ in range(100):
        x @ w
    gflops = 2 * 64 * 576 * 1536 / ((time.perf_counter() - t) / 100) / 1e9
    return {"numpy_copy_GBps": copy_gbs, "numpy_fp32_matmul_GFLOPs": gflops}


def main():
    from jaxpaged import LLM, SamplingParams

    llm = LLM(show_progress=False)
    runner = llm.engine.runner
    execute = runner.execute
    per_shape = collections.defaultdict(lambda: [0, 0.0])

    def timed(batch):
        t = time.perf_counter()
        out = execute(batch)  # returns numpy, so the step has finished
        per_shape[batch.shape_key][0] += 1
        per_shape[batch.shape_key][1] += time.perf_counter() - t
        return out

    runner.execute = timed
    prompts = workload_prompts(llm.tokenizer)
    t = time.perf_counter()
    llm.generate([{"prompt_token_ids": p} for p in prompts],
                 SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True), use_tqdm=False)
    total = time.perf_counter() - t
    rows = [{"shape (tokens, seqs, width, tile, flat blocks)": str(k), "steps": n, "total_s": s,
             "ms_per_step": 1000 * s / n} for k, (n, s) in sorted(per_shape.items(), key=lambda kv: -kv[1][1])]
    ceilings = machine_ceilings()
    print(f"workload wall time {total:.1f} s")
    for r in rows:
        print(f"{r['shape (tokens, seqs, width, tile, flat blocks)']:<32} {r['steps']:>5} steps "
              f"{r['total_s']:>7.2f} s {r['ms_per_step']:>8.1f} ms/step")
    print(f"numpy copy {ceilings['numpy_copy_GBps']:.1f} GB/s, fp32 matmul {ceilings['numpy_fp32_matmul_GFLOPs']:.0f} "
          "GFLOP/s")
    write_json("benchmarks/results/profile_steps.json", {"wall_s": total, "steps": rows, **ceilings})


if __name__ == "__main__":
    main()
