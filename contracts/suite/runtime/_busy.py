"""Keep a runtime's compute stream busy, so "still queued" is true on a GPU as on the simulator.

On a GPU, host-side work between the spin launch and the check must stay well under the spin
time; the first use of a kernel compiles it (NVRTC, hundreds of milliseconds on a fresh machine,
seen on the H200), so ``busy`` first runs every primitive once to keep compilation out of the
timed window.
"""

from __future__ import annotations

import numpy as np
from lockstep.kernels import primitives as P

SPIN_US = 300_000


def warm_up(rt) -> None:
    """Run each primitive kernel once (compiling it), then drain."""
    f = rt.upload(np.ones(4, np.float32))
    g = rt.empty(4)
    latch = rt.upload(np.zeros(2, np.int32))
    idx = rt.upload(np.array([0, 1], np.int64))
    flag = rt.upload(np.zeros(1, np.int32))
    rt.launch(P.fill, g, value=0.0)
    rt.launch(P.accumulate, g, f)
    rt.launch(P.copy, g, f)
    rt.launch(P.scale_add, g, f, alpha=2.0, beta=1.0)
    rt.launch(P.gather_checked, rt.empty(2), latch, f, idx, site=0)
    rt.launch(P.spin, flag, microseconds=1)
    rt.copy(g, f)
    rt.drain_for_unmap()
    for t in (f, g, latch, idx, flag):
        rt.free(t)


def busy(rt, microseconds: int = SPIN_US):
    """Warm up, drain, then enqueue a spin kernel: afterwards the compute stream has queued work."""
    warm_up(rt)
    flag = rt.upload(np.zeros(1, np.int32), name="spin_flag")
    rt.drain_for_unmap()
    rt.launch(P.spin, flag, microseconds=microseconds)
    return flag


__all__ = ["busy", "warm_up"]
