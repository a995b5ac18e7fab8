"""Gemma 3 through the engine: `Gemma3ForCausalLM` (jaxpaged.models.gemma3) over the paged pool on tiny random
models, against transformers' Gemma3ForCausalLM in float32 on CPU.

Seven layers of pattern (sliding, sliding, full): the module runs two groups of three in its `fori_loop` and one
sliding layer in the unrolled tail, so both paths and the pool index g * period + j are exercised. A window of 5
with 8-token blocks and prompts of up to 30 tokens: the window bites in prefill and in decode, across blocks.
Through the engine (batched ragged steps, prompts chunked by a 32-token budget, preemption forced by a 12-block
pool), first-token log-probs equal transformers' (< 1e-4) and 16 greedy tokens equal transformers' (each chosen by a
full forward pass over the sequence so far), with the reference attention backend and the native CPU kernel.
Every compiled step writes the pool in place.

(Greedy by full forward passes rather than `generate`: in the soft-capped, rope-scaled case transformers' own
`generate` with its KV cache picks another token than its full forward pass at one step where the top two logits
are 0.017 apart; the full forward pass, our dense reference and the engine agree.)
"""

from __future__ import annotations

import re

import jax
import numpy as np
import pytest
import torch
import transformers

from jaxpaged import LLM, SamplingParams
from jaxpaged.models import families, gemma3
from pallas_kernels.cpu_native import native
from tests.hlo_checks import pool_copies
from tests.models.gemma3_cases import CASES, engine_hf_model, ours

PROMPT_LENS = (9, 23, 30, 14)
NEW_TOKENS = 16
LOGPROB_ATOL = 1e-4


@pytest.fixture(scope="module", params=sorted(CASES))
def case(request):
    """(case name, transformers model, our config, our params, prompts, expected first log-probs [V] per prompt,
    expected greedy tokens per prompt)."""
    model = engine_hf_model(request.param)
    config, params = ours(model)
    rng = np.random.default_rng(5)
    prompts = [rng.integers(3, config.vocab_size, size=n).tolist() for n in PROMPT_LENS]
    first, greedy = [], []
    with torch.no_grad():
        for p in prompts:
            logits = model(torch.tensor([p])).logits[0, -1].double()
            first.append(torch.log_softmax(logits, -1).numpy())
            seq = list(p)
            for _ in range(NEW_TOKENS):  # full forward passes, no cache (see the module docstring)
                seq.append(int(model(torch.tensor([seq])).logits[0, -1].argmax()))
            greedy.append(seq[len(p):])
    return request.param, config, params, prompts, first, greedy


def test_the_groups_and_tail_of_the_layer_loop():
    config, params = ours(engine_hf_model("base"))
    assert gemma3.layer_period(config) == 3 and config.num_layers % 3 == 1
    assert isinstance(families.from_params(config, params), gemma3.Gemma3ForCausalLM)
    # Gemma 3's own pattern (5 sliding + 1 full) and its 1B depth (26 = 4 * 6 + 2)
    types = tuple(transformers.Gemma3TextConfig(num_hidden_layers=26).layer_types)
    assert gemma3.layer_period(type(config)(**{**config.__dict__, "num_layers": 26, "layer_types": types})) == 6


# The CPU's native kernel beside the reference; elsewhere the platform's default ('auto': Pallas on GPU / TPU).
BACKENDS = (["reference", "native"] if native.available("attention") else ["reference"]) if jax.default_backend() == \
    "cpu" else ["reference", "auto"]


@pytest.mark.parametrize("backend", BACKENDS)
def test_engine_equals_transformers(case, backend):
    name, config, params, prompts, first, greedy = case
    # 12 usable blocks of 8 tokens: the prompts need 11, and 16 new tokens each need 8 more, so decoding runs
    # the pool dry and preempts; a 32-token budget chunks the longer prompts.
    llm = LLM.from_params(config, params, None, dtype="float32", max_num_seqs=4, max_num_batched_tokens=32,
                          max_model_len=64, block_size=8, num_blocks=13, precompile=False, show_progress=False,
                          attention_backend=backend)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                        SamplingParams(temperature=0.0, max_tokens=1, logprobs=5), use_tqdm=False)
    for out, want in zip(outs, first, strict=True):
        top = out.outputs[0].logprobs[0]
        assert next(t for t, lp in top.items() if lp.rank == 1) == int(np.argmax(want))
        for token, lp in top.items():
            assert abs(lp.logprob - want[token]) < LOGPROB_ATOL, (name, backend, token, lp, want[token])

    sp = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], sp, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == greedy
    assert llm.stats()["preemptions"] > 0

    # Every compiled step (prefill and decode shapes) aliases the donated pool and copies no pool-sized array.
    runner = llm.engine.runner
    assert len(runner._executables) >= 2
    n = len(jax.tree.leaves(runner.params))
    for key, executable in runner._executables.items():
        hlo = executable.as_text()
        aliased = {int(p) for p in re.findall(r"\{\d+\}: \((\d+), \{\}", hlo.splitlines()[0])}
        assert {n, n + 1} <= aliased, key
        assert pool_copies(hlo, runner.kv_pool.shape) == [], key
