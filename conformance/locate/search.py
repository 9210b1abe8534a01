"""Find the first divergent node of an engine on a subject: its intermediate values exposed as
graph outputs (one run), or, where the engine cannot run that model or exposing its values changes
what it computes (a fusion that no longer fires), a bisection over the model's prefixes extracted as
models of their own (about log2(nodes) runs)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

import numpy as np

from lockstep.engines.protocol import Unsupported, precision_of

from .graph import declared_types, exposed, extract, outer_reads
from .judge import Finding, Judged, Units, first_divergence, judge_values, units_for
from .oracle import LocateError, evaluate, widen_feeds, widened
from .subject import Subject

__all__ = ["Located", "locate", "Evaluations", "evaluations"]


@dataclass
class Evaluations:
    """The oracle's two evaluations of a subject: in the model's precision and in float64."""

    native: dict[str, Any]
    exact: dict[str, Any]


def evaluations(s: Subject) -> Evaluations:
    return Evaluations(evaluate(s.model, s.feeds, where="in the model's precision"),
                       evaluate(widened(s.model), widen_feeds(s.feeds), where="float64"))


@dataclass
class Located:
    """What ``locate`` found: every judged value, the first divergent node (or None), how."""

    subject: Subject
    engine: str
    units: Units
    method: str                       # exposed | bisect
    judged: list[Judged]
    finding: Finding | None
    outputs: list[Judged]             # the graph outputs of the model as it is
    note: str = ""
    runs: int = 0
    evals: Evaluations | None = field(default=None, repr=False)

    def as_dict(self) -> dict[str, Any]:
        return {"subject": self.subject.label, "engine": self.engine, "precision": self.units.precision,
                "method": self.method, "runs": self.runs, "note": self.note,
                "compared": sum(j.status in ("in", "out") for j in self.judged),
                "out_of_band": sum(j.status == "out" for j in self.judged),
                "first_divergent_node": self.finding.as_dict() if self.finding else None,
                "graph_outputs": [o.as_dict() for o in self.outputs],
                "values": [j.as_dict() for j in self.judged]}


def failure_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()[0][:300] if str(exc).strip() else ""
    return f"{type(exc).__name__}: {text}"


def _run(engine, model, feeds: dict[str, Any]) -> dict[str, Any]:
    names = [o.name for o in model.graph.output]
    init = {t.name for t in model.graph.initializer}
    wanted = {i.name for i in model.graph.input if i.name not in init}
    outs = engine.prepare(model)({k: v for k, v in feeds.items() if k in wanted})
    if len(outs) != len(names):
        raise LocateError(f"{engine.name} returned {len(outs)} outputs for the model's {len(names)}")
    return dict(zip(names, outs))


def _frontier(model, k: int, values: dict[str, Any]) -> list[str]:
    """Tensors made by the first ``k`` nodes that later nodes read or that are graph outputs."""
    g = model.graph
    later = set().union(*(outer_reads(n) for n in g.node[k:])) if k < len(g.node) else set()
    later |= {o.name for o in g.output}
    return [o for n in g.node[:k] for o in n.output if o in later and isinstance(values.get(o), np.ndarray)]


def _bisect(engine, s: Subject, ev: Evaluations, units: Units, why: str) -> tuple[list[Judged], Finding | None, int]:
    """The smallest prefix whose frontier leaves its band (or on which the engine fails), by bisection."""
    g = s.model.graph
    seen: dict[int, list[Judged] | str] = {}
    declared = declared_types(s.model)

    def judged(k: int) -> list[Judged] | str:
        if k not in seen:
            outs = _frontier(s.model, k, ev.native)
            sub = extract(s.model, range(k), outs, ev.native, name=f"prefix-{k}", declared=declared)
            try:
                got = _run(engine, sub, s.feeds)
                seen[k] = judge_values(s.model, got, ev.native, ev.exact, units, only=set(outs))
            except Exception as exc:  # a failure of the engine on a prefix: the divergence is in it
                seen[k] = failure_line(exc)
        return seen[k]

    def diverges(k: int) -> bool:
        got = judged(k)
        return isinstance(got, str) or any(j.status == "out" for j in got)

    lo, hi = 0, len(g.node)
    if not diverges(hi):
        return judged(hi), None, len(seen)
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if diverges(mid):
            hi = mid
        else:
            lo = mid
    if hi == 1 and isinstance(judged(1), str):
        raise LocateError(f"{engine.name} cannot run the model with its values exposed ({why}) nor its first node "
                          f"extracted as a model ({judged(1)})")
    found = {j.name: j for j in (judged(lo) if lo else [])}
    last = judged(hi)
    if isinstance(last, str):  # the engine fails once node hi-1 is in: that node is where it breaks
        node = g.node[hi - 1]
        for o in (o for o in node.output if o):
            found[o] = Judged(o, hi - 1, node.name or f"#{hi - 1}", node.op_type, "?", 0, 0, float("inf"), 0.0,
                              0.0, "out", f"the engine fails on the model's first {hi} nodes: {last}")
    else:
        found.update({j.name: j for j in last})
    values = sorted(found.values(), key=lambda j: j.node)
    return values, first_divergence(s.model, values, s.feeds), len(seen)


def judging(engine, s: Subject, evals: Evaluations | None, say: Callable[[str], None]) -> tuple[Units, Evaluations]:
    """The unit roundoffs of the engine's declared precision for ``s`` and the oracle's evaluations."""
    try:
        precision = precision_of(engine, s.dtype)
    except Unsupported:
        precision = None
    say("oracle: the reference evaluator in the model's precision and in float64")
    return units_for(precision, s.dtype), evals or evaluations(s)


def locate(engine, s: Subject, *, evals: Evaluations | None = None,
           progress: Callable[[str], None] | None = None) -> Located:
    """Run ``engine`` on ``s`` and find its first divergent node (module docstring)."""
    say = progress or (lambda _m: None)
    units, ev = judging(engine, s, evals, say)
    outputs = {o.name for o in s.model.graph.output}
    say(f"{engine.name}: the model as it is")
    try:
        plain = _run(engine, s.model, s.feeds)
    except Unsupported as exc:
        raise LocateError(f"{engine.name} cannot run {s.label}: {exc}") from None
    except Exception as exc:  # it fails on the model itself: bisection finds the node it fails at
        why = f"it fails on the model itself: {failure_line(exc)}"
        say(f"{engine.name}: bisecting over extracted prefixes ({why})")
        judged, finding, runs = _bisect(engine, s, ev, units, why)
        return Located(s, engine.name, units, "bisect", judged, finding, [], note=why, runs=runs + 1, evals=ev)
    final = judge_values(s.model, plain, ev.native, ev.exact, units, only=outputs)
    diverges = any(j.status == "out" for j in final)
    m, _ = exposed(s.model, ev.native)
    say(f"{engine.name}: the model with its {len(m.graph.output) - len(outputs)} intermediate values exposed")
    why = ""
    try:
        values = _run(engine, m, s.feeds)
    except Exception as exc:
        values, why = None, f"it refused: {failure_line(exc)}"
    if values is not None:
        judged = judge_values(s.model, values, ev.native, ev.exact, units)
        finding = first_divergence(s.model, judged, s.feeds)
        if finding is not None or not diverges:
            return Located(s, engine.name, units, "exposed", judged, finding, final, runs=2, evals=ev)
        why = "exposing them hides the divergence of the graph's outputs (a fusion that no longer fires?)"
    say(f"{engine.name}: bisecting over extracted prefixes ({why})")
    judged, finding, runs = _bisect(engine, s, ev, units, why)
    return Located(s, engine.name, units, "bisect", judged, finding, final, note=why, runs=runs + 2, evals=ev)
