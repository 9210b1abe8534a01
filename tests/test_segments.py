"""Segmented capture (``reference_runtime.segments``) on the simulated device: persistent
bindings, recording-failure quarantine, invalidation, per-session counters, and the mutants the
runner must not let through (freed intermediates, a freed bound output)."""

from __future__ import annotations

import dataclasses

import numpy as np
import onnx
import pytest
from lockstep.golden.anchors import MODEL_DIR
from lockstep.golden.models.spec import PROMPT
from lockstep.kernels._kernel import Kernel
from lockstep.kernels.primitives import fill as P_fill
from lockstep.reference_runtime import Runtime, RuntimeConfig
from lockstep.reference_runtime.backends.sim import SimDevice
from lockstep.reference_runtime.engine import RefDecoder
from lockstep.reference_runtime.errors import IllegalAddress, IllegalState, UseAfterFree
from lockstep.reference_runtime.segments import CaptureSession

from lockstep.decoding import greedy
from lockstep.engines.registry import load_engine

PROMPT_IDS = list(PROMPT.encode())
TOKENS = 8


def _model(name="tiny-fp32-standard"):
    return onnx.load(str(MODEL_DIR / f"{name}.onnx"))


def _decoder(capture, name="tiny-fp32-standard", config=None):
    return RefDecoder(_model(name), Runtime(SimDevice(), config or RuntimeConfig()), capture=capture)


def _bytes(result):
    return [l.tobytes() for l in result.step_logits]


def test_growing_cache_decode_replays_segments_and_matches_eager():
    eager = greedy(_decoder(False), PROMPT_IDS, TOKENS)
    dec = _decoder(True)
    on = greedy(dec, PROMPT_IDS, TOKENS)
    c = on.counters["capture"]
    # contract: prefill and the first one-token step warm up eagerly; every later step replays
    # each captured segment once and runs each seam eagerly
    assert c["eager_steps"] == 2 and c["captured_steps"] == TOKENS - 2
    assert c["segments"] > 1 and c["captures"] == c["segments"] and c["replays"] == c["segments"] * (TOKENS - 2)
    assert c["fallbacks"] == 0 and c["invalidations"] == 0 and c["seams_by_reason"].get("classifier", 0) > 0
    assert "kernel not warmed" not in c["seams_by_reason"], "contract: the warm-up step warmed every node"
    assert on.counters["segment_replays"] == c["replays"], "result: the runtime launched exactly those graphs"
    assert on.tokens == eager.tokens and _bytes(on) == _bytes(eager), "result: byte-identical to eager"
    assert eager.counters["capture"]["captures"] == 0 and eager.counters["segment_replays"] == 0


def test_persistent_bindings_keep_their_addresses_and_replays_allocate_nothing_new():
    dec = _decoder(True)
    dec.reset()
    dec.forward(PROMPT_IDS)
    allocs = []
    uploads: list[str] = []
    upload = dec.rt.upload
    dec.rt.upload = lambda host, *, name="": uploads.append(name) or upload(host, name=name)
    for tok in [65, 66, 67, 68, 69]:
        before = dec.rt.counters.allocations
        uploads.clear()
        dec.forward([tok])
        allocs.append(dec.rt.counters.allocations - before)
    assert "input_ids" not in uploads and "position_ids" not in uploads, \
        "contract: a replayed step writes its host feeds into their persistent buffers (no upload and copy)"
    (sig,) = [s for s in dec.session._sigs.values() if s.items is not None]
    addrs = {k: t.addr for k, t in sig.persist.items()}
    assert "input_ids" in addrs and "position_ids" in addrs, "contract: host feeds a segment reads are persistent"
    assert any(k not in ("input_ids", "position_ids") for k in addrs), "contract: seam outputs a segment reads are too"
    dec.forward([70])
    assert {k: t.addr for k, t in sig.persist.items()} == addrs, "contract: the baked addresses do not move"
    # result: after the capture step, every step allocates the same (seam temporaries only), less than eager
    assert len(set(allocs[2:])) == 1 and allocs[2] < allocs[0], allocs


def _with_cublas_matmul(ex):
    """A kernel that declares itself capture-safe but calls cuBLAS: recording it fails."""
    for i, st in enumerate(ex.steps):
        if st.info.op_type == "MatMul":
            bad = Kernel(st.launch.name, st.launch.body, writes=st.launch.writes, uses_cublas=True)
            ex.steps[i] = dataclasses.replace(st, launch=bad)


def test_a_recording_failure_quarantines_the_op_type_and_stays_byte_identical():
    eager = greedy(_decoder(False, "tiny-fp32-decomposed"), PROMPT_IDS, TOKENS)
    dec = _decoder(True, "tiny-fp32-decomposed")
    _with_cublas_matmul(dec.ex)
    on = greedy(dec, PROMPT_IDS, TOKENS)
    c = on.counters["capture"]
    assert c["fallbacks"] == 1 and c["quarantined"] == ["MatMul"], "contract: the op type is quarantined once"
    assert c["seams_by_reason"].get("recording failed", 0) > 0, "contract: the next plan makes it a seam"
    assert c["captures"] > 0 and c["replays"] > 0, "contract: the other segments still capture and replay"
    assert on.tokens == eager.tokens and _bytes(on) == _bytes(eager), "result: fallback is byte-identical"
    assert not dec.rt.is_capturing


def test_an_invalidated_recording_quarantines_its_segment_and_is_counted():
    eager = greedy(_decoder(False), PROMPT_IDS, TOKENS)
    dec = _decoder(True)
    run_step = dec.ex.step
    queried = []

    def querying(run, i, persist=None, temps=None):  # a kernel wrapper that polls the stream in capture
        step = dec.ex.steps[i]
        if step.info.op_type == "Softmax" or step.info.name.endswith("o_proj"):
            if dec.rt.is_capturing and not queried:
                queried.append(step.info.name)
                dec.rt.compute.query()  # no error here; the capture is invalidated (docs/cuda-semantics.md)
        return run_step(run, i, persist=persist, temps=temps)

    dec.ex.step = querying
    on = greedy(dec, PROMPT_IDS, TOKENS)
    c = on.counters["capture"]
    assert queried and c["invalidations"] == 1 and c["fallbacks"] == 1
    from lockstep.reference_runtime.capture_plan import plan_capture

    (segment,) = [seg for seg in plan_capture(dec.ex).segments if queried[0] in seg]
    op_type = {st.info.name: st.info.op_type for st in dec.ex.steps}
    assert c["quarantined"] == sorted({op_type[n] for n in segment}), \
        "contract: found only at end_capture, so every op type of the segment is quarantined"
    assert on.tokens == eager.tokens and _bytes(on) == _bytes(eager)


class _FreesIntermediates(CaptureSession):
    """Mutant: a runner that frees a segment's intermediates after recording (the graph baked them)."""

    def _record(self, sig, seg, run):
        ok = super()._record(sig, seg, run)
        for t in seg.retained:
            self.rt.free(t)
        return ok


def test_mutant_replay_reading_freed_intermediates_is_caught():
    dec = _decoder(True)
    dec.session = _FreesIntermediates(dec.ex)
    # caught either on the host (a later segment or seam launches on a freed handle) or on the
    # device (a replay reads memory the graph baked and the pool took back): never a silent result
    with pytest.raises((IllegalAddress, UseAfterFree), match="freed|address"):
        greedy(dec, PROMPT_IDS, TOKENS)


def test_a_freed_bound_output_is_refused_before_a_replay():
    ex = load_engine("ref-sim").decoder(_model("tiny-fp32-standard")).ex
    session = CaptureSession(ex)
    rt = ex.runtime
    feeds = {"input_ids": np.asarray([[65]], np.int64), "position_ids": np.asarray([[0]], np.int64)}
    zeros = np.zeros((1, 2, 0, 16), np.float32)
    for p in [vi.name for vi in ex.inputs if vi.name.startswith("past_key_values.")]:
        feeds[p] = zeros
    logits = rt.empty((1, 1, 256), np.float32, name="bound-logits")
    session.run(feeds, bind={"logits": logits})  # warm-up
    session.run(feeds, bind={"logits": logits})  # capture: the graph writes into `logits`
    rt.free(logits)
    with pytest.raises(IllegalState, match="freed"):
        session.run(feeds, bind={"logits": logits})


def test_per_op_synchronize_is_real_without_deferral_and_a_counted_no_op_with_it():
    feeds_ids = PROMPT_IDS[:4]
    for defer, key in ((False, "syncs_real"), (True, "syncs_deferred")):
        dec = _decoder(False, config=RuntimeConfig(defer_eager_sync=defer))
        before = dec.rt.counters.as_dict()
        dec.forward(feeds_ids)
        after = dec.rt.counters.as_dict()
        launches = after["launches"] - before["launches"]
        assert after[key] - before[key] == launches > 0, "contract: one synchronize() per kernel launch"


def test_warmup_must_be_positive():
    with pytest.raises(ValueError, match="warmup"):
        CaptureSession(_decoder(False).ex, warmup=0)


def _data_dependent_model():
    """A growing KV cache (Concat onto ``past_key_values.0.key``) beside a data-dependent shape:
    NonZero(x > 0) -> Cast -> ReduceSum, whose count scales the output. NonZero's column count is
    decided by the values of ``x``, not by any feed shape (onnx derives it from ``seq``)."""
    from onnx import TensorProto as T
    from onnx import helper as h

    nodes = [
        h.make_node("Concat", ["past_key_values.0.key", "x"], ["present.0.key"], axis=2),
        h.make_node("Greater", ["x", "zero"], ["mask"]),
        h.make_node("NonZero", ["mask"], ["nz"]),
        h.make_node("Cast", ["nz"], ["nzf"], to=T.FLOAT),
        h.make_node("ReduceSum", ["nzf"], ["count"], keepdims=0),
        h.make_node("Mul", ["x", "count"], ["y0"]),
        h.make_node("Relu", ["y0"], ["y"]),
    ]
    g = h.make_graph(
        nodes, "data_dependent",
        [h.make_tensor_value_info("past_key_values.0.key", T.FLOAT, [1, 1, "past", 2]),
         h.make_tensor_value_info("x", T.FLOAT, [1, 1, "seq", 2])],
        [h.make_tensor_value_info("present.0.key", T.FLOAT, [1, 1, "total", 2]),
         h.make_tensor_value_info("y", T.FLOAT, [1, 1, "seq", 2])],
        initializer=[h.make_tensor("zero", T.FLOAT, [], [0.0])])
    return h.make_model(g, opset_imports=[h.make_opsetid("", 21)], ir_version=10)


def _drive_data_dependent(rt, runner, steps=6):
    past = rt.upload(np.zeros((1, 1, 0, 2), np.float32))
    rng = np.random.default_rng(1)
    out_bytes = []
    for _ in range(steps):
        x = rng.normal(size=(1, 1, 1, 2)).astype(np.float32)  # 0, 1 or 2 positives: NonZero's count varies
        out = runner.run({"past_key_values.0.key": past, "x": x}, keep={"present.0.key"})
        rt.free(past)
        past = out["present.0.key"]
        out_bytes += [out["y"].tobytes(), rt.download(past).tobytes()]
    rt.free(past)
    return out_bytes


def test_a_data_dependent_shape_beside_a_growing_cache_is_a_seam_and_byte_identical(device_name, make_runtime):
    """Guarantee (capture_plan docstring): a dim decided by device data (NonZero's count) is
    growing even when onnx's inference derives it from a feed symbol, so its consumers are seams,
    never baked into a segment. Killed bug: the derived symbol passed as fixed, Cast/ReduceSum were
    captured, and the second captured step failed with IllegalState ("the step signature missed a
    shape"). The seam decisions encode the contract; byte identity with eager is a result."""
    from lockstep.reference_runtime.executor import Executor

    rt_eager = make_runtime()
    eager = _drive_data_dependent(rt_eager, Executor(_data_dependent_model(), rt_eager))
    rt = make_runtime()
    session = CaptureSession(Executor(_data_dependent_model(), rt))
    captured = _drive_data_dependent(rt, session)
    decisions = dict(session.plan.decisions)
    assert decisions["Cast_3"].startswith("classifier: grows with") and decisions["ReduceSum_4"].startswith("classifier")
    assert decisions["Mul_5"] is None, "contract: the scalar count is a seam output a segment reads"
    c = session.counters
    assert c.captured_steps == 5 and c.fallbacks == 0 and c.replays > 0
    assert captured == eager, "result: byte-identical to eager"


def _host_read_model():
    """Relu -> TopK(k) -> Mul: TopK's ``k`` is a feed (device data once uploaded), so TopK reads it
    back on the host: a host-read seam between two captured nodes."""
    from onnx import TensorProto as T
    from onnx import helper as h

    nodes = [
        h.make_node("Relu", ["x"], ["r"], name="relu"),
        h.make_node("TopK", ["r", "k"], ["v", "i"], name="topk", axis=-1),
        h.make_node("Mul", ["v", "two"], ["y"], name="mul"),
    ]
    g = h.make_graph(
        nodes, "host_read",
        [h.make_tensor_value_info("x", T.FLOAT, [1, 8]), h.make_tensor_value_info("k", T.INT64, [1])],
        [h.make_tensor_value_info("y", T.FLOAT, [1, "kk"])],
        initializer=[h.make_tensor("two", T.FLOAT, [], [2.0])])
    return h.make_model(g, opset_imports=[h.make_opsetid("", 21)], ir_version=10)


def _drive_host_read(runner, steps=6):
    rng = np.random.default_rng(2)
    out = []
    for s in range(steps):
        x = rng.normal(size=(1, 8)).astype(np.float32)
        out.append(runner.run({"x": x, "k": np.asarray([1 + s % 3], np.int64)})["y"].tobytes())
    return out


def test_a_host_read_runs_as_an_eager_seam_every_step_and_is_byte_identical(make_runtime):
    """Guarantee (capture_plan docstring, rule 1): a node whose host input holds device data
    (TopK's ``k``) is a "host read" seam, decided before any recording, so a session never tries to
    record it (no fallback) and re-reads ``k`` eagerly every step: ``k`` changes value per step and
    the bytes still equal eager (a recorded TopK would bake the first step's ``k``). The plan-level
    test is tests/test_capture_plan.py; this one holds it through a session."""
    from lockstep.reference_runtime.executor import Executor

    eager = _drive_host_read(Executor(_host_read_model(), make_runtime()))
    session = CaptureSession(Executor(_host_read_model(), make_runtime()))
    captured = _drive_host_read(session)
    assert dict(session.plan.decisions)["topk"] == "host read: k", "contract: the reason is the host read"
    c = session.counters
    assert c.fallbacks == 0 and c.quarantined == [], "contract: planned as a seam, never a failed recording"
    assert c.captured_steps == 5 and c.replays > 0, "contract: the rest of the step was captured and replayed"
    assert captured == eager, "result: byte-identical to eager with k changing every step"


def test_a_device_feed_a_segment_reads_is_staged_every_step(make_runtime):
    """Contract (module docstring, persistent bindings): a device feed a segment reads is copied
    into the persistent buffer the graph baked, on every step, not only the capture step; the
    replay reads this step's ``x`` (the result, byte identity with eager, shows it)."""
    from lockstep.reference_runtime.executor import Executor

    def drive(rt, runner):
        rng = np.random.default_rng(3)
        out = []
        for _ in range(5):
            x = rt.upload(rng.normal(size=(1, 8)).astype(np.float32))
            out.append(runner.run({"x": x, "k": np.asarray([3], np.int64)})["y"].tobytes())
            rt.free(x)
        return out

    rt_eager = make_runtime()
    eager = drive(rt_eager, Executor(_host_read_model(), rt_eager))
    rt = make_runtime()
    session = CaptureSession(Executor(_host_read_model(), rt))
    captured = drive(rt, session)
    assert session.counters.replays == 4 and "x" in next(iter(session._sigs.values())).persist
    assert captured == eager, "result: every replay read its own step's device feed"


def _decode_feeds(ex, tok=65):
    feeds = {"input_ids": np.asarray([[tok]], np.int64), "position_ids": np.asarray([[0]], np.int64)}
    for p in [vi.name for vi in ex.inputs if vi.name.startswith("past_key_values.")]:
        feeds[p] = np.zeros((1, 2, 0, 16), np.float32)
    return feeds


def test_a_feed_of_another_dtype_is_refused_after_capture_as_eagerly():
    """Contract (``run`` has ``Executor.run``'s contract; a signature holds each feed's dtype): once
    a signature is captured, a feed of another dtype is another signature, checked like an eager
    run (FeedError), never written into the int64 buffer the graphs baked."""
    from lockstep.errors import FeedError

    ex = load_engine("ref-sim").decoder(_model("tiny-fp32-standard")).ex
    session = CaptureSession(ex)
    feeds = _decode_feeds(ex)
    session.run(feeds)
    session.run(feeds)
    assert session.counters.captures > 0
    with pytest.raises(FeedError, match="dtype int32 given"):
        session.run({**feeds, "input_ids": feeds["input_ids"].astype(np.int32)})


def test_a_bound_output_is_part_of_the_signature_by_identity():
    """Contract: the graphs write the bound tensor they were recorded with, so binding another
    tensor is another signature, and that tensor gets this step's logits (not the old one)."""
    ex = load_engine("ref-sim").decoder(_model("tiny-fp32-standard")).ex
    session = CaptureSession(ex)
    rt = ex.runtime
    feeds = _decode_feeds(ex)
    first = rt.empty((1, 1, 256), np.float32, name="first")
    session.run(feeds, bind={"logits": first})
    session.run(feeds, bind={"logits": first})  # captured: the graph writes into `first`
    other = rt.upload(np.full((1, 1, 256), np.nan, np.float32), name="other")
    rt.launch(P_fill, first, value=0.0)
    session.run(feeds, bind={"logits": other})
    assert not np.isnan(rt.download(other)).any(), "contract: the newly bound tensor was written"
    assert not rt.download(first).any(), "contract: the tensor of the other signature was not"


def test_close_frees_everything_the_session_allocated():
    """Contract: ``close`` frees every signature's persistent bindings and every graph's retained
    intermediates: the runtime's live allocations return to what they were before the session."""
    from lockstep.reference_runtime.executor import Executor

    rt = Runtime(SimDevice(), RuntimeConfig())
    ex = Executor(_data_dependent_model(), rt)
    live = rt.counters.allocations - rt.counters.frees
    session = CaptureSession(ex)
    _drive_data_dependent(rt, session)
    assert session.counters.captures > 0 and any(s.persist for s in session._sigs.values())
    session.close()
    assert rt.counters.allocations - rt.counters.frees == live, "contract: nothing the session held is left"


def test_a_step_whose_later_segment_failed_to_record_replays_the_earlier_and_records_the_rest():
    """Contract (a replay publishes the values read outside the segment that produces them): when
    an error that is not a recording failure (here injected: a segment's recording raising
    MemoryError before it starts) escapes a capture step after an earlier segment was recorded,
    the next step replays that segment and records the later ones from the run's values, which
    hold what the later segments read of the earlier one. Byte-identical to eager decoding."""
    eager = _decoder(False)
    dec = _decoder(True)
    prompt = PROMPT_IDS
    eager.forward(prompt)
    dec.forward(prompt)
    tokens = [65, 66, 67, 68]
    want = [eager.forward([t]).tobytes() for t in tokens]
    real = CaptureSession._record
    calls = []

    def record(self, sig, seg, run):
        calls.append(seg)
        if len(calls) == 2:  # the second segment of the first capture step
            raise MemoryError("injected: not a recording failure")
        return real(self, sig, seg, run)

    CaptureSession._record = record
    try:
        got = [dec.forward([tokens[0]]).tobytes()]  # warm-up step (eager)
        with pytest.raises(MemoryError, match="injected"):
            dec.forward([tokens[1]])
        got += [dec.forward([t]).tobytes() for t in tokens[1:]]
    finally:
        CaptureSession._record = real
    segments = [it for kind, it in next(s for s in dec.session._sigs.values() if s.items).items if kind == "segment"]
    assert len(segments) > 2 and segments[0].graph is not None and all(s.graph is not None for s in segments)
    assert got == want, "result: byte-identical to eager"


def _renamed_caches(model: onnx.ModelProto) -> onnx.ModelProto:
    """The model with its caches named as no default pattern knows (`cache.L.K` in, `cache_out.L.K` out)."""
    out = onnx.ModelProto()
    out.CopyFrom(model)

    def rename(name: str) -> str:
        if name.startswith("past_key_values."):
            return "cache." + name[len("past_key_values."):]
        if name.startswith("present."):
            return "cache_out." + name[len("present."):]
        return name

    g = out.graph
    for vi in [*g.input, *g.output, *g.value_info]:
        vi.name = rename(vi.name)
    for n in g.node:
        n.input[:] = [rename(i) for i in n.input]
        n.output[:] = [rename(o) for o in n.output]
    return out


def test_caches_a_card_names_grow_and_are_captured_like_the_default_names():
    """Contract (issue 53): the growing symbols come from the decoder's past/present roles, not from the
    cache names: a model whose card names its caches otherwise is planned and captured as the same model
    with the default names (result: the same counters, and byte-identical to eager)."""
    from lockstep.decoder_io import DecoderIO

    model = _renamed_caches(_model("tiny-fp32-standard"))
    io = DecoderIO.of(model, {"past": "cache.{layer}.{kind}", "present": "cache_out.{layer}.{kind}"})
    eager = greedy(RefDecoder(model, Runtime(SimDevice(), RuntimeConfig()), capture=False, io=io), PROMPT_IDS, TOKENS)
    on = greedy(RefDecoder(model, Runtime(SimDevice(), RuntimeConfig()), capture=True, io=io), PROMPT_IDS, TOKENS)
    default = greedy(_decoder(True), PROMPT_IDS, TOKENS)
    c, d = on.counters["capture"], default.counters["capture"]
    assert c["captures"] > 0 and c["replays"] > 0, f"contract: the renamed caches' model is captured: {c}"
    assert (c["segments"], c["captures"], c["replays"]) == (d["segments"], d["captures"], d["replays"]), (c, d)
    assert on.tokens == eager.tokens and _bytes(on) == _bytes(eager), "result: byte-identical to eager"
