"""The typed public API (issue #32): the options a type checker sees are exactly EngineConfig's, options and a config
combine, a module handed to `LLM.from_model` is left as it was, and building an engine changes no jax.config setting
unless an option asks."""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys
import textwrap
import typing

import jax
import numpy as np
import pytest
from flax import nnx

import jaxpaged
from jaxpaged import EngineConfig, EngineOptions, SamplingParams
from tests import ROOT
from tests.tiny import random_params, tiny_config


def test_engine_options_are_engine_config_fields_with_the_same_types():
    """`EngineOptions` (what `LLM(**options)` is annotated with) names every EngineConfig field and no other, each
    with EngineConfig's type: an option added to one and not the other fails here, naming it."""
    config_types = typing.get_type_hints(EngineConfig)
    option_types = typing.get_type_hints(EngineOptions)
    assert sorted(set(config_types) - set(option_types)) == [], "EngineConfig fields missing from EngineOptions"
    assert sorted(set(option_types) - set(config_types)) == [], "EngineOptions keys that EngineConfig lacks"
    wrong = {name: (option_types[name], config_types[name]) for name in config_types
             if option_types[name] != config_types[name]}
    assert not wrong, f"types differ (EngineOptions, EngineConfig): {wrong}"
    assert not EngineOptions.__required_keys__, "every option is optional (EngineConfig has a default for each)"


def test_the_model_contract_and_configs_are_top_level_exports():
    from jaxpaged.config import ModelConfig
    from jaxpaged.models.contract import CausalLM, ModelSpec
    from jaxpaged.worker.attention import AttentionBackend, AttentionMetadata, KVPool

    exported = {name: getattr(jaxpaged, name) for name in jaxpaged.__all__}
    assert exported["ModelConfig"] is ModelConfig and exported["ModelSpec"] is ModelSpec
    assert exported["CausalLM"] is CausalLM and exported["KVPool"] is KVPool
    assert exported["AttentionMetadata"] is AttentionMetadata and exported["AttentionBackend"] is AttentionBackend
    assert (ROOT / "jaxpaged" / "py.typed").is_file()


def test_an_unknown_option_is_a_value_error_naming_it_before_anything_loads():
    # The model path does not exist: the options are refused first, so the error is about them, not the file.
    with pytest.raises(ValueError, match=r"unknown engine option\(s\): max_num_seq\b.*known: .*max_num_seqs"):
        jaxpaged.LLM("/no/such/model", max_num_seq=8)
    with pytest.raises(TypeError, match="config must be an EngineConfig, not dict"):
        jaxpaged.LLM("/no/such/model", config={"max_num_seqs": 8})


def test_keywords_replace_the_fields_of_a_given_config():
    config = EngineConfig(max_num_seqs=3, seed=5, dtype="float32", max_num_batched_tokens=64, max_model_len=64,
                          block_size=8, num_blocks=48, precompile=False, show_progress=False)
    llm = jaxpaged.LLM.from_params(tiny_config(), random_params(tiny_config()), config=config, seed=9)
    assert llm.engine.config == dataclasses.replace(config, seed=9)
    with pytest.raises(ValueError, match="max_num_seqs"):  # checked as EngineConfig checks it
        jaxpaged.LLM.from_params(tiny_config(), random_params(tiny_config()), config=config, max_num_seqs=0)


def _snapshot(module: nnx.Module) -> tuple:
    """The module's structure (attribute names, variable types) and every array it holds, copied to numpy."""
    graphdef, state = nnx.split(module)
    return graphdef, {path: np.array(v) for path, v in nnx.to_flat_state(state)}


def test_from_model_leaves_the_callers_module_as_it_was():
    """On CPU with a 16-bit dtype the engine keeps a transposed copy of a tied LM head (and may prepack weights for
    the native matmul): that happens on its own copy, so the module the caller passed keeps its attributes, dtypes and
    values, and still runs the same afterwards."""
    from jaxpaged.models import families

    config = tiny_config(tie_word_embeddings=True)
    module = families.from_params(config, random_params(config))
    before = _snapshot(module)
    llm = jaxpaged.LLM.from_model(module, None, dtype="bfloat16", max_num_seqs=2, max_num_batched_tokens=64,
                                  max_model_len=64, block_size=8, num_blocks=32, precompile=False, show_progress=False)
    out = llm.generate([{"prompt_token_ids": [3, 4, 5]}], SamplingParams(max_tokens=4, temperature=0, ignore_eos=True),
                       use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 4
    assert jax.default_backend() != "cpu" or "head_t" in vars(nnx.merge(llm.engine.runner.graphdef,
                                                                       llm.engine.runner.params)), \
        "the engine's own copy should carry the transposed head (else this test checks nothing)"
    graphdef, arrays = _snapshot(module)
    assert "head_t" not in vars(module)
    assert graphdef == before[0]
    assert arrays.keys() == before[1].keys()
    for path, value in before[1].items():
        assert arrays[path].dtype == value.dtype and np.array_equal(arrays[path], value), path


def test_from_params_takes_an_nnx_state_and_leaves_it_as_it_was():
    """`params` may be the `nnx.State` of a module (e.g. after fine-tuning), cast by `dtype` on the engine's side."""
    from jaxpaged.models import families

    config = tiny_config(tie_word_embeddings=True)
    state = nnx.state(families.from_params(config, random_params(config)), nnx.Param)
    before = {path: np.array(v) for path, v in nnx.to_flat_state(state)}
    llm = jaxpaged.LLM.from_params(config, state, dtype="bfloat16", max_num_seqs=2, max_model_len=64, block_size=8,
                                   num_blocks=32, precompile=False, show_progress=False)
    assert llm.engine.runner.params["embed"][...].dtype == jax.numpy.bfloat16
    after = {path: np.array(v) for path, v in nnx.to_flat_state(state)}
    assert after.keys() == before.keys()
    assert all(after[p].dtype == np.float32 and np.array_equal(after[p], before[p]) for p in before)


def _run_python(code: str) -> subprocess.CompletedProcess:
    # A fresh process without the session's cache settings (conftest sets jax.config and JAX's environment
    # variables), which would hide a change.
    env = {k: v for k, v in os.environ.items() if not k.startswith(("JAX_COMPILATION_CACHE", "JAX_PERSISTENT_CACHE"))}
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=300)


def test_building_an_engine_with_defaults_leaves_jax_config_alone(tmp_path):
    """No process-wide change unless asked: an engine built with default options leaves the persistent
    compilation cache off; with `compilation_cache_dir` it turns it on there."""
    result = _run_python(f"""
        import jax
        from tests.tiny import tiny_llm
        before = (jax.config.jax_compilation_cache_dir, jax.config.jax_persistent_cache_min_compile_time_secs)
        tiny_llm()
        after = (jax.config.jax_compilation_cache_dir, jax.config.jax_persistent_cache_min_compile_time_secs)
        assert before == after, (before, after)
        tiny_llm(compilation_cache_dir={str(tmp_path / "xla")!r})
        assert jax.config.jax_compilation_cache_dir == {str(tmp_path / "xla")!r}, jax.config.jax_compilation_cache_dir
        print("ok", before)
    """)
    assert result.returncode == 0 and "ok" in result.stdout, result.stderr[-3000:]
    assert (tmp_path / "xla").is_dir()

