"""The oracle's 4-bit dequantization, compiled: MatMulNBits' float64 weight rows
``(q - zero_point) * scale`` with the bytes of ``contrib_oracle_ops.MatMulNBits._rows`` (numpy), six
times faster per thread and split over the host's threads.

numpy's passes (unpack, subtract, multiply: 300 M values a second on one core) were a third of a 3B
int4 model's ``golden add`` (8.5 s of the oracle's 16 s prefill, 2 cores). Here each block's sixteen
values ``(float64(q) - z) * s`` are computed once into a table (the same two operations as numpy's,
in the same order: the same bytes), then each byte's low and high nibble index it (low first).

Its own code: the reference runtime's kernel (``kernels._nbits_host``, which the float64 cross-check
runs) computes each value inline; this one shares nothing with it but numba. Without numba
(``AVAILABLE`` false: an install with ``--no-deps``) the oracle keeps its numpy passes.
"""

from __future__ import annotations

import importlib.util
import threading
from typing import Any

import numpy as np

from lockstep.host_threads import split_rows, threads

__all__ = ["AVAILABLE", "dequantize_rows"]

AVAILABLE = importlib.util.find_spec("numba") is not None

# Below this many values the rows are dequantized on the calling thread (the built-in golden models).
_THREADED_MIN = 1 << 20

_compiled: Any = None
_lock = threading.Lock()


def _table_rows(packed, scales, zps, out, n0, n1):  # pragma: no cover - compiled by numba
    nb = packed.shape[1]
    half = packed.shape[2]
    table = np.empty(16, np.float64)
    for n in range(n0, n1):
        for b in range(nb):
            z = zps[n, b]
            s = scales[n, b]
            for q in range(16):
                table[q] = (np.float64(q) - z) * s
            at = 2 * half * b
            for j in range(half):
                v = packed[n, b, j]
                out[n, at + 2 * j] = table[v & 15]
                out[n, at + 2 * j + 1] = table[v >> 4]


def _kernel() -> Any:
    global _compiled
    with _lock:
        if _compiled is None:
            from numba import njit

            _compiled = njit(nogil=True, cache=True)(_table_rows)
        return _compiled


def dequantize_rows(packed: np.ndarray, scales: np.ndarray, zero_points: np.ndarray, out: np.ndarray) -> None:
    """``out[n, b * bs + i]`` = ``(float64(q) - zero_points[n, b]) * scales[n, b]`` for the ``i``-th
    4-bit value ``q`` of block ``b`` of row ``n`` (low nibble first): ``packed`` uint8 ``[R, nb, bs / 2]``,
    ``scales`` and ``zero_points`` float64 ``[R, nb]``, ``out`` float64 ``[R, nb * bs]`` (C-contiguous)."""
    if not AVAILABLE:
        raise RuntimeError("numba is not importable: the oracle's compiled 4-bit dequantization is unavailable")
    fn = _kernel()
    rows = packed.shape[0]
    args = (np.ascontiguousarray(packed), np.ascontiguousarray(scales, np.float64),
            np.ascontiguousarray(zero_points, np.float64), out)
    split_rows(fn, args, 0, rows, threads() if out.size >= _THREADED_MIN else 1)
