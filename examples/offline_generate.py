"""Offline batch generation: many prompts through one continuously batched engine.

    python examples/offline_generate.py                    # the default model, SmolLM2-135M-Instruct
    python examples/offline_generate.py --model path/to/model.gguf --max-tokens 64

A model is a GGUF file, a Hugging Face directory (config.json + safetensors) or a jaxpaged checkpoint.
"""

import argparse

from jaxpaged import LLM, SamplingParams

parser = argparse.ArgumentParser(description="Offline batch generation with jaxpaged")
parser.add_argument("--model", default=None, help="model path (default: SmolLM2-135M-Instruct, installed with pip)")
parser.add_argument("--max-tokens", type=int, default=32, help="new tokens per prompt")
args = parser.parse_args()

prompts = [
    "The capital of France is",
    "Here is a short poem about the sea:",
    "def fibonacci(n):",
    "The three primary colours are",
]

# Build the engine once: it loads the model, sizes the paged KV cache and compiles the step shapes it will run.
# Every keyword is an engine option with vLLM's name (EngineConfig lists them all); an unknown one is an error.
# precompile=False compiles a step shape when first used: quicker for a few prompts than compiling all at start-up.
llm = LLM(model=args.model, max_num_seqs=8, max_model_len=512, precompile=False)

# temperature=0 is greedy decoding. A seed makes sampling reproducible, whatever else shares the batch.
greedy = SamplingParams(temperature=0.0, max_tokens=args.max_tokens)
sampled = SamplingParams(temperature=0.8, top_p=0.95, seed=1234, max_tokens=args.max_tokens)

for name, params in (("greedy", greedy), ("sampled", sampled)):
    # generate() runs every prompt to completion in shared batches; outputs come back in the prompts' order.
    outputs = llm.generate(prompts, params)
    print(f"--- {name}")
    for out in outputs:
        completion = out.outputs[0]  # one completion per prompt (SamplingParams(n=...) asks for more)
        print(f"{out.prompt!r} -> {completion.text!r} [{len(completion.token_ids)} tokens, {completion.finish_reason}]")

# The engine's counters (llm.stats() has them all): the KV pool, the prefix cache, start-up times.
stats = llm.stats()
print(f"KV pool: {stats['num_blocks']} blocks of {stats['block_size']} tokens; model loaded in {stats['load_s']:.1f} s")
