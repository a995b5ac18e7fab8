"""Bad input gets a clear error naming the problem, and the engine keeps serving afterwards with no leak."""

from __future__ import annotations

import pytest

from jaxpaged import LLM, SamplingParams
from jaxpaged.config import parse_bytes
from tests.tiny import random_params, tiny_config

CONFIG = tiny_config()


@pytest.fixture(scope="module")
def llm():
    return LLM.from_params(CONFIG, random_params(CONFIG), None, max_num_seqs=4, max_num_batched_tokens=64,
                           max_model_len=64, block_size=8, num_blocks=40, precompile=False, show_progress=False)


def still_serves(llm):
    out = llm.generate([{"prompt_token_ids": [5, 6, 7]}], SamplingParams(temperature=0, max_tokens=3),
                       use_tqdm=False)[0]
    assert len(out.outputs[0].token_ids) >= 1
    s = llm.stats()
    assert s["num_used"] == 0 and s["num_running"] == 0 and s["num_waiting"] == 0
    assert not llm.engine.requests


def test_prompt_longer_than_the_context(llm):
    with pytest.raises(ValueError, match="longer than the context.*max_model_len=64"):
        llm.generate([{"prompt_token_ids": [3] * 64}], use_tqdm=False)
    still_serves(llm)


def test_bad_prompt_in_a_batch_rejects_the_batch_and_leaks_nothing(llm):
    with pytest.raises(ValueError, match="longer than the context"):
        llm.generate([{"prompt_token_ids": [3, 4]}, {"prompt_token_ids": [3] * 100}], use_tqdm=False)
    still_serves(llm)


def test_token_ids_outside_the_vocabulary(llm):
    with pytest.raises(ValueError, match=r"\[0, 96\)"):
        llm.generate([{"prompt_token_ids": [3, 96]}], use_tqdm=False)
    with pytest.raises(ValueError, match="empty"):
        llm.generate([{"prompt_token_ids": []}], use_tqdm=False)
    with pytest.raises(ValueError, match="no tokenizer"):
        llm.generate(["text needs a tokenizer"], use_tqdm=False)
    still_serves(llm)


@pytest.mark.parametrize("kwargs, field", [
    ({"max_tokens": 0}, "max_tokens"), ({"max_tokens": -5}, "max_tokens"), ({"temperature": -0.1}, "temperature"),
    ({"top_p": 0.0}, "top_p"), ({"top_p": 1.5}, "top_p"), ({"top_k": -3}, "top_k"), ({"min_p": 2.0}, "min_p"),
    ({"n": 0}, "n"), ({"min_tokens": 9, "max_tokens": 3}, "min_tokens"), ({"stop": [""]}, "stop"),
])
def test_bad_sampling_params_name_the_field(kwargs, field):
    with pytest.raises(ValueError, match=field):
        SamplingParams(**kwargs)


def test_unknown_model_path():
    with pytest.raises((FileNotFoundError, ValueError), match="no/such/model"):
        LLM("/no/such/model", precompile=False)


@pytest.mark.parametrize("kwargs, message", [
    ({"block_size": 12}, "block_size=12 is not supported.*8, 16, 32"),
    ({"dtype": "int8"}, "dtype='int8'"),
    ({"attention_backend": "cuda"}, "attention_backend"),
    ({"kv_cache_memory": "lots"}, "kv_cache_memory='lots'"),
    ({"max_num_seqs": 0}, "max_num_seqs"),
    ({"bogus_option": 1}, "unknown engine option.*bogus_option"),
])
def test_bad_engine_options(kwargs, message):
    with pytest.raises(ValueError, match=message):
        LLM.from_params(CONFIG, random_params(CONFIG), None, precompile=False, **kwargs)


def test_pool_too_small_for_one_max_length_sequence_says_the_numbers():
    with pytest.raises(ValueError, match=r"holds 3 blocks .*needs 8 blocks"):
        LLM.from_params(CONFIG, random_params(CONFIG), None, max_model_len=64, block_size=8, num_blocks=4,
                        precompile=False)


def test_parse_bytes():
    assert parse_bytes("2GiB") == 2 * 2**30
    assert parse_bytes("512MiB") == 512 * 2**20
    assert parse_bytes(1000) == 1000
    with pytest.raises(ValueError):
        parse_bytes("-1GiB")


@pytest.mark.parametrize("kwargs, message", [
    ({"beam_width": 0, "max_tokens": 4}, "beam_width=0"), ({"beam_width": 11, "max_tokens": 4}, "beam_width=11"),
    ({"beam_width": 2, "max_tokens": 0}, "max_tokens=0"),
])
def test_bad_beam_search_params(kwargs, message):
    from jaxpaged import BeamSearchParams

    with pytest.raises(ValueError, match=message):
        BeamSearchParams(**kwargs)


def test_requests_too_big_for_the_engine_are_refused_and_leak_nothing(llm):
    from jaxpaged import BeamSearchParams

    with pytest.raises(ValueError, match="n=5 exceeds max_num_seqs=4"):
        llm.generate([{"prompt_token_ids": [3, 4]}], SamplingParams(n=5), use_tqdm=False)
    with pytest.raises(ValueError, match="beam_width=5 exceeds max_num_seqs=4"):
        llm.beam_search([{"prompt_token_ids": [3, 4]}], BeamSearchParams(beam_width=5, max_tokens=4), use_tqdm=False)
    with pytest.raises(ValueError, match="exceeds max_model_len=64"):
        llm.beam_search([{"prompt_token_ids": [3] * 40}], BeamSearchParams(beam_width=2, max_tokens=30),
                        use_tqdm=False)
    still_serves(llm)
