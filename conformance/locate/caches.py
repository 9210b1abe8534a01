"""The KV cache of a decode session, step by step, against the float64 oracle's (``lockstep locate
--session``): where a session's own cache handling (a write one slot late, a stale or shifted row,
a cache shared with another request) corrupts what the next step reads, no node of the step is
wrong; the step's Attention merely reads a bad past.

Every call of the session runs the model with each past input also listed as a graph output (no
node added: ONNX lets a graph output name a graph input), so the session's ``values()`` returns
what it fed. The oracle is one float64
prefill of the context up to the located step: by causality the rows ``0..p-1`` of its presents are
the past every correct session feeds at position ``p`` (a growing cache or a fixed-capacity buffer
alike; a sliding-window cache that holds fewer rows is not compared, and said). Each tensor's band
is the golden error model's for the value that writes it (its depth and reduction in the graph,
the engine's precision), or ``MEASURED`` times onnx's reference evaluator's error in the model's
precision on the same rows, the larger (``lockstep.conformance.locate.judge``).

The first past out of its band, in the order the session fed them, is the finding: the rows the
calls before wrote, as the session stored them. Whether the graph wrote them wrong is what
``lockstep locate`` without ``--session`` judges (the step's nodes on the oracle's own past)."""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np
import onnx

from .graph import depths
from .judge import Units, _value_band, float_error
from .oracle import evaluate, widen_feeds, widened

__all__ = ["CacheFinding", "CacheOracle", "with_pasts_exposed"]


def with_pasts_exposed(model: onnx.ModelProto, pasts: list[str]) -> onnx.ModelProto:
    """``model`` with every past input also a graph output of the same name (a session's
    ``values()`` returns the outputs other than the logits and presents: what it fed)."""
    m = onnx.ModelProto()
    m.CopyFrom(model)
    g = m.graph
    have = {o.name for o in g.output}
    g.output.extend(v for v in g.input if v.name in pasts and v.name not in have)
    return m


@dataclass
class CacheFinding:
    """The first cache tensor out of its band: at which call, fed or made, which row first."""

    call: str                  # "the step at position 13"
    position: int              # the position of the call's first token
    tensor: str                # the past's name
    row: int                   # the first row (along the sequence axis) out of its band
    rows: int                  # the rows compared
    error: float
    band: float
    writer: str                # the node that writes its present in the graph
    why: str

    def as_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["error"] = d["error"] if math.isfinite(d["error"]) else "inf"
        return d


class CacheOracle:
    """The float64 oracle's presents over ``context`` (one prefill) and each present's band."""

    def __init__(self, model: onnx.ModelProto, io, context: list[int], units: Units):
        self.io, self.units = io, units
        feeds = {**io.step_feeds(context, 0), **io.empty_caches()}
        exact = evaluate(widened(model), widen_feeds(feeds), where="float64, the caches of the context")
        native = evaluate(model, feeds, where="in the model's precision, the caches of the context")
        self.depth = depths(model.graph, exact)
        self.exact = {p: np.asarray(exact[io.present_of[p]], np.float64) for p in io.pasts}
        self.native = {p: np.asarray(native[io.present_of[p]], np.float64) for p in io.pasts}
        writers = {o: n for n in model.graph.node for o in n.output}
        self.writer = {p: (lambda n: f"{n.name or '?'} ({n.op_type})")(writers[io.present_of[p]])
                       if io.present_of[p] in writers else "" for p in io.pasts}
        self.skipped: set[str] = set()

    def _rows(self, a: np.ndarray, n: int) -> np.ndarray:
        return np.take(np.asarray(a, np.float64), np.arange(n), axis=self.io.seq_axis)

    def judge(self, past: str, got: np.ndarray, rows: int, call: str, position: int) -> CacheFinding | None:
        """``got``, the past ``past`` a session fed at ``call``, on its first ``rows`` rows."""
        axis = self.io.seq_axis
        if rows <= 0:
            return None
        if np.shape(got)[axis] < rows or self.exact[past].shape[axis] < rows:
            self.skipped.add(past)  # a window cache: its rows are not the positions
            return None
        ref, nat, g = self._rows(self.exact[past], rows), self._rows(self.native[past], rows), self._rows(got, rows)
        dt = np.dtype(np.asarray(got).dtype).name
        base, _ = float_error(nat, ref)
        band = _value_band(self.units, dt, self.depth[self.io.present_of[past]],
                           float(np.max(np.abs(ref))) if ref.size else 0.0, base if math.isfinite(base) else 0.0)
        err, shape_why = float_error(g, ref)
        if err <= band:
            return None
        per_row = np.moveaxis(np.abs(np.nan_to_num(g - ref, nan=np.inf)), axis, 0).reshape(rows, -1).max(axis=1)
        row = int(np.argmax(per_row > band)) if shape_why == "" else 0
        why = (f"the rows the calls before wrote, as the session stored them (a row in the wrong slot, stale, shifted "
               f"or shared); the graph writes them at {self.writer[past] or 'its present'}, which "
               "`lockstep locate` without --session judges on the oracle's own past")
        return CacheFinding(call, position, past, row, rows, err, band, self.writer[past], why)
