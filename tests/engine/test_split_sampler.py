"""A step compiled without its sampler (on a GPU, jaxpaged.worker.step's `split_sampler`) gives the fused step's
outputs: forced on here, on CPU, every request feature is compared with the fused engine; the step's executable holds
no conditional (XLA GPU makes the host wait at each), and the separate sampler runs only for steps that need more
than the argmax.
"""

from __future__ import annotations

import pytest

from jaxpaged import BeamSearchParams, SamplingParams
from jaxpaged.worker import model_runner
from jaxpaged.worker.model_runner import ModelRunner
from tests.tiny import CharTokenizer, random_params, random_prompts, tiny_config, tiny_llm

CONFIG = tiny_config(vocab_size=96, layers=2)
PARAMS = random_params(CONFIG)
PROMPTS = [{"prompt_token_ids": p} for p in random_prompts(6, 3, 30, seed=6)]

CASES = {
    "greedy": SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True),
    "seeded": SamplingParams(temperature=0.9, top_p=0.9, top_k=30, min_p=0.01, seed=7, max_tokens=16,
                             ignore_eos=True),
    "greedy_logprobs": SamplingParams(temperature=0.0, max_tokens=10, logprobs=3, ignore_eos=True),
    "sampled_logprobs": SamplingParams(temperature=0.7, seed=2, max_tokens=10, logprobs=2, ignore_eos=True),
    "penalties": SamplingParams(temperature=0.0, max_tokens=14, presence_penalty=0.8, frequency_penalty=0.4,
                                repetition_penalty=1.3, ignore_eos=True),
    "logit_bias": SamplingParams(temperature=0.0, max_tokens=12, logit_bias={40: 5.0, 41: -100.0}, ignore_eos=True),
    "min_tokens": SamplingParams(temperature=0.0, max_tokens=20, min_tokens=12, stop_token_ids=[5, 6, 7]),
    "bad_words": SamplingParams(temperature=0.0, max_tokens=12, bad_words=["b", "cd"], ignore_eos=True),
    "allowed": SamplingParams(temperature=1.0, seed=19, max_tokens=12, allowed_token_ids=list(range(30, 60)),
                              ignore_eos=True),
    "stop_strings": SamplingParams(temperature=1.0, seed=11, max_tokens=30, stop=["ab", "q"]),
    "n3": SamplingParams(n=3, temperature=1.0, seed=13, max_tokens=12, ignore_eos=True),
}


def outputs(llm, params):
    outs = llm.generate(PROMPTS, params, use_tqdm=False)
    return [[(c.token_ids, c.text, c.finish_reason, c.stop_reason, c.logprobs, c.cumulative_logprob)
             for c in o.outputs] for o in outs]


def make(split: bool, **options):
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(model_runner, "split_sampler_here", lambda multihost: split)
        llm = tiny_llm(CONFIG, PARAMS, **{"max_num_seqs": 8, "num_blocks": 120, **options})
    assert llm.engine.runner.split_sampler is split
    llm.engine.tokenizer = CharTokenizer()  # text and stop strings; the prompts are token ids
    return llm


@pytest.fixture(scope="module")
def pair():
    """The same model twice: the sampler split from the step, and fused into it (CPU's default)."""
    return make(True), make(False)


@pytest.fixture
def sampler_calls(monkeypatch):
    """The steps that ran the separate sampler (`ModelRunner._flush` with a step pending): their row counts."""
    calls = []
    original = ModelRunner._flush

    def counted(self):
        if self._pending is not None:
            calls.append(self._pending[0].layout.num_seqs)
        return original(self)

    monkeypatch.setattr(ModelRunner, "_flush", counted)
    return calls


@pytest.mark.parametrize("case", list(CASES))
def test_the_split_sampler_gives_the_fused_steps_outputs(pair, case, sampler_calls):
    split, fused = pair
    got = outputs(split, CASES[case])
    assert len(sampler_calls) == 0 if case == "greedy" else len(sampler_calls) > 0, sampler_calls
    assert got == outputs(fused, CASES[case])
    for llm in pair:
        llm.engine.block_manager.check_invariants()
        assert llm.stats()["num_used"] == 0 and not llm.engine.requests


def test_a_batch_mixing_greedy_and_sampled_rows(pair):
    """Greedy rows beside sampled ones (the step then runs the sampler for all of them) keep their argmax, and
    each row's tokens are the fused engine's."""
    params = [CASES["greedy"], CASES["seeded"], CASES["greedy_logprobs"], CASES["greedy"], CASES["penalties"],
              CASES["greedy"]]
    got, want = (llm.generate(PROMPTS, params, use_tqdm=False) for llm in pair)
    assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in want]
    assert [o.outputs[0].logprobs for o in got] == [o.outputs[0].logprobs for o in want]


def test_beam_search_is_the_same(pair):
    params = BeamSearchParams(beam_width=3, max_tokens=8)
    beams = [[[(s.tokens, s.cum_logprob) for s in o.sequences]
              for o in llm.beam_search(PROMPTS[:3], params, use_tqdm=False)] for llm in pair]
    assert beams[0] == beams[1]


def test_preemption_and_prefix_caching_with_a_split_sampler():
    """A pool too small for the batch (recompute preemption) and a second pass over cached prefixes: the fused
    engine's tokens."""
    prompts = [{"prompt_token_ids": p} for p in random_prompts(4, 20, 30, seed=8)]
    params = SamplingParams(temperature=0.8, seed=3, max_tokens=24, ignore_eos=True)
    runs = []
    for split in (True, False):
        llm = make(split, num_blocks=14, enable_prefix_caching=True)
        first = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
        again = llm.generate(prompts[-2:], params, use_tqdm=False)  # the last cached
        runs.append((first, [o.outputs[0].token_ids for o in again], llm.engine.stats()["preemptions"] > 0,
                     [o.num_cached_tokens > 0 for o in again]))
    assert runs[0] == runs[1]
    assert runs[0][2] and all(runs[0][3]), "no preemption or no cache hit: the test would prove nothing"


def test_the_split_step_holds_no_conditional_and_the_fused_one_does(pair):
    """What the split is for: XLA GPU runs a conditional by waiting on the host for its predicate, so a step that
    holds one returns to the host only when the device reaches it. The compiled step (CPU here: the same ops) has
    none when split; the fused one has the sampler's."""
    split, fused = pair
    for llm, want_conditionals in ((split, False), (fused, True)):
        runner = llm.engine.runner
        layout = runner.all_layouts()[0]
        hlo = runner._executable(layout).as_text()
        assert (" conditional(" in hlo) is want_conditionals


def test_start_up_compiles_the_split_samplers_and_nothing_compiles_later(caplog):
    """precompile: every row count's sampler is compiled with the steps (a request that samples then compiles
    nothing); without it, each when first needed."""
    llm = make(True, precompile=True)
    runner = llm.engine.runner
    assert set(runner._samplers) == {layout.num_seqs for layout in runner.all_layouts() if not layout.spec_width}
    with caplog.at_level("WARNING", logger="jaxpaged.worker.model_runner"):
        assert outputs(llm, CASES["seeded"]) == outputs(make(False), CASES["seeded"])
    assert not [r for r in caplog.records if "after start-up" in r.getMessage()]
    lazy = make(True)
    assert not lazy.engine.runner._samplers
    outputs(lazy, CASES["greedy"])
    assert not lazy.engine.runner._samplers, "a greedy run needs no sampler"
    outputs(lazy, CASES["seeded"])
    assert lazy.engine.runner._samplers


@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_speculative_decoding_with_a_split_sampler(temperature):
    """Speculative decoding (n-gram): verifying steps keep their sampler inside, the others are split; the tokens
    are the fused engine's, and proposals were made."""
    prompts = [{"prompt_token_ids": p * 4} for p in random_prompts(3, 5, 7, seed=1)]  # they repeat: n-gram finds
    params = SamplingParams(temperature=temperature, seed=5, max_tokens=20, ignore_eos=True)
    spec = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "prompt_lookup_max": 3}
    runs = []
    for split in (True, False):
        llm = make(split, speculative_config=spec)
        outs = llm.generate(prompts, params, use_tqdm=False)
        stats = llm.engine.stats()
        runs.append(([o.outputs[0].token_ids for o in outs], stats["spec_proposed_tokens"]))
    assert runs[0] == runs[1]
    assert runs[0][1] > 0, "nothing was proposed: the test would prove nothing"


def test_a_steps_sampler_is_queued_after_the_next_step_is_laid_out(pair, monkeypatch):
    """The sampler's conditionals hold the host until the device has run the step's model: the runner queues a
    step's sampler when the next step has been laid out (at its dispatch, just before it), or when the step is read
    (the last one, or a synchronous loop); never with its own step."""
    split, fused = pair
    runner = split.engine.runner
    queued = []  # (the step whose sampler is queued, the last step laid out then, whether a fetch queued it)
    original_flush, original_fetch = ModelRunner._flush, ModelRunner.fetch
    fetching = []

    def flush(self):
        if self._pending is not None:
            queued.append((self._pending[0].rows.step_id, self.input_batch._step_id, bool(fetching)))
        original_flush(self)

    def fetch(self, handle):
        fetching.append(1)
        try:
            return original_fetch(self, handle)
        finally:
            fetching.pop()

    monkeypatch.setattr(ModelRunner, "_flush", flush)
    monkeypatch.setattr(ModelRunner, "fetch", fetch)
    assert split.engine.async_scheduling
    got = outputs(split, CASES["seeded"])
    assert got == outputs(fused, CASES["seeded"])
    assert len(queued) > 5 and runner._pending is None
    by_dispatch = [(step, laid_out) for step, laid_out, at_fetch in queued if not at_fetch]
    assert by_dispatch and all(laid_out == step + 1 for step, laid_out in by_dispatch), queued
    assert sum(at_fetch for *_, at_fetch in queued) <= 2, queued  # the last steps: nothing comes after them


def test_a_sampler_that_fails_fails_its_own_steps_requests(monkeypatch):
    """A split step's sampler is queued by the next step's dispatch; if it raises, the requests of its own step fail
    (when that step is read), not those of the step that queued it, and the engine goes on. Here request a's last
    step samples (its sampler fails), and the next step holds only request b's prompt: a fails, b gets the fused
    engine's tokens."""
    llm = make(True)
    engine = llm.engine
    sampled = SamplingParams(temperature=0.8, seed=3, max_tokens=2, ignore_eos=True)
    greedy = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    real = ModelRunner._sampler
    calls = []

    def failing(self, num_seqs, unsampled):
        calls.append(num_seqs)
        if len(calls) == 2:  # a's second (last) token
            raise RuntimeError("sampler fell over")
        return real(self, num_seqs, unsampled)

    monkeypatch.setattr(ModelRunner, "_sampler", failing)
    finals, tokens = {}, {"a": [], "b": []}

    def step():
        for out in engine.step():
            tokens[out.request_id] += out.deltas[0].token_ids
            if out.finished:
                finals[out.request_id] = out

    engine.add_request("a", {"prompt_token_ids": [5, 6, 7]}, sampled)
    step()
    step()
    engine.add_request("b", {"prompt_token_ids": [8, 9, 10]}, greedy)
    while engine.has_unfinished_requests():
        step()
    assert len(calls) == 2, calls
    assert finals["a"].error == "RuntimeError: sampler fell over"
    assert finals["b"].error is None
    want = make(False).generate([{"prompt_token_ids": [8, 9, 10]}], greedy, use_tqdm=False)[0].outputs[0].token_ids
    assert tokens["b"] == want
    assert not engine.dead and engine.runner._pending is None
    engine.block_manager.check_invariants()
    assert llm.stats()["num_used"] == 0
