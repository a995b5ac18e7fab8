"""Where a decode step's time goes, per weight format: XLA's own timing of every operation of the step.

One greedy request (a 32-token prompt, --decode-tokens new tokens; --batch N: N requests at once, with
--prompt-tokens each) per format through `LLM` (bf16 = quantization
None, gguf = the file's blocks kept, int8), traced with jax.profiler (the CPU runtime records each operation it
runs). Each operation is named by what it runs: the native kernels by their FFI target and output shape (the
quantized matmuls `jaxpaged_qmatmul*`, the bf16 ones `jaxpaged_matmul*`, attention, K/V writes, norms, rope,
argmax), XLA's own operations (fusions, copies, the layer loop's slicing) together as "xla ops". Per step: the
median over the request's decode steps of the step's span (first operation's start to last one's end) and of each
kind's summed time; "between ops" is the span less the operations (the executor's own time, waits for the pool's
helpers). Beside them the step's wall time seen from the host (Engine.stats()'s device_wait_s) and the host's own
time.

    python benchmarks/decode_anatomy.py                          # bf16 and gguf, default model (SmolLM2 Q4_1)
    python benchmarks/decode_anatomy.py --formats bf16 int8 gguf --decode-tokens 48
    python benchmarks/decode_anatomy.py --formats bf16 --batch 48 --prompt-tokens 160   # the throughput workload's
                                                                  # decode steps (48 sequences, its mean prompt)
Writes benchmarks/results/decode_anatomy.json (or --out) with lscpu's CPU name and the load average.
"""

from __future__ import annotations

import argparse
import collections
import os
import re
import statistics

from common import cpu_name, print_table, trace_events, write_json
from workload import workload_prompts


def ffi_targets(executable) -> dict[str, str]:
    """HLO name of each native call of a compiled step -> 'target result-shape' (e.g. 'jaxpaged_qmatmul
    bf16[1,192]')."""
    names: dict[str, str] = {}
    for line in executable.as_text().splitlines():
        m = re.match(r"\s*%?(\S+) = (\([^)]*\)|\S+) custom-call\(.*custom_call_target=\"([^\"]+)\"", line)
        if m:
            names[m.group(1)] = f"{m.group(3)} {re.sub(r'{[^}]*}', '', m.group(2))}"
    return names


def decode_anatomy(llm, prompts: list, decode_tokens: int) -> dict:
    from jaxpaged import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=decode_tokens, ignore_eos=True)
    llm.generate(prompts, params, use_tqdm=False)  # compiled, warm
    runner = llm.engine.runner
    executable_of, keys = runner._executable, collections.Counter()

    def counted(layout):
        keys[layout.key] += 1
        return executable_of(layout)

    runner._executable = counted
    before = llm.stats()
    events = trace_events(lambda: llm.generate(prompts, params, use_tqdm=False), 1)
    after = llm.stats()
    runner._executable = executable_of
    names = ffi_targets(runner._executables[keys.most_common(1)[0][0]])  # the decode steps' executable
    runs: dict[str, list[dict]] = collections.defaultdict(list)
    for e in events:
        args = e.get("args", {})
        # (a while loop or a conditional encloses the operations it runs: only those are counted)
        if e.get("ph") == "X" and "hlo_op" in args and not e["name"].startswith(("while", "cond", "call")):
            runs[args.get("run_id", "")].append(e)
    # the decode steps: the runs of the most common operation count (the prefill has its own executable)
    count = collections.Counter(len(ops) for ops in runs.values()).most_common(1)[0][0]
    steps = [ops for ops in runs.values() if len(ops) == count]
    per_kind: dict[str, list[float]] = collections.defaultdict(list)
    calls: collections.Counter = collections.Counter()
    spans, between = [], []
    for ops in steps:  # the operations of a step run one after another, on whichever thread the executor is on
        span = max(e["ts"] + e["dur"] for e in ops) - min(e["ts"] for e in ops)
        kinds: dict[str, float] = collections.defaultdict(float)
        n: collections.Counter = collections.Counter()
        for e in ops:
            kind = names.get(e["name"], "xla ops")
            kinds[kind] += e["dur"]
            n[kind] += 1
        for kind, us in kinds.items():
            per_kind[kind].append(us / 1000)
        calls.update(n)
        spans.append(span / 1000)
        between.append((span - sum(kinds.values())) / 1000)
    rows = [{"what": kind, "calls": calls[kind] // len(steps), "ms": statistics.median(v)}
            for kind, v in per_kind.items()]
    rows.sort(key=lambda r: -r["ms"])
    rows.append({"what": "between ops", "calls": None, "ms": statistics.median(between)})
    step_count = max(after["steps"] - before["steps"], 1)
    return {"decode_steps_traced": len(steps), "span_ms": statistics.median(spans),
            "device_wait_ms": 1e3 * (after["device_wait_s"] - before["device_wait_s"]) / step_count,
            "host_ms": 1e3 * (after["host_s"] - before["host_s"]) / step_count, "parts": rows}


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default=None, help="a GGUF file (default: SmolLM2-135M-Instruct Q4_1)")
    ap.add_argument("--formats", nargs="+", default=["bf16", "gguf"], choices=["bf16", "int8", "gguf"])
    ap.add_argument("--decode-tokens", type=int, default=32)
    ap.add_argument("--batch", type=int, default=1, help="requests decoding at once")
    ap.add_argument("--prompt-tokens", type=int, default=32, help="each request's prompt")
    ap.add_argument("--out", default="benchmarks/results/decode_anatomy.json")
    args = ap.parse_args()
    from jaxpaged import LLM

    load_before = os.getloadavg()
    results = {}
    for fmt in args.formats:
        tokens = args.prompt_tokens + args.decode_tokens
        llm = LLM(args.model, quantization=None if fmt == "bf16" else fmt, dtype="bfloat16",
                  max_num_seqs=max(8, args.batch), max_model_len=max(512, tokens),
                  kv_cache_memory=f"{max(64, args.batch * tokens // 32)}MiB", enable_prefix_caching=False,
                  show_progress=False)
        prompts = [{"prompt_token_ids": p} for p in workload_prompts(
            llm.tokenizer, args.batch, seed=1, min_len=args.prompt_tokens, max_len=args.prompt_tokens)]
        r = decode_anatomy(llm, prompts, args.decode_tokens)
        r["weight_mib"] = llm.stats()["weight_bytes"] / 2**20
        results[fmt] = r
        print(f"\n{fmt}: weights {r['weight_mib']:.1f} MiB; a decode step of {args.batch} sequences (median of "
              f"{r['decode_steps_traced']}): "
              f"{r['span_ms']:.2f} ms traced; untraced wait {r['device_wait_ms']:.2f} ms, "
              f"host {r['host_ms']:.2f} ms")
        print_table(r["parts"], [("what", "operation (target, output)", "s"), ("calls", "calls/step", "d"),
                                 ("ms", "ms/step", ".3f")])
        del llm
    write_json(args.out, {"cpu": cpu_name(), "load_average_before": load_before, "args": vars(args),
                          "formats": results, "load_average_after": os.getloadavg()})


if __name__ == "__main__":
    main()
