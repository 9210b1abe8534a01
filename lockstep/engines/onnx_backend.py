"""Any ``onnx.backend.base.Backend`` as a lockstep engine.

A runtime that already runs ONNX's backend tests has a ``Backend`` (``prepare(model, device)``
returning a ``BackendRep`` whose ``run(inputs)`` gives the outputs). One line makes it an engine::

    def load_engine():
        return BackendEngine(my_runtime.backend, name="mine", device="CUDA")

registered under ``lockstep.engines`` (or named as ``my_module:make_engine``). The node suite runs
through ``prepare``/``run``; the golden locks decode through it with the KV cache on the host
(``lockstep.decoding.HostKVSession``). A model the backend reports incompatible, or a
``NotImplementedError`` from its ``prepare``, is ``Unsupported``.
"""

from __future__ import annotations

import importlib
from typing import Any

import numpy as np
import onnx

from .protocol import DEFAULT_PRECISION, RunFn, Unsupported

__all__ = ["BackendEngine"]


class BackendEngine:
    def __init__(self, backend: Any, name: str, device: str = "CPU", *,
                 precision: dict[str, str] | None = None, **prepare_kwargs: Any):
        if isinstance(backend, str):  # "package.module" holding prepare/run_model, or "module:Class"
            module, _, attr = backend.partition(":")
            backend = getattr(importlib.import_module(module), attr) if attr else importlib.import_module(module)
        for method in ("prepare", "supports_device"):
            if not callable(getattr(backend, method, None)):
                raise TypeError(f"{backend!r} is not an onnx.backend.base.Backend: no {method}()")
        self.backend = backend
        self.name = name
        self.device = device
        self.precision = dict(precision or DEFAULT_PRECISION)
        self.prepare_kwargs = prepare_kwargs

    def available(self) -> tuple[bool, str]:
        try:
            ok = bool(self.backend.supports_device(self.device))
        except Exception as exc:
            return False, f"{self.backend!r}.supports_device({self.device!r}) raised {exc!r}"
        return (ok, f"{getattr(self.backend, '__name__', self.backend)} on {self.device}" if ok
                else f"the backend does not support device {self.device!r}")

    def describe(self) -> dict[str, str]:
        return {"backend": getattr(self.backend, "__name__", repr(self.backend)), "device": self.device}

    def prepare(self, model: onnx.ModelProto) -> RunFn:
        is_compatible = getattr(self.backend, "is_compatible", None)
        if is_compatible is not None and not is_compatible(model, self.device, **self.prepare_kwargs):
            raise Unsupported(f"{self.name}: the backend reports the model incompatible (is_compatible)")
        try:
            rep = self.backend.prepare(model, self.device, **self.prepare_kwargs)
        except NotImplementedError as exc:
            raise Unsupported(f"{self.name}: {exc}") from exc
        init = {t.name for t in model.graph.initializer}
        names = [vi.name for vi in model.graph.input if vi.name not in init]

        def run(feeds: dict[str, np.ndarray]) -> list[np.ndarray]:
            return [np.asarray(x) for x in rep.run([feeds[n] for n in names if n in feeds])]

        return run
