"""The CUDA device, through CuPy: the real thing the simulated device models.

Kernels run at enqueue time inside ``with stream:``, so every CuPy ufunc, ElementwiseKernel or
RawKernel a body issues is launched asynchronously on that stream. Streams are non-blocking.
Pool memory comes from CuPy's default memory pool (allocated with the stream of the call current,
so CuPy's stream-aware pool keys it to that stream); virtual-memory mappings use the CUDA driver's
VMM calls through cuda-bindings. CUDA and CuPy errors are translated into ``reference_runtime.errors``;
a sticky error is remembered and raised by every later call, as the poisoned context would.
"""

from __future__ import annotations

import ctypes
from typing import Any

import numpy as np
from lockstep.kernels import is_host_error, Kernel, KernelHostError, storage_dtype

from ..errors import (
    CaptureD2HRefused,
    CaptureOnLegacyStream,
    CublasDuringCapture,
    CudaError,
    InvalidValue,
    MemoryAllocation,
    from_cuda_status,
)
from ._base import CUPY_DTYPES, ArrayRef, Buffer, Device, Event, Graph, Stream, check_buffer

__all__ = ["CupyDevice", "available"]


def available() -> tuple[bool, str]:
    """(usable, reason): whether CuPy imports and sees a CUDA device."""
    try:
        import cupy
    except Exception as exc:  # ImportError, or a broken CUDA library load
        return False, f"cupy is not importable: {exc!r}"
    try:
        n = cupy.cuda.runtime.getDeviceCount()
    except Exception as exc:
        return False, f"no CUDA device: {exc!r}"
    if n < 1:
        return False, "no CUDA device"
    return True, f"{n} CUDA device(s)"


# Bound on the first CupyDevice (a module import must not need CuPy): the exception classes every
# launch checks against (no import statement on the launch path).
_CUDA_ERRORS: tuple[type[BaseException], ...] = ()


class _Errors:
    """A scope that raises the device's sticky error on entry and translates what escapes it:
    CUDA runtime/driver statuses into lockstep's CUDA-named errors (latching a sticky one), CuPy's
    out-of-memory into ``MemoryAllocation``, CuPy's D2H refusal during capture into
    ``CaptureD2HRefused``. A plain class, not a generator context manager: it is on every launch."""

    __slots__ = ("dev", "what", "name")

    def __init__(self, dev: "CupyDevice", what: str, name: str = ""):
        self.dev, self.what, self.name = dev, what, name

    def __enter__(self) -> None:
        if self.dev._sticky is not None:
            raise self.dev._sticky

    def __exit__(self, et: Any, exc: Any, tb: Any) -> bool:
        if exc is not None:
            _translate_and_raise(self.dev, exc, f"{self.what} {self.name}" if self.name else self.what)
        return False


def _translate_and_raise(dev: "CupyDevice", exc: BaseException, what: str) -> None:
    """Raise lockstep's error for ``exc`` when it has one (see ``_Errors``); return otherwise, and
    the caller re-raises ``exc`` as it is."""
    if isinstance(exc, _CUDA_ERRORS):
        err = dev._translate(exc, what)
        if err.sticky:
            dev._poison(err)
        raise err from exc
    if isinstance(exc, MemoryError):  # CuPy's OutOfMemoryError (its pool found no memory), or the host's
        raise MemoryAllocation(f"{what}: {exc}") from exc
    if isinstance(exc, RuntimeError) and "is capturing" in str(exc) and not isinstance(exc, CudaError):
        raise CaptureD2HRefused(f"{what}: {exc}") from exc


def _cuda_error_classes() -> dict[str, type[CudaError]]:
    out: dict[str, type[CudaError]] = {}
    todo = [CudaError]
    while todo:
        cls = todo.pop()
        todo.extend(cls.__subclasses__())
        out.setdefault(cls.cuda_name, cls)
    return out


_NAMES = _cuda_error_classes()


class CupyEvent(Event):
    def __init__(self, device: "CupyDevice"):
        import cupy

        self.device = device
        self.ev = cupy.cuda.Event(disable_timing=True)

    def query(self) -> bool:
        with self.device._errors("event query"):
            return bool(self.ev.done)

    def synchronize(self) -> None:
        with self.device._errors("event synchronize"):
            self.ev.synchronize()


class CupyGraph(Graph):
    def __init__(self, device: "CupyDevice", graph: Any, keep: list[Any]):
        self.device = device
        self.graph = graph
        # Temporaries that kernel bodies allocated during the capture: the graph baked their
        # addresses, so they live exactly as long as the graph (CuPy would pool them at once).
        self._keep = keep

    def launch(self, stream: Stream) -> None:
        assert isinstance(stream, CupyStream)
        with self.device._errors("graph launch"):
            self.graph.launch(stream=stream.s)


_launch_kernel: Any = None  # cupy.cuda.driver.launchKernel, bound on the first CupyDevice


def _pack(xp: Any, fn: Any, grid: tuple, block: tuple, args: tuple, shared_mem: int) -> tuple | None:
    """A recorded RawKernel launch as ``cuLaunchKernel``'s arguments: the function handle, the grid
    and block padded to three dims (as CuPy pads them), and a parameter block built once: each
    argument's bytes at an 8-aligned offset of one host buffer, and the array of their addresses
    (``kernelParams``). Arguments as CuPy converts them: a device array passes its data pointer, a
    numpy scalar its bytes, a Python int/float/bool as int64/float64/bool. None for anything else."""
    values = []
    for a in args:
        if isinstance(a, xp.ndarray):
            values.append(np.uint64(a.data.ptr).tobytes())
        elif isinstance(a, np.generic) and a.dtype.kind in "biuf" and a.dtype.itemsize <= 8:
            values.append(a.tobytes())
        elif isinstance(a, bool):
            values.append(np.bool_(a).tobytes())
        elif isinstance(a, int):
            values.append(np.int64(a).tobytes())
        elif isinstance(a, float):
            values.append(np.float64(a).tobytes())
        else:
            return None
    blob = np.zeros(max(1, 8 * len(values)), np.uint8)
    for i, v in enumerate(values):
        blob[8 * i:8 * i + len(v)] = np.frombuffer(v, np.uint8)
    base = blob.ctypes.data
    params = np.array([base + 8 * i for i in range(len(values))] or [0], np.uint64)
    ptr = getattr(fn, "ptr", None)
    if not isinstance(ptr, int):
        return None
    g = (tuple(grid) + (1, 1))[:3]
    b = (tuple(block) + (1, 1))[:3]
    return (ptr, *(max(1, int(d)) for d in g), *(max(1, int(d)) for d in b), int(shared_mem),
            params.ctypes.data, (blob, params))


class CupyStream(Stream):
    def __init__(self, device: "CupyDevice", s: Any, *, legacy: bool = False):
        self.device = device
        self.s = s
        self.legacy = legacy
        self.label = "legacy" if legacy else f"stream@0x{s.ptr:x}"
        self._since_sync: list[str] = []
        self._capture_keep: list[Any] | None = None

    def _hold_alloc(self, size: int) -> Any:
        mp = self.device.xp.get_default_memory_pool().malloc(size)
        assert self._capture_keep is not None
        self._capture_keep.append(mp)
        return mp

    def __repr__(self) -> str:
        return f"<CupyStream {self.label}>"

    def launch(self, kernel: Kernel, arrays: list[ArrayRef], scalars: dict[str, Any] | None = None) -> None:
        """Run the body now, on this stream. A body's own Python exception is ``KernelHostError``
        raised here (not sticky); CUDA statuses become lockstep's CUDA-named errors."""
        dev = self.device
        if dev._sticky is not None:
            raise dev._sticky
        xs = [dev._as_cupy(a) for a in arrays]
        scalars = scalars if scalars is not None else {}
        try:
            if self._capture_keep is not None:
                with dev.xp.cuda.using_allocator(self._hold_alloc), self.s:
                    self._run(dev.xp, kernel, xs, scalars)
            else:
                with self.s:
                    self._run(dev.xp, kernel, xs, scalars)
        except BaseException as exc:  # translated (CUDA statuses, OOM, D2H in capture) or re-raised as is
            _translate_and_raise(dev, exc, f"launch {kernel.name}")
            raise
        self._note(kernel.name)

    def launch_recorded(self, kernel: Kernel, arrays: list[ArrayRef], scalars: dict[str, Any]) -> Any | None:
        """``launch`` with the body's RawKernel launches recorded (``kernels._launch.LaunchRecorder``):
        the handle is ``(name, packed launches, arguments)`` when every device operation of the
        body was one of them and their arguments could be packed (``_pack``), else None (a ufunc,
        an ElementwiseKernel, an allocation: the body must run again next time). Not during a
        capture (a graph bakes its own launches)."""
        if self._capture_keep is not None:
            self.launch(kernel, arrays, scalars)
            return None
        from lockstep.kernels import LaunchRecorder, RecordingModule, recording

        dev = self.device
        if dev._sticky is not None:
            raise dev._sticky
        xs = [dev._as_cupy(a) for a in arrays]
        rec = LaunchRecorder()
        try:
            with self.s, recording(rec):
                self._run(RecordingModule(dev.xp, rec), kernel, xs, scalars)
        except BaseException as exc:
            _translate_and_raise(dev, exc, f"launch {kernel.name}")
            raise
        self._note(kernel.name)
        if not rec.complete:
            return None
        packed = [_pack(dev.xp, *launch) for launch in rec.launches]
        if any(p is None for p in packed):
            return None
        # the recorded arguments are kept: their arrays hold the memory the packed pointers name
        return (kernel.name, tuple(packed), tuple(rec.launches))

    def relaunch(self, handle: Any) -> None:
        """The recorded launches again, on this stream, through the driver's ``cuLaunchKernel`` with
        the parameter block packed at record time (the same device buffers and host scalars): no
        kernel host code, no ``with stream``, no argument conversion."""
        dev = self.device
        if dev._sticky is not None:
            raise dev._sticky
        name, packed, _ = handle
        s = self.s.ptr
        go = _launch_kernel
        try:
            for fn, gx, gy, gz, bx, by, bz, smem, params, _blob in packed:
                go(fn, gx, gy, gz, bx, by, bz, smem, s, params, 0)
        except BaseException as exc:
            _translate_and_raise(dev, exc, f"launch {name}")
            raise
        self._note(name)

    def _note(self, name: str) -> None:
        self._since_sync.append(name)
        if len(self._since_sync) > 64:
            del self._since_sync[:-32]

    @staticmethod
    def _run(xp: Any, kernel: Kernel, xs: list[Any], scalars: dict[str, Any]) -> None:
        try:
            kernel.run(xp, xs, scalars)
        except NotImplementedError as exc:
            if "capture" in str(exc):
                raise CublasDuringCapture(f"kernel {kernel.name!r}: {exc}") from exc
            raise KernelHostError(kernel, dict(scalars), exc) from exc
        except Exception as exc:  # the body's own host code raised: not a device fault, not sticky
            # CUDA statuses (translated by _Errors), CuPy's D2H refusal during capture and
            # memory exhaustion keep their own paths.
            if (isinstance(exc, _CUDA_ERRORS) or "is capturing" in str(exc) or not is_host_error(exc)):
                raise
            raise KernelHostError(kernel, dict(scalars), exc) from exc

    def record(self, event: Event) -> None:
        assert isinstance(event, CupyEvent)
        with self.device._errors("event record"):
            event.ev.record(self.s)

    def wait(self, event: Event) -> None:
        assert isinstance(event, CupyEvent)
        with self.device._errors("stream wait event"):
            self.s.wait_event(event.ev)

    def synchronize(self) -> None:
        with self.device._errors(f"synchronize {self.label}"):
            self.s.synchronize()
        self._since_sync.clear()

    def query(self) -> bool:
        with self.device._errors(f"query {self.label}"):
            return bool(self.s.done)

    @property
    def is_capturing(self) -> bool:
        if self.legacy:
            return False
        with self.device._errors("capture status"):
            return bool(self.s.is_capturing())

    def begin_capture(self) -> None:
        try:
            with self.device._errors("begin_capture"), self.s:
                self.s.begin_capture()
        except RuntimeError as exc:
            if self.legacy and not isinstance(exc, CudaError):
                raise CaptureOnLegacyStream(f"begin_capture on the legacy stream: {exc}") from exc
            raise
        self._capture_keep = []

    def end_capture(self) -> Graph:
        keep, self._capture_keep = self._capture_keep or [], None
        with self.device._errors("end_capture"), self.s:
            return CupyGraph(self.device, self.s.end_capture(), keep)


class CupyDevice(Device):
    name = "cupy"
    ARRAY_DTYPES = CUPY_DTYPES  # by name (_base.CUPY_DTYPES): none of ml_dtypes' types
    RAW_STORAGE = True  # the small types (bfloat16, float8, int4...) as raw bits (kernels/_small.py)
    SHARED = True  # one CUDA context per process

    def __init__(self, device_id: int = 0):
        global _CUDA_ERRORS, _launch_kernel
        import cupy
        from cupy.cuda import driver, runtime

        _CUDA_ERRORS = (runtime.CUDARuntimeError, driver.CUDADriverError)
        _launch_kernel = driver.launchKernel
        self.xp = cupy
        self.device_id = device_id
        cupy.cuda.Device(device_id).use()
        self._sticky: BaseException | None = None
        self._legacy = CupyStream(self, cupy.cuda.Stream.null, legacy=True)
        self._streams: list[CupyStream] = []
        self._vmm: Any = None
        self.granularity = 2 << 20
        self.props = cupy.cuda.runtime.getDeviceProperties(device_id)
        self._allocated = 0  # bytes of live malloc'd buffers and created, unreleased VMM handles
        self._pinned: np.ndarray | None = None  # host staging of ``memcpy_dtoh_many`` (pinned memory)

    def __repr__(self) -> str:
        name = self.props["name"]
        return f"<CupyDevice {name.decode() if isinstance(name, bytes) else name}>"

    # -- errors
    @property
    def sticky_error(self) -> BaseException | None:
        return self._sticky

    def _check(self) -> None:
        if self._sticky is not None:
            raise self._sticky

    # Set once any device in this process latched a sticky error. Interpreter teardown in a
    # poisoned CUDA context can hang (seen on the H200), so test processes exit hard when it is set.
    poisoned_any = False

    def _poison(self, err: BaseException) -> None:
        self._sticky = err
        CupyDevice.poisoned_any = True

    def _errors(self, what: str) -> "_Errors":
        """A scope translating CUDA and CuPy errors of ``what`` (see ``_Errors``)."""
        return _Errors(self, what)

    def _translate(self, exc: Exception, what: str) -> CudaError:
        text = str(exc)
        name = text.split(":", 1)[0].strip()
        status = getattr(exc, "status", None)
        if name in _NAMES:
            err: CudaError = _NAMES[name](f"{what}: {text}")
        elif status is not None:
            err = from_cuda_status(int(status), f"{what}: {text}")
        else:
            err = CudaError(f"{what}: {text}")
        if err.sticky:
            launched = [k for s in self._streams for k in s._since_sync]
            err = type(err)(f"{what}: {text}; kernels launched since the last synchronisation: {launched}")
        return err

    # -- streams
    def stream(self, *, legacy: bool = False) -> CupyStream:
        import cupy

        self._check()
        if legacy:
            return self._legacy
        s = CupyStream(self, cupy.cuda.Stream(non_blocking=True))
        self._streams.append(s)
        return s

    def event(self) -> CupyEvent:
        self._check()
        return CupyEvent(self)

    def synchronize(self) -> None:
        with self._errors("device synchronize"):
            self.xp.cuda.runtime.deviceSynchronize()
        for s in self._streams:
            s._since_sync.clear()

    # -- pool memory
    @property
    def allocated_bytes(self) -> int:
        return self._allocated

    def default_memory_limit(self) -> int:
        """The GPU's total memory: a runtime's allocations are refused by name only past it; below
        it CUDA's own out-of-memory (other processes, CuPy's cache) is translated, never escapes."""
        return int(self.props["totalGlobalMem"])

    def malloc(self, nbytes: int) -> Buffer:
        if nbytes < 0:
            raise InvalidValue(f"malloc of {nbytes} bytes")
        with self._errors(f"malloc of {nbytes} bytes"):
            mp = self.xp.cuda.alloc(max(nbytes, 1))
        self._allocated += max(nbytes, 1)
        return Buffer(mp.ptr, nbytes, self, handle=mp)

    def free(self, buffer: Buffer) -> None:
        self._check()
        check_buffer(self, buffer)
        if getattr(buffer, "_vmm", False):
            raise InvalidValue(f"{buffer!r} is not pool memory; it cannot be freed", subject=buffer)
        buffer.freed = True
        buffer.__dict__.pop("_views", None)  # cached CuPy views of it (``_as_cupy``) hold the memory too
        buffer.handle = None  # the last reference: CuPy's pool takes the memory back
        self._allocated -= max(buffer.nbytes, 1)

    def _as_cupy(self, ref: ArrayRef) -> Any:
        buf = ref.buffer
        if buf.freed or buf.handle is None:
            # The runtime refuses freed tensors before this; a raw freed Buffer reaching a launch
            # is a use-after-free: CuPy's pool would hand out live memory, so refuse here.
            raise InvalidValue(f"{buf!r} was freed", subject=buf)
        views = buf.__dict__.setdefault("_views", {})  # dropped by free(): the pool takes the memory back
        key = (ref.offset, ref.shape, ref.dtype)
        v = views.get(key)
        if v is None:
            # a small type (bfloat16, float8, int4...) is viewed as its raw storage bits
            v = views[key] = self.xp.ndarray(ref.shape, storage_dtype(ref.dtype), memptr=buf.handle + ref.offset)
        return v

    # -- copies
    def memcpy_htod_async(self, dst: ArrayRef, host: np.ndarray, stream: Stream) -> None:
        assert isinstance(stream, CupyStream)
        data = np.asarray(host, dtype=dst.dtype, order="C")
        if data.shape != tuple(dst.shape):
            raise InvalidValue(f"host array of shape {data.shape} does not fit {dst!r}", subject=dst)
        with self._errors("memcpy HtoD"):
            self._as_cupy(dst).set(data.view(storage_dtype(data.dtype)), stream=stream.s)  # a small type's bits

    def memcpy_dtoh(self, src: ArrayRef, stream: Stream) -> np.ndarray:
        assert isinstance(stream, CupyStream)
        with self._errors("memcpy DtoH"):
            return self._as_cupy(src).get(stream=stream.s).view(src.dtype)  # a small type from its bits

    def memcpy_dtoh_many(self, srcs: list[ArrayRef], stream: Stream) -> list[np.ndarray]:
        """Each copy enqueued (cudaMemcpyAsync into this device's pinned staging buffer, at 256-byte
        aligned offsets), then one synchronise of ``stream``, then each copied out into an array of
        its own: the staging buffer is only ever read after the wait, so one buffer serves every call
        (a copy into pageable memory, ``ndarray.get``'s, is staged by the driver and waited for one by one)."""
        assert isinstance(stream, CupyStream)
        offsets, total = [], 0
        for src in srcs:
            offsets.append(total)
            total += -(-src.nbytes // 256) * 256
        with self._errors("memcpy DtoH"):
            stage = self._staging(total)
            base = stage.ctypes.data
            for src, off in zip(srcs, offsets):
                if src.nbytes:
                    self._as_cupy(src).data.copy_to_host_async(ctypes.c_void_p(base + off), src.nbytes, stream=stream.s)
            stream.s.synchronize()
        return [stage[off:off + src.nbytes].view(src.dtype).reshape(src.shape).copy() if src.nbytes
                else np.empty(tuple(src.shape), dtype=src.dtype) for src, off in zip(srcs, offsets)]

    def _staging(self, nbytes: int) -> np.ndarray:
        """The pinned host buffer of ``memcpy_dtoh_many``, at least ``nbytes`` (grown by doubling)."""
        stage = self._pinned
        if stage is None or stage.nbytes < nbytes:
            size = max(nbytes, 4096, 2 * (stage.nbytes if stage is not None else 0))
            mem = self.xp.cuda.alloc_pinned_memory(size)
            stage = self._pinned = np.ndarray((size,), np.uint8, buffer=mem)  # keeps `mem` alive
        return stage

    def memcpy_dtod_async(self, dst: ArrayRef, src: ArrayRef, stream: Stream) -> None:
        assert isinstance(stream, CupyStream)
        if dst.nbytes != src.nbytes:
            raise InvalidValue(f"D2D copy of {src.nbytes} bytes into {dst.nbytes} bytes", subject=dst)
        rt = self.xp.cuda.runtime
        with self._errors("memcpy DtoD"):
            rt.memcpyAsync(dst.addr, src.addr, src.nbytes, rt.memcpyDeviceToDevice, stream.s.ptr)

    # -- virtual memory management (CUDA driver API through cuda-bindings)
    def _drv(self) -> Any:
        if self._vmm is None:
            from cuda.bindings import driver as cu

            prop = cu.CUmemAllocationProp()
            prop.type = cu.CUmemAllocationType.CU_MEM_ALLOCATION_TYPE_PINNED
            prop.location.type = cu.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
            prop.location.id = self.device_id
            access = cu.CUmemAccessDesc()
            access.location.type = cu.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
            access.location.id = self.device_id
            access.flags = cu.CUmemAccess_flags.CU_MEM_ACCESS_FLAGS_PROT_READWRITE
            self._vmm = (cu, prop, access)
            gran = self._call(
                "cuMemGetAllocationGranularity",
                cu.cuMemGetAllocationGranularity,
                prop,
                cu.CUmemAllocationGranularity_flags.CU_MEM_ALLOC_GRANULARITY_MINIMUM,
            )
            self.granularity = int(gran)
        return self._vmm

    def _call(self, what: str, fn: Any, *args: Any) -> Any:
        self._check()
        from cuda.bindings import driver as cu

        out = fn(*args)
        res, rest = out[0], out[1:]
        if res != cu.CUresult.CUDA_SUCCESS:
            err = from_cuda_status(int(res), f"{what}: {res.name}")
            if err.sticky:
                self._poison(err)
            raise err
        return rest[0] if len(rest) == 1 else rest

    def _check_granules(self, size: int, what: str) -> None:
        self._drv()
        if size <= 0 or size % self.granularity:
            raise InvalidValue(f"{what} size {size} is not a positive multiple of the granularity {self.granularity}")

    def reserve(self, size: int) -> int:
        self._check_granules(size, "reserve")
        cu = self._drv()[0]
        return int(self._call("cuMemAddressReserve", cu.cuMemAddressReserve, size, 0, 0, 0))

    def mem_create(self, size: int) -> Any:
        self._check_granules(size, "mem_create")
        cu, prop, _ = self._drv()
        handle = (self._call("cuMemCreate", cu.cuMemCreate, size, prop, 0), size)
        self._allocated += size
        return handle

    def mem_map(self, va: int, size: int, handle: Any) -> Buffer:
        cu, _, access = self._drv()
        if handle[1] != size:
            raise InvalidValue(f"mem_map size {size} differs from the handle's {handle[1]}")
        ptr = cu.CUdeviceptr(va)
        self._call("cuMemMap", cu.cuMemMap, ptr, size, 0, handle[0], 0)
        self._call("cuMemSetAccess", cu.cuMemSetAccess, ptr, size, [access], 1)
        mem = self.xp.cuda.UnownedMemory(va, size, self, self.device_id)
        buf = Buffer(va, size, self, handle=self.xp.cuda.MemoryPointer(mem, 0))
        buf._vmm = True  # type: ignore[attr-defined]
        return buf

    def buffer_at(self, addr: int, nbytes: int) -> Buffer:
        self._check()
        mem = self.xp.cuda.UnownedMemory(addr, nbytes, self, self.device_id)
        buf = Buffer(addr, nbytes, self, handle=self.xp.cuda.MemoryPointer(mem, 0))
        buf._vmm = True  # type: ignore[attr-defined]  # not pool memory: free() refuses it
        return buf

    def mem_unmap(self, va: int, size: int) -> None:
        cu = self._drv()[0]
        self._call("cuMemUnmap", cu.cuMemUnmap, cu.CUdeviceptr(va), size)

    def mem_release(self, handle: Any) -> None:
        cu = self._drv()[0]
        self._call("cuMemRelease", cu.cuMemRelease, handle[0])
        self._allocated -= handle[1]

    def address_free(self, va: int, size: int) -> None:
        cu = self._drv()[0]
        self._call("cuMemAddressFree", cu.cuMemAddressFree, cu.CUdeviceptr(va), size)
