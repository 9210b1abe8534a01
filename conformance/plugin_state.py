"""What lockstep's pytest plugin keeps for one run (``config.stash``), typed: one field per fact,
each written by one job of the plugin (configuration, engine loading, expectations, outcomes) and
read by the others and by the terminal summary (``plugin_summary``)."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import Any

import pytest


# the suite's markers (registered by pytest_plugin; the outcome labels name them and the runtime plugin's)
MARKERS = (
    "node_suite: ONNX backend node cases per engine",
    "golden: golden token locks",
    "golden_kinds(*kinds): parametrize golden_model over models of these kinds only (builtin, trained, export, user)",
    "capture: CUDA graph capture checks",
    "fuzz: the fuzzer (lockstep.conformance.fuzz): mutated models, feeds and command lines; --fuzz-cases, --fuzz-seed",
)


@dataclass
class SuiteState:
    # configuration (pytest_configure); the selected engines are lockstep.engines.selection's
    shard: tuple[int, int] | None        # --lockstep-shard (index, count)
    suite: bool = False                  # the run collects one of lockstep's own suites
    progress: str = "auto"               # --lockstep-progress, else $LOCKSTEP_PROGRESS (plugin_progress)
    # loaded on first need
    golden: list | None = None           # the golden models (catalog, --golden-dir)
    expect: list | None = None           # the expectation entries that apply here
    # collection
    stale_checked: bool = False
    expected_unsupported: dict[str, Any] = field(default_factory=dict)  # nodeid -> its entry
    # outcomes (where reports arrive: the controller under xdist)
    outcomes: dict[str, dict] = field(default_factory=dict)
    skipped: Counter = field(default_factory=Counter)   # (engine or device, reason) -> tests
    tripwires: list = field(default_factory=list)
    newly_runs: list = field(default_factory=list)          # (engine, key)
    newly_unsupported: list = field(default_factory=list)   # (engine, key)
    report_paths: Any = None


STATE = pytest.StashKey[SuiteState]()


def state(config: pytest.Config) -> SuiteState:
    return config.stash[STATE]


def golden_models(config: pytest.Config) -> list:
    """The golden models of this run (built-in, trained, exports, ``--golden-dir``), listed once; a
    bad ``--golden-dir`` is a usage error. (The catalog loads onnx: imported when first needed.)"""
    st = state(config)
    if st.golden is None:
        from lockstep.golden.catalog import GoldenError, catalog

        try:
            st.golden = catalog(config.getoption("--golden-dir"))
        except GoldenError as exc:
            raise pytest.UsageError(str(exc)) from None
    return st.golden
