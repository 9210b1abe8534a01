"""``lockstep fuzz``: run N cases with a seed, print the class table (by mutation family,
ONNX Runtime's classes beside) and the distinct crash signatures, write a JSON report and a
reproducer folder per crash, hang and memory case; ``--replay DIR`` runs one reproducer again.
Exit status: 0 when no case crashed, hung or blew up memory, 1 otherwise, 2 for a usage error."""

from __future__ import annotations

import json
import sys
from pathlib import Path


def main(argv: list[str] | None = None) -> int:
    from lockstep.errors import command_parser

    ap = command_parser("lockstep fuzz", description=__doc__)
    ap.add_argument("--cases", type=int, default=300, help="number of cases (default %(default)s)")
    ap.add_argument("--seed", type=int, default=15, help="seed (default %(default)s)")
    ap.add_argument("--start", type=int, default=0, help="first case index (default 0)")
    ap.add_argument("--jobs", type=int, default=0, help="parallel workers (default: CPU count)")
    ap.add_argument("--timeout", type=float, default=30.0, help="seconds per case before it is a hang (default 30)")
    ap.add_argument("--mem-gib", type=float, default=3.0,
                    help="address space a worker may add to its size at the fork, GiB (default 3)")
    ap.add_argument("--no-ort", action="store_true", help="do not run ONNX Runtime beside each case")
    ap.add_argument("--out", default="fuzz-out", help="folder for report.json and reproducers (default %(default)s)")
    ap.add_argument("--by-mutation", action="store_true", help="also print the table by mutation kind")
    ap.add_argument("--replay", metavar="DIR", help="run one reproducer folder again and print its outcome")
    args = ap.parse_args(argv)
    mem = int(args.mem_gib * 2**30)
    if args.replay:
        return _replay(Path(args.replay), args.timeout, mem, not args.no_ort)
    if args.cases < 1 or args.start < 0 or args.jobs < 0 or args.timeout <= 0 or mem <= 0:
        print("lockstep fuzz: error: --cases >= 1, --start >= 0, --jobs >= 0, --timeout and --mem-gib > 0",
              file=sys.stderr)
        return 2
    from . import fuzz

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    done = [0]

    def progress(index, eng, res):
        done[0] += 1
        if done[0] % 200 == 0:
            print(f"  {done[0]} runs done", file=sys.stderr, flush=True)

    run = fuzz(args.seed, args.cases, start=args.start, jobs=args.jobs, timeout_s=args.timeout, mem_bytes=mem,
               ort=not args.no_ort, repro_dir=out / "repro", progress=progress)
    (out / "report.json").write_text(json.dumps(run.to_json(), indent=1, default=repr) + "\n")
    print(run.table("family"))
    if args.by_mutation:
        print()
        print(run.table("mutation"))
    sigs = run.signature_lines()
    if sigs:
        print(f"\n{len(sigs)} distinct crash/hang/memory signature(s):")
        print("\n".join(sigs))
    host = run.host_errors()
    if host:
        print(f"\n{len(host)} named outcome(s) that are a kernel's own exception (KernelHostError: a check is missing):")
        print("\n".join(f"- case {c['index']} {c['mutation']} on {c['source']}: {c['ref'].get('message', '')[:160]}"
                        for c in host[:30]))
    print(f"\n{run.summary()}\nreport: {out / 'report.json'}")
    return 1 if run.bad() else 0


def _replay(folder: Path, timeout: float, mem: int, ort: bool) -> int:
    from . import BAD, replay
    from .case import Case

    if not (folder / "case.json").is_file():
        print(f"lockstep fuzz: error: --replay {folder}: no case.json there", file=sys.stderr)
        return 2
    case = Case.read(folder)
    print(f"case {case.index} of seed {case.seed}: {case.mutation} on {case.source} {json.dumps(case.detail, default=repr)}")
    outcomes = replay(folder, timeout_s=timeout, mem_bytes=mem, ort=ort)
    for eng, res in sorted(outcomes.items()):
        print(f"{eng}: {res['cls']}: {res.get('type', '')} @ {res.get('where', '')} (stage {res.get('stage')})")
        text = res.get("traceback") or res.get("log_tail") or res.get("message") or res.get("stderr")
        if text and res["cls"] != "ok":
            print("  " + "\n  ".join(str(text).rstrip().splitlines()[-25:]))
    return 1 if outcomes.get("ref", {}).get("cls") in BAD else 0
