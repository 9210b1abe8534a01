"""Outcomes (a job of lockstep's pytest plugin): the properties each report carries (engine, op,
expectation key, markers, contract), aggregated where reports arrive (the controller under
pytest-xdist), and written at the end as ``--lockstep-report`` JSON and ``--lockstep-report-dir``'s
report.json / report.md."""

from __future__ import annotations

import functools
import json

import pytest

from lockstep.conformance import expectations
from lockstep.conformance.plugin_expectations import skip_reason
from lockstep.conformance.plugin_state import MARKERS, state
from lockstep.contracts.pytest_plugin import MARKER_NAMES as RUNTIME_MARKER_NAMES
from lockstep.engines import selection
from lockstep.engines.protocol import capabilities
from lockstep.engines.selection import UNAVAILABLE

# lockstep's own markers, by name (its and the reference runtime's plugins')
MARKER_NAMES = frozenset(m.split("(")[0].split(":")[0] for m in MARKERS) | RUNTIME_MARKER_NAMES


_LABELLED = pytest.StashKey[bool]()


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call):
    """Properties every report of a lockstep test carries (and JUnit XML as <properties>): engine,
    the op a node case is about, the test's expectation key, its lockstep markers, its contract."""
    if call.when == "setup" and not item.stash.get(_LABELLED, False):
        item.stash[_LABELLED] = True
        props = []
        params = getattr(getattr(item, "callspec", None), "params", {})
        if not any(k == "engine" for k, _ in item.user_properties):
            props.append(("engine", params.get("engine_name") or "-"))
        markers = sorted({mk.name for mk in item.iter_markers()} & MARKER_NAMES)
        if markers:
            props.append(("markers", ",".join(markers)))
        case = params.get("case")
        if case is not None and hasattr(case, "model"):
            props.append(("ops", sorted(_op_types(case.model))))
            props.append(("op", case_op(case)))
        if params.get("engine_name"):
            props.append(("key", expectations.test_key(item, params["engine_name"])))
        item.user_properties.extend(props)
    report = yield
    if call.when == "setup":
        report.user_properties = list(item.user_properties)
    return report


_CASES: dict = {}


def case_op(case) -> str:
    """The operator a node case is about: its one node's op, the op of its unexpanded twin
    (``test_x_expanded`` -> ``test_x``), else the node whose op type is named in the case."""
    return _case_op(case.name, case.model)


@functools.lru_cache(maxsize=4096)  # each case is reported once per engine: its model parsed once
def _case_op(name: str, model: bytes) -> str:
    import onnx

    from lockstep.reference_runtime.node_cases import load_cases

    m = onnx.load_from_string(model)
    if len(m.graph.node) == 1:
        return m.graph.node[0].op_type
    base = name.split("_expanded")[0]
    if base != name:
        global _CASES
        _CASES = _CASES or {c.name: c for c in load_cases()}
        if base in _CASES:
            return case_op(_CASES[base])
    flat = name.replace("_", "").lower()
    named = [n.op_type for n in m.graph.node if n.op_type.lower() in flat]
    return max(named, key=len) if named else (m.graph.node[0].op_type if m.graph.node else "?")


@functools.lru_cache(maxsize=4096)  # a case's model is one bytes object, reported once per engine
def _op_types(model_bytes: bytes) -> frozenset[str]:
    import onnx

    m = onnx.load_from_string(model_bytes)
    return frozenset({n.op_type for n in m.graph.node} | {n.op_type for f in m.functions for n in f.node})


class OutcomeRecorder:
    """Aggregates outcomes and device skips where reports arrive (the controller under xdist)."""

    def __init__(self, config: pytest.Config):
        self.config = config

    def pytest_runtest_logreport(self, report: pytest.TestReport) -> None:
        st = state(self.config)
        props = dict(report.user_properties)
        entry = st.outcomes.setdefault(
            report.nodeid, {"outcome": "passed", "contract": props.get("contract"), "engine": props.get("engine"),
                            "ops": props.get("ops", [])}
        )
        for key in ("op", "key", "precision", "stands_for"):
            if key in props:
                entry[key] = props[key]
        if report.when == "call":  # properties recorded by the test arrive with every later report too
            for key in ("tripwire", "golden", "locate"):
                if key in props and key not in entry:
                    entry[key] = json.loads(props[key])
                    if key == "tripwire":
                        st.tripwires.append(entry[key])
            for key in ("newly_runs", "newly_unsupported"):
                if key in props:
                    entry[key] = props[key]
                    getattr(st, key).append((entry.get("engine"), props[key]))
        if report.failed:
            if entry["outcome"] != "failed":
                entry["message"] = first_line(report)
                entry["failure"] = "newly unsupported" if "newly_unsupported" in entry else failure_kind(report)
            entry["outcome"] = "failed"
        elif hasattr(report, "wasxfail"):
            entry["outcome"] = "xfailed"
            entry["failure"] = failure_kind(report)
            if "tripwire" in entry:  # a recorded known failure: said as expected, not as a new FATAL
                entry["tripwire"]["expected"] = True
        elif report.skipped and entry["outcome"] == "passed":
            entry["outcome"] = "skipped"
            msg = skip_reason(report)
            entry["reason"] = msg
            if UNAVAILABLE in msg:
                name, reason = msg.split(UNAVAILABLE, 1)[1].split(": ", 1)
                st.skipped[(name, reason)] += int(props.get("stands_for", 1))


FAILURE_KINDS = ("wrong value", "error", "newly unsupported")


def failure_kind(report) -> str:
    """What a failed (or xfailed) test's exception says it is: ``wrong value`` (an ``AssertionError``:
    a result outside its tolerance or band, a contract's check) or ``error`` (anything the engine or
    the test raised: ``lockstep.engines.refusal``'s rule)."""
    crash = getattr(getattr(report, "longrepr", None), "reprcrash", None)
    text = crash.message if crash is not None else str(getattr(report, "longrepr", ""))
    return "wrong value" if text.lstrip().startswith(("AssertionError", "assert ")) else "error"


def first_line(report) -> str:
    """The first line that says what failed: the assertion's message, or the exception."""
    crash = getattr(getattr(report, "longrepr", None), "reprcrash", None)
    text = crash.message if crash is not None else str(report.longrepr)
    for line in text.splitlines():
        line = line.strip()
        if line and not line.startswith(("assert ", "+", "where")):
            return line[:300]
    return text.strip()[:300]


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    st = state(session.config)
    if getattr(session.config, "workerinput", None) is not None:
        return  # a pytest-xdist worker: the controller, which receives every report, writes the reports
    path = session.config.getoption("--lockstep-report")
    if path:
        with open(path, "w") as f:
            json.dump(st.outcomes, f, indent=1)
    report_dir = session.config.getoption("--lockstep-report-dir")
    if report_dir:
        from lockstep.conformance.report import write_report

        engines = selection.of(session.config).loaded_engines()
        described = {}
        for name, eng in engines.items():
            caps = capabilities(eng)
            described[name] = {"precision": dict(caps.precision), **caps.described(),
                               "decode session": "its own (decoder)" if caps.decoder is not None
                               else "lockstep's HostKVSession over prepare (the cache on the host)"}
        st.report_paths = write_report(st.outcomes, report_dir, described)
