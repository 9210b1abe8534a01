"""Golden token locks: an engine against the oracle's anchors.

- ``check_provenance``: the snapshot belongs to this model file and came from the oracle; a model
  whose sha256 moved fails with "model changed: regenerate", never with a token diff.
- ``teacher_forced_lock`` (fatal): over the canonical context, at every position whose oracle
  margin lies outside the near-tie band of the engine's declared precision, the engine's argmax is the anchor and its
  margin (anchor minus best other) agrees with the oracle's within twice the band. Runs as one
  prefill, step by step through the decode path, or as verify steps (k tokens a step after the
  prompt's prefill: a speculative decoder's check of its draft).
- ``tripwire``: the engine's autoregressive greedy stream against the recorded prefix. A first
  divergence at a near-tie position to one of its candidates (the tokens within the band of the
  oracle's top-1, recorded since snapshot format 4: ``anchors.allowed_at``) is reported, not fatal;
  any other token, or a divergence anywhere else, is fatal. The teacher-forced lock holds a
  near-tie position's argmax to the same set.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

from lockstep.errors import LockstepError
from .anchors import allowed_at, band_for, model_sha256
from .models.spec import GENERATOR_VERSION
from .oracle import ORACLE

__all__ = ["ModelChanged", "NotFromOracle", "check_provenance", "LockResult", "teacher_forced_lock",
           "TripResult", "tripwire"]


class ModelChanged(LockstepError, AssertionError):
    """The golden model no longer matches the snapshot's provenance: regenerate."""


class NotFromOracle(LockstepError, AssertionError):
    """The snapshot's anchors did not come from the oracle (an engine is never its own yardstick)."""


def check_provenance(snap: dict[str, Any]) -> None:
    prov = snap.get("provenance", {})
    if prov.get("oracle") != ORACLE["name"]:
        raise NotFromOracle(f"{snap.get('model')}: anchors came from {prov.get('oracle')!r}, not {ORACLE['name']}")
    sha = model_sha256(snap["model"])
    if prov.get("model_sha256") != sha or prov.get("generator_version") != GENERATOR_VERSION:
        raise ModelChanged(
            f"model changed: regenerate ({snap['model']}: snapshot sha256 {str(prov.get('model_sha256'))[:12]}…, "
            f"file {sha[:12]}…; generator {prov.get('generator_version')} vs {GENERATOR_VERSION}). "
            f"Run `lockstep golden regenerate --model {snap['model']}` and review the diff."
        )


@dataclass
class LockResult:
    mode: str
    checked: int = 0
    near_ties: int = 0
    violations: list[dict[str, Any]] = field(default_factory=list)
    band: float = 0.0
    positions: list[int] = field(default_factory=list)
    oracle_margins: list[float] = field(default_factory=list)
    engine_margins: list[float | None] = field(default_factory=list)  # None: a near-tie, not checked

    def plot_data(self, model: str, engine: str, precision: str) -> dict[str, Any]:
        """What the report's golden plot needs (conformance/plots.py)."""
        return {"model": model, "mode": self.mode, "engine": engine, "precision": precision, "band": self.band,
                "positions": self.positions, "oracle_margins": self.oracle_margins,
                "engine_margins": self.engine_margins, "violations": [v["pos"] for v in self.violations]}

    @property
    def ok(self) -> bool:
        return self.checked > 0 and not self.violations

    def describe(self) -> str:
        """The first diverging position first (where to look), then how many more."""
        if not self.violations:
            return f"{self.checked} positions checked, {self.near_ties} near-ties skipped"
        v = self.violations[0]
        if v["kind"] == "argmax":
            first = (f"first divergence at position {v['pos']}: the engine's argmax is {v['engine']}, the anchor "
                     f"{v['anchor']} (oracle margin {v['oracle_margin']}, engine margin {v['engine_margin']})")
        elif v["kind"] == "off-set":
            first = (f"first divergence at position {v['pos']}, a near-tie: the engine's argmax is {v['engine']}, "
                     f"none of the tokens within the band {v['band']} of the oracle's top-1 {v['allowed']}")
        else:
            first = (f"first divergence at position {v['pos']}: anchor {v['anchor']} kept but its margin is "
                     f"{v['engine_margin']} where the oracle's is {v['oracle_margin']} (band {v['band']})")
        more = len(self.violations) - 1
        return first + (f"; {more} more of {self.checked} checked positions diverge" if more else "")


def teacher_forced_lock(session, snap: dict[str, Any], precision: str, *, stepwise: bool = False,
                        verify: int = 0) -> LockResult:
    """``session``: a decode session (``lockstep.engines.DecodeSession``); ``precision``: the
    engine's declared precision for the model's dtype, which selects the near-tie band. One prefill,
    ``stepwise`` (one token a step), or ``verify=k`` (the prompt as a prefill, then k tokens a step:
    the speculative verify width), each judged against the same anchors and bands."""
    from lockstep.decoding import teacher_force

    context = snap["prompt"] + snap["prefix"]
    band = band_for(snap, precision)
    logits = np.asarray(teacher_force(session, context[:-1], stepwise=stepwise, verify=verify,
                                      prompt=len(snap["prompt"])), np.float64)
    res = LockResult("verify" if verify else "stepwise" if stepwise else "prefill", band=band)
    for entry in snap["positions"]:
        row = logits[entry["pos"]]
        anchor = entry["top1"]
        margin = float(row[anchor] - np.delete(row, anchor).max())
        res.positions.append(entry["pos"])
        res.oracle_margins.append(entry["margin"])
        if entry["margin"] <= band:
            res.near_ties += 1
            res.engine_margins.append(None)
            allowed, got = allowed_at(entry, band), int(np.argmax(row))
            if allowed is not None and got not in allowed:  # not one of the near-tie's outcomes: fatal
                res.violations.append({"pos": entry["pos"], "kind": "off-set", "anchor": anchor, "engine": got,
                                       "allowed": sorted(allowed), "oracle_margin": entry["margin"],
                                       "engine_margin": round(margin, 6), "band": band})
            continue
        res.checked += 1
        res.engine_margins.append(round(margin, 6))
        got = int(np.argmax(row))
        if got != anchor:
            res.violations.append({"pos": entry["pos"], "kind": "argmax", "anchor": anchor, "engine": got,
                                   "oracle_margin": entry["margin"], "engine_margin": round(margin, 6)})
        elif abs(margin - entry["margin"]) > 2 * band:
            res.violations.append({"pos": entry["pos"], "kind": "margin", "anchor": anchor,
                                   "oracle_margin": entry["margin"], "engine_margin": round(margin, 6),
                                   "band": band})
    return res


@dataclass
class TripResult:
    tokens: list[int]
    divergence: dict[str, Any] | None = None

    @property
    def fatal(self) -> bool:
        return self.divergence is not None and not self.divergence["near_tie"]


def tripwire(session, snap: dict[str, Any], precision: str) -> TripResult:
    from lockstep.decoding import greedy

    prefix = snap["prefix"]
    band = band_for(snap, precision)
    result = greedy(session, snap["prompt"], len(prefix))
    for i, (want, got) in enumerate(zip(prefix, result.tokens)):
        if want != got:
            entry = snap["positions"][i]
            row = result.step_logits[i]
            allowed = allowed_at(entry, band)
            # a near-tie outcome: the position is a near-tie and the token one of its candidates (any,
            # where the snapshot cannot say which); another token there is as fatal as anywhere else
            near_tie = entry["margin"] <= band and (allowed is None or got in allowed)
            return TripResult(result.tokens, {
                "pos": entry["pos"], "recorded": want, "engine_token": got,
                "oracle_margin": entry["margin"], "band": band, "near_tie": near_tie,
                "allowed": sorted(allowed) if allowed is not None else None,
                "engine_logit_gap": round(float(row[got] - row[want]), 6),
            })
    return TripResult(result.tokens)
