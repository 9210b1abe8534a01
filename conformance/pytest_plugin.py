"""lockstep's pytest plugin (entry point ``pytest11``): engines as parameters, golden models,
node-suite expectations and fail closed, the report. The reference runtime's own tests have a plugin
of their own (``lockstep.contracts.pytest_plugin``: devices, ``make_runtime``, mutants, ``ref_engine``).

Loaded by every pytest run where lockstep is installed, so it is cheap until lockstep's tests ask
for something: engines are loaded from the registry (``lockstep.engines``) the first time a
collected test needs one.

Fixtures
- ``engine``: parametrizes a test over the selected engines (``--engines``, default every
  registered one); an unavailable engine is a visible skip with its reason, or a failure when
  ``LOCKSTEP_REQUIRE_ENGINES`` names it. A test module that defines its own ``engine_name``
  fixture is left alone.
- ``golden_model``: parametrizes over the golden models (built-in, trained, exports, ``--golden-dir``);
  ``@pytest.mark.golden_kinds("user", ...)`` restricts a test to those kinds.

Options: ``--engines=ref-sim,mine,pkg.module:factory``, ``--lockstep-report=FILE`` (per-test
outcomes as JSON, read by ``lockstep mutants``), ``--lockstep-report-dir=DIR``,
``--lockstep-expectations=FILE``, ``--lockstep-shard=i/n``, ``--lockstep-gpus``, ``--golden-dir``.
"""

from __future__ import annotations

import functools
import json
import os
import sys
from pathlib import Path
from typing import Any

import pytest

from lockstep.conformance import expectations
from lockstep.conformance.plugin_state import SuiteState
from lockstep.engines import selection
from lockstep.engines.registry import EngineLoadError
from lockstep.engines.selection import UNAVAILABLE, unavailable
from lockstep.paths import package_path

_STATE_KEY = pytest.StashKey[SuiteState]()

MARKERS = (
    "node_suite: ONNX backend node cases per engine",
    "golden: golden token locks",
    "golden_kinds(*kinds): parametrize golden_model over models of these kinds only (builtin, trained, export, user)",
    "capture: CUDA graph capture checks",
    "fuzz: the fuzzer (lockstep.conformance.fuzz): mutated models, feeds and command lines; --fuzz-cases, --fuzz-seed",
)


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
    g.addoption("--lockstep-expectations", default=None,
                help="expectations file (default: the packaged lockstep/conformance/node_suite/expectations.toml; "
                     "'none': only the engines' own files)")


_split = selection.split


def _shard(raw: str | None) -> tuple[int, int] | None:
    if not raw:
        return None
    try:
        i, n = (int(x) for x in raw.split("/"))
    except ValueError:
        raise pytest.UsageError(f"--lockstep-shard {raw!r}: expected i/n, e.g. 1/4") from None
    if not 1 <= i <= n:
        raise pytest.UsageError(f"--lockstep-shard {raw}: i must be in 1..n")
    return i, n


def _pin_gpu(config: pytest.Config) -> None:
    """On an xdist worker, before anything touches CUDA: one GPU of --lockstep-gpus per worker."""
    raw = config.getoption("--lockstep-gpus")
    worker = getattr(config, "workerinput", {}).get("workerid")
    if not raw or worker is None:
        return
    gpus = _split(raw)
    if not gpus or not all(g.isdigit() for g in gpus):
        raise pytest.UsageError(f"--lockstep-gpus {raw!r}: expected GPU indices, e.g. 0,1,2,3")
    if "cupy" in sys.modules:
        raise pytest.UsageError("--lockstep-gpus: CuPy was imported before the plugin could pin this worker's GPU")
    os.environ["CUDA_VISIBLE_DEVICES"] = gpus[int(worker.removeprefix("gw")) % len(gpus)]


# One thread each for numpy's BLAS and ONNX Runtime in pytest-xdist workers: every worker starting a
# thread per core on the same cores made a decode step's matrix-vector products 30x slower (10.8 ms
# instead of 0.37 ms for SmolLM2's, two workers on two cores). Set in the controller before the
# workers start (they read it when they import numpy and build engines); a value already set wins.
WORKER_THREADS = {"OPENBLAS_NUM_THREADS": "1", "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1",
                  "LOCKSTEP_ORT_THREADS": "1"}


def _one_thread_per_worker(config: pytest.Config) -> None:
    if getattr(config, "workerinput", None) is not None:
        return
    workers = getattr(config.option, "numprocesses", None)
    if workers and getattr(config.option, "dist", "no") != "no":
        for key, value in WORKER_THREADS.items():
            os.environ.setdefault(key, value)


def pytest_configure(config: pytest.Config) -> None:
    for marker in MARKERS:
        config.addinivalue_line("markers", marker)
    _pin_gpu(config)
    _one_thread_per_worker(config)
    shard = _shard(config.getoption("--lockstep-shard"))
    config.pluginmanager.register(_OutcomeRecorder(config), "lockstep-outcomes")
    config.pluginmanager.register(_LastModifyItems(config), "lockstep-last-modifyitems")
    suite = _runs_lockstep_suite(config)
    config.stash[_STATE_KEY] = SuiteState(shard=shard, suite=suite)
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
        _golden_models(config)  # a missing or malformed folder: one usage error, no run, no report
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
        engines = _engines(config)
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


def _state(config: pytest.Config) -> SuiteState:
    return config.stash[_STATE_KEY]


def _engines(config: pytest.Config) -> dict:
    """The selected engines by name (``--engines``, default every registered one), loaded once per
    process: at configuration when they are named or the run is lockstep's suite, else the first
    time a collected test needs one. A failure names the entry point or factory."""
    return selection.engines(config)


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


def _own_fixture(metafunc: pytest.Metafunc, name: str) -> bool:
    """True if the test's module or conftest defines ``name`` itself (lockstep leaves it alone)."""
    return bool(metafunc._arg2fixturedefs.get(name))


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    names = metafunc.fixturenames
    if "engine_name" in names and not _own_fixture(metafunc, "engine_name"):
        metafunc.parametrize("engine_name", list(_engines(metafunc.config)))
    if "golden_model_name" in names and not _own_fixture(metafunc, "golden_model_name"):
        kinds = metafunc.definition.get_closest_marker("golden_kinds")
        models = [m.name for m in _golden_models(metafunc.config) if kinds is None or m.kind in kinds.args]
        metafunc.parametrize("golden_model_name", models or [pytest.param(None, id="none", marks=pytest.mark.skip(
            reason=f"no golden model of kind {', '.join(kinds.args if kinds else ())} selected"
                   + (" (--golden-dir adds a user's)" if kinds and "user" in kinds.args else "")))])


def _golden_models(config: pytest.Config) -> list:
    st = _state(config)
    if st.golden is None:
        from lockstep.golden.catalog import GoldenError, catalog

        try:
            st.golden = catalog(config.getoption("--golden-dir"))
        except GoldenError as exc:
            raise pytest.UsageError(str(exc)) from None
    return st.golden


@pytest.fixture
def golden_model(request: pytest.FixtureRequest, golden_model_name: str):
    """The parametrized golden model (``lockstep.golden.catalog.GoldenModel``): built-in, trained
    (a counted skip where it cannot be had here, a failure when ``LOCKSTEP_REQUIRE_MODELS`` names
    it or says ``all``), or from ``--golden-dir``."""
    gm = next(m for m in _golden_models(request.config) if m.name == golden_model_name)
    ok, reason = gm.available()
    if not ok:
        unavailable("model", gm.name, reason, _split(os.environ.get("LOCKSTEP_REQUIRE_MODELS")))
    return gm


def _usable(request: pytest.FixtureRequest, name: str):
    sel = selection.of(request.config)
    eng = _engines(request.config)[name]
    ok, reason = sel.availability(name)  # asked once per engine and session
    if not ok:
        unavailable("engine", name, reason, sel.required)
    return eng


@pytest.fixture
def engine(request: pytest.FixtureRequest, engine_name: str):
    """The parametrized engine (one object per engine and process); an unavailable engine is a
    visible skip with its reason, or a failure when ``LOCKSTEP_REQUIRE_ENGINES`` names it."""
    return _usable(request, engine_name)


def _expectations(config: pytest.Config) -> list:
    """Every entry that applies here: the expectations file (``--lockstep-expectations``, default the
    packaged one) and each selected engine's own file."""
    st = _state(config)
    if st.expect is None:
        given = config.getoption("--lockstep-expectations")
        path = Path(given) if given and given != "none" else (
            None if given == "none" else package_path("lockstep.conformance.node_suite", "expectations.toml"))
        if path is not None and given and not path.is_file():
            raise pytest.UsageError(f"--lockstep-expectations: {path} does not exist")
        try:
            entries = expectations.load(path) if path is not None and path.is_file() else []
            for name, eng in _engines(config).items():
                own = getattr(eng, "expectations", None)
                if own is not None and Path(os.fspath(own)).is_file():  # not written yet: nothing expected
                    entries += expectations.load(Path(os.fspath(own)), name)
        except expectations.ExpectationsError as exc:
            raise pytest.UsageError(str(exc)) from None
        # variants of one plugin sharing a file load it once each: an entry naming one of them once
        unique = {(e.file, e.engine, tuple(e.patterns), e.kind, e.reason, tuple(e.when.items())): e for e in entries}
        st.expect = [e for e in unique.values() if expectations.applies(e)]
    return st.expect


def _kept_by_keyword(config: pytest.Config):
    """With ``-k``, a function is collected with only some of its parameters: an entry for a key ``-k``
    left out is not stale (the complete run judges it). Returns None without ``-k``, else
    ``kept(pattern, engine)``: whether ``-k`` would have selected that exact key (pytest's own
    expression; a glob pattern, or an expression this cannot evaluate, is never judged under ``-k``)."""
    kexpr = config.getoption("keyword", "")
    if not kexpr:
        return None
    try:
        from _pytest.mark.expression import Expression

        expr = Expression.compile(kexpr)
    except Exception:
        return lambda pat, engine: False

    def kept(pat: str, engine: str) -> bool:
        if "*" in pat or "?" in pat:
            return False
        func, _, params = pat.partition("[")
        names = [f"{func}[{engine}-{params}".lower() if params else func.lower(), func.lower()]
        try:
            return bool(expr.evaluate(lambda ident, **kw: not kw and any(ident.lower() in n for n in names)))
        except Exception:
            return False

    return kept


def _stale_entries(entries: list, collected: set[str], universe: set[str], kept=None) -> str:
    """What is stale among the selected engines' entries: a pattern of a test function's key whose
    function was collected but matches none of its keys, or a node-case pattern matching no node
    case (``universe``: every case, empty when the node suite was not collected). '' when none."""
    functions = {k.split("[")[0] for k in collected}
    stale = []
    for e in entries:
        for pat in e.patterns:
            if "[" in pat:  # a test function's key: judged when that function was collected
                if kept is not None and not kept(pat, e.engine):
                    continue
                if pat.split("[")[0] in functions and not expectations.filter_keys(collected, pat):
                    stale.append((e, pat))
            elif universe and not expectations.filter_keys(universe, pat):
                stale.append((e, pat))
    if not stale:
        return ""
    return ("node-suite expectations: entries matching no case (delete them): "
            + "; ".join(f"{e.file}: {e.engine} {pat}" for e, pat in stale[:20])
            + (f"; ... and {len(stale) - 20} more" if len(stale) > 20 else ""))


def _engine_of_nodeid(nodeid: str, engines: list[str]) -> str | None:
    """The selected engine a test's node id names in its parameters (the longest that fits:
    ort-cuda-tf32 before ort-cuda), or None for a test with no engine."""
    params = nodeid.split("::")[-1].partition("[")[2].rstrip("]")
    if not params:
        return None
    parts = params.split("-")
    fits = [e for e in engines
            if any("-".join(parts[i:i + e.count("-") + 1]) == e for i in range(len(parts)))]
    return max(fits, key=len) if fits else None


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_node_collection_finished(node: Any, ids: list[str]) -> None:
    """The controller of a pytest-xdist run collects nothing: it judges the expectations' stale
    entries from the first worker's node ids (every worker collects the same), and a stale entry
    ends the run before any test runs, as a usage error does without workers."""
    config = node.config
    st = _state(config)
    if st.stale_checked:
        return
    st.stale_checked = True
    engines = sorted(_engines(config))
    keys, node_cases = set(), False
    for nodeid in ids:
        engine = _engine_of_nodeid(nodeid, engines)
        if engine is None:
            continue
        keys.add(expectations.key_from_nodeid(nodeid, engine))
        node_cases = node_cases or nodeid.split("::")[-1].startswith("test_node_case[")
    if not keys:
        return
    entries = [e for e in _expectations(config) if e.engine in engines]
    universe: set[str] = set()
    if node_cases:
        from lockstep.reference_runtime.node_cases import load_cases

        universe = {c.name for c in load_cases()}
    stale = _stale_entries(entries, keys, universe, _kept_by_keyword(config))
    if stale:
        pytest.exit(stale, returncode=pytest.ExitCode.USAGE_ERROR)


def _apply_expectations(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Mark engine tests as expected: strict xfails and skips as markers; expected-unsupported
    entries are remembered per item (``pytest_runtest_makereport`` fails a case that newly cannot
    run). An entry of a selected engine that matches no case is stale: a usage error."""
    engine_items = [it for it in items if getattr(it, "callspec", None) is not None
                    and it.callspec.params.get("engine_name") is not None]
    if not engine_items:
        return
    st = _state(config)
    engines = _engines(config)
    entries = [e for e in _expectations(config) if e.engine in engines]
    keys = {}
    for it in engine_items:
        keys[it.nodeid] = (it.callspec.params["engine_name"], expectations.test_key(it, it.callspec.params["engine_name"]))
    # node cases collected (their key is the case: test_key), as the controller of an xdist run judges it
    if any(hasattr(it.callspec.params.get("case"), "name") for it in engine_items):
        from lockstep.reference_runtime.node_cases import load_cases

        universe = {c.name for c in load_cases()}  # every case, whatever -k or node ids selected
    else:
        universe = set()
    # a pytest-xdist worker leaves the judgement to the controller (pytest_xdist_node_collection_finished):
    # a usage error raised on a worker is an INTERNALERROR there
    if getattr(config, "workerinput", None) is None:
        stale = _stale_entries(entries, {k for _, k in keys.values()}, universe, _kept_by_keyword(config))
        if stale:
            raise pytest.UsageError(stale)
    unsupported = st.expected_unsupported
    # The first entry (in file order) with a matching pattern applies. Most patterns are exact case
    # names: looked up in a dict; the glob ones are tried in order, only while they come first.
    exact: dict[tuple[str, str], int] = {}
    globs: dict[str, list[tuple[int, str]]] = {}
    for k, e in enumerate(entries):
        for pat in e.patterns:
            if "*" in pat or "?" in pat:
                globs.setdefault(e.engine, []).append((k, pat))
            else:
                exact.setdefault((e.engine, pat), k)
    for it in engine_items:
        engine, key = keys[it.nodeid]
        first = exact.get((engine, key))
        for k, pat in globs.get(engine, ()):
            if first is not None and k >= first:
                break
            if expectations.match(key, pat):
                first = k
                break
        if first is None:
            continue
        e = entries[first]
        if e.kind == "unsupported":
            unsupported[it.nodeid] = e
        elif e.kind == "xfail":
            it.add_marker(pytest.mark.xfail(strict=True, reason=e.reason))
        else:
            it.add_marker(pytest.mark.skip(reason=e.reason))


def _longest_first(config: pytest.Config, items: list[pytest.Item]) -> None:
    """On pytest-xdist workers, the largest golden models' tests (the trained ones take seconds each, a
    node case milliseconds) are dealt out evenly, each worker's share at the head of its queue.
    pytest-xdist hands each of its ``n`` workers one contiguous share of the collection at the start
    (``--dist worksteal``: an idle worker then takes the tail of a busy one's queue; ``load`` never
    takes anything back): collected last, the long tests kept one worker busy while the other sat
    idle (``lockstep check`` on two cores: 171 s, 1.2 cores busy); sorted to the front, they all went
    to one worker. The rest keep their order. Every worker computes the same order (from the model
    kinds and files, never from what a build left behind); one process keeps the collected order."""
    workers = int(getattr(config, "workerinput", {}).get("workercount") or 0)
    if workers < 2 or not any("golden_model_name" in getattr(getattr(it, "callspec", None), "params", {})
                              for it in items):
        return
    sizes: dict[str, float] = {}
    for m in _golden_models(config):
        # a trained model (built on first use, the largest) ranks first whatever its build's state, which
        # may change while another worker collects
        path = m._path if m.kind != "trained" else None
        sizes[m.name] = path.stat().st_size if path is not None and path.is_file() else float("inf")

    def size(it: pytest.Item) -> float:
        return sizes.get(getattr(getattr(it, "callspec", None), "params", {}).get("golden_model_name"), 0)

    # the long ones: golden tests of a model a hundred times the smallest's size or more
    smallest = min(sizes.values())
    long_ = sorted((it for it in items if size(it) >= 100 * smallest), key=size, reverse=True)
    if not long_:
        return
    # dealt by model, each model's tests on one worker (it loads a trained model once: 3 s each time),
    # the most tests to the worker with the fewest so far
    by_model: dict[str, list[pytest.Item]] = {}
    for it in long_:
        by_model.setdefault(it.callspec.params["golden_model_name"], []).append(it)
    heads: list[list[pytest.Item]] = [[] for _ in range(workers)]
    for tests in sorted(by_model.values(), key=len, reverse=True):
        min(heads, key=len).extend(tests)
    chosen = set(map(id, long_))
    rest = [it for it in items if id(it) not in chosen]
    ordered: list[pytest.Item] = []
    remaining = len(items)
    for i in range(workers):  # the shares pytest-xdist deals: remaining // workers left, in turn
        share = remaining // (workers - i)
        remaining -= share
        head = heads[i]
        take = max(0, share - len(head))
        ordered += head + rest[:take]
        del rest[:take]
    items[:] = ordered + rest


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    shard = _state(config).shard
    if shard is not None:  # deterministic: the same test id lands in the same shard on every machine
        import zlib

        i, n = shard
        keep = [it for it in items if zlib.crc32(it.nodeid.encode()) % n == i - 1]
        dropped = [it for it in items if zlib.crc32(it.nodeid.encode()) % n != i - 1]
        if dropped:
            config.hook.pytest_deselected(items=dropped)
        items[:] = keep
    _apply_expectations(config, items)
    _longest_first(config, items)


def _collapse_unavailable(config: pytest.Config, items: list[pytest.Item]) -> None:
    """An unavailable engine's tests: the first of each test function is kept, skipped with the
    engine's reason and standing for all of that function's tests of the engine (user property
    ``stands_for``: the terminal summary and the report count them all); the rest are deselected.
    Skipping ref-cuda's and ort-cuda's 1,884 node cases one by one cost CI more than running
    ort-cpu's (13 ms a test under pytest-xdist). A required engine never gets here: an unavailable
    one ends the session at its start (``_check_required``)."""
    engines = selection.of(config).loaded_engines()
    if not engines:  # no test took lockstep's engines (they load when one does)
        return
    params_of = [(it, getattr(getattr(it, "callspec", None), "params", {}).get("engine_name")) for it in items]
    names = {name for _, name in params_of if name in engines}  # a test's own engine_name fixture: not ours
    if not names:
        return
    sel = selection.of(config)
    down = {name for name in names if not sel.availability(name)[0]}
    if not down:
        return
    first: dict[tuple, list] = {}
    keep, drop = [], []
    for it, name in params_of:
        if name in down:
            key = (name, str(it.path), getattr(it, "originalname", it.name))
            if key in first:
                first[key][1] += 1
                drop.append(it)
                continue
            first[key] = [it, 1]
        keep.append(it)
    for it, n in first.values():
        it.user_properties.append(("stands_for", n))
    if drop:
        config.hook.pytest_deselected(items=drop)
        items[:] = keep


class _LastModifyItems:
    """Collection changes made after pytest's own -k/-m/--deselect (a hook of its own: trylast)."""

    def __init__(self, config: pytest.Config):
        self.config = config

    @pytest.hookimpl(trylast=True)
    def pytest_collection_modifyitems(self, config: pytest.Config, items: list[pytest.Item]) -> None:
        _collapse_unavailable(config, items)


_LABELLED = pytest.StashKey[bool]()


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call):
    """Properties every report of a lockstep test carries (and JUnit XML as <properties>): engine,
    the op a node case is about, the test's expectation key, its lockstep markers, its contract."""
    if call.when == "setup" and not item.stash.get(_LABELLED, False):
        item.stash[_LABELLED] = True
        props = []
        params = getattr(getattr(item, "callspec", None), "params", {})
        if not any(k == "engine" for k, _ in item.user_properties):
            props.append(("engine", params.get("engine_name") or "-"))
        markers = sorted({mk.name for mk in item.iter_markers()} & _MARKER_NAMES)
        if markers:
            props.append(("markers", ",".join(markers)))
        case = params.get("case")
        if case is not None and hasattr(case, "model"):
            props.append(("ops", sorted(_op_types(case.model))))
            props.append(("op", case_op(case)))
        if params.get("engine_name"):
            props.append(("key", expectations.test_key(item, params["engine_name"])))
        item.user_properties.extend(props)
    report = yield
    if call.when == "setup":
        report.user_properties = list(item.user_properties)
    _fail_closed(item, report)
    return report


UNSUPPORTED = "unsupported: "
# lockstep's own markers, by name (its and the reference runtime's plugins')
_MARKER_NAMES = frozenset(m.split("(")[0].split(":")[0] for m in MARKERS) | {
    "contract", "gpu", "parity", "capture_guard", "paging"}


def _skip_reason(report) -> str:
    msg = report.longrepr[2] if isinstance(report.longrepr, tuple) else str(report.longrepr)
    return msg.removeprefix("Skipped: ")


def _fail_closed(item: pytest.Item, report) -> None:
    """An engine test that newly cannot run (an ``unsupported:`` skip no entry expects) fails;
    one an entry expects unsupported that ran is recorded as newly running."""
    params = getattr(getattr(item, "callspec", None), "params", {})
    engine = params.get("engine_name")
    if engine is None or report.when not in ("setup", "call"):
        return
    expected = _state(item.config).expected_unsupported.get(item.nodeid)
    if report.skipped and not hasattr(report, "wasxfail"):
        why = _skip_reason(report)
        if why.startswith(UNSUPPORTED) and expected is None:
            key = expectations.test_key(item, engine)
            detail = why[len(UNSUPPORTED):].removeprefix(f"{engine}: ")
            report.outcome = "failed"
            report.longrepr = (
                f"lockstep: {engine} newly cannot run {key}: {detail}\n"
                f"  (fail closed: a case an engine cannot run must be expected, kind = \"unsupported\" in its "
                f"expectations; the summary \"engine tests that newly cannot run\" gives the command that records "
                f"them)")
            report.user_properties.append(("newly_unsupported", key))
    elif report.when == "call" and report.passed and expected is not None:
        report.user_properties.append(("newly_runs", expectations.test_key(item, engine)))


_CASES: dict = {}


def case_op(case) -> str:
    """The operator a node case is about: its one node's op, the op of its unexpanded twin
    (``test_x_expanded`` -> ``test_x``), else the node whose op type is named in the case."""
    return _case_op(case.name, case.model)


@functools.lru_cache(maxsize=4096)  # each case is reported once per engine: its model parsed once
def _case_op(name: str, model: bytes) -> str:
    import onnx

    from lockstep.reference_runtime.node_cases import load_cases

    m = onnx.load_from_string(model)
    if len(m.graph.node) == 1:
        return m.graph.node[0].op_type
    base = name.split("_expanded")[0]
    if base != name:
        global _CASES
        _CASES = _CASES or {c.name: c for c in load_cases()}
        if base in _CASES:
            return case_op(_CASES[base])
    flat = name.replace("_", "").lower()
    named = [n.op_type for n in m.graph.node if n.op_type.lower() in flat]
    return max(named, key=len) if named else (m.graph.node[0].op_type if m.graph.node else "?")


@functools.lru_cache(maxsize=4096)  # a case's model is one bytes object, reported once per engine
def _op_types(model_bytes: bytes) -> frozenset[str]:
    import onnx

    m = onnx.load_from_string(model_bytes)
    return frozenset({n.op_type for n in m.graph.node} | {n.op_type for f in m.functions for n in f.node})


class _OutcomeRecorder:
    """Aggregates outcomes and device skips where reports arrive (the controller under xdist)."""

    def __init__(self, config: pytest.Config):
        self.config = config

    def pytest_runtest_logreport(self, report: pytest.TestReport) -> None:
        st = _state(self.config)
        props = dict(report.user_properties)
        entry = st.outcomes.setdefault(
            report.nodeid, {"outcome": "passed", "contract": props.get("contract"), "engine": props.get("engine"),
                            "ops": props.get("ops", [])}
        )
        for key in ("op", "key", "precision", "stands_for"):
            if key in props:
                entry[key] = props[key]
        if report.when == "call":  # properties recorded by the test arrive with every later report too
            for key in ("tripwire", "golden"):
                if key in props and key not in entry:
                    entry[key] = json.loads(props[key])
                    if key == "tripwire":
                        st.tripwires.append(entry[key])
            for key in ("newly_runs", "newly_unsupported"):
                if key in props:
                    entry[key] = props[key]
                    getattr(st, key).append((entry.get("engine"), props[key]))
        if report.failed:
            if entry["outcome"] != "failed":
                entry["message"] = _first_line(report)
            entry["outcome"] = "failed"
        elif hasattr(report, "wasxfail"):
            entry["outcome"] = "xfailed"
        elif report.skipped and entry["outcome"] == "passed":
            entry["outcome"] = "skipped"
            msg = _skip_reason(report)
            entry["reason"] = msg
            if UNAVAILABLE in msg:
                name, reason = msg.split(UNAVAILABLE, 1)[1].split(": ", 1)
                st.skipped[(name, reason)] += int(props.get("stands_for", 1))


def _first_line(report) -> str:
    """The first line that says what failed: the assertion's message, or the exception."""
    crash = getattr(getattr(report, "longrepr", None), "reprcrash", None)
    text = crash.message if crash is not None else str(report.longrepr)
    for line in text.splitlines():
        line = line.strip()
        if line and not line.startswith(("assert ", "+", "where")):
            return line[:300]
    return text.strip()[:300]


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    st = _state(session.config)
    st.exitstatus = int(exitstatus)
    if getattr(session.config, "workerinput", None) is not None:
        return  # a pytest-xdist worker: the controller, which receives every report, writes the reports
    path = session.config.getoption("--lockstep-report")
    if path:
        with open(path, "w") as f:
            json.dump(st.outcomes, f, indent=1)
    report_dir = session.config.getoption("--lockstep-report-dir")
    if report_dir:
        from lockstep.conformance.report import write_report

        engines = selection.of(session.config).loaded_engines()
        described = {}
        for name, eng in engines.items():
            describe = getattr(eng, "describe", None)
            described[name] = {"precision": dict(getattr(eng, "precision", None) or {}),
                               **(describe() if callable(describe) else {})}
        st.report_paths = write_report(st.outcomes, report_dir, described)


def pytest_terminal_summary(terminalreporter, config: pytest.Config) -> None:
    from lockstep.conformance.plugin_summary import terminal_summary

    terminal_summary(terminalreporter, config, _state(config))
