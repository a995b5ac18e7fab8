"""The fixed workloads the benchmarks share, cut from one text: 64 prompts of 32-256 tokens (memory, sharing,
profile_steps, serving) and issue #11's throughput workload, 48 prompts of 24-320 tokens with 96 new tokens each
(throughput.py)."""

from __future__ import annotations

import numpy as np

TEXT = """\
The lighthouse keeper kept a ledger of every ship that passed the point, and over forty years the ledger grew into
a history of the coast. Fishing boats came first, with their nets heaped on deck and gulls wheeling behind them;
then the coal steamers, low in the water, trailing smoke that hung over the bay for hours on a still day. In
winter the storms came from the north-east and the keeper climbed the spiral stair every three hours to trim the
wick and wipe the salt from the glass. He wrote down the wind, the swell, the colour of the sky at dawn, and the
names of the men who rowed out to the wrecks. Some nights nothing passed at all, and he wrote that too, because a
quiet night was also a fact about the sea. His daughter learned to read from the ledger. She traced the names of
ships with her finger, Mary Ellen, North Star, Good Intent, and asked where each had been going and whether it
had arrived. Most had, he told her, and the ones that had not were marked with a small cross in the margin. When
she grew up she became a surveyor and drew the charts that later ships used to find their way past the reef, and
she said that every line on those charts began with a number in her father's book. Engineers measure a bridge by
the load it carries and the years it stands; gardeners measure a season by what the frost spares; teachers
measure a year by the questions their students learn to ask. Computers that answer questions measure themselves
in tokens per second and in the memory each conversation holds, and the people who build them spend their days
arranging that memory so that nothing is wasted: no slot reserved for words that will never be written, no copy
of a shared beginning kept twice, no request left waiting while another hoards space it does not need.
"""

NUM_PROMPTS = 64
MIN_LEN, MAX_LEN = 32, 256
NEW_TOKENS = 128

# benchmarks/throughput.py (issue #11)
THROUGHPUT_NUM_PROMPTS = 48
THROUGHPUT_MIN_LEN, THROUGHPUT_MAX_LEN = 24, 320
THROUGHPUT_NEW_TOKENS = 96


def workload_prompts(tokenizer, num_prompts: int = NUM_PROMPTS, seed: int = 0, min_len: int = MIN_LEN,
                     max_len: int = MAX_LEN) -> list[list[int]]:
    """Prompt token ids: lengths uniform in [min_len, max_len] (numpy seed 0), cut cyclically from TEXT's tokens."""
    ids = tokenizer(TEXT)["input_ids"]
    rng = np.random.default_rng(seed)
    lengths = rng.integers(min_len, max_len + 1, size=num_prompts)
    starts = rng.integers(0, len(ids), size=num_prompts)
    doubled = ids * (2 + max_len // len(ids))
    return [doubled[s:s + n] for s, n in zip(starts, lengths, strict=True)]
