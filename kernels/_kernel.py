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
