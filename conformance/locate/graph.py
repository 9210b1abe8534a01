"""What ``locate`` needs of a graph: node order, each value's depth and reduction length, the graph
with its intermediate values exposed as outputs, and subgraphs extracted as models of their own.

Only the top-level graph's nodes are located: a node with a subgraph (If, Loop, Scan) counts as one
node, and the values its body reads from outside are found so an extracted subgraph keeps them.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Iterable, Mapping

import numpy as np
import onnx
from onnx import helper

__all__ = ["Depth", "depths", "data_dependent", "node_outputs", "exposed", "extract", "elem_type", "outer_reads", "declared_types"]

# ops that move, select or reinterpret values without rounding them: they add no depth
_EXACT = frozenset({
    "Reshape", "Transpose", "Squeeze", "Unsqueeze", "Identity", "Flatten", "Expand", "Concat", "Slice", "Gather",
    "GatherElements", "GatherND", "Split", "Tile", "Shape", "Size", "Pad", "Where", "Max", "Min", "ReduceMax",
    "ReduceMin", "Relu", "Neg", "Abs", "Equal", "Less", "LessOrEqual", "Greater", "GreaterOrEqual", "Not", "And",
    "Or", "ConstantOfShape", "Constant", "Range", "ScatterND", "ScatterElements", "DepthToSpace", "SpaceToDepth",
    "TopK", "ArgMax", "ArgMin", "NonZero", "Trilu", "MaxPool",
})
_NORMS = frozenset({"RMSNormalization", "LayerNormalization", "SimplifiedLayerNormalization",
                    "SkipSimplifiedLayerNormalization", "SkipLayerNormalization", "GroupNormalization",
                    "InstanceNormalization"})
_ATTENTION = frozenset({"Attention", "GroupQueryAttention", "MultiHeadAttention", "PackedAttention"})


@dataclass(frozen=True)
class Depth:
    """A value's place in the error model: ``depth`` roundings on the longest path from the graph's
    inputs (moves and selections add none) and ``k``, the longest reduction on the way."""

    depth: int
    k: int


def _attr(node: onnx.NodeProto, name: str, default=None):
    for a in node.attribute:
        if a.name == name:
            return helper.get_attribute_value(a)
    return default


def _shape(values: Mapping[str, np.ndarray], name: str) -> tuple[int, ...]:
    v = values.get(name)
    return tuple(np.shape(v)) if v is not None and not isinstance(v, (list, type(None))) else ()


def reduction_length(node: onnx.NodeProto, values: Mapping[str, np.ndarray]) -> int:
    """The length of the longest sum ``node`` computes (1 for an elementwise op)."""
    op = node.op_type
    x = _shape(values, node.input[0]) if node.input else ()
    if op in ("MatMul", "MatMulInteger", "FusedMatMul"):
        return x[-1] if x else 1
    if op == "Gemm":
        return (x[0] if _attr(node, "transA", 0) else x[-1]) if x else 1
    if op == "MatMulNBits":
        return int(_attr(node, "K", 1))
    if op in ("Softmax", "LogSoftmax", "Hardmax"):
        return x[_attr(node, "axis", -1)] if x else 1
    if op.startswith("Reduce") or op in ("GlobalAveragePool", "Einsum", "CumSum"):
        out = _shape(values, node.output[0])
        return max(1, math.prod(x) // max(1, math.prod(out))) if x else 1
    if op in _NORMS:
        axis = _attr(node, "axis", -1)
        return math.prod(x[axis:]) if x else 1
    if op in _ATTENTION:
        head = x[-1] if x else 1
        heads = _attr(node, "num_heads", 0)
        if heads and len(x) == 3:
            head = x[-1] // heads
        keys = max([_shape(values, o)[-2] for o in node.output[1:] if len(_shape(values, o)) == 4] or [1])
        return max(head, keys, *(x[-2:-1] if len(x) == 4 else ()))
    if op in ("Conv", "ConvTranspose"):
        w = _shape(values, node.input[1]) if len(node.input) > 1 else ()
        return math.prod(w[1:]) if w else 1
    return 1


def outer_reads(node: onnx.NodeProto) -> set[str]:
    """Every value ``node`` reads: its inputs and, for a node with a subgraph, the outer values the
    body names without defining them."""
    reads = {i for i in node.input if i}
    for a in node.attribute:
        for g in ([a.g] if a.type == onnx.AttributeProto.GRAPH else list(a.graphs)):
            defined = {i.name for i in g.input} | {t.name for t in g.initializer}
            for n in g.node:
                defined.update(o for o in n.output if o)
            for n in g.node:
                reads.update(r for r in outer_reads(n) if r not in defined)
    return reads


def depths(graph: onnx.GraphProto, values: Mapping[str, np.ndarray]) -> dict[str, Depth]:
    """Each node output's ``Depth``, from the graph's node order (ONNX requires it topological)."""
    out: dict[str, Depth] = {}
    for node in graph.node:
        ins = [out[i] for i in outer_reads(node) if i in out]
        d = max((x.depth for x in ins), default=0) + (0 if node.op_type in _EXACT else 1)
        k = max([reduction_length(node, values), *(x.k for x in ins)])
        for o in node.output:
            if o:
                out[o] = Depth(d, k)
    return out


def data_dependent(graph: onnx.GraphProto) -> set[str]:
    """The values that depend on the data of the graph's inputs (not only on initializers, constants or
    the inputs' shapes): what a step computes. The rest an engine may fold into constants when it
    loads the model (ONNX Runtime copies such a folded output at each run, which a CUDA graph cannot)."""
    inits = {t.name for t in graph.initializer}
    dep = {i.name for i in graph.input if i.name not in inits}
    for n in graph.node:
        if n.op_type not in ("Shape", "Size") and outer_reads(n) & dep:
            dep.update(o for o in n.output if o)
    return dep


def node_outputs(graph: onnx.GraphProto) -> list[tuple[int, onnx.NodeProto, str]]:
    """(node index, node, output name) for every named output of every node, in node order."""
    return [(i, n, o) for i, n in enumerate(graph.node) for o in n.output if o]


def elem_type(value) -> int | None:
    """The ONNX tensor type of an array, or None for what is not a tensor (a sequence, None)."""
    if not isinstance(value, np.ndarray):
        return None
    try:
        return helper.np_dtype_to_tensor_dtype(value.dtype)
    except (KeyError, TypeError, ValueError):
        return None


def _typed(name: str, value, declared: Mapping[str, onnx.ValueInfoProto] | None = None) -> onnx.ValueInfoProto:
    """A value's type: as ``declared`` (a model's own graph inputs, whose symbolic dimensions keep an
    engine from folding what the model would not let it fold) where that has the value's type and
    rank, else the value's own type and shape (an intermediate's ``value_info`` can name dimensions
    that are not what a step feeds, and an engine holds a model to them)."""
    vi = (declared or {}).get(name)
    if vi is not None and vi.type.HasField("tensor_type"):
        tt = vi.type.tensor_type
        if tt.elem_type == elem_type(value) and tt.HasField("shape") and len(tt.shape.dim) == np.ndim(value):
            out = onnx.ValueInfoProto()
            out.CopyFrom(vi)
            return out
    return helper.make_tensor_value_info(name, elem_type(value), list(np.shape(value)))


def declared_types(model: onnx.ModelProto) -> dict[str, onnx.ValueInfoProto]:
    """The model's graph inputs by name (``_typed``'s ``declared``)."""
    return {vi.name: vi for vi in model.graph.input}


def exposed(model: onnx.ModelProto, values: Mapping[str, np.ndarray], *, symbolic: bool = False,
            only: set[str] | None = None) -> tuple[onnx.ModelProto, list[str]]:
    """``model`` with every node output that is a tensor in ``values`` also a graph output (typed and
    shaped from the value: the onnx checker wants a shape), and the names of all its outputs in order.
    ``symbolic``: the exposed outputs of unknown dimensions (a decode session runs the model on steps of
    other widths than the one ``values`` comes from; shape inference gives the engine their dims).
    ``only``: expose just these values."""
    m = onnx.ModelProto()
    m.CopyFrom(model)
    g = m.graph
    known = {o.name for o in g.output}
    for _, _, name in node_outputs(g):
        if name not in known and elem_type(values.get(name)) is not None and (only is None or name in only):
            shape = [None] * np.ndim(values[name]) if symbolic else list(np.shape(values[name]))
            g.output.append(helper.make_tensor_value_info(name, elem_type(values[name]), shape))
            known.add(name)
    return m, [o.name for o in g.output]


def extract(model: onnx.ModelProto, nodes: Iterable[int], outputs: list[str], values: Mapping[str, np.ndarray],
            name: str = "located", declared: Mapping[str, onnx.ValueInfoProto] | None = None) -> onnx.ModelProto:
    """The nodes at the indices ``nodes`` (kept in graph order) as a model of their own: what they read
    and no node among them makes is a graph input unless it is an initializer, which is kept;
    ``outputs`` are its outputs. Types as ``declared`` (``declared_types``: the model's inputs keep
    their symbolic dimensions, so an engine folds no more than in the model) else from ``values``."""
    g = model.graph
    picked = [g.node[i] for i in sorted(set(nodes))]
    made = {o for n in picked for o in n.output if o}
    reads = set().union(*(outer_reads(n) for n in picked)) if picked else set()
    inits = [t for t in g.initializer if t.name in reads and t.name not in made]
    init_names = {t.name for t in inits}
    order = [v for n in picked for v in n.input if v] + sorted(reads)
    declared = declared_types(model) if declared is None else declared
    inputs, seen = [], set()
    for v in order:
        if v in reads and v not in made and v not in init_names and v not in seen:
            seen.add(v)
            inputs.append(_typed(v, values[v], declared))
    graph = helper.make_graph(picked, name, inputs, [_typed(o, values[o]) for o in outputs], inits)
    m = helper.make_model(graph, opset_imports=list(model.opset_import), ir_version=model.ir_version)
    m.functions.extend(model.functions)
    if any(t.data_location == onnx.TensorProto.EXTERNAL for t in inits):  # its weights' folder: the model's
        from lockstep.model_source import SOURCE_KEY

        m.metadata_props.extend(p for p in model.metadata_props if p.key == SOURCE_KEY)
    return m
