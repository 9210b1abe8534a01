"""Source mutants of the pager layer."""

from lockstep.contracts.mutation import Mutant  # noqa: F401

MUTANTS: list = []
