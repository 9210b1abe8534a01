"""4-bit weights in com.microsoft MatMulNBits' layout, in one place: the container, the packing,
the dequantization, and the two quantizers lockstep's models use (the golden models' symmetric one
and llama.cpp's Q4_1, which the SmolLM2 GGUF stores and the exporter reproduces).

Layout: ``packed`` uint8 [N, K/block, block/2], two 4-bit values a byte, low nibble first;
``scales`` [N*K/block]; ``zero_points`` float [N*K/block] or None (zero point 8); the weight is
``W[n, k] = (q - zero_point) * scale`` per block of ``block_size`` along K ([N, K]: the HF layout,
used as ``x @ W.T``).
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np

__all__ = ["Int4Weight", "pack", "dequantize_int4", "quantize_symmetric", "quantize_q4_1", "from_q4_1"]


class Int4Weight(NamedTuple):
    """A projection in MatMulNBits' 4-bit layout (see the module docstring)."""

    packed: np.ndarray
    scales: np.ndarray
    zero_points: np.ndarray | None
    block_size: int


def pack(q: np.ndarray) -> np.ndarray:
    """4-bit values [..., block] (0..15, in element order) two a byte, low nibble first."""
    return (q[..., 0::2] | (q[..., 1::2] << 4)).astype(np.uint8)


def dequantize_int4(q: Int4Weight) -> np.ndarray:
    """The float64 [N, K] (HF layout) weight an ``Int4Weight`` encodes."""
    n, nb, half = q.packed.shape
    if 2 * half != q.block_size:
        raise ValueError(f"packed shape {q.packed.shape} does not hold blocks of {q.block_size}")
    vals = np.empty((n, nb, q.block_size), np.float64)
    vals[..., 0::2] = q.packed & 0x0F
    vals[..., 1::2] = q.packed >> 4
    zp = np.full(n * nb, 8.0) if q.zero_points is None else np.asarray(q.zero_points, np.float64)
    w = (vals - zp.reshape(n, nb, 1)) * np.asarray(q.scales, np.float64).reshape(n, nb, 1)
    return w.reshape(n, nb * q.block_size)


def _blocks(w: np.ndarray, block: int) -> np.ndarray:
    w = np.asarray(w, np.float64)
    n, k = w.shape
    if k % block or block % 2:
        raise ValueError(f"K={k} must be a multiple of the (even) int4 block size {block}")
    return w.reshape(n, k // block, block)


def quantize_symmetric(w: np.ndarray, block: int) -> Int4Weight:
    """Symmetric 4-bit quantization of ``w`` [N, K] (the golden models' int4 flavour): per block,
    ``scale = max|x| / 7`` (1 for an all-zero block), ``q = clip(rint(x / scale) + 8, 0, 15)``,
    zero point 8 (``zero_points`` None); scales in float64 (the model stores them in its dtype)."""
    b = _blocks(w, block)
    scales = np.abs(b).max(axis=2) / 7.0
    scales[scales == 0] = 1.0
    q = np.clip(np.rint(b / scales[..., None]) + 8, 0, 15).astype(np.uint8)
    return Int4Weight(pack(q), scales.reshape(-1), None, block)


def from_q4_1(q: np.ndarray, d: np.ndarray, m: np.ndarray, block: int, dtype: str = "float32") -> Int4Weight:
    """llama.cpp Q4_1 blocks (values ``q`` [N, K/block, block], ``x ~ d*q + m``) for MatMulNBits:
    scale ``d``, float zero point ``-m/d``; a constant block (``d == 0``) as q = 0, scale ``m``,
    zero point -1. ``dtype`` is the stored dtype of scales and zero points (the model's)."""
    d, m = np.asarray(d, np.float64), np.asarray(m, np.float64)
    flat = d == 0
    safe = np.where(flat, 1.0, d)
    q = np.where(flat[..., None], 0, q).astype(np.uint8)
    scales = np.where(flat, m, d).astype(dtype)
    zp = np.where(flat, -1.0, -m / safe).astype(dtype)
    return Int4Weight(pack(q), scales.reshape(-1), zp.reshape(-1), block)


def quantize_q4_1(w: np.ndarray, block: int = 32, dtype: str = "float32") -> Int4Weight:
    """Quantize ``w`` [N, K] (HF layout) as llama.cpp's Q4_1 does (per block of ``block`` along K:
    ``d = (max - min) / 15``, ``q = round((x - min) / d)`` clipped to 0..15, ``x ~ d*q + min``), in
    MatMulNBits' terms (``from_q4_1``)."""
    b = _blocks(w, block)
    lo, hi = b.min(axis=2), b.max(axis=2)
    d = ((hi - lo) / 15.0).astype(dtype).astype(np.float64)
    m = lo.astype(dtype).astype(np.float64)
    safe = np.where(d == 0, 1.0, d)
    q = np.clip(np.rint((b - m[..., None]) / safe[..., None]), 0, 15)
    return from_q4_1(q, d, m, block, dtype)
