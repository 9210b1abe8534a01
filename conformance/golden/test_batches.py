"""Batches: a model's prompts decoded as one batch through an engine (``lockstep.decoding.batched``:
the engine's ``prepare``, batch B on every input and cache) give each row its batch-1 run's tokens, and
logits within the model's near-tie band of it; byte-identical where the engine declares
``batch_invariant = True``. A difference is rows mixed (a kernel reading another row, a cache or
scratch buffer shared across the batch) or a result that depends on the batch size beyond the
engine's error model (the batch-size drift serving stacks fight). The rows are one length (no
padding). Runs with ``-m golden``; an engine without ``prepare`` or a model without a batch axis is a
skip with its reason."""

from __future__ import annotations

import numpy as np
import pytest

from lockstep.decoding import batched
from lockstep.engines import Unsupported, capabilities, precision_of, unsupported_reason
from lockstep.golden.anchors import band_for

TOKENS = 4  # a mixed row shows at the prefill's logits or the first step after it
ROWS = 3


def batch_prompts(prompt: list[int]) -> list[list[int]]:
    """``ROWS`` prompts of the snapshot prompt's length, each other's: the prompt, rotated, reversed
    (rows that differ from the first position on, so a row read in place of another shows)."""
    return [list(prompt), list(prompt[1:]) + list(prompt[:1]), list(prompt[::-1])][:ROWS]


@pytest.mark.golden
def test_batch_rows_match_their_batch_1_runs(engine, golden_model):
    proto = golden_model.load()
    io = golden_model.io(proto)
    snap = golden_model.snapshot()
    prompts = batch_prompts(list(snap["prompt"]))
    try:
        together = batched(engine, proto, prompts, TOKENS, io=io)
        alone = [batched(engine, proto, [p], TOKENS, io=io)[0] for p in prompts]
    except Unsupported as exc:
        pytest.skip(unsupported_reason(engine.name, exc))
    invariant = capabilities(engine).batch_invariant
    band = 0.0 if invariant else band_for(snap, precision_of(engine, golden_model.dtype))
    for k, (t, a) in enumerate(zip(together, alone)):
        diffs = [float(np.max(np.abs(np.asarray(x, np.float64) - np.asarray(y, np.float64))))
                 for x, y in zip(t.step_logits, a.step_logits)]
        worst = max(range(len(diffs)), key=diffs.__getitem__)
        if invariant:
            same = all(np.asarray(x).tobytes() == np.asarray(y).tobytes() for x, y in zip(t.step_logits, a.step_logits))
        else:
            same = diffs[worst] <= band
        assert t.tokens == a.tokens and same, (
            f"result: row {k} of a batch of {len(prompts)} on {engine.name} ({golden_model.name}) leaves its batch-1 "
            f"run: tokens {t.tokens} vs {a.tokens}; max |logit difference| {diffs[worst]:.6g} at step {worst} "
            + ("(the engine declares batch invariance: bytes must match)" if invariant else f"(band {band:.4g})")
            + ": rows mixed, or a result that depends on the batch size")
