"""The unit tests' pytest configuration (the repository-wide one is ../conftest.py)."""

import pytest


@pytest.fixture(autouse=True)
def _no_lockstep_requirements(monkeypatch):
    """The unit tests in tests/ run pytest and lockstep in subprocesses of their own choosing: the
    outer run's LOCKSTEP_REQUIRE_* (a GPU lane's requirements) must not leak into those. (An
    autouse fixture: a ``usefixtures`` mark added at collection time is never applied; monkeypatch
    lives here, in tests/, so that the conformance suite's thousands of node cases do not pay for it.)"""
    for key in ("LOCKSTEP_REQUIRE_ENGINES", "LOCKSTEP_REQUIRE_DEVICES"):
        monkeypatch.delenv(key, raising=False)
