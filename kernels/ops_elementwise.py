"""Elementwise ops: arithmetic, math functions, comparisons, logic, bitwise, Where, the variadic
folds (Sum, Max, Min, Mean) and Clip.

Binary ops of opset < 7 use ONNX's legacy broadcasting (``broadcast=1`` attribute, B aligned to A
at ``axis`` or as a suffix); from opset 7 on, numpy-style multidirectional broadcasting. The ops
whose ONNX semantics differ from numpy's ufuncs (integer Div, Mod, Pow, BitShift, Erf) live in
``_elementwise_util``.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable

import numpy as np

from . import _elementwise_util as U
from ._fast import binary_into, where_into
from ._launch import same_buffer
from ._op import NodeInfo, OpKernel, Spec, broadcast

__all__ = ["OPS"]

OPS: list[OpKernel] = []

_BOOL = np.dtype(np.bool_)


# --- broadcasting of two inputs, legacy (opset < 7) or numpy-style


def _legacy_b_shape(node: NodeInfo, a_shape: tuple[int, ...], b_shape: tuple[int, ...]) -> tuple[int, ...] | None:
    """For opset < 7 with broadcast=1: B's shape padded with 1s so that it lines up with A at
    ``axis`` (default: B is a suffix of A). None when the node uses no legacy broadcast."""
    if node.opset >= 7 or not node.attr("broadcast", 0):
        if node.opset < 7 and tuple(a_shape) != tuple(b_shape):
            raise node.error(f"shapes {tuple(a_shape)} and {tuple(b_shape)} differ and broadcast is not set")
        return None
    ra, rb = len(a_shape), len(b_shape)
    if rb > ra:
        raise node.error(f"legacy broadcast: B of rank {rb} is longer than A of rank {ra}")
    axis = node.attr("axis", None)
    if axis is None:
        axis = ra - rb
    elif axis < 0:
        axis += ra
    if not 0 <= axis <= ra - rb:
        raise node.error(f"legacy broadcast: axis {node.attr('axis')} does not fit B {tuple(b_shape)} into A {tuple(a_shape)}")
    for i, d in enumerate(b_shape):
        if d != 1 and d != a_shape[axis + i]:
            raise node.error(f"legacy broadcast: B {tuple(b_shape)} does not match A {tuple(a_shape)} at axis {axis}")
    return (1,) * axis + tuple(b_shape) + (1,) * (ra - rb - axis)


def _binary(op_type: str, fn: Callable[..., Any], *, out_dtype: Any = None, same_dtype: bool = True,
            since: int = 1, until: int | None = None, kinds: str = "biuf") -> OpKernel:
    """A broadcasting binary op: ``fn(xp, node, a, b, dtype)``; output dtype = A's unless given.
    ``kinds``: the dtype kinds (numpy's, bfloat16 as "f") input A may have."""

    def shapes(node, specs):
        a, b = specs[0], specs[1]
        if a is None or b is None:
            raise node.error("both inputs are required")
        if U.kind(a.dtype) not in kinds:
            raise node.error(f"input dtype {a.dtype} is not supported")
        if same_dtype and a.dtype != b.dtype:
            raise node.error(f"input dtypes differ: {a.dtype} and {b.dtype}")
        legacy = _legacy_b_shape(node, a.shape, b.shape)
        shape = tuple(a.shape) if legacy is not None else broadcast(node, a.shape, b.shape)
        return [Spec(shape, np.dtype(out_dtype) if out_dtype is not None else a.dtype)]

    def compute(xp, node, a, b):
        legacy = _legacy_b_shape(node, tuple(a.shape), tuple(b.shape))
        if legacy is not None:
            b = b.reshape(legacy)
        return (fn(xp, node, a, b, node.out_specs[0].dtype),)

    name = getattr(fn, "ufunc", None)

    def into(xp, node, outs, a, b):
        """A plain ufunc over inputs of one dtype whose result dtype is the output's: one launch."""
        out = outs[0]  # (on CuPy bfloat16 lives as uint16 bits: never a ufunc's business here)
        if a.dtype != b.dtype or out.dtype not in (a.dtype, _BOOL) or out.dtype != node.out_specs[0].dtype:
            return False
        legacy = _legacy_b_shape(node, tuple(a.shape), tuple(b.shape))
        if legacy is not None:
            b = b.reshape(legacy)
        if not binary_into(xp, name, out, a, b):  # one RawKernel on CuPy where it can
            getattr(xp, name)(a, b, out=out)
        return True

    return OpKernel(op_type, shapes, compute, since=since, until=until, into=into if name else None, capture="safe")


def _unary(op_type: str, fn: Callable[[Any, Any], Any] | str, *, out_dtype: Any = None, since: int = 1,
           kinds: str | None = None) -> OpKernel:
    """An elementwise op of one input: ``fn(xp, x)``, cast to the output dtype (x's unless given).
    ``fn`` may be the name of an ``xp`` ufunc, which also gives the op an ``into`` (one launch).
    ``kinds``: the numpy dtype kinds the op accepts (e.g. "f" for float-only math)."""
    name = fn if isinstance(fn, str) else None
    if name is not None:
        fn = lambda xp, x: getattr(xp, name)(x)  # noqa: E731

    def shapes(node, specs):
        x = specs[0]
        if kinds is not None and U.kind(x.dtype) not in kinds:
            raise node.error(f"input dtype {x.dtype} is not supported")
        return [Spec(x.shape, np.dtype(out_dtype) if out_dtype is not None else x.dtype)]

    def compute(xp, node, x):
        return (fn(xp, x).astype(node.out_specs[0].dtype, copy=False),)

    def into(xp, node, outs, x):
        """The ufunc straight into the output when it keeps x's dtype (or gives bool): one launch."""
        out = outs[0]
        want = x.dtype if out_dtype is None else np.dtype(out_dtype)
        if out.dtype != want or out.dtype != node.out_specs[0].dtype:
            return False
        getattr(xp, name)(x, out=out)
        return True

    return OpKernel(op_type, shapes, compute, since=since, into=into if name else None, capture="safe")


def _ufunc(name: str) -> Callable[..., Any]:
    def fn(xp, node, a, b, dtype):
        return getattr(xp, name)(a, b).astype(dtype, copy=False)

    fn.ufunc = name  # _binary gives the op an ``into`` calling it with ``out=``
    return fn


# --- arithmetic


def _div(xp, node, a, b, dtype):
    if U.is_int(dtype):
        return U.int_div(xp, a, b, dtype)
    return xp.divide(a, b).astype(dtype, copy=False)


def _mod(xp, node, a, b, dtype):
    return U.mod(xp, a, b, bool(node.attr("fmod", 0)), dtype)


def _mod_shapes_check(node: NodeInfo) -> None:
    if node.attr("fmod", 0) not in (0, 1):
        raise node.error(f"fmod must be 0 or 1, got {node.attr('fmod')}")


def _pow(xp, node, a, b, dtype):
    return U.power(xp, a, b)


def _bitshift(xp, node, a, b, dtype):
    return U.bitshift(xp, a, b, node.attr("direction") == "LEFT")


def _with_check(k: OpKernel, check: Callable[[NodeInfo, list[Spec | None]], None]) -> OpKernel:
    inner = k.shapes

    def shapes(node, specs):
        check(node, specs)
        return inner(node, specs)

    return dataclasses.replace(k, shapes=shapes)


def _check_bitshift(node, specs):
    if node.attr("direction") not in ("LEFT", "RIGHT"):
        raise node.error(f"direction must be 'LEFT' or 'RIGHT', got {node.attr('direction')!r}")
    if not U.is_int(specs[0].dtype):
        raise node.error(f"BitShift needs integer inputs, got {specs[0].dtype}")


def _check_int(node, specs):
    if U.kind(specs[0].dtype) not in "iub":
        raise node.error(f"{node.op_type} needs integer inputs, got {specs[0].dtype}")


_NUM = "iuf"
OPS += [
    _binary("Add", _ufunc("add"), kinds=_NUM),
    _binary("Sub", _ufunc("subtract"), kinds=_NUM),
    _binary("Mul", _ufunc("multiply"), kinds=_NUM),
    _binary("Div", _div, kinds=_NUM),
    _binary("Pow", _pow, same_dtype=False, kinds=_NUM),
    _with_check(_binary("Mod", _mod, since=10, kinds=_NUM), lambda node, specs: _mod_shapes_check(node)),
    _with_check(_binary("BitShift", _bitshift, since=11), _check_bitshift),
    _with_check(_binary("BitwiseAnd", _ufunc("bitwise_and"), since=18), _check_int),
    _with_check(_binary("BitwiseOr", _ufunc("bitwise_or"), since=18), _check_int),
    _with_check(_binary("BitwiseXor", _ufunc("bitwise_xor"), since=18), _check_int),
]

# --- comparisons and logic (bool outputs)

OPS += [
    _binary("Equal", _ufunc("equal"), out_dtype=_BOOL, kinds="biufO"),  # O: strings, run on the host
    _binary("Less", _ufunc("less"), out_dtype=_BOOL),
    _binary("Greater", _ufunc("greater"), out_dtype=_BOOL),
    _binary("LessOrEqual", _ufunc("less_equal"), out_dtype=_BOOL, since=12),
    _binary("GreaterOrEqual", _ufunc("greater_equal"), out_dtype=_BOOL, since=12),
    _binary("And", _ufunc("logical_and"), out_dtype=_BOOL, kinds="b"),
    _binary("Or", _ufunc("logical_or"), out_dtype=_BOOL, kinds="b"),
    _binary("Xor", _ufunc("logical_xor"), out_dtype=_BOOL, kinds="b"),
    _unary("Not", "logical_not", out_dtype=_BOOL, kinds="b"),
    _unary("BitwiseNot", "invert", since=18, kinds="iu"),
]

# --- unary math


def _isinf(xp, node, x):
    pos = bool(node.attr("detect_positive", 1))
    neg = bool(node.attr("detect_negative", 1))
    inf = xp.isinf(x)
    if pos and neg:
        return inf
    if pos:
        return inf & (x > 0)
    if neg:
        return inf & (x < 0)
    return xp.zeros(x.shape, dtype=xp.bool_)


def _isinf_kernel() -> OpKernel:
    def shapes(node, specs):
        return [Spec(specs[0].shape, _BOOL)]

    def compute(xp, node, x):
        return (_isinf(xp, node, x),)

    return OpKernel("IsInf", shapes, compute, since=10, capture="safe")


_F = "f"  # float-only math functions
OPS += [
    _unary("Neg", "negative", kinds="fi"),
    _unary("Abs", "absolute", kinds="fiu"),
    _unary("Reciprocal", "reciprocal", kinds=_F),
    _unary("Sqrt", "sqrt", kinds=_F),
    _unary("Exp", "exp", kinds=_F),
    _unary("Log", "log", kinds=_F),
    _unary("Sin", "sin", since=7, kinds=_F),
    _unary("Cos", "cos", since=7, kinds=_F),
    _unary("Tan", "tan", since=7, kinds=_F),
    _unary("Asin", "arcsin", since=7, kinds=_F),
    _unary("Acos", "arccos", since=7, kinds=_F),
    _unary("Atan", "arctan", since=7, kinds=_F),
    _unary("Sinh", "sinh", since=9, kinds=_F),
    _unary("Cosh", "cosh", since=9, kinds=_F),
    _unary("Tanh", "tanh", kinds=_F),
    _unary("Asinh", "arcsinh", since=9, kinds=_F),
    _unary("Acosh", "arccosh", since=9, kinds=_F),
    _unary("Atanh", "arctanh", since=9, kinds=_F),
    _unary("Erf", U.erf, since=9, kinds="fiu"),
    _unary("Ceil", "ceil", kinds=_F),
    _unary("Floor", "floor", kinds=_F),
    _unary("Round", "rint", since=11, kinds=_F),  # rint: halves to even
    _unary("Sign", "sign", since=9, kinds="fiu"),
    _unary("IsNaN", "isnan", out_dtype=_BOOL, since=9, kinds=_F),
    _isinf_kernel(),
]

# --- Where


def _where_shapes(node, specs):
    c, x, y = specs[0], specs[1], specs[2]
    if c is None or x is None or y is None:
        raise node.error("Where needs condition, X and Y")
    if c.dtype != _BOOL:
        raise node.error(f"condition must be bool, got {c.dtype}")
    if x.dtype != y.dtype:
        raise node.error(f"X and Y dtypes differ: {x.dtype} and {y.dtype}")
    return [Spec(broadcast(node, c.shape, x.shape, y.shape), x.dtype)]


def _where_compute(xp, node, c, x, y):
    return (xp.where(c, x, y).astype(node.out_specs[0].dtype, copy=False),)


def _where_into(xp, node, outs, c, x, y):
    """``out = where(c, x, y)`` for X, Y of out's dtype: numpy's ``where`` into out (two copies,
    bits as ``where`` picks them); CuPy one ElementwiseKernel (``_fast.where_into``)."""
    out = outs[0]
    if x.dtype != out.dtype or y.dtype != out.dtype or out.dtype != node.out_specs[0].dtype:
        return False
    if xp.__name__ == "cupy":
        return where_into(xp, out, c, x, y)
    if same_buffer(xp, out, c, x, y):
        return False
    xp.copyto(out, xp.broadcast_to(y, out.shape))
    xp.copyto(out, x, where=c)
    return True


OPS.append(OpKernel("Where", _where_shapes, _where_compute, since=9, into=_where_into, capture="safe"))

# --- variadic folds


def _variadic(op_type: str, fold: Callable[[Any, Any, Any], Any], *, mean: bool = False) -> OpKernel:
    def shapes(node, specs):
        present = [s for s in specs if s is not None]
        if not present:
            raise node.error("needs at least one input")
        dt = present[0].dtype
        if any(s.dtype != dt for s in present):
            raise node.error(f"input dtypes differ: {sorted({str(s.dtype) for s in present})}")
        if node.opset < 8:  # no broadcasting before opset 8
            if any(tuple(s.shape) != tuple(present[0].shape) for s in present):
                raise node.error(f"input shapes differ: {[tuple(s.shape) for s in present]}")
        return [Spec(broadcast(node, *[s.shape for s in present]), dt)]

    def compute(xp, node, *xs):
        xs = [x for x in xs if x is not None]
        dt = node.out_specs[0].dtype
        acc = xs[0]
        for x in xs[1:]:
            acc = fold(xp, acc, x)
        if mean:
            acc = xp.divide(acc, len(xs))
        acc = xp.broadcast_to(acc.astype(dt, copy=False), node.out_specs[0].shape)
        return (acc,)

    return OpKernel(op_type, shapes, compute, capture="safe")


OPS += [
    _variadic("Sum", lambda xp, a, b: xp.add(a, b)),
    _variadic("Mean", lambda xp, a, b: xp.add(a, b), mean=True),
    _variadic("Max", lambda xp, a, b: xp.maximum(a, b)),
    _variadic("Min", lambda xp, a, b: xp.minimum(a, b)),
]

# --- Clip: min/max attributes (opset 1-10), optional min/max inputs (opset 11+)


def _clip_shapes(node, specs):
    x = specs[0]
    for i in (1, 2):
        s = specs[i] if i < len(specs) else None
        if s is not None:
            if s.dtype != x.dtype:
                raise node.error(f"input {i} dtype {s.dtype} differs from input dtype {x.dtype}")
            if int(np.prod(s.shape)) != 1 or len(s.shape) > 1:
                raise node.error(f"input {i} ({'min' if i == 1 else 'max'}) must be a scalar, got shape {tuple(s.shape)}")
    return [Spec(x.shape, x.dtype)]


def _clip_bounded(xp, x, lo, hi):
    if lo is not None:
        x = xp.maximum(x, lo)
    if hi is not None:
        x = xp.minimum(x, hi)
    return x


def _clip_compute_inputs(xp, node, x, lo=None, hi=None):
    dt = node.out_specs[0].dtype
    lo = None if lo is None else lo.reshape(()).astype(dt, copy=False)
    hi = None if hi is None else hi.reshape(()).astype(dt, copy=False)
    return (_clip_bounded(xp, x, lo, hi).astype(dt, copy=False),)


def _clip_compute_attrs(xp, node, x):
    dt = node.out_specs[0].dtype
    lo = node.attr("min")
    hi = node.attr("max")
    lo = None if lo is None else xp.full((), lo, dtype=dt)
    hi = None if hi is None else xp.full((), hi, dtype=dt)
    return (_clip_bounded(xp, x, lo, hi).astype(dt, copy=False),)


OPS += [
    OpKernel("Clip", lambda node, specs: [Spec(specs[0].shape, specs[0].dtype)], _clip_compute_attrs, since=1, until=10, capture="safe"),
    OpKernel("Clip", _clip_shapes, _clip_compute_inputs, since=11, capture="safe"),
]
