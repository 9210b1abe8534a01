"""Sync-debug mode of the reference Runtime (``RuntimeConfig.sync_debug``), on the simulated device.

Assertions are labelled like the contract tests: ``contract:`` is a guarantee of the mode,
``result:`` a computed value.
"""

from __future__ import annotations

import sys
import warnings

import numpy as np
import pytest
from lockstep.kernels import primitives as P
from lockstep.reference_runtime.backends.sim import SimDevice, SimStream
from lockstep.reference_runtime.config import RuntimeConfig
from lockstep.reference_runtime.errors import CaptureD2HRefused, StreamCaptureUnsupported, SyncDebugError
from lockstep.reference_runtime.runtime import Runtime
from lockstep.reference_runtime.sync_debug import PRIMITIVES, SyncDebugWarning, SyncEvent, summarize

VAR = "LOCKSTEP_SYNC_DEBUG"
HERE = "tests/test_sync_debug.py"


def _here() -> int:
    """The caller's current line: ``rt.download(x); line = _here()`` names the call's own line."""
    return sys._getframe(1).f_lineno


def make(mode: str = "error", *, defer: bool = True) -> Runtime:
    return Runtime(SimDevice(), RuntimeConfig(defer_eager_sync=defer, sync_debug=mode))


def primitives(rt: Runtime) -> list[str]:
    return [e.primitive for e in rt.sync_log]


# -- configuration

@pytest.mark.parametrize("raw, expected", [
    ("warn", "warn"), ("ERROR", "error"), (" off ", "off"), ("Warn", "warn"), ("", "off"), ("  ", "off"),
])
def test_from_env_parses_the_variable(raw, expected):
    assert RuntimeConfig.from_env({VAR: raw}).sync_debug == expected, "contract: LOCKSTEP_SYNC_DEBUG parsed"


def test_default_is_off_and_bad_values_are_refused():
    assert RuntimeConfig().sync_debug == "off", "contract: sync-debug is off by default"
    assert RuntimeConfig.from_env({}).sync_debug == "off", "contract: unset means off"
    with pytest.raises(ValueError, match=r"sync_debug='loud': expected one of \['off', 'warn', 'error'\]"):
        RuntimeConfig(sync_debug="loud")
    with pytest.raises(ValueError, match=rf"{VAR}='loud': expected one of \['off', 'warn', 'error'\]"):
        RuntimeConfig.from_env({VAR: "loud"})


def test_runtime_reads_the_environment_at_construction(monkeypatch):
    monkeypatch.setenv(VAR, "warn")
    rt = Runtime(SimDevice())
    monkeypatch.setenv(VAR, "error")
    assert rt.config.sync_debug == "warn", "contract: read once, at construction"
    assert Runtime(SimDevice()).config.sync_debug == "error", "contract: a new runtime reads it again"
    assert Runtime(SimDevice(), RuntimeConfig()).config.sync_debug == "off", "contract: an explicit config wins"


# -- recording

def test_off_mode_records_nothing_and_keeps_raw_streams():
    rt = make("off")
    assert rt.compute is rt._res.compute and rt.copy_stream is rt._res.copy, "contract: no proxy when off"
    x = rt.upload(np.ones(4, np.float32))
    y = rt.empty(4)
    rt.copy(y, x)
    rt.synchronize()
    rt.compute.synchronize()
    assert rt.download(y).tolist() == [1.0] * 4, "result: the copy"
    rt.begin_capture("primary")
    rt.synchronize()  # the deferred no-op inside a capture, unchecked when off
    rt.end_capture("primary")
    rt.free(x)
    rt.drain_for_unmap()
    assert rt.sync_log == [], "contract: off records nothing"


def test_records_primitive_site_and_node():
    rt = make("error")
    x = rt.upload(np.ones(4, np.float32))
    y = rt.empty(4)
    assert rt.sync_log == [], "contract: construction and upload are not synchronising"
    assert rt.current_node is None, "contract: no node until a caller sets one"
    rt.current_node = "MatMul_0"
    rt.copy(y, x); l_copy = _here()  # noqa: E702
    rt.download(y); l_download = _here()  # noqa: E702
    rt.current_node = "Add_1"
    rt.synchronize(); l_sync = _here()  # noqa: E702
    rt.free(x); l_free = _here()  # noqa: E702
    rt.current_node = None
    rt.drain_for_unmap(); l_drain = _here()  # noqa: E702
    fn = "test_records_primitive_site_and_node"
    assert rt.sync_log == [
        SyncEvent("copy", False, "MatMul_0", HERE, l_copy, fn),
        SyncEvent("download", False, "MatMul_0", HERE, l_download, fn),
        SyncEvent("synchronize(deferred)", False, "Add_1", HERE, l_sync, fn),
        SyncEvent("free", False, "Add_1", HERE, l_free, fn),
        SyncEvent("drain_for_unmap", False, None, HERE, l_drain, fn),
    ], "contract: one event per primitive call (a barrier's own stream drains are not recorded again)"
    assert {e.primitive for e in rt.sync_log} <= set(PRIMITIVES), "contract: primitive names are the documented ones"


def test_call_site_is_the_first_frame_outside_the_runtime():
    rt = make("error")
    x = rt.upload(np.ones(4, np.float32))

    class Helper:
        def read(self):
            return rt.download(x), _here()  # the recorded site

    _, line = Helper().read()
    (ev,) = rt.sync_log
    assert (ev.file, ev.line) == (HERE, line), "contract: the site is the caller of the runtime primitive"
    assert ev.function.endswith("Helper.read"), f"contract: the site's qualified name, got {ev.function!r}"


def test_call_site_is_found_through_several_runtime_frames():
    """Contract: a primitive the runtime calls itself (drain_for_unmap from upload -> empty ->
    check_allocation, when only a pending free makes room) is attributed to the caller's line,
    past every runtime frame in between."""
    rt = Runtime(SimDevice(), RuntimeConfig(sync_debug="error", device_memory_limit=1 << 20))
    x = rt.upload(np.ones(200_000, np.float32))
    rt.launch(P.fill, x, value=1.0)
    rt.free(x)
    assert rt.pending_frees == 1, "the free waits for the queued fill"
    rt.upload(np.ones(200_000, np.float32)); line = _here()  # noqa: E702
    assert [(e.primitive, e.file, e.line) for e in rt.sync_log][1:] == [("drain_for_unmap", HERE, line)], \
        "contract: the site is the upload's caller"


def test_executor_sites_are_named_as_the_audit_names_them():
    """Contract: a call site inside lockstep is named relative to lockstep's root (as the static
    audit names files: the cross-check in contracts/suite/test_sync_crosscheck.py relies on it),
    and an event names the node the executor was running. Independent of that cross-check."""
    import onnx
    from lockstep.golden.anchors import MODEL_DIR
    from lockstep.reference_runtime.executor import Executor

    rt = make("error")
    ex = Executor(onnx.load(str(MODEL_DIR / "tiny-fp32-standard.onnx")), rt)
    feeds = {"input_ids": np.asarray([[65]], np.int64), "position_ids": np.asarray([[0]], np.int64)}
    for p in [vi.name for vi in ex.inputs if vi.name.startswith("past_key_values.")]:
        feeds[p] = np.zeros((1, 2, 0, 16), np.float32)
    ex.run(feeds)
    per_op = [e for e in rt.sync_log if e.primitive == "synchronize(deferred)"]
    assert per_op and {(e.file, e.function) for e in per_op} == {("reference_runtime/executor.py", "Executor._launch")}, \
        "contract: sites relative to lockstep's root, with the qualified function name"
    assert [e.node for e in per_op] == [st.info.name for st in ex.steps if st.kernel is not None and not st.alias], \
        "contract: each per-op synchronize names the node it follows"
    tail = rt.sync_log[rt.sync_log.index(per_op[-1]) + 1:]
    assert {e.primitive for e in tail} >= {"download", "free"} and {e.node for e in tail} == {None}, \
        "contract: the run's output downloads and frees are no node's (not the last node's)"


def test_forced_sync_called_directly_is_recorded_once():
    rt = make("error")
    rt._force_sync(); line = _here()  # noqa: E702
    assert primitives(rt) == ["force_sync"] and rt.sync_log[0].line == line, \
        "contract: a forced synchronise from outside the runtime is its own event"


def test_summarize_groups_by_site():
    rt = make("warn")
    x = rt.upload(np.ones(4, np.float32))
    for _ in range(3):
        rt.download(x); l_loop = _here()  # noqa: E702
    rt.begin_capture("verify")
    rt.free(x); l_free = _here()  # noqa: E702
    rt.end_capture("verify")
    for capturing in (True, False):  # one site, a capturing event first, then an eager one
        if capturing:
            rt.begin_capture("primary")
        y = rt.empty(4)
        rt.copy(y, y); l_both = _here()  # noqa: E702
        if capturing:
            rt.end_capture("primary")
    fn = "test_summarize_groups_by_site"
    assert summarize(rt.sync_log) == {
        (HERE, l_loop, fn): {"download": 3, "capturing": False},
        (HERE, l_free, fn): {"free": 1, "capturing": True},
        (HERE, l_both, fn): {"copy": 2, "capturing": True},
    }, "result: counts per primitive per site, capturing if any event was"


# -- error mode: syncs during capture

def test_deferred_synchronize_inside_capture_raises_and_the_capture_aborts_cleanly():
    rt = make("error")
    x = rt.upload(np.zeros(4, np.float32))
    rt.begin_capture("primary")
    rt.launch(P.fill, x, value=3.0)
    rt.current_node = "Softmax_7"
    line = _here() + 2
    with pytest.raises(SyncDebugError) as info:
        rt.synchronize()
    msg = str(info.value)
    assert "synchronize(deferred)" in msg and "'Softmax_7'" in msg and f"{HERE}:{line}" in msg, \
        f"contract: the error names the primitive, the node and the call site, got {msg!r}"
    ev = info.value.event
    assert (ev.primitive, ev.capturing, ev.node, ev.line) == ("synchronize(deferred)", True, "Softmax_7", line), \
        "contract: the error carries the recorded event"
    assert rt.sync_log == [ev], "contract: the refused call is recorded"
    assert rt.counters.syncs_deferred == 0, "contract: refused before the primitive ran"
    rt.abort_capture("primary")
    assert not rt.is_capturing and rt.counters.capture_aborts == 1, "contract: the capture aborts cleanly"
    rt.current_node = None
    assert rt.download(x).tolist() == [0.0] * 4, "result: nothing captured ran; the runtime stays usable"


def test_refused_sync_leaves_the_capture_valid():
    rt = make("error")
    x = rt.upload(np.zeros(4, np.float32))
    rt.begin_capture("verify")
    rt.launch(P.fill, x, value=2.0)
    with pytest.raises(SyncDebugError, match="stream.synchronize called while a capture is open"):
        rt.compute.synchronize()
    rt.end_capture("verify")  # not StreamCaptureInvalidated: the sync never reached the stream
    rt.replay("verify")
    assert rt.download(x).tolist() == [2.0] * 4, "result: the capture recorded its launch and replays"


@pytest.mark.parametrize("call", ["download", "drain_for_unmap", "_force_sync"])
def test_other_synchronising_primitives_inside_capture_raise(call):
    rt = make("error")
    x = rt.upload(np.zeros(4, np.float32))
    rt.begin_capture("primary")
    args = (x,) if call == "download" else ()
    with pytest.raises(SyncDebugError, match=r"called while capturing into primary"):
        getattr(rt, call)(*args)
    expected = "force_sync" if call == "_force_sync" else call
    assert [(e.primitive, e.capturing) for e in rt.sync_log] == [(expected, True)], "contract: recorded, capturing"
    rt.end_capture("primary")


def test_copy_and_free_inside_capture_are_recorded_not_refused():
    rt = make("error")
    x = rt.upload(np.ones(4, np.float32))
    y = rt.empty(4)
    rt.begin_capture("primary")
    rt.copy(y, x)
    rt.free(x)
    rt.end_capture("primary")
    assert [(e.primitive, e.capturing) for e in rt.sync_log] == [("copy", True), ("free", True)], \
        "contract: capture-safe primitives are recorded with capturing=True"
    rt.replay("primary")
    assert rt.download(y).tolist() == [1.0] * 4, "result: the captured copy"


def test_warn_mode_warns_inside_capture_and_keeps_the_runtime_behaviour():
    rt = make("warn")
    x = rt.upload(np.zeros(4, np.float32))
    rt.begin_capture("primary")
    with pytest.warns(SyncDebugWarning, match="synchronize\\(deferred\\) called while capturing") as rec:
        rt.synchronize(); line = _here()  # noqa: E702
    assert (rec[0].filename.replace("\\", "/").endswith(HERE), rec[0].lineno) == (True, line), \
        "contract: the warning points at the call site"
    assert rt.counters.syncs_deferred == 1, "contract: warn never refuses; the deferred no-op ran"
    with pytest.warns(SyncDebugWarning), pytest.raises(CaptureD2HRefused):
        rt.download(x)  # warned, then refused by the runtime as without sync-debug
    rt.end_capture("primary")
    assert primitives(rt) == ["synchronize(deferred)", "download"], "contract: both recorded"


# -- the deferred eager path: real drains outside the known barriers

def test_download_copy_and_drain_outside_capture_are_barriers():
    rt = make("error")
    x = rt.upload(np.ones(4, np.float32))
    y = rt.empty(4)
    rt.launch(P.fill, x, value=4.0)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        rt.copy(y, x)
        assert rt.download(y).tolist() == [4.0] * 4, "result: the copy of the filled tensor"
        rt.launch(P.fill, y, value=1.0)
        rt.drain_for_unmap()
    assert rt.compute.query(), "contract: drain_for_unmap drained through the watched stream"
    assert primitives(rt) == ["copy", "download", "drain_for_unmap"], \
        "contract: recorded, and their own stream drains are not stray drains"


@pytest.mark.parametrize("stream", ["compute", "copy_stream"])
def test_direct_stream_synchronize_on_the_deferred_path_raises_in_error_mode(stream):
    rt = make("error")
    x = rt.empty(4)
    rt.launch(P.fill, x, value=1.0)
    rt.current_node = "Gather_2"
    line = _here() + 2
    with pytest.raises(SyncDebugError, match="real stream drain on the deferred eager path") as info:
        getattr(rt, stream).synchronize()
    assert f"{HERE}:{line}" in str(info.value) and "'Gather_2'" in str(info.value), \
        "contract: the error names the node and the call site"
    assert [(e.primitive, e.capturing, e.line) for e in rt.sync_log] == [("stream.synchronize", False, line)], \
        "contract: recorded as a stream synchronise"
    assert not rt.compute.query(), "contract: refused before the drain"


def test_direct_stream_synchronize_on_the_deferred_path_warns_in_warn_mode():
    rt = make("warn")
    x = rt.empty(4)
    rt.launch(P.fill, x, value=1.0)
    with pytest.warns(SyncDebugWarning, match="real stream drain on the deferred eager path") as rec:
        rt.compute.synchronize(); line = _here()  # noqa: E702
    assert rec[0].lineno == line, "contract: the warning points at the call site"
    assert rt.compute.query(), "contract: warn never refuses; the drain ran"
    assert primitives(rt) == ["stream.synchronize"], "contract: recorded"


def test_a_runtime_that_drains_in_synchronize_is_caught():
    class DrainingSync(Runtime):  # the pre-deferral runtime's synchronize(), on the deferred path
        def synchronize(self) -> None:
            DrainingSync.line = _here() + 1
            self.compute.synchronize()

    rt = DrainingSync(SimDevice(), RuntimeConfig(sync_debug="error"))
    with pytest.raises(SyncDebugError, match="stream.synchronize is a real stream drain"):
        rt.synchronize()
    (ev,) = rt.sync_log
    assert (ev.file, ev.line, ev.function) == (HERE, DrainingSync.line, f"{DrainingSync.__qualname__}.synchronize"), \
        "contract: the site is the override that drained"


# -- deferral off

def test_deferral_off_synchronize_is_a_known_barrier():
    rt = make("error", defer=False)
    x = rt.empty(4)
    rt.launch(P.fill, x, value=1.0)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        rt.synchronize(); line = _here()  # noqa: E702
    assert rt.compute.query() and rt.counters.syncs_real == 1, "contract: a real drain, not refused"
    assert [(e.primitive, e.line) for e in rt.sync_log] == [("synchronize", line)], \
        "contract: recorded as a real synchronize, its stream drains not as stray ones"
    rt.launch(P.fill, x, value=2.0)
    rt.compute.synchronize()  # not the deferred path: recorded, not refused
    assert primitives(rt) == ["synchronize", "stream.synchronize"], "contract: a direct drain is still recorded"


def test_deferral_off_synchronize_inside_capture_raises_before_invalidating():
    rt = make("error", defer=False)
    x = rt.empty(4)
    rt.begin_capture("primary")
    rt.launch(P.fill, x, value=5.0)
    with pytest.raises(SyncDebugError, match="synchronize called while capturing into primary"):
        rt.synchronize()
    rt.end_capture("primary")  # still valid: without sync-debug this would be StreamCaptureInvalidated
    rt.replay("primary")
    assert rt.download(x).tolist() == [5.0] * 4, "result: the capture replays"
    off = Runtime(SimDevice(), RuntimeConfig(defer_eager_sync=False))
    off.begin_capture("primary")
    with pytest.raises(StreamCaptureUnsupported):
        off.synchronize()  # the behaviour sync-debug pre-empts
    off.abort_capture("primary")


# -- the watched streams

def test_watched_streams_are_transparent():
    dev = SimDevice()
    rt = Runtime(dev, RuntimeConfig(sync_debug="error"))
    assert isinstance(rt.compute, SimStream) and rt.compute is not rt._res.compute, "contract: a SimStream proxy"
    assert rt.compute == rt._res.compute and hash(rt.compute) == hash(rt._res.compute), "contract: equal to it"
    assert rt.compute.unwrapped is rt._res.compute and rt.compute.label == rt._res.compute.label, \
        "contract: attributes forwarded"
    x = rt.upload(np.arange(4, dtype=np.float32))
    rt.drain_for_unmap()
    assert dev.memcpy_dtoh(x.ref, rt.compute).tolist() == [0.0, 1.0, 2.0, 3.0], \
        "result: a watched stream can be handed to a device call"
    rt.begin_capture("primary")
    assert rt.compute.is_capturing, "contract: properties forwarded"
    rt.abort_capture("primary")
    assert primitives(rt) == ["drain_for_unmap"], "contract: no other primitive recorded"
