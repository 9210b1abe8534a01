"""Expectations and fail closed (a job of lockstep's pytest plugin): the entries that apply here
(the packaged file and each selected engine's own), stale entries as a usage error (judged by the
controller of a pytest-xdist run), strict xfails and skips as markers, and a test that newly cannot
run (an ``unsupported:`` skip no entry expects) failed."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from lockstep.conformance import expectations
from lockstep.conformance.plugin_state import state
from lockstep.engines import selection
from lockstep.engines.protocol import capabilities
from lockstep.paths import package_path


def load(config: pytest.Config) -> list:
    """Every entry that applies here: the expectations file (``--lockstep-expectations``, default the
    packaged one) and each selected engine's own file."""
    st = state(config)
    if st.expect is None:
        given = config.getoption("--lockstep-expectations")
        path = Path(given) if given and given != "none" else (
            None if given == "none" else package_path("lockstep.conformance.node_suite", "expectations.toml"))
        if path is not None and given and not path.is_file():
            raise pytest.UsageError(f"--lockstep-expectations: {path} does not exist")
        try:
            entries = expectations.load(path) if path is not None and path.is_file() else []
            for name, eng in selection.engines(config).items():
                own = capabilities(eng).expectations
                if own is not None and Path(own).is_file():  # not written yet: nothing expected
                    entries += expectations.load(Path(own), name)
        except expectations.ExpectationsError as exc:
            raise pytest.UsageError(str(exc)) from None
        # variants of one plugin sharing a file load it once each: an entry naming one of them once
        unique = {(e.file, e.engine, tuple(e.patterns), e.kind, e.reason, tuple(e.when.items())): e for e in entries}
        st.expect = [e for e in unique.values() if expectations.applies(e)]
    return st.expect


def _kept_by_keyword(config: pytest.Config):
    """With ``-k``, a function is collected with only some of its parameters: an entry for a key ``-k``
    left out is not stale (the complete run judges it). Returns None without ``-k``, else
    ``kept(pattern, engine)``: whether ``-k`` would have selected that exact key (pytest's own
    expression; a glob pattern, or an expression this cannot evaluate, is never judged under ``-k``)."""
    kexpr = config.getoption("keyword", "")
    if not kexpr:
        return None
    try:
        from _pytest.mark.expression import Expression

        expr = Expression.compile(kexpr)
    except Exception:
        return lambda pat, engine: False

    def kept(pat: str, engine: str) -> bool:
        if "*" in pat or "?" in pat:
            return False
        func, _, params = pat.partition("[")
        names = [f"{func}[{engine}-{params}".lower() if params else func.lower(), func.lower()]
        try:
            return bool(expr.evaluate(lambda ident, **kw: not kw and any(ident.lower() in n for n in names)))
        except Exception:
            return False

    return kept


def _stale_entries(entries: list, collected: set[str], universe: set[str], kept=None) -> str:
    """What is stale among the selected engines' entries: a pattern of a test function's key whose
    function was collected but matches none of its keys, or a node-case pattern matching no node
    case (``universe``: every case, empty when the node suite was not collected). '' when none."""
    functions = {k.split("[")[0] for k in collected}
    stale = []
    for e in entries:
        for pat in e.patterns:
            if "[" in pat:  # a test function's key: judged when that function was collected
                if kept is not None and not kept(pat, e.engine):
                    continue
                if pat.split("[")[0] in functions and not expectations.filter_keys(collected, pat):
                    stale.append((e, pat))
            elif universe and not expectations.filter_keys(universe, pat):
                stale.append((e, pat))
    if not stale:
        return ""
    return ("node-suite expectations: entries matching no case (delete them): "
            + "; ".join(f"{e.file}: {e.engine} {pat}" for e, pat in stale[:20])
            + (f"; ... and {len(stale) - 20} more" if len(stale) > 20 else ""))


def _engine_of_nodeid(nodeid: str, engines: list[str]) -> str | None:
    """The selected engine a test's node id names in its parameters (the longest that fits:
    ort-cuda-tf32 before ort-cuda), or None for a test with no engine."""
    params = nodeid.split("::")[-1].partition("[")[2].rstrip("]")
    if not params:
        return None
    parts = params.split("-")
    fits = [e for e in engines
            if any("-".join(parts[i:i + e.count("-") + 1]) == e for i in range(len(parts)))]
    return max(fits, key=len) if fits else None


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_node_collection_finished(node: Any, ids: list[str]) -> None:
    """The controller of a pytest-xdist run collects nothing: it judges the expectations' stale
    entries from the first worker's node ids (every worker collects the same), and a stale entry
    ends the run before any test runs, as a usage error does without workers."""
    config = node.config
    st = state(config)
    if st.stale_checked:
        return
    st.stale_checked = True
    engines = sorted(selection.engines(config))
    keys, node_cases = set(), False
    for nodeid in ids:
        engine = _engine_of_nodeid(nodeid, engines)
        if engine is None:
            continue
        keys.add(expectations.key_from_nodeid(nodeid, engine))
        node_cases = node_cases or nodeid.split("::")[-1].startswith("test_node_case[")
    if not keys:
        return
    entries = [e for e in load(config) if e.engine in engines]
    universe: set[str] = set()
    if node_cases:
        from lockstep.reference_runtime.node_cases import load_cases

        universe = {c.name for c in load_cases()}
    stale = _stale_entries(entries, keys, universe, _kept_by_keyword(config))
    if stale:
        pytest.exit(stale, returncode=pytest.ExitCode.USAGE_ERROR)


def apply(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Mark engine tests as expected: strict xfails and skips as markers; expected-unsupported
    entries are remembered per item (``pytest_runtest_makereport`` fails a case that newly cannot
    run). An entry of a selected engine that matches no case is stale: a usage error."""
    engine_items = [it for it in items if getattr(it, "callspec", None) is not None
                    and it.callspec.params.get("engine_name") is not None]
    if not engine_items:
        return
    st = state(config)
    engines = selection.engines(config)
    entries = [e for e in load(config) if e.engine in engines]
    keys = {}
    for it in engine_items:
        keys[it.nodeid] = (it.callspec.params["engine_name"], expectations.test_key(it, it.callspec.params["engine_name"]))
    # node cases collected (their key is the case: test_key), as the controller of an xdist run judges it
    if any(hasattr(it.callspec.params.get("case"), "name") for it in engine_items):
        from lockstep.reference_runtime.node_cases import load_cases

        universe = {c.name for c in load_cases()}  # every case, whatever -k or node ids selected
    else:
        universe = set()
    # a pytest-xdist worker leaves the judgement to the controller (pytest_xdist_node_collection_finished):
    # a usage error raised on a worker is an INTERNALERROR there
    if getattr(config, "workerinput", None) is None:
        stale = _stale_entries(entries, {k for _, k in keys.values()}, universe, _kept_by_keyword(config))
        if stale:
            raise pytest.UsageError(stale)
    unsupported = st.expected_unsupported
    # The first entry (in file order) with a matching pattern applies. Most patterns are exact case
    # names: looked up in a dict; the glob ones are tried in order, only while they come first.
    exact: dict[tuple[str, str], int] = {}
    globs: dict[str, list[tuple[int, str]]] = {}
    for k, e in enumerate(entries):
        for pat in e.patterns:
            if "*" in pat or "?" in pat:
                globs.setdefault(e.engine, []).append((k, pat))
            else:
                exact.setdefault((e.engine, pat), k)
    for it in engine_items:
        engine, key = keys[it.nodeid]
        first = exact.get((engine, key))
        for k, pat in globs.get(engine, ()):
            if first is not None and k >= first:
                break
            if expectations.match(key, pat):
                first = k
                break
        if first is None:
            continue
        e = entries[first]
        if e.kind == "unsupported":
            unsupported[it.nodeid] = e
        elif e.kind == "xfail":
            it.add_marker(pytest.mark.xfail(strict=True, reason=e.reason))
        else:
            it.add_marker(pytest.mark.skip(reason=e.reason))


UNSUPPORTED = "unsupported: "

def skip_reason(report) -> str:
    msg = report.longrepr[2] if isinstance(report.longrepr, tuple) else str(report.longrepr)
    return msg.removeprefix("Skipped: ")


def fail_closed(item: pytest.Item, report) -> None:
    """An engine test that newly cannot run (an ``unsupported:`` skip no entry expects) fails;
    one an entry expects unsupported that ran is recorded as newly running."""
    params = getattr(getattr(item, "callspec", None), "params", {})
    engine = params.get("engine_name")
    if engine is None or report.when not in ("setup", "call"):
        return
    expected = state(item.config).expected_unsupported.get(item.nodeid)
    if report.skipped and not hasattr(report, "wasxfail"):
        why = skip_reason(report)
        if why.startswith(UNSUPPORTED) and expected is None:
            key = expectations.test_key(item, engine)
            detail = why[len(UNSUPPORTED):].removeprefix(f"{engine}: ")
            report.outcome = "failed"
            report.longrepr = (
                f"lockstep: {engine} newly cannot run {key}: {detail}\n"
                f"  (fail closed: a case an engine cannot run must be expected, kind = \"unsupported\" in its "
                f"expectations; the summary \"engine tests that newly cannot run\" gives the command that records "
                f"them)")
            report.user_properties.append(("newly_unsupported", key))
    elif report.when == "call" and report.passed and expected is not None:
        report.user_properties.append(("newly_runs", expectations.test_key(item, engine)))




@pytest.hookimpl(tryfirst=True, wrapper=True)  # outermost: after the labels are copied onto the report
def pytest_runtest_makereport(item: pytest.Item, call):
    report = yield
    fail_closed(item, report)
    return report
