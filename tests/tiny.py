"""Tiny in-memory models for engine tests that need no files: a config and random params in the loader's layout."""

from __future__ import annotations

import numpy as np

from jaxpaged.config import ModelConfig


def tiny_config(vocab_size=96, hidden=32, layers=2, heads=4, kv_heads=2, head_dim=8, max_len=256,
                **kw) -> ModelConfig:
    return ModelConfig(vocab_size=vocab_size, hidden_size=hidden, intermediate_size=2 * hidden, num_layers=layers,
                       num_heads=heads, num_kv_heads=kv_heads, head_dim=head_dim, max_position_embeddings=max_len,
                       eos_token_ids=(1,), **kw)


class CharTokenizer:
    """Token t decodes to one letter (a..z); text encodes a letter per token. Enough for the detokenizer and stop
    strings without a real vocabulary."""

    eos_token_id = None

    def decode(self, ids, skip_special_tokens=True):
        return "".join(chr(ord("a") + t % 26) for t in ids)

    def __call__(self, text):
        return {"input_ids": [2 + ord(c) % 90 for c in text]}

    def encode(self, text, add_special_tokens=False):
        """Token ids that decode back to `text`'s letters (26 + letter index)."""
        return [26 + (ord(c) - ord("a")) % 26 for c in text]


def random_params(c: ModelConfig, seed: int = 0) -> dict:
    """Weights scaled so logits stay spread (greedy choices are not near ties)."""
    rng = np.random.default_rng(seed)

    def w(*shape, scale=None):
        scale = scale if scale is not None else 1.0 / np.sqrt(shape[-2])
        return (rng.standard_normal(shape) * scale).astype(np.float32)

    L, H, D, F = c.num_layers, c.hidden_size, c.head_dim, c.intermediate_size
    layers = {
        "attn_norm": 1 + 0.1 * w(L, H, scale=1.0), "mlp_norm": 1 + 0.1 * w(L, H, scale=1.0),
        "wq": w(L, H, c.num_heads * D), "wk": w(L, H, c.num_kv_heads * D), "wv": w(L, H, c.num_kv_heads * D),
        "wo": w(L, c.num_heads * D, H), "w_gate": w(L, H, F), "w_up": w(L, H, F), "w_down": w(L, F, H),
    }
    params = {"embed": w(c.vocab_size, H, scale=1.0), "final_norm": np.ones(H, np.float32), "layers": layers}
    if not c.tie_word_embeddings:
        params["lm_head"] = w(H, c.vocab_size, scale=2.0)
    return params


def random_prompts(n: int, lo: int, hi: int, vocab: int = 96, seed: int = 0) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [rng.integers(2, vocab, size=int(rng.integers(lo, hi + 1))).tolist() for _ in range(n)]


def tiny_llm(config: ModelConfig | None = None, params: dict | None = None, **options):
    """An LLM over a tiny model (default: 2 layers, random weights) with a 48-block pool of 8-token blocks, compiled
    lazily; options are engine options."""
    from jaxpaged import LLM

    config = config or tiny_config(layers=2, heads=4, kv_heads=2, head_dim=8)
    params = params if params is not None else random_params(config)
    options = dict(dtype="float32", max_num_seqs=4, max_num_batched_tokens=64, max_model_len=64, block_size=8,
                   num_blocks=48, precompile=False, show_progress=False) | options  # float32: the numbers tests compare
    return LLM.from_params(config, params, None, **options)


def greedy_tokens(config: ModelConfig, params: dict, prompts: list[list[int]], *, attention_backend: str,
                  max_tokens: int) -> list[list[int]]:
    """Greedy output tokens of each prompt through a `tiny_llm` engine with the given attention backend."""
    from jaxpaged import SamplingParams

    llm = tiny_llm(config, params, attention_backend=attention_backend)
    sp = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], sp, use_tqdm=False)
    return [o.outputs[0].token_ids for o in outputs]



class Collector:
    """Steps an engine and gathers each request's token ids (sample 0) from its per-step outputs (`EngineOutput`
    deltas): `tokens` holds the finished requests', `partial` the running ones'."""

    def __init__(self, engine):
        self.engine = engine
        self.tokens: dict[str, list[int]] = {}
        self.partial: dict[str, list[int]] = {}
        self.finish_reasons: dict[str, str | None] = {}

    def step(self) -> list:
        outs = self.engine.step()
        for out in outs:
            got = self.partial.setdefault(out.request_id, [])
            for delta in out.deltas:
                if delta.index == 0:
                    got += delta.token_ids
                    self.finish_reasons[out.request_id] = delta.finish_reason
            if out.finished:
                self.tokens[out.request_id] = self.partial.pop(out.request_id)
        return outs

    def drain(self) -> dict[str, list[int]]:
        """Steps until the engine has no work left; returns the finished requests' tokens."""
        while self.engine.has_unfinished_requests():
            self.step()
        return self.tokens


def drain(engine) -> dict[str, list[int]]:
    """Steps `engine` until it has no work left; returns each finished request's token ids (sample 0)."""
    return Collector(engine).drain()


def checked(engine):
    """engine.step that checks, after every step, the pool's and the scheduler's invariants and that the runner's
    persistent block tables equal the pool's."""
    original = engine.step

    def step():
        outs = original()
        engine.runner.input_batch.check_tables(engine.block_manager.tables)
        engine.block_manager.check_invariants()
        engine.scheduler.check_invariants()
        return outs

    return step
