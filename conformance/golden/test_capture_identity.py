"""Capture on/off byte identity on every golden model: ``pytest conformance/ -m capture``.

The same decode through the same engine, once eager and once captured: with a fixed-capacity
cache the one-token step is one graph in the PRIMARY slot; with a growing cache each step runs
as captured segments (one graph each) and eager seams. The token ids and the bytes of every step's
logits must be identical. Each run proves which path it took (the "on" run: its captures, a replay
per segment per step after the warm-up, no fallback; the "off" run: no capture, no replay), so
the comparison cannot pass with capture silently off. Capture is chosen per decoder, never by a
process-wide switch.
"""

from __future__ import annotations

import hashlib

import onnx
import pytest

from lockstep.golden.anchors import MODEL_DIR
from lockstep.golden.models.spec import PROMPT, VARIANTS
from lockstep.reference_runtime.decode import greedy, make_decoder

FIXED = sorted(n for n, s in VARIANTS.items() if s.kv_capacity)
ALL = sorted(VARIANTS)
TOKENS = 12
# after the prompt: decode (1 token) and verify (3 teacher-forced tokens) steps, alternating
ALTERNATION = [[66], [67, 68, 69], [70], [71, 72, 73], [74], [75, 76, 77], [78]]


def _digest(result):
    return [hashlib.sha256(l.tobytes()).hexdigest() for l in result.step_logits]


@pytest.mark.capture
@pytest.mark.parametrize("model", ALL)
def test_capture_on_off_byte_identity(engine, model):
    if engine.name == "ort-cpu":
        pytest.skip("unsupported: ort-cpu: ONNX Runtime's graphs are CUDA graphs (CUDA execution provider)")
    proto = onnx.load(str(MODEL_DIR / f"{model}.onnx"))
    prompt = list(PROMPT.encode())
    if engine.name.startswith("ort-"):
        if not VARIANTS[model].kv_capacity:
            pytest.skip(f"unsupported: {engine.name}: ONNX Runtime's CUDA graphs need fixed shapes (a fixed-capacity cache)")
        off = greedy(make_decoder(engine.name, proto, capture=False), prompt, TOKENS)
        on_decoder = make_decoder(engine.name, proto, capture=True)
        on = greedy(on_decoder, prompt, TOKENS)
        options = on_decoder.sess.get_provider_options()["CUDAExecutionProvider"]
        assert options.get("enable_cuda_graph") in ("1", "True", "true"), "contract: CUDA graphs were really on"
        assert sum(on_decoder.graph_runs.values()) == TOKENS - 1, "contract: every one-token step ran under a graph id"
        assert on.tokens == off.tokens and _digest(on) == _digest(off), "result: byte-identical to the plain run"
        return
    off = greedy(make_decoder(engine.name, proto, capture=False), prompt, TOKENS)
    on_decoder = make_decoder(engine.name, proto, capture=True)
    on = greedy(on_decoder, prompt, TOKENS)
    assert on_decoder.capture_fallback is None, f"contract: the step must capture ({on_decoder.capture_fallback})"
    c = on.counters["capture"]
    # prefill, one eager warm-up step, then TOKENS - 2 steps replayed (the first right after its capture):
    # one graph per step with a fixed-capacity cache, one per segment with a growing one
    segments = 1 if VARIANTS[model].kv_capacity else c["segments"]
    assert segments >= 1 and c["captures"] == segments, "contract: capture was really on"
    assert c["replays"] == segments * (TOKENS - 2) and c["fallbacks"] == 0, "contract: every later step replayed"
    assert on.counters["replays"] == segments * (TOKENS - 2), "contract: the runtime launched those graphs"
    assert off.counters["captures"] == 0 and off.counters["replays"] == 0, "contract: capture was really off"
    assert off.counters["capture"]["captures"] == 0
    assert on.tokens == off.tokens, "result: token ids identical"
    assert _digest(on) == _digest(off), "result: every step's logits byte-identical"


@pytest.mark.capture
@pytest.mark.parametrize("model", FIXED)
def test_primary_and_verify_slots_alternate(engine, model):
    """Decode steps (PRIMARY, one token) and verify steps (VERIFY, k=3 teacher-forced tokens)
    alternate: both slots capture once and keep replaying (neither invalidates the other), and
    every logits byte equals the eager run of the same sequence."""
    if not engine.name.startswith("ref-"):
        pytest.skip(f"unsupported: {engine.name}: engine-side capture of decode is implemented for the reference engines")
    proto = onnx.load(str(MODEL_DIR / f"{model}.onnx"))
    prompt = list(PROMPT.encode())
    def run(capture):
        dec = make_decoder(engine.name, proto, capture=capture)
        dec.reset()
        outs = [dec.forward(prompt)]
        for chunk in ALTERNATION:
            outs.append(dec.forward(chunk))
        return dec, outs

    eager_dec, eager = run(False)
    dec, captured = run(True)
    counters = dec.counters()
    assert dec.capture_fallback is None
    assert counters["captures_by_slot"] == {"primary": 1, "verify": 1}, "contract: each slot captured once"
    assert counters["replays_by_slot"]["primary"] == 3 and counters["replays_by_slot"]["verify"] == 2, (
        "contract: after one eager warm-up each, every later step replayed its own slot"
    )
    assert [a.tobytes() for a in captured] == [a.tobytes() for a in eager], "result: byte-identical to eager"
