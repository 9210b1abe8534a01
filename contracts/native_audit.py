"""``lockstep audit`` over CUDA C++ and Rust sources: the same model as the Python audit.

1. Every ``.cu .cuh .cpp .cc .c .h .hpp`` and ``.rs`` file under the given paths (config globs
   applied) is parsed with tree-sitter and indexed (``native_index``): functions, methods as
   ``Type::name`` (C++ namespaces and template arguments dropped; Rust impl types, traits' default
   methods), macros, and per function the ordered events of its body.
2. Capture entry points: the functions matching the configured patterns (default
   ``*::ComputeInternal`` and ``impl * for * { fn execute|compute|forward|cuda_fwd }``), and every
   stretch of a function between a begin-capture and an end-capture call.
3. From each entry the calls are followed across the given files: free functions, ``Type::f``,
   ``this->f``/``self.f`` (and trait default methods), methods of a receiver whose type the function
   declares, macros (expanded at the call site), lambdas and closures (part of their function), a
   local object's constructor and destructor / ``Drop``. ``__global__``/``__device__`` code and
   ``#[cfg(test)]`` items are never followed.
4. A sink (``native_rules``) on a path is a finding unless a capture guard dominates it in its
   function or at a call site on the chain, or an allowlist entry with a reason matches it (an entry
   that matches nothing is itself a finding).
5. Apart from capture: every cuMemUnmap with no real drain before it in its function
   (``unmap-without-drain``: the seeds' use-after-unmap; a deferrable ``synchronize()`` is no drain).
"""

from __future__ import annotations

import fnmatch
import re
import time
from dataclasses import dataclass
from pathlib import Path

from .audit_index import AuditError, AuditResult, Finding, Site
from .native_config import NativeAllow, NativeConfig
from .native_drains import Drains
from .native_index import Event, NFunc, NIndex, index_files
from .native_rules import NATIVE_EXTS

SKIP_DIRS = {".git", "node_modules", "target", "__pycache__", ".venv", "build"}
RELAXED_OK = re.compile(r"^(cudaMalloc|cudaMallocHost|cudaHostAlloc|cudaMallocManaged|cudaMallocPitch|cuMemAlloc|"
                        r"cuMemAllocHost|cuMemHostAlloc|cuMemAllocManaged|cuMemAllocPitch)")
_IMPL = re.compile(r"^impl\s+(\S+)\s+for\s+(\S+)\s*\{\s*fn\s+(\S+)\s*\}$")


def is_native(path: Path) -> bool:
    return path.suffix.lower() in NATIVE_EXTS


def native_files(paths: list[Path], cfg: NativeConfig) -> list[Path]:
    out: list[Path] = []
    for p in paths:
        if p.is_file():
            if is_native(p):
                out.append(p)
            continue
        for f in sorted(p.rglob("*")):
            if f.is_file() and is_native(f) and not any(part in SKIP_DIRS for part in f.relative_to(p).parts[:-1]):
                out.append(f)
    if cfg.include or cfg.exclude:
        def rel(f: Path) -> str:
            base = cfg.base or Path.cwd()
            r = f.resolve()
            return r.relative_to(base).as_posix() if r.is_relative_to(base) else r.as_posix()

        def hit(f: Path, globs: list[str]) -> bool:
            r = rel(f)
            return any(fnmatch.fnmatch(r, g) or fnmatch.fnmatch(r, "*/" + g) for g in globs)

        out = [f for f in out if (not cfg.include or hit(f, cfg.include)) and not hit(f, cfg.exclude)]
    seen: set[Path] = set()
    return [f for f in out if not (f.resolve() in seen or seen.add(f.resolve()))]  # type: ignore[func-returns-value]


def _report_name(f: Path) -> str:
    r, cwd = f.resolve(), Path.cwd().resolve()
    return r.relative_to(cwd).as_posix() if r.is_relative_to(cwd) else str(r)


# -- entries ----------------------------------------------------------------------------------------
@dataclass
class NEntry:
    name: str
    func: NFunc
    region: tuple[int, int] | None = None  # byte range of a capture stretch


def _matches(f: NFunc, pattern: str) -> bool:
    if pattern == "launches-kernels":
        return f.launches
    m = _IMPL.match(pattern.strip())
    if m:
        tr, ty, fn = m.groups()
        return (f.lang == "rust" and f.trait is not None and f.owner != f.trait and fnmatch.fnmatchcase(f.trait, tr)
                and fnmatch.fnmatchcase(f.owner or "", ty) and fnmatch.fnmatchcase(f.name, fn))
    return fnmatch.fnmatchcase(f.qualname, pattern)


def find_entries(ix: NIndex, cfg: NativeConfig, declined: dict[str, str] | None = None) -> list[NEntry]:
    """The capture entry points; a kernel whose own ``capture_support()`` always says Unsupported is none
    (named in ``declined`` with where it says so)."""
    out = []
    for f in ix.functions:
        if f.device or f.test or f.kind == "macro":
            continue
        where = f"{f.file}:{f.line}"
        pat = next((p for p in cfg.entries if _matches(f, p)), None)
        if pat is not None and f.owner in ix.facts.never_captured:
            if declined is not None:
                declined[f.owner] = ix.facts.never_captured[f.owner]
            continue
        if pat is not None:
            out.append(NEntry(f"{f.qualname} ({where}, entry pattern {pat!r})", f))
            continue
        begins = [e for e in f.events if e.what == "begin"]
        ends = sorted(e.pos for e in f.events if e.what == "end")
        for b in begins:
            end = next((p for p in ends if p > b.pos), 1 << 62)
            out.append(NEntry(f"the capture in {f.qualname} ({f.file}:{b.line}, `{b.text}`)", f, (b.pos, end)))
    return out


# -- resolution -------------------------------------------------------------------------------------
def resolve(ix: NIndex, fn: NFunc, ev: Event) -> tuple[list[NFunc], bool]:
    """What a call event names in the audited sources, and whether the receiver's type is known
    (a known type's definition overrides a sink known by name only)."""
    name = ev.name
    if ev.macro:
        return [f for f in ix.by_name.get(name, []) if f.kind == "macro" and f.lang == fn.lang], True
    if ev.what == "construct":
        t = ev.name
        got = [*ix.by_owner.get((t, t), []), *ix.by_owner.get((t, "~" + t), []),
               *[f for f in ix.by_owner.get((t, "drop"), []) if f.trait == "Drop"]]
        return got, True
    if ev.receiver is not None:  # a method call
        t = ev.rtype
        if t is not None:
            got = list(ix.by_owner.get((t, name), []))
            if not got:
                for tr in ix.impls.get(t, ()):
                    got.extend(ix.by_owner.get((tr, name), []))
            if not got and fn.trait and t == fn.owner:  # self.f() in a trait's default method or an impl of it
                got = list(ix.by_owner.get((fn.trait, name), []))
            if not got:  # a trait object (`&dyn Trait`, `Box<dyn Trait>`): every implementation in the sources
                got = [f for f in ix.by_name.get(name, []) if f.trait == t and f.owner != t]
            # none: a type the sources do not define, or one inheriting the method from elsewhere
            return got, bool(got)
        cands = [f for f in ix.by_name.get(name, []) if f.owner is not None and f.kind != "macro"]
        return (cands if len(cands) == 1 else []), False
    if ev.scope is not None:
        got = list(ix.by_owner.get((ev.scope, name), []))
        if not got:
            for tr in ix.impls.get(ev.scope, ()):
                got.extend(ix.by_owner.get((tr, name), []))
        if not got and ev.scope not in ix.types:  # namespace::f / module::f
            got = [f for f in ix.by_name.get(name, []) if f.owner is None and f.lang == fn.lang]
        return got, True
    got = []
    if fn.owner:
        got = list(ix.by_owner.get((fn.owner, name), []))
        if not got and fn.trait:
            got = list(ix.by_owner.get((fn.trait, name), []))
    if not got:
        got = [f for f in ix.by_name.get(name, []) if f.owner is None and f.lang == fn.lang]
    return got, True


# -- the audit ----------------------------------------------------------------------------------------
def _at(fn: NFunc, ev: Event) -> str:
    return f"{fn.file}:{ev.line}"


def audit_native(paths: list[str], cfg: NativeConfig) -> AuditResult:
    t0 = time.perf_counter()
    targets = [Path(p) for p in paths]
    for p in targets:
        if not p.exists():
            raise AuditError(f"{p}: no such file or directory")
    files = native_files(targets, cfg)
    ix = index_files([(f, _report_name(f)) for f in files], cfg.guards, cfg.not_capturing)
    declined: dict[str, str] = {}
    entries = find_entries(ix, cfg, declined)
    notes = []
    if declined:
        notes.append(f"{len(declined)} kernel(s) declare capture_support() Unsupported on every path and are not "
                     f"audited as capture entries: " + ", ".join(f"{k} ({v})" for k, v in sorted(declined.items())))
    if ix.parse_errors:  # tree-sitter recovers: the rest of such a file is audited; said once, not per file
        worst = sorted(ix.parse_errors.items(), key=lambda kv: (-kv[1], kv[0]))
        shown = ", ".join(f"{f} ({n})" for f, n in worst[:5])
        notes.append(f"{len(worst)} of {len(files)} file(s) hold constructs tree-sitter could not parse (macros it "
                     f"cannot expand, mostly); the code around them is audited, the unparsed spans are not: "
                     f"{shown}{' ...' if len(worst) > 5 else ''}")
    findings: list[Finding] = []
    sites: dict[tuple[str, int, int, str], Site] = {}
    begins = [e for f in ix.functions for e in f.events if e.what == "begin"]
    relaxed = bool(begins) and all("relaxed" in e.text.lower() for e in begins)
    if relaxed:  # cudaStreamCaptureModeRelaxed permits the allocating calls (not frees, which synchronise)
        notes.append("every capture in these sources is begun in relaxed mode, which permits cudaMalloc and "
                     "pinned host allocation while capturing: allocations are not reported (frees still are)")
    # One walk over (function, region, macro site, bound literals, guarded) states for all the entries together:
    # a state reached before is not walked again (per entry, the walk of a whole tree repeated most of itself
    # for each of hundreds of kernels). The first entry to reach a site gives its chain; the entry sets are
    # then carried along the walk's edges, so each finding names every entry that reaches its site.
    seen: dict[tuple, int] = {}  # state -> its index
    edges: list[tuple[int, int]] = []
    emitted: dict[int, list[Finding]] = {}
    starts: list[int] = []
    for entry in entries:
        first = f"{entry.func.qualname} ({entry.func.file}:{entry.func.line})"
        # (function, guard, chain, steps, region, macro call site: (caller, event) or None, bound literals, parent)
        stack: list = [(entry.func, "", [entry.func.qualname], [first], entry.region, None, frozenset(), -1)]
        starts.append(-1)
        while stack:
            fn, guard, chain, steps, region, at, binds, parent = stack.pop()
            key = (fn.key, region, at[1].pos if at else None, binds, bool(guard))
            if key in seen:
                if parent >= 0:
                    edges.append((parent, seen[key]))
                elif starts[-1] < 0:
                    starts[-1] = seen[key]
                continue
            me = seen[key] = len(seen)
            if parent >= 0:
                edges.append((parent, me))
            else:
                starts[-1] = me
            for ev in fn.events:
                if region is not None and not (region[0] <= ev.pos < region[1]):
                    continue
                if binds and _not_taken(ev, binds):
                    continue  # inside `if <parameter>` that this path's literal argument does not take
                g = guard or ev.guard or (at[1].guard if at else "")
                n_before = len(findings)
                if ev.what == "sink":
                    if relaxed and ev.sink == "alloc" and RELAXED_OK.match(ev.name):
                        continue
                    targets_, known = resolve(ix, fn, ev) if ev.vocab else ([], False)
                    if ev.vocab and targets_ and known:
                        continue  # the receiver's own definition is followed (its call event)
                    _sink(findings, sites, cfg, entry, fn, ev, g, chain, steps, at)
                elif ev.what == "call" and (kind := _configured_sink(cfg, ev)):
                    _sink(findings, sites, cfg, entry, fn, Event(**{**ev.__dict__, "what": "sink", "sink": kind}), g,
                          chain, steps, at)
                elif ev.what in ("call", "construct"):
                    if ev.what == "call" and not g and _allowed(cfg, fn, ev.text) is not None:
                        continue  # the user's [[allow]]: this call is on no capture path (its reason is theirs)
                    got, known = resolve(ix, fn, ev)
                    if ev.what == "call" and ev.pos in fn.vocab_sinks and not known:
                        continue  # a sink by name whose receiver is unknown: reported, not followed
                    for callee in got:
                        if callee is fn and callee.kind == "macro":
                            continue
                        never = next((nc for nc in cfg.never if _matches(callee, nc.function)), None)
                        if never is not None:  # the user's runtime never runs it while capturing
                            never.used += 1
                            continue
                        if len(chain) > 40:
                            continue
                        how = "constructed" if ev.what == "construct" else "called"
                        step = f"{callee.qualname} ({callee.file}:{callee.line}, {how} at {_at(fn, ev)})"
                        site = at if at is not None else ((fn, ev) if callee.kind == "macro" else None)
                        stack.append((callee, g, chain + [callee.qualname], [*steps, step], None, site,
                                      _bound(callee, ev, binds), me))
                if len(findings) > n_before:
                    emitted.setdefault(me, []).extend(findings[n_before:])
    _name_every_entry(entries, starts, edges, emitted, len(seen))
    findings.extend(_unmap_findings(ix, cfg))
    for nc in cfg.never:
        if not nc.used:
            findings.append(Finding("stale-allowlist", str(cfg.source or "config"), 1, 0, nc.function, [], "",
                                    "config", f"never_captured entry {nc.function!r} is called on no capture path "
                                              f"(reason was: {nc.reason}); remove it"))
    for a in cfg.allows:
        if not a.used:
            findings.append(Finding("stale-allowlist", a.file, 1, 0, a.function, [], a.call, "config",
                                    f"allowlist entry matches nothing (reason was: {a.reason}); remove it"))
    unique: dict[tuple, Finding] = {}
    for f in findings:  # one finding per site, naming every entry whose paths reach it; a macro use once
        first = unique.setdefault((f.rule, f.file, f.line, f.col, "" if f.expansions else f.call), f)
        if first is not f:
            first.others.extend(x for x in [f.entry, *f.others] if x != first.entry and x not in first.others)
            first.expansions.extend(x for x in f.expansions if x not in first.expansions)
    inventory = {(s.file, s.line): s for s in sites.values()}
    res = AuditResult(sorted(unique.values(), key=lambda f: (f.file, f.line, f.col)),
                      sorted(sites.values(), key=lambda s: (s.file, s.line)), inventory,
                      sorted({e.name for e in entries}), time.perf_counter() - t0, notes)
    res.files = len(files)  # type: ignore[attr-defined]
    return res


def _bound(callee: NFunc, call: Event, binds: frozenset) -> frozenset:
    """The callee's boolean parameters this call fixes: a literal `true`/`false`, or a parameter of the
    caller's that the path has bound, passed on by name."""
    outer = dict(binds)
    out = []
    for i, p in enumerate(callee.params):
        a = call.args[i].strip() if i < len(call.args) else ""
        if a in ("true", "false"):
            out.append((p, a == "true"))
        elif a in outer:
            out.append((p, outer[a]))
    return frozenset(out)


def _not_taken(ev: Event, binds: frozenset) -> bool:
    """Whether ``ev`` lies in a branch of `if <parameter>` (`cparam`; `!name`: its else, or `if !name`) that
    the path's bound value of that parameter does not run."""
    if not ev.cparam:
        return False
    name = ev.cparam.lstrip("!")
    value = dict(binds).get(name)
    return value is not None and value == ev.cparam.startswith("!")


def _name_every_entry(entries: list[NEntry], starts: list[int], edges: list[tuple[int, int]],
                      emitted: dict[int, list[Finding]], n: int) -> None:
    """Each finding's ``others``: the other capture entries whose paths reach its site (entry sets carried
    along the walk's edges, as bit masks, to a fixed point)."""
    reach = [0] * n
    for i, st in enumerate(starts):
        if st >= 0:
            reach[st] |= 1 << i
    changed = True
    while changed:
        changed = False
        for a, b in edges:
            if reach[a] & ~reach[b]:
                reach[b] |= reach[a]
                changed = True
    for st, found in emitted.items():
        names = [entries[i].name for i in range(len(entries)) if reach[st] >> i & 1]
        for f in found:
            f.others.extend(x for x in names if x != f.entry and x not in f.others)


def _configured_sink(cfg: NativeConfig, ev: Event) -> str | None:
    """The user's sink kind for a call (``[[sink]] call``: ``Type::name``, ``.method`` or ``name``)."""
    if not cfg.sinks:
        return None
    keys = [f"{ev.scope}::{ev.name}"] if ev.scope else []
    keys += ["." + ev.name] if ev.receiver is not None else []
    return next((cfg.sinks[k] for k in [*keys, ev.name] if k in cfg.sinks), None)


def _allowed(cfg: NativeConfig, fn: NFunc, call: str) -> NativeAllow | None:
    """The allowlist entry excusing ``call`` in ``fn`` (counted as used), or None."""
    allow = next((a for a in cfg.allows if fn.file.endswith(a.file) and a.function == fn.qualname and a.call in call),
                 None)
    if allow is not None:
        allow.used += 1
    return allow


def _sink(findings, sites, cfg: NativeConfig, entry: NEntry, fn: NFunc, ev: Event, guard: str, chain, steps, at) -> None:
    # a macro's sink is reported where the macro is used
    rfn, rev = (at[0], at[1]) if at is not None else (fn, ev)
    call = rev.text if at is None else f"{rev.text} (expands to `{ev.text}`)"
    key = (rfn.file, rev.line, rev.col, ev.sink)
    site = sites.get(key)
    if site is None:
        site = sites[key] = Site(rfn.file, rev.line, rev.col, rfn.qualname, call, ev.sink,
                                 "guarded" if guard else "unsafe", guard, end_line=rev.end_line)
    if guard:
        return
    allow = _allowed(cfg, rfn, call)
    if allow is not None:
        site.status, site.reason = "allowlisted", allow.reason
        return
    site.status = "unsafe"
    findings.append(Finding("capture-unsafe-sync", rfn.file, rev.line, rev.col, entry.name, list(chain), call, ev.sink,
                            cfg.why.get(ev.sink, ev.sink), [], [*steps, f"line {rev.line}: `{call}`"],
                            expansions=[f"{ev.sink}: `{ev.text}`"] if at is not None else []))


def _unmap_findings(ix: NIndex, cfg: NativeConfig) -> list[Finding]:
    by_site = {(g.file, g.qualname): g for g in ix.functions}
    out = []
    for f in Drains(ix, cfg, resolve).findings():
        fn = by_site.get((f.file, f.entry))
        if fn is None or _allowed(cfg, fn, f.call) is None:
            out.append(f)
    return out


__all__ = ["audit_native", "native_files", "is_native", "find_entries"]
