"""Conversions to and from the dtypes CuPy lacks, written as integer bit manipulation with ``xp``.

ONNX's small types (bfloat16, the float8 family, float4/float6, float8e8m0, int4/uint4,
int2/uint2) are ml_dtypes dtypes on the host and on the simulated device (numpy). CuPy has none of
them, so every conversion here works on the raw bits (uint8/uint16 arrays) and plain float/int
arrays, with ops that exist in both numpy and CuPy:

- ``convert(xp, x, dst, saturate, round_mode)``: ONNX Cast semantics from ``x`` (its own dtype is
  the source type) to ``dst``;
- ``to_float(xp, x)``: decode any numeric array to a standard float array (float32 for the small
  types), for arithmetic (DequantizeLinear);
- ``encode(xp, f, dst, saturate)``: a standard float array to ``dst``'s representation.

Arrays of a small type are read through ``raw(xp, x)`` (``x.view(uint8/uint16)`` on numpy; on
CuPy an array that reaches a kernel as raw storage is already unsigned bits). Results are turned
into the type by ``wrap(xp, bits, dst)``: ``bits.view(dst)`` on numpy; on CuPy the raw bits are
returned, the only representation such a value can have there. ``storage_dtype`` is what a device
without the type stores it as, ``canonical_dtype`` what ``decode(xp, bits, dtype)`` gives
(``_small`` runs kernels on raw bits with them).

Rounding is round-to-nearest-even throughout. Values below the target's normal range are rounded
by an addition in the source float type (``|x| + C`` where C's ulp is the target's subnormal
step), which relies on the device's default RNE addition (no flush-to-zero).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from ._op import dtype_name

__all__ = [
    "E8M0", "SMALL_DTYPES", "FloatFmt", "IntFmt", "bit_width", "canonical_dtype", "convert", "decode", "encode",
    "fmt_of", "is_numpy", "is_small", "raw", "storage_dtype", "to_float", "wrap",
]


@dataclass(frozen=True)
class FloatFmt:
    """A small float format: ``kind`` is ieee (inf and NaN), fn (NaN = all ones, no inf), fnuz (NaN
    = 0x80, no -0, no inf) or nonan (neither NaN nor inf: overflow saturates)."""

    name: str
    bits: int
    ebits: int
    mbits: int
    bias: int
    kind: str

    @property
    def store(self) -> Any:
        return np.uint16 if self.bits > 8 else np.uint8

    @property
    def magmask(self) -> int:
        return (1 << (self.bits - 1)) - 1

    @property
    def max_code(self) -> int:
        if self.kind == "ieee":
            return (((1 << self.ebits) - 2) << self.mbits) | ((1 << self.mbits) - 1)
        if self.kind == "fn":
            return self.magmask - 1
        return self.magmask

    @property
    def inf_code(self) -> int:
        return ((1 << self.ebits) - 1) << self.mbits


@dataclass(frozen=True)
class IntFmt:
    name: str
    bits: int
    signed: bool


E8M0 = "float8_e8m0fnu"

_FORMATS: dict[str, Any] = {
    f.name: f
    for f in (
        FloatFmt("bfloat16", 16, 8, 7, 127, "ieee"),
        FloatFmt("float8_e4m3fn", 8, 4, 3, 7, "fn"),
        FloatFmt("float8_e4m3fnuz", 8, 4, 3, 8, "fnuz"),
        FloatFmt("float8_e5m2", 8, 5, 2, 15, "ieee"),
        FloatFmt("float8_e5m2fnuz", 8, 5, 2, 16, "fnuz"),
        FloatFmt("float4_e2m1fn", 4, 2, 1, 1, "nonan"),
        FloatFmt("float6_e2m3fn", 6, 2, 3, 1, "nonan"),
        FloatFmt("float6_e3m2fn", 6, 3, 2, 3, "nonan"),
        IntFmt("int4", 4, True),
        IntFmt("uint4", 4, False),
        IntFmt("int2", 2, True),
        IntFmt("uint2", 2, False),
    )
}
_FORMATS[E8M0] = E8M0

# The numpy (ml_dtypes) names of the small types: what a device without them stores as raw bits.
SMALL_DTYPES = frozenset(_FORMATS)


def fmt_of(dtype: Any) -> Any:
    """The small-type format of ``dtype`` (FloatFmt, IntFmt or E8M0), or None for a standard dtype."""
    return _FORMATS.get(dtype_name(dtype))  # (memoised name: the executor asks per node on CuPy)


def is_small(dtype: Any) -> bool:
    return fmt_of(dtype) is not None


def bit_width(dtype: Any) -> int:
    f = fmt_of(dtype)
    if isinstance(f, (FloatFmt, IntFmt)):
        return f.bits
    return np.dtype(dtype).itemsize * 8


def is_numpy(xp: Any) -> bool:
    """numpy holding the small types as ml_dtypes arrays (not the raw-bit simulated device's
    ``RAW_BITS`` numpy, which models CuPy: bits only)."""
    return getattr(xp, "__name__", "") == "numpy" and not getattr(xp, "RAW_BITS", False)


def _store_of(fmt: Any) -> Any:
    return fmt.store if isinstance(fmt, FloatFmt) else np.uint8


def storage_dtype(dtype: Any) -> np.dtype:
    """The dtype a small type is stored as on a device that lacks it (uint16 for bfloat16, uint8 for
    the others, one element per byte for the 4- and 2-bit types); any other dtype is its own."""
    f = fmt_of(dtype)
    return np.dtype(dtype) if f is None else np.dtype(_store_of(f))


def canonical_dtype(dtype: Any) -> np.dtype:
    """The standard dtype a small type decodes to exactly: int8 for int4/uint4/int2/uint2, float32
    for the floats (bfloat16, float8, float8e8m0, float4/float6); any other dtype is its own."""
    f = fmt_of(dtype)
    if f is None:
        return np.dtype(dtype)
    return np.dtype(np.int8) if isinstance(f, IntFmt) else np.dtype(np.float32)


def raw(xp: Any, x: Any) -> Any:
    """The unsigned storage bits of an array of a small type."""
    store = _store_of(fmt_of(x.dtype)) if is_small(x.dtype) else None
    if store is None:
        if x.dtype in (np.dtype(np.uint8), np.dtype(np.uint16)):
            return x  # raw storage (CuPy)
        raise TypeError(f"raw bits asked of a {x.dtype} array")
    return x.view(store)


def wrap(xp: Any, bits: Any, dst: Any) -> Any:
    """Storage bits as an array of the small type ``dst`` (numpy); the bits themselves on CuPy."""
    f = fmt_of(dst)
    bits = bits.astype(_store_of(f))
    if is_numpy(xp):
        return bits.view(np.dtype(dst))
    return bits


# ----------------------------------------------------------------------------- small floats

_SRC = {  # source float: (float dtype, uint dtype, width, mantissa bits, bias)
    "float32": (np.float32, np.uint32, 32, 23, 127),
}


def _as_src_float(xp: Any, f: Any) -> Any:
    """The float32 the encoders round from. float64 goes through float32 first, as ml_dtypes (the
    ONNX reference) and ONNX Runtime do: a double rounding, kept for agreement with them."""
    return f if f.dtype == np.float32 else f.astype(xp.float32)


def _encode_float(xp: Any, f: Any, fmt: FloatFmt, saturate: bool) -> Any:
    """Round float32 ``f`` to ``fmt`` (RNE); returns the codes as uint32."""
    F, U, W, S, B = _SRC[f.dtype.name]
    m, bias = fmt.mbits, fmt.bias
    u = U  # typed constants (u(3)) keep numpy and CuPy in the unsigned type
    bits = f.view(U)
    sign = bits >> u(W - 1)
    a = bits & u((1 << (W - 1)) - 1)
    shift = S - m
    # target-normal range: round the mantissa in place (carry flows into the exponent), rebias
    r = (a + u((1 << (shift - 1)) - 1) + ((a >> u(shift)) & u(1))) >> u(shift)
    code_n = r - u((B - bias) << m)
    # target-subnormal range: let the float adder round |f| to a multiple of the subnormal step
    c = F(2.0 ** (1 - bias - m + S))
    code_s = (xp.abs(f) + c).view(U) - u(int(np.asarray(c).view(U)))
    code = xp.where(a < u((1 - bias + B) << S), code_s, code_n)
    inf_bits = u(((1 << (W - 1 - S)) - 1) << S)
    is_nan = a > inf_bits
    over = (code > u(fmt.max_code)) | (a == inf_bits)
    if saturate or fmt.kind == "nonan":
        ovf = u(fmt.max_code)
    elif fmt.kind == "ieee":
        ovf = u(fmt.inf_code)
    elif fmt.kind == "fn":
        ovf = u(fmt.magmask)
    else:  # fnuz
        ovf = u(1 << (fmt.bits - 1))
    code = xp.where(over, ovf, code)
    top = u(fmt.bits - 1)
    if fmt.kind == "ieee":
        code = xp.where(is_nan, u(fmt.inf_code | (1 << (m - 1))), code)
    elif fmt.kind == "fn":
        code = xp.where(is_nan, u(fmt.magmask), code)
    elif fmt.kind == "fnuz":
        code = xp.where(is_nan, u(1 << (fmt.bits - 1)), code)
        sign = xp.where(code == u(0), u(0), sign)  # no negative zero
    else:  # nonan: NaN has no encoding; ml_dtypes gives a zero with the sign flipped
        code = xp.where(is_nan, u(0), code)
        sign = xp.where(is_nan, sign ^ u(1), sign)
    return code | (sign << top)


def _decode_float(xp: Any, bits: Any, fmt: FloatFmt) -> Any:
    """Codes of ``fmt`` (unsigned ints) to float32 (exact)."""
    c = bits.astype(xp.uint32)
    u = np.uint32
    m, bias = fmt.mbits, fmt.bias
    sign = (c >> u(fmt.bits - 1)) & u(1)
    mag = c & u(fmt.magmask)
    e = mag >> u(m)
    mant = mag & u((1 << m) - 1)
    normal = ((sign << u(31)) | ((e + u(127 - bias)) << u(23)) | (mant << u(23 - m))).view(xp.float32)
    sub = mant.astype(xp.float32) * np.float32(2.0 ** (1 - bias - m))
    sub = xp.where(sign == u(1), -sub, sub)
    out = xp.where(e == u(0), sub, normal)
    nan = np.float32(np.nan)
    if fmt.kind == "ieee":
        all_ones = e == u((1 << fmt.ebits) - 1)
        inf = xp.where(sign == u(1), np.float32(-np.inf), np.float32(np.inf))
        out = xp.where(all_ones, xp.where(mant == u(0), inf, nan), out)
    elif fmt.kind == "fn":
        out = xp.where(mag == u(fmt.magmask), nan, out)
    elif fmt.kind == "fnuz":
        out = xp.where(c == u(1 << (fmt.bits - 1)), nan, out)
    return out.astype(xp.float32)


# ----------------------------------------------------------------------------- float8e8m0

def _encode_e8m0(xp: Any, f: Any, saturate: bool, round_mode: str) -> Any:
    """onnx.numpy_helper.to_float8e8m0, with xp ops: the float32 exponent, rounded."""
    u = np.uint32
    b = f.astype(xp.float32).view(xp.uint32)
    e = (b >> u(23)) & u(0xFF)
    special = e == u(0xFF)
    if round_mode == "nearest":
        g = (b & u(0x400000)) != u(0)
        r = (b & u(0x200000)) != u(0)
        s = (b & u(0x1FFFFF)) != u(0)
        up = g & (r | s | (e > u(0)))
    elif round_mode == "up":
        up = (b & u(0x7FFFFF)) != u(0)
    elif round_mode == "down":
        up = xp.zeros(e.shape, dtype=bool)
    else:
        raise ValueError(f"round_mode {round_mode!r} (expected up, down or nearest)")
    up = up & ~special
    if saturate:
        up = up & (e != u(0xFE))
    e = (e + up.astype(xp.uint32)) & u(0xFF)
    return xp.where(special, u(0xFF), e)


def _decode_e8m0(xp: Any, bits: Any) -> Any:
    u = np.uint32
    c = bits.astype(xp.uint32)
    out = xp.where(c == u(0), u(0x400000), c << u(23)).view(xp.float32)  # 2**-127 is subnormal
    return xp.where(c == u(0xFF), np.float32(np.nan), out)


# ----------------------------------------------------------------------------- int4/uint4/int2/uint2

def _encode_int(xp: Any, v: Any, fmt: IntFmt) -> Any:
    """Integer or float values to ``fmt``'s low bits, as ONNX's technical notes on these types
    define Cast to them (onnx docs/docsgen/source/technical/int4.md and int2.md, "Cast": "rounding
    to the nearest-integer (with ties to even) nearest-even integer and truncating", truncating the
    bits as packing does, ``x & 0x0F``): a float is rounded half to even (0.5 -> 0, 1.5 -> 2,
    -2.5 -> -2), then every value keeps its low bits, so out of range wraps in two's complement
    (int4: -9 -> 7, 7.5 -> 8 -> -8, 100 -> 4). The Cast operator's own text leaves float to fixed
    point out of range undefined; so are NaN and +-inf, which give 0 here (as ml_dtypes' astype of
    every version and ONNX Runtime 1.31 give them). A finite float keeps the low bits of its exact
    integer value: the clip to +-2**62 only spares int64 (a float that large is a multiple of
    2**10, low bits 0, as the clipped value's). ml_dtypes' astype differs, so neither it nor the
    node cases it generates is the reference here: 0.5.4 and 0.6 truncate toward zero, then wrap;
    0.7 truncates, and gives 0 for out of range. QuantizeLinear rounds and saturates before it
    calls this (its integers come through unchanged)."""
    if v.dtype.kind == "f":
        v = v.astype(xp.float64)
        v = xp.clip(xp.where(xp.isfinite(v), xp.rint(v), 0.0), -(2.0 ** 62), 2.0 ** 62)
    v = v.astype(xp.int64)
    return (v & np.int64((1 << fmt.bits) - 1)).astype(xp.uint8)


def _decode_int(xp: Any, bits: Any, fmt: IntFmt) -> Any:
    b = bits.astype(xp.int16) & np.int16((1 << fmt.bits) - 1)
    if fmt.signed:
        half = np.int16(1 << (fmt.bits - 1))
        b = (b ^ half) - half
    return b.astype(xp.int8)


# ----------------------------------------------------------------------------- entry points

def to_float(xp: Any, x: Any) -> Any:
    """``x`` as a standard float array: small types decode to float32 (exactly), float16/32/64 stay,
    integers and bool become float32."""
    f = fmt_of(x.dtype)
    if isinstance(f, FloatFmt):
        return _decode_float(xp, raw(xp, x), f)
    if f == E8M0:
        return _decode_e8m0(xp, raw(xp, x))
    if isinstance(f, IntFmt):
        return _decode_int(xp, raw(xp, x), f).astype(xp.float32)
    if x.dtype.kind == "f":
        return x
    return x.astype(xp.float32)


def _canonical(xp: Any, x: Any) -> Any:
    """Small types decoded to a standard dtype (float32 for floats, int8 for integers)."""
    f = fmt_of(x.dtype)
    if isinstance(f, IntFmt):
        return _decode_int(xp, raw(xp, x), f)
    if f is not None:
        return to_float(xp, x)
    return x


def decode(xp: Any, bits: Any, dtype: Any) -> Any:
    """The raw storage ``bits`` of the small type ``dtype`` (uint8/uint16, or an array of ``dtype``
    itself) decoded exactly to ``canonical_dtype(dtype)``."""
    f = fmt_of(dtype)
    b = raw(xp, bits)
    if isinstance(f, FloatFmt):
        return _decode_float(xp, b, f)
    if f == E8M0:
        return _decode_e8m0(xp, b)
    if isinstance(f, IntFmt):
        return _decode_int(xp, b, f)
    raise TypeError(f"{np.dtype(dtype)} is not a small type")


def encode(xp: Any, v: Any, dst: Any, saturate: bool = True, round_mode: str = "up") -> Any:
    """A standard-dtype array to the small type ``dst`` (see ``wrap`` for what comes back)."""
    f = fmt_of(dst)
    if isinstance(f, FloatFmt):
        bits = _encode_float(xp, _as_src_float(xp, v), f, saturate)
    elif f == E8M0:
        bits = _encode_e8m0(xp, v, saturate, round_mode)
    elif isinstance(f, IntFmt):
        bits = _encode_int(xp, v, f)
    else:
        raise TypeError(f"{np.dtype(dst)} is not a small type")
    return wrap(xp, bits, dst)


def convert(xp: Any, x: Any, dst: Any, saturate: bool = True, round_mode: str = "up") -> Any:
    """ONNX Cast of ``x`` to ``dst``: float8 ``saturate`` (overflow and inf to the largest finite
    value), ``round_mode`` for float8e8m0; other small types wrap (ints) or saturate (float4/6)."""
    dst = np.dtype(dst)
    if x.dtype == dst:
        return x
    v = _canonical(xp, x)
    if not is_small(dst):
        return v.astype(dst)
    if dst.name == "bfloat16":
        saturate = False  # saturate only concerns float8 types
    return encode(xp, v, dst, saturate, round_mode)
