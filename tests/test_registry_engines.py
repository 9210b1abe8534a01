"""The kernel registry's validation and the engine layer's classification of what it cannot run."""

from __future__ import annotations

import re
import sys
import types

import numpy as np
import pytest
from lockstep.kernels._op import Spec, Unary
from lockstep.kernels.registry import REGISTRY, Registry
from lockstep.reference_runtime.backends import device_class
from lockstep.reference_runtime.engine import RefEngine, _dtypes
from lockstep.engines import EngineLoadError, Unsupported
from onnx import TensorProto, helper

from lockstep.engines.ort import OrtEngine
from lockstep.engines.registry import load_engine


def _k(op="Neg", **kw):
    return Unary(op, lambda xp, x: -x, **{"capture": "safe", **kw})


def test_registry_rejects_overlapping_versions():
    with pytest.raises(ValueError, match=r"duplicate kernels for ai.onnx::Neg"):
        Registry([_k(since=1, until=12), _k(since=10)])
    Registry([_k(since=1, until=12), _k(since=13)])  # adjacent ranges are fine


def test_registry_rejects_non_kernels_and_modules_without_ops(tmp_path, monkeypatch):
    with pytest.raises(TypeError, match="is not an OpKernel"):
        Registry([object()])
    mod = types.ModuleType("lockstep_test_empty_ops")
    monkeypatch.setitem(sys.modules, "lockstep_test_empty_ops", mod)
    with pytest.raises(ImportError, match="defines no OPS list"):
        Registry.from_modules(("lockstep_test_empty_ops",))


def test_non_safe_capture_needs_a_reason_and_conditional_needs_a_predicate():
    with pytest.raises(ValueError, match="needs a reason"):
        _k(capture="unsupported")
    with pytest.raises(ValueError, match="capture='conditional' and capture_ok go together"):
        _k(capture="conditional", reason="depends on shapes")
    _k(capture="conditional", reason="depends on shapes", capture_ok=lambda node, specs: True)
    with pytest.raises(ValueError, match="must be safe/unsupported/conditional"):
        _k(capture="maybe", reason="x")


def test_registry_covers_the_llm_decoder_ops():
    needed = ["MatMul", "Gemm", "Add", "Mul", "Sigmoid", "Softmax", "LogSoftmax", "Attention", "RotaryEmbedding",
              "RMSNormalization", "LayerNormalization", "Gather", "GatherElements", "ScatterElements", "Reshape",
              "Transpose", "Concat", "Split", "Slice", "Expand", "Shape", "Squeeze", "Unsqueeze", "Cast", "Where",
              "Range", "Trilu", "ReduceSum", "ReduceMean", "ReduceMax", "TopK", "ArgMax", "CumSum"]
    missing = [op for op in needed if REGISTRY.lookup("", op, 23) is None]
    assert not missing


def _tiny(ir=8, elem=TensorProto.FLOAT):
    g = helper.make_graph([helper.make_node("Identity", ["x"], ["y"])], "g",
                          [helper.make_tensor_value_info("x", elem, [2])], [helper.make_tensor_value_info("y", elem, [2])])
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", 13)], ir_version=ir)


def test_ort_reports_a_too_new_ir_version_as_unsupported():
    eng = load_engine("ort-cpu")
    assert eng.available()[0]
    with pytest.raises(Unsupported, match="IR version newer than this engine accepts"):
        eng.prepare(_tiny(ir=99))
    run = eng.prepare(_tiny())
    assert run({"x": np.ones(2, np.float32)})[0].tolist() == [1.0, 1.0]


def test_ort_cuda_that_falls_back_to_cpu_is_unavailable(monkeypatch):
    class Session:
        def __init__(self, *a, providers, **k):
            self.providers = providers

        def get_providers(self):
            return ["CPUExecutionProvider"]  # what a silent fallback looks like

    fake = types.SimpleNamespace(
        __version__="0.0-fake", get_available_providers=lambda: ["CUDAExecutionProvider", "CPUExecutionProvider"],
        InferenceSession=Session, SessionOptions=lambda: types.SimpleNamespace(log_severity_level=0),
        set_default_logger_severity=lambda level: None,
    )
    monkeypatch.setitem(sys.modules, "onnxruntime", fake)
    ok, why = OrtEngine("CUDAExecutionProvider").available()
    assert not ok and "fell back" in why


def test_cuda_engine_refuses_dtypes_cupy_cannot_hold():
    holds = device_class("cupy").ARRAY_DTYPES
    assert _dtypes(_tiny(elem=TensorProto.BFLOAT16)) - holds == {"bfloat16"}
    assert _dtypes(_tiny(elem=TensorProto.FLOAT8E5M2)) - holds == {"float8_e5m2"}
    assert _dtypes(_tiny(elem=TensorProto.FLOAT16)) - holds == set()
    assert device_class("sim").ARRAY_DTYPES is None, "contract: the simulated device holds every numpy dtype"
    eng = RefEngine("cupy")
    for elem in (TensorProto.BFLOAT16, TensorProto.FLOAT8E5M2, TensorProto.INT4):
        eng._check_dtypes(_tiny(elem=elem))  # contract: the small types are held as raw bits (kernels/_small.py)
    eng._check_dtypes(_tiny(elem=TensorProto.STRING))  # contract: string tensors stay on the host (host_values)


def test_unknown_engine_name():
    from lockstep.engines import registered

    names = sorted(registered())
    assert {"ref-sim", "ref-cuda", "ort-cpu", "ort-cuda"} <= set(names)
    with pytest.raises(EngineLoadError, match=re.escape(f"unknown engine 'trt'; registered: {names}")):
        load_engine("trt")


def test_spec_rank():
    assert Spec((2, 3), np.dtype(np.float32)).rank == 2


def test_ort_cuda_engines_declare_their_options_and_precision():
    """ort-cuda is strict fp32 (use_tf32=0) and says so; ort-cuda-tf32 keeps ONNX Runtime's TF32
    default and is locked with the TF32 error model; both pin cuDNN's algorithm choice."""
    from lockstep.engines.ort import cpu_engine, cuda_engine, cuda_tf32_engine

    strict, tf32 = cuda_engine(), cuda_tf32_engine()
    assert strict.provider_options["use_tf32"] == "0" and strict.precision["float32"] == "fp32"
    assert tf32.provider_options["use_tf32"] == "1" and tf32.precision["float32"] == "tf32"
    assert strict.provider_options["cudnn_conv_algo_search"] == tf32.provider_options["cudnn_conv_algo_search"] == "DEFAULT"
    info = cpu_engine().describe()
    assert info["deterministic_compute"] == "True" and info["provider_options"] == "defaults"
