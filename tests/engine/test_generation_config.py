"""vLLM's generation_config="auto": the sampling values of a model's generation_config.json are the defaults of
requests that leave them unset, in `LLM.generate`, `AsyncEngine` and over HTTP; "vllm" keeps vLLM's own."""

from __future__ import annotations

import json
import os

import pytest

from jaxpaged import LLM, SamplingParams
from jaxpaged.entrypoints.openai.protocol import ChatCompletionRequest, CompletionRequest
from tests.tiny_hf import make_tiny_hf_model

OPTS = dict(dtype="float32", max_num_seqs=4, max_num_batched_tokens=64, max_model_len=128, block_size=8,
            kv_cache_memory="16MiB", precompile=False, show_progress=False)
# top_k 1: a draw that always picks the most likely token, so the defaults' output is the greedy one
MODEL_DEFAULTS = {"top_k": 1, "temperature": 0.7, "max_new_tokens": 5, "do_sample": True}


def with_generation_config(path: str, values: dict) -> str:
    file = os.path.join(path, "generation_config.json")
    with open(file) as f:
        gen = json.load(f)
    with open(file, "w") as f:
        json.dump({**gen, **values}, f)
    return path


@pytest.fixture(scope="module")
def path(tmp_path_factory):
    return with_generation_config(make_tiny_hf_model(tmp_path_factory.mktemp("gen"), "llama"), MODEL_DEFAULTS)


def test_a_request_without_params_samples_with_the_models_defaults(path):
    llm = LLM(path, **OPTS)
    assert llm.get_default_sampling_params() == SamplingParams(top_k=1, temperature=0.7, max_tokens=5)
    assert llm.engine.generation_defaults == {"top_k": 1, "temperature": 0.7, "max_tokens": 5}
    prompts = [{"prompt_token_ids": [5, 9, 30 + i]} for i in range(3)]
    greedy = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=5), use_tqdm=False)
    default = llm.generate(prompts, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in default] == [o.outputs[0].token_ids for o in greedy]
    assert all(len(o.outputs[0].token_ids) <= 5 for o in default)
    given = llm.generate(prompts[:1], SamplingParams(temperature=0.0, max_tokens=9, ignore_eos=True), use_tqdm=False)
    assert len(given[0].outputs[0].token_ids) == 9  # a request's own SamplingParams are its own

    vllm_way = LLM(path, generation_config="vllm", **OPTS)
    assert vllm_way.get_default_sampling_params() == SamplingParams() and not vllm_way.engine.generation_defaults


def test_over_http_unset_fields_take_the_models_defaults():
    defaults = {"top_k": 1, "temperature": 0.7, "max_tokens": 5, "repetition_penalty": 1.2}
    chat = ChatCompletionRequest.model_validate({"messages": [{"role": "user", "content": "hi"}]})
    p = chat.sampling_params(chat.requested_max_tokens, None, defaults=defaults)
    assert (p.top_k, p.temperature, p.max_tokens, p.repetition_penalty, p.top_p) == (1, 0.7, 5, 1.2, 1.0)
    chat = ChatCompletionRequest.model_validate({"messages": [{"role": "user", "content": "hi"}], "top_k": -1,
                                                 "temperature": 0.0, "max_tokens": 3})
    p = chat.sampling_params(chat.requested_max_tokens, None, defaults=defaults)
    assert (p.top_k, p.temperature, p.max_tokens, p.repetition_penalty) == (-1, 0.0, 3, 1.2)
    completion = CompletionRequest.model_validate({"prompt": "hi"})  # OpenAI's max_tokens default, 16, is set
    p = completion.sampling_params(completion.max_tokens, None, defaults=defaults)
    assert (p.max_tokens, p.top_k) == (16, 1)
    assert chat.sampling_params(3, None) == chat.sampling_params(3, None, defaults={})  # no model defaults


@pytest.mark.parametrize("values, field", [({"top_p": 2.0}, "top_p"), ({"temperature": "hot"}, "temperature"),
                                           ({"max_new_tokens": 0}, "max_tokens")])
def test_a_bad_generation_config_is_refused_at_load_naming_the_file(tmp_path, values, field):
    path = with_generation_config(make_tiny_hf_model(tmp_path, "llama"), values)
    with pytest.raises((ValueError, TypeError), match=f"^generation_config.json: {field}"):
        LLM(path, **OPTS)
