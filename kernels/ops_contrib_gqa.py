"""ONNX Runtime's GroupQueryAttention (domain ``com.microsoft``, version 1), computed as onnxruntime's
CPU provider computes it (checked against onnxruntime 1.31.1; ``tests/test_contrib_ops.py``); the
other contrib ops are ``ops_contrib`` and ``ops_contrib_attention``.

GroupQueryAttention
    Query ``[B, S, Nq*D]`` (or packed QKV when key/value are absent), key/value ``[B, S, Nkv*D]``,
    past/present KV in BNSH.  What ORT 1.31.1's CPU provider does, probed case by case:

    * Cache kind from the past length ``P`` (dim 2 of past_key; 0 when absent), the new length
      ``S`` and ``T = total_sequence_length`` (a host value, ``host_inputs``): ``T == P + S`` is a
      *dynamic* (growing, concat) cache and present has length ``T``; ``T <= P`` is a *static*
      (shared-buffer, capacity ``P``) cache and present has length ``P``; anything else is an error.
      Without past, ``T`` must equal ``S``.
    * Per batch entry b the total length is ``t_b = seqlens_k[b] + 1`` (read on the device).  On the
      first prompt (``S == T``) the past length is ``p_b = 0`` (rows ``S > t_b`` are right padding);
      otherwise ``p_b = t_b - S`` (token generation, or a later prompt chunk, which needs B == 1).
      A ``seqlens_k`` ORT refuses (outside ``[0, present length)``, below ``S - 1`` after the first
      prompt, or a rotary position past the cos/sin rows) sets the runtime's error latch
      (``index_checks``: ``DeviceAssert`` naming the node); the kernel clips it.
    * Present row ``r`` of entry b: ``past[r]`` for ``r < p_b``, the new (rotated) key/value
      ``r - p_b`` for ``p_b <= r < p_b + S``, zero elsewhere -- ORT zeroes a present buffer that
      is not the past buffer (onnxruntime's Python API never shares them; with IO binding in place
      the rows past ``p_b + S`` are unspecified in ORT and zero here).
    * Rotary (``do_rotary=1``, cos/sin caches ``[max_pos, rotary_dim/2]``) rotates Q and K at
      position ``p_b + s`` for query row s -- ``0..S-1`` on the first prompt even for padded rows,
      ``seqlens_k[b]`` when decoding one token; interleaved or half-split (``rotary_interleaved``);
      features past ``rotary_dim`` pass through.
    * Query row s (absolute position ``p_b + s``) attends to key rows ``j < t_b`` with
      ``j <= p_b + s`` (``causal=1``), and ``j > p_b + s - local_window_size`` when the window is
      positive.  Scores are ``scale * q.k`` (default ``1/sqrt(D)``), soft-capped as
      ``softcap * tanh(x / softcap)`` when ``softcap > 0``.  A row with no key gives zeros.
    * ``sliding_window_cache=1`` (Gemma 2/3's local layers from GenAI's builder): the past/present
      buffers are window-sized, of capacity ``C`` (axis 2 of past_key, at least the window ``W``),
      and the op evicts as ONNX Runtime's schema documents (Windowed KV Cache): with ``t_b`` the
      positions processed (``seqlens_k[b] + 1``), ``G = C - W + 1`` and ``L(t) = t`` up to ``C``,
      else ``t - G * ceil((t - C) / G)``, rows ``[0, L(p_b))`` of the past hold positions
      ``p_b - L(p_b) .. p_b - 1`` and rows ``[0, L(t_b))`` of the present hold ``t_b - L(t_b) ..
      t_b - 1`` (rows past ``L`` are unspecified in ORT, zero here). Any step length is accepted
      (``S > C`` too); ``total_sequence_length`` is only the batch's largest ``t_b`` (it may exceed
      ``C``). The resident range comes from device data (``seqlens_k``), so a captured step stays
      valid as the window moves. A buffer under the window (``C < W``) or none is refused; ORT's
      CUDA provider accepts only ``C == W`` (its CPU provider any ``C >= W``).
    * ``q_norm_weight``/``k_norm_weight`` (in ONNX Runtime 1.31.1's schema; Gemma 3 from GenAI's
      builder for CUDA): a per-head RMS norm of Q and K over the head size,
      ``x / sqrt(mean(x^2) + qk_norm_epsilon) * weight`` (epsilon defaults to 1e-6), before rotary,
      computed in float32 and stored in the input type -- what the builder's CPU graphs spell as
      Reshape -> SimplifiedLayerNormalization -> Reshape before the op, which is what
      ``tests/test_contrib_ops_export.py`` compares with.  ORT 1.31.1 honours the inputs on its
      CUDA and WebGPU providers only; its CPU provider refuses the node ("q_norm_weight /
      k_norm_weight inputs are not supported").  Both or neither, each of shape ``(head_size,)``.
    * Refused with ``node.error``: ``smooth_softmax=1``, quantised KV
      caches, ``qk_output``/``output_qk``, and the inputs position_ids, attention_bias, head_sink,
      k_scale, v_scale.
"""

from __future__ import annotations

import numpy as np

from ._contrib_util import assemble_cache, attention, rotary, work_dtype
from ._contrib_util import cast as _cast
from ._contrib_util import pad_specs as _specs
from ._latch import IndexCheck
from ._op import OpKernel, Spec, head_counts

OPS: list[OpKernel] = []

_MS = "com.microsoft"


# -- GroupQueryAttention -----------------------------------------------------------------------

_GQA_UNSUPPORTED_INPUTS = {9: "position_ids", 10: "attention_bias", 11: "head_sink", 12: "k_scale",
                           13: "v_scale"}


def _gqa_attrs(node):
    nq, nkv = head_counts(node, "num_heads", "kv_num_heads")
    smooth = int(node.attr("smooth_softmax", 0))
    if smooth not in (0, -1):
        raise node.error(f"smooth_softmax={smooth} is not supported (only 0)")
    for key in ("qk_output", "kv_cache_bit_width"):
        if int(node.attr(key, 0)):
            raise node.error(f"attribute {key}={node.attr(key)} is not supported")
    for key in ("k_quant_type", "v_quant_type"):
        if str(node.attr(key, "NONE")) != "NONE":
            raise node.error(f"attribute {key}={node.attr(key)!r} is not supported (quantised KV cache)")
    causal = int(node.attr("causal", 1))
    window = int(node.attr("local_window_size", -1))
    if causal not in (0, 1):
        raise node.error(f"causal={causal} must be 0 or 1")
    if not causal and window != -1:
        raise node.error(f"local_window_size={window} must be -1 when causal is 0")
    sliding = int(node.attr("sliding_window_cache", 0))
    if sliding not in (0, 1):
        raise node.error(f"sliding_window_cache={sliding} must be 0 or 1")
    if sliding and window < 1:
        raise node.error(f"sliding_window_cache=1 needs a positive local_window_size, got {window}")
    softcap = float(node.attr("softcap", 0.0))
    if softcap < 0:
        raise node.error(f"softcap={softcap} must be >= 0")
    return nq, nkv, causal, window, softcap, bool(sliding)


def _gqa_dims(node, specs):
    """(B, S, D, P, T, L, rotary_dim) from the input specs; T from the host value of input 6."""
    specs = _specs(specs, 16)
    nq, nkv, _causal, window, _softcap, sliding = _gqa_attrs(node)
    for i, name in _GQA_UNSUPPORTED_INPUTS.items():
        if specs[i] is not None:
            raise node.error(f"input {name} is not supported")
    if node.n_outputs > 3:
        raise node.error("output output_qk is not supported")
    q, k, v, pk, pv, seqlens, tsl, cos, sin = specs[:9]
    if q.rank != 3:
        raise node.error(f"query must be 3-D [B, S, hidden], got shape {q.shape}")
    B, S, hidden = q.shape
    if B < 1 or S < 1:  # ORT: "total_sequence_length must be positive" for an empty prompt
        raise node.error(f"query {list(q.shape)}: batch_size and sequence_length must be positive")
    if (k is None) != (v is None):
        raise node.error("key and value must both be present, or both absent (packed QKV)")
    heads = nq if k is not None else nq + 2 * nkv
    if hidden % heads:
        raise node.error(f"query hidden size {hidden} is not divisible by {heads} heads")
    D = hidden // heads
    if k is not None:
        for name, s in (("key", k), ("value", v)):
            if tuple(s.shape) != (B, S, nkv * D):
                raise node.error(f"{name} shape {s.shape} must be {(B, S, nkv * D)}")
    if (pk is None) != (pv is None):
        raise node.error("past_key and past_value must both be present or both absent")
    P = 0
    if pk is not None:
        if pk.rank != 4 or tuple(pk.shape[:2]) != (B, nkv) or pk.shape[3] != D:
            raise node.error(f"past_key shape {pk.shape} must be [{B}, {nkv}, past, {D}] (BNSH)")
        if tuple(pv.shape) != tuple(pk.shape):
            raise node.error(f"past_value shape {pv.shape} differs from past_key {pk.shape}")
        P = pk.shape[2]
    if tuple(seqlens.shape) != (B,) or np.dtype(seqlens.dtype) != np.int32:
        raise node.error(f"seqlens_k must be int32 [{B}], got {seqlens.dtype}{list(seqlens.shape)}")
    if tsl.value is None or tsl.value.size != 1:
        raise node.error("total_sequence_length must be a one-element int32 tensor")
    T = int(np.asarray(tsl.value).reshape(-1)[0])
    if T < 1:
        raise node.error(f"total_sequence_length must be positive, got {T}")
    if sliding:
        if pk is None or P < window:  # ORT: INVALID_ARGUMENT ("KV cache capacity (0) must be at least ...")
            raise node.error(f"sliding_window_cache=1: the KV cache capacity ({P}, axis 2 of past_key) must be at "
                             f"least local_window_size ({window})")
        L = P  # a window-sized buffer of capacity P, evicting (total_sequence_length may exceed it)
    elif T == P + S:
        L = T  # growing cache: present = past ++ new
    elif T <= P:
        L = P  # shared-buffer cache of capacity P
    else:
        raise node.error(f"total_sequence_length={T} must equal past_sequence_length + sequence_length "
                         f"({P} + {S}) for a growing cache, or be at most past_sequence_length for a static cache")
    if S > 1 and S != T and B != 1:
        raise node.error("batch_size must be 1 when sequence_length > 1 and past context is given")
    rd = 0
    if int(node.attr("do_rotary", 0)):
        if cos is None or sin is None:
            raise node.error("do_rotary=1 needs cos_cache and sin_cache")
        if cos.rank != 2 or tuple(sin.shape) != tuple(cos.shape):
            raise node.error(f"cos_cache {cos.shape} and sin_cache {sin.shape} must be the same 2-D shape")
        rd = 2 * cos.shape[1]
        if rd == 0 or rd > D:
            raise node.error(f"rotary dim 2 * {cos.shape[1]} must be in (0, head_size={D}]")
        if cos.shape[0] < T:
            raise node.error(f"cos_cache has {cos.shape[0]} positions, fewer than total_sequence_length={T}")
    elif (cos is None) != (sin is None):
        raise node.error("cos_cache and sin_cache must both be present or both absent")
    qn, kn = specs[14], specs[15]
    if (qn is None) != (kn is None):
        raise node.error("q_norm_weight and k_norm_weight must both be present or both absent")
    for name, s in (("q_norm_weight", qn), ("k_norm_weight", kn)):
        if s is not None and tuple(s.shape) != (D,):
            raise node.error(f"{name} must have shape ({D},) (head_size), got {s.shape}")
    return B, S, D, P, T, L, rd


def _gqa_shapes(node, specs):
    B, S, D, _P, _T, L, _rd = _gqa_dims(node, specs)
    nq, nkv = int(node.attr("num_heads")), int(node.attr("kv_num_heads"))
    dt = specs[0].dtype
    outs = [Spec((B, S, nq * D), dt), Spec((B, nkv, L, D), dt), Spec((B, nkv, L, D), dt)]
    return outs[:max(node.n_outputs, 1)]


def _gqa_workspace(node, specs):
    """The float64 scores (batch, heads, new tokens, cache length) with their softmax passes, and
    the cache repeated over the query heads."""
    B, S, D, _P, _T, L, _rd = _gqa_dims(node, specs)
    nq = int(node.attr("num_heads"))
    if int(node.attr("sliding_window_cache", 0)):
        L += S  # the resident rows and the step's keys side by side
    return (4 * B * nq * S * L + 4 * B * nq * L * D) * 8


def _heads(x, B, S, n, D):
    return x.reshape(B, S, n, D).transpose(0, 2, 1, 3)


def _head_rms_norm(xp, x, weight, eps, dt):
    """Per-head RMS norm over the head size of ``x`` [B, H, S, D] (work dtype), stored in ``dt``."""
    work = x.dtype
    inv = 1 / xp.sqrt(xp.mean(x * x, axis=-1, keepdims=True) + work.type(eps))  # as SimplifiedLayerNormalization
    y = x * inv * weight.astype(work)
    return y.astype(dt).astype(work) if dt != work else y


def _gqa_compute(xp, node, q, k, v, past_k, past_v, seqlens, tsl, cos=None, sin=None, position_ids=None,
                 attention_bias=None, head_sink=None, k_scale=None, v_scale=None, q_norm=None, k_norm=None):
    nq, nkv, causal, window, softcap, sliding = _gqa_attrs(node)
    B, S = q.shape[0], q.shape[1]
    D = q.shape[2] // (nq if k is not None else nq + 2 * nkv)
    P = past_k.shape[2] if past_k is not None else 0
    T = int(np.asarray(node.host[6]).reshape(-1)[0])
    L = T if T == P + S else P
    dt = np.dtype(q.dtype)
    work = work_dtype(dt)
    if k is None:  # packed QKV
        k = q[:, :, nq * D:(nq + nkv) * D]
        v = q[:, :, (nq + nkv) * D:]
        q = q[:, :, :nq * D]
    Q = _heads(q, B, S, nq, D).astype(work)
    K = _heads(k, B, S, nkv, D).astype(work)
    V = _heads(v, B, S, nkv, D).astype(work)
    if q_norm is not None:  # per-head RMS norm before rotary (q_norm_weight / k_norm_weight)
        eps = float(node.attr("qk_norm_epsilon", 1e-6))
        Q = _head_rms_norm(xp, Q, q_norm, eps, dt)
        K = _head_rms_norm(xp, K, k_norm, eps, dt)

    total = seqlens.astype(xp.int64) + 1  # t_b
    past_len = xp.zeros_like(total) if S == T else total - S  # p_b
    if int(node.attr("do_rotary", 0)):
        pos = past_len.reshape(B, 1) + xp.arange(S, dtype=xp.int64).reshape(1, S)
        pos = xp.clip(pos, 0, cos.shape[0] - 1)
        c = xp.take(cos.astype(work), pos, axis=0).reshape(B, 1, S, -1)
        s_ = xp.take(sin.astype(work), pos, axis=0).reshape(B, 1, S, -1)
        inter = bool(int(node.attr("rotary_interleaved", 0)))
        Q = rotary(xp, Q, c, s_, inter)
        K = rotary(xp, K, c, s_, inter)
        if dt != work:  # ORT stores the rotated Q and K in the input type
            Q = Q.astype(dt).astype(work)
            K = K.astype(dt).astype(work)

    i = past_len.reshape(B, 1, 1, 1) + xp.arange(S, dtype=xp.int64).reshape(1, 1, S, 1)
    scale = float(node.attr("scale", 0.0) or 0.0) or 1.0 / float(np.sqrt(D))
    if sliding:
        keys_k, keys_v, j, valid, present_k, present_v = _window_cache(
            xp, K, V, past_k.astype(work), past_v.astype(work), past_len, total, window)
        allowed = valid & (j < total.reshape(B, 1, 1, 1)) & (j <= i) & (j > i - window)
        out = attention(xp, Q, keys_k, keys_v, allowed, scale=scale, softcap=softcap)
    else:
        present_k = assemble_cache(xp, K, past_k.astype(work) if past_k is not None else None, past_len, L)
        present_v = assemble_cache(xp, V, past_v.astype(work) if past_v is not None else None, past_len, L)
        j = xp.arange(L, dtype=xp.int64).reshape(1, 1, 1, L)
        allowed = j < total.reshape(B, 1, 1, 1)
        if causal:
            allowed = allowed & (j <= i)
            if window > 0:
                allowed = allowed & (j > i - window)
        out = attention(xp, Q, present_k, present_v, allowed, scale=scale, softcap=softcap)
    out = out.transpose(0, 2, 1, 3).reshape(B, S, nq * D)
    specs = node.out_specs
    res = [_cast(out, specs[0].dtype)]
    if len(specs) > 1:
        res.append(_cast(present_k, specs[1].dtype))
    if len(specs) > 2:
        res.append(_cast(present_v, specs[2].dtype))
    return tuple(res)


def _resident(xp, t, capacity: int, window: int):
    """Rows a window-sized cache of ``capacity`` holds after ``t`` positions (int64 [B]): ``t`` up to
    the capacity, then ``t - G * ceil((t - C) / G)`` with ``G = C - W + 1`` (ORT's schema)."""
    g = capacity - window + 1
    over = xp.maximum(t - capacity, 0)
    return xp.where(t <= capacity, t, t - g * ((over + g - 1) // g))


def _window_cache(xp, K, V, past_k, past_v, past_len, total, window: int):
    """A step over a window-sized cache (``sliding_window_cache=1``): the keys the step may read,
    the resident past rows then the S new ones ([B, H, C + S, D]), their absolute positions and
    validity ([B, 1, 1, C + S]), and the present buffers ([B, H, C, D]: rows [0, L(t)) the most
    recent positions in order, zero beyond). Every index comes from device data (no read-back)."""
    B, H, S, D = K.shape
    C = past_k.shape[2]
    held = _resident(xp, past_len, C, window).reshape(B, 1)  # rows [0, held) hold p - held .. p - 1
    p = past_len.reshape(B, 1)
    j = xp.arange(C + S, dtype=xp.int64).reshape(1, C + S)
    key_pos = xp.where(j < C, p - held + j, p + j - C)
    valid = (j >= C) | (j < held)
    keys_k = xp.concatenate((past_k, K), axis=2)
    keys_v = xp.concatenate((past_v, V), axis=2)
    t = total.reshape(B, 1)
    keep = _resident(xp, total, C, window).reshape(B, 1)
    r = xp.arange(C, dtype=xp.int64).reshape(1, C)
    pos = t - keep + r  # the position present row r holds
    src = xp.clip(xp.where(pos >= p, C + pos - p, pos - p + held), 0, C + S - 1)
    idx = xp.broadcast_to(src.reshape(B, 1, C, 1), (B, H, C, D))
    filled = (r < keep).reshape(B, 1, C, 1)
    zero = K.dtype.type(0)
    present_k = xp.where(filled, xp.take_along_axis(keys_k, idx, axis=2), zero)
    present_v = xp.where(filled, xp.take_along_axis(keys_v, idx, axis=2), zero)
    return (keys_k, keys_v, key_pos.reshape(B, 1, 1, C + S), valid.reshape(B, 1, 1, C + S), present_k, present_v)


def _gqa_check(node, specs):
    """seqlens_k (checked into the error latch, as ORT refuses them): in [0, present length), at
    least S - 1 after the first prompt (no negative past), and with rotary then below the cache rows."""
    _B, S, _D, _P, T, L, rd = _gqa_dims(node, specs)
    if int(node.attr("sliding_window_cache", 0)):  # positions are absolute, the buffer holds a window of them
        return [IndexCheck(5, 0 if S == T else S - 1, min(T, specs[7].shape[0]) if rd else T)]
    if S == T:
        return [IndexCheck(5, 0, L)]
    return [IndexCheck(5, S - 1, min(L, specs[7].shape[0]) if rd else L)]


OPS.append(OpKernel("GroupQueryAttention", _gqa_shapes, _gqa_compute, domain=_MS, since=1, host_inputs=(6,),
                    optional=(1, 2, 3, 4),  # key/value empty: packed QKV; past_key/past_value empty: no past
                    index_checks=_gqa_check, workspace=_gqa_workspace, capture="safe"))
