"""The conformance report: per-engine outcome counts and an op-by-engine table of gaps.

Written by the pytest plugin at session end when ``--lockstep-report-dir`` is given (``lockstep
check`` gives it): ``report.json`` (machine-readable) and ``report.md`` (the same as tables). Files
are written atomically.
"""

from __future__ import annotations

import json
import os
import tempfile
from collections import Counter, defaultdict
from pathlib import Path

__all__ = ["summarize", "write_report", "render_markdown"]

STATUSES = ("passed", "failed", "xfailed", "skipped")


def summarize(outcomes: dict[str, dict]) -> dict:
    per_engine: dict[str, Counter] = defaultdict(Counter)
    gaps: dict[str, Counter] = defaultdict(Counter)  # op -> engine -> non-passing node cases
    for nodeid, o in outcomes.items():
        engine = o.get("engine") or "-"
        status = o.get("outcome", "passed")
        per_engine[engine][status] += 1
        if status != "passed" and o.get("ops"):
            unavailable = "lockstep: unavailable: " in (o.get("reason") or "")
            if not unavailable:
                for op in o["ops"]:
                    gaps[op][engine] += 1
    return {
        "engines": {e: {s: c.get(s, 0) for s in STATUSES} for e, c in sorted(per_engine.items())},
        "gaps": {op: dict(sorted(c.items())) for op, c in sorted(gaps.items())},
    }


def render_markdown(summary: dict, engines: dict[str, dict] | None = None) -> str:
    lines = ["# lockstep conformance report", "", "| engine | " + " | ".join(STATUSES) + " |",
             "|---|" + "---|" * len(STATUSES)]
    for engine, counts in summary["engines"].items():
        lines.append(f"| {engine} | " + " | ".join(str(counts[s]) for s in STATUSES) + " |")
    if engines:
        lines += ["", "## Engines", "", "| engine | precision | details |", "|---|---|---|"]
        for name, info in engines.items():
            precision = ", ".join(f"{d}: {p}" for d, p in info.get("precision", {}).items()) or "default"
            details = ", ".join(f"{k} {v}" for k, v in info.items() if k != "precision")
            lines.append(f"| {name} | {precision} | {details} |")
    engines = sorted({e for c in summary["gaps"].values() for e in c})
    if engines:
        lines += ["", "## Gaps: node cases not passing, by operator and engine", "",
                  "| op | " + " | ".join(engines) + " |", "|---|" + "---|" * len(engines)]
        for op, c in summary["gaps"].items():
            lines.append(f"| {op} | " + " | ".join(str(c.get(e, "")) for e in engines) + " |")
    return "\n".join(lines) + "\n"


def _atomic_write(path: Path, text: str) -> None:
    fd, tmp = tempfile.mkstemp(dir=path.parent, suffix=".tmp")
    with os.fdopen(fd, "w") as f:
        f.write(text)
    os.replace(tmp, path)


def write_report(outcomes: dict[str, dict], report_dir: str, engines: dict[str, dict] | None = None) -> dict[str, str]:
    """``engines``: per selected engine, its declared precision and ``describe()`` (versions, options)."""
    out = Path(report_dir)
    out.mkdir(parents=True, exist_ok=True)
    summary = summarize(outcomes)
    _atomic_write(out / "report.json", json.dumps({"summary": summary, "engines": engines or {}, "tests": outcomes},
                                                  indent=1))
    md = render_markdown(summary, engines)
    _atomic_write(out / "report.md", md)
    return {"json": str(out / "report.json"), "markdown": str(out / "report.md")}
