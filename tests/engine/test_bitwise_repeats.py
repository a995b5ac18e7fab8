"""Same bits however a sequence's tokens were cut into steps, in bfloat16: a prompt after a prefix-cache hit, a prompt
prefilled in small chunks, and a sequence recomputed after preemption give the tokens and log-probs (exactly) of a
plain run. The native CPU kernel runs prompt tokens in query tiles and generated tokens one at a time whatever the
step (its `prompt_lens`), and its tiles' rows do not change each other's sums; float32 runs are checked elsewhere
(test_memory_sharing.py, test_scheduler.py). Between batch sizes (the last test) bfloat16 keeps its bits where its
matmuls run natively; float32 keeps its tokens (XLA's CPU matmuls sum in another order for other row counts)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jaxpaged import LLM, SamplingParams
from jaxpaged.models.matmul import native_matmul
from pallas_kernels.cpu_native import native
from tests.tiny import random_params, random_prompts, tiny_config

pytestmark = pytest.mark.skipif(not native.available("attention"),
                                reason=f"native CPU kernel unavailable: {native.unavailable_reason('attention')}")

# head_dim 64 and bfloat16: the kernel's AVX512_BF16 paths where the CPU has them
CONFIG = tiny_config(hidden=64, heads=6, kv_heads=2, head_dim=64, layers=2)
PARAMS = random_params(CONFIG, seed=4)
GREEDY = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True, logprobs=2)
SEEDED = SamplingParams(temperature=1.0, max_tokens=10, ignore_eos=True, logprobs=2, seed=7)


def make_llm(**kw) -> LLM:
    opts = dict(dtype="bfloat16", attention_backend="native", max_num_seqs=8, max_num_batched_tokens=256,
                max_model_len=128, block_size=8, num_blocks=120, precompile=False, show_progress=False,
                enable_prefix_caching=False)
    return LLM.from_params(CONFIG, PARAMS, None, **(opts | kw))


def results(outs):
    """Each output's tokens and log-probs (chosen and top), as plain values compared exactly."""
    return [[(c.token_ids, [sorted(d.items()) for d in c.logprobs]) for c in o.outputs]
            for o in outs]


@pytest.fixture(scope="module")
def prompts():
    prefix = random_prompts(1, 37, 37, seed=21)[0]
    tails = random_prompts(5, 1, 19, seed=22)
    return [{"prompt_token_ids": prefix + t} for t in tails] + [{"prompt_token_ids": prefix[:33]}]


@pytest.fixture(scope="module")
def plain(prompts):
    """One prompt at a time, no cache, whole prompts in one step."""
    llm = make_llm()
    return {p.seed: [results(llm.generate([q], p, use_tqdm=False))[0] for q in prompts] for p in (GREEDY, SEEDED)}


@pytest.mark.parametrize("params", [GREEDY, SEEDED], ids=["greedy", "seeded"])
def test_a_prefix_cache_hit_gives_the_same_bits(prompts, plain, params):
    llm = make_llm(enable_prefix_caching=True)
    llm.generate(prompts[:1], params, use_tqdm=False)  # the shared prefix cached; its tail is computed again below
    got = [results(llm.generate([q], params, use_tqdm=False))[0] for q in prompts]
    assert llm.stats()["prefix_cache_hits"] >= 4 * 8 * len(prompts)
    assert got == plain[params.seed]


def test_a_prompt_in_small_chunks_gives_the_same_bits(prompts, plain):
    llm = make_llm(max_num_batched_tokens=16, max_num_seqs=2)  # chunks of varying size, beside other requests
    assert results(llm.generate(prompts, GREEDY, use_tqdm=False)) == plain[GREEDY.seed]
    assert llm.stats()["prefill_steps"] >= sum(len(q["prompt_token_ids"]) for q in prompts) // 16


def test_a_recomputed_sequence_gives_the_same_bits(prompts, plain):
    llm = make_llm(num_blocks=16, max_num_seqs=6, max_model_len=96)  # 15 usable blocks of 8 slots, 6 requests
    assert results(llm.generate(prompts, GREEDY, use_tqdm=False)) == plain[GREEDY.seed]
    stats = llm.stats()
    assert stats["preemptions_recompute"] > 0
    llm.engine.block_manager.check_invariants()


# SmolLM2's vocabulary size. (At a 96- or 512-token vocabulary XLA's CPU log-softmax sums a row in another order
# when the step has few rows, S x V under ~4096 elements: a toy model's log-probs differ in their last bits there.)
BIG_VOCAB = tiny_config(hidden=64, heads=6, kv_heads=2, head_dim=64, layers=2, vocab_size=49152)


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_a_request_alone_and_among_70_others(dtype):
    """Decode batches of 73 rows beside the same requests alone. bfloat16 where its matmuls run natively: the same
    bits, tokens and log-probs (every matmul, norm and attention row sums the same way whatever the batch). float32:
    the same tokens (XLA's CPU matmuls sum in another order past 64 rows, so log-probs may differ in their last
    bits)."""
    bitwise = dtype == "bfloat16" and native.matmul_is_fast()
    config = BIG_VOCAB if bitwise else CONFIG  # tokens alone need no real vocabulary (and compile faster)
    llm = LLM.from_params(config, random_params(config, seed=6), None, dtype=dtype, max_num_seqs=80,
                          max_num_batched_tokens=512, max_model_len=128, block_size=8, num_blocks=700,
                          precompile=False, show_progress=False, enable_prefix_caching=False)
    mine = [{"prompt_token_ids": p} for p in random_prompts(3, 20, 40, seed=24)]
    params = [GREEDY, SEEDED, SamplingParams(temperature=0.7, top_p=0.8, max_tokens=8, seed=3, ignore_eos=True,
                                             logprobs=2)]
    alone = [results(llm.generate([p], q, use_tqdm=False))[0] for p, q in zip(mine, params, strict=True)]
    others = [{"prompt_token_ids": p} for p in random_prompts(70, 5, 40, seed=25)]
    mixed = [SamplingParams(temperature=0.8, max_tokens=10, ignore_eos=True, seed=i) for i in range(70)]
    outs = llm.generate(others[:40] + mine[:1] + others[40:60] + mine[1:] + others[60:],
                        mixed[:40] + params[:1] + mixed[40:60] + params[1:] + mixed[60:], use_tqdm=False)
    together = results([outs[40], outs[61], outs[62]])
    if bitwise:
        assert together == alone
    else:
        assert [t[0][0] for t in together] == [a[0][0] for a in alone]
    assert llm.stats()["num_used"] == 0


def test_the_lm_heads_rows_keep_their_bits_whatever_the_other_rows():
    """The LM head's final norm too: at SmolLM2's width, with a few residual dimensions far larger than the rest (as
    real models have), XLA's fused norm sums a row's squares in an order that depends on the step's row count, so a
    row's logits could change in their last bits beside others (the fuzzing that found it: a greedy request's
    log-probs alone and among 4 others, at one step of 60: benchmarks/batch_invariance.py). Natively every row sums
    the same way. The engine's own model (head prepacked), its logits for 512 such rows, 16 at a time against one at
    a time."""
    if not native.matmul_is_fast():
        pytest.skip("bfloat16 matmuls are not native on this CPU: its steps are not bitwise batch invariant")
    config = tiny_config(hidden=576, heads=9, kv_heads=3, head_dim=64, layers=1, vocab_size=2048)
    llm = LLM.from_params(config, random_params(config, seed=8), None, dtype="bfloat16", max_model_len=64,
                          num_blocks=16, precompile=False, show_progress=False)
    runner = llm.engine.runner
    model = nnx.merge(runner.graphdef, runner.params)

    @jax.jit
    def logits(h):
        with native_matmul(16, live_rows=(h.shape[0], jnp.int32(h.shape[0]))):
            return model.logits(h)

    rng = np.random.default_rng(9)
    h = rng.standard_normal((512, 576)) * 15
    h[:, :3] *= 30  # outlier dimensions
    h = jnp.asarray(h, jnp.bfloat16)
    one = np.concatenate([np.asarray(logits(h[i:i + 1])) for i in range(512)])
    sixteen = np.concatenate([np.asarray(logits(h[i:i + 16])) for i in range(0, 512, 16)])
    np.testing.assert_array_equal(one, sixteen)
