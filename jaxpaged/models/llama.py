"""The Llama family (Llama 2/3 incl. llama3 rope scaling, Mistral with a sliding window, Qwen2 with q/k/v biases,
Qwen3 with per-head q/k RMSNorm, SmolLM2) as `flax.nnx` modules over a paged KV pool.

    model = LlamaForCausalLM(config, rngs=nnx.Rngs(0))   # random weights; families.from_params(config, params)
    hidden, kv_pool = model(token_ids, kv_pool, md, attn)     # [T] int32 -> [T, H]; the pool written and returned
    logits = model.logits(hidden[md.logits_indices])          # [S, H] -> [S, V] float32

This is the model contract of `jaxpaged.models.contract`; the engine splits the module once (`nnx.split`) and merges
it inside its jitted step. Weights are stored for x @ W; q/k follow Hugging Face's rotary convention (rotate_half).

The decoder layers are one `LlamaDecoderLayer` built under `nnx.vmap`, so each of its parameters is stacked on a
leading layer axis (`layers/wq` [L, H, Hq*D], ...; the state's layout is `jaxpaged.loader.layout`'s). They run in a
`fori_loop` that calls the stacked module with the layer index i and carries the pool: the layer reads its matrices
through `layer_matmul` and its norm weights through `layer_rms_norm` (both can read a stacked weight in place: see
jaxpaged/models/matmul.py and norm.py), its other vectors as slices; compile time does not grow with depth (unless
the step asks `contract.layer_loop` to unroll: a GPU's decode steps may), and the pool stays updated in place
(returning it from a `scan` or stacking per-layer outputs would copy the whole pool every step, see
shared/PALLAS_NOTES.md).
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxpaged.config import ModelConfig
from jaxpaged.models.contract import layer_loop
from jaxpaged.models.matmul import head_matmul, layer_glu, layer_matmul, layer_matmul3
from jaxpaged.models.norm import layer_add_rms_norm, layer_rms_norm, residual_add, rms_norm
from jaxpaged.models.quant import ROWS, embedding_rows, is_quantized
from jaxpaged.models.rope import rope_qk
from jaxpaged.worker.attention import AttentionBackend, AttentionMetadata, KVPool


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


class TransposedHead(nnx.Variable):
    """A tied LM head's [H, V] copy of the embedding's transpose, made once at load (`keep_transposed_head`); not an
    `nnx.Param`, so checkpoints and parameter trees do not carry it."""


def keep_transposed_head(model: nnx.Module, dtype) -> None:
    """Gives a tied model (`embed` [V, H], config.tie_word_embeddings) a `TransposedHead` in `dtype` for `lm_head`.

    XLA CPU runs a 16-bit x @ embed.T by converting the whole embedding to float32 every step (5x slower than
    x @ W with W stored [H, V]: benchmarks/step_anatomy.py); the copy costs V * H * itemsize bytes once."""
    model.head_t = TransposedHead(jnp.asarray(model.embed[...].T, dtype))


def lm_head(model: nnx.Module) -> jax.Array:
    """The [H, V] LM head of a model with `embed` [V, H]: its own `lm_head`, the kept transpose, or embed.T (the
    first two possibly prepacked at load for the native CPU matmul: `engine_setup.split_model`)."""
    if not model.config.tie_word_embeddings:
        return model.lm_head[...]
    head_t = getattr(model, "head_t", None)
    if head_t is not None:
        return head_t[...]
    embed = model.embed[...]
    return embed if is_quantized(embed) else embed.T  # a quantized table multiplies as x @ table.T


class LlamaDecoderLayer(nnx.Module):
    """The pre-norm decoder layers, every parameter stacked on a leading layer axis (built under `nnx.vmap`): layer
    i is attention through `attn`, then a SwiGLU MLP (both with residuals)."""

    def __init__(self, config: ModelConfig, *, rngs: nnx.Rngs, dtype=jnp.float32):
        H, D, F = config.hidden_size, config.head_dim, config.intermediate_size
        q, kv = config.num_heads * D, config.num_kv_heads * D

        def matrix(fan_in: int, fan_out: int) -> nnx.Param:
            return nnx.Param(nnx.initializers.normal(1.0 / math.sqrt(fan_in))(rngs.params(), (fan_in, fan_out), dtype))

        self.config = config
        self.attn_norm = nnx.Param(jnp.ones((H,), dtype))
        self.wq, self.wk, self.wv, self.wo = matrix(H, q), matrix(H, kv), matrix(H, kv), matrix(q, H)
        if config.attention_bias:  # Qwen2
            self.bq, self.bk, self.bv = (nnx.Param(jnp.zeros((n,), dtype)) for n in (q, kv, kv))
        if config.qk_norm:  # Qwen3: RMSNorm over each head's q and k, before RoPE
            self.q_norm, self.k_norm = nnx.Param(jnp.ones((D,), dtype)), nnx.Param(jnp.ones((D,), dtype))
        self.mlp_norm = nnx.Param(jnp.ones((H,), dtype))
        self.w_gate, self.w_up, self.w_down = matrix(H, F), matrix(H, F), matrix(F, H)

    def __call__(self, h: jax.Array, kv_pool: KVPool, layer: jax.Array, md: AttentionMetadata,
                 attn: AttentionBackend, cos: jax.Array, sin: jax.Array) -> tuple[jax.Array, KVPool]:
        """Layer `layer` (an int32 scalar, traced in the loop). h [T, H]; cos, sin [T, 1, D/2] float32. Returns
        (h [T, H], kv_pool)."""
        c = self.config
        num_tokens, eps = h.shape[0], c.rms_norm_eps

        def vec(p: nnx.Param) -> jax.Array:  # [L, n] -> layer's [n]
            return p[...][layer]

        def mm_rows(x: jax.Array, p: nnx.Param) -> jax.Array:  # x @ layer's matrix of p [L, K, N], split by rows
            return layer_matmul(x, p[...], layer, ROWS)

        x = layer_rms_norm(h, self.attn_norm[...], layer, eps)
        q, k, v = layer_matmul3(x, (self.wq[...], self.wk[...], self.wv[...]), layer)
        if c.attention_bias:
            q, k, v = q + vec(self.bq), k + vec(self.bk), v + vec(self.bv)
        q = q.reshape(num_tokens, c.num_heads, c.head_dim)  # [T, Hq, D]
        k = k.reshape(num_tokens, c.num_kv_heads, c.head_dim)  # [T, Hkv, D]
        v = v.reshape(num_tokens, c.num_kv_heads, c.head_dim)
        if c.qk_norm:
            q, k = rms_norm(q, vec(self.q_norm), eps), rms_norm(k, vec(self.k_norm), eps)
        q, k = rope_qk(q, k, cos, sin)
        out, kv_pool = attn(q, k, v, kv_pool, layer, md, sliding_window=c.sliding_window)  # [T, Hq, D]
        s, x = layer_add_rms_norm(h, mm_rows(out.reshape(num_tokens, c.num_heads * c.head_dim), self.wo),
                                  self.mlp_norm[...], layer, eps)  # s = h + attention
        mlp = mm_rows(layer_glu(x, self.w_gate[...], self.w_up[...], layer, "silu"), self.w_down)
        return residual_add(s, mlp), kv_pool


# ModelConfig fields at the values every Llama-family model has; others (Gemma 3's) this module does not implement
_LLAMA_DEFAULTS = {"layer_types": None, "rope_local_theta": None, "query_pre_attn_scalar": None, "hidden_act": "silu",
                   "embedding_multiplier": 1.0, "rms_norm_unit_offset": False, "post_norms": False,
                   "final_logit_softcapping": None}


def check_config(config: ModelConfig) -> None:
    """Raises ValueError naming the fields this module would silently ignore (a Gemma 3 config, say)."""
    unsupported = [name for name, value in _LLAMA_DEFAULTS.items() if getattr(config, name) != value]
    if unsupported:
        raise ValueError(f"architecture={config.architecture!r} cannot run as LlamaForCausalLM: it does not implement "
                         f"{', '.join(unsupported)}. Gemma 3 (architecture='gemma3') "
                         "is served by jaxpaged.models.gemma3.Gemma3ForCausalLM (jaxpaged.models.families picks it)")


class LlamaForCausalLM(nnx.Module):
    """Embedding, `num_layers` stacked decoder layers, final norm and LM head (the embedding's transpose when tied)."""

    def __init__(self, config: ModelConfig, *, rngs: nnx.Rngs, dtype=jnp.float32):
        check_config(config)
        self.config = config
        H, V = config.hidden_size, config.vocab_size
        self.embed = nnx.Param(nnx.initializers.normal(1.0)(rngs.params(), (V, H), dtype))

        @nnx.split_rngs(splits=config.num_layers)
        @nnx.vmap(in_axes=(0,), out_axes=0)
        def stacked_layers(rngs: nnx.Rngs) -> LlamaDecoderLayer:
            return LlamaDecoderLayer(config, rngs=rngs, dtype=dtype)

        self.layers = stacked_layers(rngs)
        self.final_norm = nnx.Param(jnp.ones((H,), dtype))
        if not config.tie_word_embeddings:
            self.lm_head = nnx.Param(nnx.initializers.normal(1.0 / math.sqrt(H))(rngs.params(), (H, V), dtype))

    def __call__(self, token_ids: jax.Array, kv_pool: KVPool, md: AttentionMetadata,
                 attn: AttentionBackend, num_layers: int | None = None) -> tuple[jax.Array, KVPool]:
        """token_ids [T] int32 -> (hidden [T, H] before the final norm, kv_pool with the step's K/V written).
        num_layers: run only the first this many layers (a self-speculative draft: the same weights and pool)."""
        h = embedding_rows(self.embed[...], token_ids)  # [T, H]
        inv_freq = jnp.asarray(rope_inv_freq(self.config))  # [D/2] f32, a constant of the architecture
        angles = jnp.maximum(md.positions, 0).astype(jnp.float32)[:, None] * inv_freq[None, :]  # [T, D/2]
        cos, sin = jnp.cos(angles)[:, None, :], jnp.sin(angles)[:, None, :]

        def layer_step(i, carry):
            h, kv_pool = carry
            return self.layers(h, kv_pool, i, md, attn, cos, sin)

        return layer_loop(num_layers or self.config.num_layers, layer_step, (h, kv_pool), token_ids.shape[0])

    def logits(self, hidden: jax.Array) -> jax.Array:
        """hidden [S, H] (only the rows that need logits) -> logits [S, V] float32."""
        h = rms_norm(hidden, self.final_norm[...], self.config.rms_norm_eps)
        return head_matmul(h, lm_head(self))  # [H, V], or prepacked at load


def abstract_model(config: ModelConfig) -> LlamaForCausalLM:
    """The module with ShapeDtypeStructs for parameters: its structure, nothing allocated or initialised."""
    return nnx.eval_shape(lambda: LlamaForCausalLM(config, rngs=nnx.Rngs(0)))
