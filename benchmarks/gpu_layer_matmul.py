"""The GPU layer matmul (pallas_kernels/gpu_matmul.py, and gpu_qmatmul.py's int8 per-channel kernel) against XLA's
GEMM, at the decode step's shapes of Llama-3.2-1B and Llama-3-8B, on a GPU. Needs one: elsewhere it says so and
exits 0 (nothing is timed).

For each layer matrix (q, k, v, o, gate/up, down: x [M, K] @ W[l] [K, N]) and row count M (64, 128, 256: the decode
batches the kernel takes, `step.GPU_LAYER_MATMUL_ROWS`), one jitted call multiplies by every layer of a stacked
weight of --layers layers in a `fori_loop` whose layer index is traced, as the engine's layer loop does:
  * XLA own     L weights of their own, unrolled: XLA's GEMM with nothing sliced (the best case for XLA);
  * XLA sliced  the stacked weight indexed by the loop's layer: what the engine ran before the kernel (XLA GPU
                copies the slice to a buffer of its own first: benchmarks/gpu_step_hlo.py);
  * kernel      the Pallas kernel on the stack and the layer, its tiles `gpu_matmul.layer_tiles(M, N)`, and each of
                --tiles;
  * int8 kernel the per-channel int8 kernel (`qmatmul_gpu(channel=True)`: x in bf16) on the stack's codes (--int8):
                the engine's int8 decode steps on CUDA;
  * int8 w8a8 kernel  the same weights times x quantized to int8 per block of 32, on the int8 tensor cores
                (pallas_kernels/gpu_w8a8.py, which the engine does not run; --int8), at its tiles and at
                each of --tiles' tm, tn and warps. Its error against XLA own includes the activations' rounding;
  * int8 XLA own      L int8 weights of their own, stored signed ([N, K] int8 and a scale per column): XLA's
                GEMM with the int8 -> bf16 convert in its operand, x in bf16 (--int8);
  * int8 XLA w8a8 own the same weights times x quantized to int8 per row (dynamic per token, as vLLM's W8A8 int8),
                XLA's int8 x int8 -> int32 dot, then both scales (--int8). These two say what XLA's own GEMMs make
                of int8 weights (whether they can beat bf16's at these rows), without any copy in the way.
Each is timed as the median of --samples samples of --reps calls (common.time_call). Reported per product: us,
TFLOP/s, the weight bytes over the time (GB/s) and as a share of a measured copy bandwidth, and the largest
difference from `XLA own` relative to the largest |output|. What the numbers are for: the kernel's tiles were
reasoned, not tuned (pallas_kernels/gpu_matmul.py); this picks them.

    python benchmarks/gpu_layer_matmul.py                              # -> benchmarks/results/gpu_layer_matmul.json
    python benchmarks/gpu_layer_matmul.py --tiles 128,128,64,8 64,256,64,8 --rows 256 --budget-s 60
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import jax
import jax.numpy as jnp

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))
sys.path.insert(0, HERE)
from common import print_table, time_call  # noqa: E402
from gpu_qmatmul import NOMINAL_GB_S, add_timing_arguments, relative_error, start_timing, write_results  # noqa: E402

from jaxpaged.models.quant import quantize_int8  # noqa: E402
from pallas_kernels.gpu_matmul import layer_matmul_gpu, layer_tiles  # noqa: E402
from pallas_kernels.gpu_qmatmul import qmatmul_gpu, tiles  # noqa: E402
from pallas_kernels.gpu_w8a8 import w8a8_matmul_gpu  # noqa: E402

# (K, N) of each layer matrix at the two shapes (q/k/v and gate/up as the model multiplies them: one product each)
SHAPES = {"1b q": (2048, 2048), "1b k/v": (2048, 512), "1b gate/up": (2048, 8192), "1b down": (8192, 2048),
          "8b q/o": (4096, 4096), "8b k/v": (4096, 1024), "8b gate/up": (4096, 14336), "8b down": (14336, 4096)}
ROWS = (256, 128, 64)


def signed_layers(q8, k: int) -> list:
    """A stacked int8 `QuantizedWeight` as each layer's own signed codes [N, K] int8 and column scales [N]."""
    return [((q8.codes[i].astype(jnp.int32) - 128).astype(jnp.int8)[:, :k], q8.scales[i])
            for i in range(q8.codes.shape[0])]


def w8a8_per_row(x: jax.Array, q: jax.Array, scales: jax.Array) -> jax.Array:
    """x [M, K] quantized to int8 per row (d = max|x| / 127), times q [N, K] int8 on XLA's int8 dot into int32, times
    d and each column's scale -> [M, N] float32."""
    d = jnp.max(jnp.abs(x.astype(jnp.float32)), axis=1, keepdims=True) / 127.0  # [M, 1]
    xq = jnp.round(x.astype(jnp.float32) / jnp.where(d > 0, d, 1.0)).astype(jnp.int8)
    acc = jax.lax.dot_general(xq, q, (((1,), (1,)), ((), ())), preferred_element_type=jnp.int32)
    return acc.astype(jnp.float32) * d * scales


def ways(tile_variants, int8: bool) -> dict:
    """name -> jitted fn(x, stack, own) summing x @ layer l's weight over the layers, each product its own op."""
    def looped(product):
        def run(x, stack, own):
            def body(layer, acc):
                return acc + product(x, stack, layer)
            quantized = hasattr(stack, "codes")  # int8: codes [L, N, K]
            n, layers = (stack.n, stack.codes.shape[0]) if quantized else (stack.shape[-1], stack.shape[0])
            return jax.lax.fori_loop(0, layers, body, jnp.zeros((x.shape[0], n), jnp.float32))
        return jax.jit(run)

    def own(x, stack, own):
        return sum(jnp.dot(x, w, preferred_element_type=jnp.float32) for w in own)

    out = {"XLA own": jax.jit(own),
           "XLA sliced": looped(lambda x, w, layer: jnp.dot(x, w[layer], preferred_element_type=jnp.float32))}
    for tile in [None, *tile_variants]:
        name = "kernel" + ("" if tile is None else " {},{},{},{}".format(*tile))
        out[name] = looped(lambda x, w, layer, tile=tile: layer_matmul_gpu(x, w, layer, tile=tile))
    if int8:
        out["int8 kernel"] = looped(lambda x, q, layer: qmatmul_gpu(x, q.codes, q.scales, layer, bits=8,
                                                                    pair=False, channel=True))
        out["int8 XLA own"] = jax.jit(lambda x, own8, _: sum(
            jax.lax.dot_general(x, q.astype(x.dtype), (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32)
            * s for q, s in own8))
        out["int8 XLA w8a8 own"] = jax.jit(lambda x, own8, _: sum(w8a8_per_row(x, q, s) for q, s in own8))
        for tile in [None, *tile_variants]:  # its tiles: the variants' tm, tn and warps (its K step is one block)
            name = "int8 w8a8 kernel" + ("" if tile is None else f" {tile[0]},{tile[1]},{tile[3]}")
            out[name] = looped(lambda x, q, layer, tile=tile: w8a8_matmul_gpu(
                x, q.codes, q.scales, layer, tile=None if tile is None else (tile[0], tile[1], tile[3])))
    return out


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shapes", nargs="+", default=list(SHAPES), choices=list(SHAPES))
    parser.add_argument("--rows", nargs="+", type=int, default=list(ROWS))
    parser.add_argument("--layers", type=int, default=8,
                        help="layers of the stacked weight (8: 67-940 MB, mostly beyond the card's 50 MB L2)")
    parser.add_argument("--int8", action="store_true", help="time the int8 per-channel kernel too")
    add_timing_arguments(parser, reps=10, out="gpu_layer_matmul.json")
    args = parser.parse_args()
    started = start_timing(args, "gpu_layer_matmul.py", "tests/kernels/test_gpu_matmul.py")
    if started is None:
        return
    (timing, tile_variants, copy_bw, start), device = started, jax.devices()[0]
    rows, skipped = [], []
    for m in args.rows:  # the largest decode batch first: the engine's rows at 256 sequences
        for shape in args.shapes:
            if args.budget_s is not None and time.perf_counter() - start > args.budget_s:
                skipped.append(f"{shape} M={m}")
                continue
            k, n = SHAPES[shape]
            stack = jax.random.normal(jax.random.key(m), (args.layers, k, n), jnp.bfloat16) * 0.02
            own = [stack[i] + 0 for i in range(args.layers)]  # arrays of their own
            q8 = quantize_int8(stack) if args.int8 else None
            own8 = signed_layers(q8, k) if args.int8 else None
            x = jax.random.normal(jax.random.key(1), (m, k), jnp.bfloat16)
            fns = ways(tile_variants, args.int8)
            want = fns["XLA own"](x, stack, own)
            for way, fn in fns.items():
                w = own8 if way.startswith("int8 XLA") else q8 if way.startswith("int8") else stack
                seconds = time_call(fn, (x, w, own), **timing) / args.layers  # per product
                weight = k * n * (1 if way.startswith("int8") else 2)
                rows.append({"shape": shape, "k": k, "n": n, "m": m, "way": way,
                             "tile": (list(layer_tiles(m, n)) if way == "kernel" else list(tiles(m))
                                      if way in ("int8 kernel", "int8 w8a8 kernel") else None),
                             "us": seconds * 1e6, "tflops": 2 * m * k * n / seconds / 1e12,
                             "gb_s": weight / seconds / 1e9, "of_copy": weight / seconds / copy_bw,
                             "rel_err": relative_error(fn(x, w, own), want) if way != "XLA own" else None})
            del stack, own, q8
    base = {(r["shape"], r["m"]): r["us"] for r in rows if r["way"] == "XLA own"}
    for r in rows:
        r["x_xla_own"] = base[(r["shape"], r["m"])] / r["us"]
    nominal = NOMINAL_GB_S.get(device.device_kind)
    print(f"\n{device.device_kind}: copy bandwidth {copy_bw / 1e9:.0f} GB/s, nominal {nominal or '?'} GB/s; "
          f"jax {jax.__version__}; per product, {args.layers} layers a call")
    print_table(rows, [("shape", "shape", "s"), ("m", "M", "d"), ("way", "way", "s"), ("us", "us/product", ".1f"),
                       ("tflops", "TFLOP/s", ".0f"), ("gb_s", "weight GB/s", ".0f"), ("of_copy", "of copy bw", ".0%"),
                       ("x_xla_own", "x XLA own", ".2f"), ("rel_err", "rel. err", ".1e")])
    if skipped:
        print(f"not timed (--budget-s {args.budget_s}): {', '.join(skipped)}")
    write_results(args, device, copy_bw, timing, rows, skipped)
    if any(r["rel_err"] is not None and r["rel_err"] > 2e-2 for r in rows):
        print("ERROR: a kernel differs from XLA's product beyond bf16 rounding")
        sys.exit(1)


if __name__ == "__main__":
    main()
