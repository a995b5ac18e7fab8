"""The host-side block pool: unit tests of each rule, and a hypothesis state machine over random operations."""

from __future__ import annotations

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from jaxpaged.block_manager import BlockManager, NoFreeBlocksError

BS = 4


def test_allocates_a_block_only_when_the_last_one_fills():
    bm = BlockManager(10, BS)
    assert bm.allocate_slots("a", list(range(5)), 5)
    assert len(bm.block_table("a")) == 2
    for n in (6, 7, 8):
        assert bm.allocate_slots("a", list(range(n)), n)
        assert len(bm.block_table("a")) == 2
    assert bm.allocate_slots("a", list(range(9)), 9)
    assert len(bm.block_table("a")) == 3
    assert 0 not in bm.block_table("a")  # the null block is never handed out
    bm.check_invariants()


def test_allocate_is_all_or_nothing():
    bm = BlockManager(4, BS)  # 3 usable blocks
    assert bm.allocate_slots("a", list(range(8)), 8)
    before = (bm.block_table("a"), bm.num_free_blocks)
    assert not bm.allocate_slots("b", list(range(12)), 12)
    assert bm.block_table("b") == [] and (bm.block_table("a"), bm.num_free_blocks) == before
    bm.check_invariants()


def test_prefix_cache_shares_full_blocks():
    bm = BlockManager(20, BS)
    prompt = list(range(10))  # 2 full blocks + 2 tokens
    bm.allocate_slots("a", prompt, 10)
    assert bm.take_cached_prefix("b", prompt) == 8
    assert bm.block_table("b") == bm.block_table("a")[:2]
    assert bm.stats().num_shared == 2
    bm.allocate_slots("b", prompt, 10)
    assert bm.block_table("b")[2] != bm.block_table("a")[2]  # the partly filled block is never shared by hash
    s = bm.stats()
    assert (s.prefix_cache_queries, s.prefix_cache_hits) == (10, 8)
    bm.check_invariants()


@pytest.mark.parametrize("length, hit", [(8, 4), (9, 8), (12, 8), (13, 12)])
def test_prefix_hit_never_covers_the_whole_prompt(length, hit):
    bm = BlockManager(20, BS)
    tokens = list(range(100, 116))
    bm.allocate_slots("a", tokens, 16)
    assert bm.take_cached_prefix("b", tokens[:length]) == hit


def test_prefix_chain_hash_depends_on_the_parent():
    bm = BlockManager(20, BS)
    bm.allocate_slots("a", [1, 2, 3, 4, 5, 6, 7, 8, 9], 9)
    # same second block, different first block: no hit at all
    assert bm.take_cached_prefix("b", [0, 2, 3, 4, 5, 6, 7, 8, 9]) == 0


def test_freed_cached_blocks_are_reused_and_evicted_lru_only_when_free_list_is_empty():
    bm = BlockManager(6, BS)  # 5 usable
    bm.allocate_slots("a", list(range(8)), 8)  # blocks of a: cached
    bm.free("a")
    s = bm.stats()
    assert s.num_free == 5 and s.num_cached == 2 and s.num_used == 0
    assert bm.take_cached_prefix("b", list(range(9))) == 8  # still there after free
    bm.free("b")
    bm.allocate_slots("c", list(range(50, 62)), 12)  # 3 blocks: the free list suffices, cache untouched
    assert bm.stats().num_cached == 2 + 3
    bm.allocate_slots("d", list(range(70, 78)), 8)  # 2 more: must evict both cached blocks of "a"
    assert bm.take_cached_prefix("e", list(range(9))) == 0
    bm.check_invariants()


def test_fork_then_append_copies_partly_filled_last_block():
    bm = BlockManager(20, BS)
    prompt = list(range(6))
    bm.allocate_slots("p", prompt, 6)
    bm.fork("p", "c")
    assert bm.block_table("c") == bm.block_table("p")
    assert bm.allocate_slots("c", prompt + [99], 7)
    (src, dst), = bm.pop_copies()
    assert src == bm.block_table("p")[1] and dst == bm.block_table("c")[1] and src != dst
    assert bm.block_table("c")[0] == bm.block_table("p")[0]  # the full block stays shared
    assert bm.allocate_slots("p", prompt + [98], 7)  # now alone on its block: no copy
    assert bm.pop_copies() == []
    assert bm.stats().cow_copies == 1
    bm.check_invariants()


def test_swap_out_and_in_roundtrip_preserves_sharing():
    bm = BlockManager(10, BS, enable_prefix_caching=False, num_cpu_blocks=6)
    bm.allocate_slots("p", list(range(6)), 6)
    bm.fork("p", "c")
    assert bm.can_swap_out(["p", "c"])
    out = bm.swap_out(["p", "c"])
    assert len(out) == 2 and bm.is_swapped("p") and bm.stats().num_used == 0
    bm.check_invariants()
    back = bm.swap_in(["p", "c"])
    assert len(back) == 2
    assert bm.block_table("p") == bm.block_table("c") and bm.stats().num_shared == 2
    assert bm.stats().num_cpu_used == 0
    bm.check_invariants()


def test_swap_out_needs_room_in_the_host_pool():
    bm = BlockManager(10, BS, num_cpu_blocks=1)
    bm.allocate_slots("a", list(range(8)), 8)
    assert not bm.can_swap_out(["a"])
    with pytest.raises(NoFreeBlocksError):
        bm.swap_out(["a"])


class PoolMachine(RuleBasedStateMachine):
    """Random allocate / append / fork / free / swap / cache-hit sequences against a model of block contents."""

    def __init__(self):
        super().__init__()
        self.bm = BlockManager(12, BS, enable_prefix_caching=True, num_cpu_blocks=8)
        self.tokens: dict[int, list[int]] = {}  # seq -> its tokens (those with slots)
        self.swapped: set[int] = set()
        self.next_id = 0
        self.content: dict[int, tuple] = {}  # block -> (hash, tokens it holds) of cached blocks seen referenced

    def live(self):
        return [s for s in self.tokens if s not in self.swapped]

    @rule(length=st.integers(1, 14), vocab=st.integers(1, 3))
    def new_sequence(self, length, vocab):
        seq, self.next_id = self.next_id, self.next_id + 1
        toks = [i % vocab for i in range(length)]  # small vocabularies make prefix hits common
        hit = self.bm.take_cached_prefix(seq, toks)
        assert hit % BS == 0 and hit < length
        if self.bm.allocate_slots(seq, toks, length):
            self.tokens[seq] = toks
        else:
            self.bm.free(seq)

    @precondition(lambda self: self.live())
    @rule(data=st.data(), token=st.integers(0, 2))
    def append(self, data, token):
        seq = data.draw(st.sampled_from(self.live()))
        toks = self.tokens[seq] + [token]
        if self.bm.allocate_slots(seq, toks, len(toks)):
            self.tokens[seq] = toks

    @precondition(lambda self: self.live())
    @rule(data=st.data())
    def fork(self, data):
        parent = data.draw(st.sampled_from(self.live()))
        child, self.next_id = self.next_id, self.next_id + 1
        self.bm.fork(parent, child)
        self.tokens[child] = list(self.tokens[parent])

    @precondition(lambda self: self.tokens)
    @rule(data=st.data())
    def free(self, data):
        seq = data.draw(st.sampled_from(sorted(self.tokens)))
        self.bm.free(seq)
        del self.tokens[seq]
        self.swapped.discard(seq)

    @precondition(lambda self: self.live())
    @rule(data=st.data())
    def swap_out(self, data):
        seq = data.draw(st.sampled_from(self.live()))
        if self.bm.can_swap_out([seq]):
            self.bm.swap_out([seq])
            self.swapped.add(seq)

    @precondition(lambda self: self.swapped)
    @rule(data=st.data())
    def swap_in(self, data):
        seq = data.draw(st.sampled_from(sorted(self.swapped)))
        if self.bm.can_swap_in([seq]):
            self.bm.swap_in([seq])
            self.swapped.discard(seq)

    @rule()
    def copy_on_write_targets_are_fresh(self):
        for src, dst in self.bm.pop_copies():
            assert src != dst and dst != 0

    @invariant()
    def pool_is_consistent(self):
        self.bm.check_invariants()
        for seq in self.live():
            assert len(self.bm.block_table(seq)) == -(-len(self.tokens[seq]) // BS)

    @invariant()
    def cached_block_content_never_changes_while_referenced(self):
        """A block keeps the tokens it was hashed from for as long as it carries that hash and is referenced."""
        for seq in self.live():
            for i, block in enumerate(self.bm.block_table(seq)):
                h = self.bm.block_hash.get(block)
                if h is None:
                    continue
                chunk = tuple(self.tokens[seq][i * BS:(i + 1) * BS])
                if self.content.get(block, (None,))[0] == h:
                    assert self.content[block][1] == chunk, f"cached block {block} changed"
                self.content[block] = (h, chunk)

    def teardown(self):
        for seq in list(self.tokens):
            self.bm.free(seq)
        self.bm.check_invariants()
        s = self.bm.stats()
        assert s.num_used == 0 and s.num_free == 11 and s.num_cpu_used == 0


TestPoolMachine = PoolMachine.TestCase
TestPoolMachine.settings = settings(max_examples=150, stateful_step_count=40, deadline=None)
