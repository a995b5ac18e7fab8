"""Helpers the benchmark scripts share: per-step stats sampling, tables and JSON output."""

from __future__ import annotations

import json
import os
import socket
import statistics
import subprocess
import time
import urllib.request


class StepSampler:
    """Wraps an engine's step() to record engine.stats() (plus `extra(engine)`) after every step."""

    def __init__(self, engine, extra=None):
        self.engine, self.extra, self.rows = engine, extra, []
        self._step = engine.step
        engine.step = self._sampled_step

    def _sampled_step(self):
        outs = self._step()
        row = self.engine.stats()
        if self.extra is not None:
            row.update(self.extra(self.engine))
        self.rows.append(row)
        return outs

    def mean(self, key: str) -> float:
        vals = [r[key] for r in self.rows if r["num_running"] > 0]
        return sum(vals) / len(vals) if vals else 0.0

    def peak(self, key: str) -> float:
        return max((r[key] for r in self.rows), default=0)

    def close(self):
        self.engine.step = self._step


def trace_events(run, calls: int) -> list[dict]:
    """The Chrome-trace events of a jax.profiler trace around `calls` calls of run() (each waited for); [] when the
    profiler wrote no trace."""
    import glob
    import gzip
    import tempfile

    import jax

    with tempfile.TemporaryDirectory() as directory:
        with jax.profiler.trace(directory):
            for _ in range(calls):
                jax.block_until_ready(run())
        paths = glob.glob(f"{directory}/**/*.trace.json.gz", recursive=True)
        if not paths:
            return []
        with gzip.open(paths[0]) as f:
            return json.load(f)["traceEvents"]


def top_xla_ops(events: list[dict], hlo: str, calls: int, top: int) -> list[dict]:
    """The `top` XLA operations of a step by the profiler's own timing (`events`: trace_events over `calls` calls;
    `hlo`: the executable's as_text()), each with ms and calls per step, its output shape and its HLO op_name (or
    the HLO instruction when it has none)."""
    import collections
    import re

    total: collections.Counter = collections.Counter()
    count: collections.Counter = collections.Counter()
    for e in events:
        name = e.get("name", "")
        if e.get("ph") == "X" and not name.startswith(("$", "ThunkExecutor", "SlinkyThreadPool", "while")):
            total[name] += e["dur"]
            count[name] += 1
    rows = []
    for name, us in total.most_common(top):
        line = re.search(rf"^\s*%{re.escape(name)} = (\([^)]*\)|\S+) (.*)$", hlo, re.MULTILINE)
        op = re.search(r'op_name="([^"]*)"', line.group(2)) if line else None
        rows.append({"op": name, "ms_per_step": us / 1000 / calls, "calls_per_step": count[name] // calls,
                     "shape": line.group(1) if line else "",
                     "op_name": op.group(1) if op else (line.group(2).split("(")[0].split()[-1] if line else "")})
    return rows


def timed(fn):
    t0 = time.perf_counter()
    result = fn()
    return result, time.perf_counter() - t0


def print_table(rows: list[dict], columns: list[tuple[str, str, str]]) -> None:
    """columns: (key, header, format)."""
    print(" | ".join(h for _, h, _ in columns))
    print(" | ".join("---" for _ in columns))
    for r in rows:
        print(" | ".join(format(r[k], f) if r.get(k) is not None else "-" for k, _, f in columns))


RESULTS_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")  # where --out defaults go


def write_json(path: str, payload: dict) -> None:
    os.makedirs(os.path.dirname(path), exist_ok=True)
    payload = {"machine": f"{os.cpu_count()} CPU cores (no accelerator)", **payload}
    with open(path, "w") as f:
        json.dump(payload, f, indent=2)
    print(f"wrote {path}")


def cpu_name() -> str:
    """lscpu's model name, family and model, and the flags that pick the native kernels' paths."""
    out = subprocess.run(["lscpu"], capture_output=True, text=True).stdout
    fields = {ln.split(":", 1)[0].strip(): ln.split(":", 1)[1].strip() for ln in out.splitlines() if ":" in ln}
    flags = fields.get("Flags", "").split()
    extras = [f for f in ("avx512f", "avx512_bf16", "avx512_vnni", "amx_bf16", "amx_int8") if f in flags]
    family = f" family {fields['CPU family']} model {fields.get('Model', '?')}" if "CPU family" in fields else ""
    return f"{fields.get('Model name', '?')}{family} ({', '.join(extras) or 'no avx512'})"


def time_call(fn, args, *, warmup: int, samples: int, reps: int) -> float:
    """Median seconds per call of a jitted `fn` over `samples` timings of `reps` back-to-back calls, after `warmup`
    calls."""
    import jax

    for _ in range(warmup):
        jax.block_until_ready(fn(*args))
    times = []
    for _ in range(samples):
        t0 = time.perf_counter()
        for _ in range(reps):
            out = fn(*args)
        jax.block_until_ready(out)
        times.append((time.perf_counter() - t0) / reps)
    return statistics.median(times)


def free_port() -> int:
    """A TCP port free on 127.0.0.1 now, for a server the benchmark starts."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def get_json(url: str) -> dict:
    with urllib.request.urlopen(url, timeout=30) as r:
        return json.loads(r.read())


def start_server(root, server_args: list[str], log, timeout: float = 300) -> tuple[subprocess.Popen, str]:
    """`root`/server.py with `server_args` (and a free --port), output to `log` (None: this process's), once its
    /health answers (up to `timeout` seconds: it compiles its step shapes first). Returns the process and its URL."""
    import sys

    port = free_port()
    proc = subprocess.Popen([sys.executable, os.path.join(str(root), "server.py"), "--port", str(port), *server_args],
                            cwd=root, stdout=log, stderr=subprocess.STDOUT if log else None)
    url = f"http://127.0.0.1:{port}"
    wait_healthy(proc, url, timeout)
    return proc, url


def wait_healthy(proc: subprocess.Popen, url: str, timeout: float, name: str = "the server") -> None:
    """Returns once `url`/health answers 200 (jaxpaged's server and vLLM's); RuntimeError if the process ends first
    or `timeout` seconds pass (then the process is killed)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{name} exited with {proc.returncode} during start-up")
        try:
            with urllib.request.urlopen(f"{url}/health", timeout=2) as r:
                if r.status == 200:
                    return
        except OSError:
            pass
        time.sleep(0.5)
    proc.kill()
    raise RuntimeError(f"{name} did not answer /health within {timeout:g} s")
