"""Raw-bit storage of the small types (bfloat16, float8, float8e8m0, float4/float6, int4/uint4,
int2/uint2) on a device without them: the conversions (``kernels._cast_util``) bit for bit
against ml_dtypes, the simulated device modelling CuPy's dtypes (``RawSimDevice``), the
executor's decode/native/raw paths (``kernels._small``), and every ONNX node case that has a
small type, run through that path: what ref-cuda runs, on numpy. With ``--devices=cupy`` (the GPU
lane) the device-parametrized tests run the same checks on CuPy itself (ref-cuda)."""

from __future__ import annotations

import numpy as np
import pytest
from lockstep.kernels import Kernel
from lockstep.kernels import _cast_util as cu
from lockstep.kernels._op import OpKernel
from lockstep.reference_runtime.backends.sim import RawSimDevice, SimDevice
from lockstep.reference_runtime.engine import RefEngine, _dtypes, sim_engine, sim_raw_engine
from lockstep.reference_runtime.errors import DeviceAssert
from lockstep.reference_runtime.executor import Executor
from lockstep.loading import UnsupportedModel
from lockstep.reference_runtime.runtime import Runtime
from onnx import TensorProto, helper

SMALL = sorted(cu.SMALL_DTYPES)
FLOATS = [n for n in SMALL if not n.startswith(("int", "uint"))]
INTS = [n for n in SMALL if n.startswith(("int", "uint"))]


def codes(name: str) -> np.ndarray:
    """Every bit pattern of the type, in its storage dtype (65536 for bfloat16)."""
    return np.arange(1 << min(cu.bit_width(name), 16)).astype(cu.storage_dtype(name))


def same_floats(a: np.ndarray, b: np.ndarray) -> bool:
    """Bit-equal float32 arrays, any NaN equal to any NaN."""
    nan = np.isnan(a)
    return bool(np.array_equal(nan, np.isnan(b)) and np.array_equal(a[~nan].view(np.uint32), b[~nan].view(np.uint32)))


def float32_sample() -> np.ndarray:
    """Every float32 upper half (sign, exponent, 7 mantissa bits: all of bfloat16's grid) with low
    halves on and around each rounding boundary: ties, just below, just above, zero, all ones."""
    hi = np.arange(1 << 16, dtype=np.uint32) << np.uint32(16)
    lows = np.array([0, 1, 0x3FFF, 0x4000, 0x7FFF, 0x8000, 0x8001, 0xBFFF, 0xFFFF], dtype=np.uint32)
    return (hi[:, None] | lows[None, :]).ravel().view(np.float32)


# ----------------------------------------------------------------------------- conversions


@pytest.mark.parametrize("name", SMALL)
def test_decode_of_every_bit_pattern_is_ml_dtypes_value(name):
    c = codes(name)
    got = cu.decode(np, c, name)
    want = c.view(name).astype(cu.canonical_dtype(name))
    assert got.dtype == cu.canonical_dtype(name), "contract: the small type decodes to its canonical dtype"
    if got.dtype == np.float32:
        assert same_floats(got, want), "result: every code decodes to ml_dtypes' float32 value, bit for bit"
    else:
        assert np.array_equal(got, want), "result: every code decodes to ml_dtypes' integer value"


@pytest.mark.parametrize("name", [n for n in FLOATS if n != cu.E8M0])
def test_encode_rounds_as_ml_dtypes_astype(name):
    f = float32_sample()
    with np.errstate(invalid="ignore", over="ignore"):
        got = cu.raw(np, cu.encode(np, f, name, saturate=False))
        want = f.astype(name)
    both_nan = np.isnan(cu.decode(np, got, name)) & np.isnan(want.astype(np.float32))
    mismatch = (got != want.view(cu.storage_dtype(name))) & ~both_nan
    assert not mismatch.any(), (
        f"result: {int(mismatch.sum())} float32 values encode differently from ml_dtypes, e.g. {f[mismatch][:4]}")


def test_encode_e8m0_nearest_is_ml_dtypes_on_positive_normals():
    """float8e8m0 holds powers of two only; ml_dtypes' astype rounds to nearest (ONNX's Cast rounds
    up by default, and maps zero and negatives elsewhere: compared where both define the value)."""
    f = float32_sample()
    keep = np.isfinite(f) & (f >= np.float32(2.0 ** -126))
    got = cu.raw(np, cu.encode(np, f[keep], cu.E8M0, saturate=False, round_mode="nearest"))
    assert np.array_equal(got, f[keep].astype(cu.E8M0).view(np.uint8)), "result: as ml_dtypes on every positive normal"


@pytest.mark.parametrize("name", INTS)
def test_encode_integers_wraps_as_ml_dtypes(name):
    v = np.arange(-300, 300, dtype=np.int32)
    mask = np.uint8((1 << cu.bit_width(name)) - 1)
    got = cu.raw(np, cu.encode(np, v, name))
    assert np.array_equal(got & mask, v.astype(name).view(np.uint8) & mask), "result: low bits kept, as ml_dtypes"


@pytest.mark.parametrize("name", SMALL)
def test_decode_then_encode_gives_back_every_code_but_nan_payloads(name):
    c = codes(name)
    if name == cu.E8M0:
        back = cu.raw(np, cu.encode(np, cu.decode(np, c, name), name, saturate=False, round_mode="nearest"))
    else:
        back = cu.raw(np, cu.encode(np, cu.decode(np, c, name), name, saturate=False))
    if name in INTS:
        mask = (1 << cu.bit_width(name)) - 1
        assert np.array_equal(back & mask, c), "result: every integer code round trips"
        return
    nan = np.isnan(cu.decode(np, c, name))
    assert np.array_equal(back[~nan], c[~nan]), "result: every non-NaN code round trips bit for bit"
    assert np.isnan(cu.decode(np, back[nan], name)).all(), "result: a NaN stays a NaN (its payload canonical)"


# ----------------------------------------------------------------------------- the device


@pytest.mark.parametrize("name", SMALL)
def test_upload_download_round_trip_is_bit_exact_with_nan_payloads(name):
    host = codes(name).view(name)  # every pattern, NaN payloads and negative zeros included
    rt = Runtime(RawSimDevice())
    t = rt.upload(host)
    assert t.dtype == np.dtype(name), "contract: the tensor keeps its logical dtype"
    out = rt.download(t)
    assert out.dtype == np.dtype(name), "contract: download gives the logical dtype back"
    assert np.array_equal(out.view(cu.storage_dtype(name)), host.view(cu.storage_dtype(name))), \
        "result: the bytes round trip exactly"


@pytest.mark.parametrize("name", SMALL)
def test_every_device_round_trips_the_small_types_bit_for_bit(device_name, make_runtime, name):
    """On CuPy (the GPU lane) the raw-bit storage itself: upload, a device-to-device copy, and
    ``download`` (one copy) and ``memcpy_dtoh_many`` (with the latch) give every pattern back."""
    host = codes(name).view(name)
    rt = make_runtime()
    t = rt.upload(host)
    u = rt.empty(host.shape, name)
    rt.copy(u, t)
    store = cu.storage_dtype(name)
    for out in (rt.download(t), rt.download(u), rt.device.memcpy_dtoh(u.ref, rt.compute)):
        assert out.dtype == np.dtype(name), "contract: the logical dtype comes back"
        assert np.array_equal(out.view(store), host.view(store)), "result: every bit pattern, NaN payloads included"


def test_a_small_type_model_gives_ref_sims_bits_on_every_device(device_name, make_runtime):
    """decode (Mul, Softmax), native (Cast, DequantizeLinear) and raw (Transpose, BitCast) nodes on
    the device under test against the simulated device with ml_dtypes arrays: the same bytes
    (on CuPy, the raw-bit path; rounding once where ml_dtypes rounds once)."""
    m = _model([helper.make_node("Mul", ["a", "b"], ["m"]), helper.make_node("Transpose", ["m"], ["t"]),
                helper.make_node("Cast", ["t"], ["f8"], to=TensorProto.FLOAT8E4M3FN),
                helper.make_node("BitCast", ["f8"], ["bits"], to=TensorProto.UINT8),
                helper.make_node("DequantizeLinear", ["q", "s"], ["d"])],
               [*(helper.make_tensor_value_info(n, TensorProto.BFLOAT16, [2, 3]) for n in "ab"),
                helper.make_tensor_value_info("q", TensorProto.INT4, [4]),
                helper.make_tensor_value_info("s", TensorProto.BFLOAT16, [])],
               [helper.make_tensor_value_info("bits", TensorProto.UINT8, [3, 2]),
                helper.make_tensor_value_info("t", TensorProto.BFLOAT16, [3, 2]),
                helper.make_tensor_value_info("d", TensorProto.BFLOAT16, [4])], opset=26)
    feeds = {"a": np.array([[1.0078125, 3, -7], [1e38, 0.1, np.nan]], dtype="bfloat16"),
             "b": np.array([[1.0078125, -0.5, 2], [100, 3, 1]], dtype="bfloat16"),
             "q": np.array([-8, -1, 0, 7], dtype="int4"), "s": np.array(0.375, dtype="bfloat16")}
    with np.errstate(all="ignore"):
        want = Executor(m, Runtime(SimDevice())).run(feeds)
        runs = [Executor(m, make_runtime()).run(feeds), Executor(m, Runtime(RawSimDevice())).run(feeds)]
    for got in runs:  # the device under test, and CuPy's model on numpy
        for name in ("bits", "t", "d"):
            assert got[name].dtype == want[name].dtype, f"contract: {name} keeps its type"
            assert got[name].tobytes() == want[name].tobytes(), f"result: {name} has ref-sim's bytes"


def test_kernel_bodies_get_the_storage_bits():
    seen = []

    def body(xp, x, y):
        seen.append((x.dtype, y.dtype))
        y[...] = x

    copy = Kernel("copy_bits", body, writes=(1,))
    host = np.array([1.5, -2.0, np.inf, np.nan], dtype="bfloat16")
    for dev, want in ((RawSimDevice(), np.dtype(np.uint16)), (SimDevice(), np.dtype("bfloat16"))):
        rt = Runtime(dev)
        x, y = rt.upload(host), rt.empty((4,), "bfloat16")
        rt.launch(copy, x, y)
        assert np.array_equal(rt.download(y).view(np.uint16), host.view(np.uint16)), "result: bits copied"
        assert seen[-1] == (want, want), f"contract: a body on {type(dev).__name__} sees {want}"


# ----------------------------------------------------------------------------- the executor


def _model(nodes, inputs, outputs, opset=21):
    graph = helper.make_graph(nodes, "g", inputs, outputs)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)])


def test_decode_path_computes_in_float32_and_rounds_once_to_nearest_even():
    m = _model([helper.make_node("Mul", ["a", "b"], ["y"])],
               [helper.make_tensor_value_info(n, TensorProto.BFLOAT16, [3]) for n in "ab"],
               [helper.make_tensor_value_info("y", TensorProto.BFLOAT16, [3])])
    a = np.array([1.0078125, 3.0, 1e38], dtype="bfloat16")  # 1 + 2**-7: the product is a tie
    b = np.array([1.0078125, -0.5, 100.0], dtype="bfloat16")
    ex = Executor(m, Runtime(RawSimDevice()))
    for _ in range(2):  # the first run, then the execution plan's replay of it
        with np.errstate(over="ignore"):
            y, want = ex.run({"a": a, "b": b})["y"], a * b
        assert y.dtype == np.dtype("bfloat16"), "contract: the output keeps its logical type"
        assert y.view(np.uint16).tolist() == want.view(np.uint16).tolist(), \
            "result: ml_dtypes' product, bit for bit (a tie to even, a sign, an overflow to inf)"


def test_native_cast_keeps_its_saturation_on_raw_bits():
    m = _model([helper.make_node("Cast", ["x"], ["s"], to=TensorProto.FLOAT8E4M3FN),
                helper.make_node("Cast", ["x"], ["n"], to=TensorProto.FLOAT8E4M3FN, saturate=0)],
               [helper.make_tensor_value_info("x", TensorProto.FLOAT, [3])],
               [helper.make_tensor_value_info(n, TensorProto.FLOAT8E4M3FN, [3]) for n in "sn"])
    x = np.array([1000.0, -np.inf, 0.3], dtype=np.float32)
    out = Executor(m, Runtime(RawSimDevice())).run({"x": x})
    assert out["s"].view(np.uint8).tolist() == [0x7E, 0xFE, 0x2A], "result: saturated to +-448, 0.3 rounded"
    assert out["n"].view(np.uint8).tolist() == [0x7F, 0xFF, 0x2A], "result: NaN without saturation"


# Halfway values (ties go to the even integer), values just off a tie, out-of-range values of every
# 4- and 2-bit type, integers exact only in float64, and the undefined ones (NaN, +-inf: 0 here).
CAST_INPUTS = [0.5, 1.5, 2.5, -0.5, -1.5, -2.5, 7.5, -8.5, 3.5, -3.5, 0.49, 2.6, -2.6, -9.0, 16.0, 100.0, -100.0,
               15.5, -16.5, 2.0 ** 40 + 3, 2.0 ** 40 + 2.5, 1e30, np.nan, np.inf, -np.inf]
CAST_SOURCES = {"float32": TensorProto.FLOAT, "float16": TensorProto.FLOAT16, "float64": TensorProto.DOUBLE,
                "bfloat16": TensorProto.BFLOAT16}
CAST_TARGETS = {"int4": TensorProto.INT4, "uint4": TensorProto.UINT4, "int2": TensorProto.INT2,
                "uint2": TensorProto.UINT2}


def spec_cast_to_small_int(values: np.ndarray, to: str) -> list[int]:
    """ONNX's Cast to a 4- or 2-bit integer, from its definition (onnx docs/docsgen/source/technical/
    int4.md and int2.md, "Cast"): round to the nearest integer, ties to even (Python's ``round``),
    then keep the low bits (two's complement for the signed types). NaN and +-inf are undefined
    there; lockstep gives 0 (as ml_dtypes and ONNX Runtime 1.31 do)."""
    bits, out = cu.bit_width(to), []
    for v in values.astype(np.float64).tolist():
        n = (round(v) if np.isfinite(v) else 0) & ((1 << bits) - 1)
        out.append(n - (1 << bits) if to.startswith("int") and n >= 1 << (bits - 1) else n)
    return out


@pytest.mark.parametrize("to", sorted(CAST_TARGETS))
@pytest.mark.parametrize("src", sorted(CAST_SOURCES))
def test_cast_to_the_small_integers_rounds_half_to_even_then_keeps_the_low_bits(device_name, make_runtime, src, to):
    """Cast and CastLike from every float type to int4/uint4/int2/uint2 on the device under test
    (ref-sim's ml_dtypes arrays; ref-cuda's raw bits on CuPy) and on CuPy's model on numpy
    (RawSimDevice, engine ref-sim-raw): the spec's values, never ml_dtypes' astype (which truncates
    toward zero, and since 0.7 gives 0 out of range)."""
    m = _model([helper.make_node("Cast", ["x"], ["y"], to=CAST_TARGETS[to]),
                helper.make_node("CastLike", ["x", "like"], ["z"])],
               [helper.make_tensor_value_info("x", CAST_SOURCES[src], [len(CAST_INPUTS)]),
                helper.make_tensor_value_info("like", CAST_TARGETS[to], [1])],
               [helper.make_tensor_value_info(n, CAST_TARGETS[to], [len(CAST_INPUTS)]) for n in "yz"], opset=25)
    with np.errstate(over="ignore"):
        x = np.array(CAST_INPUTS, dtype=np.float64).astype(src)
    feeds = {"x": x, "like": np.zeros(1, dtype=to)}
    want = spec_cast_to_small_int(x, to)
    for rt in (make_runtime(), Runtime(RawSimDevice())):
        out = Executor(m, rt).run(feeds)
        for name in "yz":
            assert out[name].dtype == np.dtype(to), f"contract: {name} is {to}"
            got = cu.decode(np, out[name], to).astype(int).tolist()
            assert got == want, (f"result: {src} -> {to} on {type(rt.device).__name__} ({name}): "
                                 f"inputs {x.tolist()}, got {got}, the spec gives {want}")


def test_quantize_linear_to_the_small_integers_still_rounds_and_saturates():
    """QuantizeLinear's own rule (round half to even, then saturate to the type's range), which the
    Cast rule's wrapping must not reach: on ref-sim and on raw bits."""
    m = _model([helper.make_node("QuantizeLinear", ["x", "s", "zp"], ["q"])],
               [helper.make_tensor_value_info("x", TensorProto.FLOAT, [8]),
                helper.make_tensor_value_info("s", TensorProto.FLOAT, []),
                helper.make_tensor_value_info("zp", TensorProto.INT4, [])],
               [helper.make_tensor_value_info("q", TensorProto.INT4, [8])], opset=21)
    feeds = {"x": np.array([0.5, 1.5, 2.5, -2.5, 7.5, -8.5, 100, -9], np.float32),
             "s": np.array(1.0, np.float32), "zp": np.zeros((), "int4")}
    for rt in (Runtime(SimDevice()), Runtime(RawSimDevice())):
        q = Executor(m, rt).run(feeds)["q"]
        assert cu.decode(np, q, "int4").tolist() == [0, 2, 2, -2, 7, -8, 7, -8], \
            f"result: rounded half to even, saturated to [-8, 7] on {type(rt.device).__name__}"


def test_raw_path_bitcast_moves_bits_and_dequantize_knows_its_float8_input():
    m = _model([helper.make_node("BitCast", ["x"], ["b"], to=TensorProto.INT8),
                helper.make_node("DequantizeLinear", ["x", "s", "z"], ["d"])],
               [helper.make_tensor_value_info("x", TensorProto.FLOAT8E4M3FN, [3]),
                helper.make_tensor_value_info("s", TensorProto.FLOAT, []),
                helper.make_tensor_value_info("z", TensorProto.FLOAT8E4M3FN, [])],
               [helper.make_tensor_value_info("b", TensorProto.INT8, [3]),
                helper.make_tensor_value_info("d", TensorProto.FLOAT, [3])], opset=26)
    x = np.array([0x38, 0xFF, 0x80], dtype=np.uint8).view("float8_e4m3fn")  # 1.0, NaN (payload), -0.0
    out = Executor(m, Runtime(RawSimDevice())).run(
        {"x": x, "s": np.array(2.0, dtype=np.float32), "z": np.array(1.0, dtype="float8_e4m3fn")})
    assert out["b"].view(np.uint8).tolist() == [0x38, 0xFF, 0x80], "result: BitCast moved the bits, NaN included"
    d = out["d"]
    assert d[0] == 2.0 and np.isnan(d[1]) and d[2] == 0 and np.signbit(d[2]), \
        "result: a float8 zero point is zero by definition (ignored), as on ref-sim"


def test_a_captured_small_type_segment_replays_under_the_capture_guard():
    """decode and native paths inside a captured graph: no host reads (the guard would raise)."""
    from lockstep.reference_runtime.segments import CaptureSession

    m = _model([helper.make_node("Mul", ["a", "b"], ["m"]), helper.make_node("Softmax", ["m"], ["s"]),
                helper.make_node("Cast", ["s"], ["y"], to=TensorProto.FLOAT8E4M3FN)],
               [helper.make_tensor_value_info(n, TensorProto.BFLOAT16, [2, 3]) for n in "ab"],
               [helper.make_tensor_value_info("y", TensorProto.FLOAT8E4M3FN, [2, 3])])
    a, b = np.arange(6).reshape(2, 3).astype("bfloat16"), np.ones((2, 3), "bfloat16")
    want = Executor(m, Runtime(SimDevice())).run({"a": a, "b": b})["y"]
    session = CaptureSession(Executor(m, Runtime(RawSimDevice(capture_guard=True))))
    outs = [session.run({"a": a, "b": b})["y"] for _ in range(3)]
    assert session.failure is None and session.counters.replays == 2, "contract: captured once, replayed twice"
    assert all(o.view(np.uint8).tolist() == want.view(np.uint8).tolist() for o in outs), "result: ref-sim's bits"


def test_out_of_range_index_on_raw_bits_is_a_named_device_assert():
    m = _model([helper.make_node("Gather", ["x", "i"], ["y"], name="gather_bf16")],
               [helper.make_tensor_value_info("x", TensorProto.BFLOAT16, [4]),
                helper.make_tensor_value_info("i", TensorProto.INT64, [2])],
               [helper.make_tensor_value_info("y", TensorProto.BFLOAT16, [2])])
    ex = Executor(m, Runtime(RawSimDevice()))
    x = np.arange(4).astype("bfloat16")
    assert ex.run({"x": x, "i": np.array([3, -4])})["y"].tolist() == [3.0, 0.0], "result: in-range gather"
    with pytest.raises(DeviceAssert, match="gather_bf16"):
        ex.run({"x": x, "i": np.array([4, 0])})


def test_a_kernel_that_makes_a_small_type_array_itself_is_named_on_the_raw_device():
    """CuPy cannot make a bfloat16 array; numpy can: the raw-bit device refuses the result, so a
    kernel that would break on the GPU breaks here too (a KernelHostError naming the node)."""
    from lockstep.kernels import KernelHostError
    from lockstep.kernels._op import Spec
    from lockstep.kernels.registry import Registry

    op = OpKernel("ToBf16", lambda node, specs: [Spec(specs[0].shape, np.dtype("bfloat16"))],
                  lambda xp, node, x: (x.astype(node.out_specs[0].dtype),), domain="com.example", small="native", capture="safe")
    graph = helper.make_graph([helper.make_node("ToBf16", ["x"], ["y"], name="to_bf16", domain="com.example")], "g",
                              [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2])],
                              [helper.make_tensor_value_info("y", TensorProto.BFLOAT16, [2])])
    m = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21), helper.make_opsetid("com.example", 1)])
    x = np.array([1.5, 3.0], np.float32)
    assert Executor(m, Runtime(SimDevice()), registry=Registry([op])).run({"x": x})["y"].tolist() == [1.5, 3.0], \
        "result: ml_dtypes arrays are fine on ref-sim"
    with pytest.raises(KernelHostError, match=r"node 'to_bf16'.*returned a bfloat16 array"):
        Executor(m, Runtime(RawSimDevice()), registry=Registry([op])).run({"x": x})


def test_bad_small_declaration_and_raw_storage_off_the_simulated_device_are_refused():
    with pytest.raises(ValueError, match="small must be decode/native/raw"):
        OpKernel("X", lambda node, specs: [], lambda xp, node: (), small="bits", capture="safe")
    with pytest.raises(ValueError, match="raw_storage"):
        RefEngine("cupy", raw_storage=True)


def test_raw_engine_holds_cupys_dtypes_plus_the_small_types_and_keeps_strings_on_the_host():
    eng = sim_raw_engine()
    assert eng.name == "ref-sim-raw" and eng.available()[0], "contract: a named, always available engine"
    strings = _model([helper.make_node("Identity", ["x"], ["y"])],
                     [helper.make_tensor_value_info("x", TensorProto.STRING, [2])],
                     [helper.make_tensor_value_info("y", TensorProto.STRING, [2])])
    out = eng.prepare(strings)({"x": np.array(["a", "bc"], dtype=object)})
    assert out[0].tolist() == ["a", "bc"], "result: a string tensor passes through on the host (host values)"


def _arrays(values) -> list:
    """The arrays among outputs (a sequence's elements in order; an empty optional gives none)."""
    out = []
    for v in values:
        if isinstance(v, (list, tuple)):
            out.extend(_arrays(v))
        elif v is not None:
            out.append(np.asarray(v))
    return out


# ----------------------------------------------------------------------------- ONNX's node cases

# Cases with a small type that the raw-bit path cannot pass although ref-sim does: case -> reason.
# Empty: every such case passes on the raw path wherever it passes on ref-sim.
RAW_ONLY_FAILURES: dict[str, str] = {}


# Ops whose outputs are random draws (unseeded ones draw afresh each run).
RANDOM_OPS = frozenset({"Bernoulli", "RandomUniform", "RandomUniformLike", "RandomNormal", "RandomNormalLike", "Multinomial"})


def _small_cases():
    from lockstep.reference_runtime.node_cases import load_cases

    return [c for c in load_cases() if _dtypes(c.proto()) & cu.SMALL_DTYPES]


def _ref_sim_xfails(names: set[str]) -> set[str]:
    """The cases among ``names`` that ref-sim's expectations make strict xfails with the installed
    versions (e.g. the casts whose expected values ml_dtypes 0.7 gets wrong)."""
    from lockstep.conformance import expectations
    from lockstep.paths import package_path

    entries = expectations.load(package_path("lockstep.conformance.node_suite", "expectations.toml"))
    return {n for e in entries if e.engine == "ref-sim" and e.kind == "xfail" and expectations.applies(e)
            for p in e.patterns for n in expectations.filter_keys(names, p)}


def _raw_engine(device_name: str):
    """The raw-bit engine on the device under test: ref-sim-raw on the simulated device (CuPy's
    path on numpy), ref-cuda itself on CuPy (the GPU lane: ``--devices=cupy``)."""
    return sim_raw_engine() if device_name == "sim" else RefEngine(device_name)


def test_every_small_type_node_case_runs_on_raw_bits_as_on_ref_sim(device_available):
    """On the simulated device, the prediction of ref-cuda on these cases; on CuPy, ref-cuda
    itself: on raw bits each passes, or fails as ref-sim does (a kernel not written yet:
    ref-sim's expectation covers it), or is listed above."""
    from lockstep.reference_runtime.node_cases import run_case

    cases = _small_cases()
    assert len(cases) >= 190, "contract: ONNX's small-type cases were found (190 in onnx 1.23)"
    raw, sim = _raw_engine(device_available), sim_engine()
    wrong, passed = [], 0
    for case in cases:
        got = run_case(raw, case)
        if got.status == "passed":
            passed += 1
            continue
        if case.name in RAW_ONLY_FAILURES:
            continue
        ref = run_case(sim, case)
        if ref.status == "passed" or ref.status != got.status:
            wrong.append(f"{case.name}: raw {got.status} ({got.detail[:120]}), ref-sim {ref.status}")
    assert not wrong, "result: raw bits differ from ref-sim on\n" + "\n".join(wrong)
    known = _ref_sim_xfails({c.name for c in cases})
    assert passed >= len(cases) - 1 - len(known), (
        f"contract: the path was exercised (all but the Loop case and ref-sim's {len(known)} strict xfails "
        f"of these versions pass today; {passed} of {len(cases)} passed)")
    stale = [n for n in RAW_ONLY_FAILURES if run_case(raw, next(c for c in cases if c.name == n)).status == "passed"]
    assert not stale, f"contract: listed cases that now pass: {stale}"



def _twin(case, elem: int, dtype: str):
    """``case``'s model and inputs with every float32 tensor made ``elem`` (None: nothing to turn)."""
    from onnx import numpy_helper

    model, turned = case.proto(), False
    g = model.graph
    for vi in [*g.input, *g.output, *g.value_info]:
        if vi.type.HasField("tensor_type") and vi.type.tensor_type.elem_type == TensorProto.FLOAT:
            vi.type.tensor_type.elem_type, turned = elem, True
    for t in g.initializer:
        if t.data_type == TensorProto.FLOAT:
            t.CopyFrom(numpy_helper.from_array(numpy_helper.to_array(t).astype(dtype), t.name))
            turned = True
    inputs = [x.astype(dtype) if isinstance(x, np.ndarray) and x.dtype == np.float32 else x for x in case.inputs]
    if not turned or not all(isinstance(x, np.ndarray) for x in inputs):
        return None
    return model, inputs


def test_small_type_twins_of_every_float_case_agree_with_ref_sim(device_available):
    """Every float32 node case turned bfloat16 (and float8e5m2 for the data-movement ops), run on
    ref-sim (ml_dtypes arrays) and on raw bits wherever ref-sim runs it: the same dtypes and
    shapes; bit for bit through the ops of ``_small.MOVES`` (raw mode); within a bfloat16 rounding
    or two elsewhere (decode mode rounds once where ml_dtypes rounds after every step)."""
    import warnings

    from lockstep.kernels._small import MOVES
    from lockstep.reference_runtime.node_cases import _feeds, load_cases

    raw, sim = _raw_engine(device_available), sim_engine()
    compared, moved, wrong = 0, 0, []
    refused = []  # twins the raw path refuses by design (Unsupported, named), checked below
    for case in load_cases():
        ops = {n.op_type for n in case.proto().graph.node}
        if ops & RANDOM_OPS:
            continue  # fresh draws per run: nothing to compare (the seeded ones draw from p, a rounded input)
        moves_only = ops <= MOVES
        for elem, dtype in ((TensorProto.BFLOAT16, "bfloat16"), (TensorProto.FLOAT8E5M2, "float8_e5m2")):
            if dtype != "bfloat16" and not moves_only:
                continue
            twin = _twin(case, elem, dtype)
            if twin is None:
                continue
            model, inputs = twin
            feeds = _feeds(model, inputs)
            with warnings.catch_warnings(), np.errstate(all="ignore"):
                warnings.simplefilter("ignore")
                try:
                    want = sim.prepare(model)(feeds)
                except Exception:
                    continue  # not a case ref-sim runs in this type: nothing to compare with
                try:
                    got = raw.prepare(model)(feeds)
                except UnsupportedModel as exc:
                    refused.append(case.name)
                    if "FlexAttention with score_mod/prob_mod on a raw-bit device" not in str(exc):
                        wrong.append(f"{case.name} ({dtype}): {type(exc).__name__}: {str(exc)[:200]}")
                    continue
                except Exception as exc:
                    wrong.append(f"{case.name} ({dtype}): {type(exc).__name__}: {str(exc)[:200]}")
                    continue
            compared += 1
            moved += moves_only
            for a, b in zip(_arrays(want), _arrays(got)):
                if (a.dtype, a.shape) != (b.dtype, b.shape):
                    wrong.append(f"{case.name} ({dtype}): {b.dtype}{b.shape}, ref-sim {a.dtype}{a.shape}")
                elif moves_only and a.tobytes() != b.tobytes():
                    wrong.append(f"{case.name} ({dtype}): bits differ through data movement")
                elif not moves_only:
                    af, bf = a.astype(np.float64), b.astype(np.float64)
                    with np.errstate(invalid="ignore"):  # inf - inf: equal infinities pass by ==
                        close = np.abs(af - bf) <= 2.0 ** -6 * (1 + np.maximum(np.abs(af), np.abs(bf)))
                    if not (close | (np.isnan(af) & np.isnan(bf)) | (af == bf)).all():
                        wrong.append(f"{case.name} ({dtype}): values differ past two bfloat16 roundings")
    assert compared > 1000 and moved > 200, f"contract: the twins were run ({compared}, {moved} through moves)"
    assert sorted(refused) == sorted(c for c in {c.name for c in load_cases()} if c.startswith("test_flexattention_")
                                     and c.endswith(("score_mod", "prob_mod", "causal_mask", "soft_cap", "relative_positional"))), \
        f"contract: only FlexAttention with modifier subgraphs is refused on raw bits (a named Unsupported): {refused}"
    assert not wrong, "result: raw bits disagree with ref-sim on\n" + "\n".join(wrong)
