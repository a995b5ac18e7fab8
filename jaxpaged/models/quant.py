"""Quantized weights: kept in their quantized form in device memory and dequantized inside the matmul.

    qw = quantize_int8(w)                  # w [*lead, K, N] (x @ w) -> int8 per output channel, symmetric
    y = qmatmul(x, qw, layer)              # x [M, K] @ w[layer] -> [M, N] in x's dtype (float32 accumulation)
    h = embedding_rows(table, token_ids)   # a table [V, H] (dense or quantized) -> [T, H]
    jaxpaged.quantize(module, "int8")      # a model's matrices in place (built-in modules, or any nnx.Linear)

A `QuantizedWeight` stands where a full-width array stood in a model's parameters (inside its `nnx.Param`): a pytree
of two arrays, the unsigned codes u and their scales, with the format as static data. Every weight w of column n,
k in block b of 32 is w = s * u + m (see `SCALE_MODES`): int8 per output channel (u = q + 128, m = -128 s), GGUF's
Q8_0 and Q4_0 (one float16 s per block, m = -offset s), Q4_1 (float16 s and m per block) and Q4_K (float32 s and m
per block: its d * scale is exact in float32). What a GGUF file holds is re-laid out, not re-quantized
(`jaxpaged.loader.gguf_quant`).

Storage orientation: [*lead, N, K], output channels first, blocks along K (GGUF's), for both kinds of array it
replaces: a matrix [*lead, K, N] used as x @ w (the layers' q/k/v/o/gate/up/down, an untied LM head) and a table
[N, K] (an embedding: rows looked up, and x @ table.T when it is the tied LM head). Two layouts:
  plain   codes [*lead, N, Kp * bits / 8] uint8 (4 bits: per block, byte j holds k = j low and k = j + 16 high),
          scales [*lead, N] f32 (channel), [*lead, N, B] f16 (sym), [*lead, N, B, 2] f16 / f32 (s, m)
          (Kp = 32 B = K rounded up to 32). What loaders and checkpoints hold; dequantized by `jnp` (GPU, TPU, and
          CPUs without the native kernel; 4-bit on TPU by `_nibble_matmul`), where XLA may fuse it into the dot
          (docs/quantization.md, "Where it is multiplied", says where it does).
  panels  the native CPU kernel's (pallas_kernels/cpu_native/qmatmul.cc): codes [*lead, G, B, 256 | 512], scales
          [*lead, G, 16] / [*lead, G, B, 16] / [*lead, G, B, 2, 16] with columns in groups of 16 (G a multiple of 4).
          Made once at load by `to_panels` where every product runs natively; read by the kernel, and by
          `embedding_rows` / `dequantize` (index arithmetic on the panels).
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import functools
import logging

import jax
import jax.numpy as jnp
import numpy as np

logger = logging.getLogger(__name__)

BLOCK = 32  # k per block
GROUP = 16  # columns per group of the panel layout
PANEL_GROUPS = 4  # groups per native work item: G is a multiple of it

# scale modes (qmatmul.cc's ScaleMode): w = s * (u - offset), or s * u + m
CHANNEL, BLOCK_SYM, BLOCK_F16, BLOCK_F32 = 0, 1, 2, 3
SCALE_MODES = {CHANNEL: "float32 s per column, m = -128 s", BLOCK_SYM: "float16 s per block, m = -offset s",
               BLOCK_F16: "float16 s, m per block", BLOCK_F32: "float32 s, m per block"}
FORMATS = {(8, CHANNEL): "int8", (8, BLOCK_SYM): "q8_0", (4, BLOCK_SYM): "q4_0", (4, BLOCK_F16): "q4_1",
           (8, BLOCK_F16): "q8_1", (4, BLOCK_F32): "q4_k", (8, BLOCK_F32): "q8_k"}
METHODS = (None, "int8", "gguf")  # EngineConfig.quantization's values


def offset(bits: int, scale_mode: int) -> int:
    """The code of weight zero where it is implicit (m = -offset s)."""
    return 128 if bits == 8 or scale_mode == CHANNEL else 8


@functools.partial(jax.tree_util.register_dataclass, data_fields=["codes", "scales"],
                   meta_fields=["bits", "scale_mode", "dense_shape", "table", "layout", "compute_dtype", "sources"])
@dataclasses.dataclass(frozen=True)
class QuantizedWeight:
    """A quantized matrix or table; see the module docstring for the layouts. `shape`, `ndim` and `dtype` are those
    of the full-width array it replaces (so shape checks and `x.ndim` tests of the models pass unchanged)."""

    codes: jax.Array  # uint8, layout's shape
    scales: jax.Array  # float16 or float32, layout's shape
    bits: int  # 4 or 8
    scale_mode: int  # CHANNEL, BLOCK_SYM, BLOCK_F16, BLOCK_F32
    dense_shape: tuple[int, ...]  # [*lead, K, N] for a matrix, [N, K] for a table
    table: bool = False
    layout: str = "plain"  # or "panels"
    compute_dtype: str = "float32"  # the dtype dequantized values take outside a matmul (embedding rows)
    sources: tuple[str, ...] = ()  # what it was made from: GGUF tensor types, or "int8"

    @property
    def format(self) -> str:
        return FORMATS[(self.bits, self.scale_mode)]

    @property
    def shape(self) -> tuple[int, ...]:
        return self.dense_shape

    @property
    def ndim(self) -> int:
        return len(self.dense_shape)

    @property
    def dtype(self):
        return jnp.dtype(self.compute_dtype)

    @property
    def k(self) -> int:
        return self.dense_shape[-1] if self.table else self.dense_shape[-2]

    @property
    def n(self) -> int:
        return self.dense_shape[-2] if self.table else self.dense_shape[-1]

    @property
    def lead(self) -> tuple[int, ...]:
        return () if self.table else self.dense_shape[:-2]

    @property
    def nbytes(self) -> int:
        scale_bytes = int(np.prod(self.scales.shape)) * np.dtype(self.scales.dtype).itemsize
        return int(np.prod(self.codes.shape)) + scale_bytes

    def __getitem__(self, key):
        """`param[...]` of the `nnx.Param` holding it gives it back whole (the models read their params so)."""
        if key is Ellipsis:
            return self
        raise TypeError("a QuantizedWeight is read by qmatmul / embedding_rows, not indexed; dequantize() it first")

    def replace(self, **changes) -> QuantizedWeight:
        return dataclasses.replace(self, **changes)

    def meta(self) -> dict:
        """Its static fields, JSON-ready (checkpoints store them beside the arrays)."""
        return {"bits": self.bits, "scale_mode": self.scale_mode, "dense_shape": list(self.dense_shape),
                "table": self.table, "layout": self.layout, "compute_dtype": self.compute_dtype,
                "sources": list(self.sources)}

    @classmethod
    def from_meta(cls, meta: dict, codes, scales) -> QuantizedWeight:
        return cls(codes, scales, int(meta["bits"]), int(meta["scale_mode"]), tuple(meta["dense_shape"]),
                   bool(meta["table"]), meta["layout"], meta["compute_dtype"], tuple(meta["sources"]))


def is_quantized(x) -> bool:
    return isinstance(x, QuantizedWeight)


def _xp(a):
    return np if isinstance(a, np.ndarray) else jnp


# ---- quantizing ------------------------------------------------------------------------------------------------------


def check_method(quantization) -> None:
    """ValueError naming `quantization` for a value it does not take."""
    if quantization not in METHODS:
        raise ValueError(f"quantization={quantization!r} is not supported; use one of "
                         f"{', '.join(map(repr, METHODS))}")


def quantize_int8(w, table: bool = False) -> QuantizedWeight:
    """Symmetric int8 per output channel of a full-width w: a matrix [*lead, K, N] (x @ w) or a table [N, K] (its rows
    are the channels). s = max|w| / 127 per channel, q = round(w / s) in [-127, 127], stored as u = q + 128 (plain
    layout); dequantized, q * s. numpy or jax arrays (float32 math either way, the same bits: s is max|w| times
    float32(1 / 127), as XLA computes a division by a constant)."""
    xp = _xp(w)
    dense_shape, compute_dtype = tuple(w.shape), str(np.dtype(w.dtype))
    if xp is jnp and w.ndim == 3:  # a stacked device array: one layer at a time (float32 temporaries of one layer)
        layers = [quantize_int8(w[i]) for i in range(w.shape[0])]
        return QuantizedWeight(jnp.stack([q.codes for q in layers]), jnp.stack([q.scales for q in layers]), 8,
                               CHANNEL, dense_shape, table, compute_dtype=compute_dtype, sources=("int8",))
    w = xp.asarray(w, xp.float32)
    if not table:
        w = xp.swapaxes(w, -1, -2)  # [*lead, N, K]
    amax = xp.max(xp.abs(w), axis=-1)  # [*lead, N]
    s = amax * xp.float32(1.0 / 127.0)
    inv = xp.where(s > 0, xp.float32(1.0) / xp.where(s > 0, s, 1), 0).astype(xp.float32)
    q = xp.clip(xp.rint(w * inv[..., None]), -127, 127)
    k = w.shape[-1]
    kp = -(-k // BLOCK) * BLOCK
    codes = (q + 128).astype(xp.uint8)
    if kp != k:  # padded k: code 128, weight 0
        pad = [(0, 0)] * (codes.ndim - 1) + [(0, kp - k)]
        codes = xp.pad(codes, pad, constant_values=128)
    return QuantizedWeight(codes, s.astype(xp.float32), 8, CHANNEL, dense_shape, table,
                           compute_dtype=compute_dtype, sources=("int8",))


# ---- dequantizing (jnp or numpy) -------------------------------------------------------------------------------------


def _codes_plain(codes, bits: int):
    """[*, N, Kp * bits / 8] uint8 -> [*, N, Kp] codes."""
    if bits == 8:
        return codes
    xp = _xp(codes)
    c = codes.reshape(*codes.shape[:-1], -1, BLOCK // 2)  # [*, N, B, 16]
    return xp.concatenate([c & 15, c >> 4], axis=-1).reshape(*codes.shape[:-1], -1)


def _values_plain(qw: QuantizedWeight, codes, scales):
    """float32 weights [*, N, K] from plain codes [*, N, ...] and scales of the same leading dims."""
    xp = _xp(codes)
    u = _codes_plain(codes, qw.bits).astype(xp.float32)  # [*, N, Kp]
    kp = u.shape[-1]
    if qw.scale_mode == CHANNEL:
        w = (u - 128.0) * scales[..., None]
    else:
        ub = u.reshape(*u.shape[:-1], kp // BLOCK, BLOCK)  # [*, N, B, 32]
        if qw.scale_mode == BLOCK_SYM:
            w = (ub - float(offset(qw.bits, qw.scale_mode))) * scales.astype(xp.float32)[..., None]
        else:
            s, m = scales[..., 0].astype(xp.float32), scales[..., 1].astype(xp.float32)
            w = ub * s[..., None] + m[..., None]
        w = w.reshape(u.shape)
    return w[..., :qw.k]


def _panel_rows(qw: QuantizedWeight, codes, scales, rows):
    """Plain-layout codes [T, Kp * bits / 8] and scales of columns `rows` [T] of a panel-layout weight (no lead)."""
    xp = _xp(codes)
    g, j = rows // GROUP, rows % GROUP
    c = codes[g]  # [T, B, 256 | 512]
    t = rows.shape[0]
    if qw.bits == 8:
        lanes = c.reshape(t, c.shape[1], 8, GROUP, 4)  # [T, B, q, j, t]
        u = xp.take_along_axis(lanes, j[:, None, None, None, None], axis=3)[:, :, :, 0]  # [T, B, 8, 4]
        plain = u.reshape(t, -1)
    else:
        lanes = c.reshape(t, c.shape[1], 4, GROUP, 4)
        byte = xp.take_along_axis(lanes, j[:, None, None, None, None], axis=3)[:, :, :, 0]  # [T, B, 4, 4]
        low, high = (byte & 15).reshape(t, -1, 16), (byte >> 4).reshape(t, -1, 16)  # k = 0..15, 16..31 of a block
        plain = (low | (high << 4)).astype(xp.uint8).reshape(t, -1)
    s = scales[g]  # [T, 16] | [T, B, 16] | [T, B, 2, 16]
    s = xp.take_along_axis(s, j.reshape((t,) + (1,) * (s.ndim - 1)), axis=-1)[..., 0]
    return plain, s


def dequantize(qw: QuantizedWeight, dtype=None, layer=None):
    """The full-width array qw stands for, in `dtype` (default: its compute dtype): dense_shape, or the matrix of
    `layer` of a stacked weight. For checks and fallbacks: the models never build it (qmatmul, embedding_rows)."""
    dtype = jnp.dtype(dtype or qw.compute_dtype)
    codes, scales = qw.codes, qw.scales
    if layer is not None:
        codes, scales = codes[layer], scales[layer]
    if qw.layout == "panels":
        xp = _xp(codes)
        if codes.ndim == 4:
            return xp.stack([dequantize(qw, dtype, i) for i in range(codes.shape[0])])
        codes, scales = _panel_rows(qw, codes, scales, xp.arange(qw.n))
    w = _values_plain(qw, codes, scales)  # [*, N, K]
    w = w if qw.table else _xp(w).swapaxes(w, -1, -2)
    return w.astype(dtype)


def embedding_rows(table, token_ids: jax.Array) -> jax.Array:
    """table[token_ids] for a full-width table [V, H] or a quantized one (its rows dequantized: [T, H])."""
    if not is_quantized(table):
        return table[token_ids]
    codes, scales = table.codes, table.scales
    if table.layout == "panels":
        codes, scales = _panel_rows(table, codes, scales, token_ids)
    else:
        codes, scales = codes[token_ids], scales[token_ids]
    return _values_plain(table, codes, scales).astype(table.compute_dtype)


# ---- multiplying -----------------------------------------------------------------------------------------------------


def qmatmul(x: jax.Array, qw: QuantizedWeight, layer=None, out_dtype=None, rows=None, mode: str | None = None,
            split: str | None = None):
    """x [M, K] @ the quantized matrix (the matrix of `layer` for a stacked one; a table: x @ table.T) -> [M, N] in
    out_dtype (default x's), float32 accumulation. Panel layout: the native CPU kernel (`rows`: how many leading
    rows of x are real, an int32 scalar; the rest come back as zeros; `mode`: "int8" or "bf16", the kernel's way to
    multiply, default `NATIVE_MODE`). Plain layout: `_plain_matmul` (a kernel, or dequantized to x's dtype and XLA's
    dot: the numbers of the same weights dequantized at load); under a tensor-parallel mesh, on each device's shard
    by `split` (`on_shards`)."""
    out_dtype = jnp.dtype(out_dtype or x.dtype)
    if qw.layout == "panels":
        from pallas_kernels.cpu_native.quantized import qmatmul_native

        return qmatmul_native(x, qw.codes, qw.scales, 0 if layer is None else layer, rows, n=qw.n, bits=qw.bits,
                              scale_mode=qw.scale_mode, mode=mode or NATIVE_MODE, out_dtype=out_dtype)
    y = None
    if layer is not None:
        y = on_shards(lambda x, w, layer: _plain_matmul(x, w, w.codes, w.scales, layer), x, qw, layer, split)
    if y is None:
        y = _plain_matmul(x, qw, qw.codes, qw.scales, layer)
    return y.astype(out_dtype)


_GPU_ROWS: contextvars.ContextVar[int] = contextvars.ContextVar("jaxpaged_gpu_layer_matmul_rows", default=0)


@contextlib.contextmanager
def gpu_layer_kernel(max_rows: int):
    """While tracing inside this block, products of an x with at most max_rows rows and a stacked weight run, on CUDA, a
    Pallas kernel that reads the layer in place in the stack, where XLA copies the layer's slice before its GEMM: a
    16-bit weight of x's dtype by pallas_kernels/gpu_matmul.py (`matmul.layer_matmul`), int8 per channel by
    pallas_kernels/gpu_qmatmul.py's column-scale form (`_channel_kernel_matmul`; the block formats take that kernel at
    every size). 0: never. The caller traces for a CUDA GPU; under a tensor-parallel mesh (`partitioned_products`) the
    kernels run on each device's shard."""
    token = _GPU_ROWS.set(max_rows)
    try:
        yield
    finally:
        _GPU_ROWS.reset(token)


def gpu_kernel_rows() -> int:
    """The row limit of the `gpu_layer_kernel` block being traced (0 outside one)."""
    return _GPU_ROWS.get()


# ---- tensor parallelism: a product on each device's shard ----------------------------------------------------------

COLUMNS, ROWS = "columns", "rows"  # a weight's Megatron split: by its outputs N (q/k/v, gate, up) or inputs K (o, down)

_MESH: contextvars.ContextVar = contextvars.ContextVar("jaxpaged_product_mesh", default=None)


@contextlib.contextmanager
def partitioned_products(mesh):
    """While tracing inside this block (a step for a tensor-parallel `mesh`; None: no mesh), a product whose
    weight's split is given (`split=COLUMNS` or `ROWS`, and the mesh splits it so: `split_axes`) runs its kernel on
    each device's shard (`on_shards`); any other product of a plain-layout quantized weight is XLA's dot only, which
    GSPMD splits (a Pallas kernel's custom call it would run on whole weights gathered to every device)."""
    token = _MESH.set(mesh)
    try:
        yield
    finally:
        _MESH.reset(token)


def split_axes(w, split: str, tp: int) -> tuple[int | None, int | None] | None:
    """Where a `split` (COLUMNS or ROWS) over tp devices cuts a weight as stored: (axis of the array, None) for a
    full-width [*lead, K, N]; (axis of the codes, axis of the scales or None: replicated) for a `QuantizedWeight`
    (codes [*lead, N, K bytes]; a table's N is its rows). None where tp does not split it so: N or K not a multiple
    of tp, or, by rows, codes padded past K or shares that are not whole blocks of 32 (the block formats' blocks;
    the kernels' codes are whole blocks in every format). The one rule for how weights are placed
    (`jaxpaged.parallel.tensor_parallel.llama_partition_specs`) and multiplied."""
    if not is_quantized(w):
        axis = len(w.shape) - (1 if split == COLUMNS else 2)
        return (axis, None) if w.shape[axis] % tp == 0 else None
    n_axis, k_axis = len(w.lead), len(w.lead) + 1
    if split == COLUMNS:
        return (n_axis, n_axis) if w.n % tp == 0 else None
    padded_k = w.codes.shape[-1] * 8 // w.bits
    if padded_k != w.k or w.k % (BLOCK * tp):
        return None
    return k_axis, None if w.scale_mode == CHANNEL else k_axis


def _spec(ndim: int, axis: int | None, name: str):
    from jax.sharding import PartitionSpec as P

    return P(*[name if i == axis else None for i in range(ndim)]) if axis is not None else P()


def split_specs(w, split: str, tp: int, name: str):
    """The PartitionSpec(s) of `split_axes`, with mesh axis `name`: a PartitionSpec for a full-width array, a
    QuantizedWeight holding one for its codes and one for its scales; None where tp does not split it so."""
    axes = split_axes(w, split, tp)
    if axes is None:
        return None
    if not is_quantized(w):
        return _spec(len(w.shape), axes[0], name)
    return w.replace(codes=_spec(w.codes.ndim, axes[0], name), scales=_spec(w.scales.ndim, axes[1], name))


def on_shards(fn, x: jax.Array, w, layer, split: str | None):
    """fn(x, w, layer) -> x [M, K] @ w[layer] [M, N] float32 for a stacked w [L, K, N] (full width or quantized), a
    kernel's product of one device's arrays: as it is
    without a mesh (`partitioned_products`); with one, run on each device's shard (`jax.shard_map`) where `split`
    is given and the mesh splits w so, else None (the caller multiplies by XLA's dot). By COLUMNS each device
    multiplies the whole x by its columns and holds its columns of the product; by ROWS its columns of x (split
    there by the layer before) by its rows, and the partial products are summed over the mesh in float32 (the
    all-reduce GSPMD places after the dot)."""
    mesh = _MESH.get()
    if mesh is None:
        return fn(x, w, layer)
    from jax.sharding import PartitionSpec as P

    axis = mesh.axis_names[0]
    w_spec = split_specs(w, split, mesh.size, axis) if split is not None else None
    if w_spec is None:
        return None

    def body(x, w, layer):
        if is_quantized(w):  # the shard's own shape [*lead, K, N]: its columns, or its rows
            dense = list(w.dense_shape)
            dense[-1 if split == COLUMNS else -2] //= mesh.size
            w = w.replace(dense_shape=tuple(dense))
        with partitioned_products(None):  # one device's arrays: its kernels
            y = fn(x, w, layer)
        return y if split == COLUMNS else jax.lax.psum(y.astype(jnp.float32), axis)

    x_spec, out_spec = (P(), P(None, axis)) if split == COLUMNS else (P(None, axis), P())
    return jax.shard_map(body, mesh=mesh, in_specs=(x_spec, w_spec, P()), out_specs=out_spec,
                         check_vma=False)(x, w, layer)


# XLA TPU (libtpu 0.0.42) fuses `_nibble_matmul`'s dequantization into the dot up to this many rows at Llama-3-8B's
# shapes; above it writes the weight at full width in either form, and the Pallas TPU kernel runs those products
# (benchmarks/quant_fusion.py, docs/quantization.md "Where it is multiplied").
NIBBLE_MAX_ROWS = 64


def _plain_matmul(x: jax.Array, qw: QuantizedWeight, codes: jax.Array, scales: jax.Array, layer=None) -> jax.Array:
    """x [M, K] @ one plain-layout matrix -> [M, N] float32; codes and scales are qw's whole arrays, of which `layer`
    (None: they are one matrix) is multiplied: on CUDA the block formats by the Pallas Triton kernel
    (pallas_kernels/gpu_qmatmul.py), which takes the stacked codes and the layer and dequantizes tile by tile in
    registers (XLA GPU writes their weight at full width before its GEMM, and a dynamic-slice of the stack may copy the
    layer); on TPU the 4-bit formats up to NIBBLE_MAX_ROWS rows by `_nibble_matmul` (which XLA TPU fuses into the dot,
    where `_dense_matmul`'s nibble interleave makes it write the weight at full width), and the other block products
    (Q8_0 at every row count, 4 bits above) by the Pallas Mosaic kernel (pallas_kernels/tpu_qmatmul.py), which
    dequantizes tile by tile in VMEM where XLA TPU writes their weight at full width; on CUDA int8 per channel by
    `_signed_channel_matmul` (its GEMM reads int8), or in `gpu_layer_kernel`'s steps the same Triton kernel with column
    scales (`_channel_kernel_matmul`); everywhere else `_dense_matmul`. Inside `partitioned_products` with a mesh, only
    the branches that are XLA's dot. Every branch but the kernels' multiplies the layer's codes[layer],
    scales[layer]."""
    def at_layer(fn):
        if layer is None:
            return fn
        return lambda x, codes, scales: fn(x, codes[layer], scales[layer])

    dense = at_layer(functools.partial(_dense_matmul, qw=qw))
    if _MESH.get() is not None:
        cuda = at_layer(_signed_channel_matmul) if qw.scale_mode == CHANNEL else dense
        tpu = at_layer(functools.partial(_nibble_matmul, qw=qw)) if qw.bits == 4 else dense
        return jax.lax.platform_dependent(x, codes, scales, cuda=cuda, tpu=tpu, default=dense)
    if qw.scale_mode == CHANNEL:
        cuda = at_layer(_signed_channel_matmul)
        if x.shape[0] <= gpu_kernel_rows():  # the stack read in place, not the layer's codes copied first
            cuda = functools.partial(_channel_kernel_matmul, layer=0 if layer is None else layer)
        return jax.lax.platform_dependent(x, codes, scales, cuda=cuda, default=dense)
    kernel = functools.partial(_kernel_matmul, qw=qw, layer=0 if layer is None else layer)
    if qw.bits == 4 and x.shape[0] <= NIBBLE_MAX_ROWS:
        return jax.lax.platform_dependent(x, codes, scales, cuda=kernel,
                                          tpu=at_layer(functools.partial(_nibble_matmul, qw=qw)), default=dense)
    tpu_kernel = functools.partial(_tpu_kernel_matmul, qw=qw, layer=0 if layer is None else layer)
    return jax.lax.platform_dependent(x, codes, scales, cuda=kernel, tpu=tpu_kernel, default=dense)


def _tpu_kernel_matmul(x: jax.Array, codes: jax.Array, scales: jax.Array, *, qw: QuantizedWeight, layer) -> jax.Array:
    """The block formats on TPU where XLA writes their weight at full width (8 bits at every row count, 4 bits above
    NIBBLE_MAX_ROWS): the Pallas Mosaic kernel on the stacked codes (or one matrix's, layer 0)."""
    from pallas_kernels.tpu_qmatmul import qmatmul_tpu

    return qmatmul_tpu(x, codes, scales, layer, bits=qw.bits, pair=qw.scale_mode in (BLOCK_F16, BLOCK_F32))


def _kernel_matmul(x: jax.Array, codes: jax.Array, scales: jax.Array, *, qw: QuantizedWeight, layer) -> jax.Array:
    """The block formats on CUDA: the Pallas Triton kernel on the stacked codes (or one matrix's, layer 0)."""
    from pallas_kernels.gpu_qmatmul import qmatmul_gpu

    return qmatmul_gpu(x, codes, scales, layer, bits=qw.bits, pair=qw.scale_mode in (BLOCK_F16, BLOCK_F32))


def _channel_kernel_matmul(x: jax.Array, codes: jax.Array, scales: jax.Array, *, layer) -> jax.Array:
    """int8 per channel on CUDA in `gpu_layer_kernel`'s steps: the Pallas Triton kernel on the stacked codes (or one
    matrix's, layer 0), x times u - 128 in x's dtype and each column's sum times its scale: `_signed_channel_matmul`'s
    numbers up to the float32 sum's order. (The W8A8 kernel, pallas_kernels/gpu_w8a8.py, was slower than this one at
    each of Llama-3-8B's decode products on an H200: docs/quantization.md.)"""
    from pallas_kernels.gpu_qmatmul import qmatmul_gpu

    return qmatmul_gpu(x, codes, scales, layer, bits=8, pair=False, channel=True)


def _dense_matmul(x: jax.Array, codes: jax.Array, scales: jax.Array, *, qw: QuantizedWeight) -> jax.Array:
    w = _values_plain(qw, codes, scales).astype(x.dtype)  # [N, K]
    return jax.lax.dot_general(x, w, (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32)


def _signed_channel_matmul(x: jax.Array, codes: jax.Array, scales: jax.Array) -> jax.Array:
    """int8 per channel as XLA GPU's Triton GEMM takes it: the codes as signed q = u - 128 (u ^ 128, bitcast: one
    byte per weight), a bare convert in the GEMM's operand, and each column's scale after the dot (Triton fuses no
    multiply before it). The product of the float32 weights q * s up to float32 rounding, which `_dense_matmul`
    rounds to x's dtype first: the two differ by that rounding."""
    q = jax.lax.bitcast_convert_type(codes ^ jnp.uint8(128), jnp.int8)[:, :x.shape[1]]  # [N, K] int8
    y = jax.lax.dot_general(x, q.astype(x.dtype), (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32)
    return y * scales.astype(jnp.float32)


def _nibble_matmul(x: jax.Array, codes: jax.Array, scales: jax.Array, *, qw: QuantizedWeight) -> jax.Array:
    """A 4-bit matrix's product without unpacking its bytes: each byte bitcast to its two uint4 codes in place
    ([N, B, 16, 2]: k = j and k = j + 16 of block b, as stored) and x's columns permuted to that order instead (x is
    [M, K], the weight [N, K]), then one dot over (B, 16, 2). Each weight is `_values_plain`'s (same formula, same
    float32 then x's dtype); only the order of the float32 sum differs."""
    n, kp = codes.shape[0], codes.shape[1] * 2
    blocks = kp // BLOCK
    if x.shape[1] != kp:
        x = jnp.pad(x, ((0, 0), (0, kp - x.shape[1])))
    u = jax.lax.bitcast_convert_type(codes.reshape(n, blocks, BLOCK // 2), jnp.uint4).astype(jnp.float32)
    xs = x.reshape(x.shape[0], blocks, 2, BLOCK // 2).transpose(0, 1, 3, 2)  # [M, B, 16, 2]
    if qw.scale_mode == BLOCK_SYM:
        w = (u - float(offset(qw.bits, qw.scale_mode))) * scales.astype(jnp.float32)[..., None, None]
    else:
        s, m = scales[..., 0].astype(jnp.float32), scales[..., 1].astype(jnp.float32)  # [N, B]
        w = u * s[..., None, None] + m[..., None, None]
    return jax.lax.dot_general(xs, w.astype(x.dtype), (((1, 2, 3), (1, 2, 3)), ((), ())),
                               preferred_element_type=jnp.float32)


def qmatmul3(x: jax.Array, weights: tuple[QuantizedWeight, ...], layer=None, rows=None) -> tuple[jax.Array, ...]:
    """x @ each of three quantized matrices (an attention layer's q, k, v) in x's dtype: one native call where all
    three are in the panel layout of one format and K and stacked alike (x prepared once, one call's fixed cost
    instead of three), else three `qmatmul`s. The same numbers either way."""
    first = weights[0]
    if len(weights) == 3 and all(w.layout == "panels" and w.format == first.format and w.k == first.k
                                 and w.lead == first.lead and not w.table for w in weights):
        from pallas_kernels.cpu_native.quantized import qmatmul3_native

        return qmatmul3_native(x, tuple((w.codes, w.scales) for w in weights), 0 if layer is None else layer, rows,
                               ns=tuple(w.n for w in weights), bits=first.bits, scale_mode=first.scale_mode,
                               mode=NATIVE_MODE)
    return tuple(qmatmul(x, w, layer, rows=rows, split=COLUMNS) for w in weights)


def qglu(x: jax.Array, gate: QuantizedWeight, up: QuantizedWeight, layer, activation: str, rows=None):
    """act(x @ gate[layer]) * (x @ up[layer]) [M, N] in x's dtype (a gated MLP's first half): by one native call where
    both are in the panel layout of one format, else as two `qmatmul`s and the activation in `jnp`."""
    from jaxpaged.models.matmul import ACTIVATIONS

    if gate.layout == up.layout == "panels" and gate.format == up.format and gate.shape == up.shape and \
            NATIVE_MODE == "int8":
        from pallas_kernels.cpu_native.quantized import qmatmul_glu_native

        return qmatmul_glu_native(x, (gate.codes, gate.scales), (up.codes, up.scales), 0 if layer is None else layer,
                                  rows, n=gate.n, bits=gate.bits, scale_mode=gate.scale_mode, activation=activation)
    return ACTIVATIONS[activation](qmatmul(x, gate, layer, rows=rows, split=COLUMNS)) * \
        qmatmul(x, up, layer, rows=rows, split=COLUMNS)


# The native kernel's way to multiply (benchmarks/quantization.py --kernel measured both): int8 activations with
# VPDPBUSD, at every row count.
NATIVE_MODE = "int8"


# ---- the native layout -----------------------------------------------------------------------------------------------


def to_panels(qw: QuantizedWeight) -> QuantizedWeight:
    """The plain-layout qw in the native kernel's panel layout (numpy, on the host; see qmatmul.cc): columns padded
    to a multiple of 64 with zero codes and scales."""
    if qw.layout == "panels":
        return qw
    codes, scales = np.asarray(qw.codes), np.asarray(qw.scales)
    lead = codes.shape[:-2]
    n = codes.shape[-2]
    groups = -(-n // (GROUP * PANEL_GROUPS)) * PANEL_GROUPS
    pad_n = groups * GROUP - n
    u = _codes_plain(codes, qw.bits)  # [*lead, N, Kp]
    u = np.pad(u, [(0, 0)] * len(lead) + [(0, pad_n), (0, 0)])
    blocks = u.shape[-1] // BLOCK
    if qw.bits == 8:
        u = u.reshape(*lead, groups, GROUP, blocks, 8, 4)  # [.., g, j, b, q, t]
        nl = len(lead)
        u = u.transpose(*range(nl), nl, nl + 2, nl + 3, nl + 1, nl + 4)  # [.., g, b, q, j, t]
        packed = u.reshape(*lead, groups, blocks, 512)
    else:
        u = u.reshape(*lead, groups, GROUP, blocks, 2, 4, 4)  # [.., g, j, b, half, q, t]
        nl = len(lead)
        u = u.transpose(*range(nl), nl, nl + 2, nl + 4, nl + 1, nl + 5, nl + 3)  # [.., g, b, q, j, t, half]
        packed = (u[..., 0] | (u[..., 1] << 4)).astype(np.uint8).reshape(*lead, groups, blocks, 256)
    s = np.pad(scales, [(0, 0)] * len(lead) + [(0, pad_n)] + [(0, 0)] * (scales.ndim - len(lead) - 1))
    nl = len(lead)
    if qw.scale_mode == CHANNEL:
        s = s.reshape(*lead, groups, GROUP)
    elif qw.scale_mode == BLOCK_SYM:
        s = s.reshape(*lead, groups, GROUP, blocks).swapaxes(-1, -2)  # [.., g, b, j]
    else:
        s = s.reshape(*lead, groups, GROUP, blocks, 2).transpose(*range(nl), nl, nl + 2, nl + 3, nl + 1)
    return qw.replace(codes=np.ascontiguousarray(packed), scales=np.ascontiguousarray(s), layout="panels")


# ---- module and state helpers ----------------------------------------------------------------------------------------


def map_quantized(fn, tree):
    """tree with every QuantizedWeight replaced by fn(it) (other leaves as they are)."""
    return jax.tree.map(lambda x: fn(x) if is_quantized(x) else x, tree, is_leaf=is_quantized)


def weight_summary(state) -> dict:
    """Bytes of a model state's arrays and its weights' formats: {"weight_bytes", "weight_formats": {format: bytes},
    "quantized_bytes"}; full-width arrays count under their dtype's name."""
    formats: dict[str, int] = {}
    for leaf in jax.tree.leaves(state, is_leaf=is_quantized):
        if is_quantized(leaf):
            name, size = leaf.format, leaf.nbytes
        elif hasattr(leaf, "dtype") and hasattr(leaf, "shape"):
            name, size = str(np.dtype(leaf.dtype)), int(np.prod(leaf.shape)) * np.dtype(leaf.dtype).itemsize
        else:
            continue
        formats[name] = formats.get(name, 0) + size
    quantized = sum(v for k, v in formats.items() if k in FORMATS.values())
    return {"weight_bytes": sum(formats.values()), "quantized_bytes": quantized,
            "weight_formats": dict(sorted(formats.items(), key=lambda kv: -kv[1]))}


__all__ = ["QuantizedWeight", "quantize_int8", "dequantize", "embedding_rows", "qmatmul", "to_panels",
           "is_quantized", "map_quantized", "weight_summary", "check_method", "METHODS", "FORMATS"]
