"""The server's own cost per decode step: the OpenAI server (`server.py`) on a tiny random model (1 layer, tests/
tiny_hf.py, so the device's work is small) with N clients streaming at once, against the same engine without the
server (`LLM.generate`, in a subprocess) on the same prompts. What the server adds to a step is what an accelerator
would wait for: the event loop (reader tasks, SSE, sockets) and the engine thread's hand-off share the GIL and the
cores with the step loop. The server runs with `--max-decode-slowdown 0`: its step pacer, which bounds a step that
prefills beside decoding streams by the decode step it predicts, would admit this tiny model's prompts a few a step
(its decode step is mostly fixed cost), and the N streams would never all run at once.

    python benchmarks/serving_host.py                              # 64 and 256 streams; results/serving_host.json
    python benchmarks/serving_host.py --compare /path/to/checkout  # that checkout's server.py too, same run

Columns: steps/s (the server's /stats `steps` over the streamed phase), output tokens/s, and the
server process's CPU per step by thread (from /proc: the event loop's main thread, the engine thread, XLA's
worker threads, the rest), then the client process's own CPU per step (on a 2-core machine the client shares the
cores: it is shown so the reader can tell), and the SSE events per stream over the tokens it got (below 1: a reader
that fell behind got several steps' tokens in one event). `--py-spy PATH` adds a sampled profile of the server's
threads (top frames by self time) to the output.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import json
import os
import re
import resource
import shutil
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path

import aiohttp

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.common import RESULTS_DIR, cpu_name, print_table, start_server, write_json  # noqa: E402
from tests.tiny_hf import make_tiny_hf_model  # noqa: E402

PROMPT = "The lighthouse keeper kept a ledger of every ship"
MAX_MODEL_LEN = 512
ENGINE = {"dtype": "float32", "max_num_batched_tokens": 2048, "max_model_len": MAX_MODEL_LEN,
          "kv_cache_memory": "128MiB"}


def server_args(model: str, num_seqs: int) -> list[str]:
    flags = [f"--{k.replace('_', '-')}={v}" for k, v in ENGINE.items()]
    return ["--model", model, "--served-model-name", "tiny", "--max-num-seqs", str(num_seqs),
            "--max-decode-slowdown", "0", *flags]


# ---- CPU time by thread, from /proc --------------------------------------------------------------------------------

def thread_cpu(pid: int) -> dict[str, float]:
    """CPU seconds (user + system) of each thread of `pid`, summed by role: event loop (the main thread), engine,
    XLA (its worker threads), other."""
    tick = os.sysconf("SC_CLK_TCK")
    roles: dict[str, float] = collections.defaultdict(float)
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            with open(f"/proc/{pid}/task/{tid}/stat") as f:
                stat = f.read()
        except OSError:  # the thread ended
            continue
        name = stat[stat.index("(") + 1:stat.rindex(")")]
        fields = stat[stat.rindex(")") + 2:].split()
        seconds = (int(fields[11]) + int(fields[12])) / tick  # utime, stime
        role = ("event loop" if int(tid) == pid else "engine" if name.startswith("jaxpaged-engin")
                else "xla" if name.startswith(("xla", "tf_", "XLA", "pjrt")) else "other")
        roles[role] += seconds
    return roles


# ---- the clients ---------------------------------------------------------------------------------------------------

async def one_stream(port: int, i: int, max_tokens: int) -> tuple[int, int]:
    """Streams one completion over a raw socket, read in large pieces and not parsed (a parsing client would share
    the cores with the server it measures); returns (SSE events, tokens in its usage)."""
    body = json.dumps({"model": "tiny", "prompt": f"{PROMPT} {i}", "max_tokens": max_tokens, "ignore_eos": True,
                       "temperature": 0.0, "stream": True, "stream_options": {"include_usage": True}}).encode()
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                 b"Connection: close\r\nContent-Length: %d\r\n\r\n" % len(body) + body)
    events, tail, head = 0, b"", None
    while piece := await reader.read(1 << 16):
        head = head or piece[:12]
        data = tail + piece
        events += data.count(b"data: {") - tail.count(b"data: {")
        tail = data[-4096:]
    writer.close()
    if head != b"HTTP/1.1 200" or b"completion_tokens" not in tail:
        raise RuntimeError(f"stream {i} failed: {tail[-500:]!r}")
    tokens = int(re.findall(rb'"completion_tokens": ?(\d+)', tail)[-1])
    return events - 1, tokens  # the usage event carries no text


async def streamed(url: str, num_streams: int, max_tokens: int, pid: int) -> dict:
    """N streams at once; the rates are taken over the steady part, while all N decode (between the first and the
    last /stats snapshot, polled every 50 ms, that finds N running and none waiting)."""
    port = int(url.rsplit(":", 1)[1])
    async with aiohttp.ClientSession() as session:
        await asyncio.gather(*[one_stream(port, i, 8) for i in range(8)])  # warm: the step shapes compile
        window: list[tuple[float, dict, dict, float]] = []
        streams = asyncio.gather(*[one_stream(port, i, max_tokens) for i in range(num_streams)])
        while not streams.done():
            async with session.get(f"{url}/stats") as r:
                stats = await r.json()
            if stats["num_running"] == num_streams and stats["num_waiting"] == 0:
                own = resource.getrusage(resource.RUSAGE_SELF)
                window.append((time.perf_counter(), stats, thread_cpu(pid), own.ru_utime + own.ru_stime))
            await asyncio.sleep(0.05)
        got = await streams
    if len(window) < 2:
        raise RuntimeError("no steady window: raise --max-tokens")
    (t0, s0, cpu0, own0), (t1, s1, cpu1, own1) = window[0], window[-1]
    wall, steps = t1 - t0, s1["steps"] - s0["steps"]
    row = {"steps_per_s": steps / wall, "tok_per_s": (s1["generation_tokens"] - s0["generation_tokens"]) / wall,
           "events_per_token": sum(e for e, _ in got) / sum(t for _, t in got), "steps": steps, "wall_s": wall}
    for role in ("event loop", "engine", "xla", "other"):
        row[f"cpu_{role.replace(' ', '_')}_ms"] = 1e3 * (cpu1.get(role, 0.0) - cpu0.get(role, 0.0)) / steps
    row["cpu_client_ms"] = 1e3 * (own1 - own0) / steps
    return row


# ---- the engine alone ----------------------------------------------------------------------------------------------

ALONE = textwrap.dedent("""
    import json, sys, time
    from jaxpaged import LLM, SamplingParams
    model, n, max_tokens, engine = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), json.loads(sys.argv[4])
    llm = LLM(model, max_num_seqs=n, **engine)
    prompts = [f"{sys.argv[5]} {i}" for i in range(n)]
    llm.generate(prompts[:8], SamplingParams(max_tokens=8, ignore_eos=True, temperature=0.0), use_tqdm=False)
    before = llm.engine.stats()["steps"]
    t0 = time.perf_counter()
    outs = llm.generate(prompts, SamplingParams(max_tokens=max_tokens, ignore_eos=True, temperature=0.0),
                        use_tqdm=False)
    wall = time.perf_counter() - t0
    steps = llm.engine.stats()["steps"] - before
    tokens = sum(len(o.outputs[0].token_ids) for o in outs)
    print(json.dumps({"steps_per_s": steps / wall, "tok_per_s": tokens / wall, "steps": steps, "wall_s": wall}))
""")


def engine_alone(root: Path, model: str, num_streams: int, max_tokens: int) -> dict:
    done = subprocess.run([sys.executable, "-c", ALONE, model, str(num_streams), str(max_tokens), json.dumps(ENGINE),
                           PROMPT], cwd=root, capture_output=True, text=True, timeout=600)
    if done.returncode != 0:
        raise RuntimeError(done.stderr[-3000:])
    return json.loads(done.stdout.strip().splitlines()[-1])


# ---- a sampled profile ---------------------------------------------------------------------------------------------

def profile_summary(raw_path: str, top: int = 12) -> dict[str, list[tuple[str, int]]]:
    """py-spy's raw (collapsed) stacks -> each thread's top frames by self samples."""
    frames: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)
    with open(raw_path) as f:
        for line in f:
            stack, _, count = line.rstrip().rpartition(" ")
            if not stack:
                continue
            parts = stack.split(";")
            thread = parts[0].split(": ", 1)[-1]
            frames[thread][parts[-1]] += int(count)
    return {t: c.most_common(top) for t, c in frames.items()}


async def profiled(url: str, num_streams: int, max_tokens: int, pid: int, py_spy: str, out: str) -> dict:
    spy = subprocess.Popen([py_spy, "record", "-p", str(pid), "-r", "200", "-f", "raw", "-o", out, "--threads",
                            "--nonblocking"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    time.sleep(1.0)
    try:
        await streamed(url, num_streams, max_tokens, pid)
    finally:
        spy.send_signal(2)
        spy.wait(30)
    return profile_summary(out)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--streams", type=int, nargs="+", default=[64, 256])
    p.add_argument("--max-tokens", type=int, default=256)
    p.add_argument("--repeats", type=int, default=3, help="runs per server (the table shows the median)")
    p.add_argument("--compare", type=Path, action="append", default=[], help="another checkout's server.py too")
    p.add_argument("--py-spy", default=shutil.which("py-spy"), help="py-spy's path: a profile of the last server")
    p.add_argument("--out", default=os.path.join(RESULTS_DIR, "serving_host.json"))
    args = p.parse_args()
    tmp = Path(tempfile.mkdtemp())
    model = make_tiny_hf_model(tmp / "model", "llama", num_hidden_layers=1, max_position_embeddings=MAX_MODEL_LEN)
    roots = [ROOT, *[r.resolve() for r in args.compare]]
    rows, profile = [], {}
    for n in args.streams:
        rows.append({"streams": n, "what": "engine alone (LLM.generate)", **engine_alone(ROOT, model, n,
                                                                                       args.max_tokens)})
        for root in roots:
            with open(tmp / "server.log", "w") as log:
                proc, url = start_server(root, server_args(model, n), log)
                try:
                    runs = [asyncio.run(streamed(url, n, args.max_tokens, proc.pid)) for _ in range(args.repeats)]
                    row = sorted(runs, key=lambda r: r["steps_per_s"])[len(runs) // 2]  # the median run
                    row["steps_per_s_runs"] = [r["steps_per_s"] for r in runs]
                    if args.py_spy and root == ROOT and n == args.streams[-1]:
                        profile = asyncio.run(profiled(url, n, args.max_tokens, proc.pid, args.py_spy,
                                                       str(tmp / "spy.txt")))
                finally:
                    proc.terminate()
                    proc.wait(60)
            label = "server.py" if root == ROOT else f"server.py of {root}"
            rows.append({"streams": n, "what": label, **row})
    cpu = cpu_name()
    print(f"tiny model (1 layer), {args.max_tokens} tokens per stream, greedy; {cpu}")
    print_table(rows, [("streams", "streams", "d"), ("what", "what", "s"), ("steps_per_s", "steps/s", ".0f"),
                       ("tok_per_s", "output tok/s", ".0f"), ("cpu_event_loop_ms", "event loop ms/step", ".2f"),
                       ("cpu_engine_ms", "engine thread ms/step", ".2f"), ("cpu_xla_ms", "XLA threads ms/step", ".2f"),
                       ("cpu_other_ms", "other ms/step", ".2f"), ("cpu_client_ms", "client ms/step", ".2f"),
                       ("events_per_token", "SSE events/token", ".2f")])
    for thread, top in profile.items():
        print(f"\npy-spy, server at {args.streams[-1]} streams, thread {thread}: samples by frame (self)")
        for frame, count in top:
            print(f"  {count:6d}  {frame}")
    write_json(args.out, {"cpu": cpu, "max_tokens": args.max_tokens, "engine": ENGINE, "rows": rows,
                          "profile": profile, "roots": [str(r) for r in roots]})


if __name__ == "__main__":
    main()
