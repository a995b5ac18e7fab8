"""Speculative decoding with a separate draft model (`speculative_config={"model": ...}`): a module or a path with the
target's vocabulary, its own KV pool beside the target's (the same block tables, the same copies and swaps). The
tokens are always the target's plain ones; a draft that is the target accepts everything; a different draft accepts
less; a draft of another vocabulary is refused before anything loads."""

from __future__ import annotations

import numpy as np
import pytest
from flax import nnx

from jaxpaged import LLM, SamplingParams
from jaxpaged.models import families
from tests.tiny import checked, random_params, random_prompts, tiny_config, tiny_llm

CONFIG = tiny_config(vocab_size=96, layers=4)
PARAMS = random_params(CONFIG)
PROMPTS = [{"prompt_token_ids": p * 3} for p in random_prompts(3, 5, 7, seed=3)]
GREEDY = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)
SEEDED = SamplingParams(temperature=0.8, seed=9, max_tokens=16, ignore_eos=True, n=2)


def same_model() -> nnx.Module:
    """The target's weights in a module of its own: a perfect draft."""
    return families.from_params(CONFIG, PARAMS)


def other_model() -> nnx.Module:
    """A smaller random model with the target's vocabulary: a poor draft."""
    config = tiny_config(vocab_size=96, hidden=16, layers=1, heads=2, kv_heads=1, head_dim=8)
    return families.from_params(config, random_params(config, seed=5))


def run(spec, params=GREEDY, **options):
    llm = tiny_llm(CONFIG, PARAMS, speculative_config=spec, max_num_seqs=8, **{"num_blocks": 80, **options})
    llm.engine.step = checked(llm.engine)
    outs = llm.generate(PROMPTS, params, use_tqdm=False)
    assert llm.stats()["num_used"] == 0
    return [[c.token_ids for c in o.outputs] for o in outs], llm.stats()


@pytest.fixture(scope="module")
def plain():
    return {"greedy": run(None)[0], "seeded": run(None, SEEDED)[0]}


def test_a_draft_model_equal_to_the_target_accepts_everything(plain):
    got, stats = run({"model": same_model(), "num_speculative_tokens": 4})
    assert got == plain["greedy"]
    assert stats["spec_accepted_tokens"] == stats["spec_proposed_tokens"] > 0


def test_a_poor_draft_model_changes_nothing_but_the_speed(plain):
    got, stats = run({"model": other_model(), "num_speculative_tokens": 3})
    assert got == plain["greedy"]
    assert 0 < stats["spec_proposed_tokens"] and stats["spec_accepted_tokens"] < stats["spec_proposed_tokens"]
    got, _ = run({"model": other_model(), "num_speculative_tokens": 3}, SEEDED)
    assert got == plain["seeded"]


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_preemption_moves_the_draft_pool_with_the_target_pool(plain, mode):
    """n = 2 samples share blocks (copy-on-write copies both pools); a pool too small for every sequence preempts
    (a swap carries the draft's blocks too): the same tokens, every block back at the end."""
    options = dict(num_blocks=12, preemption_mode=mode, swap_space=0.01 if mode == "swap" else 0.0)
    got, stats = run({"model": same_model(), "num_speculative_tokens": 3}, SEEDED, **options)
    assert got == plain["seeded"] and stats["preemptions"] > 0


def test_a_draft_model_from_a_path(tiny_hf_model):
    """A draft given as a model directory (here the target's own files): loaded, checked, used."""
    path = tiny_hf_model("llama")
    prompts = [{"prompt_token_ids": p * 3} for p in random_prompts(2, 4, 6, vocab=100, seed=1)]
    runs = []
    for spec in (None, {"model": path, "num_speculative_tokens": 3}):
        llm = LLM(path, dtype="float32", max_num_seqs=4, max_model_len=128, num_blocks=40, precompile=False,
                  show_progress=False, speculative_config=spec)
        runs.append(([o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY, use_tqdm=False)], llm.stats()))
    assert runs[0][0] == runs[1][0]
    assert runs[1][1]["spec_accepted_tokens"] == runs[1][1]["spec_proposed_tokens"] > 0


def test_a_quantized_draft_model_changes_nothing_but_the_speed(plain):
    """`quantization` quantizes the draft only (here the target's own weights to int8): the target's tokens,
    most drafts accepted."""
    got, stats = run({"model": same_model(), "quantization": "int8", "num_speculative_tokens": 3})
    assert got == plain["greedy"]
    assert stats["spec_accepted_tokens"] > stats["spec_proposed_tokens"] / 2


def test_a_draft_of_another_vocabulary_is_refused_before_it_loads():
    config = tiny_config(vocab_size=97, layers=1)
    with pytest.raises(ValueError, match="speculative_config.model has a vocabulary of 97"):
        tiny_llm(CONFIG, PARAMS, speculative_config={"model": families.from_params(config, random_params(config)),
                                                     "num_speculative_tokens": 2})


def test_the_draft_pool_shares_the_kv_budget():
    """With a draft model, the same kv_cache_memory holds fewer blocks: both pools are paid from it."""
    alone = tiny_llm(CONFIG, PARAMS, num_blocks=None, kv_cache_memory="1MiB")
    both = tiny_llm(CONFIG, PARAMS, num_blocks=None, kv_cache_memory="1MiB",
                    speculative_config={"model": same_model(), "num_speculative_tokens": 2})
    assert both.engine.runner.num_blocks == pytest.approx(alone.engine.runner.num_blocks / 2, abs=1)


def skipping_run(spec, prompts, params):
    """A run that records each step's layout: (token lists, stats, layouts)."""
    llm = tiny_llm(CONFIG, PARAMS, speculative_config=spec, max_num_seqs=3, num_blocks=80)
    llm.engine.step = checked(llm.engine)
    layouts = []
    dispatch = llm.engine.runner.dispatch

    def recorded(inputs, rows):
        layouts.append(inputs.layout)
        return dispatch(inputs, rows)

    llm.engine.runner.dispatch = recorded
    outs = llm.generate(prompts, params, use_tqdm=False)
    assert llm.stats()["num_used"] == 0
    return [o.outputs[0].token_ids for o in outs], llm.stats(), layouts


def test_a_draft_model_skips_the_steps_where_no_row_speculates():
    """Above disable_by_batch_size the steps run without the draft (their layouts say so, and no such step runs
    the draft model: the draft pool misses those positions). A sequence that lived through such steps does not
    speculate again (its draft K/V has holes: a perfect draft would then propose wrong tokens); one that arrives
    after the batch shrank speculates with a complete draft K/V, and every proposal of the perfect draft is
    accepted. Every sequence gets its plain tokens and every block comes back."""
    prompts = [{"prompt_token_ids": p} for p in random_prompts(4, 5, 9, seed=11)]
    params = [SamplingParams(temperature=0.0, max_tokens=m, ignore_eos=True) for m in (6, 6, 30, 30)]
    plain_tokens, _, _ = skipping_run(None, prompts, params)
    spec = {"model": same_model(), "num_speculative_tokens": 3, "disable_by_batch_size": 2}
    got, stats, layouts = skipping_run(spec, prompts, params)
    assert got == plain_tokens
    assert any(not lay.draft_kv for lay in layouts) and any(lay.draft_kv and lay.spec_width for lay in layouts)
    # the fourth request alone speculates: at most its 30 tokens' worth of verification steps, all accepted
    assert 0 < stats["spec_verify_steps"] < 30
    assert stats["spec_accepted_tokens"] == stats["spec_proposed_tokens"] > 0


def test_skipped_draft_steps_leave_holes_in_the_draft_pool():
    """The skip is real: three requests above the threshold of 2 from their first step (the prompts' prefill too):
    the target's pool holds K/V at every computed position of theirs, the draft's pool none."""
    prompts = [{"prompt_token_ids": p} for p in random_prompts(3, 8, 8, seed=12)]
    llm = tiny_llm(CONFIG, PARAMS, max_num_seqs=3, num_blocks=80, enable_prefix_caching=False,
                   speculative_config={"model": same_model(), "num_speculative_tokens": 3,
                                       "disable_by_batch_size": 2})
    tables = {}
    original = llm.engine.block_manager.free

    def remember(seq_id, *args, **kwargs):
        tables[seq_id] = list(llm.engine.block_manager.tables[seq_id])
        return original(seq_id, *args, **kwargs)

    llm.engine.block_manager.free = remember
    llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True), use_tqdm=False)
    runner = llm.engine.runner
    bs = runner.block_size
    target_k, draft_k = np.asarray(runner.kv_pool.k, np.float32), np.asarray(runner.draft_pool.k, np.float32)
    assert len(tables) == 3
    for table in tables.values():
        for p in range(8 + 9):  # 8 prompt tokens, then 9 decoded ones' K/V
            b, o = table[p // bs], p % bs
            assert np.abs(target_k[:, b, o]).sum() > 0
            assert np.abs(draft_k[:, b, o]).sum() == 0, p
