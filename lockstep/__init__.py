"""lockstep: a test-first conformance and correctness suite for CUDA inference runtimes.

The packages the design card names live under this one namespace: ``lockstep.reference_runtime``
(the reference CUDA runtime), ``lockstep.kernels``, ``lockstep.contracts``, ``lockstep.golden`` and
``lockstep.conformance`` (the suite, run with ``pytest --pyargs lockstep.conformance``, with the
``lockstep`` command, ``conformance.cli``, and the pytest plugin, ``conformance.pytest_plugin``). This
folder itself is the ground floor: named errors (``errors``), ONNX loading (``loading``), decoder I/O,
decoding, the engine protocol and registry (``engines``), paths.
"""

from importlib.metadata import PackageNotFoundError
from importlib.metadata import version as _version

DISTRIBUTION = "lockstep-conformance"

try:
    __version__ = _version(DISTRIBUTION)
except PackageNotFoundError:  # a source tree on PYTHONPATH, not installed
    __version__ = "0+unknown"

__all__ = ["__version__", "DISTRIBUTION"]
