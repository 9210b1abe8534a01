"""ONNX Runtime's contrib attention ops (domain ``com.microsoft``, version 1) that the exporters write
beside GroupQueryAttention (``ops_contrib``), computed as onnxruntime's CPU provider computes them
(checked against onnxruntime 1.31.1; ``tests/test_contrib_ops_export.py``).

RotaryEmbedding
    GenAI's builder (``-p fp16 -e cpu``) rotates query and key with it before MultiHeadAttention.
    ``input`` is 3-D ``[B, S, hidden]`` or 4-D ``[B, N, S, head_size]``; ``position_ids`` int64 is
    ``[B, S]`` (each token's position) or one element (the first token's position ``p``, token
    ``s`` at ``p + s``); ``cos_cache``/``sin_cache`` are ``[max_position, rotary_dim / 2]`` of the
    input's type.  Without ``rotary_embedding_dim`` the head size is ``2 * cos_cache.shape[1]``
    (and ``num_heads``, when 0, is ``hidden / head_size``); with it, ``num_heads`` is required and
    the head size is ``hidden / num_heads``.  The first ``rotary_dim`` features of each head are
    rotated, half-split (``x[i], x[i + rd/2]``) or ``interleaved`` (``x[2i], x[2i + 1]``); the rest
    pass through.  Computed in float32 (float16 inputs: one rounding at the end).  A position outside
    the cache's rows (ORT: "position_ids value ... is out of range") sets the runtime's error latch
    (``index_checks``: ``DeviceAssert`` naming the node) and is clipped; ``S`` above the cache's
    rows is refused (ORT: "Updating cos_cache and sin_cache ... is not currently supported").
    ``scale`` is accepted and unused, as ORT's CPU kernel reads it and leaves it unused (1.31.1:
    the same bytes with scale 2).  Refused: ``is_packed_batching=1``, a cache whose width is not
    ``rotary_dim / 2``.
MultiHeadAttention
    As the builder's fp16 CPU graphs use it: query ``[B, S, N*D]`` (rotated), key and value the
    whole cache already repeated to ``N`` heads in BNSH (``[B, N, T, D]``, after the graph's own
    Concat with the past), ``attention_bias`` ``[B|1, N|1, S, T]`` (the builder's causal and
    padding mask, as large negative values), ``num_heads``, ``scale``, ``unidirectional=0``.  Also
    ORT's other common CPU cases: key/value 3-D ``[B, L, N*D]`` / ``[B, L, N*Dv]`` with an optional
    packed ``bias`` ``[2*N*D + N*Dv]`` and past_key/past_value ``[B, N, P, D]`` (present = past ++
    new, ``T = P + L``), ``key_padding_mask`` int32 ``[B]`` (key lengths), ``[B, T]`` or
    ``[B, S, T]`` (0 masks), ``unidirectional=1`` (query row ``i`` sees keys ``j <= P + i``, only
    when ``S > 1``, as ORT; refused for a cross attention, ``L != S``, where ORT's CPU provider
    masks by no causal rule).  Scores are ``scale * q.k`` (default ``1/sqrt(D)``) plus the
    bias plus ``mask_filter_value`` (default -10000, not -inf: a fully masked row is a softmax over
    its biased scores, as in ORT) at masked positions; all in float32, float16 inputs rounded once
    at the end (bit-identical to ORT 1.31.1's float16 kernel on the cases tested).  present_key/present_value are the 4-D key/value
    themselves when given so.  Refused: packed QKV (a 5-D query, or no key) and packed KV (5-D key)
    -- ORT's CPU provider has neither -- the inputs past_sequence_length and cache_indirection
    (buffer sharing, beam search), the ``qk`` output, a past with 4-D key/value, a ``bias`` with
    4-D key/value, the ``(3 * B + 2)`` key_padding_mask.
Attention
    The BERT-style fused op (ONNX Runtime's transformer optimizer): ``input`` ``[B, S, H_in]`` times
    ``weights`` ``[H_in, hq + hk + hv]`` plus ``bias`` (``qkv_hidden_sizes``, default three equal
    thirds; ``hq == hk`` as ORT's CPU provider requires), in the input type; heads ``N``; ``past``
    ``[2, B, N, P, D]`` and ``present`` ``[2, B, N, P + S, D]``; ``mask_index`` int32 ``[B]`` (end
    positions: keys ``j >= end`` masked), ``[2B]`` (end then start positions), ``[B, T]`` or
    ``[B, S, T]`` (0 masks); ``attention_bias`` ``[B|1, N|1, S, T]``; ``unidirectional`` (query
    ``i`` sees ``j <= P + i`` when ``S > 1``).  Scores, masks and softmax as MultiHeadAttention's;
    float16 inputs have their projection rounded to float16 (as ORT keeps it: the presents are
    bit-identical), the attention in float32.
    ``bias`` absent is a zero bias (ORT 1.31.1's CPU provider crashes on it: compared with a zero
    bias there).  Refused: ``do_rotary=1`` and the 4-D (Megatron) mask (ORT's CPU provider refuses
    both), ``past_present_share_buffer=1`` and the past_sequence_length input, a present with
    ``hk != hv``.

All three are device-only (masks built from ``xp.arange``, no host reads): capture-safe.
"""

from __future__ import annotations

import numpy as np

from ._contrib_util import additive_attention, rotary, work_dtype
from ._latch import IndexCheck
from ._linalg import matmul
from ._op import OpKernel, Spec

OPS: list[OpKernel] = []

_MS = "com.microsoft"


def _cast(x, dtype):
    return x if x.dtype == dtype else x.astype(dtype)


def _specs(specs, n):
    return list(specs) + [None] * (n - len(specs))


def _flag(node, key, default=0):
    v = int(node.attr(key, default))
    if v not in (0, 1):
        raise node.error(f"attribute {key}={v} must be 0 or 1")
    return v


def _heads(x, B, S, n, D):
    return x.reshape(B, S, n, D).transpose(0, 2, 1, 3)


def _mask_add(xp, allowed, fill, work):
    return xp.where(allowed, work.type(0), work.type(fill))


# -- RotaryEmbedding ---------------------------------------------------------------------------

def _rope_attrs(node):
    nh, rd = int(node.attr("num_heads", 0)), int(node.attr("rotary_embedding_dim", 0))
    if nh < 0 or rd < 0:
        raise node.error(f"num_heads={nh} and rotary_embedding_dim={rd} must be >= 0")
    if rd > 0 and nh == 0:
        raise node.error(f"rotary_embedding_dim={rd} needs num_heads (ORT: num_heads must be provided if "
                         "rotary_embedding_dim is specified)")
    if rd % 2:
        raise node.error(f"rotary_embedding_dim={rd} must be even")
    interleaved = _flag(node, "interleaved")
    if _flag(node, "is_packed_batching"):
        raise node.error("is_packed_batching=1 (ragged batches) is not supported")
    return nh, rd, bool(interleaved)


def _rope_dims(node, specs):
    """(B, S, N, head_size, rotary_dim, positions are one start value, cache rows)."""
    x, pos, cos, sin = specs[:4]
    nh, rd_attr, _ = _rope_attrs(node)
    if x.rank not in (3, 4):
        raise node.error(f"input must be 3-D (batch, sequence, hidden) or 4-D (batch, heads, sequence, head_size), "
                         f"got shape {x.shape}")
    if np.dtype(x.dtype).kind != "f":
        raise node.error(f"input must be a floating-point tensor, got {np.dtype(x.dtype).name}")
    for name, c in (("cos_cache", cos), ("sin_cache", sin)):
        if c.rank != 2 or np.dtype(c.dtype) != np.dtype(x.dtype):
            raise node.error(f"{name} must be 2-D (max_position, rotary_dim / 2) of the input's type "
                             f"{np.dtype(x.dtype).name}, got {np.dtype(c.dtype).name}{list(c.shape)}")
    if tuple(cos.shape) != tuple(sin.shape):
        raise node.error(f"cos_cache shape {cos.shape} and sin_cache shape {sin.shape} differ")
    if np.dtype(pos.dtype) != np.int64:
        raise node.error(f"position_ids must be int64, got {np.dtype(pos.dtype).name}")
    B = x.shape[0]
    S, hidden = (x.shape[2], x.shape[1] * x.shape[3]) if x.rank == 4 else (x.shape[1], x.shape[2])
    half, rows = cos.shape[1], cos.shape[0]
    if rd_attr:
        if hidden % nh:
            raise node.error(f"hidden size {hidden} is not divisible by num_heads={nh}")
        D, rd = hidden // nh, rd_attr
        if rd > D:
            raise node.error(f"rotary_embedding_dim={rd} must be at most head_size={D}")
    else:
        D = rd = 2 * half
        if D == 0 or hidden % D:
            raise node.error(f"hidden size {hidden} is not a multiple of head_size 2 * cos_cache.shape[1] = {D}")
        if nh and nh * D != hidden:
            raise node.error(f"num_heads={nh} times head_size {D} (2 * cos_cache.shape[1]) is not the hidden size {hidden}")
    N = hidden // D
    if x.rank == 4 and (x.shape[1], x.shape[3]) != (N, D):
        raise node.error(f"4-D input {x.shape} must be (batch, {N} heads, sequence, head_size {D})")
    if half != rd // 2:
        raise node.error(f"cos_cache width {half} must be rotary_dim / 2 = {rd // 2}")
    if pos.rank == 2:
        if tuple(pos.shape) != (B, S):
            raise node.error(f"position_ids shape {pos.shape} must be {(B, S)} (batch, sequence) or one element")
        start = False
    elif int(np.prod(pos.shape)) == 1 and pos.rank <= 1:
        start = True
    else:
        raise node.error(f"position_ids shape {pos.shape} must be {(B, S)} (batch, sequence) or one element")
    if S > rows:
        raise node.error(f"sequence length {S} exceeds the {rows} rows of cos_cache (ORT: updating the caches "
                         "is not supported)")
    return B, S, N, D, rd, start, rows


def _rope_shapes(node, specs):
    _rope_dims(node, specs)
    return [Spec(specs[0].shape, specs[0].dtype)]


def _rope_compute(xp, node, x, pos, cos, sin):
    B, S, N, D, rd, start, rows = _rope_dims(node, [Spec(a.shape, a.dtype) for a in (x, pos, cos, sin)])
    work = work_dtype(x.dtype)
    xh = xp.transpose(x, (0, 2, 1, 3)) if x.ndim == 4 else x.reshape(B, S, N, D)  # (B, S, N, D)
    p = pos.astype(xp.int64)
    if start:
        p = p.reshape(1, 1) + xp.arange(S, dtype=xp.int64).reshape(1, S)
    p = xp.clip(p, 0, max(rows - 1, 0))  # out-of-range positions were flagged (index_checks)
    c = xp.take(cos.astype(work), p, axis=0)
    s = xp.take(sin.astype(work), p, axis=0)
    c = c.reshape(c.shape[0], S, 1, rd // 2)
    s = s.reshape(s.shape[0], S, 1, rd // 2)
    y = rotary(xp, xh.astype(work), c, s, bool(int(node.attr("interleaved", 0)))).astype(x.dtype)
    return (xp.transpose(y, (0, 2, 1, 3)) if x.ndim == 4 else y.reshape(x.shape),)


def _rope_check(node, specs):
    """Each token's position addresses a row of the caches (one start value: start + S - 1 does)."""
    _B, S, _N, _D, _rd, start, rows = _rope_dims(node, specs)
    return [IndexCheck(1, 0, rows - S + 1 if start else rows)]


OPS.append(OpKernel("RotaryEmbedding", _rope_shapes, _rope_compute, domain=_MS, since=1, index_checks=_rope_check,
                    check=lambda node: _rope_attrs(node), capture="safe"))


# -- shared: attention attributes and masks ----------------------------------------------------

def _attn_attrs(node):
    nh = node.attr("num_heads")
    if nh is None:
        raise node.error("attribute num_heads is required")
    nh = int(nh)
    if nh <= 0:
        raise node.error(f"num_heads={nh} must be positive")
    uni = _flag(node, "unidirectional")
    fill = float(node.attr("mask_filter_value", -10000.0))
    if not np.isfinite(fill):
        raise node.error(f"mask_filter_value={fill} must be finite")
    scale = float(node.attr("scale", 0.0) or 0.0)
    return nh, uni, fill, scale


def _check_bias(node, ab, B, N, S, T, dt):
    if ab is None:
        return
    if (ab.rank != 4 or ab.shape[0] not in (1, B) or ab.shape[1] not in (1, N) or tuple(ab.shape[2:]) != (S, T)
            or np.dtype(ab.dtype) != np.dtype(dt)):
        raise node.error(f"attention_bias must be {np.dtype(dt).name} [{B} or 1, {N} or 1, {S}, {T}], "
                         f"got {np.dtype(ab.dtype).name}{list(ab.shape)}")


def _same_type(node, dt, **named):
    for name, s in named.items():
        if s is not None and np.dtype(s.dtype) != np.dtype(dt):
            raise node.error(f"{name} must have the query's type {np.dtype(dt).name}, got {np.dtype(s.dtype).name}")


def _additive(xp, node, allowed, ab, work):
    """mask_filter_value where ``allowed`` is False (None: nothing masked), plus the attention bias."""
    add = None if allowed is None else _mask_add(xp, allowed, float(node.attr("mask_filter_value", -10000.0)), work)
    if ab is not None:
        add = ab.astype(work) if add is None else ab.astype(work) + add
    return add


def _causal(xp, S, T, offset):
    i = xp.arange(S, dtype=xp.int64).reshape(S, 1)
    j = xp.arange(T, dtype=xp.int64).reshape(1, T)
    return (j <= i + offset).reshape(1, 1, S, T)


def _attn_workspace(B, N, S, T, D, Dv):
    """float32 scores with their softmax passes, and the (possibly concatenated) keys and values."""
    return (4 * B * N * S * T + 2 * B * N * T * (D + Dv)) * 4


# -- MultiHeadAttention ------------------------------------------------------------------------

_MHA_UNSUPPORTED_INPUTS = {8: "past_sequence_length", 9: "cache_indirection"}


def _mha_dims(node, specs):
    """(B, S, L, P, T, D, Dv, key/value are 4-D BNSH)."""
    specs = _specs(specs, 10)
    nh = _attn_attrs(node)[0]
    for i, name in _MHA_UNSUPPORTED_INPUTS.items():
        if specs[i] is not None:
            raise node.error(f"input {name} is not supported (past/present buffer sharing, beam search)")
    if node.n_outputs > 3:
        raise node.error("output qk is not supported")
    q, k, v, bias, kpm, ab, pk, pv = specs[:8]
    if q.rank != 3:
        raise node.error(f"query must be 3-D [batch, sequence, hidden], got shape {q.shape} (packed QKV of rank 5 "
                         "is not supported, as on ORT's CPU provider)")
    if k is None or v is None:
        raise node.error("key and value are required (packed QKV in query is not supported, as on ORT's CPU provider)")
    dt = q.dtype
    if np.dtype(dt).kind != "f":
        raise node.error(f"query must be a floating-point tensor, got {np.dtype(dt).name}")
    _same_type(node, dt, key=k, value=v, bias=bias, past_key=pk, past_value=pv)
    B, S, H = q.shape
    if H % nh:
        raise node.error(f"query hidden size {H} is not divisible by num_heads={nh}")
    D = H // nh
    if k.rank == 3:
        L = k.shape[1]
        if tuple(k.shape) != (B, L, H):
            raise node.error(f"key shape {k.shape} must be [{B}, kv_sequence, {H}]")
        if v.rank != 3 or tuple(v.shape[:2]) != (B, L) or v.shape[2] % nh:
            raise node.error(f"value shape {v.shape} must be [{B}, {L}, num_heads * v_head_size] like key {k.shape}")
        Dv, kv4 = v.shape[2] // nh, False
    elif k.rank == 4:
        L = k.shape[2]
        if tuple(k.shape) != (B, nh, L, D):
            raise node.error(f"4-D key shape {k.shape} must be [{B}, {nh}, kv_sequence, {D}] (BNSH)")
        if v.rank != 4 or tuple(v.shape[:3]) != (B, nh, L):
            raise node.error(f"4-D value shape {v.shape} must be [{B}, {nh}, {L}, v_head_size] like key {k.shape}")
        Dv, kv4 = v.shape[3], True
        if bias is not None:
            raise node.error("bias with 4-D (BNSH) key and value is not supported")
        if pk is not None or pv is not None:
            raise node.error("past_key/past_value with 4-D (BNSH) key and value are not supported")
    else:
        raise node.error(f"key must be 3-D [batch, kv_sequence, hidden] or 4-D BNSH, got shape {k.shape} "
                         "(packed KV of rank 5 is not supported, as on ORT's CPU provider)")
    if bias is not None and tuple(bias.shape) != (2 * H + nh * Dv,):
        raise node.error(f"bias must have shape ({2 * H + nh * Dv},) (query, key and value hidden sizes), got {bias.shape}")
    if (pk is None) != (pv is None):
        raise node.error("past_key and past_value must both be present or both absent")
    P = 0
    if pk is not None:
        P = pk.shape[2] if pk.rank == 4 else -1
        if pk.rank != 4 or tuple(pk.shape) != (B, nh, P, D):
            raise node.error(f"past_key shape {pk.shape} must be [{B}, {nh}, past, {D}] (BNSH)")
        if tuple(pv.shape) != (B, nh, P, Dv):
            raise node.error(f"past_value shape {pv.shape} must be [{B}, {nh}, {P}, {Dv}] (BNSH)")
    T = P + L
    if kpm is not None:
        if np.dtype(kpm.dtype) != np.int32 or tuple(kpm.shape) not in ((B,), (B, T), (B, S, T)):
            raise node.error(f"key_padding_mask must be int32 [{B}] (key lengths), [{B}, {T}] or [{B}, {S}, {T}], "
                             f"got {np.dtype(kpm.dtype).name}{list(kpm.shape)}")
    if T == 0 and B * S:
        raise node.error(f"no keys to attend to: key sequence length {L} and past length {P}")
    if int(node.attr("unidirectional", 0)) and S > 1 and L != S:
        # (ORT 1.31.1's CPU provider masks such a cross attention by no causal rule: none of j <= i + c matches it)
        raise node.error(f"unidirectional=1 with {L} new keys for {S} query tokens is not supported (only "
                         "self-attention: as many keys as queries, after the past)")
    _check_bias(node, ab, B, nh, S, T, dt)
    return B, S, L, P, T, D, Dv, kv4


def _mha_shapes(node, specs):
    B, S, _L, _P, T, D, Dv, _kv4 = _mha_dims(node, specs)
    nh, dt = int(node.attr("num_heads")), specs[0].dtype
    outs = [Spec((B, S, nh * Dv), dt), Spec((B, nh, T, D), dt), Spec((B, nh, T, Dv), dt)]
    return outs[:max(node.n_outputs, 1)]


def _mha_workspace(node, specs):
    B, S, _L, _P, T, D, Dv, _kv4 = _mha_dims(node, specs)
    return _attn_workspace(B, int(node.attr("num_heads")), S, T, D, Dv)


def _mha_compute(xp, node, q, k=None, v=None, bias=None, kpm=None, ab=None, past_k=None, past_v=None, *unused):
    nh, uni, _fill, scale = _attn_attrs(node)
    B, S, L, _P, T, D, Dv, kv4 = _mha_dims(node, [None if a is None else Spec(a.shape, a.dtype)
                                                  for a in (q, k, v, bias, kpm, ab, past_k, past_v)])
    dt = np.dtype(q.dtype)
    work = work_dtype(dt)
    H = nh * D
    qf, kf, vf = q.astype(work), k.astype(work), v.astype(work)
    if bias is not None:
        b = bias.astype(work)
        qf, kf, vf = qf + b[:H], kf + b[H:2 * H], vf + b[2 * H:]
    Q = _heads(qf, B, S, nh, D)
    if kv4:
        K, V = kf, vf
    else:
        K, V = _heads(kf, B, L, nh, D), _heads(vf, B, L, nh, Dv)
        if past_k is not None:
            K = xp.concatenate((past_k.astype(work), K), axis=2)
            V = xp.concatenate((past_v.astype(work), V), axis=2)
    allowed = None
    if kpm is not None:
        if kpm.ndim == 1:  # key lengths (right padding)
            allowed = xp.arange(T, dtype=xp.int64).reshape(1, 1, 1, T) < kpm.astype(xp.int64).reshape(B, 1, 1, 1)
        else:
            allowed = (kpm != 0).reshape(B, 1, S if kpm.ndim == 3 else 1, T)
    if uni and S > 1:
        c = _causal(xp, S, T, T - S)  # (T - S is the past length: L == S)
        allowed = c if allowed is None else allowed & c
    add = _additive(xp, node, allowed, ab, work)
    out = additive_attention(xp, Q, K, V, add, scale=scale or 1.0 / float(np.sqrt(D)))
    out = out.transpose(0, 2, 1, 3).reshape(B, S, nh * Dv)
    res = [_cast(out, dt)]
    if node.n_outputs > 1:
        res.append(_cast(K, dt))
    if node.n_outputs > 2:
        res.append(_cast(V, dt))
    return tuple(res)


OPS.append(OpKernel("MultiHeadAttention", _mha_shapes, _mha_compute, domain=_MS, since=1,
                    check=lambda node: _attn_attrs(node), workspace=_mha_workspace, capture="safe"))


# -- Attention (BERT-style: the QKV projection fused in) -----------------------------------------

def _bert_attrs(node):
    nh, uni, fill, scale = _attn_attrs(node)
    if int(node.attr("do_rotary", 0)):
        raise node.error("do_rotary=1 is not supported (ORT's CPU provider refuses it too: MultiHeadAttention "
                         "after RotaryEmbedding is the CPU spelling)")
    if int(node.attr("past_present_share_buffer", 0)):
        raise node.error("past_present_share_buffer=1 is not supported")
    sizes = node.attr("qkv_hidden_sizes")
    if sizes is not None and len(sizes) > 0:
        sizes = [int(s) for s in sizes]
        if len(sizes) != 3 or min(sizes) <= 0:
            raise node.error(f"qkv_hidden_sizes={sizes} must be three positive sizes")
        if sizes[0] != sizes[1]:
            raise node.error(f"qkv_hidden_sizes={sizes}: the query and key sizes must be equal (as ORT's CPU provider "
                             "requires)")
        for s in sizes:
            if s % nh:
                raise node.error(f"qkv_hidden_sizes={sizes} must each be divisible by num_heads={nh}")
    else:
        sizes = None
    return nh, uni, fill, scale, sizes


def _bert_dims(node, specs):
    """(B, S, P, T, hq, hk, hv): the projection's sizes, the past and total lengths."""
    specs = _specs(specs, 7)
    nh, _uni, _fill, _scale, sizes = _bert_attrs(node)
    x, w, b, mask, past, ab, psl = specs
    if psl is not None:
        raise node.error("input past_sequence_length is not supported (past/present buffer sharing)")
    if x.rank != 3:
        raise node.error(f"input must be 3-D [batch, sequence, input_hidden], got shape {x.shape}")
    dt = x.dtype
    if np.dtype(dt).kind != "f":
        raise node.error(f"input must be a floating-point tensor, got {np.dtype(dt).name}")
    _same_type(node, dt, weights=w, bias=b, past=past)
    B, S, Hin = x.shape
    if w.rank != 2 or w.shape[0] != Hin:
        raise node.error(f"weights must be 2-D [{Hin}, q + k + v hidden], got shape {w.shape}")
    if sizes is None:
        if w.shape[1] % 3 or (w.shape[1] // 3) % nh:
            raise node.error(f"weights width {w.shape[1]} must be 3 equal hidden sizes divisible by num_heads={nh} "
                             "(or give qkv_hidden_sizes)")
        sizes = [w.shape[1] // 3] * 3
    elif sum(sizes) != w.shape[1]:
        raise node.error(f"qkv_hidden_sizes={sizes} must sum to the weights width {w.shape[1]}")
    hq, hk, hv = sizes
    if b is not None and tuple(b.shape) != (hq + hk + hv,):
        raise node.error(f"bias must have shape ({hq + hk + hv},), got {b.shape}")
    D, Dv = hq // nh, hv // nh
    P = 0
    if past is not None:
        if D != Dv:
            raise node.error(f"past needs equal key and value head sizes, got {D} and {Dv} (qkv_hidden_sizes={sizes})")
        if past.rank != 5 or tuple(past.shape[:3]) != (2, B, nh) or past.shape[4] != D:
            raise node.error(f"past shape {past.shape} must be [2, {B}, {nh}, past, {D}]")
        P = past.shape[3]
    if node.n_outputs > 1 and D != Dv:
        raise node.error(f"output present needs equal key and value head sizes, got {D} and {Dv}")
    T = P + S
    if T == 0 and B:
        raise node.error("no keys to attend to: sequence length 0 and no past")
    if mask is not None:
        if mask.rank == 4:
            raise node.error(f"a 4-D mask_index {mask.shape} (Megatron) is not supported (ORT's CPU provider refuses it too)")
        if np.dtype(mask.dtype) != np.int32 or tuple(mask.shape) not in ((B,), (2 * B,), (B, T), (B, S, T)):
            raise node.error(f"mask_index must be int32 [{B}] (end positions), [{2 * B}] (end, start), [{B}, {T}] or "
                             f"[{B}, {S}, {T}], got {np.dtype(mask.dtype).name}{list(mask.shape)}")
    _check_bias(node, ab, B, nh, S, T, dt)
    return B, S, P, T, hq, hk, hv


def _bert_shapes(node, specs):
    B, S, _P, T, hq, _hk, hv = _bert_dims(node, specs)
    nh, dt = int(node.attr("num_heads")), specs[0].dtype
    outs = [Spec((B, S, hv), dt), Spec((2, B, nh, T, hq // nh), dt)]
    return outs[:max(node.n_outputs, 1)]


def _bert_workspace(node, specs):
    B, S, _P, T, hq, hk, hv = _bert_dims(node, specs)
    nh = int(node.attr("num_heads"))
    return _attn_workspace(B, nh, S, T, hq // nh, hv // nh) + B * S * (hq + hk + hv) * 4


def _bert_compute(xp, node, x, w, b=None, mask=None, past=None, ab=None, psl=None):
    nh, uni, _fill, scale, _sizes = _bert_attrs(node)
    B, S, P, T, hq, hk, hv = _bert_dims(node, [None if a is None else Spec(a.shape, a.dtype)
                                               for a in (x, w, b, mask, past, ab)])
    dt = np.dtype(x.dtype)
    work = work_dtype(dt)
    D, Dv = hq // nh, hv // nh
    qkv = matmul(xp, x.astype(work).reshape(B * S, x.shape[2]), w.astype(work))
    if b is not None:
        qkv = qkv + b.astype(work)
    if dt != work:  # ORT keeps the projection in the input type
        qkv = qkv.astype(dt).astype(work)
    qkv = qkv.reshape(B, S, hq + hk + hv)
    Q = _heads(qkv[:, :, :hq], B, S, nh, D)
    K = _heads(qkv[:, :, hq:hq + hk], B, S, nh, D)
    V = _heads(qkv[:, :, hq + hk:], B, S, nh, Dv)
    if past is not None:
        K = xp.concatenate((past[0].astype(work), K), axis=2)
        V = xp.concatenate((past[1].astype(work), V), axis=2)
    allowed = None
    if mask is not None:
        j = xp.arange(T, dtype=xp.int64).reshape(1, T)
        if mask.ndim == 1:  # end positions (right padding), then start positions (left padding)
            m = mask.astype(xp.int64)
            allowed = j < m[:B].reshape(B, 1)
            if mask.shape[0] == 2 * B:
                allowed = allowed & (j >= xp.minimum(m[B:], T).reshape(B, 1))
            allowed = allowed.reshape(B, 1, 1, T)
        else:
            allowed = (mask != 0).reshape(B, 1, S if mask.ndim == 3 else 1, T)
    if uni and S > 1:
        c = _causal(xp, S, T, P)
        allowed = c if allowed is None else allowed & c
    add = _additive(xp, node, allowed, ab, work)
    out = additive_attention(xp, Q, K, V, add, scale=scale or 1.0 / float(np.sqrt(D)))
    res = [_cast(out.transpose(0, 2, 1, 3).reshape(B, S, hv), dt)]
    if node.n_outputs > 1:
        res.append(_cast(xp.stack((K, V)), dt))
    return tuple(res)


OPS.append(OpKernel("Attention", _bert_shapes, _bert_compute, domain=_MS, since=1,
                    check=lambda node: _bert_attrs(node), workspace=_bert_workspace, capture="safe"))
