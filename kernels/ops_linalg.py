"""linalg ops: MatMul, Gemm, MatMulInteger, QLinearMatMul, Einsum, Det (an LU determinant), and (from ``_attention``)
Attention, RotaryEmbedding, TensorScatter; (from ``_recurrent``) LinearAttention,
CausalConvWithState.

Every matrix product goes through ``_linalg.matmul`` (no cuBLAS on CuPy, so all are capture-safe).
"""

from __future__ import annotations

import numpy as np

from ._attention import ATTENTION_OPS
from ._einsum import EINSUM_OPS
from ._linalg import matmul, matmul_into, matmul_shape
from ._op import OpKernel, Spec, broadcast, const_memo
from ._recurrent import RECURRENT_OPS


def _is_float(dt) -> bool:
    return np.issubdtype(np.dtype(dt), np.floating)


# -- MatMul -------------------------------------------------------------------------------------

def _product_shape(node, a, b):
    try:
        return matmul_shape(a.shape, b.shape)
    except ValueError as exc:
        raise node.error(str(exc)) from None


def _matmul_shapes(node, specs):
    return [Spec(_product_shape(node, specs[0], specs[1]), specs[0].dtype)]


def _product(xp, node, a, b, tag: str = "b"):
    """``matmul(xp, a, b)``; for float16 operands whose B is a constant (``const_memo``), the same
    product (fp32 operands, rounded once) with B upcast once per node, not at every run."""
    if a.dtype == np.float16 and b.dtype == np.float16 and 1 in node.consts and xp.__name__ == "numpy":
        b32 = const_memo(xp, node, (tag, "float32"), (1,), lambda: np.asanyarray(b).astype(np.float32))
        return np.matmul(np.asanyarray(a).astype(np.float32), b32).astype(np.float16)
    return matmul(xp, a, b)


def _matmul_compute(xp, node, a, b):
    return (_product(xp, node, a, b),)


def _matmul_into(xp, node, outs, a, b):
    """One product kernel straight into the output (``_linalg.matmul_into``) when no operand needs a
    cast, broadcast or contiguous copy (bfloat16 on CuPy is uint16 bits: never eligible)."""
    if outs[0].dtype != node.out_specs[0].dtype:
        return False
    return matmul_into(xp, outs[0], a, b)


# -- Gemm ---------------------------------------------------------------------------------------

def _gemm_dims(node, specs):
    a, b = specs[0], specs[1]
    if a.rank != 2 or b.rank != 2:
        raise node.error(f"A and B must be 2-D, got shapes {a.shape} and {b.shape}")
    ta, tb = int(node.attr("transA", 0)), int(node.attr("transB", 0))
    m, k = (a.shape[1], a.shape[0]) if ta else a.shape
    k2, n = (b.shape[1], b.shape[0]) if tb else b.shape
    if k != k2:
        raise node.error(f"inner dimensions differ: A {a.shape} (transA={ta}), B {b.shape} (transB={tb})")
    return m, n


def _gemm_shapes(node, specs):
    m, n = _gemm_dims(node, specs)
    c = specs[2] if len(specs) > 2 else None
    if c is not None:
        if node.opset < 7 and int(node.attr("broadcast", 0)) == 0:
            if tuple(c.shape) != (m, n):
                raise node.error(f"C has shape {c.shape}, (M, N) = {(m, n)} required without broadcast")
        elif broadcast(node, c.shape, (m, n)) != (m, n):
            raise node.error(f"C of shape {c.shape} does not broadcast to (M, N) = {(m, n)}")
    return [Spec((m, n), specs[0].dtype)]


def _scale(xp, x, s, dtype):
    """x * s keeping a float dtype (integers: float64, cast back by the caller)."""
    if s == 1.0:
        return x
    if _is_float(dtype):
        return x * np.dtype(dtype).type(s)  # a host scalar: no host-to-device copy
    return x.astype(xp.float64) * s


def _gemm_compute(xp, node, a, b, c=None):
    dtype = np.dtype(node.out_specs[0].dtype)
    if int(node.attr("transA", 0)):
        a = xp.transpose(a)
    if int(node.attr("transB", 0)):
        b = xp.transpose(b)
    alpha, beta = float(node.attr("alpha", 1.0)), float(node.attr("beta", 1.0))
    y = _scale(xp, _product(xp, node, a, b, f"b:transB={int(node.attr('transB', 0))}"), alpha, dtype)
    if c is not None and beta != 0.0:
        y = y + _scale(xp, c, beta, dtype)
    return (y.astype(dtype),)


# -- MatMulInteger / QLinearMatMul ------------------------------------------------------------------

def _minus_zero_point(xp, x, zp, per_row: bool):
    x = x.astype(xp.int32)
    if zp is None:
        return x
    zp = zp.astype(xp.int32)
    if zp.ndim == 1 and zp.shape[0] > 1 and per_row and x.ndim >= 2:
        zp = zp.reshape((zp.shape[0], 1))  # per-row zero point of A: one per row (M)
    return x - zp


def _check_quant_params(node, specs, a, b, which):
    """Scales and zero points: one value (per tensor), or 1-D with one per row of A (M) or per
    column of B (N). ``which``: (input index, name, "a" | "b" | "y")."""
    m = a.shape[-2] if a.rank >= 2 else 1
    n = b.shape[-1] if b.rank >= 2 else 1
    for i, name, side in which:
        sp = specs[i] if i < len(specs) else None
        if sp is None:
            continue
        size = int(np.prod(sp.shape, dtype=np.int64))
        want = {"a": m, "b": n, "y": 1}[side]
        if not (size == 1 and sp.rank <= 1) and not (sp.rank == 1 and size == want):
            raise node.error(f"{name} has shape {sp.shape}: one value, or 1-D of {want} expected")


def _matmulint_shapes(node, specs):
    _check_quant_params(node, specs, specs[0], specs[1], [(2, "a_zero_point", "a"), (3, "b_zero_point", "b")])
    return [Spec(_product_shape(node, specs[0], specs[1]), np.dtype(np.int32))]


def _matmulint_compute(xp, node, a, b, a_zp=None, b_zp=None):
    A = _minus_zero_point(xp, a, a_zp, True)
    B = _minus_zero_point(xp, b, b_zp, False)
    return (matmul(xp, A, B).astype(xp.int32),)


def _qlinear_shapes(node, specs):
    a, b, yzp = specs[0], specs[3], specs[7] if len(specs) > 7 else None
    shape = _product_shape(node, a, b)
    _check_quant_params(node, specs, a, b, [(1, "a_scale", "a"), (2, "a_zero_point", "a"), (4, "b_scale", "b"),
                                            (5, "b_zero_point", "b"), (6, "y_scale", "y"), (7, "y_zero_point", "y")])
    out = yzp.dtype if yzp is not None else a.dtype
    if np.dtype(out) not in (np.dtype(np.uint8), np.dtype(np.int8)):
        raise node.error(f"output type {np.dtype(out)} is not supported (int8/uint8 only)")
    return [Spec(shape, np.dtype(out))]


def _per_row(xp, s):
    return s.reshape((s.shape[0], 1)) if s.ndim == 1 and s.shape[0] > 1 else s


def _qlinear_compute(xp, node, a, a_scale, a_zp, b, b_scale, b_zp, y_scale, y_zp=None):
    out = np.dtype(node.out_specs[0].dtype)
    A = _minus_zero_point(xp, a, a_zp, True)
    B = _minus_zero_point(xp, b, b_zp, False)
    C = matmul(xp, A, B)
    if A.ndim >= 2:
        a_scale = _per_row(xp, a_scale)
    # the multiplier in the scales' own precision (as the reference), applied in float64
    mult = (a_scale * b_scale) / y_scale
    D = C.astype(xp.float64) * mult.astype(xp.float64)
    if y_zp is not None:
        D = D + y_zp.astype(xp.float64)
    info = np.iinfo(out)
    return (xp.clip(xp.rint(D), float(info.min), float(info.max)).astype(out),)


# -- Det (an LU determinant with partial pivoting) ------------------------------------------------


def det_lu(xp, x):
    """LU with partial pivoting, batched, a Python loop over the (static) matrix size."""
    n = x.shape[-1]
    batch = x.shape[:-2]
    a = x.astype(xp.float64).reshape((-1, n, n))
    B = a.shape[0]
    det = xp.ones((B,), dtype=xp.float64)
    rows = xp.arange(n, dtype=xp.int64)[None, :]
    for k in range(n):
        p = xp.argmax(xp.abs(a[:, k:, k]), axis=1).astype(xp.int64)[:, None] + k  # (B, 1)
        perm = xp.where(rows == k, p, xp.where(rows == p, k, rows))
        a = xp.take_along_axis(a, xp.broadcast_to(perm[:, :, None], (B, n, n)), axis=1)
        det = xp.where(p[:, 0] != k, -det, det)
        piv = a[:, k, k]
        det = det * piv
        if k + 1 < n:
            safe = xp.where(piv == 0, 1.0, piv)
            factor = a[:, k + 1:, k] / safe[:, None]
            a[:, k + 1:, :] = a[:, k + 1:, :] - factor[:, :, None] * a[:, k:k + 1, :]
    return det.reshape(batch).astype(x.dtype)


def _det_shapes(node, specs):
    x = specs[0]
    if x.rank < 2 or x.shape[-1] != x.shape[-2]:
        raise node.error(f"input must be (..., M, M), got shape {x.shape}")
    return [Spec(x.shape[:-2], x.dtype)]


def _det_compute(xp, node, x):
    return (det_lu(xp, x),)


OPS: list[OpKernel] = [
    OpKernel("Det", _det_shapes, _det_compute, since=11, capture="safe"),
    OpKernel("MatMul", _matmul_shapes, _matmul_compute, since=1, into=_matmul_into, capture="safe"),
    OpKernel("Gemm", _gemm_shapes, _gemm_compute, since=1, capture="safe"),
    OpKernel("MatMulInteger", _matmulint_shapes, _matmulint_compute, since=10, capture="safe"),
    OpKernel("QLinearMatMul", _qlinear_shapes, _qlinear_compute, since=10, capture="safe"),
    *EINSUM_OPS,
    *ATTENTION_OPS,
    *RECURRENT_OPS,
]
