"""vLLM's prompt_logprobs against transformers: each prompt token's log-prob given the tokens before it, and the top
k, on a tiny random-weight model in float32; whatever chunking, preemption, prefix-cache hits, n > 1 and the
scheduling around it. Other requests in the same steps keep their outputs."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from jaxpaged import LLM, SamplingParams
from tests.logprob_checks import check_entries
from tests.tiny_hf import make_tiny_hf_model, make_tiny_tokenizer

K = 3
TOKENIZER = make_tiny_tokenizer()


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    import transformers

    path = make_tiny_hf_model(tmp_path_factory.mktemp("tiny"), "llama")
    hf = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    rng = np.random.default_rng(5)
    prompts = [rng.integers(3, hf.config.vocab_size, size=n).tolist() for n in (2, 9, 37, 70)]
    want = []
    for p in prompts:
        with torch.no_grad():
            want.append(torch.log_softmax(hf(torch.tensor([p])).logits[0].double(), -1).numpy())  # [len, V]
    return path, prompts, want


def make_llm(path, **kw) -> LLM:
    opts = dict(dtype="float32", max_num_seqs=4, max_num_batched_tokens=64, max_model_len=128, block_size=8,
                kv_cache_memory="16MiB", precompile=False, show_progress=False)
    return LLM(path, **{**opts, **kw})


def check(out, prompt, ref) -> None:
    """out.prompt_logprobs against transformers' log-softmax `ref` [len, V] of the same prompt: log-probs, ranks (a
    random prompt token's is far from 1), the top k in order; the tokens' texts (the test tokenizer's)."""
    got = out.prompt_logprobs
    assert got is not None and len(got) == len(prompt) and got[0] is None
    for pos in range(1, len(prompt)):  # position pos is predicted by the logits at pos - 1
        check_entries(got[pos], prompt[pos], ref[pos - 1], K, 1e-4, TOKENIZER)


@pytest.mark.parametrize("kw", [{}, {"async_scheduling": False}, {"max_num_batched_tokens": 16},
                                {"num_blocks": 17}])
def test_prompt_logprobs_match_transformers(model, kw):
    """Chunked over several steps (a 16-token budget), in a pool so small that requests preempt each other, sync or
    async; a request without prompt_logprobs beside them gets its own output unchanged."""
    path, prompts, want = model
    llm = make_llm(path, **kw)
    plain = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    alone = [o.outputs[0].token_ids for o in llm.generate([{"prompt_token_ids": p} for p in prompts], plain,
                                                            use_tqdm=False)]
    scored = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True, prompt_logprobs=K)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], [scored, plain, scored, scored], use_tqdm=False)
    for i, (out, p, ref) in enumerate(zip(outs, prompts, want, strict=True)):
        if i == 1:
            assert out.prompt_logprobs is None
        else:
            check(out, p, ref)
        assert out.outputs[0].token_ids == alone[i]
    stats = llm.stats()
    assert stats["num_used"] == 0 and (stats["preemptions"] > 0) == ("num_blocks" in kw)


def test_a_cached_prefix_is_scored_again_and_n_2_scores_once(model):
    """A prompt the prefix cache holds is computed again for its log-probs (a hit would skip its tokens); with n = 2
    both samples share the one prompt_logprobs."""
    path, prompts, want = model
    llm = make_llm(path)
    params = SamplingParams(temperature=1.0, seed=0, max_tokens=4, prompt_logprobs=K, n=2)
    for _ in range(2):
        out = llm.generate([{"prompt_token_ids": prompts[3]}], params, use_tqdm=False)[0]
        check(out, prompts[3], want[3])
        assert len(out.outputs) == 2 and out.num_cached_tokens == 0


def test_prompt_logprobs_bad_values_and_speculation_are_refused(model):
    path, _, _ = model
    for value in (-1, 21, 1.5, True):
        with pytest.raises((ValueError, TypeError), match="^prompt_logprobs"):
            SamplingParams(prompt_logprobs=value)
    llm = make_llm(path, speculative_config={"method": "ngram", "num_speculative_tokens": 2})
    with pytest.raises(ValueError, match="^prompt_logprobs is not supported with speculative decoding"):
        llm.generate([{"prompt_token_ids": [5, 6, 7]}, {"prompt_token_ids": [5, 6]}],
                     [SamplingParams(max_tokens=2), SamplingParams(prompt_logprobs=1)], use_tqdm=False)
    s = llm.stats()  # the whole batch refused: nothing queued or held, and the engine goes on
    assert s["num_used"] == s["num_running"] == s["num_waiting"] == 0 and not llm.engine.requests
    assert len(llm.generate([{"prompt_token_ids": [5, 6, 7]}], SamplingParams(max_tokens=2, ignore_eos=True),
                            use_tqdm=False)[0].outputs[0].token_ids) == 2
