"""`AsyncEngine`: the online API. One background thread owns the `Engine` (and so the device); asyncio callers
send it commands and read each request's outputs as they come.

    engine = AsyncEngine.from_options("model_dir", max_waiting=256, max_num_seqs=64)
    async for out in engine.generate("Hello", SamplingParams(max_tokens=32), "req-1"):
        print(out.outputs[0].text)          # cumulative text so far
    await engine.shutdown(grace_s=30)

Threading: callers never touch the `Engine`. They append commands (add, abort) to a deque under one condition
variable; the loop thread takes them between steps, so a request that arrives while others decode joins at the next
step. The loop thread hands each request's new token ids (`EngineOutput`) to its stream, all of a step's in one
`loop.call_soon_threadsafe`; the reader's own task turns them into text (`RequestState`: detokenization, stop
strings, log-probs), so none of that is on the engine's step path. With no work the loop thread blocks on the
condition variable (no busy polling). `stats()` returns a snapshot that the loop thread takes after every
iteration (O(1): counters), so readers never see the scheduler half-updated. `pool_view()` is a command too: the
loop thread draws the pool between steps, at most once per POOL_VIEW_MAX_AGE_S however many callers ask.
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import copy
import dataclasses
import logging
import threading
import time
from collections.abc import AsyncIterator
from typing import Unpack

from jaxpaged.chat import apply_chat_template
from jaxpaged.core.pool_view import MAX_CELLS
from jaxpaged.engine.llm_engine import Engine
from jaxpaged.engine.options import EngineOptions
from jaxpaged.engine.output_processor import RequestState
from jaxpaged.engine.setup import EngineConfig
from jaxpaged.engine.structured_output import GrammarError
from jaxpaged.entrypoints.metrics import EngineMetrics
from jaxpaged.outputs import EngineOutput, RequestOutput, SeqDelta
from jaxpaged.sampling_params import SamplingParams

logger = logging.getLogger(__name__)


class EngineOverloadedError(RuntimeError):
    """The waiting queue holds `max_waiting` requests already; try again later (HTTP 429)."""


class EngineStoppedError(RuntimeError):
    """The engine is shutting down or its loop has died; it takes no new requests (HTTP 503)."""


class RequestAbortedError(RuntimeError):
    """The request was aborted by someone other than its reader (e.g. at shutdown)."""


class EngineStepError(RuntimeError):
    """This request failed inside the engine (its step or its output processing); other requests go on (HTTP 500)."""


class RequestGrammarError(ValueError):
    """This request's structured-output grammar failed while generating: the request's own fault, not the engine's
    (HTTP 400); other requests go on."""


@dataclasses.dataclass
class _Add:
    """Requests that are queued together or not at all (the prompts of one API call)."""

    requests: list[tuple[str, str | list[int] | dict, SamplingParams]]  # (request id, prompt, params)
    arrival_time: float
    done: concurrent.futures.Future  # set (or failed with the engine's ValueError) once the engine has them
    priority: int = 0  # the scheduler's, for all of them (scheduling_policy="priority")


@dataclasses.dataclass
class _Abort:
    request_id: str
    error: BaseException | None = None  # handed to the reader when it is still listening
    # the reader the abort was meant for (None: none then): a later request that reuses the id is not it
    stream: RequestStream | None = None


@dataclasses.dataclass
class _StopSequences:
    """The reader found a stop string: those sequences end in the engine."""

    request_id: str
    indices: list[int]


@dataclasses.dataclass
class _PoolView:
    max_cells: int
    done: concurrent.futures.Future  # the view, drawn by the loop thread between steps


POOL_VIEW_MAX_AGE_S = 0.2  # callers within this long of a view share it: watchers cannot load the engine thread


class RequestStream:
    """The outputs of one request, an async iterator of `RequestOutput`s (in the request's output kind; the server
    asks for cumulative ones) ending with a finished one.

    The engine's outputs for it wait merged into one unread item (token ids only, so a reader that falls behind, or
    stops reading, holds the tokens it has not read, not an output per step); the reader turns them into text when
    it reads (`RequestState`). A terminal item (the finished output, or an error) is never replaced. Leaving early
    (`aclose()`, `break` inside `async with`, cancellation) aborts the request, which frees its KV blocks at once.
    """

    def __init__(self, engine: AsyncEngine, request_id: str, loop: asyncio.AbstractEventLoop):
        self.request_id = request_id
        self._engine = engine
        self._loop = loop
        self._unread: EngineOutput | BaseException | None = None
        self._wakeup = asyncio.Event()
        self._state: RequestState | None = None  # set by the engine thread before the add completes
        self.finished = False
        self._closed = False

    def _put(self, item: EngineOutput | BaseException) -> None:  # on the event loop, from the engine thread
        unread = self._unread
        if isinstance(unread, BaseException) or (unread is not None and unread.finished):
            return  # e.g. the shutdown's error after a finished output the reader has not taken yet
        self._unread = item if unread is None or isinstance(item, BaseException) else _merge(unread, item)
        self._wakeup.set()

    def __aiter__(self) -> RequestStream:
        return self

    async def __anext__(self) -> RequestOutput:
        while True:
            if self.finished or self._closed:
                raise StopAsyncIteration
            try:
                while self._unread is None and not self._closed:
                    self._wakeup.clear()
                    await self._wakeup.wait()
            except BaseException:  # cancelled while waiting: nobody will read this request any more
                await self.aclose()
                raise
            if self._closed:
                raise StopAsyncIteration
            item, self._unread = self._unread, None
            if isinstance(item, BaseException):
                self.finished = True
                self._engine._forget(self.request_id, abort=False)
                raise item
            out = self._state.update(item)  # the output processing: text, stop strings, log-probs
            stopped = self._state.take_stopped()
            if stopped:  # a stop string ended them before the engine did: it stops them now (finished, not aborted)
                self._engine._stop_sequences(self.request_id, stopped)
            if self._state.finished:
                self.finished = True
                self._engine._count_finished(self._state)
                self._engine._forget(self.request_id, abort=not (item.finished or stopped))
            if out is not None:
                return out

    async def aclose(self) -> None:
        if not self._closed:
            self._closed = True
            self._engine._forget(self.request_id, abort=not self.finished)
            self._unread = None
            self._wakeup.set()  # wakes a reader waiting in another task

    async def __aenter__(self) -> RequestStream:
        return self

    async def __aexit__(self, *exc) -> None:
        await self.aclose()


class AsyncEngine:
    """Runs an `Engine` in one background thread and serves many asyncio callers."""

    def __init__(self, engine: Engine, max_waiting: int = 256, metrics: EngineMetrics | None = None):
        if max_waiting < 1:
            raise ValueError(f"max_waiting={max_waiting} must be >= 1")
        self.engine = engine
        self.max_waiting = max_waiting
        self.metrics = metrics or EngineMetrics(self.stats)
        # The loop thread decodes with engine.tokenizer; callers encode with their own copy (a fast tokenizer's
        # Rust object must not be borrowed mutably from two threads at once).
        self.tokenizer = _private_copy(engine.tokenizer)
        self._cond = threading.Condition()
        self._commands: collections.deque[_Add | _Abort | _PoolView] = collections.deque()
        self._streams: dict[str, RequestStream] = {}
        self._pending_adds = 0
        self._accepting = True
        self._stop = False
        self._stopped = False  # the loop thread has exited: nobody would answer a command
        self._view: tuple[int, float, concurrent.futures.Future] | None = None  # (max_cells, asked at, view)
        self._error: BaseException | None = None
        self._token_times: dict[str, tuple[float, int]] = {}  # request id -> (last output time, tokens so far)
        self._arrivals: dict[str, float] = {}  # request id -> arrival time
        self._snapshot = self._take_snapshot()
        self._thread = threading.Thread(target=self._run, name="jaxpaged-engine", daemon=True)
        self._thread.start()

    @classmethod
    def from_options(cls, model: str | None = None, max_waiting: int = 256, *, config: EngineConfig | None = None,
                     **options: Unpack[EngineOptions]) -> AsyncEngine:
        """Loads a model (path or None for the default) and starts the engine thread; options as for `LLM`."""
        from jaxpaged.entrypoints.llm import load_engine

        return cls(load_engine(model, config, **options), max_waiting=max_waiting)

    # ---- facts about the model, for the API layer --------------------------------------------------------------

    @property
    def max_model_len(self) -> int:
        return self.engine.max_model_len

    @property
    def default_sampling_params(self) -> SamplingParams:
        """What a request given no SamplingParams samples with (`Engine.default_sampling_params`)."""
        return self.engine.default_sampling_params

    @property
    def generation_defaults(self) -> dict[str, float | int]:
        """`Engine.generation_defaults`: the sampling fields the model sets for requests that leave them unset."""
        return self.engine.generation_defaults

    @property
    def vocab_size(self) -> int:
        """Token ids the model knows: [0, vocab_size)."""
        return self.engine.model_config.vocab_size

    @property
    def is_running(self) -> bool:
        """True while the loop thread is alive and accepting requests."""
        return self._thread.is_alive() and self._accepting and self._error is None

    def encode(self, text: str) -> list[int]:
        if self.tokenizer is None:
            raise ValueError("this model has no tokenizer: send token ids")
        return list(self.tokenizer(text)["input_ids"])

    def apply_chat_template(self, conversation: list[dict], add_generation_prompt: bool = True, *,
                            continue_final_message: bool = False, chat_template_kwargs: dict | None = None
                            ) -> list[int]:
        return apply_chat_template(self.tokenizer, conversation, add_generation_prompt,
                                   continue_final_message=continue_final_message,
                                   chat_template_kwargs=chat_template_kwargs)

    # ---- requests ---------------------------------------------------------------------------------------------

    async def add_request(self, request_id: str, prompt: str | list[int] | dict,
                          params: SamplingParams | None = None, priority: int = 0) -> RequestStream:
        """Hands a request to the engine and waits until the engine has queued it.

        Raises ValueError / TypeError (bad input, from `Engine.make_request`), EngineOverloadedError (the waiting
        queue is full) or EngineStoppedError (shutting down). On success the returned stream yields the request's
        outputs.
        """
        (stream,) = await self.add_requests([(request_id, prompt, params)], priority)
        return stream

    async def add_requests(self, requests: list[tuple[str, str | list[int] | dict, SamplingParams | None]],
                           priority: int = 0) -> list[RequestStream]:
        """Queues several requests in one engine iteration, all or none (the prompts of one API call), each with
        `priority` (lower first, under scheduling_policy="priority").

        More requests than `max_waiting` can never be queued at once: ValueError, not EngineOverloadedError.
        """
        loop = asyncio.get_running_loop()
        ids = [rid for rid, _, _ in requests]
        if len(set(ids)) != len(ids):
            raise ValueError("request ids must be distinct")
        if len(requests) > self.max_waiting:
            raise ValueError(f"{len(requests)} prompts in one request can never be queued: at most "
                             f"max_waiting={self.max_waiting} requests may wait")
        streams = [RequestStream(self, rid, loop) for rid in ids]
        done: concurrent.futures.Future = concurrent.futures.Future()
        with self._cond:
            if self._error is not None or not self._accepting:
                raise EngineStoppedError("the engine is shutting down and takes no new requests")
            for rid in ids:
                if rid in self._streams:
                    raise ValueError(f"request_id {rid!r} is already in use")
            waiting = self._pending_adds + self._snapshot["num_waiting"]
            if waiting + len(requests) > self.max_waiting:
                self.metrics.rejected.inc()
                raise EngineOverloadedError(f"the server is overloaded: {waiting} requests are waiting "
                                            f"(max_waiting={self.max_waiting}); retry later")
            self._streams.update(zip(ids, streams, strict=True))
            self._pending_adds += len(requests)
            default = self.default_sampling_params
            self._commands.append(_Add([(rid, prompt, params or default) for rid, prompt, params in requests],
                                       time.monotonic(), done, priority))
            self._cond.notify()
        try:
            await asyncio.wrap_future(done)
        except BaseException:
            rejected = done.done() and not done.cancelled() and done.exception() is not None
            for stream in streams:
                stream._closed = True
                self._forget(stream.request_id, abort=not rejected)  # cancelled mid-add: the engine may hold it
            raise
        return streams

    async def generate(self, prompt: str | list[int] | dict, sampling_params: SamplingParams | None,
                       request_id: str, *, priority: int = 0) -> AsyncIterator[RequestOutput]:
        """Yields the request's cumulative outputs until it finishes; leaving early aborts it. The arguments in
        vLLM's order (`AsyncLLM.generate(prompt, sampling_params, request_id)`); `add_request` keeps vLLM's own
        (request_id, prompt, params). sampling_params None: the model's defaults."""
        if sampling_params is not None and not isinstance(sampling_params, SamplingParams):
            raise TypeError(f"generate(prompt, sampling_params, request_id): sampling_params must be a SamplingParams "
                            f"or None, not {type(sampling_params).__name__}")
        if not isinstance(request_id, str):
            raise TypeError(f"generate(prompt, sampling_params, request_id): request_id must be a str, not "
                            f"{type(request_id).__name__}")
        stream = await self.add_request(request_id, prompt, sampling_params, priority)
        async with stream:
            async for out in stream:
                yield out

    def abort(self, request_id: str) -> None:
        """Stops a request and frees its KV blocks; thread-safe, unknown or finished ids are ignored. Its reader,
        if any, gets RequestAbortedError; a request added later with the same id is not touched."""
        with self._cond:
            self._commands.append(_Abort(request_id, RequestAbortedError(f"request {request_id!r} was aborted"),
                                         self._streams.get(request_id)))
            self._cond.notify()

    def _stop_sequences(self, request_id: str, indices: list[int]) -> None:
        with self._cond:
            self._commands.append(_StopSequences(request_id, indices))
            self._cond.notify()

    def _forget(self, request_id: str, abort: bool) -> None:
        """The reader is done with a request; abort it in the engine if it has not finished."""
        with self._cond:
            self._streams.pop(request_id, None)
            if abort:
                self._commands.append(_Abort(request_id))
                self._cond.notify()

    # ---- observability ----------------------------------------------------------------------------------------

    def stats(self) -> dict:
        """`Engine.stats()` as of the end of the loop's last iteration, plus the async layer's own counts."""
        with self._cond:
            snap = dict(self._snapshot)
            snap["num_in_flight"] = len(self._streams)
            snap["num_pending_adds"] = self._pending_adds
        return snap

    async def pool_view(self, max_cells: int = MAX_CELLS) -> dict:
        """`Engine.pool_view(max_cells)`, drawn by the loop thread between steps (the event loop never reads the
        block pool while a step changes it). A view at most POOL_VIEW_MAX_AGE_S old is shared."""
        now = time.monotonic()
        with self._cond:
            view = self._view
            if view is None or view[0] != max_cells or now - view[1] >= POOL_VIEW_MAX_AGE_S:
                if self._stopped:
                    raise EngineStoppedError("the engine has stopped")
                view = self._view = (max_cells, now, concurrent.futures.Future())
                self._commands.append(_PoolView(max_cells, view[2]))
                self._cond.notify()
        # Shielded: a caller that gives up must not cancel the view the others wait for.
        return await asyncio.shield(asyncio.wrap_future(view[2]))

    def num_in_flight(self) -> int:
        with self._cond:
            return len(self._streams)

    # ---- shutdown ---------------------------------------------------------------------------------------------

    def stop_accepting(self) -> None:
        """New requests get EngineStoppedError from now on; those in flight go on."""
        with self._cond:
            self._accepting = False

    async def shutdown(self, grace_s: float = 30.0) -> None:
        """Stops accepting, lets in-flight requests finish for up to `grace_s`, aborts the rest, stops the thread."""
        self.stop_accepting()
        deadline = time.monotonic() + grace_s
        while self.num_in_flight() and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        self.fail_in_flight(EngineStoppedError(f"the engine shut down before this request finished "
                                               f"(grace period of {grace_s:g} s)"))
        await asyncio.get_running_loop().run_in_executor(None, self.close)

    def fail_in_flight(self, error: BaseException) -> int:
        """Ends every request that still has a reader: the engine aborts it, and its reader gets `error` on its
        next read, without waiting for the engine's current step (which may take seconds). Thread-safe; returns
        how many requests it ended."""
        with self._cond:
            streams = list(self._streams.values())
            self._commands.extend(_Abort(s.request_id) for s in streams)
            self._cond.notify()
        by_loop: dict[asyncio.AbstractEventLoop, list[tuple[RequestStream, BaseException]]] = {}
        for s in streams:
            by_loop.setdefault(s._loop, []).append((s, error))
        for loop, targets in by_loop.items():
            try:
                loop.call_soon_threadsafe(_put_all, targets)
            except RuntimeError:  # the readers' event loop is closed
                pass
        return len(streams)

    def close(self, timeout: float = 30.0) -> bool:
        """Aborts whatever is left and joins the loop thread (blocking); returns whether it stopped in time (it
        finishes its current step first)."""
        with self._cond:
            self._accepting = False
            self._stop = True
            self._cond.notify()
        self._thread.join(timeout)
        if self._thread.is_alive():
            logger.warning("the engine thread did not stop within %g s", timeout)
            return False
        return True

    # ---- the loop thread ----------------------------------------------------------------------------------------

    def _run(self) -> None:
        _name_os_thread(threading.current_thread().name)
        try:
            while True:
                with self._cond:
                    while not (self._commands or self._stop or self.engine.has_unfinished_requests()):
                        self._cond.wait()
                    commands = list(self._commands)
                    self._commands.clear()
                    stop = self._stop
                deliveries = self._apply(commands)
                if stop:
                    self._deliver(deliveries)
                    break
                progressed = True
                if self.engine.has_unfinished_requests():
                    progressed = self._step(deliveries)
                snapshot = self._take_snapshot()
                with self._cond:
                    self._snapshot = snapshot
                # Readers hear of outputs and aborts only now, so stats() they read next is at least as new.
                self._deliver(deliveries)
                with self._cond:
                    if not progressed and not self._commands and not self._stop:
                        # Work exists but nothing could be scheduled this iteration: wait a little, not spin.
                        self._cond.wait(0.005)
        except BaseException as e:  # a bug in this loop: fail every reader rather than leave them hanging
            logger.exception("the engine loop died")
            self._error = e
        finally:
            self._shut_down_engine()

    def _apply(self, commands: list) -> list[tuple[str, EngineOutput | BaseException]]:
        deliveries = []
        for cmd in commands:
            if isinstance(cmd, _PoolView):
                if cmd.done.set_running_or_notify_cancel():
                    try:
                        cmd.done.set_result(self.engine.pool_view(cmd.max_cells))
                    except Exception as e:
                        cmd.done.set_exception(e)
                continue
            if isinstance(cmd, _Abort):
                # (commands apply in order: a request added after the abort is not in the engine yet)
                self.engine.abort_request(cmd.request_id)
                self._token_times.pop(cmd.request_id, None)
                self._arrivals.pop(cmd.request_id, None)
                with self._cond:  # the reader it was meant for, still listening: not a newer one of the same id
                    listening = cmd.stream is not None and self._streams.get(cmd.request_id) is cmd.stream
                if cmd.error is not None and listening:
                    deliveries.append((cmd.request_id, cmd.error))
                continue
            if isinstance(cmd, _StopSequences):
                out = self.engine.stop_sequences(cmd.request_id, cmd.indices)
                if out is not None:  # the request ended here: its metrics (its reader has its final output)
                    self._observe(out, time.monotonic())
                continue
            added = []
            if cmd.done.set_running_or_notify_cancel():  # else the caller gave up before the engine saw it
                try:
                    made = [self.engine.make_request(rid, prompt, params, arrival_time=cmd.arrival_time,
                                                     priority=cmd.priority)
                            for rid, prompt, params in cmd.requests]
                    for req in made:
                        self.engine.enqueue(req)
                    added = [rid for rid, _, _ in cmd.requests]
                    with self._cond:
                        streams = [self._streams.get(rid) for rid in added]
                    for req, stream in zip(made, streams, strict=True):
                        if stream is not None:  # the reader decodes with the API side's tokenizer (its thread's)
                            stream._state = RequestState(self.tokenizer, req.request_id, req.prompt,
                                                         req.seqs[0].prompt_token_ids, req.params, req.arrival_time)
                except Exception as e:  # bad input: the caller gets it, nothing is queued, the loop goes on
                    cmd.done.set_exception(e)
            with self._cond:
                # From pending to waiting at once, so the max_waiting count never sees them twice or not at all.
                self._pending_adds -= len(cmd.requests)
                self._snapshot["num_waiting"] += len(added)
            if added:
                for rid in added:
                    self._token_times[rid] = (cmd.arrival_time, 0)
                    self._arrivals[rid] = cmd.arrival_time
                cmd.done.set_result(None)
        return deliveries

    def _step(self, deliveries: list) -> bool:
        """Runs one engine step and appends what its readers should get to `deliveries`; returns whether it
        progressed."""
        steps_before = self.engine.counters["steps"]
        # Anything that escapes step() (EngineDeadError: the pool is gone; or a bug in the host bookkeeping) ends
        # the loop: /health answers 503 and new requests are refused, rather than serving on a broken engine.
        outputs = self.engine.step()
        now = time.monotonic()
        for out in outputs:
            if out.error is not None:  # this request failed inside the step; the others went on
                self._token_times.pop(out.request_id, None)
                self._arrivals.pop(out.request_id, None)
                kind, _, message = out.error.partition(": ")
                if kind == GrammarError.__name__:
                    deliveries.append((out.request_id, RequestGrammarError(message)))
                    continue
                self.metrics.step_errors.inc()
                deliveries.append((out.request_id, EngineStepError(f"internal engine error: {out.error}")))
                continue
            self._observe(out, now)
            deliveries.append((out.request_id, out))
        return self.engine.counters["steps"] != steps_before or bool(outputs)

    def _deliver(self, deliveries: list[tuple[str, EngineOutput | BaseException]]) -> None:
        """Hands a step's outputs to their readers: one `call_soon_threadsafe` per event loop, not per request (each
        call writes to the loop's wake-up pipe: a system call on the step loop's thread, per stream per step)."""
        by_loop: dict[asyncio.AbstractEventLoop, list[tuple[RequestStream, EngineOutput | BaseException]]] = {}
        with self._cond:
            for rid, item in deliveries:
                stream = self._streams.get(rid)
                if stream is not None:  # else its reader is gone (it aborted the request itself)
                    by_loop.setdefault(stream._loop, []).append((stream, item))
        for loop, targets in by_loop.items():
            try:
                loop.call_soon_threadsafe(_put_all, targets)
            except RuntimeError:  # the readers' event loop is closed
                for stream, _ in targets:
                    self.engine.abort_request(stream.request_id)

    def _observe(self, out: EngineOutput, now: float) -> None:
        arrival = self._arrivals.get(out.request_id, now)
        last, before = self._token_times.get(out.request_id, (arrival, 0))
        tokens = before + sum(len(d.token_ids) for d in out.deltas)
        if tokens > before:
            if before == 0:
                first = out.first_token_time or now
                self.metrics.time_to_first_token.observe(max(0.0, first - arrival))
            else:
                per_token = (now - last) / (tokens - before)
                for _ in range(tokens - before):
                    self.metrics.inter_token_latency.observe(per_token)
        if out.finished:
            self._token_times.pop(out.request_id, None)
            self._arrivals.pop(out.request_id, None)
            self.metrics.e2e_latency.observe(now - arrival)
        else:
            self._token_times[out.request_id] = (now, tokens)

    def _count_finished(self, state: RequestState) -> None:
        """On the reader's side, once its output is final: each sequence's finish reason as the caller got it. (The
        engine's may differ: it can run to max_tokens, "length", before the reader finds a stop string, "stop".)"""
        for seq in state.seqs.values():
            self.metrics.finished.labels(finish_reason=seq.finish_reason or "unknown").inc()

    def _take_snapshot(self) -> dict:
        return self.engine.stats()

    def _shut_down_engine(self) -> None:
        """On the loop thread at exit: abort every request and tell every reader."""
        error: BaseException = EngineStoppedError("the engine stopped" if self._error is None else
                                                  f"the engine loop died: {self._error!r}")
        with self._cond:
            self._accepting = False
            self._stopped = True
            leftover = list(self._commands)
            self._commands.clear()
            readers = list(self._streams)
        for cmd in leftover:
            if isinstance(cmd, (_Add, _PoolView)) and cmd.done.set_running_or_notify_cancel():
                cmd.done.set_exception(error)
        for request_id in list(self.engine.requests):
            try:
                self.engine.abort_request(request_id)
            except Exception:
                logger.exception("aborting %s at shutdown failed", request_id)
        try:
            snapshot = self._take_snapshot()
        except Exception:
            snapshot = self._snapshot
        with self._cond:
            self._pending_adds = 0
            self._snapshot = snapshot
        self._deliver([(request_id, error) for request_id in readers])


def _put_all(targets: list[tuple[RequestStream, EngineOutput | BaseException]]) -> None:
    """On an event loop: a step's outputs into their streams. A stream whose hand-off raises fails alone (its reader
    gets the error, the engine aborts its request): the other streams of the step still get theirs."""
    for stream, item in targets:
        try:
            stream._put(item)
        except Exception:
            logger.exception("handing request %s its output failed", stream.request_id)
            stream._unread = EngineStepError(f"internal error handing request {stream.request_id} its output")
            stream._wakeup.set()
            stream._engine._forget(stream.request_id, abort=True)


def _name_os_thread(name: str) -> None:
    """Gives the calling thread `name` in the OS too (Linux; Python < 3.14 names only its own Thread object), so
    `top -H`, /proc and profilers tell the engine thread from the event loop and XLA's threads."""
    try:
        import ctypes

        ctypes.CDLL(None).prctl(15, name.encode()[:15], 0, 0, 0)  # PR_SET_NAME: 15 bytes and a NUL
    except (OSError, AttributeError):  # not Linux
        pass


def _private_copy(tokenizer):
    if tokenizer is None:
        return None
    try:
        return copy.deepcopy(tokenizer)
    except Exception:  # some tokenizers cannot be copied; share it (encode and decode then race rarely)
        logger.warning("could not copy the tokenizer for the API thread; sharing the engine's")
        return tokenizer


__all__ = ["AsyncEngine", "EngineOverloadedError", "EngineStepError", "EngineStoppedError", "RequestAbortedError",
           "RequestGrammarError", "RequestStream"]


def _merge(old: EngineOutput, new: EngineOutput) -> EngineOutput:
    """Two engine outputs of one request that no reader has taken yet, as one (tokens appended per sequence)."""
    deltas = {d.index: d for d in old.deltas}
    for d in new.deltas:
        kept = deltas.get(d.index)
        if kept is None:
            deltas[d.index] = d
            continue
        deltas[d.index] = SeqDelta(
            d.index, kept.token_ids + d.token_ids,
            None if kept.top_logprobs is None else kept.top_logprobs + (d.top_logprobs or []),
            d.finish_reason, d.stop_reason,
            d.cumulative_logprob if d.cumulative_logprob is not None else kept.cumulative_logprob)
    return EngineOutput(new.request_id, list(deltas.values()), new.finished,
                        new.num_cached_tokens or old.num_cached_tokens, old.first_token_time or new.first_token_time,
                        new.error, old.prompt_logprobs or new.prompt_logprobs)
