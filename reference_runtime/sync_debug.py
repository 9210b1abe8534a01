"""Sync-debug mode: a record of every synchronising or host-reading primitive a runtime executes.

Turned on per runtime by ``RuntimeConfig(sync_debug="warn"|"error")`` (environment:
``LOCKSTEP_SYNC_DEBUG``). The runtime then appends a ``SyncEvent`` to ``Runtime.sync_log`` for each
call of one of ``PRIMITIVES``, naming the ONNX node executing at the time (``Runtime.current_node``,
set by the executor) and the call site: the first stack frame outside ``reference_runtime/runtime.py``,
this module and ``reference_runtime/backends/``.

The runtime's ``compute`` and ``copy_stream`` become ``WatchedStream`` proxies that forward every
attribute to the real stream and intercept ``synchronize()``. A stream synchronise issued from
inside a known barrier of the runtime (``download`` and ``copy`` through the forced synchronise,
``drain_for_unmap``, ``synchronize()`` with deferral off, ``close``) is part of that primitive and not
recorded again; any other is recorded as ``"stream.synchronize"``.

Violations (``error`` raises ``SyncDebugError`` before the call reaches the device, so an open
capture stays valid; ``warn`` issues ``SyncDebugWarning`` at the call site and carries on):
- a primitive other than ``free`` and ``copy`` called while a capture is open, including a
  ``synchronize()`` that eager-sync deferral makes a silent no-op there (it would invalidate the
  capture once deferral is off);
- a ``stream.synchronize()`` outside the known barriers while deferral is on: a real drain on the
  deferred eager path.
"""

from __future__ import annotations

import os
import sys
import warnings
from dataclasses import dataclass
from types import CodeType, FrameType
from typing import Any, Callable, Iterable

from . import primitive as _primitive
from .errors import SyncDebugError
from .primitive import primitive

__all__ = ["SyncEvent", "SyncDebugWarning", "WatchedStream", "PRIMITIVES", "CAPTURE_SAFE", "summarize", "record"]

# PRIMITIVES (every name an event can carry) and CAPTURE_SAFE (those legal inside a capture: a
# device-to-device copy becomes a graph node, a free is deferred to end_capture) are derived from the
# runtime's @primitive declarations (reference_runtime/primitive.py): the runtime declares them here
# (``declare``) once its class is defined, since it imports this module before it declares them.
PRIMITIVES: tuple[str, ...] = ()
CAPTURE_SAFE: frozenset[str] = frozenset()


def declare(prims) -> None:
    """Set ``PRIMITIVES`` and ``CAPTURE_SAFE`` from the runtime's primitives (runtime.py, at import)."""
    global PRIMITIVES, CAPTURE_SAFE
    PRIMITIVES = _primitive.recorded_names(prims)
    CAPTURE_SAFE = _primitive.capture_safe_names(prims)


class SyncDebugWarning(UserWarning):
    """Sync-debug mode ``warn``: a call that mode ``error`` would refuse with ``SyncDebugError``."""


@dataclass(frozen=True)
class SyncEvent:
    primitive: str  # one of PRIMITIVES
    capturing: bool  # a capture was open on the runtime when it was called
    node: str | None  # Runtime.current_node at the call
    file: str  # call site: relative to lockstep's root (as the audit names files), else to the working directory
    line: int
    function: str  # co_qualname of the call site's code

    @property
    def site(self) -> str:
        return f"{self.file}:{self.line}"


_PKG_DIR = os.path.dirname(os.path.abspath(__file__))
_REPO_ROOT = os.path.dirname(_PKG_DIR)  # the source checkout, or the installed lockstep package
_INTERNAL_FILES = {os.path.join(_PKG_DIR, f) for f in ("runtime.py", "runtime_capture.py", "sync_debug.py")}
_BACKENDS_DIR = os.path.join(_PKG_DIR, "backends") + os.sep
_internal_cache: dict[str, bool] = {}
_relpath_cache: dict[str, str] = {}


def _is_internal(filename: str) -> bool:
    hit = _internal_cache.get(filename)
    if hit is None:
        path = os.path.abspath(filename)
        hit = _internal_cache[filename] = path in _INTERNAL_FILES or path.startswith(_BACKENDS_DIR)
    return hit


def _relpath(filename: str) -> str:
    rel = _relpath_cache.get(filename)
    if rel is None:
        path = os.path.abspath(filename)
        for root in (_REPO_ROOT, os.getcwd()):
            if path.startswith(root + os.sep):
                path = os.path.relpath(path, root).replace(os.sep, "/")
                break
        rel = _relpath_cache[filename] = path
    return rel


def call_site(frame: FrameType | None) -> FrameType | None:
    """The first frame at or above ``frame`` outside the runtime, this module and the backends."""
    while frame is not None and _is_internal(frame.f_code.co_filename):
        frame = frame.f_back
    return frame


def in_barrier(frame: FrameType | None, barriers: frozenset[CodeType]) -> bool:
    """True if ``frame`` or a runtime-internal frame above it (up to the call site) runs one of the
    runtime's known-barrier functions."""
    while frame is not None and _is_internal(frame.f_code.co_filename):
        if frame.f_code in barriers:
            return True
        frame = frame.f_back
    return False


def called_from_runtime(frame: FrameType | None) -> bool:
    """True if ``frame`` (a caller) is runtime-internal: a nested primitive, already recorded."""
    return frame is not None and _is_internal(frame.f_code.co_filename)


def record(rt: Any, primitive: str, *, capturing: bool, violation: str | None, frame: FrameType | None) -> SyncEvent:
    """Append a ``SyncEvent`` to ``rt.sync_log``; on a violation raise (``error``) or warn (``warn``).

    ``frame`` is where to start looking for the call site (the caller of the primitive)."""
    site = call_site(frame)
    if site is None:
        file, line, function = "<unknown>", 0, "<unknown>"
    else:
        code = site.f_code
        file, line, function = _relpath(code.co_filename), site.f_lineno, getattr(code, "co_qualname", code.co_name)
    event = SyncEvent(primitive, capturing, rt.current_node, file, line, function)
    rt.sync_log.append(event)
    if violation is not None:
        mode = rt.config.sync_debug
        message = (f"sync-debug: {primitive} {violation}; node {event.node!r}, "
                   f"call site {event.file}:{event.line} in {event.function}")
        if mode == "error":
            raise SyncDebugError(message, event=event)
        if mode == "warn":
            if site is None:
                warnings.warn(message, SyncDebugWarning, stacklevel=2)
            else:
                g = site.f_globals
                warnings.warn_explicit(message, SyncDebugWarning, site.f_code.co_filename, site.f_lineno,
                                       module=g.get("__name__"), registry=g.setdefault("__warningregistry__", {}),
                                       module_globals=g)
    return event


class WatchedStream:
    """A runtime stream seen through sync-debug: every attribute is the real stream's, except that
    ``synchronize()`` outside the runtime's known barriers is recorded (and checked) first.

    ``isinstance(w, SimStream)`` (or ``CupyStream``) holds, so a watched stream can be handed to a
    device call; ``unwrapped`` is the real stream."""

    __slots__ = ("_target", "_runtime", "_barriers")

    def __init__(self, target: Any, runtime_ref: Callable[[], Any], barriers: frozenset[CodeType]):
        object.__setattr__(self, "_target", target)
        object.__setattr__(self, "_runtime", runtime_ref)
        object.__setattr__(self, "_barriers", barriers)

    @property  # type: ignore[misc]
    def __class__(self):  # noqa: D105 - isinstance() checks see the real stream's class
        return type(self._target)

    @property
    def unwrapped(self) -> Any:
        return self._target

    def __getattr__(self, name: str) -> Any:
        return getattr(self._target, name)

    def __setattr__(self, name: str, value: Any) -> None:
        setattr(self._target, name, value)

    def __eq__(self, other: object) -> bool:
        return self._target == (other._target if type(other) is WatchedStream else other)

    def __hash__(self) -> int:
        return hash(self._target)

    def __repr__(self) -> str:
        return f"<watched {self._target!r}>"

    @primitive(
        records=("stream.synchronize",), capture="invalidates", kind="sync", label="compute/copy_stream.synchronize()",
        guarantee="a drain of one stream: under sync-debug recorded outside the runtime's known barriers (inside "
                  "one it is that primitive's own drain)")
    def synchronize(self) -> None:
        rt = self._runtime()
        caller = sys._getframe(1)
        if rt is not None and not in_barrier(caller, self._barriers):
            capturing = rt.is_capturing or bool(self._target.is_capturing)
            if capturing:
                violation = "called while a capture is open"
            elif rt.config.defer_eager_sync:
                violation = ("is a real stream drain on the deferred eager path outside the known barriers "
                             "(download, copy, drain_for_unmap, close)")
            else:
                violation = None
            record(rt, "stream.synchronize", capturing=capturing, violation=violation, frame=caller)
        del caller
        return self._target.synchronize()


def summarize(log: Iterable[SyncEvent]) -> dict[tuple[str, int, str], dict[str, Any]]:
    """Per call site ``(file, line, function)``: a count per primitive, and ``capturing``: whether
    any of its events happened while a capture was open. Sites in first-seen order."""
    out: dict[tuple[str, int, str], dict[str, Any]] = {}
    for ev in log:
        entry = out.setdefault((ev.file, ev.line, ev.function), {"capturing": False})
        entry[ev.primitive] = entry.get(ev.primitive, 0) + 1
        entry["capturing"] = entry["capturing"] or ev.capturing
    return out
