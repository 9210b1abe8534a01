"""MatMulNBits' 4-bit product on the host (the simulated device), fused: each decode step reads the
packed weight bytes and never keeps a dequantized copy.

Dequantizing a 3B int4 model's weights once and keeping them (``const_memo``) costs 12 GB of fp32
for 1.5 GB of blocks; dequantizing them in numpy at every step costs seconds a step. These numba
kernels unpack each block as they go, at the speed of an fp32 BLAS product over kept weights
(``scripts/bench_nbits_host.py``), with no memory beyond the blocks themselves.

The arithmetic, per output row ``n`` and input row ``m`` (float32 throughout): lane ``j`` of a
block of ``bs`` values holds the pair ``(2j, 2j + 1)``; over the blocks ``b`` in order,
``acc[j] += s[n, b] * ((lo - z) * x[2j] + (hi - z) * x[2j + 1])`` with ``lo``/``hi`` the byte's low
and high nibbles and ``z`` the block's zero point; then the ``bs / 2`` lanes are summed as a fixed
pairwise tree. Every row is computed whole by one thread in this order, so the result is the same
bytes for one row alone and within a batch of any size (a prefill and a decode step agree), on any
thread count. K past the last full block is read as zeros.

Without numba (``AVAILABLE`` false) the kernel falls back to dequantizing (``ops_contrib``).
"""

from __future__ import annotations

import importlib.util
import os
import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np

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


def _gemm(packed, scales, zps, xe, xo, y, n0, n1):  # pragma: no cover - compiled by numba
    h = packed.shape[2]
    nb = packed.shape[1]
    M = xe.shape[0]
    acc = np.empty((M, h), np.float32)
    de = np.empty(h, np.float32)
    do = np.empty(h, np.float32)
    for n in range(n0, n1):
        acc[:] = 0
        for b in range(nb):
            z = zps[n, b]
            s = scales[n, b]
            for j in range(h):
                v = packed[n, b, j]
                de[j] = np.float32(v & 15) - z
                do[j] = np.float32(v >> 4) - z
            for m in range(M):
                for j in range(h):
                    acc[m, j] += s * (de[j] * xe[m, b, j] + do[j] * xo[m, b, j])
        for m in range(M):
            w = h
            while w > 1:
                w //= 2
                for j in range(w):
                    acc[m, j] += acc[m, j + w]
            y[m, n] = acc[m, 0]


_compiled: tuple[Any, Any] | None = None
_pool: tuple[int, ThreadPoolExecutor] | None = None
_pool_lock = threading.Lock()


def _kernels() -> tuple[Any, Any]:
    """(gemv, gemm) compiled. nogil: the rows are split over Python threads (below), not numba's
    parallel layer, whose default (workqueue) aborts the process when two threads launch at once;
    cache: compiled once per machine, not per process."""
    global _compiled
    with _pool_lock:
        if _compiled is None:
            from numba import njit

            _compiled = (njit(nogil=True, cache=True)(_gemv), njit(nogil=True, cache=True)(_gemm))
        return _compiled


def _threads() -> int:
    return max(1, len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1))


def _executor() -> ThreadPoolExecutor:
    """This process's pool (a forked child makes its own: the parent's threads are not in it)."""
    global _pool
    with _pool_lock:
        if _pool is None or _pool[0] != os.getpid():
            _pool = (os.getpid(), ThreadPoolExecutor(_threads(), thread_name_prefix="lockstep-nbits"))
        return _pool[1]


def matmul_4bit(a: np.ndarray, packed: np.ndarray, scales: np.ndarray, zero_points: np.ndarray | None, *,
                n: int, k: int, block: int) -> np.ndarray:
    """float32 ``[M, N]`` = ``a`` (float32 ``[M, K]``) times the transpose of MatMulNBits' 4-bit weight.

    ``packed``: uint8 with ``N * n_blocks * block / 2`` values; ``scales``: ``N * n_blocks`` floats;
    ``zero_points``: None (8), packed uint8 (two per byte, ``N * ceil(n_blocks / 2)``) or floats
    (``N * n_blocks``). The caller checked the sizes (``ops_contrib._nbits_shapes``)."""
    if not AVAILABLE:
        raise RuntimeError("numba is not importable: MatMulNBits' fused host kernel is unavailable")
    nb = -(-k // block)
    h = block // 2
    p = np.ascontiguousarray(packed).reshape(n, nb, h)
    s = np.ascontiguousarray(scales, dtype=np.float32).reshape(n, nb)
    if zero_points is None:
        z = np.full((n, nb), 8, np.float32)
    elif zero_points.dtype == np.uint8:
        zb = zero_points.reshape(n, -(-nb // 2))
        z = np.stack((zb & 15, zb >> 4), axis=-1).reshape(n, -1)[:, :nb].astype(np.float32)
    else:
        z = np.ascontiguousarray(zero_points, dtype=np.float32).reshape(n, nb)
    m = a.shape[0]
    x = np.zeros((m, nb * block), np.float32)
    x[:, :k] = a
    pairs = x.reshape(m, nb, h, 2)
    xe, xo = np.ascontiguousarray(pairs[..., 0]), np.ascontiguousarray(pairs[..., 1])
    y = np.empty((m, n), np.float32)
    fn = _kernels()[0 if m == 1 else 1]
    threads = _threads()
    if threads == 1 or n * nb * block < _THREADED_MIN:
        fn(p, s, z, xe, xo, y, 0, n)
        return y
    step = -(-n // threads)
    futures = [_executor().submit(fn, p, s, z, xe, xo, y, lo, min(n, lo + step)) for lo in range(0, n, step)]
    for f in futures:
        f.result()
    return y
