"""What XLA makes of the engine's decode step for a GPU, compiled without one (deviceless AOT), read from its HLO.

The step (jaxpaged.worker.step, the model's layer loop, the Pallas GPU attention kernel) at Llama-3.2-1B's and
Llama-3-8B's shapes, a decode batch of 256 sequences, compiled for an H200 (benchmarks/target_configs/h200.txtpb)
with the GPU layer matmul (pallas_kernels/gpu_matmul.py) on and off. Printed for each: the layer loop's body,
op by op (it runs once per layer), and the bytes of the weight copies its ops make per layer beside the layer's
weight bytes. An op that writes a copy of a weight (a dynamic-slice of the stack, a concatenation of two weights)
is the weight's bytes read and written once more before the GEMM reads them, on a decode step that is bound by
reading the weights. Also counted: the step's conditionals, each of which makes the host wait for the device on a
GPU (none since the engine splits the sampler from the step there, jaxpaged.worker.step). `--formats bf16
fp8kv+int8` compiles the quantized formats too.

Not a timing: XLA's GEMM configs here are its defaults (nothing is autotuned without a GPU), so which ops exist is
what this shows, not how fast they run. Needs the CUDA PJRT plugin in a venv of its own (benchmarks/quant_fusion.py
says how): `JAX_PLATFORMS=cpu PYTHONPATH=. /work/fusion-venv/bin/python benchmarks/gpu_step_hlo.py`.
"""

from __future__ import annotations

import argparse
import functools
import math
import os
import re
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))
sys.path.insert(0, HERE)

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from common import RESULTS_DIR, print_table, write_json  # noqa: E402
from gpu_throughput import FORMATS, SHAPES  # noqa: E402
from quant_fusion import device, devices  # noqa: E402

from tests.hlo_checks import computations  # noqa: E402

BYTES = {"bf16": 2, "f16": 2, "f32": 4, "s32": 4, "u32": 4, "s8": 1, "u8": 1, "pred": 1}
SKIP = ("parameter", "get-tuple-element", "tuple", "constant", "bitcast")


def compile_decode_step(model: str, seqs: int, kernel_rows: int, target: str, fmt: str = "bf16",
                        split_sampler: bool = True, tp: int = 1, gpu_loop: str = "kernel") -> str:
    """The compiled HLO of a decode step of `seqs` sequences at `model`'s shapes (random weights, nothing allocated:
    ShapeDtypeStructs on the target device), the GPU layer matmul on up to kernel_rows rows. fmt: one of
    gpu_throughput.FORMATS (fp8kv: a float8_e4m3fn pool with per-layer scales 1.0 and rotated keys, as the engine
    builds it; int8: the weights quantized per channel, `jaxpaged.quantize`). split_sampler: the sampler left out of
    the step, as the engine runs it on a GPU (jaxpaged.worker.step). tp > 1: split over a mesh of tp such GPUs as
    the engine splits it (`jaxpaged.parallel.tensor_parallel`; the step's kernel rows as the engine sets them).
    gpu_loop: `jaxpaged.worker.step.gpu_layer_loop`'s way, with the compiler options the engine gives it on a GPU."""
    from flax import nnx

    from jaxpaged.models.llama import LlamaForCausalLM
    from jaxpaged.models.quantize import quantize
    from jaxpaged.worker.attention import KVPool, PagedAttention, gpu_splits
    from jaxpaged.worker.input_batch import EXTRAS, StepLayout, extra_shapes
    from jaxpaged.worker.kv_quant import KVScales
    from jaxpaged.worker.step import UNROLLED_GPU_OPTIONS, jit_step, step_matmul_precision
    from pallas_kernels.attention import paged_attention
    from pallas_kernels.gpu import SUPPORTED_HEAD_DIMS
    from pallas_kernels.validation import KERNEL_DTYPES

    config = SHAPES[model]
    options = FORMATS[fmt]

    def build():
        module = LlamaForCausalLM(config, rngs=nnx.Rngs(0), dtype=jnp.bfloat16)
        return quantize(module, options.get("quantization"))

    graphdef, state = nnx.split(nnx.eval_shape(build))
    mesh = None
    if tp > 1:
        from jaxpaged.parallel import tensor_parallel as tpl

        mesh = jax.sharding.Mesh(devices(target, tp), (tpl.AXIS,))
        sharding = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
        specs = tpl.llama_partition_specs(nnx.to_pure_dict(state), tp)
        spec_state = nnx.State(state)  # the same tree with a spec at each leaf
        nnx.replace_by_pure_dict(spec_state, specs)
        leaf_specs = jax.tree.leaves(spec_state, is_leaf=lambda x: isinstance(x, jax.sharding.PartitionSpec))
        leaves, treedef = jax.tree.flatten(state)
        leaves = tuple(jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=jax.sharding.NamedSharding(mesh, spec))
                       for x, spec in zip(leaves, leaf_specs, strict=True))
        pool_sharding = tpl.pool_sharding(mesh)
    else:
        sharding = pool_sharding = jax.sharding.SingleDeviceSharding(device(target))
        leaves, treedef = jax.tree.flatten(state)
        leaves = tuple(jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sharding) for x in leaves)
    fp8 = options.get("kv_cache_dtype") == "fp8"
    attn = PagedAttention("pallas_gpu", functools.partial(paged_attention, implementation="pallas_gpu"),
                          KERNEL_DTYPES, SUPPORTED_HEAD_DIMS, kernel_variant=gpu_splits,
                          kv_scales=KVScales.uniform(config.num_layers) if fp8 else None)
    if mesh is not None:
        attn = tpl.ShardedAttention(attn, mesh)
    width, max_len = 128, 2048  # block tables of 2048 tokens in 16-token blocks
    blocks = seqs * width
    pool = KVPool(*(jax.ShapeDtypeStruct((config.num_layers, blocks + 1, 16, config.num_kv_heads, config.head_dim),
                                         jnp.float8_e4m3fn if fp8 else jnp.bfloat16, sharding=pool_sharding)
                          for _ in range(2)))
    layout = StepLayout(seqs, seqs, width, 1, blocks // 4, 0, True)  # a quarter of the tables in use
    sds = functools.partial(jax.ShapeDtypeStruct, sharding=sharding)
    extras = tuple(sds(shape, e.dtype) for e, shape in zip(EXTRAS, extra_shapes(seqs, config.vocab_size, max_len),
                                                             strict=True))
    if mesh is None:
        step = jit_step(graphdef, treedef, attn, None, seqs, gpu_rows=kernel_rows, split_sampler=split_sampler,
                        gpu_loop=gpu_loop)
    else:
        step = jit_step(graphdef, treedef, attn, pool_sharding, seqs, mesh=mesh,
                        leaf_shardings=tuple(x.sharding for x in leaves), gpu_rows=kernel_rows,
                        split_sampler=split_sampler, gpu_loop=gpu_loop)
    with jax.default_matmul_precision(step_matmul_precision(leaves)):
        lowered = step.lower(leaves, pool, sds((seqs,), jnp.int32), sds((layout.size,), jnp.int32), extras, (), (),
                             layout)
    # (step_compiler_options reads the default backend, the CPU here: the GPU's option for an unrolled loop given)
    options = dict(UNROLLED_GPU_OPTIONS) if gpu_loop == "unrolled" else {}
    return lowered.compile(options).as_text()


def layer_loop_ops(hlo: str, pool_dims: str) -> list[dict]:
    """The ops of the while loop whose carry holds the pool (the layer loop), or with the loop unrolled the step's
    entry computation (every layer's ops): name, op, kind, output type and its size in MB (for the pool's in-place
    K/V writes that is the whole pool, of which they write a few rows)."""
    comps = computations(hlo)
    loop = next((line for lines in comps.values() for line in lines if " while(" in line and pool_dims in line), None)
    if loop is None:
        body = re.search(r"^ENTRY %(\S+) ", hlo, re.M).group(1)
    else:
        body = re.search(r"body=%([\w.\-]+)", loop).group(1)
    rows = []
    for line in comps[body]:
        m = re.match(r"\s*(?:ROOT )?%(\S+) = (\([^=]*\)|\S+) ([\w\-$]+)\(", line)
        if not m or m.group(3) in SKIP:
            continue
        kind = re.search(r"kind=(\w+)", line)
        what = re.search(r'custom_call_target="([^"]+)"|"name":"(\w+)"', line)
        arrays = re.findall(r"(\w+)\[([\d,]*)\]", m.group(2))
        written = sum(BYTES.get(t, 4) * math.prod(int(d) for d in dims.split(",") if d) for t, dims in arrays)
        rows.append({"op": m.group(1), "opcode": m.group(3), "kind": kind.group(1) if kind else "",
                     "what": next((g for g in what.groups() if g), "") if what else "",
                     "output": m.group(2)[:60], "output_mb": written / 1e6})
    return rows


def weight_copies(rows: list[dict], pool_dims: str, seqs: int) -> list[dict]:
    """The body's ops that write a copy of a layer's weight: an output of one layer's slice of a stack ([1, K, N], any
    dtype: a dynamic-slice, or int8 codes rewritten on their way to the GEMM), or a concatenation of bf16 weights,
    over 1 MB (not the pool's in-place writes, not the activations of the step's `seqs` rows)."""
    def copies(r):
        out = r["output"]
        if pool_dims in out or r["output_mb"] <= 1.0:
            return False
        layer_slice = re.match(r"\w+\[1,\d+,\d+\]", out) is not None
        concatenated = out.startswith("bf16[") and not out.startswith(f"bf16[{seqs},") and "concatenate" in r["op"]
        return layer_slice or concatenated

    return [r for r in rows if copies(r)]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", nargs="+", default=["1b", "8b"], choices=["1b", "8b"])
    ap.add_argument("--target", default="h200", choices=["h100", "h200"])
    ap.add_argument("--seqs", type=int, default=256)
    ap.add_argument("--formats", nargs="+", default=["bf16"], choices=list(FORMATS),
                    help="KV cache and weight formats (benchmarks/gpu_throughput.py's)")
    ap.add_argument("--tp", type=int, default=1, help="tensor parallel over this many GPUs of --target")
    ap.add_argument("--out", default=None, help="default: results/gpu_step_hlo.json (_tp<N> with --tp)")
    args = ap.parse_args()
    from jaxpaged.worker.step import GPU_LAYER_MATMUL_ROWS

    summary, bodies = [], {}
    for model, fmt in ((m, f) for m in args.models for f in args.formats):
        config = SHAPES[model]
        h, f, d = config.hidden_size, config.intermediate_size, config.head_dim
        layer_mb = 2 * (h * (config.num_heads + 2 * config.num_kv_heads) * d + config.num_heads * d * h
                        + 3 * h * f) / 1e6
        pool_dims = f"{config.num_kv_heads // args.tp},{d}]"  # one device's kv heads
        layer_mb /= args.tp  # one device's share
        if "int8" in fmt:
            layer_mb /= 2  # one byte a weight (and a scale per column)
        # the layer matmul by XLA and by the kernel; the layers unrolled (XLA's GEMMs on static slices); and the
        # engine before the split sampler (its conditionals)
        variants = ((0, True, "kernel", "layer matmul XLA"),
                    (GPU_LAYER_MATMUL_ROWS, True, "kernel", "layer matmul kernel"),
                    (GPU_LAYER_MATMUL_ROWS, True, "unrolled", "layers unrolled"),
                    (GPU_LAYER_MATMUL_ROWS, False, "kernel", "layer matmul kernel, sampler fused"))
        for kernel, split, loop, label in variants:
            t0 = time.perf_counter()
            hlo = compile_decode_step(model, args.seqs, kernel, args.target, fmt, split_sampler=split, tp=args.tp,
                                      gpu_loop=loop)
            compile_s = time.perf_counter() - t0
            rows = layer_loop_ops(hlo, pool_dims)
            per = config.num_layers if loop == "unrolled" else 1  # the entry computation holds every layer
            copies = weight_copies(rows, pool_dims, args.seqs)
            name = f"{model} {fmt} {label}"
            bodies[name] = rows
            summary.append({"step": name, "ops": len(rows) / per, "weight_mb": layer_mb,
                            "copied_mb": sum(r["output_mb"] for r in copies) / per, "copies": len(copies) / per,
                            "triton_calls": sum("triton" in r["what"] for r in rows) / per,
                            "conditionals": hlo.count(" conditional("), "compile_s": compile_s})
            print(f"\n{name}: " + (f"the step's ops ({len(rows)}, every layer's)" if per > 1 else
                                    f"the layer loop's body ({len(rows)} ops, once per layer)"))
            print_table(rows, [("op", "op", ""), ("kind", "kind", ""), ("what", "what", ""),
                               ("output", "output", ""), ("output_mb", "output MB", ".1f")])
    print(f"\n{args.target}{f' x {args.tp} (tensor parallel, per device)' if args.tp > 1 else ''}, decode step of "
          f"{args.seqs} sequences: weight copies per layer (each read and written before the GEMM reads the weight "
          "again)")
    print_table(summary, [("step", "step", ""), ("ops", "ops a layer", ".0f"),
                          ("triton_calls", "Triton calls", ".0f"), ("weight_mb", "layer weights MB", ".0f"),
                          ("copies", "weight copies", ".1f"), ("copied_mb", "MB copied", ".0f"),
                          ("conditionals", "conditionals in the step", "d"),
                          ("compile_s", "compile s (here, deviceless)", ".1f")])
    out = args.out or os.path.join(RESULTS_DIR, "gpu_step_hlo.json" if args.tp == 1 else
                                   f"gpu_step_hlo_tp{args.tp}.json")
    write_json(out, {"target": args.target, "tp": args.tp, "seqs": args.seqs, "jax": jax.__version__,
                     "summary": summary, "layer_loop_bodies": bodies})


if __name__ == "__main__":
    main()
