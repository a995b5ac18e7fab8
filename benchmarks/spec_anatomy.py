"""Where a speculative step's time goes: each compiled step shape of one speculative run, timed as the engine runs it,
then the slowest verifying shape and the plain decode shape replayed under jax.profiler with their top operations.

One greedy request of benchmarks/speculative.py's grounded (or free) workload at batch 1, for each configuration
asked for (speculative.py's names). A step is timed from its dispatch to its tokens on the host (the loop is
synchronous while speculating). The table gives, per step shape (T tokens, S rows, W table width, K proposals),
how many steps ran in it and their median time, against the plain decode step of the same run (the plain
configuration's decode shape), and the ops that take a verifying step's time.

    python benchmarks/spec_anatomy.py                                  # ngram k=4 and the 4-bit draft
    python benchmarks/spec_anatomy.py --configs "ngram k=4" --top 15
"""

from __future__ import annotations

import argparse
import collections
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from common import RESULTS_DIR, cpu_name, print_table, top_xla_ops, trace_events, write_json  # noqa: E402
from speculative import CONFIGS, prompts_for, spec_of  # noqa: E402


def record_steps(llm) -> list[dict]:
    """Wraps the engine's runner so that every step's layout, inputs and wall time (dispatch to fetched) are kept."""
    runner = llm.engine.runner
    steps: list[dict] = []
    dispatch, fetch = runner.dispatch, runner.fetch

    def timed_dispatch(inputs, rows):
        t = time.perf_counter()
        handle = dispatch(inputs, rows)
        handle._t0 = t
        handle._inputs = inputs
        return handle

    def timed_fetch(handle):
        result = fetch(handle)
        steps.append({"key": handle.layout.key, "layout": handle.layout, "inputs": handle._inputs,
                      "ms": 1000 * (time.perf_counter() - handle._t0)})
        return result

    runner.dispatch, runner.fetch = timed_dispatch, timed_fetch
    return steps


def replay(runner, inputs):
    """A function that runs the compiled step of `inputs` again (same slots written: the pool stays valid)."""
    exe = runner._executable(inputs.layout)

    def run():
        tokens, out, runner.kv_pool, runner.draft_pool = exe(runner.param_leaves, runner.kv_pool,
                                                             runner.prev_tokens, inputs.buf, runner._extras(inputs),
                                                             runner.draft_leaves, runner.draft_pool)
        return tokens

    return exe, run


def top_ops(runner, inputs, calls: int, top: int) -> list[dict]:
    """The step's top XLA operations by the profiler's own timing, ms per step, with the HLO op they came from."""
    exe, run = replay(runner, inputs)
    for _ in range(2):
        run().block_until_ready()
    rows = top_xla_ops(trace_events(run, calls), exe.as_text(), calls, top)
    for r in rows:
        r["shape"], r["what"] = r["shape"][:60], r.pop("op_name")[-70:]
    return rows


def replay_ms(runner, inputs, runs: int) -> float:
    _, run = replay(runner, inputs)
    run().block_until_ready()
    times = []
    for _ in range(runs):
        t = time.perf_counter()
        run().block_until_ready()
        times.append(1000 * (time.perf_counter() - t))
    return statistics.median(times)


def profile(config: str, workload: str, new_tokens: int, top: int, calls: int) -> dict:
    from jaxpaged import LLM, SamplingParams

    llm = LLM(max_num_seqs=8, max_model_len=1024, speculative_config=spec_of(config), show_progress=False)
    prompts = prompts_for(llm, workload, 1)
    llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=8), use_tqdm=False)
    steps = record_steps(llm)
    t0 = time.perf_counter()
    outs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=new_tokens), use_tqdm=False)
    seconds = time.perf_counter() - t0
    runner = llm.engine.runner
    by_key: dict[tuple, list[dict]] = collections.defaultdict(list)
    for s in steps[1:]:  # (the first is the prompt's prefill)
        by_key[s["key"]].append(s)
    shapes = []
    for key, group in sorted(by_key.items(), key=lambda kv: -len(kv[1])):
        shapes.append({"config": config, "shape": "T{} S{} W{} tile{} blocks{} K{}".format(*key),
                       "steps": len(group), "ms_engine": statistics.median(g["ms"] for g in group),
                       "ms_replay": replay_ms(runner, group[-1]["inputs"], 9), "key": list(key)})
    main = max(by_key.values(), key=len)[-1]
    ops = top_ops(runner, main["inputs"], calls, top)
    return {"config": config, "tok_s": len(outs[0].outputs[0].token_ids) / seconds, "shapes": shapes,
            "top_ops_of": "T{} S{} W{} tile{} blocks{} K{}".format(*main["key"]), "top_ops": ops}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--configs", nargs="+", default=["plain", "ngram k=4", "4-bit draft k=3"], choices=list(CONFIGS))
    ap.add_argument("--workload", default="grounded", choices=["grounded", "free"])
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--top", type=int, default=12)
    ap.add_argument("--calls", type=int, default=10)
    ap.add_argument("--out", default=os.path.join(RESULTS_DIR, "spec_anatomy.json"))
    args = ap.parse_args()
    results = [profile(c, args.workload, args.new_tokens, args.top, args.calls) for c in args.configs]
    print(f"\nSpeculative steps by shape, {args.workload}, batch 1, greedy; CPU: {cpu_name()}")
    print_table([s for r in results for s in r["shapes"]],
                [("config", "speculation", ""), ("shape", "step shape", ""), ("steps", "steps", "d"),
                 ("ms_engine", "ms in the engine", ".1f"), ("ms_replay", "ms replayed", ".1f")])
    for r in results:
        print(f"\n{r['config']}: {r['tok_s']:.1f} tok/s; top ops of its most frequent step ({r['top_ops_of']})")
        print_table(r["top_ops"], [("ms_per_step", "ms/step", ".2f"), ("calls_per_step", "calls", "d"),
                                   ("what", "op", ""), ("shape", "shape", "")])
    write_json(args.out, {"cpu": cpu_name(), "args": vars(args), "results": results})


if __name__ == "__main__":
    main()
