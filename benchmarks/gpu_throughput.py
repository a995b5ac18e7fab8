"""End-to-end throughput on a GPU (or TPU): random-weight Llama-3.2-1B and Llama-3-8B shapes, two workloads, the
engine and Hugging Face transformers on the same card in one run (issue #29's measurement).

    P  256 prompts of U[128, 1024] tokens, 128 new each (prefill-heavy)
    D  256 prompts of U[64, 256] tokens, 512 new each (decode-heavy)

Engine settings: bf16, max_num_seqs=256, max_num_batched_tokens=8192, max_model_len=2048, prefix caching off,
greedy, EOS ignored; each figure is the second run of the workload in the process (the first compiles). Printed and
written to results/gpu_throughput.json: tokens/s (total for P, output for D), model TFLOP/s against the card's bf16
peak, the decode step's wall time against its device time (jax.profiler trace of decode steps), compile time; HF's
static `generate` (batch 256, left-padded) and `generate_batch` (continuous batching) beside it. Goals on an H100 /
H200: decode step <= 1.3x its device time; Llama-3-8B D >= 19,000 output tok/s and Llama-3.2-1B D >= 60,000 on an
H200; P >= 50% of the card's bf16 peak. Name the card beside every figure.

    PYTHONPATH=. python benchmarks/gpu_throughput.py                 # both shapes, both workloads, HF too
    PYTHONPATH=. python benchmarks/gpu_throughput.py --models 1b --workloads D --no-hf
    PYTHONPATH=. python benchmarks/gpu_throughput.py --smoke         # tiny shapes on any machine: checks the script
    PYTHONPATH=. python benchmarks/gpu_throughput.py --rows 1b:D:bf16 8b:P:bf16 --lazy-compile --log-compiles

Formats (issue #30's GPU goal: fp8 KV and int8 weights >= 1.3x bf16 output tok/s on Llama-3-8B, workload D): each
of `--formats` is a jaxpaged row of its own, `bf16` (the default), `fp8kv` (kv_cache_dtype="fp8"), `int8`
(quantization="int8") or `fp8kv+int8`:

    PYTHONPATH=. python benchmarks/gpu_throughput.py --models 8b --workloads D --formats bf16 fp8kv+int8 --no-hf

A/B rows against the engine's earlier ways: `--xla-layer-matmul` (XLA's GEMM of the sliced layer, which copies the
layer's weights first), `--unrolled-layers` (decode-sized steps with their layer loop unrolled, so that XLA's GEMMs
read each layer's weights in place: `jaxpaged.worker.step.gpu_layer_loop`'s other way) and `--fused-sampler` (the
sampler inside the step, whose conditionals make the host wait for the device: jaxpaged.worker.step). `--sampling
top_p` samples as a chat client does (temperature 1, top-p 0.95), so every step runs the split sampler; `--sampling
regex` adds a grammar to every request (a bitmask each step, filled in after the step's dispatch: late bitmasks),
and `--sync-masks` lays the bitmasks out before each step instead, the loop synchronous (the engine before late
bitmasks: their A/B). Each row also prints a decode step's host time by part (the engine's timers).

Without a GPU or TPU it says so and exits (unless --smoke).
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import os
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from common import RESULTS_DIR, print_table, top_xla_ops, trace_events, write_json  # noqa: E402

from jaxpaged.config import ModelConfig  # noqa: E402

LLAMA3_ROPE = {"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 8192}
SHAPES = {
    "1b": ModelConfig(vocab_size=128256, hidden_size=2048, intermediate_size=8192, num_layers=16, num_heads=32,
                      num_kv_heads=8, head_dim=64, rope_theta=500000.0, rope_scaling=LLAMA3_ROPE,
                      max_position_embeddings=131072, tie_word_embeddings=True, eos_token_ids=(128001,)),
    "8b": ModelConfig(vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_layers=32, num_heads=32,
                      num_kv_heads=8, head_dim=128, rope_theta=500000.0, rope_scaling=dict(LLAMA3_ROPE, factor=8.0),
                      max_position_embeddings=8192, eos_token_ids=(128001,)),
    "smoke": ModelConfig(vocab_size=512, hidden_size=64, intermediate_size=128, num_layers=2, num_heads=4,
                         num_kv_heads=2, head_dim=16, max_position_embeddings=2048, eos_token_ids=(500,)),
}
WORKLOADS = {"P": ((128, 1024), 128), "D": ((64, 256), 512)}  # prompt length range, new tokens
FORMATS = {"bf16": {}, "fp8kv": {"kv_cache_dtype": "fp8"}, "int8": {"quantization": "int8"},
           "fp8kv+int8": {"kv_cache_dtype": "fp8", "quantization": "int8"}}  # engine options of each row
# how the jaxpaged rows sample (the HF peers are greedy): greedy, or as a chat client does (the split sampler's path)
SAMPLING = {"greedy": {"temperature": 0.0}, "top_p": {"temperature": 1.0, "top_p": 0.95, "seed": 0},
            # a grammar for every request: its bitmask each step (late bitmasks on a GPU; --sync-masks: before them).
            # The grammar never ends, so each request runs to max_tokens; over tests/tiny_hf.py's 384-token tokenizer
            # (random weights: any tokenizer whose ids fit the vocabulary will do), so the host's work is a lower bound.
            "regex": {"temperature": 1.0, "seed": 0, "regex": "[a-z ,.]*"}}
TOP_OPS = 12  # device operations of a decode step printed per row
PEAK_BF16_TFLOPS = {"H200": 989.0, "H100": 989.0, "A100": 312.0}  # dense bf16, NVIDIA's data sheets


@dataclasses.dataclass
class Run:
    model: str
    workload: str
    system: str
    seconds: float
    prompt_tokens: int
    output_tokens: int
    model_tflops: float
    compile_s: float | None = None
    decode_step_ms: float | None = None
    decode_device_ms: float | None = None
    decode_top_ops: list[dict] | None = None  # the decode step's costliest device operations (the profile)
    # where a decode step's wall time goes on the host (ms per step, the engine's own timers): the step's call
    # (`dispatch`: queued on the device; it blocks where the device makes the host wait) and the wait for tokens
    decode_host_ms: dict[str, float] | None = None


def model_flops(config: ModelConfig, prompts: list[int], new: int) -> float:
    """Forward FLOPs of the workload: 2 x (non-embedding parameters, LM head included) per token, plus attention's
    4 x layers x heads x head_dim per (token, context position) pair."""
    h, f, layers = config.hidden_size, config.intermediate_size, config.num_layers
    per_layer = h * (config.num_heads + 2 * config.num_kv_heads) * config.head_dim + config.num_heads * \
        config.head_dim * h + 3 * h * f
    dense = 2 * (layers * per_layer + h * config.vocab_size)
    flops = 0.0
    for p in prompts:
        tokens = p + new
        pairs = tokens * (tokens + 1) / 2
        flops += dense * tokens + 4 * layers * config.num_heads * config.head_dim * pairs
    return flops


NOMINAL_TB_S = {"H200": 4.8, "H100": 3.35}  # HBM bandwidth (SXM), NVIDIA's data sheets
WEIGHT_BYTES = {"bf16": 2, "fp8kv": 2, "int8": 1, "fp8kv+int8": 1}  # per parameter of the layer matmuls and head
KV_BYTES = {"bf16": 2, "fp8kv": 1, "int8": 2, "fp8kv+int8": 1}  # per K or V element
# the matmuls' operations a second against bf16's: the engine's int8 weights multiply in bf16 (x times u - 128,
# pallas_kernels/gpu_qmatmul.py's column scales), at bf16's rate
MATMUL_SPEEDUP = {"bf16": 1, "fp8kv": 1, "int8": 1, "fp8kv+int8": 1}


def decode_floor(config: ModelConfig, fmt: str, card: str, seqs: int, context: float) -> dict:
    """What a decode step of `seqs` sequences with `context` tokens each on average cannot go below on `card`, at
    its data-sheet rates: the matmuls (layers and LM head) take the longer of reading their weights and doing their
    FLOPs on the tensor cores (bf16's peak; int8's, twice it, with int8 weights: `MATMUL_SPEEDUP`); attention reads
    the K/V. Kernels run one after another, so the two add. Output tok/s: seqs per floor."""
    h, layers = config.hidden_size, config.num_layers
    per_layer = h * (config.num_heads + 2 * config.num_kv_heads) * config.head_dim + \
        config.num_heads * config.head_dim * h + 3 * h * config.intermediate_size
    params = layers * per_layer + h * config.vocab_size
    bw, peak = NOMINAL_TB_S[card] * 1e12, PEAK_BF16_TFLOPS[card] * 1e12
    weights_ms = 1e3 * params * WEIGHT_BYTES[fmt] / bw
    flops_ms = 1e3 * 2 * params * seqs / peak / MATMUL_SPEEDUP[fmt]
    kv_ms = 1e3 * seqs * context * layers * 2 * config.num_kv_heads * config.head_dim * KV_BYTES[fmt] / bw
    floor = max(weights_ms, flops_ms) + kv_ms
    return {"model": config_name(config), "format": fmt, "card": card, "weights_ms": weights_ms,
            "matmul_flops_ms": flops_ms, "kv_ms": kv_ms, "floor_ms": floor, "tok_s_ceiling": seqs / floor * 1e3}


def print_floors(seqs: int) -> None:
    """Workload D's decode step floors (`decode_floor`) for each shape, format and card: no GPU needed."""
    (lo, hi), new = WORKLOADS["D"]
    context = (lo + hi) / 2 + new / 2  # the prompt's mean, plus half the new tokens on average
    rows = [decode_floor(SHAPES[m], f, card, seqs, context) for card in NOMINAL_TB_S for m in ("1b", "8b")
            for f in FORMATS]
    base = {(r["card"], r["model"]): r["floor_ms"] for r in rows if r["format"] == "bf16"}
    for r in rows:
        r["vs_bf16"] = base[(r["card"], r["model"])] / r["floor_ms"]
    print(f"workload D's decode step of {seqs} sequences, {context:.0f} tokens of context on average: its floor at "
          "the data sheets' rates (tensor cores at their bf16 or int8 peak, HBM at its nominal bandwidth)")
    print_table(rows, [("card", "card", ""), ("model", "model", ""), ("format", "format", ""),
                       ("weights_ms", "weights ms", ".2f"), ("matmul_flops_ms", "matmul FLOPs ms", ".2f"),
                       ("kv_ms", "K/V ms", ".2f"), ("floor_ms", "floor ms", ".2f"),
                       ("tok_s_ceiling", "output tok/s ceiling", ",.0f"), ("vs_bf16", "vs bf16", ".2f")])


def workload(name: str, n: int, vocab: int, seed: int = 0) -> tuple[list[list[int]], int]:
    (lo, hi), new = WORKLOADS[name]
    rng = np.random.default_rng(seed)
    return [rng.integers(10, vocab - 10, int(rng.integers(lo, hi + 1))).tolist() for _ in range(n)], new


def run_ours(config: ModelConfig, name: str, prompts: list[list[int]], new: int, args, fmt: str = "bf16") -> Run:
    import jax
    import jax.numpy as jnp
    from flax import nnx

    from jaxpaged import LLM
    from jaxpaged.models.llama import LlamaForCausalLM

    row = f"{config_name(config)} {name} {fmt}"
    grammar = "regex" in SAMPLING[args.sampling]
    if grammar:  # a grammar's EOS is the tokenizer's: the model's must be one of its ids
        from tests.tiny_hf import EOS_ID

        config = dataclasses.replace(config, eos_token_ids=(EOS_ID,))
    t0 = time.perf_counter()
    model = LlamaForCausalLM(config, rngs=nnx.Rngs(0), dtype=jnp.bfloat16)
    print(f"[{row}] random weights made in {time.perf_counter() - t0:.1f} s", flush=True)
    t0 = time.perf_counter()
    tokenizer = None
    if grammar:  # a grammar needs a tokenizer
        from tests.tiny_hf import make_tiny_tokenizer

        tokenizer = make_tiny_tokenizer()
    llm = LLM.from_model(model, tokenizer, dtype="bfloat16", max_num_seqs=args.max_num_seqs,
                         max_num_batched_tokens=args.max_num_batched_tokens, max_model_len=args.max_model_len,
                         enable_prefix_caching=False, show_progress=False, precompile=not args.lazy_compile,
                         **FORMATS[fmt])
    compile_s = time.perf_counter() - t0
    print(f"[{row}] engine built in {compile_s:.1f} s", flush=True)
    if args.sync_masks:  # the A/B: bitmasks laid out before each step, the loop synchronous while they run
        llm.engine._late_masks = False
    sp = sampling_params(args.sampling, new)
    batch = [{"prompt_token_ids": p} for p in prompts]
    t0 = time.perf_counter()
    llm.generate(batch, sp, use_tqdm=False)  # the first run: anything left to load or compile
    first_s = time.perf_counter() - t0
    if args.lazy_compile:  # the shapes it used were compiled during the first run: start-up is both
        compile_s += first_s
    print(f"[{row}] first run {first_s:.1f} s", flush=True)
    t0 = time.perf_counter()
    outs = llm.generate(batch, sp, use_tqdm=False)
    seconds = time.perf_counter() - t0
    output_tokens = sum(len(o.outputs[0].token_ids) for o in outs)
    print(f"[{row}] timed run {seconds:.1f} s", flush=True)
    step_ms, device_ms, top_ops, host_ms = decode_step_times(llm, prompts, new, args.sampling)
    del model, llm
    gc.collect()  # the pool and weights go before the next row's model is made (its KV budget reads free memory)
    jax.clear_caches()
    system = " ".join(["jaxpaged" if fmt == "bf16" else f"jaxpaged {fmt}"]
                      + ["(XLA layer matmul)"] * args.xla_layer_matmul + ["(unrolled layers)"] * args.unrolled_layers
                      + ["(fused sampler)"] * args.fused_sampler
                      + [args.sampling] * (args.sampling != "greedy") + ["(synchronous masks)"] * args.sync_masks)
    return Run(config_name(config), name, system, seconds, sum(map(len, prompts)), output_tokens,
               model_flops(config, list(map(len, prompts)), new) / seconds / 1e12, compile_s, step_ms, device_ms,
               top_ops, host_ms)


def sampling_params(sampling: str, new: int, **kw):
    """The rows' SamplingParams for `--sampling` (a SAMPLING key): `new` tokens each, EOS ignored."""
    from jaxpaged import SamplingParams
    from jaxpaged.sampling_params import StructuredOutputsParams

    fields = dict(SAMPLING[sampling])
    if "regex" in fields:
        fields["structured_outputs"] = StructuredOutputsParams(regex=fields.pop("regex"))
    return SamplingParams(max_tokens=new, ignore_eos=True, **fields, **kw)


HOST_PARTS = ("schedule", "prepare", "dispatch", "output", "wait")  # the engine's StepTimes, in a step's order


def decode_step_times(llm, prompts: list[list[int]], new: int, sampling: str | None = None, steps: int = 20
                      ) -> tuple[float, float | None, list[dict] | None, dict[str, float]]:
    """A decode step's wall time and device time (ms) with every sequence decoding, its costliest device ops, and
    its host time by part (ms per step, `HOST_PARTS`): the prompts are prefilled, then `steps` engine steps run
    timed, then `steps` more under jax.profiler; device time is the trace's busiest device line per step (None
    without one: a CPU)."""
    engine = llm.engine
    sp = sampling_params(sampling or "greedy", new, output_kind=2)
    for i, p in enumerate(prompts):
        engine.add_request(f"trace-{i}", {"prompt_token_ids": p}, sp)
    while engine.scheduler.waiting or any(s.is_prefill for s in engine.scheduler.running):
        engine.step()
    for _ in range(3):
        engine.step()
    times = engine.step_times
    before = {k: getattr(times, f"{k}_s") for k in HOST_PARTS}
    t0 = time.perf_counter()
    for _ in range(steps):
        engine.step()
    wall_ms = 1e3 * (time.perf_counter() - t0) / steps
    host_ms = {k: 1e3 * (getattr(times, f"{k}_s") - before[k]) / steps for k in HOST_PARTS}
    events = trace_events(lambda: engine.step() and None, steps)
    line = busiest_device_line(events)
    device_ms = sum(e.get("dur", 0) for e in line) / steps / 1e3 if line else None
    try:  # the profile is for reading; a failure to name its ops must not cost the row its figures
        hlo = "\n".join(x.as_text() for x in engine.runner._executables.values())
        top_ops = top_xla_ops(line, hlo, steps, TOP_OPS)
    except Exception as e:
        print(f"decode step profile: {type(e).__name__}: {e}", file=sys.stderr)
        top_ops = None
    for i in range(len(prompts)):
        engine.abort_request(f"trace-{i}")
    while engine.has_unfinished_requests():
        engine.step()
    return wall_ms, device_ms, top_ops, host_ms


def busiest_device_line(events: list[dict]) -> list[dict]:
    """The events of the device trace line with the most busy time (the GPU's compute stream), over the traced
    calls; [] when the trace has no device line (a CPU)."""
    names = {e["pid"]: e["args"]["name"] for e in events if e.get("ph") == "M" and e.get("name") == "process_name"}
    lines: dict[tuple, list[dict]] = {}
    for e in events:
        if e.get("ph") == "X" and any(k in names.get(e["pid"], "") for k in ("GPU", "TPU", "/device:")):
            lines.setdefault((e["pid"], e.get("tid")), []).append(e)
    return max(lines.values(), key=lambda line: sum(e.get("dur", 0) for e in line), default=[])


def config_name(config: ModelConfig) -> str:
    """SHAPES' name of a config (its EOS ids aside: a grammar's row gives the model the tokenizer's)."""
    return next((k for k, v in SHAPES.items() if dataclasses.replace(v, eos_token_ids=config.eos_token_ids) == config),
                "?")


def run_hf(config: ModelConfig, name: str, prompts: list[list[int]], new: int, args, device: str) -> list[Run]:
    """transformers on the same card: static `generate` (batch of all prompts, left-padded) and `generate_batch`."""
    import torch
    import transformers

    hf_config = transformers.LlamaConfig(
        vocab_size=config.vocab_size, hidden_size=config.hidden_size, intermediate_size=config.intermediate_size,
        num_hidden_layers=config.num_layers, num_attention_heads=config.num_heads,
        num_key_value_heads=config.num_kv_heads, head_dim=config.head_dim, rope_theta=config.rope_theta,
        rope_scaling=config.rope_scaling, max_position_embeddings=config.max_position_embeddings,
        tie_word_embeddings=config.tie_word_embeddings, torch_dtype=torch.bfloat16)
    with torch.device(device):
        model = transformers.LlamaForCausalLM(hf_config).to(torch.bfloat16).eval()
    flops = model_flops(config, list(map(len, prompts)), new)
    runs = []
    gen = transformers.GenerationConfig(max_new_tokens=new, min_new_tokens=new, do_sample=False, pad_token_id=0,
                                        eos_token_id=None)

    def static():
        width = max(map(len, prompts))
        ids = torch.zeros(len(prompts), width, dtype=torch.long)
        mask = torch.zeros_like(ids)
        for i, p in enumerate(prompts):
            ids[i, width - len(p):] = torch.tensor(p)
            mask[i, width - len(p):] = 1
        with torch.no_grad():
            out = model.generate(input_ids=ids.to(device), attention_mask=mask.to(device), generation_config=gen)
        return int((out.shape[1] - width) * len(prompts))

    def continuous():
        with torch.no_grad():
            results = model.generate_batch(inputs=prompts, generation_config=gen)
        return sum(len(r.generated_tokens) for r in results.values())

    peers = [("HF generate (static)", static), ("HF generate_batch", continuous)]
    if device != "cuda":  # generate_batch sizes its cache from the device's memory: on a CPU host that is all of it
        peers = peers[:1]
    for system, fn in peers:
        try:
            fn()  # warm-up
            torch.cuda.synchronize() if device == "cuda" else None
            t0 = time.perf_counter()
            output_tokens = fn()
            torch.cuda.synchronize() if device == "cuda" else None
            seconds = time.perf_counter() - t0
            runs.append(Run(config_name(config), name, system, seconds, sum(map(len, prompts)), output_tokens,
                            flops / seconds / 1e12))
        except Exception as e:  # a peer that cannot run here is reported, not fatal
            print(f"{system} failed on {config_name(config)} {name}: {type(e).__name__}: {e}", file=sys.stderr)
    model = None  # the next shape's weights need the memory
    if device == "cuda":
        torch.cuda.empty_cache()
    return runs


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", nargs="+", default=["1b", "8b"], choices=["1b", "8b"])
    ap.add_argument("--workloads", nargs="+", default=["D", "P"], choices=list(WORKLOADS))
    ap.add_argument("--num-prompts", type=int, default=256)
    ap.add_argument("--max-num-seqs", type=int, default=256)
    ap.add_argument("--max-num-batched-tokens", type=int, default=8192)
    ap.add_argument("--max-model-len", type=int, default=2048)
    ap.add_argument("--formats", nargs="+", default=["bf16"], choices=list(FORMATS),
                    help="jaxpaged rows: KV cache and weight formats")
    ap.add_argument("--rows", nargs="+", default=None, metavar="MODEL:WORKLOAD:FORMAT",
                    help="jaxpaged rows in this order instead of models x workloads x formats, e.g. 1b:D:bf16 "
                         "8b:P:bf16 (no HF peers)")
    ap.add_argument("--no-hf", action="store_true", help="skip the transformers peers")
    ap.add_argument("--budget-s", type=float, default=None,
                    help="start no new row after this many seconds (the JSON keeps the rows done after each one)")
    ap.add_argument("--lazy-compile", action="store_true",
                    help="compile each step shape when first used (precompile=False) instead of all at start-up; "
                         "start-up s is then engine build + first run")
    ap.add_argument("--xla-layer-matmul", action="store_true",
                    help="layer matmuls by XLA's GEMM of the sliced layer instead of pallas_kernels/gpu_matmul.py "
                         "(the engine before it: an A/B of the kernel)")
    ap.add_argument("--unrolled-layers", action="store_true",
                    help="decode-sized steps with their layer loop unrolled and XLA's GEMMs on static slices of the "
                         "stacked weights instead of the kernel (jaxpaged.worker.step.gpu_layer_loop; an A/B)")
    ap.add_argument("--fused-sampler", action="store_true",
                    help="the sampler inside the step, as on CPU, instead of split from it (jaxpaged.worker.step: "
                         "the engine before the split, whose sampler's conditionals make the host wait; an A/B)")
    ap.add_argument("--sampling", default="greedy", choices=list(SAMPLING),
                    help="how the jaxpaged rows sample: greedy (as the HF peers), top_p: temperature 1, top-p "
                         "0.95, seeded (every step then runs the sampler), or regex: top_p's with a grammar (a "
                         "bitmask every step)")
    ap.add_argument("--sync-masks", action="store_true",
                    help="with --sampling regex: each step's bitmasks laid out before it, the loop synchronous "
                         "(the engine before late bitmasks; an A/B)")
    ap.add_argument("--log-compiles", action="store_true", help="log each step shape's compile time")
    ap.add_argument("--smoke", action="store_true", help="a tiny model and workload on any machine")
    ap.add_argument("--floors", action="store_true",
                    help="print workload D's decode step floors at the H100's and H200's data-sheet rates and exit "
                         "(no GPU needed)")
    ap.add_argument("--out", default=os.path.join(RESULTS_DIR, "gpu_throughput.json"))
    args = ap.parse_args()
    if args.floors:
        print_floors(args.max_num_seqs)
        return

    import jax

    if args.log_compiles:
        import logging

        logging.basicConfig(format="%(asctime)s %(name)s %(message)s")
        logging.getLogger("jaxpaged.worker.model_runner").setLevel(logging.DEBUG)
    from jaxpaged.worker import model_runner  # the A/Bs: the engine's earlier ways

    if args.xla_layer_matmul:
        model_runner.gpu_layer_matmul_rows = lambda mesh: 0
    if args.unrolled_layers:
        model_runner.gpu_layer_loop = lambda: "unrolled"
    if args.fused_sampler:
        model_runner.split_sampler_here = lambda multihost: False
    device = jax.devices()[0]
    if device.platform not in ("gpu", "tpu") and not args.smoke:
        raise SystemExit(f"gpu_throughput.py needs a GPU or TPU; JAX sees {device.platform} ({device}). "
                         "--smoke checks the script on any machine.")
    card = getattr(device, "device_kind", device.platform)
    peak = next((v for k, v in PEAK_BF16_TFLOPS.items() if k in card), None)
    models = ["smoke"] if args.smoke else args.models
    if args.smoke:
        args.num_prompts, args.max_num_seqs, args.max_model_len = 8, 8, 256
        WORKLOADS.update(P=((16, 64), 8), D=((8, 32), 16))
    if args.rows:
        rows = [tuple(r.split(":")) for r in args.rows]
        bad = [":".join(r) for r in rows if len(r) != 3 or r[0] not in SHAPES or r[1] not in WORKLOADS
               or r[2] not in FORMATS]
        if bad:
            ap.error(f"--rows: {' '.join(bad)} is not MODEL:WORKLOAD:FORMAT with MODEL in {list(SHAPES)}, "
                     f"WORKLOAD in {list(WORKLOADS)}, FORMAT in {list(FORMATS)}")
        args.no_hf = True
    else:
        rows = [(m, w, f) for m in models for w in args.workloads for f in args.formats]
    runs: list[Run] = []
    started = time.monotonic()
    skipped = []
    for i, (m, w, fmt) in enumerate(rows):
        config = SHAPES[m]
        prompts, new = workload(w, args.num_prompts, config.vocab_size)
        if args.budget_s and time.monotonic() - started > args.budget_s:
            skipped.append(f"{m} {w} {fmt}")
            continue
        runs.append(run_ours(config, w, prompts, new, args, fmt))
        print(runs[-1], flush=True)
        write_rows(args, card, peak, runs, skipped, jax.__version__)  # kept if a time limit ends the run
        last_of_pair = i + 1 == len(rows) or rows[i + 1][:2] != (m, w)
        if last_of_pair and not args.no_hf and not skipped:
            runs += run_hf(config, w, prompts, new, args, "cuda" if device.platform == "gpu" else "cpu")
    if skipped:
        print(f"not run (past --budget-s {args.budget_s:g}): {', '.join(skipped)}", flush=True)
    rows = write_rows(args, card, peak, runs, skipped, jax.__version__)
    print(f"\n{card} (bf16 peak {peak or '?'} TFLOP/s); tok/s: output tokens for D, all tokens for P")
    print_table(rows, [("model", "model", ""), ("workload", "workload", ""), ("system", "system", ""),
                       ("tok_s", "tok/s", ",.0f"), ("vs_bf16", "vs jaxpaged bf16", ".2f"),
                       ("model_tflops", "model TFLOP/s", ".1f"),
                       ("peak_share", "of peak", ".0%"), ("decode_step_ms", "decode step ms", ".2f"),
                       ("decode_device_ms", "device ms", ".2f"), ("step_over_device", "step / device", ".2f"),
                       ("compile_s", "start-up s", ".1f")])
    timed = [dict(r, **{f"{k}_ms": v for k, v in r["decode_host_ms"].items()}) for r in rows
             if r.get("decode_host_ms")]
    if timed:
        print("\na decode step's host time by part (ms per step; dispatch: the step's call, which returns when the "
              "device no longer makes the host wait; wait: for the tokens)")
        print_table(timed, [("model", "model", ""), ("system", "system", ""),
                            ("decode_step_ms", "decode step ms", ".2f"), ("decode_device_ms", "device ms", ".2f")]
                    + [(f"{k}_ms", k, ".3f") for k in HOST_PARTS])
    for r in rows:
        if r.get("decode_top_ops"):
            print(f"\n{r['model']} {r['workload']} {r['system']}: a decode step's costliest device operations "
                  f"(of {r['decode_device_ms']:.2f} ms)")
            print_table(r["decode_top_ops"], [("ms_per_step", "ms/step", ".3f"), ("calls_per_step", "calls", "d"),
                                              ("op", "op", ""), ("shape", "shape", ""), ("op_name", "op_name", "")])


def write_rows(args, card: str, peak: float | None, runs: list[Run], skipped: list[str], jax_version: str):
    """The rows so far, each against jaxpaged bf16 on its shape and workload, written to --out; returns them."""
    rows = []
    for r in runs:
        tokens = r.output_tokens if r.workload == "D" else r.prompt_tokens + r.output_tokens
        rows.append({**dataclasses.asdict(r), "tok_s": tokens / r.seconds,
                     "peak_share": r.model_tflops / peak if peak else None,
                     "step_over_device": (r.decode_step_ms / r.decode_device_ms
                                          if r.decode_step_ms and r.decode_device_ms else None)})
    base = {(r["model"], r["workload"]): r["tok_s"] for r in rows if r["system"] == "jaxpaged"}
    for r in rows:  # each row against jaxpaged bf16 on the same shape and workload
        b = base.get((r["model"], r["workload"]))
        r["vs_bf16"] = r["tok_s"] / b if b else None
    write_json(args.out, {"card": card, "peak_bf16_tflops": peak, "jax": jax_version, "args": vars(args),
                          "rows": rows, "not_run": skipped})
    return rows


if __name__ == "__main__":
    main()
