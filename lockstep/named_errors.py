"""lockstep's named errors: what a bad model, bad input or a refused device operation raises.

One list, used where the distinction matters: the CLI prints these as one line (anything else is a
bug and keeps its traceback) and the fuzzer counts them as ``named`` (anything else is a crash).
``CudaError`` covers the device's refusals (``MemoryAllocation``, ``DeviceAssert``...); the fuzzer
still counts a ``LaunchFailure`` as a crash, since on the simulated device only a kernel's own
Python raises it.
"""

from __future__ import annotations

__all__ = ["named_errors"]


def named_errors() -> tuple[type, ...]:
    from lockstep.decoder_io import ModelCardError, NotADecoder, StepError
    from lockstep.engines import EngineLoadError, Unsupported
    from lockstep.golden.catalog import GoldenError
    from lockstep.golden.text import TokenizerError
    from lockstep.kernels._op import OpError
    from lockstep.reference_runtime import errors as e
    from lockstep.reference_runtime.executor import FeedError
    from lockstep.reference_runtime.model import ModelError

    return (ModelError, Unsupported, FeedError, OpError, e.CudaError, e.CaptureD2HRefused, e.CaptureOnLegacyStream,
            e.CublasDuringCapture, e.CaptureUnmodelled, e.SyncDebugError, StepError, NotADecoder, ModelCardError,
            TokenizerError, GoldenError, EngineLoadError)
