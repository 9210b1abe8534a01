"""Unit tests of the simulated device's cross-stream race detector, and of the runtime against it."""

from __future__ import annotations

import re

import numpy as np
import pytest
from lockstep.contracts.mutants import CopyWithoutForcedSync
from lockstep.kernels import primitives as P
from lockstep.reference_runtime import Runtime, RuntimeConfig, StreamOrderRace
from lockstep.reference_runtime.backends import ArrayRef
from lockstep.reference_runtime.backends.sim import SimDevice

F32 = np.dtype(np.float32)


def setup(race_check=True):
    dev = SimDevice(race_check=race_check)
    a, b = dev.stream(), dev.stream()
    x, y = (ArrayRef(dev.malloc(16), (4,), F32) for _ in range(2))
    return dev, a, b, x, y


READERS = {  # an op on stream b that reads x
    "d2d": lambda dev, b, x, y: dev.memcpy_dtod_async(y, x, b),
    "d2h": lambda dev, b, x, y: dev.memcpy_dtoh(x, b),
    "kernel": lambda dev, b, x, y: b.launch(P.copy, [y, x]),
}
READER_NAMES = {"d2d": "memcpy DtoD", "d2h": "memcpy DtoH", "kernel": "kernel 'copy'"}


@pytest.mark.parametrize("reader", sorted(READERS))
def test_unordered_read_after_write_races_at_enqueue(reader):
    dev, a, b, x, y = setup()
    a.launch(P.fill, [x], {"value": 1.0})
    msg = (f"{READER_NAMES[reader]} on {b.label} reads 0x{x.addr:x}..0x{x.addr + 16:x}, "
           f"which kernel 'fill' on {a.label} writes, and no event or host synchronisation orders them")
    with pytest.raises(StreamOrderRace, match=re.escape(msg)) as exc:
        READERS[reader](dev, b, x, y)
    assert exc.value.subject == (f"kernel 'fill' on {a.label}", f"{READER_NAMES[reader]} on {b.label}")
    assert b.pending == 0 and dev.executed == []  # refused at the enqueue: nothing queued, nothing ran


def _event(dev, a, b, x):
    ev = dev.event()
    a.record(ev)
    b.wait(ev)


def _event_sync(dev, a, b, x):
    ev = dev.event()
    a.record(ev)
    ev.synchronize()


ORDERINGS = {
    "event wait": _event,
    "stream synchronize": lambda dev, a, b, x: a.synchronize(),
    "event synchronize": _event_sync,
    "dtoh on the writer": lambda dev, a, b, x: dev.memcpy_dtoh(x, a),
    "device synchronize": lambda dev, a, b, x: dev.synchronize(),
}


@pytest.mark.parametrize("ordering", list(ORDERINGS))
@pytest.mark.parametrize("reader", sorted(READERS))
def test_ordered_read_after_write_does_not_race(ordering, reader):
    dev, a, b, x, y = setup()
    a.launch(P.fill, [x], {"value": 1.0})
    ORDERINGS[ordering](dev, a, b, x)
    READERS[reader](dev, b, x, y)
    assert dev.memcpy_dtoh(x, b).tolist() == [1.0] * 4  # and the reader sees the write


def test_an_event_recorded_before_the_write_does_not_order_it():
    dev, a, b, x, y = setup()
    ev = dev.event()
    a.record(ev)
    a.launch(P.fill, [x], {"value": 1.0})
    b.wait(ev)
    with pytest.raises(StreamOrderRace, match=f"kernel 'fill' on {a.label} writes"):
        dev.memcpy_dtoh(x, b)


def test_two_reads_never_race():
    dev, a, b, x, y = setup()
    z = ArrayRef(dev.malloc(16), (4,), F32)
    a.launch(P.fill, [x], {"value": 2.0})
    a.synchronize()
    a.launch(P.copy, [y, x])
    b.launch(P.copy, [z, x])  # reads x unordered with a's read: fine
    assert dev.memcpy_dtoh(z, b).tolist() == [2.0] * 4


@pytest.mark.parametrize("second", ["kernel", "h2d"])
def test_unordered_write_after_read_races(second):
    dev, a, b, x, y = setup()
    a.launch(P.fill, [x], {"value": 2.0})
    a.synchronize()
    a.launch(P.copy, [y, x])  # reads x
    who = "kernel 'fill'" if second == "kernel" else "memcpy HtoD"
    with pytest.raises(StreamOrderRace, match=f"{who} on {b.label} writes .*, which kernel 'copy' on {a.label} reads"):
        if second == "kernel":
            b.launch(P.fill, [x], {"value": 3.0})
        else:
            dev.memcpy_htod_async(x, np.zeros(4, np.float32), b)


def test_unordered_writes_race_but_disjoint_bytes_do_not():
    dev, a, b, x, y = setup()
    big = dev.malloc(32)
    lo, hi = ArrayRef(big, (4,), F32), ArrayRef(big, (4,), F32, offset=16)
    a.launch(P.fill, [lo], {"value": 1.0})
    b.launch(P.fill, [hi], {"value": 2.0})  # same allocation, other bytes
    overlap = f"kernel 'fill' on {b.label} writes .*, which kernel 'fill' on {a.label} writes"
    with pytest.raises(StreamOrderRace, match=overlap):
        b.launch(P.fill, [ArrayRef(big, (2,), F32, offset=8)], {"value": 3.0})


@pytest.mark.parametrize("reader", sorted(READERS))
def test_race_check_off_does_not_raise(reader):
    dev, a, b, x, y = setup(race_check=False)
    a.launch(P.fill, [x], {"value": 1.0})
    READERS[reader](dev, b, x, y)
    b.launch(P.fill, [x], {"value": 3.0})  # write-after-write, unordered
    dev.synchronize()
    assert dev.memcpy_dtoh(x, a).tolist() == [3.0] * 4  # executed in enqueue order on device sync


def test_a_refused_enqueue_leaves_no_phantom_accesses():
    dev, a, b, x, y = setup()
    a.launch(P.fill, [x], {"value": 1.0})
    with pytest.raises(StreamOrderRace):
        dev.memcpy_dtod_async(y, x, b)  # writes y (checked first, recorded) then reads x (races)
    assert b.pending == 0
    a.launch(P.fill, [y], {"value": 2.0})  # y was never touched by any queued op


def _program(rt):
    """Runtime calls that move data across its compute and copy streams."""
    a = rt.upload(np.arange(4, dtype=np.float32))
    b = rt.empty(4)
    rt.launch(P.scale_add, b, a, alpha=2.0, beta=1.0)  # compute reads what the copy stream wrote
    rt.write(a, np.ones(4, np.float32))  # copy stream overwrites what compute read
    rt.launch(P.accumulate, b, a)
    c = rt.empty(4)
    rt.copy(c, b)  # copy stream reads what compute wrote
    rt.launch(P.accumulate, c, a)
    rt.free(a)  # a queued kernel still reads a
    d = rt.upload(np.full(4, 5.0, np.float32))
    rt.launch(P.accumulate, c, d)
    rt.begin_capture("primary")
    rt.launch(P.accumulate, c, d)
    rt.copy(b, c)
    rt.end_capture("primary")
    rt.replay("primary")
    rt.replay("primary")
    rt.write(d, np.zeros(4, np.float32))
    rt.free(b)
    e = rt.empty(4)
    rt.copy(e, c)
    got = rt.download(c).tolist(), rt.download(e).tolist()
    rt.drain_for_unmap()
    for t in (c, d, e):
        rt.free(t)
    return got


def test_runtime_paths_never_race():
    dev = SimDevice()  # race_check=True is the default
    assert dev.race_check
    rt = Runtime(dev, RuntimeConfig())
    assert _program(rt) == ([18.0, 20.0, 22.0, 24.0],) * 2
    rt.close()
    assert not [m for m in dev._maps.values() if m.kind == "pool"]


def test_the_program_can_race_a_runtime_that_skips_a_barrier():
    rt = CopyWithoutForcedSync(SimDevice(), RuntimeConfig())
    with pytest.raises(StreamOrderRace, match=r"memcpy DtoD on stream\d+ reads .* which kernel 'accumulate'"):
        _program(rt)


# -- polling a busy stream or event observes nothing (issue 16: a poll that forgot a pending write)

def _poll_stream(dev, a):
    assert a.query() is False  # busy: the fill has not executed


def _poll_event(dev, a):
    ev = dev.event()
    a.record(ev)
    assert ev.query() is False  # recorded after the fill, not yet complete


def _poll_unrecorded_event(dev, a):
    assert dev.event().query() is True  # complete by definition, but it orders nothing


POLLS = {"stream query": _poll_stream, "event query": _poll_event, "unrecorded event query": _poll_unrecorded_event}


@pytest.mark.parametrize("poll", list(POLLS))
@pytest.mark.parametrize("reader", sorted(READERS))
def test_a_poll_that_finds_work_pending_does_not_order_it(poll, reader):
    """Guarantee: only a host call that observed the write complete orders it before later work; a
    query answering "not done" (or an event with no record) keeps the pending write in the race
    checker, so a later unordered cross-stream read raises instead of reading poisoned bytes."""
    dev, a, b, x, y = setup()
    a.launch(P.fill, [x], {"value": 1.0})
    POLLS[poll](dev, a)
    with pytest.raises(StreamOrderRace, match=f"reads 0x{x.addr:x}.*which kernel 'fill' on {a.label} writes"):
        READERS[reader](dev, b, x, y)


def test_an_event_query_that_finds_the_record_done_orders_it():
    """Guarantee: a query that answers "done" is a host observation, like a synchronize. The fill
    and the record execute here only because the queue bound forces them, so the query is the
    only observation."""
    dev = SimDevice(queue_bound=1)
    a, b = dev.stream(), dev.stream()
    x, y, z = (ArrayRef(dev.malloc(16), (4,), F32) for _ in range(3))
    ev = dev.event()
    a.launch(P.fill, [x], {"value": 1.0})
    a.record(ev)  # the bound executes the fill
    a.launch(P.fill, [z], {"value": 0.0})  # ... and the record
    with pytest.raises(StreamOrderRace):  # not yet observed: still a race
        dev.memcpy_dtod_async(y, x, b)
    assert ev.query() is True
    dev.memcpy_dtod_async(y, x, b)
    assert dev.memcpy_dtoh(y, b).tolist() == [1.0] * 4


def test_the_runtime_reaping_pending_frees_while_busy_does_not_order_the_queued_work():
    """Guarantee: the runtime's non-blocking reap of pending frees (an event query per call) is not
    a host synchronisation: a write still queued on its compute stream stays a pending write for
    the race checker, so a cross-stream read of it raises."""
    dev = SimDevice()
    rt = Runtime(dev, RuntimeConfig())
    x = rt.empty(4, name="x")
    rt.launch(P.fill, x, value=1.0)
    rt.free(rt.empty(4, name="tmp"))  # a pending free, its event recorded after the fill
    rt.empty(4, name="y")  # reaps: the event query finds the fill still queued
    assert rt.pending_frees == 1
    other = dev.stream()
    with pytest.raises(StreamOrderRace, match=f"memcpy DtoH on {other.label} reads .*which kernel 'fill'"):
        dev.memcpy_dtoh(x.ref, other)


@pytest.mark.parametrize("first,second", [(True, True), (False, True), (True, False)])
def test_a_later_access_to_other_bytes_does_not_hide_an_earlier_one(first, second):
    """Guarantee: an access is forgotten only when a later access ordered after it covers its
    bytes: a write (or read) to other bytes of the same allocation on the same stream must not
    erase the earlier access, or an unordered cross-stream access to those bytes goes unseen."""
    dev, a, b, x, y = setup()
    big = dev.malloc(32)
    lo, hi = ArrayRef(big, (4,), F32), ArrayRef(big, (4,), F32, offset=16)
    dev.memcpy_htod_async(lo, np.ones(4, np.float32), a)
    dev.memcpy_htod_async(hi, np.ones(4, np.float32), a)
    a.synchronize()
    op = {True: lambda r: a.launch(P.fill, [r], {"value": 2.0}), False: lambda r: a.launch(P.copy, [y, r])}
    op[first](lo)
    op[second](hi)  # same stream, other bytes
    kind = "writes" if first else "reads"
    with pytest.raises(StreamOrderRace, match=f"0x{lo.addr:x}.* which kernel '(fill|copy)' on {a.label} {kind}"):
        if first:
            dev.memcpy_dtoh(lo, b)  # reads what the first op writes
        else:
            b.launch(P.fill, [lo], {"value": 3.0})  # writes what the first op reads


def test_a_wait_on_an_event_whose_record_already_executed_still_orders():
    """Guarantee: a wait orders the waiting stream after the record whether or not the record has
    executed yet; executing is not observing (no host call saw it complete), so the wait is the
    only ordering here. The queue bound executes the fill and the record, as a busy GPU would."""
    dev = SimDevice(queue_bound=1)
    a, b = dev.stream(), dev.stream()
    x, y, z = (ArrayRef(dev.malloc(16), (4,), F32) for _ in range(3))
    ev = dev.event()
    a.launch(P.fill, [x], {"value": 1.0})
    a.record(ev)  # the bound executes the fill
    a.launch(P.fill, [z], {"value": 0.0})  # ... and the record
    assert a.pending == 1 and dev.executed == ["fill"]
    b.wait(ev)
    dev.memcpy_dtod_async(y, x, b)  # ordered by the wait alone
    assert dev.memcpy_dtoh(y, b).tolist() == [1.0] * 4



def test_a_replayed_graph_is_race_checked_on_every_launch_and_after_memory_moves():
    """Contract (simulated device: a graph's accesses are resolved against the address map once and
    reused while no mapping was made or removed): every launch of a graph is checked and recorded
    like its first. A write on another stream racing the second launch is refused; after the
    graph's buffer was freed and a larger allocation took its address (starting below it), a
    launch is bucketed by that allocation: a write to those bytes through it races; once that
    allocation is freed too, the launch faults when it runs."""
    from lockstep.reference_runtime.errors import IllegalAddress

    dev, a, b, x, y = setup()
    z = ArrayRef(dev.malloc(16), (4,), F32)  # pool slots of 512 bytes: x, y, z in address order
    a.begin_capture()
    a.launch(P.fill, [z], {"value": 2.0})
    g = a.end_capture()
    g.launch(a)
    a.synchronize()
    g.launch(a)  # resolved accesses reused: nothing was mapped or unmapped since
    with pytest.raises(StreamOrderRace, match=f"memcpy HtoD on {b.label} writes .*, which kernel 'fill' on {a.label} writes"):
        dev.memcpy_htod_async(z, np.zeros(4, np.float32), b)
    a.synchronize()
    assert dev.memcpy_dtoh(z, a).tolist() == [2.0] * 4
    dev.free(y.buffer)
    dev.free(z.buffer)
    big = dev.malloc(1024)  # first fit: y's and z's slots, merged
    assert big.addr == y.addr and big.addr < z.addr < big.addr + 1024
    g.launch(a)  # the map moved: resolved again, the fill now inside `big`
    through_big = ArrayRef(big, (4,), F32, offset=z.addr - big.addr)
    with pytest.raises(StreamOrderRace, match=f"memcpy HtoD on {b.label} writes .*, which kernel 'fill'"):
        dev.memcpy_htod_async(through_big, np.zeros(4, np.float32), b)
    a.synchronize()
    assert dev.memcpy_dtoh(through_big, a).tolist() == [2.0] * 4
    dev.free(big)
    g.launch(a)
    with pytest.raises(IllegalAddress):
        a.synchronize()
