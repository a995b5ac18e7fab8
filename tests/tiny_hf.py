"""Tiny random-weight Hugging Face models on disk (config + safetensors + tokenizer), and GGUF copies of them,
for tests that load models by path and compare against transformers on the same files.

    path = make_tiny_hf_model(tmp_path, "llama")     # also "llama_tied", "llama3", "qwen2", "qwen3", "mistral"
    transformers.AutoModelForCausalLM.from_pretrained(path)  and  jaxpaged.loader.load_model(path)

Every kind shares one tokenizer: byte-level BPE trained here on a fixed text, TINY_VOCAB = 384 tokens (ids 0-2 are
<|endoftext|>, <|im_start|>, <|im_end|> as in SmolLM2; 256 single bytes; the rest merges), so any id a model
samples decodes, and a ChatML chat template. The model's vocab_size equals the tokenizer's length.
Weights are drawn so logits are spread (greedy picks are not near-ties): matrices N(0, 1/fan_in), embeddings
N(0, 1), norm weights 1 + N(0, 0.1^2), biases N(0, 0.1^2).
"""

from __future__ import annotations

import functools
import json
import os
from pathlib import Path

import numpy as np

TINY_VOCAB = 384
KINDS = ("llama", "llama_tied", "llama3", "qwen2", "qwen3", "mistral")
SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
BOS_ID, EOS_ID = 1, 2
CHAT_TEMPLATE = ("{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + "
                 "'<|im_end|>' + '\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}"
                 "{% endif %}")
_CORPUS = """The quick brown fox jumps over the lazy dog. A paged attention engine stores keys and values in blocks
of sixteen tokens; the scheduler admits requests while free blocks remain and preempts the youngest when memory
runs out. What is the capital of France? Paris is the capital of France, and Rome is the capital of Italy.
Write a haiku about the sea: waves fold into foam, the tide forgets the shoreline, gulls argue with wind.
Explain recursion to a child: a function that calls itself on a smaller problem until the problem is tiny.
List three prime numbers: two, three, five, seven, eleven, thirteen. 0123456789 + - * / = ( ) [ ] { } < > .
def main(): return sum(x * x for x in range(10)) # Python code, JSON {"key": "value"}, and Markdown **bold**.
user assistant system hello world thank you please answer the question briefly and clearly.
""" * 3


@functools.lru_cache(maxsize=1)
def _tokenizer_json() -> str:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=TINY_VOCAB, special_tokens=list(SPECIAL_TOKENS), show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(_CORPUS.splitlines(), trainer)
    if tok.get_vocab_size() != TINY_VOCAB:
        raise RuntimeError(f"tiny tokenizer has {tok.get_vocab_size()} tokens, wanted {TINY_VOCAB}: grow _CORPUS")
    return tok.to_str()


def make_tiny_tokenizer():
    """A transformers fast tokenizer (TINY_VOCAB tokens, ChatML template, eos <|im_end|>)."""
    from tokenizers import Tokenizer
    from transformers import PreTrainedTokenizerFast

    return PreTrainedTokenizerFast(tokenizer_object=Tokenizer.from_str(_tokenizer_json()), bos_token="<|im_start|>",
                                   eos_token="<|im_end|>", unk_token="<|endoftext|>", pad_token="<|im_end|>",
                                   chat_template=CHAT_TEMPLATE)


def tiny_hf_config(kind: str = "llama", **overrides):
    """A transformers config for `kind`: 2 layers, hidden 64, 4 query heads / 2 kv heads of 16 dims (GQA)."""
    import transformers

    if kind not in KINDS:
        raise ValueError(f"kind={kind!r}; choose one of {', '.join(KINDS)}")
    common = dict(vocab_size=TINY_VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512, rms_norm_eps=1e-5,
                  bos_token_id=BOS_ID, eos_token_id=EOS_ID, pad_token_id=EOS_ID, tie_word_embeddings=False)
    if kind == "llama3":  # original 64 positions: with head_dim 16, two frequencies fall in the smoothed band
        common["rope_scaling"] = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                  "high_freq_factor": 4.0, "original_max_position_embeddings": 64}
        common["rope_theta"] = 10000.0
    if kind in ("llama_tied", "qwen2"):
        common["tie_word_embeddings"] = True
    if kind == "mistral":
        common["sliding_window"] = 4096  # longer than max_position_embeddings: pass e.g. sliding_window=16 to bite
    if kind == "qwen3":  # Qwen3Config's own default head_dim is 128, not hidden / heads
        common["head_dim"] = common["hidden_size"] // common["num_attention_heads"]
    common.update(overrides)
    cls = {"qwen2": transformers.Qwen2Config, "qwen3": transformers.Qwen3Config,
           "mistral": transformers.MistralConfig}.get(kind, transformers.LlamaConfig)
    return cls(**common)


def randomize_(model, seed: int = 0) -> None:
    """Overwrites the weights in place with the spread-logits distribution described in the module docstring."""
    import torch

    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in sorted(model.named_parameters()):
            noise = torch.randn(p.shape, generator=gen, dtype=torch.float32)
            if name.endswith("norm.weight"):
                value = 1 + 0.1 * noise
            elif name.endswith(".bias"):
                value = 0.1 * noise
            elif "embed_tokens" in name or name == "lm_head.weight":
                value = noise
            else:
                value = noise / p.shape[1] ** 0.5
            p.copy_(value.to(p.dtype))


def make_tiny_hf_model(tmp_path, kind: str = "llama", *, seed: int = 0, dtype: str = "float32",
                       max_shard_size: str | None = None, **config_overrides) -> str:
    """Writes a tiny random-weight model of `kind` with its tokenizer into `tmp_path/kind` (`tmp_path` itself
    when it is empty or missing) and returns that directory. `dtype` ("float32" | "bfloat16" | "float16") is the
    dtype of the saved safetensors; `max_shard_size` (e.g. "40KB") shards them; `config_overrides` go to the
    transformers config (e.g. sliding_window=16, num_hidden_layers=3)."""
    import torch
    import transformers

    tmp_path = Path(tmp_path)
    directory = tmp_path if not tmp_path.exists() or not any(tmp_path.iterdir()) else tmp_path / kind
    config = tiny_hf_config(kind, **config_overrides)
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config)
    randomize_(model, seed)
    model = model.to(getattr(torch, dtype))
    kwargs = {"max_shard_size": max_shard_size} if max_shard_size else {}
    model.save_pretrained(directory, **kwargs)
    make_tiny_tokenizer().save_pretrained(directory)
    return str(directory)


THINK_TAGS = ("<think>", "</think>")


def make_tiny_thinking_model(tmp_path, kind: str = "qwen3", **kwargs) -> str:
    """`make_tiny_hf_model` whose tokenizer also has <think> and </think>, each one token (ids TINY_VOCAB and
    TINY_VOCAB + 1, added tokens that decode as text, as in Qwen3's and DeepSeek-R1's vocabularies); the model's
    vocab_size is TINY_VOCAB + 2."""
    from tokenizers import AddedToken

    path = make_tiny_hf_model(tmp_path, kind, vocab_size=TINY_VOCAB + len(THINK_TAGS), **kwargs)
    tok = make_tiny_tokenizer()
    tok.add_tokens([AddedToken(tag, special=False, normalized=False) for tag in THINK_TAGS])
    assert len(tok) == TINY_VOCAB + len(THINK_TAGS)
    tok.save_pretrained(path)
    return path


# ------------------------------------------------------------------------------------------------ GGUF copies
def llama_cpp_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """What llama.cpp's converter does to Llama q/k rows: within each head, HF row e*D/2 + j (rotate-half pairs
    j and j + D/2) moves to row 2j + e (interleaved pairs 2j, 2j+1). w [n_head*D, ...]."""
    half = w.shape[0] // n_head // 2
    return w.reshape(n_head, 2, half, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


# A Llama-family Hugging Face layer's parameter suffix -> the loader's layers key
LAYER_MAP = {
    "input_layernorm.weight": "attn_norm", "self_attn.q_proj.weight": "wq", "self_attn.k_proj.weight": "wk",
    "self_attn.v_proj.weight": "wv", "self_attn.o_proj.weight": "wo", "self_attn.q_proj.bias": "bq",
    "self_attn.k_proj.bias": "bk", "self_attn.v_proj.bias": "bv", "self_attn.q_norm.weight": "q_norm",
    "self_attn.k_norm.weight": "k_norm", "post_attention_layernorm.weight": "mlp_norm",
    "mlp.gate_proj.weight": "w_gate", "mlp.up_proj.weight": "w_up", "mlp.down_proj.weight": "w_down",
}


_GGUF_NAMES = {
    "input_layernorm.weight": "attn_norm.weight", "self_attn.q_proj.weight": "attn_q.weight",
    "self_attn.k_proj.weight": "attn_k.weight", "self_attn.v_proj.weight": "attn_v.weight",
    "self_attn.o_proj.weight": "attn_output.weight", "self_attn.q_proj.bias": "attn_q.bias",
    "self_attn.k_proj.bias": "attn_k.bias", "self_attn.v_proj.bias": "attn_v.bias",
    "self_attn.q_norm.weight": "attn_q_norm.weight", "self_attn.k_norm.weight": "attn_k_norm.weight",
    "post_attention_layernorm.weight": "ffn_norm.weight", "mlp.gate_proj.weight": "ffn_gate.weight",
    "mlp.up_proj.weight": "ffn_up.weight", "mlp.down_proj.weight": "ffn_down.weight",
}


def write_tiny_gguf(hf_dir: str, path: str, qtype: str = "F32", arch: str | None = None,
                    rope_freqs: np.ndarray | None = None, drop: tuple[str, ...] = ()) -> str:
    """Converts a `make_tiny_hf_model` directory to GGUF the way llama.cpp does (names, q/k permute for llama,
    tokenizer metadata); 2-D weights other than the embedding are stored as `qtype` ("F32" | "F16" | "Q8_0"),
    norms and biases as F32. `arch` overrides general.architecture (to test refusals); `rope_freqs` adds
    llama.cpp's llama3 frequency-factor tensor; tensors named in `drop` are left out (to test refusals)."""
    import gguf
    import torch
    import transformers

    cfg = transformers.AutoConfig.from_pretrained(hf_dir)
    state = transformers.AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).state_dict()
    model_arch = cfg.model_type if cfg.model_type in ("qwen2", "qwen3") else "llama"
    w = gguf.GGUFWriter(path, arch or model_arch)
    heads, kv_heads = cfg.num_attention_heads, cfg.num_key_value_heads
    w.add_block_count(cfg.num_hidden_layers)
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_head_count(heads)
    w.add_head_count_kv(kv_heads)
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // heads
    w.add_rope_dimension_count(head_dim)
    w.add_key_length(head_dim)
    w.add_value_length(head_dim)
    w.add_rope_freq_base(float(cfg.rope_parameters["rope_theta"]))
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    w.add_vocab_size(cfg.vocab_size)
    tok = make_tiny_tokenizer()
    vocab = sorted(tok.get_vocab().items(), key=lambda kv: kv[1])
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("default")
    w.add_token_list([t for t, _ in vocab])
    w.add_token_types([3 if t in SPECIAL_TOKENS else 1 for t, _ in vocab])
    merges = json.loads(_tokenizer_json())["model"]["merges"]
    w.add_token_merges([" ".join(m) if isinstance(m, list) else m for m in merges])
    w.add_bos_token_id(BOS_ID)
    w.add_eos_token_id(EOS_ID)
    w.add_chat_template(CHAT_TEMPLATE)

    def add(name: str, t: np.ndarray, quantize: bool):
        if name in drop:
            return
        if not quantize or qtype == "F32":
            w.add_tensor(name, t.astype(np.float32))
        elif qtype == "F16":
            w.add_tensor(name, t.astype(np.float16))
        else:
            q = gguf.quants.quantize(t.astype(np.float32), gguf.GGMLQuantizationType[qtype])
            w.add_tensor(name, q, raw_dtype=gguf.GGMLQuantizationType[qtype])

    add("token_embd.weight", state["model.embed_tokens.weight"].numpy(), False)
    add("output_norm.weight", state["model.norm.weight"].numpy(), False)
    if not cfg.tie_word_embeddings:
        add("output.weight", state["lm_head.weight"].numpy(), True)
    if rope_freqs is not None:
        add("rope_freqs.weight", np.asarray(rope_freqs, np.float32), False)
    for i in range(cfg.num_hidden_layers):
        for hf_suffix, gguf_suffix in _GGUF_NAMES.items():
            key = f"model.layers.{i}.{hf_suffix}"
            if key not in state:
                continue
            t = state[key].numpy()
            if model_arch == "llama" and ".q_proj." in key:
                t = llama_cpp_permute(t, heads)
            elif model_arch == "llama" and ".k_proj." in key:
                t = llama_cpp_permute(t, kv_heads)
            add(f"blk.{i}.{gguf_suffix}", t, t.ndim == 2)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return os.fspath(path)
