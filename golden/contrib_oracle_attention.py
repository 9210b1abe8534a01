"""The oracle's contrib attention operators (``contrib_oracle`` lists them all): RotaryEmbedding,
GroupQueryAttention (growing, shared-buffer and window-sized caches) and MultiHeadAttention, in
float64 from ONNX Runtime's documented semantics."""

from __future__ import annotations

import math

import numpy as np

from .contrib_oracle_ops import _ContribOp, _f64, _rms

__all__ = ["GroupQueryAttention", "MultiHeadAttention", "RotaryEmbedding"]

# --------------------------------------------------------------------------------------------------
# rotary embedding and attention

def _rotate(x: np.ndarray, cos: np.ndarray, sin: np.ndarray, interleaved: bool) -> np.ndarray:
    """Rotary embedding of ``x`` [..., S, head] with ``cos``/``sin`` [..., S, rot/2] broadcast over
    its leading axes; dims past ``rot`` pass through."""
    half = cos.shape[-1]
    rot = 2 * half
    if rot > x.shape[-1]:
        raise ValueError(f"rotary dims {rot} exceed the head size {x.shape[-1]}")
    out = x.copy()
    if interleaved:
        x1, x2 = x[..., 0:rot:2], x[..., 1:rot:2]
        out[..., 0:rot:2] = x1 * cos - x2 * sin
        out[..., 1:rot:2] = x2 * cos + x1 * sin
    else:
        x1, x2 = x[..., :half], x[..., half:rot]
        out[..., :half] = x1 * cos - x2 * sin
        out[..., half:rot] = x2 * cos + x1 * sin
    return out


def _softmax_rows(scores: np.ndarray, allowed: np.ndarray, sink: np.ndarray | None) -> np.ndarray:
    """Softmax over the last axis of ``scores`` restricted to ``allowed`` (others get 0); ``sink``:
    a per-row logit added to the denominator (smooth softmax: 0; head_sink: its value)."""
    masked = np.where(allowed, scores, -np.inf)
    m = np.max(masked, axis=-1, keepdims=True)
    if sink is not None:
        m = np.maximum(m, sink)
    m = np.where(np.isfinite(m), m, 0.0)
    e = np.where(allowed, np.exp(masked - m), 0.0)
    den = e.sum(axis=-1, keepdims=True)
    if sink is not None:
        den = den + np.exp(sink - m)
    return np.divide(e, den, out=np.zeros_like(e), where=den > 0)


class RotaryEmbedding(_ContribOp):
    """RoPE on input [B, S, hidden] or [B, N, S, H]; position_ids [B, S] or [1] (an offset: the
    position of token s is offset + s); cos/sin caches [max_position, rotary_dim / 2]."""

    ATTRIBUTES = {"interleaved": 0, "is_packed_batching": 0, "num_heads": 0, "rotary_embedding_dim": 0,
                  "scale": 1.0}
    N_INPUTS = 4

    def check(self):
        if self.attrs["is_packed_batching"]:
            self.refuse("is_packed_batching=1 (ragged batches)")
        if self.attrs["rotary_embedding_dim"] and not self.attrs["num_heads"]:
            self.refuse("rotary_embedding_dim without num_heads")

    def compute(self, x, a):
        inp, pos, cos_c, sin_c = x
        X = _f64(inp)
        half = cos_c.shape[-1]
        if X.ndim == 4:
            B, N, S, H = X.shape
            heads = X
        elif X.ndim == 3:
            B, S, hidden = X.shape
            H = hidden // a["num_heads"] if a["num_heads"] else 2 * half
            N = hidden // H
            if N * H != hidden:
                self.fail(f"hidden size {hidden} is not a multiple of the head size {H}")
            heads = X.reshape(B, S, N, H).transpose(0, 2, 1, 3)
        else:
            self.fail(f"input must be 3-D or 4-D, got {X.shape}")
        rot = a["rotary_embedding_dim"] or H
        if rot != 2 * half:
            self.fail(f"rotary dims {rot} but cos_cache has {half} columns (rotary_dim / 2)")
        pos = np.asarray(pos, np.int64)
        positions = (pos.reshape(-1)[0] + np.arange(S))[None, :].repeat(B, 0) if pos.size == 1 else pos.reshape(B, S)
        if positions.min() < 0 or positions.max() >= cos_c.shape[0]:
            self.fail(f"position ids {positions.min()}..{positions.max()} outside the {cos_c.shape[0]} cache rows")
        cos, sin = _f64(cos_c)[positions][:, None], _f64(sin_c)[positions][:, None]  # [B, 1, S, half]
        y = _rotate(heads, cos, sin, bool(a["interleaved"]))
        if X.ndim == 3:
            y = y.transpose(0, 2, 1, 3).reshape(B, S, -1)
        return [y.astype(inp.dtype)]


def _heads(x: np.ndarray, n: int) -> np.ndarray:
    """[B, S, n * H] -> [B, n, S, H]."""
    B, S, d = x.shape
    return x.reshape(B, S, n, d // n).transpose(0, 2, 1, 3)


def _merge(x: np.ndarray) -> np.ndarray:
    """[B, n, S, H] -> [B, S, n * H]."""
    B, n, S, H = x.shape
    return x.transpose(0, 2, 1, 3).reshape(B, S, n * H)


class GroupQueryAttention(_ContribOp):
    """Grouped-query self-attention with a KV cache (see the module docstring for what is covered).

    Per batch entry b: T_b = seqlens_k[b] + 1 keys in all; the step's S tokens sit at positions
    past_b .. T_b - 1, past_b = T_b - S (0 for a first prompt, S == total_sequence_length). The
    present holds the past's first past_b rows and then the new keys, zeros beyond (its length is
    max(total_sequence_length, the past buffer's), so a shared buffer keeps its capacity). A query
    at position p attends keys j <= p (causal), and p - j < local_window_size when that is > 0 (a
    window of that many keys, the query's own included: ONNX Runtime 1.31's CPU kernel; older ones
    attended one more).
    Scores: scale * q.k (scale 0: 1/sqrt(head size)), then softcap * tanh(x / softcap), then
    attention_bias; softmax over the attended keys (with head_sink or smooth_softmax, a sink logit
    in the denominator)."""

    ATTRIBUTES = {"num_heads": None, "kv_num_heads": None, "scale": 0.0, "softcap": 0.0, "local_window_size": -1,
                  "do_rotary": 0, "rotary_interleaved": 0, "smooth_softmax": -1, "causal": 1,
                  "sliding_window_cache": 0, "qk_output": 0, "qk_norm_epsilon": 1e-6, "k_quant_type": "NONE",
                  "v_quant_type": "NONE", "kv_cache_bit_width": 0}
    N_INPUTS = 16

    def check(self):
        a, has = self.attrs, self.has
        if not a["num_heads"] or not a["kv_num_heads"] or a["num_heads"] % a["kv_num_heads"]:
            self.refuse(f"num_heads {a['num_heads']} / kv_num_heads {a['kv_num_heads']} (a positive multiple)")
        if a["k_quant_type"] != "NONE" or a["v_quant_type"] != "NONE" or has[12] or has[13]:
            self.refuse("a quantized KV cache (k_quant_type/v_quant_type, k_scale/v_scale)")
        if a["qk_output"] or (len(self.wants) > 3 and self.wants[3]):
            self.refuse("the output_qk output (qk_output)")
        if has[1] != has[2]:
            self.refuse("key without value (or value without key)")
        if has[3] != has[4]:
            self.refuse("past_key without past_value (or the reverse)")
        if has[14] != has[15]:
            self.refuse("q_norm_weight without k_norm_weight (or the reverse)")
        if a["do_rotary"] and not (has[7] and has[8]):
            self.refuse("do_rotary=1 without cos_cache and sin_cache")
        if not a["causal"] and a["local_window_size"] > 0:
            self.refuse("causal=0 with a local window")
        if a["sliding_window_cache"] and (a["local_window_size"] <= 0 or not has[3]):
            self.refuse("sliding_window_cache=1 without a local window and a past buffer")

    def compute(self, x, a):
        (query, key, value, past_key, past_value, seqlens_k, total_len, cos_c, sin_c, position_ids,
         attention_bias, head_sink, _ks, _vs, q_norm, k_norm) = x[:16]
        nh, nkv = int(a["num_heads"]), int(a["kv_num_heads"])
        Q = _f64(query)
        if Q.ndim != 3:
            self.fail(f"query must be [batch, sequence, hidden], got {Q.shape}")
        B, S, d = Q.shape
        if key is None:  # packed QKV
            hd = d // (nh + 2 * nkv)
            if hd * (nh + 2 * nkv) != d:
                self.fail(f"packed QKV width {d} is not (num_heads + 2 kv_num_heads) x head size")
            q, k, v = (_heads(t, n) for t, n in zip(np.split(Q, [nh * hd, (nh + nkv) * hd], axis=-1), (nh, nkv, nkv)))
        else:
            hd = d // nh
            q, k, v = _heads(Q, nh), _heads(_f64(key), nkv), _heads(_f64(value), nkv)
        if S < 1 or B < 1:
            self.fail(f"an empty query {Q.shape}")
        seqlens = np.asarray(seqlens_k, np.int64).reshape(-1)
        if seqlens.shape != (B,):
            self.fail(f"seqlens_k must be [batch={B}], got {np.shape(seqlens_k)}")
        T_max = int(np.asarray(total_len).reshape(-1)[0])
        first_prompt = S == T_max
        if not first_prompt and S > 1 and B != 1:
            self.fail("sequence_length > 1 with past context needs batch 1")
        totals = seqlens + 1
        pasts = np.zeros(B, np.int64) if first_prompt else totals - S
        if (pasts < 0).any() or (totals > T_max).any() or T_max < 1:
            self.fail(f"seqlens_k {seqlens.tolist()} disagree with total_sequence_length {T_max} and {S} new tokens")

        if q_norm is not None:  # the per-head RMS norm of Q and K, before rotary
            eps = float(a["qk_norm_epsilon"])
            q = q * _rms(q, (-1,), eps) * _f64(q_norm)
            k = k * _rms(k, (-1,), eps) * _f64(k_norm)
        if a["do_rotary"]:
            if position_ids is not None:
                pid = np.asarray(position_ids, np.int64)
                if first_prompt:  # ONNX Runtime reads only the first id then: an offset
                    positions = (pid.reshape(-1)[0] + np.arange(S))[None].repeat(B, 0)
                else:
                    positions = pid.reshape(B, S)
            else:
                positions = pasts[:, None] + np.arange(S)[None, :]
            if positions.min() < 0 or positions.max() >= cos_c.shape[0]:
                self.fail(f"positions {positions.min()}..{positions.max()} outside the {cos_c.shape[0]} rows of "
                          "cos_cache")
            cos, sin = _f64(cos_c)[positions][:, None], _f64(sin_c)[positions][:, None]
            inter = bool(a["rotary_interleaved"])
            q, k = _rotate(q, cos, sin, inter), _rotate(k, cos, sin, inter)

        cache_dtype = past_key.dtype if past_key is not None else query.dtype
        buf = past_key.shape[2] if past_key is not None else 0
        if past_key is not None and (past_key.shape != past_value.shape or past_key.shape[:2] != (B, nkv)
                                     or past_key.shape[3] != hd):
            self.fail(f"past_key {past_key.shape} / past_value {past_value.shape} must be [{B}, {nkv}, length, {hd}]")
        pk = _f64(past_key) if past_key is not None else None
        pv = _f64(past_value) if past_value is not None else None
        sliding = bool(a["sliding_window_cache"])
        W = int(a["local_window_size"])
        if sliding and buf < W:
            self.fail(f"sliding_window_cache: a buffer of {buf} rows under the window of {W}")
        present_len = buf if sliding else max(T_max, buf)
        present_k = np.zeros((B, nkv, present_len, hd))
        present_v = np.zeros((B, nkv, present_len, hd))
        scale = float(a["scale"]) or 1.0 / math.sqrt(hd)
        softcap = float(a["softcap"])
        group = nh // nkv
        use_sink = head_sink is not None or a["smooth_softmax"] == 1
        out = np.zeros((B, nh, S, hd))
        for b in range(B):
            T, P = int(totals[b]), int(pasts[b])
            if sliding:  # rows [0, L(P)) of the past hold positions P - L(P) .. P - 1
                held = _resident(P, buf, W)
                keys_k = np.concatenate([pk[b, :, :held], k[b]], axis=1)
                keys_v = np.concatenate([pv[b, :, :held], v[b]], axis=1)
                key_pos = np.arange(P - held, P + S)
                keep = _resident(P + S, buf, W)
                present_k[b, :, :keep] = keys_k[:, keys_k.shape[1] - keep:]
                present_v[b, :, :keep] = keys_v[:, keys_v.shape[1] - keep:]
            else:
                if P + S > present_len:
                    self.fail(f"{P} past and {S} new positions exceed the present's {present_len}")
                if P and (pk is None or P > buf):
                    self.fail(f"{P} past positions but a past buffer of {buf}")
                if P:
                    present_k[b, :, :P], present_v[b, :, :P] = pk[b, :, :P], pv[b, :, :P]
                present_k[b, :, P:P + S], present_v[b, :, P:P + S] = k[b], v[b]
                keys_k, keys_v = present_k[b, :, :max(T, P + S)], present_v[b, :, :max(T, P + S)]
                key_pos = np.arange(keys_k.shape[1])
            q_pos = P + np.arange(S)
            allowed = key_pos[None, :] < T
            if a["causal"]:
                allowed = allowed & (key_pos[None, :] <= q_pos[:, None])
                if W > 0:
                    allowed = allowed & (q_pos[:, None] - key_pos[None, :] < W)
            kk = np.repeat(keys_k, group, axis=0)  # [nh, L, hd]
            vv = np.repeat(keys_v, group, axis=0)
            scores = scale * np.einsum("nsd,nld->nsl", q[b], kk)
            if softcap > 0:
                scores = softcap * np.tanh(scores / softcap)
            if attention_bias is not None:
                ab = _f64(attention_bias)
                ab = ab[b if ab.shape[0] > 1 else 0]  # [nh or 1, S, T_max]
                cols = np.clip(key_pos, 0, ab.shape[-1] - 1)
                scores = scores + ab[:, :, cols]
            sink = None
            if use_sink:
                sink = (_f64(head_sink).reshape(nh, 1, 1) if head_sink is not None else np.zeros((nh, 1, 1)))
                sink = np.broadcast_to(sink, (nh, S, 1))
            probs = _softmax_rows(scores, np.broadcast_to(allowed, scores.shape), sink)
            out[b] = np.einsum("nsl,nld->nsd", probs, vv)
        return [_merge(out).astype(query.dtype), present_k.astype(cache_dtype), present_v.astype(cache_dtype)]


def _resident(T: int, capacity: int, window: int) -> int:
    """Rows a sliding-window cache of ``capacity`` holds after ``T`` positions (ContribOperators.md,
    GroupQueryAttention's Windowed KV Cache: L(T) = T up to the capacity, then it evicts
    G = C - W + 1 positions at once)."""
    if T <= capacity:
        return T
    g = capacity - window + 1
    return T - g * math.ceil((T - capacity) / g)


class MultiHeadAttention(_ContribOp):
    """Multi-head attention: query [B, S, hidden]; key/value [B, L, hidden] (with an optional bias
    added to q, k, v) or, for cross attention, [B, N, L, H]; past_key/past_value [B, N, P, H]
    concatenated before the new keys (present = the concatenation); key_padding_mask (0: masked)
    [B, T], [B, S, T] or [B] (valid lengths) and ``unidirectional`` add ``mask_filter_value``;
    attention_bias [B or 1, N or 1, S, T] is added; softmax; times V."""

    ATTRIBUTES = {"num_heads": None, "scale": 0.0, "mask_filter_value": -10000.0, "unidirectional": 0}
    N_INPUTS = 10

    def check(self):
        if not self.attrs["num_heads"]:
            self.refuse("num_heads missing")
        if self.has[8]:
            self.refuse("past_sequence_length (a shared past/present buffer)")
        if self.has[9]:
            self.refuse("cache_indirection (beam search)")
        if len(self.wants) > 3 and self.wants[3]:
            self.refuse("the qk output")
        if self.has[1] != self.has[2]:
            self.refuse("packed QKV/KV inputs (key without value)")

    def compute(self, x, a):
        query, key, value, bias, kpm, attention_bias, past_key, past_value = x[:8]
        N = int(a["num_heads"])
        Q = _f64(query)
        if Q.ndim != 3 or key is None or key.ndim not in (3, 4):
            self.refuse(f"query {Q.shape} with key {None if key is None else key.shape} (only separate 3-D q/k/v "
                        "or 4-D BNSH key/value)")
        B, S, hidden = Q.shape
        if bias is not None:
            if key.ndim != 3:
                self.fail("bias with BNSH key/value")
            bq, bk, bv = np.split(_f64(bias), [hidden, hidden + key.shape[-1]])
            Q = Q + bq
        q = _heads(Q, N)
        if key.ndim == 3:
            K, V = _f64(key), _f64(value)
            if bias is not None:
                K, V = K + bk, V + bv
            k, v = _heads(K, N), _heads(V, N)
        else:
            if past_key is not None:
                self.fail("BNSH key/value with a past")
            k, v = _f64(key), _f64(value)
        if past_key is not None:
            k = np.concatenate([_f64(past_key), k], axis=2)
            v = np.concatenate([_f64(past_value), v], axis=2)
        T = k.shape[2]
        P = past_key.shape[2] if past_key is not None else 0
        hd = q.shape[-1]
        scale = float(a["scale"]) or 1.0 / math.sqrt(hd)
        scores = scale * np.einsum("bnsd,bntd->bnst", q, k)
        mfv = float(a["mask_filter_value"])
        if kpm is not None:
            m = np.asarray(kpm)
            if m.ndim == 1 and m.shape == (B,):
                valid = np.arange(T)[None, :] < m[:, None]          # [B, T]
                scores = scores + np.where(valid, 0.0, mfv)[:, None, None, :]
            elif m.ndim == 2 and m.shape == (B, T):
                scores = scores + np.where(m != 0, 0.0, mfv)[:, None, None, :]
            elif m.ndim == 3 and m.shape == (B, S, T):
                scores = scores + np.where(m != 0, 0.0, mfv)[:, None, :, :]
            else:
                self.refuse(f"key_padding_mask of shape {m.shape} (only [B], [B, T], [B, S, T])")
        if a["unidirectional"]:
            future = np.arange(T)[None, :] > (P + np.arange(S))[:, None]
            scores = scores + np.where(future, mfv, 0.0)
        if attention_bias is not None:
            scores = scores + _f64(attention_bias)
        scores = scores - scores.max(axis=-1, keepdims=True)
        e = np.exp(scores)
        probs = e / e.sum(axis=-1, keepdims=True)
        out = np.einsum("bnst,bntd->bnsd", probs, v)
        return [_merge(out).astype(query.dtype), k.astype(query.dtype), v.astype(query.dtype)]
