"""Shapes onnx's inference leaves out downstream of ONNX Runtime's contrib ops.

onnx knows no ``com.microsoft`` schema, so its inference gives no shape to a contrib op's outputs,
and none to anything computed from them: in an int4 export every node after the first
``MatMulNBits`` (751 of SmolLM2-int4's 773) had no shape, and the capture planner could not admit
one ("unresolved shape"). ``complete(model, inferred)`` walks the graph once in order after onnx's
pass: a contrib op in ``RULES`` gets its outputs' shapes from its inputs' (the op's documented
shape contract in ONNX Runtime's ContribOperators.md), and a standard node left without shapes is
inferred again, alone, by onnx's own schema (``infer_node_outputs``) now that its inputs have them,
with the constant inputs (initializers, Constant nodes) given as data. What neither can say stays
without a shape (the planner keeps it eager: fail-safe). A dim either gives without a name is a new
symbol derived from the node's inputs (``reference_runtime.symbols``), so a dim computed from a
growing one is growing too.
"""

from __future__ import annotations

from typing import Callable

import onnx
from onnx import TypeProto, helper

__all__ = ["RULES", "complete"]

Dims = list  # a shape as onnx dims: int, a dim_param str, or None (unknown)


def _dims(t: TypeProto) -> Dims | None:
    if not t.HasField("tensor_type") or not t.tensor_type.HasField("shape"):
        return None
    return [d.dim_value if d.HasField("dim_value") else (d.dim_param or None) for d in t.tensor_type.shape.dim]


def _attr(node: onnx.NodeProto, name: str, default=None):
    for a in node.attribute:
        if a.name == name:
            return helper.get_attribute_value(a)
    return default


def _same(i: int = 0) -> Callable:
    return lambda node, shapes: [shapes[i]]


def _matmul_nbits(node, shapes):
    a = shapes[0]
    return [None if a is None else [*a[:-1], int(_attr(node, "N"))]]


def _skip_norm(node, shapes):
    x = shapes[0]
    if x is None:
        return [None]
    stat = [*x[:-1], 1]
    return [x, stat, stat, x]  # output, mean, inv_std_var, input_skip_bias_sum


def _gqa(node, shapes):
    q = shapes[0]
    if q is None:
        return [None]
    heads, kv_heads = int(_attr(node, "num_heads")), int(_attr(node, "kv_num_heads"))
    packed = len(node.input) < 2 or not node.input[1]
    hidden = q[-1]
    if not isinstance(hidden, int):
        return [None]
    head = hidden // (heads + 2 * kv_heads) if packed else hidden // heads
    out = [[*q[:-1], heads * head]]
    # present_key/value: the past's shape where the past and present share one buffer (fixed
    # capacity); a growing cache's length is past + new, which only values say: left unresolved
    share = len(node.input) > 4 and node.input[3] and shapes[3] is not None and all(isinstance(d, int) for d in shapes[3][2:3])
    out += [shapes[3], shapes[4] if len(shapes) > 4 else None] if share else [None, None]
    return out


# (domain, op type) -> rule(node, input shapes) -> output shapes (None: not said); the output dtype is
# the first input's
RULES: dict[tuple[str, str], Callable] = {
    ("com.microsoft", "MatMulNBits"): _matmul_nbits,
    ("com.microsoft", "SkipSimplifiedLayerNormalization"): _skip_norm,
    ("com.microsoft", "SkipLayerNormalization"): _skip_norm,
    ("com.microsoft", "SimplifiedLayerNormalization"): _same(),
    ("", "SimplifiedLayerNormalization"): _same(),
    ("com.microsoft", "RotaryEmbedding"): _same(),
    ("com.microsoft", "QuickGelu"): _same(),
    ("com.microsoft", "FastGelu"): _same(),
    ("com.microsoft", "BiasGelu"): _same(),
    ("com.microsoft", "Gelu"): _same(),
    ("com.microsoft", "GroupQueryAttention"): _gqa,
}


def _type(elem: int, dims: Dims) -> TypeProto:
    return helper.make_tensor_type_proto(elem, dims)


def complete(model: onnx.ModelProto, inferred: onnx.ModelProto) -> onnx.ModelProto:
    """``inferred`` (onnx's pass over ``model``) with value infos added for the outputs it left
    without a shape downstream of contrib ops (see the module's docstring). ``inferred`` itself when
    the graph holds no contrib op of ``RULES``."""
    g = model.graph
    if not any((n.domain if n.domain != "ai.onnx" else "", n.op_type) in RULES for n in g.node):
        return inferred
    types: dict[str, TypeProto] = {}
    for vi in [*inferred.graph.input, *inferred.graph.value_info, *inferred.graph.output, *g.input]:
        if vi.name not in types and _dims(vi.type) is not None:
            types[vi.name] = vi.type
    data: dict[str, onnx.TensorProto] = {t.name: t for t in g.initializer}
    for t in g.initializer:
        types.setdefault(t.name, _type(t.data_type, list(t.dims)))
    opsets = {o.domain or "": o.version for o in model.opset_import}
    added: list[onnx.ValueInfoProto] = []
    for node in g.node:
        if node.op_type == "Constant":
            value = next((a.t for a in node.attribute if a.name == "value"), None)
            if value is not None and node.output:
                data[node.output[0]] = value
                types.setdefault(node.output[0], _type(value.data_type, list(value.dims)))
            continue
        outs = [o for o in node.output if o]
        if not outs or all(o in types for o in outs):
            continue
        domain = node.domain if node.domain != "ai.onnx" else ""
        got: dict[str, TypeProto] = {}
        rule = RULES.get((domain, node.op_type))
        if rule is not None:
            first = types.get(node.input[0]) if node.input else None
            if first is None:
                continue
            shapes = [_dims(types[i]) if i and i in types else None for i in node.input]
            for o, dims in zip(node.output, rule(node, shapes)):
                if o and dims is not None:
                    got[o] = _type(first.tensor_type.elem_type, dims)
        elif domain == "" and all(i in types for i in node.input if i):
            try:
                schema = onnx.defs.get_schema(node.op_type, opsets.get("", 1), "")
                ins = {i: types[i] for i in node.input if i}
                got = onnx.shape_inference.infer_node_outputs(
                    schema, node, ins, {i: data[i] for i in node.input if i in data},
                    opset_imports=list(model.opset_import), ir_version=model.ir_version or onnx.IR_VERSION)
            except Exception:  # noqa: BLE001 - onnx refuses or cannot say: the output stays unresolved
                got = {}
        for o, t in got.items():
            if o in types or _dims(t) is None:
                continue
            types[o] = t
            added.append(helper.make_value_info(o, t))
    if not added:
        return inferred
    out = onnx.ModelProto()
    out.CopyFrom(inferred)
    out.graph.value_info.extend(added)
    return out
