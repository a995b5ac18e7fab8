"""Native CPU kernels as XLA FFI custom calls, built with g++ on first use: ragged paged attention and its pool
writes (paged_attention.cc), and a bf16 matmul that reads a stacked layer weight in place (matmul.cc,
`matmul_native`).

    paged_attention_native(q, k_cache, v_cache, layer, block_tables, context_lens, query_start_loc, positions,
                           scale=..., tile_size=..., sliding_window=None, soft_cap=None, decode_blocks=None)

Arguments and result are those of `ragged_paged_attention_reference` (reference.py states every layout), for any
batch: decodes, prefill chunks, or both. tile_size and decode_blocks are accepted for the contract's sake and
ignored: each query token reads exactly the blocks its sequence holds up to its own position. q and the pools are
float32 or bfloat16 (softmax and p @ V accumulate in float32); the pool is passed whole with the layer index, so no
per-layer slice is copied, and the call works inside jit and lax.fori_loop.

The build: `g++ -std=c++17 -O3 -march=native -fno-math-errno -fPIC -shared` against `jax.ffi.include_dir()`,
into `$JAXPAGED_NATIVE_CACHE` (default ~/.cache/jaxpaged/native) as `jaxpaged_native-<hash>.so`, the hash covering
the sources, the compiler and its version, the flags, the jaxlib version, `platform.machine()` and the CPU's flags
(-march=native code must not move to an older CPU). It is written to a temporary file and renamed into place, so
concurrent builds are safe. `$JAXPAGED_CXX` picks the compiler; `JAXPAGED_NATIVE=0` disables the kernel. If the
build fails, `available()` is False and `unavailable_reason()` says why (logged once).
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
import threading

import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels.validation import KERNEL_DTYPES

logger = logging.getLogger(__name__)

SOURCES = tuple(os.path.join(os.path.dirname(os.path.abspath(__file__)), name)
                for name in ("paged_attention.cc", "matmul.cc", "norm.cc", "rope.cc", "argmax.cc", "qmatmul.cc"))
HEADERS = tuple(os.path.join(os.path.dirname(SOURCES[0]), name) for name in ("work_queue.h", "vec_math.h"))
SYMBOL = "JaxpagedPagedAttention"
TARGET = "jaxpaged_paged_attention"
WRITE_SYMBOL = "JaxpagedKvWrite"
WRITE_TARGET = "jaxpaged_kv_write"
BLOCKS_SYMBOL = "JaxpagedSetBlocks"
BLOCKS_TARGET = "jaxpaged_set_blocks"
MATMUL_SYMBOL = "JaxpagedMatmul"
MATMUL_TARGET = "jaxpaged_matmul"
GLU_SYMBOL = "JaxpagedMatmulGlu"
GLU_TARGET = "jaxpaged_matmul_glu"
GLU_ACTIVATIONS = {"silu": 0, "gelu_tanh": 1}  # matmul.cc's Activation
NORM_SYMBOL = "JaxpagedRmsNorm"
NORM_TARGET = "jaxpaged_rms_norm"
ADD_SYMBOL = "JaxpagedAddRound"
ADD_TARGET = "jaxpaged_add_round"
ROPE_SYMBOL = "JaxpagedRope"
ROPE_TARGET = "jaxpaged_rope"
ARGMAX_SYMBOL = "JaxpagedArgmax"
ARGMAX_TARGET = "jaxpaged_argmax"
QMATMUL_SYMBOL = "JaxpagedQMatmul"  # qmatmul.cc: quantized weights (Python side: quantized.py)
QMATMUL_TARGET = "jaxpaged_qmatmul"
QMATMUL_GLU_SYMBOL = "JaxpagedQMatmulGlu"
QMATMUL_GLU_TARGET = "jaxpaged_qmatmul_glu"
FLAGS = ("-std=c++17", "-O3", "-march=native", "-fno-math-errno", "-fPIC", "-shared")

_lock = threading.Lock()
_state: dict = {}  # "ok": bool, "reason": str, "path": str


def cache_dir() -> str:
    return os.environ.get("JAXPAGED_NATIVE_CACHE") or os.path.expanduser("~/.cache/jaxpaged/native")


def _cpu_flags() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith(("flags", "Features")):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor()


def _build() -> str:
    """Returns the path of the built library, building it if the cache lacks it. Raises RuntimeError on failure."""
    compiler = os.environ.get("JAXPAGED_CXX") or "g++"
    compiler_path = shutil.which(compiler)
    if compiler_path is None:
        raise RuntimeError(f"no C++ compiler: {compiler!r} is not on PATH (set JAXPAGED_CXX)")
    version = subprocess.run([compiler_path, "--version"], capture_output=True, text=True, timeout=60).stdout
    include = jax.ffi.include_dir()
    sources = []
    for name in (*SOURCES, *HEADERS):  # the key covers what the build reads
        with open(name, "rb") as f:
            sources.append(f.read())
    import jaxlib

    key = hashlib.sha256()
    for part in (*sources, compiler_path.encode(), version.encode(), " ".join(FLAGS).encode(),
                 jaxlib.__version__.encode(), platform.machine().encode(), _cpu_flags().encode()):
        key.update(part)
        key.update(b"\0")
    directory = cache_dir()
    path = os.path.join(directory, f"jaxpaged_native-{key.hexdigest()[:24]}.so")
    if os.path.exists(path):
        return path
    os.makedirs(directory, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=".jaxpaged_native-", suffix=".so", dir=directory)
    os.close(fd)
    try:
        cmd = [compiler_path, *FLAGS, "-I", include, *SOURCES, "-o", tmp]
        result = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
        if result.returncode != 0:
            raise RuntimeError(f"{' '.join(cmd)} failed ({result.returncode}):\n{result.stderr[-4000:]}")
        os.replace(tmp, path)  # atomic: a concurrent build of the same key writes the same bytes
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    logger.info("built the native CPU kernels: %s", path)
    return path


def _load() -> None:
    if os.environ.get("JAXPAGED_NATIVE", "1") == "0":
        raise RuntimeError("disabled by JAXPAGED_NATIVE=0")
    if platform.system() != "Linux" and platform.system() != "Darwin":
        raise RuntimeError(f"unsupported OS {platform.system()}")
    path = _build()
    lib = ctypes.CDLL(path)
    jax.ffi.register_ffi_target(TARGET, jax.ffi.pycapsule(getattr(lib, SYMBOL)), platform="cpu")
    jax.ffi.register_ffi_target(WRITE_TARGET, jax.ffi.pycapsule(getattr(lib, WRITE_SYMBOL)), platform="cpu")
    jax.ffi.register_ffi_target(BLOCKS_TARGET, jax.ffi.pycapsule(getattr(lib, BLOCKS_SYMBOL)), platform="cpu")
    jax.ffi.register_ffi_target(MATMUL_TARGET, jax.ffi.pycapsule(getattr(lib, MATMUL_SYMBOL)), platform="cpu")
    jax.ffi.register_ffi_target(GLU_TARGET, jax.ffi.pycapsule(getattr(lib, GLU_SYMBOL)), platform="cpu")
    jax.ffi.register_ffi_target(NORM_TARGET, jax.ffi.pycapsule(getattr(lib, NORM_SYMBOL)), platform="cpu")
    jax.ffi.register_ffi_target(ADD_TARGET, jax.ffi.pycapsule(getattr(lib, ADD_SYMBOL)), platform="cpu")
    jax.ffi.register_ffi_target(ROPE_TARGET, jax.ffi.pycapsule(getattr(lib, ROPE_SYMBOL)), platform="cpu")
    jax.ffi.register_ffi_target(ARGMAX_TARGET, jax.ffi.pycapsule(getattr(lib, ARGMAX_SYMBOL)), platform="cpu")
    jax.ffi.register_ffi_target(QMATMUL_TARGET, jax.ffi.pycapsule(getattr(lib, QMATMUL_SYMBOL)), platform="cpu")
    jax.ffi.register_ffi_target(QMATMUL_GLU_TARGET, jax.ffi.pycapsule(getattr(lib, QMATMUL_GLU_SYMBOL)),
                                platform="cpu")
    _state["lib"] = lib  # keep it loaded
    _state["path"] = path


def available() -> bool:
    """Whether the kernel is built and registered (builds it on the first call; False with a logged reason)."""
    with _lock:
        if "ok" not in _state:
            try:
                _load()
                _state["ok"], _state["reason"] = True, ""
            except Exception as e:  # noqa: BLE001 - any failure means: use the reference
                _state["ok"], _state["reason"] = False, f"{type(e).__name__}: {e}"
                logger.warning("native CPU paged attention unavailable, using the pure-JAX reference: %s",
                               _state["reason"])
        return _state["ok"]


def matmul_is_fast() -> bool:
    """Whether `matmul_native` has its AVX512_BF16 path on this CPU (else it is a plain loop: correct, slow)."""
    return available() and bool(_state["lib"].JaxpagedMatmulIsFast())


def unavailable_reason() -> str:
    """Why `available()` is False ('' when it is True)."""
    available()
    return _state["reason"]


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
) -> jax.Array:
    """Ragged paged attention on the CPU by the native kernel; see the module docstring."""
    del tile_size, decode_blocks  # the kernel walks each token's own blocks, whatever the batch's layout
    if q.ndim != 3 or k_cache.ndim != 5:
        raise ValueError(f"q must be [T, Hq, D] and k_cache [L, NB, BS, Hkv, D], got {q.shape} and {k_cache.shape}")
    if k_cache.shape != v_cache.shape:
        raise ValueError(f"k_cache {k_cache.shape} and v_cache {v_cache.shape} differ")
    if np.dtype(q.dtype) not in KERNEL_DTYPES:
        raise ValueError(f"the native kernel takes float32 or bfloat16, got {q.dtype}; use the reference backend")
    if not q.dtype == k_cache.dtype == v_cache.dtype:
        raise ValueError(f"q, k_cache and v_cache need one dtype, got {q.dtype}, {k_cache.dtype}, {v_cache.dtype}")
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
    if sliding_window is not None and sliding_window <= 0:
        raise ValueError(f"sliding_window={sliding_window} must be positive or None")
    if soft_cap is not None and soft_cap <= 0:
        raise ValueError(f"soft_cap={soft_cap} must be positive or None")
    if not available():
        raise RuntimeError(f"native CPU paged attention is unavailable: {unavailable_reason()}")
    call = jax.ffi.ffi_call(TARGET, jax.ShapeDtypeStruct(q.shape, q.dtype))
    return call(q, k_cache, v_cache, layer, block_tables, context_lens, query_start_loc, positions,
                scale=np.float32(scale), sliding_window=np.int64(sliding_window or 0),
                soft_cap=np.float32(soft_cap or 0.0))


def write_kv_native(k_cache: jax.Array, v_cache: jax.Array, layer: jax.Array | int, k_new: jax.Array,
                    v_new: jax.Array, slot_mapping: jax.Array) -> tuple[jax.Array, jax.Array]:
    """`write_kv_reference`'s contract (k_new, v_new [T, Hkv, D] into the flat slots [T] of `layer` of the pools
    [L, NB, BS, Hkv, D]) by the native kernel, in place through input/output aliasing, in the pools' dtype: XLA
    CPU's scatter converts a 16-bit pool to float32 and back, whole, around every write; this one copies T rows."""
    if k_cache.ndim != 5 or k_cache.shape != v_cache.shape:
        raise ValueError(f"the pools must be one shape [L, NB, BS, Hkv, D], got {k_cache.shape} and {v_cache.shape}")
    if k_new.shape != v_new.shape or k_new.shape[1:] != k_cache.shape[3:]:
        raise ValueError(f"k_new {k_new.shape} and v_new {v_new.shape} must be [T, Hkv, D] of the pool {k_cache.shape}")
    slot_mapping = _int32("slot_mapping", slot_mapping, 1)
    if slot_mapping.shape != k_new.shape[:1]:
        raise ValueError(f"slot_mapping {slot_mapping.shape} must be [T] for k_new {k_new.shape}")
    if not available():
        raise RuntimeError(f"native CPU paged attention is unavailable: {unavailable_reason()}")
    pool = jax.ShapeDtypeStruct(k_cache.shape, k_cache.dtype)
    call = jax.ffi.ffi_call(WRITE_TARGET, (pool, pool), input_output_aliases={0: 0, 1: 1})
    k, v = call(k_cache, v_cache, _int32("layer", layer, 0), k_new.astype(k_cache.dtype),
                v_new.astype(v_cache.dtype), slot_mapping)
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
    if not available():
        raise RuntimeError(f"native CPU paged attention is unavailable: {unavailable_reason()}")
    pool = jax.ShapeDtypeStruct(k_cache.shape, k_cache.dtype)
    call = jax.ffi.ffi_call(BLOCKS_TARGET, (pool, pool), input_output_aliases={0: 0, 1: 1})
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


def _require_kernels() -> None:
    if not available():
        raise RuntimeError(f"the native CPU kernels are unavailable: {unavailable_reason()}")


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
    _require_kernels()


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
    call = jax.ffi.ffi_call(MATMUL_TARGET, jax.ShapeDtypeStruct((x.shape[0], _columns(w)), out_dtype))
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
    call = jax.ffi.ffi_call(GLU_TARGET, jax.ShapeDtypeStruct((x.shape[0], _columns(w_gate)), jnp.bfloat16))
    return call(x, w_gate, w_up, _int32("layer", layer, 0), _int32("rows", x.shape[0] if rows is None else rows, 0),
                act=np.int64(GLU_ACTIVATIONS[activation]))


def rms_norm_native(x: jax.Array, weight: jax.Array, layer: jax.Array | int, eps: float,
                    delta: jax.Array | None = None) -> tuple[jax.Array | None, jax.Array]:
    """RMSNorm of a bfloat16 residual stream by norm.cc: x [T, H] (plus delta [T, H] first, if given), weight the
    stacked [L, H] read at `layer` (or one [H]). Returns (s, out): s = x + delta in float32, unrounded (None
    without a delta), and out = weight * bf16(s * rsqrt(mean(s^2) + eps)) [T, H] bfloat16, the numbers of XLA's
    fused step for the models' pure-JAX norm up to the float32 summation order of the mean."""
    weight = weight[None] if weight.ndim == 1 else weight
    if x.ndim != 2 or weight.ndim != 2 or weight.shape[1] != x.shape[1]:
        raise ValueError(f"x must be [T, H] and weight [L, H] or [H], got {x.shape} and {weight.shape}")
    if not x.dtype == weight.dtype == jnp.bfloat16 or (delta is not None and delta.dtype != jnp.bfloat16):
        raise ValueError(f"x, weight and delta must be bfloat16, got {x.dtype}, {weight.dtype}, "
                         f"{None if delta is None else delta.dtype}")
    if delta is not None and delta.shape != x.shape:
        raise ValueError(f"delta {delta.shape} must be x's shape {x.shape}")
    _require_kernels()
    sum_shape = x.shape if delta is not None else (0,)
    call = jax.ffi.ffi_call(NORM_TARGET, (jax.ShapeDtypeStruct(sum_shape, jnp.float32),
                                          jax.ShapeDtypeStruct(x.shape, jnp.bfloat16)))
    s, out = call(x, jnp.zeros((0,), x.dtype) if delta is None else delta, weight, _int32("layer", layer, 0),
                  eps=np.float32(eps))
    return (s if delta is not None else None), out


def add_round_native(s: jax.Array, delta: jax.Array) -> jax.Array:
    """bf16(bf16(s) + delta) for s float32 and delta bfloat16 of one shape, by norm.cc: a layer's last residual add,
    s the float32 sum `rms_norm_native` returned (rounded first, as XLA's step rounds the bfloat16 residual)."""
    if s.dtype != jnp.float32 or delta.dtype != jnp.bfloat16 or s.shape != delta.shape:
        raise ValueError(f"s must be float32 and delta bfloat16 of one shape, got {s.dtype}{s.shape} and "
                         f"{delta.dtype}{delta.shape}")
    _require_kernels()
    return jax.ffi.ffi_call(ADD_TARGET, jax.ShapeDtypeStruct(s.shape, jnp.bfloat16))(s, delta)


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
    _require_kernels()
    call = jax.ffi.ffi_call(ROPE_TARGET, (jax.ShapeDtypeStruct(q.shape, q.dtype),
                                          jax.ShapeDtypeStruct(k.shape, k.dtype)))
    return call(q, k, cos.astype(jnp.float32), sin.astype(jnp.float32))


def argmax_native(x: jax.Array) -> jax.Array:
    """The index of each row's first maximum of x [S, V] float32 -> [S] int32, by argmax.cc in one pass over the
    row: jnp.argmax(x, axis=-1) wherever a row holds no NaN (NaN is never the maximum here; a row of NaN / -inf
    gives 0)."""
    if x.ndim != 2 or x.dtype != jnp.float32:
        raise ValueError(f"x must be [S, V] float32, got {x.dtype}{list(x.shape)}")
    _require_kernels()
    return jax.ffi.ffi_call(ARGMAX_TARGET, jax.ShapeDtypeStruct(x.shape[:1], jnp.int32))(x)


def native_else_reference(*args, strict: bool = False, **kwargs) -> jax.Array:
    """The CPU attention: the native kernel for every batch whose pool dtype it takes, else the pure-JAX reference.

    strict=False ('auto') falls back to the reference for dtypes the kernel lacks; strict=True ('native') raises.
    Queries of another dtype than the pool's are cast to it (and the output back)."""
    from pallas_kernels.reference import ragged_paged_attention_reference

    q, pool = args[0], args[1]
    if strict or np.dtype(pool.dtype) in KERNEL_DTYPES:
        # Queries in the pool's dtype (e.g. a bfloat16 model over the engine's float32 CPU pool); with strict, an
        # unsupported dtype is the kernel's ValueError.
        return paged_attention_native(q.astype(pool.dtype), *args[1:], **kwargs).astype(q.dtype)
    return ragged_paged_attention_reference(*args, **kwargs)


__all__ = ["available", "unavailable_reason", "paged_attention_native", "native_else_reference", "write_kv_native",
           "set_blocks_native", "matmul_native", "matmul_glu_native", "matmul_is_fast", "prepack_weight",
           "unpack_weight", "cache_dir", "rms_norm_native", "add_round_native", "rope_native", "argmax_native"]
