"""The grammar worker: a separate process that compiles and validates structured-output specs with llguidance, so
that a spec which overflows llguidance's native stack, exhausts memory or never finishes kills this process, not
the server or the engine (see grammar_guard.py, which starts it, bounds it and restarts it).

It is run as a file (`python -P grammar_worker.py STACK_BYTES MEMORY_BYTES`), not as part of the package, so it
loads the standard library and llguidance only (no JAX, no transformers); the package imports its two helpers
(`short_error`, `parser_limits`) so both sides treat errors alike. Each operation runs on a thread with
STACK_BYTES of stack: smaller than the server's and engine's threads, so a spec that compiles here compiles there.

Protocol on stdin / stdout: frames of a 4-byte big-endian length and that many bytes of ASCII JSON.
    {"op": "tokenizer", "key", "json", "n_vocab", "eos"}  -> {"ok": true}
    {"op": "grammar", "kind", "spec"}                       -> {"ok": true, "grammar": "..."}
    {"op": "matcher", "key", "grammar"}                     -> {"ok": true}   (compiled with the tokenizer, and its
                                                                               first token mask computed)
and {"ok": false, "error": "..."} when the spec is at fault. EOF on stdin ends the process.
"""

from __future__ import annotations

import json
import os
import resource
import struct
import sys
import threading
import time

# Compact JSON (no free whitespace between tokens): a weak model otherwise fills its budget with blanks.
JSON_OPTIONS = {"whitespace_flexible": False}
MAX_ERROR_CHARS = 300
# The CPU time one token mask may take. The engine computes a step's masks on its own thread, so a slow one stalls
# every request: an ambiguous grammar's masks grow with its output (Earley items), where ordinary grammars' stay
# far below this (benchmarks/grammar_masks.py; docs/benchmarks.md). A mask over the limit fails its request (its
# first one, computed before the request is queued: a 400).
MAX_MASK_CPU_S = 0.05


def short_error(text: str) -> str:
    """llguidance's message without the grammar excerpt, state dump or caret lines that may follow its first line.

    A regex's error is the exception: its first line ends "regex parse error:" and the reason comes after the pattern
    and a caret line, as "error: unclosed group"; that reason is kept."""
    lines = [line.strip() for line in str(text).splitlines() if line.strip()]
    first = lines[0] if lines else "unknown error"
    reason = next((line for line in lines[1:] if line.startswith("error:")), None)
    if first.endswith(":") and reason:
        first = f"{first} {reason.removeprefix('error:').strip()}"
    return first[:MAX_ERROR_CHARS]


def parser_limits():
    """The same limits the engine uses: errors never carry parser state or the grammar (verbose_errors=False)."""
    from llguidance import LLParserLimits

    return LLParserLimits(verbose_errors=False)


def compile_spec(kind: str, spec: str) -> str:
    """The llguidance grammar of one spec; ValueError with a short message when the spec is invalid."""
    from llguidance import LLMatcher, grammar_from

    try:
        if kind == "json":
            g = LLMatcher.grammar_from_json_schema(spec, defaults=JSON_OPTIONS)
        elif kind == "json_object":
            g = LLMatcher.grammar_from_json_schema('{"type": "object"}', defaults=JSON_OPTIONS)
        elif kind == "regex":
            g = LLMatcher.grammar_from_regex(spec)
        elif kind in ("choice", "grammar"):
            g = grammar_from(kind, spec)
        else:
            raise ValueError(f"unknown kind {kind!r}")
    except (ValueError, TypeError) as e:
        raise ValueError(short_error(str(e))) from None
    is_error, messages = LLMatcher.validate_grammar_with_warnings(g, limits=parser_limits())
    if is_error:
        raise ValueError(short_error(messages[0]))
    return g


def check_matcher(tokenizer, grammar: str) -> None:
    """Compiles the grammar against the tokenizer and computes its first mask, as the engine's first step will, in at
    most MAX_MASK_CPU_S of CPU time."""
    from llguidance import LLMatcher

    matcher = LLMatcher(tokenizer, grammar, log_level=0, limits=parser_limits())
    if matcher.is_error():
        raise ValueError(short_error(matcher.get_error()))
    start = time.thread_time()
    matcher.compute_bitmask()
    if matcher.is_error():
        raise ValueError(f"no first token can be computed ({short_error(matcher.get_error())})")
    check_mask_time(time.thread_time() - start, "its first token mask")


def check_mask_time(seconds: float, what: str) -> None:
    """ValueError when a token mask took more than MAX_MASK_CPU_S of CPU time."""
    if seconds > MAX_MASK_CPU_S:
        raise ValueError(f"{what} took {seconds * 1e3:.1f} ms of CPU time, over the limit of "
                         f"{MAX_MASK_CPU_S * 1e3:.0f} ms (the grammar is too ambiguous or too large)")


class Worker:
    def __init__(self, stack_bytes: int):
        self.stack_bytes = stack_bytes
        self.tokenizers: dict[str, object] = {}

    def handle(self, msg: dict) -> dict:
        op = msg.get("op")
        if op == "tokenizer":
            from llguidance import LLTokenizer

            self.tokenizers[msg["key"]] = LLTokenizer(msg["json"], n_vocab=msg["n_vocab"], eos_token=msg["eos"])
            return {"ok": True}
        if op == "grammar":
            return {"ok": True, "grammar": compile_spec(msg["kind"], msg["spec"])}
        if op == "matcher":
            check_matcher(self.tokenizers[msg["key"]], msg["grammar"])
            return {"ok": True}
        raise ValueError(f"unknown op {op!r}")

    def run_on_small_stack(self, msg: dict) -> dict:
        result: dict = {}

        def target():
            try:
                result.update(self.handle(msg))
            except (ValueError, TypeError, KeyError) as e:
                result.update(ok=False, error=short_error(str(e)))
            except Exception as e:  # a panic inside llguidance surfaces as an exception: the spec's fault as well
                result.update(ok=False, error=short_error(f"{type(e).__name__}: {e}"))

        # This process is the worker's own: the stack size is set for its threads alone.
        threading.stack_size(self.stack_bytes)
        thread = threading.Thread(target=target, name="grammar-op")
        thread.start()
        thread.join()
        return result


def read_frame(stream) -> dict | None:
    head = stream.read(4)
    if len(head) < 4:
        return None
    (size,) = struct.unpack(">I", head)
    body = stream.read(size)
    if len(body) < size:
        return None
    return json.loads(body)


def write_frame(stream, obj: dict) -> None:
    body = json.dumps(obj).encode("ascii")  # ensure_ascii: lone surrogates in a spec survive the trip
    stream.write(struct.pack(">I", len(body)) + body)
    stream.flush()


def main(argv: list[str]) -> int:
    stack_bytes, memory_bytes = int(argv[1]), int(argv[2])
    if memory_bytes > 0:
        # An allocation beyond this fails (llguidance aborts): the worker dies, the spec gets its 400.
        resource.setrlimit(resource.RLIMIT_AS, (memory_bytes, memory_bytes))
    stdin, stdout = sys.stdin.buffer, sys.stdout.buffer
    sys.stdout = sys.stderr  # nothing but frames on the protocol stream
    worker = Worker(stack_bytes)
    while (msg := read_frame(stdin)) is not None:
        write_frame(stdout, worker.run_on_small_stack(msg))
    return 0


if __name__ == "__main__":
    code = main(sys.argv)
    sys.stderr.flush()
    os._exit(code)
