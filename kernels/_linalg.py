"""Matrix product for op kernels: ``matmul(xp, a, b)`` with ``np.matmul`` semantics.

This is the only module allowed to call ``np.matmul``. On numpy (the simulated device) it calls
``np.matmul`` (float16 accumulates in float32 and is cast back). On CuPy it never calls
``cupy.matmul``/``dot``/``tensordot``/``einsum`` (cuBLAS is refused during CUDA graph capture):
it launches a RawKernel of its own on the current stream, with a fixed summation order (k
ascending) and float32 accumulation for float16/float32, float64 for float64, and integer
accumulation in the input's integer type.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from ._launch import is_cupy, launch, launch_1d, raw_kernel, same_buffer
from ._op import dtype_name

__all__ = ["matmul", "matmul_into", "matmul_group_into", "matmul_shape", "GROUP_MAX"]


def matmul_shape(a_shape, b_shape) -> tuple[int, ...]:
    """The output shape of ``np.matmul`` for operands of these shapes (ValueError if invalid)."""
    a_shape, b_shape = tuple(int(d) for d in a_shape), tuple(int(d) for d in b_shape)
    if len(a_shape) == 0 or len(b_shape) == 0:
        raise ValueError("matmul operands must have rank >= 1")
    a2 = (1,) + a_shape if len(a_shape) == 1 else a_shape
    b2 = b_shape + (1,) if len(b_shape) == 1 else b_shape
    if a2[-1] != b2[-2]:
        raise ValueError(f"matmul inner dimensions differ: {a_shape} x {b_shape}")
    batch = tuple(int(d) for d in np.broadcast_shapes(a2[:-2], b2[:-2]))
    out = batch + (a2[-2], b2[-1])
    if len(a_shape) == 1:
        out = out[:-2] + out[-1:]
    if len(b_shape) == 1:
        out = out[:-1]
    return out


_TILE = 16

_SRC = r"""
extern "C" __global__ void lockstep_matmul_{name}(
        const {T}* __restrict__ A, const {T}* __restrict__ B, {T}* __restrict__ C,
        long long batch, long long M, long long N, long long K) {{
    __shared__ {ACC} As[16][16];
    __shared__ {ACC} Bs[16][16];
    const int tx = threadIdx.x;
    const int ty = threadIdx.y;
    const long long row = (long long)blockIdx.y * 16 + ty;
    const long long col = (long long)blockIdx.x * 16 + tx;
    for (long long b = blockIdx.z; b < batch; b += gridDim.z) {{
        const {T}* Ab = A + b * M * K;
        const {T}* Bb = B + b * K * N;
        {ACC} acc = ({ACC})0;
        for (long long k0 = 0; k0 < K; k0 += 16) {{
            const long long ka = k0 + tx;
            const long long kb = k0 + ty;
            As[ty][tx] = (row < M && ka < K) ? ({ACC})Ab[row * K + ka] : ({ACC})0;
            Bs[ty][tx] = (kb < K && col < N) ? ({ACC})Bb[kb * N + col] : ({ACC})0;
            __syncthreads();
            for (int kk = 0; kk < 16; ++kk) {{
                acc += As[ty][kk] * Bs[kk][tx];
            }}
            __syncthreads();
        }}
        if (row < M && col < N) {{
            C[b * M * N + row * N + col] = ({T})acc;
        }}
    }}
}}
"""

# dtype name -> (C element type, C accumulator type)
_CTYPES = {
    "float32": ("float", "float"),
    "float64": ("double", "double"),
    "int32": ("int", "int"),
    "int64": ("long long", "long long"),
}

_KERNELS: dict[str, Any] = {}


def _kernel(xp, name: str):
    k = _KERNELS.get(name)
    if k is None:
        t, acc = _CTYPES[name]
        src = _SRC.format(name=name, T=t, ACC=acc)
        k = xp.RawKernel(src, f"lockstep_matmul_{name}")
        _KERNELS[name] = k
    return k


def _launch_tile(xp, work, A, B, C, batch: int, M: int, N: int, K: int) -> None:
    """The tiled kernel over contiguous ``A`` (batch, M, K), ``B`` (batch, K, N) into ``C``."""
    if batch * M * N > 0:
        grid = ((N + _TILE - 1) // _TILE, (M + _TILE - 1) // _TILE, min(batch, 65535))
        launch(_kernel(xp, dtype_name(work)), grid, (_TILE, _TILE, 1),
               (A, B, C, np.int64(batch), np.int64(M), np.int64(N), np.int64(K)))


# Decode rows (M small, B shared): one thread per output element, k ascending, the same
# ``acc += a * b`` as the tiled kernel (whose zero padding beyond K adds exact zeros), so the same
# bits; reads of B are coalesced across a warp's columns. 32-bit indexing (the caller checks the
# sizes fit) and an unrolled k loop: the loads of eight k are issued before their multiply-adds,
# which run in the same order (a serial chain on ``acc``), so unrolling changes no bit. Measured
# on the H200 before unrolling: ~11 us per decode product, latency-bound on the serial loads.
_ROWS_SRC = r"""
extern "C" __global__ void lockstep_matmul_rows_{name}(
        const {T}* __restrict__ A, const {T}* __restrict__ B, {T}* __restrict__ C,
        int M, int N, int K) {{
    const int total = M * N;
    for (int e = blockIdx.x * blockDim.x + threadIdx.x; e < total; e += gridDim.x * blockDim.x) {{
        const int row = e / N;
        const int col = e - row * N;
        const {T}* __restrict__ Ar = A + (long long)row * K;
        const {T}* __restrict__ Bc = B + col;
        {ACC} acc = ({ACC})0;
        #pragma unroll 8
        for (int k = 0; k < K; ++k) {{
            acc += ({ACC})__ldg(Ar + k) * ({ACC})__ldg(Bc + k * N);
        }}
        C[e] = ({T})acc;
    }}
}}
"""


# One warp's output element ``C[e]`` (row, col) of ``A @ B``: lanes sum k = lane, lane + 32, ...,
# then the fixed shuffle tree. Shared text of ``_WARP_SRC`` and ``_GROUP_SRC`` (the same bits).
_WARP_DOT = r"""        const {T}* __restrict__ Ar = A + (long long)row * K;
        {ACC} acc = ({ACC})0;
        for (int k = lane; k < K; k += 32) {{
            acc += ({ACC})__ldg(Ar + k) * ({ACC})__ldg(B + (long long)k * N + col);
        }}
        for (int off = 16; off > 0; off >>= 1) {{
            acc += __shfl_down_sync(0xffffffffu, acc, off);
        }}
        if (lane == 0) {{
            C[e] = ({T})acc;
        }}
"""

# Decode rows of floats: one warp per output element, each lane summing k = lane, lane + 32, ...
# (k ascending within a lane), then a fixed shuffle tree (offsets 16, 8, 4, 2, 1): deterministic,
# but another order than the tiles' (not the same bits as the tile kernel or numpy: within the node
# suite's tolerances; decode steps and their captured replays use this one kernel alike). A serial
# chain of K multiply-adds per output becomes K/32 plus five, for the latency-bound M=1 products.
_WARP_SRC = r"""
extern "C" __global__ void lockstep_matmul_warp_{name}(
        const {T}* __restrict__ A, const {T}* __restrict__ B, {T}* __restrict__ C,
        int M, int N, int K) {{
    const int lane = threadIdx.x & 31;
    const int warp = (int)((blockIdx.x * blockDim.x + threadIdx.x) >> 5);
    const int nwarps = (int)((gridDim.x * blockDim.x) >> 5);
    const int total = M * N;
    for (int e = warp; e < total; e += nwarps) {{
        const int row = e / N;
        const int col = e - row * N;
""" + _WARP_DOT + r"""    }}
}}
"""
_WARP_TYPES = ("float32", "float64")
_ROWS_MAX = 16  # rows of A up to which the row kernel beats 16x16 tiles (decode: 1 per sequence)
_INT32 = 1 << 31


def _rows_fit(M: int, N: int, K: int) -> bool:
    """Whether ``A (M, K) @ B (K, N)`` is decode-shaped for the row kernels (warp or thread per output
    element; int32 indexing): ``matmul_into``'s choice, which ``matmul_group_into`` must make alike."""
    return M <= _ROWS_MAX and max(M * N, K * N, M * K) < _INT32 // 32


def matmul_into(xp, out, a, b) -> bool:
    """``out = matmul(a, b)`` in one launch, no temporaries: a, b and out of one dtype the kernel
    works in (float32, float64, int32, int64), C-contiguous, not sharing memory, and either B 2-D
    (A's batch and rows flattened: the same products) or A and B of one batch shape. False, having
    written nothing, otherwise (``matmul`` then computes it). numpy: ``np.matmul(a, b, out=)``."""
    dt = out.dtype
    dname = dtype_name(dt)
    if (a.dtype != dt or b.dtype != dt or dname not in _CTYPES or a.ndim < 2 or b.ndim < 2
            or not (a.flags.c_contiguous and b.flags.c_contiguous and out.flags.c_contiguous)
            or same_buffer(xp, out, a, b)):
        return False
    if b.ndim != 2 and tuple(a.shape[:-2]) != tuple(b.shape[:-2]):
        return False
    if xp.__name__ == "numpy":
        np.matmul(a, b, out=out)
        return True
    K, N = int(b.shape[-2]), int(b.shape[-1])
    if b.ndim == 2:
        batch, M = 1, math.prod(a.shape[:-1])
    else:
        batch, M = math.prod(a.shape[:-2]), int(a.shape[-2])
    if batch == 1 and _rows_fit(M, N, K):
        if M * N > 0 and dname in _WARP_TYPES:
            t, acc = _CTYPES[dname]
            name = f"lockstep_matmul_warp_{dname}"
            k = raw_kernel(xp, lambda: _WARP_SRC.format(name=dname, T=t, ACC=acc), name)
            blocks = max(1, min((M * N + 7) // 8, 65535))  # 8 warps of 32 per block of 256
            launch(k, (blocks,), (256,), (a, b, out, np.int32(M), np.int32(N), np.int32(K)))
        elif M * N > 0:
            t, acc = _CTYPES[dname]
            name = f"lockstep_matmul_rows_{dname}"
            launch_1d(raw_kernel(xp, lambda: _ROWS_SRC.format(name=dname, T=t, ACC=acc), name), M * N,
                      (a, b, out, np.int32(M), np.int32(N), np.int32(K)))
        return True
    _launch_tile(xp, dt, a, b, out, batch, M, N, K)
    return True


# Products of one A with up to four Bs (a decode step's q/k/v projections, its gate and up
# projections): ``_WARP_SRC``'s warp per output element over the outputs one after another, the
# same lane split, loop and shuffle tree per element, so each output has the bits ``matmul_into``
# gives it alone (which outputs a warp visits changes no element's arithmetic).
_GROUP_SRC = r"""
extern "C" __global__ void lockstep_matmul_group_{name}(
        const {T}* __restrict__ A, int M, int K,
        const {T}* __restrict__ B0, const {T}* __restrict__ B1, const {T}* __restrict__ B2, const {T}* __restrict__ B3,
        {T}* __restrict__ C0, {T}* __restrict__ C1, {T}* __restrict__ C2, {T}* __restrict__ C3,
        int N0, int N1, int N2, int N3) {{
    const int lane = threadIdx.x & 31;
    const int warp = (int)((blockIdx.x * blockDim.x + threadIdx.x) >> 5);
    const int nwarps = (int)((gridDim.x * blockDim.x) >> 5);
    const int t0 = M * N0, t1 = t0 + M * N1, t2 = t1 + M * N2, total = t2 + M * N3;
    for (int g = warp; g < total; g += nwarps) {{
        const {T}* __restrict__ B;
        {T}* __restrict__ C;
        int N, e;
        if (g < t0) {{ B = B0; C = C0; N = N0; e = g; }}
        else if (g < t1) {{ B = B1; C = C1; N = N1; e = g - t0; }}
        else if (g < t2) {{ B = B2; C = C2; N = N2; e = g - t1; }}
        else {{ B = B3; C = C3; N = N3; e = g - t2; }}
        const int row = e / N;
        const int col = e - row * N;
""" + _WARP_DOT + r"""    }}
}}
"""
GROUP_MAX = 4  # Bs per launch


def matmul_group_into(xp, outs, a, bs) -> bool:
    """CuPy only: ``outs[j] = matmul(a, bs[j])`` for 2-D Bs, up to ``GROUP_MAX`` of them, in one
    launch, where ``matmul_into`` would take its warp kernel for every one of them (float32 or
    float64, a's rows <= 16, C-contiguous, no shared memory): the same bits as those launches. False,
    having written nothing, otherwise (the caller then runs the products one by one)."""
    if not is_cupy(xp) or not 1 <= len(bs) <= GROUP_MAX or len(outs) != len(bs):
        return False
    dname = dtype_name(a.dtype)
    if dname not in _WARP_TYPES or a.ndim < 2 or not a.flags.c_contiguous:
        return False
    K, M = int(a.shape[-1]), math.prod(a.shape[:-1])
    for out, b in zip(outs, bs):
        if (b.dtype != a.dtype or out.dtype != a.dtype or b.ndim != 2 or int(b.shape[0]) != K
                or not (b.flags.c_contiguous and out.flags.c_contiguous) or same_buffer(xp, out, a, b)
                or tuple(out.shape) != tuple(a.shape[:-1]) + (int(b.shape[1]),)):
            return False
        N = int(b.shape[1])
        if not _rows_fit(M, N, K) or M * N == 0:
            return False
    if len({o.data.ptr for o in outs}) != len(outs):
        return False
    total = sum(M * int(b.shape[1]) for b in bs)
    if total >= _INT32 // 32:
        return False
    t, acc = _CTYPES[dname]
    k = raw_kernel(xp, lambda: _GROUP_SRC.format(name=dname, T=t, ACC=acc), f"lockstep_matmul_group_{dname}")
    pad = GROUP_MAX - len(bs)
    b_args = list(bs) + [bs[0]] * pad  # unused slots: never read (their N is 0)
    c_args = list(outs) + [outs[0]] * pad
    n_args = [np.int32(int(b.shape[1])) for b in bs] + [np.int32(0)] * pad
    blocks = max(1, min((total + 7) // 8, 65535))  # 8 warps of 32 per block of 256
    launch(k, (blocks,), (256,), (a, np.int32(M), np.int32(K), *b_args, *c_args, *n_args))
    return True


def _matmul_numpy(a, b):
    # asanyarray: an ndarray subclass (the capture guard's arrays) stays what it is
    a = np.asanyarray(a)
    b = np.asanyarray(b)
    if a.dtype == np.float16 or b.dtype == np.float16:
        dt = np.result_type(a.dtype, b.dtype)
        if dt == np.float16:
            return np.matmul(a.astype(np.float32), b.astype(np.float32)).astype(np.float16)
    return np.matmul(a, b)


def _matmul_cupy(xp, a, b):
    a = xp.asarray(a)
    b = xp.asarray(b)
    out_shape = matmul_shape(a.shape, b.shape)
    dt = np.result_type(a.dtype, b.dtype)
    # the dtype the kernel works in
    if dt == np.float16 or dt == np.float32:
        work = np.dtype(np.float32)
    elif dt == np.float64:
        work = np.dtype(np.float64)
    elif dt == np.int32:
        work = np.dtype(np.int32)
    else:
        # other integers and bool: int64 accumulation, cast back (wraps like numpy; bool = any)
        work = np.dtype(np.int64)
    a_vec, b_vec = a.ndim == 1, b.ndim == 1
    a2 = a.reshape((1,) + a.shape) if a_vec else a
    b2 = b.reshape(b.shape + (1,)) if b_vec else b
    M, K = int(a2.shape[-2]), int(a2.shape[-1])
    N = int(b2.shape[-1])
    batch_shape = tuple(int(d) for d in np.broadcast_shapes(a2.shape[:-2], b2.shape[:-2]))
    batch = int(np.prod(batch_shape, dtype=np.int64)) if batch_shape else 1
    A = xp.ascontiguousarray(xp.broadcast_to(a2.astype(work, copy=False), batch_shape + (M, K)))
    B = xp.ascontiguousarray(xp.broadcast_to(b2.astype(work, copy=False), batch_shape + (K, N)))
    C = xp.empty(batch_shape + (M, N), dtype=work)
    _launch_tile(xp, work, A, B, C, batch, M, N, K)
    C = C.reshape(out_shape)
    if C.dtype != dt:
        C = C.astype(dt)
    return C


def matmul(xp, a, b):
    """``np.matmul(a, b)`` (batch broadcasting, 1-D promotion) without cuBLAS on CuPy."""
    if xp.__name__ == "numpy":
        return _matmul_numpy(a, b)
    return _matmul_cupy(xp, a, b)
