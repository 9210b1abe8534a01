"""The minimal failing subgraph of a located divergence, written as an ONNX backend node case.

From the first divergent node, windows of the nodes before it are extracted (the node alone, then
1, 2, 4, ... nodes before it, then the smallest failing size between the last two) until one
reproduces the divergence on the engine by itself: its inputs are the float64 oracle's values
rounded to the model's types, its outputs the divergent node's. The folder holds ``model.onnx``,
``test_data_set_0/input_<i>.pb`` and ``output_<i>.pb`` (the float64 oracle's outputs in the model's
types) and ``data.json`` (``rtol``, ``atol``: the band, which onnx's loader reads; provenance under
``lockstep``): lockstep's node harness (``lockstep cases --cases-dir``, ``pytest --lockstep-cases-dir``)
and ONNX Runtime's ``onnx_test_runner`` run it.

Where the engine raised instead of producing values (``Located.failure``), the case is the node it
fails at alone (its inputs the oracle's values), written when the engine fails on it alone too (so it
can be filed upstream); a node that runs alone is said so, and nothing is written (the failure
depends on the model around it: its type or shape inference there).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import numpy as np
import onnx
from onnx import numpy_helper

from lockstep.paths import atomic_write

from .graph import extract
from .judge import judge_values
from .oracle import LocateError
from .search import Located, locate
from .subject import Subject

__all__ = ["Reduced", "reduce_to_case", "write_case"]


@dataclass
class Reduced:
    subject: Subject
    located: Located | None   # None: nothing to write (``note`` says why)
    first_node: int           # index in the original model of the window's first node
    nodes: int
    tries: int
    note: str = ""
    bands: dict[str, float] | None = None  # each output's band where ``located`` judged none (a failure)


def _target(s: Subject, located: Located) -> tuple[int, str, list[str]]:
    """The located node's index, name and the outputs a case of it checks."""
    f = located.finding
    if f is not None:
        return f.node, f.name, [j.name for j in f.outputs if j.status == "out"] or [j.name for j in f.outputs]
    node = s.model.graph.node[located.failure.node]
    outs = [o for o in node.output if o and isinstance(located.evals.native.get(o), np.ndarray)]
    return located.failure.node, located.failure.label, outs


def _window(s: Subject, located: Located, start: int) -> Subject:
    ev = located.evals
    end, name, outs = _target(s, located)
    model = s.model
    sub = extract(model, range(start, end + 1), outs, ev.native, name=f"{name}-reduced")
    init = {t.name for t in sub.graph.initializer}
    feeds: dict[str, Any] = {}
    for vi in sub.graph.input:
        if vi.name in init:
            continue
        if vi.name in s.feeds:
            feeds[vi.name] = s.feeds[vi.name]
        else:  # an intermediate value: the exact one, in the model's type
            feeds[vi.name] = np.asarray(ev.exact[vi.name]).astype(np.asarray(ev.native[vi.name]).dtype)
    n = end + 1 - start
    return Subject(f"{n} node(s) ending at {name}", sub, feeds, s.dtype)


def _alone(engine, s: Subject, located: Located, say: Callable[[str], None]) -> Reduced:
    """The node the engine fails at, alone: written where it fails alone too."""
    f = located.failure
    if f.node is None:
        return Reduced(s, None, -1, 0, 0, f"no node to reduce: {engine.name}'s error names none ({f.how})")
    w = _window(s, located, f.node)
    say(f"reduce: {w.label}")
    try:
        got = locate(engine, w)
    except LocateError as exc:
        return Reduced(w, None, f.node, 1, 1, f"{f.label} alone: {exc}")
    if got.failure is not None:
        outs = {vi.name for vi in w.model.graph.output}
        ev = got.evals
        judged = judge_values(w.model, {o: ev.native[o] for o in outs}, ev.native, ev.exact, got.units, only=outs)
        return Reduced(w, got, f.node, 1, 1, f"{engine.name} fails on {f.label} alone too: {got.failure.error}",
                       {j.name: j.band for j in judged})
    if got.finding is not None:
        return Reduced(w, got, f.node, 1, 1, f"{f.label} alone runs on {engine.name} but leaves its band")
    return Reduced(w, None, f.node, 1, 1, f"{f.label} alone runs on {engine.name}, inside its band: the failure "
                                          "depends on the model around it (its type or shape inference there)")


def reduce_to_case(engine, s: Subject, located: Located, progress: Callable[[str], None] | None = None) -> Reduced:
    """The smallest window before (and including) the first divergent node that diverges alone; for a
    node the engine fails at, that node alone (``located`` None where it runs alone: ``note``)."""
    say = progress or (lambda _m: None)
    if located.failure is not None and located.evals is not None:
        return _alone(engine, s, located, say)
    if located.finding is None or located.evals is None:
        raise LocateError("nothing to reduce: no divergent node was located")
    i = located.finding.node
    tries = 0
    cache: dict[int, Located | None] = {}

    def fails(start: int) -> Located | None:
        nonlocal tries
        if start not in cache:
            tries += 1
            w = _window(s, located, start)
            say(f"reduce: {w.label}")
            try:
                got = locate(engine, w)
            except LocateError:
                got = None
            cache[start] = got if got is not None and got.finding is not None else None
        return cache[start]

    clean, step = i + 1, 1
    start = i
    while fails(start) is None:
        if start == 0:
            raise LocateError(f"the divergence at {located.finding.name} does not reproduce in any subgraph that "
                              "ends there (it needs more than the nodes before it: the engine's state, or a "
                              "graph-wide rewrite)")
        clean, start, step = start, max(0, i - step), step * 2
    while clean - start > 1:  # the largest failing start between the failing one and the last clean one
        mid = (start + clean) // 2
        if fails(mid) is not None:
            start = mid
        else:
            clean = mid
    return Reduced(_window(s, located, start), cache[start], start, i + 1 - start, tries)


def _tensor(name: str, value: np.ndarray) -> onnx.TensorProto:
    return numpy_helper.from_array(np.asarray(value), name)


def _standalone(model: onnx.ModelProto, out: Path) -> onnx.ModelProto:
    """``model`` as a node-case folder at ``out`` holds it: initializers kept in the source model's
    external data files (a large model's, ``lockstep.loading``) read in, the source's mark dropped;
    past 1 GiB of them, written to ``out``/model.onnx.data instead (1 KiB and up). The model itself
    when it has none."""
    from lockstep.loading import with_weights
    from lockstep.model_source import SOURCE_KEY

    m = with_weights(model)
    if m is model:
        return model
    keep = [(p.key, p.value) for p in m.metadata_props if p.key != SOURCE_KEY]
    del m.metadata_props[:]
    for key, value in keep:
        m.metadata_props.add(key=key, value=value)
    if sum(len(t.raw_data) for t in m.graph.initializer) <= 1 << 30:
        return m
    from onnx.external_data_helper import convert_model_to_external_data, write_external_data_tensors

    (out / "model.onnx.data").unlink(missing_ok=True)  # (written by appending)
    convert_model_to_external_data(m, all_tensors_to_one_file=True, location="model.onnx.data", size_threshold=1024)
    return write_external_data_tensors(m, str(out))


def write_case(out: Path, reduced: Reduced, *, engine: str, command: str) -> Path:
    """The reduced subject as a node-case folder at ``out`` (files written atomically)."""
    s, loc = reduced.subject, reduced.located
    ev = loc.evals
    data = out / "test_data_set_0"
    data.mkdir(parents=True, exist_ok=True)
    atomic_write(out / "model.onnx", _standalone(s.model, out).SerializeToString())
    init = {t.name for t in s.model.graph.initializer}
    names = [vi.name for vi in s.model.graph.input if vi.name not in init]
    for k, name in enumerate(names):
        atomic_write(data / f"input_{k}.pb", _tensor(name, s.feeds[name]).SerializeToString())
    bands = reduced.bands or {j.name: j.band for j in loc.judged}
    for k, vi in enumerate(s.model.graph.output):
        want = np.asarray(ev.exact[vi.name]).astype(np.asarray(ev.native[vi.name]).dtype)
        atomic_write(data / f"output_{k}.pb", _tensor(vi.name, want).SerializeToString())
    f = loc.finding or loc.failure
    name = f.name if loc.finding is not None else s.model.graph.node[-1].name or f.label
    meta = {"rtol": 0.0, "atol": max(bands.get(vi.name, 0.0) for vi in s.model.graph.output),
            "lockstep": {"node": name, "op_type": f.op_type, "engine": engine, "nodes": reduced.nodes,
                         "located_with": command,
                         "expected": "the float64 oracle's outputs rounded to the model's types; atol is the "
                                     "error model's band of the located node's output"}}
    if loc.failure is not None:
        meta["lockstep"]["engine_error"] = loc.failure.error
    atomic_write(out / "data.json", json.dumps(meta, indent=1) + "\n")
    return out
