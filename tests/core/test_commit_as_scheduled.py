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


def _decoding(bm: BlockManager, sched: Scheduler, n: int, prompt: int, max_tokens: int = 64) -> list[Sequence]:
    seqs = []
    for i in range(n):
        seq = Sequence(str(i), list(range(2, 2 + prompt)) + [30 + i], SamplingParams(max_tokens=max_tokens),
                       num_prompt_tokens=prompt, arrival_time=float(i))
        assert bm.allocate_slots(seq.seq_id, seq.token_ids, prompt)
        seq.num_computed_tokens = prompt
        seq.status = SequenceStatus.RUNNING
        sched._insert_running(seq)
        seqs.append(seq)
    return seqs


def _step(sched: Scheduler, token: int = 5):
    """One scheduled step whose sampled tokens arrive at once (the synchronous loop)."""
    out = sched.schedule()
    for seq, sampled in zip(out.seqs, out.samples, strict=True):
        if sampled:
            seq.token_ids.append(token)
            seq.num_placeholders -= 1
    return out


@pytest.mark.parametrize("prefix_caching", [False, True])
def test_decodes_call_the_block_manager_only_where_a_block_fills_or_starts(monkeypatch, prefix_caching):
    """A decode's slot in the block it writes and holds alone is taken in place (BlockManager.writable); the block
    manager is called once a sequence starts a block (and, with prefix caching, once it fills one: its hash)."""
    bm = BlockManager(64, BLOCK, enable_prefix_caching=prefix_caching)
    sched = Scheduler(SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=64, max_model_len=128),
                      CacheConfig(block_size=BLOCK, num_blocks=64, enable_prefix_caching=prefix_caching), bm)
    seqs = _decoding(bm, sched, 3, prompt=10)
    calls = []
    allocate = bm.allocate_slots
    monkeypatch.setattr(bm, "allocate_slots", lambda *a: calls.append(a[2]) or allocate(*a))
    steps = 4 * BLOCK
    for _ in range(steps):
        out = _step(sched)
        assert len(out.seqs) == 3
        bm.check_invariants()
    for seq in seqs:  # every slot is counted, in the blocks the sequence holds
        assert bm.num_tokens(seq.seq_id) == seq.num_computed_tokens == 11 + steps - 1
        assert len(bm.block_table(seq.seq_id)) == -(-bm.num_tokens(seq.seq_id) // BLOCK)
    # the slots 11..42 cross into 4 new blocks per sequence (17, 25, 33, 41); with prefix caching the blocks
    # filling at 16, 24, 32, 40 are hashed through the call too
    assert sorted(calls) == sorted([17, 25, 33, 41] * 3 + ([16, 24, 32, 40] * 3 if prefix_caching else []))
    if prefix_caching:  # the full blocks' hashes were registered: a new prompt of the same tokens hits them
        assert len(bm.seq_hashes[seqs[0].seq_id]) == 40 // BLOCK


def test_a_forked_sequence_copies_its_shared_block_before_writing_in_it():
    """A fork shares the parent's last block: no sequence may take slots in place in a block it shares (the block
    manager's `writable` is dropped), and the next step copies that block once (copy on write)."""
    bm = BlockManager(64, BLOCK, enable_prefix_caching=False)
    sched = Scheduler(SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=64, max_model_len=128),
                      CacheConfig(block_size=BLOCK, num_blocks=64, enable_prefix_caching=False), bm)
    (parent,) = _decoding(bm, sched, 1, prompt=10)
    _step(sched)  # slot 11 (block 1) taken: the parent writes block 1 in place from now
    assert parent.seq_id in bm.writable
    child = parent.fork(sample_index=1, output_token_ids=parent.output_token_ids)  # a beam's way: same tokens
    sched.fork(parent, [child])
    bm.check_invariants()  # no writable end over a shared block
    shared = bm.block_table(parent.seq_id)[1]
    out = _step(sched)
    assert set(out.seqs) == {parent, child}
    assert [src for src, _ in out.blocks_to_copy] == [shared]
    bm.check_invariants()
