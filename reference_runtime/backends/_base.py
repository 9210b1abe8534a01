"""The device protocol both backends implement.

A device is a few parts (after tinygrad's ``Device``): memory (a pool allocator plus the virtual
memory calls reserve/create/map/unmap), streams that take launches, copies and events, and stream
capture into graphs. The runtime (``reference_runtime.runtime``) is written against this protocol
only, so the simulated and the CUDA device run the same runtime code.

Ordering guarantees, one sentence each (they are the contract the simulated device reproduces):
- ``Stream.launch`` / ``memcpy_*_async`` / ``record`` / ``wait``: enqueue and return; work on one
  stream executes in enqueue order; work on two streams is unordered unless an event orders it.
- ``Stream.synchronize`` and ``Device.synchronize``: block until the stream (every stream) has
  executed everything enqueued; they raise any sticky error latched meanwhile.
- ``Device.memcpy_dtoh``: enqueue a device-to-host copy on ``stream`` and wait for *that stream
  only*; work queued on other streams is not waited for. ``memcpy_dtoh_many``: several such
  copies, in order, and one wait.
- ``Stream.query``: True if the stream has nothing left to execute; never blocks.
- ``Event.query``: True once the work before the event's record has executed (True if never recorded).
- ``Device.free``: returns memory at once; it does not wait for queued readers (the runtime's
  stream-ordered release is what makes freeing safe).
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any

import numpy as np
from lockstep.kernels import Kernel

from ..errors import InvalidValue


# The dtypes CuPy has arrays of (``CupyDevice.ARRAY_DTYPES``, and the simulated device's model of
# it, ``sim.RawSimDevice``). A whitelist by name: ml_dtypes types (bfloat16, float8_*, int4)
# register themselves with numpy, and their kind differs across numpy versions (seen on the H200).
CUPY_DTYPES = frozenset({
    "bool", "int8", "int16", "int32", "int64", "uint8", "uint16", "uint32", "uint64",
    "float16", "float32", "float64", "complex64", "complex128",
})


@dataclass(eq=False)
class Buffer:
    """One device allocation: an address range owned by a device."""

    addr: int
    nbytes: int
    device: "Device"
    handle: Any = None  # backend object that keeps the memory alive (cupy MemoryPointer, sim id)
    freed: bool = False

    def __repr__(self) -> str:
        state = " freed" if self.freed else ""
        return f"<Buffer 0x{self.addr:x} {self.nbytes}B on {self.device.name}{state}>"


@dataclass(frozen=True, eq=False, init=False)
class ArrayRef:
    """A typed, contiguous view of device memory at an address: what a kernel launch names."""

    buffer: Buffer
    shape: tuple[int, ...]
    dtype: np.dtype
    offset: int = 0

    def __init__(self, buffer: Buffer, shape: tuple[int, ...], dtype: np.dtype, offset: int = 0):
        # one per tensor: the instance dict written directly (what the frozen dataclass's generated
        # __init__ does through object.__setattr__, a call per field)
        d = self.__dict__
        d["buffer"], d["shape"], d["dtype"], d["offset"] = buffer, shape, dtype, offset

    @property
    def addr(self) -> int:
        return self.buffer.addr + self.offset

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * np.dtype(self.dtype).itemsize

    def __repr__(self) -> str:
        return f"<ArrayRef 0x{self.addr:x} {np.dtype(self.dtype).name}{list(self.shape)}>"


class Event(ABC):
    @abstractmethod
    def query(self) -> bool: ...

    @abstractmethod
    def synchronize(self) -> None: ...


class Graph(ABC):
    """A captured, instantiated graph. Addresses are baked in at capture time."""

    @abstractmethod
    def launch(self, stream: "Stream") -> None: ...


class Stream(ABC):
    @abstractmethod
    def launch(self, kernel: Kernel, arrays: list[ArrayRef], scalars: dict[str, Any] | None = None) -> None: ...

    def launch_recorded(self, kernel: Kernel, arrays: list[ArrayRef], scalars: dict[str, Any]) -> Any | None:
        """``launch``, and a handle ``relaunch`` can enqueue again with the same arrays and scalars
        without running the kernel's host code (None: this launch cannot be replayed so)."""
        self.launch(kernel, arrays, scalars)
        return None

    def relaunch(self, handle: Any) -> None:
        """Enqueue again what ``launch_recorded`` returned ``handle`` for."""
        raise NotImplementedError(f"{type(self).__name__} records no launches")

    @abstractmethod
    def record(self, event: Event) -> None: ...

    @abstractmethod
    def wait(self, event: Event) -> None: ...

    @abstractmethod
    def synchronize(self) -> None: ...

    @abstractmethod
    def query(self) -> bool: ...

    @abstractmethod
    def begin_capture(self) -> None: ...

    @abstractmethod
    def end_capture(self) -> Graph: ...

    @property
    @abstractmethod
    def is_capturing(self) -> bool: ...


class Device(ABC):
    name: str
    xp: Any  # the array module kernel bodies run against

    # -- streams and events
    @abstractmethod
    def stream(self, *, legacy: bool = False) -> Stream:
        """A new non-blocking stream; ``legacy=True`` returns the legacy default stream instead."""

    @abstractmethod
    def event(self) -> Event: ...

    @abstractmethod
    def synchronize(self) -> None: ...

    # -- pool memory
    @abstractmethod
    def malloc(self, nbytes: int) -> Buffer: ...

    @abstractmethod
    def free(self, buffer: Buffer) -> None: ...

    # -- copies
    @abstractmethod
    def memcpy_htod_async(self, dst: ArrayRef, host: np.ndarray, stream: Stream) -> None: ...

    @abstractmethod
    def memcpy_dtoh(self, src: ArrayRef, stream: Stream) -> np.ndarray: ...

    @abstractmethod
    def memcpy_dtod_async(self, dst: ArrayRef, src: ArrayRef, stream: Stream) -> None: ...

    def memcpy_dtoh_many(self, srcs: "list[ArrayRef]", stream: Stream) -> list[np.ndarray]:
        """``memcpy_dtoh`` of each of ``srcs``, in order, on ``stream``; a backend may wait for the
        stream once for all of them instead of once per copy (same ordering guarantee)."""
        return [self.memcpy_dtoh(src, stream) for src in srcs]

    # -- virtual memory management (granules mapped under a reserved address range)
    granularity: int

    @abstractmethod
    def reserve(self, size: int) -> int: ...

    @abstractmethod
    def mem_create(self, size: int) -> Any: ...

    @abstractmethod
    def mem_map(self, va: int, size: int, handle: Any) -> Buffer:
        """Map ``handle`` at ``va`` and return a Buffer viewing the mapped range (not pool memory)."""

    @abstractmethod
    def buffer_at(self, addr: int, nbytes: int) -> Buffer:
        """A Buffer naming an address range the caller does not own (mapped or not): kernels name
        addresses, and this is how a test or a pager names one. It cannot be freed."""

    @abstractmethod
    def mem_unmap(self, va: int, size: int) -> None: ...

    @abstractmethod
    def mem_release(self, handle: Any) -> None: ...

    @abstractmethod
    def address_free(self, va: int, size: int) -> None: ...

    # -- memory accounting (what the runtime's budget, ``RuntimeConfig.device_memory_limit``, counts)
    @property
    @abstractmethod
    def allocated_bytes(self) -> int:
        """Bytes held now: pool allocations plus physical VMM memory created and not yet released."""

    @property
    def file_backed_bytes(self) -> int:
        """Bytes of ``allocated_bytes`` backed by a model file's pages (a copy-on-write map of the
        file's bytes, never written): the host's page cache holds them, not its anonymous memory, so a
        runtime under the device's default budget (which protects the host) does not count them."""
        return 0

    @abstractmethod
    def default_memory_limit(self) -> int:
        """The memory budget in bytes of a runtime on this device whose configuration names none."""

    def default_memory_why(self) -> str:
        """What bounds ``default_memory_limit``, for a refusal's message ("" when it says nothing more)."""
        return ""

    # -- diagnostics
    @property
    @abstractmethod
    def sticky_error(self) -> BaseException | None: ...

    # -- what the engine layer needs to know of a device class
    # The numpy dtype names its arrays can hold (None: every dtype numpy has, ml_dtypes included).
    ARRAY_DTYPES: frozenset[str] | None = None
    # True: the small types it has no dtype for (bfloat16, float8, int4..., ``kernels._cast_util.
    # SMALL_DTYPES``) live in its memory as raw bits: a tensor keeps its logical dtype (``ArrayRef``,
    # ``Spec``), copies move the bytes, kernel bodies get uint8/uint16 arrays (``storage_dtype``)
    # and the executor runs the nodes that touch them through ``kernels._small``.
    RAW_STORAGE = False
    # True if building one is expensive (a CUDA context): the engine keeps one per process and
    # builds a fresh one only after a sticky error; False: a fresh device per model.
    SHARED = False


def check_buffer(device: Device, buffer: Buffer) -> None:
    if buffer.device is not device:
        raise InvalidValue(f"{buffer!r} belongs to another device than {device.name}", subject=buffer)
    if buffer.freed:
        raise InvalidValue(f"{buffer!r} was already freed (double free)", subject=buffer)
