#!/usr/bin/env python3
"""Benchmark: the simulated device's 4-bit MatMulNBits, fused (``kernels/_nbits_host.py``) against
what it replaced, on one transformer layer's products.

    python scripts/bench_nbits_host.py [--shape 3b] [--rows 1,24] [--repeats 9]

For each product of one layer of ``--shape`` (a ``lockstep.golden.scale_export.SIZES`` entry: q, k, v,
o, gate, up, down; block 32, uint8 zero points as the GenAI builder writes them) and each batch of
``--rows`` input rows: the median time over ``--repeats`` runs of

- ``fused``: ``_nbits_host.matmul_4bit`` on the packed blocks (what the simulated device runs now);
- ``kept``: an fp32 product with the weight dequantized once and kept (the former ``const_memo``
  path: 4 bytes a weight for the session);
- ``dequant``: the weight dequantized in numpy at every run, then the fp32 product (the former path
  for a model under ``MEMO_MIN_MODEL_BYTES``).

Ratios are against ``kept`` in the same process. The last rows sum the layer, and the bytes each form
holds per weight. Asserts nothing; the fused kernel's tests are tests/test_nbits_host.py.
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import subprocess
import time
from functools import partial
from pathlib import Path

import numpy as np

from lockstep.golden.scale_export import SIZES
from lockstep.kernels import _nbits_host
from lockstep.kernels._contrib_util import dequantize_blocks

BLOCK = 32


def _products(shape) -> list[tuple[str, int, int]]:
    h, inter = shape.hidden, shape.d_ff
    q, kv = shape.n_heads * shape.head_dim, shape.n_kv_heads * shape.head_dim
    return [("q", q, h), ("k", kv, h), ("v", kv, h), ("o", h, q), ("gate", inter, h), ("up", inter, h),
            ("down", h, inter)]


def _dequant_product(a, packed, scales, zp, *, n, k):
    return a @ dequantize_blocks(np, packed, scales, zp, n=n, k=k, bits=4, block=BLOCK, work=np.dtype(np.float32)).T


def _median(fn, repeats: int) -> float:
    fn()
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shape", default="3b", choices=sorted(SIZES))
    ap.add_argument("--rows", default="1,24")
    ap.add_argument("--repeats", type=int, default=9)
    args = ap.parse_args()
    if not _nbits_host.AVAILABLE:
        raise SystemExit("bench_nbits_host: numba is not importable (pip install numba)")
    shape = SIZES[args.shape]
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                            cwd=Path(__file__).resolve().parents[1]).stdout.strip() or "?"
    print(f"# bench_nbits_host: shape {args.shape}, block {BLOCK}, uint8 zero points, {args.repeats} runs (median); "
          f"commit {commit}; {platform.processor() or platform.machine()}, {len(os.sched_getaffinity(0))} CPUs "
          f"(fused threads {_nbits_host._threads()}); numpy {np.__version__}")
    print("| product | N x K | rows | fused (ms) | kept (ms) | dequant (ms) | fused / kept | dequant / kept |")
    print("|---|---|---|---|---|---|---|---|")
    rng = np.random.default_rng(0)
    totals: dict[int, list[float]] = {}
    for name, n, k in _products(shape):
        nb = -(-k // BLOCK)
        packed = rng.integers(0, 256, (n, nb, BLOCK // 2), dtype=np.uint8)
        scales = rng.uniform(0.01, 0.1, n * nb).astype(np.float32)
        zp = rng.integers(0, 256, n * -(-nb // 2), dtype=np.uint8)
        kept = dequantize_blocks(np, packed, scales, zp, n=n, k=k, bits=4, block=BLOCK, work=np.dtype(np.float32))
        for m in (int(r) for r in args.rows.split(",")):
            a = rng.standard_normal((m, k)).astype(np.float32)
            weight = (packed, scales, zp)
            tf = _median(partial(_nbits_host.matmul_4bit, a, *weight, n=n, k=k, block=BLOCK), args.repeats)
            tk = _median(partial(np.matmul, a, kept.T), args.repeats)
            td = _median(partial(_dequant_product, a, *weight, n=n, k=k), max(3, args.repeats // 3))
            t = totals.setdefault(m, [0.0, 0.0, 0.0])
            t[0], t[1], t[2] = t[0] + tf, t[1] + tk, t[2] + td
            print(f"| {name} | {n} x {k} | {m} | {tf * 1e3:.2f} | {tk * 1e3:.2f} | {td * 1e3:.1f} | {tf / tk:.2f} | "
                  f"{td / tk:.1f} |")
    for m, (tf, tk, td) in totals.items():
        print(f"| **layer** | | {m} | {tf * 1e3:.2f} | {tk * 1e3:.2f} | {td * 1e3:.1f} | {tf / tk:.2f} | {td / tk:.1f} |")
    print("bytes held per weight: fused 0.5 (the packed blocks) + scales; kept 0.5 + 4; dequant 0.5 (+4 during a run)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
