"""Unit tests of the simulated device: lazy execution, pool and VMM memory, sticky errors, capture."""

from __future__ import annotations

import numpy as np
import pytest
from lockstep.kernels import primitives as P
from lockstep.kernels._kernel import Kernel, KernelHostError
from lockstep.reference_runtime.backends import ArrayRef
from lockstep.reference_runtime.backends import sim as sim_backend
from lockstep.reference_runtime.backends.sim import DEFAULT_MEMORY_CAP, SimDevice
from lockstep.reference_runtime.errors import (
    CaptureD2HRefused,
    CaptureOnLegacyStream,
    CaptureUnmodelled,
    CublasDuringCapture,
    IllegalAddress,
    IllegalState,
    InvalidValue,
    MemoryAllocation,
    StreamCaptureInvalidated,
    StreamCaptureUnsupported,
    StreamOrderRace,
)

F32 = np.dtype(np.float32)


def arr(dev, n=4, dtype=F32):
    return ArrayRef(dev.malloc(n * np.dtype(dtype).itemsize), (n,), np.dtype(dtype))


def get(dev, ref, stream):  # a synchronous read of one stream's view
    return dev.memcpy_dtoh(ref, stream).tolist()


def test_enqueue_executes_nothing_and_dtoh_executes_only_its_dependencies():
    dev = SimDevice()
    a, b, c = dev.stream(), dev.stream(), dev.stream()
    x, z, w = arr(dev), arr(dev), arr(dev)
    ev = dev.event()
    a.launch(P.fill, [x], {"value": 1.0})
    a.record(ev)
    a.launch(P.fill, [z], {"value": 3.0})  # after the record: not needed by b
    c.launch(P.fill, [w], {"value": 4.0})  # unrelated stream
    b.wait(ev)
    assert (a.pending, b.pending, c.pending, dev.executed) == (3, 1, 1, [])  # nothing ran at enqueue
    assert get(dev, x, b) == [1.0] * 4  # runs b's wait, hence a up to the record, and nothing else
    assert (a.pending, b.pending, c.pending, dev.executed) == (1, 0, 1, ["fill"])
    assert get(dev, w, c) == [4.0] * 4 and a.pending == 1
    a.synchronize()
    assert a.pending == 0 and dev.executed == ["fill"] * 3 and get(dev, z, a) == [3.0] * 4


def test_queue_bound_executes_oldest_when_exceeded():
    dev = SimDevice(queue_bound=3)
    s = dev.stream()
    x = arr(dev)
    executed_after = []
    for i in range(5):
        s.launch(Kernel(f"k{i}", lambda xp, o: o.fill(0.0), writes=(0,)), [x])
        executed_after.append((s.pending, list(dev.executed)))
    # The queue holds queue_bound entries, no more: the 4th enqueue executes the oldest entry.
    assert executed_after == [(1, []), (2, []), (3, []), (3, ["k0"]), (3, ["k0", "k1"])]


def test_pool_reuses_lowest_hole_first_and_coalesces_neighbours():
    dev = SimDevice()
    bufs = [dev.malloc(500) for _ in range(4)]
    dev.free(bufs[0])
    assert dev.malloc(500).addr == bufs[0].addr  # same size: the very same address
    dev.free(bufs[3])
    dev.free(bufs[1])
    assert dev.malloc(512).addr == bufs[1].addr
    assert dev.malloc(512).addr == bufs[3].addr
    assert dev.malloc(512).addr > bufs[3].addr
    a, b, c, _guard = (dev.malloc(512) for _ in range(4))
    dev.free(a)
    dev.free(c)
    dev.free(b)  # joins both neighbours into one 1536-byte hole
    assert dev.malloc(1536).addr == a.addr


def test_new_memory_is_poisoned_even_when_reused():
    dev = SimDevice()
    s = dev.stream()
    x = arr(dev)
    raw = dev.memcpy_dtoh(ArrayRef(x.buffer, (16,), np.dtype(np.uint8)), s)
    assert (raw == 0xFF).all() and np.isnan(dev.memcpy_dtoh(x, s)).all()
    s.launch(P.fill, [x], {"value": 1.0})
    s.synchronize()
    dev.free(x.buffer)
    again = arr(dev)
    assert again.addr == x.addr and np.isnan(dev.memcpy_dtoh(again, s)).all()


def test_vmm_reserve_map_unmap_free_cycle():
    dev = SimDevice()
    s = dev.stream()
    g = dev.granularity
    va = dev.reserve(2 * g)
    h = dev.mem_create(g)
    buf = dev.mem_map(va + g, g, h)
    assert buf.addr == va + g and buf.handle == "vmm"
    w = ArrayRef(buf, (4,), F32)
    dev.memcpy_htod_async(w, np.arange(4, dtype=np.float32), s)
    assert get(dev, w, s) == [0.0, 1.0, 2.0, 3.0]
    with pytest.raises(InvalidValue, match="still has mappings"):
        dev.address_free(va, 2 * g)
    with pytest.raises(InvalidValue, match="no mapping of that range"):
        dev.mem_unmap(va + g, 2 * g)
    dev.mem_unmap(va + g, g)
    dev.mem_release(h)
    dev.address_free(va, 2 * g)
    with pytest.raises(InvalidValue, match="no such reservation"):
        dev.address_free(va, 2 * g)


@pytest.mark.parametrize("call", ["reserve", "mem_create"])
@pytest.mark.parametrize("size", [0, -2 << 20, 4096, (2 << 20) + 1])
def test_vmm_sizes_must_be_granules(call, size):
    dev = SimDevice()
    with pytest.raises(InvalidValue, match=rf"{call} size {size} is not a positive multiple"):
        getattr(dev, call)(size)


def test_mem_map_outside_reservation_or_overlapping_is_refused():
    dev = SimDevice()
    g = dev.granularity
    va = dev.reserve(g)
    with pytest.raises(InvalidValue, match="outside every reserved range"):
        dev.mem_map(va, 2 * g, dev.mem_create(2 * g))  # runs past the reservation's end
    with pytest.raises(InvalidValue, match="outside every reserved range"):
        dev.mem_map(va + 2 * g, g, dev.mem_create(g))  # the guard granule after it
    with pytest.raises(InvalidValue, match="differs from the handle"):
        dev.mem_map(va, g, dev.mem_create(2 * g))
    dev.mem_map(va, g, dev.mem_create(g))
    with pytest.raises(InvalidValue, match=f"overlaps the mapping at 0x{va:x}"):
        dev.mem_map(va, g, dev.mem_create(g))
    wide = dev.reserve(2 * g)
    dev.mem_map(wide, 2 * g, dev.mem_create(2 * g))
    with pytest.raises(InvalidValue, match=f"overlaps the mapping at 0x{wide:x}"):
        dev.mem_map(wide + g, g, dev.mem_create(g))  # inside the tail of the lower mapping


def test_kernel_after_free_is_a_sticky_illegal_address():
    dev = SimDevice()
    s, other = dev.stream(), dev.stream()
    acc, x, y = arr(dev), arr(dev), arr(dev)
    s.launch(P.accumulate, [acc, x])
    other.launch(P.fill, [y], {"value": 1.0})
    dev.free(x.buffer)  # returns at once; the queued reader has not executed
    with pytest.raises(IllegalAddress, match=r"kernel 'accumulate' on stream\d+ touched .* not mapped") as first:
        s.synchronize()
    assert dev.sticky_error is first.value
    assert other.pending == 0 and s.pending == 0 and dev.executed == []  # queues discarded
    for call in (lambda: dev.malloc(16), lambda: s.launch(P.fill, [acc], {"value": 0.0}), dev.stream,
                 dev.synchronize, other.synchronize, dev.event, lambda: dev.memcpy_dtoh(y, other)):
        with pytest.raises(IllegalAddress) as again:
            call()
        assert again.value is first.value


def test_kernel_body_exception_is_a_host_error_raised_once_not_a_sticky_fault():
    boom = Kernel("boom_kernel", lambda xp, out: 1 // 0, writes=(0,))
    dev = SimDevice()
    s = dev.stream()
    x = arr(dev)
    s.launch(boom, [arr(dev)])
    s.launch(P.fill, [x], {"value": 2.0})  # queued after the failing body: still executes
    with pytest.raises(KernelHostError, match=r"kernel 'boom_kernel': kernel host code raised ZeroDivisionError") as err:
        s.synchronize()
    assert isinstance(err.value.__cause__, ZeroDivisionError) and dev.sticky_error is None
    assert get(dev, x, s) == [2.0] * 4  # raised once; the device stays usable
    dev.malloc(16)


@pytest.mark.parametrize("which", ["stream", "device", "query"])
def test_synchronize_or_query_in_capture_invalidates(which):
    dev = SimDevice()
    s = dev.stream()
    x = arr(dev)
    s.begin_capture()
    s.launch(P.fill, [x], {"value": 2.0})
    if which == "query":
        assert s.query() is False  # no error at the call
    else:
        with pytest.raises(StreamCaptureUnsupported, match="capturing"):
            (s if which == "stream" else dev).synchronize()
    reason = {"stream": "stream synchronize", "device": "device synchronize", "query": "stream query"}[which]
    with pytest.raises(StreamCaptureInvalidated, match=f"on {s.label} was invalidated by a {reason} during"):
        s.end_capture()
    assert not s.is_capturing and dev.executed == []


def test_dtoh_and_cublas_in_capture_are_refused_without_invalidating():
    dev = SimDevice()
    s = dev.stream()
    x = arr(dev)
    c = ArrayRef(dev.malloc(16), (2, 2), F32)
    a2 = ArrayRef(x.buffer, (2, 2), F32)
    s.begin_capture()
    s.launch(P.fill, [x], {"value": 3.0})
    with pytest.raises(CaptureD2HRefused, match="capturing"):
        dev.memcpy_dtoh(x, s)
    with pytest.raises(CublasDuringCapture, match="kernel 'matmul_cublas' calls cuBLAS"):
        s.launch(P.matmul_cublas, [c, a2, a2])
    g = s.end_capture()
    assert dev.executed == []
    g.launch(s)
    assert get(dev, x, s) == [3.0] * 4
    s.launch(P.matmul_cublas, [c, a2, a2])  # fine outside a capture
    assert get(dev, c, s) == [[18.0, 18.0], [18.0, 18.0]]


def test_capture_state_errors():
    dev = SimDevice()
    with pytest.raises(CaptureOnLegacyStream, match="legacy default stream"):
        dev.stream(legacy=True).begin_capture()
    s = dev.stream()
    with pytest.raises(IllegalState, match=f"end_capture on {s.label}, which is not capturing"):
        s.end_capture()
    s.begin_capture()
    with pytest.raises(IllegalState, match=f"{s.label} is already capturing"):
        s.begin_capture()
    assert s.is_capturing and s.end_capture() is not None


def test_graph_replay_resolves_addresses_at_execution():
    dev = SimDevice()
    s = dev.stream()
    out, src = arr(dev), arr(dev)
    s.launch(P.fill, [src], {"value": 7.0})
    s.begin_capture()
    s.launch(P.copy, [out, src])
    g = s.end_capture()
    g.launch(s)
    assert get(dev, out, s) == [7.0] * 4
    dev.free(src.buffer)
    again = arr(dev)
    assert again.addr == src.addr
    dev.memcpy_htod_async(again, np.full(4, 9.0, np.float32), s)
    g.launch(s)
    assert get(dev, out, s) == [9.0] * 4


def test_bad_frees_and_mismatched_copies_are_invalid_values():
    dev = SimDevice()
    buf = dev.malloc(16)
    dev.free(buf)
    with pytest.raises(InvalidValue, match=f"0x{buf.addr:x}.*double free"):
        dev.free(buf)
    va = dev.reserve(dev.granularity)
    mapped = dev.mem_map(va, dev.granularity, dev.mem_create(dev.granularity))
    with pytest.raises(InvalidValue, match=f"0x{va:x}.*is not pool memory \\(vmm\\)"):
        dev.free(mapped)
    with pytest.raises(InvalidValue, match=r"is not pool memory \(raw\)"):
        dev.free(dev.buffer_at(va, 16))
    with pytest.raises(InvalidValue, match="belongs to another device"):
        dev.free(SimDevice().malloc(16))
    s = dev.stream()
    x = ArrayRef(dev.malloc(16), (2, 2), F32)
    with pytest.raises(InvalidValue, match=r"shape \(4,\) does not fit <ArrayRef .* float32\[2, 2\]>"):
        dev.memcpy_htod_async(x, np.zeros(4, np.float32), s)
    small, big = arr(dev, 2), arr(dev, 8)
    with pytest.raises(InvalidValue, match="D2D copy of 32 bytes into 8 bytes"):
        dev.memcpy_dtod_async(small, big, s)
    with pytest.raises(InvalidValue, match="D2D copy of 8 bytes into 32 bytes"):
        dev.memcpy_dtod_async(big, small, s)
    with pytest.raises(InvalidValue, match=f"mem_unmap 0x{x.addr:x}\\+512: no mapping of that range"):
        dev.mem_unmap(x.addr, 512)  # pool memory is not a VMM mapping
    assert s.pending == 0


COPIES_INTO = {  # (what, a copy on stream s that names ``ref``): the three cudaMemcpyAsync directions
    "memcpy HtoD": lambda dev, s, ref, other: dev.memcpy_htod_async(ref, np.ones(4, np.float32), s),
    "memcpy DtoH": lambda dev, s, ref, other: dev.memcpy_dtoh(ref, s),
    "memcpy DtoD dst": lambda dev, s, ref, other: dev.memcpy_dtod_async(ref, other, s),
    "memcpy DtoD src": lambda dev, s, ref, other: dev.memcpy_dtod_async(other, ref, s),
}


@pytest.mark.parametrize("copy", list(COPIES_INTO))
def test_a_copy_naming_an_unmapped_range_is_refused_at_the_call(copy):
    """Guarantee (cudaMemcpyAsync validates its pointers at the call): a copy into or out of a range
    that is not mapped when it is enqueued is InvalidValue at once, nothing queued, not sticky,
    even when the range is mapped before the copy would execute. Kernels are not checked at launch."""
    dev = SimDevice()
    s = dev.stream()
    g = dev.granularity
    va = dev.reserve(g)
    nowhere, other = ArrayRef(dev.buffer_at(va, 16), (4,), F32), arr(dev)
    what = copy.rsplit(" ", 1)[0] if "DtoD" in copy else copy
    with pytest.raises(InvalidValue, match=f"{what} on {s.label}: 0x{va:x}..0x{va + 16:x} is not mapped at the call"):
        COPIES_INTO[copy](dev, s, nowhere, other)
    assert s.pending == 0 and dev.sticky_error is None
    dev.mem_map(va, g, dev.mem_create(g))  # mapped now: the refused copy must not run later
    s.synchronize()
    assert get(dev, nowhere, s) != [1.0] * 4  # poisoned backing, never written
    COPIES_INTO[copy](dev, s, nowhere, other)  # mapped at the call: accepted
    s.launch(P.fill, [ArrayRef(dev.buffer_at(va + g, 16), (4,), F32)], {"value": 1.0})  # unmapped: no error yet
    with pytest.raises(IllegalAddress):
        s.synchronize()


def test_a_freed_pool_range_is_refused_at_the_copy_call():
    """Guarantee: the check at the call covers pool memory too: a copy into freed memory nobody
    reallocated is InvalidValue at once, and the device stays usable."""
    dev = SimDevice()
    s = dev.stream()
    x = arr(dev)
    dev.free(x.buffer)
    with pytest.raises(InvalidValue, match=f"memcpy HtoD on {s.label}: 0x{x.addr:x}.*not mapped at the call"):
        dev.memcpy_htod_async(x, np.ones(4, np.float32), s)
    y = arr(dev)
    dev.memcpy_htod_async(y, np.ones(4, np.float32), s)
    assert get(dev, y, s) == [1.0] * 4


@pytest.mark.parametrize("direction", ["HtoD", "DtoD"])
def test_a_copy_unmapped_after_the_call_faults_at_execution(direction):
    """Guarantee: the call-time check does not replace the execution-time one: memory unmapped
    after a copy was enqueued faults with a sticky IllegalAddress when the copy executes."""
    dev = SimDevice()
    s = dev.stream()
    g = dev.granularity
    va = dev.reserve(g)
    dev.mem_map(va, g, dev.mem_create(g))
    dst = ArrayRef(dev.buffer_at(va, 16), (4,), F32)
    if direction == "HtoD":
        dev.memcpy_htod_async(dst, np.ones(4, np.float32), s)
    else:
        dev.memcpy_dtod_async(dst, arr(dev), s)
    dev.mem_unmap(va, g)
    with pytest.raises(IllegalAddress, match=f"memcpy {direction} on {s.label} touched 0x{va:x}.*not mapped"):
        s.synchronize()
    assert dev.sticky_error is not None


def test_a_dtod_copy_captured_from_an_unmapped_range_is_refused_at_the_call():
    """Guarantee: the call-time check holds inside a capture too (the call is the same
    cudaMemcpyAsync); the capture stays valid. A replay still resolves its addresses at execution."""
    dev = SimDevice()
    s = dev.stream()
    va = dev.reserve(dev.granularity)
    nowhere, out = ArrayRef(dev.buffer_at(va, 16), (4,), F32), arr(dev)
    s.begin_capture()
    with pytest.raises(InvalidValue, match="memcpy DtoD .* not mapped at the call"):
        dev.memcpy_dtod_async(out, nowhere, s)
    assert s.end_capture().nodes == []


def test_a_re_recorded_event_stands_for_its_latest_record():
    """Guarantee (cudaEventRecord on a used event): recording an event again replaces what it
    stands for; query, wait and synchronize follow the latest record, not the first."""
    dev = SimDevice()
    a, b = dev.stream(), dev.stream()
    x, y, z = arr(dev), arr(dev), arr(dev)
    ev = dev.event()
    a.launch(P.fill, [x], {"value": 1.0})
    a.record(ev)
    ev.synchronize()
    assert ev.query() is True
    a.launch(P.fill, [y], {"value": 2.0})
    a.record(ev)  # reused: now it stands for the fill of y
    assert ev.query() is False
    b.wait(ev)
    b.launch(P.copy, [z, y])  # ordered after the fill of y by the wait: no race
    assert get(dev, z, b) == [2.0] * 4
    assert ev.query() is True and a.pending == 0


def test_an_event_recorded_into_a_capture_queues_nothing_and_can_be_recorded_again():
    """Guarantee (sim.py: event records are fine in a capture): a record during capture is a graph
    node; nothing is queued, so after end_capture the stream is idle; the event keeps its eager
    record until it is recorded again outside the capture, and then orders as usual."""
    dev = SimDevice()
    s, other = dev.stream(), dev.stream()
    x, out = arr(dev), arr(dev)
    ev = dev.event()
    s.launch(P.fill, [x], {"value": 1.0})
    s.record(ev)
    s.synchronize()
    s.begin_capture()
    s.launch(P.accumulate, [x, x])
    s.record(ev)
    g = s.end_capture()
    assert s.pending == 0 and s.query() is True and ev.query() is True
    assert [kind for kind, _ in g.nodes] == ["kernel", "record"]
    g.launch(s)
    s.record(ev)  # an eager record after the replay: waiting on it orders the replay's write
    other.wait(ev)
    other.launch(P.copy, [out, x])
    assert get(dev, out, other) == [2.0] * 4


def test_a_dtod_copy_in_a_capture_is_a_graph_node_run_by_each_replay():
    """Guarantee (docs/cuda-semantics.md: memcpyAsync D2D is capturable): the copy is recorded, not
    executed or queued; each replay copies the bytes its source holds at that replay, in stream
    order with the graph's kernels; the replayed copy's write is seen by the race checker."""
    dev = SimDevice()
    s = dev.stream()
    src, dst = arr(dev), arr(dev)
    s.launch(P.fill, [src], {"value": 1.0})
    s.launch(P.fill, [dst], {"value": 0.0})
    s.synchronize()
    s.begin_capture()
    dev.memcpy_dtod_async(dst, src, s)
    s.launch(P.accumulate, [src, src])  # after the copy: the copy reads src before it doubles
    assert s.pending == 0
    g = s.end_capture()
    assert s.query() is True and get(dev, dst, s) == [0.0] * 4  # the capture executed nothing
    g.launch(s)
    assert get(dev, dst, s) == [1.0] * 4 and get(dev, src, s) == [2.0] * 4
    dev.memcpy_htod_async(src, np.full(4, 5.0, np.float32), s)
    g.launch(s)
    assert get(dev, dst, s) == [5.0] * 4  # the replay reads src as it is now
    g.launch(s)
    with pytest.raises(StreamOrderRace, match=f"memcpy DtoH on .* reads 0x{dst.addr:x}.*graph memcpy DtoD on {s.label} writes"):
        dev.memcpy_dtoh(dst, dev.stream())


def test_unmodelled_calls_in_a_capture_are_refused_and_queue_nothing():
    """Guarantee (sim.py): what the simulator does not model during capture (an HtoD copy, a wait
    on an event, launching a graph into the capturing stream) is CaptureUnmodelled at the call,
    never silently queued on the capturing stream."""
    dev = SimDevice()
    s = dev.stream()
    x = arr(dev)
    ev = dev.event()
    s.record(ev)
    s.begin_capture()
    s.launch(P.fill, [x], {"value": 1.0})
    with pytest.raises(CaptureUnmodelled, match="host-to-device copy during capture"):
        dev.memcpy_htod_async(x, np.ones(4, np.float32), s)
    with pytest.raises(CaptureUnmodelled, match="waiting on an event during capture"):
        s.wait(ev)
    s2 = dev.stream()
    s2.begin_capture()
    g = s2.end_capture()
    with pytest.raises(CaptureUnmodelled, match="launching a graph into a capturing stream"):
        g.launch(s)
    assert s.pending == 1  # the record before the capture, nothing after it
    assert [kind for kind, _ in s.end_capture().nodes] == ["kernel"]


def test_a_range_running_past_its_mapping_is_not_mapped():
    """Guarantee: an access is inside a mapping only when all its bytes are: a copy whose range
    starts in a mapping and runs past its end is refused at the call (InvalidValue), a kernel
    doing so faults at execution (IllegalAddress)."""
    dev = SimDevice()
    s = dev.stream()
    g = dev.granularity
    va = dev.reserve(g)
    dev.mem_map(va, g, dev.mem_create(g))
    straddle = ArrayRef(dev.buffer_at(va + g - 8, 16), (4,), F32)  # 8 bytes in, 8 in the guard granule
    with pytest.raises(InvalidValue, match="memcpy HtoD .* is not mapped at the call"):
        dev.memcpy_htod_async(straddle, np.ones(4, np.float32), s)
    with pytest.raises(InvalidValue, match="memcpy DtoH .* is not mapped at the call"):
        dev.memcpy_dtoh(straddle, s)
    assert dev.sticky_error is None
    s.launch(P.fill, [straddle], {"value": 1.0})
    with pytest.raises(IllegalAddress, match=f"kernel 'fill' on {s.label} touched 0x{va + g - 8:x}"):
        s.synchronize()


def test_a_replay_stops_at_its_first_fault():
    """Guarantee: a fault is latched when the faulting work executes and nothing executes after it;
    in a replay, the later nodes do not run, and the sticky error names the first faulting kernel."""
    dev = SimDevice()
    s = dev.stream()
    g = dev.granularity
    va = dev.reserve(g)
    acc = arr(dev)
    nowhere = ArrayRef(dev.buffer_at(va, 16), (4,), F32)
    first = Kernel("first_reader", lambda xp, o, x: xp.add(o, x, out=o), writes=(0,))
    second = Kernel("second_reader", lambda xp, o, x: xp.add(o, x, out=o), writes=(0,))
    s.begin_capture()
    s.launch(first, [acc, nowhere])
    s.launch(P.fill, [acc], {"value": 1.0})
    s.launch(second, [acc, nowhere])
    graph = s.end_capture()
    graph.launch(s)
    with pytest.raises(IllegalAddress, match="kernel 'first_reader'"):
        s.synchronize()
    assert dev.executed == [] and "first_reader" in str(dev.sticky_error)


def test_allocated_bytes_counts_pool_and_physical_memory():
    """Guarantee (_base.Device.allocated_bytes): pool allocations at their rounded size plus
    physical VMM memory created and not yet released; a free or a release gives its bytes back
    once; mapping and unmapping change nothing (the backing is counted where it is created)."""
    dev = SimDevice()
    g = dev.granularity
    assert dev.allocated_bytes == 0
    a, b = dev.malloc(100), dev.malloc(1024)
    assert dev.allocated_bytes == 512 + 1024  # pool allocations are rounded to 512 bytes
    dev.free(a)
    assert dev.allocated_bytes == 1024
    h = dev.mem_create(g)
    assert dev.allocated_bytes == 1024 + g
    va = dev.reserve(g)
    dev.mem_map(va, g, h)
    assert dev.allocated_bytes == 1024 + g
    dev.mem_release(h)  # the backing lives on while mapped, but it is no longer counted
    dev.mem_release(h)
    assert dev.allocated_bytes == 1024
    dev.mem_unmap(va, g)
    dev.free(b)
    assert dev.allocated_bytes == 0


@pytest.mark.parametrize("host, cgroup, left, limit", [
    (8 << 30, None, None, 2 << 30),                       # a quarter of the host
    (512 << 30, None, None, DEFAULT_MEMORY_CAP),          # the cap
    (None, None, None, DEFAULT_MEMORY_CAP),               # the host does not say
    (64 << 30, 4 << 30, None, 1 << 30),                   # a container: a quarter of its cgroup limit
    (24 << 30, None, 4 << 30, 2 << 30),                   # ulimit -v: half the address space left
])
def test_the_default_budget_is_the_least_of_what_the_process_may_hold(monkeypatch, host, cgroup, left, limit):
    """Guarantee (SimDevice.default_memory_limit): min(16 GiB, host memory / 4, cgroup limit / 4,
    address space left under RLIMIT_AS / 2): the budget refuses before the host can (issue 29: a
    5.9 GiB budget under a 4 GiB RLIMIT_AS never refused, the host's MemoryError came first)."""
    from lockstep import host_memory

    monkeypatch.setattr(host_memory, "physical_memory", lambda: host)
    monkeypatch.setattr(host_memory, "cgroup_memory_limit", lambda: cgroup)
    monkeypatch.setattr(host_memory, "address_space_left", lambda: left)
    assert SimDevice().default_memory_limit() == limit, "contract"


def test_a_held_host_error_is_raised_at_the_next_launch():
    """Guarantee (sim.py: kernel host errors): a body that raised is held and raised once at the
    next launch *or* synchronising call after it ran. Here the queue bound runs the body, so the
    next launch is the first call after it."""
    boom = Kernel("boom_kernel", lambda xp, out: 1 // 0, writes=(0,))
    dev = SimDevice(queue_bound=1)
    s = dev.stream()
    x = arr(dev)
    s.launch(boom, [x])
    s.launch(P.fill, [x], {"value": 2.0})  # the bound executes boom's body
    with pytest.raises(KernelHostError, match="boom_kernel"):
        s.launch(P.fill, [x], {"value": 3.0})
    assert s.pending == 1  # the refused launch queued nothing
    s.synchronize()  # raised once: the sync is clean
    assert get(dev, x, s) == [2.0] * 4 and dev.sticky_error is None


def test_a_body_the_host_cannot_back_is_memory_allocation_not_sticky():
    """Guarantee (sim.py): a kernel temporary the host cannot allocate is MemoryAllocation (CUDA's
    out-of-memory), raised once like any host error; the device stays usable."""

    def _oom(xp, out):
        xp.empty(1 << 62, dtype=np.uint8)  # numpy's own MemoryError subclass, as a real body raises

    dev = SimDevice()
    s = dev.stream()
    x = arr(dev)
    s.launch(Kernel("big_temp", _oom, writes=(0,)), [x])
    with pytest.raises(MemoryAllocation, match="kernel 'big_temp': a temporary could not be allocated") as err:
        s.synchronize()
    assert isinstance(err.value.__cause__, MemoryError) and dev.sticky_error is None
    s.launch(P.fill, [x], {"value": 1.0})
    assert get(dev, x, s) == [1.0] * 4


@pytest.mark.parametrize("nbytes", [1 << 62, 1 << 64])
def test_an_allocation_the_host_cannot_back_is_memory_allocation_and_changes_nothing(nbytes):
    """Guarantee (sim.py): a host that cannot back an allocation (numpy's MemoryError, or its
    ValueError past the largest array) is MemoryAllocation, and the refusal changes nothing."""
    dev = SimDevice()
    before = dev.malloc(16)
    with pytest.raises(MemoryAllocation, match="malloc of .* bytes: the host cannot back it"):
        dev.malloc(nbytes)
    assert dev.allocated_bytes == 512 and dev.malloc(16).addr == before.addr + 512


def test_a_device_synchronize_executes_in_global_enqueue_order():
    """Guarantee: with nothing ordering two streams, a device synchronize executes their work in
    the order it was enqueued across streams (the one deterministic interleaving)."""
    dev = SimDevice(race_check=False)
    a, b = dev.stream(), dev.stream()
    x = arr(dev)
    a.launch(P.fill, [x], {"value": 1.0})
    b.launch(P.fill, [x], {"value": 2.0})
    a.launch(P.accumulate, [x, x])
    dev.synchronize()
    assert get(dev, x, a) == [4.0] * 4  # 1, then 2, then doubled


@pytest.mark.parametrize("source", ["array", "bytearray view", "bytes view"])
def test_an_async_host_to_device_copy_takes_the_bytes_as_they_were_at_the_call(source):
    """Result: what the host changes after memcpy_htod_async returns (before the copy executes) never
    reaches the device. An array over immutable bytes (an initializer's raw_data) is taken without a
    copy (nothing can change it); any other array, read-only views of writable memory included, is
    copied at the call."""
    dev = SimDevice()
    s = dev.stream()
    ref = arr(dev)
    raw = np.arange(4, dtype=np.float32).tobytes()
    if source == "array":
        host = np.arange(4, dtype=np.float32)
        change = lambda: host.fill(7.0)  # noqa: E731
    elif source == "bytearray view":
        buf = bytearray(raw)
        host = np.frombuffer(buf, dtype=np.float32)
        change = lambda: buf.__setitem__(slice(0, 16), bytes(16))  # noqa: E731
    else:
        host = np.frombuffer(raw, dtype=np.float32)
        change = lambda: None  # noqa: E731  (bytes cannot change)
    assert sim_backend._immutable(host, np.float32) == (source == "bytes view")
    dev.memcpy_htod_async(ref, host, s)
    change()
    assert get(dev, ref, s) == [0.0, 1.0, 2.0, 3.0]
