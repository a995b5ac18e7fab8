"""The params pytree every loader assembles, one tensor at a time: the pure-dict form of the `nnx.State` of
`jaxpaged.models.llama.LlamaForCausalLM` (`models.families.param_state` wraps it).

  embed [V, H]; final_norm [H]; lm_head [H, V] (absent when embeddings are tied: the model uses embed.T)
  layers (stacked on a leading layer axis L):
    attn_norm [L, H]; wq [L, H, Hq*D]; wk, wv [L, H, Hkv*D]; bq [L, Hq*D], bk, bv [L, Hkv*D] (attention_bias only);
    q_norm, k_norm [L, D] (qk_norm only: Qwen3, Gemma 3);
    post_attn_norm, post_mlp_norm [L, H] (post_norms only: Gemma 3; on the attention / MLP output before the add);
    wo [L, Hq*D, H]; mlp_norm [L, H]; w_gate, w_up [L, H, I]; w_down [L, I, H]
Matrices are stored for x @ W, i.e. transposed from torch's Linear [out, in]; q/k rows follow Hugging Face's
rotary convention (rotate_half: the first and second halves of each head pair up). Norm weights are Hugging Face's
too: with rms_norm_unit_offset (Gemma) the scale is 1 + weight, and the weight is stored, not the scale.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from jaxpaged.config import ModelConfig

LAYER_WEIGHTS = ("attn_norm", "wq", "wk", "wv", "wo", "mlp_norm", "w_gate", "w_up", "w_down")
LAYER_BIASES = ("bq", "bk", "bv")
LAYER_QK_NORMS = ("q_norm", "k_norm")
LAYER_POST_NORMS = ("post_attn_norm", "post_mlp_norm")


def layer_names(config: ModelConfig) -> tuple[str, ...]:
    return (LAYER_WEIGHTS + (LAYER_BIASES if config.attention_bias else ())
            + (LAYER_QK_NORMS if config.qk_norm else ()) + (LAYER_POST_NORMS if config.post_norms else ()))


def global_names(config: ModelConfig) -> tuple[str, ...]:
    return ("embed", "final_norm") + (() if config.tie_word_embeddings else ("lm_head",))


def expected_shapes(config: ModelConfig) -> dict:
    """Same nesting as the params; lets loaders check what they read before the model trips on it."""
    H, F, V, L = config.hidden_size, config.intermediate_size, config.vocab_size, config.num_layers
    q, kv = config.num_heads * config.head_dim, config.num_kv_heads * config.head_dim
    per_layer = {"attn_norm": (H,), "wq": (H, q), "wk": (H, kv), "wv": (H, kv), "wo": (q, H), "mlp_norm": (H,),
                 "w_gate": (H, F), "w_up": (H, F), "w_down": (F, H), "bq": (q,), "bk": (kv,), "bv": (kv,),
                 "q_norm": (config.head_dim,), "k_norm": (config.head_dim,), "post_attn_norm": (H,),
                 "post_mlp_norm": (H,)}
    shapes = {"embed": (V, H), "final_norm": (H,), "lm_head": (H, V)}
    out = {name: shapes[name] for name in global_names(config)}
    out["layers"] = {name: (L, *per_layer[name]) for name in layer_names(config)}
    return out


def assemble(config: ModelConfig, fetch: Callable[[str, int | None], np.ndarray], dtype=np.float32) -> dict:
    """Builds the pytree from `fetch(our_name, layer_or_None)`, which returns one tensor in torch layout
    ([out, in] for matrices, [V, H] for embed/lm_head). Layers are written into preallocated stacks, cast to
    `dtype` one tensor at a time, so peak memory is about one copy of the model."""
    shapes = expected_shapes(config)

    def fix(name: str, a: np.ndarray, want: tuple[int, ...], where: str) -> np.ndarray:
        a = a.T if a.ndim == 2 and name != "embed" else a
        if a.shape != want:
            raise ValueError(f"tensor {where} has shape {a.shape} after transposing, expected {want} from the config")
        return a

    params: dict = {"layers": {}}
    for name in global_names(config):
        params[name] = np.ascontiguousarray(fix(name, fetch(name, None), shapes[name], name), dtype=dtype)
    for name in layer_names(config):
        stacked = np.empty(shapes["layers"][name], dtype=dtype)
        for i in range(config.num_layers):
            stacked[i] = fix(name, fetch(name, i), stacked.shape[1:], f"{name} of layer {i}")
        params["layers"][name] = stacked
    return params
