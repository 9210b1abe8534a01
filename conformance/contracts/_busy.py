"""Keep a runtime's compute stream busy, so "still queued" is true on a GPU as on the simulator."""

from __future__ import annotations

import numpy as np

from kernels import primitives as P

SPIN_US = 300_000  # the host finishes each test's enqueues long before this on an H200


def busy(rt, microseconds: int = SPIN_US):
    """Drain, then enqueue a spin kernel: afterwards the compute stream has queued work."""
    flag = rt.upload(np.zeros(1, np.int32), name="spin_flag")
    rt.drain_for_unmap()
    rt.launch(P.spin, flag, microseconds=microseconds)
    return flag
