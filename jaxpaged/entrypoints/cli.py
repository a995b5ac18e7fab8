"""Command line, shaped like vLLM's:

    jaxpaged serve [model] [--port 8000] [engine and server flags]    the OpenAI-compatible server
    jaxpaged generate --prompt "..." [--model path] [engine flags]   one-shot text from a model

Every engine flag is generated from `EngineConfig` (`add_engine_args`), so the flags, `LLM(...)`'s keywords and the
server's options cannot drift apart. `jaxpaged <command> --help` lists them.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import logging
import sys
import time

from jaxpaged.runtime.tcmalloc import use_tcmalloc


def add_engine_args(p: argparse.ArgumentParser) -> None:
    """`--model` and one flag per EngineConfig field (`--kebab-case`, its help, default and choices)."""
    from jaxpaged.engine.setup import EngineConfig

    p.add_argument("--model", default=None, help="GGUF file, HF directory or Orbax checkpoint (default: SmolLM2)")
    group = p.add_argument_group("engine options (LLM(...) keywords)")
    for f in dataclasses.fields(EngineConfig):
        flag = "--" + f.name.replace("_", "-")
        help, choices = f.metadata["help"], f.metadata["choices"]
        if f.type == "bool":
            group.add_argument(flag, action=argparse.BooleanOptionalAction, default=f.default, help=help)
            continue
        kind = f.type.split("|")[0].strip()
        # "int | str" (a size such as 2GiB) reads as a string; EngineConfig parses it; a dict is JSON
        parse = {"int": int, "float": float, "str": str, "dict": _json_object}[kind if "str" not in f.type else "str"]
        if choices is not None and None in choices:  # the help lists None: `--quantization none` (or None) gives it
            parse = functools.partial(_none_or, parse)
        group.add_argument(flag, type=parse, default=f.default, choices=choices,
                           help=help if f.default is None else f"{help} (default: {f.default})")


def _none_or(parse, text: str):
    return None if text.strip().lower() == "none" else parse(text)


def _json_object(text: str) -> dict:
    """A flag's JSON object (`--speculative-config '{"method": "ngram", ...}'`)."""
    try:
        value = json.loads(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(f"not JSON: {e}") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError(f"a JSON object is needed, got {type(value).__name__}")
    return value


def engine_options(args: argparse.Namespace) -> dict:
    """The EngineConfig keywords from parsed flags."""
    from jaxpaged.engine.setup import EngineConfig

    return {f.name: getattr(args, f.name) for f in dataclasses.fields(EngineConfig)}


def use_compilation_cache(args: argparse.Namespace) -> None:
    """An entry point owns its process, so it keeps JAX's persistent compilation cache on (the library does only when
    asked): an unset --compilation-cache-dir becomes the default directory, which the engine then enables."""
    from jaxpaged.runtime.compilation_cache import default_directory

    if args.compilation_cache_dir is None:
        args.compilation_cache_dir = default_directory()


def join_processes(args: argparse.Namespace):
    """Multi-host: joins the other processes (jax.distributed, gloo collectives on CPU) before any other JAX use, as
    the flags (or $JAXPAGED_*) say; returns the DistributedConfig (single process: nothing happens)."""
    from jaxpaged.engine.setup import EngineConfig
    from jaxpaged.parallel import multihost

    config = EngineConfig(**engine_options(args)).distributed_config()
    multihost.initialize(config, cpu_collectives="gloo")
    return config


def run_worker_process(args: argparse.Namespace) -> int:
    """A process other than 0: the same engine (weights, mesh, compiled steps), then process 0's ops until it says
    stop. 0 on a clean stop; 1 if process 0 went away (its collective failed)."""
    from jaxpaged.entrypoints.llm import load_engine
    from jaxpaged.parallel import multihost

    engine = load_engine(args.model, **engine_options(args))
    try:
        ops = multihost.run_worker(engine.runner)
    except Exception:
        logging.getLogger("jaxpaged.entrypoints.cli").exception("process 0 is gone; this worker stops")
        return 1
    logging.getLogger(__name__).info("worker done: %s", ", ".join(f"{n} {op.name}" for op, n in ops.items()))
    multihost.shutdown()
    return 0


def finish_process_0(runner) -> int:
    """Multi-host, process 0, its engine stopped: the workers return, then every process leaves the group. 0, or 1
    if a worker was already gone."""
    from jaxpaged.parallel import multihost

    if getattr(runner, "broadcaster", None) is None:
        return 0
    if not multihost.stop_workers(runner):
        return 1
    multihost.shutdown()
    return 0


def _generate(args: argparse.Namespace) -> int:
    from jaxpaged import LLM, SamplingParams

    use_compilation_cache(args)
    if join_processes(args).process_id != 0:
        return run_worker_process(args)
    llm = LLM(args.model, **engine_options(args))
    params = SamplingParams(temperature=args.temperature, top_p=args.top_p, max_tokens=args.max_tokens)
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
    return finish_process_0(llm.engine.runner)


def _add_serve_parser(sub) -> argparse.ArgumentParser:
    from jaxpaged.entrypoints.openai.api_server import add_server_args

    p = sub.add_parser("serve", help="the OpenAI-compatible HTTP server",
                       description="OpenAI-compatible server for jaxpaged (the same flags as server.py)")
    p.add_argument("model_tag", nargs="?", default=None, metavar="model",
                   help="GGUF file, HF directory or Orbax checkpoint (default: SmolLM2); or --model")
    add_engine_args(p)
    add_server_args(p)
    return p


def _serve(serve_parser: argparse.ArgumentParser, args: argparse.Namespace, as_program: bool) -> int:
    from jaxpaged.entrypoints.openai.api_server import check_server_args, exit_now, run_server

    if args.model_tag is not None:
        if args.model is not None and args.model != args.model_tag:
            serve_parser.error(f"two models: {args.model_tag!r} and --model {args.model!r}; give one")
        args.model = args.model_tag
    code = run_server(check_server_args(serve_parser, args))
    if as_program:
        exit_now(code)  # skips the interpreter's slow teardown of JAX's runtime, as server.py does
    return code


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="jaxpaged")
    sub = parser.add_subparsers(dest="command", required=True)
    serve_parser = _add_serve_parser(sub)
    g = sub.add_parser("generate", help="generate text for one or more prompts")
    g.add_argument("--prompt", action="append", required=True, help="repeat for several prompts")
    g.add_argument("--max-tokens", type=int, default=128)
    g.add_argument("--temperature", type=float, default=0.0)
    g.add_argument("--top-p", type=float, default=1.0)
    g.add_argument("--raw", action="store_true", help="do not apply the chat template")
    add_engine_args(g)
    args = parser.parse_args(argv)
    if argv is None:  # run as a program (a caller passing argv keeps its process as it is)
        use_tcmalloc()  # may re-execute this process with tcmalloc preloaded (jaxpaged/runtime/tcmalloc.py)
    if args.command == "serve":
        return _serve(serve_parser, args, as_program=argv is None)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    try:
        return _generate(args)
    except (ValueError, TypeError, FileNotFoundError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
