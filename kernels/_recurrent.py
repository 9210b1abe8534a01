"""Stateful sequence ops (opset 27): LinearAttention and CausalConvWithState.

LinearAttention runs its recurrence token by token (a host loop over the static sequence length,
one small batched ``_linalg.matmul`` per read/retrieval), in float32 as the reference does.
CausalConvWithState is a depthwise causal conv written as a host loop over the (static) kernel
taps. Neither reads device data on the host, so both are capture-safe.
"""

from __future__ import annotations

import numpy as np

from ._linalg import matmul
from ._op import OpKernel, Spec, head_counts

__all__ = ["RECURRENT_OPS"]

_RULES = ("linear", "gated", "delta", "gated_delta")


# -- LinearAttention ----------------------------------------------------------------------------

def _la_dims(node, specs):
    specs = list(specs) + [None] * (6 - len(specs))
    q, k, v, past, decay, beta = specs
    rule = node.attr("update_rule", "gated_delta")
    if rule not in _RULES:
        raise node.error(f"unsupported update_rule {rule!r}; expected one of {_RULES}")
    hq, hkv = head_counts(node, "q_num_heads", "kv_num_heads")
    for name, s in (("query", q), ("key", k), ("value", v)):
        if s.rank != 3:
            raise node.error(f"{name} must be rank 3 (B, T, H*D), got {s.shape}")
    B, T = q.shape[0], q.shape[1]
    if q.shape[2] % hq or k.shape[2] % hkv or v.shape[2] % hkv:
        raise node.error(f"hidden sizes {q.shape[2]}, {k.shape[2]}, {v.shape[2]} do not divide by the heads")
    dk, dv = q.shape[2] // hq, v.shape[2] // hkv
    if k.shape[2] // hkv != dk or tuple(k.shape[:2]) != (B, T) or tuple(v.shape[:2]) != (B, T):
        raise node.error(f"query {q.shape}, key {k.shape}, value {v.shape} disagree")
    gating, delta = rule in ("gated", "gated_delta"), rule in ("delta", "gated_delta")
    if gating != (decay is not None):
        raise node.error(f"update_rule {rule!r} {'requires' if gating else 'forbids'} the decay input")
    if delta != (beta is not None):
        raise node.error(f"update_rule {rule!r} {'requires' if delta else 'forbids'} the beta input")
    if decay is not None and (decay.rank != 3 or tuple(decay.shape[:2]) != (B, T) or decay.shape[2] not in (hkv, hkv * dk)):
        raise node.error(f"decay shape {decay.shape} must be (B, T, {hkv}) or (B, T, {hkv * dk})")
    if beta is not None and (beta.rank != 3 or tuple(beta.shape[:2]) != (B, T) or beta.shape[2] not in (hkv, 1)):
        raise node.error(f"beta shape {beta.shape} must be (B, T, {hkv}) or (B, T, 1)")
    if past is not None and tuple(past.shape) != (B, hkv, dk, dv):
        raise node.error(f"past_state shape {past.shape} must be {(B, hkv, dk, dv)}")
    return B, T, hq, hkv, dk, dv


def _la_shapes(node, specs):
    B, T, hq, hkv, dk, dv = _la_dims(node, specs)
    past = specs[3] if len(specs) > 3 else None
    sdt = past.dtype if past is not None else specs[0].dtype
    return [Spec((B, T, hq * dv), specs[0].dtype), Spec((B, hkv, dk, dv), sdt)][:max(node.n_outputs, 1)]


def _heads(xp, x, h):
    b, t, hd = x.shape
    return xp.transpose(x.reshape(b, t, h, hd // h), (0, 2, 1, 3)).astype(xp.float32)  # (B, H, T, D)


def _la_compute(xp, node, q, k, v, past=None, decay=None, beta=None):
    B, T, hq, hkv, dk, dv = _la_dims(node, [Spec(a.shape, a.dtype) if a is not None else None
                                            for a in (q, k, v, past, decay, beta)])
    out_dt = q.dtype
    sdt = past.dtype if past is not None else q.dtype
    q4, k4, v4 = _heads(xp, q, hq), _heads(xp, k, hkv), _heads(xp, v, hkv)
    g4 = None
    if decay is not None:
        g4 = _heads(xp, decay, hkv) if decay.shape[2] != hkv else \
            xp.transpose(decay.reshape(B, T, hkv, 1), (0, 2, 1, 3)).astype(xp.float32)
    b4 = None
    if beta is not None:
        b4 = xp.transpose(beta.reshape(B, T, beta.shape[2], 1), (0, 2, 1, 3)).astype(xp.float32)
    state = past.astype(xp.float32) if past is not None else xp.zeros((B, hkv, dk, dv), dtype=xp.float32)
    scale = float(node.attr("scale", 0.0) or 0.0)
    scale = np.float32(1.0 / np.sqrt(dk) if scale == 0.0 else scale)
    group = hq // hkv
    outs = []
    for i in range(T):
        q_t, k_t, v_t = q4[:, :, i, :], k4[:, :, i, :], v4[:, :, i, :]
        if g4 is not None:
            state = state * xp.exp(g4[:, :, i, :])[..., None]
        if b4 is not None:
            retrieved = matmul(xp, k_t[:, :, None, :], state)[:, :, 0, :]  # (B, Hkv, dv)
            v_t = b4[:, :, i, :] * (v_t - retrieved)
        state = state + k_t[..., :, None] * v_t[..., None, :]
        read = xp.repeat(state, group, axis=1) if group > 1 else state
        outs.append(matmul(xp, q_t[:, :, None, :], read)[:, :, 0, :] * scale)  # (B, Hq, dv)
    o = xp.stack(outs, axis=1) if outs else xp.zeros((B, 0, hq, dv), dtype=xp.float32)  # (B, T, Hq, dv)
    return (o.reshape(B, T, hq * dv).astype(out_dt), state.astype(sdt))


# -- CausalConvWithState ------------------------------------------------------------------------

def _cc_shapes(node, specs):
    specs = list(specs) + [None] * (4 - len(specs))
    x, w, bias, past = specs
    if node.attr("activation", "none") not in ("none", "silu", "swish"):
        raise node.error(f"unsupported activation {node.attr('activation')!r}")
    if x.rank != 3 or w.rank != 3:
        raise node.error(f"input {x.shape} and weight {w.shape} must be rank 3")
    B, C, _ = x.shape
    if w.shape[0] != C or w.shape[1] != 1 or w.shape[2] < 1:
        raise node.error(f"weight shape {w.shape} must be ({C}, 1, k)")
    k = w.shape[2]
    if bias is not None and tuple(bias.shape) != (C,):
        raise node.error(f"bias shape {bias.shape} must be ({C},)")
    if past is not None and tuple(past.shape) != (B, C, k - 1):
        raise node.error(f"past_state shape {past.shape} must be {(B, C, k - 1)}")
    return [Spec(x.shape, x.dtype), Spec((B, C, k - 1), x.dtype)][:max(node.n_outputs, 1)]


def _cc_compute(xp, node, x, w, bias=None, past=None):
    B, C, L = x.shape
    k = w.shape[2]
    pad = past.astype(x.dtype) if past is not None else xp.zeros((B, C, k - 1), dtype=x.dtype)
    padded = xp.concatenate((pad, x), axis=2)
    acc = xp.zeros((B, C, L), dtype=xp.float32)
    wf = w.astype(xp.float32)
    for i in range(k):
        acc = acc + wf[None, :, 0, i:i + 1] * padded[:, :, i:i + L].astype(xp.float32)
    if bias is not None:
        acc = acc + bias.astype(xp.float32)[None, :, None]
    y = acc.astype(x.dtype)
    if node.attr("activation", "none") in ("silu", "swish"):
        yf = y.astype(xp.float32)
        y = (yf * (1.0 / (1.0 + xp.exp(-yf)))).astype(x.dtype)
    present = padded[:, :, padded.shape[2] - (k - 1):] if k > 1 else padded[:, :, :0]
    return (y, present.copy())


RECURRENT_OPS = [
    OpKernel("LinearAttention", _la_shapes, _la_compute, since=27, capture="safe"),
    OpKernel("CausalConvWithState", _cc_shapes, _cc_compute, since=27, capture="safe"),
]
