"""Finding engines: the ``lockstep.engines`` entry-point group, or ``pkg.module:factory``.

Every engine, the four built-in ones included, is registered the same way: an entry point whose
value is a zero-argument factory (a function or a class) returning an object of the engine
protocol (``protocol.Engine``). lockstep's own ``pyproject.toml`` registers ``ref-sim``,
``ref-cuda``, ``ort-cpu`` and ``ort-cuda``; a third-party package adds its own::

    [project.entry-points."lockstep.engines"]
    mine = "my_runtime.lockstep_engine:make_engine"

An engine not installed as a package is named as ``my_module:make_engine``: a module importable
from ``sys.path`` (``PYTHONPATH``...) or, failing that, from the working directory (``lockstep`` and
``pytest`` are console scripts: Python puts their own folder on the path, not the working one; the
working directory is appended, after everything installed, only when the module is not found). Loading validates the object against the protocol, as
pluggy validates a plugin against its spec: an engine that fails to import, to build, or to
validate is an ``EngineLoadError`` naming the entry point, never a silent absence.
"""

from __future__ import annotations

import importlib
import os
import sys
from importlib.metadata import EntryPoint, entry_points
from pathlib import Path
from typing import Any

from lockstep.errors import LockstepError

from .protocol import PRECISIONS, capabilities

__all__ = ["GROUP", "EngineLoadError", "registered", "load_engine", "validate", "spec_of", "load_available"]

GROUP = "lockstep.engines"
OWN_DISTRIBUTION = "lockstep-conformance"


class EngineLoadError(LockstepError, RuntimeError):
    """An engine could not be found, imported, built or validated; the message names the entry point."""


def _dist_name(ep: EntryPoint) -> str:
    dist = getattr(ep, "dist", None)
    return dist.metadata["Name"] if dist is not None else "?"


def registered() -> dict[str, EntryPoint]:
    """Registered engines by name: lockstep's own first, then those of other packages, each group
    sorted by name. Two packages registering one name is an error."""
    found: dict[str, EntryPoint] = {}
    for ep in entry_points(group=GROUP):
        if ep.name in found and found[ep.name].value != ep.value:
            raise EngineLoadError(
                f"engine name {ep.name!r} is registered twice: {found[ep.name].value} "
                f"({_dist_name(found[ep.name])}) and {ep.value} ({_dist_name(ep)})")
        found[ep.name] = ep
    if not found:
        raise EngineLoadError(f"no engines registered under the entry-point group {GROUP!r}: "
                              f"is lockstep installed (`pip install {OWN_DISTRIBUTION}`, or `pip install -e .` in a checkout)?")
    own = sorted(n for n, ep in found.items() if _dist_name(ep).lower() == OWN_DISTRIBUTION)
    others = sorted(n for n in found if n not in own)
    return {n: found[n] for n in [*own, *others]}


def _is_spec(text: str) -> bool:
    return ":" in text


def _import(module: str):
    """``module``, from ``sys.path`` or else from the working directory (appended to ``sys.path``
    for it: after everything installed, so it never shadows a package)."""
    try:
        return importlib.import_module(module)
    except ModuleNotFoundError as exc:
        cwd = os.getcwd()
        on_path = {os.path.abspath(p or os.curdir) for p in sys.path}
        if exc.name != module.split(".")[0] or cwd in on_path:
            raise  # a dependency of the module is missing, or the working directory was searched
        sys.path.append(cwd)
        importlib.invalidate_caches()
        try:
            return importlib.import_module(module)
        except ModuleNotFoundError as again:
            if again.name == exc.name:  # not there either: the path is left as it was
                sys.path.remove(cwd)
                raise ModuleNotFoundError(f"{again} (looked on sys.path and in the working directory {cwd})",
                                          name=again.name) from None
            raise


def load_engine(name_or_spec: str) -> Any:
    """Build the engine registered as ``name_or_spec``, or made by the factory ``pkg.module:factory``."""
    text = name_or_spec.strip()
    if _is_spec(text):
        module, _, attr = text.partition(":")
        origin = f"engine factory {text!r}"
        if not module.strip() or not attr.strip():
            raise EngineLoadError(f"{origin}: expected pkg.module:factory, with both parts named")
        try:
            factory = getattr(_import(module), attr)
        except (ImportError, ValueError, TypeError) as exc:  # ValueError: a relative or malformed module name
            raise EngineLoadError(f"{origin}: cannot import {module!r}: {exc}") from exc
        except AttributeError:
            raise EngineLoadError(f"{origin}: module {module!r} has no attribute {attr!r}") from None
        expected_name = None
    else:
        eps = registered()
        if text not in eps:
            raise EngineLoadError(f"unknown engine {text!r}; registered: {list(eps)} "
                                  "(or name a factory as pkg.module:factory)")
        ep = eps[text]
        origin = f"engine entry point {text!r} ({ep.value}, from {_dist_name(ep)})"
        try:
            factory = ep.load()
        except Exception as exc:
            raise EngineLoadError(f"{origin} failed to load: {type(exc).__name__}: {exc}") from exc
        expected_name = text
    if not callable(factory):
        raise EngineLoadError(f"{origin}: {factory!r} is not callable (an engine factory takes no arguments)")
    try:
        engine = factory()
    except Exception as exc:
        raise EngineLoadError(f"{origin}: the factory raised {type(exc).__name__}: {exc}") from exc
    validate(engine, origin, expected_name)
    capabilities(engine)  # its optional members, resolved once, here
    _SPECS[id(engine)] = (engine, text)
    return engine


def load_available(name_or_spec: str) -> Any:
    """``load_engine``, then its ``available()``: an ``EngineLoadError`` saying why it cannot run here
    (what a command that runs one engine needs before it starts)."""
    engine = load_engine(name_or_spec)
    ok, why = engine.available()
    if not ok:
        raise EngineLoadError(f"engine {engine.name} is unavailable here: {why}")
    return engine


# engine -> what it was loaded by (the object kept, so that its id is never reused while here)
_SPECS: dict[int, tuple[Any, str]] = {}


def spec_of(engine: Any) -> str:
    """What loads ``engine`` again on a command line: its registered name, or the ``pkg.module:factory``
    it was built by (its name for an engine built any other way)."""
    held = _SPECS.get(id(engine))
    return held[1] if held is not None and held[0] is engine else engine.name


def validate(engine: Any, origin: str = "engine", expected_name: str | None = None) -> Any:
    """Check ``engine`` against the protocol; raise ``EngineLoadError`` naming each problem."""
    problems = []
    name = getattr(engine, "name", None)
    if not isinstance(name, str) or not name or "," in name or name != name.strip():
        problems.append(f"`name` must be a non-empty string without commas or spaces around it, got {name!r}")
    elif expected_name is not None and name != expected_name:
        problems.append(f"`name` is {name!r} but it is registered as {expected_name!r}")
    for method in ("available", "prepare"):
        if not callable(getattr(engine, method, None)):
            problems.append(f"no `{method}()` method")
    if hasattr(engine, "decoder") and not callable(engine.decoder):
        problems.append("`decoder` is not callable")
    precision = getattr(engine, "precision", None)
    if precision is not None:
        if not hasattr(precision, "items"):
            problems.append(f"`precision` must map model dtypes to precisions, got {precision!r}")
        else:
            bad = {d: p for d, p in precision.items() if p not in PRECISIONS}
            if bad:
                problems.append(f"`precision` names unknown precision(s) {bad}; known: {list(PRECISIONS)}")
    expectations = getattr(engine, "expectations", None)
    if expectations is not None:  # a file not written yet is allowed: no case is expected (fail closed)
        try:
            if Path(os.fspath(expectations)).is_dir():
                problems.append(f"`expectations` {expectations} is a folder, not a TOML file")
        except TypeError:
            problems.append(f"`expectations` must be a path, got {expectations!r}")
    self_tests = getattr(engine, "self_tests", None)
    if self_tests is not None:  # a package name: `lockstep check` runs it with --pyargs
        import importlib.util

        ok = isinstance(self_tests, str) and all(p.isidentifier() for p in self_tests.split("."))
        if not ok:
            problems.append(f"`self_tests` must name an importable package, got {self_tests!r}")
        elif importlib.util.find_spec(self_tests) is None:
            problems.append(f"`self_tests` names {self_tests!r}, which is not importable here")
    if problems:
        raise EngineLoadError(f"{origin} does not implement the engine protocol:\n  - " + "\n  - ".join(problems))
    return engine
