"""Models as files, not protos (issue 51): external data stays in its file from loading to the engines.

A model whose weights are external data (``model.onnx`` + ``model.onnx.data``, as ONNX Runtime
GenAI's builder writes one) is loaded without reading its weights (``lockstep.loading``), its
initializers read as read-only views of one memory map per file, uploaded to the simulated device
as copy-on-write maps of the file, and handed to ONNX Runtime as the graph's bytes plus the folder
of its weights: no proto holding the weights is ever serialised, so nothing is bounded by
protobuf's 2 GiB. The models here are small (a model past 2 GiB is a manual check: the issue
records it); what they check is that nothing on the way copies or serialises the weights.
"""

from __future__ import annotations

import mmap
import os
from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from lockstep import loading
from lockstep.loading import ModelError, file_range, load_model, tensor_to_numpy
from lockstep.model_source import SOURCE_KEY, file_of, source_of

# 1.25 MiB fp32 weights: past the simulated device's LAZY_POISON_MIN (1 MiB), and not a whole number of
# its 512-byte allocation unit (the allocation has a tail)
K, N = 513, 641


def _mlp(seed: int = 0, *, plain: bool = False) -> onnx.ModelProto:
    """y = relu(x @ W1 + b) @ W2, with a SimplifiedLayerNormalization (ONNX Runtime's default-domain op,
    hidden from onnx.checker by the loader) in front (``plain``: an Identity); W1 and W2 over 1 MiB each."""
    rng = np.random.default_rng(seed)
    w1 = (rng.standard_normal((K, N)) / np.sqrt(K)).astype(np.float32)
    w2 = (rng.standard_normal((N, K)) / np.sqrt(N)).astype(np.float32)
    b = rng.standard_normal(N).astype(np.float32)
    g = np.ones(K, np.float32)
    first = (helper.make_node("Identity", ["x"], ["xn"]) if plain else
             helper.make_node("SimplifiedLayerNormalization", ["x", "g"], ["xn"], axis=-1, epsilon=1e-6))
    nodes = [first,
             helper.make_node("MatMul", ["xn", "W1"], ["h"]), helper.make_node("Add", ["h", "b"], ["hb"]),
             helper.make_node("Relu", ["hb"], ["r"]), helper.make_node("MatMul", ["r", "W2"], ["y"])]
    graph = helper.make_graph(nodes, "mlp", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, K])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, K])],
                              [numpy_helper.from_array(a, n) for a, n in ((w1, "W1"), (w2, "W2"), (b, "b"), (g, "g"))
                               if not (plain and n == "g")])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21)], ir_version=10)


def _save_external(model: onnx.ModelProto, folder: Path, threshold: int = 0) -> Path:
    """``model`` saved as ``folder``/model.onnx + model.onnx.data (tensors of at least ``threshold``
    bytes there: GenAI's builder keeps small ones inline, and ONNX Runtime's shape inference cannot
    read a shape input that is external data)."""
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / "model.onnx"
    copy = onnx.ModelProto()
    copy.CopyFrom(model)
    onnx.save(copy, str(path), save_as_external_data=True, all_tensors_to_one_file=True,
              location="model.onnx.data", size_threshold=threshold)
    return path


def _feeds() -> dict[str, np.ndarray]:
    return {"x": np.random.default_rng(1).standard_normal((2, K)).astype(np.float32)}


def _file_map(a: np.ndarray):
    base = a
    while isinstance(base, (np.ndarray, memoryview)):
        base = base.base if isinstance(base, np.ndarray) else base.obj
    return base


# -- 1. loading keeps external data external --------------------------------------------------------

@pytest.mark.contract("loading.external_data_stays_external")
def test_load_model_keeps_external_data_in_its_file_and_marks_the_proto(tmp_path):
    """Contract: ``load_model(path)`` of a model with external data returns its initializers still
    external (no ``raw_data``: the weights are not read), the proto marked with its file (the folder
    engines find the weights in), and base_dir that folder; a marked proto loads again from there."""
    path = _save_external(_mlp(), tmp_path / "m")
    model, base = load_model(path)
    assert base == str(path.parent)
    for t in model.graph.initializer:
        assert t.data_location == TensorProto.EXTERNAL and not t.HasField("raw_data"), t.name
    assert source_of(model) == Path(os.path.abspath(path))
    again, base2 = load_model(model)  # the proto, as engines are handed it
    assert again is model and base2 == str(path.parent)
    assert file_of(model) == Path(os.path.abspath(path)), "an unchanged proto is still its file's"
    changed = onnx.ModelProto()
    changed.CopyFrom(model)
    changed.graph.node[-1].name = "renamed"
    assert file_of(changed) is None, "a changed copy is not the file's any more"


@pytest.mark.contract("loading.external_data_read_through_one_map_per_file")
def test_initializers_are_read_only_views_of_one_map_per_file(tmp_path):
    """Contract: ``tensor_to_numpy`` of an external initializer is a read-only view (no copy, owning
    no data) of a memory map of its file; every tensor of one file shares one map, kept for the
    process; the values are the saved ones."""
    src = _mlp()
    path = _save_external(src, tmp_path / "m")
    model, base = load_model(path)
    views = {t.name: tensor_to_numpy(t, base) for t in model.graph.initializer}
    maps = {id(_file_map(v)) for v in views.values()}
    assert len(maps) == 1 and isinstance(_file_map(views["W1"]), mmap.mmap), "one map for the file's tensors"
    for t in src.graph.initializer:
        v = views[t.name]
        assert not v.flags.owndata and not v.flags.writeable, t.name
        np.testing.assert_array_equal(v, numpy_helper.to_array(t))
        where = file_range(v)
        assert where is not None and where[0] == (path.parent / "model.onnx.data").resolve()
    again = tensor_to_numpy(model.graph.initializer[0], base)
    assert np.shares_memory(again, views[model.graph.initializer[0].name]), "the same map, not a new read"


@pytest.mark.contract("loading.external_data_checked_without_reading")
@pytest.mark.parametrize("damage, reason", [
    ("missing", r"external data file .*model.onnx.data does not exist"),
    ("truncated", r"external data offset \d+ \+ length \d+ lies beyond the end of model.onnx.data"),
    ("escape", r"external data '../outside.data' points outside the model folder"),
])
def test_bad_external_data_is_one_line_model_error_at_load_and_in_engines(tmp_path, damage, reason):
    """Contract: a missing data file, a truncated one, a location escaping the folder are one-line
    ``ModelError``s naming the tensor, from ``load_model`` (path or marked proto) and from an engine
    handed a proto whose files changed since it was loaded (ort-cpu checks before ONNX Runtime reads)."""
    path = _save_external(_mlp(), tmp_path / "m")
    model, _ = load_model(path)  # valid now
    data = path.parent / "model.onnx.data"
    if damage == "missing":
        data.unlink()
    elif damage == "truncated":
        with open(data, "r+b") as f:
            f.truncate(data.stat().st_size // 2)
    else:
        (tmp_path / "outside.data").write_bytes(data.read_bytes())
        for t in model.graph.initializer:
            for e in t.external_data:
                if e.key == "location":
                    e.value = "../outside.data"
    with pytest.raises(ModelError, match=reason) as info:
        load_model(model)
    assert "\n" not in str(info.value)
    if damage != "escape":
        with pytest.raises(ModelError, match=reason):
            load_model(path)
    from lockstep.engines.ort import cpu_engine

    with pytest.raises(ModelError, match=reason) as info:
        cpu_engine().prepare(model)
    assert "\n" not in str(info.value)


@pytest.mark.contract("loading.external_data_needs_a_folder")
def test_a_proto_with_external_data_and_no_file_is_refused_by_name(tmp_path):
    """Contract: external data in a proto that names no file (never marked, or the mark removed) is
    a ``ModelError`` at load and in ONNX Runtime's engine, never a read relative to the working directory."""
    path = _save_external(_mlp(), tmp_path / "m")
    bare = onnx.load(str(path), load_external_data=False)
    assert source_of(bare) is None
    with pytest.raises(ModelError, match="external data, but the model was not loaded from a file"):
        load_model(bare)
    from lockstep.engines.ort import cpu_engine

    with pytest.raises(ModelError, match=f"names no file to find them beside \\(metadata {SOURCE_KEY}"):
        cpu_engine().prepare(bare)


def test_a_model_file_without_external_data_is_not_marked(tmp_path):
    """Contract: a self-contained model file loads as before: weights in raw_data, no mark added."""
    path = tmp_path / "inline.onnx"
    onnx.save(_mlp(), str(path))
    model, _ = load_model(path)
    assert source_of(model) is None
    assert all(t.HasField("raw_data") for t in model.graph.initializer)


# -- 2. engines run it from the file, and as the inline model ---------------------------------------

@pytest.mark.contract("engines.external_data_runs_as_the_inline_model")
@pytest.mark.parametrize("engine", ["ref-sim", "ort-cpu"])
def test_engines_run_an_external_data_model_as_the_inline_one(tmp_path, engine):
    """Contract: ref-sim and ort-cpu give the external-data model exactly the outputs of the same
    model with its weights inline."""
    from lockstep.engines.ort import cpu_engine
    from lockstep.reference_runtime.engine import sim_engine

    make = {"ref-sim": sim_engine, "ort-cpu": cpu_engine}[engine]
    inline = _mlp()
    model, _ = load_model(_save_external(inline, tmp_path / "m"))
    want = make().prepare(inline)(_feeds())
    got = make().prepare(model)(_feeds())
    np.testing.assert_array_equal(got[0], want[0])


@pytest.mark.contract("engines.no_proto_with_weights_is_serialised")
def test_no_engine_serialises_the_weights(tmp_path, monkeypatch):
    """Contract: with protobuf's limit made 64 KiB, ort-cpu and ref-sim still run the external-data
    model (every proto serialised on the way is the graph's, not the weights'), while the same
    model inline is a one-line ``ModelError`` naming the limit, not protobuf's failure."""
    from lockstep.engines.ort import cpu_engine
    from lockstep.reference_runtime.engine import sim_engine

    limit = 64 << 10
    real = onnx.ModelProto.SerializeToString

    def guarded(self, *args, **kwargs):
        held = sum(len(t.raw_data) for t in self.graph.initializer)
        assert held <= limit, f"a proto holding {held} bytes of weights was serialised"
        return real(self, *args, **kwargs)

    inline = _mlp()
    model, _ = load_model(_save_external(inline, tmp_path / "m"))
    monkeypatch.setattr(loading, "PROTOBUF_LIMIT", limit)
    monkeypatch.setattr(onnx.ModelProto, "SerializeToString", guarded)
    want = _feeds()
    out_ort = cpu_engine().prepare(model)(want)
    out_ref = sim_engine().prepare(model)(want)
    np.testing.assert_allclose(out_ort[0], out_ref[0], rtol=1e-4, atol=1e-4)
    with pytest.raises(ModelError, match=r"^ort-cpu: the model holds 2,6\d\d,\d\d\d bytes of weights in memory, past "
                                         r"protobuf's limit of 65,536 bytes for a serialised model"):
        cpu_engine().prepare(inline)


@pytest.mark.contract("engines.a_rewritten_external_data_model_runs_as_rewritten")
def test_a_decoder_rewritten_after_loading_runs_its_rewrite_from_the_weights_file(tmp_path):
    """Contract: a growing-cache decoder with external data given a KV capacity (``open_session``
    rewrites a copy of the proto: ``DecoderIO.fixed_model``) decodes on ort-cpu and ref-sim the tokens
    and logits of the same decoder inline: the rewrite keeps its weights' locations resolvable."""
    from lockstep.decoding import DecoderIO, greedy, open_session
    from lockstep.engines.ort import cpu_engine
    from lockstep.paths import package_path
    from lockstep.reference_runtime.engine import sim_engine

    inline = onnx.load(str(package_path("lockstep.golden.models") / "tiny-fp32-standard.onnx"))
    model, _ = load_model(_save_external(inline, tmp_path / "m", threshold=1024))
    assert loading.has_external_data(model)
    card = {"kv_capacity": "32"}
    for make in (cpu_engine, sim_engine):
        runs = []
        for m in (inline, model):
            io = DecoderIO.of(m, card)
            runs.append(greedy(open_session(make(), m, io=io), [1, 2, 3], 4, io=io))
        assert runs[1].tokens == runs[0].tokens
        np.testing.assert_array_equal(np.asarray(runs[1].step_logits), np.asarray(runs[0].step_logits))


# -- 3. the simulated device maps the file, copy-on-write -------------------------------------------

def _maps_line(address: int) -> str:
    with open("/proc/self/maps") as f:
        for line in f:
            span, rest = line.split(" ", 1)
            lo, hi = (int(x, 16) for x in span.split("-"))
            if lo <= address < hi:
                return rest
    return ""


@pytest.mark.skipif(not os.path.exists("/proc/self/maps"), reason="reads /proc/self/maps (Linux)")
@pytest.mark.contract("sim.upload_of_a_file_constant_maps_the_file_copy_on_write")
def test_the_sim_uploads_a_file_constant_as_a_private_map_of_the_file(tmp_path):
    """Contract: on the simulated device, uploading an external initializer (a view of its file's
    map) into fresh memory makes that memory a private copy-on-write map of the file (the host's page
    cache, not a second copy); its bytes are the tensor's, the allocation's tail is poison, a write
    to the device memory changes neither the file nor the host view, and before the copy executes
    the memory reads as poison (the copy is still asynchronous)."""
    from lockstep.reference_runtime.backends.sim import POISON, SimDevice
    from lockstep.reference_runtime.backends._base import ArrayRef

    path = _save_external(_mlp(), tmp_path / "m")
    model, base = load_model(path)
    before = (path.parent / "model.onnx.data").read_bytes()
    dev = SimDevice(race_check=False)
    copy, other = dev.stream(), dev.stream()
    for name in ("W1", "W2"):  # (W2 starts where W1 ends: not on a page)
        w1 = tensor_to_numpy(next(t for t in model.graph.initializer if t.name == name), base)
        buf = dev.malloc(w1.nbytes)
        ref = ArrayRef(buf, w1.shape, w1.dtype)
        dev.memcpy_htod_async(ref, w1, copy)
        copy.synchronize()
        m = dev._maps[buf.addr]
        assert "model.onnx.data" in _maps_line(m.backing.__array_interface__["data"][0]), "a map of the file"
        np.testing.assert_array_equal(dev.memcpy_dtoh(ref, copy), w1)
        assert m.size > w1.nbytes and (m.backing[w1.nbytes:] == POISON).all(), "the tail is poison"
        dev._resolve_or_fault((buf.addr, w1.shape, w1.dtype), "test", copy)[...] = 7.0  # the device writes it
        assert (dev.memcpy_dtoh(ref, copy) == 7.0).all()
        assert (path.parent / "model.onnx.data").read_bytes() == before, "a device write never reaches the file"
        assert not (w1 == 7.0).any(), "nor the host's view of it"
    # the copy is asynchronous still: read on an unordered stream before it executes, the memory is poison
    late = dev.malloc(w1.nbytes)
    late_ref = ArrayRef(late, w1.shape, w1.dtype)
    dev.memcpy_htod_async(late_ref, w1, copy)
    early = dev.memcpy_dtoh(late_ref, other)
    assert early.view(np.uint8).min() == POISON == early.view(np.uint8).max()
    copy.synchronize()
    np.testing.assert_array_equal(dev.memcpy_dtoh(late_ref, copy), w1)


def test_the_sim_copies_into_memory_that_was_used_before(tmp_path):
    """Contract: an upload of a file constant into memory read or written before is a plain copy
    (the memory is not replaced under what it held)."""
    from lockstep.reference_runtime.backends.sim import SimDevice
    from lockstep.reference_runtime.backends._base import ArrayRef

    model, base = load_model(_save_external(_mlp(), tmp_path / "m"))
    w1 = tensor_to_numpy(next(t for t in model.graph.initializer if t.name == "W1"), base)
    dev = SimDevice()
    s = dev.stream()
    buf = dev.malloc(w1.nbytes)
    ref = ArrayRef(buf, w1.shape, w1.dtype)
    dev.memcpy_htod_async(ref, np.zeros(w1.shape, w1.dtype), s)
    s.synchronize()
    dev.memcpy_htod_async(ref, w1, s)
    np.testing.assert_array_equal(dev.memcpy_dtoh(ref, s), w1)
    assert file_range(dev._maps[buf.addr].backing) is None and dev._maps[buf.addr].backing.flags.owndata


@pytest.mark.contract("sim.file_constants_are_immutable_host_memory")
def test_a_view_of_a_read_only_file_map_is_taken_without_a_copy(tmp_path):
    """Contract: the simulated device takes an external initializer's view as immutable host memory
    (no copy at the call, as for raw_data's bytes); a writable array is still copied."""
    from lockstep.reference_runtime.backends import sim as sim_backend

    model, base = load_model(_save_external(_mlp(), tmp_path / "m"))
    w1 = tensor_to_numpy(model.graph.initializer[0], base)
    assert sim_backend._immutable(w1, w1.dtype)
    assert not sim_backend._immutable(np.array(w1), w1.dtype)


# -- 4. the runtimes that take files: nxrt, refusal probes ------------------------------------------

def test_refusal_probes_type_external_initializers_as_inputs(tmp_path):
    """Contract: a node probed alone (``refusal.alone``) gets an external initializer as a typed
    input, never as an external tensor the probe could not find."""
    from lockstep.engines.refusal import alone

    model, _ = load_model(_save_external(_mlp(plain=True), tmp_path / "m"))
    node = next(n for n in model.graph.node if n.op_type == "MatMul")
    types = {"xn": helper.make_tensor_type_proto(TensorProto.FLOAT, [2, K]),
             "W1": helper.make_tensor_type_proto(TensorProto.FLOAT, [K, N])}
    probe = alone(model, node, types)
    assert probe is not None and not probe.graph.initializer
    assert {i.name for i in probe.graph.input} == {"xn", "W1"}


@pytest.mark.contract("nxrt.external_data_from_the_file")
def test_nxrt_loads_an_external_data_model_from_its_file_and_refuses_a_rewrite(tmp_path):
    """Contract: nxrt-cpu is handed the model's file when the proto is the file's (nxrt finds the
    weights beside it) and runs it as the inline model; a proto changed since is ``Unsupported``
    saying nxrt needs the file."""
    pytest.importorskip("nxrt")
    from lockstep.engines.nxrt import cpu_engine
    from lockstep.engines.protocol import Unsupported

    engine = cpu_engine()
    ok, why = engine.available()
    if not ok:
        pytest.skip(why)
    inline = _mlp(plain=True)  # (nxrt has no SimplifiedLayerNormalization)
    model, _ = load_model(_save_external(inline, tmp_path / "m"))
    np.testing.assert_allclose(engine.prepare(model)(_feeds())[0], engine.prepare(inline)(_feeds())[0], rtol=0, atol=0)
    changed = onnx.ModelProto()
    changed.CopyFrom(model)
    changed.graph.node[-1].name = "renamed"
    with pytest.raises(Unsupported, match="nxrt reads external data only beside a model file"):
        engine.prepare(changed)


@pytest.mark.contract("locate.reduced_external_data_model_is_a_folder_of_its_own")
def test_a_reduced_window_of_an_external_data_model_runs_and_is_written_with_its_weights(tmp_path):
    """Contract: ``lockstep locate``'s window of a model with external data keeps the model's folder
    (engines find its weights), and the written repro holds its own weights (a node-case model.onnx
    that loads and runs without the original; past 1 GiB of them, beside it)."""
    from lockstep.conformance.locate.graph import extract
    from lockstep.conformance.locate.reduce import _standalone
    from lockstep.engines.ort import cpu_engine

    model, base = load_model(_save_external(_mlp(plain=True), tmp_path / "m"))
    feeds = _feeds()
    xn = feeds["x"]
    h = xn @ tensor_to_numpy(next(t for t in model.graph.initializer if t.name == "W1"), base)
    window = extract(model, [1, 2], ["hb"], {"xn": xn, "h": h, "hb": h})
    assert source_of(window) == source_of(model)
    want = cpu_engine().prepare(window)({"xn": xn})[0]
    out = tmp_path / "repro"
    out.mkdir()
    (out / "model.onnx").write_bytes(_standalone(window, out).SerializeToString())
    again, _ = load_model((out / "model.onnx").read_bytes())  # as a node case is read
    assert not loading.has_external_data(again) and source_of(again) is None
    np.testing.assert_array_equal(cpu_engine().prepare(again)({"xn": xn})[0], want)


@pytest.mark.contract("engines.genai_builder_layout_runs_from_its_file")
@pytest.mark.parametrize("int4", [False, True], ids=["fp32", "int4"])
def test_a_genai_builder_layout_runs_from_its_file_as_built_in_memory(tmp_path, int4):
    """Contract: a decoder written as ONNX Runtime GenAI's builder writes one (``scale_export``: page-
    aligned weights in model.onnx.data; int4 MatMulNBits), loaded from its file, gives on ref-sim and
    ort-cpu exactly the logits of the same model built in memory."""
    from lockstep.engines.ort import cpu_engine
    from lockstep.golden.llama_export import LlamaConfig, build_llama_onnx
    from lockstep.golden.scale_export import LazyInt4, LazyWeights, write_model
    from lockstep.reference_runtime.engine import sim_engine

    cfg = LlamaConfig(n_layers=2, hidden=64, n_heads=4, n_kv_heads=2, head_dim=16, d_ff=128, vocab=320,
                      max_positions=128)
    model, _ = load_model(write_model(tmp_path, cfg, int4=int4))
    assert loading.has_external_data(model)
    weights = {k: np.asarray(v) for k, v in LazyWeights(cfg, 0).items()}
    in_memory = build_llama_onnx(cfg, weights, convention="genai", int4=dict(LazyInt4(cfg, 0).items()) if int4 else None,
                                 name="random-llama")
    ids = [5, 6, 7, 300]
    feeds = {"input_ids": np.array([ids]), "attention_mask": np.ones((1, len(ids)), np.int64)}
    for i in range(cfg.n_layers):
        for k in ("key", "value"):
            feeds[f"past_key_values.{i}.{k}"] = np.zeros((1, cfg.n_kv_heads, 0, cfg.head_dim), np.float32)
    for make in (sim_engine, cpu_engine):
        np.testing.assert_array_equal(make().prepare(model)(feeds)[0], make().prepare(in_memory)(feeds)[0])


@pytest.mark.contract("runtime.default_budget_counts_anonymous_memory")
def test_the_default_budget_does_not_count_a_model_files_mapped_pages(tmp_path, monkeypatch):
    """Contract: under the simulated device's default budget (which protects the host's memory), the
    device memory that maps a model file's pages (``Device.file_backed_bytes``: page cache, not
    anonymous memory) is not counted, so a model whose weights alone pass that budget runs (a 1.5B
    fp32 export, 5.75 GiB of weights, was refused under a 5.89 GiB budget by its first activation);
    a budget the configuration names counts every byte, weights included, and refuses it."""
    from lockstep.reference_runtime import Runtime, RuntimeConfig
    from lockstep.reference_runtime.backends.sim import SimDevice
    from lockstep.reference_runtime.errors import MemoryAllocation
    from lockstep.reference_runtime.executor import Executor

    path = _save_external(_mlp(plain=True), tmp_path / "m", threshold=1024)
    model, _ = load_model(path)
    weights = 2 * K * N * 4
    expected = Executor(load_model(path)[0], Runtime(SimDevice())).run(_feeds())["y"]
    budget = weights // 2 + (1 << 20)  # half the weights, and room for the activations
    monkeypatch.setattr(SimDevice, "default_memory_limit", lambda self: budget)
    rt = Runtime(SimDevice())
    assert rt.memory_limit == budget
    np.testing.assert_array_equal(Executor(model, rt).run(_feeds())["y"], expected)
    assert rt.device.file_backed_bytes >= weights
    with pytest.raises(MemoryAllocation, match="device memory budget"):
        Executor(model, Runtime(SimDevice(), RuntimeConfig(device_memory_limit=budget))).run(_feeds())
