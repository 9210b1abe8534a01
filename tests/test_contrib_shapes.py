"""lockstep.contrib_shapes: the shapes onnx's inference leaves out downstream of ONNX Runtime's
contrib ops, checked against the shapes a real run gives (ONNX Runtime's CPU provider, every value
made an output): a planned static dim is the run's, a named dim one size everywhere."""

from __future__ import annotations

import numpy as np
import onnx
import pytest

from lockstep.contrib_shapes import complete
from lockstep.decoder_io import DecoderIO
from lockstep.engines.registry import load_engine
from lockstep.golden.anchors import MODEL_DIR
from lockstep.inference import infer

EXPORTS = MODEL_DIR.parent / "exports" / "genai"


def _shapes(model):
    g = complete(model, infer(model)).graph
    return {vi.name: [d.dim_value if d.HasField("dim_value") else d.dim_param or None for d in vi.type.tensor_type.shape.dim]
            for vi in [*g.value_info, *g.output] if vi.type.tensor_type.HasField("shape")}


@pytest.mark.parametrize("path", [MODEL_DIR / "tiny-int4-genai.onnx", EXPORTS / "llama-int4-cpu" / "model.onnx",
                                  EXPORTS / "gemma3-int4-cuda" / "model.onnx"], ids=lambda p: p.parent.name + "/" + p.stem)
def test_completed_shapes_are_the_shapes_a_run_gives(path):
    model = onnx.load(str(path))
    onnx_only = {vi.name for vi in infer(model).graph.value_info}
    planned = _shapes(model)
    produced = [o for n in model.graph.node for o in n.output if o]
    added = [v for v in produced if v in planned and v not in onnx_only]
    assert added, "result: the contrib ops' outputs and what follows them got shapes onnx did not give"
    ort = load_engine("ort-cpu")
    if not ort.available()[0]:
        pytest.skip(f"ort-cpu unavailable: {ort.available()[1]}")
    if "cuda" in path.parent.name:  # GroupQueryAttention's q/k norm inputs: ORT's CPU provider refuses them
        pytest.skip("a CUDA export: ONNX Runtime's CPU provider cannot run it (the shapes are checked above)")
    probe = onnx.ModelProto()
    probe.CopyFrom(model)
    known = {o.name for o in probe.graph.output}
    probe.graph.output.extend(onnx.ValueInfoProto(name=v) for v in added if v not in known)
    from lockstep.genai_config import card_for

    io = DecoderIO.of(model, card_for(path) if path.name == "model.onnx" else None)
    feeds = {**io.step_feeds([1, 2, 3], 0), **io.empty_caches()}
    names = [o.name for o in probe.graph.output]
    values = dict(zip(names, ort.prepare(probe)(feeds)))
    sizes: dict[str, int] = {}
    for v in added:
        got = list(np.shape(values[v]))
        want = planned[v]
        assert len(got) == len(want), f"result: {v} has rank {len(got)}, planned {want}"
        for g, w in zip(got, want):
            if isinstance(w, int):
                assert g == w, f"result: {v} is {got}, planned {want}"
            elif isinstance(w, str):
                assert sizes.setdefault(w, g) == g, f"result: {w} is {sizes[w]} elsewhere, {g} in {v}"


def test_a_graph_without_contrib_ops_is_left_as_onnx_inferred_it():
    model = onnx.load(str(MODEL_DIR / "tiny-fp32-standard.onnx"))
    inferred = infer(model)
    assert complete(model, inferred) is inferred
