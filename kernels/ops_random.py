"""Random ops: Bernoulli (opset 15), RandomUniformLike (opset 1).

The uniform draws are made on the host with numpy's ``RandomState`` (as Dropout's training mask and
ONNX's reference implementation draw theirs) and uploaded, so a seeded node gives the same values on
every run and on every device (the simulated one and CuPy alike); without ``seed`` each run draws
from fresh OS entropy. ``seed`` is a float attribute: its integer part modulo 2**32 seeds the
generator. Bernoulli's output is ``1`` where the draw ``u`` (uniform in [0, 1)) is below the input
probability ``p``, so ``P(1) = p``; RandomUniformLike scales the draws to ``[low, high)``. The draws
differ from those behind ONNX's expected outputs (its cases were recorded from another generator
state), so the node suite judges their cases by their distribution (conformance/node_suite/
random_cases.py); tests/test_random_ops.py checks the kernels. Host draws and an upload per run:
``capture="unsupported"``.
"""

from __future__ import annotations

import numpy as np

from ._op import OpKernel, Spec

__all__ = ["OPS"]

_FLOATS = ("float16", "float32", "float64", "bfloat16")


def _out_dtype(node, default):
    code = node.attr("dtype")
    if code is None:
        dt = default
    else:
        from onnx import helper  # host only: ONNX element type to numpy dtype

        dt = np.dtype(helper.tensor_dtype_to_np_dtype(int(code)))
    return dt


def _check_dtype(node):
    code = node.attr("dtype")
    if code is not None:
        from onnx import helper

        try:
            name = np.dtype(helper.tensor_dtype_to_np_dtype(int(code))).name
        except (KeyError, ValueError, TypeError):
            name = None
        if name not in _FLOATS and not (node.op_type == "Bernoulli" and name is not None and name != "object"):
            raise node.error(f"attribute dtype={code!r} is invalid: a float element type is expected "
                             "(FLOAT16, FLOAT, DOUBLE, BFLOAT16)")


def _draws(node, shape) -> np.ndarray:
    """Uniform float64 draws in [0, 1) of ``shape``, from ``seed`` if the node has one."""
    seed = node.attr("seed")
    rng = np.random.RandomState(None if seed is None else int(seed) % 2**32)
    return rng.random_sample(tuple(shape))


def _bernoulli_shapes(node, specs):
    x = specs[0]
    if x.dtype.kind != "f" and x.dtype.name != "bfloat16":
        raise node.error(f"input must be a float tensor of probabilities, got {x.dtype}")
    return [Spec(x.shape, _out_dtype(node, x.dtype))]


def _bernoulli(xp, node, x):
    u = xp.asarray(_draws(node, x.shape))
    return ((u < x.astype(xp.float64)).astype(node.out_specs[0].dtype),)


def _uniform_check(node):
    _check_dtype(node)
    low, high = float(node.attr("low", 0.0)), float(node.attr("high", 1.0))
    if not low <= high:
        raise node.error(f"attributes low={low}, high={high} are invalid: low must be <= high")


def _uniform_like_shapes(node, specs):
    x = specs[0]
    dt = _out_dtype(node, x.dtype)
    if dt.name not in _FLOATS:
        raise node.error(f"the output type {dt} (from the input, no dtype attribute) is not a float type")
    return [Spec(x.shape, dt)]


def _uniform_like(xp, node, x):
    low, high = float(node.attr("low", 0.0)), float(node.attr("high", 1.0))
    u = xp.asarray(_draws(node, x.shape))
    return ((low + (high - low) * u).astype(node.out_specs[0].dtype),)


OPS = [
    OpKernel("Bernoulli", _bernoulli_shapes, _bernoulli, since=15, check=_check_dtype,
             capture="unsupported", reason="draws on the host and uploads them each run"),
    OpKernel("RandomUniformLike", _uniform_like_shapes, _uniform_like, since=1, check=_uniform_check,
             capture="unsupported", reason="draws on the host and uploads them each run"),
]
