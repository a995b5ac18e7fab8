"""Continuous batching end to end on a tiny in-memory model: budgets, chunked prefill, preemption."""

from __future__ import annotations

import pytest

from jaxpaged import LLM, SamplingParams
from tests.tiny import random_params, random_prompts, tiny_config

CONFIG = tiny_config()
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


def test_tiny_pool_preempts_and_still_gives_the_same_outputs(prompts, reference):
    # 22 usable blocks of 8 tokens = 176 slots; 12 requests of up to 84 tokens each need far more.
    llm = make_llm(num_blocks=23, enable_prefix_caching=False)
    outs = llm.generate(prompts, GREEDY, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == reference
    stats = llm.stats()
    assert stats["preemptions"] > 0 and stats["preemptions_recompute"] == stats["preemptions"]
    assert stats["num_used"] == 0 and stats["num_free"] == 22
    llm.engine.block_manager.check_invariants()


def test_outputs_come_back_in_input_order(prompts):
    llm = make_llm()
    params = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for n in range(1, len(prompts) + 1)]
    outs = llm.generate(prompts, params, use_tqdm=False)
    assert [len(o.outputs[0].token_ids) for o in outs] == list(range(1, len(prompts) + 1))
    assert [o.prompt_token_ids for o in outs] == [p["prompt_token_ids"] for p in prompts]


def test_prefill_chunks_are_bounded_while_others_decode(reference, prompts):
    """max_prefill_tokens_while_decoding: a prompt that arrives while sequences decode is prefilled at most that many
    tokens per step (so a decoding stream waits at most one such step between tokens); with nothing decoding it gets
    the whole budget; the tokens are those of the unbounded engine."""
    llm = make_llm(max_num_batched_tokens=128, max_prefill_tokens_while_decoding=32)
    sched = llm.engine.scheduler
    steps = []
    original = sched.schedule

    def spy():
        decoding = any(sched._decodable(s) for s in sched.running)
        out = original()
        if out is not None:
            steps.append((decoding, out.is_prefill, out.num_tokens))
        return out

    sched.schedule = spy
    engine = llm.engine
    engine.add_request("first", prompts[0], GREEDY)
    while not any(s.output_token_ids for s in sched.running):  # "first" is decoding now
        engine.step()
    long_prompt = {"prompt_token_ids": random_prompts(1, 100, 100, seed=9)[0]}
    engine.add_request("long", long_prompt, GREEDY)
    outputs = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                outputs[out.request_id] = out.outputs[0].token_ids
    assert steps[0] == (False, True, steps[0][2]) and steps[0][2] > 32  # alone: the whole prompt at once
    chunks = [n for decoding, prefill, n in steps[1:] if prefill]
    assert chunks and max(chunks) <= 32 and sum(chunks) >= 100
    assert outputs["first"] == reference[0]
    assert outputs["long"] == make_llm().generate([long_prompt], GREEDY, use_tqdm=False)[0].outputs[0].token_ids


def test_bounded_prefill_chunk_must_fit_the_step_budget():
    with pytest.raises(ValueError, match="max_prefill_tokens_while_decoding"):
        make_llm(max_num_batched_tokens=64, max_prefill_tokens_while_decoding=128)
    with pytest.raises(ValueError, match="max_prefill_tokens_while_decoding"):
        make_llm(max_prefill_tokens_while_decoding=8)
