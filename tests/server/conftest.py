"""Fixtures the server tests share: one tiny random-weight Llama directory per test session (servers only read it)
and its tokenizer."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.tiny_hf import make_tiny_hf_model


@pytest.fixture(scope="session")
def model_dir(tmp_path_factory) -> Path:
    # Logits are spread (no near-ties), which the batch-invariance checks rely on; every id decodes.
    return Path(make_tiny_hf_model(tmp_path_factory.mktemp("tiny_model"), "llama"))


@pytest.fixture(scope="session")
def tokenizer(model_dir):
    import transformers

    return transformers.AutoTokenizer.from_pretrained(str(model_dir))
