"""Ragged paged attention for GPUs: a Pallas kernel on the Triton backend.

Same contract as `pallas_kernels.reference.ragged_paged_attention_reference` (layouts, masking, padding rules; read
its docstring): one launch serves a whole ragged batch of prefill chunks and decodes over the stacked K/V pool.

Why Triton and not Mosaic GPU
-----------------------------
Both GPU backends of Pallas carry a deprecation: a plain `pallas_call` lowered to Mosaic GPU warns
"jax-pallas-call-mgpu" (use `plgpu.kernel`) already in JAX 0.10.2, and the Triton backend warns "jax-pallas-triton"
at lowering from JAX 0.11 (removal planned). We chose Triton, deliberately:
  * a paged read is a gather: each K/V token row is found through the block table. Triton's pointer loads take a
    vector of row indices plus a mask, so a chunk of tokens spread over several physical blocks is one masked load,
    and slots past the context length are never read (so no NaN from an unused slot can reach the output).
    Mosaic GPU would need one TMA copy per block into shared memory, barriers, and warpgroup-sized (64-row)
    matmuls that a decode's query group of 3-8 heads would fill to 5-12%;
  * it runs on every CUDA GPU JAX supports (Ampere and later); Mosaic GPU is built for Hopper (sm_90a) and later;
  * it runs under `interpret=True` on CPU, which is how it is tested here, and `jax.export(platforms=['cuda'])`
    lowers it without a GPU, which checks Triton's static rules (power-of-two shapes) in CI.
On JAX 0.11.x the lowering emits a DeprecationWarning ("jax-pallas-triton") once per compiled shape. It is harmless,
but a test run with `-W error` must filter it (pytest `filterwarnings`, by message). We do not silence it here: a
library should not edit its users' warning filters. Up to jaxlib 0.10.2 the lowering hands Triton IR to XLA
(custom call `__gpu$xla.gpu.triton`); later jaxlibs compile it to PTX at lowering (`triton_kernel_call_ffi`). When
JAX removes the Triton backend this kernel moves to `plgpu.kernel`; the wrapper, the grid and the contract stay.

Shapes (T tokens, S sequences, W block-table width, L layers, NB pool blocks, BS block size, Hq/Hkv heads, D dim):
  q               [T, Hq, D]             bf16 or f32
  k_cache/v_cache [L, NB, BS, Hkv, D]    bf16, f32, or fp8 (e4m3fn / e5m2), cast to q's dtype in the kernel
  k_scale/v_scale float or f32 scalar    the pool's values are k_cache * k_scale, v_cache * v_scale (fp8.py);
                                         folded: scores are scaled by scale * k_scale, the output by v_scale
  layer           int32 scalar           layer of the pool to read
  block_tables    [S, W] int32
  context_lens    [S] int32
  query_start_loc [S + 1] int32          segments start at multiples of `tile_size` (the host's promise)
  positions       [T] int32              -1 on padding tokens
  output          [T, Hq, D]             q.dtype; 0 on padding tokens
Supported: head_dim a power of two from 16 to 256 (64 and 128 tested and lowered), block_size 8, 16 or 32, any
GQA ratio (a group that is not a power of two runs padded, its extra rows masked).

Inside the kernel every array is a flat view (free reshapes, no copy), so that one load is one gather of rows:
  q_ref                    [T * Hq, D]               row t * Hq + q_head
  o_ref                    [T * Hq, D] q.dtype       (splits K > 1: [K * T * Hq, D] float32, split k's rows at
                                                      k * T * Hq + t * Hq + q_head, normalised over its keys)
  lse_ref (K > 1 only)     [K * T * Hq] float32      log-sum-exp of each partial row (-1e30 if it saw no key)
  k_ref, v_ref             [L * NB * BS * Hkv, D]    row ((layer * NB + block) * BS + offset) * Hkv + kv_head
  tables_ref               [S * W]                   block_tables, row-major
  tile_seq_ref             [NT]                      sequence of each query tile
  tile_lo_ref, tile_hi_ref [NT]                      first / one-past-last K/V chunk the tile can see
  layer_ref                [1]
  scales_ref               [2] float32               (k_scale, v_scale)

Grid: (NT, Hkv, K), NT = T / tq query tiles of tq consecutive tokens, K = num_kv_splits. tq is the largest power
of two dividing `tile_size` with tq * Gp <= 128 (Gp = the GQA group Hq / Hkv rounded up to a power of two), so a
tile never straddles two sequences. One program (tile i, kv head h, split k):
  * loads the tile's queries for kv head h's query heads as one [M, D] block, M = max(16, tq * Gp), row
    r = (token r // Gp of the tile, query head r % Gp of the group); rows of padded heads or tokens are masked;
  * walks its share of the sequence's K/V in chunks of C = max(64, BS) tokens (several blocks: both dots then have
    every dimension >= 16, as Triton's tensor-core dots need): chunks [tile_lo, tile_hi) cut into K contiguous
    shares of ceil((hi - lo) / K) chunks, the k-th for split k. A chunk's rows are gathered through the block table
    by one masked load for K and one for V, so each K/V block is read once per kv head per query tile, and slots
    past the context length are not read at all;
  * keeps an online softmax in float32 (running max m, denominator l, accumulator acc [M, D]); scores are masked
    causally (kv position <= the row's position), by the context length and by the sliding window; q @ K^T and
    p @ V run in the input dtype with float32 accumulation (bf16 tensor cores; f32 inputs use IEEE f32 dots);
  * writes acc / l for its valid rows (and, when K > 1, m + log l); a padding token (position -1) sees nothing
    and gets 0.
Every (token, query head, split) belongs to exactly one program and row, so the whole output is written. With
K > 1, XLA merges the K partials (`merge_splits`: weights exp(lse_k - max_k lse_k)), reading K x T x Hq x D
float32 twice: small beside the K/V a long decode reads.

Splits (flash-decoding): without them a decode batch of S sequences runs S * Hkv programs (64 at batch 8 with 8 kv
heads), too few to keep an H100's 132 SMs loading. `default_kv_splits` doubles K while the grid has fewer than
TARGET_PROGRAMS programs and each split keeps at least one chunk, up to 16; it sees only static shapes, so the
average context comes from `decode_blocks` (the engine's flat-block count of a decode batch) or else from the
table width. Big batches and prefills get K = 1 and no merge.

Known limits (README, "Attention kernels on GPU", has the H100 figures):
  * TARGET_PROGRAMS, the chunk size and num_warps/num_stages are reasoned, and checked in one run each, not tuned;
  * a small decode batch (batch 8, up to 2048 tokens) is bound by the host's launch, 10-25% behind JAX's bundled
    kernel there;
  * a prefill re-reads its sequence's K/V once per query tile (from L2 when it fits).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels.validation import validate_ragged_inputs

NEG_INF = -1e30
SUPPORTED_HEAD_DIMS = (16, 32, 64, 128, 256)
MAX_TILE_ROWS = 128  # query rows (tokens x padded group) of one program; bounds the [M, D] f32 accumulator
MIN_DOT_DIM = 16  # Triton's tensor-core dots need every dimension >= 16
CHUNK_TOKENS = 64  # K/V tokens per loop step (at least one block), fewer where a chunk would pass CHUNK_BYTES
# Bytes of one loop step's K and V chunks. Triton keeps num_stages of them in shared memory: 64 KiB x 2 stages fits
# an A100's 164 KiB and an H100's 227 KiB beside the rest (float32 head_dim 256 at 64 tokens asked for 256 KiB, H100).
CHUNK_BYTES = 64 * 1024
# Flash-decoding split: when a batch has fewer than SPLIT_BELOW_PROGRAMS programs, each (tile, kv head) pair's
# context is split over several, up to TARGET_PROGRAMS in all (about four resident programs on each of an H100's 132
# SMs: a memory-bound kernel needs many loads in flight). On an H100 (benchmarks/kernel.py, README) 64 programs
# (batch 8 x 8 kv heads) ran 1.4-1.9x faster split 8 ways, and 256 programs (batch 32) up to 1.5x slower split 2
# ways (the merge costs more than the extra programs bring), hence no split from 128 programs on.
SPLIT_BELOW_PROGRAMS = 128
TARGET_PROGRAMS = 512
MAX_KV_SPLITS = 16
# How a query tile finds its sequence (jnp.searchsorted's method). Its default, "scan", is an XLA while loop, and on
# a GPU the host waits on the device at every iteration of one: on an H100 that cost a small decode call ~200 us of
# host time (benchmarks/kernel_gpu_anatomy.py). Unrolled, it is log2(S) gathers and no loop.
SEQUENCE_SEARCH = "scan_unrolled"


def _next_pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


def query_tile(tile_size: int, num_q_heads: int, num_kv_heads: int) -> int:
    """Tokens per program: the largest power of two dividing tile_size with tq * Gp <= MAX_TILE_ROWS (>= 1)."""
    group_pow2 = _next_pow2(num_q_heads // num_kv_heads)
    tq = tile_size & -tile_size  # lowest set bit: the largest power of two dividing tile_size
    while tq > 1 and tq * group_pow2 > MAX_TILE_ROWS:
        tq //= 2
    return tq


def chunk_tokens(block_size: int, head_dim: int, kv_itemsize: int) -> int:
    """K/V tokens per loop step: CHUNK_TOKENS (at least a block), halved while K + V of a chunk pass CHUNK_BYTES."""
    chunk = max(CHUNK_TOKENS, block_size)
    while chunk > MIN_DOT_DIM and 2 * chunk * head_dim * kv_itemsize > CHUNK_BYTES:
        chunk //= 2
    return chunk


def default_kv_splits(num_programs: int, chunks_per_seq: int) -> int:
    """How many programs share one (query tile, kv head)'s context: a power of two, 1 for big batches.

    num_programs: tiles x kv heads without splitting; chunks_per_seq: an estimate of the K/V chunks a sequence
    holds (a split gets at least one chunk).
    """
    splits = 1
    if num_programs >= SPLIT_BELOW_PROGRAMS:
        return splits
    while (splits < MAX_KV_SPLITS and num_programs * splits < TARGET_PROGRAMS
           and 2 * splits <= max(1, chunks_per_seq)):
        splits *= 2
    return splits


def kv_splits(num_tokens: int, num_seqs: int, width: int, tile_size: int, decode_blocks: int | None, *,
              num_q_heads: int, num_kv_heads: int, block_size: int, head_dim: int, kv_itemsize: int) -> int:
    """The split count `ragged_paged_attention_gpu` picks when num_kv_splits is None, from the static shapes alone:
    q [num_tokens, num_q_heads, head_dim], block tables [num_seqs, width], a pool of block_size-token blocks whose
    elements take kv_itemsize bytes, and (decode) `decode_blocks`. The kernel's program differs between two shapes
    only through this count and the arrays' sizes."""
    tq = query_tile(tile_size, num_q_heads, num_kv_heads)
    chunk = chunk_tokens(block_size, head_dim, kv_itemsize)
    # Blocks a sequence holds: the average in use for a decode batch (decode_blocks over S), else the width.
    blocks = -(-decode_blocks // num_seqs) if decode_blocks is not None else width
    return default_kv_splits(num_tokens // tq * num_kv_heads, -(-blocks * block_size // chunk))


def _tile_schedule(block_tables, context_lens, query_start_loc, positions, *, tq, chunk, sliding_window):
    """Per query tile, its sequence and the K/V chunk range [lo, hi) it can see: three [NT] int32 arrays.

    Cheap XLA ops on [T] integers, outside the kernel. A tile of padding tokens gets an empty range.
    """
    num_tiles = positions.shape[0] // tq
    starts = jnp.arange(num_tiles, dtype=jnp.int32) * tq
    # A tile belongs to the sequence whose segment holds its first token (segments start at tile boundaries).
    seq = jnp.searchsorted(query_start_loc, starts, side="right", method=SEQUENCE_SEARCH).astype(jnp.int32) - 1
    seq = jnp.clip(seq, 0, block_tables.shape[0] - 1)
    pos = positions.reshape(num_tiles, tq)
    # Causal: nothing past the tile's last position, nor past the context. All -1 (padding) -> an empty range.
    kv_end = jnp.maximum(jnp.minimum(context_lens[seq], jnp.max(pos, axis=1) + 1), 0)
    hi = (kv_end + chunk - 1) // chunk
    if sliding_window is None:
        lo = jnp.zeros_like(hi)
    else:
        # The window's lower edge is set by the tile's earliest real token.
        first = jnp.min(jnp.where(pos >= 0, pos, jnp.iinfo(jnp.int32).max), axis=1)
        lo = jnp.minimum(jnp.maximum(first - sliding_window + 1, 0) // chunk, hi)
    return seq, lo.astype(jnp.int32), hi.astype(jnp.int32)


def _paged_attention_kernel(
    # inputs
    layer_ref,  # [1] int32
    scales_ref,  # [2] float32: k_scale, v_scale
    tile_seq_ref,  # [NT] int32
    tile_lo_ref,  # [NT] int32
    tile_hi_ref,  # [NT] int32
    tables_ref,  # [S * W] int32
    context_lens_ref,  # [S] int32
    positions_ref,  # [T] int32
    q_ref,  # [T * Hq, D]
    k_ref,  # [L * NB * BS * Hkv, D]
    v_ref,  # [L * NB * BS * Hkv, D]
    # outputs
    o_ref,  # [T * Hq, D] q.dtype; with splits: [splits * T * Hq, D] float32, this split's normalised partial
    lse_ref=None,  # with splits only: [splits * T * Hq] float32, log-sum-exp of each partial (NEG_INF if empty)
    *,
    num_splits: int,
    tq: int,
    group: int,
    group_pow2: int,
    rows: int,
    chunk: int,
    block_size: int,
    num_blocks: int,
    num_q_heads: int,
    num_kv_heads: int,
    width: int,
    scale: float,
    sliding_window: int | None,
    soft_cap: float | None,
    precision: jax.lax.Precision | None,
):
    tile = pl.program_id(0)
    kv_head = pl.program_id(1)
    split = pl.program_id(2)
    head_dim = q_ref.shape[-1]
    num_rows = q_ref.shape[0]  # T * Hq

    seq = tile_seq_ref[tile]
    context_len = context_lens_ref[seq]
    layer = layer_ref[0]
    # The pool's scales, folded (fp8.py): q . (k * k_scale) = (q . k) * k_scale, and v_scale on the output.
    score_scale = scale * scales_ref[0]
    v_scale = scales_ref[1]

    # Query rows: r = (token r // Gp of the tile, query head r % Gp of this kv head's group).
    r = jnp.arange(rows, dtype=jnp.int32)
    tok = r // group_pow2
    g = r % group_pow2
    row_ok = (tok < tq) & (g < group)  # [M]
    token = tile * tq + jnp.minimum(tok, tq - 1)  # [M]
    # [M] rows of q_ref and o_ref. A padded row points past the end: masked, it is never read or written, and
    # (unlike a clamped index) it cannot alias a real row, which matters to the interpreter's masked store.
    q_rows = jnp.where(row_ok, token * num_q_heads + kv_head * group + g, num_rows * num_splits + r)
    row_mask = jnp.broadcast_to(row_ok[:, None], (rows, head_dim))
    # Loads index rows and columns with two broadcast integer arrays: Triton turns them into pointer offsets (64-bit
    # when the array passes 4 GiB), and the interpreter into a numpy-style gather.
    cols = jnp.arange(head_dim, dtype=jnp.int32)[None, :]
    q = plgpu.load(q_ref.at[q_rows[:, None], cols], mask=row_mask, other=0)  # [M, D]
    q_pos = jnp.where(row_ok, plgpu.load(positions_ref.at[token]), -1)  # [M]; padded rows see nothing

    def body(c, carry):
        m_prev, l_prev, acc_prev = carry
        kv_pos = c * chunk + jnp.arange(chunk, dtype=jnp.int32)  # [C]
        kv_ok = kv_pos < context_len
        # Physical block of each token of the chunk; past the context nothing is read (masked to block 0).
        physical = plgpu.load(tables_ref.at[seq * width + kv_pos // block_size], mask=kv_ok, other=0)  # [C]
        kv_rows = ((layer * num_blocks + physical) * block_size + kv_pos % block_size) * num_kv_heads + kv_head
        kv_mask = jnp.broadcast_to(kv_ok[:, None], (chunk, head_dim))
        # Unused slots may hold garbage (NaN): they are not loaded, the mask fills them with 0 (0 x NaN = NaN).
        # An fp8 pool is upcast here, in registers, to q's dtype (exact for bfloat16 and float32).
        k = plgpu.load(k_ref.at[kv_rows[:, None], cols], mask=kv_mask, other=0.0).astype(q.dtype)  # [C, D]
        v = plgpu.load(v_ref.at[kv_rows[:, None], cols], mask=kv_mask, other=0.0).astype(q.dtype)  # [C, D]

        s = jax.lax.dot_general(q, k, (((1,), (1,)), ((), ())), precision=precision,
                                preferred_element_type=jnp.float32)  # [M, C]
        s = s * score_scale
        if soft_cap is not None:
            s = soft_cap * jnp.tanh(s / soft_cap)
        mask = kv_ok[None, :] & (kv_pos[None, :] <= q_pos[:, None])  # [M, C]
        if sliding_window is not None:
            mask &= kv_pos[None, :] > q_pos[:, None] - sliding_window
        s = jnp.where(mask, s, NEG_INF)

        m_next = jnp.maximum(m_prev, jnp.max(s, axis=1))  # [M]
        alpha = jnp.exp(m_prev - m_next)
        # Zeroed where masked: a row with nothing visible yet has m = NEG_INF, and exp(s - m) = 1 there.
        p = jnp.where(mask, jnp.exp(s - m_next[:, None]), 0.0)  # [M, C] f32
        l_next = alpha * l_prev + jnp.sum(p, axis=1)
        pv = jnp.dot(p.astype(v.dtype), v, precision=precision, preferred_element_type=jnp.float32)  # [M, D]
        return m_next, l_next, alpha[:, None] * acc_prev + pv

    init = (jnp.full((rows,), NEG_INF, jnp.float32), jnp.zeros((rows,), jnp.float32),
            jnp.zeros((rows, head_dim), jnp.float32))
    # This split's share of the tile's chunks [lo, hi): ceil((hi - lo) / splits) each; the last may be short or empty.
    lo, hi = tile_lo_ref[tile], tile_hi_ref[tile]
    per_split = (hi - lo + num_splits - 1) // num_splits
    split_lo = jnp.minimum(lo + split * per_split, hi)
    split_hi = jnp.minimum(split_lo + per_split, hi)
    m, denom, acc = jax.lax.fori_loop(split_lo, split_hi, body, init)
    seen = denom > 0.0
    out = acc * (v_scale / jnp.where(seen, denom, 1.0))[:, None]  # rows that saw nothing (padding, splits) give 0
    if num_splits == 1:
        plgpu.store(o_ref.at[q_rows[:, None], cols], out.astype(o_ref.dtype), mask=row_mask)
    else:
        # Partials of split k live at rows k * T * Hq + row; padded rows stay past the end of the buffer.
        part_rows = jnp.where(row_ok, q_rows + split * num_rows, q_rows)
        plgpu.store(o_ref.at[part_rows[:, None], cols], out, mask=row_mask)
        lse = jnp.where(seen, m + jnp.log(jnp.where(seen, denom, 1.0)), NEG_INF)
        plgpu.store(lse_ref.at[part_rows], lse, mask=row_ok)


def ragged_paged_attention_gpu(
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
    num_kv_splits: int | None = None,
    k_scale: float | jax.Array = 1.0,
    v_scale: float | jax.Array = 1.0,
    interpret: bool = False,
    num_warps: int | None = None,
    num_stages: int = 2,
) -> jax.Array:
    """Ragged paged attention over the stacked pool; arguments and result as the reference's (module docstring).

    num_kv_splits: programs per (query tile, kv head), each over a contiguous share of the context's chunks
    (flash-decoding); None picks `default_kv_splits` from the static shapes (decode_blocks, when given, tells the
    average context). interpret=True runs the kernel in Pallas' interpreter (any backend, CPU included). num_warps
    (default: 4, or 8 for programs of more than 64 x 128 accumulator elements) and num_stages are Triton's knobs.
    """
    validate_ragged_inputs("Pallas GPU kernel", q, k_cache, v_cache, block_tables, context_lens, query_start_loc,
                           positions, tile_size, SUPPORTED_HEAD_DIMS)
    num_tokens, num_q_heads, head_dim = q.shape
    num_layers, num_blocks, block_size, num_kv_heads, _ = k_cache.shape
    num_seqs, width = block_tables.shape
    group = num_q_heads // num_kv_heads
    group_pow2 = _next_pow2(group)  # Triton blocks are powers of two: a group of 3 runs as 4, one row masked
    tq = query_tile(tile_size, num_q_heads, num_kv_heads)
    rows = max(MIN_DOT_DIM, tq * group_pow2)
    chunk = chunk_tokens(block_size, head_dim, jnp.dtype(k_cache.dtype).itemsize)
    # float32 inputs are multiplied in float32 (IEEE): Triton's default for them is TF32, ~1e-3 off.
    precision = jax.lax.Precision.HIGHEST if q.dtype == jnp.float32 else None
    num_tiles = num_tokens // tq
    if num_kv_splits is None:
        num_kv_splits = kv_splits(num_tokens, num_seqs, width, tile_size, decode_blocks, num_q_heads=num_q_heads,
                                  num_kv_heads=num_kv_heads, block_size=block_size, head_dim=head_dim,
                                  kv_itemsize=jnp.dtype(k_cache.dtype).itemsize)
    if num_kv_splits < 1:
        raise ValueError(f"num_kv_splits={num_kv_splits} must be >= 1")

    block_tables = block_tables.astype(jnp.int32)
    context_lens = context_lens.astype(jnp.int32)
    positions = positions.astype(jnp.int32)
    tile_seq, tile_lo, tile_hi = _tile_schedule(block_tables, context_lens, query_start_loc.astype(jnp.int32),
                                                positions, tq=tq, chunk=chunk, sliding_window=sliding_window)

    kernel = functools.partial(
        _paged_attention_kernel, tq=tq, group=group, group_pow2=group_pow2, rows=rows, chunk=chunk,
        block_size=block_size, num_blocks=num_blocks, num_q_heads=num_q_heads, num_kv_heads=num_kv_heads,
        width=width, scale=float(scale), sliding_window=sliding_window,
        soft_cap=None if soft_cap is None else float(soft_cap), num_splits=num_kv_splits, precision=precision)
    if num_warps is None:
        num_warps = 4 if rows * head_dim <= 64 * 128 else 8
    kv_rows = num_layers * num_blocks * block_size * num_kv_heads
    q_rows = num_tokens * num_q_heads
    if num_kv_splits == 1:
        out_shape = jax.ShapeDtypeStruct((q_rows, head_dim), q.dtype)
    else:  # float32 partials and their log-sum-exps, merged below
        out_shape = (jax.ShapeDtypeStruct((num_kv_splits * q_rows, head_dim), jnp.float32),
                     jax.ShapeDtypeStruct((num_kv_splits * q_rows,), jnp.float32))
    out = pl.pallas_call(
        kernel,
        grid=(num_tiles, num_kv_heads, num_kv_splits),
        out_shape=out_shape,
        compiler_params=plgpu.CompilerParams(num_warps=num_warps, num_stages=num_stages),
        interpret=interpret,
        name="ragged_paged_attention",
    )(
        jnp.asarray(layer, jnp.int32).reshape(1),
        jnp.stack([jnp.asarray(k_scale, jnp.float32), jnp.asarray(v_scale, jnp.float32)]), tile_seq, tile_lo,
        tile_hi, block_tables.reshape(num_seqs * width), context_lens, positions,
        q.reshape(num_tokens * num_q_heads, head_dim), k_cache.reshape(kv_rows, head_dim),
        v_cache.reshape(kv_rows, head_dim),
    )
    if num_kv_splits > 1:
        out = merge_splits(out[0].reshape(num_kv_splits, q_rows, head_dim), out[1].reshape(num_kv_splits, q_rows))
    return out.astype(q.dtype).reshape(num_tokens, num_q_heads, head_dim)


def merge_splits(parts: jax.Array, lse: jax.Array) -> jax.Array:
    """Softmax-weighted sum of per-split results: parts [K, R, D] f32 (each normalised over its own keys), lse
    [K, R] f32 (log of each split's softmax denominator, NEG_INF where it saw no key) -> [R, D] float32.

    A row no split saw (padding) has all parts 0 and comes out 0.
    """
    weights = jnp.exp(lse - jnp.max(lse, axis=0, keepdims=True))  # [K, R], 0 for empty splits of a seen row
    return jnp.sum(weights[..., None] * parts, axis=0) / jnp.sum(weights, axis=0)[:, None]
