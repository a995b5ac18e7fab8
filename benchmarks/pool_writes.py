"""Writes into the KV pool on CPU: XLA's scatter against the native kernel's aliased writes, float32 and bfloat16.

Three operations on a SmolLM2-shaped pool (30 layers, 3 kv heads, head_dim 64, block 16, --num-blocks blocks),
each jitted with the pool donated, as the engine runs them:
  * row write: one step's K/V rows (--tokens tokens) into every layer, inside a fori_loop over the layers
    (`write_kv_reference` vs `write_kv_native`);
  * block copy: copy-on-write of 8 blocks in every layer (`model_runner._copy_blocks`);
  * block write: a swap-in of 8 host blocks (`model_runner._write_blocks`).
XLA CPU's scatter has no 16-bit path: into a bfloat16 pool it converts the whole pool to float32 and back, which is
why the engine kept float32 pools on CPU before the native writes. Median of --runs calls after one warm-up.

    python benchmarks/pool_writes.py      # -> benchmarks/results/pool_writes.json
"""

from __future__ import annotations

import argparse
import functools
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np
from common import write_json
from step_anatomy import cpu_name

from jaxpaged.worker.attention import KVPool
from jaxpaged.worker.model_runner import _copy_blocks, _write_blocks, jit_pool_update
from pallas_kernels.cpu_native import available, set_blocks_native, write_kv_native
from pallas_kernels.reference import write_kv_reference


def median_ms(fn, pool, *args, runs: int) -> tuple[float, KVPool]:
    pool = fn(pool, *args)  # warm-up (compiles)
    jax.block_until_ready(pool)
    times = []
    for _ in range(runs):
        t = time.perf_counter()
        pool = fn(pool, *args)
        jax.block_until_ready(pool)
        times.append(time.perf_counter() - t)
    return 1e3 * statistics.median(times), pool


def row_write(write, num_layers: int):
    def step(pool: KVPool, k_new, v_new, slots) -> KVPool:
        def body(i, kv):
            return write(*kv, i, k_new, v_new, slots)
        return KVPool(*jax.lax.fori_loop(0, num_layers, body, (pool.k, pool.v)))
    return jax.jit(step, donate_argnums=(0,))


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--num-blocks", type=int, default=2000)
    ap.add_argument("--tokens", type=int, default=64, help="rows of one row write (a decode step of 64 sequences)")
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--out", default="benchmarks/results/pool_writes.json")
    args = ap.parse_args()
    if not available("attention"):
        raise SystemExit("the native CPU attention kernel (its pool writes) is unavailable here; nothing to compare")
    layers, block, heads, dim = 30, 16, 3, 64
    shape = (layers, args.num_blocks, block, heads, dim)
    rng = np.random.default_rng(0)
    rows = rng.standard_normal((args.tokens, heads, dim)).astype(np.float32)
    slots = rng.choice(args.num_blocks * block, args.tokens, replace=False).astype(np.int32)
    host_blocks = rng.standard_normal((layers, 8, block, heads, dim)).astype(np.float32)
    src, dst = np.arange(1, 9, dtype=np.int32), np.arange(100, 108, dtype=np.int32)
    results = []
    for dtype in (jnp.float32, jnp.bfloat16):
        for name, native in (("XLA scatter", False), ("native", True)):
            pool = KVPool(jnp.zeros(shape, dtype), jnp.zeros(shape, dtype))
            setter = set_blocks_native if native else None
            ops = {
                "row write (all layers)": (row_write(write_kv_native if native else write_kv_reference, layers),
                                           (jnp.asarray(rows, dtype), jnp.asarray(rows, dtype), slots)),
                "block copy (8 blocks)": (jit_pool_update(functools.partial(_copy_blocks, set_blocks=setter), None,
                                                          num_args=3), (src, dst)),
                "block write (8 blocks)": (jit_pool_update(functools.partial(_write_blocks, set_blocks=setter), None,
                                                           num_args=4),
                                           (dst, jnp.asarray(host_blocks, dtype), jnp.asarray(host_blocks, dtype))),
            }
            for op, (fn, op_args) in ops.items():
                ms, pool = median_ms(fn, pool, *op_args, runs=args.runs)
                results.append({"dtype": jnp.dtype(dtype).name, "write": name, "op": op, "ms": ms})
    cpu = cpu_name()
    print(f"CPU: {cpu}; pool {shape} per K and V")
    print(f"{'op':<24} {'dtype':<9} {'XLA scatter ms':>15} {'native ms':>10}")
    for op in dict.fromkeys(r["op"] for r in results):
        for dtype in ("float32", "bfloat16"):
            by = {r["write"]: r["ms"] for r in results if r["op"] == op and r["dtype"] == dtype}
            print(f"{op:<24} {dtype:<9} {by['XLA scatter']:>15.2f} {by['native']:>10.2f}")
    write_json(args.out, {"cpu": cpu, "pool_shape": shape, "tokens": args.tokens, "results": results})


if __name__ == "__main__":
    main()
