"""The engines one pytest run selected, shared by lockstep's two pytest plugins (the suite's,
``lockstep.conformance.pytest_plugin``, and the reference runtime's, ``lockstep.contracts.pytest_plugin``).

``--engines`` (default: every registered engine) is read once, when a plugin first asks
(``of(config)``); the engines load once per process, the first time one is needed, and each is asked
``available()`` once. An absent engine, device or model is a visible skip with its reason, or a
failure where the lane's ``LOCKSTEP_REQUIRE_<KIND>S`` names it (``unavailable``).
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any

import pytest

from .registry import EngineLoadError, load_engine, registered

__all__ = ["Selection", "of", "engines", "own_fixture", "runtime_device", "split", "unavailable", "UNAVAILABLE"]

UNAVAILABLE = "lockstep: unavailable: "  # the prefix of every such skip (the terminal summary counts them)


def split(raw: str | None) -> list[str]:
    """A comma-separated list (an option or an environment variable), blanks dropped."""
    return [n.strip() for n in raw.split(",") if n.strip()] if raw else []


@dataclass
class Selection:
    specs: list[str]                     # --engines, as given (empty: every registered engine)
    required: list[str]                  # LOCKSTEP_REQUIRE_ENGINES
    loaded: Any = None                   # name -> engine, or the EngineLoadError that stopped loading
    available: dict[str, tuple[bool, str]] = field(default_factory=dict)  # engine -> asked once

    def engines(self) -> dict:
        """The selected engines by name, loaded (imported, built, validated) on first call; raises
        the ``EngineLoadError`` naming the first that fails, on this call and every later one."""
        if self.loaded is None:
            try:
                self.loaded = _load(self.specs or list(registered()))
            except EngineLoadError as exc:
                self.loaded = exc
        if isinstance(self.loaded, EngineLoadError):
            raise self.loaded
        return self.loaded

    def loaded_engines(self) -> dict:
        """The engines loaded so far ({} when none was needed, or loading failed)."""
        return self.loaded if isinstance(self.loaded, dict) else {}

    def availability(self, name: str) -> tuple[bool, str]:
        if name not in self.available:
            self.available[name] = self.engines()[name].available()
        return self.available[name]


def _load(specs: list[str]) -> dict:
    objs: dict = {}
    for spec in specs:
        eng = load_engine(spec)
        if eng.name in objs:
            raise EngineLoadError(f"engine {eng.name!r} is selected twice")
        objs[eng.name] = eng
    return objs


_KEY = pytest.StashKey[Selection]()


def of(config: pytest.Config) -> Selection:
    """This run's selection (made on first call, from ``--engines`` and ``LOCKSTEP_REQUIRE_ENGINES``)."""
    sel = config.stash.get(_KEY, None)
    if sel is None:
        sel = config.stash[_KEY] = Selection(split(config.getoption("--engines", None)),
                                             split(os.environ.get("LOCKSTEP_REQUIRE_ENGINES")))
    return sel


def engines(config: pytest.Config) -> dict:
    """The selected engines; a failure to load one is a usage error naming it."""
    try:
        return of(config).engines()
    except EngineLoadError as exc:
        raise pytest.UsageError(f"lockstep: {exc}") from None


def own_fixture(metafunc: pytest.Metafunc, name: str) -> bool:
    """True if the test's module or conftest defines ``name`` itself (lockstep's plugins leave it alone)."""
    return bool(metafunc._arg2fixturedefs.get(name))


def runtime_device(engine: Any) -> str | None:
    """The reference-runtime device an engine runs on (the protocol's optional ``runtime_device``):
    such an engine brings the reference runtime's own tests; any other engine is a runtime of its own."""
    from .protocol import capabilities

    return capabilities(engine).runtime_device


def unavailable(kind: str, name: str, reason: str, required: list[str]) -> None:
    """An absent device, engine or model: a visible skip with its reason, or a failure where the
    lane's ``LOCKSTEP_REQUIRE_<KIND>S`` names it (or says ``all``)."""
    if name in required or "all" in required:
        pytest.fail(f"{kind} {name!r} is required by LOCKSTEP_REQUIRE_{kind.upper()}S but unavailable: {reason}")
    pytest.skip(f"{UNAVAILABLE}{name}: {reason}")
