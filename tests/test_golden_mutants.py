"""Proof the golden locks can fail: mutant engines break the fatal lock, the planted near-tie trips
the tripwire without failing, and provenance problems fail loudly instead of passing."""

from __future__ import annotations

import copy

import numpy as np
import onnx
import pytest
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
        for name, t in list(self.cache.items()):
            kv = self.rt.download(t)
            if kv.shape[2] >= 2:
                kv[:, :, -2] = kv[:, :, -1]
                self.rt.write(t, kv)
        return out


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


def test_the_real_decoder_passes_both_modes():
    snap = load_snapshot(FP32)
    dec = ref_decoder(FP32)
    for stepwise in (False, True):
        res = teacher_forced_lock(dec, snap, "fp32", stepwise=stepwise)
        assert res.ok and res.checked == len(snap["positions"]) - res.near_ties


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

    snap = load_snapshot(FP32)
    model = onnx.load(str(MODEL_DIR / f"{FP32}.onnx"))
    prompt, prefix = snap["prompt"], snap["prefix"]
    context = prompt + prefix
    rng = np.random.default_rng(0)
    logits = rng.normal(0.0, 4.0, (len(context), max(context) + 8)).astype(np.float32)
    for i in range(len(context) - 1):
        logits[i, context[i + 1]] = logits[i].max() + 1.0  # the oracle's greedy token, margin >= 1
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
