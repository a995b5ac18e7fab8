"""The model contract: what a Flax module provides to be served by the engine.

    class MyModel(nnx.Module):
        config: <anything with the `ModelSpec` fields>       # pool shape, vocabulary, context, EOS ids
        def __call__(self, token_ids, kv_pool, md, attn):    # -> (hidden, kv_pool)
        def logits(self, hidden):                           # -> logits

  token_ids  [T] int32          the step's new tokens, a ragged batch of prefill chunks and decodes (padded)
  kv_pool    KVPool             the paged K/V cache of all layers (worker.attention), passed through, never read
  md         AttentionMetadata  positions [T] (-1 = padding), block tables, ... (jaxpaged.worker.attention)
  attn       the attention backend: per layer i, `out, kv_pool = attn(q, k, v, kv_pool, i, md, sliding_window=...)`
             with q [T, Hq, D], k, v [T, Hkv, D] (RoPE applied); it writes k, v into the pool and attends over each
             token's sequence (causal, through the block tables)
  hidden     [T, H]  one row per token; the engine picks the rows that need logits (`md.logits_indices`)
  logits     hidden [S, H] -> [S, V] float32, row by row (the final norm and LM head)

The engine splits the module once at load (`nnx.split`), donates the pool to a jitted step and merges the module
inside it (`nnx.merge`), so `__call__` must be traceable: no Python branching on array values, and the pool only ever
passed on to `attn` and returned (returning it from a `scan` over layers, or stacking per-layer pools, would copy
it every step; a `fori_loop` that carries it keeps the update in place). Layer index `i` may be a traced int32.
`jaxpaged.models.llama.LlamaForCausalLM` is the reference implementation; README "Bring your own Flax model" adapts
a model step by step.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
from typing import Protocol

import jax

from jaxpaged.worker.attention import AttentionBackend, AttentionMetadata, KVPool


@dataclasses.dataclass(frozen=True)
class ModelSpec:
    """What the engine needs to know of a model besides its forward pass. `ModelConfig` has these fields too."""

    vocab_size: int
    num_layers: int  # layers that call `attn` (one pool slice each)
    num_kv_heads: int
    head_dim: int
    max_position_embeddings: int = 2048
    eos_token_ids: tuple[int, ...] = ()


SPEC_FIELDS = tuple(f.name for f in dataclasses.fields(ModelSpec))


class CausalLM(Protocol):
    config: ModelSpec

    def __call__(self, token_ids: jax.Array, kv_pool: KVPool, md: AttentionMetadata,
                 attn: AttentionBackend) -> tuple[jax.Array, KVPool]: ...

    def logits(self, hidden: jax.Array) -> jax.Array: ...


def check_model(model) -> None:
    """Raises TypeError naming what `model` lacks of the contract (checked before anything is compiled)."""
    from flax import nnx

    if not isinstance(model, nnx.Module):
        raise TypeError(f"the model must be a flax.nnx.Module, got {type(model).__name__}")
    config = getattr(model, "config", None)
    missing = [f for f in SPEC_FIELDS if not hasattr(config, f)]
    if missing:
        raise TypeError(f"{type(model).__name__}.config must have the fields of jaxpaged.models.ModelSpec; "
                        f"missing: {', '.join(missing)}")
    if not callable(getattr(model, "logits", None)):
        raise TypeError(f"{type(model).__name__} has no logits(hidden) method (the final norm and LM head)")


_UNROLL_ROWS: contextvars.ContextVar[int] = contextvars.ContextVar("jaxpaged_unrolled_layer_rows", default=0)


@contextlib.contextmanager
def unrolled_layers(max_rows: int):
    """While tracing inside this block, `layer_loop`s of steps of at most max_rows tokens are unrolled. 0: never."""
    token = _UNROLL_ROWS.set(max_rows)
    try:
        yield
    finally:
        _UNROLL_ROWS.reset(token)


def unrolled(rows: int) -> bool:
    """Whether the step being traced, of `rows` tokens, unrolls its `layer_loop`s."""
    return rows <= _UNROLL_ROWS.get()


def layer_loop(num: int, body, carry, rows: int):
    """`jax.lax.fori_loop(0, num, body, carry)` over a model's layers (or groups of them), for a step of `rows`
    tokens; unrolled inside `unrolled_layers(max_rows)` when rows <= max_rows. Unrolled, each layer's index is a
    constant, so its weights are static slices of their stacks, which XLA GPU's GEMM fusions read in place (a
    dynamic-slice in a while loop is copied out first: benchmarks/gpu_step_hlo.py); the cost is a compile that
    grows with depth."""
    if unrolled(rows):
        return jax.lax.fori_loop(0, num, body, carry, unroll=True)
    return jax.lax.fori_loop(0, num, body, carry)
