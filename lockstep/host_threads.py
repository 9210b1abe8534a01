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

__all__ = ["executor", "threads"]

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
