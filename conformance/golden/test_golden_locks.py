"""Golden token locks on every engine: ``pytest conformance/ -m golden``.

Per engine and golden model: the snapshot must belong to this model file and come from the
oracle; the fatal lock runs teacher forcing as one prefill and step by step; the tripwire compares
the greedy stream with the recorded one (a first divergence at a near-tie is reported in the
terminal summary and the JSON report, not failed). The engine's declared precision for the model's
dtype (``engine.precision``) selects the near-tie band, and is recorded in the report. An engine
without a decode session of its own decodes through ``prepare`` with the cache on the host. A
missing model or snapshot is a failure, never a skip. ``test_snapshot_is_the_oracle`` recomputes
the anchors from the oracle and compares them with the snapshot through syrupy (``pytest
--snapshot-update`` rewrites it, like ``lockstep golden regenerate``).
"""

from __future__ import annotations

import json

import onnx
import pytest
from lockstep.golden.anchors import MODEL_DIR, compute_anchors, load_snapshot
from lockstep.golden.locks import check_provenance, teacher_forced_lock, tripwire
from lockstep.golden.models.spec import VARIANTS
from lockstep.golden.syrupy_ext import GoldenSnapshotExtension

from lockstep.decoding import open_session
from lockstep.engines import Unsupported, precision_of

MODELS = sorted(VARIANTS)


def _session(engine, name, record_property):
    model = onnx.load(str(MODEL_DIR / f"{name}.onnx"))
    try:
        precision = precision_of(engine, VARIANTS[name].dtype)
        session = open_session(engine, model)
    except Unsupported as exc:
        pytest.skip(f"unsupported: {engine.name}: {exc}")
    record_property("precision", precision)
    return session, precision


@pytest.mark.golden
@pytest.mark.parametrize("model", MODELS)
@pytest.mark.parametrize("mode", ["prefill", "stepwise"])
def test_teacher_forced_lock(engine, model, mode, record_property):
    snap = load_snapshot(model)
    check_provenance(snap)
    session, precision = _session(engine, model, record_property)
    res = teacher_forced_lock(session, snap, precision, stepwise=mode == "stepwise")
    assert res.checked > 0, "result: the lock checked no position (every position a near-tie?)"
    assert not res.violations, (f"result: {engine.name} ({precision}) breaks the lock on {model} ({mode}): "
                                f"{res.describe()}; the first ones: {res.violations[:4]}")


@pytest.mark.golden
@pytest.mark.parametrize("model", MODELS)
def test_tripwire(engine, model, record_property):
    snap = load_snapshot(model)
    check_provenance(snap)
    session, precision = _session(engine, model, record_property)
    trip = tripwire(session, snap, precision)
    if trip.divergence is not None:
        record_property("tripwire", json.dumps({"engine": engine.name, "model": model, "precision": precision,
                                                **trip.divergence}))
    assert not trip.fatal, (f"result: {engine.name} ({precision}) diverges from the recorded stream of {model} at "
                            f"position {trip.divergence and trip.divergence['pos']}, not a near-tie: {trip.divergence}")


@pytest.mark.golden
@pytest.mark.parametrize("model", MODELS)
def test_snapshot_is_the_oracle(model, snapshot):
    assert compute_anchors(model) == snapshot.use_extension(GoldenSnapshotExtension)(name=model)
