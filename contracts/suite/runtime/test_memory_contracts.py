"""Contracts of memory release, the device error latch, and runtime lifetime."""

from __future__ import annotations

import gc

import numpy as np
import pytest
from lockstep.kernels import Kernel
from lockstep.kernels import primitives as P
from lockstep.reference_runtime import DeviceAssert, InvalidValue, RuntimeConfig, UseAfterFree

from ._busy import busy

UNIQUE_N = 12_345  # float32 elements; no other test buffer has this size


@pytest.mark.contract("stream-ordered-release")
def test_freed_buffer_not_reused_under_queued_reader(make_runtime):
    """Freeing a buffer that a queued kernel reads never lets its memory be reused before that
    kernel ran: a new allocation gets other memory, and the reader sees the old bytes."""
    rt = make_runtime()
    n = UNIQUE_N  # a size no other buffer has: a pool would hand this exact memory out again
    a = rt.upload(np.full(n, 2.0, np.float32))
    acc = rt.upload(np.zeros(n, np.float32))
    busy(rt)
    rt.launch(P.accumulate, acc, a)
    old = a.addr
    rt.free(a)
    b = rt.empty(n)
    assert b.addr != old, "contract: memory with a queued reader is not handed out again"
    rt.write(b, np.full(n, 7.0, np.float32))
    assert (rt.download(acc) == 2.0).all(), "result: the reader saw the freed buffer's bytes"
    rt.drain_for_unmap()
    assert rt.pending_frees == 0, "contract: released once its readers ran"


@pytest.mark.contract("error-latch-sticky")
def test_error_latch_is_sticky_and_blocks_nothing_else(make_runtime):
    """A kernel that sees an out-of-range index sets the device latch without a host read; the
    next synchronising read raises DeviceAssert naming the site, every read raises until
    reset_error_latch(), and the latch blocks neither drains, launches, allocations nor frees."""
    rt = make_runtime()
    table = rt.upload(np.arange(4, dtype=np.float32) * 10)
    out = rt.empty(2)
    good = rt.upload(np.array([1, 3], np.int64))
    bad = rt.upload(np.array([1, 9], np.int64))
    site = rt.latch_site("Gather_7")
    rt.launch(P.gather_checked, out, rt.error_latch, table, good, site=site)
    assert rt.download(out).tolist() == [10.0, 30.0], "result: in-range gather, latch untouched"

    busy(rt)
    downloads = rt.counters.downloads
    rt.launch(P.gather_checked, out, rt.error_latch, table, bad, site=site)
    assert not rt.compute.query() and rt.counters.downloads == downloads, "contract: no readback on the fast path"
    for _ in range(2):
        with pytest.raises(DeviceAssert, match="Gather_7"):
            rt.download(out)
    rt.drain_for_unmap()  # contract: a barrier is not blocked by the latch
    extra = rt.empty(2)
    rt.launch(P.fill, extra, value=1.0)
    rt.free(extra)
    with pytest.raises(DeviceAssert):
        rt.download(table)  # contract: still set after the other work
    rt.reset_error_latch()
    assert rt.download(table).tolist() == [0.0, 10.0, 20.0, 30.0], "contract: reset clears the latch"


@pytest.mark.contract("escape-hatch-reads-latch")
def test_real_synchronize_reads_the_latch(make_runtime):
    """With deferral off, synchronize() is a synchronising point: it raises a set latch."""
    rt = make_runtime(RuntimeConfig(defer_eager_sync=False))
    table = rt.upload(np.zeros(4, np.float32))
    out = rt.empty(1)
    bad = rt.upload(np.array([-1], np.int64))
    rt.launch(P.gather_checked, out, rt.error_latch, table, bad, site=rt.latch_site("Gather_0"))
    with pytest.raises(DeviceAssert, match="Gather_0"):
        rt.synchronize()


@pytest.mark.contract("drop-after-enqueue")
def test_dropping_runtime_or_kernel_after_enqueue_leaves_device_usable(device, make_runtime):
    """A runtime, or a kernel object, dropped right after an enqueue (no readback) leaves the
    device healthy: its queued work completes without faults and a new runtime works."""
    rt = make_runtime()
    src = rt.upload(np.full(UNIQUE_N + 1024, 1.0, np.float32))
    dst = rt.upload(np.zeros(UNIQUE_N, np.float32))  # a size a pool hands out again only for `fresh`
    busy(rt)
    temp = Kernel("temp_add", lambda xp, o, x: xp.add(o, x[: o.shape[0]], out=o), writes=(0,))
    rt.launch(temp, dst, src)
    del temp
    del rt, src, dst
    gc.collect()
    rt2 = make_runtime()
    fresh = rt2.upload(np.zeros(UNIQUE_N, np.float32))
    device.synchronize()  # contract: the dropped runtime's queued work ran without a fault
    assert (rt2.download(fresh) == 0.0).all(), "contract: dropped work never writes memory handed out again"
    y = rt2.upload(np.arange(3, dtype=np.float32))
    rt2.launch(P.accumulate, y, y)
    assert rt2.download(y).tolist() == [0.0, 2.0, 4.0], "result: a new runtime works"


def test_memory_bad_input(make_runtime):
    """Use after free and double free are refused with the object named; the runtime stays usable."""
    rt = make_runtime()
    x = rt.upload(np.ones(2, np.float32))
    rt.free(x)
    with pytest.raises(UseAfterFree, match=x.name):
        rt.launch(P.fill, x, value=0.0)
    with pytest.raises(UseAfterFree):
        rt.download(x)
    with pytest.raises(UseAfterFree):
        rt.free(x)
    other = make_runtime().upload(np.ones(2, np.float32))
    with pytest.raises(InvalidValue, match="another runtime"):
        rt.launch(P.fill, other, value=0.0)
    y = rt.upload(np.ones(2, np.float32))
    assert rt.download(y).tolist() == [1.0, 1.0]
