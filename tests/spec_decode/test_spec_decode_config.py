"""`SpeculativeConfig`: vLLM's names and defaults, and a clear error naming the field for every bad input."""

from __future__ import annotations

import pytest
from flax import nnx

from jaxpaged.spec_decode.config import DEFAULT_PROMPT_LOOKUP, MAX_SPECULATIVE_TOKENS, SpeculativeConfig
from tests.tiny import tiny_config


def test_ngram_dict_as_vllm_takes_it():
    c = SpeculativeConfig.from_dict({"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 2,
                                     "prompt_lookup_max": 5})
    assert (c.method, c.num_speculative_tokens, c.prompt_lookup_min, c.prompt_lookup_max) == ("ngram", 4, 2, 5)
    assert c.model is None and c.disable_by_batch_size is None and c.min_acceptance_rate == 0.0


@pytest.mark.parametrize("given,want", [({}, (DEFAULT_PROMPT_LOOKUP, DEFAULT_PROMPT_LOOKUP)),
                                        ({"prompt_lookup_max": 3}, (3, 3)), ({"prompt_lookup_min": 2}, (2, 2))])
def test_ngram_bounds_default_as_vllm(given, want):
    c = SpeculativeConfig.from_dict({"method": "ngram", "num_speculative_tokens": 2, **given})
    assert (c.prompt_lookup_min, c.prompt_lookup_max) == want


def test_method_inferred_from_a_draft():
    assert SpeculativeConfig.from_dict({"model": "/some/draft", "num_speculative_tokens": 3}).method == "draft_model"
    assert SpeculativeConfig.from_dict({"draft_num_layers": 2, "num_speculative_tokens": 3}).method == "draft_model"
    legacy = SpeculativeConfig.from_dict({"model": "ngram", "num_speculative_tokens": 3})
    assert legacy.method == "ngram" and legacy.model is None
    assert SpeculativeConfig.from_dict({"method": "[ngram]", "num_speculative_tokens": 3}).method == "ngram"


def test_a_module_is_a_draft():
    from jaxpaged.models.llama import LlamaForCausalLM

    module = LlamaForCausalLM(tiny_config(), rngs=nnx.Rngs(0))
    c = SpeculativeConfig.coerce({"model": module, "num_speculative_tokens": 2})
    assert c.method == "draft_model" and c.model is module
    assert SpeculativeConfig.coerce(c) is c and SpeculativeConfig.coerce(None) is None


def test_switch_offs_are_kept():
    c = SpeculativeConfig.from_dict({"method": "ngram", "num_speculative_tokens": 2, "disable_by_batch_size": 8,
                                     "min_acceptance_rate": 0.25, "acceptance_window": 16, "acceptance_cooldown": 0})
    assert (c.disable_by_batch_size, c.min_acceptance_rate, c.acceptance_window, c.acceptance_cooldown) == (
        8, 0.25, 16, 0)


BAD = {
    "k_zero": ({"method": "ngram", "num_speculative_tokens": 0}, ValueError, "num_speculative_tokens=0"),
    "k_negative": ({"method": "ngram", "num_speculative_tokens": -2}, ValueError, "num_speculative_tokens=-2"),
    "k_above_bound": ({"method": "ngram", "num_speculative_tokens": MAX_SPECULATIVE_TOKENS + 1}, ValueError,
                      f"num_speculative_tokens={MAX_SPECULATIVE_TOKENS + 1} must be between 1 and"),
    "k_float": ({"method": "ngram", "num_speculative_tokens": 2.0}, TypeError, "num_speculative_tokens must be an"),
    "k_bool": ({"method": "ngram", "num_speculative_tokens": True}, TypeError, "num_speculative_tokens"),
    "k_string": ({"method": "ngram", "num_speculative_tokens": "4"}, TypeError, "num_speculative_tokens"),
    "k_missing": ({"method": "ngram"}, ValueError, "num_speculative_tokens is missing"),
    "unknown_method": ({"method": "eagle", "num_speculative_tokens": 2}, ValueError,
                       "method='eagle' is not supported; use one of ngram, draft_model"),
    "method_not_string": ({"method": 3, "num_speculative_tokens": 2}, TypeError, "method must be a string"),
    "no_method_no_draft": ({"num_speculative_tokens": 2}, ValueError, "method is missing"),
    "unknown_key": ({"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_maximum": 3}, ValueError,
                    "unknown key.*'prompt_lookup_maximum'"),
    "min_above_max": ({"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 4,
                       "prompt_lookup_max": 2}, ValueError, "prompt_lookup_min=4 must be <= prompt_lookup_max=2"),
    "min_zero": ({"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 0}, ValueError,
                 "prompt_lookup_min=0 must be >= 1"),
    "max_negative": ({"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_max": -1}, ValueError,
                     "prompt_lookup_max=-1"),
    "lookup_float": ({"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_max": 2.5}, TypeError,
                     "prompt_lookup_max must be an integer"),
    "ngram_with_model": ({"method": "ngram", "num_speculative_tokens": 2, "model": "/a/draft"}, ValueError,
                         "speculative_config.model is for method='draft_model'"),
    "ngram_with_layers": ({"method": "ngram", "num_speculative_tokens": 2, "draft_num_layers": 1}, ValueError,
                          "speculative_config.draft_num_layers is for method='draft_model'"),
    "model_ngram_but_draft_method": ({"method": "draft_model", "model": "ngram", "num_speculative_tokens": 2},
                                     ValueError, "model='ngram' names the ngram method"),
    "draft_with_lookup": ({"model": "/a/draft", "num_speculative_tokens": 2, "prompt_lookup_max": 3}, ValueError,
                          "prompt_lookup_max is for method='ngram'"),
    "draft_without_model": ({"method": "draft_model", "num_speculative_tokens": 2}, ValueError,
                            "speculative_config.model is missing"),
    "model_and_layers": ({"model": "/a/draft", "draft_num_layers": 2, "num_speculative_tokens": 2}, ValueError,
                         "either `model`.*or `draft_num_layers`"),
    "layers_zero": ({"draft_num_layers": 0, "num_speculative_tokens": 2}, ValueError, "draft_num_layers=0"),
    "model_bad_type": ({"model": 42, "num_speculative_tokens": 2}, TypeError,
                       "speculative_config.model must be a path"),
    "batch_size_one": ({"method": "ngram", "num_speculative_tokens": 2, "disable_by_batch_size": 1}, ValueError,
                       "disable_by_batch_size=1 must be >= 2"),
    "batch_size_float": ({"method": "ngram", "num_speculative_tokens": 2, "disable_by_batch_size": 4.0}, TypeError,
                         "disable_by_batch_size must be an integer"),
    "rate_above_one": ({"method": "ngram", "num_speculative_tokens": 2, "min_acceptance_rate": 1.5}, ValueError,
                       "min_acceptance_rate=1.5 must be between 0 and 1"),
    "rate_string": ({"method": "ngram", "num_speculative_tokens": 2, "min_acceptance_rate": "0.5"}, TypeError,
                    "min_acceptance_rate must be a number"),
    "window_zero": ({"method": "ngram", "num_speculative_tokens": 2, "acceptance_window": 0}, ValueError,
                    "acceptance_window=0 must be >= 1"),
    "cooldown_negative": ({"method": "ngram", "num_speculative_tokens": 2, "acceptance_cooldown": -1}, ValueError,
                          "acceptance_cooldown=-1 must be >= 0"),
    "quantization_unknown": ({"model": "/a/draft", "num_speculative_tokens": 2, "quantization": "fp4"}, ValueError,
                             "speculative_config.quantization='fp4'"),
    "quantization_without_model": ({"method": "ngram", "num_speculative_tokens": 2, "quantization": "int8"},
                                   ValueError, "quantization is for a draft model"),
}


@pytest.mark.parametrize("name", list(BAD))
def test_bad_input_names_the_field(name):
    d, error, message = BAD[name]
    with pytest.raises(error, match=message):
        SpeculativeConfig.from_dict(d)


def test_not_a_dict():
    with pytest.raises(TypeError, match="speculative_config must be a dict"):
        SpeculativeConfig.coerce([("method", "ngram")])


def test_draft_layers_checked_against_the_target():
    c = SpeculativeConfig.from_dict({"draft_num_layers": 3, "num_speculative_tokens": 2})
    c.check_target(3)
    with pytest.raises(ValueError, match="draft_num_layers=3 exceeds the target model's 2 layers"):
        c.check_target(2)
