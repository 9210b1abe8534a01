"""Launch replay (reference_runtime/plan.py, ``Runtime.launch_recorded``/``relaunch``): a planned
static node records its launch once and is relaunched from the record, without its kernel's host
code, while it gets the very same tensors. On every selected device (``make_runtime``: the
simulated device in CI, CuPy on the GPU lane, where a record holds RawKernel launches only).
Each test says whether it asserts a *contract* (when a record is used) or a *result* (values).
"""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from lockstep.decoding import greedy
from lockstep.golden.anchors import MODEL_DIR
from lockstep.kernels import _fast, _launch
from lockstep.kernels._kernel import Kernel
from lockstep.reference_runtime import DeviceAssert, RuntimeConfig
from lockstep.reference_runtime.engine import RefDecoder
from lockstep.reference_runtime.errors import UseAfterFree
from lockstep.reference_runtime.executor import Executor
from onnx import TensorProto, helper, numpy_helper

PROMPT = list(b"The quick brown fox")
F = np.float32


def _decode(make_runtime, model: str, replay: bool, tokens: int = 8):
    rt = make_runtime(RuntimeConfig(launch_replay=replay))
    dec = RefDecoder(onnx.load(str(MODEL_DIR / f"{model}.onnx")), rt)
    return dec, greedy(dec, PROMPT, tokens)


def _plans(dec):
    return list(dec.ex.plans._plans.values())


# Ops whose decode-shaped bodies are RawKernel launches alone on CuPy (kernels/_fast.py, _fused.py,
# _linalg.py): recorded there; other bodies (CuPy reductions, ufunc fallbacks) run every step.
_RAW_ON_CUPY = {"MatMul", "Transpose", "RMSNormalization", "RotaryEmbedding", "TensorScatter", "Attention", "Add",
                "Mul", "Sub", "Sigmoid", "Gather", "Cast", "Slice", "Unsqueeze", "Equal", "LessOrEqual", "Range", "Shape",
                "SiluMul", "AddRMSNorm", "MatMulGroup", "RotaryPair", "ScatterPair"}  # the fused steps (reference_runtime/fusion.py)


@pytest.mark.parametrize("model", ["tiny-fp32-standard-kv64", "tiny-fp32-standard"])
def test_a_replayed_decode_is_byte_identical_and_replays_its_static_nodes(make_runtime, model):
    """Result: every step's logits byte-identical with launch replay on and off, the same launches.
    Contract: in the decode plan every static launching node replays (those reading a dynamic
    node's output too: it is written into a planned buffer), except the one writing a graph output
    allocated afresh each step (the logits); on CuPy, every node of an op whose body is RawKernel
    launches alone. Off, none replays."""
    _, off = _decode(make_runtime, model, False)
    dec, on = _decode(make_runtime, model, True)
    assert [a.tobytes() for a in on.step_logits] == [a.tobytes() for a in off.step_logits], "result"
    assert on.counters["launches"] == off.counters["launches"], "contract: the same launches"
    (plan,) = _plans(dec)
    static = {pn.name: dec.ex.steps[pn.index].info.op_type for pn in plan.nodes if not pn.slow and pn.call is not None}
    left = {pn.name for pn in plan.nodes if pn.name in static and pn.replay is None}
    fresh = {pn.name for pn in plan.nodes if any(name == "logits" for _, name, _ in pn.per_run)}
    assert fresh and plan.replays > 0
    if dec.rt.device.name == "sim":
        assert left == fresh, "contract: every static node with fixed tensors replays"
    else:
        assert not {n for n in left - fresh if static[n] in _RAW_ON_CUPY}, \
            "contract: the RawKernel-only bodies replay on CuPy"
    dec_off, _ = _decode(make_runtime, model, False, tokens=4)
    assert all(p.replays == 0 for p in _plans(dec_off)), "contract: launch_replay=False records nothing"


def _chain_model():
    """y = (x + c) * c: ``Add`` writes an intermediate (a planned buffer), ``Mul`` the graph output."""
    c = numpy_helper.from_array(np.arange(6, dtype=F).reshape(2, 3) + 1, "c")
    nodes = [helper.make_node("Add", ["x", "c"], ["s"], name="add"), helper.make_node("Mul", ["s", "c"], ["y"], name="mul")]
    g = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 3])],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, 3])], initializer=[c])
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", 21)], ir_version=10)


def test_a_node_handed_other_tensors_runs_its_body(make_runtime):
    """Result: a device feed replaced by another tensor of the same shape (same step signature) gives
    the new feed's values: the recorded launch, which names the old tensor, is not relaunched.
    Contract: its record is dropped."""
    rt = make_runtime()
    ex = Executor(_chain_model(), rt)
    c = np.arange(6, dtype=F).reshape(2, 3) + 1
    x1, x2 = np.full((2, 3), 1, F), np.full((2, 3), 7, F)
    t1 = rt.upload(x1)
    for _ in range(3):  # node by node (recorded), plan built and recorded, relaunched
        np.testing.assert_array_equal(ex.run({"x": t1})["y"], (x1 + c) * c)
    (plan,) = ex.plans._plans.values()
    assert plan.replays == 1, "contract: Add replays (Mul writes a fresh graph output)"
    t2 = rt.upload(x2)
    np.testing.assert_array_equal(ex.run({"x": t2})["y"], (x2 + c) * c, err_msg="result: the new feed's values")
    assert plan.replays == 0, "contract: the record naming the old feed is dropped"
    for _ in range(2):
        np.testing.assert_array_equal(ex.run({"x": t2})["y"], (x2 + c) * c)
    assert plan.replays == 0, "contract: a record that served once is not taken again (tensors new each step)"


def test_a_record_that_served_is_taken_again_for_new_tensors(make_runtime):
    """Contract: a record relaunched ``StepPlan.REARM`` times whose tensors then change (a cache
    allocated anew for the next sequence) is recorded again on the next run and relaunched after.
    Result: every run gives its own feed's values."""
    from lockstep.reference_runtime.plan import StepPlan

    rt = make_runtime()
    ex = Executor(_chain_model(), rt)
    c = np.arange(6, dtype=F).reshape(2, 3) + 1
    x1, x2 = np.full((2, 3), 2, F), np.full((2, 3), 5, F)
    t1, t2 = rt.upload(x1), rt.upload(x2)
    for _ in range(2 + StepPlan.REARM):
        np.testing.assert_array_equal(ex.run({"x": t1})["y"], (x1 + c) * c)
    (plan,) = ex.plans._plans.values()
    assert plan.replays == 1
    np.testing.assert_array_equal(ex.run({"x": t2})["y"], (x2 + c) * c, err_msg="result: the mismatch runs the body")
    assert plan.replays == 0
    np.testing.assert_array_equal(ex.run({"x": t2})["y"], (x2 + c) * c, err_msg="result: recorded again")
    assert plan.replays == 1, "contract: recorded again on the run after the mismatch"
    np.testing.assert_array_equal(ex.run({"x": t2})["y"], (x2 + c) * c, err_msg="result: relaunched")


def _gather_model(op: str):
    """``op``(data, idx) into an intermediate, then ``Add`` 0: the indexing node is static and
    planned, its index checks flag into the error latch."""
    data = numpy_helper.from_array(np.arange(12, dtype=F).reshape(4, 3), "data")
    zero = numpy_helper.from_array(np.zeros((1,), F), "zero")
    idx_shape = [2, 3] if op == "GatherElements" else [2]
    nodes = [helper.make_node(op, ["data", "idx"], ["g"], name=f"{op}_under_test", axis=0),
             helper.make_node("Add", ["g", "zero"], ["y"], name="add")]
    out_shape = [2, 3]
    g = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("idx", TensorProto.INT64, idx_shape)],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, out_shape)], initializer=[data, zero])
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", 21)], ir_version=10)


@pytest.mark.parametrize("op", ["Gather", "GatherElements"])
def test_a_replayed_index_check_still_sets_the_latch(make_runtime, op):
    """Result: after the indexing node is relaunched from its record, new in-range indices give new
    values and an out-of-range one is a DeviceAssert naming the node (the relaunched flag kernel
    sets the latch and the next synchronising read looks at it). On CuPy, GatherElements has no
    single-launch path: its body (flag kernel + CuPy ops) is never recorded, so its values follow
    the indices too."""
    rt = make_runtime()
    ex = Executor(_gather_model(op), rt)
    data = np.arange(12, dtype=F).reshape(4, 3)
    shape = (2, 3) if op == "GatherElements" else (2,)

    def want(idx):
        return np.take_along_axis(data, idx, 0) if op == "GatherElements" else data[idx]

    first = np.zeros(shape, np.int64) + 1
    for _ in range(3):
        np.testing.assert_array_equal(ex.run({"idx": first})["y"], want(first))
    other = np.zeros(shape, np.int64) + 3
    np.testing.assert_array_equal(ex.run({"idx": other})["y"], want(other), err_msg="result: new indices")
    with pytest.raises(DeviceAssert, match=f"{op}_under_test"):
        ex.run({"idx": other + 1})
    rt.reset_error_latch()
    np.testing.assert_array_equal(ex.run({"idx": first})["y"], want(first))


def test_a_relaunch_naming_a_freed_tensor_is_refused(make_runtime):
    """Contract: ``relaunch`` of a record whose tensor has been freed since raises UseAfterFree
    naming it; nothing is enqueued."""
    rt = make_runtime()
    t = rt.empty((4,), np.float32, name="victim")
    values = np.arange(4, dtype=np.float32)
    fill = Kernel("test_fill4", lambda xp, out: _fast.fill_value(xp, out, values), writes=(0,))  # one RawKernel on CuPy
    r = rt.launch_recorded(fill, t)
    np.testing.assert_array_equal(rt.download(t), values)
    assert r is not None, "a body of one RawKernel launch is recordable on every device"
    launches = rt.counters.launches
    rt.relaunch(r)
    assert rt.counters.launches == launches + 1
    rt.free(t)
    with pytest.raises(UseAfterFree, match="victim"):
        rt.relaunch(r)
    assert rt.counters.launches == launches + 1


def test_launch_replay_is_configuration():
    """Contract: ``launch_replay`` is a configuration field (environment LOCKSTEP_LAUNCH_REPLAY, read
    once by ``from_env``), on by default; a bad value names the variable."""
    assert RuntimeConfig().launch_replay is True
    assert RuntimeConfig.from_env({"LOCKSTEP_LAUNCH_REPLAY": "0"}).launch_replay is False
    with pytest.raises(ValueError, match="LOCKSTEP_LAUNCH_REPLAY"):
        RuntimeConfig.from_env({"LOCKSTEP_LAUNCH_REPLAY": "sometimes"})


# -- the kernels' recorder (kernels/_fast.py), without a GPU ---------------------------------------

class _FakeRaw:
    """Stands for a cupy.RawKernel: ``.kernel`` is the function a record keeps."""

    def __init__(self):
        self.kernel = object()
        self.calls = []

    def __call__(self, grid, block, args, shared_mem=0):
        self.calls.append((grid, block, args, shared_mem))


def test_the_recorder_keeps_launches_only_while_recording():
    """Contract: ``_launch.launch`` launches always and appends (function, grid, block, args,
    shared_mem) to the active recorder only; ``recording`` nests and restores."""
    k = _FakeRaw()
    _launch.launch(k, (1,), (32,), (1, 2))
    outer, inner = _launch.LaunchRecorder(), _launch.LaunchRecorder()
    with _launch.recording(outer):
        _launch.launch_1d(k, 600, ("a",))
        with _launch.recording(inner):
            _launch.launch(k, (2,), (64,), ("b",), 128)
        _launch.launch(k, (3,), (32,), ("c",))
    _launch.launch(k, (4,), (32,), ("d",))
    assert len(k.calls) == 5
    assert [r[1:] for r in outer.launches] == [((3,), (256,), ("a",), 0), ((3,), (32,), ("c",), 0)]
    assert inner.launches == [(k.kernel, (2,), (64,), ("b",), 128)]
    assert outer.complete and inner.complete


def test_the_recording_module_refuses_what_may_launch():
    """Contract: through ``RecordingModule`` a body may reach types and kernel constructors; any other
    attribute (a ufunc, ``copyto``, ``empty``) refuses the record, naming the first one; so does
    ``unrecordable``; a record with no launch is not complete."""
    rec = _launch.LaunchRecorder()
    xp = _launch.RecordingModule(np, rec)
    assert xp.__name__ == "numpy" and xp.float32 is np.float32 and xp.int64 is np.int64
    assert rec.refused is None and not rec.complete, "contract: nothing launched is not a record"
    assert xp.copyto is np.copyto
    xp.add  # noqa: B018
    assert rec.refused == "xp.copyto"
    other = _launch.LaunchRecorder()
    _launch.unrecordable("outside any recording: ignored")
    with _launch.recording(other):
        _launch.launch(_FakeRaw(), (1,), (1,), ())
        _launch.unrecordable("ndarray.fill")
    assert other.refused == "ndarray.fill" and not other.complete


def test_a_recorded_launch_packs_its_arguments_as_cupy_passes_them():
    """Contract: the CUDA backend's parameter block for ``cuLaunchKernel`` (``backends.cupy._pack``):
    a device array passes its data pointer, numpy scalars their own bytes, Python int/float/bool
    as int64/float64/bool (CuPy's conversions), each at an 8-aligned offset, grid and block padded
    to three dims; any other argument makes the launch unrecordable. (Checked with stand-ins here;
    the GPU lane relaunches every node case's record through it.)"""
    import ctypes

    from lockstep.reference_runtime.backends.cupy import _pack

    class FakeXp:
        class ndarray:
            def __init__(self, ptr):
                self.data = type("Mem", (), {"ptr": ptr})()

    class Fn:
        ptr = 0xF00

    args = (FakeXp.ndarray(0xABC0), np.int32(-2), np.float32(1.5), 7, 0.25, True, np.uint8(9))
    packed = _pack(FakeXp, Fn(), (5,), (256, 2), args, 64)
    fn, gx, gy, gz, bx, by, bz, smem, params, (blob, ptrs) = packed
    assert (fn, gx, gy, gz, bx, by, bz, smem) == (0xF00, 5, 1, 1, 256, 2, 1, 64)
    assert params == ptrs.ctypes.data and list(ptrs) == [blob.ctypes.data + 8 * i for i in range(len(args))]

    def at(i, ctype):
        return ctypes.cast(int(ptrs[i]), ctypes.POINTER(ctype)).contents.value

    assert at(0, ctypes.c_uint64) == 0xABC0 and at(1, ctypes.c_int32) == -2 and at(2, ctypes.c_float) == 1.5
    assert at(3, ctypes.c_int64) == 7 and at(4, ctypes.c_double) == 0.25 and at(5, ctypes.c_bool) is True
    assert at(6, ctypes.c_uint8) == 9
    assert _pack(FakeXp, Fn(), (1,), (1,), (None,), 0) is None, "None is not an argument CuPy packs"
    assert _pack(FakeXp, Fn(), (1,), (1,), ("x",), 0) is None
    assert _pack(FakeXp, object(), (1,), (1,), (), 0) is None, "a function without a handle"
