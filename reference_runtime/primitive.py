"""What synchronises, declared once: a marker on each runtime primitive, and the tables derived from it.

``@primitive(...)`` on a runtime method (in the spirit of pluggy's ``HookimplMarker``) stores a
``Primitive`` on the function (attribute ``lockstep_primitive``) and returns the function itself,
unwrapped: no frame is added, so sync-debug's call sites and barrier checks see exactly the code
they saw before. ``collect(*owners)`` gathers the marked functions of classes and modules
(definition order); ``primitive_table.primitives()`` is the runtime's: ``Runtime``'s,
``reference_runtime/runtime.py``'s module functions and sync-debug's ``WatchedStream``'s. This module
imports neither the runtime nor sync-debug (both import it): every derivation takes the primitives.

Derived from the declarations, never written again elsewhere:

- ``sync_debug.PRIMITIVES`` (every ``records`` name) and ``sync_debug.CAPTURE_SAFE`` (the recorded
  names whose ``capture`` is legal inside a capture);
- the runtime's ``_BARRIERS`` (the code of every ``barrier=True`` primitive);
- the static audit's sink tables for runtime primitives (``audit_tables()``, ``audit_sinks()``) and
  the allowlist's ``[capture]`` entries for the runtime (``capture_entries()``);
- the primitive table of the top-level README (``markdown()``, between the markers
  ``<!-- primitives:begin -->`` / ``<!-- primitives:end -->``; ``python -m
  lockstep.reference_runtime.primitive_table --write`` rewrites it, ``--markdown`` prints it,
  ``--check`` fails when it is stale, as a test does).
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterable, TypeVar

__all__ = ["Primitive", "primitive", "collect", "CAPTURE", "SINK_KINDS", "audit_tables",
           "audit_sinks", "capture_entries", "markdown", "MARK_BEGIN", "MARK_END", "README", "rewrite"]

ATTR = "lockstep_primitive"  # the attribute the marker sets on a function

# What a primitive does when called while a capture is open, and whether that is legal there.
CAPTURE = {
    "captured": ("recorded into the graph", True),
    "deferred": ("deferred until the capture closes", True),
    "host": ("host-side only: legal", True),
    "lifecycle": ("opens or closes a capture", True),
    "refused": ("refused; the capture stays valid", False),
    "noop-or-invalidates": ("a no-op under deferral, else it invalidates the capture", False),
    "invalidates": ("invalidates the capture (`StreamCaptureUnsupported`)", False),
    "leaks": ("skips the drain and leaks the runtime's memory", False),
}
# The static audit's sink kinds a runtime primitive can be (contracts/audit.py's WHY keys).
SINK_KINDS = ("sync", "drain", "d2h", "runtime-copy", "free")
RECEIVERS = ("any", "runtime")  # audit: a sink whatever the receiver, or only on a runtime object

MARK_BEGIN = "<!-- primitives:begin (generated: python -m lockstep.reference_runtime.primitive_table --write) -->"
MARK_END = "<!-- primitives:end -->"
README = Path(__file__).resolve().parent.parent / "README.md"  # the checkout's README (absent from a wheel)

F = TypeVar("F", bound=Callable[..., Any])


@dataclass(frozen=True)
class Primitive:
    """One runtime primitive's declaration.

    ``records``: the names sync-debug records a call under (empty: not recorded); ``barrier``: a
    stream synchronise issued while it runs is its own drain, not a stray one; ``capture``: what it
    does inside a capture (a key of ``CAPTURE``); ``kind``: the static audit's sink kind, None if
    not a sink; ``receiver``: the audit's sink on any receiver or on a runtime only; ``why``: the
    kind's reason (declared on one primitive per kind); ``entry``: why it runs while a graph is
    recorded (the allowlist's ``[capture]`` entry), None if it does not; ``guarantee``: the README
    line; ``label``: its name in the README (default ``name``)."""

    name: str
    qualname: str
    module: str
    code: Any  # the function's code object (what sync-debug's barrier check compares)
    guarantee: str
    records: tuple[str, ...] = ()
    barrier: bool = False
    capture: str = "host"
    kind: str | None = None
    receiver: str = "any"
    why: str | None = None
    entry: str | None = None
    label: str | None = None

    @property
    def capture_safe(self) -> bool:
        return CAPTURE[self.capture][1]

    @property
    def file(self) -> str:
        """The file as the audit names it (relative to lockstep's root)."""
        root = Path(__file__).resolve().parent.parent
        path = Path(self.code.co_filename).resolve()
        try:
            return path.relative_to(root).as_posix()
        except ValueError:
            return path.as_posix()


def primitive(*, guarantee: str, records: Iterable[str] = (), barrier: bool = False, capture: str = "host",
              kind: str | None = None, receiver: str = "any", why: str | None = None, entry: str | None = None,
              label: str | None = None) -> Callable[[F], F]:
    """Mark a function as a runtime primitive (see ``Primitive``); the function is returned as is."""
    records = tuple(records)
    if capture not in CAPTURE:
        raise ValueError(f"capture={capture!r}: expected one of {sorted(CAPTURE)}")
    if kind is not None and kind not in SINK_KINDS:
        raise ValueError(f"kind={kind!r}: expected one of {list(SINK_KINDS)} or None")
    if receiver not in RECEIVERS:
        raise ValueError(f"receiver={receiver!r}: expected one of {list(RECEIVERS)}")
    if why is not None and kind is None:
        raise ValueError("why= explains an audit sink kind: declare kind= too")
    if not guarantee.strip():
        raise ValueError("a primitive states its guarantee")

    def mark(fn: F) -> F:
        setattr(fn, ATTR, Primitive(fn.__name__, fn.__qualname__, fn.__module__, fn.__code__, guarantee.strip(),
                                    records, barrier, capture, kind, receiver, why, entry, label))
        return fn

    return mark


def declared(obj: Any) -> Primitive | None:
    """The declaration on a function (or a method reached through a class), if any."""
    return getattr(obj, ATTR, None)


def collect(*owners: Any) -> list[Primitive]:
    """The primitives marked in ``owners`` (classes or modules), in each owner's definition order;
    for a class, then its bases' (MRO order, an overridden method once); for a module, only
    functions defined in it."""
    out: list[Primitive] = []
    for owner in owners:
        if inspect.ismodule(owner):
            scopes: list[dict[str, Any]] = [vars(owner)]
        else:  # a class: its own definitions, then each base's (MRO order) that it does not override
            scopes = [vars(k) for k in owner.__mro__ if k is not object]
        seen: set[str] = set()
        for scope in scopes:
            for name, value in scope.items():
                if name in seen or not inspect.isfunction(value) or (
                        inspect.ismodule(owner) and value.__module__ != owner.__name__):
                    continue
                seen.add(name)
                p = declared(value)
                if p is not None:
                    out.append(p)
    return out


# -- derivations ----------------------------------------------------------------------------------

def recorded_names(prims: Iterable[Primitive]) -> tuple[str, ...]:
    """sync-debug's ``PRIMITIVES``: every name a call is recorded under, in declaration order."""
    out: list[str] = []
    for p in prims:
        out += [r for r in p.records if r not in out]
    return tuple(out)


def capture_safe_names(prims: Iterable[Primitive]) -> frozenset[str]:
    """sync-debug's ``CAPTURE_SAFE``: recorded names that are legal while a capture is open."""
    return frozenset(r for p in prims if p.capture_safe for r in p.records)


def barrier_codes(prims: Iterable[Primitive]) -> frozenset[Any]:
    """The runtime's ``_BARRIERS``: the code objects of the barrier primitives."""
    return frozenset(p.code for p in prims if p.barrier)


def audit_tables(prims: Iterable[Primitive]) -> tuple[dict[str, str], dict[str, str], dict[str, str]]:
    """The audit's tables restricted to runtime primitives: ``(SYNC_METHODS, RUNTIME_METHODS, WHY)``
    (method name -> kind on any receiver, method name -> kind on a runtime receiver, kind -> why).

    A method name is one sink whatever class declares it (the audit matches call attributes by name),
    and each kind's reason is declared exactly once: a conflict is an error."""
    prims = list(prims)
    tables: dict[str, dict[str, str]] = {"any": {}, "runtime": {}}
    where: dict[str, str] = {}
    why: dict[str, str] = {}
    for p in prims:
        if p.kind is None:
            continue
        table = tables[p.receiver]
        if where.get(p.name, p.receiver) != p.receiver or table.get(p.name, p.kind) != p.kind:
            raise ValueError(f"{p.qualname}: {p.name!r} declared as two different audit sinks")
        table[p.name] = p.kind
        where[p.name] = p.receiver
        if p.why is not None:
            if p.kind in why:
                raise ValueError(f"{p.qualname}: the reason of sink kind {p.kind!r} is declared twice")
            why[p.kind] = p.why
    missing = sorted({k for t in tables.values() for k in t.values()} - set(why))
    if missing:
        raise ValueError(f"sink kinds without a declared reason (why=): {missing}")
    return tables["any"], tables["runtime"], why


def audit_sinks(prims: Iterable[Primitive]) -> dict[str, tuple[str, str]]:
    """Per runtime-primitive method name: its audit sink ``(kind, why)``."""
    sync, runtime, why = audit_tables(prims)
    return {name: (kind, why[kind]) for name, kind in {**sync, **runtime}.items()}


def capture_entries(prims: Iterable[Primitive]) -> list[dict[str, str]]:
    """The allowlist's ``[capture] entries`` for runtime primitives: ``{file, function, reason}``."""
    return [{"file": p.file, "function": p.qualname, "reason": p.entry} for p in prims if p.entry is not None]


def _cell(text: str) -> str:
    return " ".join(text.split()).replace("|", "\\|")


def markdown(prims: Iterable[Primitive]) -> str:
    """The README's primitive table (without the markers)."""
    rows = ["| primitive | guarantee | inside a capture | sync-debug records | barrier | audit sink |",
            "|---|---|---|---|---|---|"]
    for p in prims:
        label = p.label or (f"{p.name}()" if not p.name.startswith("_") else f"{p.qualname}()")
        records = ", ".join(f"`{r}`" for r in p.records) or "-"
        sink = "-" if p.kind is None else f"`{p.kind}`" + (" (on a runtime)" if p.receiver == "runtime" else "")
        rows.append(f"| `{_cell(label)}` | {_cell(p.guarantee)} | {CAPTURE[p.capture][0]} | {records} | "
                    f"{'yes' if p.barrier else '-'} | {sink} |")
    return "\n".join(rows) + "\n"


def rewrite(text: str, table: str) -> str:
    """``text`` with the block between the markers replaced by ``table``."""
    if text.count(MARK_BEGIN) != 1 or text.count(MARK_END) != 1 or text.index(MARK_BEGIN) > text.index(MARK_END):
        raise ValueError(f"expected one {MARK_BEGIN!r} ... {MARK_END!r} block")
    head, rest = text.split(MARK_BEGIN)
    _, tail = rest.split(MARK_END)
    return f"{head}{MARK_BEGIN}\n{table}{MARK_END}{tail}"
