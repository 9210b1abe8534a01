"""com.microsoft contrib ops (kernels/ops_contrib.py) on ref-sim against onnxruntime's CPU provider.

Each test builds a one-node model, runs it on ``ref-sim`` and ``ort-cpu`` with the same random
feeds and compares every output (float32 to 1e-4 relative; float16 looser).
"""

from __future__ import annotations

import numpy as np
import pytest
from lockstep.kernels._op import OpError
from onnx import TensorProto as TP
from onnx import helper

from lockstep.engines.registry import load_engine

_ORT = load_engine("ort-cpu")
_REF = load_engine("ref-sim")
pytestmark = pytest.mark.skipif(not _ORT.available()[0], reason=f"ort-cpu: {_ORT.available()[1]}")

_NP = {TP.FLOAT: np.float32, TP.FLOAT16: np.float16, TP.DOUBLE: np.float64, TP.UINT8: np.uint8, TP.INT32: np.int32}
_ELEM = {np.dtype(v): k for k, v in _NP.items()}
_TOL = {np.float32: (1e-4, 1e-5), np.float64: (1e-9, 1e-12), np.float16: (5e-3, 1e-3)}


def _model(node, feeds: dict[str, np.ndarray], outputs: list[tuple[str, int, int]]):
    """A one-node model; every input declared with its feed's dtype and full shape, each output
    (name, elem_type, rank) with symbolic dims."""
    inputs = [helper.make_tensor_value_info(n, _ELEM[a.dtype], list(a.shape)) for n, a in feeds.items()]
    outs = [helper.make_tensor_value_info(n, t, [f"{n}_{d}" for d in range(r)]) for n, t, r in outputs]
    g = helper.make_graph([node], "g", inputs, outs)
    return helper.make_model(g, ir_version=10, opset_imports=[helper.make_opsetid("", 21),
                                                              helper.make_opsetid("com.microsoft", 1)])


def _compare(ref_model, feeds, ort_model=None, dtype=np.float32):
    got = _REF.prepare(ref_model)(feeds)
    want = _ORT.prepare(ort_model if ort_model is not None else ref_model)(feeds)
    assert len(got) == len(want)
    rtol, atol = _TOL[dtype]
    for i, (g, w) in enumerate(zip(got, want)):
        assert g.shape == w.shape and g.dtype == w.dtype, (i, g.shape, g.dtype, w.shape, w.dtype)
        np.testing.assert_allclose(g.astype(np.float64), w.astype(np.float64), rtol=rtol, atol=atol,
                                   err_msg=f"output {i}")
    return got


# -- SimplifiedLayerNormalization / SkipSimplifiedLayerNormalization ---------------------------

@pytest.mark.parametrize("shape,scale_shape,axis,dt,sdt,stash", [
    ((2, 3, 16), (16,), None, np.float32, np.float32, None),
    ((4, 32), (32,), -1, np.float32, np.float32, 1),
    ((2, 3, 8), (3, 8), -2, np.float32, np.float32, None),
    ((2, 3, 8), (1, 8), 1, np.float32, np.float32, None),
    ((2, 5, 8), (8,), None, np.float16, np.float16, None),
    ((2, 5, 8), (8,), None, np.float16, np.float32, None),
    ((3, 8), (8,), None, np.float64, np.float64, 1),
])
def test_simplified_layer_norm(shape, scale_shape, axis, dt, sdt, stash):
    rng = np.random.default_rng(0)
    feeds = {"x": (rng.standard_normal(shape) * 3).astype(dt), "g": rng.standard_normal(scale_shape).astype(sdt)}
    kw = {"epsilon": 1e-5}
    if axis is not None:
        kw["axis"] = axis
    if stash is not None:
        kw["stash_type"] = stash
    outs = [("y", _ELEM[np.dtype(sdt)], len(shape)), ("isv", TP.FLOAT, len(shape))]
    # ORT registers this op in the ai.onnx domain, which onnx.checker (and so the reference
    # runtime) rejects: the reference runs the com.microsoft spelling of the same node.
    ref = _model(helper.make_node("SimplifiedLayerNormalization", ["x", "g"], ["y", "isv"], domain="com.microsoft", **kw),
                 feeds, outs)
    ort = _model(helper.make_node("SimplifiedLayerNormalization", ["x", "g"], ["y", "isv"], **kw), feeds, outs)
    _compare(ref, feeds, ort, dtype=np.float16 if np.float16 in (dt, sdt) else dt)


@pytest.mark.parametrize("shape,skip_shape,bias,outputs,dt", [
    ((2, 3, 16), (2, 3, 16), True, ["y"], np.float32),
    ((2, 3, 16), (2, 3, 16), True, ["y", "mean", "isv", "sum"], np.float32),
    ((2, 3, 16), (1, 3, 16), False, ["y", "", "isv", "sum"], np.float32),
    ((2, 3, 16), (3, 16), True, ["y", "", "", "sum"], np.float32),
    ((5, 32), (5, 32), False, ["y", "mean", "isv"], np.float32),
    ((2, 4, 16), (2, 4, 16), True, ["y", "", "isv", "sum"], np.float16),
])
def test_skip_simplified_layer_norm(shape, skip_shape, bias, outputs, dt):
    rng = np.random.default_rng(1)
    H = shape[-1]
    feeds = {"x": rng.standard_normal(shape).astype(dt), "s": rng.standard_normal(skip_shape).astype(dt),
             "gamma": rng.standard_normal(H).astype(dt)}
    if bias:
        feeds["bias"] = rng.standard_normal(H).astype(dt)
    elem = _ELEM[np.dtype(dt)]
    types = {"y": elem, "mean": TP.FLOAT, "isv": TP.FLOAT, "sum": elem}
    node = helper.make_node("SkipSimplifiedLayerNormalization", list(feeds), outputs, domain="com.microsoft",
                            epsilon=1e-6)
    got = _compare(_model(node, feeds, [(o, types[o], len(shape)) for o in outputs if o]), feeds, dtype=dt)
    if "mean" in outputs:
        assert not got[1].any()  # ORT writes zeros for the simplified variant


def test_skip_simplified_layer_norm_refuses_a_bad_skip_shape():
    feeds = {"x": np.ones((2, 3, 8), np.float32), "s": np.ones((2, 1, 8), np.float32), "g": np.ones(8, np.float32)}
    node = helper.make_node("SkipSimplifiedLayerNormalization", ["x", "s", "g"], ["y"], domain="com.microsoft")
    with pytest.raises(OpError, match="skip shape"):
        _REF.prepare(_model(node, feeds, [("y", TP.FLOAT, 3)]))(feeds)


# -- MatMulNBits -------------------------------------------------------------------------------

def _quantized(rng, N, K, bits, block, zp_kind, dt):
    nb = -(-K // block)
    per = 8 // bits
    q = rng.integers(0, 1 << bits, (N, nb * block)).astype(np.uint8)
    packed = np.zeros((N, nb * block // per), np.uint8)
    for i in range(per):
        packed |= (q[:, i::per] << (i * bits)).astype(np.uint8)
    feeds = {"B": packed.reshape(N, nb, block * bits // 8), "scales": rng.uniform(0.01, 0.1, N * nb).astype(dt)}
    if zp_kind == "uint8":
        z = rng.integers(0, 1 << bits, (N, nb)).astype(np.uint8)
        zb = -(-nb * bits // 8)
        zpad = np.zeros((N, zb * per), np.uint8)
        zpad[:, :nb] = z
        zp = np.zeros((N, zb), np.uint8)
        for i in range(per):
            zp |= (zpad[:, i::per] << (i * bits)).astype(np.uint8)
        feeds["zp"] = zp.reshape(-1)
    elif zp_kind == "float":
        feeds["zp"] = rng.uniform(0, (1 << bits) - 1, N * nb).astype(dt)
    return feeds


@pytest.mark.parametrize("a_shape,N,bits,block,zp_kind,bias,dt", [
    ((3, 64), 16, 4, 16, None, False, np.float32),
    ((2, 3, 64), 24, 4, 32, "uint8", True, np.float32),
    ((2, 3, 80), 24, 4, 32, "uint8", False, np.float32),  # K not a multiple of block_size
    ((5, 200), 8, 4, 64, "float", True, np.float32),
    ((1, 1, 256), 32, 4, 128, "uint8", True, np.float32),
    ((4, 96), 16, 4, 128, None, True, np.float32),
    ((3, 64), 16, 2, 16, "uint8", True, np.float32),
    ((3, 64), 16, 8, 32, "uint8", False, np.float32),
    ((3, 64), 16, 8, 64, None, True, np.float32),
    ((3, 48), 16, 2, 16, None, False, np.float32),
    ((2, 64), 16, 4, 32, "uint8", True, np.float16),
])
def test_matmul_nbits(a_shape, N, bits, block, zp_kind, bias, dt):
    rng = np.random.default_rng(2)
    K = a_shape[-1]
    feeds = {"A": rng.standard_normal(a_shape).astype(dt)}
    feeds.update(_quantized(rng, N, K, bits, block, zp_kind, dt))
    if bias:
        feeds["bias"] = rng.standard_normal(N).astype(dt)
    ins = ["A", "B", "scales", "zp" if zp_kind else "", "", "bias" if bias else ""]
    while not ins[-1]:
        ins.pop()
    node = helper.make_node("MatMulNBits", ins, ["Y"], domain="com.microsoft", K=K, N=N, bits=bits,
                            block_size=block, accuracy_level=0)
    _compare(_model(node, feeds, [("Y", _ELEM[np.dtype(dt)], len(a_shape))]), feeds, dtype=dt)


def test_matmul_nbits_refuses_g_idx():
    feeds = {"A": np.ones((2, 32), np.float32), "B": np.zeros((4, 1, 16), np.uint8),
             "scales": np.ones(4, np.float32), "g_idx": np.zeros(32, np.int32)}
    node = helper.make_node("MatMulNBits", ["A", "B", "scales", "", "g_idx"], ["Y"], domain="com.microsoft",
                            K=32, N=4, bits=4, block_size=32)
    with pytest.raises(OpError, match="g_idx"):
        _REF.prepare(_model(node, feeds, [("Y", TP.FLOAT, 2)]))(feeds)


# -- GroupQueryAttention -----------------------------------------------------------------------

def _gqa_case(rng, *, B, S, nq, nkv, D, P, T, seqlens=None, rot=0, packed=False, dt=np.float32, attrs=None):
    """Feeds and node for one GQA call; P=None: no past inputs; rot: rotary dim (0: none)."""
    f = {}
    if packed:
        f["q"] = rng.standard_normal((B, S, (nq + 2 * nkv) * D)).astype(dt)
    else:
        f["q"] = rng.standard_normal((B, S, nq * D)).astype(dt)
        f["k"] = rng.standard_normal((B, S, nkv * D)).astype(dt)
        f["v"] = rng.standard_normal((B, S, nkv * D)).astype(dt)
    if P is not None:
        f["pk"] = rng.standard_normal((B, nkv, P, D)).astype(dt)
        f["pv"] = rng.standard_normal((B, nkv, P, D)).astype(dt)
    f["sk"] = np.asarray(seqlens if seqlens is not None else [T - 1] * B, np.int32)
    f["tsl"] = np.array(T, np.int32)
    kw = dict(num_heads=nq, kv_num_heads=nkv, **(attrs or {}))
    if rot:
        ang = rng.uniform(0, 2 * np.pi, (max(T, P or 0) + 3, rot // 2))
        f["cos"], f["sin"] = np.cos(ang).astype(dt), np.sin(ang).astype(dt)
        kw["do_rotary"] = 1
    names = ["q", "k", "v", "pk", "pv", "sk", "tsl", "cos", "sin"]
    ins = [n if n in f else "" for n in names]
    while not ins[-1]:
        ins.pop()
    node = helper.make_node("GroupQueryAttention", ins, ["out", "present_k", "present_v"], domain="com.microsoft", **kw)
    elem = _ELEM[np.dtype(dt)]
    return node, f, [("out", elem, 3), ("present_k", elem, 4), ("present_v", elem, 4)]


_GQA_CASES = {
    # prefill, no past inputs
    "prefill": dict(B=2, S=5, nq=4, nkv=2, D=16, P=None, T=5),
    "prefill_mha": dict(B=1, S=4, nq=2, nkv=2, D=32, P=None, T=4),
    # prefill with an empty past (dynamic cache)
    "prefill_empty_past": dict(B=2, S=4, nq=4, nkv=1, D=16, P=0, T=4),
    # prefill into a static (shared-buffer) cache of capacity 8, right-padded batch entry
    "prefill_static_padded": dict(B=2, S=4, nq=4, nkv=2, D=16, P=8, T=4, seqlens=[3, 1]),
    "prefill_padded_rotary": dict(B=2, S=4, nq=4, nkv=2, D=16, P=None, T=4, seqlens=[3, 1], rot=16),
    # decode: growing cache (present = past ++ new), ragged batch
    "decode_growing": dict(B=2, S=1, nq=4, nkv=2, D=16, P=6, T=7, seqlens=[6, 3]),
    # decode: static cache, capacity 10 > total 7, ragged
    "decode_static": dict(B=3, S=1, nq=6, nkv=2, D=16, P=10, T=7, seqlens=[6, 2, 4]),
    # a later prompt chunk (B must be 1), growing and static
    "chunk_growing": dict(B=1, S=3, nq=4, nkv=2, D=16, P=5, T=8),
    "chunk_static": dict(B=1, S=3, nq=4, nkv=2, D=16, P=12, T=8),
    # rotary: half-split and interleaved, full and partial rotary dim
    "rotary_prefill": dict(B=2, S=5, nq=4, nkv=2, D=16, P=None, T=5, rot=16),
    "rotary_interleaved_decode": dict(B=2, S=1, nq=4, nkv=2, D=16, P=9, T=7, seqlens=[6, 2], rot=16,
                                      attrs=dict(rotary_interleaved=1)),
    "rotary_partial_chunk": dict(B=1, S=3, nq=4, nkv=2, D=32, P=5, T=8, rot=16),
    "packed_rotary_decode": dict(B=2, S=1, nq=4, nkv=2, D=16, P=6, T=7, seqlens=[6, 4], rot=16, packed=True),
    "packed_prefill": dict(B=1, S=4, nq=2, nkv=1, D=16, P=None, T=4, packed=True),
    # attributes
    "local_window": dict(B=1, S=7, nq=4, nkv=2, D=16, P=None, T=7, attrs=dict(local_window_size=3)),
    "local_window_decode": dict(B=2, S=1, nq=4, nkv=2, D=16, P=8, T=7, seqlens=[6, 3], attrs=dict(local_window_size=2)),
    "window_padded_rows": dict(B=2, S=5, nq=4, nkv=2, D=16, P=None, T=5, seqlens=[4, 0], attrs=dict(local_window_size=2)),
    # Gemma 2's local layers from GenAI's builder: a shared buffer holding every position (no eviction)
    "sliding_window_cache_prefill": dict(B=1, S=6, nq=4, nkv=2, D=16, P=12, T=6, rot=16,
                                         attrs=dict(local_window_size=3, sliding_window_cache=1, softcap=4.0)),
    "sliding_window_cache_decode": dict(B=1, S=1, nq=4, nkv=2, D=16, P=12, T=9, rot=16,
                                        attrs=dict(local_window_size=3, sliding_window_cache=1)),
    "softcap_scale": dict(B=1, S=5, nq=4, nkv=2, D=16, P=None, T=5, attrs=dict(softcap=2.0, scale=0.4)),
    "not_causal": dict(B=2, S=1, nq=4, nkv=2, D=16, P=4, T=5, seqlens=[4, 2], attrs=dict(causal=0)),
    "float16_prefill": dict(B=2, S=4, nq=4, nkv=2, D=16, P=None, T=4, rot=16, dt=np.float16),
    "float16_decode": dict(B=2, S=1, nq=4, nkv=2, D=16, P=8, T=6, seqlens=[5, 3], rot=16, dt=np.float16),
}


@pytest.mark.parametrize("name", list(_GQA_CASES))
def test_group_query_attention(name):
    case = _GQA_CASES[name]
    node, feeds, outs = _gqa_case(np.random.default_rng(3), **case)
    if (case.get("attrs") or {}).get("sliding_window_cache"):
        # ORT leaves the present rows past the filled ones unwritten in this mode (seen as leftovers of
        # earlier runs): only rows < total_sequence_length are specified
        model, T = _model(node, feeds, outs), case["T"]
        got, want = _REF.prepare(model)(feeds), _ORT.prepare(model)(feeds)
        for i, (g, w) in enumerate(zip(got, want)):
            g, w = (g, w) if i == 0 else (g[:, :, :T], w[:, :, :T])
            np.testing.assert_allclose(g, w, rtol=1e-4, atol=1e-5, err_msg=f"output {i}")
        return
    _compare(_model(node, feeds, outs), feeds, dtype=case.get("dt", np.float32))


def test_group_query_attention_prefill_then_decode_steps():
    """Prefill, then three decode steps feeding present back as past (growing cache)."""
    rng = np.random.default_rng(4)
    B, nq, nkv, D, S0 = 2, 4, 2, 16, 3
    node, feeds, outs = _gqa_case(rng, B=B, S=S0, nq=nq, nkv=nkv, D=D, P=0, T=S0, rot=16)
    ang = rng.uniform(0, 2 * np.pi, (16, D // 2))  # one cache for every step
    cos, sin = np.cos(ang).astype(np.float32), np.sin(ang).astype(np.float32)
    feeds["cos"], feeds["sin"] = cos, sin
    _, pk, pv = _compare(_model(node, feeds, outs), feeds)
    for step in range(3):
        T = S0 + step + 1
        node, feeds, outs = _gqa_case(rng, B=B, S=1, nq=nq, nkv=nkv, D=D, P=T - 1, T=T, rot=16)
        feeds.update(pk=pk, pv=pv, cos=cos, sin=sin)
        _, pk, pv = _compare(_model(node, feeds, outs), feeds)
    assert pk.shape == (B, nkv, S0 + 3, D)


@pytest.mark.parametrize("attrs,match", [
    (dict(smooth_softmax=1), "smooth_softmax"),
    (dict(sliding_window_cache=1, local_window_size=4), "sliding_window_cache"),
    (dict(k_quant_type="PER_TENSOR"), "k_quant_type"),
])
def test_group_query_attention_refuses_unsupported_attributes(attrs, match):
    node, feeds, outs = _gqa_case(np.random.default_rng(5), B=1, S=2, nq=2, nkv=1, D=16, P=None, T=2, attrs=attrs)
    with pytest.raises(OpError, match=match):
        _REF.prepare(_model(node, feeds, outs))(feeds)


def test_group_query_attention_refuses_an_inconsistent_total_length():
    # past 2 + new 3 = 5: total 4 is neither a growing (5) nor a static (<= 2) cache; ORT refuses it too
    node, feeds, outs = _gqa_case(np.random.default_rng(6), B=1, S=3, nq=2, nkv=1, D=16, P=2, T=4)
    with pytest.raises(OpError, match="total_sequence_length"):
        _REF.prepare(_model(node, feeds, outs))(feeds)


def test_onnxruntime_also_refuses_an_inconsistent_total_length():
    # result about ONNX Runtime, not a lockstep contract: 1.31 refuses this case (our reference follows
    # it); 1.30 (the H200's) accepted it silently, so older versions are a visible skip, not a failure
    import onnxruntime

    if tuple(int(x) for x in onnxruntime.__version__.split(".")[:2]) < (1, 31):
        pytest.skip(f"onnxruntime {onnxruntime.__version__} accepts an inconsistent total_sequence_length "
                    "(observed with 1.30 on the H200); the refusal is checked on >= 1.31")
    node, feeds, outs = _gqa_case(np.random.default_rng(6), B=1, S=3, nq=2, nkv=1, D=16, P=2, T=4)
    with pytest.raises(Exception, match="total_sequence_length"):
        _ORT.prepare(_model(node, feeds, outs))(feeds)


@pytest.mark.parametrize("case", [
    dict(B=1, S=0, nq=2, nkv=1, D=16, P=None, T=0),   # an empty prompt: ORT "total_sequence_length must be positive"
    dict(B=1, S=0, nq=2, nkv=1, D=16, P=3, T=3),      # no new token after a past
    dict(B=0, S=2, nq=2, nkv=1, D=16, P=None, T=2),   # no batch entry
])
def test_group_query_attention_refuses_empty_inputs(case):
    # contract: an empty query (fuzz seed 41 case 4298: an empty input_ids into tiny-int4-genai) is an
    # OpError naming the length, not a reshape's ValueError from the kernel's host code (KernelHostError)
    node, feeds, outs = _gqa_case(np.random.default_rng(7), seqlens=[max(case["T"] - 1, 0)] * case["B"], **case)
    with pytest.raises(OpError, match="must be positive"):
        _REF.prepare(_model(node, feeds, outs))(feeds)


def _resident(t, capacity, window):
    # ONNX Runtime's schema (Windowed KV Cache): L(T) = T up to C, then T - G * ceil((T - C) / G), G = C - W + 1
    g = capacity - window + 1
    return t if t <= capacity else t - g * -(-(t - capacity) // g)


@pytest.mark.parametrize("C,W,steps,rot", [
    (3, 3, [2, 1, 1, 1, 1], 16),     # C == W (what ORT's CUDA provider requires): G = 1, one row a step
    (5, 3, [4, 1, 1, 1, 1, 1], 0),  # slack: G = 3 positions evicted at once
    (4, 4, [9, 1, 1], 16),          # a prompt longer than the buffer (S > C)
    (6, 3, [2, 3, 4, 1], 16),       # multi-token chunks crossing evictions
])
def test_group_query_attention_window_sized_cache_evicts_as_onnxruntime_does(C, W, steps, rot):
    """sliding_window_cache=1 with a window-sized buffer (Gemma 2/3's local layers, the builder's
    ``past_sliding_length``): step after step, present fed back as past, equal to ONNX Runtime's CPU
    kernel on the output and on the resident rows [0, L(t)) of the present."""
    # result: ONNX Runtime's CPU provider is the reference (before this kernel evicted, it refused the case)
    rng = np.random.default_rng(C * 100 + W)
    nq, nkv, D = 4, 2, 16
    horizon = sum(steps)
    cos = sin = None
    if rot:
        ang = rng.uniform(0, 2 * np.pi, (horizon + 4, rot // 2))
        cos, sin = np.cos(ang).astype(np.float32), np.sin(ang).astype(np.float32)
    pk = pv = np.zeros((1, nkv, C, D), np.float32)
    t = 0
    for i, S in enumerate(steps):
        t += S
        # the scalar is the shared buffer's mask length (GenAI's builder: Shape(attention_mask)), above C
        node, feeds, outs = _gqa_case(rng, B=1, S=S, nq=nq, nkv=nkv, D=D, P=C, T=horizon, seqlens=[t - 1], rot=rot,
                                      attrs=dict(local_window_size=W, sliding_window_cache=1, softcap=4.0))
        feeds.update(pk=pk, pv=pv)
        if rot:
            feeds.update(cos=cos, sin=sin)
        model = _model(node, feeds, outs)
        got, want = _REF.prepare(model)(feeds), _ORT.prepare(model)(feeds)
        keep = _resident(t, C, W)
        np.testing.assert_allclose(got[0], want[0], rtol=1e-4, atol=1e-5, err_msg=f"step {i}: output")
        for k in (1, 2):
            assert got[k].shape == (1, nkv, C, D)
            np.testing.assert_allclose(got[k][:, :, :keep], want[k][:, :, :keep], rtol=1e-5, atol=1e-6,
                                       err_msg=f"step {i}: present {k}, resident rows [0, {keep})")
        pk, pv = got[1], got[2]


def test_group_query_attention_refuses_a_window_cache_under_the_window():
    # contract: sliding_window_cache=1 with a buffer of fewer rows than local_window_size (or none) is
    # refused, naming both (ONNX Runtime: "KV cache capacity (0) must be at least local_window_size")
    node, feeds, outs = _gqa_case(np.random.default_rng(8), B=1, S=1, nq=2, nkv=1, D=16, P=2, T=7,
                                  attrs=dict(local_window_size=3, sliding_window_cache=1))
    with pytest.raises(OpError, match=r"KV cache capacity \(2, axis 2 of past_key\) must be at least local_window_size \(3\)"):
        _REF.prepare(_model(node, feeds, outs))(feeds)


@pytest.mark.parametrize("alpha,dt", [(None, np.float32), (1.0, np.float32), (2.5, np.float64)])
def test_quick_gelu(alpha, dt):
    # result: ONNX Runtime's CPU kernel (Optimum's --optimize O2 writes it for Llama's SiLU)
    import onnxruntime

    if np.dtype(dt) == np.float64 and not onnxruntime.__version__.startswith("1.31."):
        pytest.skip(f"onnxruntime {onnxruntime.__version__} has no float64 QuickGelu kernel (1.31 does)")
    x = (np.random.default_rng(9).standard_normal((2, 3, 8)) * 4).astype(dt)
    node = helper.make_node("QuickGelu", ["x"], ["y"], domain="com.microsoft",
                            **({} if alpha is None else {"alpha": alpha}))
    _compare(_model(node, {"x": x}, [("y", _ELEM[np.dtype(dt)], 3)]), {"x": x}, dtype=dt)
