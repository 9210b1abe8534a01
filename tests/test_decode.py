"""Prefill + greedy decode on the reference runtime and ONNX Runtime, with a toy KV-cache model
that has the golden I/O contract and a causal dependence on its cache (so a wrong cache shows)."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from lockstep.conformance.cli import main
from lockstep.decoding import StepError, greedy, teacher_force
from lockstep.engines import Unsupported
from lockstep.engines.registry import load_engine


def toy_decoder(seed=0) -> onnx.ModelProto:
    rng = np.random.RandomState(seed)
    E = rng.randn(256, 4).astype(np.float32)
    W = rng.randn(4, 256).astype(np.float32)
    nodes = [
        helper.make_node("Gather", ["E", "input_ids"], ["x"]),  # [1, s, 4]
        helper.make_node("Unsqueeze", ["x", "one"], ["k_new"]),  # [1, 1, s, 4]
        helper.make_node("Concat", ["past_key_values.0.key", "k_new"], ["present.0.key"], axis=2),
        helper.make_node("Mul", ["k_new", "two"], ["v_new"]),
        helper.make_node("Concat", ["past_key_values.0.value", "v_new"], ["present.0.value"], axis=2),
        helper.make_node("CumSum", ["present.0.key", "two_i"], ["cum"]),  # causal prefix sums over seq
        helper.make_node("Shape", ["x"], ["xs"]),
        helper.make_node("Gather", ["xs", "one_s"], ["s"]),  # seq length
        helper.make_node("Neg", ["s"], ["neg_s"]),
        helper.make_node("Slice", ["cum", "neg_s", "big", "two_1d"], ["ctx4"]),  # the last s positions
        helper.make_node("Squeeze", ["ctx4", "one"], ["ctx"]),  # [1, s, 4]
        helper.make_node("Add", ["x", "ctx"], ["h"]),
        helper.make_node("MatMul", ["h", "W"], ["logits"]),
    ]
    inits = [
        numpy_helper.from_array(E, "E"), numpy_helper.from_array(W, "W"),
        numpy_helper.from_array(np.array([1], np.int64), "one"), numpy_helper.from_array(np.float32(2.0), "two"),
        numpy_helper.from_array(np.array(2, np.int64), "two_i"), numpy_helper.from_array(np.array([1], np.int64), "one_s"),
        numpy_helper.from_array(np.array([2**31], np.int64), "big"),
        numpy_helper.from_array(np.array([2], np.int64), "two_1d"),
    ]
    kv = lambda n, s: helper.make_tensor_value_info(n, TensorProto.FLOAT, [1, 1, s, 4])  # noqa: E731
    g = helper.make_graph(
        nodes, "toy",
        [helper.make_tensor_value_info("input_ids", TensorProto.INT64, [1, "seq"]),
         helper.make_tensor_value_info("position_ids", TensorProto.INT64, [1, "seq"]),
         kv("past_key_values.0.key", "past"), kv("past_key_values.0.value", "past")],
        [helper.make_tensor_value_info("logits", TensorProto.FLOAT, [1, "seq", 256]),
         kv("present.0.key", "total"), kv("present.0.value", "total")],
        initializer=inits,
    )
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", 21)], ir_version=10)


PROMPT = list(b"Hello")


@pytest.mark.parametrize("engine", ["ref-sim", "ort-cpu"])
def test_prefill_and_stepwise_teacher_forcing_agree(engine):
    dec = load_engine(engine).decoder(toy_decoder())
    ctx = PROMPT + [7, 42, 99]
    a = teacher_force(dec, ctx, stepwise=False)
    b = teacher_force(dec, ctx, stepwise=True)
    assert a.shape == (len(ctx), 256)
    np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5)


def test_greedy_matches_across_engines_and_keeps_the_cache_on_device():
    model = toy_decoder()
    ref = load_engine("ref-sim").decoder(model)
    res = greedy(ref, PROMPT, 8)
    ort = greedy(load_engine("ort-cpu").decoder(model), PROMPT, 8)
    assert res.tokens == ort.tokens
    for a, b in zip(res.step_logits, ort.step_logits):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5)
    assert len(set(res.tokens)) > 1
    # 8 forwards (the prompt, then one per generated token but the last), each downloading only
    # its logits: the cache stays on the device, and the Slice starts (Shape -> Gather -> Neg) are
    # folded on the host instead of read back
    assert res.counters["downloads"] == 8
    assert ref.position == len(PROMPT) + 7


def test_decode_cli_prints_text_tokens_and_counters(tmp_path, capsys):
    path = tmp_path / "toy.onnx"
    onnx.save(toy_decoder(), str(path))
    assert main(["decode", str(path), "--prompt", "Hello", "--tokens", "4", "--engine", "ref-sim"]) == 0
    out = capsys.readouterr().out
    assert "output: " in out and "tokens: [" in out and '"launches"' in out
    assert "random" not in out, "contract: no note for a model of the user's"
    assert main(["decode", "no-such-model", "--prompt", "x"]) == 2


def test_decoding_a_builtin_golden_model_says_its_weights_are_random(capsys):
    """Its text is noise by construction: the command says so in one line and names the trained
    model that decodes real text."""
    assert main(["decode", "tiny-fp32-standard", "--prompt", "hello", "--tokens", "2"]) == 0
    notes = [line for line in capsys.readouterr().out.splitlines() if line.startswith("note: ")]
    assert notes == [("note: tiny-fp32-standard is one of lockstep's built-in golden models, whose weights are random "
                      "(they lock token ids, not meaning): its text is noise; for real text decode the trained SmolLM2 "
                      "export: lockstep decode smollm2-fp32 --prompt hello")], notes


def _result(tokens, logits, replays):
    from lockstep.decoding import DecodeResult

    return DecodeResult([1, 2], list(tokens), [np.asarray(x, np.float32) for x in logits], step_replays=list(replays))


def test_first_divergence_names_the_step_tokens_replays_and_logit_difference():
    from lockstep.decoding import first_divergence

    base = [[0.0, 1.0, 0.0], [2.0, 0.0, 0.0], [0.0, 0.0, 3.0]]
    same = _result([1, 0, 2], base, [0, 0, 1])
    assert first_divergence(same, _result([1, 0, 2], base, [0, 0, 0])) is None, "result: identical decodes"
    moved = [base[0], base[1], [0.0, 3.5, 3.0]]
    d = first_divergence(_result([1, 0, 1], moved, [0, 0, 1]), same)
    assert (d["step"], d["position"], d["tokens"], d["replays"], d["why"]) == (2, 4, (1, 2), 1, "tokens differ")
    assert d["max_abs_diff"] == pytest.approx(3.5)
    nudged = [base[0], [2.0, 1e-6, 0.0], base[2]]
    d = first_divergence(_result([1, 0, 2], nudged, [0, 0, 1]), same)
    assert (d["step"], d["tokens"], d["why"]) == (1, (0, 0), "logits differ"), "result: a byte is a divergence"
    assert d["max_abs_diff"] == pytest.approx(1e-6, rel=1e-3)


def test_greedy_records_the_replays_seen_at_each_step():
    from lockstep.engines import CaptureStats

    class Counting:
        def reset(self):
            self.calls = 0

        def forward(self, ids):
            self.calls += 1
            return np.eye(4, dtype=np.float32)[[self.calls % 4] * len(ids)]

        def capture_stats(self):
            return CaptureStats(1, max(self.calls - 2, 0), 0)

    res = greedy(Counting(), [3, 3], 4)
    assert res.tokens == [1, 2, 3, 0] and res.step_replays == [0, 0, 1, 2]


def test_a_model_without_the_contract_is_refused():
    from lockstep.decoding import NotADecoder

    g = helper.make_graph([helper.make_node("Identity", ["x"], ["y"])], "g",
                          [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1])],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1])])
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 21)], ir_version=10)
    with pytest.raises(NotADecoder, match=r"not a decoder lockstep can drive: no input_ids input\. Found inputs: x \[1\]; outputs: y \[1\]"):
        load_engine("ref-sim").decoder(m)


def test_fixed_capacity_cache_is_written_in_place_with_fixed_shapes():
    from lockstep.golden.anchors import MODEL_DIR

    dec = load_engine("ref-sim").decoder(onnx.load(str(MODEL_DIR / "tiny-fp32-standard-kv64.onnx")))
    assert dec.capacity == 64
    buffers = {p: (t, t.addr) for p, t in dec.cache.items()}
    res = greedy(dec, list(b"The quick brown fox"), 6)
    assert {p: (t, t.addr) for p, t in dec.cache.items()} == buffers, "same tensors, same addresses every step"
    assert all(t.shape == (1, 2, 64, 16) for t in dec.cache.values())
    growing = greedy(load_engine("ref-sim").decoder(onnx.load(str(MODEL_DIR / "tiny-fp32-standard.onnx"))),
                     list(b"The quick brown fox"), 6)
    assert res.tokens == growing.tokens
    for a, b in zip(res.step_logits, growing.step_logits):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5)
    dec.reset()
    with pytest.raises(ValueError, match="KV capacity 64 exceeded"):
        dec.forward([1] * 65)


def test_binding_an_output_over_a_feed_read_later_is_refused():
    from lockstep.reference_runtime import Runtime, RuntimeConfig
    from lockstep.reference_runtime.backends.sim import SimDevice
    from lockstep.reference_runtime.executor import Executor, FeedError

    # y = a + 1 is produced before z = a * 2 reads a: writing y over a in place would corrupt z
    g = helper.make_graph(
        [helper.make_node("Add", ["a", "one"], ["y"]), helper.make_node("Mul", ["a", "two"], ["z"])], "g",
        [helper.make_tensor_value_info("a", TensorProto.FLOAT, [2])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2]), helper.make_tensor_value_info("z", TensorProto.FLOAT, [2])],
        initializer=[numpy_helper.from_array(np.float32(1), "one"), numpy_helper.from_array(np.float32(2), "two")],
    )
    rt = Runtime(SimDevice(), RuntimeConfig())
    ex = Executor(helper.make_model(g, opset_imports=[helper.make_opsetid("", 21)], ir_version=10), rt)
    a = rt.upload(np.ones(2, np.float32))
    with pytest.raises(FeedError, match="unsafe: a later node reads 'a'"):
        ex.run({"a": a}, bind={"y": a})
    out = ex.run({"a": a}, bind={"z": a})  # z's producer is a's last reader: in place is safe
    assert out["z"] is a and rt.download(a).tolist() == [2.0, 2.0] and out["y"].tolist() == [2.0, 2.0]


def test_ort_decoder_keeps_its_cache_in_ortvalues():
    import onnxruntime as ort

    dec = load_engine("ort-cpu").decoder(toy_decoder())
    dec.forward(PROMPT)
    assert all(isinstance(v, ort.OrtValue) and v.shape() == [1, 1, len(PROMPT), 4] for v in dec.cache.values())


def test_capture_off_the_cuda_provider_or_without_fixed_shapes_is_a_clear_error():
    from lockstep.golden.anchors import MODEL_DIR

    # a growing cache on the reference engines is captured in segments, not refused
    dec = load_engine("ref-sim").decoder(onnx.load(str(MODEL_DIR / "tiny-fp32-standard.onnx")), capture=True)
    assert dec.session is not None
    with pytest.raises(Unsupported, match="ONNX Runtime's graphs are CUDA graphs"):
        load_engine("ort-cpu").decoder(onnx.load(str(MODEL_DIR / "tiny-fp32-standard-kv64.onnx")), capture=True)
    from lockstep.engines.ort import OrtDecoder

    with pytest.raises(Unsupported, match="fixed-capacity KV cache"):
        OrtDecoder(onnx.load(str(MODEL_DIR / "tiny-fp32-standard.onnx")), load_engine("ort-cpu"), fixed_bindings=True)


@pytest.mark.parametrize("model", ["tiny-fp32-standard-kv64", "tiny-fp32-decomposed-kv64"])
def test_ort_fixed_bindings_ping_pong_matches_the_plain_binding_path(model):
    """The binding scheme ONNX Runtime's CUDA graphs need (persistent OrtValues, the KV cache
    ping-ponging between two buffer sets, ids updated in place), checked on the CPU provider
    against the plain IO-binding path: decode and verify steps, byte for byte. (The CUDA-graph
    run itself needs ort-cuda, which no machine of this project has: see docs/gpu-verification.md.)"""
    from lockstep.golden.anchors import MODEL_DIR

    from lockstep.engines.ort import OrtDecoder

    engine = load_engine("ort-cpu")
    if not engine.available()[0]:
        pytest.skip(f"ort-cpu unavailable: {engine.available()[1]}")
    proto = onnx.load(str(MODEL_DIR / f"{model}.onnx"))
    # a prefill, one-token steps, verify steps of the graphed width (4) and of another (3), a rewind
    steps = [list(b"The quick"), [66], [67, 68, 69, 70], [71], [72, 73, 74], [75, 76, 77, 78], ("rewind", 2),
             [79], [80], [81, 82, 83, 84], [85]]

    def run(dec):
        dec.reset()
        out = []
        for s in steps:
            if s[0] == "rewind":
                dec.rewind(s[1])
            else:
                out.append(dec.forward(s).tobytes())
        return out

    plain, fixed = OrtDecoder(proto, engine), OrtDecoder(proto, engine, fixed_bindings=True)
    first = run(fixed)
    assert first == run(plain), "result: same bytes as the plain binding path"
    assert run(fixed) == first, "result: reset reuses the same buffers and gives the same bytes"
    # each call flips the cache's direction (0 after reset): the 1-token steps run in directions
    # 1, 1, 0, 1, 1 (ids 2, 2, 1, 2, 2), the 4-token ones in 0, 1, 0 (ids 3, 4, 3); the 3-token step and
    # the prefill ungraphed (-1); two runs of the fixed session
    assert fixed.graph_runs == {1: 2, 2: 8, 3: 4, 4: 2}, (
        f"contract: each graphed width alternates between its own two ids ({fixed.graph_runs})")


@pytest.mark.parametrize("model", ["tiny-fp32-standard", "tiny-fp32-standard-kv64"])
@pytest.mark.parametrize("fixed", [False, True])
def test_ort_rewind_forgets_a_rejected_verify_step(model, fixed):
    """Guarantee (OrtDecoder.rewind, what a speculative decode needs): after a verify step whose
    last tokens are rewound, the session continues as one that never saw them: same position, and
    the next step's logits those of a session fed only the accepted tokens (within 1e-5: the
    accepted rows came from a wider step); a growing cache is cut, a fixed one keeps its buffers."""
    from lockstep.golden.anchors import MODEL_DIR

    from lockstep.engines.ort import OrtDecoder

    engine = load_engine("ort-cpu")
    if not engine.available()[0]:
        pytest.skip(f"ort-cpu unavailable: {engine.available()[1]}")
    proto = onnx.load(str(MODEL_DIR / f"{model}.onnx"))
    if fixed and "kv64" not in model:
        pytest.skip("fixed bindings need a fixed-capacity cache (tested above)")
    spec = OrtDecoder(proto, engine, fixed_bindings=fixed)
    spec.forward(list(b"The quick"))
    spec.forward([66, 67, 68, 69])
    spec.rewind(2)
    assert spec.position == len(b"The quick") + 2, "contract: rewind takes the position back"
    got = spec.forward([70])
    ref = OrtDecoder(proto, engine, fixed_bindings=fixed)
    ref.forward(list(b"The quick"))
    ref.forward([66, 67])
    want = ref.forward([70])
    np.testing.assert_allclose(got, want, rtol=0, atol=1e-5, err_msg="result: the rejected tokens were forgotten")
    with pytest.raises(StepError, match="holds"):
        spec.rewind(spec.position + 1)


def test_a_step_that_cannot_be_captured_decodes_eagerly_and_says_why():
    """A host read inside a recorded step (a download while a MatMul is recorded) refuses the
    recording cleanly (D2H during capture): the capture is aborted, that segment runs eagerly, its
    op type is quarantined for the session, and the decode goes on with the eager tokens."""
    from lockstep.golden.anchors import MODEL_DIR
    from lockstep.reference_runtime import Runtime, RuntimeConfig
    from lockstep.reference_runtime.backends.sim import SimDevice
    from lockstep.reference_runtime.engine import RefDecoder

    model = onnx.load(str(MODEL_DIR / "tiny-fp32-standard-kv64.onnx"))
    dec = RefDecoder(model, Runtime(SimDevice(), RuntimeConfig()), capture=True)
    real_step = dec.ex.step

    def step_with_a_seam(run, i, **kw):
        if dec.rt.is_capturing and dec.ex.steps[i].info.op_type == "MatMul":
            dec.rt.download(run.env["position_ids"].tensor)  # what a host seam does
        return real_step(run, i, **kw)

    dec.ex.step = step_with_a_seam
    res = greedy(dec, list(b"The quick"), 5)
    assert dec.capture_fallback and "CaptureD2HRefused" in dec.capture_fallback
    c = res.counters["capture"]
    assert c["fallbacks"] == 1 and c["quarantined"] == ["MatMul"], "contract: the op type is quarantined"
    assert res.counters["capture_aborts"] == 1 and not dec.rt.is_capturing
    eager = greedy(load_engine("ref-sim").decoder(model), list(b"The quick"), 5)
    assert res.tokens == eager.tokens


class _SharedGraphLifecycle:
    """Mutant runtime mixin: every segment graph handle shares one lifecycle (the last graph
    captured is what any handle replays): the seeds' shared-slot bug, for the graphs a capture
    session keeps per step signature."""

    def end_segment(self, seg):
        super().end_segment(seg)
        self._shared = seg.graph

    def replay_segment(self, seg):
        seg.graph = getattr(self, "_shared", seg.graph)
        super().replay_segment(seg)


class _SharedSlots:
    """Mutant runtime mixin: the two graph slots share one lifecycle (VERIFY is PRIMARY): seed 004's
    bug, where the verify step's capture replaced the decode step's graph."""

    def begin_capture(self, slot):
        super().begin_capture("primary")

    def end_capture(self, slot):
        super().end_capture("primary")

    def abort_capture(self, slot):
        super().abort_capture("primary")

    def replay(self, slot):
        super().replay("primary")


@pytest.mark.parametrize("model_name, mixin", [("tiny-fp32-standard-kv64", _SharedSlots),
                                               ("tiny-fp32-standard", _SharedGraphLifecycle)])
def test_shared_graph_lifecycle_mutant_breaks_decode_verify_alternation(model_name, mixin):
    """The seeds' replays=0 bug class, end to end: with the decode and verify signatures' graphs
    sharing one lifecycle (a fixed-capacity cache: the PRIMARY and VERIFY slots; a growing one: the
    segment graphs), alternating decode and verify steps no longer match the eager run; with
    independent graphs they do (conformance/golden/test_capture_identity.py)."""
    from lockstep.golden.anchors import MODEL_DIR
    from lockstep.reference_runtime import Runtime, RuntimeConfig
    from lockstep.reference_runtime.backends.sim import SimDevice
    from lockstep.reference_runtime.engine import RefDecoder

    class Shared(mixin, Runtime):
        pass

    model = onnx.load(str(MODEL_DIR / f"{model_name}.onnx"))
    steps = [list(b"The quick"), [66], [67, 68, 69], [70], [71, 72, 73], [74]]

    def run(dec):
        dec.reset()
        try:
            return [dec.forward(s).tobytes() for s in steps]
        except Exception as exc:  # a replay of the wrong graph may also fail outright
            return [repr(exc)]

    eager = run(load_engine("ref-sim").decoder(model))
    assert run(RefDecoder(model, Runtime(SimDevice(), RuntimeConfig()), capture=True)) == eager, \
        "result: independent graphs replay byte-identically"
    broken = run(RefDecoder(model, Shared(SimDevice(), RuntimeConfig()), capture=True))
    assert broken != eager


def test_a_graph_whose_intermediates_were_freed_fails_instead_of_replaying_silently():
    """Mutant: the captured step's intermediates are freed after the capture (not retained with the
    graph). Their addresses are baked in the graph, so a replay reads and writes memory that was
    released or handed out again: the simulated device must not let that pass as a correct decode."""
    from lockstep.golden.anchors import MODEL_DIR
    from lockstep.reference_runtime import Runtime, RuntimeConfig
    from lockstep.reference_runtime.backends.sim import SimDevice
    from lockstep.reference_runtime.engine import RefDecoder

    model = onnx.load(str(MODEL_DIR / "tiny-fp32-standard-kv64.onnx"))
    prompt = list(b"The quick brown fox")
    eager = greedy(load_engine("ref-sim").decoder(model), prompt, 8)
    from lockstep.reference_runtime.segments import CaptureSession

    class FreesIntermediates(CaptureSession):
        def _record(self, sig, seg, run):
            ok = super()._record(sig, seg, run)
            for t in seg.retained:
                self.rt.free(t)  # the retention dropped
            return ok

    dec = RefDecoder(model, Runtime(SimDevice(), RuntimeConfig()), capture=True)
    dec.session = FreesIntermediates(dec.ex)
    try:
        broken = greedy(dec, prompt, 8)
    except Exception as exc:  # IllegalAddress (unmapped) or a race: the failure is loud
        assert type(exc).__name__ in {"IllegalAddress", "StreamOrderRace", "LaunchFailure", "UseAfterFree"}, exc
        return
    assert [l.tobytes() for l in broken.step_logits] != [l.tobytes() for l in eager.step_logits]
