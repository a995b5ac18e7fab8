"""Online serving benchmark: the throughput workload's prompts sent to the OpenAI server over HTTP.

Open loop: requests arrive as a Poisson process at each --rates value (requests/s). Closed loop: --concurrency
clients each send their next request as soon as the last one finished. Every request streams
(`/v1/completions`, greedy, EOS ignored, a fixed number of new tokens) so the client sees its first token.

Reports request throughput, output tokens/s, TTFT (time to first token), TPOT (time per output token after
the first) p50/p99 and ITL (inter-token latency: the gap between two chunks of one stream that carry text)
p50/p99/max; prints a table, writes benchmarks/results/serving.json and plots them against the rate in
benchmarks/results/serving.png.

Peer (--peers, default auto): with --start-server, vLLM's CPU build (its venv from
`benchmarks/peers/build_vllm_cpu.py`) serves the same weights (the model exported as a Hugging Face directory,
`benchmarks/peers/export_hf.py`) through its own OpenAI server (what `vllm serve` runs; bfloat16; the options
--server-args shares with it: --max-num-seqs, --max-num-batched-tokens, --max-model-len), after jaxpaged's server has
stopped, and gets the same runs; a second table sets the two side by side. Both keep their default prefix caching
(on); every run has its own prompts (workload seeds --seed, --seed + 1, ...), so no run finds another's in the cache.

Interference run (--long-prompts K, default 4): --concurrency streams decode alone for a while, then K long prompts
(--long-prompt-tokens each) arrive while they decode. Its rows give the streams' ITL alone (before the long prompts
come) and with the long prompts being prefilled: a stream stalls for as long as a step that carries a prefill chunk
takes. Then the control: the same streams once more with nothing arriving, and the ITL of the same gaps (stream and
token) as the disturbed ones. A decode step's time grows with the streams' contexts, which grow while the long
prompts are prefilled, so the control, not the gaps before the arrival, is the decode step those gaps would have
taken: ITL p99 with the long prompts over the control's p50 is how much a prefill disturbs the running streams.

    python benchmarks/serving.py --url http://127.0.0.1:8000          # a running server
    python benchmarks/serving.py --start-server                       # starts server.py on the default model
    python benchmarks/serving.py --start-server --quick               # a few minutes on 2 CPU cores
    python benchmarks/serving.py --start-server --quick --peers none  # jaxpaged alone
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import subprocess
import sys
import tempfile
import time

import aiohttp
import numpy as np
from common import cpu_name, free_port, wait_healthy
from common import start_server as common_start_server
from workload import NEW_TOKENS, workload_prompts

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "peers"))
import vllm_cpu  # noqa: E402

QUICK_SERVER_ARGS = "--max-num-seqs 8 --max-num-batched-tokens 512 --max-model-len 512"
SHARED_OPTIONS = ("--max-num-seqs", "--max-num-batched-tokens", "--max-model-len")  # same meaning in vLLM
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


# ---- one request --------------------------------------------------------------------------------------------------

async def one_request(session: aiohttp.ClientSession, url: str, model: str, prompt: list[int],
                      max_tokens: int) -> dict:
    """Streams one completion; returns its timings (seconds) and token count, or the error."""
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0, "ignore_eos": True,
            "stream": True, "stream_options": {"include_usage": True}}
    start = time.perf_counter()
    first = None
    tokens = 0
    arrivals: list[float] = []  # when each chunk carrying text arrived
    try:
        async with session.post(f"{url}/v1/completions", json=body) as resp:
            if resp.status != 200:
                return {"ok": False, "error": f"HTTP {resp.status}: {(await resp.text())[:200]}"}
            async for raw in resp.content:
                line = raw.strip()
                if not line.startswith(b"data: ") or line == b"data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                if "error" in chunk:
                    return {"ok": False, "error": chunk["error"]["message"]}
                if chunk.get("usage"):
                    tokens = chunk["usage"]["completion_tokens"]
                if any(c.get("text") for c in chunk.get("choices", [])):
                    arrivals.append(time.perf_counter())
                    first = first or arrivals[-1]
    except aiohttp.ClientError as e:
        return {"ok": False, "error": repr(e)}
    end = time.perf_counter()
    first = first or end
    return {"ok": True, "start": start, "ttft": first - start, "latency": end - start, "tokens": tokens,
            "tpot": (end - first) / (tokens - 1) if tokens > 1 else None, "arrivals": arrivals,
            "itl": np.diff(arrivals).tolist()}


# ---- the two load shapes ------------------------------------------------------------------------------------------

async def open_loop(url: str, model: str, prompts: list[list[int]], rate: float, max_tokens: int,
                    seed: int) -> tuple[list[dict], float]:
    rng = np.random.default_rng(seed)
    gaps = rng.exponential(1.0 / rate, size=len(prompts))
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=None),
                                     connector=aiohttp.TCPConnector(limit=0)) as session:
        t0 = time.perf_counter()
        tasks = []
        for prompt, gap in zip(prompts, gaps, strict=True):
            await asyncio.sleep(gap)
            tasks.append(asyncio.create_task(one_request(session, url, model, prompt, max_tokens)))
        results = await asyncio.gather(*tasks)
    return results, time.perf_counter() - t0


async def closed_loop(url: str, model: str, prompts: list[list[int]], concurrency: int,
                      max_tokens: int) -> tuple[list[dict], float]:
    queue: asyncio.Queue = asyncio.Queue()
    for p in prompts:
        queue.put_nowait(p)
    results: list[dict] = []
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=None),
                                     connector=aiohttp.TCPConnector(limit=0)) as session:
        async def client():
            while not queue.empty():
                results.append(await one_request(session, url, model, queue.get_nowait(), max_tokens))

        t0 = time.perf_counter()
        await asyncio.gather(*(client() for _ in range(concurrency)))
    return results, time.perf_counter() - t0


async def interference(url: str, model: str, prompts: list[list[int]], long_prompts: list[list[int]],
                       concurrency: int, max_tokens: int,
                       alone_s: float) -> tuple[list[dict], list[dict], float, float]:
    """`concurrency` streams of `max_tokens` start together; `alone_s` seconds later the long prompts arrive (one
    new token each). Returns the streams' results, the long prompts' results, their arrival time and the elapsed
    time."""
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=None),
                                     connector=aiohttp.TCPConnector(limit=0)) as session:
        t0 = time.perf_counter()
        streams = [asyncio.create_task(one_request(session, url, model, p, max_tokens))
                   for p in prompts[:concurrency]]
        await asyncio.sleep(alone_s)
        arrival = time.perf_counter()
        longs = [asyncio.create_task(one_request(session, url, model, p, 1)) for p in long_prompts]
        results = await asyncio.gather(*streams)
        long_results = await asyncio.gather(*longs)
    return results, long_results, arrival, time.perf_counter() - t0


def itl_split(results: list[dict], arrival: float) -> tuple[list[float], list[tuple[int, int]]]:
    """The streams' inter-token gaps that ended before the long prompts arrived, and where those that ended after
    are: (stream, gap index)."""
    alone, disturbed = [], []
    for i, r in enumerate(results):
        if r["ok"]:
            for j, (end, gap) in enumerate(zip(r["arrivals"][1:], r["itl"], strict=True)):
                if end < arrival:
                    alone.append(gap)
                else:
                    disturbed.append((i, j))
    return alone, disturbed


def gaps_at(results: list[dict], where: list[tuple[int, int]]) -> list[float]:
    """The gaps of a run at the places (stream, gap index) given; the control's at the disturbed run's places."""
    return [results[i]["itl"][j] for i, j in where if results[i]["ok"] and j < len(results[i]["itl"])]


def _pct(xs: list[float], q: float) -> float | None:
    return float(np.percentile(xs, q)) if xs else None


def summarize(label: str, rate: float | None, results: list[dict], elapsed: float,
              itl: list[float] | None = None) -> dict:
    ok = [r for r in results if r["ok"]]
    ttft = [r["ttft"] for r in ok]
    tpot = [r["tpot"] for r in ok if r["tpot"] is not None]
    itl = [g for r in ok for g in r["itl"]] if itl is None else itl
    return {"run": label, "rate": rate, "requests": len(results), "failed": len(results) - len(ok),
            "errors": sorted({r["error"] for r in results if not r["ok"]})[:3], "duration_s": elapsed,
            "request_throughput": len(ok) / elapsed, "output_tokens_per_s": sum(r["tokens"] for r in ok) / elapsed,
            "ttft_p50_s": _pct(ttft, 50), "ttft_p99_s": _pct(ttft, 99), "tpot_p50_s": _pct(tpot, 50),
            "tpot_p99_s": _pct(tpot, 99), "latency_p50_s": _pct([r["latency"] for r in ok], 50),
            "itl_p50_s": _pct(itl, 50), "itl_p99_s": _pct(itl, 99), "itl_max_s": max(itl) if itl else None}


def long_prompts(prompts: list[list[int]], count: int, length: int) -> list[list[int]]:
    """`count` prompts of `length` tokens, each the workload's prompts joined from a different start."""
    out = []
    for i in range(count):
        ids: list[int] = []
        j = i
        while len(ids) < length:
            ids += prompts[j % len(prompts)]
            j += 1
        out.append(ids[:length])
    return out


# ---- server handling ----------------------------------------------------------------------------------------------

def start_server(args) -> tuple[subprocess.Popen, str]:
    server_args = ["--served-model-name", "bench", "--max-waiting", "100000", *args.server_args.split()]
    if args.model:
        server_args += ["--model", args.model]
    print("starting server.py", " ".join(server_args), file=sys.stderr)
    return common_start_server(ROOT, server_args, None, args.startup_timeout)


def shared_options(server_args: str) -> list[str]:
    """The options of --server-args that vLLM's server takes with the same meaning (SHARED_OPTIONS), as given."""
    words, out = server_args.split(), []
    for i, w in enumerate(words):
        name = w.split("=")[0]
        if name in SHARED_OPTIONS:
            out += [w] if "=" in w else [w, words[i + 1]]
    return out


def served_model(url: str) -> str:
    import urllib.request

    with urllib.request.urlopen(f"{url}/v1/models", timeout=10) as r:
        return json.load(r)["data"][0]["id"]


# ---- report -------------------------------------------------------------------------------------------------------

def print_table(rows: list[dict]) -> None:
    ms = lambda v: f"{v * 1000:.0f}" if v is not None else "-"
    print(f"\n{'run':<24} {'req':>4} {'fail':>4} {'req/s':>7} {'out tok/s':>9} {'TTFT p50':>9} {'TTFT p99':>9} "
          f"{'TPOT p50':>9} {'TPOT p99':>9} {'ITL p50':>8} {'ITL p99':>8} {'ITL max':>8}   (times in ms)")
    for r in rows:
        print(f"{r['run']:<24} {r['requests']:>4} {r['failed']:>4} {r['request_throughput']:>7.2f} "
              f"{r['output_tokens_per_s']:>9.1f} {ms(r['ttft_p50_s']):>9} {ms(r['ttft_p99_s']):>9} "
              f"{ms(r['tpot_p50_s']):>9} {ms(r['tpot_p99_s']):>9} {ms(r['itl_p50_s']):>8} {ms(r['itl_p99_s']):>8} "
              f"{ms(r['itl_max_s']):>8}")
        if "long_ttft_p50_s" in r:
            print(f"    the long prompts' TTFT: p50 {ms(r['long_ttft_p50_s'])}, max {ms(r['long_ttft_max_s'])}, "
                  f"{r['long_failed']} failed")
        if "itl_p99_over_control_p50" in r:
            print(f"    ITL p99 / the control's ITL p50 at the same gaps: {r['itl_p99_over_control_p50']:.2f}x")
        for e in r["errors"]:
            print(f"    error: {e}")


def _scaled(value: float | None, scale: float) -> float:
    return value * scale if value is not None else float("nan")


def plot(rows: list[dict], peer_rows: list[dict] | None, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    # (key in the rows, axis label, scale, [(suffix, line style, legend tag)])
    pcts = [("_p50_s", "o-", "p50"), ("_p99_s", "s--", "p99")]
    panels = [("output_tokens_per_s", "output tokens/s", 1, [("", "o-", "")]),
              ("request_throughput", "requests/s", 1, [("", "o-", "")]),
              ("ttft", "TTFT (ms)", 1000, pcts), ("tpot", "TPOT (ms)", 1000, pcts)]
    systems = [("jaxpaged", rows, "C0")] + ([("vLLM-CPU", peer_rows, "C3")] if peer_rows else [])
    fig, axes = plt.subplots(2, 2, figsize=(10, 7))
    for ax, (key, label, scale, lines) in zip(axes.flat, panels, strict=True):
        for system, system_rows, color in systems:
            open_rows = [r for r in system_rows if r["rate"] is not None]
            closed = [r for r in system_rows if r["run"].startswith("closed")]
            rates = [r["rate"] for r in open_rows]
            for suffix, style, tag in lines:
                name = key + suffix
                ax.plot(rates, [_scaled(r[name], scale) for r in open_rows], style, color=color,
                        label=f"{system} Poisson {tag}".strip())
                for r in closed:
                    ax.axhline(_scaled(r[name], scale), color=color, linestyle=style[1:], linewidth=1, alpha=0.5,
                               label=f"{system} {r['run']} {tag}".strip())
        ax.set_xlabel("request rate (req/s)")
        ax.set_ylabel(label)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=6)
    fig.suptitle("OpenAI servers on the same weights: throughput and latency vs request rate")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    print(f"wrote {path}")


# ---- main ---------------------------------------------------------------------------------------------------------

def parse_args():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--url", default=None, help="a running server; without it use --start-server")
    ap.add_argument("--start-server", action="store_true", help="start server.py for the run and stop it after")
    ap.add_argument("--model", default=None, help="model for the started server and the prompts' tokenizer")
    ap.add_argument("--server-args", default="", help="extra server.py options, e.g. '--max-num-seqs 32'")
    ap.add_argument("--startup-timeout", type=float, default=900.0)
    ap.add_argument("--rates", default="0.5,1,2,4", help="Poisson request rates (req/s), comma separated")
    ap.add_argument("--concurrency", type=int, default=16, help="clients in the closed-loop run (0: skip it)")
    ap.add_argument("--long-prompts", type=int, default=4, help="long prompts in the interference run (0: skip it)")
    ap.add_argument("--long-prompt-tokens", type=int, default=1536)
    ap.add_argument("--alone-s", type=float, default=3.0, help="seconds the streams decode before long prompts come")
    ap.add_argument("--stream-tokens", type=int, default=320,
                    help="new tokens of each stream in the interference run (enough to outlast the long prompts)")
    ap.add_argument("--num-prompts", type=int, default=64)
    ap.add_argument("--max-tokens", type=int, default=NEW_TOKENS)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--quick", action="store_true",
                    help=f"16 prompts, 32 new tokens, rates 1 and 4, 8 clients, long prompts of 384 tokens 1 s into 8 "
                         f"streams of 160; server: "
                         f"{QUICK_SERVER_ARGS}")
    ap.add_argument("--peers", default="auto", choices=["auto", "vllm-cpu", "none"],
                    help="auto: vLLM-CPU's server too when its venv is built; vllm-cpu: required")
    ap.add_argument("--vllm-venv", default=vllm_cpu.default_venv(), help="default: %(default)s")
    ap.add_argument("--vllm-dtype", default="bfloat16", choices=["bfloat16", "float32"])
    ap.add_argument("--out", default=os.path.join(ROOT, "benchmarks", "results", "serving.json"))
    args = ap.parse_args()
    if args.quick:
        args.num_prompts, args.max_tokens, args.rates, args.concurrency = 16, 32, "1,4", 8
        args.long_prompt_tokens, args.stream_tokens = min(args.long_prompt_tokens, 384), min(args.stream_tokens, 160)
        args.alone_s = min(args.alone_s, 1.0)  # the streams still decode when the long prompts come
        args.server_args = args.server_args or QUICK_SERVER_ARGS
    if not args.url and not args.start_server:
        ap.error("give --url of a running server or --start-server")
    return args


def run_load(url: str, prompt_sets: list[list[list[int]]], args) -> list[dict]:
    """Every run of the benchmark against the server at `url`: a warm-up, the Poisson rates, the closed loop, the
    interference run and its control. Each run before the control has prompt set of its own (`prompt_sets`, in that
    order): none finds another run's prompts in the prefix cache. The control repeats the interference run's."""
    model = served_model(url)
    sets = iter(prompt_sets)
    # Warm-up: a few requests so lazily compiled shapes do not land in the first run.
    asyncio.run(closed_loop(url, model, next(sets)[:2], 2, 4))
    rows = []
    for rate in [float(x) for x in args.rates.split(",") if x]:
        print(f"Poisson rate {rate} req/s ...", file=sys.stderr)
        results, elapsed = asyncio.run(open_loop(url, model, next(sets), rate, args.max_tokens, args.seed))
        rows.append(summarize(f"rate {rate:g}/s", rate, results, elapsed))
    if args.concurrency > 0:
        print(f"closed loop, {args.concurrency} clients ...", file=sys.stderr)
        results, elapsed = asyncio.run(closed_loop(url, model, next(sets), args.concurrency, args.max_tokens))
        rows.append(summarize(f"closed x{args.concurrency}", None, results, elapsed))
    if args.long_prompts > 0 and args.concurrency > 0:
        prompts = next(sets)
        print(f"interference: {args.concurrency} streams, then {args.long_prompts} prompts of "
              f"{args.long_prompt_tokens} tokens ...", file=sys.stderr)
        longs = long_prompts(prompts, args.long_prompts, args.long_prompt_tokens)
        results, long_results, arrival, elapsed = asyncio.run(interference(
            url, model, prompts, longs, args.concurrency, args.stream_tokens, args.alone_s))
        alone, disturbed = itl_split(results, arrival)
        print("control: the same streams, nothing arriving ...", file=sys.stderr)
        control, _, _, control_elapsed = asyncio.run(interference(
            url, model, prompts, [], args.concurrency, args.stream_tokens, args.alone_s))
        rows.append(summarize(f"streams alone x{args.concurrency}", None, results, elapsed, alone))
        rows.append(summarize(f"+ {args.long_prompts} x {args.long_prompt_tokens}-token prompts", None, results,
                              elapsed, gaps_at(results, disturbed)))
        # what the streams' ITL costs the long prompts: their time to first token, from their arrival
        long_ttft = [r["ttft"] for r in long_results if r["ok"]]
        rows[-1].update(long_ttft_p50_s=_pct(long_ttft, 50), long_ttft_max_s=max(long_ttft, default=None),
                        long_failed=len(long_results) - len(long_ttft))
        rows.append(summarize("control: same gaps alone", None, control, control_elapsed,
                              gaps_at(control, disturbed)))
        disturbed_row, control_row = rows[-2], rows[-1]
        if disturbed_row["itl_p99_s"] and control_row["itl_p50_s"]:
            disturbed_row["itl_p99_over_control_p50"] = disturbed_row["itl_p99_s"] / control_row["itl_p50_s"]
    return rows


def run_jaxpaged(args, prompts: list[list[list[int]]]) -> tuple[list[dict], str]:
    """The runs on jaxpaged's server (started here or at --url); its rows and its URL."""
    proc, url = start_server(args) if args.start_server else (None, args.url)
    try:
        return run_load(url, prompts, args), url
    finally:
        if proc is not None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(60)
            except subprocess.TimeoutExpired:
                proc.kill()


def run_peer(args, prompts: list[list[list[int]]]) -> dict:
    """The same runs on vLLM-CPU's server over the same weights; its rows, command and log tail (or the error)."""
    from export_hf import hf_directory

    model_dir = hf_directory(args.model)
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    with tempfile.NamedTemporaryFile("w+", prefix="jaxpaged-vllm-serve-", suffix=".log") as log:
        proc, command = vllm_cpu.start_server(model_dir, port, args.vllm_dtype, shared_options(args.server_args),
                                              args.vllm_venv, log.name)
        try:
            try:
                wait_healthy(proc, url, args.startup_timeout, "vLLM-CPU's server")
            except RuntimeError as e:
                return {"error": str(e), "command": command, "log_tail": log.read().splitlines()[-30:]}
            rows = run_load(url, prompts, args)
        finally:
            vllm_cpu.stop_server(proc)
        return {"rows": rows, "command": command, "version": vllm_cpu.VLLM_VERSION, "dtype": args.vllm_dtype,
                "model_dir": model_dir, "log_tail": log.read().splitlines()[-15:]}


def print_side_by_side(ours: list[dict], peer: list[dict]) -> None:
    ms = lambda v: f"{v * 1000:.0f}" if v is not None else "-"
    print(f"\n{'run':<24} {'out tok/s':>19} {'x vLLM':>7} {'TTFT p50':>13} {'TPOT p50':>11} {'ITL p99':>11} "
          f"{'failed':>7}   (jaxpaged / vLLM-CPU, times in ms)")
    for a, b in zip(ours, peer, strict=True):
        ratio = a["output_tokens_per_s"] / b["output_tokens_per_s"] if b["output_tokens_per_s"] else float("nan")
        print(f"{a['run']:<24} {a['output_tokens_per_s']:>9.1f} / {b['output_tokens_per_s']:<7.1f} {ratio:>7.2f} "
              f"{ms(a['ttft_p50_s']):>6} / {ms(b['ttft_p50_s']):<4} {ms(a['tpot_p50_s']):>4} / "
              f"{ms(b['tpot_p50_s']):<4} {ms(a['itl_p99_s']):>4} / {ms(b['itl_p99_s']):<4} "
              f"{a['failed']:>3} / {b['failed']}")


def main():
    args = parse_args()
    from jaxpaged.loader import load_model

    tokenizer = load_model(args.model).tokenizer
    runs = 2 + len([x for x in args.rates.split(",") if x]) + 1  # warm-up, rates, closed loop, interference
    prompt_sets = [workload_prompts(tokenizer, args.num_prompts, seed=args.seed + i) for i in range(runs)]
    prompts = prompt_sets[1]
    peer_state = "skipped (--peers none)" if args.peers == "none" else None
    if args.peers != "none" and not args.start_server:
        peer_state = "skipped: the peer runs only with --start-server (the same weights, started here)"
    elif args.peers != "none" and not vllm_cpu.is_installed(args.vllm_venv):
        if args.peers == "vllm-cpu":
            sys.exit(vllm_cpu.not_installed_message(args.vllm_venv))
        peer_state = vllm_cpu.not_installed_message(args.vllm_venv)
    rows, url = run_jaxpaged(args, prompt_sets)
    peer = None
    if peer_state is None:
        print("vLLM-CPU's server ...", file=sys.stderr)
        peer = run_peer(args, prompt_sets)
        peer_state = "ran" if "rows" in peer else f"failed: {peer['error']}"
    cpu = cpu_name()
    print(f"\nworkload: {len(prompts)} prompts a run (a set of its own each), {sum(map(len, prompts))} prompt tokens "
          f"in the first, {args.max_tokens} new tokens each (greedy, EOS ignored, streamed); CPU: {cpu}")
    print(f"jaxpaged: server.py {args.server_args or '(defaults)'} ({url})")
    print_table(rows)
    if peer and "rows" in peer:
        print(f"\nvLLM-CPU {peer['version']}: {peer['command']}")
        print_table(peer["rows"])
        print_side_by_side(rows, peer["rows"])
    else:
        print(f"\nvLLM-CPU: {peer_state}")
        for line in (peer or {}).get("log_tail", [])[-10:]:
            print("    " + line)
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump({"rows": rows, "num_prompts": len(prompts), "max_tokens": args.max_tokens,
                   "model": args.model or "default", "cpu": cpu, "machine": f"{os.cpu_count()} CPU cores",
                   "server_args": args.server_args, "quick": args.quick, "vllm_cpu": peer_state, "peer": peer},
                  f, indent=2)
    print(f"wrote {args.out}")
    plot(rows, (peer or {}).get("rows"), os.path.splitext(args.out)[0] + ".png")


if __name__ == "__main__":
    main()
