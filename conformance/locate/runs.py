"""How ``locate`` runs an engine on a subject: through ``prepare`` or through its own decode session.

- ``prepared``: ``engine.prepare(model)(feeds)``, every graph output by name. Node cases, a decode step
  on the float64 oracle's past (``--position``: a decode session forms its own past, so only ``prepare``
  can be fed the oracle's), the prefixes a bisection extracts (they are no decoders), and the
  intermediate-value search of a decoder whose session returns no values run so.
- ``prefilled``: a decoder's prefill of its context in the engine's own decode session,
  ``lockstep.decoding.open_session(engine, model, io=...)``, as the golden prefill lock runs it: the
  logits as the graph's output ``[1, len, vocab]`` and, where the session has the protocol's optional
  ``values()``, the other outputs (not the presents, which the session keeps). ``through_session``
  says when: a decoder subject's prefill on an engine that declares ``decoder`` (one that declares
  none gets ``HostKVSession``, ``prepare`` on the same feeds, so ``prepare`` itself runs it and its
  presents are judged too).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from lockstep.decoding import open_session

from .oracle import LocateError
from .subject import Decode, Subject

__all__ = ["prepared", "prefilled", "through_session"]


def prepared(engine, model, feeds: dict[str, Any]) -> dict[str, Any]:
    """``model``'s graph outputs by name, run through ``engine.prepare`` on the feeds it takes."""
    names = [o.name for o in model.graph.output]
    init = {t.name for t in model.graph.initializer}
    wanted = {i.name for i in model.graph.input if i.name not in init}
    outs = engine.prepare(model)({k: v for k, v in feeds.items() if k in wanted})
    if len(outs) != len(names):
        raise LocateError(f"{engine.name} returned {len(outs)} outputs for the model's {len(names)}")
    return dict(zip(names, outs))


def through_session(engine, s: Subject) -> bool:
    """Whether ``s`` runs in ``engine``'s own decode session: a decoder's prefill, an engine with ``decoder``."""
    from lockstep.engines.protocol import capabilities

    return s.decode is not None and s.decode.position is None and capabilities(engine).decoder is not None


def prefilled(engine, model, d: Decode, *, values: bool) -> dict[str, Any] | None:
    """The prefill of ``d.context`` in ``engine``'s decode session of ``model``: the logits and, with
    ``values``, the session's ``values()``; None when ``values`` is asked of a session without them."""
    session = open_session(engine, model, io=d.io)
    has = callable(getattr(session, "values", None))
    if values and not has:
        return None
    session.reset()
    logits = session.forward(list(d.context))
    got = dict(session.values()) if values else {}
    got[d.io.logits] = np.asarray(logits)[None]
    return got
