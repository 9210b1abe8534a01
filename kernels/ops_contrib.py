"""ONNX Runtime contrib ops (domain ``com.microsoft``, version 1), computed as onnxruntime's CPU
provider computes them (checked against onnxruntime 1.31.1; ``tests/test_contrib_ops.py``).

SimplifiedLayerNormalization
    RMS norm over the axes ``[axis, rank)``: ``Y = X / sqrt(mean(X^2) + epsilon) * scale``, in
    float32 (float64 when an operand or ``stash_type`` is double); optional ``inv_std_var`` of shape
    ``X.shape[:axis] + (1,) * (rank - axis)`` in the ``stash_type`` dtype (1: float, 11: double).
    ``Y`` has the dtype of ``scale`` (ORT's type V).  ORT itself registers this op in the ai.onnx
    domain (``""``), where ONNX Runtime GenAI's builder writes it; ``onnx.checker`` has no schema
    for it there, so the loader checks such nodes against ONNX Runtime's own schema
    (``lockstep/ort_schemas.py``). Registered in both domains (ONNX Runtime 1.31 has it
    only in the default one).
QuickGelu
    ``Y = X * sigmoid(alpha * X)`` (``alpha`` defaults to 1.702), computed in float32 (float64 for
    double), as Optimum's ``--optimize O2`` fuses the SiLU-like activation of Llama-family MLPs.
FastGelu, BiasGelu
    ``FastGelu(X, bias?) = 0.5 z (1 + tanh(sqrt(2/pi) (z + 0.044715 z^3)))`` and
    ``BiasGelu(A, B) = 0.5 z (1 + erf(z / sqrt(2)))`` of ``z = X + bias`` (``A + B``), the bias 1-D of
    the last dim's length (as ORT's CPU kernels require); computed in float32 (float64 for double).
    ORT has no double BiasGelu; it is accepted here as float64 arithmetic.
SkipSimplifiedLayerNormalization
    ``s = input + skip (+ bias)``; ``output = s / sqrt(mean(s^2) + epsilon) * gamma`` over the
    last axis (epsilon defaults to 1e-12).  ``input`` is 2-D or 3-D; ``skip`` has the input's shape
    or its last two dims (``[S, H]`` or ``[1, S, H]``).  ``mean`` is all zeros (ORT writes zeros),
    ``inv_std_var`` is float ``[..., 1]``, ``input_skip_bias_sum`` is ``s`` in the input dtype.
SkipLayerNormalization
    The same sums and shapes as SkipSimplifiedLayerNormalization (``s = input + skip (+ bias)``, in
    float32 for float16), then a layer norm over the last axis:
    ``output = (s - mean) / sqrt(var + epsilon) * gamma (+ beta)``; ``mean`` and ``inv_std_var``
    are float ``[..., 1]`` (ORT writes both), ``input_skip_bias_sum`` is ``s`` in the input dtype.
    Inputs ``input, skip, gamma, beta?, bias?``.
MatMulNBits
    ``Y = A @ dequant(B).T (+ bias)``, ``dequant = (q - zero_point) * scale`` per block of
    ``block_size`` along K; ``bits`` 2, 4 or 8 (values packed low bits first); zero points absent
    (``2**(bits-1)``), packed uint8 or float.  Dequantised on the device, multiplied through
    ``_linalg.matmul`` in float32.  ``g_idx`` and ``weight_prepacked`` are refused;
    ``accuracy_level`` is ignored (ORT's level 4 quantises A to int8; we stay in float32).
GatherBlockQuantized
    A Gather of rows of a block-quantised table (the builder's int4 embedding, sharing the tied
    lm_head's MatMulNBits blocks): ``data`` uint8 ``[rows, ..., K * bits / 8]`` packed along the
    last axis low bits first, ``gather_axis`` 0 and ``quantize_axis`` the last axis (as ORT requires
    for uint8 data), ``scales`` ``[rows, ..., ceil(K / block_size)]`` of the output's float type,
    ``zero_points`` absent (``2**(bits-1)``) or uint8 packed the same way.  Output
    ``indices.shape + data.shape[1:-1] + (K,)``, ``(q - zero_point) * scale`` in float32 then cast.
    Indices in ``[-rows, rows)`` wrap; any other index gives a row of zeros (ORT 1.31's documented
    behaviour, unlike ONNX's Gather: no error).  Only the gathered rows are dequantised.  Refused:
    data of another type (int4/uint4, float8, float4), another gather or quantize axis, bits other
    than 2, 4, 8, a block_size that is not a power of 2 of at least 16.
GroupQueryAttention
    In ``ops_contrib_gqa`` (its own module: the cache kinds, rotary, windows and eviction).
"""

from __future__ import annotations

import numpy as np

from ._contrib_util import dequantize_blocks, unpack_bits, work_dtype
from ._contrib_util import cast as _cast
from ._contrib_util import pad_specs as _specs
from ._elementwise_util import erf
from ._linalg import matmul
from . import _nbits_host
from ._op import OpKernel, Spec, const_memo, normalize_axis

OPS: list[OpKernel] = []

_MS = "com.microsoft"
_STASH = {1: np.dtype(np.float32), 11: np.dtype(np.float64)}


# -- QuickGelu (Optimum's O2 fusion of x * sigmoid(1.702 x)) ------------------------------------

def _quick_gelu_shapes(node, specs):
    x = specs[0]
    if np.dtype(x.dtype).kind != "f":
        raise node.error(f"input must be a floating-point tensor, got {np.dtype(x.dtype).name}")
    return [Spec(x.shape, x.dtype)]


def _quick_gelu_compute(xp, node, x):
    alpha = float(node.attr("alpha", 1.702))
    work = work_dtype(x.dtype)
    xf = x.astype(work)
    return (_cast(xf / (1 + xp.exp(-work.type(alpha) * xf)), x.dtype),)


OPS.append(OpKernel("QuickGelu", _quick_gelu_shapes, _quick_gelu_compute, domain=_MS, since=1, capture="safe"))


# -- FastGelu, BiasGelu (ORT's transformer optimizer: a Gelu after a MatMul's bias) -------------

_SQRT_2_OVER_PI = 0.7978845608028654


def _gelu_shapes(node, specs):
    x, bias = _specs(specs, 2)[:2]
    if np.dtype(x.dtype).kind != "f":
        raise node.error(f"input must be a floating-point tensor, got {np.dtype(x.dtype).name}")
    if bias is not None:
        if bias.rank != 1 or x.rank < 1 or bias.shape[0] != x.shape[-1] or np.dtype(bias.dtype) != np.dtype(x.dtype):
            raise node.error(f"bias must be 1-D {np.dtype(x.dtype).name} of the input's last dim "
                             f"({x.shape[-1] if x.rank else 'none'}), got {np.dtype(bias.dtype).name}{list(bias.shape)}")
    return [Spec(x.shape, x.dtype)]


def _biased(x, bias, work):
    z = x.astype(work)
    return z if bias is None else z + bias.astype(work)


def _fast_gelu_compute(xp, node, x, bias=None):
    work = work_dtype(x.dtype)
    z = _biased(x, bias, work)
    c, a, half = work.type(_SQRT_2_OVER_PI), work.type(0.044715), work.type(0.5)
    return (_cast(half * z * (1 + xp.tanh(c * (z + a * z * z * z))), x.dtype),)


def _bias_gelu_compute(xp, node, a, b):
    work = work_dtype(a.dtype)
    z = _biased(a, b, work)
    return (_cast(work.type(0.5) * z * (1 + erf(xp, z * work.type(1 / np.sqrt(2.0)))), a.dtype),)


OPS.append(OpKernel("FastGelu", _gelu_shapes, _fast_gelu_compute, domain=_MS, since=1, capture="safe"))
OPS.append(OpKernel("BiasGelu", _gelu_shapes, _bias_gelu_compute, domain=_MS, since=1, capture="safe"))


# -- SimplifiedLayerNormalization --------------------------------------------------------------

def _sln_dims(node, x, scale):
    axis = normalize_axis(node, int(node.attr("axis", -1)), x.rank)
    norm = tuple(x.shape[axis:])
    try:
        ok = tuple(np.broadcast_shapes(tuple(scale.shape), tuple(x.shape))) == tuple(x.shape)
    except ValueError:
        ok = False
    if not ok or scale.rank > x.rank:
        raise node.error(f"scale shape {scale.shape} does not broadcast to input {x.shape} (normalized dims {norm})")
    stash = int(node.attr("stash_type", 1))
    if stash not in _STASH:
        raise node.error(f"stash_type {stash} is not supported (1: float, 11: double)")
    return axis, _STASH[stash]


def _sln_shapes(node, specs):
    x, scale = specs[0], specs[1]
    axis, stash = _sln_dims(node, x, scale)
    stat = tuple(x.shape[:axis]) + (1,) * (x.rank - axis)
    return [Spec(x.shape, scale.dtype), Spec(stat, stash)][:max(node.n_outputs, 1)]


def _sln_compute(xp, node, x, scale):
    axis = normalize_axis(node, int(node.attr("axis", -1)), x.ndim)
    eps = float(node.attr("epsilon", 1e-5))
    specs = node.out_specs
    work = work_dtype(x.dtype, scale.dtype, *(s.dtype for s in specs[1:]))
    xf = x.astype(work)
    axes = tuple(range(axis, x.ndim))
    inv = 1 / xp.sqrt(xp.mean(xf * xf, axis=axes, keepdims=True) + work.type(eps))
    y = _cast(xf * inv * scale.astype(work), specs[0].dtype)
    return (y, _cast(inv, specs[1].dtype)) if len(specs) > 1 else (y,)


OPS.append(OpKernel("SimplifiedLayerNormalization", _sln_shapes, _sln_compute, domain=_MS, since=1, capture="safe"))
# ONNX Runtime registers it in the default domain too, where GenAI's builder writes it (the loader checks
# such nodes against ONNX Runtime's schema: lockstep/ort_schemas.py)
OPS.append(OpKernel("SimplifiedLayerNormalization", _sln_shapes, _sln_compute, domain="", since=1, capture="safe"))


# -- SkipSimplifiedLayerNormalization ----------------------------------------------------------

def _skip_shapes(node, specs):
    x, skip, gamma, bias = _specs(specs, 4)[:4]
    if x.rank not in (2, 3):
        raise node.error(f"input is expected to have 2 or 3 dimensions, got shape {x.shape}")
    H = x.shape[-1]
    if skip.rank not in (2, 3):
        raise node.error(f"skip is expected to have 2 or 3 dimensions, got shape {skip.shape}")
    if tuple(skip.shape) != tuple(x.shape) and (
            tuple(skip.shape[-2:]) != tuple(x.shape[-2:]) or (skip.rank == 3 and skip.shape[0] != 1)):
        raise node.error(f"skip shape {skip.shape} must equal input shape {x.shape} or its last two dims")
    for name, s in (("gamma", gamma), ("bias", bias)):
        if s is not None and tuple(s.shape) != (H,):
            raise node.error(f"{name} must have shape ({H},), got {s.shape}")
    stat = tuple(x.shape[:-1]) + (1,)
    f32 = np.dtype(np.float32)
    return [Spec(x.shape, x.dtype), Spec(stat, f32), Spec(stat, f32), Spec(x.shape, x.dtype)][:max(node.n_outputs, 1)]


def _skip_compute(xp, node, x, skip, gamma, bias=None):
    eps = float(node.attr("epsilon", 1e-12))
    work = work_dtype(x.dtype)
    s = x.astype(work) + skip.astype(work)  # float16: summed and normalised in float32, as ORT does
    if bias is not None:
        s = s + bias.astype(work)
    inv = 1 / xp.sqrt(xp.mean(s * s, axis=-1, keepdims=True) + work.type(eps))
    specs = node.out_specs
    outs = [_cast(s * inv * gamma.astype(work), specs[0].dtype)]
    if len(specs) > 1:
        outs.append(xp.zeros(specs[1].shape, dtype=specs[1].dtype))
    if len(specs) > 2:
        outs.append(_cast(inv, specs[2].dtype))
    if len(specs) > 3:
        outs.append(_cast(s, specs[3].dtype))
    return tuple(outs)


OPS.append(OpKernel("SkipSimplifiedLayerNormalization", _skip_shapes, _skip_compute, domain=_MS, since=1, capture="safe"))


# -- SkipLayerNormalization --------------------------------------------------------------------

def _skip_ln_shapes(node, specs):
    x, skip, gamma, beta, bias = _specs(specs, 5)[:5]
    outs = _skip_shapes(node, [x, skip, gamma, bias])  # the same inputs and outputs, beta besides
    if beta is not None and tuple(beta.shape) != (x.shape[-1],):
        raise node.error(f"beta must have shape ({x.shape[-1]},), got {beta.shape}")
    return outs


def _skip_ln_compute(xp, node, x, skip, gamma, beta=None, bias=None):
    eps = float(node.attr("epsilon", 1e-12))
    work = work_dtype(x.dtype)
    s = x.astype(work) + skip.astype(work)  # float16: summed and normalised in float32, as ORT does
    if bias is not None:
        s = s + bias.astype(work)
    mean = xp.mean(s, axis=-1, keepdims=True)
    var = xp.mean(s * s, axis=-1, keepdims=True) - mean * mean  # ORT's E[s^2] - E[s]^2
    inv = 1 / xp.sqrt(var + work.type(eps))
    y = (s - mean) * inv * gamma.astype(work)
    if beta is not None:
        y = y + beta.astype(work)
    specs = node.out_specs
    outs = [_cast(y, specs[0].dtype)]
    if len(specs) > 1:
        outs.append(_cast(mean, specs[1].dtype))
    if len(specs) > 2:
        outs.append(_cast(inv, specs[2].dtype))
    if len(specs) > 3:
        outs.append(_cast(s, specs[3].dtype))
    return tuple(outs)


OPS.append(OpKernel("SkipLayerNormalization", _skip_ln_shapes, _skip_ln_compute, domain=_MS, since=1, capture="safe"))


# -- MatMulNBits -------------------------------------------------------------------------------

def _nbits_attrs(node):
    for key in ("K", "N", "block_size"):
        if node.attr(key) is None:
            raise node.error(f"attribute {key} is required")
    K, N, bs = int(node.attr("K")), int(node.attr("N")), int(node.attr("block_size"))
    bits = int(node.attr("bits", 4))
    if bits not in (2, 4, 8):
        raise node.error(f"bits={bits} is not supported (2, 4 or 8)")
    if bs < 16 or bs & (bs - 1):
        raise node.error(f"block_size={bs} must be a power of 2 and at least 16")
    if K <= 0 or N <= 0:
        raise node.error(f"K={K} and N={N} must be positive")
    if int(node.attr("weight_prepacked", 0)):
        raise node.error("weight_prepacked=1 is not supported")
    return K, N, bs, bits


def _nbits_shapes(node, specs):
    a, b, scales, zp, g_idx, bias = _specs(specs, 6)[:6]
    K, N, bs, bits = _nbits_attrs(node)
    nb = -(-K // bs)
    if g_idx is not None:
        raise node.error("input g_idx is not supported")
    if a.rank < 1 or a.shape[-1] != K:
        raise node.error(f"A's last dimension must be K={K}, got shape {a.shape}")
    if np.dtype(b.dtype) != np.uint8 or int(np.prod(b.shape)) != N * nb * bs * bits // 8:
        raise node.error(f"B must be uint8 [{N}, {nb}, {bs * bits // 8}], got {b.dtype}{list(b.shape)}")
    if int(np.prod(scales.shape)) != N * nb:
        raise node.error(f"scales must have N * n_blocks = {N * nb} elements, got shape {scales.shape}")
    if zp is not None:
        want = N * -(-nb * bits // 8) if np.dtype(zp.dtype) == np.uint8 else N * nb
        if int(np.prod(zp.shape)) != want:
            raise node.error(f"zero_points ({zp.dtype}) must have {want} elements, got shape {zp.shape}")
    if bias is not None and int(np.prod(bias.shape)) != N:
        raise node.error(f"bias must have N={N} elements, got shape {bias.shape}")
    return [Spec(tuple(a.shape[:-1]) + (N,), a.dtype)]


def _nbits_compute(xp, node, a, b, scales, zp=None, g_idx=None, bias=None):
    K, N, bs, bits = _nbits_attrs(node)
    work = work_dtype(a.dtype)
    # the numpy test stays in the condition: the source audit reads it as the capture guard
    if xp.__name__ == "numpy" and bits == 4 and _nbits_host.AVAILABLE and not node.in_dtypes:
        # the simulated device and the float64 cross-check: unpacked block by block at every run, no
        # dequantized copy kept
        y = _nbits_host.matmul_4bit(a.reshape(-1, K).astype(work, copy=False), b, scales, zp,
                                    n=N, k=K, block=bs).reshape(tuple(a.shape[:-1]) + (N,))
        if bias is not None:
            y = y + bias.reshape(N).astype(work)
        return (_cast(y, node.out_specs[0].dtype),)
    consts = (1, 2) if zp is None else (1, 2, 3)  # the weight's blocks, scales and zero points

    def dequantized():
        return dequantize_blocks(xp, b, scales, zp, n=N, k=K, bits=bits, block=bs, work=work)

    w = const_memo(xp, node, ("dequantized", np.dtype(work).name), consts, dequantized)
    y = matmul(xp, a.astype(work), xp.transpose(w))
    if bias is not None:
        y = y + bias.reshape(N).astype(work)
    return (_cast(y, node.out_specs[0].dtype),)


OPS.append(OpKernel("MatMulNBits", _nbits_shapes, _nbits_compute, domain=_MS, since=1, capture="safe"))


# -- GatherBlockQuantized ----------------------------------------------------------------------

def _gbq_attrs(node):
    bits, bs = int(node.attr("bits", 4)), int(node.attr("block_size", 128))
    if bits not in (2, 4, 8):
        raise node.error(f"bits={bits} is not supported (2, 4 or 8)")
    if bs < 16 or bs & (bs - 1):
        raise node.error(f"block_size={bs} must be a power of 2 and at least 16")
    return bits, bs


def _gbq_dims(node, specs):
    """(bits, block_size, K: the unpacked last dim, n_blocks)."""
    data, idx, scales, zp = _specs(specs, 4)[:4]
    bits, bs = _gbq_attrs(node)
    if np.dtype(data.dtype) != np.uint8:
        raise node.error(f"data of type {np.dtype(data.dtype).name} is not supported (uint8, packed along the last "
                         "axis; int4/uint4, float8 and float4 data are not)")
    r = data.rank
    if r < 2:
        raise node.error(f"data must have rank >= 2 (rows, ..., packed values), got shape {data.shape}")
    ga = normalize_axis(node, int(node.attr("gather_axis", 0)), r)
    qa = normalize_axis(node, int(node.attr("quantize_axis", 1)), r)
    if ga != 0:
        raise node.error(f"gather_axis={node.attr('gather_axis')} is not supported: uint8 data is gathered along "
                         "axis 0 (as ORT requires)")
    if qa != r - 1:
        raise node.error(f"quantize_axis={node.attr('quantize_axis', 1)} is not supported: only the last axis "
                         f"({r - 1}, the packed one)")
    if np.dtype(idx.dtype) not in (np.int32, np.int64):
        raise node.error(f"indices must be int32 or int64, got {np.dtype(idx.dtype).name}")
    K = data.shape[-1] * (8 // bits)
    nb = -(-K // bs)
    lead = tuple(data.shape[:-1])
    if np.dtype(scales.dtype).kind != "f" or tuple(scales.shape) != lead + (nb,):
        raise node.error(f"scales must be float {list(lead + (nb,))} (data {list(data.shape)}, block_size {bs}), "
                         f"got {np.dtype(scales.dtype).name}{list(scales.shape)}")
    if zp is not None:
        zw = -(-nb * bits // 8)
        if np.dtype(zp.dtype) != np.uint8 or tuple(zp.shape) != lead + (zw,):
            raise node.error(f"zero_points must be uint8 {list(lead + (zw,))} (packed as data), "
                             f"got {np.dtype(zp.dtype).name}{list(zp.shape)}")
    return bits, bs, K, nb


def _gbq_shapes(node, specs):
    data, idx, scales = specs[:3]
    _bits, _bs, K, _nb = _gbq_dims(node, specs)
    return [Spec(tuple(idx.shape) + tuple(data.shape[1:-1]) + (K,), scales.dtype)]


def _gbq_compute(xp, node, data, indices, scales, zero_points=None):
    bits, bs, K, nb = _gbq_dims(node, [None if a is None else Spec(a.shape, a.dtype)
                                       for a in (data, indices, scales, zero_points)])
    spec = node.out_specs[0]
    rows = data.shape[0]
    if rows == 0:  # every index is out of range: rows of zeros
        return (xp.zeros(spec.shape, dtype=spec.dtype),)
    work = work_dtype(scales.dtype)
    i = indices.astype(xp.int64)
    i = xp.where(i < 0, i + rows, i)
    valid = (i >= 0) & (i < rows)  # ORT: an index outside [-rows, rows) gives zeros (no error)
    i = xp.clip(i, 0, rows - 1)
    q = unpack_bits(xp, xp.take(data, i, axis=0), bits).astype(work)  # only the gathered rows
    s = xp.repeat(xp.take(scales, i, axis=0).astype(work), bs, axis=-1)[..., :K]
    if zero_points is None:
        z = work.type(1 << (bits - 1))
    else:
        z = unpack_bits(xp, xp.take(zero_points, i, axis=0), bits)[..., :nb].astype(work)
        z = xp.repeat(z, bs, axis=-1)[..., :K]
    w = (q - z) * s
    keep = valid.reshape(valid.shape + (1,) * (w.ndim - valid.ndim))
    return (_cast(xp.where(keep, w, work.type(0)), spec.dtype),)


OPS.append(OpKernel("GatherBlockQuantized", _gbq_shapes, _gbq_compute, domain=_MS, since=1, capture="safe"))
