"""lockstep's fuzzer: mutated golden models, ONNX node cases, feeds and command lines, each run in
an isolated worker on the reference runtime (simulated device), with ONNX Runtime's outcome beside.

- ``mutations.py``: cases from (seed, index), deterministic; the mutation families.
- ``case.py``: a case and its folder form (the reproducer).
- ``targets.py``: running a case in-process (reference runtime, ONNX Runtime, the CLI) and the
  outcome classes (``ok``, ``named``, ``crash``, ``hang``, ``memory``; the named errors are listed in
  ``lockstep.errors.LockstepError``).
- ``runner.py``: one forked worker per case and target, address-space limit, per-case timeout.
- ``report.py``: ``fuzz()``, the tables, crash signatures, reproducers, ``replay()``.
- ``command.py``: the command, ``lockstep fuzz`` (its ``main``).

Command: ``lockstep fuzz --cases N --seed S`` (``scripts/fuzz.py`` is the same); the
test is ``tests/test_fuzz.py`` (marker ``fuzz``). See ``docs/fuzzing.md``.
"""

from .case import Case
from .mutations import FAMILIES, make_case
from .report import BAD, FuzzRun, fuzz, replay
from .targets import CLASSES

__all__ = ["BAD", "CLASSES", "Case", "FAMILIES", "FuzzRun", "fuzz", "make_case", "replay"]
