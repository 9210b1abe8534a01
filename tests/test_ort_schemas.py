"""Ops ONNX Runtime registers in the default domain (SimplifiedLayerNormalization, where ONNX Runtime
GenAI's builder writes it): loaded after a check against ONNX Runtime's own schema, not refused by
onnx.checker (issue 30), and run as ONNX Runtime runs them."""

from __future__ import annotations

import numpy as np
import pytest
from onnx import TensorProto as TP
from onnx import helper

from lockstep.engines.registry import load_engine
from lockstep import ort_schemas
from lockstep.loading import ModelError, load_model

_ORT = load_engine("ort-cpu")
_REF = load_engine("ref-sim")
needs_ort = pytest.mark.skipif(not _ORT.available()[0], reason=f"ort-cpu: {_ORT.available()[1]}")


def _sln_model(domain="", opset=22, inputs=("x", "scale"), outputs=("y",), **attrs):
    node = helper.make_node("SimplifiedLayerNormalization", list(inputs), list(outputs), name="norm0",
                            domain=domain, **({"epsilon": 1e-5, "axis": -1} | attrs))
    scale = helper.make_tensor("scale", TP.FLOAT, [8], np.linspace(0.5, 1.5, 8).astype(np.float32))
    g = helper.make_graph([node], "g", [helper.make_tensor_value_info("x", TP.FLOAT, ["b", 8])],
                          [helper.make_tensor_value_info(o, TP.FLOAT, ["b", 8 if i == 0 else 1]) for i, o in enumerate(outputs)], [scale])
    imports = [helper.make_opsetid("", opset)] + ([helper.make_opsetid(domain, 1)] if domain not in ("", "ai.onnx") else [])
    return helper.make_model(g, ir_version=10, opset_imports=imports)


@needs_ort
def test_snapshot_is_the_installed_onnxruntimes_schemas():
    # result: the committed snapshot was taken from this ONNX Runtime (regenerate with
    # `python -m lockstep.ort_schemas --write` when it moves)
    version, schemas = ort_schemas.from_onnxruntime()
    want = {(s.name, s.since_version): s for s in schemas}
    have = {(s.name, s.since_version): s for v in ort_schemas.default_domain_schemas().values() for s in v}
    assert have == want, f"ort_schemas.json differs from onnxruntime {version}'s schemas"


@needs_ort
@pytest.mark.parametrize("domain", ["", "ai.onnx", "com.microsoft"])
def test_simplified_layer_norm_loads_and_runs_in_either_domain(domain):
    # contract: a model ONNX Runtime loads (the op in the default domain, as the builder writes it) loads
    # here and gives ONNX Runtime's result; ONNX Runtime 1.31 registers the op only in the default domain
    # (com.microsoft:SimplifiedLayerNormalization "is not a registered function/op"), the reference
    # runtime takes both
    x = np.random.default_rng(0).standard_normal((3, 8)).astype(np.float32)
    got, = _REF.prepare(_sln_model(domain))({"x": x})
    want, = _ORT.prepare(_sln_model(""))({"x": x})
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)


def test_the_loaded_model_is_unchanged():
    # contract: hiding the nodes from onnx.checker leaves the caller's model as it was
    m = _sln_model("ai.onnx")
    before = m.SerializeToString()
    load_model(m)
    assert m.SerializeToString() == before


@pytest.mark.parametrize("kw,match", [
    (dict(inputs=("x",)), r"norm0.*1 inputs, expected 2\.\.2"),
    (dict(outputs=("y", "inv", "extra")), r"norm0.*3 outputs, expected 1\.\.2"),
    (dict(bogus=1), r"norm0.*unknown attribute 'bogus'"),
    (dict(epsilon=1), r"norm0.*attribute 'epsilon' is INT, expected FLOAT"),
])
def test_a_node_that_breaks_onnxruntimes_schema_is_refused(kw, match):
    # contract: checked against ONNX Runtime's schema, with the node named, at load
    with pytest.raises(ModelError, match=match):
        load_model(_sln_model(**kw))


def test_an_op_neither_knows_is_still_refused_by_the_checker():
    # contract: only ONNX Runtime's registered default-domain ops are let through
    m = _sln_model()
    m.graph.node[0].op_type = "SimplifiedLayerNormalizationX"
    with pytest.raises(ModelError, match="onnx.checker.*No Op registered for SimplifiedLayerNormalizationX"):
        load_model(m)


def test_a_deprecated_default_domain_op_is_refused():
    # contract: ONNX Runtime deprecated its experimental ai.onnx ops (Affine, ...) at opset 10
    node = helper.make_node("Affine", ["x"], ["y"], name="aff")
    g = helper.make_graph([node], "g", [helper.make_tensor_value_info("x", TP.FLOAT, [2])],
                          [helper.make_tensor_value_info("y", TP.FLOAT, [2])])
    m = helper.make_model(g, ir_version=10, opset_imports=[helper.make_opsetid("", 22)])
    with pytest.raises(ModelError, match="aff.*deprecated in ONNX Runtime since opset 10"):
        load_model(m)
