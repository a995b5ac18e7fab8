"""Fixtures of the model tests."""

from __future__ import annotations

import os

import pytest


@pytest.fixture(scope="module")
def gguf_parsed_once():
    """For the module: `gguf.GGUFReader(path)` parses each file once and hands every later caller the same reader.

    Gemma 3 270M's GGUF carries a 262k-token vocabulary, and gguf's reader parses it in ~10 s (2 cores); transformers
    alone parses the file three times (config, tensors, tokenizer) and jaxpaged's loader once more. The reader is
    read-only (a memory map and the fields parsed from it), so sharing it changes no value either side reads."""
    import gguf

    parse = gguf.GGUFReader
    readers = {}

    def reader(path, mode="r"):
        key = (os.path.realpath(path), mode)
        if key not in readers:
            readers[key] = parse(path, mode)
        return readers[key]

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(gguf, "GGUFReader", reader)
        yield
