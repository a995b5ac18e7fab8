"""A picture of the KV pool for people: which block holds what, by state and by owning request, in bounded size.

Host Python only. It reads a `BlockManager` (refcounts, free list, evictable LRU, block tables) and must run where
that is safe: on the thread that owns the engine, between steps (`Engine.pool_view`).

Each cell is one block, or for a pool larger than `max_cells` a run of `blocks_per_cell` consecutive blocks
summarised by their most common state (ties go to the busier state) and the most common owner among its in-use
blocks. Device block 0, the null block, is never shown.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping

from jaxpaged.core.block_manager import BlockManager

FREE, USED, SHARED, CACHED = 0, 1, 2, 3  # device blocks
HOST_FREE, SWAPPED = 0, 4  # host (swap) blocks
STATE_NAMES = {FREE: "free", USED: "used", SHARED: "shared", CACHED: "cached", SWAPPED: "swapped"}
MAX_CELLS = 4096
NO_OWNER = -1
# When a downsampled cell's blocks split evenly, show the state that says more about load.
_PRIORITY = {SHARED: 4, SWAPPED: 4, USED: 3, CACHED: 2, FREE: 1}


def _cells(states: list[int], owners: list[int], max_cells: int) -> dict:
    n = len(states)
    per_cell = max(1, -(-n // max_cells))
    if per_cell == 1:
        return {"blocks_per_cell": 1, "state": list(states), "owner": list(owners)}
    cell_states, cell_owners = [], []
    for start in range(0, n, per_cell):
        counts = Counter(states[start:start + per_cell])
        cell_states.append(max(counts, key=lambda s: (counts[s], _PRIORITY[s])))
        held = Counter(o for o in owners[start:start + per_cell] if o != NO_OWNER)
        cell_owners.append(held.most_common(1)[0][0] if held else NO_OWNER)
    return {"blocks_per_cell": per_cell, "state": cell_states, "owner": cell_owners}


def pool_view(bm: BlockManager, seq_owner: Mapping, max_cells: int = MAX_CELLS) -> dict:
    """The pool as cells: `device` and `host` each hold `state` (codes in STATE_NAMES) and `owner` (an index into
    the caller's request list, or -1) per cell, `blocks_per_cell`, `downsampled` and per-state block counts.

    `seq_owner` maps a sequence id to its request's index; blocks of sequences it lacks count as owned by nobody.
    A block several requests hold (a shared prefix) is shown as its first holder's.
    """
    if not isinstance(max_cells, int) or isinstance(max_cells, bool) or not 1 <= max_cells <= MAX_CELLS:
        raise ValueError(f"max_cells={max_cells!r} must be an integer in [1, {MAX_CELLS}]")
    n = bm.num_blocks
    owners = [NO_OWNER] * n
    for seq_id, table in bm.tables.items():
        owner = seq_owner.get(seq_id, NO_OWNER)
        for block in table:
            if owners[block] == NO_OWNER:
                owners[block] = owner
    evictable = bm.evictable
    states = [FREE] * n
    for block in range(1, n):
        ref = bm.refcount[block]
        states[block] = SHARED if ref > 1 else USED if ref == 1 else CACHED if block in evictable else FREE
    host_owners = [NO_OWNER] * bm.num_cpu_blocks
    for seq_id, table in bm.cpu_tables.items():
        owner = seq_owner.get(seq_id, NO_OWNER)
        for block in table:
            if host_owners[block] == NO_OWNER:
                host_owners[block] = owner
    host_states = [SWAPPED if r > 0 else HOST_FREE for r in bm.cpu_refcount]

    def side(st: list[int], ow: list[int], kinds: tuple[int, ...]) -> dict:
        cells = _cells(st, ow, max_cells)
        counts = Counter(st)
        return {"num_blocks": len(st), "downsampled": cells["blocks_per_cell"] > 1, **cells,
                "counts": {STATE_NAMES[k]: counts.get(k, 0) for k in kinds}}

    return {"block_size": bm.block_size, "states": {str(k): v for k, v in STATE_NAMES.items()},
            "device": side(states[1:], owners[1:], (FREE, USED, SHARED, CACHED)),
            "host": side(host_states, host_owners, (HOST_FREE, SWAPPED))}


__all__ = ["CACHED", "FREE", "MAX_CELLS", "NO_OWNER", "SHARED", "STATE_NAMES", "SWAPPED", "USED", "pool_view"]
