"""Attribute validation at load: ``validate(kernel, info)`` runs once per node when the executor
builds its steps, before anything executes, and raises ``OpError`` naming the node, the attribute
and what is allowed.

Three layers, in order:

- the operator's ONNX schema (``onnx.defs``, for the model's opset; com.microsoft ops have none):
  required attributes present;
- the tables below, for what a schema cannot say: enumerations (string modes, 0/1 flags), integer
  ranges, attribute lists (kernel_shape/strides/dilations positive, pads non-negative, lengths that
  agree), ONNX element types (``to``, ``dtype``, ``output_dtype``);
- the kernel's own ``OpKernel.check(info)``, for the rest.

Before them, the node's arity against the kernel's body: a node with fewer inputs than its
``compute`` (or host body) takes positionally without a default, or one of those left empty ("")
unless the kernel lists it in ``OpKernel.optional``, is refused (``OpError`` naming the input),
since the call would fail inside the kernel (a ``TypeError``, or an ``AttributeError`` on None);
ONNX's checker counts inputs for ai.onnx ops, but com.microsoft ops have no schema in onnx.

Checks that need input ranks or values (an axis against a rank, Resize scales) stay in the
kernel's ``shapes()``, which raises ``OpError`` too.
"""

from __future__ import annotations

import inspect
import math
from typing import Any

import numpy as np

from ._op import NodeInfo, OpError

__all__ = ["validate"]

_CONV = ("Conv", "ConvTranspose", "ConvInteger", "QLinearConv", "DeformConv")
_POOL = ("AveragePool", "MaxPool", "LpPool", "MaxRoiPool")
_AUTO_PAD = ("NOTSET", "SAME_UPPER", "SAME_LOWER", "VALID")
_REDUCTION = ("none", "add", "mul", "max", "min")

# op type -> attribute -> allowed values (strings or ints); the attribute may be absent.
ENUMS: dict[str, dict[str, tuple[Any, ...]]] = {
    "Resize": {"mode": ("nearest", "linear", "cubic"),
               "coordinate_transformation_mode": ("half_pixel", "half_pixel_symmetric", "pytorch_half_pixel",
                                                  "align_corners", "asymmetric", "tf_crop_and_resize",
                                                  "tf_half_pixel_for_nn"),
               "nearest_mode": ("round_prefer_floor", "round_prefer_ceil", "floor", "ceil"),
               "keep_aspect_ratio_policy": ("stretch", "not_larger", "not_smaller"),
               "exclude_outside": (0, 1), "antialias": (0, 1)},
    "Upsample": {"mode": ("nearest", "linear")},
    "GridSample": {"mode": ("bilinear", "nearest", "bicubic", "linear", "cubic"),
                   "padding_mode": ("zeros", "border", "reflection"), "align_corners": (0, 1)},
    "AffineGrid": {"align_corners": (0, 1)},
    "Pad": {"mode": ("constant", "reflect", "edge", "wrap")},
    "Gelu": {"approximate": ("none", "tanh")},
    "DepthToSpace": {"mode": ("DCR", "CRD")},
    "ScatterElements": {"reduction": _REDUCTION},
    "ScatterND": {"reduction": _REDUCTION},
    "TensorScatter": {"mode": ("linear", "circular")},
    "RNN": {"direction": ("forward", "reverse", "bidirectional"), "layout": (0, 1)},
    "GRU": {"direction": ("forward", "reverse", "bidirectional"), "layout": (0, 1),
            "linear_before_reset": (0, 1)},
    "LSTM": {"direction": ("forward", "reverse", "bidirectional"), "layout": (0, 1), "input_forget": (0, 1)},
    "RoiAlign": {"mode": ("avg", "max"), "coordinate_transformation_mode": ("half_pixel", "output_half_pixel")},
    "Gemm": {"transA": (0, 1), "transB": (0, 1)},
    "TopK": {"largest": (0, 1), "sorted": (0, 1)},
    "CumSum": {"exclusive": (0, 1), "reverse": (0, 1)},
    "ArgMax": {"keepdims": (0, 1), "select_last_index": (0, 1)},
    "ArgMin": {"keepdims": (0, 1), "select_last_index": (0, 1)},
    "Trilu": {"upper": (0, 1)},
    "Mod": {"fmod": (0, 1)},
    "LpNormalization": {"p": (1, 2)},
    "DFT": {"inverse": (0, 1), "onesided": (0, 1)},
    "STFT": {"onesided": (0, 1)},
    "NonMaxSuppression": {"center_point_box": (0, 1)},
    "Unique": {"sorted": (0, 1)},
    "Attention": {"is_causal": (0, 1), "qk_matmul_output_mode": (0, 1, 2, 3),
                  "softmax_precision": (1, 10, 11, 16)},  # float, float16, double, bfloat16
    "BatchNormalization": {"training_mode": (0, 1)},
    "CastLike": {"saturate": (0, 1)},
    "CumProd": {"exclusive": (0, 1), "reverse": (0, 1)},
    "IsInf": {"detect_negative": (0, 1), "detect_positive": (0, 1)},
    "Reshape": {"allowzero": (0, 1)},
    "BlackmanWindow": {"periodic": (0, 1)},
    "HammingWindow": {"periodic": (0, 1)},
    "HannWindow": {"periodic": (0, 1)},
    "RotaryEmbedding": {"interleaved": (0, 1)},
    "MaxPool": {"storage_order": (0, 1), "ceil_mode": (0, 1)},
    "AveragePool": {"count_include_pad": (0, 1), "ceil_mode": (0, 1)},
    "LpPool": {"ceil_mode": (0, 1)},
    "QuantizeLinear": {"saturate": (0, 1)},
    "Cast": {"saturate": (0, 1)},
    "MatMulNBits": {"bits": (2, 4, 8)},
    **{op: {"auto_pad": _AUTO_PAD} for op in _CONV},
}
for _reduce in ("ReduceSum", "ReduceMean", "ReduceMax", "ReduceMin", "ReduceProd", "ReduceL1", "ReduceL2",
                "ReduceLogSum", "ReduceLogSumExp", "ReduceSumSquare"):
    ENUMS[_reduce] = {"keepdims": (0, 1), "noop_with_empty_axes": (0, 1)}
for _op in ("MaxPool", "AveragePool", "LpPool"):
    ENUMS[_op] = {**ENUMS[_op], "auto_pad": _AUTO_PAD}

# op type -> attribute -> (lowest, highest) allowed integer, either end None for open.
RANGES: dict[str, dict[str, tuple[int | None, int | None]]] = {
    "Attention": {"left_window_size": (-1, None), "right_window_size": (-1, None)},
    "LpPool": {"p": (1, None)},
    "LRN": {"size": (1, None)},
    "DepthToSpace": {"blocksize": (1, None)},
    "SpaceToDepth": {"blocksize": (1, None)},
    "Split": {"num_outputs": (1, None)},
    "MatMulNBits": {"K": (1, None), "N": (1, None), "block_size": (16, None), "accuracy_level": (0, 4)},
    "GroupNormalization": {"num_groups": (1, None)},
    "RotaryEmbedding": {"num_heads": (0, None), "rotary_embedding_dim": (0, None)},
    "RNN": {"hidden_size": (1, None)},
    "GRU": {"hidden_size": (1, None)},
    "LSTM": {"hidden_size": (1, None)},
    "RoiAlign": {"output_height": (1, None), "output_width": (1, None), "sampling_ratio": (0, None)},
    **{op: {"group": (1, None)} for op in _CONV},
}

# op type -> attributes holding an ONNX element type (0 allowed where it means "not given").
DTYPES: dict[str, tuple[tuple[str, bool], ...]] = {
    "Cast": (("to", False),),
    "EyeLike": (("dtype", False),),
    "RandomNormal": (("dtype", False),),
    "RandomUniform": (("dtype", False),),
    "RandomNormalLike": (("dtype", False),),
    "RandomUniformLike": (("dtype", False),),
    "Multinomial": (("dtype", False),),
    "Bernoulli": (("dtype", False),),
    "QuantizeLinear": (("output_dtype", True),),
    "DequantizeLinear": (("output_dtype", True),),
}

# Float attributes that must be finite (a NaN or inf there is never meaningful).
FINITE: dict[str, tuple[str, ...]] = {
    "Resize": ("cubic_coeff_a", "extrapolation_value"),
    "LRN": ("alpha", "beta", "bias"),
    "RandomNormal": ("mean", "scale", "seed"),
    "RandomUniform": ("low", "high", "seed"),
    "RandomNormalLike": ("mean", "scale", "seed"),
    "RandomUniformLike": ("low", "high", "seed"),
    "Multinomial": ("seed",),
    "Bernoulli": ("seed",),
}

_SPATIAL = ("kernel_shape", "strides", "dilations", "pads", "output_padding", "output_shape")


def _fail(info: NodeInfo, attr: str, value: Any, allowed: str) -> OpError:
    return info.error(f"attribute {attr}={value!r} is invalid: {allowed}")


# (op_type, opset, domain) -> the names of the schema's required attributes (() without a schema).
# onnx's schemas are a fixed table of the installed onnx; looking one up and building its attribute
# map costs ~6 us, once per node of every model without this.
_REQUIRED: dict[tuple[str, int, str], tuple[str, ...]] = {}


def _required_attributes(op_type: str, opset: int, domain: str) -> tuple[str, ...]:
    key = (op_type, opset, domain)
    names = _REQUIRED.get(key)
    if names is None:
        import onnx.defs

        try:
            schema = onnx.defs.get_schema(op_type, opset, domain)
        except onnx.defs.SchemaError:  # no schema (contrib domain, or an op newer than onnx): the tables still apply
            names = ()
        else:
            names = tuple(name for name, a in schema.attributes.items() if a.required)
        _REQUIRED[key] = names
    return names


def _schema_required(info: NodeInfo) -> None:
    for name in _required_attributes(info.op_type, info.opset, info.domain):
        if name not in info.attrs:
            raise info.error(f"required attribute {name} is missing")


def _as_int(info: NodeInfo, attr: str, v: Any) -> int:
    if isinstance(v, (bool, np.bool_)) or not isinstance(v, (int, np.integer)):
        raise _fail(info, attr, v, "an integer is expected")
    return int(v)


def _dtype_ok(to: Any) -> bool:
    from onnx import TensorProto, helper

    if isinstance(to, str):  # opset-1 Cast spells the type as a name
        to = TensorProto.DataType.Value(to.upper()) if to.upper() in TensorProto.DataType.keys() else -1  # noqa: SIM118
    if not isinstance(to, (int, np.integer)) or to == TensorProto.STRING:
        return False
    try:
        np.dtype(helper.tensor_dtype_to_np_dtype(int(to)))
    except (KeyError, ValueError, TypeError):
        return False
    return True


def _spatial(info: NodeInfo) -> None:
    """kernel_shape/strides/dilations positive, pads non-negative, lengths agreeing."""
    a = info.attrs
    ks = a.get("kernel_shape")
    n = len(ks) if isinstance(ks, list) and ks else None  # conv: taken from the weights when absent
    if info.op_type in (*_POOL, "MaxUnpool") and info.op_type != "MaxRoiPool" and not ks:
        raise info.error("required attribute kernel_shape is missing or empty")
    for name in _SPATIAL:
        v = a.get(name)
        if v is None or (isinstance(v, list) and not v):
            continue  # absent or empty: the default (as ONNX Runtime reads an empty list)
        if not isinstance(v, list):
            raise _fail(info, name, v, "a list of integers is expected")
        vals = [_as_int(info, name, x) for x in v]
        lo = 0 if name in ("pads", "output_padding") else 1
        if any(x < lo for x in vals):
            raise _fail(info, name, vals, f"every entry must be >= {lo}")
        if n is not None and name != "output_shape":
            want = 2 * n if name == "pads" else n
            if len(vals) != want:
                raise _fail(info, name, vals, f"{want} entries expected (kernel_shape has {n})")


# The tables name ai.onnx operators, plus these of com.microsoft (whose names ai.onnx does not use).
_CONTRIB_TABLED = ("MatMulNBits",)


_ARITY: dict[Any, tuple[str, ...]] = {}  # a kernel body -> the input parameters it requires


def _required_inputs(body: Any) -> tuple[str, ...]:
    """The positional parameters without a default that ``body(xp_or_ctx, node, *inputs)`` takes
    after its first two (the inputs every call must pass); () when its signature cannot be read."""
    got = _ARITY.get(body)
    if got is None:
        try:
            params = list(inspect.signature(body).parameters.values())[2:]
        except (TypeError, ValueError):
            params = []
        got = _ARITY[body] = tuple(p.name for p in params if p.default is p.empty
                                   and p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD))
    return got


def _arity(kernel: Any, info: NodeInfo, empty: tuple[int, ...] = ()) -> None:
    body = getattr(kernel, "host", None) or getattr(kernel, "compute", None)
    if body is None:
        return
    need = _required_inputs(body)
    if info.n_inputs < len(need):
        missing = ", ".join(need[info.n_inputs:])
        raise info.error(f"{info.n_inputs} input(s) given, {len(need)} required ({', '.join(need)}): "
                         f"missing {missing}")
    optional = getattr(kernel, "optional", ())
    for i in empty:
        if i < len(need) and i not in optional:
            raise info.error(f"input {i} ({need[i]}) is empty (\"\"), but the operator requires it")


def validate(kernel: Any, info: NodeInfo, empty: tuple[int, ...] = ()) -> None:
    """All load-time checks of one node (arity: ``empty`` lists the inputs the node leaves empty;
    then attributes); raises ``OpError``."""
    if kernel is not None:
        _arity(kernel, info, empty)
    _schema_required(info)
    op = info.op_type if info.domain in ("", "ai.onnx") or info.op_type in _CONTRIB_TABLED else None
    for attr, allowed in ENUMS.get(op, {}).items():
        if attr in info.attrs and info.attrs[attr] not in allowed:
            raise _fail(info, attr, info.attrs[attr], f"allowed: {', '.join(map(repr, allowed))}")
    for attr, (lo, hi) in RANGES.get(op, {}).items():
        if attr in info.attrs:
            v = _as_int(info, attr, info.attrs[attr])
            if (lo is not None and v < lo) or (hi is not None and v > hi):
                rng = f"[{'-inf' if lo is None else lo}, {'inf' if hi is None else hi}]"
                raise _fail(info, attr, v, f"must lie in {rng}")
    for attr, zero_ok in DTYPES.get(op, ()):
        v = info.attrs.get(attr)
        if v is not None and not (zero_ok and v == 0) and not _dtype_ok(v):
            raise _fail(info, attr, v, "an ONNX tensor element type this runtime holds (not STRING or UNDEFINED)")
    for attr in FINITE.get(op, ()):
        v = info.attrs.get(attr)
        if isinstance(v, float) and not math.isfinite(v):
            raise _fail(info, attr, v, "a finite number is expected")
    if op in (*_CONV, *_POOL, "MaxUnpool", "Col2Im"):
        _spatial(info)
    if kernel is not None and getattr(kernel, "check", None) is not None:
        kernel.check(info)
