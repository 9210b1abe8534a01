"""The one Llama decoder-graph builder: the ONNX graph object and the decoder layers, shared by
the golden-model generator (``models/build.py``) and the exporter in real exporters' conventions
(``llama_export.py``).

Both front-ends emit the same layer sequence and differ only in names and in what surrounds the
layers (inputs, masks, positions, where initializers go, the LM head). So the layers are written
once, here, and each front-end passes a ``Naming`` (how it names a layer's weights and nodes) and
the pieces its form needs:

- ``llama_layers``: RMSNorm, q/k/v projections split into heads, rotary, attention, heads merged,
  o projection and residual, RMSNorm, the SwiGLU MLP and residual, per layer; the final norm. The
  front-end gives ``proj`` (MatMul or MatMulNBits), ``rms`` (the ONNX op or its decomposition),
  ``rope`` (RotaryEmbedding or its decomposition) and ``attend`` (Attention with a past, a
  fixed-capacity write, or the decomposed softmax).
- ``gqa_layers``: ONNX Runtime GenAI's form: GroupQueryAttention with rotary inside and
  SkipSimplifiedLayerNormalization carrying the residual into the next layer's norm.

A ``Naming`` is a table of templates with ``{i}`` for the layer: ``weight[role]`` for
initializers, ``node[role]`` for node names. The tables are at the bottom (``GOLDEN``, every
golden flavour; ``OPTIMUM`` and ``GENAI``, the exporter's conventions): they keep each front-end's
bytes (node and initializer names) as they were when the two builders were separate, which the
golden manifest's sha256s pin.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np
import onnx
from onnx import helper, numpy_helper

__all__ = ["GENAI", "GOLDEN", "MS_DOMAIN", "OPTIMUM", "Graph", "Naming", "gqa_layers",
           "llama_layers", "rotary_embedding", "swiglu"]

MS_DOMAIN = "com.microsoft"

Proj = Callable[[str, str, str], str]  # (x, weight key, node name) -> output
Norm = Callable[[str, str, str], str]  # (x, scale initializer, node name) -> output


class Graph:
    """Nodes and initializers in insertion order; small constants deduplicated by value (named
    ``const.<n>``); ``contrib`` records whether a ``com.microsoft`` op was used."""

    def __init__(self, dtype: str, sink: Any = None):
        self.dtype = dtype
        self.sink = sink  # where large initializers go instead of the proto (``scale_export.ExternalData``)
        self.nodes: list[onnx.NodeProto] = []
        self.inits: list[onnx.TensorProto] = []
        self.contrib = False
        self._consts: dict[tuple, str] = {}

    def init(self, name: str, value: np.ndarray) -> str:
        """An initializer of ``value``'s shape: a 0-d value stays a scalar (rank 0), as ``Range``'s
        bounds and GroupQueryAttention's ``total_sequence_length`` must be (``np.ascontiguousarray``
        alone makes it 1-D, which strict runtimes refuse there)."""
        a = np.asarray(value)
        if self.sink is not None and a.nbytes >= self.sink.threshold:
            self.inits.append(self.sink.tensor(name, a))  # written to the data file now, referenced here
            return name
        self.inits.append(numpy_helper.from_array(np.ascontiguousarray(a).reshape(a.shape), name))
        return name

    def const(self, value, dtype) -> str:
        """A small constant initializer, deduplicated by value."""
        a = np.asarray(value, dtype=dtype)
        key = (a.dtype.str, a.shape, a.tobytes())
        if key not in self._consts:
            self._consts[key] = self.init(f"const.{len(self._consts)}", a)
        return self._consts[key]

    def i64(self, value) -> str:
        return self.const(value, np.int64)

    def f(self, value) -> str:
        return self.const(value, self.dtype)

    def op(self, op_type: str, inputs: list[str], name: str, n_out: int = 1, outputs: list[str] | None = None,
           **attrs: Any) -> Any:
        """Append a node; its outputs are ``outputs`` or ``name`` (``name:<k>`` for ``n_out`` > 1).
        Returns the one output's name, or the list of them."""
        outs = outputs if outputs is not None else [name if n_out == 1 else f"{name}:{i}" for i in range(n_out)]
        domain = attrs.pop("domain", None) or None
        if domain == MS_DOMAIN:
            self.contrib = True
        self.nodes.append(helper.make_node(op_type, inputs, outs, name=name, domain=domain, **attrs))
        return outs[0] if len(outs) == 1 else outs


@dataclass(frozen=True)
class Naming:
    """How one form names a layer's initializers (``weight``) and nodes (``node``): templates with
    ``{i}``, the layer index. Roles: weights ``attn_norm q k v o mlp_norm gate up down final_norm``;
    nodes ``attn_norm q_proj q_reshape q_heads`` (and k, v) ``q_rope k_rope attention merge_heads
    merge o_proj attn_residual mlp_norm mlp mlp_residual final_norm``."""

    weight: Mapping[str, str]
    node: Mapping[str, str]

    def w(self, role: str, i: int = 0) -> str:
        return self.weight[role].format(i=i)

    def n(self, role: str, i: int = 0) -> str:
        return self.node[role].format(i=i)


def swiglu(g: Graph, proj: Proj, h: str, weights: tuple[str, str, str], prefix: str) -> str:
    """``down(SiLU(gate(h)) * up(h))``: nodes ``{prefix}/`` ``gate_proj``, ``up_proj``,
    ``gate_sigmoid``, ``gate_silu``, ``gated``, ``down_proj`` in this order."""
    gate_w, up_w, down_w = weights
    gate = proj(h, gate_w, f"{prefix}/gate_proj")
    up = proj(h, up_w, f"{prefix}/up_proj")
    act = g.op("Mul", [gate, g.op("Sigmoid", [gate], f"{prefix}/gate_sigmoid")], f"{prefix}/gate_silu")
    return proj(g.op("Mul", [act, up], f"{prefix}/gated"), down_w, f"{prefix}/down_proj")


def rotary_embedding(g: Graph, positions: str) -> Callable[[str, str], str]:
    """``rope`` for ``llama_layers``: ONNX RotaryEmbedding (rotate-half) over the graph's
    ``rope.cos_cache``/``rope.sin_cache`` at ``positions``."""
    def rope(x: str, name: str) -> str:
        return g.op("RotaryEmbedding", [x, "rope.cos_cache", "rope.sin_cache", positions], name, interleaved=0)
    return rope


def llama_layers(g: Graph, naming: Naming, x: str, *, n_layers: int, heads: tuple[int, int, int], proj: Proj,
                 rms: Norm, rope: Callable[[str, str], str],
                 attend: Callable[[int, str, str, str], str]) -> str:
    """The decoder layers on the embedded ``x`` [B, S, hidden] and the final norm. ``heads`` is
    ``(n_heads, n_kv_heads, head_dim)``; ``attend(i, q, k, v)`` gets layer ``i``'s rotated q and k
    and its v as [B, heads, S, D] and returns the attention [B, n_heads, S, D] (writing the
    layer's presents)."""
    H, KV, D = heads

    def split(t: str, n: int, i: int, which: str) -> str:  # [B, S, n*D] -> [B, n, S, D]
        r = g.op("Reshape", [t, g.i64([0, 0, n, D])], naming.n(f"{which}_reshape", i))
        return g.op("Transpose", [r], naming.n(f"{which}_heads", i), perm=[0, 2, 1, 3])

    for i in range(n_layers):
        h = rms(x, naming.w("attn_norm", i), naming.n("attn_norm", i))
        q = split(proj(h, naming.w("q", i), naming.n("q_proj", i)), H, i, "q")
        k = split(proj(h, naming.w("k", i), naming.n("k_proj", i)), KV, i, "k")
        v = split(proj(h, naming.w("v", i), naming.n("v_proj", i)), KV, i, "v")
        q, k = rope(q, naming.n("q_rope", i)), rope(k, naming.n("k_rope", i))
        att = attend(i, q, k, v)
        att = g.op("Transpose", [att], naming.n("merge_heads", i), perm=[0, 2, 1, 3])
        att = g.op("Reshape", [att, g.i64([0, 0, H * D])], naming.n("merge", i))
        x = g.op("Add", [x, proj(att, naming.w("o", i), naming.n("o_proj", i))], naming.n("attn_residual", i))
        h = rms(x, naming.w("mlp_norm", i), naming.n("mlp_norm", i))
        down = swiglu(g, proj, h, (naming.w("gate", i), naming.w("up", i), naming.w("down", i)), naming.n("mlp", i))
        x = g.op("Add", [x, down], naming.n("mlp_residual", i))
    return rms(x, naming.w("final_norm"), naming.n("final_norm"))


def gqa_layers(g: Graph, naming: Naming, x: str, *, n_layers: int, n_heads: int, n_kv_heads: int, head_dim: int,
               eps: float, proj: Proj, seqlens_k: str, total_sequence_length: str) -> str:
    """ONNX Runtime GenAI's decoder layers on the embedded ``x``: the first norm is ONNX
    RMSNormalization (ONNX Runtime registers SimplifiedLayerNormalization only in the ai.onnx
    domain, which onnx.checker rejects); each layer's GroupQueryAttention (rotary inside, the
    graph's ``rope.*_cache``) and a SkipSimplifiedLayerNormalization after attention and after the
    MLP, the last one being the final norm. Returns the final norm's output."""
    h = g.op("RMSNormalization", [x, naming.w("attn_norm", 0)], naming.n("attn_norm", 0), axis=-1,
             epsilon=float(eps), stash_type=1)
    for i in range(n_layers):
        q = proj(h, naming.w("q", i), naming.n("q_proj", i))
        k = proj(h, naming.w("k", i), naming.n("k_proj", i))
        v = proj(h, naming.w("v", i), naming.n("v_proj", i))
        att_name = naming.n("attention", i)
        att = g.op("GroupQueryAttention",
                   [q, k, v, f"past_key_values.{i}.key", f"past_key_values.{i}.value", seqlens_k,
                    total_sequence_length, "rope.cos_cache", "rope.sin_cache"], att_name,
                   outputs=[att_name, f"present.{i}.key", f"present.{i}.value"], domain=MS_DOMAIN,
                   num_heads=n_heads, kv_num_heads=n_kv_heads, do_rotary=1, rotary_interleaved=0,
                   scale=float(1.0 / np.sqrt(head_dim)))[0]
        o = proj(att, naming.w("o", i), naming.n("o_proj", i))
        norm = naming.n("mlp_norm", i)
        h, _, _, x = g.op("SkipSimplifiedLayerNormalization", [o, x, naming.w("mlp_norm", i)], norm,
                          outputs=[norm, "", "", naming.n("attn_residual", i)], domain=MS_DOMAIN, epsilon=float(eps))
        down = swiglu(g, proj, h, (naming.w("gate", i), naming.w("up", i), naming.w("down", i)), naming.n("mlp", i))
        last = i + 1 == n_layers
        gamma = naming.w("final_norm") if last else naming.w("attn_norm", i + 1)
        norm = naming.n("final_norm") if last else naming.n("attn_norm", i + 1)
        h, _, _, x = g.op("SkipSimplifiedLayerNormalization", [down, x, gamma], norm,
                          outputs=[norm, "", "", naming.n("mlp_residual", i)], domain=MS_DOMAIN, epsilon=float(eps))
    return h


# -- the forms' naming tables -------------------------------------------------------------------

def _table(prefix: str, names: Mapping[str, str]) -> dict[str, str]:
    return {role: (prefix + t if not t.startswith("=") else t[1:]) for role, t in names.items()}


_GOLDEN_WEIGHTS = _table("layers.{i}.", {
    "attn_norm": "attn_norm.weight", "q": "q_proj.weight", "k": "k_proj.weight", "v": "v_proj.weight",
    "o": "o_proj.weight", "mlp_norm": "mlp_norm.weight", "gate": "gate_proj.weight", "up": "up_proj.weight",
    "down": "down_proj.weight", "final_norm": "=norm.weight"})
_HF_WEIGHTS = _table("model.layers.{i}.", {
    "attn_norm": "input_layernorm.weight", "q": "self_attn.q_proj.weight", "k": "self_attn.k_proj.weight",
    "v": "self_attn.v_proj.weight", "o": "self_attn.o_proj.weight", "mlp_norm": "post_attention_layernorm.weight",
    "gate": "mlp.gate_proj.weight", "up": "mlp.up_proj.weight", "down": "mlp.down_proj.weight",
    "final_norm": "=model.norm.weight"})

_GOLDEN_NODES = _table("layers.{i}/", {
    "attn_norm": "attn_norm", "q_proj": "q_proj", "k_proj": "k_proj", "v_proj": "v_proj",
    "q_reshape": "q/reshape", "q_heads": "q", "k_reshape": "k/reshape", "k_heads": "k",
    "v_reshape": "v/reshape", "v_heads": "v", "q_rope": "q_rope", "k_rope": "k_rope", "attention": "attention",
    "merge_heads": "attention_t", "merge": "attention_merged", "o_proj": "o_proj", "attn_residual": "attn_residual",
    "mlp_norm": "mlp_norm", "mlp": "=layers.{i}", "mlp_residual": "mlp_residual", "final_norm": "=final_norm"})
_EXPORT_NODES = _table("layers.{i}/", {
    "attn_norm": "input_layernorm", "q_proj": "attn/q_proj", "k_proj": "attn/k_proj", "v_proj": "attn/v_proj",
    "q_reshape": "attn/q/reshape", "q_heads": "attn/q/transpose", "k_reshape": "attn/k/reshape",
    "k_heads": "attn/k/transpose", "v_reshape": "attn/v/reshape", "v_heads": "attn/v/transpose",
    "q_rope": "attn/q_rope", "k_rope": "attn/k_rope", "attention": "attn/attention",
    "merge_heads": "attn/merge_transpose", "merge": "attn/merge", "o_proj": "attn/o_proj",
    "attn_residual": "attn_residual", "mlp_norm": "post_attention_layernorm", "mlp": "mlp",
    "mlp_residual": "mlp_residual", "final_norm": "=norm"})

#: lockstep's golden models (``models/build.py``), every flavour.
GOLDEN = Naming(_GOLDEN_WEIGHTS, _GOLDEN_NODES)
#: ``build_llama_onnx(convention="optimum")``: Hugging Face names, the exporter's node names.
OPTIMUM = Naming(_HF_WEIGHTS, _EXPORT_NODES)
#: ``build_llama_onnx(convention="genai")``: as OPTIMUM, the attention node named ``attn/gqa``.
GENAI = Naming(_HF_WEIGHTS, {**_EXPORT_NODES, "attention": "layers.{i}/attn/gqa"})
