"""``lockstep locate``: planted kernel bugs are located at exactly their node, clean engines locate
nothing, ``--reduce`` writes a node case that fails on the buggy engine and passes on clean ones, and a
failing lock names the node and the command.

Each planted bug is ONNX Runtime's CPU provider behind a rewrite of one node (``fixtures/planted_engines.py``):
a fusion pass that scales one MatMul weight, a normalisation's epsilon 10,000 times too large, a Softmax
output transposed (square at the prefill), rotary embedding pairing the wrong halves. Assertions here
are results (which node), and the clean runs' are the contract that locate reports nothing on a correct
engine (no false positive, on the golden models and on real exports).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from lockstep.conformance.locate import LocateError, locate, subject
from lockstep.conformance.locate.reduce import reduce_to_case, write_case
from lockstep.engines import load_engine
from lockstep.reference_runtime.node_cases import load_case_dirs, run_case

FIXTURES = Path(__file__).resolve().parent / "fixtures"
# the fixtures' folder before what the environment already puts on the path (the GPU lane's site folders)
PYPATH = os.pathsep.join(p for p in (str(FIXTURES), os.environ.get("PYTHONPATH", "")) if p)
sys.path.insert(0, str(FIXTURES))
from planted_engines import make  # noqa: E402

# (bug, model, node): golden models and real exports (GenAI's builder, Optimum), prefill and a decode step
PLANTED = [
    ("matmul_scale", "tiny-fp32-standard", "layers.1/up_proj"),
    ("matmul_scale", "genai-llama-fp32-cpu", "/model/layers.0/mlp/gate_proj/MatMul"),
    ("matmul_scale", "optimum-llama-fp32", "/model/layers.1/self_attn/v_proj/MatMul"),
    ("epsilon", "tiny-fp32-standard", "layers.0/mlp_norm"),
    ("epsilon", "tiny-fp32-decomposed", "layers.1/attn_norm/add_eps"),
    ("epsilon", "genai-llama-fp32-cpu", "/model/layers.1/post_attention_layernorm/SkipLayerNorm"),
    ("epsilon", "optimum-llama-fp32", "/model/layers.1/input_layernorm/Add"),
    ("transposed", "tiny-fp32-decomposed", "layers.1/probs"),
    ("transposed", "optimum-llama-fp32", "/model/layers.0/self_attn/Softmax"),
    ("rotary_half", "tiny-fp32-standard", "layers.1/k_rope"),
    ("rotary_half", "tiny-fp32-decomposed", "layers.0/q_rope/rotate_half"),
    ("rotary_half", "genai-llama-fp32-cpu", "/model/layers.1/attn/GroupQueryAttention"),
    ("rotary_half", "optimum-llama-fp32", "/model/layers.0/self_attn/Concat_3"),
]
CLEAN_MODELS = ["tiny-fp32-standard", "tiny-fp16-standard", "tiny-fp32-decomposed-kv64", "tiny-int4-genai",
                "genai-llama-fp32-cpu", "genai-gemma3-fp16-cpu", "optimum-llama-fp32", "optimum-qwen3-fp32"]


@pytest.mark.parametrize("position", [None, 9], ids=["prefill", "step9"])
@pytest.mark.parametrize("bug,model,node", PLANTED, ids=[f"{b}-{m}" for b, m, _ in PLANTED])
def test_planted_bug_is_located_at_its_node(bug, model, node, position):
    loc = locate(make(bug, node), subject(model, position=position))
    assert loc.finding is not None, f"result: {bug} on {model} was not located"
    assert loc.finding.name == node, f"result: {bug} located at {loc.finding.name}, planted at {node}"
    d = loc.as_dict()["first_divergent_node"]
    assert d["name"] == node and d["op_type"] == loc.finding.op_type
    ins = [i for i in d["inputs"] if i["status"] not in ("exact", "unknown")]
    assert all(i["status"] == "in" for i in ins), f"result: an input of the first node is out of band: {ins}"


@pytest.mark.parametrize("engine", ["ort-cpu", "ref-sim"])
@pytest.mark.parametrize("model", CLEAN_MODELS)
def test_clean_engine_locates_nothing(engine, model):
    for position in (None, 7):
        loc = locate(load_engine(engine), subject(model, position=position))
        # the prefill in the engine's own decode session (both declare one), a step through prepare
        assert loc.method == ("session-eager" if position is None else "exposed"), loc.note
        assert loc.finding is None, f"result: a false divergence on clean {engine}: {loc.finding.as_dict()}"
        assert sum(j.status == "in" for j in loc.judged) > 10


def test_reduce_writes_a_case_failing_on_the_buggy_engine_only(tmp_path):
    for bug, model, node in [PLANTED[0], PLANTED[5], PLANTED[8], PLANTED[11]]:
        buggy, s = make(bug, node), subject(model)
        loc = locate(buggy, s)
        red = reduce_to_case(buggy, s, loc)
        out = write_case(tmp_path / bug, red, engine=bug, command="test")
        assert red.nodes == 1 and (out / "test_data_set_0" / "input_0.pb").is_file()
        (case,) = load_case_dirs(out)
        assert run_case(buggy, case).status == "failed", f"result: the reduced {bug} case passes on the buggy engine"
        for clean in ("ort-cpu", "ref-sim"):
            got = run_case(load_engine(clean), case)
            assert got.status == "passed", f"result: the reduced {bug} case fails on clean {clean}: {got.detail}"
        again = locate(buggy, subject(str(out)))
        assert again.finding is not None and again.finding.name == node


F2_CASES = ["test_attention_causal_boolmask_nan_robustness_expanded",
            "test_attention_23_boolmask_fullymasked_row_nan_robustness_expanded",
            "test_attention_4d_causal_nonpad_negative_offset_structural_empty_expanded",
            "test_attention_23_fullymasked_qk_matmul_output_mode3_zero_expanded",
            "test_attention_local_window_gqa_rank4_mask_expanded"]


@pytest.mark.parametrize("case", F2_CASES)
def test_ort_cuda_reducemax_finding_reproduced_on_cpu_is_located(case):
    """F2 (docs/ort-cuda-findings.md) planted on the CPU provider: located at a ReduceMax of ONNX's own
    node case, with no case-specific code; the clean provider locates nothing there. (The H200 lane runs
    the same cases on ort-cuda itself: scripts/locate_lane.py.)"""
    loc = locate(make("reducemax_floor", ""), subject(case))
    assert loc.finding is not None and loc.finding.op_type == "ReduceMax", loc.as_dict()["first_divergent_node"]
    assert "where the oracle has -inf" in loc.finding.outputs[0].why
    assert locate(load_engine("ort-cpu"), subject(case)).finding is None


def test_divergence_in_a_shape_is_located_by_bisection():
    """A transposed output at a decode step is not square: the engine fails on the model itself, and
    bisection over extracted prefixes names the node whose output changed shape."""
    loc = locate(make("transposed", "layers.1/probs"), subject("tiny-fp32-decomposed", position=9))
    assert loc.method == "bisect" and loc.finding.name == "layers.1/probs"
    assert "shape" in loc.finding.outputs[0].why


class _NoExposure:
    """An engine that runs a model only with the outputs it declares (a compiled engine)."""

    name = "no-exposure"

    def __init__(self, inner, outputs: int):
        self.inner, self.outputs = inner, outputs

    def available(self):
        return True, ""

    def prepare(self, model):
        if len(model.graph.output) > self.outputs:
            raise RuntimeError("this engine runs a model's own outputs only")
        return self.inner.prepare(model)


def test_an_engine_that_refuses_exposed_values_is_bisected():
    buggy = make("matmul_scale", "layers.1/up_proj")
    loc = locate(_NoExposure(buggy, 8), subject("tiny-fp32-standard"))
    assert loc.method == "bisect" and "refused" in loc.note
    assert loc.finding.name == "layers.1/up_proj" and loc.runs < 16


def test_node_case_by_name_and_bad_input(tmp_path):
    loc = locate(load_engine("ort-cpu"), subject("test_softmax_axis_0"))
    assert loc.finding is None and loc.judged
    with pytest.raises(LocateError, match="no such ONNX node case"):
        subject("test_no_such_case")
    with pytest.raises(LocateError, match="neither a file"):
        subject("no-such-model")
    with pytest.raises(LocateError, match="positions 0..41"):
        subject("tiny-fp32-standard", position=42)
    (tmp_path / "m").mkdir()
    with pytest.raises(LocateError, match="not a node-case folder"):
        subject(str(tmp_path / "m"))


def _cli(*args, env=None):
    return subprocess.run([sys.executable, "-m", "lockstep", "locate", *args], capture_output=True, text=True,
                          env={**os.environ, "PYTHONPATH": PYPATH, **(env or {})}, timeout=300)


def test_cli_text_json_exit_status_and_reduce(tmp_path):
    env = {"PLANTED_NODE": "layers.0/mlp_norm"}
    r = _cli("tiny-fp32-standard", "--engine", "planted_engines:make_epsilon", "--format", "json", "-q",
             "--reduce", str(tmp_path / "case"), "--plot", str(tmp_path / "p.png"), env=env)
    assert r.returncode == 1, r.stderr
    out = json.loads(r.stdout)
    assert out["first_divergent_node"]["name"] == "layers.0/mlp_norm"
    assert out["first_divergent_node"]["op_type"] == "RMSNormalization"
    assert out["command"] == "lockstep locate tiny-fp32-standard --engine planted_engines:make_epsilon"
    assert out["reduced"]["nodes"] == 1 and (tmp_path / "case" / "model.onnx").is_file()
    assert (tmp_path / "p.png").stat().st_size > 1000
    r = _cli("tiny-fp32-standard", "--engine", "ort-cpu", "-q")
    assert r.returncode == 0 and "no divergence" in r.stdout, r.stdout + r.stderr
    r = _cli("tiny-fp32-standard", "--engine", "planted_engines:make_epsilon", "--reduce", str(tmp_path / "case"),
             env=env)
    assert r.returncode == 2 and "not empty" in r.stderr and "Traceback" not in r.stderr
    r = _cli("nope.onnx", "--engine", "ort-cpu")
    assert r.returncode == 2 and r.stderr.count("\n") == 1 and "Traceback" not in r.stderr


def test_case_dir_runs_in_the_node_suite_with_a_locate_command(tmp_path):
    buggy, s = make("matmul_scale", "layers.1/up_proj"), subject("tiny-fp32-standard")
    write_case(tmp_path / "cases" / "up_proj", reduce_to_case(buggy, s, locate(buggy, s)), engine="x", command="y")
    r = subprocess.run([sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "--pyargs",
                        "lockstep.conformance.node_suite", "--engines", "ort-cpu,planted_engines:make_matmul_scale",
                        f"--lockstep-cases-dir={tmp_path / 'cases'}", "-k", "cases/", "-q", "-n", "0"],
                       capture_output=True, text=True, cwd=tmp_path, timeout=300,
                       env={**os.environ, "PYTHONPATH": PYPATH, "PLANTED_NODE": "layers.1/up_proj"})
    assert "1 failed, 1 passed" in r.stdout, r.stdout[-2000:]
    assert (f"locate it: lockstep locate {tmp_path / 'cases' / 'up_proj'} --engine planted_engines:make_matmul_scale"
            in r.stdout)


def test_a_failing_lock_names_its_node_and_command_and_the_report_plots_it(tmp_path):
    r = subprocess.run([sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "--pyargs",
                        "lockstep.conformance.golden", "--engines", "planted_engines:make_matmul_scale",
                        "-k", "test_teacher_forced_lock and tiny-fp32-standard-prefill", "-q", "-n", "0",
                        f"--lockstep-report-dir={tmp_path / 'rep'}"],
                       capture_output=True, text=True, cwd=tmp_path, timeout=300,
                       env={**os.environ, "PYTHONPATH": PYPATH, "PLANTED_NODE": "layers.1/up_proj"})
    assert "1 failed" in r.stdout, r.stdout[-3000:]
    assert "first divergent node: layers.1/up_proj (MatMul)" in r.stdout
    assert "lockstep locate tiny-fp32-standard --engine planted_engines:make_matmul_scale" in r.stdout
    report = json.loads((tmp_path / "rep" / "report.json").read_text())
    (entry,) = [t["locate"] for t in report["tests"].values() if "locate" in t]
    assert entry["first"]["name"] == "layers.1/up_proj" and entry["points"]
    assert (tmp_path / "rep" / "locate-tiny-fp32-standard-planted-matmul_scale-prefill.png").is_file()


# a bug of the captured decode only (prepare and the eager session clean): ORT CUDA's F4 in miniature
CAPTURE_ONLY = [("matmul_scale", "tiny-fp32-standard", "layers.1/up_proj"),
                ("epsilon", "tiny-fp32-decomposed-kv64", "layers.0/attn_norm/add_eps"),
                ("rotary_half", "genai-llama-fp32-cpu", "/model/layers.1/attn/GroupQueryAttention")]


@pytest.mark.parametrize("bug,model,node", CAPTURE_ONLY, ids=[f"{b}-{m}" for b, m, _ in CAPTURE_ONLY])
def test_a_capture_only_bug_is_located_through_the_captured_session(bug, model, node):
    from planted_engines import CaptureOnly

    from lockstep.conformance.locate.session import locate_in_session

    engine, s = CaptureOnly(bug, node), subject(model, position=24)
    assert locate(engine, s).finding is None, "result: prepare runs the clean model"
    assert locate_in_session(engine, s, "eager").finding is None, "result: the eager session is clean"
    loc = locate_in_session(engine, s, "capture")
    assert "replayed a captured graph" in loc.note, f"contract: the located step is a replay ({loc.note})"
    assert loc.finding is not None and loc.finding.name == node, \
        f"result: the capture bug located at {loc.finding and loc.finding.name}, planted at {node}"
    assert loc.as_dict()["first_divergent_node"]["op_type"] == loc.finding.op_type


@pytest.mark.parametrize("engine,model", [("ref-sim", "tiny-fp16-standard"), ("ref-sim", "genai-gemma2-fp16-cuda"),
                                          ("ref-sim", "optimum-llama-fp32"), ("ort-cpu", "genai-gemma2-fp16-cuda"),
                                          ("ort-cpu", "genai-llama-fp32-cpu"), ("ort-cpu", "tiny-fp32-decomposed-kv64")])
def test_clean_decode_sessions_locate_nothing(engine, model):
    """The contract that a session's own past (not the oracle's) keeps a clean engine inside every band."""
    from lockstep.conformance.locate.session import locate_in_session

    eng = load_engine(engine)
    s = subject(model, position=24)
    modes = ("eager", "capture") if engine == "ref-sim" else ("eager",)
    for mode in modes:
        loc = locate_in_session(eng, s, mode)
        assert loc.finding is None, f"contract: a false divergence in clean {engine}'s {mode} session: {loc.finding.as_dict()}"
        assert sum(j.status == "in" for j in loc.judged) > 10, "contract: values were compared"


def test_ort_decoder_returns_the_same_values_with_fixed_bindings():
    """OrtDecoder's extra outputs in the fixed-binding path (CUDA graphs' persistent buffers) are the plain
    path's, step by step: what `--session capture` reads on ort-cuda."""
    from lockstep.conformance.locate.graph import exposed
    from lockstep.conformance.locate.search import evaluations
    from lockstep.engines.ort import OrtDecoder

    eng, s = load_engine("ort-cpu"), subject("tiny-fp32-decomposed-kv64", position=22)
    m, _ = exposed(s.model, evaluations(s).native, symbolic=True)
    plain, fixed = (OrtDecoder(m, eng, fixed_bindings=f, io=s.decode.io) for f in (False, True))
    ctx = s.decode.context
    for d in (plain, fixed):
        d.forward(ctx[:s.decode.prefill])
    for p in range(s.decode.prefill, 23):
        a, b = plain.forward([ctx[p]]), fixed.forward([ctx[p]])
        np.testing.assert_array_equal(a, b)
        va, vb = plain.values(), fixed.values()
        assert va.keys() == vb.keys() and len(va) > 10, "contract: every exposed value comes back"
        for k in va:
            np.testing.assert_array_equal(va[k], vb[k], err_msg=f"result: {k} at position {p}")


def test_session_mode_errors_are_one_line(tmp_path):
    from planted_engines import NoValues

    from lockstep.conformance.locate.session import locate_in_session

    with pytest.raises(LocateError, match="needs --position N"):
        locate_in_session(load_engine("ref-sim"), subject("tiny-fp32-standard"), "capture")
    with pytest.raises(LocateError, match="not a decoder's step"):
        locate_in_session(load_engine("ref-sim"), subject("test_softmax_axis_0"), "eager")
    with pytest.raises(LocateError, match="returns no values"):
        locate_in_session(NoValues(), subject("tiny-fp32-standard", position=22), "capture")
    with pytest.raises(LocateError, match="no capture decode session"):
        locate_in_session(load_engine("ort-cpu"), subject("tiny-fp32-standard", position=22), "capture")
    r = _cli("tiny-fp32-standard", "--engine", "ref-sim", "--session", "capture", "--position", "22", "--reduce",
             str(tmp_path / "x"))
    assert r.returncode == 2 and "does not go with --session" in r.stderr and "Traceback" not in r.stderr


def _suite_prints_a_command_that_locates(tmp_path, engine: str, k: str, command: str, expect: str) -> None:
    """The golden suite on a planted engine fails, its message holds ``command`` (a regex), and that command
    names the planted node layers.1/up_proj."""
    import re

    env = {**os.environ, "PYTHONPATH": PYPATH, "PLANTED_NODE": "layers.1/up_proj"}
    r = subprocess.run([sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "--pyargs",
                        "lockstep.conformance.golden", "--engines", f"planted_engines:{engine}", "-k", k, "-q", "-n", "0"],
                       capture_output=True, text=True, cwd=tmp_path, timeout=300, env=env)
    assert "1 failed" in r.stdout and expect in r.stdout, r.stdout[-3000:]
    m = re.search(command, r.stdout)
    assert m, r.stdout[-3000:]
    r = _cli(*m.group(1).split()[2:], "--format", "json", "-q", env={"PLANTED_NODE": "layers.1/up_proj"})
    assert r.returncode == 1, r.stderr
    assert json.loads(r.stdout)["first_divergent_node"]["name"] == "layers.1/up_proj"


def test_a_capture_identity_failure_names_the_command_that_locates_its_node(tmp_path):
    """The golden capture on/off check fails on a capture-only bug, names `lockstep locate ... --session capture`,
    and that command names the planted node."""
    _suite_prints_a_command_that_locates(
        tmp_path, "make_capture_matmul_scale", "test_capture_on_off_byte_identity and tiny-fp32-standard]",
        r"locate the node: (lockstep locate tiny-fp32-standard --position \d+ --engine "
        r"planted_engines:make_capture_matmul_scale --session capture)", "diverge at step")


def test_a_decode_session_bug_is_named_by_its_lock_and_located_by_the_command_it_prints(tmp_path):
    """A bug of the engine's own decode session (prepare clean) breaks the stepwise lock; its message says no
    node leaves its band through prepare, names the node the session's step computes out of band (located
    in the failing test) and prints `--session eager`, which names it again."""
    _suite_prints_a_command_that_locates(
        tmp_path, "make_decode_matmul_scale", "test_teacher_forced_lock and tiny-fp32-standard-stepwise",
        r"decode session the first divergent node is layers\.1/up_proj \(MatMul\): (lockstep locate tiny-fp32-standard "
        r"--position \d+ --engine planted_engines:make_decode_matmul_scale --session eager)",
        "no node leaves its band through prepare")


def test_a_session_exposes_only_what_the_step_computes_from_its_data():
    """Values made from initializers, constants or the inputs' shapes alone are not exposed through a decode
    session (an engine folds them at load; ORT CUDA copies a folded output with a sync its graph capture refuses)."""
    # contract: on tiny-fp32-decomposed-kv64 the fixed-capacity past's Shape-derived values and constant-only
    # values are left out, every value the attention and MLP compute from the step's data is kept
    from lockstep.conformance.locate.graph import data_dependent

    s = subject("tiny-fp32-decomposed-kv64", position=20)
    g = s.model.graph
    dep = data_dependent(g)
    made = {o for n in g.node for o in n.output if o}
    shapes = {o for n in g.node if n.op_type in ("Shape", "Size", "Constant") for o in n.output}
    assert not (shapes & dep), "contract: shape and constant values are not the step's data"
    assert any(n.op_type == "MatMul" for n in g.node if n.output[0] in dep)
    assert {n.output[0] for n in g.node if n.op_type in ("MatMul", "Softmax")} <= dep, "contract: compute is kept"
    assert len(dep & made) < len(made)
