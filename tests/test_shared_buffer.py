"""A growing-cache decoder given a capacity decodes into a shared buffer written in place
(lockstep/shared_buffer.py, issue 34's first stage): one captured graph a step, on the simulated
device. Assertions say whether they encode a contract or a result."""

from __future__ import annotations

import numpy as np
import onnx
import pytest

from lockstep.decoder_io import ContextLimitExceeded, DecoderIO
from lockstep.golden.anchors import MODEL_DIR
from lockstep.golden.models.spec import PROMPT
from lockstep.reference_runtime import Runtime, RuntimeConfig
from lockstep.reference_runtime.backends import make_device
from lockstep.reference_runtime.engine import RefDecoder
from lockstep.shared_buffer import SharedBufferError, shared_buffer

CARD = {"kv_capacity": "64"}


def _model(name: str) -> onnx.ModelProto:
    return onnx.load(str(MODEL_DIR / f"{name}.onnx"))


def _decode(name: str, card=None, *, capture: bool = False, steps: int = 6):
    m = _model(name)
    dec = RefDecoder(m, Runtime(make_device("sim"), RuntimeConfig()), capture=capture,
                     io=DecoderIO.of(m, card) if card else None)
    logits = [dec.forward(list(PROMPT.encode()))]
    for _ in range(steps):
        logits.append(dec.forward([int(np.argmax(logits[-1][-1]))]))
    return logits, dec


@pytest.mark.parametrize("name", ["tiny-fp32-standard", "small-fp32-standard"])
def test_the_shared_buffer_form_is_the_fixed_capacity_construction(name):
    """result: the growing model with kv_capacity 64 decodes byte for byte as its -kv64 variant (the same
    spec and weights, built with the fixed-capacity construction), eager and captured, and its captured
    step is one graph with no seam (the growing form: nine graphs and nine seams)."""
    shared, _ = _decode(name, CARD)
    kv64, _ = _decode(f"{name}-kv64")
    assert all(np.array_equal(a, b) for a, b in zip(shared, kv64))
    captured, dec = _decode(name, CARD, capture=True)
    assert all(np.array_equal(a, b) for a, b in zip(shared, captured)), "contract: capture on/off byte identity"
    counters = dec.capture_counters()
    assert counters["segments"] == 1 and counters["seams_by_reason"] == {} and counters["fallbacks"] == 0


def test_the_shared_buffer_form_decodes_the_growing_models_tokens():
    """result: the same greedy tokens as the growing cache, logits within float32 summation differences
    (64 keys with the unfilled masked out, instead of past + new)."""
    shared, _ = _decode("tiny-fp32-standard", CARD, steps=10)
    growing, _ = _decode("tiny-fp32-standard", steps=10)
    assert [int(np.argmax(x[-1])) for x in shared] == [int(np.argmax(x[-1])) for x in growing]
    assert max(float(np.max(np.abs(a - b))) for a, b in zip(shared, growing)) < 1e-4


def test_a_step_past_the_capacity_is_refused():
    m = _model("tiny-fp32-standard")
    dec = RefDecoder(m, Runtime(make_device("sim"), RuntimeConfig()), io=DecoderIO.of(m, {"kv_capacity": "20"}))
    dec.forward(list(PROMPT.encode()))  # 19 positions
    dec.forward([1])
    with pytest.raises(ContextLimitExceeded, match="KV capacity 20 exceeded"):
        dec.forward([2])


@pytest.mark.parametrize("name", ["tiny-fp32-decomposed", "tiny-fp16-decomposed", "tiny-fp32-decomposed-mask",
                                  "tiny-fp16-standard-mask", "tiny-neartie-fp32-standard"])
def test_every_growing_form_of_locksteps_models_is_one_graph_with_the_growing_tokens(name):
    """result: the decomposed form (Concat onto the past -> TensorScatter) and the attention-mask forms
    (the queries' cache positions Range(past, past + new) -> the step's positions) decode the growing form's
    tokens in one captured graph a step; capture on/off byte-identical (contract)."""
    shared, _ = _decode(name, CARD, steps=8)
    growing, _ = _decode(name, steps=8)
    assert [int(np.argmax(x[-1])) for x in shared] == [int(np.argmax(x[-1])) for x in growing]
    assert max(float(np.max(np.abs(a.astype(np.float64) - b))) for a, b in zip(shared, growing)) < 1e-4
    captured, dec = _decode(name, CARD, capture=True, steps=8)
    assert all(np.array_equal(a, b) for a, b in zip(shared, captured)), "contract: capture on/off byte identity"
    assert dec.capture_counters()["segments"] == 1 and dec.capture_counters()["seams_by_reason"] == {}


def _export(rel: str) -> onnx.ModelProto:
    from lockstep.loading import load_model

    folder = MODEL_DIR.parent / "exports" / rel
    model, _ = load_model(next(iter(sorted(folder.glob("*.onnx")))))
    return model


@pytest.mark.parametrize("model, message", [
    (lambda: _model("tiny-int4-genai"), "(GroupQueryAttention) takes total_sequence_length from the past's shape"),
    (lambda: _export("optimum/llama-fp32"), "node '/model/Cast' (Cast) uses the past length"),
    (lambda: _export("optimum/gemma-fp32"), "no position_ids input"),
])
def test_forms_the_rewrite_does_not_know_are_refused_naming_the_node(model, message):
    """contract: a growing form the rewrite cannot map is refused before it runs, naming the node (it
    would fail with a shape error later, or read the capacity as the filled length): GroupQueryAttention's
    growing mode, Optimum's real exports (their mask casts the past length), a model without position_ids."""
    m = model()
    with pytest.raises(SharedBufferError) as err:
        shared_buffer(m, DecoderIO.of(m, CARD))
    assert message in str(err.value)


def test_a_model_that_does_not_append_is_left_as_it_is():
    """contract: a fixed-capacity model, or no capacity asked for, is the model itself."""
    kv = _model("tiny-fp32-standard-kv64")
    assert shared_buffer(kv, DecoderIO.of(kv)) is kv
    growing = _model("tiny-fp32-standard")
    assert shared_buffer(growing, DecoderIO.of(growing)) is growing


def test_onnx_runtime_decodes_the_shared_buffer_form_as_the_fixed_capacity_model():
    """result: ONNX Runtime (CPU) runs the rewritten graph: the same logits as the -kv64 variant."""
    from lockstep.engines.ort import OrtDecoder
    from lockstep.engines.registry import load_engine

    ort = load_engine("ort-cpu")
    if not ort.available()[0]:
        pytest.skip(f"ort-cpu: {ort.available()[1]}")
    out = {}
    for name, card in (("tiny-fp32-standard", CARD), ("tiny-fp32-standard-kv64", None)):
        m = _model(name)
        dec = OrtDecoder(m, ort, io=DecoderIO.of(m, card) if card else None)
        dec.reset()
        seq = [dec.forward(list(PROMPT.encode()))]
        for _ in range(4):
            seq.append(dec.forward([int(np.argmax(seq[-1][-1]))]))
        out[name] = seq
    assert all(np.array_equal(a, b) for a, b in zip(out["tiny-fp32-standard"], out["tiny-fp32-standard-kv64"]))


def test_the_catalog_locks_each_rewrite_in_its_shared_buffer_form():
    """contract: the golden suite runs locks, capture identity and paging on a shared-buffer form of the
    growing models, one per rewrite (Attention with past, Concat, the mask's query positions): the same
    file, prompt and snapshot as the growing model, its decode sessions given the kv_capacity card; its
    snapshot is the growing model's (regenerated there, never written as its own)."""
    from lockstep.golden.catalog import SHARED_FORMS, GoldenError, builtin_models

    models = {m.name: m for m in builtin_models()}
    for base, capacity in SHARED_FORMS.items():
        form, growing = models[f"{base}@{capacity}"], models[base]
        assert form.kind == "shared" and form.snapshot_path == growing.snapshot_path
        assert form.model_path() == growing.model_path() and form.prompt() == growing.prompt()
        assert form.io().capacity == capacity == form.kv_capacity and growing.io().capacity == 0
        with pytest.raises(GoldenError, match=f"shares {base}'s snapshot"):
            form.write({})
    # each rewrite the form makes is taken by one of them: Attention with past inputs, a Concat onto the
    # past, and the queries' positions Range(past, past + new) replaced by the step's position_ids
    paths = set()
    for base, capacity in SHARED_FORMS.items():
        m = _model(base)
        io = DecoderIO.of(m, {"kv_capacity": str(capacity)})
        before = {n.op_type for n in m.graph.node}
        after = [n for n in shared_buffer(m, io).graph.node]
        if any(n.op_type == "Attention" and len(n.input) >= 6 for n in m.graph.node):
            paths.add("attention")
        if "Concat" in before and sum(n.op_type == "Concat" for n in after) < sum(
                n.op_type == "Concat" for n in m.graph.node):
            paths.add("concat")
        if sum(n.op_type == "Range" for n in after) < sum(n.op_type == "Range" for n in m.graph.node):
            paths.add("query positions")
    assert paths == {"attention", "concat", "query positions"}, paths
