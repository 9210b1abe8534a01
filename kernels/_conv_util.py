"""Shared plumbing of the convolution / pooling / resampling / spectral kernels (``ops_conv``,
``ops_resize``, ``ops_signal``; ``ops_linalg``'s Det).

Host-side helpers (geometry: output sizes and pads from attributes) use plain Python / numpy on
attributes only. The ``xp`` helpers are numpy/CuPy generic: windows are gathered with constant
``xp.pad`` and strided slices (one per kernel offset), and every matrix product goes through
``_linalg.matmul`` — never ``xp.matmul``/``dot``/``einsum``/``tensordot``.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence
from typing import Any

import numpy as np

from ._op import NodeInfo, Spec

__all__ = [
    "Geometry",
    "affine_grid",
    "conv_nd",
    "conv_transpose_nd",
    "convt_geometry",
    "det_lu",
    "dft_last",
    "float_work",
    "geometry",
    "grid_sample",
    "host_vals",
    "need_spatial",
    "pad_value_min",
    "resize_axis",
    "spatial_attrs",
    "specs_of",
    "windows",
]


def float_work(dtype: Any) -> np.dtype:
    """The dtype sums are accumulated in: float32 for 16-bit floats, else the dtype itself."""
    dt = np.dtype(dtype)
    if dt.kind == "f" and dt.itemsize < 4 or dt.name == "bfloat16":
        return np.dtype(np.float32)
    return dt


def pad_value_min(dtype: Any) -> Any:
    """The padding value neutral for max: -inf for floats, the type's minimum for integers."""
    dt = np.dtype(dtype)
    if dt.kind in "iu":
        return int(np.iinfo(dt).min)
    if dt.kind == "b":
        return False
    return -np.inf


def _ints(node: NodeInfo, key: str, n: int, default: int) -> list[int]:
    v = node.attr(key)
    if v is None or (isinstance(v, (list, tuple)) and len(v) == 0):
        return [default] * n
    v = [int(a) for a in v]
    if len(v) != n:
        raise node.error(f"attribute {key} has {len(v)} values, {n} expected")
    return v


def spatial_attrs(node: NodeInfo, nsp: int, kernel: Sequence[int] | None = None):
    """(kernel_shape, strides, dilations, pads) from attributes; pads as [begins..., ends...]."""
    if kernel is None:
        k = node.attr("kernel_shape")
        if not k:
            raise node.error("attribute kernel_shape is required")
        kernel = [int(a) for a in k]
    elif node.attr("kernel_shape"):
        ks = [int(a) for a in node.attr("kernel_shape")]
        if ks != list(kernel):
            raise node.error(f"kernel_shape {ks} does not match the weights' spatial shape {list(kernel)}")
    if len(kernel) != nsp:
        raise node.error(f"kernel_shape {list(kernel)} has rank {len(kernel)}, input has {nsp} spatial dims")
    strides = _ints(node, "strides", nsp, 1)
    dilations = _ints(node, "dilations", nsp, 1)
    pads = _ints(node, "pads", 2 * nsp, 0)
    if any(s <= 0 for s in strides) or any(d <= 0 for d in dilations) or any(k <= 0 for k in kernel):
        raise node.error(f"kernel_shape {list(kernel)}, strides {strides} and dilations {dilations} must be positive")
    if any(p < 0 for p in pads):
        raise node.error(f"pads {pads} must be non-negative")
    return list(kernel), strides, dilations, pads


class Geometry:
    """Output spatial sizes and begin/end pads of a windowed op (conv or pool)."""

    def __init__(self, kernel, strides, dilations, begin, end, out):
        self.kernel, self.strides, self.dilations = list(kernel), list(strides), list(dilations)
        self.begin, self.end, self.out = list(begin), list(end), list(out)


def _window_fits(node: NodeInfo, kernel, eff: int, padded: int, stride: int, axis: int) -> None:
    """ONNX's output size ``(padded - eff) // stride + 1`` must not be negative (a window far larger
    than the padded input; ONNX Runtime refuses it too). Zero is kept: an empty output."""
    if (padded - eff) // stride + 1 < 0:
        raise node.error(f"kernel_shape {kernel} (dilated window {eff}) is larger than the padded input "
                         f"({padded}) on spatial axis {axis}: the output size would be negative")


def geometry(node: NodeInfo, in_sp: Sequence[int], kernel=None, *, ceil_mode: bool = False) -> Geometry:
    nsp = len(in_sp)
    kernel, strides, dilations, pads = spatial_attrs(node, nsp, kernel)
    auto_pad = node.attr("auto_pad", "NOTSET") or "NOTSET"
    begin, end, out = [], [], []
    for i, n in enumerate(in_sp):
        eff = (kernel[i] - 1) * dilations[i] + 1
        s = strides[i]
        if auto_pad in ("SAME_UPPER", "SAME_LOWER"):
            o = -(-n // s)
            total = max(0, (o - 1) * s + eff - n)
            small = total // 2
            b = small if auto_pad == "SAME_UPPER" else total - small
            e = total - b
        elif auto_pad == "VALID":
            b = e = 0
            _window_fits(node, kernel, eff, n, s, i)
            o = (n - eff) // s + 1 if n >= eff else 0
        elif auto_pad == "NOTSET":
            b, e = pads[i], pads[i + nsp]
            span = n + b + e - eff
            _window_fits(node, kernel, eff, n + b + e, s, i)
            if span < 0:
                o = 0
            elif ceil_mode:
                o = -(-span // s) + 1
                if (o - 1) * s >= n + b:  # the last window must start inside the input or its begin pad
                    o -= 1
            else:
                o = span // s + 1
        else:
            raise node.error(f"auto_pad {auto_pad!r} is not one of NOTSET, SAME_UPPER, SAME_LOWER, VALID")
        begin.append(b)
        end.append(e)
        out.append(max(o, 0))
    return Geometry(kernel, strides, dilations, begin, end, out)


def windows(xp, x, g: Geometry, value: Any = 0, *, end_value: Any = None):
    """The sliding windows of ``x`` (..., *spatial): an array (..., K, *out) with K = prod(kernel).

    ``x`` is padded with ``value`` by the geometry's pads, and (when the last windows reach past
    the end pad, ceil_mode) further with ``end_value`` (default ``value``)."""
    nsp = len(g.kernel)
    lead = tuple(x.shape[: x.ndim - nsp])
    K = int(np.prod(g.kernel))
    if any(o == 0 for o in g.out):
        return xp.zeros(lead + (K, *g.out), dtype=x.dtype)
    in_sp = x.shape[x.ndim - nsp:]
    pad = [(0, 0)] * len(lead)
    extra = []
    for i in range(nsp):
        need = (g.out[i] - 1) * g.strides[i] + (g.kernel[i] - 1) * g.dilations[i] + 1
        extra.append(max(0, need - in_sp[i] - g.begin[i] - g.end[i]))
        pad.append((g.begin[i], g.end[i]))
    if any(b or e for b, e in pad):
        x = xp.pad(x, pad, mode="constant", constant_values=value)
    if any(extra):
        ev = value if end_value is None else end_value
        x = xp.pad(x, [(0, 0)] * len(lead) + [(0, e) for e in extra], mode="constant", constant_values=ev)
    pre = (slice(None),) * len(lead)
    parts = []
    for offs in itertools.product(*[range(k) for k in g.kernel]):
        sl = tuple(
            slice(o * d, o * d + (n - 1) * s + 1, s)
            for o, d, n, s in zip(offs, g.dilations, g.out, g.strides)
        )
        parts.append(x[pre + sl])
    return xp.stack(parts, axis=len(lead))


def windows_bytes(lead: int, in_sp: Sequence[int], g: Geometry, itemsize: int = 8) -> int:
    """An upper estimate of the temporaries of ``windows`` over ``lead`` leading elements (Python
    ints): the padded input and the stacked windows, twice (a caller's elementwise pass over them)."""
    padded = 1
    for i, n in enumerate(in_sp):
        need = (g.out[i] - 1) * g.strides[i] + (g.kernel[i] - 1) * g.dilations[i] + 1 if g.out[i] else 0
        padded *= max(n + g.begin[i] + g.end[i], need)
    return 2 * lead * (padded + math.prod(g.kernel) * math.prod(g.out)) * itemsize


def dft_bytes(batch: int, length: int, bins: int) -> int:
    """An upper estimate of ``dft_last``'s temporaries (Python ints): the (length, bins) index,
    angle, cosine and sine matrices, and float64 copies and results of ``batch`` rows."""
    return 4 * length * bins * 8 + 4 * batch * (length + bins) * 8


def conv_nd(xp, x, w, b, g: Geometry, group: int):
    """Grouped N-d convolution: im2col windows, then one batched ``_linalg.matmul``."""
    from ._linalg import matmul

    N, C = x.shape[0], x.shape[1]
    M = w.shape[0]
    K = int(np.prod(g.kernel))
    P = int(np.prod(g.out))
    cols = windows(xp, x, g, 0)  # (N, C, K, *out)
    cols = cols.reshape(N, group, (C // group) * K, P)
    wm = w.reshape(1, group, M // group, (C // group) * K)
    y = matmul(xp, wm, cols)  # (N, group, M/group, P)
    y = y.reshape((N, M) + tuple(g.out))
    if b is not None:
        y = y + b.reshape((1, M) + (1,) * len(g.out)).astype(y.dtype)
    return y.astype(x.dtype, copy=False)


def convt_geometry(node: NodeInfo, in_sp: Sequence[int], kernel: Sequence[int]):
    """(strides, dilations, begin pads, output sizes) of a ConvTranspose."""
    nsp = len(in_sp)
    kernel, strides, dilations, pads = spatial_attrs(node, nsp, kernel)
    out_pad = _ints(node, "output_padding", nsp, 0)
    auto_pad = node.attr("auto_pad", "NOTSET") or "NOTSET"
    if auto_pad not in ("NOTSET", "SAME_UPPER", "SAME_LOWER", "VALID"):
        raise node.error(f"auto_pad {auto_pad!r} is not one of NOTSET, SAME_UPPER, SAME_LOWER, VALID")
    out_shape = node.attr("output_shape")
    out_shape = [int(a) for a in out_shape][-nsp:] if out_shape else None
    if out_shape is not None and len(out_shape) != nsp:
        raise node.error(f"output_shape {out_shape} does not have {nsp} spatial dims")
    has_pads = bool(node.attr("pads")) and auto_pad == "NOTSET"
    begin, out = [], []
    for i, n in enumerate(in_sp):
        natural = strides[i] * (n - 1) + out_pad[i] + (kernel[i] - 1) * dilations[i] + 1
        if out_shape is not None and has_pads:
            b, o = pads[i], out_shape[i]
        elif out_shape is not None or auto_pad in ("SAME_UPPER", "SAME_LOWER"):
            o = out_shape[i] if out_shape is not None else n * strides[i]
            total = max(0, natural - o)  # as onnxruntime: never negative (extra size is zero-filled at the end)
            b = total // 2 if auto_pad == "SAME_UPPER" else total - total // 2
        else:
            if auto_pad == "VALID":
                pads = [0] * (2 * nsp)
            b = pads[i]
            o = natural - pads[i] - pads[i + nsp]
        if o < 0:
            raise node.error(f"ConvTranspose output size {o} along spatial dim {i} is negative")
        begin.append(b)
        out.append(o)
    return strides, dilations, begin, out


def conv_transpose_nd(xp, x, w, b, strides, dilations, begin, out, group: int):
    """Grouped N-d transposed convolution: one batched ``_linalg.matmul`` then col2im by strided adds."""
    from ._linalg import matmul

    N, C = x.shape[0], x.shape[1]
    in_sp = tuple(x.shape[2:])
    kernel = tuple(w.shape[2:])
    Mg = w.shape[1]
    M = Mg * group
    K = int(np.prod(kernel))
    I = int(np.prod(in_sp)) if in_sp else 1
    nsp = len(in_sp)
    xm = x.reshape(N, group, C // group, I)
    wm = xp.swapaxes(w.reshape(group, C // group, Mg * K), 1, 2).reshape(1, group, Mg * K, C // group)
    cols = matmul(xp, wm, xm).reshape((N, M, K) + in_sp)  # (N, M, K, *in)
    work = float_work(x.dtype)
    lead, size = [], []
    for i in range(nsp):
        natural = (in_sp[i] - 1) * strides[i] + (kernel[i] - 1) * dilations[i] + 1
        l0 = max(0, -begin[i])
        lead.append(l0)
        size.append(l0 + max(natural, begin[i] + out[i]))
    buf = xp.zeros((N, M) + tuple(size), dtype=work)
    pre = (slice(None), slice(None))
    for k, offs in enumerate(itertools.product(*[range(n) for n in kernel])):
        sl = tuple(
            slice(l0 + o * d, l0 + o * d + (n - 1) * s + 1, s)
            for l0, o, d, n, s in zip(lead, offs, dilations, in_sp, strides)
        )
        buf[pre + sl] += cols[:, :, k].astype(work, copy=False)
    crop = tuple(slice(l0 + bg, l0 + bg + o) for l0, bg, o in zip(lead, begin, out))
    y = buf[pre + crop]
    if b is not None:
        y = y + b.reshape((1, M) + (1,) * nsp).astype(work)
    return y.astype(x.dtype)


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


# ---------------------------------------------------------------- DFT, Det


def _fit(xp, a, n):
    """Truncate or zero-pad the last axis of ``a`` to ``n``."""
    m = a.shape[-1]
    if m >= n:
        return a[..., :n]
    return xp.pad(a, [(0, 0)] * (a.ndim - 1) + [(0, n - m)], mode="constant")


def dft_last(xp, xr, xi, length, inverse, onesided):
    """DFT along the last axis of (xr, xi) (xi may be None) -> (re, im) float64; im None for irfft."""
    from ._linalg import matmul

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


def det_lu(xp, x):
    """LU with partial pivoting, batched, a Python loop over the (static) matrix size."""
    n = x.shape[-1]
    batch = x.shape[:-2]
    a = x.astype(xp.float64).reshape((-1, n, n))
    B = a.shape[0]
    det = xp.ones((B,), dtype=xp.float64)
    rows = xp.arange(n, dtype=xp.int64)[None, :]
    for k in range(n):
        p = xp.argmax(xp.abs(a[:, k:, k]), axis=1).astype(xp.int64)[:, None] + k  # (B, 1)
        perm = xp.where(rows == k, p, xp.where(rows == p, k, rows))
        a = xp.take_along_axis(a, xp.broadcast_to(perm[:, :, None], (B, n, n)), axis=1)
        det = xp.where(p[:, 0] != k, -det, det)
        piv = a[:, k, k]
        det = det * piv
        if k + 1 < n:
            safe = xp.where(piv == 0, 1.0, piv)
            factor = a[:, k + 1:, k] / safe[:, None]
            a[:, k + 1:, :] = a[:, k + 1:, :] - factor[:, :, None] * a[:, k:k + 1, :]
    return det.reshape(batch).astype(x.dtype)


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



# -- shared by the conv, resize and signal op modules ------------------------------------------

def need_spatial(node, x: Spec, what: str = "X", nonempty: bool = False) -> int:
    """The spatial rank of ``x`` (N, C, spatial...); ``nonempty``: each spatial dim must be positive
    (an op that samples or reduces over them has nothing to read otherwise; ONNX Runtime refuses it too)."""
    if x.rank < 3:
        raise node.error(f"{what} must have rank >= 3 (N, C, spatial...), got shape {x.shape}")
    if nonempty and any(d == 0 for d in x.shape[2:]):
        raise node.error(f"{what} shape {x.shape}: every spatial dim must be positive for {node.op_type}")
    return x.rank - 2


def specs_of(node, arrays):
    """Specs as shapes() saw them, rebuilt in compute: host values from ``node.host``."""
    out = []
    for i, a in enumerate(arrays):
        if a is None:
            out.append(None)
        else:
            h = node.host.get(i)
            out.append(Spec(tuple(a.shape), a.dtype, h))
    return out


def host_vals(node, specs, i):
    """The host value of optional input ``i`` as a flat float64 array, or None if absent/empty."""
    if len(specs) <= i or specs[i] is None:
        return None
    v = np.asarray(specs[i].value).reshape(-1)
    return v if v.size else None
