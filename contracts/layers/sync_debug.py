"""Source mutants of the sync_debug layer."""

from lockstep.contracts.mutation import Mutant  # noqa: F401

MUTANTS: list = []
