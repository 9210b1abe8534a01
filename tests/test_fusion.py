"""Kernel fusion at load (reference_runtime/fusion.py): fused steps give the unfused nodes' bits, on
every device the run selects (the simulated device in CI, where a fused step runs its nodes' own
bodies; CuPy on the GPU lane, where it takes its one-launch kernel). Assertions say whether they
encode a contract or a result."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from lockstep.decoder_io import DecoderIO
from lockstep.golden.anchors import MODEL_DIR
from lockstep.golden.models.spec import PROMPT
from lockstep.reference_runtime import RuntimeConfig
from lockstep.reference_runtime import fusion
from lockstep.reference_runtime.engine import RefDecoder
from lockstep.reference_runtime.executor import Executor

OFF = RuntimeConfig(fuse_kernels=False)


def _decode(make_runtime, name: str, config: RuntimeConfig, *, capture: bool, card=None, steps: int = 5):
    m = onnx.load(str(MODEL_DIR / f"{name}.onnx"))
    rt = make_runtime(config)
    dec = RefDecoder(m, rt, capture=capture, io=DecoderIO.of(m, card) if card else None)
    out = [np.asarray(dec.forward(list(PROMPT.encode())))]
    before = rt.counters.launches
    for _ in range(steps):
        out.append(np.asarray(dec.forward([int(np.argmax(out[-1][-1]))])))
    return out, dec, (rt.counters.launches - before) / steps


@pytest.mark.contract("fusion.same_bits")
@pytest.mark.parametrize("name,card", [("small-fp32-standard-kv64", None), ("small-fp32-standard", {"kv_capacity": "64"}),
                                       ("tiny-fp32-decomposed", None), ("small-fp32-standard", None)])
@pytest.mark.parametrize("capture", [False, True], ids=["eager", "captured"])
def test_fused_decode_is_the_unfused_decode_byte_for_byte(make_runtime, name, card, capture):
    """contract: a golden model decodes to the same logits, byte for byte, with fusion on and off
    (prefill and five one-token steps), eager and captured, on this device. result: the float32
    golden models fuse (their q/k/v and gate/up products, x*sigmoid(x)*up, residual Add + norm)."""
    on, dec, _ = _decode(make_runtime, name, RuntimeConfig(), capture=capture, card=card)
    off, plain, _ = _decode(make_runtime, name, OFF, capture=capture, card=card)
    assert dec.ex.fused and not plain.ex.fused, "result: fused with fuse_kernels on, not with it off"
    for k, (a, b) in enumerate(zip(on, off)):
        assert a.dtype == b.dtype and a.tobytes() == b.tobytes(), f"contract: step {k}'s logits differ with fusion"


def test_fusion_takes_launches_out_of_a_decode_step(make_runtime):
    """result: small-fp32-standard-kv64's eager decode step launches 36 kernels fewer fused (4 layers:
    q/k/v 3 -> 1, gate/up 2 -> 1, Sigmoid+Mul+Mul 3 -> 1, two Add+RMSNormalization 2 -> 1 each, the
    q and k RotaryEmbeddings 2 -> 1, the key and value TensorScatters 2 -> 1)."""
    _, dec, fused = _decode(make_runtime, "small-fp32-standard-kv64", RuntimeConfig(), capture=False)
    _, _, plain = _decode(make_runtime, "small-fp32-standard-kv64", OFF, capture=False)
    assert plain - fused == 36, (plain, fused)
    ops = sorted({n.split("+")[0].split("/")[-1] for n in dec.ex.fused})
    assert {st.info.op_type for st in dec.ex.steps if st.info.name in dec.ex.fused} == set(fusion.FUSED_OPS), ops


# -- one group at a time: small graphs, fast paths and fallbacks ----------------------------------

def _graph(nodes, inputs, outputs, inits=(), value_info=()):
    g = helper.make_graph(nodes, "g", inputs, outputs, list(inits), value_info=list(value_info))
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", 23)])


def _f32(name, shape):
    return helper.make_tensor_value_info(name, TensorProto.FLOAT, shape)


def _run(make_runtime, model, feeds, config):
    ex = Executor(model, make_runtime(config))
    return ex, ex.run(feeds)


def _same(make_runtime, model, feeds, expect_fused: int):
    on_ex, on = _run(make_runtime, model, feeds, RuntimeConfig())
    off_ex, off = _run(make_runtime, model, feeds, OFF)
    assert len(on_ex.fused) == expect_fused, f"result: {on_ex.fused}"
    assert not off_ex.fused
    assert on.keys() == off.keys()
    for name in on:
        a, b = np.asarray(on[name]), np.asarray(off[name])
        assert a.shape == b.shape and a.tobytes() == b.tobytes(), "contract: the fused step's bits are the nodes'"
    return on_ex


def _silu_model(shape, u_shape=None):
    nodes = [helper.make_node("Sigmoid", ["g"], ["s"], name="sig"),
             helper.make_node("Mul", ["s", "g"], ["m"], name="mul1"),  # the operand order the golden models do not use
             helper.make_node("Mul", ["u", "m"], ["y"], name="mul2")]
    return _graph(nodes, [_f32("g", shape), _f32("u", u_shape or shape)], [_f32("y", shape)])


@pytest.mark.contract("fusion.same_bits")
@pytest.mark.parametrize("shape", [(1, 1, 256), (3, 7, 33), (1, 19, 256)])
def test_silu_mul_fuses_with_its_nodes_bits(make_runtime, shape):
    """contract: Sigmoid, Mul, Mul (either operand order) fuse into one step with the nodes' bits,
    including values large enough to saturate the sigmoid either way."""
    rng = np.random.default_rng(1)
    g = (rng.standard_normal(shape) * 12).astype(np.float32)
    u = rng.standard_normal(shape).astype(np.float32)
    ex = _same(make_runtime, _silu_model(shape), {"g": g, "u": u}, 1)
    assert ex.steps[0].info.op_type == "SiluMul" and ex.steps[0].info.domain == fusion.DOMAIN
    assert ex.steps[0].info.name == "sig+mul1+mul2", "contract: a fused step is named after its nodes"


def test_silu_mul_broadcast_takes_the_nodes_path(make_runtime):
    """contract: an ``up`` that broadcasts (not the fast path's case) still gives the nodes' bits."""
    rng = np.random.default_rng(2)
    g = rng.standard_normal((2, 3, 8)).astype(np.float32)
    u = rng.standard_normal((8,)).astype(np.float32)
    _same(make_runtime, _silu_model((2, 3, 8), (8,)), {"g": g, "u": u}, 1)


def _add_norm_model(shape, keep: bool, eps=1e-6, scale_shape=None):
    cols = shape[-1]
    scale = numpy_helper.from_array(np.linspace(0.5, 1.5, cols, dtype=np.float32).reshape(scale_shape or (cols,)),
                                    "scale")
    nodes = [helper.make_node("Add", ["a", "b"], ["s"], name="add"),
             helper.make_node("RMSNormalization", ["s", "scale"], ["y"], name="norm", epsilon=eps)]
    outs = [_f32("y", shape)]
    if keep:
        nodes.append(helper.make_node("Mul", ["s", "s"], ["z"], name="other_reader"))
        outs.append(_f32("z", shape))
    return _graph(nodes, [_f32("a", shape), _f32("b", shape)], outs, [scale])


@pytest.mark.contract("fusion.same_bits")
@pytest.mark.parametrize("keep", [False, True], ids=["sum-internal", "sum-read-later"])
@pytest.mark.parametrize("shape", [(1, 1, 128), (2, 19, 576), (1, 1, 1000)])
def test_add_rms_norm_fuses_with_its_nodes_bits(make_runtime, shape, keep):
    """contract: Add then RMSNormalization of the sum (a constant scale) fuse with the nodes' bits;
    the sum stays an output of the fused step when anything else reads it."""
    rng = np.random.default_rng(3)
    feeds = {"a": rng.standard_normal(shape).astype(np.float32), "b": rng.standard_normal(shape).astype(np.float32)}
    ex = _same(make_runtime, _add_norm_model(shape, keep), feeds, 1)
    fused = next(st for st in ex.steps if st.info.domain == fusion.DOMAIN)
    assert fused.outputs == (("s", "y") if keep else ("y",)), "contract: the sum is kept only when read"


def _group_model(m_shape, ns, k=128):
    rng = np.random.default_rng(4)
    inits = [numpy_helper.from_array(rng.standard_normal((k, n)).astype(np.float32), f"w{j}") for j, n in enumerate(ns)]
    nodes = [helper.make_node("MatMul", ["x", f"w{j}"], [f"y{j}"], name=f"mm{j}") for j in range(len(ns))]
    return _graph(nodes, [_f32("x", m_shape + (k,))], [_f32(f"y{j}", m_shape + (n,)) for j, n in enumerate(ns)], inits)


@pytest.mark.contract("fusion.same_bits")
@pytest.mark.parametrize("m_shape,ns,groups", [((1, 1), (128, 32, 32), 1), ((1, 19), (64, 16), 1),
                                               ((1, 1), (8, 8, 8, 8, 8, 8), 2), ((16,), (1, 300), 1)])
def test_matmul_group_fuses_with_its_nodes_bits(make_runtime, m_shape, ns, groups):
    """contract: MatMuls of one activation by constant 2-D weights fuse, up to four a step, with the
    products' bits (decode rows: one launch; 19 prompt rows: the products one by one)."""
    rng = np.random.default_rng(5)
    x = rng.standard_normal(m_shape + (128,)).astype(np.float32)
    _same(make_runtime, _group_model(m_shape, ns), {"x": x}, groups)


def test_nothing_fuses_across_a_graph_output_or_a_non_float32_value(make_runtime):
    """contract: an intermediate the caller reads (a graph output, as ``lockstep locate`` exposes
    them) is never fused away; float16 groups are left to their nodes (their per-node rounding)."""
    m = _silu_model((2, 4))
    m.graph.output.append(_f32("s", (2, 4)))
    ex = Executor(m, make_runtime(RuntimeConfig()))
    assert not ex.fused and [st.info.op_type for st in ex.steps] == ["Sigmoid", "Mul", "Mul"]
    half = _silu_model((2, 4))
    for vi in [*half.graph.input, *half.graph.output]:
        vi.type.tensor_type.elem_type = TensorProto.FLOAT16
    ex = Executor(half, make_runtime(RuntimeConfig()))
    assert not ex.fused


def test_fuse_kernels_is_read_from_the_environment_once():
    """contract: LOCKSTEP_FUSE_KERNELS sets the runtime's configuration (an object), like its other settings."""
    assert RuntimeConfig.from_env({"LOCKSTEP_FUSE_KERNELS": "0"}).fuse_kernels is False
    assert RuntimeConfig.from_env({}).fuse_kernels is True
    with pytest.raises(ValueError, match="LOCKSTEP_FUSE_KERNELS"):
        RuntimeConfig.from_env({"LOCKSTEP_FUSE_KERNELS": "maybe"})


def test_the_bit_check_catches_a_wrong_fused_kernel(make_runtime, monkeypatch):
    """contract (the check can fail): a mutant fused kernel that drops the sigmoid (x*u) is caught by
    the byte comparison the tests above make."""
    def wrong(xp, out, g, u):
        xp.multiply(g, u, out=out)
        return True

    monkeypatch.setattr(fusion, "silu_mul_into", wrong)
    rng = np.random.default_rng(6)
    feeds = {"g": rng.standard_normal((1, 1, 64)).astype(np.float32), "u": rng.standard_normal((1, 1, 64)).astype(np.float32)}
    with pytest.raises(AssertionError, match="contract: the fused step's bits"):
        _same(make_runtime, _silu_model((1, 1, 64)), feeds, 1)


# -- pairs: two RotaryEmbeddings, two TensorScatters ------------------------------------------------

def _rope_pair_model(*, shared: bool = True, chained: bool = False, interleaved: int = 0, x_rank: int = 4):
    """q_rope, k_rope at one position_ids (their cos/sin caches one initializer pair, or copies under
    other names); ``chained``: k_rope rotates q_rope's output (not a pair)."""
    rng = np.random.default_rng(7)
    rows, half = 8, 4
    cos, sin = rng.standard_normal((rows, half)).astype(np.float32), rng.standard_normal((rows, half)).astype(np.float32)
    inits = [numpy_helper.from_array(cos, "cos"), numpy_helper.from_array(sin, "sin")]
    if not shared:
        inits += [numpy_helper.from_array(cos.copy(), "cos_k"), numpy_helper.from_array(sin.copy(), "sin_k")]
    attrs = {"interleaved": interleaved} if x_rank == 4 else {"interleaved": interleaved, "num_heads": 2}
    qs, ks = ((1, 4, 3, 8), (1, 2, 3, 8)) if x_rank == 4 else ((1, 3, 16), (1, 3, 16))
    nodes = [helper.make_node("RotaryEmbedding", ["xq", "cos", "sin", "pos"], ["yq"], name="q_rope", **attrs),
             helper.make_node("RotaryEmbedding", ["yq" if chained else "xk", *(("cos", "sin") if shared else ("cos_k", "sin_k")),
                                                  "pos"], ["yk"], name="k_rope", **attrs)]
    ins = [_f32("xq", qs), _f32("xk", ks), helper.make_tensor_value_info("pos", TensorProto.INT64, [1, 3])]
    return _graph(nodes, ins, [_f32("yq", qs), _f32("yk", qs if chained else ks)], inits), qs, ks


def _rope_feeds(qs, ks, pos=(2, 3, 4)):
    rng = np.random.default_rng(8)
    return {"xq": rng.standard_normal(qs).astype(np.float32), "xk": rng.standard_normal(ks).astype(np.float32),
            "pos": np.array([pos], np.int64)}


@pytest.mark.contract("fusion.same_bits")
@pytest.mark.parametrize("shared", [True, False], ids=["one-cache", "two-caches"])
@pytest.mark.parametrize("interleaved,x_rank", [(0, 4), (1, 4), (0, 3)])
def test_rotary_pair_fuses_with_its_nodes_bits(make_runtime, shared, interleaved, x_rank):
    """contract: two RotaryEmbeddings side by side (q with 4 heads, k with 2; 3-D with num_heads) fuse
    into one step with the nodes' bits (CuPy: one launch when they share one cache, else the nodes'
    kernels); result: one fused step."""
    m, qs, ks = _rope_pair_model(shared=shared, interleaved=interleaved, x_rank=x_rank)
    ex = _same(make_runtime, m, _rope_feeds(qs, ks), 1)
    assert [st.info.op_type for st in ex.steps] == ["RotaryPair"]


def test_a_rotary_reading_the_other_is_no_pair(make_runtime):
    """contract: a RotaryEmbedding of the first one's output runs after it (no pair)."""
    m, qs, ks = _rope_pair_model(chained=True)
    ex = Executor(m, make_runtime(RuntimeConfig()))
    assert not ex.fused and [st.info.op_type for st in ex.steps] == ["RotaryEmbedding", "RotaryEmbedding"]


@pytest.mark.contract("latch.first_site")
def test_a_fused_pair_checks_each_value_once_and_still_flags(make_runtime, monkeypatch):
    """contract: a position past the cache rows is DeviceAssert naming the fused step (its name holds
    q_rope); result: the pair launches one position check, the unfused nodes' first one only when their
    caches share names (two caches: one check per node unfused, one in the pair)."""
    from lockstep.reference_runtime import steps as steps_mod
    from lockstep.reference_runtime.errors import DeviceAssert

    calls: list[int] = []
    real = steps_mod.flag_check
    monkeypatch.setattr(steps_mod, "flag_check", lambda *a: (calls.append(1), real(*a))[1])
    m, qs, ks = _rope_pair_model(shared=False)
    Executor(m, make_runtime(RuntimeConfig())).run(_rope_feeds(qs, ks))
    assert len(calls) == 1, "result: one check of position_ids in the pair"
    calls.clear()
    Executor(m, make_runtime(OFF)).run(_rope_feeds(qs, ks))
    assert len(calls) == 2, "result: each node checks its own cache's rows unfused"
    ex = Executor(m, make_runtime(RuntimeConfig()))
    with pytest.raises(DeviceAssert, match="q_rope"):
        ex.run(_rope_feeds(qs, ks, pos=(2, 3, 8)))


def _scatter_pair_model(dtype=TensorProto.FLOAT):
    """present_value, present_key: TensorScatter of the value and key caches at one write index."""
    cache, upd = [1, 2, 6, 4], [1, 2, 1, 4]
    t = lambda n, s: helper.make_tensor_value_info(n, dtype, s)  # noqa: E731
    nodes = [helper.make_node("TensorScatter", ["pv", "v", "wi"], ["yv"], name="present_value", axis=2),
             helper.make_node("TensorScatter", ["pk", "k", "wi"], ["yk"], name="present_key", axis=2)]
    ins = [t("pv", cache), t("v", upd), t("pk", cache), t("k", upd), helper.make_tensor_value_info("wi", TensorProto.INT64, [1])]
    g = helper.make_graph(nodes, "g", ins, [t("yv", cache), t("yk", cache)])
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", 24)])


@pytest.mark.contract("fusion.same_bits")
@pytest.mark.parametrize("dtype", [TensorProto.FLOAT, TensorProto.FLOAT16], ids=["float32", "float16"])
def test_scatter_pair_fuses_with_its_nodes_bits_and_flags_a_bad_index(make_runtime, dtype):
    """contract: the key and value TensorScatters fuse with the nodes' bits (any one dtype: the pair
    copies elements), and a write index past the cache is DeviceAssert naming the fused step; result:
    one fused step."""
    from lockstep.reference_runtime.errors import DeviceAssert

    rng = np.random.default_rng(9)
    np_dt = np.float32 if dtype == TensorProto.FLOAT else np.float16
    feeds = {n: rng.standard_normal(s).astype(np_dt) for n, s in (("pv", (1, 2, 6, 4)), ("v", (1, 2, 1, 4)),
                                                                  ("pk", (1, 2, 6, 4)), ("k", (1, 2, 1, 4)))}
    feeds["wi"] = np.array([3], np.int64)
    ex = _same(make_runtime, _scatter_pair_model(dtype), feeds, 1)
    assert [st.info.op_type for st in ex.steps] == ["ScatterPair"]
    with pytest.raises(DeviceAssert, match="present_value"):
        ex.run(dict(feeds, wi=np.array([6], np.int64)))
