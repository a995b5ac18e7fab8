"""The unrolled layer loop (`jaxpaged.worker.step.gpu_layer_loop` "unrolled", `jaxpaged.models.contract.layer_loop`):
on a CUDA GPU, decode-sized steps may unroll the layers so that XLA's GEMMs read static slices of the stacked weights
in place. Forced on here (on CPU the engine never unrolls), it changes nothing a user sees: the same greedy tokens
and log-probs as the rolled loop, for Llama and for Gemma 3 (whose loop runs over groups of layers and a tail);
the steps within the row limit compile without a while loop over the pool, larger ones keep it, and every step
still writes the donated pool in place."""

from __future__ import annotations

import re

import jax
import numpy as np
import pytest

from jaxpaged import LLM, SamplingParams
from jaxpaged.models import contract
from jaxpaged.worker import model_runner
from tests.hlo_checks import pool_copies
from tests.tiny import random_params, random_prompts, tiny_config, tiny_llm

ROWS = 16  # steps of at most this many tokens unroll: the decodes, not the prefills of these prompts


def llama():
    config = tiny_config(hidden=64, heads=4, kv_heads=2, head_dim=16, layers=3)
    return tiny_llm(config, random_params(config, seed=3))


def gemma3():
    from tests.models.gemma3_cases import engine_hf_model, ours

    config, params = ours(engine_hf_model("base"))
    return LLM.from_params(config, params, None, dtype="float32", max_num_seqs=4, max_num_batched_tokens=64,
                           max_model_len=64, block_size=8, num_blocks=48, precompile=False, show_progress=False)


def layer_loops(hlo: str, pool_shape: tuple[int, ...]) -> int:
    """While loops of a compiled step that carry the pool (the layer loop, or Gemma 3's loop over groups)."""
    dims = ",".join(map(str, pool_shape))
    return sum(1 for line in hlo.splitlines() if " while(" in line and f"[{dims}]" in line)


@pytest.mark.parametrize("build", [llama, gemma3], ids=["llama", "gemma3"])
def test_unrolled_steps_give_the_rolled_loops_tokens(monkeypatch, build):
    prompts = [{"prompt_token_ids": p} for p in random_prompts(3, 20, 30, seed=5)]
    greedy = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, logprobs=2)

    def run():
        llm = build()
        return llm, [o.outputs[0] for o in llm.generate(prompts, greedy, use_tqdm=False)]

    _, rolled = run()
    monkeypatch.setattr(model_runner, "gpu_layer_matmul_rows", lambda mesh: ROWS)
    monkeypatch.setattr(model_runner, "gpu_layer_loop", lambda: "unrolled")
    llm, unrolled = run()
    for a, b in zip(rolled, unrolled, strict=True):
        assert a.token_ids == b.token_ids
        for la, lb in zip(a.logprobs, b.logprobs, strict=True):
            assert la.keys() == lb.keys()
            assert [e.rank for e in la.values()] == [lb[t].rank for t in la]
            np.testing.assert_allclose([e.logprob for e in la.values()], [lb[t].logprob for t in la], rtol=1e-6,
                                       atol=1e-5)

    runner = llm.engine.runner
    n = len(jax.tree.leaves(runner.params))
    loops = {}
    for key, executable in runner._executables.items():
        hlo = executable.as_text()
        aliased = {int(p) for p in re.findall(r"\{\d+\}: \((\d+), \{\}", hlo.splitlines()[0])}
        assert {n, n + 1} <= aliased and pool_copies(hlo, runner.kv_pool.shape) == [], key
        loops[key] = layer_loops(hlo, runner.kv_pool.shape)
    assert 0 in loops.values() and any(loops.values()), loops  # decodes unrolled, the prefills not


def test_layer_loop_unrolls_only_within_the_row_limit():
    def count_whiles(rows: int) -> int:
        fn = jax.jit(lambda x: contract.layer_loop(4, lambda i, c: c * x + i, x, rows))
        return fn.lower(np.float32(1)).compile().as_text().count(" while(")

    assert count_whiles(8) == 1  # outside `unrolled_layers`
    with contract.unrolled_layers(8):
        assert count_whiles(8) == 0 and count_whiles(9) == 1
