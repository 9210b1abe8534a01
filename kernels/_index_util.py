"""Helpers for the index ops (``ops_index``): index normalisation, linearisation, scatter-reduce.

Everything here that takes ``xp`` runs on the device (numpy on the simulated device, CuPy on the
GPU) and follows the kernel rules: no host reads of device values, no ``ufunc.at``, no
``put_along_axis``, no data-dependent shapes. Helpers without ``xp`` work on host values only.

Out-of-range indices: ONNX makes them an error, but raising would need a host readback. The ops
declare their index inputs (``index_checks``), which the executor flags into the runtime's error
latch (``DeviceAssert`` naming the node at the next synchronising read); the kernels themselves
*wrap* negative indices (``i + dim``, as ONNX specifies) and then *clamp* to ``[0, dim - 1]``, so a
bad index reads/writes a valid element instead of faulting the device.

Scatter with a reduction (add/mul/max/min) is done without ``ufunc.at`` by a sort-based segmented
scan (``scatter_reduce``): the update rows are stably sorted by target, an inclusive segmented
Hillis-Steele scan (``ceil(log2 n)`` steps, ``n`` = update count, known on the host from shapes)
folds each run of equal targets, the total of each run is broadcast to every member (its last
element, found with ``searchsorted``), and ``out[targets] = op(out[targets], total)`` is written:
duplicate targets all write the same value, so the result does not depend on which write wins.
Folding order for add/mul is a tree rather than ONNX's sequential loop, so floating results may
differ from the reference in the last bits.
"""

from __future__ import annotations

from typing import Any, Sequence

import numpy as np

from ._op import NodeInfo, Spec

__all__ = [
    "prod", "strides_of", "fix_index", "linear_along_axis", "scatter_reduce", "REDUCTIONS",
    "host_int", "host_ints", "require_int",
]


def prod(shape: Sequence[int]) -> int:
    p = 1
    for d in shape:
        p *= int(d)
    return p


def strides_of(shape: Sequence[int]) -> list[int]:
    """Element strides of a C-contiguous array of ``shape`` (host ints)."""
    out = [1] * len(shape)
    for i in range(len(shape) - 2, -1, -1):
        out[i] = out[i + 1] * int(shape[i + 1])
    return out


def require_int(node: NodeInfo, spec: Spec | None, what: str) -> None:
    if spec is None:
        raise node.error(f"input {what!r} is required")
    if spec.dtype.kind not in "iu":
        raise node.error(f"input {what!r} must be an integer tensor, got {spec.dtype}")


def host_ints(node: NodeInfo, spec: Spec | None, what: str) -> list[int]:
    """The host value of an integer input listed in ``host_inputs``, as a list of Python ints."""
    if spec is None or spec.value is None:
        raise node.error(f"input {what!r} must be known on the host")
    v = np.asarray(spec.value)
    if v.dtype.kind == "f":
        if not np.all(np.isfinite(v)):
            raise node.error(f"input {what!r} must hold finite numbers, got {v.reshape(-1)[:8]}")
        return [int(x) for x in v.reshape(-1)]
    return [int(x) for x in v.reshape(-1).astype(np.int64)]


def host_int(node: NodeInfo, spec: Spec | None, what: str) -> int:
    vals = host_ints(node, spec, what)
    if len(vals) != 1:
        raise node.error(f"input {what!r} must hold exactly one value, got {len(vals)}")
    return vals[0]


# -- device helpers ------------------------------------------------------------------------------

def fix_index(xp: Any, idx: Any, dim: int) -> Any:
    """int64 indices with negatives wrapped (``i + dim``) and the result clamped to ``[0, dim-1]``."""
    idx = idx.astype(xp.int64)
    idx = xp.where(idx < 0, idx + dim, idx)
    return xp.clip(idx, 0, max(int(dim) - 1, 0))


def linear_along_axis(xp: Any, idx: Any, axis: int, data_shape: Sequence[int]) -> Any:
    """Flat positions in a C-contiguous ``data`` for GatherElements/ScatterElements indices.

    ``idx`` has data's rank; element ``p`` of it addresses ``data[p[0], .., idx[p], .., p[r-1]]``.
    """
    strides = strides_of(data_shape)
    lin = fix_index(xp, idx, data_shape[axis]) * strides[axis]
    for d in range(idx.ndim):
        if d == axis:
            continue
        shape = [1] * idx.ndim
        shape[d] = idx.shape[d]
        lin = lin + xp.arange(idx.shape[d], dtype=xp.int64).reshape(shape) * strides[d]
    return lin


def _op_of(xp: Any, reduction: str):
    return {"add": xp.add, "mul": xp.multiply, "max": xp.maximum, "min": xp.minimum}[reduction]


REDUCTIONS = ("none", "add", "mul", "max", "min")


def scatter_reduce(xp: Any, out2d: Any, rows: Any, upd2d: Any, reduction: str) -> Any:
    """``out2d[rows[i]] = op(out2d[rows[i]], upd2d[i])`` for every i, in place; returns ``out2d``.

    ``out2d``: (M, R) device array (a private copy: it is written); ``rows``: (n,) int64 in
    ``[0, M)``; ``upd2d``: (n, R). ``reduction`` "none" assigns (duplicate rows: one of the
    updates wins, unspecified which, as in ONNX); otherwise see the module docstring.
    """
    if reduction == "none":
        out2d[rows] = upd2d
        return out2d
    op = _op_of(xp, reduction)
    n = int(rows.shape[0])
    if n == 0:
        return out2d
    order = xp.argsort(rows, kind="stable")
    srows = rows[order]
    vals = upd2d[order].astype(out2d.dtype)
    first = xp.searchsorted(srows, srows, side="left")
    last = xp.searchsorted(srows, srows, side="right") - 1
    pos = xp.arange(n, dtype=xp.int64)
    d = 1
    while d < n:  # host loop over ceil(log2 n) steps; n is a shape, known on the host
        shifted = xp.concatenate([vals[:d], vals[: n - d]], axis=0)
        ok = (pos - d >= first).reshape(-1, 1)
        vals = xp.where(ok, op(vals, shifted), vals)
        d *= 2
    total = vals[last]
    out2d[srows] = op(out2d[srows], total)
    return out2d
