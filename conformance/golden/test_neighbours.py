"""Neighbouring sessions: two decode sessions of one engine on one model, advanced step by step in
turn (``lockstep.decoding.interleaved``), each give their solo run's tokens, and logits within the
model's near-tie band of it (byte-identical on an engine that computes each session alone, as every
engine here does: the band only keeps a correct engine whose kernels vary run to run from failing).
A difference is state one session left in another: a shared cache or scratch buffer, the
cross-request leak serving engines ship. Runs with ``-m golden``; an engine that cannot open a
session for the model is a skip with its reason."""

from __future__ import annotations

import numpy as np
import pytest

from lockstep.decoding import greedy, interleaved, open_session
from lockstep.engines import Unsupported, precision_of, unsupported_reason
from lockstep.golden.anchors import band_for

TOKENS = 4  # a leak shows at the first step after both prefills: a neighbour wrote over the cache


@pytest.mark.golden
def test_interleaved_sessions_match_their_solo_runs(engine, golden_model):
    proto = golden_model.load()
    io = golden_model.io(proto)
    snap = golden_model.snapshot()
    prompts = [list(snap["prompt"]), list(snap["prompt"][1:]) + list(snap["prefix"][:3])]  # two contexts
    try:
        together = interleaved([open_session(engine, proto, io=io) for _ in prompts], prompts, TOKENS, io=io)
        alone = [greedy(open_session(engine, proto, io=io), p, TOKENS) for p in prompts]
    except Unsupported as exc:
        pytest.skip(unsupported_reason(engine.name, exc))
    band = band_for(snap, precision_of(engine, golden_model.dtype))
    for k, (t, a) in enumerate(zip(together, alone)):
        diffs = [float(np.max(np.abs(np.asarray(x, np.float64) - np.asarray(y, np.float64))))
                 for x, y in zip(t.step_logits, a.step_logits)]
        worst = max(range(len(diffs)), key=diffs.__getitem__)
        assert t.tokens == a.tokens and diffs[worst] <= band, (
            f"result: session {k} of {engine.name} on {golden_model.name}, run beside another, leaves its solo run: "
            f"tokens {t.tokens} vs {a.tokens}; max |logit difference| {diffs[worst]:.6g} at step {worst} "
            f"(band {band:.4g}): state shared between sessions")
