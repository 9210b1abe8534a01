"""DeformConv, ConvInteger, QLinearConv (kernels/ops_conv_variants.py) and NonMaxSuppression
(kernels/ops_detection.py) beyond ONNX's node cases: edges the cases miss, compared with onnx's
reference (``ReferenceEvaluator``) or with the operator's definition, and bad attributes/inputs
refused as ``OpError`` naming the node. Each test says whether it asserts a *result* or a
*contract*."""

from __future__ import annotations

import numpy as np
import pytest
from lockstep.kernels import KernelHostError
from lockstep.kernels._op import OpError
from lockstep.reference_runtime import Runtime, RuntimeConfig
from lockstep.reference_runtime.backends.sim import SimDevice
from lockstep.reference_runtime.executor import Executor
from onnx import helper
from onnx.reference import ReferenceEvaluator

F = np.float32


def _model(op, feeds: dict, out: tuple, opset: int, **attrs):
    """One node ``op`` named n0 over graph inputs ``feeds`` (name -> array; "" an absent input)."""
    def vi(name, dt, shape):
        return helper.make_tensor_value_info(name, helper.np_dtype_to_tensor_dtype(np.dtype(dt)), shape)

    node = helper.make_node(op, list(feeds), ["y"], name="n0", **attrs)
    rank = 2 if op == "NonMaxSuppression" else next(iter(feeds.values())).ndim
    g = helper.make_graph([node], "g", [vi(n, v.dtype, v.shape) for n, v in feeds.items() if n],
                          [vi("y", out[0], [f"d{i}" for i in range(rank)])])
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", opset)], ir_version=10)


def _feeds(feeds):
    return {n: v for n, v in feeds.items() if n}


def _run(make_runtime, op, feeds, out_dtype, opset, **attrs):
    return Executor(_model(op, feeds, (out_dtype, None), opset, **attrs), make_runtime()).run(_feeds(feeds))["y"]


def _reference(op, feeds, out_dtype, opset, **attrs):
    return ReferenceEvaluator(_model(op, feeds, (out_dtype, None), opset, **attrs)).run(None, _feeds(feeds))[0]


def _load(op, feeds, out_dtype, opset, **attrs):
    return Executor(_model(op, feeds, (out_dtype, None), opset, **attrs), Runtime(SimDevice(), RuntimeConfig()))


# -- NonMaxSuppression -----------------------------------------------------------------------------

BOXES = np.array([[[0.5, 0.5, 1.0, 1.0], [0.5, 0.6, 1.0, 1.0], [0.5, 0.4, 1.0, 1.0],
                   [0.5, 10.5, 1.0, 1.0], [0.5, 10.6, 1.0, 1.0], [0.5, 100.5, 1.0, 1.0]]], F)
SCORES = np.array([[[0.9, 0.75, 0.6, 0.95, 0.5, 0.3]]], F)


def _nms_feeds(boxes=BOXES, scores=SCORES, mx=3, iou=0.5, score=None):
    f = {"boxes": boxes, "scores": scores, "max": np.array([mx], np.int64), "iou": np.array([iou], F)}
    if score is not None:
        f["score"] = np.array([score], F)
    return f


def test_nms_max_output_zero_selects_nothing(make_runtime):
    """result: max_output_boxes_per_class = 0 keeps no box: a (0, 3) int64 output."""
    y = _run(make_runtime, "NonMaxSuppression", _nms_feeds(mx=0), np.int64, 11)
    assert y.shape == (0, 3) and y.dtype == np.int64


def test_nms_absent_max_output_selects_nothing(make_runtime):
    """result: without max_output_boxes_per_class (its default 0) nothing is selected."""
    y = _run(make_runtime, "NonMaxSuppression", {"boxes": BOXES, "scores": SCORES}, np.int64, 11)
    assert y.shape == (0, 3)


@pytest.mark.parametrize("score", [None, 0.55])
def test_nms_center_point_box_matches_the_reference(make_runtime, score):
    """result: center_point_box=1 boxes ([xc, yc, w, h], overlapping along x), with and without a
    score threshold, select what onnx's reference selects (in its order)."""
    feeds = _nms_feeds(score=score)
    y = _run(make_runtime, "NonMaxSuppression", feeds, np.int64, 11, center_point_box=1)
    want = _reference("NonMaxSuppression", feeds, np.int64, 11, center_point_box=1)
    np.testing.assert_array_equal(y, want)
    assert y.tolist() == ([[0, 0, 3], [0, 0, 0], [0, 0, 5]] if score is None else [[0, 0, 3], [0, 0, 0]])


def test_nms_corner_boxes_differ_from_center_boxes(make_runtime):
    """result: the same numbers read as corners [y1, x1, y2, x2] (center_point_box=0) are other
    boxes: the reference's selection, not the center-format one."""
    feeds = _nms_feeds(mx=6)
    y = _run(make_runtime, "NonMaxSuppression", feeds, np.int64, 11)
    np.testing.assert_array_equal(y, _reference("NonMaxSuppression", feeds, np.int64, 11))


def test_nms_iou_threshold_outside_unit_interval_is_refused(make_runtime):
    """contract: iou_threshold 1.5 is an OpError naming the node (host value, checked in shapes)."""
    with pytest.raises(OpError, match=r"node 'n0' \(NonMaxSuppression.*iou_threshold 1.5 is outside \[0, 1\]"):
        _run(make_runtime, "NonMaxSuppression", _nms_feeds(iou=1.5), np.int64, 11)


def test_nms_center_point_box_2_is_refused_at_load():
    """contract: center_point_box must be 0 or 1, refused when the model loads."""
    with pytest.raises(OpError, match=r"node 'n0'.*center_point_box=2 is invalid: allowed: 0, 1") as err:
        _load("NonMaxSuppression", _nms_feeds(), np.int64, 11, center_point_box=2)
    assert not isinstance(err.value, KernelHostError)


def test_nms_scores_of_another_box_count_are_refused(make_runtime):
    """contract: scores (1, 1, 5) for 6 boxes is an OpError naming both shapes."""
    with pytest.raises(OpError, match=r"node 'n0'.*scores must have shape \(1, classes, 6\), got \(1, 1, 5\)"):
        _run(make_runtime, "NonMaxSuppression", _nms_feeds(scores=SCORES[:, :, :5]), np.int64, 11)


# -- DeformConv ------------------------------------------------------------------------------------

def _conv_attrs(nsp, **over):
    return {"strides": [2] * nsp, "pads": [1] * (2 * nsp), "dilations": [1] * nsp, **over}


@pytest.mark.parametrize("shape,kernel,group", [((2, 4, 9), (3,), 2), ((1, 2, 5, 6), (2, 3), 1),
                                                ((1, 2, 4, 4, 5), (2, 2, 2), 2)])
def test_deform_conv_with_zero_offsets_is_conv(make_runtime, shape, kernel, group):
    """result: offsets all zero (and no mask) sample the regular grid: DeformConv equals Conv with
    the same weights, bias, groups, strides and pads, in 1-D, 2-D and 3-D."""
    rng = np.random.default_rng(3)
    nsp = len(kernel)
    x = rng.standard_normal(shape).astype(F)
    w = rng.standard_normal((4, shape[1] // group, *kernel)).astype(F)
    b = rng.standard_normal(4).astype(F)
    attrs = _conv_attrs(nsp, group=group)
    conv = _run(make_runtime, "Conv", {"x": x, "w": w, "b": b}, F, 21, **attrs)
    off = np.zeros((shape[0], 2 * int(np.prod(kernel)) * nsp, *conv.shape[2:]), F)  # offset_group 2
    y = _run(make_runtime, "DeformConv", {"x": x, "w": w, "off": off, "b": b}, F, 22, offset_group=2, **attrs)
    np.testing.assert_allclose(y, conv, rtol=1e-5, atol=1e-5)


def test_deform_conv_groups_mask_and_fractional_offsets_match_the_reference(make_runtime):
    """result: group 2, offset_group 2, strides, dilations, pads, mask and bias, with offsets that
    reach past the borders, against onnx's reference."""
    rng = np.random.default_rng(5)
    x = rng.standard_normal((2, 4, 5, 6)).astype(F)
    w = rng.standard_normal((6, 2, 2, 2)).astype(F)
    attrs = {"group": 2, "offset_group": 2, "strides": [1, 2], "dilations": [2, 1], "pads": [1, 0, 1, 1]}
    off = (rng.standard_normal((2, 2 * 4 * 2, 5, 3)) * 1.7).astype(F)
    mask = rng.uniform(0, 1, (2, 2 * 4, 5, 3)).astype(F)
    feeds = {"x": x, "w": w, "off": off, "b": rng.standard_normal(6).astype(F), "mask": mask}
    y = _run(make_runtime, "DeformConv", feeds, F, 22, **attrs)
    np.testing.assert_allclose(y, _reference("DeformConv", feeds, F, 22, **attrs), rtol=1e-4, atol=1e-5)


def test_deform_conv_offset_group_zero_is_refused_at_load():
    """contract: offset_group 0 is an OpError naming the node and the attribute at load."""
    feeds = {"x": np.zeros((1, 2, 3, 3), F), "w": np.zeros((2, 2, 2, 2), F), "off": np.zeros((1, 8, 2, 2), F)}
    with pytest.raises(OpError, match=r"node 'n0' \(DeformConv.*offset_group=0 is invalid: must be an integer >= 1"):
        _load("DeformConv", feeds, F, 22, offset_group=0)


def test_deform_conv_offset_of_the_wrong_shape_is_refused(make_runtime):
    """contract: an offset without one (y, x) pair per kernel tap is an OpError naming the shapes."""
    feeds = {"x": np.zeros((1, 2, 3, 3), F), "w": np.zeros((2, 2, 2, 2), F), "off": np.zeros((1, 4, 2, 2), F)}
    with pytest.raises(OpError, match=r"node 'n0'.*offset has shape \(1, 4, 2, 2\), \(1, 8, 2, 2\) expected"):
        _run(make_runtime, "DeformConv", feeds, F, 22)


# -- ConvInteger / QLinearConv ---------------------------------------------------------------------

def test_conv_integer_per_channel_weight_zero_point(make_runtime):
    """result: w_zero_point with one value per output channel (the spec allows a 1-D tensor of M),
    int8 weights, uint8 input with its zero point, pads and strides: the reference's int32 values."""
    rng = np.random.default_rng(7)
    feeds = {"x": rng.integers(0, 256, (1, 3, 5, 5), dtype=np.uint8),
             "w": rng.integers(-128, 128, (4, 3, 3, 3), dtype=np.int8),
             "xzp": np.array(131, np.uint8), "wzp": np.array([-3, 0, 7, 100], np.int8)}
    attrs = {"pads": [1, 1, 1, 1], "strides": [2, 1]}
    y = _run(make_runtime, "ConvInteger", feeds, np.int32, 10, **attrs)
    want = _reference("ConvInteger", feeds, np.int32, 10, **attrs)
    assert y.dtype == np.int32
    np.testing.assert_array_equal(y, want)
    # the definition: per-channel shift of the weights, zero-point padding of the input
    xs = np.pad(feeds["x"].astype(np.int32) - 131, [(0, 0), (0, 0), (1, 1), (1, 1)])
    ws = feeds["w"].astype(np.int32) - feeds["wzp"].astype(np.int32).reshape(4, 1, 1, 1)
    assert y[0, 2, 1, 3] == int((xs[0, :, 2:5, 3:6] * ws[2]).sum())


def test_conv_integer_zero_point_of_the_wrong_length_is_refused(make_runtime):
    """contract: a w_zero_point of 3 values for 4 output channels is an OpError naming it."""
    feeds = {"x": np.zeros((1, 1, 3, 3), np.uint8), "w": np.zeros((4, 1, 2, 2), np.uint8),
             "": np.zeros(0, np.uint8), "wzp": np.zeros(3, np.uint8)}
    with pytest.raises(OpError, match=r"node 'n0'.*w_zero_point has shape \(3,\): one value, or 1-D of 4"):
        _run(make_runtime, "ConvInteger", feeds, np.int32, 10)


@pytest.mark.parametrize("dt", [np.int8, np.uint8])
def test_qlinear_conv_per_channel_scales_bias_rounding_and_saturation(make_runtime, dt):
    """result: per-channel w_scale and w_zero_point, an int32 bias, a y_scale small enough that
    values saturate at both ends: the reference's bytes (round half to even, then clip)."""
    rng = np.random.default_rng(11)
    info = np.iinfo(dt)
    feeds = {"x": rng.integers(info.min, info.max + 1, (1, 2, 4, 4), dtype=dt), "xs": np.array(0.05, F),
             "xzp": np.array(3, dt), "w": rng.integers(-20, 21, (3, 2, 2, 2), dtype=np.int8),
             "ws": np.array([0.02, 0.5, 0.125], F), "wzp": np.array([0, 1, -2], np.int8),
             "ys": np.array(0.05, F), "yzp": np.array(info.min + 100, dt),
             "b": np.array([1000, -40, 7], np.int32)}
    attrs = {"pads": [0, 1, 1, 0]}
    y = _run(make_runtime, "QLinearConv", feeds, dt, 10, **attrs)
    want = _reference("QLinearConv", feeds, dt, 10, **attrs)
    assert y.dtype == np.dtype(dt)
    np.testing.assert_array_equal(y, want)
    assert (y == info.max).any() and (y == info.min).any()


def test_qlinear_conv_rounds_half_to_even(make_runtime):
    """result: accumulators 1, 3, 5 (times 0.5: 0.5, 1.5, 2.5) requantise to 0, 2, 2."""
    feeds = {"x": np.array([[[[1, 3, 5]]]], np.uint8), "xs": np.array(1.0, F), "xzp": np.array(0, np.uint8),
             "w": np.ones((1, 1, 1, 1), np.uint8), "ws": np.array(0.5, F), "wzp": np.array(0, np.uint8),
             "ys": np.array(1.0, F), "yzp": np.array(0, np.uint8)}
    y = _run(make_runtime, "QLinearConv", feeds, np.uint8, 10)
    assert y.reshape(-1).tolist() == [0, 2, 2]


def test_qlinear_conv_bias_of_another_type_is_refused(make_runtime):
    """contract: a float bias (B must be int32) is an OpError naming it."""
    feeds = {"x": np.zeros((1, 1, 2, 2), np.uint8), "xs": np.array(1.0, F), "xzp": np.array(0, np.uint8),
             "w": np.ones((2, 1, 1, 1), np.uint8), "ws": np.array(1.0, F), "wzp": np.array(0, np.uint8),
             "ys": np.array(1.0, F), "yzp": np.array(0, np.uint8), "b": np.zeros(2, F)}
    with pytest.raises(OpError, match=r"node 'n0'.*B must be int32 of shape \(2,\), got float32"):
        _run(make_runtime, "QLinearConv", feeds, np.uint8, 10)


def test_qlinear_conv_group_that_does_not_divide_is_refused_at_load():
    """contract: group 0 is refused when the model loads, naming node and attribute."""
    feeds = {"x": np.zeros((1, 2, 2, 2), np.uint8), "xs": np.array(1.0, F), "xzp": np.array(0, np.uint8),
             "w": np.ones((2, 1, 1, 1), np.uint8), "ws": np.array(1.0, F), "wzp": np.array(0, np.uint8),
             "ys": np.array(1.0, F), "yzp": np.array(0, np.uint8)}
    with pytest.raises(OpError, match=r"node 'n0'.*group=0 is invalid"):
        _load("QLinearConv", feeds, np.uint8, 10, group=0)
