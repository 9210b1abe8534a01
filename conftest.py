"""Repository-wide pytest configuration.

lockstep's plugin (devices, engines, mutants, markers, reports) is loaded by its ``pytest11`` entry
point, as in any repository where the package is installed. Here: pytest's own ``pytester``, for
the tests that run pytest on generated test files.
"""

pytest_plugins = ["pytester"]
