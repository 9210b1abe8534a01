"""MatMulNBits' 4-bit host kernels (kernels/_nbits_host.py), the simulated device's: their value
against the dequantized weight's float64 product, their thread and chunk invariance, and that the
executor takes them (no dequantized copy kept)."""

from __future__ import annotations

import numpy as np
import pytest
from lockstep.kernels import _nbits_host
from lockstep.kernels._contrib_util import dequantize_blocks

pytestmark = pytest.mark.skipif(not _nbits_host.AVAILABLE, reason="numba is not importable (a dependency)")


def _weights(rng, n, k, block, zp_kind):
    nb = -(-k // block)
    packed = rng.integers(0, 256, (n, nb, block // 2), dtype=np.uint8)
    scales = rng.uniform(0.01, 0.1, n * nb).astype(np.float32)
    if zp_kind == "uint8":
        zp = rng.integers(0, 256, n * -(-nb // 2), dtype=np.uint8)
    elif zp_kind == "float":
        zp = rng.uniform(0, 15, n * nb).astype(np.float32)
    else:
        zp = None
    return packed, scales, zp


CASES = [  # (M, N, K, block, zero points)
    (1, 16, 64, 16, None),
    (1, 33, 80, 32, "uint8"),  # K not a multiple of the block, an odd block count
    (3, 24, 200, 64, "float"),
    (5, 8, 256, 128, "uint8"),
    (7, 300, 4096, 32, None),  # past the threaded minimum
    (1, 3000, 512, 32, "uint8"),
]


@pytest.mark.parametrize("m,n,k,block,zp_kind", CASES)
def test_the_fused_product_is_the_dequantized_weights_product(m, n, k, block, zp_kind):
    """Result: within float32 rounding of the float64 product of the dequantized weight (what the
    ONNX Runtime contrib op defines: ``(q - zero_point) * scale`` per block)."""
    rng = np.random.default_rng(m * 1000 + n)
    packed, scales, zp = _weights(rng, n, k, block, zp_kind)
    a = rng.standard_normal((m, k)).astype(np.float32)
    w = dequantize_blocks(np, packed, scales, zp, n=n, k=k, bits=4, block=block, work=np.dtype(np.float64))
    want = a.astype(np.float64) @ w.T
    got = _nbits_host.matmul_4bit(a, packed, scales, zp, n=n, k=k, block=block)
    assert got.dtype == np.float32 and got.shape == (m, n)
    bound = 8 * k * np.finfo(np.float32).eps * (np.abs(a).astype(np.float64) @ np.abs(w).T)
    assert np.all(np.abs(got - want) <= bound + 1e-30), "result: float32 rounding of the exact product"


def test_the_bytes_do_not_depend_on_the_thread_count(monkeypatch):
    """Contract (thread invariance): each output row is computed whole by one thread (a decode step),
    and each weight row dequantized exactly by one (several rows), so the split of the rows over
    threads changes no byte; several rows in one chunk are the fp32 product of the weight
    ``dequantize_blocks`` gives, and in smaller chunks BLAS's product of the same values (result:
    within float32 rounding, the blocking of BLAS's sum is its own)."""
    rng = np.random.default_rng(5)
    n, k, block = 1200, 1000, 32  # K not a multiple of the block
    packed, scales, zp = _weights(rng, n, k, block, "uint8")
    a = rng.standard_normal((6, k)).astype(np.float32)
    w = dequantize_blocks(np, packed, scales, zp, n=n, k=k, bits=4, block=block, work=np.dtype(np.float32))
    batch = _nbits_host.matmul_4bit(a, packed, scales, zp, n=n, k=k, block=block)
    assert batch.tobytes() == (a @ w.T).tobytes(), "contract: several rows are the dequantized weight's product"
    one = _nbits_host.matmul_4bit(a[:1], packed, scales, zp, n=n, k=k, block=block)
    monkeypatch.setattr(_nbits_host, "_THREADED_MIN", 0)
    for threads in (1, 3, 7):
        monkeypatch.setattr(_nbits_host, "_threads", lambda t=threads: t)
        got = _nbits_host.matmul_4bit(a, packed, scales, zp, n=n, k=k, block=block)
        assert got.tobytes() == batch.tobytes(), f"contract: {threads} threads, several rows: the same bytes"
        got = _nbits_host.matmul_4bit(a[:1], packed, scales, zp, n=n, k=k, block=block)
        assert got.tobytes() == one.tobytes(), f"contract: {threads} threads, one row: the same bytes"
    monkeypatch.setattr(_nbits_host, "_CHUNK_BYTES", 4 * 1024 * 37)  # 37 weight rows a chunk
    got = _nbits_host.matmul_4bit(a, packed, scales, zp, n=n, k=k, block=block)
    bound = 4 * k * np.finfo(np.float32).eps * (np.abs(a) @ np.abs(w).T)
    assert np.all(np.abs(got - batch) <= bound), "result: chunked, within float32 rounding of one chunk"


def test_the_simulated_devices_matmulnbits_takes_the_fused_kernel(monkeypatch):
    """Contract: on the simulated device a 4-bit MatMulNBits runs the fused kernel (no dequantized
    copy of the weight, at any model size); its output is the kernel's bytes plus the bias."""
    from onnx import TensorProto, helper, numpy_helper
    from lockstep.reference_runtime import Runtime, RuntimeConfig
    from lockstep.reference_runtime.backends.sim import SimDevice
    from lockstep.reference_runtime.executor import Executor

    rng = np.random.default_rng(9)
    n, k, block = 40, 96, 32
    packed, scales, zp = _weights(rng, n, k, block, "uint8")
    bias = rng.standard_normal(n).astype(np.float32)
    inits = [numpy_helper.from_array(v, name) for v, name in ((packed, "q"), (scales, "s"), (zp, "z"), (bias, "bias"))]
    node = helper.make_node("MatMulNBits", ["a", "q", "s", "z", "", "bias"], ["y"], domain="com.microsoft", K=k, N=n,
                            bits=4, block_size=block)
    g = helper.make_graph([node], "g", [helper.make_tensor_value_info("a", TensorProto.FLOAT, (2, 3, k))],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, (2, 3, n))], initializer=inits)
    model = helper.make_model(g, opset_imports=[helper.make_opsetid("", 21), helper.make_opsetid("com.microsoft", 1)],
                              ir_version=10)
    calls = []
    real = _nbits_host.matmul_4bit
    monkeypatch.setattr(_nbits_host, "matmul_4bit", lambda *a, **kw: calls.append(1) or real(*a, **kw))
    a = rng.standard_normal((2, 3, k)).astype(np.float32)
    got = Executor(model, Runtime(SimDevice(), RuntimeConfig())).run({"a": a})["y"]
    assert calls == [1], "contract: the fused kernel ran, once"
    want = real(a.reshape(6, k), packed, scales, zp, n=n, k=k, block=block).reshape(2, 3, n) + bias
    assert got.tobytes() == want.tobytes(), "result: the kernel's bytes plus the bias"


@pytest.mark.parametrize("zp_kind", [None, "uint8", "float"])
def test_a_float64_product_is_the_dequantized_weights_product(zp_kind, monkeypatch):
    """Result (the float64 cross-check's MatMulNBits): the float64 product of the weight
    ``dequantize_blocks`` gives in float64 (the same two operations per value: exact), one row or
    several, within float64 rounding of BLAS's blocking; the bytes do not depend on the thread count
    (contract: each weight row dequantized whole by one thread)."""
    rng = np.random.default_rng(11)
    for m, n, k, block in ((1, 300, 96, 32), (5, 257, 1000, 64)):
        packed, scales, zp = _weights(rng, n, k, block, zp_kind)
        a = rng.standard_normal((m, k))
        w = dequantize_blocks(np, packed, scales, zp, n=n, k=k, bits=4, block=block, work=np.dtype(np.float64))
        got = _nbits_host.matmul_4bit(a, packed, scales, zp, n=n, k=k, block=block)
        assert got.dtype == np.float64 and got.shape == (m, n)
        bound = 4 * k * np.finfo(np.float64).eps * (np.abs(a) @ np.abs(w).T)
        assert np.all(np.abs(got - a @ w.T) <= bound), "result: float64 rounding of the dequantized product"
        monkeypatch.setattr(_nbits_host, "_THREADED_MIN", 0)
        for threads in (1, 3):
            monkeypatch.setattr(_nbits_host, "_threads", lambda t=threads: t)
            again = _nbits_host.matmul_4bit(a, packed, scales, zp, n=n, k=k, block=block)
            assert again.tobytes() == got.tobytes(), f"contract: {threads} threads, the same bytes"
        monkeypatch.undo()
