"""Single-launch CuPy kernels for ``OpKernel.into`` (the eager fast path), and their numpy forms.

Each helper here writes one node's output(s) into preallocated arrays with ONE device launch on
CuPy (a RawKernel or ElementwiseKernel compiled once per element type and cached), and the same
values with numpy on the simulated device. Every helper checks the case it handles first and
returns False, having written nothing, for anything else (other dtypes, non-contiguous operands):
the caller then falls back to its op's ``compute``.

Guarantee: the bytes equal the op's ``compute`` bytes. Index helpers (gather, device flags) and
copies are exact by construction; ``sigmoid`` uses the very float32 operations of
``_nn_util.sigmoid`` (``expf``, one IEEE add and divide, no contractible multiply-add).

Nothing here synchronises or reads device values on the host: scalars passed to kernels are host
values (shapes, attributes, ``Spec.value``), so every launch is capture-safe.

Every launch goes through ``_launch`` (``launch``, ``launch_1d``, ``raw_kernel``), which records it for
the planned eager step's replay.
"""

from __future__ import annotations

import math
import numpy as np

from ._index_util import fix_index
from ._launch import _CACHE, ITEM_CTYPE, _contiguous, is_cupy, launch, launch_1d, raw_kernel, same_buffer, unrecordable
from ._op import dtype_name

__all__ = ["gather", "flag_range", "fill_value", "sigmoid_into", "where_into", "range_into", "binary_into",
           "permute_into", "strided_copy_into", "cast_into", "GATHER_SRC", "FLAG_SRC", "SIGMOID_SRC", "RANGE_SRC",
           "CAST_SRC", "FILL_SRC", "BINARY_SRC", "PERMUTE_SRC"]

_INDEX_CTYPE = {"int64": "long long", "int32": "int"}


# -- Gather along one axis: wrap negatives, clamp (as _index_util.fix_index), copy bits ------------

GATHER_SRC = r"""
extern "C" __global__ void lockstep_gather_{S}_{I}(
        const {T}* __restrict__ data, const {IT}* __restrict__ idx, {T}* __restrict__ out,
        long long dim, long long inner, long long n, long long total) {{
    for (long long e = (long long)blockIdx.x * blockDim.x + threadIdx.x; e < total;
         e += (long long)gridDim.x * blockDim.x) {{
        long long i = e % inner;
        long long r = e / inner;
        long long j = r % n;
        long long o = r / n;
        long long t = (long long)idx[j];
        if (t < 0) t += dim;
        if (t < 0) t = 0;
        if (t > dim - 1) t = dim - 1;
        out[e] = data[(o * dim + t) * inner + i];
    }}
}}
"""


def gather(xp, out, data, idx, axis: int) -> bool:
    """``out = take(data, fix_index(idx), axis)`` in one launch (C-contiguous data, idx and out)."""
    itemsize = data.dtype.itemsize
    if (out.dtype != data.dtype or dtype_name(idx.dtype) not in _INDEX_CTYPE or itemsize not in ITEM_CTYPE
            or not _contiguous(out, data, idx) or same_buffer(xp, out, data, idx)):
        return False
    dim = int(data.shape[axis])
    if not is_cupy(xp):
        xp.take(data, fix_index(xp, idx, dim), axis=axis, out=out)
        return True
    total = int(out.size)
    if total == 0:
        return True
    inner = math.prod(data.shape[axis + 1:])
    iname = dtype_name(idx.dtype)
    name = f"lockstep_gather_{itemsize}_{iname}"
    src = lambda: GATHER_SRC.format(S=itemsize, I=iname, T=ITEM_CTYPE[itemsize], IT=_INDEX_CTYPE[iname])  # noqa: E731
    launch_1d(raw_kernel(xp, src, name), total,
              (data, idx, out, np.int64(dim), np.int64(inner), np.int64(idx.size), np.int64(total)))
    return True


# -- Index checks into the error latch: one launch (kernels/_latch.py semantics) -------------------

FLAG_SRC = r"""
extern "C" __global__ void lockstep_flag_{I}(
        const {IT}* __restrict__ idx, long long n, long long stride, long long offset,
        long long lo, long long hi, int has_ignore, long long ignore, int* latch, int site) {{
    for (long long e = (long long)blockIdx.x * blockDim.x + threadIdx.x; e < n;
         e += (long long)gridDim.x * blockDim.x) {{
        long long v = (long long)idx[offset + e * stride];
        bool bad = (v < lo) || (v >= hi);
        if (has_ignore && v == ignore) bad = false;
        if (bad) {{
            if (atomicCAS(&latch[0], 0, 1) == 0) latch[1] = site;
            return;
        }}
    }}
}}
"""


def flag_range(xp, latch, idx, lo: int, hi: int, site: int, ignore: int | None, column: int | None = None) -> bool:
    """CuPy only: set ``latch = [1, site]`` (site only if ``latch[0]`` was 0) when any index (of
    column ``column`` of the last axis, when given) lies outside ``[lo, hi)`` and differs from
    ``ignore``; one launch. False (nothing launched) for other index dtypes or layouts."""
    if (not is_cupy(xp) or dtype_name(idx.dtype) not in _INDEX_CTYPE or latch.dtype != np.int32
            or not idx.flags.c_contiguous):
        return False
    if column is None:
        n, stride, offset = int(idx.size), 1, 0
    else:
        cols = int(idx.shape[-1])
        n, stride, offset = int(idx.size) // max(cols, 1), cols, int(column)
    if n == 0:
        return True
    iname = dtype_name(idx.dtype)
    name = f"lockstep_flag_{iname}"
    src = lambda: FLAG_SRC.format(I=iname, IT=_INDEX_CTYPE[iname])  # noqa: E731
    launch_1d(raw_kernel(xp, src, name), n,
              (idx, np.int64(n), np.int64(stride), np.int64(offset), np.int64(lo), np.int64(hi),
               np.int32(ignore is not None), np.int64(0 if ignore is None else ignore), latch, np.int32(site)))
    return True


# -- Host-known values (Spec.value: Shape, folded Range) written with one fill or one launch --------

_FILL_MAX = 8
FILL_SRC = r"""
extern "C" __global__ void lockstep_fill8_{S}({T}* out, long long n,
        {T} v0, {T} v1, {T} v2, {T} v3, {T} v4, {T} v5, {T} v6, {T} v7) {{
    long long e = (long long)threadIdx.x;
    if (e >= n) return;
    {T} v = v0;
    if (e == 1) v = v1;
    if (e == 2) v = v2;
    if (e == 3) v = v3;
    if (e == 4) v = v4;
    if (e == 5) v = v5;
    if (e == 6) v = v6;
    if (e == 7) v = v7;
    out[e] = v;
}}
"""


def fill_value(xp, out, value) -> bool:
    """Write the host array ``value`` (already ``out``'s shape and dtype) into ``out``: one fill if
    uniform, else (at most 8 elements of 4 or 8 bytes) one launch with the values as arguments;
    numpy assigns element by element, as ``_shape_util.device_const`` builds it."""
    if value is None:
        return False
    value = np.asarray(value)
    if value.dtype != out.dtype or tuple(value.shape) != tuple(out.shape) or not out.flags.c_contiguous:
        return False
    flat = value.reshape(-1)
    if flat.size == 0:
        return True
    itemsize = flat.dtype.itemsize
    small = flat.size <= _FILL_MAX and itemsize in (4, 8)
    if not (small and is_cupy(xp)):  # (on CuPy, small values take the launch below, uniform or not)
        if bool(np.all(flat == flat[0])):  # the test device_const makes
            unrecordable("ndarray.fill")
            out.fill(flat[0])
            return True
        if not small:
            return False
        view = out.reshape(-1)
        for i, v in enumerate(flat):
            view[i] = v
        return True
    bits = flat.view(np.dtype(f"u{itemsize}"))
    vals = [bits.dtype.type(b) for b in bits] + [bits.dtype.type(0)] * (_FILL_MAX - flat.size)
    name = f"lockstep_fill8_{itemsize}"
    kernel = raw_kernel(xp, lambda: FILL_SRC.format(S=itemsize, T=ITEM_CTYPE[itemsize]), name)
    launch(kernel, (1,), (32,), (out, np.int64(flat.size), *vals))
    return True


# -- Sigmoid: _nn_util.sigmoid's operations, fused -------------------------------------------------

_SIGMOID_BODY = {
    "float32": "float e = expf(-fabsf(x)); y = (x >= 0.0f) ? (1.0f / (1.0f + e)) : (e / (1.0f + e));",
    "float64": "double e = exp(-fabs(x)); y = (x >= 0.0) ? (1.0 / (1.0 + e)) : (e / (1.0 + e));",
}


SIGMOID_SRC = r"""
extern "C" __global__ void lockstep_sigmoid_raw_{dt}(const {T}* __restrict__ xs, {T}* __restrict__ ys, long long n) {{
    for (long long at = (long long)blockIdx.x * blockDim.x + threadIdx.x; at < n;
         at += (long long)gridDim.x * blockDim.x) {{
        {T} x = xs[at];
        {T} y;
        {BODY}
        ys[at] = y;
    }}
}}
"""


def sigmoid_into(xp, out, x) -> bool:
    """CuPy only: ``out = sigmoid(x)`` for float32/float64 x of out's dtype, one launch (a RawKernel
    for contiguous operands, else an ElementwiseKernel): the same IEEE operations as
    ``_nn_util.sigmoid`` (no multiply-add to contract), so the same bits."""
    dt = dtype_name(x.dtype)
    body = _SIGMOID_BODY.get(dt)
    if not is_cupy(xp) or body is None or out.dtype != x.dtype:
        return False
    if x.flags.c_contiguous and out.flags.c_contiguous and x.shape == out.shape:
        n = int(out.size)
        if n:
            k = raw_kernel(xp, lambda: SIGMOID_SRC.format(dt=dt, T=_VALUE_CTYPE[dt], BODY=body),
                           f"lockstep_sigmoid_raw_{dt}")
            launch_1d(k, n, (x, out, np.int64(n)))
        return True
    name = f"lockstep_sigmoid_{dt}"
    k = _CACHE.get(name)
    if k is None:
        k = _CACHE[name] = xp.ElementwiseKernel("T x", "T y", body, name)
    unrecordable("ElementwiseKernel " + name)
    k(x, out)
    return True


def where_into(xp, out, c, x, y) -> bool:
    """CuPy only: ``out = c ? x : y`` (broadcasting; bool c, x and y of out's dtype), one
    ElementwiseKernel: a select copies the chosen element as ``where`` does."""
    if not is_cupy(xp) or c.dtype != np.bool_ or x.dtype != out.dtype or y.dtype != out.dtype:
        return False
    k = _CACHE.get("lockstep_where")
    if k is None:
        k = _CACHE["lockstep_where"] = xp.ElementwiseKernel("bool c, T x, T y", "T z", "z = c ? x : y",
                                                            "lockstep_where")
    unrecordable("ElementwiseKernel lockstep_where")
    k(c, x, y, out)
    return True


RANGE_SRC = r"""
extern "C" __global__ void lockstep_range_{dt}({T}* __restrict__ y, long long start, long long delta, long long n) {{
    for (long long e = (long long)blockIdx.x * blockDim.x + threadIdx.x; e < n;
         e += (long long)gridDim.x * blockDim.x) {{
        y[e] = ({T})(long long)((unsigned long long)start + (unsigned long long)e * (unsigned long long)delta);
    }}
}}
"""


def range_into(xp, out, start: int, delta: int) -> bool:
    """``out[i] = start + i * delta`` for a 1-D int32/int64 ``out`` (host ints start and delta),
    wrapping as int64 arithmetic does and truncated to out's type as ``astype`` truncates."""
    dt = dtype_name(out.dtype)
    if dt not in ("int32", "int64") or out.ndim != 1:
        return False
    if not is_cupy(xp):
        xp.copyto(out, xp.arange(out.shape[0], dtype=xp.int64) * np.int64(delta) + np.int64(start), casting="unsafe")
        return True
    n = int(out.shape[0])
    if n:
        k = raw_kernel(xp, lambda: RANGE_SRC.format(dt=dt, T=_VALUE_CTYPE[dt]), f"lockstep_range_{dt}")
        launch_1d(k, n, (out, np.int64(start), np.int64(delta), np.int64(n)))
    return True


# -- Strided elementwise launches: one RawKernel instead of a CuPy ufunc or copyto -----------------
# (a RawKernel call costs the host ~7 us on the H200's Xeon, a ufunc ~14: scripts/host_costs.py).
# Shapes of up to _ND dims, passed as arguments: the output's dims and, per operand, its element
# strides in the output's index space (0 where it broadcasts). Every element is one IEEE operation
# of the operands' type (no contraction across operations), so the bits are the ufunc's.

_ND = 6
_BINARY_OPS = {"add": "x + y", "subtract": "x - y", "multiply": "x * y", "divide": "x / y",
               "equal": "x == y", "less": "x < y", "less_equal": "x <= y", "greater": "x > y",
               "greater_equal": "x >= y"}
_COMPARE = {"equal", "less", "less_equal", "greater", "greater_equal"}
_VALUE_CTYPE = {"float32": "float", "float64": "double", "int32": "int", "int64": "long long"}

BINARY_SRC = r"""
extern "C" __global__ void lockstep_binary_{op}_{dt}(
        const {T}* __restrict__ A, const {T}* __restrict__ B, {OT}* __restrict__ C, long long n,
        long long d0, long long d1, long long d2, long long d3, long long d4, long long d5,
        long long a0, long long a1, long long a2, long long a3, long long a4, long long a5,
        long long b0, long long b1, long long b2, long long b3, long long b4, long long b5) {{
    for (long long e = (long long)blockIdx.x * blockDim.x + threadIdx.x; e < n;
         e += (long long)gridDim.x * blockDim.x) {{
        long long r = e, ia = 0, ib = 0, k;
        k = r % d5; r /= d5; ia += k * a5; ib += k * b5;
        k = r % d4; r /= d4; ia += k * a4; ib += k * b4;
        k = r % d3; r /= d3; ia += k * a3; ib += k * b3;
        k = r % d2; r /= d2; ia += k * a2; ib += k * b2;
        k = r % d1; r /= d1; ia += k * a1; ib += k * b1;
        ia += r * a0; ib += r * b0;
        const {T} x = A[ia];
        const {T} y = B[ib];
        C[e] = ({OT})({EXPR});
    }}
}}
"""

PERMUTE_SRC = r"""
extern "C" __global__ void lockstep_permute_{S}(
        const {T}* __restrict__ X, {T}* __restrict__ Y, long long n,
        long long d0, long long d1, long long d2, long long d3, long long d4, long long d5,
        long long s0, long long s1, long long s2, long long s3, long long s4, long long s5) {{
    for (long long e = (long long)blockIdx.x * blockDim.x + threadIdx.x; e < n;
         e += (long long)gridDim.x * blockDim.x) {{
        long long r = e, ix = 0, k;
        k = r % d5; r /= d5; ix += k * s5;
        k = r % d4; r /= d4; ix += k * s4;
        k = r % d3; r /= d3; ix += k * s3;
        k = r % d2; r /= d2; ix += k * s2;
        k = r % d1; r /= d1; ix += k * s1;
        ix += r * s0;
        Y[e] = X[ix];
    }}
}}
"""


def _pad(dims: tuple[int, ...], fill: int) -> tuple[int, ...]:
    return (fill,) * (_ND - len(dims)) + tuple(dims)


def _contiguous_strides(shape: tuple[int, ...]) -> tuple[int, ...]:
    out, acc = [], 1
    for d in reversed(shape):
        out.append(acc)
        acc *= d
    return tuple(reversed(out))


def _broadcast_strides(shape: tuple[int, ...], out_shape: tuple[int, ...]) -> tuple[int, ...] | None:
    """Element strides of a C-contiguous operand of ``shape`` indexed by ``out_shape`` (numpy's
    right-aligned broadcasting), or None when it does not broadcast to it."""
    if len(shape) > len(out_shape):
        return None
    shape = (1,) * (len(out_shape) - len(shape)) + tuple(shape)
    strides = _contiguous_strides(shape)
    out = []
    for d, o, s in zip(shape, out_shape, strides):
        if d == o:
            out.append(s if d != 1 else 0)
        elif d == 1:
            out.append(0)
        else:
            return None
    return tuple(out)


def binary_into(xp, ufunc: str, out, a, b) -> bool:
    """``out = ufunc(a, b)`` for a, b of one dtype (float32/64, int32/64) broadcasting to ``out``
    (of their dtype, or bool for a comparison), up to 6 dims, C-contiguous: one RawKernel on
    CuPy. False, having written nothing, otherwise (integer division: ONNX truncates)."""
    expr = _BINARY_OPS.get(ufunc)
    dt = dtype_name(a.dtype)
    if (not is_cupy(xp) or expr is None or dt not in _VALUE_CTYPE or b.dtype != a.dtype or out.ndim > _ND
            or (ufunc == "divide" and dt not in ("float32", "float64"))):
        return False
    odt = dtype_name(out.dtype)
    if odt != ("bool" if ufunc in _COMPARE else dt):
        return False
    if not (a.flags.c_contiguous and b.flags.c_contiguous and out.flags.c_contiguous):
        return False
    shape = tuple(out.shape)
    sa, sb = _broadcast_strides(tuple(a.shape), shape), _broadcast_strides(tuple(b.shape), shape)
    if sa is None or sb is None:
        return False
    n = math.prod(shape)
    if n == 0:
        return True
    name = f"lockstep_binary_{ufunc}_{dt}"
    ot = "unsigned char" if odt == "bool" else _VALUE_CTYPE[dt]
    k = raw_kernel(xp, lambda: BINARY_SRC.format(op=ufunc, dt=dt, T=_VALUE_CTYPE[dt], OT=ot, EXPR=expr), name)
    i64 = np.int64
    launch_1d(k, n, (a, b, out, i64(n), *map(i64, _pad(shape, 1)), *map(i64, _pad(sa, 0)), *map(i64, _pad(sb, 0))))
    return True


def permute_into(xp, out, x, perm: tuple[int, ...]) -> bool:
    """``out = x.transpose(perm)`` (C-contiguous, up to 6 dims, 1/2/4/8-byte elements): one
    RawKernel moving bits on CuPy. False, having written nothing, otherwise."""
    itemsize = x.dtype.itemsize
    if (not is_cupy(xp) or x.ndim > _ND or itemsize not in ITEM_CTYPE or out.dtype != x.dtype
            or not (x.flags.c_contiguous and out.flags.c_contiguous)):
        return False
    src = _contiguous_strides(tuple(x.shape))
    strides = tuple(src[p] for p in perm)  # out index i along axis j reads x along axis perm[j]
    shape = tuple(out.shape)
    n = math.prod(shape)
    if n == 0:
        return True
    k = raw_kernel(xp, lambda: PERMUTE_SRC.format(S=itemsize, T=ITEM_CTYPE[itemsize]), f"lockstep_permute_{itemsize}")
    i64 = np.int64
    launch_1d(k, n, (x, out, i64(n), *map(i64, _pad(shape, 1)), *map(i64, _pad(strides, 0))))
    return True


def strided_copy_into(xp, out, view) -> bool:
    """``out[...] = view`` for a C-contiguous ``out`` and a view of its shape and dtype with any
    element strides (a Slice's view, negative steps too; a reshaped contiguous array): the permute
    RawKernel with the view's own strides, moving bits, on CuPy. False, having written nothing,
    otherwise (numpy, more than 6 dims, other element sizes, strides not whole elements)."""
    itemsize = out.dtype.itemsize
    if (not is_cupy(xp) or view.dtype != out.dtype or tuple(view.shape) != tuple(out.shape) or out.ndim > _ND
            or itemsize not in ITEM_CTYPE or not out.flags.c_contiguous or any(s % itemsize for s in view.strides)):
        return False
    n = int(out.size)
    if n == 0:
        return True
    if same_buffer(xp, out, view):
        return False
    k = raw_kernel(xp, lambda: PERMUTE_SRC.format(S=itemsize, T=ITEM_CTYPE[itemsize]), f"lockstep_permute_{itemsize}")
    i64 = np.int64
    strides = tuple(s // itemsize for s in view.strides)
    launch_1d(k, n, (view, out, i64(n), *map(i64, _pad(tuple(out.shape), 1)), *map(i64, _pad(strides, 0))))
    return True


CAST_SRC = r"""
extern "C" __global__ void lockstep_cast_{src}_{dst}(const {S}* __restrict__ X, {D}* __restrict__ Y, long long n) {{
    for (long long at = (long long)blockIdx.x * blockDim.x + threadIdx.x; at < n;
         at += (long long)gridDim.x * blockDim.x) {{
        Y[at] = ({D})X[at];
    }}
}}
"""
_CAST_FROM = {**_VALUE_CTYPE, "bool": "bool"}


def cast_into(xp, out, x) -> bool:
    """``out[...] = x.astype(out.dtype)`` for C-contiguous operands of one shape, from float32/64,
    int32/64 or bool to float32/64 or int32/64: one RawKernel doing C's conversion (the conversion
    CuPy's own casting copy compiles to), on CuPy. False, having written nothing, otherwise."""
    src, dst = dtype_name(x.dtype), dtype_name(out.dtype)
    if (not is_cupy(xp) or src not in _CAST_FROM or dst not in _VALUE_CTYPE or tuple(x.shape) != tuple(out.shape)
            or not (x.flags.c_contiguous and out.flags.c_contiguous) or same_buffer(xp, out, x)):
        return False
    n = int(out.size)
    if n:
        k = raw_kernel(xp, lambda: CAST_SRC.format(src=src, dst=dst, S=_CAST_FROM[src], D=_VALUE_CTYPE[dst]),
                       f"lockstep_cast_{src}_{dst}")
        launch_1d(k, n, (x, out, np.int64(n)))
    return True
