"""Benchmark: decode under weight paging versus resident weights.

    python scripts/bench_paging.py [--device cupy|sim] [--model small-fp32-standard-kv64] [--steps 16] [--repeats 3]

Same protocol as ``bench_decode.py`` (prefill and two warm-up steps untimed, then ``--steps``
timed one-token steps, modes interleaved, GC paused, median of ``--repeats``). Modes: resident
weights eager and captured; paged weights with ``vram_limit`` set to the tightest budget (the
largest single node's weights, so nearly every node evicts), eager and captured. Reported:
tokens/s, ratio to resident eager, page-ins and bytes moved per token, and the share of the timed
wall time spent in ``drain_for_unmap`` before unmaps. Token streams must match across modes.
"""

from __future__ import annotations

import argparse
import gc
import statistics
import sys
from pathlib import Path


import onnx  # noqa: E402
from lockstep.golden.anchors import MODEL_DIR  # noqa: E402
from lockstep.reference_runtime import Runtime, RuntimeConfig  # noqa: E402
from lockstep.reference_runtime.backends import make_device  # noqa: E402
from lockstep.reference_runtime.engine import RefDecoder  # noqa: E402
from lockstep.reference_runtime.executor import Executor  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_decode import conditions, timed_decode  # noqa: E402


def tightest_budget(model, device: str) -> int:
    probe = Executor(model, Runtime(make_device(device), RuntimeConfig(vram_limit=1 << 40)))
    p = probe.pager
    need = max(sum(p.span_of(p.tensor(k).ref.nbytes) for k in keys) for keys in probe.paged_inputs.values())
    p.close()
    return need


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--device", default="cupy")
    ap.add_argument("--model", default="small-fp32-standard-kv64")
    ap.add_argument("--steps", type=int, default=16)
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args(argv)
    model = onnx.load(str(MODEL_DIR / f"{args.model}.onnx"))
    budget = tightest_budget(model, args.device)
    modes = {
        "resident, eager": RuntimeConfig(),
        "resident, captured": RuntimeConfig(),
        "paged, eager": RuntimeConfig(vram_limit=budget),
        "paged, captured": RuntimeConfig(vram_limit=budget),
    }
    decs = {m: RefDecoder(model, Runtime(make_device(args.device), cfg), capture=m.endswith("captured"))
            for m, cfg in modes.items()}
    for d in decs.values():
        timed_decode(d, 2)
    runs = {m: [] for m in decs}
    moved = {m: [] for m in decs}
    drain_share = {m: [] for m in decs}
    page_ins = {m: [] for m in decs}
    streams = {}
    for _ in range(args.repeats):
        for m, d in decs.items():
            pager = d.ex.pager
            before = pager.counters.as_dict() if pager else None
            gc.collect()
            gc.disable()
            try:
                elapsed, streams[m], _ = timed_decode(d, args.steps)
            finally:
                gc.enable()
            runs[m].append(args.steps / elapsed)
            if pager:
                after = pager.counters.as_dict()
                moved[m].append((after["bytes_moved"] - before["bytes_moved"]) / args.steps)
                page_ins[m].append((after["page_ins"] - before["page_ins"]) / args.steps)
                drain_share[m].append((after["drain_seconds"] - before["drain_seconds"]) / elapsed)
    if len({tuple(v) for v in streams.values()}) != 1:
        raise SystemExit(f"token streams differ between modes: {streams}")
    print(f"# paging benchmark: {args.model}, vram_limit {budget} bytes (the largest node's weights; "
          f"{len(decs['paged, eager'].ex.pager._weights)} paged weights); {conditions(args.device, args.steps, args.repeats)}")
    print("| mode | tokens/s (median) | vs resident eager | page-ins/token | MiB moved/token | drain share of wall time | runs |")
    print("|---|---:|---:|---:|---:|---:|---|")
    base = statistics.median(runs["resident, eager"])
    for m in decs:
        t = statistics.median(runs[m])
        pi = f"{statistics.median(page_ins[m]):.1f}" if page_ins[m] else "0"
        mb = f"{statistics.median(moved[m]) / 2**20:.2f}" if moved[m] else "0"
        ds = f"{100 * statistics.median(drain_share[m]):.1f}%" if drain_share[m] else "0"
        print(f"| {m} | {t:.1f} | {t / base:.2f}x | {pi} | {mb} | {ds} | {', '.join(f'{x:.0f}' for x in runs[m])} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
