"""Compiled steps shared by the runners of one process (`model_runner._SHARED_EXECUTABLES`): an engine equal to one
built before takes its executables instead of compiling again; one that differs in anything its step's trace reads
compiles its own."""

from __future__ import annotations

import functools

import numpy as np
import pytest

from jaxpaged import SamplingParams
from jaxpaged.models import quant
from jaxpaged.worker import model_runner
from tests.tiny import random_params, random_prompts, tiny_config, tiny_llm

CONFIG = tiny_config()
PARAMS = random_params(CONFIG, seed=3)
PROMPTS = [{"prompt_token_ids": p} for p in random_prompts(3, 4, 12, seed=5)]
GREEDY = SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True)


def _run(**options):
    llm = tiny_llm(CONFIG, PARAMS, **options)
    tokens = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, GREEDY, use_tqdm=False)]
    return llm.engine.runner, tokens


def test_an_equal_engine_takes_the_executables_of_the_one_before():
    first, tokens = _run()
    second, again = _run()
    assert again == tokens
    assert second.compiled_shapes == first.compiled_shapes
    for key, executable in second._executables.items():
        assert executable is first._executables[key]


@pytest.mark.parametrize("change", ["pool", "model_len", "native_mode"])
def test_an_engine_that_differs_compiles_its_own(monkeypatch, change):
    """A pool of another size, another max_model_len (the step's extra inputs are sized by it) and the quantized
    matmul's mode (read when the step is traced) each give the engine executables of its own."""
    first, tokens = _run()
    # max_model_len 60: the same 8-block tables as 64 (so the same layouts), other extra inputs
    options = {"pool": {"num_blocks": 40}, "model_len": {"max_model_len": 60}}.get(change, {})
    if change == "native_mode":
        monkeypatch.setattr(quant, "NATIVE_MODE", "bf16")
    other, again = _run(**options)
    assert again == tokens
    shared = set(other._executables) & set(first._executables)
    assert shared and all(other._executables[k] is not first._executables[k] for k in shared)


def test_the_process_keeps_at_most_the_limit(monkeypatch):
    monkeypatch.setattr(model_runner, "SHARED_EXECUTABLES_LIMIT", 1)
    runner, _ = _run(num_blocks=44)
    assert len(runner.compiled_shapes) > 1 and len(model_runner._SHARED_EXECUTABLES) == 1


def test_value_key_compares_partials_and_dataclasses_by_value_and_refuses_arrays():
    def kernel(x, *, strict):
        return x

    assert model_runner.value_key(functools.partial(kernel, strict=True)) == \
        model_runner.value_key(functools.partial(kernel, strict=True))
    assert model_runner.value_key(functools.partial(kernel, strict=True)) != \
        model_runner.value_key(functools.partial(kernel, strict=False))
    with pytest.raises(TypeError):
        model_runner.value_key(functools.partial(kernel, scales=np.ones(2)))
