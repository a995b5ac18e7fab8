"""The host-side block pool: unit tests of each rule, and hypothesis state machines over random operations."""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from jaxpaged.core import block_manager
from jaxpaged.core.block_manager import BlockManager, NoFreeBlocksError, chain_hash

BS = 4


def used_refcounts(bm: BlockManager) -> dict[int, int]:
    return {b: r for b, r in enumerate(bm.refcount) if r}


# ---- allocation ---------------------------------------------------------------------------------------------------


def test_allocates_a_block_only_when_the_last_one_fills():
    bm = BlockManager(10, BS)
    assert bm.allocate_slots("a", list(range(5)), 5)
    assert len(bm.block_table("a")) == 2 and bm.num_tokens("a") == 5
    for n in (6, 7, 8):
        assert bm.allocate_slots("a", list(range(n)), n)
        assert len(bm.block_table("a")) == 2
    assert bm.allocate_slots("a", list(range(9)), 9)
    assert len(bm.block_table("a")) == 3 and bm.num_tokens("a") == 9
    assert bm.num_free_blocks == 9 - 3
    bm.check_invariants()


def test_null_block_is_never_handed_out():
    bm = BlockManager(5, BS)  # blocks 1..4 usable
    assert bm.allocate_slots("a", list(range(16)), 16)
    assert sorted(bm.block_table("a")) == [1, 2, 3, 4]
    assert not bm.allocate_slots("b", [0], 1)
    assert bm.stats().num_blocks == 4
    bm.check_invariants()


def test_allocate_is_all_or_nothing():
    bm = BlockManager(4, BS)  # 3 usable blocks
    assert bm.allocate_slots("a", list(range(8)), 8)
    before = (list(bm.block_table("a")), bm.num_free_blocks, bm.stats())
    assert not bm.allocate_slots("b", list(range(12)), 12)
    assert bm.block_table("b") == [] and bm.num_tokens("b") == 0
    assert (bm.block_table("a"), bm.num_free_blocks, bm.stats()) == before
    bm.check_invariants()


def test_allocate_is_all_or_nothing_when_a_copy_on_write_is_needed():
    bm = BlockManager(4, BS)  # 3 usable blocks
    bm.allocate_slots("p", list(range(6)), 6)  # 2 blocks, the second partly filled
    bm.fork("p", "c")
    table, refs = list(bm.block_table("c")), used_refcounts(bm)
    # 9 tokens: a copy of the shared partial block plus a third block = 2 blocks, but only 1 is free
    assert not bm.allocate_slots("c", list(range(9)), 9)
    assert bm.block_table("c") == table and used_refcounts(bm) == refs and bm.num_tokens("c") == 6
    assert bm.pop_copies() == [] and bm.stats().cow_copies == 0
    assert bm.allocate_slots("c", list(range(7)), 7)  # the copy alone fits
    assert len(bm.pop_copies()) == 1
    bm.check_invariants()


def test_free_of_an_unknown_or_already_freed_sequence_is_a_noop():
    bm = BlockManager(6, BS)
    bm.free("nobody")
    bm.allocate_slots("a", list(range(6)), 6)
    bm.free("a")
    free_after_first = bm.num_free_blocks
    bm.free("a")
    assert bm.num_free_blocks == free_after_first == 5 and bm.block_table("a") == []
    bm.check_invariants()


# ---- prefix caching -----------------------------------------------------------------------------------------------


def test_prefix_cache_shares_full_blocks():
    bm = BlockManager(20, BS)
    prompt = list(range(10))  # 2 full blocks + 2 tokens
    bm.allocate_slots("a", prompt, 10)
    assert bm.take_cached_prefix("b", prompt) == 8
    assert bm.block_table("b") == bm.block_table("a")[:2] and bm.num_tokens("b") == 8
    assert bm.stats().num_shared == 2
    bm.allocate_slots("b", prompt, 10)
    assert bm.block_table("b")[2] != bm.block_table("a")[2]  # the partly filled block is never shared by hash
    s = bm.stats()
    assert (s.prefix_cache_queries, s.prefix_cache_hits) == (10, 8)
    bm.check_invariants()


@pytest.mark.parametrize("length, hit", [(1, 0), (4, 0), (5, 4), (8, 4), (9, 8), (12, 8), (13, 12), (16, 12)])
def test_prefix_hit_never_covers_the_whole_prompt(length, hit):
    bm = BlockManager(20, BS)
    tokens = list(range(100, 116))  # all 4 blocks cached
    bm.allocate_slots("a", tokens, 16)
    assert bm.take_cached_prefix("b", tokens[:length]) == hit
    assert bm.num_tokens("b") == hit and len(bm.block_table("b")) == hit // BS


def test_prefix_boundary_exact_block_and_one_past():
    bm = BlockManager(20, BS)
    prompt = list(range(8))  # exactly 2 full blocks
    bm.allocate_slots("a", prompt, 8)
    a1, a2 = bm.block_table("a")
    # Exactly on the boundary: the last block must be recomputed, so only the first is taken.
    assert bm.take_cached_prefix("b", prompt) == 4
    assert bm.allocate_slots("b", prompt, 8)
    assert bm.block_table("b")[0] == a1 and bm.block_table("b")[1] != a2
    assert bm.stats().num_cached == 2  # b's copy of the second block is not registered twice
    # One token past the boundary: both blocks are taken, the new token gets a fresh block.
    assert bm.take_cached_prefix("c", prompt + [99]) == 8
    assert bm.allocate_slots("c", prompt + [99], 9)
    assert bm.block_table("c")[:2] == [a1, a2] and len(bm.block_table("c")) == 3
    bm.check_invariants()


def test_prefix_chain_hash_depends_on_the_parent():
    bm = BlockManager(20, BS)
    bm.allocate_slots("a", [1, 2, 3, 4, 5, 6, 7, 8, 9], 9)
    # same second block, different first block: no hit at all
    assert bm.take_cached_prefix("b", [0, 2, 3, 4, 5, 6, 7, 8, 9]) == 0
    assert chain_hash(None, [5, 6, 7, 8]) != chain_hash(chain_hash(None, [1, 2, 3, 4]), [5, 6, 7, 8])


def test_only_blocks_covered_by_slots_and_known_tokens_are_cached():
    bm = BlockManager(20, BS)
    tokens = list(range(20))
    bm.allocate_slots("a", tokens[:6], 12)  # 3 full blocks of slots, tokens known for 1.5 of them
    assert bm.stats().num_cached == 1
    bm.allocate_slots("a", tokens[:12], 12)
    assert bm.stats().num_cached == 3
    bm.allocate_slots("b", [50 + t for t in tokens], 9)  # 20 known tokens, 2 full blocks of slots
    assert bm.stats().num_cached == 3 + 2
    bm.check_invariants()


def test_equal_content_is_registered_once():
    bm = BlockManager(8, BS)  # 7 usable
    tokens = list(range(8))
    bm.allocate_slots("a", tokens, 8)
    bm.allocate_slots("b", tokens, 8)  # computed independently, no cache lookup
    assert bm.stats().num_cached == 2 and not set(bm.block_table("a")) & set(bm.block_table("b"))
    b_blocks = set(bm.block_table("b"))
    bm.free("a")
    bm.free("b")
    assert set(bm.evictable) == set(bm.block_hash) and not b_blocks & set(bm.evictable)
    assert b_blocks <= set(bm.free_list)
    bm.check_invariants()


def test_cached_blocks_survive_free_and_are_taken_back():
    bm = BlockManager(6, BS)  # 5 usable
    prompt = list(range(9))
    bm.allocate_slots("a", prompt, 9)
    cached = bm.block_table("a")[:2]
    bm.free("a")
    s = bm.stats()
    assert (s.num_free, s.num_cached, s.num_used) == (5, 2, 0)
    assert bm.take_cached_prefix("b", prompt) == 8 and bm.block_table("b") == cached
    assert bm.num_free_blocks == 3 and not set(cached) & set(bm.evictable)
    bm.check_invariants()


def test_withheld_blocks_leave_the_prefix_cache_and_later_ones_never_join():
    """`withhold(seq, t)`: the blocks from the one holding token t leave the cache and those the sequence fills
    later never join it, through a fork and a swap too; its earlier blocks stay cached; a freed sequence's id starts
    clean."""
    bm = BlockManager(16, BS, num_cpu_blocks=8)
    tokens = list(range(2, 30))
    assert bm.allocate_slots("a", tokens, 12)  # 3 full blocks, cached
    assert bm.stats().num_cached == 3
    bm.withhold("a", 5)  # token 5 sits in block 1: blocks 1 and 2 leave
    assert set(bm.block_hash) == {bm.block_table("a")[0]}
    assert bm.allocate_slots("a", tokens, 20)  # blocks 3 and 4 fill: not cached
    assert set(bm.block_hash) == {bm.block_table("a")[0]}
    bm.withhold("a", 16)  # a later position changes nothing
    assert bm.withheld["a"] == 1
    bm.fork("a", "child")
    assert bm.allocate_slots("child", tokens, 24)  # the child's own block 5: not cached either
    assert set(bm.block_hash) == {bm.block_table("a")[0]}
    bm.swap_out(["a", "child"])
    bm.swap_in(["a", "child"])  # swapped-in blocks are cached again up to the withheld one only
    assert len(bm.block_hash) == 1  # block 0's content (its old copy, left cached when it was swapped out)
    bm.check_invariants()
    assert bm.take_cached_prefix("b", tokens[:21]) == BS  # another request finds block 0 alone
    bm.free("b")
    bm.free("a")
    bm.free("child")
    assert "a" not in bm.withheld and "child" not in bm.withheld
    assert bm.allocate_slots("a", tokens, 12) and bm.stats().num_cached == 3  # the same id, a new sequence
    bm.check_invariants()


def test_lru_evicts_oldest_cached_block_only_when_free_list_empty():
    bm = BlockManager(6, BS)  # 5 usable
    bm.allocate_slots("a", list(range(5)), 5)  # a full (cached) block + a partial one
    bm.allocate_slots("b", list(range(10, 15)), 5)
    a1, b1 = bm.block_table("a")[0], bm.block_table("b")[0]
    bm.free("a")  # a's cached block is freed first: the oldest in the LRU
    bm.free("b")
    assert list(bm.evictable) == [a1, b1] and len(bm.free_list) == 3
    bm.allocate_slots("c", list(range(50, 62)), 12)  # 3 blocks: the free list suffices, the cache is untouched
    assert {a1, b1} == set(bm.block_hash) - set(bm.block_table("c")) and not bm.free_list
    bm.allocate_slots("d", list(range(70, 74)), 4)  # free list empty: evicts a1, the least recently freed
    assert bm.block_table("d") == [a1]
    assert bm.take_cached_prefix("x", list(range(5))) == 0
    assert bm.take_cached_prefix("y", list(range(10, 15))) == 4 and bm.block_table("y") == [b1]
    bm.check_invariants()


def test_free_puts_the_tail_in_the_lru_before_the_prefix():
    bm = BlockManager(5, BS)  # 4 usable
    prompt = list(range(12))
    bm.allocate_slots("a", prompt, 12)
    bm.free("a")
    bm.allocate_slots("b", [90], 1)  # the never-used block
    bm.allocate_slots("c", [91], 1)  # evicts a's last block first
    assert bm.take_cached_prefix("d", prompt + [0]) == 8


def test_prefix_caching_off_shares_nothing():
    bm = BlockManager(10, BS, enable_prefix_caching=False)
    prompt = list(range(10))
    bm.allocate_slots("a", prompt, 10)
    assert bm.take_cached_prefix("b", prompt) == 0
    bm.free("a")
    s = bm.stats()
    assert (s.num_cached, s.prefix_cache_queries, s.num_free) == (0, 0, 9) and not bm.evictable
    bm.check_invariants()


def test_chain_hash_is_stable_across_processes():
    # Loads the module file alone (the jaxpaged package imports JAX): a fresh interpreter, another hash salt.
    code = ("import importlib.util, sys; spec = importlib.util.spec_from_file_location('bm', sys.argv[1]); "
            "m = sys.modules['bm'] = importlib.util.module_from_spec(spec); spec.loader.exec_module(m); "
            "print(m.chain_hash(m.chain_hash(None, [1, 2, 3, 4]), [5, 6, 7, 8]).hex())")
    expected = chain_hash(chain_hash(None, [1, 2, 3, 4]), [5, 6, 7, 8]).hex()
    for seed in ("1", "2"):
        out = subprocess.run([sys.executable, "-c", code, block_manager.__file__], capture_output=True, text=True,
                             env={**os.environ, "PYTHONHASHSEED": seed}, check=True).stdout.strip()
        assert out == expected


# ---- copy-on-write ------------------------------------------------------------------------------------------------


def test_fork_then_append_copies_partly_filled_last_block():
    bm = BlockManager(20, BS)
    prompt = list(range(6))
    bm.allocate_slots("p", prompt, 6)
    bm.fork("p", "c")
    assert bm.block_table("c") == bm.block_table("p") and bm.num_tokens("c") == 6
    assert bm.stats().num_shared == 2
    assert bm.allocate_slots("c", prompt + [99], 7)
    (src, dst), = bm.pop_copies()
    assert src == bm.block_table("p")[1] and dst == bm.block_table("c")[1] and src != dst
    assert bm.block_table("c")[0] == bm.block_table("p")[0]  # the full block stays shared
    assert bm.allocate_slots("p", prompt + [98], 7)  # now alone on its block: no copy
    assert bm.pop_copies() == []
    assert bm.stats().cow_copies == 1
    bm.check_invariants()


def test_fork_of_a_full_last_block_appends_without_a_copy():
    bm = BlockManager(20, BS)
    prompt = list(range(8))
    bm.allocate_slots("p", prompt, 8)
    bm.fork("p", "c")
    assert bm.allocate_slots("c", prompt + [1], 9)
    assert bm.pop_copies() == [] and bm.block_table("c")[:2] == bm.block_table("p")
    assert len(bm.block_table("c")) == 3


def test_a_copy_of_a_pending_copy_reads_the_original():
    bm = BlockManager(20, BS)
    bm.allocate_slots("p", list(range(6)), 6)
    p2 = bm.block_table("p")[1]
    bm.fork("p", "c1")
    bm.allocate_slots("c1", list(range(7)), 7)  # c1 gets a copy d1 of p2
    d1 = bm.block_table("c1")[1]
    bm.fork("c1", "c2")
    bm.allocate_slots("c2", list(range(8)), 8)  # d1 is shared now: c2 copies it too, before d1 holds anything
    d2 = bm.block_table("c2")[1]
    # the runner reads every source before it writes any destination, so d2 must read p2, not the empty d1
    assert sorted(bm.pop_copies()) == sorted([(p2, d1), (p2, d2)])
    bm.check_invariants()


def test_freeing_a_copy_destination_before_the_step_drops_the_copy():
    bm = BlockManager(20, BS)
    bm.allocate_slots("p", list(range(6)), 6)
    bm.fork("p", "c")
    bm.allocate_slots("c", list(range(7)), 7)
    bm.free("c")
    assert bm.pop_copies() == []
    bm.check_invariants()


def test_reserved_slots_are_copied_only_when_written():
    bm = BlockManager(20, BS, reserve_tokens=16)  # the contiguous allocator: 4 blocks up front
    bm.allocate_slots("p", list(range(6)), 6)
    assert len(bm.block_table("p")) == 4
    bm.fork("p", "c")
    bm.allocate_slots("c", list(range(7)), 7)  # writes the shared partial block: a copy
    bm.allocate_slots("c", list(range(9)), 9)  # writes the shared, empty third block: a fresh one, no copy
    p, c = bm.block_table("p"), bm.block_table("c")
    assert [(x == y) for x, y in zip(p, c, strict=True)] == [True, False, False, True]
    assert bm.pop_copies() == [(p[1], c[1])] and bm.stats().cow_copies == 1
    bm.check_invariants()


def test_fork_refuses_a_child_that_already_has_slots():
    bm = BlockManager(20, BS)
    bm.allocate_slots("p", list(range(6)), 6)
    bm.allocate_slots("c", list(range(3)), 3)
    with pytest.raises(ValueError, match="child"):
        bm.fork("p", "c")


# ---- swapping -----------------------------------------------------------------------------------------------------


def test_swap_out_and_in_roundtrip_preserves_sharing():
    bm = BlockManager(10, BS, enable_prefix_caching=False, num_cpu_blocks=6)
    bm.allocate_slots("p", list(range(6)), 6)
    bm.fork("p", "c")
    bm.fork("p", "other")  # another request's sequence holding the same blocks (not in the group)
    assert bm.can_swap_out(["p", "c"])
    out = bm.swap_out(["p", "c"])
    assert sorted(d for d, _ in out) == sorted(bm.block_table("other"))  # shared blocks map to one host block each
    assert bm.is_swapped("p") and bm.is_swapped("c") and not bm.is_swapped("other")
    assert bm.block_table("p") == [] and bm.num_tokens("p") == 6
    assert used_refcounts(bm) == {b: 1 for b in bm.block_table("other")}  # they stay for "other"
    assert bm.stats().num_cpu_used == 2 and bm.stats().swapped_out_blocks == 2
    bm.check_invariants()
    back = bm.swap_in(["p", "c"])
    assert sorted(h for h, _ in back) == sorted(h for _, h in out)
    assert bm.block_table("p") == bm.block_table("c") == [d for _, d in back]
    assert not set(bm.block_table("p")) & set(bm.block_table("other"))
    assert all(bm.refcount[b] == 2 for b in bm.block_table("p"))
    s = bm.stats()
    assert (s.num_cpu_used, s.swapped_in_blocks, s.num_shared) == (0, 2, 2)
    assert not bm.is_swapped("p") and bm.num_tokens("c") == 6
    bm.check_invariants()


def test_swap_out_needs_room_in_the_host_pool():
    bm = BlockManager(10, BS, num_cpu_blocks=1)
    bm.allocate_slots("a", list(range(8)), 8)
    assert not bm.can_swap_out(["a"])
    with pytest.raises(NoFreeBlocksError):
        bm.swap_out(["a"])
    assert len(bm.block_table("a")) == 2 and not bm.is_swapped("a")
    bm.check_invariants()


def test_swap_in_needs_room_on_the_device():
    bm = BlockManager(4, BS, num_cpu_blocks=4)  # 3 usable
    bm.allocate_slots("a", list(range(8)), 8)
    bm.swap_out(["a"])
    bm.allocate_slots("b", list(range(50, 60)), 10)  # 3 blocks; a's cached blocks are evicted
    assert not bm.can_swap_in(["a"])
    with pytest.raises(NoFreeBlocksError):
        bm.swap_in(["a"])
    assert bm.is_swapped("a") and bm.stats().num_cpu_used == 2
    bm.free("b")
    assert bm.can_swap_in(["a"]) and len(bm.swap_in(["a"])) == 2
    bm.check_invariants()


def test_swapped_in_blocks_are_cached_again():
    bm = BlockManager(4, BS, num_cpu_blocks=4)  # 3 usable
    prompt = list(range(9))
    bm.allocate_slots("a", prompt, 9)
    bm.swap_out(["a"])
    bm.allocate_slots("b", list(range(50, 62)), 12)  # evicts a's cached device blocks
    bm.free("b")
    assert bm.take_cached_prefix("x", prompt) == 0
    bm.free("x")
    bm.swap_in(["a"])
    assert bm.take_cached_prefix("y", prompt) == 8 and bm.block_table("y") == bm.block_table("a")[:2]
    bm.check_invariants()


def test_swap_out_of_a_copy_destination_reads_its_source():
    bm = BlockManager(20, BS, num_cpu_blocks=4)
    bm.allocate_slots("p", list(range(6)), 6)
    bm.fork("p", "c")
    bm.allocate_slots("c", list(range(7)), 7)  # pending copy p2 -> d: d holds nothing until the copies run
    p1, p2 = bm.block_table("p")
    out = dict(bm.swap_out(["c"]))
    assert set(out) == {p1, p2}  # swap-outs run before the copies: d's content is read from p2
    assert bm.pop_copies() == []  # d was freed: its copy is void
    bm.check_invariants()


def test_swap_misuse_is_a_value_error():
    bm = BlockManager(10, BS, num_cpu_blocks=4)
    bm.allocate_slots("a", list(range(5)), 5)
    with pytest.raises(ValueError, match="not swapped"):
        bm.swap_in(["a"])
    bm.swap_out(["a"])
    assert not bm.can_swap_out(["a"])
    with pytest.raises(ValueError, match="already swapped"):
        bm.swap_out(["a"])
    with pytest.raises(ValueError, match="swapped out"):
        bm.allocate_slots("a", list(range(6)), 6)
    bm.free("a")  # frees the host blocks
    assert bm.stats().num_cpu_used == 0
    bm.check_invariants()


def test_check_invariants_catches_a_broken_pool():
    bm = BlockManager(10, BS)
    bm.allocate_slots("a", list(range(6)), 6)
    bm.check_invariants()
    bm.refcount[bm.block_table("a")[0]] += 1
    with pytest.raises(AssertionError, match="refcount"):
        bm.check_invariants()
    bm.refcount[bm.block_table("a")[0]] -= 1
    bm.free_list.append(bm.block_table("a")[1])
    with pytest.raises(AssertionError, match="block"):
        bm.check_invariants()


# ---- random operations against a model of what every block holds ----------------------------------------------------


@dataclasses.dataclass
class Seq:
    known: list[int]  # tokens the sequence knows (a chunked prompt is known before it has slots)
    alloc: int  # token slots it has (== BlockManager.num_tokens)
    written: int  # slots whose K/V the (modelled) device has written
    family: int  # the request: a sequence and everything forked from it


class PoolMachine(RuleBasedStateMachine):
    """Random allocate / append / fork / free / swap / cache-hit operations, executed on a model of the device.

    The calls between two `step`s are one engine step. `step` runs the returned copies as the engine does (swap-ins,
    swap-outs, copy-on-write as one gather-then-scatter, then the model writes every allocated slot) on a model of
    the tokens in every device and host block; blocks on a free list are blanked after each step. It then checks
    that every sequence reads its own tokens through its table and that a hash always names the same tokens.
    As the scheduler does, a step's swap-ins come before its allocations and swap-outs. With prefix caching on, only
    sequences whose slots are all written are freed or swapped out (blocks are hashed when allocated); with it off,
    any sequence may be, as a preempted one is, and its unwritten slots are simply never written.
    """

    NUM_BLOCKS, NUM_CPU_BLOCKS, CACHING, RESERVE = 12, 8, True, 0

    def __init__(self):
        super().__init__()
        self.bm = BlockManager(self.NUM_BLOCKS, BS, self.CACHING, self.NUM_CPU_BLOCKS, reserve_tokens=self.RESERVE)
        self.seqs: dict[int, Seq] = {}
        self.swapped: set[int] = set()
        self.history: list[list[int]] = [[0] * 9]  # prompts of freed sequences, for prefix hits
        self.dev: dict[int, list] = {}  # device block -> the token in each slot (None: nothing valid)
        self.cpu: dict[int, list] = {}  # host block -> the same
        self.swap_ins: list[tuple[int, int]] = []
        self.swap_outs: list[tuple[int, int]] = []
        self.busy = False  # something was allocated or swapped out since the last step: no swap-in now
        self.hash_tokens: dict[bytes, tuple] = {}
        self.next_id = 0

    def on_device(self) -> list[int]:
        return sorted(s for s in self.seqs if s not in self.swapped)

    def releasable(self) -> list[int]:
        return sorted(s for s, q in self.seqs.items() if not self.CACHING or q.written == q.alloc)

    def snapshot(self):
        return ({s: list(self.bm.block_table(s)) for s in self.seqs}, used_refcounts(self.bm), self.bm.stats())

    def draw_group(self, data, candidates: list[int]) -> list[int]:
        """A whole request's sequences still in `candidates`, or some of them."""
        seq = data.draw(st.sampled_from(candidates))
        kin = [s for s in candidates if self.seqs[s].family == self.seqs[seq].family]
        if data.draw(st.booleans()):
            return kin
        return data.draw(st.lists(st.sampled_from(kin), min_size=1, max_size=3, unique=True))

    @rule(data=st.data())
    def new_sequence(self, data):
        if data.draw(st.booleans()):  # share a prefix with an earlier prompt: cache hits
            base = data.draw(st.sampled_from(self.history + [q.known for q in self.seqs.values()]))
            prompt = base[:data.draw(st.integers(0, len(base)))] + data.draw(st.lists(st.integers(0, 2), max_size=6))
        else:
            prompt = data.draw(st.lists(st.integers(0, 2), min_size=1, max_size=14))
        prompt = prompt or [0]
        seq, self.next_id = self.next_id, self.next_id + 1
        hit = self.bm.take_cached_prefix(seq, prompt)
        assert hit % BS == 0 and hit <= (len(prompt) - 1) // BS * BS and (self.CACHING or hit == 0)
        self.seqs[seq] = Seq(list(prompt), hit, hit, seq)
        before = self.snapshot()
        num = hit + data.draw(st.integers(1, len(prompt) - hit))  # maybe a chunk of the prompt
        if self.bm.allocate_slots(seq, prompt, num):
            self.seqs[seq].alloc = num
            self.busy = True
        else:
            assert self.snapshot() == before, "a failed allocation changed the pool"
            self.bm.free(seq)  # gives back the prefix-hit blocks, as the scheduler does
            del self.seqs[seq]

    @precondition(lambda self: self.on_device())
    @rule(data=st.data(), chunk=st.integers(1, 6), token=st.integers(0, 2), all_known=st.booleans())
    def extend(self, data, chunk, token, all_known):
        seq = data.draw(st.sampled_from(self.on_device()))
        known_short_by = 0 if all_known else data.draw(st.integers(1, BS))
        self._extend(seq, chunk, token, known_short_by)

    def _extend(self, seq: int, chunk: int, token: int, known_short_by: int = 0) -> None:
        q = self.seqs[seq]
        if q.alloc < len(q.known):  # the rest of a chunked prompt
            num = min(len(q.known), q.alloc + chunk)
        else:  # one decoded token
            q.known.append(token)
            num = len(q.known)
        token_ids = q.known[:max(0, num - known_short_by)] if known_short_by else q.known
        before = self.snapshot()
        if self.bm.allocate_slots(seq, token_ids, num):
            q.alloc = num
            self.busy = True
        else:
            assert self.snapshot() == before, "a failed allocation changed the pool"

    @precondition(lambda self: self.on_device())
    @rule(data=st.data())
    def fork(self, data):
        self._fork(data.draw(st.sampled_from(self.on_device())))

    def _fork(self, parent: int) -> int:
        child, self.next_id = self.next_id, self.next_id + 1
        self.bm.fork(parent, child)
        q = self.seqs[parent]
        self.seqs[child] = Seq(list(q.known), q.alloc, q.written, q.family)
        return child

    @precondition(lambda self: self.on_device())
    @rule(data=st.data(), token=st.integers(0, 2))
    def fork_and_extend(self, data, token):
        """n > 1 as the scheduler runs it: fork, and the child at once writes a token of its own."""
        self._extend(self._fork(data.draw(st.sampled_from(self.on_device()))), 1, token)

    @precondition(lambda self: self.releasable())
    @rule(data=st.data())
    def free(self, data):
        seq = data.draw(st.sampled_from(self.releasable()))
        self.bm.free(seq)
        self.history = (self.history + [self.seqs.pop(seq).known])[-8:]
        self.swapped.discard(seq)

    @precondition(lambda self: set(self.releasable()) - self.swapped)
    @rule(data=st.data())
    def swap_out(self, data):
        group = self.draw_group(data, sorted(set(self.releasable()) - self.swapped))
        distinct = {b for s in group for b in self.bm.block_table(s)}
        if not self.bm.can_swap_out(group):
            assert len(distinct) > self.bm.stats().num_cpu_blocks - self.bm.stats().num_cpu_used
            return
        copies = self.bm.swap_out(group)
        assert len(copies) == len(distinct) and len({c for _, c in copies}) == len(copies)
        self.swap_outs += copies
        self.swapped |= set(group)
        self.busy = True

    @precondition(lambda self: self.swapped and not self.busy)
    @rule(data=st.data())
    def swap_in(self, data):
        group = self.draw_group(data, sorted(self.swapped))
        if self.bm.can_swap_in(group):
            self.swap_ins += self.bm.swap_in(group)
            self.swapped -= set(group)

    @rule()
    def step(self):
        blank = [None] * BS
        for c, d in self.swap_ins:
            self.dev[d] = list(self.cpu.get(c, blank))
        for d, c in self.swap_outs:
            self.cpu[c] = list(self.dev.get(d, blank))
        copies = self.bm.pop_copies()
        assert len({d for _, d in copies}) == len(copies) and all(0 not in pair for pair in copies)
        assert all(s != d for s, d in copies)
        sources = [list(self.dev.get(s, blank)) for s, _ in copies]  # all read before any is written
        for (_, d), content in zip(copies, sources, strict=True):
            self.dev[d] = content
        self.swap_ins, self.swap_outs, self.busy = [], [], False
        for seq in self.on_device():
            q, table = self.seqs[seq], self.bm.block_table(seq)
            for pos in range(q.written, q.alloc):
                self.dev.setdefault(table[pos // BS], list(blank))[pos % BS] = q.known[pos]
            q.written = q.alloc
        self.check_contents()
        # What sits on a free list holds nothing anyone may read: blank it, so reading it by mistake shows.
        for block in self.bm.free_list:
            self.dev[block] = list(blank)
        for block in self.bm.cpu_free:
            self.cpu[block] = list(blank)

    def check_contents(self):
        for seq, q in self.seqs.items():
            pool = self.cpu if seq in self.swapped else self.dev
            table = self.bm.cpu_tables[seq] if seq in self.swapped else self.bm.block_table(seq)
            held = [pool.get(table[p // BS], [None] * BS)[p % BS] for p in range(q.written)]
            assert held == q.known[:q.written], f"seq {seq} reads {held}, wrote {q.known[:q.written]}"
            parent = None  # a cached block's hash is the chain hash of the tokens it and its prefix hold
            for i in range(q.written // BS if seq not in self.swapped else 0):
                parent = chain_hash(parent, q.known[i * BS:(i + 1) * BS])
                assert self.bm.block_hash.get(table[i], parent) == parent, f"seq {seq}: block {i} has a wrong hash"
        for block, h in self.bm.block_hash.items():  # a hash always names the same tokens, whichever block holds it
            content = tuple(self.dev.get(block, [None] * BS))
            assert None not in content, f"cached block {block} was never fully written"
            assert self.hash_tokens.setdefault(h, content) == content, f"cached block {block} changed"

    @invariant()
    def pool_is_consistent(self):
        self.bm.check_invariants()
        reserved = self.RESERVE // BS
        for seq, q in self.seqs.items():
            assert self.bm.num_tokens(seq) == q.alloc and self.bm.is_swapped(seq) == (seq in self.swapped)
            if seq not in self.swapped:
                assert len(self.bm.block_table(seq)) == max(-(-q.alloc // BS), reserved)

    def teardown(self):
        self.step()
        for seq in list(self.seqs):
            self.bm.free(seq)
        self.bm.check_invariants()
        s = self.bm.stats()
        assert (s.num_used, s.num_free, s.num_cpu_used) == (0, self.NUM_BLOCKS - 1, 0)
        assert set(self.bm.free_list) | set(self.bm.evictable) == set(range(1, self.NUM_BLOCKS))
        assert self.bm.pop_copies() == []


class NoCachePoolMachine(PoolMachine):
    CACHING = False


class ReservingPoolMachine(PoolMachine):
    NUM_BLOCKS, RESERVE = 16, 8


STATEFUL = settings(max_examples=120, stateful_step_count=50, deadline=None)
TestPoolMachine = PoolMachine.TestCase
TestPoolMachine.settings = STATEFUL
TestNoCachePoolMachine = NoCachePoolMachine.TestCase
TestNoCachePoolMachine.settings = settings(STATEFUL, max_examples=80)
TestReservingPoolMachine = ReservingPoolMachine.TestCase
TestReservingPoolMachine.settings = settings(STATEFUL, max_examples=40)


def test_the_machine_sees_a_corrupted_shared_block():
    """The machine's model is not vacuous: a block shared by two sequences is read by both through their tables."""
    m = PoolMachine()
    m.bm.allocate_slots(0, [1, 2, 3, 4, 5], 5)
    m.seqs[0] = Seq([1, 2, 3, 4, 5], 5, 0, 0)
    m.step()
    m.bm.fork(0, 1)
    m.seqs[1] = Seq([1, 2, 3, 4, 5], 5, 5, 0)
    m.check_contents()
    m.dev[m.bm.block_table(1)[1]][0] = 9
    with pytest.raises(AssertionError, match="seq 0"):
        m.check_contents()
