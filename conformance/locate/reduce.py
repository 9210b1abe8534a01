"""The minimal failing subgraph of a located divergence, written as an ONNX backend node case.

From the first divergent node, windows of the nodes before it are extracted (the node alone, then
1, 2, 4, ... nodes before it, then the smallest failing size between the last two) until one
reproduces the divergence on the engine by itself: its inputs are the float64 oracle's values
rounded to the model's types, its outputs the divergent node's. The folder holds ``model.onnx``,
``test_data_set_0/input_<i>.pb`` and ``output_<i>.pb`` (the float64 oracle's outputs in the model's
types) and ``data.json`` (``rtol``, ``atol``: the band, which onnx's loader reads; provenance under
``lockstep``): lockstep's node harness (``lockstep cases --cases-dir``, ``pytest --lockstep-cases-dir``)
and ONNX Runtime's ``onnx_test_runner`` run it.
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
from .oracle import LocateError
from .search import Located, locate
from .subject import Subject

__all__ = ["Reduced", "reduce_to_case", "write_case"]


@dataclass
class Reduced:
    subject: Subject
    located: Located
    first_node: int           # index in the original model of the window's first node
    nodes: int
    tries: int


def _window(s: Subject, located: Located, start: int) -> Subject:
    ev = located.evals
    f = located.finding
    model = s.model
    outs = [j.name for j in f.outputs if j.status == "out"] or [j.name for j in f.outputs]
    sub = extract(model, range(start, f.node + 1), outs, ev.native, name=f"{f.name}-reduced")
    init = {t.name for t in sub.graph.initializer}
    feeds: dict[str, Any] = {}
    for vi in sub.graph.input:
        if vi.name in init:
            continue
        if vi.name in s.feeds:
            feeds[vi.name] = s.feeds[vi.name]
        else:  # an intermediate value: the exact one, in the model's type
            feeds[vi.name] = np.asarray(ev.exact[vi.name]).astype(np.asarray(ev.native[vi.name]).dtype)
    n = f.node + 1 - start
    return Subject(f"{n} node(s) ending at {f.name}", sub, feeds, s.dtype)


def reduce_to_case(engine, s: Subject, located: Located, progress: Callable[[str], None] | None = None) -> Reduced:
    """The smallest window before (and including) the first divergent node that diverges alone."""
    if located.finding is None or located.evals is None:
        raise LocateError("nothing to reduce: no divergent node was located")
    say = progress or (lambda _m: None)
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


def write_case(out: Path, reduced: Reduced, *, engine: str, command: str) -> Path:
    """The reduced subject as a node-case folder at ``out`` (files written atomically)."""
    s, loc = reduced.subject, reduced.located
    ev = loc.evals
    data = out / "test_data_set_0"
    data.mkdir(parents=True, exist_ok=True)
    atomic_write(out / "model.onnx", s.model.SerializeToString())
    init = {t.name for t in s.model.graph.initializer}
    names = [vi.name for vi in s.model.graph.input if vi.name not in init]
    for k, name in enumerate(names):
        atomic_write(data / f"input_{k}.pb", _tensor(name, s.feeds[name]).SerializeToString())
    bands = {j.name: j.band for j in loc.judged}
    for k, vi in enumerate(s.model.graph.output):
        want = np.asarray(ev.exact[vi.name]).astype(np.asarray(ev.native[vi.name]).dtype)
        atomic_write(data / f"output_{k}.pb", _tensor(vi.name, want).SerializeToString())
    f = loc.finding
    meta = {"rtol": 0.0, "atol": max(bands.get(vi.name, 0.0) for vi in s.model.graph.output),
            "lockstep": {"node": f.name, "op_type": f.op_type, "engine": engine, "nodes": reduced.nodes,
                         "located_with": command,
                         "expected": "the float64 oracle's outputs rounded to the model's types; atol is the "
                                     "error model's band of the divergent output"}}
    atomic_write(out / "data.json", json.dumps(meta, indent=1) + "\n")
    return out
