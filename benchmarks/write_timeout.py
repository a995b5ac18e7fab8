"""How long a stream whose client reads nothing keeps its KV blocks (issue #28): a real `server.py` on the tiny
random-weight model of tests/tiny_hf.py, `--write-timeout 2`, and raw-socket clients on 127.0.0.1 that send one
streamed completions request (n=16, 4032 tokens each, ignore_eos) and never read, with the kernel's default receive
buffer and with the largest one it gives. Measured from the first generated token to every block free.

    python benchmarks/write_timeout.py [--root PATH] [--out PATH]

--root runs another checkout's server.py (e.g. one from before the fix) on the same model, for comparison.
Prints a table and writes benchmarks/results/write_timeout.json.
"""

from __future__ import annotations

import argparse
import json
import platform
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.common import get_json, print_table, start_server, write_json  # noqa: E402
from tests.tiny_hf import make_tiny_hf_model  # noqa: E402

WRITE_TIMEOUT = 2.0
MAX_MODEL_LEN = 4096
N, MAX_TOKENS = 16, MAX_MODEL_LEN - 64


def cpu_model() -> str:
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True, timeout=10).stdout
    except OSError:
        return platform.machine()
    return next((line.split(":", 1)[1].strip() for line in out.splitlines() if line.startswith("Model name")),
                platform.machine())


SERVER_ARGS = ["--served-model-name", "tiny", "--dtype", "float32", "--no-precompile", "--max-num-seqs", "16",
               "--max-num-batched-tokens", "256", "--max-model-len", str(MAX_MODEL_LEN), "--block-size", "16",
               "--kv-cache-memory", "48MiB", "--write-timeout", str(WRITE_TIMEOUT)]


def wait(predicate, timeout: float):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.05)
    return None


def never_read(url: str, rcvbuf: int | None) -> dict:
    before = get_json(f"{url}/stats")
    body = json.dumps({"model": "tiny", "prompt": "The lighthouse keeper kept a ledger", "n": N,
                       "max_tokens": MAX_TOKENS, "ignore_eos": True, "temperature": 1.0, "stream": True}).encode()
    sock = socket.socket()
    if rcvbuf is not None:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, rcvbuf)
    sock.connect(("127.0.0.1", int(url.rsplit(":", 1)[1])))
    try:
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                     b"Content-Length: %d\r\n\r\n" % len(body) + body)
        wait(lambda: get_json(f"{url}/stats")["generation_tokens"] > before["generation_tokens"], 120)
        t0 = time.monotonic()
        after = wait(lambda: s if (s := get_json(f"{url}/stats"))["num_in_flight"] == 0 and s["num_used"] == 0
                     else None, 300)
        held_s = time.monotonic() - t0
    finally:
        sock.close()
    return {"rcvbuf": "default" if rcvbuf is None else f"{rcvbuf >> 20} MiB asked",
            "blocks_held_s": held_s if after else None,
            "tokens_generated": (after or get_json(f"{url}/stats"))["generation_tokens"] - before["generation_tokens"],
            "tokens_asked": N * MAX_TOKENS}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--root", type=Path, default=ROOT, help="checkout whose server.py to run")
    p.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "write_timeout.json"))
    args = p.parse_args()
    tmp = Path(tempfile.mkdtemp())
    model = make_tiny_hf_model(tmp / "model", "llama", max_position_embeddings=MAX_MODEL_LEN)
    with open(tmp / "server.log", "w") as log:
        proc, url = start_server(args.root.resolve(), ["--model", model, *SERVER_ARGS], log)
        try:
            never_read(url, None)  # compiles the step shapes this request needs; not counted
            rows = [never_read(url, rcvbuf) for rcvbuf in (None, 64 * 2**20)]
        finally:
            proc.terminate()
            proc.wait(60)
    cpu = cpu_model()
    print(f"server.py of {args.root}, --write-timeout {WRITE_TIMEOUT:g} s, tiny model, {cpu}")
    print_table(rows, [("rcvbuf", "client receive buffer", "s"), ("blocks_held_s", "blocks held (s)", ".1f"),
                       ("tokens_generated", "tokens generated", "d"), ("tokens_asked", "of", "d")])
    write_json(args.out, {"cpu": cpu, "root": str(args.root), "write_timeout_s": WRITE_TIMEOUT, "rows": rows})


if __name__ == "__main__":
    main()
