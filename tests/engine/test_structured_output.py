"""Structured output (llguidance grammars applied as a device bitmask), penalties, logit_bias and bad_words, through
the Python API on a tiny random-weight HF model: a random model still produces valid output because of the mask."""

from __future__ import annotations

import json
import re

import jsonschema
import numpy as np
import pytest

from jaxpaged import LLM, SamplingParams
from jaxpaged.entrypoints.llm import RequestFailedError
from jaxpaged.sampling_params import StructuredOutputsParams
from tests.tiny_hf import make_tiny_hf_model

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 6},
        "kind": {"enum": ["ship", "lighthouse", "gull"]},
        "position": {
            "type": "object",
            "properties": {"x": {"type": "integer", "minimum": -50, "maximum": 50},
                           "y": {"type": "integer", "minimum": 0, "maximum": 99}},
            "required": ["x", "y"], "additionalProperties": False,
        },
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 4}, "maxItems": 3},
        "ok": {"type": "boolean"},
    },
    "required": ["name", "kind", "position", "tags"],
    "additionalProperties": False,
}
PROMPT = "The lighthouse keeper kept a ledger of every ship"


@pytest.fixture(scope="module")
def llm(tmp_path_factory):
    path = make_tiny_hf_model(tmp_path_factory.mktemp("tiny"), "llama")
    return LLM(path, dtype="float32", max_num_seqs=16, max_num_batched_tokens=256, max_model_len=256, block_size=16,
               num_blocks=400, precompile=False, show_progress=False)


def texts(outs):
    return [c.text for o in outs for c in o.outputs]


def test_sampled_json_always_validates_against_a_nested_schema(llm):
    params = SamplingParams(n=10, temperature=1.0, max_tokens=200, seed=0,
                            structured_outputs=StructuredOutputsParams(json=SCHEMA))
    outs = llm.generate([PROMPT, "hello", "What is the capital of France?", "{", "0123"], params, use_tqdm=False)
    got = texts(outs)
    assert len(got) == 50
    for o in outs:
        assert all(c.finish_reason == "stop" for c in o.outputs)
    for text in got:
        jsonschema.validate(json.loads(text), SCHEMA)
    assert len(set(got)) > 10  # sampled, not one forced string


def test_regex_and_choice_hold(llm):
    regex = r"[A-Z][a-z]{2,5}-[0-9]{3}"
    outs = llm.generate([PROMPT] * 4, SamplingParams(temperature=1.0, max_tokens=40, seed=1,
                                                      structured_outputs=StructuredOutputsParams(regex=regex)),
                        use_tqdm=False)
    for t in texts(outs):
        assert re.fullmatch(regex, t), t
    choices = ["port", "starboard", "aft deck"]
    outs = llm.generate([PROMPT], SamplingParams(n=8, temperature=1.0, max_tokens=20, seed=2,
                                                 structured_outputs=StructuredOutputsParams(choice=choices)),
                        use_tqdm=False)
    assert all(t in choices for t in texts(outs))


def test_json_object_and_grammar(llm):
    outs = llm.generate([PROMPT] * 3, SamplingParams(
        temperature=1.0, max_tokens=120, seed=3,
        structured_outputs=StructuredOutputsParams(json_object=True)), use_tqdm=False)
    for o in outs:
        if o.outputs[0].finish_reason == "stop":
            assert isinstance(json.loads(o.outputs[0].text), dict)
        else:
            assert o.outputs[0].text.startswith("{")
    lark = 'start: "yes" | "no" | "maybe " NUM\nNUM: /[0-9]{2}/'
    outs = llm.generate([PROMPT] * 3, SamplingParams(temperature=1.0, max_tokens=20, seed=4,
                                                     structured_outputs=StructuredOutputsParams(grammar=lark)),
                        use_tqdm=False)
    for t in texts(outs):
        assert re.fullmatch(r"yes|no|maybe [0-9]{2}", t), t


def test_a_constrained_request_leaves_free_ones_in_its_batch_unchanged(llm):
    prompts = [PROMPT, "hello world", "What is the capital of France?"]
    free = [SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True),
            SamplingParams(temperature=1.0, max_tokens=24, seed=9, ignore_eos=True)]
    alone = llm.generate(prompts[:2], free, use_tqdm=False)
    constrained = SamplingParams(temperature=1.0, max_tokens=200, seed=5,
                                 structured_outputs=StructuredOutputsParams(json=SCHEMA))
    mixed = llm.generate(prompts, free + [constrained], use_tqdm=False)
    assert [o.outputs[0].token_ids for o in mixed[:2]] == [o.outputs[0].token_ids for o in alone]
    jsonschema.validate(json.loads(mixed[2].outputs[0].text), SCHEMA)


def test_grammars_are_compiled_once_per_spec(llm):
    cache = llm.engine.grammars
    before = cache.compiles
    for seed in range(3):
        llm.generate([PROMPT], SamplingParams(seed=seed, max_tokens=8, structured_outputs=StructuredOutputsParams(
            regex="[a-z]{1,6}")), use_tqdm=False)
    assert cache.compiles == before + 1


@pytest.mark.parametrize("spec, field", [
    ({"json": {"type": "nope"}}, "structured_outputs.json"),
    ({"json": {"$ref": "#/nowhere"}}, "structured_outputs.json"),
    ({"regex": "[a-"}, "structured_outputs.regex"),
    ({"grammar": "start: ???"}, "structured_outputs.grammar"),
    ({"choice": []}, "structured_outputs.choice"),
    ({"regex": "a", "choice": ["a"]}, "structured_outputs"),
])
def test_invalid_specs_are_value_errors_naming_the_field(spec, field):
    with pytest.raises((ValueError, TypeError)) as e:
        SamplingParams(structured_outputs=StructuredOutputsParams(**spec))
    assert str(e.value).startswith(field)


@pytest.mark.parametrize("spec, reason", [
    ({"regex": "(ab"}, "unclosed group"),
    ({"regex": "a{5,2}"}, "the start must be <= the end"),
    ({"json": {"type": "string", "pattern": "(("}}, "unclosed group"),
])
def test_a_bad_regex_error_says_why_on_one_line(spec, reason):
    """The regex library's reason follows the pattern and a caret line; it is kept, the caret lines are not."""
    with pytest.raises(ValueError) as e:
        SamplingParams(structured_outputs=StructuredOutputsParams(**spec))
    assert reason in str(e.value) and "\n" not in str(e.value)


# ---- penalties, logit_bias, bad_words ----------------------------------------------------------------------------

def _native_penalties() -> bool:
    from pallas_kernels import cpu_native

    return cpu_native.available("penalties")


# XLA's penalties, and the native CPU kernel's (the engine's in steps whose matmuls run natively)
PENALTY_PATHS = pytest.mark.parametrize("native", [False, pytest.param(True, marks=pytest.mark.skipif(
    "not _native_penalties()", reason="the native CPU kernels could not be built"))])


@PENALTY_PATHS
def test_repetition_penalty_matches_transformers(native):
    import jax.numpy as jnp
    import torch
    from transformers import RepetitionPenaltyLogitsProcessor

    from jaxpaged.worker import sampler

    rng = np.random.default_rng(0)
    rows, vocab, max_len = 3, 50, 16
    logits = rng.normal(size=(rows, vocab)).astype(np.float32) * 3
    seqs = [[1, 5, 5, 7], [0, 49, 3, 3, 3, 12, 40], [8]]
    penalties = [1.3, 0.7, 2.0]
    sm = sampler.SamplingMetadata.padding(rows, vocab, max_len)
    for i, (ids, p) in enumerate(zip(seqs, penalties, strict=True)):
        sm.seen_tokens[i, :len(ids)] = ids
        sm.output_start[i] = 2
        sm.repetition_penalty[i] = p
    sm.penalized = np.array(True)
    got = np.asarray(sampler.process_logits(jnp.asarray(logits), sm, native))
    for i, (ids, p) in enumerate(zip(seqs, penalties, strict=True)):
        want = RepetitionPenaltyLogitsProcessor(p)(torch.tensor([ids]), torch.tensor(logits[i:i + 1]))
        np.testing.assert_allclose(got[i], want.numpy()[0], rtol=1e-6)


@PENALTY_PATHS
def test_presence_and_frequency_penalties_count_generated_tokens_only(native):
    import jax.numpy as jnp

    from jaxpaged.worker import sampler

    vocab = 10
    logits = np.zeros((1, vocab), np.float32)
    sm = sampler.SamplingMetadata.padding(1, vocab, 8)
    sm.seen_tokens[0, :6] = [4, 4, 1, 1, 1, 2]  # prompt [4, 4], output [1, 1, 1, 2]
    sm.output_start[0] = 2
    sm.presence_penalty[0], sm.frequency_penalty[0], sm.penalized = 0.5, 0.25, np.array(True)
    got = np.asarray(sampler.process_logits(jnp.asarray(logits), sm, native))[0]
    want = np.zeros(vocab)
    want[1] = -0.5 - 3 * 0.25
    want[2] = -0.5 - 0.25
    np.testing.assert_allclose(got, want)


@PENALTY_PATHS
def test_penalties_count_the_pending_token_as_the_host_would(native):
    """Under asynchronous scheduling a row's last token is still on its way to the host when the next step is laid
    out: the step passes it as pending_tokens, and the penalties are those of the history with it appended."""
    import jax.numpy as jnp

    from jaxpaged.worker import sampler

    rng = np.random.default_rng(1)
    rows, vocab, max_len = 3, 12, 8
    logits = jnp.asarray(rng.normal(size=(rows, vocab)).astype(np.float32) * 2)
    history = [[4, 4, 1, 2], [3, 5, 5], [7, 1, 1]]  # prompt: the first 2 tokens of each; the last is output

    def penalized(with_pending: bool):
        sm = sampler.SamplingMetadata.padding(rows, vocab, max_len)
        for i, ids in enumerate(history):
            known = ids[:-1] if with_pending else ids
            sm.seen_tokens[i, :len(known)] = known
            sm.output_start[i] = 2
            if with_pending:
                sm.pending_tokens[i] = ids[-1]
        sm.presence_penalty[:] = 0.5
        sm.frequency_penalty[:] = 0.25
        sm.repetition_penalty[:] = 1.5
        sm.penalized = np.array(True)
        return np.asarray(sampler.process_logits(logits, sm, native))

    np.testing.assert_allclose(penalized(True), penalized(False))
    assert not np.allclose(penalized(False), np.asarray(logits))


def test_greedy_with_penalties_is_deterministic_and_batch_invariant(llm):
    penalized = SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True, presence_penalty=0.8,
                               frequency_penalty=0.6, repetition_penalty=1.4)
    plain = SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True)
    alone = llm.generate([PROMPT], penalized, use_tqdm=False)[0].outputs[0].token_ids
    again = llm.generate([PROMPT], penalized, use_tqdm=False)[0].outputs[0].token_ids
    batched = llm.generate(["hello", PROMPT, "What is"], [plain, penalized, plain], use_tqdm=False)
    assert alone == again == batched[1].outputs[0].token_ids
    free = llm.generate([PROMPT], plain, use_tqdm=False)[0].outputs[0].token_ids
    assert free != alone  # the penalties did something
    # a strong frequency penalty makes repeats rarer than without it
    assert len(set(alone)) >= len(set(free))


def test_logit_bias_forces_and_forbids_tokens(llm):
    plain = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    free = llm.generate([PROMPT], plain, use_tqdm=False)[0].outputs[0].token_ids
    forced = llm.generate([PROMPT], SamplingParams(temperature=1.0, seed=0, max_tokens=12, ignore_eos=True,
                                                   logit_bias={77: 100}), use_tqdm=False)[0].outputs[0].token_ids
    assert forced == [77] * 12
    banned = {t: -100 for t in set(free)}
    out = llm.generate([PROMPT], SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, logit_bias=banned),
                       use_tqdm=False)[0].outputs[0].token_ids
    assert not set(out) & set(free)


def test_bad_words_are_never_generated(llm):
    plain = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    free = llm.generate([PROMPT], plain, use_tqdm=False)[0].outputs[0].token_ids
    tok = llm.engine.tokenizer

    def round_trips(ids):
        text = tok.decode(ids)
        return text.strip() == text and tok.encode(text, add_special_tokens=False) == ids

    # two tokens of the free output that form a word (banned once its first token was generated), and a later
    # single token (banned everywhere)
    start = next(i for i in range(2, 30) if round_trips(free[i:i + 2]))
    single = next(i for i in range(start + 2, 40) if round_trips(free[i:i + 1]) and free[i] not in free[:start + 2])
    word_ids = free[start:start + 2]
    out = llm.generate([PROMPT], SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True,
                                                bad_words=[tok.decode(word_ids), tok.decode(free[single:single + 1])]),
                       use_tqdm=False)[0].outputs[0].token_ids
    assert not any(out[i:i + 2] == word_ids for i in range(len(out)))
    assert free[single] not in out
    assert out[:start + 1] == free[:start + 1]  # the word's first token is fine; its second is not


def test_allowed_token_ids_limit_what_is_generated(llm):
    """vLLM's allowed_token_ids: a greedy request takes the best allowed token (the one a +100 bias on each allowed
    token picks); sampled ones never leave the set, with a grammar too; a set that leaves nothing to generate fails
    that request alone, and its batch goes on."""
    free = llm.generate([PROMPT], SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True),
                        use_tqdm=False)[0].outputs[0].token_ids
    allowed = sorted({t for t in range(40, 90)} - set(free[:1]))
    greedy = llm.generate([PROMPT], SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True,
                                                   allowed_token_ids=allowed), use_tqdm=False)[0].outputs[0]
    biased = llm.generate([PROMPT], SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True,
                                                   logit_bias={t: 100 for t in allowed[:300]}), use_tqdm=False)
    assert greedy.token_ids == biased[0].outputs[0].token_ids and greedy.token_ids[0] != free[0]
    sampled = llm.generate([PROMPT] * 3, [SamplingParams(temperature=1.5, seed=s, max_tokens=16, ignore_eos=True,
                                                         allowed_token_ids=allowed) for s in range(3)], use_tqdm=False)
    assert all(set(c.token_ids) <= set(allowed) for o in sampled for c in o.outputs)
    tok = llm.engine.tokenizer
    digits = [tok.convert_tokens_to_ids(d) for d in "0123456789"]
    grammar = StructuredOutputsParams(regex="[0-9]{1,5}")
    out = llm.generate([PROMPT], SamplingParams(temperature=1.0, seed=0, max_tokens=8, structured_outputs=grammar,
                                                allowed_token_ids=digits[:3] + [tok.eos_token_id]),
                       use_tqdm=False)[0].outputs[0]
    assert re.fullmatch("[0-2]{1,5}", out.text), out.text
    # a grammar of letters, only digits allowed: no token can follow; that request fails, naming why
    bad = SamplingParams(max_tokens=4, structured_outputs=StructuredOutputsParams(regex="[a-z]+"),
                         allowed_token_ids=digits)
    with pytest.raises(RequestFailedError, match="no token may follow"):
        llm.generate([PROMPT], bad, use_tqdm=False)
    # beside another request in the same steps: that one fails alone, the other finishes
    engine = llm.engine
    engine.add_request("conflict", PROMPT, bad)
    engine.add_request("bystander", PROMPT, SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True))
    done = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            done.setdefault(out.request_id, []).append(out)
    assert done["conflict"][-1].error and "no token may follow" in done["conflict"][-1].error
    assert sum(len(d.token_ids) for o in done["bystander"] for d in o.deltas) == 4
    with pytest.raises(ValueError, match="^allowed_token_ids must be in"):
        llm.generate([PROMPT], SamplingParams(allowed_token_ids=[10**6]), use_tqdm=False)
    with pytest.raises(ValueError, match="min_tokens bans"):
        llm.generate([PROMPT], SamplingParams(allowed_token_ids=[tok.eos_token_id], min_tokens=1), use_tqdm=False)
    assert llm.stats()["num_used"] == 0


def test_stop_strings_with_regex_characters_work_literally(llm):
    tok = llm.engine.tokenizer
    for special in ("*", "(", "[", "\\", "?", "+", "|", "$", "^", "{"):
        (token,) = tok.encode(special, add_special_tokens=False)
        forced = dict(temperature=0.0, max_tokens=12, ignore_eos=True, logit_bias={token: 100})
        out = llm.generate([PROMPT], SamplingParams(**forced), use_tqdm=False)[0].outputs[0]
        assert out.text == special * 12
        # as a regex ".*" / "(.)+" would match at once; literally they never appear
        for stop in (".*", "(.)+", special + "."):
            out = llm.generate([PROMPT], SamplingParams(**forced, stop=[stop]), use_tqdm=False)[0].outputs[0]
            assert out.finish_reason == "length" and out.text == special * 12
        out = llm.generate([PROMPT], SamplingParams(**forced, stop=[special * 3]), use_tqdm=False)[0].outputs[0]
        assert out.finish_reason == "stop" and out.stop_reason == special * 3 and out.text == ""


@pytest.mark.parametrize("kwargs, field", [
    ({"presence_penalty": 2.5}, "presence_penalty"),
    ({"frequency_penalty": float("nan")}, "frequency_penalty"),
    ({"repetition_penalty": 0.0}, "repetition_penalty"),
    ({"repetition_penalty": 1e300}, "repetition_penalty"),  # float32 inf in the sampler
    ({"repetition_penalty": 5e-324}, "repetition_penalty"),  # float32 0
    ({"temperature": 1e39}, "temperature"),  # float32 inf: a banned token's -inf / inf is NaN, which can win
    ({"temperature": -0.5}, "temperature"),
    ({"repetition_penalty": "1"}, "repetition_penalty"),
    ({"logit_bias": {5: 101}}, "logit_bias"),
    ({"logit_bias": {-1: 1}}, "logit_bias"),
    ({"logit_bias": {i: 1 for i in range(301)}}, "logit_bias"),
    ({"logit_bias": [1]}, "logit_bias"),
    ({"bad_words": "x"}, "bad_words"),
    ({"bad_words": [""]}, "bad_words"),
    ({"structured_outputs": 5}, "structured_outputs"),
    ({"allowed_token_ids": []}, "allowed_token_ids"),
    ({"allowed_token_ids": [-1]}, "allowed_token_ids"),
    ({"allowed_token_ids": [1.0]}, "allowed_token_ids"),
    ({"allowed_token_ids": 5}, "allowed_token_ids"),
])
def test_bad_sampling_controls_name_the_field(kwargs, field):
    with pytest.raises((ValueError, TypeError)) as e:
        SamplingParams(**kwargs)
    assert str(e.value).startswith(field)


def test_logit_bias_ids_are_checked_against_the_vocabulary(llm):
    with pytest.raises(ValueError, match="^logit_bias"):
        llm.generate([PROMPT], SamplingParams(logit_bias={10**6: 1}), use_tqdm=False)


def test_masks_and_penalties_add_no_compile_after_start_up(tmp_path):
    path = make_tiny_hf_model(tmp_path, "llama")
    llm = LLM(path, max_num_seqs=4, max_num_batched_tokens=64, max_model_len=64, block_size=16, num_blocks=64,
              show_progress=False)
    runner = llm.engine.runner
    shapes = runner.compiled_shapes
    assert runner.warmed_up and shapes
    params = [SamplingParams(max_tokens=30, seed=0, structured_outputs=StructuredOutputsParams(regex="[a-z]{3,9}")),
              SamplingParams(max_tokens=20, temperature=0.0, repetition_penalty=1.2, frequency_penalty=0.5,
                             logit_bias={5: 3.0}, bad_words=["the"]),
              SamplingParams(n=2, max_tokens=20, seed=1)]
    llm.generate([PROMPT, "hello", "What is"], params, use_tqdm=False)
    assert runner.compiled_shapes == shapes


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_preempted_constrained_requests_stay_valid_and_unchanged(tmp_path, mode):
    """A tight pool preempts: a seeded constrained request's tokens equal those it gets alone, so its matcher was
    advanced once per token (a replayed token would make the grammar reject or change the mask)."""
    path = make_tiny_hf_model(tmp_path, "llama")
    llm = LLM(path, max_num_seqs=8, max_num_batched_tokens=128, max_model_len=256, block_size=16, num_blocks=24,
              preemption_mode=mode, swap_space=0.01 if mode == "swap" else 0.0, precompile=False,
              show_progress=False)
    params = [SamplingParams(temperature=1.0, seed=s, max_tokens=200, structured_outputs=StructuredOutputsParams(
        json=SCHEMA), presence_penalty=0.5) for s in range(8)]
    prompts = [f"{PROMPT} {i}" for i in range(8)]
    alone = [llm.generate([p], sp, use_tqdm=False)[0].outputs[0].token_ids for p, sp in zip(prompts, params,
                                                                                             strict=True)]
    together = llm.generate(prompts, params, use_tqdm=False)
    assert llm.engine.stats()["preemptions"] > 0
    assert [o.outputs[0].token_ids for o in together] == alone
    for o in together:
        jsonschema.validate(json.loads(o.outputs[0].text), SCHEMA)
