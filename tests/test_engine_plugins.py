"""Third-party engines: the registry (entry points and ``pkg.module:factory``), validation against the
protocol, the pytest plugin's engine selection, the ``onnx.backend`` adapter, and the example
out-of-tree plugin (``examples/engine-plugin``) clean and with its planted bug."""

from __future__ import annotations

import os
import subprocess
import sys
from importlib.metadata import EntryPoint
from pathlib import Path

import onnx
import pytest
from onnx import TensorProto, helper

from lockstep.conformance.cli import _self_tests
from lockstep.decoding import HostKVSession, open_session
from lockstep.engines import EngineLoadError, Unsupported, load_engine, registered, validate
from lockstep.engines import registry as registry_mod
from lockstep.engines.onnx_backend import BackendEngine
from lockstep.golden.anchors import MODEL_DIR, load_snapshot
from lockstep.golden.locks import teacher_forced_lock, tripwire
from lockstep.reference_runtime.node_cases import load_cases, run_case

ROOT = Path(__file__).resolve().parent.parent
EXAMPLE = ROOT / "examples" / "engine-plugin"
# lockstep's own engines: the entry points its pyproject.toml registers (sorted, as registered() lists them)
BUILTIN = sorted(__import__("tomllib").loads((ROOT / "pyproject.toml").read_text())
                 ["project"]["entry-points"]["lockstep.engines"])


# -- registry --------------------------------------------------------------------------------------
def test_the_builtin_engines_are_registered_as_entry_points():
    eps = registered()
    assert list(eps)[:len(BUILTIN)] == BUILTIN, "contract: lockstep's own engines come through its entry points"
    assert eps["ref-sim"].value == "lockstep.reference_runtime.engine:sim_engine"
    assert load_engine("ref-sim").name == "ref-sim"


class _Tiny:
    name = "tiny"

    def available(self):
        return True, "always"

    def prepare(self, model):
        return lambda feeds: [feeds["x"]]


def make_tiny():
    return _Tiny()


def make_broken():
    raise RuntimeError("no licence server")


def make_nameless():
    t = _Tiny()
    t.name = "has,comma"
    return t


def test_a_factory_spec_loads_and_validates():
    eng = load_engine(f"{__name__}:make_tiny")
    assert eng.name == "tiny" and eng.prepare(None)({"x": 1}) == [1]


@pytest.mark.parametrize("spec, message", [
    ("no_such_module_xyz:make", "engine factory 'no_such_module_xyz:make': cannot import 'no_such_module_xyz'"),
    (f"{__name__}:missing", f"module '{__name__}' has no attribute 'missing'"),
    (f"{__name__}:make_broken", "the factory raised RuntimeError: no licence server"),
    (f"{__name__}:make_nameless", "`name` must be a non-empty string without commas"),
    (f"{__name__}:ROOT", "is not callable"),
    (":", "expected pkg.module:factory, with both parts named"),  # found by the fuzzer (issue 15)
    (".relative:make", "cannot import '.relative'"),
])
def test_an_engine_that_fails_to_load_is_an_error_naming_it(spec, message):
    with pytest.raises(EngineLoadError, match=None) as err:
        load_engine(spec)
    assert message in str(err.value)


def test_validation_lists_every_problem_with_the_offending_definition(tmp_path):
    class Bad:
        name = "bad"
        precision = {"float32": "fp31"}
        expectations = tmp_path  # a folder
        decoder = 3

    with pytest.raises(EngineLoadError) as err:
        validate(Bad(), "engine entry point 'bad' (x:y)")
    text = str(err.value)
    assert text.startswith("engine entry point 'bad' (x:y) does not implement the engine protocol")
    for problem in ("no `available()` method", "no `prepare()` method", "`decoder` is not callable",
                    "unknown precision(s) {'float32': 'fp31'}", f"`expectations` {tmp_path} is a folder"):
        assert problem in text


def test_an_expectations_file_not_written_yet_is_allowed(tmp_path):
    """A new engine declares its file before its first run writes it: no load error (fail closed:
    it then expects nothing, so every case it cannot run fails and the run says how to write it)."""
    eng = _Tiny()
    eng.expectations = tmp_path / "not-yet.toml"
    assert validate(eng) is eng


RAISER = '''
from lockstep.engines import Unsupported

class Raiser:
    name = "raiser"
    def available(self):
        return True, "here"
    def prepare(self, model):
        raise Unsupported("raiser: raiser: no kernel for " + model.graph.node[0].op_type)

def make():
    return Raiser()
'''


def test_a_factory_module_in_the_working_directory_loads(tmp_path, monkeypatch):
    """The registry's promise: ``module:factory`` from the working directory, also where Python did
    not put it on sys.path (the ``lockstep`` and ``pytest`` console scripts put their own folder)."""
    (tmp_path / "raiser.py").write_text(RAISER)
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "path", [p for p in sys.path if p not in ("", ".", str(tmp_path))])
    monkeypatch.delitem(sys.modules, "raiser", raising=False)
    before = list(sys.path)
    with pytest.raises(EngineLoadError, match=r"cannot import 'no_such_xyz': No module named 'no_such_xyz' \(looked "
                                              r"on sys.path and in the working directory"):
        load_engine("no_such_xyz:make")
    assert sys.path == before, "contract: a module found nowhere leaves sys.path as it was"
    assert load_engine("raiser:make").name == "raiser"
    assert sys.path == [*before, str(tmp_path)], "result: appended, after everything installed"


@pytest.mark.parametrize("command", [["lockstep", "check"], ["pytest", "--pyargs", "lockstep.conformance"]])
def test_console_scripts_find_a_factory_in_the_working_directory(tmp_path, command):
    """``lockstep check --engines raiser:make`` / ``pytest --engines raiser:make`` from the folder
    holding raiser.py (``python -P``: the working directory not on sys.path, as for a console script)."""
    (tmp_path / "raiser.py").write_text(RAISER)
    # PYTHONPATH stays: it is where lockstep lives in an install by --target (the GPU lane's)
    env = {k: v for k, v in os.environ.items() if not k.startswith("LOCKSTEP_REQUIRE_")}
    proc = subprocess.run([sys.executable, "-P", "-m", *command, "--engines", "raiser:make", "-m", "node_suite",
                           "-k", "test_abs or test_relu", "-p", "no:cacheprovider", "-q"], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=300, check=False)
    out = proc.stdout + proc.stderr
    assert "No module named 'raiser'" not in out, out[-2000:]
    assert proc.returncode == 1 and "3 failed" in out, out[-3000:]
    assert "raiser newly cannot run test_abs: no kernel for Abs" in out, "result: the engine's name said once"
    assert "raiser: raiser:" not in out, out[-3000:]


def _fake_entry_points(monkeypatch, *eps: EntryPoint):
    monkeypatch.setattr(registry_mod, "entry_points", lambda group: list(eps) if group == registry_mod.GROUP else [])


def test_an_entry_point_whose_engine_has_another_name_is_refused(monkeypatch):
    _fake_entry_points(monkeypatch, EntryPoint("mine", f"{__name__}:make_tiny", registry_mod.GROUP))
    with pytest.raises(EngineLoadError, match="`name` is 'tiny' but it is registered as 'mine'"):
        load_engine("mine")


def test_a_broken_entry_point_names_itself(monkeypatch):
    _fake_entry_points(monkeypatch, EntryPoint("mine", "no_such_module_xyz:make", registry_mod.GROUP))
    with pytest.raises(EngineLoadError, match=r"engine entry point 'mine' \(no_such_module_xyz:make, from \?\) "
                                              r"failed to load: ModuleNotFoundError"):
        load_engine("mine")


def test_one_name_registered_twice_is_an_error(monkeypatch):
    _fake_entry_points(monkeypatch, EntryPoint("mine", "a:make", registry_mod.GROUP),
                       EntryPoint("mine", "b:make", registry_mod.GROUP))
    with pytest.raises(EngineLoadError, match="engine name 'mine' is registered twice: a:make"):
        registered()


def test_no_engines_registered_at_all_is_an_error(monkeypatch):
    _fake_entry_points(monkeypatch)
    with pytest.raises(EngineLoadError, match="is lockstep installed"):
        registered()


# -- the pytest plugin ------------------------------------------------------------------------------
ENGINE_MODULE = '''
import numpy as np

class Doubler:
    name = "doubler"
    def available(self):
        return True, "here"
    def prepare(self, model):
        return lambda feeds: [2 * feeds["x"]]

def make():
    return Doubler()
'''

USES_ENGINE = '''
def test_uses_engine(engine):
    assert engine.name == "doubler"
'''

OWN_FIXTURE = '''
import pytest

@pytest.fixture(params=["a", "b"])
def engine_name(request):
    return request.param

def test_mine(engine_name):
    assert engine_name in ("a", "b")
'''


def test_the_plugin_runs_tests_against_a_factory_engine_and_leaves_user_fixtures_alone(pytester):
    pytester.makepyfile(my_engine=ENGINE_MODULE, test_uses=USES_ENGINE, test_own=OWN_FIXTURE)
    pytester.syspathinsert()
    result = pytester.runpytest("--engines", "my_engine:make", "-p", "no:cacheprovider", "-v")
    result.assert_outcomes(passed=3)
    result.stdout.fnmatch_lines(["*test_mine[[]a[]] PASSED*", "*test_uses_engine[[]doubler[]] PASSED*"])


def test_the_plugin_refuses_an_engine_that_fails_to_load(pytester):
    pytester.makepyfile(test_uses=USES_ENGINE)
    result = pytester.runpytest("--engines", "no_such_module_xyz:make", "-p", "no:cacheprovider")
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines(["ERROR: --engines: engine factory 'no_such_module_xyz:make': cannot import*"])


def test_a_broken_registered_engine_ends_the_run_once_with_its_name(pytester, monkeypatch):
    """Without --engines every registered engine is loaded when a test first needs one: a broken
    entry point ends the session with one message naming it, never a silent absence."""
    _fake_entry_points(monkeypatch, EntryPoint("mine", "no_such_module_xyz:make", registry_mod.GROUP))
    result = pytester.runpytest("--pyargs", "lockstep.conformance.node_suite", "-p", "no:cacheprovider")
    assert result.ret == pytest.ExitCode.USAGE_ERROR, "contract: lockstep's suite refuses to start"
    text = result.stdout.str() + result.stderr.str()
    assert text.count("engine entry point 'mine' (no_such_module_xyz:make, from ?) failed to load") == 1, text
    # a user's own tests that take the engine fixture: loaded when needed, the error names it too
    pytester.makepyfile(test_uses=USES_ENGINE)
    result = pytester.runpytest("-p", "no:cacheprovider", "test_uses.py")
    assert result.ret != 0 and "engine entry point 'mine'" in result.stdout.str() + result.stderr.str()


# -- the onnx.backend adapter ----------------------------------------------------------------------
class _RefEvalRep:
    def __init__(self, model):
        from onnx.reference import ReferenceEvaluator

        self.ev = ReferenceEvaluator(model)
        init = {t.name for t in model.graph.initializer}
        self.names = [i.name for i in model.graph.input if i.name not in init]

    def run(self, inputs, **kwargs):
        return self.ev.run(None, dict(zip(self.names, inputs)))


class RefEvalBackend:
    """A minimal ``onnx.backend.base.Backend`` over onnx's reference evaluator (the shape a runtime
    that already runs ONNX's backend tests has)."""

    @classmethod
    def prepare(cls, model, device="CPU", **kwargs):
        return _RefEvalRep(model)

    @classmethod
    def supports_device(cls, device):
        return device == "CPU"

    @classmethod
    def is_compatible(cls, model, device="CPU", **kwargs):
        return not any(n.op_type == "Loop" for n in model.graph.node)


def test_an_onnx_backend_is_one_line_from_an_engine():
    eng = validate(BackendEngine(RefEvalBackend, name="refeval"))
    assert eng.available()[0] and not BackendEngine(RefEvalBackend, "x", device="CUDA").available()[0]
    cases = [c for c in load_cases() if c.name in ("test_add", "test_softmax_axis_0", "test_matmul_2d")]
    assert [run_case(eng, c).status for c in cases] == ["passed"] * 3, "result: the node suite runs through it"
    loop = helper.make_model(helper.make_graph([helper.make_node("Loop", ["m", "c"], ["y"], body=helper.make_graph(
        [], "b", [], []))], "g", [helper.make_tensor_value_info("m", TensorProto.INT64, [])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1])]))
    with pytest.raises(Unsupported, match="incompatible"):
        eng.prepare(loop)
    # the golden locks decode through prepare() with the cache on the host
    name = "tiny-fp32-standard"
    session = open_session(eng, onnx.load(str(MODEL_DIR / f"{name}.onnx")))
    assert isinstance(session, HostKVSession)
    snap = load_snapshot(name)
    assert teacher_forced_lock(session, snap, "fp32", stepwise=False).ok
    assert teacher_forced_lock(session, snap, "fp32", stepwise=True).ok
    with pytest.raises(Unsupported, match="no graph capture"):
        open_session(eng, onnx.load(str(MODEL_DIR / f"{name}.onnx")), capture=True)


# -- the example plugin (examples/engine-plugin) ---------------------------------------------------
@pytest.fixture
def example(monkeypatch):
    monkeypatch.syspath_prepend(str(EXAMPLE))
    import lockstep_example_engine

    return lockstep_example_engine


def test_the_example_engine_passes_and_its_planted_bug_fails_at_the_first_diverging_position(example):
    name = "tiny-fp32-standard"
    model = onnx.load(str(MODEL_DIR / f"{name}.onnx"))
    snap = load_snapshot(name)
    clean = validate(example.make_engine(), expected_name="example")
    buggy = validate(example.make_buggy_engine())
    for stepwise in (False, True):
        assert teacher_forced_lock(clean.decoder(model), snap, "fp32", stepwise=stepwise).ok
    assert not tripwire(clean.decoder(model), snap, "fp32").fatal
    assert teacher_forced_lock(buggy.decoder(model), snap, "fp32", stepwise=False).ok, "the prefill is unaffected"
    lock = teacher_forced_lock(buggy.decoder(model), snap, "fp32", stepwise=True)
    assert not lock.ok and lock.describe().startswith(f"first divergence at position {snap['start']}:")
    trip = tripwire(buggy.decoder(model), snap, "fp32")
    assert trip.fatal and trip.divergence["pos"] == snap["start"] + 1, "result: the first greedy step after it"


def test_the_example_has_no_capture_and_refuses_ops_it_lacks(example):
    eng = example.make_engine()
    with pytest.raises(Unsupported, match="no graph capture"):
        eng.decoder(onnx.load(str(MODEL_DIR / "tiny-fp32-standard-kv64.onnx")), capture=True)
    case = next(c for c in load_cases() if c.name == "test_lrn")
    assert run_case(eng, case).status == "unsupported"


def test_lockstep_check_on_the_buggy_example_fails_with_the_position(tmp_path):
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(EXAMPLE), os.environ.get("PYTHONPATH", "")]))
    proc = subprocess.run(
        [sys.executable, "-m", "lockstep", "check", "--engines", "lockstep_example_engine:make_buggy_engine",
         "--report-dir", str(tmp_path / "rep"), "-m", "golden", "-k", "tiny-fp32-standard and not kv64",
         "-p", "no:cacheprovider", "-q"],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 1, out[-3000:]
    assert "example-buggy (fp32) breaks the lock on tiny-fp32-standard (stepwise): first divergence at position 18" in out
    assert "1 passed" not in out or "2 failed" in out


# -- what a plugin-only run runs ---------------------------------------------------------------------
def _collect(*engines_and_options):
    proc = subprocess.run([sys.executable, "-m", "pytest", "--co", "-q", "-p", "no:cacheprovider", "--pyargs",
                           "lockstep.conformance", *engines_and_options], capture_output=True, text=True, cwd=ROOT,
                          timeout=600)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    return proc.stdout


@pytest.mark.contract("plugin.self_tests_need_a_reference_engine")
def test_a_plugin_only_run_holds_only_its_engine_s_tests():
    """The suite users run holds engine tests only: collected with only a non-reference engine, every
    test is that engine's and nothing is deselected to get there. The reference runtime's own tests
    (``lockstep.contracts.suite``: runtime contracts, parity, the capture-guard pass, paging, the
    built-in oracle checks, the audit) are what the reference engines bring (``self_tests``):
    ``lockstep check`` runs them only when one is selected."""
    plugin_only = _collect("--engines", "ort-cpu")
    ids = [line for line in plugin_only.splitlines() if "::" in line]
    # and the check of a user's snapshots (--golden-dir), one visible skip without them
    user = [i for i in ids if i.endswith("test_golden_locks.py::test_snapshot_is_the_oracle[none]")]
    assert len(user) == 1 and all("[ort-cpu-" in i or "[ort-cpu]" in i for i in ids if i not in user), (
        f"contract: only the engine's own tests: {[i for i in ids if 'ort-cpu' not in i][:5]}")
    assert "deselected" not in plugin_only, "contract: nothing of lockstep's own was collected to be dropped"
    assert _self_tests("ort-cpu") == [], "contract: a plugin-only check adds no self-test suite"
    assert _self_tests("ref-sim,ort-cpu") == ["lockstep.contracts.suite"], "contract: ref-sim brings its own"
    assert _self_tests(None) == ["lockstep.contracts.suite"], "contract: every registered engine: ref-sim's too"
    assert _self_tests("no-such-engine") == [], "result: the plugin's usage error names it (test_fail_closed)"


def test_an_engine_s_self_tests_must_name_an_importable_package():
    """``self_tests`` is validated at load, as the rest of the protocol: a non-name or a package
    that is not importable is an EngineLoadError naming it."""
    eng = load_engine("ref-sim")
    for bad, why in (("not a package", "must name an importable package"),
                     ("lockstep.no_such_suite", "not importable here")):
        class Bad:
            name, available, prepare, self_tests = "bad", eng.available, eng.prepare, bad

        with pytest.raises(EngineLoadError, match=why):
            validate(Bad(), "bad")


def test_xdist_workers_get_one_blas_and_onnxruntime_thread(pytester):
    """lockstep's plugin sets one BLAS and one ONNX Runtime thread for pytest-xdist workers (before
    they start: they read it when they import numpy and build engines), a value the user set wins,
    and a run without workers is left alone."""
    pytester.makepyfile(test_threads="""
        import os
        def test_env():
            want = os.environ["WANT"].split(",")
            got = [os.environ.get("OPENBLAS_NUM_THREADS", "unset"), os.environ.get("LOCKSTEP_ORT_THREADS", "unset")]
            assert got == want, got
    """)
    env = {k: v for k, v in os.environ.items() if k not in ("OPENBLAS_NUM_THREADS", "LOCKSTEP_ORT_THREADS")}

    def run(extra_env, *args):
        return subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *args, "test_threads.py"],
                              cwd=pytester.path, env={**env, **extra_env}, capture_output=True, text=True, timeout=300)

    for extra, args in (({"WANT": "1,1"}, ("-n", "2")), ({"WANT": "4,1", "OPENBLAS_NUM_THREADS": "4"}, ("-n", "2")),
                        ({"WANT": "unset,unset"}, ())):
        proc = run(extra, *args)
        assert proc.returncode == 0, f"contract: {extra} {args}: {proc.stdout[-1500:]}"
    from lockstep.engines.ort import OrtEngine

    assert OrtEngine("CPUExecutionProvider", threads=1)._session_options().intra_op_num_threads == 1


# -- capture identity: a planted divergence ---------------------------------------------------------
PLANTED = '''
import numpy as np
from lockstep.engines import CaptureStats, Unsupported


class Session:
    """Deterministic logits per (token, position); with capture on, the one-token step replayed
    for the second time (the 3rd one-token step) reads a stale buffer: one logit jumps to 100."""

    def __init__(self, io, capture):
        self.vocab, self.capture = io.vocab, capture
        self.reset()

    def reset(self):
        self.pos = self.steps = self.captures = self.replays = 0

    def forward(self, ids):
        rows = []
        for t in ids:
            rows.append(np.random.default_rng(int(t) * 1009 + self.pos).standard_normal(self.vocab).astype(np.float32))
            self.pos += 1
        logits = np.stack(rows)
        if self.capture and len(ids) == 1:
            self.steps += 1
            self.captures, self.replays = 1, self.steps - 1  # recorded on the first step, replayed after
            if self.steps == 3:
                logits[-1, int(np.argmin(logits[-1]))] = 100.0
        return logits

    def capture_stats(self):
        return CaptureStats(self.captures, self.replays, 0)


class Planted:
    name = "planted"

    def available(self):
        return True, "here"

    def prepare(self, model):
        raise Unsupported("decodes only")

    def decoder(self, model, *, capture=False, io=None):
        return Session(io, capture)


def make():
    return Planted()
'''


def test_a_capture_divergence_names_the_step_replays_tokens_and_logit_difference(pytester):
    """The capture identity test on an engine whose captured path departs at its third one-token
    step: the failure says which step, after how many replays, both tokens and the max |logit
    difference| there (not `At index 3 diff: 97 != 186`)."""
    pytester.makepyfile(planted_engine=PLANTED)
    pytester.syspathinsert()
    result = pytester.runpytest("--pyargs", "lockstep.conformance.golden", "-m", "capture", "-k",
                                "test_capture_on_off and tiny-fp32-standard and not kv64", "--engines",
                                "planted_engine:make", "-p", "no:cacheprovider")
    result.assert_outcomes(failed=1)
    out = result.stdout.str()
    import re

    m = re.search(r"result: capture on and off of tiny-fp32-standard diverge at step 3 \(position (\d+), after 2 "
                  r"replay\(s\) of the captured run\): token (\d+) with capture on, (\d+) off; max \|logit difference\| "
                  r"(\d+\.\d+) at that step; the 3 step\(s\) before it byte-identical", out)
    assert m, out[-3000:]
    assert m.group(2) != m.group(3) and 100 < float(m.group(4)) < 110, m.group(0)
