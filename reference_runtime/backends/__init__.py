"""Device backends: ``sim`` (numpy, always available) and ``cupy`` (a CUDA GPU through CuPy).

``make_device(name)`` builds one; ``available_devices()`` says which can be built here and why not;
``device_class(name)`` is the class (its ``ARRAY_DTYPES`` and ``SHARED`` tell the engine layer what
it may hold and whether to share one per process).

Adding a backend: a module implementing ``_base.Device`` with a module-level ``available() ->
(bool, reason)``, and one line in ``_BACKENDS`` (name -> module, class). See reference_runtime/README.md.
"""

from __future__ import annotations

import importlib
import sys

from ._base import ArrayRef, Buffer, Device, Event, Graph, Stream

__all__ = ["Device", "Stream", "Event", "Graph", "Buffer", "ArrayRef", "make_device", "available_devices",
           "device_class", "DEVICES"]

# name -> (module of this package, Device class); modules are imported only when used
_BACKENDS = {
    "sim": ("sim", "SimDevice"),
    "cupy": ("cupy", "CupyDevice"),
}
DEVICES = tuple(_BACKENDS)


def _module(name: str):
    if name not in _BACKENDS:
        raise ValueError(f"unknown device {name!r}; devices are {list(DEVICES)}")
    module = sys.modules.get(f"{__name__}.{_BACKENDS[name][0]}")  # imported already: no import machinery
    return module if module is not None else importlib.import_module(f".{_BACKENDS[name][0]}", __name__)


def device_class(name: str) -> type[Device]:
    return getattr(_module(name), _BACKENDS[name][1])


def available_devices() -> dict[str, tuple[bool, str]]:
    out = {}
    for name in DEVICES:
        check = getattr(_module(name), "available", None)
        out[name] = check() if check is not None else (True, f"{name} device")
    return out


def make_device(name: str, **kwargs) -> Device:
    return device_class(name)(**kwargs)
