"""The capture census of every golden model with a growing cache on the reference runtime (ref-sim):
nodes, nodes admitted into captured segments, seams by reason. ``--write`` records each model's
floor (the captured fraction, rounded down to a percent) in conformance/golden/capture_floors.toml,
which test_capture_on_off_byte_identity holds the reference runtime to. Models whose cache has a
fixed capacity are left out: their whole step is one graph.

    python scripts/capture_census.py [--write] [MODEL ...]
"""

from __future__ import annotations

import argparse
import math
import subprocess
import sys
from datetime import datetime, timezone
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
FLOORS = ROOT / "conformance" / "golden" / "capture_floors.toml"


def census(model) -> dict | None:
    from lockstep.decoding import greedy, open_session
    from lockstep.engines.registry import load_engine

    proto = model.load()
    io = model.io(proto)
    if io.capacity:
        return None
    session = open_session(load_engine("ref-sim"), proto, capture=True, io=io)
    greedy(session, model.prompt(), 3)
    c = session.capture_counters()
    return {"nodes": c["nodes"], "captured": c["captured_nodes"], "seams": c["seams_by_reason"]}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("models", nargs="*")
    ap.add_argument("--write", action="store_true", help=f"write the floors into {FLOORS.relative_to(ROOT)}")
    args = ap.parse_args(argv)
    from lockstep.golden.catalog import catalog

    rows = []
    print("| model | nodes | captured | fraction | seams by reason |\n|---|---:|---:|---:|---|")
    for m in catalog():
        if args.models and m.name not in args.models:
            continue
        c = census(m)
        if c is None:
            continue
        frac = c["captured"] / c["nodes"]
        rows.append((m.name, c, frac))
        print(f"| {m.name} | {c['nodes']} | {c['captured']} | {frac:.1%} | {c['seams']} |")
    if args.write:
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True).stdout.strip()
        lines = ["# The capture census floor per golden model with a growing cache: the fraction of its nodes the",
                 "# reference runtime admits into captured segments, rounded down to a percent (measured on ref-sim;",
                 "# the plan is device-independent). test_capture_on_off_byte_identity fails the reference runtime",
                 "# below it. Written by `python scripts/capture_census.py --write`",
                 f"# ({datetime.now(timezone.utc):%Y-%m-%d}, commit {commit}): rebuild after a planner change and review the diff.", ""]
        for name, c, frac in rows:
            lines.append(f'"{name}" = {math.floor(frac * 100) / 100:.2f}  # {c["captured"]} of {c["nodes"]} nodes; seams {c["seams"]}')
        FLOORS.write_text("\n".join(lines) + "\n")
        print(f"written: {FLOORS}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
