"""A sequence's token history as an array (`Sequence.token_array`, a penalized row's `seen_tokens` each step): kept
and extended, always equal to token_ids."""

from __future__ import annotations

import numpy as np

from jaxpaged.core.request import Sequence
from jaxpaged.sampling_params import SamplingParams


def test_token_array_follows_token_ids_as_tokens_arrive():
    seq = Sequence("r", [5, 6, 7], SamplingParams(max_tokens=8))
    first = seq.token_array()
    assert first.dtype == np.int32 and first.tolist() == [5, 6, 7]
    assert seq.token_array() is first  # nothing new: nothing converted
    seq.num_placeholders = 2
    seq.resolve(11)
    seq.resolve(12)
    assert seq.token_array().tolist() == [5, 6, 7, 11, 12]
    seq.token_ids.append(13)  # the step loop's fast path appends directly
    assert seq.token_array().tolist() == seq.token_ids
    child = seq.fork(sample_index=1, output_token_ids=[40])
    assert child.token_array().tolist() == [5, 6, 7, 40]
    assert seq.token_array().tolist() == [5, 6, 7, 11, 12, 13]
