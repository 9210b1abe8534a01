"""The simulated device: numpy memory behind an asynchronous, lazily executed CUDA model.

What it models, and how (each row is observable and reproduced on the H200 by the parity scenarios
in ``contracts.parity``):

- Streams are in-order queues. Nothing executes at enqueue. Work executes *on demand*: a
  synchronising call executes exactly the work it must wait for (its stream's queue, plus the
  event records that queue waits on), and nothing else. Work that no synchronisation orders is
  therefore never executed early, which is what turns a missing barrier into a deterministic
  wrong answer or fault instead of a timing-dependent one. A stream whose queue passes
  ``queue_bound`` executes its oldest entry at the next enqueue, like a full launch queue.
- Memory is a virtual address space. Pool allocations (``malloc``) and virtual-memory mappings
  (``reserve``/``mem_create``/``mem_map``) are both mappings of physical backing at addresses;
  ``free`` and ``mem_unmap`` remove the mapping at once. Kernels name *addresses*; they are resolved
  when the work executes, so a kernel that executes after its memory was freed or unmapped faults
  with ``IllegalAddress`` (a pool address reused by a new allocation is read as that allocation's
  bytes, as on a GPU). Copies are also checked at the call, as cudaMemcpyAsync checks its pointers:
  a copy naming a range that is not mapped then is ``InvalidValue`` (not sticky, nothing queued),
  even if the range would be mapped before the copy executes; memory unmapped after the call
  faults at execution like a kernel's. New backing is filled with 0xFF bytes (NaN for floats) so unwritten reads show.
  Pool memory of at least ``LAZY_POISON_MIN`` bytes is poisoned at its first use rather than at
  ``malloc`` (nothing can tell: nothing reads it before), so that a host-to-device copy of a model
  file's bytes (an external initializer, a read-only view of the file's map: ``lockstep.loading``)
  into a fresh allocation can, when it executes, make that allocation a private copy-on-write map of
  the file instead (``_file_backing``): the device's copy of a constant then shares the host's page
  cache until a write (which stays private: nothing written to device memory reaches the file), and a
  model's weights are not held twice in host memory.
  Backing is host RAM: ``allocated_bytes`` counts it for the runtime's budget (whose default,
  ``default_memory_limit``, is a share of what the process may hold: the host's or the cgroup's
  memory, the address space left under ``RLIMIT_AS``), and a host that cannot back an
  allocation is ``MemoryAllocation``, as cudaMalloc's out-of-memory.
- Kernel host errors: a kernel body that raises (its Python, not the device) is a
  ``KernelHostError``, not a fault: it is held and raised once at the next launch or synchronising
  call after the body ran (CuPy raises it at the launch itself, where the body runs); the other
  queued work still executes and the device stays usable.
- Sticky errors: a fault is latched when the faulting work executes, every queue is discarded
  (the context is dead), and every later call raises it, naming the kernel that faulted.
- Capture: the outcomes of docs/cuda-semantics.md (synchronize/device-synchronize raise
  ``StreamCaptureUnsupported`` and invalidate; a stream query invalidates silently; D2H and cuBLAS
  are refused without invalidating; kernels, D2D copies, event records and allocations are fine;
  the legacy stream cannot capture). Graphs bake addresses; a replay resolves them when it executes.
  With ``capture_guard=True`` each kernel node of a replayed graph runs with arrays and an ``xp``
  that refuse host reads (``_capture_guard``), raising ``HostReadInCapture`` naming the kernel, node
  and source line (held and raised like a kernel host error): on CuPy that read is a D2H transfer
  refused during capture, so the kernel's ``capture="safe"`` declaration is wrong.

Deliberate strictness beyond a GPU: a kernel that reads freed *pool* memory nobody reallocated
faults here, where CuPy's pool would keep the memory mapped and return stale bytes.
"""

from __future__ import annotations

import bisect
import ctypes
import itertools
import math
import mmap
import os
import sys
import types
from typing import Any

import numpy as np
from lockstep.host_memory import host_budget
from lockstep.kernels import is_host_error, Kernel, KernelHostError, storage_dtype
from lockstep.loading import file_range

from ..errors import (
    CaptureD2HRefused,
    CaptureUnmodelled,
    IllegalAddress,
    InvalidValue,
    MemoryAllocation,
    StreamCaptureUnsupported,
)
from ._base import CUPY_DTYPES, ArrayRef, Buffer, Device, Stream, check_buffer
from ._hazards import HazardTracker
from ._sim_stream import SimEvent, SimGraph, SimStream, _Mapping, _node_payload, _Op

__all__ = ["SimDevice", "RawSimDevice", "SimEvent", "SimGraph", "SimStream"]  # the last three: _sim_stream

POOL_BASE = 0x7000_0000_0000
VMM_BASE = 0x7F00_0000_0000
POOL_ALIGN = 512
POISON = 0xFF
DEFAULT_MEMORY_CAP = 16 << 30  # bytes: the simulated device's budget is at most this by default
LAZY_POISON_MIN = 1 << 20  # bytes: pool memory at least this large is poisoned at its first use (``_LazyPool``)


def _round_up(n: int, k: int) -> int:
    return (n + k - 1) // k * k


def _immutable(host: Any, dtype: Any) -> bool:
    """Whether ``host`` is a read-only numpy array of ``dtype`` whose memory is a ``bytes`` object's
    (numpy's frombuffer of bytes) or lockstep's read-only map of a model's external data file
    (``lockstep.loading.tensor_to_numpy``, which nothing in lockstep writes): nothing in the process
    can write it, through it or through any other view."""
    if not isinstance(host, np.ndarray) or host.flags.writeable or host.dtype != np.dtype(dtype):
        return False
    base: Any = host
    while isinstance(base, (np.ndarray, memoryview)):
        base = base.base if isinstance(base, np.ndarray) else base.obj
    if isinstance(base, mmap.mmap):  # lockstep's own read-only map of a model's data file, nobody else's
        return file_range(host) is not None
    return isinstance(base, bytes)


def _backing(size: int, what: str, *, poison: bool = True) -> np.ndarray:
    """Host memory for ``size`` device bytes, poisoned (``poison=False``: not yet, ``_LazyPool``);
    the host refusing it is the device's OOM."""
    try:
        backing = np.empty(size, dtype=np.uint8)
    except (MemoryError, ValueError) as exc:  # ValueError: numpy's "array is too big"
        raise MemoryAllocation(f"{what} of {size} bytes: the host cannot back it ({exc})", nbytes=size) from None
    if poison:
        backing.fill(POISON)
    return backing


class _LazyPool(_Mapping):
    """Pool memory poisoned at its first use, not at ``malloc`` (unobservable: nothing reads it
    before). ``raw``: its host memory while untouched (unpoisoned, so never made resident), None
    once ``backing`` was read; ``SimDevice._map_file`` may replace it by a map of a file first."""

    __slots__ = ("raw",)

    def __init__(self, start: int, size: int, raw: np.ndarray, kind: str):
        self.start, self.size, self.raw, self.kind = start, size, raw, kind

    def __getattr__(self, name: str) -> Any:  # only for an attribute not set: ``backing`` before its first use
        if name != "backing":
            raise AttributeError(name)
        raw, self.raw = self.raw, None
        raw.fill(POISON)
        self.backing = raw
        return raw

    def __repr__(self) -> str:
        return f"_LazyPool(start=0x{self.start:x}, size={self.size}, untouched={self.raw is not None})"


_MAP_FIXED = 0x10  # Linux's (every architecture CPython builds for but alpha)
_LIBC: Any = None


def _file_backing(path: Any, offset: int, nbytes: int, size: int) -> np.ndarray | None:
    """``size`` bytes of private host memory whose first ``nbytes`` are the file's from ``offset``
    and the rest poison, as a copy-on-write map of the file (``MAP_PRIVATE``: reading shares the
    page cache, a write makes a private page and never reaches the file); None where this cannot be
    done (not Linux, the file shorter than that now, a failing mmap): the caller copies instead."""
    global _LIBC
    if sys.platform != "linux" or sys.maxsize < 2**32:
        return None
    try:
        if _LIBC is None:
            libc = ctypes.CDLL(None, use_errno=True)
            libc.mmap.restype = ctypes.c_void_p
            libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int,
                                  ctypes.c_long]
            _LIBC = libc
        page = mmap.PAGESIZE
        head = offset % page
        start = offset - head
        total = _round_up(head + size, page)
        # the address range first (anonymous: owned, and unmapped whole, by this mmap object), then the
        # file's pages mapped over its start; pages past the file's end stay anonymous
        region = mmap.mmap(-1, total, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS,
                           prot=mmap.PROT_READ | mmap.PROT_WRITE)
        with open(path, "rb") as f:
            fsize = os.fstat(f.fileno()).st_size
            if offset + nbytes > fsize:
                return None
            flen = min(total, _round_up(fsize - start, page))
            anchor = ctypes.c_char.from_buffer(region)
            addr = ctypes.addressof(anchor)
            del anchor
            got = _LIBC.mmap(addr, flen, mmap.PROT_READ | mmap.PROT_WRITE, mmap.MAP_PRIVATE | _MAP_FIXED,
                             f.fileno(), start)
        if got != addr:
            return None  # (the region is dropped unread: its object unmaps whatever is left of it)
        backing = np.frombuffer(region, dtype=np.uint8, count=size, offset=head)
        backing[nbytes:] = POISON
        return backing
    except (OSError, ValueError, AttributeError, TypeError):
        return None


def available() -> tuple[bool, str]:
    return True, "numpy simulated device"


class SimDevice(Device):
    """A numpy-backed device with CUDA's asynchronous semantics. See the module docstring."""

    name = "sim"
    xp = np

    def __init__(self, *, queue_bound: int = 1024, granularity: int = 2 << 20, race_check: bool = True,
                 capture_guard: bool = False):
        self.queue_bound = queue_bound
        # Kernels executing as nodes of a captured graph run with arrays that refuse host reads
        # (``_capture_guard``: ``HostReadInCapture`` naming kernel, node and line). Read once, here.
        self.capture_guard = capture_guard
        self.race_check = race_check
        self._hz = HazardTracker()
        self.granularity = granularity
        self._seq = itertools.count()
        self._stream_ids = itertools.count()
        self._streams: list[SimStream] = []
        self._legacy = SimStream(self, legacy=True)
        self._starts: list[int] = []
        self._maps: dict[int, _Mapping] = {}
        self._map_generation = 0  # bumped by every mapping made or removed (``SimGraph`` caches on it)
        self._pool_free: list[tuple[int, int]] = []  # sorted (start, size) holes below _pool_top
        self._pool_top = POOL_BASE
        self._pool_sizes: dict[int, int] = {}
        self._vmm_top = VMM_BASE
        self._reserved: dict[int, int] = {}
        self._phys_ids = itertools.count(1)
        self._allocated = 0  # pool bytes (rounded) plus physical VMM bytes not yet released
        self._file_backed: dict[int, int] = {}  # pool start -> size, for allocations mapped from a file
        self._file_backed_total = 0  # their sum (read at every allocation under the default budget)
        self._phys_live: dict[int, int] = {}  # physical handle id -> bytes
        self._sticky: BaseException | None = None
        self._host_error: BaseException | None = None  # a kernel body's own exception, raised once
        self.executed: list[str] = []  # names of executed kernels, for tests and diagnostics

    def __repr__(self) -> str:
        return f"<SimDevice streams={len(self._streams)} mappings={len(self._maps)}>"

    # -- sticky errors
    @property
    def sticky_error(self) -> BaseException | None:
        return self._sticky

    def _check(self) -> None:
        if self._sticky is not None:
            raise self._sticky

    def _raise_host_error(self) -> None:
        """At a launch or a synchronising call (after its sticky check): a held kernel host error, once."""
        err, self._host_error = self._host_error, None
        if err is not None:
            raise err

    def _latch(self, err: BaseException) -> None:
        self._sticky = err
        for s in [self._legacy, *self._streams]:
            s.queue.clear()

    # -- streams
    def stream(self, *, legacy: bool = False) -> SimStream:
        self._check()
        if legacy:
            return self._legacy
        s = SimStream(self)
        self._streams.append(s)
        return s

    def event(self) -> SimEvent:
        self._check()
        return SimEvent(self)

    def _capturing(self) -> list[SimStream]:
        return [s for s in self._streams if s._capture is not None]

    def synchronize(self) -> None:
        self._check()
        capturing = self._capturing()
        if capturing:
            for s in capturing:
                s._capture.invalidated = "device synchronize during capture"  # type: ignore[union-attr]
            raise StreamCaptureUnsupported("device synchronize while a stream is capturing", subject=capturing[0])
        while True:
            heads = [s.queue[0] for s in [self._legacy, *self._streams] if s.queue]
            if not heads or self._sticky is not None:
                break
            self._run_through(min(heads, key=lambda op: op.seq))
        self._check()
        for s in [self._legacy, *self._streams]:
            self._observed(s.vc)
        self._raise_host_error()

    def _observed(self, vc: dict[int, int]) -> None:
        if self.race_check:
            self._hz.observed(vc)

    def _access(self, who: str, ref: tuple, write: bool) -> tuple[int, int, int, bool, str]:
        addr, shape, dtype = ref
        nbytes = math.prod(shape) * dtype.itemsize
        m = self._lookup(addr, max(nbytes, 1))
        return (m.start if m is not None else addr, addr, addr + nbytes, write, who)

    # -- execution
    def _run_through(self, target: _Op) -> None:
        """Execute ``target`` and exactly what it depends on: earlier work on its stream, and the
        event records its waits name (transitively). Nothing else executes."""
        while not target.done and self._sticky is None:
            stream = target.stream
            op = stream.queue[0]
            if op.kind == "wait" and not op.payload["target"].done:
                self._run_through(op.payload["target"])
                continue
            stream.queue.popleft()
            self._execute(op)
            op.done = True

    def _execute(self, op: _Op) -> None:
        p = op.payload
        if op.kind == "kernel":
            self._exec_kernel(p["kernel"], p["refs"], p["scalars"], op.stream)
        elif op.kind == "graph":
            for kind, node in p["nodes"]:
                if self._sticky is not None:
                    return
                if kind == "kernel":
                    self._exec_kernel(node["kernel"], node["refs"], node["scalars"], op.stream,
                                      guarded=self.capture_guard)
                elif kind == "d2d":
                    self._exec_copy(node["dst"], node["src"], op.stream)
                # "record" nodes order nothing outside a graph launch in this model.
        elif op.kind == "h2d":
            if "file" in p and self._map_file(p["dst"], p["file"]):
                return
            view = self._resolve_or_fault(p["dst"], "memcpy HtoD", op.stream)
            if view is not None:
                view[...] = p["data"]
        elif op.kind == "d2h":
            view = self._resolve_or_fault(p["src"], "memcpy DtoH", op.stream)
            if view is not None:
                p["out"] = view.copy()
        elif op.kind == "d2d":
            self._exec_copy(p["dst"], p["src"], op.stream)
        elif op.kind in ("record", "wait"):
            pass
        else:  # pragma: no cover - internal invariant
            raise AssertionError(op.kind)

    def _check_mapped_at_call(self, ref: tuple, what: str, stream: SimStream) -> None:
        """cudaMemcpyAsync validates its pointers at the call: a range not mapped now is refused
        (cudaErrorInvalidValue, not sticky), whatever is mapped there before the copy would run."""
        addr, shape, dtype = ref
        nbytes = math.prod(shape) * dtype.itemsize
        if self._lookup(addr, max(nbytes, 1)) is None:
            raise InvalidValue(
                f"{what} on {stream.label}: 0x{addr:x}..0x{addr + nbytes:x} is not mapped at the call",
                subject=(what, addr, nbytes),
            )

    def _exec_copy(self, dst, src, stream) -> None:
        d = self._resolve_or_fault(dst, "memcpy DtoD", stream)
        s = self._resolve_or_fault(src, "memcpy DtoD", stream)
        if d is not None and s is not None:
            d[...] = s

    def _exec_kernel(self, kernel: Kernel, refs, scalars, stream, *, guarded: bool = False) -> None:
        arrays = []
        for ref in refs:
            view = self._resolve_or_fault(ref, kernel, stream)
            if view is None:
                return
            arrays.append(view)
        xp: Any = self.xp
        if guarded:  # a captured kernel: its arrays and xp refuse host reads (HostReadInCapture)
            from ._capture_guard import GuardContext, GuardedNumpy, guard

            ctx = GuardContext.of_launch(kernel, scalars)
            xp, arrays = GuardedNumpy(ctx, self.xp), [guard(a, ctx) for a in arrays]
        try:
            kernel.run(xp, arrays, scalars)
        except Exception as exc:  # the body's host code raised: not a device fault, not sticky
            if self._host_error is None:
                self._host_error = exc
                if isinstance(exc, MemoryError):  # a temporary the host could not back: CUDA's OOM
                    self._host_error = MemoryAllocation(
                        f"kernel {kernel.name!r}: a temporary could not be allocated ({exc or 'MemoryError'})",
                        subject=kernel)
                    self._host_error.__cause__ = exc
                elif is_host_error(exc):
                    self._host_error = KernelHostError(kernel, scalars, exc)
                    self._host_error.__cause__ = exc
            return
        self.executed.append(kernel.name)

    # -- memory
    @property
    def allocated_bytes(self) -> int:
        return self._allocated

    @property
    def file_backed_bytes(self) -> int:
        return self._file_backed_total

    def default_memory_limit(self) -> int:
        """The smaller of 16 GiB and what the process may hold on the host
        (``lockstep.host_memory.host_budget``: a quarter of the host's or the cgroup's memory, half the
        address space left under ``RLIMIT_AS``): the device's memory is host RAM, so its budget must
        refuse a request (``MemoryAllocation``, named) before the host does (a ``MemoryError``)."""
        return host_budget(DEFAULT_MEMORY_CAP).nbytes

    def default_memory_why(self) -> str:
        """What bounds ``default_memory_limit`` (for the refusal's message)."""
        return host_budget(DEFAULT_MEMORY_CAP).why

    def _lookup(self, addr: int, nbytes: int) -> _Mapping | None:
        m = self._maps.get(addr)  # most names are a mapping's first byte (mappings never overlap)
        if m is None:
            i = bisect.bisect_right(self._starts, addr) - 1
            if i < 0:
                return None
            m = self._maps[self._starts[i]]
        return m if addr + nbytes <= m.start + m.size else None

    def _resolve_or_fault(self, ref, what: "str | Kernel", stream) -> np.ndarray | None:
        """The array at ``ref`` now, or None after latching ``IllegalAddress`` naming ``what`` (the
        operation, or the kernel: its message is built only when it faults)."""
        addr, shape, dtype = ref
        nbytes = math.prod(shape) * dtype.itemsize
        m = self._lookup(addr, max(nbytes, 1))
        if m is None:
            if isinstance(what, Kernel):
                what = f"kernel {what.name!r}"
            self._latch(
                IllegalAddress(
                    f"{what} on {stream.label} touched 0x{addr:x}..0x{addr + nbytes:x}, which is not mapped",
                    subject=(what, addr, nbytes),
                )
            )
            return None
        # a view of the mapping's bytes (one constructor call; the slice-view-reshape chain is three)
        return np.ndarray(shape, dtype, buffer=m.backing, offset=addr - m.start)

    def _map_file(self, ref: tuple, file: tuple) -> bool:
        """The host-to-device copy of a file's bytes (``file``: path, offset) into ``ref``, executed as
        a copy-on-write map of the file (``_file_backing``) when ``ref`` is the whole start of pool memory
        nobody has used yet (``_LazyPool``); False: copy as usual."""
        addr, shape, dtype = ref
        m = self._maps.get(addr)
        if type(m) is not _LazyPool or m.raw is None:
            return False
        backing = _file_backing(file[0], file[1], math.prod(shape) * dtype.itemsize, m.size)
        if backing is None:
            return False
        m.raw = None
        m.backing = backing
        self._file_backed[m.start] = m.size
        self._file_backed_total += m.size
        return True

    def _map(self, start: int, backing: np.ndarray, kind: str, *, lazy: bool = False) -> None:
        size = backing.nbytes
        i = bisect.bisect_left(self._starts, start)
        for j in (i - 1, i):
            if 0 <= j < len(self._starts):
                m = self._maps[self._starts[j]]
                if m.start < start + size and start < m.start + m.size:
                    raise InvalidValue(f"mapping 0x{start:x}+{size} overlaps the mapping at 0x{m.start:x}")
        self._starts.insert(i, start)  # (i is its place: no mapping starts there, it would overlap)
        self._maps[start] = _LazyPool(start, size, backing, kind) if lazy else _Mapping(start, size, backing, kind)
        self._map_generation += 1

    def _unmap(self, start: int) -> _Mapping:
        m = self._maps.pop(start)
        self._starts.remove(start)
        self._map_generation += 1
        return m

    def malloc(self, nbytes: int) -> Buffer:
        self._check()
        if nbytes < 0:
            raise InvalidValue(f"malloc of {nbytes} bytes")
        size = _round_up(max(nbytes, 1), POOL_ALIGN)
        lazy = size >= LAZY_POISON_MIN
        backing = _backing(size, "malloc", poison=not lazy)  # before any bookkeeping: a refusal changes nothing
        start = None
        for i, (s, n) in enumerate(self._pool_free):  # first fit, lowest address: reuse is predictable
            if n >= size:
                start = s
                if n == size:
                    del self._pool_free[i]
                else:
                    self._pool_free[i] = (s + size, n - size)
                break
        if start is None:
            start = self._pool_top
            self._pool_top += size
        self._map(start, backing, "pool", lazy=lazy)
        self._pool_sizes[start] = size
        self._allocated += size
        return Buffer(start, nbytes, self, handle="pool")

    def free(self, buffer: Buffer) -> None:
        self._check()
        check_buffer(self, buffer)
        if buffer.handle != "pool":
            raise InvalidValue(f"{buffer!r} is not pool memory ({buffer.handle}); it cannot be freed", subject=buffer)
        buffer.freed = True
        self._unmap(buffer.addr)
        size = self._pool_sizes.pop(buffer.addr)
        self._allocated -= size
        self._file_backed_total -= self._file_backed.pop(buffer.addr, 0)
        holes = self._pool_free + [(buffer.addr, size)]
        holes.sort()
        merged: list[tuple[int, int]] = []
        for s, n in holes:
            if merged and merged[-1][0] + merged[-1][1] == s:
                merged[-1] = (merged[-1][0], merged[-1][1] + n)
            else:
                merged.append((s, n))
        self._pool_free = merged

    # -- virtual memory management
    def _check_granules(self, size: int, what: str) -> None:
        if size <= 0 or size % self.granularity:
            raise InvalidValue(f"{what} size {size} is not a positive multiple of the granularity {self.granularity}")

    def reserve(self, size: int) -> int:
        self._check()
        self._check_granules(size, "reserve")
        va = self._vmm_top
        self._vmm_top += size + self.granularity  # a guard granule between reservations
        self._reserved[va] = size
        return va

    def mem_create(self, size: int) -> Any:
        self._check()
        self._check_granules(size, "mem_create")
        backing = _backing(size, "mem_create")
        pid = next(self._phys_ids)
        self._phys_live[pid] = size
        self._allocated += size
        return ("phys", pid, backing)

    def mem_map(self, va: int, size: int, handle: Any) -> Buffer:
        self._check()
        if va % self.granularity:
            raise InvalidValue(f"mem_map at 0x{va:x}: not aligned to the granularity {self.granularity}")
        backing = handle[2]
        if backing.nbytes != size:
            raise InvalidValue(f"mem_map size {size} differs from the handle's {backing.nbytes}")
        if not any(r <= va and va + size <= r + n for r, n in self._reserved.items()):
            raise InvalidValue(f"mem_map at 0x{va:x}+{size} is outside every reserved range")
        self._map(va, backing, "vmm")
        return Buffer(va, size, self, handle="vmm")

    def mem_unmap(self, va: int, size: int) -> None:
        self._check()
        m = self._maps.get(va)
        if m is None or m.kind != "vmm" or m.size != size:
            raise InvalidValue(f"mem_unmap 0x{va:x}+{size}: no mapping of that range")
        self._unmap(va)

    def mem_release(self, handle: Any) -> None:
        self._check()  # backing lives on while mapped, as with cuMemRelease
        self._allocated -= self._phys_live.pop(handle[1], 0)

    def buffer_at(self, addr: int, nbytes: int) -> Buffer:
        self._check()
        return Buffer(addr, nbytes, self, handle="raw")

    def address_free(self, va: int, size: int) -> None:
        self._check()
        if self._reserved.get(va) != size:
            raise InvalidValue(f"address_free 0x{va:x}+{size}: no such reservation")
        if any(va <= s < va + size for s in self._starts):
            raise InvalidValue(f"address_free 0x{va:x}+{size}: range still has mappings")
        del self._reserved[va]

    # -- copies
    def memcpy_htod_async(self, dst: ArrayRef, host: np.ndarray, stream: Stream) -> None:
        self._check()
        assert isinstance(stream, SimStream)
        # the bytes as they are now: the copy executes later, and the caller may change its array by then;
        # an array over immutable bytes (an initializer's raw_data) cannot change, so it is not copied
        data = host if _immutable(host, dst.dtype) else np.array(host, dtype=dst.dtype, copy=True)
        if data.shape != tuple(dst.shape):
            raise InvalidValue(f"host array of shape {data.shape} does not fit {dst!r}", subject=dst)
        if stream.is_capturing:
            raise CaptureUnmodelled("a host-to-device copy during capture is not modelled")
        ref = _node_payload(dst)
        self._check_mapped_at_call(ref, "memcpy HtoD", stream)
        # a model file's bytes (an external initializer's map) into large memory: ``_map_file`` may map
        # the file when the copy executes, instead of copying
        where = file_range(host) if data is host and data.nbytes >= LAZY_POISON_MIN else None
        if where is not None:
            stream._enqueue("h2d", [("memcpy HtoD", ref, True)], dst=ref, data=data, file=where)
        else:
            stream._enqueue("h2d", [("memcpy HtoD", ref, True)], dst=ref, data=data)

    def memcpy_dtoh(self, src: ArrayRef, stream: Stream) -> np.ndarray:
        return self.memcpy_dtoh_many([src], stream)[0]

    def memcpy_dtoh_many(self, srcs: list[ArrayRef], stream: Stream) -> list[np.ndarray]:
        """The copies enqueued in order (every pointer checked first), then one wait: the last."""
        self._check()
        assert isinstance(stream, SimStream)
        if stream.is_capturing:
            raise CaptureD2HRefused("the current stream is capturing, so D2H transfers are disallowed")
        refs = [_node_payload(src) for src in srcs]
        for ref in refs:
            self._check_mapped_at_call(ref, "memcpy DtoH", stream)
        ops = [stream._enqueue("d2h", [("memcpy DtoH", ref, False)], src=ref) for ref in refs]
        if not ops:
            return []
        self._run_through(ops[-1])
        self._check()
        self._observed(ops[-1].vc)
        self._raise_host_error()
        return [op.payload["out"] for op in ops]

    def memcpy_dtod_async(self, dst: ArrayRef, src: ArrayRef, stream: Stream) -> None:
        self._check()
        assert isinstance(stream, SimStream)
        if dst.nbytes != src.nbytes:
            raise InvalidValue(f"D2D copy of {src.nbytes} bytes into {dst.nbytes} bytes", subject=dst)
        d, s_ = _node_payload(dst), _node_payload(src)
        for ref in (d, s_):
            self._check_mapped_at_call(ref, "memcpy DtoD", stream)
        if stream._capture is not None:
            stream._capture.nodes.append(("d2d", dict(dst=d, src=s_)))
            return
        stream._enqueue("d2d", [("memcpy DtoD", d, True), ("memcpy DtoD", s_, False)], dst=d, src=s_)


class RawNumpy(types.ModuleType):
    """numpy as kernel bodies see it on ``RawSimDevice``: numpy itself (``__name__`` stays "numpy",
    so kernels take their numpy paths), marked ``RAW_BITS``: ``kernels._cast_util`` then returns
    small-type results as their storage bits, as on CuPy, and ``kernels._small`` refuses a kernel
    result of a small dtype (CuPy could not have made it)."""

    RAW_BITS = True

    def __init__(self) -> None:
        super().__init__("numpy")

    def __getattr__(self, name: str) -> Any:
        return getattr(np, name)


RAW_NUMPY = RawNumpy()


class RawSimDevice(SimDevice):
    """The simulated device holding CuPy's dtypes only (``CUPY_DTYPES``), with the small types
    (bfloat16, float8, int4...) stored as raw bits, as on CuPy (``Device.RAW_STORAGE``): copies
    move the bytes of the logical type, kernel bodies get each small-typed array as its uint8/uint16
    storage and ``RAW_NUMPY`` as their ``xp``, and the executor runs the nodes that touch one
    through ``kernels._small``: the code path ref-cuda takes, on numpy (engine ``ref-sim-raw``,
    ``engine.sim_raw_engine``). Not modelled: a kernel body that makes a small-type array with
    numpy and turns it back into a standard one before returning (CuPy would refuse the first)."""

    ARRAY_DTYPES = CUPY_DTYPES
    RAW_STORAGE = True
    xp = RAW_NUMPY

    def _exec_kernel(self, kernel: Kernel, refs, scalars, stream, *, guarded: bool = False) -> None:
        super()._exec_kernel(kernel, [(addr, shape, storage_dtype(dtype)) for addr, shape, dtype in refs],
                             scalars, stream, guarded=guarded)
