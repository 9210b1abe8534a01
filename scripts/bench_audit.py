"""Benchmark: wall time of `lockstep audit` on the whole tree.

    python scripts/bench_audit.py [--repeats 5]

Two figures, median of ``--repeats`` runs each: the command as a user runs it (a fresh Python
process: interpreter start, imports, parsing, analysis), and the in-process audit with a cold
parse cache. Prints the conditions (machine, Python, commit, files and entry points audited).
A benchmark, not a test: it asserts nothing.
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

from lockstep.contracts import audit as A  # noqa: E402


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args(argv)
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, cwd=ROOT).stdout.strip()
    cli, inproc = [], []
    env = dict(os.environ)
    for _ in range(args.repeats):
        t0 = time.perf_counter()
        rc = subprocess.run([sys.executable, "-m", "lockstep", "audit"], cwd=ROOT, env=env,
                            capture_output=True).returncode
        cli.append(time.perf_counter() - t0)
        A._PARSED.clear()
        t0 = time.perf_counter()
        res = A.audit()
        inproc.append(time.perf_counter() - t0)
    files = len(A._tree_files([ROOT / t for t in A.DEFAULT_TREE]))
    print(f"# sync audit of the whole tree: {files} files, {len(res.entries)} capture entry points, "
          f"{len(res.sites)} sync sites on capture paths, exit {rc}")
    print(f"# machine: {platform.machine()} {os.cpu_count()} cores, Python {platform.python_version()}, commit {commit}, "
          f"median of {args.repeats}")
    print("| measure | median s | runs s |")
    print("|---|---:|---|")
    print(f"| `lockstep audit` (fresh process) | {statistics.median(cli):.2f} | {', '.join(f'{x:.2f}' for x in cli)} |")
    print(f"| `audit()` in process, cold parse | {statistics.median(inproc):.2f} | {', '.join(f'{x:.2f}' for x in inproc)} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
