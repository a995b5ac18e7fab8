"""`pool_view`: the watch page's picture of the KV pool, checked against BlockManager states built by hand, and
`Engine.pool_view` on a tiny model (the requests that own the cells)."""

from __future__ import annotations

import json

import pytest

from jaxpaged.core.block_manager import BlockManager
from jaxpaged.core.pool_view import CACHED, FREE, MAX_CELLS, NO_OWNER, SHARED, SWAPPED, USED, pool_view

BS = 4


def cells(view: dict) -> list[tuple[int, int]]:
    d = view["device"]
    return list(zip(d["state"], d["owner"], strict=True))


def test_an_empty_pool_is_all_free_and_hides_the_null_block():
    bm = BlockManager(9, BS)
    view = pool_view(bm, {})
    assert view["device"]["num_blocks"] == 8
    assert cells(view) == [(FREE, NO_OWNER)] * 8
    assert view["device"]["counts"] == {"free": 8, "used": 0, "shared": 0, "cached": 0}
    assert view["device"]["blocks_per_cell"] == 1 and not view["device"]["downsampled"]


def test_used_blocks_carry_their_sequences_owner():
    bm = BlockManager(9, BS, enable_prefix_caching=False)
    assert bm.allocate_slots("a", list(range(6)), 6)  # 2 blocks
    assert bm.allocate_slots("b", list(range(3)), 3)  # 1 block
    view = pool_view(bm, {"a": 0, "b": 1})
    by_block = dict(zip(range(1, 9), cells(view), strict=True))
    for block in bm.block_table("a"):
        assert by_block[block] == (USED, 0)
    (b_block,) = bm.block_table("b")
    assert by_block[b_block] == (USED, 1)
    assert view["device"]["counts"] == {"free": 5, "used": 3, "shared": 0, "cached": 0}


def test_forked_blocks_are_shared_and_a_cow_block_is_private():
    bm = BlockManager(9, BS, enable_prefix_caching=False)
    assert bm.allocate_slots("p", list(range(6)), 6)
    bm.fork("p", "c")
    assert bm.allocate_slots("c", list(range(7)), 7)  # writes into the shared partial block: copy-on-write
    view = pool_view(bm, {"p": 0, "c": 0})
    states = {b: s for b, (s, _) in zip(range(1, 9), cells(view), strict=True)}
    first, p_last = bm.block_table("p")
    c_last = bm.block_table("c")[1]
    assert states[first] == SHARED and states[p_last] == USED and states[c_last] == USED
    assert view["device"]["counts"]["shared"] == 1


def test_finished_prefix_blocks_are_cached_until_evicted():
    bm = BlockManager(5, BS)  # 4 usable blocks
    prompt = list(range(9))  # 2 full blocks + 1 partial
    assert bm.allocate_slots("a", prompt, 9)
    full = bm.block_table("a")[:2]
    bm.free("a")
    view = pool_view(bm, {})
    states = {b: s for b, (s, _) in zip(range(1, 5), cells(view), strict=True)}
    assert [states[b] for b in full] == [CACHED, CACHED]
    assert view["device"]["counts"] == {"free": 2, "used": 0, "shared": 0, "cached": 2}
    # a request with the same prefix takes them back into use
    assert bm.take_cached_prefix("b", prompt) == 8
    view = pool_view(bm, {"b": 3})
    states = {b: (s, o) for b, (s, o) in zip(range(1, 5), cells(view), strict=True)}
    assert [states[b] for b in full] == [(USED, 3), (USED, 3)]


def test_swapped_sequences_show_in_the_host_pool():
    bm = BlockManager(9, BS, enable_prefix_caching=False, num_cpu_blocks=4)
    assert bm.allocate_slots("a", list(range(6)), 6)
    bm.swap_out(["a"])
    view = pool_view(bm, {"a": 2})
    assert view["device"]["counts"]["used"] == 0
    host = view["host"]
    assert host["num_blocks"] == 4 and host["counts"] == {"free": 2, "swapped": 2}
    assert sorted(zip(host["state"], host["owner"], strict=True)) == [(0, NO_OWNER)] * 2 + [(SWAPPED, 2)] * 2


def test_a_large_pool_is_downsampled_to_at_most_max_cells():
    bm = BlockManager(100_001, 16, enable_prefix_caching=False)
    tokens = 16 * 60_000
    assert bm.allocate_slots("big", [0] * tokens, tokens)  # blocks 1..60000 in use
    view = pool_view(bm, {"big": 0}, max_cells=MAX_CELLS)
    d = view["device"]
    assert d["downsampled"] and len(d["state"]) <= MAX_CELLS and len(d["owner"]) == len(d["state"])
    assert d["blocks_per_cell"] * len(d["state"]) >= 100_000
    per = d["blocks_per_cell"]
    # cells wholly inside the used range are used by "big", cells wholly past it are free
    assert d["state"][0] == USED and d["owner"][0] == 0
    assert d["state"][60_000 // per - 1] == USED and d["state"][60_000 // per + 1] == FREE
    assert d["counts"] == {"free": 40_000, "used": 60_000, "shared": 0, "cached": 0}
    assert len(json.dumps(view)) < 64_000  # bounded however large the pool
    small = pool_view(bm, {"big": 0}, max_cells=10)["device"]
    assert len(small["state"]) == 10 and small["state"][:6] == [USED] * 6 and small["state"][6:] == [FREE] * 4


@pytest.mark.parametrize("bad", [0, -1, MAX_CELLS + 1, 2.0, True, "7"])
def test_max_cells_out_of_range_is_refused(bad):
    with pytest.raises(ValueError, match="max_cells"):
        pool_view(BlockManager(4, BS), {}, max_cells=bad)


def test_engine_pool_view_names_the_requests_that_own_blocks(tiny_hf_model):
    from jaxpaged import LLM, SamplingParams

    llm = LLM(model=tiny_hf_model("llama"), max_model_len=64, block_size=8, kv_cache_memory="1MiB", precompile=False)
    engine = llm.engine
    params = SamplingParams(n=2, max_tokens=8, temperature=1.0, seed=0, ignore_eos=True)
    engine.add_request("r0", {"prompt_token_ids": list(range(3, 23))}, params)  # 20 tokens: 3 blocks
    engine.add_request("r1", {"prompt_token_ids": list(range(30, 35))}, SamplingParams(max_tokens=8, ignore_eos=True))
    for _ in range(3):
        engine.step()
    view = engine.pool_view()
    ids = [r["id"] for r in view["requests"]]
    assert ids == ["r0", "r1"]
    owners = {o for s, o in cells(view) if s in (USED, SHARED)}
    assert owners == {0, 1}
    assert view["device"]["counts"]["shared"] >= 2  # r0's two samples share their full prompt blocks
    assert view["requests"][0]["num_seqs"] == 2 and view["num_running"] == 3
    while engine.has_unfinished_requests():
        engine.step()
    view = engine.pool_view()
    assert view["requests"] == [] and view["device"]["counts"]["used"] == 0
    assert view["device"]["counts"]["cached"] >= 2  # the finished prompts' full blocks stay as cached prefixes
