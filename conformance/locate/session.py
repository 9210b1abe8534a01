"""Locate through an engine's decode session (``lockstep locate --session eager|capture``): where
``prepare`` runs every node inside its band but the engine's decode -- its KV-cache handling, or its
graph capture (CUDA graphs) -- computes something else.

The model, with every intermediate value exposed as a graph output, runs in the engine's own decode
session (``decoder(model, capture=...)``): the subject's context prefilled up to its prompt (or up to
the located position, when that is inside the prompt), then one token a step (the steps a captured
decode replays) up to the located position. That step's values,
which the session returns through the protocol's optional ``DecodeSession.values()``, and its logits
are judged against the float64 oracle of the step as ``locate`` judges them (the oracle's past is its
own; a clean engine's past differs from it by its own rounding, inside the bands). The first node out
of its band with its inputs inside is the finding.

Before that, the cache: every call also returns the pasts it was fed and the presents it wrote, each
compared with the float64 oracle's rows for those positions (``caches``); the first cache tensor
out of its band, at the first call that shows one, is reported first (``Located.cache``): a KV write
one slot late shows at the first step after the prefill, whatever position is located.
"""

from __future__ import annotations

from typing import Callable

from lockstep.decoding import open_session
from lockstep.engines.protocol import Unsupported

from .caches import CacheOracle, with_pasts_exposed
from .failure import failed_at
from .graph import data_dependent, exposed
from .judge import first_divergence, judge_values
from .oracle import LocateError
from .search import Evaluations, Located, failure_line, judging
from .subject import Subject

__all__ = ["SESSIONS", "locate_in_session"]

SESSIONS = ("eager", "capture")


def locate_in_session(engine, s: Subject, mode: str, *, evals: Evaluations | None = None,
                      progress: Callable[[str], None] | None = None) -> Located:
    """``s``'s step (``--position``) run through ``engine``'s decode session, captured or eager."""
    say = progress or (lambda _m: None)
    if mode not in SESSIONS:
        raise LocateError(f"--session {mode}: one of {', '.join(SESSIONS)}")
    d = s.decode
    if d is None:
        raise LocateError(f"--session {mode}: {s.label} is not a decoder's step (a golden model, or a decoder file "
                          "with --prompt or --golden)")
    if d.position is None:
        raise LocateError(f"--session {mode} needs --position N: the one-token step to locate (positions "
                          f"0..{len(d.context) - 1}; from {d.prefill}, after the prompt, the steps a capture replays)")
    start = min(d.prefill, d.position)  # a step inside the prompt: the prefill stops before it
    units, ev = judging(engine, s, evals, say)
    # only what the step computes from its data: a value an engine folds into a constant at load (from
    # initializers or static shapes) cannot diverge between eager and capture, and ONNX Runtime copies such
    # an output with a synchronisation that its CUDA graph capture refuses (H100, 1.31.1)
    m, _ = exposed(s.model, ev.native, symbolic=True, only=data_dependent(s.model.graph))
    io = d.io
    m = with_pasts_exposed(m, list(io.pasts))
    caches = CacheOracle(s.model, io, list(d.context[:d.position]), units) if d.position else None
    say(f"{engine.name}: its {mode} decode session on the model with its values and pasts exposed, "
        f"prefill of {start} tokens then {d.position - start + 1} one-token steps")
    try:
        session = open_session(engine, m, capture=mode == "capture", io=io)
    except Unsupported as exc:
        raise LocateError(f"{engine.name} has no {mode} decode session for {s.label}: {exc}") from None
    if not callable(getattr(session, "values", None)):
        raise LocateError(f"{engine.name}'s decode session returns no values (the protocol's optional "
                          "DecodeSession.values()): its step can be located no further than its logits")
    before, p, cache = None, start, None

    def check(at: int) -> None:  # the pasts fed at the step at ``at``: rows 0..at-1
        nonlocal cache
        if caches is None or cache is not None or at == 0:
            return
        vals = session.values()
        for past in io.pasts:
            if past in vals:
                cache = caches.judge(past, vals[past], at, f"the step at position {at}", at)
                if cache is not None:
                    return

    try:
        session.reset()
        if start:
            session.forward(d.context[:start])
        for p in range(start, d.position + 1):
            before = session.capture_stats()
            logits = session.forward([d.context[p]])
            check(p)
        after = session.capture_stats()
    except Exception as exc:  # the engine's failure, in one line: where, and what it said
        f = failed_at(m, exc)
        node = f" at node {f.label} ({f.op_type}, node {f.node})" if f.node is not None else ""
        raise LocateError(f"{engine.name}'s {mode} decode session fails on the model with its values exposed, "
                          f"at position {p}{node}: {failure_line(exc)}") from None
    got = {k: v for k, v in session.values().items() if k not in io.present_of}
    got[d.io.logits] = logits[None]  # [1, 1, vocab], as the graph's output
    judged = judge_values(s.model, got, ev.native, ev.exact, units, only=set(got))
    finding = first_divergence(s.model, judged, s.feeds)
    replayed = after.replays - (before.replays if before else 0)
    note = (f"{mode} decode session: prefill of {start}, one-token steps to position {d.position}; the step "
            f"{'replayed a captured graph' if replayed else 'ran no replay'} (captures {after.captures}, replays "
            f"{after.replays}, fallbacks {after.fallbacks})"
            + ("; the pasts it fed compared with the float64 oracle's at every step"
               + (f" (not the window caches {', '.join(sorted(caches.skipped))})" if caches.skipped else "")
               if caches is not None else ""))
    outputs = [j for j in judged if j.name == d.io.logits]
    return Located(s, engine.name, units, f"session-{mode}", judged, finding, outputs, note=note,
                   runs=d.position - start + 2, evals=ev, cache=cache)
