"""`lockstep check` end to end (a subprocess), and the report's aggregation."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from lockstep.conformance.report import render_markdown, summarize

ROOT = Path(__file__).resolve().parent.parent


def test_lockstep_check_writes_json_and_markdown(tmp_path):
    out = tmp_path / "rep"
    proc = subprocess.run(
        [sys.executable, "-m", "lockstep", "check", "--engines", "ref-sim,ort-cpu",
         "--report-dir", str(out), "-q", "-p", "no:cacheprovider", "-m", "node_suite", "-k", "test_abs or test_acos"],
        cwd=ROOT, capture_output=True, text=True, timeout=300,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    report = json.loads((out / "report.json").read_text())
    engines = report["summary"]["engines"]
    assert engines["ref-sim"]["passed"] >= 4 and engines["ref-sim"]["failed"] == 0
    assert engines["ort-cpu"]["passed"] >= 4
    assert "| ref-sim |" in (out / "report.md").read_text()
    assert "| ref-sim |" in proc.stdout  # the summary is printed too


def test_lockstep_check_reports_the_same_with_workers_and_in_process(tmp_path):
    """`lockstep check` runs its suite on pytest-xdist workers by default (--jobs auto); the report
    aggregated from the workers counts what one process counts; a bad --jobs is one usage line."""
    counts = {}
    for jobs in ("2", "1"):
        out = tmp_path / f"jobs{jobs}"
        proc = subprocess.run(
            [sys.executable, "-m", "lockstep", "check", "--engines", "ref-sim,ort-cpu", "--jobs", jobs,
             "--report-dir", str(out), "-q", "-p", "no:cacheprovider", "-m", "node_suite or golden",
             "-k", "test_abs or test_acos or tiny-fp32-standard and not kv64"],
            cwd=ROOT, capture_output=True, text=True, timeout=600)
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
        assert ("bringing up nodes" in proc.stdout) == (jobs == "2"), proc.stdout[-2000:]
        counts[jobs] = json.loads((out / "report.json").read_text())["summary"]["engines"]
    assert counts["2"] == counts["1"] and counts["1"]["ref-sim"]["passed"] > 4, f"result: {counts}"
    proc = subprocess.run([sys.executable, "-m", "lockstep", "check", "--jobs", "many"], cwd=tmp_path,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and proc.stderr.strip().splitlines() == [
        "lockstep: error: --jobs 'many': a number of processes (1: in this process) or auto"], proc.stderr


def test_summary_counts_and_gaps():
    outcomes = {
        "a[ref-sim-test_x]": {"outcome": "passed", "engine": "ref-sim", "ops": ["Add"]},
        "a[ref-sim-test_y]": {"outcome": "failed", "engine": "ref-sim", "ops": ["Add", "Loop"]},
        "a[ort-cpu-test_y]": {"outcome": "skipped", "engine": "ort-cpu", "ops": ["Add", "Loop"],
                              "reason": "unsupported: ort-cpu: operator or type not implemented"},
        "a[ref-cuda-test_y]": {"outcome": "skipped", "engine": "ref-cuda", "ops": ["Loop"],
                               "reason": "lockstep: unavailable: ref-cuda: no GPU"},
    }
    outcomes["tests/test_audit.py::test_tree"] = {"outcome": "passed"}  # lockstep's own: no engine
    s = summarize(outcomes)
    assert s["engines"]["ref-sim"] == {"passed": 1, "failed": 1, "xfailed": 0, "skipped": 0}
    assert s["engines"]["(no engine)"] == {"passed": 1, "failed": 0, "xfailed": 0, "skipped": 0}, \
        "result: lockstep's own tests are a labelled row, not an unlabelled '-' engine"
    assert s["gaps"] == {"Add": {"ort-cpu": 1, "ref-sim": 1}, "Loop": {"ort-cpu": 1, "ref-sim": 1}}
    md = render_markdown(s)
    assert "| Loop | 1 | 1 |" in md and "ref-cuda" not in md.split("## Gaps")[1]


def _node_suite(tmp_path, toml: str, *extra: str):
    exp = tmp_path / "exp.toml"
    exp.write_text(toml)
    return subprocess.run(
        [sys.executable, "-m", "pytest", "conformance/node_suite", "-m", "node_suite", "--engines=ref-sim", "-q",
         "-p", "no:cacheprovider", f"--lockstep-expectations={exp}", *extra],
        cwd=ROOT, capture_output=True, text=True, timeout=300,
    )


def test_expectations_that_match_nothing_or_lack_a_reason_are_errors(tmp_path):
    stale = '[[expect]]\nengine = "ref-sim"\npattern = "test_no_such_case*"\nkind = "xfail"\nreason = "x"\n'
    proc = _node_suite(tmp_path, stale, "-k", "test_abs")
    assert proc.returncode == 4 and "entries matching no case" in proc.stdout + proc.stderr


@pytest.mark.contract("expectations.stale_entry_is_usage_error_on_workers")
def test_a_stale_entry_is_a_usage_error_on_pytest_xdist_workers_too(tmp_path):
    """Contract: under pytest-xdist (the README's `pytest -n auto`) a stale entry, of a node case or of
    a test function's key, ends the run as a usage error (exit 4) naming it, before any test runs; a
    worker raising it was an INTERNALERROR. An entry that matches keeps the run going."""
    stale = ('[[expect]]\nengine = "ref-sim"\npatterns = ["test_no_such_case*", "test_square_product[no-such-shape]"]\n'
             'kind = "xfail"\nreason = "x"\n')
    proc = _node_suite(tmp_path, stale, "-k", "test_abs or test_square_product", "-n", "2")
    out = proc.stdout + proc.stderr
    assert proc.returncode == 4 and "INTERNALERROR" not in out, out[-3000:]
    assert "ref-sim test_no_such_case*" in out and "ref-sim test_square_product[no-such-shape]" in out, out[-3000:]
    assert " passed" not in out, out[-3000:]
    fine = '[[expect]]\nengine = "ref-sim"\npattern = "test_abs"\nkind = "skip"\nreason = "x"\n'
    proc = _node_suite(tmp_path, fine, "-k", "test_abs", "-n", "2")
    assert proc.returncode == 0 and "skipped" in proc.stdout, proc.stdout[-3000:] + proc.stderr[-2000:]
    no_reason = '[[expect]]\nengine = "ref-sim"\npattern = "test_abs"\nkind = "xfail"\n'
    proc = _node_suite(tmp_path, no_reason, "-k", "test_abs")
    assert proc.returncode == 4 and "needs engine, pattern or patterns, kind (xfail|skip|unsupported) and reason" in proc.stdout + proc.stderr


def test_an_xfail_that_passes_fails_the_run(tmp_path):
    strict = '[[expect]]\nengine = "ref-sim"\npattern = "test_abs"\nkind = "xfail"\nreason = "stale"\n'
    proc = _node_suite(tmp_path, strict, "-k", "test_abs")
    assert proc.returncode == 1 and "XPASS(strict)" in proc.stdout


def test_jobs_auto_runs_in_process_under_a_pytest_xdist_worker(monkeypatch):
    """Contract: `--jobs auto` starts workers, except where its own options choose, or where it
    runs inside a pytest-xdist worker (a test running `lockstep check`: the outer run has the CPUs)."""
    from lockstep.conformance.cli import _workers

    monkeypatch.delenv("PYTEST_XDIST_WORKER", raising=False)
    steal = ["--dist", "worksteal"]  # an idle worker takes tests from a busy one
    assert _workers("auto", []) == ["-n", "auto", *steal] and _workers("3", []) == ["-n", "3", *steal]
    assert _workers("auto", ["-n", "2"]) == [] and _workers("1", []) == [] and _workers("auto", ["-p", "no:xdist"]) == []
    monkeypatch.setenv("PYTEST_XDIST_WORKER", "gw1")
    assert _workers("auto", []) == [] and _workers("2", []) == ["-n", "2", *steal]


def test_an_expected_tripwire_failure_is_said_as_expected_not_fatal():
    """result (issue 54, point 6): a tripwire that fails where the engine's expectations record it
    (xfailed) is said "fatal, expected" in the terminal summary and "FATAL, expected" on the plot, and
    counted apart; an unexpected one stays FATAL."""
    import json
    from types import SimpleNamespace

    from lockstep.conformance.plugin_outcomes import OutcomeRecorder
    from lockstep.conformance.plugin_state import STATE, SuiteState
    from lockstep.conformance.plugin_summary import terminal_summary

    config = SimpleNamespace(stash={STATE: SuiteState(shard=None)}, getoption=lambda *a, **k: None)
    rec = OutcomeRecorder(config)
    for i, expected in enumerate((True, False)):
        trip = {"engine": "e", "model": f"m{i}", "pos": 20, "near_tie": False, "recorded": 1, "engine_token": 2,
                "oracle_margin": 0.5, "band": 0.01}
        report = SimpleNamespace(nodeid=f"test_tripwire[e-m{i}]", when="call", failed=not expected, skipped=expected,
                                 user_properties=[("engine", "e"), ("tripwire", json.dumps(trip))], longrepr=None)
        if expected:
            report.wasxfail = "reason"
        rec.pytest_runtest_logreport(report)
    lines = []
    tr = SimpleNamespace(section=lambda *a, **k: None, write_line=lambda text, **k: lines.append(text))
    terminal_summary(tr, config, config.stash[STATE])
    said = {line.split(":")[0]: line for line in lines if "position 20" in line}
    assert said["e m0"].endswith("fatal, expected (a known failure its expectations record: xfailed)"), said
    assert said["e m1"].endswith(": FATAL"), said


def _node_case(engine: str, case: str, op: str, outcome: str, **extra) -> tuple[str, dict]:
    return (f"conformance/node_suite/test_node_cases.py::test_node_case[{engine}-{case}]",
            {"outcome": outcome, "engine": engine, "op": op, "ops": [op], "key": case, **extra})


def test_failures_are_grouped_by_op_most_frequent_first_and_a_located_lock_by_its_node():
    """result (issue 54, point 6): report.md groups the failures by operator with counts, most first:
    node cases by their op, a failing lock by the op of its located first divergent node, a lock
    located at no node by its model; a passing or xfailed case is no failure."""
    from lockstep.conformance.report import failures_by_op

    long_name = "/model/layers.11/self_attn/" + "very_long_scope/" * 30 + "MatMul_3"
    lock = {"outcome": "failed", "engine": "my-engine", "failure": "wrong value", "message": "breaks the lock",
            "locate": {"model": "tiny-fp32-standard", "engine": "my-engine", "mode": "stepwise", "position": 20,
                       "first": {"name": long_name, "op_type": "MatMul", "node": 7},
                       "points": [[1, 1e-7, 1e-4, "in", 3], [4, 0.25, 1e-4, "out", 7]]}}
    unlocated = {"outcome": "failed", "engine": "my-engine", "message": "diverges",
                 "golden": {"model": "tiny-fp16-standard", "mode": "prefill", "positions": [], "engine_margins": []}}
    outcomes = dict([
        _node_case("my-engine", "test_softmax_axis_0", "Softmax", "failed", failure="wrong value", message="off"),
        _node_case("my-engine", "test_softmax_axis_1", "Softmax", "failed", failure="error", message="raised"),
        _node_case("ort-cpu", "test_softmax_axis_1", "Softmax", "passed"),
        _node_case("my-engine", "test_softmax_axis_2", "Softmax", "xfailed", failure="wrong value"),
        _node_case("my-engine", "test_matmul_2d", "MatMul", "failed", failure="wrong value", message="off"),
        _node_case("my-engine", "test_acos", "Acos", "failed", failure="wrong value", message="off"),
    ])
    outcomes["conformance/golden/test_golden_locks.py::test_teacher_forced_lock[my-engine-tiny-fp32-standard-stepwise]"] = lock
    outcomes["conformance/golden/test_golden_locks.py::test_tripwire[my-engine-tiny-fp16-standard]"] = unlocated
    groups = [(g, len(m)) for g, m in failures_by_op(outcomes)]
    assert groups == [("MatMul", 2), ("Softmax", 2), ("Acos", 1), ("model tiny-fp16-standard", 1)], groups
    md = render_markdown(summarize(outcomes), None, outcomes)
    section = md.split("## Failures by operator")[1]
    rows = [line for line in section.splitlines() if line.startswith("| ") and not line.startswith("| op")]
    assert rows[0].startswith("| MatMul | 2 | my-engine 2 |") and rows[1].startswith("| Softmax | 2 | my-engine 2 |"), rows
    assert "| Acos | 1 |" in rows[2] and "| model tiny-fp16-standard | 1 |" in rows[3], rows
    # contract: the located node is shown whole (a name far past the message's 300 characters), with its error
    assert (f"  - located: first divergent node `{long_name}` (MatMul, node 7), error 0.25 against a band of 0.0001, "
            "in tiny-fp32-standard on my-engine (stepwise, position 20)") in md.splitlines(), md


def test_rows_that_are_no_engine_are_labelled_and_explained_under_the_table():
    """result (issue 54, point 6): the plugin's `-` (a test with no engine) is the row `(no engine)`, and a
    line under the engine table says what it and `reference-runtime` (the reference runtime's own tests)
    are; a report with only engines has no such line."""
    from lockstep.contracts.pytest_plugin import OWN

    from lockstep.conformance.report import OWN_RUNTIME

    assert OWN_RUNTIME == OWN, "contract: the row the reference runtime's plugin writes is the one explained"
    outcomes = dict([_node_case("ref-sim", "test_acos", "Acos", "passed")])
    outcomes["conformance/golden/test_golden_locks.py::test_snapshot_is_the_oracle[mine]"] = {"outcome": "passed",
                                                                                              "engine": "-"}
    outcomes["contracts/suite/test_builtin_snapshots.py::test_snapshot[x]"] = {"outcome": "passed",
                                                                             "engine": "reference-runtime"}
    s = summarize(outcomes)
    assert list(s["engines"]) == ["(no engine)", "ref-sim", "reference-runtime"], s["engines"]
    md = render_markdown(s, {"ref-sim": {}}, outcomes)
    table_end = md.index("| reference-runtime |")
    legend = md[table_end:].split("\n\n")[1]
    assert legend.startswith("Rows that are not engines: `(no engine)`: tests that run no engine") and \
        "`reference-runtime`: the reference runtime's own tests" in legend and "\n" not in legend, legend
    only = dict([_node_case("ref-sim", "test_acos", "Acos", "passed")])
    assert "Rows that are not engines" not in render_markdown(summarize(only), {"ref-sim": {}}, only)


def test_the_located_line_carries_the_failing_locks_whole_sentence():
    """result: a lock's locate sentence (a cache finding, its command) reaches report.md whole, though
    the failure message's first line is cut at 300 characters."""
    from lockstep.conformance.report import located_line

    sentence = "in e's decode session the first divergent cache is past.0.key ... " + "x" * 400 + ": lockstep locate m --session eager"
    line = located_line({"locate": {"model": "m", "engine": "e", "mode": "stepwise", "position": 18, "first": None,
                                    "points": [], "sentence": sentence}})
    assert line.endswith(sentence) and "stepwise, position 18" in line
    assert located_line({"locate": {"model": "m", "engine": "e", "mode": "prefill", "first": None}}).endswith(
        "(the message says where the divergence is)")
