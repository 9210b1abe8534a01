"""RNN, GRU, LSTM and RoiAlign beyond ONNX's node cases (issue 19): what those cases leave out
(sequence_lens shorter than the sequence, layout=1 with every optional input, non-default
activations, clip, linear_before_reset, input_forget; RoiAlign's sampling_ratio 0, out-of-map
regions, opset 10), checked against a plain numpy loop over the spec's equations written here (ONNX's
reference evaluator ignores sequence_lens and knows two activations) or against that evaluator where
it is right; bad attributes refused when the model loads, and out-of-range sequence_lens or
batch_indices a ``DeviceAssert`` naming the node, on every selected device (``make_runtime``).
"""

from __future__ import annotations

import numpy as np
import pytest
from lockstep.kernels._op import OpError
from lockstep.reference_runtime import DeviceAssert, Runtime, RuntimeConfig
from lockstep.reference_runtime.backends.sim import SimDevice
from lockstep.reference_runtime.executor import Executor
from onnx import helper
from onnx.reference import ReferenceEvaluator

F = np.float32
_RNG = np.random.default_rng(19)


def _r(*shape, dtype=F):
    return (_RNG.standard_normal(shape) * 0.5).astype(dtype)


def _model(op, inputs: dict, outputs: dict, opset=22, name="node_under_test", **attrs):
    """One node over ``inputs`` (name -> array, or None for an empty optional input) whose outputs
    are ``outputs`` (name -> shape, or None for an empty output)."""
    node = helper.make_node(op, [k if v is not None else "" for k, v in inputs.items()],
                            [k if v is not None else "" for k, v in outputs.items()], name=name, **attrs)
    vis = [helper.make_tensor_value_info(k, helper.np_dtype_to_tensor_dtype(v.dtype), v.shape)
           for k, v in inputs.items() if v is not None]
    dt = helper.np_dtype_to_tensor_dtype(next(iter(inputs.values())).dtype)
    outs = [helper.make_tensor_value_info(k, dt, s) for k, s in outputs.items() if s is not None]
    graph = helper.make_graph([node], "g", vis, outs)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)], ir_version=10)


def _feeds(inputs):
    return {k: v for k, v in inputs.items() if v is not None}


def _sim():
    return Runtime(SimDevice(), RuntimeConfig())


# -- the spec's equations, one batch row and one direction at a time --------------------------------

def _sig(x):
    return 1.0 / (1.0 + np.exp(-x))


_ACT = {
    "Tanh": lambda x, a, b: np.tanh(x), "Sigmoid": lambda x, a, b: _sig(x),
    "Relu": lambda x, a, b: np.maximum(x, 0), "LeakyRelu": lambda x, a, b: np.where(x >= 0, x, a * x),
    "HardSigmoid": lambda x, a, b: np.clip(a * x + b, 0, 1), "Affine": lambda x, a, b: a * x + b,
}


def _loop(kind, x, w, r, b, h0, c0, p, lens, acts, clip=None, lbr=0, input_forget=0, reverse=(1,)):
    """Y (T, nd, batch, H), Y_h and Y_c (nd, batch, H), layout 0, in float64: each row runs its own
    ``lens[b]`` steps (the directions in ``reverse`` from step ``lens[b] - 1`` down to 0)."""
    T, nb, _ = x.shape
    nd, _, H = r.shape
    y = np.zeros((T, nd, nb, H))
    yh, yc = np.zeros((nd, nb, H)), np.zeros((nd, nb, H))

    def act(k, v, d):
        name, a, bb = acts[d][k]
        v = v if clip is None else np.clip(v, -clip, clip)
        return _ACT[name](v, a, bb)

    for d in range(nd):
        W, R, Wb, Rb = w[d], r[d], b[d][:len(b[d]) // 2], b[d][len(b[d]) // 2:]
        for n in range(nb):
            h, c = h0[d, n].astype(np.float64), c0[d, n].astype(np.float64)
            steps = range(lens[n] - 1, -1, -1) if d in reverse else range(lens[n])
            for t in steps:
                xt = x[t, n].astype(np.float64)
                if kind == "RNN":
                    h = act(0, W @ xt + R @ h + Wb + Rb, d)
                elif kind == "GRU":
                    z = act(0, W[:H] @ xt + R[:H] @ h + Wb[:H] + Rb[:H], d)
                    rr = act(0, W[H:2 * H] @ xt + R[H:2 * H] @ h + Wb[H:2 * H] + Rb[H:2 * H], d)
                    if lbr:
                        hh = act(1, W[2 * H:] @ xt + rr * (R[2 * H:] @ h + Rb[2 * H:]) + Wb[2 * H:], d)
                    else:
                        hh = act(1, W[2 * H:] @ xt + R[2 * H:] @ (rr * h) + Rb[2 * H:] + Wb[2 * H:], d)
                    h = (1 - z) * hh + z * h
                else:
                    g = W @ xt + R @ h + Wb + Rb
                    gi, go, gf, gc = g[:H], g[H:2 * H], g[2 * H:3 * H], g[3 * H:]
                    i = act(0, gi + p[d][:H] * c, d)
                    f = 1 - i if input_forget else act(0, gf + p[d][2 * H:] * c, d)
                    c = f * c + i * act(1, gc, d)
                    o = act(0, go + p[d][H:2 * H] * c, d)
                    name, a, bb = acts[d][2]
                    h = o * _ACT[name](c, a, bb)
                y[t, d, n] = h
            if lens[n]:  # a row of length 0 has no last step: zero Y_h/Y_c (ONNX Runtime's choice)
                yh[d, n], yc[d, n] = h, c
    return y, yh, yc


def _case(kind, direction, layout, T=5, nb=3, ni=4, H=3, lens=(5, 2, 0), **attrs):
    nd, G = (2 if direction == "bidirectional" else 1), {"RNN": 1, "GRU": 3, "LSTM": 4}[kind]
    x, w, r, b = _r(T, nb, ni), _r(nd, G * H, ni), _r(nd, G * H, H), _r(nd, 2 * G * H)
    h0, c0, p = _r(nd, nb, H), _r(nd, nb, H), _r(nd, 3 * H)
    lens = np.array(lens, np.int32)
    t = (lambda a: np.ascontiguousarray(np.swapaxes(a, 0, 1))) if layout else (lambda a: a)
    inputs = {"X": t(x), "W": w, "R": r, "B": b, "sequence_lens": lens, "initial_h": t(h0)}
    if kind == "LSTM":
        inputs.update(initial_c=t(c0), P=p)
    state = [nb, nd, H] if layout else [nd, nb, H]
    outputs = {"Y": [nb, T, nd, H] if layout else [T, nd, nb, H], "Y_h": state}
    if kind == "LSTM":
        outputs["Y_c"] = state
    model = _model(kind, inputs, outputs, direction=direction, layout=layout, hidden_size=H, **attrs)
    return model, inputs, (x, w, r, b, h0, c0, p, lens)


def _check(got, want_y, want_h, want_c, layout, tol=2e-5):
    if layout:
        want_y, want_h, want_c = want_y.transpose(2, 0, 1, 3), want_h.transpose(1, 0, 2), want_c.transpose(1, 0, 2)
    np.testing.assert_allclose(got["Y"], want_y, rtol=tol, atol=tol)  # result: Y
    np.testing.assert_allclose(got["Y_h"], want_h, rtol=tol, atol=tol)  # result: Y_h
    if "Y_c" in got:
        np.testing.assert_allclose(got["Y_c"], want_c, rtol=tol, atol=tol)  # result: Y_c


_DEFAULT = {"RNN": [("Tanh", 0, 0)], "GRU": [("Sigmoid", 0, 0), ("Tanh", 0, 0)],
            "LSTM": [("Sigmoid", 0, 0), ("Tanh", 0, 0), ("Tanh", 0, 0)]}


@pytest.mark.parametrize("layout", [0, 1])
@pytest.mark.parametrize("kind", ["RNN", "GRU", "LSTM"])
def test_bidirectional_with_short_sequence_lens_matches_the_spec_loop(make_runtime, kind, layout):
    """Rows of length 5, 2 and 0 in a sequence of 5, every optional input, both layouts."""
    model, inputs, (x, w, r, b, h0, c0, p, lens) = _case(kind, "bidirectional", layout)
    got = Executor(model, make_runtime()).run(_feeds(inputs))
    want = _loop(kind, x, w, r, b, h0, c0, p, lens, [_DEFAULT[kind]] * 2)
    _check(got, *want, layout)
    # contract: past a row's length its outputs are zero, and a row of length 0 has a zero Y_h
    y = got["Y"] if not layout else got["Y"].transpose(1, 2, 0, 3)
    assert not y[2:, :, 1].any() and not y[:, :, 2].any()
    yh = got["Y_h"] if not layout else got["Y_h"].transpose(1, 0, 2)
    assert not yh[:, 2].any() and h0[:, 2].all()


@pytest.mark.parametrize("kind", ["RNN", "GRU", "LSTM"])
def test_short_sequence_lens_agree_with_onnxruntime(kind):
    """Data about ONNX Runtime's CPU provider (layout 0 only: it refuses layout 1), which fixes what
    the spec leaves open: the reverse direction starts at a row's own last step, a row of length 0
    gives zero Y_h/Y_c."""
    ort = pytest.importorskip("onnxruntime")
    model, inputs, _ = _case(kind, "bidirectional", 0, lens=(5, 2, 0))
    sess = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    want = sess.run(None, _feeds(inputs))
    got = Executor(model, _sim()).run(_feeds(inputs))
    for name, w in zip(got, want):
        np.testing.assert_allclose(got[name], w, rtol=1e-5, atol=1e-6)  # result: each output


def test_reverse_gru_linear_before_reset_with_clip(make_runtime):
    model, inputs, (x, w, r, b, h0, c0, p, lens) = _case("GRU", "reverse", 0, lens=(3, 5, 1),
                                                         linear_before_reset=1, clip=0.3)
    got = Executor(model, make_runtime()).run(_feeds(inputs))
    want = _loop("GRU", x, w, r, b, h0, c0, p, lens, [_DEFAULT["GRU"]], clip=0.3, lbr=1, reverse=(0,))
    _check(got, *want, 0)


def test_activations_with_alpha_beta_and_input_forget(make_runtime):
    """activation_alpha/beta are consumed in order by the activations that take them."""
    acts = ["HardSigmoid", "LeakyRelu", "Affine"]
    model, inputs, (x, w, r, b, h0, c0, p, lens) = _case(
        "LSTM", "forward", 1, lens=(4, 5, 2), input_forget=1, activations=acts,
        activation_alpha=[0.3, 0.05, 0.9], activation_beta=[0.4, -0.1])
    got = Executor(model, make_runtime()).run(_feeds(inputs))
    spec = [("HardSigmoid", 0.3, 0.4), ("LeakyRelu", 0.05, 0), ("Affine", 0.9, -0.1)]
    want = _loop("LSTM", x, w, r, b, h0, c0, p, lens, [spec], input_forget=1)
    _check(got, *want, 1)


def test_rnn_relu_matches_the_loop_without_optional_inputs(make_runtime):
    x, w, r = _r(4, 2, 3), _r(1, 5, 3), _r(1, 5, 5)
    model = _model("RNN", {"X": x, "W": w, "R": r}, {"Y": [4, 1, 2, 5], "Y_h": [1, 2, 5]},
                   hidden_size=5, activations=["Relu"])
    got = Executor(model, make_runtime()).run({"X": x, "W": w, "R": r})
    zeros = np.zeros((1, 2, 5), F)
    want = _loop("RNN", x, w, r, np.zeros((1, 10), F), zeros, zeros, None, [4, 4], [[("Relu", 0, 0)]])
    _check(got, *want, 0)


def test_float64_and_float16_follow_onnx_reference(make_runtime):
    for dt, tol in ((np.float64, 1e-12), (np.float16, 2e-3)):
        x, w, r = _r(3, 2, 2, dtype=dt), _r(1, 12, 2, dtype=dt), _r(1, 12, 3, dtype=dt)
        model = _model("LSTM", {"X": x, "W": w, "R": r}, {"Y": [3, 1, 2, 3], "Y_h": [1, 2, 3]}, hidden_size=3)
        got = Executor(model, make_runtime()).run({"X": x, "W": w, "R": r})
        want = ReferenceEvaluator(model).run(None, {"X": x, "W": w, "R": r})
        assert got["Y"].dtype == dt  # contract: the input's dtype comes back
        np.testing.assert_allclose(got["Y"], want[0], rtol=tol, atol=tol)  # result: Y
        np.testing.assert_allclose(got["Y_h"], want[1], rtol=tol, atol=tol)  # result: Y_h


def test_sequence_lens_out_of_range_is_a_device_assert_naming_the_node(make_runtime):
    model, inputs, _ = _case("LSTM", "bidirectional", 0)
    rt = make_runtime()
    ex = Executor(model, rt)
    good = ex.run(_feeds(inputs))
    with pytest.raises(DeviceAssert, match="node_under_test"):
        ex.run({**_feeds(inputs), "sequence_lens": np.array([6, 1, 1], np.int32)})
    rt.reset_error_latch()
    again = ex.run(_feeds(inputs))
    np.testing.assert_array_equal(again["Y"], good["Y"])  # result: usable again after the reset


# -- attributes refused when the model loads --------------------------------------------------------

def _rnn_load(**attrs):
    x, w, r = _r(3, 1, 2), _r(1, 4, 2), _r(1, 4, 4)
    attrs.setdefault("hidden_size", 4)
    Executor(_model("RNN", {"X": x, "W": w, "R": r}, {"Y": [3, 1, 1, 4]}, name="rnn0", **attrs), _sim())


@pytest.mark.parametrize("attrs, pattern", [
    ({"direction": "sideways"}, r"direction='sideways' is invalid: allowed: 'forward', 'reverse', 'bidirectional'"),
    ({"activations": ["Swish"]}, r"unknown activation 'Swish'"),
    ({"activations": ["Tanh", "Tanh"]}, r"activations=\['Tanh', 'Tanh'\] is invalid: 1 entries expected"),
    ({"activation_alpha": [0.5]}, r"activation_alpha=\[0.5\] is invalid: only 0 of the activations"),
    ({"clip": -1.0}, r"clip=-1.0 is invalid: a positive finite number"),
    ({"layout": 2}, r"layout=2 is invalid: allowed: 0, 1"),
    ({"hidden_size": 0}, r"hidden_size=0 is invalid: must lie in \[1, inf\]"),
])
def test_bad_rnn_attribute_is_an_op_error_at_load(attrs, pattern):
    with pytest.raises(OpError, match=r"node 'rnn0' \(RNN, opset 22\): .*" + pattern):
        _rnn_load(**attrs)


def test_hidden_size_disagreeing_with_the_weights_is_an_op_error_before_any_launch():
    """Load-time checks see attributes only; W and R are inputs, so the mismatch is refused by shape
    inference on the first run, naming the node, before the kernel launches."""
    x, w, r = _r(3, 1, 2), _r(1, 4, 2), _r(1, 4, 4)
    model = _model("RNN", {"X": x, "W": w, "R": r}, {"Y": [3, 1, 1, 4]}, name="rnn0", hidden_size=3)
    rt = _sim()
    ex = Executor(model, rt)
    with pytest.raises(OpError, match=r"node 'rnn0' \(RNN, opset 22\): attribute hidden_size=3 does not match R"):
        ex.run({"X": x, "W": w, "R": r})
    gru = _model("GRU", {"X": x, "W": w, "R": r}, {"Y": [3, 1, 1, 4]}, name="gru0")
    with pytest.raises(OpError, match=r"node 'gru0' \(GRU, opset 22\): input W has shape \(1, 4, 2\), expected \(1, 12, 2\)"):
        Executor(gru, rt).run({"X": x, "W": w, "R": r})


# -- RoiAlign ----------------------------------------------------------------------------------------

_ROIS = np.array([[0, 0, 9, 9], [0, 0, 4, 4], [2.5, 1.2, 8.7, 6.1], [-3, -2, 14, 12], [5, 5, 4, 3]], F)


@pytest.mark.parametrize("mode", ["avg", "max"])
@pytest.mark.parametrize("ctm", ["half_pixel", "output_half_pixel"])
@pytest.mark.parametrize("ratio", [0, 1, 3])
def test_roialign_matches_onnx_reference(make_runtime, mode, ctm, ratio):
    """sampling_ratio 0 gives each region its own grid (1..5 here), regions partly outside the map
    and a malformed one (x2 < x1)."""
    x = _r(2, 3, 10, 9)
    inputs = {"X": x, "rois": _ROIS * np.float32(0.8), "batch_indices": np.array([0, 1, 1, 0, 1], np.int64)}
    model = _model("RoiAlign", inputs, {"Y": [5, 3, 3, 2]}, mode=mode, coordinate_transformation_mode=ctm,
                   output_height=3, output_width=2, sampling_ratio=ratio, spatial_scale=0.8)
    got = Executor(model, make_runtime()).run(inputs)["Y"]
    want = ReferenceEvaluator(model).run(None, inputs)[0]
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)  # result: Y


def test_roialign_opset10_is_output_half_pixel_and_float64(make_runtime):
    x = _r(1, 2, 6, 6, dtype=np.float64)
    inputs = {"X": x, "rois": _ROIS[:3].astype(np.float64) * 0.6, "batch_indices": np.zeros(3, np.int64)}
    model = _model("RoiAlign", inputs, {"Y": [3, 2, 2, 2]}, opset=10, output_height=2, output_width=2)
    got = Executor(model, make_runtime()).run(inputs)["Y"]
    assert got.dtype == np.float64  # contract: the input's dtype comes back
    # onnx's evaluator gives opset 10 opset 16's default (half_pixel); ONNX Runtime, and lockstep,
    # keep opset 10's unshifted coordinates: the same node at opset 16 with output_half_pixel
    same = _model("RoiAlign", inputs, {"Y": [3, 2, 2, 2]}, opset=16, output_height=2, output_width=2,
                  coordinate_transformation_mode="output_half_pixel")
    np.testing.assert_allclose(got, ReferenceEvaluator(same).run(None, inputs)[0], rtol=1e-12)  # result: Y


def test_roialign_batch_index_out_of_range_is_a_device_assert(make_runtime):
    inputs = {"X": _r(2, 1, 5, 5), "rois": _ROIS[:2], "batch_indices": np.array([1, 0], np.int64)}
    model = _model("RoiAlign", inputs, {"Y": [2, 1, 2, 2]}, output_height=2, output_width=2, sampling_ratio=2)
    rt = make_runtime()
    ex = Executor(model, rt)
    good = ex.run(inputs)["Y"]
    with pytest.raises(DeviceAssert, match="node_under_test"):
        ex.run({**inputs, "batch_indices": np.array([2, 0], np.int64)})
    rt.reset_error_latch()
    np.testing.assert_array_equal(ex.run(inputs)["Y"], good)  # result: usable again after the reset


@pytest.mark.parametrize("attrs, pattern", [
    ({"mode": "median"}, r"mode='median' is invalid: allowed: 'avg', 'max'"),
    ({"coordinate_transformation_mode": "asymmetric"}, r"coordinate_transformation_mode='asymmetric' is invalid"),
    ({"sampling_ratio": -1}, r"sampling_ratio=-1 is invalid"),
    ({"spatial_scale": 0.0}, r"spatial_scale=0.0 is invalid: a positive finite number"),
])
def test_bad_roialign_attribute_is_an_op_error_at_load(attrs, pattern):
    inputs = {"X": _r(1, 1, 4, 4), "rois": _ROIS[:1], "batch_indices": np.zeros(1, np.int64)}
    model = _model("RoiAlign", inputs, {"Y": [1, 1, 1, 1]}, name="roi0", **attrs)
    with pytest.raises(OpError, match=r"node 'roi0' \(RoiAlign, opset 22\): .*" + pattern):
        Executor(model, _sim())


def test_roialign_non_finite_rois_and_an_empty_batch_are_named_errors(make_runtime):
    inputs = {"X": _r(1, 1, 5, 5), "rois": _ROIS[:2], "batch_indices": np.zeros(2, np.int64)}
    model = _model("RoiAlign", inputs, {"Y": [2, 1, 1, 1]}, name="roi0", sampling_ratio=2)
    rt = make_runtime()
    with pytest.raises(OpError, match=r"node 'roi0' \(RoiAlign, opset 22\): input rois must hold finite coordinates"):
        Executor(model, rt).run({**inputs, "rois": np.full((2, 4), np.nan, F)})
    empty = {**inputs, "X": np.zeros((0, 1, 5, 5), F)}
    model = _model("RoiAlign", empty, {"Y": [2, 1, 1, 1]}, name="roi0", sampling_ratio=2)
    with pytest.raises(DeviceAssert, match="roi0"):  # every batch index lies outside [0, 0)
        Executor(model, rt).run(empty)
    rt.reset_error_latch()
