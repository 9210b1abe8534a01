"""Bad models and bad feeds at load time (issue 15): every failure is a named error, never a dead
process, a runaway allocation, or onnx's own exception escaping.

The loader is the same on every device (nothing touches the device before the model is checked);
the tests that build an ``Executor`` still take the ``device`` fixture, so the GPU lane runs them
on CuPy too."""

from __future__ import annotations

import os

import numpy as np
import onnx
import pytest
from lockstep import inference
from lockstep.reference_runtime import Runtime, RuntimeConfig
from lockstep.reference_runtime.executor import Executor, FeedError
from lockstep.loading import ModelError, UnsupportedModel, load_model
from lockstep.reference_runtime.symbols import symbolic_shapes
from onnx import TensorProto, helper


def _vi(name, elem=TensorProto.FLOAT, shape=(2, 3, 4)):
    return helper.make_tensor_value_info(name, elem, None if shape is None else list(shape))


def _golden_copy(name: str) -> onnx.ModelProto:
    """A copy of a builtin golden model to mutate: ``GoldenModel.load`` gives the process's cached
    object, which a test must never change (the next test of this worker would run the mutant)."""
    from lockstep.golden.catalog import builtin_models

    model = onnx.ModelProto()
    model.CopyFrom(next(m for m in builtin_models() if m.name == name).load())
    return model


def _decode_cli(model: onnx.ModelProto, tmp_path):
    """``lockstep decode`` of ``model`` (saved under ``tmp_path``) on ref-sim, as a user runs it."""
    import subprocess
    import sys

    path = tmp_path / "bad.onnx"
    onnx.save(model, path)
    return subprocess.run([sys.executable, "-m", "lockstep", "decode", str(path), "--engine", "ref-sim", "--prompt",
                           "hi", "--tokens", "3"], capture_output=True, text=True, timeout=120)


def _model(nodes, inputs, outputs, initializers=(), value_info=(), opset=21):
    g = helper.make_graph(nodes, "g", inputs, outputs, initializer=list(initializers), value_info=list(value_info))
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", opset)], ir_version=10)


def _gathernd(batch_dims=-5):
    return _model([helper.make_node("GatherND", ["x", "i"], ["y"], name="gnd", batch_dims=batch_dims)],
                  [_vi("x"), _vi("i", TensorProto.INT64, (2, 1))], [_vi("y", shape=("a", "b"))])


def _layernorm(axis=2**31):
    return _model([helper.make_node("LayerNormalization", ["x", "s"], ["y", "m", "v"], name="ln", axis=axis)],
                  [_vi("x"), _vi("s", shape=(4,))], [_vi("y", shape=("a", "b", "c")), _vi("m", shape=("a", "b", "c")), _vi("v", shape=("a", "b", "c"))])


def _shape_tensor_declared_huge(dim=10**9):
    """Shape -> Add with the Shape's output declared 10**9 long: data propagation allocates it."""
    return _model([helper.make_node("Shape", ["x"], ["s"]), helper.make_node("Add", ["s", "s"], ["y"])],
                  [_vi("x", shape=("a",))], [_vi("y", TensorProto.INT64, ("n",))],
                  value_info=[_vi("s", TensorProto.INT64, (dim,))])


def test_text_that_is_not_utf8_is_a_model_error_naming_the_field(tmp_path):
    """protobuf hands ONNX's invalid UTF-8 strings back as bytes, which raise wherever they are next
    used (a fuzzer's flipped byte in the graph's name crashed the inference worker's copy)."""
    data = bytearray(_model([helper.make_node("Relu", ["x"], ["y"])], [_vi("x")], [_vi("y")]).SerializeToString())
    at = data.index(b"\x12\x01g") + 2  # the graph's name, "g"
    data[at] = 0xE9
    (tmp_path / "m.onnx").write_bytes(bytes(data))
    with pytest.raises(ModelError, match=r"m\.onnx: model\.graph\.name: text b'\\xe9' is not valid UTF-8"):
        load_model(tmp_path / "m.onnx")


@pytest.fixture
def runtime(device):
    return Runtime(device, RuntimeConfig())


# -- 1. shape inference cannot kill or exhaust the process -----------------------------------------

@pytest.mark.parametrize("model, attribute", [(_gathernd(), "'batch_dims' is -5; allowed: 0..1024"),
                                              (_layernorm(), "'axis' is 2147483648; allowed: -1024..1024")],
                         ids=["gathernd", "layernorm"])
def test_attributes_that_crash_onnx_shape_inference_are_refused_by_name(runtime, model, attribute):
    """These two segfaulted onnx's inference inside Executor.__init__ (the process died)."""
    with pytest.raises(ModelError, match=rf"node '(gnd|ln)' \((GatherND|LayerNormalization)\): attribute {attribute}"):
        Executor(model, runtime)


def test_a_split_into_two_billion_outputs_is_refused_by_name(runtime):
    """Split num_outputs=2**31 made onnx's inference allocate past its memory budget."""
    m = _model([helper.make_node("Split", ["x"], ["a", "b"], name="split", axis=0, num_outputs=2**31)],
               [_vi("x", shape=(4,))], [_vi("a", shape=(2,)), _vi("b", shape=(2,))], opset=18)
    with pytest.raises(ModelError, match=r"node 'split' \(Split\): attribute 'num_outputs' is 2147483648; allowed: 1..65536"):
        Executor(m, runtime)


@pytest.mark.parametrize("model", [_gathernd(), _layernorm()], ids=["gathernd", "layernorm"])
def test_an_inference_crash_past_the_checks_is_contained(monkeypatch, model):
    """Without the pre-check the crash happens, in the worker child, and is a ModelError here. What
    onnx's inference does with these attributes is undefined: it reads past its buffers and either
    segfaults or asks for an absurd allocation, depending on the heap the worker inherited at its
    fork (the order tests ran in); both end the child and are contained."""
    if not hasattr(os, "fork"):
        pytest.fail("this platform has no fork: inference runs in-process and this test cannot check containment")
    monkeypatch.setattr(inference, "check_for_inference", lambda m: None)
    with pytest.raises(ModelError, match=r"onnx shape inference (crashed on this model \(SIGSEGV\)|needed more than \d+ MiB)"):
        symbolic_shapes(model)
    assert symbolic_shapes(_layernorm(axis=-1))[1]["y"] == (2, 3, 4), "a fresh worker serves the next model"


def test_a_huge_declared_dim_is_dropped_before_inference(runtime):
    """A value_info dim of 10**9 made data propagation grow past 4 GB (24 GB once): it is unknown now."""
    ex = Executor(_shape_tensor_declared_huge(), runtime)
    assert ex.symbolic_shapes["s"] == (1,)  # inferred from x's rank, not the declaration


def test_an_inference_that_runs_away_is_stopped_by_its_memory_budget(monkeypatch):
    """Past the dim cap (raised here), the child's address-space limit stops it: a ModelError."""
    if not hasattr(os, "fork"):
        pytest.fail("this platform has no fork: inference runs in-process and this test cannot check containment")
    monkeypatch.setattr(inference, "DIM_CAP", 1 << 40)
    monkeypatch.setattr(inference, "MEMORY_BUDGET", 512 << 20)
    with pytest.raises(ModelError, match="onnx shape inference needed more than 512 MiB"):
        symbolic_shapes(_shape_tensor_declared_huge())


def _sleep_forever(data):
    import time

    time.sleep(600)


def test_an_inference_that_hangs_is_stopped_by_its_timeout(monkeypatch):
    """A hang in onnx's inference (none is known; the fuzzer found one elsewhere) ends in a ModelError."""
    if not hasattr(os, "fork"):
        pytest.fail("this platform has no fork: inference runs in-process and this test cannot check containment")
    monkeypatch.setattr(inference, "_WORKER", None)  # a fresh worker, forked with the sleeping inference
    monkeypatch.setattr(inference, "_run_inference", _sleep_forever)
    monkeypatch.setattr(inference, "TIMEOUT_S", 1.0)
    monkeypatch.setattr(inference, "_CACHE", type(inference._CACHE)())
    with pytest.raises(ModelError, match=r"onnx shape inference did not finish within 1 s on this model"):
        symbolic_shapes(_layernorm(axis=-1))
    assert inference._WORKER is None, "the hung worker was killed; the next model forks a fresh one"


def test_the_inference_cache_drops_the_least_recently_used_past_its_entries_or_bytes(monkeypatch):
    """Contract: the cache of inferred shapes is bounded by entries and by bytes, dropping the least
    recently used first and always keeping the newest."""
    monkeypatch.setattr(inference, "_CACHE", type(inference._CACHE)())
    monkeypatch.setattr(inference, "_CACHE_SIZE", 3)
    monkeypatch.setattr(inference, "_CACHE_BYTES", 10)
    for k in b"abc":
        inference._remember(bytes([k]), b"12")
    inference._remember(b"d", None)  # an uninferable model is remembered too (0 bytes)
    assert list(inference._CACHE) == [b"b", b"c", b"d"], "contract: past 3 entries, the oldest goes"
    inference._remember(b"e", b"123456789")
    assert list(inference._CACHE) == [b"d", b"e"], "contract: past 10 bytes, the oldest go until it fits"
    inference._remember(b"f", b"x" * 50)
    assert list(inference._CACHE) == [b"f"], "contract: the newest stays even past the byte bound"


# -- 2. loader failures are ModelError naming file, tensor and reason -------------------------------

def _external_model(tmp_path, entries, dims=(4,)):
    data = np.arange(4, dtype=np.float32).tobytes()
    w = TensorProto(name="w", data_type=TensorProto.FLOAT, dims=list(dims), data_location=TensorProto.EXTERNAL)
    for key, value in entries.items():
        e = w.external_data.add()
        e.key, e.value = key, value
    m = _model([helper.make_node("Identity", ["w"], ["y"])], [], [_vi("y", shape=dims)], [w])
    path = tmp_path / "m.onnx"
    path.write_bytes(m.SerializeToString())
    (tmp_path / "w.bin").write_bytes(data)
    return path


@pytest.mark.parametrize("entries, reason", [
    ({"location": "w.bin", "offset": "8"}, r"external data offset 8 \+ length 16 lies beyond the end of w.bin \(16 bytes\)"),
    ({"location": "w.bin", "length": "64"}, r"external data length 64 bytes, dims \[4\] need 16"),
    ({"location": "w.bin", "offset": "-4"}, "external data offset -4 is negative"),
    ({"location": "w.bin", "length": "lots"}, "external data length 'lots' is not a number"),
    ({"location": "w\0.bin"}, "external data location 'w\\\\x00.bin' is empty or holds a NUL byte"),
    ({"location": "nothere.bin"}, "external data file .*nothere.bin does not exist"),
], ids=["beyond-the-file", "length-mismatch", "negative", "non-numeric", "nul", "missing"])
def test_bad_external_data_is_a_model_error_naming_file_and_tensor(tmp_path, runtime, entries, reason):
    path = _external_model(tmp_path, entries)
    with pytest.raises(ModelError, match=rf"^{path!s}: initializer 'w': {reason}"):
        Executor(str(path), runtime)


def test_external_data_loads_from_inside_the_folder(tmp_path, runtime):
    path = _external_model(tmp_path, {"location": "w.bin", "offset": "0", "length": "16"})
    assert np.array_equal(Executor(str(path), runtime).run({})["y"], np.arange(4, dtype=np.float32))


def test_a_symlink_out_of_the_model_folder_is_refused(tmp_path, runtime):
    folder = tmp_path / "model"
    folder.mkdir()
    path = _external_model(folder, {"location": "link.bin"})
    (tmp_path / "secret.bin").write_bytes(np.ones(4, np.float32).tobytes())
    (folder / "link.bin").symlink_to(tmp_path / "secret.bin")
    with pytest.raises(ModelError, match=r"initializer 'w': external data 'link.bin' points outside the model folder"):
        Executor(str(path), runtime)


def test_external_data_on_a_constant_attribute_is_refused(tmp_path, runtime):
    t = TensorProto(name="c", data_type=TensorProto.FLOAT, dims=[4], data_location=TensorProto.EXTERNAL)
    e = t.external_data.add()
    e.key, e.value = "location", "w.bin"
    m = _model([helper.make_node("Constant", [], ["y"], name="k", value=t)], [], [_vi("y", shape=(4,))])
    (tmp_path / "w.bin").write_bytes(np.ones(4, np.float32).tobytes())
    (tmp_path / "m.onnx").write_bytes(m.SerializeToString())
    with pytest.raises(ModelError, match=r"node 'k' \(Constant\) attribute 'value': external data is allowed on "
                                         r"the graph's initializers only"):
        Executor(str(tmp_path / "m.onnx"), runtime)


@pytest.mark.parametrize("tensor, reason", [
    (TensorProto(name="w", data_type=TensorProto.FLOAT, dims=[3, 4], raw_data=np.zeros(5, np.float32).tobytes()),
     r"initializer 'w': dims \[3, 4\] need 48 bytes, the data has 20"),
    (TensorProto(name="w", data_type=TensorProto.INT64, dims=[6], int64_data=[1, 2, 3]), r"initializer 'w': dims \[6\] need 6 values in int64_data, the data has 3"),
    (TensorProto(name="w", data_type=77, dims=[1], raw_data=b"\0"), "initializer 'w': unknown data type 77"),
    (TensorProto(name="w", data_type=0, dims=[1], raw_data=b"\0"), "initializer 'w': data type is UNDEFINED"),
], ids=["raw-too-short", "typed-too-short", "unknown-type", "undefined-type"])
def test_initializer_data_that_does_not_match_its_dims_is_a_model_error(runtime, tensor, reason):
    m = _model([helper.make_node("Identity", ["w"], ["y"])], [], [_vi("y", shape=("n",))], [tensor])
    with pytest.raises(ModelError, match=reason):
        Executor(m, runtime)


def test_an_opset_newer_than_onnx_knows_is_unsupported(runtime):
    m = _model([helper.make_node("Relu", ["x"], ["y"])], [_vi("x")], [_vi("y")], opset=99)
    with pytest.raises(UnsupportedModel, match=r"imports opsets newer than this runtime knows: ai.onnx 99 \(newest known: \d+\)"):
        Executor(m, runtime)


def test_a_valid_model_with_every_tensor_form_still_loads(runtime):
    """The new tensor checks accept what onnx writes: raw, typed, packed int4, string-free."""
    ints = helper.make_tensor("k", TensorProto.INT64, [2], [1, 2])
    raw = helper.make_tensor("w", TensorProto.FLOAT, [2], np.ones(2, np.float32).tobytes(), raw=True)
    int4 = helper.make_tensor("q", TensorProto.INT4, [3], [1, -2, 3])
    m = _model([helper.make_node("Identity", ["w"], ["y"])], [], [_vi("y", shape=(2,))], [ints, raw, int4])
    load_model(m)
    assert Executor(m, runtime).run({})["y"].tolist() == [1.0, 1.0]


def _weights_model():
    w = helper.make_tensor("w", TensorProto.FLOAT, [3, 4], np.arange(12, dtype=np.float32).tobytes(), raw=True)
    return _model([helper.make_node("Relu", ["w"], ["y"], name="r")], [], [_vi("y", shape=(3, 4))], [w])


@pytest.mark.contract("load_model.validated_once")
def test_a_model_validated_once_is_not_checked_again_but_a_changed_one_is(monkeypatch):
    """load_model skips its checks only for a model whose skeleton (all of it but its weights' bytes)
    it validated before: the same model opened by many tests is checked once, and any change a check
    could see (a node, an attribute, an initializer's dims or data length) is checked again."""
    import onnx

    calls = []
    real = onnx.checker.check_model
    monkeypatch.setattr(onnx.checker, "check_model", lambda m, *a, **k: (calls.append(1), real(m, *a, **k))[1])
    m = _weights_model()
    load_model(m)
    load_model(m)
    assert len(calls) == 1, "contract: validated once"
    m.graph.initializer[0].raw_data = np.ones(12, np.float32).tobytes()  # other bytes, same length
    load_model(m)
    assert len(calls) == 1, "contract: the weights' bytes are not what the checks read"
    m.graph.node[0].attribute.extend([helper.make_attribute("axis", 2**31)])  # an attribute Relu has not
    with pytest.raises(ModelError, match="Unrecognized attribute: axis for operator Relu"):
        load_model(m)
    del m.graph.node[0].attribute[:]
    m.graph.initializer[0].dims[:] = [4, 4]  # the data no longer matches the dims
    with pytest.raises(ModelError, match=r"initializer 'w': dims \[4, 4\] need 64 bytes, the data has 48"):
        load_model(m)
    m.graph.initializer[0].dims[:] = [3, 4]
    m.graph.initializer[0].raw_data = b"\0" * 20  # the same dims, the data shorter
    with pytest.raises(ModelError, match=r"dims \[3, 4\] need 48 bytes, the data has 20"):
        load_model(m)


def test_a_model_file_is_checked_from_its_bytes(tmp_path, monkeypatch):
    """A model file's own bytes go to onnx.checker (the model is not serialised again to check it)."""
    import onnx

    seen = []
    real = onnx.checker.check_model
    monkeypatch.setattr(onnx.checker, "check_model", lambda m, *a, **k: (seen.append(type(m)), real(m, *a, **k))[1])
    m = _weights_model()
    m.graph.name = "from-file"  # not validated before in this process
    (tmp_path / "m.onnx").write_bytes(m.SerializeToString())
    model, base = load_model(tmp_path / "m.onnx")
    assert seen == [bytes] and base == str(tmp_path) and model.graph.name == "from-file"


# -- 3. feeds ----------------------------------------------------------------------------------------

def test_feed_names_that_are_not_strings_are_a_feed_error(runtime):
    ex = Executor(_model([helper.make_node("Relu", ["x"], ["y"])], [_vi("x")], [_vi("y")]), runtime)
    with pytest.raises(FeedError, match=r"feed names must be strings, got \[0\]; the model's inputs are \['x'\]"):
        ex.run({0: np.zeros((2, 3, 4), np.float32)})


def test_an_empty_prompt_is_a_step_error_on_every_session():
    """An empty prompt was an IndexError (the prefill's logits were empty) on a fixed-capacity model."""
    from lockstep.golden.catalog import builtin_models

    from lockstep.decoder_io import StepError
    from lockstep.decoding import greedy, open_session, teacher_force
    from lockstep.engines.registry import load_engine

    gm = next(m for m in builtin_models() if m.name == "tiny-fp32-standard-kv64")
    session = open_session(load_engine("ref-sim"), gm.load())
    with pytest.raises(StepError, match="greedy decode needs a prompt of at least one token, got none"):
        greedy(session, [], 2)
    with pytest.raises(StepError, match="teacher forcing needs a context of at least one token"):
        teacher_force(session, [], stepwise=True)
    with pytest.raises(StepError, match="a decode step needs at least one token, got 0"):
        session.forward([])


# -- ONNX Runtime's own refusals ---------------------------------------------------------------------

def test_onnx_runtime_refusing_a_model_is_a_model_error_naming_the_engine():
    """InvalidGraph / Fail at session creation escaped as onnxruntime's own exception classes."""
    from lockstep.engines.registry import load_engine

    engine = load_engine("ort-cpu")
    ok, why = engine.available()
    if not ok:
        pytest.skip(f"ort-cpu unavailable here: {why}")
    m = _model([helper.make_node("Add", ["a", "b"], ["y"], name="add")],
               [_vi("a", TensorProto.BFLOAT16, (2,)), _vi("b", TensorProto.FLOAT, (2,))], [_vi("y", shape=(2,))])
    m.ir_version = 8
    load_model(m)  # onnx's checker takes it
    with pytest.raises(ModelError, match=r"^ort-cpu refuses the model: Fail: .*bound to different types .*\(add\)"):
        engine.prepare(m)


# -- killed writes (snapshots, manifests, caches go through lockstep.paths.atomic_write) -------------

def _killed_write(folder, name):
    """A child process killed (SIGKILL) in the middle of ``atomic_write``: what it leaves behind."""
    import subprocess
    import sys

    code = ("import os, signal, sys; from lockstep.paths import atomic_write\n"
            "def die(f):\n    f.write(b'half'); f.flush(); os.kill(os.getpid(), signal.SIGKILL)\n"
            "atomic_write(sys.argv[1], die)\n")
    proc = subprocess.run([sys.executable, "-c", code, str(folder / name)], check=False, timeout=60)
    assert proc.returncode == -9
    return sorted(p.name for p in folder.iterdir())


def test_a_killed_write_leaves_an_ignored_temporary_that_the_next_write_removes(tmp_path):
    import subprocess
    from pathlib import Path

    from lockstep.golden.anchors import write_snapshot

    (tmp_path / "m.json").write_text("old")
    left = _killed_write(tmp_path, "m.json")
    temps = [n for n in left if n != "m.json"]
    assert len(temps) == 1 and temps[0].startswith(".m.json.") and temps[0].endswith(".lockstep-tmp"), left
    assert (tmp_path / "m.json").read_text() == "old", "the old file survives the killed write"
    repo = Path(__file__).resolve().parents[1]
    ignored = subprocess.run(["git", "-C", str(repo), "check-ignore", "-q", "--no-index",
                              f"golden/snapshots/{temps[0]}"], check=False)
    assert ignored.returncode == 0, "git ignores the temporary files in golden/snapshots/"
    write_snapshot({"model": "other", "provenance": {}, "prompt": "", "prefix": [], "band": 0, "positions": []},
                   tmp_path)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m.json", "other.json"], "the stale temporary is gone"


def test_a_temporary_of_a_live_writer_is_kept(tmp_path):
    import os

    from lockstep.paths import atomic_write

    live = tmp_path / f".a.json.{os.getppid()}.x1y2.lockstep-tmp"  # our parent: alive while we run
    live.write_bytes(b"in progress")
    atomic_write(tmp_path / "b.json", "{}")
    assert live.exists()


def test_a_rewritten_file_keeps_its_mode_and_a_new_one_is_0644_under_the_umask(tmp_path):
    import os
    import stat

    from lockstep.golden.anchors import write_snapshot

    from lockstep.paths import atomic_write

    kept = tmp_path / "shared.json"
    kept.write_text("{}")
    kept.chmod(0o664)
    atomic_write(kept, "{}\n")
    assert stat.S_IMODE(kept.stat().st_mode) == 0o664
    old = os.umask(0o022)
    try:
        path = write_snapshot({"model": "fresh", "provenance": {}, "prompt": "", "prefix": [], "band": 0,
                               "positions": []}, tmp_path)
        os.umask(0o077)
        private = atomic_write(tmp_path / "private.json", "{}")
    finally:
        os.umask(old)
    assert stat.S_IMODE(path.stat().st_mode) == 0o644, "snapshots were rewritten 0600 by mkstemp"
    assert stat.S_IMODE(private.stat().st_mode) == 0o600


@pytest.mark.parametrize("bad", [-3, 1000])
def test_a_present_of_a_type_onnx_does_not_know_is_named_not_a_keyerror(tmp_path, bad):
    """result (issue 55, a crash back since the declared-shape checks): small-fp32-standard with one
    present's elem_type set outside onnx's table is refused in one line naming the present and the
    code, by the library and by `lockstep decode`; no KeyError, no traceback."""
    import subprocess
    import sys

    from lockstep.decoder_io import DecoderIO, NotADecoder

    model = _golden_copy("small-fp32-standard")
    out = next(o for o in model.graph.output if o.name.startswith("present"))
    out.type.tensor_type.elem_type = bad
    with pytest.raises(NotADecoder, match=rf"{out.name} is elem_type {bad} \(not an ONNX type\)"):
        DecoderIO.of(model)
    path = tmp_path / "bad.onnx"
    onnx.save(model, path)
    r = subprocess.run([sys.executable, "-m", "lockstep", "decode", str(path), "--engine", "ref-sim", "--prompt", "hi"],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode != 0 and "Traceback" not in r.stderr and len(r.stderr.strip().splitlines()) == 1, r.stderr
    assert f"elem_type {bad} (not an ONNX type)" in r.stderr


def test_not_a_decoder_names_a_few_inputs_not_hundreds():
    """result: a model of 300 inputs that is no decoder is refused in a message of a few hundred
    characters (the first 8 inputs and how many more), not one of every input (10 KB on a large model)."""
    from lockstep.decoder_io import DecoderIO, NotADecoder
    from onnx import TensorProto, helper

    ins = [helper.make_tensor_value_info(f"x{i}", TensorProto.FLOAT, [1]) for i in range(300)]
    g = helper.make_graph([helper.make_node("Identity", ["x0"], ["y"])], "g", ins,
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1])])
    with pytest.raises(NotADecoder) as info:
        DecoderIO.of(helper.make_model(g, opset_imports=[helper.make_opsetid("", 21)]))
    assert "x7 [1] and 292 more" in str(info.value) and len(str(info.value)) < 800


def test_type_name_never_raises():
    """contract: the one helper messages format a user's elem_type with."""
    from lockstep.errors import type_name

    assert type_name(1) == "FLOAT" and type_name(0) == "untyped"
    assert type_name(-3) == "elem_type -3 (not an ONNX type)" and "not an ONNX type" in type_name("x")


def test_a_value_info_of_another_type_than_its_node_makes_is_a_model_error_at_load(tmp_path):
    """result (issue 55): tiny-fp16-decomposed with an intermediate declared INT8[0] (its Reshape makes
    float16 of rank 4) is refused when the reference runtime loads it, naming the value, the declaration
    and what its node makes (lockstep.inference.infer, which the reference runtime's plan reads); before,
    the first decode steps ran and the plan raised IllegalState."""

    model = _golden_copy("tiny-fp16-decomposed")
    node = next(n for n in model.graph.node if n.op_type == "Reshape")
    model.graph.value_info.append(helper.make_tensor_value_info(node.output[0], TensorProto.INT8, [0]))
    want = rf"value_info '{node.output[0]}' declares INT8\[0\] but node .* \(Reshape\) makes FLOAT16"
    with pytest.raises(ModelError, match=want):
        inference.infer(model)
    r = _decode_cli(model, tmp_path)
    assert r.returncode != 0 and "Traceback" not in r.stderr and "declares INT8[0]" in r.stderr, r.stderr


def test_a_constant_declared_a_scalar_as_genai_s_builder_writes_it_is_read_as_what_it_makes():
    """contract (no false rejection): a 1-D Constant declared a scalar (every Constant of ONNX Runtime
    GenAI's builder) loads; its value_info is replaced by the inferred shape, not trusted."""
    from lockstep import inference

    c = helper.make_node("Constant", [], ["shape"], value=helper.make_tensor("v", TensorProto.INT64, [2], [2, 3]))
    g = helper.make_graph([c, helper.make_node("Reshape", ["x", "shape"], ["y"])], "g",
                          [helper.make_tensor_value_info("x", TensorProto.FLOAT, [6])],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, 3])],
                          value_info=[helper.make_tensor_value_info("shape", TensorProto.INT64, [])])
    model = helper.make_model(g, opset_imports=[helper.make_opsetid("", 21)])
    got = {vi.name: vi for vi in inference.infer(model).graph.value_info}
    assert [d.dim_value for d in got["shape"].type.tensor_type.shape.dim] == [2]


def test_the_reference_runtime_names_a_contradicting_value_info_when_it_loads_the_model():
    """result (the fuzzer's value_info_contradict, where ONNX Runtime refuses at load): a golden model
    with an intermediate declared DOUBLE scalar is refused by ref-sim's prepare, not run as if nothing
    were declared (or failing steps later)."""
    from lockstep.engines import load_engine

    model = _golden_copy("tiny-neartie-fp32-standard")
    model.graph.value_info.append(helper.make_tensor_value_info("layers.0/attention_merged", TensorProto.DOUBLE, []))
    with pytest.raises(ModelError, match=r"'layers.0/attention_merged' declares DOUBLE\[\] but node .* makes FLOAT"):
        load_engine("ref-sim").prepare(model)


@pytest.mark.parametrize("names", [("past_key_values.0.key", "present.0.key"), ("logits",), ("input_ids",)])
def test_a_decoder_role_of_a_type_onnx_does_not_know_is_named_with_its_value(tmp_path, names):
    """result (issue 55): where the present's type agrees with its past's (both -3), or the logits or
    input_ids are of a code outside onnx's table, the ModelError names the value and the code (was
    'unsupported tensor element type -3', naming no value); `lockstep decode` prints it in one line."""
    import subprocess
    import sys

    from lockstep.decoder_io import DecoderIO

    model = _golden_copy("small-fp32-standard")
    for vi in [*model.graph.input, *model.graph.output]:
        if vi.name in names:
            vi.type.tensor_type.elem_type = -3
    want = rf"{names[0]}: unsupported tensor element type: elem_type -3 \(not an ONNX type\)"
    with pytest.raises(ModelError, match=want):
        DecoderIO.of(model)
    if names[0] != "logits":
        return
    path = tmp_path / "bad.onnx"
    onnx.save(model, path)
    r = subprocess.run([sys.executable, "-m", "lockstep", "decode", str(path), "--engine", "ref-sim", "--prompt", "hi"],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode != 0 and "Traceback" not in r.stderr and len(r.stderr.strip().splitlines()) == 1, r.stderr
    assert "logits: unsupported tensor element type: elem_type -3 (not an ONNX type)" in r.stderr


@pytest.mark.parametrize("elem", [TensorProto.INT8, -3])
def test_a_value_info_contradicting_a_node_that_reads_a_graph_output_is_a_model_error(tmp_path, elem):
    """result (issue 55): tiny-fp16-decomposed's repeat-KV Unsqueeze reads present.0.key, a graph
    output no value_info types; its output declared INT8 (or a code outside onnx's table) escaped the
    declared-type check (the node's input type was unknown) and `lockstep decode` ended in the plan's
    IllegalState ('the step signature missed a shape'). Now a ModelError at load, in one line."""

    model = _golden_copy("tiny-fp16-decomposed")
    node = next(n for n in model.graph.node if n.op_type == "Unsqueeze" and "present.0.key" in n.input)
    model.graph.value_info.append(helper.make_tensor_value_info(node.output[0], elem, None))
    shown = "INT8" if elem == TensorProto.INT8 else r"elem_type -3 \(not an ONNX type\)"
    want = rf"value_info '{node.output[0]}' declares {shown} but node .* \(Unsqueeze\) makes FLOAT16"
    with pytest.raises(ModelError, match=want):
        inference.infer(model)
    r = _decode_cli(model, tmp_path)
    assert r.returncode != 0 and "Traceback" not in r.stderr and len(r.stderr.strip().splitlines()) == 1, r.stderr
    assert "IllegalState" not in r.stderr and f"value_info '{node.output[0]}' declares" in r.stderr, r.stderr
