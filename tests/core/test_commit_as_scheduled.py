"""Decodes are committed as they are scheduled (Scheduler._schedule_decodes: computed tokens advanced, a placeholder
counted, in the same pass over the running sequences). A decode committed that way and then preempted in the same
step, for a prompt chunk scheduled after it (mixed steps), must go back to exactly where it was before the step, and
the step's per-row lists must stay aligned with its sequences."""

from __future__ import annotations

import pytest

from jaxpaged.config import CacheConfig, SchedulerConfig
from jaxpaged.core.block_manager import BlockManager
from jaxpaged.core.request import Sequence, SequenceStatus
from jaxpaged.core.scheduler import Scheduler
from jaxpaged.sampling_params import SamplingParams

BLOCK = 8


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_a_committed_decode_preempted_for_a_prompt_chunk_goes_back_to_before_the_step(mode):
    # 3 usable blocks: the older request A holds 1 (8 of its 24 prompt tokens computed), the newer B holds 1 (its
    # 8-token prompt) and decodes into the last free one; A's next 16-token chunk then needs 2 more: B is preempted.
    bm = BlockManager(4, BLOCK, enable_prefix_caching=False, num_cpu_blocks=4 if mode == "swap" else 0)
    cache = CacheConfig(block_size=BLOCK, num_blocks=4, preemption_mode=mode, swap_space=1.0 if mode == "swap" else 0)
    sched = Scheduler(SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=64, max_model_len=128), cache, bm,
                      mixed_steps=True)
    params = SamplingParams(max_tokens=16)
    a = Sequence("a", list(range(2, 26)), params, arrival_time=0.0)
    b = Sequence("b", list(range(2, 10)) + [11], params, num_prompt_tokens=8, arrival_time=1.0)  # one output token
    for seq, computed in ((a, 8), (b, 8)):
        assert bm.allocate_slots(seq.seq_id, seq.token_ids, computed)
        seq.num_computed_tokens = computed
        seq.status = SequenceStatus.RUNNING
        sched._insert_running(seq)
    b_blocks = list(bm.block_table(b.seq_id))

    out = sched.schedule()

    assert out.preempted == [b]
    assert out.seqs == [a]
    assert (out.num_new_tokens, out.starts, out.samples, out.num_spec, out.drafts) == ([16], [8], [True], [0], [False])
    assert (a.num_computed_tokens, a.num_placeholders) == (24, 1)
    assert b.num_placeholders == 0, "the preempted decode's placeholder must be given back"
    if mode == "swap":
        assert b.status is SequenceStatus.SWAPPED and b.num_computed_tokens == 8  # its K/V kept on the host
        # its blocks go to the host, the one its decode had just been given too
        assert [d for d, _ in out.blocks_to_swap_out][:1] == b_blocks and len(out.blocks_to_swap_out) == 2
    else:
        assert b.status is SequenceStatus.WAITING and b.num_computed_tokens == 0
    assert bm.block_table(b.seq_id) == []
    assert len(bm.block_table(a.seq_id)) == 3


def test_a_decode_step_commits_every_row_as_the_generic_commit_would():
    """Plain decodes take the inline commit; one with proposals (speculative decoding) the generic one: the step's
    lists are the same either way, in running order."""
    bm = BlockManager(16, BLOCK, enable_prefix_caching=False)
    sched = Scheduler(SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=64, max_model_len=128),
                      CacheConfig(block_size=BLOCK, num_blocks=16), bm)
    params = SamplingParams(max_tokens=32)
    seqs = []
    for i in range(3):
        seq = Sequence(str(i), list(range(2, 12)) + [20 + i], params, num_prompt_tokens=10, arrival_time=float(i))
        assert bm.allocate_slots(seq.seq_id, seq.token_ids, 10)
        seq.num_computed_tokens = 10
        seq.status = SequenceStatus.RUNNING
        sched._insert_running(seq)
        seqs.append(seq)
    seqs[1].spec_tokens = [7, 8]  # the middle one verifies two proposals

    out = sched.schedule()

    assert out.seqs == seqs
    assert out.num_new_tokens == [1, 3, 1]
    assert out.starts == [10, 10, 10]
    assert out.samples == [True, True, True]
    assert out.num_spec == [0, 2, 0]
    assert out.drafts == [False, False, False]
    assert out.is_prefill  # a row verifies proposals: the step is prefill-shaped
    assert [s.num_computed_tokens for s in seqs] == [11, 13, 11]
    assert [s.num_placeholders for s in seqs] == [1, 1, 1]
