"""Where the host time of an eager decode step goes: cProfile over one-token steps.

    python scripts/profile_decode.py [--device cupy] [--model small-fp32-standard-kv64] [--steps 16]
                                     [--defer on|off] [--capture on|off] [--top 35]

Prints the top functions by internal time and by cumulative time, and the mean wall time of a
raw ``Runtime.synchronize()`` with deferral off (drain + latch read) against a no-op one. A
diagnostic for the decode benchmark (scripts/bench_decode.py), not a benchmark itself.
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import sys
import time


import numpy as np  # noqa: E402
import onnx  # noqa: E402
from lockstep.golden.anchors import MODEL_DIR  # noqa: E402
from lockstep.golden.models.spec import PROMPT  # noqa: E402
from lockstep.reference_runtime import Runtime, RuntimeConfig  # noqa: E402
from lockstep.reference_runtime.backends import make_device  # noqa: E402
from lockstep.reference_runtime.engine import RefDecoder  # noqa: E402


def _by_op(dec, logits, steps: int) -> None:
    """Host wall time of each node's launch (``Executor._launch``), summed by op type (no profiler),
    and on CuPy the device time of its kernels (CUDA events recorded around the launch on the
    compute stream). Views (Reshape and friends) launch nothing and are not in the table."""
    from collections import defaultdict

    from lockstep.reference_runtime import executor as exmod

    totals: dict[str, list[float]] = defaultdict(lambda: [0.0, 0])
    events: list[tuple[str, object, object]] = []
    stream = getattr(dec.rt._res.compute, "s", None)  # the CuPy stream (None on the simulator)
    real = exmod.Executor._launch

    def timed(self, step, *a, **k):
        t0 = time.perf_counter()
        if stream is not None:
            import cupy

            e0, e1 = cupy.cuda.Event(), cupy.cuda.Event()
            e0.record(stream)
        try:
            return real(self, step, *a, **k)
        finally:
            row = totals[step.info.op_type]
            row[0] += time.perf_counter() - t0
            row[1] += 1
            if stream is not None:
                e1.record(stream)
                events.append((step.info.op_type, e0, e1))

    wall = 0.0
    spin_buf = dec.rt.empty((1,), np.int32, name="spin") if stream is not None else None
    for _ in range(steps):
        token = int(np.argmax(logits))
        if stream is not None:
            # the GPU spins while the host enqueues the step: the events then time kernels back to
            # back, not the host's launch gaps (device time); host time is measured as before
            from lockstep.kernels import primitives

            dec.rt.launch(primitives.spin, spin_buf, microseconds=20000)
        exmod.Executor._launch = timed
        t0 = time.perf_counter()
        try:
            logits = dec.forward([token])[-1]
        finally:
            exmod.Executor._launch = real
        wall += time.perf_counter() - t0
    nodes = sum(r[1] for r in totals.values())
    print(f"# per op type, {steps} steps: {1e3 * wall / steps:.2f} ms/step, {nodes / steps:.0f} nodes/step, "
          f"{1e6 * wall / max(nodes, 1):.1f} us wall per node (with the timing wrapper; on CuPy each step "
          "waits for a 20 ms spin at its end: read the per-node columns)")
    device: dict[str, float] = defaultdict(float)
    if events:
        import cupy

        stream.synchronize()
        for op, e0, e1 in events:
            device[op] += cupy.cuda.get_elapsed_time(e0, e1) * 1e-3
    print(f"{'op type':24} {'nodes/step':>10} {'host us/node':>12} {'ms/step':>8} {'device us/node':>14}")
    for op, (t, n) in sorted(totals.items(), key=lambda kv: -kv[1][0]):
        dev = f"{1e6 * device[op] / n:14.1f}" if events else f"{'n/a':>14}"
        print(f"{op:24} {n / steps:10.1f} {1e6 * t / n:12.1f} {1e3 * t / steps:8.2f} {dev}")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--device", default="cupy")
    ap.add_argument("--model", default="small-fp32-standard-kv64")
    ap.add_argument("--steps", type=int, default=16)
    ap.add_argument("--defer", choices=("on", "off"), default="on")
    ap.add_argument("--capture", choices=("on", "off"), default="off")
    ap.add_argument("--top", type=int, default=35)
    ap.add_argument("--by-op", action="store_true", help="also print host wall time per op type (no profiler)")
    args = ap.parse_args(argv)
    rt = Runtime(make_device(args.device), RuntimeConfig(defer_eager_sync=args.defer == "on"))
    dec = RefDecoder(onnx.load(str(MODEL_DIR / f"{args.model}.onnx")), rt, capture=args.capture == "on")
    dec.reset()
    logits = dec.forward(list(PROMPT.encode()))[-1]
    for _ in range(3):
        logits = dec.forward([int(np.argmax(logits))])[-1]
    if args.by_op:
        _by_op(dec, logits, args.steps)
    prof = cProfile.Profile()
    t0 = time.perf_counter()
    prof.enable()
    for _ in range(args.steps):
        logits = dec.forward([int(np.argmax(logits))])[-1]
    prof.disable()
    wall = time.perf_counter() - t0
    print(f"# {args.model} on {args.device}, defer {args.defer}, capture {args.capture}: "
          f"{args.steps} steps, {1e3 * wall / args.steps:.2f} ms/step under the profiler")
    stats = pstats.Stats(prof).strip_dirs()
    stats.sort_stats("tottime").print_stats(args.top)
    stats.sort_stats("cumulative").print_stats(args.top)
    # who copies or reduces on the host path inside a step: callers, to find the node. Note that
    # copy_from_async called by cupy.copyto is a DEVICE-to-device memcpy (copyto of contiguous
    # arrays of one dtype; on kv64 eager: the Slice and the two Unsqueezes of the position_ids feed,
    # which are not views because their input is a graph input); copy_from_host is host-to-device
    stats.print_callers(r"copy_from_async|copy_from_host|method 'sum'|method 'get'")
    for defer in (True, False):
        r = Runtime(make_device(args.device), RuntimeConfig(defer_eager_sync=defer))
        r.synchronize()
        t0 = time.perf_counter()
        for _ in range(200):
            r.synchronize()
        print(f"Runtime.synchronize() with deferral {'on' if defer else 'off'}: "
              f"{1e6 * (time.perf_counter() - t0) / 200:.1f} us per call (idle streams)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
