"""ONNX Runtime GenAI as an engine (issue 30): ``ort-genai`` (CPU) and ``ort-genai-cuda``
(``lockstep/engines/ort_genai.py``).

Results: every fp32 builder export for the CPU (``golden/exports/genai/*-fp32-cpu``) decodes through
GenAI's Generator to transformers' own greedy ids, with lockstep's argmax and with GenAI's own greedy
search (``generate_next_token``); Mistral is the known exporter finding (strict xfail). Teacher-forced
logits (one prefill, and one token per ``append_tokens``) agree with ``ort-cpu``'s within 1e-4. The
suite's golden locks and tripwire hold on every builder export the catalog locks (fp32, fp16 and
int4, cpu and cuda graphs; the int4-cpu ones compute with int8 activations, as on ort-cpu, which their
MatMulNBits accuracy_level=4 allows and their bands cover), but Mistral.
Contracts: a model GenAI cannot run (no ``genai_config.json``, an in-memory ModelProto, a config of
another file, a single graph) is ``Unsupported`` with its reason; the CPU engine has no capture
(``Unsupported``); without ``onnxruntime_genai`` the engine is a visible skip with a reason, as is a
broken install (two ONNX Runtime distributions in one folder, an ONNX Runtime older than GenAI
requires); GenAI's errors inside ``lockstep decode`` are one line naming the model and the engine.

The ``*-cuda`` parameters run on a GPU with onnxruntime-genai-cuda (the GPU lane); here they are
skips with the reason. ``LOCKSTEP_REQUIRE_ENGINES=ort-genai-cuda`` makes that skip a failure.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import types
from pathlib import Path

import numpy as np
import onnx
import pytest

from lockstep.decoder_io import DecoderIO
from lockstep.decoding import first_divergence, greedy, open_session, teacher_force
from lockstep.engines import Unsupported
from lockstep.engines import ort_genai
from lockstep.engines.ort_genai import GenAIEngine
from lockstep.genai_config import card_for
from lockstep.model_source import SOURCE_KEY, mark_source, source_of
from lockstep.loading import load_model, tensor_to_numpy

ROOT = Path(__file__).resolve().parent.parent
EXPORTS_DIR = ROOT / "golden" / "exports"
MANIFEST = json.loads((EXPORTS_DIR / "manifest.json").read_text())
EXPORTS = {e["path"]: e for e in MANIFEST["exports"]}
BUILDER_FP32_CPU = sorted(p for p, e in EXPORTS.items()
                          if e["exporter"] == "genai" and e["precision"] == "fp32" and e["ep"] == "cpu")
FINDINGS = {
    "genai/mistral-fp32-cpu": "onnxruntime-genai 0.18.0's builder ignores Mistral's sliding_window (8): its graph "
                              "attends every key (transformers a window of 8), and its genai_config says "
                              "sliding_window window_size 8 with layers []; GenAI 0.18.0 then fails at position 24 "
                              "(present.0.key pre-allocated as {1,2,24,16}, computed {1,2,25,16}), as the manifest's "
                              "ort_genai_cpu_error records",
}
ENGINES = ["ort-genai", "ort-genai-cuda"]
LLAMA = "genai/llama-fp32-cpu"


def _engine(name: str) -> GenAIEngine:
    """The engine, or a skip with its reason (a failure when LOCKSTEP_REQUIRE_ENGINES names it)."""
    eng = GenAIEngine("cpu" if name == "ort-genai" else "cuda")
    ok, why = eng.available()
    if not ok:
        if name in os.environ.get("LOCKSTEP_REQUIRE_ENGINES", "").split(","):
            pytest.fail(f"{name} is required (LOCKSTEP_REQUIRE_ENGINES) but unavailable: {why}")
        pytest.skip(f"{name} unavailable: {why}")
    return eng


def _load(path: str):
    """(ModelProto marked with its file, DecoderIO from its card) of the export at ``path`` (the manifest's)."""
    model_path = EXPORTS_DIR / path / "model.onnx"
    model, _ = load_model(model_path)
    mark_source(model, model_path)
    return model, DecoderIO.of(model, card_for(model_path))


def _params(paths):
    out = []
    for p in paths:
        marks = [pytest.mark.xfail(reason=FINDINGS[p], strict=True)] if p in FINDINGS else []
        out += [pytest.param(p, e, marks=marks, id=f"{p}-{e}") for e in ENGINES]
    return out


# -- results ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("path,genai", _params(BUILDER_FP32_CPU))
def test_builder_exports_decode_to_transformers_greedy_ids(path, genai):
    # result: transformers' greedy decode of the same weights is the independent reference
    eng = _engine(genai)
    e = EXPORTS[path]
    model, io = _load(path)
    want = e["transformers_greedy_ids"]
    session = open_session(eng, model, io=io)
    got = greedy(session, e["prompt_ids"], len(want)).tokens
    first = next((i for i, (a, b) in enumerate(zip(got, want)) if a != b), None)
    assert first is None, f"{path} on {genai}: first difference at token {first}: {got} vs transformers {want}"
    native = session.native_greedy(e["prompt_ids"], len(want))
    assert native == got, f"result: GenAI's own greedy search (generate_next_token) agrees: {native} vs {got}"


@pytest.mark.parametrize("path", [p for p in BUILDER_FP32_CPU if p not in FINDINGS])
@pytest.mark.parametrize("stepwise", [False, True], ids=["prefill", "stepwise"])
def test_teacher_forced_logits_agree_with_ort_cpu(path, stepwise):
    # result: GenAI's Generator runs ONNX Runtime's CPU kernels: its logits over the prompt and transformers'
    # stream, as one append_tokens or one token per call, are ort-cpu's within 1e-4 (measured: 0 on five
    # architectures, <= 4.2e-6 stepwise on Gemma 2/3)
    from lockstep.engines.ort import OrtEngine

    eng = _engine("ort-genai")
    ort_cpu = OrtEngine("CPUExecutionProvider")
    ok, why = ort_cpu.available()
    if not ok:
        pytest.skip(f"ort-cpu unavailable: {why}")
    e = EXPORTS[path]
    model, io = _load(path)
    context = e["prompt_ids"] + e["transformers_greedy_ids"][:-1]
    got = teacher_force(open_session(eng, model, io=io), context, stepwise=stepwise)
    ref = teacher_force(open_session(ort_cpu, model, io=io), context, stepwise=stepwise)
    assert got.shape == ref.shape == (len(context), io.vocab)
    diff = float(np.max(np.abs(got.astype(np.float64) - ref.astype(np.float64))))
    assert diff <= 1e-4, f"result: ort-genai's teacher-forced logits of {path} are ort-cpu's within 1e-4: {diff:.3g}"


def _builder_snapshots() -> list[str]:
    from lockstep.golden.catalog import export_models

    return sorted(m.name for m in export_models() if m.name.startswith("genai-"))


LOCK_FINDINGS = {  # (snapshot, engine) -> reason: each a strict xfail
    **{("genai-mistral-fp32-cpu", e): FINDINGS["genai/mistral-fp32-cpu"] for e in ENGINES},
    # measured 2026-12-03: here (CPU) and on the H200 (ort-genai-cuda, ORT GenAI 0.18.0, ORT 1.31.1)
    **{(f"genai-{a}-fp16-cpu", e): "ORT GenAI 0.18.0 fails on the builder's fp16 CPU Gemma graphs (MultiHeadAttention, "
       "sliding layers): Concat repeat_kv output shape differs from the pre-allocated present" for a in ("gemma2", "gemma3")
       for e in ENGINES},
    **{(f"genai-gemma3-{p}-cuda", "ort-genai"): "GroupQueryAttention (CPU): q_norm_weight / k_norm_weight not supported "
       "(ONNX Runtime 1.31.1's CPU provider; its CUDA provider runs them)" for p in ("fp16", "int4")},
}


def _lock_params():
    out = []
    for name in _builder_snapshots():
        for e in ENGINES:
            finding = LOCK_FINDINGS.get((name, e))
            marks = [pytest.mark.xfail(reason=finding, strict=True)] if finding else []
            out.append(pytest.param(name, e, marks=marks, id=f"{name}-{e}"))
    return out


@pytest.mark.golden
@pytest.mark.parametrize("name,genai", _lock_params())
def test_golden_locks_of_the_builder_exports(name, genai, record_property):
    # result: the suite's own locks (oracle anchors, the precision's near-tie band; teacher forcing as one
    # prefill and token by token; the tripwire) on every builder export the catalog locks, run through GenAI
    # with the model marked with its file (the catalog's shared ModelProto carries no path: a private copy)
    from lockstep.engines import precision_of
    from lockstep.golden.catalog import export_models
    from lockstep.golden.locks import teacher_forced_lock, tripwire

    eng = _engine(genai)
    gm = next(m for m in export_models() if m.name == name)
    snap = gm.snapshot()
    gm.check_provenance(snap)
    model, _ = load_model(gm.model_path())
    mark_source(model, gm.model_path())
    io = gm.io(model)
    precision = precision_of(eng, gm.dtype)
    record_property("precision", precision)
    problems = []
    for stepwise in (False, True):
        res = teacher_forced_lock(open_session(eng, model, io=io), snap, precision, stepwise=stepwise)
        if res.checked == 0 or res.violations:
            problems.append(f"{'stepwise' if stepwise else 'prefill'}: {res.describe()}; {res.violations[:3]}")
    trip = tripwire(open_session(eng, model, io=io), snap, precision)
    if trip.fatal:
        problems.append(f"tripwire: {trip.divergence}")
    assert not problems, f"result: {genai} ({precision}) breaks the locks of {name}: " + " | ".join(problems)


def test_the_model_run_is_the_modelproto_handed_not_the_file():
    # contract: the engine runs the ModelProto it is given (og.Config.add_model_data); the folder gives only
    # the config. A ModelProto changed after loading (its lm_head doubled) gives doubled logits.
    from onnx import numpy_helper

    eng = _engine("ort-genai")
    model, io = _load(LLAMA)
    prompt = EXPORTS[LLAMA]["prompt_ids"]
    base = open_session(eng, model, io=io).forward(prompt)
    changed = onnx.ModelProto()
    changed.CopyFrom(model)
    (t,) = [t for t in changed.graph.initializer if t.name == "lm_head.MatMul.weight"]
    # (its weights stay in model.onnx.data, read through a map: lockstep.loading.tensor_to_numpy)
    t.CopyFrom(numpy_helper.from_array(tensor_to_numpy(t, str(source_of(model).parent)) * 2, t.name))
    assert source_of(changed) == source_of(model), "contract: a copy keeps its source"
    doubled = open_session(eng, changed, io=io).forward(prompt)
    np.testing.assert_allclose(doubled, 2 * base, rtol=1e-5, atol=1e-5)


def test_a_session_resets_and_reports_what_it_ran():
    eng = _engine("ort-genai")
    model, io = _load(LLAMA)
    session = open_session(eng, model, io=io)
    prompt = EXPORTS[LLAMA]["prompt_ids"]
    a = greedy(session, prompt, 6)
    b = greedy(session, prompt, 6)
    assert first_divergence(a, b) is None, "contract: reset starts a fresh context (same bytes twice)"
    assert a.counters["ort_genai"]["max_length"] == io.capacity == 128
    assert session.capture_stats().as_dict() == {"captures": 0, "replays": 0, "fallbacks": 0, "detail": {}}
    desc = eng.describe()
    assert desc["onnxruntime-genai"].startswith(ort_genai_version()) and desc["onnxruntime"]
    assert desc["provider"] == "cpu"


def ort_genai_version() -> str:
    import onnxruntime_genai as og

    return og.__version__


def test_a_context_past_the_shared_buffer_is_refused_before_genai_runs():
    from lockstep.decoder_io import ContextLimitExceeded

    eng = _engine("ort-genai")
    model, io = _load(LLAMA)
    session = open_session(eng, model, io=io)
    with pytest.raises(ContextLimitExceeded):
        session.forward([5] * (io.capacity + 1))


# -- capture ---------------------------------------------------------------------------------------
def test_the_cpu_engine_has_no_capture_and_says_so():
    # contract: capture on ort-genai is Unsupported with its reason (a counted skip in the suite), whatever
    # the model; the check needs no onnxruntime_genai
    model, io = _load(LLAMA)
    with pytest.raises(Unsupported, match="no graph capture on the CPU provider"):
        open_session(GenAIEngine("cpu"), model, capture=True, io=io)


# ORT's CUDA graphs replay a window-sized GroupQueryAttention cache wrong (docs/ort-cuda-findings.md F4): GenAI's
# own graphs on the builder's Gemma 2/3 CUDA exports leave its eager decode, as ort-cuda's do
_WINDOW_GRAPH = ("ONNX Runtime 1.31.1's CUDA graphs replay GroupQueryAttention sliding_window_cache=1 differently "
                 "from its eager run (F4): ORT GenAI 0.18.0's enable_cuda_graph diverges at the first replay")


@pytest.mark.capture
@pytest.mark.parametrize("path", ["genai/llama-fp16-cuda", "genai/llama-int4-cuda", *[
    pytest.param(f"genai/{a}-{p}-cuda", marks=pytest.mark.xfail(reason=_WINDOW_GRAPH, strict=True))
    for a in ("gemma2", "gemma3") for p in ("fp16", "int4")]])
def test_cuda_graphs_on_and_off_are_byte_identical(path):
    # result (GPU lane): GenAI's CUDA graphs (enable_cuda_graph, shared buffer) change no byte of the decode of
    # the builder's -e cuda exports (an -e cpu export keeps nodes on the CPU: Unsupported, the next test)
    eng = _engine("ort-genai-cuda")
    e = EXPORTS[path]
    model, io = _load(path)
    n = len(e["transformers_greedy_ids"])
    on = greedy(open_session(eng, model, capture=True, io=io), e["prompt_ids"], n)
    off = greedy(open_session(eng, model, capture=False, io=io), e["prompt_ids"], n)
    assert on.capture.captures >= 1 and on.capture.replays >= 1, on.capture
    assert off.capture.captures == 0 and off.capture.replays == 0, off.capture
    assert (div := first_divergence(on, off)) is None, f"result: capture on/off of {path} on ort-genai-cuda: {div}"
    if e["precision"] != "int4":  # int4 computes another function than transformers' fp32 weights
        want = e["transformers_greedy_ids"]
        assert on.tokens == want, f"{path}: {on.tokens} vs transformers {want}"


@pytest.mark.capture
def test_cuda_graphs_of_a_cpu_export_are_unsupported_with_the_reason():
    # result (GPU lane, ORT GenAI 0.18.0 with ORT 1.31.1: "This session cannot use the graph capture feature ...
    # all compute graph nodes have not been partitioned to the CUDAExecutionProvider"); contract: Unsupported
    eng = _engine("ort-genai-cuda")
    model, io = _load(LLAMA)
    with pytest.raises(Unsupported, match="need every node on the CUDA provider"):
        greedy(open_session(eng, model, capture=True, io=io), EXPORTS[LLAMA]["prompt_ids"], 2)


# -- what GenAI cannot run -------------------------------------------------------------------------
def test_a_model_without_genai_config_is_unsupported_with_its_reason(tmp_path):
    # contract: each case is Unsupported before GenAI is asked (no onnxruntime_genai needed), naming why
    eng = GenAIEngine("cpu")
    optimum = EXPORTS_DIR / "optimum" / "llama-fp32" / "model.onnx"
    model, _ = load_model(optimum)
    io = DecoderIO.of(model, card_for(optimum))
    with pytest.raises(Unsupported, match=r"an in-memory model: ORT GenAI runs a model folder .*lockstep\.source"):
        open_session(eng, model, io=io)  # nobody said where it came from
    mark_source(model, optimum)
    with pytest.raises(Unsupported) as info:
        open_session(eng, model, io=io)
    msg = str(info.value)
    assert msg.startswith("ort-genai: ") and str(optimum) in msg and "no genai_config.json beside it" in msg
    assert "\n" not in msg
    # a config beside the file that describes another file
    folder = tmp_path / "other"
    folder.mkdir()
    shutil.copy(EXPORTS_DIR / LLAMA / "genai_config.json", folder)
    shutil.copy(optimum, folder / "decoder.onnx")
    mark_source(model, folder / "decoder.onnx")
    with pytest.raises(Unsupported, match=r"genai_config.json describes model.onnx, not decoder.onnx"):
        eng.decoder(model, io=io)


def test_a_single_graph_is_unsupported():
    node = onnx.helper.make_node("Abs", ["x"], ["y"])
    graph = onnx.helper.make_graph([node], "g", [onnx.helper.make_tensor_value_info("x", onnx.TensorProto.FLOAT, [1])],
                                   [onnx.helper.make_tensor_value_info("y", onnx.TensorProto.FLOAT, [1])])
    with pytest.raises(Unsupported, match="runs whole decoders .* never a single graph"):
        GenAIEngine("cpu").prepare(onnx.helper.make_model(graph))


def test_mark_source_replaces_and_keeps_other_metadata(tmp_path):
    model = onnx.ModelProto()
    model.metadata_props.add(key="author", value="me")
    mark_source(model, "a/model.onnx")
    mark_source(model, tmp_path / "model.onnx")
    assert [(p.key, p.value) for p in model.metadata_props] == [("author", "me"),
                                                                (SOURCE_KEY, str(tmp_path / "model.onnx"))]
    assert source_of(model) == tmp_path / "model.onnx" and source_of(onnx.ModelProto()) is None


# -- without the package, or with a broken install -------------------------------------------------
def test_without_onnxruntime_genai_the_engine_is_a_reasoned_skip(monkeypatch):
    monkeypatch.setitem(sys.modules, "onnxruntime_genai", None)  # import raises ImportError
    for device in ("cpu", "cuda"):
        ok, why = GenAIEngine(device).available()
        assert not ok
        assert why.startswith("onnxruntime_genai is not installed (pip install 'lockstep-conformance[genai]'"), why


def test_without_onnxruntime_genai_the_suite_counts_a_skip(tmp_path):
    # contract: through lockstep's plugin, an engine whose package is missing is one counted skip per test
    # function with the reason (simulated: an onnxruntime_genai that fails to import comes first on the path)
    stub = tmp_path / "stub" / "onnxruntime_genai"
    stub.mkdir(parents=True)
    (stub / "__init__.py").write_text("raise ImportError('simulated: onnxruntime_genai is not installed')\n")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(stub.parent), os.environ.get("PYTHONPATH", "")])}
    env.pop("LOCKSTEP_REQUIRE_ENGINES", None)
    proc = subprocess.run([sys.executable, "-m", "pytest", str(ROOT / "conformance/node_suite/test_square_products.py"),
                           "--engines", "lockstep.engines.ort_genai:cpu_engine", "-q", "-rs", "-p", "no:cacheprovider"],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-3000:]
    assert "1 skipped" in out and "ort-genai: onnxruntime_genai is not installed" in out, out[-3000:]


def _fake_genai(monkeypatch, build="onnxruntime-genai", version="0.18.0"):
    import onnxruntime

    site = Path(onnxruntime.__file__).resolve().parent.parent
    fake = types.ModuleType("onnxruntime_genai")
    fake.__file__ = str(site / "onnxruntime_genai" / "__init__.py")
    fake.__version__, fake.__id__ = version, build
    fake.disable_telemetry_events = lambda: None
    monkeypatch.setitem(sys.modules, "onnxruntime_genai", fake)
    monkeypatch.delenv("ORT_LIB_PATH", raising=False)
    return site


def test_two_onnx_runtime_distributions_in_one_folder_are_named(monkeypatch):
    # what `pip install onnxruntime-genai` does beside the ort extra: it installs onnxruntime (1.32.0) over
    # onnxruntime-gpu 1.31.1's files (one import package), and pip check sees nothing wrong
    site = _fake_genai(monkeypatch)
    real = ort_genai._dists_in
    monkeypatch.setattr(ort_genai, "_dists_in", lambda where, names: (
        {"onnxruntime": "1.32.0", "onnxruntime-gpu": "1.31.1"} if "onnxruntime-gpu" in names else real(where, names)))
    ok, why = GenAIEngine("cpu").available()
    assert not ok
    assert why.startswith(f"onnxruntime 1.32.0 and onnxruntime-gpu 1.31.1 are both installed in {site}: they share the "
                          "onnxruntime import package"), why
    assert "pip install 'lockstep-conformance[genai]'" in why


def test_an_onnx_runtime_older_than_genai_requires_is_named(monkeypatch):
    # a later GenAI installed with --no-deps over the ort extra's ONNX Runtime 1.31
    import onnxruntime

    _fake_genai(monkeypatch, version="0.19.0")
    monkeypatch.setattr(ort_genai, "_dists_in", lambda where, names: {})
    monkeypatch.setattr(ort_genai, "_requires", lambda dist, site: ["numpy>=1.21.6", "onnxruntime>=1.32.0"])
    ok, why = GenAIEngine("cpu").available()
    assert not ok and why.startswith(f"onnxruntime-genai requires onnxruntime>=1.32.0 but onnxruntime "
                                     f"{onnxruntime.__version__} is installed"), why


def test_the_cpu_build_of_genai_has_no_cuda_engine(monkeypatch):
    _fake_genai(monkeypatch)
    monkeypatch.setattr(ort_genai, "_dists_in", lambda where, names: {})
    monkeypatch.setattr(ort_genai, "_requires", lambda dist, site: [])
    assert GenAIEngine("cpu").available()[0]
    ok, why = GenAIEngine("cuda").available()
    assert not ok
    assert why == "onnxruntime-genai 0.18.0 has no CUDA provider: ort-genai-cuda needs onnxruntime-genai-cuda", why


# -- lockstep decode -------------------------------------------------------------------------------
GENAI_SPEC = "lockstep.engines.ort_genai:cpu_engine"


def test_lockstep_decode_runs_a_builder_export_on_ort_genai(capfd):
    from lockstep.conformance.cli import main

    _engine("ort-genai")
    e = EXPORTS[LLAMA]
    assert main(["decode", str(EXPORTS_DIR / LLAMA / "model.onnx"), "--prompt", e["prompt_text"], "--tokens", "6",
                 "--engine", GENAI_SPEC]) == 0
    out = capfd.readouterr().out
    assert "engine: ort-genai" in out and f"tokens: {e['transformers_greedy_ids'][:6]}" in out, out


def _epsilon_broken(tmp_path) -> Path:
    """The llama export with every layer norm's epsilon -1: lockstep loads it; ONNX Runtime refuses it."""
    folder = tmp_path / "broken"
    folder.mkdir()
    model, _ = load_model(EXPORTS_DIR / LLAMA / "model.onnx")
    for n in model.graph.node:
        for a in n.attribute:
            if "LayerNorm" in n.op_type and a.name == "epsilon":
                a.f = -1.0
    onnx.save(model, folder / "model.onnx")
    # the weights stay external (load_model keeps them in their file): the data file goes beside it
    for f in ("model.onnx.data", "genai_config.json", "tokenizer.json", "tokenizer_config.json",
              "special_tokens_map.json"):
        shutil.copy(EXPORTS_DIR / LLAMA / f, folder)
    return folder / "model.onnx"


@pytest.mark.parametrize("genai", ["ort-genai", "ort-cpu"])
def test_runtime_errors_inside_lockstep_decode_are_one_line_naming_model_and_engine(tmp_path, capfd, genai):
    from lockstep.conformance.cli import main

    if genai == "ort-genai":
        _engine("ort-genai")
        spec = GENAI_SPEC
    else:
        from lockstep.engines.ort import OrtEngine

        if not OrtEngine("CPUExecutionProvider").available()[0]:
            pytest.skip("ort-cpu unavailable")
        spec = "ort-cpu"
    path = _epsilon_broken(tmp_path)
    assert main(["decode", str(path), "--prompt", "hi", "--tokens", "2", "--engine", spec]) == 2
    err = capfd.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and err.startswith("lockstep: error: "), err
    assert str(path) in err and f"{genai} " in err and "refuses the model" in err and "epsilon" in err, err


def _raising_engine(exc):
    class Raising:
        name = "raising"

        def available(self):
            return True, "here"

        def prepare(self, model):
            raise AssertionError("not used")

        def decoder(self, model, *, capture=False, io=None):
            raise exc

    return Raising()


def make_ort_raising():
    from onnxruntime.capi.onnxruntime_pybind11_state import RuntimeException

    return _raising_engine(RuntimeException("[ONNXRuntimeError] : 6 : RUNTIME_EXCEPTION : Exception during "
                                            "initialization: simulated"))


def make_genai_raising():
    return _raising_engine(ort_genai.GenAIError("ort-genai: ORT GenAI 0.18.0 fails at a decode step: CUDA failure 2: "
                                                "out of memory"))


def make_bug_raising():
    return _raising_engine(KeyError("a bug of lockstep's own"))


@pytest.mark.parametrize("factory, needle", [
    ("make_ort_raising", "RuntimeException: [ONNXRuntimeError] : 6 : RUNTIME_EXCEPTION"),
    ("make_genai_raising", "GenAIError: ort-genai: ORT GenAI 0.18.0 fails at a decode step: CUDA failure 2"),
])
def test_an_engine_runtime_failure_in_lockstep_decode_is_one_line(capfd, factory, needle):
    # contract: ONNX Runtime's own exception types (and ORT GenAI's GenAIError) that no named error covers
    # (a device failure ort-cpu/ort-cuda re-raise, an ORT status type outside the classified ones) are one
    # line naming model and engine, never a traceback
    pytest.importorskip("onnxruntime")
    from lockstep.conformance.cli import main

    path = EXPORTS_DIR / LLAMA / "model.onnx"
    assert main(["decode", str(path), "--prompt", "hi", "--tokens", "2", "--engine", f"{__name__}:{factory}"]) == 2
    err = capfd.readouterr().err.strip()
    assert err == f"lockstep: error: model.onnx on raising: {needle}" or (
        err.startswith("lockstep: error: model.onnx on raising: ") and needle in err and "\n" not in err), err


def test_a_bug_in_lockstep_decode_keeps_its_traceback():
    from lockstep.conformance.cli import main

    path = EXPORTS_DIR / LLAMA / "model.onnx"
    with pytest.raises(KeyError, match="a bug of lockstep's own"):
        main(["decode", str(path), "--prompt", "hi", "--tokens", "2", "--engine", f"{__name__}:make_bug_raising"])
