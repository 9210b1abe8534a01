"""index ops: Gather*, Scatter*, OneHot, TopK, ArgMax/ArgMin, CumSum/CumProd, NonZero, Compress,
Unique, ReverseSequence.

Device-side indices are never read back. Every index input the ONNX spec requires in range is
declared in ``index_checks`` (``_latch.IndexCheck``): the executor flags an out-of-range value into
the runtime's error latch (``DeviceAssert`` naming the node at the next synchronising read), and
the kernel itself wraps negatives per ONNX and clamps (``_index_util``), so it never faults.
OneHot is defined for any index (out of range: all "off"), so it declares none.
Scatter reductions use a sort-based segmented scan, not ``ufunc.at`` (``_index_util.scatter_reduce``).

Data-dependent output shapes: NonZero and Unique read their data input on the host
(``host_inputs``), compute the result in ``shapes()`` with numpy and hand it to ``compute``
through ``Spec.value``; Compress reads only its condition on the host and gathers the data on the
device. All three are ``capture="unsupported"``.
"""

from __future__ import annotations

import numpy as np

from ._index_util import (
    REDUCTIONS,
    fix_index,
    host_int,
    linear_along_axis,
    prod,
    require_int,
    scatter_reduce,
)
from ._fast import gather
from ._latch import IndexCheck
from ._op import OpKernel, Spec, normalize_axis

OPS: list[OpKernel] = []

_I64 = np.dtype(np.int64)
_DATA_DEP = dict(capture="unsupported", reason="data-dependent output shape")


# -- Gather family ---------------------------------------------------------------------------------

def _gather_shapes(node, specs):
    data, idx = specs[0], specs[1]
    require_int(node, idx, "indices")
    if data.rank < 1:
        raise node.error("data must have rank >= 1")
    axis = normalize_axis(node, node.attr("axis", 0), data.rank)
    if data.shape[axis] == 0 and prod(idx.shape) > 0:
        raise node.error(f"cannot gather {prod(idx.shape)} indices from an empty axis {axis}")
    return [Spec(data.shape[:axis] + idx.shape + data.shape[axis + 1:], data.dtype)]


def _gather(xp, node, data, idx):
    axis = normalize_axis(node, node.attr("axis", 0), data.ndim)
    return (xp.take(data, fix_index(xp, idx, data.shape[axis]), axis=axis),)


def _axis_bound(node, specs, default_axis=0):
    data = specs[0]
    axis = node.attr("axis", default_axis)
    return data.shape[axis % data.rank] if data.rank else 1


# Index inputs validated on the device into the runtime's error latch (see kernels/_latch.py).
_GATHER_CHECK = lambda node, specs: [(1, _axis_bound(node, specs))]  # noqa: E731

def _gather_into(xp, node, outs, data, idx):
    """One launch on CuPy (``_fast.gather``: wrap, clamp and copy in one kernel), ``take(out=)`` on numpy."""
    return gather(xp, outs[0], data, idx, normalize_axis(node, node.attr("axis", 0), data.ndim))


OPS.append(OpKernel("Gather", _gather_shapes, _gather, since=1, index_checks=_GATHER_CHECK, into=_gather_into, capture="safe"))


def _check_elements_indices(node, data, idx, verb):
    """The shape rules GatherElements and ScatterElements share; returns the normalized axis."""
    require_int(node, idx, "indices")
    if data.rank < 1 or idx.rank != data.rank:
        raise node.error(f"indices rank {idx.rank} must equal data rank {data.rank} (>= 1)")
    axis = normalize_axis(node, node.attr("axis", 0), data.rank)
    for d in range(data.rank):
        if d != axis and idx.shape[d] > data.shape[d]:
            raise node.error(f"indices dim {d} ({idx.shape[d]}) exceeds data dim {data.shape[d]}")
    if data.shape[axis] == 0 and prod(idx.shape) > 0:
        raise node.error(f"cannot {verb} an empty axis {axis}")
    return axis


def _gather_elements_shapes(node, specs):
    data, idx = specs[0], specs[1]
    _check_elements_indices(node, data, idx, "gather from")
    return [Spec(idx.shape, data.dtype)]


def _gather_elements(xp, node, data, idx):
    axis = normalize_axis(node, node.attr("axis", 0), data.ndim)
    lin = linear_along_axis(xp, idx, axis, data.shape)
    return (xp.take(data.reshape(-1), lin),)


OPS.append(OpKernel("GatherElements", _gather_elements_shapes, _gather_elements, since=11,
                    index_checks=_GATHER_CHECK, capture="safe"))


def _gather_nd_dims(node, dshape, ishape):
    b = int(node.attr("batch_dims", 0))
    if len(dshape) < 1 or len(ishape) < 1:
        raise node.error("data and indices must have rank >= 1")
    if not 0 <= b < min(len(dshape), len(ishape)):
        raise node.error(f"batch_dims {b} must be in [0, min(rank(data), rank(indices)))")
    if tuple(dshape[:b]) != tuple(ishape[:b]):
        raise node.error(f"batch dims differ: data {tuple(dshape[:b])}, indices {tuple(ishape[:b])}")
    m = int(ishape[-1])
    if b + m > len(dshape):
        raise node.error(f"indices.shape[-1] = {m} too large for data rank {len(dshape)} with batch_dims {b}")
    return b, m


def _gather_nd_shapes(node, specs):
    data, idx = specs[0], specs[1]
    require_int(node, idx, "indices")
    b, m = _gather_nd_dims(node, data.shape, idx.shape)
    if prod(idx.shape[:-1]) > 0 and any(d == 0 for d in data.shape[b:b + m]):
        raise node.error("cannot gather from an empty dimension")
    return [Spec(tuple(idx.shape[:-1]) + tuple(data.shape[b + m:]), data.dtype)]


def _gather_nd(xp, node, data, idx):
    b, m = _gather_nd_dims(node, data.shape, idx.shape)
    B = prod(data.shape[:b])
    dims = data.shape[b:b + m]
    N = prod(idx.shape[b:-1])
    R = prod(data.shape[b + m:])
    idx3 = idx.reshape(B, N, m)
    rows = xp.zeros((B, N), dtype=xp.int64)
    for j in range(m):
        rows = rows * dims[j] + fix_index(xp, idx3[:, :, j], dims[j])
    data3 = data.reshape(B, prod(dims), R)
    out = data3[xp.arange(B, dtype=xp.int64).reshape(-1, 1), rows]
    return (out.reshape(node.out_specs[0].shape),)


def _gather_nd_check(node, specs):
    """Each index tuple's column j addresses data axis batch_dims + j: valid in [-dim, dim)."""
    b, m = _gather_nd_dims(node, specs[0].shape, specs[1].shape)
    dims = specs[0].shape[b:b + m]
    return [IndexCheck(1, tuple(-d for d in dims), tuple(dims))]


OPS.append(OpKernel("GatherND", _gather_nd_shapes, _gather_nd, since=11, index_checks=_gather_nd_check, capture="safe"))


# -- Scatter family --------------------------------------------------------------------------------

def _reduction(node):
    red = node.attr("reduction", "none")
    allowed = ("none",) if node.opset < 16 or node.op_type == "Scatter" else \
        ("none", "add", "mul") if node.opset < 18 else REDUCTIONS
    if red not in allowed:
        raise node.error(f"reduction {red!r} not supported at this opset (allowed: {', '.join(allowed)})")
    return red


def _scatter_elements_shapes(node, specs):
    data, idx, upd = specs[0], specs[1], specs[2]
    _reduction(node)
    if upd.shape != idx.shape:
        raise node.error(f"updates shape {upd.shape} must equal indices shape {idx.shape}")
    _check_elements_indices(node, data, idx, "scatter into")
    return [Spec(data.shape, data.dtype)]


def _scatter_elements(xp, node, data, idx, upd):
    axis = normalize_axis(node, node.attr("axis", 0), data.ndim)
    rows = linear_along_axis(xp, idx, axis, data.shape).reshape(-1)
    out = xp.array(data, copy=True).reshape(-1, 1)
    out = scatter_reduce(xp, out, rows, upd.reshape(-1, 1), _reduction(node))
    return (out.reshape(data.shape),)


OPS.append(OpKernel("ScatterElements", _scatter_elements_shapes, _scatter_elements, since=11,
                    index_checks=_GATHER_CHECK, capture="safe"))
# Scatter (opset 9-10, deprecated in 11) is ScatterElements without reductions.
OPS.append(OpKernel("Scatter", _scatter_elements_shapes, _scatter_elements, since=9, until=10,
                    index_checks=_GATHER_CHECK, capture="safe"))


def _scatter_nd_shapes(node, specs):
    data, idx, upd = specs[0], specs[1], specs[2]
    require_int(node, idx, "indices")
    _reduction(node)
    if data.rank < 1 or idx.rank < 1:
        raise node.error("data and indices must have rank >= 1")
    k = idx.shape[-1]
    if k > data.rank:
        raise node.error(f"indices.shape[-1] = {k} exceeds data rank {data.rank}")
    want = tuple(idx.shape[:-1]) + tuple(data.shape[k:])
    if upd.shape != want:
        raise node.error(f"updates shape {upd.shape} must be {want}")
    if prod(idx.shape[:-1]) > 0 and any(d == 0 for d in data.shape[:k]):
        raise node.error("cannot scatter into an empty dimension")
    return [Spec(data.shape, data.dtype)]


def _scatter_nd(xp, node, data, idx, upd):
    k = idx.shape[-1]
    dims = data.shape[:k]
    N = prod(idx.shape[:-1])
    R = prod(data.shape[k:])
    idx2 = idx.reshape(N, k)
    rows = xp.zeros((N,), dtype=xp.int64)
    for j in range(k):
        rows = rows * dims[j] + fix_index(xp, idx2[:, j], dims[j])
    out = xp.array(data, copy=True).reshape(prod(dims), R)
    out = scatter_reduce(xp, out, rows, upd.reshape(N, R), _reduction(node))
    return (out.reshape(data.shape),)


def _scatter_nd_check(node, specs):
    """Column j of each index tuple addresses data axis j: valid in [-dim, dim)."""
    dims = specs[0].shape[:specs[1].shape[-1]]
    return [IndexCheck(1, tuple(-d for d in dims), tuple(dims))]


OPS.append(OpKernel("ScatterND", _scatter_nd_shapes, _scatter_nd, since=11, index_checks=_scatter_nd_check, capture="safe"))


# -- OneHot ----------------------------------------------------------------------------------------

def _one_hot_depth(node, spec):
    depth = host_int(node, spec, "depth")
    if depth < 1:
        raise node.error(f"depth must be positive, got {depth}")
    return depth


def _one_hot_shapes(node, specs):
    idx, vals = specs[0], specs[2]
    depth = _one_hot_depth(node, specs[1])
    if prod(vals.shape) != 2:
        raise node.error(f"values must hold 2 elements [off, on], got shape {vals.shape}")
    r = idx.rank
    axis = node.attr("axis", -1)
    if not -r - 1 <= axis <= r:
        raise node.error(f"axis {axis} out of range for output rank {r + 1}")
    axis %= r + 1
    return [Spec(idx.shape[:axis] + (depth,) + idx.shape[axis:], vals.dtype)]


def _one_hot(xp, node, idx, _depth, vals):
    r = idx.ndim
    axis = node.attr("axis", -1) % (r + 1)
    depth = node.out_specs[0].shape[axis]
    i = idx.astype(xp.int64)  # non-integer indices are cast to int64 (ONNX)
    i = xp.where(i < 0, i + depth, i)
    tshape = [1] * (r + 1)
    tshape[axis] = depth
    mask = xp.expand_dims(i, axis) == xp.arange(depth, dtype=xp.int64).reshape(tshape)
    v = vals.reshape(-1)
    return (xp.where(mask, v[1], v[0]),)


OPS.append(OpKernel("OneHot", _one_hot_shapes, _one_hot, since=9, host_inputs=(1,), capture="safe"))


# -- TopK ------------------------------------------------------------------------------------------

def _topk_k(node, specs):
    return node.attr("k") if node.opset < 10 else host_int(node, specs[1], "K")


def _topk_shapes(node, specs):
    x = specs[0]
    if x.rank < 1:
        raise node.error("input must have rank >= 1")
    axis = normalize_axis(node, node.attr("axis", -1), x.rank)
    k = _topk_k(node, specs)
    if k is None or not 0 <= k <= x.shape[axis]:
        raise node.error(f"k={k} must be in [0, {x.shape[axis]}] (size of axis {axis})")
    shape = x.shape[:axis] + (int(k),) + x.shape[axis + 1:]
    return [Spec(shape, x.dtype), Spec(shape, _I64)]


def _topk(xp, node, x, _k=None):
    axis = normalize_axis(node, node.attr("axis", -1), x.ndim)
    k = node.out_specs[0].shape[axis]
    n = x.shape[axis]
    if node.attr("largest", 1):
        # Descending with ties by lower index: stable ascending sort of the flipped axis, reversed.
        order = xp.flip(xp.argsort(xp.flip(x, axis), axis=axis, kind="stable"), axis)
        order = (n - 1) - order
    else:
        order = xp.argsort(x, axis=axis, kind="stable")
    idx = xp.take(order, xp.arange(k, dtype=xp.int64), axis=axis).astype(xp.int64)
    return (xp.take_along_axis(x, idx, axis=axis), idx)


OPS.append(OpKernel("TopK", _topk_shapes, _topk, since=1, until=9, capture="safe"))
OPS.append(OpKernel("TopK", _topk_shapes, _topk, since=10, host_inputs=(1,), capture="safe"))


# -- ArgMax / ArgMin -------------------------------------------------------------------------------

def _arg_shapes(node, specs):
    x = specs[0]
    r = max(x.rank, 1)
    axis = normalize_axis(node, node.attr("axis", 0), r)
    if x.rank == 0:
        raise node.error("input must have rank >= 1")
    if x.shape[axis] == 0:
        raise node.error(f"cannot take {node.op_type} over empty axis {axis}")
    if node.attr("keepdims", 1):
        shape = x.shape[:axis] + (1,) + x.shape[axis + 1:]
    else:
        shape = x.shape[:axis] + x.shape[axis + 1:]
    return [Spec(shape, _I64)]


def _arg(fn_name):
    def compute(xp, node, x):
        fn = getattr(xp, fn_name)
        axis = normalize_axis(node, node.attr("axis", 0), x.ndim)
        if node.attr("select_last_index", 0):
            r = (x.shape[axis] - 1) - fn(xp.flip(x, axis), axis=axis)
        else:
            r = fn(x, axis=axis)
        return (r.astype(xp.int64).reshape(node.out_specs[0].shape),)
    return compute


OPS.append(OpKernel("ArgMax", _arg_shapes, _arg("argmax"), since=1, capture="safe"))
OPS.append(OpKernel("ArgMin", _arg_shapes, _arg("argmin"), since=1, capture="safe"))


# -- CumSum / CumProd ------------------------------------------------------------------------------

def _cum_shapes(node, specs):
    x = specs[0]
    if x.rank < 1:
        raise node.error("input must have rank >= 1")
    if specs[1] is not None and specs[1].dtype.kind not in "iu":
        raise node.error(f"axis must be an integer tensor, got {specs[1].dtype}")
    normalize_axis(node, host_int(node, specs[1], "axis"), x.rank)
    return [Spec(x.shape, x.dtype)]


def _cum(fn_name, ident):
    def compute(xp, node, x, _axis):
        axis = normalize_axis(node, int(np.asarray(node.host[1]).reshape(-1)[0]), x.ndim)
        reverse, exclusive = node.attr("reverse", 0), node.attr("exclusive", 0)
        y = xp.flip(x, axis) if reverse else x
        c = getattr(xp, fn_name)(y, axis=axis, dtype=x.dtype)
        n = x.shape[axis]
        if exclusive and n > 0:
            head_shape = list(x.shape)
            head_shape[axis] = 1
            sl = [slice(None)] * x.ndim
            sl[axis] = slice(0, n - 1)
            c = xp.concatenate([xp.full(head_shape, ident, dtype=x.dtype), c[tuple(sl)]], axis=axis)
        return (xp.flip(c, axis) if reverse else c,)
    return compute


OPS.append(OpKernel("CumSum", _cum_shapes, _cum("cumsum", 0), since=11, host_inputs=(1,), capture="safe"))
OPS.append(OpKernel("CumProd", _cum_shapes, _cum("cumprod", 1), since=26, host_inputs=(1,), capture="safe"))


# -- ReverseSequence -------------------------------------------------------------------------------

def _rev_axes(node, rank):
    t = normalize_axis(node, node.attr("time_axis", 0), rank)
    b = normalize_axis(node, node.attr("batch_axis", 1), rank)
    if t == b:
        raise node.error(f"time_axis and batch_axis must differ (both {t})")
    return t, b


def _reverse_sequence_shapes(node, specs):
    x, lens = specs[0], specs[1]
    require_int(node, lens, "sequence_lens")
    if x.rank < 2:
        raise node.error("input must have rank >= 2")
    t, b = _rev_axes(node, x.rank)
    if lens.shape != (x.shape[b],):
        raise node.error(f"sequence_lens shape {lens.shape} must be ({x.shape[b]},) (the batch size)")
    return [Spec(x.shape, x.dtype)]


def _reverse_sequence(xp, node, x, lens):
    t, b = _rev_axes(node, x.ndim)
    T, B = x.shape[t], x.shape[b]
    tshape, bshape = [1] * x.ndim, [1] * x.ndim
    tshape[t], bshape[b] = T, B
    L = xp.clip(lens.astype(xp.int64), 0, T).reshape(bshape)
    pos = xp.arange(T, dtype=xp.int64).reshape(tshape)
    src = xp.where(pos < L, L - 1 - pos, pos)
    return (xp.take_along_axis(x, xp.broadcast_to(src, x.shape), axis=t),)


def _reverse_sequence_check(node, specs):
    """sequence_lens lie in [0, T] (T: the time axis), as ONNX Runtime requires."""
    t, _ = _rev_axes(node, specs[0].rank)
    return [IndexCheck(1, 0, specs[0].shape[t] + 1)]


OPS.append(OpKernel("ReverseSequence", _reverse_sequence_shapes, _reverse_sequence, since=10,
                    index_checks=_reverse_sequence_check, capture="safe"))


# -- data-dependent shapes: NonZero, Compress, Unique ---------------------------------------------

def _host_value(node, spec, what):
    if spec is None or spec.value is None:
        raise node.error(f"input {what!r} must be known on the host")
    return np.asarray(spec.value)


def _nonzero_shapes(node, specs):
    x = _host_value(node, specs[0], "X")
    if x.ndim == 0:
        res = np.zeros((0, int(x != 0)), dtype=np.int64)
    else:
        res = np.stack(np.nonzero(x)).astype(np.int64).reshape(x.ndim, -1)
    return [Spec(res.shape, _I64, res)]


def _from_host_outputs(xp, node, *_arrays):
    return tuple(xp.asarray(s.value) for s in node.out_specs)


OPS.append(OpKernel("NonZero", _nonzero_shapes, _from_host_outputs, since=9, host_inputs=(0,), **_DATA_DEP))


def _compress_plan(node, data_shape, cond):
    cond = np.asarray(cond)
    if cond.ndim != 1:
        raise node.error(f"condition must be 1-D, got shape {cond.shape}")
    axis = node.attr("axis")
    if axis is None:
        n = prod(data_shape)
    else:
        axis = normalize_axis(node, axis, len(data_shape))
        n = data_shape[axis]
    pos = np.nonzero(cond.astype(bool))[0].astype(np.int64)
    if pos.size and pos[-1] >= n:
        raise node.error(f"condition selects index {int(pos[-1])} but the axis has only {n} elements")
    return axis, pos


def _compress_shapes(node, specs):
    data, cond = specs[0], specs[1]
    axis, pos = _compress_plan(node, data.shape, _host_value(node, cond, "condition"))
    shape = (pos.size,) if axis is None else data.shape[:axis] + (pos.size,) + data.shape[axis + 1:]
    return [Spec(shape, data.dtype)]


def _compress(xp, node, data, _cond):
    axis, pos = _compress_plan(node, data.shape, node.host[1])
    src = data.reshape(-1) if axis is None else data
    return (xp.take(src, xp.asarray(pos), axis=0 if axis is None else axis),)


OPS.append(OpKernel("Compress", _compress_shapes, _compress, since=9, host_inputs=(1,), **_DATA_DEP))


def _unique_host(node, x):
    axis = node.attr("axis")
    if axis is not None:
        if x.ndim < 1:
            raise node.error("axis given but input is a scalar")
        axis = normalize_axis(node, axis, x.ndim)
        src = x
    else:
        src = x.reshape(-1)
    y, first, inv, counts = np.unique(src, return_index=True, return_inverse=True, return_counts=True,
                                      axis=axis)
    inv = np.asarray(inv).reshape(-1)
    if not node.attr("sorted", 1):
        order = np.argsort(first, kind="stable")  # unique values by first occurrence
        rank = np.empty_like(order)
        rank[order] = np.arange(order.size)
        first, counts, inv = first[order], counts[order], rank[inv]
        y = np.take(src, first, axis=0 if axis is None else axis)
    return [np.ascontiguousarray(y), first.astype(np.int64), inv.astype(np.int64), counts.astype(np.int64)]


def _unique_shapes(node, specs):
    res = _unique_host(node, _host_value(node, specs[0], "X"))[: node.n_outputs]
    return [Spec(tuple(v.shape), v.dtype, v) for v in res]


OPS.append(OpKernel("Unique", _unique_shapes, _from_host_outputs, since=11, host_inputs=(0,), **_DATA_DEP))
