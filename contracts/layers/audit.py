"""Source mutants of the audit layer."""

from lockstep.contracts.mutation import Mutant  # noqa: F401

MUTANTS: list = []
