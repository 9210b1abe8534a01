"""What each engine is expected to fail or to be unable to run: the suite fails closed.

An expectations file (TOML; the packaged ``conformance/node_suite/expectations.toml`` for the built-in
engines, plus each engine's own ``expectations`` file) holds ``[[expect]]`` entries::

    [[expect]]
    engine = "ort-cpu"                     # optional in an engine's own file
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
from dataclasses import dataclass, field
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path
from typing import Any, Iterable

__all__ = ["Entry", "ExpectationsError", "load", "applies", "test_key", "key_from_nodeid", "reason_class", "KINDS",
           "emit"]

KINDS = ("xfail", "skip", "unsupported")
_ALIASES = {"onnxruntime": ("onnxruntime", "onnxruntime-gpu")}


class ExpectationsError(ValueError):
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
    return re.compile("".join(".*" if c == "*" else "." if c == "?" else re.escape(c) for c in pattern) + r"\Z")


def match(key: str, pattern: str) -> bool:
    """Glob match with ``*`` and ``?`` only: brackets in test keys (``test_x[model]``) are literal."""
    return bool(_regex(pattern).match(key))


def filter_keys(keys: Iterable[str], pattern: str) -> list[str]:
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
    """The entries of one file; in an engine's own file (``engine`` given) ``engine`` defaults to it."""
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
            if e["engine"] != engine:
                problems.append(f"entry {n}: engine {e['engine']!r} in the expectations of engine {engine!r}")
        patterns = e.get("patterns") or ([e["pattern"]] if e.get("pattern") else [])
        missing = [k for k in ("engine", "kind", "reason") if not e.get(k)] + ([] if patterns else ["pattern(s)"])
        if missing or e.get("kind") not in KINDS:
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


def reason_class(why: str, engines: Iterable[str] = ()) -> str:
    """A skip reason without its per-case details: 'no kernel for ai.onnx::Loop' stays, node names go."""
    if "no kernel for" in why:
        return "no kernel for " + why.split("no kernel for ", 1)[1].split(";")[0].split(" (")[0]
    parts = why.split(": ")
    if parts[0] in set(engines):
        parts = parts[1:]
    return parts[0][:100] if parts else why[:100]


def key_from_nodeid(nodeid: str, engine: str) -> str:
    """The key of a test from its node id (for reports written before keys were recorded)."""
    name = nodeid.split("::")[-1]
    func, _, params = name.partition("[")
    params = params.rstrip("]")
    if func == "test_node_case":
        return params.split(f"{engine}-", 1)[1] if params.startswith(f"{engine}-") else params
    for form in (f"{engine}-", f"-{engine}"):
        if form in params:
            params = params.replace(form, "", 1)
            break
    return f"{func}[{params}]" if params else func


def emit(engine: str, rows: Iterable[tuple[str, str]], when: dict[str, str] | None = None) -> str:
    """TOML ``unsupported`` entries for ``(key, reason)`` rows, one entry per reason."""
    by_reason: dict[str, list[str]] = {}
    for key, reason in rows:
        by_reason.setdefault(reason, []).append(key)
    lines = []
    for reason, keys in sorted(by_reason.items(), key=lambda kv: (-len(kv[1]), kv[0])):
        lines += ["[[expect]]", f'engine = "{engine}"', 'kind = "unsupported"', f"reason = {_q(reason)}"]
        if when:
            lines.append("when = { " + ", ".join(f"{k} = {_q(v)}" for k, v in when.items()) + " }")
        lines.append("patterns = [")
        lines += [f"  {_q(k)}," for k in sorted(set(keys))]
        lines += ["]", ""]
    return "\n".join(lines)


def _q(text: str) -> str:
    return '"' + text.replace("\\", "\\\\").replace('"', '\\"') + '"'


def rows_from_report(report: dict, engine: str) -> list[tuple[str, str]]:
    """``(key, reason class)`` of every case ``engine`` could not run in a report (written by
    ``--lockstep-report-dir``): skipped as unsupported, or failed as newly unsupported."""
    rows = []
    for nodeid, o in report.get("tests", {}).items():
        if o.get("engine") != engine:
            continue
        key = o.get("key") or key_from_nodeid(nodeid, engine)
        reason = o.get("reason") or ""
        message = o.get("message") or ""
        if o.get("outcome") == "skipped" and reason.startswith("unsupported: "):
            detail = reason[len("unsupported: "):]
        elif o.get("outcome") == "failed" and " newly cannot run " in message:
            detail = message.split(f" newly cannot run {key}: ", 1)[-1]
        else:
            continue
        rows.append((key, reason_class(detail.removeprefix(f"{engine}: "), [engine])))
    return rows


def main(argv: list[str] | None = None) -> int:
    """``python -m lockstep.expectations --from-report reports/report.json --engine ort-cpu
    [--when onnxruntime===1.31.1]``: TOML ``unsupported`` entries for what the engine could not run."""
    import argparse
    import json
    import sys

    ap = argparse.ArgumentParser(prog="python -m lockstep.expectations", description=main.__doc__.splitlines()[0])
    ap.add_argument("--from-report", required=True, help="a report.json written by --lockstep-report-dir")
    ap.add_argument("--engine", action="append", required=True)
    ap.add_argument("--when", action="append", default=[], help="dist<specifier>, e.g. onnxruntime==1.31.* (repeatable)")
    args = ap.parse_args(argv)
    try:
        report = json.loads(Path(args.from_report).read_text())
    except (OSError, ValueError) as exc:
        print(f"error: {args.from_report}: {exc}", file=sys.stderr)
        return 2
    when = {}
    for w in args.when:
        import re

        m = re.match(r"^([A-Za-z0-9_.-]+)\s*([<>=!~].*)$", w)
        if not m:
            print(f"error: --when {w!r}: expected dist<specifier>", file=sys.stderr)
            return 2
        when[m.group(1)] = m.group(2)
    for engine in args.engine:
        print(f"# --- {engine}: cases it cannot run (generated from {args.from_report})")
        print(emit(engine, rows_from_report(report, engine), when or None))
    return 0


if __name__ == "__main__":
    import sys

    sys.exit(main())
