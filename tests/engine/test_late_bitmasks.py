"""Late bitmasks: where the sampler runs apart from the step (a GPU: `ModelRunner.split_sampler`, forced on here, on
CPU), a grammar's or bad words' bitmask is computed after the step is dispatched, once the previous step's tokens are
in, so those requests keep the step loop asynchronous. Their tokens are the synchronous loop's (the fused engine, which
lays each bitmask out before its step); a bitmask that fails fails its own request."""

from __future__ import annotations

import dataclasses
import json

import jsonschema
import pytest

from jaxpaged import LLM, SamplingParams
from jaxpaged.sampling_params import StructuredOutputsParams
from jaxpaged.worker import model_runner
from jaxpaged.worker.model_runner import ModelRunner
from tests.tiny_hf import make_tiny_hf_model

SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 5},
                                           "n": {"type": "integer", "minimum": 0, "maximum": 99}},
          "required": ["name", "n"], "additionalProperties": False}
PROMPTS = ["The lighthouse keeper kept a ledger", "hello", "What is the capital of France?"]
EMPTY = "[^\\x00-\\U0010FFFF]"  # a regex no token can start: a grammar that reaches it fails while generating


def so(**kw) -> StructuredOutputsParams:
    return StructuredOutputsParams(**kw)


CASES = {
    "json_sampled_n3": SamplingParams(n=3, temperature=1.0, seed=5, max_tokens=60, structured_outputs=so(json=SCHEMA)),
    "regex_greedy": SamplingParams(temperature=0.0, max_tokens=20, structured_outputs=so(regex="[a-e]{3,12}")),
    "choice": SamplingParams(temperature=1.0, seed=3, max_tokens=8,
                             structured_outputs=so(choice=["yes", "no", "maybe"])),
    "bad_words_of_several_tokens": SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True,
                                                  bad_words=["the keeper", "hello world", "a"]),
}


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    """The same tiny HF model (a real tokenizer, for the grammars) twice: the sampler split from the step (late
    bitmasks), and fused into it (CPU's default: these requests make the loop synchronous)."""
    path = make_tiny_hf_model(tmp_path_factory.mktemp("tiny"), "llama")

    def make(split: bool) -> LLM:
        with pytest.MonkeyPatch.context() as mp:
            mp.setattr(model_runner, "split_sampler_here", lambda multihost: split)
            llm = LLM(path, dtype="float32", max_num_seqs=12, max_num_batched_tokens=128, max_model_len=128,
                      block_size=16, num_blocks=120, precompile=False, show_progress=False)
        assert llm.engine.runner.split_sampler is split and llm.engine._late_masks is split
        return llm

    return make(True), make(False)


def outputs(llm: LLM, params) -> list:
    plain = SamplingParams(temperature=0.7, seed=1, max_tokens=16, ignore_eos=True)
    outs = llm.generate(PROMPTS + ["a plain request beside them"], [params] * len(PROMPTS) + [plain], use_tqdm=False)
    return [[(c.token_ids, c.text, c.finish_reason) for c in o.outputs] for o in outs]


@pytest.mark.parametrize("case", list(CASES))
def test_late_bitmasks_give_the_synchronous_loops_tokens(pair, case):
    late, fused = pair
    got = outputs(late, CASES[case])
    assert got == outputs(fused, CASES[case])
    if case.startswith("json"):
        for request in got[:len(PROMPTS)]:
            for _, text, reason in request:
                assert reason == "stop"
                jsonschema.validate(json.loads(text), SCHEMA)
    for llm in pair:
        llm.engine.block_manager.check_invariants()
        assert llm.stats()["num_used"] == 0 and not llm.engine.requests


def test_grammar_requests_keep_the_loop_asynchronous_with_a_split_sampler(pair, monkeypatch):
    """Step N + 1 is dispatched before step N's tokens are read, and its sampler is queued after them."""
    late, fused = pair
    events = []
    dispatch, fetch, sample = ModelRunner.dispatch, ModelRunner.fetch, ModelRunner.sample_pending
    monkeypatch.setattr(ModelRunner, "dispatch", lambda self, *a: events.append("d") or dispatch(self, *a))
    monkeypatch.setattr(ModelRunner, "fetch", lambda self, h: events.append("f") or fetch(self, h))
    monkeypatch.setattr(ModelRunner, "sample_pending", lambda self, *a: events.append("s") or sample(self, *a))
    late.generate(PROMPTS, CASES["regex_greedy"], use_tqdm=False)
    pattern = "".join(events)
    assert "dfsdfsdfs" in pattern, pattern  # dispatch N + 1, read N, then N + 1's masks and sampler
    events.clear()
    fused.generate(PROMPTS, CASES["regex_greedy"], use_tqdm=False)
    assert "dd" not in "".join(events) and "s" not in "".join(events)  # fused: synchronous, masks laid out first


def test_a_grammar_that_fails_in_a_late_bitmask_fails_its_own_request(pair):
    late, _ = pair
    failing = SamplingParams(max_tokens=30, temperature=0,
                             structured_outputs=so(grammar=f'start: "abcdefghij" x\nx: /{EMPTY}/'))
    fine = SamplingParams(max_tokens=30, temperature=0, ignore_eos=True)
    engine = late.engine
    engine.add_request("bad", [5, 6, 7], failing)
    engine.add_request("good", [5, 6, 8], fine)
    outs: dict[str, list] = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            outs.setdefault(out.request_id, []).append(out)
    bad = outs["bad"][-1]
    assert bad.error is not None and bad.error.startswith("GrammarError: "), bad.error
    assert all(o.error is None for o in outs["good"]) and outs["good"][-1].finished
    assert sum(len(d.token_ids) for o in outs["good"] for d in o.deltas) == 30
    assert engine.stats()["num_used"] == 0
    engine.block_manager.check_invariants()


def test_a_bad_word_of_two_tokens_is_banned_right_after_its_first_token(pair):
    """The ban of a two-token bad word depends on the token just sampled, the one a late bitmask waits for: the word
    is taken from the plain greedy output, and both loops steer around it the same way."""
    late, fused = pair
    tok = late.engine.tokenizer
    plain = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    free = late.generate([PROMPTS[0]], plain, use_tqdm=False)[0].outputs[0].token_ids
    word = next(w for i in range(2, len(free) - 1)
                if (w := tok.decode(free[i:i + 2])).strip() == w and len(w) > 1
                and tok.encode(w, add_special_tokens=False) == free[i:i + 2])
    banned = dataclasses.replace(plain, bad_words=[word])
    got = [late.generate([PROMPTS[0]], banned, use_tqdm=False)[0].outputs[0] for _ in range(2)]
    want = fused.generate([PROMPTS[0]], banned, use_tqdm=False)[0].outputs[0]
    assert got[0].token_ids == got[1].token_ids == want.token_ids != free
    assert word not in want.text


def test_a_step_whose_requests_all_fail_still_frees_the_rows_of_finished_ones(pair):
    """The scheduler hands each diff over once (rows of sequences that left, changed tables): a step that does not
    run because its only request's grammar failed must still free the row of the plain request that finished the
    step before. It did not (the row leaked; once every row had leaked, every request failed with "no free row").
    The plain request finishes after 1..14 tokens, so one of them finishes just before the grammar fails."""
    for late in pair:
        engine = late.engine
        batch = engine.runner.input_batch
        failing = SamplingParams(max_tokens=30, temperature=0,
                                 structured_outputs=so(grammar=f'start: "abcdefghij" x\nx: /{EMPTY}/'))
        errors = []
        for k in range(1, 15):
            engine.add_request(f"bad{k}", [5, 6, 7], failing)
            engine.add_request(f"plain{k}", [5, 6, 8], SamplingParams(max_tokens=k, temperature=0, ignore_eos=True))
            while engine.has_unfinished_requests():
                errors += [out.error for out in engine.step() if out.error is not None]
            # every row still held belongs to a sequence whose removal the next step hands over
            assert set(batch.row_of) <= set(engine.scheduler._removed), (k, batch.row_of)
            assert batch.num_free_rows == batch.max_rows - len(batch.row_of)
        assert len(errors) == 14 and all(e.startswith("GrammarError: ") for e in errors), errors
        assert engine.stats()["num_used"] == 0
