"""lockstep as a required check that fails closed and says what failed: a kernel dropped from the
registry fails the suite, naming the command that records it; FAILED lines carry their message; an
expected-unsupported case that runs is reported; a required engine
absent or unselected is one line and a non-zero exit; a usage error prints no report; the report
names failures, versions and commit, JUnit carries engine/op/marker properties, the step summary
gets the report; shards merge; xdist workers are pinned to GPUs; regenerate --check fails on drift."""

from __future__ import annotations

import json
import re
import os
import subprocess
import sys
from pathlib import Path

import pytest

import lockstep.golden.anchors as anchors
from lockstep.conformance.cli import main
from lockstep.kernels.registry import Registry

ROOT = Path(__file__).resolve().parent.parent


def _env(**extra):
    env = {k: v for k, v in os.environ.items() if not k.startswith("LOCKSTEP_REQUIRE_")}
    if "PYTHONPATH" in extra and env.get("PYTHONPATH"):  # in front of, not instead of, where lockstep may be
        extra["PYTHONPATH"] = os.pathsep.join([extra["PYTHONPATH"], env["PYTHONPATH"]])
    env.update(extra)
    return env


def _lockstep(args, cwd, **env):
    proc = subprocess.run([sys.executable, "-m", "lockstep", *args], cwd=cwd, env=_env(**env), capture_output=True,
                          text=True, timeout=600)
    return proc.returncode, proc.stdout + proc.stderr


def test_a_kernel_removed_from_the_registry_fails_the_suite(pytester, monkeypatch):
    """The issue's case: Sigmoid dropped from the registry turned 2 node cases into skips and the run
    stayed green; now each case it newly cannot run is a failure naming what to record."""
    real = Registry.lookup
    monkeypatch.setattr(Registry, "lookup", lambda self, domain, op, opset: None if op == "Sigmoid"
                        else real(self, domain, op, opset))
    result = pytester.runpytest("--pyargs", "lockstep.conformance.node_suite", "-m", "node_suite", "-k", "sigmoid",
                                "--engines", "ref-sim", "-p", "no:cacheprovider")
    out = result.stdout.str()
    assert result.ret == pytest.ExitCode.TESTS_FAILED
    assert "ref-sim newly cannot run test_sigmoid: model uses operators this runtime cannot run: " \
           "Sigmoid_0: no kernel for ai.onnx::Sigmoid" in out, "result: the engine named once"
    assert "lockstep: engine tests that newly cannot run" in out
    assert "ref-sim: 2 newly unsupported (2 node cases of 1 operator): test_sigmoid, test_sigmoid_example" in out
    assert "(this run wrote no report: rerun with --lockstep-report-dir reports" in out
    assert " --engine ref-sim --new --engine-field >> " in out and "expectations.toml" in out, (
        "contract: a built-in engine's cases go to the expectations file in use, with their engine named")
    result.assert_outcomes(failed=2, passed=6)


def test_an_expected_unsupported_case_that_runs_is_reported(pytester, tmp_path):
    exp = tmp_path / "exp.toml"
    exp.write_text('[[expect]]\nengine = "ref-sim"\nkind = "unsupported"\nreason = "pretend"\npatterns = ["test_abs"]\n')
    result = pytester.runpytest("--pyargs", "lockstep.conformance.node_suite", "-m", "node_suite", "-k", "test_abs",
                                "--engines", "ref-sim", f"--lockstep-expectations={exp}", "-p", "no:cacheprovider")
    assert result.ret == pytest.ExitCode.OK
    result.stdout.fnmatch_lines(["*expected-unsupported cases that now run (delete their entries)*",
                                 "ref-sim: 1: test_abs"])


UNAVAILABLE_ENGINE = '''
class Absent:
    name = "absent"
    def available(self):
        return False, "its driver is not installed"
    def prepare(self, model):
        raise AssertionError("never")

def make():
    return Absent()
'''


def test_a_required_engine_absent_or_unselected_is_one_line(tmp_path):
    (tmp_path / "absent_engine.py").write_text(UNAVAILABLE_ENGINE)
    base = [sys.executable, "-m", "pytest", "--pyargs", "lockstep.conformance.golden", "-m", "golden", "-q",
            "-p", "no:cacheprovider"]
    proc = subprocess.run(base + ["--engines", "ref-sim"], cwd=tmp_path, capture_output=True, text=True, timeout=300,
                          env=_env(LOCKSTEP_REQUIRE_ENGINES="ref-cuda"))
    assert proc.returncode == 4 and proc.stdout.strip() == "" and proc.stderr.strip().count("\n") == 0, proc.stderr
    assert "LOCKSTEP_REQUIRE_ENGINES names ref-cuda, which is not selected (engines: ref-sim)" in proc.stderr
    proc = subprocess.run(base + ["--engines", "absent_engine:make"], cwd=tmp_path, capture_output=True, text=True,
                          timeout=300, env=_env(LOCKSTEP_REQUIRE_ENGINES="absent", PYTHONPATH=str(tmp_path)))
    assert proc.returncode == 4 and proc.stderr.strip().count("\n") == 0, proc.stderr
    assert "LOCKSTEP_REQUIRE_ENGINES: engine absent is unavailable here: its driver is not installed" in proc.stderr


@pytest.mark.contract("plugin.unavailable_engine_counted")
def test_an_unavailable_engine_is_one_skip_per_test_function_counting_all_its_tests(tmp_path):
    """An unavailable engine's tests are not skipped one by one: each test function keeps one skip,
    with the engine's reason, that stands for all of that function's tests of the engine; the rest
    are deselected, and the terminal summary and the report still count every one of them."""
    (tmp_path / "absent_engine.py").write_text(UNAVAILABLE_ENGINE)
    rc, out = _lockstep(["check", "--engines", "ref-sim,absent_engine:make", "--jobs", "1", "--report-dir", "rep",
                         "-m", "node_suite", "-k", "test_abs or test_acos", "-p", "no:cacheprovider"],
                        tmp_path, PYTHONPATH=str(tmp_path))
    assert rc == 0, out[-3000:]
    counts = json.loads((tmp_path / "rep" / "report.json").read_text())["summary"]["engines"]
    ran = counts["ref-sim"]["passed"]
    assert ran >= 4 and counts["absent"] == {"passed": 0, "failed": 0, "xfailed": 0, "skipped": ran}, counts
    assert f"absent: {ran} test(s) skipped: its driver is not installed" in out, out[-3000:]
    # pytest's own line counts the items that ran: ref-sim's and one kept skip per test function of the absent
    # engine (here one: test_node_case); the others are deselected (the substring match on "N deselected" this
    # replaces passed only while the -m/-k total happened to end in ran - 2)
    line = re.search(r"=+ (\d+) passed, (\d+) skipped, (\d+) deselected", out)
    assert line and int(line.group(1)) == ran and int(line.group(2)) == 1, (
        "contract: one skip kept per test function", out[-1500:])


def test_a_usage_error_prints_no_report(tmp_path):
    old = tmp_path / "reports"
    old.mkdir()
    (old / "report.md").write_text("# an OLD report from yesterday\n")
    rc, out = _lockstep(["check", "--engines", "nope", "--report-dir", str(old)], tmp_path)
    assert rc == 4 and "unknown engine 'nope'" in out
    assert "OLD report" not in out, "contract: only a run that happened prints its report"


def test_failed_lines_carry_their_message_in_an_80_column_log(pytester, monkeypatch):
    """pytest drops a FAILED line's message when the node id leaves no room (an 80-column log); on
    lockstep's suite each FAILED line carries its first message line in full."""
    monkeypatch.setenv("COLUMNS", "80")
    real = Registry.lookup
    monkeypatch.setattr(Registry, "lookup", lambda self, domain, op, opset: None if op == "Sigmoid"
                        else real(self, domain, op, opset))
    result = pytester.runpytest("--pyargs", "lockstep.conformance.node_suite", "-m", "node_suite", "-k",
                                "test_sigmoid_example or test_abs", "--engines", "ref-sim", "-p", "no:cacheprovider")
    lines = [line for line in result.stdout.lines if line.startswith("FAILED ")]
    assert len(lines) == 1 and lines[0].startswith(
        "FAILED test_node_cases.py::test_node_case[ref-sim-test_sigmoid_example] - lockstep: ref-sim newly cannot run "
        "test_sigmoid_example: model uses operators this runtime cannot run: Sigmoid_0: no kernel for ai.onnx::Sigmoid"
    ), result.stdout.lines[-20:]
    assert result.stdout.str().count("short test summary info") == 1, "contract: one short summary, not two"


def test_the_report_names_failures_versions_commit_and_carries_junit_properties(tmp_path):
    example = ROOT / "examples" / "engine-plugin"
    summary = tmp_path / "step-summary.md"
    rc, out = _lockstep(["check", "--engines", "lockstep_example_engine:make_buggy_engine", "--report-dir", "rep",
                         "-m", "golden", "-k", "tiny-fp32-standard and not kv64", "-p", "no:cacheprovider", "-q"],
                        tmp_path, PYTHONPATH=str(example), GITHUB_STEP_SUMMARY=str(summary), LOCKSTEP_COMMIT="abc1234")
    assert rc == 1, out[-3000:]
    md = (tmp_path / "rep" / "report.md").read_text()
    assert "## Failures (2)" in md and "first divergence at position 18" in md
    assert "| commit | abc1234 |" in md and "| onnx |" in md and "| numpy |" in md
    assert summary.read_text() == md, "contract: the Markdown report goes to GITHUB_STEP_SUMMARY"
    junit = (tmp_path / "rep" / "junit.xml").read_text()
    assert '<property name="engine" value="example-buggy" />' in junit and 'name="markers" value="golden"' in junit
    assert '<property name="precision" value="fp32" />' in junit, "result: the tests' own properties too"
    assert "record_property is incompatible" not in out and "PytestWarning" not in out, (
        "contract: JUnit in the xunit1 family, whose testcases take properties: no warning per test")
    assert "![golden-tiny-fp32-standard.png](golden-tiny-fp32-standard.png)" in md
    assert (tmp_path / "rep" / "golden-tiny-fp32-standard.png").is_file() and (tmp_path / "rep" / "scoreboard.html").is_file()


def test_a_missing_golden_dir_is_one_line_and_no_report(tmp_path):
    """``--golden-dir`` naming no folder: one line before anything runs (exit 2 from `lockstep
    check`, 4 from pytest's usage error), no traceback, no report; `golden regenerate --dir` names
    its own option."""
    rc, out = _lockstep(["check", "--engines", "ref-sim", "--golden-dir", "nope", "-m", "golden"], tmp_path)
    assert rc == 2 and out.strip() == "lockstep: error: --golden-dir nope: no such directory", out[-3000:]
    assert not (tmp_path / "reports").exists(), "contract: a usage error writes no report"
    proc = subprocess.run([sys.executable, "-m", "pytest", "--pyargs", "lockstep.conformance.golden", "--engines",
                           "ref-sim", "--golden-dir", "nope", "-p", "no:cacheprovider", "-q"], cwd=tmp_path,
                          env=_env(), capture_output=True, text=True, timeout=300, check=False)
    assert proc.returncode == 4 and proc.stderr.strip() == "ERROR: --golden-dir nope: no such directory", (
        proc.stdout[-2000:] + proc.stderr[-2000:])
    assert "Traceback" not in proc.stdout + proc.stderr
    rc, out = _lockstep(["golden", "regenerate", "--dir", "nope", "--dry-run"], tmp_path)
    assert rc == 2 and out.strip().startswith("lockstep: error: --dir nope: no such directory"), out
    (tmp_path / "empty").mkdir()
    rc, out = _lockstep(["golden", "regenerate", "--dir", "empty", "--dry-run"], tmp_path)
    assert rc == 2 and "--dir empty: holds no snapshot" in out and "--golden-dir" not in out, out


def test_check_help_names_markers_and_factory_engines(tmp_path):
    rc, out = _lockstep(["check", "--help"], tmp_path)
    assert rc == 0
    text = " ".join(out.split())
    for needle in ("-m MARKEXPR", "node_suite", "golden", "capture", "pkg.module:factory",
                   "lockstep check --engines my_module:make_engine -m node_suite"):
        assert needle in text, f"contract: `lockstep check --help` says {needle!r}:\n{out}"


def test_shards_partition_the_suite_and_merge_into_one_report(tmp_path):
    args = ["--engines", "ref-sim", "-m", "node_suite", "-k", "test_abs or test_add or test_acos", "-q",
            "-p", "no:cacheprovider"]
    assert _lockstep(["check", "--report-dir", "all", *args], tmp_path)[0] == 0
    for i in (1, 2, 3):
        assert _lockstep(["check", "--report-dir", f"s{i}", "--lockstep-shard", f"{i}/3", *args], tmp_path)[0] == 0
    rc, out = _lockstep(["report", "merge", "s1/report.json", "s2/report.json", "s3/report.json", "--output", "m"],
                        tmp_path)
    assert rc == 0, out
    whole = json.loads((tmp_path / "all" / "report.json").read_text())
    merged = json.loads((tmp_path / "m" / "report.json").read_text())
    parts = [set(json.loads((tmp_path / f"s{i}" / "report.json").read_text())["tests"]) for i in (1, 2, 3)]
    assert not (parts[0] & parts[1]) and not (parts[1] & parts[2]) and all(parts), "result: disjoint, none empty"
    assert set(merged["tests"]) == set(whole["tests"]) and merged["summary"] == whole["summary"]
    rc, out = _lockstep(["report", "merge", "s1/report.json", "s1/report.json", "--output", "m2"], tmp_path)
    assert rc == 2 and "the shards overlap" in out


PIN = '''
import os

def test_where(worker_id):
    open(f"gpu-{worker_id}", "w").write(os.environ.get("CUDA_VISIBLE_DEVICES", "unset"))
'''


def test_xdist_workers_are_pinned_one_gpu_each(tmp_path):
    (tmp_path / "test_pin.py").write_text(PIN + PIN.replace("test_where", "test_there").replace("gpu-", "gpu2-"))
    proc = subprocess.run([sys.executable, "-m", "pytest", "-n", "2", "--lockstep-gpus", "4,5", "-q",
                           "-p", "no:cacheprovider", "-p", "no:randomly", "test_pin.py"], cwd=tmp_path,
                          capture_output=True, text=True, timeout=300, env=_env())
    assert proc.returncode == 0, proc.stdout + proc.stderr
    seen = {p.name.split("-")[-1]: p.read_text() for p in tmp_path.glob("gpu*-gw*")}
    assert seen.get("gw0") == "4" and seen.get("gw1") == "5", seen


def test_regenerate_check_fails_on_drift_and_passes_when_clean(tmp_path, monkeypatch, capsys):
    assert main(["golden", "regenerate", "--check", "--model", "tiny-fp32-standard"]) == 0
    monkeypatch.setattr(anchors, "SNAPSHOT_DIR", tmp_path)
    snap = anchors.compute_anchors("tiny-fp32-standard")
    snap["positions"][3]["margin"] += 0.5
    path = anchors.write_snapshot(snap)
    before = path.read_text()
    capsys.readouterr()
    assert main(["golden", "regenerate", "--check", "--model", "tiny-fp32-standard"]) == 1
    out = capsys.readouterr().out
    assert "pos " in out and "margin" in out and "check: 1 of 1 snapshot(s) would change; nothing written" in out
    assert path.read_text() == before, "contract: --check writes nothing"


@pytest.mark.parametrize("dist", ["ml_dtypes", "numpy", "onnx"])
def test_an_entry_keyed_to_a_case_generating_package_applies_only_with_its_versions(dist):
    """The node cases' expected outputs depend on onnx, ml_dtypes and numpy: an entry keyed to one
    of them (``when = { ml_dtypes = "==0.7.*" }``) applies with the installed version it names only."""
    import importlib

    from lockstep.conformance.expectations import Entry, applies

    got = importlib.import_module(dist).__version__
    assert applies(Entry("ref-sim", ["test_x"], "xfail", "why", {dist: f"=={got}"})), \
        f"contract: an entry keyed {dist}=={got} applies with {dist} {got} installed"
    assert not applies(Entry("ref-sim", ["test_x"], "xfail", "why", {dist: f"!={got}"})), \
        f"contract: an entry keyed to other {dist} versions does not apply with {got}"
