"""xp-generic (numpy / CuPy) helpers of the elementwise kernels whose ONNX semantics differ from
the plain numpy ufunc: erf (CuPy has no top-level ``erf``), C-style integer division, ONNX Mod,
Pow keeping the base dtype, and BitShift with out-of-range shift amounts.

Every helper uses only ``xp`` functions that exist with the same meaning in numpy and CuPy, never
reads device values on the host, and returns an array of the dtype ONNX prescribes. Divisors and
shift amounts that would be undefined in CUDA (integer division by zero, shifts >= the bit width)
are replaced before the operation, so the GPU never executes undefined behaviour and numpy never
warns.
"""

from __future__ import annotations

from typing import Any

import numpy as np

__all__ = ["erf", "int_div", "mod", "power", "bitshift", "is_int", "is_signed", "kind"]


def kind(dtype: Any) -> str:
    """numpy's dtype kind, with ml_dtypes' bfloat16 (kind 'V') counted as a float ('f')."""
    dt = np.dtype(dtype)
    kind = dt.kind  # (numpy builds .name in Python: read only for the kind bfloat16 has)
    return "f" if kind == "V" and dt.name == "bfloat16" else kind


def is_int(dtype: Any) -> bool:
    return np.dtype(dtype).kind in "iu"


def is_signed(dtype: Any) -> bool:
    return np.dtype(dtype).kind == "i"


# --- erf: Cephes (ndtr.c, S. L. Moshier, public domain) rational approximations, evaluated in
# float64: |x| <= 1: erf = x T(x^2) / U(x^2); 1 < |x|: erfc = exp(-x^2) P(|x|) / Q(|x|), with |x|
# clamped to 6 (erfc(6) ~ 2e-17, so erf rounds to +-1 there even in float64).
_T = (9.60497373987051638749e0, 9.00260197203842689217e1, 2.23200534594684319226e3,
      7.00332514112805075473e3, 5.55923013010394962768e4)
_U = (1.0, 3.35617141647503099647e1, 5.21357949780152679795e2, 4.59432382970980127987e3,
      2.26290000613890934246e4, 4.92673942608635921086e4)
_P = (2.46196981473530512524e-10, 5.64189564831068821977e-1, 7.46321056442269912687e0,
      4.86371970985681366614e1, 1.96520832956077098242e2, 5.26445194995477358631e2,
      9.34528527171957607540e2, 1.02755188689515710272e3, 5.57535335369399327526e2)
_Q = (1.0, 1.32281951154744992508e1, 8.67072140885989742329e1, 3.54937778887819891062e2,
      9.75708501743205489753e2, 1.82390916687909736289e3, 2.24633760818710981792e3,
      1.65666309194161350182e3, 5.57535340817727675546e2)


def _polevl(x, coefs):
    acc = x * 0.0 + coefs[0]
    for c in coefs[1:]:
        acc = acc * x + c
    return acc


def erf(xp, x):
    """erf(x) to float64 accuracy, cast back to x's dtype (NaN propagates, erf(+-inf) = +-1)."""
    x64 = x.astype(xp.float64)
    ax = xp.abs(x64)
    xs = xp.clip(x64, -1.0, 1.0)  # the small branch only ever sees |x| <= 1
    zs = xs * xs
    small = xs * _polevl(zs, _T) / _polevl(zs, _U)
    am = xp.clip(ax, 1.0, 6.0)  # the tail branch only ever sees 1 <= |x| <= 6 (NaN stays NaN)
    erfc = xp.exp(-(am * am)) * _polevl(am, _P) / _polevl(am, _Q)
    big = xp.where(x64 < 0, erfc - 1.0, 1.0 - erfc)
    big = xp.where(xp.isnan(x64), x64, big)
    return xp.where(ax <= 1.0, small, big).astype(x.dtype)


# --- integer arithmetic with C semantics


def _safe_divisor(xp, b):
    return xp.where(b == 0, xp.ones_like(b), b)


def int_div(xp, a, b, dtype):
    """Integer division truncating toward zero (C, ONNX); x / 0 gives 0 (undefined in ONNX)."""
    a = a.astype(dtype, copy=False)
    b = b.astype(dtype, copy=False)
    bs = _safe_divisor(xp, b)
    r = xp.fmod(a, bs)  # truncated remainder: sign of a, so a - r is an exact multiple of bs
    q = xp.floor_divide(a - r, bs)
    return xp.where(b == 0, xp.zeros_like(q), q).astype(dtype, copy=False)


def mod(xp, a, b, fmod: bool, dtype):
    """ONNX Mod: fmod=1 -> C fmod (sign of a); fmod=0 -> a - floor(a/b)*b (sign of b).

    Floats follow numpy's divmod (fmod, then one correction step; zero takes b's sign), which
    gives the spec's special cases: x % +-inf = x (same sign) or +-inf (opposite sign), x % 0
    and +-inf % y = NaN. Integers modulo 0 give 0 (undefined in ONNX)."""
    a = a.astype(dtype, copy=False)
    b = b.astype(dtype, copy=False)
    if is_int(dtype):
        bs = _safe_divisor(xp, b)
        r = xp.fmod(a, bs)
        if not fmod and is_signed(dtype):
            adjust = (r != 0) & ((r < 0) != (b < 0))
            r = xp.where(adjust, r + bs, r)
        return xp.where(b == 0, xp.zeros_like(r), r).astype(dtype, copy=False)
    r = xp.fmod(a, b)
    if fmod:
        return r.astype(dtype, copy=False)
    adjust = (r != 0) & ((r < 0) != (b < 0))
    r = xp.where(adjust, r + b, r)
    r = xp.where(r == 0, xp.copysign(xp.zeros_like(r), b), r)
    return r.astype(dtype, copy=False)


def power(xp, a, b):
    """ONNX Pow: a ** b in a's dtype, whatever b's dtype."""
    dt = a.dtype
    if not is_int(dt):
        if is_int(b.dtype):
            return xp.power(a, b.astype(dt)).astype(dt, copy=False)
        work = np.promote_types(dt, b.dtype)  # host-side, on dtypes only
        return xp.power(a.astype(work, copy=False), b.astype(work, copy=False)).astype(dt)
    if not is_int(b.dtype):  # integer base, float exponent: computed in float64, truncated back
        return xp.power(a.astype(xp.float64), b.astype(xp.float64)).astype(dt)
    # integer ** integer: numpy refuses negative exponents; a ** -n is 1 (a == 1), +-1 (a == -1),
    # else 0 (truncation of 1/a**n; a == 0 is a division by zero, undefined, given 0).
    if is_signed(b.dtype):
        neg = b < 0
        e = xp.where(neg, xp.zeros_like(b), b).astype(dt)
        res = xp.power(a, e)
        odd = (b % 2) != 0
        one = xp.ones_like(res)
        inv = xp.where(a == 1, one, xp.where(a == -1, xp.where(odd, -one, one), xp.zeros_like(res)))
        return xp.where(neg, inv, res).astype(dt, copy=False)
    return xp.power(a, b.astype(dt)).astype(dt, copy=False)


def bitshift(xp, a, b, left: bool):
    """ONNX BitShift (opset 28 semantics, a superset of opset 11's unsigned-only one): right shifts
    of signed values are arithmetic; shifts < 0 or >= the bit width give the sign fill (-1 for a
    right shift of a negative value, else 0); left shifts of signed values wrap."""
    dt = a.dtype
    bits = np.dtype(dt).itemsize * 8
    b = b.astype(dt, copy=False)
    if is_signed(dt):
        valid = (b >= 0) & (b < bits)
    else:
        valid = b < bits
    s = xp.where(valid, b, xp.zeros_like(b))
    if left:
        if is_signed(dt):
            udt = np.dtype(f"u{np.dtype(dt).itemsize}")
            shifted = xp.left_shift(a.astype(udt), s.astype(udt)).astype(dt)
        else:
            shifted = xp.left_shift(a, s)
        fill = xp.zeros_like(shifted)
    else:
        shifted = xp.right_shift(a, s)
        fill = xp.zeros_like(shifted)
        if is_signed(dt):
            fill = xp.where(a < 0, fill - 1, fill)
    return xp.where(valid, shifted, fill).astype(dt, copy=False)
