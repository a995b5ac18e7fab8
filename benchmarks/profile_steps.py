"""Where a step's time goes: per-shape step timings on the throughput workload, next to this machine's numpy
copy bandwidth and fp32 matmul rate (the ceilings the engine's steps are compared with in README.md).

    python benchmarks/profile_steps.py
    # a 16-bit model on CPU, with the default float32 pool and with a bfloat16 pool (short run: 16 prompts, 8 tokens)
    python benchmarks/profile_steps.py --dtype bfloat16 --num-prompts 16 --new-tokens 8 --out /tmp/bf16.json
    python benchmarks/profile_steps.py --dtype bfloat16 --kv-cache-dtype bfloat16 --num-prompts 16 --new-tokens 8 \
        --out /tmp/bf16_pool.json
"""

from __future__ import annotations

import argparse
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

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--kv-cache-dtype", default="auto")
    ap.add_argument("--num-prompts", type=int, default=None, help="default: the throughput workload's 64")
    ap.add_argument("--new-tokens", type=int, default=NEW_TOKENS)
    ap.add_argument("--out", default="benchmarks/results/profile_steps.json")
    args = ap.parse_args()

    llm = LLM(show_progress=False, dtype=args.dtype, kv_cache_dtype=args.kv_cache_dtype)
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
    prompts = workload_prompts(llm.tokenizer, *([args.num_prompts] if args.num_prompts else []))
    t = time.perf_counter()
    llm.generate([{"prompt_token_ids": p} for p in prompts],
                 SamplingParams(temperature=0.0, max_tokens=args.new_tokens, ignore_eos=True), use_tqdm=False)
    total = time.perf_counter() - t
    rows = [{"shape (tokens, seqs, width, tile, flat blocks)": str(k), "steps": n, "total_s": s,
             "ms_per_step": 1000 * s / n} for k, (n, s) in sorted(per_shape.items(), key=lambda kv: -kv[1][1])]
    ceilings = machine_ceilings()
    print(f"dtype {args.dtype}, pool {llm.engine.runner.kv_pool.dtype}: workload wall time {total:.1f} s")
    for r in rows:
        print(f"{r['shape (tokens, seqs, width, tile, flat blocks)']:<32} {r['steps']:>5} steps "
              f"{r['total_s']:>7.2f} s {r['ms_per_step']:>8.1f} ms/step")
    print(f"numpy copy {ceilings['numpy_copy_GBps']:.1f} GB/s, fp32 matmul {ceilings['numpy_fp32_matmul_GFLOPs']:.0f} "
          "GFLOP/s")
    write_json(args.out, {"dtype": args.dtype, "pool_dtype": str(llm.engine.runner.kv_pool.dtype), "wall_s": total,
                          "steps": rows, **ceilings})


if __name__ == "__main__":
    main()
