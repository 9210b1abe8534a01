"""lockstep's kernels. A kernel body is written once against an array module; see ``_kernel``."""

from . import primitives
from ._kernel import CAPTURE_SAFE, CAPTURE_UNSUPPORTED, Kernel, KernelHostError

__all__ = ["Kernel", "KernelHostError", "CAPTURE_SAFE", "CAPTURE_UNSUPPORTED", "primitives"]
