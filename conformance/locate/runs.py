"""How ``locate`` runs an engine on a subject: ``prepared``, ``engine.prepare(model)(feeds)``, every
graph output by name (the model, the model with its values exposed, the prefixes a bisection extracts)."""

from __future__ import annotations

from typing import Any

from .oracle import LocateError

__all__ = ["prepared"]


def prepared(engine, model, feeds: dict[str, Any]) -> dict[str, Any]:
    """``model``'s graph outputs by name, run through ``engine.prepare`` on the feeds it takes."""
    names = [o.name for o in model.graph.output]
    init = {t.name for t in model.graph.initializer}
    wanted = {i.name for i in model.graph.input if i.name not in init}
    outs = engine.prepare(model)({k: v for k, v in feeds.items() if k in wanted})
    if len(outs) != len(names):
        raise LocateError(f"{engine.name} returned {len(outs)} outputs for the model's {len(names)}")
    return dict(zip(names, outs))
