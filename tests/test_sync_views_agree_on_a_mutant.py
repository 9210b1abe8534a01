"""Both views catch the same bug: the executor's per-op ``synchronize()`` without its capture
guard. The static audit reports the unguarded call in the mutated source; the runtime's
sync-debug mode (error) refuses it the moment a capture records that step. (Under deferral the
unguarded call is a silent no-op in a capture: the seeds' class of hidden sync.)"""

from __future__ import annotations

import onnx
from lockstep.contracts.audit import ROOT, audit
from lockstep.golden.anchors import MODEL_DIR
from lockstep.reference_runtime import Runtime, RuntimeConfig
from lockstep.reference_runtime.backends.sim import SimDevice
from lockstep.reference_runtime.engine import RefDecoder

from lockstep.decoding import greedy

GUARDED = "        if not rt.is_capturing:\n"
CALL = "            rt.synchronize()\n"


def test_static_audit_reports_the_unguarded_per_op_sync(tmp_path):
    src = (ROOT / "reference_runtime" / "executor.py").read_text()
    assert GUARDED + "            # A runtime's per-op" in src, "the guarded call this mutant removes is where we expect it"
    mutated = src.replace(GUARDED, "        if True:\n", 1)
    pkg = tmp_path / "reference_runtime"
    pkg.mkdir()
    (pkg / "executor.py").write_text(mutated)
    allow = tmp_path / "allow.toml"
    allow.write_text('[capture]\nentries = [{ file = "executor.py", function = "Executor._launch", reason = "test" }]\n')
    res = audit([str(pkg / "executor.py")], allowlist=allow)
    unsafe = [f for f in res.findings if f.rule == "capture-unsafe-sync" and f.call == "rt.synchronize()"]
    assert unsafe and unsafe[0].kind == "sync", [(f.line, f.call) for f in res.findings]


def test_sync_debug_refuses_the_unguarded_per_op_sync_during_capture(monkeypatch):
    from lockstep.reference_runtime.executor import Executor

    real = Executor._launch

    def unguarded(self, *args, **kw):
        real(self, *args, **kw)
        if self.runtime.is_capturing:
            self.runtime.synchronize()  # what the guard kept out of the capture

    monkeypatch.setattr(Executor, "_launch", unguarded)
    rt = Runtime(SimDevice(), RuntimeConfig(sync_debug="error"))
    dec = RefDecoder(onnx.load(str(MODEL_DIR / "tiny-fp32-standard-kv64.onnx")), rt, capture=True)
    res = greedy(dec, list(b"The quick"), 4)
    # the refusal happens inside the recording: the decoder aborts the capture and decodes eagerly
    assert dec.capture_fallback and "SyncDebugError" in dec.capture_fallback, dec.capture_fallback
    assert any(e.capturing and e.primitive == "synchronize(deferred)" for e in rt.sync_log)
    off = Runtime(SimDevice(), RuntimeConfig(sync_debug="off"))
    quiet = RefDecoder(onnx.load(str(MODEL_DIR / "tiny-fp32-standard-kv64.onnx")), off, capture=True)
    greedy(quiet, list(b"The quick"), 4)
    assert quiet.capture_fallback is None, "result: without the debug mode the deferred no-op hides it"
    assert res.tokens
