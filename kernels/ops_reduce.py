"""reduce ops: ReduceSum/Mean/Max/Min/Prod/L1/L2/LogSum/LogSumExp/SumSquare, and the losses
NegativeLogLikelihoodLoss and SoftmaxCrossEntropyLoss.

Axes come from the ``axes`` attribute before ReduceSum-13 / the other Reduce*-18, and from the
optional input 1 from then on (listed in ``host_inputs``: the output shape depends on them).
A reduction over no axes (empty axes with ``noop_with_empty_axes=1``) applies the op's elementwise
part only (abs, square, log...), as onnx's reference does; for Sum/Mean/Max/Min/Prod that is the
input itself. Half-precision reductions accumulate in float32 and are cast back.
The losses' targets are checked on the device into the runtime's error latch (``index_checks``:
[0, C) except ``ignore_index``); the kernel clips them after they are flagged.
"""

from __future__ import annotations

import numpy as np

from ._latch import IndexCheck
from ._op import OpKernel, Spec
from ._reduce_util import acc_dtype, empty_fill, input_spec, is_float, reduced_shape, resolve_axes

__all__ = ["OPS"]


def _node_axes(node, rank: int, axes_since: int, axes_value) -> tuple[int, ...]:
    return resolve_axes(node, rank, axes_value, node.opset >= axes_since)


def _allowed(kind: str, dtype: np.dtype) -> bool:
    if dtype.kind == "b":
        return kind in ("max", "min")
    return dtype.kind in "iuf" or dtype.name == "bfloat16"


def _reduce(xp, kind: str, x, axes: tuple[int, ...], keepdims: bool, out_shape: tuple[int, ...]):
    dt = x.dtype
    if x.size == 0:
        return xp.full(out_shape, empty_fill(kind, dt), dtype=dt)
    acc = acc_dtype(dt)
    ax = axes if axes else None

    def total(y):
        return y if ax is None else xp.sum(y, axis=ax, keepdims=keepdims, dtype=y.dtype)

    if kind in ("max", "min"):
        if ax is None:
            return x
        fn = xp.max if kind == "max" else xp.min
        return fn(x, axis=ax, keepdims=keepdims)
    if kind == "logsumexp":
        work = x.astype(acc if is_float(dt) else np.float64)
        if ax is None:
            return work.astype(dt)
        m = xp.max(work, axis=ax, keepdims=True)
        m = xp.where(xp.isinf(m), xp.zeros_like(m), m)
        s = xp.sum(xp.exp(work - m), axis=ax, keepdims=True, dtype=work.dtype)
        r = xp.log(s) + m
        if not keepdims:
            r = r.reshape(out_shape)
        return r.astype(dt)
    y = x.astype(acc, copy=False)
    if kind == "sum":
        r = total(y)
    elif kind == "mean":
        if ax is None:
            return x
        n = 1
        for a in ax:
            n *= int(x.shape[a])
        s = total(y)
        if is_float(dt):
            r = s / acc.type(n)
        else:
            r = s.astype(np.float64) / np.float64(n)
    elif kind == "prod":
        r = y if ax is None else xp.prod(y, axis=ax, keepdims=keepdims, dtype=acc)
    elif kind == "l1":
        r = total(xp.abs(y))
    elif kind == "sumsquare":
        r = total(y * y)
    elif kind == "l2":
        s = total(y * y)
        r = xp.sqrt(s if is_float(dt) else s.astype(np.float64))
    elif kind == "logsum":
        s = total(y)
        r = xp.log(s if is_float(dt) else s.astype(np.float64))
    else:  # pragma: no cover - table below only lists the kinds above
        raise ValueError(kind)
    return r.astype(dt)


def Reduce(op_type: str, kind: str, axes_since: int) -> OpKernel:
    """A Reduce* op; ``axes_since``: the opset from which axes is input 1 rather than an attribute."""

    def shapes(node, specs):
        x = specs[0]
        if not _allowed(kind, np.dtype(x.dtype)):
            raise node.error(f"input dtype {x.dtype} is not supported")
        ax_spec = input_spec(specs, 1)
        if node.opset >= axes_since and ax_spec is not None and ax_spec.value is None:
            raise node.error("axes input has no host value")
        axes = _node_axes(node, x.rank, axes_since, ax_spec.value if ax_spec is not None else None)
        keepdims = bool(node.attr("keepdims", 1))
        return [Spec(reduced_shape(x.shape, axes, keepdims), x.dtype)]

    def compute(xp, node, x, axes_in=None):
        axes = _node_axes(node, x.ndim, axes_since, node.host.get(1) if axes_in is not None else None)
        keepdims = bool(node.attr("keepdims", 1))
        return (_reduce(xp, kind, x, axes, keepdims, node.out_specs[0].shape),)

    def into(xp, node, outs, x, axes_in=None):
        """A sum over given axes that accumulates in the output dtype: ``sum(..., out=)``, one launch."""
        out = outs[0]
        axes = _node_axes(node, x.ndim, axes_since, node.host.get(1) if axes_in is not None else None)
        if not axes or x.size == 0 or acc_dtype(x.dtype) != x.dtype or out.dtype != x.dtype:
            return False
        xp.sum(x, axis=axes, keepdims=bool(node.attr("keepdims", 1)), dtype=x.dtype, out=out)
        return True

    return OpKernel(op_type, shapes, compute, host_inputs=(1,), into=into if kind == "sum" else None, capture="safe")


# -- losses ------------------------------------------------------------------------------------

def _loss_shapes(node, specs, with_log_prob: bool):
    x, t = specs[0], specs[1]
    w = input_spec(specs, 2)
    if x.rank < 2:
        raise node.error(f"input must have rank >= 2 (N, C, ...), got shape {x.shape}")
    if not is_float(x.dtype):
        raise node.error(f"input dtype {x.dtype} is not a float type")
    if np.dtype(t.dtype).kind not in "iu":
        raise node.error(f"target dtype {t.dtype} is not an integer type")
    if x.shape[1] == 0:  # no class a target could name (and a softmax over none is undefined)
        raise node.error(f"input shape {x.shape} has 0 classes (axis 1): a loss needs at least one class")
    want = (x.shape[0],) + tuple(x.shape[2:])
    if tuple(t.shape) != want:
        raise node.error(f"target shape {t.shape} does not match input shape {x.shape} (expected {want})")
    if w is not None and tuple(w.shape) != (x.shape[1],):
        raise node.error(f"weight shape {w.shape} is not (C,) = ({x.shape[1]},)")
    reduction = node.attr("reduction", "mean")
    if reduction not in ("none", "sum", "mean"):
        raise node.error(f"reduction {reduction!r} is not none, sum or mean")
    out = [Spec(tuple(t.shape) if reduction == "none" else (), x.dtype)]
    if with_log_prob and node.n_outputs > 1:
        out.append(Spec(tuple(x.shape), x.dtype))
    return out


def _nll(xp, node, logp, target, weight, out_dtype):
    """Weighted, ignore-index-masked NLL of ``logp`` (N, C, ...) in its (accumulation) dtype."""
    C = logp.shape[1]
    acc = logp.dtype
    ignore = node.attr("ignore_index")
    t = target.astype(np.int64)
    if ignore is not None:
        keep = t != np.int64(ignore)
        t = xp.where(keep, t, xp.zeros_like(t))
    t = xp.clip(t, 0, C - 1)
    picked = xp.take_along_axis(logp, xp.expand_dims(t, 1), axis=1)
    picked = picked.reshape(target.shape)
    w = None
    if weight is not None:
        w = xp.take(weight.astype(acc), t)
    if ignore is not None:
        m = keep.astype(acc)
        w = m if w is None else w * m
    loss = -picked if w is None else -picked * w
    reduction = node.attr("reduction", "mean")
    if reduction == "none":
        return loss.astype(out_dtype)
    total = xp.sum(loss, dtype=acc)
    if reduction == "sum":
        return total.astype(out_dtype)
    if w is None:
        n = 1
        for d in target.shape:
            n *= int(d)
        return (total / acc.type(n)).astype(out_dtype)
    return (total / xp.sum(w, dtype=acc)).astype(out_dtype)


def _nll_compute(xp, node, x, target, weight=None):
    acc = acc_dtype(x.dtype)
    return (_nll(xp, node, x.astype(acc), target, weight, x.dtype),)


def _sce_compute(xp, node, x, target, weight=None):
    acc = acc_dtype(x.dtype)
    xa = x.astype(acc)
    m = xp.max(xa, axis=1, keepdims=True)
    m = xp.where(xp.isinf(m), xp.zeros_like(m), m)
    shifted = xa - m
    logp = shifted - xp.log(xp.sum(xp.exp(shifted), axis=1, keepdims=True, dtype=acc))
    loss = _nll(xp, node, logp, target, weight, x.dtype)
    if node.n_outputs > 1:
        return loss, logp.astype(x.dtype)
    return (loss,)


def _loss_target_check(node, specs):
    """Targets lie in [0, C) unless equal to ignore_index (checked into the error latch)."""
    ignore = node.attr("ignore_index")
    return [IndexCheck(1, 0, specs[0].shape[1], None if ignore is None else int(ignore))]


NLL_LOSS = OpKernel("NegativeLogLikelihoodLoss", lambda node, specs: _loss_shapes(node, specs, False),
                    _nll_compute, since=12, index_checks=_loss_target_check, capture="safe")
SCE_LOSS = OpKernel("SoftmaxCrossEntropyLoss", lambda node, specs: _loss_shapes(node, specs, True),
                    _sce_compute, since=12, index_checks=_loss_target_check, capture="safe")


OPS: list[OpKernel] = [
    Reduce("ReduceSum", "sum", 13),
    Reduce("ReduceMean", "mean", 18),
    Reduce("ReduceMax", "max", 18),
    Reduce("ReduceMin", "min", 18),
    Reduce("ReduceProd", "prod", 18),
    Reduce("ReduceL1", "l1", 18),
    Reduce("ReduceL2", "l2", 18),
    Reduce("ReduceLogSum", "logsum", 18),
    Reduce("ReduceLogSumExp", "logsumexp", 18),
    Reduce("ReduceSumSquare", "sumsquare", 18),
    NLL_LOSS,
    SCE_LOSS,
]
