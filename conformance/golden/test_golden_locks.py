"""Golden token locks on every engine: ``pytest conformance/ -m golden``.

Per engine and golden model (the built-in ones, the trained SmolLM2 exports, and the user's from
``--golden-dir``): the snapshot must belong to this model file and come from the oracle; the fatal
lock runs teacher forcing as one prefill, step by step, and as verify steps (the prompt's prefill,
then ``VERIFY_WIDTH`` tokens a step: a speculative decoder's check of its draft); the tripwire compares the greedy stream
with the recorded one (a first divergence at a near-tie is reported in the terminal summary and the
JSON report, not failed). The engine's declared precision for the model's dtype
(``engine.precision``) selects the near-tie band, and is recorded in the report. An engine without
a decode session of its own decodes through ``prepare`` with the cache on the host. A missing model
or snapshot is a failure, never a skip (a trained model that cannot be built here is a counted skip
with its reason, a failure under ``LOCKSTEP_REQUIRE_MODELS``). ``test_snapshot_is_the_oracle``
recomputes a user's anchors (``--golden-dir``) from the oracle and compares them with the snapshot;
the built-in, trained and export snapshots are checked by the reference runtime's suite
(``lockstep.contracts.suite.test_builtin_snapshots``, through syrupy).
"""

from __future__ import annotations

import json

import pytest

from lockstep.decoding import VERIFY_WIDTH, open_session
from lockstep.engines import Unsupported, precision_of, unsupported_reason
from lockstep.golden.anchors import same_anchors
from lockstep.golden.locks import teacher_forced_lock, tripwire

from ..locate.lock import for_lock
from .arbiter import model_takes_no_verify_step


def _locate(engine, golden_model, position, mode, request, record_property) -> str:
    """The first divergent node of a broken lock (``lockstep.conformance.locate``), for its message."""
    where, plot = for_lock(engine, golden_model, position, mode, request.config.getoption("golden_dir"))
    if plot is not None:  # with the whole sentence: the message's first line is cut in the report
        record_property("locate", json.dumps({**plot, "sentence": where}))
    return where


def _session(engine, golden_model, record_property):
    model = golden_model.load()
    try:
        precision = precision_of(engine, golden_model.dtype)
        session = open_session(engine, model, io=golden_model.io(model))
    except Unsupported as exc:
        pytest.skip(unsupported_reason(engine.name, exc))
    record_property("precision", precision)
    return session, precision


@pytest.mark.golden
@pytest.mark.parametrize("mode", ["prefill", "stepwise", "verify"])
def test_teacher_forced_lock(engine, golden_model, mode, record_property, request):
    snap = golden_model.snapshot()
    golden_model.check_provenance(snap)
    session, precision = _session(engine, golden_model, record_property)
    try:
        res = teacher_forced_lock(session, snap, precision, stepwise=mode == "stepwise",
                                  verify=VERIFY_WIDTH if mode == "verify" else 0)
    except Exception as exc:
        why = model_takes_no_verify_step(engine, session, golden_model, snap, exc) if mode == "verify" else None
        if why:
            pytest.skip(why)
        raise
    record_property("golden", json.dumps(res.plot_data(golden_model.name, engine.name, precision)))
    assert res.checked > 0, "result: the lock checked no position (every position a near-tie?)"
    where = _locate(engine, golden_model, None if mode == "prefill" else res.violations[0]["pos"], mode, request,
                    record_property) if res.violations else ""
    assert not res.violations, (f"result: {engine.name} ({precision}) breaks the lock on {golden_model.name} "
                                f"({mode}): {res.describe()}; the first ones: {res.violations[:4]}; {where}")


@pytest.mark.golden
def test_tripwire(engine, golden_model, record_property, request):
    snap = golden_model.snapshot()
    golden_model.check_provenance(snap)
    session, precision = _session(engine, golden_model, record_property)
    trip = tripwire(session, snap, precision)
    if trip.divergence is not None:
        record_property("tripwire", json.dumps({"engine": engine.name, "model": golden_model.name,
                                                "precision": precision, **trip.divergence}))
    where = _locate(engine, golden_model, trip.divergence["pos"], "tripwire", request, record_property) if trip.fatal else ""
    assert not trip.fatal, (f"result: {engine.name} ({precision}) diverges from the recorded stream of "
                            f"{golden_model.name} at position {trip.divergence and trip.divergence['pos']}, "
                            f"not a near-tie outcome (a near-tie position and one of its candidates, 'allowed'): {trip.divergence}; {where}")


@pytest.mark.golden
@pytest.mark.golden_kinds("user")
def test_snapshot_is_the_oracle(golden_model):
    """A user's snapshot (``--golden-dir``) is what the oracle computes today from its model (the
    built-in ones are lockstep's own data: ``lockstep.contracts.suite`` checks them)."""
    assert same_anchors(golden_model.compute_anchors(), golden_model.snapshot()), (
        f"result: the oracle no longer gives {golden_model.snapshot_path}: `lockstep golden regenerate "
        f"--model {golden_model.name} --dir {golden_model.snapshot_path.parent}`")
