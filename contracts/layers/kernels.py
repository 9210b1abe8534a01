"""Source mutants of the kernels layer."""

from lockstep.contracts.mutation import Mutant  # noqa: F401

MUTANTS: list = []
