"""Batches: a model's prompts decoded as one batch through an engine (``lockstep.decoding.batched``:
the engine's ``prepare``, batch B on every input and cache) give each row its batch-1 run's tokens, and
logits within the model's near-tie band of it (up to the first step whose tokens differ: a flip the band
allows is a near-tie of a prompt the snapshot does not hold); byte-identical where the engine declares
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
        why = row_departs(t, a, band, invariant)
        assert why is None, (f"result: row {k} of a batch of {len(prompts)} on {engine.name} ({golden_model.name}) "
                             f"leaves its batch-1 run: {why}: rows mixed, or a result that depends on the batch size")


def row_departs(row, alone, band: float, invariant: bool) -> str | None:
    """Why a batch row's decode leaves its batch-1 run, or None. Compared up to the first step whose
    tokens differ (past it the two runs feed different tokens); a flip there whose logits are within
    band is a near-tie the engine's error model allows (these prompts are not the snapshot's, whose
    near-ties are known). An engine that declares batch invariance must match bytes and never flip."""
    upto = next((i for i, (x, y) in enumerate(zip(row.tokens, alone.tokens)) if x != y), len(row.tokens) - 1)
    pairs = list(zip(row.step_logits, alone.step_logits))[:upto + 1]
    diffs = [float(np.max(np.abs(np.asarray(x, np.float64) - np.asarray(y, np.float64)))) for x, y in pairs]
    worst = max(range(len(diffs)), key=diffs.__getitem__)
    said = f"tokens {row.tokens} vs {alone.tokens}; max |logit difference| {diffs[worst]:.6g} at step {worst}"
    if invariant:
        same = row.tokens == alone.tokens and all(np.asarray(x).tobytes() == np.asarray(y).tobytes() for x, y in pairs)
        return None if same else f"{said} (the engine declares batch invariance: bytes must match)"
    return None if diffs[worst] <= band else f"{said} (band {band:.4g}, steps 0..{upto})"
