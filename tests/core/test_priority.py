"""Priority scheduling (vLLM's `scheduling_policy="priority"`), on the scheduler and block pool alone: the waiting
queue admits the lowest priority value first (arrival order among equals), and preemption takes the running request
with the highest value, where first-come-first-served takes the newest."""

from __future__ import annotations

import pytest

from jaxpaged.config import CacheConfig, SchedulerConfig
from jaxpaged.core.block_manager import BlockManager
from jaxpaged.core.request import Sequence
from jaxpaged.core.scheduler import Scheduler
from jaxpaged.sampling_params import SamplingParams

BLOCK = 8


def make_scheduler(policy: str, max_num_seqs: int, num_blocks: int) -> Scheduler:
    bm = BlockManager(num_blocks, BLOCK, enable_prefix_caching=False)
    return Scheduler(SchedulerConfig(max_num_seqs=max_num_seqs, max_num_batched_tokens=64, max_model_len=64,
                                     policy=policy), CacheConfig(block_size=BLOCK, num_blocks=num_blocks), bm)


def request(rid: int, priority: int, prompt_len: int = 4, max_tokens: int = 3) -> Sequence:
    return Sequence(str(rid), [2 + rid] * prompt_len, SamplingParams(max_tokens=max_tokens), arrival_time=float(rid),
                    priority=priority)


def step(sched: Scheduler) -> list[str]:
    """One step, its tokens arriving at once (a finished sequence leaves); the ids of the sequences it ran."""
    out = sched.schedule()
    if out is None:
        return []
    for s in out.scheduled:
        if s.samples:
            s.seq.resolve(3)
            if len(s.seq.output_token_ids) >= s.seq.params.max_tokens:
                sched.finish(s.seq, "length")
    sched.block_manager.check_invariants()
    return [s.seq.request_id for s in out.scheduled]


@pytest.mark.parametrize("policy, order", [("priority", ["1", "3", "2", "0"]), ("fcfs", ["0", "1", "2", "3"])])
def test_one_seat_serves_the_lowest_priority_value_first(policy, order):
    sched = make_scheduler(policy, max_num_seqs=1, num_blocks=32)
    for rid, priority in enumerate([3, 1, 2, 1] if policy == "priority" else [0, 0, 0, 0]):
        sched.add(request(rid, priority))
    started = []
    for _ in range(40):
        for rid in step(sched):
            if rid not in started:
                started.append(rid)
    assert started == order and not sched.has_unfinished()


@pytest.mark.parametrize("policy, victim", [("priority", "0"), ("fcfs", "2")])
def test_preemption_takes_the_highest_priority_value_not_the_newest(policy, victim):
    """Three requests of one block of prompt each fill a pool of 4 blocks (one is the null block) and each needs a
    second block for its first output token: the one preempted is the highest value's (the oldest here), where
    fcfs preempts the newest."""
    sched = make_scheduler(policy, max_num_seqs=3, num_blocks=4)
    for rid, priority in enumerate([9, 0, 1] if policy == "priority" else [0, 0, 0]):
        sched.add(request(rid, priority, prompt_len=BLOCK, max_tokens=8))
    preempted = []
    for _ in range(6):
        out = sched.schedule()
        preempted += [s.request_id for s in out.preempted]
        for s in out.scheduled:
            if s.samples:
                s.seq.resolve(3)
        if preempted:
            break
    assert preempted[:1] == [victim]


def test_a_waiting_request_that_comes_first_is_admitted_before_a_swapped_one_returns():
    """Under fcfs swapped requests return before any waiting one (they arrived first); under priority a waiting
    request with a lower value starts before a swapped one with a higher value is brought back."""
    bm = BlockManager(4, BLOCK, enable_prefix_caching=False, num_cpu_blocks=8)
    sched = Scheduler(SchedulerConfig(max_num_seqs=3, max_num_batched_tokens=64, max_model_len=64,
                                      policy="priority"),
                      CacheConfig(block_size=BLOCK, num_blocks=4, preemption_mode="swap", swap_space=1.0), bm)
    for rid, priority in enumerate([9, 5]):
        sched.add(request(rid, priority, prompt_len=BLOCK, max_tokens=12))
    for _ in range(12):
        out = sched.schedule()
        for s in out.scheduled:
            if s.samples:
                s.seq.resolve(3)
        if out.preempted:
            break
    assert [s.request_id for s in sched.swapped] == ["0"]  # the higher value went to the host pool
    sched.add(request(2, 0, prompt_len=4, max_tokens=2))  # arrives later, comes first
    out = sched.schedule()
    assert "2" in [s.seq.request_id for s in out.scheduled] and not out.blocks_to_swap_in
    assert [s.request_id for s in sched.swapped] == ["0"]
    for s in out.scheduled:
        if s.samples:
            s.seq.resolve(3)
    swap_outs = 0
    for _ in range(60):  # the rest runs out, request 0 among it, and every block comes back
        out = sched.schedule()
        if out is None:
            break
        swap_outs += bool(out.blocks_to_swap_out)
        for s in out.scheduled:
            if s.samples:
                s.seq.resolve(3)
                if len(s.seq.output_token_ids) >= s.seq.params.max_tokens:
                    sched.finish(s.seq, "length")
        bm.check_invariants()
    assert not sched.has_unfinished() and bm.num_free_blocks == bm.num_blocks - 1
    # request 0, the last in priority order, is not brought back while request 1 still needs the room: swapped in
    # then, it would be the first preempted again, in and out every step
    assert swap_outs == 0
