"""Tensor parallelism, what it costs per device: bytes of weights and of the KV pool on each device (from the arrays'
shards), and the collective bytes of one prefill step and one decode step read from the compiled HLO, beside the
Megatron formula; plus the CPU step time.

Each tp size (1, 2, 4, 8) runs in its own process with 8 fake CPU devices (XLA_FLAGS=
--xla_force_host_platform_device_count=8, set before JAX starts), the default model (SmolLM2-135M, float32) and the
same pool (num_blocks fixed, so the pool's logical size is the same at every tp).

Collective bytes: every all-reduce / all-gather / reduce-scatter / all-to-all / collective-permute in the compiled
step, with the bytes of its result on one device (the reduced array; the gathered array); those in the layer loop's
body (the `while` whose carry holds the pool) count once per layer. The Megatron formula, in the same bytes:

    (2 L + 1) x T x hidden x 4          all-reduces: after o and after down in each of L layers, and one after the
                                        vocabulary-split embedding lookup; T = the step's padded token count,
                                        activations float32
    + S x V x 4                         all-gather of the vocabulary-split logits of the S sequences, float32

It leaves out the wire traffic of the algorithm (a ring all-reduce sends 2 (tp-1)/tp of its bytes from each device).

Step time: median of 5 runs of the compiled step on 2 CPU cores shared by 8 fake devices. That is not a speed claim:
fake devices share the same cores and memory, so more devices only add the collectives' overhead.

    python benchmarks/tensor_parallel.py          # prints a table, writes benchmarks/results/tensor_parallel.json
    python benchmarks/tensor_parallel.py --quantization gguf   # the GGUF's Q4_1 / Q8_0 tensors kept, split as
                                                  # stored (results/tensor_parallel_gguf.json); or int8
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, ROOT)
from tests.hlo_checks import COLLECTIVES, computations, reachable  # noqa: E402  (the tests' HLO reading)

SIZES = (1, 2, 4, 8)
DEVICES = 8
DTYPE_BYTES = {"f32": 4, "bf16": 2, "f16": 2, "s32": 4, "u32": 4, "pred": 1, "s8": 1, "u8": 1, "f64": 8, "s64": 8}
ENGINE = dict(dtype="float32", max_num_seqs=8, max_num_batched_tokens=256, max_model_len=256, num_blocks=192,
              block_size=16, precompile=False, show_progress=False)
PROMPTS, PROMPT_LEN, NEW_TOKENS = 8, 96, 8


# ---- HLO -------------------------------------------------------------------------------------------------------------


def _result_bytes(line: str, op: str) -> int:
    """Bytes of the result of a collective instruction line, `%x = f32[8,576]{1,0} all-reduce(%y), ...` (a tuple
    result: all its arrays). XLA's HLO text does not repeat the operands' shapes."""
    result = line.split(f" {op}(", 1)[0].split(" = ", 1)[1]
    total = 0
    for dtype, dims in re.findall(r"\b([a-z]+\d*)\[([\d,]*)\]", result):
        n = 1
        for d in filter(None, dims.split(",")):
            n *= int(d)
        total += n * DTYPE_BYTES[dtype]
    return total


def step_collectives(hlo: str, local_pool_shape: tuple[int, ...], num_layers: int) -> dict:
    """{op: {"count": per step, "bytes": result bytes per step}}, the layer loop's body counted num_layers times."""
    comps = computations(hlo)
    dims = ",".join(map(str, local_pool_shape))
    loops = [re.search(r"body=%([\w.\-]+)", ln).group(1) for lines in comps.values() for ln in lines
             if " while(" in ln and f"[{dims}]" in ln.split(" while(")[0]]
    body = reachable(comps, loops[0]) if len(loops) == 1 else set()
    out = {op: {"count": 0, "bytes": 0} for op in COLLECTIVES}
    for name, lines in comps.items():
        times = num_layers if name in body else 1
        for line in lines:
            for op in COLLECTIVES:
                for form in (op, f"{op}-start"):  # async pairs: count the start, not the done
                    if f" {form}(" in line:
                        out[op]["count"] += times
                        out[op]["bytes"] += times * _result_bytes(line, form)
    return out


def megatron_bytes(tp: int, tokens: int, seqs: int, hidden: int, layers: int, vocab: int) -> int:
    """The formula in the module docstring; 0 at tp 1 (nothing is split)."""
    if tp == 1:
        return 0
    return (2 * layers + 1) * tokens * hidden * 4 + seqs * vocab * 4


# ---- one tp size, in a child process with 8 fake devices ------------------------------------------------------------


def measure(tp: int, quantization: str | None = None) -> dict:
    import jax
    import numpy as np

    from jaxpaged import LLM, SamplingParams
    from jaxpaged.parallel.tensor_parallel import per_device_bytes

    llm = LLM(tensor_parallel_size=tp, quantization=quantization, **ENGINE)
    runner = llm.engine.runner
    captured = {}  # kind -> (inputs, rows) of its largest step
    dispatch = runner.dispatch

    def capture(inputs, rows):
        kind = "decode" if inputs.layout.num_tokens == inputs.layout.num_seqs else "prefill"  # one token a row
        if kind not in captured or inputs.layout.num_tokens >= captured[kind][0].layout.num_tokens:
            captured[kind] = (inputs, rows)
        return dispatch(inputs, rows)

    runner.dispatch = capture
    rng = np.random.default_rng(0)
    vocab = llm.engine.model_config.vocab_size
    prompts = [{"prompt_token_ids": rng.integers(3, vocab, PROMPT_LEN).tolist()} for _ in range(PROMPTS)]
    llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True), use_tqdm=False)
    runner.dispatch = dispatch

    config = runner.config
    local_pool = runner.kv_pool.k.addressable_shards[0].data.shape
    weights, pool = per_device_bytes(runner.params), per_device_bytes(runner.kv_pool)
    out = {"tp": tp, "weights_bytes_per_device": max(weights.values()), "weights_bytes_total": sum(weights.values()),
           "pool_bytes_per_device": max(pool.values()), "pool_bytes_total": sum(pool.values()),
           "kv_head_slots": config.num_kv_heads, "query_head_slots": config.num_heads, "steps": {}}
    model = llm.engine.model_config
    for kind, (inputs, rows) in sorted(captured.items()):
        layout = inputs.layout
        tokens, seqs = layout.num_tokens, layout.num_seqs
        hlo = runner._executables[layout.key].as_text()
        coll = step_collectives(hlo, local_pool, config.num_layers)
        times = []
        for _ in range(6):  # the same step again (it rewrites the same pool slots); the host batch is not touched
            t = time.perf_counter()
            jax.block_until_ready(runner.dispatch(inputs, rows).tokens)
            times.append(time.perf_counter() - t)
        out["steps"][kind] = {
            "tokens": tokens, "seqs": seqs, "collectives": coll,
            "collective_bytes": sum(c["bytes"] for c in coll.values()),
            "megatron_bytes": megatron_bytes(tp, tokens, seqs, model.hidden_size, model.num_layers, vocab),
            "step_ms": 1000 * statistics.median(times[1:])}
    return out


# ---- the parent -----------------------------------------------------------------------------------------------------


def run_size(tp: int, quantization: str | None) -> dict:
    env = {**os.environ, "XLA_FLAGS": f"--xla_force_host_platform_device_count={DEVICES}", "JAX_PLATFORMS": "cpu",
           "PYTHONPATH": ROOT}
    quant = ["--quantization", quantization] if quantization else []
    proc = subprocess.run([sys.executable, os.path.abspath(__file__), "--worker", str(tp), *quant], cwd=ROOT,
                          env=env, capture_output=True, text=True, timeout=1200)
    if proc.returncode:
        raise RuntimeError(f"tp {tp} failed:\n{proc.stderr[-3000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quantization", choices=("int8", "gguf"), default=None,
                        help="weights quantized (int8) or the GGUF's formats kept (gguf); default: full width")
    parser.add_argument("--worker", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        print(json.dumps(measure(args.worker, args.quantization)))
        return
    sys.path.insert(0, HERE)
    from common import print_table, write_json
    from step_anatomy import cpu_name

    cpu = cpu_name()
    results = []
    for tp in SIZES:
        t0 = time.perf_counter()
        results.append(run_size(tp, args.quantization))
        print(f"tp {tp}: {time.perf_counter() - t0:.0f} s", file=sys.stderr)
    rows = []
    for r in results:
        row = {"tp": r["tp"], "weights": r["weights_bytes_per_device"] / 2**20,
               "pool": r["pool_bytes_per_device"] / 2**20, "heads": f"{r['query_head_slots']}/{r['kv_head_slots']}"}
        for kind in ("prefill", "decode"):
            s = r["steps"][kind]
            row[f"{kind}_shape"] = f"{s['tokens']}x{s['seqs']}"
            row[f"{kind}_coll"] = s["collective_bytes"] / 2**10
            row[f"{kind}_formula"] = s["megatron_bytes"] / 2**10
            row[f"{kind}_ops"] = "/".join(str(s["collectives"][op]["count"]) for op in ("all-reduce", "all-gather"))
            row[f"{kind}_ms"] = s["step_ms"]
        rows.append(row)
    weights = {None: "float32", "int8": "int8 weights, float32 compute", "gguf": "Q4_1/Q8_0 kept, float32 compute"}
    print(f"\nSmolLM2-135M {weights[args.quantization]}, {DEVICES} fake CPU devices on {os.cpu_count()} cores of "
          f"{cpu}; pool "
          f"{ENGINE['num_blocks']} blocks of {ENGINE['block_size']}. Collective KiB: result bytes from the compiled "
          "HLO (AR/AG: all-reduce/all-gather ops per step); formula: (2L+1)*T*hidden*4 + S*V*4. Step ms: fake devices "
          "sharing 2 cores, not a speed claim.\n")
    print_table(rows, [("tp", "tp", "d"), ("heads", "q/kv slots", "s"), ("weights", "weights MiB/dev", ".1f"),
                       ("pool", "KV pool MiB/dev", ".1f"), ("prefill_shape", "prefill TxS", "s"),
                       ("prefill_ops", "AR/AG", "s"), ("prefill_coll", "coll KiB", ".0f"),
                       ("prefill_formula", "formula KiB", ".0f"), ("prefill_ms", "ms", ".0f"),
                       ("decode_shape", "decode TxS", "s"), ("decode_ops", "AR/AG", "s"),
                       ("decode_coll", "coll KiB", ".0f"), ("decode_formula", "formula KiB", ".0f"),
                       ("decode_ms", "ms", ".0f")])
    name = f"tensor_parallel_{args.quantization}.json" if args.quantization else "tensor_parallel.json"
    write_json(os.path.join(HERE, "results", name),
               {"cpu": cpu, "devices": f"{DEVICES} fake CPU devices (--xla_force_host_platform_device_count)",
                "engine": ENGINE, "quantization": args.quantization,
                "formula": "(2 L + 1) x T x hidden x 4 + S x V x 4 result bytes per step",
                "note": "step_ms: fake devices on 2 CPU cores, not a speed claim", "results": results})


if __name__ == "__main__":
    main()
