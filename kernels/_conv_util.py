"""Shared plumbing of the convolution and pooling kernels (``ops_conv``, ``ops_conv_variants``),
and the node helpers the resampling and spectral ops share (``need_spatial``, ``specs_of``,
``host_vals``). Resampling is ``_resample_util``, the DFT ``_signal_util``, Det's LU ``ops_linalg``.

Host-side helpers (geometry: output sizes and pads from attributes) use plain Python / numpy on
attributes only. The ``xp`` helpers are numpy/CuPy generic: windows are gathered with constant
``xp.pad`` and strided slices (one per kernel offset), and every matrix product goes through
``_linalg.matmul`` — never ``xp.matmul``/``dot``/``einsum``/``tensordot``.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence
from typing import Any

import numpy as np

from ._op import NodeInfo, Spec

__all__ = [
    "Geometry",
    "conv_nd",
    "conv_transpose_nd",
    "convt_geometry",
    "float_work",
    "geometry",
    "host_vals",
    "need_spatial",
    "pad_value_min",
    "spatial_attrs",
    "specs_of",
    "windows",
]


def float_work(dtype: Any) -> np.dtype:
    """The dtype sums are accumulated in: float32 for 16-bit floats, else the dtype itself."""
    dt = np.dtype(dtype)
    if dt.kind == "f" and dt.itemsize < 4 or dt.name == "bfloat16":
        return np.dtype(np.float32)
    return dt


def pad_value_min(dtype: Any) -> Any:
    """The padding value neutral for max: -inf for floats, the type's minimum for integers."""
    dt = np.dtype(dtype)
    if dt.kind in "iu":
        return int(np.iinfo(dt).min)
    if dt.kind == "b":
        return False
    return -np.inf


def _ints(node: NodeInfo, key: str, n: int, default: int) -> list[int]:
    v = node.attr(key)
    if v is None or (isinstance(v, (list, tuple)) and len(v) == 0):
        return [default] * n
    v = [int(a) for a in v]
    if len(v) != n:
        raise node.error(f"attribute {key} has {len(v)} values, {n} expected")
    return v


def spatial_attrs(node: NodeInfo, nsp: int, kernel: Sequence[int] | None = None):
    """(kernel_shape, strides, dilations, pads) from attributes; pads as [begins..., ends...]."""
    if kernel is None:
        k = node.attr("kernel_shape")
        if not k:
            raise node.error("attribute kernel_shape is required")
        kernel = [int(a) for a in k]
    elif node.attr("kernel_shape"):
        ks = [int(a) for a in node.attr("kernel_shape")]
        if ks != list(kernel):
            raise node.error(f"kernel_shape {ks} does not match the weights' spatial shape {list(kernel)}")
    if len(kernel) != nsp:
        raise node.error(f"kernel_shape {list(kernel)} has rank {len(kernel)}, input has {nsp} spatial dims")
    strides = _ints(node, "strides", nsp, 1)
    dilations = _ints(node, "dilations", nsp, 1)
    pads = _ints(node, "pads", 2 * nsp, 0)
    if any(s <= 0 for s in strides) or any(d <= 0 for d in dilations) or any(k <= 0 for k in kernel):
        raise node.error(f"kernel_shape {list(kernel)}, strides {strides} and dilations {dilations} must be positive")
    if any(p < 0 for p in pads):
        raise node.error(f"pads {pads} must be non-negative")
    return list(kernel), strides, dilations, pads


class Geometry:
    """Output spatial sizes and begin/end pads of a windowed op (conv or pool)."""

    def __init__(self, kernel, strides, dilations, begin, end, out):
        self.kernel, self.strides, self.dilations = list(kernel), list(strides), list(dilations)
        self.begin, self.end, self.out = list(begin), list(end), list(out)


def _window_fits(node: NodeInfo, kernel, eff: int, padded: int, stride: int, axis: int) -> None:
    """ONNX's output size ``(padded - eff) // stride + 1`` must not be negative (a window far larger
    than the padded input; ONNX Runtime refuses it too). Zero is kept: an empty output."""
    if (padded - eff) // stride + 1 < 0:
        raise node.error(f"kernel_shape {kernel} (dilated window {eff}) is larger than the padded input "
                         f"({padded}) on spatial axis {axis}: the output size would be negative")


def geometry(node: NodeInfo, in_sp: Sequence[int], kernel=None, *, ceil_mode: bool = False) -> Geometry:
    nsp = len(in_sp)
    kernel, strides, dilations, pads = spatial_attrs(node, nsp, kernel)
    auto_pad = node.attr("auto_pad", "NOTSET") or "NOTSET"
    begin, end, out = [], [], []
    for i, n in enumerate(in_sp):
        eff = (kernel[i] - 1) * dilations[i] + 1
        s = strides[i]
        if auto_pad in ("SAME_UPPER", "SAME_LOWER"):
            o = -(-n // s)
            total = max(0, (o - 1) * s + eff - n)
            small = total // 2
            b = small if auto_pad == "SAME_UPPER" else total - small
            e = total - b
        elif auto_pad == "VALID":
            b = e = 0
            _window_fits(node, kernel, eff, n, s, i)
            o = (n - eff) // s + 1 if n >= eff else 0
        elif auto_pad == "NOTSET":
            b, e = pads[i], pads[i + nsp]
            span = n + b + e - eff
            _window_fits(node, kernel, eff, n + b + e, s, i)
            if span < 0:
                o = 0
            elif ceil_mode:
                o = -(-span // s) + 1
                if (o - 1) * s >= n + b:  # the last window must start inside the input or its begin pad
                    o -= 1
            else:
                o = span // s + 1
        else:
            raise node.error(f"auto_pad {auto_pad!r} is not one of NOTSET, SAME_UPPER, SAME_LOWER, VALID")
        begin.append(b)
        end.append(e)
        out.append(max(o, 0))
    return Geometry(kernel, strides, dilations, begin, end, out)


def windows(xp, x, g: Geometry, value: Any = 0, *, end_value: Any = None):
    """The sliding windows of ``x`` (..., *spatial): an array (..., K, *out) with K = prod(kernel).

    ``x`` is padded with ``value`` by the geometry's pads, and (when the last windows reach past
    the end pad, ceil_mode) further with ``end_value`` (default ``value``)."""
    nsp = len(g.kernel)
    lead = tuple(x.shape[: x.ndim - nsp])
    K = int(np.prod(g.kernel))
    if any(o == 0 for o in g.out):
        return xp.zeros(lead + (K, *g.out), dtype=x.dtype)
    in_sp = x.shape[x.ndim - nsp:]
    pad = [(0, 0)] * len(lead)
    extra = []
    for i in range(nsp):
        need = (g.out[i] - 1) * g.strides[i] + (g.kernel[i] - 1) * g.dilations[i] + 1
        extra.append(max(0, need - in_sp[i] - g.begin[i] - g.end[i]))
        pad.append((g.begin[i], g.end[i]))
    if any(b or e for b, e in pad):
        x = xp.pad(x, pad, mode="constant", constant_values=value)
    if any(extra):
        ev = value if end_value is None else end_value
        x = xp.pad(x, [(0, 0)] * len(lead) + [(0, e) for e in extra], mode="constant", constant_values=ev)
    pre = (slice(None),) * len(lead)
    parts = []
    for offs in itertools.product(*[range(k) for k in g.kernel]):
        sl = tuple(
            slice(o * d, o * d + (n - 1) * s + 1, s)
            for o, d, n, s in zip(offs, g.dilations, g.out, g.strides)
        )
        parts.append(x[pre + sl])
    return xp.stack(parts, axis=len(lead))


def windows_bytes(lead: int, in_sp: Sequence[int], g: Geometry, itemsize: int = 8) -> int:
    """An upper estimate of the temporaries of ``windows`` over ``lead`` leading elements (Python
    ints): the padded input and the stacked windows, twice (a caller's elementwise pass over them)."""
    padded = 1
    for i, n in enumerate(in_sp):
        need = (g.out[i] - 1) * g.strides[i] + (g.kernel[i] - 1) * g.dilations[i] + 1 if g.out[i] else 0
        padded *= max(n + g.begin[i] + g.end[i], need)
    return 2 * lead * (padded + math.prod(g.kernel) * math.prod(g.out)) * itemsize


def conv_nd(xp, x, w, b, g: Geometry, group: int):
    """Grouped N-d convolution: im2col windows, then one batched ``_linalg.matmul``."""
    from ._linalg import matmul

    N, C = x.shape[0], x.shape[1]
    M = w.shape[0]
    K = int(np.prod(g.kernel))
    P = int(np.prod(g.out))
    cols = windows(xp, x, g, 0)  # (N, C, K, *out)
    cols = cols.reshape(N, group, (C // group) * K, P)
    wm = w.reshape(1, group, M // group, (C // group) * K)
    y = matmul(xp, wm, cols)  # (N, group, M/group, P)
    y = y.reshape((N, M) + tuple(g.out))
    if b is not None:
        y = y + b.reshape((1, M) + (1,) * len(g.out)).astype(y.dtype)
    return y.astype(x.dtype, copy=False)


def convt_geometry(node: NodeInfo, in_sp: Sequence[int], kernel: Sequence[int]):
    """(strides, dilations, begin pads, output sizes) of a ConvTranspose."""
    nsp = len(in_sp)
    kernel, strides, dilations, pads = spatial_attrs(node, nsp, kernel)
    out_pad = _ints(node, "output_padding", nsp, 0)
    auto_pad = node.attr("auto_pad", "NOTSET") or "NOTSET"
    if auto_pad not in ("NOTSET", "SAME_UPPER", "SAME_LOWER", "VALID"):
        raise node.error(f"auto_pad {auto_pad!r} is not one of NOTSET, SAME_UPPER, SAME_LOWER, VALID")
    out_shape = node.attr("output_shape")
    out_shape = [int(a) for a in out_shape][-nsp:] if out_shape else None
    if out_shape is not None and len(out_shape) != nsp:
        raise node.error(f"output_shape {out_shape} does not have {nsp} spatial dims")
    has_pads = bool(node.attr("pads")) and auto_pad == "NOTSET"
    begin, out = [], []
    for i, n in enumerate(in_sp):
        natural = strides[i] * (n - 1) + out_pad[i] + (kernel[i] - 1) * dilations[i] + 1
        if out_shape is not None and has_pads:
            b, o = pads[i], out_shape[i]
        elif out_shape is not None or auto_pad in ("SAME_UPPER", "SAME_LOWER"):
            o = out_shape[i] if out_shape is not None else n * strides[i]
            total = max(0, natural - o)  # as onnxruntime: never negative (extra size is zero-filled at the end)
            b = total // 2 if auto_pad == "SAME_UPPER" else total - total // 2
        else:
            if auto_pad == "VALID":
                pads = [0] * (2 * nsp)
            b = pads[i]
            o = natural - pads[i] - pads[i + nsp]
        if o < 0:
            raise node.error(f"ConvTranspose output size {o} along spatial dim {i} is negative")
        begin.append(b)
        out.append(o)
    return strides, dilations, begin, out


def conv_transpose_nd(xp, x, w, b, strides, dilations, begin, out, group: int):
    """Grouped N-d transposed convolution: one batched ``_linalg.matmul`` then col2im by strided adds."""
    from ._linalg import matmul

    N, C = x.shape[0], x.shape[1]
    in_sp = tuple(x.shape[2:])
    kernel = tuple(w.shape[2:])
    Mg = w.shape[1]
    M = Mg * group
    K = int(np.prod(kernel))
    I = int(np.prod(in_sp)) if in_sp else 1
    nsp = len(in_sp)
    xm = x.reshape(N, group, C // group, I)
    wm = xp.swapaxes(w.reshape(group, C // group, Mg * K), 1, 2).reshape(1, group, Mg * K, C // group)
    cols = matmul(xp, wm, xm).reshape((N, M, K) + in_sp)  # (N, M, K, *in)
    work = float_work(x.dtype)
    lead, size = [], []
    for i in range(nsp):
        natural = (in_sp[i] - 1) * strides[i] + (kernel[i] - 1) * dilations[i] + 1
        l0 = max(0, -begin[i])
        lead.append(l0)
        size.append(l0 + max(natural, begin[i] + out[i]))
    buf = xp.zeros((N, M) + tuple(size), dtype=work)
    pre = (slice(None), slice(None))
    for k, offs in enumerate(itertools.product(*[range(n) for n in kernel])):
        sl = tuple(
            slice(l0 + o * d, l0 + o * d + (n - 1) * s + 1, s)
            for l0, o, d, n, s in zip(lead, offs, dilations, in_sp, strides)
        )
        buf[pre + sl] += cols[:, :, k].astype(work, copy=False)
    crop = tuple(slice(l0 + bg, l0 + bg + o) for l0, bg, o in zip(lead, begin, out))
    y = buf[pre + crop]
    if b is not None:
        y = y + b.reshape((1, M) + (1,) * nsp).astype(work)
    return y.astype(x.dtype)


# -- shared by the conv, resize and signal op modules ------------------------------------------

def need_spatial(node, x: Spec, what: str = "X", nonempty: bool = False) -> int:
    """The spatial rank of ``x`` (N, C, spatial...); ``nonempty``: each spatial dim must be positive
    (an op that samples or reduces over them has nothing to read otherwise; ONNX Runtime refuses it too)."""
    if x.rank < 3:
        raise node.error(f"{what} must have rank >= 3 (N, C, spatial...), got shape {x.shape}")
    if nonempty and any(d == 0 for d in x.shape[2:]):
        raise node.error(f"{what} shape {x.shape}: every spatial dim must be positive for {node.op_type}")
    return x.rank - 2


def specs_of(node, arrays):
    """Specs as shapes() saw them, rebuilt in compute: host values from ``node.host``."""
    out = []
    for i, a in enumerate(arrays):
        if a is None:
            out.append(None)
        else:
            h = node.host.get(i)
            out.append(Spec(tuple(a.shape), a.dtype, h))
    return out


def host_vals(node, specs, i):
    """The host value of optional input ``i`` as a flat float64 array, or None if absent/empty."""
    if len(specs) <= i or specs[i] is None:
        return None
    v = np.asarray(specs[i].value).reshape(-1)
    return v if v.size else None
