"""Beam search under memory pressure. A request's beams wait for each other at every step: a beam that has given its
candidates holds its blocks until the others have given theirs. A search whose beams could not all fit the pool
(each on blocks of its own, as they are once preempted and recomputed) stopped the engine for good: the beams
holding blocks waited for one that could not come back while they held them. Such a search is refused up front;
several that each fit, in a pool that holds about one at a time, finish with a big pool's beams and leave no block
in use."""

from __future__ import annotations

import pytest

from jaxpaged import LLM, BeamSearchParams
from tests.tiny import random_params, tiny_config

CONFIG = tiny_config(hidden=32, heads=4, kv_heads=2, head_dim=8, layers=2)
PARAMS = random_params(CONFIG, seed=1)
OPTIONS = dict(dtype="float32", max_num_seqs=8, max_num_batched_tokens=64, max_model_len=64, block_size=8,
               precompile=False, show_progress=False)
PROMPTS = [[(7 * i + 3 * j) % 90 + 4 for j in range(n)] for i, n in enumerate((5, 20, 13, 9))]
BEAMS = BeamSearchParams(beam_width=3, max_tokens=16, ignore_eos=True)
# the largest search needs 3 beams x 5 blocks of its own; 16 blocks (15 usable) hold it, not all four at once
SMALL_POOL = 16


def run(num_blocks: int, **options) -> tuple[dict, dict]:
    """Each prompt's beams (token ids and cumulative log-probs), and the engine's stats; fails instead of hanging."""
    engine = LLM.from_params(CONFIG, PARAMS, None, num_blocks=num_blocks, **{**OPTIONS, **options}).engine
    for i, prompt in enumerate(PROMPTS):
        engine.add_beam_request(f"b{i}", prompt, BEAMS)
    outs, idle = {}, 0
    for _ in range(5000):
        if not engine.has_unfinished_requests():
            break
        steps = engine.counters["steps"]
        for out in engine.step():
            outs[out.request_id] = [(d.token_ids, d.cumulative_logprob) for d in out.deltas]
        idle = idle + 1 if engine.counters["steps"] == steps else 0
        assert idle < 50, f"the engine stopped stepping: {engine.stats()}"
    assert not engine.has_unfinished_requests()
    return outs, engine.stats()


@pytest.fixture(scope="module")
def big_pool():
    outs, stats = run(200)
    assert stats["preemptions"] == 0
    return outs


@pytest.mark.parametrize("prefix_caching", [False, True], ids=["no-cache", "prefix-cache"])
@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_beam_searches_that_fit_one_at_a_time_finish_with_the_big_pools_beams(big_pool, mode, prefix_caching):
    outs, stats = run(SMALL_POOL, preemption_mode=mode, enable_prefix_caching=prefix_caching,
                      swap_space=0.01 if mode == "swap" else 0.0)
    assert stats["preemptions"] > 0, "nothing was preempted: the test would prove nothing"
    assert stats["num_used"] == 0 and stats["num_swapped"] == 0
    assert sorted(outs) == sorted(big_pool)
    for rid, beams in big_pool.items():
        assert [ids for ids, _ in outs[rid]] == [ids for ids, _ in beams], rid
        # recomputed K/V: float32 sums in another order
        assert [lp for _, lp in outs[rid]] == pytest.approx([lp for _, lp in beams], abs=1e-4), rid


def test_a_beam_search_the_pool_cannot_hold_is_refused_and_leaks_nothing():
    """3 beams of 20 + 30 tokens need 3 x 7 blocks of their own (as they would recomputed): a 19-block pool refuses
    it naming beam_width, before anything is queued; 2 beams fit and run."""
    llm = LLM.from_params(CONFIG, PARAMS, None, num_blocks=20, **OPTIONS)
    with pytest.raises(ValueError, match=r"beam_width=3 beams .* need 21 KV blocks; the pool has 19"):
        llm.beam_search([{"prompt_token_ids": [3] * 20}], BeamSearchParams(beam_width=3, max_tokens=30),
                        use_tqdm=False)
    assert not llm.engine.requests and llm.stats()["num_used"] == 0
    out = llm.beam_search([{"prompt_token_ids": [3] * 20}], BeamSearchParams(beam_width=2, max_tokens=30),
                          use_tqdm=False)
    assert len(out[0].sequences) == 2 and llm.stats()["num_used"] == 0


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_children_of_a_preempted_beam_are_recomputed(mode):
    """The next beams are chosen once every beam has given its candidates, so a beam preempted after giving its own
    can be a parent while it is out (swapped, or waiting to be recomputed): its children start with no K/V on the
    device and are recomputed (forking a swapped parent's blocks raised, and would have failed the request)."""
    from jaxpaged.config import CacheConfig, SchedulerConfig
    from jaxpaged.core.block_manager import BlockManager
    from jaxpaged.core.request import Sequence, SequenceStatus
    from jaxpaged.core.scheduler import Scheduler
    from jaxpaged.sampling_params import SamplingParams

    bm = BlockManager(16, 8, enable_prefix_caching=False, num_cpu_blocks=8)
    sched = Scheduler(SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=64, max_model_len=64),
                      CacheConfig(block_size=8, num_blocks=16, preemption_mode=mode,
                                  swap_space=0.01 if mode == "swap" else 0.0), bm)
    parent = Sequence("r", list(range(3, 23)), SamplingParams(temperature=0.0))
    sched.add(parent)
    out = sched.schedule()  # the prompt's prefill
    assert out.seqs == [parent] and parent.num_computed_tokens == 20
    sched._preempt(parent, out)
    assert parent.status is (SequenceStatus.SWAPPED if mode == "swap" else SequenceStatus.WAITING)
    child = parent.fork(output_token_ids=[40])
    sched.fork(parent, [child])
    assert child.status is SequenceStatus.RUNNING and child.num_computed_tokens == 0
    assert bm.block_table(child.seq_id) == []
    sched.finish(parent, "beam")
    out = sched.schedule()  # the child's whole prompt and token, recomputed
    assert out.seqs == [child] and out.num_new_tokens == [21]
    bm.check_invariants()
