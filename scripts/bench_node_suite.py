"""Benchmark: wall time of ONNX's node suite per engine, against onnx's reference evaluator.

    python scripts/bench_node_suite.py [--engines ref-sim,ort-cpu] [--repeats 3]

Each engine runs every node case (prepare + run + compare) once per repeat; the table gives the
median wall time, the passed count, and the ratio to ``onnx.reference.ReferenceEvaluator`` run in
the same process on the same cases (the baseline). Conditions (machine, commit, versions) are
printed with the table. A benchmark, not a test: it asserts nothing.
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import subprocess
import sys
import time
import warnings


import numpy as np  # noqa: E402
import onnx  # noqa: E402
from lockstep.reference_runtime.node_cases import load_cases, run_case  # noqa: E402

from lockstep.engines.protocol import Engine  # noqa: E402
from lockstep.engines.registry import load_engine  # noqa: E402


class OnnxReference(Engine):
    name = "onnx-reference"
    values = frozenset({"sequence", "optional"})  # the evaluator takes lists and None as ONNX's loader gives them

    def available(self):
        return True, f"onnx {onnx.__version__} ReferenceEvaluator"

    def prepare(self, model):
        from onnx.reference import ReferenceEvaluator

        ev = ReferenceEvaluator(model)
        names = [i.name for i in model.graph.input if i.name not in {t.name for t in model.graph.initializer}]

        def run(feeds):
            return ev.run(None, {n: feeds[n] for n in names if n in feeds})

        return run


def bench(engine, cases, repeats):
    times, counts = [], {}
    for _ in range(repeats):
        counts = {}
        t0 = time.perf_counter()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            for c in cases:
                st = run_case(engine, c).status
                counts[st] = counts.get(st, 0) + 1
        times.append(time.perf_counter() - t0)
    return statistics.median(times), times, counts


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--engines", default="ref-sim,ort-cpu")
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    cases = load_cases()
    try:
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    except OSError:
        commit = "unknown"
    print(f"# node-suite benchmark: {len(cases)} cases, median of {args.repeats} runs")
    print(f"# machine: {platform.machine()} {os.cpu_count()} cores, Python {platform.python_version()}, "
          f"numpy {np.__version__}, onnx {onnx.__version__}, commit {commit}")
    base_t, base_runs, base_counts = bench(OnnxReference(), cases, args.repeats)
    rows = [("onnx-reference (baseline)", base_t, base_runs, base_counts)]
    for name in args.engines.split(","):
        eng = load_engine(name)
        ok, why = eng.available()
        if not ok:
            print(f"# {name}: unavailable: {why}")
            continue
        t, runs, counts = bench(eng, cases, args.repeats)
        rows.append((name, t, runs, counts))
    print()
    print("| engine | median wall s | runs s | passed | failed | error | unsupported | time / baseline |")
    print("|---|---|---|---|---|---|---|---|")
    for name, t, runs, c in rows:
        print(f"| {name} | {t:.2f} | {', '.join(f'{x:.2f}' for x in runs)} | {c.get('passed', 0)} | "
              f"{c.get('failed', 0)} | {c.get('error', 0)} | {c.get('unsupported', 0)} | {t / base_t:.2f}x |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
