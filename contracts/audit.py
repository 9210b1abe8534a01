"""Static audit of capture-unsafe synchronisation: ``lockstep audit [PATHS...]``.

What it does, in order:

1. Parses every Python file of the audited tree (``kernels/`` and ``reference_runtime/`` by
   default, plus any files given) with ``ast`` and indexes functions (module functions, methods as
   ``Class.method``, nested functions as ``outer.inner``, lambdas), imports and simple aliases.
2. Finds the *capture entry points*: every kernel body that may be recorded into a CUDA graph —
   the compute function of each ``OpKernel(...)`` and the body of each ``Kernel(...)`` that is not
   declared ``capture="unsupported"``, including functions and lambdas handed to kernel factories
   (``Unary("Abs", lambda xp, x: ...)``) — and the runtime functions that
   ``contracts/sync_allowlist.toml`` declares as running during a capture (``[capture] entries``).
   With PATHS, only entries in those files are audited (a new kernel before it is registered);
   calls are still followed into the whole tree.
3. Walks the call graph from each entry (calls to functions it can resolve: same module, imported
   names and modules, ``self.method``, nested defs; not dynamic dispatch such as
   ``getattr(xp, name)``) and looks for synchronising or host-reading calls (the tables below,
   each kind with its ``WHY``).
   Device values are tracked from the kernel's array parameters through expressions and
   assignments, and into helpers by argument position, so ``float(x.sum())`` or ``if x.any():``
   on a device array is found, while ``int(x.shape[0])`` is not.
4. A sink is accepted when a capture guard dominates it on the path: it sits in the
   not-capturing branch of an ``if`` on ``is_capturing`` / ``_capturing`` (``if not rt.is_capturing:``,
   ``else`` of ``if rt.is_capturing:``), or after an ``if <capturing>: return|raise`` in an
   enclosing block, in the function itself or at any call site along the chain. Otherwise it is a
   finding, unless an allowlist entry (file, function, call text, reason) matches it. An allowlist
   entry that matches nothing is itself a finding (a stale entry hides nothing and must go).

Exit status: 0 clean, 1 findings, 2 usage or parse error. Formats: text (default), json, sarif
(SARIF 2.1.0, for code-scanning annotations). Reported files are named relative to ``--root``, the
user's repository (SARIF: relative URIs against ``SRCROOT``; default: the current directory when
the PATHS lie under it, else lockstep's own tree). ``--explain`` also lists, per finding, the capture
guards in the functions of its chain and why none dominates, and the accepted (guarded or
allowlisted) sync sites.
"""

from __future__ import annotations

import argparse
import ast
import sys
import time
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

try:
    import tomllib
except ModuleNotFoundError:  # Python < 3.11
    tomllib = None  # type: ignore[assignment]

# the phases, one module each; their names stay importable from here (tests, scripts, the CLI)
from .audit_entries import Entry, _kernel_entries
from .audit_guards import _mentions_guard
from .audit_index import (  # noqa: F401  (re-exported)
    _PARSED,
    DEFAULT_TREE,
    ROOT,
    WHY,
    AuditError,
    AuditResult,
    Finding,
    Module,
    Site,
    _own_nodes,
    _parse,
    _rel,
    _tree_files,
)
from .audit_report import (  # noqa: F401  (re-exported)
    SARIF_RULES,
    Locations,
    _allowlist_line,
    _located,
    format_json,
    format_sarif,
    format_text,
)
from .audit_values import Audit

DEFAULT_ALLOWLIST = ROOT / "contracts" / "sync_allowlist.toml"

__all__ = ["audit", "main", "Finding", "Site", "AuditResult"]


# -- configuration --------------------------------------------------------------------------------
@dataclass
class Allow:
    file: str
    function: str
    call: str
    reason: str
    used: int = 0


def _load_config(path: Path | None) -> tuple[list[Allow], list[dict[str, str]]]:
    if path is None:  # deliberately none (tests of the audit itself)
        return [], []
    if not path.is_file():  # a missing allowlist would silently drop the runtime's capture entries
        raise AuditError(f"allowlist {path}: no such file")
    if tomllib is None:
        raise AuditError("reading the allowlist needs Python 3.11 (tomllib)")
    try:
        data = tomllib.loads(path.read_text(encoding="utf-8"))
    except (tomllib.TOMLDecodeError, OSError, UnicodeDecodeError) as exc:
        raise AuditError(f"{_rel(path)}: {exc}") from exc
    allows = []
    for i, a in enumerate(data.get("allow", [])):
        missing = [k for k in ("file", "function", "call", "reason") if not str(a.get(k, "")).strip()]
        if missing:
            raise AuditError(f"{_rel(path)}: [[allow]] entry {i + 1} lacks {missing}")
        allows.append(Allow(a["file"], a["function"], a["call"], a["reason"]))
    caps = data.get("capture", {}).get("entries", [])
    for i, c in enumerate(caps):
        if not c.get("file") or not c.get("function") or not c.get("reason"):
            raise AuditError(f"{_rel(path)}: [capture] entry {i + 1} needs file, function and reason")
    return allows, caps


# -- driver ---------------------------------------------------------------------------------------
HELPER_CAP = 200  # helper files followed per folder beside an out-of-tree kernel


def audit(paths: list[str] | None = None, *, allowlist: Path | None = DEFAULT_ALLOWLIST,
          tree: Iterable[str] = DEFAULT_TREE) -> AuditResult:
    t0 = time.perf_counter()
    targets = [Path(p) for p in paths or []]
    for p in targets:
        if not p.exists():
            raise AuditError(f"{p}: no such file or directory")
    files = {f.resolve(): f for f in _tree_files([ROOT / t for t in tree])}
    for f in _tree_files(targets):
        files.setdefault(f.resolve(), f)
    modules = [_parse(f) for f in files.values()]
    # helper files beside a kernel outside the tree (the user's own package): parsed so that calls into
    # them are followed; one that cannot be parsed, or past the cap, is not followed, and the user is told
    tree_roots = [(ROOT / t).resolve() for t in tree]
    notes: list[str] = []
    for folder in sorted({t.resolve().parent for t in _tree_files(targets)}):
        if any(folder.is_relative_to(r) for r in tree_roots):
            continue
        siblings = sorted(folder.glob("*.py"))
        if len(siblings) > HELPER_CAP:
            notes.append(f"{_rel(folder)}: {len(siblings) - HELPER_CAP} helper file(s) past the first {HELPER_CAP} "
                         "not followed (name them as PATHS to audit them)")
        for sib in siblings[:HELPER_CAP]:
            if sib.resolve() not in files:
                try:
                    modules.append(_parse(sib))
                except AuditError as exc:
                    notes.append(f"helper file not followed: {exc}")
                files[sib.resolve()] = sib
    au = Audit(modules)
    allows, caps = _load_config(allowlist)
    target_files = {f.resolve() for f in _tree_files(targets)} if targets else None

    entries: list[Entry] = []
    findings: list[Finding] = []
    unsupported: list[str] = []
    for mod in modules:
        if target_files is not None and mod.path.resolve() not in target_files:
            continue
        es, unresolved, declared = _kernel_entries(au, mod)
        entries.extend(es)
        findings.extend(unresolved)
        unsupported.extend(declared)
    if targets and unsupported:  # said, so that a file of such kernels is not mistaken for audited code
        what = "; ".join(unsupported[:8]) + (f"; and {len(unsupported) - 8} more" if len(unsupported) > 8 else "")
        lead = ("nothing to audit: every kernel found is" if not entries and not findings else
                f"{len(unsupported)} kernel(s)")
        notes.append(f"{lead} declared capture=\"unsupported\" (never captured, so not audited): {what}")
    for c in caps:
        matching = [m for m in modules if m.rel == c["file"] or m.rel.endswith("/" + c["file"])]
        if target_files is not None:
            matching = [m for m in matching if m.path.resolve() in target_files]
            if not matching:
                continue
        mod = next((m for m in matching if c["function"] in m.functions), matching[0] if matching else None)
        if mod is None or c["function"] not in mod.functions:
            findings.append(Finding("stale-allowlist", c["file"], 1, 0, c["function"], [], "", "config",
                                    f"[capture] entry {c['file']}:{c['function']} names no function"))
            continue
        f = mod.functions[c["function"]]
        entries.append(Entry(f"runtime {c['function']} ({c['file']})", f, tuple(False for _ in f.params)))

    sites: dict[tuple[str, int, int, str], Site] = {}
    seen_paths: set[tuple[str, str, tuple[bool, ...]]] = set()
    for entry in entries:
        first = f"{entry.func.qualname} ({entry.func.module.rel}:{getattr(entry.func.node, 'lineno', 1)})"
        stack = [(entry.func, entry.taint, [entry.func.qualname], "", [first])]
        while stack:
            fn, taint, chain, guard, steps = stack.pop()
            if (entry.name, fn.key, taint) in seen_paths and not guard:
                continue
            seen_paths.add((entry.name, fn.key, taint))
            s = au.summary(fn, taint)
            for sink in s.sinks:
                g = guard or sink.guard
                key = (fn.module.rel, sink.node.lineno, sink.node.col_offset, sink.kind)
                site = sites.get(key)
                if site is None:
                    site = sites[key] = Site(fn.module.rel, sink.node.lineno, sink.node.col_offset, fn.qualname,
                                             sink.call, sink.kind, "guarded" if g else "unsafe", g,
                                             end_line=getattr(sink.node, "end_lineno", sink.node.lineno))
                if g:
                    continue
                allow = next((a for a in allows if fn.module.rel.endswith(a.file) and a.function == fn.qualname
                              and a.call in sink.call), None)
                if allow is not None:
                    allow.used += 1
                    site.status, site.reason = "allowlisted", allow.reason
                    continue
                site.status = "unsafe"
                guards = [f"{q}: {gs}" for q in chain for gs in _guards_of(au, fn.module, q)]
                findings.append(Finding("capture-unsafe-sync", fn.module.rel, sink.node.lineno, sink.node.col_offset,
                                        entry.name, list(chain), sink.call, sink.kind, WHY[sink.kind], guards,
                                        [*steps, f"line {sink.node.lineno}: `{sink.call}`"]))
            for cs in s.calls:
                if len(chain) > 40:
                    continue
                step = (f"{cs.callee.qualname} ({cs.callee.module.rel}:{getattr(cs.callee.node, 'lineno', 1)}, "
                        f"called at {fn.module.rel}:{cs.node.lineno})")
                stack.append((cs.callee, cs.taint, chain + [cs.callee.qualname], guard or cs.guard, [*steps, step]))
    scope = {_rel(p) for p in target_files} if target_files is not None else None
    for a in allows:
        if scope is not None and not any(r.endswith(a.file) for r in scope):
            continue  # auditing given files only: entries about other files are not judged
        if not a.used:
            findings.append(Finding("stale-allowlist", a.file, 1, 0, a.function, [], a.call, "config",
                                    f"allowlist entry matches nothing (reason was: {a.reason}); remove it"))
    # de-duplicate findings of one site reached from many entries: keep the first entry, count the rest
    unique: dict[tuple, Finding] = {}
    for f in findings:
        unique.setdefault((f.rule, f.file, f.line, f.col, f.call), f)
    inventory = _inventory(au, modules, sites)
    return AuditResult(sorted(unique.values(), key=lambda f: (f.file, f.line, f.col)),
                       sorted(sites.values(), key=lambda s: (s.file, s.line)), inventory,
                       sorted({e.name for e in entries}), time.perf_counter() - t0, notes, unsupported)


def _guards_of(au: Audit, mod: Module, qualname: str) -> list[str]:
    fn = mod.functions.get(qualname)
    if fn is None:
        for m in au.modules.values():
            if qualname in m.functions:
                fn = m.functions[qualname]
                break
    if fn is None:
        return []
    out = []
    for n in _own_nodes(fn):
        if isinstance(n, (ast.If, ast.While)) and _mentions_guard(n.test):
            out.append(f"line {n.lineno} `{ast.unparse(n.test)}` does not dominate the call "
                       "(the call is not in its not-capturing branch, and its capturing branch does not exit first)")
    return out


def split_paths(paths: list[str]) -> tuple[list[str], list[str]]:
    """The given paths for the Python audit and for the C++/CUDA/Rust one: a file by its suffix, a
    folder to each whose files it holds."""
    from .native_audit import is_native

    py, native = [], []
    for p in paths:
        path = Path(p)
        if not path.exists():
            raise AuditError(f"{p}: no such file or directory")
        if path.is_file():
            if path.suffix == ".py":
                py.append(p)
            elif is_native(path):
                native.append(p)
            else:
                raise AuditError(f"{p}: not a Python, C++/CUDA or Rust source (.py, .cu, .cuh, .cpp, .cc, .c, .h, "
                                 ".hpp, .rs) or a directory")
            continue
        has_native = any(f.is_file() and is_native(f) for f in path.rglob("*"))
        has_py = any(path.rglob("*.py"))
        if has_native:
            native.append(p)
        if has_py or not has_native:
            py.append(p)
    return py, native


def merge(a: AuditResult, b: AuditResult) -> AuditResult:
    return AuditResult(sorted([*a.findings, *b.findings], key=lambda f: (f.file, f.line, f.col)),
                       sorted([*a.sites, *b.sites], key=lambda s: (s.file, s.line)), {**b.inventory, **a.inventory},
                       sorted({*a.entries, *b.entries}), a.seconds + b.seconds, [*a.notes, *b.notes],
                       [*a.unsupported, *b.unsupported])


def site_of(res: "AuditResult", file: str, line: int) -> Site | None:
    """The inventory site whose call spans ``file:line`` (what a runtime frame reports)."""
    exact = res.inventory.get((file, line))
    if exact is not None:
        return exact
    return next((s for (f, _), s in res.inventory.items() if f == file and s.line <= line <= max(s.end_line, s.line)), None)


def _inventory(au: Audit, modules: list[Module], sites: dict) -> dict[tuple[str, int], Site]:
    """Every sink-looking call in the tree (receiver-based only: runtime and stream primitives),
    with the status the capture paths gave it, or "eager-only" if no capture path reaches it."""
    out: dict[tuple[str, int], Site] = {}
    for s in sites.values():
        prev = out.get((s.file, s.line))
        if prev is None or (prev.status != "unsafe" and s.status == "unsafe"):
            out[(s.file, s.line)] = s
    for mod in modules:
        for fn in mod.functions.values():
            summary = au.summary(fn, tuple(False for _ in fn.params))
            for sink in summary.sinks:
                out.setdefault((mod.rel, sink.node.lineno), Site(
                    mod.rel, sink.node.lineno, sink.node.col_offset, fn.qualname, sink.call, sink.kind, "eager-only",
                    end_line=getattr(sink.node, "end_lineno", sink.node.lineno)))
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="lockstep audit", description="Static audit of capture-unsafe synchronisation.")
    ap.add_argument("paths", nargs="*", help="files or folders to audit (default: kernels/ and reference_runtime/)")
    ap.add_argument("--format", choices=("text", "json", "sarif"), default="text")
    ap.add_argument("--explain", action="store_true", help="show the guards considered and the accepted sites")
    ap.add_argument("--allowlist", default=str(DEFAULT_ALLOWLIST), help="the allowlist TOML (default: %(default)s)")
    ap.add_argument("--root", help="the repository root that reported locations are relative to (SARIF: SRCROOT); "
                                   "default: the current directory when the PATHS lie under it, else lockstep's "
                                   "own tree")
    ap.add_argument("--output", help="write the report here instead of stdout (its folder must exist)")
    ap.add_argument("--config", help="C++/CUDA and Rust: the configuration (a lockstep.toml with [audit], or a "
                                     "pyproject.toml with [tool.lockstep.audit]); default: the first found beside "
                                     "the PATHS or above them")
    try:
        args = ap.parse_args(argv)
    except SystemExit as exc:
        return 2 if exc.code else 0

    def error(msg: str) -> int:
        print(f"lockstep audit: error: {msg}", file=sys.stderr)
        return 2

    if args.root is not None and not Path(args.root).is_dir():
        return error(f"--root {args.root}: " + ("not a directory" if Path(args.root).exists() else "no such directory"))
    if args.output:
        out = Path(args.output)
        if out.is_dir():
            return error(f"--output {args.output}: is a directory")
        if not out.parent.is_dir():  # checked first: a long audit must not end in a traceback
            return error(f"--output {args.output}: folder {out.parent} does not exist")
    try:
        py_paths, native_paths = split_paths(args.paths)
        res = None
        if native_paths:
            from .native_audit import audit_native
            from .native_config import find_config, load_config

            config = Path(args.config) if args.config else find_config([Path(p) for p in native_paths])
            res = audit_native(native_paths, load_config(config))
            if not res.entries and not res.findings:
                return error(f"no capture entry point found in {', '.join(native_paths)} ({getattr(res, 'files', 0)} "
                             "C++/CUDA/Rust file(s), no cuMemUnmap without a drain either): no function matches the "
                             "entry patterns "
                             "(default *::ComputeInternal, impl * for * { fn execute|compute|forward|cuda_fwd }) and "
                             "none begins a capture; name your runtime's in [tool.lockstep.audit] entries "
                             "(pyproject.toml or lockstep.toml, or --config)")
        if py_paths or not native_paths:
            py = audit(py_paths, allowlist=Path(args.allowlist))
            mixed = bool(native_paths) and not py.entries and not py.unsupported and not py.findings
            if res is None:
                res = py
            elif not mixed:  # a folder of both: the Python kernels found there too
                res = merge(res, py)
        where = Locations.of(py_paths, args.root, Path(args.allowlist), extra=native_paths)
    except AuditError as exc:
        return error(str(exc))
    if py_paths and not native_paths and not res.entries and not res.unsupported and not res.findings:
        # nothing audited is not clean
        return error(f"no kernel found in {', '.join(args.paths)}: no OpKernel(...)/Kernel(...) or kernel factory "
                     "call hands a compute function over there (a kernel declared capture=\"unsupported\" is "
                     "not audited)")
    text = {"text": lambda: format_text(res, args.explain, where), "json": lambda: format_json(res, where),
            "sarif": lambda: format_sarif(res, where)}[args.format]()
    if args.output:
        try:
            Path(args.output).write_text(text + "\n", encoding="utf-8")
        except OSError as exc:
            return error(f"--output {args.output}: cannot write: {exc.strerror or exc}")
    else:
        try:
            print(text)
        except BrokenPipeError:  # `lockstep audit | head`: the reader left; the exit status still tells
            import os

            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
    return 1 if res.findings else 0
