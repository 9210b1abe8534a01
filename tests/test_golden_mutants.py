"""Proof the golden locks can fail: mutant engines break the fatal lock, the planted near-tie trips
the tripwire without failing, and provenance problems fail loudly instead of passing."""

from __future__ import annotations

import copy

import numpy as np
import onnx
import pytest
from lockstep.decoding import VERIFY_WIDTH, StepError, open_session, teacher_force
from lockstep.golden.anchors import MODEL_DIR, load_snapshot
from lockstep.golden.locks import ModelChanged, NotFromOracle, check_provenance, teacher_forced_lock, tripwire
from lockstep.golden.models.spec import NEAR_TIE
from lockstep.reference_runtime import Runtime, RuntimeConfig
from lockstep.reference_runtime.backends.sim import SimDevice
from lockstep.reference_runtime.engine import RefDecoder

FP32 = "tiny-fp32-standard"


def ref_decoder(name, cls=RefDecoder):
    return cls(onnx.load(str(MODEL_DIR / f"{name}.onnx")), Runtime(SimDevice(), RuntimeConfig()))


class RotaryOffByOne(RefDecoder):
    """Decode steps use position p + 1 for the token at p (the cache was written at the right ones)."""

    def forward(self, ids):
        if len(ids) == 1 and self.position > 0:
            self.position += 1
            out = super().forward(ids)
            self.position -= 1
            return out
        return super().forward(ids)


class KvWrongSlot(RefDecoder):
    """Each step writes its key/value one slot early, over the previous token's entry (so that
    entry is lost and the new one appears twice). A mere swap of two slots would be invisible:
    attention is order-free over keys that carry their rotary positions."""

    def forward(self, ids):
        out = super().forward(ids)
        for _name, t in list(self.cache.items()):
            kv = self.rt.download(t)
            if kv.shape[2] >= 2:
                kv[:, :, -2] = kv[:, :, -1]
                self.rt.write(t, kv)
        return out


class VerifyGarbled(RefDecoder):
    """Every step of more than one token after a past runs one position early (its rotary positions
    and cache slots shifted): the prefill and the one-token steps are right, a speculative verify step
    is garbled. The suite once ran 40 prefills, 688 one-token steps and no verify step (issue 53)."""

    def forward(self, ids):
        if len(ids) > 1 and self.position > 0:
            self.position -= 1
            out = super().forward(ids)
            self.position += 1
            return out
        return super().forward(ids)


class Perturbed:
    """Adds ``delta`` to the runner-up logit at every position: an fp16-scale perturbation."""

    def __init__(self, inner, delta):
        self.inner, self.delta = inner, delta

    def reset(self):
        self.inner.reset()

    def forward(self, ids):
        logits = np.array(self.inner.forward(ids), np.float64)
        for row in logits:
            row[np.argsort(-row)[1]] += self.delta
        return logits

    def capture_stats(self):
        return self.inner.capture_stats()


class Nudged(Perturbed):
    """Adds ``delta`` to one logit (``rank`` 0: the top-1, 1: the runner-up) at one absolute position
    ``pos`` only, in every mode (prefill, stepwise, greedy): exactly one anchored position moves."""

    def __init__(self, inner, pos, delta, rank=1):
        super().__init__(inner, delta)
        self.pos, self.rank, self.at = pos, rank, 0

    def reset(self):
        self.inner.reset()
        self.at = 0

    def forward(self, ids):
        logits = np.array(self.inner.forward(ids), np.float64)
        if 0 <= self.pos - self.at < len(logits):
            row = logits[self.pos - self.at]
            row[np.argsort(-row)[self.rank]] += self.delta
        self.at += len(ids)
        return logits


@pytest.mark.parametrize("mutant", [RotaryOffByOne, KvWrongSlot])
def test_decode_path_mutants_fail_the_fatal_lock(mutant):
    snap = load_snapshot(FP32)
    dec = ref_decoder(FP32, mutant)
    prefill = teacher_forced_lock(dec, snap, "fp32", stepwise=False)
    stepwise = teacher_forced_lock(dec, snap, "fp32", stepwise=True)
    assert prefill.ok, "the mutant breaks only the decode path; one prefill is unaffected"
    assert not stepwise.ok and stepwise.violations, f"{mutant.__name__} must break the stepwise lock"
    first = stepwise.violations[0]["pos"]
    assert stepwise.describe().startswith(f"first divergence at position {first}:"), (
        "result: the message points at the first diverging position")


def test_a_verify_step_mutant_fails_only_the_verify_lock():
    """result: an engine whose every M > 1 step after a past is garbled passes the prefill and
    stepwise locks and fails the verify lock (k = VERIFY_WIDTH tokens a step after the prompt)."""
    snap = load_snapshot(FP32)
    dec = ref_decoder(FP32, VerifyGarbled)
    assert teacher_forced_lock(dec, snap, "fp32", stepwise=False).ok
    assert teacher_forced_lock(dec, snap, "fp32", stepwise=True).ok
    verify = teacher_forced_lock(dec, snap, "fp32", verify=VERIFY_WIDTH)
    assert verify.mode == "verify" and verify.violations, "the garbled verify steps must break the lock"
    assert verify.violations[0]["pos"] >= len(snap["prompt"]), "the prompt's prefill is right"


def test_verify_steps_are_the_prompt_then_k_tokens_a_call():
    """contract (teacher_force, verify=k): the prompt as one prefill, then k tokens a call, the last
    one shorter; every position of the context gets its logits."""
    calls = []

    class Recorder:
        def reset(self):
            calls.clear()

        def forward(self, ids):
            calls.append(len(ids))
            return np.zeros((len(ids), 3))

    out = teacher_force(Recorder(), list(range(11)), verify=4, prompt=5)
    assert calls == [5, 4, 2] and out.shape == (11, 3)
    with pytest.raises(StepError):
        teacher_force(Recorder(), [1, 2], verify=1)


def test_the_real_decoder_passes_every_mode():
    snap = load_snapshot(FP32)
    dec = ref_decoder(FP32)
    for kw in ({"stepwise": False}, {"stepwise": True}, {"verify": VERIFY_WIDTH}):
        res = teacher_forced_lock(dec, snap, "fp32", **kw)
        assert res.ok and res.checked == len(snap["positions"]) - res.near_ties, kw


def test_the_lock_checks_the_last_anchored_position():
    """Contract (teacher_forced_lock): every anchored position outside the band is checked, the
    last one included, in both modes. Independent of the position count asserted in
    test_the_real_decoder_passes_both_modes: here a divergence planted at the last position only
    must be the one violation."""
    snap = load_snapshot(FP32)
    last = snap["positions"][-1]
    assert last["margin"] > snap["band"]["fp32"], "the last position is checked, not a near-tie"
    dec = Nudged(ref_decoder(FP32), last["pos"], 2 * last["margin"])  # the runner-up overtakes
    for stepwise in (False, True):
        res = teacher_forced_lock(dec, snap, "fp32", stepwise=stepwise)
        assert [(v["pos"], v["kind"]) for v in res.violations] == [(last["pos"], "argmax")], res.describe()


def test_the_tripwire_compares_the_last_recorded_token():
    """Contract (tripwire): the greedy stream is compared over the whole recorded prefix; a
    divergence at its last token, outside the band, is fatal."""
    snap = load_snapshot(FP32)
    last = snap["positions"][-1]
    trip = tripwire(Nudged(ref_decoder(FP32), last["pos"], 2 * last["margin"]), snap, "fp32")
    assert trip.fatal and trip.divergence["pos"] == last["pos"], trip.divergence


def test_a_margin_moved_beyond_twice_the_band_either_way_is_a_violation():
    """Contract (teacher_forced_lock): where the engine keeps the anchor, a margin off the oracle's
    by more than twice the band is a violation, whether the engine shrank it or grew it."""
    snap = load_snapshot(FP32)
    band = snap["band"]["fp32"]
    entry = max(snap["positions"], key=lambda p: p["margin"])
    assert entry["margin"] > 10 * band
    # 5 bands: the honest decoder is within 2 of the oracle, so the moved margin is at least 3 off
    for rank, change in ((1, "shrunk"), (0, "grown")):
        res = teacher_forced_lock(Nudged(ref_decoder(FP32), entry["pos"], 5 * band, rank), snap, "fp32",
                                  stepwise=False)
        assert [(v["pos"], v["kind"]) for v in res.violations] == [(entry["pos"], "margin")], (change, res.violations)


def test_a_flipped_argmax_is_a_violation_never_a_near_tie():
    """Contract (teacher_forced_lock): near-ties are the positions whose *oracle* margin lies in the
    band; an engine whose own error collapses or flips a margin does not make that position a
    near-tie (its error cannot excuse itself)."""
    snap = load_snapshot(FP32)
    band = snap["band"]["fp32"]
    entry = max(snap["positions"], key=lambda p: p["margin"])
    res = teacher_forced_lock(Nudged(ref_decoder(FP32), entry["pos"], 2 * entry["margin"]), snap, "fp32",
                              stepwise=False)
    assert res.near_ties == sum(p["margin"] <= band for p in snap["positions"])
    assert [(v["pos"], v["kind"]) for v in res.violations] == [(entry["pos"], "argmax")], res.violations
    assert res.violations[0]["engine_margin"] < 0


def test_a_lock_that_checked_no_position_is_not_a_pass():
    """Contract (LockResult.ok): a lock where every position is a near-tie checked nothing and is
    not a pass, however clean the engine."""
    snap = copy.deepcopy(load_snapshot(FP32))
    snap["band"]["fp32"] = 1e9
    res = teacher_forced_lock(ref_decoder(FP32), snap, "fp32", stepwise=False)
    assert res.checked == 0 and res.near_ties == len(snap["positions"]) and not res.violations
    assert not res.ok


def test_fp16_accumulation_declared_as_fp32_fails_the_lock():
    snap = load_snapshot(FP32)
    fp16 = ref_decoder("tiny-fp16-standard")  # the same weights, computed in fp16
    honest = teacher_forced_lock(fp16, snap, "fp16", stepwise=False)
    assert honest.ok, honest.violations
    lying = teacher_forced_lock(fp16, snap, "fp32", stepwise=False)
    assert not lying.ok and any(v["kind"] == "margin" for v in lying.violations)


def test_a_snapshot_not_from_the_oracle_or_for_another_model_fails():
    snap = load_snapshot(FP32)
    check_provenance(snap)
    skipped = copy.deepcopy(snap)
    skipped["provenance"]["oracle"] = "ref-sim"  # anchors taken from an engine: a skipped oracle
    with pytest.raises(NotFromOracle):
        check_provenance(skipped)
    moved = copy.deepcopy(snap)
    moved["provenance"]["model_sha256"] = "0" * 64
    with pytest.raises(ModelChanged, match="model changed: regenerate"):
        check_provenance(moved)


def test_provenance_of_another_generator_version_is_model_changed():
    """Contract (check_provenance): the snapshot records the generator version; a snapshot from
    another one fails with "model changed: regenerate" even where the model's sha256 agrees."""
    from lockstep.golden.models.spec import GENERATOR_VERSION

    snap = copy.deepcopy(load_snapshot(FP32))
    snap["provenance"]["generator_version"] = str(int(GENERATOR_VERSION) + 1)
    with pytest.raises(ModelChanged, match="model changed: regenerate"):
        check_provenance(snap)


def test_provenance_of_a_user_model_follows_its_file(tmp_path):
    """Contract (GoldenModel.check_provenance, a user's model): the snapshot belongs to the model
    file's sha256 and came from the oracle; one byte more in the file is "model changed"."""
    import shutil

    from lockstep.golden.catalog import GoldenModel

    path = tmp_path / "mine.onnx"
    shutil.copy(MODEL_DIR / f"{FP32}.onnx", path)
    gm = GoldenModel("mine", "user", tmp_path / "mine.json", path)
    snap = load_snapshot(FP32)  # from the oracle, for this very file
    gm.check_provenance(snap)
    engine_made = copy.deepcopy(snap)
    engine_made["provenance"]["oracle"] = "ref-sim"
    with pytest.raises(NotFromOracle):
        gm.check_provenance(engine_made)
    with open(path, "ab") as f:
        f.write(b"\0")
    with pytest.raises(ModelChanged, match="model changed: regenerate"):
        gm.check_provenance(snap)


def test_missing_model_or_snapshot_is_an_error_not_a_pass():
    with pytest.raises(FileNotFoundError, match="run `lockstep golden regenerate"):
        load_snapshot("no-such-model")
    snap = copy.deepcopy(load_snapshot(FP32))
    snap["model"] = "no-such-model"
    with pytest.raises(FileNotFoundError, match="golden model .* is missing"):
        check_provenance(snap)


def test_the_planted_near_tie_trips_the_tripwire_without_failing():
    name = "tiny-neartie-fp32-standard"
    snap = load_snapshot(name)
    planted = snap["positions"][0]
    assert planted["pos"] == NEAR_TIE.position and planted["margin"] < 1e-3
    dec = Perturbed(ref_decoder(name), delta=1e-3)  # flips a 2e-4 margin, not the others
    trip = tripwire(dec, snap, "fp16")
    assert trip.divergence is not None and trip.divergence["pos"] == NEAR_TIE.position
    assert trip.divergence["near_tie"] and not trip.fatal
    lock = teacher_forced_lock(dec, snap, "fp16", stepwise=False)
    assert lock.ok, "the fatal lock skips the near-tie"


def test_an_off_set_token_at_a_near_tie_is_fatal_in_the_lock_and_the_tripwire():
    """result (issue 53, seed 001's allowed set): at the planted near-tie the only benign outcomes
    are the tokens within the band of the oracle's top-1 (``allowed_at``); the 6th-ranked token pushed
    up by +50 logits there passed both tripwire and lock before snapshot format 4, and fails both now."""
    from lockstep.golden.anchors import allowed_at, band_for

    name = "tiny-neartie-fp32-standard"
    snap = load_snapshot(name)
    planted = snap["positions"][0]
    allowed = allowed_at(planted, band_for(snap, "fp16"))
    assert allowed is not None and planted["top2"] in allowed, "format 4: the near-tie's candidates are recorded"
    pushed = Nudged(ref_decoder(name), NEAR_TIE.position, delta=50.0, rank=5)
    trip = tripwire(pushed, snap, "fp16")
    assert trip.divergence["pos"] == NEAR_TIE.position and trip.divergence["engine_token"] not in allowed
    assert trip.fatal and not trip.divergence["near_tie"], "a token outside the allowed set is not a near-tie outcome"
    lock = teacher_forced_lock(pushed, snap, "fp16", stepwise=False)
    assert not lock.ok and lock.violations[0]["kind"] == "off-set" and lock.violations[0]["pos"] == NEAR_TIE.position
    assert "none of the tokens within the band" in lock.describe()
    # the benign flip (the runner-up, within the band) stays a near-tie outcome: no false alarm
    benign = Nudged(ref_decoder(name), NEAR_TIE.position, delta=1e-3, rank=1)
    assert not tripwire(benign, snap, "fp16").fatal and teacher_forced_lock(benign, snap, "fp16").ok


def test_a_snapshot_without_near_tie_candidates_keeps_every_near_tie_outcome():
    """contract (allowed_at): a format-3 snapshot (no ``near``) or a position with more candidates
    within the band than recorded (``next_gap`` <= band) cannot say which tokens are benign: any
    token at a near-tie stays a near-tie outcome, never a false alarm."""
    from lockstep.golden.anchors import allowed_at

    entry = {"pos": 3, "top1": 7, "top2": 9, "margin": 0.01}
    assert allowed_at(entry, 0.1) is None
    assert allowed_at({**entry, "near": [[9, 0.01], [4, 0.05]], "next_gap": 0.08}, 0.1) is None
    assert allowed_at({**entry, "near": [[9, 0.01], [4, 0.05]], "next_gap": 0.3}, 0.1) == {7, 9, 4}
    assert allowed_at({**entry, "near": [[9, 0.01], [4, 0.05]], "next_gap": 0.3}, 0.02) == {7, 9}


def test_a_divergence_outside_the_band_is_fatal():
    snap = load_snapshot(FP32)
    trip = tripwire(Perturbed(ref_decoder(FP32), delta=5.0), snap, "fp32")
    assert trip.fatal and not trip.divergence["near_tie"]


def _tf32(a):
    """Round float32 values to TF32 (10 explicit mantissa bits, round to nearest even)."""
    bits = np.asarray(a, np.float32).view(np.uint32).astype(np.uint64)
    lsb = (bits >> 13) & 1
    return ((bits + 0xFFF + lsb) & ~np.uint64(0x1FFF)).astype(np.uint32).view(np.float32)


def test_tf32_products_fail_the_fp32_lock_and_pass_the_tf32_band():
    """What ORT's CUDA provider does by default (TF32 matrix products), emulated by rounding the
    weights to TF32: the strict fp32 lock catches it; declared as tf32, the wider band accepts it."""
    from onnx import numpy_helper

    snap = load_snapshot(FP32)
    model = onnx.load(str(MODEL_DIR / f"{FP32}.onnx"))
    for t in model.graph.initializer:
        if t.data_type == onnx.TensorProto.FLOAT and len(t.dims) == 2 and not t.name.startswith("rope"):
            t.CopyFrom(numpy_helper.from_array(_tf32(numpy_helper.to_array(t)), t.name))
    dec = RefDecoder(model, Runtime(SimDevice(), RuntimeConfig()))
    strict = teacher_forced_lock(dec, snap, "fp32", stepwise=False)
    assert not strict.ok and all(v["kind"] == "margin" for v in strict.violations), strict.describe()
    assert teacher_forced_lock(dec, snap, "tf32", stepwise=False).ok, "result: inside the TF32 band"
    assert snap["band"]["tf32"] > 100 * snap["band"]["fp32"]


def test_an_fp16_band_inflated_a_thousandfold_is_caught():
    """Guarantee (golden/README, anchors' error model): a divergence at a position whose oracle
    margin lies outside the fp16 band is fatal for an fp16 engine. Mutant: the fp16 band inflated
    x1000 (in the error model or in the snapshot), which would make that divergence a near-tie.
    The fatal assertion encodes the contract; the band equality encodes a result (the stored band
    is the error model's, recomputed here), so a mutant of either place is killed."""
    from lockstep.golden.anchors import ModelShape, near_tie_band

    name = "tiny-fp16-standard"
    snap = load_snapshot(name)
    model = onnx.load(str(MODEL_DIR / f"{name}.onnx"))
    assert snap["band"]["fp16"] == float(f"{near_tie_band(ModelShape.of(model), 'fp16', snap['logit_scale']):.4g}")
    dec = Perturbed(ref_decoder(name), delta=5.0)  # flips the first position: a real divergence
    trip = tripwire(dec, snap, "fp16")
    assert trip.divergence is not None and trip.fatal, trip.divergence
    band, margin = snap["band"]["fp16"], trip.divergence["oracle_margin"]
    assert band < margin < 1000 * band, "the planted divergence discriminates a thousandfold inflation"
    inflated = copy.deepcopy(snap)
    inflated["band"]["fp16"] = 1000 * band
    assert not tripwire(dec, inflated, "fp16").fatal, "under the mutant the same divergence passes as a near-tie"


def test_oracle_and_cross_check_disagreeing_refuses_regeneration():
    """Guarantee (anchors_from_oracle): regeneration refuses to write anchors where the fp32
    oracle and its float64 cross-check differ by more than the fp32 band, naming the first such
    position. A planted disagreement (the oracle run's cross-check logits shifted at two positions)
    must raise OracleDisagreement naming the first; the same run without it writes anchors, so the
    guard is not simply always refusing. Both assertions encode the contract."""
    from lockstep.golden.anchors import OracleDisagreement, anchors_from_oracle

    snap, model, (prompt, prefix, logits) = _planted_oracle()
    context = prompt + prefix
    cross = logits.astype(np.float64) + 1e-9
    kwargs = dict(provenance={}, prefix_tokens=len(prefix))
    agreed = anchors_from_oracle(FP32, model, model, model, prompt, run=(prefix, logits, cross), **kwargs)
    assert [p["pos"] for p in agreed["positions"]] == list(range(len(prompt) - 1, len(context) - 1))
    first, second = len(prompt) + 2, len(prompt) + 5
    planted = cross.copy()
    planted[first, 0] += 0.05  # far outside the fp32 band, far inside every other
    planted[second, 1] -= 0.05
    with pytest.raises(OracleDisagreement, match=rf"position {first}: oracle and float64 cross-check differ"):
        anchors_from_oracle(FP32, model, model, model, prompt, run=(prefix, logits, planted), **kwargs)


def _planted_oracle():
    """The snapshot, model and a made-up oracle run (prompt, prefix, logits) whose argmax is the
    recorded greedy token everywhere with a margin of at least 1."""
    snap = load_snapshot(FP32)
    model = onnx.load(str(MODEL_DIR / f"{FP32}.onnx"))
    prompt, prefix = snap["prompt"], snap["prefix"]
    context = prompt + prefix
    rng = np.random.default_rng(0)
    logits = rng.normal(0.0, 4.0, (len(context), max(context) + 8)).astype(np.float32)
    for i in range(len(context) - 1):
        logits[i, context[i + 1]] = logits[i].max() + 1.0
    return snap, model, (prompt, prefix, logits)


def test_an_oracle_argmax_that_is_not_its_recorded_token_refuses_regeneration():
    """Contract (anchors_from_oracle): every anchor's top-1 is the oracle's own recorded greedy
    token; logits whose argmax at a position is another token refuse to write, naming it (no
    cross-check involved)."""
    from lockstep.golden.anchors import OracleDisagreement, anchors_from_oracle

    _, model, (prompt, prefix, logits) = _planted_oracle()
    at = len(prompt) + 3
    logits[at, (prompt + prefix)[at + 1] ^ 1] = logits[at].max() + 1.0
    with pytest.raises(OracleDisagreement, match=rf"position {at}: the oracle's argmax .* is not its own greedy token"):
        anchors_from_oracle(FP32, model, model, None, prompt, run=(prefix, logits, None), provenance={},
                            prefix_tokens=len(prefix))


def test_the_cross_check_is_float64():
    """Result: the cross-check (the reference runtime in float64 on the decomposed twin) agrees
    with the generator's independent float64 numpy forward to 1e-9, where the fp32 oracle is about
    1e-5 off: a float64 computation, fine enough to judge the fp32 band (1e-4 here). Both paths:
    streamed (every model without a subgraph) and the executor's whole model (the others)."""
    from lockstep.golden.models import PROMPT, VARIANTS, build, prompt_ids, reference_forward, weights_from_model
    from lockstep.golden.oracle import decomposed_twin, float64_logits, float64_logits_executor

    spec = VARIANTS[FP32]
    ids = prompt_ids(PROMPT)
    want, _ = reference_forward(spec, weights_from_model(build(spec)), ids, np.arange(ids.shape[1])[None])
    for path in (float64_logits, float64_logits_executor):
        got = path(decomposed_twin(spec), [int(t) for t in ids[0]])
        assert got.dtype == np.float64 and np.abs(got - want[0]).max() < 1e-9, f"result: {path.__name__}"


def test_a_verify_failure_is_the_models_only_where_a_second_runtime_fails_too():
    """contract (conformance.golden.arbiter, the verify lock's skip): an engine that fails the verify
    step of a model another runtime verifies is failed (no reason to skip); a model every runtime
    refuses k tokens after a past (GenAI's fp16 CPU export: its causal mask is built for a prefill or
    one token) is a skip naming both failures; an engine whose prefill fails is the prefill's."""
    from lockstep.conformance.golden.arbiter import model_takes_no_verify_step
    from lockstep.engines.registry import load_available
    from lockstep.golden.catalog import catalog

    models = {m.name: m for m in catalog()}
    engine = load_available("ref-sim")
    tiny = models[FP32]
    garbled = ref_decoder(FP32, VerifyGarbled)
    assert model_takes_no_verify_step(engine, garbled, tiny, tiny.snapshot(), RuntimeError("x")) is None

    class Refuses(RefDecoder):
        def forward(self, ids):
            if len(ids) > 1 and self.position > 0:
                raise RuntimeError("no verify step here")
            return super().forward(ids)

    assert model_takes_no_verify_step(engine, ref_decoder(FP32, Refuses), tiny, tiny.snapshot(),
                                      RuntimeError("no verify step here")) is None, "ORT runs it: the engine's bug"
    gm = models["genai-llama-fp16-cpu"]
    model = gm.load()
    session = open_session(engine, model, io=gm.io(model))
    why = model_takes_no_verify_step(engine, session, gm, gm.snapshot(), RuntimeError("Expand"))
    assert why and why.startswith("genai-llama-fp16-cpu takes no 4-token step after a past") and "ort-cpu" in why

    class NoPrefill(RefDecoder):
        def forward(self, ids):
            raise RuntimeError("no prefill either")

    assert model_takes_no_verify_step(engine, ref_decoder(FP32, NoPrefill), tiny, tiny.snapshot(),
                                      RuntimeError("x")) is None


class NoRewind(RefDecoder):
    """Keeps a verify step's rejected tokens: its rewind does nothing."""

    def rewind(self, n):
        pass


def test_speculative_decode_is_greedy_and_a_session_that_keeps_rejected_tokens_is_not():
    """result: the reference runtime's speculative decode (prompt-lookup draft, verify steps of
    VERIFY_WIDTH, rewind) gives the greedy tokens on a model with a fixed-capacity cache, capture on
    and off, both slots replaying; a session whose rewind keeps the rejected draft leaves greedy."""
    from lockstep.decoding import greedy, speculative

    name = "small-fp32-standard-kv64"
    snap = load_snapshot(name)
    prompt = snap["prompt"] + snap["prefix"][:6] + snap["prompt"]
    want = greedy(ref_decoder(name), prompt, 16).tokens
    plain = speculative(ref_decoder(name), prompt, 16)
    assert plain.tokens == want and plain.kinds().get("verify", 0) >= 2
    assert any(c["kind"] == "verify" and c["accepted"] < VERIFY_WIDTH - 1 for c in plain.calls), "a draft was rejected"
    model = onnx.load(str(MODEL_DIR / f"{name}.onnx"))
    captured = RefDecoder(model, Runtime(SimDevice(), RuntimeConfig()), capture=True)
    on = speculative(captured, prompt, 16)
    slots = on.capture.detail["replays_by_slot"]
    assert on.tokens == want and slots["primary"] > 0 and slots["verify"] > 0, slots
    # a growing cache keeps the rejected rows where rewind does nothing: the tokens leave greedy
    grow = "small-fp32-standard"
    snap = load_snapshot(grow)
    prompt = snap["prompt"] + snap["prefix"][:6] + snap["prompt"]
    want = greedy(ref_decoder(grow), prompt, 16).tokens
    assert speculative(ref_decoder(grow), prompt, 16).tokens == want
    assert speculative(ref_decoder(grow, NoRewind), prompt, 16).tokens != want


class SharedKvBuffer(RefDecoder):
    """Every session on one runtime writes the same fixed-capacity KV buffer: a serving engine's
    pool handing two requests one block (the cross-request leak)."""

    pool: dict = {}

    def reset(self):
        super().reset()
        held = SharedKvBuffer.pool.setdefault(id(self.rt), self.cache)
        if held is not self.cache:
            self.cache = held
            self._bind = {self.present_of[p]: t for p, t in self.cache.items()}


def test_neighbouring_sessions_match_their_solo_runs_and_a_shared_kv_buffer_does_not():
    """result: two reference-runtime sessions advanced in turn (``interleaved``) give their solo
    greedy runs' bytes; two sessions sharing one KV buffer do not (the check
    conformance/golden/test_neighbours.py runs on every engine)."""
    from lockstep.decoding import greedy, interleaved

    name = "small-fp32-standard-kv64"
    snap = load_snapshot(name)
    prompts = [snap["prompt"], snap["prompt"][1:] + snap["prefix"][:3]]
    model = onnx.load(str(MODEL_DIR / f"{name}.onnx"))
    solo = [greedy(ref_decoder(name), p, 8) for p in prompts]

    def pair(cls):
        rt = Runtime(SimDevice(), RuntimeConfig())
        return [cls(model, rt), cls(model, rt)]

    honest = interleaved(pair(RefDecoder), prompts, 8)
    assert [r.tokens for r in honest] == [s.tokens for s in solo]
    assert all(a.tobytes() == b.tobytes() for r, s in zip(honest, solo) for a, b in zip(r.step_logits, s.step_logits))
    leaky = interleaved(pair(SharedKvBuffer), prompts, 8)
    assert any(a.tobytes() != b.tobytes() for r, s in zip(leaky, solo) for a, b in zip(r.step_logits, s.step_logits)), (
        "a shared KV buffer must show in the interleaved run")


def test_a_cache_holding_fewer_rows_than_it_should_refuses_rewind():
    """contract (decoding.check_rewind, both sessions' rewind): a sliding-window cache, fixed-capacity
    or growing, cannot forget a step (the rows it overwrote are gone): Unsupported, never a wrong
    cache; more positions than held is a StepError."""
    from types import SimpleNamespace

    from lockstep.decoding import check_rewind
    from lockstep.engines.protocol import Unsupported

    growing, fixed = SimpleNamespace(capacity=0), SimpleNamespace(capacity=64)
    check_rewind(growing, {"k0": 20, "k1": 20}, 20, 3)
    check_rewind(fixed, {"k0": 64}, 20, 3)
    for io, rows in ((growing, {"k0": 20, "k1": 8}), (fixed, {"k0": 64, "k1": 8})):
        with pytest.raises(Unsupported, match="k1 is a sliding-window cache of 8 rows"):
            check_rewind(io, rows, 20, 3)
    with pytest.raises(StepError):
        check_rewind(growing, {"k0": 20}, 20, 21)


class BatchRowsMixed:
    """ref-sim whose graph runs read the first row's cache for every row of a batch (a cache block
    shared across a batch's requests); batch 1 is untouched."""

    name = "planted-batch-rows-mixed"

    def __init__(self, declares_invariance: bool = False):
        from lockstep.engines import load_engine

        self.inner = load_engine("ref-sim")
        self.batch_invariant = declares_invariance

    def available(self):
        return True, ""

    def prepare(self, model):
        run = self.inner.prepare(model)
        pasts = {i.name for i in model.graph.input if "past" in i.name}

        def mixed(feeds):
            feeds = {k: (np.repeat(v[:1], len(v), axis=0) if k in pasts and len(v) > 1 else v) for k, v in feeds.items()}
            return run(feeds)

        return mixed


class BatchNudged(BatchRowsMixed):
    """ref-sim whose batch > 1 logits move by 1e-6 (a reduction order that depends on the batch size):
    within every band, but not byte-identical."""

    def prepare(self, model):
        run = self.inner.prepare(model)
        logits = model.graph.output[0].name

        def nudged(feeds):
            names = [o.name for o in model.graph.output]
            out = list(run(feeds))
            i = names.index(logits)
            if np.shape(out[i])[0] > 1:
                out[i] = np.asarray(out[i]) + np.float32(1e-6)
            return out

        return nudged


def _batch_check(engine, name):
    from lockstep.conformance.golden.test_batches import test_batch_rows_match_their_batch_1_runs
    from lockstep.golden.catalog import builtin_models

    model = next(m for m in builtin_models() if m.name == name)
    test_batch_rows_match_their_batch_1_runs(engine, model)


def test_a_batch_whose_rows_share_a_cache_fails_the_batch_check_and_ref_sim_passes_it():
    """result: the check users run (conformance/golden/test_batches.py) passes the reference runtime
    and fails an engine whose batch rows read one row's cache; an engine declaring batch invariance
    fails on a 1e-6 batch-dependent drift that the band would let through otherwise."""
    from lockstep.engines import load_engine

    _batch_check(load_engine("ref-sim"), "small-fp32-standard")
    with pytest.raises(AssertionError, match="row 1 of a batch of 3 .* leaves its batch-1 run"):
        _batch_check(BatchRowsMixed(), "small-fp32-standard")
    _batch_check(BatchNudged(), "small-fp32-standard")  # within the band: no invariance declared
    with pytest.raises(AssertionError, match="declares batch invariance"):
        _batch_check(BatchNudged(declares_invariance=True), "small-fp32-standard")


def test_a_batch_row_may_flip_a_near_tie_its_band_allows_and_nothing_more():
    """contract (no false alarm, seen on ort-cuda-tf32, phi3 exports, on an H100): a row whose
    token flips at a step where its logits are within band of its batch-1 run's passes, and the
    steps after the flip (different tokens fed) are not compared; a flip at logits outside the band
    fails, and so does any flip or byte difference where the engine declares batch invariance."""
    from lockstep.conformance.golden.test_batches import row_departs
    from lockstep.decoding import DecodeResult

    def run(tokens, logits):
        return DecodeResult([1], tokens, [np.asarray(x, np.float32) for x in logits])

    alone = run([2, 0, 1], [[0, 0, 1], [1.0, 0.999, 0], [0, 5, 0]])
    near_flip = run([2, 1, 0], [[0, 0, 1], [0.999, 1.0, 0], [9, 0, 0]])  # step 2 differs by 9: after the flip
    assert row_departs(near_flip, alone, band=0.01, invariant=False) is None
    assert "band 0.01, steps 0..1" in row_departs(run([2, 1, 1], [[0, 0, 1], [0.5, 1.0, 0], [0, 5, 0]]), alone,
                                                  band=0.01, invariant=False)
    assert "max |logit difference| 9 at step 2" in row_departs(run([2, 0, 0], [[0, 0, 1], [1.0, 0.999, 0], [9, 5, 0]]),
                                                               alone, band=0.01, invariant=False)
    assert "declares batch invariance" in row_departs(near_flip, alone, band=0.0, invariant=True)
    assert row_departs(alone, alone, band=0.0, invariant=True) is None
