"""The runtime: one per device, the only way executor code touches a device.

Primitives and the guarantee each gives (call the one whose guarantee you need; never rely on a
side effect of another): each primitive declares its guarantee, what it does inside a capture,
whether sync-debug records it, whether it is a barrier and which audit sink it is, once, in its
``@primitive(...)`` marker (``reference_runtime/primitive.py``). The README's primitive table,
sync-debug's ``PRIMITIVES``/``CAPTURE_SAFE``, this module's ``_BARRIERS`` and the audit's sink
tables for the runtime are derived from those markers (``python -m
lockstep.reference_runtime.primitive_table --markdown`` prints the table).

Sync-debug mode (``RuntimeConfig.sync_debug = warn | error``, see ``reference_runtime.sync_debug``):
every call of ``synchronize``, the forced synchronise, ``drain_for_unmap``, ``download``, ``copy``,
``free``, and every ``synchronize()`` on ``compute``/``copy_stream`` outside the known barriers, is
recorded in ``sync_log`` with ``current_node`` and its call site; ``error`` refuses a synchronising
call inside a capture, and a real drain on the deferred eager path outside the known barriers.
"""

from __future__ import annotations

import math
import sys
import weakref
from typing import Any

import numpy as np
from lockstep.kernels import dtype_name, Kernel, KernelHostError, primitives

from . import primitive as _primitive
from . import sync_debug as _sd
from .backends._base import ArrayRef, Buffer, Device, Event, Stream
from .config import RuntimeConfig
from .errors import (
    CaptureD2HRefused,
    CudaError,
    DeviceAssert,
    IllegalState,
    InvalidValue,
    MemoryAllocation,
    StreamCaptureUnsupported,
    UseAfterFree,
)
from .primitive import primitive
from .runtime_capture import CaptureAPI
from .runtime_types import (
    _SLOTS,
    Counters,
    GraphSlot,
    Relaunch,
    SegmentGraph,
    Tensor,
    _human,
    _OwnTensor,
    _Resources,
    _SlotState,
)

__all__ = ["Runtime", "Tensor", "Relaunch", "GraphSlot", "SegmentGraph", "Counters"]

INT64_MAX = (1 << 63) - 1


@primitive(
    barrier=True, capture="leaks", label="(finalizer) _release",
    guarantee="a runtime's finalizer: drains both streams (queued kernels may read its memory), then frees it "
              "all; with a dead context or an open capture it leaks instead")
def _release(res: _Resources) -> None:
    """Finalizer: drain both streams (queued kernels may read our memory), then free it all."""
    if res.device.sticky_error is not None or res.compute.is_capturing:
        return  # a dead context or an open capture: nothing can be drained safely; leak instead
    for stream in (res.compute, res.copy):
        try:
            stream.synchronize()
        except KernelHostError:
            pass  # a kernel's host error in work nobody waits for any more; the stream still drained
        except CudaError:
            return  # the drain itself hit a sticky error (queued work faulted): leak, the context is dead
    for buf in [b for b, _ in res.pending] + list(res.live.values()):
        if not buf.freed:
            res.device.free(buf)
    res.pending.clear()
    res.live.clear()


class Runtime(CaptureAPI):
    """One runtime per device. See the module docstring for the guarantee of each primitive (the
    capture primitives, graph slots and segment graphs, are ``runtime_capture.CaptureAPI``'s)."""

    # Mutants replace this to model a runtime dropped without its drain.
    _release_resources = staticmethod(_release)

    # The ONNX node executing now (the executor sets it around each node); sync-debug events name it.
    current_node: str | None = None

    def __init__(self, device: Device, config: RuntimeConfig | None = None):
        self.device = device
        self.config = config if config is not None else RuntimeConfig.from_env()
        self.counters = Counters()
        self._res = _Resources(device, device.stream(), device.stream())
        self.current_node = None
        # The device memory budget (bytes): the configuration's, else the device's own default.
        self.memory_limit = self.config.device_memory_limit or device.default_memory_limit()
        # the device's default budget protects the host's memory: a model file's pages mapped into device
        # memory (``Device.file_backed_bytes``) are the page cache's, not counted; a configured budget counts all
        self._count_file_pages = bool(self.config.device_memory_limit)
        self._budget_why = ("RuntimeConfig.device_memory_limit" if self.config.device_memory_limit else
                            device.default_memory_why() or "the device's default")
        self.sync_log: list[_sd.SyncEvent] = []  # stays empty with sync_debug off
        self._sync_debug = self.config.sync_debug != "off"
        self._watched: tuple[_sd.WatchedStream, _sd.WatchedStream] | None = None
        if self._sync_debug:
            ref = weakref.ref(self)
            self._watched = (_sd.WatchedStream(self._res.compute, ref, _BARRIERS),
                             _sd.WatchedStream(self._res.copy, ref, _BARRIERS))
        self._slots: dict[GraphSlot, _SlotState] = {s: _SlotState() for s in _SLOTS}
        self._capturing: GraphSlot | SegmentGraph | None = None
        self._frees_after_capture: list[Buffer] = []
        self._sites: dict[int, str] = {}
        self._site_ids: dict[str, int] = {}
        self._enqueued = 0  # device work items enqueued (launches, copies, replays): frees batch on it
        # Compute-stream work items enqueued (launches, replays, captured copies), and their count
        # when both streams were last drained: equal means nothing queued on compute can still read
        # a tensor, so a write needs no "after compute" event (the host saw that work complete).
        self._on_compute = 0
        self._drained_at = -1
        # One event for the orderings a copy consumes at once (recorded, then waited on right away):
        # a wait takes the record before it, so re-recording it later changes no earlier wait.
        self._order_event = device.event()
        self._free_event: Event | None = None
        self._free_mark = -1
        # ``_enqueued`` when both streams were last drained by this runtime: while it is still that,
        # no device work is queued, so a free goes back at once (no event: there is no reader to wait for)
        self._drained = -1
        self._finalizer = weakref.finalize(self, type(self)._release_resources, self._res)
        latch = self.empty((2,), np.int32, name="error_latch")
        self.error_latch: Tensor = _OwnTensor(self, latch.ref, owned=True, name="error_latch")
        # True while the latch is known clear: read clear since the last launch, replay, write or
        # copy that could set it (a download then skips the latch read; the answer is the same)
        self._latch_quiet = False
        self.launch(primitives.fill, self.error_latch, value=0)
        # Nothing but that fill has touched the latch: once it runs the latch reads clear, so the
        # first download need not read it (the next launch, replay, write or copy that may set it
        # makes the next synchronising point read it again)
        self._latch_quiet = True

    # -- streams (watched proxies under sync-debug: their synchronize() is recorded outside barriers)
    @property
    def compute(self) -> Stream:
        w = self._watched
        return self._res.compute if w is None else w[0]  # type: ignore[return-value]

    @property
    def copy_stream(self) -> Stream:
        w = self._watched
        return self._res.copy if w is None else w[1]  # type: ignore[return-value]

    def __repr__(self) -> str:
        debug = f" sync_debug={self.config.sync_debug}" if self._sync_debug else ""
        return f"<Runtime on {self.device.name} defer_eager_sync={self.config.defer_eager_sync}{debug}>"

    # -- sync-debug
    def _sync_note(self, primitive: str) -> None:
        """Record a call of ``primitive`` (sync-debug on); refuse or warn on one inside a capture."""
        cap = self._capturing
        violation = None
        if cap is not None and primitive not in _sd.CAPTURE_SAFE:
            violation = f"called while capturing into {cap.value}"
        _sd.record(self, primitive, capturing=cap is not None, violation=violation, frame=sys._getframe(2))

    # -- memory
    @primitive(
        capture="host", entry="outputs and temporaries are allocated while recording",
        guarantee="allocate within the device memory budget (`memory_limit`): a request that would pass it, or "
                  "whose size is not one (a negative dim, a byte count past int64), is refused *before* anything is "
                  "allocated with `MemoryAllocation` naming `current_node`, the value, the size, the budget and the "
                  "bytes in use; not sticky. Pending frees are drained first (outside a capture)")
    def empty(self, shape: tuple[int, ...] | int, dtype: Any = np.float32, *, name: str = "") -> Tensor:
        shape = (shape,) if isinstance(shape, int) else tuple(map(int, shape))
        dtype = np.dtype(dtype)
        if dtype.hasobject or dtype.kind in "US":
            raise InvalidValue(f"dtype {dtype} cannot live in device memory (strings and objects stay on the host)",
                               subject=name or dtype)
        self._reap()
        nbytes = self._size_of(shape, dtype, name)
        if self._in_use() + nbytes > self.memory_limit:  # (what names it only in a refusal)
            self.check_allocation(nbytes, name, f"{dtype_name(dtype)}{list(shape)}")
        try:
            buf = self.device.malloc(nbytes)
        except MemoryAllocation as exc:  # the device itself refused (CUDA's OOM, the host's)
            raise self._refusal(name, f"{dtype_name(dtype)}{list(shape)}", nbytes,
                                f"the device refused it: {exc}") from exc
        self._res.live[id(buf)] = buf
        self.counters.allocations += 1
        return Tensor(self, ArrayRef(buf, shape, dtype), owned=True, name=name)

    def _size_of(self, shape: tuple[int, ...], dtype: np.dtype, name: str) -> int:
        """The byte count of ``shape`` in Python ints; a negative dim, or a shape no int64 (numpy's
        size type) can count, is refused as an allocation failure, never a numpy overflow."""
        if shape and min(shape) < 0:
            raise self._refusal(name, f"{dtype.name}{list(shape)}", None, "a negative dim is not a size")
        nbytes = math.prod(shape) * dtype.itemsize
        if 0 < nbytes <= INT64_MAX:
            return nbytes
        # numpy refuses past int64 even at size 0 (with no zero dim, the extent is the byte count)
        extent = math.prod(max(d, 1) for d in shape) * dtype.itemsize if not nbytes else nbytes
        if max(nbytes, extent) > INT64_MAX:
            raise self._refusal(name, f"{dtype.name}{list(shape)}", nbytes, "its byte count overflows int64")
        return nbytes

    @primitive(
        capture="host",
        guarantee="refuse (`MemoryAllocation`) an allocation that would pass `memory_limit`; outside a capture, "
                  "pending frees are drained (`drain_for_unmap`) and given back first")
    def check_allocation(self, nbytes: int, name: str = "", what: str = "") -> None:
        """Refuse (``MemoryAllocation``) an allocation of ``nbytes`` that would take the device past
        ``memory_limit``; outside a capture, pending frees are drained and given back first."""
        if self._in_use() + nbytes <= self.memory_limit:
            return
        if self._capturing is None and (self._res.pending or not self._count_file_pages):
            # queued readers executed: every pending free goes back; queued uploads of a model file's
            # bytes executed: they become maps of the file, which the default budget does not count
            self.drain_for_unmap()
        in_use = self._in_use()
        if in_use + nbytes > self.memory_limit:
            raise self._refusal(name, what, nbytes, f"device memory budget {self.memory_limit} bytes "
                                f"({_human(self.memory_limit)}: {self._budget_why}), {in_use} bytes in use")

    def _in_use(self) -> int:
        """The device bytes the budget counts: all of them, less a model file's mapped pages under
        the device's default budget (``Device.file_backed_bytes``)."""
        used = self.device.allocated_bytes
        return used if self._count_file_pages else used - self.device.file_backed_bytes

    def _refusal(self, name: str, what: str, nbytes: int | None, why: str) -> MemoryAllocation:
        node = self.current_node
        where = f"node {node!r}: " if node else ""
        size = f"{nbytes} bytes ({_human(nbytes)})" if nbytes is not None else "an invalid size"
        return MemoryAllocation(
            f"{where}value {name or '(unnamed)'!r} {what}: {size} refused: {why}",
            node=node, value=name or None, nbytes=nbytes, limit=self.memory_limit, in_use=self._in_use())

    def wrap(self, buffer: Buffer, shape: tuple[int, ...], dtype: Any, *, offset: int = 0, name: str = "") -> Tensor:
        """A tensor over memory the runtime does not own (e.g. a virtual-memory mapping)."""
        ref = ArrayRef(buffer, tuple(shape), np.dtype(dtype), offset)
        if offset < 0 or offset + ref.nbytes > buffer.nbytes:
            raise InvalidValue(f"{ref!r} does not fit in {buffer!r}", subject=buffer)
        return Tensor(self, ref, owned=False, name=name)

    @primitive(
        records=("free",), capture="deferred", kind="free", receiver="runtime",
        why="a runtime free: stream-ordered release waits on queued readers (deferred in a capture)",
        entry="a failed recording frees what it allocated",
        guarantee="stream-ordered release: the memory goes back to the device only once every queued reader on "
                  "both streams has executed; until then it cannot be reused")
    def free(self, t: Tensor) -> None:
        """Stream-ordered release: reusable only after every queued reader on both streams ran."""
        if self._sync_debug:
            self._sync_note("free")
        self._check_live(t)
        if not t.owned:
            raise InvalidValue(f"{t!r} is not owned by this runtime; it cannot be freed here", subject=t)
        t.freed = True
        buf = t.ref.buffer
        del self._res.live[id(buf)]
        self.counters.frees += 1
        if self._capturing is not None:
            self._frees_after_capture.append(buf)
            return
        self._release_after_queued_work(buf)

    def _mark_drained(self) -> None:
        """Both streams were just synchronised: nothing enqueued so far can still run (the markers
        ``_drained``, for frees, and ``_drained_at``, for writes, are declared in ``__init__``)."""
        self._drained = self._enqueued
        self._drained_at = self._on_compute

    def _release_after_queued_work(self, buf: Buffer) -> None:
        if self._drained == self._enqueued:
            # Nothing enqueued since both streams drained: no queued work can read ``buf``, and every
            # pending free's readers ran too. They go back first (oldest first, as ``_reap`` would).
            self._reap()
            self.device.free(buf)
            self.counters.frees_released += 1
            return
        # Frees with no device work enqueued between them share one "queued readers done" event
        # (an executor releases a step's temporaries in a batch): the set of queued readers is the same.
        if self._free_event is None or self._free_mark != self._enqueued:
            done_copy = self._order_event  # consumed by the wait below
            self.copy_stream.record(done_copy)
            self.compute.wait(done_copy)
            self._free_event = self.device.event()
            self.compute.record(self._free_event)
            self._free_mark = self._enqueued
        self._res.pending.append((buf, self._free_event))

    def _reap(self) -> None:
        """Give back pending frees whose queued readers have executed (a non-blocking query).

        Every pending free's event is recorded on the in-order compute stream, in list order, so
        completion is monotonic: the first event not yet complete ends the scan (one query per
        call in the steady state, not one per pending free)."""
        if self._capturing is not None:
            return
        pending = self._res.pending
        n = 0
        for buf, ev in pending:
            if not ev.query():
                break
            self.device.free(buf)
            self.counters.frees_released += 1
            n += 1
        del pending[:n]

    @property
    def pending_frees(self) -> int:
        return len(self._res.pending)

    def _check_live(self, t: Tensor) -> None:
        if not isinstance(t, Tensor):
            raise InvalidValue(f"expected a Tensor, got {type(t).__name__}", subject=t)
        if t.runtime is not self:
            raise InvalidValue(f"{t!r} belongs to another runtime", subject=t)
        if t.freed:
            raise UseAfterFree(f"{t!r} was freed", subject=t)

    # -- launches
    @primitive(
        capture="captured", entry="every kernel launch of a recorded step",
        guarantee="enqueue a kernel on the compute stream and return; kernel-to-kernel order on that stream is "
                  "guaranteed with no host synchronisation")
    def launch(self, kernel: Kernel, *tensors: Tensor, **scalars: Any) -> None:
        self._admit(tensors)
        self.compute.launch(kernel, [t.ref for t in tensors], scalars)
        self._launched()

    def _admit(self, tensors: tuple[Tensor, ...]) -> bool:
        """Refuse a launch naming a dead or foreign tensor; note one naming the error latch (it may be
        set now: the next synchronising point reads it). Returns whether the latch is named."""
        latch = self.error_latch.ref.buffer
        named = False
        for t in tensors:
            if type(t) is not Tensor or t.freed or t.runtime is not self:
                self._check_live(t)  # raises, naming what is wrong (the runtime's own latch passes)
            if t.ref.buffer is latch:
                named = True
        if named:
            self._latch_quiet = False
        return named

    def _launched(self) -> None:
        self._enqueued += 1
        self._on_compute += 1
        self.counters.launches += 1
        if self._capturing is not None:
            self.counters.captured_launches += 1

    @primitive(
        capture="captured", entry="a planned node's first launch, recorded",
        guarantee="`launch`, returning a `Relaunch` when the device could record the kernel's device work "
                  "(CuPy: RawKernel launches only), else None")
    def launch_recorded(self, kernel: Kernel, *tensors: Tensor, **scalars: Any) -> "Relaunch | None":
        """``launch``, returning a ``Relaunch`` of it when the device could record it (``relaunch``
        then enqueues the same device work on the same tensors without the kernel's host code), else
        None. The plan of an eager step records its static nodes so (reference_runtime/plan.py)."""
        named = self._admit(tensors)
        handle = self.compute.launch_recorded(kernel, [t.ref for t in tensors], scalars)
        self._launched()
        return None if handle is None else Relaunch(tensors, handle, named)

    @primitive(
        capture="captured", entry="a planned node's recorded launches",
        guarantee="enqueue again, on the compute stream, the device work `launch_recorded` recorded, on the same "
                  "tensors (refused with `UseAfterFree` if one was freed since): a launch without the kernel's "
                  "host code")
    def relaunch(self, r: "Relaunch") -> None:
        for t in r.tensors:
            if t.freed:
                self._check_live(t)
        if r.latch:
            self._latch_quiet = False
        self.compute.relaunch(r.handle)
        self._launched()

    def latch_site(self, name: str) -> int:
        """Register a site (e.g. an ONNX node name) that may set the error latch; returns its id."""
        i = self._site_ids.get(name)
        if i is None:
            i = self._site_ids[name] = len(self._sites) + 1
            self._sites[i] = name
        return i

    @primitive(
        capture="captured", label="error_latch / reset_error_latch()",
        guarantee="a device int32[2] that kernels set ([1, site]) instead of reading values back; read at "
                  "synchronising points (`download`, a real `synchronize`), raised as `DeviceAssert` naming the "
                  "site, sticky until `reset_error_latch()` (a launch that clears it)")
    def reset_error_latch(self) -> None:
        self.launch(primitives.fill, self.error_latch, value=0)

    # -- synchronisation
    @property
    def is_capturing(self) -> bool:
        return self._capturing is not None

    @primitive(
        records=("synchronize", "synchronize(deferred)"), barrier=True, capture="noop-or-invalidates", kind="sync",
        why=("a stream/device synchronise: inside a capture CUDA refuses it "
             "(cudaErrorStreamCaptureUnsupported, the capture is invalidated; lockstep: "
             "StreamCaptureUnsupported); under eager-sync deferral a no-op that hides the sync"),
        guarantee="*public, may be a no-op*: with eager-sync deferral on (the default; "
                  "`LOCKSTEP_DEFER_EAGER_SYNC=0` turns it off) it does nothing; with it off it drains both "
                  "streams and reads the error latch. Never use it as a barrier")
    def synchronize(self) -> None:
        """A no-op under eager-sync deferral; otherwise a real drain plus a latch read. Not a barrier."""
        if self._sync_debug:
            self._sync_note("synchronize(deferred)" if self.config.defer_eager_sync else "synchronize")
        if self.config.defer_eager_sync:
            self.counters.syncs_deferred += 1
            return
        self.counters.syncs_real += 1
        self.compute.synchronize()  # inside a capture: StreamCaptureUnsupported, capture invalidated
        self.copy_stream.synchronize()
        self._mark_drained()
        self._reap()
        self._raise_if_latched()

    @primitive(
        records=("force_sync",), barrier=True, capture="refused", kind="drain",
        guarantee="private: drains both streams whatever the deferral setting (`download` and `copy` drain "
                  "through it; recorded on its own only when called from outside the runtime); "
                  "`IllegalState` inside a capture")
    def _force_sync(self) -> None:
        """Private: drain both streams whatever the deferral setting (for copies that need it)."""
        if self._sync_debug and not _sd.called_from_runtime(sys._getframe(1)):
            self._sync_note("force_sync")  # from download/copy it is part of their own event
        if self._capturing is not None:
            raise IllegalState("internal: forced synchronise requested inside a capture")
        self.counters.forced_syncs += 1
        self.compute.synchronize()
        self.copy_stream.synchronize()
        self._mark_drained()

    @primitive(
        records=("drain_for_unmap",), barrier=True, capture="refused", kind="drain",
        why="a drain of the streams (drain_for_unmap / forced synchronise): refused inside a capture",
        guarantee="THE barrier before freeing or unmapping memory a queued kernel may read: drains compute and "
                  "copy streams unconditionally, ignoring deferral. Refused inside a capture "
                  "(`StreamCaptureUnsupported`, the capture stays valid). It does not raise on a set error latch: "
                  "a barrier must not be blocked by it")
    def drain_for_unmap(self) -> None:
        """Unconditional drain of compute and copy streams; call it before freeing or unmapping
        memory that a queued kernel may read. Ignores deferral; refused inside a capture."""
        if self._sync_debug:
            self._sync_note("drain_for_unmap")
        if self._capturing is not None:
            raise StreamCaptureUnsupported(
                f"drain_for_unmap inside a capture into slot {self._capturing.value}: "
                "a drain cannot be recorded; unmap after end_capture",
                subject=self._capturing,
            )
        self.counters.drains += 1
        self.compute.synchronize()
        self.copy_stream.synchronize()
        self._mark_drained()
        self._reap()

    # -- copies
    @primitive(
        capture="refused",
        guarantee="`empty`, then `write`: a new tensor holding a copy of a host array (0-d stays 0-d)")
    def upload(self, host: Any, *, name: str = "") -> Tensor:
        arr = np.asarray(host, order="C")  # keeps 0-d arrays 0-d, unlike ascontiguousarray
        t = self.empty(arr.shape, arr.dtype, name=name)
        self._write(t, arr, fresh=True)
        return t

    @primitive(
        capture="refused",
        guarantee="host-to-device on the copy stream, ordered after queued compute work that may read the "
                  "tensor and before compute work enqueued later; refused inside a capture")
    def write(self, t: Tensor, host: Any) -> None:
        """Host-to-device on the copy stream, ordered after queued compute work that may read ``t``
        and before compute work enqueued later."""
        self._write(t, host)

    def _write(self, t: Tensor, host: Any, *, fresh: bool = False) -> None:
        """``write``; ``fresh``: ``t`` was allocated just now (``upload``), so no queued work can
        touch its memory (a free gives memory back only once its readers ran): no compute wait."""
        self._check_live(t)
        if self._capturing is not None:
            raise StreamCaptureUnsupported(f"write to {t!r} during capture: host-to-device copies are not captured")
        order = self._order_event
        if not fresh and self._drained_at != self._on_compute:  # compute work queued since the last drain
            self.compute.record(order)
            self.copy_stream.wait(order)
        self.device.memcpy_htod_async(t.ref, np.asarray(host), self._res.copy)
        self._enqueued += 1
        if t.ref.buffer is self.error_latch.ref.buffer:
            self._latch_quiet = False
        self.copy_stream.record(order)
        self.compute.wait(order)

    @primitive(
        records=("download",), capture="refused", kind="d2h",
        why=("a device-to-host read: CuPy copies the value back with a blocking cudaMemcpy, which "
             "waits for the stream and is illegal while it is capturing (lockstep: CaptureD2HRefused)"),
        guarantee="device-to-host: always sees completed data, whatever the deferral setting (a private forced "
                  "synchronise drains both streams first), then reads the error latch (`DeviceAssert`, no data), "
                  "in one round with the data when work since the last read may have set it. Refused "
                  "inside a capture (`CaptureD2HRefused`) without invalidating it")
    def download(self, t: Tensor) -> np.ndarray:
        """Device-to-host; always complete. Raises ``DeviceAssert`` if the error latch is set."""
        if self._sync_debug:
            self._sync_note("download")
        self._check_live(t)
        if self._capturing is not None:
            raise CaptureD2HRefused(f"download of {t!r}: the compute stream is capturing, D2H is disallowed")
        self._force_sync()
        self._reap()
        drained = self._drained == self._enqueued
        if self._latch_quiet:  # read clear, and nothing enqueued since could have set it
            out = self.device.memcpy_dtoh(t.ref, self._res.copy)
        else:  # the latch and the data in one round trip (one wait for the copy stream, not two)
            latch, out = self.device.memcpy_dtoh_many([self.error_latch.ref, t.ref], self._res.copy)
            self._raise_if_latched(latch)
        self.counters.downloads += 1
        self._enqueued += 1
        if drained:  # the copy waited for itself on the drained copy stream: both are drained still
            self._drained = self._enqueued
        return out

    @primitive(
        records=("copy",), capture="captured", kind="runtime-copy", receiver="runtime",
        why="a runtime device-to-device copy: eagerly it forces a synchronise first",
        entry="a device-to-device copy inside a recorded step",
        guarantee="device-to-device: eager, on the copy stream after a forced synchronise; inside a capture, a "
                  "graph node on the compute stream")
    def copy(self, dst: Tensor, src: Tensor) -> None:
        """Device-to-device. Eager: on the copy stream after a forced synchronise (so the source is
        complete), with later compute work ordered after it. In a capture: a graph node on compute."""
        if self._sync_debug:
            self._sync_note("copy")
        self._check_live(dst)
        self._check_live(src)
        self._enqueued += 1
        if dst.ref.buffer is self.error_latch.ref.buffer:
            self._latch_quiet = False
        if self._capturing is not None:
            self.device.memcpy_dtod_async(dst.ref, src.ref, self._res.compute)
            self._on_compute += 1
            return
        self._force_sync()
        self.device.memcpy_dtod_async(dst.ref, src.ref, self._res.copy)
        copied = self._order_event
        self.copy_stream.record(copied)
        self.compute.wait(copied)

    def _read_latch(self) -> np.ndarray:
        return self.device.memcpy_dtoh(self.error_latch.ref, self._res.copy)

    def _raise_if_latched(self, latch: "np.ndarray | None" = None) -> None:
        """Raise ``DeviceAssert`` if the error latch is set; ``latch``: its value, read already with
        the queues drained (``download`` reads it together with the data)."""
        if self._latch_quiet:  # read clear, and nothing enqueued since could have set it
            return
        if latch is None:
            latch = self._read_latch()
        if latch[0] != 0:
            site = int(latch[1])
            raise DeviceAssert(
                f"device error latch set by {self._sites.get(site, f'unknown site {site}')!r}; "
                "reset_error_latch() clears it",
                subject=self._sites.get(site, site),
            )
        self._latch_quiet = True

    # -- lifetime
    @primitive(
        barrier=True, capture="leaks",
        guarantee="drain both streams, then free everything this runtime owns; idempotent (also the finalizer of "
                  "a runtime dropped unclosed)")
    def close(self) -> None:
        """Drain, then free everything this runtime owns. Idempotent."""
        self._finalizer()

    def __enter__(self) -> "Runtime":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


# Known barriers for sync-debug, derived from the declarations (``barrier=True``): a stream synchronise
# issued while one of these runs is that primitive's own drain (download and copy drain through
# _force_sync; synchronize drains only with deferral off), not a stray drain on the deferred eager path.
_BARRIERS = _primitive.barrier_codes(_primitive.collect(Runtime, sys.modules[__name__]))
_sd.declare(_primitive.collect(Runtime, sys.modules[__name__], _sd.WatchedStream))
