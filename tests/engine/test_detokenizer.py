"""Incremental detokenization of a real tokenizer: the Rust way (`tokenizers.DecodeStream`, where the tokenizer's
decode is its Rust object's alone) gives the text the Python way gives after every token, and the final text is the
tokenizer's own decode of all of them."""

from __future__ import annotations

import pytest

from jaxpaged.engine.detokenizer import Detokenizer, rust_tokenizer
from tests.default_model import default_model
from tests.text_streams import TEXT, python_way, streamed


@pytest.fixture(scope="module")
def smollm2_tokenizer():
    from jaxpaged.loader.cache import cache_path
    from jaxpaged.loader.tokenizer import directory_tokenizer
    from tests import ROOT

    # the tokenizer files of its converted copy (default_model() writes it): transformers reads them in well under a
    # second, where building the tokenizer from the GGUF's vocabulary takes several
    return directory_tokenizer(cache_path(default_model(), str(ROOT / "checkpoints")))


@pytest.mark.parametrize("skip_special_tokens", [True, False])
def test_the_rust_stream_and_the_python_way_give_the_same_text_after_every_token(smollm2_tokenizer,
                                                                                  skip_special_tokens):
    tok = smollm2_tokenizer
    assert rust_tokenizer(tok) is not None  # the default model's tokenizer takes the Rust way
    ids = tok.encode(TEXT, add_special_tokens=False)
    ids = ids[:7] + [tok.eos_token_id] + ids[7:]  # a special token mid-way: skipped, or shown
    fast, fast_texts = streamed(tok, ids, skip_special_tokens=skip_special_tokens)
    slow, slow_texts = streamed(python_way(tok), ids, skip_special_tokens=skip_special_tokens)
    assert fast._stream is not None and slow._stream is None
    assert fast_texts == slow_texts
    assert fast_texts[-1] == tok.decode(ids, skip_special_tokens=skip_special_tokens)
    assert all("\ufffd" not in t and fast_texts[-1].startswith(t) for t in fast_texts)
    assert (tok.eos_token in fast_texts[-1]) is not skip_special_tokens


def test_stop_strings_work_on_the_rust_way(smollm2_tokenizer):
    tok = smollm2_tokenizer
    ids = tok.encode("The keeper wrote END and more", add_special_tokens=False)
    d = Detokenizer(tok, stop=["END"])
    for i in range(1, len(ids) + 1):
        before = len(d.text)
        d.add(ids[:i])
        if d.check_stop(len(d.text) - before):
            break
    assert d._stream is not None and d.stopped_on == "END" and d.text == "The keeper wrote "


def test_a_tokenizer_that_cleans_up_spaces_takes_the_python_way(smollm2_tokenizer):
    """transformers' clean-up of spaces is not the Rust decoder's: such a tokenizer keeps the Python way."""
    import copy

    tok = copy.deepcopy(smollm2_tokenizer)
    tok.clean_up_tokenization_spaces = True
    assert rust_tokenizer(tok) is None and Detokenizer(tok)._stream is None
