"""RoiAlign (opsets 10, 16+): bilinear sampling of regions of a feature map, pooled by avg or max.

Every region's sample positions are computed on the device at once: per region, per output row
``ph`` and grid row ``iy`` (and the same along x), the position
``start + ph * bin + (iy + 0.5) * bin / grid`` (ONNX's reference's order of float operations), its
two neighbouring rows and their weights; the four corners are gathered from ``X`` laid out
(N, H*W, C) and combined, in float32 (float64 for float64 inputs). A sample outside
``[-1, H] x [-1, W]`` has zero weights but still counts in the average, as in the reference; in
``max`` mode a bin is the maximum over its samples of ``max(w1*v1, w2*v2, w3*v3, w4*v4)`` (the
reference's definition).

``sampling_ratio = 0`` makes each region's grid ``ceil(roi_size / output_size)``, a function of the
ROI *values*; ``rois`` is therefore read on the host (``host_inputs``) to size the padded grid (its
largest region), and each region masks the samples past its own grid on the device. The body reads
nothing on the host. ``batch_indices`` outside ``[0, N)`` are flagged into the error latch
(``index_checks``) and clamped (with ``N = 0`` the output is zeros, every index flagged). Non-finite
ROI coordinates and an empty spatial dim are refused by ``shapes()`` (``OpError``). Opset 10 has no ``coordinate_transformation_mode``: it is
``output_half_pixel`` there (opset 16's default is ``half_pixel``).
"""

from __future__ import annotations

import numpy as np

from ._latch import IndexCheck
from ._nn_util import to_work, work_dtype
from ._op import OpKernel, Spec

__all__ = ["OPS"]


def _attrs(node):
    mode = node.attr("mode", "avg")
    ctm = node.attr("coordinate_transformation_mode", "half_pixel" if node.opset >= 16 else "output_half_pixel")
    oh, ow = int(node.attr("output_height", 1)), int(node.attr("output_width", 1))
    ratio = int(node.attr("sampling_ratio", 0))
    scale = float(node.attr("spatial_scale", 1.0))
    return mode, ctm == "half_pixel", oh, ow, ratio, scale


def _check(node) -> None:
    scale = node.attr("spatial_scale", 1.0)
    if not (isinstance(scale, (int, float)) and np.isfinite(scale) and scale > 0):
        raise node.error(f"attribute spatial_scale={scale!r} is invalid: a positive finite number is expected")


def _shapes(node, specs):
    x, rois, idx = (list(specs) + [None] * 3)[:3]
    if x is None or rois is None or idx is None:
        raise node.error("inputs X, rois and batch_indices are required")
    if x.rank != 4:
        raise node.error(f"input X must be rank 4 (N, C, H, W), got shape {x.shape}")
    if x.dtype.kind != "f" or rois.dtype != x.dtype:
        raise node.error(f"inputs X and rois must be one float dtype, got {x.dtype} and {rois.dtype}")
    if rois.rank != 2 or rois.shape[1] != 4:
        raise node.error(f"input rois must have shape (num_rois, 4), got {rois.shape}")
    if idx.rank != 1 or idx.shape[0] != rois.shape[0] or idx.dtype.kind not in "iu":
        raise node.error(f"input batch_indices must be integers of shape ({rois.shape[0]},), got {idx.dtype}{idx.shape}")
    if rois.shape[0] and (x.shape[2] == 0 or x.shape[3] == 0):
        raise node.error(f"input X has an empty spatial dim {x.shape}: the regions have nothing to sample")
    if rois.value is not None and not np.all(np.isfinite(rois.value)):
        raise node.error("input rois must hold finite coordinates")
    _, _, oh, ow, _, _ = _attrs(node)
    return [Spec((rois.shape[0], x.shape[1], oh, ow), x.dtype)]


def _index_checks(node, specs):
    return [IndexCheck(2, 0, int(specs[0].shape[0]))]


def _geometry(mod, rois, wd, half_pixel, oh, ow, scale):
    """Per region: start (y, x), bin size (h, w) and the size of the region; ``mod`` is numpy (the
    host's copy) or ``xp`` (the device's), with the same float operations."""
    r = rois.astype(wd) * wd.type(scale)
    off = wd.type(0.5 if half_pixel else 0.0)
    x1, y1, x2, y2 = r[:, 0] - off, r[:, 1] - off, r[:, 2] - off, r[:, 3] - off
    rw, rh = x2 - x1, y2 - y1
    if not half_pixel:  # malformed regions are forced to 1x1
        rw, rh = mod.maximum(rw, wd.type(1)), mod.maximum(rh, wd.type(1))
    return y1, x1, rh / wd.type(oh), rw / wd.type(ow)


def _grid_size(node, rois_host, wd) -> tuple[int, int]:
    """The padded sampling grid: ``sampling_ratio``, or the largest region's ``ceil(bin)`` (host)."""
    _, half_pixel, oh, ow, ratio, scale = _attrs(node)
    if ratio > 0:
        return ratio, ratio
    rois = np.asarray(rois_host)
    if rois.shape[0] == 0:
        return 1, 1
    _, _, bh, bw = _geometry(np, rois, wd, half_pixel, oh, ow, scale)
    return max(1, int(np.ceil(bh).max())), max(1, int(np.ceil(bw).max()))


def _axis(xp, start, bin_, grid, pooled, G, size, wd):
    """Along one axis, per (region, pooled, grid sample): low and high indices, the two weights,
    and whether the sample lies inside ``[-1, size]``; shapes (R, pooled, G)."""
    p = xp.arange(pooled, dtype=wd).reshape(1, pooled, 1)
    i = xp.arange(G, dtype=wd).reshape(1, 1, G) + wd.type(0.5)
    b = bin_.reshape(-1, 1, 1)
    pos = (start.reshape(-1, 1, 1) + p * b) + i * b / grid.astype(wd).reshape(-1, 1, 1)
    inside = xp.logical_and(pos >= -1, pos <= size)  # (False for NaN: never indexes anything)
    pos = xp.where(inside, xp.maximum(pos, wd.type(0)), wd.type(0))
    low = xp.floor(pos).astype(xp.int64)
    at_end = low >= size - 1
    low = xp.minimum(low, size - 1)
    high = xp.where(at_end, low, low + 1)
    pos = xp.where(at_end, low.astype(wd), pos)
    lw = pos - low.astype(wd)
    hw = wd.type(1) - lw
    return low, high, hw, lw, inside


def _compute(xp, node, X, rois, batch_indices):
    mode, half_pixel, oh, ow, ratio, scale = _attrs(node)
    wd = work_dtype(X.dtype)
    N, C, H, W = (int(d) for d in X.shape)
    R = int(rois.shape[0])
    if N == 0 or R == 0:  # no image to sample (every batch index is flagged): zeros, no gather
        return (xp.zeros((R, C, oh, ow), dtype=X.dtype),)
    Gh, Gw = _grid_size(node, node.host[1], wd)
    y1, x1, bh, bw = _geometry(xp, rois, wd, half_pixel, oh, ow, scale)
    if ratio > 0:
        gh = xp.full((R,), ratio, dtype=xp.int64)
        gw = gh
    else:  # the region's own grid, within the padded one (a negative size samples nothing)
        gh = xp.clip(xp.ceil(bh).astype(xp.int64), 0, Gh)
        gw = xp.clip(xp.ceil(bw).astype(xp.int64), 0, Gw)
    ylo, yhi, yhw, ylw, yin = _axis(xp, y1, bh, xp.maximum(gh, 1), oh, Gh, H, wd)
    xlo, xhi, xhw, xlw, xin = _axis(xp, x1, bw, xp.maximum(gw, 1), ow, Gw, W, wd)
    # (R, oh, Gh, 1, 1) against (R, 1, 1, ow, Gw)
    def ys(a):
        return a.reshape(R, oh, Gh, 1, 1)

    def xs(a):
        return a.reshape(R, 1, 1, ow, Gw)

    inside = xp.logical_and(ys(yin), xs(xin))
    live = xp.logical_and((xp.arange(Gh) < gh.reshape(-1, 1)).reshape(R, 1, Gh, 1, 1),
                          (xp.arange(Gw) < gw.reshape(-1, 1)).reshape(R, 1, 1, 1, Gw))
    b = xp.clip(batch_indices.astype(xp.int64), 0, max(N - 1, 0)).reshape(R, 1, 1, 1, 1)
    feat = xp.transpose(to_work(X, wd).reshape(N, C, H * W), (0, 2, 1))  # (N, H*W, C)
    terms = []
    for yy, wy in ((ylo, yhw), (yhi, ylw)):
        for xx, wx in ((xlo, xhw), (xhi, xlw)):
            w = xp.where(inside, ys(wy) * xs(wx), wd.type(0))
            v = feat[b, ys(yy) * W + xs(xx)]  # (R, oh, Gh, ow, Gw, C)
            terms.append(w[..., None] * v)
    if mode == "avg":
        s = (terms[0] + terms[1]) + (terms[2] + terms[3])
        s = xp.where(live[..., None], s, wd.type(0)).sum(axis=(2, 4))
        y = s / xp.maximum(gh * gw, 1).astype(wd).reshape(R, 1, 1, 1)
    else:
        m = xp.maximum(xp.maximum(terms[0], terms[1]), xp.maximum(terms[2], terms[3]))
        m = xp.where(live[..., None], m, wd.type(-np.inf)).max(axis=(2, 4))
        any_live = xp.logical_and(gh > 0, gw > 0).reshape(R, 1, 1, 1)
        y = xp.where(any_live, m, wd.type(0))
    return (xp.ascontiguousarray(xp.transpose(y, (0, 3, 1, 2))).astype(X.dtype),)


def _workspace(node, specs):
    """The gathered samples: four (R, oh, Gh, ow, Gw, C) corner terms plus their weights and sums."""
    x, rois = specs[0], specs[1]
    if rois.value is None:
        return 0
    wd = work_dtype(x.dtype)
    Gh, Gw = _grid_size(node, rois.value, wd)
    _, _, oh, ow, _, _ = _attrs(node)
    return 8 * int(rois.shape[0]) * oh * ow * Gh * Gw * int(x.shape[1]) * wd.itemsize


OPS = [OpKernel("RoiAlign", _shapes, _compute, since=10, host_inputs=(1,), index_checks=_index_checks,
                check=_check, workspace=_workspace, capture="safe")]
