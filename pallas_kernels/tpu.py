"""Ragged paged attention for TPUs: a Pallas kernel on the Mosaic TPU backend.

Same contract as `pallas_kernels.reference.ragged_paged_attention_reference` (layouts, masking, padding rules; read
its docstring): one launch serves a whole ragged batch of prefill chunks and decodes over the stacked K/V pool,
which stays in HBM and is read block by block through the block table.

Arguments (T tokens, S sequences, W block-table width, L layers, NB pool blocks, BS block size, Hq/Hkv heads,
D head_dim, G = Hq // Hkv):
  q               [T, Hq, D]             float32 or bfloat16
  k_cache/v_cache [L, NB, BS, Hkv, D]    float32, bfloat16 or fp8 (e4m3fn / e5m2), cast to q's dtype in the
                                         kernel, left in HBM
  k_scale/v_scale float or f32 scalar    the pool's values are k_cache * k_scale, v_cache * v_scale (fp8.py);
                                         folded: scores are scaled by scale * k_scale, the output by v_scale
  layer           int32 scalar           layer of the pool to read
  block_tables    [S, W] int32           ids are clipped to [0, NB) (a DMA must never leave the pool)
  context_lens    [S] int32
  query_start_loc [S + 1] int32          segments start at multiples of `tile_size` (the host's promise)
  positions       [T] int32              -1 on padding tokens
  output          [T, Hq, D]             q.dtype; 0 on padding tokens
Supported: head_dim 64, 128 or 256 (Gemma 3), block_size 8, 16 or 32, q float32 or bfloat16 (the pool also fp8),
any Hq that is a multiple of Hkv (SmolLM2's 9 q / 3 kv heads included), tile_size >= 1 dividing T. Anything else
raises ValueError naming the field.

What the kernel sees (built by cheap XLA ops on q and the integer metadata; the pool is never copied or reshaped):
  scalar prefetch (SMEM)
    layer_ref      [1]        layer
    scales_ref     [2] f32    (k_scale, v_scale)
    tables_ref     [S * W]    block_tables, row-major, flattened (1-D: SMEM pads 2-D arrays)
    tile_seq_ref   [NT]       sequence of each query tile
    tile_ctx_ref   [NT]       context_lens of that sequence
    tile_lo_ref    [NT]       first logical block the tile can see (> 0 only with a sliding window)
    tile_hi_ref    [NT]       one past the last logical block it can see (causal: up to its last real token)
  blocked inputs (VMEM, pipelined by Pallas)
    q_ref          [Hkv, M, D]   this tile's queries, row r = (token r // G of the tile, query head r % G of the
                                 kv head's group); rows tq * G .. M - 1 are padding (zeros)
    row_pos_ref    [M, 1] int32  position of each row's token, -1 for padding tokens and padding rows
  HBM (memory_space=pl.ANY): k_hbm, v_hbm  [L, NB, BS, Hkv, D], the caller's pool arrays as they are
  output block     o_ref [Hkv, M, D] of the [NT, Hkv, M, D] result, turned back into [T, Hq, D] outside
  scratch
    k_buf, v_buf   VMEM [2, NBC, BS, Hkv, D]   double buffer of one chunk of NBC blocks (NBC * BS = C tokens)
    sems           DMA semaphores [2 (K, V), 2 (slot)]
    m_ref, l_ref   VMEM [Hkv, M, 1] f32        running max and denominator of the online softmax
    acc_ref        VMEM [Hkv, M, D] f32        running numerator
    state_ref      SMEM [2] int32              (slot of this tile's first chunk, 1 if the previous program already
                                               started fetching it)

Grid: (NT,), NT = T / tq query tiles of tq consecutive tokens (tq = tile_size, halved while tq * G > 256), so a tile
never straddles two sequences. M = tq * G rounded up to the sublane tile (8 rows for float32, 16 for bfloat16).
One program (tile i) handles every query head of every kv head of its tq tokens:
  * walks its sequence's logical blocks [tile_lo, tile_hi) in chunks of NBC blocks. A chunk is NBC DMAs per pool
    (K and V), one per block: k_hbm[layer, block_tables[seq, j]] -> k_buf[slot, j - chunk start], each a whole
    [BS, Hkv, D] block, so each K/V block is read from HBM once per query tile, for all kv heads at once. Blocks
    past tile_hi are not fetched;
  * double buffering: before computing on chunk c (slot s) it starts the DMAs of chunk c + 1 into slot 1 - s; on
    its last chunk it starts the next tile's first chunk (that is why the grid axis is "arbitrary": programs run
    in order on one core, and the prefetch crosses program boundaries);
  * per kv head h (a static loop): scores = q_ref[h] @ k_buf[s, :, :, h, :]^T (f32 accumulation; float32 inputs
    use Precision.HIGHEST), scaled, soft-capped, masked causally (kv position <= the row's position), by the
    context length and by the sliding window; online softmax in float32 in m/l/acc scratch; p @ V with V zeroed
    outside the fetched, in-context slots (stale or NaN slots would give 0 x NaN = NaN);
  * writes acc / l for every row of its output block (0 where a row saw nothing: padding tokens and rows).
Every (token, query head) of the output belongs to exactly one program and row, so the whole output is written.

Padding for TPU tiling: query rows are padded to M (a multiple of 8 / 16 sublanes) outside the kernel; head_dim 64
stays the arrays' full last dimension (Mosaic pads it to 128 lanes in VMEM); the pool's (Hkv, D) minor dimensions are
DMAd whole, so no kv-head slice of a tiled dimension is ever taken in HBM (3 kv heads are not a multiple of the
8-row tile), and the per-head view k_buf[s, :, :, h, :] is a strided VMEM load. Nothing of the pool is padded or
copied by this function.

The pool's HBM layout (measured with libtpu 0.0.42's compile-only client for v5e): the custom call takes the pool
row-major. For head_dim 128 that is XLA's default TPU layout. For head_dim 64 it is not: XLA's default puts the
block axis minor-most (major_to_minor (0, 2, 3, 4, 1)), and a step given a pool in that layout copies both pools to
row-major on the way in and back on the way out (four whole-pool copies per step, 939 MiB of temporaries for SmolLM2
at 30 layers x 1000 blocks in bfloat16). So on TPU the engine allocates the pool, and compiles its step, block copy
and swap-in write with the pool in and out, in an explicit row-major format,
`jax.experimental.layout.Format(Layout(major_to_minor=(0, 1, 2, 3, 4)), sharding)` (`pool_format` in
jaxpaged/model_runner.py); the compiled step then holds no copy of the pool (tests/kernels/test_tpu_pool_layout.py). XLA
tiles that layout's (Hkv, D) = (3, 64) as (4, 128): the pool takes 8/3 of its logical bytes in HBM (938 MiB for
352 MiB of K/V there), and the KV budget counts the padded bytes (`pool_block_bytes`, read from XLA's compiled
allocation). A TPU-first pool layout would remove the padding.

`decode_blocks` is accepted for the engine's sake and ignored: each program already stops at its tile's context,
so a decode reads only the blocks its sequence uses. `chunk_tokens` exists for tests (several chunks on short
contexts) and tuning.

JAX APIs relied on (present in both jax 0.10.2 and 0.11.2; the tests pass on both): `pl.pallas_call`, `pl.BlockSpec`,
`pl.ANY`, `pl.program_id`, `pl.num_programs`, `pl.when`, `pl.cdiv`, `pltpu.PrefetchScalarGridSpec`, `pltpu.VMEM`,
`pltpu.SMEM`, `pltpu.SemaphoreType.DMA`, `pltpu.make_async_copy`, `pltpu.CompilerParams(dimension_semantics=)`,
`pltpu.InterpretParams` (tests).

Known limits (no TPU was at hand: the kernel is checked by the Pallas interpreters, by jax.export's TPU lowering and
by libtpu's compile-only client for v4, v5e, v5p and v6e topologies; nothing was run or timed on a TPU):
  * the whole block table is scalar-prefetched into SMEM (1 MiB on v5e): S * W is capped at MAX_TABLE_ENTRIES
    (2^17, 512 KiB; e.g. 256 sequences x 512 blocks), a ValueError beyond;
  * no split of one sequence's context over several programs (flash-decoding), and the "arbitrary" grid runs on
    one TensorCore (v4/v5p megacore would split a "parallel" axis over two);
  * each block is one DMA per pool, of BS x Hkv x D elements: small DMAs for small models (6 KiB for SmolLM2 at
    BS 16 in bfloat16);
  * a decode tile has G query rows padded to M = 8 / 16: the MXU is mostly idle on decode, as in any decode kernel.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from pallas_kernels.validation import validate_ragged_inputs

NEG_INF = -1e30
SUPPORTED_HEAD_DIMS = (64, 128, 256)
MAX_TILE_ROWS = 256  # query rows (tokens x group) of one program; bounds the [Hkv, M, D] f32 accumulator
CHUNK_TOKENS = 128  # K/V tokens per loop step (NBC = CHUNK_TOKENS // BS blocks), before the VMEM cap below
CHUNK_BUFFER_BYTES = 1 << 20  # cap on one K or V chunk buffer slot in VMEM (padded tile bytes)
MAX_TABLE_ENTRIES = 1 << 17  # S * W int32 scalar-prefetched into SMEM (1 MiB on v5e; half of it for the table)


def _round_up(x: int, m: int) -> int:
    return -(-x // m) * m


def _sublanes(dtype) -> int:
    """Rows of one VMEM tile: 8 for 32-bit types, 16 for bfloat16."""
    return 8 * (4 // jnp.dtype(dtype).itemsize)


def query_tile(tile_size: int, group: int) -> int:
    """Tokens per program: tile_size, halved while even and tq * group > MAX_TILE_ROWS."""
    tq = tile_size
    while tq % 2 == 0 and tq * group > MAX_TILE_ROWS:
        tq //= 2
    return tq


def chunk_blocks(block_size: int, num_kv_heads: int, head_dim: int, dtype, chunk_tokens: int = CHUNK_TOKENS) -> int:
    """Blocks per DMA chunk: chunk_tokens of K/V, fewer if one buffer slot would pass CHUNK_BUFFER_BYTES."""
    itemsize = jnp.dtype(dtype).itemsize
    block_bytes = block_size * _round_up(num_kv_heads, _sublanes(dtype)) * _round_up(head_dim, 128) * itemsize
    return max(1, min(chunk_tokens // block_size, CHUNK_BUFFER_BYTES // block_bytes))


def _validate(q, k_cache, v_cache, block_tables, context_lens, query_start_loc, positions, tile_size,
              sliding_window, soft_cap, chunk_tokens):
    validate_ragged_inputs("Pallas TPU kernel", q, k_cache, v_cache, block_tables, context_lens, query_start_loc,
                           positions, tile_size, SUPPORTED_HEAD_DIMS)
    block_size = k_cache.shape[2]
    if block_tables.size > MAX_TABLE_ENTRIES:
        raise ValueError(f"block_tables{block_tables.shape} has {block_tables.size} entries; the Pallas TPU kernel "
                         f"keeps the table in SMEM and takes at most {MAX_TABLE_ENTRIES} (sequences x width)")
    if chunk_tokens < block_size or chunk_tokens % block_size:
        raise ValueError(f"chunk_tokens={chunk_tokens} must be a positive multiple of block_size={block_size}")
    if sliding_window is not None and sliding_window < 1:
        raise ValueError(f"sliding_window={sliding_window} must be >= 1 or None")
    if soft_cap is not None and soft_cap <= 0:
        raise ValueError(f"soft_cap={soft_cap} must be > 0 or None")


def _tile_schedule(block_tables, context_lens, query_start_loc, positions, *, tq, block_size, sliding_window):
    """Per query tile: its sequence, that sequence's context length and the logical blocks [lo, hi) it can see.

    Four [NT] int32 arrays from cheap XLA ops on [T] integers. A tile of padding tokens gets an empty range.
    """
    num_tiles = positions.shape[0] // tq
    num_seqs, width = block_tables.shape
    starts = jnp.arange(num_tiles, dtype=jnp.int32) * tq
    # A tile belongs to the sequence whose segment holds its first token (segments start at tile boundaries).
    # Unrolled: log2(S) gathers, no while loop in the step (gpu.py's SEQUENCE_SEARCH says why).
    seq = jnp.searchsorted(query_start_loc, starts, side="right", method="scan_unrolled").astype(jnp.int32) - 1
    seq = jnp.clip(seq, 0, num_seqs - 1)
    ctx = context_lens[seq]
    pos = positions.reshape(num_tiles, tq)
    # Causal: nothing past the tile's last position, nor past the context. All -1 (padding) -> an empty range.
    kv_end = jnp.maximum(jnp.minimum(ctx, jnp.max(pos, axis=1) + 1), 0)
    hi = jnp.minimum((kv_end + block_size - 1) // block_size, width)
    if sliding_window is None:
        lo = jnp.zeros_like(hi)
    else:
        # The window's lower edge is set by the tile's earliest real token.
        first = jnp.min(jnp.where(pos >= 0, pos, jnp.iinfo(jnp.int32).max), axis=1)
        lo = jnp.minimum(jnp.maximum(first - sliding_window + 1, 0) // block_size, hi)
    return seq, ctx.astype(jnp.int32), lo.astype(jnp.int32), hi.astype(jnp.int32)


def _paged_attention_kernel(
    # scalar prefetch (SMEM)
    layer_ref,  # [1] int32
    scales_ref,  # [2] float32: k_scale, v_scale
    tables_ref,  # [S * W] int32
    tile_seq_ref,  # [NT] int32
    tile_ctx_ref,  # [NT] int32
    tile_lo_ref,  # [NT] int32
    tile_hi_ref,  # [NT] int32
    # inputs
    q_ref,  # VMEM [Hkv, M, D]
    row_pos_ref,  # VMEM [M, 1] int32
    k_hbm,  # HBM [L, NB, BS, Hkv, D]
    v_hbm,  # HBM [L, NB, BS, Hkv, D]
    # output
    o_ref,  # VMEM [Hkv, M, D]
    # scratch
    k_buf,  # VMEM [2, NBC, BS, Hkv, D]
    v_buf,  # VMEM [2, NBC, BS, Hkv, D]
    sems,  # DMA semaphores [2, 2]: (K, V) x slot
    m_ref,  # VMEM [Hkv, M, 1] f32
    l_ref,  # VMEM [Hkv, M, 1] f32
    acc_ref,  # VMEM [Hkv, M, D] f32
    state_ref,  # SMEM [2] int32: slot of this tile's first chunk, 1 if it is already being fetched
    *,
    width: int,
    scale: float,
    sliding_window: int | None,
    soft_cap: float | None,
):
    tile = pl.program_id(0)
    num_tiles = pl.num_programs(0)
    num_kv_heads, rows, head_dim = q_ref.shape
    _, blocks_per_chunk, block_size, _, _ = k_buf.shape
    chunk = blocks_per_chunk * block_size
    layer = layer_ref[0]
    # The pool's scales, folded (fp8.py): q . (k * k_scale) = (q . k) * k_scale, and v_scale on the output.
    score_scale = scale * scales_ref[0]
    v_scale = scales_ref[1]

    def num_chunks(t):
        return pl.cdiv(tile_hi_ref[t] - tile_lo_ref[t], blocks_per_chunk)

    def chunk_copies(t, c, slot, fn):
        """Calls fn(copy_k, copy_v) for each block of chunk c of tile t that the tile can see (a scalar loop)."""
        seq = tile_seq_ref[t]
        first = tile_lo_ref[t] + c * blocks_per_chunk
        count = jnp.minimum(blocks_per_chunk, tile_hi_ref[t] - first)

        def each(j, carry):
            block = tables_ref[seq * width + first + j]
            fn(pltpu.make_async_copy(k_hbm.at[layer, block], k_buf.at[slot, j], sems.at[0, slot]),
               pltpu.make_async_copy(v_hbm.at[layer, block], v_buf.at[slot, j], sems.at[1, slot]))
            return carry

        jax.lax.fori_loop(0, count, each, 0)

    def start(t, c, slot):
        def go(copy_k, copy_v):
            copy_k.start()
            copy_v.start()
        chunk_copies(t, c, slot, go)

    def wait(t, c, slot):
        def go(copy_k, copy_v):
            copy_k.wait()
            copy_v.wait()
        chunk_copies(t, c, slot, go)

    @pl.when(tile == 0)
    def _():
        state_ref[0] = 0
        state_ref[1] = 0

    n = num_chunks(tile)
    first_slot = state_ref[0]

    @pl.when((n > 0) & (state_ref[1] == 0))
    def _():
        start(tile, 0, first_slot)

    m_ref[...] = jnp.full(m_ref.shape, NEG_INF, jnp.float32)
    l_ref[...] = jnp.zeros(l_ref.shape, jnp.float32)
    acc_ref[...] = jnp.zeros(acc_ref.shape, jnp.float32)

    ctx = tile_ctx_ref[tile]
    lo = tile_lo_ref[tile]
    # Slots past this limit are outside the context or were not fetched (stale data, NaN): V is zeroed there.
    v_limit = jnp.minimum(ctx, tile_hi_ref[tile] * block_size)
    row_pos = row_pos_ref[...]  # [M, 1]
    next_tile = jnp.minimum(tile + 1, num_tiles - 1)
    prefetch_next_tile = (tile + 1 < num_tiles) & (num_chunks(next_tile) > 0)
    compute_dtype = q_ref.dtype
    precision = jax.lax.Precision.HIGHEST if compute_dtype == jnp.float32 else None

    def body(c, carry):
        slot = (first_slot + c) % 2

        @pl.when(c + 1 < n)
        def _():
            start(tile, c + 1, 1 - slot)

        @pl.when((c + 1 == n) & prefetch_next_tile)
        def _():
            start(next_tile, 0, 1 - slot)

        wait(tile, c, slot)

        start_pos = (lo + c * blocks_per_chunk) * block_size
        kv_pos = start_pos + jax.lax.broadcasted_iota(jnp.int32, (1, chunk), 1)  # [1, C]
        mask = (kv_pos <= row_pos) & (kv_pos < ctx)  # [M, C]
        if sliding_window is not None:
            mask &= kv_pos > row_pos - sliding_window
        v_ok = start_pos + jax.lax.broadcasted_iota(jnp.int32, (chunk, 1), 0) < v_limit  # [C, 1]

        for h in range(num_kv_heads):
            q = q_ref[h]  # [M, D]
            # An fp8 pool is upcast here, in VMEM, to q's dtype (exact for bfloat16 and float32).
            k = k_buf[slot, :, :, h, :].reshape(chunk, head_dim).astype(compute_dtype)  # [C, D]
            s = jax.lax.dot_general(q, k, (((1,), (1,)), ((), ())), precision=precision,
                                    preferred_element_type=jnp.float32) * score_scale  # [M, C]
            if soft_cap is not None:
                s = soft_cap * jnp.tanh(s / soft_cap)
            s = jnp.where(mask, s, NEG_INF)
            m_prev = m_ref[h]  # [M, 1]
            m_next = jnp.maximum(m_prev, jnp.max(s, axis=1, keepdims=True))
            alpha = jnp.exp(m_prev - m_next)
            # Zeroed where masked: a row with nothing visible yet has m = NEG_INF, and exp(s - m) = 1 there.
            p = jnp.where(mask, jnp.exp(s - m_next), 0.0)  # [M, C] f32
            m_ref[h] = m_next
            l_ref[h] = alpha * l_ref[h] + jnp.sum(p, axis=1, keepdims=True)
            v = v_buf[slot, :, :, h, :].reshape(chunk, head_dim).astype(compute_dtype)  # [C, D]
            v = jnp.where(v_ok, v, jnp.zeros((), compute_dtype))
            pv = jax.lax.dot_general(p.astype(compute_dtype), v, (((1,), (0,)), ((), ())), precision=precision,
                                     preferred_element_type=jnp.float32)  # [M, D]
            acc_ref[h] = alpha * acc_ref[h] + pv
        return carry

    jax.lax.fori_loop(0, n, body, 0)

    # The next program finds its first chunk in the slot after this program's last one, already in flight.
    has_chunks = n > 0
    state_ref[0] = jnp.where(has_chunks, (first_slot + n) % 2, first_slot)
    state_ref[1] = jnp.where(has_chunks & prefetch_next_tile, 1, 0)

    for h in range(num_kv_heads):
        denom = l_ref[h]
        out = acc_ref[h] * (v_scale / jnp.where(denom == 0.0, 1.0, denom))  # rows that saw nothing give 0
        o_ref[h] = out.astype(o_ref.dtype)


def ragged_paged_attention_tpu(
    q: jax.Array,
    k_cache: jax.Array,
    v_cache: jax.Array,
    layer: jax.Array | int,
    block_tables: jax.Array,
    context_lens: jax.Array,
    query_start_loc: jax.Array,
    positions: jax.Array,
    *,
    scale: float,
    tile_size: int = 1,
    sliding_window: int | None = None,
    soft_cap: float | None = None,
    decode_blocks: int | None = None,
    interpret: bool | pltpu.InterpretParams = False,
    chunk_tokens: int = CHUNK_TOKENS,
    k_scale: float | jax.Array = 1.0,
    v_scale: float | jax.Array = 1.0,
) -> jax.Array:
    """Ragged paged attention over the stacked pool; arguments and result as the reference's (module docstring).

    interpret=True runs the kernel in Pallas' interpreter (any backend, CPU included; DMAs complete at once);
    interpret=pltpu.InterpretParams(...) runs the TPU interpreter, which models DMAs, semaphores and races.
    chunk_tokens (a multiple of block_size) sets the K/V tokens one loop step fetches and computes on.
    """
    del decode_blocks  # each program reads only the blocks its tile can see anyway
    _validate(q, k_cache, v_cache, block_tables, context_lens, query_start_loc, positions, tile_size,
              sliding_window, soft_cap, chunk_tokens)
    num_tokens, num_q_heads, head_dim = q.shape
    _, num_blocks, block_size, num_kv_heads, _ = k_cache.shape
    num_seqs, width = block_tables.shape
    group = num_q_heads // num_kv_heads
    tq = query_tile(tile_size, group)
    num_tiles = num_tokens // tq
    rows = _round_up(tq * group, _sublanes(q.dtype))
    blocks_per_chunk = chunk_blocks(block_size, num_kv_heads, head_dim, k_cache.dtype, chunk_tokens)

    block_tables = jnp.clip(block_tables.astype(jnp.int32), 0, num_blocks - 1)
    context_lens = context_lens.astype(jnp.int32)
    positions = positions.astype(jnp.int32)
    tile_seq, tile_ctx, tile_lo, tile_hi = _tile_schedule(
        block_tables, context_lens, query_start_loc.astype(jnp.int32), positions, tq=tq, block_size=block_size,
        sliding_window=sliding_window)

    # [T, Hq, D] -> [NT, Hkv, M, D]: row r of (tile, kv head) = (token r // G, query head r % G of the group).
    q_tiles = q.reshape(num_tiles, tq, num_kv_heads, group, head_dim).transpose(0, 2, 1, 3, 4)
    q_tiles = q_tiles.reshape(num_tiles, num_kv_heads, tq * group, head_dim)
    q_tiles = jnp.pad(q_tiles, ((0, 0), (0, 0), (0, rows - tq * group), (0, 0)))
    row_pos = jnp.repeat(positions.reshape(num_tiles, tq), group, axis=1)  # [NT, tq * G]
    row_pos = jnp.pad(row_pos, ((0, 0), (0, rows - tq * group)), constant_values=-1)[:, :, None]  # [NT, M, 1]

    kernel = functools.partial(
        _paged_attention_kernel, width=width, scale=float(scale), sliding_window=sliding_window,
        soft_cap=None if soft_cap is None else float(soft_cap))
    buf = pltpu.VMEM((2, blocks_per_chunk, block_size, num_kv_heads, head_dim), k_cache.dtype)
    grid_spec = pltpu.PrefetchScalarGridSpec(
        num_scalar_prefetch=7,
        grid=(num_tiles,),
        in_specs=[
            pl.BlockSpec((None, num_kv_heads, rows, head_dim), lambda i, *_: (i, 0, 0, 0)),
            pl.BlockSpec((None, rows, 1), lambda i, *_: (i, 0, 0)),
            pl.BlockSpec(memory_space=pl.ANY),
            pl.BlockSpec(memory_space=pl.ANY),
        ],
        out_specs=pl.BlockSpec((None, num_kv_heads, rows, head_dim), lambda i, *_: (i, 0, 0, 0)),
        scratch_shapes=[
            buf,
            buf,
            pltpu.SemaphoreType.DMA((2, 2)),
            pltpu.VMEM((num_kv_heads, rows, 1), jnp.float32),
            pltpu.VMEM((num_kv_heads, rows, 1), jnp.float32),
            pltpu.VMEM((num_kv_heads, rows, head_dim), jnp.float32),
            pltpu.SMEM((2,), jnp.int32),
        ],
    )
    out = pl.pallas_call(
        kernel,
        grid_spec=grid_spec,
        out_shape=jax.ShapeDtypeStruct((num_tiles, num_kv_heads, rows, head_dim), q.dtype),
        # "arbitrary": programs run in order, each one starting the next one's first DMA.
        compiler_params=pltpu.CompilerParams(dimension_semantics=("arbitrary",)),
        interpret=interpret,
        name="ragged_paged_attention_tpu",
    )(
        jnp.asarray(layer, jnp.int32).reshape(1),
        jnp.stack([jnp.asarray(k_scale, jnp.float32), jnp.asarray(v_scale, jnp.float32)]),
        block_tables.reshape(num_seqs * width), tile_seq, tile_ctx, tile_lo, tile_hi, q_tiles, row_pos, k_cache,
        v_cache,
    )
    # [NT, Hkv, M, D] -> [T, Hq, D]
    out = out[:, :, :tq * group].reshape(num_tiles, num_kv_heads, tq, group, head_dim).transpose(0, 2, 1, 3, 4)
    return out.reshape(num_tokens, num_q_heads, head_dim)
