"""Engines: the protocol a runtime implements, and the registry that finds them.

See ``protocol`` for what an engine is and ``registry`` for how one is registered (the entry-point
group ``lockstep.engines``). The built-in engines: ``lockstep.reference_runtime.engine`` (ref-sim,
ref-cuda) and ``lockstep.engines.ort`` (ort-cpu, ort-cuda); ``lockstep.engines.onnx_backend``
turns any ``onnx.backend.base.Backend`` into an engine.
"""

from .protocol import (
                       DEFAULT_PRECISION,
                       PRECISIONS,
                       CaptureStats,
                       DecodeSession,
                       Engine,
                       RunFn,
                       Unsupported,
                       precision_of,
                       unsupported_reason,
)
from .registry import GROUP, EngineLoadError, load_engine, registered, validate

__all__ = ["Engine", "DecodeSession", "CaptureStats", "Unsupported", "RunFn", "PRECISIONS", "DEFAULT_PRECISION",
           "precision_of", "unsupported_reason", "GROUP", "EngineLoadError", "load_engine", "registered", "validate"]
