"""Source mutants: one plausible edit to one module, applied at import time in a child pytest.

A ``Mutant`` names a module of the ``lockstep`` namespace, a snippet of its source (which must
occur exactly once: a snippet that no longer matches is a *stale* mutant, an error, never a pass),
the replacement, the guarantee the edit breaks and the tests that claim that guarantee. The child
process (``python -m lockstep.contracts.mutation``) installs an import hook that compiles the
mutated source in place of the file's (no bytecode is written, the tree is never touched), then
imports the mutated module (before pytest's own import hook can load it) and runs pytest on the
mutant's tests. The mutant is *killed* when at least one of them fails.

This module imports nothing of lockstep's runtime, so the hook is in place before pytest's plugin
imports the mutated modules.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import importlib.util
import json
import sys
from dataclasses import asdict, dataclass, field
from pathlib import Path

from lockstep.errors import LockstepError

__all__ = ["Mutant", "StaleMutant", "install", "mutated_source", "to_json", "from_json"]


class StaleMutant(LockstepError, LookupError):
    """A mutant's snippet does not occur exactly once in its module's source."""


@dataclass(frozen=True)
class Mutant:
    """One edit that breaks one guarantee.

    ``tests`` are pytest arguments relative to the checkout root (paths or node ids); ``select`` is
    a ``-k`` expression, ``marks`` a ``-m`` expression. ``equivalent`` holds the argument when the
    edit cannot change behaviour the tests can observe (such a mutant is expected to survive).
    ``ci`` puts the mutant in the subset CI runs on every submission. ``devices`` are the devices
the edit can matter on (an edit of a CUDA kernel's source: ``("cupy",)``).
    """

    layer: str
    name: str
    module: str            # dotted name under lockstep, e.g. "lockstep.reference_runtime.executor"
    old: str               # exact source text, occurring exactly once
    new: str
    breaks: str            # the guarantee, in one sentence
    tests: tuple[str, ...]
    select: str | None = None
    marks: str | None = None
    ci: bool = False
    equivalent: str | None = None
    extra: tuple[str, ...] = field(default=())  # more pytest arguments
    devices: tuple[str, ...] = ("sim", "cupy")  # where the edit can matter (a CUDA source: cupy only)

    @property
    def key(self) -> str:
        return f"{self.layer}.{self.name}"

    def pytest_args(self) -> list[str]:
        args = list(self.tests)
        if self.select:
            args += ["-k", self.select]
        if self.marks:
            args += ["-m", self.marks]
        return args + list(self.extra)

    def target(self) -> tuple:
        """What a baseline run is shared by: the same tests, selection and options."""
        return (self.tests, self.select, self.marks, self.extra)


def _module_path(module: str) -> Path:
    """The module's source file, found without importing it or its parent packages (a package's
    ``__init__`` often imports the very module a mutant must later load mutated)."""
    parts = module.split(".")
    spec = importlib.util.find_spec(parts[0])
    for i in range(1, len(parts)):
        if spec is None or not spec.submodule_search_locations:
            break
        name, locations, spec = ".".join(parts[:i + 1]), list(spec.submodule_search_locations), None
        for finder in sys.meta_path:
            if isinstance(finder, _Finder) or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(name, locations)
            if spec is not None:
                break
    if spec is None or not spec.origin or not spec.origin.endswith(".py"):
        raise StaleMutant(f"module {module!r} has no Python source")
    return Path(spec.origin)


def mutated_source(m: Mutant, source: str | None = None) -> str:
    """The module's source with the mutant applied; StaleMutant when the snippet is not unique."""
    if source is None:
        source = _module_path(m.module).read_text()
    n = source.count(m.old)
    if n != 1:
        where = "does not occur" if n == 0 else f"occurs {n} times"
        raise StaleMutant(f"mutant {m.key}: its snippet {where} in {m.module} "
                          f"(the code changed: update or remove the mutant): {m.old.strip()[:80]!r}")
    if m.old == m.new:
        raise StaleMutant(f"mutant {m.key}: the replacement equals the original")
    return source.replace(m.old, m.new)


class _Loader(importlib.machinery.SourceFileLoader):
    def __init__(self, fullname: str, path: str, mutants: list[Mutant], applied: set[str]):
        super().__init__(fullname, path)
        self._mutants = mutants
        self._applied = applied

    def get_code(self, fullname):  # never read or write cached bytecode for a mutated module
        source = Path(self.path).read_text()
        for m in self._mutants:
            source = mutated_source(m, source)
        self._applied.add(fullname)
        return compile(source, self.path, "exec", dont_inherit=True)

    def set_data(self, *args, **kwargs):  # pragma: no cover - get_code never caches
        return None


class _Finder(importlib.abc.MetaPathFinder):
    def __init__(self, mutants: list[Mutant]):
        self.by_module: dict[str, list[Mutant]] = {}
        for m in mutants:
            self.by_module.setdefault(m.module, []).append(m)
        self.applied: set[str] = set()

    def find_spec(self, fullname, path, target=None):
        if fullname not in self.by_module:
            return None
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(fullname, path, target)
            if spec is not None:
                break
        else:
            return None
        if not spec.origin or not spec.origin.endswith(".py"):
            return None
        spec.loader = _Loader(fullname, spec.origin, self.by_module[fullname], self.applied)
        spec.cached = None
        return spec


def install(mutants: list[Mutant]) -> _Finder:
    """Mutate these modules when they are first imported. Refuses a module already imported."""
    for m in mutants:
        mutated_source(m)  # stale mutants fail here, before anything runs
        if m.module in sys.modules:
            raise RuntimeError(f"{m.module} is already imported: the mutant {m.key} would not apply")
    finder = _Finder(mutants)
    sys.meta_path.insert(0, finder)
    return finder


def to_json(m: Mutant) -> str:
    return json.dumps(asdict(m))


def from_json(text: str) -> Mutant:
    d = json.loads(text)
    return Mutant(**{k: tuple(v) if isinstance(v, list) else v for k, v in d.items()})


def _child(argv: list[str]) -> int:
    """``python -m lockstep.contracts.mutation MUTANT.json RESULT.json -- PYTEST-ARGS``."""
    spec_path, result_path = argv[0], argv[1]
    pytest_args = argv[argv.index("--") + 1:]
    mutant = from_json(Path(spec_path).read_text())
    finder = install([mutant])
    # Import the mutated module now: pytest's assertion-rewriting hook goes to the front of
    # sys.meta_path and would load lockstep's modules (a pytest plugin's package) itself.
    importlib.import_module(mutant.module)
    import pytest

    rc = pytest.main(pytest_args)
    Path(result_path).write_text(json.dumps({"applied": sorted(finder.applied), "returncode": int(rc)}))
    return int(rc)


if __name__ == "__main__":
    sys.exit(_child(sys.argv[1:]))
