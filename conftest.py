"""Repository-wide pytest configuration.

lockstep's plugin (devices, engines, golden models, mutants, markers, reports) is loaded by its
``pytest11`` entry point, as in any repository where the package is installed. Here:

- pytest's own ``pytester``, for the tests that run pytest on generated test files;
- the trained golden models (SmolLM2) are required in this repository's runs: without the ``models``
  extra or its GGUF they fail instead of being counted skips (an explicit LOCKSTEP_REQUIRE_MODELS,
  even empty, wins).
"""

import os

import pytest

pytest_plugins = ["pytester"]

os.environ.setdefault("LOCKSTEP_REQUIRE_MODELS", "all")


@pytest.fixture(autouse=True)
def _no_lockstep_requirements(request):
    """The unit tests in tests/ run pytest and lockstep in subprocesses of their own choosing: the
    outer run's LOCKSTEP_REQUIRE_* (a GPU lane's requirements) must not leak into those. (An
    autouse fixture: a ``usefixtures`` mark added at collection time is never applied; monkeypatch
    is taken only for those tests, not for each of the suite's thousands of node cases.)"""
    parts = request.node.path.parts
    if "tests" in parts and "conformance" not in parts:
        monkeypatch = request.getfixturevalue("monkeypatch")
        for key in ("LOCKSTEP_REQUIRE_ENGINES", "LOCKSTEP_REQUIRE_DEVICES"):
            monkeypatch.delenv(key, raising=False)
