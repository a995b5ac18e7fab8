"""Structured-output specs checked where they cannot hurt anyone else.

llguidance compiles grammars in native code that recurses once per rule or reference: a chain a few thousand long
overflows the stack and kills the whole process (SIGSEGV), and a large spec can take seconds. So a spec passes two
gates before the server or the engine compiles it:

1. Input limits, in pure Python and without recursion (`check_limits`): its size, its JSON nesting depth, and its
   number of `$ref`s, definitions and grammar rules.
2. llguidance itself, in a worker process (`grammar_worker.py`) whose threads have a quarter of the caller's stack,
   an address-space limit and a deadline (`GrammarWorkers`). It returns the compiled grammar, and checks it against
   the engine's tokenizer (compile + first token mask) before the engine builds its own matcher. A spec that
   crashes, exhausts or outlasts the worker is refused (ValueError naming the field); the worker is restarted.

Results are cached by a digest of the spec, so a repeated spec (good or bad) costs nothing the second time.
"""

from __future__ import annotations

import atexit
import collections
import hashlib
import json
import logging
import os
import re
import resource
import select
import struct
import subprocess
import sys
import threading
import time

from jaxpaged import client_json

logger = logging.getLogger(__name__)

MAX_SPEC_CHARS = 128 * 1024  # a schema, regex, grammar or the choices together, as text
MAX_SPEC_DEPTH = 64  # JSON nesting of a schema (a schema level is about two JSON levels: properties -> name)
MAX_SPEC_REFS = 256  # "$ref"s in a schema (or in a grammar's inline %json)
MAX_SPEC_DEFINITIONS = 512  # entries of "$defs" / "definitions" in a schema
MAX_GRAMMAR_RULES = 512  # rules of a Lark / GBNF grammar
CHECK_TIMEOUT_S = 5.0  # one compile in the worker; also the longest a check waits for a free worker
TOKENIZER_TIMEOUT_S = 120.0  # loading a tokenizer into a fresh worker (1 s for 50k tokens, 10 s for 262k)
# Address space of a worker: with a tokenizer loaded its peak is 150 MB (50k tokens) to 620 MB (Gemma 3's 262k).
WORKER_MEMORY_BYTES = 2 * 2**30
NUM_WORKERS = 2
MAX_CACHED_RESULTS = 4096
MAX_CACHED_GRAMMAR_CHARS = 64 * 2**20

_WORKER_SCRIPT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "grammar_worker.py")
# A Lark rule ("name:", "?name:", "name.2:", "name{x}:") or a GBNF one ("name ::=") at the start of a line.
_RULE = re.compile(r"^[ \t]*[?!]?[A-Za-z_][A-Za-z0-9_-]*(?:\{[^}\n]*\})?(?:\.-?\d+)?[ \t]*(?::|::=)", re.MULTILINE)


class GrammarBusyError(RuntimeError):
    """Every grammar worker stayed busy for the whole check timeout (HTTP 429: retry later)."""


# ---- gate 1: input limits -----------------------------------------------------------------------------------------

def check_limits(field: str, kind: str, value) -> None:
    """Refuses a spec beyond the input limits before anything compiles it: ValueError naming `field`.
    `value` is the spec as given (a JSON schema as a dict or its text, a list of choices, a regex or grammar)."""
    if kind == "json":
        if isinstance(value, str):
            _check_size(field, len(value))
            value = client_json.loads(value, field, max_depth=MAX_SPEC_DEPTH)
        if not isinstance(value, dict):
            raise ValueError(f"{field} must be a JSON schema: a JSON object")
        _check_schema(field, value)
    elif kind == "choice":
        _check_size(field, sum(len(c) + 4 for c in value))
    elif kind in ("regex", "grammar"):
        _check_size(field, len(value))
        if kind == "grammar":
            rules = len(_RULE.findall(value))
            if rules > MAX_GRAMMAR_RULES:
                raise ValueError(f"{field} has {rules} rules; at most {MAX_GRAMMAR_RULES} are allowed")
            refs = value.count('"$ref"')
            if refs > MAX_SPEC_REFS:
                raise ValueError(f"{field} has {refs} $refs; at most {MAX_SPEC_REFS} are allowed")


def _check_size(field: str, chars: int) -> None:
    if chars > MAX_SPEC_CHARS:
        raise ValueError(f"{field} is {chars} characters long; at most {MAX_SPEC_CHARS} are allowed")


def _check_schema(field: str, schema: dict) -> None:
    """Depth, size, $refs and definitions of a schema, walked without recursion (a dict nested 10,000 deep is
    refused, not a RecursionError)."""
    chars = refs = definitions = 0
    stack = [(schema, 1)]
    while stack:
        node, depth = stack.pop()
        if depth > MAX_SPEC_DEPTH and isinstance(node, (dict, list, tuple)):
            raise ValueError(f"{field} is nested more than {MAX_SPEC_DEPTH} levels deep")
        if isinstance(node, dict):
            for k, v in node.items():
                if not isinstance(k, str):
                    raise ValueError(f"{field} must have string keys, not {type(k).__name__}")
                chars += len(k) + 4
                if k == "$ref":
                    refs += 1
                elif k in ("$defs", "definitions") and isinstance(v, dict):
                    definitions += len(v)
                stack.append((v, depth + 1))
        elif isinstance(node, (list, tuple)):
            chars += 2 + len(node)
            stack.extend((v, depth + 1) for v in node)
        elif isinstance(node, str):
            chars += len(node) + 2
        elif node is None or isinstance(node, (bool, int, float)):
            chars += 8
        else:
            raise ValueError(f"{field} holds a {type(node).__name__}, which is not JSON")
        if chars > MAX_SPEC_CHARS:
            raise ValueError(f"{field} is more than {MAX_SPEC_CHARS} characters long as JSON; at most "
                             f"{MAX_SPEC_CHARS} are allowed")
    if refs > MAX_SPEC_REFS:
        raise ValueError(f"{field} has {refs} $refs; at most {MAX_SPEC_REFS} are allowed")
    if definitions > MAX_SPEC_DEFINITIONS:
        raise ValueError(f"{field} has {definitions} definitions ($defs); at most {MAX_SPEC_DEFINITIONS} are "
                         "allowed")


# ---- gate 2: llguidance in a worker process -------------------------------------------------------------------------

def _thread_stack_bytes() -> int:
    """The stack a thread of this process gets (what the engine's and the server's threads compile on)."""
    configured = threading.stack_size()
    if configured:
        return configured
    soft, _ = resource.getrlimit(resource.RLIMIT_STACK)
    return soft if soft != resource.RLIM_INFINITY else 2 * 2**20


def worker_stack_bytes() -> int:
    """A quarter of this process's thread stack (between 256 KiB and 2 MiB): a spec that compiles within it in the
    worker compiles here with room to spare, because llguidance's stack use grows with the spec, not the caller."""
    return max(256 * 2**10, min(2 * 2**20, _thread_stack_bytes() // 4))


class _WorkerDied(Exception):
    def __init__(self, why: str):
        super().__init__(why)
        self.why = why


class _Worker:
    """One worker process and the tokenizers it has loaded."""

    def __init__(self, memory_bytes: int):
        self.proc = subprocess.Popen(
            [sys.executable, "-P", _WORKER_SCRIPT, str(worker_stack_bytes()), str(memory_bytes)],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, close_fds=True)
        self.tokenizers: set[str] = set()

    def call(self, msg: dict, timeout: float) -> dict:
        body = json.dumps(msg).encode("ascii")
        try:
            self.proc.stdin.write(struct.pack(">I", len(body)) + body)
            self.proc.stdin.flush()
        except (BrokenPipeError, OSError):  # it died before this message (killed from outside): not its fault
            self.kill()
            raise _WorkerDied("gone") from None
        deadline = time.monotonic() + timeout
        head = self._read(4, deadline)
        (size,) = struct.unpack(">I", head)
        return json.loads(self._read(size, deadline))

    def _read(self, n: int, deadline: float) -> bytes:
        fd, data = self.proc.stdout.fileno(), b""
        while len(data) < n:
            left = deadline - time.monotonic()
            if left <= 0 or not select.select([fd], [], [], left)[0]:
                self.kill()
                raise _WorkerDied("timeout")
            chunk = os.read(fd, n - len(data))
            if not chunk:
                raise _WorkerDied(self._exit_reason())
            data += chunk
        return data

    def _exit_reason(self) -> str:
        try:
            code = self.proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            self.kill()
            return "crash"
        return "out of memory" if code in (-6, 134) else "crash"  # Rust aborts on a failed allocation

    def alive(self) -> bool:
        return self.proc.poll() is None

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait()
        for pipe in (self.proc.stdin, self.proc.stdout):
            try:
                pipe.close()
            except OSError:
                pass


class _Cache:
    """LRU of check results by key, bounded in entries and in the characters of the grammars it holds."""

    def __init__(self, max_entries: int, max_chars: int):
        self._items: collections.OrderedDict[tuple, tuple[bool, str]] = collections.OrderedDict()
        self._chars = 0
        self.max_entries, self.max_chars = max_entries, max_chars

    def get(self, key: tuple) -> tuple[bool, str] | None:
        item = self._items.get(key)
        if item is not None:
            self._items.move_to_end(key)
        return item

    def put(self, key: tuple, item: tuple[bool, str]) -> None:
        if key in self._items:
            return
        self._items[key] = item
        self._chars += len(item[1])
        while self._items and (len(self._items) > self.max_entries or self._chars > self.max_chars):
            _, old = self._items.popitem(last=False)
            self._chars -= len(old[1])


class GrammarWorkers:
    """A few grammar worker processes, started on first use. Thread-safe: each check takes a free worker (waiting
    at most `timeout_s`, else GrammarBusyError) and gives the spec at most `timeout_s` to compile."""

    def __init__(self, num_workers: int = NUM_WORKERS, timeout_s: float = CHECK_TIMEOUT_S,
                 memory_bytes: int = WORKER_MEMORY_BYTES):
        self.num_workers, self.timeout_s, self.memory_bytes = num_workers, timeout_s, memory_bytes
        self._cond = threading.Condition()
        self._idle: list[_Worker] = []
        self._started = 0
        self._tokenizers: dict[str, dict] = {}
        self._cache = _Cache(MAX_CACHED_RESULTS, MAX_CACHED_GRAMMAR_CHARS)
        self.restarts = 0  # for tests: workers lost to a timeout or a crash
        self.compiles = 0  # for tests: checks that reached a worker (not served from the cache)

    def grammar(self, field: str, kind: str, spec: str) -> str:
        """The llguidance grammar of a spec (already within `check_limits`); ValueError naming `field` if it does not
        compile, or takes more than the timeout, memory or stack a worker has."""
        key = ("grammar", kind, hashlib.sha256(spec.encode("utf-8", "surrogatepass")).hexdigest())
        ok, text = self._run(key, {"op": "grammar", "kind": kind, "spec": spec})
        if not ok:
            raise ValueError(f"{field} is invalid: {text}")
        return text

    def register_tokenizer(self, tokenizer_json: str, n_vocab: int, eos: list[int]) -> str:
        """A key naming this tokenizer for `check_matcher` (workers load it when they first need it)."""
        key = hashlib.sha256(f"{n_vocab} {sorted(eos)} ".encode() + tokenizer_json.encode()).hexdigest()
        with self._cond:
            self._tokenizers[key] = {"op": "tokenizer", "key": key, "json": tokenizer_json, "n_vocab": n_vocab,
                                     "eos": sorted(eos)}
        return key

    def check_matcher(self, field: str, tokenizer_key: str, grammar: str) -> None:
        """Compiles `grammar` against the tokenizer and computes its first token mask in a worker: ValueError naming
        `field` if that fails (a grammar that passes here cannot fail the engine's first step)."""
        digest = hashlib.sha256(grammar.encode("utf-8", "surrogatepass")).hexdigest()
        ok, text = self._run(("matcher", tokenizer_key, digest),
                             {"op": "matcher", "key": tokenizer_key, "grammar": grammar})
        if not ok:
            raise ValueError(f"{field} cannot be used with this model's tokenizer: {text}")

    def _run(self, key: tuple, msg: dict) -> tuple[bool, str]:
        with self._cond:
            cached = self._cache.get(key)
        if cached is not None:
            return cached
        for attempt in range(2):
            worker = self._acquire()
            try:
                self._load_tokenizer(worker, msg)
                self.compiles += 1
                reply = worker.call(msg, self.timeout_s)
                result = (True, reply.get("grammar", "")) if reply.get("ok") else (False, str(reply.get("error")))
            except _WorkerDied as e:
                worker = None
                self.restarts += 1
                if e.why == "gone" and attempt == 0:  # lost before it saw the spec: once more on a fresh worker
                    continue
                what = {"timeout": f"it takes more than {self.timeout_s:g} s to compile",
                        "out of memory": "compiling it needs more memory than a grammar may use"}.get(
                    e.why, "it is too complex to compile (it crashed the grammar compiler)")
                logger.warning("a structured-output spec was refused: %s; grammar worker restarted", what)
                result = (False, what)
            finally:
                self._release(worker)
            break
        with self._cond:
            self._cache.put(key, result)
        return result

    def _load_tokenizer(self, worker: _Worker, msg: dict) -> None:
        if msg["op"] != "matcher" or msg["key"] in worker.tokenizers:
            return
        try:
            reply = worker.call(self._tokenizers[msg["key"]], TOKENIZER_TIMEOUT_S)
        except _WorkerDied as e:
            if e.why == "gone":
                raise
            raise RuntimeError(f"the grammar worker could not load the tokenizer ({e.why})") from None
        if not reply.get("ok"):
            raise RuntimeError(f"the grammar worker could not load the tokenizer: {reply.get('error')}")
        worker.tokenizers.add(msg["key"])

    def _acquire(self) -> _Worker:
        deadline = time.monotonic() + self.timeout_s
        with self._cond:
            while True:
                while self._idle:
                    worker = self._idle.pop()
                    if worker.alive():
                        return worker
                    worker.kill()
                    self._started -= 1
                if self._started < self.num_workers:
                    self._started += 1
                    break
                left = deadline - time.monotonic()
                if left <= 0:
                    raise GrammarBusyError(f"all {self.num_workers} grammar workers were busy for "
                                           f"{self.timeout_s:g} s; retry later")
                self._cond.wait(left)
        try:
            return _Worker(self.memory_bytes)
        except BaseException:
            with self._cond:
                self._started -= 1
                self._cond.notify()
            raise

    def _release(self, worker: _Worker | None) -> None:
        with self._cond:
            if worker is None:  # lost: a new one is started when next needed
                self._started -= 1
            else:
                self._idle.append(worker)
            self._cond.notify()

    def close(self) -> None:
        with self._cond:
            idle, self._idle = self._idle, []
            self._started -= len(idle)
        for worker in idle:
            worker.kill()


_shared: GrammarWorkers | None = None
_shared_lock = threading.Lock()


def workers() -> GrammarWorkers:
    """This process's grammar workers (shared by every engine and by `StructuredOutputsParams`)."""
    global _shared
    with _shared_lock:
        if _shared is None:
            _shared = GrammarWorkers()
            atexit.register(_shared.close)
        return _shared
