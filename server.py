"""OpenAI-compatible HTTP server (aiohttp) on jaxpaged's `AsyncEngine`.

    python server.py --model path/to/model --host 127.0.0.1 --port 8000 [--api-key KEY] [engine options]

Routes: POST /v1/completions, POST /v1/chat/completions (`stream: true` answers with server-sent events),
GET /v1/models, GET /health, GET /metrics (Prometheus text), GET /stats (the engine's counters as JSON).
This file is transport only: bodies, auth, status codes and SSE framing. The API's JSON shapes are in
jaxpaged/entrypoints/openai_protocol.py and openai_serving.py; the engine never sees HTTP.

SIGINT/SIGTERM: stop listening, refuse new requests (503), let in-flight ones finish for --shutdown-grace seconds,
abort the rest, exit 0. A second signal exits at once.
"""

from __future__ import annotations

import argparse
import asyncio
import hmac
import json
import logging
import os
import signal
import sys

from aiohttp import web

from jaxpaged.cli import add_engine_args, engine_options
from jaxpaged.entrypoints.async_engine import AsyncEngine
from jaxpaged.entrypoints.openai_protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    OpenAIError,
    error_body,
    parse_body,
)
from jaxpaged.entrypoints.openai_serving import ChunkStream, OpenAIServing

logger = logging.getLogger("jaxpaged.server")

ENGINE = web.AppKey("engine", AsyncEngine)
SERVING = web.AppKey("serving", OpenAIServing)
MAX_BODY = web.AppKey("max_body_bytes", int)

_ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 404: "not_found_error",
                405: "invalid_request_error", 413: "invalid_request_error", 429: "server_overloaded",
                503: "service_unavailable"}


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


def require_api_key(api_key: str):
    expected = api_key.encode()

    @web.middleware
    async def check(request: web.Request, handler):
        if request.path.startswith("/v1/"):
            header = request.headers.get("Authorization", "")
            scheme, _, token = header.partition(" ")
            if not header:
                raise OpenAIError("missing API key: send 'Authorization: Bearer <key>'", status=401,
                                  type="authentication_error", code="missing_api_key")
            if scheme.lower() != "bearer" or not hmac.compare_digest(token.strip().encode(), expected):
                raise OpenAIError("incorrect API key provided", status=401, type="authentication_error",
                                  code="invalid_api_key")
        return await handler(request)

    return check


async def _read_body(request: web.Request) -> bytes:
    limit = request.app[MAX_BODY]
    if request.content_length is not None and request.content_length > limit:
        raise OpenAIError(f"the request body is {request.content_length} bytes; the limit is {limit} bytes",
                          status=413, code="request_too_large")
    try:
        return await request.read()
    except web.HTTPRequestEntityTooLarge:
        raise OpenAIError(f"the request body exceeds the limit of {limit} bytes", status=413,
                          code="request_too_large") from None


def _sse(obj: dict) -> bytes:
    return b"data: " + json.dumps(obj, separators=(",", ":")).encode() + b"\n\n"


async def _respond(request: web.Request, result: dict | ChunkStream) -> web.StreamResponse:
    if isinstance(result, dict):
        return web.json_response(result)
    resp = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache",
                                       "X-Accel-Buffering": "no"})
    try:
        await resp.prepare(request)
        try:
            async for chunk in result:
                await resp.write(_sse(chunk))
        except OpenAIError as e:  # the engine failed mid-stream; headers are out, so say it in the stream
            await resp.write(_sse(e.body()))
        await resp.write(b"data: [DONE]\n\n")
        await resp.write_eof()
    except ConnectionResetError:  # the client went away; closing the stream below aborts the request
        logger.info("client disconnected mid-stream from %s", request.path)
    finally:
        await result.aclose()
    return resp


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
              max_body_bytes: int = 4 * 2**20, max_prompts_per_request: int = 64) -> web.Application:
    middlewares = [errors_as_json] + ([require_api_key(api_key)] if api_key else [])
    app = web.Application(middlewares=middlewares, client_max_size=max_body_bytes)
    app[ENGINE] = engine
    app[SERVING] = OpenAIServing(engine, model_names, max_prompts_per_request)
    app[MAX_BODY] = max_body_bytes
    app.router.add_post("/v1/completions", completions)
    app.router.add_post("/v1/chat/completions", chat_completions)
    app.router.add_get("/v1/models", models)
    app.router.add_get("/v1/models/{model}", model)
    app.router.add_get("/health", health)
    app.router.add_get("/metrics", metrics)
    app.router.add_get("/stats", stats)
    return app


async def serve(app: web.Application, host: str, port: int, grace_s: float) -> None:
    """Serves until SIGINT/SIGTERM, then drains in-flight requests for up to grace_s and stops the engine."""
    engine = app[ENGINE]
    # handler_cancellation: a client that hangs up cancels its handler, which aborts its request at once.
    runner = web.AppRunner(app, handler_cancellation=True, shutdown_timeout=grace_s, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, host, port)
    await site.start()
    logger.info("serving %s on http://%s:%d", ", ".join(app[SERVING].model_names), host, port)
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()
    logger.info("shutting down: refusing new requests, %d in flight get up to %.0f s", engine.num_in_flight(),
                grace_s)
    for sig in (signal.SIGINT, signal.SIGTERM):  # a second signal: leave now
        loop.add_signal_handler(sig, lambda: os._exit(1))
    engine.stop_accepting()
    await runner.cleanup()  # stops listening, waits up to grace_s for handlers, cancels the rest
    await engine.shutdown(grace_s=0.0)
    logger.info("stopped")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description="OpenAI-compatible server for jaxpaged")
    add_engine_args(p)
    p.add_argument("--host", default="127.0.0.1", help="interface to bind (default: loopback only)")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--api-key", default=os.environ.get("JAXPAGED_API_KEY"),
                   help="require 'Authorization: Bearer KEY' on /v1/* (default: $JAXPAGED_API_KEY, else none)")
    p.add_argument("--served-model-name", nargs="+", default=None,
                   help="name(s) clients use in 'model' (default: the model path's base name)")
    p.add_argument("--max-body-bytes", type=int, default=4 * 2**20, help="largest request body accepted (413)")
    p.add_argument("--max-waiting", type=int, default=256,
                   help="requests allowed to wait for a slot; more are answered 429")
    p.add_argument("--max-prompts-per-request", type=int, default=64,
                   help="prompts one completions request may hold (400 beyond it)")
    p.add_argument("--shutdown-grace", type=float, default=30.0,
                   help="seconds in-flight requests get to finish after SIGINT/SIGTERM")
    p.add_argument("--log-level", default="INFO")
    args = p.parse_args(argv)
    for name in ("max_body_bytes", "max_waiting", "max_prompts_per_request"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1")
    return args


def default_model_name(model: str | None) -> str:
    if model is None:
        return "SmolLM2-135M-Instruct"
    base = os.path.basename(os.path.normpath(model))
    return base.removesuffix(".gguf") or model


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    names = args.served_model_name or [default_model_name(args.model)]
    try:
        engine = AsyncEngine.from_options(args.model, max_waiting=args.max_waiting, **engine_options(args))
    except (ValueError, TypeError, FileNotFoundError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    app = build_app(engine, names, args.api_key, args.max_body_bytes, args.max_prompts_per_request)
    try:
        asyncio.run(serve(app, args.host, args.port, args.shutdown_grace))
    except OSError as e:  # e.g. the port is taken
        print(f"error: {e}", file=sys.stderr)
        engine.close()
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
