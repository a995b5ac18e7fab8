"""Offline throughput: jaxpaged's `LLM.generate` against Hugging Face `generate` on the same weights.

Workload (benchmarks/workload.py): 64 prompts, 32-256 tokens, 128 new tokens each, EOS ignored, greedy.
Both run in this one process, one after the other. Prints a table and writes benchmarks/results/throughput.json.

    python benchmarks/throughput.py                 # default model, HF at batch 16 and 64
    python benchmarks/throughput.py --skip-hf       # jaxpaged only
    python benchmarks/throughput.py --dtype bfloat16 --out benchmarks/results/throughput_bf16.json   # both in bf16
"""

from __future__ import annotations

import argparse
import json
import os
import threading
import time

from workload import NEW_TOKENS, workload_prompts


class PeakRSS:
    """Samples this process's resident memory in a thread; `peak` in bytes since the last reset."""

    def __init__(self, interval: float = 0.05):
        self.peak, self._stop = 0, False
        self._interval = interval
        threading.Thread(target=self._loop, daemon=True).start()

    def _loop(self):
        page = os.sysconf("SC_PAGE_SIZE")
        while not self._stop:
            with open("/proc/self/statm") as f:
                self.peak = max(self.peak, int(f.read().split()[1]) * page)
            time.sleep(self._interval)

    def reset(self):
        self.peak = 0


def run_jaxpaged(args, prompts, rss: PeakRSS) -> dict:
    from jaxpaged import LLM, SamplingParams

    t0 = time.perf_counter()
    llm = LLM(args.model, max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens,
              block_size=args.block_size, kv_cache_memory=args.kv_cache_memory, dtype=args.dtype)
    startup = time.perf_counter() - t0
    params = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)
    utilizations = []
    engine = llm.engine
    step = engine.step

    def sampled_step():  # KV utilization while the batch runs
        outs = step()
        utilizations.append(engine.stats()["kv_utilization"])
        return outs

    engine.step = sampled_step
    rss.reset()
    t0 = time.perf_counter()
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    elapsed = time.perf_counter() - t0
    engine.step = step
    generated = sum(len(o.outputs[0].token_ids) for o in outs)
    s = llm.stats()
    return {"system": f"jaxpaged (max_num_seqs={args.max_num_seqs}, block {args.block_size}, {args.dtype})",
            "tokens_per_s": generated / elapsed, "wall_s": elapsed, "generated_tokens": generated,
            "peak_rss_gib": rss.peak / 2**30, "kv_utilization_mean": sum(utilizations) / len(utilizations),
            "steps": s["steps"], "preemptions": s["preemptions"], "startup_s": startup,
            "compile_s": s["compile_s"]}


def run_hf(args, prompts, batch_size: int, rss: PeakRSS) -> dict:
    import torch
    import transformers

    from jaxpaged.loader import default_model_path

    torch.set_num_threads(os.cpu_count() or 2)
    path = args.model or default_model_path()
    dtype = getattr(torch, args.dtype)
    if path.endswith(".gguf"):
        model = transformers.AutoModelForCausalLM.from_pretrained(
            os.path.dirname(path), gguf_file=os.path.basename(path), dtype=dtype)
    else:
        model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=dtype)
    model.eval()
    pad = model.config.eos_token_id if isinstance(model.config.eos_token_id, int) else 0
    rss.reset()
    t0 = time.perf_counter()
    generated = 0
    for i in range(0, len(prompts), batch_size):
        chunk = prompts[i:i + batch_size]
        width = max(map(len, chunk))
        ids = torch.tensor([[pad] * (width - len(p)) + p for p in chunk])
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in chunk])
        with torch.no_grad():
            out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=NEW_TOKENS,
                                 min_new_tokens=NEW_TOKENS, do_sample=False, pad_token_id=pad)
        generated += (out.shape[1] - width) * len(chunk)
    elapsed = time.perf_counter() - t0
    return {"system": f"HF transformers generate (static batch {batch_size}, left padding, {args.dtype})",
            "tokens_per_s": generated / elapsed, "wall_s": elapsed, "generated_tokens": generated,
            "peak_rss_gib": rss.peak / 2**30, "kv_utilization_mean": None}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default=None)
    ap.add_argument("--max-num-seqs", type=int, default=64)
    ap.add_argument("--max-num-batched-tokens", type=int, default=2048)
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--kv-cache-memory", default="1GiB")
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"], help="both systems' dtype")
    ap.add_argument("--hf-batch-sizes", default="16,64")
    ap.add_argument("--skip-hf", action="store_true")
    ap.add_argument("--num-prompts", type=int, default=64)
    ap.add_argument("--out", default="benchmarks/results/throughput.json")
    args = ap.parse_args()

    from jaxpaged.loader import load_model

    tokenizer = load_model(args.model).tokenizer
    prompts = workload_prompts(tokenizer, args.num_prompts)
    rss = PeakRSS()
    rows = [run_jaxpaged(args, prompts, rss)]
    if not args.skip_hf:
        for bs in map(int, args.hf_batch_sizes.split(",")):
            rows.append(run_hf(args, prompts, bs, rss))
    best_hf = max((r["tokens_per_s"] for r in rows[1:]), default=None)
    print(f"\nworkload: {len(prompts)} prompts, {sum(map(len, prompts))} prompt tokens, {NEW_TOKENS} new tokens each")
    print(f"{'system':<62} {'tok/s':>8} {'wall s':>8} {'peak GiB':>9} {'KV util':>8}")
    for r in rows:
        util = f"{r['kv_utilization_mean']:.1%}" if r["kv_utilization_mean"] is not None else "-"
        print(f"{r['system']:<62} {r['tokens_per_s']:>8.1f} {r['wall_s']:>8.1f} {r['peak_rss_gib']:>9.2f} {util:>8}")
    if best_hf:
        print(f"jaxpaged / best HF batch: {rows[0]['tokens_per_s'] / best_hf:.2f}x")
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump({"rows": rows, "ratio_vs_best_hf": rows[0]["tokens_per_s"] / best_hf if best_hf else None,
                   "dtype": args.dtype, "machine": f"{os.cpu_count()} CPU cores"}, f, indent=2)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
