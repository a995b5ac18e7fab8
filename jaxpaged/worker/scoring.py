"""Teacher-forced scoring through the engine's paged path: the log-prob of every next token of a text.

The engine samples one token per sequence and step and returns no prompt log-probs, so perplexity cannot come
from `LLM.generate`. This runs the engine's own pieces instead, on one sequence at a time: its model (the split
state the runner holds, merged inside the trace as the step does, with the step's native CPU matmuls and matmul
precision), its attention backend (the same K/V write into a pool of the engine's dtype: an fp8 pool quantizes as
it is written, the same kernel reading it back through a block table) and a pool of the engine's dtype and device
format. Each window of text is one sequence fed as a chunked prefill, `chunk` tokens per call, the pool carrying the
earlier chunks' K/V, so every token is scored against the quantized cache of all tokens before it in its window;
the log-softmax of every row is taken where the step would sample only the last one.

The pool here is private (window / block_size blocks, shuffled so the block table is not the identity), so the
engine's own pool, block manager and prefix cache are untouched and scoring may run beside generation.

    result = score_text(llm.engine.runner, token_ids, window=2048, chunk=256, bos_token_id=1)
    perplexity = math.exp(-result.logprobs.mean())
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxpaged.models.matmul import native_matmul
from jaxpaged.worker.attention import AttentionMetadata
from jaxpaged.worker.kv_pool import zeros_pool
from jaxpaged.worker.step import native_matmul_rows, step_compiler_options, step_matmul_precision


@dataclasses.dataclass
class ScoreResult:
    logprobs: np.ndarray  # [N] float32: log p(token | the tokens before it in its window), for each scored token
    greedy: np.ndarray  # [N] int32: the most likely token at each scored position (teacher-forced)
    targets: np.ndarray  # [N] int32: the scored tokens

    @property
    def perplexity(self) -> float:
        return float(np.exp(-np.mean(self.logprobs.astype(np.float64))))


def _forward(state, kv_pool, token_ids, targets, md: AttentionMetadata, *, graphdef, attn, native_rows: int):
    """token_ids, targets [T] int32 -> (log p(target) [T] f32, argmax [T] int32, kv_pool)."""
    model = nnx.merge(graphdef, state)
    with native_matmul(native_rows, live_rows=(token_ids.shape[0], md.query_start_loc[-1])):
        hidden, kv_pool = model(token_ids, kv_pool, md, attn)  # [T, H]
        logits = model.logits(hidden).astype(jnp.float32)  # [T, V]
    logp = jax.nn.log_softmax(logits, axis=-1)
    picked = jnp.take_along_axis(logp, targets[:, None], axis=-1)[:, 0]
    return picked, jnp.argmax(logits, axis=-1).astype(jnp.int32), kv_pool


def score_text(runner, token_ids, *, window: int = 2048, chunk: int = 256, bos_token_id: int | None = None,
               seed: int = 0) -> ScoreResult:
    """Scores `token_ids` (a text's tokens) in consecutive windows: each window is a fresh sequence of at most
    `window` tokens, `bos_token_id` first when given (then every text token is scored; without it each window's
    first token is context only), fed `chunk` tokens at a time through the engine's paged path (module docstring).

    runner: the engine's `ModelRunner` (single device). chunk: a multiple of the runner's prefill tile."""
    if runner.mesh is not None:
        raise ValueError("score_text runs on one device; build the engine with tensor_parallel_size=1")
    bs = runner.block_size
    if chunk % runner.prefill_tile or window % chunk or window < 2:
        raise ValueError(f"chunk={chunk} must be a multiple of the prefill tile {runner.prefill_tile}, and "
                         f"window={window} a multiple of chunk")
    ids = np.asarray(token_ids, np.int32)
    width = window // bs + (window % bs > 0)
    cfg = runner.config
    shape = (cfg.num_layers, width + 1, bs, cfg.num_kv_heads, cfg.head_dim)
    pool = zeros_pool(shape, runner.kv_pool.dtype, runner.pool_format)  # block 0: the null block
    table = np.random.default_rng(seed).permutation(np.arange(1, width + 1)).astype(np.int32)  # [W]
    fn = jax.jit(functools.partial(_forward, graphdef=runner.graphdef, attn=runner.attn,
                                   native_rows=native_matmul_rows(None)), donate_argnums=(1,))
    compiled = None

    lead = [] if bos_token_id is None else [int(bos_token_id)]
    text_per_window = window - len(lead)
    logprobs, greedy, targets = [], [], []
    for w0 in range(0, len(ids), text_per_window):
        seq = np.asarray(lead + ids[w0:w0 + text_per_window].tolist(), np.int32)  # the window's sequence
        nxt = np.append(seq[1:], -1)  # row i predicts seq[i + 1]; the last row predicts nothing here
        for c0 in range(0, len(seq), chunk):
            c1 = min(c0 + chunk, len(seq))
            n = c1 - c0
            tok, tgt = np.zeros(chunk, np.int32), np.zeros(chunk, np.int32)
            tok[:n], tgt[:n] = seq[c0:c1], np.maximum(nxt[c0:c1], 0)
            pos = np.full(chunk, -1, np.int32)
            pos[:n] = np.arange(c0, c1)
            slots = np.zeros(chunk, np.int32)  # padding writes into the null block
            slots[:n] = table[pos[:n] // bs] * bs + pos[:n] % bs
            md = AttentionMetadata(positions=pos, slot_mapping=slots, block_tables=table[None, :].copy(),
                                   context_lens=np.array([c1], np.int32),
                                   query_start_loc=np.array([0, chunk], np.int32),
                                   logits_indices=np.array([n - 1], np.int32), tile_size=runner.prefill_tile,
                                   decode_blocks=None, prompt_lens=np.array([len(seq)], np.int32))
            if compiled is None:
                with jax.default_matmul_precision(step_matmul_precision(runner.params)):
                    lowered = fn.lower(runner.params, pool, tok, tgt, md)
                compiled = lowered.compile(compiler_options=step_compiler_options(runner.params))
            lp, top, pool = compiled(runner.params, pool, tok, tgt, md)
            keep = nxt[c0:c1] >= 0
            logprobs.append(np.asarray(lp)[:n][keep])
            greedy.append(np.asarray(top)[:n][keep])
            targets.append(nxt[c0:c1][keep])
    return ScoreResult(np.concatenate(logprobs), np.concatenate(greedy), np.concatenate(targets))


__all__ = ["ScoreResult", "score_text"]
