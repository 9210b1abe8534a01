"""Launching and recording RawKernel launches (what the devices and every CuPy-launching kernel
module share): ``raw_kernel`` (compiled once per variant and cached), ``launch``/``launch_1d``, and the
launch records.

Launch records (the planned eager step's replay, ``reference_runtime/plan.py``): every RawKernel
launch of the kernels goes through ``launch``, which appends ``(function, grid, block, args,
shared_mem)`` to the active ``LaunchRecorder`` when one is set (``recording``). A body whose launches
were all recorded can be relaunched from the record alone, without its host code, as long as it
gets the same buffers and host values (a static node of an execution plan does). Anything else a
body does on the device (a ufunc, an ElementwiseKernel, ``copyto``, an array method that launches
or allocates) must not be replayed: the backend hands recorded bodies a ``RecordingModule`` in
place of ``cupy``, which refuses the record on any attribute that is not a type or a kernel
constructor, and the paths here that launch without ``launch`` refuse it themselves
(``unrecordable``). ``tests/test_kernel_into.py`` replays every node case's recorded ``into`` on the
GPU over changed inputs and poisoned outputs, against a fresh run.
"""

from __future__ import annotations

from typing import Any

import numpy as np

__all__ = ["is_cupy", "same_buffer", "raw_kernel", "launch", "launch_1d", "LaunchRecorder", "RecordingModule",
           "recording", "unrecordable", "ITEM_CTYPE"]

# Element bytes -> an unsigned C type of that size: copies move bits, whatever the dtype.
ITEM_CTYPE = {1: "unsigned char", 2: "unsigned short", 4: "unsigned int", 8: "unsigned long long"}

_CACHE: dict[str, Any] = {}
_THREADS = 256


def is_cupy(xp) -> bool:
    return xp.__name__ == "cupy"


def raw_kernel(xp, src, name: str):
    """``xp.RawKernel(src, name)`` compiled once per (name) and cached; ``name`` encodes the variant.
    ``src`` may be a callable making the source (formatted only on a cache miss)."""
    k = _CACHE.get(name)
    if k is None:
        k = _CACHE[name] = xp.RawKernel(src() if callable(src) else src, name)
    return k


class LaunchRecorder:
    """The RawKernel launches one kernel body issued, in order, and why the record is unusable
    (``refused``: the body did something on the device that is not in ``launches``)."""

    __slots__ = ("launches", "refused")

    def __init__(self) -> None:
        self.launches: list[tuple] = []
        self.refused: str | None = None

    def refuse(self, why: str) -> None:
        if self.refused is None:
            self.refused = why

    @property
    def complete(self) -> bool:
        """Whether relaunching ``launches`` does everything the body did (at least one launch)."""
        return self.refused is None and bool(self.launches)


_RECORDER: LaunchRecorder | None = None  # set only inside ``recording`` (the runtime is single-threaded)


class recording:
    """``with recording(rec):`` makes ``launch`` append to ``rec`` (nested uses restore the outer one)."""

    def __init__(self, rec: LaunchRecorder):
        self.rec = rec
        self.outer: LaunchRecorder | None = None

    def __enter__(self) -> LaunchRecorder:
        global _RECORDER
        self.outer, _RECORDER = _RECORDER, self.rec
        return self.rec

    def __exit__(self, *exc) -> None:
        global _RECORDER
        _RECORDER = self.outer


def unrecordable(why: str) -> None:
    """A path about to do device work ``launch`` does not see: a record being taken is refused."""
    if _RECORDER is not None:
        _RECORDER.refuse(why)


class RecordingModule:
    """The array module a recorded body sees on CuPy: ``cupy`` itself, except that reaching for
    anything but a scalar type or a kernel constructor refuses the record (that attribute may launch
    or allocate: ufuncs, ``copyto``, ``empty``, ...)."""

    SAFE = frozenset({"RawKernel", "ElementwiseKernel", "ndarray", "dtype", "bool_", "float16", "float32",
                      "float64", "int8", "int16", "int32", "int64", "uint8", "uint16", "uint32", "uint64"})

    def __init__(self, xp: Any, rec: LaunchRecorder):
        self.__name__ = xp.__name__
        self._xp = xp
        self._rec = rec

    def __getattr__(self, name: str) -> Any:
        if name not in self.SAFE:
            self._rec.refuse(f"xp.{name}")
        return getattr(self._xp, name)


def launch(kernel, grid: tuple, block: tuple, args: tuple, shared_mem: int = 0) -> None:
    """Launch a RawKernel on the current stream (recorded when a ``LaunchRecorder`` is active)."""
    if _RECORDER is not None:
        _RECORDER.launches.append((kernel.kernel, grid, block, args, shared_mem))
    kernel(grid, block, args, shared_mem=shared_mem)


def launch_1d(kernel, total: int, args: tuple, shared_mem: int = 0) -> None:
    """A grid-stride launch over ``total`` elements (kernels loop ``e += gridDim.x * blockDim.x``)."""
    blocks = max(1, min((int(total) + _THREADS - 1) // _THREADS, 65535))
    launch(kernel, (blocks,), (_THREADS,), args, shared_mem)


def same_buffer(xp, out, *arrays) -> bool:
    """Whether ``out`` may be (a view of) the memory of one of ``arrays`` (an output bound in place
    to a feed it reads): a kernel that reads other positions than it writes must not run then.
    CuPy compares base pointers (bound tensors are whole buffers; no device read), numpy overlap."""
    if is_cupy(xp):
        return any(a is not None and a.data.ptr == out.data.ptr for a in arrays)
    return any(a is not None and np.may_share_memory(out, a) for a in arrays)


def _contiguous(*arrays) -> bool:
    return all(a.flags.c_contiguous for a in arrays)
