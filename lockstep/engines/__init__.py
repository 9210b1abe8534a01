"""Engines: the protocol a runtime implements, and the registry that finds them.

See ``protocol`` for what an engine is and ``registry`` for how one is registered (the entry-point
group ``lockstep.engines``). The built-in engines: ``lockstep.reference_runtime.engine`` (ref-sim,
ref-cuda), ``lockstep.engines.ort`` (ort-cpu, ort-cuda, ort-cuda-tf32) and ``lockstep.engines.ort_genai``
(ort-genai, ort-genai-cuda: ONNX Runtime GenAI's Generator); ``lockstep.engines.onnx_backend``
turns any ``onnx.backend.base.Backend`` into an engine.
"""

from .protocol import (
                       DEFAULT_PRECISION,
                       PRECISIONS,
                       Capabilities,
                       CaptureStats,
                       DecodeSession,
                       Engine,
                       RunFn,
                       Unsupported,
                       capabilities,
                       precision_of,
                       unsupported_reason,
)
from .registry import GROUP, EngineLoadError, load_engine, registered, validate

__all__ = ["Engine", "DecodeSession", "CaptureStats", "Capabilities", "Unsupported", "RunFn", "PRECISIONS",
           "DEFAULT_PRECISION", "capabilities", "precision_of", "unsupported_reason", "GROUP", "EngineLoadError", "load_engine", "registered", "validate"]
