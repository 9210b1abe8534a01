"""The host's threads for numeric work on the CPU: how many this process may use, and one pool of
them per process.

Used where a numba kernel (``nogil``) splits its rows over Python threads: the reference runtime's
4-bit MatMulNBits (``kernels._nbits_host``) and the oracle's 4-bit dequantization
(``golden.int4_host``). numba's own parallel layer is not used: its default (workqueue) aborts the
process when two threads launch at once.
"""

from __future__ import annotations

import os
import threading
from concurrent.futures import ThreadPoolExecutor

__all__ = ["executor", "split_rows", "threads"]

_pool: tuple[int, ThreadPoolExecutor] | None = None
_lock = threading.Lock()


def threads() -> int:
    """The CPUs this process may run on (its affinity mask, else the machine's count)."""
    return max(1, len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1))


def executor() -> ThreadPoolExecutor:
    """This process's pool of ``threads()`` threads (a forked child makes its own: the parent's
    threads are not in it)."""
    global _pool
    with _lock:
        if _pool is None or _pool[0] != os.getpid():
            _pool = (os.getpid(), ThreadPoolExecutor(threads(), thread_name_prefix="lockstep-host"))
        return _pool[1]


def split_rows(fn, head: tuple, r0: int, r1: int, workers: int) -> None:
    """``fn(*head, lo, hi)`` over the rows ``[r0, r1)`` in ``workers`` contiguous parts on this process's
    pool (on the calling thread when ``workers`` is 1), each row in exactly one call; returns when all
    are done (a part's exception is raised here)."""
    if workers <= 1:
        fn(*head, r0, r1)
        return
    step = -(-(r1 - r0) // workers)
    for f in [executor().submit(fn, *head, lo, min(r1, lo + step)) for lo in range(r0, r1, step)]:
        f.result()
