"""Device-side index checks (issue 15): every index input ONNX requires in range sets the runtime's
error latch, which surfaces as ``DeviceAssert`` naming the node at the next synchronising read;
in-range indices (negative ones where ONNX allows them) give onnx's reference values, and the
runtime is usable again after ``reset_error_latch()``. On every selected device (``device_name``).
"""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest
from lockstep.reference_runtime import DeviceAssert
from lockstep.reference_runtime.executor import Executor
from onnx import helper, numpy_helper
from onnx.reference import ReferenceEvaluator

sys.path.insert(0, str(Path(__file__).parent))  # the GroupQueryAttention helpers of test_contrib_ops

F, I = np.float32, np.int64


def _model(op, inputs: dict, n_out=1, opset=21, **attrs):
    """One node named ``<op>_under_test`` over ``inputs``; its outputs' shapes from onnx's reference."""
    names = list(inputs)
    node = helper.make_node(op, names, [f"y{i}" for i in range(n_out)], name=f"{op}_under_test", **attrs)
    vis = [helper.make_tensor_value_info(n, helper.np_dtype_to_tensor_dtype(v.dtype), v.shape)
           for n, v in inputs.items()]
    def build(shapes):
        outs = [helper.make_tensor_value_info(f"y{i}", 1, s) for i, s in enumerate(shapes)]  # all float here
        g = helper.make_graph([node], "g", vis, outs)
        return helper.make_model(g, opset_imports=[helper.make_opsetid("", opset)], ir_version=10)

    if op == "Scatter":  # onnx's reference has no Scatter: it is ScatterElements without reductions
        return _with_op(build([list(inputs["d"].shape)]), "Scatter")
    return build([list(y.shape) for y in ReferenceEvaluator(build([None] * n_out)).run(None, inputs)])


def _with_op(model, op):
    model.graph.node[0].op_type = op
    return model


def _reference(model):
    if model.graph.node[0].op_type == "Scatter":
        m = _with_op(type(model).FromString(model.SerializeToString()), "ScatterElements")
        m.opset_import[0].version = 11
        return ReferenceEvaluator(m)
    return ReferenceEvaluator(model)


_RNG = np.random.default_rng(0)


def _x(*shape):
    return _RNG.standard_normal(shape).astype(F)


# (id, op, opset, attrs, good inputs, bad inputs (same shapes), n_out)
CASES = [
    ("gather", "Gather", 21, dict(axis=0),
     {"d": _x(4, 2), "i": np.array([-4, 0, 3], I)}, {"i": np.array([0, 4, 1], I)}, 1),
    ("gather-negative", "Gather", 21, dict(axis=1),
     {"d": _x(2, 3), "i": np.array([-1, 2], I)}, {"i": np.array([-4, 0], I)}, 1),
    ("gather-elements", "GatherElements", 21, dict(axis=1),
     {"d": _x(2, 3), "i": np.array([[-1, 0, 2], [1, 2, -3]], I)}, {"i": np.array([[0, 3, 0], [0, 0, 0]], I)}, 1),
    ("scatter-elements", "ScatterElements", 21, dict(axis=0),
     {"d": _x(3, 3), "i": np.array([[-1, 0, 2]], I), "u": _x(1, 3)}, {"i": np.array([[0, -4, 1]], I)}, 1),
    ("scatter-opset10", "Scatter", 10, dict(axis=1),
     {"d": _x(2, 3), "i": np.array([[2], [-3]], I), "u": _x(2, 1)}, {"i": np.array([[3], [0]], I)}, 1),
    # per-column bounds: column 0 indexes an axis of 2, column 1 an axis of 3
    ("gathernd", "GatherND", 21, {},
     {"d": _x(2, 3), "i": np.array([[1, -1], [-2, 2]], I)}, {"i": np.array([[2, 0], [0, 0]], I)}, 1),
    ("gathernd-batch", "GatherND", 21, dict(batch_dims=1),
     {"d": _x(2, 3, 4), "i": np.array([[[2]], [[-3]]], I)}, {"i": np.array([[[0]], [[3]]], I)}, 1),
    ("scatternd", "ScatterND", 21, {},
     {"d": _x(4, 2), "i": np.array([[-1], [1]], I), "u": _x(2, 2)}, {"i": np.array([[4], [1]], I)}, 1),
    ("scatternd-column", "ScatterND", 21, {},
     {"d": _x(2, 3), "i": np.array([[1, -3]], I), "u": _x(1)}, {"i": np.array([[-3, 0]], I)}, 1),
    ("reverse-sequence", "ReverseSequence", 21, dict(time_axis=0, batch_axis=1),
     {"x": _x(4, 3), "lens": np.array([4, 0, 2], I)}, {"lens": np.array([5, 1, 1], I)}, 1),
    ("reverse-sequence-negative", "ReverseSequence", 21, dict(time_axis=1, batch_axis=0),
     {"x": _x(2, 4), "lens": np.array([1, 3], I)}, {"lens": np.array([-1, 3], I)}, 1),
    ("tensor-scatter", "TensorScatter", 24, dict(axis=-2),
     {"past": _x(2, 5, 2), "upd": _x(2, 2, 2), "wi": np.array([3, 0], I)}, {"wi": np.array([4, 0], I)}, 1),
    ("rotary", "RotaryEmbedding", 23, {},
     {"x": _x(1, 2, 2, 4), "cos": _x(3, 2), "sin": _x(3, 2), "pos": np.array([[0, 2]], I)},
     {"pos": np.array([[0, 3]], I)}, 1),
    ("rotary-negative", "RotaryEmbedding", 23, {},
     {"x": _x(1, 2, 2, 4), "cos": _x(3, 2), "sin": _x(3, 2), "pos": np.array([[1, 2]], I)},
     {"pos": np.array([[-1, 0]], I)}, 1),
    ("maxunpool", "MaxUnpool", 21, dict(kernel_shape=[2], strides=[2]),
     {"x": _x(1, 1, 2), "i": np.array([[[1, 2]]], I)}, {"i": np.array([[[1, 4]]], I)}, 1),
    ("nll", "NegativeLogLikelihoodLoss", 21, dict(reduction="none"),
     {"x": _x(3, 4), "t": np.array([0, 3, 1], I)}, {"t": np.array([0, 4, 1], I)}, 1),
    # reduction "sum": with ignore_index, onnx's reference divides a "mean" by the count of all
    # targets, ONNX Runtime (and lockstep) by the non-ignored ones
    ("nll-ignore", "NegativeLogLikelihoodLoss", 21, dict(reduction="sum", ignore_index=-1),
     {"x": _x(3, 4), "t": np.array([0, -1, 2], I)}, {"t": np.array([0, -2, 2], I)}, 1),
    ("sce", "SoftmaxCrossEntropyLoss", 21, dict(reduction="sum"),
     {"x": _x(2, 3, 2), "t": np.array([[2, 0], [1, 1]], I)}, {"t": np.array([[2, 0], [-1, 1]], I)}, 2),
    ("sce-ignore", "SoftmaxCrossEntropyLoss", 21, dict(reduction="none", ignore_index=7),
     {"x": _x(2, 3), "t": np.array([7, 2], I)}, {"t": np.array([3, 2], I)}, 1),
]


# ONNX Runtime 1.31's CPU provider refuses every bad case above except negative loss targets, which
# its function body (GatherElements) wraps; the ONNX spec allows only [0, C) or ignore_index there.
ORT_ACCEPTS = {"nll-ignore", "sce"}


def _onnxruntime_131():
    """ONNX Runtime, for tests recording its outcomes; observed with 1.31 (older: a visible skip)."""
    import onnxruntime

    if tuple(int(x) for x in onnxruntime.__version__.split(".")[:2]) < (1, 31):
        pytest.skip(f"ONNX Runtime's outcomes here were recorded with 1.31, this is {onnxruntime.__version__}")
    return onnxruntime


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_onnxruntime_outcome_on_the_bad_cases(case):
    """Data about ONNX Runtime, not a lockstep contract: which of these it refuses too."""
    onnxruntime = _onnxruntime_131()

    _id, op, opset, attrs, good, bad, n_out = case
    model = _model(op, good, n_out, opset, **attrs)
    sess = onnxruntime.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    sess.run(None, good)
    if _id in ORT_ACCEPTS:
        sess.run(None, {**good, **bad})
    else:
        from onnxruntime.capi.onnxruntime_pybind11_state import Fail, InvalidArgument, RuntimeException

        with pytest.raises((Fail, InvalidArgument, RuntimeException)):
            sess.run(None, {**good, **bad})


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_index_out_of_range_is_a_device_assert_naming_the_node(make_runtime, case):
    _id, op, opset, attrs, good, bad, n_out = case
    model = _model(op, good, n_out, opset, **attrs)
    rt = make_runtime()
    ex = Executor(model, rt)
    want = _reference(model).run(None, good)
    got = ex.run(good)
    for i, w in enumerate(want):
        np.testing.assert_allclose(got[f"y{i}"], w, rtol=1e-5, atol=1e-6)
    downloads = rt.counters.downloads
    with pytest.raises(DeviceAssert, match=f"{op}_under_test"):
        ex.run({**good, **bad})
    assert rt.counters.downloads == downloads, "no readback of the indices before the outputs' read"
    rt.reset_error_latch()
    again = ex.run(good)
    for i, w in enumerate(want):
        np.testing.assert_allclose(again[f"y{i}"], w, rtol=1e-5, atol=1e-6)


def test_onehot_accepts_any_index(make_runtime):
    """OneHot is defined for out-of-range indices (a row of "off" values): no latch."""
    good = {"i": np.array([0, 5, -7, 2], I), "depth": np.array(3, I), "v": np.array([0, 1], F)}
    model = _model("OneHot", good, 1, 21)
    got = Executor(model, make_runtime()).run(good)["y0"]
    np.testing.assert_array_equal(got, ReferenceEvaluator(model).run(None, good)[0])


def test_tensor_scatter_circular_wraps_any_write_index(make_runtime):
    good = {"past": _x(1, 4, 2), "upd": _x(1, 3, 2), "wi": np.array([6], I)}
    model = _model("TensorScatter", good, 1, 24, axis=-2, mode="circular")
    got = Executor(model, make_runtime()).run(good)["y0"]
    np.testing.assert_allclose(got, ReferenceEvaluator(model).run(None, good)[0])


def test_rotary_position_past_its_cache_in_a_decode_is_a_device_assert(make_runtime):
    """A golden-shaped RotaryEmbedding with its caches as initializers: position 512 of a 512-row
    cache is flagged (it used to raise IndexError inside the kernel, a sticky LaunchFailure)."""
    cos = numpy_helper.from_array(_x(512, 2), "cos")
    sin = numpy_helper.from_array(_x(512, 2), "sin")
    node = helper.make_node("RotaryEmbedding", ["x", "cos", "sin", "pos"], ["y"], name="rope_layer0")
    g = helper.make_graph([node], "g", [helper.make_tensor_value_info("x", 1, [1, 1, 1, 4]),
                                        helper.make_tensor_value_info("pos", 7, [1, 1])],
                          [helper.make_tensor_value_info("y", 1, [1, 1, 1, 4])], initializer=[cos, sin])
    model = helper.make_model(g, opset_imports=[helper.make_opsetid("", 23)], ir_version=10)
    rt = make_runtime()
    ex = Executor(model, rt)
    x = _x(1, 1, 1, 4)
    ex.run({"x": x, "pos": np.array([[511]], I)})
    with pytest.raises(DeviceAssert, match="rope_layer0"):
        ex.run({"x": x, "pos": np.array([[512]], I)})
    rt.reset_error_latch()
    ok = {"x": x, "pos": np.array([[5]], I)}
    np.testing.assert_allclose(ex.run(ok)["y"], ReferenceEvaluator(model).run(None, ok)[0], rtol=1e-6)


# -- the decode position limit ---------------------------------------------------------------------

def _golden(name):
    import onnx
    from lockstep.golden.anchors import MODEL_DIR

    return onnx.load(str(MODEL_DIR / f"{name}.onnx"))


@pytest.mark.parametrize("name", ["tiny-fp32-standard", "tiny-fp32-decomposed"])
def test_golden_model_past_its_rotary_cache_is_a_device_assert(make_runtime, name):
    """Running a golden model at position 512 (its caches have 512 rows) without the decode check
    flags the node that reads the cache: a resettable DeviceAssert, not a sticky device fault."""
    model = _golden(name)
    rt = make_runtime()
    ex = Executor(model, rt)
    empty = np.zeros((1, 2, 0, 16), F)
    feeds = {"input_ids": np.array([[65]], I), "position_ids": np.array([[512]], I),
             **{vi.name: empty for vi in model.graph.input if vi.name.startswith("past_key_values")}}
    # the first node to flag (the q/k rotations fused into one step are named after both: 'a+b')
    node = r"'(layers.0/q_rope\+)?layers.0/[qk]_rope'" if "standard" in name else "'rope/cos_half'"
    with pytest.raises(DeviceAssert, match=node):
        ex.run(feeds)
    rt.reset_error_latch()
    ex.run({**feeds, "position_ids": np.array([[511]], I)})


@pytest.mark.parametrize("which", ["ref-sim", "ort-cpu", "host-kv"])
@pytest.mark.parametrize("model_name", ["tiny-fp32-standard", "tiny-fp32-decomposed", "tiny-int4-genai"])
def test_decode_refuses_a_context_past_the_model_limit_before_running(which, model_name):
    """prompt + tokens crossing the 512 rows of the rotary cache: refused by greedy and
    teacher_force before anything runs, and by a session's step at the limit, on every engine."""
    from lockstep.decoding import ContextLimitExceeded, HostKVSession, greedy, open_session, teacher_force
    from lockstep.engines.registry import load_engine

    model = _golden(model_name)
    if which == "host-kv":  # lockstep's own session over any engine's prepare
        session = HostKVSession(model, load_engine("ref-sim").prepare(model))
    else:
        session = open_session(load_engine(which), model)
    calls = []
    forward = session.forward
    session.forward = lambda ids: calls.append(len(ids)) or forward(ids)
    limit = "position limit 512 exceeded.*rope.cos_cache"
    with pytest.raises(ContextLimitExceeded, match=limit):
        greedy(session, [65] * 510, 4)  # would feed positions 0..512
    with pytest.raises(ContextLimitExceeded, match=limit):
        teacher_force(session, [65] * 513, stepwise=True)
    assert calls == [], "refused before running"
    session.reset()
    session.forward([65] * 511)
    session.forward([66])  # position 511, the last row
    with pytest.raises(ContextLimitExceeded, match=r"position 512 \+ 1 tokens would use position 512"):
        session.forward([67])


def test_greedy_up_to_the_limit_runs():
    from lockstep.decoding import greedy, open_session
    from lockstep.engines.registry import load_engine

    session = open_session(load_engine("ref-sim"), _golden("tiny-fp32-standard"))
    res = greedy(session, [65] * 509, 4)  # positions 0..511
    assert len(res.tokens) == 4


# -- GroupQueryAttention's seqlens_k (com.microsoft; onnx's reference has no contrib ops: ORT is the oracle)

_GQA = {  # case, good seqlens_k, bad seqlens_k (ORT refuses each bad one)
    "decode-growing": (dict(B=2, S=1, nq=4, nkv=2, D=16, P=6, T=7, rot=16), [6, 3], [7, 3]),
    "decode-negative": (dict(B=2, S=1, nq=4, nkv=2, D=16, P=6, T=7, rot=16), [0, 3], [-1, 3]),
    "prefill": (dict(B=2, S=4, nq=4, nkv=2, D=16, P=None, T=4, rot=16), [3, 1], [4, 3]),
    "chunk-negative-past": (dict(B=1, S=3, nq=4, nkv=2, D=16, P=5, T=8, rot=16), [7], [1]),
    "static-capacity": (dict(B=1, S=1, nq=4, nkv=2, D=16, P=10, T=7), [9], [10]),
    # a static cache of 10 with an 8-row rotary cache: position 8 has no row
    "static-rotary-rows": (dict(B=1, S=1, nq=4, nkv=2, D=16, P=10, T=7, rot=16), [7], [8]),
}


@pytest.mark.parametrize("name", list(_GQA))
def test_group_query_attention_seqlens_out_of_range_is_a_device_assert(make_runtime, name):
    from test_contrib_ops import _ORT, _gqa_case
    from test_contrib_ops import _model as contrib_model

    case, good, bad = _GQA[name]
    node, feeds, outs = _gqa_case(np.random.default_rng(7), seqlens=good, **case)
    if name == "static-rotary-rows":
        feeds["cos"], feeds["sin"] = feeds["cos"][:8], feeds["sin"][:8]
    node.name = "gqa_under_test"
    model = contrib_model(node, feeds, outs)
    rt = make_runtime()
    ex = Executor(model, rt)
    want = _ORT.prepare(model)(feeds)
    got = ex.run(feeds)
    for w, o in zip(want, outs):
        np.testing.assert_allclose(got[o[0]], w, rtol=1e-4, atol=1e-5)
    bad_feeds = {**feeds, "sk": np.asarray(bad, np.int32)}
    with pytest.raises(DeviceAssert, match="gqa_under_test"):
        ex.run(bad_feeds)
    rt.reset_error_latch()
    np.testing.assert_allclose(ex.run(feeds)[outs[0][0]], want[0], rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("name", list(_GQA))
def test_onnxruntime_refuses_the_bad_seqlens_too(name):
    """Data about ONNX Runtime (1.31), not a lockstep contract: it refuses each bad seqlens_k above."""
    _onnxruntime_131()
    from test_contrib_ops import _ORT, _gqa_case
    from test_contrib_ops import _model as contrib_model

    case, _good, bad = _GQA[name]
    node, feeds, outs = _gqa_case(np.random.default_rng(7), seqlens=bad, **case)
    if name == "static-rotary-rows":
        feeds["cos"], feeds["sin"] = feeds["cos"][:8], feeds["sin"][:8]
    with pytest.raises(Exception, match="seqlens_k"):
        _ORT.prepare(contrib_model(node, feeds, outs))(feeds)


def test_an_index_out_of_range_in_a_replayed_graph_is_raised(make_runtime):
    """Contract: a kernel of a replayed graph may set the latch too: after a replay whose Gather
    reads an out-of-range index, the next synchronising read raises DeviceAssert naming the node
    (the runtime skips a latch read only when nothing that could set it ran since the last one)."""
    from lockstep.reference_runtime.segments import CaptureSession

    data = np.arange(8, dtype=F).reshape(4, 2)
    node = helper.make_node("Gather", ["d", "i"], ["y"], name="Gather_under_test")
    g = helper.make_graph([node], "g", [helper.make_tensor_value_info("i", 7, [1])],
                          [helper.make_tensor_value_info("y", 1, [1, 2])], [numpy_helper.from_array(data, "d")])
    model = helper.make_model(g, opset_imports=[helper.make_opsetid("", 13)], ir_version=10)
    session = CaptureSession(Executor(model, make_runtime()))
    for k in (1, 2):  # eager warm-up, then recorded and replayed
        assert session.run({"i": np.asarray([k], I)})["y"].tolist() == [data[k].tolist()]
    assert session.counters.captures == 1
    with pytest.raises(DeviceAssert, match="Gather_under_test"):
        session.run({"i": np.asarray([7], I)})  # a replay: only the graph touched the latch
    assert session.counters.replays == 2
