"""The C++/CUDA and Rust audit, apart from capture: drain obligations across calls (``unmap-without-drain``,
the seeds' use-after-unmap).

A ``cuMemUnmap`` (or a call the configuration names in ``unmaps`` / ``requires_drain``: a free or a
re-fill of memory kernels may still read) needs a real drain of the compute stream before it on every
path. A function that reaches one without discharging it hands the obligation to its callers (through
``self.f()``, fields, pattern-bound and trait receivers: whatever the index resolves by type); a call
site discharges it with a real drain that dominates the call, one handed in as an argument (a closure),
a latch (``if !drained { drain; drained = true; }``) or a ``true`` for the callee's
``if <parameter> { drain }``. An unmap after a map in the same function (an error path undoing it) or
on an error path is exempt.

A drain is decided from its definition: one that can return before it drains (``synchronize()``'s
``if self.defer_eager_sync.load(..) { return Ok(()); }``) is conditional, not a drain; so is one the
configuration names in ``conditional_drains``. A drain of a copy stream (``copy_stream().synchronize()``)
drains that stream only. An obligation that meets a conditional drain is reported there (the barrier
that does not drain); one no caller discharges is reported at the function that has no caller in the
audited sources, with the chain down to the unmap."""

from __future__ import annotations

import re
from dataclasses import dataclass

from .audit_index import Finding
from .native_config import NativeConfig
from .native_index import Event, NFunc, NIndex
from .native_rules import DRAIN_WHY, METHOD_SINKS, UNMAP_WHY

MAPS = {"cuMemMap", "cuMemCreate"}
_BARRIER_NAME = re.compile(r"sync|drain|barrier|quiesce|fence", re.IGNORECASE)
_SYNC_METHODS = {n for n, k in METHOD_SINKS.items() if k == "sync"}


@dataclass
class Obligation:
    site: tuple[NFunc, Event]  # the unmap (or configured call) that needs the drain
    steps: list[str]  # from the function holding it down to the site
    unless: str = ""  # discharged when the caller passes true for this parameter
    reported: bool = False  # met a conditional barrier (reported there): no finding where no caller discharges it


def _copy_stream(ev: Event) -> bool:
    return "copy" in (ev.receiver or "").lower() or "copy" in ev.name.lower()


class Drains:
    def __init__(self, ix: NIndex, cfg: NativeConfig, resolve):
        self.ix, self.cfg, self.resolve = ix, cfg, resolve
        self.status: dict[tuple, tuple[str, str]] = {}  # fn.key -> ("real"|"conditional"|"", why)
        self.obl: dict[tuple, list[Obligation]] = {}
        self.callers: dict[tuple, list[tuple[NFunc, Event]]] = {}
        self._resolved: dict[tuple, list[NFunc]] = {}
        for f in ix.functions:
            if f.device or f.test or f.kind == "macro":
                continue
            for ev in f.events:
                if ev.what == "call":
                    for g in self._targets(f, ev):
                        self.callers.setdefault(g.key, []).append((f, ev))
                elif ev.what == "drop":
                    for g in self.ix.by_owner.get((ev.name, "drop"), []):
                        self.callers.setdefault(g.key, []).append((f, ev))

    def _targets(self, fn: NFunc, ev: Event) -> list[NFunc]:
        key = (fn.key, ev.pos, ev.end, ev.name, ev.what)  # (a chained call's calls start at one byte)
        if key not in self._resolved:
            got, known = self.resolve(self.ix, fn, ev)
            self._resolved[key] = ([] if ev.receiver is not None and not known  # a method: by its receiver's type
                                   else [g for g in got if g is not fn and g.kind != "macro" and not g.test])
        return self._resolved[key]

    def _configured(self, keys: set[str], fn: NFunc, ev: Event, targets: list[NFunc]) -> bool:
        names = {ev.name, *(f"{g.owner}::{g.name}" for g in targets if g.owner)}
        if ev.scope:
            names.add(f"{ev.scope}::{ev.name}")
        if ev.rtype:
            names.add(f"{ev.rtype}::{ev.name}")
        return bool(names & keys)

    # what a call does to the stream
    def drain_of(self, fn: NFunc, ev: Event, depth: int = 0) -> tuple[str, str]:
        """("real" | "conditional" | "", why) for one event: a drain, a call to one, or neither."""
        if ev.what not in ("call", "drain", "sink") or _copy_stream(ev):
            return "", ""
        targets = self._targets(fn, ev) if ev.what != "drain" or ev.receiver is not None else []
        if self._configured(self.cfg.conditional_drains, fn, ev, targets):
            return "conditional", "the configuration names it a conditional drain"
        if targets:
            worst = ("", "")
            for g in targets:
                st = self.function_status(g, depth + 1)
                if st[0] == "conditional" and not self._thin(g) and not st[1].startswith(g.qualname):
                    continue  # a large function that calls a conditional drain is no barrier itself
                if st[0] == "conditional" or (st[0] == "real" and worst[0] == ""):
                    worst = st
            return worst
        if ev.what == "drain" or ev.name in self.cfg.drains:
            return "real", ""
        if ev.receiver is not None and ev.name in _SYNC_METHODS and "stream" in ev.receiver.lower():
            return "real", ""  # a CUDA stream's own synchronize (a crate's type the sources do not define)
        return "", ""

    @staticmethod
    def _thin(g: NFunc) -> bool:
        """A wrapper: a handful of calls (`fn barrier(&self) -> Result<()> { self.rt.synchronize() }`), or a
        function its name calls a barrier (`synchronize_before_pooled_unmap`, `drain_*`, `*_barrier`)."""
        return sum(e.what == "call" for e in g.events) <= 3 or bool(_BARRIER_NAME.search(g.name))

    def function_status(self, fn: NFunc, depth: int = 0) -> tuple[str, str]:
        if fn.key in self.status:
            return self.status[fn.key]
        if depth > 6:
            return "", ""
        self.status[fn.key] = ("", "")  # recursion: not a drain
        top = fn.events[0].blocks[:1] if fn.events else ()
        returns = [e for e in fn.events if e.what == "return" and not e.text.startswith("return Err")]
        found = ("", "")
        for ev in fn.events:
            if ev.blocks != top:
                # a drain in a branch makes no drain of the function; a conditional one there (a barrier behind
                # `if pooled { self.runtime.synchronize() }`, the deferrable synchronize) makes it a conditional
                # barrier, reported where it is called before an unmap
                if not found[0] and ev.what in ("call", "drain") and (st := self.drain_of(fn, ev, depth))[0] == "conditional":
                    found = st
                continue
            st, why = self.drain_of(fn, ev, depth)
            if not st:
                continue
            early = next((r for r in returns if r.pos < ev.pos), None)
            if st == "real" and early is None:
                found = ("real", "")
                break
            if st == "real":
                found = ("conditional", f"{fn.qualname} can return before it drains ({fn.file}:{early.line}: "
                                        f"`{early.text}`)")
            elif st == "conditional" and not found[0]:
                found = (st, why)
        self.status[fn.key] = found
        return found

    # obligations
    def obligations(self, fn: NFunc) -> list[Obligation]:
        if fn.key in self.obl:
            return self.obl[fn.key]
        self.obl[fn.key] = []  # recursion
        out: list[Obligation] = []
        evs = fn.events
        maps = [e.pos for e in evs if e.what in ("call", "sink") and e.name in MAPS]
        own_map = bool(maps)
        for u in evs:
            if u.guard.startswith("error path"):
                continue
            incoming: list[Obligation] = []
            if u.what == "unmap" and own_map:
                continue  # the function maps too: it undoes its own mapping (a failed map's unwind)
            if u.what == "unmap":
                incoming = [Obligation((fn, u), [f"line {u.line}: `{u.text}`"])]
            elif u.what in ("call", "drop"):
                targets = self._targets(fn, u) if u.what == "call" else [
                    g for g in self.ix.by_owner.get((u.name, "drop"), []) if g.trait == "Drop"]
                if self._configured(self.cfg.unmaps | self.cfg.requires_drain, fn, u, targets):
                    incoming = [Obligation((fn, u), [f"line {u.line}: `{u.text}`"])]
                else:
                    for g in targets:
                        for o in self.obligations(g):
                            if o.unless and self._passes_true(g, u, o.unless):
                                continue
                            incoming.append(Obligation(o.site, [f"{g.qualname} ({g.file}:{g.line}, called at "
                                                                f"{fn.file}:{u.line})", *o.steps], reported=o.reported))
            if not incoming:
                continue
            if any(m < u.pos for m in maps):
                continue  # undoes a mapping made earlier in this call: no kernel has used it
            verdict, drain, unless = self._discharged(fn, u)
            for o in incoming:
                if verdict == "real":
                    continue
                o.unless = unless
                if verdict == "conditional":
                    self.reports.append((fn, drain, o))  # reported at the barrier
                    if not unless:
                        continue
                    # `if <param> { barrier }`: its callers still owe a drain (a barrier of theirs is judged too), but
                    # one with no barrier of its own is not reported again: this barrier is the defect on its path
                    o = Obligation(o.site, o.steps, reported=True)
                out.append(o)
        # one obligation per site and condition (the first chain): the same unmap reached through many
        # callees is one debt, and a caller would otherwise inherit every path to it (the whole nxrt tree's
        # lists grew past minutes of work)
        unique: dict[tuple, Obligation] = {}
        for o in out:
            unique.setdefault((o.site[0].key, o.site[1].pos, o.unless), o)
        out = list(unique.values())
        self.obl[fn.key] = out
        return out

    def _passes_true(self, callee: NFunc, call: Event, param: str) -> bool:
        if param not in callee.params:
            return False
        i = callee.params.index(param)
        return len(call.args) > i and call.args[i].strip() == "true"

    def _discharged(self, fn: NFunc, u: Event) -> tuple[str, Event | None, str]:
        """("real" | "conditional" | "", the drain, the parameter whose truth drains) before ``u`` in ``fn``."""
        best: tuple[str, Event | None, str] = ("", None, "")
        for d in fn.events:
            inside = u.pos <= d.pos < u.end and d is not u  # a drain handed in as an argument
            if d is u or not (inside or d.pos < u.pos):
                continue
            st, _ = self.drain_of(fn, d)
            if not st:
                continue
            dominates = inside or u.blocks[: len(d.blocks)] == d.blocks
            if st == "real" and dominates:
                return "real", d, ""
            if st == "real" and d.cparam and not best[0]:
                best = ("", d, d.cparam)
            elif st == "conditional":
                best = ("conditional", d, d.cparam)
        return best

    def findings(self) -> list[Finding]:
        self.reports: list[tuple[NFunc, Event | None, Obligation]] = []
        roots: list[tuple[NFunc, Obligation]] = []
        for fn in self.ix.functions:
            if fn.device or fn.test or fn.kind == "macro":
                continue
            obs = self.obligations(fn)
            if obs and not self.callers.get(fn.key):
                roots.extend((fn, o) for o in obs)
        out: list[Finding] = []
        for fn, d, o in self.reports:
            sfn, sev = o.site
            why = self.drain_of(fn, d)[1] if d is not None else ""
            out.append(Finding("unmap-without-drain", fn.file, d.line, d.col, fn.qualname,  # type: ignore[union-attr]
                               [fn.qualname], d.text, "unmap-without-drain",  # type: ignore[union-attr]
                               f"{DRAIN_WHY} ({why})" if why else DRAIN_WHY, [],
                               [f"{fn.qualname} ({fn.file}:{fn.line})",
                                f"line {d.line}: `{d.text}`: a conditional drain", *o.steps]))  # type: ignore[union-attr]
        for fn, o in roots:
            if o.reported:
                continue  # its path's conditional barrier is the finding
            sfn, sev = o.site
            head = [f"{fn.qualname} ({fn.file}:{fn.line})", *o.steps]
            out.append(Finding("unmap-without-drain", sfn.file, sev.line, sev.col, fn.qualname,
                               [fn.qualname] + [s.split(" (")[0] for s in o.steps[:-1]], sev.text,
                               "unmap-without-drain", UNMAP_WHY, [], head))
        return out
