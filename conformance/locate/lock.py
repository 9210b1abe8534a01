"""A failing golden lock or tripwire, located: the suite calls ``for_lock`` when a lock breaks, and
the failure message names the first divergent node (and the one command that locates it again);
the report's plot of that lock draws every value's error against its band by depth."""

from __future__ import annotations

import math
from typing import Any

from lockstep.engines.registry import spec_of

from .command import command_line
from .oracle import LocateError
from .search import Located, locate
from .subject import golden_subject

__all__ = ["AUTO_BYTES", "for_lock", "plot_data"]

AUTO_BYTES = 64 << 20  # models up to this size are located in the failing test itself (seconds); larger ones named


def plot_data(loc: Located, model: str, mode: str, position: int | None) -> dict[str, Any]:
    """What the report's locate plot needs (``lockstep.conformance.plots.locate_plots``)."""
    f = loc.finding
    return {"model": model, "engine": loc.engine, "mode": mode, "position": position,
            "precision": loc.units.precision,
            "first": {"name": f.name, "op_type": f.op_type, "node": f.node} if f else None,
            "points": [[j.depth, j.error if math.isfinite(j.error) else None, j.band, j.status, j.node]
                       for j in loc.judged if j.status in ("in", "out") and j.band == j.band]}


def for_lock(engine, gm, position: int | None, mode: str, golden_dirs=()) -> tuple[str, dict[str, Any] | None]:
    """(a sentence for the failure message, the plot's data or None) for a lock of ``gm`` that breaks
    at ``position`` (None: the prefill)."""
    try:
        s = golden_subject(gm, position, list(golden_dirs))
    except Exception as exc:  # the message of a failing lock must not turn into another error
        return f"locate: cannot build its feeds ({type(exc).__name__}: {exc})", None
    cmd = command_line(s.args, spec_of(engine))
    if gm.model_path().stat().st_size > AUTO_BYTES:
        return f"locate its first divergent node: {cmd}", None
    try:
        loc = locate(engine, s)
    except LocateError as exc:
        return f"locate: {exc} ({cmd})", None
    except Exception as exc:
        return f"locate: {type(exc).__name__}: {exc} ({cmd})", None
    data = plot_data(loc, gm.name, mode, position)
    if loc.failure is not None:
        f = loc.failure
        where = f"at node {f.label} ({f.op_type})" if f.node is not None else "at no node its error names"
        return f"{engine.name} raises instead of producing values, {where}: {f.error}: {cmd}", data
    if loc.finding is None and position is not None:
        in_session = _in_session(engine, s, loc.evals)
        if in_session:
            return in_session, data
    if loc.finding is None:
        session = (f"; through its decode session: {command_line(s.args, spec_of(engine), 'eager')}"
                   if position is not None else "")
        if loc.method.startswith("session"):
            return (f"no node leaves its band in {engine.name}'s decode session's prefill with its values exposed "
                    f"(exposing them may hide it): {cmd}"), data
        return (f"no node leaves its band when {engine.name} runs the graph through prepare (the divergence is "
                f"in its decode session, not in its graph execution): {cmd}{session}"), data
    f = loc.finding.as_dict()
    err = f["max_abs_error"]
    return (f"first divergent node: {f['name']} ({f['op_type']}), error {err if isinstance(err, str) else f'{err:.3g}'} "
            f"against a band of {f['band']:.3g}, {f['downstream_out_of_band']} of the nodes it feeds also out: "
            f"{cmd}"), data


def _in_session(engine, s, evals) -> str:
    """Where ``prepare`` runs every node of the step in band, the step through the engine's own
    decode session (its cache handling), on the oracle's evaluations ``locate`` already made: the
    first cache fed out of band or node, as a sentence;
    "" when it finds nothing, the engine declares no session, or it cannot be run so."""
    from lockstep.engines.protocol import capabilities

    from .session import locate_in_session

    if capabilities(engine).decoder is None:
        return ""  # lockstep's own host session over prepare: nothing of the engine's between the steps
    cmd = command_line(s.args, spec_of(engine), "eager")
    try:
        loc = locate_in_session(engine, s, "eager", evals=evals)
    except Exception:  # noqa: BLE001 - the message of a failing lock must not turn into another error
        return ""
    if loc.cache is not None:
        c = loc.cache
        return (f"no node leaves its band through prepare; in {engine.name}'s decode session the first divergent "
                f"cache is {c.tensor}, fed to {c.call}: row {c.row} of {c.rows} out of band (error {c.error:.3g}, "
                f"band {c.band:.3g}): its cache handling between the steps: {cmd}")
    if loc.finding is not None:
        f = loc.finding.as_dict()
        return (f"no node leaves its band through prepare; in {engine.name}'s decode session the first divergent "
                f"node is {f['name']} ({f['op_type']}): {cmd}")
    return ""
