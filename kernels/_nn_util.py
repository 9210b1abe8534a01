"""Helpers for ``ops_nn``: precision handling and xp-only special functions (erf, sigmoid, softplus).

Everything here takes an array module ``xp`` (numpy or CuPy) and uses only functions both provide
with the same meaning; nothing reads device values on the host.
"""

from __future__ import annotations

import numpy as np

__all__ = ["erf", "sigmoid", "softplus", "stash_dtype", "to_work", "work_dtype"]

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


# W. J. Cody, "Rational Chebyshev approximations for the error function" (Math. Comp. 1969), as in
# his CALERF routine: three ranges, each a rational function; accurate to about 1e-16 relative.
_A = (3.16112374387056560e00, 1.13864154151050156e02, 3.77485237685302021e02,
      3.20937758913846947e03, 1.85777706184603153e-1)
_B = (2.36012909523441209e01, 2.44024637934444173e02, 1.28261652607737228e03,
      2.84423683343917062e03)
_C = (5.64188496988670089e-1, 8.88314979438837594e00, 6.61191906371416295e01,
      2.98635138197400131e02, 8.81952221241769090e02, 1.71204761263407058e03,
      2.05107837782607147e03, 1.23033935479799725e03, 2.15311535474403846e-8)
_D = (1.57449261107098347e01, 1.17693950891312499e02, 5.37181101862009858e02,
      1.62138957456669019e03, 3.29079923573345963e03, 4.36261909014324716e03,
      3.43936767414372164e03, 1.23033935480374942e03)
_P = (3.05326634961232344e-1, 3.60344899949804439e-1, 1.25781726111229246e-1,
      1.60837851487422766e-2, 6.58749161529837803e-4, 1.63153871373020978e-2)
_Q = (2.56852019228982242e00, 1.87295284992346725e00, 5.27905102951428412e-1,
      6.05183413124413191e-2, 2.33520497626869185e-3)
_SQRPI = 5.6418958354775628695e-1  # 1/sqrt(pi)


def erf(xp, x):
    """erf(x) elementwise for a float32/float64 array ``x`` (result in ``x``'s dtype).

    Computed in float64 internally for float64 inputs, float32 otherwise (float16/bfloat16 inputs
    are promoted to float32). NaN propagates; +-inf give +-1.
    """
    x = to_work(x)
    y = xp.abs(x)
    # |x| <= 0.5: erf = x * R1(x^2) (x clipped so the unused lanes stay finite)
    xs = xp.clip(x, -0.5, 0.5)
    ysq = xs * xs
    xnum = _A[4] * ysq
    xden = ysq
    for i in range(3):
        xnum = (xnum + _A[i]) * ysq
        xden = (xden + _B[i]) * ysq
    small = xs * (xnum + _A[3]) / (xden + _B[3])
    # 0.5 < |x| <= 4: erfc = exp(-x^2) * R2(|x|)
    ym = xp.minimum(y, 4.0)
    xnum = _C[8] * ym
    xden = ym
    for i in range(7):
        xnum = (xnum + _C[i]) * ym
        xden = (xden + _D[i]) * ym
    mid = (xnum + _C[7]) / (xden + _D[7])
    # |x| > 4: erfc = exp(-x^2)/|x| * (1/sqrt(pi) + R3(1/x^2)/x^2)
    yl = xp.maximum(y, 4.0)
    yl = xp.minimum(yl, 27.0)  # erfc underflows to 0 long before; keeps inf out of the arithmetic
    inv = 1.0 / (yl * yl)
    xnum = _P[5] * inv
    xden = inv
    for i in range(4):
        xnum = (xnum + _P[i]) * inv
        xden = (xden + _Q[i]) * inv
    large = inv * (xnum + _P[4]) / (xden + _Q[4])
    large = (_SQRPI - large) / yl
    ytail = xp.where(y <= 4.0, ym, yl)
    r = xp.where(y <= 4.0, mid, large)
    # exp(-y^2) split as exp(-t^2) * exp(-(y-t)(y+t)) with t = y rounded down to 1/16, for accuracy
    t = xp.trunc(ytail * 16.0) / 16.0
    erfc = xp.exp(-t * t) * xp.exp(-(ytail - t) * (ytail + t)) * r
    big = (0.5 - erfc) + 0.5
    big = xp.where(x < 0, -big, big)
    out = xp.where(y <= 0.5, small, big)
    return xp.where(xp.isnan(x), x, out).astype(x.dtype, copy=False)


def sigmoid(xp, x):
    """1/(1+exp(-x)) without overflow for either sign."""
    e = xp.exp(-xp.abs(x))
    return xp.where(x >= 0, 1.0 / (1.0 + e), e / (1.0 + e))


def softplus(xp, x):
    """log(1+exp(x)) without overflow."""
    return xp.maximum(x, 0.0) + xp.log1p(xp.exp(-xp.abs(x)))
