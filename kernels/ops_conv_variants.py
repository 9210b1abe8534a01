"""Convolution variants: DeformConv, ConvInteger, QLinearConv.

All three reuse the Conv machinery of ``_conv_util`` (``geometry`` for output sizes and pads,
``conv_nd`` for the grouped im2col product through ``_linalg.matmul``):

- ConvInteger: ``(x - x_zero_point) * (w - w_zero_point)`` summed in int32 (the zero points are
  subtracted before padding, so the pads hold the zero point: zero in the shifted domain);
  ``w_zero_point`` is one value or one per output channel.
- QLinearConv: the same int32 sum plus the int32 bias ``B``, requantised as
  ``saturate(round_half_even(acc * (x_scale * w_scale / y_scale)) + y_zero_point)`` (the
  multiplier in the scales' own precision, applied in float64, as ONNX's reference does);
  ``w_scale``/``w_zero_point`` per tensor or per output channel.
- DeformConv: each kernel tap samples ``X`` at its regular position plus a learned offset, by
  multilinear interpolation (zero outside the input), optionally scaled by ``mask``; the samples
  form the im2col columns of one grouped ``_linalg.matmul``. Any number of spatial dims.

No host reads: every body is capture-safe (temporaries only, gathers by ``take_along_axis``).
"""

from __future__ import annotations

import itertools
import math

import numpy as np

from ._conv_util import conv_nd, float_work, geometry, windows_bytes
from ._linalg import matmul
from ._op import OpKernel, Spec

__all__ = ["OPS"]

_I8 = (np.dtype(np.int8), np.dtype(np.uint8))


def _need_spatial(node, x: Spec) -> int:
    if x.rank < 3:
        raise node.error(f"X must have rank >= 3 (N, C, spatial...), got shape {x.shape}")
    return x.rank - 2


def _opt(specs, i):
    return specs[i] if len(specs) > i else None


def _group(node, x: Spec, w: Spec) -> int:
    if w.rank != x.rank:
        raise node.error(f"W rank {w.rank} does not match X rank {x.rank}")
    group = int(node.attr("group", 1))
    C, M = x.shape[1], w.shape[0]
    if group <= 0 or C % group or M % group:
        raise node.error(f"group {group} does not divide channels (input {C}, output {M})")
    if C // group != w.shape[1]:
        raise node.error(f"input has {C} channels, weights expect {w.shape[1]} x group {group}")
    return group


def _conv_workspace(node, specs, w_input: int = 1):
    x, w = specs[0], specs[w_input]
    g = geometry(node, x.shape[2:], list(w.shape[2:]))
    return windows_bytes(x.shape[0] * x.shape[1], x.shape[2:], g) + 2 * x.shape[0] * w.shape[0] * math.prod(g.out) * 8


def _per_channel(node, spec: Spec | None, name: str, m: int, dtype=None) -> None:
    """A per-tensor (one value) or per-output-channel (1-D of ``m``) parameter, of ``dtype`` if given."""
    if spec is None:
        return
    size = math.prod(spec.shape)
    if not ((size == 1 and spec.rank <= 1) or (spec.rank == 1 and size == m)):
        raise node.error(f"{name} has shape {spec.shape}: one value, or 1-D of {m} (output channels) expected")
    if dtype is not None and np.dtype(spec.dtype) != np.dtype(dtype):
        raise node.error(f"{name} has type {np.dtype(spec.dtype)}, {np.dtype(dtype)} expected")


def _per_tensor(node, spec: Spec | None, name: str, dtype=None) -> None:
    if spec is None:
        return
    if not (math.prod(spec.shape) == 1 and spec.rank <= 1):
        raise node.error(f"{name} has shape {spec.shape}: one value expected (per-tensor)")
    if dtype is not None and np.dtype(spec.dtype) != np.dtype(dtype):
        raise node.error(f"{name} has type {np.dtype(spec.dtype)}, {np.dtype(dtype)} expected")


def _int8_input(node, spec: Spec, name: str) -> None:
    if np.dtype(spec.dtype) not in _I8:
        raise node.error(f"{name} has type {np.dtype(spec.dtype)}: int8 or uint8 expected")


def _shifted(xp, v, zp, channels_axis_rank: int = 0):
    """``v`` in int32 minus its zero point (one value, or one per leading channel of a rank-``r`` v)."""
    v = v.astype(xp.int32)
    if zp is None:
        return v
    zp = zp.astype(xp.int32)
    if channels_axis_rank and zp.size > 1:
        zp = zp.reshape((zp.shape[0],) + (1,) * (channels_axis_rank - 1))
    else:
        zp = zp.reshape(())
    return v - zp


# ---------------------------------------------------------------- ConvInteger


def _convint_shapes(node, specs):
    x, w = specs[0], specs[1]
    _need_spatial(node, x)
    _int8_input(node, x, "x")
    _int8_input(node, w, "w")
    _group(node, x, w)
    _per_tensor(node, _opt(specs, 2), "x_zero_point", x.dtype)
    _per_channel(node, _opt(specs, 3), "w_zero_point", w.shape[0], w.dtype)
    g = geometry(node, x.shape[2:], list(w.shape[2:]))
    return [Spec((x.shape[0], w.shape[0], *g.out), np.dtype(np.int32))]


def _convint_compute(xp, node, x, w, x_zp=None, w_zp=None):
    g = geometry(node, x.shape[2:], list(w.shape[2:]))
    X = _shifted(xp, x, x_zp)
    W = _shifted(xp, w, w_zp, w.ndim)
    return (conv_nd(xp, X, W, None, g, int(node.attr("group", 1))).astype(xp.int32),)


# ---------------------------------------------------------------- QLinearConv


def _qconv_shapes(node, specs):
    x, w = specs[0], specs[3]
    _need_spatial(node, x)
    _int8_input(node, x, "x")
    _int8_input(node, w, "w")
    _group(node, x, w)
    M = w.shape[0]
    _per_tensor(node, specs[1], "x_scale")
    _per_tensor(node, _opt(specs, 2), "x_zero_point", x.dtype)
    _per_channel(node, specs[4], "w_scale", M)
    _per_channel(node, _opt(specs, 5), "w_zero_point", M, w.dtype)
    _per_tensor(node, specs[6], "y_scale")
    yzp = _opt(specs, 7)
    _per_tensor(node, yzp, "y_zero_point")
    for i, name in ((1, "x_scale"), (4, "w_scale"), (6, "y_scale")):
        if np.dtype(specs[i].dtype).kind != "f":
            raise node.error(f"{name} has type {np.dtype(specs[i].dtype)}: a float type expected")
    b = _opt(specs, 8)
    if b is not None and (tuple(b.shape) != (M,) or np.dtype(b.dtype) != np.dtype(np.int32)):
        raise node.error(f"B must be int32 of shape ({M},), got {np.dtype(b.dtype)} {b.shape}")
    out = np.dtype(yzp.dtype) if yzp is not None else np.dtype(x.dtype)
    if out not in _I8:
        raise node.error(f"y_zero_point has type {out}: int8 or uint8 expected")
    g = geometry(node, x.shape[2:], list(w.shape[2:]))
    return [Spec((x.shape[0], M, *g.out), out)]


def _qconv_compute(xp, node, x, x_scale, x_zp, w, w_scale, w_zp, y_scale, y_zp=None, b=None):
    out = np.dtype(node.out_specs[0].dtype)
    g = geometry(node, x.shape[2:], list(w.shape[2:]))
    nsp = x.ndim - 2
    acc = conv_nd(xp, _shifted(xp, x, x_zp), _shifted(xp, w, w_zp, w.ndim), b, g, int(node.attr("group", 1)))
    if w_scale.size > 1:
        w_scale = w_scale.reshape((1, w_scale.shape[0]) + (1,) * nsp)
    else:
        w_scale = w_scale.reshape(())
    # the multiplier in the scales' own precision (as the reference), applied in float64
    mult = (x_scale.reshape(()) * w_scale) / y_scale.reshape(())
    r = acc.astype(xp.float64) * mult.astype(xp.float64)
    if y_zp is not None:
        r = r + y_zp.reshape(()).astype(xp.float64)
    info = np.iinfo(out)
    return (xp.clip(xp.rint(r), float(info.min), float(info.max)).astype(out),)


# ---------------------------------------------------------------- DeformConv


def _deform_check(node) -> None:
    og = node.attr("offset_group", 1)
    if isinstance(og, bool) or not isinstance(og, (int, np.integer)) or og < 1:
        raise node.error(f"attribute offset_group={og!r} is invalid: must be an integer >= 1")
    if (node.attr("auto_pad", "NOTSET") or "NOTSET") != "NOTSET":
        raise node.error(f"attribute auto_pad={node.attr('auto_pad')!r} is invalid: DeformConv has explicit pads only")


def _deform_shapes(node, specs):
    x, w, off = specs[0], specs[1], specs[2]
    b, mask = _opt(specs, 3), _opt(specs, 4)
    nsp = _need_spatial(node, x)
    if np.dtype(x.dtype).kind != "f":
        raise node.error(f"X has type {np.dtype(x.dtype)}: a float type expected")
    _group(node, x, w)
    og = int(node.attr("offset_group", 1))
    if x.shape[1] % og:
        raise node.error(f"offset_group {og} does not divide the input channels {x.shape[1]}")
    g = geometry(node, x.shape[2:], list(w.shape[2:]))
    K = math.prod(g.kernel)
    want = (x.shape[0], og * K * nsp, *g.out)
    if tuple(off.shape) != want:
        raise node.error(f"offset has shape {off.shape}, {want} expected (N, offset_group * kernel size * {nsp}, *output)")
    if mask is not None and tuple(mask.shape) != (x.shape[0], og * K, *g.out):
        raise node.error(f"mask has shape {mask.shape}, {(x.shape[0], og * K, *g.out)} expected")
    if b is not None and tuple(b.shape) != (w.shape[0],):
        raise node.error(f"B must have shape ({w.shape[0]},), got {b.shape}")
    return [Spec((x.shape[0], w.shape[0], *g.out), x.dtype)]


def _deform_workspace(node, specs):
    x, w = specs[0], specs[1]
    g = geometry(node, x.shape[2:], list(w.shape[2:]))
    cols = x.shape[0] * x.shape[1] * math.prod(g.kernel) * math.prod(g.out)
    return 4 * cols * 8 + 2 * x.shape[0] * w.shape[0] * math.prod(g.out) * 8


def _regular_positions(xp, g, d: int, nsp: int):
    """Tap positions along spatial dim ``d`` without offsets: (*kernel, *out) float64."""
    k_shape = [1] * (2 * nsp)
    k_shape[d] = g.kernel[d]
    o_shape = [1] * (2 * nsp)
    o_shape[nsp + d] = g.out[d]
    taps = xp.arange(g.kernel[d], dtype=xp.float64).reshape(k_shape) * g.dilations[d] - g.begin[d]
    outs = xp.arange(g.out[d], dtype=xp.float64).reshape(o_shape) * g.strides[d]
    return xp.broadcast_to(taps + outs, tuple(g.kernel) + tuple(g.out))


def deform_conv(xp, x, w, offset, b, mask, g, group: int, og: int):
    """Deformable convolution (N-d) of ``x`` (N, C, *in) by ``w`` (M, C/group, *kernel)."""
    N, C, M = x.shape[0], x.shape[1], w.shape[0]
    nsp = x.ndim - 2
    in_sp = list(x.shape[2:])
    K, P = math.prod(g.kernel), math.prod(g.out)
    S = math.prod(in_sp)
    cog = C // og
    work = float_work(x.dtype)
    off = offset.astype(xp.float64).reshape(N, og, K, nsp, P)
    per_dim = []  # per spatial dim: (floor index (N, og, K, P) int64, fraction (N, og, K, P))
    for d in range(nsp):
        pos = _regular_positions(xp, g, d, nsp).reshape(1, 1, K, P) + off[:, :, :, d, :]
        lo = xp.floor(pos)
        per_dim.append((lo.astype(xp.int64), pos - lo))
    strides = [math.prod(in_sp[d + 1:]) for d in range(nsp)]
    xf = x.astype(work, copy=False).reshape(N, og, cog, S)
    cols = xp.zeros((N, og, cog, K * P), dtype=work)
    for corner in itertools.product((0, 1), repeat=nsp):
        flat = None
        weight = None
        valid = None
        for d, c in enumerate(corner):
            lo, t = per_dim[d]
            j = lo + c
            ok = (j >= 0) & (j < in_sp[d])
            part = xp.clip(j, 0, in_sp[d] - 1) * strides[d]
            wt = t if c else 1 - t
            flat = part if flat is None else flat + part
            weight = wt if weight is None else weight * wt
            valid = ok if valid is None else valid & ok
        weight = xp.where(valid, weight, 0.0).astype(work).reshape(N, og, 1, K * P)
        idx = xp.broadcast_to(flat.reshape(N, og, 1, K * P), (N, og, cog, K * P))
        cols = cols + xp.take_along_axis(xf, idx, axis=3) * weight
    if mask is not None:
        cols = cols * mask.astype(work).reshape(N, og, 1, K * P)
    cols = cols.reshape(N, group, (C // group) * K, P)
    wm = w.astype(work, copy=False).reshape(1, group, M // group, (C // group) * K)
    y = matmul(xp, wm, cols).reshape((N, M) + tuple(g.out))
    if b is not None:
        y = y + b.astype(work).reshape((1, M) + (1,) * nsp)
    return y.astype(x.dtype)


def _deform_compute(xp, node, x, w, offset, b=None, mask=None):
    g = geometry(node, x.shape[2:], list(w.shape[2:]))
    return (deform_conv(xp, x, w, offset, b, mask, g, int(node.attr("group", 1)),
                        int(node.attr("offset_group", 1))),)


OPS: list[OpKernel] = [
    OpKernel("ConvInteger", _convint_shapes, _convint_compute, since=10, workspace=_conv_workspace, capture="safe"),
    OpKernel("QLinearConv", _qconv_shapes, _qconv_compute, since=10,
             workspace=lambda node, specs: _conv_workspace(node, specs, 3), capture="safe"),
    OpKernel("DeformConv", _deform_shapes, _deform_compute, since=19, check=_deform_check,
             workspace=_deform_workspace, capture="safe"),
]
