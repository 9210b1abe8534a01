"""Parity scenarios are registered by a decorator and validated when parity.py is imported."""

from __future__ import annotations

import pytest

from lockstep.contracts import parity


def test_a_second_scenario_of_one_name_is_refused_at_registration(monkeypatch):
    monkeypatch.setattr(parity, "_REGISTERED", dict(parity._REGISTERED))

    def scenario_capture_d2h(dev, rec):
        pass

    with pytest.raises(ValueError, match="'capture_d2h' is registered twice"):
        parity.scenario(scenario_capture_d2h)

    def not_named_so(dev, rec):
        pass

    with pytest.raises(ValueError, match="must be scenario_<name>"):
        parity.scenario(not_named_so)


def test_a_scenario_without_its_expected_steps_fails_the_import_check(monkeypatch):
    monkeypatch.setattr(parity, "SCENARIOS", {**parity.SCENARIOS, "new_one": lambda dev, rec: None})
    with pytest.raises(ValueError, match="scenario 'new_one' has no EXPECTED entry; scenario 'new_one' has no ROW"):
        parity._check_registered()
    monkeypatch.setattr(parity, "SCENARIOS", dict(parity.SCENARIOS))
    parity.SCENARIOS.pop("new_one")
    monkeypatch.setitem(parity.EXPECTED, "gone", [])
    with pytest.raises(ValueError, match=r"EXPECTED names \['gone'\], which are not scenarios"):
        parity._check_registered()
