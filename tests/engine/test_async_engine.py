"""`AsyncEngine`: one loop thread owns the engine; asyncio callers stream, abort, get errors, and shut it down."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest

from jaxpaged.engine.llm_engine import Engine, EngineDeadError
from jaxpaged.engine.setup import EngineConfig
from jaxpaged.entrypoints.async_engine import (
    AsyncEngine,
    EngineOverloadedError,
    EngineStepError,
    EngineStoppedError,
    RequestAbortedError,
)
from jaxpaged.sampling_params import SamplingParams
from tests.tiny import CharTokenizer, drain, random_params, tiny_config

CONFIG = tiny_config()
GREEDY = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)


@pytest.fixture(scope="module")
def engine():
    return Engine(CONFIG, random_params(CONFIG), CharTokenizer(),
                  EngineConfig(dtype="float32", max_num_seqs=4, max_num_batched_tokens=64, max_model_len=64,
                               block_size=8, num_blocks=40, precompile=False, show_progress=False))


@pytest.fixture
def aengine(engine):
    ae = AsyncEngine(engine, max_waiting=8)
    yield ae
    ae.close()


def offline(engine, prompt, params):
    engine.add_request("offline", prompt, params)
    return drain(engine)["offline"]


def wait_for(predicate, timeout=10.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.01)
    return False


def test_streamed_outputs_grow_and_match_the_engine_run_directly(engine):
    ae = AsyncEngine(engine)

    async def run():
        return [out async for out in ae.generate([5, 6, 7, 8], GREEDY, "a")]

    outs = asyncio.run(run())
    ae.close()
    ids = [o.outputs[0].token_ids for o in outs]
    assert outs[-1].finished and not any(o.finished for o in outs[:-1])
    assert [o.outputs[0].finished() for o in outs] == [o.finished for o in outs]  # vLLM's CompletionOutput method
    assert all(later[:len(earlier)] == earlier for earlier, later in zip(ids, ids[1:], strict=False))
    assert ids[-1] == offline(engine, [5, 6, 7, 8], GREEDY)


def test_generate_takes_vllm_s_order_and_the_old_one_is_a_type_error_before_anything_is_queued(aengine):
    """generate(prompt, sampling_params, request_id), as vLLM's AsyncLLM; the order this API had before
    (request_id, prompt, params) raises a TypeError naming the argument, and queues nothing."""

    async def run(*args):
        return [o async for o in aengine.generate(*args)]

    outs = asyncio.run(run([5, 6, 7], GREEDY, "vllm-order"))
    assert outs[-1].finished and outs[-1].request_id == "vllm-order"
    before = aengine.stats()
    with pytest.raises(TypeError, match="sampling_params must be a SamplingParams"):
        asyncio.run(run("old-order", [5, 6, 7], GREEDY))
    with pytest.raises(TypeError, match="request_id must be a str"):
        asyncio.run(run([5, 6, 7], GREEDY, 7))
    after = aengine.stats()
    assert after["num_in_flight"] == 0 and after["num_pending_adds"] == 0 and after["num_used"] == 0
    assert after["num_waiting"] == before["num_waiting"] == 0 and after["steps"] == before["steps"]


def test_concurrent_requests_each_get_their_own_output(engine, aengine):
    prompts = [[3 + i, 9, 4 + 2 * i] for i in range(6)]

    async def run():
        async def one(i, p):
            last = None
            async for out in aengine.generate(p, GREEDY, f"r{i}"):
                last = out
            return last.outputs[0].token_ids

        return await asyncio.gather(*(one(i, p) for i, p in enumerate(prompts)))

    together = asyncio.run(run())
    aengine.close()  # the engine is used directly below; its loop thread must be gone
    alone = [offline(engine, p, GREEDY) for p in prompts]
    assert together == alone and len({tuple(t) for t in alone}) > 1


def test_a_step_s_outputs_reach_their_readers_in_one_wake_up_of_their_event_loop(engine, aengine):
    """Each `call_soon_threadsafe` writes to the loop's wake-up pipe from the engine thread: once per step for all
    of the step's streams, not once per stream (four streams decode together here)."""
    calls = []

    async def run():
        loop = asyncio.get_running_loop()
        wake = loop.call_soon_threadsafe

        def counted(callback, *args, **kwargs):
            if threading.current_thread().name == "jaxpaged-engine" and \
                    getattr(callback, "__name__", "") in ("_put", "_put_all"):  # outputs (not the adds' futures)
                calls.append(len(args[0]) if callback.__name__ == "_put_all" else 1)
            return wake(callback, *args, **kwargs)

        loop.call_soon_threadsafe = counted

        async def one(i):
            return [out async for out in aengine.generate([3 + i, 9, 4], GREEDY, f"w{i}")][-1]

        steps = engine.counters["steps"]
        last = await asyncio.gather(*(one(i) for i in range(4)))
        return last, engine.counters["steps"] - steps

    last, steps = asyncio.run(run())
    assert all(o.finished and len(o.outputs[0].token_ids) == 8 for o in last)
    assert sum(calls) >= 4 * 8  # every stream heard of each of its tokens' steps (or of several at once)...
    assert len(calls) <= steps + 1 and max(calls) == 4, (calls, steps)  # ...in one wake-up per step at most


def test_a_hand_off_that_raises_fails_its_request_alone(engine, aengine, monkeypatch):
    """All of a step's outputs reach their readers in one callback: one stream's failure there must not keep the
    others' outputs from them, and its request is aborted (its blocks freed)."""
    from jaxpaged.entrypoints import async_engine

    merge = async_engine._merge

    def merge_failing_for_bad(old, new):
        if new.request_id == "bad":
            raise RuntimeError("injected")
        return merge(old, new)

    monkeypatch.setattr(async_engine, "_merge", merge_failing_for_bad)
    slow = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)

    async def run():
        async def good(i):
            return [out async for out in aengine.generate([3 + i, 9, 4], slow, f"good{i}")][-1]

        async def bad():
            stream = await aengine.add_request("bad", [5, 6, 7], slow)
            await asyncio.sleep(0.3)  # outputs pile up unread: the next one is merged, which raises
            with pytest.raises(EngineStepError, match="handing request bad its output"):
                async for _ in stream:
                    pass

        return await asyncio.gather(bad(), *(good(i) for i in range(3)))

    _, *goods = asyncio.run(run())
    assert all(o.finished and len(o.outputs[0].token_ids) == 24 for o in goods)
    assert wait_for(lambda: aengine.stats()["num_used"] == 0 and aengine.stats()["num_in_flight"] == 0)


def test_outputs_merged_for_a_slow_reader_keep_the_prompt_logprobs(aengine):
    """A reader that takes its outputs late gets them merged into one: the prompt's log-probs, which come once, in
    the output of the step that finished the prompt, are in it."""
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, prompt_logprobs=1)

    async def run():
        stream = await aengine.add_request("slow-reader", [5, 6, 7, 8], params)
        for _ in range(600):  # every step's output piles up unread, up to the finished one
            await asyncio.sleep(0.05)
            if stream._unread is not None and stream._unread.finished:
                break
        return [out async for out in stream]

    outs = asyncio.run(run())
    assert len(outs) == 1 and outs[-1].finished and len(outs[-1].outputs[0].token_ids) == 12
    scored = outs[-1].prompt_logprobs
    assert scored is not None and scored[0] is None and [next(iter(e)) for e in scored[1:]] == [6, 7, 8]


def test_bad_request_raises_to_the_caller_and_the_loop_goes_on(aengine):
    async def run():
        with pytest.raises(ValueError, match="longer than the context"):
            await aengine.add_request("too-long", [3] * 100, GREEDY)
        with pytest.raises(ValueError, match="empty"):
            await aengine.add_request("empty", [], GREEDY)
        return [out async for out in aengine.generate([3, 4], GREEDY, "ok")][-1]

    last = asyncio.run(run())
    assert last.finished and len(last.outputs[0].token_ids) == 8
    assert wait_for(lambda: aengine.stats()["num_used"] == 0 and aengine.stats()["num_in_flight"] == 0)


def test_a_full_waiting_queue_refuses_with_overloaded(engine):
    ae = AsyncEngine(engine, max_waiting=1)

    async def run():
        return await asyncio.gather(ae.add_request("first", [3, 4], GREEDY), ae.add_request("second", [3, 5], GREEDY),
                                    return_exceptions=True)

    first, second = asyncio.run(run())
    ae.close()
    assert isinstance(second, EngineOverloadedError) and "max_waiting=1" in str(second)
    assert not isinstance(first, BaseException)
    assert ae.metrics.rejected._value.get() == 1


def test_abort_from_another_thread_frees_the_blocks_at_once(aengine):
    params = SamplingParams(temperature=0, max_tokens=50, ignore_eos=True)

    async def run():
        seen = 0
        with pytest.raises(RequestAbortedError):
            async for _ in aengine.generate([3, 4, 5], params, "long"):
                seen += 1
                if seen == 2:
                    threading.Thread(target=aengine.abort, args=("long",)).start()
        return seen

    seen = asyncio.run(run())
    assert seen < 50
    s = aengine.stats()
    assert s["num_used"] == 0 and s["num_running"] == 0 and s["aborted_requests"] >= 1


def test_aborting_a_finished_request_leaves_a_new_one_with_its_id_alone(aengine):
    """abort(id) of a request that has finished is ignored, also by the request that reuses the id right after
    (the abort's error went to whichever reader held the id when it was delivered: the new one, whose request
    then ran on unread, its id refused). Twice in a row too."""
    async def run():
        first = [out async for out in aengine.generate([5, 6, 7], GREEDY, "x")]
        aengine.abort("x")
        aengine.abort("x")
        second = [out async for out in aengine.generate([5, 6, 7], GREEDY, "x")]
        return first, second

    for _ in range(3):
        first, second = asyncio.run(run())
        assert second[-1].finished and second[-1].outputs[0].token_ids == first[-1].outputs[0].token_ids
    assert wait_for(lambda: aengine.stats()["num_used"] == 0 and aengine.stats()["num_running"] == 0)


def test_leaving_the_stream_early_aborts_the_request(aengine):
    params = SamplingParams(temperature=0, max_tokens=50, ignore_eos=True)

    async def run():
        async for out in aengine.generate([3, 4, 5], params, "quit"):
            if len(out.outputs[0].token_ids) >= 2:
                break

    before = aengine.stats()["aborted_requests"]
    asyncio.run(run())
    assert wait_for(lambda: aengine.stats()["aborted_requests"] == before + 1)
    assert aengine.stats()["num_used"] == 0


@pytest.mark.parametrize("n,reader_lags", [(1, False), (2, False), (2, True)])
def test_a_request_ended_by_a_stop_string_counts_as_finished_not_aborted(engine, n, reader_lags):
    """The output processor finds stop strings, a step or two after the engine ran past them: the engine is told to
    stop those sequences (finished, reason "stop"). It was told to abort the request, which /stats and /metrics then
    counted as aborted, not finished. A reader that lags finds the stop string only after the engine ran to
    max_tokens: the engine's reason is "length", the caller's "stop"; /metrics counts the caller's (it counted the
    engine's, and a clean-clone CI under load saw it)."""
    text = engine.tokenizer.decode(offline(engine, [5, 6, 7], GREEDY))  # (before a loop thread owns the engine)
    aengine = AsyncEngine(engine)
    params = SamplingParams(n=n, temperature=0, max_tokens=8, ignore_eos=True, stop=[text[3:5]])

    async def run():
        stream = aengine.generate([5, 6, 7], params, f"stop{n}{reader_lags}")
        outs = [await anext(stream)]
        if reader_lags:  # the engine finishes the request (max_tokens) before the reader reads on
            done = before["finished_requests"] + 1
            assert await asyncio.to_thread(wait_for, lambda: aengine.stats()["finished_requests"] == done)
        return (outs + [out async for out in stream])[-1]

    def success(reason):
        return aengine.metrics.finished.labels(finish_reason=reason)._value.get()

    try:
        before, stops = aengine.stats(), success("stop")
        final = asyncio.run(run())
        assert [(c.text, c.finish_reason, c.stop_reason) for c in final.outputs] == [(text[:3], "stop", text[3:5])] * n
        assert wait_for(lambda: aengine.stats()["finished_requests"] == before["finished_requests"] + 1)
        after = aengine.stats()
        assert after["aborted_requests"] == before["aborted_requests"] and after["num_used"] == 0
        # (the metric is counted from the final output, just after the engine's own counter: wait for it too)
        assert wait_for(lambda: success("stop") == stops + n), success("stop")
    finally:
        aengine.close()


def test_the_idle_loop_sleeps(aengine):
    async def run():
        return [o async for o in aengine.generate([3, 4], GREEDY, "x")]

    asyncio.run(run())
    steps = aengine.stats()["steps"]
    cpu = time.process_time()
    time.sleep(0.5)
    assert time.process_time() - cpu < 0.1  # a spinning loop thread would burn ~0.5 s
    assert aengine.stats()["steps"] == steps


def test_shutdown_lets_in_flight_requests_finish_and_refuses_new_ones(engine):
    ae = AsyncEngine(engine)
    params = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)

    async def run():
        stream = await ae.add_request("inflight", [3, 4], params)
        shutdown = asyncio.create_task(ae.shutdown(grace_s=30))
        await asyncio.sleep(0)
        with pytest.raises(EngineStoppedError):
            await ae.add_request("late", [3, 4], params)
        outs = [o async for o in stream]
        await shutdown
        return outs[-1]

    last = asyncio.run(run())
    assert last.finished and len(last.outputs[0].token_ids) == 20
    assert not ae._thread.is_alive() and not ae.is_running


def test_shutdown_past_the_grace_period_aborts_the_rest(engine):
    ae = AsyncEngine(engine)
    params = SamplingParams(temperature=0, max_tokens=60, ignore_eos=True)

    async def run():
        stream = await ae.add_request("slow", [3, 4], params)
        await ae.shutdown(grace_s=0.0)
        with pytest.raises((EngineStoppedError, RequestAbortedError)):
            async for _ in stream:
                pass

    asyncio.run(run())
    assert engine.stats()["num_used"] == 0 and not engine.requests


def test_a_failing_device_step_fails_its_requests_but_not_the_loop(engine, aengine, monkeypatch):
    real_dispatch = engine.runner.dispatch
    calls = {"n": 0}

    def flaky_dispatch(inputs, rows):
        calls["n"] += 1
        if calls["n"] == 1:  # raises before touching the pool, which stays alive
            raise RuntimeError("device fell over")
        return real_dispatch(inputs, rows)

    monkeypatch.setattr(engine.runner, "dispatch", flaky_dispatch)
    failed_before = aengine.stats()["failed_requests"]

    async def run():
        with pytest.raises(EngineStepError, match="device fell over"):
            async for _ in aengine.generate([3, 4], GREEDY, "unlucky"):
                pass
        return [o async for o in aengine.generate([3, 4], GREEDY, "lucky")][-1]

    last = asyncio.run(run())
    assert last.finished and aengine.is_running
    assert last.outputs[0].token_ids == offline_tokens(engine, [3, 4])
    assert wait_for(lambda: aengine.stats()["num_used"] == 0)
    # /metrics counts it as failed (not as aborted)
    from prometheus_client import generate_latest

    failed = aengine.stats()["failed_requests"]
    assert failed == failed_before + 1
    assert f"jaxpaged_requests_failed_total {float(failed)}" in generate_latest(aengine.metrics.registry).decode()


def test_one_bad_row_fails_only_its_request(engine, aengine, monkeypatch):
    """A row the host cannot lay out (here: injected for one request) fails that request; the stream beside it in
    the same steps finishes with the tokens it gets alone."""
    real_prepare = engine.runner.prepare

    def prepare(out, *args):
        if any(s.request_id == "hostile" for s in out.seqs):
            raise OverflowError("Python int too large to convert to C int")
        return real_prepare(out, *args)

    monkeypatch.setattr(engine.runner, "prepare", prepare)
    expected = offline_tokens(engine, [5, 6, 7])

    async def run():
        good = await aengine.add_request("good", [5, 6, 7], GREEDY)
        bad = await aengine.add_request("hostile", [3, 4], GREEDY)
        with pytest.raises(EngineStepError, match="too large"):
            async for _ in bad:
                pass
        return [o async for o in good][-1]

    last = asyncio.run(run())
    assert last.outputs[0].token_ids == expected and aengine.is_running
    assert wait_for(lambda: aengine.stats()["num_used"] == 0 and aengine.stats()["failed_requests"] >= 1)


def test_a_step_that_lost_its_donated_pool_stops_the_engine():
    """After a device step raised with the pool donated, nothing can run: the loop stops, readers get an error,
    is_running turns false (the server's /health answers 503) and new requests are refused."""
    dead = Engine(CONFIG, random_params(CONFIG), CharTokenizer(),
                  EngineConfig(dtype="float32", max_num_seqs=4, max_num_batched_tokens=64, max_model_len=64,
                               block_size=8, num_blocks=40, precompile=False, show_progress=False))

    def dispatch_and_lose_the_pool(inputs, rows):
        dead.runner.kv_pool.k.delete()
        raise RuntimeError("XLA runtime error: out of memory")

    dead.runner.dispatch = dispatch_and_lose_the_pool
    ae = AsyncEngine(dead)

    async def run():
        with pytest.raises((EngineStoppedError, EngineStepError)):
            async for _ in ae.generate([3, 4], GREEDY, "victim"):
                pass
        with pytest.raises(EngineStoppedError):
            await ae.add_request("later", [3, 4], GREEDY)

    asyncio.run(run())
    assert not ae.is_running and dead.dead is not None
    with pytest.raises(EngineDeadError):
        dead.step()
    ae.close()


def offline_tokens(engine, prompt):
    """The greedy tokens of `prompt` alone on a fresh engine with the same weights."""
    fresh = Engine(CONFIG, engine.runner.params, CharTokenizer(),
                   EngineConfig(dtype="float32", max_num_seqs=4, max_num_batched_tokens=64, max_model_len=64,
                                block_size=8, num_blocks=40, precompile=False, show_progress=False))
    return offline(fresh, prompt, GREEDY)
