"""Continuous batching end to end on a tiny in-memory model: budgets, chunked prefill, preemption."""

from __future__ import annotations

import jax
import pytest

from jaxpaged import LLM, SamplingParams
from jaxpaged.core.sched_output import SchedulerOutput
from jaxpaged.core.scheduler import PACED_CHUNK_UNIT, PACER_WINDOW, StepPacer, decodable
from pallas_kernels.cpu_native import native
from tests.tiny import Collector, random_params, random_prompts, tiny_config

CONFIG = tiny_config()
ON_CPU = jax.default_backend() == "cpu"
# mixed steps: the native CPU attention kernel (not built, or JAXPAGED_NATIVE=0: the reference, which keeps them apart)
MIXED = ON_CPU and native.available("attention")
PARAMS = random_params(CONFIG)
GREEDY = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)


def make_llm(**kw) -> LLM:
    opts = dict(dtype="float32", max_num_seqs=8, max_num_batched_tokens=128, max_model_len=128, block_size=8,
                num_blocks=200, precompile=False, show_progress=False)
    opts.update(kw)
    return LLM.from_params(CONFIG, PARAMS, None, **opts)


@pytest.fixture(scope="module")
def prompts():
    return [{"prompt_token_ids": p} for p in random_prompts(12, 3, 60)]


@pytest.fixture(scope="module")
def reference(prompts):
    """Each prompt alone in a big pool: the outputs every other configuration must reproduce."""
    llm = make_llm()
    return [llm.generate([p], GREEDY, use_tqdm=False)[0].outputs[0].token_ids for p in prompts]


def test_batched_equals_one_at_a_time(prompts, reference):
    outs = make_llm().generate(prompts, GREEDY, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == reference


def test_budgets_respected_every_step(prompts):
    llm = make_llm(max_num_seqs=4, max_num_batched_tokens=64)
    sched = llm.engine.scheduler
    seen = []
    original = sched.schedule

    def spy():
        out = original()
        if out is not None:
            seen.append(out)
            assert len(sched.running) <= 4
            assert len(out.scheduled) <= 4
            assert out.num_tokens <= 64
        return out

    sched.schedule = spy
    llm.generate(prompts, GREEDY, use_tqdm=False)
    assert any(o.is_prefill for o in seen) and any(not o.is_prefill for o in seen)


def test_chunked_prefill_equals_unchunked(reference):
    long_prompts = [{"prompt_token_ids": p} for p in random_prompts(3, 90, 100, seed=5)]
    want = make_llm(max_num_batched_tokens=128).generate(long_prompts, GREEDY, use_tqdm=False)
    llm = make_llm(max_num_batched_tokens=32)  # a 100-token prompt needs 4 prefill steps
    got = llm.generate(long_prompts, GREEDY, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in want]
    assert llm.stats()["prefill_steps"] >= 4 * 3 // 2


@pytest.mark.parametrize("backend", ["auto", "reference"])  # mixed steps, and separate prefill / decode steps
def test_tiny_pool_preempts_and_still_gives_the_same_outputs(prompts, reference, backend):
    # 22 usable blocks of 8 tokens = 176 slots; 12 requests of up to 84 tokens each need far more.
    llm = make_llm(num_blocks=23, enable_prefix_caching=False, attention_backend=backend)
    outs = llm.generate(prompts, GREEDY, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == reference
    stats = llm.stats()
    assert stats["preemptions"] > 0 and stats["preemptions_recompute"] == stats["preemptions"]
    assert stats["num_used"] == 0 and stats["num_free"] == 22
    llm.engine.block_manager.check_invariants()
    llm.engine.scheduler.check_invariants()


def test_outputs_come_back_in_input_order(prompts):
    llm = make_llm()
    params = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for n in range(1, len(prompts) + 1)]
    outs = llm.generate(prompts, params, use_tqdm=False)
    assert [len(o.outputs[0].token_ids) for o in outs] == list(range(1, len(prompts) + 1))
    assert [o.prompt_token_ids for o in outs] == [p["prompt_token_ids"] for p in prompts]


def _spy_steps(sched) -> list[tuple[bool, int, int]]:
    """Records (something was decoding before the step, prompt tokens, decode tokens) of every scheduled step."""
    steps = []
    original = sched.schedule

    def spy():
        decoding = any(decodable(s) for s in sched.running)
        out = original()
        if out is not None:
            prompt = sum(s.num_new_tokens for s in out.scheduled if not s.is_decode)
            steps.append((decoding, prompt, out.num_tokens - prompt))
        return out

    sched.schedule = spy
    return steps


def _long_prompt_while_decoding(engine, first, decode_steps: int) -> tuple[dict, dict[str, list[int]]]:
    """Request "first" runs until it decodes (and `decode_steps` decode steps more), then a 100-token prompt "long"
    arrives; runs both to the end. Returns ("long"'s prompt, each request's tokens)."""
    engine.add_request("first", first, GREEDY)
    collector = Collector(engine)
    while not any(s.output_token_ids for s in engine.scheduler.running):  # "first" is decoding now
        collector.step()
    for _ in range(decode_steps):
        collector.step()
    long_prompt = {"prompt_token_ids": random_prompts(1, 100, 100, seed=9)[0]}
    engine.add_request("long", long_prompt, GREEDY)
    return long_prompt, collector.drain()


@pytest.mark.parametrize("backend", ["auto", "reference"])
def test_prefill_chunks_are_bounded_while_others_decode(reference, prompts, backend):
    """max_prefill_tokens_while_decoding: a prompt that arrives while sequences decode is prefilled at most that many
    tokens per step (so a decoding stream waits at most one such step between tokens); with nothing decoding it gets
    the whole budget; the tokens are those of the unbounded engine. With the native CPU kernel ('auto') the chunks
    ride in the same steps as the decodes (mixed steps); with the reference, decode steps come between them."""
    llm = make_llm(max_num_batched_tokens=128, max_prefill_tokens_while_decoding=32, attention_backend=backend)
    mixed = llm.engine.scheduler.mixed_steps
    assert mixed == (backend == "auto" and MIXED)  # 'auto' off CPU is Pallas, which keeps steps apart
    steps = _spy_steps(llm.engine.scheduler)
    long_prompt, outputs = _long_prompt_while_decoding(llm.engine, prompts[0], decode_steps=0)
    assert steps[0][:2] == (False, len(prompts[0]["prompt_token_ids"])) and steps[0][1] > 32  # alone: all at once
    chunks = [(prompt, decodes) for decoding, prompt, decodes in steps[1:] if prompt]
    assert chunks and max(p for p, _ in chunks) <= 32 and sum(p for p, _ in chunks) >= 100
    if mixed:  # "first" decodes in every step that prefills "long"
        assert all(decodes == 1 for _, decodes in chunks)
    else:
        assert all(decodes == 0 for _, decodes in chunks)
    assert outputs["first"] == reference[0]
    assert outputs["long"] == make_llm().generate([long_prompt], GREEDY, use_tqdm=False)[0].outputs[0].token_ids


@pytest.mark.skipif(not MIXED, reason="mixed steps need the native CPU kernel (attention_backend='auto' on CPU)")
def test_mixed_steps_decode_every_running_sequence_every_step(prompts, reference):
    """Mixed steps: while prompts are being prefilled, every sequence that waits for a token gets it in that step;
    the token budget counts the decodes first; the outputs are those of each prompt alone."""
    llm = make_llm(max_num_seqs=6, max_num_batched_tokens=48)
    sched = llm.engine.scheduler
    assert sched.mixed_steps
    original = sched.schedule
    mixed = []

    def spy():
        waiting = [s for s in sched.running if decodable(s)]
        out = original()
        if out is not None:
            assert out.num_tokens <= 48
            scheduled = {s.seq.seq_id for s in out.scheduled}
            if not out.preempted:
                assert all(s.seq_id in scheduled for s in waiting)
            prompt = sum(s.num_new_tokens for s in out.scheduled if not s.is_decode)
            mixed.append(prompt > 0 and len(out.scheduled) > 1 and any(s.is_decode for s in out.scheduled))
        return out

    sched.schedule = spy
    outs = llm.generate(prompts, GREEDY, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == reference
    assert sum(mixed) >= 3  # steps that carried decodes and prompt tokens together
    llm.engine.block_manager.check_invariants()
    llm.engine.scheduler.check_invariants()


def test_bounded_prefill_chunk_must_fit_the_step_budget():
    with pytest.raises(ValueError, match="max_prefill_tokens_while_decoding"):
        make_llm(max_num_batched_tokens=64, max_prefill_tokens_while_decoding=128)
    with pytest.raises(ValueError, match="max_prefill_tokens_while_decoding"):
        make_llm(max_prefill_tokens_while_decoding=8)


def test_the_pacer_fits_a_steps_prompt_tokens_to_the_delay_it_may_add():
    """StepPacer's arithmetic: with decode steps of 20 ms (the median of the last ones: one slow or fast step does
    not move it) and a slowdown of 2, a mixed step may add 20 ms; the next bound is the tokens that fit at the upper
    median excess per token of the last PACER_WINDOW paced steps (one slow step among them does not shrink it, slow
    steps in a row do), in 4s for mixed steps (16s for separate ones), between one unit and the ceiling, at most
    twice the last bound. Steps nobody waited for (not paced) and steps before any decode teach it nothing."""
    decode = SchedulerOutput(is_prefill=False, seqs=["a decode"])

    def paced(tokens, paced=True):
        return SchedulerOutput(is_prefill=True, seqs=["a chunk"], prompt_tokens=tokens, paced=paced)

    pacer = StepPacer(ceiling=128, slowdown=2.0, mixed_steps=True)
    pacer.observe(paced(128), 0.080)  # no decode step seen yet
    assert pacer.bound == 128 and pacer.decode_s(1) is None
    for seconds in (0.019, 0.020, 0.005, 0.100, 0.021):  # a fast and a slow one among them
        pacer.observe(decode, seconds)
    assert pacer.decode_s(1) == 0.020
    pacer.observe(paced(128), 0.080)  # 60 ms over a decode step for 128 tokens: 20 ms fit 42 -> 40
    assert pacer.bound == 40
    pacer.observe(paced(40), 0.025)  # 5 ms for 40 tokens, but the slow step is the upper median of two: still 40
    assert pacer.bound == 40
    pacer.observe(paced(40), 0.025)  # the fast steps are the most now: 160 would fit, growth is at most 2x
    assert pacer.bound == 80
    pacer.observe(paced(64, paced=False), 1.0)  # a prompt alone (nothing decoding): not a paced step
    assert pacer.bound == 80
    for _ in range(PACER_WINDOW - 3):
        pacer.observe(paced(80), 0.030)  # 10 ms for 80 tokens: 160 fit
    pacer.observe(paced(4), 0.040)  # one slow step (20 ms for 4 tokens): noise, not the tokens' cost
    assert pacer.bound == 128
    for _ in range(PACER_WINDOW // 2):
        pacer.observe(paced(80), 0.500)  # far over, step after step: one unit, the least a step can prefill
    assert pacer.bound == PACED_CHUNK_UNIT

    separate = StepPacer(ceiling=128, slowdown=2.0, mixed_steps=False)
    separate.observe(decode, 0.020)
    separate.observe(paced(128), 0.040)  # a prefill step between two decode steps is all delay: 20 ms fit 64
    assert separate.bound == 64
    separate.observe(paced(64), 0.500)  # far over: one tile
    assert separate.bound == 16


def test_the_pacer_measures_a_paced_step_against_a_decode_step_of_as_many_rows():
    """A decode step's time grows with its rows: a paced step of 8 decodes and 32 prompt tokens taking 30 ms is 10
    ms over the 8-row decode step (20 ms), not 25 ms over a 2-row one (5 ms), so at slowdown 2 the next bound is 20
    ms at 10/32 ms a token: 64 (the 2-row step would give 0.8 ms a token and 5 ms allowed: 4). A row count not seen
    takes the nearest fewer rows' time; with none fewer, the fewest rows'. Each is the median of its last steps."""
    def decode(rows):
        return SchedulerOutput(is_prefill=False, seqs=["a decode"] * rows)

    def paced(tokens, rows):
        return SchedulerOutput(is_prefill=True, seqs=["a decode"] * rows + ["a chunk"], prompt_tokens=tokens,
                               paced=True, num_decodes=rows)

    pacer = StepPacer(ceiling=128, slowdown=2.0, mixed_steps=True)
    pacer.observe(decode(2), 0.005)
    for seconds in (0.019, 0.020, 0.030):
        pacer.observe(decode(8), seconds)
    assert (pacer.decode_s(2), pacer.decode_s(8)) == (0.005, 0.020)
    assert (pacer.decode_s(5), pacer.decode_s(12), pacer.decode_s(1)) == (0.005, 0.020, 0.005)
    pacer.observe(paced(32, rows=8), 0.030)
    assert pacer.bound == 64
    pacer.observe(paced(64, rows=2), 0.045)  # 40 ms over the 2-row step for 64 tokens (0.62 ms a token)
    pacer.observe(paced(64, rows=2), 0.045)  # the upper median of three: 5 ms fit 8
    assert pacer.bound == 8


@pytest.mark.parametrize("per_token_s", [0.0005, 0.0001, 0.002])
def test_max_decode_slowdown_shrinks_chunks_that_would_delay_decoding_streams(prompts, reference, monkeypatch,
                                                                           per_token_s):
    """The engine reports step times to the pacer (here: 10 ms per step plus per_token_s per prompt token, so the
    test does not depend on this machine's speed). A 100-token prompt arrives while a stream decodes: its first
    chunk is the ceiling (64); then a step may add 10 ms of prompt tokens: 20 a step at 0.5 ms each (mixed steps;
    a separate prefill step is all delay and takes whole tiles: 16), 64 at 0.1 ms, and at 2 ms 4 a step on mixed
    steps, below a tile, since they lay tokens out one by one (16, one tile, on separate steps). The tokens are
    those of the unpaced engine. Synchronous steps: with asynchronous scheduling a step's time reaches the pacer
    after the next step was scheduled, so each bound applies one step later."""
    llm = make_llm(max_num_batched_tokens=128, max_prefill_tokens_while_decoding=64, max_decode_slowdown=2.0,
                   async_scheduling=False)
    sched = llm.engine.scheduler
    if not sched.mixed_steps and per_token_s == 0.0001:
        pytest.skip("a separate prefill step is all delay: this case is about mixed steps")
    bound = {0.0005: 20, 0.0001: 64, 0.002: 4} if sched.mixed_steps else {0.0005: 16, 0.002: 16}
    real = sched.observe_step
    monkeypatch.setattr(sched, "observe_step", lambda out, _: real(out, 0.010 + per_token_s * out.prompt_tokens))
    steps = _spy_steps(sched)
    long_prompt, outputs = _long_prompt_while_decoding(llm.engine, prompts[0], decode_steps=2)  # a decode's time
    chunks = [prompt for decoding, prompt, _ in steps[1:] if prompt and decoding]
    assert chunks[0] == 64 and sum(chunks) == 100
    assert all(c <= bound[per_token_s] for c in chunks[1:]) and max(chunks[1:]) == min(bound[per_token_s], 100 - 64)
    assert outputs["first"] == reference[0]
    assert outputs["long"] == make_llm().generate([long_prompt], GREEDY, use_tqdm=False)[0].outputs[0].token_ids


@pytest.mark.skipif(not MIXED, reason="mixed steps need the native CPU kernel (attention_backend='auto' on CPU)")
def test_mixed_steps_take_half_as_many_sequence_rows_as_tokens_and_compile_nothing_new(prompts, reference):
    """A prefill-shaped step of the mixed-step backends has S = T / 2 sequence rows below the largest T (the LM head
    and the sampler cost per row); a step with more sequences than that runs at a larger T, which is compiled at
    start-up too: every step's shape is one of all_shapes(), nothing compiles later, outputs are unchanged."""
    llm = make_llm(max_num_seqs=40, max_num_batched_tokens=128, precompile=True)
    runner = llm.engine.runner
    assert runner.prefill_buckets == [64, 128]
    assert [runner._prefill_seqs(t) for t in runner.prefill_buckets] == [32, 40]
    assert runner._prefill_bucket(32, 17) == 64 and runner._prefill_bucket(40, 33) == 128
    with pytest.raises(ValueError, match="exceed the largest prefill bucket"):
        runner._prefill_bucket(129, 1)
    shapes = runner.compiled_shapes
    assert shapes == set(runner.all_shapes())
    seen = []
    dispatch = runner.dispatch

    def spy(inputs, rows):
        seen.append((inputs.layout.key, len(rows.seqs)))
        return dispatch(inputs, rows)

    runner.dispatch = spy
    many = prompts * 3  # 36 sequences decode while later prompts are prefilled beside them
    outs = llm.generate(many, GREEDY, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == reference * 3
    assert runner.compiled_shapes == shapes
    mixed = [(key, n) for key, n in seen if key[4] is None]
    assert all(n <= key[1] for key, n in mixed)
    assert any(key[0] == 64 and key[1] == 32 for key, _ in mixed)
    assert any(key[0] == 128 and n > 32 for key, n in mixed)  # more sequences than T = 64 takes: the next T


def test_priority_scheduling_runs_lower_values_first_with_the_same_outputs(prompts, reference):
    """scheduling_policy="priority": one seat, so requests run one after another in priority order (each one's
    first token after the previous one's); every output is the same as alone, in a pool so small that requests
    preempt each other; a priority under fcfs, or of the wrong type, is refused naming it."""
    llm = make_llm(scheduling_policy="priority", max_num_seqs=1)
    priority = [3, -1, 2, 0]
    outs = llm.generate(prompts[:4], GREEDY, use_tqdm=False, priority=priority)
    firsts = [o.metrics["first_token_time"] for o in outs]
    assert sorted(range(4), key=lambda i: firsts[i]) == sorted(range(4), key=lambda i: priority[i])
    assert [o.outputs[0].token_ids for o in outs] == reference[:4]
    small = make_llm(scheduling_policy="priority", num_blocks=24)
    outs = small.generate(prompts, GREEDY, use_tqdm=False, priority=[i % 3 for i in range(len(prompts))])
    assert [o.outputs[0].token_ids for o in outs] == reference and small.stats()["preemptions"] > 0
    with pytest.raises(ValueError, match="^priority=1 needs scheduling_policy='priority'"):
        make_llm().generate(prompts[:1], GREEDY, use_tqdm=False, priority=[1])
    with pytest.raises(TypeError, match="^priority must be an integer"):
        llm.generate(prompts[:1], GREEDY, use_tqdm=False, priority=[1.5])
    with pytest.raises(ValueError, match="one integer per prompt"):
        llm.generate(prompts[:2], GREEDY, use_tqdm=False, priority=[1])
    s = llm.stats()  # the refused batches left nothing queued or held
    assert s["num_used"] == s["num_running"] == s["num_waiting"] == 0 and not llm.engine.requests
    with pytest.raises(ValueError, match="scheduling_policy"):
        make_llm(scheduling_policy="lifo")
