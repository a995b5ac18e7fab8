"""A small GPT-2-like `nnx.Module` that is not in the package, for the bring-your-own-model tests
(tests/models/test_bring_your_own_model.py says what it makes visible): learned absolute position embeddings, LayerNorm
with biases, a plain GELU MLP, attention projections with biases, blocks in an `nnx.List`. Its attention is one call,
`attend(q, k, v)`: dense causal attention in its own forward pass, the engine's `attn` through the model contract."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from flax import nnx

from jaxpaged.models import ModelSpec

VOCAB, HIDDEN, HEADS, KV_HEADS, LAYERS, MAX_LEN = 96, 48, 6, 2, 3, 64
HEAD_DIM = HIDDEN // HEADS
NEW_TOKENS = 20


class Block(nnx.Module):
    def __init__(self, rngs: nnx.Rngs):
        self.ln1 = nnx.LayerNorm(HIDDEN, rngs=rngs)
        self.qkv = nnx.Linear(HIDDEN, (HEADS + 2 * KV_HEADS) * HEAD_DIM, rngs=rngs)
        self.proj = nnx.Linear(HEADS * HEAD_DIM, HIDDEN, rngs=rngs)
        self.ln2 = nnx.LayerNorm(HIDDEN, rngs=rngs)
        self.fc = nnx.Linear(HIDDEN, 4 * HIDDEN, rngs=rngs)
        self.out = nnx.Linear(4 * HIDDEN, HIDDEN, rngs=rngs)

    def __call__(self, x, attend):
        """x [T, H]; attend(q [T, Hq, D], k, v [T, Hkv, D]) -> [T, Hq, D] is the only thing that sees other tokens."""
        t = x.shape[0]
        q, k, v = jnp.split(self.qkv(self.ln1(x)), [HEADS * HEAD_DIM, (HEADS + KV_HEADS) * HEAD_DIM], axis=-1)
        out = attend(q.reshape(t, HEADS, HEAD_DIM), k.reshape(t, KV_HEADS, HEAD_DIM), v.reshape(t, KV_HEADS, HEAD_DIM))
        x = x + self.proj(out.reshape(t, HEADS * HEAD_DIM))
        return x + self.out(jax.nn.gelu(self.fc(self.ln2(x))))


class TinyGPT(nnx.Module):
    def __init__(self, rngs: nnx.Rngs):
        self.config = ModelSpec(vocab_size=VOCAB, num_layers=LAYERS, num_kv_heads=KV_HEADS, head_dim=HEAD_DIM,
                                max_position_embeddings=MAX_LEN)
        # Spread-out embeddings so greedy choices are not near ties
        self.wte = nnx.Embed(VOCAB, HIDDEN, embedding_init=nnx.initializers.normal(1.0), rngs=rngs)
        self.wpe = nnx.Embed(MAX_LEN, HIDDEN, embedding_init=nnx.initializers.normal(0.5), rngs=rngs)
        self.blocks = nnx.List([Block(rngs) for _ in range(LAYERS)])
        self.ln_f = nnx.LayerNorm(HIDDEN, rngs=rngs)
        self.head = nnx.Linear(HIDDEN, VOCAB, use_bias=False, kernel_init=nnx.initializers.normal(1.0), rngs=rngs)

    # -- the model contract (jaxpaged.models.contract) -------------------------------------------------------------
    def __call__(self, token_ids, kv_pool, md, attn):
        x = self.wte(token_ids) + self.wpe(jnp.maximum(md.positions, 0))  # padding tokens: position -1
        for i, block in enumerate(self.blocks):
            def paged(q, k, v, i=i):
                nonlocal kv_pool
                out, kv_pool = attn(q, k, v, kv_pool, i, md)
                return out

            x = block(x, paged)
        return x, kv_pool

    def logits(self, hidden):
        return self.head(self.ln_f(hidden)).astype(jnp.float32)

    # -- the model's own forward pass: one sequence, dense causal attention ------------------------------------------
    def dense_logits(self, token_ids):
        """token_ids [T] -> logits [T, V] float32; position t sees positions <= t."""
        t = token_ids.shape[0]
        x = self.wte(token_ids) + self.wpe(jnp.arange(t))
        for block in self.blocks:
            x = block(x, dense_causal_attention)
        return self.logits(x)


def dense_causal_attention(q, k, v):
    group = HEADS // KV_HEADS
    k, v = jnp.repeat(k, group, axis=1), jnp.repeat(v, group, axis=1)
    s = jnp.einsum("qhd,khd->hqk", q, k) / math.sqrt(HEAD_DIM)
    mask = jnp.tril(jnp.ones((q.shape[0], k.shape[0]), bool))
    return jnp.einsum("hqk,khd->qhd", jax.nn.softmax(jnp.where(mask, s, -jnp.inf), axis=-1), v)
