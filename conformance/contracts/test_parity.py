"""Fidelity of the simulated device: the parity scenarios of ``contracts.parity``.

On every device the observations must equal the expected ones written from cuda-semantics.md and
the runtime contracts; since the simulated device runs in CI and the CUDA device on the H200, the
two are then equal to each other. On a GPU, scenarios that poison the context run in a child
process.
"""

from __future__ import annotations

import pytest

from contracts.parity import EXPECTED, ROW, SCENARIOS, run_scenario


@pytest.mark.parity
@pytest.mark.parametrize("scenario", sorted(SCENARIOS))
def test_scenario_outcomes(device_available, scenario):
    got = run_scenario(scenario, device_available)
    expected = EXPECTED[scenario]
    assert got == expected, f"{device_available} diverges on '{ROW[scenario]}'"


def test_every_scenario_has_expectations():
    assert set(SCENARIOS) == set(EXPECTED) == set(ROW)
