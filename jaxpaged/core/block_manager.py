"""The KV block pool on the host: which physical block holds which tokens of which sequence.

Plain Python, no JAX: the device only ever sees block tables and slot numbers made from this bookkeeping.

- Blocks 0..num_blocks-1 live on the device; block 0 is the *null block*: never handed out, it is where padding
  tokens write their K/V, so a padded batch needs no special case on the device.
- Each block has a reference count: the number of sequence block tables that hold it (a table holding a block
  twice counts twice). Sequences of one request (parallel samples, beams) and requests with equal prefixes share
  blocks this way. A block is always exactly one of: on the free list, cached and evictable (refcount 0, still
  holding a prefix hash and its K/V), or in use (refcount > 0).
- Prefix caching: a block full of known tokens gets a hash that chains its parent block's hash with its token ids
  (sha256, stable across processes), so equal prefixes map to equal hashes. One block per hash: a second block
  with the same content stays unregistered. Hashes are registered when the slots are *allocated*, as vLLM v1 does;
  the step that follows writes the K/V, so a sequence must not be freed or swapped out in the same step after
  `allocate_slots` gave it new slots (the scheduler only preempts sequences it has not yet scheduled).
- LRU: a hashed block whose refcount drops to 0 joins an LRU of evictable blocks; a request with the same prefix
  takes it back (`take_cached_prefix`). Allocation takes the free list first and evicts the least recently freed
  cached block only when the free list is empty. `free` returns a table tail first, so a request's last blocks are
  evicted before its prefix, which other requests are likelier to share.
- Copy-on-write: writes only ever go past a sequence's last token, so only a shared, partly filled last block can
  be written by two owners; the first write moves the writer to a fresh block and records a (src, dst) copy for
  the device (`pop_copies`); a shared block with no tokens yet (`reserve_tokens`) just gets a fresh block.
  Pending copies stay correct when their blocks move within the step: a destination freed before the copy ran is
  dropped, a chain of copies reads the original, and swapping out a destination reads its source.
- Swap: whole request groups move to a host pool of `num_cpu_blocks` blocks and back; a block shared inside the
  group maps to one host block, so sharing survives the round trip.

The device side of one step runs the lists in this order: swap-ins (host -> device), swap-outs (device -> host),
copy-on-write copies (all sources read before any destination is written), then the model step. This is correct
when a step's `swap_in` calls come before its allocations and swap-outs, as the scheduler does.
"""

from __future__ import annotations

import dataclasses
import hashlib
from collections import Counter, OrderedDict, deque
from collections.abc import Iterable, Sequence

NULL_BLOCK = 0
_ROOT_HASH = hashlib.sha256(b"jaxpaged prefix cache root").digest()


class NoFreeBlocksError(RuntimeError):
    """The device or host pool has fewer free blocks than the operation needs."""


@dataclasses.dataclass
class BlockStats:
    num_blocks: int  # usable blocks (the null block excluded)
    num_free: int  # allocatable now: free list + evictable cached blocks
    num_used: int  # refcount > 0
    num_cached: int  # blocks holding a prefix-cache hash (any refcount)
    num_shared: int  # refcount > 1
    prefix_cache_queries: int  # prompt tokens looked up (every take_cached_prefix call counts its whole prompt)
    prefix_cache_hits: int  # prompt tokens found
    num_cpu_blocks: int
    num_cpu_used: int
    swapped_out_blocks: int  # cumulative
    swapped_in_blocks: int  # cumulative
    cow_copies: int  # cumulative


def chain_hash(parent: bytes | None, tokens: Sequence[int]) -> bytes:
    """The prefix-cache key of a full block: sha256 of its parent's key (None for the first block) and its tokens.

    Not Python's hash(): that is salted per process, and keys must agree across processes and hosts.
    """
    h = hashlib.sha256(_ROOT_HASH if parent is None else parent)
    h.update(",".join(str(int(t)) for t in tokens).encode())
    return h.digest()


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True,
                 num_cpu_blocks: int = 0, reserve_tokens: int = 0):
        if num_blocks < 2:
            raise ValueError(f"num_blocks={num_blocks} must be >= 2 (block 0 is the null block)")
        if block_size < 1:
            raise ValueError(f"block_size={block_size} must be >= 1")
        if num_cpu_blocks < 0 or reserve_tokens < 0:
            raise ValueError(f"num_cpu_blocks={num_cpu_blocks} and reserve_tokens={reserve_tokens} must be >= 0")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        # > 0 models the pre-PagedAttention allocator (benchmarks only): a sequence's first allocation reserves this
        # many token slots (max_model_len) up front, as systems that store the KV cache contiguously must.
        self.reserve_tokens = reserve_tokens
        # device pool
        self.free_list: deque[int] = deque(range(1, num_blocks))
        self.refcount = [0] * num_blocks
        self.evictable: OrderedDict[int, None] = OrderedDict()  # cached, refcount 0; least recently freed first
        self.hash_to_block: dict[bytes, int] = {}
        self.block_hash: dict[int, bytes] = {}
        self.pending_copies: dict[int, int] = {}  # dst -> src, copy-on-write not yet handed to the runner
        # sequences
        self.tables: dict = {}  # seq_id -> device blocks, logical order
        self.seq_tokens: dict = {}  # seq_id -> token slots allocated (kept while swapped out)
        self.seq_hashes: dict = {}  # seq_id -> chain hashes of its leading full, known blocks
        # seq_id -> the token count up to which the sequence may grow with nothing to allocate, copy or hash: the
        # end of the block it writes now, which it holds alone (short of filling it where full blocks get hashes).
        # Set by `allocate_slots`, dropped by whatever else changes the sequence's table. The scheduler's decode
        # loop reads it and advances `seq_tokens` and `num_device_tokens` itself for such a slot, without a call
        # (`Scheduler._schedule_decodes`): that loop runs for every running sequence at every step.
        self.writable: dict = {}
        # seq_id -> the first of its blocks kept out of the prefix cache (`withhold`): from there its K/V lacks what
        # some reader of the cache needs (a separate draft model's K/V, skipped in a step without the draft)
        self.withheld: dict = {}
        # host pool
        self.num_cpu_blocks = num_cpu_blocks
        self.cpu_free: deque[int] = deque(range(num_cpu_blocks))
        self.cpu_refcount = [0] * num_cpu_blocks
        self.cpu_tables: dict = {}  # seq_id -> host blocks of a swapped-out sequence
        self.counters = {"queries": 0, "hits": 0, "swapped_out": 0, "swapped_in": 0, "cow": 0}
        # Kept as they change, so stats() costs O(1) at every step, whatever the pool's size.
        self.num_used = 0  # blocks with refcount > 0
        self.num_shared = 0  # blocks with refcount > 1
        self.num_table_blocks = 0  # entries of the device block tables (a shared block once per holder)
        self.num_device_tokens = 0  # token slots the sequences on the device hold (seq_tokens, swapped ones not)
        # Sequences whose device block table changed since `pop_changed_tables` (the runner's persistent copy of
        # the tables is updated from these alone).
        self.changed_tables: set = set()

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
            raise NoFreeBlocksError(f"all {self.num_blocks - 1} KV blocks are in use")
        self.refcount[block] = 1
        self.num_used += 1
        return block

    def _ref(self, block: int) -> None:
        n = self.refcount[block]
        if n == 0:
            del self.evictable[block]  # a prefix-cache hit brings an evictable block back into use
            self.num_used += 1
        elif n == 1:
            self.num_shared += 1
        self.refcount[block] = n + 1

    def _unref(self, block: int) -> None:
        n = self.refcount[block] = self.refcount[block] - 1
        if n == 1:
            self.num_shared -= 1
        if n > 0:
            return
        self.num_used -= 1
        self.pending_copies.pop(block, None)  # nobody will read this copy's destination
        if block in self.block_hash:
            self.evictable[block] = None
        else:
            self.free_list.append(block)

    def _register(self, block: int, h: bytes) -> None:
        """Maps a full block to its chain hash unless that hash (or this block) is already mapped."""
        if h not in self.hash_to_block and block not in self.block_hash:
            self.hash_to_block[h] = block
            self.block_hash[block] = h

    def _record_copy(self, src: int, dst: int) -> None:
        # src may itself wait for a copy in this step: read from the block that holds the content now. That can be
        # dst itself (freed this step, still unchanged, handed out again): then there is nothing to copy.
        src = self.pending_copies.get(src, src)
        if src != dst:
            self.pending_copies[dst] = src
        self.counters["cow"] += 1

    # ---- sequences ----------------------------------------------------------------------------------------------

    def block_table(self, seq_id) -> list[int]:
        return self.tables.get(seq_id, [])

    def num_tokens(self, seq_id) -> int:
        return self.seq_tokens.get(seq_id, 0)

    def take_cached_prefix(self, seq_id, token_ids: Sequence[int]) -> int:
        """For a sequence with no slots yet: takes the longest cached chain of its full blocks; returns its tokens.

        Never the whole prompt: at most ((len - 1) // block_size) blocks, so at least one token runs to produce
        logits. Every call counts all of `token_ids` as queried (a request retried next step counts again, as in
        vLLM) and the returned tokens as hits. Returns 0 with prefix caching off.
        """
        if not self.enable_prefix_caching or self.tables.get(seq_id) or seq_id in self.cpu_tables:
            return 0
        self.counters["queries"] += len(token_ids)
        bs = self.block_size
        blocks, hashes = [], []
        for i in range((len(token_ids) - 1) // bs):
            h = chain_hash(hashes[-1] if hashes else None, token_ids[i * bs:(i + 1) * bs])
            block = self.hash_to_block.get(h)
            if block is None:
                break
            self._ref(block)
            blocks.append(block)
            hashes.append(h)
        self.tables[seq_id] = blocks
        self.seq_hashes[seq_id] = hashes
        self.seq_tokens[seq_id] = len(blocks) * bs
        self.num_table_blocks += len(blocks)
        self.num_device_tokens += len(blocks) * bs
        self.changed_tables.add(seq_id)
        self.counters["hits"] += len(blocks) * bs
        return len(blocks) * bs

    def allocate_slots(self, seq_id, token_ids: Sequence[int], num_tokens: int) -> bool:
        """Gives the sequence slots for its first `num_tokens` tokens; all or nothing. False: not enough blocks.

        `token_ids` are the sequence's known tokens (longer or shorter than `num_tokens`): every block that is
        full of slots and of known tokens gets its prefix hash registered.

        A decode's next slot in a block the sequence alone holds costs a few comparisons (the fast path below): it
        runs for every running sequence at every step.
        """
        table = self.tables.get(seq_id)
        have = self.seq_tokens.get(seq_id, 0)
        bs = self.block_size
        if table is not None and have < num_tokens <= len(table) * bs:
            last = (num_tokens - 1) // bs
            if last == have // bs and self.refcount[table[last]] == 1:
                # the new slots are in the block the sequence writes now, which it holds alone: nothing to allocate
                # or copy (a block that just filled with known tokens gets its prefix hash)
                self.seq_tokens[seq_id] = num_tokens
                self.num_device_tokens += num_tokens - have
                if self.enable_prefix_caching and num_tokens % bs == 0 and len(token_ids) >= num_tokens:
                    self._register_full_blocks(seq_id, token_ids)
                return True
        if num_tokens < 0:
            raise ValueError(f"num_tokens={num_tokens} must be >= 0")
        if seq_id in self.cpu_tables:
            raise ValueError(f"sequence {seq_id!r} is swapped out; swap_in before allocating")
        table = table if table is not None else []
        num_new = max(0, _cdiv(max(num_tokens, self.reserve_tokens), bs) - len(table))
        # The blocks this call writes into that other sequences also hold must be made private first.
        shared = [i for i in range(have // bs, min(_cdiv(num_tokens, bs), len(table)))
                  if self.refcount[table[i]] > 1] if num_tokens > have else []
        if num_new + len(shared) > self.num_free_blocks:
            return False
        for i in shared:
            src, table[i] = table[i], self._allocate()
            self._unref(src)
            if i * bs < have:  # it already holds some of this sequence's tokens: copy them
                self._record_copy(src, table[i])
        table.extend(self._allocate() for _ in range(num_new))
        self.tables[seq_id] = table
        self.seq_tokens[seq_id] = max(have, num_tokens)
        self.num_table_blocks += num_new
        self.num_device_tokens += max(have, num_tokens) - have
        if num_new or shared:
            self.changed_tables.add(seq_id)
        self.seq_hashes.setdefault(seq_id, [])
        if self.enable_prefix_caching:
            self._register_full_blocks(seq_id, token_ids)
        self._note_writable(seq_id, table)
        return True

    def _note_writable(self, seq_id, table: list[int]) -> None:
        """Records how far the sequence may grow in the block it writes now (`writable`), if it holds it alone."""
        bs = self.block_size
        i = self.seq_tokens[seq_id] // bs
        if i < len(table) and self.refcount[table[i]] == 1:
            self.writable[seq_id] = (i + 1) * bs - (1 if self.enable_prefix_caching else 0)
        else:
            self.writable.pop(seq_id, None)

    def cache_full_blocks(self, seq_id, token_ids: Sequence[int]) -> None:
        """Registers the prefix hashes of the sequence's blocks that are full of slots and of known tokens (before it
        is freed: a token that became known after its block's last allocation, as with asynchronous scheduling)."""
        if self.enable_prefix_caching and seq_id in self.tables:
            self._register_full_blocks(seq_id, token_ids)

    def _register_full_blocks(self, seq_id, token_ids: Sequence[int]) -> None:
        bs = self.block_size
        hashes, table = self.seq_hashes[seq_id], self.tables[seq_id]
        withheld = self.withheld.get(seq_id, len(table))
        for i in range(len(hashes), min(self.seq_tokens[seq_id], len(token_ids)) // bs):
            hashes.append(chain_hash(hashes[-1] if hashes else None, token_ids[i * bs:(i + 1) * bs]))
            if i < withheld:
                self._register(table[i], hashes[-1])

    def withhold(self, seq_id, from_token: int) -> None:
        """Keeps the sequence's blocks from the one holding token `from_token` out of the prefix cache: the K/V
        written there lacks what a reader of the cache needs (a separate draft model skipped those tokens, so a
        request finding them cached would draft from holes). Those registered already leave the cache (a sequence
        holding one already keeps it); those it fills later never join. Its earlier blocks stay cached."""
        first = from_token // self.block_size
        if self.withheld.get(seq_id, first + 1) <= first:
            return
        self.withheld[seq_id] = first
        table, hashes = self.tables.get(seq_id, []), self.seq_hashes.get(seq_id, [])
        for i in range(first, min(len(table), len(hashes))):
            if self.block_hash.get(table[i]) == hashes[i]:
                del self.hash_to_block[self.block_hash.pop(table[i])]

    def fork(self, parent_id, child_id) -> None:
        """The child shares every block of the parent (parallel samples, beams) and its token count."""
        if child_id in self.seq_tokens or child_id in self.tables or child_id in self.cpu_tables:
            raise ValueError(f"fork: child {child_id!r} already has slots; free it first")
        if parent_id in self.cpu_tables:
            raise ValueError(f"fork: parent {parent_id!r} is swapped out")
        table = list(self.tables.get(parent_id, []))
        for block in table:
            self._ref(block)
        self.writable.pop(parent_id, None)  # its last block is shared now: the next write copies it
        self.tables[child_id] = table
        self.seq_tokens[child_id] = self.seq_tokens.get(parent_id, 0)
        self.seq_hashes[child_id] = list(self.seq_hashes.get(parent_id, []))
        if parent_id in self.withheld:  # the same blocks, the same holes
            self.withheld[child_id] = self.withheld[parent_id]
        self.num_table_blocks += len(table)
        self.num_device_tokens += self.seq_tokens[child_id]
        self.changed_tables.add(child_id)

    def free(self, seq_id) -> None:
        """Returns the sequence's blocks (device or host). Unknown ids are a no-op."""
        self._drop_device_table(seq_id)
        for block in self.cpu_tables.pop(seq_id, []):
            self._cpu_unref(block)
        self.seq_tokens.pop(seq_id, None)
        self.seq_hashes.pop(seq_id, None)
        self.withheld.pop(seq_id, None)
        self.changed_tables.discard(seq_id)

    def _drop_device_table(self, seq_id) -> None:
        self.writable.pop(seq_id, None)
        table = self.tables.pop(seq_id, None)
        if table is None:
            return
        for block in reversed(table):  # the tail first: evicted before the prefix
            self._unref(block)
        self.num_table_blocks -= len(table)
        self.num_device_tokens -= self.seq_tokens.get(seq_id, 0)

    def forget_unwritten(self, seq_id, num_written_tokens: int) -> None:
        """Before freeing a sequence whose step failed: its blocks past `num_written_tokens` had their prefix
        hashes registered when their slots were allocated, but their K/V were never written. Blocks that only
        this sequence holds leave the prefix cache, so no later request can hit them."""
        table = self.tables.get(seq_id, [])
        for block in table[num_written_tokens // self.block_size:]:
            if self.refcount[block] == 1 and block in self.block_hash:
                del self.hash_to_block[self.block_hash.pop(block)]
        hashes = self.seq_hashes.get(seq_id)
        if hashes is not None:
            del hashes[num_written_tokens // self.block_size:]

    def truncate(self, seq_id, num_tokens: int) -> None:
        """Speculative decoding's rollback: the sequence keeps slots for its first `num_tokens` tokens only; blocks
        past them (they held rejected proposals, or slots allocated ahead for a draft) go back to the pool. No hash
        is lost: hashes are only ever registered for blocks full of tokens known and computed before them."""
        table = self.tables.get(seq_id)
        have = self.seq_tokens.get(seq_id, 0)
        if table is None or num_tokens >= have:
            return
        self.writable.pop(seq_id, None)
        keep = max(_cdiv(num_tokens, self.block_size), _cdiv(self.reserve_tokens, self.block_size))
        dropped = table[keep:]
        del table[keep:]
        for block in reversed(dropped):
            self._unref(block)
        self.seq_tokens[seq_id] = num_tokens
        self.num_table_blocks -= len(dropped)
        self.num_device_tokens -= have - num_tokens
        if dropped:
            self.changed_tables.add(seq_id)
        hashes = self.seq_hashes.get(seq_id)
        if hashes is not None:
            del hashes[num_tokens // self.block_size:]

    def pop_changed_tables(self) -> dict:
        """seq_id -> its device block table, for the sequences whose table changed since the last call (new,
        grown, copied on write, swapped in); a sequence freed or swapped out since then is not in it."""
        changed = {s: self.tables[s] for s in self.changed_tables if s in self.tables}
        self.changed_tables = set()
        return changed

    def pop_copies(self) -> list[tuple[int, int]]:
        """Copy-on-write (src, dst) device copies recorded since the last call; no dst repeats."""
        copies = [(src, dst) for dst, src in self.pending_copies.items()]
        self.pending_copies = {}
        return copies

    # ---- swap ---------------------------------------------------------------------------------------------------

    @staticmethod
    def _distinct(tables: Iterable[list[int]]) -> list[int]:
        return list(dict.fromkeys(b for t in tables for b in t))

    def can_swap_out(self, seq_ids: Iterable) -> bool:
        seq_ids = list(seq_ids)
        if any(s in self.cpu_tables for s in seq_ids):
            return False
        return len(self._distinct(self.block_table(s) for s in seq_ids)) <= len(self.cpu_free)

    def swap_out(self, seq_ids: Iterable) -> list[tuple[int, int]]:
        """Moves a group's blocks to the host pool; returns the (device block, host block) copies to make.

        Blocks that sequences outside the group also hold stay on the device for them (and get copied too).
        """
        seq_ids = list(dict.fromkeys(seq_ids))
        if any(s in self.cpu_tables for s in seq_ids):
            raise ValueError(f"swap_out: some of {seq_ids} are already swapped out")
        if not self.can_swap_out(seq_ids):
            raise NoFreeBlocksError(f"the host swap pool has {len(self.cpu_free)} free blocks; the group needs more")
        mapping = {b: self.cpu_free.popleft() for b in self._distinct(self.block_table(s) for s in seq_ids)}
        # A block still waiting for its copy-on-write copy has no content yet: read its source.
        copies = [(self.pending_copies.get(b, b), c) for b, c in mapping.items()]
        for s in seq_ids:
            self.cpu_tables[s] = [mapping[b] for b in self.block_table(s)]
            for c in self.cpu_tables[s]:
                self.cpu_refcount[c] += 1
            self._drop_device_table(s)
            self.seq_tokens.setdefault(s, 0)
        self.counters["swapped_out"] += len(mapping)
        return copies

    def is_swapped(self, seq_id) -> bool:
        return seq_id in self.cpu_tables

    def can_swap_in(self, seq_ids: Iterable, headroom: int = 0) -> bool:
        """Whether the swapped group fits on the device with `headroom` blocks still free after it."""
        seq_ids = list(seq_ids)
        if not all(s in self.cpu_tables for s in seq_ids):
            return False
        return len(self._distinct(self.cpu_tables[s] for s in seq_ids)) + headroom <= self.num_free_blocks

    def swap_in(self, seq_ids: Iterable) -> list[tuple[int, int]]:
        """Brings a swapped group back onto the device; returns the (host block, device block) copies to make."""
        seq_ids = list(dict.fromkeys(seq_ids))
        if not all(s in self.cpu_tables for s in seq_ids):
            raise ValueError(f"swap_in: some of {seq_ids} are not swapped out")
        if not self.can_swap_in(seq_ids):
            raise NoFreeBlocksError(f"{self.num_free_blocks} free device blocks are too few to swap the group in")
        mapping = {c: self._allocate() for c in self._distinct(self.cpu_tables[s] for s in seq_ids)}
        for s in seq_ids:
            self.tables[s] = [mapping[c] for c in self.cpu_tables[s]]
            for c in self.cpu_tables.pop(s):
                self._cpu_unref(c)
        for block, n in Counter(b for s in seq_ids for b in self.tables[s]).items():
            self.refcount[block] = n  # _allocate set 1; the group's own sharing makes it n
            self.num_shared += n > 1
        for s in seq_ids:
            self.num_table_blocks += len(self.tables[s])
            self.num_device_tokens += self.seq_tokens.get(s, 0)
            self.changed_tables.add(s)
        if self.enable_prefix_caching:  # same tokens, same hashes: cache the new blocks where nobody else is
            for s in seq_ids:
                hashes = self.seq_hashes.get(s, [])[:self.withheld.get(s)]
                for block, h in zip(self.tables[s], hashes, strict=False):
                    self._register(block, h)
        self.counters["swapped_in"] += len(mapping)
        return list(mapping.items())

    def _cpu_unref(self, block: int) -> bool:
        """Whether the block is free now."""
        self.cpu_refcount[block] -= 1
        if self.cpu_refcount[block] == 0:
            self.cpu_free.append(block)
            return True
        return False

    # ---- observability ------------------------------------------------------------------------------------------

    def stats(self) -> BlockStats:
        return BlockStats(
            num_blocks=self.num_blocks - 1, num_free=self.num_free_blocks,
            num_used=self.num_used, num_cached=len(self.block_hash), num_shared=self.num_shared,
            prefix_cache_queries=self.counters["queries"], prefix_cache_hits=self.counters["hits"],
            num_cpu_blocks=self.num_cpu_blocks, num_cpu_used=self.num_cpu_blocks - len(self.cpu_free),
            swapped_out_blocks=self.counters["swapped_out"], swapped_in_blocks=self.counters["swapped_in"],
            cow_copies=self.counters["cow"])

    def check_invariants(self) -> None:
        """Raises AssertionError describing the first broken invariant of the pool."""
        n, bs = self.num_blocks, self.block_size
        counts = Counter(b for t in self.tables.values() for b in t)
        assert all(0 < b < n for b in counts), f"a block table holds the null block or an id outside 1..{n - 1}"
        assert all(self.refcount[b] == counts[b] for b in range(n)), "refcounts differ from block-table references"
        free = list(self.free_list)
        assert all(0 < b < n for b in free), f"the free list holds the null block or an id outside 1..{n - 1}"
        assert len(free) == len(set(free)), "a block is twice in the free list"
        free_set, evictable = set(free), set(self.evictable)
        for block in range(1, n):
            places = (block in free_set) + (block in evictable) + (self.refcount[block] > 0)
            assert places == 1, f"block {block} is in {places} of free list / evictable cache / in use"
        assert NULL_BLOCK not in evictable and NULL_BLOCK not in self.block_hash, "the null block is cached"
        assert self.num_used == sum(1 for r in self.refcount if r > 0), "the used-block counter drifted"
        assert self.num_shared == sum(1 for r in self.refcount if r > 1), "the shared-block counter drifted"
        assert self.num_table_blocks == sum(map(len, self.tables.values())), "the table-entry counter drifted"
        assert self.num_device_tokens == sum(self.seq_tokens[s] for s in self.tables), "the token counter drifted"
        for s, end in self.writable.items():  # every slot up to `end` is in the block written now, held alone
            table, have = self.tables.get(s), self.seq_tokens.get(s, 0)
            assert table is not None, f"seq {s!r} has a writable end but no table"
            assert end <= have or ((end - 1) // bs == have // bs < len(table) and self.refcount[table[have // bs]] == 1
                                   and not (self.enable_prefix_caching and end % bs == 0)), \
                f"seq {s!r}: writable end {end} past its block ({have} slots, {len(table)} blocks)"
        assert evictable <= set(self.block_hash), "an evictable block has no hash"
        assert len(self.hash_to_block) == len(self.block_hash) and all(
            self.block_hash.get(b) == h for h, b in self.hash_to_block.items()), "hash maps disagree"
        for dst, src in self.pending_copies.items():
            assert self.refcount[dst] > 0 and 0 < src < n and src != dst, f"bad pending copy {src} -> {dst}"
        # sequences
        assert not (self.tables.keys() & self.cpu_tables.keys()), "a sequence is both on device and swapped out"
        assert self.seq_tokens.keys() == self.tables.keys() | self.cpu_tables.keys(), "token counts of unknown seqs"
        for s, tokens in self.seq_tokens.items():
            table = self.tables.get(s, self.cpu_tables.get(s))
            want = max(_cdiv(tokens, bs), _cdiv(self.reserve_tokens, bs) if self.reserve_tokens else 0)
            assert _cdiv(tokens, bs) <= len(table) <= want, f"seq {s!r}: {len(table)} blocks for {tokens} tokens"
            hashes = self.seq_hashes.get(s, [])
            assert len(hashes) <= tokens // bs, f"seq {s!r} has hashes for blocks it has not filled"
            if s in self.tables:
                for i, h in enumerate(hashes):
                    assert self.block_hash.get(table[i], h) == h, f"seq {s!r}: block {table[i]} has another hash"
        # host pool
        cpu_counts = Counter(b for t in self.cpu_tables.values() for b in t)
        assert all(self.cpu_refcount[b] == cpu_counts[b] for b in range(self.num_cpu_blocks)), \
            "host refcounts differ from host block-table references"
        cpu_free = list(self.cpu_free)
        assert len(cpu_free) == len(set(cpu_free)), "a host block is twice in the host free list"
        assert set(cpu_free) | set(cpu_counts) == set(range(self.num_cpu_blocks)) and not (
            set(cpu_free) & set(cpu_counts)), "host blocks leaked or both free and referenced"
