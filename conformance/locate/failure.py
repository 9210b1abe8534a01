"""When the engine raises instead of producing values: the node its error names, and its first line.

An engine's own type or shape inference runs when it loads a model, and what it infers depends on
the model around a node: exposing a value as a graph output declares its type and shape, which can
mend the inference that failed (or break another). So an engine's failure on the model is located
at the node its error names where it names one (nxrt: ``node N ("name", op '::Op', ...)`` or
``node "name"``; ONNX Runtime: ``Node (name)``, ``Name:'name'``, ``In Node, ("name", Op, ...)``), not
by what runs once values are exposed; a failure that names none is located at the first node whose
prefix, extracted as a model of its own, the engine fails on (``search``). Either way it is said as an
error (``EngineFailure``), never as a value out of its band.
"""

from __future__ import annotations

import re
from dataclasses import asdict, dataclass
from typing import Any

import onnx

from lockstep.engines.refusal import first_line

__all__ = ["EngineFailure", "failure_line", "named_node", "failed_at"]

# (regex, group of the node's name, group of its index or None, group of its op or None)
_NAMED = (
    (re.compile(r"""node (\d+) \("((?:[^"\\]|\\.)*)", op '([^']*)'"""), 2, 1, 3),  # nxrt's executor
    (re.compile(r'node "([^"]+)"'), 1, None, None),                                 # nxrt's load refusals
    (re.compile(r"Node \(([^)]*)\)(?: Op \((\w+)\))?"), 1, None, 2),                # ONNX Runtime at load
    (re.compile(r"Name:'([^']*)'"), 1, None, None),                                 # ONNX Runtime at run
    (re.compile(r'In Node, \("([^"]*)", (\w+)'), 1, None, 2),                       # ONNX Runtime's checker
)


def failure_line(exc: BaseException, limit: int = 300) -> str:
    """``Type: the first line of its message`` (at most ``limit`` characters of it)."""
    return f"{type(exc).__name__}: {first_line(exc, limit)}"


def _texts(exc: BaseException) -> list[str]:
    """The messages of ``exc`` and of the exceptions it was raised from (an engine's wrapper keeps the
    runtime's own message as its cause)."""
    out, seen = [], set()
    e: BaseException | None = exc
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        out.append(str(e))
        e = e.__cause__ or e.__context__
    return out


def named_node(model: onnx.ModelProto, exc: BaseException | str) -> int | None:
    """The index, in ``model``'s top graph, of the node the engine's error names (by name; by index
    where the name is empty and the node there is of the op named), or None."""
    nodes = list(model.graph.node)
    by_name: dict[str, int] = {}
    for i, n in enumerate(nodes):
        if n.name:
            by_name.setdefault(n.name, i)
    for text in ([exc] if isinstance(exc, str) else _texts(exc)):
        for pattern, name_group, index_group, op_group in _NAMED:
            for m in pattern.finditer(text):
                name = m.group(name_group)
                if name in by_name:
                    return by_name[name]
                op = (m.group(op_group) or "").rsplit(":", 1)[-1] if op_group else ""
                if not name and index_group and op:
                    i = int(m.group(index_group))
                    if i < len(nodes) and nodes[i].op_type == op:
                        return i
    return None


@dataclass
class EngineFailure:
    """The engine raised instead of producing values: at ``node`` (graph order; None where neither its
    error nor a prefix names one), ``how`` it was found, and the engine's error in one line."""

    error: str                 # "EngineError: nxrt-cpu: run: ..." (failure_line)
    node: int | None
    name: str = ""
    op_type: str = ""
    how: str = ""              # "named by its error", "the first node whose prefix it fails on", ...

    @property
    def label(self) -> str:
        return self.name or (f"#{self.node}" if self.node is not None else "")

    def as_dict(self) -> dict[str, Any]:
        return {**asdict(self), "label": self.label}


def failed_at(model: onnx.ModelProto, exc: BaseException, how: str = "named by its error") -> EngineFailure:
    """``exc``'s failure, at the node its error names in ``model`` (``node`` None where it names none)."""
    i = named_node(model, exc)
    if i is None:
        return EngineFailure(failure_line(exc, 1000), None)
    n = model.graph.node[i]
    return EngineFailure(failure_line(exc, 1000), i, n.name, n.op_type, how)
