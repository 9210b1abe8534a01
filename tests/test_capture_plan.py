"""The growing-symbol classifier and the admission order of the capture plan, with the mutants it
must catch: a kernel that declares itself capture-safe over a growing extent, and growing symbols
hidden behind a broadcast or a Reshape."""

from __future__ import annotations

import numpy as np
import onnx
from lockstep.golden.anchors import MODEL_DIR
from lockstep.reference_runtime import Runtime, RuntimeConfig
from lockstep.reference_runtime.backends.sim import SimDevice
from lockstep.reference_runtime.capture_plan import plan_capture
from lockstep.reference_runtime.executor import Executor
from onnx import TensorProto, helper, numpy_helper


def _ex(model):
    return Executor(model, Runtime(SimDevice(), RuntimeConfig()))


def _kv_model(nodes, extra_inputs=(), extra_outputs=(), inits=()):
    kv = helper.make_tensor_value_info("past_key_values.0.key", TensorProto.FLOAT, ["b", 2, "past", 4])
    out = helper.make_tensor_value_info("present.0.key", TensorProto.FLOAT, ["b", 2, "total", 4])
    g = helper.make_graph(nodes, "g", [kv, *extra_inputs], [out, *extra_outputs], initializer=list(inits))
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", 21)], ir_version=10)


def test_a_kernel_declared_safe_over_a_growing_extent_is_vetoed():
    ex = _ex(onnx.load(str(MODEL_DIR / "tiny-fp32-standard.onnx")))
    plan = dict(plan_capture(ex).decisions)
    att = [n for n in plan if n.endswith("/attention")]
    assert att and all(plan[n].startswith("classifier: grows with") for n in att)
    step = next(s for s in ex.steps if s.info.name == att[0])
    assert step.kernel.capture == "safe", "the kernel says safe; the classifier overrules it"


def test_growing_symbol_behind_a_broadcast_is_caught():
    # y has its own symbol 'n', but Add(past, y) unifies n with past: Neg(y) grows too
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, ["b", 2, "n", 4])
    nodes = [helper.make_node("Add", ["past_key_values.0.key", "y"], ["s"], name="add"),
             helper.make_node("Neg", ["y"], ["ny"], name="neg_y"),
             helper.make_node("Concat", ["past_key_values.0.key", "ny"], ["present.0.key"], axis=2, name="cat")]
    s = helper.make_tensor_value_info("s", TensorProto.FLOAT, ["b", 2, "past", 4])  # live: dead nodes are pruned
    plan = dict(plan_capture(_ex(_kv_model(nodes, [y], [s]))).decisions)
    assert plan["neg_y"] is not None and plan["neg_y"].startswith("classifier")


def test_growing_symbol_behind_a_reshape_is_caught():
    nodes = [helper.make_node("Reshape", ["past_key_values.0.key", "flat"], ["r"], name="flatten"),
             helper.make_node("Relu", ["r"], ["rr"], name="relu"),
             helper.make_node("Identity", ["past_key_values.0.key"], ["present.0.key"], name="id")]
    out = helper.make_tensor_value_info("rr", TensorProto.FLOAT, ["b", "flat_dim"])
    model = _kv_model(nodes, extra_outputs=[out], inits=[numpy_helper.from_array(np.array([0, -1], np.int64), "flat")])
    plan = dict(plan_capture(_ex(model)).decisions)
    assert plan["relu"] is not None and plan["relu"].startswith("classifier"), plan


def test_fixed_shapes_form_one_segment_and_unrelated_nodes_are_admitted():
    plan = plan_capture(_ex(onnx.load(str(MODEL_DIR / "tiny-fp32-standard-kv64.onnx"))))
    assert len(plan.segments) == 1 and all(r is None for _, r in plan.decisions) and not plan.growing
    grow = plan_capture(_ex(onnx.load(str(MODEL_DIR / "tiny-fp32-standard.onnx"))))
    admitted = [n for n, r in grow.decisions if r is None]
    parts = [p for n in admitted for p in n.split("+")]  # a fused step is named by its nodes joined with +
    assert any(p.endswith("/q_proj") for p in parts), "projections do not touch the KV length"


def test_a_host_read_is_a_seam_before_the_classifier():
    # TopK's k comes from data the device holds: a host read, whatever else the node touches
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, ["b", 2, "past", 4])
    k = helper.make_tensor_value_info("k", TensorProto.INT64, [1])
    nodes = [helper.make_node("TopK", ["x", "k"], ["v", "i"], name="topk", axis=-1),
             helper.make_node("Identity", ["past_key_values.0.key"], ["present.0.key"], name="id")]
    outs = [helper.make_tensor_value_info("v", TensorProto.FLOAT, ["b", 2, "past", "kk"]),
            helper.make_tensor_value_info("i", TensorProto.INT64, ["b", 2, "past", "kk"])]
    plan = dict(plan_capture(_ex(_kv_model(nodes, [x, k], outs))).decisions)
    assert plan["topk"] == "host read: k"


def test_a_length_computed_from_the_kv_shape_is_growing_but_from_a_fixed_capacity_is_not():
    """Range(0, past + seq) gets a symbol with no symbolic parent; its values come from Shape(past),
    so it grows. Range(0, C) in the fixed-capacity model does not."""
    grow = dict(plan_capture(_ex(onnx.load(str(MODEL_DIR / "tiny-fp32-standard.onnx")))).decisions)
    assert grow["mask/key_positions"] is not None and grow["mask/key_positions"].startswith("classifier")
    fixed = dict(plan_capture(_ex(onnx.load(str(MODEL_DIR / "tiny-fp32-standard-kv64.onnx")))).decisions)
    assert fixed["mask/key_positions"] is None


def test_shape_arithmetic_whose_values_grow_is_vetoed():
    """past_len + seq_len has a fixed shape (1,) but growing contents; the executor folds it on
    the host, and a replay would not refresh that copy (found by the segmented runner: the Range
    after it got a stale length). The classifier vetoes it on value-level provenance."""
    plan = dict(plan_capture(_ex(onnx.load(str(MODEL_DIR / "tiny-fp32-standard.onnx")))).decisions)
    assert plan["mask/total_len"] is not None and plan["mask/total_len"].startswith("classifier: grows with")


def test_session_reasons_quarantine_and_warm_up_come_before_the_kernel():
    ex = _ex(onnx.load(str(MODEL_DIR / "tiny-fp32-standard-kv64.onnx")))
    plan = dict(plan_capture(ex, quarantined={"MatMul"}).decisions)
    matmuls = [s.info.name for s in ex.steps if s.info.op_type == "MatMul"]
    assert matmuls and all(plan[n] == "recording failed: MatMul quarantined" for n in matmuls)
    assert sum(r is not None for r in plan.values()) == len(matmuls)
    cold = dict(plan_capture(ex, warmed=set()).decisions)
    launched = [st.info.name for st in ex.steps if st.kernel is not None]
    assert launched and all(cold[n] == "kernel not warmed" for n in launched)


def test_a_value_without_a_resolved_shape_cannot_be_admitted(monkeypatch):
    # onnx's shape inference does not know com.microsoft ops: without lockstep.contrib_shapes' rule
    # for MatMulNBits its outputs, and all that follows, have no shape to check
    from lockstep import contrib_shapes

    monkeypatch.delitem(contrib_shapes.RULES, ("com.microsoft", "MatMulNBits"))
    plan = plan_capture(_ex(onnx.load(str(MODEL_DIR / "tiny-int4-genai.onnx"))))
    reasons = dict(plan.decisions)
    assert reasons["layers.0/q_proj"] == "unresolved shape: layers.0/q_proj"
    assert plan.census()["seams_by_reason"]["unresolved shape"] > 0


def test_a_contrib_op_with_a_shape_rule_and_what_follows_it_are_admitted():
    """result (issue 53: SmolLM2 int4 captured 5 of 773 nodes): with MatMulNBits' shape rule, its
    outputs and every node computed from them have shapes; no node of the int4 model is an
    'unresolved shape' seam."""
    plan = plan_capture(_ex(onnx.load(str(MODEL_DIR / "tiny-int4-genai.onnx"))))
    reasons = dict(plan.decisions)
    assert reasons["layers.0/q_proj"] is None
    assert "unresolved shape" not in plan.census()["seams_by_reason"]


def test_control_flow_is_a_host_seam():
    # sequence ops are host kernels (kernels/ops_sequence.py): a host seam, before any other check
    nodes = [helper.make_node("SequenceEmpty", [], ["s"], name="seq"),
             helper.make_node("Identity", ["past_key_values.0.key"], ["present.0.key"], name="id")]
    model = _kv_model(nodes, extra_outputs=[helper.make_tensor_sequence_value_info("s", TensorProto.FLOAT, None)])
    ex = Executor(model, Runtime(SimDevice(), RuntimeConfig()))
    assert dict(plan_capture(ex).decisions)["seq"] == "host control flow: SequenceEmpty", "contract: a host seam"


def _vi(name, shape, elem=TensorProto.FLOAT):
    return helper.make_tensor_value_info(name, elem, list(shape))


def _grows(decision):
    return decision is not None and decision.startswith("classifier: grows with")


def test_growing_symbol_behind_an_expand_is_caught():
    """Contract (capture_plan docstring: Expand alignment unifies): y's own symbol 'n' expanded to
    the KV cache's shape is the KV length, so Neg(y) grows."""
    nodes = [helper.make_node("Shape", ["past_key_values.0.key"], ["s"], name="shape"),
             helper.make_node("Expand", ["y", "s"], ["e"], name="expand"),
             helper.make_node("Neg", ["y"], ["ny"], name="neg_y"),
             helper.make_node("Identity", ["past_key_values.0.key"], ["present.0.key"], name="id")]
    plan = dict(plan_capture(_ex(_kv_model(nodes, [_vi("y", ["b", 2, "n", 4])],
                                           [_vi("e", ["b", 2, "past", 4]), _vi("ny", ["b", 2, "n", 4])]))).decisions)
    assert _grows(plan["neg_y"]), plan


def test_growing_symbol_behind_matmul_batch_dims_is_caught():
    """Contract (capture_plan docstring: MatMul batch dims unify): the KV length in a batch
    position of a MatMul unifies with the other operand's batch dim 'n', so Neg(y) grows."""
    nodes = [helper.make_node("Transpose", ["past_key_values.0.key"], ["t"], perm=[0, 2, 1, 3], name="tr"),
             helper.make_node("MatMul", ["t", "y"], ["m"], name="matmul"),
             helper.make_node("Neg", ["y"], ["ny"], name="neg_y"),
             helper.make_node("Identity", ["past_key_values.0.key"], ["present.0.key"], name="id")]
    plan = dict(plan_capture(_ex(_kv_model(nodes, [_vi("y", ["b", "n", 4, 3])],
                                           [_vi("m", ["b", "past", 2, 3]), _vi("ny", ["b", "n", 4, 3])]))).decisions)
    assert _grows(plan["neg_y"]), plan


def test_concat_unifies_the_non_axis_dims_and_never_the_axis():
    """Contract (capture_plan docstring: Concat alignment): the axis dim of a Concat is a sum, not
    a unification, also for a negative axis (the new tokens concatenated onto the cache on axis -2
    do not grow); every other dim unifies (z concatenated on axis -1 shares the KV length)."""
    nodes = [helper.make_node("Concat", ["past_key_values.0.key", "x"], ["present.0.key"], axis=-2, name="cat"),
             helper.make_node("Neg", ["x"], ["nx"], name="neg_x"),
             helper.make_node("Concat", ["past_key_values.0.key", "z"], ["pz"], axis=-1, name="cat_z"),
             helper.make_node("Neg", ["z"], ["nz"], name="neg_z")]
    model = _kv_model(nodes, [_vi("x", ["b", 2, "seq", 4]), _vi("z", ["b", 2, "m", 3])],
                      [_vi("nx", ["b", 2, "seq", 4]), _vi("pz", ["b", 2, "past", 7]), _vi("nz", ["b", 2, "m", 3])])
    plan = dict(plan_capture(_ex(model)).decisions)
    assert plan["neg_x"] is None, plan
    assert _grows(plan["neg_z"]), plan


def test_a_present_output_seeds_growth_without_a_past_input():
    """Contract (capture_plan docstring): the sequence axis of a declared present.* output is
    growing by itself, as a past_key_values.* input's is."""
    nodes = [helper.make_node("Neg", ["x"], ["present.0.key"], name="neg")]
    g = helper.make_graph(nodes, "g", [_vi("x", ["b", 2, "seq", 4])], [_vi("present.0.key", ["b", 2, "seq", 4])])
    plan = plan_capture(_ex(helper.make_model(g, opset_imports=[helper.make_opsetid("", 21)], ir_version=10)))
    assert _grows(dict(plan.decisions)["neg"]) and plan.growing == {"seq"}


def test_unification_is_transitive_along_a_chain():
    """Contract: unification is an equivalence (union-find): past ~ n through one Add and n ~ m
    through another make m grow too, whichever order the unions come in."""
    nodes = [helper.make_node("Add", ["y", "past_key_values.0.key"], ["s1"], name="add1"),
             helper.make_node("Add", ["y", "w"], ["s2"], name="add2"),
             helper.make_node("Neg", ["w"], ["nw"], name="neg_w"),
             helper.make_node("Identity", ["past_key_values.0.key"], ["present.0.key"], name="id")]
    model = _kv_model(nodes, [_vi("y", ["b", 2, "n", 4]), _vi("w", ["b", 2, "m", 4])],
                      [_vi("s1", ["b", 2, "past", 4]), _vi("s2", ["b", 2, "n", 4]), _vi("nw", ["b", 2, "m", 4])])
    plan = dict(plan_capture(_ex(model)).decisions)
    assert _grows(plan["neg_w"]), plan


def _nonzero_model():
    """A growing KV cache beside NonZero(x > 0), whose count is decided by x's values."""
    nodes = [helper.make_node("Concat", ["past_key_values.0.key", "x"], ["present.0.key"], axis=2, name="cat"),
             helper.make_node("Greater", ["x", "zero"], ["mask"], name="greater"),
             helper.make_node("NonZero", ["mask"], ["nz"], name="nonzero"),
             helper.make_node("Cast", ["nz"], ["nzf"], to=TensorProto.FLOAT, name="cast"),
             helper.make_node("ReduceSum", ["nzf"], ["count"], keepdims=0, name="count"),
             helper.make_node("Mul", ["x", "count"], ["y0"], name="mul"),
             helper.make_node("Relu", ["y0"], ["y"], name="relu")]
    return _kv_model(nodes, [_vi("x", ["b", 2, "seq", 4])], [_vi("y", ["b", 2, "seq", 4])],
                     [numpy_helper.from_array(np.array(0, np.float32), "zero")])


def test_a_nonzero_count_beside_a_growing_cache_is_growing():
    """Contract (capture_plan docstring): a dim device data decides (NonZero's count) is growing
    even when onnx derives it from a feed symbol, so its consumers are seams; the scalar count a
    segment reads is fine. Segments are maximal runs of admitted nodes, split at every seam. (The
    session-level twin, with byte identity, is tests/test_segments.py's data-dependent test.)"""
    plan = plan_capture(_ex(_nonzero_model()))
    d = dict(plan.decisions)
    assert d["nonzero"] == "host read: mask"
    assert _grows(d["cast"]) and _grows(d["count"]), d
    assert d["greater"] is None and d["mul"] is None and d["relu"] is None
    assert plan.segments == [["greater"], ["mul", "relu"]]


def test_values_of_a_capture_unsafe_kernel_are_not_host_known():
    """Contract (capture_plan docstring: host-known is what the executor folds): the executor
    folds only capture-safe kernels, so TopK's k computed from NonZero over a constant is a host
    read, and NonZero itself is a 'kernel:' seam (it declares itself unsupported)."""
    nodes = [helper.make_node("NonZero", ["c"], ["nz"], name="nonzero"),
             helper.make_node("ReduceSum", ["nz", "axes"], ["k"], keepdims=0, name="sum"),
             helper.make_node("TopK", ["x", "k"], ["v", "i"], axis=-1, name="topk"),
             helper.make_node("Identity", ["past_key_values.0.key"], ["present.0.key"], name="id")]
    inits = [numpy_helper.from_array(np.array([1, 0, 1], np.int64), "c"),
             numpy_helper.from_array(np.array([1], np.int64), "axes")]
    model = _kv_model(nodes, [_vi("x", [3, 4])], [_vi("v", [3, "kk"]), _vi("i", [3, "kk"], TensorProto.INT64)], inits)
    d = dict(plan_capture(_ex(model)).decisions)
    assert d["nonzero"] == "kernel: data-dependent output shape"
    assert d["topk"] == "host read: k"


def test_a_conditional_kernel_is_admitted_exactly_when_it_says_yes():
    """Contract (capture_plan docstring, step 3): a ``conditional`` kernel is asked with the node's
    specs, constant values included: Dropout in inference mode (no training_mode, or a constant
    False) is admitted; with a constant True it is a 'kernel:' seam."""
    nodes = [helper.make_node("Dropout", ["x"], ["d0"], name="plain"),
             helper.make_node("Dropout", ["x", "ratio", "off"], ["d1"], name="inference"),
             helper.make_node("Dropout", ["x", "ratio", "on"], ["d2"], name="training"),
             helper.make_node("Identity", ["past_key_values.0.key"], ["present.0.key"], name="id")]
    inits = [numpy_helper.from_array(np.array(0.5, np.float32), "ratio"),
             numpy_helper.from_array(np.array(False), "off"), numpy_helper.from_array(np.array(True), "on")]
    model = _kv_model(nodes, [_vi("x", [2, 3])], [_vi(n, [2, 3]) for n in ("d0", "d1", "d2")], inits)
    d = dict(plan_capture(_ex(model)).decisions)
    assert d["plain"] is None and d["inference"] is None
    assert d["training"] == "kernel: training mode uploads a host-drawn mask"


def test_a_reshape_to_a_length_computed_from_the_kv_shape_grows():
    """Contract (capture_plan docstring: a dim decided by values that depend on a growing symbol
    grows, derived or not): Reshape(x, [2 * past_len, -1]) gets dims onnx derives from x's own
    symbols (b, seq), not from 'past'; only the value-level provenance of its target makes them
    growing, so Relu over the result is vetoed."""
    nodes = [helper.make_node("Shape", ["past_key_values.0.key"], ["s"], start=2, end=3, name="shape"),
             helper.make_node("Mul", ["s", "two"], ["s2"], name="twice"),
             helper.make_node("Concat", ["s2", "m1"], ["tgt"], axis=0, name="tgt"),
             helper.make_node("Reshape", ["x", "tgt"], ["r"], name="reshape"),
             helper.make_node("Relu", ["r"], ["rr"], name="relu"),
             helper.make_node("Identity", ["past_key_values.0.key"], ["present.0.key"], name="id")]
    inits = [numpy_helper.from_array(np.array([2], np.int64), "two"),
             numpy_helper.from_array(np.array([-1], np.int64), "m1")]
    ex = _ex(_kv_model(nodes, [_vi("x", ["b", "seq", 4])], [_vi("rr", [None, None])], inits))
    assert not ex.symbolic_shapes["r"][0].is_root, "the premise: onnx derived the dim from x's symbols"
    assert _grows(dict(plan_capture(ex).decisions)["relu"])


def test_a_symbol_s_roots_are_computed_once_per_symbol():
    """Provenance is a DAG whose paths multiply: a chain of n diamonds has 2**n paths to its root. Each
    symbol's roots are computed once (memoised): linear in the symbols, not in the paths."""
    # contract: Symbol.roots visits each symbol once; without it the growing-symbol classification of a
    # model with its values exposed (lockstep locate --session) took 270 million calls
    from lockstep.reference_runtime.symbols import Symbol

    root = Symbol("past_sequence_length")
    top = root
    chain = []
    for i in range(18):  # small enough that an unmemoised walk (262,144 paths) still ends, and fails below
        a, b = Symbol(f"a{i}", frozenset({top})), Symbol(f"b{i}", frozenset({top}))
        top = Symbol(f"m{i}", frozenset({a, b}))
        chain += [a, b, top]
    assert top.roots() == frozenset({root})
    assert top.roots() is top.roots(), "contract: computed once, then the same set"
    assert all(s.__dict__.get("_roots") == frozenset({root}) for s in chain), "contract: every symbol on the way memoised"
