"""Primitive kernels: the small set the runtime and its contract tests are built from.

Each body writes in place and never reads a device value on the host, so all are capture-safe
except ``matmul_cublas`` (cuBLAS, refused by CuPy during capture; kept to model that row of
docs/cuda-semantics.md, not for use by the executor).
"""

from __future__ import annotations

from . import _spin
from ._kernel import CAPTURE_UNSUPPORTED, Kernel
from ._latch import flag_out_of_range

__all__ = ["fill", "accumulate", "copy", "scale_add", "gather_checked", "spin", "matmul_cublas"]


def _fill(xp, out, *, value):
    out[...] = value


def _accumulate(xp, acc, x):
    # acc += x: an extra or missing execution changes the result, so replay counts are observable.
    xp.add(acc, x, out=acc)


def _copy(xp, dst, src):
    dst[...] = src


def _scale_add(xp, out, x, *, alpha, beta):
    xp.multiply(x, alpha, out=out)
    xp.add(out, beta, out=out)


def _gather_checked(xp, out, latch, table, idx, *, site):
    """out[i] = table[idx[i]]; an out-of-range index sets latch = [1, site] on the device.

    No device-to-host read: the bound check is a device-side reduction written into the latch,
    and the indices are clamped so the gather itself never reads out of bounds.
    """
    n = table.shape[0]
    flag_out_of_range(xp, latch, idx, 0, n, site)
    xp.take(table, xp.clip(idx, 0, n - 1), axis=0, out=out)


def _matmul(xp, out, a, b):
    xp.matmul(a, b, out=out)


fill = Kernel("fill", _fill, writes=(0,))
accumulate = Kernel("accumulate", _accumulate, writes=(0,))
copy = Kernel("copy", _copy, writes=(0,))
scale_add = Kernel("scale_add", _scale_add, writes=(0,))
gather_checked = Kernel("gather_checked", _gather_checked, writes=(0, 1))
spin = Kernel("spin", _spin.body, writes=(0,), cuda_body=_spin.cuda_body)
matmul_cublas = Kernel(
    "matmul_cublas",
    _matmul,
    writes=(0,),
    capture=CAPTURE_UNSUPPORTED,
    reason="cupy.matmul calls cuBLAS, which CuPy refuses during stream capture",
    uses_cublas=True,
)
