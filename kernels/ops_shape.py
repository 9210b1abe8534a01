"""shape ops: Shape, Size, Reshape, Flatten, Squeeze, Unsqueeze, Transpose, Concat, Split, Slice,
Expand, Tile, Pad, ConstantOfShape, Range, EyeLike, Trilu, DepthToSpace, SpaceToDepth,
CenterCropPad, Col2Im.

Values that decide output shapes (Reshape's shape, Slice's starts, Pad's pads...) are host inputs
(``host_inputs``); compute reads them from ``node.host`` and slices with Python ints. Small outputs
whose inputs are all known on the host also get their value computed there (``_shape_util.op``),
so shape subgraphs run without readbacks.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from ._fast import fill_value, permute_into, range_into, strided_copy_into
from ._launch import same_buffer
from ._op import NodeInfo, OpKernel, Spec, broadcast, normalize_axis
from ._shape_util import (
    I64,
    attr_ints,
    ccp_compute,
    ccp_shapes,
    col2im_compute,
    col2im_shapes,
    d2s_compute,
    d2s_shapes,
    device_const,
    host_ints,
    host_scalar,
    norm_axes,
    op,
    pad_compute,
    pad_shapes,
    prod,
    s2d_compute,
    s2d_shapes,
)

OPS: list[OpKernel] = []


def _host_specs(node: NodeInfo, arrays: tuple[Any, ...]) -> list[Spec | None]:
    """Specs rebuilt inside compute: shapes from the arrays, values from ``node.host``."""
    return [None if a is None else Spec(tuple(a.shape), a.dtype, node.host.get(i)) for i, a in enumerate(arrays)]


# ----------------------------------------------------------------------------- Shape, Size

def _shape_shapes(node, specs):
    x = specs[0]
    r = x.rank
    start, end = int(node.attr("start", 0)), node.attr("end")
    end = r if end is None else int(end)
    start = min(max(start + r if start < 0 else start, 0), r)
    end = min(max(end + r if end < 0 else end, 0), r)
    value = np.asarray(x.shape[start:end] if start < end else (), dtype=I64).reshape(-1)
    return [Spec(value.shape, I64, value)]


def _from_value(xp, node, *_):
    return (device_const(xp, node.out_specs[0].value),)


def _size_shapes(node, specs):
    return [Spec((), I64, np.asarray(prod(specs[0].shape), dtype=I64))]


def _value_into(xp, node, outs, *_):
    """The host-known value written with one fill or one launch (``_fast.fill_value``)."""
    return fill_value(xp, outs[0], node.out_specs[0].value)


OPS += [
    OpKernel("Shape", _shape_shapes, _from_value, into=_value_into, capture="safe"),
    OpKernel("Size", _size_shapes, _from_value, into=_value_into, capture="safe"),
]


# ----------------------------------------------------------------------------- Reshape, Flatten

def _reshape_target(node, in_shape, shape, allowzero):
    out, neg = [], -1
    for i, d in enumerate(shape):
        if d == 0 and not allowzero:
            if i >= len(in_shape):
                raise node.error(f"shape {shape}: 0 at index {i} copies a dim the input (rank {len(in_shape)}) lacks")
            d = in_shape[i]
        elif d == -1:
            if neg >= 0:
                raise node.error(f"shape {shape} has more than one -1")
            neg = i
        elif d < -1:
            raise node.error(f"shape {shape} has an invalid dim {d}")
        out.append(d)
    total = prod(in_shape)
    if neg >= 0:
        if allowzero and 0 in shape:
            raise node.error(f"shape {shape}: -1 together with 0 under allowzero=1")
        known = prod(d for i, d in enumerate(out) if i != neg)
        if known == 0 or total % known:
            raise node.error(f"cannot reshape {tuple(in_shape)} to {shape}")
        out[neg] = total // known
    if prod(out) != total:
        raise node.error(f"cannot reshape {tuple(in_shape)} ({total} elements) to {shape}")
    return tuple(out)


def _reshape_shapes(node, specs):
    x = specs[0]
    if node.opset < 5:
        shape = attr_ints(node, "shape")
        if shape is None:
            raise node.error("missing shape attribute")
    else:
        shape = host_ints(node, specs[1], "shape")
    allowzero = int(node.attr("allowzero", 0)) if node.opset >= 14 else 0
    return [Spec(_reshape_target(node, x.shape, shape, allowzero), x.dtype)]


def _reshape_compute(xp, node, x, *_):
    return (xp.reshape(x, node.out_specs[0].shape),)


def _reshape_into(xp, node, outs, x, *_):
    """When the executor cannot make the node a view (its input is a graph input or a paged
    weight, its output a graph output): a contiguous input copied into the output, one RawKernel
    on CuPy (``_fast.strided_copy_into``, the bytes of compute's reshape). Elsewhere: compute."""
    out = outs[0]
    if not x.flags.c_contiguous or x.size != out.size:
        return False
    return strided_copy_into(xp, out, x.reshape(out.shape))


def _flatten_shapes(node, specs):
    x = specs[0]
    axis = int(node.attr("axis", 1))
    r = x.rank
    if not -r <= axis <= r:
        raise node.error(f"axis {axis} out of range for rank {r}")
    axis = axis + r if axis < 0 else axis
    return [Spec((prod(x.shape[:axis]), prod(x.shape[axis:])), x.dtype)]


OPS += [
    op("Reshape", _reshape_shapes, _reshape_compute, until=4, into=_reshape_into, capture="safe"),
    op("Reshape", _reshape_shapes, _reshape_compute, since=5, host_inputs=(1,), into=_reshape_into, capture="safe"),
    op("Flatten", _flatten_shapes, _reshape_compute, into=_reshape_into, capture="safe"),
]


# ----------------------------------------------------------------------------- Squeeze, Unsqueeze

def _axes(node, specs, idx):
    if node.opset < 13:
        return attr_ints(node, "axes")
    return host_ints(node, specs[idx], "axes") if len(specs) > idx else None


def _squeeze_shapes(node, specs):
    x = specs[0]
    axes = _axes(node, specs, 1)
    if axes is None:
        axes = [i for i, d in enumerate(x.shape) if d == 1]
    axes = norm_axes(node, axes, x.rank)
    for a in axes:
        if x.shape[a] != 1:
            raise node.error(f"cannot squeeze axis {a} of size {x.shape[a]} (shape {x.shape})")
    return [Spec(tuple(d for i, d in enumerate(x.shape) if i not in axes), x.dtype)]


def _unsqueeze_shapes(node, specs):
    x = specs[0]
    axes = _axes(node, specs, 1)
    if axes is None:
        raise node.error("missing axes")
    r = x.rank + len(axes)
    axes = norm_axes(node, axes, r)
    dims = iter(x.shape)
    return [Spec(tuple(1 if i in axes else next(dims) for i in range(r)), x.dtype)]


OPS += [
    op("Squeeze", _squeeze_shapes, _reshape_compute, until=12, into=_reshape_into, capture="safe"),
    op("Squeeze", _squeeze_shapes, _reshape_compute, since=13, host_inputs=(1,), into=_reshape_into, capture="safe"),
    op("Unsqueeze", _unsqueeze_shapes, _reshape_compute, until=12, into=_reshape_into, capture="safe"),
    op("Unsqueeze", _unsqueeze_shapes, _reshape_compute, since=13, host_inputs=(1,), into=_reshape_into, capture="safe"),
]


# ----------------------------------------------------------------------------- Transpose, Concat

def _perm(node, rank):
    perm = attr_ints(node, "perm")
    if perm is None:
        return list(range(rank))[::-1]
    if sorted(perm) != list(range(rank)):
        raise node.error(f"perm {perm} is not a permutation of the {rank} axes")
    return perm


def _transpose_shapes(node, specs):
    x = specs[0]
    return [Spec(tuple(x.shape[p] for p in _perm(node, x.rank)), x.dtype)]


def _transpose_compute(xp, node, x):
    return (xp.transpose(x, _perm(node, x.ndim)),)


def _transpose_into(xp, node, outs, x):
    """One strided copy of the permuted view into the output (compute's view, copied): one
    RawKernel on CuPy where it can (``_fast.permute_into``), else ``copyto``."""
    perm = _perm(node, x.ndim)
    if not permute_into(xp, outs[0], x, tuple(perm)):
        xp.copyto(outs[0], xp.transpose(x, perm))
    return True


def _concat_shapes(node, specs):
    xs = [s for s in specs if s is not None]
    if not xs:
        raise node.error("no inputs")
    r = xs[0].rank
    axis = normalize_axis(node, int(node.attr("axis", 1 if node.opset < 4 else 0)), r)
    out = list(xs[0].shape)
    for s in xs[1:]:
        if s.rank != r or any(a != b for i, (a, b) in enumerate(zip(s.shape, xs[0].shape)) if i != axis):
            raise node.error(f"inputs of shapes {[t.shape for t in xs]} do not concatenate on axis {axis}")
        if s.dtype != xs[0].dtype:
            raise node.error(f"inputs of dtypes {[str(t.dtype) for t in xs]} differ")
        out[axis] += s.shape[axis]
    return [Spec(tuple(out), xs[0].dtype)]


def _concat_compute(xp, node, *xs):
    xs = [x for x in xs if x is not None]
    axis = int(node.attr("axis", 1 if node.opset < 4 else 0))
    axis = axis + xs[0].ndim if axis < 0 else axis
    return (xp.concatenate(xs, axis=axis),)


def _concat_into(xp, node, outs, *xs):
    """``concatenate(..., out=)`` for inputs of the output's dtype not sharing its memory."""
    out = outs[0]
    xs = [x for x in xs if x is not None]
    if any(x.dtype != out.dtype for x in xs) or same_buffer(xp, out, *xs):
        return False
    axis = int(node.attr("axis", 1 if node.opset < 4 else 0))
    axis = axis + xs[0].ndim if axis < 0 else axis
    xp.concatenate(xs, axis=axis, out=out)
    return True


OPS += [
    op("Transpose", _transpose_shapes, _transpose_compute, into=_transpose_into, capture="safe"),
    op("Concat", _concat_shapes, _concat_compute, into=_concat_into, capture="safe"),
]


# ----------------------------------------------------------------------------- Split

def _split_sizes(node, specs):
    x = specs[0]
    if x.rank == 0:
        raise node.error("input must have rank >= 1, got a scalar")
    axis = normalize_axis(node, int(node.attr("axis", 0)), x.rank)
    dim, n = x.shape[axis], node.n_outputs
    split = None
    if node.opset < 13 and node.opset >= 2:
        split = attr_ints(node, "split")
    else:
        if len(specs) > 1 and specs[1] is not None:
            split = host_ints(node, specs[1], "split")
        elif node.opset < 2:
            split = attr_ints(node, "split")
    if split is not None:
        if len(split) != n or sum(split) != dim or any(s < 0 for s in split):
            raise node.error(f"split {split} does not divide axis {axis} of size {dim} into {n} outputs")
        return axis, split
    num = node.attr("num_outputs") if node.opset >= 18 else None
    if num is not None:
        if int(num) != n:
            raise node.error(f"num_outputs={num} but the node has {n} outputs")
        chunk = -(-dim // n)
        return axis, [max(0, min(chunk, dim - i * chunk)) for i in range(n)]
    if dim % n:
        raise node.error(f"axis {axis} of size {dim} does not split evenly into {n} outputs")
    return axis, [dim // n] * n


def _split_shapes(node, specs):
    x = specs[0]
    axis, sizes = _split_sizes(node, specs)
    return [Spec(x.shape[:axis] + (s,) + x.shape[axis + 1:], x.dtype) for s in sizes]


def _split_compute(xp, node, x, *rest):
    axis, sizes = _split_sizes(node, _host_specs(node, (x, *rest)))
    outs, pos = [], 0
    for s in sizes:
        outs.append(x[(slice(None),) * axis + (slice(pos, pos + s),)])
        pos += s
    return tuple(outs)


OPS += [
    op("Split", _split_shapes, _split_compute, until=1, host_inputs=(1,), capture="safe"),
    op("Split", _split_shapes, _split_compute, since=2, until=12, capture="safe"),
    op("Split", _split_shapes, _split_compute, since=13, host_inputs=(1,), capture="safe"),
]


# ----------------------------------------------------------------------------- Slice

def _slice_params(node, specs):
    """(python slices for the input, output shape)."""
    x = specs[0]
    if node.opset < 10:
        starts, ends, axes = attr_ints(node, "starts"), attr_ints(node, "ends"), attr_ints(node, "axes")
        steps = None
        if starts is None or ends is None:
            raise node.error("missing starts/ends attributes")
    else:
        starts = host_ints(node, specs[1], "starts")
        ends = host_ints(node, specs[2], "ends")
        axes = host_ints(node, specs[3], "axes") if len(specs) > 3 else None
        steps = host_ints(node, specs[4], "steps") if len(specs) > 4 else None
    if axes is None:
        axes = list(range(len(starts)))
    if steps is None:
        steps = [1] * len(starts)
    if not len(starts) == len(ends) == len(axes) == len(steps):
        raise node.error(f"starts {starts}, ends {ends}, axes {axes}, steps {steps} differ in length")
    axes = norm_axes(node, axes, x.rank)
    slices = [slice(None)] * x.rank
    shape = list(x.shape)
    for a, s, e, st in zip(axes, starts, ends, steps):
        dim = x.shape[a]
        if st == 0:
            raise node.error(f"step 0 on axis {a}")
        s = s + dim if s < 0 else s
        e = e + dim if e < 0 else e
        if st > 0:
            s, e = min(max(s, 0), dim), min(max(e, 0), dim)
        else:
            s, e = min(max(s, 0), dim - 1), min(max(e, -1), dim - 1)
        n = len(range(s, e, st))
        shape[a] = n
        if n == 0:
            slices[a] = slice(0, 0)
        else:
            slices[a] = slice(s, e if e >= 0 else None, st)
    return tuple(slices), tuple(shape)


def _slice_shapes(node, specs):
    return [Spec(_slice_params(node, specs)[1], specs[0].dtype)]


def _slice_compute(xp, node, x, *rest):
    slices, _ = _slice_params(node, _host_specs(node, (x, *rest)))
    return (x[slices],)


def _slice_into(xp, node, outs, x, *rest):
    """One strided copy of compute's view into the output (one RawKernel on CuPy where it can:
    ``_fast.strided_copy_into``)."""
    view = _slice_compute(xp, node, x, *rest)[0]
    if not strided_copy_into(xp, outs[0], view):
        xp.copyto(outs[0], view)
    return True


OPS += [
    op("Slice", _slice_shapes, _slice_compute, until=9, into=_slice_into, capture="safe"),
    op("Slice", _slice_shapes, _slice_compute, since=10, host_inputs=(1, 2, 3, 4), into=_slice_into, capture="safe"),
]


# ----------------------------------------------------------------------------- Expand, Tile

def _expand_shapes(node, specs):
    x = specs[0]
    shape = host_ints(node, specs[1], "shape")
    return [Spec(broadcast(node, x.shape, shape), x.dtype)]


def _expand_compute(xp, node, x, _shape):
    return (xp.broadcast_to(x, node.out_specs[0].shape),)


def _expand_into(xp, node, outs, x, _shape):
    """One broadcasting copy into the output."""
    xp.copyto(outs[0], xp.broadcast_to(x, node.out_specs[0].shape))
    return True


def _tile_reps(node, specs):
    x = specs[0]
    if node.opset < 6:
        tiles = int(host_scalar(node, specs[1], "tiles"))
        axis = normalize_axis(node, int(host_scalar(node, specs[2], "axis")), x.rank)
        reps = [1] * x.rank
        reps[axis] = tiles
    else:
        reps = host_ints(node, specs[1], "repeats")
    if len(reps) != x.rank or any(r < 0 for r in reps):
        raise node.error(f"repeats {reps} invalid for input of rank {x.rank}")
    return reps


def _tile_shapes(node, specs):
    x = specs[0]
    return [Spec(tuple(d * r for d, r in zip(x.shape, _tile_reps(node, specs))), x.dtype)]


def _tile_compute(xp, node, x, *rest):
    reps = _tile_reps(node, _host_specs(node, (x, *rest)))
    return (xp.tile(x, tuple(reps)),)


OPS += [
    op("Expand", _expand_shapes, _expand_compute, since=8, host_inputs=(1,), into=_expand_into, capture="safe"),
    op("Tile", _tile_shapes, _tile_compute, until=5, host_inputs=(1, 2), capture="safe"),
    op("Tile", _tile_shapes, _tile_compute, since=6, host_inputs=(1,), capture="safe"),
]


# ----------------------------------------------------------------------------- Pad

OPS += [
    op("Pad", pad_shapes, pad_compute, until=10, capture="safe"),
    op("Pad", pad_shapes, pad_compute, since=11, host_inputs=(1, 3), capture="safe"),
]


# ----------------------------------------------------------------------------- ConstantOfShape, Range, EyeLike

def _cos_value(node):
    v = node.attr("value")
    if v is None:
        return np.zeros((), dtype=np.float32)
    v = np.asarray(v)
    if v.size != 1:
        raise node.error(f"value must hold one element, got shape {v.shape}")
    return v.reshape(())


def _cos_shapes(node, specs):
    shape = host_ints(node, specs[0], "input")
    if any(d < 0 for d in shape):
        raise node.error(f"negative dim in shape {shape}")
    return [Spec(tuple(shape), _cos_value(node).dtype)]


def _cos_compute(xp, node, _shape):
    v = _cos_value(node)
    return (xp.full(node.out_specs[0].shape, v[()], dtype=v.dtype),)


def _range_compute_dtype(node, dt):
    if dt == np.float16 or dt.name == "bfloat16":  # accumulate wider (stash_type from opset 27)
        st = int(node.attr("stash_type", 1)) if node.opset >= 27 else 1
        return np.dtype(np.float64) if st == 11 else np.dtype(np.float32)
    return dt


def _range_params(node, specs):
    start = host_scalar(node, specs[0], "start")
    limit = host_scalar(node, specs[1], "limit")
    delta = host_scalar(node, specs[2], "delta")
    dt = specs[0].dtype
    if dt.kind in "iu":
        s, l, d = int(start), int(limit), int(delta)
        if d == 0:
            raise node.error("delta is 0")
        n = max(-(-(l - s) // d), 0)
    else:
        s, l, d = float(start), float(limit), float(delta)
        if d == 0 or not math.isfinite(d) or not math.isfinite(s) or not math.isfinite(l):
            raise node.error(f"invalid range start={s} limit={l} delta={d}")
        n = max(math.ceil((l - s) / d), 0)
    return s, d, n


def _range_shapes(node, specs):
    dt = specs[0].dtype
    if specs[1].dtype != dt or specs[2].dtype != dt:
        raise node.error("start, limit and delta must share a dtype")
    _, _, n = _range_params(node, specs)
    return [Spec((n,), dt)]


def _range_compute(xp, node, *arrays):
    s, d, n = _range_params(node, _host_specs(node, arrays))
    dt = node.out_specs[0].dtype
    cdt = _range_compute_dtype(node, dt)
    out = xp.arange(n, dtype=cdt) * cdt.type(d) + cdt.type(s)
    return (out.astype(dt),)


def _range_into(xp, node, outs, *arrays):
    """int32/int64: ``start + i * delta`` in the output's integer type, one ElementwiseKernel on CuPy
    (``_fast.range_into``: the same wrapping arithmetic as compute's arange), numpy's arange on numpy."""
    s, d, _ = _range_params(node, _host_specs(node, arrays))
    return range_into(xp, outs[0], int(s), int(d)) if outs[0].dtype.kind == "i" else False


def _eyelike_dtype(node, x):
    dt = node.attr("dtype")
    if dt is None:
        return x.dtype
    from onnx import helper  # host only: ONNX type enum to numpy dtype

    return np.dtype(helper.tensor_dtype_to_np_dtype(int(dt)))


def _eyelike_shapes(node, specs):
    x = specs[0]
    if x.rank != 2:
        raise node.error(f"input must be 2-D, got shape {x.shape}")
    return [Spec(x.shape, _eyelike_dtype(node, x))]


def _eyelike_compute(xp, node, x):
    spec = node.out_specs[0]
    return (xp.eye(spec.shape[0], spec.shape[1], k=int(node.attr("k", 0)), dtype=spec.dtype),)


OPS += [
    op("ConstantOfShape", _cos_shapes, _cos_compute, since=9, host_inputs=(0,), capture="safe"),
    op("Range", _range_shapes, _range_compute, since=11, host_inputs=(0, 1, 2), into=_range_into, capture="safe"),
    op("EyeLike", _eyelike_shapes, _eyelike_compute, since=9, capture="safe"),
]


# ----------------------------------------------------------------------------- Trilu

def _trilu_shapes(node, specs):
    x = specs[0]
    if x.rank < 2:
        raise node.error(f"input must have rank >= 2, got shape {x.shape}")
    if len(specs) > 1 and specs[1] is not None and prod(specs[1].shape) != 1:
        raise node.error(f"k must be a scalar, got shape {specs[1].shape}")
    return [Spec(x.shape, x.dtype)]


def _trilu_compute(xp, node, x, k=None):
    n, m = x.shape[-2], x.shape[-1]
    diag = xp.arange(m, dtype=np.int64)[None, :] - xp.arange(n, dtype=np.int64)[:, None]
    kk = 0 if k is None else xp.reshape(k, ()).astype(np.int64)
    mask = diag >= kk if int(node.attr("upper", 1)) else diag <= kk
    return (xp.where(mask, x, xp.zeros((), dtype=x.dtype)),)


OPS += [op("Trilu", _trilu_shapes, _trilu_compute, since=14, capture="safe")]


# ----------------------------------------------------------------------------- DepthToSpace, SpaceToDepth, CenterCropPad, Col2Im

OPS += [
    op("DepthToSpace", d2s_shapes, d2s_compute, capture="safe"),
    op("SpaceToDepth", s2d_shapes, s2d_compute, capture="safe"),
    op("CenterCropPad", ccp_shapes, ccp_compute, since=18, host_inputs=(1,), capture="safe"),
    op("Col2Im", col2im_shapes, col2im_compute, since=18, host_inputs=(1, 2), capture="safe"),
]
