"""Host cost of the CuPy calls a reference kernel makes, on this machine (diagnostic, not a benchmark).

    python scripts/host_costs.py [--n 2000]

Prints the mean host time per call of each form (queue not drained inside the loop): a view
over pool memory, a ufunc with and without ``out=``, ``copyto``, a RawKernel launch, a stream
context switch, an event record, a pool allocation. What an eager step's per-node floor is made of.
"""

from __future__ import annotations

import argparse
import sys
import time


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--n", type=int, default=2000)
    args = ap.parse_args(argv)
    import cupy as cp
    import numpy as np

    s = cp.cuda.Stream(non_blocking=True)
    a = cp.ones((1, 1, 64), cp.float32)
    b = cp.ones((1, 1, 64), cp.float32)
    o = cp.empty_like(a)
    mp = a.data
    k = cp.RawKernel(r'''extern "C" __global__ void f(const float* a, float* o, long long n) {
        long long i = blockIdx.x * blockDim.x + threadIdx.x; if (i < n) o[i] = a[i] * 2.0f; }''', "f")
    ev = cp.cuda.Event(disable_timing=True)
    forms = {
        "ndarray(memptr=) view": lambda: cp.ndarray((1, 1, 64), np.float32, memptr=mp),
        "cp.add(a, b)": lambda: cp.add(a, b),
        "cp.add(a, b, out=o)": lambda: cp.add(a, b, out=o),
        "cp.copyto(o, a)": lambda: cp.copyto(o, a),
        "RawKernel launch": lambda: k((1,), (64,), (a, o, np.int64(64))),
        "with stream: (enter+exit)": lambda: s.__enter__() and s.__exit__(None, None, None),
        "event record": lambda: ev.record(s),
        "pool malloc 256 B": lambda: cp.cuda.alloc(256),
        "a.reshape(64)": lambda: a.reshape(64),
        "cp.exp(a, out=o)": lambda: cp.exp(a, out=o),
        "a.sum(axis=-1)": lambda: a.sum(axis=-1),
    }
    print(f"# host time per call, mean of {args.n} (after 100 warm-up calls); device {cp.cuda.runtime.getDeviceProperties(0)['name']}")
    with s:
        for name, fn in forms.items():
            for _ in range(100):
                fn()
            s.synchronize()
            t0 = time.perf_counter()
            for _ in range(args.n):
                fn()
            dt = time.perf_counter() - t0
            s.synchronize()
            print(f"{name:28} {1e6 * dt / args.n:8.2f} us")
    t0 = time.perf_counter()
    for _ in range(args.n):
        s.synchronize()
    print(f"{'idle stream synchronize':28} {1e6 * (time.perf_counter() - t0) / args.n:8.2f} us")
    return 0


if __name__ == "__main__":
    sys.exit(main())
