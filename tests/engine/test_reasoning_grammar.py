"""A thinking model's structured output (reasoning_parser, as in vLLM): the grammar constrains the answer after
</think>, not the reasoning before it; a qwen3 sequence that does not open a think block is constrained from its
first token; a tokenizer without one-token tags leaves the grammar on the whole output (and start-up says so)."""

from __future__ import annotations

import json
import logging

import jsonschema
import pytest

from jaxpaged import LLM, SamplingParams
from jaxpaged.engine.setup import EngineConfig
from jaxpaged.sampling_params import StructuredOutputsParams
from tests.tiny_hf import EOS_ID, TINY_VOCAB, make_tiny_hf_model, make_tiny_thinking_model

THINK, END = TINY_VOCAB, TINY_VOCAB + 1  # the tags' ids in make_tiny_thinking_model's tokenizer
SCHEMA = {"type": "object", "properties": {"answer": {"type": "integer", "minimum": 0, "maximum": 99}},
          "required": ["answer"], "additionalProperties": False}
OPTIONS = dict(dtype="float32", max_num_seqs=8, max_num_batched_tokens=256, max_model_len=256, block_size=16,
               num_blocks=200, precompile=False, show_progress=False, enable_prefix_caching=False)


def params(n=4, bias=None, **kw):
    # EOS held back (it would end a reasoning before its </think>); the grammar still lets it end the answer
    return SamplingParams(n=n, temperature=1.0, seed=7, max_tokens=160,
                          logit_bias={EOS_ID: -100.0, **(bias or {})},
                          structured_outputs=StructuredOutputsParams(json=SCHEMA), **kw)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_tiny_thinking_model(tmp_path_factory.mktemp("thinking"))


@pytest.fixture(scope="module")
def r1(model_dir):
    return LLM(model_dir, reasoning_parser="deepseek_r1", **OPTIONS)


@pytest.fixture(scope="module")
def qwen3(model_dir):
    return LLM(model_dir, reasoning_parser="qwen3", **OPTIONS)


def answer_of(llm, completion) -> tuple[list[int], str]:
    """(the reasoning's tokens, the answer's text): the output split at its first </think>."""
    ids = completion.token_ids
    assert END in ids, completion
    cut = ids.index(END)
    return ids[:cut], llm.tokenizer.decode(ids[cut + 1:])


def test_deepseek_r1_reasons_freely_then_answers_in_the_schema(r1):
    assert r1.engine.gates_grammars
    prompt = {"prompt_token_ids": r1.tokenizer.encode("What is the answer?", add_special_tokens=False)}
    (out,) = r1.generate([prompt], params(bias={END: 14.0}), use_tqdm=False)
    for c in out.outputs:
        reasoning, answer = answer_of(r1, c)
        assert reasoning, c  # some tokens before </think>, sampled without the grammar:
        assert not r1.tokenizer.decode(reasoning).lstrip().startswith("{"), c  # not what JSON must start with
        jsonschema.validate(json.loads(answer), SCHEMA)
        assert c.finish_reason == "stop", c
    assert len({tuple(c.token_ids) for c in out.outputs}) > 1  # four samples, each gated on its own


def test_qwen3_reasons_when_its_prompt_opens_a_think_block(qwen3):
    prompt = {"prompt_token_ids": qwen3.tokenizer.encode("Think first.", add_special_tokens=False) + [THINK]}
    (out,) = qwen3.generate([prompt], params(bias={END: 14.0}), use_tqdm=False)
    for c in out.outputs:
        reasoning, answer = answer_of(qwen3, c)
        assert reasoning and not qwen3.tokenizer.decode(reasoning).lstrip().startswith("{"), c
        jsonschema.validate(json.loads(answer), SCHEMA)


def test_qwen3_s_first_token_decides_whether_it_reasons(qwen3):
    prompt = {"prompt_token_ids": qwen3.tokenizer.encode("Answer.", add_special_tokens=False)}
    # <think> first (allowed beside the grammar's first tokens): reasoning, then the answer after </think>
    (out,) = qwen3.generate([prompt], params(bias={THINK: 100.0, END: 100.0}), use_tqdm=False)
    for c in out.outputs:
        assert c.token_ids[0] == THINK, c
        _, answer = answer_of(qwen3, c)
        jsonschema.validate(json.loads(answer), SCHEMA)
    # any other first token: the answer starts there, constrained from its first token
    (out,) = qwen3.generate([prompt], params(bias={THINK: -100.0, END: 100.0}), use_tqdm=False)
    for c in out.outputs:
        assert END not in c.token_ids and THINK not in c.token_ids, c
        jsonschema.validate(json.loads(c.text), SCHEMA)
        assert c.finish_reason == "stop", c


def test_without_one_token_tags_the_grammar_holds_from_the_first_token(tmp_path, caplog):
    path = make_tiny_hf_model(tmp_path, "qwen3")  # the tiny tokenizer has no <think> token
    with caplog.at_level(logging.WARNING, logger="jaxpaged"):
        llm = LLM(path, reasoning_parser="deepseek_r1", **OPTIONS)
    assert not llm.engine.gates_grammars
    assert "reasoning_parser=deepseek_r1: the tokenizer has no <think> and </think> of one token each" in caplog.text
    (out,) = llm.generate(["What is the answer?"], params(n=2), use_tqdm=False)
    for c in out.outputs:
        jsonschema.validate(json.loads(c.text), SCHEMA)


def test_an_unknown_reasoning_parser_is_refused_naming_the_option():
    with pytest.raises(ValueError, match="reasoning_parser"):
        EngineConfig(reasoning_parser="r2")
