"""Contracts of the runtime primitives: parity scenarios and the mutant catalogue.

The contract tests themselves live in ``suite/runtime/`` (the reference runtime's own tests: ``suite``); this package holds what they and
the ``lockstep mutants`` / ``lockstep parity`` commands share.
"""

__all__: list[str] = []
