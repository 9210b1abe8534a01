"""How fast `lockstep audit` reads C++/CUDA (or Rust): a table with its conditions.

    taskset -c 0,1 python scripts/bench_audit_native.py SRC_DIR [--lines 100000] [--runs 5]

Takes whole source files under SRC_DIR in sorted path order until their lines pass --lines
(generated data such as embedded CUBIN arrays, `*.cubin.cc` and `*_kernel.sm*.cc`, left out), then
times, in this process, the baseline (tree-sitter parsing alone) and the whole audit (index, entries,
reachability, guards, report) over them, medians of --runs. The issue's bar: 100k lines of C++ in
<= 30 s on 2 cores (pin with taskset; the audit runs on one thread).
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import subprocess
import tempfile
import time
from pathlib import Path

from lockstep.contracts.native_audit import audit_native, is_native
from lockstep.contracts.native_config import NativeConfig
from lockstep.contracts.native_index import language_of, parser

GENERATED = (".cubin.cc",)


def corpus(src: Path, lines: int) -> tuple[list[Path], int]:
    files, total = [], 0
    for f in sorted(p for p in src.rglob("*") if p.is_file() and is_native(p)):
        if f.name.endswith(GENERATED) or "_kernel.sm" in f.name:
            continue
        files.append(f)
        total += f.read_bytes().count(b"\n")
        if total >= lines:
            break
    return files, total


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("src")
    ap.add_argument("--lines", type=int, default=100_000)
    ap.add_argument("--runs", type=int, default=5)
    args = ap.parse_args()
    files, total = corpus(Path(args.src), args.lines)
    with tempfile.TemporaryDirectory() as tmp:  # one folder of links: the audit takes it as one path
        for i, f in enumerate(files):
            os.symlink(f.resolve(), Path(tmp) / f"{i:05d}_{f.name}")

        def parse_only() -> None:
            for f in files:
                parser(language_of(f)).parse(f.read_bytes())

        def whole() -> None:
            audit_native([tmp], NativeConfig(entries=["*::ComputeInternal", "launches-kernels"]))

        res = audit_native([tmp], NativeConfig(entries=["*::ComputeInternal", "launches-kernels"]))
        rows = []
        for name, fn in (("tree-sitter parse only (baseline)", parse_only), ("lockstep audit", whole)):
            times = []
            for _ in range(args.runs):
                t0 = time.perf_counter()
                fn()
                times.append(time.perf_counter() - t0)
            rows.append((name, statistics.median(times), min(times), max(times)))
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                            cwd=Path(__file__).resolve().parent).stdout.strip() or "unknown"
    cpu = next((line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                if line.startswith("model name")), platform.processor()) if Path("/proc/cpuinfo").exists() else platform.processor()
    print(f"commit {commit}; {cpu}; cores available {len(os.sched_getaffinity(0))}; Python {platform.python_version()}")
    print(f"corpus: {len(files)} files, {total} lines under {args.src}; {len(res.entries)} entries, "
          f"{len(res.findings)} findings; medians of {args.runs} runs")
    print("| what | median s | min s | max s | lines/s | ratio to baseline |")
    print("|---|---|---|---|---|---|")
    base = rows[0][1]
    for name, med, lo, hi in rows:
        print(f"| {name} | {med:.2f} | {lo:.2f} | {hi:.2f} | {total / med:,.0f} | {med / base:.1f}x |")


if __name__ == "__main__":
    main()
