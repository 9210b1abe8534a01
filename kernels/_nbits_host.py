"""MatMulNBits' 4-bit product on the host (the simulated device): the packed weight bytes are read
at every run and no dequantized copy of the weight is kept.

Dequantizing a 3B int4 model's weights once and keeping them (``const_memo``) costs 12 GB of fp32
for 1.5 GB of blocks; dequantizing them in numpy at every step costs seconds a step. Two numba
kernels instead (``scripts/bench_nbits_host.py`` measures them):

- one input row (a decode step): the blocks are unpacked inside the product (one layer of a 3B model:
  1.9x the time of an fp32 BLAS product over kept weights, 1/15 of dequantizing at every run; 2 cores).
  Per output row ``n``, float32 throughout: lane ``j`` of a block of ``bs`` values holds the pair
  ``(2j, 2j + 1)``; over the blocks ``b`` in order,
  ``acc[j] += s[n, b] * ((lo - z) * x[2j] + (hi - z) * x[2j + 1])`` with ``lo``/``hi`` the byte's
  low and high nibbles and ``z`` the block's zero point; then the ``bs / 2`` lanes are summed as a
  fixed pairwise tree. K past the last full block is read as zeros.
- several rows (a prefill), and every float64 product (the oracle's float64 cross-check): 32 MiB of
  weight rows at a time are dequantized into scratch of A's dtype (the values ``dequantize_blocks``
  gives: ``(q - z) * s``), then multiplied by numpy's BLAS. The cross-check of a 3B int4 model read
  every weight dequantized into a whole float64 copy before (4.1 s of its 11.8 s, 2 cores).

Each output row is computed whole by one thread, so the bytes do not depend on the thread count.

Without numba (``AVAILABLE`` false) the kernel falls back to dequantizing (``ops_contrib``).
"""

from __future__ import annotations

import importlib.util
import threading
from typing import Any

import numpy as np

from lockstep.host_threads import split_rows
from lockstep.host_threads import threads as _threads

# numba is a dependency, imported at the first product (half a second: not at every lockstep start);
# a machine without it (the GPU lane installs with --no-deps) falls back to dequantizing.
AVAILABLE = importlib.util.find_spec("numba") is not None

__all__ = ["AVAILABLE", "matmul_4bit"]

# Below this many weight values a product runs on the calling thread (the built-in golden models).
_THREADED_MIN = 1 << 20


def _gemv(packed, scales, zps, xe, xo, y, n0, n1):  # pragma: no cover - compiled by numba
    h = packed.shape[2]
    nb = packed.shape[1]
    acc = np.empty(h, np.float32)
    for n in range(n0, n1):
        acc[:] = 0
        for b in range(nb):
            z = zps[n, b]
            s = scales[n, b]
            for j in range(h):
                v = packed[n, b, j]
                acc[j] += s * ((np.float32(v & 15) - z) * xe[0, b, j] + (np.float32(v >> 4) - z) * xo[0, b, j])
        w = h
        while w > 1:
            w //= 2
            for j in range(w):
                acc[j] += acc[j + w]
        y[0, n] = acc[0]


def _dequant(packed, scales, zps, out, first, n0, n1):  # pragma: no cover - compiled by numba
    h = packed.shape[2]
    nb = packed.shape[1]
    for n in range(n0, n1):
        r = n - first
        for b in range(nb):
            z = zps[n, b]
            s = scales[n, b]
            base = 2 * h * b
            for j in range(h):
                v = packed[n, b, j]
                out[r, base + 2 * j] = (np.float32(v & 15) - z) * s
                out[r, base + 2 * j + 1] = (np.float32(v >> 4) - z) * s


_compiled: tuple[Any, Any] | None = None
# A product of several rows dequantizes this many bytes of weight rows at a time into fp32 scratch.
_CHUNK_BYTES = 32 << 20
_compile_lock = threading.Lock()


def _kernels() -> tuple[Any, Any]:
    """(gemv, dequant) compiled. nogil: the rows are split over Python threads (below), not numba's
    parallel layer, whose default (workqueue) aborts the process when two threads launch at once;
    cache: compiled once per machine, not per process."""
    global _compiled
    with _compile_lock:
        if _compiled is None:
            from numba import njit

            _compiled = (njit(nogil=True, cache=True)(_gemv), njit(nogil=True, cache=True)(_dequant))
        return _compiled


def _operands(packed, scales, zero_points, n: int, nb: int, h: int, dtype) -> tuple[np.ndarray, ...]:
    """(blocks [N, nb, h], scales [N, nb], zero points [N, nb]) as the kernels read them, the scales
    and zero points in ``dtype``."""
    p = np.ascontiguousarray(packed).reshape(n, nb, h)
    s = np.ascontiguousarray(scales, dtype=dtype).reshape(n, nb)
    if zero_points is None:
        z = np.full((n, nb), 8, dtype)
    elif zero_points.dtype == np.uint8:
        zb = zero_points.reshape(n, -(-nb // 2))
        z = np.stack((zb & 15, zb >> 4), axis=-1).reshape(n, -1)[:, :nb].astype(dtype)
    else:
        z = np.ascontiguousarray(zero_points, dtype=dtype).reshape(n, nb)
    return p, s, z


def matmul_4bit(a: np.ndarray, packed: np.ndarray, scales: np.ndarray, zero_points: np.ndarray | None, *,
                n: int, k: int, block: int) -> np.ndarray:
    """``[M, N]`` = ``a`` (float32 or float64 ``[M, K]``) times the transpose of MatMulNBits' 4-bit
    weight, in ``a``'s dtype.

    ``packed``: uint8 with ``N * n_blocks * block / 2`` values; ``scales``: ``N * n_blocks`` floats;
    ``zero_points``: None (8), packed uint8 (two per byte, ``N * ceil(n_blocks / 2)``) or floats
    (``N * n_blocks``). The caller checked the sizes (``ops_contrib._nbits_shapes``)."""
    if not AVAILABLE:
        raise RuntimeError("numba is not importable: MatMulNBits' fused host kernel is unavailable")
    dtype = np.dtype(a.dtype)
    if dtype not in (np.float32, np.float64):
        raise TypeError(f"matmul_4bit computes in float32 or float64, not {dtype}")
    nb = -(-k // block)
    h = block // 2
    p, s, z = _operands(packed, scales, zero_points, n, nb, h, dtype)
    m = a.shape[0]
    gemv, dequant = _kernels()
    y = np.empty((m, n), dtype)
    if m != 1 or dtype == np.float64:
        # rows of the weight dequantized a chunk at a time (the values dequantize_blocks gives), then
        # one BLAS product per chunk: a prefill (and the float64 cross-check) never holds a copy of
        # every weight, and the chunk is written where it is read
        rows = max(1, min(n, _CHUNK_BYTES // (dtype.itemsize * nb * block)))
        scratch = np.empty((rows, nb * block), dtype)
        for c0 in range(0, n, rows):
            c1 = min(n, c0 + rows)
            _split(dequant, p, s, z, scratch, c0, c0, c1)
            y[:, c0:c1] = a @ scratch[:c1 - c0, :k].T
        return y
    x = np.zeros((1, nb * block), np.float32)
    x[:, :k] = a
    pairs = x.reshape(1, nb, h, 2)
    xe, xo = np.ascontiguousarray(pairs[..., 0]), np.ascontiguousarray(pairs[..., 1])
    _split(gemv, p, s, z, xe, xo, y, 0, n)
    return y


def _split(fn, *args) -> None:
    """``fn(*args[:-2], lo, hi)`` over the rows ``[args[-2], args[-1])``, split over this process's
    threads where the rows hold enough weights; each row whole in one call."""
    *head, r0, r1 = args
    p = head[0]
    threaded = (r1 - r0) * p.shape[1] * p.shape[2] * 2 >= _THREADED_MIN
    split_rows(fn, tuple(head), r0, r1, _threads() if threaded else 1)
