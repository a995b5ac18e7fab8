"""Where a speculative step's time goes: each compiled step shape of one speculative run, timed as the engine runs it,
then the slowest verifying shape and the plain decode shape replayed under jax.profiler with their top operations.

One greedy request of benchmarks/speculative.py's grounded (or free) workload at batch 1, for each configuration
asked for (speculative.py's names). A step is timed from its dispatch to its tokens on the host (the loop is
synchronous while speculating). The table gives, per step shape (T tokens, S rows, W table width, K proposals),
how many steps ran in it and their median time, against the plain decode step of the same run (the plain
configuration's decode shape), and the ops that take a verifying step's time.

    python benchmarks/spec_anatomy.py                                  # ngram k=4 and the 4-bit draft
    python benchmarks/spec_anatomy.py --configs "ngram k=4" --top 15
    python benchmarks/spec_anatomy.py --workload free --configs plain "4-bit draft k=5" "4-bit draft k=7"
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import json
import os
import statistics
import sys
import time

import jax

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from common import RESULTS_DIR, cpu_name, print_table, top_xla_ops, trace_events, write_json  # noqa: E402
from speculative import CONFIGS, prompts_for, spec_of  # noqa: E402


def record_steps(llm) -> list[dict]:
    """Wraps the engine's runner so that every step's layout, inputs and times are kept: the host's work before its
    dispatch (since the step before was read: its tokens applied, proposals, scheduling, the batch laid out), the
    dispatch call, the wait for the device, and the read of its results (the sync copy to host)."""
    runner = llm.engine.runner
    steps: list[dict] = []
    dispatch, fetch = runner.dispatch, runner.fetch
    last_read = [None]

    def timed_dispatch(inputs, rows):
        t = time.perf_counter()
        handle = dispatch(inputs, rows)
        handle._t = (last_read[0], t, time.perf_counter())
        handle._inputs = inputs
        return handle

    def timed_fetch(handle):
        t0 = time.perf_counter()
        jax.block_until_ready([handle.tokens, handle.verified])
        t1 = time.perf_counter()
        result = fetch(handle)
        t2 = last_read[0] = time.perf_counter()
        before, start, queued = handle._t
        steps.append({"key": handle.layout.key, "layout": handle.layout, "inputs": handle._inputs,
                      "ms": 1000 * (t2 - start), "host_before_ms": 1000 * (start - before) if before else None,
                      "dispatch_ms": 1000 * (queued - start), "wait_ms": 1000 * (t1 - max(queued, t0)),
                      "read_ms": 1000 * (t2 - t1)})
        return result

    runner.dispatch, runner.fetch = timed_dispatch, timed_fetch
    return steps


def replay(runner, inputs):
    """A function that runs the compiled step of `inputs` again (same slots written: the pool stays valid)."""
    exe = runner._executable(inputs.layout)

    def run():
        tokens, out, runner.kv_pool, runner.draft_pool, _ = exe(runner.param_leaves, runner.kv_pool,
                                                                runner.prev_tokens, inputs.buf, runner._extras(inputs),
                                                                runner.draft_leaves, runner.draft_pool)
        return tokens

    return exe, run


def replay_ms(runner, inputs, runs: int) -> tuple[float, float]:
    """(median ms, minor page faults per call) of the step replayed `runs` times: fresh pages of large buffers
    are paid for by faults, which the profiler's per-op times include."""
    import resource

    _, run = replay(runner, inputs)
    run().block_until_ready()
    times = []
    faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    for _ in range(runs):
        t = time.perf_counter()
        run().block_until_ready()
        times.append(1000 * (time.perf_counter() - t))
    return statistics.median(times), (resource.getrusage(resource.RUSAGE_SELF).ru_minflt - faults) / runs


SCOPES = ("model", "draft_run", "lm_head", "verify", "draft_loop", "first")  # jaxpaged/worker/step.py's named scopes


def scope_ms(events: list[dict], hlo: str, calls: int) -> dict[str, float]:
    """ms per step of the profiled ops summed by the step's named scopes (`draft_loop/model`: the draft loop's layers;
    `other`: ops outside every scope: input unpacking, sampling, the tokens' padding), and `total`."""
    import re

    op_names = {m.group(1): m.group(2) for m in re.finditer(r'^\s*%(\S+) = .*op_name="([^"]*)"', hlo, re.MULTILINE)}
    out: collections.Counter = collections.Counter()
    for e in events:
        name = e.get("name", "")
        if e.get("ph") != "X" or name.startswith(("$", "ThunkExecutor", "SlinkyThreadPool", "while", "Pjit",
                                                   "CommonPjRt")):
            continue
        parts = [p for p in op_names.get(name, "").split("/") if p in SCOPES]
        label = "/".join(parts) or "other"
        out[label] += e["dur"] / 1000 / calls
        out["total"] += e["dur"] / 1000 / calls
    return dict(sorted(out.items(), key=lambda kv: -kv[1]))


def _median(values) -> float | None:
    values = [v for v in values if v is not None]
    return statistics.median(values) if values else None


def profile(config: str, workload: str, new_tokens: int, top: int, calls: int, cache_dir: str | None) -> dict:
    from jaxpaged import LLM, SamplingParams

    start = time.perf_counter()
    llm = LLM(max_num_seqs=8, max_model_len=1024, speculative_config=spec_of(config), show_progress=False,
              compilation_cache_dir=cache_dir)
    print(f"{config}: engine up in {time.perf_counter() - start:.0f} s", flush=True)
    prompts = prompts_for(llm, workload, 1)
    llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=8), use_tqdm=False)
    steps = record_steps(llm)
    engine = llm.engine
    times0 = dataclasses.replace(engine.step_times)
    stats0 = llm.stats()
    t0 = time.perf_counter()
    outs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=new_tokens), use_tqdm=False)
    seconds = time.perf_counter() - t0
    stats1 = llm.stats()
    times1 = engine.step_times
    num_steps = times1.steps - times0.steps
    host = {f: 1000 * (getattr(times1, f) - getattr(times0, f)) / num_steps
            for f in ("schedule_s", "prepare_s", "dispatch_s", "wait_s", "output_s")}
    runner = engine.runner
    by_key: dict[tuple, list[dict]] = collections.defaultdict(list)
    for s in steps[1:]:  # (the first is the prompt's prefill)
        by_key[s["key"]].append(s)
    shapes = []
    for key, group in sorted(by_key.items(), key=lambda kv: -len(kv[1])):
        shapes.append({"config": config, "shape": "T{} S{} W{} tile{} blocks{} K{}".format(*key),
                       "steps": len(group), "ms_engine": _median(g["ms"] for g in group),
                       "host_before_ms": _median(g["host_before_ms"] for g in group),
                       "dispatch_ms": _median(g["dispatch_ms"] for g in group),
                       "wait_ms": _median(g["wait_ms"] for g in group),
                       "read_ms": _median(g["read_ms"] for g in group),
                       "key": list(key)})
        shapes[-1]["ms_replay"], shapes[-1]["faults_replay"] = replay_ms(runner, group[-1]["inputs"], 9)
    main = max(by_key.values(), key=len)[-1]
    exe, run = replay(runner, main["inputs"])
    for _ in range(2):
        run().block_until_ready()
    events = trace_events(run, calls)
    ops = top_xla_ops(events, exe.as_text(), calls, top)
    for r in ops:
        r["shape"], r["what"] = r["shape"][:60], r.pop("op_name")[-70:]
    tokens = len(outs[0].outputs[0].token_ids)
    verify_steps = stats1["spec_verify_steps"] - stats0["spec_verify_steps"]
    accepted = stats1["spec_accepted_tokens"] - stats0["spec_accepted_tokens"]
    return {"config": config, "tok_s": tokens / seconds, "seconds": seconds, "tokens": tokens, "steps": num_steps,
            "verify_steps": verify_steps,
            "mean_accepted_length": 1 + accepted / verify_steps if verify_steps else None,
            "host_ms_per_step": host, "shapes": shapes,
            "top_ops_of": "T{} S{} W{} tile{} blocks{} K{}".format(*main["key"]), "top_ops": ops,
            "scopes_ms": scope_ms(events, exe.as_text(), calls)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--configs", nargs="+", default=["plain", "ngram k=4", "4-bit draft k=3"], choices=list(CONFIGS))
    ap.add_argument("--workload", default="grounded", choices=["grounded", "free"])
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--top", type=int, default=12)
    ap.add_argument("--calls", type=int, default=10)
    ap.add_argument("--out", default=os.path.join(RESULTS_DIR, "spec_anatomy.json"))
    ap.add_argument("--merge", action="store_true", help="keep --out's results of the configurations not run now")
    ap.add_argument("--compilation-cache-dir", default=None, help="JAX's persistent compilation cache (faster reruns)")
    args = ap.parse_args()
    results = [profile(c, args.workload, args.new_tokens, args.top, args.calls, args.compilation_cache_dir)
               for c in args.configs]
    if args.merge and os.path.exists(args.out):  # keep the file's other configurations (runs one at a time)
        with open(args.out) as f:
            earlier = json.load(f)
        if earlier["args"]["workload"] == args.workload:
            results = [r for r in earlier["results"] if r["config"] not in args.configs] + results
    print(f"\nSpeculative steps by shape, {args.workload}, batch 1, greedy; CPU: {cpu_name()}")
    print_table([s for r in results for s in r["shapes"]],
                [("config", "speculation", ""), ("shape", "step shape", ""), ("steps", "steps", "d"),
                 ("ms_engine", "ms in the engine", ".1f"), ("host_before_ms", "host before", ".1f"),
                 ("dispatch_ms", "dispatch", ".1f"), ("wait_ms", "device wait", ".1f"),
                 ("read_ms", "read", ".2f"), ("ms_replay", "ms replayed", ".1f"),
                 ("faults_replay", "page faults/step", ".0f")])
    print("\nPer run: tok/s, steps, tokens per verifying step, and host ms per step (engine.step_times)")
    print_table([{"config": r["config"], "tok_s": r["tok_s"], "steps": r["steps"],
                  "mal": r["mean_accepted_length"], **{k: v for k, v in r["host_ms_per_step"].items()}}
                 for r in results],
                [("config", "speculation", ""), ("tok_s", "tok/s", ".1f"), ("steps", "steps", "d"),
                 ("mal", "tokens/verify step", ".2f"), ("schedule_s", "schedule+propose", ".2f"),
                 ("prepare_s", "prepare", ".2f"), ("dispatch_s", "dispatch", ".2f"), ("wait_s", "wait+read", ".2f"),
                 ("output_s", "output", ".2f")])
    for r in results:
        print(f"\n{r['config']}: {r['tok_s']:.1f} tok/s; its most frequent step ({r['top_ops_of']}) by part, "
              "ms per step (profiled)")
        print_table([{"part": k, "ms": v} for k, v in r["scopes_ms"].items()], [("part", "part", ""),
                                                                               ("ms", "ms/step", ".2f")])
        print("top ops")
        print_table(r["top_ops"], [("ms_per_step", "ms/step", ".2f"), ("calls_per_step", "calls", "d"),
                                   ("what", "op", ""), ("shape", "shape", "")])
    write_json(args.out, {"cpu": cpu_name(), "args": vars(args), "results": results})


if __name__ == "__main__":
    main()
