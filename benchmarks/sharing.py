"""Sharing savings: KV blocks held with parallel sampling (n = 2, 4, 6) and beam search (width 2, 4, 6) against
what the same sequences would hold without sharing.

Without sharing every sequence owns a copy of each of its blocks: sum over live sequences of their block-table
lengths (the logical blocks). With sharing the pool holds the distinct physical blocks (num_used). The saving is
1 - physical / logical, averaged over steps. The paper reports 6.1-9.8% for parallel sampling and 37.6-55.2% for
beam search on its workloads (longer outputs than here).

    python benchmarks/sharing.py
"""

from __future__ import annotations

import argparse

from common import StepSampler, print_table, timed, write_json
from workload import workload_prompts


def logical_blocks(engine) -> dict:
    bm = engine.block_manager
    return {"logical_blocks": sum(len(bm.block_table(s.seq_id)) for s in engine.scheduler.running)}


def run(llm, kind: str, width: int, prompts, max_tokens: int) -> dict:
    from jaxpaged import BeamSearchParams, SamplingParams

    sampler = StepSampler(llm.engine, logical_blocks)
    reqs = [{"prompt_token_ids": p} for p in prompts]
    if kind == "parallel sampling":
        params = SamplingParams(n=width, temperature=0.8, max_tokens=max_tokens, seed=0, ignore_eos=True)
        _, wall = timed(lambda: llm.generate(reqs, params, use_tqdm=False))
    else:
        _, wall = timed(lambda: llm.beam_search(reqs, BeamSearchParams(beam_width=width, max_tokens=max_tokens,
                                                                          ignore_eos=True), use_tqdm=False))
    sampler.close()
    rows = [r for r in sampler.rows if r["logical_blocks"] > 0]
    saving = sum(1 - r["num_used"] / r["logical_blocks"] for r in rows) / len(rows)
    return {"kind": kind, "width": width, "saving": saving, "peak_physical": max(r["num_used"] for r in rows),
            "peak_logical": max(r["logical_blocks"] for r in rows), "wall_s": wall}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default=None)
    ap.add_argument("--num-prompts", type=int, default=8)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--widths", default="2,4,6")
    ap.add_argument("--out", default="benchmarks/results/sharing.json")
    args = ap.parse_args()
    from jaxpaged import LLM

    llm = LLM(args.model, max_model_len=512, max_num_seqs=64, enable_prefix_caching=False, precompile=False,
              show_progress=False)
    prompts = workload_prompts(llm.tokenizer, args.num_prompts)
    rows = [run(llm, kind, w, prompts, args.max_tokens) for kind in ("parallel sampling", "beam search")
            for w in map(int, args.widths.split(","))]
    print(f"\n{len(prompts)} prompts of 32-256 tokens, {args.max_tokens} new tokens, block 16")
    print_table(rows, [("kind", "decoding", ""), ("width", "n / beam width", "d"),
                       ("saving", "KV blocks saved by sharing", ".1%"), ("peak_physical", "peak blocks (shared)", "d"),
                       ("peak_logical", "peak blocks (unshared)", "d")])
    write_json(args.out, {"num_prompts": len(prompts), "max_tokens": args.max_tokens, "rows": rows})


if __name__ == "__main__":
    main()
