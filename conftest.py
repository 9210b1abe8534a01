"""Repository-wide pytest configuration: lockstep's plugin (devices, mutants, contract markers)."""

pytest_plugins = ["contracts.pytest_plugin"]
