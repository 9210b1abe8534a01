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
