"""Symbolic dimensions at load time: which dims are the same, and which derive from which.

onnx's shape inference (with data propagation, run contained by ``inference.infer``) names what it can; this module interns every
symbolic dim into a ``Symbol`` object (same name, same object) and records provenance: a symbol
first appearing on a node's output derives from the symbols on that node's inputs. The record is
conservative (a derived symbol lists every input symbol of its producer, an over-approximation),
which is the safe direction for the capture classifier: a dim that *might* grow with the KV length
is treated as growing. Dims onnx cannot name become anonymous symbols ``value:axis`` with the same
provenance; graph-input dims are roots.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import onnx

__all__ = ["Symbol", "symbolic_shapes"]

Dim = "int | Symbol"


@dataclass(frozen=True, eq=False)
class Symbol:
    """A symbolic dimension; compare with ``is``. ``derived_from`` lists its direct parents."""

    name: str
    derived_from: frozenset["Symbol"] = field(default=frozenset())
    producer: str = ""  # the node that introduced it; "" for a graph input

    @property
    def is_root(self) -> bool:
        return not self.derived_from

    def roots(self) -> frozenset["Symbol"]:
        """The graph-input symbols this one ultimately derives from (itself, for a root). Computed once
        per symbol: provenance is a DAG whose paths multiply (a model with its intermediate values
        exposed as outputs, as ``lockstep locate --session`` runs it, took 270 million calls for one
        classification without it)."""
        cached = self.__dict__.get("_roots")
        if cached is None:
            if self.is_root:
                cached = frozenset({self})
            else:
                out: set[Symbol] = set()
                for p in self.derived_from:
                    out |= p.roots()
                cached = frozenset(out)
            object.__setattr__(self, "_roots", cached)  # frozen: provenance never changes once made
        return cached

    def __repr__(self) -> str:
        if self.is_root:
            return f"Symbol({self.name!r})"
        return f"Symbol({self.name!r} <- {sorted(s.name for s in self.derived_from)})"


def _raw_dims(vi: onnx.ValueInfoProto) -> list[int | str | None] | None:
    if not vi.type.HasField("tensor_type") or not vi.type.tensor_type.HasField("shape"):
        return None
    out: list[int | str | None] = []
    for d in vi.type.tensor_type.shape.dim:
        out.append(int(d.dim_value) if d.HasField("dim_value") else (d.dim_param if d.HasField("dim_param") else None))
    return out


def symbolic_shapes(model: onnx.ModelProto, *, checked: bool = False
                    ) -> tuple[dict[str, Symbol], dict[str, tuple[int | Symbol, ...]]]:
    """Symbols by name and each value's dims. onnx's inference runs contained (``inference.infer``):
    a model it crashes on, or that makes it run away, is a ``ModelError``. ``checked``: the model
    passed ``load_model``'s checks (``check_for_inference`` need not run again)."""
    from lockstep.contrib_shapes import complete
    from lockstep.inference import infer

    # onnx's pass, then the shapes it leaves out downstream of ONNX Runtime's contrib ops
    inferred = complete(model, infer(model, checked=checked))
    g = inferred.graph
    raw = {vi.name: dims for vi in [*g.input, *g.value_info, *g.output] if (dims := _raw_dims(vi)) is not None}
    symbols: dict[str, Symbol] = {}
    shapes: dict[str, tuple[int | Symbol, ...]] = {}

    def resolve(value: str, parents: frozenset[Symbol], producer: str) -> None:
        dims: list[int | Symbol] = []
        for axis, d in enumerate(raw[value]):
            if isinstance(d, int):
                dims.append(d)
                continue
            name = d if d else f"{value}:{axis}"
            if name not in symbols:
                symbols[name] = Symbol(name, parents, producer)
            dims.append(symbols[name])
        shapes[value] = tuple(dims)

    for vi in g.input:
        if vi.name in raw:
            resolve(vi.name, frozenset(), "")
    for i, node in enumerate(g.node):
        parents = frozenset(d for name in node.input if name in shapes for d in shapes[name] if isinstance(d, Symbol))
        for out in node.output:
            if out and out in raw and out not in shapes:
                resolve(out, parents, node.name or f"{node.op_type}_{i}")
    return symbols, shapes
