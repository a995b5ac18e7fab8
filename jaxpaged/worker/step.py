"""The jitted step and its shapes: one pure function of (parameters, KV pool, previous tokens, packed inputs) that
runs the model over a ragged batch and samples a token per sequence, returning the new pool (donated, updated in
place).

Every array the step sees is padded up to a bucket, so XLA compiles a few shapes once (at start-up) and a request's
length never reaches a jitted shape:
  decode steps   tokens = sequences = S in `decode_buckets`; block tables at the full width; the K/V read as a
                 flat list of B blocks, B in the runner's `flat_block_buckets(S)` (the blocks in use, rounded up)
  prefill steps  tokens T in `prefill_buckets`, sequences min(max_num_seqs, T / tile), block-table width W in
                 `width_buckets`, tile 16; or tile 1 when the attention `mixes_steps` (then a prefill step may
                 carry decodes too, every sequence's tokens start right after the previous one's, and S is T / 2
                 but at the largest T: a step with more sequences than that takes a larger T)
  verifying      (speculative decoding, K proposals) prefill-shaped, but with tile 1 S is T / (K + 1) below the largest
                 T, and T also takes powers of two from K + 1 up (`ModelRunner._token_buckets`)

The step's inputs travel as one int32 buffer (`input_batch.StepLayout`), and the parameters as the flat list of
their leaves (flattened once at load, unflattened inside the trace): a call costs one host-to-device copy and no
pytree traversal of the model. The sampled tokens come back padded to a fixed `max_rows`, so the next step can take
its decoding rows' input tokens from them on the device, whatever the two steps' shapes.

On a GPU the sampler is an executable of its own (`split_sampler`, `sample_rows`). XLA GPU runs a `lax.cond` by
copying its predicate to the host and waiting for the device there (its ConditionalThunk), and the sampler's
branches (sampling at all, penalties and masks, log-probs) are conds: a step holding them returns from its call only
when the device has run the model, so the host cannot prepare the next step meanwhile. Split, the step ends with
each row's argmax and no conditional, and returns the logits; the host, which knows whether any row samples, is
processed or wants log-probs (`StepInputs.greedy_only`), runs the sampler on them only then. A verifying step
(speculative decoding) keeps its sampler inside.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from flax import nnx
from jax.experimental.layout import Format
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from jaxpaged.models.contract import unrolled_layers
from jaxpaged.models.matmul import native_matmul
from jaxpaged.models.quant import gpu_layer_kernel, partitioned_products
from jaxpaged.worker import sampler
from jaxpaged.worker.attention import AttentionBackend, AttentionMetadata, KVPool
from jaxpaged.worker.input_batch import EXTRAS, StepLayout
from jaxpaged.worker.rejection_sampler import rejection_sample
from jaxpaged.worker.sampler import MAX_LOGPROBS, SamplerOutput, SamplingMetadata, TokenLogprobs

NATIVE_MATMUL_ROWS = 1 << 20  # every step's: benchmarks/matmul.py compares the native kernel with XLA's dot by rows
GPU_LAYER_MATMUL_ROWS = 256  # decode-sized steps (reasoned: weight-bound below, product-bound above; not yet timed)


def pow2_buckets(lo: int, hi: int) -> list[int]:
    """Powers of two from lo up to hi, with hi itself as the last bucket."""
    out, b = [], lo
    while b < hi:
        out.append(b)
        b *= 2
    return out + [hi]


def batch_buckets(lo: int, hi: int) -> list[int]:
    """Sequence counts of decode steps: powers of two from lo, with the 1.5x points between them from 16 up (24, 48,
    96, ...), so a batch is padded by at most a third above 16 rows (a decode step costs per row), and hi last."""
    out = []
    for b in pow2_buckets(lo, hi):
        if b >= 32 and b // 4 * 3 > (out[-1] if out else 0):
            out.append(b // 4 * 3)
        out.append(b)
    return sorted(set(x for x in out if x <= hi))


def pick_bucket(buckets: list[int], n: int) -> int:
    for b in buckets:
        if b >= n:
            return b
    raise ValueError(f"{n} exceeds the largest bucket {buckets[-1]}")


@functools.partial(jax.tree_util.register_dataclass, data_fields=["tokens", "num_accepted", "proposals", "lp"],
                   meta_fields=[])
@dataclasses.dataclass
class VerifiedOutput:
    """A verifying step's result (speculative decoding), per sequence row: K + 1 positions."""

    tokens: jax.Array  # [S, K + 1] int32: accepted proposals, the target's token, then -1
    num_accepted: jax.Array  # [S] int32: the row emits num_accepted + 1 tokens
    proposals: jax.Array  # [S, K] int32: the draft loop's proposals for the next step (zeros without a draft)
    lp: TokenLogprobs  # [S, K + 1]: each emitted token's (zeros unless want_logprobs)


SCORE_SLAB = 256  # token rows whose logits a scoring step holds at once ([rows, V] float32)


def _prompt_scores(model, hidden: jax.Array, targets: jax.Array, native_matmul_rows: int, mesh: Mesh | None
                   ) -> TokenLogprobs:
    """A scoring step's extra output (`StepLayout.prompt_scores`): per token row, the log-prob and rank of the prompt
    token that follows it (`targets`; garbage where that is -1) and the row's top MAX_LOGPROBS, from the model's raw
    logits as the sampler's log-probs are. hidden [T, H], targets [T] int32 -> TokenLogprobs of lead shape [T]: the
    LM head over every token row, SCORE_SLAB rows at a time (T a multiple of 16, so a slab is the largest power of two
    up to SCORE_SLAB that divides T)."""
    t = hidden.shape[0]
    c = next(c for c in (SCORE_SLAB, 128, 64, 32, 16, 8, 4, 2, 1) if t % c == 0)

    def slab(args):
        h, tg = args  # [c, H], [c]
        with native_matmul(native_matmul_rows, live_rows=(c, jnp.int32(c))):
            logits = model.logits(h)  # [c, V] f32
        if mesh is not None and logits.shape[-1] % mesh.size == 0:
            logits = jax.lax.with_sharding_constraint(logits, NamedSharding(mesh, P()))
        logp = jax.nn.log_softmax(logits, axis=-1)
        tg = jnp.maximum(tg, 0)[:, None]  # [c, 1]
        rank = jnp.sum(logits >= jnp.take_along_axis(logits, tg, axis=1), axis=-1, dtype=jnp.int32)  # as the sampler's
        top_lp, top_ids = jax.lax.top_k(logp, MAX_LOGPROBS)
        return TokenLogprobs(jnp.take_along_axis(logp, tg, axis=1)[:, 0], rank, top_ids.astype(jnp.int32), top_lp)

    out = jax.lax.map(slab, (hidden.reshape(t // c, c, -1), targets.reshape(t // c, c)))
    return jax.tree.map(lambda x: x.reshape(t, *x.shape[2:]), out)


@functools.partial(jax.tree_util.register_dataclass, data_fields=["greedy", "logits", "sampling"], meta_fields=[])
@dataclasses.dataclass
class Unsampled:
    """A split step's result (`split_sampler`): its rows' argmax, which is the step's output when every row is greedy
    and asks for nothing else, and what `sample_rows` needs otherwise."""

    greedy: SamplerOutput  # tokens [S]: each row's argmax; the log-prob fields zeros
    logits: jax.Array  # [S, V] float32
    sampling: SamplingMetadata  # the step's, its EXTRAS fields None (sample_rows takes those arrays again)


def _without_extras(sm: SamplingMetadata) -> SamplingMetadata:
    return dataclasses.replace(sm, **{e.name: None for e in EXTRAS})


def sample_rows(logits: jax.Array, sampling: SamplingMetadata, extras: tuple, *, max_rows: int, native: bool
                ) -> tuple[jax.Array, SamplerOutput]:
    """A split step's sampler: (tokens [max_rows] int32, padded as the step pads them, the sampler's output over S
    rows). logits [S, V] float32, sampling from `Unsampled`, extras the step's EXTRAS arrays."""
    sm = dataclasses.replace(sampling, **{e.name: x for e, x in zip(EXTRAS, extras, strict=True)})
    out = sampler.sample(logits, sm, native=native)
    return jnp.zeros(max_rows, jnp.int32).at[:out.tokens.shape[0]].set(out.tokens), out


def jit_sample_rows(max_rows: int, native: bool, mesh: Mesh | None = None):
    """`sample_rows` jitted; with a tensor-parallel mesh, its outputs replicated over it as the step's are."""
    fn = functools.partial(sample_rows, max_rows=max_rows, native=native)
    if mesh is not None:
        return jax.jit(fn, out_shardings=NamedSharding(mesh, P()))
    return jax.jit(fn)


def split_sampler_here(multihost: bool) -> bool:
    """Whether steps run their sampler as an executable of its own (module docstring): on a GPU, in one process.
    Elsewhere a cond costs the host nothing (XLA CPU runs it on the calling thread, a TPU on its own cores), and
    the fused step saves a call."""
    return jax.default_backend() == "gpu" and not multihost


@dataclasses.dataclass(frozen=True)
class DraftSpec:
    """A separate draft model (speculative decoding), static in the step: its split structure and its attention
    backend (its own layer count and head size: its own KV pool, addressed by the target's block tables)."""

    graphdef: nnx.GraphDef
    treedef: object
    attn: AttentionBackend


def _step(*args, gpu_layer_rows: int = 0, gpu_loop: str = "kernel", **kwargs):
    """`_step_body`, its layer matmuls of at most gpu_layer_rows rows by the Pallas GPU kernels that read a stacked
    weight in place (`gpu_layer_matmul_rows`); with gpu_loop "unrolled" (`gpu_layer_loop`) those steps unroll their
    layer loop instead and XLA's GEMMs read the 16-bit weights' static slices in place (int8 keeps its kernel: XLA
    rewrites its codes before the GEMM either way); with a tensor-parallel mesh, kernels on each device's shard
    (`partitioned_products`)."""
    unroll_rows = gpu_layer_rows if gpu_loop == "unrolled" else 0
    with gpu_layer_kernel(gpu_layer_rows), unrolled_layers(unroll_rows), partitioned_products(kwargs.get("mesh")):
        return _step_body(*args, **kwargs)


def _step_body(param_leaves: tuple, kv_pool: KVPool, prev_tokens: jax.Array, buf: jax.Array, extras: tuple,
               draft_leaves: tuple, draft_pool: KVPool | tuple, layout: StepLayout, *, treedef, graphdef: nnx.GraphDef,
               attn: AttentionBackend, max_rows: int, mesh: Mesh | None = None, native_matmul_rows: int = 0,
               draft_layers: int = 0, draft: DraftSpec | None = None, split_sampler: bool = False
               ) -> tuple[jax.Array, SamplerOutput | VerifiedOutput | Unsampled, KVPool, KVPool | tuple,
                          TokenLogprobs | None]:
    """param_leaves: the model state's leaves; prev_tokens [max_rows] int32, the previous step's sampled tokens;
    buf [layout.size] int32; extras: the sampler's large arrays (`input_batch.EXTRAS`), [S, ...] each;
    draft_leaves, draft_pool: a separate draft model's state leaves and KV pool (empty tuples without one).
    Returns (tokens [max_rows] int32: each row's last sampled token (rows past S are 0), the sampler's output over S
    rows (a VerifiedOutput for a verifying layout), the pool, the draft's pool). draft_layers: > 0, a verifying step
    then proposes K tokens per flagged row with the model's first draft_layers layers (a self-speculative draft);
    with `draft`, the draft model runs over the step's tokens (its pool holds what the target's holds) and proposes
    instead; a layout with draft_kv False skips it and its loop (no row of the step speculates soon).
    split_sampler: a step that does not verify returns `Unsampled` (its argmax as the tokens) instead of sampling.
    Last, a scoring layout's prompt log-probs (`_prompt_scores`; None for other layouts)."""
    model = nnx.merge(graphdef, jax.tree.unflatten(treedef, param_leaves))  # inside the trace: no per-call cost
    host_ids, token_src, md, sm = layout.unpack(buf, extras)
    # A decoding row whose last token the host does not know yet reads it from the previous step's output.
    token_ids = jnp.where(token_src >= 0, prev_tokens[jnp.maximum(token_src, 0)], host_ids)  # [T]
    sm = dataclasses.replace(sm, pending_tokens=_pending_tokens(token_ids, token_src, md, layout))
    # Rows from query_start_loc[-1] on are padding (the step's token bucket): the native matmuls skip them.
    # (the named scopes label the step's parts in a profile: benchmarks/spec_anatomy.py sums the ops by them)
    with native_matmul(native_matmul_rows, live_rows=(token_ids.shape[0], md.query_start_loc[-1])):
        with jax.named_scope("model"):
            hidden, kv_pool = model(token_ids, kv_pool, md, attn)  # [T, H]
        drafter = None
        if draft is not None and layout.draft_kv:  # the draft's K/V of the same tokens, at the same slots of its pool
            draft_model = nnx.merge(draft.graphdef, jax.tree.unflatten(draft.treedef, draft_leaves))

            def run(pool):
                with jax.named_scope("draft_run"):
                    return draft_model(token_ids, pool, md, draft.attn)[1]

            if layout.spec_width:  # a verifying step: only where some row's chunk is not in the draft's pool yet
                draft_pool = jax.lax.cond(layout.draft_run(buf), run, lambda pool: pool, draft_pool)
            else:
                draft_pool = run(draft_pool)
            drafter = (draft_model, draft.attn, None)
        elif draft_layers:
            drafter = (model, attn, draft_layers)
    scores = None
    if layout.prompt_scores:  # a row wants its prompt's log-probs: the LM head over every token row too
        with jax.named_scope("prompt_scores"):
            scores = _prompt_scores(model, hidden, layout.score_targets(buf), native_matmul_rows, mesh)
    # The LM head runs only on the rows that need logits: one per sequence (K + 1 per sequence in a verifying
    # step), not one per token; natively, only on the step's sequences' rows (the rest of S is padding: context
    # length 0).
    num_seqs = jnp.sum(md.context_lens > 0, dtype=jnp.int32)
    with native_matmul(native_matmul_rows, live_rows=(md.logits_indices.shape[0], num_seqs * (layout.spec_width + 1))):
        with jax.named_scope("lm_head"):
            logits = model.logits(hidden[md.logits_indices])  # [S, V] f32
    if mesh is not None and logits.shape[-1] % mesh.size == 0:
        # Tensor parallel: the LM head's output stays split over the vocabulary (so XLA does not gather the head
        # instead), then the sampler gets the whole rows: the same sampling code, and the same tokens, at every tp.
        logits = jax.lax.with_sharding_constraint(logits, NamedSharding(mesh, P(None, mesh.axis_names[0])))
        logits = jax.lax.with_sharding_constraint(logits, NamedSharding(mesh, P()))
    native = native_matmul_rows > 0
    if layout.spec_width:
        out, kv_pool, draft_pool = _verify(logits, kv_pool, draft_pool, buf, md, sm, layout, native, drafter,
                                           native_matmul_rows, token_ids)
        last = jnp.take_along_axis(out.tokens, out.num_accepted[:, None], axis=1)[:, 0]  # [S]
        tokens = jnp.zeros(max_rows, jnp.int32).at[:last.shape[0]].set(last)
        return tokens, out, kv_pool, draft_pool, scores
    if split_sampler:
        greedy = sampler.greedy(logits, native)
        tokens = jnp.zeros(max_rows, jnp.int32).at[:greedy.tokens.shape[0]].set(greedy.tokens)
        return tokens, Unsampled(greedy, logits, _without_extras(sm)), kv_pool, draft_pool, scores
    out = sampler.sample(logits, sm, native=native)
    tokens = jnp.zeros(max_rows, jnp.int32).at[:out.tokens.shape[0]].set(out.tokens)
    return tokens, out, kv_pool, draft_pool, scores


def _pending_tokens(token_ids: jax.Array, token_src: jax.Array, md: AttentionMetadata, layout: StepLayout
                    ) -> jax.Array:
    """[S] int32: each row's last token where it came from the device (the host has not seen it: penalties count it
    beside the row's seen_tokens), else -1. Only a row that runs one token, its last, reads it from the device
    (`InputBatch.build`); that token is the one whose logits the row samples from (its first logits row when the step
    verifies)."""
    s, k = layout.num_seqs, layout.spec_width
    first = md.logits_indices.reshape(s, k + 1)[:, 0]  # [S]
    return jnp.where((token_src[first] >= 0) & (md.context_lens > 0), token_ids[first], -1)


def _verify(logits: jax.Array, kv_pool: KVPool, draft_pool: KVPool | tuple, buf: jax.Array, md: AttentionMetadata,
            sm: SamplingMetadata, layout: StepLayout, native: bool, drafter: tuple | None,
            native_matmul_rows: int, token_ids: jax.Array) -> tuple[VerifiedOutput, KVPool, KVPool | tuple]:
    """Speculative decoding's verification (`rejection_sampler`), then the draft loop. logits [S (K + 1), V] f32:
    each row's K + 1 positions. Rows that verify proposals never ask for processed logits (penalties, bias, bans,
    grammars: the engine lets no such row speculate), so processing applies at each row's first position only,
    where a row that verifies nothing samples its one token as the plain sampler does. drafter: (model, attention,
    layers) of the draft (the target's first layers over its pool, or a draft model over its own pool), or None.
    token_ids [T]: the step's tokens (a draft model's loop starts from each row's last accepted one)."""
    s, k = layout.num_seqs, layout.spec_width
    raw = logits.reshape(s, k + 1, -1)  # [S, K + 1, V]
    drafts, num_draft, emit_pos, draft_flag = layout.spec_fields(buf)
    asked = sm.penalized | sm.constrained | jnp.any(sm.bias_ids >= 0) | jnp.any(sm.banned >= 0)

    def verify(logits):
        return rejection_sample(logits, drafts, num_draft, None, temperature=sm.temperature, top_k=sm.top_k,
                                top_p=sm.top_p, min_p=sm.min_p, seed_lo=sm.seed_lo, seed_hi=sm.seed_hi, step=sm.step,
                                native=native)

    # Each branch verifies whole: a step whose rows ask for no processing reads the logits as they are (a processed
    # copy of [S, K + 1, V], or a cond passing them through, would copy them in every verifying step).
    with jax.named_scope("verify"):
        v = jax.lax.cond(asked, lambda x: verify(x.at[:, 0].set(sampler.process_logits(x[:, 0], sm, native))), verify,
                         raw)

    def with_logprobs(raw):  # [S, K + 1, V]
        return sampler.logprobs(raw, jnp.maximum(v.tokens, 0), native)

    with jax.named_scope("verify"):
        lp = jax.lax.cond(sm.want_logprobs, with_logprobs, lambda raw: TokenLogprobs.zeros((s, k + 1)), raw)
    proposals = jnp.zeros((s, k), jnp.int32)
    if drafter is not None:
        model, attn, layers = drafter
        last = jnp.take_along_axis(v.tokens, v.num_accepted[:, None], axis=1)[:, 0]  # [S] the token drafts follow
        live = draft_flag & (md.context_lens > 0)
        pool = kv_pool if layers else draft_pool
        num_seqs = jnp.sum(md.context_lens > 0, dtype=jnp.int32)  # the step's sequences: rows 0..num_seqs - 1
        # a draft model's loop starts one token earlier, at the last accepted one (see _draft)
        accepted = None if layers else token_ids[md.logits_indices.reshape(s, k + 1)[jnp.arange(s), v.num_accepted]]
        with jax.named_scope("draft_loop"):
            proposals, pool = _draft(model, pool, last, emit_pos + v.num_accepted, live, md.block_tables, k, attn,
                                     layers, native_matmul_rows, num_seqs, accepted, v.num_accepted == k)
        kv_pool, draft_pool = (pool, draft_pool) if layers else (kv_pool, pool)
    return VerifiedOutput(v.tokens, v.num_accepted, proposals, lp), kv_pool, draft_pool


def _draft(model, kv_pool: KVPool, first: jax.Array, first_pos: jax.Array, live: jax.Array, tables: jax.Array,
           k: int, attn: AttentionBackend, draft_layers: int | None, native_matmul_rows: int, num_seqs: jax.Array,
           accepted: jax.Array | None = None, write_accepted: jax.Array | None = None) -> tuple[jax.Array, KVPool]:
    """Greedy proposals of the draft: k one-token steps per live row from `first` at `first_pos` [S]. A
    self-speculative draft is the model's first `draft_layers` layers over the target's pool: the K/V they need for
    every earlier position are the ones the target wrote there (this step's included). A draft model (draft_layers
    None) reads its own pool, where its loop of the step before wrote the tokens this step verified, from their first
    (the last token then) on; so its first step takes two tokens per row: `accepted` [S] (the last accepted one, at
    first_pos - 1) and `first`. That loop wrote every accepted token but the k-th (it never takes its own last
    proposal), so `accepted`'s K/V is written only where write_accepted [S] (all k accepted), else the null slot
    takes it and the pool keeps the loop's (or this step's draft run's) K/V there. The
    draft's own writes past the accepted tokens (k positions from first_pos, slots the scheduler allocated ahead) are
    overwritten by the next step's verification (and, in a draft model's pool, by its next loop). Returns
    (proposals [S, k] int32, pool). A greedy draft's q is one-hot: `rejection_sample` verifies it as n-gram's.
    num_seqs: rows from it on are padding (the native matmuls and head skip them)."""
    s, width = tables.shape
    bs = kv_pool.shape[2]
    rows = jnp.arange(s)

    def forward(tokens, pos, pool, write):
        """The draft over m tokens per row, tokens, pos and write [S, m] (row-major in the step: write False sends a
        token's K/V to the null slot); its greedy token after each row's last."""
        m = tokens.shape[1]
        block = tables[rows[:, None], jnp.minimum(pos // bs, width - 1)]  # [S, m]
        on = live[:, None]
        # Near max_model_len the loop runs past the table (its proposals there are never verified): those positions
        # write nothing and read the table's positions only. (Clamped into the last block, a self-draft's writes
        # overwrote the target's K/V of a block earlier.)
        inside = pos < width * bs
        md = AttentionMetadata(
            positions=jnp.where(on, pos, -1).reshape(-1),
            slot_mapping=jnp.where(on & write & inside, block * bs + pos % bs, 0).reshape(-1),
            block_tables=tables, context_lens=jnp.where(live, jnp.minimum(pos[:, -1] + 1, width * bs), 0),
            query_start_loc=jnp.arange(s + 1, dtype=jnp.int32) * m,
            logits_indices=(rows * m + m - 1).astype(jnp.int32),
            tile_size=1, decode_blocks=s * width if m == 1 else None)
        with native_matmul(native_matmul_rows, live_rows=(s * m, num_seqs * m)), jax.named_scope("model"):
            hidden, pool = (model(tokens.reshape(-1), pool, md, attn, num_layers=draft_layers) if draft_layers
                            else model(tokens.reshape(-1), pool, md, attn))
        with native_matmul(native_matmul_rows, live_rows=(s, num_seqs)), jax.named_scope("lm_head"):
            last = hidden if m == 1 else hidden[md.logits_indices]  # [S, H]
            nxt = sampler._argmax(model.logits(last), native_matmul_rows > 0)  # [S]
        return nxt, pool

    def one(j, carry):
        token, pool, proposals = carry
        nxt, pool = forward(token[:, None], (first_pos + j)[:, None], pool, True)
        return nxt, pool, proposals.at[:, j].set(nxt)

    proposals, lo = jnp.zeros((s, k), jnp.int32), 0
    if accepted is not None:
        pos = first_pos[:, None] + jnp.arange(-1, 1)[None, :]  # [S, 2]
        write = jnp.stack([write_accepted, jnp.ones_like(write_accepted)], axis=1)
        with jax.named_scope("first"):
            first, kv_pool = forward(jnp.stack([accepted, first], axis=1), pos, kv_pool, write)
        proposals, lo = proposals.at[:, 0].set(first), 1
    _, kv_pool, proposals = jax.lax.fori_loop(lo, k, one, (first, kv_pool, proposals))
    return proposals, kv_pool


def native_matmul_rows(mesh: Mesh | None) -> int:
    """The most rows a step's layer matmuls run by the native CPU kernel (`jaxpaged.models.matmul`), 0 for none:
    on a CPU with AVX512_BF16 without a tensor-parallel mesh, up to NATIVE_MATMUL_ROWS: every step, decode and
    prefill (at 256-2048 rows the kernel runs within a few percent of XLA's dot rate, and a prefill step is faster
    with it: no weight slices copied, bf16 results written instead of float32 ones)."""
    if mesh is not None or jax.default_backend() != "cpu":
        return 0
    from pallas_kernels import cpu_native

    return NATIVE_MATMUL_ROWS if cpu_native.matmul_is_fast() else 0


def gpu_layer_matmul_rows(mesh: Mesh | None = None) -> int:
    """The most rows a step's layer matmuls run by the Pallas GPU kernels that read a stacked weight in place
    (`jaxpaged.models.quant.gpu_layer_kernel`: bf16 and int8 per channel), 0 for none: on a CUDA GPU, up to
    GPU_LAYER_MATMUL_ROWS, the decode-sized steps, which are bound by reading the weights that XLA's GEMM would read
    three times (pallas_kernels/gpu_matmul.py); larger steps are bound by the product itself and keep XLA's GEMM.
    With a tensor-parallel mesh the kernels run on each device's shard (`quant.on_shards`)."""
    del mesh  # the same rows with a mesh: each device's kernel sees its shard
    if jax.default_backend() != "gpu":
        return 0
    return GPU_LAYER_MATMUL_ROWS


def gpu_layer_loop() -> str:
    """How a CUDA GPU's decode-sized steps (`gpu_layer_matmul_rows`) read each layer's weights from their stacks:
    "kernel", the layer loop an XLA while loop whose matmuls are Pallas kernels reading the stack in place
    (pallas_kernels/gpu_matmul.py), or "unrolled", the loop unrolled so that XLA's own GEMMs read static slices in
    place (`jaxpaged.models.contract.layer_loop`; XLA's GEMM of a weight of its own ran 1.5-3x faster than the kernel
    on an H200, docs/benchmarks.md, at a compile that grows with depth). "kernel" until a card has timed the other
    end to end (`benchmarks/gpu_throughput.py --unrolled-layers`)."""
    return "kernel"


def jit_step(graphdef: nnx.GraphDef, treedef, attn: AttentionBackend, fmt: Format | NamedSharding | None,
             max_rows: int, mesh: Mesh | None = None, leaf_shardings=None, native_rows: int = 0,
             draft_layers: int = 0, draft: DraftSpec | None = None, gpu_rows: int = 0, split_sampler: bool = False,
             gpu_loop: str = "kernel"):
    """The jitted step (`_step`) of the model `graphdef` with state structure `treedef` (both from `nnx.split` at
    load) and the attention backend `attn`, `layout` static; bfloat16 layer matmuls of at most native_rows rows by
    the native CPU kernel (`native_matmul_rows`); steps of at most gpu_rows tokens read stacked weights in place as
    gpu_loop says (`gpu_layer_loop`); split_sampler: the sampler left to `sample_rows` (module docstring).

    The pool is donated. With a pool format, the pool comes in and goes out in it, and the other arguments and
    outputs live on its device. With a tensor-parallel mesh, the parameters keep their shardings, the pool its
    split by kv head, and the inputs and the sampler's output are replicated over the mesh.
    """
    step = functools.partial(_step, treedef=treedef, graphdef=graphdef, attn=attn, max_rows=max_rows, mesh=mesh,
                             native_matmul_rows=native_rows, draft_layers=draft_layers, draft=draft,
                             gpu_layer_rows=gpu_rows, gpu_loop=gpu_loop, split_sampler=split_sampler)
    if mesh is not None:  # (a draft model is refused under tensor parallelism: its args are empty)
        rep, pool = NamedSharding(mesh, P()), KVPool(fmt, fmt)
        return jax.jit(step, static_argnums=(7,), donate_argnums=(1, 6),
                       in_shardings=(leaf_shardings, pool, rep, rep, rep, rep, rep),
                       out_shardings=(rep, rep, pool, rep, rep))
    if fmt is None:
        return jax.jit(step, static_argnums=(7,), donate_argnums=(1, 6))
    device = fmt.sharding
    pool = KVPool(fmt, fmt)
    draft_pool = pool if draft is not None else device
    return jax.jit(step, static_argnums=(7,), donate_argnums=(1, 6),
                   in_shardings=(device, pool, device, device, device, device, draft_pool),
                   out_shardings=(device, device, pool, draft_pool, device))


# XLA GPU's options for a step whose layer loop is unrolled (`step_compiler_options` says why)
UNROLLED_GPU_OPTIONS = {"xla_gpu_dot_merger_threshold_mb": "0"}


def step_compiler_options(params, gpu_loop: str = "kernel") -> dict[str, str]:
    """XLA options for compiling the step: on CPU with 16-bit parameters, no while-loop invariant code motion; on a
    GPU with an unrolled layer loop (`gpu_layer_loop`), no merging of dots that share an input.

    XLA CPU slices a layer's weights out of the stacked [L, ...] arrays in float32 (it has no 16-bit dynamic-slice),
    and the invariant-code-motion pass hoists that conversion out of the layer loop: every step then converts every
    stacked weight to float32 and back (a bfloat16 decode step of 64 sequences: 346 ms instead of 153 ms,
    benchmarks/step_anatomy.py). Without the pass the conversion stays fused with the slice of one layer.
    XLA GPU's dot merger turns x @ gate and x @ up (or q, k, v) into one GEMM of the weights concatenated, a copy of
    them each step; unrolled, each GEMM would read its static slice in place (benchmarks/gpu_step_hlo.py).
    Options are per executable: nothing process-wide changes."""
    if jax.default_backend() == "gpu" and gpu_loop == "unrolled":
        return dict(UNROLLED_GPU_OPTIONS)
    sixteen_bit = any(jnp.issubdtype(x.dtype, jnp.floating) and jnp.dtype(x.dtype).itemsize == 2
                      for x in jax.tree.leaves(params))
    if jax.default_backend() != "cpu" or not sixteen_bit:
        return {}
    return {"xla_disable_hlo_passes": "while-loop-invariant-code-motion"}


def step_matmul_precision(params) -> str | None:
    """'highest' for a float32 model, so its matmuls multiply in float32: XLA's default on GPU rounds float32 inputs
    to TF32 (logits ~1e-3 off transformers' float32) and on TPU to bfloat16. None (the default) for 16-bit models.
    On CPU it changes nothing."""
    floats = [x.dtype for x in jax.tree.leaves(params) if jnp.issubdtype(x.dtype, jnp.floating)]
    return "highest" if floats and all(jnp.dtype(d) == jnp.float32 for d in floats) else None


def lower_step(step_fn, param_leaves, kv_pool: KVPool, prev_tokens, layout: StepLayout, extras: tuple,
               draft_leaves: tuple = (), draft_pool: KVPool | tuple = ()):
    """Lowers the step for one layout; the arguments may be arrays or jax.ShapeDtypeStructs. The matmul precision is
    set for this trace only (`step_matmul_precision`), not process-wide."""
    buf = jax.ShapeDtypeStruct((layout.size,), jnp.int32)
    with jax.default_matmul_precision(step_matmul_precision(param_leaves)):
        return step_fn.lower(param_leaves, kv_pool, prev_tokens, buf, extras, draft_leaves, draft_pool, layout)
