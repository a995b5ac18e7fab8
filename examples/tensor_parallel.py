"""Tensor parallelism: one model split over several devices, here two fake CPU devices.

    python examples/tensor_parallel.py                     # the default model over 2 CPU "devices"
    python examples/tensor_parallel.py --model path/to/model --tp 2

On GPUs or TPUs, `tensor_parallel_size` splits over the real devices and nothing else changes. On a CPU, XLA can
pretend to have N devices (XLA_FLAGS below), which is how jaxpaged tests its parallel code without accelerators.
"""

import os

# Must be set before JAX starts, so before importing jaxpaged (it imports JAX).
os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=2"

import argparse  # noqa: E402

import jax  # noqa: E402

from jaxpaged import LLM, SamplingParams  # noqa: E402

parser = argparse.ArgumentParser(description="Tensor parallelism on fake CPU devices")
parser.add_argument("--model", default=None, help="model path (default: SmolLM2-135M-Instruct, installed with pip)")
parser.add_argument("--tp", type=int, default=2, help="devices to split the model over")
parser.add_argument("--max-tokens", type=int, default=24)
args = parser.parse_args()
print("devices:", jax.devices())

# Megatron-style: attention heads and MLP columns are split over the devices, with two all-reduces per layer; the
# KV cache is split by kv head. The start-up log shows each device's share of weights and pool.
llm = LLM(model=args.model, tensor_parallel_size=args.tp, max_num_seqs=4, max_model_len=512, precompile=False)
params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens)
for out in llm.generate(["The best way to learn a language is", "JAX is a library for"], params):
    print(f"{out.prompt!r} -> {out.outputs[0].text!r}")
print("the KV pool lives on:", sorted(str(d) for d in jax.tree.leaves(llm.engine.runner.kv_pool)[0].devices()))
