"""Find the first divergent node of an engine on a subject: its intermediate values exposed as
graph outputs (one run), or, where the engine cannot run that model or exposing its values changes
what it computes (a fusion that no longer fires), a bisection over the model's prefixes extracted as
models of their own (about log2(nodes) runs).

A decoder's prefill on an engine that declares its own decode session runs in that session (``runs``:
what the golden prefill lock runs, not ``prepare``); node cases, decode steps on the oracle's past,
bisections and the values of a session without ``values()`` run through ``prepare``.

Where the engine raises instead of producing values (``failure``), the result is that error, at a node:
the one its error names on the model as it is (exposing values changes what an engine's own type and
shape inference sees, so what runs once they are exposed does not say where the model fails), else the
first node whose prefix, extracted as a model, the engine fails on. In a bisection too, a prefix the
engine fails on is located as its error at the node it names (else the prefix's last node), never as a
value out of band at a later one.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

import numpy as np

from lockstep.engines.protocol import Unsupported, precision_of

from .failure import EngineFailure, failed_at, failure_line
from .graph import data_dependent, declared_types, exposed, extract, outer_reads
from .judge import Finding, Judged, Units, first_divergence, judge_values, units_for
from .oracle import LocateError, evaluate, widen_feeds, widened
from .runs import prefilled, prepared, through_session
from .subject import Subject

__all__ = ["Located", "locate", "Evaluations", "evaluations", "failure_line"]


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
    """What ``locate`` found: every judged value, the first divergent node (or None), how; or,
    where the engine raised instead of producing values, ``failure`` (``finding`` is then None)."""

    subject: Subject
    engine: str
    units: Units
    method: str                       # exposed | session-eager | session-capture | bisect | error
    judged: list[Judged]
    finding: Finding | None
    outputs: list[Judged]             # the graph outputs of the model as it is
    note: str = ""
    runs: int = 0
    evals: Evaluations | None = field(default=None, repr=False)
    failure: EngineFailure | None = None
    cache: Any = None                 # a decode session's first cache tensor out of band (caches.CacheFinding)

    @property
    def found(self) -> bool:
        """A node or a cache tensor was located: a divergent one, or a node the engine fails at."""
        return self.finding is not None or self.failure is not None or self.cache is not None

    def as_dict(self) -> dict[str, Any]:
        return {"subject": self.subject.label, "engine": self.engine, "precision": self.units.precision,
                "method": self.method, "runs": self.runs, "note": self.note,
                "compared": sum(j.status in ("in", "out") for j in self.judged),
                "out_of_band": sum(j.status == "out" for j in self.judged),
                "first_divergent_cache": self.cache.as_dict() if self.cache is not None else None,
                "first_divergent_node": self.finding.as_dict() if self.finding else None,
                "engine_error": self.failure.as_dict() if self.failure else None,
                "graph_outputs": [o.as_dict() for o in self.outputs],
                "values": [j.as_dict() for j in self.judged]}


def _frontier(model, k: int, values: dict[str, Any]) -> list[str]:
    """Tensors made by the first ``k`` nodes that later nodes read or that are graph outputs."""
    g = model.graph
    later = set().union(*(outer_reads(n) for n in g.node[k:])) if k < len(g.node) else set()
    later |= {o.name for o in g.output}
    return [o for n in g.node[:k] for o in n.output if o in later and isinstance(values.get(o), np.ndarray)]


def _prefix(engine, s: Subject, ev: Evaluations, units: Units, k: int) -> list[Judged] | tuple[Any, BaseException]:
    """The first ``k`` nodes extracted as a model, run through ``prepare``: their frontier judged, or the
    extracted model and what the engine raised on it."""
    outs = _frontier(s.model, k, ev.native)
    sub = extract(s.model, range(k), outs, ev.native, name=f"prefix-{k}", declared=declared_types(s.model))
    try:
        got = prepared(engine, sub, s.feeds)
        return judge_values(s.model, got, ev.native, ev.exact, units, only=set(outs))
    except Exception as exc:  # the engine fails on this prefix: located as its error
        return sub, exc


def _bisect(engine, s: Subject, ev: Evaluations, units: Units, why: str, end: int | None = None,
            seen: dict[int, list[Judged] | tuple[Any, BaseException]] | None = None,
            ) -> tuple[list[Judged], Finding | None, EngineFailure | None, int]:
    """The smallest prefix, of at most ``end`` nodes, whose frontier leaves its band or on which the
    engine fails, by bisection: (judged values, the divergent node or None, the failure or None, runs).
    ``seen``: prefixes already run, by length."""
    g = s.model.graph
    seen = dict(seen or {})
    ran = len(seen)

    def judged(k: int) -> list[Judged] | tuple[Any, BaseException]:
        if k not in seen:
            seen[k] = _prefix(engine, s, ev, units, k)
        return seen[k]

    def diverges(k: int) -> bool:
        got = judged(k)
        return isinstance(got, tuple) or any(j.status == "out" for j in got)

    lo, hi = 0, len(g.node) if end is None else end
    if not diverges(hi):
        return judged(hi), None, None, len(seen) - ran
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if diverges(mid):
            hi = mid
        else:
            lo = mid
    found = {j.name: j for j in (judged(lo) if lo else [])}
    last = judged(hi)
    if isinstance(last, tuple):  # the node its error names in the prefix, else the prefix's last node
        sub, exc = last
        failure = failed_at(sub, exc, f"named by its error on the model's first {hi} nodes extracted as a model")
        if failure.node is None:
            if hi == 1:
                raise LocateError(f"{engine.name} cannot run the model ({why}) nor its first node extracted as a "
                                  f"model ({failure_line(exc)})")
            node = g.node[hi - 1]
            failure = EngineFailure(failure.error, hi - 1, node.name, node.op_type,
                                    f"the first node whose prefix it fails on (it runs the first {lo}, fails on "
                                    f"the first {hi}, each extracted as a model)")
        return sorted(found.values(), key=lambda j: j.node), None, failure, len(seen) - ran
    found.update({j.name: j for j in last})
    values = sorted(found.values(), key=lambda j: j.node)
    return values, first_divergence(s.model, values, s.feeds), None, len(seen) - ran


def judging(engine, s: Subject, evals: Evaluations | None, say: Callable[[str], None]) -> tuple[Units, Evaluations]:
    """The unit roundoffs of the engine's declared precision for ``s`` and the oracle's evaluations."""
    try:
        precision = precision_of(engine, s.dtype)
    except Unsupported:
        precision = None
    say("oracle: the reference evaluator in the model's precision and in float64")
    return units_for(precision, s.dtype), evals or evaluations(s)


def _bisected(engine, s: Subject, ev: Evaluations, units: Units, why: str, outputs: list[Judged], runs: int,
              say: Callable[[str], None], raised: BaseException | None = None, end: int | None = None,
              seen: dict | None = None) -> Located:
    say(f"{engine.name}: bisecting over extracted prefixes ({why})")
    judged, finding, failure, n = _bisect(engine, s, ev, units, why, end, seen)
    if raised is not None and finding is None and failure is None:  # it fails on the model, on no prefix
        failure = EngineFailure(failure_line(raised, 1000), None,
                                how="its error names no node, and it runs every prefix extracted as a model")
    return Located(s, engine.name, units, "bisect", judged, finding, outputs, note=why, runs=runs + n, evals=ev,
                   failure=failure)


def _named(engine, s: Subject, ev: Evaluations, units: Units, failure: EngineFailure,
           say: Callable[[str], None]) -> Located:
    """The node the engine's error names, unless a value before it is already out of its band (a run-time
    failure on a wrong input, a shape): the nodes before it, extracted as a model, are judged (one run; a
    failure of the engine on them proves nothing, as an extraction changes what its inference sees)."""
    k = failure.node
    before = _prefix(engine, s, ev, units, k) if k else []
    if isinstance(before, tuple) or not any(j.status == "out" for j in before):
        return Located(s, engine.name, units, "error", before if isinstance(before, list) else [], None, [],
                       note="it fails on the model itself", runs=2 if k else 1, evals=ev, failure=failure)
    why = (f"it fails on the model itself at {failure.label} ({failure.op_type}) on values already out of band "
           f"before it: {failure.error[:300]}")
    return _bisected(engine, s, ev, units, why, [], 2, say, end=k, seen={k: before})


def locate(engine, s: Subject, *, evals: Evaluations | None = None,
           progress: Callable[[str], None] | None = None) -> Located:
    """Run ``engine`` on ``s`` and find its first divergent node, or the node it fails at (module
    docstring). Raises ``LocateError`` where the engine declares ``s`` unsupported."""
    say = progress or (lambda _m: None)
    units, ev = judging(engine, s, evals, say)
    outputs = {o.name for o in s.model.graph.output}
    session = through_session(engine, s)
    inside = " in its decode session" if session else ""
    say(f"{engine.name}: the model as it is{inside}")
    try:
        plain = prefilled(engine, s.model, s.decode, values=False) if session else prepared(engine, s.model, s.feeds)
    except Unsupported as exc:
        raise LocateError(f"{engine.name} cannot run {s.label}: {exc}") from None
    except Exception as exc:  # it raises on the model itself: at the node its error names, else bisected
        failure = failed_at(s.model, exc, f"named by its error on the model itself{inside}")
        if failure.node is None:
            why = f"it fails on the model itself{inside}: {failure_line(exc)}"
            return _bisected(engine, s, ev, units, why, [], 1, say, raised=exc)
        return _named(engine, s, ev, units, failure, say)
    # the graph outputs it returned (a decode session keeps its presents)
    final = judge_values(s.model, plain, ev.native, ev.exact, units, only=outputs & set(plain))
    diverges = any(j.status == "out" for j in final)
    # a session builds its own feeds (a mask of its cache's width): only the values the step computes from
    # its data, of symbolic shapes, as ``locate_in_session`` exposes them
    m, _ = exposed(s.model, ev.native, symbolic=True, only=data_dependent(s.model.graph)) if session else \
        exposed(s.model, ev.native)
    say(f"{engine.name}: the model with its {len(m.graph.output) - len(outputs)} intermediate values exposed{inside}")
    why, method, note = "", "exposed", ""
    try:
        values = prefilled(engine, m, s.decode, values=True) if session else prepared(engine, m, s.feeds)
        if session and values is not None:
            method, note = "session-eager", f"eager decode session: prefill of {len(s.decode.context)}"
        elif session:  # its session returns no values: the intermediate values through prepare
            note = "its decode session returns no values(): the logits from it, the values through prepare"
            values = prepared(engine, exposed(s.model, ev.native)[0], s.feeds)
    except Exception as exc:
        values, why = None, f"it refused: {failure_line(exc)}"
    if values is not None:
        judged = judge_values(s.model, values, ev.native, ev.exact, units)
        finding = first_divergence(s.model, judged, s.feeds)
        if finding is not None or not diverges:
            return Located(s, engine.name, units, method, judged, finding, final, note=note, runs=2, evals=ev)
        why = "exposing them hides the divergence of the graph's outputs (a fusion that no longer fires?)"
    if session:
        why += "; the prefixes through prepare"
    return _bisected(engine, s, ev, units, why, final, 2, say)
