"""Source mutants of the executor layer."""

from lockstep.contracts.mutation import Mutant  # noqa: F401

MUTANTS: list = []
