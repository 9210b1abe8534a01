"""The kernel object every device launches.

A kernel body is written once against an array module ``xp`` (numpy on the simulated device, cupy
on the GPU): ``body(xp, *arrays, **scalars)`` and it must write its results *in place* into the
arrays named by ``writes``. On the simulated device the body runs when the stream executes the
launch (lazily), with arrays resolved by address at that moment; on the GPU it runs at enqueue time
inside ``with stream:``, so every CuPy ufunc/ElementwiseKernel/RawKernel it issues goes to that
stream and returns to the host at once.

Capture contract: a kernel body must not synchronise, read device values on the host, or allocate
host-visible results. ``capture`` declares whether it may be recorded into a CUDA graph:
``"safe"``, or ``"unsupported"`` with a ``reason``. ``uses_cublas`` marks bodies that call cuBLAS
(``xp.matmul``), which CuPy refuses during capture.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

from ._op import OpError


class KernelHostError(OpError):
    """A kernel's host code (its Python body) raised: a bug or an unchecked input in the kernel, not
    a device fault. Names the node and op type (or the kernel, for a runtime primitive) and the
    original exception, which is chained as ``__cause__``. Not sticky: the device stays usable.

    On CuPy the body runs at enqueue, so this is raised by the launch itself. On the simulated
    device the body runs lazily; the error is held by the device and raised once, at the next
    launch or synchronising call (synchronize, event synchronize, device-to-host copy) after the
    body ran, and the rest of the queued work still executes (its inputs may be garbage; the run
    that raised is abandoned by its caller).
    """

    def __init__(self, kernel: Kernel, scalars: dict[str, Any], exc: BaseException):
        node = scalars.get("node")
        if node is not None and hasattr(node, "op_type"):
            who = f"node {node.name!r} ({node.op_type}, opset {node.opset})"
        else:
            who = f"kernel {kernel.name!r}"
        super().__init__(f"{who}: kernel host code raised {type(exc).__name__}: {exc} (not a device fault)")
        self.kernel = kernel
        self.node = node
        self.original = exc


def is_host_error(exc: BaseException) -> bool:
    """Whether an exception from a kernel body is the body's own host-code failure (wrapped into
    ``KernelHostError``) rather than memory exhaustion (reported by memory accounting), one of
    lockstep's device errors (they carry ``cuda_name``) or the engine protocol's ``Unsupported``
    (a counted skip with its reason), which keep their own class."""
    from lockstep.engines.protocol import Unsupported  # the protocol's exception: no runtime import

    return (isinstance(exc, Exception) and not isinstance(exc, (MemoryError, KernelHostError, Unsupported))
            and not hasattr(exc, "cuda_name"))


CAPTURE_SAFE = "safe"
CAPTURE_UNSUPPORTED = "unsupported"


@dataclass(frozen=True)
class Kernel:
    name: str
    body: Callable[..., None]
    writes: tuple[int, ...]  # indices of the arrays it writes; negative indices count from the end
    capture: str = CAPTURE_SAFE
    reason: str = ""
    uses_cublas: bool = False
    # Optional GPU-only body for kernels with no array-module form (e.g. a timed spin).
    cuda_body: Callable[..., None] | None = field(default=None, compare=False)

    def __post_init__(self) -> None:
        if self.capture not in (CAPTURE_SAFE, CAPTURE_UNSUPPORTED):
            raise ValueError(f"kernel {self.name!r}: capture must be 'safe' or 'unsupported', got {self.capture!r}")
        if self.capture != CAPTURE_SAFE and not self.reason:
            raise ValueError(f"kernel {self.name!r}: capture={self.capture!r} needs a reason")
        if not self.writes:
            raise ValueError(f"kernel {self.name!r}: a kernel must write at least one array")

    def run(self, xp: Any, arrays: list[Any], scalars: dict[str, Any]) -> None:
        body = self.cuda_body if (self.cuda_body is not None and xp.__name__ == "cupy") else self.body
        body(xp, *arrays, **scalars)
