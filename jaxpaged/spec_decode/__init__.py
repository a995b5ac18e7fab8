"""Speculative decoding (issue #31): propose k tokens per sequence cheaply, score them in one target step, keep the
longest prefix the target agrees with. This package holds the self-contained pieces; the engine integration comes
with the new step loop (issue #29).

    config.py     SpeculativeConfig (vLLM's names; `LLM(speculative_config={...})`), errors naming the field
    ngram.py      prompt-lookup proposer, host numpy, one sequence or a [B, W] batch of the persistent input batch
    draft.py      draft modules: the target's first N layers (shared embedding / norm / head), or a model with the
                  target's vocabulary (checked before its weights load)
    rejection.py  the verification sampler, on device: greedy = argmax prefix; sampled = Leviathan/Chen rejection
                  sampling, keys per (seed, token index) as the plain sampler's
    gate.py       when to speculate: `disable_by_batch_size`, and per request a low-acceptance switch-off

How they plug into a step (design; nothing below is wired yet)
--------------------------------------------------------------
1. Propose. Before scheduling, each speculating decode row gets n <= k proposals: `ngram.propose_batch` over the
   persistent batch's token rows ([R, max_model_len] and lengths), limited per row by the room left before
   max_tokens and max_model_len; or the draft model's k steps (below). Rows the gate turns off (`SpeculationGate`:
   the batch size, the request's acceptance), rows with penalties, logit bias, min_tokens bans, a grammar or beam
   search propose nothing (n = 0): `sampler.process_logits` depends on the tokens before each position, so those
   rows stay at one token per step.
2. Schedule. A row with n proposals is a chunk of n + 1 query tokens [last sampled token, d_0 .. d_{n-1}] at
   positions c .. c + n (c = tokens already in the cache); it asks `allocate_slots` for c + n + 1 slots (the
   token budget counts n + 1), passing only the sequence's *real* tokens as `token_ids`, so no block holding
   proposals gets a prefix hash. Copy-on-write of shared blocks (n > 1 forks, cached prefixes) happens there as for
   any write.
3. Score. The chunk goes through the existing ragged kernels like a prefill chunk: `query_start_loc` spans n + 1
   tokens, `positions`/`slot_mapping` cover c .. c + n, `context_lens` = c + n + 1, causal masking inside the chunk
   (pallas_kernels/reference.py: token t sees positions <= positions[t]). A step with any verifying row is not a
   decode-only step: `decode_blocks=None`, and the reference / Pallas backends pad each chunk to the 16-token query
   tile (k + 1 <= 17 fits one or two tiles), while the native CPU backend (`mixes_steps`) runs it at tile 1 beside
   plain decodes. The logits rows become [S, k + 1]: `logits_indices` lists each row's k + 1 positions (rows with
   n < k repeat their last index; those positions are ignored), so the LM head runs on S (k + 1) rows; a step where no
   row speculates keeps today's [S] layout and program (a static flag in the shape key, as tpu-inference does for
   its sampling flags).
4. Verify. `rejection_sample(logits [S, k+1, V], drafts [S, k], n [S], q or None, temperature, top_k, top_p, min_p,
   seed_lo, seed_hi, step)` -> tokens [S, k + 1] (-1 padded), num_accepted [S]. A row with n = 0 emits exactly the
   plain sampler's token (tested), so one program serves mixed rows. Log-probs are the target's, taken from the
   same logits rows at the emitted positions.
5. Append and roll back. Row s emits a + 1 tokens (a = num_accepted): the first a are its proposals, whose K/V the
   step already wrote at c + 1 .. c + a; the last (correction or bonus) is the next step's input token, as after
   any decode. The slots c + a + 1 .. c + n hold K/V of rejected proposals; the rollback is bookkeeping only:
   the sequence's cached length becomes c + a + 1, so no later step's `context_lens` reaches those slots (kernels
   mask every position >= context_lens, V included, so stale or NaN slots are harmless), and the next step
   overwrites them. On the host a `BlockManager.truncate(seq_id, num_tokens)` (the inverse of `allocate_slots`;
   to add in core/block_manager.py) pops the blocks past cdiv(c + a + 1, block_size), which only held rejected
   tokens, back to the pool and drops any hash past the last full block of accepted tokens; blocks that fill with
   accepted tokens get their hash as today, on the next `allocate_slots`. Stop checks run over the a + 1 tokens in
   order (EOS / stop ids / max_tokens inside the run cut it there; the rest is dropped and truncated the same way).
   Preemption (recompute or swap) sees an ordinary sequence of c + a + 1 cached tokens.
6. Asynchronous loop (#29). Step N + 1's chunk shape depends on N's acceptance, and n-gram proposals need N's
   tokens on the host: a speculating row is prepared after N's tokens are read (the loop is synchronous while any
   row speculates; rows that do not speculate keep the overlapped path). The draft model can instead propose on
   device from N's device-resident tokens.
7. Draft model. The draft has its own KV pool (its own layer count, kv heads and head dim) with the target's
   `num_blocks` and `block_size`, so one block table per sequence addresses both pools and no second block manager
   is needed (the pool budget is shared between the two). Each round it runs k one-token steps in one jitted loop
   (input: the last token, then its own proposals), drawing proposal j from its distribution q_j after the row's
   temperature and filters, with the row's key for token step + j folded with a draft stream constant (independent
   of the verifier's noise); q [S, k, V] goes to `rejection_sample`. Its rejected K/V roll back like the target's;
   when all k are accepted, its cache lacks d_{k-1}, so its next round starts with the 2-token chunk [d_{k-1},
   bonus]. A draft made of the target's first N layers (`draft.truncated_draft`) shares the embedding and head.
8. Metrics: proposed, accepted and accepted-length counters per step (from `num_draft` and `num_accepted`), fed to
   `SpeculationGate.record` and to `/metrics` / `LLM.stats()`.
"""

from jaxpaged.spec_decode.config import MAX_SPECULATIVE_TOKENS, SpeculativeConfig

__all__ = ["MAX_SPECULATIVE_TOKENS", "SpeculativeConfig"]
