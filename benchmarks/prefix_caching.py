"""Prefix caching: many requests that share a long system prompt, with short distinct questions.

Runs the same requests with enable_prefix_caching off and on (same process, fresh engine each) and reports wall
time, throughput, mean time to first token, the prefix-cache hit rate (tokens) and the prefill tokens it skipped.

    python benchmarks/prefix_caching.py
"""

from __future__ import annotations

import argparse

from common import print_table, timed, write_json
from workload import TEXT


def run(args, prompts, caching: bool) -> dict:
    from jaxpaged import LLM, SamplingParams

    llm = LLM(args.model, enable_prefix_caching=caching, max_model_len=1024, max_num_seqs=32, precompile=False,
              show_progress=False)
    llm.generate([{"prompt_token_ids": prompts[0]}], SamplingParams(max_tokens=1), use_tqdm=False)  # compile
    llm = LLM(args.model, enable_prefix_caching=caching, max_model_len=1024, max_num_seqs=32, precompile=False,
              show_progress=False)  # fresh pool and counters; compiled programs come from the persistent cache
    params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens, ignore_eos=True)
    outs, wall = timed(lambda: llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False))
    s = llm.stats()
    ttft = [o.metrics["first_token_time"] - o.metrics["arrival_time"] for o in outs]
    return {"caching": "on" if caching else "off", "wall_s": wall,
            "tokens_per_s": sum(len(o.outputs[0].token_ids) for o in outs) / wall,
            "mean_ttft_s": sum(ttft) / len(ttft),
            "hit_rate": s["prefix_cache_hits"] / s["prefix_cache_queries"] if s["prefix_cache_queries"] else 0.0,
            "prefill_tokens_skipped": s["prefix_cache_hits"], "prompt_tokens_computed": s["prompt_tokens"]}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default=None)
    ap.add_argument("--num-requests", type=int, default=32)
    ap.add_argument("--system-tokens", type=int, default=512)
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument("--out", default="benchmarks/results/prefix_caching.json")
    args = ap.parse_args()
    from jaxpaged.loader import load_model

    tok = load_model(args.model).tokenizer
    system = (tok(TEXT)["input_ids"] * 4)[: args.system_tokens]
    questions = [tok(f" Question {i}: what does line {i} of the ledger say about ship number {i * 7}?")["input_ids"]
                 for i in range(args.num_requests)]
    prompts = [system + q for q in questions]
    rows = [run(args, prompts, caching) for caching in (False, True)]
    print(f"\n{len(prompts)} requests: {args.system_tokens}-token shared prefix + ~20-token question, "
          f"{args.max_tokens} new tokens")
    print_table(rows, [("caching", "prefix caching", ""), ("wall_s", "wall s", ".1f"),
                       ("tokens_per_s", "tok/s", ".1f"), ("mean_ttft_s", "mean TTFT s", ".2f"),
                       ("hit_rate", "hit rate", ".1%"), ("prefill_tokens_skipped", "prefill tokens skipped", "d"),
                       ("prompt_tokens_computed", "prompt tokens computed", "d")])
    write_json(args.out, {"rows": rows})


if __name__ == "__main__":
    main()
