"""Sequences, optionals and string tensors (reference_runtime/host_values.py, kernels/ops_sequence.py,
kernels/ops_string.py): what ONNX's node cases do not cover — named errors for bad positions, feeds
and attributes, string graphs end to end through the engine protocol, capture seams, the harness's
comparison of sequences, and ONNX Runtime with a sequence feed."""

from __future__ import annotations

import numpy as np
import pytest
from lockstep.kernels._op import OpError
from lockstep.reference_runtime import Runtime, RuntimeConfig
from lockstep.reference_runtime.backends.sim import SimDevice
from lockstep.reference_runtime.capture_plan import plan_capture
from lockstep.reference_runtime.engine import RefEngine
from lockstep.reference_runtime.executor import Executor, FeedError
from lockstep.reference_runtime.node_cases import NodeCase, assert_similar, run_case
from lockstep.reference_runtime.segments import CaptureSession
from onnx import TensorProto as TP
from onnx import helper

from lockstep.engines.registry import load_engine

_SEQ_F = helper.make_tensor_sequence_value_info
_T = helper.make_tensor_value_info


def _model(nodes, inputs, outputs, opset=21, extra=()):
    g = helper.make_graph(nodes, "g", inputs, outputs)
    return helper.make_model(g, ir_version=10, opset_imports=[helper.make_opsetid("", opset), *extra])


def _ex(model):
    return Executor(model, Runtime(SimDevice(), RuntimeConfig()))


def _seq_at_model():
    return _model([helper.make_node("SequenceAt", ["s", "p"], ["y"])],
                  [_SEQ_F("s", TP.FLOAT, None), _T("p", TP.INT64, [])], [_T("y", TP.FLOAT, ["n"])])


def test_sequence_at_returns_the_element_and_refuses_a_position_out_of_range():
    ex = _ex(_seq_at_model())
    seq = [np.arange(3, dtype=np.float32), np.ones(2, np.float32)]
    got = ex.run({"s": seq, "p": np.array(-1)})["y"]
    np.testing.assert_array_equal(got, seq[1], err_msg="result: position -1 is the last element")
    with pytest.raises(OpError, match=r"position 2 is out of range \[-2, 1\] for a sequence of length 2"):
        ex.run({"s": seq, "p": np.array(2)})
    with pytest.raises(OpError, match="SequenceAt.*position -3"):
        ex.run({"s": seq, "p": np.array(-3)})


def test_sequence_insert_and_erase_refuse_bad_positions_by_name():
    ins = _model([helper.make_node("SequenceInsert", ["s", "t", "p"], ["y"])],
                 [_SEQ_F("s", TP.FLOAT, None), _T("t", TP.FLOAT, ["k"]), _T("p", TP.INT64, ["q"])],
                 [_SEQ_F("y", TP.FLOAT, None)])
    ex = _ex(ins)
    s, t = [np.zeros(2, np.float32)], np.ones(1, np.float32)
    out = ex.run({"s": s, "t": t, "p": np.array([1])})["y"]
    assert [x.tolist() for x in out] == [[0.0, 0.0], [1.0]], "result: inserted at the back (position n)"
    with pytest.raises(OpError, match=r"position 2 is out of range \[-1, 1\]"):
        ex.run({"s": s, "t": t, "p": np.array([2])})
    with pytest.raises(OpError, match="position must be a scalar int32/int64 tensor, got int64\\[2\\]"):
        ex.run({"s": s, "t": t, "p": np.array([0, 1])})
    erase = _ex(_model([helper.make_node("SequenceErase", ["s"], ["y"])], [_SEQ_F("s", TP.FLOAT, None)],
                       [_SEQ_F("y", TP.FLOAT, None)]))
    with pytest.raises(OpError, match="cannot erase from an empty sequence"):
        erase.run({"s": []})


def test_feeds_of_the_wrong_kind_are_feed_errors_naming_the_input():
    ex = _ex(_seq_at_model())
    with pytest.raises(FeedError, match="input 's': a sequence of tensor.* takes a list of arrays, got ndarray"):
        ex.run({"s": np.zeros(2, np.float32), "p": np.array(0)})
    with pytest.raises(FeedError, match=r"input 's\[1\]': dtype int32 given, float32 declared"):
        ex.run({"s": [np.zeros(2, np.float32), np.zeros(2, np.int32)], "p": np.array(0)})
    floats = _ex(_model([helper.make_node("Relu", ["x"], ["y"])], [_T("x", TP.FLOAT, [2])], [_T("y", TP.FLOAT, [2])]))
    with pytest.raises(FeedError, match="input 'x': dtype object given, float32 declared"):
        floats.run({"x": np.array(["a", "b"], dtype=object)})
    strings = _ex(_model([helper.make_node("Identity", ["x"], ["y"])], [_T("x", TP.STRING, [2])],
                         [_T("y", TP.STRING, [2])]))
    with pytest.raises(FeedError, match="input 'x': dtype float32 given, object declared"):
        strings.run({"x": np.zeros(2, np.float32)})
    with pytest.raises(FeedError, match="holds only str elements"):
        strings.run({"x": np.array(["a", 1], dtype=object)})


def _string_graph():
    """StringConcat -> RegexFullMatch, and Equal on strings -> Cast -> Add (a device node after a host one)."""
    nodes = [
        helper.make_node("StringConcat", ["a", "b"], ["ab"]),
        helper.make_node("RegexFullMatch", ["ab"], ["m"], pattern=r"[a-z]+@[a-z]+\.com"),
        helper.make_node("Equal", ["a", "b"], ["eq"]),
        helper.make_node("Cast", ["eq"], ["eqf"], to=TP.FLOAT),
        helper.make_node("Add", ["eqf", "w"], ["score"]),
    ]
    return _model(nodes, [_T("a", TP.STRING, [3]), _T("b", TP.STRING, [3]), _T("w", TP.FLOAT, [3])],
                  [_T("ab", TP.STRING, [3]), _T("m", TP.BOOL, [3]), _T("score", TP.FLOAT, [3])])


_A = np.array(["joe@", "x", "ann@"], dtype=object)
_B = np.array(["site.com", "x", "Site.com"], dtype=object)


def test_a_string_graph_runs_end_to_end_through_the_engine_protocol():
    run = RefEngine("sim").prepare(_string_graph())
    ab, m, score = run({"a": _A, "b": _B, "w": np.full(3, 0.5, np.float32)})
    assert ab.dtype == object and ab.tolist() == ["joe@site.com", "xx", "ann@Site.com"], "result: StringConcat"
    assert m.tolist() == [True, False, False], "result: RegexFullMatch (Python re, case-sensitive)"
    assert score.dtype == np.float32 and score.tolist() == [0.5, 1.5, 0.5], "result: Equal on strings, then the device"


def test_host_nodes_are_capture_seams_and_a_capture_session_runs_around_them():
    ex = _ex(_string_graph())
    feeds = {"a": _A, "b": _B, "w": np.full(3, 0.5, np.float32)}
    ex.run(feeds)  # warms the nodes: Equal on strings is found to run on the host
    plan = dict(plan_capture(ex).decisions)
    names = {st.info.op_type: st.info.name for st in ex.steps}
    for op in ("StringConcat", "RegexFullMatch", "Equal"):
        assert plan[names[op]] == f"host values: {op}", f"contract: {op} on strings is a host seam"
    assert plan[names["Add"]] is None, "contract: the device node after them is admitted"
    sess = CaptureSession(ex, warmup=1)
    for _ in range(3):
        out = sess.run(feeds)
        assert out["score"].tolist() == [0.5, 1.5, 0.5], "result: same outputs eager and captured"
        assert out["ab"].tolist() == ["joe@site.com", "xx", "ann@Site.com"], "result: host outputs come back"
    assert ex.plans is None, "contract: no execution plan replays a graph with host nodes"


def test_a_plan_previewed_before_any_run_is_not_kept_past_a_host_seam_the_run_finds():
    """Contract: a capture session keeps its plans by the nodes the executor has found to be host
    seams too. Equal handed strings is a device kernel until a run finds it on the host; a plan
    previewed before that run (as the capture-guard pass does) must not be the one the session
    records with."""
    ex = _ex(_string_graph())
    feeds = {"a": _A, "b": _B, "w": np.full(3, 0.5, np.float32)}
    sess = CaptureSession(ex, warmup=1)
    equal = next(st.info.name for st in ex.steps if st.info.op_type == "Equal")
    assert dict(sess.preview_plan().decisions)[equal] is None, "result: before a run, Equal looks capturable"
    for _ in range(2):
        out = sess.run(feeds)
    assert dict(sess.plan.decisions)[equal] == "host values: Equal", "contract: the plan recorded with names the seam"
    assert out["score"].tolist() == [0.5, 1.5, 0.5], "result: the captured run's outputs"


def test_bad_string_attributes_are_refused_at_load():
    def one(node, out_type=TP.BOOL, domain=()):
        return _model([node], [_T("x", TP.STRING, [2])], [_T("y", out_type, [2])], extra=domain)

    with pytest.raises(OpError, match=r"pattern='\(' is not a valid regular expression"):
        _ex(one(helper.make_node("RegexFullMatch", ["x"], ["y"], pattern="(")))
    with pytest.raises(OpError, match="case_change_action='TITLE'"):
        _ex(one(helper.make_node("StringNormalizer", ["x"], ["y"], case_change_action="TITLE"), TP.STRING))
    with pytest.raises(OpError, match="maxsplit=-1"):
        _ex(_model([helper.make_node("StringSplit", ["x"], ["y", "n"], maxsplit=-1)], [_T("x", TP.STRING, [2])],
                   [_T("y", TP.STRING, [2, "w"]), _T("n", TP.INT64, [2])]))
    ml = [helper.make_opsetid("ai.onnx.ml", 4)]
    with pytest.raises(OpError, match="2 keys but 1 values"):
        _ex(one(helper.make_node("LabelEncoder", ["x"], ["y"], domain="ai.onnx.ml", keys_strings=["a", "b"],
                                 values_int64s=[1]), TP.INT64, ml))


def test_label_encoder_maps_strings_to_ints_with_its_default():
    ml = [helper.make_opsetid("ai.onnx.ml", 4)]
    m = _model([helper.make_node("LabelEncoder", ["x"], ["y"], domain="ai.onnx.ml", keys_strings=["a", "b"],
                                 values_int64s=[7, 8], default_int64=-5)],
               [_T("x", TP.STRING, [3])], [_T("y", TP.INT64, [3])], extra=ml)
    y = _ex(m).run({"x": np.array(["b", "zz", "a"], dtype=object)})["y"]
    assert y.dtype == np.int64 and y.tolist() == [8, -5, 7], "result: mapped, the unknown key to default_int64"


def test_an_optional_output_comes_back_as_none_and_a_sequence_cannot_be_kept():
    opt = helper.make_tensor_type_proto(TP.FLOAT, None)
    m = _model([helper.make_node("Optional", [], ["o"], type=opt),
                helper.make_node("OptionalHasElement", ["o"], ["h"])], [],
               [helper.make_value_info("o", helper.make_optional_type_proto(opt)), _T("h", TP.BOOL, [])])
    out = _ex(m).run({})
    assert out["o"] is None and out["h"].tolist() is False, "result: an empty optional, and it has no element"
    split = _model([helper.make_node("SplitToSequence", ["x"], ["s"], axis=0, keepdims=0)],
                   [_T("x", TP.FLOAT, [2, 3])], [_SEQ_F("s", TP.FLOAT, None)])
    ex = _ex(split)
    x = np.arange(6, dtype=np.float32).reshape(2, 3)
    assert [a.tolist() for a in ex.run({"x": x})["s"]] == x.tolist(), "result: rows, the axis squeezed"
    with pytest.raises(FeedError, match="output 's' is not a device tensor"):
        ex.run({"x": x}, keep={"s"})


def test_the_harness_compares_sequences_by_length_and_element():
    a = [np.zeros(2, np.float32), np.ones(1, np.float32)]
    assert_similar([a, None], [list(a), None], 1e-6, 0.0)
    with pytest.raises(AssertionError, match="a sequence of 1 tensors, 2 expected"):
        assert_similar([a], [a[:1]], 1e-6, 0.0)  # ONNX's runner alone iterates the shorter one: passes
    with pytest.raises(AssertionError, match="element 1"):
        assert_similar([a], [[a[0], np.full(1, 2, np.float32)]], 1e-6, 0.0)
    with pytest.raises(AssertionError, match="an empty optional expected"):
        assert_similar([None], [a[0]], 1e-6, 0.0)


class _TensorsOnly:
    """An engine that declares no ``values``: never handed a sequence."""

    name = "tensors-only"

    def available(self):
        return True, ""

    def prepare(self, model):
        raise AssertionError("a sequence case must not reach an engine that takes no sequences")


def test_an_engine_without_sequence_values_reports_the_case_unsupported():
    case = NodeCase("seq", _seq_at_model().SerializeToString(), [[np.zeros(1, np.float32)], np.array(0)],
                    [np.zeros(1, np.float32)], 1e-6, 0.0)
    out = run_case(_TensorsOnly(), case)
    assert (out.status, out.detail) == ("unsupported", "tensors-only takes no sequence values"), "contract: a clean Unsupported"
    assert run_case(RefEngine("sim"), case).status == "passed", "result: ref-sim takes it"


_ORT = load_engine("ort-cpu")


@pytest.mark.skipif(not _ORT.available()[0], reason=f"ort-cpu: {_ORT.available()[1]}")
def test_ort_takes_a_sequence_feed_and_returns_a_sequence():
    m = _model([helper.make_node("SequenceInsert", ["s", "t"], ["y"]),
                helper.make_node("ConcatFromSequence", ["y"], ["c"], axis=0)],
               [_SEQ_F("s", TP.FLOAT, None), _T("t", TP.FLOAT, [1])], [_SEQ_F("y", TP.FLOAT, None), _T("c", TP.FLOAT, ["m"])],
               opset=18)
    feeds = {"s": [np.zeros(2, np.float32), np.ones(1, np.float32)], "t": np.full(1, 3, np.float32)}
    y, c = _ORT.prepare(m)(feeds)
    ry, rc = RefEngine("sim").prepare(m)(feeds)
    assert isinstance(y, list) and [a.tolist() for a in y] == [[0, 0], [1], [3]], "result: ORT's sequence output"
    assert_similar([y, c], [ry, rc], 0.0, 0.0)
    assert c.tolist() == [0, 0, 1, 3], "result: concatenated"


def test_construct_erase_length_and_concat_from_sequence_which_no_node_case_covers():
    nodes = [helper.make_node("SequenceConstruct", ["a", "b", "c"], ["s"]),
             helper.make_node("SequenceErase", ["s", "p"], ["e"]),
             helper.make_node("SequenceLength", ["e"], ["n"]),
             helper.make_node("ConcatFromSequence", ["e"], ["stacked"], axis=-1, new_axis=1),
             helper.make_node("ConcatFromSequence", ["s"], ["joined"], axis=0)]
    m = _model(nodes, [_T(k, TP.FLOAT, [2, 3]) for k in "abc"] + [_T("p", TP.INT64, [])],
               [_T("n", TP.INT64, []), _T("stacked", TP.FLOAT, [2, 3, 2]), _T("joined", TP.FLOAT, [6, 3])])
    a, b, c = (np.arange(6, dtype=np.float32).reshape(2, 3) + 10 * k for k in range(3))
    out = _ex(m).run({"a": a, "b": b, "c": c, "p": np.array(-2)})
    assert out["n"].dtype == np.int64 and out["n"].tolist() == 2, "result: one of three erased"
    np.testing.assert_array_equal(out["stacked"], np.stack([a, c], axis=-1), err_msg="result: b erased, stacked last")
    np.testing.assert_array_equal(out["joined"], np.concatenate([a, b, c]), err_msg="result: concatenated on axis 0")
    bad = _model([helper.make_node("SequenceConstruct", ["a"], ["s"]),
                  helper.make_node("ConcatFromSequence", ["s"], ["y"], axis=3)],
                 [_T("a", TP.FLOAT, [2, 3])], [_T("y", TP.FLOAT, [2, 3])])
    with pytest.raises(OpError, match="ConcatFromSequence.*axis 3 out of range for rank 2"):
        _ex(bad).run({"a": a})


@pytest.mark.skipif(not _ORT.available()[0], reason=f"ort-cpu: {_ORT.available()[1]}")
def test_ort_and_ref_sim_agree_on_an_optional_feed_empty_and_full():
    opt = helper.make_optional_type_proto(helper.make_tensor_type_proto(TP.FLOAT, ["n"]))
    m = _model([helper.make_node("OptionalHasElement", ["o"], ["h"]), helper.make_node("Identity", ["o"], ["o2"])],
               [helper.make_value_info("o", opt)], [_T("h", TP.BOOL, []), helper.make_value_info("o2", opt)], opset=16)
    m.ir_version = 8
    for feed in (None, np.ones(2, np.float32)):
        want, got = _ORT.prepare(m)({"o": feed}), RefEngine("sim").prepare(m)({"o": feed})
        assert want[0].tolist() is (feed is not None), "result: ORT says whether the optional holds a value"
        assert_similar(want, got, 0.0, 0.0)
