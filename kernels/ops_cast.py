"""cast ops: Cast, CastLike, BitCast, QuantizeLinear, DequantizeLinear, DynamicQuantizeLinear.

The small ONNX types (bfloat16, float8 e4m3fn/e4m3fnuz/e5m2/e5m2fnuz, float8e8m0, float4e2m1,
float6, int4/uint4, int2/uint2) are converted with integer bit manipulation (``_cast_util``), so
every kernel here is a plain elementwise computation on numpy and CuPy alike: all capture-safe.
On numpy these values are ml_dtypes arrays; CuPy has no such dtypes, so there they can only
exist as their raw storage bits (what ``_cast_util.wrap`` returns): there (``kernels._small``)
Cast, CastLike, QuantizeLinear and DequantizeLinear get their small inputs decoded exactly, with
``node.in_dtypes`` naming the types, and encode their small outputs themselves (``small="native"``);
BitCast moves the storage bits (``small="raw"``).
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np
from onnx import TensorProto, helper

from ._cast_util import E8M0, FloatFmt, bit_width, convert, encode, fmt_of, is_small, raw, to_float, wrap
from ._fast import cast_into
from ._op import NodeInfo, OpKernel, Spec, normalize_axis

OPS: list[OpKernel] = []


def _onnx_dtype(node: NodeInfo, to: Any, what: str = "to") -> np.dtype:
    """The numpy dtype of an ONNX element type (an int; opset-1 Cast spells it as a string)."""
    if isinstance(to, str):
        try:
            to = TensorProto.DataType.Value(to.upper())
        except ValueError:
            raise node.error(f"{what}={to!r} is not an ONNX tensor type") from None
    if to == TensorProto.STRING:
        raise node.error(f"{what}=STRING is not supported: string tensors never reach the device")
    try:
        return np.dtype(helper.tensor_dtype_to_np_dtype(int(to)))
    except (KeyError, ValueError, TypeError):
        raise node.error(f"{what}={to!r} is not a supported ONNX tensor type") from None


def _check_numeric(node: NodeInfo, spec: Spec, what: str) -> None:
    if spec.dtype == object or spec.dtype.kind in "SUO":
        raise node.error(f"{what} is a string tensor, which never reaches the device")


# ----------------------------------------------------------------------------- Cast, CastLike

def _saturate(node: NodeInfo) -> bool:
    return bool(node.attr("saturate", 1)) if node.opset >= 19 else True


def _round_mode(node: NodeInfo) -> str:
    mode = node.attr("round_mode", "up")
    if mode not in ("up", "down", "nearest"):
        raise node.error(f"round_mode={mode!r} (expected up, down or nearest)")
    return mode


def _cast_shapes(node, specs):
    x = specs[0]
    _check_numeric(node, x, "input")
    if node.attr("to") is None:
        raise node.error("attribute 'to' is required")
    _round_mode(node)
    return [Spec(x.shape, _onnx_dtype(node, node.attr("to")))]


def _castlike_shapes(node, specs):
    x, like = specs[0], specs[1]
    _check_numeric(node, x, "input")
    _check_numeric(node, like, "target_type")
    _round_mode(node)
    return [Spec(x.shape, like.dtype)]


def _cast_compute(xp, node, x, *_):
    dst = node.out_specs[0].dtype
    return (convert(xp, x, dst, _saturate(node), _round_mode(node)),)


def _cast_into(xp, node, outs, x, *_):
    """Between standard dtypes ``convert`` is ``astype``: one casting copy straight into the output
    (the same cast loop, so the same bytes, NaN and overflow included). Small types go to compute."""
    out = outs[0]
    if is_small(x.dtype) or is_small(out.dtype) or out.dtype != node.out_specs[0].dtype:
        return False
    if not cast_into(xp, out, x):  # one RawKernel on CuPy for the common types
        xp.copyto(out, x, casting="unsafe")
    return True


OPS += [
    OpKernel("Cast", _cast_shapes, _cast_compute, into=_cast_into, small="native", capture="safe"),
    OpKernel("CastLike", _castlike_shapes, _cast_compute, since=15, into=_cast_into, small="native", capture="safe"),
]


# ----------------------------------------------------------------------------- BitCast

def _bitcast_shapes(node, specs):
    x = specs[0]
    _check_numeric(node, x, "input")
    if node.attr("to") is None:
        raise node.error("attribute 'to' is required")
    dst = _onnx_dtype(node, node.attr("to"))
    if bit_width(x.dtype) != bit_width(dst):
        raise node.error(f"BitCast needs equal bit widths: {x.dtype} is {bit_width(x.dtype)} bits, "
                         f"{dst} is {bit_width(dst)}")
    return [Spec(x.shape, dst)]


_UINT = {1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64}


def _bitcast_compute(xp, node, x):
    dst = node.out_specs[0].dtype
    bits = raw(xp, x) if is_small(x.dtype) else x.view(_UINT[x.dtype.itemsize])
    return (wrap(xp, bits, dst) if is_small(dst) else bits.view(dst),)


OPS.append(OpKernel("BitCast", _bitcast_shapes, _bitcast_compute, since=26, small="raw", capture="safe"))


# ----------------------------------------------------------------------------- Quantize / Dequantize

_QRANGE = {  # integer quantized types: saturation range
    "uint8": (0, 255), "int8": (-128, 127), "uint16": (0, 65535), "int16": (-32768, 32767),
    "uint4": (0, 15), "int4": (-8, 7), "uint2": (0, 3), "int2": (-2, 1),
}
_QFLOAT = {"float8_e4m3fn", "float8_e4m3fnuz", "float8_e5m2", "float8_e5m2fnuz",
           "float4_e2m1fn", "float6_e2m3fn", "float6_e3m2fn"}
_FLOAT8 = {"float8_e4m3fn", "float8_e4m3fnuz", "float8_e5m2", "float8_e5m2fnuz"}


def _per_tensor(shape: tuple[int, ...]) -> bool:
    return math.prod(shape) == 1


def _check_param(node: NodeInfo, x: Spec, p: Spec, what: str, axis: int, block: int) -> None:
    """Per-tensor (one element), per-axis (1-D of x's axis length), or blocked."""
    if block < 0:
        raise node.error(f"block_size must be >= 0, got {block}")
    if not block:
        if p.rank != 1:
            raise node.error(f"{what} of shape {p.shape} must be a scalar or 1-D (or give block_size)")
        if p.shape[0] != x.shape[axis]:
            raise node.error(f"{what} has {p.shape[0]} elements, x has {x.shape[axis]} along axis {axis}")
        return
    want = tuple(math.ceil(d / block) if i == axis else d for i, d in enumerate(x.shape))
    if p.shape != want:
        raise node.error(f"blocked {what} of shape {p.shape} for x {x.shape}, axis {axis}, "
                         f"block_size {block}: expected {want}")


def _axis_block(node: NodeInfo, rank: int, scale_shape: tuple[int, ...]) -> tuple[int, int]:
    """(axis, block_size); the axis is only checked (and needed) when the scale is not per-tensor."""
    block = int(node.attr("block_size", 0)) if node.opset >= 21 else 0
    if _per_tensor(scale_shape):
        return 0, block
    return normalize_axis(node, int(node.attr("axis", 1)), rank), block


def _qparams(node: NodeInfo, x: Spec, scale: Spec, zp: Spec | None) -> tuple[int, int]:
    if node.opset < 21 and scale.rank > 1:
        raise node.error(f"scale of shape {scale.shape} must be a scalar or 1-D at opset {node.opset}")
    if zp is not None and zp.shape != scale.shape and not (_per_tensor(zp.shape) and _per_tensor(scale.shape)):
        raise node.error(f"zero point shape {zp.shape} differs from scale shape {scale.shape}")
    axis, block = _axis_block(node, x.rank, scale.shape)
    if not _per_tensor(scale.shape):
        if x.rank == 0:
            raise node.error(f"scale of shape {scale.shape} for a scalar x")
        _check_param(node, x, scale, "scale", axis, block)
    return axis, block


def _expand(xp, p: Any, shape: tuple[int, ...], axis: int, block: int) -> Any:
    """A scale or zero point reshaped/repeated to broadcast against x."""
    if _per_tensor(tuple(p.shape)):
        return p.reshape(())
    if not block:
        dims = [1] * len(shape)
        dims[axis] = p.shape[0]
        return p.reshape(tuple(dims))
    p = xp.repeat(p, block, axis=axis)
    return p[(slice(None),) * axis + (slice(0, shape[axis]),)]


def _quantize_shapes(node, specs):
    x, scale = specs[0], specs[1]
    zp = specs[2] if len(specs) > 2 else None
    out_attr = int(node.attr("output_dtype", 0)) if node.opset >= 21 else 0
    if zp is not None:
        dst = zp.dtype
        if out_attr and _onnx_dtype(node, out_attr, "output_dtype") != dst:
            raise node.error(f"output_dtype {_onnx_dtype(node, out_attr, 'output_dtype')} differs from "
                             f"the zero point's type {dst}")
    elif out_attr:
        dst = _onnx_dtype(node, out_attr, "output_dtype")
    else:
        dst = np.dtype(np.uint8)
    if dst.name not in _QRANGE and dst.name not in _QFLOAT:
        raise node.error(f"{dst} is not a quantized type")
    if x.dtype.kind != "f" and x.dtype.name != "bfloat16" and x.dtype != np.int32:
        raise node.error(f"x of type {x.dtype} cannot be quantized")
    _qparams(node, x, scale, zp)
    precision = int(node.attr("precision", 0)) if node.opset >= 23 else 0
    if precision:
        _onnx_dtype(node, precision, "precision")
    return [Spec(x.shape, dst)]


def _work_dtype(d: np.dtype) -> np.dtype:
    return np.dtype(np.float32) if is_small(d) else d


def _quantize_compute(xp, node, x, scale, zp=None):
    dst = node.out_specs[0].dtype
    axis, block = _axis_block(node, x.ndim, tuple(scale.shape))
    precision = int(node.attr("precision", 0)) if node.opset >= 23 else 0
    xf, sf = to_float(xp, x), to_float(xp, _expand(xp, scale, x.shape, axis, block))
    if precision:
        pd = _work_dtype(_onnx_dtype(node, precision, "precision"))
        xf, sf = xf.astype(pd), sf.astype(pd)
    v = xf / sf
    zf = None if zp is None else to_float(xp, _expand(xp, zp, x.shape, axis, block))
    if dst.name in _QRANGE:
        lo, hi = _QRANGE[dst.name]
        acc = xp.float64 if v.dtype == np.float64 else xp.float32
        q = xp.rint(v).astype(acc)
        if zf is not None:
            q = q + zf.astype(acc)
        q = xp.where(xp.isnan(q), acc(lo), xp.clip(q, acc(lo), acc(hi)))
        if is_small(dst):
            return (encode(xp, q, dst),)
        return (q.astype(dst),)
    if dst.name in _FLOAT8:  # the zero point of float8 is zero by definition (and ignored)
        return (encode(xp, v, dst, bool(node.attr("saturate", 1))),)
    if zf is not None:  # float4/float6: no NaN/inf, always saturating
        v = v.astype(xp.float32) + zf
    return (encode(xp, v, dst),)


def _dequantize_shapes(node, specs):
    x, scale = specs[0], specs[1]
    zp = specs[2] if len(specs) > 2 else None
    if zp is not None and zp.dtype != x.dtype:
        raise node.error(f"zero point type {zp.dtype} differs from x's type {x.dtype}")
    if zp is not None and x.dtype == np.int32:
        raise node.error("int32 input takes no zero point")
    _qparams(node, x, scale, zp)
    out_attr = int(node.attr("output_dtype", 0)) if node.opset >= 23 else 0
    dst = _onnx_dtype(node, out_attr, "output_dtype") if out_attr else scale.dtype
    return [Spec(x.shape, dst)]


def _dequantize_compute(xp, node, x, scale, zp=None):
    dst = node.out_specs[0].dtype
    axis, block = _axis_block(node, x.ndim, tuple(scale.shape))
    f = fmt_of(node.in_dtype(0, x))  # (x arrives decoded on a raw-bit device: kernels/_small.py)
    dx = to_float(xp, x).astype(xp.float32)
    # float quantized types have no zero point in effect (it is zero by definition)
    if zp is not None and not isinstance(f, FloatFmt) and f != E8M0:
        dx = dx - to_float(xp, _expand(xp, zp, x.shape, axis, block)).astype(xp.float32)
    sf = to_float(xp, _expand(xp, scale, x.shape, axis, block))
    y = dx * (sf if sf.dtype == np.float64 else sf.astype(xp.float32))
    return (encode(xp, y, dst) if is_small(dst) else y.astype(dst),)


OPS += [
    OpKernel("QuantizeLinear", _quantize_shapes, _quantize_compute, since=10, small="native", capture="safe"),
    OpKernel("DequantizeLinear", _dequantize_shapes, _dequantize_compute, since=10, small="native", capture="safe"),
]


# ----------------------------------------------------------------------------- DynamicQuantizeLinear

def _dql_shapes(node, specs):
    x = specs[0]
    if x.dtype != np.float32:
        raise node.error(f"x must be float32, got {x.dtype}")
    if 0 in x.shape:
        raise node.error("x is empty: its range (and so the scale) is undefined")
    return [Spec(x.shape, np.dtype(np.uint8)), Spec((), np.dtype(np.float32)), Spec((), np.dtype(np.uint8))]


def _dql_compute(xp, node, x):
    f32 = np.float32
    zero, qmax = f32(0), f32(255)
    hi = xp.maximum(zero, xp.max(x))
    lo = xp.minimum(zero, xp.min(x))
    scale = xp.where(hi == lo, f32(1), hi - lo) / qmax
    zp = xp.rint(xp.clip(zero - lo / scale, zero, qmax))
    y = xp.clip(xp.rint(x / scale) + zp, zero, qmax)
    return (y.astype(xp.uint8), scale.astype(xp.float32), zp.astype(xp.uint8))


OPS.append(OpKernel("DynamicQuantizeLinear", _dql_shapes, _dql_compute, since=11, capture="safe"))
