"""Each value an engine computes, against the float64 oracle and a band from the error model.

A float value's error is the largest absolute difference from the float64 oracle over its elements
(a NaN or an infinity where the oracle has another value is an infinite error). Its band is the
larger of

- the error model of the golden locks (``lockstep.golden.anchors``) for one value:
  ``KAPPA * sqrt(depth) * (u_s + u_o + sqrt(K) * u_a) * scale``, with ``depth`` the roundings on the
  longest path from the inputs, ``K`` the longest reduction on the way, ``(u_s, u_o, u_a)`` the unit
  roundoffs of the engine's declared precision (``lockstep.engines.PRECISIONS``; storage no finer
  than the value's own type) and ``scale`` the value's largest finite magnitude;
- ``MEASURED`` times the error of onnx's reference evaluator computing the model in its own
  precision (the baseline a careful implementation makes, which carries what the error model cannot
  see: cancellation, an exponential's amplification).

A non-float value (indices, masks, shapes) must equal the oracle's, unless onnx's evaluator in the
model's precision computes another one too (a comparison flipped by rounding): then it is not judged.
The first divergent node is the first node, in graph order, one of whose outputs leaves its band;
its inputs are then inside theirs (they come before it).
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Any, Mapping

import numpy as np
import onnx

from lockstep.engines.protocol import PRECISIONS
from lockstep.golden.anchors import UNIT_ROUNDOFF

from .graph import Depth, depths, node_outputs, outer_reads

__all__ = ["KAPPA", "MEASURED", "Judged", "Units", "judge_values", "units_for"]

KAPPA = 8.0      # headroom of the error model for the largest of a tensor's elements
MEASURED = 8.0   # times the reference evaluator's own error in the model's precision
_U = {**UNIT_ROUNDOFF, "float64": 2.0**-53}


@dataclass(frozen=True)
class Units:
    """Unit roundoffs of a precision: activation storage, product operands, accumulation."""

    precision: str
    storage: float
    operand: float
    accum: float


def units_for(precision: str | None, dtype: str) -> Units:
    """The precision's unit roundoffs; with none declared, the model's own type for all three."""
    if precision is None or precision not in PRECISIONS:
        u = _U.get(dtype, _U["float32"])
        return Units(precision or dtype, u, u, u)
    s, o, a = PRECISIONS[precision]
    return Units(precision, _U[s], _U[o], _U[a])


@dataclass
class Judged:
    """One value: where it comes from, its error against the float64 oracle and its band."""

    name: str
    node: int                  # index of the producing node in the graph
    node_name: str
    op_type: str
    dtype: str
    depth: int
    k: int
    error: float               # max |engine - float64 oracle| (inf: a NaN/inf mismatch or another shape)
    band: float
    scale: float               # max finite |float64 oracle|
    status: str                # in | out | unjudged | missing
    why: str = ""              # for out/unjudged/missing: what was seen
    rel: float = 0.0           # error / scale

    def as_dict(self) -> dict[str, Any]:
        d = asdict(self)
        for k in ("error", "band", "scale", "rel"):
            v = d[k]
            d[k] = None if v is None else (v if math.isfinite(v) else "inf") if isinstance(v, float) else v
        return d


def _finite_max(a: np.ndarray) -> float:
    f = a[np.isfinite(a)]
    return float(np.max(np.abs(f))) if f.size else 0.0


def float_error(got: np.ndarray, ref: np.ndarray) -> tuple[float, str]:
    """Max |got - ref| over the elements (both as float64), inf where their NaNs or infinities differ."""
    g, r = np.asarray(got, np.float64), np.asarray(ref, np.float64)
    if g.shape != r.shape:
        return math.inf, f"shape {list(g.shape)} where the oracle's is {list(r.shape)}"
    same = (g == r) | (np.isnan(g) & np.isnan(r))
    both = np.isfinite(g) & np.isfinite(r)
    bad = ~same & ~both
    if bad.any():
        i = tuple(int(x) for x in np.argwhere(bad)[0])
        return math.inf, f"{int(bad.sum())} element(s) {g[i]} where the oracle has {r[i]} (first at {list(i)})"
    if not both.any():
        return 0.0, ""
    return float(np.max(np.abs(g[both] - r[both]))), ""


def _value_band(units: Units, dt: str, d: Depth, scale: float, baseline: float) -> float:
    u_s = max(units.storage, _U.get(dt, units.storage))
    u_o = units.operand if units.operand > u_s else 0.0
    model = KAPPA * math.sqrt(max(d.depth, 1)) * (u_s + u_o + math.sqrt(d.k) * units.accum) * scale
    return max(model, MEASURED * baseline)


def judge_values(model: onnx.ModelProto, engine_values: Mapping[str, Any], native: Mapping[str, Any],
                 exact: Mapping[str, Any], units: Units, only: set[str] | None = None) -> list[Judged]:
    """Every node output of ``model`` (those in ``only``, when given) that the engine returned, judged."""
    dep = depths(model.graph, exact)
    out: list[Judged] = []
    for i, node, name in node_outputs(model.graph):
        if only is not None and name not in only:
            continue
        ref = exact.get(name)
        if not isinstance(ref, np.ndarray):
            continue  # sequences, optionals: not located
        got, nat = engine_values.get(name), native.get(name)
        base = dict(name=name, node=i, node_name=node.name or f"#{i}", op_type=node.op_type, depth=dep[name].depth,
                    k=dep[name].k)
        if not isinstance(got, np.ndarray):
            out.append(Judged(**base, dtype=str(np.asarray(nat).dtype) if nat is not None else "?", error=math.nan,
                              band=math.nan, scale=0.0, status="missing", why="the engine did not return it"))
            continue
        dt = np.dtype(got.dtype).name
        if got.dtype.kind in "fc" and ref.dtype.kind in "fc":
            scale = _finite_max(ref.astype(np.float64))
            err, why = float_error(got, ref)
            b_err, _ = float_error(nat, ref) if isinstance(nat, np.ndarray) else (0.0, "")
            band = _value_band(units, dt, dep[name], scale, b_err)
            if math.isinf(b_err) and math.isinf(err):
                same, _ = float_error(got, nat) if isinstance(nat, np.ndarray) else (math.inf, "")
                status = "unjudged" if same <= band or math.isinf(band) else "out"
                why = why + "; the reference evaluator in the model's precision does the same" if status == "unjudged" else why
            else:
                status = "in" if err <= band else "out"
            out.append(Judged(**base, dtype=dt, error=err, band=band, scale=scale, status=status, why=why,
                              rel=err / scale if scale else (0.0 if err == 0 else math.inf)))
            continue
        equal = got.shape == ref.shape and np.array_equal(got, ref)
        if equal:
            out.append(Judged(**base, dtype=dt, error=0.0, band=0.0, scale=0.0, status="in"))
            continue
        flipped = isinstance(nat, np.ndarray) and not np.array_equal(nat, ref)
        if flipped and got.shape == nat.shape and np.array_equal(got, nat):
            out.append(Judged(**base, dtype=dt, error=math.inf, band=0.0, scale=0.0, status="unjudged",
                              why="the reference evaluator in the model's precision computes the same"))
            continue
        why = (f"shape {list(got.shape)} where the oracle's is {list(ref.shape)}" if got.shape != ref.shape
               else f"{int(np.sum(got != ref))} of {got.size} element(s) differ")
        out.append(Judged(**base, dtype=dt, error=math.inf, band=0.0, scale=0.0, status="out", why=why))
    return out


@dataclass
class Finding:
    """The first divergent node and what surrounds it."""

    node: int
    name: str
    op_type: str
    outputs: list[Judged]
    inputs: list[dict[str, Any]]
    downstream: int            # later nodes, fed by it, whose outputs also leave their band
    later: int                 # nodes fed by it that were judged

    def as_dict(self) -> dict[str, Any]:
        worst = max(self.outputs, key=lambda j: (j.status == "out", j.error if j.error == j.error else -1))
        return {"name": self.name, "op_type": self.op_type, "index": self.node, "output": worst.name,
                "max_abs_error": worst.as_dict()["error"], "max_rel_error": worst.as_dict()["rel"],
                "band": worst.band, "depth": worst.depth, "reduction": worst.k, "why": worst.why,
                "outputs": [o.as_dict() for o in self.outputs], "inputs": self.inputs,
                "downstream_out_of_band": self.downstream, "downstream_judged": self.later}


def _descendants(graph: onnx.GraphProto, start: int) -> set[int]:
    made: set[str] = {o for o in graph.node[start].output if o}
    found: set[int] = set()
    for j in range(start + 1, len(graph.node)):
        if outer_reads(graph.node[j]) & made:
            found.add(j)
            made.update(o for o in graph.node[j].output if o)
    return found


def first_divergence(model: onnx.ModelProto, judged: list[Judged], feeds: Mapping[str, Any]) -> Finding | None:
    """The first node with an output out of its band (``None`` when every judged value is inside)."""
    out = [j for j in judged if j.status == "out"]
    if not out:
        return None
    g = model.graph
    first = min(j.node for j in out)
    node = g.node[first]
    by_name = {j.name: j for j in judged}
    inits = {t.name for t in g.initializer}
    inputs = []
    for name in [i for i in node.input if i]:
        if name in by_name:
            j = by_name[name]
            inputs.append({"name": name, "from": f"{j.node_name} ({j.op_type})", "status": j.status,
                           "error": j.as_dict()["error"], "band": j.band})
        else:
            inputs.append({"name": name, "from": "initializer" if name in inits else "graph input" if name in feeds
                           else "not compared", "status": "exact" if name in inits or name in feeds else "unknown"})
    later = _descendants(g, first)
    out_nodes = {j.node for j in out}
    judged_nodes = {j.node for j in judged}
    return Finding(first, node.name or f"#{first}", node.op_type, [j for j in judged if j.node == first], inputs,
                   len(later & out_nodes), len(later & judged_nodes))
