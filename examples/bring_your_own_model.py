"""Bring your own flax.nnx model: serve a module that is not in jaxpaged through the paged KV cache.

    python examples/bring_your_own_model.py

A model follows the contract of jaxpaged.models.contract: a `config` with the `ModelSpec` fields, `__call__(token_ids,
kv_pool, md, attn) -> (hidden, kv_pool)` and `logits(hidden)`. The one change from a plain model: attention is one
call, `attn(q, k, v, kv_pool, layer, md)`, which writes the new K/V into the paged pool and attends over each
sequence's history. Here a tiny GPT with random weights; the engine's greedy tokens equal its own dense forward pass.
"""

from types import SimpleNamespace

import jax
import jax.numpy as jnp
from flax import nnx

from jaxpaged import LLM, ModelSpec, SamplingParams

VOCAB, HIDDEN, HEADS, HEAD_DIM, LAYERS = 128, 64, 4, 16, 2


class TinyGPT(nnx.Module):
    def __init__(self, rngs: nnx.Rngs):
        # What the engine needs besides the forward pass: the KV pool's shape, the vocabulary, the context length.
        self.config = ModelSpec(vocab_size=VOCAB, num_layers=LAYERS, num_kv_heads=HEADS, head_dim=HEAD_DIM,
                                max_position_embeddings=256)
        self.embed = nnx.Embed(VOCAB, HIDDEN, embedding_init=nnx.initializers.normal(1.0), rngs=rngs)
        self.pos = nnx.Embed(256, HIDDEN, rngs=rngs)
        self.qkv = nnx.List([nnx.Linear(HIDDEN, 3 * HEADS * HEAD_DIM, rngs=rngs) for _ in range(LAYERS)])
        self.out = nnx.List([nnx.Linear(HEADS * HEAD_DIM, HIDDEN, rngs=rngs) for _ in range(LAYERS)])
        self.norm = nnx.LayerNorm(HIDDEN, rngs=rngs)
        self.head = nnx.Linear(HIDDEN, VOCAB, kernel_init=nnx.initializers.normal(1.0), rngs=rngs)

    def __call__(self, token_ids, kv_pool, md, attn):
        """token_ids [T] int32: the step's new tokens of all its sequences; md.positions [T] (-1 on padding)."""
        x = self.embed(token_ids) + self.pos(jnp.maximum(md.positions, 0))  # [T, HIDDEN]
        for i in range(LAYERS):
            q, k, v = jnp.split(self.qkv[i](x).reshape(-1, 3 * HEADS, HEAD_DIM), 3, axis=1)  # each [T, HEADS, D]
            out, kv_pool = attn(q, k, v, kv_pool, i, md)  # paged causal attention; the pool is passed on
            x = x + self.out[i](out.reshape(-1, HEADS * HEAD_DIM))
        return x, kv_pool

    def logits(self, hidden):
        return self.head(self.norm(hidden)).astype(jnp.float32)  # [S, VOCAB]


model = TinyGPT(nnx.Rngs(0))
# No tokenizer: prompts are token ids and outputs carry ids only. Options are engine options, as for LLM(...).
# precompile=False: compile each step shape when first used (the default compiles them all at start-up).
llm = LLM.from_model(model, tokenizer=None, dtype="float32", max_num_seqs=4, max_model_len=256, precompile=False)
prompts = [[5, 17, 42], [7, 7, 7, 7, 1, 2]]
params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)


def dense_greedy(prompt: list[int], n: int) -> list[int]:
    """The same model without the engine: full causal attention over the whole sequence, one token at a time."""
    def dense_attn(q, k, v, kv_pool, layer, md):
        scores = jnp.einsum("qhd,khd->hqk", q, k) / HEAD_DIM**0.5
        causal = jnp.tril(jnp.ones((len(q), len(k)), bool))
        return jnp.einsum("hqk,khd->qhd", jax.nn.softmax(jnp.where(causal, scores, -jnp.inf), -1), v), kv_pool

    seq = list(prompt)
    for _ in range(n):
        md = SimpleNamespace(positions=jnp.arange(len(seq)))  # all that the dense pass reads of md
        hidden, _ = model(jnp.array(seq), None, md, dense_attn)
        seq.append(int(model.logits(hidden[-1:])[0].argmax()))
    return seq[len(prompt):]


for prompt, out in zip(prompts, outputs, strict=True):
    tokens = out.outputs[0].token_ids
    print(f"prompt {prompt} -> {tokens} (dense forward agrees: {tokens == dense_greedy(prompt, len(tokens))})")
