"""A real `server.py` process for the server tests, and the small HTTP helpers they share: raw sockets stand in for
clients that misbehave in ways an HTTP library would not. Each test module starts the processes it needs (its flags
differ) once, as a module-scoped fixture."""

from __future__ import annotations

import json
import re
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import openai

from tests import ROOT

MAX_BODY = 20_000

MAX_MODEL_LEN = 128

MODEL = "tiny"

ENGINE_ARGS = ["--dtype", "float32", "--no-precompile", "--max-num-seqs", "16", "--max-num-batched-tokens", "256",
               "--max-model-len", str(MAX_MODEL_LEN), "--block-size", "16", "--kv-cache-memory", "4MiB"]

PROMPT = "The lighthouse keeper kept a ledger of every ship"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    def __init__(self, model_dir: Path, log_path: Path, *extra: str, startup_timeout: float = 240.0):
        port = free_port()
        self.url = f"http://127.0.0.1:{port}"
        self.log_path = log_path
        cmd = [sys.executable, str(ROOT / "server.py"), "--model", str(model_dir), "--port", str(port),
               "--served-model-name", MODEL, "--max-body-bytes", str(MAX_BODY), *ENGINE_ARGS, *extra]
        self._log = open(log_path, "w")  # noqa: SIM115 (closed in stop())
        self.proc = subprocess.Popen(cmd, cwd=ROOT, stdout=self._log, stderr=subprocess.STDOUT)
        deadline = time.time() + startup_timeout
        while time.time() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited with {self.proc.returncode}:\n{self.log()}")
            try:
                if get(f"{self.url}/health")[0] == 200:
                    return
            except OSError:
                pass
            time.sleep(0.5)
        self.stop()
        raise RuntimeError(f"server not healthy after {startup_timeout} s:\n{self.log()}")

    def log(self) -> str:
        return self.log_path.read_text()[-4000:]

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._log.close()

    def client(self, api_key: str = "none") -> openai.OpenAI:
        return openai.OpenAI(base_url=f"{self.url}/v1", api_key=api_key, max_retries=0, timeout=120)


def request(method: str, url: str, body: bytes | None = None, headers: dict | None = None) -> tuple[int, dict]:
    req = urllib.request.Request(url, data=body, method=method,
                                 headers={"Content-Type": "application/json", **(headers or {})})
    try:
        with urllib.request.urlopen(req, timeout=120) as r:
            status, raw = r.status, r.read()
    except urllib.error.HTTPError as e:
        status, raw = e.code, e.read()
    try:
        return status, json.loads(raw)
    except ValueError:
        return status, {"raw": raw.decode(errors="replace")}


def get(url: str) -> tuple[int, dict]:
    return request("GET", url)


def post(url: str, body: dict | bytes, headers: dict | None = None) -> tuple[int, dict]:
    return request("POST", url, body if isinstance(body, bytes) else json.dumps(body).encode(), headers)


def assert_idle(url: str, headers: dict | None = None, timeout: float = 10.0) -> None:
    """The server at `url` holds nothing: no request in flight, running or waiting, no KV block in use (a refused
    request left nothing behind)."""
    deadline = time.time() + timeout
    while True:
        stats = request("GET", f"{url}/stats", None, headers)[1]
        idle = stats["num_in_flight"] == stats["num_used"] == stats["num_running"] == stats["num_waiting"] == 0
        if idle or time.time() > deadline:
            break
        time.sleep(0.05)
    assert idle, stats


def connect(server: Server, rcvbuf: int | None = None) -> socket.socket:
    sock = socket.socket()
    if rcvbuf is not None:  # a small window: the server's writes block sooner when this client does not read
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, rcvbuf)
    sock.settimeout(30)
    sock.connect(("127.0.0.1", int(server.url.rsplit(":", 1)[1])))
    return sock


def http_bytes(method: str, path: str, body: bytes = b"", headers: dict | None = None,
               content_length: int | None = None) -> bytes:
    lines = [f"{method} {path} HTTP/1.1", "Host: 127.0.0.1", "Content-Type: application/json",
             f"Content-Length: {len(body) if content_length is None else content_length}"]
    lines += [f"{k}: {v}" for k, v in (headers or {}).items()]
    return "\r\n".join(lines).encode() + b"\r\n\r\n" + body


def read_response(sock: socket.socket) -> tuple[int, dict]:
    """One response with a Content-Length body, leaving the connection open."""
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = sock.recv(65536)
        assert chunk, f"connection closed mid-response: {data!r}"
        data += chunk
    head, body = data.split(b"\r\n\r\n", 1)
    length = int(re.search(rb"(?i)content-length: *(\d+)", head).group(1))
    while len(body) < length:
        body += sock.recv(65536)
    return int(head.split()[1]), json.loads(body)


def read_until_closed(sock: socket.socket, timeout: float) -> tuple[bytes, float]:
    """Everything the server sends until it closes the connection, and how many seconds that took."""
    t0 = time.monotonic()
    deadline, data = t0 + timeout, b""
    while True:
        sock.settimeout(max(0.01, deadline - time.monotonic()))
        try:
            chunk = sock.recv(65536)
        except ConnectionResetError:
            chunk = b""
        except TimeoutError:
            raise AssertionError(f"the server kept the connection open for {timeout} s; got {data[:200]!r}") from None
        if not chunk:
            return data, time.monotonic() - t0
        data += chunk


def wait_for(predicate, timeout: float, what: str):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.1)
    raise AssertionError(f"not within {timeout} s: {what}")


def still_serves(server) -> None:
    assert get(f"{server.url}/health") == (200, {"status": "ok"})
    status, body = post(f"{server.url}/v1/completions", {"model": MODEL, "prompt": "Hello", "max_tokens": 2,
                                                         "temperature": 0, "ignore_eos": True})
    assert status == 200 and body["usage"]["completion_tokens"] == 2, body
