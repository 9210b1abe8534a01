"""The ``lockstep`` command line."""

from __future__ import annotations

import argparse
import shlex
import sys
from pathlib import Path

from lockstep.errors import LockstepError


def _device(name: str) -> str:
    """A device name that exists and can be built here, or a one-line error."""
    from lockstep.reference_runtime.backends import DEVICES, available_devices

    if name not in DEVICES:
        raise CliError(f"--device {name!r}: unknown device; devices: {', '.join(DEVICES)}")
    ok, why = available_devices()[name]
    if not ok:
        raise CliError(f"--device {name}: unavailable here: {why}")
    return name


def _mutants(args: argparse.Namespace) -> int:
    from lockstep.contracts.layers import SOURCE_LAYERS, catalogue
    from lockstep.contracts.mutant_runner import run_mutants
    from lockstep.contracts.mutants import MUTANTS

    if args.jobs is not None and args.jobs < 1:
        raise CliError(f"--jobs {args.jobs}: at least 1")
    layers = list(dict.fromkeys(la for item in args.layer or [] for la in item.split(",") if la))
    if "all" in layers:
        layers = list(SOURCE_LAYERS)
    unknown_layers = [la for la in layers if la not in SOURCE_LAYERS]
    if unknown_layers:
        raise CliError(f"--layer: unknown layer(s) {unknown_layers}; layers: all, {', '.join(SOURCE_LAYERS)}")
    source = catalogue(SOURCE_LAYERS)
    if args.list:
        for name, cls in MUTANTS.items():
            print(f"runtime.{name}  {(cls.__doc__ or '').strip().splitlines()[0]}")
        for key, m in source.items():
            if not layers or m.layer in layers:
                tag = " [ci]" if m.ci else ""
                tag += " [equivalent]" if m.equivalent else ""
                print(f"{key}{tag}  {m.breaks}")
        return 0
    names = [n.removeprefix("runtime.") if n.removeprefix("runtime.") in MUTANTS else n for n in args.mutant or []]
    unknown = [n for n in names if n not in MUTANTS and n not in source]
    if unknown:
        raise CliError(f"--mutant: unknown mutant(s) {unknown}; `lockstep mutants --list` lists them")
    for opt, path in (("--json", args.json), ("--markdown", args.markdown)):
        if path is not None and not path.parent.is_dir():
            raise CliError(f"{opt} {path}: folder {path.parent} does not exist")
    device = _device(args.device)
    runtime_names = [n for n in names if n in MUTANTS]
    source_names = [n for n in names if n in source]
    if not layers and not source_names:  # the runtime catalogue: runs from the wheel alone
        return run_mutants(device, runtime_names or None, jobs=args.jobs, timeout_s=args.timeout)
    from lockstep.contracts.layer_runner import CheckoutNotFound, run_layers

    rc = 0
    if runtime_names:
        rc |= run_mutants(device, runtime_names, jobs=args.jobs, timeout_s=args.timeout)
    try:
        rc |= run_layers(layers or None if not source_names else [], source_names or None, device=device,
                         ci_only=args.ci, jobs=args.jobs, timeout_s=args.timeout,
                         json_path=args.json, markdown_path=args.markdown)
    except CheckoutNotFound as exc:
        raise CliError(str(exc)) from None
    return rc


def _check(args: argparse.Namespace, passthrough: list[str]) -> int:
    """The main job: the packaged conformance suite (``pytest --pyargs lockstep.conformance``) on
    the selected engines, and the tests those engines bring of their own machinery (``self_tests``:
    the reference runtime's ``lockstep.contracts.suite``), with a report. Runs from any directory."""
    import time
    from pathlib import Path
    from pathlib import Path as _P

    try:
        import pytest
    except ImportError:  # an install without the test extra: one line, not a traceback
        raise CliError("lockstep check runs pytest, which is not installed: "
                       "pip install 'lockstep-conformance[test]'") from None

    if not _P(args.report_dir).resolve().parent.is_dir():
        raise CliError(f"--report-dir {args.report_dir}: its parent folder does not exist")
    if args.golden_dir:
        from lockstep.golden.catalog import GoldenError, dir_models

        for d in args.golden_dir:
            try:
                dir_models(d)
            except GoldenError as exc:  # before pytest starts: one line, no run, no report
                raise CliError(str(exc)) from None
    if args.cases_dir:
        from lockstep.reference_runtime.node_cases import CaseDirError, load_case_dirs

        for d in args.cases_dir:
            try:
                load_case_dirs(d)
            except CaseDirError as exc:
                raise CliError(str(exc)) from None
    argv = ["--pyargs", "lockstep.conformance", *_self_tests(args.engines), f"--lockstep-report-dir={args.report_dir}",
            # xunit1: the JUnit family whose testcases may carry properties (engine, op, key, markers,
            # precision, the golden plot data); under xunit2 pytest warns once per recorded property
            f"--junitxml={_P(args.report_dir) / 'junit.xml'}", "-o", "junit_family=xunit1",
            # this command imported lockstep before pytest loads its plugin; the suite's test
            # modules are still rewritten, only the plugin's own asserts are not
            "-W", "ignore:Module already imported so cannot be rewritten:pytest.PytestAssertRewriteWarning"]
    if args.engines:
        argv.append(f"--engines={args.engines}")
    argv += [f"--golden-dir={d}" for d in args.golden_dir]
    argv += [f"--lockstep-cases-dir={d}" for d in args.cases_dir]
    argv += _workers(args.jobs, passthrough)
    started = time.time()
    rc = int(pytest.main(argv + passthrough))
    md = Path(args.report_dir) / "report.md"
    if md.is_file() and md.stat().st_mtime >= started:  # written by this run, not an earlier one
        print(md.read_text())
        print(f"report: {md} and {md.with_suffix('.json')}")
    return rc


def _self_tests(engines: str | None) -> list[str]:
    """The packages of the selected engines' own tests (their ``self_tests``: the reference engines'
    ``lockstep.contracts.suite``), each once, run beside the suite."""
    from lockstep.engines import EngineLoadError, load_engine, registered
    from lockstep.engines.protocol import capabilities
    from lockstep.engines.selection import split

    try:
        specs = split(engines) or list(registered())
        found = [capabilities(load_engine(spec)).self_tests for spec in specs]
    except EngineLoadError:
        return []  # pytest's plugin says which engine, as a usage error, before anything runs
    return list(dict.fromkeys(p for p in found if p))


def _workers(jobs: str, passthrough: list[str]) -> list[str]:
    """pytest-xdist's options for ``--jobs``: ``auto`` (the default) one worker per CPU where
    pytest-xdist is installed, the pytest options name none of their own and this process is not
    itself run by a pytest-xdist worker (whose run has the CPUs already: a test of lockstep's that
    runs ``lockstep check``); ``1`` in-process."""
    import os

    if jobs != "auto" and not (jobs.isdigit() and int(jobs) >= 1):
        raise CliError(f"--jobs {jobs!r}: a number of processes (1: in this process) or auto")
    own = any(a in ("-n", "--numprocesses", "--dist") or a.startswith(("-n", "--numprocesses=", "--dist="))
              or a == "no:xdist" for a in passthrough)
    if own or jobs == "1" or (jobs == "auto" and os.environ.get("PYTEST_XDIST_WORKER")):
        return []
    import importlib.util

    if importlib.util.find_spec("xdist") is None:
        if jobs != "auto":
            raise CliError(f"--jobs {jobs}: needs pytest-xdist (pip install 'lockstep-conformance[test]')")
        return []
    # worksteal: an idle worker takes tests from a busy one's queue. pytest-xdist's default (load) hands
    # each worker its share ahead and never takes it back: on two cores one worker sat idle for most of
    # a check while the other ran the golden tests it had been handed (171 s, 1.2 cores busy)
    return ["-n", jobs, "--dist", "worksteal"]


class CliError(LockstepError):
    """A usage problem: printed as one ``lockstep: error: ...`` line, exit status 2."""


def _utf8(option: str, text: str) -> str:
    """``text`` if it encodes as UTF-8 (a command line may carry lone surrogates), else a CliError."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise CliError(f"{option}: not valid UTF-8 text ({exc.reason} at character {exc.start})") from None
    return text


def _named(path, exc: Exception) -> str:
    """The error's one line, naming ``path`` once."""
    msg = str(exc)
    return msg if msg.startswith(str(path)) else f"{path}: {msg}"


def engine_failure(exc: BaseException) -> bool:
    """An error of the engine's runtime, not of lockstep (whose bugs keep their traceback): ONNX
    Runtime's own exception types, the RuntimeError its IO-binding run raises ("Error in execution:",
    a status "[ONNXRuntimeError]": a device failure ort-cpu/ort-cuda re-raise), ORT GenAI's GenAIError."""
    from lockstep.engines.ort_genai import GenAIError

    if isinstance(exc, GenAIError) or type(exc).__module__.startswith(("onnxruntime.", "onnxruntime_genai")):
        return True
    text = str(exc)
    return isinstance(exc, RuntimeError) and (text.startswith("Error in execution:") or "[ONNXRuntimeError]" in text)


def _warn_bytes(tokenizer, vocab: int) -> None:
    """A model of more than 256 tokens read as UTF-8 bytes is almost never what was meant."""
    if tokenizer is None and vocab > 256:
        print(f"warning: no tokenizer (no --tokenizer, no tokenizer.json beside the model): the text is read as "
              f"UTF-8 bytes (ids 0..255) though the model has {vocab} tokens", file=sys.stderr)


def _decode(args: argparse.Namespace) -> int:
    """Greedy decode of a prompt on any registered engine; prints the text, token ids and counters."""
    import json
    from pathlib import Path

    from lockstep.decoder_io import ModelCardError, NotADecoder, StepError
    from lockstep.decoding import greedy, open_session
    from lockstep.engines import EngineLoadError, Unsupported
    from lockstep.engines.registry import load_available
    from lockstep.errors import FeedError
    from lockstep.golden.catalog import builtin_models, export_models, trained_models
    from lockstep.golden.text import Text, TokenizerError
    from lockstep.kernels import OpError
    from lockstep.loading import ModelError, load_model
    from lockstep.reference_runtime.errors import CudaError

    if args.tokens < 1:
        raise CliError(f"--tokens {args.tokens}: generate at least one token")
    _utf8("--prompt", args.prompt)
    path, tokenizer, random_weights = Path(args.model), args.tokenizer, None
    if not path.is_file():
        known = {m.name: m for m in [*builtin_models(), *trained_models(), *export_models()]}
        gm = known.get(args.model)
        if gm is None:
            raise CliError(f"model {args.model!r}: neither a file nor a golden model name ({', '.join(sorted(known))})")
        ok, why = gm.available()
        if not ok:
            raise CliError(f"model {gm.name} is unavailable here: {why}")
        path = gm.model_path()
        tokenizer = tokenizer or gm.tokenizer_path()
        if gm.kind == "builtin":  # generated to lock tokens: their weights are random
            random_weights = gm.name
    try:
        engine = load_available(args.engine)
    except EngineLoadError as exc:
        raise CliError(str(exc)) from None
    try:
        model, _ = load_model(path)
        from lockstep.decoder_io import DecoderIO
        from lockstep.genai_config import card_for, tokenizer_for
        from lockstep.model_source import mark_source

        mark_source(model, path)  # an engine that runs the model's folder (ort-genai) finds its config there

        card = card_for(path, args.io)
        io = DecoderIO.of(model, card)
        tokenizer = tokenizer or tokenizer_for(path)
        _warn_bytes(tokenizer, io.vocab)
        text = Text.load(tokenizer, io.vocab)
        prompt = text.encode(args.prompt)
        if not prompt:
            raise CliError("--prompt: empty prompt (it must encode to at least one token)")
        room = io.capacity - len(prompt) if io.capacity else None
        if room is not None and args.tokens > room + 1:
            raise CliError(f"--tokens {args.tokens}: the model's fixed KV cache holds {io.capacity} positions, "
                           f"the prompt takes {len(prompt)}: at most {room + 1} tokens")
        session = open_session(engine, model, capture=args.capture == "on", io=io)
    except (ModelError, ModelCardError, TokenizerError) as exc:
        raise CliError(_named(path, exc)) from None
    except (Unsupported, NotADecoder) as exc:
        raise CliError(f"{path.name} on {engine.name}: {str(exc).removeprefix(f'{engine.name}: ')}") from None
    except (CudaError, OpError) as exc:  # a device refusal (MemoryAllocation...) or a node's attributes
        raise CliError(f"{path.name} on {engine.name}: {type(exc).__name__}: {exc}") from None
    except Exception as exc:
        if not engine_failure(exc):
            raise
        raise CliError(f"{path.name} on {engine.name}: {type(exc).__name__}: {exc}") from None
    try:
        result = greedy(session, prompt, args.tokens)
    except (CudaError, OpError) as exc:
        raise CliError(f"{path.name} on {engine.name}: {type(exc).__name__}: {exc}") from None
    except (ModelError, FeedError, StepError) as exc:
        raise CliError(f"{path.name} on {engine.name}: {exc}") from None
    except Exception as exc:
        if not engine_failure(exc):
            raise
        raise CliError(f"{path.name} on {engine.name}: {type(exc).__name__}: {exc}") from None
    print(f"engine: {engine.name}  model: {path.name}  text: {text.name}")
    print(f"prompt: {args.prompt!r}")
    print(f"output: {text.decode(result.tokens)!r}")
    if random_weights:
        print(f"note: {random_weights} is one of lockstep's built-in golden models, whose weights are random (they "
              f"lock token ids, not meaning): its text is noise; for real text decode the trained SmolLM2 export: "
              f"lockstep decode smollm2-fp32 --prompt {shlex.quote(args.prompt)}")
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


def _progress():
    try:
        from tqdm import tqdm
    except ImportError:  # progress is a nicety, not a dependency of correctness
        def tqdm(it, **kw):
            return it
        tqdm.write = print
    return tqdm


def _golden(args: argparse.Namespace) -> int:
    """Regenerate golden anchors from the fp32 oracle, show what changed, write atomically."""
    from lockstep.golden.anchors import diff_snapshots, same_anchors
    from lockstep.golden.catalog import GoldenError, builtin_models, dir_models, export_models, trained_models

    if args.source != "oracle":
        raise CliError(f"refusing --source {args.source}: anchors come from the fp32 oracle only "
                       "(an engine under test is never its own yardstick)")
    if args.dir and not Path(args.dir).is_dir():
        raise CliError(f"--dir {args.dir}: no such directory (a folder of snapshots written by `lockstep golden add`)")
    try:
        models = dir_models(args.dir) if args.dir else [*builtin_models(), *trained_models(), *export_models()]
    except GoldenError as exc:
        raise CliError(str(exc).replace("--golden-dir ", "--dir ", 1)) from None
    by_name = {m.name: m for m in models}
    names = args.model or [m.name for m in models if m.kind != "shared" and (m.kind != "trained" or m.available()[0])]
    unknown = [n for n in names if n not in by_name]
    if unknown:
        raise CliError(f"unknown golden model(s) {unknown}; known: {sorted(by_name)}")
    tqdm = _progress()
    changed = 0
    for name in tqdm(names, desc="golden anchors", unit="model"):
        gm = by_name[name]
        new = gm.compute_anchors()
        try:
            old = gm.snapshot()
        except (FileNotFoundError, ValueError):
            old = None
        diff = diff_snapshots(old, new)
        if old is not None and same_anchors(old, new):
            # the same comparison `pytest --snapshot-update` makes: nothing to write
            extra = f" ({'; '.join(diff)})" if diff else ""
            tqdm.write(f"{name}: unchanged{extra}")
            continue
        changed += 1
        lines = [f"{name}: {len(diff)} change(s)", *(f"  {line}" for line in diff[:40])]
        if len(diff) > 40:
            lines.append(f"  ... and {len(diff) - 40} more")
        if not (args.dry_run or args.check):
            lines.append(f"  written: {gm.write(new)}")
        tqdm.write("\n".join(lines))
    if args.dry_run or args.check:  # said every time: a dry run that changed nothing wrote nothing too
        print(f"{'check' if args.check else 'dry run'}: {changed} of {len(names)} snapshot(s) would change; "
              "nothing written")
    return 1 if args.check and changed else 0


def _golden_add(args: argparse.Namespace) -> int:
    """Record a golden snapshot for the user's model from the fp32 oracle."""
    from lockstep.decoder_io import DecoderIO, ModelCardError, NotADecoder
    from lockstep.engines.registry import EngineLoadError
    from lockstep.genai_config import card_for, tokenizer_for
    from lockstep.golden.anchors import OracleDisagreement
    from lockstep.golden.catalog import GoldenError, add_model
    from lockstep.golden.text import TokenizerError
    from lockstep.loading import ModelError

    if not args.name or "/" in args.name or args.name.startswith("."):
        raise CliError(f"--name {args.name!r}: a plain name (it becomes <dir>/<name>.json)")
    _utf8("--prompt", args.prompt)
    try:
        card = card_for(args.model, args.io)
        tokenizer = args.tokenizer or tokenizer_for(args.model)
        if tokenizer is None:  # the cached load add_model reads again (catalog.load_file): one parse
            from lockstep.golden.catalog import load_file

            _warn_bytes(None, DecoderIO.of(load_file(Path(args.model)), card).vocab)
        from lockstep.decoder_io import card_path_for, parse_io_option, read_card

        toml = card_path_for(args.model)
        said = {**(read_card(toml) if toml.is_file() else {}), **(parse_io_option(args.io) if args.io else {})}
        path = add_model(args.model, args.name, args.prompt, args.dir, tokens=args.tokens, tokenizer=tokenizer,
                         twin=args.twin, card=card, crosscheck=not args.no_crosscheck, progress=print,
                         fit_capacity="kv_capacity" not in said, propose=args.propose)
    except (GoldenError, ModelCardError, NotADecoder, TokenizerError, ModelError, OracleDisagreement,
            FileNotFoundError, EngineLoadError) as exc:
        raise CliError(str(exc)) from None
    print(f"written: {path}")
    print(f"lock it: pytest --pyargs lockstep.conformance --golden-dir {args.dir} -m golden   "
          f"(or lockstep check --golden-dir {args.dir})")
    return 0


def _report_merge(args: argparse.Namespace) -> int:
    """Merge the report.json of several shards into one report (md, json, pictures)."""
    from lockstep.conformance.report import ReportError, merge

    try:
        paths = merge(args.reports, args.output)
    except ReportError as exc:
        raise CliError(str(exc)) from None
    print(f"merged {len(args.reports)} report(s): {paths['markdown']} and {paths['json']}")
    return 0


def _report_diff(args: argparse.Namespace) -> int:
    """What changed between two reports (runs), or two engines of one: exit status 1 when a test newly fails."""
    import json

    from lockstep.conformance.report import ReportError, read_report
    from lockstep.conformance.report_diff import diff, render_text, side

    engines = None
    if args.engines is not None:
        engines = [e.strip() for e in args.engines.split(",")]
        if len(engines) != 2 or not all(engines):
            raise CliError(f"--engines {args.engines!r}: two engines, X,Y (X of the first report, Y of the second "
                           "or of the same one)")
    if len(args.reports) > 2 or (len(args.reports) == 1 and engines is None):
        raise CliError(f"{len(args.reports)} report(s): give two (A B: two runs), or one with --engines X,Y "
                       "(two engines of one run)")
    if len(args.reports) == 1 and engines[0] == engines[1]:
        raise CliError(f"--engines {args.engines}: the same engine twice in one report")
    if not args.threshold >= 0:  # NaN too
        raise CliError(f"--threshold {args.threshold}: a number >= 0 (the smallest move of a margin to list)")
    if args.top < 0:
        raise CliError(f"--top {args.top}: a number >= 0")
    paths = args.reports if len(args.reports) == 2 else args.reports * 2
    try:
        reports = [read_report(p) for p in dict.fromkeys(paths)]
        ra, rb = reports[0], reports[-1]
        a = side(ra, engines and engines[0], paths[0])
        b = side(rb, engines and engines[1], paths[1])
    except ReportError as exc:
        raise CliError(str(exc)) from None
    name_a = f"{paths[0]}" + (f" (engine {engines[0]})" if engines else "")
    name_b = f"{paths[1]}" + (f" (engine {engines[1]})" if engines else "")
    d = diff(a, b, a_name=name_a, b_name=name_b, threshold=args.threshold,
             env_a=None if ra is rb else ra.get("environment"), env_b=None if ra is rb else rb.get("environment"))
    if args.format == "json":
        print(json.dumps(d.as_dict(), indent=1))
    else:
        print(render_text(d, top=args.top, limit=None if args.all else 50), end="")
    return d.exit_status


def _parity(args: argparse.Namespace) -> int:
    from pathlib import Path

    from lockstep.contracts import parity

    _device(args.device)
    unknown = [n for n in args.scenario or [] if n not in parity.SCENARIOS]
    if unknown:
        raise CliError(f"--scenario: unknown scenario(s) {unknown}; known: {', '.join(sorted(parity.SCENARIOS))}")
    if args.compare and not Path(args.compare).is_file():
        raise CliError(f"--compare {args.compare}: no such file (observations written by `lockstep parity --json`)")
    if args.json and args.json != "-" and not Path(args.json).resolve().parent.is_dir():
        raise CliError(f"--json {args.json}: the folder does not exist")

    argv = ["--device", args.device]
    for s in args.scenario or []:
        argv += ["--scenario", s]
    if args.json:
        argv += ["--json", args.json]
    if args.compare:
        argv += ["--compare", args.compare]
    return parity.main(argv)


def _audit(argv: list[str]) -> int:
    from lockstep.contracts.audit import main as audit_main

    return audit_main(argv)


def _expectations(argv: list[str]) -> int:
    from lockstep.conformance.expectations import main as expectations_main

    return expectations_main(argv)


def _fuzz(argv: list[str]) -> int:
    from lockstep.conformance.fuzz.command import main as fuzz_main

    return fuzz_main(argv)


def _cases(argv: list[str]) -> int:
    from lockstep.reference_runtime.node_cases import main as cases_main

    return cases_main(argv)


def _locate(argv: list[str]) -> int:
    from lockstep.conformance.locate.command import main as locate_main

    return locate_main(argv)


def _capture_guard(argv: list[str]) -> int:
    from lockstep.reference_runtime.capture_guard_pass import main as capture_guard_main

    return capture_guard_main(argv)


# the commands with an argument parser of their own, in their module: `lockstep NAME ARGS...` is that
# module's main(ARGS), its exit codes; (handler, the help line of `lockstep --help`)
_OWN_PARSER = {
    "audit": (_audit, "static audit of capture-unsafe synchronisation: "
                      "`lockstep audit [PATHS...] [--format text|json|sarif] [--explain]`"),
    "expectations": (_expectations, "write an engine's expectations entries (TOML) from a run's report: "
                                    "`lockstep expectations --from-report reports/report.json --engine NAME [--new]`"),
    "cases": (_cases, "run ONNX's backend node cases on an engine, each case's outcome and a summary: "
                      "`lockstep cases --engine ref-sim --match 'test_add*' [--emit-expectations]`"),
    "capture-guard": (_capture_guard, "the capture guard's pass over ONNX's node cases (captured bytes against "
                                      "eager, host reads): `lockstep capture-guard [--match PATTERN]`"),
    "locate": (_locate, "the first node whose value leaves its error band on an engine, and a minimal case: "
                        "`lockstep locate MODEL --engine SPEC [--position N] [--reduce DIR] [--format json]`"),
    "fuzz": (_fuzz, "fuzz the reference runtime (with ONNX Runtime beside) and the CLI from a seed, reproducers "
                    "per crash: `lockstep fuzz --cases N --seed S`, `lockstep fuzz --replay DIR`"),
}


def _own_parser(handler, argv: list[str]) -> int:
    """A command of ``_OWN_PARSER``: its exit status, argparse's too (``--help``: 0, a usage error: 2)."""
    try:
        return handler(argv)
    except SystemExit as exc:
        return 0 if exc.code is None else exc.code if isinstance(exc.code, int) else 2


def main(argv: list[str] | None = None) -> int:
    import sys

    raw = list(sys.argv[1:] if argv is None else argv)
    if raw[:1] and raw[0] in _OWN_PARSER:
        return _guarded(lambda: _own_parser(_OWN_PARSER[raw[0]][0], raw[1:]))
    from lockstep import __version__

    ap = argparse.ArgumentParser(prog="lockstep", description="Conformance and correctness suite for CUDA inference runtimes.")
    ap.add_argument("--version", action="version", version=f"lockstep {__version__}")
    sub = ap.add_subparsers(dest="command", required=True)
    for name, (_, help_line) in _OWN_PARSER.items():
        sub.add_parser(name, help=help_line, add_help=False)

    m = sub.add_parser("mutants", help="prove the tests can fail: run them against catalogues of broken code "
                       "(default: the runtime's contract tests against broken runtimes)")
    m.add_argument("--device", default="sim", help="device to run on (sim, cupy); default sim")
    m.add_argument("--layer", action="append",
                   help="run this layer's source mutants (repeatable or comma-separated; `all` for every layer "
                        "with its score): runtime, sim, executor, capture_plan, segments, golden, pager, audit, "
                        "sync_debug, kernels. Source layers run the tests of a lockstep checkout")
    m.add_argument("--mutant", action="append",
                   help="only this mutant (repeatable; `--list` names them): each named mutant must be killed; the "
                        "rule that every contract test kills some mutant needs the full runtime catalogue")
    m.add_argument("--ci", action="store_true", help="only the mutants of the CI subset")
    m.add_argument("--list", action="store_true", help="list the mutants and the guarantee each breaks")
    m.add_argument("--json", type=Path, default=None, help="write every mutant's outcome and the scores here")
    m.add_argument("--markdown", type=Path, default=None, help="write the scores and outcomes as Markdown tables")
    m.add_argument("--jobs", type=int, default=None, help="parallel pytest processes (default: CPU count)")
    m.add_argument("--timeout", type=float, default=600, help="seconds allowed per pytest process (default 600)")
    m.set_defaults(func=_mutants)

    c = sub.add_parser("check", help="run the conformance suite on the available engines and write a report "
                       "(unknown options are passed to pytest)",
                       description="Run lockstep's conformance suite (pytest --pyargs lockstep.conformance) on the "
                                   "selected engines and write reports/report.{json,md} and junit.xml. A case an "
                                   "engine newly cannot run fails (fail closed); the run says how to record it.",
                       epilog="Other options go to pytest, e.g. -m MARKEXPR to select a part of the suite "
                              "(markers: node_suite, golden, capture, paging, contract, parity, capture_guard; "
                              "-m node_suite runs ONNX's node cases only), -k EXPR, -x, -q. "
                              "Examples: lockstep check --engines ref-sim,ort-cpu; "
                              "lockstep check --engines my_module:make_engine -m node_suite")
    c.add_argument("--engines", default=None,
                   help="comma-separated engines: registered names (ref-sim, ort-cpu, ... and installed plugins') "
                        "or pkg.module:factory, a zero-argument factory in a module importable from here or from "
                        "PYTHONPATH (default: every registered engine)")
    c.add_argument("--report-dir", default="reports", help="where report.json and report.md go (default: reports/)")
    c.add_argument("--golden-dir", action="append", default=[],
                   help="a folder of snapshots from `lockstep golden add` to lock too (repeatable)")
    c.add_argument("--cases-dir", action="append", default=[],
                   help="a folder of ONNX backend node cases (model.onnx, test_data_set_0/) to run in the node suite "
                        "with its expectations (repeatable): your own, or those `lockstep locate --reduce` writes")
    c.add_argument("-j", "--jobs", default="auto",
                   help="pytest-xdist worker processes: auto (default: one per CPU, where pytest-xdist is "
                        "installed) or a number; 1 runs in this process")
    c.set_defaults(func=_check)

    d = sub.add_parser("decode", help="greedy-decode a prompt with a golden (or any golden-contract) model")
    d.add_argument("model", help="a .onnx path or a golden model name, e.g. tiny-fp32-standard, smollm2-fp32")
    d.add_argument("--tokenizer", help="a tokenizers JSON file (default: the golden model's, else UTF-8 bytes)")
    d.add_argument("--io", help="decoder roles as role=name,... (default: <model>.lockstep.toml, else detected)")
    d.add_argument("--prompt", required=True)
    d.add_argument("--tokens", type=int, default=16)
    d.add_argument("--engine", default="ref-sim",
                   help="a registered engine (ref-sim, ref-cuda, ort-cpu, ort-cuda, ...) or pkg.module:factory")
    d.add_argument("--capture", choices=("on", "off"), default="off",
                   help="capture decode steps: one graph per step with a fixed-capacity cache, captured "
                        "segments and eager seams with a growing one; ort-cuda: ONNX Runtime CUDA graphs")
    d.set_defaults(func=_decode)

    g = sub.add_parser("golden", help="golden anchors: `lockstep golden regenerate [--model NAME] [--dir DIR]`, "
                       "`lockstep golden add MODEL.onnx --name NAME --prompt TEXT --dir DIR`")
    gsub = g.add_subparsers(dest="golden_command", required=True)
    gr = gsub.add_parser("regenerate", help="recompute anchors from the fp32 oracle, show the diff, write atomically")
    gr.add_argument("--model", action="append", help="golden model name (repeatable; default: all)")
    gr.add_argument("--source", default="oracle", help="where anchors come from: only 'oracle' is accepted")
    gr.add_argument("--dry-run", action="store_true", help="show what would change, write nothing")
    gr.add_argument("--check", action="store_true",
                    help="for CI: exit 1 with the diff when any snapshot would change; write nothing")
    gr.add_argument("--dir", help="a folder of snapshots written by `lockstep golden add` (default: lockstep's own)")
    gr.set_defaults(func=_golden)
    ga = gsub.add_parser("add", help="record a golden snapshot for your model from the fp32 oracle")
    ga.add_argument("model", help="the .onnx model (a decoder: Optimum, GenAI or lockstep I/O, or a model card)")
    ga.add_argument("--name", required=True, help="the model's name in the suite (<dir>/<name>.json)")
    ga.add_argument("--prompt", required=True, help="the prompt text of the canonical context")
    ga.add_argument("--tokens", type=int, default=None, help="length of the recorded greedy prefix (default 24)")
    ga.add_argument("--tokenizer", help="a tokenizers JSON file (default: tokenizer.json beside the model, else "
                    "UTF-8 bytes, for byte-level models)")
    ga.add_argument("--twin", help="an fp32 model computing the same function (the oracle runs it: for an int4 or "
                                   "contrib-op model; for fp16 the default is the model upcast to fp32)")
    ga.add_argument("--io", help="roles as role=name,... (default: <model>.lockstep.toml, else detected)")
    ga.add_argument("--dir", default="lockstep-golden", help="where the snapshot goes (default: %(default)s)")
    ga.add_argument("--no-crosscheck", action="store_true",
                    help="skip the float64 cross-check on the reference runtime (recorded in the provenance)")
    ga.add_argument("--propose", default="auto", metavar="ENGINE",
                    help="the engine whose greedy decode proposes the greedy prefix for the oracle to vouch for in "
                         "one prefill (a hint: the snapshot is the same whatever proposes it): auto (ort-cpu where "
                         "installed, for a quantized or fp16 model), an engine name, or oracle (the oracle's own "
                         "steps; default: %(default)s)")
    ga.set_defaults(func=_golden_add)

    r = sub.add_parser("report", help="reports: `lockstep report merge SHARD/report.json ... --output DIR`, "
                                      "`lockstep report diff A B`, `lockstep report diff REPORT --engines X,Y`")
    rsub = r.add_subparsers(dest="report_command", required=True)
    rm = rsub.add_parser("merge", help="merge the reports of --lockstep-shard runs into one")
    rm.add_argument("reports", nargs="+", help="report.json files, one per shard")
    rm.add_argument("--output", required=True, help="where the merged report goes")
    rm.set_defaults(func=_report_merge)
    rd = rsub.add_parser("diff", help="what changed between two runs' reports, or two engines of one: newly failing, "
                                      "newly passing, newly skipped tests, margins that moved; exit status 1 when a "
                                      "test newly fails",
                         description="Compare report A with report B (two runs: tests matched by id), or engine X with "
                                     "engine Y (--engines X,Y: of one report, or X of A and Y of B; tests matched by "
                                     "id without the engine). Lists what newly fails (not failing in A, failing in "
                                     "B), newly passes, is newly skipped or unsupported, and the largest moves of "
                                     "the margins and errors the reports record (golden locks' engine margins, a "
                                     "located node's error). Exit status 1 when a test newly fails, else 0; 2 for "
                                     "bad input.")
    rd.add_argument("reports", nargs="+", metavar="REPORT",
                    help="report.json files or the folders holding them: A B, or one with --engines X,Y")
    rd.add_argument("--engines", default=None, metavar="X,Y", help="compare engine X with engine Y")
    rd.add_argument("--threshold", type=float, default=0.0,
                    help="list the margins and errors that moved by at least this much (absolute; default: any move)")
    rd.add_argument("--top", type=int, default=10, help="how many of the largest moves to list (default 10)")
    rd.add_argument("--all", action="store_true", help="list every changed test (default: 50 of each kind)")
    rd.add_argument("--format", choices=("text", "json"), default="text", help="text (default) or json")
    rd.set_defaults(func=_report_diff)

    p = sub.add_parser("parity", help="run the sim-vs-CUDA parity scenarios on one device")
    p.add_argument("--device", default="sim")
    p.add_argument("--scenario", action="append")
    p.add_argument("--json", help="write observations to this JSON file")
    p.add_argument("--compare", help="observations from another device to compare with")
    p.set_defaults(func=_parity)

    args, extra = ap.parse_known_args(argv)

    def run() -> int:
        if args.command == "check":
            return _check(args, extra)
        if extra:
            ap.error(f"unrecognized arguments: {' '.join(extra)}")
        return args.func(args)

    return _guarded(run)


def _guarded(run) -> int:
    """``run()``'s exit status; lockstep's errors as one line, exit status 2."""
    try:
        return run()
    except CliError as exc:  # one line, whatever the message held
        line = "; ".join(part.strip() for part in str(exc).splitlines() if part.strip())
        print(f"lockstep: error: {line}", file=sys.stderr)
        return 2
    except LockstepError as exc:
        # lockstep's named errors (a bad model, feed, attribute, index, a device refusal...) reaching
        # here from any command: their message is the user's answer, one line, class named; anything
        # else is a bug and keeps its traceback
        line = "; ".join(part.strip() for part in str(exc).splitlines() if part.strip())
        print(f"lockstep: error: {type(exc).__name__}: {line}", file=sys.stderr)
        return 2
    except BrokenPipeError:  # `lockstep ... | head`: the reader left; not an error of ours
        import os

        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0


if __name__ == "__main__":
    sys.exit(main())
