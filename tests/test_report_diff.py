"""`lockstep report diff`: two runs' reports, or two engines of one, compared (conformance/report_diff.py)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from lockstep.conformance.cli import main

CASES = "conformance/node_suite/test_node_cases.py::test_node_case"
LOCK = "conformance/golden/test_golden_locks.py::test_teacher_forced_lock"


def _case(engine: str, case: str, op: str, outcome: str, **extra) -> tuple[str, dict]:
    return f"{CASES}[{engine}-{case}]", {"outcome": outcome, "engine": engine, "op": op, "ops": [op], "key": case,
                                         **extra}


def _lock(engine: str, margins: list[float], outcome: str = "passed") -> tuple[str, dict]:
    return f"{LOCK}[{engine}-tiny-fp32-standard-prefill]", {
        "outcome": outcome, "engine": engine, "key": "test_teacher_forced_lock[tiny-fp32-standard-prefill]",
        "golden": {"model": "tiny-fp32-standard", "mode": "prefill", "engine": engine, "precision": "fp32",
                   "band": 1e-4, "positions": [18, 19, 20], "oracle_margins": [2.6, 3.1, 0.25],
                   "engine_margins": margins, "violations": []}}


def _write(path, tests: dict, env: dict | None = None):
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"summary": {}, "engines": {}, "environment": env or {"onnxruntime": "1.31.1"},
                                "tests": tests}))
    return path


def _runs(tmp_path):
    """Run A and run B of one engine: acos breaks, asin is fixed, atan becomes unsupported, the lock's
    margin at position 20 shrinks by 2e-3 (position 18 by 1e-6)."""
    a = dict([_case("e", "test_acos", "Acos", "passed"),
              _case("e", "test_asin", "Asin", "failed", failure="wrong value", message="max |diff| 0.5"),
              _case("e", "test_atan", "Atan", "passed"),
              _case("e", "test_abs", "Abs", "passed"),
              _lock("e", [2.6, 3.1, 0.25])])
    b = dict([_case("e", "test_acos", "Acos", "failed", failure="wrong value", message="max |diff| 0.01"),
              _case("e", "test_asin", "Asin", "passed"),
              _case("e", "test_atan", "Atan", "skipped", reason="unsupported: e: no kernel for Atan"),
              _case("e", "test_abs", "Abs", "passed"),
              _lock("e", [2.600001, 3.1, 0.248])])
    return _write(tmp_path / "a" / "report.json", a), _write(tmp_path / "b" / "report.json", b,
                                                             {"onnxruntime": "1.32.0"})


def test_a_diff_of_two_runs_says_what_newly_fails_passes_skips_and_which_margin_moved(tmp_path, capsys):
    """result: each change in its section, the moved margin with its size against the band; exit status 1
    because a test newly fails; the folders of the reports name them too."""
    a, b = _runs(tmp_path)
    assert main(["report", "diff", str(a), str(b.parent)]) == 1
    out = capsys.readouterr().out
    fails = out.split("newly fails")[1].split("newly passes")[0]
    assert "test_node_case[e-test_acos] [Acos]: passed -> failed: wrong value: max |diff| 0.01" in fails, out
    assert "asin" not in fails and "atan" not in fails and "abs" not in fails, out
    passes = out.split("newly passes")[1].split("newly skipped")[0]
    assert "test_node_case[e-test_asin] [Asin]: failed -> passed" in passes and "acos" not in passes, out
    skipped = out.split("newly skipped or unsupported")[1].split("margins")[0]
    assert "test_node_case[e-test_atan] [Atan]: passed -> unsupported: unsupported: e: no kernel for Atan" in skipped
    moved = out.split("margins and errors that moved")[1]
    assert ("test_teacher_forced_lock[e-tiny-fp32-standard-prefill]: margin at position 20: 0.25 -> 0.248 "
            "(-0.002, 20x its band 0.0001); 2 of its measures moved") in moved, out
    assert "environment: onnxruntime 1.31.1 -> 1.32.0" in out
    assert out.rstrip().endswith("1 newly fail, 1 newly pass, 1 newly skipped, 1 moved: exit status 1"), out
    # the threshold: the 1e-6 move at position 18 is under it, the lock's largest move is not
    assert main(["report", "diff", str(a), str(b), "--threshold", "1e-5"]) == 1
    assert "; 2 of its measures moved" not in capsys.readouterr().out
    assert main(["report", "diff", str(a), str(b), "--threshold", "0.01"]) == 1
    assert "margins and errors that moved by at least 0.01: none" in capsys.readouterr().out


def test_a_diff_with_nothing_newly_failing_exits_0_and_json_says_the_same(tmp_path, capsys):
    """result: B against A has the reverse changes: acos and atan newly pass, asin newly fails; A against
    itself has none (exit status 0); --format json carries the lists and the exit status."""
    a, b = _runs(tmp_path)
    assert main(["report", "diff", str(a), str(a)]) == 0
    out = capsys.readouterr().out
    assert "newly fails (not failing in A, failing in B): none" in out and "moved by any amount: none" in out, out
    assert main(["report", "diff", str(b), str(a), "--format", "json"]) == 1
    d = json.loads(capsys.readouterr().out)
    case = "test_node_cases.py::test_node_case"
    assert [c["test"] for c in d["newly_fails"]] == [f"{case}[e-test_asin]"], d
    assert [(c["test"], c["before"]) for c in d["newly_passes"]] == [
        (f"{case}[e-test_acos]", "failed"), (f"{case}[e-test_atan]", "unsupported")], d
    assert d["newly_skipped"] == [] and d["other"] == [], d
    assert d["moves"][0]["delta"] == pytest.approx(0.002) and d["exit_status"] == 1, d


def test_a_diff_of_two_engines_in_one_report_matches_tests_without_the_engine(tmp_path, capsys):
    """result: --engines X,Y compares X's test with Y's same test (its id without the engine): Y's
    failing acos newly fails, its unsupported atan is newly unsupported, the margins X and Y record
    differ; exit status 1; Y,X the other way round, with no new failure: exit status 0."""
    tests = dict([_case("ref-sim", "test_acos", "Acos", "passed"), _case("ort-cpu", "test_acos", "Acos", "failed",
                                                                         failure="error", message="raised"),
                  _case("ref-sim", "test_atan", "Atan", "passed"),
                  _case("ort-cpu", "test_atan", "Atan", "skipped", reason="unsupported: ort-cpu: not implemented"),
                  _case("ref-sim", "test_abs", "Abs", "passed"), _case("ort-cpu", "test_abs", "Abs", "passed"),
                  _lock("ref-sim", [2.6, 3.1, 0.25]), _lock("ort-cpu", [2.6, 3.1, 0.2501])])
    tests["conformance/golden/test_golden_locks.py::test_snapshot_is_the_oracle[mine]"] = {"outcome": "failed",
                                                                                          "engine": "-"}
    rep = _write(tmp_path / "r" / "report.json", tests)
    assert main(["report", "diff", str(rep), "--engines", "ref-sim,ort-cpu"]) == 1
    out = capsys.readouterr().out
    assert "A: " + str(rep) + " (engine ref-sim)" in out and "compared 4 test(s) on both sides" in out, out
    assert f"{CASES.rsplit('/', 1)[1]}[test_acos] [Acos]: passed -> failed: error: raised" in out, out
    assert "test_node_case[test_atan] [Atan]: passed -> unsupported" in out, out
    assert "test_teacher_forced_lock[tiny-fp32-standard-prefill]: margin at position 20: 0.25 -> 0.2501" in out, out
    assert "snapshot_is_the_oracle" not in out, "result: a test of no engine is on neither side"
    assert main(["report", "diff", str(rep), "--engines", "ort-cpu,ref-sim"]) == 0
    out = capsys.readouterr().out
    assert "test_node_case[test_acos] [Acos]: failed -> passed" in out and "0 newly fail, 2 newly pass" in out, out


def test_runs_from_different_folders_are_matched_by_the_file_name_of_their_ids(tmp_path, capsys):
    """result: a run from a checkout (`conformance/node_suite/test_node_cases.py::...`) and one of `lockstep
    check` (`--pyargs`: `test_node_cases.py::...`) hold the same tests: acos newly fails, nothing is only
    on one side."""
    a = _write(tmp_path / "a.json", dict([_case("e", "test_acos", "Acos", "passed")]))
    b = _write(tmp_path / "b.json", {k.split("/")[-1]: o for k, o in [_case("e", "test_acos", "Acos", "failed")]})
    assert main(["report", "diff", str(a), str(b)]) == 1
    out = capsys.readouterr().out
    assert "compared 1 test(s) on both sides; only in A: 0, only in B: 0" in out, out
    assert "test_node_cases.py::test_node_case[e-test_acos] [Acos]: passed -> failed" in out, out


def _err(capsys) -> str:
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "Traceback" not in err, err
    return err


def test_bad_input_is_one_line_with_exit_status_2(tmp_path, capsys):
    """contract: a missing report, a malformed one, an engine the report does not hold, a wrong number of
    reports: one `lockstep: error:` line naming the problem, exit status 2, no diff printed."""
    a, _ = _runs(tmp_path)
    assert main(["report", "diff", str(a), str(tmp_path / "absent.json")]) == 2
    assert _err(capsys).startswith(f"lockstep: error: {tmp_path / 'absent.json'}: no such file")
    assert main(["report", "diff", str(a), str(tmp_path)]) == 2  # a folder holding no report.json
    assert _err(capsys).startswith(f"lockstep: error: {tmp_path / 'report.json'}: no such file")
    bad = tmp_path / "bad.json"
    bad.write_text('{"tests": {"t": {"outcome": "passed"}')
    assert main(["report", "diff", str(a), str(bad)]) == 2
    assert _err(capsys).startswith(f"lockstep: error: {bad}: not a lockstep report.json (not JSON: ")
    bad.write_text('{"tests": ["t"]}')
    assert main(["report", "diff", str(bad), str(a)]) == 2
    assert _err(capsys).startswith(f"lockstep: error: {bad}: not a lockstep report.json (no \"tests\" object")
    assert main(["report", "diff", str(a), "--engines", "e,nope"]) == 2
    assert _err(capsys) == f"lockstep: error: {a}: no test of engine 'nope' (its engines: e)\n"
    assert main(["report", "diff", str(a)]) == 2
    assert "give two (A B: two runs), or one with --engines X,Y" in _err(capsys)
    assert main(["report", "diff", str(a), "--engines", "e"]) == 2
    assert "two engines, X,Y" in _err(capsys)
    assert main(["report", "diff", str(a), str(a), "--threshold", "-1"]) == 2
    assert "--threshold -1.0: a number >= 0" in _err(capsys)
    assert capsys.readouterr().out == ""


def test_bad_input_through_the_real_command(tmp_path):
    """contract: the installed command's answer to a malformed report: one line on stderr, exit status 2."""
    bad = tmp_path / "report.json"
    bad.write_text("not json")
    proc = subprocess.run([sys.executable, "-m", "lockstep", "report", "diff", str(bad), str(bad)],
                          capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert proc.returncode == 2 and proc.stdout == "", proc.stdout + proc.stderr
    assert proc.stderr.startswith(f"lockstep: error: {bad}: not a lockstep report.json (not JSON: Expecting value") \
        and proc.stderr.count("\n") == 1, proc.stderr
