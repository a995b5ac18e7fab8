"""Paged-attention kernels head to head: the pure-JAX reference, our Pallas GPU kernel, and JAX's bundled one.

Decode batches (batch 8 / 32 / 128 x context 512 / 2048 / 8192, block 16, 32 q heads / 8 kv heads, head_dim 128,
bf16) and one mixed batch (prefill chunks + decodes, 16-token tiles). Each implementation is jitted, warmed up,
then timed as the median over --samples samples of --reps back-to-back calls. Reported:
  * time per call (us);
  * achieved bandwidth = (K/V bytes of every sequence's context + q bytes read + output bytes written) / time, the
    least memory any implementation must move, against a measured device copy bandwidth (read + write of a large
    array); decode attention is memory-bound, so this ratio is the figure of merit;
  * the largest difference from the reference's output (when the reference fits in memory).
`pallas_gpu` is our kernel with its default flash-decoding splits (`default_kv_splits`), `pallas_gpu_1split` the
same kernel with none. JAX's bundled kernel (`jax.experimental.pallas.ops.gpu.paged_attention`, Triton, decode
only) wants its own layout, k/v pages [kv_heads, pages, page_size, head_dim] (converted once, outside the timing),
and does no 1/sqrt(d) scaling inside, so its q is pre-scaled (inside the timed call). A run needs a CUDA GPU:

    python benchmarks/kernel.py                 # the full grid -> benchmarks/results/kernel.json
    python benchmarks/kernel.py --smoke         # tiny sizes on any machine: the reference, and the kernels in
                                                # interpret mode -> benchmarks/results/kernel_smoke.json
    python benchmarks/kernel.py --cpu           # CPU decode and prefill: the reference against the native
                                                # kernel (pallas_kernels/cpu_native), SmolLM2's shapes, --dtype
                                                # -> benchmarks/results/kernel_cpu.json
    python benchmarks/kernel.py --cpu --kv-dtype fp8    # the same with an fp8 pool (float8_e4m3fn; fp8_e5m2),
                                                # q in --dtype -> benchmarks/results/kernel_cpu_fp8.json
"""

from __future__ import annotations

import argparse
import functools
import logging
import math

import jax
import jax.numpy as jnp
import numpy as np
from common import print_table, time_call, write_json

from pallas_kernels.fp8 import FP8_NAMES, to_pool_dtype
from pallas_kernels.gpu import ragged_paged_attention_gpu
from pallas_kernels.reference import ragged_paged_attention_reference

logger = logging.getLogger("benchmarks.kernel")

FULL = dict(batches=(8, 32, 128), contexts=(512, 2048, 8192), block_size=16, q_heads=32, kv_heads=8, head_dim=128,
            mixed=[dict(prefills=4, prefill_context=2048, chunk=512, decodes=60, decode_context=2048)])
# SmolLM2-135M's heads; 64 sequences of 160 / 256 tokens (640 / 1024 blocks in use), the throughput workload's range
# and one prefill step of the workload's shape: 13 whole prompts of 157 tokens (2041 tokens)
# The pool of those cases fits in the CPU's caches (8-12 MB); `layered`: the engine's case, a decode step over 30
# layers (the throughput workload's mid-decode batch), whose 240 MB of K/V come from memory, timed per layer;
# `mixed`: a serving step while a long prompt arrives (benchmarks/serving.py's interference run): 16 streams decoding
# and a 64-, 16- or 4-token chunk (4: the serving pacer's smallest) at the end of a 1536-token prompt, over 30 layers
# as in the engine (the long prompt's K/V come from memory), timed per layer; the reference runs once there, for
# its output only (seconds per call over 30 layers).
CPU = dict(batches=(64,), contexts=(160, 256), block_size=16, q_heads=9, kv_heads=3, head_dim=64,
           mixed=[dict(prefills=1, prefill_context=1536, chunk=c, decodes=16, decode_context=360, layers=30)
                  for c in (64, 16, 4)],
           prefill=dict(prompts=13, length=157), layered=dict(batch=48, context=210, layers=30))
SMOKE = dict(batches=(2, 4), contexts=(32, 64), block_size=16, q_heads=4, kv_heads=2, head_dim=64,
             mixed=[dict(prefills=2, prefill_context=48, chunk=16, decodes=3, decode_context=40)])


def make_batch(seqs: list[tuple[int, int]], *, tile: int, block_size: int, q_heads: int, kv_heads: int,
               head_dim: int, dtype, seed: int = 0, layers: int = 1, kv_dtype=None) -> dict:
    """A ragged batch over a pool of exactly the blocks it uses (in each of `layers` layers), assigned in shuffled
    order.

    seqs: (context_len, q_len) per sequence. Returns the reference's arguments plus layout facts.
    """
    rng = np.random.default_rng(seed)
    per_seq = [-(-ctx // block_size) for ctx, _ in seqs]
    num_blocks = 1 + sum(per_seq)  # block 0 is the null block
    width = max(per_seq)
    ids = rng.permutation(np.arange(1, num_blocks)).astype(np.int32)
    tables = np.zeros((len(seqs), width), np.int32)
    qsl, positions, start = [0], [], 0
    for i, (ctx, q_len) in enumerate(seqs):
        tables[i, :per_seq[i]] = ids[start:start + per_seq[i]]
        start += per_seq[i]
        length = -(-q_len // tile) * tile
        positions += list(range(ctx - q_len, ctx)) + [-1] * (length - q_len)
        qsl.append(qsl[-1] + length)
    kq, kk, kv = jax.random.split(jax.random.key(seed), 3)
    pool_shape = (layers, num_blocks, block_size, kv_heads, head_dim)  # [L, NB, BS, Hkv, D]

    def pool(key):  # an fp8 pool: normal values saturated and rounded (pallas_kernels/fp8.py)
        if kv_dtype is None or kv_dtype == dtype:
            return jax.random.normal(key, pool_shape, dtype)
        return to_pool_dtype(jax.random.normal(key, pool_shape, jnp.float32), kv_dtype)

    return dict(
        q=jax.random.normal(kq, (len(positions), q_heads, head_dim), dtype), k_cache=pool(kk), v_cache=pool(kv),
        block_tables=jnp.asarray(tables), context_lens=jnp.asarray([c for c, _ in seqs], jnp.int32),
        query_start_loc=jnp.asarray(qsl, jnp.int32), positions=jnp.asarray(positions, jnp.int32),
        tile=tile, decode_blocks=sum(per_seq), scale=1.0 / math.sqrt(head_dim))


def min_bytes(batch: dict) -> int:
    """K/V of every sequence's context read once, q read, output written."""
    q, k = batch["q"], batch["k_cache"]
    kv_heads, head_dim = k.shape[3], k.shape[4]
    kv = int(np.sum(np.asarray(batch["context_lens"]))) * kv_heads * head_dim * 2 * k.dtype.itemsize
    real_tokens = int(np.sum(np.asarray(batch["positions"]) >= 0))
    return kv + 2 * real_tokens * q.shape[1] * head_dim * q.dtype.itemsize


def copy_bandwidth(num_bytes: int, **timing) -> float:
    """Bytes per second of a read + write of one large array on the default device (on CPU: numpy's copy, which
    reaches memory bandwidth where XLA CPU's elementwise loop does not)."""
    if jax.default_backend() == "cpu":
        a = np.ones(num_bytes // 4, np.float32)
        b = np.empty_like(a)
        return 2 * a.nbytes / time_call(lambda: np.copyto(b, a), (), **timing)
    x = jnp.ones(num_bytes // 4, jnp.float32)
    seconds = time_call(jax.jit(lambda a: a + 1.0), (x,), **timing)
    return 2 * x.nbytes / seconds


def implementations(batch: dict, *, decode: bool, interpret: bool, cpu: bool = False) -> dict:
    """name -> (jitted fn, args); the bundled kernel only for decode batches; with cpu, the reference and native."""
    common = dict(scale=batch["scale"], tile_size=batch["tile"])
    args = (batch["q"], batch["k_cache"], batch["v_cache"], jnp.int32(0), batch["block_tables"],
            batch["context_lens"], batch["query_start_loc"], batch["positions"])
    flat = dict(decode_blocks=batch["decode_blocks"]) if decode else {}
    if cpu:
        from pallas_kernels.cpu_native import paged_attention_native

        layers = batch["k_cache"].shape[0]

        def every_layer(fn):  # as the step runs it: one call per layer in a fori_loop (the sum keeps each live)
            def run(q, k, v, _layer, *rest):
                return jax.lax.fori_loop(0, layers, lambda i, acc: acc + fn(q, k, v, i, *rest), jnp.zeros_like(q))
            return run

        return {name: (jax.jit(every_layer(functools.partial(fn, **common, **flat))), args) for name, fn in
                (("reference", ragged_paged_attention_reference), ("native_cpu", paged_attention_native))}
    impls = {
        "reference": (jax.jit(functools.partial(ragged_paged_attention_reference, **common, **flat)), args),
        "pallas_gpu": (jax.jit(functools.partial(ragged_paged_attention_gpu, **common, **flat,
                                                 interpret=interpret)), args),
    }
    if decode:  # the same kernel without flash-decoding splits, to see what they buy at each size
        impls["pallas_gpu_1split"] = (jax.jit(functools.partial(ragged_paged_attention_gpu, **common, **flat,
                                                                num_kv_splits=1, interpret=interpret)), args)
    if decode:
        from jax.experimental.pallas.ops.gpu.paged_attention import paged_attention as bundled

        # Its layout: k/v pages [Hkv, NB, BS, D]; converted once, outside the timing.
        k_pages = jnp.transpose(batch["k_cache"][0], (2, 0, 1, 3))
        v_pages = jnp.transpose(batch["v_cache"][0], (2, 0, 1, 3))
        pages = batch["block_tables"].shape[1]
        k_splits = math.gcd(16, pages)  # it needs pages per sequence divisible by k_splits

        def run_bundled(q, k_pages, v_pages, tables, lengths):
            return bundled(q * jnp.asarray(batch["scale"], q.dtype), k_pages, v_pages, tables, lengths,
                           k_splits=k_splits, interpret=interpret)

        impls["jax_bundled"] = (jax.jit(run_bundled), (batch["q"], k_pages, v_pages, batch["block_tables"],
                                                       batch["context_lens"]))
    return impls


def run_case(name: str, batch: dict, *, decode: bool, interpret: bool, copy_bw: float, timing: dict,
             cpu: bool = False, untimed: frozenset[str] = frozenset()) -> list[dict]:
    """One row per implementation; those in `untimed` run once, for the output comparison only."""
    rows, outputs = [], {}
    nbytes = min_bytes(batch)
    layers = batch["k_cache"].shape[0] if cpu else 1  # on CPU each call runs every layer: times are per layer
    for impl, (fn, args) in implementations(batch, decode=decode, interpret=interpret, cpu=cpu).items():
        row = {"case": name, "impl": impl, "bytes": nbytes}
        try:
            outputs[impl] = jax.block_until_ready(fn(*args))
            if impl in untimed:
                rows.append(row)
                continue
            seconds = time_call(fn, args, **timing) / layers
            row.update(us=seconds * 1e6, gb_s=nbytes / seconds / 1e9, of_copy=nbytes / seconds / copy_bw)
        except Exception as e:  # e.g. the reference running out of device memory at batch 128 x 8192
            logger.warning("%s / %s failed: %s", name, impl, str(e).splitlines()[0][:200])
            row["error"] = type(e).__name__
        rows.append(row)
    if "reference" in outputs:
        want = np.asarray(outputs["reference"], np.float32)
        valid = np.asarray(batch["positions"]) >= 0
        for row in rows:
            if row["impl"] in outputs and row["impl"] != "reference":
                got = np.asarray(outputs[row["impl"]], np.float32)
                row["max_err"] = float(np.abs(got[valid] - want[valid]).max())
    return rows


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--smoke", action="store_true", help="tiny sizes; kernels in interpret mode; runs on CPU")
    ap.add_argument("--cpu", action="store_true",
                    help="CPU decode and prefill: reference vs the native kernel, SmolLM2 shapes")
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--samples", type=int, default=30)
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    ap.add_argument("--kv-dtype", default=None, choices=list(FP8_NAMES), help="an fp8 pool (default: --dtype)")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")

    device = jax.devices()[0]
    on_gpu = device.platform == "gpu"
    if not on_gpu and not (args.smoke or args.cpu):
        raise SystemExit(f"no GPU here ({device.platform}); the real run needs one. Use --smoke to check the script, "
                         "--cpu for the CPU kernels.")
    cfg = SMOKE if args.smoke else CPU if args.cpu else FULL
    interpret = not on_gpu
    timing = dict(warmup=1, samples=3, reps=1) if args.smoke else dict(warmup=args.warmup, samples=args.samples,
                                                                       reps=args.reps)
    dtype = jnp.dtype(args.dtype)
    kv_dtype = FP8_NAMES[args.kv_dtype] if args.kv_dtype else dtype
    shape = dict(block_size=cfg["block_size"], q_heads=cfg["q_heads"], kv_heads=cfg["kv_heads"],
                 head_dim=cfg["head_dim"], dtype=dtype, kv_dtype=kv_dtype)
    copy_bw = copy_bandwidth((1 << 30) if on_gpu else (1 << 28) if args.cpu else (1 << 24), **timing)
    logger.info("device %s: copy bandwidth %.0f GB/s", device.device_kind, copy_bw / 1e9)

    rows = []
    for batch_size in cfg["batches"]:
        for ctx in cfg["contexts"]:
            batch = make_batch([(ctx, 1)] * batch_size, tile=1, **shape)
            rows += run_case(f"decode b={batch_size} ctx={ctx}", batch, decode=True, interpret=interpret,
                             copy_bw=copy_bw, timing=timing, cpu=args.cpu)
            del batch
    pf = cfg.get("prefill")
    if pf:  # whole prompts, 16-token tiles (the reference's prefill layout; the native kernel takes any)
        prefill = make_batch([(pf["length"], pf["length"])] * pf["prompts"], tile=16, **shape)
        rows += run_case(f"prefill {pf['prompts']}x{pf['length']} tokens", prefill, decode=False,
                         interpret=interpret, copy_bw=copy_bw, timing=timing, cpu=args.cpu)
    lay = cfg.get("layered")
    if lay:
        batch = make_batch([(lay["context"], 1)] * lay["batch"], tile=1, layers=lay["layers"], **shape)
        rows += run_case(f"decode b={lay['batch']} ctx={lay['context']}, {lay['layers']} layers (per layer)", batch,
                         decode=True, interpret=interpret, copy_bw=copy_bw, timing=timing, cpu=args.cpu)
        del batch
    for m in cfg["mixed"]:
        seqs = [(m["prefill_context"], m["chunk"])] * m["prefills"] + [(m["decode_context"], 1)] * m["decodes"]
        layers = m.get("layers", 1)
        mixed = make_batch(seqs, tile=16, layers=layers, **shape)
        name = f"mixed {m['prefills']}x{m['chunk']} prefill + {m['decodes']} decodes"
        rows += run_case(name + (f", {layers} layers (per layer)" if layers > 1 else ""), mixed, decode=False,
                         interpret=interpret, copy_bw=copy_bw, timing=timing, cpu=args.cpu,
                         untimed=frozenset({"reference"}) if layers > 1 else frozenset())
        del mixed

    print(f"\n{device.device_kind}: copy bandwidth {copy_bw / 1e9:.0f} GB/s; {cfg['q_heads']} q / {cfg['kv_heads']} "
          f"kv heads, head_dim {cfg['head_dim']}, block {cfg['block_size']}, {dtype.name}, pool {kv_dtype.name}"
          + (" (smoke: interpret mode, timings meaningless)" if args.smoke else ""))
    print_table(rows, [("case", "case", ""), ("impl", "implementation", ""), ("us", "us/call", ".1f"),
                       ("gb_s", "GB/s", ".0f"), ("of_copy", "of copy bw", ".0%"), ("max_err", "max |diff| vs ref",
                                                                                      ".2e"), ("error", "error", "")])
    out = args.out or (f"benchmarks/results/kernel{'_smoke' if args.smoke else '_cpu' if args.cpu else ''}"
                       f"{'_' + args.kv_dtype if args.kv_dtype else ''}.json")
    write_json(out, {"machine": f"{device.device_kind} ({device.platform}), jax {jax.__version__}",
                     "smoke": args.smoke, "dtype": dtype.name, "kv_dtype": kv_dtype.name, "config": cfg,
                     "copy_bandwidth_gb_s": copy_bw / 1e9,
                     "timing": timing, "rows": rows})


if __name__ == "__main__":
    main()
