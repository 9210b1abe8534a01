"""ONNX's backend node cases (``onnx.backend.test.loader``), cached, and run against an engine.

onnx builds its 1,884 node cases in memory (about 5-10 s), expected outputs computed with the
installed numpy and ml_dtypes; ``load_cases`` keeps them in a pickle keyed by the versions of all
three (``CASE_PACKAGES``) in lockstep's cache (``$LOCKSTEP_CACHE_DIR``, default the user cache
directory) so pytest-xdist workers do not each pay that. ``run_case`` compares outputs the way
ONNX's own runner does (``Runner.assert_similar_outputs``: shapes, dtypes, rtol/atol per case;
sequences element by element, an empty optional as None: ``assert_similar``). Cases with sequence
or optional inputs/outputs go only to an engine that declares it takes them (``values``); to any
other engine they are ``unsupported``.

As a command, for working on kernels: ``lockstep cases --engine ref-sim --match 'test_add*'`` prints each case's outcome and a summary.
"""

from __future__ import annotations

import fnmatch
import pickle
import re
import sys
import warnings
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import onnx
import onnx.numpy_helper

from lockstep.engines.protocol import Unsupported, capabilities

from lockstep.loading import ModelError

__all__ = ["NodeCase", "load_cases", "load_case_dirs", "run_case", "outcome_of_error", "Outcome", "assert_similar", "CaseDirError"]


@dataclass(frozen=True)
class NodeCase:
    name: str
    model: bytes
    inputs: list[np.ndarray]
    outputs: list[np.ndarray]
    rtol: float
    atol: float

    def proto(self) -> onnx.ModelProto:
        return onnx.load_from_string(self.model)


@dataclass(frozen=True)
class Outcome:
    status: str  # passed | failed | unsupported | error
    detail: str = ""


# The packages whose versions change the cases onnx generates: its case generator (onnx), the
# small-type conversions it computes expected outputs with (ml_dtypes' astype: 0.7 changed
# float -> int4/int2 out of range), and numpy's own arithmetic and pickles.
CASE_PACKAGES = ("onnx", "ml_dtypes", "numpy")


def case_versions() -> dict[str, str]:
    """The installed version of each package in ``CASE_PACKAGES`` (the modules' own)."""
    import importlib

    return {name: importlib.import_module(name).__version__ for name in CASE_PACKAGES}


def _cache_path() -> Path:
    """The cache file of the installed versions: a cache generated under other versions is never read."""
    from lockstep.paths import cache_dir

    key = "-".join(f"{k}-{v}" for k, v in case_versions().items())
    return cache_dir() / f"node-cases-{key}.pkl"


def _build() -> list[NodeCase]:
    from onnx.backend.test import loader

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        raw = loader.load_model_tests(kind="node")
    cases = []
    for c in raw:
        if c.model is None or not c.data_sets:
            continue
        ins, outs = c.data_sets[0]
        cases.append(NodeCase(c.name, c.model.SerializeToString(), list(ins), list(outs), c.rtol, c.atol))
    return cases


_LOADED: list[NodeCase] = []


def load_cases() -> list[NodeCase]:
    """Every case: once per process (onnx's loader registers its cases globally and refuses a second
    build in one process), from the on-disk cache when it is there."""
    if not _LOADED:
        _LOADED.extend(_load_cases())
    return _LOADED


def _load_cases() -> list[NodeCase]:
    path = _cache_path()
    if path.is_file():
        try:
            with open(path, "rb") as f:
                return pickle.load(f)
        except Exception:
            pass  # a corrupt or foreign cache is rebuilt, never trusted
    cases = _build()
    path.parent.mkdir(parents=True, exist_ok=True)
    from lockstep.paths import atomic_write

    # atomic: concurrent workers never read half a file
    atomic_write(path, lambda f: pickle.dump(cases, f, protocol=pickle.HIGHEST_PROTOCOL))
    return cases


class CaseDirError(ModelError):
    """A node-case folder that cannot be read (no model.onnx, no test_data_set_*, a file that is not a
    TensorProto, a data.json without numbers); the message names the file."""


def _read_tensors(data: Path, prefix: str) -> list[np.ndarray]:
    files = sorted(data.glob(f"{prefix}_*.pb"), key=lambda p: (len(p.stem), p.stem))
    out = []
    for f in files:
        t = onnx.TensorProto()
        try:
            t.ParseFromString(f.read_bytes())
            out.append(onnx.numpy_helper.to_array(t))
        except Exception as exc:
            raise CaseDirError(f"{f}: not a TensorProto ({type(exc).__name__}: {exc})") from None
    return out


def load_case_dirs(root: str | Path) -> list[NodeCase]:
    """The ONNX backend cases in a folder (a user's own, or ``lockstep locate --reduce``'s): every folder
    under ``root`` (``root`` itself included) holding ``model.onnx`` and ``test_data_set_<k>/input_<i>.pb``,
    ``output_<i>.pb``, one case per data set, named by the folder's path under ``root`` (and
    ``/test_data_set_<k>`` beyond the first); tolerances from its ``data.json`` (``rtol``, ``atol``) as
    onnx's loader reads them, else onnx's defaults (1e-3, 1e-7)."""
    import json

    root = Path(root)
    if not root.is_dir():
        raise CaseDirError(f"--cases-dir {root}: not a folder")
    cases = []
    for model in sorted(root.rglob("model.onnx")):
        d = model.parent
        rtol, atol = 1e-3, 1e-7
        if (d / "data.json").is_file():
            try:
                meta = json.loads((d / "data.json").read_text())
                rtol, atol = float(meta.get("rtol", rtol)), float(meta.get("atol", atol))
            except (ValueError, TypeError, AttributeError) as exc:
                raise CaseDirError(f"{d / 'data.json'}: not JSON with numeric rtol/atol ({exc})") from None
        sets = sorted(d.glob("test_data_set_*"), key=lambda p: (len(p.name), p.name))
        if not sets:
            raise CaseDirError(f"{d}: model.onnx without a test_data_set_0 folder")
        name = d.relative_to(root).as_posix() if d != root else d.name
        for k, data in enumerate(sets):
            cases.append(NodeCase(name if k == 0 else f"{name}/{data.name}", model.read_bytes(),
                                  _read_tensors(data, "input"), _read_tensors(data, "output"), rtol, atol))
    if not cases:
        raise CaseDirError(f"--cases-dir {root}: no node case in it (a folder with model.onnx and test_data_set_0/)")
    return cases


def locate_command(case_name: str, engine: str, cases_dir: str | Path | None = None) -> str:
    """The command that locates a failing case's first divergent node."""
    import shlex

    if cases_dir is None:
        where = case_name
    else:  # the case's folder: under the root, or the root itself (named by its own folder name)
        root, rel = Path(cases_dir), case_name.split("/test_data_set_")[0]
        where = str(root if rel == root.name and (root / "model.onnx").is_file() else root / rel)
    return f"lockstep locate {shlex.quote(where)} --engine {shlex.quote(engine)}"


def _feeds(model: onnx.ModelProto, inputs: list[np.ndarray]) -> dict[str, np.ndarray]:
    init = {t.name for t in model.graph.initializer}
    names = [vi.name for vi in model.graph.input if vi.name not in init]
    return dict(zip(names, inputs))


def _value(x):
    """A case's input or output as the engine protocol passes it: a tensor as a numpy array (numpy
    scalars are 0-d tensors; TensorProtos hold the exotic dtypes), a sequence as a list of them, an
    empty optional as None (onnx's loader gives an optional as its value, or None)."""
    if isinstance(x, onnx.TensorProto):
        return onnx.numpy_helper.to_array(x)
    if isinstance(x, (np.ndarray, np.generic)):
        return np.asarray(x)
    if isinstance(x, (list, tuple)):
        return [_value(v) for v in x]
    if x is None:
        return None
    raise TypeError(f"unexpected node-case value of type {type(x).__name__}")


def _kinds(values) -> set[str]:
    """The non-tensor kinds among the values: "sequence", "optional" (an empty one)."""
    return {"sequence" if isinstance(v, list) else "optional" for v in values if not isinstance(v, np.ndarray)}


# numpy's own bool, integer and float dtypes: the ones ``_surely_similar`` decides on
_PLAIN = frozenset(np.dtype(t) for t in (np.bool_, np.int8, np.int16, np.int32, np.int64, np.uint8, np.uint16,
                                         np.uint32, np.uint64, np.float16, np.float32, np.float64))


def _surely_similar(ref, out, rtol: float, atol: float) -> bool:
    """True only when ONNX's runner would pass ``out`` against ``ref``: both numpy arrays of one
    shape and one plain dtype, and every element ``np.isclose`` with ``equal_nan`` (the test
    ``assert_allclose`` makes; NaN and infinities then sit at the same places too). Anything else,
    a failure included, goes to the runner itself, which decides and words the message. Its numpy
    testing machinery costs about 0.5 ms a case; this check, about a tenth of that."""
    if type(ref) is not np.ndarray or type(out) is not np.ndarray:
        return False
    if ref.shape != out.shape or ref.dtype != out.dtype or ref.dtype not in _PLAIN:
        return False
    try:
        with np.errstate(all="ignore"):
            return bool(np.isclose(out, ref, rtol=rtol, atol=atol, equal_nan=True).all())
    except Exception:  # noqa: BLE001 - the runner decides
        return False


def assert_similar(expected: list, outputs: list, rtol: float, atol: float) -> None:
    """ONNX's runner's comparison (``Runner.assert_similar_outputs``) per output, with sequences
    compared element by element after their lengths, and an empty optional equal only to None."""
    from onnx.backend.test.runner import Runner

    if len(outputs) != len(expected):
        raise AssertionError(f"{len(outputs)} outputs, {len(expected)} expected")
    for i, (ref, out) in enumerate(zip(expected, outputs)):
        if ref is None or out is None:
            if ref is not out:
                raise AssertionError(f"output {i}: {'an empty optional' if ref is None else 'a value'} expected, "
                                     f"got {'None' if out is None else type(out).__name__}")
        elif isinstance(ref, list):
            if not isinstance(out, (list, tuple)):
                raise AssertionError(f"output {i}: a sequence expected, got {type(out).__name__}")
            if len(out) != len(ref):
                raise AssertionError(f"output {i}: a sequence of {len(out)} tensors, {len(ref)} expected")
            for j, (r, o) in enumerate(zip(ref, out)):
                try:
                    assert_similar([r], [o], rtol, atol)
                except AssertionError as exc:
                    raise AssertionError(f"output {i}, element {j}: {exc}") from None
        elif isinstance(out, (list, tuple)):
            raise AssertionError(f"output {i}: a tensor expected, got a sequence")
        elif not _surely_similar(ref, out, rtol, atol):
            Runner.assert_similar_outputs([ref], [np.asarray(out)], rtol, atol)


def outcome_of_error(exc: BaseException) -> "Outcome":
    """The outcome of an engine that raised running a case: ``Unsupported`` is unsupported, anything
    else an error (a ``ModelError`` named so, the rest by class and its first 500 characters)."""
    if isinstance(exc, Unsupported):
        return Outcome("unsupported", str(exc))
    if isinstance(exc, ModelError):
        return Outcome("error", f"ModelError: {exc}")
    return Outcome("error", f"{type(exc).__name__}: {str(exc)[:500]}")


def run_case(engine, case: NodeCase) -> Outcome:
    ins, outs = [_value(x) for x in case.inputs], [_value(x) for x in case.outputs]
    kinds = _kinds([*ins, *outs]) - capabilities(engine).values
    if kinds:  # the engine declares which non-tensor values it takes (protocol: ``values``)
        return Outcome("unsupported", f"{engine.name} takes no {' or '.join(sorted(kinds))} values")
    case = NodeCase(case.name, case.model, ins, outs, case.rtol, case.atol)
    model = case.proto()
    try:
        run = engine.prepare(model)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            outs = run(_feeds(model, case.inputs))
    except Exception as exc:  # noqa: BLE001 - every engine error is an outcome
        return outcome_of_error(exc)
    try:
        assert_similar(case.outputs, list(outs), case.rtol, case.atol)
    except AssertionError as exc:
        return Outcome("failed", str(exc).strip()[:800])
    except Exception as exc:
        return Outcome("failed", f"{type(exc).__name__}: {str(exc)[:500]}")
    return Outcome("passed")


def main(argv: list[str] | None = None) -> int:
    from lockstep.engines.registry import EngineLoadError, load_engine

    from lockstep.errors import command_parser

    ap = command_parser("lockstep cases", description="Run ONNX's backend node cases on an engine: each case's "
                        "outcome and a summary, or --emit-expectations entries for what it fails. Exit 1 when a "
                        "case fails or raises (0 with --emit-expectations), 2 on a usage error.")
    ap.add_argument("--engine", default="ref-sim")
    ap.add_argument("--match", action="append", help="fnmatch pattern on case names (repeatable)")
    ap.add_argument("--show", default="failed,error", help="statuses to print in detail")
    ap.add_argument("--cases-dir", action="append", default=[],
                    help="a folder of node cases (model.onnx, test_data_set_0/) to run instead of ONNX's (repeatable): "
                         "a user's own, or those `lockstep locate --reduce` writes")
    ap.add_argument("--emit-expectations", action="store_true",
                    help="print TOML [[expect]] entries (strict xfail) for every failed or erroring case, for the "
                         "engine's own expectations file (and the variants sharing it)")
    ap.add_argument("--engine-field", action="store_true",
                    help="with --emit-expectations: write engine = NAME into each entry (a file several engines "
                         "share, like lockstep's own)")
    args = ap.parse_args(argv)
    try:
        engine = load_engine(args.engine)
    except EngineLoadError as exc:
        print(f"{ap.prog}: error: {exc}", file=sys.stderr)
        return 2
    ok, why = engine.available()
    if not ok:
        print(f"{ap.prog}: error: engine {engine.name} is unavailable here: {why}", file=sys.stderr)
        return 2
    counts: dict[str, int] = {}
    show = set(args.show.split(","))
    try:
        pool = [(c, d) for d in args.cases_dir for c in load_case_dirs(d)] or [(c, None) for c in load_cases()]
    except CaseDirError as exc:
        print(f"{ap.prog}: error: {exc}", file=sys.stderr)
        return 2
    cases = [(c, d) for c, d in pool if not args.match or any(fnmatch.fnmatch(c.name, p) for p in args.match)]
    if not cases:
        print(f"{ap.prog}: error: --match {args.match}: no node case matches ({len(pool)} cases)", file=sys.stderr)
        return 2
    for case, where in cases:
        out = run_case(engine, case)
        counts[out.status] = counts.get(out.status, 0) + 1
        if args.emit_expectations:
            if out.status in ("failed", "error"):
                first = (out.detail.strip().splitlines() or [""])[0].replace('"', "'")[:200]
                version = _engine_version(engine)
                field = f'engine = "{engine.name}"\n' if args.engine_field else ""
                print(f'[[expect]]\n{field}pattern = "{case.name}"\nkind = "xfail"\n'
                      f'reason = "{version}: {out.status}: {first}"\n')
            continue
        if out.status in show:
            print(f"{out.status:11} {case.name}: {out.detail.splitlines()[0] if out.detail else ''}")
            if out.status == "failed":
                print(f"{'':11} locate it: {locate_command(case.name, args.engine, where)}")
    summary = " ".join(f"{k}={v}" for k, v in sorted(counts.items()))
    print(f"# {summary}" if args.emit_expectations else summary)
    # a case that failed or raised fails the command (a script or CI step sees it); writing expectations
    # for them is what --emit-expectations is for, so that run succeeds
    return 0 if args.emit_expectations or not (counts.get("failed") or counts.get("error")) else 1


def _engine_version(engine) -> str:
    """What the engine says of its versions (``describe()``), for an expectation's reason."""
    info = capabilities(engine).described()
    versions = [f"{k} {v}" for k, v in info.items() if re.fullmatch(r"\d+(\.\d+)+\S*", str(v))]
    return ", ".join(versions) or engine.name
