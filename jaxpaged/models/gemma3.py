"""Gemma 3 (text) as a pure-JAX reference over dense, non-paged attention: one sequence, every position.

This pins down each Gemma 3 detail against transformers' `Gemma3ForCausalLM`; the paged model the engine serves,
`Gemma3ForCausalLM` at the end of this file, is an nnx module whose layer body is the same `decoder_layer` with the
paged attention backend in place of `dense_attention`. Per layer i, with x [T, H]:

    h = embed[token_ids] * embedding_multiplier               (sqrt(hidden), rounded to the weight dtype as HF does)
    a = rms(h) ; q, k, v = a @ wq, a @ wk, a @ wv ; q, k = rms_head(q), rms_head(k)   (per-head q/k norms)
    q, k = rope(q, k; base = rope_local_theta on sliding layers, rope_theta (+ rope_scaling) on full ones)
    o = softmax(q k^T * query_pre_attn_scalar ** -0.5 + causal & window mask) v   (window on sliding layers only)
    h = h + rms(o @ wo)                                        (post-attention norm before the residual add)
    h = h + rms(down(gelu_tanh(rms(h) @ w_gate) * (rms(h) @ w_up)))   (pre- and post-MLP norms)
    logits = rms(h) @ embed.T                                  (tied; final_logit_softcapping if a config sets it)

Every rms here is Gemma's: normalise in float32, scale by (1 + weight) in float32, cast back.

Params are the loader's layout (`jaxpaged.loader.layout`): per-layer tensors stacked on a leading layer axis, so the
layers run in one `fori_loop` and the per-layer differences (window, rope table) are data indexed by the layer,
not separate traces.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxpaged.config import ModelConfig
from jaxpaged.models import norm
from jaxpaged.models.contract import layer_loop
from jaxpaged.models.llama import lm_head, rope_inv_freq
from jaxpaged.models.matmul import ACTIVATIONS, head_matmul, layer_glu, layer_matmul, matmul
from jaxpaged.models.quant import COLUMNS, ROWS, embedding_rows
from jaxpaged.models.rope import rope_qk

NEG_INF = -1e30
NO_WINDOW = 0  # in the per-layer window table: the layer attends to its whole context


def rms_norm(x: jax.Array, weight: jax.Array, config: ModelConfig) -> jax.Array:
    """RMSNorm over the last axis. Gemma (rms_norm_unit_offset) scales by (1 + weight) in float32 and casts after;
    Llama casts first and scales by weight, as each family's HF code does (it matters in 16-bit dtypes). Natively in
    a native step (`jaxpaged.models.norm.rms_norm`)."""
    return norm.rms_norm(x, weight, config.rms_norm_eps, unit_offset=config.rms_norm_unit_offset)


def layer_rope_tables(config: ModelConfig) -> np.ndarray:
    """[L, D/2] float32 inverse frequencies of each layer: sliding layers use rope_local_theta without scaling
    (Gemma 3's local base 10000), full ones rope_theta with rope_scaling."""
    full = rope_inv_freq(config)
    if config.rope_local_theta is None:
        return np.stack([full] * config.num_layers)
    local = rope_inv_freq(dataclasses.replace(config, rope_theta=config.rope_local_theta, rope_scaling=None))
    return np.stack([local if config.layer_window(i) is not None else full for i in range(config.num_layers)])


def layer_windows(config: ModelConfig) -> np.ndarray:
    """[L] int32 sliding window of each layer, NO_WINDOW (0) for layers that see their whole context."""
    return np.asarray([config.layer_window(i) or NO_WINDOW for i in range(config.num_layers)], np.int32)


def attention_scale(config: ModelConfig) -> float:
    scalar = config.query_pre_attn_scalar or config.head_dim
    return 1.0 / math.sqrt(scalar)


def _act_name(config: ModelConfig) -> str:
    """The gated MLP's activation, as `layer_glu` names it."""
    return "gelu_tanh" if config.hidden_act == "gelu_pytorch_tanh" else "silu"


def _soft_cap(x: jax.Array, cap: float | None) -> jax.Array:
    return x if cap is None else cap * jnp.tanh(x / cap)


def dense_attention(q: jax.Array, k: jax.Array, v: jax.Array, positions: jax.Array, window: jax.Array, *,
                    scale: float) -> jax.Array:
    """One sequence, no paging. q [T, Hq, D], k, v [T, Hkv, D], positions [T] int32 (of q and k alike);
    window: int32 scalar, possibly traced, NO_WINDOW for none. Returns [T, Hq, D] in q's dtype.
    Token t sees positions p <= t, and p > t - window when a window is set (HF's sliding_window_overlay)."""
    num_tokens, num_q_heads, head_dim = q.shape
    num_kv_heads = k.shape[1]
    group = num_q_heads // num_kv_heads
    qg = q.reshape(num_tokens, num_kv_heads, group, head_dim).astype(jnp.float32)
    scores = jnp.einsum("tkgd,skd->kgts", qg, k.astype(jnp.float32)) * scale  # [Hkv, G, T, T]
    q_pos, kv_pos = positions[:, None], positions[None, :]
    mask = (kv_pos <= q_pos) & ((window == NO_WINDOW) | (kv_pos > q_pos - window))  # [T, T]
    probs = jax.nn.softmax(jnp.where(mask, scores, NEG_INF), axis=-1)
    out = jnp.einsum("kgts,skd->tkgd", probs, v.astype(jnp.float32))
    return out.reshape(num_tokens, num_q_heads, head_dim).astype(q.dtype)


# (q [T, Hq, D], k [T, Hkv, D], v [T, Hkv, D], window int32 scalar) -> [T, Hq, D]
Attend = Callable[[jax.Array, jax.Array, jax.Array, jax.Array], jax.Array]


def _plain(x: jax.Array, w: jax.Array, split: str | None = None) -> jax.Array:
    return matmul(x, w)


def decoder_layer(p: dict, h: jax.Array, cos: jax.Array, sin: jax.Array, window: jax.Array, attend: Attend, *,
                  config: ModelConfig, matmul: Callable[..., jax.Array] = _plain,
                  glu: Callable[[jax.Array, jax.Array, jax.Array], jax.Array] | None = None) -> jax.Array:
    """One Gemma 3 layer. p: this layer's params (the loader's per-layer names); h [T, H];
    cos, sin [T, 1, D/2] float32 of this layer's rope base; window int32 scalar. Returns h [T, H].
    matmul(x, p[name], split) multiplies by a weight matrix (split: `quant.COLUMNS` or `ROWS`, how tensor
    parallelism splits it): by default p holds this layer's [K, N] matrices; the paged model passes the stacked
    [L, K, N] ones with a `layer_matmul` of its layer, and glu(x, w_gate, w_up) (default: act(matmul(x, w_gate)) *
    matmul(x, w_up)) as its `layer_glu`."""
    c = config
    num_tokens = h.shape[0]
    x = rms_norm(h, p["attn_norm"], c)
    q = matmul(x, p["wq"], COLUMNS).reshape(num_tokens, c.num_heads, c.head_dim)  # [T, Hq, D]
    k = matmul(x, p["wk"], COLUMNS).reshape(num_tokens, c.num_kv_heads, c.head_dim)  # [T, Hkv, D]
    v = matmul(x, p["wv"], COLUMNS).reshape(num_tokens, c.num_kv_heads, c.head_dim)
    if c.qk_norm:  # over each head's D values, before RoPE
        q, k = rms_norm(q, p["q_norm"], c), rms_norm(k, p["k_norm"], c)
    q, k = rope_qk(q, k, cos, sin)
    out = matmul(attend(q, k, v, window).reshape(num_tokens, c.num_heads * c.head_dim), p["wo"], ROWS)  # [T, H]
    h = h + (rms_norm(out, p["post_attn_norm"], c) if c.post_norms else out)
    x = rms_norm(h, p["mlp_norm"], c)
    if glu is None:
        gated = ACTIVATIONS[_act_name(c)](matmul(x, p["w_gate"], COLUMNS)) * matmul(x, p["w_up"], COLUMNS)  # [T, I]
    else:
        gated = glu(x, p["w_gate"], p["w_up"])
    out = matmul(gated, p["w_down"], ROWS)  # [T, H]
    return h + (rms_norm(out, p["post_mlp_norm"], c) if c.post_norms else out)


def embed(params: dict, token_ids: jax.Array, config: ModelConfig) -> jax.Array:
    """token_ids [T] int32 -> [T, H] in the params' dtype, scaled by embedding_multiplier rounded to that dtype
    (HF multiplies by the scale cast to the weight dtype: 25.30 is 25.25 in bf16)."""
    h = embedding_rows(params["embed"], token_ids)
    if config.embedding_multiplier != 1.0:
        h = h * jnp.asarray(config.embedding_multiplier, h.dtype)
    return h


@functools.partial(jax.jit, static_argnames="config")
def forward_dense(params: dict, token_ids: jax.Array, *, config: ModelConfig) -> jax.Array:
    """One sequence at positions 0..T-1: token_ids [T] int32 -> hidden [T, H] before the final norm."""
    positions = jnp.arange(token_ids.shape[0], dtype=jnp.int32)  # [T]
    inv_freq = jnp.asarray(layer_rope_tables(config))  # [L, D/2] float32
    windows = jnp.asarray(layer_windows(config))  # [L] int32
    scale = attention_scale(config)

    def attend(q, k, v, window):
        return dense_attention(q, k, v, positions, window, scale=scale)

    def layer_step(i, h):
        p = jax.tree.map(lambda x: x[i], params["layers"])
        angles = positions.astype(jnp.float32)[:, None] * inv_freq[i][None, :]  # [T, D/2]
        cos, sin = jnp.cos(angles)[:, None, :], jnp.sin(angles)[:, None, :]
        return decoder_layer(p, h, cos, sin, windows[i], attend, config=config)

    return jax.lax.fori_loop(0, config.num_layers, layer_step, embed(params, token_ids, config))


@functools.partial(jax.jit, static_argnames="config")
def logits(params: dict, hidden: jax.Array, *, config: ModelConfig) -> jax.Array:
    """hidden [N, H] -> logits [N, V] float32: final norm, LM head (embed.T when tied), final soft-cap."""
    h = rms_norm(hidden, params["final_norm"], config)
    head = params["embed"].T if config.tie_word_embeddings else params["lm_head"]  # [H, V]
    out = jnp.dot(h.astype(head.dtype), head, preferred_element_type=jnp.float32)
    return _soft_cap(out, config.final_logit_softcapping)


def greedy(params: dict, prompt: list[int], num_tokens: int, *, config: ModelConfig) -> list[int]:
    """`num_tokens` greedy tokens after `prompt`, recomputing the whole sequence each step (a test oracle, not a
    server: no cache, O(n^2) work). The sequence is padded to its final length so one trace serves every step:
    attention is causal, so the padding after position n does not change position n's hidden state."""
    total = len(prompt) + num_tokens
    ids = np.zeros(total, np.int32)  # [prompt + new] int32, filled as tokens are chosen
    ids[:len(prompt)] = prompt
    for n in range(len(prompt), total):
        hidden = forward_dense(params, jnp.asarray(ids), config=config)  # [total, H]
        ids[n] = int(jnp.argmax(logits(params, hidden[n - 1:n], config=config)[0]))
    return ids[len(prompt):].tolist()


# --- the paged module the engine serves ------------------------------------------------------------------------------


def layer_period(config: ModelConfig) -> int:
    """The shortest P with layer i's type equal to layer (i mod P)'s for every layer (Gemma 3: 6, five sliding
    layers then a full one; 1 when every layer has the same window). The paged model runs the layers in groups of P
    whose windows and rope bases are static, and the last num_layers % P layers unrolled after them."""
    types = config.layer_types or ("same",) * config.num_layers
    return next(p for p in range(1, len(types) + 1) if all(types[i] == types[i % p] for i in range(len(types))))


class Gemma3Layers(nnx.Module):
    """Every decoder layer's parameters, stacked on a leading layer axis under the loader's names (`layers/wq`
    [L, H, Hq*D], ...; `jaxpaged.loader.layout`). Random init: matrices N(0, 1/fan_in), norm weights 0 (scale 1)."""

    def __init__(self, config: ModelConfig, *, rngs: nnx.Rngs, dtype=jnp.float32):
        from jaxpaged.loader.layout import expected_shapes, layer_names

        shapes = expected_shapes(config)["layers"]
        self.names = layer_names(config)
        for name in self.names:
            shape = shapes[name]
            if len(shape) == 3:
                value = nnx.initializers.normal(1.0 / math.sqrt(shape[1]))(rngs.params(), shape, dtype)
            else:
                value = jnp.zeros(shape, dtype)
            setattr(self, name, nnx.Param(value))

    def stacked(self) -> dict:
        return {name: getattr(self, name)[...] for name in self.names}


class Gemma3ForCausalLM(nnx.Module):
    """Gemma 3 (text) over the paged KV pool, on the model contract (`jaxpaged.models.contract`):

        hidden, kv_pool = model(token_ids, kv_pool, md, attn)   # [T] int32 -> [T, H], pool written and returned
        logits = model.logits(hidden)                          # [S, H] -> [S, V] float32

    The layer body is `decoder_layer` (the dense reference's), with the attention backend in place of dense
    attention. Sliding and full layers differ in a static argument of the kernels (`sliding_window`) and in their
    rope base, so the layers run in a `fori_loop` over groups of `layer_period(config)` layers (Gemma 3: 5 sliding
    + 1 full) whose body unrolls the group with each layer's static window and rope table; the last
    num_layers % period layers (Gemma 3 1B: 26 = 4 * 6 + 2) are unrolled after the loop. Pool layer of group g's
    j-th layer: g * period + j. The loop carries the pool, so it is updated in place; compile time grows with the
    period, not with depth. Queries scale by query_pre_attn_scalar ** -0.5 (`scale=`)."""

    def __init__(self, config: ModelConfig, *, rngs: nnx.Rngs, dtype=jnp.float32):
        self.config = config
        H, V = config.hidden_size, config.vocab_size
        self.embed = nnx.Param(nnx.initializers.normal(1.0)(rngs.params(), (V, H), dtype))
        self.layers = Gemma3Layers(config, rngs=rngs, dtype=dtype)
        self.final_norm = nnx.Param(jnp.zeros((H,), dtype))
        if not config.tie_word_embeddings:
            self.lm_head = nnx.Param(nnx.initializers.normal(1.0 / math.sqrt(H))(rngs.params(), (H, V), dtype))

    def __call__(self, token_ids: jax.Array, kv_pool, md, attn,
                 num_layers: int | None = None) -> tuple[jax.Array, object]:
        """token_ids [T] int32 -> (hidden [T, H] before the final norm, kv_pool with the step's K/V written).
        num_layers: run only the first this many layers (a self-speculative draft: the same weights and pool)."""
        c = self.config
        num_layers = num_layers or c.num_layers
        period = layer_period(c)
        num_groups = num_layers // period
        scale = attention_scale(c)
        stacked = self.layers.stacked()  # name -> [L, ...]
        tables = layer_rope_tables(c)  # [L, D/2] numpy, constants of the architecture
        positions = jnp.maximum(md.positions, 0).astype(jnp.float32)[:, None]  # [T, 1]; padding (-1) -> 0
        rope: dict = {}  # table bytes -> (cos, sin) [T, 1, D/2], built before the loop and shared by its layers
        for j in range(period):
            key = tables[j].tobytes()
            if key not in rope:
                angles = positions * jnp.asarray(tables[j])[None, :]  # [T, D/2]
                rope[key] = jnp.cos(angles)[:, None, :], jnp.sin(angles)[:, None, :]

        def run_layer(layer, j: int, h, pool):
            """Layer `layer` (traced in the loop, static in the tail), of the same type as layer j < period."""
            window = c.layer_window(j)
            # vectors sliced; matrices stacked, read at `layer` by layer_matmul (in place where it can)
            p = {name: x if x.ndim >= 3 else x[layer] for name, x in stacked.items()}
            box = [pool]

            def attend(q, k, v, _window):
                out, box[0] = attn(q, k, v, box[0], layer, md, scale=scale, sliding_window=window)
                return out

            cos, sin = rope[tables[j].tobytes()]
            h = decoder_layer(p, h, cos, sin, jnp.int32(window or NO_WINDOW), attend, config=c,
                              matmul=lambda x, w, split=None: layer_matmul(x, w, layer, split),
                              glu=lambda x, wg, wu: layer_glu(x, wg, wu, layer, _act_name(c)))
            return h, box[0]

        def group(g, carry):
            h, pool = carry
            for j in range(period):
                h, pool = run_layer(g * period + j, j, h, pool)
            return h, pool

        carry = (embed({"embed": self.embed[...]}, token_ids, c), kv_pool)
        if num_groups:
            carry = layer_loop(num_groups, group, carry, token_ids.shape[0])
        for i in range(num_groups * period, num_layers):
            carry = run_layer(i, i % period, *carry)
        return carry

    def logits(self, hidden: jax.Array) -> jax.Array:
        """hidden [S, H] -> logits [S, V] float32: final norm, LM head (embed.T when tied), final soft-cap."""
        c = self.config
        h = rms_norm(hidden, self.final_norm[...], c)
        return _soft_cap(head_matmul(h, lm_head(self)), c.final_logit_softcapping)  # head [H, V] or prepacked
