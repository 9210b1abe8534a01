"""Unit tests of the reference Runtime on the simulated device."""

from __future__ import annotations

import re

import numpy as np
import pytest
from lockstep.kernels import primitives as P
from lockstep.reference_runtime import GraphSlot, IllegalState, InvalidValue, Runtime, RuntimeConfig
from lockstep.reference_runtime.backends.sim import SimDevice

VAR = "LOCKSTEP_DEFER_EAGER_SYNC"


def pool_mappings(dev):
    return [m for m in dev._maps.values() if m.kind == "pool"]


@pytest.mark.parametrize("raw, expected", [
    ("0", False), ("false", False), ("OFF", False), ("No", False), (" off ", False),
    ("1", True), ("TRUE", True), ("On", True), ("yes", True), ("", True), ("  ", True),
])
def test_from_env_parses_the_variable(raw, expected):
    assert RuntimeConfig.from_env({VAR: raw}).defer_eager_sync is expected


def test_from_env_default_and_garbage():
    assert RuntimeConfig.from_env({}).defer_eager_sync is True
    with pytest.raises(ValueError, match=f"{VAR}='maybe': expected one of"):
        RuntimeConfig.from_env({VAR: "maybe"})


def test_runtime_reads_the_environment_at_construction(monkeypatch):
    monkeypatch.delenv(VAR, raising=False)
    before = Runtime(SimDevice())
    monkeypatch.setenv(VAR, "off")
    after = Runtime(SimDevice())
    assert before.config.defer_eager_sync is True and after.config.defer_eager_sync is False
    assert RuntimeConfig.from_env({}).defer_eager_sync is True  # an explicit environ ignores os.environ
    assert Runtime(SimDevice(), RuntimeConfig()).config.defer_eager_sync is True  # an explicit config wins
    before.synchronize()
    after.synchronize()
    assert (before.counters.syncs_deferred, before.counters.syncs_real) == (1, 0)
    assert (after.counters.syncs_deferred, after.counters.syncs_real) == (0, 1)
    monkeypatch.setenv(VAR, "garbage")
    with pytest.raises(ValueError, match=VAR):
        Runtime(SimDevice())


def test_counters():
    rt = Runtime(SimDevice(), RuntimeConfig())
    c = rt.counters
    assert (c.launches, c.allocations) == (1, 1)  # the error latch and its clearing fill
    x = rt.upload(np.zeros(4, np.float32))
    y = rt.empty(4)
    rt.launch(P.fill, x, value=1.0)
    rt.synchronize()
    assert (c.launches, c.allocations, c.syncs_deferred, c.syncs_real, c.forced_syncs) == (2, 3, 1, 0, 0)
    rt.copy(y, x)
    assert rt.download(y).tolist() == [1.0] * 4
    assert (c.forced_syncs, c.downloads, c.drains) == (2, 1, 0)
    rt.free(x)  # nothing enqueued since the download drained both streams: back at once
    assert (c.frees, c.frees_released, rt.pending_frees) == (1, 1, 0)
    w = rt.empty(4)
    rt.launch(P.fill, w, value=2.0)  # queued: w's free waits for it
    rt.free(w)
    assert (c.frees, c.frees_released, rt.pending_frees) == (2, 1, 1)
    rt.drain_for_unmap()
    assert (c.drains, c.frees_released, rt.pending_frees) == (1, 2, 0)
    rt.begin_capture("verify")
    rt.launch(P.accumulate, y, y)
    rt.end_capture("verify")
    rt.replay("verify")
    rt.replay(GraphSlot.VERIFY)
    rt.begin_capture("primary")
    rt.abort_capture("primary")
    assert (c.launches, c.captured_launches, c.captures, c.replays, c.capture_aborts) == (4, 1, 1, 2, 1)
    assert c.captures_by_slot == {"primary": 0, "verify": 1}
    assert c.replays_by_slot == {"primary": 0, "verify": 2}
    assert rt.download(y).tolist() == [4.0] * 4
    snapshot = c.as_dict()
    snapshot["replays_by_slot"]["verify"] = 99
    assert c.replays_by_slot["verify"] == 2 and snapshot["downloads"] == 2


def test_wrap_bounds_and_wrapped_tensors_cannot_be_freed():
    dev = SimDevice()
    rt = Runtime(dev, RuntimeConfig())
    buf = dev.malloc(16)
    for shape, offset in [((5,), 0), ((2,), 12), ((1,), -4)]:
        with pytest.raises(InvalidValue, match=f"does not fit in <Buffer 0x{buf.addr:x} 16B"):
            rt.wrap(buf, shape, np.float32, offset=offset)
    t = rt.wrap(buf, (2,), np.float32, offset=8, name="wrapped")
    rt.write(t, np.array([3.0, 4.0], np.float32))
    assert rt.download(t).tolist() == [3.0, 4.0]
    with pytest.raises(InvalidValue, match="<Tensor wrapped float32.* is not owned by this runtime"):
        rt.free(t)
    assert not t.freed and not buf.freed
    assert dev.memcpy_dtoh(rt.wrap(buf, (4,), np.float32).ref, rt.compute)[2:].tolist() == [3.0, 4.0]


DTYPES = [np.float32, np.float16, np.int64, np.int32, np.bool_]
SHAPES = [(3,), (2, 3), (0,), (2, 0, 3), (1, 1, 1)]




@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: np.dtype(d).name)
@pytest.mark.parametrize("shape", [*SHAPES, ()], ids=str)
def test_upload_download_round_trip(dtype, shape):
    rt = Runtime(SimDevice(), RuntimeConfig())
    host = (np.arange(int(np.prod(shape)), dtype=np.int64).reshape(shape) % 3).astype(dtype)
    t = rt.upload(host)
    assert t.shape == shape and t.dtype == np.dtype(dtype)
    got = rt.download(t)
    assert got.shape == shape and got.dtype == np.dtype(dtype) and np.array_equal(got, host)


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: np.dtype(d).name)
def test_zero_d_round_trip_through_empty_and_write(dtype):
    rt = Runtime(SimDevice(), RuntimeConfig())
    t = rt.empty((), dtype)
    rt.write(t, np.array(1, dtype))
    got = rt.download(t)
    assert got.shape == () and got.dtype == np.dtype(dtype) and got == 1


@pytest.mark.parametrize("close", ["end_capture", "abort_capture"])
def test_free_during_capture_is_deferred_then_stream_ordered(close):
    rt = Runtime(SimDevice(), RuntimeConfig())
    t = rt.upload(np.full(4, 2.0, np.float32))
    acc = rt.upload(np.zeros(4, np.float32))
    rt.drain_for_unmap()
    rt.launch(P.accumulate, acc, t)  # an eager reader, queued and not executed
    rt.begin_capture("primary")
    rt.launch(P.accumulate, acc, acc)
    rt.free(t)
    buf = t.ref.buffer
    assert t.freed and rt.pending_frees == 0 and not buf.freed and rt.counters.frees == 1
    assert rt.empty(4).addr != buf.addr  # the memory is still in use during the capture
    getattr(rt, close)("primary")
    assert rt.pending_frees == 1 and not buf.freed  # queued behind the reader
    assert rt.empty(4).addr != buf.addr
    assert rt.download(acc).tolist() == [2.0] * 4  # the reader saw t's bytes
    assert rt.pending_frees == 0 and buf.freed and rt.counters.frees_released == 1


@pytest.mark.parametrize("raw, slot", [
    ("PRIMARY", GraphSlot.PRIMARY), ("primary", GraphSlot.PRIMARY), ("Verify", GraphSlot.VERIFY),
    ("VERIFY", GraphSlot.VERIFY), (GraphSlot.VERIFY, GraphSlot.VERIFY),
])
def test_graph_slot_parse_accepts_names_case_insensitively(raw, slot):
    assert GraphSlot.parse(raw) is slot


@pytest.mark.parametrize("raw", ["draft", "", "primary ", "PRIMARY_", None])
def test_graph_slot_parse_rejects_other_names(raw):
    with pytest.raises(InvalidValue, match=f"unknown graph slot {raw!r}; slots are \\['primary', 'verify'\\]"):
        GraphSlot.parse(raw)


def test_close_is_idempotent_and_frees_everything():
    dev = SimDevice()
    g = dev.granularity
    va = dev.reserve(g)
    mapped = dev.mem_map(va, g, dev.mem_create(g))
    rt = Runtime(dev, RuntimeConfig())
    keep = rt.upload(np.ones(4, np.float32))
    gone = rt.upload(np.ones(4, np.float32))
    rt.wrap(mapped, (4,), np.float32)
    rt.launch(P.accumulate, keep, gone)
    rt.free(gone)  # pending behind the queued kernel
    assert len(pool_mappings(dev)) == 3 and rt.pending_frees == 1
    rt.close()
    assert pool_mappings(dev) == [] and "accumulate" in dev.executed  # drained, then freed
    assert dev._maps[va].kind == "vmm"  # memory the runtime does not own stays
    rt.close()
    assert pool_mappings(dev) == [] and dev.sticky_error is None


def test_a_free_with_nothing_queued_since_a_drain_goes_back_at_once(device_name, make_runtime):
    """Guarantee (``Runtime.free``: stream-ordered release): memory goes back once every queued
    reader ran. Right after a drain (a download, drain_for_unmap, a real synchronize) nothing is
    queued, so a free gives the memory back at once, after the frees still pending (oldest first);
    once work is enqueued again a free waits for it (an event), and the pool does not hand the
    memory out while a queued kernel may read it. Same outcome on every device."""
    rt = make_runtime()
    c = rt.counters
    a = rt.upload(np.ones(4, np.float32))
    b = rt.empty(4)
    rt.launch(P.accumulate, b, a)  # queued: reads a
    rt.free(a)
    assert (c.frees_released, rt.pending_frees) == (0, 1), "a queued kernel reads a: its free waits"
    out = rt.empty(4)
    rt.launch(P.fill, out, value=3.0)
    assert rt.download(out).tolist() == [3.0] * 4  # drains both streams
    released = c.frees_released
    rt.free(b)
    assert (c.frees_released, rt.pending_frees) == (released + 1, 0), "nothing queued since the drain"
    x = rt.upload(np.full(4, 2.0, np.float32))
    y = rt.empty(4)
    rt.launch(P.fill, y, value=0.0)
    rt.launch(P.accumulate, y, x)  # queued: reads x
    rt.free(x)
    assert rt.pending_frees == 1, "work was enqueued after the drain: the free waits for it"
    z = rt.upload(np.full(4, 9.0, np.float32))  # must not be handed x's memory while the kernel may read it
    assert rt.download(y).tolist() == [2.0] * 4
    assert rt.download(z).tolist() == [9.0] * 4


def test_a_replay_while_a_capture_is_open_is_refused_and_the_capture_stays_valid(device_name, make_runtime):
    """Guarantee (runtime docstring: one capture at a time on the compute stream): replaying a slot
    or a segment while any capture is open is IllegalState naming both, before anything reaches the
    device (a graph launched into a capturing stream would be captured into it); the open capture
    stays valid and records nothing of the refused replay. Same outcome on every device."""
    rt = make_runtime()
    x = rt.upload(np.zeros(2, np.float32))
    rt.begin_capture("primary")
    rt.launch(P.fill, x, value=5.0)
    rt.end_capture("primary")
    seg = rt.begin_segment("seg0")
    rt.launch(P.fill, x, value=7.0)
    rt.end_segment(seg)
    replays = rt.counters.replays

    rt.begin_capture("verify")
    rt.launch(P.accumulate, x, x)
    with pytest.raises(IllegalState, match=r"replay\(primary\) while capturing into verify"):
        rt.replay("primary")
    with pytest.raises(IllegalState, match=re.escape(f"replay_segment({seg.label}) while capturing into verify")):
        rt.replay_segment(seg)
    rt.end_capture("verify")  # still valid: not invalidated by the refused replays
    seg1 = rt.begin_segment("seg1")
    with pytest.raises(IllegalState, match=re.escape(f"replay(primary) while capturing into {seg1.value}")):
        rt.replay("primary")
    rt.abort_segment(seg1)
    assert rt.counters.replays == replays and not rt.is_capturing

    rt.replay("primary")  # 5, 5
    rt.replay("verify")  # doubles: had the refused replay of primary been captured, it would reset first
    assert rt.download(x).tolist() == [10.0, 10.0]
    rt.replay("primary")
    rt.replay_segment(seg)
    rt.replay("verify")
    assert rt.download(x).tolist() == [14.0, 14.0]


def test_resetting_the_capturing_slot_is_refused_and_the_capture_completes(device_name, make_runtime):
    """Guarantee (Runtime.reset): resetting the slot that is capturing is IllegalState (abort_capture
    is the way to drop it); the open capture is untouched and, once ended, replays what it recorded.
    Resetting another slot during the capture is allowed and drops only that slot's graph."""
    rt = make_runtime()
    x = rt.upload(np.zeros(2, np.float32))
    rt.begin_capture("verify")
    rt.launch(P.fill, x, value=1.0)
    rt.end_capture("verify")
    rt.begin_capture("primary")
    rt.launch(P.fill, x, value=3.0)
    with pytest.raises(IllegalState, match=r"reset\(primary\) while it is capturing"):
        rt.reset("primary")
    rt.reset("verify")  # another slot: allowed, even now
    rt.end_capture("primary")
    assert rt.has_graph("primary") and not rt.has_graph("verify")
    rt.launch(P.fill, x, value=0.0)
    rt.replay("primary")
    assert rt.download(x).tolist() == [3.0, 3.0]


def test_a_download_inside_a_capture_is_refused_and_the_capture_stays_valid(device_name, make_runtime):
    """Guarantee (Runtime.download): inside a capture a download is CaptureD2HRefused, raised by the
    runtime before any synchronisation reaches the capturing stream; the capture stays valid and
    its graph replays what it recorded."""
    from lockstep.reference_runtime.errors import CaptureD2HRefused

    rt = make_runtime()
    x = rt.upload(np.zeros(3, np.float32))
    rt.begin_capture("primary")
    rt.launch(P.fill, x, value=4.0)
    with pytest.raises(CaptureD2HRefused, match="capturing"):
        rt.download(x)
    rt.end_capture("primary")
    rt.replay("primary")
    assert rt.download(x).tolist() == [4.0, 4.0, 4.0]

def test_frees_with_no_work_between_share_one_event_that_waits_for_both_streams():
    """Guarantee (Runtime._release_after_queued_work): frees with no device work enqueued between
    them are one batch on one "queued readers done" event, which waits for the readers queued on
    the copy stream as well as on compute; a free after more work gets a later event. Executing
    up to the batch's event (and nothing after it) gives back the batch, and only the batch."""
    dev = SimDevice()
    rt = Runtime(dev, RuntimeConfig())
    a, c, late = (rt.upload(np.full(4, v, np.float32)) for v in (2.0, 3.0, 4.0))
    acc, b = rt.upload(np.zeros(4, np.float32)), rt.empty(4)
    rt.copy(b, a)  # a reader of a, queued on the copy stream
    rt.launch(P.accumulate, acc, c)  # a reader of c, queued on compute
    rt.free(a)
    rt.free(c)  # nothing enqueued since the last free: the same batch
    rt.launch(P.accumulate, acc, late)
    rt.free(late)  # after more work: a batch of its own
    pending = list(rt._res.pending)
    assert [buf for buf, _ in pending] == [a.ref.buffer, c.ref.buffer, late.ref.buffer]
    batch = pending[0][1]
    assert pending[1][1] is batch and pending[2][1] is not batch
    assert not batch.query()  # nothing has executed: no reader ran
    batch.synchronize()  # executes what the batch's event waits for, and nothing after it
    rt.empty(4)  # reaps
    assert (rt.pending_frees, rt.counters.frees_released) == (1, 2)
    assert a.ref.buffer.freed and c.ref.buffer.freed and not late.ref.buffer.freed
    assert rt.download(b).tolist() == [2.0] * 4  # the copy read a before a went back
    assert rt.download(acc).tolist() == [7.0] * 4
    assert rt.pending_frees == 0
