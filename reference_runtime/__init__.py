"""lockstep's reference CUDA runtime: devices, runtime primitives, and (later) the ONNX executor."""

from .config import RuntimeConfig
from .errors import *  # noqa: F401,F403
from .errors import __all__ as _errors_all
from .runtime import Counters, GraphSlot, Runtime, Tensor

__all__ = ["Runtime", "RuntimeConfig", "Tensor", "GraphSlot", "Counters", *_errors_all]
