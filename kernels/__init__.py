"""lockstep's kernels. A kernel body is written once against an array module; see ``_kernel``.

The names below are the package's interface to the runtime above it (the reference runtime's
executor, devices and control flow; the audit): import them from ``lockstep.kernels``, never from its
``_`` modules. The op kernels themselves are found through ``lockstep.kernels.registry``.
"""

from . import primitives
from ._attention import flex_output, flex_precision, flex_scores, flex_softmax
from ._attr_check import validate as validate_node
from ._cast_util import SMALL_DTYPES, storage_dtype
from ._host import Seq
from ._kernel import CAPTURE_SAFE, CAPTURE_UNSUPPORTED, Kernel, KernelHostError, is_host_error
from ._latch import as_check, flag_check
from ._launch import LaunchRecorder, RecordingModule, recording
from ._op import MEMO_MIN_MODEL_BYTES, NodeInfo, OpError, OpKernel, Spec, dtype_name
from ._small import in_dtypes as small_in_dtypes
from ._small import run as run_small
from ._xp_facts import DATA_DEPENDENT_SHAPE, HOST_RESULT

__all__ = [
    # kernels and their declarations
    "Kernel", "KernelHostError", "is_host_error", "CAPTURE_SAFE", "CAPTURE_UNSUPPORTED", "primitives",
    # ONNX op kernels: what the executor matches nodes to and checks them with
    "OpKernel", "NodeInfo", "OpError", "Spec", "MEMO_MIN_MODEL_BYTES", "dtype_name", "validate_node",
    # host values, small types, index checks, FlexAttention's device math
    "Seq", "SMALL_DTYPES", "storage_dtype", "small_in_dtypes", "run_small", "as_check", "flag_check",
    "flex_output", "flex_precision", "flex_scores", "flex_softmax",
    # launch records (the devices) and the array calls the audit and the capture guard share
    "LaunchRecorder", "RecordingModule", "recording", "DATA_DEPENDENT_SHAPE", "HOST_RESULT",
]
