"""Runs the throughput workload on vLLM's CPU build. Executed by the vLLM venv's python (it imports nothing from
jaxpaged), started by `benchmarks/peers/vllm_cpu.py` with the preloads and thread settings in its environment.

    <venv>/bin/python benchmarks/peers/vllm_cpu_run.py --model HF_DIR --prompts prompts.json --dtype bfloat16 \
        --out result.json

prompts.json: {"prompt_token_ids": [[...], ...], "max_tokens": 96, "sampling": {...}}. Every prompt goes in at once
through one `LLM.generate` call: greedy (plus "sampling"'s SamplingParams fields, e.g. penalties), EOS ignored, exactly
max_tokens new tokens, prefix caching off. The result JSON holds
tok/s, wall time (the generate call alone, after the engine is built and warmed by vLLM itself) and every
request's generated token ids, in prompt order.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import threading
import time

ENV_KEYS = ("LD_PRELOAD", "VLLM_CPU_OMP_THREADS_BIND", "VLLM_CPU_NUM_OF_RESERVED_CPU", "VLLM_CPU_KVCACHE_SPACE",
            "OMP_NUM_THREADS", "VLLM_ENABLE_V1_MULTIPROCESSING", "VLLM_CPU_SGL_KERNEL")


class TreeRSS:
    """Peak resident memory of this process and its children (vLLM's engine core runs in a child process)."""

    def __init__(self, interval: float = 0.1):
        import psutil

        self.peak, self._proc, self._interval = 0, psutil.Process(), interval
        threading.Thread(target=self._loop, daemon=True).start()

    def _loop(self):
        import psutil

        while True:
            total = 0
            for p in [self._proc, *self._proc.children(recursive=True)]:
                try:
                    total += p.memory_info().rss
                except psutil.Error:
                    pass
            self.peak = max(self.peak, total)
            time.sleep(self._interval)

    def reset(self):
        self.peak = 0


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True, help="Hugging Face directory")
    ap.add_argument("--prompts", required=True, help="JSON file written by benchmarks/throughput.py")
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    ap.add_argument("--out", required=True)
    ap.add_argument("--max-num-seqs", type=int, default=None, help="default: vLLM's own")
    ap.add_argument("--max-num-batched-tokens", type=int, default=None, help="default: vLLM's own")
    args = ap.parse_args()

    with open(args.prompts) as f:
        spec = json.load(f)
    prompts, max_tokens = spec["prompt_token_ids"], int(spec["max_tokens"])

    import torch
    import vllm
    from vllm import LLM, SamplingParams

    rss = TreeRSS()
    engine_args = {"model": args.model, "tokenizer": args.model, "dtype": args.dtype, "seed": 0,
                   "enable_prefix_caching": False,
                   "max_model_len": max(map(len, prompts)) + max_tokens}
    if args.max_num_seqs:
        engine_args["max_num_seqs"] = args.max_num_seqs
    if args.max_num_batched_tokens:
        engine_args["max_num_batched_tokens"] = args.max_num_batched_tokens
    t0 = time.perf_counter()
    llm = LLM(**engine_args)
    startup = time.perf_counter() - t0
    params = SamplingParams(**{"temperature": 0.0, "max_tokens": max_tokens, "min_tokens": max_tokens,
                               "ignore_eos": True, **spec.get("sampling", {})})
    requests = [{"prompt_token_ids": p} for p in prompts]
    rss.reset()
    t0 = time.perf_counter()
    outs = llm.generate(requests, params, use_tqdm=False)
    elapsed = time.perf_counter() - t0
    token_ids = [list(o.outputs[0].token_ids) for o in outs]
    resolved = {}
    try:  # what vLLM chose where we left it its defaults
        cfg = llm.llm_engine.vllm_config
        resolved = {"max_num_seqs": cfg.scheduler_config.max_num_seqs,
                    "max_num_batched_tokens": cfg.scheduler_config.max_num_batched_tokens,
                    "block_size": cfg.cache_config.block_size,
                    "enable_prefix_caching": cfg.cache_config.enable_prefix_caching,
                    "compilation_mode": str(getattr(cfg.compilation_config, "mode", None))}
    except AttributeError as e:
        resolved = {"error": f"could not read vLLM's config: {e}"}
    generated = sum(map(len, token_ids))
    result = {
        "system": f"vLLM {vllm.__version__} CPU ({args.dtype})",
        "tokens_per_s": generated / elapsed, "wall_s": elapsed, "generated_tokens": generated,
        "peak_rss_gib": rss.peak / 2**30, "startup_s": startup, "token_ids": token_ids,
        "engine_args": engine_args, "vllm_config": resolved, "vllm_version": vllm.__version__,
        "torch_version": torch.__version__, "torch_threads": torch.get_num_threads(), "python": sys.version.split()[0],
        "env": {k: os.environ.get(k) for k in ENV_KEYS},
    }
    with open(args.out, "w") as f:
        json.dump(result, f)
    print(f"vLLM {args.dtype}: {generated} tokens in {elapsed:.1f} s = {generated / elapsed:.1f} tok/s "
          f"(startup {startup:.1f} s)", flush=True)
    # vLLM's engine core is a child process; exiting without a shutdown can leave it behind
    shutdown = getattr(getattr(llm, "llm_engine", None), "engine_core", None)
    if shutdown is not None and hasattr(shutdown, "shutdown"):
        shutdown.shutdown()


if __name__ == "__main__":
    main()
