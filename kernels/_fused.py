"""Fused single-launch kernels for the decode step's heavy ops: RMSNormalization, RotaryEmbedding,
TensorScatter and Attention (``OpKernel.into`` of ``ops_nn`` and ``_attention``).

Each ``*_into(xp, out..., inputs...)`` handles the common case only (float32, C-contiguous
operands, the attributes the golden models use) and returns False, having written nothing, for
anything else, so the op's ``compute`` stays the reference. On CuPy it is one RawKernel launch
(Attention with present_key/present_value outputs: two). On numpy:

- ``rope_into`` and ``tensor_scatter_into`` run the (full) kernel's index arithmetic vectorised,
  with the very float32 operations of ``compute``: the same bytes (checked against ``compute`` over
  ONNX's node cases, tests/test_kernel_into.py);
- ``rms_norm_into`` and ``attention_into`` return False: their kernels sum in another order than
  CuPy's reductions (below), so numpy keeps ``compute``; tests/test_kernel_into.py checks a numpy
  transliteration of each kernel against ``compute`` within the node suite's tolerances.

Rounding versus the CuPy composition in ``compute``: products and sums are written with
``__fmul_rn``/``__fadd_rn`` (no multiply-add contraction) where ``compute`` rounds each ufunc's
result, so RotaryEmbedding and TensorScatter give the same bits. The dot products of Attention use
``acc += a * b`` with k ascending from 0, as ``_linalg``'s matmul kernel does (so the same bits for
Q K^T and P V). Two reductions differ in order only: RMSNormalization's sum of squares and
Attention's softmax denominator are summed per thread (strided) and then in a fixed tree, where
CuPy's reduction kernel uses its own order: last-bit differences in float32, deterministic.
"""

from __future__ import annotations

import math

import numpy as np

from ._launch import ITEM_CTYPE, is_cupy, launch, launch_1d, raw_kernel, same_buffer
from ._op import dtype_name

__all__ = ["rms_norm_into", "rope_into", "rope_pair_into", "tensor_scatter_pair_into", "tensor_scatter_into", "attention_into", "silu_mul_into", "add_rms_norm_into",
           "RMS_NORM_SRC", "ROPE_SRC", "TS_FULL_SRC", "TS_UPDATE_SRC", "KV_CONCAT_SRC", "ATTENTION_SRC",
           "SILU_MUL_SRC", "ADD_RMS_NORM_SRC"]

_F32 = np.dtype(np.float32)
_I64 = np.dtype(np.int64)
_INDEX_CTYPE = {"int64": "long long", "int32": "int"}


def _address(xp, a) -> int:
    return a.data.ptr if is_cupy(xp) else a.__array_interface__["data"][0]


def _f32(*arrays) -> bool:
    return all(a.dtype == _F32 and a.flags.c_contiguous for a in arrays)


# -- RMSNormalization: one block (256 threads) per row ---------------------------------------------

# The block's sum of squares (``acc`` per thread, a fixed tree over ``part``) and the row's inverse
# root: shared text of ``RMS_NORM_SRC`` and ``ADD_RMS_NORM_SRC`` (the same roundings in both).
_RMS_INV = r"""        part[tid] = acc;
        __syncthreads();
        for (int k = blockDim.x / 2; k > 0; k >>= 1) {
            if (tid < k) part[tid] = __fadd_rn(part[tid], part[tid + k]);
            __syncthreads();
        }
        const float ms = __fdiv_rn(part[0], (float)cols);
        const float inv = __fdiv_rn(1.0f, __fsqrt_rn(__fadd_rn(ms, eps)));
"""

RMS_NORM_SRC = r"""
extern "C" __global__ void lockstep_rms_norm_f32(
        const float* __restrict__ x, const float* __restrict__ scale, float* __restrict__ y,
        long long rows, long long cols, float eps) {
    __shared__ float part[256];
    const int tid = threadIdx.x;
    for (long long r = blockIdx.x; r < rows; r += gridDim.x) {
        const float* xr = x + r * cols;
        float acc = 0.0f;
        for (long long c = tid; c < cols; c += blockDim.x) {
            acc = __fadd_rn(acc, __fmul_rn(xr[c], xr[c]));
        }
""" + _RMS_INV + r"""        for (long long c = tid; c < cols; c += blockDim.x) {
            y[r * cols + c] = __fmul_rn(__fmul_rn(xr[c], inv), scale[c]);
        }
        __syncthreads();
    }
}
"""


def _norm_rows(shape, scale_shape, axis: int) -> tuple[int, int]:
    """(rows, cols) of a normalisation over the axes >= ``axis`` with a scale that varies along them
    only (its shape, leading 1s aside, is ``shape[axis:]``); (0, 0) when the kernels do not apply."""
    tail = tuple(shape[axis:])
    lead = len(scale_shape) - len(tail)
    if lead < 0 or tuple(scale_shape[lead:]) != tail or any(d != 1 for d in scale_shape[:lead]):
        return 0, 0
    cols = math.prod(tail)
    rows = math.prod(shape) // cols if cols else 0
    return (rows, cols) if rows and cols else (0, 0)


def rms_norm_into(xp, out, x, scale, axis: int, eps: float) -> bool:
    """CuPy only: ``out = x / sqrt(mean(x*x over axes >= axis) + eps) * scale`` for float32 x, out,
    scale, where scale varies along the normalised axes only (its shape, leading 1s aside, is
    ``x.shape[axis:]``): one block per row, float32 accumulation."""
    if not is_cupy(xp) or not _f32(out, x, scale) or same_buffer(xp, out, x, scale):
        return False
    rows, cols = _norm_rows(x.shape, scale.shape, axis)
    if rows == 0:
        return False
    k = raw_kernel(xp, RMS_NORM_SRC, "lockstep_rms_norm_f32")
    launch(k, (min(rows, 65535),), (256,), (x, scale, out, np.int64(rows), np.int64(cols), np.float32(eps)))
    return True


# -- RotaryEmbedding: one thread per output element ------------------------------------------------

# One output element of RotaryEmbedding: shared by the one-node kernel and the pair kernel (a decode
# step's q and k rotations in one launch), so each element has the same arithmetic in both.
_ROPE_ELEM = r"""
__device__ __forceinline__ void lockstep_rope_elem(
        const float* __restrict__ x, const float* __restrict__ cosc, const float* __restrict__ sinc,
        const long long* __restrict__ pos, float* __restrict__ y,
        long long H, long long S, long long D, long long rd, long long rows,
        int heads_first, int interleaved, int has_pos, long long e) {
    const long long half = rd / 2;
    const long long d = e % D;
    if (d >= rd) {
        y[e] = x[e];
        return;
    }
    long long r = e / D;
    long long b;
    long long s;
    if (heads_first) {
        s = r % S;
        b = r / (S * H);
    } else {
        s = (r / H) % S;
        b = r / (H * S);
    }
    long long i;
    long long i1;
    long long i2;
    int first;
    if (interleaved) {
        i = d / 2;
        i1 = 2 * i;
        i2 = 2 * i + 1;
        first = (d % 2) == 0;
    } else if (d < half) {
        i = d;
        i1 = d;
        i2 = d + half;
        first = 1;
    } else {
        i = d - half;
        i1 = i;
        i2 = d;
        first = 0;
    }
    long long crow = b * S + s;
    if (has_pos) {
        crow = pos[b * S + s];
        if (crow < 0) crow = 0;
        if (crow > rows - 1) crow = rows - 1;
    }
    const float c = cosc[crow * half + i];
    const float sn = sinc[crow * half + i];
    const long long base = e - d;
    const float x1 = x[base + i1];
    const float x2 = x[base + i2];
    if (first) {
        y[e] = __fsub_rn(__fmul_rn(c, x1), __fmul_rn(sn, x2));
    } else {
        y[e] = __fadd_rn(__fmul_rn(sn, x1), __fmul_rn(c, x2));
    }
}
"""

ROPE_SRC = _ROPE_ELEM + r"""
extern "C" __global__ void lockstep_rope_f32(
        const float* __restrict__ x, const float* __restrict__ cosc, const float* __restrict__ sinc,
        const long long* __restrict__ pos, float* __restrict__ y,
        long long H, long long S, long long D, long long rd, long long rows,
        int heads_first, int interleaved, int has_pos, long long total) {
    for (long long e = (long long)blockIdx.x * blockDim.x + threadIdx.x; e < total;
         e += (long long)gridDim.x * blockDim.x) {
        lockstep_rope_elem(x, cosc, sinc, pos, y, H, S, D, rd, rows, heads_first, interleaved, has_pos, e);
    }
}
"""

ROPE_PAIR_SRC = _ROPE_ELEM + r"""
extern "C" __global__ void lockstep_rope_pair_f32(
        const float* __restrict__ x0, float* __restrict__ y0, long long H0, long long total0,
        const float* __restrict__ x1, float* __restrict__ y1, long long H1, long long total1,
        const float* __restrict__ cosc, const float* __restrict__ sinc, const long long* __restrict__ pos,
        long long S, long long D, long long rd, long long rows, int heads_first, int interleaved, int has_pos) {
    const long long total = total0 + total1;
    for (long long e = (long long)blockIdx.x * blockDim.x + threadIdx.x; e < total;
         e += (long long)gridDim.x * blockDim.x) {
        if (e < total0) {
            lockstep_rope_elem(x0, cosc, sinc, pos, y0, H0, S, D, rd, rows, heads_first, interleaved, has_pos, e);
        } else {
            lockstep_rope_elem(x1, cosc, sinc, pos, y1, H1, S, D, rd, rows, heads_first, interleaved, has_pos,
                               e - total0);
        }
    }
}
"""


def _rope_numpy(out, x, cos, sin, pos, H, S, D, rd, heads_first, interleaved):
    """The kernel's index arithmetic, vectorised over every element."""
    e = np.arange(x.size, dtype=np.int64)
    d, r = e % D, e // D
    s = r % S if heads_first else (r // H) % S
    b = r // (S * H)
    half = rd // 2
    if interleaved:
        i, i1, i2, first = d // 2, (d // 2) * 2, (d // 2) * 2 + 1, d % 2 == 0
    else:
        first = d < half
        i = np.where(first, d, d - half)
        i1, i2 = i, i + half
    crow = b * S + s if pos is None else np.clip(pos.reshape(-1)[b * S + s], 0, cos.shape[0] - 1)
    rot = d < rd
    i, i1, i2 = (np.where(rot, v, 0) for v in (i, i1, i2))
    flat, cf, sf = x.reshape(-1), cos.reshape(-1), sin.reshape(-1)
    c, sn = cf[crow * half + i], sf[crow * half + i]
    x1, x2 = flat[e - d + i1], flat[e - d + i2]
    y = np.where(first, c * x1 - sn * x2, sn * x1 + c * x2)
    out.reshape(-1)[...] = np.where(rot, y, flat)


def _rope_geometry(xp, out, x, cos, sin, pos, num_heads: int):
    """(H, S, D, heads_first) of a RotaryEmbedding the kernels take (float32, caches of one shape,
    int64 C-contiguous position_ids or none, nothing shared), else None."""
    if not _f32(out, x, cos, sin) or same_buffer(xp, out, x, cos, sin, pos) or tuple(sin.shape) != tuple(cos.shape):
        return None
    if pos is not None and (pos.dtype != _I64 or not pos.flags.c_contiguous):
        return None
    heads_first = x.ndim == 4
    if heads_first:
        _, H, S, D = (int(d) for d in x.shape)
    else:
        H = int(num_heads)
        S, D = int(x.shape[1]), int(x.shape[2]) // H
    return H, S, D, heads_first


def rope_into(xp, out, x, cos, sin, pos, num_heads: int, rd: int, interleaved: bool) -> bool:
    """``out = RotaryEmbedding(x, cos, sin, pos)`` for float32 x (4-D (B, H, S, D), or 3-D
    (B, S, H*D) with ``num_heads``), float32 caches (2-D with int64 position_ids, clamped to the
    cache rows as compute clamps them; (B, S, rd/2) without), one launch."""
    geom = _rope_geometry(xp, out, x, cos, sin, pos, num_heads)
    if geom is None:
        return False
    H, S, D, heads_first = geom
    if x.size == 0:
        return True
    if not is_cupy(xp):
        _rope_numpy(out, x, cos, sin, pos, H, S, D, rd, heads_first, interleaved)
        return True
    k = raw_kernel(xp, ROPE_SRC, "lockstep_rope_f32")
    launch_1d(k, x.size, (x, cos, sin, pos if pos is not None else cos, out, np.int64(H), np.int64(S),
                          np.int64(D), np.int64(rd), np.int64(cos.shape[0]), np.int32(heads_first),
                          np.int32(interleaved), np.int32(pos is not None), np.int64(x.size)))
    return True


def rope_pair_into(xp, out0, x0, heads0: int, out1, x1, heads1: int, cos, sin, pos, rd: int, interleaved: bool) -> bool:
    """CuPy only: ``rope_into`` of two inputs (a decode step's q and k) at one cos/sin cache and
    position_ids, in one launch with each element's ``rope_into`` arithmetic: both of one rank,
    sequence length and head size (their head counts may differ). False, having written nothing,
    otherwise."""
    if (not is_cupy(xp) or x0.size == 0 or x1.size == 0 or x0.ndim != x1.ndim or same_buffer(xp, out0, out1, x1)
            or same_buffer(xp, out1, x0)):
        return False
    g0 = _rope_geometry(xp, out0, x0, cos, sin, pos, heads0)
    g1 = _rope_geometry(xp, out1, x1, cos, sin, pos, heads1)
    if g0 is None or g1 is None or g0[1:] != g1[1:]:
        return False
    (H0, S, D, heads_first), H1 = g0, g1[0]
    k = raw_kernel(xp, ROPE_PAIR_SRC, "lockstep_rope_pair_f32")
    launch_1d(k, x0.size + x1.size,
              (x0, out0, np.int64(H0), np.int64(x0.size), x1, out1, np.int64(H1), np.int64(x1.size),
               cos, sin, pos if pos is not None else cos, np.int64(S), np.int64(D), np.int64(rd),
               np.int64(cos.shape[0]), np.int32(heads_first), np.int32(interleaved), np.int32(pos is not None)))
    return True


# -- TensorScatter: (B, P, L, Q) cache, (B, P, S, Q) update at write_indices along L ---------------

TS_FULL_SRC = r"""
extern "C" __global__ void lockstep_ts_full_{S}_{I}(
        const {T}* __restrict__ past, const {T}* __restrict__ upd, const {IT}* __restrict__ wi,
        {T}* __restrict__ out, long long P, long long L, long long Q, long long Sn,
        int has_wi, int circular, long long total) {{
    for (long long e = (long long)blockIdx.x * blockDim.x + threadIdx.x; e < total;
         e += (long long)gridDim.x * blockDim.x) {{
        const long long q = e % Q;
        long long r = e / Q;
        const long long t = r % L;
        r = r / L;
        const long long p = r % P;
        const long long b = r / P;
        long long src = t - (has_wi ? (long long)wi[b] : 0LL);
        if (circular) src = ((src % L) + L) % L;
        if (src >= 0 && src < Sn) {{
            out[e] = upd[((b * P + p) * Sn + src) * Q + q];
        }} else {{
            out[e] = past[e];
        }}
    }}
}}
"""

# One update element of TensorScatter written into a cache bound in place: shared by the one-node
# kernel and the pair kernel (a decode step's key and value caches in one launch).
_TS_UPDATE_ELEM = r"""
__device__ __forceinline__ void lockstep_ts_update_elem_{S}_{I}(
        const {T}* __restrict__ upd, const {IT}* __restrict__ wi, {T}* out,
        long long P, long long L, long long Q, long long Sn, int has_wi, int circular, long long e) {{
    const long long q = e % Q;
    long long r = e / Q;
    const long long s = r % Sn;
    r = r / Sn;
    const long long p = r % P;
    const long long b = r / P;
    long long dst = s + (has_wi ? (long long)wi[b] : 0LL);
    if (circular) dst = ((dst % L) + L) % L;
    if (dst >= 0 && dst < L) {{
        out[((b * P + p) * L + dst) * Q + q] = upd[e];
    }}
}}
"""

TS_UPDATE_SRC = _TS_UPDATE_ELEM + r"""
extern "C" __global__ void lockstep_ts_update_{S}_{I}(
        const {T}* __restrict__ upd, const {IT}* __restrict__ wi, {T}* out,
        long long P, long long L, long long Q, long long Sn, int has_wi, int circular, long long total) {{
    for (long long e = (long long)blockIdx.x * blockDim.x + threadIdx.x; e < total;
         e += (long long)gridDim.x * blockDim.x) {{
        lockstep_ts_update_elem_{S}_{I}(upd, wi, out, P, L, Q, Sn, has_wi, circular, e);
    }}
}}
"""

TS_UPDATE_PAIR_SRC = _TS_UPDATE_ELEM + r"""
extern "C" __global__ void lockstep_ts_update_pair_{S}_{I}(
        const {T}* __restrict__ upd0, const {IT}* __restrict__ wi0, {T}* out0,
        long long P0, long long L0, long long Q0, long long Sn0, long long total0,
        const {T}* __restrict__ upd1, const {IT}* __restrict__ wi1, {T}* out1,
        long long P1, long long L1, long long Q1, long long Sn1, long long total1, int has_wi, int circular) {{
    const long long total = total0 + total1;
    for (long long e = (long long)blockIdx.x * blockDim.x + threadIdx.x; e < total;
         e += (long long)gridDim.x * blockDim.x) {{
        if (e < total0) {{
            lockstep_ts_update_elem_{S}_{I}(upd0, wi0, out0, P0, L0, Q0, Sn0, has_wi, circular, e);
        }} else {{
            lockstep_ts_update_elem_{S}_{I}(upd1, wi1, out1, P1, L1, Q1, Sn1, has_wi, circular, e - total0);
        }}
    }}
}}
"""


def _ts_geometry(xp, out, past, upd, wi, axis: int):
    """(in_place, B, P, L, Q, Sn) of a TensorScatter the kernels take (C-contiguous, one dtype,
    int32/int64 write_indices, nothing shared but a cache bound in place as its own output), else None."""
    itemsize = out.dtype.itemsize
    if (past.dtype != out.dtype or upd.dtype != out.dtype or itemsize not in ITEM_CTYPE
            or not (out.flags.c_contiguous and past.flags.c_contiguous and upd.flags.c_contiguous)):
        return None
    if wi is not None and (dtype_name(wi.dtype) not in _INDEX_CTYPE or not wi.flags.c_contiguous):
        return None
    in_place = _address(xp, out) == _address(xp, past)  # the cache bound in place as its own output
    if same_buffer(xp, out, upd, wi) or (not in_place and same_buffer(xp, out, past)):
        return None
    B, L, Sn = int(past.shape[0]), int(past.shape[axis]), int(upd.shape[axis])
    return in_place, B, math.prod(past.shape[1:axis]), L, math.prod(past.shape[axis + 1:]), Sn


def _ts_format(out, wi) -> tuple[dict, str]:
    itemsize = out.dtype.itemsize
    iname = dtype_name(wi.dtype) if wi is not None else "int64"
    return dict(S=itemsize, I=iname, T=ITEM_CTYPE[itemsize], IT=_INDEX_CTYPE[iname]), f"{itemsize}_{iname}"


def tensor_scatter_into(xp, out, past, upd, wi, axis: int, circular: bool) -> bool:
    """``out = TensorScatter(past, upd, wi)`` (C-contiguous, one dtype; int32/int64 write_indices).
    When ``out`` is ``past``'s memory (the in-place KV cache) only the update rows are written;
    otherwise one kernel writes every element (the cache's, or the update's where it lands)."""
    geom = _ts_geometry(xp, out, past, upd, wi, axis)
    if geom is None:
        return False
    in_place, B, P, L, Q, Sn = geom
    if not is_cupy(xp):  # the full kernel's arithmetic (the update kernel writes the same values)
        if Sn == 0:
            xp.copyto(out, past)
            return True
        t = np.arange(L, dtype=np.int64).reshape(1, 1, L, 1)
        src = t if wi is None else t - wi.astype(np.int64).reshape(B, 1, 1, 1)
        if circular:
            src = src % L
        idx = np.broadcast_to(np.clip(src, 0, Sn - 1), (B, P, L, Q))
        picked = np.take_along_axis(upd.reshape(B, P, Sn, Q), idx, axis=2)
        xp.copyto(out, np.where((src >= 0) & (src < Sn), picked, past.reshape(B, P, L, Q)).reshape(out.shape))
        return True
    fmt, tag = _ts_format(out, wi)
    wptr = wi if wi is not None else upd
    if in_place:
        total = int(upd.size)
        if total:
            k = raw_kernel(xp, lambda: TS_UPDATE_SRC.format(**fmt), f"lockstep_ts_update_{tag}")
            launch_1d(k, total, (upd, wptr, out, np.int64(P), np.int64(L), np.int64(Q), np.int64(Sn),
                                 np.int32(wi is not None), np.int32(circular), np.int64(total)))
        return True
    total = int(out.size)
    if total:
        k = raw_kernel(xp, lambda: TS_FULL_SRC.format(**fmt), f"lockstep_ts_full_{tag}")
        launch_1d(k, total, (past, upd, wptr, out, np.int64(P), np.int64(L), np.int64(Q), np.int64(Sn),
                             np.int32(wi is not None), np.int32(circular), np.int64(total)))
    return True


def tensor_scatter_pair_into(xp, out0, past0, upd0, wi0, out1, past1, upd1, wi1, axis: int, circular: bool) -> bool:
    """CuPy only: ``tensor_scatter_into`` of two caches bound in place (a decode step's key and value
    caches), in one launch of each update element's arithmetic: one dtype, write_indices of one
    dtype or none for both, nothing shared across the two. False, having written nothing, otherwise."""
    if not is_cupy(xp) or (wi0 is None) != (wi1 is None) or out0.dtype != out1.dtype:
        return False
    if wi0 is not None and wi0.dtype != wi1.dtype:
        return False
    g0, g1 = _ts_geometry(xp, out0, past0, upd0, wi0, axis), _ts_geometry(xp, out1, past1, upd1, wi1, axis)
    if g0 is None or g1 is None or not (g0[0] and g1[0]) or same_buffer(xp, out0, out1, upd1, wi1) \
            or same_buffer(xp, out1, upd0, wi0) or upd0.size == 0 or upd1.size == 0:
        return False
    (_, _, P0, L0, Q0, Sn0), (_, _, P1, L1, Q1, Sn1) = g0, g1
    fmt, tag = _ts_format(out0, wi0)
    k = raw_kernel(xp, lambda: TS_UPDATE_PAIR_SRC.format(**fmt), f"lockstep_ts_update_pair_{tag}")
    launch_1d(k, int(upd0.size) + int(upd1.size),
              (upd0, wi0 if wi0 is not None else upd0, out0, np.int64(P0), np.int64(L0), np.int64(Q0), np.int64(Sn0),
               np.int64(upd0.size), upd1, wi1 if wi1 is not None else upd1, out1, np.int64(P1), np.int64(L1),
               np.int64(Q1), np.int64(Sn1), np.int64(upd1.size), np.int32(wi0 is not None), np.int32(circular)))
    return True


# -- Attention (4-D, float32): present = concat(past, new); one block per (batch, head, query) -----

KV_CONCAT_SRC = r"""
extern "C" __global__ void lockstep_kv_concat_f32(
        const float* __restrict__ kp, const float* __restrict__ kn, const float* __restrict__ vp,
        const float* __restrict__ vn, float* __restrict__ ok, float* __restrict__ ov,
        long long BH, long long P, long long Skv, long long D, long long Dv) {
    const long long T = P + Skv;
    const long long nk = BH * T * D;
    const long long total = nk + BH * T * Dv;
    for (long long e = (long long)blockIdx.x * blockDim.x + threadIdx.x; e < total;
         e += (long long)gridDim.x * blockDim.x) {
        if (e < nk) {
            const long long d = e % D;
            const long long t = (e / D) % T;
            const long long bh = e / (D * T);
            ok[e] = (t < P) ? kp[(bh * P + t) * D + d] : kn[(bh * Skv + (t - P)) * D + d];
        } else {
            const long long f = e - nk;
            const long long d = f % Dv;
            const long long t = (f / Dv) % T;
            const long long bh = f / (Dv * T);
            ov[f] = (t < P) ? vp[(bh * P + t) * Dv + d] : vn[(bh * Skv + (t - P)) * Dv + d];
        }
    }
}
"""

ATTENTION_SRC = r"""
__device__ __forceinline__ float lockstep_nanmax(float a, float b) {
    if (a != a) return a;
    if (b != b) return b;
    return a > b ? a : b;
}

extern "C" __global__ void lockstep_attention_f32(
        const float* __restrict__ q, const float* __restrict__ kp, const float* __restrict__ kn,
        const float* __restrict__ vp, const float* __restrict__ vn, const unsigned char* __restrict__ mask,
        float* __restrict__ y, long long Hq, long long Hkv, long long Sq, long long P, long long Skv,
        long long D, long long Dv, float s, int mask_kind, long long m0, long long m1, long long m2,
        long long m3, long long Tm, int causal) {
    extern __shared__ float sh[];
    __shared__ float red[128];
    float* qs = sh;
    float* sc = sh + D;
    const float NEG_INF = __int_as_float((int)0xff800000);
    const int tid = threadIdx.x;
    const int nt = blockDim.x;
    const long long T = P + Skv;
    const long long row = blockIdx.x;
    const long long i = row % Sq;
    const long long h = (row / Sq) % Hq;
    const long long b = row / (Sq * Hq);
    const long long hk = h / (Hq / Hkv);
    const long long bh = b * Hkv + hk;
    for (long long d = tid; d < D; d += nt) {
        qs[d] = __fmul_rn(q[row * D + d], s);
    }
    __syncthreads();
    int ok_local = 0;
    float mx = NEG_INF;
    for (long long j = tid; j < T; j += nt) {
        const float* kr = (j < P) ? (kp + (bh * P + j) * D) : (kn + (bh * Skv + (j - P)) * D);
        float acc = 0.0f;
        for (long long d = 0; d < D; ++d) {
            const float kv = __fmul_rn(kr[d], s);
            acc += qs[d] * kv;
        }
        float mval = 0.0f;
        if (mask_kind != 0) {
            if (j < Tm) {
                const long long off = b * m0 + h * m1 + i * m2 + j * m3;
                if (mask_kind == 1) {
                    mval = mask[off] ? 0.0f : NEG_INF;
                } else {
                    mval = ((const float*)mask)[off];
                }
            } else {
                mval = NEG_INF;
            }
        }
        float bias = 0.0f;
        if (causal) {
            const float cv = (j <= i + P) ? 0.0f : NEG_INF;
            bias = __fadd_rn(mval, cv);
        } else if (mask_kind != 0) {
            bias = __fadd_rn(0.0f, mval);
        }
        if (!(bias == NEG_INF)) ok_local = 1;
        const float wb = __fadd_rn(acc, bias);
        sc[j] = wb;
        mx = lockstep_nanmax(mx, wb);
    }
    const int row_ok = __syncthreads_or(ok_local);
    red[tid] = mx;
    __syncthreads();
    for (int st = nt / 2; st > 0; st >>= 1) {
        if (tid < st) red[tid] = lockstep_nanmax(red[tid], red[tid + st]);
        __syncthreads();
    }
    const float xmax = red[0];
    const float safe = (xmax == NEG_INF) ? 0.0f : xmax;
    __syncthreads();
    float part = 0.0f;
    for (long long j = tid; j < T; j += nt) {
        const float ev = expf(__fsub_rn(sc[j], safe));
        sc[j] = ev;
        part = __fadd_rn(part, ev);
    }
    red[tid] = part;
    __syncthreads();
    for (int st = nt / 2; st > 0; st >>= 1) {
        if (tid < st) red[tid] = __fadd_rn(red[tid], red[tid + st]);
        __syncthreads();
    }
    const float ssum = red[0];
    const float denom = (ssum == 0.0f) ? 1.0f : ssum;
    for (long long j = tid; j < T; j += nt) {
        sc[j] = row_ok ? __fdiv_rn(sc[j], denom) : 0.0f;
    }
    __syncthreads();
    for (long long d = tid; d < Dv; d += nt) {
        float acc = 0.0f;
        for (long long j = 0; j < T; ++j) {
            const float vv = (j < P) ? vp[(bh * P + j) * Dv + d] : vn[(bh * Skv + (j - P)) * Dv + d];
            acc += sc[j] * vv;
        }
        y[row * Dv + d] = acc;
    }
}
"""

_ATT_THREADS = 128  # a power of two: the kernel's tree reductions halve it
_SHARED_FLOATS = 12 * 1024 - 256  # the query row and one score row, with red[], within 48 KiB


def _mask_strides(mask, B: int, Hq: int, Sq: int) -> tuple[int, int, int, int]:
    """Element strides of ``mask`` broadcast to (B, Hq, Sq, its own last dim): 0 where it broadcasts."""
    shape, strides = tuple(mask.shape), tuple(st // mask.dtype.itemsize for st in mask.strides)
    out = [0, 0, 0, strides[-1]]
    for k in range(1, min(len(shape), 4)):
        if shape[-1 - k] != 1:
            out[3 - k] = strides[-1 - k]
    return out[0], out[1], out[2], out[3]


def attention_into(xp, outs, q, k, v, mask, past_k, past_v, scale: float, causal: bool) -> bool:
    """CuPy only: Attention's y (and present_key/present_value when ``outs`` has them) for float32
    4-D Q, K, V (and past), a bool or float32 mask or none, is_causal, GQA; the caller refuses
    softcap, windows, nonpad_kv_seqlen, softmax_precision other than float32 and the qk output.
    One launch for y (scores and softmax in shared memory), one more for the presents."""
    if not is_cupy(xp) or q.ndim != 4 or len(outs) > 3:
        return False
    arrays = [x for x in (q, k, v, past_k, past_v) if x is not None]
    if not _f32(*arrays, *outs) or same_buffer(xp, outs[0], *arrays):
        return False
    if mask is not None and (mask.dtype not in (np.bool_, _F32) or mask.ndim > 4):
        return False
    B, Hq, Sq, D = (int(d) for d in q.shape)
    Hkv, Skv, Dv = int(k.shape[1]), int(k.shape[2]), int(v.shape[3])
    P = int(past_k.shape[2]) if past_k is not None else 0
    if D + P + Skv > _SHARED_FLOATS or q.size == 0:
        return False
    kp = past_k if past_k is not None else k
    vp = past_v if past_v is not None else v
    if len(outs) > 1:
        concat = raw_kernel(xp, KV_CONCAT_SRC, "lockstep_kv_concat_f32")
        launch_1d(concat, B * Hkv * (P + Skv) * (D + Dv),
                  (kp, k, vp, v, outs[1], outs[2] if len(outs) > 2 else outs[1],
                   np.int64(B * Hkv), np.int64(P), np.int64(Skv), np.int64(D), np.int64(Dv if len(outs) > 2 else 0)))
    kind = 0 if mask is None else (1 if mask.dtype == np.bool_ else 2)
    m = _mask_strides(mask, B, Hq, Sq) if mask is not None else (0, 0, 0, 0)
    tm = int(mask.shape[-1]) if mask is not None else 0
    attn = raw_kernel(xp, ATTENTION_SRC, "lockstep_attention_f32")
    launch(attn, (B * Hq * Sq,), (_ATT_THREADS,),
         (q, kp, k, vp, v, mask if mask is not None else q, outs[0], np.int64(Hq), np.int64(Hkv), np.int64(Sq),
          np.int64(P), np.int64(Skv), np.int64(D), np.int64(Dv), np.float32(np.sqrt(scale)), np.int32(kind),
          *(np.int64(x) for x in m), np.int64(tm), np.int32(causal)),
         (D + P + Skv) * 4)
    return True


# -- Fused groups of nodes (reference_runtime/fusion.py): one launch where the unfused nodes take
# two or three, the same bits as those nodes' own fast paths ---------------------------------------

# x * sigmoid(x) * u: Sigmoid's float32 body (``_fast._SIGMOID_BODY``, the very text) then the two
# products of the Mul nodes (``_fast.BINARY_SRC``'s ``x * y``: one rounding each; IEEE products
# commute, so either operand order of each Mul gives these bits).
SILU_MUL_SRC = r"""
extern "C" __global__ void lockstep_silu_mul_f32(
        const float* __restrict__ gs, const float* __restrict__ us, float* __restrict__ out, long long n) {{
    for (long long at = (long long)blockIdx.x * blockDim.x + threadIdx.x; at < n;
         at += (long long)gridDim.x * blockDim.x) {{
        float x = gs[at];
        float y;
        {BODY}
        const float m = x * y;
        out[at] = m * us[at];
    }}
}}
"""


def silu_mul_into(xp, out, g, u) -> bool:
    """CuPy only: ``out = (g * sigmoid(g)) * u`` for float32 g, u and out of one shape, C-contiguous,
    in one launch: the bits of Sigmoid's and the two Muls' own kernels (``_fast.sigmoid_into``,
    ``_fast.binary_into``). False, having written nothing, otherwise."""
    from ._fast import _SIGMOID_BODY

    if (not is_cupy(xp) or not _f32(out, g, u) or tuple(g.shape) != tuple(out.shape)
            or tuple(u.shape) != tuple(out.shape) or same_buffer(xp, out, g, u)):
        return False
    n = int(out.size)
    if n:
        k = raw_kernel(xp, lambda: SILU_MUL_SRC.format(BODY=_SIGMOID_BODY["float32"]), "lockstep_silu_mul_f32")
        launch_1d(k, n, (g, u, out, np.int64(n)))
    return True


# Add then RMSNormalization of the sum: the sum's element is ``_fast.BINARY_SRC``'s ``x + y`` (one
# rounding; IEEE sums commute), written to ``s`` (the Add's output, or the normalised output itself
# when nothing else reads the sum: each thread rereads only the elements it wrote), then
# ``RMS_NORM_SRC`` line for line over those values: the same threads, strides, tree and roundings.
ADD_RMS_NORM_SRC = r"""
extern "C" __global__ void lockstep_add_rms_norm_f32(
        const float* __restrict__ a, const float* __restrict__ b, const float* __restrict__ scale,
        float* s, float* y, long long rows, long long cols, float eps) {
    __shared__ float part[256];
    const int tid = threadIdx.x;
    for (long long r = blockIdx.x; r < rows; r += gridDim.x) {
        float* sr = s + r * cols;
        float acc = 0.0f;
        for (long long c = tid; c < cols; c += blockDim.x) {
            const float v = a[r * cols + c] + b[r * cols + c];
            sr[c] = v;
            acc = __fadd_rn(acc, __fmul_rn(v, v));
        }
""" + _RMS_INV + r"""        for (long long c = tid; c < cols; c += blockDim.x) {
            y[r * cols + c] = __fmul_rn(__fmul_rn(sr[c], inv), scale[c]);
        }
        __syncthreads();
    }
}
"""


def add_rms_norm_into(xp, s, out, a, b, scale, axis: int, eps: float) -> bool:
    """CuPy only: ``s = a + b``; ``out = RMSNormalization(s, scale)`` over axes >= ``axis`` (float32
    work), one launch with ``rms_norm_into``'s bits for the norm and ``binary_into``'s for the sum.
    ``s`` None: the sum is not kept (``out`` holds it until normalised). a, b, s and out float32 of
    one shape, C-contiguous; scale as ``rms_norm_into`` takes it. False, having written nothing,
    otherwise."""
    sums = out if s is None else s
    if (not is_cupy(xp) or not _f32(out, sums, a, b, scale) or tuple(a.shape) != tuple(out.shape)
            or tuple(b.shape) != tuple(out.shape) or tuple(sums.shape) != tuple(out.shape)
            or same_buffer(xp, out, a, b, scale) or (s is not None and same_buffer(xp, s, a, b, scale, out))):
        return False
    rows, cols = _norm_rows(out.shape, scale.shape, axis)
    if rows == 0:
        return False
    k = raw_kernel(xp, ADD_RMS_NORM_SRC, "lockstep_add_rms_norm_f32")
    launch(k, (min(rows, 65535),), (256,), (a, b, scale, sums, out, np.int64(rows), np.int64(cols), np.float32(eps)))
    return True
