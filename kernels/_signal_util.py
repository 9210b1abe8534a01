"""Spectral plumbing of ``ops_signal``: a DFT along the last axis as two real matrix products
(``_linalg.matmul``: capturable, no cuFFT) and its workspace estimate."""

from __future__ import annotations

import numpy as np

from ._linalg import matmul

__all__ = ["dft_bytes", "dft_last"]


def dft_bytes(batch: int, length: int, bins: int) -> int:
    """An upper estimate of ``dft_last``'s temporaries (Python ints): the (length, bins) index,
    angle, cosine and sine matrices, and float64 copies and results of ``batch`` rows."""
    return 4 * length * bins * 8 + 4 * batch * (length + bins) * 8


def _fit(xp, a, n):
    """Truncate or zero-pad the last axis of ``a`` to ``n``."""
    m = a.shape[-1]
    if m >= n:
        return a[..., :n]
    return xp.pad(a, [(0, 0)] * (a.ndim - 1) + [(0, n - m)], mode="constant")


def dft_last(xp, xr, xi, length, inverse, onesided):
    """DFT along the last axis of (xr, xi) (xi may be None) -> (re, im) float64; im None for irfft."""
    f64 = xp.float64
    if inverse and onesided:
        m = length // 2 + 1
        xr = _fit(xp, xr, m)
        xi = None if xi is None else _fit(xp, xi, m)
        k = xp.arange(m, dtype=xp.int64)[:, None]
        t = xp.arange(length, dtype=xp.int64)[None, :]
        ang = (k * t % length).astype(f64) * (2 * np.pi / length)
        w = xp.where((k == 0) | (2 * k == length), 1.0, 2.0) / length
        out = matmul(xp, xr, w * xp.cos(ang))
        if xi is not None:
            out = out - matmul(xp, xi, w * xp.sin(ang))
        return out, None
    K = length // 2 + 1 if onesided and not inverse else length
    xr = _fit(xp, xr, length)
    xi = None if xi is None else _fit(xp, xi, length)
    t = xp.arange(length, dtype=xp.int64)[:, None]
    k = xp.arange(K, dtype=xp.int64)[None, :]
    ang = (t * k % length).astype(f64) * (2 * np.pi / length)
    c, s = xp.cos(ang), xp.sin(ang)
    if inverse:
        s = -s
    re = matmul(xp, xr, c)
    im = -matmul(xp, xr, s)
    if xi is not None:
        re = re + matmul(xp, xi, s)
        im = im + matmul(xp, xi, c)
    if inverse:
        re, im = re / length, im / length
    return re, im
