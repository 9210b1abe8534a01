"""The unit tests' pytest configuration (the repository-wide one is ../conftest.py)."""

import onnx  # noqa: F401  (see below)
import pytest

# pytester's in-process runs restore sys.modules after each run: a module first imported inside one is
# imported again by the next, and onnx's C++ extension cannot be (protobuf aborts the process on the
# second registration of onnx.proto). Imported here, before any such run, it is kept across them.


@pytest.fixture(autouse=True)
def _no_lockstep_requirements(monkeypatch):
    """The unit tests in tests/ run pytest and lockstep in subprocesses of their own choosing: the
    outer run's LOCKSTEP_REQUIRE_* (a GPU lane's requirements) must not leak into those. (An
    autouse fixture: a ``usefixtures`` mark added at collection time is never applied; monkeypatch
    lives here, in tests/, so that the conformance suite's thousands of node cases do not pay for it.)"""
    for key in ("LOCKSTEP_REQUIRE_ENGINES", "LOCKSTEP_REQUIRE_DEVICES"):
        monkeypatch.delenv(key, raising=False)
