"""A GGUF file's quantized matrices kept quantized (`quantization="gguf"`): each tensor's blocks re-laid out as a
`jaxpaged.models.quant.QuantizedWeight` (plain layout), with its codes and scales unchanged.

    config, params = load_gguf_quantized(path)   # params: the loader's layout, matrices as QuantizedWeight

Kept as they are (the codes and scales of the file, re-laid out only):
  Q8_0   8-bit codes, float16 scale per 32                      -> "q8_0" (u = q + 128, w = d (u - 128))
  Q4_0   4-bit codes, float16 scale per 32                      -> "q4_0" (w = d (u - 8))
  Q4_1   4-bit codes, float16 scale and min per 32              -> "q4_1" (w = d u + m)
  Q4_K   4-bit codes, per 256: float16 d, dmin; per 32: 6-bit scale and min -> "q4_k": s = d sc and m = -dmin mn
         per 32, exact in float32 (11 x 6 significant bits)
  Q5_0   5-bit codes, float16 scale per 32                      -> "q8_0", widened to 8-bit codes (u = q + 112), exact
Every other quantized type (Q6_K of Q4_K_M files, Q5_1, Q5_K, Q2_K, Q3_K, IQ*) cannot be kept: it is dequantized
and stored re-quantized as 8-bit codes with a float32 scale and min per 32 ("q8_k"), with a warning naming the type
(the 8-bit step is a quarter of a 6-bit one: close to the file, not equal to it). Tensors the file holds in a float
type (F32, F16, BF16) stay full width, as the file has them; only where such a layer shares a stack with quantized
layers is it re-quantized the same way (with the warning).
A stacked weight has one format for all its layers (the kernel reads layer `i` of one array): when a file mixes
types across layers (Q4_K_M: ffn_down in Q4_K and Q6_K, attn_v in Q5_0 and Q8_0), the layers are widened to the
smallest common form (8-bit codes; float16, then float32 scales), which holds the kept types exactly.

Quantized here: the layers' q/k/v/o/gate/up/down, an untied output.weight and the token embedding (a table: the
lookup dequantizes its rows, and a tied model multiplies by it as its LM head). Norms and biases are dequantized to
float32 as `gguf_file.load_gguf` does.
"""

from __future__ import annotations

import dataclasses
import logging

import numpy as np

from jaxpaged.config import ModelConfig
from jaxpaged.loader.gguf_file import _TENSORS, NORM_NAMES, _unpermute, dequantize, model_config_from_gguf
from jaxpaged.loader.layout import expected_shapes, global_names, layer_names
from jaxpaged.models.matmul import LAYER_MATRICES
from jaxpaged.models.quant import BLOCK, BLOCK_F16, BLOCK_F32, BLOCK_SYM, QuantizedWeight

logger = logging.getLogger(__name__)

KEPT_TYPES = ("Q8_0", "Q4_0", "Q4_1", "Q4_K", "Q5_0")
QUANTIZED_GLOBALS = ("embed", "lm_head")


@dataclasses.dataclass
class Planes:
    """One tensor [N, K] (N output channels, blocks along K) in the plain layout, before stacking."""

    codes: np.ndarray  # uint8 [N, Kp * bits / 8]
    scales: np.ndarray  # float16 [N, B] (BLOCK_SYM) or float16 / float32 [N, B, 2] (s, m)
    bits: int
    scale_mode: int
    source: str  # the GGML type name

    def widened(self, bits: int, scale_mode: int) -> Planes:
        """The same weights with `bits`-bit codes and `scale_mode` scales (>= its own), exactly."""
        codes, scales = self.codes, self.scales
        if bits == 8 and self.bits == 4:
            u = _unpack4(codes)
            if self.scale_mode == BLOCK_SYM and scale_mode == BLOCK_SYM:
                u = u + np.uint8(120)  # s (u - 8) = s (u + 120 - 128)
            codes = u
        if scale_mode != self.scale_mode:
            if self.scale_mode == BLOCK_SYM:  # s (u - offset) = s u + m, m = -offset s (exact in float16)
                off = 128.0 if self.bits == 8 else 8.0
                scales = np.stack([scales, (-off * scales.astype(np.float32)).astype(scales.dtype)], axis=-1)
                if not np.all(np.isfinite(scales)):
                    raise ValueError(f"a {self.source} scale overflows float16 when widened")
            scales = scales.astype(np.float32 if scale_mode == BLOCK_F32 else np.float16)
        return Planes(codes, scales, bits, scale_mode, self.source)


def _unpack4(codes: np.ndarray) -> np.ndarray:
    """[N, Kp / 2] packed (per block, byte j: k = j low, k = j + 16 high) -> [N, Kp] codes."""
    c = codes.reshape(*codes.shape[:-1], -1, BLOCK // 2)
    return np.concatenate([c & 15, c >> 4], axis=-1).reshape(*codes.shape[:-1], -1)


def _pack4(u: np.ndarray) -> np.ndarray:
    ub = u.reshape(*u.shape[:-1], -1, BLOCK)
    return (ub[..., :16] | (ub[..., 16:] << 4)).astype(np.uint8).reshape(*u.shape[:-1], -1)


def _blocks(tensor, block_bytes: int) -> np.ndarray:
    """The tensor's raw blocks [N, K / block, block_bytes] uint8."""
    data = np.asarray(tensor.data).view(np.uint8)
    n = int(tensor.shape[-1]) if len(tensor.shape) > 1 else 1
    return data.reshape(n, -1, block_bytes)


def _f16(raw: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(raw).view(np.float16)[..., 0]


def requantize8(w: np.ndarray, source: str) -> Planes:
    """w [N, K] float32 as 8-bit codes with a float32 scale and min per block of 32 (s = (max - min) / 255, m = min,
    u = round((w - m) / s)): what a type that cannot be kept becomes."""
    n, k = w.shape
    kp = -(-k // BLOCK) * BLOCK
    wb = np.zeros((n, kp), np.float32)
    wb[:, :k] = w
    wb = wb.reshape(n, kp // BLOCK, BLOCK)
    lo, hi = wb.min(axis=-1), wb.max(axis=-1)
    s = ((hi - lo) / np.float32(255.0)).astype(np.float32)
    inv = np.where(s > 0, np.float32(1.0) / np.where(s > 0, s, 1), 0).astype(np.float32)
    u = np.clip(np.rint((wb - lo[..., None]) * inv[..., None]), 0, 255).astype(np.uint8)
    return Planes(u.reshape(n, kp), np.stack([s, lo], axis=-1), 8, BLOCK_F32, source)


FLOAT_TYPES = ("F32", "F16", "BF16", "F64")


def tensor_planes(tensor) -> Planes | None:
    """One GGUF matrix (GGUF shape [K, N]: torch's [N, K]) as Planes, kept where its type allows (module docstring);
    None for a float type (full width in the file)."""
    kind = tensor.tensor_type.name
    if kind in FLOAT_TYPES:
        return None
    if kind == "Q8_0":
        b = _blocks(tensor, 34)
        u = (b[..., 2:].view(np.int8).astype(np.int16) + 128).astype(np.uint8)  # [N, B, 32]
        return Planes(u.reshape(u.shape[0], -1), _f16(b[..., :2]), 8, BLOCK_SYM, kind)
    if kind == "Q4_0":
        b = _blocks(tensor, 18)  # the file's nibble order is the plain layout's
        return Planes(np.ascontiguousarray(b[..., 2:]).reshape(b.shape[0], -1), _f16(b[..., :2]), 4, BLOCK_SYM, kind)
    if kind == "Q4_1":
        b = _blocks(tensor, 20)
        scales = np.stack([_f16(b[..., :2]), _f16(b[..., 2:4])], axis=-1)
        return Planes(np.ascontiguousarray(b[..., 4:]).reshape(b.shape[0], -1), scales, 4, BLOCK_F16, kind)
    if kind == "Q5_0":
        b = _blocks(tensor, 22)
        qh = np.ascontiguousarray(b[..., 2:6]).view(np.uint32)  # [N, B, 1]: bit j is the 5th bit of k = j
        qs = b[..., 6:]  # [N, B, 16]
        bits = (qh >> np.arange(32, dtype=np.uint32)) & 1  # [N, B, 32]
        q = np.concatenate([qs & 15, qs >> 4], axis=-1) | (bits.astype(np.uint8) << 4)
        u = (q + np.uint8(112)).astype(np.uint8)  # d (q - 16) = d (u - 128)
        return Planes(u.reshape(u.shape[0], -1), _f16(b[..., :2]), 8, BLOCK_SYM, kind)
    if kind == "Q4_K":
        from gguf.quants import Q4_K

        b = _blocks(tensor, 144)  # per 256: d, dmin, 12 bytes of scales, 128 bytes of codes
        n, supers = b.shape[:2]
        d = _f16(b[..., 0:2]).astype(np.float32)
        dmin = _f16(b[..., 2:4]).astype(np.float32)
        sc, mn = Q4_K.get_scale_min(np.ascontiguousarray(b[..., 4:16]).reshape(-1, 12))  # [N * supers, 8] each
        s = d[..., None] * sc.reshape(n, supers, 8).astype(np.float32)
        m = -(dmin[..., None] * mn.reshape(n, supers, 8).astype(np.float32))
        qs = b[..., 16:].reshape(n, supers, 4, 32)  # per 64 weights: k = 0..31 low nibbles, 32..63 high
        u = np.stack([qs & 15, qs >> 4], axis=3).reshape(n, -1)  # [N, K] in k order
        return Planes(_pack4(u), np.stack([s.reshape(n, -1), m.reshape(n, -1)], axis=-1), 4, BLOCK_F32, kind)
    return requantize8(dequantize(tensor), kind)


def _common_form(planes: list[Planes]) -> tuple[int, int]:
    bits = max(p.bits for p in planes)
    modes = {p.scale_mode for p in planes}
    if len(modes) == 1 and all(p.bits == bits for p in planes):
        return bits, modes.pop()
    mode = max(modes) if modes != {BLOCK_SYM} else BLOCK_SYM
    if bits == 8 and mode == BLOCK_SYM:
        return bits, mode
    return bits, max(mode, BLOCK_F16)


def stacked_weight(planes: list[Planes], dense_shape: tuple[int, ...], table: bool = False) -> QuantizedWeight:
    """The layers' Planes (one, unstacked, for a table or a 2-D matrix) as one QuantizedWeight, in their common form."""
    bits, mode = _common_form(planes)
    planes = [p.widened(bits, mode) for p in planes]
    sources = tuple(sorted({p.source for p in planes}))
    if len(planes) == 1 and (table or len(dense_shape) == 2):
        return QuantizedWeight(planes[0].codes, planes[0].scales, bits, mode, dense_shape, table, sources=sources)
    return QuantizedWeight(np.stack([p.codes for p in planes]), np.stack([p.scales for p in planes]), bits, mode,
                           dense_shape, table, sources=sources)


def load_gguf_quantized(path: str, reader=None) -> tuple[ModelConfig, dict]:
    """(config, params) with the matrices and the embedding as QuantizedWeight (plain layout, numpy) and the rest
    float32, in the loader's layout. Logs a warning per type that could not be kept, naming it and its tensors.
    reader: the file's `gguf.GGUFReader`, if the caller parsed it already."""
    from gguf import GGUFReader

    reader = reader or GGUFReader(path)
    config = model_config_from_gguf(reader)
    tensors = {t.name: t for t in reader.tensors}
    permuted = config.architecture == "llama"
    norm_shift = 1.0 if config.rms_norm_unit_offset else 0.0
    shapes = expected_shapes(config)

    params: dict = {"layers": {}}
    lost: dict[str, list[str]] = {}

    def tensor(name: str, layer: int | None):
        key = _TENSORS[name].format(i=layer)
        if key not in tensors:
            raise ValueError(f"missing tensor {key!r} in {path}")
        return tensors[key]

    def rows(name: str, a: np.ndarray) -> np.ndarray:
        """[N, ...] with llama.cpp's q/k row permute undone (rows are output channels)."""
        if permuted and name in ("wq", "wk"):
            return _unpermute(a, config.num_heads if name == "wq" else config.num_kv_heads)
        return a

    def planes(name: str, layer: int | None) -> Planes | None:
        p = tensor_planes(tensor(name, layer))
        return p if p is None else dataclasses.replace(p, codes=rows(name, p.codes), scales=rows(name, p.scales))

    def quantized(name: str, layers: list[int | None], shape: tuple[int, ...]):
        """The stack (or one tensor) as a QuantizedWeight; full width (float32) when every part is a float type."""
        parts = [planes(name, i) for i in layers]
        if all(p is None for p in parts):
            dense_parts = [rows(name, dense(name, i)) for i in layers]
            a = dense_parts[0] if layers == [None] else np.stack(dense_parts)
            return a if name == "embed" else np.ascontiguousarray(np.swapaxes(a, -1, -2))  # [*, K, N] for x @ w
        for j, (i, p) in enumerate(zip(layers, parts, strict=True)):
            if p is None:  # a float layer among quantized ones
                t = tensor(name, i)
                parts[j] = requantize8(rows(name, np.asarray(dequantize(t), np.float32)), t.tensor_type.name)
        for i, p in zip(layers, parts, strict=True):
            if p.source not in KEPT_TYPES:
                lost.setdefault(p.source, []).append(_TENSORS[name].format(i=i))
        return stacked_weight(parts, shape, table=name == "embed")

    def dense(name: str, layer: int | None) -> np.ndarray:
        a = dequantize(tensor(name, layer))
        if permuted and name in ("bq", "bk"):
            a = _unpermute(a, config.num_heads if name == "bq" else config.num_kv_heads)
        elif norm_shift and name in NORM_NAMES:
            a = a - np.float32(norm_shift)
        return np.ascontiguousarray(a, np.float32)

    for name in global_names(config):
        if name in QUANTIZED_GLOBALS:
            params[name] = quantized(name, [None], shapes[name])
        else:
            params[name] = dense(name, None)
    for name in layer_names(config):
        if name in LAYER_MATRICES:
            params["layers"][name] = quantized(name, list(range(config.num_layers)), shapes["layers"][name])
        else:
            params["layers"][name] = np.stack([dense(name, i) for i in range(config.num_layers)])
    for kind, names in lost.items():
        logger.warning("quantization='gguf': %d tensor(s) of type %s cannot be kept in their format and were "
                       "re-quantized to 8-bit codes with a float32 scale and min per 32 (close to the file, not "
                       "equal to it): %s", len(names), kind, ", ".join(names[:6]) + (" ..." if len(names) > 6 else ""))
    for name, shape in shapes["layers"].items():
        if tuple(params["layers"][name].shape) != shape:
            raise ValueError(f"tensor {name} has shape {params['layers'][name].shape}, expected {shape}")
    return config, params


__all__ = ["KEPT_TYPES", "Planes", "load_gguf_quantized", "stacked_weight", "tensor_planes", "requantize8"]
