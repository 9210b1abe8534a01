"""The reference runtime's pytest plugin (entry point ``pytest11``, ``lockstep-runtime``): what its
own tests (``lockstep.contracts.suite``) need, kept out of the suite users run on their engines.

Loaded by every pytest run where lockstep is installed, so it imports nothing heavy until one of
the fixtures below is asked for (the runtime, its devices and the mutant catalogue load then).

Fixtures
- ``device_name`` / ``device``: parametrizes over the selected devices (``--devices``; default the
  devices of the reference engines that ``--engines`` names, or all when it is not given); an
  unavailable device is a visible skip, or a failure when ``LOCKSTEP_REQUIRE_DEVICES`` names it.
- ``make_runtime(config=None)``: builds runtimes on ``device`` from the class under test: the real
  ``Runtime``, or the mutant named by ``--lockstep-mutant``; closes them at teardown.
- ``ref_engine``: parametrizes over the selected engines that are the reference runtime (those
  with a ``runtime_device``: tests of its own machinery, paging, sync-debug, capture plans).

Markers: ``contract(name)`` (a runtime primitive's guarantee: exactly one name and a docstring
stating it, checked at collection), ``parity``, ``capture_guard``, ``paging``, ``gpu``.
Options: ``--devices=sim,cupy``, ``--lockstep-mutant=NAME``.
"""

from __future__ import annotations

import os
import sys
import weakref
from dataclasses import dataclass

import pytest

from lockstep.engines import selection

MARKERS = (
    "contract(name): a test of a named runtime-primitive guarantee; its docstring states the guarantee",
    "gpu: needs a CUDA device (skipped, visibly, without one)",
    "parity: simulated-vs-CUDA parity scenarios",
    "capture_guard: node cases captured on the simulated device with host reads refused (docs/capture-guard.md)",
    "paging: weight paging checks",
)
MARKER_NAMES = frozenset(m.split("(")[0].split(":")[0] for m in MARKERS)
SUITE = "lockstep.contracts.suite"   # the reference engines' own tests (their ``self_tests``)
OWN = "reference-runtime"            # the report's engine for a self-test with neither engine nor device


@dataclass
class RuntimeState:
    selected: list[str] | None           # devices the runtime's own tests run on (None: not decided yet)
    required: list[str]                  # LOCKSTEP_REQUIRE_DEVICES
    mutant: str | None                   # --lockstep-mutant: the runtime class under test
    availability: dict[str, tuple[bool, str]] | None = None   # device -> (available, why not)
    exitstatus: int = 1                  # the session's, for a hard exit after a poisoned CUDA context


_KEY = pytest.StashKey[RuntimeState]()


def pytest_addoption(parser: pytest.Parser) -> None:
    g = parser.getgroup("lockstep")
    g.addoption("--devices", default=None,
                help="comma-separated reference-runtime devices to run its own tests on, e.g. sim,cupy (default: "
                     "those of the reference engines --engines names, or all of reference_runtime.backends.DEVICES)")
    g.addoption("--lockstep-mutant", default=None,
                help="run the tests against this mutant runtime (see lockstep.contracts.mutants)")


def _devices() -> tuple[str, ...]:
    """The reference runtime's devices (``reference_runtime.backends.DEVICES``: a backend added there
    is a device here), imported only when a run names or needs one."""
    from lockstep.reference_runtime.backends import DEVICES

    return DEVICES


def _names(raw: str | None, where: str) -> list[str]:
    names = selection.split(raw)
    unknown = [n for n in names if n not in _devices()] if names else []
    if unknown:
        raise pytest.UsageError(f"{where}: unknown name(s) {unknown}; known: {list(_devices())}")
    return names


def pytest_configure(config: pytest.Config) -> None:
    for marker in MARKERS:
        config.addinivalue_line("markers", marker)
    given = config.getoption("--devices")
    required = _names(os.environ.get("LOCKSTEP_REQUIRE_DEVICES"), "LOCKSTEP_REQUIRE_DEVICES")
    mutant = config.getoption("--lockstep-mutant")
    if mutant:
        from lockstep.contracts.mutants import runtime_class

        try:
            runtime_class(mutant)  # fail early on an unknown name
        except ValueError as exc:
            raise pytest.UsageError(f"--lockstep-mutant: {exc}") from None
    config.stash[_KEY] = RuntimeState(_names(given, "--devices") or (list(_devices()) if given is not None else None),
                                      required, mutant)
    if required:  # a lane that must have these devices fails closed at the start, in one line
        problems = []
        for name in required:
            if name not in _selected(config):
                problems.append(f"LOCKSTEP_REQUIRE_DEVICES names {name}, which --devices does not select "
                                f"({','.join(_selected(config))})")
            else:
                ok, why = _availability(config)[name]
                if not ok:
                    problems.append(f"LOCKSTEP_REQUIRE_DEVICES: device {name} is unavailable here: {why}")
        if problems:
            raise pytest.UsageError("; ".join(problems))


def _state(config: pytest.Config) -> RuntimeState:
    return config.stash[_KEY]


def _selected(config: pytest.Config) -> list[str]:
    """--devices, or the devices of the reference engines --engines names, or all when neither is given."""
    st = _state(config)
    if st.selected is None:
        sel = selection.of(config)
        if sel.specs:
            on = {selection.runtime_device(e) for e in selection.engines(config).values()}
            st.selected = [d for d in _devices() if d in on]
        else:
            st.selected = list(_devices())
    return st.selected


def _availability(config: pytest.Config) -> dict[str, tuple[bool, str]]:
    st = _state(config)
    if st.availability is None:
        from lockstep.reference_runtime.backends import available_devices

        st.availability = available_devices()
    return st.availability


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    names = metafunc.fixturenames
    if "device_name" in names and not selection.own_fixture(metafunc, "device_name"):
        metafunc.parametrize("device_name", _selected(metafunc.config) or [pytest.param(
            None, marks=pytest.mark.skip(reason="no reference-runtime device selected: --engines names no reference "
                                                "engine (--devices=sim,cupy runs the runtime's own contract tests)"))])
    if "ref_engine_name" in names and not selection.own_fixture(metafunc, "ref_engine_name"):
        refs = [n for n, e in selection.engines(metafunc.config).items() if selection.runtime_device(e)]
        metafunc.parametrize("ref_engine_name", refs or [pytest.param(
            None, marks=pytest.mark.skip(reason="no reference-runtime engine selected (--engines): "
                                                "this test checks the reference runtime's own machinery"))])


@pytest.fixture
def device_available(request: pytest.FixtureRequest, device_name: str) -> str:
    """The parametrized device's name, once it is known to be usable; otherwise a visible skip
    with its reason, or a failure when ``LOCKSTEP_REQUIRE_DEVICES`` names it."""
    ok, reason = _availability(request.config)[device_name]
    if not ok:
        selection.unavailable("device", device_name, reason, _state(request.config).required)
    return device_name


@pytest.fixture
def device(device_available: str):
    """A fresh device of the parametrized kind (see ``device_available`` for absent devices)."""
    from lockstep.reference_runtime.backends import make_device

    return make_device(device_available)


@pytest.fixture
def make_runtime(request: pytest.FixtureRequest, device):
    """Factory: ``make_runtime(config=None)`` builds the runtime under test (real or mutant).

    The default configuration is ``RuntimeConfig()`` (deferral on), never the environment, so a
    test states the configuration it checks."""
    from lockstep.contracts.mutants import runtime_class
    from lockstep.reference_runtime import RuntimeConfig

    cls = runtime_class(_state(request.config).mutant)
    made: list[weakref.ref] = []  # weak: a test may drop a runtime on purpose

    def make(config: RuntimeConfig | None = None):
        rt = cls(device, config if config is not None else RuntimeConfig())
        made.append(weakref.ref(rt))
        return rt

    yield make
    for ref in made:
        rt = ref()
        if rt is None:
            continue
        try:
            rt.close()
        except Exception:  # a test that poisoned its device has already failed for that
            pass


@pytest.fixture
def ref_engine(request: pytest.FixtureRequest, ref_engine_name: str):
    """A selected reference-runtime engine (``ref-sim``, ``ref-cuda``): a visible skip with its
    reason where it is unavailable, a failure when ``LOCKSTEP_REQUIRE_ENGINES`` names it."""
    sel = selection.of(request.config)
    ok, reason = sel.availability(ref_engine_name)
    if not ok:
        selection.unavailable("engine", ref_engine_name, reason, sel.required)
    return selection.engines(request.config)[ref_engine_name]


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """A contract test names exactly one guarantee and states it in its docstring (a usage error otherwise)."""
    problems = []
    for item in items:
        m = item.get_closest_marker("contract")
        if m is None:
            continue
        if len(m.args) != 1 or not isinstance(m.args[0], str) or not m.args[0]:
            problems.append(f"{item.nodeid}: @pytest.mark.contract needs exactly one name, got {m.args!r}")
        fn = getattr(item, "function", None)
        if fn is None or not (fn.__doc__ or "").strip():
            problems.append(f"{item.nodeid}: a contract test needs a docstring stating its guarantee")
    if problems:
        raise pytest.UsageError("contract tests malformed:\n  " + "\n  ".join(problems))


def _in_suite(item: pytest.Item) -> bool:
    return (getattr(item, "module", None) is not None and item.module.__name__.startswith(SUITE)) \
        or f"{os.sep}contracts{os.sep}suite{os.sep}" in str(item.path)


@pytest.hookimpl(tryfirst=True, wrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call):
    """The report's engine of a reference-runtime test (before the suite's plugin labels the rest):
    its reference engine, the engine that runs on its device (or the device), else ``reference-runtime``
    for the runtime's own checks; and its contract."""
    if call.when == "setup" and not any(k == "engine" for k, _ in item.user_properties):
        params = getattr(getattr(item, "callspec", None), "params", {})
        who = params.get("ref_engine_name")
        if not who and params.get("device_name"):
            on = {selection.runtime_device(e): n for n, e in selection.of(item.config).loaded_engines().items()}
            who = on.get(params["device_name"], params["device_name"])
        if not who and not params.get("engine_name") and _in_suite(item):
            who = OWN
        if who:
            item.user_properties.append(("engine", who))
        m = item.get_closest_marker("contract")
        if m is not None and m.args:
            item.user_properties.append(("contract", m.args[0]))
    return (yield)


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    _state(session.config).exitstatus = int(exitstatus)


@pytest.hookimpl(trylast=True)
def pytest_unconfigure(config: pytest.Config) -> None:
    """Exit hard if a test poisoned a CUDA context: teardown in a poisoned context can hang."""
    mod = sys.modules.get("lockstep.reference_runtime.backends.cupy")
    if mod is not None and mod.CupyDevice.poisoned_any:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(_state(config).exitstatus)
