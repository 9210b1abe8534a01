"""Weight paging with stable virtual addresses: the distant caller of ``drain_for_unmap``.

Weights live on the host. Each weight key reserves a virtual address range once (rounded up to
the device's VMM granularity, 2 MiB on the H200) and keeps it for the pager's life; physical
granules are created and mapped under it on page-in, unmapped and released on eviction. A tensor
over that range (``Runtime.wrap``) therefore has the same address whether or not the weight is
resident, so a captured graph that baked it stays valid across evict and re-page — provided the
weight is resident when the graph runs, which ``ensure`` (and, for graphs, ``admit``) guarantee.

Ordering, the seeds' lesson (seed 000): every pre-unmap point calls ``Runtime.drain_for_unmap()``,
the runtime's one real barrier; nothing here relies on ``synchronize()``, which is a deferred no-op
on the eager path (``contracts``' mutant ``SyncBarrierPager`` is the bug). Page-in is a
host-to-device copy on the runtime's copy stream, ordered after queued compute work and before
compute enqueued later (``Runtime.write``).

The resident set is bounded by ``vram_limit`` bytes of mapped granules, evicting the least
recently used weights not needed by the current request. Counters: page-ins, hits, evictions,
bytes moved, drain time.

Admission rule for graphs: a graph records which weight key it baked at which address
(``baked``); before it replays, ``admit`` refuses (``PagerError``) if any such address now holds a
different weight (the pager recycles the address ranges of dropped weights) or is not resident.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any, Iterable

import numpy as np

from lockstep.errors import LockstepError
from .errors import IllegalState

__all__ = ["WeightPager", "PagerError", "PagingConfigError", "PagerCounters"]


class PagerError(LockstepError, RuntimeError):
    """A paging request the pager refuses (a graph against a remapped address, paging in a capture)."""


class PagingConfigError(LockstepError, ValueError):
    """The paging configuration cannot work (a budget smaller than one weight); raised at session creation."""


@dataclass
class PagerCounters:
    page_ins: int = 0
    hits: int = 0
    evictions: int = 0
    bytes_moved: int = 0  # host-to-device bytes of page-ins
    drain_seconds: float = 0.0  # wall time in drain_for_unmap before unmaps
    drains: int = 0

    def as_dict(self) -> dict[str, Any]:
        return dict(self.__dict__)


@dataclass
class _Weight:
    key: str
    host: np.ndarray
    va: int
    span: int  # reserved and mapped bytes (granule multiple)
    tensor: Any  # Runtime.wrap over the reserved range: the stable device view
    handle: Any = None  # the physical allocation while resident


@dataclass
class _Range:
    va: int
    span: int
    owner: str | None = None


class WeightPager:
    """Pages host weights into a budget of mapped granules under stable addresses."""

    def __init__(self, runtime, vram_limit: int):
        if vram_limit is None or vram_limit <= 0:
            raise PagingConfigError(f"vram_limit={vram_limit!r}: a pager needs a positive budget in bytes")
        self.rt = runtime
        self.device = runtime.device
        self.limit = int(vram_limit)
        self.counters = PagerCounters()
        self._weights: dict[str, _Weight] = {}
        self._lru: "OrderedDict[str, None]" = OrderedDict()  # resident keys, least recent first
        self._ranges: list[_Range] = []  # every reservation, reused by later weights once dropped
        self.resident_bytes = 0
        self._granularity()

    def _granularity(self) -> int:
        g = getattr(self.device, "granularity", None)
        if not g and hasattr(self.device, "_drv"):
            self.device._drv()  # CUDA: the granularity is queried from the driver
            g = self.device.granularity
        return int(g)

    def span_of(self, nbytes: int) -> int:
        g = self._granularity()
        return max(g, -(-int(nbytes) // g) * g)

    # -- registration
    def register(self, key: str, host: np.ndarray):
        """Give ``key`` its stable address range and return the device tensor over it (not resident yet)."""
        if key in self._weights:
            raise PagerError(f"weight {key!r} is already registered")
        host = np.ascontiguousarray(host)
        span = self.span_of(host.nbytes)
        if span > self.limit:
            raise PagingConfigError(
                f"vram_limit {self.limit} bytes is smaller than weight {key!r}: {host.nbytes} bytes "
                f"({span} bytes mapped at granularity {self._granularity()})")
        rng = next((r for r in self._ranges if r.owner is None and r.span == span), None)
        if rng is None:
            rng = _Range(self.device.reserve(span), span)
            self._ranges.append(rng)
        rng.owner = key
        buf = self.device.buffer_at(rng.va, host.nbytes if host.nbytes else 1)
        tensor = self.rt.wrap(buf, host.shape, host.dtype, name=f"weight:{key}")
        self._weights[key] = _Weight(key, host, rng.va, span, tensor)
        return tensor

    def drop(self, key: str) -> None:
        """Forget a weight: evict it if resident; its address range goes back for reuse."""
        w = self._weights.pop(key)
        if w.handle is not None:
            self._evict(w)
        for r in self._ranges:
            if r.va == w.va:
                r.owner = None

    def tensor(self, key: str):
        return self._weights[key].tensor

    def key_at(self, va: int) -> str | None:
        return next((r.owner for r in self._ranges if r.va == va), None)

    def is_paged(self, key: str) -> bool:
        return key in self._weights

    def is_resident(self, key: str) -> bool:
        return self._weights[key].handle is not None

    # -- residency
    def ensure(self, keys: Iterable[str]) -> None:
        """Make every key resident (page-ins, evicting least recently used others). Refused inside
        a capture when anything must move: a drain and a remap cannot be recorded."""
        want = [k for k in dict.fromkeys(keys) if k in self._weights]
        missing = [k for k in want if self._weights[k].handle is None]
        for k in want:
            if self._weights[k].handle is not None:
                self.counters.hits += 1
                self._lru.move_to_end(k)
        if not missing:
            return
        if self.rt.is_capturing:
            raise PagerError(f"weights {missing} must be paged in during a capture; ensure them before recording")
        need = sum(self._weights[k].span for k in want)
        if need > self.limit:
            raise PagerError(f"one request needs {need} bytes of weights {want}, more than vram_limit {self.limit}")
        protected = set(want)
        for k in missing:
            w = self._weights[k]
            while self.resident_bytes + w.span > self.limit:
                victim = next((v for v in self._lru if v not in protected), None)
                if victim is None:
                    raise PagerError(f"cannot fit {k!r}: every resident weight is needed by this request")
                self._evict(self._weights[victim])
            self._page_in(w)

    def _page_in(self, w: _Weight) -> None:
        self.rt.check_allocation(w.span, f"weight:{w.key}", "(mapped granules)")  # the device budget
        handle = self.device.mem_create(w.span)
        self.device.mem_map(w.va, w.span, handle)
        w.handle = handle
        self.resident_bytes += w.span
        self._lru[w.key] = None
        self.rt.write(w.tensor, w.host)  # copy stream, after queued compute, before later compute
        self.counters.page_ins += 1
        self.counters.bytes_moved += int(w.host.nbytes)

    def _barrier(self) -> None:
        """Before an unmap: every queued kernel that may read the weight must have executed."""
        t0 = time.perf_counter()
        self.rt.drain_for_unmap()
        self.counters.drain_seconds += time.perf_counter() - t0
        self.counters.drains += 1

    def _evict(self, w: _Weight) -> None:
        self._barrier()
        self.device.mem_unmap(w.va, w.span)
        self.device.mem_release(w.handle)
        w.handle = None
        self.resident_bytes -= w.span
        self._lru.pop(w.key, None)
        self.counters.evictions += 1

    def evict_all(self) -> None:
        for k in list(self._lru):
            self._evict(self._weights[k])

    # -- graphs
    def baked(self, keys: Iterable[str]) -> dict[int, str]:
        """What a graph that reads ``keys`` bakes: address -> weight key."""
        return {self._weights[k].va: k for k in keys if k in self._weights}

    def admit(self, baked: dict[int, str]) -> None:
        """Refuse a replay whose baked weight addresses no longer hold those weights, or are not resident."""
        for va, key in baked.items():
            now = self.key_at(va)
            if now != key:
                holder = repr(now) if now else "nothing"
                raise PagerError(f"a graph baked weight {key!r} at 0x{va:x}, but that address now holds "
                                 f"{holder}: refusing the replay (it would read another weight)")
            if self._weights[key].handle is None:
                raise PagerError(f"a graph reads weight {key!r} at 0x{va:x}, which is not resident: ensure it first")

    def close(self) -> None:
        """Drain, unmap and release everything, free the reservations."""
        if self.rt.is_capturing:
            raise IllegalState("closing a pager during a capture")
        self.evict_all()
        for r in self._ranges:
            self.device.address_free(r.va, r.span)
        self._ranges.clear()
        self._weights.clear()
