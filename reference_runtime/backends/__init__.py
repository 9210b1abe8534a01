"""Device backends: ``sim`` (numpy, always available) and ``cupy`` (a CUDA GPU through CuPy).

``make_device(name)`` builds one; ``available_devices()`` says which can be built here and why not.
Adding a backend: a module implementing ``_base.Device``, and a line in ``_FACTORIES``.
"""

from __future__ import annotations

from ._base import ArrayRef, Buffer, Device, Event, Graph, Stream

__all__ = ["Device", "Stream", "Event", "Graph", "Buffer", "ArrayRef", "make_device", "available_devices", "DEVICES"]

DEVICES = ("sim", "cupy")


def available_devices() -> dict[str, tuple[bool, str]]:
    from . import cupy as _cupy

    return {"sim": (True, "numpy simulated device"), "cupy": _cupy.available()}


def make_device(name: str, **kwargs) -> Device:
    if name == "sim":
        from .sim import SimDevice

        return SimDevice(**kwargs)
    if name == "cupy":
        from .cupy import CupyDevice

        return CupyDevice(**kwargs)
    raise ValueError(f"unknown device {name!r}; devices are {list(DEVICES)}")
