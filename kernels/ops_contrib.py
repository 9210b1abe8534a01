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
    Query ``[B, S, Nq*D]`` (or packed QKV when key/value are absent), key/value ``[B, S, Nkv*D]``,
    past/present KV in BNSH.  What ORT 1.31.1's CPU provider does, probed case by case:

    * Cache kind from the past length ``P`` (dim 2 of past_key; 0 when absent), the new length
      ``S`` and ``T = total_sequence_length`` (a host value, ``host_inputs``): ``T == P + S`` is a
      *dynamic* (growing, concat) cache and present has length ``T``; ``T <= P`` is a *static*
      (shared-buffer, capacity ``P``) cache and present has length ``P``; anything else is an error.
      Without past, ``T`` must equal ``S``.
    * Per batch entry b the total length is ``t_b = seqlens_k[b] + 1`` (read on the device).  On the
      first prompt (``S == T``) the past length is ``p_b = 0`` (rows ``S > t_b`` are right padding);
      otherwise ``p_b = t_b - S`` (token generation, or a later prompt chunk, which needs B == 1).
      A ``seqlens_k`` ORT refuses (outside ``[0, present length)``, below ``S - 1`` after the first
      prompt, or a rotary position past the cos/sin rows) sets the runtime's error latch
      (``index_checks``: ``DeviceAssert`` naming the node); the kernel clips it.
    * Present row ``r`` of entry b: ``past[r]`` for ``r < p_b``, the new (rotated) key/value
      ``r - p_b`` for ``p_b <= r < p_b + S``, zero elsewhere -- ORT zeroes a present buffer that
      is not the past buffer (onnxruntime's Python API never shares them; with IO binding in place
      the rows past ``p_b + S`` are unspecified in ORT and zero here).
    * Rotary (``do_rotary=1``, cos/sin caches ``[max_pos, rotary_dim/2]``) rotates Q and K at
      position ``p_b + s`` for query row s -- ``0..S-1`` on the first prompt even for padded rows,
      ``seqlens_k[b]`` when decoding one token; interleaved or half-split (``rotary_interleaved``);
      features past ``rotary_dim`` pass through.
    * Query row s (absolute position ``p_b + s``) attends to key rows ``j < t_b`` with
      ``j <= p_b + s`` (``causal=1``), and ``j > p_b + s - local_window_size`` when the window is
      positive.  Scores are ``scale * q.k`` (default ``1/sqrt(D)``), soft-capped as
      ``softcap * tanh(x / softcap)`` when ``softcap > 0``.  A row with no key gives zeros.
    * ``sliding_window_cache=1`` (Gemma 2/3's local layers from GenAI's builder): the past/present
      buffers are window-sized, of capacity ``C`` (axis 2 of past_key, at least the window ``W``),
      and the op evicts as ONNX Runtime's schema documents (Windowed KV Cache): with ``t_b`` the
      positions processed (``seqlens_k[b] + 1``), ``G = C - W + 1`` and ``L(t) = t`` up to ``C``,
      else ``t - G * ceil((t - C) / G)``, rows ``[0, L(p_b))`` of the past hold positions
      ``p_b - L(p_b) .. p_b - 1`` and rows ``[0, L(t_b))`` of the present hold ``t_b - L(t_b) ..
      t_b - 1`` (rows past ``L`` are unspecified in ORT, zero here). Any step length is accepted
      (``S > C`` too); ``total_sequence_length`` is only the batch's largest ``t_b`` (it may exceed
      ``C``). The resident range comes from device data (``seqlens_k``), so a captured step stays
      valid as the window moves. A buffer under the window (``C < W``) or none is refused; ORT's
      CUDA provider accepts only ``C == W`` (its CPU provider any ``C >= W``).
    * ``q_norm_weight``/``k_norm_weight`` (in ONNX Runtime 1.31.1's schema; Gemma 3 from GenAI's
      builder for CUDA): a per-head RMS norm of Q and K over the head size,
      ``x / sqrt(mean(x^2) + qk_norm_epsilon) * weight`` (epsilon defaults to 1e-6), before rotary,
      computed in float32 and stored in the input type -- what the builder's CPU graphs spell as
      Reshape -> SimplifiedLayerNormalization -> Reshape before the op, which is what
      ``tests/test_contrib_ops_export.py`` compares with.  ORT 1.31.1 honours the inputs on its
      CUDA and WebGPU providers only; its CPU provider refuses the node ("q_norm_weight /
      k_norm_weight inputs are not supported").  Both or neither, each of shape ``(head_size,)``.
    * Refused with ``node.error``: ``smooth_softmax=1``, quantised KV
      caches, ``qk_output``/``output_qk``, and the inputs position_ids, attention_bias, head_sink,
      k_scale, v_scale.
"""

from __future__ import annotations

import numpy as np

from ._contrib_util import assemble_cache, attention, dequantize_blocks, rotary, unpack_bits, work_dtype
from ._elementwise_util import erf
from ._latch import IndexCheck
from ._linalg import matmul
from ._op import OpKernel, Spec, const_memo, head_counts, normalize_axis

OPS: list[OpKernel] = []

_MS = "com.microsoft"
_STASH = {1: np.dtype(np.float32), 11: np.dtype(np.float64)}


def _cast(x, dtype):
    return x if x.dtype == dtype else x.astype(dtype)


def _specs(specs, n):
    return list(specs) + [None] * (n - len(specs))


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
    consts = (1, 2) if zp is None else (1, 2, 3)  # the weight's blocks, scales and zero points
    w = const_memo(xp, node, ("dequantized", np.dtype(work).name), consts,
                   lambda: dequantize_blocks(xp, b, scales, zp, n=N, k=K, bits=bits, block=bs, work=work))
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


# -- GroupQueryAttention -----------------------------------------------------------------------

_GQA_UNSUPPORTED_INPUTS = {9: "position_ids", 10: "attention_bias", 11: "head_sink", 12: "k_scale",
                           13: "v_scale"}


def _gqa_attrs(node):
    nq, nkv = head_counts(node, "num_heads", "kv_num_heads")
    smooth = int(node.attr("smooth_softmax", 0))
    if smooth not in (0, -1):
        raise node.error(f"smooth_softmax={smooth} is not supported (only 0)")
    for key in ("qk_output", "kv_cache_bit_width"):
        if int(node.attr(key, 0)):
            raise node.error(f"attribute {key}={node.attr(key)} is not supported")
    for key in ("k_quant_type", "v_quant_type"):
        if str(node.attr(key, "NONE")) != "NONE":
            raise node.error(f"attribute {key}={node.attr(key)!r} is not supported (quantised KV cache)")
    causal = int(node.attr("causal", 1))
    window = int(node.attr("local_window_size", -1))
    if causal not in (0, 1):
        raise node.error(f"causal={causal} must be 0 or 1")
    if not causal and window != -1:
        raise node.error(f"local_window_size={window} must be -1 when causal is 0")
    sliding = int(node.attr("sliding_window_cache", 0))
    if sliding not in (0, 1):
        raise node.error(f"sliding_window_cache={sliding} must be 0 or 1")
    if sliding and window < 1:
        raise node.error(f"sliding_window_cache=1 needs a positive local_window_size, got {window}")
    softcap = float(node.attr("softcap", 0.0))
    if softcap < 0:
        raise node.error(f"softcap={softcap} must be >= 0")
    return nq, nkv, causal, window, softcap, bool(sliding)


def _gqa_dims(node, specs):
    """(B, S, D, P, T, L, rotary_dim) from the input specs; T from the host value of input 6."""
    specs = _specs(specs, 16)
    nq, nkv, _causal, window, _softcap, sliding = _gqa_attrs(node)
    for i, name in _GQA_UNSUPPORTED_INPUTS.items():
        if specs[i] is not None:
            raise node.error(f"input {name} is not supported")
    if node.n_outputs > 3:
        raise node.error("output output_qk is not supported")
    q, k, v, pk, pv, seqlens, tsl, cos, sin = specs[:9]
    if q.rank != 3:
        raise node.error(f"query must be 3-D [B, S, hidden], got shape {q.shape}")
    B, S, hidden = q.shape
    if B < 1 or S < 1:  # ORT: "total_sequence_length must be positive" for an empty prompt
        raise node.error(f"query {list(q.shape)}: batch_size and sequence_length must be positive")
    if (k is None) != (v is None):
        raise node.error("key and value must both be present, or both absent (packed QKV)")
    heads = nq if k is not None else nq + 2 * nkv
    if hidden % heads:
        raise node.error(f"query hidden size {hidden} is not divisible by {heads} heads")
    D = hidden // heads
    if k is not None:
        for name, s in (("key", k), ("value", v)):
            if tuple(s.shape) != (B, S, nkv * D):
                raise node.error(f"{name} shape {s.shape} must be {(B, S, nkv * D)}")
    if (pk is None) != (pv is None):
        raise node.error("past_key and past_value must both be present or both absent")
    P = 0
    if pk is not None:
        if pk.rank != 4 or tuple(pk.shape[:2]) != (B, nkv) or pk.shape[3] != D:
            raise node.error(f"past_key shape {pk.shape} must be [{B}, {nkv}, past, {D}] (BNSH)")
        if tuple(pv.shape) != tuple(pk.shape):
            raise node.error(f"past_value shape {pv.shape} differs from past_key {pk.shape}")
        P = pk.shape[2]
    if tuple(seqlens.shape) != (B,) or np.dtype(seqlens.dtype) != np.int32:
        raise node.error(f"seqlens_k must be int32 [{B}], got {seqlens.dtype}{list(seqlens.shape)}")
    if tsl.value is None or tsl.value.size != 1:
        raise node.error("total_sequence_length must be a one-element int32 tensor")
    T = int(np.asarray(tsl.value).reshape(-1)[0])
    if T < 1:
        raise node.error(f"total_sequence_length must be positive, got {T}")
    if sliding:
        if pk is None or P < window:  # ORT: INVALID_ARGUMENT ("KV cache capacity (0) must be at least ...")
            raise node.error(f"sliding_window_cache=1: the KV cache capacity ({P}, axis 2 of past_key) must be at "
                             f"least local_window_size ({window})")
        L = P  # a window-sized buffer of capacity P, evicting (total_sequence_length may exceed it)
    elif T == P + S:
        L = T  # growing cache: present = past ++ new
    elif T <= P:
        L = P  # shared-buffer cache of capacity P
    else:
        raise node.error(f"total_sequence_length={T} must equal past_sequence_length + sequence_length "
                         f"({P} + {S}) for a growing cache, or be at most past_sequence_length for a static cache")
    if S > 1 and S != T and B != 1:
        raise node.error("batch_size must be 1 when sequence_length > 1 and past context is given")
    rd = 0
    if int(node.attr("do_rotary", 0)):
        if cos is None or sin is None:
            raise node.error("do_rotary=1 needs cos_cache and sin_cache")
        if cos.rank != 2 or tuple(sin.shape) != tuple(cos.shape):
            raise node.error(f"cos_cache {cos.shape} and sin_cache {sin.shape} must be the same 2-D shape")
        rd = 2 * cos.shape[1]
        if rd == 0 or rd > D:
            raise node.error(f"rotary dim 2 * {cos.shape[1]} must be in (0, head_size={D}]")
        if cos.shape[0] < T:
            raise node.error(f"cos_cache has {cos.shape[0]} positions, fewer than total_sequence_length={T}")
    elif (cos is None) != (sin is None):
        raise node.error("cos_cache and sin_cache must both be present or both absent")
    qn, kn = specs[14], specs[15]
    if (qn is None) != (kn is None):
        raise node.error("q_norm_weight and k_norm_weight must both be present or both absent")
    for name, s in (("q_norm_weight", qn), ("k_norm_weight", kn)):
        if s is not None and tuple(s.shape) != (D,):
            raise node.error(f"{name} must have shape ({D},) (head_size), got {s.shape}")
    return B, S, D, P, T, L, rd


def _gqa_shapes(node, specs):
    B, S, D, _P, _T, L, _rd = _gqa_dims(node, specs)
    nq, nkv = int(node.attr("num_heads")), int(node.attr("kv_num_heads"))
    dt = specs[0].dtype
    outs = [Spec((B, S, nq * D), dt), Spec((B, nkv, L, D), dt), Spec((B, nkv, L, D), dt)]
    return outs[:max(node.n_outputs, 1)]


def _gqa_workspace(node, specs):
    """The float64 scores (batch, heads, new tokens, cache length) with their softmax passes, and
    the cache repeated over the query heads."""
    B, S, D, _P, _T, L, _rd = _gqa_dims(node, specs)
    nq = int(node.attr("num_heads"))
    if int(node.attr("sliding_window_cache", 0)):
        L += S  # the resident rows and the step's keys side by side
    return (4 * B * nq * S * L + 4 * B * nq * L * D) * 8


def _heads(x, B, S, n, D):
    return x.reshape(B, S, n, D).transpose(0, 2, 1, 3)


def _head_rms_norm(xp, x, weight, eps, dt):
    """Per-head RMS norm over the head size of ``x`` [B, H, S, D] (work dtype), stored in ``dt``."""
    work = x.dtype
    inv = 1 / xp.sqrt(xp.mean(x * x, axis=-1, keepdims=True) + work.type(eps))  # as SimplifiedLayerNormalization
    y = x * inv * weight.astype(work)
    return y.astype(dt).astype(work) if dt != work else y


def _gqa_compute(xp, node, q, k, v, past_k, past_v, seqlens, tsl, cos=None, sin=None, position_ids=None,
                 attention_bias=None, head_sink=None, k_scale=None, v_scale=None, q_norm=None, k_norm=None):
    nq, nkv, causal, window, softcap, sliding = _gqa_attrs(node)
    B, S = q.shape[0], q.shape[1]
    D = q.shape[2] // (nq if k is not None else nq + 2 * nkv)
    P = past_k.shape[2] if past_k is not None else 0
    T = int(np.asarray(node.host[6]).reshape(-1)[0])
    L = T if T == P + S else P
    dt = np.dtype(q.dtype)
    work = work_dtype(dt)
    if k is None:  # packed QKV
        k = q[:, :, nq * D:(nq + nkv) * D]
        v = q[:, :, (nq + nkv) * D:]
        q = q[:, :, :nq * D]
    Q = _heads(q, B, S, nq, D).astype(work)
    K = _heads(k, B, S, nkv, D).astype(work)
    V = _heads(v, B, S, nkv, D).astype(work)
    if q_norm is not None:  # per-head RMS norm before rotary (q_norm_weight / k_norm_weight)
        eps = float(node.attr("qk_norm_epsilon", 1e-6))
        Q = _head_rms_norm(xp, Q, q_norm, eps, dt)
        K = _head_rms_norm(xp, K, k_norm, eps, dt)

    total = seqlens.astype(xp.int64) + 1  # t_b
    past_len = xp.zeros_like(total) if S == T else total - S  # p_b
    if int(node.attr("do_rotary", 0)):
        pos = past_len.reshape(B, 1) + xp.arange(S, dtype=xp.int64).reshape(1, S)
        pos = xp.clip(pos, 0, cos.shape[0] - 1)
        c = xp.take(cos.astype(work), pos, axis=0).reshape(B, 1, S, -1)
        s_ = xp.take(sin.astype(work), pos, axis=0).reshape(B, 1, S, -1)
        inter = bool(int(node.attr("rotary_interleaved", 0)))
        Q = rotary(xp, Q, c, s_, inter)
        K = rotary(xp, K, c, s_, inter)
        if dt != work:  # ORT stores the rotated Q and K in the input type
            Q = Q.astype(dt).astype(work)
            K = K.astype(dt).astype(work)

    i = past_len.reshape(B, 1, 1, 1) + xp.arange(S, dtype=xp.int64).reshape(1, 1, S, 1)
    scale = float(node.attr("scale", 0.0) or 0.0) or 1.0 / float(np.sqrt(D))
    if sliding:
        keys_k, keys_v, j, valid, present_k, present_v = _window_cache(
            xp, K, V, past_k.astype(work), past_v.astype(work), past_len, total, window)
        allowed = valid & (j < total.reshape(B, 1, 1, 1)) & (j <= i) & (j > i - window)
        out = attention(xp, Q, keys_k, keys_v, allowed, scale=scale, softcap=softcap)
    else:
        present_k = assemble_cache(xp, K, past_k.astype(work) if past_k is not None else None, past_len, L)
        present_v = assemble_cache(xp, V, past_v.astype(work) if past_v is not None else None, past_len, L)
        j = xp.arange(L, dtype=xp.int64).reshape(1, 1, 1, L)
        allowed = j < total.reshape(B, 1, 1, 1)
        if causal:
            allowed = allowed & (j <= i)
            if window > 0:
                allowed = allowed & (j > i - window)
        out = attention(xp, Q, present_k, present_v, allowed, scale=scale, softcap=softcap)
    out = out.transpose(0, 2, 1, 3).reshape(B, S, nq * D)
    specs = node.out_specs
    res = [_cast(out, specs[0].dtype)]
    if len(specs) > 1:
        res.append(_cast(present_k, specs[1].dtype))
    if len(specs) > 2:
        res.append(_cast(present_v, specs[2].dtype))
    return tuple(res)


def _resident(xp, t, capacity: int, window: int):
    """Rows a window-sized cache of ``capacity`` holds after ``t`` positions (int64 [B]): ``t`` up to
    the capacity, then ``t - G * ceil((t - C) / G)`` with ``G = C - W + 1`` (ORT's schema)."""
    g = capacity - window + 1
    over = xp.maximum(t - capacity, 0)
    return xp.where(t <= capacity, t, t - g * ((over + g - 1) // g))


def _window_cache(xp, K, V, past_k, past_v, past_len, total, window: int):
    """A step over a window-sized cache (``sliding_window_cache=1``): the keys the step may read,
    the resident past rows then the S new ones ([B, H, C + S, D]), their absolute positions and
    validity ([B, 1, 1, C + S]), and the present buffers ([B, H, C, D]: rows [0, L(t)) the most
    recent positions in order, zero beyond). Every index comes from device data (no read-back)."""
    B, H, S, D = K.shape
    C = past_k.shape[2]
    held = _resident(xp, past_len, C, window).reshape(B, 1)  # rows [0, held) hold p - held .. p - 1
    p = past_len.reshape(B, 1)
    j = xp.arange(C + S, dtype=xp.int64).reshape(1, C + S)
    key_pos = xp.where(j < C, p - held + j, p + j - C)
    valid = (j >= C) | (j < held)
    keys_k = xp.concatenate((past_k, K), axis=2)
    keys_v = xp.concatenate((past_v, V), axis=2)
    t = total.reshape(B, 1)
    keep = _resident(xp, total, C, window).reshape(B, 1)
    r = xp.arange(C, dtype=xp.int64).reshape(1, C)
    pos = t - keep + r  # the position present row r holds
    src = xp.clip(xp.where(pos >= p, C + pos - p, pos - p + held), 0, C + S - 1)
    idx = xp.broadcast_to(src.reshape(B, 1, C, 1), (B, H, C, D))
    filled = (r < keep).reshape(B, 1, C, 1)
    zero = K.dtype.type(0)
    present_k = xp.where(filled, xp.take_along_axis(keys_k, idx, axis=2), zero)
    present_v = xp.where(filled, xp.take_along_axis(keys_v, idx, axis=2), zero)
    return (keys_k, keys_v, key_pos.reshape(B, 1, 1, C + S), valid.reshape(B, 1, 1, C + S), present_k, present_v)


def _gqa_check(node, specs):
    """seqlens_k (checked into the error latch, as ORT refuses them): in [0, present length), at
    least S - 1 after the first prompt (no negative past), and with rotary then below the cache rows."""
    _B, S, _D, _P, T, L, rd = _gqa_dims(node, specs)
    if int(node.attr("sliding_window_cache", 0)):  # positions are absolute, the buffer holds a window of them
        return [IndexCheck(5, 0 if S == T else S - 1, min(T, specs[7].shape[0]) if rd else T)]
    if S == T:
        return [IndexCheck(5, 0, L)]
    return [IndexCheck(5, S - 1, min(L, specs[7].shape[0]) if rd else L)]


OPS.append(OpKernel("GroupQueryAttention", _gqa_shapes, _gqa_compute, domain=_MS, since=1, host_inputs=(6,),
                    optional=(1, 2, 3, 4),  # key/value empty: packed QKV; past_key/past_value empty: no past
                    index_checks=_gqa_check, workspace=_gqa_workspace, capture="safe"))
