"""Kernel errors (issue 15): a kernel's own Python exception is a named, non-sticky
``KernelHostError`` (an ``OpError``), never a device fault; attributes are validated when a model
loads, as ``OpError`` naming node, attribute and what is allowed."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import numpy as np
import onnx
import pytest
from lockstep.kernels._attr_check import validate as validate_node
from lockstep.kernels import Kernel, KernelHostError
from lockstep.kernels import primitives as P
from lockstep.kernels._op import NodeInfo, OpError, OpKernel, Spec
from lockstep.kernels.registry import REGISTRY, Registry
from lockstep.reference_runtime import Runtime, RuntimeConfig
from lockstep.reference_runtime.backends.sim import SimDevice
from lockstep.reference_runtime.executor import Executor
from onnx import TensorProto, helper

ROOT = Path(__file__).resolve().parents[1]


def _model(node, inputs, outputs, opset=21, domain_opsets=()):
    graph = helper.make_graph([node], "g", inputs, outputs)
    ops = [helper.make_opsetid("", opset), *[helper.make_opsetid(d, v) for d, v in domain_opsets]]
    return helper.make_model(graph, opset_imports=ops)


def _vi(name, dtype, shape):
    return helper.make_tensor_value_info(name, dtype, shape)


def _sim_runtime():
    return Runtime(SimDevice(), RuntimeConfig())


# ------------------------------------------------------------------ kernel host errors on a device


def test_kernel_body_exception_is_a_host_error_and_the_runtime_stays_usable(device_name, make_runtime):
    """On CuPy the body raises at the launch; on the simulator at the next synchronising call.
    Either way: KernelHostError (an OpError) chaining the original, no sticky error, and the same
    runtime runs work afterwards."""
    boom = Kernel("boom_kernel", lambda xp, out: 1 // 0, writes=(0,))
    rt = make_runtime()
    t = rt.upload(np.zeros(4, np.float32))
    with pytest.raises(KernelHostError, match=r"kernel 'boom_kernel': kernel host code raised ZeroDivisionError") as err:
        rt.launch(boom, t)
        rt.download(t)
    assert isinstance(err.value, OpError) and isinstance(err.value.__cause__, ZeroDivisionError)
    assert rt.device.sticky_error is None
    rt.launch(P.fill, t, value=3.0)
    assert rt.download(t).tolist() == [3.0] * 4


def _raising_registry():
    """The real registry plus a custom-domain op whose compute raises (a kernel bug)."""

    def shapes(node, specs):
        return [Spec(specs[0].shape, specs[0].dtype)]

    def compute(xp, node, x):
        raise KeyError("a kernel bug")

    bad = OpKernel("Broken", shapes, compute, domain="test.kern", since=1, capture="safe")
    kernels = [k for (d, op) in REGISTRY.ops() for k in REGISTRY._by_op[(d, op)]]
    return Registry([*kernels, bad])


def test_executor_kernel_exception_names_the_node_and_the_next_run_works(device_name, make_runtime):
    rt = make_runtime()
    x = _vi("x", TensorProto.FLOAT, [3])
    broken = _model(helper.make_node("Broken", ["x"], ["y"], name="the_broken_node", domain="test.kern"),
                    [x], [_vi("y", TensorProto.FLOAT, [3])], domain_opsets=[("test.kern", 1)])
    ex = Executor(broken, rt, registry=_raising_registry())
    with pytest.raises(KernelHostError, match=r"node 'the_broken_node' \(Broken, opset 1\): kernel host code raised KeyError"):
        ex.run({"x": np.ones(3, np.float32)})
    assert rt.device.sticky_error is None
    good = Executor(_model(helper.make_node("Neg", ["x"], ["y"]), [x], [_vi("y", TensorProto.FLOAT, [3])]), rt)
    assert good.run({"x": np.ones(3, np.float32)})["y"].tolist() == [-1.0] * 3


# ------------------------------------------------------------------ attribute validation at load

F = TensorProto.FLOAT
X4 = _vi("x", F, [1, 2, 4, 4])
Y4 = _vi("y", F, ["a", "b", "c", "d"])


def _resize(**attrs):
    node = helper.make_node("Resize", ["x", "", "scales"], ["y"], name="rs", **attrs)
    scales = helper.make_tensor("scales", F, [4], [1, 1, 2, 2])
    m = _model(node, [X4], [Y4])
    m.graph.initializer.append(scales)
    return m


def _simple(op, inputs, attrs, x=X4, y=Y4, opset=21, inits=(), attr_protos=()):
    node = helper.make_node(op, inputs, ["y"], name="n0", **attrs)
    node.attribute.extend(attr_protos)
    m = _model(node, [x], [y], opset=opset)
    m.graph.initializer.extend(inits)
    return m


def _matmulnbits(**over):
    attrs = {"K": 32, "N": 8, "bits": 4, "block_size": 32, **over}
    node = helper.make_node("MatMulNBits", ["x", "w", "s"], ["y"], name="n0", domain="com.microsoft", **attrs)
    m = _model(node, [_vi("x", F, [1, 32])], [_vi("y", F, [1, 8])], domain_opsets=[("com.microsoft", 1)])
    m.graph.initializer.extend([
        helper.make_tensor("w", TensorProto.UINT8, [8, 1, 16], np.zeros(128, np.uint8).tolist()),
        helper.make_tensor("s", F, [8], [1.0] * 8)])
    return m


CASES = {
    "resize-mode": (lambda: _resize(mode="bogus"), r"attribute mode='bogus' is invalid: allowed: 'nearest', 'linear', 'cubic'"),
    "resize-ctm": (lambda: _resize(coordinate_transformation_mode="bogus"), r"coordinate_transformation_mode='bogus'.*'half_pixel'"),
    "resize-nearest-mode": (lambda: _resize(nearest_mode="up"), r"nearest_mode='up'.*'round_prefer_floor'"),
    "pad-mode": (lambda: _simple("Pad", ["x", "pads"], {"mode": "mirror"},
                                              inits=[helper.make_tensor("pads", TensorProto.INT64, [8], [0] * 8)]), r"mode='mirror'.*'reflect'"),
    "gelu-approximate": (lambda: _simple("Gelu", ["x"], {"approximate": "fast"}, opset=20), r"approximate='fast'.*'tanh'"),
    "conv-auto-pad": (lambda: _simple("Conv", ["x", "x"], {"auto_pad": "SAME"}), r"auto_pad='SAME'.*'SAME_UPPER'"),
    "maxpool-strides": (lambda: _simple("MaxPool", ["x"], {"kernel_shape": [2, 2], "strides": [0, 1]}), r"strides=\[0, 1\].*>= 1"),
    "maxpool-pads-length": (lambda: _simple("MaxPool", ["x"], {"kernel_shape": [2, 2], "pads": [0, 0]}), r"pads=\[0, 0\].*4 entries"),
    "avgpool-kernel-empty": (lambda: _simple("AveragePool", ["x"], {}, attr_protos=[
        onnx.AttributeProto(name="kernel_shape", type=onnx.AttributeProto.INTS)]), r"kernel_shape is missing or empty"),
    "argmax-keepdims": (lambda: _simple("ArgMax", ["x"], {"keepdims": 2}, y=_vi("y", TensorProto.INT64, ["a", "b", "c", "d"])), r"keepdims=2.*allowed: 0, 1"),
    "eyelike-dtype": (lambda: _simple("EyeLike", ["x"], {"dtype": 0}, x=_vi("x", F, [3, 3]), y=_vi("y", F, [3, 3])), r"dtype=0.*element type"),
    "lppool-p": (lambda: _simple("LpPool", ["x"], {"kernel_shape": [2, 2], "p": 0}), r"p=0.*\[1, inf\]"),
    "depth-to-space-mode": (lambda: _simple("DepthToSpace", ["x"], {"blocksize": 2, "mode": "XYZ"}), r"mode='XYZ'.*'DCR', 'CRD'"),
    "matmulnbits-bits": (lambda: _matmulnbits(bits=3), r"bits=3.*allowed: 2, 4, 8"),
    "matmulnbits-block": (lambda: _matmulnbits(block_size=0), r"block_size=0.*\[16, inf\]"),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_bad_attribute_is_an_op_error_at_load(case):
    build, pattern = CASES[case]
    with pytest.raises(OpError, match=pattern) as err:
        Executor(build(), _sim_runtime())  # construction: nothing executes
    assert "node 'n0'" in str(err.value) or "node 'rs'" in str(err.value)
    assert not isinstance(err.value, KernelHostError)


def test_schema_required_attribute_is_checked_without_onnx_checker():
    """Models loaded with the checker never get here without a required attribute (ModelError
    first); the hook itself checks it, for loaders that skip the checker."""
    info = NodeInfo("n0", "LRN", "", 13, {}, 1, 1)
    with pytest.raises(OpError, match=r"node 'n0' \(LRN, opset 13\): required attribute size is missing"):
        validate_node(REGISTRY.lookup("", "LRN", 13), info)


def test_lrn_size_beyond_the_channels_runs_without_allocating_the_window():
    x = np.arange(2 * 3 * 2 * 2, dtype=np.float32).reshape(2, 3, 2, 2) / 10
    size = 2**31 - 1
    model = _simple("LRN", ["x"], {"size": size}, x=_vi("x", F, list(x.shape)), y=_vi("y", F, list(x.shape)))
    y = Executor(model, _sim_runtime()).run({"x": x})["y"]
    den = (1.0 + 1e-4 / size * (x.astype(np.float64) ** 2).sum(axis=1, keepdims=True)) ** 0.75
    np.testing.assert_allclose(y, x / den, rtol=1e-6)


def test_dropout_takes_any_int64_seed():
    x = np.ones((4, 4), np.float32)
    node = helper.make_node("Dropout", ["x", "r", "t"], ["y"], name="n0", seed=-(2**40))
    m = _model(node, [_vi("x", F, [4, 4])], [_vi("y", F, [4, 4])])
    m.graph.initializer.extend([helper.make_tensor("r", F, [], [0.5]),
                                helper.make_tensor("t", TensorProto.BOOL, [], [True])])
    y = Executor(m, _sim_runtime()).run({"x": x})["y"]
    assert set(np.unique(y).tolist()) <= {0.0, 2.0}


# ------------------------------------------------------------------ input-dependent checks in shapes()


def _resize_scales(value):
    m = _model(helper.make_node("Resize", ["x", "", "scales"], ["y"], name="rs"), [X4, _vi("scales", F, [4])], [Y4])
    return m, {"x": np.ones((1, 2, 4, 4), np.float32), "scales": np.array([1, 1, value, 2], np.float32)}


@pytest.mark.parametrize("value", [np.nan, np.inf])
def test_resize_scales_not_finite_is_an_op_error(value):
    model, feeds = _resize_scales(value)
    with pytest.raises(OpError, match=r"node 'rs' \(Resize, opset 21\): scales .* must be positive and finite") as err:
        Executor(model, _sim_runtime()).run(feeds)
    assert not isinstance(err.value, KernelHostError)


def test_onehot_depth_not_finite_is_an_op_error():
    node = helper.make_node("OneHot", ["i", "d", "v"], ["y"], name="oh")
    m = _model(node, [_vi("i", TensorProto.INT64, [3]), _vi("d", F, [])], [_vi("y", F, [3, "n"])])
    m.graph.initializer.append(helper.make_tensor("v", F, [2], [0, 1]))
    with pytest.raises(OpError, match=r"node 'oh' \(OneHot, opset 21\): input 'depth' must hold finite numbers"):
        Executor(m, _sim_runtime()).run({"i": np.arange(3), "d": np.array(np.inf, np.float32)})


def test_qlinearmatmul_zero_point_shape_is_an_op_error():
    u8 = TensorProto.UINT8
    node = helper.make_node("QLinearMatMul", ["a", "as", "azp", "b", "bs", "bzp", "ys", "yzp"], ["y"], name="q")
    m = _model(node, [_vi("a", u8, [2, 3]), _vi("azp", u8, [0])], [_vi("y", u8, [2, 4])])
    m.graph.initializer.extend([
        helper.make_tensor("as", F, [], [0.1]), helper.make_tensor("b", u8, [3, 4], [1] * 12),
        helper.make_tensor("bs", F, [], [0.1]), helper.make_tensor("bzp", u8, [], [0]),
        helper.make_tensor("ys", F, [], [0.1]), helper.make_tensor("yzp", u8, [], [0])])
    feeds = {"a": np.ones((2, 3), np.uint8), "azp": np.zeros(0, np.uint8)}
    with pytest.raises(OpError, match=r"node 'q' .*a_zero_point has shape \(0,\): one value, or 1-D of 2 expected"):
        Executor(m, _sim_runtime()).run(feeds)


def test_pool_window_larger_than_the_padded_input_is_an_op_error():
    """Before, the output was empty but the window index arrays took kernel_shape's size."""
    m = _simple("MaxPool", ["x"], {"kernel_shape": [2**31, 1]})
    with pytest.raises(OpError, match=r"node 'n0' \(MaxPool, opset 21\): kernel_shape \[2147483648, 1\] .* larger than "
                                      r"the padded input \(4\) on spatial axis 0") as err:
        Executor(m, _sim_runtime()).run({"x": np.ones((1, 2, 4, 4), np.float32)})
    assert not isinstance(err.value, KernelHostError)


def test_raw_exception_from_a_kernels_shape_code_names_the_node():
    """A kernel's shapes() failing with a plain Python exception (a missing check) is a
    KernelHostError naming the node, raised before anything is launched."""

    def shapes(node, specs):
        return [Spec((specs[0].shape[5],), specs[0].dtype)]  # IndexError on a short shape

    bad = OpKernel("ShapeBug", shapes, lambda xp, node, x: (x,), domain="test.kern", since=1, capture="safe")
    kernels = [k for (d, op) in REGISTRY.ops() for k in REGISTRY._by_op[(d, op)]]
    x = _vi("x", F, [3])
    m = _model(helper.make_node("ShapeBug", ["x"], ["y"], name="sb", domain="test.kern"),
               [x], [_vi("y", F, [3])], domain_opsets=[("test.kern", 1)])
    rt = _sim_runtime()
    with pytest.raises(KernelHostError, match=r"node 'sb' \(ShapeBug, opset 1\): kernel host code raised IndexError") as err:
        Executor(m, rt, registry=Registry([*kernels, bad])).run({"x": np.ones(3, np.float32)})
    assert isinstance(err.value.__cause__, IndexError)
    assert not any(k.startswith("ShapeBug") for k in rt.device.executed)


# ------------------------------------------------------------------ the mutation sweeps, bounded


SWEEPS = {
    # attribute mutations (the ops whose mutations ended as LaunchFailure or a raw exception before)
    "attrs": ((), ("Resize", "Upsample", "Gelu", "EyeLike", "LpPool", "LRN", "Dropout", "Attention",
                   "TfIdfVectorizer", "TreeEnsemble")),
    # host-read input values (NaN/inf scales and depths)
    "inputs": (("--inputs",), ("OneHot", "Upsample", "RoiAlign", "ImageDecoder")),
    # feed shapes reaching shapes() (rank +-1, empty)
    "shapes": (("--shapes",), ("QLinearMatMul", "MatMulInteger", "Split", "STFT", "GroupNormalization", "RoiAlign")),
    # any axis of a feed emptied (issue 29: these ended as KernelHostError, a kernel's own ValueError/IndexError)
    "empty axes": (("--shapes",), ("SoftmaxCrossEntropyLoss", "NegativeLogLikelihoodLoss", "Attention", "ConvTranspose",
                                   "Einsum", "GlobalMaxPool", "GridSample", "RotaryEmbedding")),
}


@pytest.mark.parametrize("sweep", sorted(SWEEPS))
def test_mutations_of_node_cases_give_named_errors(tmp_path, sweep):
    """scripts/mutate_attrs.py over ops whose mutations used to end as LaunchFailure, a raw
    exception or a KernelHostError: every outcome is now OK or a named error (one case per op,
    attribute or input, and mutation)."""
    out = tmp_path / "m.jsonl"
    classes = set()
    flags, ops = SWEEPS[sweep]
    for op in ops:
        proc = subprocess.run([sys.executable, str(ROOT / "scripts" / "mutate_attrs.py"), *flags, "--per-op", "1",
                               "--match", op, "--out", str(out)], check=False, capture_output=True, text=True, timeout=120)
        assert proc.returncode == 0, proc.stderr[-2000:]
        summary = proc.stdout.strip().splitlines()[-1]
        # "memory" (an allocation past the device's means) is the device memory budget's class
        bad = [line for line in proc.stdout.splitlines()[:-1] if not line.startswith("memory ")]
        assert not bad, f"{op}: {summary}\n" + "\n".join(bad[:20])
        classes |= set(ast.literal_eval(summary.split(":", 1)[1].strip()))
    assert classes <= {"ok", "named", "memory"} and "named" in classes


# ------------------------------------------------------------------ input errors named before the kernel runs (issue 29)


def test_a_node_with_fewer_inputs_than_its_kernel_takes_is_an_op_error_at_load():
    """Guarantee (_attr_check._arity): a node given fewer inputs than its kernel's compute takes
    positionally is refused when the model loads, naming the missing inputs (com.microsoft ops have
    no ONNX schema to count them); it used to reach compute as a TypeError (KernelHostError)."""
    x = _vi("x", F, [1, 2, 4])
    node = helper.make_node("SkipSimplifiedLayerNormalization", ["x", "s"], ["y"], name="ssln", domain="com.microsoft")
    m = _model(node, [x, _vi("s", F, [1, 2, 4])], [_vi("y", F, [1, 2, 4])], domain_opsets=[("com.microsoft", 1)])
    with pytest.raises(OpError, match=r"node 'ssln' \(SkipSimplifiedLayerNormalization, opset 1\): 2 input\(s\) given, "
                                      r"3 required \(x, skip, gamma\): missing gamma") as err:
        Executor(m, _sim_runtime())  # construction: nothing executes
    assert not isinstance(err.value, KernelHostError), "contract: an input error, not a kernel's own exception"
    two = OpKernel("TwoIn", lambda node, specs: [specs[0]], lambda xp, node, a, b: (a + b,), domain="test.kern", capture="safe")
    kernels = [k for (d, op) in REGISTRY.ops() for k in REGISTRY._by_op[(d, op)]]
    m = _model(helper.make_node("TwoIn", ["x"], ["y"], name="t", domain="test.kern"), [x], [_vi("y", F, [1, 2, 4])],
               domain_opsets=[("test.kern", 1)])
    with pytest.raises(OpError, match=r"1 input\(s\) given, 2 required \(a, b\): missing b"):
        Executor(m, _sim_runtime(), registry=Registry([*kernels, two]))
    m = _model(helper.make_node("TwoIn", ["x", ""], ["y"], name="t", domain="test.kern"), [x], [_vi("y", F, [1, 2, 4])],
               domain_opsets=[("test.kern", 1)])
    with pytest.raises(OpError, match=r"input 1 \(b\) is empty \(\"\"\), but the operator requires it"):
        Executor(m, _sim_runtime(), registry=Registry([*kernels, two]))  # (fuzz seed 29 case 8304: MatMulNBits scales)
    maybe = OpKernel("TwoIn", lambda node, specs: [specs[0]], lambda xp, node, a, b: (a if b is None else a + b,),
                     domain="test.kern", optional=(1,), capture="safe")
    Executor(m, _sim_runtime(), registry=Registry([*kernels, maybe]))  # declared optional: loads


@pytest.mark.parametrize("op", ["SoftmaxCrossEntropyLoss", "NegativeLogLikelihoodLoss"])
def test_a_loss_over_zero_classes_is_an_op_error_naming_the_shape(op):
    node = helper.make_node(op, ["s", "t"], ["o"], name="loss", reduction="mean")
    m = _model(node, [_vi("s", F, [2, 0]), _vi("t", TensorProto.INT64, [2])], [_vi("o", F, [])], opset=13)
    with pytest.raises(OpError, match=rf"node 'loss' \({op}, opset 13\): input shape \(2, 0\) has 0 classes") as err:
        Executor(m, _sim_runtime()).run({"s": np.zeros((2, 0), np.float32), "t": np.zeros(2, np.int64)})
    assert not isinstance(err.value, KernelHostError), "contract: a shape check names it, not the kernel's ValueError"


@pytest.mark.parametrize("a, b", [((5, 0, 3), (5, 3, 4)), ((5, 2, 3), (5, 3, 0)), ((5, 2, 0), (5, 0, 4)), ((1, 2, 3), (0, 3, 4))])
def test_einsum_with_an_empty_axis_gives_numpys_result(a, b):
    """Result: an empty label is a size like any other (it used to broadcast as 1: a ValueError)."""
    node = helper.make_node("Einsum", ["a", "b"], ["y"], equation="bij,bjk->bik")
    m = _model(node, [_vi("a", F, list(a)), _vi("b", F, list(b))], [_vi("y", F, ["B", "I", "K"])], opset=12)
    rng = np.random.default_rng(0)
    A, B = rng.random(a, dtype=np.float32), rng.random(b, dtype=np.float32)
    (y,) = Executor(m, _sim_runtime()).run({"a": A, "b": B}).values()
    np.testing.assert_allclose(y, np.einsum("bij,bjk->bik", A, B), rtol=1e-6)


def test_a_kernel_that_declares_no_capture_is_refused_at_construction():
    # contract: capture has no default that claims safety: a kernel without the declaration, or a non-safe one
    # without a reason, is refused when it is built (at import for the packaged kernels), naming the op
    def shapes(node, specs):
        return [specs[0]]

    with pytest.raises(ValueError, match="Forgot: a kernel declares its capture"):
        OpKernel("Forgot", shapes, lambda xp, node, x: (x,))
    with pytest.raises(ValueError, match="Seam: capture='unsupported' needs a reason"):
        OpKernel("Seam", shapes, lambda xp, node, x: (x,), capture="unsupported")
    assert OpKernel("Fine", shapes, lambda xp, node, x: (x,), capture="safe").capture == "safe"


@pytest.mark.parametrize("axis", [np.nan, 1.5])
def test_a_dft_axis_that_is_no_integer_is_named_not_a_host_error(axis):
    """result (issue 55, fuzzer): ONNX's test_dft_axis with its axis input a float (NaN, 1.5) is refused
    as an OpError naming the node and the input's type and value; before, `int(nan)` escaped as a
    KernelHostError ('cannot convert float NaN to integer')."""
    from lockstep.reference_runtime.node_cases import _value, load_cases

    case = next(c for c in load_cases() if c.name == "test_dft_axis")
    model = case.proto()
    next(i for i in model.graph.input if i.name == "axis").type.tensor_type.elem_type = TensorProto.FLOAT
    x = _value(case.inputs[0])
    with pytest.raises(OpError, match=r"axis must be an integer \(int32 or int64\), got float32") as info:
        Executor(model, _sim_runtime()).run({"x": x, "axis": np.array(axis, np.float32)})
    assert not isinstance(info.value, KernelHostError), info.value
