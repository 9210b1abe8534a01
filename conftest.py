"""Repository-wide pytest configuration.

lockstep's plugin (devices, engines, golden models, mutants, markers, reports) is loaded by its
``pytest11`` entry point, as in any repository where the package is installed. Here:

- pytest's own ``pytester``, for the tests that run pytest on generated test files;
- the trained golden models (SmolLM2) are required in this repository's runs: without the ``models``
  extra or its GGUF they fail instead of being counted skips (an explicit LOCKSTEP_REQUIRE_MODELS,
  even empty, wins).

The unit tests' own autouse fixture is in ``tests/conftest.py``: the thousands of conformance node
cases do not pay for it.
"""

import os


pytest_plugins = ["pytester"]

os.environ.setdefault("LOCKSTEP_REQUIRE_MODELS", "all")
