"""The Llama-family decoder (Llama 2/3, Mistral, Qwen2, SmolLM2) as a pure function over a paged KV pool.

Parameters are a plain pytree (see `jaxpaged.loader` for the layout: weights stored as x @ W, per-layer tensors
stacked on a leading layer axis). One call runs a ragged batch of new tokens (prefill chunks or decodes) through
all layers, writing their K/V into the pool at `slot_mapping` and attending through the block tables.

Layers run in a `fori_loop` that carries the pool, so the pool is updated in place: returning it from a `scan` or
stacking per-layer outputs would copy the whole pool every step (see shared/PALLAS_NOTES.md).
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np

from jaxpaged.attention import AttentionBackend, AttentionMetadata, KVPool
from jaxpaged.config import ModelConfig


def rope_inv_freq(config: ModelConfig) -> np.ndarray:
    """[head_dim // 2] float32 inverse frequencies, with HF's rope scaling rules ('linear', 'llama3')."""
    dim = config.head_dim
    inv_freq = 1.0 / (config.rope_theta ** (np.arange(0, dim, 2, dtype=np.float64) / dim))
    scaling = config.rope_scaling or {}
    kind = scaling.get("rope_type", scaling.get("type", "default"))
    if kind == "default":
        pass
    elif kind == "linear":
        inv_freq = inv_freq / scaling["factor"]
    elif kind == "llama3":
        factor = scaling["factor"]
        low, high = scaling.get("low_freq_factor", 1.0), scaling.get("high_freq_factor", 4.0)
        old_len = scaling["original_max_position_embeddings"]
        low_wavelen, high_wavelen = old_len / low, old_len / high
        wavelen = 2 * math.pi / inv_freq
        scaled = np.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
        smooth = (old_len / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
        inv_freq = np.where(medium, smoothed, scaled)
    else:
        raise ValueError(f"rope_scaling type {kind!r} is not supported; supported: default, linear, llama3")
    return inv_freq.astype(np.float32)


def _matmul(x: jax.Array, w: jax.Array) -> jax.Array:
    """x @ w accumulated in float32 (as GPU and TPU matrix units do for 16-bit inputs), returned in x's dtype."""
    return jnp.dot(x, w, preferred_element_type=jnp.float32).astype(x.dtype)


def _rms_norm(x: jax.Array, weight: jax.Array, eps: float) -> jax.Array:
    # As Hugging Face does: normalise in float32, cast back, then scale.
    xf = x.astype(jnp.float32)
    xf = xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + eps)
    return weight * xf.astype(x.dtype)


def _rope(x: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
    """x [T, H, D]; cos, sin [T, 1, D/2] float32. HF convention: rotate the two halves."""
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half].astype(jnp.float32), x[..., half:].astype(jnp.float32)
    out = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
    return out.astype(x.dtype)


def forward(params: dict, token_ids: jax.Array, kv_pool: KVPool, md: AttentionMetadata, attn: AttentionBackend, *,
            config: ModelConfig) -> tuple[jax.Array, KVPool]:
    """Runs the step's T tokens (token_ids [T] int32) through the decoder; returns (hidden [T, H], kv_pool)."""
    num_heads, num_kv_heads, head_dim = config.num_heads, config.num_kv_heads, config.head_dim
    positions = md.positions
    num_tokens = positions.shape[0]

    h = params["embed"][token_ids]  # [T, H]
    inv_freq = jnp.asarray(rope_inv_freq(config))
    angles = jnp.maximum(positions, 0).astype(jnp.float32)[:, None] * inv_freq[None, :]  # [T, D/2]
    cos, sin = jnp.cos(angles)[:, None, :], jnp.sin(angles)[:, None, :]
    layers = params["layers"]

    def layer_step(i, carry):
        h, kv_pool = carry
        p = jax.tree.map(lambda x: x[i], layers)
        x = _rms_norm(h, p["attn_norm"], config.rms_norm_eps)
        q, k, v = _matmul(x, p["wq"]), _matmul(x, p["wk"]), _matmul(x, p["wv"])
        if config.attention_bias:
            q, k, v = q + p["bq"], k + p["bk"], v + p["bv"]
        q = _rope(q.reshape(num_tokens, num_heads, head_dim), cos, sin)
        k = _rope(k.reshape(num_tokens, num_kv_heads, head_dim), cos, sin)
        v = v.reshape(num_tokens, num_kv_heads, head_dim)
        out, kv_pool = attn(q, k, v, kv_pool, i, md, sliding_window=config.sliding_window)
        h = h + _matmul(out.reshape(num_tokens, num_heads * head_dim), p["wo"])
        x = _rms_norm(h, p["mlp_norm"], config.rms_norm_eps)
        h = h + _matmul(jax.nn.silu(_matmul(x, p["w_gate"])) * _matmul(x, p["w_up"]), p["w_down"])
        return h, kv_pool

    return jax.lax.fori_loop(0, config.num_layers, layer_step, (h, kv_pool))


def logits(params: dict, hidden: jax.Array, *, config: ModelConfig) -> jax.Array:
    """hidden [S, H] (the rows that need logits) -> logits [S, V] float32."""
    h = _rms_norm(hidden, params["final_norm"], config.rms_norm_eps)
    lm_head = params["embed"].T if config.tie_word_embeddings else params["lm_head"]  # [H, V]
    return jnp.dot(h.astype(lm_head.dtype), lm_head, preferred_element_type=jnp.float32)
