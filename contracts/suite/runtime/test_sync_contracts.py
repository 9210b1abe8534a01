"""Contracts of the synchronising primitives: synchronize, the forced synchronise, drain_for_unmap.

Assertions are labelled: ``contract:`` encodes a guarantee of the primitive (a failure means the
primitive changed its contract, or the contract is stale and needs a deliberate decision);
``result:`` encodes a computed value (a failure is a regression in the data path).
"""

from __future__ import annotations

import numpy as np
import pytest
from lockstep.kernels import primitives as P
from lockstep.reference_runtime import GraphSlot, RuntimeConfig, StreamCaptureInvalidated, StreamCaptureUnsupported

from ._busy import busy

DEFER = RuntimeConfig(defer_eager_sync=True)
NO_DEFER = RuntimeConfig(defer_eager_sync=False)


@pytest.mark.contract("enqueue-is-asynchronous")
def test_enqueue_returns_while_work_is_queued(make_runtime):
    """A launch returns to the host while the kernel is still queued: the host runs ahead."""
    rt = make_runtime(DEFER)
    busy(rt)
    x = rt.empty(4)
    rt.launch(P.fill, x, value=1.0)
    assert not rt.compute.query(), "contract: launch must not wait for the kernel"
    assert rt.download(x).tolist() == [1.0] * 4, "result: the queued work completes"


@pytest.mark.contract("deferred-synchronize-is-noop")
def test_deferred_synchronize_does_not_drain(make_runtime):
    """With eager-sync deferral on (the default), synchronize() leaves queued work queued."""
    rt = make_runtime(DEFER)
    busy(rt)
    rt.synchronize()
    assert not rt.compute.query(), "contract: deferred synchronize() must not drain the compute stream"
    assert rt.counters.syncs_deferred == 1 and rt.counters.syncs_real == 0, "contract: counted as deferred"


@pytest.mark.contract("escape-hatch-drains")
def test_synchronize_drains_with_deferral_off(make_runtime):
    """With deferral off (LOCKSTEP_DEFER_EAGER_SYNC=0), synchronize() drains the compute stream."""
    rt = make_runtime(NO_DEFER)
    busy(rt)
    rt.synchronize()
    assert rt.compute.query(), "contract: synchronize() with deferral off must drain"
    assert rt.counters.syncs_real == 1, "contract: counted as a real synchronisation"


@pytest.mark.contract("d2h-complete")
@pytest.mark.parametrize("config", [DEFER, NO_DEFER], ids=["defer", "no-defer"])
def test_download_sees_completed_work(make_runtime, config):
    """A device-to-host read always sees the work enqueued before it, whatever the deferral."""
    rt = make_runtime(config)
    x = rt.upload(np.ones(4, np.float32))
    busy(rt)
    rt.launch(P.fill, x, value=5.0)
    assert rt.download(x).tolist() == [5.0] * 4, "contract: download returns completed data"


@pytest.mark.contract("d2d-complete")
def test_device_copy_sees_completed_work(make_runtime):
    """A device-to-device copy reads its source after the work enqueued before it, and work
    enqueued after it reads the copied bytes."""
    rt = make_runtime(DEFER)
    x = rt.upload(np.ones(4, np.float32))
    y = rt.upload(np.zeros(4, np.float32))
    z = rt.upload(np.zeros(4, np.float32))
    busy(rt)
    rt.launch(P.fill, x, value=5.0)
    rt.copy(y, x)
    rt.launch(P.accumulate, z, y)
    assert rt.download(z).tolist() == [5.0] * 4, "contract: the copy saw the fill, the add saw the copy"


@pytest.mark.contract("drain-for-unmap-drains")
def test_drain_for_unmap_drains_both_streams(make_runtime):
    """drain_for_unmap() drains compute and copy streams even with deferral on, so memory a queued
    kernel reads can be unmapped right after it."""
    rt = make_runtime(DEFER)
    dev = rt.device
    g = dev.granularity
    va, h = dev.reserve(g), dev.mem_create(g)
    w = rt.wrap(dev.mem_map(va, g, h), (4,), np.float32, name="weights")
    acc = rt.upload(np.zeros(4, np.float32))
    rt.write(w, np.full(4, 3.0, np.float32))
    busy(rt)
    rt.launch(P.accumulate, acc, w)
    rt.drain_for_unmap()
    assert rt.compute.query() and rt.copy_stream.query(), "contract: both streams drained"
    dev.mem_unmap(va, g)
    dev.mem_release(h)
    dev.address_free(va, g)
    assert rt.download(acc).tolist() == [3.0] * 4, "result: the kernel read the weights before the unmap"


@pytest.mark.contract("drain-for-unmap-refused-in-capture")
def test_drain_for_unmap_is_refused_inside_capture(make_runtime):
    """drain_for_unmap() inside a capture raises StreamCaptureUnsupported before touching the
    stream, so the capture stays valid and its graph replays."""
    rt = make_runtime(DEFER)
    x = rt.upload(np.zeros(2, np.float32))
    one = rt.upload(np.ones(2, np.float32))
    rt.drain_for_unmap()
    rt.begin_capture(GraphSlot.PRIMARY)
    rt.launch(P.accumulate, x, one)
    with pytest.raises(StreamCaptureUnsupported):
        rt.drain_for_unmap()
    rt.end_capture(GraphSlot.PRIMARY)  # contract: not invalidated
    rt.replay(GraphSlot.PRIMARY)
    assert rt.download(x).tolist() == [1.0, 1.0], "result: the graph replays the captured add once"


@pytest.mark.contract("synchronize-in-capture-deferred")
def test_synchronize_inside_capture_is_noop_under_deferral(make_runtime):
    """Under deferral, synchronize() inside a capture is a no-op: no error, capture intact."""
    rt = make_runtime(DEFER)
    x = rt.upload(np.zeros(2, np.float32))
    one = rt.upload(np.ones(2, np.float32))
    rt.drain_for_unmap()
    rt.begin_capture(GraphSlot.PRIMARY)
    rt.launch(P.accumulate, x, one)
    rt.synchronize()  # contract: must not raise
    rt.launch(P.accumulate, x, one)
    rt.end_capture(GraphSlot.PRIMARY)  # contract: must not be invalidated
    rt.replay(GraphSlot.PRIMARY)
    assert rt.download(x).tolist() == [2.0, 2.0], "result: both captured adds replayed"


@pytest.mark.contract("synchronize-in-capture-no-defer")
def test_synchronize_inside_capture_raises_without_deferral(make_runtime):
    """With deferral off, synchronize() inside a capture raises StreamCaptureUnsupported and the
    capture is invalidated (end_capture raises StreamCaptureInvalidated), as CUDA does; the
    runtime stays usable and the slot stays empty."""
    rt = make_runtime(NO_DEFER)
    x = rt.upload(np.zeros(2, np.float32))
    rt.drain_for_unmap()
    rt.begin_capture(GraphSlot.PRIMARY)
    rt.launch(P.fill, x, value=1.0)
    with pytest.raises(StreamCaptureUnsupported):
        rt.synchronize()
    with pytest.raises(StreamCaptureInvalidated):
        rt.end_capture(GraphSlot.PRIMARY)
    assert not rt.is_capturing and not rt.has_graph(GraphSlot.PRIMARY), "contract: capture ended, slot empty"
    rt.launch(P.fill, x, value=4.0)
    assert rt.download(x).tolist() == [4.0, 4.0], "result: eager work runs after the failed capture"
