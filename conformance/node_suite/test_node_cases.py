"""ONNX's backend node cases, on every engine: ``pytest conformance/ -m node_suite``.

A case an engine cannot run (an operator it lacks, an IR version or opset newer than it accepts,
sequence values) is a skip whose reason starts with ``unsupported:``, counted per engine in the
terminal summary and the report; a case it runs must match ONNX's expected outputs the way ONNX's
runner compares them. Known failures are listed in ``expectations.toml`` (strict xfails, each with
its reason). A case whose graph holds a random op (Bernoulli, RandomUniform(Like), RandomNormal(Like),
Multinomial) is judged by its distribution instead (``random_cases.judge``: shape, dtype, support,
seeded reproducibility, moments over many draws), never by ONNX's one stored draw.
``--lockstep-cases-dir DIR`` (``lockstep check --cases-dir DIR``) adds the node cases of a folder in
the same format (a user's own, or those ``lockstep locate --reduce`` writes), their ids
``DIR-NAME/CASE``, under the same expectations. A failing case names the command that locates
its first divergent node.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
from lockstep.reference_runtime.node_cases import load_case_dirs, load_cases, locate_command, run_case

from lockstep.conformance.node_suite.random_cases import has_random_op, judge
from lockstep.engines import unsupported_reason
from lockstep.engines.refusal import EngineError
from lockstep.engines.registry import spec_of

CASES = load_cases()
_FOLDER: dict[str, tuple[str, str]] = {}  # a folder case's id -> (its folder, its name there)


def node_cases(config) -> list:
    """ONNX's cases and those of ``--lockstep-cases-dir``: the plugin parametrizes ``case`` with them
    after the engines (a test id is ``ENGINE-CASE``)."""
    dirs = []
    for d in config.getoption("lockstep_cases_dir") or []:
        for c in load_case_dirs(d):
            named = dataclasses.replace(c, name=f"{Path(d).name}/{c.name}")
            _FOLDER[named.name] = (d, c.name)
            dirs.append(named)
    return CASES + dirs


@pytest.mark.node_suite
def test_node_case(engine, case):
    where, name = _FOLDER.get(case.name, (None, case.name))
    outcome = judge(engine, case) if has_random_op(case) else run_case(engine, case)
    if outcome.status == "unsupported":
        pytest.skip(unsupported_reason(engine.name, outcome.detail[:300]))
    locate = f"locate it: {locate_command(name, spec_of(engine), where)}"
    if outcome.status == "error":  # the engine raised: an error, counted apart from wrong values
        raise EngineError(f"{engine.name} error: {outcome.detail}\n{locate}")
    assert outcome.status == "passed", f"{engine.name} {outcome.status}: {outcome.detail}\n{locate}"
