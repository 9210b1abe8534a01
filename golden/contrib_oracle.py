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
- onnx's ``RMSNormalization`` and ``LayerNormalization`` in their ``stash_type``
  (``lockstep.golden.oracle_norms``: onnx 1.23's reference computes them in the input's type);
- ``QuickGelu`` (Optimum's O2: ``x * sigmoid(alpha * x)``);
- ``RotaryEmbedding``, ``MultiHeadAttention`` (the builder's fp16 CPU graphs), ``MatMulNBits`` and
  ``GatherBlockQuantized`` (its int4 graphs): the dequantized weights in float64, whatever
  ``accuracy_level`` lets ONNX Runtime approximate (the near-tie band covers that: ``anchors``).

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

import onnx
from onnx.reference.op_run import OpRun

from .contrib_oracle_attention import GroupQueryAttention, MultiHeadAttention, RotaryEmbedding
from .oracle_norms import NORM_OPS
from .contrib_oracle_ops import (
    GatherBlockQuantized,
    MatMulNBits,
    OracleUnsupported,
    QuickGelu,
    SimplifiedLayerNormalization,
    SkipSimplifiedLayerNormalization,
    _node_name,
)

__all__ = ["CONTRIB_OPS", "OracleUnsupported", "check_supported", "contrib_ops"]


# --------------------------------------------------------------------------------------------------
# the registry

def _in_domain(cls: type, domain: str) -> type:
    return type(cls.__name__, (cls,), {"op_domain": domain, "__doc__": cls.__doc__})


_MS = [GroupQueryAttention, SkipSimplifiedLayerNormalization, QuickGelu, RotaryEmbedding, MultiHeadAttention,
       MatMulNBits, GatherBlockQuantized]
# ONNX Runtime registers SimplifiedLayerNormalization in the default domain (where GenAI's builder and
# Optimum's O2 write it) and SkipSimplifiedLayerNormalization in com.microsoft; each is accepted in both.
# onnx's own RMSNormalization and LayerNormalization, computed in their stash type (lockstep.golden.oracle_norms)
CONTRIB_OPS: list[type[OpRun]] = [*_MS, SimplifiedLayerNormalization,
                                  _in_domain(SimplifiedLayerNormalization, "com.microsoft"),
                                  _in_domain(SkipSimplifiedLayerNormalization, ""), *NORM_OPS]


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
