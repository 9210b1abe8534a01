"""lockstep's nxrt engines (``lockstep/engines/nxrt.py``) on a small decoder built in code.

Contracts: nxrt-cpu's decode session (``NxrtDecoder``: the presents fed back as nxrt's own values)
decodes as ONNX Runtime does; an engine whose package is not installed is unavailable with the
command that installs it; nxrt-ep-cpu's refusal of nodes it loads alone is an error, not Unsupported."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from lockstep.decoding import open_session, teacher_force
from lockstep.decoder_io import DecoderIO
from lockstep.engines.nxrt import NxrtDecoder, NxrtEpEngine
from lockstep.engines.refusal import EngineError
from lockstep.engines.registry import load_engine


def toy_decoder(vocab: int = 16, hidden: int = 4, seed: int = 0) -> onnx.ModelProto:
    """A decoder in lockstep's own convention: one layer whose step attends every cached key (no mask:
    decoded step by step only) over a growing KV cache, the logits a product of the result."""
    rng = np.random.default_rng(seed)
    inits = [numpy_helper.from_array(rng.standard_normal((vocab, hidden)).astype(np.float32), "emb"),
             numpy_helper.from_array(rng.standard_normal((hidden, vocab)).astype(np.float32), "W"),
             numpy_helper.from_array(np.array([1], np.int64), "one"),
             numpy_helper.from_array(np.array([1, -1, hidden], np.int64), "shape")]
    nodes = [helper.make_node("Gather", ["emb", "input_ids"], ["x"]),
             helper.make_node("Unsqueeze", ["x", "one"], ["q"]),
             helper.make_node("Concat", ["past_key_values.0.key", "q"], ["present.0.key"], axis=2),
             helper.make_node("Concat", ["past_key_values.0.value", "q"], ["present.0.value"], axis=2),
             helper.make_node("Transpose", ["present.0.key"], ["kt"], perm=[0, 1, 3, 2]),
             helper.make_node("MatMul", ["q", "kt"], ["scores"]),
             helper.make_node("MatMul", ["scores", "present.0.value"], ["ctx"]),
             helper.make_node("Reshape", ["ctx", "shape"], ["y"]),
             helper.make_node("Add", ["x", "y"], ["h"]),
             helper.make_node("MatMul", ["h", "W"], ["logits"])]
    f = lambda name, shape: helper.make_tensor_value_info(name, TensorProto.FLOAT, shape)  # noqa: E731
    graph = helper.make_graph(
        nodes, "toy", [helper.make_tensor_value_info("input_ids", TensorProto.INT64, [1, "S"]),
                       f("past_key_values.0.key", [1, 1, "P", hidden]), f("past_key_values.0.value", [1, 1, "P", hidden])],
        [f("logits", [1, "S", vocab]), f("present.0.key", [1, 1, "T", hidden]), f("present.0.value", [1, 1, "T", hidden])],
        initializer=inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21)], ir_version=10)


def _engine(name):
    engine = load_engine(name)
    ok, why = engine.available()
    if not ok:
        pytest.skip(why)
    return engine


def test_nxrt_cpu_decodes_through_its_own_values_as_onnx_runtime_does():
    model = toy_decoder()
    io = DecoderIO.of(model)
    ours = open_session(_engine("nxrt-cpu"), model, io=io)
    assert isinstance(ours, NxrtDecoder), "contract: the engine's own decode session runs the locks"
    got = teacher_force(ours, [1, 2, 3, 4, 5], stepwise=True)
    want = teacher_force(open_session(_engine("ort-cpu"), model, io=io), [1, 2, 3, 4, 5], stepwise=True)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)  # result: the same logits, step by step
    assert type(ours.cache["past_key_values.0.key"]).__name__ == "NxrtValue", "contract: the cache stays nxrt's"


def test_an_engine_whose_package_is_missing_names_its_extra(monkeypatch):
    import importlib

    real = importlib.import_module

    def no_cuda_plugin(name, *args):
        if name == "nxrt_ep_cuda":
            raise ModuleNotFoundError("No module named 'nxrt_ep_cuda'")
        return real(name, *args)

    monkeypatch.setattr(importlib, "import_module", no_cuda_plugin)
    ok, why = NxrtEpEngine("nxrt_ep_cuda", "nxrt-ep-cuda", "cuda").available()
    assert not ok and "pip install 'lockstep-conformance[nxrt-cuda]'" in why


def test_nxrt_ep_cpu_declining_nodes_it_loads_alone_is_an_error():
    """nxrt-ep-cpu 0.1.0.dev6 declines this graph's Gather, Unsqueeze, Transpose, Reshape and Add in the
    model (ONNX Runtime's CPU fallback off) though it claims each alone: an error by the rule."""
    engine = _engine("nxrt-ep-cpu")
    try:
        engine.prepare(toy_decoder())
    except EngineError as exc:
        assert "loads each alone" in str(exc)
    else:
        pytest.fail("nxrt-ep-cpu now runs the toy decoder: decode it here against ort-cpu instead")
