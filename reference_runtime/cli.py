"""The ``lockstep`` command line."""

from __future__ import annotations

import argparse
import sys


def _mutants(args: argparse.Namespace) -> int:
    from contracts.mutant_runner import run_mutants

    return run_mutants(args.device, args.mutant, jobs=args.jobs, timeout_s=args.timeout)


def _parity(args: argparse.Namespace) -> int:
    from contracts import parity

    argv = ["--device", args.device]
    for s in args.scenario or []:
        argv += ["--scenario", s]
    if args.json:
        argv += ["--json", args.json]
    if args.compare:
        argv += ["--compare", args.compare]
    return parity.main(argv)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="lockstep", description="Conformance and correctness suite for CUDA inference runtimes.")
    sub = ap.add_subparsers(dest="command", required=True)

    m = sub.add_parser("mutants", help="run the contract tests against the catalogue of broken runtimes")
    m.add_argument("--device", default="sim", help="device to run on (sim, cupy); default sim")
    m.add_argument("--mutant", action="append", help="only this mutant (repeatable)")
    m.add_argument("--jobs", type=int, default=None, help="parallel pytest processes (default: CPU count)")
    m.add_argument("--timeout", type=float, default=600, help="seconds allowed per pytest process (default 600)")
    m.set_defaults(func=_mutants)

    p = sub.add_parser("parity", help="run the sim-vs-CUDA parity scenarios on one device")
    p.add_argument("--device", default="sim")
    p.add_argument("--scenario", action="append")
    p.add_argument("--json", help="write observations to this JSON file")
    p.add_argument("--compare", help="observations from another device to compare with")
    p.set_defaults(func=_parity)

    args = ap.parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
