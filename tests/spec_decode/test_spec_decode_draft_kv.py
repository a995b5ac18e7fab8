"""A separate draft model's KV pool across verifying steps: its loop writes the K/V of the tokens the next step
verifies (the last token, then its proposals), so a step whose rows all come from that loop runs no draft over its
tokens, and the loop's first step rewrites only what it could not have written (the k-th proposal, when all k are
accepted). These tests check the pool itself: after partly rejected steps it holds, at every position of the
sequence, what a fresh prefill of the draft over the same tokens writes; the run over the step's tokens is really
skipped; and preemption (recompute, swap) leaves a perfect draft accepting everything."""

from __future__ import annotations

import numpy as np
import pytest

from jaxpaged import SamplingParams
from jaxpaged.models import families
from tests.tiny import checked, random_params, random_prompts, tiny_config, tiny_llm

CONFIG = tiny_config(vocab_size=96, layers=4)
PARAMS = random_params(CONFIG)
# The target with noise on its layer weights: a draft that agrees with it often, not always.
NOISY = {**PARAMS, "layers": {name: w + 0.15 * np.random.default_rng(7).standard_normal(w.shape).astype(np.float32)
                              * w.std() for name, w in PARAMS["layers"].items()}}
PROMPTS = [{"prompt_token_ids": p * 3} for p in random_prompts(3, 5, 7, seed=3)]
GREEDY = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
K = 3


def record(llm):
    """Wraps the engine: every dispatched step's inputs, every sequence's block table when it is freed, and every
    verified row's (proposals verified, accepted)."""
    engine = llm.engine
    engine.step = checked(engine)
    seen = {"inputs": [], "tables": {}, "verified": []}
    dispatch, free, verified = engine.runner.dispatch, engine.block_manager.free, engine._verified

    def recorded_dispatch(inputs, rows):
        seen["inputs"].append(inputs)
        return dispatch(inputs, rows)

    def recorded_free(seq_id, *args, **kwargs):
        seen["tables"][seq_id] = list(engine.block_manager.tables.get(seq_id, []))
        return free(seq_id, *args, **kwargs)

    def recorded_verified(out, result, i, seq):
        seen["verified"].append((out.num_spec[i], int(result.num_accepted[i])))
        return verified(out, result, i, seq)

    engine.runner.dispatch, engine.block_manager.free, engine._verified = recorded_dispatch, recorded_free, \
        recorded_verified
    return seen


def pool_at(pool, table: list[int], positions: range, block_size: int) -> tuple[np.ndarray, np.ndarray]:
    """K and V [L, P, Hkv, D] of a sequence's positions, read through its block table."""
    k, v = np.asarray(pool.k, np.float32), np.asarray(pool.v, np.float32)
    blocks = [table[p // block_size] for p in positions]
    offsets = [p % block_size for p in positions]
    return k[:, blocks, offsets], v[:, blocks, offsets]


def test_the_draft_pool_after_partly_rejected_steps_equals_a_fresh_prefill():
    draft = families.from_params(CONFIG, NOISY)
    llm = tiny_llm(CONFIG, PARAMS, max_num_seqs=8, num_blocks=80, enable_prefix_caching=False,
                   speculative_config={"model": draft, "num_speculative_tokens": K})
    seen = record(llm)
    outs = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    assert llm.stats()["num_used"] == 0
    plain = tiny_llm(CONFIG, PARAMS, max_num_seqs=8, num_blocks=80).generate(PROMPTS, GREEDY, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == [o.outputs[0].token_ids for o in plain]
    # both kinds of verifying step happened: some rejected a proposal, some accepted all k (the loop's first step
    # then writes the k-th proposal's K/V)
    verified = [(n, a) for n, a in seen["verified"] if n]
    assert any(a < n for n, a in verified) and any(a == n == K for n, a in verified)
    # steps whose every row came from the draft loop ran no draft over their tokens; prompt steps did
    runs = [int(i.layout.view(i.buf, "draft_run")[0]) for i in seen["inputs"] if i.layout.spec_width]
    assert 0 in runs and 1 in runs
    # The draft pool at every position but the last token's equals a fresh prefill of the draft over the tokens.
    bs = llm.engine.runner.block_size
    draft_pool = llm.engine.runner.draft_pool
    assert len(seen["tables"]) == len(PROMPTS)
    for out, (_, table) in zip(outs, sorted(seen["tables"].items()), strict=True):  # (seq ids in request order)
        tokens = list(out.prompt_token_ids) + list(out.outputs[0].token_ids)
        fresh = tiny_llm(CONFIG, NOISY, max_num_seqs=8, num_blocks=80, enable_prefix_caching=False)
        fresh_seen = record(fresh)
        fresh.generate([{"prompt_token_ids": tokens[:-1]}], SamplingParams(temperature=0.0, max_tokens=1),
                       use_tqdm=False)
        (fresh_table,) = fresh_seen["tables"].values()
        positions = range(len(tokens) - 1)
        got_k, got_v = pool_at(draft_pool, table, positions, bs)
        want_k, want_v = pool_at(fresh.engine.runner.kv_pool, fresh_table, positions, bs)
        np.testing.assert_allclose(got_k, want_k, rtol=1e-4, atol=1e-5)
        np.testing.assert_allclose(got_v, want_v, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_preempted_sequences_keep_a_perfect_draft_accepting_everything(mode):
    """A pool too small for every sequence preempts: a recomputed sequence's draft K/V is rebuilt by its prefill, a
    swapped one's travels with its blocks (the slots its loop wrote ahead too); a draft that is the target still
    accepts every proposal, so no position of its pool was lost."""
    options = dict(num_blocks=12, preemption_mode=mode, swap_space=0.01 if mode == "swap" else 0.0)
    llm = tiny_llm(CONFIG, PARAMS, max_num_seqs=8, **options,
                   speculative_config={"model": families.from_params(CONFIG, PARAMS), "num_speculative_tokens": K})
    llm.engine.step = checked(llm.engine)
    outs = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    stats = llm.stats()
    assert stats["preemptions"] > 0 and stats["num_used"] == 0
    plain = tiny_llm(CONFIG, PARAMS, max_num_seqs=8, num_blocks=80).generate(PROMPTS, GREEDY, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == [o.outputs[0].token_ids for o in plain]
    assert stats["spec_accepted_tokens"] == stats["spec_proposed_tokens"] > 0


def test_blocks_written_without_the_draft_stay_out_of_the_prefix_cache():
    """Above disable_by_batch_size a step runs without the draft, so its sequences' draft K/V has holes. Their blocks
    must not be found in the prefix cache later: a request alone afterwards, with the same prompt, would draft from
    those holes. With a draft that is the target, that request accepts every proposal and gets its plain tokens."""
    spec = {"model": families.from_params(CONFIG, PARAMS), "num_speculative_tokens": K, "disable_by_batch_size": 2}
    llm = tiny_llm(CONFIG, PARAMS, max_num_seqs=8, num_blocks=80, speculative_config=spec)
    llm.engine.step = checked(llm.engine)
    shared = random_prompts(1, 24, 24, seed=11)[0]  # three full blocks of 8
    busy = [{"prompt_token_ids": shared + [5 + i]} for i in range(3)]  # three running: the draft is skipped
    llm.generate(busy, SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True), use_tqdm=False)
    before = llm.stats()
    alone = [{"prompt_token_ids": shared + [40]}]
    out = llm.generate(alone, GREEDY, use_tqdm=False)[0]
    stats = llm.stats()
    plain = tiny_llm(CONFIG, PARAMS, max_num_seqs=8, num_blocks=80).generate(alone, GREEDY, use_tqdm=False)[0]
    assert out.outputs[0].token_ids == plain.outputs[0].token_ids
    proposed = stats["spec_proposed_tokens"] - before["spec_proposed_tokens"]
    assert stats["spec_accepted_tokens"] - before["spec_accepted_tokens"] == proposed > 0
    assert stats["num_used"] == 0


def test_a_recomputed_sequence_speculates_again_from_a_whole_draft():
    """A sequence that ran without the draft (above disable_by_batch_size) and is then preempted by recompute gets
    its draft K/V back from its new prefill: once the batch is small enough it speculates again, and a draft that is
    the target accepts every proposal (no hole was drafted from)."""
    spec = {"model": families.from_params(CONFIG, PARAMS), "num_speculative_tokens": K, "disable_by_batch_size": 2}
    llm = tiny_llm(CONFIG, PARAMS, max_num_seqs=8, num_blocks=10, preemption_mode="recompute",
                   speculative_config=spec)
    llm.engine.step = checked(llm.engine)
    engine, events = llm.engine, []
    preempt, verified = engine.scheduler._preempt, engine._verified

    def recorded_preempt(seq, out):
        events.append(("preempted", seq.seq_id, seq.draft_stale))
        return preempt(seq, out)

    def recorded_verified(out, result, i, seq):
        events.append(("verified", seq.seq_id, out.num_spec[i]))
        return verified(out, result, i, seq)

    engine.scheduler._preempt, engine._verified = recorded_preempt, recorded_verified
    outs = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    stats = llm.stats()
    plain = tiny_llm(CONFIG, PARAMS, max_num_seqs=8, num_blocks=80).generate(PROMPTS, GREEDY, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == [o.outputs[0].token_ids for o in plain]
    assert stats["spec_accepted_tokens"] == stats["spec_proposed_tokens"] > 0 and stats["num_used"] == 0
    stale = [i for i, (kind, seq_id, was_stale) in enumerate(events) if kind == "preempted" and was_stale]
    assert stale, "no sequence was preempted after running without the draft"
    assert any(kind == "verified" and seq_id == events[i][1] and n > 0
               for i in stale for kind, seq_id, n in events[i + 1:])



def test_a_sample_forked_from_a_sequence_without_its_draft_shares_its_holes():
    """n > 1: samples are forked from a sequence whose prompt step may have skipped the draft; they share its blocks,
    so they are marked as it is and do not speculate from its holes."""
    from jaxpaged.core.request import Sequence

    parent = Sequence("r", [5, 6, 7], SamplingParams(n=2), num_prompt_tokens=3, max_model_len=64)
    assert not parent.fork(sample_index=1).draft_stale
    parent.draft_stale = True
    assert parent.fork(sample_index=1).draft_stale
