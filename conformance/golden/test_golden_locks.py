"""Golden token locks on every engine: ``pytest conformance/ -m golden``.

Per engine and golden model: the snapshot must belong to this model file and come from the
oracle; the fatal lock runs teacher forcing as one prefill and step by step; the tripwire compares
the greedy stream with the recorded one (a first divergence at a near-tie is reported in the
terminal summary and the JSON report, not failed). A missing model or snapshot is a failure, never
a skip. ``test_snapshot_is_the_oracle`` recomputes the anchors from the oracle and compares them
with the snapshot through syrupy (``pytest --snapshot-update`` rewrites it, like
``lockstep golden regenerate``).
"""

from __future__ import annotations

import json

import onnx
import pytest

from lockstep.golden.anchors import MODEL_DIR, compute_anchors, load_snapshot
from lockstep.golden.locks import check_provenance, teacher_forced_lock, tripwire
from lockstep.golden.models.spec import VARIANTS
from lockstep.golden.syrupy_ext import GoldenSnapshotExtension
from lockstep.reference_runtime.decode import make_decoder
from lockstep.reference_runtime.model import UnsupportedModel

MODELS = sorted(VARIANTS)


def _decoder(engine, name):
    model = onnx.load(str(MODEL_DIR / f"{name}.onnx"))
    try:
        return make_decoder(engine.name, model)
    except UnsupportedModel as exc:
        pytest.skip(f"unsupported: {engine.name}: {exc}")


@pytest.mark.golden
@pytest.mark.parametrize("model", MODELS)
@pytest.mark.parametrize("mode", ["prefill", "stepwise"])
def test_teacher_forced_lock(engine, model, mode):
    snap = load_snapshot(model)
    check_provenance(snap)
    res = teacher_forced_lock(_decoder(engine, model), snap, VARIANTS[model].dtype, stepwise=mode == "stepwise")
    assert res.checked > 0, "result: the lock checked no position (every position a near-tie?)"
    assert not res.violations, f"result: {engine.name} breaks the lock on {model} ({mode}): {res.violations}"


@pytest.mark.golden
@pytest.mark.parametrize("model", MODELS)
def test_tripwire(engine, model, record_property):
    snap = load_snapshot(model)
    check_provenance(snap)
    trip = tripwire(_decoder(engine, model), snap, VARIANTS[model].dtype)
    if trip.divergence is not None:
        record_property("tripwire", json.dumps({"engine": engine.name, "model": model, **trip.divergence}))
    assert not trip.fatal, f"result: {engine.name} diverges from the recorded stream at a non-near-tie: {trip.divergence}"


@pytest.mark.golden
@pytest.mark.parametrize("model", MODELS)
def test_snapshot_is_the_oracle(model, snapshot):
    assert compute_anchors(model) == snapshot.use_extension(GoldenSnapshotExtension)(name=model)
