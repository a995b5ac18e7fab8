"""Speculative decoding through the engine: every configuration gives exactly the tokens of plain decoding (greedy,
and seeded sampling too: proposals are verified against the token the plain sampler would draw), on tiny random
models, with n > 1, logprobs, stop conditions, prefix caching and preemption; a draft equal to the target accepts
everything; a weak draft accepts little and changes nothing; rollback leaves no block behind; the metrics count it."""

from __future__ import annotations

import dataclasses

import jax
import pytest

from jaxpaged import SamplingParams
from jaxpaged.models import families, gemma3
from pallas_kernels.cpu_native import native
from tests.default_model import default_model
from tests.tiny import CharTokenizer, checked, random_params, random_prompts, tiny_config, tiny_llm

CONFIG = tiny_config(vocab_size=96, layers=4)
PARAMS = random_params(CONFIG)
# prompts that repeat themselves, so prompt lookup finds something to propose
PROMPTS = [{"prompt_token_ids": p * 4} for p in random_prompts(3, 5, 7, seed=1)]
NGRAM = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "prompt_lookup_max": 3}
WEAK_DRAFT = {"draft_num_layers": 1, "num_speculative_tokens": 3}
FULL_DRAFT = {"draft_num_layers": 4, "num_speculative_tokens": 4}  # the target itself: accepts everything
SPECS = {"ngram": NGRAM, "weak_draft": WEAK_DRAFT, "full_draft": FULL_DRAFT}


def generate(params: SamplingParams, spec=None, prompts=PROMPTS, **options):
    llm = tiny_llm(CONFIG, PARAMS, speculative_config=spec, max_num_seqs=8, num_blocks=80, **options)
    outs = llm.generate(prompts, params, use_tqdm=False)
    llm.engine.block_manager.check_invariants()
    assert llm.stats()["num_used"] == 0, "a block outlived its request"
    return [[(c.token_ids, c.finish_reason, c.stop_reason) for c in o.outputs] for o in outs], llm.stats(), outs


@pytest.fixture(scope="module")
def plain():
    """Non-speculative outputs of the cases the tests below compare with."""
    return {}


def reference(plain, key, params, **options):
    if key not in plain:
        plain[key] = generate(params, None, **options)
    return plain[key]


GREEDY = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
SEEDED = SamplingParams(temperature=0.9, top_p=0.9, top_k=40, seed=5, max_tokens=20, ignore_eos=True, n=2,
                        logprobs=2)


@pytest.mark.parametrize("spec", list(SPECS))
def test_greedy_tokens_are_those_of_plain_decoding(plain, spec):
    want, _, _ = reference(plain, "greedy", GREEDY)
    got, stats, _ = generate(GREEDY, SPECS[spec])
    assert got == want
    assert stats["spec_proposed_tokens"] > 0
    if spec == "full_draft":  # the draft is the model: every proposal is accepted, k + 1 tokens a step
        assert stats["spec_accepted_tokens"] == stats["spec_proposed_tokens"]
        assert stats["spec_mean_accepted_length"] > 2.5
    if spec == "weak_draft":  # a 1-layer draft of a random 4-layer model guesses badly, and changes nothing
        assert stats["spec_accepted_tokens"] < stats["spec_proposed_tokens"]


@pytest.mark.parametrize("spec", list(SPECS))
def test_seeded_sampling_with_n2_and_logprobs_is_that_of_plain_decoding(plain, spec):
    """Proposals are accepted when they equal the token plain sampling draws at that position (a deterministic
    proposer's exact rejection sampling), so a seeded request gives the same tokens, and log-probs, with and
    without speculation."""
    want, _, want_outs = reference(plain, "seeded", SEEDED)
    # 6 samples: where steps keep prompts and decodes apart (no native CPU kernel, or a GPU/TPU) a verifying step
    # pads each of them to a 16-token query tile, which the default 64-token budget does not hold
    got, stats, outs = generate(SEEDED, SPECS[spec], max_num_batched_tokens=128)
    assert got == want and stats["spec_proposed_tokens"] > 0
    for o, w in zip(outs, want_outs, strict=True):
        for c, d in zip(o.outputs, w.outputs, strict=True):
            assert [sorted(x) for x in c.logprobs] == [sorted(x) for x in d.logprobs]
            assert c.cumulative_logprob == pytest.approx(d.cumulative_logprob, abs=1e-4)


@pytest.mark.parametrize("spec", ["weak_draft", "full_draft"])
def test_a_self_draft_that_runs_up_to_max_model_len_leaves_the_targets_kv_alone(plain, spec):
    """Near max_model_len (64 here) the draft loop proposes past the block table; those positions write nothing. They
    were written into the table's last block, which a self-draft shares with the target: the target's K/V a block
    earlier was overwritten, and the next verification read it (other tokens, other log-probs)."""
    prompts = [{"prompt_token_ids": p} for p in random_prompts(4, 50, 58, seed=20)]
    params = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True, logprobs=2)
    got, _, outs = generate(params, SPECS[spec], prompts=prompts)
    want, _, plain_outs = reference(plain, "to_max_model_len", params, prompts=prompts)
    assert got == want and all(c[1] == "length" for o in got for c in o)
    for o, w in zip(outs, plain_outs, strict=True):  # float32: a verified token's sums are ordered differently
        for step, want_step in zip(o.outputs[0].logprobs, w.outputs[0].logprobs, strict=True):
            assert step.keys() == want_step.keys()
            assert all(abs(step[t].logprob - want_step[t].logprob) < 1e-4 for t in step), (step, want_step)


def test_stop_ids_and_max_tokens_cut_a_verified_run(plain):
    """A stop id or max_tokens inside a run of accepted tokens ends the sequence there; the rest is dropped."""
    sp = SamplingParams(temperature=1.0, seed=3, max_tokens=13, stop_token_ids=[10, 11, 12, 13], n=3)
    want, _, _ = reference(plain, "stops", sp)
    assert any(r == "stop" for o in want for _, r, _ in o) and any(r == "length" for o in want for _, r, _ in o)
    for spec in SPECS.values():
        got, _, _ = generate(sp, spec)
        assert got == want


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_preemption_and_rollback_leave_the_pool_whole(plain, mode):
    """A pool too small for every sequence: preempted sequences come back with the same tokens, the pool's
    invariants hold after every step (rolled-back slots included), and every block returns at the end."""
    options = dict(num_blocks=11, preemption_mode=mode, swap_space=0.01 if mode == "swap" else 0.0)
    want, _, _ = reference(plain, "greedy", GREEDY)
    for spec in (NGRAM, FULL_DRAFT):
        llm = tiny_llm(CONFIG, PARAMS, speculative_config=spec, max_num_seqs=8, **options)
        llm.engine.step = checked(llm.engine)
        outs = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
        assert [[(c.token_ids, c.finish_reason, c.stop_reason) for c in o.outputs] for o in outs] == want
        assert llm.stats()["preemptions"] > 0 and llm.stats()["num_used"] == 0


def test_prefix_caching_with_speculation(plain):
    shared = random_prompts(1, 32, 32, seed=8)[0]
    prompts = [{"prompt_token_ids": shared + [3 + i] + shared[:6]} for i in range(3)]
    want, _, _ = reference(plain, "prefix", GREEDY, prompts=prompts)
    llm = tiny_llm(CONFIG, PARAMS, speculative_config=NGRAM, max_num_seqs=8, num_blocks=80)
    llm.generate(prompts[:1], GREEDY, use_tqdm=False)
    outs = llm.generate(prompts, GREEDY, use_tqdm=False)
    assert [[(c.token_ids, c.finish_reason, c.stop_reason) for c in o.outputs] for o in outs] == want
    assert all(o.num_cached_tokens >= 24 for o in outs)


def test_rows_that_process_their_logits_do_not_speculate(plain):
    """Penalties and logit bias depend on each position's context (or were left out of verification): such
    requests decode one token per step, with the same tokens, beside requests that speculate."""
    penalized = SamplingParams(temperature=0.0, max_tokens=12, presence_penalty=1.5, ignore_eos=True)
    want, _, _ = reference(plain, "penalized", penalized)
    got, stats, _ = generate(penalized, NGRAM)
    assert got == want and stats["spec_proposed_tokens"] == 0


class OneTokenWords(CharTokenizer):
    """A word is one token with or without its leading space (as in real vocabularies): a one-token ban."""

    def encode(self, text, add_special_tokens=False):
        return super().encode(text.strip())


def test_bad_words_do_not_speculate(plain):
    """A banned word is masked in decoding, not in verification: such a request decodes one token per step and
    never emits the word, which greedy decoding would."""
    free = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    banned_id = OneTokenWords().encode("t")[0]
    assert any(banned_id in ids for ((ids, _, _),) in reference(plain, "free", free)[0])
    runs = []
    for spec in (None, FULL_DRAFT):
        llm = tiny_llm(CONFIG, PARAMS, speculative_config=spec, max_num_seqs=8, num_blocks=80)
        llm.engine.tokenizer = OneTokenWords()
        outs = llm.generate(PROMPTS, dataclasses.replace(free, bad_words=["t"]), use_tqdm=False)
        runs.append(([o.outputs[0].token_ids for o in outs], llm.stats()["spec_proposed_tokens"]))
    assert runs[1] == (runs[0][0], 0)
    assert all(banned_id not in ids for ids in runs[0][0])


def test_disable_by_batch_size_turns_it_off_for_large_batches():
    got, stats, _ = generate(GREEDY, dict(NGRAM, disable_by_batch_size=2))  # 3 requests run at once
    assert stats["spec_proposed_tokens"] == 0
    assert got == generate(GREEDY, None)[0]


def test_low_acceptance_switches_a_request_off():
    """A weak draft whose acceptance stays below min_acceptance_rate stops proposing after its window."""
    spec = dict(WEAK_DRAFT, min_acceptance_rate=0.99, acceptance_window=2, acceptance_cooldown=0)
    _, stats, _ = generate(GREEDY, spec)
    _, free, _ = generate(GREEDY, WEAK_DRAFT)
    assert 0 < stats["spec_proposed_tokens"] < free["spec_proposed_tokens"] / 2


def test_a_gemma3_self_draft_gives_its_greedy_tokens():
    """Gemma 3 (sliding and full layers, a draft cutting inside the layer pattern): same greedy tokens."""
    from tests.models.gemma3_cases import hf_model, ours

    config, params = ours(hf_model("base"))  # 5 layers: sliding, sliding, full, sliding, full
    prompts = [{"prompt_token_ids": p * 3} for p in random_prompts(2, 5, 7, vocab=config.vocab_size, seed=2)]
    runs = []
    for spec in (None, {"draft_num_layers": 3, "num_speculative_tokens": 3}, NGRAM):
        llm = tiny_llm(config, params, speculative_config=spec, max_num_seqs=4, num_blocks=60)
        runs.append([o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY, use_tqdm=False)])
        assert llm.stats()["num_used"] == 0
    assert runs[0] == runs[1] == runs[2]
    assert isinstance(families.from_params(config, params), gemma3.Gemma3ForCausalLM)


@pytest.mark.parametrize("spec, match", [
    ({"method": "ngrams", "num_speculative_tokens": 3}, "method"),
    ({"method": "ngram", "num_speculative_tokens": 0}, "num_speculative_tokens"),
    ({"method": "ngram", "num_speculative_tokens": 99}, "num_speculative_tokens"),
    ({"draft_num_layers": 9, "num_speculative_tokens": 2}, "draft_num_layers=9 exceeds"),
    ({"method": "ngram", "num_speculative_tokenz": 2}, "unknown key"),
])
def test_bad_speculative_configs_are_refused_before_anything_runs(spec, match):
    with pytest.raises((ValueError, TypeError), match=match):
        tiny_llm(CONFIG, PARAMS, speculative_config=spec)


def test_bfloat16_native_steps_verify_exactly_what_they_would_decode():
    """In bfloat16 on CPU the layer matmuls and the LM head run natively and only on live rows: a verifying step's
    K + 1 logits rows per sequence must all be computed, and a short run of query tokens attends as decode items, so
    each verified position's logits are bit for bit the decode step's: the same greedy tokens and log-probs."""
    sp = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True, logprobs=2)
    runs = []
    for spec in (None, NGRAM, FULL_DRAFT):
        llm = tiny_llm(CONFIG, PARAMS, speculative_config=spec, max_num_seqs=8, num_blocks=80, dtype="bfloat16")
        outs = llm.generate(PROMPTS, sp, use_tqdm=False)
        runs.append([(o.outputs[0].token_ids, o.outputs[0].logprobs) for o in outs])
    assert runs[0] == runs[1] == runs[2]


@pytest.mark.slow
def test_the_default_model_speculates_with_its_greedy_tokens():
    """SmolLM2-135M-Instruct in bfloat16, asked to repeat a passage: n-gram proposals are accepted, and the answer
    is token for token the plain one's (also with a self-draft of its first 10 layers)."""
    from jaxpaged import LLM

    default_model()
    passage = ("The block manager keeps a free list of physical blocks and a reference count for each block. When a "
               "sequence finishes, its blocks go back to the free list.")
    results = []
    for spec in (None, {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 2,
                        "prompt_lookup_max": 4}, {"draft_num_layers": 10, "num_speculative_tokens": 3}):
        llm = LLM(max_num_seqs=2, max_model_len=512, speculative_config=spec, kv_cache_memory="64MiB", precompile=False,
                  show_progress=False)
        prompt = llm.apply_chat_template([{"role": "user", "content": f"Repeat word for word:\n\n{passage}"}])
        out = llm.generate([{"prompt_token_ids": prompt}], SamplingParams(temperature=0.0, max_tokens=32),
                           use_tqdm=False)[0].outputs[0]
        results.append((out.token_ids, llm.stats()))
    assert results[0][0] == results[1][0] == results[2][0]
    assert results[1][1]["spec_accepted_tokens"] > 8  # it copies: prompt lookup guesses most of it


def test_steps_above_the_batch_threshold_run_asynchronously():
    """With more than disable_by_batch_size requests running no row proposes, and the decode steps run
    asynchronously (a step is dispatched while the one before is still unread); once the batch shrinks, the loop is
    synchronous again and the rows speculate. Every row gets its plain tokens, every block comes back."""
    prompts = [{"prompt_token_ids": p * 4} for p in random_prompts(4, 5, 7, seed=4)]
    params = [SamplingParams(temperature=0.0, max_tokens=m, ignore_eos=True) for m in (6, 6, 30, 30)]
    runs = []
    for config in (None, {**NGRAM, "disable_by_batch_size": 2}):
        llm = tiny_llm(CONFIG, PARAMS, speculative_config=config, max_num_seqs=4, num_blocks=80)
        llm.engine.step = checked(llm.engine)
        runner = llm.engine.runner
        dispatch, fetch, unread, overlapped = runner.dispatch, runner.fetch, [0], []

        def recorded(inputs, rows, dispatch=dispatch, unread=unread, overlapped=overlapped):
            overlapped.append(unread[0] > 0)
            unread[0] += 1
            return dispatch(inputs, rows)

        def fetched(handle, fetch=fetch, unread=unread):
            unread[0] -= 1
            return fetch(handle)

        runner.dispatch, runner.fetch = recorded, fetched
        outs = llm.generate(prompts, params, use_tqdm=False)
        assert llm.stats()["num_used"] == 0
        runs.append(([o.outputs[0].token_ids for o in outs], llm.stats(), overlapped))
    (plain_tokens, _, _), (got, stats, overlapped) = runs
    assert got == plain_tokens
    assert any(overlapped)
    assert stats["spec_proposed_tokens"] > 0


def test_only_steps_that_verify_take_the_verifying_layout():
    """A prefill-shaped step takes the verifying layout (K + 1 logits rows per sequence, read before the next step is
    scheduled) only when some row verifies proposals or runs the draft loop: the prompts' prefill, where nothing is
    proposed yet (as above disable_by_batch_size), runs in the plain layout. The tokens are plain decoding's."""
    llm = tiny_llm(CONFIG, PARAMS, speculative_config=NGRAM, max_num_seqs=8, num_blocks=80)
    runner = llm.engine.runner
    layout, steps = runner.layout, []

    def recorded(out, layout=layout):
        chosen = layout(out)
        steps.append((out.is_prefill, any(out.num_spec), chosen.spec_width))
        return chosen

    runner.layout = recorded
    outs = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    assert [[(c.token_ids, c.finish_reason, c.stop_reason) for c in o.outputs] for o in outs] == \
        reference({}, "greedy", GREEDY)[0]
    assert steps[0] == (True, False, 0)  # the prompts' prefill: nothing to verify, the plain layout
    verifying = [s for s in steps if s[2]]
    assert verifying and all(s == (True, True, NGRAM["num_speculative_tokens"]) for s in verifying)
    assert llm.stats()["spec_accepted_tokens"] > 0


@pytest.mark.skipif(jax.default_backend() != "cpu" or not native.available("attention"),
                    reason="tile-1 steps need the native CPU attention kernel")
def test_a_verifying_step_is_shaped_by_its_rows():
    """A verifying step takes K + 1 float32 logits rows over the vocabulary per sequence row, so its rows are
    T / (K + 1) (not a prompt chunk's T / 2), and with tile 1 its T goes below the smallest prefill bucket: one
    sequence verifying K proposals runs in T = K + 1 rounded up to a power of two with one row, not in the smallest
    prompt chunk's shape, whose padded logits the step would allocate and touch every call. Every shape taken is a
    precompiled one, and the tokens are plain decoding's, alone and three at a time."""
    k = NGRAM["num_speculative_tokens"]
    for prompts in (PROMPTS[:1], PROMPTS):
        llm = tiny_llm(CONFIG, PARAMS, speculative_config=NGRAM, max_num_seqs=8, num_blocks=80, dtype="bfloat16")
        runner = llm.engine.runner
        assert runner.prefill_tile == 1
        layout, used = runner.layout, []

        def recorded(out, layout=layout, used=used):
            chosen = layout(out)
            used.append((len(out.seqs), chosen))
            return chosen

        runner.layout = recorded
        outs = llm.generate(prompts, GREEDY, use_tqdm=False)
        plain = tiny_llm(CONFIG, PARAMS, max_num_seqs=8, num_blocks=80, dtype="bfloat16")
        assert [o.outputs[0].token_ids for o in outs] == \
            [o.outputs[0].token_ids for o in plain.generate(prompts, GREEDY, use_tqdm=False)]
        verifying = [(n, lay) for n, lay in used if lay.spec_width]
        assert verifying and llm.stats()["spec_accepted_tokens"] > 0
        for n, lay in verifying:
            assert n <= lay.num_seqs and lay.num_seqs * (k + 1) <= lay.num_tokens
            assert lay.num_tokens < runner.prefill_buckets[0]  # (few rows: below the smallest prompt chunk's T)
        if len(prompts) == 1:
            assert {(lay.num_tokens, lay.num_seqs) for _, lay in verifying} == {(4, 1)}
        assert {lay.key for _, lay in used} <= set(runner.all_shapes())


def test_allowed_token_ids_do_not_speculate():
    """allowed_token_ids mask decoding, not verification: such a request decodes one token per step, with the tokens
    it gets without speculation, all from the set (greedy decoding would leave it)."""
    free = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    allowed = list(range(CONFIG.vocab_size // 2))
    runs = []
    for spec in (None, FULL_DRAFT):
        llm = tiny_llm(CONFIG, PARAMS, speculative_config=spec, max_num_seqs=8, num_blocks=80)
        unmasked = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, free, use_tqdm=False)]
        before = llm.stats()["spec_proposed_tokens"]
        outs = llm.generate(PROMPTS, dataclasses.replace(free, allowed_token_ids=allowed), use_tqdm=False)
        runs.append(([o.outputs[0].token_ids for o in outs], before, llm.stats()["spec_proposed_tokens"] - before,
                     unmasked))
    assert runs[1][0] == runs[0][0] and runs[1][2] == 0
    assert runs[1][1] > 0  # the unmasked requests before them did speculate
    assert any(max(ids) >= len(allowed) for ids in runs[0][3])
    assert all(max(ids) < len(allowed) for ids in runs[0][0])
