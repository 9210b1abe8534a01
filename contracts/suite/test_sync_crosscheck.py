"""The static sync audit and the runtime's sync-debug mode agree (issue 6).

Each golden model is decoded with capture on under ``sync_debug="warn"``; every synchronising
primitive the runtime executed is recorded with its call site. Then:
- completeness: every observed call site is one the static audit found (its inventory of sink
  calls), so the audit does not miss a way the code synchronises;
- agreement: no observed site is one the audit calls unsafe, and every site observed while a
  capture was open is one the audit accepted on a capture path (guarded or allowlisted) — a site
  the audit thought eager-only but that ran during a capture would mean its call graph missed a
  capture path;
- no warning was raised (nothing synchronised inside a capture, no stray real drain).
"""

from __future__ import annotations

import warnings

import onnx
import pytest
from lockstep.contracts.audit import audit, site_of
from lockstep.golden.anchors import MODEL_DIR
from lockstep.golden.models.spec import PROMPT, VARIANTS
from lockstep.reference_runtime import Runtime, RuntimeConfig
from lockstep.reference_runtime.backends import make_device
from lockstep.reference_runtime.engine import RefDecoder
from lockstep.reference_runtime.sync_debug import SyncDebugWarning

from lockstep.decoding import greedy

_AUDIT = None


def _audit():
    global _AUDIT
    if _AUDIT is None:
        _AUDIT = audit()
    return _AUDIT


@pytest.mark.capture
@pytest.mark.parametrize("model", sorted(VARIANTS))
def test_observed_sync_sites_are_ones_the_audit_accepts(ref_engine, model):
    rt = Runtime(make_device(ref_engine.device_name), RuntimeConfig(sync_debug="warn"))
    dec = RefDecoder(onnx.load(str(MODEL_DIR / f"{model}.onnx")), rt, capture=True)
    with warnings.catch_warnings():
        warnings.simplefilter("error", SyncDebugWarning)
        result = greedy(dec, list(PROMPT.encode()), 6)
    assert result.counters["capture"]["captures"] > 0, "contract: capture was really on"
    log = rt.sync_log
    assert log, "contract: the mode recorded the step's synchronising primitives (not vacuous)"
    res = _audit()
    sites = {(e.file, e.line): e for e in log}
    missing = [f"{f}:{l} {e.function} {e.primitive}" for (f, l), e in sites.items() if site_of(res, f, l) is None]
    assert not missing, f"result: observed sync sites the static audit does not know: {missing}"
    unsafe = [f"{f}:{l}" for (f, l) in sites if site_of(res, f, l).status == "unsafe"]
    assert not unsafe, f"result: observed sites the audit calls unsafe: {unsafe}"
    in_capture = {(e.file, e.line) for e in log if e.capturing}
    wrong = [f"{f}:{l} ({site_of(res, f, l).status})" for (f, l) in in_capture
             if site_of(res, f, l).status not in ("guarded", "allowlisted")]
    assert not wrong, f"result: sites that ran during a capture but that the audit saw on no capture path: {wrong}"
