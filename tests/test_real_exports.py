"""Models the real exporters wrote (issue 30): ONNX Runtime GenAI's model builder and Hugging Face
Optimum, from tiny random-init transformers models (``scripts/real_exports.py``; the outputs and
their manifest are committed in ``golden/exports/``, the exporters are not CI dependencies).

Results (not lockstep contracts): every fp32 export for the CPU decodes to transformers' own greedy
ids on ref-sim (capture off and on) and on ort-cpu; each known disagreement is an exporter's, listed
in ``EXPORTER_FINDINGS`` with the reason, and fails this test the day it goes away (strict xfail).
Contracts: the shared-buffer mask (GenAI's default) covers the filled positions only; lockstep reads
what the builder states in genai_config.json (head size, shared buffer) and the tokenizer beside
the model; an export it cannot run is a named error, never a traceback.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from lockstep.decoder_io import DecoderIO, NotADecoder
from lockstep.decoding import greedy, open_session
from lockstep.engines import Unsupported
from lockstep.engines.registry import load_engine
from lockstep.genai_config import card_for, describe, tokenizer_for
from lockstep.loading import ModelError, load_model

ROOT = Path(__file__).resolve().parent.parent / "golden" / "exports"
MANIFEST = json.loads((ROOT / "manifest.json").read_text())
EXPORTS = {e["path"]: e for e in MANIFEST["exports"]}

# the exporter computes another function than transformers: lockstep's engines and ONNX Runtime agree
# with each other and disagree with transformers at the same position
EXPORTER_FINDINGS = {
    "genai/mistral-fp32-cpu": "onnxruntime-genai 0.18.0's builder ignores Mistral's sliding_window (8): "
                              "local_window_size=-1 on every GroupQueryAttention and genai_config sliding_window "
                              "layers []; transformers attends a window of 8, the prompt is 9 tokens",
    "optimum/gemma2-fp32": "optimum-onnx's Gemma 2 export diverges from transformers 4.57 at token 2 "
                           "(ONNX Runtime CPU too)",
}
# the builder's -p fp32 -e cuda graphs: ONNX Runtime's CPU provider refuses to load them as well
BROKEN = sorted(p for p, e in EXPORTS.items() if e.get("ep") == "cuda" and e["precision"] == "fp32")
FP32_CPU = sorted(p for p, e in EXPORTS.items() if e["precision"] == "fp32" and p not in BROKEN)
# fp16 exports whose greedy ids equal transformers' fp32 ones on every engine measured (a result: fp16
# rounding could flip a near-tie; none of these 24 tokens is one)
FP16 = ["genai/gemma2-fp16-cuda", "genai/llama-fp16-cuda", "optimum/llama-fp16"]
# the CUDA engines are a counted skip without a GPU (LOCKSTEP_REQUIRE_ENGINES makes them a failure)
ENGINES = [("ref-sim", False), ("ref-sim", True), ("ort-cpu", False),
           ("ref-cuda", False), ("ref-cuda", True), ("ort-cuda", False)]


def _decode(path: str, engine: str, capture: bool) -> list[int]:
    e = EXPORTS[path]
    model_path = ROOT / path / "model.onnx"
    eng = load_engine(engine)
    ok, why = eng.available()
    if not ok:  # a counted skip (the plugin refuses a run that selects a required engine it cannot load)
        pytest.skip(f"{engine}: {why}")
    model, _ = load_model(model_path)
    io = DecoderIO.of(model, card_for(model_path))
    try:
        session = open_session(eng, model, capture=capture, io=io)
    except Unsupported as exc:  # an op lockstep has no kernel for yet: a counted skip naming it
        pytest.skip(f"{path} on {engine}: {exc}")
    return greedy(session, e["prompt_ids"], len(e["transformers_greedy_ids"])).tokens


def _params(paths):
    out = []
    for p in paths:
        for engine, capture in ENGINES:
            why = EXPORTER_FINDINGS.get(p)
            marks = [pytest.mark.xfail(reason=why, strict=True)] if why else []
            out.append(pytest.param(p, engine, capture, marks=marks, id=f"{p}-{engine}{'-capture' if capture else ''}"))
    return out


@pytest.mark.parametrize("path,engine,capture", _params(FP32_CPU + FP16))
def test_export_decodes_to_transformers_greedy_ids(path, engine, capture):
    # result: the independent reference is transformers' own greedy decode of the same weights
    got = _decode(path, engine, capture)
    want = EXPORTS[path]["transformers_greedy_ids"]
    first = next((i for i, (a, b) in enumerate(zip(got, want)) if a != b), None)
    assert first is None, f"{path} on {engine}: first difference at token {first}: {got} vs transformers {want}"


def test_the_set_covers_both_exporters_and_eight_architectures():
    # result: what the committed set holds (a regeneration that drops an architecture shows here)
    archs = {e["architecture"] for e in EXPORTS.values()}
    assert archs >= {"llama", "qwen2", "qwen3", "phi3", "gemma", "gemma2", "gemma3", "mistral"}
    for exporter in ("genai", "optimum"):
        assert {e["architecture"] for e in EXPORTS.values() if e["exporter"] == exporter} == archs


@pytest.mark.contract("decoder_io.shared_buffer_mask_covers_the_filled_positions")
def test_the_shared_buffer_mask_covers_the_filled_positions():
    """A fixed-capacity (shared past/present) buffer's mask marks the filled positions, never the empty slots."""
    # contract: GenAI's builder shares past and present (a buffer of search.max_length positions); the
    # mask must mark the filled positions only. With ones over the whole buffer every engine attends the
    # empty slots (before the fix: ref-sim and ort-cpu differed from transformers at token 0).
    path = ROOT / "genai/llama-fp32-cpu/model.onnx"
    cfg = describe(path)
    assert cfg is not None and cfg.share_buffer
    model, _ = load_model(path)
    io = DecoderIO.of(model, card_for(path))
    assert io.capacity == cfg.max_length and io.head_dim == cfg.head_size
    for position, n in ((0, 9), (9, 1), (30, 1)):
        # contract: GroupQueryAttention's documented total_sequence_length is past + new (the mask's width):
        # by default the mask covers exactly the filled positions (nxrt's CPU kernel refuses anything else)
        mask = io.step_feeds([1] * n, position)[io.attention_mask]
        assert mask.shape == (1, position + n) and mask.all()
        # contract: a session that needs one shape every step (capture, fixed bindings) gets the buffer's
        # width, ones over the filled positions and never the empty slots (as ORT GenAI feeds its CUDA graphs)
        mask = io.step_feeds([1] * n, position, fixed_shapes=True)[io.attention_mask]
        assert mask.shape == (1, io.capacity)
        assert mask[0, :position + n].all() and not mask[0, position + n:].any()


def test_the_tokenizer_beside_the_export_is_its_own():
    # contract: both exporters write tokenizer.json beside model.onnx; lockstep finds it, and it encodes
    # the manifest's prompt to transformers' ids
    from lockstep.golden.text import Text

    for path in ("genai/llama-fp32-cpu", "optimum/llama-fp32"):
        tok = tokenizer_for(ROOT / path / "model.onnx")
        assert tok is not None
        assert Text.load(tok, 1 << 16).encode(MANIFEST["prompt"]["text"]) == MANIFEST["prompt"]["ids"]


@pytest.mark.parametrize("path", BROKEN)
def test_an_export_onnx_runtime_cannot_load_is_refused_with_a_named_error(path):
    # result about the exporter (onnxruntime-genai 0.18.0, -p fp32 -e cuda: its present outputs come from no
    # node, or an input marked single is fed twice), and a contract for lockstep: a one-line ModelError naming
    # the file at load, where ONNX Runtime's CPU provider refuses the file too
    ort = pytest.importorskip("onnxruntime")
    model_path = ROOT / path / "model.onnx"
    with pytest.raises(ModelError) as info:
        load_model(model_path)
    msg = str(info.value)
    assert str(model_path) in msg and "onnx.checker" in msg and "\n" not in msg.strip()
    with pytest.raises(Exception, match="Load model"):
        ort.InferenceSession(str(model_path), providers=["CPUExecutionProvider"])


@pytest.mark.contract("decoder_io.fixed_model_binds_the_shared_buffer_shapes")
def test_the_shared_buffer_shapes_are_bound_for_the_runtime():
    """A shared buffer the graph declares symbolic is run with the capacity and head size bound."""
    # contract: the builder declares past/present as [batch, kv_heads, 'past_sequence_length', 'kv_cache_dim']
    # and the mask as [batch, 'total_sequence_length']; genai_config.json fixes them (max_length, head_size).
    # fixed_model writes those into the declared I/O so nothing a fixed-capacity step sees can grow
    path = ROOT / "genai/llama-fp32-cpu/model.onnx"
    model, _ = load_model(path)
    io = DecoderIO.of(model, card_for(path))
    fixed = io.fixed_model(model)
    assert fixed is not model
    decl = {vi.name: [d.dim_value if d.HasField("dim_value") else d.dim_param for d in vi.type.tensor_type.shape.dim]
            for vi in [*fixed.graph.input, *fixed.graph.output]}
    for name in [*io.pasts, *io.present_of.values()]:
        assert decl[name][io.seq_axis] == io.capacity and decl[name][3] == io.head_dim, (name, decl[name])
    assert decl[io.attention_mask][1] == io.capacity
    assert io.fixed_model(fixed) is fixed, "contract: nothing left to bind returns the model itself"
    # the original is untouched (a session's model is the user's)
    orig = {vi.name: vi for vi in model.graph.input}
    assert not orig[io.pasts[0]].type.tensor_type.shape.dim[io.seq_axis].HasField("dim_value")


@pytest.mark.contract("decoder_io.a_sliding_layer_gets_a_window_sized_cache")
@pytest.mark.parametrize("engine", ["ref-sim", "ort-cpu"])
def test_a_sliding_layer_gets_a_window_sized_cache(engine):
    """A past read by GroupQueryAttention with sliding_window_cache=1 gets a buffer of the window's rows,
    not the shared buffer's capacity; the other layers keep the capacity."""
    # contract: the builder's Gemma 2/3 graphs declare the local layers' past as 'past_sliding_length' and mark
    # their attention sliding_window_cache=1 (local_window_size 8); ONNX Runtime GenAI gives them a window-sized
    # buffer and ORT's CUDA provider accepts only that ("KV cache capacity (128) to equal local_window_size (8)":
    # before, lockstep gave every layer the 128 rows, measured on the H200 2026-12-03)
    path = ROOT / "genai/gemma2-fp32-cpu/model.onnx"
    cfg = describe(path)
    window, local = cfg.raw["model"]["decoder"]["sliding_window"]["window_size"], cfg.raw["model"]["decoder"][
        "sliding_window"]["layers"]
    model, _ = load_model(path)
    io = DecoderIO.of(model, card_for(path))
    assert io.capacity == cfg.max_length
    want = {io.pasts[2 * layer + i]: window for layer in local for i in (0, 1)}
    assert io.window_capacity == want
    for p in io.pasts:
        rows = window if p in want else io.capacity
        assert io.empty_cache(p).shape[io.seq_axis] == rows == io.capacity_of(p), p
    fixed = {vi.name: vi for vi in [*io.fixed_model(model).graph.input, *io.fixed_model(model).graph.output]}
    for p in want:
        for name in (p, io.present_of[p]):
            assert fixed[name].type.tensor_type.shape.dim[io.seq_axis].dim_value == window, name
    eng = load_engine(engine)
    session = open_session(eng, model, io=io)
    # result: the decode past the window (a 9-token prompt, window 8: eviction from the first step) equals
    # transformers' ids on a window-sized buffer
    e = EXPORTS["genai/gemma2-fp32-cpu"]
    assert greedy(session, e["prompt_ids"], len(e["transformers_greedy_ids"])).tokens == e["transformers_greedy_ids"]


@pytest.mark.contract("engines.ort_writes_a_window_cache_in_place")
def _gemma2_on_ort_cpu():
    """ort-cpu (a counted skip where it cannot run), the builder's Gemma 2 fp32 export and its roles."""
    eng = load_engine("ort-cpu")
    ok, why = eng.available()
    if not ok:
        pytest.skip(f"ort-cpu: {why}")
    path = ROOT / "genai/gemma2-fp32-cpu/model.onnx"
    model, _ = load_model(path)
    return eng, model, DecoderIO.of(model, card_for(path))


@pytest.mark.parametrize("fixed", [False, True])
def test_onnx_runtime_writes_a_window_sized_cache_in_place(fixed):
    """ONNX Runtime's session binds a window-sized cache's present to its own past buffer (in place), in the
    plain and the fixed-binding (CUDA graph) paths; the full layers keep their own scheme."""
    # contract: ORT 1.31.1's CUDA provider refuses anything else ("sliding_window_cache=1 requires past_key/
    # present_key and past_value/present_value to share the same buffer", H200 2026-12-04); checked here on
    # the CPU provider, where the binding logic is the same
    from lockstep.engines.ort import OrtDecoder

    eng, model, io = _gemma2_on_ort_cpu()
    dec = OrtDecoder(model, eng, fixed_bindings=fixed, io=io)
    window = sorted(io.window_capacity)
    assert window, "the export has a window-sized layer"

    def buffers():
        sets = dec._sets if fixed else [dec.cache]
        return [[s[p].data_ptr() for p in window] for s in sets]

    e = EXPORTS["genai/gemma2-fp32-cpu"]
    dec.reset()
    before = buffers()
    tokens = [int(np.argmax(dec.forward(e["prompt_ids"])[-1]))]
    while len(tokens) < len(e["transformers_greedy_ids"]):
        tokens.append(int(np.argmax(dec.forward([tokens[-1]])[-1])))
    assert buffers() == before, "contract: the window caches stay in their buffers"
    if fixed:
        assert before[0] == before[1], "contract: one buffer for both ping-pong directions"
    assert tokens == e["transformers_greedy_ids"], "result: transformers' ids through the in-place window cache"


def test_prepare_binds_a_window_sized_cache_in_place(monkeypatch):
    """The engine protocol's ``prepare`` on ONNX Runtime binds a window-sized cache in place too (what
    ``lockstep locate`` and the node suite run), with the plain session's results."""
    # contract: ORT 1.31.1's CUDA provider refuses a window-sized cache not bound in place (H200, 2026-12-06:
    # `lockstep locate genai-gemma2-fp16-cuda --engine ort-cuda` reported the refusal at layer 0's
    # GroupQueryAttention); checked on the CPU provider, where the binding logic is the same
    eng, model, io = _gemma2_on_ort_cpu()
    assert io.window_capacity, "the export has a window-sized layer"
    bound: dict[str, dict[str, int]] = {"in": {}, "out": {}}
    real_session = eng.session

    class Binding:  # the real binding, its OrtValue bindings recorded by address
        def __init__(self, b):
            self.b = b

        def bind_ortvalue_input(self, name, v):
            bound["in"][name] = v.data_ptr()
            self.b.bind_ortvalue_input(name, v)

        def bind_ortvalue_output(self, name, v):
            bound["out"][name] = v.data_ptr()
            self.b.bind_ortvalue_output(name, v)

        def __getattr__(self, a):
            return getattr(self.b, a)

    class Session:
        def __init__(self, s):
            self.s = s

        def io_binding(self):
            return Binding(self.s.io_binding())

        def run_with_iobinding(self, binding, *a):
            return self.s.run_with_iobinding(binding.b, *a)

        def __getattr__(self, a):
            return getattr(self.s, a)

    monkeypatch.setattr(eng, "session", lambda m, o=None: Session(real_session(m, o)))
    feeds = {**io.step_feeds(EXPORTS["genai/gemma2-fp32-cpu"]["prompt_ids"], 0), **io.empty_caches()}
    got = eng.prepare(model)(feeds)
    for past in io.window_capacity:
        present = io.present_of[past]
        assert present in bound["out"] and bound["out"][present] == bound["in"].get(past), \
            f"contract: {present} is written into {past}'s buffer"
    plain = real_session(model).run(None, feeds)
    assert len(got) == len(plain)
    for a, b in zip(got, plain):
        np.testing.assert_array_equal(a, b, err_msg="result: the in-place run computes the plain run's values")


def test_a_window_sized_cache_declared_fixed_is_taken_at_its_size_and_refused_under_the_window():
    # contract: a window cache whose rows the graph declares keeps them (ORT's CPU provider accepts any C >= W);
    # fewer rows than the window is NotADecoder naming the input, before anything runs
    import onnx

    path = ROOT / "genai/gemma2-fp32-cpu/model.onnx"
    model, _ = load_model(path)
    for rows, ok in ((12, True), (5, False)):
        m = onnx.ModelProto()
        m.CopyFrom(model)
        for vi in [*m.graph.input, *m.graph.output]:
            dims = vi.type.tensor_type.shape.dim
            if len(dims) == 4 and dims[2].dim_param in ("past_sliding_length", "total_sliding_length"):
                dims[2].Clear()
                dims[2].dim_value = rows
        if ok:
            io = DecoderIO.of(m, card_for(path))
            assert io.window_capacity == {"past_key_values.0.key": rows, "past_key_values.0.value": rows}
            assert io.capacity == 128
        else:
            with pytest.raises(NotADecoder, match=r"past_key_values\.0\.key .*window-sized cache .* of 5 rows holds "
                                                  r"less than its window \(8\)"):
                DecoderIO.of(m, card_for(path))
    with pytest.raises(KeyError, match="'logits' is not a past input"):
        DecoderIO.of(model, card_for(path)).empty_cache("logits")


@pytest.mark.capture
@pytest.mark.contract("reference_runtime.capture_one_graph_per_fixed_capacity_step")
def test_a_builder_export_captures_one_graph_and_replays_it():
    """A builder export (shared buffer) captures its one-token step once on ref-sim and replays it, byte-identical."""
    # contract: as for lockstep's own fixed-capacity models: one graph, every later step replayed (before
    # fixed_model the symbolic past/mask shapes made the runtime capture a new graph at every step: 5 of 1)
    eng = load_engine("ref-sim")
    path = ROOT / "genai/llama-fp32-cpu/model.onnx"
    model, _ = load_model(path)
    io = DecoderIO.of(model, card_for(path))
    prompt, tokens = EXPORTS["genai/llama-fp32-cpu"]["prompt_ids"], 8
    on = greedy(open_session(eng, model, capture=True, io=io), prompt, tokens)
    off = greedy(open_session(eng, model, capture=False, io=io), prompt, tokens)
    assert on.capture.captures == 1 and on.capture.fallbacks == 0, on.capture
    assert on.capture.replays == tokens - 2, on.capture
    from lockstep.decoding import first_divergence

    assert first_divergence(on, off) is None, "result: capture on and off byte-identical"
