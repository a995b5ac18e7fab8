"""Speculative decoding (issue #31; docs/speculative.md): propose k tokens per sequence cheaply, score them in one
target step, keep the longest prefix the target agrees with. The tokens are always those of plain decoding
(greedy and seeded sampling alike).

    config.py     SpeculativeConfig (vLLM's names; `LLM(speculative_config={...})`), errors naming the field
    ngram.py      prompt-lookup proposer (host numpy), called by `LLMEngine._propose` before each schedule
    draft.py      draft modules: the target's first N layers (shared embedding / norm / head), or a model with the
                  target's vocabulary (checked before its weights load; `quantization` keeps it int8 / GGUF)
    gate.py       when to speculate: `disable_by_batch_size`, and per request a low-acceptance switch-off

Elsewhere: the scheduler gives a row with n proposals a chunk of n + 1 query tokens (prefill-shaped: the kernels'
multi-token queries), `worker.step` scores it and verifies with `worker.rejection_sampler` (q one-hot for a
deterministic proposer), a draft proposes the next step's tokens inside the same jitted step (its own KV pool with
the target's block tables), and `core.block_manager.BlockManager.truncate` rolls back the rejected slots. Requests
whose logits need processing (penalties, logit bias, bad words, grammars, beams) decode one token a step.
"""

from jaxpaged.spec_decode.config import MAX_SPECULATIVE_TOKENS, SpeculativeConfig

__all__ = ["MAX_SPECULATIVE_TOKENS", "SpeculativeConfig"]
