"""Spectral ops: DFT, STFT, the Hann/Hamming/Blackman windows, MelWeightMatrix (``_signal_util``'s
dft_last: every product through ``_linalg.matmul``).
"""

from __future__ import annotations

import math

import numpy as np

from ._conv_util import host_vals, specs_of
from ._signal_util import dft_bytes, dft_last
from ._op import OpKernel, Spec

__all__ = ["OPS"]

__all__ = ["OPS"]


# ---------------------------------------------------------------- DFT, STFT, windows, MelWeightMatrix


def _host_int(node, specs, i, what):
    v = host_vals(node, specs, i)
    if v is None:
        return None
    if v.size != 1:
        raise node.error(f"{what} must be a scalar, got {v.size} values")
    if v.dtype.kind not in "iu":  # the spec types it int32/int64; a float (NaN, 1.5) is a model error, named
        raise node.error(f"{what} must be an integer (int32 or int64), got {v.dtype.name} {v.reshape(-1)[0]!r}")
    return int(v.reshape(-1)[0])


def _dft_plan(node, specs):
    """(axis, dft_length, inverse, onesided, output shape)."""
    x = specs[0]
    r = x.rank
    if r < 2 or x.shape[-1] not in (1, 2):
        raise node.error(f"input must be (..., 1) real or (..., 2) complex, got shape {x.shape}")
    if node.opset >= 20:
        axis = _host_int(node, specs, 2, "axis")
        axis = -2 if axis is None else axis
    else:
        axis = int(node.attr("axis", 1))
    if not -r <= axis < r or axis % r == r - 1:
        raise node.error(f"axis {axis} is out of range for input rank {r}")
    axis %= r
    inverse = bool(node.attr("inverse", 0))
    onesided = bool(node.attr("onesided", 0))
    length = _host_int(node, specs, 1, "dft_length")
    if length is None:
        length = 2 * (x.shape[axis] - 1) if inverse and onesided else x.shape[axis]
    if length <= 0:
        raise node.error(f"dft_length {length} must be positive")
    shape = list(x.shape)
    if inverse:
        shape[axis], shape[-1] = length, 1 if onesided else 2
    else:
        shape[axis], shape[-1] = (length // 2 + 1 if onesided else length), 2
    return axis, length, inverse, onesided, tuple(shape)


def _dft_shapes(node, specs):
    return [Spec(_dft_plan(node, specs)[4], specs[0].dtype)]


def _dft_workspace(node, specs):
    axis, length, _, _, _ = _dft_plan(node, specs)
    x = specs[0]
    return dft_bytes(math.prod(x.shape) // max(x.shape[axis] * x.shape[-1], 1), length, length)


def _dft_compute(xp, node, x, *rest):
    specs = specs_of(node, (x, *rest))
    axis, length, inverse, onesided, _ = _dft_plan(node, specs)
    xs = xp.moveaxis(x, axis, -2).astype(xp.float64)
    xr = xs[..., 0]
    xi = xs[..., 1] if x.shape[-1] == 2 else None
    re, im = dft_last(xp, xr, xi, length, inverse, onesided)
    out = xp.stack([re] if im is None else [re, im], axis=-1)
    return (xp.moveaxis(out, -2, axis).astype(x.dtype),)


def _stft_plan(node, specs):
    x = specs[0]
    if x.rank != 3 or x.shape[-1] not in (1, 2):
        raise node.error(f"signal must be (batch, length, 1 or 2), got shape {x.shape}")
    step = _host_int(node, specs, 1, "frame_step")
    if step is None or step <= 0:
        raise node.error("frame_step must be a positive scalar")
    window = specs[2] if len(specs) > 2 else None
    if window is not None and window.rank != 1:
        raise node.error(f"window must be 1-D, got shape {window.shape}")
    length = _host_int(node, specs, 3, "frame_length")
    if length is None:
        length = window.shape[0] if window is not None else x.shape[1]
    if window is not None and tuple(window.shape) != (length,):
        raise node.error(f"window shape {window.shape} does not match frame_length {length}")
    if length <= 0 or length > x.shape[1]:
        raise node.error(f"frame_length {length} must be in [1, {x.shape[1]}]")
    onesided = bool(node.attr("onesided", 1))
    frames = 1 + (x.shape[1] - length) // step
    bins = length // 2 + 1 if onesided else length
    return step, length, onesided, (x.shape[0], frames, bins, 2)


def _stft_shapes(node, specs):
    return [Spec(_stft_plan(node, specs)[3], specs[0].dtype)]


def _stft_workspace(node, specs):
    _, length, _, shape = _stft_plan(node, specs)
    rows = shape[0] * shape[1]
    return 4 * rows * length * 2 * 8 + dft_bytes(rows, length, length)  # the frames, then their DFT


def _stft_compute(xp, node, x, frame_step, window=None, frame_length=None):
    specs = specs_of(node, (x, frame_step, window, frame_length))
    step, length, onesided, shape = _stft_plan(node, specs)
    F = shape[1]
    idx = xp.arange(F, dtype=xp.int64)[:, None] * step + xp.arange(length, dtype=xp.int64)[None, :]
    fr = xp.take(x.astype(xp.float64), idx, axis=1)  # (B, F, L, c)
    if window is not None:
        fr = fr * window.astype(xp.float64)[:, None]
    xi = fr[..., 1] if x.shape[-1] == 2 else None
    re, im = dft_last(xp, fr[..., 0], xi, length, False, onesided)
    return (xp.stack([re, im], axis=-1).astype(x.dtype),)


def _onnx_dtype(node, code):
    from onnx import helper  # host only: ONNX type enum to numpy dtype

    try:
        return np.dtype(helper.tensor_dtype_to_np_dtype(int(code)))
    except (KeyError, ValueError, TypeError):
        raise node.error(f"output_datatype {code} is not a supported tensor type") from None


def _window_shapes(node, specs):
    size = _host_int(node, specs, 0, "size")
    if size is None or size < 0:
        raise node.error("size must be a non-negative scalar")
    return [Spec((size,), _onnx_dtype(node, node.attr("output_datatype", 1)))]


def _window_compute(xp, node, size):
    n = node.out_specs[0].shape[0]
    N = n if int(node.attr("periodic", 1)) else n - 1
    i = xp.arange(n, dtype=xp.float64)
    a = i * (2 * np.pi / N) if N else i * 0.0
    if node.op_type == "HannWindow":
        w = 0.5 - 0.5 * xp.cos(a)
    elif node.op_type == "HammingWindow":
        alpha = 25.0 / 46.0
        w = alpha - (1 - alpha) * xp.cos(a)
    else:
        w = 0.42 - 0.5 * xp.cos(a) + 0.08 * xp.cos(2 * a)
    return (w.astype(node.out_specs[0].dtype),)


def _mel_plan(node, specs):
    bins = _host_int(node, specs, 0, "num_mel_bins")
    dft = _host_int(node, specs, 1, "dft_length")
    rate = _host_int(node, specs, 2, "sample_rate")
    lo = host_vals(node, specs, 3)
    hi = host_vals(node, specs, 4)
    if None in (bins, dft, rate) or lo is None or hi is None or bins <= 0 or dft <= 0 or rate <= 0:
        raise node.error("num_mel_bins, dft_length, sample_rate must be positive scalars, edges given")
    return bins, dft, rate, float(lo[0]), float(hi[0])


def _mel_shapes(node, specs):
    bins, dft, _, _, _ = _mel_plan(node, specs)
    return [Spec((dft // 2 + 1, bins), _onnx_dtype(node, node.attr("output_datatype", 1)))]


def _mel_compute(xp, node, *args):
    specs = specs_of(node, args)
    bins, dft, rate, lo, hi = _mel_plan(node, specs)
    nspec = dft // 2 + 1
    lo_mel = 2595 * np.log1p(lo / 700) / np.log(10)
    hi_mel = 2595 * np.log1p(hi / 700) / np.log(10)
    step = (hi_mel - lo_mel) / (bins + 2)
    f = xp.arange(bins + 2, dtype=xp.float64) * step + lo_mel
    f = 700 * xp.expm1(f / 2595 * np.log(10))
    f = xp.floor((dft + 1) * f / rate).astype(xp.int64)
    left, center, right = f[None, :-2], f[None, 1:-1], f[None, 2:]
    j = xp.arange(nspec, dtype=xp.int64)[:, None]
    up = (j - left) / xp.maximum(center - left, 1)
    down = (right - j) / xp.maximum(right - center, 1)
    out = xp.where((j >= left) & (j <= center), up, 0.0)
    out = xp.where((center == left) & (j == center), 1.0, out)
    out = xp.where((j >= center) & (j < right), down, out)
    return (out.astype(node.out_specs[0].dtype),)


OPS: list[OpKernel] = [
    OpKernel("DFT", _dft_shapes, _dft_compute, since=17, host_inputs=(1, 2), workspace=_dft_workspace, capture="safe"),
    OpKernel("STFT", _stft_shapes, _stft_compute, since=17, host_inputs=(1, 3), workspace=_stft_workspace, capture="safe"),
    OpKernel("HannWindow", _window_shapes, _window_compute, since=17, host_inputs=(0,), capture="safe"),
    OpKernel("HammingWindow", _window_shapes, _window_compute, since=17, host_inputs=(0,), capture="safe"),
    OpKernel("BlackmanWindow", _window_shapes, _window_compute, since=17, host_inputs=(0,), capture="safe"),
    OpKernel("MelWeightMatrix", _mel_shapes, _mel_compute, since=17, host_inputs=(0, 1, 2, 3, 4), capture="safe"),
]
