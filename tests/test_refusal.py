"""The Unsupported-vs-error rule (``lockstep.engines.refusal``) and the nxrt engines' use of it.

Contract: a refusal is ``Unsupported`` only when it is a fact about the engine whatever surrounds the
node (the node alone is refused too, or the model is one node); a refusal of a node the engine loads
alone is an ``EngineError``; a runtime's message that means "no kernel, type or capability" is told
from any other failure by the engine's ``Refusals`` table."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from lockstep.engines import Unsupported
from lockstep.engines.refusal import EngineError, Refusals, alone, confirm


def _model(nodes, inputs, outputs, inits=()):
    graph = helper.make_graph(nodes, "g", inputs, outputs, initializer=list(inits))
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21)], ir_version=10)


def _two_nodes():
    """x -> Relu -> Reshape(shape: a small constant) -> y."""
    shape = numpy_helper.from_array(np.array([2, 3], np.int64), "shape")
    return _model([helper.make_node("Relu", ["x"], ["r"], name="relu"),
                   helper.make_node("Reshape", ["r", "shape"], ["y"], name="reshape")],
                  [helper.make_tensor_value_info("x", TensorProto.FLOAT, [6])],
                  [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)], [shape])


def _refuses(*ops):
    def load(model):
        if any(n.op_type in ops for n in model.graph.node):
            raise RuntimeError("unsupported operator")
    return load


def test_alone_types_the_inputs_as_the_whole_model_does_and_keeps_small_constants():
    m = _two_nodes()
    probe = alone(m, m.graph.node[1])
    assert [n.op_type for n in probe.graph.node] == ["Reshape"]
    (r,) = probe.graph.input
    assert r.name == "r" and r.type.tensor_type.elem_type == TensorProto.FLOAT, "result: typed by inference"
    assert [t.name for t in probe.graph.initializer] == ["shape"], "result: a small constant stays a constant"
    onnx.checker.check_model(probe, full_check=True)


def test_a_refusal_of_a_node_that_loads_alone_is_an_error():
    m = _two_nodes()
    got = confirm("eng", "no kernel for Reshape", m, [m.graph.node[1]], _refuses("Nothing"), "refused Reshape")
    assert isinstance(got, EngineError) and "loads it alone" in str(got) and "Reshape 'reshape'" in str(got)


def test_a_node_refused_alone_too_is_unsupported_naming_its_operator():
    m = _two_nodes()
    got = confirm("eng", "whatever", m, list(m.graph.node), _refuses("Reshape"), "declined")
    assert isinstance(got, Unsupported) and "ai.onnx::Reshape" in str(got) and "Relu" not in str(got).split("(")[0]
    assert "1 other declined node(s) load alone" in str(got), "result: the neighbours it declined are counted"


def test_a_model_of_one_node_is_its_own_probe():
    m = _model([helper.make_node("Relu", ["x"], ["y"])], [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2])],
               [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2])])
    got = confirm("eng", "no kernel for Relu", m, list(m.graph.node), _refuses("Nothing"), "")
    assert isinstance(got, Unsupported) and str(got) == "eng: no kernel for Relu"


def test_a_node_that_cannot_be_probed_keeps_the_engines_word():
    m = _two_nodes()
    body = helper.make_graph([], "b", [], [])
    looped = helper.make_node("If", ["c"], ["o"], then_branch=body, else_branch=body)
    assert alone(m, looped) is None, "contract: a node holding a subgraph is not probed"
    got = confirm("eng", "no kernel for If", m, [looped], _refuses("Nothing"), "")
    assert isinstance(got, Unsupported)


def test_refusals_tell_a_missing_kernel_from_a_failure():
    table = Refusals(((r"unsupported operator (?P<op>[\w.]+::\w+)", "no kernel for {op}"),))
    assert table.reason("unsupported operator ai.onnx::Upsample: no handler") == "no kernel for ai.onnx::Upsample"
    assert table.reason("internal executor error: node 5 failed") is None


nxrt = pytest.importorskip("nxrt", reason="nxrt is not installed: pip install 'lockstep-conformance[nxrt]'")


def test_nxrt_reports_its_own_type_inference_failure_as_unsupported_and_lockstep_calls_it_an_error():
    """nxrt 0.1.0.dev6 says "unsupported operator TensorScatter" on a shared-buffer golden model (its
    inference types write_indices float32) but loads a TensorScatter alone: an error, not Unsupported."""
    from packaging.version import Version

    from lockstep.decoding import open_session, teacher_force
    from lockstep.engines.registry import load_engine
    from lockstep.golden.catalog import catalog

    if Version(nxrt.__version__) != Version("0.1.0.dev6"):
        pytest.skip(f"recorded for nxrt 0.1.0.dev6, this is {nxrt.__version__}")
    engine = load_engine("nxrt-cpu")
    gm = next(m for m in catalog() if m.name == "tiny-fp32-standard-kv64")
    model = gm.load()
    try:
        teacher_force(open_session(engine, model, io=gm.io(model)), [1, 2, 3], stepwise=True)
    except EngineError as exc:
        assert "TensorScatter" in str(exc) and "loads it alone" in str(exc)
    else:
        pytest.fail("nxrt now decodes the model: update docs/nxrt-findings.md (F7) and this test")


def test_nxrt_without_a_kernel_is_unsupported():
    from lockstep.engines.registry import load_engine
    from lockstep.reference_runtime.node_cases import load_cases, run_case

    engine = load_engine("nxrt-cpu")
    case = next(c for c in load_cases() if c.name == "test_upsample_nearest")
    outcome = run_case(engine, case)
    assert outcome.status == "unsupported" and "Upsample" in outcome.detail
