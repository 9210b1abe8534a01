"""The simulated device's streams, events and graphs (``sim``'s in-order queues that execute on
demand, capture into graphs that bake addresses, and replays): see ``sim``'s docstring for the
model; ``SimDevice`` holds the memory they resolve against."""

from __future__ import annotations

import weakref
from collections import deque
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np
from lockstep.kernels import Kernel

from ..errors import (
    CaptureOnLegacyStream,
    CaptureUnmodelled,
    CublasDuringCapture,
    IllegalState,
    StreamCaptureInvalidated,
    StreamCaptureUnsupported,
)
from ._base import ArrayRef, Event, Graph, Stream

if TYPE_CHECKING:  # sim imports this module
    from .sim import SimDevice

__all__ = ["SimEvent", "SimGraph", "SimStream"]


@dataclass(eq=False, slots=True)
class _Op:
    kind: str  # kernel | h2d | d2h | d2d | record | wait | graph
    stream: "SimStream"
    seq: int
    payload: dict[str, Any]
    done: bool = False
    vc: dict[int, int] | None = None  # its clock (HazardTracker.enqueue), with race checking on


@dataclass(eq=False, slots=True)
class _Mapping:
    start: int
    size: int
    backing: np.ndarray  # uint8
    kind: str  # pool | vmm


@dataclass
class _Capture:
    nodes: list[tuple[str, dict[str, Any]]] = field(default_factory=list)
    invalidated: str | None = None


def _node_payload(ref: ArrayRef) -> tuple[int, tuple[int, ...], np.dtype]:
    # Bake the address, not the Buffer object: this is what a CUDA graph or a queued launch holds.
    return (ref.addr, tuple(ref.shape), np.dtype(ref.dtype))


def _kernel_accesses(kernel: Kernel, refs: list[tuple]) -> list[tuple[Kernel, tuple, bool]]:
    n, writes = len(refs), kernel.writes  # the kernel names the accesses (``Access.who`` words it)
    return [(kernel, ref, i in writes or i - n in writes) for i, ref in enumerate(refs)]


class SimEvent(Event):
    def __init__(self, device: "SimDevice"):
        self.device = device
        self._last_record: _Op | None = None

    def query(self) -> bool:
        self.device._check()
        rec = self._last_record
        if rec is not None and rec.done:
            self.device._observed(rec.vc)
        return rec is None or rec.done

    def synchronize(self) -> None:
        self.device._check()
        rec = self._last_record
        if rec is not None:
            self.device._run_through(rec)
            self.device._check()
            self.device._observed(rec.vc)
            self.device._raise_host_error()


class SimGraph(Graph):
    def __init__(self, device: "SimDevice", nodes: list[tuple[str, dict[str, Any]]]):
        self.device = device
        self.nodes = list(nodes)
        accesses: list[tuple[str, tuple, bool]] = []  # what the race checker sees of a launch: fixed
        for kind, node in self.nodes:
            if kind == "kernel":
                accesses += _kernel_accesses(node["kernel"], node["refs"])
            elif kind == "d2d":
                accesses += [("graph memcpy DtoD", node["dst"], True), ("graph memcpy DtoD", node["src"], False)]
        self._accesses = accesses
        # the accesses resolved against the address map (bucketed by allocation), and the map's
        # generation they were resolved at: a replay with no mapping made or removed since reuses them
        self._resolved: list[tuple] = []
        self._generation = -1

    def launch(self, stream: Stream) -> None:
        assert isinstance(stream, SimStream)
        if stream.is_capturing:
            raise CaptureUnmodelled("launching a graph into a capturing stream is not modelled")
        dev = self.device
        if dev.race_check and self._generation != dev._map_generation:
            self._resolved = [dev._access(who, ref, write) for who, ref, write in self._accesses]
            self._generation = dev._map_generation
        stream._enqueue("graph", resolved=self._resolved, nodes=self.nodes)

    def __repr__(self) -> str:
        return f"<SimGraph {len(self.nodes)} nodes>"


class SimStream(Stream):
    """A stream names its device through a weak reference (the device holds its streams): device and
    streams form no reference cycle, so a dropped device, its memory and its race records go at
    once, not at the next cyclic garbage collection. Whoever holds a stream holds its device too."""

    def __init__(self, device: "SimDevice", *, legacy: bool = False, label: str = ""):
        self._device = weakref.ref(device)
        self.legacy = legacy
        self.index = next(device._stream_ids)
        self.label = label or ("legacy" if legacy else f"stream{self.index}")
        self.vc: dict[int, int] = {}
        self.queue: deque[_Op] = deque()
        self._capture: _Capture | None = None

    @property
    def device(self) -> "SimDevice":
        return self._device()  # type: ignore[return-value]

    def __repr__(self) -> str:
        return f"<SimStream {self.label} queued={len(self.queue)}>"

    # -- enqueue
    def _enqueue(self, kind: str, accesses: list[tuple[str, tuple, bool]] = (), *,  # type: ignore[assignment]
                 resolved: "list[tuple] | None" = None, **payload: Any) -> _Op:
        """Enqueue an op; ``resolved``: its accesses already resolved by ``SimDevice._access``."""
        dev = self.device
        op = _Op(kind, self, next(dev._seq), payload)
        if dev.race_check:
            op.vc = dev._hz.enqueue(self, resolved if resolved is not None else
                                    [dev._access(who, ref, write) for who, ref, write in accesses])
        self.queue.append(op)
        if len(self.queue) > dev.queue_bound:
            dev._run_through(self.queue[0])
        return op

    def launch(self, kernel: Kernel, arrays: list[ArrayRef], scalars: dict[str, Any] | None = None) -> None:
        refs = [_node_payload(a) for a in arrays]
        self.relaunch((kernel, refs, dict(scalars or {}), _kernel_accesses(kernel, refs)))

    def launch_recorded(self, kernel: Kernel, arrays: list[ArrayRef], scalars: dict[str, Any]) -> Any | None:
        """The simulated device runs bodies lazily from the launch's own record: the handle is that
        record (addresses resolved again, and every access race-checked, at each relaunch)."""
        refs = [_node_payload(a) for a in arrays]
        handle = (kernel, refs, dict(scalars), _kernel_accesses(kernel, refs))
        self.relaunch(handle)
        return handle

    def relaunch(self, handle: Any) -> None:
        kernel, refs, scalars, accesses = handle
        self.device._check()
        self.device._raise_host_error()
        if self._capture is not None:
            if kernel.uses_cublas:
                raise CublasDuringCapture(
                    f"kernel {kernel.name!r} calls cuBLAS, which is unsupported during stream capture"
                )
            self._capture.nodes.append(("kernel", dict(kernel=kernel, refs=refs, scalars=dict(scalars))))
            return
        self._enqueue("kernel", accesses, kernel=kernel, refs=refs, scalars=scalars)

    def record(self, event: Event) -> None:
        self.device._check()
        assert isinstance(event, SimEvent)
        if self._capture is not None:
            self._capture.nodes.append(("record", dict(event=event)))
            return
        event._last_record = self._enqueue("record")  # the op names no event: no event<->op cycle

    def wait(self, event: Event) -> None:
        self.device._check()
        assert isinstance(event, SimEvent)
        if self._capture is not None:
            raise CaptureUnmodelled("waiting on an event during capture is not modelled by the simulated device")
        rec = event._last_record
        if rec is not None:
            if self.device.race_check:
                self.device._hz.wait(self, rec.vc)
            if not rec.done:
                self._enqueue("wait", target=rec)

    # -- host-side
    def synchronize(self) -> None:
        self.device._check()
        if self._capture is not None:
            self._capture.invalidated = "stream synchronize during capture"
            raise StreamCaptureUnsupported(f"synchronize on {self.label} while it is capturing", subject=self)
        if self.queue:
            self.device._run_through(self.queue[-1])
        self.device._check()
        self.device._observed(self.vc)
        self.device._raise_host_error()

    def query(self) -> bool:
        self.device._check()
        if self._capture is not None:
            # cudaStreamQuery on a capturing stream: no error at the call, the capture is invalidated.
            self._capture.invalidated = "stream query during capture"
            return False
        if not self.queue:
            self.device._observed(self.vc)
        return not self.queue

    @property
    def pending(self) -> int:
        """Number of queued, not yet executed entries (a test hook; the GPU has no equivalent)."""
        return len(self.queue)

    # -- capture
    @property
    def is_capturing(self) -> bool:
        return self._capture is not None

    def begin_capture(self) -> None:
        self.device._check()
        if self.legacy:
            raise CaptureOnLegacyStream("cannot capture on the legacy default stream; use a non-blocking stream")
        if self._capture is not None:
            raise IllegalState(f"{self.label} is already capturing", subject=self)
        self._capture = _Capture()

    def end_capture(self) -> Graph:
        self.device._check()
        cap = self._capture
        if cap is None:
            raise IllegalState(f"end_capture on {self.label}, which is not capturing", subject=self)
        self._capture = None
        if cap.invalidated:
            raise StreamCaptureInvalidated(f"capture on {self.label} was invalidated by a {cap.invalidated}", subject=self)
        return SimGraph(self.device, cap.nodes)
