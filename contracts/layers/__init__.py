"""The source-mutant catalogue, one module per layer of the reference runtime and the suite.

Each module holds ``MUTANTS``, a list of :class:`lockstep.contracts.mutation.Mutant`: one-edit
source mutants killed by the tests that claim the guarantee each breaks (``lockstep mutants
--layer NAME``). The layer ``runtime`` also holds the class-based catalogue of
``lockstep.contracts.mutants`` (whole primitives overridden, killed by the packaged contract tests).

Adding a mutant: append a ``Mutant`` to the layer's module with the exact snippet it replaces
(it must occur once in the module), the guarantee it breaks in one sentence and the tests that
claim that guarantee; run ``lockstep mutants --layer NAME --mutant LAYER.NAME``. A survivor is a
gap to fix with a test, or an equivalent mutant recorded with its argument (``equivalent=``).
"""

from __future__ import annotations

import importlib

from lockstep.contracts.mutation import Mutant

__all__ = ["SOURCE_LAYERS", "catalogue"]

# Order is the report's order.
SOURCE_LAYERS = ("runtime", "sim", "executor", "capture_plan", "segments", "golden", "pager", "audit",
                 "sync_debug", "kernels")


def _layer_mutants(layer: str) -> list[Mutant]:
    mod = importlib.import_module(f"lockstep.contracts.layers.{layer}")
    mutants = list(mod.MUTANTS)
    for m in mutants:
        if m.layer != layer:
            raise ValueError(f"mutant {m.key} is listed in layer {layer!r}")
    return mutants


def catalogue(layers: tuple[str, ...] | list[str] = SOURCE_LAYERS) -> dict[str, Mutant]:
    """Every source mutant of these layers by key (``layer.name``); duplicate keys are an error."""
    out: dict[str, Mutant] = {}
    for layer in layers:
        for m in _layer_mutants(layer):
            if m.key in out:
                raise ValueError(f"duplicate mutant {m.key}")
            out[m.key] = m
    return out

