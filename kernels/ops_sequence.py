"""Sequence and optional ops: SequenceEmpty, SequenceConstruct, SequenceAt, SequenceInsert,
SequenceErase, SequenceLength, SplitToSequence, ConcatFromSequence, Optional, OptionalHasElement,
OptionalGetElement.

Host kernels (``_host.py``): a sequence is a host-side tuple of device tensors, an optional is
``None`` or its value. Positions are read on the host (the node's host seam); the element tensors
stay on the device: SequenceAt/Insert/Erase/Construct move references, SplitToSequence and
ConcatFromSequence are one device launch each. A position out of range is an ``OpError`` naming
the node, the position and the sequence length.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import onnx

from ._host import HostOp, Seq
from ._op import NodeInfo, Spec, normalize_axis

__all__ = ["OPS"]


def _seq(node: NodeInfo, value: Any, what: str = "input 0") -> Seq:
    if not isinstance(value, Seq):
        got = "an empty optional" if value is None else "a tensor"
        raise node.error(f"{what} must be a sequence, got {got}")
    return value


def _tensor(node: NodeInfo, value: Any, what: str) -> Any:
    if value is None or isinstance(value, Seq):
        raise node.error(f"{what} must be a tensor, got {'a sequence' if value is not None else 'nothing'}")
    return value


def _position(ctx, node: NodeInfo, value: Any, n: int, *, insert: bool = False) -> int:
    """A host-read position in [-n, n-1] ([-n, n] for an insertion), as an index in [0, n]."""
    pos = ctx.read(_tensor(node, value, "position"))
    if pos.dtype not in (np.int32, np.int64) or pos.size != 1 or pos.ndim > 1:
        raise node.error(f"position must be a scalar int32/int64 tensor, got {pos.dtype}{list(pos.shape)}")
    p = int(pos.reshape(()))
    hi = n if insert else n - 1
    if not -n <= p <= hi:
        raise node.error(f"position {p} is out of range [{-n}, {hi}] for a sequence of length {n}")
    return p + n if p < 0 else p


def _same_dtype(node: NodeInfo, dtype: np.dtype, values: list[Any]) -> None:
    for v in values:
        if v.spec.dtype != dtype:
            raise node.error(f"a sequence of {dtype} cannot hold a {v.spec.dtype} tensor")


def _elem_dtype(node: NodeInfo) -> np.dtype:
    from onnx import helper

    code = node.attr("dtype", onnx.TensorProto.FLOAT)
    try:
        return np.dtype(helper.tensor_dtype_to_np_dtype(code))
    except Exception as exc:
        raise node.error(f"attribute dtype={code!r} is not an ONNX tensor element type") from exc


def _check_dtype(node: NodeInfo) -> None:
    _elem_dtype(node)


def _sequence_empty(ctx, node):
    return (Seq((), _elem_dtype(node)),)


def _sequence_construct(ctx, node, *inputs):
    if not inputs:
        raise node.error("needs at least one input")
    values = [_tensor(node, v, f"input {i}") for i, v in enumerate(inputs)]
    _same_dtype(node, values[0].spec.dtype, values)
    return (Seq(tuple(values), values[0].spec.dtype),)


def _sequence_at(ctx, node, seq, position=None):
    seq = _seq(node, seq)
    return (seq.items[_position(ctx, node, position, len(seq))],)


def _sequence_insert(ctx, node, seq, tensor, position=None):
    seq = _seq(node, seq)
    tensor = _tensor(node, tensor, "input 1")
    _same_dtype(node, seq.dtype, [tensor])
    items = list(seq.items)
    at = len(items) if position is None else _position(ctx, node, position, len(items), insert=True)
    items.insert(at, tensor)
    return (Seq(tuple(items), seq.dtype),)


def _sequence_erase(ctx, node, seq, position=None):
    seq = _seq(node, seq)
    if not seq.items:
        raise node.error("cannot erase from an empty sequence")
    at = len(seq) - 1 if position is None else _position(ctx, node, position, len(seq))
    return (Seq(seq.items[:at] + seq.items[at + 1:], seq.dtype),)


def _sequence_length(ctx, node, seq):
    return (ctx.tensor(np.array(len(_seq(node, seq)), dtype=np.int64)),)


def _split_lengths(ctx, node, dim: int, split: Any) -> list[int]:
    if split is None:
        return [1] * dim
    s = ctx.read(split)
    if s.dtype not in (np.int32, np.int64) or s.ndim > 1:
        raise node.error(f"split must be a scalar or 1-D int32/int64 tensor, got {s.dtype}{list(s.shape)}")
    if s.ndim == 0:
        length = int(s)
        if length <= 0:
            raise node.error(f"split {length} must be positive")
        return [length] * (dim // length) + ([dim % length] if dim % length else [])
    lengths = [int(v) for v in s]
    if any(v < 0 for v in lengths) or sum(lengths) != dim:
        raise node.error(f"split {lengths} must be non-negative and sum to the axis length {dim}")
    return lengths


def _split_to_sequence(ctx, node, x, split=None):
    x = _tensor(node, x, "input 0")
    shape = x.spec.shape
    axis = normalize_axis(node, int(node.attr("axis", 0)), len(shape))
    lengths = _split_lengths(ctx, node, shape[axis], split)
    squeeze = split is None and not node.attr("keepdims", 1)
    bounds, start = [], 0
    for n in lengths:
        bounds.append((start, start + n))
        start += n
    specs = []
    for lo, hi in bounds:
        piece = list(shape)
        piece[axis] = hi - lo
        if squeeze:
            del piece[axis]
        specs.append(Spec(tuple(piece), x.spec.dtype))

    def pieces(xp, a):
        index = [slice(None)] * len(shape)
        out = []
        for lo, hi in bounds:
            index[axis] = slice(lo, hi)
            out.append(a[tuple(index)])
        return tuple(out)

    return (Seq(tuple(ctx.launch(pieces, specs, x)), x.spec.dtype),)


def _concat_from_sequence(ctx, node, seq):
    seq = _seq(node, seq)
    if not seq.items:
        raise node.error("cannot concatenate an empty sequence")
    first = seq.items[0].spec
    new_axis = bool(node.attr("new_axis", 0))
    rank = len(first.shape) + new_axis
    axis = normalize_axis(node, int(node.attr("axis")), rank)
    for v in seq.items:
        s = v.spec
        if s.dtype != first.dtype or len(s.shape) != len(first.shape):
            raise node.error(f"elements {first.dtype}{list(first.shape)} and {s.dtype}{list(s.shape)} do not concatenate")
        if new_axis and s.shape != first.shape:
            raise node.error(f"stacking needs equal shapes, got {list(first.shape)} and {list(s.shape)}")
        if not new_axis and any(a != b for k, (a, b) in enumerate(zip(s.shape, first.shape)) if k != axis):
            raise node.error(f"shapes {list(first.shape)} and {list(s.shape)} differ off axis {axis}")
    if new_axis:
        shape = (*first.shape[:axis], len(seq), *first.shape[axis:])
    else:
        shape = (*first.shape[:axis], sum(v.spec.shape[axis] for v in seq.items), *first.shape[axis + 1:])

    def join(xp, *arrays):
        if new_axis:
            return (xp.stack(arrays, axis=axis),)
        return (xp.concatenate(arrays, axis=axis),)

    return tuple(ctx.launch(join, [Spec(shape, first.dtype)], *seq.items))


def _optional(ctx, node, x=None):
    tp = node.attr("type")
    if x is not None and isinstance(tp, onnx.TypeProto) and tp.HasField("tensor_type") and not isinstance(x, Seq):
        from onnx import helper

        want = np.dtype(helper.tensor_dtype_to_np_dtype(tp.tensor_type.elem_type))
        if x.spec.dtype != want:
            raise node.error(f"input dtype {x.spec.dtype} disagrees with attribute type ({want})")
    if x is None and tp is None:
        raise node.error("an empty Optional needs the attribute type")
    return (x,)


def _optional_has_element(ctx, node, x=None):
    return (ctx.tensor(np.array(x is not None)),)


def _optional_get_element(ctx, node, x):
    if x is None:
        raise node.error("the optional input is empty")
    return (x,)


OPS = [
    HostOp("SequenceEmpty", _sequence_empty, since=11, check=_check_dtype),
    HostOp("SequenceConstruct", _sequence_construct, since=11),
    HostOp("SequenceAt", _sequence_at, since=11),
    HostOp("SequenceInsert", _sequence_insert, since=11),
    HostOp("SequenceErase", _sequence_erase, since=11),
    HostOp("SequenceLength", _sequence_length, since=11),
    HostOp("SplitToSequence", _split_to_sequence, since=11),
    HostOp("ConcatFromSequence", _concat_from_sequence, since=11),
    HostOp("Optional", _optional, since=15),
    HostOp("OptionalHasElement", _optional_has_element, since=15),
    HostOp("OptionalGetElement", _optional_get_element, since=15),
]
