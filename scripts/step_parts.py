"""Host time of one decode step, part by part (diagnostic, not a benchmark).

    python scripts/step_parts.py [--device cupy|sim] [--model small-fp32-standard-kv64]
                                 [--capture on|off] [--steps 32] [--repeats 5]

After the prompt's prefill and three warm-up steps (the captured path has recorded its graph by
then), ``--steps`` one-token greedy steps are timed, ``--repeats`` times. Each named function below
is wrapped by a timer that keeps its *exclusive* time (its own wall time minus the time of the
wrapped functions it calls), so the parts add up to the step's wall time; the table prints, per
part, calls and microseconds per step (medians over the repeats) and what the part is. Parts:

- the decode session's own glue (``RefDecoder.forward``: the feeds dict, the bind dict, the logits
  row), ``DecoderIO.step_feeds``, the capture session's signature and bookkeeping, the
  executor's ``start`` (feed checks), ``finish``, ``release``;
- the runtime's ``write`` (host feeds into their buffers), ``replay_segment``, ``download`` (the
  forced synchronise, the reap of pending frees, the error latch read), its stream-ordered
  ``free``;
- the device calls (both backends): event creation, record, wait, H2D and D2H copies, graph
  launch, stream synchronize. On CuPy a stream synchronize *waits for the device* (the graph, or
  the eager kernels still queued): that row is device time, not host time;
- on the simulated device, ``SimDevice._execute`` (numpy executing the kernels, inside the
  synchronise that needs them): the simulation's own cost, which a GPU does not pay on the host;
- on the eager path, the executor's node loop (``Executor.step`` and the plan's ``execute``,
  the launches themselves included) as one row each.

``--no-simulation`` (simulated device only): race checks off, kernels and host-to-device copies
not executed, graphs launched without the race checker's lists; only device-to-host copies run.
The values are garbage (the tokens are still the logits' argmax), the control flow is the real
one: what remains is the host path alone, without the simulator's numpy work.

The wrappers add about a microsecond per wrapped call (the ``timer overhead`` estimate is printed);
the step wall time without them is printed alongside, measured in the same repeats (interleaved).
Python's garbage collector is paused in the timed loops, as in the decode benchmark.
"""

from __future__ import annotations

import argparse
import gc
import statistics
import sys
import time
from collections import defaultdict

import numpy as np
import onnx
from lockstep.decoding import DecoderIO
from lockstep.golden.anchors import MODEL_DIR
from lockstep.golden.models.spec import PROMPT
from lockstep.reference_runtime import Runtime, RuntimeConfig
from lockstep.reference_runtime import executor as exmod
from lockstep.reference_runtime import runtime as rtmod
from lockstep.reference_runtime import segments as segmod
from lockstep.reference_runtime.backends import make_device
from lockstep.reference_runtime.engine import RefDecoder
from lockstep.reference_runtime.runtime_types import GraphSlot

perf = time.perf_counter


class Timers:
    """Exclusive-time wrappers on class attributes, installed and removed as a whole."""

    def __init__(self) -> None:
        self.acc: dict[str, float] = defaultdict(float)
        self.calls: dict[str, int] = defaultdict(int)
        self.what: dict[str, str] = {}
        self._stack = [0.0]
        self._installed: list[tuple[type, str, object]] = []

    def wrap(self, cls: type, name: str, label: str, what: str) -> None:
        real = cls.__dict__.get(name)
        if real is None:  # inherited: wrap where it is found, restore by deleting
            real_fn = getattr(cls, name)
        else:
            real_fn = real
        if isinstance(real_fn, staticmethod):
            real_fn = real_fn.__func__
        acc, calls, stack = self.acc, self.calls, self._stack
        self.what[label] = what

        def timed(*a, **k):
            stack.append(0.0)
            t0 = perf()
            try:
                return real_fn(*a, **k)
            finally:
                dt = perf() - t0
                acc[label] += dt - stack.pop()
                calls[label] += 1
                stack[-1] += dt

        self._installed.append((cls, name, real))
        setattr(cls, name, staticmethod(timed) if isinstance(real, staticmethod) else timed)

    def remove(self) -> None:
        for cls, name, real in reversed(self._installed):
            if real is None:
                delattr(cls, name)
            else:
                setattr(cls, name, real)
        self._installed.clear()

    def reset(self) -> None:
        self.acc.clear()
        self.calls.clear()


def install(t: Timers, dec: RefDecoder) -> None:
    rt = dec.rt
    dev, stream = rt.device, rt._res.compute
    t.wrap(RefDecoder, "forward", "decoder: forward glue", "feeds/bind dicts, logits row (RefDecoder.forward)")
    t.wrap(DecoderIO, "step_feeds", "decoder: step_feeds", "host feed arrays built (numpy)")
    t.wrap(segmod.CaptureSession, "run", "capture: run", "signature lookup, warm-up/baked checks")
    t.wrap(segmod.CaptureSession, "_signature", "capture: signature", "step signature (shapes masked)")
    t.wrap(segmod.CaptureSession, "_in_place", "capture: in-place feeds", "device feeds bound in place")
    t.wrap(segmod.CaptureSession, "_run_segmented", "capture: segments loop", "host feeds staged, items walked")
    t.wrap(exmod.Executor, "run", "executor: run", "plan lookup, the run's frame")
    t.wrap(exmod.Executor, "start", "executor: start", "keep/bind checks, feed checks, env")
    t.wrap(exmod.Executor, "_check_feeds", "executor: feed checks", "dtype/rank/dims of every feed")
    t.wrap(exmod.Executor, "finish", "executor: finish", "outputs collected")
    t.wrap(exmod.Executor, "release", "executor: release", "temporaries freed")
    t.wrap(exmod.Executor, "step", "executor: node steps (eager)", "inference, allocation, launch per node")
    if dec.ex.plans is not None:
        from lockstep.reference_runtime import plan as planmod

        t.wrap(planmod.StepPlan, "execute", "executor: plan execute (eager)", "the planned launches")
        t.wrap(planmod.PlanCache, "lookup", "executor: plan lookup", "step signature of the plan cache")
    t.wrap(rtmod.Runtime, "write", "runtime: write", "H2D into a feed buffer, ordered by events")
    t.wrap(rtmod.Runtime, "upload", "runtime: upload", "allocate + H2D")
    t.wrap(rtmod.Runtime, "replay_segment", "runtime: replay_segment", "checks, counters")
    t.wrap(rtmod.Runtime, "replay", "runtime: replay (a graph slot)", "checks, counters")
    t.wrap(rtmod.Runtime, "download", "runtime: download", "checks, counters")
    t.wrap(rtmod.Runtime, "_force_sync", "runtime: forced sync", "both streams synchronised")
    t.wrap(rtmod.Runtime, "_reap", "runtime: reap frees", "pending frees whose event completed")
    t.wrap(rtmod.Runtime, "_raise_if_latched", "runtime: latch check", "error latch read when it may be set")
    t.wrap(rtmod.Runtime, "free", "runtime: free", "stream-ordered free")
    t.wrap(type(dev), "event", "device: event create", "a new event object")
    t.wrap(type(stream), "record", "device: event record", "")
    t.wrap(type(stream), "wait", "device: stream wait", "")
    t.wrap(type(stream), "synchronize", "device: stream synchronize",
           "WAITS FOR THE DEVICE on CuPy; on sim it runs the queue (see execute)")
    t.wrap(type(dev), "memcpy_htod_async", "device: H2D copy", "host feed (pageable source)")
    t.wrap(type(dev), "memcpy_dtoh", "device: D2H copy", "one copy, then its stream synchronised")
    if "memcpy_dtoh_many" in vars(type(dev)) or hasattr(type(dev), "memcpy_dtoh_many"):
        t.wrap(type(dev), "memcpy_dtoh_many", "device: D2H copies, one wait", "error latch + data, one synchronise")
    if hasattr(type(dev), "_execute"):
        t.wrap(type(dev), "_execute", "sim: kernels executed", "SIMULATION: numpy runs the kernels (no GPU host cost)")
    if dec.session is not None and dec.session._sigs:
        for sig in dec.session._sigs.values():
            for kind, item in sig.items or []:
                if kind == "segment" and item.graph is not None:
                    # a fixed-capacity step's graph lives in a runtime slot (PRIMARY / VERIFY), a segment's in its handle
                    held = rt._slots[item.graph] if isinstance(item.graph, GraphSlot) else item.graph
                    t.wrap(type(held.graph), "launch", "device: graph launch", "")
                    break
            else:
                continue
            break


def steps(dec: RefDecoder, logits: np.ndarray, n: int) -> tuple[float, np.ndarray]:
    gc.collect()
    gc.disable()
    try:
        t0 = perf()
        for _ in range(n):
            logits = dec.forward([int(np.argmax(logits))])[-1]
        return perf() - t0, logits
    finally:
        gc.enable()


def main(argv=None) -> int:
    undo: list = []
    try:
        return _main(argv, undo)
    finally:
        for fn in undo:  # --no-simulation patched the simulator's classes: this process gets them back
            fn()


def _main(argv, undo: list) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cupy")
    ap.add_argument("--model", default="small-fp32-standard-kv64")
    ap.add_argument("--capture", choices=("on", "off"), default="on")
    ap.add_argument("--defer", choices=("on", "off"), default="on")
    ap.add_argument("--steps", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--no-simulation", action="store_true",
                    help="sim only: execute no kernels and check no races (the host path alone)")
    args = ap.parse_args(argv)
    device = make_device(args.device)
    rt = Runtime(device, RuntimeConfig(defer_eager_sync=args.defer == "on"))
    dec = RefDecoder(onnx.load(str(MODEL_DIR / f"{args.model}.onnx")), rt, capture=args.capture == "on")
    prompt = list(PROMPT.encode())
    t = Timers()
    parts: dict[str, list[float]] = defaultdict(list)
    calls: dict[str, list[float]] = defaultdict(list)
    plain, timed, overhead = [], [], []
    counts0 = None
    for r in range(args.repeats):
        dec.reset()
        logits = dec.forward(prompt)[-1]
        for _ in range(3):
            logits = dec.forward([int(np.argmax(logits))])[-1]
        if args.no_simulation and r == 0:  # after a real warm-up: kernels compiled, graphs recorded, latch clear
            undo.append(_no_simulation(device))
        half = args.steps // 2
        wall, logits = steps(dec, logits, half)  # uninstrumented, then instrumented: same context
        plain.append(wall / half)
        c0 = rt.counters.as_dict()
        try:
            install(t, dec)
            t.reset()
            wall, logits = steps(dec, logits, args.steps - half)
        finally:
            t.remove()
        n = args.steps - half
        timed.append(wall / n)
        c1 = rt.counters.as_dict()
        counts0 = {k: (c1[k] - c0[k]) / n for k in c1 if isinstance(c1[k], int)}
        for label in set(t.what) | set(parts):
            parts[label].append(t.acc.get(label, 0.0) / n)
            calls[label].append(t.calls.get(label, 0) / n)
        # timer overhead: an empty wrapped call, measured here
        overhead.append(_wrapper_cost())
    ov = statistics.median(overhead)
    sim_note = " (NO SIMULATION: host path only)" if args.no_simulation else ""
    print(f"# {args.model} on {args.device}{sim_note}, capture {args.capture}, defer {args.defer}: {args.steps} steps "
          f"({args.steps // 2} plain, {args.steps - args.steps // 2} instrumented) x {args.repeats} repeats, medians")
    print(f"# step wall: {1e6 * statistics.median(plain):.1f} us plain, {1e6 * statistics.median(timed):.1f} us "
          f"instrumented; timer overhead ~{1e6 * ov:.2f} us per wrapped call")
    print("# runtime counters per step: " + ", ".join(f"{k} {v:g}" for k, v in (counts0 or {}).items() if v))
    print("| part | calls/step | us/step | what |")
    print("|---|---:|---:|---|")
    rows = sorted(parts, key=lambda k: -statistics.median(parts[k]))
    total = 0.0
    groups = {"python": 0.0, "device": 0.0, "wait": 0.0}
    wrapped = 0.0
    for label in rows:
        us = 1e6 * statistics.median(parts[label])
        ncall = statistics.median(calls[label])
        if not ncall:
            continue
        total += us
        wrapped += ncall
        if label.startswith("sim:") or label == "device: stream synchronize":
            groups["wait"] += us
        elif label.startswith("device:"):
            groups["device"] += us
        else:
            groups["python"] += us
        print(f"| {label} | {ncall:g} | {us:.1f} | {t.what.get(label, '')} |")
    print(f"| (sum of parts) | {wrapped:g} | {total:.1f} | instrumented step wall {1e6 * statistics.median(timed):.1f} us; "
          f"the wrappers' own cost ~{ov * 1e6 * wrapped:.0f} us of it |")
    print(f"| (runtime and above: Python a GPU step runs too) | | {groups['python']:.1f} | executor, session, decoder, "
          "runtime rows |")
    on_gpu = "CUDA API calls (host)" if args.device != "sim" else "the SIMULATOR's Python (a GPU pays CUDA calls here)"
    print(f"| (device calls) | | {groups['device']:.1f} | {on_gpu} |")
    print(f"| (waits) | | {groups['wait']:.1f} | "
          + ("stream synchronize: the device running the step" if args.device != "sim"
             else "simulated kernels executing, stream synchronize") + " |")
    return 0


def _no_simulation(device):
    """Switch the simulated device's own work off (see the module docstring); returns the undo."""
    from lockstep.reference_runtime.backends import sim

    if not isinstance(device, sim.SimDevice):
        raise SystemExit("--no-simulation is for the simulated device (--device sim)")
    device.race_check = False
    execute, launch = sim.SimDevice._execute, sim.SimGraph.launch
    sim.SimDevice._execute = lambda self, op: execute(self, op) if op.kind == "d2h" else None
    sim.SimGraph.launch = lambda self, stream: stream._enqueue("graph", nodes=self.nodes)

    def undo() -> None:
        sim.SimDevice._execute, sim.SimGraph.launch = execute, launch

    return undo


def _wrapper_cost() -> float:
    class _C:
        def f(self):
            return None

    t = Timers()
    t.wrap(_C, "f", "x", "")
    c = _C()
    n = 20000
    t0 = perf()
    for _ in range(n):
        c.f()
    dt = perf() - t0
    t.remove()
    c2 = _C()
    t0 = perf()
    for _ in range(n):
        c2.f()
    return (dt - (perf() - t0)) / n


if __name__ == "__main__":
    sys.exit(main())
