"""The native CPU kernels' Python entry points (XLA FFI custom calls; build.py builds each kernel's library on first
use): ragged paged attention and its pool writes (paged_attention.cc), a bf16 matmul that reads a stacked layer
weight in place (matmul.cc, `matmul_native`), RMSNorm and residual adds (norm.cc), rotary embedding (rope.cc), and
the sampler's argmax (argmax.cc), penalties (penalties.cc), top-k / top-p threshold (top_p.cc), Gumbel-max draw
(gumbel.cc) and log-probs (logprobs.cc).

    paged_attention_native(q, k_cache, v_cache, layer, block_tables, context_lens, query_start_loc, positions,
                           scale=..., tile_size=..., sliding_window=None, soft_cap=None, decode_blocks=None,
                           prompt_lens=None)

Arguments and result are those of `ragged_paged_attention_reference` (reference.py states every layout), for any
batch: decodes, prefill chunks, or both. tile_size and decode_blocks are accepted for the contract's sake and
ignored: each query token reads exactly the blocks its sequence holds up to its own position. q and the pools are
float32 or bfloat16 (softmax and p @ V accumulate in float32), or the pools fp8 (float8_e4m3fn / float8_e5m2, with
q either, read with k_scale / v_scale: pallas_kernels/fp8.py); the pool is passed whole with the layer index, so no
per-layer slice is copied, and the call works inside jit and lax.fori_loop.

prompt_lens [S] int32 (the prompt length of each sequence; the engine passes it) makes every token's result
independent of how its sequence was cut into steps: prompt tokens run in query tiles, the others (decodes,
speculative proposals) one token at a time, so a prompt gives the same bits in one chunk or as the short tail of a
prefix-cache hit, and a generated token the same bits when verified or recomputed. Without it, a sequence with at
most 17 tokens in the call runs per token and a longer one in tiles.

Each function checks its arguments (ValueError naming the field), then that its kernel is available
(`available(kernel)`; RuntimeError with the reason if not).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels.cpu_native.build import KERNELS, available, cache_dir, library, target_name, unavailable_reason
from pallas_kernels.fp8 import is_fp8, to_pool_dtype
from pallas_kernels.validation import KERNEL_DTYPES

GLU_ACTIVATIONS = {"silu": 0, "gelu_tanh": 1}  # matmul.cc's Activation
_KERNEL_OF = {symbol: kernel.name for kernel in KERNELS.values() for symbol in kernel.symbols}


def _ffi_call(symbol: str, result_shape_dtypes, **kwargs):
    """jax.ffi.ffi_call of the handler `symbol` (its kernel built and registered first; RuntimeError if it cannot
    be)."""
    kernel = _KERNEL_OF[symbol]
    if not available(kernel):
        raise RuntimeError(f"the native CPU kernel {kernel!r} is unavailable: {unavailable_reason(kernel)}")
    return jax.ffi.ffi_call(target_name(symbol), result_shape_dtypes, **kwargs)


def matmul_is_fast() -> bool:
    """Whether `matmul_native` runs here, on its AVX512_BF16 path (the matmul kernel is built only for CPUs with it)."""
    return available("matmul") and bool(library("matmul").JaxpagedMatmulIsFast())


def matmul_uses_amx() -> bool:
    """Whether `matmul_native` (and `matmul_glu_native`) with K a multiple of 32 run on AMX tiles here: built for a
    CPU with AMX-BF16, granted the tile state by the OS, and not turned off by JAXPAGED_NATIVE_AMX=0 (read on each
    call; benchmarks/matmul.py compares the two paths)."""
    return matmul_is_fast() and bool(library("matmul").JaxpagedMatmulUsesAmx())


def _int32(name: str, x, ndim: int) -> jax.Array:
    x = jnp.asarray(x)
    if not jnp.issubdtype(x.dtype, jnp.integer):
        raise ValueError(f"{name} must be int32, got {x.dtype}")
    if x.ndim != ndim:
        raise ValueError(f"{name} must have {ndim} dimensions, got shape {x.shape}")
    return x.astype(jnp.int32)


def paged_attention_native(
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
    k_scale: float | jax.Array = 1.0,
    v_scale: float | jax.Array = 1.0,
    prompt_lens: jax.Array | None = None,
) -> jax.Array:
    """Ragged paged attention on the CPU by the native kernel; see the module docstring."""
    del tile_size, decode_blocks  # the kernel walks each token's own blocks, whatever the batch's layout
    if q.ndim != 3 or k_cache.ndim != 5:
        raise ValueError(f"q must be [T, Hq, D] and k_cache [L, NB, BS, Hkv, D], got {q.shape} and {k_cache.shape}")
    if k_cache.shape != v_cache.shape:
        raise ValueError(f"k_cache {k_cache.shape} and v_cache {v_cache.shape} differ")
    if np.dtype(q.dtype) not in KERNEL_DTYPES:
        raise ValueError(f"the native kernel takes float32 or bfloat16, got {q.dtype}; use the reference backend")
    if k_cache.dtype != v_cache.dtype or not (k_cache.dtype == q.dtype or is_fp8(k_cache.dtype)):
        raise ValueError(f"q, k_cache and v_cache need one dtype (or the pools one fp8 dtype), got {q.dtype}, "
                         f"{k_cache.dtype}, {v_cache.dtype}")
    num_tokens, num_q_heads, head_dim = q.shape
    num_kv_heads = k_cache.shape[3]
    if k_cache.shape[4] != head_dim or num_q_heads % num_kv_heads:
        raise ValueError(f"q {q.shape} does not fit the pool {k_cache.shape}: head_dim must match and Hq be a "
                         "multiple of Hkv")
    block_tables = _int32("block_tables", block_tables, 2)
    context_lens = _int32("context_lens", context_lens, 1)
    query_start_loc = _int32("query_start_loc", query_start_loc, 1)
    positions = _int32("positions", positions, 1)
    layer = _int32("layer", layer, 0)
    num_seqs = block_tables.shape[0]
    if context_lens.shape != (num_seqs,) or query_start_loc.shape != (num_seqs + 1,):
        raise ValueError(f"context_lens {context_lens.shape} and query_start_loc {query_start_loc.shape} must be "
                         f"[S] and [S + 1] for block_tables {block_tables.shape}")
    if positions.shape != (num_tokens,):
        raise ValueError(f"positions {positions.shape} must be [T] = ({num_tokens},)")
    if prompt_lens is None:
        prompt_lens = jnp.full((num_seqs,), -1, jnp.int32)
    prompt_lens = _int32("prompt_lens", prompt_lens, 1)
    if prompt_lens.shape != (num_seqs,):
        raise ValueError(f"prompt_lens {prompt_lens.shape} must be [S] = ({num_seqs},)")
    if sliding_window is not None and sliding_window <= 0:
        raise ValueError(f"sliding_window={sliding_window} must be positive or None")
    if soft_cap is not None and soft_cap <= 0:
        raise ValueError(f"soft_cap={soft_cap} must be positive or None")
    call = _ffi_call("JaxpagedPagedAttention", jax.ShapeDtypeStruct(q.shape, q.dtype))
    kv_scales = jnp.stack([jnp.asarray(k_scale, jnp.float32), jnp.asarray(v_scale, jnp.float32)])  # [2]
    return call(q, k_cache, v_cache, layer, block_tables, context_lens, query_start_loc, positions, prompt_lens,
                kv_scales,
                scale=np.float32(scale), sliding_window=np.int64(sliding_window or 0),
                soft_cap=np.float32(soft_cap or 0.0))


def write_kv_native(k_cache: jax.Array, v_cache: jax.Array, layer: jax.Array | int, k_new: jax.Array,
                    v_new: jax.Array, slot_mapping: jax.Array) -> tuple[jax.Array, jax.Array]:
    """`write_kv_reference`'s contract (k_new, v_new [T, Hkv, D] into the flat slots [T] of `layer` of the pools
    [L, NB, BS, Hkv, D]) by the native kernel, in place through input/output aliasing, in the pools' dtype: XLA
    CPU's scatter converts a 16-bit or fp8 pool to float16/float32 and back, whole, around every write; this one
    copies T rows (cast to the pool's dtype first, an fp8 pool saturating: `fp8.to_pool_dtype`)."""
    if k_cache.ndim != 5 or k_cache.shape != v_cache.shape:
        raise ValueError(f"the pools must be one shape [L, NB, BS, Hkv, D], got {k_cache.shape} and {v_cache.shape}")
    if k_new.shape != v_new.shape or k_new.shape[1:] != k_cache.shape[3:]:
        raise ValueError(f"k_new {k_new.shape} and v_new {v_new.shape} must be [T, Hkv, D] of the pool {k_cache.shape}")
    slot_mapping = _int32("slot_mapping", slot_mapping, 1)
    if slot_mapping.shape != k_new.shape[:1]:
        raise ValueError(f"slot_mapping {slot_mapping.shape} must be [T] for k_new {k_new.shape}")
    pool = jax.ShapeDtypeStruct(k_cache.shape, k_cache.dtype)
    call = _ffi_call("JaxpagedKvWrite", (pool, pool), input_output_aliases={0: 0, 1: 1})
    k, v = call(k_cache, v_cache, _int32("layer", layer, 0), to_pool_dtype(k_new, k_cache.dtype),
                to_pool_dtype(v_new, v_cache.dtype), slot_mapping)
    return k, v


def set_blocks_native(k_cache: jax.Array, v_cache: jax.Array, dst: jax.Array, k_blocks: jax.Array,
                      v_blocks: jax.Array) -> tuple[jax.Array, jax.Array]:
    """pool[:, dst[j]] = blocks[:, j] for both pools [L, NB, BS, Hkv, D], blocks [L, N, BS, Hkv, D], dst [N] int32:
    copy-on-write copies and swap-ins, in place through aliasing, in the pools' dtype (XLA CPU's scatter into a
    16-bit pool converts it whole to float32 and back)."""
    if k_cache.ndim != 5 or k_cache.shape != v_cache.shape:
        raise ValueError(f"the pools must be one shape [L, NB, BS, Hkv, D], got {k_cache.shape} and {v_cache.shape}")
    expected = (k_cache.shape[0], dst.shape[0], *k_cache.shape[2:])
    if k_blocks.shape != expected or v_blocks.shape != expected:
        raise ValueError(f"k_blocks {k_blocks.shape} and v_blocks {v_blocks.shape} must be {expected} for dst "
                         f"{dst.shape} and the pool {k_cache.shape}")
    pool = jax.ShapeDtypeStruct(k_cache.shape, k_cache.dtype)
    call = _ffi_call("JaxpagedSetBlocks", (pool, pool), input_output_aliases={0: 0, 1: 1})
    return call(k_cache, v_cache, _int32("dst", dst, 1), jnp.asarray(k_blocks, k_cache.dtype),
                jnp.asarray(v_blocks, v_cache.dtype))


PANEL = 32  # output columns per panel of a prepacked weight (matmul.cc's kPanel)


def prepack_weight(w):
    """A stacked weight [L, K, N] (K even, N a multiple of 32) laid out as the native matmuls read it, panel after
    panel: [L, N/32, K/2, 64], where [l, p, i] holds, for the 32 columns c of panel p, w[l, 2i, c] and
    w[l, 2i + 1, c] interleaved by halves of 16 columns (what VDPBF16PS multiplies). A panel is one contiguous run of
    K * 64 bytes, so a call streams the weight instead of reading 64 bytes per row and packing it (matmul.cc).
    numpy or jax arrays; the inverse is `unpack_weight`."""
    xp = jnp if isinstance(w, jax.Array) else np
    L, K, N = w.shape
    if K % 2 or N % PANEL:
        raise ValueError(f"a prepacked weight needs K even and N a multiple of {PANEL}, got [L, K, N] = {w.shape}")
    w = w.reshape(L, K // 2, 2, N // PANEL, 2, PANEL // 2)  # [l, i, parity, panel, half, lane]
    return xp.transpose(w, (0, 3, 1, 4, 5, 2)).reshape(L, N // PANEL, K // 2, 2 * PANEL)


def unpack_weight(w):
    """`prepack_weight`'s inverse: [L, N/32, K/2, 64] -> [L, K, N] (or [N/32, K/2, 64] -> [K, N])."""
    xp = jnp if isinstance(w, jax.Array) else np
    *lead, panels, pairs, _ = w.shape
    w = w.reshape(*lead, panels, pairs, 2, PANEL // 2, 2)  # [.., panel, i, half, lane, parity]
    n = len(lead)
    w = xp.transpose(w, (*range(n), n + 1, n + 4, n, n + 2, n + 3))  # [.., i, parity, panel, half, lane]
    return w.reshape(*lead, 2 * pairs, panels * PANEL)


def _check_matmul(x: jax.Array, w: jax.Array, name: str) -> None:
    """The native matmuls' arguments: x [M, K] and w [K, N], [L, K, N] or prepacked [L, N/32, K/2, 64]
    (`prepack_weight`), both bfloat16, K even; the kernels built."""
    k = 2 * w.shape[2] if w.ndim == 4 else w.shape[-2]
    if x.ndim != 2 or w.ndim not in (2, 3, 4) or k != x.shape[1] or (w.ndim == 4 and w.shape[3] != 2 * PANEL):
        raise ValueError(f"x must be [M, K] and {name} [K, N], [L, K, N] or prepacked [L, N/32, K/2, 64], got "
                         f"{x.shape} and {w.shape}")
    if x.dtype != jnp.bfloat16 or w.dtype != jnp.bfloat16:
        raise ValueError(f"x and {name} must be bfloat16, got {x.dtype} and {w.dtype}")
    if x.shape[1] % 2:
        raise ValueError(f"K = {x.shape[1]} must be even")


def _columns(w: jax.Array) -> int:
    return w.shape[1] * PANEL if w.ndim == 4 else w.shape[-1]


def matmul_native(x: jax.Array, w: jax.Array, layer: jax.Array | int = 0, out_dtype=None,
                  rows: jax.Array | int | None = None) -> jax.Array:
    """x [M, K] @ w [K, N], or @ w[layer] for a stacked w [L, K, N] or a prepacked one (`prepack_weight`; read in
    place: no slice is copied), both
    bfloat16 with K even, accumulated in float32 and returned in out_dtype (bfloat16 by default, rounded to nearest
    even, or float32). Equal to `jnp.dot(x, w[layer], preferred_element_type=jnp.float32).astype(out_dtype)` up to
    float32 summation order, on the first `rows` rows (default: all M; an int32 scalar, traced or not); the rows
    after them are zeros. Fast on CPUs with AVX512_BF16 (`matmul_is_fast`); see matmul.cc."""
    out_dtype = jnp.dtype(out_dtype or jnp.bfloat16)
    _check_matmul(x, w, "w")
    if out_dtype not in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float32)):
        raise ValueError(f"out_dtype must be bfloat16 or float32, got {out_dtype}")
    call = _ffi_call("JaxpagedMatmul", jax.ShapeDtypeStruct((x.shape[0], _columns(w)), out_dtype))
    return call(x, w, _int32("layer", layer, 0), _int32("rows", x.shape[0] if rows is None else rows, 0))


def matmul_glu_native(x: jax.Array, w_gate: jax.Array, w_up: jax.Array, layer: jax.Array | int = 0,
                      activation: str = "silu", rows: jax.Array | int | None = None) -> jax.Array:
    """act(x @ w_gate) * (x @ w_up) [M, N] bfloat16 in one pass (a gated MLP's first half): the weights [K, N], or
    stacked [L, K, N] and read at `layer` in place; rounded as the unfused bfloat16 computation is: each product
    (as `matmul_native`'s), act(gate) (computed in float32) and the product; both weights may be prepacked.
    activation: "silu" or "gelu_tanh" (GELU's tanh approximation). Only the first `rows` rows (default: all) are
    computed, as in `matmul_native`."""
    if activation not in GLU_ACTIVATIONS:
        raise ValueError(f"activation must be one of {', '.join(GLU_ACTIVATIONS)}, got {activation!r}")
    if w_gate.shape != w_up.shape or w_gate.dtype != w_up.dtype:
        raise ValueError(f"w_gate and w_up must have one shape and dtype, got {w_gate.shape} {w_gate.dtype} and "
                         f"{w_up.shape} {w_up.dtype}")
    _check_matmul(x, w_gate, "w_gate")
    call = _ffi_call("JaxpagedMatmulGlu", jax.ShapeDtypeStruct((x.shape[0], _columns(w_gate)), jnp.bfloat16))
    return call(x, w_gate, w_up, _int32("layer", layer, 0), _int32("rows", x.shape[0] if rows is None else rows, 0),
                act=np.int64(GLU_ACTIVATIONS[activation]))


def rms_norm_native(x: jax.Array, weight: jax.Array, layer: jax.Array | int, eps: float,
                    delta: jax.Array | None = None, unit_offset: bool = False) -> tuple[jax.Array | None, jax.Array]:
    """RMSNorm of a bfloat16 residual stream by norm.cc: x [T, H] (plus delta [T, H] first, if given), weight the
    stacked [L, H] read at `layer` (or one [H]). Returns (s, out): s = x + delta in float32, unrounded (None
    without a delta), and out = weight * bf16(s * rsqrt(mean(s^2) + eps)) [T, H] bfloat16 (unit_offset, Gemma's:
    bf16(s * rsqrt(...) * (1 + weight)) in float32), the numbers of XLA's fused step for the models' pure-JAX norm
    up to the float32 summation order of the mean."""
    weight = weight[None] if weight.ndim == 1 else weight
    if x.ndim != 2 or weight.ndim != 2 or weight.shape[1] != x.shape[1]:
        raise ValueError(f"x must be [T, H] and weight [L, H] or [H], got {x.shape} and {weight.shape}")
    if not x.dtype == weight.dtype == jnp.bfloat16 or (delta is not None and delta.dtype != jnp.bfloat16):
        raise ValueError(f"x, weight and delta must be bfloat16, got {x.dtype}, {weight.dtype}, "
                         f"{None if delta is None else delta.dtype}")
    if delta is not None and delta.shape != x.shape:
        raise ValueError(f"delta {delta.shape} must be x's shape {x.shape}")
    sum_shape = x.shape if delta is not None else (0,)
    call = _ffi_call("JaxpagedRmsNorm", (jax.ShapeDtypeStruct(sum_shape, jnp.float32),
                                          jax.ShapeDtypeStruct(x.shape, jnp.bfloat16)))
    s, out = call(x, jnp.zeros((0,), x.dtype) if delta is None else delta, weight, _int32("layer", layer, 0),
                  eps=np.float32(eps), unit_offset=np.int64(bool(unit_offset)))
    return (s if delta is not None else None), out


def add_round_native(s: jax.Array, delta: jax.Array) -> jax.Array:
    """bf16(bf16(s) + delta) for s float32 and delta bfloat16 of one shape, by norm.cc: a layer's last residual add,
    s the float32 sum `rms_norm_native` returned (rounded first, as XLA's step rounds the bfloat16 residual)."""
    if s.dtype != jnp.float32 or delta.dtype != jnp.bfloat16 or s.shape != delta.shape:
        raise ValueError(f"s must be float32 and delta bfloat16 of one shape, got {s.dtype}{s.shape} and "
                         f"{delta.dtype}{delta.shape}")
    return _ffi_call("JaxpagedAddRound", jax.ShapeDtypeStruct(s.shape, jnp.bfloat16))(s, delta)


def rope_native(q: jax.Array, k: jax.Array, cos: jax.Array, sin: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Rotary embedding of q [T, Hq, D] and k [T, Hk, D] (bfloat16, D even) by rope.cc, Hugging Face's rotate-half
    convention: each head's halves (x1, x2) -> (x1 cos - x2 sin, x2 cos + x1 sin) in float32 (each a fused
    multiply-add, as XLA CPU computes the pure-JAX rope), rounded once to bfloat16; cos, sin float32 with T * D/2
    elements ([T, 1, D/2] as the models build them)."""
    if q.ndim != 3 or k.ndim != 3 or q.shape[0] != k.shape[0] or q.shape[2] != k.shape[2] or q.shape[2] % 2:
        raise ValueError(f"q and k must be [T, H, D] with one T and one even D, got {q.shape} and {k.shape}")
    if q.dtype != jnp.bfloat16 or k.dtype != jnp.bfloat16:
        raise ValueError(f"q and k must be bfloat16, got {q.dtype} and {k.dtype}")
    half = q.shape[0] * q.shape[2] // 2
    if cos.size != half or sin.size != half:
        raise ValueError(f"cos {cos.shape} and sin {sin.shape} must have T * D/2 = {half} elements")
    call = _ffi_call("JaxpagedRope", (jax.ShapeDtypeStruct(q.shape, q.dtype),
                                          jax.ShapeDtypeStruct(k.shape, k.dtype)))
    return call(q, k, cos.astype(jnp.float32), sin.astype(jnp.float32))


def argmax_native(x: jax.Array) -> jax.Array:
    """The index of each row's first maximum of x [S, V] float32 -> [S] int32, by argmax.cc in one pass over the
    row: jnp.argmax(x, axis=-1) wherever a row holds no NaN (NaN is never the maximum here; a row of NaN / -inf
    gives 0)."""
    if x.ndim != 2 or x.dtype != jnp.float32:
        raise ValueError(f"x must be [S, V] float32, got {x.dtype}{list(x.shape)}")
    return _ffi_call("JaxpagedArgmax", jax.ShapeDtypeStruct(x.shape[:1], jnp.int32))(x)


def logprobs_native(logits: jax.Array, tokens: jax.Array, k: int
                    ) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array]:
    """The log-probs a step returns, by logprobs.cc in two passes over each row of logits [S, V] float32, writing
    nothing of size V: (chosen [S] float32: log p(tokens[r]); ranks [S] int32: how many logits of the row are >=
    tokens[r]'s, itself included; values [S, k] float32: the row's k largest log-probs, largest first; indices [S, k]
    int32: jax.lax.top_k(logits, k)'s indices exactly). tokens [S] int32 in [0, V) (else NaN, rank 0). A log-prob is
    (logit - max) - log(sum(exp(logit - max))), the sum in float64. 1 <= k <= min(V, 64)."""
    if logits.ndim != 2 or logits.dtype != jnp.float32:
        raise ValueError(f"logits must be [S, V] float32, got {logits.dtype}{list(logits.shape)}")
    s, v = logits.shape
    if not isinstance(k, int) or not 1 <= k <= min(v, 64):
        raise ValueError(f"k must be an int in [1, min(V, 64)] = [1, {min(v, 64)}], got {k!r}")
    tokens = _int32("tokens", tokens, 1)
    if tokens.shape != (s,):
        raise ValueError(f"tokens must be [{s}], got shape {tokens.shape}")
    out = (jax.ShapeDtypeStruct((s,), jnp.float32), jax.ShapeDtypeStruct((s,), jnp.int32),
           jax.ShapeDtypeStruct((s, k), jnp.float32), jax.ShapeDtypeStruct((s, k), jnp.int32))
    return _ffi_call("JaxpagedLogprobs", out)(logits, tokens)


def penalties_native(logits: jax.Array, seen: jax.Array, output_start: jax.Array, pending: jax.Array,
                     presence: jax.Array, frequency: jax.Array, repetition: jax.Array) -> jax.Array:
    """Repetition, frequency and presence penalties on logits [S, V] float32, by penalties.cc, visiting only each
    row's seen tokens: seen [S, L] int32 (prompt then output, -1 = padding), output_start [S] int32 (index in seen
    of the first output token), pending [S] int32 (an output token not in seen, -1 = none), presence / frequency /
    repetition [S] float32. The same bits as `jaxpaged.worker.sampler._penalize`'s XLA version (penalties.cc says
    what each penalty does)."""
    if logits.ndim != 2 or logits.dtype != jnp.float32:
        raise ValueError(f"logits must be [S, V] float32, got {logits.dtype}{list(logits.shape)}")
    s = logits.shape[0]
    seen = _int32("seen", seen, 2)
    if seen.shape[0] != s:
        raise ValueError(f"seen must have {s} rows (the logits'), got shape {seen.shape}")
    per_row = [_int32("output_start", output_start, 1), _int32("pending", pending, 1)]
    per_row += [jnp.asarray(x, jnp.float32) for x in (presence, frequency, repetition)]
    for name, x in zip(("output_start", "pending", "presence", "frequency", "repetition"), per_row, strict=True):
        if x.shape != (s,):
            raise ValueError(f"{name} must be [{s}], got shape {x.shape}")
    call = _ffi_call("JaxpagedPenalties", jax.ShapeDtypeStruct(logits.shape, jnp.float32))
    return call(logits, seen, *per_row)


def top_p_threshold_native(logits: jax.Array, k: jax.Array, top_p: jax.Array) -> jax.Array:
    """Each row's top-k / top-p threshold of logits [S, V] float32 -> [S] float32, by top_p.cc: the sampler keeps
    the tokens at or above it. k [S] int32 in [1, V]; top_p [S] float32 in (0, 1] (>= 1: no top-p). The value
    `jaxpaged.worker.sampler._threshold_by_sort` finds by sorting the row, except where a prefix's mass is within
    rounding of top_p (summed here in float64)."""
    if logits.ndim != 2 or logits.dtype != jnp.float32:
        raise ValueError(f"logits must be [S, V] float32, got {logits.dtype}{list(logits.shape)}")
    s = logits.shape[0]
    k, top_p = _int32("k", k, 1), jnp.asarray(top_p, jnp.float32)
    if k.shape != (s,) or top_p.shape != (s,):
        raise ValueError(f"k and top_p must be [{s}], got shapes {k.shape} and {top_p.shape}")
    return _ffi_call("JaxpagedTopPThreshold", jax.ShapeDtypeStruct((s,), jnp.float32))(logits, k, top_p)


def gumbel_argmax_native(x: jax.Array, keys: jax.Array) -> jax.Array:
    """One token per row of x [S, V] float32 (logits, scaled and filtered) drawn with Gumbel noise, by gumbel.cc:
    argmax(x + jax.random.gumbel(key, (V,))) for each row's threefry2x32 key, keys [S, 2] uint32 (the keys' data).
    The uniform draws are JAX's bit for bit (partitionable threefry, JAX's default); the logarithms are within ~1 ulp
    of XLA's, so a token differs from XLA's draw only where two candidates tie within float32 rounding."""
    if x.ndim != 2 or x.dtype != jnp.float32:
        raise ValueError(f"x must be [S, V] float32, got {x.dtype}{list(x.shape)}")
    if keys.shape != (x.shape[0], 2) or keys.dtype != jnp.uint32:
        raise ValueError(f"keys must be [{x.shape[0]}, 2] uint32 (threefry2x32 key data), got "
                         f"{keys.dtype}{list(keys.shape)}")
    return _ffi_call("JaxpagedGumbelArgmax", jax.ShapeDtypeStruct(x.shape[:1], jnp.int32))(x, keys)


def native_else_reference(*args, strict: bool = False, **kwargs) -> jax.Array:
    """The CPU attention: the native kernel for every batch whose pool dtype it takes, else the pure-JAX reference.

    strict=False ('auto') falls back to the reference for dtypes the kernel lacks; strict=True ('native') raises.
    Queries of another dtype than the pool's are cast to it (and the output back), except over an fp8 pool, which
    the kernel reads with float32 or bfloat16 queries as they are."""
    from pallas_kernels.reference import ragged_paged_attention_reference

    q, pool = args[0], args[1]
    if is_fp8(pool.dtype) and (strict or np.dtype(q.dtype) in KERNEL_DTYPES):
        return paged_attention_native(*args, **kwargs)
    if strict or np.dtype(pool.dtype) in KERNEL_DTYPES:
        # Queries in the pool's dtype (e.g. a bfloat16 model over the engine's float32 CPU pool); with strict, an
        # unsupported dtype is the kernel's ValueError.
        return paged_attention_native(q.astype(pool.dtype), *args[1:], **kwargs).astype(q.dtype)
    kwargs.pop("prompt_lens", None)  # the native kernel's alone
    return ragged_paged_attention_reference(*args, **kwargs)


__all__ = ["available", "unavailable_reason", "paged_attention_native", "native_else_reference", "write_kv_native",
           "set_blocks_native", "matmul_native", "matmul_glu_native", "matmul_is_fast", "matmul_uses_amx",
           "prepack_weight", "unpack_weight", "cache_dir", "rms_norm_native", "add_round_native", "rope_native",
           "argmax_native", "logprobs_native", "penalties_native", "top_p_threshold_native", "gumbel_argmax_native"]
