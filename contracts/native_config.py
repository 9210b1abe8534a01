"""The C++/CUDA and Rust audit, its configuration: a user's own capture entry points, sinks, guards,
drains, file globs and allowlist, in ``[tool.lockstep.audit]`` of their ``pyproject.toml`` or
``[audit]`` of a ``lockstep.toml`` (found beside the audited paths or above them, or named with
``--config``). Read once into a ``NativeConfig``; a malformed one is a one-line error naming the key.

```toml
[tool.lockstep.audit]
entries = ["*::ComputeInternal", "ggml_cuda_compute_forward", "impl * for * { fn execute }", "launches-kernels"]
default_entries = true        # keep the built-in entry points too (the default)
guards = ["graph_capture_active"]          # names whose truth means "the stream is capturing"
not_capturing = ["doCheckError"]           # names whose truth means "the stream is not capturing"
drains = ["full_barrier"]                  # calls that really drain the stream before an unmap
conditional_drains = ["Rt::sync"]          # drains that may be deferred (a definition the sources lack)
unmaps = ["Pool::unmap_range"]             # calls that unmap (their definition is not in the audited tree)
requires_drain = ["Pages::refill"]         # frees / re-fills of memory kernels may still read
include = ["src/**"]                       # file globs (relative to the config's folder)
exclude = ["**/tests/**"]
[[tool.lockstep.audit.sink]]
call = "MyStream::wait"                    # `name` (a free function), `.name` (a method) or `Type::name`
kind = "sync"                              # a built-in kind, or a new one with its `why`
[[tool.lockstep.audit.never_captured]]   # functions the runtime never runs while capturing (its
function = "ggml_cuda_mul_mat_id"          # own checks turn graphs off for them): not followed
reason = "check_node_graph_compatibility disables CUDA graphs for MUL_MAT_ID that needs a sync"
[[tool.lockstep.audit.allow]]
file = "src/kernels/topk.cu"               # a suffix of the reported file
function = "TopK::ComputeInternal"         # as the audit prints it
call = "cudaStreamSynchronize"             # a substring of the call: a sink there is excused, and a
reason = "TopK is never captured: the EP excludes it from CUDA graphs"  # call there is not followed
```"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from .audit_index import AuditError
from .native_rules import DEFAULT_ENTRIES, DRAINS, GUARD_WORDS, WHY

try:
    import tomllib
except ModuleNotFoundError:  # Python < 3.11
    tomllib = None  # type: ignore[assignment]

CONFIG_NAMES = ("lockstep.toml", "pyproject.toml")


@dataclass
class NativeAllow:
    file: str
    function: str
    call: str
    reason: str
    used: int = 0


@dataclass
class NeverCaptured:
    function: str  # a glob over qualified names, as entries
    reason: str
    used: int = 0


@dataclass
class NativeConfig:
    entries: list[str] = field(default_factory=lambda: list(DEFAULT_ENTRIES))
    guards: set[str] = field(default_factory=lambda: set(GUARD_WORDS))
    not_capturing: set[str] = field(default_factory=set)
    drains: set[str] = field(default_factory=lambda: set(DRAINS))
    conditional_drains: set[str] = field(default_factory=set)  # "name" or "Type::name"
    unmaps: set[str] = field(default_factory=set)
    requires_drain: set[str] = field(default_factory=set)
    sinks: dict[str, str] = field(default_factory=dict)  # "name" | ".name" | "Type::name" -> kind
    why: dict[str, str] = field(default_factory=lambda: dict(WHY))
    include: list[str] = field(default_factory=list)
    exclude: list[str] = field(default_factory=list)
    allows: list[NativeAllow] = field(default_factory=list)
    never: list[NeverCaptured] = field(default_factory=list)
    source: Path | None = None  # the file it was read from
    base: Path | None = None  # its folder: include/exclude are relative to it


def _table(path: Path) -> dict | None:
    if tomllib is None:
        raise AuditError("reading the audit configuration needs Python 3.11 (tomllib)")
    try:
        data = tomllib.loads(path.read_text(encoding="utf-8"))
    except (tomllib.TOMLDecodeError, OSError, UnicodeDecodeError) as exc:
        raise AuditError(f"{path}: {exc}") from exc
    if path.name == "pyproject.toml":
        return data.get("tool", {}).get("lockstep", {}).get("audit")
    return data.get("audit", data.get("tool", {}).get("lockstep", {}).get("audit"))


def find_config(paths: list[Path]) -> Path | None:
    """The first lockstep.toml, or pyproject.toml with [tool.lockstep.audit], in the folder of a
    given path or above it."""
    seen: set[Path] = set()
    for p in paths:
        d = p.resolve() if p.is_dir() else p.resolve().parent
        for folder in [d, *d.parents]:
            if folder in seen:
                break
            seen.add(folder)
            for name in CONFIG_NAMES:
                cand = folder / name
                if cand.is_file() and _table(cand) is not None:
                    return cand
    return None


def _strings(t: dict, key: str, where: str) -> list[str]:
    v = t.get(key, [])
    if not isinstance(v, list) or not all(isinstance(x, str) and x.strip() for x in v):
        raise AuditError(f"{where}: `{key}` must be a list of non-empty strings")
    return list(v)


def load_config(path: Path | None) -> NativeConfig:
    if path is None:
        return NativeConfig()
    if not path.is_file():
        raise AuditError(f"--config {path}: no such file")
    t = _table(path)
    where = f"{path} [{'tool.lockstep.audit' if path.name == 'pyproject.toml' else 'audit'}]"
    if t is None:
        raise AuditError(f"{path}: no [{'tool.lockstep.audit' if path.name == 'pyproject.toml' else 'audit'}] table")
    known = {"entries", "default_entries", "guards", "not_capturing", "drains", "include", "exclude", "sink", "allow",
             "never_captured", "conditional_drains", "unmaps", "requires_drain"}
    unknown = sorted(set(t) - known)
    if unknown:
        raise AuditError(f"{where}: unknown key(s) {unknown} (known: {sorted(known)})")
    cfg = NativeConfig(source=path.resolve(), base=path.resolve().parent)
    default = t.get("default_entries", True)
    if not isinstance(default, bool):
        raise AuditError(f"{where}: `default_entries` must be true or false")
    own = _strings(t, "entries", where)
    cfg.entries = ([*DEFAULT_ENTRIES] if default else []) + own
    if not cfg.entries:
        raise AuditError(f"{where}: no entry points (default_entries = false and `entries` empty)")
    cfg.guards |= {g.replace("_", "").lower() for g in _strings(t, "guards", where)}
    cfg.not_capturing = {g.replace("_", "").lower() for g in _strings(t, "not_capturing", where)}
    cfg.drains |= set(_strings(t, "drains", where))
    cfg.conditional_drains = set(_strings(t, "conditional_drains", where))
    cfg.unmaps = set(_strings(t, "unmaps", where))
    cfg.requires_drain = set(_strings(t, "requires_drain", where))
    cfg.include = _strings(t, "include", where)
    cfg.exclude = _strings(t, "exclude", where)
    for i, s in enumerate(t.get("sink", [])):
        if not isinstance(s, dict) or not str(s.get("call", "")).strip() or not str(s.get("kind", "")).strip():
            raise AuditError(f"{where}: [[sink]] entry {i + 1} needs `call` and `kind`")
        kind = s["kind"]
        if kind not in cfg.why:
            if not str(s.get("why", "")).strip():
                raise AuditError(f"{where}: [[sink]] entry {i + 1}: kind {kind!r} is not built in "
                                 f"({', '.join(sorted(WHY))}): give its `why`")
            cfg.why[kind] = s["why"]
        cfg.sinks[s["call"]] = kind
    for i, a in enumerate(t.get("never_captured", [])):
        missing = [k for k in ("function", "reason") if not isinstance(a, dict) or not str(a.get(k, "")).strip()]
        if missing:
            raise AuditError(f"{where}: [[never_captured]] entry {i + 1} lacks {missing}")
        cfg.never.append(NeverCaptured(a["function"], a["reason"]))
    for i, a in enumerate(t.get("allow", [])):
        missing = [k for k in ("file", "function", "call", "reason") if not isinstance(a, dict) or not str(a.get(k, "")).strip()]
        if missing:
            raise AuditError(f"{where}: [[allow]] entry {i + 1} lacks {missing}")
        cfg.allows.append(NativeAllow(a["file"], a["function"], a["call"], a["reason"]))
    return cfg
