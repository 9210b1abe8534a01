"""The ``lockstep`` command line."""

from __future__ import annotations

import argparse
import sys


def _mutants(args: argparse.Namespace) -> int:
    from lockstep.contracts.mutant_runner import run_mutants

    return run_mutants(args.device, args.mutant, jobs=args.jobs, timeout_s=args.timeout)


def _check(args: argparse.Namespace, passthrough: list[str]) -> int:
    """The main job: the packaged conformance suite (``pytest --pyargs lockstep.conformance``) on
    the selected engines, with a report. Runs from any directory."""
    import time
    from pathlib import Path

    import pytest

    argv = ["--pyargs", "lockstep.conformance", f"--lockstep-report-dir={args.report_dir}",
            # this command imported lockstep before pytest loads its plugin; the suite's test
            # modules are still rewritten, only the plugin's own asserts are not
            "-W", "ignore:Module already imported so cannot be rewritten:pytest.PytestAssertRewriteWarning"]
    if args.engines:
        argv.append(f"--engines={args.engines}")
    started = time.time()
    rc = int(pytest.main(argv + passthrough))
    md = Path(args.report_dir) / "report.md"
    if md.is_file() and md.stat().st_mtime >= started:  # written by this run, not an earlier one
        print(md.read_text())
        print(f"report: {md} and {md.with_suffix('.json')}")
    return rc


class CliError(Exception):
    """A usage problem: printed as one ``lockstep: error: ...`` line, exit status 2."""


def _decode(args: argparse.Namespace) -> int:
    """Greedy decode of a prompt on any registered engine; prints the text, token ids and counters."""
    import json
    from pathlib import Path

    from lockstep.decoding import NotADecoder, greedy, open_session
    from lockstep.engines import EngineLoadError, Unsupported, load_engine
    from lockstep.paths import package_path
    from lockstep.reference_runtime.model import ModelError, load_model

    path = Path(args.model)
    if not path.is_file():
        path = package_path("lockstep.golden.models", f"{args.model}.onnx")
    if not path.is_file():
        raise CliError(f"model {args.model!r}: neither a file nor a golden model name "
                       f"(see {package_path('lockstep.golden.models', 'manifest.json')})")
    try:
        engine = load_engine(args.engine)
    except EngineLoadError as exc:
        raise CliError(str(exc)) from None
    ok, why = engine.available()
    if not ok:
        raise CliError(f"engine {engine.name} is unavailable here: {why}")
    try:
        model, _ = load_model(path)
        session = open_session(engine, model, capture=args.capture == "on")
    except ModelError as exc:
        raise CliError(f"{path}: {exc}") from None
    except (Unsupported, NotADecoder) as exc:
        raise CliError(f"{path.name} on {engine.name}: {exc}") from None
    prompt = list(args.prompt.encode("utf-8"))
    result = greedy(session, prompt, args.tokens)
    print(f"engine: {engine.name}  model: {path.name}")
    print(f"prompt: {args.prompt!r}")
    print(f"output: {result.text()!r}")
    print(f"tokens: {result.tokens}")
    if args.capture == "on":
        fallback = getattr(session, "capture_fallback", None)
        c = result.capture
        print(f"capture: {c.captures} graph(s) captured, {c.replays} replay(s), {c.fallbacks} fallback(s)"
              + (f": fell back to eager: {fallback}" if fallback else "")
              + (f"; {json.dumps(c.detail)}" if c.detail else ""))
    if result.counters:
        print(f"counters: {json.dumps(result.counters)}")
    return 0


def _golden(args: argparse.Namespace) -> int:
    """Regenerate golden anchors from the fp32 oracle, show what changed, write atomically."""
    from lockstep.golden.anchors import compute_anchors, diff_snapshots, load_snapshot, same_anchors, write_snapshot
    from lockstep.golden.models.spec import VARIANTS

    if args.source != "oracle":
        print(f"refusing --source {args.source}: anchors come from the fp32 oracle only "
              "(an engine under test is never its own yardstick)")
        return 2
    names = args.model or list(VARIANTS)
    unknown = [n for n in names if n not in VARIANTS]
    if unknown:
        print(f"unknown golden model(s) {unknown}; known: {sorted(VARIANTS)}")
        return 2
    try:
        from tqdm import tqdm
    except ImportError:  # progress is a nicety, not a dependency of correctness
        def tqdm(it, **kw):
            return it
    changed = 0
    for name in tqdm(names, desc="golden anchors", unit="model"):
        new = compute_anchors(name)
        try:
            old = load_snapshot(name)
        except FileNotFoundError:
            old = None
        diff = diff_snapshots(old, new)
        if old is not None and same_anchors(old, new):
            # the same comparison `pytest --snapshot-update` makes: nothing to write
            extra = f" ({'; '.join(diff)})" if diff else ""
            print(f"{name}: unchanged{extra}")
            continue
        changed += 1
        print(f"{name}: {len(diff)} change(s)")
        for line in diff[:40]:
            print(f"  {line}")
        if len(diff) > 40:
            print(f"  ... and {len(diff) - 40} more")
        if args.dry_run:
            continue
        print(f"  written: {write_snapshot(new)}")
    if args.dry_run and changed:
        print(f"dry run: {changed} snapshot(s) would change; nothing written")
    return 0


def _parity(args: argparse.Namespace) -> int:
    from lockstep.contracts import parity

    argv = ["--device", args.device]
    for s in args.scenario or []:
        argv += ["--scenario", s]
    if args.json:
        argv += ["--json", args.json]
    if args.compare:
        argv += ["--compare", args.compare]
    return parity.main(argv)


def main(argv: list[str] | None = None) -> int:
    import sys

    raw = list(sys.argv[1:] if argv is None else argv)
    if raw[:1] == ["audit"]:  # its own argument parser (contracts/audit.py), exit codes 0/1/2
        from lockstep.contracts.audit import main as audit_main

        return audit_main(raw[1:])
    ap = argparse.ArgumentParser(prog="lockstep", description="Conformance and correctness suite for CUDA inference runtimes.")
    sub = ap.add_subparsers(dest="command", required=True)
    sub.add_parser("audit", help="static audit of capture-unsafe synchronisation: "
                   "`lockstep audit [PATHS...] [--format text|json|sarif] [--explain]`", add_help=False)

    m = sub.add_parser("mutants", help="run the contract tests against the catalogue of broken runtimes")
    m.add_argument("--device", default="sim", help="device to run on (sim, cupy); default sim")
    m.add_argument("--mutant", action="append", help="only this mutant (repeatable)")
    m.add_argument("--jobs", type=int, default=None, help="parallel pytest processes (default: CPU count)")
    m.add_argument("--timeout", type=float, default=600, help="seconds allowed per pytest process (default 600)")
    m.set_defaults(func=_mutants)

    c = sub.add_parser("check", help="run the conformance suite on the available engines and write a report "
                       "(unknown options are passed to pytest)")
    c.add_argument("--engines", default=None, help="comma-separated engines (default: all available)")
    c.add_argument("--report-dir", default="reports", help="where report.json and report.md go (default: reports/)")
    c.set_defaults(func=_check)

    d = sub.add_parser("decode", help="greedy-decode a prompt with a golden (or any golden-contract) model")
    d.add_argument("model", help="a .onnx path or a golden model name, e.g. tiny-fp32-standard")
    d.add_argument("--prompt", required=True)
    d.add_argument("--tokens", type=int, default=16)
    d.add_argument("--engine", default="ref-sim",
                   help="a registered engine (ref-sim, ref-cuda, ort-cpu, ort-cuda, ...) or pkg.module:factory")
    d.add_argument("--capture", choices=("on", "off"), default="off",
                   help="capture decode steps: one graph per step with a fixed-capacity cache, captured "
                        "segments and eager seams with a growing one; ort-cuda: ONNX Runtime CUDA graphs")
    d.set_defaults(func=_decode)

    g = sub.add_parser("golden", help="golden anchors: `lockstep golden regenerate [--model NAME]`")
    gsub = g.add_subparsers(dest="golden_command", required=True)
    gr = gsub.add_parser("regenerate", help="recompute anchors from the fp32 oracle, show the diff, write atomically")
    gr.add_argument("--model", action="append", help="golden model name (repeatable; default: all)")
    gr.add_argument("--source", default="oracle", help="where anchors come from: only 'oracle' is accepted")
    gr.add_argument("--dry-run", action="store_true", help="show what would change, write nothing")
    gr.set_defaults(func=_golden)

    p = sub.add_parser("parity", help="run the sim-vs-CUDA parity scenarios on one device")
    p.add_argument("--device", default="sim")
    p.add_argument("--scenario", action="append")
    p.add_argument("--json", help="write observations to this JSON file")
    p.add_argument("--compare", help="observations from another device to compare with")
    p.set_defaults(func=_parity)

    args, extra = ap.parse_known_args(argv)
    try:
        if args.command == "check":
            return _check(args, extra)
        if extra:
            ap.error(f"unrecognized arguments: {' '.join(extra)}")
        return args.func(args)
    except CliError as exc:
        print(f"lockstep: error: {exc}", file=sys.stderr)
        return 2
    except BrokenPipeError:  # `lockstep ... | head`: the reader left; not an error of ours
        import os

        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0


if __name__ == "__main__":
    sys.exit(main())
