"""lockstep's pytest plugin: devices as parameters, mutant runtimes, contract-marker hygiene.

Fixtures
- ``device_name``: parametrizes a test over the selected devices (``--devices``, default all).
- ``device``: a fresh device of that name; an unavailable device is a visible skip with its
  reason, or a failure when ``LOCKSTEP_REQUIRE_DEVICES`` names it (for lanes that must have it).
- ``make_runtime(config=None)``: builds runtimes on ``device`` from the class under test: the real
  ``Runtime``, or the mutant named by ``--lockstep-mutant``; closes them at teardown.

Options: ``--devices=sim,cupy``, ``--lockstep-mutant=NAME``, ``--lockstep-report=FILE`` (per-test
outcomes as JSON, read by ``lockstep mutants``).
"""

from __future__ import annotations

import json
import os
import sys
import weakref
from collections import Counter

import pytest

from reference_runtime import RuntimeConfig
from reference_runtime.backends import DEVICES, available_devices, make_device

from .mutants import runtime_class

_STATE_KEY = pytest.StashKey[dict]()


def pytest_addoption(parser: pytest.Parser) -> None:
    g = parser.getgroup("lockstep")
    g.addoption("--devices", default=None, help=f"comma-separated devices to run on, of {list(DEVICES)} (default: all)")
    g.addoption("--lockstep-mutant", default=None, help="run the tests against this mutant runtime (see contracts.mutants)")
    g.addoption("--lockstep-report", default=None, help="write per-test outcomes to this JSON file")


def pytest_configure(config: pytest.Config) -> None:
    raw = config.getoption("--devices")
    selected = [d.strip() for d in raw.split(",") if d.strip()] if raw else list(DEVICES)
    unknown = [d for d in selected if d not in DEVICES]
    if unknown:
        raise pytest.UsageError(f"--devices: unknown device(s) {unknown}; devices are {list(DEVICES)}")
    required = [d.strip() for d in os.environ.get("LOCKSTEP_REQUIRE_DEVICES", "").split(",") if d.strip()]
    bad_required = [d for d in required if d not in DEVICES]
    if bad_required:
        raise pytest.UsageError(f"LOCKSTEP_REQUIRE_DEVICES names unknown device(s) {bad_required}")
    mutant = config.getoption("--lockstep-mutant")
    runtime_class(mutant)  # fail early on an unknown name
    config.pluginmanager.register(_OutcomeRecorder(config), "lockstep-outcomes")
    config.stash[_STATE_KEY] = {
        "selected": selected,
        "required": required,
        "availability": None,
        "mutant": mutant,
        "skipped": Counter(),
        "outcomes": {},
    }


def _state(config: pytest.Config) -> dict:
    return config.stash[_STATE_KEY]


def _availability(config: pytest.Config) -> dict[str, tuple[bool, str]]:
    st = _state(config)
    if st["availability"] is None:
        st["availability"] = available_devices()
    return st["availability"]


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    if "device_name" in metafunc.fixturenames:
        metafunc.parametrize("device_name", _state(metafunc.config)["selected"])


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
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


UNAVAILABLE = "lockstep: device unavailable: "


@pytest.fixture
def device_available(request: pytest.FixtureRequest, device_name: str) -> str:
    """The parametrized device's name, once it is known to be usable; otherwise a visible skip
    with its reason, or a failure when ``LOCKSTEP_REQUIRE_DEVICES`` names it."""
    st = _state(request.config)
    ok, reason = _availability(request.config)[device_name]
    if not ok:
        if device_name in st["required"]:
            pytest.fail(f"device {device_name!r} is required by LOCKSTEP_REQUIRE_DEVICES but unavailable: {reason}")
        pytest.skip(f"{UNAVAILABLE}{device_name}: {reason}")
    return device_name


@pytest.fixture
def device(device_available: str):
    """A fresh device of the parametrized kind (see ``device_available`` for absent devices)."""
    return make_device(device_available)


@pytest.fixture
def make_runtime(request: pytest.FixtureRequest, device):
    """Factory: ``make_runtime(config=None)`` builds the runtime under test (real or mutant).

    The default configuration is ``RuntimeConfig()`` (deferral on), never the environment, so a
    test states the configuration it checks."""
    cls = runtime_class(_state(request.config)["mutant"])
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




@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call):
    report = yield
    m = item.get_closest_marker("contract")
    if m is not None and m.args:
        report.user_properties.append(("contract", m.args[0]))
    return report


class _OutcomeRecorder:
    """Aggregates outcomes and device skips where reports arrive (the controller under xdist)."""

    def __init__(self, config: pytest.Config):
        self.config = config

    def pytest_runtest_logreport(self, report: pytest.TestReport) -> None:
        st = _state(self.config)
        contract = dict(report.user_properties).get("contract")
        entry = st["outcomes"].setdefault(report.nodeid, {"outcome": "passed", "contract": contract})
        if report.failed:
            entry["outcome"] = "failed"
        elif report.skipped and entry["outcome"] == "passed":
            entry["outcome"] = "skipped"
            msg = report.longrepr[2] if isinstance(report.longrepr, tuple) else str(report.longrepr)
            if UNAVAILABLE in msg:
                name, reason = msg.split(UNAVAILABLE, 1)[1].split(": ", 1)
                st["skipped"][(name, reason)] += 1


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    st = _state(session.config)
    st["exitstatus"] = int(exitstatus)
    path = session.config.getoption("--lockstep-report")
    if path:
        with open(path, "w") as f:
            json.dump(st["outcomes"], f, indent=1)


@pytest.hookimpl(trylast=True)
def pytest_unconfigure(config: pytest.Config) -> None:
    """Exit hard if a test poisoned a CUDA context: teardown in a poisoned context can hang."""
    mod = sys.modules.get("reference_runtime.backends.cupy")
    if mod is not None and mod.CupyDevice.poisoned_any:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(_state(config).get("exitstatus", 1))


def pytest_terminal_summary(terminalreporter, config: pytest.Config) -> None:
    st = _state(config)
    if st["mutant"]:
        terminalreporter.write_line(f"lockstep: runtime under test is the MUTANT {st['mutant']!r}", red=True)
    if st["skipped"]:
        terminalreporter.section("lockstep: unavailable devices")
        for (name, reason), n in sorted(st["skipped"].items()):
            terminalreporter.write_line(f"{name}: {n} test(s) skipped: {reason}", yellow=True)
        terminalreporter.write_line("set LOCKSTEP_REQUIRE_DEVICES=cupy to make an absent device a failure")
