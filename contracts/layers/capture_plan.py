"""Source mutants of the capture_plan layer."""

from lockstep.contracts.mutation import Mutant  # noqa: F401

MUTANTS: list = []
