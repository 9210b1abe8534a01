"""Bernoulli and RandomUniformLike (kernels/ops_random.py). ONNX's six test_bernoulli* cases cannot
match exactly (their expected values come from another generator state), so this checks what can be
checked: values in {0, 1} (or in [low, high)), the mean near p over a large draw, a seeded node
reproducible run after run and between executors, unseeded runs differing, output dtypes, and bad
attributes refused at load naming the node."""

from __future__ import annotations

import numpy as np
import pytest
from lockstep.kernels._op import OpError
from lockstep.reference_runtime import Runtime, RuntimeConfig
from lockstep.reference_runtime.backends.sim import SimDevice
from lockstep.reference_runtime.executor import Executor
from onnx import TensorProto, helper

F, D = TensorProto.FLOAT, TensorProto.DOUBLE
N = 200_000


def _model(op, out_type=F, in_type=F, **attrs):
    node = helper.make_node(op, ["x"], ["y"], name="rnd", **attrs)
    g = helper.make_graph([node], "g", [helper.make_tensor_value_info("x", in_type, [None])],
                          [helper.make_tensor_value_info("y", out_type, [None])])
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", 22)], ir_version=10)


def _executor(model):
    return Executor(model, Runtime(SimDevice(), RuntimeConfig()))


def test_bernoulli_values_are_0_or_1_with_mean_p():
    p = np.array([0.0, 0.2, 0.7, 1.0], np.float32)
    x = np.repeat(p, N // 4)
    y = _executor(_model("Bernoulli", seed=7.0)).run({"x": x})["y"]
    assert y.dtype == np.float32 and set(np.unique(y).tolist()) <= {0.0, 1.0}, "result: values in {0, 1}"
    means = y.reshape(4, -1).mean(axis=1)
    assert means[0] == 0.0 and means[3] == 1.0, "result: p = 0 never and p = 1 always gives 1"
    # 50,000 draws each: the standard error is <= 0.0023; 0.01 is over four of them
    np.testing.assert_allclose(means[1:3], [0.2, 0.7], atol=0.01, err_msg="result: P(1) = p")


def test_bernoulli_seeded_is_reproducible_and_unseeded_is_not():
    x = np.full(1000, 0.5, np.float64)
    seeded = _model("Bernoulli", out_type=D, in_type=D, seed=3.0)
    ex = _executor(seeded)
    first = ex.run({"x": x})["y"]
    np.testing.assert_array_equal(ex.run({"x": x})["y"], first, err_msg="result: the same seed, the same draws")
    np.testing.assert_array_equal(_executor(seeded).run({"x": x})["y"], first, err_msg="result: and in a new executor")
    other = _executor(_model("Bernoulli", out_type=D, in_type=D, seed=4.0)).run({"x": x})["y"]
    assert (other != first).any(), "result: another seed, other draws"
    free = _executor(_model("Bernoulli", out_type=D, in_type=D))
    assert (free.run({"x": x})["y"] != free.run({"x": x})["y"]).any(), "result: unseeded runs draw afresh"


def test_bernoulli_dtype_attribute_sets_the_output_type():
    model = _model("Bernoulli", out_type=TensorProto.INT32, dtype=TensorProto.INT32, seed=1.0)
    y = _executor(model).run({"x": np.full(64, 0.5, np.float32)})["y"]
    assert y.dtype == np.int32 and set(np.unique(y).tolist()) <= {0, 1}, "result: int32 zeros and ones"


def test_random_uniform_like_range_mean_and_dtype():
    model = _model("RandomUniformLike", out_type=D, low=-2.0, high=6.0, seed=11.0, dtype=D)
    y = _executor(model).run({"x": np.zeros(N, np.float32)})["y"]
    assert y.dtype == np.float64 and y.shape == (N,), "result: the dtype attribute, the input's shape"
    assert y.min() >= -2.0 and y.max() < 6.0, "result: in [low, high)"
    # uniform on [-2, 6): mean 2, standard deviation 8/sqrt(12); the mean's standard error is 0.005
    assert abs(y.mean() - 2.0) < 0.03, "result: mean (low + high) / 2"


def test_random_uniform_like_low_above_high_is_an_op_error_at_load():
    with pytest.raises(OpError, match=r"node 'rnd' \(RandomUniformLike, opset 22\): attributes low=2.0, high=1.0"):
        _executor(_model("RandomUniformLike", low=2.0, high=1.0))


def test_random_uniform_like_integer_dtype_is_an_op_error_at_load():
    with pytest.raises(OpError, match=r"node 'rnd' \(RandomUniformLike, opset 22\): attribute dtype=6 is invalid"):
        _executor(_model("RandomUniformLike", out_type=TensorProto.INT32, dtype=TensorProto.INT32))


def test_bernoulli_seed_not_finite_is_an_op_error_at_load():
    with pytest.raises(OpError, match=r"node 'rnd' \(Bernoulli, opset 22\): attribute seed=nan"):
        _executor(_model("Bernoulli", seed=float("nan")))
