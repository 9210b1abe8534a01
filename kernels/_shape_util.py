"""Helpers of the shape ops (``ops_shape``): host-side value reading, host folding of small values,
device constants built without a host-to-device copy, and the larger kernels (Pad, Col2Im,
CenterCropPad, DepthToSpace, SpaceToDepth).

Every ``compute`` here follows the kernel rules (``kernels/README.md``): ``xp`` only, slices and
shapes from host values (attributes, ``node.host``, ``node.out_specs``), never a read of device data.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np

from ._fast import fill_value
from ._op import NodeInfo, OpKernel, Spec, normalize_axis

# Outputs up to this many elements whose inputs are all known on the host get their value computed
# on the host too (``Spec.value``), so shape subgraphs (Shape -> Slice -> Concat -> Reshape) need
# no readback at the Reshape.
FOLD_MAX = 1024
I64 = np.dtype(np.int64)


# ----------------------------------------------------------------------------- host values

def host_ints(node: NodeInfo, spec: Spec | None, what: str) -> list[int] | None:
    """The host value of an int input as a flat list (None when the input is absent)."""
    if spec is None:
        return None
    if spec.value is None:
        raise node.error(f"input {what!r} must be known on the host")
    v = np.asarray(spec.value).reshape(-1)
    if v.dtype.kind == "f" and np.all(np.isfinite(v)) and np.all(v == np.round(v)):
        v = v.astype(np.int64)  # Split-1 and Tile-1 take their sizes as float tensors
    if v.dtype.kind not in "iub":
        raise node.error(f"input {what!r} must hold integers, got {v.dtype} {v[:8]}")
    return [int(x) for x in v]


def host_scalar(node: NodeInfo, spec: Spec | None, what: str) -> Any:
    if spec is None or spec.value is None:
        raise node.error(f"input {what!r} must be known on the host")
    v = np.asarray(spec.value)
    if v.size != 1:
        raise node.error(f"input {what!r} must hold one value, got shape {v.shape}")
    return v.reshape(())[()]


def attr_ints(node: NodeInfo, key: str, default: Any = None) -> list[int] | None:
    v = node.attr(key, default)
    if v is None:
        return None
    return [int(x) for x in np.asarray(v).reshape(-1)]


def norm_axes(node: NodeInfo, axes: list[int], rank: int) -> list[int]:
    out = [normalize_axis(node, a, rank) for a in axes]
    if len(set(out)) != len(out):
        raise node.error(f"repeated axes in {axes}")
    return out


def prod(xs: Any) -> int:
    p = 1
    for x in xs:
        p *= int(x)
    return p


# ----------------------------------------------------------------------------- device constants

def device_const(xp: Any, value: np.ndarray) -> Any:
    """A device array equal to the host array ``value``, built with fills rather than a host copy
    (a pageable host-to-device copy is not allowed inside a CUDA graph capture)."""
    value = np.asarray(value)
    if value.size == 0:
        return xp.empty(value.shape, dtype=value.dtype)
    flat = value.reshape(-1)
    if bool(np.all(flat == flat[0])):
        return xp.full(value.shape, flat[0], dtype=value.dtype)
    if value.size <= 64:
        out = xp.empty((value.size,), dtype=value.dtype)
        for i, v in enumerate(flat):
            out[i] = v
        return out.reshape(value.shape)
    return xp.asarray(value)


# ----------------------------------------------------------------------------- kernels with folding

def op(op_type: str, shapes: Callable, compute: Callable, *, fold: bool = True, **kw: Any) -> OpKernel:
    """An ``OpKernel`` whose small outputs are also computed on the host (``Spec.value``) when every
    present input's value is known there: ``compute`` run with numpy, the same body as on the device."""
    if not fold:
        return OpKernel(op_type, shapes, compute, **kw)
    host_inputs = tuple(kw.get("host_inputs", ()))
    inner_into = kw.pop("into", None)

    def into(xp, node, outs, *arrays):
        """A single output whose value shape inference knows is written from the host value (one
        fill or one launch, ``_fast.fill_value``); otherwise the op's own ``into``, if any."""
        if len(outs) == 1 and fill_value(xp, outs[0], node.out_specs[0].value):
            return True
        return inner_into is not None and inner_into(xp, node, outs, *arrays)

    def shapes_folding(node: NodeInfo, specs: list[Spec | None]) -> list[Spec]:
        outs = list(shapes(node, specs))
        present = [s for s in specs if s is not None]
        if (
            any(s.value is None for s in outs)
            and all(s.value is not None and np.size(s.value) <= FOLD_MAX for s in present)
            and all(prod(s.shape) <= FOLD_MAX for s in outs)
        ):
            host = {i: specs[i].value for i in host_inputs if i < len(specs) and specs[i] is not None}
            call = node.for_run(tuple(outs), host)
            res = compute(np, call, *[None if s is None else np.asarray(s.value) for s in specs])
            outs = [
                s if s.value is not None else Spec(s.shape, s.dtype, np.asarray(r).astype(s.dtype).reshape(s.shape))
                for s, r in zip(outs, res)
            ]
        return outs

    return OpKernel(op_type, shapes_folding, compute, into=into, **kw)


# ----------------------------------------------------------------------------- runs along an axis

def _runs(idx: np.ndarray) -> list[tuple[int, int, int]]:
    """Split a host index vector into runs (first, step in {-1,0,1}, length)."""
    runs: list[tuple[int, int, int]] = []
    i, n = 0, len(idx)
    while i < n:
        if i + 1 < n and abs(int(idx[i + 1]) - int(idx[i])) <= 1:
            step = int(idx[i + 1]) - int(idx[i])
            j = i + 1
            while j + 1 < n and int(idx[j + 1]) - int(idx[j]) == step:
                j += 1
            runs.append((int(idx[i]), step, j - i + 1))
            i = j + 1
        else:
            runs.append((int(idx[i]), 1, 1))
            i += 1
    return runs


def take_axis_static(xp: Any, x: Any, axis: int, idx: np.ndarray) -> Any:
    """``xp.take(x, idx, axis)`` for a host index vector, built from slices (no index upload)."""
    pre = (slice(None),) * axis
    pieces = []
    for first, step, length in _runs(idx):
        if step == 1:
            pieces.append(x[pre + (slice(first, first + length),)])
        elif step == -1:
            stop = first - length
            pieces.append(x[pre + (slice(first, stop if stop >= 0 else None, -1),)])
        else:
            one = x[pre + (slice(first, first + 1),)]
            shape = list(one.shape)
            shape[axis] = length
            pieces.append(xp.broadcast_to(one, tuple(shape)))
    if len(pieces) == 1:
        return pieces[0]
    return xp.concatenate(pieces, axis=axis)


# ----------------------------------------------------------------------------- Pad

def _pad_index(mode: str, n: int, before: int, after: int) -> np.ndarray:
    i = np.arange(-before, n + after, dtype=np.int64)
    if mode == "edge":
        return np.clip(i, 0, n - 1)
    if mode == "wrap":
        return np.mod(i, n)
    # reflect (without repeating the edge), periodic with period 2(n-1)
    if n == 1:
        return np.zeros_like(i)
    period = 2 * (n - 1)
    m = np.mod(i, period)
    return np.where(m < n, m, period - m)


def _pad_params(node: NodeInfo, specs: list[Spec | None]) -> tuple[str, list[int], list[int]]:
    """(mode, pads_begin, pads_end) per axis of the data."""
    x = specs[0]
    rank = x.rank
    mode = node.attr("mode", "constant")
    if mode not in ("constant", "reflect", "edge", "wrap") or (mode == "wrap" and node.opset < 19):
        raise node.error(f"unsupported pad mode {mode!r}")
    if node.opset < 11:
        pads = attr_ints(node, "paddings" if node.opset < 2 else "pads")
        if pads is None:
            raise node.error("missing pads attribute")
        axes = list(range(rank))
    else:
        pads = host_ints(node, specs[1], "pads")
        axes_in = host_ints(node, specs[3], "axes") if len(specs) > 3 and node.opset >= 18 else None
        axes = norm_axes(node, axes_in, rank) if axes_in is not None else list(range(rank))
    if len(pads) != 2 * len(axes):
        raise node.error(f"pads has {len(pads)} values, expected {2 * len(axes)} (2 per axis)")
    begin, end = [0] * rank, [0] * rank
    for k, a in enumerate(axes):
        begin[a], end[a] = pads[k], pads[len(axes) + k]
    for a in range(rank):
        if x.shape[a] + begin[a] + end[a] < 0:
            raise node.error(f"pads {begin[a]}, {end[a]} remove more than axis {a} of size {x.shape[a]}")
        n = x.shape[a] + min(begin[a], 0) + min(end[a], 0)
        if mode != "constant" and n == 0 and (begin[a] > 0 or end[a] > 0):
            raise node.error(f"cannot {mode}-pad axis {a}, which is empty")
    return mode, begin, end


def pad_shapes(node: NodeInfo, specs: list[Spec | None]) -> list[Spec]:
    x = specs[0]
    _, begin, end = _pad_params(node, specs)
    return [Spec(tuple(d + b + e for d, b, e in zip(x.shape, begin, end)), x.dtype)]


def pad_compute(xp: Any, node: NodeInfo, x: Any, *rest: Any) -> tuple[Any]:
    specs: list[Spec | None] = [Spec(tuple(x.shape), x.dtype)]
    for i, a in enumerate(rest, start=1):
        specs.append(None if a is None else Spec(tuple(a.shape), a.dtype, node.host.get(i)))
    mode, begin, end = _pad_params(node, specs)
    # negative pads crop
    crop = tuple(slice(-min(b, 0), d + min(e, 0)) for d, b, e in zip(x.shape, begin, end))
    x = x[crop]
    begin = [max(b, 0) for b in begin]
    end = [max(e, 0) for e in end]
    if mode == "constant":
        out = xp.empty(node.out_specs[0].shape, dtype=x.dtype)
        cv = rest[1] if len(rest) > 1 and node.opset >= 11 else None
        if cv is not None:
            out[...] = xp.reshape(cv, ()).astype(x.dtype)
        else:
            value = node.attr("value", 0.0) if node.opset < 11 else 0
            out[...] = np.asarray(value).astype(x.dtype)[()]
        out[tuple(slice(b, b + d) for b, d in zip(begin, x.shape))] = x
        return (out,)
    for a in range(x.ndim):
        if begin[a] or end[a]:
            x = take_axis_static(xp, x, a, _pad_index(mode, x.shape[a], begin[a], end[a]))
    return (x,)


# ----------------------------------------------------------------------------- CenterCropPad

def _ccp_params(node: NodeInfo, specs: list[Spec | None]) -> tuple[tuple[int, ...], list[slice], list[slice]]:
    x = specs[0]
    shape = host_ints(node, specs[1], "shape")
    axes_attr = attr_ints(node, "axes")
    axes = norm_axes(node, axes_attr, x.rank) if axes_attr is not None else list(range(x.rank))
    if len(shape) != len(axes):
        raise node.error(f"shape has {len(shape)} values for {len(axes)} axes")
    new = list(x.shape)
    crop = [slice(0, d) for d in x.shape]
    pad = [slice(0, d) for d in x.shape]
    for a, sh in zip(axes, shape):
        dim = x.shape[a]
        if sh < 0:
            raise node.error(f"negative target size {sh} for axis {a}")
        new[a] = sh
        if sh < dim:
            d = (dim - sh) // 2
            crop[a] = slice(d, d + sh)
        elif sh > dim:
            d = (sh - dim) // 2
            pad[a] = slice(d, d + dim)
    return tuple(new), crop, pad


def ccp_shapes(node: NodeInfo, specs: list[Spec | None]) -> list[Spec]:
    new, _, _ = _ccp_params(node, specs)
    return [Spec(new, specs[0].dtype)]


def ccp_compute(xp: Any, node: NodeInfo, x: Any, shape: Any) -> tuple[Any]:
    specs = [Spec(tuple(x.shape), x.dtype), Spec(tuple(shape.shape), shape.dtype, node.host.get(1))]
    new, crop, pad = _ccp_params(node, specs)
    out = xp.zeros(new, dtype=x.dtype)
    out[tuple(pad)] = x[tuple(crop)]
    return (out,)


# ----------------------------------------------------------------------------- DepthToSpace / SpaceToDepth

def _blocksize(node: NodeInfo, x: Spec) -> int:
    b = node.attr("blocksize")
    if b is None or int(b) <= 0:
        raise node.error("blocksize must be a positive integer")
    if x.rank != 4:
        raise node.error(f"input must be 4-D (N, C, H, W), got shape {x.shape}")
    mode = node.attr("mode", "DCR")
    if mode not in ("DCR", "CRD"):
        raise node.error(f"unknown mode {mode!r}")
    return int(b)


def d2s_shapes(node: NodeInfo, specs: list[Spec | None]) -> list[Spec]:
    x = specs[0]
    b = _blocksize(node, x)
    n, c, h, w = x.shape
    if c % (b * b):
        raise node.error(f"channels {c} not divisible by blocksize^2 = {b * b}")
    return [Spec((n, c // (b * b), h * b, w * b), x.dtype)]


def d2s_compute(xp: Any, node: NodeInfo, x: Any) -> tuple[Any]:
    b = int(node.attr("blocksize"))
    n, c, h, w = x.shape
    cb = c // (b * b)
    if node.attr("mode", "DCR") == "DCR":
        t = xp.transpose(xp.reshape(x, (n, b, b, cb, h, w)), (0, 3, 4, 1, 5, 2))
    else:
        t = xp.transpose(xp.reshape(x, (n, cb, b, b, h, w)), (0, 1, 4, 2, 5, 3))
    return (xp.reshape(t, (n, cb, h * b, w * b)),)


def s2d_shapes(node: NodeInfo, specs: list[Spec | None]) -> list[Spec]:
    x = specs[0]
    b = _blocksize(node, x)
    n, c, h, w = x.shape
    if h % b or w % b:
        raise node.error(f"spatial dims {h}x{w} not divisible by blocksize {b}")
    return [Spec((n, c * b * b, h // b, w // b), x.dtype)]


def s2d_compute(xp: Any, node: NodeInfo, x: Any) -> tuple[Any]:
    b = int(node.attr("blocksize"))
    n, c, h, w = x.shape
    t = xp.reshape(x, (n, c, h // b, b, w // b, b))
    perm = (0, 3, 5, 1, 2, 4) if node.attr("mode", "DCR") == "DCR" else (0, 1, 3, 5, 2, 4)
    return (xp.reshape(xp.transpose(t, perm), (n, c * b * b, h // b, w // b)),)


# ----------------------------------------------------------------------------- Col2Im

def _col2im_params(node: NodeInfo, specs: list[Spec | None]):
    x = specs[0]
    image = host_ints(node, specs[1], "image_shape")
    block = host_ints(node, specs[2], "block_shape")
    nd = len(image)
    if len(block) != nd:
        raise node.error(f"image_shape {image} and block_shape {block} differ in length")
    strides = attr_ints(node, "strides") or [1] * nd
    dil = attr_ints(node, "dilations") or [1] * nd
    pads = attr_ints(node, "pads") or [0] * (2 * nd)
    if len(strides) != nd or len(dil) != nd or len(pads) != 2 * nd:
        raise node.error("strides/dilations/pads do not match the number of spatial dims")
    if x.rank != 3:
        raise node.error(f"input must be 3-D (N, C*prod(block_shape), L), got shape {x.shape}")
    bl = prod(block)
    if bl <= 0 or x.shape[1] % bl:
        raise node.error(f"input dim 1 ({x.shape[1]}) not divisible by prod(block_shape) = {bl}")
    cols = [(image[i] + pads[i] + pads[nd + i] - (dil[i] * (block[i] - 1) + 1)) // strides[i] + 1 for i in range(nd)]
    if any(c <= 0 for c in cols) or prod(cols) != x.shape[2]:
        raise node.error(f"input dim 2 ({x.shape[2]}) does not match the {cols} sliding blocks")
    return image, block, strides, dil, pads, cols


def col2im_shapes(node: NodeInfo, specs: list[Spec | None]) -> list[Spec]:
    x = specs[0]
    image, block, *_ = _col2im_params(node, specs)
    return [Spec((x.shape[0], x.shape[1] // prod(block), *image), x.dtype)]


def col2im_compute(xp: Any, node: NodeInfo, x: Any, image_shape: Any, block_shape: Any) -> tuple[Any]:
    specs = [
        Spec(tuple(x.shape), x.dtype),
        Spec(tuple(image_shape.shape), image_shape.dtype, node.host.get(1)),
        Spec(tuple(block_shape.shape), block_shape.dtype, node.host.get(2)),
    ]
    image, block, strides, dil, pads, cols = _col2im_params(node, specs)
    nd = len(image)
    n, c = x.shape[0], x.shape[1] // prod(block)
    x = xp.reshape(x, (n, c, *block, *cols))
    padded = xp.zeros((n, c, *[image[i] + pads[i] + pads[nd + i] for i in range(nd)]), dtype=x.dtype)
    for off in np.ndindex(*block):
        dst = tuple(
            slice(off[i] * dil[i], off[i] * dil[i] + strides[i] * (cols[i] - 1) + 1, strides[i]) for i in range(nd)
        )
        key = (slice(None), slice(None)) + dst
        padded[key] = padded[key] + x[(slice(None), slice(None)) + tuple(off)]
    crop = tuple(slice(pads[i], pads[i] + image[i]) for i in range(nd))
    return (padded[(slice(None), slice(None)) + crop],)
