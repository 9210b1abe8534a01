"""ai.onnx.ml ArrayFeatureExtractor, Binarizer, TreeEnsemble and the training optimizers Momentum,
Adagrad, Adam (kernels/ops_ml.py, kernels/ops_training.py) beyond ONNX's node cases: the aggregates,
missing values and transforms the two TreeEnsemble cases do not use, the optimizers after their
first update (every case has T = 0), and bad attributes or indices as named errors."""

from __future__ import annotations

import numpy as np
import pytest
from lockstep.engines.protocol import Unsupported
from lockstep.kernels._op import OpError
from lockstep.reference_runtime import DeviceAssert, Runtime, RuntimeConfig
from lockstep.reference_runtime.backends.sim import SimDevice
from lockstep.reference_runtime.executor import Executor
from onnx import TensorProto, helper, numpy_helper
from onnx.reference import ReferenceEvaluator

F, D, I64 = TensorProto.FLOAT, TensorProto.DOUBLE, TensorProto.INT64
ML = ("ai.onnx.ml", 5)
TRAINING = ("ai.onnx.preview.training", 1)


def _model(node, inputs, outputs, domain):
    g = helper.make_graph([node], "g", [helper.make_tensor_value_info(n, t, s) for n, t, s in inputs],
                          [helper.make_tensor_value_info(n, t, s) for n, t, s in outputs])
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", 21), helper.make_opsetid(*domain)],
                             ir_version=10)


def _run(model, feeds):
    ex = Executor(model, Runtime(SimDevice(), RuntimeConfig()))
    out = ex.run(feeds)
    return [out[o.name] for o in model.graph.output]


# ------------------------------------------------------------------ TreeEnsemble

def _forest(aggregate=1, post=0, nan_true=None, modes=(0, 1, 3), n_targets=2, **over):
    """Two trees on 3 features: tree 0 = nodes 0-1 (leaves 0-2), tree 1 = node 2 (leaves 3-4)."""
    attrs = dict(
        nodes_featureids=[0, 1, 2], nodes_truenodeids=[1, 0, 3], nodes_falsenodeids=[2, 1, 4],
        nodes_trueleafs=[0, 1, 1], nodes_falseleafs=[1, 1, 1], leaf_targetids=[0, 1, 0, 1, 1],
        tree_roots=[0, 2], aggregate_function=aggregate, post_transform=post, n_targets=n_targets,
        nodes_modes=numpy_helper.from_array(np.array(modes, np.uint8), "nodes_modes"),
        nodes_splits=numpy_helper.from_array(np.array([0.5, -0.25, 1.5], np.float32), "nodes_splits"),
        leaf_weights=numpy_helper.from_array(np.array([1.0, -2.0, 3.5, 0.25, 4.0], np.float32), "leaf_weights"))
    if nan_true is not None:
        attrs["nodes_missing_value_tracks_true"] = nan_true
    attrs.update(over)
    node = helper.make_node("TreeEnsemble", ["X"], ["Y"], name="forest", domain="ai.onnx.ml", **attrs)
    return _model(node, [("X", F, [None, None])], [("Y", F, [None, n_targets])], ML)


X = np.array([[0.1, -1.0, 2.0], [0.9, 0.0, 1.0], [0.5, -0.25, 1.5], [np.nan, 3.0, np.nan], [-4, 4, 4]], np.float32)


@pytest.mark.parametrize("aggregate", [0, 1, 2, 3], ids=["average", "sum", "min", "max"])
def test_tree_ensemble_aggregates_match_onnx_reference(aggregate):
    model = _forest(aggregate=aggregate, nan_true=[1, 0, 1])
    want = ReferenceEvaluator(model).run(None, {"X": X})[0]
    np.testing.assert_allclose(_run(model, {"X": X})[0], want, rtol=1e-6, err_msg="result: aggregate")


def test_tree_ensemble_nan_follows_missing_value_tracks_true():
    x = np.array([[np.nan, 0.0, 0.0]], np.float32)
    to_true = _run(_forest(nan_true=[1, 0, 0]), {"X": x})[0]
    to_false = _run(_forest(nan_true=[0, 0, 0]), {"X": x})[0]
    # NaN at node 0: true -> node 1 (feature 1 = 0.0 < -0.25 false -> leaf 1 (-2.0, target 1)); false -> leaf 2
    assert to_true[0].tolist() == [0.0, -2.0 + 4.0], "result: NaN tracked to the true branch"
    assert to_false[0].tolist() == [3.5, 4.0], "result: NaN fails the comparison"


@pytest.mark.parametrize("post", [1, 2, 3], ids=["softmax", "logistic", "softmax_zero"])
def test_tree_ensemble_post_transform(post):
    raw = ReferenceEvaluator(_forest()).run(None, {"X": X})[0].astype(np.float64)  # the reference ignores it
    if post == 2:
        want = 1 / (1 + np.exp(-raw))
    else:
        keep = raw != 0 if post == 3 else np.ones_like(raw, bool)
        e = np.where(keep, np.exp(raw - np.where(keep, raw, -np.inf).max(1, keepdims=True)), 0)
        want = e / e.sum(1, keepdims=True)
    np.testing.assert_allclose(_run(_forest(post=post), {"X": X})[0], want, rtol=1e-6, err_msg="result")


@pytest.mark.parametrize("over, pattern", [
    (dict(modes=(0, 9, 0)), r"nodes_modes holds \[0, 9\]: allowed 0..6"),
    (dict(nodes_truenodeids=[1, 7, 3]), r"nodes_truenodeids\[1\]=7 is out of range \(leaf ids are in \[0, 5\)\)"),
    (dict(nodes_truenodeids=[1, 0, 3], nodes_trueleafs=[0, 0, 1]), r"cycle through node"),
    (dict(leaf_targetids=[0, 1, 0, 1, 2]), r"leaf_targetids holds 0..2, outside \[0, n_targets=2\)"),
    (dict(tree_roots=[0, 5]), r"tree_roots holds 5, outside \[0, 3\)"),
    (dict(aggregate=7), r"aggregate_function=7 is invalid"),
    (dict(nodes_featureids=[0, 1]), r"nodes_featureids has 2 entries, nodes_splits has 3"),
])
def test_tree_ensemble_bad_attribute_is_an_op_error_at_load(over, pattern):
    with pytest.raises(OpError, match=r"node 'forest' \(TreeEnsemble, opset 5\): .*" + pattern):
        Executor(_forest(**over), Runtime(SimDevice(), RuntimeConfig()))


def test_tree_ensemble_probit_is_unsupported_at_load():
    with pytest.raises(Unsupported, match="PROBIT"):
        Executor(_forest(post=4), Runtime(SimDevice(), RuntimeConfig()))


def test_tree_ensemble_feature_beyond_the_input_is_an_op_error():
    with pytest.raises(OpError, match=r"node 'forest'.*reads feature 2; X has 2"):
        _run(_forest(), {"X": np.zeros((1, 2), np.float32)})


# ------------------------------------------------------------------ ArrayFeatureExtractor, Binarizer

def _afe():
    node = helper.make_node("ArrayFeatureExtractor", ["x", "i"], ["y"], name="afe", domain="ai.onnx.ml")
    return _model(node, [("x", F, [2, 3]), ("i", I64, [None])], [("y", F, [2, None])], ("ai.onnx.ml", 1))


def test_array_feature_extractor_out_of_range_index_is_a_device_assert():
    x = np.arange(6, dtype=np.float32).reshape(2, 3)
    ex = Executor(_afe(), Runtime(SimDevice(), RuntimeConfig()))
    assert ex.run({"x": x, "i": np.array([2, 0])})["y"].tolist() == [[2, 0], [5, 3]], "result"
    with pytest.raises(DeviceAssert, match="afe"):
        ex.run({"x": x, "i": np.array([3])})


def test_array_feature_extractor_on_strings_runs_on_the_host_and_checks_its_indices():
    node = helper.make_node("ArrayFeatureExtractor", ["x", "i"], ["y"], name="afe", domain="ai.onnx.ml")
    model = _model(node, [("x", TensorProto.STRING, [2, 3]), ("i", I64, [None])],
                   [("y", TensorProto.STRING, [2, None])], ("ai.onnx.ml", 1))
    x = np.array([["a", "b", "c"], ["d", "e", "f"]], dtype=object)
    ex = Executor(model, Runtime(SimDevice(), RuntimeConfig()))
    assert ex.run({"x": x, "i": np.array([2, -3])})["y"].tolist() == [["c", "a"], ["f", "d"]], "result"
    with pytest.raises(OpError, match=r"node 'afe' \(ArrayFeatureExtractor, opset 1\): index 3 is out of range"):
        ex.run({"x": x, "i": np.array([0, 3])})


def test_binarizer_integer_input_compares_with_the_float_threshold():
    node = helper.make_node("Binarizer", ["x"], ["y"], name="bin", domain="ai.onnx.ml", threshold=1.5)
    model = _model(node, [("x", I64, [4])], [("y", I64, [4])], ("ai.onnx.ml", 1))
    assert _run(model, {"x": np.array([0, 1, 2, 3])})[0].tolist() == [0, 0, 1, 1], "result: 1 > 1.5 is false"


def test_binarizer_nan_threshold_is_an_op_error_at_load():
    node = helper.make_node("Binarizer", ["x"], ["y"], name="bin", domain="ai.onnx.ml", threshold=float("nan"))
    with pytest.raises(OpError, match=r"node 'bin' \(Binarizer, opset 1\): attribute threshold=nan"):
        Executor(_model(node, [("x", F, [4])], [("y", F, [4])], ("ai.onnx.ml", 1)), Runtime(SimDevice(), RuntimeConfig()))


# ------------------------------------------------------------------ Momentum, Adagrad, Adam

def _optimizer(op, n=2, **attrs):
    per = {"Momentum": 3, "Adagrad": 3, "Adam": 4}[op]
    names = [f"{k}{i}" for k in "XGVH"[:per] for i in range(n)]
    node = helper.make_node(op, ["R", "T", *names], [f"{nm}_new" for nm in names if nm[0] not in "G"],
                            name="opt", domain="ai.onnx.preview.training", **attrs)
    ins = [("R", F, []), ("T", I64, []), *[(nm, F, [3]) for nm in names]]
    outs = [(f"{nm}_new", F, [3]) for nm in names if nm[0] != "G"]
    return _model(node, ins, outs, TRAINING), names


OPTIMIZERS = {
    "momentum": ("Momentum", dict(alpha=0.9, beta=0.5, mode="standard", norm_coefficient=0.01)),
    "nesterov": ("Momentum", dict(alpha=0.9, beta=0.5, mode="nesterov", norm_coefficient=0.01)),
    "adagrad": ("Adagrad", dict(decay_factor=0.1, epsilon=1e-5, norm_coefficient=0.01)),
    "adam": ("Adam", dict(alpha=0.9, beta=0.99, epsilon=1e-5, norm_coefficient=0.01, norm_coefficient_post=0.02)),
}


@pytest.mark.parametrize("t", [0, 1, 5])
@pytest.mark.parametrize("which", sorted(OPTIMIZERS))
def test_optimizer_after_the_first_update_matches_onnx_reference(which, t):
    op, attrs = OPTIMIZERS[which]
    model, names = _optimizer(op, **attrs)
    rng = np.random.default_rng(3)
    feeds = {"R": np.array(0.1, np.float32), "T": np.array(t, np.int64),
             **{nm: (rng.random(3) + (nm[0] in "H")).astype(np.float32) for nm in names}}
    want = ReferenceEvaluator(model).run(None, feeds)
    for got, w in zip(_run(model, feeds), want):
        np.testing.assert_allclose(got, w, rtol=1e-5, atol=1e-6, err_msg=f"result: {which} at T={t}")


def test_momentum_bad_mode_and_input_count_are_op_errors_at_load():
    model, _ = _optimizer("Momentum", alpha=0.9, beta=0.5, mode="heavy", norm_coefficient=0.0)
    with pytest.raises(OpError, match=r"node 'opt' \(Momentum, opset 1\): attribute mode='heavy' is invalid"):
        Executor(model, Runtime(SimDevice(), RuntimeConfig()))
    model, _ = _optimizer("Adam")
    del model.graph.node[0].input[-1]  # one H short
    model.graph.input.pop()
    with pytest.raises(OpError, match=r"node 'opt' \(Adam, opset 1\): takes R, T and 4 inputs per optimised tensor"):
        Executor(model, Runtime(SimDevice(), RuntimeConfig()))
