"""The executor's handling of bad input, and its ordering on the simulated device."""

from __future__ import annotations

import numpy as np
import pytest
from lockstep.reference_runtime import Runtime, RuntimeConfig
from lockstep.reference_runtime.backends.sim import SimDevice
from lockstep.reference_runtime.executor import Executor, FeedError
from lockstep.kernels import _nbits_host
from lockstep.kernels._op import OpError
from lockstep.loading import ModelError, UnsupportedModel
from onnx import TensorProto, helper, numpy_helper


def _model(nodes, inputs, outputs, initializers=(), opset=21, ir=10):
    g = helper.make_graph(nodes, "g", inputs, outputs, initializer=list(initializers))
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", opset)], ir_version=ir)


def _rt():
    return Runtime(SimDevice(), RuntimeConfig())


def _vi(name, elem=TensorProto.FLOAT, shape=("n",)):
    return helper.make_tensor_value_info(name, elem, list(shape))


def test_unsupported_ops_are_all_reported_before_execution():
    """Contract (executor docstring): every node without a kernel is reported at load, all of them
    in one UnsupportedModel (killed mutant: raising at the first one)."""
    m = _model(
        [helper.make_node("FancyOp", ["x"], ["y"], domain="com.example", name="fancy"),
         helper.make_node("Identity", ["y"], ["z"]),
         helper.make_node("PlainOp", ["z"], ["w"], domain="com.example", name="plain")],
        [_vi("x")], [_vi("w")],
    )
    m.opset_import.append(helper.make_opsetid("com.example", 3))
    with pytest.raises(UnsupportedModel) as exc:
        Executor(m, _rt())
    assert exc.value.items == ["fancy: no kernel for com.example::FancyOp", "plain: no kernel for com.example::PlainOp"]


def test_unsupported_reason_names_the_opset():
    from lockstep.kernels._op import Unary
    from lockstep.kernels.registry import Registry

    old_only = Registry([Unary("Neg", lambda xp, x: -x, since=1, until=5, capture="safe")])
    m = _model([helper.make_node("Neg", ["x"], ["y"], name="neg")], [_vi("x")], [_vi("y")])
    with pytest.raises(UnsupportedModel, match=r"neg: no kernel for ai.onnx::Neg at opset 21 \(have 1-5\)"):
        Executor(m, _rt(), registry=old_only)
    m2 = _model([helper.make_node("TfIdfVectorizer", ["x"], ["y"], name="tfidf", mode="TF", min_gram_length=1,
                                  max_gram_length=1, max_skip_count=0, ngram_counts=[0], ngram_indexes=[0],
                                  pool_int64s=[1])],
                [_vi("x", TensorProto.INT64)], [_vi("y")])
    with pytest.raises(UnsupportedModel, match=r"tfidf: no kernel for ai.onnx::TfIdfVectorizer"):
        Executor(m2, _rt(), registry=old_only)


def test_a_nonexistent_standard_op_fails_the_checker():
    m = _model([helper.make_node("Frobnicate", ["x"], ["y"], name="frob")], [_vi("x")], [_vi("y")])
    with pytest.raises(ModelError, match="No Op registered for Frobnicate"):
        Executor(m, _rt())


def test_malformed_protobuf_is_a_clear_error(tmp_path):
    with pytest.raises(ModelError, match="not a valid ONNX protobuf"):
        Executor(b"\x08\x07garbage\xff\xff", _rt())
    bad = tmp_path / "bad.onnx"
    bad.write_bytes(b"\x12\x34not onnx at all")
    with pytest.raises(ModelError, match="bad.onnx"):
        Executor(str(bad), _rt())
    with pytest.raises(ModelError, match="does not exist"):
        Executor(str(tmp_path / "missing.onnx"), _rt())


def test_checker_failure_is_a_model_error():
    m = _model([helper.make_node("Identity", ["x"], ["y"])], [_vi("x")], [_vi("nope")])
    with pytest.raises(ModelError, match="onnx.checker"):
        Executor(m, _rt())


def test_external_data_outside_the_model_folder_is_refused(tmp_path):
    w = TensorProto(name="w", data_type=TensorProto.FLOAT, dims=[4], data_location=TensorProto.EXTERNAL)
    entry = w.external_data.add()
    entry.key, entry.value = "location", "../outside.bin"
    m = _model([helper.make_node("Identity", ["w"], ["y"])], [], [_vi("y", shape=(4,))], [w])
    folder = tmp_path / "model"
    folder.mkdir()
    path = folder / "m.onnx"
    path.write_bytes(m.SerializeToString())
    (tmp_path / "outside.bin").write_bytes(np.ones(4, np.float32).tobytes())
    with pytest.raises(ModelError, match="external data '../outside.bin' points outside the model folder"):
        Executor(str(path), _rt())


def _identity_model():
    return _model([helper.make_node("Identity", ["a"], ["y"])],
                  [_vi("a", shape=("n", 3)), _vi("b", shape=("n",))], [_vi("y", shape=("n", 3))])


@pytest.mark.parametrize(
    "feeds, match",
    [
        ({"a": np.zeros((2, 3), np.float32)}, r"missing feed\(s\) \['b'\]"),
        ({"a": np.zeros((2, 3), np.float32), "b": np.zeros(2, np.float32), "c": np.zeros(1)}, r"unknown feed\(s\) \['c'\]"),
        ({"a": np.zeros((2, 3), np.float64), "b": np.zeros(2, np.float32)}, r"input 'a': dtype float64 given, float32 declared"),
        ({"a": np.zeros((2, 3, 1), np.float32), "b": np.zeros(2, np.float32)}, r"input 'a': rank 3 given"),
        ({"a": np.zeros((2, 4), np.float32), "b": np.zeros(2, np.float32)}, r"input 'a': dim 1 is 4, declared 3"),
        ({"a": np.zeros((2, 2), np.float32), "b": np.zeros(2, np.float32)}, r"input 'a': dim 1 is 2, declared 3"),
        ({"a": np.zeros((2,), np.float32), "b": np.zeros(2, np.float32)}, r"input 'a': rank 1 given"),
        ({"a": np.zeros((2, 3), np.float32), "b": np.zeros(5, np.float32)}, r"input 'b': dim 0 \('n'\) is 5, but 'a' bound it to 2"),
        ({"a": [[0.0] * 3] * 2, "b": np.zeros(2, np.float32)}, r"input 'a': expected a numpy array"),
    ],
)
def test_bad_feeds_name_the_input(feeds, match):
    """Contract (executor docstring): names, dtypes, ranks (lower and higher), fixed dims (smaller
    and larger) and symbol bindings are checked, FeedError naming the input."""
    ex = Executor(_identity_model(), _rt())
    with pytest.raises(FeedError, match=match):
        ex.run(feeds)


@pytest.mark.parametrize(
    "a, b, match",
    [
        (np.zeros((2, 3), np.int64), np.zeros(2, np.float32), r"input 'a': dtype int64 given, float32 declared"),
        (np.zeros((2, 3, 1), np.float32), np.zeros(2, np.float32), r"input 'a': rank 3 given"),
        (np.zeros((2, 4), np.float32), np.zeros(2, np.float32), r"input 'a': dim 1 is 4, declared 3"),
        (np.zeros((2, 3), np.float32), np.zeros(5, np.float32), r"input 'b': dim 0 \('n'\) is 5, but 'a' bound it to 2"),
    ],
)
def test_bad_device_tensor_feeds_name_the_input(device_name, make_runtime, a, b, match):
    """Guarantee (Executor.run, reference_runtime/README): a device Tensor feed is checked like a
    host array: dtype, rank, declared dims and symbol bindings, FeedError naming the input, before
    any work is enqueued (decode feeds its KV cache as device tensors). Killed mutant: the checks
    skipped for device tensors, so an int64 tensor fed to a float32 input ran and yielded int64.
    The FeedError and the launch count encode the contract; the output after the refusal is a
    result (the runtime stays usable)."""
    rt = make_runtime()
    ex = Executor(_identity_model(), rt)
    ta, tb = rt.upload(a), rt.upload(b)
    launches = rt.counters.launches
    with pytest.raises(FeedError, match=match):
        ex.run({"a": ta, "b": tb})
    assert rt.counters.launches == launches, "contract: refused before any launch"
    good = rt.upload(np.arange(6, dtype=np.float32).reshape(2, 3))
    assert ex.run({"a": good, "b": rt.upload(np.zeros(2, np.float32))})["y"].tolist() == rt.download(good).tolist()


def test_identity_round_trip_and_runtime_stays_usable_after_a_bad_feed():
    rt = _rt()
    ex = Executor(_identity_model(), rt)
    with pytest.raises(FeedError):
        ex.run({})
    a = np.arange(6, dtype=np.float32).reshape(2, 3)
    out = ex.run({"a": a, "b": np.zeros(2, np.float32)})
    assert np.array_equal(out["y"], a)
    assert rt.pending_frees == 0 or rt.drain_for_unmap() is None


def test_symbolic_dims_are_interned_at_load():
    m = _model(
        [helper.make_node("Identity", ["a"], ["t"]), helper.make_node("Identity", ["t"], ["y"])],
        [_vi("a", shape=("batch", "seq")), _vi("b", shape=("seq",))], [_vi("y", shape=("batch", "seq"))],
    )
    ex = Executor(m, _rt())
    batch, seq = ex.symbols["batch"], ex.symbols["seq"]
    assert ex.symbolic_shapes["a"] == (batch, seq)
    assert ex.symbolic_shapes["b"][0] is seq  # one name, one symbol object
    assert ex.symbolic_shapes["t"] == (batch, seq)  # propagated through the graph
    assert batch.is_root and seq.is_root


def test_derived_symbols_record_their_provenance():
    m = _model(
        [helper.make_node("Flatten", ["x"], ["f"], axis=2, name="flat"),
         helper.make_node("Concat", ["a", "b"], ["c"], axis=0, name="cat")],
        [_vi("x", shape=("batch", "seq", 4)), _vi("a", shape=("past",)), _vi("b", shape=("new",))],
        [_vi("f", shape=(None, 4)), _vi("c", shape=(None,))],
    )
    ex = Executor(m, _rt())
    sym = ex.symbols
    flat0 = ex.symbolic_shapes["f"][0]
    assert flat0.producer == "flat" and flat0.roots() == {sym["batch"], sym["seq"]}
    cat0 = ex.symbolic_shapes["c"][0]
    assert cat0.producer == "cat" and cat0.roots() == {sym["past"], sym["new"]}
    assert ex.symbolic_shapes["f"][1] == 4


def test_out_of_range_index_sets_the_latch_without_readback():
    from lockstep.kernels._op import OpKernel, Spec
    from lockstep.kernels.registry import Registry
    from lockstep.reference_runtime import DeviceAssert

    def shapes(node, specs):
        return [Spec(specs[1].shape + specs[0].shape[1:], specs[0].dtype)]

    def compute(xp, node, data, idx):
        n = data.shape[0]
        return (xp.take(data, xp.clip(xp.where(idx < 0, idx + n, idx), 0, n - 1), axis=0),)

    gather = OpKernel("Gather", shapes, compute, index_checks=lambda node, specs: [(1, specs[0].shape[0])], capture="safe")
    m = _model([helper.make_node("Gather", ["d", "i"], ["y"], name="Gather_7")],
               [_vi("d", shape=(4,)), _vi("i", TensorProto.INT64, shape=(2,))], [_vi("y", shape=(2,))])
    rt = _rt()
    ex = Executor(m, rt, registry=Registry([gather]))
    d = np.arange(4, dtype=np.float32)
    assert ex.run({"d": d, "i": np.array([-1, 3])})["y"].tolist() == [3.0, 3.0]
    downloads = rt.counters.downloads
    with pytest.raises(DeviceAssert, match="Gather_7"):
        ex.run({"d": d, "i": np.array([0, 4])})
    assert rt.counters.downloads == downloads, "no readback before the synchronising read of the outputs"
    with pytest.raises(DeviceAssert, match="Gather_7"):
        ex.run({"d": d, "i": np.array([0, 1])})  # sticky until reset
    rt.reset_error_latch()
    assert ex.run({"d": d, "i": np.array([0, 1])})["y"].tolist() == [0.0, 1.0]


def test_registered_gather_flags_out_of_range_indices():
    """The real Gather kernel: an out-of-range index raises DeviceAssert naming the node."""
    from lockstep.reference_runtime import DeviceAssert

    m = _model([helper.make_node("Gather", ["d", "i"], ["y"], name="Gather_lm_head", axis=0)],
               [_vi("d", shape=(4, 2)), _vi("i", TensorProto.INT64, shape=(3,))], [_vi("y", shape=(3, 2))])
    ex = Executor(m, _rt())
    d = np.arange(8, dtype=np.float32).reshape(4, 2)
    assert ex.run({"d": d, "i": np.array([-4, 0, 3])})["y"][:, 0].tolist() == [0.0, 0.0, 6.0]
    with pytest.raises(DeviceAssert, match="Gather_lm_head"):
        ex.run({"d": d, "i": np.array([0, -5, 1])})


def test_device_feeds_and_kept_outputs():
    rt = _rt()
    m = _model([helper.make_node("Identity", ["a"], ["y"]), helper.make_node("Identity", ["a"], ["z"])],
               [_vi("a", shape=("n",))], [_vi("y", shape=("n",)), _vi("z", shape=("n",))])
    ex = Executor(m, rt)
    a = rt.upload(np.arange(3, dtype=np.float32))
    out = ex.run({"a": a}, keep={"y", "z"})
    y, z = out["y"], out["z"]
    assert y is not a and z is not a and y is not z, "kept outputs are the caller's own tensors"
    assert rt.download(y).tolist() == [0.0, 1.0, 2.0] and not a.freed
    rt.free(y)
    rt.free(z)
    assert rt.download(a).tolist() == [0.0, 1.0, 2.0], "a device feed is never freed by run"
    with pytest.raises(FeedError, match="not graph outputs"):
        ex.run({"a": a}, keep={"nope"})
    rt.free(a)
    with pytest.raises(FeedError, match="freed or belongs to another runtime"):
        ex.run({"a": a})


def test_a_kept_computed_output_is_handed_over_alive():
    """Contract (Executor.run): an output named in ``keep`` comes back as a live device Tensor the
    caller owns; the run frees its other temporaries but never that one."""
    rt = _rt()
    m = _model([helper.make_node("Neg", ["a"], ["y"])], [_vi("a", shape=(3,))], [_vi("y", shape=(3,))])
    y = Executor(m, rt).run({"a": np.arange(3, dtype=np.float32)}, keep={"y"})["y"]
    rt.drain_for_unmap()
    assert not y.freed and rt.download(y).tolist() == [0.0, -1.0, -2.0]
    rt.free(y)


def test_a_device_tensor_of_another_runtime_is_refused():
    """Contract (Executor.run: feeds are "this runtime's device Tensors"): a live Tensor of another
    runtime is a FeedError naming the input, before any launch; never read across devices."""
    rt, other = _rt(), _rt()
    ex = Executor(_identity_model(), rt)
    a = other.upload(np.zeros((2, 3), np.float32))
    launches = rt.counters.launches
    with pytest.raises(FeedError, match="input 'a': device tensor .* belongs to another runtime"):
        ex.run({"a": a, "b": np.zeros(2, np.float32)})
    assert rt.counters.launches == launches and not a.freed


@pytest.mark.parametrize("dtype, shape", [(np.float64, (2,)), (np.float32, (3,))], ids=["dtype", "shape"])
def test_a_bound_output_of_the_wrong_dtype_or_shape_is_refused(dtype, shape):
    """Contract (Executor.run, IO binding): an output is written into its bound Tensor only when
    that Tensor has the output's dtype and shape; otherwise FeedError naming the output, and the
    bound Tensor is untouched (killed mutant: the dtype compare dropped, a cast write)."""
    rt = _rt()
    m = _model([helper.make_node("Neg", ["a"], ["y"])], [_vi("a", shape=(2,))], [_vi("y", shape=(2,))])
    ex = Executor(m, rt)
    out = rt.upload(np.full(shape, 7, dtype))
    with pytest.raises(FeedError, match="output 'y' is bound to .* but is float32\\[2\\]"):
        ex.run({"a": np.ones(2, np.float32)}, bind={"y": out})
    assert (rt.download(out) == 7).all()
    ok = rt.upload(np.zeros(2, np.float32))
    assert ex.run({"a": np.ones(2, np.float32)}, bind={"y": ok})["y"] is ok and rt.download(ok).tolist() == [-1, -1]


def test_shape_arithmetic_is_folded_on_the_host_not_read_back():
    # Reshape's target shape comes from Shape -> Gather -> Concat: no device readback needed
    m = _model(
        [helper.make_node("Shape", ["x"], ["s"]),
         helper.make_node("Gather", ["s", "zero"], ["n"], axis=0),
         helper.make_node("Concat", ["n", "minus1"], ["target"], axis=0),
         helper.make_node("Reshape", ["x", "target"], ["y"])],
        [_vi("x", shape=("a", 2, 3))], [_vi("y", shape=("a", 6))],
        [numpy_helper.from_array(np.array([0], np.int64), "zero"),
         numpy_helper.from_array(np.array([-1], np.int64), "minus1")],
    )
    rt = _rt()
    ex = Executor(m, rt)
    x = np.arange(12, dtype=np.float32).reshape(2, 2, 3)
    before = rt.counters.downloads
    assert ex.run({"x": x})["y"].shape == (2, 6)
    assert rt.counters.downloads - before == 1, "only the graph output is downloaded"


def test_string_inputs_and_outputs_stay_on_the_host():
    """Contract (Executor, host_values): string tensors never reach device memory; a string input
    passes through to its output on the host while the float one is uploaded and downloaded."""
    m = _model([helper.make_node("Identity", ["s"], ["t"]), helper.make_node("Relu", ["x"], ["y"])],
               [_vi("s", TensorProto.STRING), _vi("x")], [_vi("t", TensorProto.STRING), _vi("y")])
    rt = _rt()
    ex = Executor(m, rt)
    s, x = np.array(["a", "bc"], dtype=object), np.array([-1.0, 2.0], np.float32)
    allocations, downloads = rt.counters.allocations, rt.counters.downloads
    out = ex.run({"s": s, "x": x})
    assert out["t"].dtype == object and out["t"].tolist() == ["a", "bc"], "result: the strings come back"
    assert out["y"].tolist() == [0.0, 2.0], "result: the float path runs on the device"
    assert rt.counters.allocations - allocations == 2, "contract: device memory for x and y only, none for strings"
    assert rt.counters.downloads - downloads == 1, "contract: only y is downloaded"


@pytest.mark.parametrize("attr, value, dtype", [
    ("value_float", 1.5, np.float32), ("value_floats", [1.5, 2.0], np.float32),
    ("value_int", 3, np.int64), ("value_ints", [3, 4], np.int64),
], ids=["value_float", "value_floats", "value_int", "value_ints"])
def test_constant_attribute_forms_have_their_onnx_dtypes(attr, value, dtype):
    """Contract (ONNX Constant): value_float(s) are float32, value_int(s) int64; the executor's
    host constant and the graph output have exactly that dtype and value."""
    elem = TensorProto.FLOAT if dtype == np.float32 else TensorProto.INT64
    shape = [len(value)] if isinstance(value, list) else []
    m = _model([helper.make_node("Constant", [], ["y"], **{attr: value})], [], [_vi("y", elem, shape)])
    y = Executor(m, _rt()).run({})["y"]
    assert y.dtype == dtype and y.tolist() == value


def test_a_kernel_whose_compute_breaks_its_shape_promise_is_an_error_naming_the_node():
    """Contract (executor: outputs are allocated from ``OpKernel.shapes``): a compute result of
    another shape than promised is an error naming the node, never broadcast into the output."""
    from lockstep.kernels._op import OpKernel, Spec
    from lockstep.kernels.registry import Registry

    liar = OpKernel("Neg", lambda node, specs: [Spec(specs[0].shape, specs[0].dtype)],
                    lambda xp, node, x: (-x[:1],), since=1, capture="safe")
    m = _model([helper.make_node("Neg", ["a"], ["y"], name="neg_liar")], [_vi("a", shape=(3,))], [_vi("y", shape=(3,))])
    rt = _rt()
    with pytest.raises(Exception, match=r"neg_liar.*compute gave shape \(1,\), shapes\(\) promised \(3,\)"):
        Executor(m, rt, registry=Registry([liar])).run({"a": np.ones(3, np.float32)})


def test_a_half_precision_cache_fed_to_a_float32_concat_is_refused():
    """Contract (Executor.run; the decode path feeds its KV cache as device Tensors): a float16
    device Tensor fed to a float32 cache input is a FeedError before any launch, not a Concat that
    mixes widths. Independent of test_bad_device_tensor_feeds_name_the_input (another model, another dtype)."""
    rt = _rt()
    m = _model([helper.make_node("Concat", ["past", "new"], ["present"], axis=0)],
               [_vi("past", shape=("p", 2)), _vi("new", shape=(1, 2))], [_vi("present", shape=("t", 2))])
    ex = Executor(m, rt)
    past = rt.upload(np.zeros((3, 2), np.float16))
    launches = rt.counters.launches
    with pytest.raises(FeedError, match="input 'past': dtype float16 given, float32 declared"):
        ex.run({"past": past, "new": np.ones((1, 2), np.float32)})
    assert rt.counters.launches == launches


def test_nodes_no_output_depends_on_are_loaded_but_not_run(make_runtime):
    """Contract: a node whose outputs no graph output depends on is validated at load (a bad
    attribute is still refused) and then pruned: named in ``Executor.pruned``, never launched (as
    ONNX Runtime's optimizer removes it). Result: the graph outputs are unchanged."""


    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [3])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, [3])

    def model(dead_attrs):
        nodes = [helper.make_node("Relu", ["x"], ["y"], name="live"),
                 helper.make_node("Neg", ["x"], ["n"], name="dead"),
                 helper.make_node("Cast", ["n"], ["m"], name="dead_too", **dead_attrs)]
        g = helper.make_graph(nodes, "g", [x], [y])
        return helper.make_model(g, opset_imports=[helper.make_opsetid("", 21)], ir_version=10)

    rt = make_runtime()
    ex = Executor(model({"to": TensorProto.DOUBLE}), rt)
    assert ex.pruned == ("dead", "dead_too") and [st.info.name for st in ex.steps] == ["live"]
    before = rt.counters.launches
    out = ex.run({"x": np.array([-1.0, 0.0, 2.0], np.float32)})["y"]
    np.testing.assert_array_equal(out, [0.0, 0.0, 2.0])
    assert rt.counters.launches - before == 1, "contract: the dead nodes launch nothing"
    with pytest.raises(OpError, match="dead_too"):
        Executor(model({"to": 999}), rt)


def _weights_model():
    """fp16 products whose B is an initializer (MatMul, Gemm with transB) and MatMulNBits of 4 and 8 bits."""
    rng = np.random.default_rng(7)
    w = numpy_helper.from_array(rng.standard_normal((8, 6)).astype(np.float16), "w")
    wt = numpy_helper.from_array(rng.standard_normal((5, 6)).astype(np.float16), "wt")
    q = numpy_helper.from_array(rng.integers(0, 255, (4, 1, 16), dtype=np.uint8), "q")  # N=4, K=8, block 32
    q8 = numpy_helper.from_array(rng.integers(0, 255, (4, 1, 32), dtype=np.uint8), "q8")  # the same, 8 bits
    s = numpy_helper.from_array(rng.random(4).astype(np.float32) + 0.5, "s")
    nodes = [helper.make_node("MatMul", ["x", "w"], ["h"]),
             helper.make_node("Gemm", ["h", "wt"], ["y"], transB=1),
             helper.make_node("Cast", ["x"], ["x32"], to=TensorProto.FLOAT),
             helper.make_node("MatMulNBits", ["x32", "q", "s"], ["z"], domain="com.microsoft", K=8, N=4, bits=4,
                              block_size=32, name="nbits4"),
             helper.make_node("MatMulNBits", ["x32", "q8", "s"], ["z8"], domain="com.microsoft", K=8, N=4, bits=8,
                              block_size=32, name="nbits8")]
    m = _model(nodes, [_vi("x", TensorProto.FLOAT16, (3, 8))],
               [_vi("y", TensorProto.FLOAT16, (3, 5)), _vi("z", TensorProto.FLOAT, (3, 4)),
                _vi("z8", TensorProto.FLOAT, (3, 4))], [w, wt, q, q8, s])
    m.opset_import.append(helper.make_opsetid("com.microsoft", 1))
    return m


@pytest.mark.contract("executor.const_memo")
def test_a_large_models_weight_memos_change_no_byte_and_stay_off_elsewhere(monkeypatch):
    """Kernels derive fp32 weights (fp16 upcasts, MatMulNBits' dequantized 2/8-bit blocks) once per node
    only for a model whose weights pass MEMO_MIN_MODEL_BYTES, with no weight pager: the outputs are the
    bytes of the per-run computation, and small models and paged executors keep no memo. A 4-bit
    MatMulNBits keeps none at all: its fused kernel (kernels/_nbits_host.py) reads the blocks each run."""
    from lockstep.reference_runtime import executor as ex_mod

    m = _weights_model()
    xs = [np.random.default_rng(i).standard_normal((3, 8)).astype(np.float16) for i in (1, 2)]
    plain = Executor(m, _rt())
    assert not any(st.info.consts for st in plain.steps), "contract: a small model keeps no memo"
    want = [[plain.run({"x": x})[k].tobytes() for k in ("y", "z", "z8")] for x in xs]
    monkeypatch.setattr(ex_mod, "MEMO_MIN_MODEL_BYTES", 1)  # this model counts as large
    memo = Executor(m, _rt())
    got = [[memo.run({"x": x})[k].tobytes() for k in ("y", "z", "z8")] for x in xs]
    assert got == want, "result: the bytes of the per-run computation, run after run"
    kept = {st.info.name if st.info.op_type == "MatMulNBits" else st.info.op_type: len(st.info.memo)
            for st in memo.steps if st.info.memo}
    want_kept = {"MatMul": 1, "Gemm": 1, "nbits8": 1} if _nbits_host.AVAILABLE else \
        {"MatMul": 1, "Gemm": 1, "nbits4": 1, "nbits8": 1}
    assert kept == want_kept, f"contract: one memo per weight-reading node, none for a fused 4-bit one: {kept}"
    paged = Executor(m, Runtime(SimDevice(), RuntimeConfig(vram_limit=1 << 30)))
    assert not any(st.info.consts for st in paged.steps), "contract: no memo under a weight pager"


@pytest.mark.contract("executor.fold_weight_transposes")
def test_a_large_models_weight_transpose_is_done_once_at_load(monkeypatch):
    """Contract: in a model whose weights pass MEMO_MIN_MODEL_BYTES (no weight pager), a Transpose of
    an initializer (GenAI's builder's tied embedding: Gather(Transpose(lm_head))) runs once at load,
    not at every run: its node is folded into a constant, and the outputs are the bytes of the
    unfolded run. Small models, paged executors and a transpose that is a graph output are not folded."""
    from lockstep.reference_runtime import executor as ex_mod

    rng = np.random.default_rng(3)
    w = numpy_helper.from_array(rng.standard_normal((6, 11)).astype(np.float32), "lm_head")
    nodes = [helper.make_node("Transpose", ["lm_head"], ["table"], name="T"),
             helper.make_node("Gather", ["table", "ids"], ["emb"]),
             helper.make_node("MatMul", ["emb", "lm_head"], ["logits"]),
             helper.make_node("Transpose", ["lm_head"], ["wt"], name="T_out", perm=[1, 0])]
    m = _model(nodes, [_vi("ids", TensorProto.INT64, (2, 3))],
               [_vi("logits", TensorProto.FLOAT, (2, 3, 11)), _vi("wt", TensorProto.FLOAT, (11, 6))], [w])
    ids = np.array([[0, 5, 10], [3, 3, 7]], np.int64)
    plain = Executor(m, _rt())
    assert plain.folded == () and "T" in [st.info.name for st in plain.steps], "contract: a small model folds nothing"
    want = {k: v.tobytes() for k, v in plain.run({"ids": ids}).items()}
    monkeypatch.setattr(ex_mod, "MEMO_MIN_MODEL_BYTES", 1)  # this model counts as large
    big = Executor(m, _rt())
    assert big.folded == ("T",), f"contract: the weight's transpose is folded, not the graph output's: {big.folded}"
    assert "T" not in [st.info.name for st in big.steps], "contract: no step runs the folded transpose"
    for _ in range(2):
        got = {k: v.tobytes() for k, v in big.run({"ids": ids}).items()}
        assert got == want, "result: the bytes of the unfolded run"
    paged = Executor(m, Runtime(SimDevice(), RuntimeConfig(vram_limit=1 << 30)))
    assert paged.folded == (), "contract: nothing is folded under a weight pager"
