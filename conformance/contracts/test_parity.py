"""Fidelity of the simulated device: the parity scenarios of ``contracts.parity``.

On every device the observations must equal the expected ones written from cuda-semantics.md and
the runtime contracts; since the simulated device runs in CI and the CUDA device on the H200, the
two are then equal to each other. On a GPU, scenarios that poison the context run in a child
process.
"""

from __future__ import annotations

import pytest
from lockstep.contracts.parity import DIVERGENCES, EXPECTED, ROW, SCENARIOS, expected_for, run_scenario


@pytest.mark.parity
@pytest.mark.parametrize("scenario", sorted(SCENARIOS))
def test_scenario_outcomes(device_available, scenario):
    got = run_scenario(scenario, device_available)
    expected = expected_for(scenario, device_available)
    assert got == expected, f"{device_available} diverges on '{ROW[scenario]}'"


def test_every_scenario_has_expectations():
    assert set(SCENARIOS) == set(EXPECTED) == set(ROW)
    for name, d in DIVERGENCES.items():
        assert name in SCENARIOS and d.get("why"), f"divergence {name!r} needs a scenario and a reason"
