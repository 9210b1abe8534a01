"""The terminal summaries of lockstep's pytest plugin (``pytest_plugin.pytest_terminal_summary``).

After pytest's own sections, in this order: the mutant under test; the golden tripwires; the engine
tests that newly cannot run (failed: the suite fails closed) with, per engine, the one command
that records them in its expectations file; the expected-unsupported cases that now run; the cases
each engine could not run (expected, skipped) by the operator they are about; the unavailable
devices, engines and models. On lockstep's suite, the short test summary's FAILED and ERROR lines
carry each test's first message line whatever the terminal's width (pytest drops it when the node
id leaves no room, as in an 80-column log).
"""

from __future__ import annotations

import shlex
from collections import Counter
from pathlib import Path

from lockstep.conformance import expectations
from lockstep.engines import selection
from lockstep.engines.protocol import capabilities
from lockstep.paths import package_path
from lockstep.conformance.plugin_expectations import UNSUPPORTED
from lockstep.conformance.plugin_outcomes import first_line
from lockstep.conformance.plugin_state import SuiteState



def terminal_summary(terminalreporter, config, st: SuiteState) -> None:
    tr = terminalreporter
    mutant = config.getoption("--lockstep-mutant", None)  # the reference runtime's plugin's option
    if mutant:
        tr.write_line(f"lockstep: runtime under test is the MUTANT {mutant!r}", red=True)
    if st.tripwires:
        tr.section("lockstep: golden tripwires (first divergence from the recorded stream)")
        for t in st.tripwires:
            expected = bool(t.get("expected"))
            kind = ("near-tie, not fatal" if t["near_tie"] else
                    "fatal, expected (a known failure its expectations record: xfailed)" if expected else "FATAL")
            tr.write_line(
                f"{t['engine']} {t['model']}: position {t['pos']}: recorded {t['recorded']}, engine {t['engine_token']}"
                f" (oracle margin {t['oracle_margin']}, band {t['band']}): {kind}",
                yellow=t["near_tie"] or expected, red=not (t["near_tie"] or expected),
            )
    _failures_by_kind(tr, config, st)
    _newly_unsupported(tr, config, st)
    _newly_running(tr, st)
    _unsupported_by_operator(tr, st)
    if st.skipped:
        tr.section("lockstep: unavailable devices, engines and models")
        for (name, reason), n in sorted(st.skipped.items()):
            tr.write_line(f"{name}: {n} test(s) skipped: {reason}", yellow=True)
        tr.write_line(
            "LOCKSTEP_REQUIRE_DEVICES=cupy / LOCKSTEP_REQUIRE_ENGINES=ref-cuda,... / LOCKSTEP_REQUIRE_MODELS=... "
            "make an absent one a failure"
        )
    if st.suite:
        _short_summary_with_messages(tr, config)


def _failures_by_kind(tr, config, st: SuiteState) -> None:
    """Per engine, its failures counted apart by what failed: wrong values (an AssertionError: outside
    the tolerance or band), errors (the engine raised), tests it newly cannot run."""
    by_engine: dict[str, Counter] = {}
    for o in st.outcomes.values():
        if o.get("outcome") == "failed" and o.get("engine") not in (None, "-"):
            by_engine.setdefault(o["engine"], Counter())[o.get("failure") or "error"] += 1
    if not by_engine:
        return
    tr.section("lockstep: failures by kind (wrong values, errors, newly unsupported)")
    for engine, c in sorted(by_engine.items()):
        parts = [_n(c[k], k).replace("errors", "errors (the engine raised)") for k in
                 ("wrong value", "error", "newly unsupported") if c[k]]
        tr.write_line(f"{engine}: " + ", ".join(parts), red=True)
        if c["wrong value"] or c["error"]:  # (the newly unsupported have their own section and command)
            for line in record_command(config, st, engine, failures=True):
                tr.write_line(line)


def _shown(path: Path) -> str:
    """``path`` as the user would type it here: relative to the working directory when inside it."""
    path = Path(path).resolve()
    try:
        rel = path.relative_to(Path.cwd())
    except ValueError:
        rel = path
    return shlex.quote(str(rel))


def record_command(config, st: SuiteState, engine: str, *, failures: bool = False) -> list[str]:
    """How to record ``engine``'s newly unsupported tests of this run (``failures``: its failures, as
    strict xfails): lines to print."""
    report_dir = config.getoption("--lockstep-report-dir")
    report = _shown(Path(report_dir) / "report.json") if report_dir else "reports/report.json"
    engines = selection.of(config).loaded_engines()
    own = capabilities(engines[engine]).expectations if engine in engines else None
    if own is not None:
        target, field = _shown(Path(own)), ""
        where = f"its expectations file {target}" + (
            "" if Path(own).is_file() else " (not written yet: this writes it)")
    else:
        given = config.getoption("--lockstep-expectations")
        builtin = type(engines.get(engine)).__module__.startswith("lockstep.")
        if given == "none" or not given and not builtin:  # a plugin's cases belong in its own file
            target, field = shlex.quote(f"{engine}.toml"), ""
            where = (f"an expectations file of {engine}'s own (declare it on the engine: `expectations = "
                     f"Path(__file__).with_name({target!r})`)")
        else:
            shared = Path(given) if given else package_path("lockstep.conformance.node_suite", "expectations.toml")
            target, field = _shown(shared), " --engine-field"
            where = f"the expectations file in use, {target}"
    what = "--failures" if failures else "--new"
    lines = [f"  {'known failures' if failures else 'intended'}? record them in {where}:",
             f"  lockstep expectations --from-report {report} --engine {engine} {what}{field} >> {target}"]
    if not report_dir:
        lines.insert(0, "  (this run wrote no report: rerun with --lockstep-report-dir reports, as `lockstep check` does)")
    return lines


def _newly_unsupported(tr, config, st: SuiteState) -> None:
    rows = st.newly_unsupported or []
    if not rows:
        return
    tr.section("lockstep: engine tests that newly cannot run (FAILED: record them or fix)")
    ops = {}
    for o in st.outcomes.values():
        if o.get("newly_unsupported"):
            ops[(o.get("engine"), o["newly_unsupported"])] = o.get("op")
    by_engine: dict[str, list[str]] = {}
    for engine, k in rows:
        by_engine.setdefault(engine, []).append(k)
    for engine, ks in sorted(by_engine.items()):
        of = Counter(ops.get((engine, k)) for k in ks)
        other = of.pop(None, 0)
        what = ", ".join(part for part in (f"{_n(sum(of.values()), 'node case')} of {_n(len(of), 'operator')}"
                                           if of else "", _n(other, "other test") if other else "") if part)
        tr.write_line(f"{engine}: {len(ks)} newly unsupported ({what}): {', '.join(sorted(ks)[:8])}"
                      + (" ..." if len(ks) > 8 else ""), red=True)
        for line in record_command(config, st, engine):
            tr.write_line(line)
        tr.write_line("  a regression? fix the engine: each failure above says what it could not run")


def _n(count: int, noun: str) -> str:
    return f"{count} {noun}" + ("" if count == 1 else "s")


def _newly_running(tr, st: SuiteState) -> None:
    rows = st.newly_runs or []
    if not rows:
        return
    tr.section("lockstep: expected-unsupported cases that now run (delete their entries)")
    by_engine: dict[str, list[str]] = {}
    for engine, k in rows:
        by_engine.setdefault(engine, []).append(k)
    for engine, ks in sorted(by_engine.items()):
        tr.write_line(f"{engine}: {len(ks)}: {', '.join(sorted(ks)[:12])}" + (" ..." if len(ks) > 12 else ""),
                      green=True)


def _unsupported_by_operator(tr, st: SuiteState) -> None:
    """Expected unsupported (skipped) cases per engine: grouped by the operator a node case is about
    (its most frequent reason shown), the other tests by reason."""
    groups: dict[str, dict[str, Counter]] = {}
    for o in st.outcomes.values():
        reason = o.get("reason") or ""
        if o.get("outcome") != "skipped" or not reason.startswith(UNSUPPORTED):
            continue
        engine = o.get("engine") or reason[len(UNSUPPORTED):].partition(": ")[0]
        why = reason[len(UNSUPPORTED):].removeprefix(f"{engine}: ")
        op = o.get("op")
        groups.setdefault(engine, {}).setdefault(op or "", Counter())[expectations.reason_class(why, [engine], op)] += 1
    if not groups:
        return
    tr.section("lockstep: cases an engine reported it cannot run (expected: skipped, by operator)")
    for engine, by_op in sorted(groups.items()):
        n = sum(sum(c.values()) for c in by_op.values())
        rows = []
        for op, reasons in by_op.items():
            if op:
                top, _ = min(reasons.items(), key=lambda rc: (-rc[1], rc[0]))
                more = f" (and {len(reasons) - 1} other message(s))" if len(reasons) > 1 else ""
                rows.append((sum(reasons.values()), top + more))
            else:
                rows += [(c, r) for r, c in reasons.items()]
        rows.sort(key=lambda r: (-r[0], r[1]))
        ops = sum(1 for op in by_op if op)
        tr.write_line(f"{engine}: {n} skipped" + (f" ({_n(ops, 'operator')})" if ops else ""), yellow=True)
        for count, why in rows[:8]:
            tr.write_line(f"    {count:5d}  {why}")
        if len(rows) > 8:
            tr.write_line(f"    ... and {len(rows) - 8} more (see the JSON report)")


def _short_summary_with_messages(tr, config) -> None:
    """pytest's FAILED/ERROR lines, each with its first message line in full: printed here, and
    taken out of pytest's own short summary (which follows and would trim or drop the message)."""
    chars = getattr(tr, "reportchars", "")
    kinds = [(c, stat) for c, stat in (("f", "failed"), ("E", "error")) if c in chars and tr.stats.get(stat)]
    if not kinds:
        return
    tr.write_sep("=", "short test summary info")
    for _c, stat in kinds:
        for rep in tr.stats[stat]:
            word = "FAILED" if stat == "failed" else "ERROR"
            where = config.cwd_relative_nodeid(rep.nodeid)
            if stat == "error" and getattr(rep, "when", "") in ("setup", "teardown"):
                where = f"at {rep.when} of {where}"
            tr.write_line(f"{word} {where} - {first_line(rep)}", red=True)
    tr.reportchars = "".join(ch for ch in chars if ch not in {c for c, _ in kinds})
