"""A Llama-architecture ONNX exporter in the conventions real exports use, and a float64 numpy
forward of the same architecture to check it against.

``build_llama_onnx(cfg, weights, convention=...)`` is a pure function of its arguments: the same
config, weights and options give a byte-identical ``SerializeToString()`` (IR 10, opset 24, plus
``com.microsoft`` 1 when a contrib op is used). ``weights`` use Hugging Face's names and layouts
(``model.embed_tokens.weight`` [vocab, hidden], projections [out, in], see ``weight_names``) and
Hugging Face's semantics: rotate-half (non-interleaved) RoPE on the HF-layout q/k rows, grouped
query attention, SiLU-gated MLP, RMSNorm with ``rms_eps``.

Conventions (batch 1 is what lockstep decodes; both graphs are shape-generic):

``optimum`` (Hugging Face Optimum / transformers.js)
    inputs ``input_ids`` int64 [batch_size, sequence_length], ``attention_mask`` int64
    [batch_size, total_sequence_length], ``position_ids`` int64 [batch_size, sequence_length]
    (only with ``position_ids=True``; without it positions are past length + 0..S-1),
    ``past_key_values.{i}.key|value`` [batch_size, n_kv_heads, past_sequence_length, head_dim];
    outputs ``logits`` [batch_size, sequence_length, vocab] and ``present.{i}.key|value``
    [batch_size, n_kv_heads, total_sequence_length, head_dim]. Standard ONNX ops: RMSNormalization,
    RotaryEmbedding, Attention (boolean mask, past -> present). Query ``s`` (cache index
    ``past + s``) attends key ``t`` iff ``t <= past + s`` and ``attention_mask[b, t] == 1``; a
    padding query also attends itself, so that its (unused) row stays finite.
``genai`` (ONNX Runtime GenAI builder style)
    inputs ``input_ids``, ``attention_mask``, ``past_key_values.{i}.key|value`` (BNSH), no
    position_ids; com.microsoft GroupQueryAttention (``seqlens_k`` = ReduceSum(attention_mask) - 1
    as int32 [batch], ``total_sequence_length`` = Shape(attention_mask)[1] as an int32 scalar,
    ``do_rotary=1`` with cos/sin caches), SkipSimplifiedLayerNormalization carrying the residual;
    the first norm is RMSNormalization (ONNX Runtime registers SimplifiedLayerNormalization only
    in the ai.onnx domain, which onnx.checker rejects), as in ``golden/models/build.py``.

Tied embeddings (``tie_embeddings=True``): the [vocab, hidden] matrix is one initializer, read by
the Gather and by the LM head (``Gemm(transB=1)`` on the hidden states reshaped to 2-D). Untied,
``lm_head.weight`` [vocab, hidden] feeds the same Gemm. Other projections are MatMuls on the
transposed ([in, out]) weight, initializer ``<HF name>.T``, or, when listed in ``int4``,
com.microsoft MatMulNBits (bits 4) on ``<HF name>.qweight|scales|zero_points``.

Also here: ``random_llama_weights`` (float64, HF naming), ``llama_forward`` (the float64 forward of
``golden/forward.py``, the golden models' own, on HF-named weights: independent of the graphs),
``quantize_q4_1`` (re-exported from ``golden/int4.py``: scale + minimum per block, as llama.cpp's
Q4_1, in MatMulNBits' layout) and ``ExportSession`` (a batch-1 decode session over any engine's
``run`` for models of either convention).
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import onnx
from onnx import TensorProto, helper

from .forward import forward as _core_forward
from .forward import rope_tables as _rope_tables
from .int4 import Int4Weight, dequantize_int4, quantize_q4_1
from .decoder_graph import GENAI, MS_DOMAIN, OPTIMUM, Graph, gqa_layers, llama_layers, rotary_embedding

__all__ = [
    "CONVENTIONS", "EXPORTER_VERSION", "IR_VERSION", "OPSET", "ExportSession", "Int4Weight", "LlamaConfig",
    "build_llama_onnx", "dequantize_int4", "llama_forward", "projection_names", "quantize_q4_1",
    "random_llama_weights", "rope_tables", "weight_names",
]

EXPORTER_VERSION = "2"  # 2: scalar constants are rank 0 (Range bounds, GQA total_sequence_length)
IR_VERSION = 10
OPSET = 24
CONVENTIONS = ("optimum", "genai")
_DTYPES = {"float32": TensorProto.FLOAT, "float16": TensorProto.FLOAT16}


@dataclass(frozen=True)
class LlamaConfig:
    """The shape of a Llama-architecture decoder (Hugging Face ``LlamaConfig`` terms)."""

    n_layers: int
    hidden: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    d_ff: int
    vocab: int
    rope_theta: float = 10000.0
    rms_eps: float = 1e-5
    tie_embeddings: bool = True
    max_positions: int = 2048

    def __post_init__(self) -> None:
        for f in ("n_layers", "hidden", "n_heads", "n_kv_heads", "head_dim", "d_ff", "vocab", "max_positions"):
            if int(getattr(self, f)) <= 0:
                raise ValueError(f"LlamaConfig.{f} must be positive, got {getattr(self, f)!r}")
        if self.n_heads % self.n_kv_heads:
            raise ValueError(f"LlamaConfig: n_heads={self.n_heads} is not a multiple of n_kv_heads={self.n_kv_heads}")
        if self.head_dim % 2:
            raise ValueError(f"LlamaConfig: head_dim={self.head_dim} must be even (rotary halves)")

    @property
    def q_dim(self) -> int:
        return self.n_heads * self.head_dim

    @property
    def kv_dim(self) -> int:
        return self.n_kv_heads * self.head_dim

    def as_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


_LAYER_PROJ = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
               "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")


def projection_names(cfg: LlamaConfig) -> list[str]:
    """The HF names of every per-layer projection weight (the ones ``int4`` may quantize)."""
    return [f"model.layers.{i}.{p}.weight" for i in range(cfg.n_layers) for p in _LAYER_PROJ]


def _shapes(cfg: LlamaConfig) -> dict[str, tuple[int, ...]]:
    h = cfg.hidden
    out: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (cfg.vocab, h)}
    for i in range(cfg.n_layers):
        p = f"model.layers.{i}."
        out[p + "input_layernorm.weight"] = (h,)
        out[p + "self_attn.q_proj.weight"] = (cfg.q_dim, h)
        out[p + "self_attn.k_proj.weight"] = (cfg.kv_dim, h)
        out[p + "self_attn.v_proj.weight"] = (cfg.kv_dim, h)
        out[p + "self_attn.o_proj.weight"] = (h, cfg.q_dim)
        out[p + "post_attention_layernorm.weight"] = (h,)
        out[p + "mlp.gate_proj.weight"] = (cfg.d_ff, h)
        out[p + "mlp.up_proj.weight"] = (cfg.d_ff, h)
        out[p + "mlp.down_proj.weight"] = (h, cfg.d_ff)
    out["model.norm.weight"] = (h,)
    if not cfg.tie_embeddings:
        out["lm_head.weight"] = (cfg.vocab, h)
    return out


def weight_names(cfg: LlamaConfig) -> list[str]:
    """Every weight ``cfg`` needs, in HF naming and a fixed order (no ``lm_head.weight`` when tied)."""
    return list(_shapes(cfg))


# -- weights ------------------------------------------------------------------------------------

def random_llama_weights(cfg: LlamaConfig, seed: int) -> dict[str, np.ndarray]:
    """float64 weights in HF naming and layout, drawn in ``weight_names`` order from
    ``numpy.random.default_rng(seed)``. Projections are N(0, 1/fan_in) (q and k twice that scale,
    for attention of a few units), norms 1 + N(0, 0.1^2), the embedding / LM head N(0, 9/hidden):
    logits have a spread of a few units."""
    rng = np.random.default_rng(seed)
    out: dict[str, np.ndarray] = {}
    for name, shape in _shapes(cfg).items():
        if len(shape) == 1:
            out[name] = 1.0 + 0.1 * rng.standard_normal(shape)
        elif name in ("model.embed_tokens.weight", "lm_head.weight"):
            out[name] = rng.standard_normal(shape) * (3.0 / np.sqrt(cfg.hidden))
        else:
            gain = 2.0 if name.endswith(("q_proj.weight", "k_proj.weight")) else 1.0
            out[name] = rng.standard_normal(shape) * (gain / np.sqrt(shape[1]))
    return out


def rope_tables(cfg: LlamaConfig) -> tuple[np.ndarray, np.ndarray]:
    """float64 (cos, sin) [max_positions, head_dim/2]: angle ``p * rope_theta^(-2i/head_dim)``."""
    return _rope_tables(cfg.head_dim, cfg.rope_theta, cfg.max_positions)


def _check_weights(cfg: LlamaConfig, weights: Mapping[str, np.ndarray], skip: set[str] = frozenset()) -> None:
    for name, shape in _shapes(cfg).items():
        if name in skip:
            continue
        if name not in weights:
            raise KeyError(f"weights: {name!r} is missing (config {cfg})")
        got = tuple(np.shape(weights[name]))
        if got != shape:
            raise ValueError(f"weights: {name!r} has shape {got}, expected {shape} (HF layout [out, in])")
    if cfg.tie_embeddings and "lm_head.weight" in weights:
        raise ValueError("weights: lm_head.weight given but tie_embeddings=True (the embedding is the LM head)")


# -- the float64 forward ------------------------------------------------------------------------

def llama_forward(cfg: LlamaConfig, weights: Mapping[str, np.ndarray], input_ids) -> np.ndarray:
    """float64 logits [seq, vocab] of ``input_ids`` ([seq] or [1, seq]) at positions 0..seq-1, no
    past: Hugging Face Llama semantics through ``golden.forward.forward`` (the golden models' forward,
    written independently of the ONNX graphs), with ``rope_tables(cfg)`` and ``rms_eps``."""
    _check_weights(cfg, weights)
    ids = np.asarray(input_ids, np.int64).reshape(1, -1)
    cos, sin = rope_tables(cfg)
    logits, _, _ = _core_forward(_CoreWeights(cfg, weights), ids, np.arange(ids.shape[1], dtype=np.int64)[None, :],
                                 n_layers=cfg.n_layers, n_heads=cfg.n_heads, n_kv_heads=cfg.n_kv_heads,
                                 head_dim=cfg.head_dim, eps=cfg.rms_eps, cos=cos, sin=sin)
    return logits[0]


_CORE_NAMES = {"input_layernorm": "attn_norm", "post_attention_layernorm": "mlp_norm",
               **{f"self_attn.{a}_proj": f"{a}_proj" for a in "qkvo"},
               **{f"mlp.{a}_proj": f"{a}_proj" for a in ("gate", "up", "down")}}


class _CoreWeights(Mapping):
    """HF-named weights as ``golden.forward``'s names and layout ([in, out]: a projection's
    transpose, a view), converted to float64 as they are read (one layer at a time)."""

    def __init__(self, cfg: LlamaConfig, weights: Mapping[str, np.ndarray]):
        self.weights = weights
        head = "model.embed_tokens.weight" if cfg.tie_embeddings else "lm_head.weight"
        self.names = {"embed_tokens.weight": ("model.embed_tokens.weight", False),
                      "norm.weight": ("model.norm.weight", False), "lm_head.weight": (head, True)}
        for i in range(cfg.n_layers):
            for hf, core in _CORE_NAMES.items():
                self.names[f"layers.{i}.{core}.weight"] = (f"model.layers.{i}.{hf}.weight", "norm" not in core)

    def __getitem__(self, name: str) -> np.ndarray:
        hf, transpose = self.names[name]
        a = np.asarray(self.weights[hf], np.float64)
        return a.T if transpose else a

    def __iter__(self):
        return iter(self.names)

    def __len__(self) -> int:
        return len(self.names)


# -- the graph ----------------------------------------------------------------------------------

def build_llama_onnx(cfg: LlamaConfig, weights: Mapping[str, np.ndarray], *, convention: str,
                     dtype: str = "float32", int4: Mapping[str, Int4Weight | tuple] | None = None,
                     position_ids: bool = True, name: str = "llama", external: Any = None) -> onnx.ModelProto:
    """The ONNX decoder of ``cfg`` with ``weights`` (HF naming, float64 or float32) in ``convention``
    (``optimum`` or ``genai``, see the module docstring), weights and activations in ``dtype``
    (float32 or float16). ``int4`` maps projection names (``projection_names``) to ``Int4Weight``
    (or a 4-tuple of the same fields): those become MatMulNBits and their float weight may be absent
    from ``weights``. ``position_ids`` (optimum only): whether positions are an input. ``external``
    (``scale_export.ExternalData``): large initializers are written to its data file as they are
    made and referenced from the proto (``weights`` and ``int4`` may then be lazy mappings: each
    value is read once, where it is used). Deterministic."""
    if convention not in CONVENTIONS:
        raise ValueError(f"convention must be one of {CONVENTIONS}, got {convention!r}")
    if dtype not in _DTYPES:
        raise ValueError(f"dtype must be one of {sorted(_DTYPES)}, got {dtype!r}")
    if convention == "genai" and position_ids:
        position_ids = False  # the GenAI convention has no position_ids input (GroupQueryAttention derives them)
    int4 = int4 or {}  # read where each projection is made: a lazy mapping quantizes one at a time
    unknown = sorted(set(int4) - set(projection_names(cfg)))
    if unknown:
        raise KeyError(f"int4: {unknown[:4]} are not projection weights of this config "
                       f"(e.g. {projection_names(cfg)[0]!r})")
    _check_weights(cfg, weights, skip=set(int4))

    odt = _DTYPES[dtype]
    KV, D, L = cfg.n_kv_heads, cfg.head_dim, cfg.n_layers
    g = Graph(dtype, external)

    def cast(a) -> np.ndarray:
        return np.asarray(a, np.float64).astype(dtype)

    # initializers: embedding, norms, (lm head), rope caches; projections as they are first used
    g.init("model.embed_tokens.weight", cast(weights["model.embed_tokens.weight"]))
    for i in range(L):
        for n in ("input_layernorm", "post_attention_layernorm"):
            g.init(f"model.layers.{i}.{n}.weight", cast(weights[f"model.layers.{i}.{n}.weight"]))
    g.init("model.norm.weight", cast(weights["model.norm.weight"]))
    head = "model.embed_tokens.weight"
    if not cfg.tie_embeddings:
        head = g.init("lm_head.weight", cast(weights["lm_head.weight"]))
    cos, sin = rope_tables(cfg)
    g.init("rope.cos_cache", cos.astype(dtype))
    g.init("rope.sin_cache", sin.astype(dtype))

    def proj(x: str, key: str, node: str) -> str:
        q = Int4Weight(*int4[key]) if key in int4 else None
        if q is not None:
            _check_int4(cfg, key, q)
        if q is None:
            wt = g.init(key + ".T", np.ascontiguousarray(cast(weights[key]).T))
            return g.op("MatMul", [x, wt], node)
        n_out, k_in = _shapes(cfg)[key]
        ins = [g.init(key + ".qweight", q.packed.astype(np.uint8)), g.init(key + ".scales", cast(q.scales))]
        if q.zero_points is not None:
            ins.append(g.init(key + ".zero_points", cast(q.zero_points)))
        return g.op("MatMulNBits", [x] + ins, node, domain=MS_DOMAIN, K=k_in, N=n_out, bits=4, block_size=q.block_size)

    inputs = [helper.make_tensor_value_info("input_ids", TensorProto.INT64, ["batch_size", "sequence_length"]),
              helper.make_tensor_value_info("attention_mask", TensorProto.INT64, ["batch_size", "total_sequence_length"])]
    if position_ids:
        inputs.append(helper.make_tensor_value_info("position_ids", TensorProto.INT64, ["batch_size", "sequence_length"]))
    outputs = [helper.make_tensor_value_info("logits", odt, ["batch_size", "sequence_length", cfg.vocab])]
    for i in range(L):
        for kind in ("key", "value"):
            inputs.append(helper.make_tensor_value_info(f"past_key_values.{i}.{kind}", odt,
                                                        ["batch_size", KV, "past_sequence_length", D]))
            outputs.append(helper.make_tensor_value_info(f"present.{i}.{kind}", odt,
                                                         ["batch_size", KV, "total_sequence_length", D]))

    ids_shape = g.op("Shape", ["input_ids"], "ids_shape")  # [B, S]
    x = g.op("Gather", ["model.embed_tokens.weight", "input_ids"], "embed_tokens", axis=0)
    scale = float(1.0 / np.sqrt(D))
    if convention == "optimum":
        x = _optimum_layers(g, cfg, x, ids_shape, proj, position_ids, scale)
    else:
        x = _genai_layers(g, cfg, x, proj)

    # LM head: Gemm(transB=1) on [B*S, hidden] against the [vocab, hidden] matrix, then [B, S, vocab]
    flat = g.op("Reshape", [x, g.i64([-1, cfg.hidden])], "lm_head/flatten")
    logits2 = g.op("Gemm", [flat, head], "lm_head/gemm", transB=1)
    out_shape = g.op("Concat", [ids_shape, g.i64([cfg.vocab])], "lm_head/shape", axis=0)
    g.op("Reshape", [logits2, out_shape], "lm_head", outputs=["logits"])

    graph = helper.make_graph(g.nodes, name, inputs, outputs, initializer=g.inits)
    opsets = [helper.make_opsetid("", OPSET)] + ([helper.make_opsetid(MS_DOMAIN, 1)] if g.contrib else [])
    model = helper.make_model(graph, opset_imports=opsets, ir_version=IR_VERSION,
                              producer_name="lockstep.golden.llama_export", producer_version=EXPORTER_VERSION)
    meta = {"config": cfg.as_dict(), "convention": convention, "dtype": dtype, "position_ids": bool(position_ids),
            "int4": sorted(int4), "exporter_version": EXPORTER_VERSION}
    model.doc_string = json.dumps(meta, sort_keys=True)
    helper.set_model_props(model, {"lockstep.llama.config": json.dumps(cfg.as_dict(), sort_keys=True),
                                   "lockstep.llama.convention": convention,
                                   "lockstep.llama.exporter_version": EXPORTER_VERSION})
    return model


def _check_int4(cfg: LlamaConfig, key: str, q: Int4Weight) -> None:
    n, k = _shapes(cfg)[key]
    bs = int(q.block_size)
    if bs < 16 or bs & (bs - 1) or k % bs:
        raise ValueError(f"int4[{key!r}]: block_size {bs} must be a power of two >= 16 dividing K={k}")
    if np.asarray(q.packed).dtype != np.uint8 or tuple(np.shape(q.packed)) != (n, k // bs, bs // 2):
        raise ValueError(f"int4[{key!r}]: packed must be uint8 {(n, k // bs, bs // 2)}, got "
                         f"{np.asarray(q.packed).dtype}{tuple(np.shape(q.packed))}")
    for what, a in (("scales", q.scales), ("zero_points", q.zero_points)):
        if a is not None and np.size(a) != n * (k // bs):
            raise ValueError(f"int4[{key!r}]: {what} must have N*K/block = {n * (k // bs)} values, got {np.size(a)}")


def _optimum_layers(g: Graph, cfg: LlamaConfig, x: str, ids_shape: str, proj: Callable, has_positions: bool,
                    scale: float) -> str:
    # key t is attended by query s (cache index P + s) iff t <= P + s and (mask[b, t] or t == P + s)
    past_len = g.op("Gather", [g.op("Shape", ["past_key_values.0.key"], "mask/past_shape"), g.i64(2)],
                    "mask/past_length", axis=0)
    seq_len = g.op("Gather", [ids_shape, g.i64(1)], "mask/sequence_length", axis=0)
    total = g.op("Gather", [g.op("Shape", ["attention_mask"], "mask/mask_shape"), g.i64(1)],
                 "mask/total_length", axis=0)
    kpos = g.op("Unsqueeze", [g.op("Range", [g.i64(0), total, g.i64(1)], "mask/key_index"), g.i64([0])],
                "mask/key_index_row")  # [1, T]
    qidx = g.op("Range", [past_len, g.op("Add", [past_len, seq_len], "mask/end"), g.i64(1)], "mask/query_index")
    qpos = g.op("Unsqueeze", [qidx, g.i64([1])], "mask/query_index_col")  # [S, 1]
    causal = g.op("LessOrEqual", [kpos, qpos], "mask/causal")  # [S, T]
    itself = g.op("Equal", [kpos, qpos], "mask/self")  # [S, T]
    keep = g.op("Unsqueeze", [g.op("Cast", ["attention_mask"], "mask/keep_bool", to=TensorProto.BOOL),
                              g.i64([1, 2])], "mask/keep")  # [B, 1, 1, T]
    allowed = g.op("And", [causal, g.op("Or", [keep, itself], "mask/keep_or_self")], "mask/allowed")  # [B,1,S,T]
    if has_positions:
        positions = "position_ids"
    else:
        positions = g.op("Expand", [g.op("Unsqueeze", [qidx, g.i64([0])], "rope/positions_row"), ids_shape],
                         "rope/positions")  # [B, S]

    def attend(i: int, q: str, k: str, v: str) -> str:
        name = OPTIMUM.n("attention", i)
        return g.op("Attention", [q, k, v, allowed, f"past_key_values.{i}.key", f"past_key_values.{i}.value"],
                    name, outputs=[name, f"present.{i}.key", f"present.{i}.value"], scale=scale)[0]

    return llama_layers(g, OPTIMUM, x, n_layers=cfg.n_layers, heads=(cfg.n_heads, cfg.n_kv_heads, cfg.head_dim),
                        proj=proj, rms=lambda x, w, name: _rms(g, cfg, x, w, name),
                        rope=rotary_embedding(g, positions), attend=attend)


def _rms(g: Graph, cfg: LlamaConfig, x: str, scale: str, name: str) -> str:
    return g.op("RMSNormalization", [x, scale], name, axis=-1, epsilon=float(cfg.rms_eps), stash_type=1)


def _genai_layers(g: Graph, cfg: LlamaConfig, x: str, proj: Callable) -> str:
    mask_sum = g.op("ReduceSum", ["attention_mask", g.i64([1])], "attn_mask/reduce_sum", keepdims=0)
    seqlens = g.op("Cast", [g.op("Sub", [mask_sum, g.i64(1)], "attn_mask/sub")], "attn_mask/seqlens_k",
                   to=TensorProto.INT32)  # [B]
    total = g.op("Cast", [g.op("Gather", [g.op("Shape", ["attention_mask"], "attn_mask/shape"), g.i64(1)],
                               "attn_mask/total_length", axis=0)],
                 "attn_mask/total_sequence_length", to=TensorProto.INT32)  # int32 scalar
    return gqa_layers(g, GENAI, x, n_layers=cfg.n_layers, n_heads=cfg.n_heads, n_kv_heads=cfg.n_kv_heads,
                      head_dim=cfg.head_dim, eps=cfg.rms_eps, proj=proj, seqlens_k=seqlens,
                      total_sequence_length=total)


# -- decoding through an engine's run ------------------------------------------------------------

class ExportSession:
    """A batch-1 decode session (``reset``/``forward``/``capture_stats``, lockstep's DecodeSession
    protocol) over ``run(feeds) -> outputs`` for a model built by ``build_llama_onnx`` (either
    convention): each step feeds ``input_ids``, an all-ones ``attention_mask`` over every key so
    far, ``position_ids`` when the graph has them, and the previous step's presents as host arrays.
    ``forward(ids)`` returns the logits of ``ids`` [len(ids), vocab]."""

    def __init__(self, model: onnx.ModelProto, run: Callable[[dict[str, np.ndarray]], list]):
        from onnx.helper import tensor_dtype_to_np_dtype

        self.run = run
        ins = {vi.name: vi for vi in model.graph.input}
        if "input_ids" not in ins or "attention_mask" not in ins:
            raise ValueError(f"not an optimum/genai decoder: inputs {list(ins)[:6]}")
        self.positions = "position_ids" in ins
        self.pasts = [n for n in ins if n.startswith("past_key_values.")]
        first = ins[self.pasts[0]].type.tensor_type
        self.kv_dtype = tensor_dtype_to_np_dtype(first.elem_type)
        self.kv_heads, self.head_dim = first.shape.dim[1].dim_value, first.shape.dim[3].dim_value
        self.outputs = [o.name for o in model.graph.output]
        self.reset()

    def reset(self) -> None:
        empty = np.zeros((1, self.kv_heads, 0, self.head_dim), self.kv_dtype)
        self.cache = {p: empty for p in self.pasts}
        self.position = 0

    def forward(self, ids: Sequence[int]) -> np.ndarray:
        n = len(ids)
        if n < 1:
            raise ValueError("forward needs at least one token")
        feeds = {"input_ids": np.asarray([list(ids)], np.int64),
                 "attention_mask": np.ones((1, self.position + n), np.int64), **self.cache}
        if self.positions:
            feeds["position_ids"] = np.arange(self.position, self.position + n, dtype=np.int64)[None, :]
        out = dict(zip(self.outputs, self.run(feeds)))
        self.cache = {p: np.asarray(out["present." + p[len("past_key_values."):]]) for p in self.pasts}
        self.position += n
        return np.asarray(out["logits"][0])

    def capture_stats(self):
        from lockstep.engines.protocol import CaptureStats

        return CaptureStats()
