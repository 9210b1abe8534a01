"""The expectation writers and their files (``conformance/expectations.py``,
``lockstep cases --emit-expectations``): reasons grouped by the
operator a case is about, entries an engine's own file takes (and its variants sharing it), only the
newly unsupported for appending, and variant factories of one plugin sharing one file in a run."""

from __future__ import annotations

import json

import pytest

from lockstep.conformance import expectations
from lockstep.conformance.expectations import emit, reason_class, rows_from_report

ORT_ABS = ("[ONNXRuntimeError] : 9 : NOT_IMPLEMENTED : Could not find an implementation for Abs(13) node with name "
           "'n0'")
ORT_RESIZE = ("[ONNXRuntimeError] : 9 : NOT_IMPLEMENTED : Could not find an implementation for Resize(19) node with "
              "name 'resize_7'")
ORT_INVALID = ("[ONNXRuntimeError] : 10 : INVALID_GRAPH : This is an invalid model. In Node, ('', Foo, '', -1) : "
               "('X': tensor(float),) -> ('Y': tensor(float),) , Error Unrecognized attribute: bar")


def test_onnx_runtime_reasons_group_by_the_operator_not_its_status_prefix():
    """The issue's case: every ONNX Runtime message split at its first ': ' was `[ONNXRuntimeError] `."""
    assert reason_class(ORT_ABS, op="Abs") == "NOT_IMPLEMENTED: Could not find an implementation for Abs(13)"
    assert reason_class(ORT_RESIZE, op="Resize") == "NOT_IMPLEMENTED: Could not find an implementation for Resize(19)"
    assert reason_class(ORT_INVALID, op="Foo") == "Foo: INVALID_GRAPH: This is an invalid model. In Node"
    ir = ("ort-cpu: model IR version newer than this engine accepts: [ONNXRuntimeError] : 1 : FAIL : /onnxruntime_src/"
          "onnxruntime/core/graph/model.cc:256 onnxruntime::Model::Model(onnx::ModelProto&&, const onnxruntime::"
          "PathString&) Unsupported model IR version: 11, max supported IR version: 10")
    assert reason_class(ir, ["ort-cpu"], "OptionalHasElement") == (
        "OptionalHasElement: model IR version newer than this engine accepts: FAIL: Unsupported model IR version: 11, "
        "max supported IR version: 10"), "result: C++ source locations and signatures dropped"
    assert len({reason_class(m, op=o) for m, o in ((ORT_ABS, "Abs"), (ORT_RESIZE, "Resize"))}) == 2


def test_a_reason_names_its_operator_once_and_its_engine_not_at_all():
    assert reason_class("myengine: myengine: takes no sequence values", ["myengine"], "SequenceInsert") == (
        "SequenceInsert: takes no sequence values"), "result: the op in front when the text does not name it"
    assert reason_class("no kernel for Conv", ["x"], "Conv") == "no kernel for Conv", "result: no repetition"
    assert reason_class("ref-sim: model uses operators this runtime cannot run: Loop_0: no kernel for ai.onnx::Loop "
                        "at opset 16 (have 1-)", ["ref-sim"], "Loop") == "no kernel for ai.onnx::Loop at opset 16"
    assert reason_class("no kernel for A, B, C, D, E, F", op="F") == "F: no kernel for A, B, C, D and 2 more"
    assert reason_class("declares no decode session, so no graph capture") == (
        "declares no decode session, so no graph capture"), "result: a test without an op keeps its reason"


def _report(rows):
    """A report.json's tests: (key, op, outcome, reason-or-message) for engine myengine."""
    tests = {}
    for key, op, outcome, text in rows:
        o = {"engine": "myengine", "key": key, "op": op, "outcome": outcome}
        if outcome == "skipped":
            o["reason"] = f"unsupported: myengine: {text}"
        else:
            o["message"] = f"lockstep: myengine newly cannot run {key}: {text}"
            o["newly_unsupported"] = key
        tests[f"t.py::test_node_case[myengine-{key}]"] = o
    return {"tests": tests}


REPORT = _report([
    ("test_resize_a", "Resize", "failed", ORT_RESIZE), ("test_resize_b", "Resize", "failed", ORT_RESIZE),
    ("test_resize_c", "Resize", "failed", ORT_RESIZE.replace("19", "18")),
    ("test_abs", "Abs", "skipped", ORT_ABS),
    ("test_capture_on_off_byte_identity[m1]", None, "failed", "declares no decode session, so no graph capture"),
    ("test_add", "Add", "passed", ""),
])


def test_the_writer_emits_one_entry_per_operator_for_the_engines_own_file(tmp_path):
    text = emit("myengine", rows_from_report(REPORT, "myengine"), source="r.json")
    assert "engine =" not in text, "contract: entries for an engine's own file name no engine"
    assert text.splitlines()[0] == "# myengine: 5 case(s) it cannot run, by the operator each is about (from r.json)"
    assert text.index('"test_abs"') < text.index('"test_resize_a"') < text.index("test_capture_on_off"), (
        "result: operators in alphabetical order, then the other tests by reason")
    assert 'reason = "NOT_IMPLEMENTED: Could not find an implementation for Resize(19) (and 1 other message(s))"' in text
    assert 'patterns = ["test_resize_a", "test_resize_b", "test_resize_c"]' in text
    assert emit("myengine", rows_from_report(REPORT, "myengine")) == emit(
        "myengine", reversed(rows_from_report(REPORT, "myengine"))), "contract: stable whatever the report's order"
    path = tmp_path / "own.toml"
    path.write_text(text)
    for name in ("myengine", "myengine-gemm"):  # the variant factory sharing the file
        entries = expectations.load(path, name)
        assert {e.engine for e in entries} == {name} and len(entries) == 3
    shared = emit("myengine", rows_from_report(REPORT, "myengine"), engine_field=True)
    assert shared.count('engine = "myengine"') == 3, "result: --engine-field for a file engines share"
    path.write_text(shared)
    assert {e.engine for e in expectations.load(path)} == {"myengine"}


def test_only_the_newly_unsupported_are_written_for_appending():
    new = rows_from_report(REPORT, "myengine", new_only=True)
    assert sorted(k for k, _, _ in new) == ["test_capture_on_off_byte_identity[m1]", "test_resize_a",
                                            "test_resize_b", "test_resize_c"], "result: the expected test_abs left out"


def test_an_own_file_entry_naming_a_variant_is_that_variants_alone(tmp_path):
    path = tmp_path / "own.toml"
    path.write_text('[[expect]]\nkind = "unsupported"\nreason = "r"\npatterns = ["test_a"]\n\n'
                    '[[expect]]\nengine = "myengine-gemm"\nkind = "unsupported"\nreason = "gemm only"\n'
                    'patterns = ["test_b"]\n')
    assert [(e.engine, e.patterns) for e in expectations.load(path, "myengine")] == [
        ("myengine", ["test_a"]), ("myengine-gemm", ["test_b"])], "result: no error; the named entry keeps its engine"


def test_the_from_report_command(tmp_path, capsys):
    rep = tmp_path / "report.json"
    rep.write_text(json.dumps(REPORT))
    assert expectations.main(["--from-report", str(rep), "--engine", "myengine", "--new"]) == 0
    out = capsys.readouterr().out
    assert "test_resize_a" in out and '"test_abs"' not in out and "engine =" not in out
    assert expectations.main(["--from-report", str(rep), "--engine", "nope"]) == 2
    assert "--engine nope: not in" in capsys.readouterr().err


class _WrongAbs:
    name = "wrong-abs"

    def available(self):
        return True, "here"

    def prepare(self, model):
        return lambda feeds: [-abs(next(iter(feeds.values())))]


def make_wrong_abs():
    return _WrongAbs()


@pytest.mark.parametrize("field", [False, True])
def test_node_cases_emits_xfails_for_the_engines_own_file(capsys, field):
    from lockstep.reference_runtime.node_cases import main

    args = ["--engine", f"{__name__}:make_wrong_abs", "--match", "test_abs", "--emit-expectations"]
    assert main(args + (["--engine-field"] if field else [])) == 0
    out = capsys.readouterr().out
    assert 'pattern = "test_abs"\nkind = "xfail"' in out
    assert ('engine = "wrong-abs"' in out) == field, "contract: the engine only with --engine-field"


VARIANTS = '''
from pathlib import Path

import numpy as np

from lockstep.engines import Unsupported


class Engine:
    expectations = Path(__file__).with_name("variants.toml")  # one file, both variants

    def __init__(self, name, kernels):
        self.name, self.kernels = name, kernels

    def available(self):
        return True, "here"

    def prepare(self, model):
        nodes = model.graph.node
        if len(nodes) != 1 or nodes[0].op_type not in self.kernels:
            raise Unsupported(f"{self.name}: no kernel for {nodes[0].op_type}")
        kernel, inputs = self.kernels[nodes[0].op_type], list(nodes[0].input)
        return lambda feeds: [kernel(*(feeds[n] for n in inputs))]


def make():
    return Engine("myengine", {"Abs": np.abs})


def make_neg():
    return Engine("myengine-neg", {"Abs": np.abs, "Neg": np.negative})
'''


def test_variant_factories_of_one_plugin_share_its_expectations_file(pytester, capsys):
    """The issue's case: entries written from one variant's run (`engine = "myengine"` in each) made
    the other variant's load fail. Written without `engine`, they are each variant's; one naming a
    variant is left out for the other."""
    pytester.makepyfile(lockstep_variants=VARIANTS)
    pytester.syspathinsert()
    sel = ["--pyargs", "lockstep.conformance.node_suite", "-m", "node_suite", "-k", "test_abs or test_neg",
           "-p", "no:cacheprovider"]
    first = pytester.runpytest(*sel, "--engines", "lockstep_variants:make", "--lockstep-report-dir", "rep")
    first.assert_outcomes(passed=1, failed=2)
    capsys.readouterr()
    assert expectations.main(["--from-report", str(pytester.path / "rep" / "report.json"), "--engine", "myengine",
                              "--new"]) == 0
    (pytester.path / "variants.toml").write_text(capsys.readouterr().out)
    both = pytester.runpytest(*sel, "--engines", "lockstep_variants:make,lockstep_variants:make_neg")
    both.assert_outcomes(passed=4, skipped=2)
    both.stdout.fnmatch_lines(["*expected-unsupported cases that now run*", "myengine-neg: 2: test_neg, test_neg_example"])
    text = (pytester.path / "variants.toml").read_text()
    (pytester.path / "variants.toml").write_text(text.replace('kind = "unsupported"',
                                                              'engine = "myengine"\nkind = "unsupported"'))
    neg = pytester.runpytest(*sel, "--engines", "lockstep_variants:make_neg")
    neg.assert_outcomes(passed=3)
    assert "now run" not in neg.stdout.str(), "result: the entry naming myengine is not the variant's"


ORTISH = '''
from pathlib import Path

from lockstep.engines import Unsupported


class Ortish:
    """Refuses every model with ONNX Runtime's own words (a plugin passing str(exc) on)."""
    name = "ortish"
    expectations = Path(__file__).with_name("ortish.toml")

    def available(self):
        return True, "here"

    def prepare(self, model):
        op = model.graph.node[0].op_type
        raise Unsupported(f"[ONNXRuntimeError] : 9 : NOT_IMPLEMENTED : Could not find an implementation for {op}(13) "
                          f"node with name '{model.graph.name}'")


def make():
    return Ortish()
'''


def test_onnx_runtime_messages_are_recorded_and_summarised_per_operator(pytester, capsys):
    pytester.makepyfile(lockstep_ortish=ORTISH)
    pytester.syspathinsert()
    sel = ["--pyargs", "lockstep.conformance.node_suite", "-m", "node_suite", "-k", "test_abs or test_neg or test_relu",
           "--engines", "lockstep_ortish:make", "-p", "no:cacheprovider"]
    pytester.runpytest(*sel, "--lockstep-report-dir", "rep").assert_outcomes(failed=5)
    capsys.readouterr()
    assert expectations.main(["--from-report", str(pytester.path / "rep" / "report.json"), "--engine", "ortish"]) == 0
    written = capsys.readouterr().out
    (pytester.path / "ortish.toml").write_text(written)
    assert written.count("[[expect]]") == 3 and "Could not find an implementation for Relu(13)" in written, written
    result = pytester.runpytest(*sel)
    result.assert_outcomes(skipped=5)
    result.stdout.fnmatch_lines([
        "ortish: 5 skipped (3 operators)",
        "*NOT_IMPLEMENTED: Could not find an implementation for Neg(13)",
        "*NOT_IMPLEMENTED: Could not find an implementation for Relu(13) (and 1 other message(s))",  # its expanded case
        "*NOT_IMPLEMENTED: Could not find an implementation for Abs(13)",
    ])


def test_a_bracketless_pattern_matches_node_cases_not_parametrized_keys():
    # contract: "test_*" in an engine's expectations (every node case: ORT GenAI runs none) must not take the
    # golden locks it does run (test_tripwire[genai-llama-fp32-cpu]); before, every such case read "newly runs"
    from lockstep.conformance.expectations import filter_keys, match

    assert match("test_abs", "test_*") and match("test_dft_inverse_x", "test_dft_inverse*")
    assert not match("test_tripwire[genai-llama-fp32-cpu]", "test_*")
    assert match("test_tripwire[genai-llama-fp32-cpu]", "test_tripwire[*]")
    assert filter_keys({"test_abs", "test_tripwire[m]"}, "test_*") == ["test_abs"]


def test_under_k_an_entry_for_a_deselected_key_is_not_stale():
    # contract: `-k genai-` collects some parameters of test_capture_on_off_byte_identity; an exact entry for a
    # parameter -k left out is not judged (before: "entries matching no case" ended the run), one -k kept is
    from types import SimpleNamespace

    from lockstep.conformance.expectations import Entry
    from lockstep.conformance.plugin_expectations import _kept_by_keyword, _stale_entries

    kept = _kept_by_keyword(SimpleNamespace(getoption=lambda name, default=None: "genai-"))
    collected = {"test_capture_on_off_byte_identity[genai-llama-fp32-cpu]"}
    left_out = Entry(engine="ort-cuda", patterns=["test_capture_on_off_byte_identity[tiny-fp32-standard]"],
                     kind="unsupported", reason="x")
    wrong = Entry(engine="ort-cuda", patterns=["test_capture_on_off_byte_identity[genai-no-such]"],
                  kind="unsupported", reason="x")
    assert _stale_entries([left_out], collected, set(), kept) == ""
    assert "genai-no-such" in _stale_entries([wrong], collected, set(), kept)
    assert "tiny-fp32-standard" in _stale_entries([left_out], collected, set(), None), "without -k it is stale"


def test_the_key_of_a_test_whose_only_parameter_is_the_engine_is_its_function():
    # contract: the engine is never part of a key, also when it is the only parameter (before: `test_f[ort-genai]`,
    # which a shared file's `test_*` could not match, and which names one variant of a shared file)
    from lockstep.conformance.expectations import key_from_nodeid

    assert key_from_nodeid("conformance/x/test_y.py::test_f[ort-genai]", "ort-genai") == "test_f"
    assert key_from_nodeid("conformance/x/test_y.py::test_f[ort-genai-tiny]", "ort-genai") == "test_f[tiny]"
    assert key_from_nodeid("conformance/x/test_y.py::test_f[tiny-ort-genai]", "ort-genai") == "test_f[tiny]"


FLAKY = '''
from pathlib import Path

import numpy as np


class Flaky:
    """Gets Abs wrong (a wrong value) and raises on Neg (an error): two kinds of failure."""
    name = "flaky"
    expectations = Path(__file__).with_name("flaky.toml")

    def available(self):
        return True, "here"

    def prepare(self, model):
        op = model.graph.node[0].op_type
        if op == "Neg":
            raise RuntimeError("internal executor error: node 0 (Neg) failed")
        return lambda feeds: [np.abs(next(iter(feeds.values()))) + 1]


def make():
    return Flaky()
'''


def test_failures_are_counted_by_kind_and_recorded_as_strict_xfails(pytester, capsys):
    """Contract: a wrong value and an error are counted apart (terminal summary, report.json, report.md), and
    `lockstep expectations --failures` records both as strict xfails that make the next run green."""
    pytester.makepyfile(lockstep_flaky=FLAKY)
    pytester.syspathinsert()
    sel = ["--pyargs", "lockstep.conformance.node_suite", "-m", "node_suite", "-k", "test_abs or test_neg",
           "--engines", "lockstep_flaky:make", "-p", "no:cacheprovider"]
    first = pytester.runpytest(*sel, "--lockstep-report-dir", "rep")
    first.assert_outcomes(failed=3)
    first.stdout.fnmatch_lines(["*failures by kind*", "flaky: 1 wrong value, 2 errors (the engine raised)",
                                "  known failures? record them in its expectations file*",
                                "  lockstep expectations --from-report rep/report.json --engine flaky --failures >> flaky.toml"])
    report = json.loads((pytester.path / "rep" / "report.json").read_text())
    assert report["summary"]["kinds"]["flaky"] == {"failed": {"error": 2, "wrong value": 1}}
    assert report["engines"]["flaky"]["decode session"].startswith("lockstep's HostKVSession"), \
        "contract: the report says which decode session ran the locks"
    assert "| flaky | 1 | 2 | 0 | 0 | 0 |" in (pytester.path / "rep" / "report.md").read_text()
    capsys.readouterr()
    assert expectations.main(["--from-report", str(pytester.path / "rep" / "report.json"), "--engine", "flaky",
                              "--failures"]) == 0
    written = capsys.readouterr().out
    assert written.count('kind = "xfail"') == 3 and "error: " in written and "wrong value: " in written, written
    (pytester.path / "flaky.toml").write_text(written)
    again = pytester.runpytest(*sel, "--lockstep-report-dir", "rep2")
    again.assert_outcomes(xfailed=3)
    kinds = json.loads((pytester.path / "rep2" / "report.json").read_text())["summary"]["kinds"]["flaky"]
    assert kinds == {"xfailed": {"error": 2, "wrong value": 1}}, "result: known failures keep their kind"
    assert expectations.main(["--from-report", str(pytester.path / "rep" / "report.json"), "--engine", "flaky",
                              "--failures", "--new"]) == 2
