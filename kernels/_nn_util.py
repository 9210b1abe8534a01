"""Helpers for ``ops_nn``: precision handling and xp-only special functions (sigmoid, softplus; erf is ``_elementwise_util.erf``).

Everything here takes an array module ``xp`` (numpy or CuPy) and uses only functions both provide
with the same meaning; nothing reads device values on the host.
"""

from __future__ import annotations

import numpy as np

__all__ = ["sigmoid", "softplus", "stash_dtype", "to_work", "work_dtype"]

_F32 = np.dtype(np.float32)
_F64 = np.dtype(np.float64)


def work_dtype(dtype) -> np.dtype:
    """The dtype to compute a floating op in: float64 stays, everything else goes to float32."""
    dtype = np.dtype(dtype)
    return _F64 if dtype == _F64 else _F32


def to_work(x, dtype=None):
    """``x`` as the working float dtype (float32, or float64 for float64 inputs), copying only if needed."""
    want = work_dtype(x.dtype) if dtype is None else np.dtype(dtype)
    return x if x.dtype == want else x.astype(want)


def stash_dtype(stash_type: int, x_dtype) -> np.dtype:
    """The computation dtype for a normalization's ``stash_type`` (TensorProto elem type), never less
    precise than float32, and float64 when either the input or the stash type is float64."""
    if np.dtype(x_dtype) == _F64 or int(stash_type) == 11:  # TensorProto.DOUBLE
        return _F64
    return _F32


def sigmoid(xp, x):
    """1/(1+exp(-x)) without overflow for either sign."""
    e = xp.exp(-xp.abs(x))
    return xp.where(x >= 0, 1.0 / (1.0 + e), e / (1.0 + e))


def softplus(xp, x):
    """log(1+exp(x)) without overflow."""
    return xp.maximum(x, 0.0) + xp.log1p(xp.exp(-xp.abs(x)))
