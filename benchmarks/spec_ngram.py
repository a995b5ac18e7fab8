"""Host cost of the n-gram proposer (`jaxpaged.spec_decode.ngram`), which runs for every speculating sequence on
every step: microseconds per sequence at 2k and 8k tokens, one sequence alone (`propose`) and 48 as one padded batch
(`propose_batch`, the persistent input batch's layout), k=4, prompt_lookup 2..5 (sequence lengths vary +-25% in
the batch).

Token streams:
  random     ids uniform over a 49152 vocabulary (SmolLM2's): few earlier occurrences of the last token
  quoting    random prompt, then an answer copying spans of it: the proposer finds its match (the case n-gram wins)
  low-vocab  ids over 16 values: ~L/16 candidates per sequence, a worst case for the candidate filter

Median over --runs timed calls (each --repeat calls long).

    python benchmarks/spec_ngram.py       # -> benchmarks/results/spec_ngram.json
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np
from common import write_json
from step_anatomy import cpu_name

from jaxpaged.spec_decode.ngram import propose, propose_batch

K, MIN_N, MAX_N = 4, 2, 5


def stream(kind: str, length: int, rng: np.random.Generator) -> np.ndarray:
    if kind == "random":
        return rng.integers(0, 49152, size=length, dtype=np.int32)
    if kind == "low-vocab":
        return rng.integers(0, 16, size=length, dtype=np.int32)
    prompt = rng.integers(0, 49152, size=length * 3 // 4, dtype=np.int32)
    pieces, total = [prompt], len(prompt)
    while total < length:  # quote 8-40 tokens of the prompt, then 1-4 tokens of its own
        start, span = int(rng.integers(0, len(prompt) - 40)), int(rng.integers(8, 41))
        own = rng.integers(0, 49152, size=int(rng.integers(1, 5)), dtype=np.int32)
        pieces += [prompt[start:start + span], own]
        total += span + len(own)
    return np.concatenate(pieces)[:length]


def us_per_call(fn, runs: int, repeat: int) -> float:
    fn()
    times = []
    for _ in range(runs):
        t = time.perf_counter()
        for _ in range(repeat):
            fn()
        times.append((time.perf_counter() - t) / repeat)
    return statistics.median(times) * 1e6


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", type=int, default=7)
    parser.add_argument("--repeat", type=int, default=200)
    parser.add_argument("--batch", type=int, default=48)
    parser.add_argument("--out", default="benchmarks/results/spec_ngram.json")
    args = parser.parse_args()
    rng = np.random.default_rng(0)
    cpu = cpu_name()
    print(f"CPU: {cpu}; k={K}, prompt_lookup {MIN_N}..{MAX_N}, batch {args.batch}")
    print(f"{'stream':<10} {'tokens':>7} {'alone us/seq':>13} {'batch us/seq':>13} {'found %':>8}")
    results = []
    for kind in ("random", "quoting", "low-vocab"):
        for length in (2048, 8192):
            one = stream(kind, length, rng)
            alone = us_per_call(lambda one=one: propose(one, k=K, min_n=MIN_N, max_n=MAX_N), args.runs, args.repeat)
            lengths = rng.integers(length * 3 // 4, length * 5 // 4 + 1, size=args.batch)
            rows = np.zeros((args.batch, int(lengths.max())), np.int32)  # the persistent batch's [B, W] layout
            for b, n in enumerate(lengths):
                rows[b, :n] = stream(kind, int(n), rng)
            batch = us_per_call(lambda rows=rows, lengths=lengths: propose_batch(
                rows, lengths, k=K, min_n=MIN_N, max_n=MAX_N), args.runs, max(1, args.repeat // 10)) / args.batch
            _, counts = propose_batch(rows, lengths, k=K, min_n=MIN_N, max_n=MAX_N)
            found = 100.0 * float(np.mean(counts > 0))
            print(f"{kind:<10} {length:>7} {alone:>13.1f} {batch:>13.1f} {found:>8.0f}")
            results.append({"stream": kind, "tokens": length, "alone_us_per_seq": round(alone, 2),
                            "batch_us_per_seq": round(batch, 2), "batch": args.batch, "found_pct": found})
    write_json(args.out, {"cpu": cpu, "k": K, "min_n": MIN_N, "max_n": MAX_N, "results": results})


if __name__ == "__main__":
    main()
