"""Convolution and pooling: Conv, ConvTranspose, the max/average/Lp pools and their global forms,
MaxUnpool, LRN. Windowed ops gather their windows with constant ``xp.pad`` and strided slices
(``_conv_util.windows``); every matrix product goes through ``_linalg.matmul``.
"""

from __future__ import annotations

import math

import numpy as np

from ._conv_util import (
    need_spatial,
    conv_nd,
    conv_transpose_nd,
    convt_geometry,
    float_work,
    geometry,
    pad_value_min,
    windows,
    windows_bytes,
)
from ._latch import IndexCheck
from ._op import OpKernel, Spec

__all__ = ["OPS"]

__all__ = ["OPS"]


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
    need_spatial(node, x, nonempty=True)
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
    need_spatial(node, x, nonempty=True)
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
    need_spatial(node, x)
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
    need_spatial(node, x, nonempty=node.op_type == "GlobalMaxPool")  # (a max over no elements has no value)
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
    need_spatial(node, x)
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
]
