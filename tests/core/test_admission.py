"""Admission and step order, on the scheduler and block pool alone (no model): whatever mix of n, prompt lengths
and arrivals comes in, no step holds more than max_num_seqs sequences, and running streams are never stalled
behind more than one prefill step (separate steps) or at all (mixed steps), under both scheduling policies."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from jaxpaged.config import CacheConfig, SchedulerConfig
from jaxpaged.core.block_manager import BlockManager
from jaxpaged.core.request import Sequence
from jaxpaged.core.scheduler import Scheduler
from jaxpaged.sampling_params import SamplingParams

BLOCK = 8


def make_scheduler(max_num_seqs: int, num_blocks: int, budget: int = 64, mixed: bool = False) -> Scheduler:
    bm = BlockManager(num_blocks, BLOCK, enable_prefix_caching=True)
    return Scheduler(SchedulerConfig(max_num_seqs=max_num_seqs, max_num_batched_tokens=budget, max_model_len=128),
                     CacheConfig(block_size=BLOCK, num_blocks=num_blocks), bm, mixed_steps=mixed)


def request(rid: int, n: int, prompt_len: int, max_tokens: int, arrival: float) -> Sequence:
    prompt = [2 + (rid * 7 + i) % 50 for i in range(prompt_len)]
    return Sequence(str(rid), prompt, SamplingParams(n=n, max_tokens=max_tokens), arrival_time=arrival,
                    fork_pending=n - 1)


def run(sched: Scheduler, arrivals: dict[int, list[Sequence]], max_steps: int = 2000) -> list:
    """Steps the scheduler as the engine would (every scheduled token computed, one token sampled per finished
    row, each step's tokens read before the next is scheduled); checks the invariants after every step; returns the
    steps' outputs."""
    limit = sched.config.max_num_seqs
    steps, last_prefill = [], False
    for t in range(max_steps):
        for seq in arrivals.get(t, []):
            sched.add(seq)
        if not sched.has_unfinished() and t > max(arrivals, default=0):
            return steps
        waiting_decodes = [s for s in sched.running if (s.num_uncomputed_tokens == 1 and not s.is_prefill)]
        out = sched.schedule()
        if out is None:
            continue
        assert len(out.scheduled) <= limit
        assert len(sched.running) <= limit
        assert out.num_tokens <= sched.config.max_num_batched_tokens or not out.is_prefill
        for parent, children in out.forked:  # n > 1: the request's other samples, sharing the parent's blocks
            assert [c.sample_index for c in children] == list(range(1, parent.params.n))
            assert all(c.request_id == parent.request_id and (c in sched.running or c in out.preempted)
                       for c in children)
        if sched.mixed_steps:
            if not out.preempted:
                assert {s.seq_id for s in waiting_decodes} <= {x.seq.seq_id for x in out.scheduled}, \
                    "a running stream waited for a token in a mixed step"
        elif last_prefill and waiting_decodes:
            assert not out.is_prefill, "two prefill steps in a row while running streams waited for a token"
        last_prefill = out.is_prefill and bool(out.scheduled)
        steps.append(out)
        for sched_seq in out.scheduled:  # the scheduler advanced num_computed_tokens; the tokens arrive
            seq = sched_seq.seq
            if sched_seq.samples:
                seq.resolve(3)
                if len(seq.output_token_ids) >= seq.params.max_tokens:
                    sched.finish(seq, "length")
        sched.block_manager.check_invariants()
    raise AssertionError("the requests did not finish")


@pytest.mark.parametrize("mixed", [False, True], ids=["separate", "mixed"])
@settings(max_examples=60, deadline=None)
@given(max_num_seqs=st.integers(4, 12), num_blocks=st.integers(12, 60),
       requests=st.lists(st.tuples(st.integers(1, 4), st.integers(1, 40), st.integers(1, 6), st.integers(0, 6)),
                         min_size=1, max_size=24))
def test_no_step_ever_holds_more_than_max_num_seqs(mixed, max_num_seqs, num_blocks, requests):
    sched = make_scheduler(max_num_seqs, num_blocks, mixed=mixed)
    arrivals: dict[int, list[Sequence]] = {}
    for rid, (n, prompt_len, max_tokens, at) in enumerate(requests):
        arrivals.setdefault(at, []).append(request(rid, min(n, max_num_seqs), prompt_len, max_tokens, float(rid)))
    run(sched, arrivals)
    assert sched.block_manager.stats().num_used == 0


@pytest.mark.parametrize("mixed", [False, True], ids=["separate", "mixed"])
def test_concurrent_parents_that_fork_later_wait_instead_of_overflowing(mixed):
    """The failure that crashed the server: 17 requests of n=4 at once on max_num_seqs=64 (68 seats)."""
    sched = make_scheduler(max_num_seqs=64, num_blocks=400, budget=2048, mixed=mixed)
    steps = run(sched, {0: [request(i, 4, 5, 8, float(i)) for i in range(17)]})
    assert max(len(s.scheduled) for s in steps) == 64


@pytest.mark.parametrize("mixed", [False, True], ids=["separate", "mixed"])
def test_a_queue_of_prompts_does_not_stall_running_streams(mixed):
    """One running stream and 40 long prompts behind it: prefill and decode steps alternate while it runs
    (separate steps), or it decodes in every step beside the prompts' chunks (mixed steps)."""
    sched = make_scheduler(max_num_seqs=64, num_blocks=400, budget=64, mixed=mixed)
    stream = request(0, 1, 4, 30, 0.0)
    steps = run(sched, {0: [stream], 2: [request(i, 1, 60, 1, float(i)) for i in range(1, 41)]})
    stream_steps = [i for i, s in enumerate(steps) if any(x.seq is stream for x in s.scheduled)]
    gaps = [b - a for a, b in zip(stream_steps, stream_steps[1:], strict=False)]
    assert max(gaps) <= (1 if mixed else 2)  # no step / at most one prefill step between two of its tokens
    if mixed:
        assert sum(s.is_prefill and any(x.seq is stream for x in s.scheduled) for s in steps) >= 5
