"""lockstep's pytest plugin (entry point ``pytest11``): engines as parameters, golden models,
node-suite expectations and fail closed, the report. The reference runtime's own tests have a plugin
of their own (``lockstep.contracts.pytest_plugin``: devices, ``make_runtime``, mutants, ``ref_engine``).

Loaded by every pytest run where lockstep is installed, so it is cheap until lockstep's tests ask
for something: engines are loaded from the registry (``lockstep.engines``) the first time a
collected test needs one. This module holds the options, the markers and the fixtures; each other
job is a plugin of its own that it registers (``plugin_collection``, ``plugin_expectations``,
``plugin_outcomes``; the terminal summary is ``plugin_summary``; the models fetched and built before
the tests, said on the terminal, ``plugin_models``; progress lines with an estimate, ``plugin_progress``),
all over ``plugin_state.SuiteState``.

Fixtures
- ``engine``: parametrizes a test over the selected engines (``--engines``, default every
  registered one); an unavailable engine is a visible skip with its reason, or a failure when
  ``LOCKSTEP_REQUIRE_ENGINES`` names it. A test module that defines its own ``engine_name``
  fixture is left alone.
- ``golden_model``: parametrizes over the golden models (built-in, trained, exports, ``--golden-dir``);
  ``@pytest.mark.golden_kinds("user", ...)`` restricts a test to those kinds.

Options: ``--engines=ref-sim,mine,pkg.module:factory``, ``--lockstep-report=FILE`` (per-test
outcomes as JSON, read by ``lockstep mutants``), ``--lockstep-report-dir=DIR``,
``--lockstep-expectations=FILE``, ``--lockstep-shard=i/n``, ``--lockstep-gpus``, ``--golden-dir``,
``--lockstep-progress=auto|on|off`` (or ``LOCKSTEP_PROGRESS``).
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from lockstep.conformance import plugin_collection, plugin_expectations, plugin_models, plugin_outcomes, plugin_progress
from lockstep.conformance.plugin_state import MARKERS, STATE, SuiteState, golden_models, state
from lockstep.engines import selection
from lockstep.engines.registry import EngineLoadError
from lockstep.engines.selection import unavailable
from lockstep.paths import package_path



def pytest_addoption(parser: pytest.Parser) -> None:
    g = parser.getgroup("lockstep")
    g.addoption("--engines", default=None,
                help="comma-separated engines: registered names (entry points of lockstep.engines) or "
                     "pkg.module:factory (default: every registered engine)")
    g.addoption("--lockstep-report", default=None, help="write per-test outcomes to this JSON file")
    g.addoption("--lockstep-report-dir", default=None,
                help="write report.json and report.md (per-engine counts, op gaps) here")
    g.addoption("--lockstep-shard", default=None,
                help="i/n: run only the i-th of n deterministic shards (by a hash of each test's id), for a "
                     "CI matrix over machines; merge their reports with `lockstep report merge`")
    g.addoption("--lockstep-gpus", default=None,
                help="comma-separated GPU indices for pytest-xdist workers: worker gwN sees only GPU N mod len "
                     "(CUDA_VISIBLE_DEVICES), one GPU each on a multi-GPU runner")
    g.addoption("--fuzz-cases", type=int, default=300, help="cases of the fuzz test (marker fuzz; default 300)")
    g.addoption("--fuzz-seed", type=int, default=15, help="seed of the fuzz test (default 15)")
    g.addoption("--fuzz-out", default=None, help="folder for the fuzz test's report.json and reproducers "
                                                 "(default: a pytest temporary folder)")
    g.addoption("--golden-dir", action="append", default=[],
                help="a folder of golden snapshots written by `lockstep golden add` (repeatable): its models are "
                     "locked next to the built-in ones")
    g.addoption("--lockstep-cases-dir", action="append", default=[],
                help="a folder of ONNX backend node cases (model.onnx, test_data_set_0/) to run in the node suite "
                     "with its expectations (repeatable): a user's own, or `lockstep locate --reduce`'s")
    g.addoption("--lockstep-expectations", default=None,
                help="expectations file (default: the packaged lockstep/conformance/node_suite/expectations.toml; "
                     "'none': only the engines' own files)")
    g.addoption("--lockstep-progress", default=None, choices=plugin_progress.SETTINGS,
                help="a line now and then with the tests done, elapsed and an estimate of the time left: "
                     f"auto (default: unless -v), on, off; default from ${plugin_progress.ENV}")


def pytest_configure(config: pytest.Config) -> None:
    for marker in MARKERS:
        config.addinivalue_line("markers", marker)
    plugin_collection.pin_gpu(config)
    plugin_collection.one_thread_per_worker(config)
    shard = plugin_collection.parse_shard(config.getoption("--lockstep-shard"))
    suite = _runs_lockstep_suite(config)
    progress = plugin_progress.setting(config.getoption("--lockstep-progress"), os.environ)
    config.stash[STATE] = SuiteState(shard=shard, suite=suite, progress=progress)
    # the plugin's jobs, each a plugin of its own over the typed state (plugin_state.SuiteState)
    config.pluginmanager.register(plugin_expectations, "lockstep-expectations")
    config.pluginmanager.register(plugin_outcomes, "lockstep-outcome-labels")
    config.pluginmanager.register(plugin_outcomes.OutcomeRecorder(config), "lockstep-outcomes")
    config.pluginmanager.register(plugin_collection.LastModifyItems(config), "lockstep-last-modifyitems")
    if getattr(config, "workerinput", None) is None:  # the process that owns the terminal
        config.pluginmanager.register(plugin_models.ModelPreparer(config), "lockstep-models")
        if plugin_progress.enabled(progress, config.getoption("verbose")):
            config.pluginmanager.register(plugin_progress.Progress(config), "lockstep-progress")
    # Engines named on the command line, or all registered ones when this run is lockstep's suite,
    # load now: a bad one is one usage error up front. Otherwise (a user's own tests that take the
    # `engine` fixture) they load when a test first needs one.
    sel = selection.of(config)
    if sel.specs or suite:
        try:
            sel.engines()
        except EngineLoadError as exc:
            raise pytest.UsageError(f"--engines: {exc}" if sel.specs else f"lockstep: {exc}") from None
    _check_required(config)
    if config.getoption("--golden-dir"):
        golden_models(config)  # a missing or malformed folder: one usage error, no run, no report
    if suite:
        from lockstep.paths import CacheDirError, cache_dir

        try:
            cache_dir()
        except CacheDirError as exc:
            raise pytest.UsageError(str(exc)) from None


def _check_required(config: pytest.Config) -> None:
    """LOCKSTEP_REQUIRE_ENGINES, once, at session start: each must be selected and available here,
    else one line and a non-zero exit (a lane that must have them fails closed)."""
    sel = selection.of(config)
    problems = []
    if sel.required:
        engines = selection.engines(config)
        for name in sel.required:
            if name not in engines:
                problems.append(f"LOCKSTEP_REQUIRE_ENGINES names {name}, which is not selected "
                                f"(engines: {', '.join(engines)})")
            else:
                ok, why = sel.availability(name)
                if not ok:
                    problems.append(f"LOCKSTEP_REQUIRE_ENGINES: engine {name} is unavailable here: {why}")
    if problems:
        raise pytest.UsageError("; ".join(problems))


def _runs_lockstep_suite(config: pytest.Config) -> bool:
    """Whether this run collects one of lockstep's suites (an argument inside or above the
    lockstep.conformance or lockstep.contracts.suite package, or ``--pyargs lockstep...``)."""
    suites = [package_path(p).resolve() for p in ("lockstep.conformance", "lockstep.contracts.suite")]
    for arg in config.args:
        target = str(arg).split("::")[0]
        if config.option.pyargs and target.split(".")[0] == "lockstep":
            return True
        path = Path(target).resolve()
        for suite in suites:
            if path == suite or suite in path.parents or path in suite.parents:
                return True
    return False


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    names = metafunc.fixturenames
    if "engine_name" in names and not selection.own_fixture(metafunc, "engine_name"):
        metafunc.parametrize("engine_name", list(selection.engines(metafunc.config)))
    if "case" in names and callable(getattr(metafunc.module, "node_cases", None)):
        # the node suite's cases (ONNX's and --lockstep-cases-dir's), after the engines: ids ENGINE-CASE
        metafunc.parametrize("case", metafunc.module.node_cases(metafunc.config), ids=lambda c: c.name)
    if "golden_model_name" in names and not selection.own_fixture(metafunc, "golden_model_name"):
        kinds = metafunc.definition.get_closest_marker("golden_kinds")
        models = [m.name for m in golden_models(metafunc.config) if kinds is None or m.kind in kinds.args]
        metafunc.parametrize("golden_model_name", models or [pytest.param(None, id="none", marks=pytest.mark.skip(
            reason=f"no golden model of kind {', '.join(kinds.args if kinds else ())} selected"
                   + (" (--golden-dir adds a user's)" if kinds and "user" in kinds.args else "")))])


@pytest.fixture
def golden_model(request: pytest.FixtureRequest, golden_model_name: str):
    """The parametrized golden model (``lockstep.golden.catalog.GoldenModel``): built-in, trained
    (a counted skip where it cannot be had here, a failure when ``LOCKSTEP_REQUIRE_MODELS`` names
    it or says ``all``), or from ``--golden-dir``."""
    gm = next(m for m in golden_models(request.config) if m.name == golden_model_name)
    ok, reason = gm.available()
    if not ok:
        unavailable("model", gm.name, reason, selection.split(os.environ.get("LOCKSTEP_REQUIRE_MODELS")))
    return gm


def _usable(request: pytest.FixtureRequest, name: str):
    sel = selection.of(request.config)
    eng = selection.engines(request.config)[name]
    ok, reason = sel.availability(name)  # asked once per engine and session
    if not ok:
        unavailable("engine", name, reason, sel.required)
    return eng


@pytest.fixture
def engine(request: pytest.FixtureRequest, engine_name: str):
    """The parametrized engine (one object per engine and process); an unavailable engine is a
    visible skip with its reason, or a failure when ``LOCKSTEP_REQUIRE_ENGINES`` names it."""
    return _usable(request, engine_name)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    # in this order: a shard's tests are the ones expectations are applied to and then ordered
    plugin_collection.shard_items(config, items)
    plugin_expectations.apply(config, items)
    plugin_collection.longest_first(config, items)


def pytest_terminal_summary(terminalreporter, config: pytest.Config) -> None:
    from lockstep.conformance.plugin_summary import terminal_summary

    terminal_summary(terminalreporter, config, state(config))
