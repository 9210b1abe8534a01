"""Unit tests of the command line, the mutant catalogue and runner, and the contract-marker hygiene."""

from __future__ import annotations

import inspect
import io

import pytest
from lockstep.contracts.mutant_runner import run_mutants
from lockstep.contracts.mutants import MUTANTS, runtime_class
from lockstep.contracts.parity import SCENARIOS
from lockstep.reference_runtime.runtime import Runtime

from lockstep.cli import main




def test_cli_parity_on_sim_matches(capsys):
    assert main(["parity", "--device", "sim"]) == 0
    out = capsys.readouterr().out
    n = len(SCENARIOS)
    assert f"{n}/{n} scenarios match on sim" in out and "DIFF" not in out


def test_cli_parity_single_scenario(capsys):
    assert main(["parity", "--device", "sim", "--scenario", "rt_slots"]) == 0
    assert "1/1 scenarios match on sim" in capsys.readouterr().out


def test_cli_parity_unknown_scenario_is_a_usage_error(capsys):
    assert main(["parity", "--scenario", "nope"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("lockstep: error: --scenario: unknown scenario(s) ['nope']") and err.count("\n") == 1


def test_cli_needs_a_command(capsys):
    with pytest.raises(SystemExit) as exc:
        main([])
    assert exc.value.code == 2


def test_runtime_class_lookup():
    assert runtime_class(None) is Runtime and runtime_class("") is Runtime
    assert runtime_class("free_without_wait") is MUTANTS["free_without_wait"]
    with pytest.raises(ValueError, match="unknown mutant 'nope'; known: \\['close_without_drain'"):
        runtime_class("nope")


@pytest.mark.parametrize("name", sorted(MUTANTS))
def test_each_mutant_is_a_documented_runtime_override(name):
    cls = MUTANTS[name]
    assert issubclass(cls, Runtime) and cls is not Runtime
    assert (cls.__doc__ or "").strip() and cls.__doc__ != Runtime.__doc__
    overridden = [k for k, v in vars(cls).items()
                  if not k.startswith("__") and hasattr(Runtime, k) and v is not inspect.getattr_static(Runtime, k)]
    if "__init__" in vars(cls):
        overridden.append("__init__")
    assert overridden, f"{name} overrides nothing of Runtime"


def test_run_mutants_kills_every_mutant():
    out = io.StringIO()
    assert run_mutants("sim", out=out) == 0, out.getvalue()
    text = out.getvalue()
    n = len(MUTANTS)  # 12 today
    assert f"PASS: {n}/{n} mutants killed" in text and "SURVIVED" not in text and "KILLS NONE" not in text


def test_run_mutants_rejects_unknown_names(capsys):
    assert run_mutants("sim", ["nope"], out=io.StringIO()) == 2
    assert "unknown mutant(s) ['nope']" in capsys.readouterr().err


WELL_FORMED = '''
import pytest

@pytest.mark.contract("well-formed")
def test_ok():
    """States its guarantee."""
'''


@pytest.fixture
def run_isolated(pytester):
    """Run pytest in pytester's directory: lockstep's plugin comes from its pytest11 entry point, as in
    any repository where the package is installed (hypothesis's plugin is slow to load there)."""
    def run(**files):
        pytester.makepyfile(**files)
        return pytester.runpytest("-p", "no:cacheprovider", "-p", "no:hypothesispytest")

    return run


def test_well_formed_contract_test_runs(run_isolated):
    result = run_isolated(test_good=WELL_FORMED)
    assert result.ret == pytest.ExitCode.OK
    result.assert_outcomes(passed=1)


NO_NAME = "@pytest.mark.contract needs exactly one name, got "
NO_DOC = "a contract test needs a docstring stating its guarantee"


@pytest.mark.parametrize("source, problems", [
    ("@pytest.mark.contract()\ndef test_bad():\n    pass\n", [NO_NAME + "()", NO_DOC]),
    ("@pytest.mark.contract('a', 'b')\ndef test_bad():\n    'Doc.'\n", [NO_NAME + "('a', 'b')"]),
    ("@pytest.mark.contract('named')\ndef test_bad():\n    pass\n", [NO_DOC]),
], ids=["no-name-no-docstring", "two-names", "no-docstring"])
def test_malformed_contract_test_is_a_usage_error(run_isolated, source, problems):
    result = run_isolated(test_bad="import pytest\n\n" + source)
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines(["*contract tests malformed:*"])
    for problem in problems:
        assert f"test_bad.py::test_bad: {problem}" in result.stderr.str()
    result.assert_outcomes()  # nothing ran
