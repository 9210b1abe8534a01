"""Kernel cases ONNX's node suite does not cover (found by the kernels layer's source mutants,
docs/mutation/kernels.md): each runs a one-node model on the selected device and compares it with
onnx's reference (``ReferenceEvaluator``) or, where that has no implementation of the op version,
with the operator's definition written out in numpy. Each test says whether it asserts a *result*
(the op's values) or a *contract* (the runtime's error reporting).
"""

from __future__ import annotations

import numpy as np
import pytest
from lockstep.reference_runtime import DeviceAssert
from lockstep.reference_runtime.executor import Executor
from onnx import helper
from onnx.reference import ReferenceEvaluator

F, I = np.float32, np.int64
I64_MIN = np.iinfo(np.int64).min


def _model(nodes, inputs: dict, outputs: dict, opset: int):
    """A graph of ``nodes``; ``inputs``/``outputs``: name -> (numpy dtype, shape)."""
    def vi(name, dt, shape):
        return helper.make_tensor_value_info(name, helper.np_dtype_to_tensor_dtype(np.dtype(dt)), shape)

    g = helper.make_graph(nodes, "g", [vi(n, *t) for n, t in inputs.items()],
                          [vi(n, *t) for n, t in outputs.items()])
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", opset)], ir_version=10)


def _one(op, feeds: dict, out_dtype, opset: int = 21, **attrs):
    """(model, onnx reference's output): one node ``op`` over ``feeds`` with one output ``y``."""
    node = helper.make_node(op, list(feeds), ["y"], name=f"{op}_under_test", **attrs)
    ins = {n: (v.dtype, v.shape) for n, v in feeds.items()}
    want = ReferenceEvaluator(_model([node], ins, {"y": (out_dtype, None)}, opset)).run(None, feeds)[0]
    return _model([node], ins, {"y": (out_dtype, want.shape)}, opset), want


def _run(make_runtime, model, feeds):
    return Executor(model, make_runtime()).run(feeds)["y"]


# -- Slice: negative steps -------------------------------------------------------------------------

@pytest.mark.parametrize("starts,ends,steps", [
    ([-1], [I64_MIN], [-1]),          # x[::-1] as exporters write it: end before the start clamps to -1
    ([4], [-100], [-2]),              # an end far before the axis start, step -2
    ([2], [-6], [-1]),                # end + dim = -1: still before element 0
])
def test_slice_negative_step_reaches_element_zero(make_runtime, starts, ends, steps):
    """Result: a negative-step Slice whose end lies before the axis start includes element 0
    (ONNX clamps such an end to -1); ONNX's node cases only end at 0 or later."""
    feeds = {"x": np.arange(5, dtype=F), "starts": np.array(starts, I), "ends": np.array(ends, I),
             "axes": np.array([0], I), "steps": np.array(steps, I)}
    model, want = _one("Slice", feeds, F)
    assert want[-1] == 0.0
    np.testing.assert_array_equal(_run(make_runtime, model, feeds), want)


# -- Range -----------------------------------------------------------------------------------------

@pytest.mark.parametrize("start,limit,delta,dt", [
    (0, 10, 3, np.int64),             # 10 / 3 is not whole: 4 elements
    (-2, 7, 4, np.int32),
    (5, -6, -2, np.int64),
    (0.0, 1.0, 0.3, np.float32),      # 3.33..: 4 elements (ceil), not 3
    (2.5, -1.0, -1.5, np.float64),
    (3, 3, 1, np.int64),              # empty
])
def test_range_count_is_the_ceiling(make_runtime, start, limit, delta, dt):
    """Result: Range has ceil((limit - start) / delta) elements, for integer and float inputs
    (the node suite has one integer and whole-number float cases)."""
    feeds = {"start": np.array(start, dt), "limit": np.array(limit, dt), "delta": np.array(delta, dt)}
    model, want = _one("Range", feeds, dt)
    got = _run(make_runtime, model, feeds)
    assert got.shape == want.shape and got.dtype == want.dtype
    np.testing.assert_allclose(got, want, rtol=1e-6)


# -- legacy broadcasting (opset < 7) ---------------------------------------------------------------

@pytest.mark.parametrize("op,fn", [("Add", np.add), ("Mul", np.multiply), ("Sub", np.subtract)])
def test_legacy_broadcast_aligns_b_with_the_trailing_dims(make_runtime, op, fn):
    """Result: before opset 7, broadcast=1 without axis lines B up with A's trailing dimensions
    (onnx's reference has no legacy broadcasting: the definition in numpy)."""
    a = np.arange(24, dtype=F).reshape(2, 3, 4)
    b = np.arange(12, dtype=F).reshape(3, 4) + 1
    model = _model([helper.make_node(op, ["a", "b"], ["y"], broadcast=1)],
                   {"a": (F, a.shape), "b": (F, b.shape)}, {"y": (F, a.shape)}, opset=6)
    np.testing.assert_array_equal(_run(make_runtime, model, {"a": a, "b": b}), fn(a, b))


# -- Softmax / LogSoftmax before opset 13 ----------------------------------------------------------

def _softmax_2d(x, axis):
    rows = int(np.prod(x.shape[:axis]))
    x2 = x.reshape(rows, -1).astype(np.float64)
    e = np.exp(x2 - x2.max(axis=1, keepdims=True))
    return (e / e.sum(axis=1, keepdims=True)).reshape(x.shape)


@pytest.mark.parametrize("op", ["Softmax", "LogSoftmax"])
@pytest.mark.parametrize("axis", [None, 2, -1])
def test_softmax_before_opset_13_runs_over_the_flattened_trailing_block(make_runtime, op, axis):
    """Result: opset < 13 coerces X to 2-D at ``axis`` (default 1) and normalizes each row of the
    trailing block (ONNX's node cases are all opset 13+; the definition in numpy)."""
    x = np.random.default_rng(0).standard_normal((2, 3, 4)).astype(F)
    attrs = {} if axis is None else {"axis": axis}
    model = _model([helper.make_node(op, ["x"], ["y"], **attrs)], {"x": (F, x.shape)}, {"y": (F, x.shape)}, opset=11)
    want = _softmax_2d(x, 1 if axis is None else axis % 3)
    if op == "LogSoftmax":
        want = np.log(want)
    np.testing.assert_allclose(_run(make_runtime, model, {"x": x}), want, rtol=1e-5, atol=1e-6)


# -- half-precision reductions accumulate in float32 -------------------------------------------------

@pytest.mark.parametrize("op,x,want", [
    ("ReduceMean", [[60000.0, 60000.0]], 60000.0),   # the float16 sum (120000) would overflow to inf
    ("ReduceL2", [[300.0, 400.0]], 500.0),           # the float16 sum of squares (250000) too
    ("ReduceSumSquare", [[100.0, 100.0, 0.5]], 20000.25),
])
def test_float16_reductions_accumulate_in_float32(make_runtime, op, x, want):
    """Result: a float16 Reduce* accumulates in float32 and casts the result back (ops_reduce's
    docstring), so a total past float16's range that ends in range is finite. The definition in
    float64, not onnx's reference, which accumulates ReduceL2/SumSquare in float16 and overflows."""
    feeds = {"x": np.array(x, np.float16), "axes": np.array([1], I)}
    model = _model([helper.make_node(op, ["x", "axes"], ["y"], keepdims=0)],
                   {"x": (np.float16, [1, len(x[0])]), "axes": (I, [1])}, {"y": (np.float16, [1])}, opset=18)
    got = _run(make_runtime, model, feeds)
    assert got.dtype == np.float16
    np.testing.assert_allclose(got.astype(np.float64), [np.float16(want)], rtol=1e-3)


# -- Conv / pooling: begin and end pads differ on an axis ---------------------------------------------

@pytest.mark.parametrize("op,attrs", [
    ("Conv", dict(strides=[2, 1])),
    ("MaxPool", dict(kernel_shape=[2, 3], strides=[1, 2])),
    ("AveragePool", dict(kernel_shape=[3, 3], count_include_pad=0)),
    ("AveragePool", dict(kernel_shape=[3, 3], count_include_pad=1, strides=[2, 2])),
])
def test_window_ops_with_asymmetric_pads(make_runtime, op, attrs):
    """Result: ``pads`` are [begin of each axis..., end of each axis...]; with begin != end on an
    axis (no ONNX node case of Conv or a pool has one) the output matches onnx's reference. Each
    pad is smaller than the kernel (ONNX Runtime requires it: no window lies wholly in padding)."""
    rng = np.random.default_rng(1)
    feeds = {"x": rng.standard_normal((1, 2, 5, 6)).astype(F)}
    if op == "Conv":
        feeds["w"] = rng.standard_normal((3, 2, 3, 3)).astype(F)
    model, want = _one(op, feeds, F, opset=21, pads=[1, 0, 0, 2], **attrs)
    np.testing.assert_allclose(_run(make_runtime, model, feeds), want, rtol=1e-5, atol=1e-5)


# -- MatMul: int64 accumulation --------------------------------------------------------------------

def test_matmul_spans_several_tiles_and_batches(make_runtime):
    """Result: a float32 MatMul whose M, N and K pass one 16-wide tile of the GPU kernel (ONNX's
    MatMul/Gemm node cases all have K < 16), with broadcast batches, matches onnx's reference."""
    rng = np.random.default_rng(2)
    feeds = {"a": rng.standard_normal((2, 1, 19, 37)).astype(F), "b": rng.standard_normal((3, 37, 21)).astype(F)}
    model, want = _one("MatMul", feeds, F, opset=13)
    np.testing.assert_allclose(_run(make_runtime, model, feeds), want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("k", [7, 33, 64, 256])
def test_matmul_decode_rows_sum_every_k(make_runtime, k):
    """Result: decode-shaped products (one row of A, a 2-D weight; the GPU's warp kernel, whose 32
    lanes each sum every 32nd k before a shuffle tree) match onnx's reference for K below, at and
    far past one warp's width."""
    rng = np.random.default_rng(3)
    feeds = {"a": rng.standard_normal((1, 1, k)).astype(F), "b": rng.standard_normal((k, 40)).astype(F)}
    model, want = _one("MatMul", feeds, F, opset=13)
    np.testing.assert_allclose(_run(make_runtime, model, feeds), want, rtol=1e-5, atol=1e-5)


def test_matmul_int64_accumulates_past_32_bits(make_runtime):
    """Result: an int64 MatMul accumulates in int64 (products and sums past 2**31 do not wrap)."""
    a = np.array([[3_000_000_000, 5, -7], [1, 2**20, 3]], I)  # no int64 overflow: C leaves it undefined
    b = np.array([[2, 1], [3, 4_000_000_000], [-5, 6]], I)
    model, want = _one("MatMul", {"a": a, "b": b}, I, opset=13)
    np.testing.assert_array_equal(want, a @ b)
    np.testing.assert_array_equal(_run(make_runtime, model, {"a": a, "b": b}), want)


# -- the error latch names the first node that flagged -----------------------------------------------

def test_latch_names_the_first_node_that_flagged(make_runtime):
    """Contract: when two nodes flag out-of-range indices in one run, DeviceAssert names the first
    one launched (the latch keeps the first site; kernels/_latch.py)."""
    nodes = [helper.make_node("Gather", ["d", "i"], ["g1"], name="Gather_first"),
             helper.make_node("Gather", ["d", "j"], ["g2"], name="Gather_second"),
             helper.make_node("Add", ["g1", "g2"], ["y"], name="add")]
    model = _model(nodes, {"d": (F, [4]), "i": (I, [2]), "j": (I, [2])}, {"y": (F, [2])}, opset=13)
    d = np.arange(4, dtype=F)
    ok = {"d": d, "i": np.array([0, 3], I), "j": np.array([1, -4], I)}
    rt = make_runtime()
    ex = Executor(model, rt)
    np.testing.assert_array_equal(ex.run(ok)["y"], [1.0, 3.0])
    with pytest.raises(DeviceAssert, match="Gather_first") as exc:
        ex.run({**ok, "i": np.array([4, 0], I), "j": np.array([0, 9], I)})
    assert "Gather_second" not in str(exc.value)
    rt.reset_error_latch()
    with pytest.raises(DeviceAssert, match="Gather_second"):  # the site is per node, not per run
        ex.run({**ok, "j": np.array([0, 9], I)})
