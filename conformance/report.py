"""The conformance report: per-engine counts, failures, environment, an op-by-engine table of gaps,
and pictures (golden margins, the op scoreboard).

Written by the pytest plugin at session end when ``--lockstep-report-dir`` is given (``lockstep
check`` gives it): ``report.json`` (machine-readable: summary, engines, environment, every test's
outcome), ``report.md`` (the same as tables, with the failing tests and their first message line;
also appended to ``$GITHUB_STEP_SUMMARY`` when that is set) and the PNG/HTML pictures
(``conformance/plots.py``). Only a run that happened writes one. ``merge`` combines the reports of
shards (``--lockstep-shard i/n`` on several machines) into one; ``lockstep report diff``
(``conformance/report_diff.py``) compares two reports, or two engines of one. Files are written atomically.
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

from .expectations import key_from_nodeid

__all__ = ["summarize", "write_report", "render_markdown", "environment", "merge", "read_report", "failure_group",
           "located_line", "ReportError", "NO_ENGINE", "OWN_RUNTIME"]

STATUSES = ("passed", "failed", "xfailed", "skipped")
# the row of tests that run no engine (the plugin labels them "-"): the suite's checks of lockstep's own data,
# e.g. a --golden-dir snapshot recomputed from the oracle (test_snapshot_is_the_oracle)
NO_ENGINE = "(no engine)"
# the row of the reference runtime's own tests that take no engine or device (lockstep.contracts.pytest_plugin.OWN)
OWN_RUNTIME = "reference-runtime"
# what a row of the engine table that names no engine of the run is: a line under the table
ENGINE_LEGEND = {
    NO_ENGINE: "tests that run no engine (checks of lockstep's own data, e.g. a `--golden-dir` snapshot recomputed "
               "from the oracle)",
    OWN_RUNTIME: "the reference runtime's own tests that take no engine or device (`lockstep.contracts.suite`, run "
                 "when ref-sim or ref-cuda is selected: the capture guard's pass over ONNX's node cases, built-in "
                 "snapshots, capture census, sync audit)",
}


class ReportError(LockstepError, ValueError):
    """A report cannot be read or merged; the message names the file."""


def summarize(outcomes: dict[str, dict]) -> dict:
    """Per engine: counts of each status; ``kinds``: its failed and xfailed tests by what failed
    (``wrong value``, ``error``, ``newly unsupported``: counted apart); ``gaps``: by operator."""
    per_engine: dict[str, Counter] = defaultdict(Counter)
    kinds: dict[str, dict[str, Counter]] = defaultdict(lambda: defaultdict(Counter))
    gaps: dict[str, Counter] = defaultdict(Counter)  # op -> engine -> non-passing node cases
    for _nodeid, o in outcomes.items():
        engine = engine_row(o)
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


def engine_row(entry: dict) -> str:
    """The engine table's row of a test: its engine, or ``NO_ENGINE`` (the plugin's ``-``, or none)."""
    engine = entry.get("engine")
    return NO_ENGINE if engine in (None, "", "-") else engine


# the golden suite's test modules (conformance/golden/test_*.py): their tests take a golden model (and a mode)
_GOLDEN_MODULES = frozenset(p.name for p in (Path(__file__).resolve().parent / "golden").glob("test_*.py"))
_MODES = ("-prefill", "-stepwise", "-verify")


def _model_of(nodeid: str, entry: dict) -> str | None:
    """The golden model a test ran: recorded with its lock, locate or tripwire, else the parameter of a
    golden suite test (its id without the engine and the mode)."""
    for key in ("golden", "locate", "tripwire"):
        if isinstance(entry.get(key), dict) and entry[key].get("model"):
            return str(entry[key]["model"])
    if nodeid.split("::")[0].rsplit("/", 1)[-1] not in _GOLDEN_MODULES:
        return None
    engine = entry.get("engine")
    key = entry.get("key") or (key_from_nodeid(nodeid, engine) if engine not in (None, "", "-")
                               else nodeid.split("::")[-1])
    params = key.partition("[")[2].rstrip("]")
    for mode in _MODES:
        params = params.removesuffix(mode)
    return params or None


def _function(nodeid: str) -> str:
    return nodeid.split("::")[-1].split("[")[0]


def failure_group(nodeid: str, entry: dict) -> str:
    """What a failure is grouped under: the operator a node case is about, the op of the first
    divergent node where a failing lock was located, else ``model NAME`` (a golden model's failure
    located at no node), else ``test FUNCTION`` (a test about no op or model)."""
    if entry.get("op"):
        return str(entry["op"])
    first = (entry.get("locate") or {}).get("first") if isinstance(entry.get("locate"), dict) else None
    if isinstance(first, dict) and first.get("op_type"):
        return str(first["op_type"])
    model = _model_of(nodeid, entry)
    return f"model {model}" if model else f"test {_function(nodeid)}"


def _located_error(loc: dict, node) -> tuple[float | None, float | None]:
    for p in loc.get("points") or []:
        if isinstance(p, (list, tuple)) and len(p) >= 5 and p[4] == node:
            return p[1], p[2]
    return None, None


def located_line(entry: dict) -> str | None:
    """The failing lock's located first divergent node, whole (name, op, index, its error and band),
    from the ``locate`` the test recorded; None where it recorded none."""
    loc = entry.get("locate")
    if not isinstance(loc, dict):
        return None
    mode = loc.get("mode") or "?"
    where = mode if loc.get("position") is None and mode == "prefill" else (
        f"{mode}, prefill" if loc.get("position") is None else f"{mode}, position {loc['position']}")
    run = f"{loc.get('model', '?')} on {loc.get('engine', '?')} ({where})"
    first = loc.get("first")
    said = f"; {loc['sentence']}" if isinstance(loc.get("sentence"), str) else ""
    if not isinstance(first, dict):
        return (f"located: no node leaves its band in {run}"
                + (said or " (the message says where the divergence is)"))
    error, band = _located_error(loc, first.get("node"))
    err = "an infinite or NaN error" if error is None else f"error {error:.3g}"
    against = f" against a band of {band:.3g}" if isinstance(band, (int, float)) else ""
    return (f"located: first divergent node `{first.get('name')}` ({first.get('op_type')}, node {first.get('node')}), "
            f"{err}{against}, in {run}{said}")


def failures_by_op(outcomes: dict[str, dict]) -> list[tuple[str, list[tuple[str, dict]]]]:
    """The failed tests grouped by ``failure_group``, most failures first (then by name)."""
    groups: dict[str, list[tuple[str, dict]]] = defaultdict(list)
    for nodeid, o in outcomes.items():
        if o.get("outcome") == "failed":
            groups[failure_group(nodeid, o)].append((nodeid, o))
    return sorted(groups.items(), key=lambda kv: (-len(kv[1]), kv[0]))


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


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
    legend = [f"`{row}`: {ENGINE_LEGEND[row]}" for row in summary["engines"] if row in ENGINE_LEGEND]
    legend += [f"`{row}`: no engine of this run: the reference runtime's own tests on its device {row}"
               for row in summary["engines"] if engines and row not in engines and row not in ENGINE_LEGEND]
    if legend:
        lines += ["", "Rows that are not engines: " + "; ".join(legend) + "."]
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
            where = located_line(o)
            if where:
                lines.append(f"  - {where}")
        if len(failed) > 200:
            lines.append(f"- ... and {len(failed) - 200} more (report.json)")
        lines += ["", "## Failures by operator", "",
                  "Node cases by the operator they are about; golden locks and decodes by the operator of their first "
                  "divergent node where one was located, else by model; other tests by their test function.", "",
                  "| op (or model, test) | failures | by engine | tests |", "|---|---|---|---|"]
        for group, members in failures_by_op(failed):
            per_engine = Counter(engine_row(o) for _, o in members)
            by_engine = ", ".join(f"{e} {n}" for e, n in sorted(per_engine.items(), key=lambda kv: (-kv[1], kv[0])))
            shown = []
            for nodeid, o in members[:3]:
                first = (o.get("locate") or {}).get("first") if isinstance(o.get("locate"), dict) else None
                at = f" at `{first.get('name')}`" if isinstance(first, dict) and not o.get("op") else ""
                shown.append(f"`{nodeid.split('::')[-1]}`{at}")
            more = f", ... and {len(members) - 3} more" if len(members) > 3 else ""
            lines.append(f"| {_cell(group)} | {len(members)} | {by_engine} | {_cell(', '.join(shown) + more)} |")
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


def read_report(path: str | os.PathLike) -> dict:
    """A report.json (or the folder holding one) as its dict, its ``tests`` a dict of entries; a
    ``ReportError`` naming the file when it is missing, not JSON, or not a lockstep report."""
    p = Path(path)
    if p.is_dir():
        p = p / "report.json"
    try:
        text = p.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise ReportError(f"{p}: no such file (a report.json written by --lockstep-report-dir or `lockstep check`, "
                          "or its folder)") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise ReportError(f"{p}: cannot be read ({type(exc).__name__}: {exc})") from None
    try:
        data = json.loads(text)
    except ValueError as exc:
        raise ReportError(f"{p}: not a lockstep report.json (not JSON: {exc})") from None
    tests = data.get("tests") if isinstance(data, dict) else None
    if not isinstance(tests, dict) or not all(isinstance(o, dict) for o in tests.values()):
        raise ReportError(f"{p}: not a lockstep report.json (no \"tests\" object of test entries)")
    for key in ("engines", "environment"):
        if not isinstance(data.get(key) or {}, dict):
            raise ReportError(f"{p}: not a lockstep report.json (\"{key}\" is not an object)")
    return data


def merge(paths: list[str | os.PathLike], report_dir: str | os.PathLike) -> dict[str, str]:
    """One report from the reports of several shards: their tests (a test in two shards is an error:
    the shards overlapped), engines and environments (which must agree on versions)."""
    tests: dict[str, dict] = {}
    engines: dict[str, dict] = {}
    envs = []
    for p in paths:
        data = read_report(p)
        part, eng, env = data["tests"], data.get("engines") or {}, data.get("environment") or {}
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
