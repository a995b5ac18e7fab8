"""OpenAI-compatible HTTP server (aiohttp) on jaxpaged's `AsyncEngine`.

    jaxpaged serve path/to/model --host 127.0.0.1 --port 8000 [--api-key KEY] [engine options]
    python -m jaxpaged.entrypoints.openai.api_server --model path/to/model ...    (the same flags)
    python server.py --model path/to/model ...                                  (a checkout's launcher)

Routes: POST /v1/completions, POST /v1/chat/completions (`stream: true` answers with server-sent events),
GET /v1/models, GET /health, GET /metrics (Prometheus text), GET /stats (the engine's counters as JSON),
POST /tokenize, POST /detokenize, GET /version (vLLM's), GET /pool (the KV pool, block by block) and GET / (a page
that chats and watches the pool; static, it holds no data, so it is served without the key and asks for it).
This file is transport only: bodies, auth, timeouts, status codes and SSE framing. The API's JSON shapes are in
protocol.py and serving.py beside this file; the engine never sees HTTP.

With --api-key (or $JAXPAGED_API_KEY, which keeps the key out of `ps`), every route but /health needs
'Authorization: Bearer KEY'; --metrics-without-auth opens /metrics to a scraper.

SIGINT/SIGTERM: keep listening but answer new API requests 503, let in-flight ones finish; at the end of
--shutdown-grace, end the streams still running with an error event and `data: [DONE]`, and exit 0 within the
grace. A second signal exits at once. README.md's "What the server promises" lists every limit and timeout.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import gc
import hmac
import json
import logging
import os
import re
import signal
import sys
import zlib
from importlib import metadata
from pathlib import Path
from typing import NoReturn

from aiohttp import web
from aiohttp.http_exceptions import HttpProcessingError
from aiohttp.web_protocol import RequestPayloadError

from jaxpaged.chat import check_chat_template, load_chat_template
from jaxpaged.core.pool_view import MAX_CELLS
from jaxpaged.entrypoints.async_engine import AsyncEngine, EngineStoppedError
from jaxpaged.entrypoints.cli import (
    add_engine_args,
    engine_options,
    finish_process_0,
    join_processes,
    run_worker_process,
    use_compilation_cache,
)
from jaxpaged.entrypoints.openai.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    OpenAIError,
    TokenizeRequest,
    error_body,
    parse_body,
)
from jaxpaged.entrypoints.openai.read_progress import ReadProgress, cap_buffers
from jaxpaged.entrypoints.openai.serving import ChunkStream, OpenAIServing
from jaxpaged.runtime.tcmalloc import use_tcmalloc

logger = logging.getLogger("jaxpaged.server")
PAGE = Path(__file__).resolve().parent / "static" / "index.html"  # package data (pyproject.toml)


class Lifecycle:
    """How many API requests are in flight, and whether the server is draining them before it exits."""

    def __init__(self):
        self.draining = False
        self.in_flight = 0
        self._idle = asyncio.Event()
        self._idle.set()

    def enter(self) -> None:
        self.in_flight += 1
        self._idle.clear()

    def leave(self) -> None:
        self.in_flight -= 1
        if not self.in_flight:
            self._idle.set()

    async def wait_idle(self, timeout: float) -> bool:
        """True once no API request is in flight; False if some still are after `timeout` seconds."""
        try:
            async with asyncio.timeout(max(0.0, timeout)):
                await self._idle.wait()
            return True
        except TimeoutError:
            return False


ENGINE = web.AppKey("engine", AsyncEngine)
SERVING = web.AppKey("serving", OpenAIServing)
LIFECYCLE = web.AppKey("lifecycle", Lifecycle)
MAX_BODY = web.AppKey("max_body_bytes", int)
BODY_TIMEOUT = web.AppKey("body_timeout", float)
WRITE_TIMEOUT = web.AppKey("write_timeout", float)

_ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 404: "not_found_error",
                405: "invalid_request_error", 408: "invalid_request_error", 413: "invalid_request_error",
                429: "server_overloaded", 503: "service_unavailable"}


class _BodyTimeout(Exception):
    """The client sent headers but not the whole body within --body-timeout."""


class _UndecodableBody(Exception):
    """The body does not decode as its Content-Encoding says (e.g. gzip): the client's error (400)."""


class _ClientNotReading(Exception):
    """The client has had stream output waiting and read none of it for --write-timeout (read_progress.py)."""


def _error_response(status: int, message: str, type: str | None = None, param: str | None = None,
                    code: str | None = None, headers: dict | None = None) -> web.Response:
    body = error_body(message, type or _ERROR_TYPES.get(status, "server_error"), param, code)
    return web.json_response(body, status=status, headers=headers)


@web.middleware
async def errors_as_json(request: web.Request, handler):
    """Every failure becomes OpenAI's error JSON; unexpected ones are logged and answered 500."""
    try:
        return await handler(request)
    except OpenAIError as e:
        headers = {"Retry-After": "1"} if e.status in (429, 503) else None
        return _error_response(e.status, e.message, e.type, e.param, e.code, headers)
    except _BodyTimeout:
        # Answer, then close at once: the rest of the body may never come, so the connection cannot be reused
        # (aiohttp would otherwise wait up to 10 s reading the rest).
        return await _answer_and_close(request, _error_response(
            408, f"the request body did not arrive within {request.app[BODY_TIMEOUT]:g} s", code="request_timeout"))
    except _UndecodableBody as e:
        # Closed as well: aiohttp would read the rest of the body after the answer, meet the same error again and log
        # it as a traceback.
        return await _answer_and_close(request, _error_response(400, str(e)))
    except web.HTTPException as e:
        if e.status < 400:
            raise
        message = {404: f"no route {request.method} {request.path}",
                   405: f"method {request.method} is not allowed on {request.path}",
                   413: f"the request body exceeds the limit of {request.app[MAX_BODY]} bytes"}.get(e.status, e.reason)
        return _error_response(e.status, message)
    except Exception:
        logger.exception("unhandled error on %s %s", request.method, request.path)
        return _error_response(500, "internal server error", "server_error")


async def _answer_and_close(request: web.Request, resp: web.Response) -> web.Response:
    resp.force_close()
    await resp.prepare(request)
    await resp.write_eof()
    request.protocol.force_close()
    return resp


@web.middleware
async def track_api_requests(request: web.Request, handler):
    """Counts API requests in flight for the shutdown drain, and answers new ones 503 while draining."""
    if not request.path.startswith("/v1/"):  # /health, /metrics and /stats answer to the end
        return await handler(request)
    lifecycle = request.app[LIFECYCLE]
    if lifecycle.draining:
        raise OpenAIError("the server is shutting down and takes no new requests; retry on another replica",
                          status=503, type="service_unavailable", code="shutting_down")
    lifecycle.enter()
    try:
        return await handler(request)
    finally:
        lifecycle.leave()


async def _close_when_draining(request: web.Request, response: web.StreamResponse) -> None:
    # While draining, keep-alive clients are told to reconnect (elsewhere) rather than reuse this connection.
    if request.app[LIFECYCLE].draining:
        response.force_close()
        response.headers["Connection"] = "close"  # aiohttp builds the headers before this hook: say it ourselves


def require_api_key(api_key: str, open_paths: frozenset[str]):
    """Every path but `open_paths` needs 'Authorization: Bearer <api_key>' (compared in constant time)."""
    expected = api_key.encode()

    @web.middleware
    async def check(request: web.Request, handler):
        if request.path not in open_paths:
            header = request.headers.get("Authorization", "")
            scheme, _, token = header.partition(" ")
            if not header:
                raise OpenAIError("missing API key: send 'Authorization: Bearer <key>'", status=401,
                                  type="authentication_error", code="missing_api_key")
            if scheme.lower() != "bearer" or not hmac.compare_digest(_raw_bytes(token.strip()), expected):
                raise OpenAIError("incorrect API key provided", status=401, type="authentication_error",
                                  code="invalid_api_key")
        return await handler(request)

    return check


def _raw_bytes(header_value: str) -> bytes:
    """The header's bytes as sent: aiohttp decodes bytes that are not UTF-8 to lone surrogates, which plain
    .encode() refuses (that was a 500); they can never equal the key, so any bytes compare safely."""
    try:
        return header_value.encode("utf-8", "surrogateescape")
    except UnicodeEncodeError:
        return header_value.encode("utf-8", "replace")


async def _read_body(request: web.Request) -> bytes:
    limit = request.app[MAX_BODY]
    if request.content_length is not None and request.content_length > limit:
        raise OpenAIError(f"the request body is {request.content_length} bytes; the limit is {limit} bytes",
                          status=413, code="request_too_large")
    try:
        async with asyncio.timeout(request.app[BODY_TIMEOUT]):
            raw = await request.read()
    except web.HTTPRequestEntityTooLarge:
        raise OpenAIError(f"the request body exceeds the limit of {limit} bytes", status=413,
                          code="request_too_large") from None
    except TimeoutError:
        logger.warning("%s sent headers but not the body of %s %s within %g s (--body-timeout); closing",
                       request.remote, request.method, request.path, request.app[BODY_TIMEOUT])
        raise _BodyTimeout from None
    except (RequestPayloadError, HttpProcessingError) as e:  # an error aiohttp reports on the body itself
        raise _undecodable(request, str(e)) from None
    return _decoded(request, raw, limit)


def _decoded(request: web.Request, raw: bytes, limit: int) -> bytes:
    """The body as its Content-Encoding says, at most `limit` bytes: gzip and deflate are decoded here, br and zstd
    refused (400), any other value read as it is (as aiohttp reads it). aiohttp's own decoding is off (build_app):
    it reports a deflate body that does not end as a deflate stream as an error of the connection, not of the
    request, so a handler whose headers had arrived first waited for the rest until --body-timeout (then a 408)."""
    encoding = request.headers.get("Content-Encoding", "").strip().lower()
    if encoding in ("br", "zstd"):
        raise _undecodable(request, "not supported", " (this server decodes gzip and deflate)")
    if encoding not in ("gzip", "deflate") or not raw:
        return raw
    # deflate is zlib-wrapped (RFC 1950) or, as aiohttp and urllib3 also take it, raw (RFC 1951)
    decoder = zlib.decompressobj(31 if encoding == "gzip" else 15 if raw[0] & 0xF == 8 else -15)
    try:
        body = decoder.decompress(raw, limit + 1)  # a small body that decompresses to gigabytes stops at the limit
    except zlib.error as e:
        raise _undecodable(request, str(e)) from None
    if len(body) > limit:
        raise OpenAIError(f"the request body exceeds the limit of {limit} bytes", status=413,
                          code="request_too_large")
    if not decoder.eof or decoder.unused_data:
        raise _undecodable(request, "the compressed stream does not end where the body does")
    return body


def _undecodable(request: web.Request, detail: str, hint: str = "") -> _UndecodableBody:
    encoding = request.headers.get("Content-Encoding", "")[:40]
    logger.warning("%s sent a body that does not decode as Content-Encoding %r on %s %s: answered 400 (%s)",
                   request.remote, encoding, request.method, request.path, re.sub(r"\s+", " ", detail)[:120])
    return _UndecodableBody(f"the request body does not decode as its Content-Encoding {encoding!r}{hint}")


def _sse(obj: dict) -> bytes:
    return b"data: " + json.dumps(obj, separators=(",", ":")).encode() + b"\n\n"


async def _respond(request: web.Request, result: dict | ChunkStream) -> web.StreamResponse:
    if isinstance(result, dict):
        return web.json_response(result)
    timeout = request.app[WRITE_TIMEOUT]
    resp = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache",
                                       "X-Accel-Buffering": "no"})

    async def send(data: bytes | None) -> None:
        # A write waits only when the (small) buffers are full; that alone bounds it by the timeout too.
        try:
            async with asyncio.timeout(timeout):
                await (resp.write(data) if data is not None else resp.write_eof())
        except TimeoutError:
            raise _ClientNotReading from None

    async def pump() -> None:
        await resp.prepare(request)
        try:
            async for chunk in result:
                await send(_sse(chunk))
        except OpenAIError as e:  # the engine failed or shut down mid-stream; headers are out: say it in the stream
            await send(_sse(e.body()))
        await send(b"data: [DONE]\n\n")
        await send(None)

    try:
        await _while_client_reads(request, pump(), timeout)
    except ConnectionResetError:  # the client went away; closing the stream below aborts the request
        logger.info("client disconnected mid-stream from %s", request.path)
    except _ClientNotReading:
        logger.warning("%s did not read its %s stream for %g s (--write-timeout): request aborted, connection "
                       "closed", request.remote, request.path, timeout)
        await result.aclose()
        if request.transport is not None:
            request.transport.abort()  # drops what is buffered for the client, rather than wait to send it
    finally:
        await result.aclose()
    return resp


async def _while_client_reads(request: web.Request, pump, timeout: float) -> None:
    """Runs a stream's `pump` coroutine; raises _ClientNotReading once the client has had output waiting and
    consumed none of it for `timeout` seconds, however much its buffers still take (read_progress.py)."""
    task = asyncio.ensure_future(pump)
    transport = request.transport
    try:
        if transport is None:
            return await task
        cap_buffers(transport)
        loop = asyncio.get_running_loop()
        progress = ReadProgress(transport, loop.time())
        interval = min(0.5, timeout / 4)
        while True:
            done, _ = await asyncio.wait({task}, timeout=interval)
            if done:
                return task.result()
            now = loop.time()
            progress.sample(now)
            if progress.stalled_for(now) >= timeout:
                raise _ClientNotReading
    finally:
        if not task.done():
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task


async def completions(request: web.Request) -> web.StreamResponse:
    body = parse_body(CompletionRequest, await _read_body(request))
    return await _respond(request, await request.app[SERVING].completion(body))


async def chat_completions(request: web.Request) -> web.StreamResponse:
    body = parse_body(ChatCompletionRequest, await _read_body(request))
    return await _respond(request, await request.app[SERVING].chat(body))


async def models(request: web.Request) -> web.Response:
    return web.json_response(request.app[SERVING].list_models())


async def model(request: web.Request) -> web.Response:
    return web.json_response(request.app[SERVING].get_model(request.match_info["model"]))


async def tokenize(request: web.Request) -> web.Response:
    body = parse_body(TokenizeRequest, await _read_body(request))
    return web.json_response(await request.app[SERVING].tokenize(body))


async def detokenize(request: web.Request) -> web.Response:
    body = parse_body(DetokenizeRequest, await _read_body(request))
    return web.json_response(await request.app[SERVING].detokenize(body))


def _version() -> str:
    try:
        return metadata.version("jaxpaged")
    except metadata.PackageNotFoundError:  # run from a checkout that was never installed
        return "unknown"


async def version(request: web.Request) -> web.Response:
    return web.json_response({"version": _version()})


async def pool(request: web.Request) -> web.Response:
    raw = request.query.get("max_cells", str(MAX_CELLS))
    # (a digit string past Python's 4300-digit int() limit raised: a 500)
    if not (raw.isascii() and raw.isdigit() and len(raw) <= len(str(MAX_CELLS)) and 1 <= int(raw) <= MAX_CELLS):
        raise OpenAIError(f"max_cells={raw[:20]!r} must be an integer in [1, {MAX_CELLS}]", param="max_cells")
    try:
        view = await request.app[ENGINE].pool_view(int(raw))
    except EngineStoppedError as e:
        raise OpenAIError(str(e), status=503, type="service_unavailable", code="engine_stopped") from e
    return web.json_response(view, headers={"Cache-Control": "no-store"})


async def page(request: web.Request) -> web.FileResponse:
    return web.FileResponse(PAGE, headers={"Cache-Control": "no-cache"})


async def health(request: web.Request) -> web.Response:
    if request.app[ENGINE].is_running:
        return web.json_response({"status": "ok"})
    return _error_response(503, "the engine is shutting down or stopped", code="unhealthy")


async def metrics(request: web.Request) -> web.Response:
    return web.Response(body=request.app[ENGINE].metrics.render(),
                        headers={"Content-Type": "text/plain; version=0.0.4; charset=utf-8"})


async def stats(request: web.Request) -> web.Response:
    return web.json_response(request.app[ENGINE].stats())


def build_app(engine: AsyncEngine, model_names: list[str], api_key: str | None = None,
              max_body_bytes: int = 4 * 2**20, *, metrics_without_auth: bool = False,
              max_prompt_chars: int | None = None, body_timeout: float = 30.0,
              write_timeout: float = 30.0, max_prompts_per_request: int = 64,
              tool_call_parser: str | None = None, chat_template: str | None = None) -> web.Application:
    # "/" is the static page: it holds no data and asks for the key itself (a browser cannot send it on navigation).
    open_paths = frozenset({"/health", "/"} | ({"/metrics"} if metrics_without_auth else set()))
    middlewares = [errors_as_json, track_api_requests] + ([require_api_key(api_key, open_paths)] if api_key else [])
    # auto_decompress off: _read_body decodes gzip and deflate itself (see _decoded)
    app = web.Application(middlewares=middlewares, client_max_size=max_body_bytes,
                          handler_args={"auto_decompress": False})
    app[ENGINE] = engine
    app[SERVING] = OpenAIServing(engine, model_names, max_prompt_chars, max_prompts_per_request, tool_call_parser,
                                 chat_template)
    app[LIFECYCLE] = Lifecycle()
    app[MAX_BODY] = max_body_bytes
    app[BODY_TIMEOUT] = body_timeout
    app[WRITE_TIMEOUT] = write_timeout
    app.on_response_prepare.append(_close_when_draining)
    app.router.add_post("/v1/completions", completions)
    app.router.add_post("/v1/chat/completions", chat_completions)
    app.router.add_get("/v1/models", models)
    app.router.add_get("/v1/models/{model}", model)
    app.router.add_get("/health", health)
    app.router.add_get("/metrics", metrics)
    app.router.add_get("/stats", stats)
    app.router.add_post("/tokenize", tokenize)
    app.router.add_post("/detokenize", detokenize)
    app.router.add_get("/version", version)
    app.router.add_get("/pool", pool)
    app.router.add_get("/", page)
    return app


class _AiohttpLogger(logging.LoggerAdapter):
    """aiohttp's server logger, except that a malformed request (garbage on the socket, a broken header) is one
    WARNING line: it is the client's mistake, and a traceback per port scan would bury the server's own errors."""

    def exception(self, msg, *args, exc_info=True, **kwargs):
        if isinstance(exc_info, HttpProcessingError):
            self._malformed(args, exc_info)
        else:
            super().exception(msg, *args, exc_info=exc_info, **kwargs)

    def debug(self, msg, *args, exc_info=None, **kwargs):
        if isinstance(exc_info, HttpProcessingError):  # aiohttp logs a bad method on a fresh connection as debug
            self._malformed(args, exc_info)
        else:
            super().debug(msg, *args, exc_info=exc_info, **kwargs)

    def _malformed(self, args: tuple, exc: HttpProcessingError) -> None:
        what = re.sub(r"\s+", " ", str(exc.message or exc)).strip()
        self.warning("malformed HTTP request from %s answered 400: %s", args[0] if args else "?", what[:200])


async def serve(app: web.Application, host: str, port: int, grace_s: float, keepalive_timeout: float) -> None:
    """Serves until SIGINT/SIGTERM, then drains in-flight requests and stops, all within grace_s."""
    engine, lifecycle = app[ENGINE], app[LIFECYCLE]
    # The end of the grace is kept for ending the streams still running and closing connections.
    reserve = min(1.0, grace_s / 4)
    # handler_cancellation: a client that hangs up cancels its handler, which aborts its request at once.
    # keepalive_timeout: aiohttp closes a connection that has not sent a complete request's headers this long after
    # it opened or after its previous response, so it is both the idle keep-alive limit and the header timeout.
    runner = web.AppRunner(app, handler_cancellation=True, shutdown_timeout=reserve / 8, access_log=None,
                           keepalive_timeout=keepalive_timeout,
                           logger=_AiohttpLogger(logging.getLogger("aiohttp.server"), {}))
    await runner.setup()
    site = web.TCPSite(runner, host, port)
    await site.start()
    logger.info("serving %s on http://%s:%d", ", ".join(app[SERVING].model_names), host, port)
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()
    deadline = loop.time() + grace_s
    for sig in (signal.SIGINT, signal.SIGTERM):  # a second signal: leave now
        loop.add_signal_handler(sig, lambda: os._exit(1))
    # Still listening: new API requests get 503 with an OpenAI error body, not a refused connection.
    lifecycle.draining = True
    engine.stop_accepting()
    logger.info("shutting down: new requests get 503; %d in flight get up to %g s", lifecycle.in_flight, grace_s)
    if not await lifecycle.wait_idle(deadline - reserve - loop.time()):
        # Readers get the error now, not after the engine's current step; streams write it, then [DONE].
        ended = engine.fail_in_flight(EngineStoppedError(
            f"the server shut down before this request finished (--shutdown-grace {grace_s:g} s)"))
        logger.warning("shutdown grace over: ending %d requests still in flight", ended)
        await lifecycle.wait_idle(deadline - reserve * 3 / 4 - loop.time())
    await runner.cleanup()  # stops listening; cancels what is left (a stream whose client does not read)
    app[SERVING].close()
    # If the engine thread is inside a long step it is left behind (a daemon thread): the grace is what counts, and
    # its last part (reserve / 2) is left for the process's exit, which waits for the GIL behind that step's thread
    # (a quarter was not always enough on a loaded 2-core machine).
    await loop.run_in_executor(None, engine.close, max(0.05, deadline - reserve / 2 - loop.time()))
    logger.info("stopped")


# The server's defaults while streams decode (EngineConfig's: the whole token budget, unpaced, for offline
# throughput; as vLLM, whose API server and LLM class default to different budgets): at most 128 prompt tokens a
# step, and within that, a step that prefills beside decoding streams is paced (StepPacer) to at most 1.7 typical
# decode steps: the pacer bounds the step it predicts, and the streams' inter-token gaps add the machine's own
# spread on top, so the default leaves room below issue #11's goal of ITL p99 <= 2 decode steps, while prompts that
# keep arriving still get in (docs/benchmarks.md#serving: the interference and Poisson runs at 1.5-1.8, and what
# each costs time to first token). --max-decode-slowdown 0 leaves the fixed bound alone.
SERVER_PREFILL_TOKENS_WHILE_DECODING = 128
SERVER_MAX_DECODE_SLOWDOWN = 1.7


# vLLM `serve` flags that change nothing here, accepted so that a vLLM command line starts this server too; start-up
# names each one given, with why it changes nothing.
VLLM_FLAGS_WITHOUT_EFFECT = {
    "trust_remote_code": "jaxpaged runs no code from a checkpoint: its models are its own",
    "enforce_eager": "there are no CUDA graphs to turn off: each step is one compiled XLA executable",
    "enable_chunked_prefill": "prompts are always chunked (--max-num-batched-tokens)",
    "enable_auto_tool_choice": 'tool_choice "auto" is on whenever --tool-call-parser is given',
    "disable_log_requests": "requests are not logged one by one",
    "disable_log_stats": "no stats are logged periodically (/metrics and /stats have them)",
}


def add_server_args(p: argparse.ArgumentParser) -> None:
    """The server's own flags (`--host`, `--port`, limits and timeouts); the engine's come from `add_engine_args`."""
    p.add_argument("--host", default="127.0.0.1", help="interface to bind (default: loopback only)")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--api-key", default=os.environ.get("JAXPAGED_API_KEY"),
                   help="require 'Authorization: Bearer KEY' on every route but /health (default: "
                        "$JAXPAGED_API_KEY, else none; the variable keeps the key out of `ps`)")
    p.add_argument("--metrics-without-auth", action="store_true",
                   help="with an API key, still answer /metrics without it (for a scraper on a private network)")
    p.add_argument("--served-model-name", nargs="+", default=None,
                   help="name(s) clients use in 'model' (default: the model path's base name)")
    p.add_argument("--max-body-bytes", type=int, default=4 * 2**20, help="largest request body accepted (413)")
    p.add_argument("--max-prompt-chars", type=int, default=None,
                   help="longer string prompts (or chat contents) get 400 without being tokenized (default: "
                        "max_model_len x the longest token's characters, the most that could fit)")
    p.add_argument("--max-waiting", type=int, default=256,
                   help="requests allowed to wait for a slot; more are answered 429")
    p.add_argument("--max-prompts-per-request", type=int, default=64,
                   help="prompts one completions request may hold (400 beyond it)")
    p.add_argument("--keepalive-timeout", type=float, default=5.0,
                   help="seconds an idle connection stays open; also the time a client has to send a request's "
                        "headers (from connecting, or from its previous response)")
    p.add_argument("--body-timeout", type=float, default=30.0,
                   help="seconds a client has to send the request body after its headers (408)")
    p.add_argument("--write-timeout", type=float, default=30.0,
                   help="a stream whose client reads nothing for this many seconds is aborted and closed")
    p.add_argument("--shutdown-grace", type=float, default=30.0,
                   help="seconds in-flight requests get to finish after SIGINT/SIGTERM")
    p.add_argument("--tool-call-parser", choices=["hermes", "llama3_json"], default=None,
                   help='parses tool calls out of chat outputs for tool_choice "auto" (required/named need none)')
    p.add_argument("--chat-template", default=None,
                   help="a Jinja chat template (a file's path, or the template itself) used instead of the "
                        "tokenizer's, for chat requests and /tokenize")
    p.add_argument("--log-level", default="INFO")
    vllm = p.add_argument_group("vLLM flags accepted without effect (start-up says why)")
    for name, why in VLLM_FLAGS_WITHOUT_EFFECT.items():
        vllm.add_argument(f"--{name.replace('_', '-')}", action="store_true", help=why)


def check_server_args(p: argparse.ArgumentParser, args: argparse.Namespace) -> argparse.Namespace:
    """Range checks (`p.error` names the flag) and the server's own engine defaults, applied to parsed flags."""
    for name in ("max_body_bytes", "max_waiting", "max_prompts_per_request"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1")
    if args.max_prompt_chars is not None and args.max_prompt_chars < 1:
        p.error("--max-prompt-chars must be >= 1")
    for name in ("keepalive_timeout", "body_timeout", "write_timeout"):
        if not getattr(args, name) > 0:
            p.error(f"--{name.replace('_', '-')} must be > 0 seconds")
    if not args.shutdown_grace >= 0:
        p.error("--shutdown-grace must be >= 0 seconds")
    if args.enable_auto_tool_choice and args.tool_call_parser is None:
        p.error("--enable-auto-tool-choice needs --tool-call-parser (as in vLLM)")
    if args.max_prefill_tokens_while_decoding is None:
        args.max_prefill_tokens_while_decoding = min(SERVER_PREFILL_TOKENS_WHILE_DECODING, args.max_num_batched_tokens)
    if args.max_decode_slowdown is None:
        args.max_decode_slowdown = SERVER_MAX_DECODE_SLOWDOWN
    elif args.max_decode_slowdown == 0:
        args.max_decode_slowdown = None
    return args


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description="OpenAI-compatible server for jaxpaged")
    add_engine_args(p)
    add_server_args(p)
    return check_server_args(p, p.parse_args(argv))


def default_model_name(model: str | None) -> str:
    if model is None:
        return "SmolLM2-135M-Instruct"
    base = os.path.basename(os.path.normpath(model))
    return base.removesuffix(".gguf") or model


def main(argv: list[str] | None = None) -> int:
    """`python -m jaxpaged.entrypoints.openai.api_server` and server.py: parses `argv` (None: the command line)."""
    args = parse_args(argv)
    if argv is None:  # run as a program (a caller passing argv keeps its process as it is)
        use_tcmalloc()  # may re-execute this process with tcmalloc preloaded (jaxpaged/runtime/tcmalloc.py)
    return run_server(args)


def run_server(args: argparse.Namespace) -> int:
    """Builds the engine from parsed flags (`parse_args`, or `jaxpaged serve`) and serves until a signal; the exit
    code (0 clean, 1 a multi-host peer lost, 2 bad options or a port taken)."""
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    for name, why in VLLM_FLAGS_WITHOUT_EFFECT.items():
        if getattr(args, name, False):
            logger.warning("--%s changes nothing here: %s", name.replace("_", "-"), why)
    names = args.served_model_name or [default_model_name(args.model)]
    try:
        use_compilation_cache(args)  # the process is ours: JAX's persistent cache makes the next start fast
        # multi-host: every process builds the engine; process 0 serves, the others run its steps
        if join_processes(args).process_id != 0:
            return run_worker_process(args)
        chat_template = None if args.chat_template is None else load_chat_template(args.chat_template)
        engine = AsyncEngine.from_options(args.model, max_waiting=args.max_waiting, **engine_options(args))
    except (ValueError, TypeError, FileNotFoundError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if chat_template is not None:
        try:
            check_chat_template(chat_template, engine.tokenizer)
        except ValueError as e:
            print(f"error: --chat-template: {e}", file=sys.stderr)
            engine.close()
            finish_process_0(engine.engine.runner)
            return 2
    # Loading leaves many long-lived objects (model, tokenizer, compiled steps): frozen, a full collection scans only
    # what serving allocates, instead of pausing every stream while it walks them all.
    gc.collect()
    gc.freeze()
    app = build_app(engine, names, args.api_key, args.max_body_bytes, metrics_without_auth=args.metrics_without_auth,
                    max_prompt_chars=args.max_prompt_chars, body_timeout=args.body_timeout,
                    write_timeout=args.write_timeout,
                    max_prompts_per_request=args.max_prompts_per_request, tool_call_parser=args.tool_call_parser,
                    chat_template=chat_template)
    try:
        asyncio.run(serve(app, args.host, args.port, args.shutdown_grace, args.keepalive_timeout))
    except OSError as e:  # e.g. the port is taken
        print(f"error: {e}", file=sys.stderr)
        engine.close()
        finish_process_0(engine.engine.runner)
        return 2
    if not engine.engine.runner.multihost:  # a single process
        return 0
    # multi-host: the workers are told to stop only once no step of this process can follow (the thread has ended)
    if not engine.close(timeout=1.0):
        logger.error("the engine thread is still in a step; the other processes are ended by the heartbeat timeout")
        return 1
    return finish_process_0(engine.engine.runner)


def exit_now(code: int) -> NoReturn:
    """Ends a server process: everything is closed and flushed, so the interpreter's teardown of JAX's runtime,
    which takes seconds and would overrun --shutdown-grace, is skipped."""
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


if __name__ == "__main__":
    exit_now(main())
