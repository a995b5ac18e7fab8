"""Tiny random-weight models (Llama, Qwen2 with biases, Qwen3 with q/k norms, Mistral with a sliding window, llama3
rope scaling; GQA ratios 1, 2, 3 and 4) loaded by path, against transformers on the same files.

Tolerance: first-token log-probs within 1e-4 (float32, 2 layers); greedy tokens identical, one at a time and batched.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from jaxpaged import LLM, SamplingParams
from tests.logprob_checks import check_entries
from tests.tiny_hf import make_tiny_hf_model

CASES = {
    "llama_gqa2": ("llama", {}),
    "llama_mha_gqa1": ("llama", {"num_attention_heads": 4, "num_key_value_heads": 4}),
    "llama_gqa3": ("llama", {"hidden_size": 96, "num_attention_heads": 6, "num_key_value_heads": 2}),
    "llama_gqa4_tied": ("llama_tied", {"num_attention_heads": 8, "num_key_value_heads": 2}),
    "llama3_rope_scaling": ("llama3", {}),
    "qwen2_bias": ("qwen2", {}),
    "qwen3_qk_norm": ("qwen3", {}),
    "qwen3_gqa4_head_dim_32": ("qwen3", {"num_attention_heads": 8, "num_key_value_heads": 2, "head_dim": 32}),
    "mistral_sliding_window": ("mistral", {"sliding_window": 16}),
}
NEW = 16


def prompts(vocab: int) -> list[list[int]]:
    rng = np.random.default_rng(3)
    return [rng.integers(3, vocab, size=n).tolist() for n in (5, 23, 41)]


@pytest.mark.parametrize("case", list(CASES))
def test_matches_transformers(case, tmp_path):
    import transformers

    kind, overrides = CASES[case]
    path = make_tiny_hf_model(tmp_path / case, kind, **overrides)
    hf = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    ps = prompts(hf.config.vocab_size)
    llm = LLM(path, dtype="float32", max_num_seqs=4, max_num_batched_tokens=64, max_model_len=128, block_size=8,
              kv_cache_memory="16MiB", precompile=False, show_progress=False)

    # the first token's log-probs, greedy and drawn at a high temperature (a drawn token's rank is rarely 1)
    greedy = SamplingParams(temperature=0.0, max_tokens=1, logprobs=20)
    drawn = SamplingParams(temperature=5.0, seed=1, max_tokens=1, logprobs=2, n=3)
    for params in (greedy, drawn):
        outs = llm.generate([{"prompt_token_ids": p} for p in ps], params, use_tqdm=False)
        for p, out in zip(ps, outs, strict=True):
            with torch.no_grad():
                ref = torch.log_softmax(hf(torch.tensor([p])).logits[0, -1].double(), -1).numpy()
            for o in out.outputs:
                check_entries(o.logprobs[0], o.token_ids[0], ref, params.logprobs, 1e-4, llm.get_tokenizer())

    want = []
    for p in ps:
        with torch.no_grad():
            seq = hf.generate(torch.tensor([p]), max_new_tokens=NEW, min_new_tokens=NEW, do_sample=False,
                              pad_token_id=0)
        want.append(seq[0, len(p):].tolist())
    params = SamplingParams(temperature=0.0, max_tokens=NEW, min_tokens=NEW)  # HF's min_new_tokens bans EOS too
    alone = [llm.generate([{"prompt_token_ids": p}], params, use_tqdm=False)[0].outputs[0].token_ids for p in ps]
    batched = [o.outputs[0].token_ids for o in llm.generate([{"prompt_token_ids": p} for p in ps], params,
                                                             use_tqdm=False)]
    assert alone == want
    assert batched == want
