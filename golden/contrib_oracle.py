"""ONNX Runtime's contrib operators for the oracle: float64 numpy implementations for onnx's
``ReferenceEvaluator`` (``new_ops=CONTRIB_OPS``), so that an fp32 export with contrib ops is its own
oracle and ``--twin`` is needed only for quantized or fp16 models.

Written from ONNX Runtime's documented semantics (``docs/ContribOperators.md``) and checked against
its CPU kernels (``tests/test_contrib_oracle.py``: same function on small random inputs); nothing
here imports or shares code with lockstep's kernels (``kernels/``), which these ops judge.

Every op computes in float64 and returns each output in the type ONNX Runtime's schema declares
for it (the input's float type; ``inv_std_var`` and ``mean`` in float32). The ops real exporters
write, with what is covered:

- ``GroupQueryAttention`` (ONNX Runtime GenAI's builder): separate or packed QKV, past/present in
  BNSH with ``seqlens_k`` / ``total_sequence_length`` (a growing cache, or a shared past/present
  buffer of fixed capacity whose rows past the filled length are zero in the present), rotary
  (``do_rotary``, cos/sin caches, interleaved or not, partial rotary dims, ``position_ids``),
  ``scale``, ``softcap``, ``local_window_size``, ``causal=0``, ``attention_bias``, ``head_sink`` and
  ``smooth_softmax``, ``q_norm_weight``/``k_norm_weight`` (the per-head RMS norm before rotary),
  ``sliding_window_cache`` (a window-sized buffer that evicts as the documentation specifies);
- ``SkipSimplifiedLayerNormalization`` (all four outputs) and ``SimplifiedLayerNormalization``
  (registered by ONNX Runtime in the default domain, where the builder and Optimum's O2 write it;
  each is accepted in both domains here);
- ``QuickGelu`` (Optimum's O2: ``x * sigmoid(alpha * x)``);
- ``RotaryEmbedding``, ``MultiHeadAttention`` (the builder's fp16 CPU graphs), ``MatMulNBits`` and
  ``GatherBlockQuantized`` (its int4 graphs): the dequantized weights in float64, whatever
  ``accuracy_level`` lets ONNX Runtime approximate.

A mode an op does not implement (a quantized KV cache, a QK output, packed batching, ...) is refused
when the evaluator is built, as is a node of an op nobody implements (``check_supported``): one line,
``OracleUnsupported``, naming the op and the node.

How the default domain is handled: ``ReferenceEvaluator`` looks a node up in ``new_ops`` by
``(op_domain, class name)`` before onnx's own operator set, so a class ``SimplifiedLayerNormalization``
with ``op_domain = ""`` runs the builder's default-domain node although onnx 1.23 has no such
operator at opset 22 (no schema needed, nothing rewritten in the model). Every class here sets
``op_schema = None``: ``OpRun`` would otherwise take the attribute defaults of an onnx operator of
the same name (onnx has default-domain ``RotaryEmbedding`` and ``Attention`` since opset 23).
"""

from __future__ import annotations

import math

import numpy as np
import onnx
from onnx.reference.op_run import OpRun

__all__ = ["CONTRIB_OPS", "OracleUnsupported", "check_supported", "contrib_ops"]

F64 = np.float64


class OracleUnsupported(NotImplementedError):
    """The oracle cannot run a node: no implementation of its op, or of the mode it asks for. The
    message is one line naming the op and the node."""


def _node_name(node: onnx.NodeProto) -> str:
    return f"{node.domain or 'ai.onnx'}::{node.op_type} node {node.name or '(unnamed)'!r}"


def _f64(x) -> np.ndarray:
    return np.asarray(x, dtype=F64)


class _ContribOp(OpRun):
    """Base of the contrib ops: optional inputs by name (an empty name is absent), outputs named ""
    are not computed, and each op checks at load that it implements what the node asks."""

    op_domain = "com.microsoft"
    op_schema = None                 # never the schema of an onnx op of the same name
    ATTRIBUTES: dict[str, object] = {}  # name -> default (ONNX Runtime's)
    N_INPUTS = 1

    def __init__(self, onnx_node, run_params, schema=None):
        super().__init__(onnx_node, run_params, schema)
        unknown = sorted({a.name for a in onnx_node.attribute} - set(self.ATTRIBUTES))
        if unknown:
            self.refuse(f"attribute(s) {unknown} (known: {sorted(self.ATTRIBUTES)})")
        self.attrs = dict(self.ATTRIBUTES)
        for a in onnx_node.attribute:
            v = onnx.helper.get_attribute_value(a)
            self.attrs[a.name] = v.decode() if isinstance(v, bytes) else v
        self.has = [bool(n) for n in onnx_node.input] + [False] * max(0, self.N_INPUTS - len(onnx_node.input))
        self.wants = [bool(n) for n in onnx_node.output]
        self.check()

    # -- what a subclass writes ------------------------------------------------------------------
    def check(self) -> None:
        """Refuse (``self.refuse``) what the node asks that this op does not implement."""

    def compute(self, x: list, a: dict) -> list:
        """The outputs (a list, None where not wanted) from the inputs ``x`` (None where absent)."""
        raise NotImplementedError

    # -- machinery -------------------------------------------------------------------------------
    def refuse(self, what: str):
        raise OracleUnsupported(f"the oracle has no implementation of {_node_name(self.onnx_node)}: {what}")

    def fail(self, what: str):
        raise ValueError(f"{_node_name(self.onnx_node)}: {what}")

    def _run(self, *args, **_attrs):
        x = [a if i < len(self.has) and self.has[i] else None for i, a in enumerate(args)]
        x += [None] * (max(self.N_INPUTS, len(self.has)) - len(x))
        outs = list(self.compute(x, self.attrs))
        outs += [None] * (len(self.wants) - len(outs))
        return tuple(o if w else None for o, w in zip(outs, self.wants))

    def _check_and_fix_outputs(self, res):
        # an output named "" is None: ReferenceEvaluator stores it under "", the name every absent
        # optional input reads, which must stay None
        kept = super()._check_and_fix_outputs(tuple(r for r, w in zip(res, self.wants) if w))
        it = iter(kept)
        return tuple(next(it) if w else None for w in self.wants)


# --------------------------------------------------------------------------------------------------
# normalization and activations

def _rms(x: np.ndarray, axes: tuple[int, ...], eps: float) -> np.ndarray:
    """1 / sqrt(mean(x^2) + eps) over ``axes``, keeping them."""
    return 1.0 / np.sqrt(np.mean(x * x, axis=axes, keepdims=True) + eps)


class SimplifiedLayerNormalization(_ContribOp):
    """Y = X / sqrt(mean(X^2 over axes [axis, rank)) + epsilon) * scale; inv_std_var is the factor."""

    op_domain = ""
    ATTRIBUTES = {"axis": -1, "epsilon": 1e-5, "stash_type": 1}
    N_INPUTS = 2

    def check(self):
        if self.attrs["stash_type"] not in (1, 11):
            self.refuse(f"stash_type {self.attrs['stash_type']} (1: float, 11: double)")

    def compute(self, x, a):
        X, scale = x[0], x[1]
        rank = X.ndim
        axis = a["axis"] + rank if a["axis"] < 0 else a["axis"]
        if not 0 <= axis < rank:
            self.fail(f"axis {a['axis']} out of range for rank {rank}")
        inv = _rms(_f64(X), tuple(range(axis, rank)), float(a["epsilon"]))
        y = _f64(X) * inv * _f64(scale)
        u = np.float64 if a["stash_type"] == 11 else np.float32
        return [y.astype(scale.dtype), inv.astype(u)]


class SkipSimplifiedLayerNormalization(_ContribOp):
    """s = input + skip (+ bias); output = s / sqrt(mean(s^2) + epsilon) * gamma over the last axis;
    mean (zeros: RMS normalization subtracts none), inv_std_var, input_skip_bias_sum = s."""

    ATTRIBUTES = {"epsilon": 1e-12}
    N_INPUTS = 4

    def compute(self, x, a):
        inp, skip, gamma, bias = x
        if inp.ndim not in (2, 3):
            self.fail(f"input must be 2-D or 3-D, got {inp.shape}")
        hidden = inp.shape[-1]
        if gamma.shape != (hidden,) or (bias is not None and bias.shape != (hidden,)):
            self.fail(f"gamma {gamma.shape} / bias {None if bias is None else bias.shape} must be ({hidden},)")
        if skip.shape != inp.shape and not (skip.ndim in (2, 3) and skip.shape[-2:] == inp.shape[-2:]
                                            and (skip.ndim == 2 or skip.shape[0] == 1)):
            self.fail(f"skip {skip.shape} must be input's shape {inp.shape}, (1, S, H) or (S, H)")
        s = _f64(inp) + _f64(skip)
        if bias is not None:
            s = s + _f64(bias)
        inv = _rms(s, (-1,), float(a["epsilon"]))
        y = s * inv * _f64(gamma)
        return [y.astype(inp.dtype), np.zeros(inv.shape, np.float32), inv.astype(np.float32), s.astype(inp.dtype)]


class QuickGelu(_ContribOp):
    """Y = X * sigmoid(alpha * X)."""

    ATTRIBUTES = {"alpha": 1.702}

    def compute(self, x, a):
        X = _f64(x[0])
        with np.errstate(over="ignore"):
            y = X / (1.0 + np.exp(-float(a["alpha"]) * X))
        return [y.astype(x[0].dtype)]


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


# --------------------------------------------------------------------------------------------------
# block-quantized weights

def _unpack(q: np.ndarray, bits: int) -> np.ndarray:
    """uint8 bytes -> their ``8 / bits`` values each along the last axis, low-order bits first."""
    per = 8 // bits
    mask = (1 << bits) - 1
    q = np.asarray(q, np.uint8)
    vals = [(q >> (bits * i)) & mask for i in range(per)]
    return np.stack(vals, axis=-1).reshape(*q.shape[:-1], q.shape[-1] * per).astype(np.int64)


class MatMulNBits(_ContribOp):
    """Y = A @ dequant(B)^T + bias: B [N, k_blocks, blob] holds each row's K values, ``bits`` wide,
    packed low bits first; w = (q - zero_point) * scale per block of ``block_size`` along K
    (zero point 2^(bits-1) when absent; packed uint8 or float). The oracle computes the dequantized
    product exactly (float64): ``accuracy_level`` (how far ONNX Runtime may quantize A) is ignored."""

    ATTRIBUTES = {"K": None, "N": None, "bits": 4, "block_size": None, "accuracy_level": 0, "weight_prepacked": 0}
    N_INPUTS = 6

    def check(self):
        a = self.attrs
        if a["bits"] not in (2, 4, 8):
            self.refuse(f"bits={a['bits']} (2, 4, 8)")
        if not a["K"] or not a["N"] or not a["block_size"]:
            self.refuse("K, N and block_size are required")
        if a["weight_prepacked"]:
            self.refuse("weight_prepacked (an execution provider's layout)")
        if self.has[4]:
            self.refuse("g_idx (deprecated)")

    def weight(self, B, scales, zp) -> np.ndarray:
        a = self.attrs
        K, N, bits, bs = int(a["K"]), int(a["N"]), int(a["bits"]), int(a["block_size"])
        nb = -(-K // bs)
        if B.shape != (N, nb, bs * bits // 8):
            self.fail(f"B {B.shape} must be [{N}, {nb}, {bs * bits // 8}]")
        q = _unpack(B, bits).reshape(N, nb, bs)
        s = _f64(scales).reshape(N, nb)
        if zp is None:
            z = np.full((N, nb), float(1 << (bits - 1)))
        elif zp.dtype == np.uint8:
            z = _unpack(zp.reshape(N, -1), bits)[:, :nb].astype(F64)
        else:
            z = _f64(zp).reshape(N, nb)
        w = (q - z[:, :, None]) * s[:, :, None]
        return w.reshape(N, nb * bs)[:, :K]

    def compute(self, x, a):
        A, B, scales, zp, _g, bias = x[:6]
        w = self.weight(B, scales, zp)
        if A.shape[-1] != w.shape[1]:
            self.fail(f"A's last axis {A.shape[-1]} is not K={w.shape[1]}")
        y = _f64(A) @ w.T
        if bias is not None:
            y = y + _f64(bias)
        return [y.astype(A.dtype)]


class GatherBlockQuantized(_ContribOp):
    """Gather of a block-quantized table: uint8 data (``bits`` < 8 packed along the last axis, low bits
    first; gather axis 0) or int4/uint4; w = (q - zero_point) * scale per block of ``block_size``
    along ``quantize_axis`` (zero point: 2^(bits-1) for uint8, 0 for int4/uint4); indices out of
    range give zero rows."""

    ATTRIBUTES = {"bits": 4, "block_size": 128, "gather_axis": 0, "quantize_axis": 1}
    N_INPUTS = 4

    def check(self):
        if self.attrs["bits"] not in (2, 4, 8):
            self.refuse(f"bits={self.attrs['bits']} (2, 4, 8)")

    def table(self, data, scales, zp) -> tuple[np.ndarray, int]:
        a = self.attrs
        bits, bs = int(a["bits"]), int(a["block_size"])
        rank = data.ndim
        qa = a["quantize_axis"] + rank if a["quantize_axis"] < 0 else a["quantize_axis"]
        ga = a["gather_axis"] + rank if a["gather_axis"] < 0 else a["gather_axis"]
        name = str(data.dtype)
        if data.dtype == np.uint8:
            if ga != 0 or qa != rank - 1:
                self.refuse(f"uint8 data with gather_axis {ga} / quantize_axis {qa} (0 / the last axis)")
            q = _unpack(data, bits) if bits < 8 else data.astype(np.int64)
            default_zp = 1 << (bits - 1)
            z = None if zp is None else (_unpack(zp, bits) if bits < 8 else zp.astype(np.int64))
        elif name in ("int4", "uint4"):
            q = data.astype(np.int64)
            default_zp = 0
            z = None if zp is None else zp.astype(np.int64)
        else:
            self.refuse(f"data of type {name} (uint8, int4, uint4)")
        nb = scales.shape[qa]
        if -(-q.shape[qa] // bs) != nb:
            self.fail(f"scales {scales.shape} do not have ceil({q.shape[qa]} / {bs}) blocks on axis {qa}")
        zz = np.full(scales.shape, float(default_zp)) if z is None else \
            np.take(z, np.arange(nb), axis=qa).astype(F64)
        expand = lambda t: np.take(np.repeat(t, bs, axis=qa), np.arange(q.shape[qa]), axis=qa)  # noqa: E731
        return (q - expand(zz)) * expand(_f64(scales)), ga

    def compute(self, x, a):
        data, indices, scales, zp = x[:4]
        w, ga = self.table(data, scales, zp)
        n = w.shape[ga]
        idx = np.asarray(indices, np.int64)
        idx = np.where(idx < 0, idx + n, idx)
        inside = (idx >= 0) & (idx < n)
        out = np.take(w, np.where(inside, idx, 0), axis=ga)
        shape = [1] * ga + list(idx.shape) + [1] * (w.ndim - ga - 1)
        out = np.where(inside.reshape(shape), out, 0.0)
        return [out.astype(scales.dtype)]


# --------------------------------------------------------------------------------------------------
# the registry

def _in_domain(cls: type, domain: str) -> type:
    return type(cls.__name__, (cls,), {"op_domain": domain, "__doc__": cls.__doc__})


_MS = [GroupQueryAttention, SkipSimplifiedLayerNormalization, QuickGelu, RotaryEmbedding, MultiHeadAttention,
       MatMulNBits, GatherBlockQuantized]
# ONNX Runtime registers SimplifiedLayerNormalization in the default domain (where GenAI's builder and
# Optimum's O2 write it) and SkipSimplifiedLayerNormalization in com.microsoft; each is accepted in both.
CONTRIB_OPS: list[type[OpRun]] = [*_MS, SimplifiedLayerNormalization,
                                  _in_domain(SimplifiedLayerNormalization, "com.microsoft"),
                                  _in_domain(SkipSimplifiedLayerNormalization, "")]


def contrib_ops() -> dict[tuple[str, str], type[OpRun]]:
    """(domain, op type) -> implementation, for every op the oracle adds to onnx's."""
    return {(c.op_domain, c.__name__): c for c in CONTRIB_OPS}


_OTHER_DOMAINS = ("ai.onnx.ml", "ai.onnx.preview.training", "ai.onnx.preview")


def check_supported(model: onnx.ModelProto) -> None:
    """Raise ``OracleUnsupported`` (one line, naming the op and the node) at the first node that
    neither onnx's reference evaluator nor ``CONTRIB_OPS`` implements."""
    ours = contrib_ops()
    opsets = {o.domain: o.version for o in model.opset_import}
    local = {(f.domain, f.name) for f in model.functions}
    from lockstep.inference import _nodes  # every node, subgraphs included (structure only)

    for n in _nodes(model.graph):
        key = (n.domain, n.op_type)
        if key in ours or key in local:
            continue
        if n.domain in ("", "ai.onnx", *_OTHER_DOMAINS):
            dom = "" if n.domain == "ai.onnx" else n.domain
            version = opsets.get(n.domain, opsets.get(dom, 1))
            if onnx.defs.has(n.op_type, version, dom):
                continue
        raise OracleUnsupported(
            f"the oracle has no implementation of {_node_name(n)} (onnx {onnx.__version__}'s reference "
            f"evaluator and lockstep's contrib ops lack it): give an fp32 twin computing the same function "
            f"(--twin)")
