"""``lockstep report diff``: what changed between two conformance reports (two runs), or between two
engines of one report (or of two).

``diff(a, b)`` compares two sides, each the tests of a ``report.json`` (``lockstep.conformance.report``)
and optionally one engine of it. Two runs are matched by test id; two engines by the test id with
the engine taken out (``expectations.key_from_nodeid``: ``test_node_case[ref-sim-test_acos]`` and
``test_node_case[ort-cpu-test_acos]`` are one test); an id is read from its file's name on (the folders
before it depend on where pytest ran). It finds:

- newly failing tests: failed in B, not failed in A (passed, skipped, unsupported, xfailed, or not
  run there): the command's exit status is 1 when there is one, 0 otherwise;
- newly passing tests: passed in B, not passing in A (a test only B ran is counted, not listed);
- newly skipped tests: skipped in B (unsupported by the engine, its engine unavailable, or another
  skip) where A ran them; other changes of outcome (e.g. failed -> xfailed), counted by kind;
- measures that moved, where both sides recorded one: a golden lock's engine margin (top-1 minus
  top-2 logit) at each position it checked, a located lock's first divergent node's error, and a
  test's own numeric ``max_abs_diff`` / ``max_abs_error`` / ``max_error`` if it records one. Per
  test the largest move (B - A) is kept; the largest moves are listed, with a threshold.

Reading a report is ``report.read_report``: a missing, unreadable or malformed file is a
``ReportError`` naming it (the CLI prints it as one line, exit status 2).
"""

from __future__ import annotations

import math
from collections import Counter
from dataclasses import asdict, dataclass, field
from typing import Any

from .expectations import key_from_nodeid
from .report import NO_ENGINE, ReportError, engine_row, failure_group

__all__ = ["Change", "Move", "Diff", "diff", "side", "render_text", "state", "measures", "MEASURES"]

# a test's own numeric measure of how far off it was, read where a test records one at the top of its entry
MEASURES = ("max_abs_diff", "max_abs_error", "max_error")
SKIPS = ("skipped", "unsupported", "unavailable")


def state(entry: dict | None) -> str:
    """A test's outcome, a skip told apart by why: ``unsupported`` (the engine cannot run it),
    ``unavailable`` (the engine could not be loaded here), else ``skipped``; ``absent``: not run."""
    if entry is None:
        return "absent"
    outcome = entry.get("outcome", "passed")
    if outcome != "skipped":
        return outcome
    reason = entry.get("reason") or ""
    if "lockstep: unavailable: " in reason:
        return "unavailable"
    if reason.startswith("unsupported") or entry.get("newly_unsupported"):
        return "unsupported"
    return "skipped"


def _finite(x: Any) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


def measures(entry: dict) -> dict[str, tuple[float, float | None]]:
    """name -> (value, the band it is judged against, or None) of every numeric measure the entry records."""
    out: dict[str, tuple[float, float | None]] = {}
    g = entry.get("golden")
    if isinstance(g, dict):
        band = g.get("band") if _finite(g.get("band")) else None
        for pos, m in zip(g.get("positions") or [], g.get("engine_margins") or []):
            if _finite(m):
                out[f"margin at position {pos}"] = (float(m), band)
    loc = entry.get("locate")
    if isinstance(loc, dict) and isinstance(loc.get("first"), dict):
        node = loc["first"].get("node")
        for p in loc.get("points") or []:
            if isinstance(p, (list, tuple)) and len(p) >= 5 and p[4] == node and _finite(p[1]):
                out[f"located node {loc['first'].get('name')} error"] = (float(p[1]), p[2] if _finite(p[2]) else None)
                break
    for key in MEASURES:
        if _finite(entry.get(key)):
            out[key] = (float(entry[key]), None)
    return out


@dataclass
class Change:
    test: str          # the test's id (two engines: without the engine)
    group: str         # the op (or model, test) it is about: report.failure_group
    before: str        # state in A
    after: str         # state in B
    detail: str = ""   # B's failure kind and message, or its skip reason; A's message for a newly passing test


@dataclass
class Move:
    test: str
    measure: str       # e.g. "margin at position 20"
    before: float
    after: float
    band: float | None
    moved: int = 1     # how many of the test's measures moved past the threshold

    @property
    def delta(self) -> float:
        return self.after - self.before


@dataclass
class Diff:
    a: str                          # what side A is (file, engine)
    b: str
    compared: int = 0               # tests on both sides
    only_a: int = 0
    only_b: int = 0
    newly_fails: list[Change] = field(default_factory=list)
    newly_passes: list[Change] = field(default_factory=list)
    newly_skipped: list[Change] = field(default_factory=list)
    other: Counter = field(default_factory=Counter)   # (before, after) -> count, the changes listed nowhere else
    moves: list[Move] = field(default_factory=list)    # largest |delta| first
    threshold: float = 0.0
    environment: dict[str, tuple[Any, Any]] = field(default_factory=dict)   # what differs between the two runs

    def as_dict(self) -> dict:
        d = asdict(self)
        d["other"] = [{"before": a, "after": b, "count": n} for (a, b), n in sorted(self.other.items())]
        for m, src in zip(d["moves"], self.moves):
            m["delta"] = src.delta
        d["exit_status"] = self.exit_status
        return d

    @property
    def exit_status(self) -> int:
        return 1 if self.newly_fails else 0


def side(report: dict, engine: str | None, where: str) -> dict[str, dict]:
    """The tests of one side: every test of ``report`` by id, or ``engine``'s by id without the engine."""
    tests = report["tests"]
    if engine is None:
        return dict(tests)
    ran = {engine_row(o) for o in tests.values()}
    if engine not in ran:
        known = ", ".join(sorted(ran - {NO_ENGINE})) or "none"
        raise ReportError(f"{where}: no test of engine {engine!r} (its engines: {known})")
    out = {}
    for nodeid, o in tests.items():
        if o.get("engine") == engine:
            path, _, _ = nodeid.rpartition("::")
            key = key_from_nodeid(nodeid, engine)
            func = nodeid.split("::")[-1].split("[")[0]
            out[f"{path}::{func}[{key}]" if func == "test_node_case" else f"{path}::{key}"] = o
    return out


def _detail(entry: dict | None, st: str) -> str:
    if entry is None:
        return ""
    if st == "failed":
        kind = entry.get("failure") or "error"
        return f"{kind}: {entry.get('message') or ''}".strip()
    if st in SKIPS:
        return entry.get("reason") or ""
    return ""


def diff(a: dict[str, dict], b: dict[str, dict], *, a_name: str = "A", b_name: str = "B",
         threshold: float = 0.0, env_a: dict | None = None, env_b: dict | None = None) -> Diff:
    """What changed from side ``a`` to side ``b`` (test id -> report entry, as ``side`` gives them)."""
    out = Diff(a=a_name, b=b_name, threshold=threshold)
    a, b = _by_file_name(a), _by_file_name(b)
    both = [t for t in a if t in b]
    out.compared, out.only_a, out.only_b = len(both), len(set(a) - set(b)), len(set(b) - set(a))
    for test in list(a) + [t for t in b if t not in a]:
        ea, eb = a.get(test), b.get(test)
        sa, sb = state(ea), state(eb)
        if sa == sb or sb == "absent":
            pass
        elif sb == "failed":
            out.newly_fails.append(Change(test, failure_group(test, eb), sa, sb, _detail(eb, sb)))
        elif sa == "absent":
            pass  # a test only B ran, not failing there: counted in only_b
        elif sb == "passed":
            out.newly_passes.append(Change(test, failure_group(test, ea), sa, sb, _detail(ea, sa)))
        elif sb in SKIPS and sa not in SKIPS:
            out.newly_skipped.append(Change(test, failure_group(test, eb), sa, sb, _detail(eb, sb)))
        else:
            out.other[(sa, sb)] += 1
        if ea is None or eb is None:
            continue
        ma, mb = measures(ea), measures(eb)
        moved = [Move(test, k, ma[k][0], mb[k][0], mb[k][1] if mb[k][1] is not None else ma[k][1])
                 for k in ma if k in mb and mb[k][0] != ma[k][0] and abs(mb[k][0] - ma[k][0]) >= threshold]
        if moved:
            top = max(moved, key=lambda m: abs(m.delta))
            top.moved = len(moved)
            out.moves.append(top)
    out.moves.sort(key=lambda m: (-abs(m.delta), m.test))
    keys = sorted(set(env_a or {}) | set(env_b or {}))
    out.environment = {k: ((env_a or {}).get(k), (env_b or {}).get(k)) for k in keys
                       if (env_a or {}).get(k) != (env_b or {}).get(k) and k != "merged from"}
    return out


def _short(test: str) -> str:
    return test.rsplit("/", 1)[-1]


def _by_file_name(tests: dict[str, dict]) -> dict[str, dict]:
    """The tests by id from their file's name on (``test_node_cases.py::test_node_case[...]``): a run's ids
    start where pytest's rootdir puts them (``conformance/node_suite/...`` from a checkout, the file name
    under ``lockstep check``'s ``--pyargs``); kept whole where two files of one name would collide."""
    short = {_short(t): o for t, o in tests.items()}
    return short if len(short) == len(tests) else tests


def _changes(title: str, changes: list[Change], limit: int | None) -> list[str]:
    lines = [f"{title} ({len(changes)}):" if changes else f"{title}: none"]
    for c in changes[:limit]:
        detail = f": {c.detail}" if c.detail else ""
        lines.append(f"  - {_short(c.test)} [{c.group}]: {c.before} -> {c.after}{detail}")
    if limit is not None and len(changes) > limit:
        lines.append(f"  ... and {len(changes) - limit} more (--all lists every one)")
    return lines


def render_text(d: Diff, top: int = 10, limit: int | None = 50) -> str:
    """The diff for a terminal: the sides, each kind of change, the largest moves, a one-line tally."""
    lines = [f"A: {d.a}", f"B: {d.b}",
             f"compared {d.compared} test(s) on both sides; only in A: {d.only_a}, only in B: {d.only_b}"]
    if d.environment:
        lines.append("environment: " + "; ".join(f"{k} {va} -> {vb}" for k, (va, vb) in d.environment.items()))
    lines.append("")
    lines += _changes("newly fails (not failing in A, failing in B)", d.newly_fails, limit)
    if d.newly_fails:
        by_group = Counter(c.group for c in d.newly_fails)
        lines.append("  by op (or model, test): " + ", ".join(
            f"{g} {n}" for g, n in sorted(by_group.items(), key=lambda kv: (-kv[1], kv[0]))))
    lines += _changes("newly passes", d.newly_passes, limit)
    lines += _changes("newly skipped or unsupported", d.newly_skipped, limit)
    if d.other:
        lines.append("other changes: " + ", ".join(f"{a} -> {b} {n}" for (a, b), n in sorted(d.other.items())))
    at_least = f"by at least {d.threshold:g}" if d.threshold > 0 else "by any amount"
    if d.moves:
        shown = d.moves[:top]
        lines.append(f"margins and errors that moved {at_least} ({len(d.moves)} test(s); the largest "
                     f"{len(shown)}, B - A):")
        for m in shown:
            band = f", {abs(m.delta) / m.band:.3g}x its band {m.band:.3g}" if m.band else ""
            more = f"; {m.moved} of its measures moved" if m.moved > 1 else ""
            lines.append(f"  - {_short(m.test)}: {m.measure}: {m.before:.6g} -> {m.after:.6g} "
                         f"({m.delta:+.3g}{band}){more}")
    else:
        lines.append(f"margins and errors that moved {at_least}: none")
    lines += ["", f"{len(d.newly_fails)} newly fail, {len(d.newly_passes)} newly pass, {len(d.newly_skipped)} "
                  f"newly skipped, {len(d.moves)} moved" + (": exit status 1" if d.newly_fails else "")]
    return "\n".join(lines) + "\n"
