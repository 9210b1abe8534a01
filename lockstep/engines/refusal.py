"""Unsupported or error: the rule an engine follows when it does not produce outputs, and its helpers.

The rule. ``Unsupported`` is a statement about the engine that holds whatever model surrounds the
node: an operator (domain, opset version) it has no kernel for, an element type, an attribute value,
or a capability (graph capture, sequence values) it does not implement. It is a counted skip where
the engine's expectations record it, a failure where they do not (fail closed). Anything else an
engine raises is an error: a failed type or shape inference, a refusal of a node that it runs in
another model, an internal error, a crash. An error is the engine's failure until shown otherwise,
recorded (a strict xfail) like a wrong value, and counted apart from wrong values (results outside
the tolerance or band: ``AssertionError``) in the summary and the report.

Runtimes report both as text, so an engine maps its runtime's messages to the rule:
- ``Refusals``: a table of regular expressions over a runtime's error messages that mean "no kernel,
  type or capability", each with the reason to report; a message that matches none is an error.
- ``alone``: a refusal that names one node is checked by loading that node alone (a one-node model,
  its inputs typed as the whole model's inference types them, its attributes as they are). If the
  engine loads the node alone, the refusal depended on the model around it (a runtime's own type or
  shape inference gone wrong, reported as "unsupported operator"): ``confirm`` turns it into an
  ``EngineError``. A model of one node is its own probe.

``EngineError`` names the engine, the phase (load, run) and the runtime's first line.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Callable, Iterable

import onnx

from lockstep.errors import LockstepError

from .protocol import Unsupported

__all__ = ["EngineError", "Refusals", "alone", "confirm", "first_line", "types_of"]

SMALL_INITIALIZER = 4096  # bytes: a probe keeps smaller initializers as constants (shapes, axes, indices)


class EngineError(LockstepError, RuntimeError):
    """An engine failed on something it does not declare unsupported: an error, counted apart from
    wrong values. The message names the engine, the phase and the runtime's own words."""


def first_line(exc: BaseException | str, limit: int = 400) -> str:
    """The first non-empty line of an error's text, cut at ``limit`` characters."""
    text = str(exc)
    line = next((s.strip() for s in text.splitlines() if s.strip()), "")
    return line if len(line) <= limit else line[:limit] + "..."


@dataclass(frozen=True)
class Refusals:
    """Which of a runtime's error messages mean Unsupported: ``(regex, reason)`` pairs, the first
    that matches wins. ``reason`` may use the match's groups (``{0}``, ``{op}``)."""

    table: tuple[tuple[str, str], ...]

    def reason(self, message: str) -> str | None:
        """The Unsupported reason of ``message``, or None (an error)."""
        for pattern, reason in self.table:
            m = re.search(pattern, message, re.IGNORECASE | re.DOTALL)
            if m:
                return reason.format(m.group(0), *m.groups(), **m.groupdict())
        return None


def types_of(model: onnx.ModelProto) -> dict[str, onnx.TypeProto]:
    """Every value's type as onnx infers it (declared ones first), for probes' inputs: through
    ``lockstep.inference.infer`` (contained: a model that crashes onnx's inference is a named error,
    not a dead process; the model uninferred where inference says nothing)."""
    from lockstep.errors import ModelError
    from lockstep.inference import infer

    try:
        inferred = infer(model)
    except ModelError:
        inferred = model
    g = inferred.graph
    out = {v.name: v.type for v in [*g.value_info, *g.input, *g.output]}
    for t in g.initializer:
        out.setdefault(t.name, onnx.helper.make_tensor_type_proto(t.data_type, list(t.dims)))
    return out


def alone(model: onnx.ModelProto, node: onnx.NodeProto,
          types: dict[str, onnx.TypeProto] | None = None) -> onnx.ModelProto | None:
    """A model of ``node`` alone: its inputs graph inputs of the types the whole model's inference
    gives them (small initializers kept as constants), its outputs graph outputs typed as inferred
    (untyped where inference says nothing); the
    model's opsets, IR version and functions. None where an input's type is unknown or the node holds
    a subgraph (its outer-scope values cannot be typed here). ``types``: ``types_of(model)``, when the
    caller probes several nodes of one model."""
    if any(a.type in (onnx.AttributeProto.GRAPH, onnx.AttributeProto.GRAPHS) for a in node.attribute):
        return None
    types = types_of(model) if types is None else types
    inits = {t.name: t for t in model.graph.initializer}
    inputs, kept = [], []
    for name in dict.fromkeys(i for i in node.input if i):
        t = inits.get(name)
        if (t is not None and t.data_location != onnx.TensorProto.EXTERNAL
                and len(t.SerializeToString()) <= SMALL_INITIALIZER):  # (external data: typed as an input)
            kept.append(t)
        elif name in types and types[name].HasField("tensor_type") and types[name].tensor_type.elem_type:
            inputs.append(onnx.helper.make_value_info(name, types[name]))
        else:
            return None
    outputs = [onnx.helper.make_value_info(o, types[o] if o in types else onnx.TypeProto()) for o in node.output if o]
    graph = onnx.helper.make_graph([node], "alone", inputs, outputs, initializer=kept)
    probe = onnx.helper.make_model(graph, opset_imports=list(model.opset_import), ir_version=model.ir_version)
    probe.functions.extend(model.functions)
    return probe


def find_node(model: onnx.ModelProto, *, name: str | None = None, op_type: str | None = None) -> onnx.NodeProto | None:
    """The main graph's node named ``name`` (else the only node of ``op_type``)."""
    nodes = list(model.graph.node)
    if name:
        hit = [n for n in nodes if n.name == name]
        if len(hit) == 1:
            return hit[0]
    if op_type:
        hit = [n for n in nodes if n.op_type == op_type]
        if len(hit) == 1:
            return hit[0]
    return None


def _signature(node: onnx.NodeProto) -> bytes:
    """Nodes of one op with equal attributes probe alike (their inputs' types aside): one probe each."""
    return node.op_type.encode() + node.domain.encode() + b"".join(a.SerializeToString() for a in node.attribute)


def confirm(engine_name: str, reason: str, model: onnx.ModelProto, nodes: Iterable[onnx.NodeProto],
            load: Callable[[onnx.ModelProto], object], runtime_message: str,
            limit: int = 16) -> Unsupported | EngineError:
    """The rule for a refusal naming ``nodes``: ``Unsupported`` if one of them is refused alone too
    (``load`` raises on its one-node model: a missing kernel, whose absence may make the runtime
    decline its neighbours as well), the reason then naming the operators refused alone; also
    ``Unsupported(reason)`` where a node cannot be probed; ``EngineError`` if the engine loads every
    one of them alone. A model of one node is its own probe: the engine's word stands. At most
    ``limit`` probes (nodes of one op with equal attributes probe once)."""
    nodes = list(nodes)
    if len(model.graph.node) <= 1 or not nodes:
        return Unsupported(f"{engine_name}: {reason}")
    loads, refused, unprobed, seen = [], [], False, set()
    types = types_of(model)  # one inference for every probe
    for node in nodes:
        key = _signature(node)
        if key in seen:
            continue
        seen.add(key)
        probe = alone(model, node, types) if len(seen) <= limit else None
        if probe is None:
            unprobed = True
            continue
        try:
            load(probe)
        except Exception:
            refused.append(node)
            continue
        loads.append(f"{node.op_type} {node.name!r}" if node.name else node.op_type)
    if refused:
        ops = sorted({f"{n.domain or 'ai.onnx'}::{n.op_type}" for n in refused})
        others = len(nodes) - sum(1 for n in nodes if _signature(n) in {_signature(r) for r in refused})
        beside = f"; {others} other declined node(s) load alone" if others else ""
        return Unsupported(f"{engine_name}: declines {', '.join(ops)}, alone too (no kernel, or an input, type or "
                           f"attribute of theirs it does not take{beside})")
    if unprobed:
        return Unsupported(f"{engine_name}: {reason}")
    return EngineError(
        f"{engine_name}: refuses {', '.join(loads)} in this model ({first_line(runtime_message, 300)}) but loads "
        f"{'it' if len(loads) == 1 else 'each'} alone with the same input types: the refusal depends on the model "
        f"around it (an error, not a missing kernel)")
