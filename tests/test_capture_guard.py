"""The capture guard (``reference_runtime/backends/_capture_guard.py``, ``SimDevice(capture_guard=True)``):
a kernel that runs from a captured graph on the guarded simulated device gets arrays and an ``xp``
that refuse every host read, with ``HostReadInCapture`` naming the kernel, the node and the line."""

from __future__ import annotations

import math
import operator

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper

from lockstep.kernels import Kernel
from lockstep.kernels._op import NodeInfo, OpKernel, Spec
from lockstep.kernels.registry import Registry
from lockstep.reference_runtime import Runtime, RuntimeConfig
from lockstep.reference_runtime.backends._capture_guard import GuardContext, GuardedArray, GuardedNumpy, guard
from lockstep.reference_runtime.backends.sim import SimDevice
from lockstep.reference_runtime.capture_guard_pass import guard_case
from lockstep.reference_runtime.errors import CaptureD2HRefused, HostReadInCapture
from lockstep.reference_runtime.executor import Executor
from lockstep.reference_runtime.node_cases import load_cases
from lockstep.reference_runtime.segments import CaptureSession

NODE = NodeInfo("n0", "Probe", "", 1, {}, 1, 1)


def _iter_read(xp, x):
    acc = 0.0
    for v in x:
        acc += float(v)
    return acc


def _mask_set(xp, x):
    y = x.copy()
    y[x > 0] = 0
    return y[0]


# each read is on the lambda's own line (its co_firstlineno), which the error must name
READS = {
    "bool": lambda xp, x: 1.0 if bool(x[0]) else 0.0,
    "if": lambda xp, x: 1.0 if x.any() else 0.0,
    "not any": lambda xp, x: float(not x.any()),
    "float": lambda xp, x: float(x[0]),
    "__float__": lambda xp, x: x[0].__float__(),
    "int": lambda xp, x: int(x[1]),
    "index": lambda xp, x: operator.index(x.astype(xp.int64)[1]),
    "range": lambda xp, x: len(range(x.astype(xp.int64).sum())),
    "complex": lambda xp, x: complex(x[0]).real,
    "f-string": lambda xp, x: len(f"{x[0]:.3f}"),
    "format": lambda xp, x: len("{}".format(x)),
    "percent": lambda xp, x: len("%d" % x[1]),
    "str": lambda xp, x: len(str(x)),
    "repr": lambda xp, x: len(repr(x)),
    "print": lambda xp, x: print(x) or 0.0,
    "__array__": lambda xp, x: x.__array__().sum(),
    "tolist": lambda xp, x: x.tolist()[0],
    "item": lambda xp, x: x.item(0),
    "tobytes": lambda xp, x: len(x.tobytes()),
    "in": lambda xp, x: float(2.0 in x),
    "math": lambda xp, x: math.exp(x[0]),
    "builtin min": lambda xp, x: min(x[0], x[1]),
    "builtin max": lambda xp, x: max(x),
    "sorted": lambda xp, x: sorted(x)[0],
    "mask": lambda xp, x: x[x > 0].sum(),
    "unique": lambda xp, x: xp.unique(x).sum(),
    "np.unique": lambda xp, x: np.unique(x).sum(),
    "nonzero": lambda xp, x: xp.nonzero(x)[0].sum(),
    "x.nonzero": lambda xp, x: x.nonzero()[0].sum(),
    "flatnonzero": lambda xp, x: xp.flatnonzero(x).sum(),
    "argwhere": lambda xp, x: xp.argwhere(x).sum(),
    "extract": lambda xp, x: xp.extract(x > 0, x).sum(),
    "compress": lambda xp, x: xp.compress(x > 0, x).sum(),
    "where 1-arg": lambda xp, x: xp.where(x > 0)[0].sum(),
}


def _probe(read):
    def body(xp, out, x, node=None):
        out[...] = read(xp, x)

    return Kernel("probe", body, writes=(0,))


def _captured(kernel, x_host, *, guard_on=True, capture=True, node=NODE):
    rt = Runtime(SimDevice(capture_guard=guard_on), RuntimeConfig())
    x, out = rt.upload(x_host), rt.empty((), np.float64)
    if capture:
        rt.begin_capture("primary")
        rt.launch(kernel, out, x, node=node)
        rt.end_capture("primary")
        rt.replay("primary")
    else:
        rt.launch(kernel, out, x, node=node)
    return rt.download(out)


X = np.array([1.5, 2.0, -3.0], np.float64)


@pytest.mark.parametrize("what", sorted(READS))
def test_each_host_read_in_a_captured_kernel_is_refused_naming_kernel_node_and_line(what):
    """Contract (SimDevice capture_guard): a kernel replayed from a captured graph that reads
    device values on the host, in any of these forms, raises HostReadInCapture (a CaptureD2HRefused,
    as CuPy refuses the D2H) naming the kernel, the ONNX node and op type, and the line of the read."""
    read = READS[what]
    with pytest.raises(HostReadInCapture) as info:
        _captured(_probe(read), X)
    err = info.value
    assert isinstance(err, CaptureD2HRefused)
    assert (err.kernel, err.node, err.op_type) == ("probe", "n0", "Probe")
    assert err.file == __file__ and err.line == read.__code__.co_firstlineno, (err.file, err.line, str(err))
    assert f"test_capture_guard.py:{err.line}" in str(err) and "node 'n0'" in str(err)


@pytest.mark.parametrize("what", ["iteration then float", "mask assignment"])
def test_reads_inside_helpers_name_the_helpers_line(what):
    """Contract: the named line is the first frame outside numpy and the guard, so a read inside a
    helper the kernel calls names the helper's line."""
    helper_fn = _iter_read if what.startswith("iteration") else _mask_set
    with pytest.raises(HostReadInCapture) as info:
        _captured(_probe(helper_fn), X)
    src = info.value.source
    assert info.value.file == __file__
    assert ("float(v)" in src) if helper_fn is _iter_read else ("y[x > 0] = 0" in src), src


def test_the_guard_is_off_outside_a_capture_and_off_by_default():
    """Contract: the guard applies only to kernels run from a captured graph on a device built with
    capture_guard=True; eager launches, and captures on a default device, run the body unguarded."""
    bad = _probe(READS["float"])
    assert _captured(bad, X, capture=False) == 1.5
    assert _captured(bad, X, guard_on=False) == 1.5
    assert SimDevice().capture_guard is False


def test_a_runtime_primitive_is_named_by_its_kernel():
    """Contract: a refused read in a kernel launched without an ONNX node names the kernel alone."""
    with pytest.raises(HostReadInCapture, match=r"kernel 'probe': float\(\)") as info:
        _captured(_probe(READS["float"]), X, node=None)
    assert info.value.node is None


def _legit(xp, x):
    """numpy a kernel may use during capture: fixed output shapes, no value reaches the host."""
    y = xp.where(x > 0, x, -x) + xp.float32(1)
    m = xp.stack([y, y * 2]).reshape(2, 3)
    parts = [
        m.sum(), m.mean(), m.std(axis=0).sum(), m.astype(np.float16).mean(), m.argmax(), xp.max(m, axis=1).sum(),
        xp.take(m, xp.asarray([2, 0]), axis=1).sum(), m[:, xp.asarray([1])].sum(), m[1, 2], m[..., None].sum(),
        xp.concatenate([m, m], axis=0).sum(), xp.einsum("ij->j", m).sum(), xp.sort(m, axis=1)[:, 0].sum(),
        xp.cumsum(m, axis=1)[:, -1].sum(), xp.pad(m, 1).sum(), xp.clip(m, 1, 3).sum(), m.clip(1, 3).sum(),
        xp.count_nonzero(m), xp.isnan(m).any(), xp.maximum.reduce(m, axis=0).sum(), xp.linalg.norm(m),
        xp.fft.fft(m).real.sum(), xp.broadcast_to(m, (2, 2, 3)).sum(), xp.prod(xp.asarray(m.shape)),
        sum(m[0]), xp.stack([r for r in m]).sum(), xp.round(m).sum(), abs(-m).sum(), xp.argsort(m).sum(),
        xp.searchsorted(xp.asarray([1.0, 2.0]), m.reshape(-1)).sum(), xp.matmul(m, m.T).sum(),
    ]
    acc = xp.zeros((), xp.float64)
    for p in parts:
        assert isinstance(p, GuardedArray) or xp.__name__ == "numpy" and not isinstance(xp, GuardedNumpy)
        acc = acc + p
    buf = xp.zeros_like(m)
    xp.copyto(buf, m)
    buf[0, xp.asarray([0, 2])] = 7.0
    return acc + buf.sum() + len(m) + m.shape[1] + m.ndim + m.size


def test_legitimate_numpy_in_a_captured_kernel_is_not_refused_and_stays_guarded():
    """Result: a body using many numpy routines a capture-safe kernel may use runs guarded without
    a refusal, every result it computes is a guarded device array (never a numpy scalar that would
    escape the guard), and its value is the unguarded run's."""
    assert _captured(_probe(_legit), X) == _captured(_probe(_legit), X, guard_on=False)


def test_guarded_xp_keeps_numpy_identity_for_kernels_that_choose_their_path_by_it():
    """Contract: the guarded array module is named ``numpy`` (kernels choose their numpy path by
    ``xp.__name__``) and hands back numpy's dtypes, classes and ufuncs unchanged."""
    xp = GuardedNumpy(GuardContext("k"))
    assert xp.__name__ == "numpy" and xp.float32 is np.float32 and xp.add is np.add and xp.finfo is np.finfo
    assert isinstance(xp.asarray([1, 2]), GuardedArray) and not isinstance(guard(np.ones(2), None)[0], np.generic)


_SAMPLE = ("test_add", "test_conv_with_strides_padding", "test_gather_0", "test_reduce_mean_default_axes_keepdims_example",
           "test_layer_normalization_4d_axis0", "test_resize_upsample_scales_linear", "test_cast_FLOAT_to_FLOAT16",
           "test_instancenorm_example", "test_lrn", "test_attention_3d", "test_softmax_axis_0", "test_top_k",
           "test_einsum_batch_matmul", "test_scatter_elements_with_axis", "test_slice", "test_reshape_extended_dims",
           "test_matmul_3d", "test_dft", "test_quantizelinear", "test_gathernd_example_int32")


@pytest.mark.parametrize("name", _SAMPLE)
def test_a_sample_of_real_kernels_runs_captured_and_guarded_with_eager_bytes(name):
    """Result: a sample of the registry's kernels (elementwise, conv, index, reduce, norm, resize,
    cast, recurrent, attention, einsum, scatter, host-input shape ops, DFT, quantize) runs captured
    on the guarded device with no refusal, and the captured bytes equal the eager bytes."""
    (case,) = [c for c in load_cases() if c.name == name]
    out = guard_case(case)
    assert out.status == "passed" and out.captured_nodes >= 1, out


def test_an_unseeded_random_op_is_a_skip_and_a_seeded_one_is_compared():
    """Result: Bernoulli's expansion (RandomUniformLike, an eager seam, then Greater and Cast,
    captured) draws afresh each run without a seed, so the pass skips it naming the op; with a seed
    both runs draw the same and the bytes must agree."""
    cases = {c.name: c for c in load_cases() if c.name in ("test_bernoulli_expanded", "test_bernoulli_seed_expanded")}
    free = guard_case(cases["test_bernoulli_expanded"])
    assert free.status == "skipped" and free.detail.startswith("unseeded random op RandomUniformLike"), free
    seeded = guard_case(cases["test_bernoulli_seed_expanded"])
    assert seeded.status == "passed" and seeded.captured_nodes >= 1, seeded


def _bad_compute(xp, node, x):
    if x.any():  # a host read of device data: CuPy refuses it during capture
        return (x * 2,)
    return (x,)


def test_a_wrong_capture_declaration_is_found_through_the_executor_and_capture_session():
    """Result: an op declared capture="safe" whose compute branches on a device value runs fine
    eagerly, and its captured run in a CaptureSession on the guarded device raises
    HostReadInCapture naming the launched kernel, the node, its op type and the compute line."""
    op = OpKernel("BadAny", lambda node, specs: [Spec(specs[0].shape, specs[0].dtype)], _bad_compute,
                  domain="com.example", capture="safe")
    node = helper.make_node("BadAny", ["x"], ["y"], name="bad0", domain="com.example")
    graph = helper.make_graph([node], "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [3])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [3])],
                              value_info=[helper.make_tensor_value_info("y", TensorProto.FLOAT, [3])])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21), helper.make_opsetid("com.example", 1)],
                              ir_version=10)
    onnx.checker.check_model(model)
    ex = Executor(model, Runtime(SimDevice(capture_guard=True), RuntimeConfig()), registry=Registry([op]))
    sess = CaptureSession(ex)
    x = np.array([1.0, 0.0, 2.0], np.float32)
    np.testing.assert_array_equal(sess.run({"x": x})["y"], 2 * x)  # eager: fine
    with pytest.raises(HostReadInCapture) as info:
        sess.run({"x": x})
    err = info.value
    assert (err.kernel, err.node, err.op_type) == ("BadAny:bad0", "bad0", "BadAny")
    assert err.line == _bad_compute.__code__.co_firstlineno + 1 and "if x.any()" in err.source, str(err)
    assert sess.counters.captures == 1, "contract: the node really was captured (not a seam)"


def _fixture_ops():
    import importlib.util
    from pathlib import Path

    path = Path(__file__).parent / "fixtures" / "capture_guard" / "wrong_kernels.py"
    spec = importlib.util.spec_from_file_location("capture_guard_wrong_kernels", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return path, mod.OPS


@pytest.mark.parametrize("op_type", [op.op_type for op in _fixture_ops()[1]])
def test_each_wrongly_declared_fixture_kernel_is_caught_by_the_dynamic_pass(op_type):
    """Result: each kernel of tests/fixtures/capture_guard/wrong_kernels.py (declared safe, one class
    of host read each: print, f-string, str, math.*, builtin max/sorted, __float__, `not x.any()`,
    mask get/set, unique, extract, reading iteration, __index__, item) is refused under a captured
    run through the executor, naming its node and a line of the fixture file."""
    path, ops = _fixture_ops()
    (op,) = [o for o in ops if o.op_type == op_type]
    node = helper.make_node(op_type, ["x"], ["y"], name="n", domain="com.example")
    vi = [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, 3])]
    graph = helper.make_graph([node], "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 3])], vi,
                              value_info=vi)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21), helper.make_opsetid("com.example", 1)],
                              ir_version=10)
    ex = Executor(model, Runtime(SimDevice(capture_guard=True), RuntimeConfig()), registry=Registry([op]))
    sess = CaptureSession(ex)
    x = np.array([[1.0, -2.0, 3.0], [0.5, 0.0, -1.0]], np.float32)
    sess.run({"x": x})
    with pytest.raises(HostReadInCapture) as info:
        sess.run({"x": x})
    assert info.value.op_type == op_type and info.value.node == "n" and info.value.file == str(path), str(info.value)


# Host reads the static audit cannot see, each with the reason (the dynamic pass is their backstop).
STATIC_GAPS = {
    "IndexX": "range() of a device scalar (__index__ through a builtin taking an int): the audit tracks "
              "range() as a host builtin over host ints",
}


def test_static_and_dynamic_passes_agree_on_the_wrongly_declared_kernels():
    """Contract (cross-check, as sync-debug is cross-checked with the audit): every fixture kernel the
    dynamic pass refuses is also reported by the static audit inside that kernel's compute, except the
    listed gaps; and a listed gap the audit now sees must leave the list (no stale excuse)."""
    import ast

    from lockstep.contracts.audit import audit

    path, ops = _fixture_ops()
    tree = ast.parse(path.read_text())
    spans = {f.name: (f.lineno, f.end_lineno) for f in tree.body if isinstance(f, ast.FunctionDef)}
    res = audit([str(path)])
    lines = {f.line for f in res.findings}
    seen = {}
    for op in ops:
        lo, hi = spans[op.compute.__name__]
        seen[op.op_type] = any(lo <= ln <= hi for ln in lines)
    missed = sorted(k for k, v in seen.items() if not v)
    assert missed == sorted(STATIC_GAPS), (
        f"static audit misses {missed}; documented gaps {sorted(STATIC_GAPS)} (a new miss is a regression, "
        "a gap now seen must leave STATIC_GAPS)")


def test_the_pass_as_a_command(capsys):
    """Contract: the command runs the selected cases and reports counts; a --match naming no case is
    one usage line, exit 2 (not an empty success)."""
    from lockstep.reference_runtime.capture_guard_pass import main

    assert main(["--match", "test_add_bcast"]) == 0
    assert "passed=1" in capsys.readouterr().out
    assert main(["--match", "no_such_case*"]) == 2
    assert "matches no node case" in capsys.readouterr().err


def test_the_audit_and_the_guard_read_one_table_per_fact():
    # contract: the static audit and the dynamic capture guard decide "data-dependent output shape" and
    # "host result from metadata" from the same tables (kernels/_xp_facts.py); they used to disagree
    # (the audit's 5 data-dependent calls against the guard's 15)
    from lockstep.contracts import audit_index
    from lockstep.kernels import _xp_facts
    from lockstep.reference_runtime.backends import _capture_guard

    assert audit_index.DATA_SHAPE is _capture_guard.DATA_DEPENDENT is _xp_facts.DATA_DEPENDENT_SHAPE
    assert audit_index.HOST_XP is _capture_guard.METADATA is _xp_facts.HOST_RESULT
