"""Control flow run by the executor (``reference_runtime.control_flow``): what ONNX's node cases do
not cover. A nested If inside a Loop reading an outer-scope value, a body's unsupported op and bad
attributes refused at load naming the node, a Loop of zero iterations, Scan's reversed and
re-axed outputs, host-read conditions that change per run, the temporaries freed, and capture
on a model with an If (the If an eager seam, the rest captured, bytes equal to eager); capture of
control flow whose trip count is fixed (a Scan, a Loop with a constant trip count and a passed-through
condition, a FlexAttention's modifiers) when the body is capture-safe, recorded in a segment,
replayed with the eager bytes (under the capture guard too), its temporaries retained and freed
with the graph, past the memory budget a recording failure; otherwise a seam naming the reason."""

from __future__ import annotations

import gc

import numpy as np
import pytest
from onnx import TensorProto as T
from onnx import helper as h

from lockstep.kernels._op import OpError
from lockstep.reference_runtime import Runtime, RuntimeConfig
from lockstep.reference_runtime.backends.sim import SimDevice
from lockstep.reference_runtime.executor import Executor, UnsupportedModel
from lockstep.reference_runtime.segments import CaptureSession

OPSET = [h.make_opsetid("", 21)]


def _run(model, feeds, runtime=None):
    ex = Executor(model, runtime or Runtime(SimDevice(), RuntimeConfig()))
    return ex, ex.run(feeds)


def _scalar(name, elem):
    return h.make_tensor_value_info(name, elem, [])


def _nested_if_in_loop_model():
    """w = 2 * w_in (an outer-scope value the nested If reads); Loop M times over x: iteration 0
    subtracts w, later iterations add it (If on ``i > 0`` inside the body); the scan output
    collects each iteration's value."""
    then_g = h.make_graph([h.make_node("Add", ["x_c", "w"], ["t_out"], name="then_add")], "then", [],
                          [h.make_tensor_value_info("t_out", T.FLOAT, [3])])
    else_g = h.make_graph([h.make_node("Sub", ["x_c", "w"], ["e_out"], name="else_sub")], "else", [],
                          [h.make_tensor_value_info("e_out", T.FLOAT, [3])])
    body = h.make_graph(
        [h.make_node("Greater", ["i", "zero"], ["later"], name="later"),
         h.make_node("If", ["later"], ["x_next"], name="inner_if", then_branch=then_g, else_branch=else_g),
         h.make_node("Identity", ["cond_in"], ["cond_out"], name="keep_going"),
         h.make_node("Identity", ["x_next"], ["x_scan"], name="collect")],
        "body",
        [_scalar("i", T.INT64), _scalar("cond_in", T.BOOL), h.make_tensor_value_info("x_c", T.FLOAT, [3])],
        [_scalar("cond_out", T.BOOL), h.make_tensor_value_info("x_next", T.FLOAT, [3]),
         h.make_tensor_value_info("x_scan", T.FLOAT, [3])],
        initializer=[h.make_tensor("zero", T.INT64, [], [0])])
    g = h.make_graph(
        [h.make_node("Mul", ["w_in", "two"], ["w"], name="double"),
         h.make_node("Loop", ["M", "", "x"], ["x_final", "xs"], name="loop", body=body)],
        "nested", [_scalar("M", T.INT64), h.make_tensor_value_info("x", T.FLOAT, [3]),
                   h.make_tensor_value_info("w_in", T.FLOAT, [3])],
        [h.make_tensor_value_info("x_final", T.FLOAT, [3]), h.make_tensor_value_info("xs", T.FLOAT, [None, 3])],
        initializer=[h.make_tensor("two", T.FLOAT, [], [2.0])])
    return h.make_model(g, opset_imports=OPSET, ir_version=10)


def test_nested_if_inside_a_loop_reads_an_outer_scope_value():
    x = np.array([1.0, 2.0, 3.0], np.float32)
    w_in = np.array([0.5, -1.0, 2.0], np.float32)
    _, out = _run(_nested_if_in_loop_model(), {"M": np.array(3, np.int64), "x": x, "w_in": w_in})
    w = 2 * w_in
    expect = [x - w, x - w + w, x - w + w + w]  # iteration 0 subtracts, 1 and 2 add
    np.testing.assert_array_equal(out["xs"], np.stack(expect)), "result: each iteration's value, stacked"
    np.testing.assert_array_equal(out["x_final"], expect[-1]), "result: the last loop-carried value"


def test_a_loop_of_zero_iterations_returns_its_initial_values_and_empty_scan_outputs():
    x = np.array([1.0, 2.0, 3.0], np.float32)
    _, out = _run(_nested_if_in_loop_model(), {"M": np.array(0, np.int64), "x": x, "w_in": np.ones(3, np.float32)})
    np.testing.assert_array_equal(out["x_final"], x), "result: no iteration: the initial value"
    assert out["xs"].shape == (0, 3) and out["xs"].dtype == np.float32, \
        "result: an empty scan output of the body's declared element type and shape"


def test_an_executor_with_control_flow_runs_each_run_node_by_node_and_frees_its_temporaries():
    rt = Runtime(SimDevice(), RuntimeConfig())
    ex = Executor(_nested_if_in_loop_model(), rt)
    assert ex.plans is None, "contract: no execution plan (a trip count changes shapes under one signature)"
    x, w_in = np.arange(3, dtype=np.float32), np.ones(3, np.float32)
    shapes = [ex.run({"M": np.array(m, np.int64), "x": x, "w_in": w_in})["xs"].shape for m in (2, 5, 1)]
    assert shapes == [(2, 3), (5, 3), (1, 3)], "result: each run's trip count, not the first run's"
    rt.synchronize()
    base = rt.device.allocated_bytes
    ex.run({"M": np.array(4, np.int64), "x": x, "w_in": w_in})
    rt.synchronize()
    assert rt.device.allocated_bytes == base, "contract: slices, iteration scalars and carried values freed"


def test_a_loop_ends_on_its_bodys_condition():
    """No trip count: the body's condition output (read on the host each iteration) ends it."""
    body = h.make_graph(
        [h.make_node("Add", ["s", "one"], ["s_next"], name="inc"),
         h.make_node("Less", ["s_next", "limit"], ["go"], name="go"),
         h.make_node("Identity", ["s_next"], ["s_trace"], name="trace")],
        "body", [_scalar("i", T.INT64), _scalar("c", T.BOOL), _scalar("s", T.FLOAT)],
        [_scalar("go", T.BOOL), _scalar("s_next", T.FLOAT), _scalar("s_trace", T.FLOAT)],
        initializer=[h.make_tensor("one", T.FLOAT, [], [1.0])])
    g = h.make_graph([h.make_node("Loop", ["", "c0", "s0"], ["s_final", "trace"], name="while", body=body)],
                     "while", [_scalar("c0", T.BOOL), _scalar("s0", T.FLOAT), _scalar("limit", T.FLOAT)],
                     [_scalar("s_final", T.FLOAT), h.make_tensor_value_info("trace", T.FLOAT, [None])])
    model = h.make_model(g, opset_imports=OPSET, ir_version=10)
    _, out = _run(model, {"c0": np.array(True), "s0": np.array(0.0, np.float32), "limit": np.array(3.5, np.float32)})
    np.testing.assert_array_equal(out["trace"], np.array([1, 2, 3, 4], np.float32)), \
        "result: runs until the body says stop (4 >= 3.5), that iteration included"
    assert float(out["s_final"]) == 4.0
    _, out = _run(model, {"c0": np.array(False), "s0": np.array(7.0, np.float32), "limit": np.array(3.5, np.float32)})
    assert float(out["s_final"]) == 7.0 and out["trace"].shape == (0,), "result: a false initial condition: no iteration"


def _scan_model(**attrs):
    body = h.make_graph(
        [h.make_node("Add", ["acc", "x_t"], ["acc_next"], name="acc"),
         h.make_node("Mul", ["x_t", "acc_next"], ["y_t"], name="y")],
        "body", [h.make_tensor_value_info("acc", T.FLOAT, [2]), h.make_tensor_value_info("x_t", T.FLOAT, [2])],
        [h.make_tensor_value_info("acc_next", T.FLOAT, [2]), h.make_tensor_value_info("y_t", T.FLOAT, [2])])
    g = h.make_graph([h.make_node("Scan", ["init", "xs"], ["final", "ys"], name="scan", body=body,
                                  num_scan_inputs=1, **attrs)],
                     "scan", [h.make_tensor_value_info("init", T.FLOAT, [2]), h.make_tensor_value_info("xs", T.FLOAT, [2, 4])],
                     [h.make_tensor_value_info("final", T.FLOAT, [2]), h.make_tensor_value_info("ys", T.FLOAT, [None, None])])
    return h.make_model(g, opset_imports=OPSET, ir_version=10)


def test_scan_over_axis_1_in_reverse_with_outputs_stacked_on_axis_1_in_reverse():
    init = np.array([1.0, -1.0], np.float32)
    xs = np.arange(8, dtype=np.float32).reshape(2, 4)
    _, out = _run(_scan_model(scan_input_axes=[1], scan_input_directions=[1], scan_output_axes=[-1],
                              scan_output_directions=[1]), {"init": init, "xs": xs})
    acc, ys = init.copy(), []
    for t in range(3, -1, -1):  # reversed over axis 1
        acc = acc + xs[:, t]
        ys.append(xs[:, t] * acc)
    np.testing.assert_array_equal(out["final"], acc), "result: the state after the last slice"
    np.testing.assert_array_equal(out["ys"], np.stack(ys[::-1], axis=1)), \
        "result: outputs stacked on axis 1, the first iteration's last"


@pytest.mark.parametrize("attrs, named", [
    ({"scan_input_directions": [2]}, "scan_input_directions"),
    ({"scan_output_axes": [0, 1]}, "scan_output_axes"),
])
def test_a_bad_scan_attribute_is_refused_at_load_naming_node_and_attribute(attrs, named):
    with pytest.raises(OpError, match=rf"'scan'.*{named}"):
        Executor(_scan_model(**attrs), Runtime(SimDevice(), RuntimeConfig()))


def test_a_scan_axis_out_of_range_is_a_named_error():
    ex = Executor(_scan_model(scan_input_axes=[2]), Runtime(SimDevice(), RuntimeConfig()))
    with pytest.raises(OpError, match=r"'scan'.*scan_input_axes.*out of range"):
        ex.run({"init": np.zeros(2, np.float32), "xs": np.zeros((2, 4), np.float32)})


def _loop_with_body(node, extra_opsets=(), n=2, initializer=()):
    body = h.make_graph([node, h.make_node("Identity", ["c"], ["c_out"], name="keep")], "body",
                        [_scalar("i", T.INT64), _scalar("c", T.BOOL), h.make_tensor_value_info("v", T.FLOAT, [n])],
                        [_scalar("c_out", T.BOOL), h.make_tensor_value_info("v_next", T.FLOAT, [n])],
                        initializer=list(initializer))
    g = h.make_graph([h.make_node("Loop", ["M", "", "v0"], ["v_final"], name="loop", body=body)], "loop",
                     [_scalar("M", T.INT64), h.make_tensor_value_info("v0", T.FLOAT, [n])],
                     [h.make_tensor_value_info("v_final", T.FLOAT, [n])])
    return h.make_model(g, opset_imports=OPSET + list(extra_opsets), ir_version=10)


def test_a_long_loop_frees_each_superseded_carried_value_within_the_memory_budget():
    """40 iterations over a 1 MiB carried value under an 8 MiB device budget: fits only if each
    iteration's superseded value is freed as the next replaces it (not all at the loop's end)."""
    n = 1 << 18  # float32: 1 MiB
    model = _loop_with_body(h.make_node("Add", ["v", "one"], ["v_next"], name="inc"), n=n,
                            initializer=[h.make_tensor("one", T.FLOAT, [], [1.0])])
    rt = Runtime(SimDevice(), RuntimeConfig(device_memory_limit=8 << 20))
    out = Executor(model, rt).run({"M": np.array(40, np.int64), "v0": np.zeros(n, np.float32)})
    assert out["v_final"].shape == (n,) and bool((out["v_final"] == 40).all()), "result: 40 increments"


def test_a_loop_whose_body_has_an_unsupported_op_is_refused_at_load_naming_it():
    model = _loop_with_body(h.make_node("Frobnicate", ["v"], ["v_next"], name="body_frob", domain="com.example"),
                            [h.make_opsetid("com.example", 1)])
    with pytest.raises(UnsupportedModel, match="body_frob"):
        Executor(model, Runtime(SimDevice(), RuntimeConfig()))


def test_a_bad_attribute_inside_a_body_is_refused_at_load_naming_the_body_node():
    model = _loop_with_body(h.make_node("LeakyRelu", ["v"], ["v_next"], name="body_act", alpha=0.1))
    Executor(model, Runtime(SimDevice(), RuntimeConfig()))  # the good one loads
    model = _loop_with_body(h.make_node("CumSum", ["v", "axis"], ["v_next"], name="body_cumsum", exclusive=3))
    model.graph.node[0].attribute[0].g.initializer.append(h.make_tensor("axis", T.INT64, [], [0]))
    with pytest.raises(OpError, match=r"body_cumsum.*exclusive"):
        Executor(model, Runtime(SimDevice(), RuntimeConfig()))


def _if_model():
    """r = Relu(x); y = If(c, r * 2, -r); out = y + 1: the If between two capturable nodes."""
    then_g = h.make_graph([h.make_node("Mul", ["r", "two"], ["t"], name="then_mul")], "then", [],
                          [h.make_tensor_value_info("t", T.FLOAT, [1, 8])])
    else_g = h.make_graph([h.make_node("Neg", ["r"], ["e"], name="else_neg")], "else", [],
                          [h.make_tensor_value_info("e", T.FLOAT, [1, 8])])
    g = h.make_graph(
        [h.make_node("Relu", ["x"], ["r"], name="relu"),
         h.make_node("If", ["c"], ["y"], name="if", then_branch=then_g, else_branch=else_g),
         h.make_node("Add", ["y", "one"], ["out"], name="add")],
        "if_model", [h.make_tensor_value_info("x", T.FLOAT, [1, 8]), h.make_tensor_value_info("c", T.BOOL, [1])],
        [h.make_tensor_value_info("out", T.FLOAT, [1, 8])],
        initializer=[h.make_tensor("two", T.FLOAT, [], [2.0]), h.make_tensor("one", T.FLOAT, [], [1.0])])
    return h.make_model(g, opset_imports=OPSET, ir_version=10)


def _drive_if(runner, steps=6):
    rng = np.random.default_rng(3)
    out = []
    for s in range(steps):
        x = rng.normal(size=(1, 8)).astype(np.float32)
        out.append(runner.run({"x": x, "c": np.array([s % 2 == 0])})["out"].tobytes())
    return out


def test_capture_on_a_model_with_an_if_runs_the_if_as_a_seam_and_matches_eager(make_runtime):
    """The If reads its condition on the host: a "host control flow" seam every step; the nodes
    around it are captured and replayed; the condition flips each step and the bytes equal eager."""
    eager = _drive_if(Executor(_if_model(), make_runtime()))
    session = CaptureSession(Executor(_if_model(), make_runtime()))
    captured = _drive_if(session)
    decisions = dict(session.plan.decisions)
    assert decisions["if"] == "host control flow: If", "contract: the If is a seam, never recorded"
    assert decisions["relu"] is None and decisions["add"] is None, "contract: the nodes around it are captured"
    c = session.counters
    assert c.fallbacks == 0 and c.captured_steps > 0 and c.replays > 0
    assert captured == eager, "result: byte-identical to eager, both branches"
    x = np.frombuffer(eager[0], np.float32)  # not vacuous: the eager bytes are the If's semantics
    assert x.shape == (8,)


def test_if_semantics_and_a_condition_of_two_elements_is_a_named_error():
    ex = Executor(_if_model(), Runtime(SimDevice(), RuntimeConfig()))
    x = np.array([[-1, 2, -3, 4, 0, 1, -2, 3]], np.float32)
    r = np.maximum(x, 0)
    np.testing.assert_array_equal(ex.run({"x": x, "c": np.array([True])})["out"], r * 2 + 1)
    np.testing.assert_array_equal(ex.run({"x": x, "c": np.array([False])})["out"], -r + 1)
    model = _if_model()
    model.graph.input[1].type.tensor_type.shape.dim[0].dim_value = 2
    ex = Executor(model, Runtime(SimDevice(), RuntimeConfig()))
    with pytest.raises(OpError, match=r"'if'.*one element"):
        ex.run({"x": x, "c": np.array([True, False])})


def test_flexattention_with_a_bad_softmax_precision_is_refused_at_load():
    mod = h.make_graph([h.make_node("Identity", ["s"], ["s_out"])], "mod",
                       [h.make_tensor_value_info("s", T.FLOAT, [1, 1, 2, 2])], [h.make_tensor_value_info("s_out", T.FLOAT, [1, 1, 2, 2])])
    shape = [1, 1, 2, 4]
    g = h.make_graph([h.make_node("FlexAttention", ["q", "k", "v"], ["y"], name="flex", domain="ai.onnx.preview",
                                  score_mod=mod, softmax_precision=T.INT32)], "flex",
                     [h.make_tensor_value_info(n, T.FLOAT, shape) for n in "qkv"],
                     [h.make_tensor_value_info("y", T.FLOAT, shape)])
    model = h.make_model(g, opset_imports=OPSET + [h.make_opsetid("ai.onnx.preview", 1)], ir_version=10)
    with pytest.raises(OpError, match=r"'flex'.*softmax_precision"):
        Executor(model, Runtime(SimDevice(), RuntimeConfig()))


def test_a_loop_output_bound_to_a_device_tensor_is_written_into_it():
    rt = Runtime(SimDevice(), RuntimeConfig())
    ex = Executor(_nested_if_in_loop_model(), rt)
    x, w_in = np.array([1.0, 2.0, 3.0], np.float32), np.ones(3, np.float32)
    bound = rt.empty((3,), np.float32, name="bound-x_final")
    out = ex.run({"M": np.array(2, np.int64), "x": x, "w_in": w_in}, bind={"x_final": bound})
    assert out["x_final"] is bound, "contract: IO binding hands back the caller's tensor"
    np.testing.assert_array_equal(rt.download(bound), x), "result: x - w + w, written into the bound tensor"


def _if_shape_model():
    """y = If(c, Concat(r, r), r) after r = Relu(x); out = y * 2: the branches' shapes differ."""
    then_g = h.make_graph([h.make_node("Concat", ["r", "r"], ["t"], name="then_cat", axis=1)], "then", [],
                          [h.make_tensor_value_info("t", T.FLOAT, [1, 16])])
    else_g = h.make_graph([h.make_node("Identity", ["r"], ["e"], name="else_id")], "else", [],
                          [h.make_tensor_value_info("e", T.FLOAT, [1, 8])])
    g = h.make_graph(
        [h.make_node("Relu", ["x"], ["r"], name="relu"),
         h.make_node("If", ["c"], ["y"], name="if", then_branch=then_g, else_branch=else_g),
         h.make_node("Mul", ["y", "two"], ["out"], name="mul")],
        "if_shapes", [h.make_tensor_value_info("x", T.FLOAT, [1, 8]), h.make_tensor_value_info("c", T.BOOL, [1])],
        [h.make_tensor_value_info("out", T.FLOAT, [1, None])],
        initializer=[h.make_tensor("two", T.FLOAT, [], [2.0])])
    return h.make_model(g, opset_imports=OPSET, ir_version=10)


def test_capture_with_an_if_whose_branches_differ_in_shape_keeps_their_reader_eager(make_runtime):
    """The If's output shape follows the branch (device data): its reader is not baked into a
    segment, so alternating branches under one step signature still give the eager bytes."""
    eager = _drive_if(Executor(_if_shape_model(), make_runtime()))
    session = CaptureSession(Executor(_if_shape_model(), make_runtime()))
    captured = _drive_if(session)
    decisions = dict(session.plan.decisions)
    assert decisions["if"] == "host control flow: If" and decisions["mul"] is not None, \
        f"contract: the If and its reader are seams, got {decisions}"
    assert session.counters.fallbacks == 0 and session.counters.captured_steps > 0
    assert captured == eager and {len(b) for b in eager} == {32, 64}, "result: both shapes, byte-identical to eager"


def test_opset8_scan_runs_full_sequence_lens_and_names_shorter_ones():
    body = h.make_graph([h.make_node("Add", ["acc", "x_t"], ["acc_next"], name="acc"),
                         h.make_node("Identity", ["acc_next"], ["y_t"], name="y")], "body",
                        [h.make_tensor_value_info("acc", T.FLOAT, [2]), h.make_tensor_value_info("x_t", T.FLOAT, [2])],
                        [h.make_tensor_value_info("acc_next", T.FLOAT, [2]), h.make_tensor_value_info("y_t", T.FLOAT, [2])])
    g = h.make_graph([h.make_node("Scan", ["lens", "init", "xs"], ["final", "ys"], name="scan8", body=body,
                                  num_scan_inputs=1)], "scan8",
                     [h.make_tensor_value_info("lens", T.INT32, [1]), h.make_tensor_value_info("init", T.FLOAT, [1, 2]),
                      h.make_tensor_value_info("xs", T.FLOAT, [1, 3, 2])],
                     [h.make_tensor_value_info("final", T.FLOAT, [1, 2]), h.make_tensor_value_info("ys", T.FLOAT, [1, 3, 2])])
    ex = Executor(h.make_model(g, opset_imports=[h.make_opsetid("", 8)], ir_version=10), Runtime(SimDevice(), RuntimeConfig()))
    xs = np.arange(6, dtype=np.float32).reshape(1, 3, 2)
    out = ex.run({"lens": np.array([3], np.int32), "init": np.zeros((1, 2), np.float32), "xs": xs})
    np.testing.assert_array_equal(out["ys"], np.cumsum(xs, axis=1)), "result: running sums per batch entry"
    with pytest.raises(OpError, match=r"'scan8'.*sequence_lens"):
        ex.run({"lens": np.array([2], np.int32), "init": np.zeros((1, 2), np.float32), "xs": xs})


def test_a_branch_output_that_is_a_view_of_a_branch_temporary_outlives_the_branch():
    """Identity(Reshape(Add(...))) inside a branch: the Reshape is a view of the Add's buffer,
    which the branch frees when it ends; the If's output is its own copy, never a view of freed
    memory (which the sim may still read back right: its addresses are not reused at once)."""
    branch = h.make_graph([h.make_node("Add", ["x", "x"], ["t1"], name="b_add"),
                           h.make_node("Reshape", ["t1", "flat"], ["t2"], name="b_view"),
                           h.make_node("Identity", ["t2"], ["t3"], name="b_id")], "branch", [],
                          [h.make_tensor_value_info("t3", T.FLOAT, [8])],
                          initializer=[h.make_tensor("flat", T.INT64, [1], [8])])
    g = h.make_graph([h.make_node("If", ["c"], ["y"], name="if", then_branch=branch, else_branch=branch),
                      h.make_node("Neg", ["y"], ["out"], name="neg")], "views",
                     [h.make_tensor_value_info("x", T.FLOAT, [2, 4]), h.make_tensor_value_info("c", T.BOOL, [])],
                     [h.make_tensor_value_info("y", T.FLOAT, [8]), h.make_tensor_value_info("out", T.FLOAT, [8])])
    rt = Runtime(SimDevice(), RuntimeConfig())
    ex = Executor(h.make_model(g, opset_imports=OPSET, ir_version=10), rt)
    x = np.arange(8, dtype=np.float32).reshape(2, 4)
    run = ex.start({"x": x, "c": np.array(True)})  # the step API: the If's output as the run holds it
    try:
        ex.step(run, 0)
        assert not run.env["y"].tensor.ref.buffer.freed, "contract: the If's output is not in freed memory"
        ex.step(run, 1)
        out = ex.finish(run)
    finally:
        ex.release(run)
    np.testing.assert_array_equal(out["y"], 2 * x.reshape(8)), "result: the branch's value"
    np.testing.assert_array_equal(out["out"], -2 * x.reshape(8))


def _seq_type(elem=T.FLOAT, shape=None):
    return h.make_sequence_type_proto(h.make_tensor_type_proto(elem, shape))


def _loop_appending_to_a_sequence_model():
    """Loop M times: the body appends ``x * i`` (a body temporary) to a carried sequence."""
    body = h.make_graph(
        [h.make_node("Cast", ["i"], ["i_f"], name="cast", to=T.FLOAT),
         h.make_node("Mul", ["x", "i_f"], ["xi"], name="scale"),
         h.make_node("SequenceInsert", ["seq_in", "xi"], ["seq_out"], name="append"),
         h.make_node("Identity", ["cond_in"], ["cond_out"], name="keep_going")],
        "body",
        [_scalar("i", T.INT64), _scalar("cond_in", T.BOOL), h.make_value_info("seq_in", _seq_type(T.FLOAT, [2]))],
        [_scalar("cond_out", T.BOOL), h.make_value_info("seq_out", _seq_type(T.FLOAT, [2]))])
    g = h.make_graph(
        [h.make_node("SequenceEmpty", [], ["empty"], name="empty", dtype=T.FLOAT),
         h.make_node("Loop", ["M", "", "empty"], ["seq"], name="loop", body=body)],
        "seqloop", [_scalar("M", T.INT64), h.make_tensor_value_info("x", T.FLOAT, [2])],
        [h.make_value_info("seq", _seq_type(T.FLOAT, [2]))])
    return h.make_model(g, opset_imports=OPSET, ir_version=10)


def test_a_loop_carrying_a_sequence_keeps_the_body_tensors_it_holds_and_frees_the_rest():
    """The elements a body appends are body temporaries: the carried sequence holds them, so they
    are handed over (not freed with the body's run: a use after free before), and everything else
    is freed by the run's end."""
    rt = Runtime(SimDevice(), RuntimeConfig())
    ex = Executor(_loop_appending_to_a_sequence_model(), rt)
    x = np.array([1.0, 2.0], np.float32)
    out = ex.run({"M": np.array(4, np.int64), "x": x})["seq"]
    assert [a.tolist() for a in out] == [(x * i).tolist() for i in range(4)], "result: x * i for each iteration"
    rt.synchronize()
    base = rt.device.allocated_bytes
    ex.run({"M": np.array(6, np.int64), "x": x})
    rt.synchronize()
    assert rt.device.allocated_bytes == base, "contract: the sequence's elements and the loop's temporaries freed"


def _sequence_map_model():
    body = h.make_graph([h.make_node("Add", ["a", "b"], ["c"], name="add")], "body",
                        [h.make_tensor_value_info("a", T.FLOAT, [None]), h.make_tensor_value_info("b", T.FLOAT, [None])],
                        [h.make_tensor_value_info("c", T.FLOAT, [None])])
    g = h.make_graph([h.make_node("SequenceMap", ["xs", "ys"], ["zs"], name="map", body=body)], "map",
                     [h.make_value_info("xs", _seq_type(T.FLOAT, [None])), h.make_value_info("ys", _seq_type(T.FLOAT, [None]))],
                     [h.make_value_info("zs", _seq_type(T.FLOAT, [None]))])
    return h.make_model(g, opset_imports=[h.make_opsetid("", 17)], ir_version=10)


def test_sequence_map_adds_elementwise_and_names_a_length_mismatch():
    ex = Executor(_sequence_map_model(), Runtime(SimDevice(), RuntimeConfig()))
    xs = [np.arange(n, dtype=np.float32) for n in (1, 3)]
    out = ex.run({"xs": xs, "ys": [a * 10 for a in xs]})["zs"]
    assert [a.tolist() for a in out] == [(a * 11).tolist() for a in xs], "result: x + 10x per element"
    with pytest.raises(OpError, match=r"map.*input 1 is a sequence of 1 elements, input 0 has 2"):
        ex.run({"xs": xs, "ys": xs[:1]})


# -- capture of control flow whose trip count is fixed (capture_plan._control_seam)
def _scan_capture_model(body_extra=(), body_y="x_t", extra_inputs=(), opsets=OPSET):
    """r = Relu(x); w = 2 * w_in; Scan over r's rows: acc += row, y_t = body_y * acc * w (w read
    from the outer scope); out = ys + 1. ``body_extra`` nodes may compute ``body_y`` from x_t."""
    body = h.make_graph(
        [*body_extra,
         h.make_node("Add", ["acc", "x_t"], ["acc_next"], name="acc"),
         h.make_node("Mul", [body_y, "acc_next"], ["y0"], name="y0"),
         h.make_node("Mul", ["y0", "w"], ["y_t"], name="y")],
        "body", [h.make_tensor_value_info("acc", T.FLOAT, [3]), h.make_tensor_value_info("x_t", T.FLOAT, [3])],
        [h.make_tensor_value_info("acc_next", T.FLOAT, [3]), h.make_tensor_value_info("y_t", T.FLOAT, [3])])
    g = h.make_graph(
        [h.make_node("Relu", ["x"], ["r"], name="relu"),
         h.make_node("Mul", ["w_in", "two"], ["w"], name="double"),
         h.make_node("Scan", ["init", "r"], ["final", "ys"], name="scan", body=body, num_scan_inputs=1),
         h.make_node("Add", ["ys", "one"], ["out"], name="add")],
        "scan_capture", [h.make_tensor_value_info("x", T.FLOAT, [4, 3]), h.make_tensor_value_info("init", T.FLOAT, [3]),
                         h.make_tensor_value_info("w_in", T.FLOAT, [3]), *extra_inputs],
        [h.make_tensor_value_info("final", T.FLOAT, [3]), h.make_tensor_value_info("out", T.FLOAT, [4, 3])],
        initializer=[h.make_tensor("two", T.FLOAT, [], [2.0]), h.make_tensor("one", T.FLOAT, [], [1.0])])
    return h.make_model(g, opset_imports=opsets, ir_version=10)


def _drive_scan(runner, steps=5, extra=None):
    rng = np.random.default_rng(7)
    out = []
    for _ in range(steps):
        feeds = {"x": rng.normal(size=(4, 3)).astype(np.float32), "init": rng.normal(size=3).astype(np.float32),
                 "w_in": rng.normal(size=3).astype(np.float32), **(extra or {})}
        res = runner.run(feeds)
        out.append((res["final"].tobytes(), res["out"].tobytes()))
    return out


def test_capture_records_a_scan_with_a_capture_safe_body_inside_a_segment(make_runtime):
    """The Scan's trip count is a shape and its body is capture-safe: it is admitted, recorded in
    one segment with the nodes around it, replayed on new data each step with the eager bytes, and
    its iterations' retained temporaries are freed when the session closes."""
    eager_rt = make_runtime()
    eager = _drive_scan(Executor(_scan_capture_model(), eager_rt))
    gc.collect()  # the eager executor's buffers freed, and given back by a drain: on CuPy the device
    eager_rt.synchronize()  # (and its byte count) is shared with the runtime below
    rt = make_runtime()
    ex = Executor(_scan_capture_model(), rt)
    rt.synchronize()
    base = rt.device.allocated_bytes
    session = CaptureSession(ex)
    captured = _drive_scan(session)
    decisions = dict(session.plan.decisions)
    assert decisions["scan"] is None, f"contract: a Scan with a capture-safe body is admitted, got {decisions}"
    assert session.plan.segments == [["relu", "double", "scan", "add"]], "contract: one segment, the Scan inside"
    c = session.counters
    assert (c.captures, c.fallbacks, c.captured_steps, c.replays) == (1, 0, 4, 4), \
        f"contract: recorded once, replayed each captured step, no fallback: {c}"
    assert captured == eager, "result: byte-identical to eager on each step's new data"
    assert len({b for b, _ in eager}) == 5, "result: not vacuous: each step's data gives other bytes"
    session.close()
    rt.synchronize()
    assert rt.device.allocated_bytes == base, "contract: the recorded iterations' temporaries freed with the graphs"


def test_a_captured_scan_runs_guarded_with_no_host_read():
    """On the simulated device with the capture guard, each replayed kernel (the Scan's slices,
    body and stacking included) refuses host reads; the replays give the eager bytes."""
    eager = _drive_scan(Executor(_scan_capture_model(), Runtime(SimDevice(), RuntimeConfig())))
    session = CaptureSession(Executor(_scan_capture_model(), Runtime(SimDevice(capture_guard=True), RuntimeConfig())))
    assert _drive_scan(session) == eager, "result: guarded replays byte-identical to eager"
    assert dict(session.plan.decisions)["scan"] is None and session.counters.replays == 4


@pytest.mark.parametrize("extra, y, inputs, feed, reason", [
    ([h.make_node("RandomUniformLike", ["x_t"], ["u"], name="draw", seed=1.0)], "u", (), {},
     "host control flow: Scan (body node 'draw': kernel: draws on the host and uploads them each run)"),
    ([h.make_node("CumSum", ["x_t", "axis"], ["u"], name="cum")], "u", (_scalar("axis", T.INT64),),
     {"axis": np.array(0, np.int64)}, "host control flow: Scan (body node 'cum': host read: axis)"),
])
def test_capture_keeps_a_scan_whose_body_is_not_capture_safe_a_seam_naming_the_body_node(
        make_runtime, extra, y, inputs, feed, reason):
    model = _scan_capture_model(extra, y, inputs)
    session = CaptureSession(Executor(model, make_runtime()))
    captured = _drive_scan(session, extra=feed)
    decisions = dict(session.plan.decisions)
    assert decisions["scan"] == reason, f"contract: the seam names the body node and why, got {decisions['scan']!r}"
    assert decisions["relu"] is None and decisions["add"] is None, "contract: the nodes around it are captured"
    assert session.counters.fallbacks == 0 and session.counters.replays > 0
    assert captured == _drive_scan(Executor(model, make_runtime()), extra=feed), "result: eager bytes"


def _loop_capture_model(m_const=True, cond=None, body_cond="c"):
    """v = Relu(x); Loop M times (M = 3, an initializer, or a feed): v += w (outer), collecting
    each v; out = vs * 2. ``cond``: the Loop's condition input ('' none); ``body_cond``: the
    body's condition output (its input 'c' passed through, or a computed one)."""
    body = h.make_graph(
        [h.make_node("Add", ["v", "w"], ["v_next"], name="inc"),
         h.make_node("Identity", ["v_next"], ["v_scan"], name="collect"),
         h.make_node("Identity", ["c"], ["c_out"], name="keep") if body_cond == "c" else
         h.make_node("Less", ["i", "big"], ["c_out"], name="keep")],
        "body", [_scalar("i", T.INT64), _scalar("c", T.BOOL), h.make_tensor_value_info("v", T.FLOAT, [3])],
        [_scalar("c_out", T.BOOL), h.make_tensor_value_info("v_next", T.FLOAT, [3]),
         h.make_tensor_value_info("v_scan", T.FLOAT, [3])],
        initializer=[h.make_tensor("big", T.INT64, [], [100])])
    inputs = [h.make_tensor_value_info("x", T.FLOAT, [3]), h.make_tensor_value_info("w", T.FLOAT, [3])]
    inits = [h.make_tensor("two", T.FLOAT, [], [2.0])]
    if m_const:
        inits.append(h.make_tensor("M", T.INT64, [], [3]))
    else:
        inputs.append(_scalar("M", T.INT64))
    if cond:
        inputs.append(_scalar(cond, T.BOOL))
    g = h.make_graph(
        [h.make_node("Relu", ["x"], ["v0"], name="relu"),
         h.make_node("Loop", ["M", cond or "", "v0"], ["v_final", "vs"], name="loop", body=body),
         h.make_node("Mul", ["vs", "two"], ["out"], name="mul")],
        "loop_capture", inputs,
        [h.make_tensor_value_info("v_final", T.FLOAT, [3]), h.make_tensor_value_info("out", T.FLOAT, [3, 3])],
        initializer=inits)
    return h.make_model(g, opset_imports=OPSET, ir_version=10)


def _drive_loop(runner, extra, steps=4):
    rng = np.random.default_rng(11)
    return [tuple(runner.run({"x": rng.normal(size=3).astype(np.float32), "w": rng.normal(size=3).astype(np.float32),
                              **extra})[o].tobytes() for o in ("v_final", "out")) for _ in range(steps)]


@pytest.mark.parametrize("kw, extra, reason", [
    ({}, {}, None),
    ({"m_const": False}, {"M": np.array(3, np.int64)}, "host control flow: Loop (trip count read on the host)"),
    ({"cond": "go"}, {"go": np.array(True)}, "host control flow: Loop (condition read on the host)"),
    ({"body_cond": "computed"}, {},
     "host control flow: Loop (the body's condition read on the host each iteration)"),
])
def test_capture_records_a_loop_only_when_its_trip_count_is_host_known_and_its_condition_fixed(
        make_runtime, kw, extra, reason):
    """A Loop with a constant M whose body passes its condition through reads nothing on the host:
    recorded (its iteration numbers written by fill kernels); otherwise a seam saying what the host
    reads. Either way the bytes are eager's."""
    session = CaptureSession(Executor(_loop_capture_model(**kw), make_runtime()))
    captured = _drive_loop(session, extra)
    decisions = dict(session.plan.decisions)
    assert decisions["loop"] == reason, f"contract: the Loop's decision, got {decisions['loop']!r}"
    assert decisions["relu"] is None, "contract: the node before it is captured"
    assert (decisions["mul"] is None) == (reason is None), \
        f"contract: the reader of its stacked output is captured only when the trip count is fixed (else its " \
        f"length is device data): {decisions['mul']!r}"
    assert session.counters.fallbacks == 0 and session.counters.replays >= 3
    assert captured == _drive_loop(Executor(_loop_capture_model(**kw), make_runtime()), extra), "result: eager bytes"


def test_capture_keeps_a_loop_with_a_constant_trip_count_past_the_limit_a_seam(make_runtime, monkeypatch):
    from lockstep.reference_runtime import capture_plan

    monkeypatch.setattr(capture_plan, "MAX_CAPTURED_TRIPS", 2)  # the model's M is 3
    session = CaptureSession(Executor(_loop_capture_model(), make_runtime()))
    captured = _drive_loop(session, {})
    assert dict(session.plan.decisions)["loop"] == "host control flow: Loop (trip count past 2)", \
        "contract: a Loop recorded iteration by iteration is bounded"
    assert captured == _drive_loop(Executor(_loop_capture_model(), make_runtime()), {}), "result: eager bytes"


def test_a_captured_scan_whose_retained_temporaries_pass_the_budget_falls_back_to_eager():
    """64 iterations of 256 KiB temporaries under a 40 MiB budget: eagerly each iteration's are
    freed as it ends; recorded, all are retained with the graph, past the budget. The recording
    fails (RetainedPastBudget), the Scan is quarantined and the step's bytes are eager's."""
    n, t = 1 << 16, 64
    body = h.make_graph([h.make_node("Mul", ["x_t", "two"], ["x2"], name="twice"),
                         h.make_node("Add", ["acc", "x2"], ["acc_next"], name="acc")], "body",
                        [h.make_tensor_value_info("acc", T.FLOAT, [n]), h.make_tensor_value_info("x_t", T.FLOAT, [n])],
                        [h.make_tensor_value_info("acc_next", T.FLOAT, [n])],
                        initializer=[h.make_tensor("two", T.FLOAT, [], [2.0])])
    g = h.make_graph([h.make_node("Scan", ["init", "xs"], ["final"], name="scan", body=body, num_scan_inputs=1)],
                     "big_scan",
                     [h.make_tensor_value_info("init", T.FLOAT, [n]), h.make_tensor_value_info("xs", T.FLOAT, [t, n])],
                     [h.make_tensor_value_info("final", T.FLOAT, [n])])
    model = h.make_model(g, opset_imports=OPSET, ir_version=10)
    session = CaptureSession(Executor(model, Runtime(SimDevice(), RuntimeConfig(device_memory_limit=40 << 20))))
    xs = np.ones((t, n), np.float32)
    feeds = {"init": np.zeros(n, np.float32), "xs": xs}
    outs = [session.run(feeds)["final"] for _ in range(3)]
    assert session.counters.fallbacks == 1 and session.quarantined == {"Scan"}, \
        f"contract: the recording failed once and quarantined Scan: {session.counters}"
    assert session.failure.startswith("RetainedPastBudget: Scan 'scan'"), session.failure
    assert dict(session.plan.decisions)["scan"] == "recording failed: Scan quarantined"
    assert all(bool((o == 2 * t).all()) for o in outs), "result: every step's sum, eagerly"


@pytest.mark.parametrize("mod, reason", [
    (h.make_node("Mul", ["s", "half"], ["s_out"], name="soft"), None),
    (h.make_node("RandomUniformLike", ["s"], ["s_out"], name="noise", seed=2.0),
     "host control flow: FlexAttention (body node 'noise': kernel: draws on the host and uploads them each run)"),
])
def test_capture_records_a_flexattention_whose_score_mod_is_capture_safe(make_runtime, mod, reason):
    """FlexAttention's modifier runs once on the scores, reading nothing on the host: with a
    capture-safe body the node is recorded, else a seam naming the body node; eager bytes either way."""
    score_mod = h.make_graph([mod], "mod", [h.make_tensor_value_info("s", T.FLOAT, [1, 1, 2, 2])],
                             [h.make_tensor_value_info("s_out", T.FLOAT, [1, 1, 2, 2])],
                             initializer=[h.make_tensor("half", T.FLOAT, [], [0.5])])
    shape = [1, 1, 2, 4]
    g = h.make_graph([h.make_node("Relu", ["q_in"], ["q"], name="relu"),
                      h.make_node("FlexAttention", ["q", "k", "v"], ["y"], name="flex", domain="ai.onnx.preview",
                                  score_mod=score_mod)], "flex",
                     [h.make_tensor_value_info(n, T.FLOAT, shape) for n in ("q_in", "k", "v")],
                     [h.make_tensor_value_info("y", T.FLOAT, shape)])
    model = h.make_model(g, opset_imports=OPSET + [h.make_opsetid("ai.onnx.preview", 1)], ir_version=10)

    def drive(runner):
        rng = np.random.default_rng(5)
        return [runner.run({n: rng.normal(size=shape).astype(np.float32) for n in ("q_in", "k", "v")})["y"].tobytes()
                for _ in range(4)]

    session = CaptureSession(Executor(model, make_runtime()))
    captured = drive(session)
    decisions = dict(session.plan.decisions)
    assert decisions["flex"] == reason and decisions["relu"] is None, f"contract: the decisions, got {decisions}"
    assert session.counters.fallbacks == 0 and session.counters.replays == 3
    assert captured == drive(Executor(model, make_runtime())), "result: eager bytes"


def test_capture_records_a_scan_nested_in_a_scan_body_reading_a_value_two_scopes_out():
    """The outer body holds a Scan whose body reads ``w`` from the graph: the check recurses into
    the nested body, the recording retains both levels' temporaries, replays give eager's bytes."""
    inner = h.make_graph([h.make_node("Add", ["a", "e"], ["a2"], name="inner_add"),
                          h.make_node("Mul", ["e", "w"], ["eo"], name="inner_mul")], "inner",
                         [_scalar("a", T.FLOAT), _scalar("e", T.FLOAT)],
                         [_scalar("a2", T.FLOAT), _scalar("eo", T.FLOAT)])
    outer = h.make_graph([h.make_node("Scan", ["acc", "row"], ["acc2", "row_out"], name="inner_scan", body=inner,
                                      num_scan_inputs=1),
                          h.make_node("Identity", ["acc2"], ["acc_out"], name="carry")], "outer",
                         [_scalar("acc", T.FLOAT), h.make_tensor_value_info("row", T.FLOAT, [3])],
                         [_scalar("acc_out", T.FLOAT), h.make_tensor_value_info("row_out", T.FLOAT, [3])])
    g = h.make_graph([h.make_node("Relu", ["x"], ["r"], name="relu"),
                      h.make_node("Scan", ["z", "r"], ["total", "ys"], name="scan", body=outer, num_scan_inputs=1)],
                     "nested",
                     [h.make_tensor_value_info("x", T.FLOAT, [4, 3]), _scalar("z", T.FLOAT), _scalar("w", T.FLOAT)],
                     [_scalar("total", T.FLOAT), h.make_tensor_value_info("ys", T.FLOAT, [4, 3])])
    model = h.make_model(g, opset_imports=OPSET, ir_version=10)
    rng = np.random.default_rng(0)
    feeds = [{"x": rng.normal(size=(4, 3)).astype(np.float32), "z": np.array(0, np.float32),
              "w": np.array(rng.normal(), np.float32)} for _ in range(4)]
    eager_ex = Executor(model, Runtime(SimDevice(), RuntimeConfig()))
    eager = [[v.tobytes() for v in eager_ex.run(f).values()] for f in feeds]
    session = CaptureSession(Executor(model, Runtime(SimDevice(capture_guard=True), RuntimeConfig())))
    captured = [[v.tobytes() for v in session.run(f).values()] for f in feeds]
    assert session.plan.decisions == [("relu", None), ("scan", None)], "contract: the nested Scan's node admitted"
    assert (session.counters.captures, session.counters.replays) == (1, 3)
    assert captured == eager, "result: guarded replays byte-identical to eager"
    r = np.maximum(feeds[-1]["x"], 0)
    np.testing.assert_allclose(np.frombuffer(eager[-1][1], np.float32).reshape(4, 3), r * feeds[-1]["w"], rtol=1e-6), \
        "result: not vacuous: the inner body's w * element"


# --- issue 55: a Loop that never ends ---

def _loop11(trip: int):
    from lockstep.reference_runtime.node_cases import _value, load_cases

    case = next(c for c in load_cases() if c.name == "test_loop11")
    feeds = dict(zip([i.name for i in case.proto().graph.input], [_value(x) for x in case.inputs]))
    feeds["trip_count"] = np.array(trip, np.int64)
    return case.proto(), feeds


def test_a_trip_count_over_the_loop_budget_is_refused_before_the_first_iteration():
    """result (issue 55's hang: ONNX's test_loop11 with its trip count 2**31-1 ran for hours, ONNX Runtime
    hangs on it too): refused at once, naming the node, the count and the budget; a smaller budget from
    the environment is read once into the runtime's config."""
    model, feeds = _loop11(2**31 - 1)
    with pytest.raises(OpError, match=r"trip count 2147483647 is over the runtime's loop budget of 1000000"):
        _run(model, feeds)
    cfg = RuntimeConfig.from_env({"LOCKSTEP_MAX_LOOP_ITERATIONS": "3"})
    assert cfg.max_loop_iterations == 3
    with pytest.raises(OpError, match="trip count 5 is over the runtime's loop budget of 3"):
        _run(*_loop11(5), runtime=Runtime(SimDevice(), cfg))
    with pytest.raises(ValueError, match="LOCKSTEP_MAX_LOOP_ITERATIONS='x'"):
        RuntimeConfig.from_env({"LOCKSTEP_MAX_LOOP_ITERATIONS": "x"})


def test_a_scan_output_that_changes_shape_is_refused_at_that_iteration():
    """result: test_loop11's scan output (a slice of a 5-element constant at the iteration number) is
    empty from iteration 5 on: with a trip count of 100,000 the OpError names iteration 5 and comes at
    once, not after the last iteration's stacking."""
    import time

    model, feeds = _loop11(100_000)
    t0 = time.perf_counter()
    with pytest.raises(OpError, match=r"changes between iterations: float32\[1\] then float32\[0\] at iteration 5"):
        _run(model, feeds)
    assert time.perf_counter() - t0 < 10


def test_a_loop_keeps_its_scan_parts_without_rebuilding_them_each_iteration(monkeypatch):
    """contract (per-iteration cost independent of the count): the values a Loop keeps alive while it
    drops an iteration's temporaries are the new carried values and a set of the scan parts kept up to
    date, never a list of every part rebuilt per iteration (quadratic: 2,000 iterations took 5.1 s)."""
    from lockstep.reference_runtime import control_body

    sizes = []
    drop = control_body._Control._drop

    def counting(self, v, owned, live, held=None):
        sizes.append(len(live))
        return drop(self, v, owned, live, held)

    monkeypatch.setattr(control_body._Control, "_drop", counting)
    n = 300
    body = h.make_graph(
        [h.make_node("Identity", ["c_in"], ["c_out"]), h.make_node("Add", ["v_in", "one"], ["v_out"]),
         h.make_node("Identity", ["v_in"], ["scan"])], "body",
        [_scalar("i", T.INT64), _scalar("c_in", T.BOOL), h.make_tensor_value_info("v_in", T.FLOAT, [1])],
        [_scalar("c_out", T.BOOL), h.make_tensor_value_info("v_out", T.FLOAT, [1]),
         h.make_tensor_value_info("scan", T.FLOAT, [1])],
        [h.make_tensor("one", T.FLOAT, [1], [1.0])])
    g = h.make_graph([h.make_node("Loop", ["M", "", "v0"], ["v", "scans"], body=body)], "g",
                     [_scalar("M", T.INT64), h.make_tensor_value_info("v0", T.FLOAT, [1])],
                     [h.make_tensor_value_info("v", T.FLOAT, [1]), h.make_tensor_value_info("scans", T.FLOAT, [None, 1])])
    model = h.make_model(g, opset_imports=[h.make_opsetid("", 21)])
    _, out = _run(model, {"M": np.array(n, np.int64), "v0": np.zeros(1, np.float32)})
    v, scans = out["v"], out["scans"]
    assert float(v[0]) == n and np.array_equal(np.asarray(scans)[:, 0], np.arange(n, dtype=np.float32))
    assert sizes and max(sizes) == 1, max(sizes)  # the one carried value, whatever the iteration
