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

    python benchmarks/speculative.py                       # both workloads, batch 1 and 48
    python benchmarks/speculative.py --batches 1 --new-tokens 64 --workloads grounded   # a quick look

Goals (issue #31): >= 2x tokens/s at batch 1 with n-gram on the grounded workload, >= 1.5x with a draft, never
slower at batch 48. llama.cpp's lookup decoding is the peer where it can be built (not here: no llama.cpp).
"""

from __future__ import annotations

import argparse
import os
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


def run(config_name: str, workload: str, batch: int, args) -> dict:
    from jaxpaged import LLM, SamplingParams

    spec = spec_of(config_name)
    llm = LLM(max_num_seqs=max(batch, 8), max_model_len=1024, speculative_config=spec, show_progress=False)
    prompts = prompts_for(llm, workload, batch)
    sp = SamplingParams(temperature=0.0, max_tokens=args.new_tokens)
    llm.generate(prompts[:1], SamplingParams(temperature=0.0, max_tokens=8), use_tqdm=False)  # warm the shapes
    before = llm.stats()
    t0 = time.perf_counter()
    outs = llm.generate(prompts, sp, use_tqdm=False)
    seconds = time.perf_counter() - t0
    after = llm.stats()
    tokens = sum(len(o.outputs[0].token_ids) for o in outs)
    proposed = after["spec_proposed_tokens"] - before["spec_proposed_tokens"]
    accepted = after["spec_accepted_tokens"] - before["spec_accepted_tokens"]
    verify_steps = after["spec_verify_steps"] - before["spec_verify_steps"]
    return {"workload": workload, "batch": batch, "config": config_name, "tok_s": tokens / seconds,
            "seconds": seconds, "tokens": tokens, "steps": after["steps"] - before["steps"],
            "acceptance": accepted / proposed if proposed else None,
            "mean_accepted_length": 1 + accepted / verify_steps if verify_steps else None,
            "token_ids": [o.outputs[0].token_ids for o in outs]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--workloads", nargs="+", default=["grounded", "free"], choices=["grounded", "free"])
    ap.add_argument("--batches", nargs="+", type=int, default=[1, 48])
    ap.add_argument("--configs", nargs="+", default=list(CONFIGS), choices=list(CONFIGS))
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--out", default=os.path.join(RESULTS_DIR, "speculative.json"))
    args = ap.parse_args()
    if "plain" not in args.configs:
        args.configs = ["plain", *args.configs]
    rows = []
    for workload in args.workloads:
        for batch in args.batches:
            plain = None
            for name in args.configs:
                row = run(name, workload, batch, args)
                if plain is None:
                    plain = row
                row["speedup"] = row["tok_s"] / plain["tok_s"]
                row["same_tokens"] = row["token_ids"] == plain["token_ids"]
                rows.append(row)
                print(f"{workload} batch {batch} {name}: {row['tok_s']:.1f} tok/s, x{row['speedup']:.2f}, "
                      f"same tokens: {row['same_tokens']}", flush=True)
    print(f"\nSpeculative decoding, SmolLM2-135M-Instruct (bf16 where the CPU has it), greedy, {args.new_tokens} new "
          f"tokens; CPU: {cpu_name()}")
    print_table(rows, [("workload", "workload", ""), ("batch", "batch", "d"), ("config", "speculation", ""),
                       ("tok_s", "tok/s", ".1f"), ("speedup", "vs plain", ".2f"), ("acceptance", "accepted", ".0%"),
                       ("mean_accepted_length", "tokens/verify step", ".2f"), ("steps", "steps", "d"),
                       ("same_tokens", "same tokens", "")])
    for row in rows:
        row.pop("token_ids")
    write_json(args.out, {"cpu": cpu_name(), "args": vars(args), "configs": {k: CONFIGS[k] for k in args.configs},
                          "rows": rows})


if __name__ == "__main__":
    main()
