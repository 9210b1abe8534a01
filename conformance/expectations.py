"""What each engine is expected to fail or to be unable to run: the suite fails closed.

An expectations file (TOML; the packaged ``conformance/node_suite/expectations.toml`` for the built-in
engines, plus each engine's own ``expectations`` file) holds ``[[expect]]`` entries::

    [[expect]]
    engine = "ort-cpu"                     # optional in an engine's own file (below)
    patterns = ["test_scan_sum", "test_scan9_*"]   # or pattern = "..."
    kind = "unsupported"                   # xfail | skip | unsupported
    reason = "no kernel for ai.onnx::Scan"
    when = { onnxruntime = "==1.31.*" }    # optional: only with these library versions

A pattern (``*`` and ``?`` wildcards; brackets are literal) is matched against a test's key: a node case's name (``test_abs``), or, for the
other engine tests, the test function with its parameters but the engine
(``test_capture_on_off_byte_identity[tiny-fp32-standard]``).

- ``xfail`` (strict): the case must fail; one that starts passing fails the run.
- ``skip``: not run.
- ``unsupported``: the engine reports it cannot run the case (an op, a dtype, a capability it
  lacks). A case an engine newly cannot run, with no such entry, is a FAILURE: a kernel dropped from
  a registry, an op regressing to "not implemented", a capability lost. A case an entry expects
  unsupported that now runs is reported ("newly runs": delete the entry).

An engine's own file (its ``expectations`` attribute) needs no ``engine``: an entry without it is the
engine's that declares the file, and of each engine that declares it when variants of one plugin
(two factories, two names) share one file. An entry that names an engine is that engine's alone (a
variant's own difference), left out for the other engines sharing the file. A declared file that
does not exist yet holds no entry: every case the engine cannot run fails (the run says how to
write it). The writers (``lockstep expectations --from-report``, ``lockstep cases
--emit-expectations``) write entries without ``engine``;
``--engine-field`` adds it, for a file several engines share (lockstep's packaged one).

An entry whose ``when`` holds and that matches no case is stale: a usage error. ``when`` keys are
distribution names (``onnx``, ``onnxruntime`` — which also matches ``onnxruntime-gpu`` —,
``ml_dtypes``, ``numpy``); the built-in ONNX Runtime entries are recorded for the ONNX Runtime
versions the ``ort`` extra allows, and node cases whose generated expected outputs are wrong under
some ml_dtypes are keyed to it (``when = { ml_dtypes = "==0.7.*" }``).
"""

from __future__ import annotations

import functools
import os
import re
import tomllib
from collections import Counter
from dataclasses import dataclass, field
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path
from typing import Any, Iterable

from lockstep.errors import LockstepError

__all__ = ["Entry", "ExpectationsError", "load", "applies", "test_key", "key_from_nodeid", "reason_class", "KINDS",
           "emit"]

KINDS = ("xfail", "skip", "unsupported")
_ALIASES = {"onnxruntime": ("onnxruntime", "onnxruntime-gpu")}


class ExpectationsError(LockstepError, ValueError):
    """An expectations file is malformed; the message names the file and the entry."""


@dataclass
class Entry:
    engine: str
    patterns: list[str]
    kind: str
    reason: str
    when: dict[str, str] = field(default_factory=dict)
    file: str = ""


@functools.lru_cache(maxsize=None)  # every collected case is matched against every pattern
def _regex(pattern: str) -> re.Pattern:
    # a pattern without "[" is a node case's name (or a test function's bare key): its "*" stays out of a
    # parametrized key's brackets, so "test_*" (every node case) never takes test_tripwire[model]
    star = ".*" if "[" in pattern else r"[^\[]*"
    return re.compile("".join(star if c == "*" else "." if c == "?" else re.escape(c) for c in pattern) + r"\Z")


def match(key: str, pattern: str) -> bool:
    """Glob match with ``*`` and ``?`` only: brackets in test keys (``test_x[model]``) are literal, and a
    pattern without a bracket matches no bracketed key."""
    return bool(_regex(pattern).match(key))


def filter_keys(keys: Iterable[str], pattern: str) -> list[str]:
    if "*" not in pattern and "?" not in pattern:  # an exact key (most patterns): no regex over every key
        return [pattern] if pattern in keys else []
    rx = _regex(pattern)
    return [k for k in keys if rx.match(k)]


def _installed(dist: str) -> str | None:
    """The version in use: the importable module's own for onnx/onnxruntime (a build on PYTHONPATH
    shadows an installed distribution of another version, as on the GPU lane), else the metadata's."""
    import importlib

    module = {"onnx": "onnx", "onnxruntime": "onnxruntime"}.get(dist)
    if module is not None:
        try:
            return importlib.import_module(module).__version__
        except ImportError:
            pass
    for name in _ALIASES.get(dist, (dist,)):
        try:
            return version(name)
        except PackageNotFoundError:
            continue
    return None


def applies(entry: Entry) -> bool:
    """Whether the entry's ``when`` holds for the installed libraries (no ``when``: always)."""
    if not entry.when:
        return True
    from packaging.specifiers import SpecifierSet

    for dist, spec in entry.when.items():
        got = _installed(dist)
        if got is None or got not in SpecifierSet(spec, prereleases=True):
            return False
    return True


def load(path: str | os.PathLike, engine: str | None = None) -> list[Entry]:
    """The entries of one file. In an engine's own file (``engine`` given) an entry without
    ``engine`` is that engine's; one naming another engine (a variant sharing the file) is kept as
    that engine's."""
    path = Path(path)
    try:
        raw = tomllib.loads(path.read_text(encoding="utf-8")).get("expect", [])
    except (tomllib.TOMLDecodeError, OSError, UnicodeDecodeError) as exc:
        raise ExpectationsError(f"{path}: not a readable TOML expectations file: {exc}") from None
    out, problems = [], []
    for n, e in enumerate(raw):
        e = dict(e)
        if engine is not None:
            e.setdefault("engine", engine)
        patterns = e.get("patterns") or ([e["pattern"]] if e.get("pattern") else [])
        missing = [k for k in ("engine", "kind", "reason") if not e.get(k)] + ([] if patterns else ["pattern(s)"])
        if missing or e.get("kind") not in KINDS or not isinstance(e.get("engine"), str):
            problems.append(f"entry {n}: needs engine, pattern or patterns, kind ({'|'.join(KINDS)}) and reason; "
                            f"got {e}")
            continue
        when = e.get("when") or {}
        if not isinstance(when, dict) or not all(isinstance(v, str) for v in when.values()):
            problems.append(f"entry {n}: when must map distributions to version specifiers, got {when!r}")
            continue
        try:
            from packaging.specifiers import SpecifierSet

            for spec in when.values():
                SpecifierSet(spec)
        except Exception as exc:
            problems.append(f"entry {n}: when {when}: {exc}")
            continue
        out.append(Entry(e["engine"], list(patterns), e["kind"], e["reason"], dict(when), str(path)))
    if problems:
        raise ExpectationsError(f"{path}:\n  " + "\n  ".join(problems))
    return out


def test_key(item: Any, engine: str) -> str:
    """A test item's key: the node case's name, or the function with its parameters but the engine."""
    case = getattr(getattr(item, "callspec", None), "params", {}).get("case")
    if case is not None and hasattr(case, "name"):
        return case.name
    return key_from_nodeid(item.nodeid, engine)


_ORT_CODE = re.compile(r"\[ONNXRuntimeError\] : \d+ : ")  # ONNX Runtime's status code, the same for every op
_DETAIL = re.compile(r" node with name .*$| \(.*$|; .*$")  # a node's name, a parenthesised or later detail
_SOURCE = re.compile(r"\S+\.(?:cc|cpp|cu|h|hpp):\d+(?:\s+[\w:~<>]+\([^)]*\))?\s*")  # a C++ file:line, function


def reason_class(why: str, engines: Iterable[str] = (), op: str | None = None) -> str:
    """A cannot-run reason without its per-case details, naming the operator the case is about
    (``op``, a node case's) when the text does not: 'no kernel for ai.onnx::Loop' stays, node
    names and the engine's name in front go; ONNX Runtime's messages keep what follows their
    status code ('Resize: NOT_IMPLEMENTED: Could not find an implementation for Resize(19)')."""
    text = (why.strip().splitlines() or [""])[0]
    names = set(engines)
    while True:
        head, sep, rest = text.partition(": ")
        if not (sep and head in names):
            break
        text = rest
    if "no kernel for" in text:
        ops = text.split("no kernel for ", 1)[1].split(";")[0].split(" (")[0].split(", ")
        cls = "no kernel for " + ", ".join(ops[:4]) + (f" and {len(ops) - 4} more" if len(ops) > 4 else "")
    else:
        cls = _DETAIL.sub("", _SOURCE.sub("", _ORT_CODE.sub("", text)).replace(" : ", ": ")).strip().rstrip(":;,")
        if len(cls) > 120:
            cls = cls[:120].rsplit(" ", 1)[0] + " ..."
    cls = cls or "no reason given"
    if op and not re.search(rf"(?<![A-Za-z0-9]){re.escape(op)}(?![A-Za-z0-9])", cls):
        cls = f"{op}: {cls}"
    return cls


def key_from_nodeid(nodeid: str, engine: str) -> str:
    """The key of a test from its node id (for reports written before keys were recorded)."""
    name = nodeid.split("::")[-1]
    func, _, params = name.partition("[")
    params = params.rstrip("]")
    if func == "test_node_case":
        return params.split(f"{engine}-", 1)[1] if params.startswith(f"{engine}-") else params
    if params == engine:  # the engine is the test's only parameter: the key is the function
        params = ""
    for form in (f"{engine}-", f"-{engine}"):
        if form in params:
            params = params.replace(form, "", 1)
            break
    return f"{func}[{params}]" if params else func


def emit(engine: str, rows: Iterable[tuple], when: dict[str, str] | None = None, *, engine_field: bool = False,
         source: str = "") -> str:
    """TOML ``unsupported`` entries for ``(key, reason)`` or ``(key, reason, op)`` rows: one entry per
    operator for node cases (``op`` given; the reason its cases give most), one per reason for the
    other tests; operators in alphabetical order, then reasons, keys sorted: a stable, reviewable
    file. ``engine_field``: write ``engine = NAME`` (a file several engines share); without it the
    entries are for the engine's own file (and every variant sharing it)."""
    by_op: dict[str, list[tuple[str, str]]] = {}
    by_reason: dict[str, list[str]] = {}
    n = 0
    for row in rows:
        key, reason, op = (*row, None)[:3]
        n += 1
        if op:
            by_op.setdefault(op, []).append((key, reason))
        else:
            by_reason.setdefault(reason, []).append(key)
    groups = []
    for op in sorted(by_op, key=lambda o: (o.lower(), o)):
        reasons = Counter(r for _, r in by_op[op]).most_common()
        top = min(reasons, key=lambda rc: (-rc[1], rc[0]))[0]
        more = f" (and {len(reasons) - 1} other message(s))" if len(reasons) > 1 else ""
        groups.append((top + more, [k for k, _ in by_op[op]]))
    groups += [(reason, by_reason[reason]) for reason in sorted(by_reason)]
    what = f"{n} case(s) it cannot run" + (", by the operator each is about" if by_op else "")
    lines = [f"# {engine}: {what}" + (f" (from {source})" if source else ""), ""]
    for reason, keys in groups:
        lines += ["[[expect]]"] + ([f'engine = "{engine}"'] if engine_field else [])
        lines += ['kind = "unsupported"', f"reason = {_q(reason)}"]
        if when:
            lines.append("when = { " + ", ".join(f"{k} = {_q(v)}" for k, v in when.items()) + " }")
        keys = sorted(set(keys))
        inline = "patterns = [" + ", ".join(_q(k) for k in keys) + "]"
        lines += [inline] if len(inline) <= 110 else ["patterns = [", *(f"  {_q(k)}," for k in keys), "]"]
        lines.append("")
    return "\n".join(lines)


def _q(text: str) -> str:
    return '"' + text.replace("\\", "\\\\").replace('"', '\\"') + '"'


def rows_from_report(report: dict, engine: str, *, new_only: bool = False) -> list[tuple[str, str, str | None]]:
    """``(key, reason class, op)`` of every case ``engine`` could not run in a report (written by
    ``--lockstep-report-dir``): skipped as unsupported (expected), or failed as newly unsupported;
    ``new_only``: only the latter (to append to the engine's file). ``op``: the operator a node case
    is about, else None."""
    rows = []
    for nodeid, o in report.get("tests", {}).items():
        if o.get("engine") != engine:
            continue
        key = o.get("key") or key_from_nodeid(nodeid, engine)
        reason = o.get("reason") or ""
        message = o.get("message") or ""
        if o.get("outcome") == "skipped" and reason.startswith("unsupported: ") and not new_only:
            detail = reason[len("unsupported: "):]
        elif o.get("outcome") == "failed" and " newly cannot run " in message:
            detail = message.split(f" newly cannot run {key}: ", 1)[-1]
        else:
            continue
        rows.append((key, reason_class(detail, [engine], o.get("op")), o.get("op")))
    return rows


def failures_from_report(report: dict, engine: str) -> list[tuple[str, str]]:
    """``(key, reason)`` of every test ``engine`` failed in a report, by a wrong value or an error
    (not a test it newly cannot run: ``rows_from_report``): the golden locks, tripwires and capture
    identity as well as node cases. ``reason``: what failed (``wrong value``, ``error``) and the
    failure's first line."""
    rows = []
    for nodeid, o in report.get("tests", {}).items():
        if o.get("engine") != engine or o.get("outcome") != "failed" or o.get("newly_unsupported"):
            continue
        message = o.get("message") or ""
        if " newly cannot run " in message:
            continue
        key = o.get("key") or key_from_nodeid(nodeid, engine)
        rows.append((key, f"{o.get('failure') or 'error'}: {message}".strip()[:240]))
    return sorted(rows)


def emit_xfails(engine: str, rows: Iterable[tuple[str, str]], when: dict[str, str] | None = None, *,
                engine_field: bool = False, source: str = "") -> str:
    """TOML strict ``xfail`` entries, one per failing test (``(key, reason)`` rows): known failures,
    each with what failed; a test that starts passing then fails the run, so the entry goes."""
    rows = list(rows)
    lines = [f"# {engine}: {len(rows)} known failure(s)" + (f" (from {source})" if source else ""), ""]
    for key, reason in rows:
        lines += ["[[expect]]"] + ([f'engine = "{engine}"'] if engine_field else [])
        lines += [f"pattern = {_q(key)}", 'kind = "xfail"', f"reason = {_q(reason)}"]
        if when:
            lines.append("when = { " + ", ".join(f"{k} = {_q(v)}" for k, v in when.items()) + " }")
        lines.append("")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    """``lockstep expectations --from-report reports/report.json --engine NAME [--new | --failures]
    [--when onnxruntime==1.31.*] [--engine-field]``: TOML ``unsupported`` entries for what the engine
    could not run, or (``--failures``) strict ``xfail`` entries for what it failed, for its own
    expectations file."""
    import json
    import sys

    from lockstep.errors import command_parser

    ap = command_parser("lockstep expectations", description=main.__doc__.splitlines()[0])
    ap.add_argument("--from-report", required=True, help="a report.json written by --lockstep-report-dir "
                                                         "(lockstep check writes reports/report.json)")
    ap.add_argument("--engine", action="append", required=True, help="the engine's name (repeatable)")
    ap.add_argument("--new", action="store_true",
                    help="only the cases that failed as newly unsupported (append them: >> FILE); default: every "
                         "case the engine could not run, expected or not (a whole unsupported section)")
    ap.add_argument("--failures", action="store_true",
                    help="strict xfail entries for every test the engine failed by a wrong value or an error (golden "
                         "locks, tripwires, capture identity, node cases): record known failures, each with what "
                         "failed; append them: >> FILE")
    ap.add_argument("--engine-field", action="store_true",
                    help="write engine = NAME into each entry (a file several engines share, like lockstep's own); "
                         "default: entries for the engine's own file, which its variants may share")
    ap.add_argument("--when", action="append", default=[], help="dist<specifier>, e.g. onnxruntime==1.31.* (repeatable)")
    args = ap.parse_args(argv)
    try:
        report = json.loads(Path(args.from_report).read_text())
    except (OSError, ValueError) as exc:
        print(f"{ap.prog}: error: {args.from_report}: {exc}", file=sys.stderr)
        return 2
    when = {}
    for w in args.when:
        m = re.match(r"^([A-Za-z0-9_.-]+)\s*([<>=!~].*)$", w)
        if not m:
            print(f"{ap.prog}: error: --when {w!r}: expected dist<specifier>", file=sys.stderr)
            return 2
        when[m.group(1)] = m.group(2)
    known = sorted({o.get("engine") for o in report.get("tests", {}).values()} - {None, "-"})
    unknown = [e for e in args.engine if e not in known]
    if unknown:
        print(f"{ap.prog}: error: --engine {', '.join(unknown)}: not in {args.from_report} (its engines: {', '.join(known)})",
              file=sys.stderr)
        return 2
    if args.failures and args.new:
        print(f"{ap.prog}: error: --failures and --new: one at a time (xfail entries, or unsupported ones)",
              file=sys.stderr)
        return 2
    for engine in args.engine:
        if args.failures:
            print(emit_xfails(engine, failures_from_report(report, engine), when or None,
                              engine_field=args.engine_field, source=args.from_report))
            continue
        print(emit(engine, rows_from_report(report, engine, new_only=args.new), when or None,
                   engine_field=args.engine_field, source=args.from_report))
    return 0
