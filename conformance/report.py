"""The conformance report: per-engine counts, failures, environment, an op-by-engine table of gaps,
and pictures (golden margins, the op scoreboard).

Written by the pytest plugin at session end when ``--lockstep-report-dir`` is given (``lockstep
check`` gives it): ``report.json`` (machine-readable: summary, engines, environment, every test's
outcome), ``report.md`` (the same as tables, with the failing tests and their first message line;
also appended to ``$GITHUB_STEP_SUMMARY`` when that is set) and the PNG/HTML pictures
(``conformance/plots.py``). Only a run that happened writes one. ``merge`` combines the reports of
shards (``--lockstep-shard i/n`` on several machines) into one. Files are written atomically.
"""

from __future__ import annotations

import json
import os
import platform
import subprocess
import sys
from collections import Counter, defaultdict
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path

from lockstep.errors import LockstepError
from lockstep.paths import atomic_write

__all__ = ["summarize", "write_report", "render_markdown", "environment", "merge", "ReportError"]

STATUSES = ("passed", "failed", "xfailed", "skipped")
# the row of tests that run no engine: lockstep's own (runtime contracts, parity, the audit, oracle checks)
NO_ENGINE = "(no engine)"


class ReportError(LockstepError, ValueError):
    """A report cannot be read or merged; the message names the file."""


def summarize(outcomes: dict[str, dict]) -> dict:
    """Per engine: counts of each status; ``kinds``: its failed and xfailed tests by what failed
    (``wrong value``, ``error``, ``newly unsupported``: counted apart); ``gaps``: by operator."""
    per_engine: dict[str, Counter] = defaultdict(Counter)
    kinds: dict[str, dict[str, Counter]] = defaultdict(lambda: defaultdict(Counter))
    gaps: dict[str, Counter] = defaultdict(Counter)  # op -> engine -> non-passing node cases
    for _nodeid, o in outcomes.items():
        engine = o.get("engine") or NO_ENGINE
        status = o.get("outcome", "passed")
        per_engine[engine][status] += int(o.get("stands_for", 1))  # an unavailable engine's one skip for many
        if status in ("failed", "xfailed"):
            kinds[engine][status][o.get("failure") or "error"] += 1
        ops = [o["op"]] if o.get("op") else o.get("ops", [])  # the op the case is about
        if status != "passed" and ops:
            unavailable = "lockstep: unavailable: " in (o.get("reason") or "")
            if not unavailable:
                for op in ops:
                    gaps[op][engine] += 1
    return {
        "engines": {e: {s: c.get(s, 0) for s in STATUSES} for e, c in sorted(per_engine.items())},
        "kinds": {e: {s: dict(sorted(c.items())) for s, c in sorted(k.items())} for e, k in sorted(kinds.items())},
        "gaps": {op: dict(sorted(c.items())) for op, c in sorted(gaps.items())},
    }


def _version(dist: str) -> str | None:
    try:
        return version(dist)
    except PackageNotFoundError:
        return None


def environment() -> dict[str, str]:
    """Versions and commit of this run: Python, numpy, ml_dtypes, onnx, ONNX Runtime, CuPy, CUDA (runtime and
    driver, read only when CuPy is already loaded: a report never initialises a GPU), lockstep."""
    env = {"python": platform.python_version(), "platform": platform.platform(terse=True),
           "lockstep": _version("lockstep-conformance") or "not installed"}
    for dist in ("numpy", "ml_dtypes", "onnx", "onnxruntime", "onnxruntime-gpu", "cupy-cuda13x", "cupy-cuda12x"):
        got = _version(dist)
        if got:
            env[dist] = got
    cupy = sys.modules.get("cupy")
    if cupy is not None:
        try:
            env["cuda runtime"] = str(cupy.cuda.runtime.runtimeGetVersion())
            env["cuda driver"] = str(cupy.cuda.runtime.driverGetVersion())
        except Exception as exc:  # a poisoned or absent context: say so, never fail the report
            env["cuda"] = f"unreadable ({type(exc).__name__})"
    commit = os.environ.get("LOCKSTEP_COMMIT") or os.environ.get("GITHUB_SHA")
    if not commit:
        try:
            commit = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True, timeout=5,
                                    check=True).stdout.strip()
        except (OSError, subprocess.SubprocessError):
            commit = ""
    env["commit"] = commit or "unknown (not a git checkout; set LOCKSTEP_COMMIT)"
    return env


def render_markdown(summary: dict, engines: dict[str, dict] | None = None, outcomes: dict[str, dict] | None = None,
                    env: dict[str, str] | None = None) -> str:
    lines = ["# lockstep conformance report", "", "| engine | " + " | ".join(STATUSES) + " |",
             "|---|" + "---|" * len(STATUSES)]
    for engine, counts in summary["engines"].items():
        lines.append(f"| {engine} | " + " | ".join(str(counts[s]) for s in STATUSES) + " |")
    kinds = summary.get("kinds") or {}
    if kinds:
        lines += ["", "Failed and known-failing (xfailed) tests by what failed: a wrong value (outside its tolerance "
                  "or band), an error (the engine raised), a test the engine newly cannot run.", "",
                  "| engine | failed: wrong values | failed: errors | failed: newly unsupported "
                  "| xfailed: wrong values | xfailed: errors |", "|---|---|---|---|---|---|"]
        for engine, k in kinds.items():
            f, x = k.get("failed", {}), k.get("xfailed", {})
            lines.append(f"| {engine} | {f.get('wrong value', 0)} | {f.get('error', 0)} | {f.get('newly unsupported', 0)} "
                         f"| {x.get('wrong value', 0)} | {x.get('error', 0)} |")
    failed = {k: o for k, o in (outcomes or {}).items() if o.get("outcome") == "failed"}
    if failed:
        lines += ["", f"## Failures ({len(failed)})", ""]
        for nodeid, o in list(failed.items())[:200]:
            kind = f" ({o['failure']})" if o.get("failure") else ""
            lines.append(f"- `{nodeid}`{kind}: {(o.get('message') or '').replace('|', '/')}")
        if len(failed) > 200:
            lines.append(f"- ... and {len(failed) - 200} more (report.json)")
    newly = [(o.get("engine"), o["newly_runs"]) for o in (outcomes or {}).values() if o.get("newly_runs")]
    if newly:
        lines += ["", "## Expected unsupported, now running (delete their entries)", ""]
        lines += [f"- {e}: `{k}`" for e, k in newly]
    if engines:
        lines += ["", "## Engines", "", "| engine | precision | details |", "|---|---|---|"]
        for name, info in engines.items():
            precision = ", ".join(f"{d}: {p}" for d, p in info.get("precision", {}).items()) or "default"
            details = ", ".join(f"{k} {v}" for k, v in info.items() if k != "precision")
            lines.append(f"| {name} | {precision} | {details} |")
    if env:
        lines += ["", "## Environment", "", "| | |", "|---|---|"] + [f"| {k} | {v} |" for k, v in env.items()]
    gap_engines = sorted({e for c in summary["gaps"].values() for e in c})
    if gap_engines:
        lines += ["", "## Gaps: cases not passing, by the operator they are about and engine", "",
                  "| op | " + " | ".join(gap_engines) + " |", "|---|" + "---|" * len(gap_engines)]
        for op, c in summary["gaps"].items():
            lines.append(f"| {op} | " + " | ".join(str(c.get(e, "")) for e in gap_engines) + " |")
    return "\n".join(lines) + "\n"


def write_report(outcomes: dict[str, dict], report_dir: str | os.PathLike, engines: dict[str, dict] | None = None,
                 env: dict[str, str] | None = None) -> dict[str, str]:
    """``engines``: per selected engine, its declared precision and ``describe()`` (versions, options)."""
    out = Path(report_dir)
    out.mkdir(parents=True, exist_ok=True)
    summary = summarize(outcomes)
    env = env if env is not None else environment()
    atomic_write(out / "report.json", json.dumps({"summary": summary, "engines": engines or {}, "environment": env,
                                                   "tests": outcomes}, indent=1))
    md = render_markdown(summary, engines, outcomes, env)
    try:  # pictures next to the report (matplotlib, in the test extra): never at the cost of the report
        from .plots import write_plots

        pictures = [p.name for p in write_plots({"summary": summary, "engines": engines or {}, "tests": outcomes}, out)]
    except ImportError as exc:
        pictures, md = [], md + f"\n(no plots: {exc})\n"
    if pictures:
        md += "\n## Pictures\n\n" + "\n".join(
            f"- [{name}]({name})" if name.endswith(".html") else f"- ![{name}]({name})" for name in pictures) + "\n"
    atomic_write(out / "report.md", md)
    step_summary = os.environ.get("GITHUB_STEP_SUMMARY")
    if step_summary:
        try:
            with open(step_summary, "a", encoding="utf-8") as f:
                f.write(md)
        except OSError as exc:
            print(f"lockstep: cannot append the report to GITHUB_STEP_SUMMARY {step_summary}: {exc}", file=sys.stderr)
    return {"json": str(out / "report.json"), "markdown": str(out / "report.md")}


def merge(paths: list[str | os.PathLike], report_dir: str | os.PathLike) -> dict[str, str]:
    """One report from the reports of several shards: their tests (a test in two shards is an error:
    the shards overlapped), engines and environments (which must agree on versions)."""
    tests: dict[str, dict] = {}
    engines: dict[str, dict] = {}
    envs = []
    for p in paths:
        try:
            data = json.loads(Path(p).read_text())
            part, eng, env = data["tests"], data.get("engines", {}), data.get("environment", {})
        except (OSError, ValueError, KeyError, TypeError) as exc:
            raise ReportError(f"{p}: not a lockstep report.json ({type(exc).__name__}: {exc})") from None
        both = sorted(set(tests) & set(part))
        if both:
            raise ReportError(f"{p}: {len(both)} test(s) also in an earlier report (the shards overlap), e.g. {both[0]}")
        tests.update(part)
        engines.update(eng)
        envs.append((p, env))
    if not paths:
        raise ReportError("nothing to merge")
    keys = ("python", "numpy", "ml_dtypes", "onnx", "onnxruntime", "onnxruntime-gpu", "lockstep")
    first_path, first = envs[0]
    for p, env in envs[1:]:
        differ = {k: (first.get(k), env.get(k)) for k in keys if first.get(k) != env.get(k)}
        if differ:
            raise ReportError(f"{p}: ran with other versions than {first_path}: {differ}")
    env = dict(first)
    env["merged from"] = ", ".join(str(p) for p, _ in envs)
    return write_report(tests, report_dir, engines, env)
