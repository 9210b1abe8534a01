"""Repository-wide pytest configuration.

lockstep's plugin (devices, engines, golden models, mutants, markers, reports) is loaded by its
``pytest11`` entry point, as in any repository where the package is installed. Here:

- pytest's own ``pytester``, for the tests that run pytest on generated test files;
- the trained golden models (SmolLM2) are required in this repository's runs: without the ``models``
  extra or its GGUF they fail instead of being counted skips (an explicit LOCKSTEP_REQUIRE_MODELS,
  even empty, wins). Only in runs started inside this repository: an editable install puts this
  file above the packaged suite, so pytest loads it into a user's ``lockstep check`` or
  ``pytest --pyargs lockstep.conformance`` started elsewhere, where the policy is not theirs.

- under pytest-xdist, the longest serial units of work are handed out first (the packaging module's
  chain of venv installs and checks, the mutant catalogue's CI subset, the SmolLM2 module): handed
  out last, as collection order did, one worker ran them alone while the other sat idle.

The unit tests' own autouse fixture is in ``tests/conftest.py``: the thousands of conformance node
cases do not pay for it.
"""

import os
from pathlib import Path

import pytest


pytest_plugins = ["pytester"]

REPOSITORY = Path(__file__).resolve().parent


def started_here(config) -> bool:
    """Whether this run was started inside the repository (its invocation directory is in it)."""
    return Path(config.invocation_params.dir).resolve().is_relative_to(REPOSITORY)


@pytest.hookimpl(tryfirst=True)
def pytest_configure(config):
    if started_here(config):  # before the workers start: they inherit it
        os.environ.setdefault("LOCKSTEP_REQUIRE_MODELS", "all")


# the longest units of one worker each (measured: docs/benchmarks.md, issue 28), longest first
LONG_FIRST = ("tests/test_packaging.py::", "tests/test_mutation_catalogue.py::test_the_ci_subset_is_killed",
              "tests/test_smollm2.py::")


@pytest.hookimpl(trylast=True)  # after lockstep's own order (its largest golden models first)
def pytest_collection_modifyitems(config, items):
    if not started_here(config):
        return
    if not getattr(config.option, "numprocesses", None) and not hasattr(config, "workerinput"):
        return  # one process: the order a reader expects

    def rank(item):
        return next((i for i, prefix in enumerate(LONG_FIRST) if item.nodeid.startswith(prefix)), len(LONG_FIRST))

    items.sort(key=rank)  # stable: each module's own order kept
