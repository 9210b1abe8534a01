"""``lockstep locate`` when the engine raises instead of producing values, and when its decode session is
not its ``prepare``.

- An engine's own type or shape inference at load depends on the model around a node: exposing a value as
  an output (or extracting a prefix) declares its type and shape and can mend what failed. The failure
  is located at the node the engine's error names on the model as it is (nxrt's and ONNX Runtime's
  message forms), else at the first node whose prefix fails, and said as an error, never as a value out
  of band at a later node. ``--reduce`` writes that node alone where it fails alone, else says so.
- A decoder's prefill runs in the engine's own decode session (``open_session``), as its prefill lock
  does: an engine whose ``decoder()`` and ``prepare`` differ is located through the decoder.
"""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import numpy_helper

from lockstep.conformance.locate import locate, subject
from lockstep.conformance.locate.command import render_text
from lockstep.conformance.locate.failure import named_node
from lockstep.conformance.locate.reduce import reduce_to_case, write_case
from lockstep.engines import load_engine
from lockstep.reference_runtime.node_cases import load_case_dirs

NODE, INDEX = "layers.0/mlp_norm", 26  # tiny-fp32-standard's first MLP norm (RMSNormalization)

# the same failure at NODE as each runtime words it
MESSAGES = {
    "nxrt-run": 'internal executor error: node {i} ("{name}", op \'::{op}\', inputs ["x"] [Float32] [[]]) failed: '
                "kernel execution failed: output byte count 4 does not match produced 1",
    "nxrt-unnamed": 'internal executor error: node {i} ("", op \'::{op}\', inputs ["x"] [Float32] [[]]) failed: '
                    "Transpose: perm rank 4 != input rank 0",
    "ort-load": "[ONNXRuntimeError] : 1 : FAIL : Node ({name}) Op ({op}) [ShapeInferenceError] Incompatible dimensions",
    "ort-run": "[ONNXRuntimeError] : 6 : RUNTIME_EXCEPTION : Non-zero status code returned while running {op} node. "
               "Name:'{name}' Status Message: invalid expand shape",
}


class _LoadTimeInference:
    """ONNX Runtime's CPU provider behind a static inference that cannot type ``node``'s output unless the
    model declares it as a graph output (as nxrt's Expand typed ``[Float32] [[]]``): a model where it is an
    intermediate value fails, worded as ``style`` (None: a message that names no node)."""

    def __init__(self, node: str, style: str | None):
        self.inner, self.name, self.node, self.style = load_engine("ort-cpu"), "load-time-inference", node, style

    def available(self):
        return True, ""

    def prepare(self, model):
        nodes = list(model.graph.node)
        outputs = {o.name for o in model.graph.output}
        for i, n in enumerate(nodes):
            if n.name == self.node and n.output[0] not in outputs:
                name = "" if self.style == "nxrt-unnamed" else n.name
                text = MESSAGES[self.style].format(i=i, name=name, op=n.op_type) if self.style else \
                    "the model failed to load: an output's type is unknown"
                raise RuntimeError(text)
        return self.inner.prepare(model)


@pytest.mark.parametrize("style", sorted(MESSAGES))
def test_a_load_time_failure_is_located_at_the_node_its_error_names(style):
    """Every prefix that holds the node exposes its output, so only the whole model fails: bisection alone
    would name the last node; the error names the node, and that is the result, said as an error."""
    loc = locate(_LoadTimeInference(NODE, style), subject("tiny-fp32-standard"))
    assert loc.finding is None, f"result: a value out of band at {loc.finding and loc.finding.name}, not an error"
    f = loc.failure
    assert f is not None and (f.node, f.op_type) == (INDEX, "RMSNormalization"), f"result: located at {f}"
    assert f.how.startswith("named by its error")
    text = render_text(loc)
    assert len(text.splitlines()) == 2 and f"node {INDEX}" in text and "RuntimeError: " in text, text
    d = loc.as_dict()
    assert d["first_divergent_node"] is None and d["engine_error"]["name"] == NODE


def test_an_error_that_names_no_node_is_the_first_failing_prefix_said_as_an_error():
    """A monotone failure (every prefix holding the node fails) that names no node: bisection's answer is the
    node whose prefix first fails, reported as the engine's error, not as an infinite error of its value."""

    class Refuses(_LoadTimeInference):
        def prepare(self, model):
            if any(n.name == self.node for n in model.graph.node):
                raise RuntimeError("the model failed to load")
            return self.inner.prepare(model)

    loc = locate(Refuses(NODE, None), subject("tiny-fp32-standard"))
    assert loc.method == "bisect" and loc.finding is None
    assert (loc.failure.node, loc.failure.name) == (INDEX, NODE), loc.failure
    assert "first node whose prefix it fails on" in loc.failure.how
    assert all(j.status == "in" for j in loc.judged), "contract: the values before it are judged, in band"


def test_named_node_reads_each_runtime_and_ignores_what_is_not_in_the_model():
    m = subject("tiny-fp32-standard").model
    for style, text in MESSAGES.items():
        got = named_node(m, text.format(i=INDEX, name="" if style == "nxrt-unnamed" else NODE, op="RMSNormalization"))
        assert got == INDEX, style
    assert named_node(m, 'node "layers.1/up_proj": unsupported operator') == 53
    assert named_node(m, "In Node, (\"layers.1/up_proj\", MatMul, \"\", -1) : bad input") == 53
    assert named_node(m, 'internal executor error: node 26 ("", op \'::MatMul\', ...)') is None, "op must match"
    assert named_node(m, "Name:'no/such/node'") is None and named_node(m, "no node named") is None
    try:  # the runtime's words kept as the cause of an engine's wrapper
        try:
            raise RuntimeError(f"Name:'{NODE}'")
        except RuntimeError as inner:
            raise ValueError("engine: run failed") from inner
    except ValueError as exc:
        assert named_node(m, exc) == INDEX


def test_reduce_writes_the_node_alone_where_it_fails_alone_and_says_so_where_it_runs(tmp_path):
    s = subject("tiny-fp32-standard")
    context = _LoadTimeInference(NODE, "nxrt-run")  # fails only where its output is not declared
    red = reduce_to_case(context, s, locate(context, s))
    assert red.located is None and "depends on the model around it" in red.note, red.note

    class Always(_LoadTimeInference):  # fails on the node wherever it is
        def prepare(self, model):
            for i, n in enumerate(model.graph.node):
                if n.name == self.node:
                    raise RuntimeError(MESSAGES["nxrt-run"].format(i=i, name=n.name, op=n.op_type))
            return self.inner.prepare(model)

    always = Always(NODE, "nxrt-run")
    red = reduce_to_case(always, s, locate(always, s))
    assert red.located is not None and red.nodes == 1 and "alone too" in red.note, red.note
    out = write_case(tmp_path / "case", red, engine="always", command="test")
    (case,) = load_case_dirs(out)
    assert [n.name for n in onnx.load(out / "model.onnx").graph.node] == [NODE]
    assert case.name == "case" and (out / "test_data_set_0" / "output_0.pb").is_file()


def test_nxrt_failure_is_located_at_the_node_it_names():
    """nxrt 0.1.0.dev6 on ONNX's expanded attention case: its executor fails at node 49 (a Transpose whose
    input its static inference typed as a scalar); bisection over prefixes named node 47 instead."""
    engine = load_engine("nxrt-cpu")
    ok, why = engine.available()
    if not ok:
        pytest.skip(why)
    s = subject("test_attention_4d_expanded")
    try:
        engine.prepare(s.model)(s.feeds)
        pytest.skip("nxrt runs test_attention_4d_expanded now")
    except Exception as exc:
        if "node 49 (" not in str(exc):
            pytest.skip(f"nxrt fails elsewhere now: {exc}")
    loc = locate(engine, s)
    assert loc.failure is not None and (loc.failure.node, loc.failure.op_type) == (49, "Transpose"), loc.as_dict()
    assert "perm rank" in loc.failure.error


def _scaled(model: onnx.ModelProto, node: str) -> onnx.ModelProto:
    """``model`` with ``node``'s MatMul weight scaled by 1.25 (a fusion bug)."""
    m = onnx.ModelProto()
    m.CopyFrom(model)
    n = next(n for n in m.graph.node if n.name == node)
    t = next(t for t in m.graph.initializer if t.name == n.input[1])
    t.CopyFrom(numpy_helper.from_array((numpy_helper.to_array(t) * np.float32(1.25)).astype(np.float32), t.name))
    return m


class _TwoPaths:
    """ONNX Runtime's CPU provider whose decode session (``decoder``) and ``prepare`` differ: a bug planted
    in the one named ``broken``."""

    def __init__(self, broken: str, node: str = "layers.1/up_proj"):
        self.inner, self.name, self.broken, self.node = load_engine("ort-cpu"), f"broken-{broken}", broken, node
        self.precision = self.inner.precision

    def available(self):
        return True, ""

    def _model(self, model, path):
        return _scaled(model, self.node) if path == self.broken and any(
            n.name == self.node for n in model.graph.node) else model

    def prepare(self, model):
        return self.inner.prepare(self._model(model, "prepare"))

    def decoder(self, model, *, capture=False, io=None):
        return self.inner.decoder(self._model(model, "decoder"), capture=capture, io=io)


def test_a_prefill_is_located_through_the_engines_own_decoder():
    """The prefill lock runs in the engine's decode session, so locate does: a bug in the decoder only is
    located at its node, a bug in prepare only is not (the decoder is right)."""
    s = subject("tiny-fp32-standard")
    loc = locate(_TwoPaths("decoder"), s)
    assert loc.method == "session-eager", loc.method
    assert loc.finding is not None and loc.finding.name == "layers.1/up_proj", \
        f"result: the decoder's bug located at {loc.finding and loc.finding.name}"
    loc = locate(_TwoPaths("prepare"), s)
    assert loc.method == "session-eager" and loc.finding is None and loc.failure is None, \
        f"result: prepare's bug located through the prefill: {loc.finding and loc.finding.name}"
    step = locate(_TwoPaths("prepare"), subject("tiny-fp32-standard", position=20))
    assert step.method == "exposed" and step.finding.name == "layers.1/up_proj", \
        "contract: a step on the oracle's past runs through prepare"
