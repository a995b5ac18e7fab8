"""Host time of a decode step, and how much of it the device waits for: a tiny random model (1 layer, 64 wide, so the
device's work is small), 64 / 256 / 1024 running sequences decoding, the step loop's host time split into schedule /
prepare / dispatch / output, the device's own step time (the compiled step replayed alone) and the step's wall time,
with asynchronous scheduling on and off, in the same run. The engine at an earlier commit (`--baseline`, default the
commit before the persistent batch) runs the same workload in a subprocess beside it: its wall time per step.

    python benchmarks/host_overhead.py                      # 64, 256, 1024 sequences; writes results/host_overhead.json
    python benchmarks/host_overhead.py --seqs 256 --steps 30 --no-baseline
    python benchmarks/host_overhead.py --seqs 256 --no-baseline --penalized-only   # penalized rows, long prompts

Goal (issue #29): host time <= 1 ms per step at 256 sequences and <= 3 ms at 1024 on this project's CPU, hidden behind
the device step by asynchronous scheduling. A cProfile of one configuration is printed at the end.

Columns: `host` is the step loop's Python (schedule + prepare + output); `dispatch` is the compiled step's call, which
on a CPU backend can run part of the step in the calling thread (XLA's CPU client), so it is shown apart; `wait` is the
host blocked on a step's tokens; `gc` Python's garbage collector within the step (in whichever part it ran; the rows
"heap frozen" first freeze the start-up heap, `gc.freeze()`, as the server does after loading, which a library leaves
to its caller); `device` the compiled decode step replayed alone. On this 2-core CPU the "device" is
the same two cores, so overlapping host and device work (async) mostly shares them: the overlap pays on an
accelerator, where the host's time is otherwise the device's idle time.
"""

from __future__ import annotations

import argparse
import cProfile
import gc
import inspect
import io
import json
import os
import pstats
import subprocess
import sys
import tempfile
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from common import RESULTS_DIR, cpu_name, print_table, write_json  # noqa: E402

BASELINE = "7f69e84"  # main before the persistent batch (issue #29)


def tiny_model(vocab: int, layers: int, hidden: int):
    from jaxpaged.config import ModelConfig

    config = ModelConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=2 * hidden, num_layers=layers,
                         num_heads=4, num_kv_heads=2, head_dim=hidden // 4, max_position_embeddings=4096,
                         eos_token_ids=(1,))
    rng = np.random.default_rng(0)

    def w(*shape):
        return (rng.standard_normal(shape) / np.sqrt(shape[-2])).astype(np.float32)

    L, H, D, F = layers, hidden, config.head_dim, 2 * hidden
    params = {"embed": w(vocab, H), "final_norm": np.ones(H, np.float32), "lm_head": w(H, vocab), "layers": {
        "attn_norm": np.ones((L, H), np.float32), "mlp_norm": np.ones((L, H), np.float32),
        "wq": w(L, H, 4 * D), "wk": w(L, H, 2 * D), "wv": w(L, H, 2 * D), "wo": w(L, 4 * D, H),
        "w_gate": w(L, H, F), "w_up": w(L, H, F), "w_down": w(L, F, H)}}
    return config, params


def run_ours(num_seqs: int, steps: int, async_scheduling: bool, streaming: bool, args, profile: bool = False,
             frozen: bool = False, penalized: bool = False) -> dict:
    """frozen: the start-up heap frozen out of the garbage collector's reach first (`gc.freeze()`), as the server
    does after loading; the collector's time during the timed steps is measured either way (`gc_ms`). penalized:
    every request has presence, frequency and repetition penalties and a prompt of --penalty-prompt tokens (the
    step sends each row's history)."""
    from jaxpaged import LLM, RequestOutputKind, SamplingParams

    config, params = tiny_model(args.vocab, args.layers, args.hidden)
    prompt_len = args.penalty_prompt if penalized else args.prompt
    blocks_per_seq = max(12, -(-(prompt_len + steps + 16) // 16))
    llm = LLM.from_params(config, params, None, max_num_seqs=num_seqs, max_num_batched_tokens=max(2048, num_seqs),
                          max_model_len=2048, block_size=16, num_blocks=max(num_seqs * blocks_per_seq, 128) + 8,
                          precompile=False, show_progress=False, dtype="float32", enable_prefix_caching=False,
                          async_scheduling=async_scheduling)
    engine = llm.engine
    kind = RequestOutputKind.CUMULATIVE if streaming else RequestOutputKind.FINAL_ONLY
    penalties = dict(presence_penalty=0.5, frequency_penalty=0.5, repetition_penalty=1.2) if penalized else {}
    sp = SamplingParams(temperature=0.0, max_tokens=2048 - prompt_len, ignore_eos=True, output_kind=kind, **penalties)
    rng = np.random.default_rng(0)
    for i in range(num_seqs):
        engine.add_request(f"r{i}", {"prompt_token_ids": rng.integers(2, args.vocab, prompt_len).tolist()}, sp)
    while engine.scheduler.waiting or any(s.is_prefill for s in engine.scheduler.running):
        engine.step()
    for _ in range(5):  # every sequence decoding, the decode shape compiled
        engine.step()
    times = engine.step_times
    before = dict(vars(times))
    profiler = cProfile.Profile() if profile else None
    if frozen:
        gc.collect()
        gc.freeze()
    collecting = [0.0, 0.0]  # [seconds in the collector, when the running collection started]

    def on_gc(phase, info):
        if phase == "start":
            collecting[1] = time.perf_counter()
        else:
            collecting[0] += time.perf_counter() - collecting[1]

    gc.callbacks.append(on_gc)
    t0 = time.perf_counter()
    if profiler:
        profiler.enable()
    for _ in range(steps):
        engine.step()
    if profiler:
        profiler.disable()
    wall = (time.perf_counter() - t0) / steps
    gc.callbacks.remove(on_gc)
    if frozen:
        gc.unfreeze()
    n = times.steps - before["steps"]
    split = {k: 1e3 * (getattr(times, k) - before[k]) / max(n, 1)
             for k in ("schedule_s", "prepare_s", "dispatch_s", "output_s", "wait_s")}
    device = device_step_ms(engine)
    outputs = ("streamed" if streaming else "final only") + (", heap frozen" if frozen else "") + \
        (f", penalized, {prompt_len}-token prompts" if penalized else "")
    row = {"seqs": num_seqs, "async": async_scheduling, "outputs": outputs,
           "step_ms": 1e3 * wall, "device_ms": device, "gc_ms": 1e3 * collecting[0] / steps,
           **{k.replace("_s", "_ms"): v for k, v in split.items()},
           "host_ms": sum(split[k] for k in ("schedule_s", "prepare_s", "output_s"))}
    row["device_busy"] = min(1.0, device / row["step_ms"]) if row["step_ms"] else 0.0
    if profiler:
        out = io.StringIO()
        pstats.Stats(profiler, stream=out).sort_stats("tottime").print_stats(18)
        row["profile"] = out.getvalue()
    return row


def device_step_ms(engine, calls: int = 20) -> float:
    """The compiled decode step alone: the last step's inputs replayed back to back, waited for (median ms)."""
    import jax

    runner = engine.runner
    inflight = engine._inflight
    if inflight is None:
        return float("nan")
    layout = inflight.handle.layout
    step = runner._executable(layout)
    inputs, _ = runner.input_batch.build(inflight.out, layout)  # the last step's rows again
    buf, extras = inputs.buf, runner._extras(inputs)
    pool, draft_pool, prev = runner.kv_pool, runner.draft_pool, runner.prev_tokens
    jax.block_until_ready(engine.runner.fetch(inflight.handle).tokens)
    engine._inflight = None
    times = []
    for _ in range(calls):
        t0 = time.perf_counter()
        tokens, _, pool, draft_pool, _ = step(runner.param_leaves, pool, prev, runner._arg(buf), extras,
                                              runner.draft_leaves, draft_pool)
        jax.block_until_ready(tokens)
        times.append(time.perf_counter() - t0)
    runner.kv_pool, runner.draft_pool = pool, draft_pool
    return 1e3 * float(np.median(times[3:]))


# Runs in the baseline's own tree (its jaxpaged first on sys.path); tiny_model's source is pasted in below, so nothing
# of this checkout is imported there.
BASELINE_SCRIPT = r"""
import json, sys, time
import numpy as np
sys.path.insert(0, sys.argv[1])
from jaxpaged import LLM, SamplingParams
assert __import__("jaxpaged").__file__.startswith(sys.argv[1]), "the baseline must import its own jaxpaged"
# tiny_model
num_seqs, steps, vocab, layers, hidden, prompt = map(int, sys.argv[3:9])
config, params = tiny_model(vocab, layers, hidden)
llm = LLM.from_params(config, params, None, max_num_seqs=num_seqs, max_num_batched_tokens=max(2048, num_seqs),
                      max_model_len=2048, block_size=16, num_blocks=num_seqs * 12 + 8, precompile=False,
                      show_progress=False, dtype="float32", enable_prefix_caching=False)
engine = llm.engine
sp = SamplingParams(temperature=0.0, max_tokens=1500, ignore_eos=True)
rng = np.random.default_rng(0)
for i in range(num_seqs):
    engine.add_request(f"r{i}", {"prompt_token_ids": rng.integers(2, vocab, prompt).tolist()}, sp)
while engine.scheduler.waiting or any(s.is_prefill for s in engine.scheduler.running):
    engine.step()
for _ in range(5):
    engine.step()
t0 = time.perf_counter()
for _ in range(steps):
    engine.step()
print(json.dumps({"step_ms": 1e3 * (time.perf_counter() - t0) / steps}))
"""


def run_baseline(ref: str, num_seqs: int, steps: int, args) -> dict | None:
    """The engine at `ref` on the same workload, in a subprocess over a temporary git worktree (its wall time per
    step; that engine streamed every request's output every step, as its step loop did)."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    with tempfile.TemporaryDirectory() as tmp:
        tree = os.path.join(tmp, "baseline")
        made = subprocess.run(["git", "-C", root, "worktree", "add", "--detach", tree, ref], capture_output=True)
        if made.returncode != 0:
            print(f"baseline {ref}: no worktree ({made.stderr.decode().strip()})", file=sys.stderr)
            return None
        try:
            script = os.path.join(tmp, "baseline.py")
            head, body = BASELINE_SCRIPT.split("# tiny_model\n")
            with open(script, "w") as f:
                f.write(head + inspect.getsource(tiny_model) + body)
            cmd = [sys.executable, script, tree, os.path.dirname(os.path.abspath(__file__)), str(num_seqs), str(steps),
                   str(args.vocab), str(args.layers), str(args.hidden), str(args.prompt)]
            done = subprocess.run(cmd, capture_output=True, text=True, cwd=tree, timeout=1800)
            if done.returncode != 0:
                print(f"baseline {ref} failed:\n{done.stderr[-2000:]}", file=sys.stderr)
                return None
            return json.loads(done.stdout.strip().splitlines()[-1])
        finally:
            subprocess.run(["git", "-C", root, "worktree", "remove", "--force", tree], capture_output=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seqs", type=int, nargs="+", default=[64, 256, 1024])
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--vocab", type=int, default=512)
    parser.add_argument("--layers", type=int, default=1)
    parser.add_argument("--hidden", type=int, default=64)
    parser.add_argument("--prompt", type=int, default=32, help="prompt tokens per sequence")
    parser.add_argument("--penalized", action="store_true", help="also rows whose requests have penalties")
    parser.add_argument("--penalized-only", action="store_true", help="only those rows")
    parser.add_argument("--penalty-prompt", type=int, default=1000, help="prompt tokens of the penalized rows")
    parser.add_argument("--baseline", default=BASELINE, help="git ref of the engine to compare with")
    parser.add_argument("--no-baseline", action="store_true")
    parser.add_argument("--profile-seqs", type=int, default=1024, help="cProfile the async run of this many")
    parser.add_argument("--out", default=os.path.join(RESULTS_DIR, "host_overhead.json"))
    args = parser.parse_args()

    rows, profile = [], ""
    for num_seqs in args.seqs:
        for async_scheduling in (True, False):
            variants = [] if args.penalized_only else [(False, False, False), (True, False, False), (True, True, False)]
            if args.penalized or args.penalized_only:
                variants.append((False, False, True))
            for streaming, frozen, penalized in variants:
                want_profile = (num_seqs == args.profile_seqs and async_scheduling and not streaming
                                and penalized == args.penalized_only)
                row = run_ours(num_seqs, args.steps, async_scheduling, streaming, args, profile=want_profile,
                               frozen=frozen, penalized=penalized)
                profile = row.pop("profile", profile)
                rows.append(row)
                print(f"{num_seqs} seqs async={async_scheduling} {row['outputs']}: step {row['step_ms']:.2f} ms, "
                      f"host {row['host_ms']:.2f} ms, device {row['device_ms']:.2f} ms", flush=True)
        if not args.no_baseline:
            base = run_baseline(args.baseline, num_seqs, args.steps, args)
            if base is not None:
                rows.append({"seqs": num_seqs, "async": False, "outputs": f"engine at {args.baseline}",
                             "step_ms": base["step_ms"]})
    columns = [("seqs", "seqs", "d"), ("async", "async", ""), ("outputs", "outputs", ""),
               ("step_ms", "step ms", ".2f"), ("device_ms", "device ms", ".2f"), ("host_ms", "host ms", ".2f"),
               ("schedule_ms", "schedule", ".3f"), ("prepare_ms", "prepare", ".3f"), ("dispatch_ms", "dispatch", ".3f"),
               ("output_ms", "output", ".3f"), ("gc_ms", "gc", ".3f"), ("wait_ms", "wait", ".2f"),
               ("device_busy", "device busy", ".0%")]
    print(f"\nHost overhead per decode step, CPU: {cpu_name()}, model: {args.layers} layer(s), hidden {args.hidden}, "
          f"vocab {args.vocab}")
    print_table(rows, columns)
    if profile:
        print(f"\ncProfile of {args.profile_seqs} sequences, async, final-only outputs (tottime):\n{profile}")
    write_json(args.out, {"cpu": cpu_name(), "args": vars(args), "rows": rows, "profile": profile})


if __name__ == "__main__":
    main()
