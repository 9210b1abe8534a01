"""Exceptions named after the CUDA errors they mirror.

Every device-level failure in lockstep is one of these, on both devices: the simulated device
raises them directly, the CuPy device translates ``CUDARuntimeError``/``CUDADriverError`` status
codes into them (``from_cuda_status``). Tests and parity scenarios compare exception *classes*, so
a class is the observable outcome of a failing call.

Sticky errors (``sticky = True``) poison the device context: the first synchronising call after
the fault raises them, and every later call on that device raises them again until the device is
rebuilt (a new process on a real GPU).
"""

from __future__ import annotations

from lockstep.errors import LockstepError

__all__ = [
    "CudaError",
    "InvalidValue",
    "MemoryAllocation",
    "InvalidResourceHandle",
    "IllegalState",
    "IllegalAddress",
    "LaunchFailure",
    "StreamCaptureUnsupported",
    "StreamCaptureInvalidated",
    "CaptureD2HRefused",
    "HostReadInCapture",
    "CublasDuringCapture",
    "DeviceAssert",
    "UseAfterFree",
    "CaptureUnmodelled",
    "CaptureOnLegacyStream",
    "StreamOrderRace",
    "SyncDebugError",
    "from_cuda_status",
]


class CudaError(LockstepError, RuntimeError):
    """Base of every error a lockstep device or runtime raises for a failed device operation."""

    cuda_name = "cudaErrorUnknown"
    status = 999
    sticky = False

    def __init__(self, message: str, *, subject: object | None = None):
        super().__init__(f"{self.cuda_name}: {message}")
        self.subject = subject


class InvalidValue(CudaError):
    """An argument was invalid: an unknown slot, a double free, a foreign buffer (cudaErrorInvalidValue)."""

    cuda_name = "cudaErrorInvalidValue"
    status = 1


class MemoryAllocation(CudaError):
    """The device cannot hold the requested allocation (cudaErrorMemoryAllocation). Not sticky: the
    allocation is refused and nothing else changes, so the runtime stays usable.

    The runtime raises it *before* allocating, when a request would exceed the device memory budget
    (``RuntimeConfig.device_memory_limit``) or its byte count is not a valid size (a negative dim, or
    more than an int64 can count); the CuPy device also translates CUDA's and CuPy's own
    out-of-memory errors into it. ``node`` (the ONNX node running, or None), ``value`` (the tensor's
    name), ``nbytes`` (the request; None when it cannot be counted), ``limit`` and ``in_use`` (the
    budget and the bytes held on the device at the request) say what was refused.
    """

    cuda_name = "cudaErrorMemoryAllocation"
    status = 2

    def __init__(self, message: str, *, subject: object | None = None, node: str | None = None,
                 value: str | None = None, nbytes: int | None = None, limit: int | None = None,
                 in_use: int | None = None):
        super().__init__(message, subject=subject if subject is not None else value)
        self.node, self.value, self.nbytes, self.limit, self.in_use = node, value, nbytes, limit, in_use


class UseAfterFree(InvalidValue):
    """A runtime handle was used after it was freed; refused before anything reached the device."""


class InvalidResourceHandle(CudaError):
    """An empty or destroyed graph, stream or event was used (cudaErrorInvalidResourceHandle)."""

    cuda_name = "cudaErrorInvalidResourceHandle"
    status = 400


class IllegalState(CudaError):
    """The call is not legal in the current state, e.g. ``end_capture`` without ``begin`` (cudaErrorIllegalState)."""

    cuda_name = "cudaErrorIllegalState"
    status = 401


class IllegalAddress(CudaError):
    """A kernel touched memory that is not mapped at execution time (cudaErrorIllegalAddress). Sticky."""

    cuda_name = "cudaErrorIllegalAddress"
    status = 700
    sticky = True


class LaunchFailure(CudaError):
    """A kernel failed while executing (cudaErrorLaunchFailure). Sticky."""

    cuda_name = "cudaErrorLaunchFailure"
    status = 719
    sticky = True


class DeviceAssert(CudaError):
    """The runtime's device error latch was set by a kernel (mirrors cudaErrorAssert, but resettable).

    Unlike CUDA's device-side assert this is not sticky for the context: it stays raised at every
    synchronising read until ``Runtime.reset_error_latch()``.
    """

    cuda_name = "cudaErrorAssert"
    status = 710


class StreamCaptureUnsupported(CudaError):
    """A synchronising call was made while a stream was capturing (cudaErrorStreamCaptureUnsupported)."""

    cuda_name = "cudaErrorStreamCaptureUnsupported"
    status = 900


class StreamCaptureInvalidated(CudaError):
    """``end_capture`` of a capture that an earlier illegal call invalidated (cudaErrorStreamCaptureInvalidated)."""

    cuda_name = "cudaErrorStreamCaptureInvalidated"
    status = 901


class CaptureD2HRefused(LockstepError, RuntimeError):
    """A device-to-host read was asked for during capture; refused before CUDA, capture stays valid.

    Mirrors CuPy's own ``RuntimeError('the current stream is capturing, so D2H transfers are
    disallowed')``, which is raised before any CUDA call and so does not invalidate the capture.
    """

    cuda_name = "cupy:D2HDuringCapture"


class HostReadInCapture(CaptureD2HRefused):
    """A kernel body read device values on the host while running from a captured graph (the
    simulated device's capture guard, ``SimDevice(capture_guard=True)``; ``backends/_capture_guard``).

    On CuPy such a read (``float(x)``, ``bool(x)``, ``.item()``, ``print(x)``, boolean-mask indexing,
    ``xp.unique``...) is a device-to-host transfer, refused while the stream captures: the kernel's
    ``capture="safe"`` declaration is wrong. ``kernel`` (the launched kernel's name), ``node`` (the ONNX
    node's name, or None for a runtime primitive), ``op_type``, ``read`` (what was refused) and
    ``file``/``line``/``source`` (the first frame outside numpy and the guard: the kernel's line) say
    where. Raised where the body's other host errors are: at the next launch or synchronising call.
    """

    cuda_name = "lockstep:HostReadInCapture"

    def __init__(self, message: str, *, kernel: str = "", node: str | None = None, op_type: str | None = None,
                 read: str = "", file: str = "", line: int = 0, source: str = ""):
        super().__init__(message)
        self.kernel, self.node, self.op_type, self.read = kernel, node, op_type, read
        self.file, self.line, self.source = file, line, source


class CaptureOnLegacyStream(LockstepError, RuntimeError):
    """Capture was begun on the legacy default stream; CuPy refuses it before calling CUDA
    (measured on the H200: a plain ``RuntimeError``, not a CUDA status)."""

    cuda_name = "cupy:CaptureOnLegacyStream"


class CublasDuringCapture(LockstepError, NotImplementedError):
    """A cuBLAS-backed call was made during capture; CuPy refuses it before calling cuBLAS."""

    cuda_name = "cupy:cuBLASDuringCapture"


class CaptureUnmodelled(LockstepError, NotImplementedError):
    """The simulated device was asked for a capture-time operation whose CUDA outcome it does not model."""

    cuda_name = "lockstep:unmodelled"


class StreamOrderRace(CudaError):
    """Two streams touch the same bytes (one writing) with nothing ordering them (simulated device only).

    CUDA has no such error: on a GPU the program just races. The simulated device reports it at the
    enqueue that completes the race, like compute-sanitizer's racecheck does for shared memory.
    """

    cuda_name = "lockstep:StreamOrderRace"
    status = -1


class SyncDebugError(LockstepError, RuntimeError):
    """Sync-debug mode ``error`` (``RuntimeConfig.sync_debug``): a synchronising primitive was called
    while a capture was open, or a real stream drain happened on the deferred eager path outside the
    known barriers. Raised before the call reaches the device, so an open capture stays valid.
    ``event`` is the ``reference_runtime.sync_debug.SyncEvent`` naming the primitive, node and call site."""

    cuda_name = "lockstep:SyncDebug"

    def __init__(self, message: str, *, event: object | None = None):
        super().__init__(message)
        self.event = event


_BY_STATUS = {
    cls.status: cls
    for cls in (
        InvalidValue,
        MemoryAllocation,
        InvalidResourceHandle,
        IllegalState,
        IllegalAddress,
        LaunchFailure,
        DeviceAssert,
        StreamCaptureUnsupported,
        StreamCaptureInvalidated,
    )
}
# The driver API uses the same numbers as the runtime API for every status mapped here
# (1, 2, 400, 401, 700, 710, 719, 900, 901), so one table serves both.


def from_cuda_status(status: int, message: str) -> CudaError:
    """Translate a CUDA (runtime or driver API) status code into the lockstep exception that mirrors it."""
    cls = _BY_STATUS.get(status)
    if cls is None:
        err = CudaError(f"status {status}: {message}")
        err.status = status
        return err
    return cls(message)
