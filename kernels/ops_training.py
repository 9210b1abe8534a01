"""ai.onnx.preview.training optimizers: Momentum, Adagrad, Adam (opset 1), one or several tensors.

Inputs are ``R`` (learning rate, a scalar), ``T`` (the update count, an int64 scalar), then the
tensors to optimise and their gradients and state, grouped by kind: Momentum and Adagrad take
``X_1..X_n, G_1..G_n, V_1..V_n`` (V is the momentum, Adagrad's H the squared-gradient sum) and give
``X_1_new..X_n_new, V_1_new..V_n_new``; Adam takes ``X.., G.., V.., H..`` and gives
``X_new.., V_new.., H_new..``. The first update (``T == 0``) is special in each (Momentum's gradient
coefficient is 1, Adam skips its bias correction): a device-side ``where`` on ``T``, no host read,
so all three are capture-safe. Arithmetic is float64 on the device, results in each tensor's dtype.
The update rules are ONNX's (onnx/reference/ops/aionnx_preview_training).
"""

from __future__ import annotations

import numpy as np

from ._op import OpKernel, Spec

__all__ = ["OPS"]

TRAINING = "ai.onnx.preview.training"
OPS: list[OpKernel] = []

# op -> (state tensors per optimised tensor besides X and G, outputs per optimised tensor)
_GROUPS = {"Momentum": 1, "Adagrad": 1, "Adam": 2}


def _count(node) -> int:
    """n, the number of optimised tensors, from the input and output counts (an OpError if they disagree)."""
    per = 2 + _GROUPS[node.op_type]
    n, rest = divmod(node.n_inputs - 2, per)
    if node.n_inputs < 2 + per or rest:
        raise node.error(f"takes R, T and {per} inputs per optimised tensor; got {node.n_inputs} inputs")
    if node.n_outputs != (per - 1) * n:
        raise node.error(f"{n} optimised tensors give {(per - 1) * n} outputs; the node has {node.n_outputs}")
    return n


def _check(node):
    _count(node)
    for name in ("alpha", "beta", "epsilon", "norm_coefficient", "norm_coefficient_post", "decay_factor"):
        v = node.attr(name)
        if v is not None and (not isinstance(v, (int, float)) or not np.isfinite(v)):
            raise node.error(f"attribute {name}={v!r} is invalid: a finite number is expected")
    if node.op_type == "Momentum" and node.attr("mode") not in ("standard", "nesterov"):
        raise node.error(f"attribute mode={node.attr('mode')!r} is invalid: allowed: 'standard', 'nesterov'")
    if node.op_type in ("Adam", "Adagrad") and float(node.attr("epsilon", 1e-6)) < 0:
        raise node.error(f"attribute epsilon={node.attr('epsilon')!r} is invalid: must be >= 0")


def _shapes(node, specs):
    n = _count(node)
    r, t = specs[0], specs[1]
    if r is None or t is None or int(np.prod(r.shape)) != 1 or int(np.prod(t.shape)) != 1:
        raise node.error("R and T must be scalars")
    if r.dtype.kind != "f" or t.dtype != np.int64:
        raise node.error(f"R must be float and T int64, got {r.dtype} and {t.dtype}")
    groups = [specs[2 + k * n: 2 + (k + 1) * n] for k in range(2 + _GROUPS[node.op_type])]
    for i in range(n):
        x = groups[0][i]
        if x is None or x.dtype.kind != "f":
            raise node.error(f"optimised tensor {i} must be a float tensor")
        for k, g in enumerate(groups[1:], 1):
            if g[i] is None or g[i].shape != x.shape or g[i].dtype != x.dtype:
                raise node.error(f"input {2 + k * n + i} must match X_{i + 1}: shape {x.shape}, {x.dtype}")
    outs = [Spec(x.shape, x.dtype) for x in groups[0]]
    return outs * (1 + _GROUPS[node.op_type])


def _split(xp, node, arrays):
    n = (len(arrays) - 2) // (2 + _GROUPS[node.op_type])
    f64 = lambda a: a.astype(xp.float64)  # noqa: E731
    r, t = f64(arrays[0].reshape(())), arrays[1].reshape(())
    return n, r, t, [[f64(a) for a in arrays[2 + k * n: 2 + (k + 1) * n]] for k in range(2 + _GROUPS[node.op_type])]


def _momentum(xp, node, *arrays):
    n, r, t, (xs, gs, vs) = _split(xp, node, arrays)
    alpha, beta, lam = (float(node.attr(a)) for a in ("alpha", "beta", "norm_coefficient"))
    nesterov = node.attr("mode") == "nesterov"
    b = xp.where(t > 0, beta, 1.0)  # the gradient's coefficient is 1 at the first update
    x_new, v_new = [], []
    for x, g, v in zip(xs, gs, vs):
        g = lam * x + g
        v2 = alpha * v + b * g
        x_new.append(x - r * (g + alpha * v2) if nesterov else x - r * v2)
        v_new.append(v2)
    dt = [s.dtype for s in node.out_specs]
    return tuple(a.astype(d) for a, d in zip(x_new + v_new, dt))


def _adagrad(xp, node, *arrays):
    n, r, t, (xs, gs, hs) = _split(xp, node, arrays)
    decay, eps, lam = (float(node.attr(a, d)) for a, d in (("decay_factor", 0.0), ("epsilon", 1e-6),
                                                           ("norm_coefficient", 0.0)))
    rate = r / (1 + t.astype(xp.float64) * decay)
    x_new, h_new = [], []
    for x, g, h in zip(xs, gs, hs):
        g = lam * x + g
        h2 = h + g * g
        x_new.append(x - rate * g / (xp.sqrt(h2) + eps))
        h_new.append(h2)
    dt = [s.dtype for s in node.out_specs]
    return tuple(a.astype(d) for a, d in zip(x_new + h_new, dt))


def _adam(xp, node, *arrays):
    n, r, t, (xs, gs, vs, hs) = _split(xp, node, arrays)
    alpha, beta, eps, lam, lam_post = (float(node.attr(a, d)) for a, d in (
        ("alpha", 0.9), ("beta", 0.999), ("epsilon", 1e-6), ("norm_coefficient", 0.0), ("norm_coefficient_post", 0.0)))
    tf = xp.maximum(t, 1).astype(xp.float64)  # (T == 0 selects r below; this keeps its branch finite)
    corrected = r * xp.sqrt(1 - beta ** tf) / (1 - alpha ** tf) if alpha != 1 else r
    rate = xp.where(t > 0, corrected, r)  # bias correction from the second update on
    x_new, v_new, h_new = [], [], []
    for x, g, v, h in zip(xs, gs, vs, hs):
        g = lam * x + g
        v2 = alpha * v + (1 - alpha) * g
        h2 = beta * h + (1 - beta) * (g * g)
        x_new.append((1 - lam_post) * (x - rate * (v2 / (xp.sqrt(h2) + eps))))
        v_new.append(v2)
        h_new.append(h2)
    dt = [s.dtype for s in node.out_specs]
    return tuple(a.astype(d) for a, d in zip(x_new + v_new + h_new, dt))


OPS.append(OpKernel("Momentum", _shapes, _momentum, domain=TRAINING, since=1, check=_check, capture="safe"))
OPS.append(OpKernel("Adagrad", _shapes, _adagrad, domain=TRAINING, since=1, check=_check, capture="safe"))
OPS.append(OpKernel("Adam", _shapes, _adam, domain=TRAINING, since=1, check=_check, capture="safe"))
