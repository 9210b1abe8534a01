"""The golden-model generator: ``build(spec) -> onnx.ModelProto``, a pure function of the spec.

Weights come from ``numpy.random.RandomState(spec.seed)`` in float64, in a fixed order, and are
then cast to the spec's dtype, so the fp32 and fp16 variants of one seed share their values up to
rounding. ``reference_forward`` is the float64 numpy forward of ``golden/forward.py`` (the one the
Llama exporter's ``llama_forward`` also runs) on these weights, written independently of the graph;
it plants the near-tie and is the oracle the tests compare the engines against.

Also here: the manifest (``write_models``, ``check_models``): each variant's sha256 of its
deterministic serialization, its spec and the generator version.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from collections.abc import Callable
from typing import Any

import numpy as np

from lockstep.paths import atomic_write
import onnx
from onnx import TensorProto, helper, numpy_helper

from ..decoder_graph import GOLDEN, MS_DOMAIN, Graph, gqa_layers, llama_layers, rotary_embedding
from ..forward import forward as _core_forward
from ..forward import rope_tables
from ..int4 import dequantize_int4, quantize_symmetric
from .spec import GENERATOR_VERSION, VARIANTS, ModelSpec, spec_dict

__all__ = [
    "IR_VERSION",
    "MANIFEST",
    "MODELS_DIR",
    "OPSET",
    "build",
    "check_models",
    "empty_past",
    "prompt_feeds",
    "prompt_ids",
    "read_manifest",
    "reference_forward",
    "serialize",
    "sha256_of",
    "stored_weights",
    "weights_from_model",
    "write_models",
]

IR_VERSION = 10
OPSET = 24
MODELS_DIR = Path(__file__).resolve().parent
MANIFEST = MODELS_DIR / "manifest.json"

_ONNX_DTYPE = {"float32": TensorProto.FLOAT, "float16": TensorProto.FLOAT16}


# -- weights ------------------------------------------------------------------------------------

def _raw_weights(spec: ModelSpec) -> dict[str, np.ndarray]:
    """All weights in float64, drawn in a fixed order from RandomState(seed)."""
    rs = np.random.RandomState(spec.seed)
    d, L = spec.d_model, spec.n_layers
    w: dict[str, np.ndarray] = {}

    def normal(shape, scale):
        return rs.standard_normal(shape) * scale

    def norm_scale():
        return 1.0 + normal((d,), spec.norm_jitter)

    w["embed_tokens.weight"] = normal((spec.vocab, d), spec.embed_scale)
    for l in range(L):
        p = f"layers.{l}."
        w[p + "attn_norm.weight"] = norm_scale()
        w[p + "q_proj.weight"] = normal((d, spec.q_dim), spec.qk_scale / np.sqrt(d))
        w[p + "k_proj.weight"] = normal((d, spec.kv_dim), spec.qk_scale / np.sqrt(d))
        w[p + "v_proj.weight"] = normal((d, spec.kv_dim), spec.proj_scale / np.sqrt(d))
        w[p + "o_proj.weight"] = normal((spec.q_dim, d), spec.proj_scale / np.sqrt(spec.q_dim))
        w[p + "mlp_norm.weight"] = norm_scale()
        w[p + "gate_proj.weight"] = normal((d, spec.d_ff), spec.proj_scale / np.sqrt(d))
        w[p + "up_proj.weight"] = normal((d, spec.d_ff), spec.proj_scale / np.sqrt(d))
        w[p + "down_proj.weight"] = normal((spec.d_ff, d), spec.proj_scale / np.sqrt(spec.d_ff))
    w["norm.weight"] = norm_scale()
    w["lm_head.weight"] = normal((d, spec.vocab), spec.lm_head_scale / np.sqrt(d))
    w["rope.cos_cache"], w["rope.sin_cache"] = rope_tables(spec.head_dim, spec.rope_theta, spec.max_positions)
    return w


def _round(a: np.ndarray, dtype: str) -> np.ndarray:
    return np.asarray(a, dtype=np.float64).astype(dtype).astype(np.float64)


_PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def stored_weights(spec: ModelSpec) -> dict[str, np.ndarray]:
    """The weights exactly as the model stores them (values rounded to the dtype), held in float64,
    with int4 quantization (dequantized values) and the near-tie correction where the spec asks."""
    w = {k: _round(v, spec.dtype) for k, v in _raw_weights(spec).items()}
    if spec.weights_int4:
        for k in list(w):
            if k.split(".")[-2] in _PROJECTIONS:
                dequantized = dequantize_int4(quantize_symmetric(w[k].T, spec.int4_block)).T
                w[k] = _round(dequantized, spec.dtype)
    if spec.near_tie is not None:
        w = _plant_near_tie(spec, w)
    return w


def weights_from_model(model: onnx.ModelProto) -> dict[str, np.ndarray]:
    """Every float initializer of a built model, as float64 (the ``reference_forward`` weights)."""
    return {t.name: numpy_helper.to_array(t).astype(np.float64) for t in model.graph.initializer
            if not t.name.startswith("const.")}


# -- the float64 reference forward (golden/forward.py, in this generator's naming and layout) ----

def _forward(spec: ModelSpec, w: dict[str, np.ndarray], input_ids: np.ndarray, position_ids: np.ndarray,
             past: list[tuple[np.ndarray, np.ndarray]] | None, attention_mask: np.ndarray | None = None):
    """``golden.forward.forward`` on the spec's shape, its stored rope caches and its eps as the
    graph carries it (a float32 attribute / constant): ``(logits, presents, hidden)``."""
    return _core_forward(w, input_ids, position_ids, n_layers=spec.n_layers, n_heads=spec.n_heads,
                         n_kv_heads=spec.n_kv_heads, head_dim=spec.head_dim, eps=float(np.float32(spec.eps)),
                         cos=w["rope.cos_cache"], sin=w["rope.sin_cache"], past=past, attention_mask=attention_mask)


def reference_forward(spec: ModelSpec, weights: dict[str, np.ndarray] | None, input_ids: np.ndarray,
                      position_ids: np.ndarray, past: list[tuple[np.ndarray, np.ndarray]] | None = None,
                      attention_mask: np.ndarray | None = None):
    """float64 forward: ``(logits (B, S, vocab), [(present_key, present_value) per layer])``.

    ``weights`` defaults to ``stored_weights(spec)``; pass ``weights_from_model(model)`` to mirror
    a model file. ``past`` is a list of (key, value) pairs (B, n_kv_heads, past_seq, head_dim).
    ``attention_mask`` (B, past_seq + seq), for a spec with one: a 0 drops that key (None: all 1)."""
    w = stored_weights(spec) if weights is None else weights
    logits, presents, _ = _forward(spec, w, np.asarray(input_ids), np.asarray(position_ids), past, attention_mask)
    return logits, presents


def prompt_ids(prompt: str) -> np.ndarray:
    return np.frombuffer(prompt.encode("utf-8"), dtype=np.uint8).astype(np.int64)[None, :]


def empty_past(spec: ModelSpec, batch: int = 1) -> list[tuple[np.ndarray, np.ndarray]]:
    z = np.zeros((batch, spec.n_kv_heads, 0, spec.head_dim), dtype=spec.dtype)
    return [(z, z.copy()) for _ in range(spec.n_layers)]


def prompt_feeds(spec: ModelSpec, input_ids: np.ndarray, past=None, start: int | None = None) -> dict[str, np.ndarray]:
    """Feeds for a (1, seq) token array: positions continue after ``past`` (empty when None)."""
    input_ids = np.asarray(input_ids, dtype=np.int64).reshape(1, -1)
    past = empty_past(spec) if past is None else past
    start = past[0][0].shape[2] if start is None else start
    feeds = {"input_ids": input_ids,
             "position_ids": np.arange(start, start + input_ids.shape[1], dtype=np.int64)[None, :]}
    if spec.attention_mask:  # every key so far: the past's and this step's
        feeds["attention_mask"] = np.ones((1, past[0][0].shape[2] + input_ids.shape[1]), np.int64)
    for l, (k, v) in enumerate(past):
        feeds[f"past_key_values.{l}.key"] = np.ascontiguousarray(k, dtype=spec.dtype)
        feeds[f"past_key_values.{l}.value"] = np.ascontiguousarray(v, dtype=spec.dtype)
    return feeds


def _plant_near_tie(spec: ModelSpec, w: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """Rank-one correction of the runner-up's lm_head column: at the planted position the top-2
    logits end ``margin`` apart (float64 forward of the stored, dtype-rounded weights)."""
    nt = spec.near_tie
    assert nt is not None
    ids = prompt_ids(nt.prompt)
    if not 0 <= nt.position < ids.shape[1]:
        raise ValueError(f"{spec.name}: near-tie position {nt.position} outside the prompt ({ids.shape[1]} tokens)")
    pos = np.arange(ids.shape[1], dtype=np.int64)[None, :]
    logits, _, hidden = _forward(spec, w, ids, pos, None)
    row, h = logits[0, nt.position], hidden[0, nt.position]
    order = np.argsort(-row, kind="stable")
    top1, top2 = int(order[0]), int(order[1])
    if (top1, top2) != (nt.top1, nt.top2):
        raise ValueError(f"{spec.name}: near-tie recorded tokens (top1={nt.top1}, top2={nt.top2}) but the model's "
                         f"top-2 at position {nt.position} are (top1={top1}, top2={top2}); update NEAR_TIE in spec.py")
    lm = w["lm_head.weight"].copy()
    col = lm[:, top2]
    target = row[top1] - nt.margin
    col = col + (target - h @ col) * h / (h @ h)
    lm[:, top2] = _round(col, spec.dtype)
    out = dict(w)
    out["lm_head.weight"] = lm
    return out


# -- the graph (the layers are golden/decoder_graph.py's, shared with the exporter) -------------

def _rms_node(g: Graph, spec: ModelSpec, x: str, scale: str, name: str) -> str:
    if spec.flavour == "standard":
        return g.op("RMSNormalization", [x, scale], name, axis=-1, epsilon=float(spec.eps), stash_type=1)
    # decomposed: x * Reciprocal(Sqrt(ReduceMean(x*x) + eps)) * scale, in float32 like stash_type=1
    if spec.dtype != "float32":
        x = g.op("Cast", [x], f"{name}/x_f32", to=TensorProto.FLOAT)
        scale = g.op("Cast", [scale], f"{name}/scale_f32", to=TensorProto.FLOAT)
    sq = g.op("Mul", [x, x], f"{name}/sq")
    ms = g.op("ReduceMean", [sq, g.i64([-1])], f"{name}/mean", keepdims=1)
    ms = g.op("Add", [ms, g.const(spec.eps, np.float32)], f"{name}/add_eps")
    inv = g.op("Reciprocal", [g.op("Sqrt", [ms], f"{name}/sqrt")], f"{name}/inv")
    y = g.op("Mul", [g.op("Mul", [x, inv], f"{name}/normed"), scale], name if spec.dtype == "float32" else f"{name}/y")
    if spec.dtype != "float32":
        y = g.op("Cast", [y], name, to=_ONNX_DTYPE[spec.dtype])
    return y


def build(spec: ModelSpec) -> onnx.ModelProto:
    """The ONNX model of a spec (see golden/models/README.md). Pure: same spec, same bytes."""
    if spec.flavour == "genai":
        return _build_genai(spec)
    w = stored_weights(spec)
    dt, odt = spec.dtype, _ONNX_DTYPE[spec.dtype]
    H, KV, D, L = spec.n_heads, spec.n_kv_heads, spec.head_dim, spec.n_layers
    g = Graph(dt)
    for k, v in w.items():
        g.init(k, v.astype(dt))

    inputs, outputs = _io(spec)
    C = spec.kv_capacity

    # shared: causal mask from positions, key k attended by query q iff k <= position_ids[b, q]
    past_len = g.op("Gather", [g.op("Shape", ["past_key_values.0.key"], "mask/past_shape"), g.i64(2)],
                    "mask/past_len", axis=0)
    # the new length: read by the growing total (past + new) and by the attention mask's query positions only
    seq_len = (g.op("Gather", [g.op("Shape", ["input_ids"], "mask/ids_shape"), g.i64(1)], "mask/seq_len", axis=0)
               if not C or spec.attention_mask else None)
    total = g.op("Add", [past_len, seq_len], "mask/total_len") if not C else past_len  # fixed: T = C
    kpos = g.op("Range", [g.i64(0), total, g.i64(1)], "mask/key_positions")  # (T,)
    # where this step's keys/values go, each flavour emitting only the write it reads: TensorScatter
    # at the batch's first position (standard), or a one-hot over the slots (decomposed)
    if C and spec.flavour == "standard":
        start = g.op("Squeeze", [g.op("Slice", ["position_ids", g.i64([0]), g.i64([1]), g.i64([1])],
                                      "kv/first_position"), g.i64([1])], "kv/write_index")  # (B,)
    if C and spec.flavour == "decomposed":
        onehot = g.op("Cast", [g.op("Equal", [g.op("Unsqueeze", ["position_ids", g.i64([2])], "kv/pos3"), kpos],
                                    "kv/slot_hit")], "kv/onehot", to=odt)  # (B, S, C)
        onehot_t = g.op("Unsqueeze", [g.op("Transpose", [onehot], "kv/onehot_t3", perm=[0, 2, 1]), g.i64([1])],
                        "kv/onehot_t")  # (B, 1, C, S)
        keep = g.op("Sub", [g.f(1.0), g.op("Unsqueeze", [g.op("ReduceSum", [onehot, g.i64([1])], "kv/written",
                                                                keepdims=0), g.i64([1, 3])], "kv/written4")],
                    "kv/keep")  # (B, 1, C, 1): 1 where the slot keeps its past value
    if spec.attention_mask:  # transformers' eager mask: where(causal AND attention_mask, 0, finfo.min)
        bias = _hf_mask_bias(g, spec, past_len, seq_len, kpos)  # (B, 1, S, T)
    else:
        qpos = g.op("Unsqueeze", ["position_ids", g.i64([1, 3])], "mask/query_positions")  # (B, 1, S, 1)
        allowed = g.op("LessOrEqual", [kpos, qpos], "mask/allowed")  # (B, 1, S, T) bool
    if spec.flavour == "decomposed" and not spec.attention_mask:
        bias = g.op("Where", [allowed, g.f(0.0), g.f(-np.inf)], "mask/bias")  # (B, 1, S, T): 0 / -inf
    scale = float(1.0 / np.sqrt(D))

    def presents(l: int) -> tuple[str, str, str, str]:
        return (f"past_key_values.{l}.key", f"past_key_values.{l}.value", f"present.{l}.key", f"present.{l}.value")

    if spec.flavour == "standard":
        rope = rotary_embedding(g, "position_ids")

        def attend(l: int, q: str, k: str, v: str) -> str:
            n, (past_k, past_v, pres_k, pres_v) = f"layers.{l}", presents(l)
            if C:  # write in place (functionally) at the write index, attend over all C slots
                kk = g.op("TensorScatter", [past_k, k, start], f"{n}/present_key", outputs=[pres_k], axis=2)
                vv = g.op("TensorScatter", [past_v, v, start], f"{n}/present_value", outputs=[pres_v], axis=2)
                return g.op("Attention", [q, kk, vv, allowed], f"{n}/attention", scale=scale)
            # the mask: boolean (True = attend), or the additive bias of an attention_mask input
            mask = bias if spec.attention_mask else allowed
            return g.op("Attention", [q, k, v, mask, past_k, past_v], f"{n}/attention",
                        outputs=[f"{n}/attention", pres_k, pres_v], scale=scale)[0]
    else:
        rope, attend = _decomposed_attention(g, spec, bias, onehot_t if C else None, keep if C else None, presents)

    x = g.op("Gather", ["embed_tokens.weight", "input_ids"], "embed", axis=0)
    x = llama_layers(g, GOLDEN, x, n_layers=L, heads=(H, KV, D),
                     proj=lambda x, w, node: g.op("MatMul", [x, w], node),
                     rms=lambda x, scale, name: _rms_node(g, spec, x, scale, name), rope=rope, attend=attend)
    g.op("MatMul", [x, "lm_head.weight"], "lm_head", outputs=["logits"])
    return _finish(spec, g, inputs, outputs)


def _decomposed_attention(g: Graph, spec: ModelSpec, bias: str, onehot_t: str | None, keep: str | None,
                          presents: Callable[[int], tuple[str, str, str, str]]):
    """``rope`` and ``attend`` of the decomposed flavour: elementwise ops, Gather, Slice, Concat,
    MatMul and Softmax only (rotate-half rotary, repeated KV heads, a fixed-capacity write as
    ``past * keep + onehot^T @ new``)."""
    H, KV, D = spec.n_heads, spec.n_kv_heads, spec.head_dim
    half = D // 2
    cos = g.op("Gather", ["rope.cos_cache", "position_ids"], "rope/cos_half", axis=0)  # (B, S, D/2)
    sin = g.op("Gather", ["rope.sin_cache", "position_ids"], "rope/sin_half", axis=0)
    cos = g.op("Unsqueeze", [g.op("Concat", [cos, cos], "rope/cos_full", axis=-1), g.i64([1])], "rope/cos")
    sin = g.op("Unsqueeze", [g.op("Concat", [sin, sin], "rope/sin_full", axis=-1), g.i64([1])], "rope/sin")

    def rope(x: str, name: str) -> str:  # x * cos + rotate_half(x) * sin, rotate_half = [-x2, x1]
        x1 = g.op("Slice", [x, g.i64([0]), g.i64([half]), g.i64([-1])], f"{name}/x1")
        x2 = g.op("Slice", [x, g.i64([half]), g.i64([D]), g.i64([-1])], f"{name}/x2")
        rot = g.op("Concat", [g.op("Neg", [x2], f"{name}/neg_x2"), x1], f"{name}/rotate_half", axis=-1)
        return g.op("Add", [g.op("Mul", [x, cos], f"{name}/x_cos"), g.op("Mul", [rot, sin], f"{name}/rot_sin")],
                    name)

    def repeat_kv(x: str, name: str) -> str:  # (B, KV, T, D) -> (B, H, T, D), head h uses kv head h // G
        if H == KV:
            return x
        u = g.op("Unsqueeze", [x, g.i64([2])], f"{name}/unsqueeze")
        e = g.op("Expand", [u, g.i64([1, 1, H // KV, 1, 1])], f"{name}/expand")
        return g.op("Reshape", [e, g.i64([0, H, -1, D])], name)

    def attend(l: int, q: str, k: str, v: str) -> str:
        n, (past_k, past_v, pres_k, pres_v) = f"layers.{l}", presents(l)
        if onehot_t is not None:  # present = past * keep + onehot^T @ new: elementwise and MatMul only
            def write(past: str, new: str, out: str, name: str) -> str:
                kept = g.op("Mul", [past, keep], f"{name}/kept")
                return g.op("Add", [kept, g.op("MatMul", [onehot_t, new], f"{name}/scattered")], name,
                            outputs=[out])
            kk = write(past_k, k, pres_k, f"{n}/present_key")
            vv = write(past_v, v, pres_v, f"{n}/present_value")
        else:
            kk = g.op("Concat", [past_k, k], f"{n}/present_key", axis=2, outputs=[pres_k])
            vv = g.op("Concat", [past_v, v], f"{n}/present_value", axis=2, outputs=[pres_v])
        kr, vr = repeat_kv(kk, f"{n}/k_repeat"), repeat_kv(vv, f"{n}/v_repeat")
        kt = g.op("Transpose", [kr], f"{n}/k_t", perm=[0, 1, 3, 2])
        s = g.op("Mul", [g.op("MatMul", [q, kt], f"{n}/qk"), g.f(1.0 / np.sqrt(D))], f"{n}/scores")
        s = g.op("Add", [s, bias], f"{n}/masked_scores")
        pr = g.op("Softmax", [s], f"{n}/probs", axis=-1)
        return g.op("MatMul", [pr, vr], f"{n}/attention")

    return rope, attend


def _hf_mask_bias(g: Graph, spec: ModelSpec, past_len: str, seq_len: str, kpos: str) -> str:
    """The additive mask of a Hugging Face export (transformers' ``masking_utils``: ``sdpa_mask``
    and ``eager_mask``, as Optimum exports them): query ``q`` at cache position ``past + q`` attends
    key ``t`` iff ``t <= past + q`` AND ``attention_mask[b, t]``, with no escape for a query's own
    key, and ``Where(allowed, 0, finfo(dtype).min)`` is added to the scores. So a mask that drops
    any key, the step's own included, changes the softmax. (B, 1, S, T) in the model dtype."""
    end = g.op("Add", [past_len, seq_len], "mask/cache_end")
    cache_position = g.op("Range", [past_len, end, g.i64(1)], "mask/cache_position")  # (S,)
    causal = g.op("LessOrEqual", [kpos, g.op("Unsqueeze", [cache_position, g.i64([1])], "mask/query_index")],
                  "mask/causal")  # (S, T): key index <= query's cache position
    padding = g.op("Unsqueeze", [g.op("Cast", ["attention_mask"], "mask/padding_bool", to=TensorProto.BOOL),
                                 g.i64([1, 2])], "mask/padding")  # (B, 1, 1, T)
    allowed = g.op("And", [causal, padding], "mask/allowed")  # (B, 1, S, T)
    return g.op("Where", [allowed, g.f(0.0), g.f(np.finfo(spec.dtype).min)], "mask/bias")


def _io(spec: ModelSpec) -> tuple[list, list]:
    odt, KV, D, C = _ONNX_DTYPE[spec.dtype], spec.n_kv_heads, spec.head_dim, spec.kv_capacity
    inputs = [helper.make_tensor_value_info("input_ids", TensorProto.INT64, ["batch", "seq"]),
              helper.make_tensor_value_info("position_ids", TensorProto.INT64, ["batch", "seq"])]
    if spec.attention_mask:  # Optimum's order: input_ids, attention_mask, position_ids, past_key_values.*
        inputs.insert(1, helper.make_tensor_value_info("attention_mask", TensorProto.INT64, ["batch", "total_seq"]))
    outputs = [helper.make_tensor_value_info("logits", odt, ["batch", "seq", spec.vocab])]
    for l in range(spec.n_layers):
        for kind in ("key", "value"):
            inputs.append(helper.make_tensor_value_info(f"past_key_values.{l}.{kind}", odt,
                                                        ["batch", KV, C or "past_seq", D]))
            outputs.append(helper.make_tensor_value_info(f"present.{l}.{kind}", odt,
                                                         ["batch", KV, C or "total_seq", D]))
    return inputs, outputs


def _build_genai(spec: ModelSpec) -> onnx.ModelProto:
    """ONNX Runtime GenAI style (``decoder_graph.gqa_layers``): MatMulNBits int4 projections,
    GroupQueryAttention with rotary inside, SkipSimplifiedLayerNormalization carrying the residual.
    The fp32 oracle runs the standard flavour of the same spec (same dequantized weights)."""
    w = stored_weights(spec)
    raw = {k: _round(v, spec.dtype) for k, v in _raw_weights(spec).items()}
    dt = spec.dtype
    g = Graph(dt)
    for k, v in w.items():
        if k.split(".")[-2] not in _PROJECTIONS:
            g.init(k, v.astype(dt))
    inputs, outputs = _io(spec)

    def nbits(x: str, weight: str, name: str) -> str:
        q = quantize_symmetric(raw[weight].T, spec.int4_block)
        k, n = raw[weight].shape
        g.init(weight + ".qweight", q.packed)
        g.init(weight + ".scales", q.scales.astype(dt))
        return g.op("MatMulNBits", [x, weight + ".qweight", weight + ".scales"], name, domain=MS_DOMAIN,
                    K=k, N=n, bits=4, block_size=spec.int4_block)

    past_len = g.op("Gather", [g.op("Shape", ["past_key_values.0.key"], "gqa/past_shape"), g.i64(2)],
                    "gqa/past_len", axis=0)
    seq_len = g.op("Gather", [g.op("Shape", ["input_ids"], "gqa/ids_shape"), g.i64(1)], "gqa/seq_len", axis=0)
    batch = g.op("Gather", [g.op("Shape", ["input_ids"], "gqa/ids_shape2"), g.i64([0])], "gqa/batch", axis=0)
    total = g.op("Add", [past_len, seq_len], "gqa/total")
    total_i32 = g.op("Cast", [total], "gqa/total_sequence_length", to=TensorProto.INT32)
    seqlens = g.op("Expand", [g.op("Cast", [g.op("Sub", [total, g.i64(1)], "gqa/last")], "gqa/last_i32",
                                   to=TensorProto.INT32), batch], "gqa/seqlens_k")

    x = g.op("Gather", ["embed_tokens.weight", "input_ids"], "embed", axis=0)
    h = gqa_layers(g, GOLDEN, x, n_layers=spec.n_layers, n_heads=spec.n_heads, n_kv_heads=spec.n_kv_heads,
                   head_dim=spec.head_dim, eps=spec.eps, proj=nbits, seqlens_k=seqlens, total_sequence_length=total_i32)
    g.op("MatMul", [h, "lm_head.weight"], "lm_head", outputs=["logits"])
    return _finish(spec, g, inputs, outputs)


def _finish(spec: ModelSpec, g: Graph, inputs: list, outputs: list) -> onnx.ModelProto:
    graph = helper.make_graph(g.nodes, spec.name, inputs, outputs, initializer=g.inits)
    opsets = [helper.make_opsetid("", OPSET)] + ([helper.make_opsetid(MS_DOMAIN, 1)] if g.contrib else [])
    model = helper.make_model(graph, opset_imports=opsets, ir_version=IR_VERSION,
                              producer_name="lockstep.golden.models", producer_version=GENERATOR_VERSION)
    meta = {"spec": spec_dict(spec), "generator_version": GENERATOR_VERSION}
    model.doc_string = json.dumps(meta, sort_keys=True)
    helper.set_model_props(model, {"lockstep.golden.variant": spec.name,
                                   "lockstep.golden.generator_version": GENERATOR_VERSION})
    return model


# -- serialization and the manifest --------------------------------------------------------------

def serialize(model: onnx.ModelProto) -> bytes:
    return model.SerializeToString(deterministic=True)


def sha256_of(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def _manifest_entry(spec: ModelSpec, data: bytes) -> dict[str, Any]:
    return {"sha256": sha256_of(data), "spec": spec_dict(spec), "generator_version": GENERATOR_VERSION}


def write_models(directory: Path | str = MODELS_DIR, variants: dict[str, ModelSpec] = VARIANTS) -> dict[str, Any]:
    """Write ``<name>.onnx`` for every variant and ``manifest.json``; returns the manifest."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    manifest: dict[str, Any] = {}
    for name, spec in variants.items():
        data = serialize(build(spec))
        atomic_write(directory / f"{name}.onnx", data)
        manifest[name] = _manifest_entry(spec, data)
    atomic_write(directory / "manifest.json", (json.dumps(manifest, indent=2, sort_keys=True) + "\n").encode())
    return manifest


def read_manifest(directory: Path | str = MODELS_DIR) -> dict[str, Any]:
    return json.loads((Path(directory) / "manifest.json").read_text())


def check_models(directory: Path | str = MODELS_DIR, variants: dict[str, ModelSpec] = VARIANTS) -> list[str]:
    """Rebuild every variant in memory; one line per problem (empty: all clean). Each line starts
    with the model's name: drift (the generator's sha256 differs from the manifest's), a manifest
    spec or generator version that differs, a file missing or differing from the build."""
    directory = Path(directory)
    try:
        manifest = read_manifest(directory)
    except FileNotFoundError:
        return [f"manifest.json: missing in {directory}"]
    except json.JSONDecodeError as exc:
        return [f"manifest.json: not valid JSON: {exc}"]
    problems: list[str] = []
    for name, spec in variants.items():
        data = serialize(build(spec))
        want = _manifest_entry(spec, data)
        got = manifest.get(name)
        if got is None:
            problems.append(f"{name}: not in the manifest")
        else:
            if got.get("sha256") != want["sha256"]:
                problems.append(f"{name}: drift: the generator builds sha256 {want['sha256']}, "
                                f"the manifest records {got.get('sha256')}")
            if got.get("spec") != want["spec"]:
                problems.append(f"{name}: the manifest's spec differs from spec.py")
            if got.get("generator_version") != GENERATOR_VERSION:
                problems.append(f"{name}: the manifest's generator_version {got.get('generator_version')!r} "
                                f"differs from {GENERATOR_VERSION!r}")
        path = directory / f"{name}.onnx"
        if not path.is_file():
            problems.append(f"{name}: file {path.name} is missing")
        elif sha256_of(path.read_bytes()) != want["sha256"]:
            problems.append(f"{name}: file {path.name} differs from the build (sha256 "
                            f"{sha256_of(path.read_bytes())})")
    for name in sorted(set(manifest) - set(variants)):
        problems.append(f"{name}: in the manifest but not a variant in spec.py")
    return problems
