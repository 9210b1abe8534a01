"""Recurrent ops: RNN, GRU and LSTM (opset 7 on; layout, sequence_lens, peepholes, clip).

One host loop over the (static) sequence length per direction; the input projection of every step
is one ``_linalg.matmul`` up front, the recurrence one small ``matmul`` per step (never cuBLAS).
Work is in float32 (float64 for float64 inputs), cast back at the end.

``sequence_lens`` stays on the device: at step ``t`` a batch row updates its state only where
``t < sequence_lens[b]`` (a per-row mask), so its outputs past its length are zero and ``Y_h``/
``Y_c`` hold the state of its last valid step. The reverse direction walks ``t = T-1 .. 0`` with the
same mask, so it starts from the initial state at the row's own last step, and a row of length 0
has zero ``Y_h``/``Y_c`` (both as ONNX Runtime does; ONNX's reference evaluator ignores the input).
A length outside ``[0, T]`` is flagged into the runtime's error latch (``index_checks``). Nothing is
read on the host, so the three ops are capture-safe.

Activations (``activations``, per direction, in the order f, g, h): Relu, Tanh, Sigmoid, Affine,
LeakyRelu, ThresholdedRelu, ScaledTanh, HardSigmoid, Elu, Softsign, Softplus (case-insensitive).
``activation_alpha``/``activation_beta`` are consumed in that order by the activations that take
them (as ONNX Runtime reads them); a missing value is the ONNX operator's default (LeakyRelu 0.01,
HardSigmoid 0.2/0.5, Elu 1.0, ThresholdedRelu 1.0, Affine 1.0/0.0, ScaledTanh 1.0/1.0). A
bidirectional node may list one direction's activations, used for both. ``clip`` bounds the gate
pre-activations (the inputs of f and g) to ``[-clip, clip]``; LSTM's cell state goes into h
unclipped. LSTM's ``input_forget=1`` couples the forget gate to the input gate (``f = 1 - i``).
"""

from __future__ import annotations

import math

import numpy as np

from ._latch import IndexCheck
from ._linalg import matmul
from ._nn_util import sigmoid, softplus, to_work, work_dtype
from ._op import OpKernel, Spec

__all__ = ["OPS"]

_GATES = {"RNN": 1, "GRU": 3, "LSTM": 4}
_DEFAULT_ACTS = {"RNN": ("Tanh",), "GRU": ("Sigmoid", "Tanh"), "LSTM": ("Sigmoid", "Tanh", "Tanh")}
# lower-case name -> (default alpha or None if it takes none, default beta or None)
_ACT_PARAMS = {
    "relu": (None, None), "tanh": (None, None), "sigmoid": (None, None), "softsign": (None, None),
    "softplus": (None, None), "affine": (1.0, 0.0), "leakyrelu": (0.01, None), "thresholdedrelu": (1.0, None),
    "scaledtanh": (1.0, 1.0), "hardsigmoid": (0.2, 0.5), "elu": (1.0, None),
}
# input index of each optional input
_SEQ, _H0 = 4, 5
_C0, _P = 6, 7


def _num_directions(node) -> int:
    return 2 if node.attr("direction", "forward") == "bidirectional" else 1


def _activations(node) -> list[list[tuple[str, float, float]]]:
    """Per direction, the (name, alpha, beta) of each activation; raises ``OpError`` on a bad list."""
    nd, per = _num_directions(node), len(_DEFAULT_ACTS[node.op_type])
    names = node.attr("activations")
    if names is None:
        names = list(_DEFAULT_ACTS[node.op_type]) * nd
    if not isinstance(names, (list, tuple)) or not all(isinstance(n, str) for n in names):
        raise node.error(f"attribute activations={names!r} is invalid: a list of strings is expected")
    names = list(names)
    if nd == 2 and len(names) == per:
        names = names * 2
    if len(names) != per * nd:
        raise node.error(f"attribute activations={names!r} is invalid: {per * nd} entries expected "
                         f"({per} per direction, {nd} direction{'s' if nd > 1 else ''})")
    for n in names:
        if n.lower() not in _ACT_PARAMS:
            raise node.error(f"attribute activations has unknown activation {n!r}: allowed: "
                             "Relu, Tanh, Sigmoid, Affine, LeakyRelu, ThresholdedRelu, ScaledTanh, "
                             "HardSigmoid, Elu, Softsign, Softplus")
    lists = {}
    for key in ("activation_alpha", "activation_beta"):
        v = node.attr(key)
        v = [] if v is None else v
        if not isinstance(v, (list, tuple)) or not all(isinstance(x, (int, float)) and math.isfinite(x) for x in v):
            raise node.error(f"attribute {key}={v!r} is invalid: a list of finite numbers is expected")
        lists[key] = list(v)
    alphas, betas = iter(lists["activation_alpha"]), iter(lists["activation_beta"])
    used_a = used_b = 0
    out = []
    for n in names:
        da, db = _ACT_PARAMS[n.lower()]
        a = b = 0.0
        if da is not None:
            a = float(next(alphas, da))
            used_a += 1
        if db is not None:
            b = float(next(betas, db))
            used_b += 1
        out.append((n.lower(), a, b))
    for key, used in (("activation_alpha", used_a), ("activation_beta", used_b)):
        if len(lists[key]) > used:
            raise node.error(f"attribute {key}={lists[key]!r} is invalid: only {used} of the activations "
                             f"{names!r} take one")
    return [out[d * per:(d + 1) * per] for d in range(nd)]


def _check(node) -> None:
    """Load-time checks beyond ``_attr_check``'s tables (which hold direction, layout, the 0/1 flags
    and hidden_size's range): the activations with their alpha/beta, and clip."""
    _activations(node)
    clip = node.attr("clip")
    if clip is not None and not (isinstance(clip, (int, float)) and math.isfinite(clip) and clip > 0):
        raise node.error(f"attribute clip={clip!r} is invalid: a positive finite number is expected")


def _dims(node, specs):
    """(T, batch, input, hidden, num_directions) from the inputs, every shape checked."""
    specs = list(specs) + [None] * (8 - len(specs))
    x, w, r = specs[0], specs[1], specs[2]
    if x is None or w is None or r is None:
        raise node.error("inputs X, W and R are required")
    for name, s in (("X", x), ("W", w), ("R", r)):
        if s.rank != 3:
            raise node.error(f"input {name} must be rank 3, got shape {s.shape}")
        if s.dtype.kind != "f":
            raise node.error(f"input {name} must be a float tensor, got {s.dtype}")
    layout = int(node.attr("layout", 0))
    T, nb, ni = (x.shape[1], x.shape[0], x.shape[2]) if layout else x.shape
    nd, G = _num_directions(node), _GATES[node.op_type]
    H = int(r.shape[2])
    hs = node.attr("hidden_size")
    if hs is not None and int(hs) != H:
        raise node.error(f"attribute hidden_size={hs} does not match R's shape {r.shape} (hidden size {H})")
    if tuple(w.shape) != (nd, G * H, ni):
        raise node.error(f"input W has shape {w.shape}, expected {(nd, G * H, ni)} "
                         f"(direction {node.attr('direction', 'forward')!r}, {G} gate(s), hidden size {H}, input size {ni})")
    if tuple(r.shape) != (nd, G * H, H):
        raise node.error(f"input R has shape {r.shape}, expected {(nd, G * H, H)}")
    state = (nb, nd, H) if layout else (nd, nb, H)
    want = {3: ("B", (nd, 2 * G * H)), _SEQ: ("sequence_lens", (nb,)), _H0: ("initial_h", state)}
    if node.op_type == "LSTM":
        want.update({_C0: ("initial_c", state), _P: ("P", (nd, 3 * H))})
    for i, s in enumerate(specs[3:], start=3):
        if s is None:
            continue
        if i not in want:
            raise node.error(f"{node.op_type} takes {max(want) + 1} inputs, got input {i}")
        name, shape = want[i]
        if tuple(s.shape) != shape:
            raise node.error(f"input {name} has shape {s.shape}, expected {shape}")
        if i == _SEQ:
            if s.dtype.kind not in "iu":
                raise node.error(f"input sequence_lens must be an integer tensor, got {s.dtype}")
        elif s.dtype != x.dtype:
            raise node.error(f"input {name} is {s.dtype}, X is {x.dtype}")
    if w.dtype != x.dtype or r.dtype != x.dtype:
        raise node.error(f"inputs X, W, R must share one dtype, got {x.dtype}, {w.dtype}, {r.dtype}")
    return T, nb, ni, H, nd


def _shapes(node, specs):
    T, nb, _, H, nd = _dims(node, specs)
    layout = int(node.attr("layout", 0))
    dt = specs[0].dtype
    y = (nb, T, nd, H) if layout else (T, nd, nb, H)
    state = (nb, nd, H) if layout else (nd, nb, H)
    n = max(node.n_outputs, 1)
    if n > (3 if node.op_type == "LSTM" else 2):
        raise node.error(f"{node.op_type} has at most {3 if node.op_type == 'LSTM' else 2} outputs, got {n}")
    return [Spec(y, dt), Spec(state, dt), Spec(state, dt)][:n]


def _index_checks(node, specs):
    if len(specs) > _SEQ and specs[_SEQ] is not None:
        T = specs[0].shape[1] if int(node.attr("layout", 0)) else specs[0].shape[0]
        return [IndexCheck(_SEQ, 0, int(T) + 1)]
    return []


def _act(xp, x, name: str, alpha: float, beta: float):
    if name == "tanh":
        return xp.tanh(x)
    if name == "sigmoid":
        return sigmoid(xp, x)
    if name == "relu":
        return xp.maximum(x, 0)
    if name == "affine":
        return x * alpha + beta
    if name == "leakyrelu":
        return xp.where(x >= 0, x, x * alpha)
    if name == "thresholdedrelu":
        return xp.where(x > alpha, x, 0).astype(x.dtype)
    if name == "scaledtanh":
        return xp.tanh(x * beta) * alpha
    if name == "hardsigmoid":
        return xp.clip(x * alpha + beta, 0, 1)
    if name == "elu":
        return xp.where(x >= 0, x, (xp.exp(xp.minimum(x, 0)) - 1) * alpha)
    if name == "softsign":
        return x / (1 + xp.abs(x))
    return softplus(xp, x)  # "softplus" (the names are checked at load)


def _cell(xp, kind, acts, clip, lbr, input_forget, xw, h, c, r_t, rb, p):
    """One step of one direction: ``xw`` is this step's input projection plus both biases except
    GRU's recurrent h-bias (``rb``); returns (h, c)."""
    def f(i, v):
        if clip is not None:
            v = xp.clip(v, -clip, clip)
        name, a, b = acts[i]
        return _act(xp, v, name, a, b)

    H = h.shape[1]
    if kind == "RNN":
        return f(0, xw + matmul(xp, h, r_t)), c
    if kind == "GRU":
        zr = xw[:, :2 * H] + matmul(xp, h, r_t[:, :2 * H])
        z, r = f(0, zr[:, :H]), f(0, zr[:, H:])
        if lbr:
            hh = f(1, xw[:, 2 * H:] + r * (matmul(xp, h, r_t[:, 2 * H:]) + rb))
        else:
            hh = f(1, xw[:, 2 * H:] + matmul(xp, r * h, r_t[:, 2 * H:]) + rb)
        return (1 - z) * hh + z * h, c
    g = xw + matmul(xp, h, r_t)  # LSTM gates i, o, f, c
    gi, go, gf, gc = g[:, :H], g[:, H:2 * H], g[:, 2 * H:3 * H], g[:, 3 * H:]
    if p is not None:
        gi, gf = gi + p[0] * c, gf + p[2] * c
    i = f(0, gi)
    fg = 1 - i if input_forget else f(0, gf)
    c_new = fg * c + i * f(1, gc)
    if p is not None:
        go = go + p[1] * c_new
    name, a, b = acts[2]
    return f(0, go) * _act(xp, c_new, name, a, b), c_new


def _compute(xp, node, X, W, R, B=None, seq=None, h0=None, c0=None, P=None):
    kind = node.op_type
    layout = int(node.attr("layout", 0))
    wd = work_dtype(X.dtype)
    x = to_work(X)
    if layout:
        x = xp.transpose(x, (1, 0, 2))
        h0 = None if h0 is None else xp.transpose(h0, (1, 0, 2))
        c0 = None if c0 is None else xp.transpose(c0, (1, 0, 2))
    T, nb, ni = (int(d) for d in x.shape)
    nd, GH, H = (int(d) for d in R.shape)
    clip = node.attr("clip")
    clip = None if clip is None else wd.type(clip)
    lbr = int(node.attr("linear_before_reset", 0))
    input_forget = int(node.attr("input_forget", 0))
    reverse_only = node.attr("direction", "forward") == "reverse"
    acts = _activations(node)
    lens = None if seq is None else seq.astype(xp.int64).reshape(nb, 1)
    ys, hs, cs = [], [], []
    for d in range(nd):
        w_t = xp.transpose(to_work(W[d], wd))  # (input, G*H)
        r_t = xp.ascontiguousarray(xp.transpose(to_work(R[d], wd)))  # (H, G*H)
        xw = matmul(xp, x.reshape(T * nb, ni), w_t).reshape(T, nb, GH)
        rb = None
        if B is not None:
            b = to_work(B[d], wd)
            wb, rbias = b[:GH], b[GH:]
            if kind == "GRU":  # the recurrent h-bias sits inside r * (...) or after the product
                xw = xw + (wb + xp.concatenate((rbias[:2 * H], xp.zeros((H,), dtype=wd))))
                rb = rbias[2 * H:]
            else:
                xw = xw + (wb + rbias)
        if rb is None and kind == "GRU":
            rb = xp.zeros((H,), dtype=wd)
        p = None
        if P is not None:
            pw = to_work(P[d], wd)
            p = (pw[:H], pw[H:2 * H], pw[2 * H:])
        h = xp.zeros((nb, H), dtype=wd) if h0 is None else to_work(h0[d], wd)
        c = None
        if kind == "LSTM":
            c = xp.zeros((nb, H), dtype=wd) if c0 is None else to_work(c0[d], wd)
        steps: list = [None] * T
        order = range(T - 1, -1, -1) if (reverse_only or d == 1) else range(T)
        for t in order:  # host loop over the sequence length (a shape)
            h_new, c_new = _cell(xp, kind, acts[d], clip, lbr, input_forget, xw[t], h, c, r_t, rb, p)
            if lens is None:
                h, c = h_new, c_new
                steps[t] = h
            else:
                live = lens > t  # (batch, 1): this row's sequence still runs at step t
                h = xp.where(live, h_new, h)
                if c is not None:
                    c = xp.where(live, c_new, c)
                steps[t] = xp.where(live, h_new, xp.zeros((), dtype=wd))
        if lens is not None:  # a row of length 0 has no last step: zero Y_h/Y_c (as ONNX Runtime)
            ran = lens > 0
            h = xp.where(ran, h, xp.zeros((), dtype=wd))
            c = None if c is None else xp.where(ran, c, xp.zeros((), dtype=wd))
        ys.append(xp.stack(steps) if T else xp.zeros((0, nb, H), dtype=wd))
        hs.append(h)
        cs.append(c)
    y = xp.stack(ys, axis=1)  # (T, nd, batch, H)
    yh = xp.stack(hs)  # (nd, batch, H)
    yc = xp.stack(cs) if kind == "LSTM" else yh
    if layout:
        y, yh, yc = xp.transpose(y, (2, 0, 1, 3)), xp.transpose(yh, (1, 0, 2)), xp.transpose(yc, (1, 0, 2))
    dt = np.dtype(X.dtype)
    outs = tuple(xp.ascontiguousarray(v.astype(dt)) for v in (y, yh, yc))
    return outs[:max(node.n_outputs, 1)]


OPS = [OpKernel(op, _shapes, _compute, since=7, check=_check, index_checks=_index_checks, capture="safe")
       for op in ("RNN", "GRU", "LSTM")]
