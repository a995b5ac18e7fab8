"""The models' matmuls: float32 accumulation, and a stacked layer weight read without copying its slice.

    y = matmul(x, w)                      # x [M, K] @ w [K, N], accumulated in float32, returned in x's dtype
    y = layer_matmul(x, w, layer)         # x [M, K] @ w[layer] of a stacked w [L, K, N]: the same numbers
    y = layer_matmul(x, wo, layer, quant.ROWS)  # under tensor parallelism: split by rows (kernels per shard)
    q, k, v = layer_matmul3(x, (wq, wk, wv), layer)   # three of them (one native call for quantized weights)
    y = layer_glu(x, w_gate, w_up, layer, "silu")   # silu(x @ w_gate[layer]) * (x @ w_up[layer]): a gated MLP
    logits = head_matmul(h, head)         # h [S, H] @ head [H, V] (or prepacked) -> float32 logits
    h = embedding_rows(table, token_ids)  # table [V, H] (full width or quantized) -> [T, H]
    prepack_layer_weights(state)          # the native kernels' layout for every stacked matrix, once at load

`layer_matmul` is XLA's dot of the slice `w[layer]`, unless the step is traced inside `native_matmul(max_rows)`:
then a bfloat16 product of at most max_rows rows runs as `pallas_kernels.cpu_native.matmul_native`, which reads
layer `layer` of the stacked weight in place. The engine's step sets this on CPUs with AVX512_BF16 when no
tensor-parallel mesh is in use (XLA cannot split a custom call over a mesh): XLA CPU's bf16 dot packs the whole
weight into its own layout on every call and slices the layer out of the stack first, which costs a decode step
more than its arithmetic (benchmarks/step_anatomy.py). At prefill sizes the two run at about the same rate
(benchmarks/matmul.py), and the native one writes its bf16 result directly. `layer_glu` is, under the same
conditions, one native pass over both weights that writes act(gate) * up (`cpu_native.matmul_glu_native`): XLA
would write both [M, N] products and read them back for the activation.

Quantized weights (`jaxpaged.models.quant.QuantizedWeight`, `quantization="int8"` or `"gguf"`) take the same calls
and are read in their quantized form: by the native kernel qmatmul.cc where the engine laid them out for it, else
dequantized to x's dtype right before XLA's dot.

`prepack_layer_weights` lays the stacked matrices out once, at load, as the native kernel reads them
(`cpu_native.prepack_weight`, [L, N/32, K/2, 64]): a decode step's few rows then stream each weight from memory
instead of gathering 64 bytes of every row of it and packing them on every call (benchmarks/matmul.py). Both
functions take either layout; a prepacked weight outside the native kernel (another dtype, too many rows) is
unpacked first, which is correct and slow: the engine prepacks only where every step runs natively.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools

import jax
import jax.numpy as jnp

from jaxpaged.models.contract import unrolled
from jaxpaged.models.quant import COLUMNS, gpu_kernel_rows, is_quantized, on_shards, qglu, qmatmul, qmatmul3

_NATIVE_ROWS: contextvars.ContextVar[int] = contextvars.ContextVar("jaxpaged_native_matmul_rows", default=0)
_LIVE_ROWS: contextvars.ContextVar = contextvars.ContextVar("jaxpaged_native_live_rows", default=None)


@contextlib.contextmanager
def native_matmul(max_rows: int, live_rows: tuple[int, jax.Array] | None = None):
    """While tracing inside this block, `layer_matmul` and `layer_glu` of bfloat16 x with at most max_rows rows use
    the native CPU kernel (0: never). The caller checks that the kernel is fast here (`cpu_native.matmul_is_fast()`).
    live_rows = (T, n), n an int32 scalar of the same trace: of an x of T rows (the step's tokens) only the first n
    are real, the others a bucketed step's padding; the native kernel multiplies only those, zeros for the rest."""
    tokens = _NATIVE_ROWS.set(max_rows), _LIVE_ROWS.set(live_rows)
    try:
        yield
    finally:
        _NATIVE_ROWS.reset(tokens[0])
        _LIVE_ROWS.reset(tokens[1])


def matmul(x: jax.Array, w: jax.Array) -> jax.Array:
    """x @ w accumulated in float32 (as GPU and TPU matrix units do for 16-bit inputs), returned in x's dtype."""
    return jnp.dot(x, w, preferred_element_type=jnp.float32).astype(x.dtype)


def _live_rows(x: jax.Array) -> jax.Array | None:
    live = _LIVE_ROWS.get()
    return live[1] if live is not None and x.shape[0] == live[0] else None


def uses_native(x: jax.Array, w: jax.Array, kernel: str = "matmul") -> bool:
    """Whether this trace runs x's product with w (or its norm or rope: `kernel` "norm", "rope") natively: inside
    `native_matmul`, x bfloat16 [M, K] with M <= its max_rows and K even, w bfloat16, and that native kernel built
    here (each is its own library: one that failed to build leaves the others native)."""
    rows = _NATIVE_ROWS.get()
    if not (rows and x.ndim == 2 and x.shape[0] <= rows and x.shape[1] % 2 == 0 and x.dtype == jnp.bfloat16
            and w.dtype == jnp.bfloat16):
        return False
    from pallas_kernels import cpu_native

    return cpu_native.available(kernel)


def _layer(w: jax.Array, layer: jax.Array | int) -> jax.Array:
    """[K, N] matrix `layer` of a stacked weight, [L, K, N] or prepacked [L, N/32, K/2, 64]."""
    if w.ndim == 4:
        from pallas_kernels.cpu_native import unpack_weight

        return unpack_weight(w[layer])
    return w[layer]


def layer_matmul(x: jax.Array, w: jax.Array, layer: jax.Array | int, split: str | None = None) -> jax.Array:
    """x [M, K] @ w[layer] for w [L, K, N] stacked over layers (or prepacked, or a `quant.QuantizedWeight`: read in
    its quantized form); `matmul`'s numbers, in x's dtype. split: how a tensor-parallel mesh splits w, COLUMNS (its
    outputs: q/k/v, gate, up) or ROWS (its inputs: o, down), so that a kernel can run on each device's shard
    (`quant.on_shards`); None, or a weight the mesh does not split so: XLA's dot, which GSPMD splits."""
    if is_quantized(w):
        return qmatmul(x, w, layer, rows=_live_rows(x), split=split)
    if uses_native(x, w):
        from pallas_kernels.cpu_native import matmul_native

        return matmul_native(x, w, layer, rows=_live_rows(x))
    if w.ndim == 3 and x.ndim == 2 and x.shape[0] <= gpu_kernel_rows() and w.dtype == x.dtype \
            and not unrolled(x.shape[0]):  # unrolled, XLA's GEMM reads the layer's static slice in place
        from pallas_kernels.gpu_matmul import layer_matmul_gpu

        y = on_shards(layer_matmul_gpu, x, w, layer, split)
        if y is not None:
            return y.astype(x.dtype)
    return matmul(x, _layer(w, layer))


def layer_matmul3(x: jax.Array, ws: tuple[jax.Array, jax.Array, jax.Array],
                  layer: jax.Array | int) -> tuple[jax.Array, jax.Array, jax.Array]:
    """x @ each of three stacked weights at `layer` (an attention layer's q, k, v, split by COLUMNS):
    `layer_matmul`'s numbers; three quantized weights of one format go through one native call (x quantized once,
    one call's fixed cost)."""
    if all(is_quantized(w) for w in ws):
        return qmatmul3(x, tuple(ws), layer, rows=_live_rows(x))
    return tuple(layer_matmul(x, w, layer, COLUMNS) for w in ws)


def linear(x: jax.Array, w) -> jax.Array:
    """x [..., K] @ w [K, N] (full width, or a `quant.QuantizedWeight` read in its quantized form) in x's dtype: what
    `jaxpaged.quantize`'s `QuantizedLinear` runs."""
    lead = x.shape[:-1]
    x2 = x.reshape(-1, x.shape[-1])
    y = qmatmul(x2, w, rows=_live_rows(x2)) if is_quantized(w) else matmul(x2, w)
    return y.reshape(*lead, y.shape[-1])


ACTIVATIONS = {"silu": jax.nn.silu, "gelu_tanh": functools.partial(jax.nn.gelu, approximate=True)}


def layer_glu(x: jax.Array, w_gate: jax.Array, w_up: jax.Array, layer: jax.Array | int, activation: str) -> jax.Array:
    """act(x [M, K] @ w_gate[layer]) * (x @ w_up[layer]) [M, N] in x's dtype, for stacked w_gate, w_up [L, K, N]; act
    is "silu" or "gelu_tanh" (the weights stacked or prepacked). Natively the roundings are the same (each product,
    act(gate), their product) and
    only act's float32 approximation differs from XLA's (an occasional bf16 rounding step)."""
    if is_quantized(w_gate) and is_quantized(w_up):
        return qglu(x, w_gate, w_up, layer, activation, rows=_live_rows(x))
    if not is_quantized(w_gate) and uses_native(x, w_gate) and w_up.dtype == w_gate.dtype:
        from pallas_kernels.cpu_native import matmul_glu_native

        return matmul_glu_native(x, w_gate, w_up, layer, activation, rows=_live_rows(x))
    return ACTIVATIONS[activation](layer_matmul(x, w_gate, layer, COLUMNS)) * layer_matmul(x, w_up, layer, COLUMNS)


def head_matmul(h: jax.Array, head: jax.Array) -> jax.Array:
    """h [S, H] @ head [H, V] accumulated and returned in float32: the LM head. A head prepacked as a one-layer
    stack ([1, V/32, H/2, 64], `prepack_head`) runs natively inside `native_matmul` (bfloat16 h), on its live rows;
    elsewhere XLA's dot (of the unpacked head). A quantized head (`quant.QuantizedWeight`, a matrix or the tied
    embedding table) is read in its quantized form."""
    if is_quantized(head):
        return qmatmul(h, head, None if head.table or not head.lead else 0, jnp.float32, rows=_live_rows(h))
    if head.ndim == 4 and uses_native(h, head):
        from pallas_kernels.cpu_native import matmul_native

        return matmul_native(h, head, 0, jnp.float32, rows=_live_rows(h))
    return jnp.dot(h.astype(head.dtype), _layer(head, 0) if head.ndim == 4 else head,
                   preferred_element_type=jnp.float32)


def _prepacked_if_it_fits(w: jax.Array) -> jax.Array:
    """A stacked bfloat16 [L, K, N] prepacked (`cpu_native.prepack_weight`) where its shape allows (K even, N a
    multiple of 32); else as it is."""
    from pallas_kernels.cpu_native import PANEL, prepack_weight

    if w.ndim != 3 or w.dtype != jnp.bfloat16 or w.shape[1] % 2 or w.shape[2] % PANEL:
        return w
    return jax.jit(prepack_weight)(w)


def prepack_head(head: jax.Array) -> jax.Array:
    """A bfloat16 LM head [H, V] prepacked as a one-layer stack for `head_matmul` where its shape allows (H even, V a
    multiple of 32); else as it is."""
    if is_quantized(head):
        return head
    packed = _prepacked_if_it_fits(head[None]) if head.ndim == 2 else head
    return head if packed.ndim == 3 else packed


LAYER_MATRICES = ("wq", "wk", "wv", "wo", "w_gate", "w_up", "w_down")  # the loader's names (jaxpaged.loader.layout)


def prepack_layer_weights(state: dict) -> dict:
    """The built-in models' state (a pure dict, `nnx.to_pure_dict`) with every stacked bfloat16 layer matrix
    (`layers/wq` ... `layers/w_down`, [L, K, N]) prepacked for the native kernel where its shape allows (K even,
    N a multiple of 32); the rest as it is. For a step that runs its matmuls natively (`native_matmul`)."""
    layers = dict(state["layers"])
    for name in LAYER_MATRICES:
        if name in layers and not is_quantized(layers[name]):
            layers[name] = _prepacked_if_it_fits(layers[name])
    return {**state, "layers": layers}
