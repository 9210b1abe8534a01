"""Resampling: Resize and Upsample, GridSample, AffineGrid (``_resample_util``'s resize_axis,
grid_sample, affine_grid).
"""

from __future__ import annotations

import math

import numpy as np

from ._conv_util import float_work, host_vals, need_spatial, specs_of
from ._resample_util import affine_grid, grid_sample, resize_axis
from ._op import OpKernel, Spec

__all__ = ["OPS"]


# ---------------------------------------------------------------- Resize / Upsample


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
            v = host_vals(node, specs, 1)
            scales = [] if v is None else [float(a) for a in v]
        if len(scales) != r:
            raise node.error(f"scales {scales} must have one value per input dim ({r})")
        roi, sizes, axes = None, None, list(range(r))
    else:
        axes = node.attr("axes")
        axes = list(range(r)) if not axes else [int(a) % r if -r <= int(a) < r else None for a in axes]
        if None in axes or len(set(axes)) != len(axes):
            raise node.error(f"axes {node.attr('axes')} are invalid for rank {r}")
        roi_v = host_vals(node, specs, 1)
        sc = host_vals(node, specs, 2)
        sz = host_vals(node, specs, 3)
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
    specs = specs_of(node, (x, *rest))
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
    nsp = need_spatial(node, x, nonempty=True)
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


OPS: list[OpKernel] = [
    OpKernel("Upsample", _resize_shapes, _resize_compute, since=1, host_inputs=(1,), workspace=_resize_workspace, capture="safe"),
    OpKernel("Resize", _resize_shapes, _resize_compute, since=10, host_inputs=(1, 2, 3), workspace=_resize_workspace, capture="safe"),
    OpKernel("GridSample", _gridsample_shapes, _gridsample_compute, since=16, capture="safe"),
    OpKernel("AffineGrid", _affine_shapes, _affine_compute, since=20, host_inputs=(1,), capture="safe"),
]
