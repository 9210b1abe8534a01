"""The reference runtime's value types: ``Tensor`` (a typed device array the runtime owns or wraps),
``GraphSlot`` (the PRIMARY/VERIFY capture slots), ``SegmentGraph`` (a captured segment's handle),
``Relaunch`` (a recorded launch), ``Counters``, and what a runtime owns on its device (``_Resources``,
released by ``runtime._release``). ``runtime.py`` holds the ``Runtime`` and its primitives."""

from __future__ import annotations

import enum
import itertools
import weakref
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np

from .backends._base import ArrayRef, Buffer, Device, Event, Graph, Stream
from .errors import InvalidValue

if TYPE_CHECKING:  # the runtime imports this module
    from .runtime import Runtime

__all__ = ["Counters", "GraphSlot", "Relaunch", "SegmentGraph", "Tensor"]


def _human(n: int) -> str:
    for unit, k in (("EiB", 60), ("PiB", 50), ("TiB", 40), ("GiB", 30), ("MiB", 20), ("KiB", 10)):
        if n >= 1 << k:
            return f"{n / (1 << k):.3g} {unit}"
    return f"{n} B"


class GraphSlot(enum.Enum):
    PRIMARY = "primary"  # M=1 decode step
    VERIFY = "verify"  # fixed-width M=k verify step

    @classmethod
    def parse(cls, slot: "GraphSlot | str") -> "GraphSlot":
        if isinstance(slot, GraphSlot):
            return slot
        try:
            return cls(str(slot).lower())
        except ValueError:
            raise InvalidValue(f"unknown graph slot {slot!r}; slots are {[s.value for s in cls]}", subject=slot) from None


_SLOTS = tuple(GraphSlot)  # iterating the enum class costs microseconds; every runtime does it three times
_SLOT_NAMES = tuple(s.value for s in _SLOTS)


class SegmentGraph:
    """A graph handle outside the PRIMARY/VERIFY slots: one captured segment of a step. Its
    lifecycle is its own; replaying it never touches a slot or another segment."""

    _ids = itertools.count()

    def __init__(self, label: str):
        self.label = f"{label}#{next(self._ids)}"
        self.graph: Graph | None = None

    @property
    def value(self) -> str:  # named like a slot in messages
        return f"segment {self.label}"

    def __repr__(self) -> str:
        return f"<SegmentGraph {self.label} {'captured' if self.graph is not None else 'empty'}>"


@dataclass
class Counters:
    launches: int = 0
    captured_launches: int = 0
    syncs_real: int = 0
    syncs_deferred: int = 0
    forced_syncs: int = 0
    drains: int = 0
    allocations: int = 0
    frees: int = 0
    frees_released: int = 0
    downloads: int = 0
    captures: int = 0
    capture_aborts: int = 0
    replays: int = 0
    segment_captures: int = 0
    segment_replays: int = 0
    replays_by_slot: dict[str, int] = field(default_factory=lambda: dict.fromkeys(_SLOT_NAMES, 0))
    captures_by_slot: dict[str, int] = field(default_factory=lambda: dict.fromkeys(_SLOT_NAMES, 0))

    def as_dict(self) -> dict[str, Any]:
        return {k: (dict(v) if isinstance(v, dict) else v) for k, v in self.__dict__.items()}


class Tensor:
    """A runtime-owned (or wrapped) typed device array."""

    _ids = itertools.count()

    def __init__(self, runtime: "Runtime", ref: ArrayRef, *, owned: bool, name: str = ""):
        self.runtime = runtime
        self.ref = ref
        self.owned = owned
        self.freed = False
        self.name = name or f"t{next(self._ids)}"

    shape = property(lambda self: self.ref.shape)
    dtype = property(lambda self: np.dtype(self.ref.dtype))
    addr = property(lambda self: self.ref.addr)

    def __repr__(self) -> str:
        state = " freed" if self.freed else ""
        return f"<Tensor {self.name} {self.dtype.name}{list(self.shape)} @0x{self.addr:x}{state}>"


class Relaunch:
    """A recorded launch (``Runtime.launch_recorded``): the tensors it names, in launch order, the
    device's handle, and whether the error latch is among them."""

    __slots__ = ("tensors", "handle", "latch")

    def __init__(self, tensors: tuple[Tensor, ...], handle: Any, latch: bool):
        self.tensors, self.handle, self.latch = tensors, handle, latch


class _OwnTensor(Tensor):
    """A tensor the runtime itself holds (its error latch). It names its runtime through a weak
    reference: runtime and latch form no reference cycle, so a dropped runtime is released (and
    its finalizer drains and frees) at once, not at the next cyclic garbage collection."""

    @property  # type: ignore[override]
    def runtime(self) -> "Runtime":
        return self._runtime()

    @runtime.setter
    def runtime(self, runtime: "Runtime") -> None:
        self._runtime = weakref.ref(runtime)


@dataclass
class _SlotState:
    graph: Graph | None = None


@dataclass(eq=False)
class _Resources:
    """What a runtime owns on its device; kept apart so a finalizer can release it without the runtime."""

    device: Device
    compute: Stream
    copy: Stream
    live: dict[int, Buffer] = field(default_factory=dict)
    pending: list[tuple[Buffer, Event]] = field(default_factory=list)
