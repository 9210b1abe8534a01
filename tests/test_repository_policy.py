"""The repository's own pytest policy (conftest.py: the trained models required) stays out of a user's run.

An editable install puts the repository's conftest.py above the packaged suite, so pytest loads it
into ``pytest --pyargs lockstep.conformance`` started anywhere. Contract: the policy applies to runs
started inside the repository only; a user's run elsewhere sees ``LOCKSTEP_REQUIRE_MODELS`` as they
set it (unset: missing models are counted skips)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

PROBE = '''
import os
def pytest_collection_finish(session):
    with open(os.environ["PROBE_OUT"], "w") as f:
        f.write(repr(os.environ.get("LOCKSTEP_REQUIRE_MODELS")))
'''


def _required_models_seen(where: Path, tmp_path: Path) -> str:
    """What ``LOCKSTEP_REQUIRE_MODELS`` a suite run started in ``where`` sees, by a plugin that records it."""
    (tmp_path / "policy_probe.py").write_text(PROBE)
    out = tmp_path / "seen.txt"
    env = {k: v for k, v in os.environ.items() if k not in ("LOCKSTEP_REQUIRE_MODELS", "PYTEST_XDIST_WORKER",
                                                            "PYTEST_ADDOPTS")}
    env.update(PROBE_OUT=str(out), PYTHONPATH=os.pathsep.join([str(tmp_path), env.get("PYTHONPATH", "")]))
    proc = subprocess.run([sys.executable, "-m", "pytest", "--pyargs", "lockstep.conformance", "-p", "policy_probe",
                           "-n", "0", "-p", "no:cacheprovider", "--co", "-q", "--engines", "ref-sim",
                           "-m", "golden", "-k", "tiny-fp32-standard and not stepwise"],
                          cwd=where, env=env, capture_output=True, text=True, timeout=300)
    assert out.exists(), f"the run did not reach collection: {proc.stdout[-2000:]}{proc.stderr[-2000:]}"
    return out.read_text()


def test_a_run_started_outside_the_repository_gets_no_repository_policy(tmp_path):
    """Contract: a user's run (started outside the checkout) keeps its own environment."""
    import lockstep.conformance

    if not Path(lockstep.conformance.__file__).resolve().is_relative_to(ROOT):
        pytest.skip("lockstep is installed from a wheel here: the repository's conftest.py is not above the suite")
    elsewhere = tmp_path / "user-repo"
    elsewhere.mkdir()
    assert _required_models_seen(elsewhere, tmp_path) == "None"


def test_a_run_started_in_the_repository_requires_the_trained_models(tmp_path):
    """Contract: this repository's own runs require the trained models (a missing one fails)."""
    assert _required_models_seen(ROOT, tmp_path) == "'all'"
