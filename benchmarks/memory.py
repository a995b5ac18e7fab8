"""Memory waste and block size: the paper's Figure 2 and the block-size comparison, on the throughput workload.

Runs the same workload (64 prompts of 32-256 tokens, 128 new tokens, greedy, EOS ignored) through the same
scheduler and the same KV budget with
  (a) a contiguous allocator that reserves max_model_len slots per request up front (the pre-PagedAttention scheme,
      `kv_allocation="contiguous"`), and
  (b) paged blocks of 8, 16 and 32 tokens,
and reports the share of reserved KV slots that hold real tokens (mean over steps), the largest batch each
sustained, preemptions and throughput.

Then the K/V formats (--kv-cache-dtypes): the same budget with paged blocks of 16 in each kv_cache_dtype, and the
tokens its pool holds per GiB (float32 4 bytes an element, bfloat16 2, fp8 1: fp8 holds twice bfloat16's tokens), with
the same workload's batch and throughput.

    python benchmarks/memory.py                       # all four configurations, then every K/V format
    python benchmarks/memory.py --configs paged16 --kv-cache-dtypes none     # one
"""

from __future__ import annotations

import argparse

from common import StepSampler, cpu_name, print_table, timed, write_json
from workload import NEW_TOKENS, workload_prompts


def parse_bytes(value: str) -> int:
    from jaxpaged.config import parse_bytes as parse

    return parse(value)


CONFIGS = {"contiguous": ("contiguous", 16), "paged8": ("paged", 8), "paged16": ("paged", 16),
           "paged32": ("paged", 32)}


def run(name: str, args, prompts, kv_cache_dtype: str = "auto") -> dict:
    from jaxpaged import LLM, SamplingParams

    allocation, block_size = CONFIGS[name]
    llm = LLM(args.model, block_size=block_size, kv_allocation=allocation, kv_cache_memory=args.kv_cache_memory,
              max_model_len=args.max_model_len, max_num_seqs=64, enable_prefix_caching=False, precompile=False,
              show_progress=False, kv_cache_dtype=kv_cache_dtype)
    sampler = StepSampler(llm.engine)
    params = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)
    outs, wall = timed(lambda: llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False))
    sampler.close()
    s = llm.stats()
    generated = sum(len(o.outputs[0].token_ids) for o in outs)
    budget = parse_bytes(args.kv_cache_memory)
    return {"config": name, "block_size": block_size, "kv_cache_dtype": s["kv_cache_dtype"],
            "kv_bytes_per_token": s["kv_bytes_per_token"], "tokens_per_gib": 2**30 // s["kv_bytes_per_token"],
            "kv_tokens": s["num_blocks"] * block_size,
            "kv_tokens_per_gib": s["num_blocks"] * block_size * 2**30 / budget,
            "kv_utilization": sampler.mean("kv_utilization"), "max_batch": sampler.peak("num_running"),
            "mean_batch": sampler.mean("num_running"), "preemptions": s["preemptions"],
            "tokens_per_s": generated / wall, "wall_s": wall}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default=None)
    ap.add_argument("--configs", default=",".join(CONFIGS))
    ap.add_argument("--kv-cache-memory", default="512MiB", help="the same KV budget for every configuration")
    ap.add_argument("--max-model-len", type=int, default=512, help="what the contiguous allocator reserves")
    ap.add_argument("--num-prompts", type=int, default=64)
    ap.add_argument("--kv-cache-dtypes", default="float32,bfloat16,fp8,fp8_e5m2",
                    help="kv_cache_dtype values compared at paged16 (none: skip)")
    ap.add_argument("--out", default="benchmarks/results/memory.json")
    args = ap.parse_args()
    from jaxpaged.loader import load_model

    prompts = workload_prompts(load_model(args.model).tokenizer, args.num_prompts)
    rows = [run(name, args, prompts) for name in args.configs.split(",") if name]
    print(f"\nKV budget {args.kv_cache_memory}, max_model_len {args.max_model_len}, {len(prompts)} prompts")
    print_table(rows, [("config", "allocation", ""), ("kv_tokens", "KV slots", "d"),
                       ("kv_utilization", "slots holding real tokens", ".1%"), ("max_batch", "largest batch", "d"),
                       ("mean_batch", "mean batch", ".1f"), ("preemptions", "preemptions", "d"),
                       ("tokens_per_s", "tok/s", ".1f")])
    formats = [] if args.kv_cache_dtypes == "none" else [run("paged16", args, prompts, kv)
                                                         for kv in args.kv_cache_dtypes.split(",")]
    if formats:
        base = next((r for r in formats if r["kv_cache_dtype"] == "bfloat16"), formats[0])
        for r in formats:
            r["tokens_vs_bf16"] = r["kv_tokens"] / base["kv_tokens"]
        print(f"\nK/V formats, paged blocks of 16, KV budget {args.kv_cache_memory}; CPU: {cpu_name()}")
        print_table(formats, [("kv_cache_dtype", "KV cache", ""), ("kv_bytes_per_token", "bytes/token", "d"),
                              ("tokens_per_gib", "tokens per GiB", "d"), ("kv_tokens", "KV slots", "d"),
                              ("tokens_vs_bf16", "vs bf16", ".2f"), ("max_batch", "largest batch", "d"),
                              ("preemptions", "preemptions", "d"), ("tokens_per_s", "tok/s", ".1f")])
    write_json(args.out, {"kv_cache_memory": args.kv_cache_memory, "max_model_len": args.max_model_len,
                          "cpu": cpu_name(), "rows": rows, "kv_formats": formats})


if __name__ == "__main__":
    main()
