"""Asynchronous scheduling (the default) gives exactly the outputs of the synchronous loop: the step N + 1 that is
dispatched before step N's tokens reach the host takes its decoding rows' tokens from the device, stop conditions
apply one step late and the extra token of a finished sequence is dropped. Every request feature is compared, on a
tiny random model, between `async_scheduling=True` and `False`; and the loop really overlaps: step N + 1 is on the
device before the host reads step N's tokens.
"""

from __future__ import annotations

import dataclasses

import pytest

from jaxpaged import BeamSearchParams, SamplingParams
from jaxpaged.worker.input_batch import InputBatch
from jaxpaged.worker.model_runner import ModelRunner
from tests.tiny import CharTokenizer, checked, random_params, random_prompts, tiny_config, tiny_llm

CONFIG = tiny_config(vocab_size=96, layers=2)
PARAMS = random_params(CONFIG)
PROMPTS = [{"prompt_token_ids": p} for p in random_prompts(6, 3, 30, seed=4)]

CASES = {
    "greedy": SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True),
    "eos": SamplingParams(temperature=1.0, seed=1, max_tokens=30, logit_bias={1: 2.5}),  # EOS (1) made likely
    "seeded": SamplingParams(temperature=0.9, top_p=0.9, top_k=30, seed=7, max_tokens=16, ignore_eos=True),
    "stop_ids": SamplingParams(temperature=1.0, seed=3, max_tokens=30, stop_token_ids=[5, 6, 7, 8, 9, 10]),
    "min_tokens": SamplingParams(temperature=1.0, seed=5, max_tokens=25, min_tokens=12, stop_token_ids=[5, 6, 7]),
    "stop_strings": SamplingParams(temperature=1.0, seed=11, max_tokens=30, stop=["ab", "q"],
                                   include_stop_str_in_output=True),
    "logprobs": SamplingParams(temperature=0.7, seed=2, max_tokens=10, logprobs=3, ignore_eos=True),
    "penalties": SamplingParams(temperature=0.8, seed=9, max_tokens=14, presence_penalty=0.8,
                                frequency_penalty=0.4, repetition_penalty=1.3, ignore_eos=True),
    "penalties_n2": SamplingParams(n=2, temperature=1.0, seed=21, max_tokens=16, presence_penalty=2.0,
                                   frequency_penalty=1.0, repetition_penalty=1.2, ignore_eos=True),
    "penalties_greedy": SamplingParams(temperature=0.0, max_tokens=16, presence_penalty=0.5, frequency_penalty=0.5,
                                       repetition_penalty=1.5, ignore_eos=True),
    "logit_bias": SamplingParams(temperature=0.0, max_tokens=12, logit_bias={40: 5.0, 41: -100.0}, ignore_eos=True),
    "n3": SamplingParams(n=3, temperature=1.0, seed=13, max_tokens=12, ignore_eos=True),
    "bad_words": SamplingParams(temperature=1.0, seed=17, max_tokens=12, bad_words=["b", "cd"], ignore_eos=True),
    "allowed": SamplingParams(temperature=1.0, seed=19, max_tokens=12, allowed_token_ids=list(range(30, 60)),
                              ignore_eos=True),
}


def outputs(llm, params):
    outs = llm.generate(PROMPTS, params, use_tqdm=False)
    return [[(c.token_ids, c.text, c.finish_reason, c.stop_reason, c.logprobs, c.cumulative_logprob)
             for c in o.outputs] for o in outs]


@pytest.fixture(scope="module")
def pair():
    """The same model twice: asynchronous and synchronous step loops."""
    def make(async_scheduling):
        llm = tiny_llm(CONFIG, PARAMS, async_scheduling=async_scheduling, max_num_seqs=8, num_blocks=120)
        llm.engine.tokenizer = CharTokenizer()  # text and stop strings; the prompts are token ids
        return llm

    return make(True), make(False)


@pytest.mark.parametrize("case", list(CASES))
def test_async_scheduling_gives_the_synchronous_outputs(pair, case):
    fast, slow = pair
    assert fast.engine.async_scheduling and not slow.engine.async_scheduling
    got, want = outputs(fast, CASES[case]), outputs(slow, CASES[case])
    assert got == want
    for llm in pair:
        llm.engine.block_manager.check_invariants()
        assert llm.stats()["num_used"] == 0 and not llm.engine.requests


def test_the_stop_cases_do_stop_early(pair):
    """The cases above exercise what they name: some sequences end on an EOS, a stop id, a stop string."""
    _, slow = pair
    reasons = {case: [c[2:4] for o in outputs(slow, CASES[case]) for c in o]
               for case in ("eos", "stop_ids", "stop_strings")}
    assert any(r == ("stop", None) for r in reasons["eos"])
    assert any(r[0] == "stop" and isinstance(r[1], int) for r in reasons["stop_ids"])
    assert any(r[0] == "stop" and isinstance(r[1], str) for r in reasons["stop_strings"])


def test_beam_search_is_the_same_with_and_without_async(pair):
    fast, slow = pair
    params = BeamSearchParams(beam_width=3, max_tokens=8)
    got = fast.beam_search(PROMPTS[:3], params, use_tqdm=False)
    want = slow.beam_search(PROMPTS[:3], params, use_tqdm=False)
    assert [[(s.tokens, s.cum_logprob) for s in o.sequences] for o in got] == \
        [[(s.tokens, s.cum_logprob) for s in o.sequences] for o in want]


def test_prefix_caching_is_the_same_with_and_without_async(pair):
    """Requests that share a long prefix hit the cache under both loops, with the same tokens."""
    shared = random_prompts(1, 40, 40, seed=8)[0]
    prompts = [{"prompt_token_ids": shared + [3 + i]} for i in range(4)]
    sp = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
    results = []
    for llm in pair:
        llm.generate(prompts[:1], sp, use_tqdm=False)  # fills the cache
        outs = llm.generate(prompts, sp, use_tqdm=False)
        results.append([(o.outputs[0].token_ids, o.num_cached_tokens) for o in outs])
    assert results[0] == results[1]
    assert all(cached >= 32 for _, cached in results[0])


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_preemption_gives_the_same_tokens_with_and_without_async(mode):
    """A pool too small for every sequence at once: sequences are preempted (recomputed or swapped) and come back;
    both loops give the tokens each prompt gets alone, and the runner's persistent block tables always equal the
    pool's."""
    prompts = [{"prompt_token_ids": p} for p in random_prompts(6, 8, 20, seed=6)]
    sp = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    alone = [tiny_llm(CONFIG, PARAMS).generate([p], sp, use_tqdm=False)[0].outputs[0].token_ids for p in prompts]
    for async_scheduling in (True, False):
        llm = tiny_llm(CONFIG, PARAMS, async_scheduling=async_scheduling, max_num_seqs=6, num_blocks=14,
                       preemption_mode=mode, swap_space=0.01 if mode == "swap" else 0.0)
        engine = llm.engine
        engine.step = checked(engine)
        outs = llm.generate(prompts, sp, use_tqdm=False)
        assert [o.outputs[0].token_ids for o in outs] == alone
        assert llm.stats()[f"preemptions_{mode}"] > 0
        assert llm.stats()["num_used"] == 0


def test_the_next_step_is_dispatched_before_the_last_ones_tokens_are_read(monkeypatch):
    """The overlap itself: in steady decoding, each step() dispatches step N + 1 and then fetches step N."""
    events = []
    dispatch, fetch = ModelRunner.dispatch, ModelRunner.fetch
    monkeypatch.setattr(ModelRunner, "dispatch", lambda self, *a: events.append("dispatch") or dispatch(self, *a))
    monkeypatch.setattr(ModelRunner, "fetch", lambda self, h: events.append("fetch") or fetch(self, h))
    llm = tiny_llm(CONFIG, PARAMS)
    llm.generate(PROMPTS[:2], SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True), use_tqdm=False)
    pattern = "".join("d" if e == "dispatch" else "f" for e in events)
    assert pattern.count("d") == pattern.count("f") > 10
    assert "dd" in pattern and pattern.index("dd") < pattern.index("f")  # step 2 queued before step 1 is read
    assert "dfdfdf" in pattern  # steady state: one step in flight while the host reads the one before


def test_penalized_requests_keep_the_loop_asynchronous(monkeypatch):
    """Penalties need a row's token history, not on the host: the step counts the last token, which it reads from
    the device, itself. So penalized requests still overlap steps (their tokens are the synchronous loop's: the
    penalties cases above)."""
    events = []
    dispatch, fetch = ModelRunner.dispatch, ModelRunner.fetch
    monkeypatch.setattr(ModelRunner, "dispatch", lambda self, *a: events.append("d") or dispatch(self, *a))
    monkeypatch.setattr(ModelRunner, "fetch", lambda self, h: events.append("f") or fetch(self, h))
    llm = tiny_llm(CONFIG, PARAMS)
    llm.generate(PROMPTS[:2], CASES["penalties"], use_tqdm=False)
    pattern = "".join(events)
    assert "dfdfdf" in pattern and pattern.index("dd") < pattern.index("f")


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_a_penalized_rows_history_is_its_sequences_tokens_at_every_step(monkeypatch, mode):
    """The persistent batch keeps each penalized row's tokens as an array and extends it step by step: at every step
    it holds exactly the tokens the host has, through rows reused by other sequences and preemption."""
    checked = []
    original = InputBatch.seen_tokens

    def checking(self, out, layout, max_len):
        seen = original(self, out, layout, max_len)
        for i, seq in enumerate(out.seqs):
            if seq.params.has_penalties:
                n = len(seq.token_ids)
                assert seen[i, :n].tolist() == seq.token_ids and (seen[i, n:] == -1).all()
                checked.append(seq.seq_id)
        return seen

    monkeypatch.setattr(InputBatch, "seen_tokens", checking)
    llm = tiny_llm(CONFIG, PARAMS, max_num_seqs=4, num_blocks=14, preemption_mode=mode,
                   swap_space=0.01 if mode == "swap" else 0.0)
    prompts = [{"prompt_token_ids": p} for p in random_prompts(6, 8, 20, seed=6)]
    llm.generate(prompts, dataclasses.replace(CASES["penalties_n2"], max_tokens=20), use_tqdm=False)
    assert llm.stats()[f"preemptions_{mode}"] > 0
    assert len(checked) > 100 and len(set(checked)) >= 12  # every sample of every prompt, step after step


def test_final_only_requests_give_no_output_until_they_finish():
    """`LLM.generate`'s requests: the engine hands out nothing per step, only each request's tokens when it ends."""
    llm = tiny_llm(CONFIG, PARAMS)
    engine = llm.engine
    engine.add_request("a", PROMPTS[0], SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True,
                                                       output_kind=2))
    per_step = []
    while engine.has_unfinished_requests():
        per_step.append(engine.step())
    assert all(not outs for outs in per_step[:-1])
    (final,) = per_step[-1]
    assert final.finished and len(final.deltas[0].token_ids) == 8
