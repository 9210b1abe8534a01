"""Which node case leaves an engine's CUDA context poisoned (a sticky CUDA error: every later call in
the process fails), found from a one-process run's JUnit order and confirmed in child processes.

    python3 scripts/nxrt_poison.py JUNIT.xml --engine nxrt-ep-cuda [--before 8]

Reads the run's test cases in execution order (``pytest -n 0 --junitxml``), takes the first whose
failure names a sticky CUDA error and the ``--before`` cases that ran just before it, and runs each
candidate in a child process of its own followed by a canary case (``test_abs``): the candidate whose
canary then fails with the sticky error is the one that poisons the context. Prints one line per
candidate and the verdict; a diagnostic for the GPU lane, not a test."""

from __future__ import annotations

import argparse
import re
import subprocess
import sys
import xml.etree.ElementTree as ET

STICKY = re.compile(r"CUDA_ERROR_ILLEGAL_ADDRESS|CUDA_ERROR_LAUNCH_FAILED|illegal memory access|unspecified launch failure",
                    re.IGNORECASE)

CHILD = r'''
import sys
from lockstep.engines.registry import load_engine
from lockstep.reference_runtime.node_cases import load_cases, run_case
engine = load_engine(sys.argv[1]); engine.available()
cases = {c.name: c for c in load_cases()}
first = run_case(engine, cases[sys.argv[2]])
canary = run_case(engine, cases["test_abs"])
print("CASE", first.status, first.detail.splitlines()[0][:200] if first.detail else "")
print("CANARY", canary.status, canary.detail.splitlines()[0][:200] if canary.detail else "")
'''


def order(junit: str, engine: str) -> list[tuple[str, str]]:
    """(case, failure text) in execution order for ``engine``'s node cases."""
    out = []
    for tc in ET.parse(junit).getroot().iter("testcase"):
        m = re.search(rf"test_node_case\[{re.escape(engine)}-(.+)\]$", tc.get("name", ""))
        if not m:
            continue
        fail = tc.find("failure")
        out.append((m.group(1), (fail.get("message", "") + (fail.text or "")) if fail is not None else ""))
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="nxrt_poison")
    ap.add_argument("junit")
    ap.add_argument("--engine", default="nxrt-ep-cuda")
    ap.add_argument("--before", type=int, default=8)
    ap.add_argument("--first", action="store_true", help="print only the first case failing with a sticky error "
                                                          "(nothing if none), for a loop that deselects it")
    args = ap.parse_args(argv)
    ran = order(args.junit, args.engine)
    first = next((i for i, (_, text) in enumerate(ran) if STICKY.search(text)), None)
    if args.first:
        if first is not None:
            print(ran[first][0])
        return 0
    if first is None:
        print(f"no sticky CUDA error among {len(ran)} cases")
        return 0
    print(f"first sticky error at case {first} of {len(ran)}: {ran[first][0]}")
    later = sum(1 for _, text in ran[first:] if STICKY.search(text))
    print(f"cases failing with it from there on: {later} of {len(ran) - first}")
    verdict = []
    for name, _ in ran[max(0, first - args.before):first + 1]:
        res = subprocess.run([sys.executable, "-c", CHILD, args.engine, name], capture_output=True, text=True,
                             timeout=240)
        lines = [ln for ln in res.stdout.splitlines() if ln.startswith(("CASE", "CANARY"))]
        canary = next((ln for ln in lines if ln.startswith("CANARY")), f"CANARY none (rc {res.returncode}: "
                      f"{(res.stderr.strip().splitlines() or [''])[-1][:200]})")
        poisoned = bool(STICKY.search(canary)) or not lines
        print(f"{'POISONS' if poisoned else 'clean  '} {name}: {' | '.join(lines) or canary}")
        if poisoned:
            verdict.append(name)
    print("verdict:", ", ".join(verdict) or "none of the candidates poisons the context alone")
    return 0


if __name__ == "__main__":
    sys.exit(main())
