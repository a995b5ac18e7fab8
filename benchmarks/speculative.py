"""Speculative decoding on this machine's CPU: the default model (SmolLM2-135M-Instruct) with and without it, in the
same run, at batch 1 and batch 48, on two workloads:

    grounded   answers that copy spans of their prompt (repeat a passage, fix a typo in a function, quote a
               paragraph), where prompt lookup finds what comes next
    free       free generation (stories, explanations), where nothing in the prompt predicts the answer

Configurations: none; n-gram prompt lookup (k=4, n in 2..4); a self-speculative draft of the model's first layers
(k=4); the model's own GGUF kept 4-bit as a draft model (k=3, 5 and 7). Every run is greedy, so each configuration's
tokens must equal the plain run's (checked: a mismatch is a bug, and the table says so). Speculation turns itself
off above `disable_by_batch_size` (8 here), so batch 48 should cost nothing (a draft model skips its run in those
steps). Prints tokens/s, the speed-up over the plain run of the same batch and workload, acceptance rate and mean
accepted length, with the CPU's name; writes results/speculative.json.

Each speculating configuration runs in one process beside a plain engine, `--repeats` times interleaved (plain then
speculating, then the other way round), and its speed-up is the median of the repeats' ratios, with their min and
max: a single pair of runs of a few seconds moves by 10-20% on this shared VM.

    python benchmarks/speculative.py                       # both workloads, batch 1 and 48
    python benchmarks/speculative.py --batches 1 --new-tokens 64 --workloads grounded   # a quick look
    python benchmarks/speculative.py --batches 48 --configs "ngram k=4" --repeats 5 --merge   # add rows to the table

Goals (issue #31): >= 2x tokens/s at batch 1 with n-gram on the grounded workload, >= 1.5x with a draft, never
slower at batch 48. llama.cpp's prompt-lookup decoding is the peer: benchmarks/peers/llama_cpp_peer.py --parts lookup
(llama-cpp-python's bundled llama.cpp, built from its sdist into a venv of its own).
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from common import RESULTS_DIR, cpu_name, print_table, write_json  # noqa: E402

PASSAGE = ("The block manager keeps a free list of physical blocks and a reference count for each block. When a "
           "sequence needs a new slot, the manager hands out the first free block; when a sequence finishes, its "
           "blocks go back to the free list unless another sequence still holds them.")
CODE = '''def mean(values):
    total = 0
    for v in values:
        total += v
    return totl / len(values)
'''
GROUNDED = [
    f"Repeat the following text word for word, and nothing else:\n\n{PASSAGE}",
    f"Fix the typo in this Python function and return the whole corrected function:\n\n{CODE}",
    f"Copy this paragraph exactly, then stop:\n\n{PASSAGE}",
    f"Rewrite this function unchanged except for the bug on its last line:\n\n{CODE}",
]
FREE = [
    "Write a short story about a lighthouse keeper who finds a map.",
    "Explain how a bicycle stays upright, in simple words.",
    "Describe a busy market in a small town on a Saturday morning.",
    "Write a letter to a friend about a trip to the mountains.",
]
CONFIGS = {
    "plain": None,
    "ngram k=4": {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 2, "prompt_lookup_max": 4,
                  "disable_by_batch_size": 8},
    # the same with the per-request low-acceptance switch (off by default, as vLLM has none): a request whose last
    # 32 verifications accepted under 30% of their proposals stops proposing for 256 steps
    "ngram k=4 gated": {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 2, "prompt_lookup_max": 4,
                        "disable_by_batch_size": 8, "min_acceptance_rate": 0.3},
    "draft 10/30 layers k=4": {"draft_num_layers": 10, "num_speculative_tokens": 4, "disable_by_batch_size": 8},
    # the model's own GGUF file kept in its 4-bit formats as the draft of the full-width model
    "4-bit draft k=3": {"model": "<default GGUF>", "quantization": "gguf", "num_speculative_tokens": 3,
                        "disable_by_batch_size": 8},
    "4-bit draft k=5": {"model": "<default GGUF>", "quantization": "gguf", "num_speculative_tokens": 5,
                        "disable_by_batch_size": 8},
    "4-bit draft k=7": {"model": "<default GGUF>", "quantization": "gguf", "num_speculative_tokens": 7,
                        "disable_by_batch_size": 8},
}


def spec_of(config_name: str) -> dict | None:
    from jaxpaged.loader import default_model_path

    spec = CONFIGS[config_name]
    if spec is not None and spec.get("model") == "<default GGUF>":
        spec = {**spec, "model": default_model_path()}
    return spec


def prompts_for(llm, workload: str, batch: int) -> list[dict]:
    texts = GROUNDED if workload == "grounded" else FREE
    convs = [[{"role": "user", "content": texts[i % len(texts)]}] for i in range(batch)]
    return [{"prompt_token_ids": llm.apply_chat_template(c)} for c in convs]


def make_llm(config_name: str, batch: int, cache_dir: str | None):
    from jaxpaged import LLM

    # Shapes compile when a step first needs them (`warm` runs the workload once untimed first): a speculating
    # engine's start-up precompiles every shape twice or four times over, minutes of this CPU for shapes a run of
    # one workload never takes.
    return LLM(max_num_seqs=max(batch, 8), max_model_len=1024, speculative_config=spec_of(config_name),
               show_progress=False, compilation_cache_dir=cache_dir, precompile=False)


def warm(llm, workload: str, batch: int, new_tokens: int) -> None:
    """The timed run twice, untimed: every step shape it takes is compiled before the clock starts (greedy runs are
    deterministic, so the timed runs take the same shapes; the second run finds the prompts in the prefix cache, as
    the timed ones do, and its prefill takes other shapes)."""
    warmed = llm.__dict__.setdefault("_benchmark_warmed", set())
    if (workload, batch) not in warmed:
        for _ in range(2):
            timed_run(llm, workload, batch, new_tokens)
        warmed.add((workload, batch))


def timed_run(llm, workload: str, batch: int, new_tokens: int) -> dict:
    """One timed generate of the workload's batch (greedy): tok/s, steps and the speculation counters."""
    from jaxpaged import SamplingParams

    prompts = prompts_for(llm, workload, batch)
    sp = SamplingParams(temperature=0.0, max_tokens=new_tokens)
    before = llm.stats()
    t0 = time.perf_counter()
    outs = llm.generate(prompts, sp, use_tqdm=False)
    seconds = time.perf_counter() - t0
    after = llm.stats()
    tokens = sum(len(o.outputs[0].token_ids) for o in outs)
    proposed = after["spec_proposed_tokens"] - before["spec_proposed_tokens"]
    accepted = after["spec_accepted_tokens"] - before["spec_accepted_tokens"]
    verify_steps = after["spec_verify_steps"] - before["spec_verify_steps"]
    return {"tok_s": tokens / seconds, "seconds": seconds, "tokens": tokens, "steps": after["steps"] - before["steps"],
            "proposed": proposed, "accepted": accepted, "verify_steps": verify_steps,
            "token_ids": [o.outputs[0].token_ids for o in outs]}


def compare(name: str, llm, plain_llm, workload: str, batch: int, args) -> dict:
    """`name` against plain in one process, `args.repeats` times interleaved: each repeat times both engines back
    to back (plain first in even repeats, the speculating one first in odd ones, so a drift of the machine's speed
    favours neither), and its ratio compares the two runs of that repeat. The row gives the median tok/s of each,
    the median ratio and the ratios' spread (min, max)."""
    warm(llm, workload, batch, args.new_tokens)
    warm(plain_llm, workload, batch, args.new_tokens)
    pairs = []
    for r in range(args.repeats):
        if name == "plain":
            p = s = timed_run(llm, workload, batch, args.new_tokens)
        elif r % 2 == 0:
            p = timed_run(plain_llm, workload, batch, args.new_tokens)
            s = timed_run(llm, workload, batch, args.new_tokens)
        else:
            s = timed_run(llm, workload, batch, args.new_tokens)
            p = timed_run(plain_llm, workload, batch, args.new_tokens)
        pairs.append((p, s))
    ratios = [s["tok_s"] / p["tok_s"] for p, s in pairs]
    spec_runs = [s for _, s in pairs]
    proposed = sum(s["proposed"] for s in spec_runs)
    accepted = sum(s["accepted"] for s in spec_runs)
    verify_steps = sum(s["verify_steps"] for s in spec_runs)
    return {"workload": workload, "batch": batch, "config": name, "repeats": args.repeats,
            "tok_s": statistics.median(s["tok_s"] for s in spec_runs),
            "plain_tok_s": statistics.median(p["tok_s"] for p, _ in pairs),
            "speedup": statistics.median(ratios), "speedup_min": min(ratios), "speedup_max": max(ratios),
            "ratios": ratios, "tok_s_runs": [s["tok_s"] for s in spec_runs],
            "plain_tok_s_runs": [p["tok_s"] for p, _ in pairs],
            "seconds": statistics.median(s["seconds"] for s in spec_runs), "tokens": spec_runs[0]["tokens"],
            "steps": spec_runs[0]["steps"], "acceptance": accepted / proposed if proposed else None,
            "mean_accepted_length": 1 + accepted / verify_steps if verify_steps else None,
            "same_tokens": all(s["token_ids"] == p["token_ids"] for p, s in pairs)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--workloads", nargs="+", default=["grounded", "free"], choices=["grounded", "free"])
    ap.add_argument("--batches", nargs="+", type=int, default=[1, 48])
    ap.add_argument("--configs", nargs="+", default=list(CONFIGS), choices=list(CONFIGS))
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=3, help="interleaved plain/speculating pairs per row")
    ap.add_argument("--out", default=os.path.join(RESULTS_DIR, "speculative.json"))
    ap.add_argument("--merge", action="store_true",
                    help="keep --out's rows of other (workload, batch, configuration)s: one table from several runs")
    ap.add_argument("--compilation-cache-dir", default=None, help="JAX's persistent compilation cache (faster starts)")
    args = ap.parse_args()
    if "plain" not in args.configs:
        args.configs = ["plain", *args.configs]
    rows = []
    for batch in args.batches:
        plain_llm = make_llm("plain", batch, args.compilation_cache_dir)
        for name in args.configs:
            llm = plain_llm if name == "plain" else make_llm(name, batch, args.compilation_cache_dir)
            for workload in args.workloads:
                row = compare(name, llm, plain_llm, workload, batch, args)
                rows.append(row)
                print(f"{workload} batch {batch} {name}: {row['tok_s']:.1f} tok/s, x{row['speedup']:.2f} "
                      f"(repeats {', '.join(f'{x:.2f}' for x in row['ratios'])}), same tokens: {row['same_tokens']}",
                      flush=True)
            del llm
            gc.collect()  # (the speculating engine of this configuration is dropped before the next one starts)
    if args.merge and os.path.exists(args.out):
        with open(args.out) as f:
            earlier = json.load(f)
        ran = {(r["workload"], r["batch"], r["config"]) for r in rows}
        rows = [r for r in earlier["rows"] if (r["workload"], r["batch"], r["config"]) not in ran] + rows
    order = {name: i for i, name in enumerate(CONFIGS)}
    rows.sort(key=lambda r: (r["batch"], r["workload"] != "grounded", order[r["config"]]))
    print(f"\nSpeculative decoding, SmolLM2-135M-Instruct (bf16 where the CPU has it), greedy, {args.new_tokens} new "
          f"tokens, each speculating row against plain runs interleaved with it; CPU: {cpu_name()}")
    print_table(rows, [("workload", "workload", ""), ("batch", "batch", "d"), ("config", "speculation", ""),
                       ("tok_s", "tok/s", ".1f"), ("plain_tok_s", "plain tok/s", ".1f"),
                       ("speedup", "vs plain (median)", ".2f"), ("speedup_min", "min", ".2f"),
                       ("speedup_max", "max", ".2f"), ("repeats", "repeats", "d"), ("acceptance", "accepted", ".0%"),
                       ("mean_accepted_length", "tokens/verify step", ".2f"), ("steps", "steps", "d"),
                       ("same_tokens", "same tokens", "")])
    write_json(args.out, {"cpu": cpu_name(), "args": vars(args), "configs": {k: CONFIGS[k] for k in CONFIGS},
                          "rows": rows})


if __name__ == "__main__":
    main()
