"""Attention-family ops: Attention (23-25), RotaryEmbedding (23), TensorScatter (24), and
ai.onnx.preview FlexAttention (1; without score_mod/prob_mod subgraphs: with them the executor
runs it, ``reference_runtime/control_flow.py``, through this module's ``flex_*`` stages).

All products go through ``_linalg.matmul``; masks are built on the device from ``xp.arange``
(nonpad_kv_seqlen and write_indices stay on the device), so every op here is capture-safe.

Index inputs are checked on the device into the runtime's error latch (``index_checks``):
RotaryEmbedding's position_ids must address a row of its cos/sin caches, TensorScatter's linear
write_indices must leave room for the update. The kernels clip such values after they are flagged,
so they never raise (a raise inside a kernel would be a sticky device fault).
"""

from __future__ import annotations

import numpy as np

from ._fused import attention_into, rope_into, tensor_scatter_into
from ._latch import IndexCheck
from ._linalg import matmul
from ._op import OpKernel, Spec, normalize_axis

__all__ = ["ATTENTION_OPS"]

# ONNX TensorProto element types allowed for softmax_precision
_PRECISION = {1: np.float32, 10: np.float16, 11: np.float64, 16: np.float32}  # bfloat16 -> float32


# -- Attention ----------------------------------------------------------------------------------

def _attn_dims(node, specs):
    q, k, v = specs[0], specs[1], specs[2]
    if not (q.rank == k.rank == v.rank) or q.rank not in (3, 4):
        raise node.error(f"Q, K, V must all be 3-D or all 4-D, got ranks {q.rank}, {k.rank}, {v.rank}")
    B = q.shape[0]
    if q.rank == 3:
        hq, hkv = node.attr("q_num_heads"), node.attr("kv_num_heads")
        if hq is None or hkv is None:
            raise node.error("3-D inputs need the q_num_heads and kv_num_heads attributes")
        hq, hkv = int(hq), int(hkv)
        if hq <= 0 or hkv <= 0:
            raise node.error(f"q_num_heads={hq} and kv_num_heads={hkv} must be positive")
        for name, s, h in (("Q", q, hq), ("K", k, hkv), ("V", v, hkv)):
            if s.shape[2] % h:
                raise node.error(f"{name} hidden size {s.shape[2]} is not divisible by its {h} heads")
        sq, skv = q.shape[1], k.shape[1]
        dq, dk, dv = q.shape[2] // hq, k.shape[2] // hkv, v.shape[2] // hkv
        if v.shape[1] != skv:
            raise node.error(f"K and V sequence lengths differ: {k.shape} vs {v.shape}")
    else:
        if node.opset >= 25 and (node.attr("q_num_heads") is not None or node.attr("kv_num_heads") is not None):
            raise node.error("q_num_heads and kv_num_heads must not be specified for 4-D inputs")
        hq, sq, dq = q.shape[1:]
        hkv, skv, dk = k.shape[1:]
        if v.shape[1] != hkv or v.shape[2] != skv:
            raise node.error(f"K and V shapes disagree: {k.shape} vs {v.shape}")
        dv = v.shape[3]
    if k.shape[0] != B or v.shape[0] != B:
        raise node.error(f"batch sizes differ: Q {q.shape}, K {k.shape}, V {v.shape}")
    if dq != dk:
        raise node.error(f"Q head size {dq} differs from K head size {dk}")
    if hq != hkv and hq % hkv:
        raise node.error(f"q_num_heads {hq} is not a multiple of kv_num_heads {hkv}")
    return B, hq, hkv, sq, skv, dq, dv


def _attention_workspace(node, specs):
    """The float64 scores (batch, q heads, q length, total) and their softmax passes, and K and V
    repeated over the query heads: they dwarf Q, K and V when the head size is small."""
    specs = list(specs) + [None] * (7 - len(specs))
    B, hq, _, sq, skv, dk, dv = _attn_dims(node, specs)
    total = skv + (specs[4].shape[2] if specs[4] is not None else 0)
    return (4 * B * hq * sq * total + 2 * B * hq * total * (dk + dv)) * 8


def _attention_shapes(node, specs):
    specs = list(specs) + [None] * (7 - len(specs))
    B, hq, hkv, sq, skv, dk, dv = _attn_dims(node, specs)
    pk, pv, mask, nonpad = specs[4], specs[5], specs[3], specs[6]
    if (pk is None) != (pv is None):
        raise node.error("past_key and past_value must be given together")
    if nonpad is not None and pk is not None:
        raise node.error("nonpad_kv_seqlen cannot be combined with past_key/past_value")
    past = 0
    if pk is not None:
        if pk.rank != 4 or tuple(pk.shape[:2]) != (B, hkv) or pk.shape[3] != dk:
            raise node.error(f"past_key shape {pk.shape} does not match (batch, kv_heads, past, head_size)")
        if pv.rank != 4 or tuple(pv.shape[:3]) != tuple(pk.shape[:3]) or pv.shape[3] != dv:
            raise node.error(f"past_value shape {pv.shape} does not match past_key {pk.shape}")
        past = pk.shape[2]
    total = past + skv
    if mask is not None:
        if mask.rank < 1 or mask.shape[-1] > total:
            raise node.error(f"attn_mask shape {mask.shape} is longer than total sequence {total}")
        try:
            ok = np.broadcast_shapes(tuple(mask.shape[:-1]) + (total,), (B, hq, sq, total)) == (B, hq, sq, total)
        except ValueError:
            ok = False
        if not ok:
            raise node.error(f"attn_mask shape {mask.shape} does not broadcast to {(B, hq, sq, total)}")
    if nonpad is not None and tuple(nonpad.shape) != (B,):
        raise node.error(f"nonpad_kv_seqlen must have shape ({B},), got {nonpad.shape}")
    dt = specs[0].dtype
    y = (B, hq, sq, dv) if specs[0].rank == 4 else (B, sq, hq * dv)
    outs = [Spec(y, dt), Spec((B, hkv, total, dk), specs[1].dtype),
            Spec((B, hkv, total, dv), specs[2].dtype), Spec((B, hq, sq, total), dt)]
    return outs[:node.n_outputs]


def _f32(xp, fn, x):
    """``fn(x)`` computed in float32 for float16 ``x`` and rounded back, as numpy does: CuPy's own
    float16 transcendental may be a native half approximation that differs in the last bit."""
    if x.dtype == np.float16:
        return fn(x.astype(xp.float32)).astype(xp.float16)
    return fn(x)


def _sum_last(xp, x):
    if x.dtype == np.float16:  # numpy accumulates float16 sums in float32, rounding once
        return xp.sum(x, axis=-1, keepdims=True, dtype=xp.float32).astype(xp.float16)
    return xp.sum(x, axis=-1, keepdims=True)


def _bias_from(xp, allowed, dt):
    return xp.where(allowed, dt.type(0), dt.type(-np.inf))


def _attention_compute(xp, node, q, k, v, mask=None, past_k=None, past_v=None, nonpad=None):
    dt = np.dtype(q.dtype)
    B = q.shape[0]
    rank3 = q.ndim == 3
    if rank3:
        hq, hkv = int(node.attr("q_num_heads")), int(node.attr("kv_num_heads"))
        # head sizes spelled out: reshape's -1 is ambiguous for an empty sequence
        q = xp.transpose(q.reshape(B, q.shape[1], hq, q.shape[2] // hq), (0, 2, 1, 3))
        k = xp.transpose(k.reshape(B, k.shape[1], hkv, k.shape[2] // hkv), (0, 2, 1, 3))
        v = xp.transpose(v.reshape(B, v.shape[1], hkv, v.shape[2] // hkv), (0, 2, 1, 3))
    hq, sq, dq = q.shape[1], q.shape[2], q.shape[3]
    scale = node.attr("scale")
    scale = 1.0 / np.sqrt(dq) if scale is None else float(scale)
    s = dt.type(np.sqrt(scale))
    if past_k is not None:
        k = xp.concatenate((past_k, k), axis=2)
        v = xp.concatenate((past_v, v), axis=2)
    present_k, present_v = k, v
    past = past_k.shape[2] if past_k is not None else 0
    total = k.shape[2]

    # additive bias (broadcasts against (B, H, Sq, T))
    bias = xp.zeros((sq, total), dtype=dt)
    if mask is not None:
        pad = total - mask.shape[-1]
        if pad > 0:
            fill = False if mask.dtype == np.bool_ else -np.inf
            mask = xp.pad(mask, [(0, 0)] * (mask.ndim - 1) + [(0, pad)], mode="constant", constant_values=fill)
        if mask.dtype == np.bool_:
            mask = _bias_from(xp, mask, dt)
        else:
            mask = mask.astype(dt)
    left = int(node.attr("left_window_size", -1))
    right = int(node.attr("right_window_size", -1))
    if left < -1 or right < -1:
        raise node.error(f"window sizes must be -1 or nonnegative, got {left}, {right}")
    windowed = left >= 0 or right >= 0
    per_batch = nonpad is not None and past_k is None
    i_idx = xp.arange(sq, dtype=xp.int64).reshape(sq, 1)
    j_idx = xp.arange(total, dtype=xp.int64).reshape(1, total)
    if per_batch:
        offset = nonpad.astype(xp.int64).reshape(-1, 1, 1) - sq  # (B, 1, 1)
    else:
        offset = past

    def offset_bias(base, allowed):
        add = _bias_from(xp, allowed, dt)
        if per_batch:
            add = add.reshape(add.shape[0], 1, sq, total)
        return base + add

    if int(node.attr("is_causal", 0)):
        base = xp.zeros((sq, total), dtype=dt) if mask is None else mask
        if windowed:
            base = xp.zeros((sq, total), dtype=dt) + base
        bias = offset_bias(base, j_idx <= i_idx + offset)
    elif mask is not None:
        bias = bias + mask
    if windowed:
        bias = xp.zeros((sq, total), dtype=dt) + bias
        diff = (i_idx + offset) - j_idx
        allowed = xp.ones(diff.shape, dtype=bool)
        if left >= 0:
            allowed = allowed & (diff <= left)
        if right >= 0:
            allowed = allowed & (-diff <= right)
        bias = offset_bias(bias, allowed)
    if nonpad is not None:
        keep = xp.arange(total, dtype=xp.int64).reshape(1, total) < nonpad.astype(xp.int64).reshape(-1, 1)
        bias = bias + _bias_from(xp, keep, dt).reshape(B, 1, 1, total)

    hk = k.shape[1]
    if hq != hk and hq % hk == 0:
        k = xp.repeat(k, hq // hk, axis=1)
        v = xp.repeat(v, hq // hk, axis=1)

    qk = matmul(xp, q * s, xp.swapaxes(k, -1, -2) * s).astype(dt)
    softcap = float(node.attr("softcap", 0.0) or 0.0)
    if softcap > 0:
        c = dt.type(softcap)
        qk = _f32(xp, xp.tanh, qk / c) * c
    # An additive mask at the bottom of the range (Hugging Face's finfo(float16).min) may overflow
    # to -inf in float16, in this sum or in x - max below: IEEE's answer, and exp gives its 0.
    with np.errstate(over="ignore"):
        with_bias = qk + bias
    mode = int(node.attr("qk_matmul_output_mode", 0))
    qk_out = with_bias if mode == 2 else qk
    prec = node.attr("softmax_precision")
    x = with_bias.astype(_PRECISION.get(int(prec), dt)) if prec is not None else with_bias
    x_max = xp.max(x, axis=-1, keepdims=True)
    zero, one = x.dtype.type(0), x.dtype.type(1)
    safe_max = xp.where(x_max == -np.inf, zero, x_max)
    with np.errstate(over="ignore"):
        e = _f32(xp, xp.exp, x - safe_max)
    ssum = _sum_last(xp, e)
    p = e / xp.where(ssum == zero, one, ssum)
    row_masked = xp.max(bias, axis=-1, keepdims=True) == -np.inf
    p = xp.where(row_masked, zero, p)
    if mode == 3:
        qk_out = p
    p = p.astype(dt)
    y = matmul(xp, p, v).astype(dt)
    if rank3:
        y = xp.transpose(y, (0, 2, 1, 3)).reshape(B, sq, y.shape[1] * y.shape[3])
    return (y, present_k, present_v, qk_out.astype(dt))[:max(node.n_outputs, 1)]


def _attention_into(xp, node, outs, q, k, v, mask=None, past_k=None, past_v=None, nonpad=None):
    """The decode case in one launch on CuPy (two with the presents; ``_fused.attention_into``):
    no softcap, windows or nonpad_kv_seqlen, float32 softmax; its softmax denominator is summed in
    another order than CuPy's sum (last-bit float32 differences)."""
    left, right = int(node.attr("left_window_size", -1)), int(node.attr("right_window_size", -1))
    prec = node.attr("softmax_precision")
    if (nonpad is not None or float(node.attr("softcap", 0.0) or 0.0) != 0.0 or left != -1 or right != -1
            or (prec is not None and _PRECISION.get(int(prec)) is not np.float32)):
        return False
    scale = node.attr("scale")
    scale = 1.0 / np.sqrt(q.shape[-1]) if scale is None else float(scale)
    return attention_into(xp, outs, q, k, v, mask, past_k, past_v, scale, bool(int(node.attr("is_causal", 0))))


# -- RotaryEmbedding ----------------------------------------------------------------------------

def _rope_dims(node, specs):
    x = specs[0]
    if x.rank == 4:
        B, H, S, D = x.shape
    elif x.rank == 3:
        nh = int(node.attr("num_heads", 0) or 0)
        if nh <= 0:
            raise node.error("3-D input needs a positive num_heads attribute")
        B, S, hidden = x.shape
        if hidden % nh:
            raise node.error(f"hidden size {hidden} is not divisible by num_heads {nh}")
        H, D = nh, hidden // nh
    else:
        raise node.error(f"input must be 3-D or 4-D, got shape {x.shape}")
    rd = int(node.attr("rotary_embedding_dim", 0) or 0) or D
    if rd > D or rd % 2:
        raise node.error(f"rotary_embedding_dim {rd} must be even and at most head_size {D}")
    return B, H, S, D, rd


def _rope_shapes(node, specs):
    B, H, S, D, rd = _rope_dims(node, specs)
    cos, sin = specs[1], specs[2]
    pos = specs[3] if len(specs) > 3 else None
    for name, c in (("cos_cache", cos), ("sin_cache", sin)):
        if c.shape[-1] != rd // 2:
            raise node.error(f"{name} last dim {c.shape[-1]} != rotary_embedding_dim/2 = {rd // 2}")
        if pos is None and tuple(c.shape) != (B, S, rd // 2):
            raise node.error(f"{name} shape {c.shape} must be (batch, seq, rotary_dim/2) without position_ids")
        if pos is not None and c.rank != 2:
            raise node.error(f"{name} must be 2-D with position_ids, got {c.shape}")
    if tuple(cos.shape) != tuple(sin.shape):
        raise node.error(f"cos_cache shape {cos.shape} and sin_cache shape {sin.shape} differ")
    if pos is not None and tuple(pos.shape) != (B, S):
        raise node.error(f"position_ids shape {pos.shape} must be {(B, S)}")
    if pos is not None and cos.shape[0] == 0 and B * S:
        raise node.error(f"cos_cache shape {cos.shape} has no rows: position_ids cannot index it")
    return [Spec(specs[0].shape, specs[0].dtype)]


def _rope_compute(xp, node, x, cos, sin, pos=None):
    B, H, S, D, rd = _rope_dims(node, [Spec(x.shape, x.dtype)])
    shape = x.shape
    x = xp.transpose(x, (0, 2, 1, 3)) if x.ndim == 4 else x.reshape(B, S, H, D)  # (B, S, H, D)
    if pos is not None:  # out-of-range positions were flagged (_rope_check); clip so the kernel never raises
        pos = xp.clip(pos.astype(xp.int64), 0, cos.shape[0] - 1)
        cos = xp.take(cos, pos, axis=0)
        sin = xp.take(sin, pos, axis=0)
    cos = cos.reshape(B, S, 1, rd // 2)
    sin = sin.reshape(B, S, 1, rd // 2)
    rot, rest = x[..., :rd], x[..., rd:]
    if int(node.attr("interleaved", 0)):
        x1, x2 = rot[..., 0::2], rot[..., 1::2]
    else:
        x1, x2 = rot[..., :rd // 2], rot[..., rd // 2:]
    real = cos * x1 - sin * x2
    imag = sin * x1 + cos * x2
    if int(node.attr("interleaved", 0)):
        rot = xp.stack((real, imag), axis=-1).reshape(B, S, H, rd)
    else:
        rot = xp.concatenate((real, imag), axis=-1)
    y = xp.concatenate((rot, rest), axis=-1)
    y = xp.transpose(y, (0, 2, 1, 3)) if len(shape) == 4 else y.reshape(shape)
    return (y.astype(x.dtype),)


def _rope_into(xp, node, outs, x, cos, sin, pos=None):
    """One launch on CuPy, the kernel's index arithmetic with numpy (``_fused.rope_into``): same bytes."""
    _, H, _, _, rd = _rope_dims(node, [Spec(x.shape, x.dtype)])
    return rope_into(xp, outs[0], x, cos, sin, pos, H, rd, bool(int(node.attr("interleaved", 0))))


def _rope_check(node, specs):
    """position_ids address rows [0, rows) of the 2-D cos/sin caches (ONNX Runtime refuses others)."""
    if len(specs) > 3 and specs[3] is not None:
        return [IndexCheck(3, 0, min(specs[1].shape[0], specs[2].shape[0]), by=(1, 2))]
    return []


# -- TensorScatter ------------------------------------------------------------------------------

def _ts_shapes(node, specs):
    past, upd = specs[0], specs[1]
    wi = specs[2] if len(specs) > 2 else None
    if past.rank < 2 or upd.rank != past.rank:
        raise node.error(f"past_cache {past.shape} and update {upd.shape} must have the same rank >= 2")
    axis = normalize_axis(node, int(node.attr("axis", -2)), past.rank)
    if axis == 0:
        raise node.error("axis cannot be 0 (the batch dimension)")
    for i, (a, b) in enumerate(zip(past.shape, upd.shape)):
        if (i != axis and a != b) or (i == axis and b > a):
            raise node.error(f"update shape {upd.shape} does not fit past_cache {past.shape} on axis {i}")
    if node.attr("mode", "linear") not in ("linear", "circular"):
        raise node.error(f"unsupported mode {node.attr('mode')!r}")
    if wi is not None and tuple(wi.shape) != (past.shape[0],):
        raise node.error(f"write_indices must have shape ({past.shape[0]},), got {wi.shape}")
    return [Spec(past.shape, past.dtype)]


def _ts_compute(xp, node, past, upd, wi=None):
    nd = past.ndim
    axis = int(node.attr("axis", -2)) % nd
    L, S = past.shape[axis], upd.shape[axis]
    if S == 0:
        return (past.copy(),)
    tshape = [1] * nd
    tshape[axis] = L
    t = xp.arange(L, dtype=xp.int64).reshape(tshape)
    if wi is not None:
        src = t - wi.astype(xp.int64).reshape((past.shape[0],) + (1,) * (nd - 1))
    else:
        src = t
    if node.attr("mode", "linear") == "circular":
        src = src % L
    valid = (src >= 0) & (src < S)
    idx_shape = list(upd.shape)
    idx_shape[axis] = L
    idx = xp.broadcast_to(xp.clip(src, 0, S - 1), tuple(idx_shape))
    gathered = xp.take_along_axis(upd, idx, axis=axis)
    return (xp.where(valid, gathered, past).astype(past.dtype),)


def _ts_into(xp, node, outs, past, upd, wi=None):
    """One launch (``_fused.tensor_scatter_into``); a cache bound in place gets only its update rows."""
    axis = int(node.attr("axis", -2)) % past.ndim
    return tensor_scatter_into(xp, outs[0], past, upd, wi, axis, node.attr("mode", "linear") == "circular")


def _ts_check(node, specs):
    """Linear mode: write_indices[b] + sequence_length <= max_sequence_length (ONNX's reference
    indexes past the cache otherwise); circular mode wraps any index, so nothing to check."""
    if len(specs) < 3 or specs[2] is None or node.attr("mode", "linear") != "linear":
        return []
    axis = int(node.attr("axis", -2)) % specs[0].rank
    L, S = specs[0].shape[axis], specs[1].shape[axis]
    return [IndexCheck(2, 0, L - S + 1)] if S else []


# -- FlexAttention (ai.onnx.preview) -----------------------------------------------------------

def _flex_shapes(node, specs):
    q, k, v = specs[0], specs[1], specs[2]
    for name in ("score_mod", "prob_mod"):
        if node.attr(name) is not None:
            from lockstep.engines.protocol import Unsupported  # the protocol's exception: kernels do not import the runtime

            raise Unsupported(f"FlexAttention: {node.name}: the {name} subgraph attribute is not supported")
    if q.rank != 4 or k.rank != 4 or v.rank != 4:
        raise node.error(f"Q, K, V must be rank 4, got {q.shape}, {k.shape}, {v.shape}")
    B, hq, L, E = q.shape
    _, hkv, S, ek = k.shape
    if v.shape[1] != hkv or v.shape[2] != S or ek != E or k.shape[0] != B or v.shape[0] != B:
        raise node.error(f"Q {q.shape}, K {k.shape}, V {v.shape} disagree")
    if hq != hkv and (hkv <= 0 or hq % hkv):
        raise node.error(f"q heads {hq} is not a multiple of kv heads {hkv}")
    prec = node.attr("softmax_precision")
    if prec is not None and int(prec) not in _PRECISION:
        raise node.error(f"unsupported softmax_precision {prec}")
    return [Spec((B, hq, L, v.shape[3]), v.dtype)]


def flex_scores(xp, node, q, k):
    """FlexAttention's ``(Q * sqrt(scale)) @ (K * sqrt(scale))^T`` (K's heads repeated for GQA) in
    the softmax precision (``flex_precision``). Shared with the subgraph path
    (``reference_runtime.control_flow``), which runs score_mod/prob_mod between the stages."""
    dt = np.dtype(q.dtype)
    hq, hkv, E = q.shape[1], k.shape[1], q.shape[3]
    if hq != hkv:
        k = xp.repeat(k, hq // hkv, axis=1)
    scale = node.attr("scale")
    scale = 1.0 / np.sqrt(E) if scale is None else float(scale)
    s = dt.type(np.sqrt(np.float32(scale)))
    scores = matmul(xp, q * s, xp.swapaxes(k * s, -1, -2)).astype(dt)
    return scores.astype(flex_precision(node, dt))


def flex_precision(node, dt) -> np.dtype:
    """The softmax precision: the attribute's, else float32 for inputs narrower than it, else theirs."""
    prec = node.attr("softmax_precision")
    if prec is not None:
        return np.dtype(_PRECISION[int(prec)])
    return np.dtype(np.float32) if np.dtype(dt).itemsize < 4 else np.dtype(dt)


def flex_softmax(xp, scores):
    e = _f32(xp, xp.exp, scores - xp.max(scores, axis=-1, keepdims=True))
    return e / _sum_last(xp, e)


def flex_output(xp, probs, v):
    """``probs @ V`` (V's heads repeated for GQA) in the softmax precision, cast to V's dtype."""
    hq, hkv = probs.shape[1], v.shape[1]
    if hq != hkv:
        v = xp.repeat(v, hq // hkv, axis=1)
    return matmul(xp, probs, v.astype(probs.dtype)).astype(v.dtype)


def _flex_compute(xp, node, q, k, v):
    return (flex_output(xp, flex_softmax(xp, flex_scores(xp, node, q, k)), v),)


ATTENTION_OPS = [
    OpKernel("FlexAttention", _flex_shapes, _flex_compute, domain="ai.onnx.preview", since=1, capture="safe"),
    OpKernel("Attention", _attention_shapes, _attention_compute, since=23,
             workspace=_attention_workspace, into=_attention_into, capture="safe"),
    OpKernel("RotaryEmbedding", _rope_shapes, _rope_compute, since=23, index_checks=_rope_check,
             into=_rope_into, capture="safe"),
    OpKernel("TensorScatter", _ts_shapes, _ts_compute, since=24, index_checks=_ts_check, into=_ts_into, capture="safe"),
]
