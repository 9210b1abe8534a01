"""Source mutants of the segments layer."""

from lockstep.contracts.mutation import Mutant  # noqa: F401

MUTANTS: list = []
