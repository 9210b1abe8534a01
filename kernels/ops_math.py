"""math ops: convolution, pooling, LRN, resampling (Resize/Upsample/GridSample/AffineGrid),
spectral ops (DFT/STFT/windows/MelWeightMatrix) and Det.

Windowed ops gather their windows with constant ``xp.pad`` and strided slices
(``_conv_util.windows``); every matrix product goes through ``_linalg.matmul``.
"""

from __future__ import annotations

import math

import numpy as np

from ._conv_util import (
    affine_grid,
    conv_nd,
    conv_transpose_nd,
    convt_geometry,
    det_lu,
    dft_bytes,
    dft_last,
    float_work,
    geometry,
    grid_sample,
    pad_value_min,
    resize_axis,
    windows,
    windows_bytes,
)
from ._latch import IndexCheck
from ._op import OpKernel, Spec

__all__ = ["OPS"]


def _need_spatial(node, x: Spec, what: str = "X", nonempty: bool = False) -> int:
    """The spatial rank of ``x`` (N, C, spatial...); ``nonempty``: each spatial dim must be positive
    (an op that samples or reduces over them has nothing to read otherwise; ONNX Runtime refuses it too)."""
    if x.rank < 3:
        raise node.error(f"{what} must have rank >= 3 (N, C, spatial...), got shape {x.shape}")
    if nonempty and any(d == 0 for d in x.shape[2:]):
        raise node.error(f"{what} shape {x.shape}: every spatial dim must be positive for {node.op_type}")
    return x.rank - 2


def _specs_of(node, arrays):
    """Specs as shapes() saw them, rebuilt in compute: host values from ``node.host``."""
    out = []
    for i, a in enumerate(arrays):
        if a is None:
            out.append(None)
        else:
            h = node.host.get(i)
            out.append(Spec(tuple(a.shape), a.dtype, h))
    return out


# ---------------------------------------------------------------- Conv / ConvTranspose


def _group(node, C: int, M: int, cin_w: int) -> int:
    group = int(node.attr("group", 1))
    if group <= 0 or C % group or M % group:
        raise node.error(f"group {group} does not divide channels (input {C}, output {M})")
    if C // group != cin_w:
        raise node.error(f"input has {C} channels, weights expect {cin_w} x group {group}")
    return group


def _conv_shapes(node, specs):
    x, w, b = specs[0], specs[1], specs[2] if len(specs) > 2 else None
    _need_spatial(node, x, nonempty=True)
    if w.rank != x.rank:
        raise node.error(f"W rank {w.rank} does not match X rank {x.rank}")
    _group(node, x.shape[1], w.shape[0], w.shape[1])
    if b is not None and tuple(b.shape) != (w.shape[0],):
        raise node.error(f"B must have shape ({w.shape[0]},), got {b.shape}")
    g = geometry(node, x.shape[2:], list(w.shape[2:]))
    return [Spec((x.shape[0], w.shape[0], *g.out), x.dtype)]


def _conv_compute(xp, node, x, w, b=None):
    g = geometry(node, x.shape[2:], list(w.shape[2:]))
    return (conv_nd(xp, x, w, b, g, int(node.attr("group", 1))),)


def _conv_workspace(node, specs):
    x, w = specs[0], specs[1]
    g = geometry(node, x.shape[2:], list(w.shape[2:]))
    return windows_bytes(x.shape[0] * x.shape[1], x.shape[2:], g) + 2 * x.shape[0] * w.shape[0] * math.prod(g.out) * 8


def _convt_shapes(node, specs):
    x, w, b = specs[0], specs[1], specs[2] if len(specs) > 2 else None
    _need_spatial(node, x, nonempty=True)
    if w.rank != x.rank:
        raise node.error(f"W rank {w.rank} does not match X rank {x.rank}")
    group = int(node.attr("group", 1))
    if group <= 0 or x.shape[1] % group or w.shape[0] != x.shape[1]:
        raise node.error(f"W's first dim {w.shape[0]} must equal X's channels {x.shape[1]}, divisible by group {group}")
    M = w.shape[1] * group
    if b is not None and tuple(b.shape) != (M,):
        raise node.error(f"B must have shape ({M},), got {b.shape}")
    _, _, _, out = convt_geometry(node, x.shape[2:], list(w.shape[2:]))
    return [Spec((x.shape[0], M, *out), x.dtype)]


def _convt_workspace(node, specs):
    x, w = specs[0], specs[1]
    kernel = list(w.shape[2:])
    strides, dilations, begin, out = convt_geometry(node, x.shape[2:], kernel)
    nm = x.shape[0] * w.shape[1] * int(node.attr("group", 1))
    size = 1
    for i, n in enumerate(x.shape[2:]):
        natural = (n - 1) * strides[i] + (kernel[i] - 1) * dilations[i] + 1
        size *= max(0, -begin[i]) + max(natural, begin[i] + out[i])
    return 2 * nm * (math.prod(kernel) * math.prod(x.shape[2:]) + size) * 8


def _convt_compute(xp, node, x, w, b=None):
    strides, dilations, begin, out = convt_geometry(node, x.shape[2:], list(w.shape[2:]))
    return (conv_transpose_nd(xp, x, w, b, strides, dilations, begin, out, int(node.attr("group", 1))),)


# ---------------------------------------------------------------- pooling


def _pool_geometry(node, x_shape):
    ceil = bool(node.attr("ceil_mode", 0))
    return geometry(node, x_shape[2:], None, ceil_mode=ceil)


def _pool_shapes(node, specs):
    x = specs[0]
    _need_spatial(node, x)
    g = _pool_geometry(node, x.shape)
    out = [Spec((x.shape[0], x.shape[1], *g.out), x.dtype)]
    if node.op_type == "MaxPool" and node.n_outputs > 1:
        out.append(Spec(out[0].shape, np.dtype(np.int64)))
    return out


def _pool_workspace(node, specs):
    x = specs[0]
    g = _pool_geometry(node, x.shape)
    return windows_bytes(x.shape[0] * x.shape[1] + 1, x.shape[2:], g)  # + 1: AveragePool's window counts


def _maxpool_compute(xp, node, x):
    g = _pool_geometry(node, x.shape)
    nsp = len(g.kernel)
    win = windows(xp, x, g, pad_value_min(x.dtype))  # (N, C, K, *out)
    y = win.max(axis=2) if win.shape[2] else xp.zeros(win.shape[:2] + win.shape[3:], x.dtype)
    if node.n_outputs < 2:
        return (y,)
    # Indices: flat position of the (first) maximum in the whole input tensor
    am = xp.argmax(win, axis=2).astype(xp.int64)  # kernel offset, row-major over kernel dims
    sp = list(x.shape[2:])
    col_major = int(node.attr("storage_order", 0)) == 1
    flat = xp.zeros(am.shape, dtype=xp.int64)
    kstride = 1
    for i in reversed(range(nsp)):
        o_i = (am // kstride) % g.kernel[i]
        kstride *= g.kernel[i]
        shape = [1] * (nsp + 2)
        shape[2 + i] = g.out[i]
        base = (xp.arange(g.out[i], dtype=xp.int64) * g.strides[i] - g.begin[i]).reshape(shape)
        h = base + o_i * g.dilations[i]
        mult = int(np.prod(sp[:i])) if col_major else int(np.prod(sp[i + 1:]))
        flat = flat + h * mult
    nc = (xp.arange(x.shape[0] * x.shape[1], dtype=xp.int64) * int(np.prod(sp))).reshape(
        (x.shape[0], x.shape[1]) + (1,) * nsp)
    return y, flat + nc


def _window_count(xp, in_sp, g, include_pad: bool, dtype):
    ones = xp.ones(tuple(in_sp), dtype=dtype)
    win = windows(xp, ones, g, 1 if include_pad else 0, end_value=0)  # (K, *out)
    return win.sum(axis=0)


def _avgpool_compute(xp, node, x):
    g = _pool_geometry(node, x.shape)
    work = float_work(x.dtype)
    xw = x.astype(work, copy=False)
    s = windows(xp, xw, g, 0).sum(axis=2)
    n = _window_count(xp, x.shape[2:], g, bool(node.attr("count_include_pad", 0)), work)
    return ((s / xp.maximum(n, 1)).astype(x.dtype),)


def _lp_p(node) -> float:
    p = node.attr("p", 2)
    return float(p)


def _lppool_compute(xp, node, x):
    g = _pool_geometry(node, x.shape)
    p = _lp_p(node)
    work = float_work(x.dtype)
    a = xp.abs(x.astype(work, copy=False))
    s = xp.power(windows(xp, a, g, 0), p).sum(axis=2)
    return (xp.power(s, 1.0 / p).astype(x.dtype),)


def _global_shapes(node, specs):
    x = specs[0]
    _need_spatial(node, x, nonempty=node.op_type == "GlobalMaxPool")  # (a max over no elements has no value)
    return [Spec((x.shape[0], x.shape[1]) + (1,) * (x.rank - 2), x.dtype)]


def _global_axes(x):
    return tuple(range(2, x.ndim))


def _gap_compute(xp, node, x):
    work = float_work(x.dtype)
    return (x.astype(work, copy=False).mean(axis=_global_axes(x), keepdims=True).astype(x.dtype),)


def _gmp_compute(xp, node, x):
    return (x.max(axis=_global_axes(x), keepdims=True),)


def _glp_compute(xp, node, x):
    p = _lp_p(node)
    work = float_work(x.dtype)
    s = xp.power(xp.abs(x.astype(work, copy=False)), p).sum(axis=_global_axes(x), keepdims=True)
    return (xp.power(s, 1.0 / p).astype(x.dtype),)


# ---------------------------------------------------------------- MaxUnpool, LRN


def _unpool_inferred(node, x_shape):
    nsp = len(x_shape) - 2
    k = node.attr("kernel_shape")
    if not k or len(k) != nsp:
        raise node.error("attribute kernel_shape is required and must match the spatial rank")
    strides = list(node.attr("strides") or [1] * nsp)
    pads = list(node.attr("pads") or [0] * (2 * nsp))
    sp = [(x_shape[2 + i] - 1) * strides[i] - (pads[i] + pads[nsp + i]) + int(k[i]) for i in range(nsp)]
    if any(d < 0 for d in sp):
        raise node.error(f"inferred output spatial shape {sp} is negative")
    return (x_shape[0], x_shape[1], *sp)


def _unpool_shapes(node, specs):
    x = specs[0]
    _need_spatial(node, x)
    if tuple(specs[1].shape) != tuple(x.shape):
        raise node.error(f"I shape {specs[1].shape} must equal X shape {x.shape}")
    shape = _unpool_inferred(node, x.shape)
    if len(specs) > 2 and specs[2] is not None:
        shape = tuple(int(d) for d in np.asarray(specs[2].value).reshape(-1))
        if len(shape) != x.rank or any(d < 0 for d in shape):
            raise node.error(f"output_shape {list(shape)} must be {x.rank} non-negative dims")
    return [Spec(shape, x.dtype)]


def _unpool_compute(xp, node, x, ind, out_shape=None):
    # Indices are flat positions in the shape inferred from the attributes (as ONNX's reference
    # and its node cases do); an explicit output_shape then pads (or crops) that at the end.
    inferred = _unpool_inferred(node, x.shape)
    shape = node.out_specs[0].shape
    total = int(np.prod(inferred))
    y = xp.zeros((total,), dtype=x.dtype)
    if x.size and total:
        y[xp.clip(ind.reshape(-1).astype(xp.int64), 0, total - 1)] = x.reshape(-1)
    y = y.reshape(inferred)
    if tuple(shape) != tuple(inferred):
        y = y[tuple(slice(0, min(a, b)) for a, b in zip(inferred, shape))]
        y = xp.pad(y, [(0, max(0, b - a)) for a, b in zip(y.shape, shape)], mode="constant")
    return (y,)


def _unpool_check(node, specs):
    """Indices are flat positions in the inferred output: [0, its size) (flagged into the error latch)."""
    return [IndexCheck(1, 0, int(np.prod(_unpool_inferred(node, specs[0].shape), dtype=np.int64)))]


def _lrn_shapes(node, specs):
    x = specs[0]
    if x.rank < 3:
        raise node.error(f"X must have rank >= 3, got shape {x.shape}")
    if node.attr("size") is None or int(node.attr("size")) <= 0:
        raise node.error("attribute size is required and must be positive")
    return [Spec(x.shape, x.dtype)]


def _lrn_compute(xp, node, x):
    size = int(node.attr("size"))
    alpha = float(node.attr("alpha", 1e-4))
    beta = float(node.attr("beta", 0.75))
    bias = float(node.attr("bias", 1.0))
    work = float_work(x.dtype)
    xw = x.astype(work, copy=False)
    sq = xw * xw
    C = x.shape[1]
    # The window [c - c1, c + c2], clipped to the channels: a size beyond C adds only zeros.
    c1 = min((size - 1) // 2, max(C - 1, 0))
    c2 = min(size - 1 - (size - 1) // 2, max(C - 1, 0))
    pad = [(0, 0)] * x.ndim
    pad[1] = (c1, c2)
    sqp = xp.pad(sq, pad, mode="constant", constant_values=0)
    acc = xp.zeros_like(sq)
    for i in range(c1 + c2 + 1):
        acc = acc + sqp[:, i:i + C]
    den = xp.power(acc * work.type(alpha / size) + work.type(bias), work.type(beta))
    return ((xw / den).astype(x.dtype),)


# ---------------------------------------------------------------- Resize / Upsample


def _host_vals(node, specs, i):
    """The host value of optional input ``i`` as a flat float64 array, or None if absent/empty."""
    if len(specs) <= i or specs[i] is None:
        return None
    v = np.asarray(specs[i].value).reshape(-1)
    return v if v.size else None


def _resize_plan(node, specs):
    """(output shape, per-axis scales, per-axis roi pairs or None, axes to resample)."""
    x = specs[0]
    r = x.rank
    op = node.op_type
    if op == "Upsample" or node.opset < 11:
        if op == "Upsample" and node.opset < 9:
            if node.opset < 7:
                scales = [1.0, 1.0, float(node.attr("height_scale", 1.0)), float(node.attr("width_scale", 1.0))]
            else:
                scales = [float(v) for v in node.attr("scales", [])]
        else:
            v = _host_vals(node, specs, 1)
            scales = [] if v is None else [float(a) for a in v]
        if len(scales) != r:
            raise node.error(f"scales {scales} must have one value per input dim ({r})")
        roi, sizes, axes = None, None, list(range(r))
    else:
        axes = node.attr("axes")
        axes = list(range(r)) if not axes else [int(a) % r if -r <= int(a) < r else None for a in axes]
        if None in axes or len(set(axes)) != len(axes):
            raise node.error(f"axes {node.attr('axes')} are invalid for rank {r}")
        roi_v = _host_vals(node, specs, 1)
        sc = _host_vals(node, specs, 2)
        sz = _host_vals(node, specs, 3)
        if (sc is None) == (sz is None):
            raise node.error("exactly one of scales and sizes must be given")
        na = len(axes)
        roi = None
        if node.attr("coordinate_transformation_mode") == "tf_crop_and_resize":
            if roi_v is None:
                raise node.error("coordinate_transformation_mode tf_crop_and_resize needs a non-empty roi input")
            if len(roi_v) != 2 * na:
                raise node.error(f"roi has {len(roi_v)} values, {2 * na} expected")
            roi = [(0.0, 1.0)] * r
            for k, a in enumerate(axes):
                roi[a] = (float(roi_v[k]), float(roi_v[na + k]))
        scales = [1.0] * r
        sizes = None
        if sc is not None:
            if len(sc) != na:
                raise node.error(f"scales has {len(sc)} values, {na} expected")
            for k, a in enumerate(axes):
                scales[a] = float(sc[k])
        else:
            if len(sz) != na:
                raise node.error(f"sizes has {len(sz)} values, {na} expected")
            sizes = list(x.shape)
            for k, a in enumerate(axes):
                sizes[a] = int(sz[k])
            scales = [sizes[a] / x.shape[a] if x.shape[a] else 1.0 for a in range(r)]
            policy = node.attr("keep_aspect_ratio_policy", "stretch")
            if policy != "stretch":
                if policy == "not_larger":
                    s = min(scales[a] for a in axes)
                elif policy == "not_smaller":
                    s = max(scales[a] for a in axes)
                else:
                    raise node.error(f"keep_aspect_ratio_policy {policy!r} is not supported")
                for a in axes:
                    scales[a] = s
                    sizes[a] = int(s * x.shape[a] + 0.5)
    if any(not np.isfinite(s) or s <= 0 for s in scales):
        raise node.error(f"scales {scales} must be positive and finite")
    if sizes is None:
        sizes = [int(np.floor(s * d)) for s, d in zip(scales, x.shape)]
    return tuple(sizes), scales, roi, axes


def _resize_shapes(node, specs):
    shape, _, _, _ = _resize_plan(node, specs)
    return [Spec(shape, specs[0].dtype)]


def _resize_workspace(node, specs):
    """Axis by axis, as compute goes: the largest intermediate times its taps (an upsampled axis
    before a downsampled one can dwarf both input and output)."""
    shape, scales, _, axes = _resize_plan(node, specs)
    taps = {"nearest": 1, "linear": 2, "bilinear": 2, "cubic": 4}.get(node.attr("mode", "nearest"), 4)
    cur, peak = list(specs[0].shape), 0
    for a in axes:
        cur[a] = shape[a]
        t = taps * math.ceil(1 / scales[a]) if node.attr("antialias", 0) and 0 < scales[a] < 1 else taps
        peak = max(peak, math.prod(cur) * (t + 2))
    return peak * 8


def _resize_compute(xp, node, x, *rest):
    specs = _specs_of(node, (x, *rest))
    shape, scales, roi, axes = _resize_plan(node, specs)
    mode = node.attr("mode", "nearest")
    if mode == "bilinear":
        mode = "linear"
    legacy = node.op_type == "Upsample" or node.opset < 11
    work = float_work(x.dtype) if x.dtype.kind == "f" else np.dtype(np.float64)
    y = x if mode == "nearest" else x.astype(work, copy=False)
    for a in axes:
        pair = None if roi is None else roi[a]
        if abs(scales[a] - 1.0) < 1e-9 and shape[a] == y.shape[a] and (
                pair is None or (abs(pair[0]) < 1e-9 and abs(pair[1] - 1.0) < 1e-9)):
            continue
        if legacy:
            kw = {"ctm": "asymmetric", "nearest_mode": "floor" if scales[a] >= 1 else "ceil"}
        else:
            kw = {
                "ctm": node.attr("coordinate_transformation_mode", "half_pixel"),
                "nearest_mode": node.attr("nearest_mode", "round_prefer_floor"),
                "cubic_a": float(node.attr("cubic_coeff_a", -0.75)),
                "exclude_outside": bool(node.attr("exclude_outside", 0)),
                "extrapolation": float(node.attr("extrapolation_value", 0.0)),
                "antialias": bool(node.attr("antialias", 0)) and scales[a] < 1,
            }
        try:
            y = resize_axis(xp, y, a, shape[a], scales[a], mode=mode, roi=pair, **kw)
        except ValueError as exc:
            raise node.error(str(exc)) from None
    if y.dtype != x.dtype and x.dtype.kind in "iu":
        info = np.iinfo(x.dtype)
        y = xp.clip(xp.rint(y), info.min, info.max)
    return (y.astype(x.dtype),)


# ---------------------------------------------------------------- GridSample, AffineGrid


def _gridsample_shapes(node, specs):
    x, grid = specs[0], specs[1]
    nsp = _need_spatial(node, x, nonempty=True)
    if grid.rank != x.rank or grid.shape[0] != x.shape[0] or grid.shape[-1] != nsp:
        raise node.error(f"grid shape {grid.shape} must be (N, *out, {nsp}) for X shape {x.shape}")
    mode = node.attr("mode", "bilinear" if node.opset < 20 else "linear")
    if mode not in ("bilinear", "linear", "nearest", "bicubic", "cubic"):
        raise node.error(f"mode {mode!r} is not supported")
    if node.attr("padding_mode", "zeros") not in ("zeros", "border", "reflection"):
        raise node.error(f"padding_mode {node.attr('padding_mode')!r} is not supported")
    return [Spec((x.shape[0], x.shape[1], *grid.shape[1:-1]), x.dtype)]


def _gridsample_compute(xp, node, x, grid):
    mode = node.attr("mode", "bilinear" if node.opset < 20 else "linear")
    mode = {"bilinear": "linear", "bicubic": "cubic"}.get(mode, mode)
    return (grid_sample(xp, x, grid, mode=mode, padding_mode=node.attr("padding_mode", "zeros"),
                        align_corners=bool(node.attr("align_corners", 0))),)


def _affine_shapes(node, specs):
    theta = specs[0]
    size = [int(v) for v in np.asarray(specs[1].value).reshape(-1)]
    nd = len(size) - 2
    if nd not in (2, 3) or theta.shape != (size[0], nd, nd + 1):
        raise node.error(f"theta shape {theta.shape} does not match size {size}")
    return [Spec((size[0], *size[2:], nd), theta.dtype)]


def _affine_compute(xp, node, theta, size):
    return (affine_grid(xp, theta, node.out_specs[0].shape[1:-1], bool(node.attr("align_corners", 0))),)


# ---------------------------------------------------------------- DFT, STFT, windows, MelWeightMatrix


def _host_int(node, specs, i, what):
    v = _host_vals(node, specs, i)
    if v is None:
        return None
    if v.size != 1:
        raise node.error(f"{what} must be a scalar, got {v.size} values")
    return int(v[0])


def _dft_plan(node, specs):
    """(axis, dft_length, inverse, onesided, output shape)."""
    x = specs[0]
    r = x.rank
    if r < 2 or x.shape[-1] not in (1, 2):
        raise node.error(f"input must be (..., 1) real or (..., 2) complex, got shape {x.shape}")
    if node.opset >= 20:
        axis = _host_int(node, specs, 2, "axis")
        axis = -2 if axis is None else axis
    else:
        axis = int(node.attr("axis", 1))
    if not -r <= axis < r or axis % r == r - 1:
        raise node.error(f"axis {axis} is out of range for input rank {r}")
    axis %= r
    inverse = bool(node.attr("inverse", 0))
    onesided = bool(node.attr("onesided", 0))
    length = _host_int(node, specs, 1, "dft_length")
    if length is None:
        length = 2 * (x.shape[axis] - 1) if inverse and onesided else x.shape[axis]
    if length <= 0:
        raise node.error(f"dft_length {length} must be positive")
    shape = list(x.shape)
    if inverse:
        shape[axis], shape[-1] = length, 1 if onesided else 2
    else:
        shape[axis], shape[-1] = (length // 2 + 1 if onesided else length), 2
    return axis, length, inverse, onesided, tuple(shape)


def _dft_shapes(node, specs):
    return [Spec(_dft_plan(node, specs)[4], specs[0].dtype)]


def _dft_workspace(node, specs):
    axis, length, _, _, _ = _dft_plan(node, specs)
    x = specs[0]
    return dft_bytes(math.prod(x.shape) // max(x.shape[axis] * x.shape[-1], 1), length, length)


def _dft_compute(xp, node, x, *rest):
    specs = _specs_of(node, (x, *rest))
    axis, length, inverse, onesided, _ = _dft_plan(node, specs)
    xs = xp.moveaxis(x, axis, -2).astype(xp.float64)
    xr = xs[..., 0]
    xi = xs[..., 1] if x.shape[-1] == 2 else None
    re, im = dft_last(xp, xr, xi, length, inverse, onesided)
    out = xp.stack([re] if im is None else [re, im], axis=-1)
    return (xp.moveaxis(out, -2, axis).astype(x.dtype),)


def _stft_plan(node, specs):
    x = specs[0]
    if x.rank != 3 or x.shape[-1] not in (1, 2):
        raise node.error(f"signal must be (batch, length, 1 or 2), got shape {x.shape}")
    step = _host_int(node, specs, 1, "frame_step")
    if step is None or step <= 0:
        raise node.error("frame_step must be a positive scalar")
    window = specs[2] if len(specs) > 2 else None
    if window is not None and window.rank != 1:
        raise node.error(f"window must be 1-D, got shape {window.shape}")
    length = _host_int(node, specs, 3, "frame_length")
    if length is None:
        length = window.shape[0] if window is not None else x.shape[1]
    if window is not None and tuple(window.shape) != (length,):
        raise node.error(f"window shape {window.shape} does not match frame_length {length}")
    if length <= 0 or length > x.shape[1]:
        raise node.error(f"frame_length {length} must be in [1, {x.shape[1]}]")
    onesided = bool(node.attr("onesided", 1))
    frames = 1 + (x.shape[1] - length) // step
    bins = length // 2 + 1 if onesided else length
    return step, length, onesided, (x.shape[0], frames, bins, 2)


def _stft_shapes(node, specs):
    return [Spec(_stft_plan(node, specs)[3], specs[0].dtype)]


def _stft_workspace(node, specs):
    _, length, _, shape = _stft_plan(node, specs)
    rows = shape[0] * shape[1]
    return 4 * rows * length * 2 * 8 + dft_bytes(rows, length, length)  # the frames, then their DFT


def _stft_compute(xp, node, x, frame_step, window=None, frame_length=None):
    specs = _specs_of(node, (x, frame_step, window, frame_length))
    step, length, onesided, shape = _stft_plan(node, specs)
    F = shape[1]
    idx = xp.arange(F, dtype=xp.int64)[:, None] * step + xp.arange(length, dtype=xp.int64)[None, :]
    fr = xp.take(x.astype(xp.float64), idx, axis=1)  # (B, F, L, c)
    if window is not None:
        fr = fr * window.astype(xp.float64)[:, None]
    xi = fr[..., 1] if x.shape[-1] == 2 else None
    re, im = dft_last(xp, fr[..., 0], xi, length, False, onesided)
    return (xp.stack([re, im], axis=-1).astype(x.dtype),)


def _onnx_dtype(node, code):
    from onnx import helper  # host only: ONNX type enum to numpy dtype

    try:
        return np.dtype(helper.tensor_dtype_to_np_dtype(int(code)))
    except (KeyError, ValueError, TypeError):
        raise node.error(f"output_datatype {code} is not a supported tensor type") from None


def _window_shapes(node, specs):
    size = _host_int(node, specs, 0, "size")
    if size is None or size < 0:
        raise node.error("size must be a non-negative scalar")
    return [Spec((size,), _onnx_dtype(node, node.attr("output_datatype", 1)))]


def _window_compute(xp, node, size):
    n = node.out_specs[0].shape[0]
    N = n if int(node.attr("periodic", 1)) else n - 1
    i = xp.arange(n, dtype=xp.float64)
    a = i * (2 * np.pi / N) if N else i * 0.0
    if node.op_type == "HannWindow":
        w = 0.5 - 0.5 * xp.cos(a)
    elif node.op_type == "HammingWindow":
        alpha = 25.0 / 46.0
        w = alpha - (1 - alpha) * xp.cos(a)
    else:
        w = 0.42 - 0.5 * xp.cos(a) + 0.08 * xp.cos(2 * a)
    return (w.astype(node.out_specs[0].dtype),)


def _mel_plan(node, specs):
    bins = _host_int(node, specs, 0, "num_mel_bins")
    dft = _host_int(node, specs, 1, "dft_length")
    rate = _host_int(node, specs, 2, "sample_rate")
    lo = _host_vals(node, specs, 3)
    hi = _host_vals(node, specs, 4)
    if None in (bins, dft, rate) or lo is None or hi is None or bins <= 0 or dft <= 0 or rate <= 0:
        raise node.error("num_mel_bins, dft_length, sample_rate must be positive scalars, edges given")
    return bins, dft, rate, float(lo[0]), float(hi[0])


def _mel_shapes(node, specs):
    bins, dft, _, _, _ = _mel_plan(node, specs)
    return [Spec((dft // 2 + 1, bins), _onnx_dtype(node, node.attr("output_datatype", 1)))]


def _mel_compute(xp, node, *args):
    specs = _specs_of(node, args)
    bins, dft, rate, lo, hi = _mel_plan(node, specs)
    nspec = dft // 2 + 1
    lo_mel = 2595 * np.log1p(lo / 700) / np.log(10)
    hi_mel = 2595 * np.log1p(hi / 700) / np.log(10)
    step = (hi_mel - lo_mel) / (bins + 2)
    f = xp.arange(bins + 2, dtype=xp.float64) * step + lo_mel
    f = 700 * xp.expm1(f / 2595 * np.log(10))
    f = xp.floor((dft + 1) * f / rate).astype(xp.int64)
    left, center, right = f[None, :-2], f[None, 1:-1], f[None, 2:]
    j = xp.arange(nspec, dtype=xp.int64)[:, None]
    up = (j - left) / xp.maximum(center - left, 1)
    down = (right - j) / xp.maximum(right - center, 1)
    out = xp.where((j >= left) & (j <= center), up, 0.0)
    out = xp.where((center == left) & (j == center), 1.0, out)
    out = xp.where((j >= center) & (j < right), down, out)
    return (out.astype(node.out_specs[0].dtype),)


# ---------------------------------------------------------------- Det


def _det_shapes(node, specs):
    x = specs[0]
    if x.rank < 2 or x.shape[-1] != x.shape[-2]:
        raise node.error(f"input must be (..., M, M), got shape {x.shape}")
    return [Spec(x.shape[:-2], x.dtype)]


def _det_compute(xp, node, x):
    return (det_lu(xp, x),)


# ---------------------------------------------------------------- registry

OPS: list[OpKernel] = [
    OpKernel("Conv", _conv_shapes, _conv_compute, since=1, workspace=_conv_workspace, capture="safe"),
    OpKernel("ConvTranspose", _convt_shapes, _convt_compute, since=1, workspace=_convt_workspace, capture="safe"),
    OpKernel("MaxPool", _pool_shapes, _maxpool_compute, since=1, workspace=_pool_workspace, capture="safe"),
    OpKernel("AveragePool", _pool_shapes, _avgpool_compute, since=1, workspace=_pool_workspace, capture="safe"),
    OpKernel("LpPool", _pool_shapes, _lppool_compute, since=1, workspace=_pool_workspace, capture="safe"),
    OpKernel("GlobalAveragePool", _global_shapes, _gap_compute, since=1, capture="safe"),
    OpKernel("GlobalMaxPool", _global_shapes, _gmp_compute, since=1, capture="safe"),
    OpKernel("GlobalLpPool", _global_shapes, _glp_compute, since=1, capture="safe"),
    OpKernel("MaxUnpool", _unpool_shapes, _unpool_compute, since=9, host_inputs=(2,), index_checks=_unpool_check, capture="safe"),
    OpKernel("LRN", _lrn_shapes, _lrn_compute, since=1, capture="safe"),
    OpKernel("Upsample", _resize_shapes, _resize_compute, since=1, host_inputs=(1,), workspace=_resize_workspace, capture="safe"),
    OpKernel("Resize", _resize_shapes, _resize_compute, since=10, host_inputs=(1, 2, 3), workspace=_resize_workspace, capture="safe"),
    OpKernel("GridSample", _gridsample_shapes, _gridsample_compute, since=16, capture="safe"),
    OpKernel("AffineGrid", _affine_shapes, _affine_compute, since=20, host_inputs=(1,), capture="safe"),
    OpKernel("DFT", _dft_shapes, _dft_compute, since=17, host_inputs=(1, 2), workspace=_dft_workspace, capture="safe"),
    OpKernel("STFT", _stft_shapes, _stft_compute, since=17, host_inputs=(1, 3), workspace=_stft_workspace, capture="safe"),
    OpKernel("HannWindow", _window_shapes, _window_compute, since=17, host_inputs=(0,), capture="safe"),
    OpKernel("HammingWindow", _window_shapes, _window_compute, since=17, host_inputs=(0,), capture="safe"),
    OpKernel("BlackmanWindow", _window_shapes, _window_compute, since=17, host_inputs=(0,), capture="safe"),
    OpKernel("MelWeightMatrix", _mel_shapes, _mel_compute, since=17, host_inputs=(0, 1, 2, 3, 4), capture="safe"),
    OpKernel("Det", _det_shapes, _det_compute, since=11, capture="safe"),
]
