"""``OpKernel.into``, the eager fast path (kernels/_op.py): every kernel that has one is checked
against its own ``compute`` over ONNX's node cases on numpy, the golden models' hot ops are checked
to take it, and the CuPy-only kernel sources (kernels/_fast.py, _fused.py, _linalg.py) are checked
as far as a machine without a GPU can: they format, they compile with NVRTC, and numpy transliterations of the kernels whose
summation order differs from ``compute`` agree with it within the node suite's tolerances. Each
test says whether it asserts a *contract* (the fast path's rules) or a *result* (values).
"""

from __future__ import annotations

import collections
import dataclasses
import os
import re
import sys
import warnings

import numpy as np
import onnx
import onnx.numpy_helper
import pytest

from lockstep.kernels import _fast, _fused, _launch, _linalg
from lockstep.kernels._op import NodeInfo, Spec
from lockstep.kernels.registry import REGISTRY
from lockstep.reference_runtime.steps import node_attrs
from lockstep.reference_runtime.node_cases import load_cases

_SENTINEL = 0xA5


def _kernels_with_into():
    return [k for ks in REGISTRY._by_op.values() for k in ks if k.into is not None]


def _call(case):
    """(kernel, NodeInfo for this run, input arrays) of a one-node case whose kernel has ``into``,
    built as the executor builds them; None when the case is not such a node or shape inference
    refuses it (an error case)."""
    model = case.proto()
    if len(model.graph.node) != 1:
        return None
    node = model.graph.node[0]
    domain = "" if node.domain == "ai.onnx" else node.domain
    opsets = {("" if o.domain == "ai.onnx" else o.domain): o.version for o in model.opset_import}
    kernel = REGISTRY.lookup(domain, node.op_type, opsets.get(domain, 0))
    if kernel is None or kernel.into is None:
        return None
    init = {t.name for t in model.graph.initializer}
    names = [vi.name for vi in model.graph.input if vi.name not in init]
    feeds = dict(zip(names, (onnx.numpy_helper.to_array(x) if isinstance(x, onnx.TensorProto) else x
                             for x in case.inputs)))
    if any(not isinstance(v, np.ndarray) for v in feeds.values()) or any(i and i not in feeds for i in node.input):
        return None
    arrays = [np.ascontiguousarray(feeds[i]) if i else None for i in node.input]
    specs = [None if a is None else Spec(a.shape, a.dtype, a if i in kernel.host_inputs else None)
             for i, a in enumerate(arrays)]
    info = NodeInfo(node.name or node.op_type, node.op_type, domain, opsets[domain], node_attrs(node, None),
                    len(node.input), len(node.output))
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            out_specs = kernel.shapes(info, specs)
    except Exception:
        return None
    host = {i: specs[i].value for i in kernel.host_inputs if i < len(specs) and specs[i] is not None}
    return kernel, dataclasses.replace(info, out_specs=tuple(out_specs), host=host), arrays


def _sentinel_outs(specs):
    outs = tuple(np.empty(s.shape, s.dtype) for s in specs)
    for o in outs:
        o.reshape(-1).view(np.uint8)[...] = _SENTINEL
    return outs


def _cases():
    got = [(c.name, _call(c)) for c in load_cases()]
    return [(name, call) for name, call in got if call is not None]


_CASES = _cases()


def test_into_kernels_exist_and_have_node_cases():
    """Contract: the fast path is declared on the elementwise, shape, index, linalg, attention and
    normalisation kernels the decode step runs, and ONNX's node cases exercise each op that has it."""
    ops = {k.op_type for k in _kernels_with_into()}
    assert {"Add", "Mul", "Sub", "Equal", "LessOrEqual", "Cast", "Where", "Transpose", "Slice", "Concat", "Expand",
            "Gather", "ReduceSum", "Shape", "MatMul", "Sigmoid", "RMSNormalization", "RotaryEmbedding",
            "TensorScatter", "Attention"} <= ops
    covered = {call[1].op_type for _, call in _CASES}
    assert {"Add", "Equal", "Cast", "Where", "Transpose", "Slice", "Concat", "Expand", "Gather", "ReduceSum",
            "Shape", "MatMul", "RMSNormalization", "RotaryEmbedding", "TensorScatter", "Attention"} <= covered


def _computed(xp, kernel, info, arrays, refused: str) -> list:
    """``compute``'s outputs copied into arrays of the promised specs with the executor's casting
    (what ``into`` must equal); a case ``compute`` refuses is skipped with ``refused``."""
    try:
        results = kernel.compute(xp, info, *arrays)
    except Exception:
        pytest.skip(refused)
    want = []
    for spec, res in zip(info.out_specs, results):
        w = xp.empty(spec.shape, spec.dtype)
        xp.copyto(w, xp.asarray(res), casting="unsafe")
        want.append(w)
    return want


@pytest.mark.parametrize("name,call", _CASES, ids=[n for n, _ in _CASES])
def test_into_writes_computes_bytes_or_nothing(name, call):
    """Contract: ``into`` returning True wrote exactly ``compute``'s bytes (copied with the executor's
    casting) into every output; returning False left every output byte untouched."""
    kernel, info, arrays = call
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        want = _computed(np, kernel, info, arrays, "compute refuses this case (an error case of the op)")
        outs = _sentinel_outs(info.out_specs)
        took = kernel.into(np, info, outs, *arrays)
    assert took in (True, False)
    for _spec, out, w in zip(info.out_specs, outs, want):
        if took:
            assert out.tobytes() == w.tobytes(), f"{name}: into's bytes differ from compute's"
        else:
            assert set(out.reshape(-1).view(np.uint8).tolist()) <= {_SENTINEL}, f"{name}: into wrote, then said False"


def _fast_path_counts(model_name: str, tokens: bytes, steps: int):
    """{op_type: (True returns, False returns)} of ``into`` over a greedy decode on the simulated device."""
    from lockstep.decoding import greedy
    from lockstep.engines.registry import load_engine
    from lockstep.golden.anchors import MODEL_DIR

    counts: dict[str, list[int]] = collections.defaultdict(lambda: [0, 0])
    originals = {}
    for k in _kernels_with_into():
        def counting(xp, node, outs, *args, _inner=k.into):
            took = _inner(xp, node, outs, *args)
            counts[node.op_type][0 if took else 1] += 1
            return took

        originals[id(k)] = (k, k.into)
        object.__setattr__(k, "into", counting)  # frozen dataclass: patched for this run only
    try:
        dec = load_engine("ref-sim").decoder(onnx.load(str(MODEL_DIR / f"{model_name}.onnx")))
        greedy(dec, list(tokens), steps)
    finally:
        for k, into in originals.values():
            object.__setattr__(k, "into", into)
    return {op: tuple(c) for op, c in counts.items()}


@pytest.mark.parametrize("model_name", ["tiny-fp32-standard-kv64", "tiny-fp32-standard"])
def test_golden_hot_ops_take_the_fast_path_on_numpy(model_name):
    """Contract: on the simulated device every node of these ops in the golden models' decode takes
    the fast path (``into`` returns True): the ops whose ``into`` has a numpy form. RMSNormalization,
    Attention and Sigmoid are CuPy-only fused kernels (numpy keeps ``compute``)."""
    counts = _fast_path_counts(model_name, b"The quick", 3)
    numpy_forms = {"MatMul", "Gather", "Transpose", "Add", "Mul", "RotaryEmbedding", "TensorScatter", "Shape",
                   "Equal", "Cast", "ReduceSum", "Sub", "LessOrEqual", "Slice", "Range"}
    for op, (took, fell) in counts.items():
        if op in numpy_forms:
            assert fell == 0 and took > 0, f"{op}: {fell} of {took + fell} nodes fell back to compute"
    cuda_only = {"RMSNormalization", "Attention", "Sigmoid"}
    assert all(counts[op][0] == 0 for op in cuda_only if op in counts)
    assert {"MatMul", "Gather", "RotaryEmbedding"} <= set(counts)


# -- the CuPy-only kernel sources ---------------------------------------------------------------------

_SOURCES = {
    "gather": _fast.GATHER_SRC.format(S=4, I="int64", T="unsigned int", IT="long long"),
    "flag": _fast.FLAG_SRC.format(I="int64", IT="long long"),
    "fill": _fast.FILL_SRC.format(S=8, T="unsigned long long"),
    "matmul_rows": _linalg._ROWS_SRC.format(name="float32", T="float", ACC="float"),
    "matmul_warp": _linalg._WARP_SRC.format(name="float32", T="float", ACC="float"),
    "rms_norm": _fused.RMS_NORM_SRC,
    "rope": _fused.ROPE_SRC,
    "ts_full": _fused.TS_FULL_SRC.format(S=4, I="int64", T="unsigned int", IT="long long"),
    "ts_update": _fused.TS_UPDATE_SRC.format(S=4, I="int64", T="unsigned int", IT="long long"),
    "kv_concat": _fused.KV_CONCAT_SRC,
    "attention": _fused.ATTENTION_SRC,
    "binary": _fast.BINARY_SRC.format(op="less_equal", dt="int64", T="long long", OT="unsigned char", EXPR="x <= y"),
    "permute": _fast.PERMUTE_SRC.format(S=4, T="unsigned int"),
    "sigmoid": _fast.SIGMOID_SRC.format(dt="float32", T="float", BODY=_fast._SIGMOID_BODY["float32"]),
    "range": _fast.RANGE_SRC.format(dt="int64", T="long long"),
    "cast": _fast.CAST_SRC.format(src="bool", dst="float32", S="bool", D="float"),
    # the fused steps' kernels (reference_runtime/fusion.py)
    "silu_mul": _fused.SILU_MUL_SRC.format(BODY=_fast._SIGMOID_BODY["float32"]),
    "add_rms_norm": _fused.ADD_RMS_NORM_SRC,
    "matmul_group": _linalg._GROUP_SRC.format(name="float32", T="float", ACC="float"),
    "matmul_group_f64": _linalg._GROUP_SRC.format(name="float64", T="double", ACC="double"),
    "rope_pair": _fused.ROPE_PAIR_SRC,
    "ts_update_pair": _fused.TS_UPDATE_PAIR_SRC.format(S=2, I="int32", T="unsigned short", IT="int"),
}


@pytest.mark.parametrize("name", sorted(_SOURCES))
def test_cuda_sources_format_as_c(name):
    """Contract: each RawKernel source formats (no stray braces) into balanced C with one
    ``extern "C" __global__`` entry named ``lockstep_*``; the GPU lane compiles and runs them
    (the node suite on ref-cuda)."""
    src = _SOURCES[name]
    assert src.count("{") == src.count("}") and src.count("(") == src.count(")")
    entries = re.findall(r'extern "C" __global__ void (lockstep_\w+)\(', src)
    assert len(entries) == 1, entries
    assert "{{" not in src and "{S}" not in src and "{T}" not in src


def _nvrtc():
    """cuda-bindings' NVRTC, the ``nvidia-cuda-nvrtc`` wheel's libraries loaded first (the bindings look
    for them elsewhere); None when that wheel or cuda-bindings is not installed (the dev extra installs
    both on Linux)."""
    import ctypes
    from importlib import metadata

    try:
        files = metadata.files("nvidia-cuda-nvrtc") or []
        metadata.version("cuda-bindings")
    except metadata.PackageNotFoundError:
        return None
    libs = sorted((f for f in files if f.name.startswith(("libnvrtc.so", "libnvrtc-builtins.so"))),
                  key=lambda f: "builtins" not in f.name)  # the builtins library first: libnvrtc needs it
    for f in libs:
        ctypes.CDLL(str(f.locate()), mode=ctypes.RTLD_GLOBAL)
    from cuda.bindings import nvrtc

    return nvrtc


@pytest.mark.parametrize("name", sorted(_SOURCES))
def test_cuda_sources_compile_with_nvrtc(name):
    """Contract: each RawKernel source compiles with NVRTC for compute_90 (the lane's H100/H200), no
    GPU needed: a source that would not compile fails here, not on the first GPU run. Skipped, counted,
    only where the nvidia-cuda-nvrtc or cuda-bindings wheel is absent (a failure under
    LOCKSTEP_REQUIRE_DEV_TOOLS=1, as .ci/run sets it); installed but not loading is a failure."""
    nvrtc = _nvrtc()
    if nvrtc is None:
        why = "nvidia-cuda-nvrtc or cuda-bindings is not installed (pip install -e '.[dev]' on Linux brings them)"
        if os.environ.get("LOCKSTEP_REQUIRE_DEV_TOOLS") == "1" and sys.platform == "linux":  # the extra's marker
            pytest.fail(f"{why}, and LOCKSTEP_REQUIRE_DEV_TOOLS=1 requires them")
        pytest.skip(why)
    ok = nvrtc.nvrtcResult.NVRTC_SUCCESS
    err, prog = nvrtc.nvrtcCreateProgram(_SOURCES[name].encode(), f"{name}.cu".encode(), 0, [], [])
    assert err == ok, err
    try:
        opts = [b"--gpu-architecture=compute_90"]
        (err,) = nvrtc.nvrtcCompileProgram(prog, len(opts), opts)
        _, size = nvrtc.nvrtcGetProgramLogSize(prog)
        log = b" " * size
        nvrtc.nvrtcGetProgramLog(prog, log)
        assert err == ok, f"{name}: NVRTC: {log.rstrip(bytes(1)).decode(errors='replace').strip()}"
    finally:
        nvrtc.nvrtcDestroyProgram(prog)


def _rms_norm_kernel_numpy(x, scale, eps):
    """RMS_NORM_SRC transliterated: 256 strided float32 partial sums, a halving tree, then the row."""
    rows = x.reshape(-1, scale.size).astype(np.float32)
    out = np.empty_like(rows)
    for r, xr in enumerate(rows):
        part = np.zeros(256, np.float32)
        for c in range(xr.size):
            part[c % 256] = np.float32(part[c % 256] + np.float32(xr[c] * xr[c]))
        s = 128
        while s:
            part[:s] = part[:s] + part[s:2 * s]
            s //= 2
        inv = np.float32(1) / np.sqrt(np.float32(part[0] / np.float32(xr.size)) + np.float32(eps))
        out[r] = xr * inv * scale.reshape(-1)
    return out.reshape(x.shape)


def test_rms_norm_kernel_order_agrees_with_compute():
    """Result: the fused RMSNormalization's summation order (strided partials, a tree) stays within
    float32 rounding of ``compute`` (rtol 1e-6 on golden-sized rows)."""
    from lockstep.kernels.ops_nn import _rms_norm_compute

    rng = np.random.default_rng(0)
    x, scale = rng.standard_normal((3, 640)).astype(np.float32), rng.standard_normal(640).astype(np.float32)
    info = NodeInfo("n", "RMSNormalization", "", 23, {"epsilon": 1e-5}, 2, 1, out_specs=(Spec(x.shape, x.dtype),))
    (want,) = _rms_norm_compute(np, info, x, scale)
    np.testing.assert_allclose(_rms_norm_kernel_numpy(x, scale, 1e-5), want, rtol=1e-6, atol=1e-7)


def _attention_kernel_numpy(q, k, v, mask, past_k, past_v, scale, causal):
    """ATTENTION_SRC transliterated per (batch, head, query) row: k-ascending dot products, the bias
    as the kernel builds it, NaN-propagating max, 128 strided partial sums and a tree."""
    kk = k if past_k is None else np.concatenate((past_k, k), axis=2)
    vv = v if past_v is None else np.concatenate((past_v, v), axis=2)
    B, Hq, Sq, D = q.shape
    P = 0 if past_k is None else past_k.shape[2]
    T, group = kk.shape[2], Hq // k.shape[1]
    s = np.float32(np.sqrt(scale))
    y = np.empty(q.shape[:3] + (v.shape[3],), np.float32)
    neg = np.float32(-np.inf)
    for b, h, i in np.ndindex(B, Hq, Sq):
        qs, ks = q[b, h, i] * s, kk[b, h // group] * s
        acc = np.zeros(T, np.float32)
        for d in range(D):  # acc += a * b: one rounding per term (the GPU fuses it; within tolerance)
            acc = np.float32(acc + qs[d] * ks[:, d])
        mval = np.zeros(T, np.float32)
        if mask is not None:
            m = np.broadcast_to(mask, (B, Hq, Sq, mask.shape[-1]))[b, h, i]
            m = np.where(m, np.float32(0), neg) if m.dtype == np.bool_ else m.astype(np.float32)
            mval = np.concatenate((m, np.full(T - m.size, neg, np.float32)))
        cv = np.where(np.arange(T) <= i + P, np.float32(0), neg)
        bias = mval + cv if causal else np.float32(0) + mval
        wb = acc + bias
        xmax = wb.max()
        e = np.exp(wb - (np.float32(0) if xmax == neg else xmax))
        part = np.zeros(128, np.float32)
        for j in range(T):
            part[j % 128] += e[j]
        st = 64
        while st:
            part[:st] = part[:st] + part[st:2 * st]
            st //= 2
        p = e / (np.float32(1) if part[0] == 0 else part[0]) if (bias != neg).any() else np.zeros(T, np.float32)
        y[b, h, i] = (p[:, None] * vv[b, h // group]).sum(axis=0, dtype=np.float32)
    return y


@pytest.mark.parametrize("causal,mask_kind,past", [(0, "bool", True), (1, None, False), (0, "float", False)])
def test_attention_kernel_agrees_with_compute(causal, mask_kind, past):
    """Result: the fused Attention's arithmetic (bias, masked rows, softmax, GQA) agrees with
    ``compute`` within the node suite's float32 tolerance (rtol 1e-5)."""
    from lockstep.kernels._attention import _attention_compute

    rng = np.random.default_rng(1)
    B, Hq, Hkv, Sq, S, P, D = 2, 4, 2, 3, 5, 4, 8
    q = rng.standard_normal((B, Hq, Sq, D)).astype(np.float32)
    k, v = (rng.standard_normal((B, Hkv, S, D)).astype(np.float32) for _ in range(2))
    pk, pv = ((rng.standard_normal((B, Hkv, P, D)).astype(np.float32) for _ in range(2)) if past else (None, None))
    T = S + (P if past else 0)
    mask = None
    if mask_kind == "bool":
        mask = rng.random((B, 1, Sq, T - 1)) > 0.3
        mask[0, 0, 0] = False  # a fully masked row: zeros
    elif mask_kind == "float":
        mask = rng.standard_normal((Sq, T)).astype(np.float32)
    info = NodeInfo("n", "Attention", "", 23, {"is_causal": causal, "scale": 0.3}, 6, 1,
                    out_specs=(Spec((B, Hq, Sq, D), np.dtype(np.float32)),))
    (want,) = _attention_compute(np, info, q, k, v, mask, pk, pv)
    got = _attention_kernel_numpy(q, k, v, mask, pk, pv, 0.3, causal)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)


def _unravel(e: int, dims: tuple[int, ...], strides: tuple[int, ...]) -> int:
    """The index arithmetic of BINARY_SRC/PERMUTE_SRC (kernels/_fast.py), transliterated."""
    r, i = e, 0
    for j in range(len(dims) - 1, 0, -1):
        k = r % dims[j]
        r //= dims[j]
        i += k * strides[j]
    return i + r * strides[0]


@pytest.mark.parametrize("sa,sb", [((2, 3, 4), (4,)), ((2, 1, 4), (1, 3, 1)), ((1,), (5, 2)), ((3, 4), (3, 4)),
                                   ((2, 3, 1, 5), (3, 4, 1)), ((), (2, 2))])
def test_the_strided_binary_kernels_index_as_numpy_broadcasts(sa, sb):
    """Result: the CuPy binary RawKernel's operand indices (transliterated, padded to 6 dims)
    give numpy's broadcast of a + b, element for element (the GPU lane runs the kernel itself)."""
    from lockstep.kernels._fast import _broadcast_strides, _pad

    rng = np.random.default_rng(0)
    a, b = rng.standard_normal(sa).astype(np.float32), rng.standard_normal(sb).astype(np.float32)
    out = np.broadcast_shapes(sa, sb)
    d, ia, ib = _pad(out, 1), _pad(_broadcast_strides(sa, out), 0), _pad(_broadcast_strides(sb, out), 0)
    got = [a.ravel()[_unravel(e, d, ia)] + b.ravel()[_unravel(e, d, ib)] for e in range(int(np.prod(out)))]
    assert np.array_equal(np.asarray(got, np.float32).reshape(out), a + b)
    assert _broadcast_strides((3,), (2, 4)) is None, "contract: a shape that does not broadcast is refused"


@pytest.mark.parametrize("shape", [(2, 3, 4), (1, 2, 3, 4), (5,), (2, 3, 4, 5, 6)])
def test_the_permute_kernel_indexes_as_numpy_transposes(shape):
    """Result: the CuPy permute RawKernel's source indices (transliterated) give ``x.transpose(perm)``."""
    import itertools

    from lockstep.kernels._fast import _contiguous_strides, _pad

    x = np.arange(int(np.prod(shape)), dtype=np.float32).reshape(shape)
    src = _contiguous_strides(shape)
    for perm in list(itertools.permutations(range(len(shape))))[:24]:
        out = tuple(shape[p] for p in perm)
        d, s = _pad(out, 1), _pad(tuple(src[p] for p in perm), 0)
        got = [x.ravel()[_unravel(e, d, s)] for e in range(x.size)]
        assert np.array_equal(np.asarray(got, np.float32).reshape(out), x.transpose(perm)), perm


# fused kernels that sum in another order than CuPy's reductions, and the decode products' warp kernel
# (lanes, then a shuffle tree) against compute's tiles
_REORDERED = {"RMSNormalization", "Attention", "MatMul"}


@pytest.mark.parametrize("name,call", _CASES, ids=[n for n, _ in _CASES])
def test_into_on_cupy_matches_compute_on_cupy(name, call):
    """Contract (GPU only): on CuPy, ``into`` returning True wrote ``compute``'s bytes, except the
    reordered kernels (``_REORDERED``), which stay within the case's tolerances; False wrote nothing."""
    cp = pytest.importorskip("cupy")
    kernel, info, arrays = call
    from lockstep.reference_runtime.backends.cupy import CupyDevice

    dtypes = [a.dtype for a in arrays if a is not None] + [np.dtype(s.dtype) for s in info.out_specs]
    if any(dt.name not in CupyDevice.ARRAY_DTYPES for dt in dtypes):  # inputs and outputs alike
        pytest.skip("CuPy holds the small ONNX types as raw bits: compute's business")
    dev = [None if a is None else cp.asarray(a) for a in arrays]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        want = [cp.asnumpy(w) for w in _computed(cp, kernel, info, dev, "compute refuses this case on CuPy")]
        outs = tuple(cp.asarray(o) for o in _sentinel_outs(info.out_specs))
        took = kernel.into(cp, info, outs, *dev)
    case = next(c for c in load_cases() if c.name == name)
    for out, w in zip(outs, want):
        got = cp.asnumpy(out)
        if not took:
            assert set(got.reshape(-1).view(np.uint8).tolist()) <= {_SENTINEL}
        elif info.op_type in _REORDERED:
            np.testing.assert_allclose(got, w, rtol=case.rtol, atol=case.atol)
        else:
            assert got.tobytes() == w.tobytes(), f"{name}: into's bytes differ from compute's on CuPy"


def test_the_warp_matmul_order_stays_within_float32_rounding():
    """Result: the decode products' warp kernel (kernels/_linalg.py ``_WARP_SRC``), transliterated:
    32 lane sums (k = lane, lane + 32, ...) folded by the shuffle tree 16, 8, 4, 2, 1, in float32,
    agree with numpy's product to float32 rounding (another order than the tiles, not another sum)."""
    rng = np.random.default_rng(1)
    for K, N in ((64, 64), (256, 64), (64, 256), (7, 3)):
        a = rng.standard_normal((1, K)).astype(np.float32)
        b = rng.standard_normal((K, N)).astype(np.float32)
        got = np.empty((1, N), np.float32)
        for col in range(N):
            lanes = [np.float32(0)] * 32
            for lane in range(32):
                for k in range(lane, K, 32):
                    lanes[lane] = np.float32(lanes[lane] + np.float32(a[0, k] * b[k, col]))
            off = 16
            while off:
                lanes = [np.float32(lanes[i] + lanes[i + off]) if i + off < 32 else lanes[i] for i in range(32)]
                off //= 2
            got[0, col] = lanes[0]
        np.testing.assert_allclose(got, a.astype(np.float64) @ b.astype(np.float64), rtol=1e-5, atol=1e-5)


def _other_values(a: np.ndarray) -> np.ndarray:
    """The same dtype and shape, other values from the same set (a roll: indices stay valid)."""
    return np.roll(a.reshape(-1), 1).reshape(a.shape) if a.size > 1 else a


@pytest.mark.parametrize("name,call", _CASES, ids=[n for n, _ in _CASES])
def test_a_recorded_into_relaunches_its_bytes_on_cupy(name, call):
    """Contract (GPU only): when ``into`` ran under a ``LaunchRecorder`` with a complete record (RawKernel
    launches only, ``RecordingModule`` in place of cupy), relaunching the record through the driver
    with the parameter blocks CupyStream packs (``_pack``) after the inputs' values changed in place
    writes, into poisoned outputs, the bytes a fresh ``into`` writes for the
    new values: the record reads its inputs on the device and writes every output byte. A case
    whose record is refused (other CuPy work) is skipped, naming what refused it."""
    cp = pytest.importorskip("cupy")
    kernel, info, arrays = call
    from lockstep.reference_runtime.backends.cupy import CupyDevice

    dtypes = [a.dtype for a in arrays if a is not None] + [np.dtype(s.dtype) for s in info.out_specs]
    if any(dt.name not in CupyDevice.ARRAY_DTYPES for dt in dtypes):
        pytest.skip("CuPy holds the small ONNX types as raw bits: compute's business")
    dev = [None if a is None else cp.asarray(a) for a in arrays]
    rec = _launch.LaunchRecorder()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        outs = tuple(cp.asarray(o) for o in _sentinel_outs(info.out_specs))
        with _launch.recording(rec):
            took = kernel.into(_launch.RecordingModule(cp, rec), info, outs, *dev)
    if not took or not rec.complete:
        pytest.skip(f"not recorded: {'into declined' if not took else rec.refused or 'no launch'}")
    for i, (a, d) in enumerate(zip(arrays, dev)):
        if d is not None and i not in kernel.host_inputs:  # host values are baked in the call, as in a plan
            d[...] = cp.asarray(_other_values(a))
    for o in outs:
        o.reshape(-1).view(cp.uint8)[...] = 0x5A
    from lockstep.reference_runtime.backends.cupy import _pack

    stream = cp.cuda.get_current_stream()
    packed = [_pack(cp, *launch) for launch in rec.launches]  # as CupyStream.relaunch does
    assert all(p is not None for p in packed), "the kernels pass device arrays and numpy scalars only"
    for fn, gx, gy, gz, bx, by, bz, smem, params, _blob in packed:
        cp.cuda.driver.launchKernel(fn, gx, gy, gz, bx, by, bz, smem, stream.ptr, params, 0)
    fresh = tuple(cp.asarray(o) for o in _sentinel_outs(info.out_specs))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        assert kernel.into(cp, info, fresh, *dev)
    for out, want in zip(outs, fresh):
        assert cp.asnumpy(out).tobytes() == cp.asnumpy(want).tobytes(), f"{name}: the relaunch's bytes differ"
