"""ONNX's backend node cases, on every engine: ``pytest conformance/ -m node_suite``.

A case an engine cannot run (an operator it lacks, an IR version or opset newer than it accepts,
sequence values) is a skip whose reason starts with ``unsupported:``, counted per engine in the
terminal summary and the report; a case it runs must match ONNX's expected outputs the way ONNX's
runner compares them. Known failures are listed in ``expectations.toml`` (strict xfails, each with
its reason).
"""

from __future__ import annotations

import pytest
from lockstep.reference_runtime.node_cases import load_cases, run_case

from lockstep.engines import unsupported_reason

CASES = load_cases()


@pytest.mark.node_suite
@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_node_case(engine, case):
    outcome = run_case(engine, case)
    if outcome.status == "unsupported":
        pytest.skip(unsupported_reason(engine.name, outcome.detail[:300]))
    assert outcome.status == "passed", f"{engine.name} {outcome.status}: {outcome.detail}"
