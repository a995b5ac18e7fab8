"""Memory under a long mixed load: does the server leak? `server.py` on the default model, --concurrency clients
sending a seeded mix of requests for --minutes; every --sample-s the server process's RSS, open file descriptors and
threads, the pool's used blocks and the requests answered. Then the load stops: every KV block must be free again,
and the RSS's slope over the second half of the run (after the allocator's and XLA's warm-up; Theil-Sen's, robust to
the allocator's occasional release of memory) says whether memory grows with the requests served (MiB per 1000
requests; a leak of one 4 KiB object a request shows as ~4).

The mix, each request drawn at random: a streamed chat; a chat with log-probs (top 5); a seeded completion with
n=2 at top-p 0.9; a chat held to a JSON schema; a completion with stop strings; a streamed chat the client drops
after its first chunk; a body the server refuses (400); a chat that shares a long system prompt with the others
(prefix caching). Prompts and lengths vary, so blocks are allocated, shared, freed and cached all the time.

    python benchmarks/soak.py                       # 10 minutes, 8 clients -> benchmarks/results/soak.json
    python benchmarks/soak.py --minutes 2 --out /tmp/soak.json   # a short run
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import re
import shlex
import sys
import time
import urllib.request

import aiohttp
import numpy as np
from common import RESULTS_DIR, cpu_name, print_table, write_json
from serving import start_server

KINDS = ["stream", "logprobs", "n2_top_p", "json_schema", "stop", "dropped", "bad", "shared_prefix"]
SYSTEM = "You are a careful assistant. " * 40  # ~240 tokens every shared_prefix request starts with
WORDS = "the of pages block cache model token batch queue device host step river stone light paper".split()
SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 12}, "age": {"type": "integer"}},
          "required": ["name", "age"]}


def proc_status(pid: int) -> dict:
    """The process's RSS (MiB), open file descriptors and threads, from /proc."""
    with open(f"/proc/{pid}/status") as f:
        status = f.read()
    return {"rss_mib": int(re.search(r"VmRSS:\s+(\d+) kB", status).group(1)) / 1024,
            "threads": int(re.search(r"Threads:\s+(\d+)", status).group(1)),
            "fds": len(os.listdir(f"/proc/{pid}/fd"))}


def get_json(url: str) -> dict:
    with urllib.request.urlopen(url, timeout=30) as r:
        return json.load(r)


def request_for(kind: str, rng: random.Random, model: str) -> tuple[str, dict | bytes]:
    """(path, body) of one request of `kind`."""
    words = " ".join(rng.choice(WORDS) for _ in range(rng.randint(3, 120)))
    chat = {"model": model, "messages": [{"role": "user", "content": f"Tell me about {words}"}],
            "max_tokens": rng.randint(1, 48), "temperature": 0.0}
    if kind == "stream":
        return "/v1/chat/completions", {**chat, "stream": True, "stream_options": {"include_usage": True}}
    if kind == "logprobs":
        return "/v1/chat/completions", {**chat, "logprobs": True, "top_logprobs": 5}
    if kind == "n2_top_p":
        return "/v1/completions", {"model": model, "prompt": words, "n": 2, "temperature": 1.0, "top_p": 0.9,
                                   "seed": rng.randint(0, 2**31), "max_tokens": rng.randint(1, 32)}
    if kind == "json_schema":
        return "/v1/chat/completions", {**chat, "max_tokens": 48, "response_format": {
            "type": "json_schema", "json_schema": {"name": "person", "schema": SCHEMA}}}
    if kind == "stop":
        return "/v1/completions", {"model": model, "prompt": words, "max_tokens": 40, "temperature": 0.7,
                                   "stop": [rng.choice(WORDS), "\n\n"]}
    if kind == "dropped":
        return "/v1/chat/completions", {**chat, "max_tokens": 64, "stream": True}
    if kind == "bad":
        return "/v1/chat/completions", rng.choice([b'{"model": "x", "messages": [', b'{"model": 5}',
                                                   json.dumps({**chat, "temperature": -3}).encode()])
    if kind == "shared_prefix":
        return "/v1/chat/completions", {**chat, "messages": [{"role": "system", "content": SYSTEM},
                                                             *chat["messages"]]}
    raise ValueError(kind)


async def client(session: aiohttp.ClientSession, url: str, model: str, seed: int, stop_at: float,
                 counts: dict) -> None:
    rng = random.Random(seed)
    while time.monotonic() < stop_at:
        kind = rng.choice(KINDS)
        path, body = request_for(kind, rng, model)
        kwargs = {"data": body, "headers": {"Content-Type": "application/json"}} if isinstance(body, bytes) \
            else {"json": body}
        try:
            async with session.post(url + path, **kwargs) as resp:
                if kind == "dropped":
                    await resp.content.readline()  # the first chunk, then the connection goes
                    resp.close()
                    status = "dropped"
                else:
                    await resp.read()
                    status = resp.status
        except aiohttp.ClientError as e:
            status = f"client error {type(e).__name__}"
        key = f"{kind} {status}"
        counts[key] = counts.get(key, 0) + 1


async def run(url: str, model: str, pid: int, args) -> tuple[list[dict], dict]:
    counts: dict[str, int] = {}
    t0 = time.monotonic()
    stop_at = t0 + 60 * args.minutes
    samples = []
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=300)) as session:
        tasks = [asyncio.create_task(client(session, url, model, 1000 + i, stop_at, counts))
                 for i in range(args.concurrency)]
        while not all(t.done() for t in tasks):
            await asyncio.wait(tasks, timeout=args.sample_s)
            stats = await asyncio.to_thread(get_json, f"{url}/stats")
            samples.append({"t_s": time.monotonic() - t0, "requests": sum(counts.values()),
                            "num_used_blocks": stats["num_used"], **proc_status(pid)})
            print(samples[-1], flush=True)
        for t in tasks:
            t.result()  # a client's own bug surfaces here
    return samples, counts


def slope_mib_per_1000(samples: list[dict]) -> float:
    """The slope of RSS against requests answered over the second half of the samples, Theil-Sen's (the median of
    the slopes between every two samples): a step (the allocator handing memory back to the system at some point)
    moves it little, where a least-squares line tilts towards it; a leak moves every pair's slope."""
    half = samples[len(samples) // 2:]
    pairs = [((b["rss_mib"] - a["rss_mib"]) / (b["requests"] - a["requests"]))
             for i, a in enumerate(half) for b in half[i + 1:] if b["requests"] != a["requests"]]
    return float(np.median(pairs) * 1000) if len(half) >= 3 and pairs else float("nan")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--minutes", type=float, default=10.0)
    ap.add_argument("--concurrency", type=int, default=8)
    ap.add_argument("--sample-s", type=float, default=15.0)
    ap.add_argument("--model", default=None, help="what server.py serves (default: its default model)")
    ap.add_argument("--server-args", default="--max-num-seqs 16 --max-model-len 1024")
    ap.add_argument("--startup-timeout", type=float, default=900.0)
    ap.add_argument("--out", default=os.path.join(RESULTS_DIR, "soak.json"))
    args = ap.parse_args()

    proc, url = start_server(args)
    try:
        model = get_json(f"{url}/v1/models")["data"][0]["id"]
        start = proc_status(proc.pid)
        samples, counts = asyncio.run(run(url, model, proc.pid, args))
        deadline = time.monotonic() + 60
        while (stats := get_json(f"{url}/stats"))["num_used"] and time.monotonic() < deadline:
            time.sleep(0.5)  # the dropped streams' requests end at their next step
        end = proc_status(proc.pid)
        alive = proc.poll() is None
    finally:
        proc.terminate()
        proc.wait(timeout=60)

    total = sum(counts.values())
    slope = slope_mib_per_1000(samples)
    print(f"\nCPU: {cpu_name()}; server args: {args.server_args}; {args.concurrency} clients, {args.minutes} min")
    every = max(1, len(samples) // 12)
    print_table(samples[::every] + ([samples[-1]] if (len(samples) - 1) % every else []),
                [("t_s", "t s", ".0f"), ("requests", "requests", "d"), ("rss_mib", "RSS MiB", ".1f"),
                 ("num_used_blocks", "used blocks", "d"), ("fds", "fds", "d"), ("threads", "threads", "d")])
    print(f"\n{total} requests: {dict(sorted(counts.items()))}")
    print(f"RSS: {start['rss_mib']:.1f} MiB after start-up, {samples[len(samples) // 2]['rss_mib']:.1f} at half "
          f"time, {end['rss_mib']:.1f} at the end; slope over the second half {slope:.2f} MiB per 1000 requests")
    print(f"after the load: used blocks {stats['num_used']} (0 expected), fds {start['fds']} -> {end['fds']}, "
          f"threads {start['threads']} -> {end['threads']}, server alive: {alive}")
    write_json(args.out, {"cpu": cpu_name(), "command": shlex.join(["python", "benchmarks/soak.py", *sys.argv[1:]]),
        "server_args": args.server_args, "concurrency": args.concurrency, "minutes": args.minutes,
        "counts": counts, "samples": samples, "start": start, "end": end, "used_blocks_after": stats["num_used"],
        "rss_slope_mib_per_1000_requests": slope, "server_alive": alive})


if __name__ == "__main__":
    main()
