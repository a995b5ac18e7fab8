"""GGUF files (llama.cpp): metadata -> ModelConfig, tensors dequantized (gguf.quants) -> params.

llama.cpp writes Mistral and Llama 2/3 as architecture "llama"; Qwen2 is "qwen2". For "llama" its converter
permutes the rows of attn_q / attn_k (weights and biases) so that each head's rotary pairs sit next to each other
(interleaved rope); `_unpermute` restores Hugging Face's rotate-half order. Qwen2 and Qwen3 ("qwen3", with
attn_q_norm / attn_k_norm) use rotate-half in llama.cpp too, so their q/k are stored unpermuted.

Gemma 3 ("gemma3", text only) is stored unpermuted as well (rotate-half rope), with per-head q/k norms and norms after
attention and the MLP. llama.cpp's converter stores every Gemma norm weight as 1 + w (the scale Gemma's RMSNorm
applies); we subtract the 1 again, as transformers does, so params hold Hugging Face's weights. What the file does
not say (the layer pattern, the local layers' rope base, the query scale) follows llama.cpp's gemma3 defaults,
which are the Hugging Face configs' values.
"""

from __future__ import annotations

import math

import numpy as np

from jaxpaged.config import ModelConfig
from jaxpaged.loader.layout import assemble

SUPPORTED_GGUF_ARCHS = ("llama", "qwen2", "qwen3", "gemma3")
MAGIC = b"GGUF"

# our name -> GGUF tensor name ("{i}" is the layer)
_TENSORS = {
    "embed": "token_embd.weight", "final_norm": "output_norm.weight", "lm_head": "output.weight",
    "attn_norm": "blk.{i}.attn_norm.weight", "wq": "blk.{i}.attn_q.weight", "wk": "blk.{i}.attn_k.weight",
    "wv": "blk.{i}.attn_v.weight", "wo": "blk.{i}.attn_output.weight", "bq": "blk.{i}.attn_q.bias",
    "bk": "blk.{i}.attn_k.bias", "bv": "blk.{i}.attn_v.bias", "q_norm": "blk.{i}.attn_q_norm.weight",
    "k_norm": "blk.{i}.attn_k_norm.weight", "mlp_norm": "blk.{i}.ffn_norm.weight",
    "post_attn_norm": "blk.{i}.post_attention_norm.weight", "post_mlp_norm": "blk.{i}.post_ffw_norm.weight",
    "w_gate": "blk.{i}.ffn_gate.weight", "w_up": "blk.{i}.ffn_up.weight", "w_down": "blk.{i}.ffn_down.weight",
}


def is_gguf_file(path: str) -> bool:
    with open(path, "rb") as f:
        return f.read(4) == MAGIC


def field(reader, key: str, default=None):
    f = reader.fields.get(key)
    return default if f is None else f.contents()


def _f32(value) -> float:
    """GGUF stores float32: 9.999999747378752e-06 -> 1e-05, the value the source config had."""
    return float(np.format_float_positional(np.float32(value), unique=True, trim="-"))


def _llama3_scaling(rope_freqs: np.ndarray, theta: float, head_dim: int, original_ctx: int) -> dict:
    """Recovers HF's llama3 rope_scaling from llama.cpp's `rope_freqs` (per frequency, the divisor HF's llama3
    rule applies: 1 for high frequencies, `factor` for low ones, a smooth blend between). Only the ratios
    original_ctx / {low,high}_freq_factor matter, so `original_ctx` (8192 unless the file says) fixes the scale."""
    r = np.asarray(rope_freqs, np.float64)
    factor = float(r.max())
    inv_freq = theta ** (-np.arange(0, head_dim, 2, dtype=np.float64) / head_dim)
    x = original_ctx * inv_freq / (2 * math.pi)  # original_ctx / wavelength
    medium = (r > 1 + 1e-6) & (r < factor - 1e-6 * factor)
    if factor <= 1 or medium.sum() < 2:
        raise ValueError("rope_freqs in this GGUF does not follow Llama 3's scaling rule with a recoverable "
                         f"transition band (factor={factor}); cannot build rope_scaling")
    smooth = (1 / r[medium] - 1 / factor) / (1 - 1 / factor)  # = (x - low) / (high - low)
    slope, intercept = np.polyfit(x[medium], smooth, 1)
    low = round(float(-intercept / slope), 4)
    high = round(float(low + 1 / slope), 4)
    scaling = {"rope_type": "llama3", "factor": factor, "low_freq_factor": low, "high_freq_factor": high,
               "original_max_position_embeddings": original_ctx}
    want = np.where(x < low, factor, np.where(x > high, 1.0, 1 / ((1 - (x - low) / (high - low)) / factor
                                                                   + (x - low) / (high - low))))
    if not np.allclose(want, r, rtol=1e-3):
        raise ValueError(f"rope_freqs in this GGUF does not match Llama 3's scaling rule (best fit {scaling})")
    return scaling


# llama.cpp's gemma3 defaults (llama-model.cpp): every 6th layer is global, local layers use rope base 10000
GEMMA3_GLOBAL_EVERY = 6
GEMMA3_LOCAL_ROPE_THETA = 10000.0
NORM_NAMES = ("final_norm", "attn_norm", "mlp_norm", "q_norm", "k_norm", "post_attn_norm", "post_mlp_norm")


def _gemma3_layer_types(pattern, num_layers: int) -> tuple[str, ...]:
    """`{arch}.attention.sliding_window_pattern`: absent (llama.cpp's default period), a period n (layers
    n-1, 2n-1, ... are global) or one bool per layer (True: sliding)."""
    if pattern is None:
        pattern = GEMMA3_GLOBAL_EVERY
    if isinstance(pattern, (list, tuple)):
        if len(pattern) != num_layers:
            raise ValueError(f"gemma3.attention.sliding_window_pattern has {len(pattern)} entries for "
                             f"block_count={num_layers} layers")
        sliding = [bool(p) for p in pattern]
    else:
        sliding = [(i + 1) % int(pattern) != 0 for i in range(num_layers)]
    return tuple("sliding_attention" if s else "full_attention" for s in sliding)


def _gemma3_fields(key, hidden: int, heads: int, head_dim: int, num_layers: int) -> dict:
    """The ModelConfig fields only Gemma 3 sets. No soft-capping: Gemma 3 replaced Gemma 2's with the q/k norms
    (llama.cpp's gemma3 graph has none; transformers ignores attn_logit_softcapping for Gemma 3)."""
    return dict(
        layer_types=_gemma3_layer_types(key("attention.sliding_window_pattern"), num_layers),
        rope_local_theta=_f32(key("rope.freq_base_swa", GEMMA3_LOCAL_ROPE_THETA)),
        # As llama.cpp (after gemma_pytorch's configs): queries scale by 1/sqrt(head_dim), except the 27B
        # (62 layers), scaled by 1/sqrt(hidden / heads)
        query_pre_attn_scalar=float(hidden // heads if num_layers == 62 else head_dim),
        hidden_act="gelu_pytorch_tanh", embedding_multiplier=math.sqrt(hidden), rms_norm_unit_offset=True,
        post_norms=True)


def _eog_ids(reader, arch: str) -> list[int]:
    """Gemma's chat turns end with <end_of_turn>, which llama.cpp also stops at (it detects it by its text) and
    Hugging Face's generation config lists; the GGUF names only <eos>."""
    if arch != "gemma3":
        return []
    tokens = reader.fields.get("tokenizer.ggml.tokens")
    if tokens is None:
        return []
    for i, part in enumerate(tokens.data):
        if bytes(tokens.parts[part]) == b"<end_of_turn>":
            return [i]
    return []


def model_config_from_gguf(reader) -> ModelConfig:
    arch = field(reader, "general.architecture")
    if arch not in SUPPORTED_GGUF_ARCHS:
        raise ValueError(f"unsupported GGUF architecture general.architecture={arch!r}; supported: "
                         f"{', '.join(SUPPORTED_GGUF_ARCHS)}")

    def key(name, default=None):
        return field(reader, f"{arch}.{name}", default)

    tensors = {t.name: t for t in reader.tensors}
    if "token_embd.weight" not in tensors:
        raise ValueError("missing tensor 'token_embd.weight' in the GGUF file")
    hidden, heads = int(key("embedding_length")), int(key("attention.head_count"))
    head_dim = int(key("attention.key_length", hidden // heads))
    rot = key("rope.dimension_count")
    if rot is not None and int(rot) != head_dim:
        raise ValueError(f"{arch}.rope.dimension_count={rot} != head_dim={head_dim}: partial rotary is not supported")
    theta = _f32(key("rope.freq_base", 10000.0))
    scaling = None
    kind = key("rope.scaling.type")
    if "rope_freqs.weight" in tensors:
        from gguf import quants

        t = tensors["rope_freqs.weight"]
        scaling = _llama3_scaling(quants.dequantize(t.data, t.tensor_type), theta, head_dim,
                                  int(key("rope.scaling.original_context_length", 8192)))
    elif kind == "linear":
        scaling = {"rope_type": "linear", "factor": _f32(key("rope.scaling.factor"))}
    elif kind == "yarn":
        scaling = {"rope_type": "yarn", "factor": _f32(key("rope.scaling.factor")),
                   "original_max_position_embeddings": int(key("rope.scaling.original_context_length"))}
    elif kind not in (None, "none"):
        raise ValueError(f"{arch}.rope.scaling.type={kind!r} is not supported; supported: linear, yarn, llama3")
    eos = [field(reader, f"tokenizer.ggml.{k}_token_id") for k in ("eos", "eot", "eom")] + _eog_ids(reader, arch)
    num_layers = int(key("block_count"))
    gemma = _gemma3_fields(key, hidden, heads, head_dim, num_layers) if arch == "gemma3" else {}
    return ModelConfig(
        vocab_size=int(tensors["token_embd.weight"].shape[1]), hidden_size=hidden,
        intermediate_size=int(key("feed_forward_length")), num_layers=num_layers, num_heads=heads,
        num_kv_heads=int(key("attention.head_count_kv", heads)), head_dim=head_dim,
        rms_norm_eps=_f32(key("attention.layer_norm_rms_epsilon", 1e-5)), rope_theta=theta, rope_scaling=scaling,
        max_position_embeddings=int(key("context_length", 2048)),
        tie_word_embeddings="output.weight" not in tensors, attention_bias="blk.0.attn_q.bias" in tensors,
        qk_norm="blk.0.attn_q_norm.weight" in tensors,
        sliding_window=key("attention.sliding_window"), bos_token_id=field(reader, "tokenizer.ggml.bos_token_id"),
        eos_token_ids=tuple(dict.fromkeys(int(i) for i in eos if i is not None)), architecture=arch, **gemma)


def _unpermute(w: np.ndarray, n_head: int) -> np.ndarray:
    """Inverse of llama.cpp's convert-time permute. Per head, llama.cpp's rows are (pair j, element e) -> row
    2j+e; HF's are row e*D/2 + j. w [n_head*D, ...] (a weight or a bias)."""
    half = w.shape[0] // n_head // 2
    return w.reshape(n_head, half, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def dequantize(tensor) -> np.ndarray:
    """One GGUF tensor as float32 in numpy (row-major) order: GGUF lists dims fastest first, so a torch
    Linear [out, in] is stored with shape (in, out) and comes back here as [out, in]."""
    from gguf import quants

    try:
        data = quants.dequantize(tensor.data, tensor.tensor_type)
    except NotImplementedError as e:
        raise ValueError(f"tensor {tensor.name!r} has GGML type {tensor.tensor_type.name}, which gguf cannot "
                         "dequantize") from e
    return np.asarray(data, np.float32).reshape(tuple(int(d) for d in reversed(tensor.shape)))


def load_gguf(path: str, reader=None) -> tuple[ModelConfig, dict]:
    """Params in float32 (what the cache stores), dequantized one tensor at a time from the memory-mapped file.
    reader: the file's `gguf.GGUFReader`, if the caller parsed it already (a large vocabulary takes seconds)."""
    from gguf import GGUFReader

    reader = reader or GGUFReader(path)
    config = model_config_from_gguf(reader)
    tensors = {t.name: t for t in reader.tensors}
    permuted = config.architecture == "llama"
    # llama.cpp stored Gemma's norm scales (1 + w); params hold w
    norm_shift = 1.0 if config.rms_norm_unit_offset else 0.0

    def fetch(name: str, layer: int | None) -> np.ndarray:
        key = _TENSORS[name].format(i=layer)
        if key not in tensors:
            raise ValueError(f"missing tensor {key!r} in {path}")
        a = dequantize(tensors[key])
        if permuted and name in ("wq", "bq"):
            a = _unpermute(a, config.num_heads)
        elif permuted and name in ("wk", "bk"):
            a = _unpermute(a, config.num_kv_heads)
        elif norm_shift and name in NORM_NAMES:
            a = a - np.float32(norm_shift)
        return a

    return config, assemble(config, fetch, np.float32)


# Gemma 3's chat format (google/gemma-3-*-it's tokenizer_config.json, its text part), for Gemma GGUFs that carry no
# template (llama.cpp knows the format by the model, not from the file): a system message prefixes the first user
# turn; assistant turns are "model" turns; every turn ends with <end_of_turn>.
GEMMA3_CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{%- if messages[0]['role'] == 'system' -%}"
    "{%- set first_user_prefix = messages[0]['content'] + '\n\n' -%}{%- set loop_messages = messages[1:] -%}"
    "{%- else -%}{%- set first_user_prefix = '' -%}{%- set loop_messages = messages -%}{%- endif -%}"
    "{%- for message in loop_messages -%}"
    "{%- if (message['role'] == 'user') != (loop.index0 % 2 == 0) -%}"
    "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}{%- endif -%}"
    "{%- set role = 'model' if message['role'] == 'assistant' else message['role'] -%}"
    "{{ '<start_of_turn>' + role + '\n' + (first_user_prefix if loop.first else '') }}"
    "{{ message['content'] | trim }}{{ '<end_of_turn>\n' }}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{ '<start_of_turn>model\n' }}{%- endif -%}")


def chat_template_of(path: str, reader=None) -> str | None:
    """The file's tokenizer.chat_template; for a gemma3 file without one, Gemma 3's (GEMMA3_CHAT_TEMPLATE).
    reader: the file's `gguf.GGUFReader`, if the caller parsed it already."""
    from gguf import GGUFReader

    reader = reader or GGUFReader(path)
    template = field(reader, "tokenizer.chat_template")
    if template is None and field(reader, "general.architecture") == "gemma3":
        return GEMMA3_CHAT_TEMPLATE
    return template
