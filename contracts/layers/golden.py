"""Source mutants of the golden layer."""

from lockstep.contracts.mutation import Mutant  # noqa: F401

MUTANTS: list = []
