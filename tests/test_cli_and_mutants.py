"""Unit tests of the command line, the mutant catalogue and runner, and the contract-marker hygiene."""

from __future__ import annotations

import inspect
import io

import numpy as np
import onnx

import pytest
from lockstep.contracts.mutant_runner import run_mutants
from lockstep.contracts.mutants import MUTANTS, runtime_class
from lockstep.contracts.parity import SCENARIOS
from lockstep.reference_runtime.runtime import Runtime

from lockstep.conformance.cli import main


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
    with pytest.raises(ValueError, match="unknown mutant 'nope'; known: \\['capture_executes', 'close_without_drain'"):
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
    n = len(MUTANTS)  # 13 today
    assert f"PASS: {n}/{n} mutants killed" in text and "SURVIVED" not in text and "KILLS NONE" not in text
    assert "OTHERS ONLY" not in text and "NO MUTANT" not in text, "contract: each test killed by its own guarantee's mutant"
    assert all(getattr(cls, "breaks", ()) for cls in MUTANTS.values()), "contract: every mutant names what it breaks"


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


# -- bad files and bad arguments (issue 15): one line, no Traceback, a non-zero exit ----------------

def _bad_model_files(folder):
    """Files a user may hand ``lockstep decode``: truncated, random, text, and models that crashed
    or exhausted onnx's shape inference."""
    import os

    from lockstep.golden.catalog import builtin_models
    from onnx import TensorProto as T
    from onnx import helper

    vi = helper.make_tensor_value_info
    good = next(m for m in builtin_models() if m.name == "tiny-fp32-standard").model_path().read_bytes()
    files = {"truncated.onnx": good[: len(good) // 3], "random.onnx": os.urandom(4096),
             "text.onnx": b"this is not a model\n"}

    def model(nodes, ins, outs, **kw):
        g = helper.make_graph(nodes, "g", ins, outs, **kw)
        return helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)]).SerializeToString()

    files["gathernd-batch-dims.onnx"] = model(
        [helper.make_node("GatherND", ["x", "i"], ["y"], batch_dims=-5)],
        [vi("x", T.FLOAT, [2, 3, 4]), vi("i", T.INT64, [2, 1])], [vi("y", T.FLOAT, ["a", "b"])])
    files["layernorm-axis.onnx"] = model(
        [helper.make_node("LayerNormalization", ["x", "s"], ["y", "m", "v"], axis=2**31)],
        [vi("x", T.FLOAT, [2, 3, 4]), vi("s", T.FLOAT, [4])], [vi(n, T.FLOAT, ["a"]) for n in "ymv"])
    files["huge-value-info.onnx"] = model(
        [helper.make_node("Shape", ["x"], ["s"]), helper.make_node("Add", ["s", "s"], ["y"])],
        [vi("x", T.FLOAT, ["a"])], [vi("y", T.INT64, ["n"])], value_info=[vi("s", T.INT64, [10**9])])
    for name, data in files.items():
        (folder / name).write_bytes(data)
    return sorted(files)


def _lockstep(*argv, cwd):
    """The real command in a child process (a crash would be a negative status, not a Python error),
    under a memory ceiling (the huge-dim model once grew past 24 GB)."""
    import resource
    import subprocess
    import sys

    def limit():
        resource.setrlimit(resource.RLIMIT_AS, (6 << 30, 6 << 30))

    return subprocess.run([sys.executable, "-m", "lockstep", *argv], check=False, cwd=cwd, capture_output=True, text=True,
                          errors="replace", timeout=120, preexec_fn=limit)


def _one_line_error(proc, *needles):
    assert proc.returncode == 2, (proc.returncode, proc.stderr)
    assert "Traceback" not in proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("lockstep: error: "), proc.stderr
    for needle in needles:
        assert needle in lines[0], lines[0]


@pytest.mark.parametrize("engine", ["ref-sim", "ort-cpu"])
def test_decode_of_bad_model_files_is_one_line_naming_the_file(tmp_path, engine):
    from lockstep.engines.registry import load_engine

    ok, why = load_engine(engine).available()
    if not ok:
        pytest.skip(f"{engine} unavailable here: {why}")
    reasons = {"truncated.onnx": "not a valid ONNX protobuf", "random.onnx": "not a valid ONNX protobuf",
               "text.onnx": "not a valid ONNX protobuf",
               "gathernd-batch-dims.onnx": "attribute 'batch_dims' is -5",
               "layernorm-axis.onnx": "attribute 'axis' is 2147483648",
               "huge-value-info.onnx": "not a decoder lockstep can drive"}  # loaded fine: the dim is dropped
    for name in _bad_model_files(tmp_path):
        proc = _lockstep("decode", name, "--prompt", "hi", "--tokens", "2", "--engine", engine, cwd=tmp_path)
        _one_line_error(proc, name, reasons[name])


def test_decode_with_a_prompt_that_is_not_utf8_is_one_line(tmp_path):
    proc = _lockstep("decode", "tiny-fp32-standard", "--prompt", "caf\udce9", "--tokens", "2", cwd=tmp_path)
    _one_line_error(proc, "--prompt: not valid UTF-8 text")


def test_audit_of_a_file_that_is_not_utf8_is_one_line_naming_it(tmp_path):
    (tmp_path / "latin1.py").write_bytes(b"# caf\xe9\nx = 1\n")
    proc = _lockstep("audit", "latin1.py", cwd=tmp_path)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr
    assert proc.stderr.strip() == "lockstep audit: error: latin1.py: cannot read: not UTF-8 text (byte 0xe9 at offset 5)"


def test_decode_with_a_model_card_that_is_not_utf8_is_one_line(tmp_path):
    from lockstep.golden.catalog import builtin_models

    good = next(m for m in builtin_models() if m.name == "tiny-fp32-standard").model_path()
    (tmp_path / "m.onnx").write_bytes(good.read_bytes())
    (tmp_path / "m.lockstep.toml").write_bytes(b'[io]\ninput_ids = "\xff"\n')
    proc = _lockstep("decode", "m.onnx", "--prompt", "hi", "--tokens", "2", cwd=tmp_path)
    _one_line_error(proc, "m.onnx: model card m.lockstep.toml: 'utf-8' codec can't decode byte 0xff")


def test_decode_past_the_device_memory_budget_is_one_line(tmp_path, monkeypatch):
    """A device refusal (MemoryAllocation) reaching the CLI is its one line, not a traceback (found
    trying the budget as a user would: LOCKSTEP_DEVICE_MEMORY_LIMIT=1K)."""
    monkeypatch.setenv("LOCKSTEP_DEVICE_MEMORY_LIMIT", "1K")
    proc = _lockstep("decode", "tiny-fp32-standard", "--prompt", "hi", "--tokens", "2", "--engine", "ref-sim",
                     cwd=tmp_path)
    _one_line_error(proc, "tiny-fp32-standard.onnx on ref-sim: MemoryAllocation:", "device memory budget 1024 bytes")


def test_a_named_error_from_any_command_is_one_line(monkeypatch, capsys):
    """The CLI's last resort: lockstep's named errors from any command print one line naming their
    class; anything else (a bug) keeps its traceback."""
    from lockstep.conformance import cli
    from lockstep.reference_runtime.errors import DeviceAssert

    def boom(args):
        raise DeviceAssert("node 'g' flagged an index out of range")

    monkeypatch.setattr(cli, "_parity", boom)
    assert cli.main(["parity"]) == 2
    assert capsys.readouterr().err == "lockstep: error: DeviceAssert: cudaErrorAssert: node 'g' flagged an index out of range\n"

    def bug(args):
        raise KeyError("a bug")

    monkeypatch.setattr(cli, "_parity", bug)
    with pytest.raises(KeyError):
        cli.main(["parity"])


def test_cli_mutants_layers_usage_errors(capsys, tmp_path):
    """Contract: bad --layer/--mutant/--json values are one usage line, exit 2."""
    assert main(["mutants", "--layer", "nope"]) == 2
    assert "unknown layer(s) ['nope']" in capsys.readouterr().err
    assert main(["mutants", "--mutant", "sim.nope"]) == 2
    assert "unknown mutant(s) ['sim.nope']" in capsys.readouterr().err
    assert main(["mutants", "--layer", "sim", "--json", str(tmp_path / "missing" / "x.json")]) == 2
    assert "does not exist" in capsys.readouterr().err


def test_cli_mutants_list_names_every_layer(capsys):
    """Contract: --list names each mutant with the guarantee it breaks, the runtime's included."""
    from lockstep.contracts.layers import catalogue

    assert main(["mutants", "--list"]) == 0
    text = capsys.readouterr().out
    assert all(f"runtime.{n} " in text for n in MUTANTS)
    assert all(f"{k}" in text for k in catalogue())


def test_cli_mutants_one_source_mutant(capsys, tmp_path):
    """Result: a named source mutant runs against its tests and is killed; --json records it."""
    out = tmp_path / "m.json"
    assert main(["mutants", "--mutant", "sim.race_read_read_conflicts", "--json", str(out)]) == 0
    import json

    data = json.loads(out.read_text())
    assert [m["status"] for m in data["mutants"]] == ["killed"] and data["scores"]["sim"]["killed"] == 1


# the tools that parse their own arguments (_OWN_PARSER): `lockstep NAME ARGS...` runs the module's main(ARGS)


def test_cli_cases_runs_node_cases_and_prints_the_outcome(capsys):
    assert main(["cases", "--engine", "ref-sim", "--match", "test_abs"]) == 0
    assert capsys.readouterr().out.strip() == "passed=1", "result: test_abs passes on ref-sim, the summary printed"


def test_cli_cases_emits_expectations_through_to_the_module(capsys):
    # the rest of the command line reaches node_cases.main unchanged: --emit-expectations changes the output
    assert main(["cases", "--engine", "ref-sim", "--match", "test_abs", "--emit-expectations"]) == 0
    assert capsys.readouterr().out.strip() == "# passed=1"


def test_cli_cases_fails_on_a_failing_case_and_locates_a_root_case_folder(tmp_path, capsys):
    """contract (issue 54): `lockstep cases` exits 1 when a case fails (0 only with
    --emit-expectations), and the locate command it prints names the case folder itself when
    --cases-dir is that folder (it printed cases/X/X, which `lockstep locate` refused)."""
    from onnx import TensorProto, helper, numpy_helper

    case = tmp_path / "abs_case"
    (case / "test_data_set_0").mkdir(parents=True)
    g = helper.make_graph([helper.make_node("Abs", ["x"], ["y"])], "g",
                          [helper.make_tensor_value_info("x", TensorProto.FLOAT, [3])],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, [3])])
    onnx.save(helper.make_model(g, opset_imports=[helper.make_opsetid("", 13)]), str(case / "model.onnx"))
    x = np.array([-1.0, 2.0, -3.0], np.float32)
    (case / "test_data_set_0" / "input_0.pb").write_bytes(numpy_helper.from_array(x, "x").SerializeToString())
    wrong = np.array([1.0, 2.0, 30.0], np.float32)  # the recorded output is wrong: the case fails on a right engine
    (case / "test_data_set_0" / "output_0.pb").write_bytes(numpy_helper.from_array(wrong, "y").SerializeToString())
    assert main(["cases", "--engine", "ref-sim", "--cases-dir", str(case)]) == 1
    out = capsys.readouterr().out
    assert f"locate it: lockstep locate {case} --engine ref-sim" in out and "failed=1" in out, out
    assert main(["cases", "--engine", "ref-sim", "--cases-dir", str(case), "--emit-expectations"]) == 0


def test_cli_cases_unknown_engine_is_one_line(capsys):
    assert main(["cases", "--engine", "nope", "--match", "test_abs"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("lockstep cases: error: ") and "nope" in err and err.count("\n") == 1, err


def test_cli_expectations_from_a_report(tmp_path, capsys):
    import json

    def case(key, op, outcome, o):
        return f"t.py::test_node_case[myengine-{key}]", {"engine": "myengine", "key": key, "op": op,
                                                          "outcome": outcome, **o}

    rep = tmp_path / "report.json"
    rep.write_text(json.dumps({"tests": dict([
        case("test_acos", "Acos", "failed", {"message": "lockstep: myengine newly cannot run test_acos: no kernel "
                                                        "for Acos", "newly_unsupported": "test_acos"}),
        case("test_abs", "Abs", "skipped", {"reason": "unsupported: myengine: no kernel for Abs"}),
        case("test_add", "Add", "passed", {})])}))
    # the rest of the command line reaches expectations.main unchanged: --new and --engine-field both count
    assert main(["expectations", "--from-report", str(rep), "--engine", "myengine", "--new", "--engine-field"]) == 0
    out = capsys.readouterr().out
    assert '"test_acos"' in out and '"test_abs"' not in out and 'engine = "myengine"' in out, out
    assert main(["expectations", "--from-report", str(rep), "--engine", "nope"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("lockstep expectations: error: --engine nope: not in") and err.count("\n") == 1, err


@pytest.mark.parametrize("argv", [["--bogus"], ["--from-report"], []])
def test_cli_expectations_with_a_bad_argument_is_one_usage_line(capsys, argv):
    assert main(["expectations", *argv]) == 2
    err = capsys.readouterr().err
    assert err.startswith("lockstep expectations: error: ") and err.count("\n") == 1, err


def test_cli_expectations_through_the_real_command(tmp_path):
    proc = _lockstep("expectations", "--from-report", "absent.json", "--engine", "x", cwd=tmp_path)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr
    assert proc.stderr.startswith("lockstep expectations: error: absent.json: ") and proc.stderr.count("\n") == 1


@pytest.mark.parametrize("name", ["fuzz", "capture-guard", "cases", "expectations", "audit"])
def test_cli_own_parser_help_exits_0_and_names_the_command(capsys, name):
    assert main([name, "--help"]) == 0
    assert capsys.readouterr().out.startswith(f"usage: lockstep {name} ")


def test_cli_help_lists_the_tools(capsys):
    with pytest.raises(SystemExit) as exc:
        main(["--help"])
    assert exc.value.code == 0
    out = capsys.readouterr().out
    for name in ("expectations", "cases", "capture-guard", "fuzz", "audit"):
        assert f"\n    {name} " in out, (name, out)


def test_cli_capture_guard_runs_the_pass(capsys):
    assert main(["capture-guard", "--match", "test_add_bcast"]) == 0
    assert "passed=1" in capsys.readouterr().out
    assert main(["capture-guard", "--match", "no_such_case*"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("lockstep capture-guard: error: ") and err.count("\n") == 1, err


def test_cli_fuzz_usage_errors_are_one_line(capsys, tmp_path):
    assert main(["fuzz", "--cases", "0"]) == 2
    assert capsys.readouterr().err.startswith("lockstep fuzz: error: --cases >= 1")
    assert main(["fuzz", "--replay", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert err == f"lockstep fuzz: error: --replay {tmp_path}: no case.json there\n", err


def test_fuzz_reproducer_command_is_the_cli():
    from pathlib import Path

    from lockstep.conformance.fuzz.report import replay_command

    assert " -m lockstep fuzz --replay " in replay_command(Path("repro/x"))


def test_cli_check_without_pytest_is_one_line(capsys, monkeypatch, tmp_path):
    """Contract: `lockstep check` on an install without the test extra (no pytest) is a one-line usage
    error naming the extra, not a traceback."""
    import sys

    monkeypatch.setitem(sys.modules, "pytest", None)  # `import pytest` raises ImportError
    assert main(["check", "--report-dir", str(tmp_path / "r")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "pip install 'lockstep-conformance[test]'" in err, err
