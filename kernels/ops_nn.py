"""nn ops: activations, softmax family, normalizations, Dropout.

Floating activations and normalizations compute in float32 (float64 for float64 inputs; float16 and
bfloat16 are promoted) and cast back to the output dtype. Every ``compute`` here uses only ``xp``
functions numpy and CuPy share and never reads device values on the host.
"""

from __future__ import annotations

import math

import numpy as np
from onnx import helper as _onnx_helper

from ._elementwise_util import erf
from ._fast import sigmoid_into
from ._fused import rms_norm_into
from ._nn_util import sigmoid, softplus, stash_dtype, to_work, work_dtype
from ._op import OpKernel, Spec, normalize_axis

OPS: list[OpKernel] = []

_F64 = np.dtype(np.float64)


def _is_int(dtype) -> bool:
    return np.dtype(dtype).kind in "iub"


def _same_spec(node, specs):
    return [Spec(specs[0].shape, specs[0].dtype)]


def _cast(y, dtype):
    return y if y.dtype == dtype else y.astype(dtype)


# ---------------------------------------------------------------------------------------------
# Elementwise activations: fn(xp, x, node) on the working float dtype (ints: see int_fn).

def _activation(op_type: str, fn, since: int, int_fn=None, into=None) -> OpKernel:
    def compute(xp, node, x):
        dt = node.out_specs[0].dtype
        if _is_int(x.dtype):
            if int_fn is None:
                raise node.error(f"integer input {x.dtype} is not supported")
            return (_cast(int_fn(xp, x, node), dt),)
        return (_cast(fn(xp, to_work(x), node), dt),)

    return OpKernel(op_type, _same_spec, compute, since=since, into=into, capture="safe")


def _sigmoid_into(xp, node, outs, x):
    """CuPy: one fused launch, the same float32/float64 operations as ``sigmoid`` (``_fast``)."""
    return sigmoid_into(xp, outs[0], x)


def _f(node, key, default) -> float:
    return float(node.attr(key, default))


def _relu_int(xp, x, node):
    return xp.maximum(x, x.dtype.type(0))


def _elu(xp, x, node):
    a = _f(node, "alpha", 1.0)
    return xp.where(x > 0, x, a * xp.expm1(xp.minimum(x, 0.0)))


def _selu(xp, x, node):
    a = _f(node, "alpha", 1.67326319217681884765625)
    g = _f(node, "gamma", 1.05070102214813232421875)
    return g * xp.where(x > 0, x, a * xp.expm1(xp.minimum(x, 0.0)))


def _celu(xp, x, node):
    a = _f(node, "alpha", 1.0)
    if a == 0:
        raise node.error("alpha must be non-zero")
    return xp.maximum(x, 0.0) + xp.minimum(0.0, a * xp.expm1(xp.minimum(x, 0.0) / a))


def _hard_sigmoid(xp, x, node):
    return xp.clip(_f(node, "alpha", 0.2) * x + _f(node, "beta", 0.5), 0.0, 1.0)


def _gelu(xp, x, node):
    mode = node.attr("approximate", "none")
    if mode == "tanh":
        c = math.sqrt(2.0 / math.pi)
        return 0.5 * x * (1.0 + xp.tanh(c * (x + 0.044715 * x * x * x)))
    if mode != "none":
        raise node.error(f"approximate must be 'none' or 'tanh', got {mode!r}")
    return 0.5 * x * (1.0 + erf(xp, x * (1.0 / math.sqrt(2.0))))


def _shrink(xp, x, node):
    lambd, bias = _f(node, "lambd", 0.5), _f(node, "bias", 0.0)
    return xp.where(x < -lambd, x + bias, xp.where(x > lambd, x - bias, 0.0))


def _shrink_int(xp, x, node):
    return _shrink(xp, x.astype(_F64), node)


for _op, _fn, _since, _int in (
    ("Relu", lambda xp, x, n: xp.maximum(x, 0.0), 1, _relu_int),
    ("LeakyRelu", lambda xp, x, n: xp.where(x > 0, x, x * _f(n, "alpha", 0.01)), 1, None),
    ("Elu", _elu, 1, None),
    ("Selu", _selu, 1, None),
    ("Celu", _celu, 12, None),
    ("Sigmoid", lambda xp, x, n: sigmoid(xp, x), 1, None),
    ("HardSigmoid", _hard_sigmoid, 1, None),
    ("HardSwish", lambda xp, x, n: x * xp.clip(x * (1.0 / 6.0) + 0.5, 0.0, 1.0), 14, None),
    ("Softplus", lambda xp, x, n: softplus(xp, x), 1, None),
    ("Softsign", lambda xp, x, n: x / (1.0 + xp.abs(x)), 1, None),
    ("Swish", lambda xp, x, n: x * sigmoid(xp, _f(n, "alpha", 1.0) * x), 24, None),
    ("Mish", lambda xp, x, n: x * xp.tanh(softplus(xp, x)), 18, None),
    ("Gelu", _gelu, 20, None),
    ("ThresholdedRelu", lambda xp, x, n: xp.where(x > _f(n, "alpha", 1.0), x, 0.0), 10, None),
    ("Shrink", _shrink, 9, _shrink_int),
):
    OPS.append(_activation(_op, _fn, _since, _int, _sigmoid_into if _op == "Sigmoid" else None))


# ---------------------------------------------------------------------------------------------
# PRelu, SwiGLU

def _prelu_shapes(node, specs):
    x, s = specs[0], specs[1]
    try:
        ok = tuple(np.broadcast_shapes(x.shape, s.shape)) == tuple(x.shape)
    except ValueError:
        ok = False
    legacy = node.opset < 7 and s.rank == 1 and x.rank >= 2 and s.shape[0] == x.shape[1]
    if not (ok or legacy):
        raise node.error(f"slope shape {s.shape} is not unidirectionally broadcastable to X shape {x.shape}")
    return [Spec(x.shape, x.dtype)]


def _prelu_compute(xp, node, x, slope):
    dt = node.out_specs[0].dtype
    if node.opset < 7 and slope.ndim == 1 and x.ndim >= 2 and slope.shape[0] == x.shape[1] and slope.shape[0] > 1:
        slope = slope.reshape((slope.shape[0],) + (1,) * (x.ndim - 2))  # pre-7: per-channel slope
    if not _is_int(x.dtype):
        x = to_work(x)
        slope = to_work(slope, x.dtype)
    return (_cast(xp.where(x < 0, x * slope, x), dt),)


OPS.append(OpKernel("PRelu", _prelu_shapes, _prelu_compute, capture="safe"))


def _swiglu_shapes(node, specs):
    a, b = specs[0], specs[1]
    if a.shape != b.shape:
        raise node.error(f"A {a.shape} and B {b.shape} must have identical shapes")
    return [Spec(a.shape, a.dtype)]


def _swiglu_compute(xp, node, a, b):
    alpha = _f(node, "alpha", 1.0)
    a = to_work(a)
    y = a * sigmoid(xp, alpha * a) * to_work(b, a.dtype)
    return (_cast(y, node.out_specs[0].dtype),)


OPS.append(OpKernel("SwiGLU", _swiglu_shapes, _swiglu_compute, since=28, capture="safe"))


# ---------------------------------------------------------------------------------------------
# Softmax, LogSoftmax, Hardmax. Before opset 13: X is coerced to 2-D [prod(d[:axis]), prod(d[axis:])]
# and the op runs along the flattened trailing block; from 13: along the single axis.

def _softmax(xp, x, axis):
    e = xp.exp(x - xp.max(x, axis=axis, keepdims=True))
    return e / xp.sum(e, axis=axis, keepdims=True)


def _log_softmax(xp, x, axis):
    d = x - xp.max(x, axis=axis, keepdims=True)
    return d - xp.log(xp.sum(xp.exp(d), axis=axis, keepdims=True))


def _hardmax(xp, x, axis):
    idx = xp.expand_dims(xp.argmax(x, axis=axis), axis)
    shape = [1] * x.ndim
    shape[axis] = x.shape[axis]
    ar = xp.arange(x.shape[axis]).reshape(tuple(shape))
    return (ar == idx).astype(x.dtype)


def _softmax_axis(node, rank: int) -> int:
    return normalize_axis(node, int(node.attr("axis", -1 if node.opset >= 13 else 1)), rank)


def _softmax_family(op_type: str, fn) -> OpKernel:
    def shapes(node, specs):
        x = specs[0]
        if x.rank == 0:
            raise node.error("input must have rank >= 1")
        _softmax_axis(node, x.rank)
        return [Spec(x.shape, x.dtype)]

    def compute(xp, node, x):
        dt = node.out_specs[0].dtype
        axis = _softmax_axis(node, x.ndim)
        if x.size == 0:
            return (x,)
        # float16 stays float16, as ONNX's reference computes it (exp rounds per element, sums
        # accumulate in float32 on both numpy and CuPy); matching it keeps fp16 attention cases
        # within their 1e-3 tolerance. bfloat16 (numpy only) is promoted to float32.
        xw = x if x.dtype == np.float16 else to_work(x)
        if node.opset >= 13:
            y = fn(xp, xw, axis)
        else:
            rows = int(np.prod(x.shape[:axis], dtype=np.int64))
            y = fn(xp, xw.reshape((rows, x.size // rows)), 1).reshape(x.shape)
        return (_cast(y, dt),)

    return OpKernel(op_type, shapes, compute, capture="safe")


OPS.append(_softmax_family("Softmax", _softmax))
OPS.append(_softmax_family("LogSoftmax", _log_softmax))
OPS.append(_softmax_family("Hardmax", _hardmax))


# ---------------------------------------------------------------------------------------------
# Normalizations

def _moments(xp, x, axes):
    mean = xp.mean(x, axis=axes, keepdims=True)
    d = x - mean
    return mean, d, xp.mean(d * d, axis=axes, keepdims=True)


def _check_bcast(node, name, spec, shape):
    if spec is None:
        return
    try:
        ok = tuple(np.broadcast_shapes(spec.shape, shape)) == tuple(shape)
    except ValueError:
        ok = False
    if not ok:
        raise node.error(f"{name} shape {spec.shape} does not broadcast to {tuple(shape)}")


def _stash_np_dtype(node, default=1) -> np.dtype:
    st = int(node.attr("stash_type", default))
    try:
        return np.dtype(_onnx_helper.tensor_dtype_to_np_dtype(st))
    except (KeyError, TypeError, ValueError):
        raise node.error(f"unsupported stash_type {st}") from None


def _layer_norm_shapes(node, specs):
    x = specs[0]
    axis = normalize_axis(node, int(node.attr("axis", -1)), x.rank)
    _check_bcast(node, "Scale", specs[1], x.shape)
    _check_bcast(node, "B", specs[2] if len(specs) > 2 else None, x.shape)
    red = tuple(x.shape[:axis]) + (1,) * (x.rank - axis)
    u = _stash_np_dtype(node)
    return [Spec(x.shape, x.dtype), Spec(red, u), Spec(red, u)][: max(node.n_outputs, 1)]


def _layer_norm_compute(xp, node, x, scale, b=None):
    axis = normalize_axis(node, int(node.attr("axis", -1)), x.ndim)
    wd = stash_dtype(node.attr("stash_type", 1), x.dtype)
    xw = to_work(x, wd)
    mean, d, var = _moments(xp, xw, tuple(range(axis, x.ndim)))
    inv = 1.0 / xp.sqrt(var + _f(node, "epsilon", 1e-5))
    y = d * inv * to_work(scale, wd)
    if b is not None:
        y = y + to_work(b, wd)
    return tuple(_cast(o, s.dtype) for o, s in zip((y, mean, inv), node.out_specs))


OPS.append(OpKernel("LayerNormalization", _layer_norm_shapes, _layer_norm_compute, since=17, capture="safe"))


def _rms_norm_shapes(node, specs):
    x = specs[0]
    normalize_axis(node, int(node.attr("axis", -1)), x.rank)
    _check_bcast(node, "scale", specs[1], x.shape)
    return [Spec(x.shape, x.dtype)]


def _rms_norm_compute(xp, node, x, scale):
    axis = normalize_axis(node, int(node.attr("axis", -1)), x.ndim)
    wd = stash_dtype(node.attr("stash_type", 1), x.dtype)
    xw = to_work(x, wd)
    ms = xp.mean(xw * xw, axis=tuple(range(axis, x.ndim)), keepdims=True)
    y = xw * (1.0 / xp.sqrt(ms + _f(node, "epsilon", 1e-5))) * to_work(scale, wd)
    return (_cast(y, node.out_specs[0].dtype),)


def _rms_norm_into(xp, node, outs, x, scale):
    """CuPy: one fused launch for float32 work (``_fused.rms_norm_into``; its sum of squares is
    ordered differently from CuPy's mean: last-bit float32 differences)."""
    if stash_dtype(node.attr("stash_type", 1), x.dtype) != np.float32:
        return False
    axis = normalize_axis(node, int(node.attr("axis", -1)), x.ndim)
    return rms_norm_into(xp, outs[0], x, scale, axis, _f(node, "epsilon", 1e-5))


OPS.append(OpKernel("RMSNormalization", _rms_norm_shapes, _rms_norm_compute, since=23, into=_rms_norm_into, capture="safe"))


def _channel(p, rank: int):
    """A per-channel parameter (C,) shaped to broadcast against (N, C, D1, ...)."""
    return p.reshape((-1,) + (1,) * (rank - 2))


def _param_dtype(*arrays) -> np.dtype:
    return _F64 if any(a is not None and a.dtype == _F64 for a in arrays) else work_dtype(arrays[0].dtype)


def _channel_params_check(node, specs, names, want: int, what: str = "C"):
    for i, name in enumerate(names, start=1):
        s = specs[i] if i < len(specs) else None
        if s is not None and (s.rank != 1 or s.shape[0] != want):
            raise node.error(f"{name} must have shape ({want},) ({what}), got {s.shape}")


def _instance_norm_shapes(node, specs):
    x = specs[0]
    if x.rank < 2:
        raise node.error(f"input must have rank >= 2 (N, C, ...), got shape {x.shape}")
    _channel_params_check(node, specs, ("scale", "B"), x.shape[1])
    return [Spec(x.shape, x.dtype)]


def _instance_norm_compute(xp, node, x, scale, b):
    wd = _param_dtype(x, scale, b)
    xw = to_work(x, wd)
    _, d, var = _moments(xp, xw, tuple(range(2, x.ndim)))
    y = d / xp.sqrt(var + _f(node, "epsilon", 1e-5))
    y = y * _channel(to_work(scale, wd), x.ndim) + _channel(to_work(b, wd), x.ndim)
    return (_cast(y, node.out_specs[0].dtype),)


OPS.append(OpKernel("InstanceNormalization", _instance_norm_shapes, _instance_norm_compute, capture="safe"))


def _group_norm_shapes(node, specs):
    x = specs[0]
    g = node.attr("num_groups")
    if g is None:
        raise node.error("attribute num_groups is required")
    if x.rank < 2:
        raise node.error(f"input must have rank >= 2 (N, C, ...), got shape {x.shape}")
    c = x.shape[1]
    if int(g) <= 0 or c % int(g):
        raise node.error(f"num_groups {g} must be positive and divide the channel count {c}")
    if node.opset >= 21:
        _channel_params_check(node, specs, ("scale", "bias"), c)
    else:
        _channel_params_check(node, specs, ("scale", "bias"), int(g), "num_groups")
    return [Spec(x.shape, x.dtype)]


def _group_norm_compute(xp, node, x, scale, b):
    g = int(node.attr("num_groups"))
    n, c = x.shape[0], x.shape[1]
    if node.opset >= 21:
        wd = stash_dtype(node.attr("stash_type", 1), x.dtype)
    else:
        wd = _param_dtype(x, scale, b)
    xg = to_work(x, wd).reshape((n, g, (c // g) * int(np.prod(x.shape[2:], dtype=np.int64))))  # no -1: n may be 0
    _, d, var = _moments(xp, xg, (2,))
    y = (d / xp.sqrt(var + _f(node, "epsilon", 1e-5))).reshape(x.shape)
    pd = work_dtype(node.out_specs[0].dtype) if wd != _F64 else wd
    y = to_work(y, pd)
    scale, b = to_work(scale, pd), to_work(b, pd)
    if node.opset < 21:  # per-group parameters: every channel of a group shares its group's value
        scale, b = xp.repeat(scale, c // g), xp.repeat(b, c // g)
    y = y * _channel(scale, x.ndim) + _channel(b, x.ndim)
    return (_cast(y, node.out_specs[0].dtype),)


OPS.append(OpKernel("GroupNormalization", _group_norm_shapes, _group_norm_compute, since=18, capture="safe"))


def _lp_norm_shapes(node, specs):
    x = specs[0]
    normalize_axis(node, int(node.attr("axis", -1)), x.rank)
    if int(node.attr("p", 2)) not in (1, 2):
        raise node.error(f"p must be 1 or 2, got {node.attr('p')}")
    return [Spec(x.shape, x.dtype)]


def _lp_norm_compute(xp, node, x):
    axis = normalize_axis(node, int(node.attr("axis", -1)), x.ndim)
    xw = to_work(x)
    if int(node.attr("p", 2)) == 1:
        norm = xp.sum(xp.abs(xw), axis=axis, keepdims=True)
    else:
        norm = xp.sqrt(xp.sum(xw * xw, axis=axis, keepdims=True))
    # A zero norm means the whole slice is zero: divide by 1 there, which gives the defined 0.
    y = xw / xp.where(norm == 0, 1.0, norm).astype(xw.dtype)
    return (_cast(y, node.out_specs[0].dtype),)


OPS.append(OpKernel("LpNormalization", _lp_norm_shapes, _lp_norm_compute, capture="safe"))


def _mvn_axes(node, rank: int) -> tuple[int, ...]:
    axes = node.attr("axes", [0, 2, 3])
    return tuple(sorted({normalize_axis(node, int(a), rank) for a in axes}))


def _mvn_shapes(node, specs):
    _mvn_axes(node, specs[0].rank)
    return [Spec(specs[0].shape, specs[0].dtype)]


def _mvn_compute(xp, node, x):
    xw = to_work(x)
    _, d, var = _moments(xp, xw, _mvn_axes(node, x.ndim))
    y = d / (xp.sqrt(var) + 1e-9)
    return (_cast(y, node.out_specs[0].dtype),)


OPS.append(OpKernel("MeanVarianceNormalization", _mvn_shapes, _mvn_compute, since=9, capture="safe"))


# ---------------------------------------------------------------------------------------------
# BatchNormalization. Inference: y = (x - mean) / sqrt(var + eps) * scale + bias, per channel.
# Training (opset >= 14: training_mode=1; before: when the optional statistics outputs are
# requested) normalizes with the batch statistics and returns the updated running statistics.

def _bn_training(node) -> bool:
    if node.opset >= 14:
        return bool(node.attr("training_mode", 0))
    return node.n_outputs > 1


def _bn_spatial(node) -> bool:
    return node.opset >= 9 or bool(node.attr("spatial", 1))


def _bn_shapes(node, specs):
    x = specs[0]
    if x.rank < 2:
        raise node.error(f"input must have rank >= 2 (N, C, ...), got shape {x.shape}")
    c = x.shape[1]
    for i, name in enumerate(("scale", "B", "input_mean", "input_var"), start=1):
        s = specs[i]
        ok = s.shape == (c,) or (not _bn_spatial(node) and tuple(s.shape) == tuple(x.shape[1:]))
        if not ok:
            raise node.error(f"{name} must have shape ({c},), got {s.shape}")
    outs = [Spec(x.shape, x.dtype)]
    if _bn_training(node):
        if not _bn_spatial(node):
            raise node.error("training mode with spatial=0 is not supported")
        if node.opset >= 14:
            outs += [Spec(specs[3].shape, specs[3].dtype), Spec(specs[4].shape, specs[4].dtype)]
        else:
            outs += [Spec((c,), x.dtype)] * 4
    return outs[: max(node.n_outputs, 1)]


def _bn_compute(xp, node, x, scale, b, mean, var):
    wd = _param_dtype(x, scale, b, mean, var)
    eps = _f(node, "epsilon", 1e-5)
    rank = x.ndim
    xw = to_work(x, wd)
    scale, b, mean, var = (to_work(p, wd) for p in (scale, b, mean, var))
    specs = node.out_specs

    def shaped(p):
        return _channel(p, rank) if p.ndim == 1 else p

    if not _bn_training(node):
        y = (xw - shaped(mean)) * (shaped(scale) / xp.sqrt(shaped(var) + eps)) + shaped(b)
        return (_cast(y, specs[0].dtype),)
    axes = (0,) + tuple(range(2, rank))
    bmean, d, bvar = _moments(xp, xw, axes)
    y = d * (shaped(scale) / xp.sqrt(bvar + eps)) + shaped(b)
    bmean, bvar = bmean.reshape(-1), bvar.reshape(-1)
    mom = _f(node, "momentum", 0.9)
    run_mean = mean * mom + bmean * (1.0 - mom)
    run_var = var * mom + bvar * (1.0 - mom)
    outs = [y, run_mean, run_var, bmean, bvar][: len(specs)]
    return tuple(_cast(o, s.dtype) for o, s in zip(outs, specs))


OPS.append(OpKernel("BatchNormalization", _bn_shapes, _bn_compute, capture="safe"))


# ---------------------------------------------------------------------------------------------
# Dropout. Inference: identity, mask all True (ones in X's dtype before opset 10). Opset >= 12
# training (the training_mode input true): the uniform draws come from numpy's RandomState(seed) on
# the host (as ONNX's reference does, so seeded cases reproduce) and are uploaded; the ratio stays
# on the device, so only training_mode is a host input.

def _dropout_shapes(node, specs):
    x = specs[0]
    outs = [Spec(x.shape, x.dtype)]
    if node.n_outputs > 1:
        outs.append(Spec(x.shape, np.dtype(bool) if node.opset >= 10 else x.dtype))
    return outs


def _dropout_identity(xp, node, x, *_):
    specs = node.out_specs
    if len(specs) > 1:
        return (x, xp.ones(x.shape, dtype=specs[1].dtype))
    return (x,)


def _scalar(spec) -> bool:
    return int(np.prod(spec.shape, dtype=np.int64)) == 1


def _dropout12_shapes(node, specs):
    for i, name in ((1, "ratio"), (2, "training_mode")):
        s = specs[i] if i < len(specs) else None
        if s is not None and not _scalar(s):
            raise node.error(f"{name} must be a scalar, got shape {s.shape}")
    r = specs[1] if len(specs) > 1 else None
    if r is not None and r.value is not None:
        ratio = float(np.asarray(r.value).reshape(-1)[0])
        if not 0.0 <= ratio < 1.0:
            raise node.error(f"ratio must be in [0, 1), got {ratio}")
    return _dropout_shapes(node, specs)


def _dropout12_compute(xp, node, x, ratio=None, training_mode=None):
    t = node.host.get(2)
    if t is None or not bool(np.asarray(t).reshape(-1)[0]):
        return _dropout_identity(xp, node, x)
    xw = to_work(x)
    r = xw.dtype.type(0.5) if ratio is None else to_work(ratio, xw.dtype).reshape(())
    seed = node.attr("seed")
    # host-side, from attributes; any int64 seed is legal ONNX, RandomState takes 32 bits
    rng = np.random.RandomState(None if seed is None else int(seed) % 2**32)
    keep = xp.asarray(rng.uniform(0.0, 1.0, tuple(x.shape))) >= r
    y = keep.astype(xw.dtype) * xw * (1.0 / (1.0 - r))
    out = [_cast(y, node.out_specs[0].dtype)]
    if len(node.out_specs) > 1:
        out.append(keep)
    return tuple(out)


OPS.append(OpKernel("Dropout", _dropout_shapes, _dropout_identity, since=1, until=11, capture="safe"))
def _dropout_inference(node, specs):
    """Capturable only in inference mode: training draws its mask on the host and uploads it."""
    mode = specs[2] if len(specs) > 2 else None
    return mode is None or (mode.value is not None and not bool(mode.value))


OPS.append(OpKernel("Dropout", _dropout12_shapes, _dropout12_compute, since=12, host_inputs=(2,),
                    capture="conditional", reason="training mode uploads a host-drawn mask",
                    capture_ok=_dropout_inference))
