"""The oracle's compiled 4-bit dequantization (golden/int4_host.py): the bytes of its numpy passes
(``contrib_oracle_ops.MatMulNBits._rows``) at any thread count, and the oracle's MatMulNBits product
the same with it or without it."""

from __future__ import annotations

import numpy as np
import pytest
from lockstep.golden import contrib_oracle_ops, int4_host

pytestmark = pytest.mark.skipif(not int4_host.AVAILABLE, reason="numba is not importable (a dependency)")


def _op(n, k, block):
    op = contrib_oracle_ops.MatMulNBits.__new__(contrib_oracle_ops.MatMulNBits)
    op.attrs = {"K": k, "N": n, "bits": 4, "block_size": block}
    return op


def _weights(rng, n, k, block, zp_kind):
    nb = -(-k // block)
    packed = rng.integers(0, 256, (n, nb, block // 2), dtype=np.uint8)
    scales = rng.uniform(0.01, 0.1, (n, nb)).astype(np.float32)
    zp = {None: None, "uint8": rng.integers(0, 256, (n, -(-nb // 2)), dtype=np.uint8),
          "float": rng.uniform(0, 15, (n, nb)).astype(np.float16)}[zp_kind]
    return packed, scales, zp


@pytest.mark.parametrize("zp_kind", [None, "uint8", "float"])
def test_the_compiled_rows_are_the_numpy_rows_bytes(zp_kind, monkeypatch):
    """Result: ``(float64(q) - z) * s`` per value, low nibble first: the numpy passes' bytes, at 1 and
    3 threads, K a multiple of the block or not."""
    rng = np.random.default_rng(3)
    monkeypatch.setattr(int4_host, "_THREADED_MIN", 0)
    for n, k, block in ((300, 96, 32), (257, 1000, 64)):
        packed, scales, zp = _weights(rng, n, k, block, zp_kind)
        op = _op(n, k, block)
        k_, n_, bits, bs, nb, s, z = op._layout(packed, scales, zp)
        want = op._rows(packed, s, z, slice(0, n), k, bits, bs, nb)
        z64 = np.full(s.shape, 8.0) if z is None else z.astype(np.float64)
        for threads in (1, 3):
            monkeypatch.setattr(int4_host, "threads", lambda t=threads: t)
            out = np.empty((n, nb * bs))
            int4_host.dequantize_rows(packed, s.astype(np.float64), z64, out)
            assert np.ascontiguousarray(out[:, :k]).tobytes() == np.ascontiguousarray(want).tobytes(), (
                f"result: {threads} thread(s), the numpy passes' bytes")


def test_the_oracles_product_is_the_same_compiled_or_not(monkeypatch):
    """Result: the oracle's MatMulNBits output has the same bytes with the compiled dequantization as
    with numpy's (what every int4 snapshot was computed with), over several chunks of rows."""
    rng = np.random.default_rng(4)
    n, k, block = 700, 256, 32
    packed, scales, zp = _weights(rng, n, k, block, "uint8")
    a = rng.standard_normal((5, k)).astype(np.float32)
    op = _op(n, k, block)
    monkeypatch.setattr(contrib_oracle_ops.MatMulNBits, "ROWS_ELEMENTS", 64 * k)  # 256-row chunks (MIN_ROWS)
    fast = op.compute([a, packed, scales, zp, None, None], None)[0]
    monkeypatch.setattr(int4_host, "AVAILABLE", False)
    slow = op.compute([a, packed, scales, zp, None, None], None)[0]
    assert fast.tobytes() == slow.tobytes(), "result: the same product with and without the compiled rows"
