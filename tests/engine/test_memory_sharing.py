"""Prefix caching, parallel sampling with copy-on-write, and swapping, on a tiny in-memory model."""

from __future__ import annotations

import pytest

from jaxpaged import LLM, SamplingParams
from tests.tiny import random_params, random_prompts, tiny_config

CONFIG = tiny_config()
PARAMS = random_params(CONFIG)
BS = 8


def make_llm(**kw) -> LLM:
    opts = dict(dtype="float32", max_num_seqs=8, max_num_batched_tokens=128, max_model_len=128, block_size=BS,
                num_blocks=200, precompile=False, show_progress=False)
    opts.update(kw)
    return LLM.from_params(CONFIG, PARAMS, None, **opts)


def tokens(outs):
    return [[c.token_ids for c in o.outputs] for o in outs]


def shared_prefix_prompts():
    """Prompts sharing a 32-token prefix (4 full blocks), ending on the boundary, one past it, and far past it."""
    prefix = random_prompts(1, 32, 32, seed=11)[0]
    tails = random_prompts(4, 1, 20, seed=12)
    prompts = [prefix + [7], prefix + tails[0], prefix[:24] + tails[1], prefix + [9] + tails[2], prefix + tails[3]]
    prompts.append(prefix[:16])  # a prompt that is itself exactly 2 full blocks
    return [{"prompt_token_ids": p} for p in prompts]


@pytest.mark.parametrize("params", [
    SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True),
    SamplingParams(temperature=0.9, top_p=0.9, max_tokens=12, seed=5, ignore_eos=True),
], ids=["greedy", "seeded"])
def test_prefix_caching_on_and_off_give_the_same_outputs(params):
    prompts = shared_prefix_prompts()
    off = make_llm(enable_prefix_caching=False)
    want = [tokens(off.generate([p], params, use_tqdm=False))[0] for p in prompts]
    on = make_llm(enable_prefix_caching=True)
    got = [tokens(on.generate([p], params, use_tqdm=False))[0] for p in prompts]
    assert got == want
    s = on.stats()
    # the 2nd..5th prompts reuse 4, 3, 4, 4 full blocks of the first; the last reuses 1 (never the whole prompt)
    assert s["prefix_cache_hits"] >= (4 + 3 + 4 + 4 + 1) * BS
    assert s["prefix_cache_queries"] >= sum(len(p["prompt_token_ids"]) for p in prompts[1:])
    assert off.stats()["prefix_cache_hits"] == 0
    on.engine.block_manager.check_invariants()
    on.engine.scheduler.check_invariants()


def test_prefix_hits_in_one_batch_give_the_same_outputs():
    prompts = shared_prefix_prompts()
    params = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
    want = tokens(make_llm(enable_prefix_caching=False).generate(prompts, params, use_tqdm=False))
    llm = make_llm()
    llm.generate(prompts[:1], params, use_tqdm=False)  # warm the cache
    assert tokens(llm.generate(prompts, params, use_tqdm=False)) == want
    assert llm.stats()["prefix_cache_hits"] > 0


def peak_used_blocks(llm, prompts, params):
    peak = 0
    step = llm.engine.step

    def spy():
        nonlocal peak
        outs = step()
        peak = max(peak, llm.stats()["num_used"])
        return outs

    llm.engine.step = spy
    outs = llm.generate(prompts, params, use_tqdm=False)
    llm.engine.step = step
    return outs, peak


def test_parallel_sampling_shares_the_prompt_blocks_and_is_reproducible():
    prompt = [{"prompt_token_ids": random_prompts(1, 61, 61, seed=3)[0]}]  # 8 blocks, the last one partly filled
    params = SamplingParams(n=4, temperature=1.0, max_tokens=6, seed=42, ignore_eos=True)
    llm = make_llm(enable_prefix_caching=False)
    outs, peak = peak_used_blocks(llm, prompt, params)
    samples = tokens(outs)[0]
    assert len(samples) == 4 and len({tuple(s) for s in samples}) > 1
    # 7 full prompt blocks held once; each sample has its own copy of the partly filled 8th block (+1 growing)
    assert peak <= 7 + 4 * 2
    s = llm.stats()
    assert s["cow_copies"] >= 3
    assert s["num_used"] == 0
    again = tokens(make_llm(enable_prefix_caching=False).generate(prompt, params, use_tqdm=False))[0]
    assert again == samples
    # each sample equals a single-sample request drawn with that sample's seed stream
    first = tokens(make_llm().generate(prompt, SamplingParams(n=1, temperature=1.0, max_tokens=6, seed=42,
                                                                ignore_eos=True), use_tqdm=False))[0][0]
    assert samples[0] == first


def test_swapping_gives_the_same_outputs_and_shows_swaps():
    prompts = [{"prompt_token_ids": p} for p in random_prompts(10, 20, 60, seed=8)]
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    want = tokens(make_llm().generate(prompts, params, use_tqdm=False))
    llm = make_llm(num_blocks=23, swap_space=0.01, preemption_mode="swap", enable_prefix_caching=False)
    got = tokens(llm.generate(prompts, params, use_tqdm=False))
    assert got == want
    s = llm.stats()
    assert s["preemptions_swap"] > 0 and s["swapped_out_blocks"] > 0 and s["swapped_in_blocks"] > 0
    assert s["num_used"] == 0 and s["num_cpu_used"] == 0
    llm.engine.block_manager.check_invariants()
    llm.engine.scheduler.check_invariants()


def test_the_host_pool_is_swap_space_and_a_request_that_ends_while_swapped_out_frees_its_blocks():
    """The host pool is one array per pool array (K, V), num_cpu_blocks blocks each: what swap_space pays for, made
    at the first swap-out and never grown. (It was a dict of per-block views of each swap-out's arrays: a block
    swapped back in kept its whole swap-out's array alive while any of its blocks stayed out, and an aborted
    request's arrays stayed until a later swap-out reused the block ids.) An aborted swapped-out request's host
    blocks go back to the block manager and are reused."""
    llm = make_llm(max_num_seqs=6, num_blocks=14, max_model_len=64, swap_space=0.01, preemption_mode="swap",
                   enable_prefix_caching=False)
    engine = llm.engine
    params = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    for i, p in enumerate(random_prompts(6, 8, 20, seed=6)):
        engine.add_request(f"r{i}", p, params)
    while not engine.scheduler.swapped:
        engine.step()
    bm = engine.block_manager
    pool_bytes = bm.num_cpu_blocks * engine.runner.host_block_bytes
    assert sum(a.nbytes for a in engine._host_pool) == pool_bytes > 0
    assert [a.shape[1] for a in engine._host_pool] == [bm.num_cpu_blocks] * 2
    victim = engine.scheduler.swapped[0]
    assert len(bm.cpu_tables[victim.seq_id]) > 0
    engine.abort_request(victim.request_id)
    while engine.has_unfinished_requests():
        engine.step()
    assert sum(a.nbytes for a in engine._host_pool) == pool_bytes
    assert llm.stats()["num_cpu_used"] == 0
