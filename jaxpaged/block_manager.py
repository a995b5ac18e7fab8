"""The KV block pool on the host: which physical block holds which tokens of which sequence.

Plain Python, no JAX: the device only ever sees block tables and slot numbers made from this bookkeeping.

- Blocks 0..num_blocks-1 live on the device; block 0 is the *null block*: never handed out, it is where padding
  tokens write their K/V, so a padded batch needs no special case on the device.
- Each block has a reference count: the number of sequence block tables that hold it. Sequences of one request
  (parallel samples, beams) and requests with equal prefixes share blocks this way.
- Prefix caching: a block full of known tokens gets a hash that chains its parent block's hash with its token
  ids, so equal prefixes map to equal hashes. A block whose refcount drops to 0 keeps its hash and its K/V in an
  LRU of *evictable* cached blocks: a later request with the same prefix takes it back; allocation evicts the
  least recently freed one only when the free list is empty.
- Copy-on-write: writes only ever go past a sequence's last token, so only a shared, partly filled last block can
  be written by two owners; the first write copies it (a (src, dst) pair the runner copies on device).
- Swap: whole request groups move to a host pool of `num_cpu_blocks` blocks and back, sharing preserved.
"""

from __future__ import annotations

import dataclasses
import hashlib
from collections import OrderedDict, deque


class NoFreeBlocksError(RuntimeError):
    pass


@dataclasses.dataclass
class BlockStats:
    num_blocks: int  # usable blocks (the null block excluded)
    num_free: int  # allocatable now: free list + evictable cached blocks
    num_used: int  # refcount > 0
    num_cached: int  # blocks holding a prefix-cache hash (any refcount)
    num_shared: int  # refcount > 1
    prefix_cache_queries: int  # prompt tokens looked up
    prefix_cache_hits: int  # prompt tokens found
    num_cpu_blocks: int
    num_cpu_used: int
    swapped_out_blocks: int  # cumulative
    swapped_in_blocks: int  # cumulative
    cow_copies: int  # cumulative


def chain_hash(parent: bytes | None, tokens: tuple[int, ...]) -> bytes:
    """Stable across processes (unlike hash()): sha256 of the parent's hash and the block's token ids."""
    h = hashlib.sha256(parent or b"root")
    h.update(",".join(map(str, tokens)).encode())
    return h.digest()


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True,
                 num_cpu_blocks: int = 0, reserve_tokens: int = 0):
        if num_blocks < 2:
            raise ValueError(f"num_blocks={num_blocks} must be >= 2 (block 0 is the null block)")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        # > 0 models the pre-PagedAttention allocator (benchmarks only): a sequence's first allocation reserves this
        # many token slots (max_model_len) up front, as systems that store the KV cache contiguously must.
        self.reserve_tokens = reserve_tokens
        self.free_list: deque[int] = deque(range(1, num_blocks))
        self.refcount = [0] * num_blocks
        self.evictable: OrderedDict[int, None] = OrderedDict()  # cached, refcount 0; oldest first
        self.hash_to_block: dict[bytes, int] = {}
        self.block_hash: dict[int, bytes] = {}
        self.tables: dict[int, list[int]] = {}  # seq_id -> device blocks
        self.seq_tokens: dict[int, int] = {}  # seq_id -> token slots allocated
        self.seq_hashes: dict[int, list[bytes]] = {}  # seq_id -> hashes of its leading full blocks
        self.pending_copies: list[tuple[int, int]] = []
        # host pool
        self.num_cpu_blocks = num_cpu_blocks
        self.cpu_free: deque[int] = deque(range(num_cpu_blocks))
        self.cpu_tables: dict[int, list[int]] = {}
        self.cpu_refcount = [0] * num_cpu_blocks
        self.counters = {"queries": 0, "hits": 0, "swapped_out": 0, "swapped_in": 0, "cow": 0}

    # ---- pool primitives ----------------------------------------------------------------------------------------

    @property
    def num_free_blocks(self) -> int:
        return len(self.free_list) + len(self.evictable)

    def _allocate(self) -> int:
        if self.free_list:
            block = self.free_list.popleft()
        elif self.evictable:
            block, _ = self.evictable.popitem(last=False)  # the least recently freed cached block
            del self.hash_to_block[self.block_hash.pop(block)]
        else:
            raise NoFreeBlocksError("the KV pool has no free block")
        self.refcount[block] = 1
        return block

    def _ref(self, block: int) -> None:
        if self.refcount[block] == 0:
            self.evictable.pop(block)  # a cache hit brings it back into use
        self.refcount[block] += 1

    def _unref(self, block: int) -> None:
        self.refcount[block] -= 1
        if self.refcount[block] == 0:
            if block in self.block_hash:
                self.evictable[block] = None
            else:
                self.free_list.append(block)

    # ---- sequences ----------------------------------------------------------------------------------------------

    def block_table(self, seq_id) -> list[int]:
        return self.tables.get(seq_id, [])

    def num_tokens(self, seq_id) -> int:
        return self.seq_tokens.get(seq_id, 0)

    def take_cached_prefix(self, seq_id, token_ids: list[int]) -> int:
        """For a sequence with no blocks yet: takes the longest cached chain of its full blocks; returns tokens.

        Never the whole prompt: at least one token must run to produce logits. Queries count the prompt's tokens.
        """
        if not self.enable_prefix_caching or self.tables.get(seq_id):
            return 0
        self.counters["queries"] += len(token_ids)
        bs = self.block_size
        parent, blocks, hashes = None, [], []
        for i in range((len(token_ids) - 1) // bs):
            h = chain_hash(parent, tuple(token_ids[i * bs:(i + 1) * bs]))
            block = self.hash_to_block.get(h)
            if block is None:
                break
            self._ref(block)
            blocks.append(block)
            hashes.append(h)
            parent = h
        self.tables[seq_id] = blocks
        self.seq_hashes[seq_id] = hashes
        self.seq_tokens[seq_id] = len(blocks) * bs
        self.counters["hits"] += len(blocks) * bs
        return len(blocks) * bs

    def allocate_slots(self, seq_id, token_ids: list[int], num_tokens: int) -> bool:
        """Gives the sequence slots for its first `num_tokens` tokens; all or nothing. False: not enough blocks."""
        table = self.tables.setdefault(seq_id, [])
        have = self.seq_tokens.setdefault(seq_id, 0)
        self.seq_hashes.setdefault(seq_id, [])
        bs = self.block_size
        needed = -(-max(num_tokens, self.reserve_tokens) // bs) - len(table)
        cow = num_tokens > have and have % bs != 0 and self.refcount[table[-1]] > 1
        if needed + cow > self.num_free_blocks:
            return False
        if cow:  # the shared, partly filled last block is about to be written: copy it
            src = table[-1]
            dst = self._allocate()
            self._unref(src)
            table[-1] = dst
            self.pending_copies.append((src, dst))
            self.counters["cow"] += 1
        for _ in range(max(needed, 0)):
            table.append(self._allocate())
        self.seq_tokens[seq_id] = max(have, num_tokens)
        self._cache_full_blocks(seq_id, token_ids)
        return True

    def _cache_full_blocks(self, seq_id, token_ids: list[int]) -> None:
        """Registers the hashes of the sequence's blocks that are full of known tokens."""
        if not self.enable_prefix_caching:
            return
        bs = self.block_size
        hashes, table = self.seq_hashes[seq_id], self.tables[seq_id]
        full = min(self.seq_tokens[seq_id], len(token_ids)) // bs
        for i in range(len(hashes), full):
            h = chain_hash(hashes[-1] if hashes else None, tuple(token_ids[i * bs:(i + 1) * bs]))
            hashes.append(h)
            block = table[i]
            if h not in self.hash_to_block and block not in self.block_hash:
                self.hash_to_block[h] = block
                self.block_hash[block] = h

    def fork(self, parent_id, child_id) -> None:
        """The child shares every block of the parent (parallel samples, beams)."""
        table = list(self.tables.get(parent_id, []))
        for block in table:
            self._ref(block)
        self.tables[child_id] = table
        self.seq_tokens[child_id] = self.seq_tokens.get(parent_id, 0)
        self.seq_hashes[child_id] = list(self.seq_hashes.get(parent_id, []))

    def free(self, seq_id) -> None:
        """Returns the sequence's blocks (device or host). Unknown ids are a no-op."""
        for block in reversed(self.tables.pop(seq_id, [])):  # the tail first: evicted before the prefix
            self._unref(block)
        for block in self.cpu_tables.pop(seq_id, []):
            self._cpu_unref(block)
        self.seq_tokens.pop(seq_id, None)
        self.seq_hashes.pop(seq_id, None)

    def pop_copies(self) -> list[tuple[int, int]]:
        copies, self.pending_copies = self.pending_copies, []
        return copies

    # ---- swap ---------------------------------------------------------------------------------------------------

    def _distinct(self, tables: list[list[int]]) -> list[int]:
        return list(dict.fromkeys(b for t in tables for b in t))

    def can_swap_out(self, seq_ids) -> bool:
        return len(self._distinct([self.tables.get(s, []) for s in seq_ids])) <= len(self.cpu_free)

    def swap_out(self, seq_ids) -> list[tuple[int, int]]:
        """Moves the group's blocks to the host pool; returns (device block, host block) copies to make."""
        if not self.can_swap_out(seq_ids):
            raise NoFreeBlocksError("the host swap pool is full")
        mapping = {b: self.cpu_free.popleft() for b in self._distinct([self.tables[s] for s in seq_ids])}
        for s in seq_ids:
            self.cpu_tables[s] = [mapping[b] for b in self.tables[s]]
            for block in self.cpu_tables[s]:
                self.cpu_refcount[block] += 1
            for block in self.tables.pop(s):
                self._unref(block)
        self.counters["swapped_out"] += len(mapping)
        return list(mapping.items())

    def is_swapped(self, seq_id) -> bool:
        return seq_id in self.cpu_tables

    def can_swap_in(self, seq_ids) -> bool:
        return len(self._distinct([self.cpu_tables.get(s, []) for s in seq_ids])) <= self.num_free_blocks

    def swap_in(self, seq_ids) -> list[tuple[int, int]]:
        """Brings the group back onto the device; returns (host block, device block) copies to make."""
        if not self.can_swap_in(seq_ids):
            raise NoFreeBlocksError("not enough free device blocks to swap in")
        mapping = {c: self._allocate() for c in self._distinct([self.cpu_tables[s] for s in seq_ids])}
        refs: dict[int, int] = {}
        for s in seq_ids:
            self.tables[s] = [mapping[c] for c in self.cpu_tables[s]]
            for c in self.cpu_tables.pop(s):
                refs[mapping[c]] = refs.get(mapping[c], 0) + 1
                self._cpu_unref(c)
        for block, n in refs.items():
            self.refcount[block] = n  # _allocate set 1; the group's own sharing makes it n
        for s in seq_ids:  # swapped-in blocks carry no hash: they were new blocks
            self.seq_hashes[s] = []
        self.counters["swapped_in"] += len(mapping)
        return list(mapping.items())

    def _cpu_unref(self, block: int) -> None:
        self.cpu_refcount[block] -= 1
        if self.cpu_refcount[block] == 0:
            self.cpu_free.append(block)

    # ---- observability ------------------------------------------------------------------------------------------

    def stats(self) -> BlockStats:
        used = sum(1 for r in self.refcount if r > 0)
        return BlockStats(
            num_blocks=self.num_blocks - 1, num_free=self.num_free_blocks, num_used=used,
            num_cached=len(self.block_hash), num_shared=sum(1 for r in self.refcount if r > 1),
            prefix_cache_queries=self.counters["queries"], prefix_cache_hits=self.counters["hits"],
            num_cpu_blocks=self.num_cpu_blocks, num_cpu_used=self.num_cpu_blocks - len(self.cpu_free),
            swapped_out_blocks=self.counters["swapped_out"], swapped_in_blocks=self.counters["swapped_in"],
            cow_copies=self.counters["cow"])

    def check_invariants(self) -> None:
        """Raises AssertionError describing the first broken invariant of the pool."""
        counts = [0] * self.num_blocks
        for table in self.tables.values():
            for block in table:
                counts[block] += 1
        assert counts[0] == 0 and self.refcount[0] == 0, "the null block is in use"
        assert counts == self.refcount, "refcounts differ from the number of block-table references"
        free = list(self.free_list)
        assert len(free) == len(set(free)), "a block is twice in the free list"
        free_set, evictable = set(free), set(self.evictable)
        for block in range(1, self.num_blocks):
            places = (block in free_set) + (block in evictable) + (self.refcount[block] > 0)
            assert places == 1, f"block {block} is in {places} of free list / evictable cache / in use"
        assert all(b in self.block_hash for b in evictable), "an evictable block has no hash"
        assert not (free_set & set(self.block_hash)), "a free-list block still carries a hash"
        assert {b: h for h, b in self.hash_to_block.items()} == self.block_hash, "hash maps disagree"
        cpu_counts = [0] * self.num_cpu_blocks
        for table in self.cpu_tables.values():
            for block in table:
                cpu_counts[block] += 1
        assert cpu_counts == self.cpu_refcount, "host refcounts differ from host block-table references"
        assert len(self.cpu_free) + sum(1 for r in self.cpu_refcount if r > 0) == self.num_cpu_blocks, \
            "host blocks leaked"
