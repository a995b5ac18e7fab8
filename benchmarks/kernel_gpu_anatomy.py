"""Where a small GPU decode call goes: each device kernel's time (jax.profiler) for our Pallas kernel and its knobs.

benchmarks/kernel.py found our kernel 2-3x slower than JAX's bundled one on small decode batches (batch 8-32,
context 512-2048) on an H100, with the cause not profiled. This script times those cases per call (wall clock,
`kernel.time_call`) and, from a jax.profiler trace of the same calls, every GPU kernel the call launches (the Pallas
kernel, the tile schedule's XLA ops, the flash-decoding merge), for variants of the kernel's knobs:
  default      the engine's settings (default_kv_splits, num_warps, num_stages=2, CHUNK_TOKENS=64)
  scan_search  the tile schedule's sequence search as a while loop (jnp.searchsorted's default), as before
  1split       no flash-decoding split
  warps2/8     Triton's num_warps
  stages1/3    Triton's num_stages (software pipelining of the K/V loads)
  chunkN       K/V tokens per loop step (gpu.CHUNK_TOKENS)
  bundled      jax.experimental.pallas.ops.gpu.paged_attention, for comparison
A run needs a CUDA GPU (`--smoke` checks the script anywhere in interpret mode, times meaningless):

    PYTHONPATH=. python benchmarks/kernel_gpu_anatomy.py   # -> benchmarks/results/kernel_gpu_anatomy.json
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import functools
import math

import jax
import jax.numpy as jnp
from common import print_table, trace_events, write_json
from kernel import make_batch, min_bytes, time_call

import pallas_kernels.gpu as gpu

SHAPE = dict(block_size=16, q_heads=32, kv_heads=8, head_dim=128, dtype=jnp.bfloat16)
CASES = [(8, 512), (8, 2048), (32, 512), (32, 2048), (128, 2048)]  # (batch, context)
CONTROL = (128, 2048)  # a large case where the kernel is at copy bandwidth: only the profiled variants run
SMOKE_SHAPE = dict(block_size=16, q_heads=4, kv_heads=2, head_dim=64, dtype=jnp.bfloat16)
SMOKE_CASES = [(2, 64)]
VARIANTS = {  # name -> (kwargs of ragged_paged_attention_gpu, module constants of gpu.py set while it is traced)
    "default": ({}, {}),
    "scan_search": ({}, {"SEQUENCE_SEARCH": "scan"}),
    "1split": ({"num_kv_splits": 1}, {}),
    "warps2": ({"num_warps": 2}, {}),
    "warps8": ({"num_warps": 8}, {}),
    "stages1": ({"num_stages": 1}, {}),
    "stages3": ({"num_stages": 3}, {}),
    "chunk16": ({}, {"CHUNK_TOKENS": 16}),
    "chunk32": ({}, {"CHUNK_TOKENS": 32}),
    "chunk128": ({}, {"CHUNK_TOKENS": 128}),
}


@contextlib.contextmanager
def patched(constants: dict):
    """gpu.py's module constants set while a variant is traced (they are read when its shapes are chosen)."""
    saved = {name: getattr(gpu, name) for name in constants}
    for name, value in constants.items():
        setattr(gpu, name, value)
    try:
        yield
    finally:
        for name, value in saved.items():
            setattr(gpu, name, value)


def device_kernels(fn, args, calls: int) -> tuple[float, dict[str, float], dict[str, float]]:
    """From a jax.profiler trace of `calls` calls, microseconds per call: the device's busy time, each kernel's, and
    each trace line's (device and host threads) top operations.

    On a GPU the trace's device has several lines that overlap (XLA Modules, XLA Ops, one per CUDA stream): the
    busy time is the modules line's (else the fullest line's), the kernels those of the stream lines. In interpret
    mode on CPU every line counts (times meaningless).
    """
    jax.block_until_ready(fn(*args))
    events = trace_events(lambda: fn(*args), calls)
    if not events:
        return 0.0, {}, {}
    names = {(e["pid"], e.get("tid") if e["name"] == "thread_name" else None): e["args"]["name"] for e in events
             if e.get("ph") == "M" and e.get("name") in ("process_name", "thread_name")}
    on_gpu = any("GPU" in name for (pid, tid), name in names.items() if tid is None)
    lines: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)  # device lines
    host: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)  # the host's threads
    for e in events:
        if e.get("ph") != "X":
            continue
        device = not on_gpu or "GPU" in names.get((e["pid"], None), "")
        line = names.get((e["pid"], None), "?") + " / " + names.get((e["pid"], e.get("tid")), "?")
        (lines if device else host)[line][e.get("name", "?")] += e.get("dur", 0) / calls
    if not lines:
        return 0.0, {}, {}
    modules = [line for line in lines if "Modules" in line]
    busy = sum(lines[modules[0]].values()) if modules else max(sum(c.values()) for c in lines.values())
    streams = [c for line, c in lines.items() if "Stream" in line] or list(lines.values())
    kernels = sum(streams, collections.Counter())
    every = {line: dict(c.most_common(8)) for line, c in (lines | host).items()}
    return busy, dict(kernels.most_common()), every


def variant_fn(batch: dict, kwargs: dict, constants: dict, interpret: bool):
    fn = functools.partial(gpu.ragged_paged_attention_gpu, scale=batch["scale"], tile_size=1,
                           decode_blocks=batch["decode_blocks"], interpret=interpret, **kwargs)
    with patched(constants):
        compiled = jax.jit(fn).lower(*call_args(batch)).compile()
    return compiled


def call_args(batch: dict) -> tuple:
    return (batch["q"], batch["k_cache"], batch["v_cache"], jnp.int32(0), batch["block_tables"],
            batch["context_lens"], batch["query_start_loc"], batch["positions"])


def bundled_fn(batch: dict, interpret: bool):
    from jax.experimental.pallas.ops.gpu.paged_attention import paged_attention as bundled

    k_pages = jnp.transpose(batch["k_cache"][0], (2, 0, 1, 3))  # its layout [Hkv, NB, BS, D], converted untimed
    v_pages = jnp.transpose(batch["v_cache"][0], (2, 0, 1, 3))
    k_splits = math.gcd(16, batch["block_tables"].shape[1])

    def run(q, k_pages, v_pages, tables, lengths):
        return bundled(q * jnp.asarray(batch["scale"], q.dtype), k_pages, v_pages, tables, lengths,
                       k_splits=k_splits, interpret=interpret)

    return jax.jit(run), (batch["q"], k_pages, v_pages, batch["block_tables"], batch["context_lens"])


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--smoke", action="store_true", help="tiny sizes in interpret mode (any machine)")
    ap.add_argument("--variants", default=",".join([*VARIANTS, "bundled"]))
    ap.add_argument("--profiled", default="default,1split,bundled", help="variants also traced by jax.profiler")
    ap.add_argument("--calls", type=int, default=20, help="calls profiled per variant")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    device = jax.devices()[0]
    if device.platform != "gpu" and not args.smoke:
        raise SystemExit(f"no GPU here ({device.platform}); use --smoke to check the script")
    interpret = device.platform != "gpu"
    timing = dict(warmup=1, samples=2, reps=1) if args.smoke else dict(warmup=3, samples=15, reps=10)
    shape, cases = (SMOKE_SHAPE, SMOKE_CASES) if args.smoke else (SHAPE, CASES)
    names, profiled = args.variants.split(","), args.profiled.split(",")

    rows = []
    for batch_size, ctx in cases:
        batch = make_batch([(ctx, 1)] * batch_size, tile=1, **shape)
        case = f"decode b={batch_size} ctx={ctx}"
        reference = None
        for name in names:
            if (batch_size, ctx) == CONTROL and name not in profiled:
                continue
            if name == "bundled":
                fn, fargs = bundled_fn(batch, interpret)
            else:
                kwargs, constants = VARIANTS[name]
                fn, fargs = variant_fn(batch, kwargs, constants, interpret), call_args(batch)
            out = jax.block_until_ready(fn(*fargs)).astype(jnp.float32)
            reference = out if reference is None else reference
            us = time_call(fn, fargs, **timing) * 1e6
            busy, kernels, lines = (device_kernels(fn, fargs, calls=2 if args.smoke else args.calls)
                                    if name in profiled else (None, {}, {}))
            host = max((us for line in lines.values() for op, us in line.items() if "Executable::Execute" in op),
                       default=None)
            rows.append({"case": case, "variant": name, "us": us, "gb_s": min_bytes(batch) / us / 1e3,
                         "device_us": busy, "host_execute_us": host, "launches": len(kernels) or None,
                         "top": "; ".join(f"{k[:40]} {v:.1f}" for k, v in list(kernels.items())[:4]),
                         "max_diff_vs_default": float(jnp.max(jnp.abs(out - reference))), "kernels": kernels,
                         "lines": lines})
            print(f"{case} {name}: {us:.1f} us/call, device {busy} us: {rows[-1]['top']}", flush=True)
        del batch

    print(f"\n{device.device_kind}, jax {jax.__version__}: {shape['q_heads']} q / {shape['kv_heads']} kv heads, "
          f"head_dim {shape['head_dim']}, block {shape['block_size']}, bf16"
          + (" (smoke: interpret mode, times meaningless)" if args.smoke else ""))
    print_table(rows, [("case", "case", ""), ("variant", "variant", ""), ("us", "us/call", ".1f"),
                       ("device_us", "device us", ".1f"), ("host_execute_us", "host Execute us", ".1f"),
                       ("gb_s", "GB/s", ".0f"),
                       ("max_diff_vs_default", "diff", ".1e"), ("top", "kernels (us/call)", "")])
    write_json(args.out or f"benchmarks/results/kernel_gpu_anatomy{'_smoke' if args.smoke else ''}.json",
               {"device": f"{device.device_kind} ({device.platform}), jax {jax.__version__}", "timing": timing,
                "rows": rows})


if __name__ == "__main__":
    main()
