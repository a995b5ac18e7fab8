"""Bring your own Flax model: an `nnx.Module` that is not in the package, served through `LLM.from_model`.

The model (tests/models/tiny_gpt.py) is a small GPT-2-like architecture built from Flax's own layers, deliberately
unlike the Llama family: learned absolute position embeddings (no RoPE), LayerNorm with biases, a plain GELU MLP,
attention projections with biases, blocks held in an `nnx.List` and run by a Python loop. Its attention is one call,
`attend(q, k, v)`, that the model's own dense forward pass fills with full causal attention and the engine's path
fills with the `attn` protocol: the adaptation docs/byo_model.md describes.

Through the engine (paged pool, batched ragged steps, preemption forced by a tiny pool) its greedy tokens and first
log-probs equal those of its own dense forward pass.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jaxpaged import LLM, SamplingParams
from jaxpaged.models import ModelSpec, check_model
from tests.models.tiny_gpt import MAX_LEN, NEW_TOKENS, VOCAB, TinyGPT


@pytest.fixture(scope="module")
def model():
    return TinyGPT(nnx.Rngs(7))


@pytest.fixture(scope="module")
def prompts():
    rng = np.random.default_rng(11)
    return [rng.integers(0, VOCAB, size=n).tolist() for n in (6, 15, 16, 11)]


def dense_greedy(model: TinyGPT, prompt: list[int], n: int) -> tuple[list[int], np.ndarray]:
    """Greedy tokens by the dense forward pass (one compiled shape: tokens padded at the end, which the causal mask
    hides from earlier positions), and the log-probs of the first one's distribution."""
    # float32 products on every platform, as the engine's float32 step (XLA GPU's default is TF32)
    forward = nnx.jit(lambda m, ids: m.dense_logits(ids))
    with jax.default_matmul_precision("highest"):
        return _dense_greedy(forward, model, prompt, n)


def _dense_greedy(forward, model: TinyGPT, prompt: list[int], n: int) -> tuple[list[int], np.ndarray]:
    seq, first = list(prompt), None
    for _ in range(n):
        ids = np.zeros(MAX_LEN, np.int32)
        ids[:len(seq)] = seq
        row = np.asarray(forward(model, jnp.asarray(ids))[len(seq) - 1], np.float64)
        if first is None:
            first = row - row.max() - np.log(np.exp(row - row.max()).sum())
        seq.append(int(row.argmax()))
    return seq[len(prompt):], first


def test_the_test_model_follows_the_contract(model):
    check_model(model)


def test_own_model_through_the_engine_equals_its_dense_forward(model, prompts):
    # 12 usable blocks of 8 tokens: the prompts (7 blocks) are admitted together, but 20 new tokens each need 18
    # blocks, so decoding runs the pool dry and preempts.
    llm = LLM.from_model(model, dtype="float32", max_num_seqs=4, max_num_batched_tokens=64, max_model_len=MAX_LEN,
                         block_size=8, num_blocks=13, precompile=False, show_progress=False)
    first = llm.generate([{"prompt_token_ids": p} for p in prompts],
                         SamplingParams(temperature=0.0, max_tokens=1, logprobs=5), use_tqdm=False)
    expected = [dense_greedy(model, p, NEW_TOKENS) for p in prompts]
    for out, (_, ref) in zip(first, expected, strict=True):
        for token, lp in out.outputs[0].logprobs[0].items():
            assert abs(lp.logprob - ref[token]) < 1e-4, (token, lp, ref[token])

    params = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)
    batched = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in batched] == [tokens for tokens, _ in expected]
    stats = llm.stats()
    assert stats["preemptions"] > 0, stats  # the tiny pool did force a request out and back in


def test_a_module_without_the_contract_is_refused_before_compiling():
    class NoLogits(nnx.Module):
        def __init__(self):
            self.config = ModelSpec(vocab_size=8, num_layers=1, num_kv_heads=1, head_dim=8)

    with pytest.raises(TypeError, match="logits"):
        LLM.from_model(NoLogits(), precompile=False)

    class NoSpec(nnx.Module):
        def logits(self, hidden):
            return hidden

    with pytest.raises(TypeError, match="num_layers"):
        LLM.from_model(NoSpec(), precompile=False)


def test_tensor_parallelism_refuses_an_own_module_by_name(model):
    """Only the built-in modules have a Megatron split (they hold the loader's layout); an own module at tp > 1 is a
    ValueError naming the option and the module (checked before anything is placed, so one device is enough)."""
    from jaxpaged.engine.setup import split_model_tensor_parallel
    from jaxpaged.parallel.tensor_parallel import make_mesh

    with pytest.raises(ValueError, match="tensor_parallel_size > 1 splits the built-in modules.*TinyGPT"):
        split_model_tensor_parallel(model, np.float32, make_mesh(1))
