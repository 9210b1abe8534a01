"""Resampling plumbing (numpy/CuPy generic) of ``ops_resize``: Resize's separable per-axis taps
(``resize_axis``: coordinate transformation modes, nearest/linear/cubic with antialias), GridSample
and AffineGrid: gathers and weighted sums, no matrix product."""

from __future__ import annotations

import itertools

import numpy as np

from ._conv_util import float_work

__all__ = ["affine_grid", "cubic_coeffs", "grid_sample", "reflect", "resize_axis"]


def reflect(xp, v, lo: float, hi: float):
    """Reflect coordinates ``v`` by the borders [lo, hi] until they lie within (GridSample)."""
    rng = hi - lo
    if rng <= 0:
        return xp.zeros_like(v) + lo
    below = v < lo
    dx = xp.where(below, lo - v, v - hi)
    n = xp.floor(dx / rng)
    r = dx - n * rng
    even = xp.remainder(n, 2) == 0
    ref_below = xp.where(even, lo + r, hi - r)
    ref_above = xp.where(even, hi - r, lo + r)
    return xp.where(below, ref_below, xp.where(v > hi, ref_above, v))


def cubic_coeffs(xp, t, A: float):
    """Keys cubic convolution weights of the 4 taps at offsets -1, 0, 1, 2 for fraction ``t``."""
    t1 = t + 1
    s = 1 - t
    s1 = s + 1
    return [
        ((A * t1 - 5 * A) * t1 + 8 * A) * t1 - 4 * A,
        ((A + 2) * t - (A + 3)) * t * t + 1,
        ((A + 2) * s - (A + 3)) * s * s + 1,
        ((A * s1 - 5 * A) * s1 + 8 * A) * s1 - 4 * A,
    ]


# ---------------------------------------------------------------- Resize (separable, per axis)


def _source_coords(xp, ctm: str, out_len: int, in_len: int, scale: float, roi):
    """Source coordinate of every output index along one axis (float64), and for
    tf_crop_and_resize a mask of the positions to extrapolate (else None)."""
    y = xp.arange(out_len, dtype=xp.float64)
    out_w = scale * in_len
    mask = None
    if ctm == "align_corners":
        x = y * 0.0 if out_w == 1 else y * ((in_len - 1) / (out_w - 1))
    elif ctm == "asymmetric":
        x = y / scale
    elif ctm == "tf_crop_and_resize":
        r0, r1 = roi
        if out_w == 1:
            x = y * 0.0 + (r1 - r0) * (in_len - 1) / 2
        else:
            x = y * ((r1 - r0) * (in_len - 1) / (out_w - 1))
        x = x + r0 * (in_len - 1)
        mask = (x < 0) | (x > in_len - 1)
    elif ctm == "pytorch_half_pixel":
        x = y * 0.0 - 0.5 if out_w == 1 else (y + 0.5) / scale - 0.5
    elif ctm == "half_pixel":
        x = (y + 0.5) / scale - 0.5
    elif ctm == "tf_half_pixel_for_nn":  # Resize-11/12 only
        x = (y + 0.5) / scale
    elif ctm == "half_pixel_symmetric":
        offset = (in_len / 2) * (1 - out_len / out_w)
        x = offset + (y + 0.5) / scale - 0.5
    else:
        raise ValueError(f"coordinate_transformation_mode {ctm!r} is not supported")
    return x, mask


def _tap_coeffs(xp, mode: str, ratio, scale: float, *, nearest_mode: str, cubic_a: float, antialias: bool):
    """The weights of each tap (a list of arrays over output positions), ratio in (0, 1]."""
    if mode == "nearest":
        if nearest_mode == "round_prefer_floor":
            up = ratio > 0.5
        elif nearest_mode == "round_prefer_ceil":
            up = ratio >= 0.5
        elif nearest_mode == "floor":
            up = ratio < 0  # never
        elif nearest_mode == "ceil":
            up = ratio >= 0  # always
        else:
            raise ValueError(f"nearest_mode {nearest_mode!r} is not supported")
        up = up | (ratio == 1)
        return [~up, up]
    if mode == "linear" and not antialias:
        return [1 - ratio, ratio]
    if mode == "cubic" and not antialias:
        return cubic_coeffs(xp, ratio, cubic_a)
    s = min(scale, 1.0)
    if mode == "linear":
        start = int(np.floor(-1 / s) + 1)
        taps = [xp.clip(1 - xp.abs((i - ratio) * s), 0, 1) for i in range(start, 2 - start)]
    elif mode == "cubic":
        A = cubic_a
        start = int(np.floor(-2 / s) + 1)
        taps = []
        for i in range(start, 2 - start):
            t = xp.abs((i - ratio) * s)
            t2, t3 = t * t, t * t * t
            near = (A + 2) * t3 - (A + 3) * t2 + 1
            far = A * t3 - 5 * A * t2 + 8 * A * t - 4 * A
            taps.append(xp.where(t <= 1, near, xp.where(t < 2, far, 0.0)))
    else:
        raise ValueError(f"mode {mode!r} is not supported")
    total = taps[0]
    for t in taps[1:]:
        total = total + t
    return [t / total for t in taps]


def resize_axis(xp, data, axis: int, out_len: int, scale: float, *, ctm: str, mode: str, roi=None,
                nearest_mode: str = "round_prefer_floor", cubic_a: float = -0.75,
                exclude_outside: bool = False, extrapolation: float = 0.0, antialias: bool = False):
    """Resample ``data`` along ``axis`` to ``out_len`` points (ONNX Resize, one axis)."""
    in_len = data.shape[axis]
    if out_len == 0 or in_len == 0:
        shape = list(data.shape)
        shape[axis] = out_len
        return xp.zeros(tuple(shape), dtype=data.dtype)
    x, mask = _source_coords(xp, ctm, out_len, in_len, scale, roi)
    xi = xp.floor(x)
    ratio = xp.where(x == xi, 1.0, x - xi)
    coeffs = _tap_coeffs(xp, mode, ratio, scale, nearest_mode=nearest_mode, cubic_a=cubic_a,
                         antialias=antialias)
    n = len(coeffs)
    # the n source indices closest to x (ties to the smaller), as ONNX's reference picks them
    pw = -(-n // 2)
    xpad = x + pw
    p = xp.floor(xpad)
    frac = xpad - p
    if n % 2 == 0:
        off = xp.where(frac == 0, -(n // 2), -(n // 2) + 1)
    else:
        base = -((n - 1) // 2)
        off = xp.where(frac <= 0.5, base, base + 1)
    start = (p + off).astype(xp.int64) - pw
    idx = [start + k for k in range(n)]
    bshape = [1] * data.ndim
    bshape[axis] = out_len
    if mode == "nearest":
        pick = xp.where(coeffs[1], idx[1], idx[0])
        res = xp.take(data, xp.clip(pick, 0, in_len - 1), axis=axis)
    else:
        if exclude_outside:
            coeffs = [xp.where((i < 0) | (i >= in_len), 0.0, c) for i, c in zip(idx, coeffs)]
            total = coeffs[0]
            for c in coeffs[1:]:
                total = total + c
            total = xp.where(total == 0, 1.0, total)
            coeffs = [c / total for c in coeffs]
        res = None
        for i, c in zip(idx, coeffs):
            term = xp.take(data, xp.clip(i, 0, in_len - 1), axis=axis) * c.astype(data.dtype).reshape(bshape)
            res = term if res is None else res + term
    if mask is not None:
        res = xp.where(mask.reshape(bshape), extrapolation, res).astype(res.dtype, copy=False)
    return res


# ---------------------------------------------------------------- GridSample


def grid_sample(xp, x, grid, *, mode: str, padding_mode: str, align_corners: bool):
    """ONNX GridSample for any number of spatial dims (x: (N, C, *D), grid: (N, *O, nd))."""
    N, C = x.shape[0], x.shape[1]
    dims = list(x.shape[2:])
    nd = len(dims)
    out_sp = tuple(grid.shape[1:-1])
    P = int(np.prod(out_sp)) if out_sp else 1
    S = int(np.prod(dims)) if dims else 1
    work = float_work(x.dtype)
    cdt = float_work(grid.dtype)
    g = grid.astype(cdt, copy=False).reshape(N, P, nd)
    taps_per_dim = []  # per spatial dim: list of (index (N, P) int64, weight (N, P), valid (N, P))
    for i, L in enumerate(dims):
        n = g[:, :, nd - 1 - i]
        if align_corners:
            c = (n + 1) / 2 * (L - 1)
            lo, hi = 0.0, L - 1.0
        else:
            c = ((n + 1) * L - 1) / 2
            lo, hi = -0.5, L - 0.5
        c = c.astype(cdt, copy=False)
        if mode == "nearest":
            c = xp.rint(c)
        out = (c < lo) | (c > hi)
        if padding_mode == "border":
            c = xp.where(out, xp.clip(c, 0, L - 1), c)
        elif padding_mode == "reflection":
            c = xp.where(out, reflect(xp, c, lo, hi), c)
        if mode == "nearest":
            base = xp.trunc(c)
            offs, weights = [0], [None]
        else:
            base = xp.floor(c)
            t = c - base
            if mode == "linear":
                offs, weights = [0, 1], [1 - t, t]
            else:
                offs, weights = [-1, 0, 1, 2], cubic_coeffs(xp, t, -0.75)
        base = base.astype(xp.int64)
        taps = []
        for o, w in zip(offs, weights):
            j = base + o
            if padding_mode == "zeros":
                valid = (j >= 0) & (j < L)
            else:
                valid = None
                if padding_mode == "reflection":
                    j = xp.trunc(reflect(xp, j.astype(cdt), lo, hi)).astype(xp.int64)
            taps.append((xp.clip(j, 0, L - 1), w, valid))
        taps_per_dim.append(taps)
    xf = x.astype(work, copy=False).reshape(N, C, S)
    acc = xp.zeros((N, C, P), dtype=work)
    strides = [int(np.prod(dims[i + 1:])) for i in range(nd)]
    for combo in itertools.product(*taps_per_dim):
        flat = None
        weight = None
        valid = None
        for (j, w, v), st in zip(combo, strides):
            flat = j * st if flat is None else flat + j * st
            if w is not None:
                weight = w if weight is None else weight * w
            if v is not None:
                valid = v if valid is None else valid & v
        vals = xp.take_along_axis(xf, xp.broadcast_to(flat[:, None, :], (N, C, P)), axis=2)
        if weight is not None:
            vals = vals * weight.astype(work)[:, None, :]
        if valid is not None:
            vals = xp.where(valid[:, None, :], vals, 0)
        acc = acc + vals
    return acc.reshape((N, C) + out_sp).astype(x.dtype)


def affine_grid(xp, theta, sp, align: bool):
    """ONNX AffineGrid: theta (N, nd, nd+1) applied to the normalized base grid of spatial size sp."""
    nd = len(sp)
    work = float_work(theta.dtype)
    th = theta.astype(work, copy=False)
    base = []  # coordinate along the last spatial dim first (x, y, z)
    for i in reversed(range(nd)):
        L = sp[i]
        a = xp.arange(L, dtype=work)
        if align:
            a = a * (2.0 / (L - 1)) - 1 if L > 1 else a * 0 - 1
        else:
            a = (a * 2 + 1) / L - 1
        shape = [1] * nd
        shape[i] = L
        base.append(a.reshape(shape))
    comps = []
    for j in range(nd):
        t = th[:, j].reshape((th.shape[0],) + (1,) * nd + (nd + 1,))
        v = t[..., nd]
        for k in range(nd):
            v = v + t[..., k] * base[k]
        comps.append(v)
    return xp.stack(comps, axis=-1).astype(theta.dtype)
