"""Fidelity of the simulated device: the parity scenarios of ``contracts.parity``.

On every device the observations must equal the expected ones written from docs/cuda-semantics.md and
the runtime contracts; since the simulated device runs in CI and the CUDA device on the H200, the
two are then equal to each other. On a GPU, scenarios that poison the context run in a child
process.
"""

from __future__ import annotations

import pytest
from lockstep.contracts.parity import DIVERGENCES, EXPECTED, ROW, SCENARIOS, accepted, run_scenario


@pytest.mark.parity
@pytest.mark.parametrize("scenario", sorted(SCENARIOS))
def test_scenario_outcomes(device_available, scenario):
    got = run_scenario(scenario, device_available)
    ok = accepted(scenario, device_available)
    if len(ok) == 1:
        assert got == ok[0], f"{device_available} diverges on '{ROW[scenario]}'"
    else:  # undefined behaviour the device was seen to resolve either way (DIVERGENCES' or_expected)
        assert got in ok, f"{device_available} diverges on '{ROW[scenario]}': {got} is none of {ok}"


def test_every_scenario_has_expectations():
    assert set(SCENARIOS) == set(EXPECTED) == set(ROW)
    for name, d in DIVERGENCES.items():
        assert name in SCENARIOS and d.get("why"), f"divergence {name!r} needs a scenario and a reason"
