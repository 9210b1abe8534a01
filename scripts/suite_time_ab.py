"""A/B wall and CPU time of one pytest selection in two checkouts, interleaved (ABBA) rounds.

    python scripts/suite_time_ab.py --baseline-tree ../old --baseline-python ../venv-old/bin/python \
        --rounds 6 -- conformance/node_suite --engines=ref-sim,ort-cpu

Each round runs the selection once in each checkout (alternating which goes first), as
``python -m pytest -q -p no:cacheprovider ARGS`` in that checkout with that interpreter (an
editable install of that checkout), and records the run's wall time, its process CPU time, its
collection CPU time and each test's CPU time (a small plugin, loaded with ``-p``). It prints a
table per round, the medians, the per-round ratios (this tree over the baseline) and a per-group
split of the tests' CPU time (the groups: test function names). On a shared or drifting machine
only the per-round ratios compare; their median is the figure to quote, with its spread.

How the issue-19 node-suite figure in docs/benchmarks.md was made; the baseline checkout is a
``git worktree add --detach DIR COMMIT`` with a copy of the venv whose editable finder points at it.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

_PLUGIN = '''
import json, os, time
import pytest
_T, _S = {}, {}
@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    t0 = time.process_time()
    yield
    _T[item.nodeid] = time.process_time() - t0
@pytest.hookimpl(hookwrapper=True)
def pytest_collection(session):
    t0 = time.process_time()
    yield
    _S["collection"] = time.process_time() - t0
def pytest_sessionfinish(session):
    _S["process"] = time.process_time()
    with open(os.environ["SUITE_TIME_AB_OUT"], "w") as f:
        json.dump({"tests": _T, "session": _S}, f)
'''


def _commit(tree: Path) -> str:
    out = subprocess.run(["git", "-C", str(tree), "rev-parse", "--short", "HEAD"], capture_output=True, text=True)
    return out.stdout.strip() or "?"


def _run(tree: Path, python: str, args: list[str], plugin_dir: str, out: Path) -> dict:
    env = dict(os.environ, SUITE_TIME_AB_OUT=str(out),
               PYTHONPATH=os.pathsep.join(filter(None, [plugin_dir, os.environ.get("PYTHONPATH")])))
    t0 = time.perf_counter()
    proc = subprocess.run([python, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "suite_time_ab_plugin", *args],
                          cwd=tree, env=env, capture_output=True, text=True)
    wall = time.perf_counter() - t0
    if proc.returncode not in (0, 1) or not out.exists():  # 1: some tests failed (timed all the same)
        tail = "\n".join((proc.stdout + proc.stderr).strip().splitlines()[-15:])
        raise SystemExit(f"suite_time_ab: pytest in {tree} exited {proc.returncode}, not a test run:\n{tail}")
    data = json.loads(out.read_text())
    data["session"]["wall"] = wall
    data["session"]["summary"] = (proc.stdout.strip().splitlines() or ["?"])[-1]
    return data


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="scripts/suite_time_ab.py", description=__doc__.split("\n\n")[0])
    ap.add_argument("--baseline-tree", required=True, type=Path, help="the other checkout (its root)")
    ap.add_argument("--baseline-python", required=True, help="an interpreter with that checkout installed")
    ap.add_argument("--tree", type=Path, default=Path(__file__).resolve().parents[1], help="this checkout (default: here)")
    ap.add_argument("--python", default=sys.executable)
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("pytest_args", nargs="*", help="the selection (after --)")
    a = ap.parse_args(argv)
    if a.rounds < 1:
        ap.error("--rounds must be >= 1")
    for tree in (a.baseline_tree, a.tree):
        if not (tree / "pyproject.toml").is_file():
            ap.error(f"{tree} is not a checkout (no pyproject.toml)")
    trees = {"baseline": (a.baseline_tree.resolve(), a.baseline_python), "this": (a.tree.resolve(), a.python)}
    print(f"# {platform.node()} | {os.cpu_count()} cpus | python {platform.python_version()} | "
          f"baseline {_commit(trees['baseline'][0])} | this {_commit(trees['this'][0])} | "
          f"pytest -q -p no:cacheprovider {' '.join(a.pytest_args)} | {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}")
    runs: dict[str, list[dict]] = {"baseline": [], "this": []}
    with tempfile.TemporaryDirectory() as tmp:
        Path(tmp, "suite_time_ab_plugin.py").write_text(_PLUGIN)
        print(f"{'round':>5} {'tree':8} {'wall s':>8} {'cpu s':>8} {'collect s':>9}  summary")
        for r in range(a.rounds):
            for k in (("baseline", "this") if r % 2 == 0 else ("this", "baseline")):
                d = _run(*trees[k], a.pytest_args, tmp, Path(tmp, f"{k}-{r}.json"))
                runs[k].append(d)
                s = d["session"]
                print(f"{r:>5} {k:8} {s['wall']:8.2f} {s['process']:8.2f} {s['collection']:9.2f}  {s['summary']}", flush=True)
    med = {k: {m: statistics.median(d["session"][m] for d in v) for m in ("wall", "process")} for k, v in runs.items()}
    print(f"medians: baseline wall {med['baseline']['wall']:.2f} s, cpu {med['baseline']['process']:.2f} s | "
          f"this wall {med['this']['wall']:.2f} s, cpu {med['this']['process']:.2f} s")
    for m, label in (("wall", "wall"), ("process", "cpu")):
        ratios = [t["session"][m] / b["session"][m] for b, t in zip(runs["baseline"], runs["this"])]
        print(f"this / baseline, {label}, per round: {' '.join(f'{x:.3f}' for x in ratios)}  "
              f"median {statistics.median(ratios):.3f} (range {min(ratios):.3f}-{max(ratios):.3f})")
    groups: dict[str, dict[str, float]] = {}
    for k, v in runs.items():
        per: dict[str, list[float]] = collections.defaultdict(list)
        for d in v:
            for t, x in d["tests"].items():
                per[t].append(x)
        g: dict[str, float] = collections.Counter()
        for t, xs in per.items():
            g[t.split("::")[-1].split("[")[0]] += statistics.median(xs)
        groups[k] = g
    print(f"{'test function':48} {'baseline cpu s':>14} {'this cpu s':>10}")
    for name in sorted(set(groups["baseline"]) | set(groups["this"])):
        print(f"{name[:48]:48} {groups['baseline'].get(name, 0):14.2f} {groups['this'].get(name, 0):10.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
