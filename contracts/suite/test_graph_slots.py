"""The reference runtime's two graph slots on a golden model: decode and verify steps alternate,
each signature captured once and replayed from its own slot (``pytest contracts/suite -m capture``)."""

from __future__ import annotations

import onnx
import pytest

from lockstep.golden.anchors import MODEL_DIR
from lockstep.golden.models.spec import PROMPT, VARIANTS

FIXED = sorted(n for n, s in VARIANTS.items() if s.kv_capacity)
# after the prompt: decode (1 token) and verify (3 teacher-forced tokens) steps, alternating
ALTERNATION = [[66], [67, 68, 69], [70], [71, 72, 73], [74], [75, 76, 77], [78]]


@pytest.mark.capture
@pytest.mark.parametrize("model", FIXED)
def test_decode_and_verify_graphs_alternate(ref_engine, model):
    """Decode steps (one token) and verify steps (k=3 teacher-forced tokens) alternate: each step
    signature is captured once (the whole fixed-capacity step: one segment) and keeps replaying its
    own graph (neither invalidates the other), and every logits byte equals the eager run of the
    same sequence."""
    proto = onnx.load(str(MODEL_DIR / f"{model}.onnx"))
    prompt = list(PROMPT.encode())

    def run(capture):
        dec = ref_engine.decoder(proto, capture=capture)
        dec.reset()
        outs = [dec.forward(prompt)]
        for chunk in ALTERNATION:
            outs.append(dec.forward(chunk))
        return dec, outs

    eager_dec, eager = run(False)
    dec, captured = run(True)
    counters = dec.counters()
    c = counters["capture"]
    assert dec.capture_fallback is None and c["fallbacks"] == 0
    assert c["segments"] == 1, "contract: nothing in a fixed-capacity step grows: the whole step is one segment"
    assert c["captures"] == 2, "contract: each signature (decode, verify) captured once"
    assert c["replays"] == 3 + 2, (
        "contract: after one eager warm-up each, every later step replayed its own graph "
        "(4 decode steps: 3 replays; 3 verify steps: 2; the step that records replays right away)")
    assert [a.tobytes() for a in captured] == [a.tobytes() for a in eager], "result: byte-identical to eager"
