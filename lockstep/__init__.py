"""lockstep: a test-first conformance and correctness suite for CUDA inference runtimes.

The packages the design card names live under this one namespace: ``lockstep.reference_runtime``
(the reference CUDA runtime), ``lockstep.kernels``, ``lockstep.contracts``, ``lockstep.golden`` and
``lockstep.conformance`` (the suite, run with ``pytest --pyargs lockstep.conformance``). This module
itself holds the package's face: the ``lockstep`` command (``cli``), the pytest plugin
(``pytest_plugin``), the engine protocol and registry (``engines``).
"""

from importlib.metadata import PackageNotFoundError
from importlib.metadata import version as _version

DISTRIBUTION = "lockstep-conformance"

try:
    __version__ = _version(DISTRIBUTION)
except PackageNotFoundError:  # a source tree on PYTHONPATH, not installed
    __version__ = "0+unknown"

__all__ = ["__version__", "DISTRIBUTION"]
