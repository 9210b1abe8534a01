"""Detection ops: NonMaxSuppression.

NonMaxSuppression's output shape (the number of boxes kept) depends on the data, so the op is a
host seam: every input is read on the host (``host_inputs``), ``shapes()`` runs the greedy
selection in numpy and returns the exact result as the output's host value, and ``compute`` only
uploads it. Semantics (ONNX, as its reference and ONNX Runtime): per batch and class, candidates
with score > score_threshold (when given) in descending score order (ties: the lower box index
first); a candidate is kept unless its IoU with an already kept box of that class exceeds
iou_threshold; at most max_output_boxes_per_class kept per class. Boxes are corners
``[y1, x1, y2, x2]`` in either order (center_point_box=0) or ``[x_center, y_center, width,
height]`` (center_point_box=1). The IoU arithmetic runs in the boxes' own float type.
"""

from __future__ import annotations

import numpy as np

from ._op import OpKernel, Spec

__all__ = ["OPS", "nms_select"]

_I64 = np.dtype(np.int64)


def _corners(boxes: np.ndarray, center_point_box: int):
    """(x_min, x_max, y_min, y_max) arrays of boxes (n, 4), in their own float type."""
    if center_point_box:
        xc, yc, w, h = boxes[:, 0], boxes[:, 1], boxes[:, 2], boxes[:, 3]
        two = boxes.dtype.type(2)
        return xc - w / two, xc + w / two, yc - h / two, yc + h / two
    y1, x1, y2, x2 = boxes[:, 0], boxes[:, 1], boxes[:, 2], boxes[:, 3]
    return np.minimum(x1, x2), np.maximum(x1, x2), np.minimum(y1, y2), np.maximum(y1, y2)


def _suppressed(c, top: int, rest: np.ndarray, iou_threshold) -> np.ndarray:
    """Which boxes ``rest`` the kept box ``top`` suppresses (IoU > threshold, positive areas)."""
    x0, x1, y0, y1 = c
    ix = np.minimum(x1[top], x1[rest]) - np.maximum(x0[top], x0[rest])
    iy = np.minimum(y1[top], y1[rest]) - np.maximum(y0[top], y0[rest])
    inter = ix * iy
    a_top = (x1[top] - x0[top]) * (y1[top] - y0[top])
    a_rest = (x1[rest] - x0[rest]) * (y1[rest] - y0[rest])
    union = a_top + a_rest - inter
    ok = (ix > 0) & (iy > 0) & (inter > 0) & (a_top > 0) & (a_rest > 0) & (union > 0)
    with np.errstate(divide="ignore", invalid="ignore"):
        iou = inter / np.where(ok, union, 1)
    return ok & (iou > iou_threshold)


def nms_select(boxes: np.ndarray, scores: np.ndarray, max_per_class: int, iou_threshold,
               score_threshold, center_point_box: int) -> np.ndarray:
    """The selected (batch, class, box) triples, int64 (k, 3), in ONNX's order."""
    out = []
    if max_per_class <= 0:
        return np.zeros((0, 3), dtype=_I64)
    for b in range(boxes.shape[0]):
        c = _corners(boxes[b], center_point_box)
        for k in range(scores.shape[1]):
            s = scores[b, k]
            cand = np.arange(s.shape[0]) if score_threshold is None else np.flatnonzero(s > score_threshold)
            order = cand[np.argsort(-s[cand], kind="stable")]  # descending; ties keep the lower index first
            kept = 0
            while order.size and kept < max_per_class:
                top, order = int(order[0]), order[1:]
                out.append((b, k, top))
                kept += 1
                if order.size:
                    order = order[~_suppressed(c, top, order, iou_threshold)]
    return np.asarray(out, dtype=_I64).reshape(-1, 3)


def _scalar(node, specs, i, name, kind):
    """The host value of optional scalar input ``i`` (None when absent or empty)."""
    sp = specs[i] if len(specs) > i else None
    if sp is None:
        return None
    v = np.asarray(sp.value)
    if v.size == 0:
        return None
    if v.size != 1:
        raise node.error(f"{name} has shape {v.shape}: one value expected")
    if v.dtype.kind not in kind:
        raise node.error(f"{name} has type {v.dtype}: {'an integer' if kind == 'iu' else 'a float'} type expected")
    return v.reshape(())


def _nms_shapes(node, specs):
    boxes, scores = specs[0], specs[1]
    if boxes.rank != 3 or boxes.shape[2] != 4:
        raise node.error(f"boxes must have shape (batches, boxes, 4), got {boxes.shape}")
    if scores.rank != 3 or scores.shape[0] != boxes.shape[0] or scores.shape[2] != boxes.shape[1]:
        raise node.error(f"scores must have shape ({boxes.shape[0]}, classes, {boxes.shape[1]}), got {scores.shape}")
    for sp, name in ((boxes, "boxes"), (scores, "scores")):
        if np.dtype(sp.dtype).kind != "f":
            raise node.error(f"{name} has type {np.dtype(sp.dtype)}: a float type expected")
    mx = _scalar(node, specs, 2, "max_output_boxes_per_class", "iu")
    iou = _scalar(node, specs, 3, "iou_threshold", "f")
    score = _scalar(node, specs, 4, "score_threshold", "f")
    if iou is not None and not 0 <= float(iou) <= 1:
        raise node.error(f"iou_threshold {float(iou)} is outside [0, 1]")
    b = np.asarray(boxes.value)
    dt = b.dtype
    iou_t = dt.type(0) if iou is None else iou.astype(dt)
    res = nms_select(b, np.asarray(scores.value), 0 if mx is None else int(mx), iou_t,
                     score, int(node.attr("center_point_box", 0)))
    return [Spec(res.shape, _I64, res)]


def _from_host(xp, node, *_arrays):
    return (xp.asarray(node.out_specs[0].value),)


OPS: list[OpKernel] = [
    OpKernel("NonMaxSuppression", _nms_shapes, _from_host, since=10, host_inputs=(0, 1, 2, 3, 4),
             capture="unsupported", reason="data-dependent output shape (the boxes kept are chosen on the host)"),
]
