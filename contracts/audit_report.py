"""The sync audit, output: text, JSON and SARIF reports and where their files are named."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any
from urllib.parse import quote

from .audit_index import DEFAULT_TREE, ROOT, AuditResult, Finding, Site, _rel, _tree_files
from .native_rules import FIX, NATIVE_EXTS


# -- output ---------------------------------------------------------------------------------------
class Locations:
    """Where the reported files are, named for the reader of the report.

    The audit names a file relative to lockstep's own tree (what the allowlist matches) or as it
    was given on the command line. A report names it relative to ``root`` (the user's repository)
    when it lies under it, else by its absolute path; in SARIF a relative URI against the base id
    ``SRCROOT`` (``root``), else an absolute ``file:`` URI. Without a root, names are kept as the
    audit gave them (the library API of the formatters, as before)."""

    def __init__(self, root: Path | None = None, files: dict[str, Path] | None = None,
                 allowlist: Path | None = None):
        self.root = root.resolve() if root is not None else None
        self.files = dict(files or {})  # the audit's file name -> absolute path
        self.allowlist = allowlist.resolve() if allowlist is not None else None

    @classmethod
    def of(cls, paths: list[str], root: str | None, allowlist: Path | None,
           extra: list[str] | None = None) -> "Locations":
        """The files ``audit(paths)`` reads, named as it names them; ``root`` None is the default:
        the current directory when PATHS are given and all lie under it, else lockstep's tree root
        (the audit of lockstep's own tree is named as ever: ``reference_runtime/executor.py``)."""
        tree = _tree_files([ROOT / t for t in DEFAULT_TREE])
        given = _tree_files([Path(p) for p in paths])
        files: dict[str, Path] = {}
        for f in [*tree, *given]:
            files.setdefault(_rel(f), f.resolve())
        for p in extra or []:  # C++/CUDA/Rust sources: named relative to the current directory
            given.append(Path(p))
            cwd = Path.cwd().resolve()
            for f in ([Path(p)] if Path(p).is_file() else (x for x in Path(p).rglob("*") if x.is_file())):
                r = f.resolve()
                files.setdefault(r.relative_to(cwd).as_posix() if r.is_relative_to(cwd) else str(r), r)
        if root is not None:
            base = Path(root)
        else:
            cwd = Path.cwd().resolve()
            base = cwd if given and all(f.resolve().is_relative_to(cwd) for f in given) else ROOT
        return cls(base, files, allowlist)

    def path(self, file: str) -> Path | None:
        """The absolute path of a file the audit named, or None if it names none that exists."""
        got = self.files.get(file)
        if got is not None:
            return got
        p = Path(file)
        for cand in ([p] if p.is_absolute() else [ROOT / p]):
            if cand.is_file():
                return cand.resolve()
        return None

    def name(self, file: str) -> str:
        """The file as the text and JSON reports name it."""
        p = self.path(file) if self.root is not None else None
        if p is None:
            return file
        return p.relative_to(self.root).as_posix() if p.is_relative_to(self.root) else str(p)

    def artifact(self, file: str | Path) -> dict[str, Any]:
        """A SARIF artifactLocation."""
        p = file if isinstance(file, Path) else self.path(file) if self.root is not None else None
        if p is None:  # a name that is no file (a stale allowlist entry's): a relative reference, no base
            return {"uri": quote(str(file).replace("\\", "/"))}
        if self.root is not None and p.is_relative_to(self.root):
            return {"uri": quote(p.relative_to(self.root).as_posix()), "uriBaseId": "SRCROOT"}
        return {"uri": p.as_uri()}


def _located(res: AuditResult, where: Locations | None) -> tuple[list[Finding], list[Site]]:
    if where is None or where.root is None:
        return res.findings, res.sites
    findings = [Finding(**{**f.as_dict(), "file": where.name(f.file)}) for f in res.findings]
    sites = [Site(**{**s.__dict__, "file": where.name(s.file)}) for s in res.sites]
    return findings, sites


def format_text(res: AuditResult, explain: bool, where: Locations | None = None) -> str:
    findings, sites = _located(res, where)
    lines = []
    for f in findings:
        if f.rule == "capture-unsafe-sync":
            lines.append(f"{f.file}:{f.line}:{f.col + 1}: {f.kind}: `{f.call}` on a capture path of {f.entry}")
            lines.append(f"    chain: {' -> '.join(f.steps or f.chain)}")
            also = f.expansions[1:]
            if also:
                lines.append(f"    the macro also reaches {len(also)} other sink(s): {'; '.join(also[:4])}"
                             f"{' ...' if len(also) > 4 else ''}")
            if f.others:
                shown = "; ".join(f.others[:3])
                lines.append(f"    also on the capture paths of {len(f.others)} other entr{'y' if len(f.others) == 1 else 'ies'}: "
                             f"{shown}{' ...' if len(f.others) > 3 else ''}")
            lines.append(f"    why: {f.why}")
            if Path(f.file).suffix.lower() in NATIVE_EXTS:
                lines.append(f"    fix: {FIX.get(f.kind, 'guard it with the capture status, move it out of the capture path, or allowlist it with a reason in [tool.lockstep.audit]')}")
            elif f.entry.startswith("runtime "):
                lines.append("    fix: guard it (`if not rt.is_capturing:` / an early exit when capturing), or allowlist "
                             "it with a reason in contracts/sync_allowlist.toml")
            else:  # a kernel's compute has no `rt`: the forms that exist there
                lines.append("    fix: a kernel's compute has no `rt`: guard it with the stream's state (`if not "
                             "xp.cuda.get_current_stream().is_capturing():`), keep it to the numpy path (`if "
                             "xp.__name__ == \"numpy\":`), declare the kernel capture=\"unsupported\", or allowlist "
                             "it with a reason in contracts/sync_allowlist.toml")
            if explain:
                lines.extend(f"    guard considered: {g}" for g in f.guards or ["none in the chain"])
        elif f.rule == "unmap-without-drain":
            lines.append(f"{f.file}:{f.line}:{f.col + 1}: unmap-without-drain: `{f.call}` in {f.entry}")
            lines.append(f"    why: {f.why}")
        else:
            lines.append(f"{f.file}:{f.line}: {f.rule}: {f.why} [{f.entry} {f.call}]".rstrip())
    if explain:
        lines.append("")
        lines.append(f"entry points ({len(res.entries)}):")
        lines.extend(f"  {e}" for e in res.entries)
        lines.append("accepted sync sites on capture paths:")
        for s in sites:
            if s.status != "unsafe":
                lines.append(f"  {s.file}:{s.line} {s.function}: `{s.call}` {s.status}: {s.guard or s.reason}")
    lines.extend(f"note: {n}" for n in res.notes)
    n = sum(f.rule == "capture-unsafe-sync" for f in findings)
    lines.append(f"lockstep audit: {len(res.entries)} capture entry points, {len(res.sites)} sync sites on capture paths, "
                 f"{n} unsafe, {len(findings) - n} other finding(s), {res.seconds:.2f} s")
    return "\n".join(lines)


def format_json(res: AuditResult, where: Locations | None = None) -> str:
    findings, sites = _located(res, where)
    doc: dict[str, Any] = {"findings": [f.as_dict() for f in findings], "sites": [s.__dict__ for s in sites],
                           "entries": res.entries, "seconds": res.seconds, "notes": res.notes,
                           "unsupported": res.unsupported}
    if where is not None and where.root is not None:
        doc["root"] = str(where.root)
    return json.dumps(doc, indent=1)


SARIF_RULES = {
    "capture-unsafe-sync": "A synchronising or host-reading call on a capture path without a dominating capture guard",
    "stale-allowlist": "A sync allowlist entry (or capture entry) that matches nothing",
    "unresolved-entry": "A kernel body the audit could not resolve statically",
    "unmap-without-drain": "cuMemUnmap with no real drain of the stream before it (use-after-unmap)",
}


def _allowlist_line(path: Path, f: Finding) -> int:
    """The line of the allowlist that holds a stale entry (its call text, else its function), else 1."""
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except OSError:
        return 1
    for needle in [x for x in (f.call, f.entry) if x]:
        for i, line in enumerate(lines, 1):
            if needle in line:
                return i
    return 1


def format_sarif(res: AuditResult, where: Locations | None = None) -> str:
    """SARIF 2.1.0 (validated against the OASIS schema in tests/test_audit.py). Locations are relative
    to ``SRCROOT``, the user's repository root (``--root``); a file outside it has an absolute
    ``file:`` URI. A stale allowlist entry is located in the allowlist, where it is to be removed."""
    where = where or Locations(ROOT)
    rule_ids = list(SARIF_RULES)
    results = []
    for f in res.findings:
        if f.rule == "capture-unsafe-sync":
            text = f"`{f.call}` ({f.kind}) on a capture path of {f.entry}: {f.why}"
        elif f.rule == "stale-allowlist":  # the entry, as the allowlist names it
            text = f"{f.why} [file {f.file}, function {f.entry}" + (f", call {f.call}]" if f.call else "]")
        else:
            text = f"{f.why} [{f.entry} {f.call}]".replace(" ]", "]")
        if f.rule == "stale-allowlist" and where.allowlist is not None:
            artifact, region = where.artifact(where.allowlist), {"startLine": _allowlist_line(where.allowlist, f)}
        else:
            artifact, region = where.artifact(f.file), {"startLine": max(f.line, 1), "startColumn": f.col + 1}
        r: dict[str, Any] = {
            "ruleId": f.rule,
            "ruleIndex": rule_ids.index(f.rule),
            "level": "error" if f.rule != "unresolved-entry" else "warning",
            "message": {"text": text},
            "locations": [{"physicalLocation": {"artifactLocation": artifact, "region": region}}],
        }
        if f.chain:
            r["properties"] = {"chain": f.chain, "entry": f.entry, **({"other_entries": f.others} if f.others else {}),
                               **({"macro_expansions": f.expansions} if f.expansions else {})}
        results.append(r)
    run: dict[str, Any] = {
        "tool": {"driver": {"name": "lockstep-audit",
                            "rules": [{"id": k, "shortDescription": {"text": v}} for k, v in SARIF_RULES.items()]}},
        "results": results,
    }
    if res.notes:  # what was not followed or not audited, as the tool's own notifications
        run["invocations"] = [{"executionSuccessful": True, "toolExecutionNotifications": [
            {"level": "note", "message": {"text": n}} for n in res.notes]}]
    if where.root is not None:
        run["originalUriBaseIds"] = {"SRCROOT": {"uri": where.root.as_uri().rstrip("/") + "/"}}
    doc = {"$schema": "https://json.schemastore.org/sarif-2.1.0.json", "version": "2.1.0", "runs": [run]}
    return json.dumps(doc, indent=1)


