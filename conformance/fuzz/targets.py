"""Running one case in this process, and the class of its outcome.

Classes: ``ok`` (ran), ``named`` (an exception of ``named_classes()``: what lockstep promises a bad model or
input gets), ``crash`` (any other exception: a leaked traceback; or death by a signal, decided by
the runner), ``hang`` (past the per-case timeout, runner), ``memory`` (``MemoryError``, or the
address-space limit hit, runner).

``LaunchFailure`` is never ``named`` here: on the simulated device it is raised only when a
kernel's Python code raised (``backends/sim.py``), which is a bug reported as a device fault: a
``crash``, or ``memory`` when what the kernel raised was a ``MemoryError``.

ONNX Runtime's outcome is data beside each case, with the same classes, except that any Python
exception from its API counts as ``named`` (ORT raises its own classes, and refuses bad feed
types with ``TypeError`` at the binding); only a process death is an ORT ``crash``.
"""

from __future__ import annotations

import importlib
import io
import os
import re
import sys
import traceback
from pathlib import Path
from typing import Any, Callable

from lockstep.errors import LockstepError

from .case import MODEL_FILE, Case

__all__ = ["named_classes", "classify", "run_ref", "run_ort", "run_cli", "CLASSES"]

CLASSES = ("ok", "named", "crash", "hang", "memory")

def named_classes() -> tuple[type, ...]:
    """lockstep's named errors: ``LockstepError`` (a CLI case's refusal, ``CliError``, is one)."""
    return (LockstepError,)


def _roots() -> list[str]:
    """Source folders of lockstep's packages (the fuzzer's own excluded): where a signature's frame is taken."""
    roots = []
    for mod in ("lockstep", "lockstep.reference_runtime", "lockstep.kernels", "lockstep.golden", "lockstep.contracts",
                "lockstep.conformance"):
        try:
            roots.append(str(Path(importlib.import_module(mod).__file__).parent) + os.sep)
        except ImportError:
            pass
    return roots


def _where(frames: list[tuple[str, str]]) -> str:
    """``file:function`` of the innermost lockstep frame, and of the innermost frame when it is elsewhere."""
    roots = _roots()
    fuzz = str(Path(__file__).parent) + os.sep
    ours = [(f, fn) for f, fn in frames if any(f.startswith(r) for r in roots) and not f.startswith(fuzz)]
    parts = []
    if ours:
        f, fn = ours[-1]
        parts.append(f"{_short(f, roots)}:{fn}")
    if frames and (not ours or frames[-1] != ours[-1]):
        f, fn = frames[-1]
        parts.append(f"{_short(f, roots)}:{fn}")
    return " > ".join(parts) or "?"


def _short(path: str, roots: list[str]) -> str:
    for r in sorted(roots, key=len, reverse=True):
        if path.startswith(r):
            return Path(r).name + "/" + path[len(r):]
    return "/".join(Path(path).parts[-2:])


def classify(exc: BaseException | None) -> dict[str, Any]:
    """The class, type, signature and traceback of an exception (``None``: ok)."""
    if exc is None:
        return {"cls": "ok"}
    from lockstep.reference_runtime.errors import LaunchFailure

    frames = [(fs.filename, fs.name) for fs in traceback.extract_tb(exc.__traceback__)]
    tname = type(exc).__name__
    msg = str(exc)
    if isinstance(exc, MemoryError):
        cls = "memory"
    elif isinstance(exc, LaunchFailure):
        inner = re.search(r"failed: (\w+)\(", msg)
        cls = "memory" if inner and inner.group(1) == "MemoryError" else "crash"
        kern = re.search(r"kernel '([^':]+)", msg)
        tname = f"LaunchFailure[{inner.group(1) if inner else '?'}]"
        frames.append((f"kernel {kern.group(1) if kern else '?'}", "compute"))
    elif isinstance(exc, named_classes()):
        cls = "named"
    else:
        cls = "crash"
    tb = "".join(traceback.format_exception(type(exc), exc, exc.__traceback__))
    return {"cls": cls, "type": tname, "message": msg[:500], "where": _where(frames), "traceback": tb[-6000:]}


# -- the targets: each returns ``classify``'s dict; ``stage`` reports progress to the runner ----------------
# The simulated device the fuzzer runs on has 1 GiB (``RuntimeConfig.device_memory_limit``), well
# under the worker's address-space limit (runner.py): a request too big for the device is the
# device's named refusal (``MemoryAllocation``), and ``memory`` is left meaning what it should, the
# host running out outside any device allocation. The CLI cases run with the device's default budget
# instead (``SimDevice.default_memory_limit``, bounded by the worker's RLIMIT_AS), as a user's would.
DEVICE_MEMORY = 1 << 30


def _feeds(case: Case) -> dict[Any, Any]:
    return dict(case.feeds or [])


def run_ref(case: Case, folder: Path, stage: Callable[[str], None]) -> dict[str, Any]:
    """The reference runtime on the simulated device: load the file, prepare, run (or decode)."""
    from lockstep.loading import load_model
    from lockstep.reference_runtime.config import RuntimeConfig
    from lockstep.reference_runtime.engine import RefEngine

    try:
        stage("load")
        model, _ = load_model(folder / MODEL_FILE)
        engine = RefEngine("sim", RuntimeConfig(device_memory_limit=DEVICE_MEMORY))
        if case.decode is not None:
            from lockstep.decoding import open_session

            stage("open")
            session = open_session(engine, model)
            for ids in case.decode["steps"]:
                stage("decode")
                session.forward(ids)
        else:
            stage("prepare")
            run = engine.prepare(model)
            stage("run")
            run(_feeds(case))
    except BaseException as exc:  # noqa: BLE001 - classifying every outcome is the point
        if isinstance(exc, (KeyboardInterrupt, SystemExit)):
            raise
        return classify(exc)
    return classify(None)


def run_ort(case: Case, folder: Path, stage: Callable[[str], None]) -> dict[str, Any]:
    """ONNX Runtime's CPU provider on the same file and feeds (decode: the same steps, cache on the host)."""
    import onnxruntime as ort

    try:
        so = ort.SessionOptions()
        so.intra_op_num_threads = so.inter_op_num_threads = 1
        so.log_severity_level = 4
        stage("load")
        sess = ort.InferenceSession(str(folder / MODEL_FILE), so, providers=["CPUExecutionProvider"])
        if case.decode is not None:
            import onnx

            from lockstep.decoder_io import DecoderIO

            io_ = DecoderIO.of(onnx.load(str(folder / MODEL_FILE), load_external_data=False))
            outs = [o.name for o in sess.get_outputs()]
            cache = io_.empty_caches()
            pos = 0
            for ids in case.decode["steps"]:
                stage("decode")
                res = dict(zip(outs, sess.run(None, {**io_.step_feeds(ids, pos), **cache})))
                cache = {p: res[io_.present_of[p]] for p in io_.pasts}
                pos += len(ids)
        else:
            stage("run")
            sess.run(None, _feeds(case))
    except MemoryError as exc:
        return classify(exc)
    except Exception as exc:  # noqa: BLE001 - see the module docstring
        return {"cls": "named", "type": type(exc).__name__, "message": str(exc)[:300]}
    return {"cls": "ok"}


def run_cli(case: Case, folder: Path, stage: Callable[[str], None]) -> dict[str, Any]:
    """``lockstep.conformance.cli.main(argv)`` in this process, in the case's folder: an exit status (0 ok,
    else named) or an exception escaping the command (a crash: the CLI promises one line)."""
    from lockstep.conformance.cli import main

    argv = [a.replace("{model}", str(folder / MODEL_FILE)).replace("{dir}", str(folder)) for a in case.argv or []]
    os.chdir(folder)
    # No LOCKSTEP_DEVICE_MEMORY_LIMIT here: the CLI runs with the simulated device's default budget,
    # which must respect the worker's RLIMIT_AS (issue 29: a default above it let the host fail first).
    os.environ.pop("LOCKSTEP_DEVICE_MEMORY_LIMIT", None)
    err = io.StringIO()
    old = sys.stderr
    sys.stderr = err
    try:
        stage("cli")
        try:
            rc = main(argv)
        except SystemExit as exc:  # argparse usage errors
            rc = exc.code if isinstance(exc.code, int) else 2
    except BaseException as exc:  # noqa: BLE001
        if isinstance(exc, KeyboardInterrupt):
            raise
        out = classify(exc)
        if out["cls"] == "named":  # a named error escaping the command is still a traceback for its user
            out["cls"] = "crash"
        return out
    finally:
        sys.stderr = old
    lines = [ln for ln in err.getvalue().splitlines() if ln.strip()]
    return {"cls": "ok" if rc == 0 else "named", "rc": rc, "stderr": "\n".join(lines[-3:])[:500]}
