"""Command line: `jaxpaged generate` (one-shot text from a model). The HTTP server is `server.py`."""

from __future__ import annotations

import argparse
import logging
import sys
import time


def add_engine_args(p: argparse.ArgumentParser) -> None:
    """The engine options every command shares (the names of EngineConfig's fields)."""
    p.add_argument("--model", default=None, help="GGUF file, HF directory or Orbax checkpoint (default: SmolLM2)")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    p.add_argument("--kv-cache-dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"],
                   help="K/V pool dtype; auto: --dtype, but float32 on CPU for 16-bit dtypes")
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--kv-cache-memory", default=None, help="KV pool size on CPU, e.g. 1GiB")
    p.add_argument("--gpu-memory-utilization", type=float, default=0.9)
    p.add_argument("--max-num-seqs", type=int, default=64)
    p.add_argument("--max-num-batched-tokens", type=int, default=2048)
    p.add_argument("--max-model-len", type=int, default=None)
    p.add_argument("--no-prefix-caching", action="store_true")
    p.add_argument("--swap-space", type=float, default=0.0, help="GiB of host memory for swapped blocks")
    p.add_argument("--preemption-mode", default="recompute", choices=["recompute", "swap"])
    p.add_argument("--attention-backend", default="auto", choices=["auto", "reference", "pallas", "native"])
    p.add_argument("--no-precompile", action="store_true", help="compile step shapes lazily instead of at start")


def engine_options(args: argparse.Namespace) -> dict:
    return dict(dtype=args.dtype, kv_cache_dtype=args.kv_cache_dtype, block_size=args.block_size,
                kv_cache_memory=args.kv_cache_memory,
                gpu_memory_utilization=args.gpu_memory_utilization, max_num_seqs=args.max_num_seqs,
                max_num_batched_tokens=args.max_num_batched_tokens, max_model_len=args.max_model_len,
                enable_prefix_caching=not args.no_prefix_caching, swap_space=args.swap_space,
                preemption_mode=args.preemption_mode, attention_backend=args.attention_backend,
                precompile=not args.no_precompile)


def _generate(args: argparse.Namespace) -> int:
    from jaxpaged import LLM, SamplingParams

    llm = LLM(args.model, **engine_options(args))
    params = SamplingParams(temperature=args.temperature, top_p=args.top_p, max_tokens=args.max_tokens,
                            seed=args.seed)
    t0 = time.perf_counter()
    if args.raw or not getattr(llm.tokenizer, "chat_template", None):
        outs = llm.generate(args.prompt, params, use_tqdm=False)
    else:
        outs = llm.chat([[{"role": "user", "content": p}] for p in args.prompt], params, use_tqdm=False)
    elapsed = time.perf_counter() - t0
    for prompt, out in zip(args.prompt, outs, strict=True):
        print(f"### {prompt}\n{out.outputs[0].text.strip()}\n")
    s = llm.stats()
    ntok = sum(len(o.outputs[0].token_ids) for o in outs)
    print(f"[{ntok} tokens in {elapsed:.1f} s; start-up: load {s.get('load_s', 0):.1f} s, compile "
          f"{s['compile_s']:.1f} s; KV pool {s['num_blocks']} blocks of {s['block_size']}]", file=sys.stderr)
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="jaxpaged")
    sub = parser.add_subparsers(dest="command", required=True)
    g = sub.add_parser("generate", help="generate text for one or more prompts")
    g.add_argument("--prompt", action="append", required=True, help="repeat for several prompts")
    g.add_argument("--max-tokens", type=int, default=128)
    g.add_argument("--temperature", type=float, default=0.0)
    g.add_argument("--top-p", type=float, default=1.0)
    g.add_argument("--seed", type=int, default=None)
    g.add_argument("--raw", action="store_true", help="do not apply the chat template")
    add_engine_args(g)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    try:
        return _generate(args)
    except (ValueError, FileNotFoundError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
