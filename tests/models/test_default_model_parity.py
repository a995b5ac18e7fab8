"""The embedded default model (SmolLM2-135M-Instruct, real weights) against Hugging Face transformers on CPU: its
loaded tensors, log-probs, greedy and beam-search tokens.

Both read the same GGUF and dequantize it to float32, so the weights are identical. Tolerance on log-probs of
the first generated token: 2e-3 absolute (float32 with different summation orders over 30 layers).
"""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch

from jaxpaged import LLM, SamplingParams
from tests.default_model import default_model
from tests.tiny_hf import LAYER_MAP

pytestmark = pytest.mark.slow  # starts processes or loads a real model: docs/testing.md

PROMPTS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "Explain recursion to a child in two sentences.",
    "List three prime numbers.",
]
NEW_TOKENS = 32


@pytest.fixture(scope="module")
def llm():
    default_model()
    return LLM(dtype="float32", max_num_seqs=8, max_num_batched_tokens=256, max_model_len=512, kv_cache_memory="256MiB",
               precompile=False, show_progress=False)


@pytest.fixture(scope="module")
def hf_model():
    import transformers

    path = default_model()
    model = transformers.AutoModelForCausalLM.from_pretrained(
        os.path.dirname(path), gguf_file=os.path.basename(path), dtype=torch.float32)
    return model.eval()


@pytest.fixture(scope="module")
def prompt_ids(llm):
    return [llm.apply_chat_template([{"role": "user", "content": p}]) for p in PROMPTS]


@pytest.fixture(scope="module")
def hf_greedy(hf_model, prompt_ids):
    outs = []
    for ids in prompt_ids:
        with torch.no_grad():
            out = hf_model.generate(torch.tensor([ids]), max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS,
                                    do_sample=False, pad_token_id=0)
        outs.append(out[0, len(ids):].tolist())
    return outs


def test_first_token_logprobs_match_transformers(llm, hf_model, prompt_ids):
    params = SamplingParams(temperature=0.0, max_tokens=1, logprobs=20)
    outs = llm.generate([{"prompt_token_ids": ids} for ids in prompt_ids], params, use_tqdm=False)
    for ids, out in zip(prompt_ids, outs, strict=True):
        with torch.no_grad():
            ref = torch.log_softmax(hf_model(torch.tensor([ids])).logits[0, -1].double(), -1).numpy()
        ours = out.outputs[0].logprobs[0]
        top_ref = np.argsort(-ref)[:20]
        assert set(ours) >= set(top_ref[:5].tolist()), "top tokens differ from transformers"
        for token, lp in ours.items():
            assert abs(lp.logprob - ref[token]) < 2e-3, (token, lp, ref[token])


def test_greedy_matches_transformers_one_at_a_time(llm, prompt_ids, hf_greedy):
    params = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, min_tokens=NEW_TOKENS)  # as HF bans EOS
    for ids, want in zip(prompt_ids, hf_greedy, strict=True):
        out = llm.generate([{"prompt_token_ids": ids}], params, use_tqdm=False)[0]
        assert out.outputs[0].token_ids == want


def test_greedy_matches_transformers_in_one_batch(llm, prompt_ids, hf_greedy):
    params = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, min_tokens=NEW_TOKENS)  # as HF bans EOS
    outs = llm.generate([{"prompt_token_ids": ids} for ids in prompt_ids], params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == hf_greedy


def test_chat_answers_the_question(llm):
    out = llm.chat([{"role": "user", "content": "What is the capital of France?"}],
                   SamplingParams(temperature=0.0, max_tokens=24), use_tqdm=False)[0]
    assert "Paris" in out.outputs[0].text
    assert out.outputs[0].finish_reason in ("stop", "length")
    assert llm.stats()["num_used"] == 0  # every block back in the pool (cached blocks count as free)


@pytest.mark.parametrize("prompt_index", [0, 2])
def test_beam_search_matches_transformers(llm, hf_model, prompt_ids, prompt_index):
    """HF generate(num_beams=4, do_sample=False, length_penalty=1.0, early_stopping=False); EOS ends a hypothesis
    and stays in its tokens; our best hypothesis equals HF's returned sequence."""
    from jaxpaged import BeamSearchParams

    ids = prompt_ids[prompt_index]
    max_new = 12
    with torch.no_grad():
        out = hf_model.generate(torch.tensor([ids]), num_beams=4, do_sample=False, max_new_tokens=max_new,
                                length_penalty=1.0, early_stopping=False, pad_token_id=0)
    want = out[0, len(ids):].tolist()
    eos = hf_model.generation_config.eos_token_id
    eos = set(eos if isinstance(eos, list) else [eos])
    for i, t in enumerate(want):  # HF pads a hypothesis that ended early
        if t in eos:
            want = want[: i + 1]
            break
    res = llm.beam_search([{"prompt_token_ids": ids}], BeamSearchParams(beam_width=4, max_tokens=max_new),
                          use_tqdm=False)[0]
    # vLLM's BeamSearchOutput: tokens and text include the prompt
    best = res.sequences[0]
    assert best.tokens == ids + want and len(res.sequences) == 4
    assert best.text == llm.tokenizer.decode(ids + want, skip_special_tokens=True)
    scores = [s.cum_logprob / (len(s.tokens) - len(ids)) for s in res.sequences]
    assert scores == sorted(scores, reverse=True)
    assert llm.stats()["num_used"] == 0


def test_output_kinds(llm):
    """CUMULATIVE: every output holds everything so far; DELTA: only what is new, and the pieces add up to the same
    text, tokens and log-probs (for each of n=2 samples); FINAL_ONLY: one output, when the request finishes. The
    engine's token outputs go through the output processor (`RequestState`), as the server and `LLM` do."""
    from jaxpaged import RequestOutputKind
    from jaxpaged.engine.output_processor import RequestState

    engine = llm.engine
    prompt = {"prompt_token_ids": llm.tokenizer.encode(PROMPTS[0])}
    states = {}
    for kind in RequestOutputKind:
        params = SamplingParams(n=2, temperature=0.8, seed=7, max_tokens=12, logprobs=2, ignore_eos=True,
                                output_kind=kind)
        req = engine.make_request(kind.name, prompt, params)
        engine.enqueue(req)
        states[kind.name] = RequestState(llm.tokenizer, kind.name, None, prompt["prompt_token_ids"], params,
                                         req.arrival_time)
    seen = {kind.name: [] for kind in RequestOutputKind}
    while engine.has_unfinished_requests():
        for out in engine.step():
            result = states[out.request_id].update(out)
            if result is not None:
                seen[out.request_id].append(result)
    cumulative, delta, final = (seen[k.name] for k in RequestOutputKind)
    assert len(final) == 1 and final[0].finished and len(cumulative) == len(delta) > 1
    assert not any(o.finished for o in delta[:-1]) and delta[-1].finished
    for i in range(2):
        whole = cumulative[-1].outputs[i]
        assert len(whole.token_ids) == 12 and whole.text
        assert [len(o.outputs[i].token_ids) for o in cumulative] == list(range(1, 13))
        assert "".join(o.outputs[i].text for o in delta) == whole.text == final[0].outputs[i].text
        assert sum((o.outputs[i].token_ids for o in delta), []) == whole.token_ids == final[0].outputs[i].token_ids
        assert sum((o.outputs[i].logprobs for o in delta), []) == whole.logprobs
        assert all(len(o.outputs[i].token_ids) == 1 for o in delta)


def test_our_gguf_loading_equals_transformers(hf_model):
    """The loader's float32 params of the default GGUF against transformers' state dict of the same file: q and k
    un-permuted, every other tensor as stored, the config's fields."""
    from jaxpaged.loader.gguf_file import load_gguf

    config, params = load_gguf(default_model())
    hf_cfg, state = hf_model.config, {k: v.numpy() for k, v in hf_model.state_dict().items()}
    assert (config.num_layers, config.num_heads, config.num_kv_heads, config.head_dim) == (30, 9, 3, 64)
    assert config.tie_word_embeddings and "lm_head" not in params and config.eos_token_ids == (2,)
    assert config.vocab_size == hf_cfg.vocab_size == 49152 and config.rope_theta == hf_cfg.rope_parameters["rope_theta"]
    assert config.rms_norm_eps == pytest.approx(hf_cfg.rms_norm_eps, rel=1e-6)
    layers = params["layers"]
    for i in (0, 17, 29):
        for suffix, ours in LAYER_MAP.items():
            if ours in layers:  # q, k (un-permuted), v, o, norms, gate/up/down
                np.testing.assert_array_equal(layers[ours][i], state[f"model.layers.{i}.{suffix}"].T,
                                              err_msg=f"{ours}[{i}]")
    np.testing.assert_array_equal(params["embed"], state["model.embed_tokens.weight"])
    np.testing.assert_array_equal(params["final_norm"], state["model.norm.weight"])
