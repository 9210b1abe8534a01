"""Contracts of graph capture into the PRIMARY and VERIFY slots.

The kernels accumulate (``acc += x``) so that an extra or a missing replay changes the result:
an idempotent kernel (``acc = x``) would let a slot that replays twice, or not at all, pass.
"""

from __future__ import annotations

import numpy as np
import pytest
from lockstep.kernels import primitives as P
from lockstep.reference_runtime import GraphSlot, IllegalState, InvalidResourceHandle, InvalidValue

PRIMARY, VERIFY = GraphSlot.PRIMARY, GraphSlot.VERIFY


def _capture_add(rt, slot, acc, x, times=1):
    rt.begin_capture(slot)
    for _ in range(times):
        rt.launch(P.accumulate, acc, x)
    rt.end_capture(slot)


@pytest.mark.contract("graph-slots-independent")
def test_slots_capture_replay_and_reset_independently(make_runtime):
    """PRIMARY and VERIFY hold one graph each: capturing, replaying or resetting one never
    changes what the other replays, and each replay executes its graph exactly once."""
    rt = make_runtime()
    one = rt.upload(np.ones(2, np.float32))
    p = rt.upload(np.zeros(2, np.float32))
    v = rt.upload(np.zeros(2, np.float32))
    rt.drain_for_unmap()

    _capture_add(rt, PRIMARY, p, one)
    rt.replay(PRIMARY)
    _capture_add(rt, VERIFY, v, one, times=10)  # capturing VERIFY must leave PRIMARY's graph alone
    for slot in (PRIMARY, VERIFY, PRIMARY, VERIFY, PRIMARY):
        rt.replay(slot)
    assert rt.download(p).tolist() == [4.0, 4.0], "contract: PRIMARY replayed exactly 4 times"
    assert rt.download(v).tolist() == [20.0, 20.0], "contract: VERIFY replayed exactly 2 times"

    rt.reset(VERIFY)
    assert rt.has_graph(PRIMARY) and not rt.has_graph(VERIFY), "contract: reset empties only its slot"
    rt.replay(PRIMARY)
    with pytest.raises(InvalidResourceHandle):
        rt.replay(VERIFY)
    assert rt.download(p).tolist() == [5.0, 5.0], "contract: PRIMARY still replays after VERIFY's reset"
    assert rt.download(v).tolist() == [20.0, 20.0], "contract: a reset slot replays nothing"
    assert rt.counters.replays_by_slot == {"primary": 5, "verify": 2}, "contract: replays counted per slot"
    assert rt.counters.captures_by_slot == {"primary": 1, "verify": 1}, "contract: captures counted per slot"


@pytest.mark.contract("graph-slot-abort")
def test_abort_capture_leaves_other_slot(make_runtime):
    """Aborting a capture into one slot discards only that capture; the other slot still replays."""
    rt = make_runtime()
    one = rt.upload(np.ones(2, np.float32))
    p = rt.upload(np.zeros(2, np.float32))
    rt.drain_for_unmap()
    _capture_add(rt, PRIMARY, p, one)
    rt.begin_capture(VERIFY)
    rt.launch(P.accumulate, p, one)
    rt.abort_capture(VERIFY)
    assert not rt.is_capturing and not rt.has_graph(VERIFY), "contract: abort leaves VERIFY empty"
    rt.replay(PRIMARY)
    assert rt.download(p).tolist() == [1.0, 1.0], "contract: PRIMARY replays once; the aborted add never ran"


@pytest.mark.contract("capture-does-not-execute")
def test_capture_records_without_executing(make_runtime):
    """Work launched during a capture is recorded, not executed; it runs once per replay."""
    rt = make_runtime()
    one = rt.upload(np.ones(2, np.float32))
    p = rt.upload(np.zeros(2, np.float32))
    rt.drain_for_unmap()
    _capture_add(rt, PRIMARY, p, one, times=3)
    assert rt.download(p).tolist() == [0.0, 0.0], "contract: capture executed nothing"
    rt.replay(PRIMARY)
    assert rt.download(p).tolist() == [3.0, 3.0], "result: one replay ran the three adds"


def test_capture_bad_input(make_runtime):
    """Bad input to the capture API raises the CUDA-named error and leaves the runtime usable."""
    rt = make_runtime()
    x = rt.upload(np.zeros(2, np.float32))
    with pytest.raises(IllegalState, match="no capture is open"):
        rt.end_capture(PRIMARY)
    with pytest.raises(InvalidValue, match="unknown graph slot 'draft'"):
        rt.begin_capture("draft")
    with pytest.raises(InvalidResourceHandle, match="holds no graph"):
        rt.replay(VERIFY)
    rt.begin_capture(PRIMARY)
    with pytest.raises(IllegalState, match="already capturing"):
        rt.begin_capture(VERIFY)
    with pytest.raises(IllegalState, match="slot primary is capturing"):
        rt.end_capture(VERIFY)
    rt.end_capture(PRIMARY)
    rt.launch(P.fill, x, value=2.0)
    assert rt.download(x).tolist() == [2.0, 2.0]
