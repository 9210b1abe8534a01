"""Capture on/off byte identity on the golden models with a fixed-capacity cache:
``pytest conformance/ -m capture``.

The same decode through the same engine, once eager and once with the one-token step captured
into the PRIMARY slot and replayed: the token ids and the bytes of every step's logits must be
identical. Each run proves which path it took (the "on" run: one capture, a replay per step after
the warm-up, no fallback; the "off" run: no capture, no replay), so the comparison cannot pass
with capture silently off. Capture is chosen per decoder, never by a process-wide switch.
"""

from __future__ import annotations

import hashlib

import onnx
import pytest

from golden.anchors import MODEL_DIR
from golden.models.spec import PROMPT, VARIANTS
from reference_runtime.decode import greedy, make_decoder

FIXED = sorted(n for n, s in VARIANTS.items() if s.kv_capacity)
TOKENS = 12
# after the prompt: decode (1 token) and verify (3 teacher-forced tokens) steps, alternating
ALTERNATION = [[66], [67, 68, 69], [70], [71, 72, 73], [74], [75, 76, 77], [78]]


def _digest(result):
    return [hashlib.sha256(l.tobytes()).hexdigest() for l in result.step_logits]


@pytest.mark.capture
@pytest.mark.parametrize("model", FIXED)
def test_capture_on_off_byte_identity(engine, model):
    if not engine.name.startswith("ref-"):
        pytest.skip(f"unsupported: {engine.name}: engine-side capture of decode is implemented for the reference engines")
    proto = onnx.load(str(MODEL_DIR / f"{model}.onnx"))
    prompt = list(PROMPT.encode())
    off = greedy(make_decoder(engine.name, proto, capture=False), prompt, TOKENS)
    on_decoder = make_decoder(engine.name, proto, capture=True)
    on = greedy(on_decoder, prompt, TOKENS)
    assert on_decoder.capture_fallback is None, f"contract: the step must capture ({on_decoder.capture_fallback})"
    # prefill, one eager warm-up step, then TOKENS - 2 steps replayed (the first right after its capture)
    assert on.counters["captures"] == 1 and on.counters["replays"] == TOKENS - 2, "contract: capture was really on"
    assert off.counters["captures"] == 0 and off.counters["replays"] == 0, "contract: capture was really off"
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
