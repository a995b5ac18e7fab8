"""Step anatomy: where one prefill step and one decode step of the throughput workload spend their time.

Each part of the step is compiled on its own at the step's real shapes and timed on the device (median of runs,
results blocked on): the model's matmuls (the 7 per layer plus the LM head, through the same stacked weights,
layer loop and kernels: the native one for small bf16 steps), attention (the K/V write and the paged read through
the engine's backend, every layer), the sampler; the rest of the step (embedding, norms, RoPE, residuals,
layer-loop slicing) is the full step minus those. The host side is timed too: `prepare` (numpy batch building)
and the dispatch of the step (the call returns before the device finishes). The matmul rate is compared with
XLA's own dot rate on this machine at the same shapes. The parts are timed in rounds (each round calls every part
once) and step_over_matmul is the median of the rounds' ratios: a shared machine's slow stretches hit a round's
parts alike. Last, each step's top operations by XLA's own timing
(jax.profiler's trace of the compiled step).

    python benchmarks/step_anatomy.py                      # float32, default model
    python benchmarks/step_anatomy.py --dtype bfloat16
    python benchmarks/step_anatomy.py --dtype bfloat16 --mixed-chunk 16   # serving: a decode step of 16 streams and
                                                           # a mixed step with a 16-token chunk of a long prompt
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import functools
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np
from common import cpu_name, top_xla_ops, trace_events, write_json
from decode_anatomy import ffi_targets
from flax import nnx
from workload import workload_prompts

from jaxpaged.models.matmul import head_matmul, layer_matmul, native_matmul
from jaxpaged.runtime.compilation_cache import default_directory, enable_compilation_cache
from jaxpaged.runtime.tcmalloc import tcmalloc_loaded, use_tcmalloc


def device_ms(fn, *args, runs: int = 7) -> float:
    """Median wall time of fn(*args) with its result blocked on, after one warm-up call."""
    return statistics.median(interleaved_ms({"fn": lambda: fn(*args)}, runs)["fn"])


def interleaved_ms(parts: dict, rounds: int) -> dict[str, list[float]]:
    """Wall times (ms) of each part's call, its result blocked on, after one warm-up call each: `rounds` rounds of
    one call of every part in turn, so that each round's parts see the same machine (other tenants of a shared
    machine slow whole stretches of a run; per-round ratios cancel that out)."""
    for fn in parts.values():
        jax.block_until_ready(fn())
    times: dict[str, list[float]] = {name: [] for name in parts}
    for _ in range(rounds):
        for name, fn in parts.items():
            t = time.perf_counter()
            jax.block_until_ready(fn())
            times[name].append(1000 * (time.perf_counter() - t))
    return times


def _copy(inputs):
    """A step's inputs (`StepInputs`) as they were when dispatched: the runner refills its buffers every step."""
    extras = {name: np.copy(x) for name, x in inputs.extras.items()}
    return dataclasses.replace(inputs, buf=np.copy(inputs.buf), extras=extras)


def capture_batches(llm, num_prompts: int, new_tokens: int):
    """Runs part of the workload; returns the largest prefill step's inputs, the most frequent decode step's (by
    layout) and the host's prepare time per step."""
    from jaxpaged import SamplingParams

    runner = llm.engine.runner
    dispatch, prepare = runner.dispatch, runner.prepare
    seen: dict = {}
    counts: collections.Counter = collections.Counter()
    prepare_s: list[tuple[bool, float]] = []

    def timed_prepare(out, *args, **kwargs):
        t = time.perf_counter()
        prepared = prepare(out, *args, **kwargs)
        prepare_s.append((out.is_prefill, time.perf_counter() - t))
        return prepared

    def keep(inputs, rows):
        key = inputs.layout.key
        counts[key] += 1
        if key not in seen:
            seen[key] = _copy(inputs)
        return dispatch(inputs, rows)

    runner.dispatch, runner.prepare = keep, timed_prepare
    prompts = workload_prompts(llm.tokenizer, num_prompts)
    llm.generate([{"prompt_token_ids": p} for p in prompts],
                 SamplingParams(temperature=0.0, max_tokens=new_tokens, ignore_eos=True), use_tqdm=False)
    runner.dispatch, runner.prepare = dispatch, prepare
    prefill = max((k for k in seen if k[4] is None), key=lambda k: k[0])
    decode = max((k for k in seen if k[4] is not None), key=lambda k: (counts[k], k[1]))
    host = {kind: 1000 * statistics.median([s for p, s in prepare_s if p == (kind == "prefill")])
            for kind in ("prefill", "decode")}
    return seen[prefill], seen[decode], host


def profile_ops(step_fn, executable, runs: int = 3, top: int = 12) -> list[dict]:
    """XLA's own per-operation timing of one step (jax.profiler: the CPU runtime records each thunk it runs): the
    `top` operations by time per step, each with its output shape and what it computes (the HLO's op_name).
    Independent operations may run at once on the intra-op threads, so the times can add up to more than the step.
    """
    rows = top_xla_ops(trace_events(lambda: step_fn(None), runs), executable.as_text(), runs, top)
    targets = ffi_targets(executable)  # a native kernel's call: its FFI target and result shape
    for r in rows:
        what = r.pop("op_name").split("/")[-1]
        r["what"] = targets.get(r["op"], what)
    return rows


def capture_mixed(llm, chunk: int, streams: int = 16, long_tokens: int = 1536):
    """benchmarks/serving.py's interference run as steps: `streams` sequences of 300 prompt tokens decode, then a
    prompt of `long_tokens` arrives and is prefilled `chunk` tokens per step beside them (the server's
    max_prefill_tokens_while_decoding). Returns the streams' decode step and the last mixed step (the chunk at
    the longest context), their inputs."""
    from jaxpaged import SamplingParams

    engine, runner = llm.engine, llm.engine.runner
    rng = np.random.default_rng(0)
    for i in range(streams):
        engine.add_request(f"stream{i}", {"prompt_token_ids": rng.integers(100, 20000, 300).tolist()},
                           SamplingParams(temperature=0.0, max_tokens=long_tokens, ignore_eos=True))
    for _ in range(8):  # the streams' prompts in, a few decode steps
        engine.step()
    engine.scheduler.config = dataclasses.replace(engine.scheduler.config, max_prefill_tokens_while_decoding=chunk)
    seen: list = []
    dispatch = runner.dispatch

    def keep(inputs, rows):
        seen.append(_copy(inputs))
        return dispatch(inputs, rows)

    runner.dispatch = keep
    engine.step()
    decode = seen[-1]
    engine.add_request("long", {"prompt_token_ids": rng.integers(100, 20000, long_tokens).tolist()},
                       SamplingParams(temperature=0.0, max_tokens=1))
    while engine.scheduler.waiting or any(s.is_prefill for s in engine.scheduler.running):
        engine.step()
    runner.dispatch = dispatch
    mixed = [b for b in seen if b.layout.decode_blocks is None][-1]
    return decode, mixed


def matmul_part(config, dtype, native_rows: int):
    """jit(weights, x [T, H], rows [S, H]) -> the layer matmuls over all layers plus the LM head on S rows, through
    the models' `layer_matmul` and `head_matmul` with the step's own choice of the native kernel (native_rows)."""
    def run(w, x, rows):
        def layer(i, x):
            def mm(a, name):
                with native_matmul(native_rows):
                    return layer_matmul(a, w["layers"][name], i)

            q, k, v = mm(x, "wq"), mm(x, "wk"), mm(x, "wv")
            o = mm(q, "wo") + 0 * (k.sum() + v.sum()).astype(dtype)  # keep k, v live
            m = mm(mm(x, "w_gate") * mm(x, "w_up"), "w_down")
            return x + o + m

        x = jax.lax.fori_loop(0, config.num_layers, layer, x)
        head = w["lm_head"] if "lm_head" in w else w["head_t"] if "head_t" in w else w["embed"].T  # as the model's
        with native_matmul(native_rows):
            return x, head_matmul(rows, head)

    return run


def matmul_flops(config, tokens: int, rows: int) -> float:
    H, F = config.hidden_size, config.intermediate_size
    q, kv = config.num_heads * config.head_dim, config.num_kv_heads * config.head_dim
    per_token = 2 * (H * q + 2 * H * kv + q * H + 3 * H * F)
    return config.num_layers * tokens * per_token + 2 * rows * H * config.vocab_size


def attention_part(attn, config, dtype):
    """jit(pool, q, k, v, md) -> pool after every layer's write + read (the pool donated, as in the step)."""
    def run(pool, q, k, v, md):
        def layer(i, carry):
            out, pool = carry
            o, pool = attn(q, k, v, pool, i, md, sliding_window=config.sliding_window)
            return out + o.astype(out.dtype), pool

        return jax.lax.fori_loop(0, config.num_layers, layer, (jnp.zeros_like(q), pool))

    return jax.jit(run, donate_argnums=(0,))


def xla_dot_rate(tokens: int, k: int, n: int, dtype) -> float:
    """GFLOP/s of one plain XLA dot [tokens, k] @ [k, n] with float32 accumulation."""
    x = jnp.ones((tokens, k), dtype)
    w = jnp.ones((k, n), dtype)
    f = jax.jit(lambda x, w: jnp.dot(x, w, preferred_element_type=jnp.float32))
    return 2 * tokens * k * n / device_ms(f, x, w, runs=11) / 1e6


def anatomy(llm, inputs, kind: str, host_prepare_ms: float, dtype, rounds: int) -> dict:
    from jaxpaged.worker import sampler
    from jaxpaged.worker.attention import attention_backend
    from jaxpaged.worker.step import native_matmul_rows, step_compiler_options

    runner, config = llm.engine.runner, llm.engine.model_config
    layout = inputs.layout
    T, S = layout.num_tokens, layout.num_seqs
    step = runner._executable(layout)
    buf, extras = runner._arg(inputs.buf), runner._extras(inputs)
    _, _, md, sm = layout.unpack(jnp.asarray(inputs.buf), extras)  # the attention and sampling metadata, eagerly

    def full(_):
        tokens, _, runner.kv_pool, runner.draft_pool, _ = step(runner.param_leaves, runner.kv_pool,
                                                               runner.prev_tokens, buf, extras,
                                                               runner.draft_leaves, runner.draft_pool)
        return tokens

    t = time.perf_counter()
    out = full(None)
    dispatch_ms = 1000 * (time.perf_counter() - t)
    jax.block_until_ready(out)

    weights = nnx.to_pure_dict(runner.params)
    H = config.hidden_size
    x, rows = jnp.ones((T, H), dtype), jnp.ones((S, H), dtype)
    # Compiled with the step's own XLA options (model_runner.step_compiler_options).
    matmuls = jax.jit(matmul_part(config, dtype, native_matmul_rows(runner.mesh))).lower(weights, x, rows).compile(
        compiler_options=step_compiler_options(runner.params))

    attn = attention_backend(llm.engine.config.attention_backend)
    q = jnp.ones((T, config.num_heads, config.head_dim), dtype)
    k = jnp.ones((T, config.num_kv_heads, config.head_dim), dtype)
    attn_fn = attention_part(attn, config, dtype)

    def attention(_):
        out, runner.kv_pool = attn_fn(runner.kv_pool, q, k, k, md)
        return out

    logits = jnp.ones((S, config.vocab_size), jnp.float32)
    sample = jax.jit(functools.partial(sampler.sample, native=native_matmul_rows(runner.mesh) > 0))  # as the step
    times = interleaved_ms({"step": lambda: full(None), "matmul": lambda: matmuls(weights, x, rows),
                            "attention": lambda: attention(None), "sampler": lambda: sample(logits, sm)},
                           rounds)
    step_ms, mm_ms, attn_ms, sample_ms = (statistics.median(times[k]) for k in ("step", "matmul", "attention",
                                                                                  "sampler"))
    ratios = sorted(s / m for s, m in zip(times["step"], times["matmul"], strict=True))
    flops = matmul_flops(config, T, S)
    rest = step_ms - mm_ms - attn_ms - sample_ms
    ops = profile_ops(full, step)
    return {"kind": kind, "shape": str(layout.key), "tokens": T, "seqs": S, "step_ms": step_ms, "profile": ops,
            "matmul_ms": mm_ms, "attention_ms": attn_ms, "sampler_ms": sample_ms, "rest_ms": rest,
            "host_prepare_ms": host_prepare_ms, "dispatch_ms": dispatch_ms,
            "matmul_GFLOPs": flops / mm_ms / 1e6, "xla_dot_GFLOPs": xla_dot_rate(T, H, config.intermediate_size, dtype),
            "step_over_matmul": statistics.median(ratios), "step_over_matmul_quartiles": (
                ratios[len(ratios) // 4], ratios[3 * len(ratios) // 4]), "rounds": rounds}


def main():
    from jaxpaged import LLM

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--num-prompts", type=int, default=64)
    ap.add_argument("--new-tokens", type=int, default=16)
    ap.add_argument("--mixed-chunk", type=int, default=None,
                    help="instead: a decode step of 16 streams and a mixed step carrying this many tokens of a "
                         "1536-token prompt beside them (benchmarks/serving.py's interference run)")
    ap.add_argument("--rounds", type=int, default=15, help="timing rounds (each times every part once)")
    ap.add_argument("--out", default=None, help="default: benchmarks/results/step_anatomy_<dtype>[_mixed<N>].json")
    args = ap.parse_args()
    use_tcmalloc()  # what server.py and the CLI run on (jaxpaged/runtime/tcmalloc.py)
    enable_compilation_cache(default_directory())  # as they do: a rerun's start-up reads its compiled steps
    dtype = jnp.dtype(args.dtype)

    llm = LLM(dtype=args.dtype, show_progress=False, enable_prefix_caching=False)
    if args.mixed_chunk:
        decode, mixed = capture_mixed(llm, args.mixed_chunk)
        rows = [anatomy(llm, decode, "decode", float("nan"), dtype, args.rounds),
                anatomy(llm, mixed, f"mixed ({args.mixed_chunk}-token chunk)", float("nan"), dtype,
                        args.rounds)]
    else:
        prefill, decode, host = capture_batches(llm, args.num_prompts, args.new_tokens)
        rows = [anatomy(llm, prefill, "prefill", host["prefill"], dtype, args.rounds),
                anatomy(llm, decode, "decode", host["decode"], dtype, args.rounds)]
    cpu = cpu_name()
    print(f"{cpu}, dtype {args.dtype}, pool {llm.engine.runner.kv_pool.dtype}")
    cols = ["kind", "shape", "step_ms", "matmul_ms", "attention_ms", "sampler_ms", "rest_ms", "host_prepare_ms",
            "dispatch_ms", "matmul_GFLOPs", "xla_dot_GFLOPs", "step_over_matmul"]
    print(" | ".join(cols))
    print(" | ".join("---" for _ in cols))
    for r in rows:
        print(" | ".join(f"{r[c]:.1f}" if isinstance(r[c], float) else str(r[c]) for c in cols))
    for r in rows:
        low, high = r["step_over_matmul_quartiles"]
        print(f"{r['kind']}: step / matmul {r['step_over_matmul']:.2f} (median of {r['rounds']} rounds' ratios; "
              f"quartiles {low:.2f}-{high:.2f})")
    for r in rows:
        print(f"\n{r['kind']} step {r['shape']}: XLA's per-operation profile (jax.profiler), top {len(r['profile'])}")
        print("op | ms per step | calls | output shape | what")
        print("--- | --- | --- | --- | ---")
        for o in r["profile"]:
            print(f"{o['op']} | {o['ms_per_step']:.1f} | {o['calls_per_step']} | {o['shape']} | {o['what']}")
    suffix = f"_mixed{args.mixed_chunk}" if args.mixed_chunk else ""
    write_json(args.out or f"benchmarks/results/step_anatomy_{args.dtype}{suffix}.json",
               {"cpu": cpu, "dtype": args.dtype, "pool_dtype": str(llm.engine.runner.kv_pool.dtype),
                "allocator": "tcmalloc" if tcmalloc_loaded() else "system", "rows": rows})


if __name__ == "__main__":
    main()
