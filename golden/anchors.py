"""Golden anchors: what the fp32 oracle says at every position of a canonical context.

A snapshot (``golden/snapshots/<model>.json``) holds, for one golden model:
- provenance: the model file's sha256, generator version, the oracle's name and version, dtype;
- the canonical context: the prompt plus a recorded prefix (the oracle's greedy continuation),
  stored, never rebuilt from a live stream;
- per position from the last prompt token on: the oracle's top-1 and top-2 tokens and their margin;
- the near-tie band per engine dtype, from the error model below.

Error model (``near_tie_band``): an engine computing in a precision (``lockstep.engines.PRECISIONS``:
activation storage ``s``, matrix-product operands ``o``, accumulation ``a``) perturbs a logit of
scale ``L`` by about ``L * (R * (layers + 1) * (u_s + u_o) + sqrt(K) * u_a)``, with ``R = 6``
roundings per layer (norm, q/k/v, attention, output projection, MLP, residual), ``u_o`` counted
only where operands are rounded below their storage format (TF32), and ``K`` the longest dot
product. The band is ``KAPPA = 2`` times that (both compared logits carry it). A snapshot holds a
band per precision that applies to its model's dtype (storage no finer than the model's);
positions whose oracle margin lies inside the band of the engine's declared precision are
near-ties for that engine.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import os
import tempfile
from pathlib import Path
from typing import Any, Callable

import numpy as np

from lockstep.engines.protocol import PRECISIONS

from .models.spec import GENERATOR_VERSION, PROMPT, VARIANTS, ModelSpec
from .oracle import ORACLE, decomposed_twin, float64_logits, greedy_oracle, oracle_logits

__all__ = [
    "SNAPSHOT_DIR", "MODEL_DIR", "PREFIX_TOKENS", "near_tie_band", "precisions_for", "band_for", "compute_anchors", "load_snapshot",
    "snapshot_text", "write_snapshot", "diff_snapshots", "same_anchors", "INFORMATIONAL", "model_sha256", "OracleDisagreement",
]

ROOT = Path(__file__).resolve().parent
SNAPSHOT_DIR = ROOT / "snapshots"
MODEL_DIR = ROOT / "models"
PREFIX_TOKENS = 24
SNAPSHOT_FORMAT = 2  # 2: bands per precision (1: per model dtype)

UNIT_ROUNDOFF = {"float32": 2.0**-24, "tf32": 2.0**-11, "float16": 2.0**-11, "bfloat16": 2.0**-8}
ROUNDINGS_PER_LAYER = 6
KAPPA = 2.0


def precisions_for(dtype: str) -> list[str]:
    """The precisions an engine may compute a model of ``dtype`` in: storage no finer than the model's."""
    return [p for p, (storage, _, _) in PRECISIONS.items() if UNIT_ROUNDOFF[storage] >= UNIT_ROUNDOFF[dtype]]


class OracleDisagreement(RuntimeError):
    """The oracle and its float64 cross-check disagree: regeneration refuses to write."""


def near_tie_band(spec: ModelSpec, precision: str, logit_scale: float) -> float:
    storage, operand, accum = PRECISIONS[precision]
    u_s = max(UNIT_ROUNDOFF[storage], UNIT_ROUNDOFF[spec.dtype])
    u_o = UNIT_ROUNDOFF[operand] if UNIT_ROUNDOFF[operand] > u_s else 0.0
    k = max(spec.d_model, spec.q_dim, spec.d_ff)
    rel = ROUNDINGS_PER_LAYER * (spec.n_layers + 1) * (u_s + u_o) + math.sqrt(k) * UNIT_ROUNDOFF[accum]
    return KAPPA * logit_scale * rel


def band_for(snap: dict[str, Any], precision: str) -> float:
    """The near-tie band of ``precision`` in a snapshot; a clear error where it has none."""
    bands = snap.get("band", {})
    if precision not in bands:
        raise ValueError(f"{snap.get('model')}: no near-tie band for precision {precision!r} "
                         f"(the snapshot has {sorted(bands)}: a {snap.get('provenance', {}).get('dtype')} model "
                         "cannot be computed in a finer precision than its own; an older snapshot format is "
                         "regenerated with `lockstep golden regenerate`)")
    return bands[precision]


def model_sha256(name: str) -> str:
    path = MODEL_DIR / f"{name}.onnx"
    if not path.is_file():
        raise FileNotFoundError(f"golden model {path} is missing: run `python -m lockstep.golden.models --write`")
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _prompt(spec: ModelSpec) -> list[int]:
    return list((spec.near_tie.prompt if spec.near_tie else PROMPT).encode("utf-8"))


def compute_anchors(name: str, progress: Callable[[str], None] | None = None) -> dict[str, Any]:
    """Anchors for ``name`` from the oracle only (never from an engine under test)."""
    from .models.build import build

    say = progress or (lambda msg: None)
    spec = VARIANTS[name]
    # The oracle runs standard ONNX ops: a genai model's oracle is its standard-flavour twin (same
    # dequantized int4 weights, same function), since onnx's evaluator has no contrib ops.
    flavour = "standard" if spec.flavour == "genai" else spec.flavour
    fp32 = build(dataclasses.replace(spec, dtype="float32", flavour=flavour))
    prompt = _prompt(spec)
    say(f"{name}: oracle greedy prefix ({PREFIX_TOKENS} tokens)")
    prefix = greedy_oracle(fp32, prompt, PREFIX_TOKENS)
    context = prompt + prefix
    say(f"{name}: oracle logits over the canonical context ({len(context)} tokens)")
    logits = oracle_logits(fp32, context)
    say(f"{name}: float64 cross-check on the reference runtime")
    cross = float64_logits(decomposed_twin(spec), context)
    scale = float(np.abs(logits).max())
    bands = {p: near_tie_band(spec, p, scale) for p in precisions_for(spec.dtype)}
    fp32_band = near_tie_band(dataclasses.replace(spec, dtype="float32"), "fp32", scale)
    start = len(prompt) - 1
    positions = []
    for i in range(start, len(context) - 1):
        row = logits[i]
        order = np.argsort(-row, kind="stable")
        top1, top2 = int(order[0]), int(order[1])
        margin = float(row[top1] - row[top2])
        if top1 != context[i + 1]:
            raise OracleDisagreement(f"{name}: position {i}: the oracle's argmax {top1} is not its own greedy token")
        diff = float(np.abs(row - cross[i]).max())
        if diff > fp32_band or (margin > fp32_band and int(np.argmax(cross[i])) != top1):
            raise OracleDisagreement(
                f"{name}: position {i}: oracle and float64 cross-check differ by {diff:.3g} "
                f"(fp32 band {fp32_band:.3g}); refusing to write anchors"
            )
        positions.append({"pos": i, "top1": top1, "top2": top2, "margin": round(margin, 6)})
    return {
        "format": SNAPSHOT_FORMAT,
        "model": name,
        "provenance": {
            "model_sha256": model_sha256(name),
            "generator_version": GENERATOR_VERSION,
            "oracle": ORACLE["name"],
            "oracle_version": ORACLE["version"],
            "crosscheck": "lockstep ref-sim, float64, decomposed flavour",
            "dtype": spec.dtype,
        },
        "prompt": prompt,
        "prefix": prefix,
        "start": start,
        "logit_scale": round(scale, 4),
        "band": {d: float(f"{b:.4g}") for d, b in bands.items()},
        "positions": positions,
    }


def snapshot_text(data: dict[str, Any]) -> str:
    """The one serialization of a snapshot, shared by regeneration and syrupy's --snapshot-update."""
    return json.dumps(data, indent=1, sort_keys=True) + "\n"


def load_snapshot(name: str) -> dict[str, Any]:
    path = SNAPSHOT_DIR / f"{name}.json"
    if not path.is_file():
        raise FileNotFoundError(f"no golden snapshot {path}: run `lockstep golden regenerate --model {name}`")
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as exc:
        raise ValueError(f"golden snapshot {path} is corrupt ({exc}); regenerate it") from exc


def write_snapshot(data: dict[str, Any]) -> Path:
    SNAPSHOT_DIR.mkdir(parents=True, exist_ok=True)
    path = SNAPSHOT_DIR / f"{data['model']}.json"
    fd, tmp = tempfile.mkstemp(dir=SNAPSHOT_DIR, suffix=".tmp")
    with os.fdopen(fd, "w") as f:
        f.write(snapshot_text(data))
    os.replace(tmp, path)  # atomic: a crash never leaves half a snapshot
    return path


FLOAT_RTOL = 1e-4


# Provenance that informs but does not decide: a patch release of onnx on another machine (the
# H200 has 1.23.1) must not fail an oracle whose anchors still agree within tolerance.
INFORMATIONAL = {"oracle_version"}


def same_anchors(a: Any, b: Any) -> bool:
    """Equal as golden data: floats within FLOAT_RTOL, tokens and provenance exact, INFORMATIONAL keys ignored."""
    if isinstance(a, float) or isinstance(b, float):
        try:
            return abs(float(a) - float(b)) <= FLOAT_RTOL * max(1.0, abs(float(a)), abs(float(b)))
        except (TypeError, ValueError):
            return False
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(k in INFORMATIONAL or same_anchors(a[k], b[k]) for k in a)
    if isinstance(a, list) and isinstance(b, list):
        return len(a) == len(b) and all(same_anchors(x, y) for x, y in zip(a, b))
    return a == b


def diff_snapshots(old: dict[str, Any] | None, new: dict[str, Any]) -> list[str]:
    """Human-readable changes: provenance, context, and per-position tokens and margins."""
    if old is None:
        return [f"new snapshot: {len(new['positions'])} positions"]
    out = []
    if old.get("format") != new.get("format"):
        out.append(f"format: {old.get('format')} -> {new.get('format')}")
    if old.get("band") != new.get("band"):
        out.append(f"band: {old.get('band')} -> {new.get('band')}")
    for k, v in new["provenance"].items():
        if old.get("provenance", {}).get(k) != v:
            note = " (informational)" if k in INFORMATIONAL else ""
            out.append(f"provenance.{k}: {old.get('provenance', {}).get(k)!r} -> {v!r}{note}")
    if old.get("prefix") != new["prefix"]:
        out.append(f"prefix: {old.get('prefix')} -> {new['prefix']}")
    olds = {p["pos"]: p for p in old.get("positions", [])}
    for p in new["positions"]:
        o = olds.get(p["pos"])
        if o is None:
            out.append(f"pos {p['pos']}: new (top1 {p['top1']}, margin {p['margin']})")
        elif (o["top1"], o["top2"]) != (p["top1"], p["top2"]) or abs(o["margin"] - p["margin"]) > 1e-5:
            out.append(f"pos {p['pos']}: top1 {o['top1']}->{p['top1']} top2 {o['top2']}->{p['top2']} "
                       f"margin {o['margin']}->{p['margin']}")
    return out
