"""Shared plumbing of the Reduce* kernels: axes resolution (attribute or input), output shapes,
accumulation dtypes and empty-set fills. Host-side helpers only use numpy on attributes and
``Spec.value``/``node.host`` values; the xp helpers are numpy/CuPy generic."""

from __future__ import annotations

from typing import Any

import numpy as np

from ._op import NodeInfo, Spec

__all__ = ["resolve_axes", "reduced_shape", "acc_dtype", "empty_fill", "is_float"]


def is_float(dtype: Any) -> bool:
    dt = np.dtype(dtype)
    return dt.kind == "f" or dt.name == "bfloat16"


def acc_dtype(dtype: Any) -> np.dtype:
    """The dtype a sum-like reduction accumulates in: float32 for the half types, else the input's."""
    dt = np.dtype(dtype)
    if dt.itemsize < 4 and is_float(dt):
        return np.dtype(np.float32)
    return dt


def _axes_from_value(node: NodeInfo, value: Any) -> list[int] | None:
    if value is None:
        return None
    arr = np.asarray(value)
    if arr.dtype.kind not in "iu":
        raise node.error(f"axes must be an integer tensor, got {arr.dtype}")
    return [int(a) for a in arr.reshape(-1)]


def resolve_axes(node: NodeInfo, rank: int, axes_value: Any, axes_input: bool) -> tuple[int, ...]:
    """The normalized, sorted axes to reduce over; ``()`` means no reduction (noop).

    ``axes_input``: the op version takes axes as input 1 (``axes_value`` is its host value, or None
    when the input is absent); otherwise the ``axes`` attribute is used.
    """
    if axes_input:
        axes = _axes_from_value(node, axes_value)
        noop = bool(node.attr("noop_with_empty_axes", 0))
    else:
        raw = node.attr("axes")
        axes = None if raw is None else [int(a) for a in raw]
        noop = False
    if not axes:
        return () if noop else tuple(range(rank))
    out = []
    for a in axes:
        if not -rank <= a < max(rank, 1) or (rank == 0 and a not in (0, -1)):
            raise node.error(f"axis {a} out of range for input of rank {rank}")
        n = a % rank if rank else 0
        if n in out:
            raise node.error(f"axis {a} repeated in axes {axes}")
        out.append(n)
    if rank == 0:
        return ()
    return tuple(sorted(out))


def reduced_shape(shape: tuple[int, ...], axes: tuple[int, ...], keepdims: bool) -> tuple[int, ...]:
    if keepdims:
        return tuple(1 if i in axes else d for i, d in enumerate(shape))
    return tuple(d for i, d in enumerate(shape) if i not in axes)


def empty_fill(kind: str, dtype: Any) -> Any:
    """The value of a reduction over an empty set, per the ONNX spec / node cases."""
    dt = np.dtype(dtype)
    if kind in ("sum", "l1", "l2", "sumsquare"):
        return 0
    if kind == "prod":
        return 1
    if kind == "mean":
        return np.nan if is_float(dt) else 0
    if kind in ("max", "min"):
        if dt.kind == "b":
            return kind == "min"
        if dt.kind in "iu":
            info = np.iinfo(dt)
            return info.min if kind == "max" else info.max
        return -np.inf if kind == "max" else np.inf
    if kind in ("logsum", "logsumexp"):
        return -np.inf
    raise ValueError(kind)


def input_spec(specs: list[Spec | None], i: int) -> Spec | None:
    return specs[i] if i < len(specs) else None
