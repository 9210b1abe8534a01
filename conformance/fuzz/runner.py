"""Each case in a process of its own: a segfault, a hang or a memory blow-up ends that process only.

``run_tasks`` forks one worker per (case, target) from a parent that has already imported numpy,
onnx, ONNX Runtime and lockstep (a fork costs milliseconds, an interpreter start a second), keeps
at most ``jobs`` of them running, and in each child:

- limits the address space (``RLIMIT_AS``) to ``mem_bytes`` above the size the process had at the
  fork, or to an existing lower limit (allocations beyond it fail: numpy raises ``MemoryError``,
  C++ throws ``bad_alloc``), and core dumps to nothing;
- sends stdout/stderr to a file and turns ``faulthandler`` on, so a fatal signal leaves the Python
  stack at the fault;
- reports each stage (load, prepare, run...) and then the outcome as JSON lines on a pipe.

The parent kills a worker past ``timeout_s`` (``hang``), and classes a death by signal as ``crash``
(``memory`` where the stderr says an allocation failed, or for a SIGKILL it did not send: the
kernel's OOM killer).
"""

from __future__ import annotations

import faulthandler
import json
import os
import re
import resource
import select
import shutil
import signal
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from .case import Case

__all__ = ["Task", "run_tasks", "preload", "vm_size"]

Target = Callable[[Case, Path, Callable[[str], None]], dict]
_FAULT_LOG = None  # a worker's log file, open for faulthandler


@dataclass
class Task:
    key: Any            # the caller's handle, e.g. (index, "ref")
    case: "Case | Callable[[], Case]"   # or a function making it, called in the worker (keeps the parent small)
    target: Target


def preload() -> None:
    """Import what the targets use, once, before forking."""
    import numpy  # noqa: F401
    import onnx  # noqa: F401
    import onnx.shape_inference  # noqa: F401

    import lockstep.conformance.cli  # noqa: F401
    import lockstep.decoding  # noqa: F401
    import lockstep.reference_runtime.engine  # noqa: F401
    import lockstep.reference_runtime.executor  # noqa: F401
    from lockstep.conformance.fuzz import targets

    targets.named_classes()
    try:
        import onnxruntime  # noqa: F401
    except ImportError:
        pass


def vm_size() -> int:
    """This process's virtual size in bytes (Linux), 0 where unknown."""
    try:
        m = re.search(r"VmSize:\s+(\d+) kB", Path("/proc/self/status").read_text())
        return int(m.group(1)) * 1024 if m else 0
    except OSError:
        return 0


def _child(task: Task, folder: Path, w: int, mem_bytes: int, log: Path) -> None:
    """In the forked worker: never returns."""
    code = 0
    try:
        fd = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        os.dup2(fd, 1)
        os.dup2(fd, 2)
        global _FAULT_LOG
        _FAULT_LOG = os.fdopen(fd, "w")  # the log itself, whatever sys.stderr is (pytest replaces it)
        faulthandler.enable(file=_FAULT_LOG, all_threads=False)
        resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
        if mem_bytes:
            soft, hard = resource.getrlimit(resource.RLIMIT_AS)
            limit = vm_size() + mem_bytes
            limit = min([limit, *(x for x in (soft, hard) if x != resource.RLIM_INFINITY)])  # never above a ulimit -v
            resource.setrlimit(resource.RLIMIT_AS, (limit, hard))

        def stage(name: str) -> None:
            os.write(w, (json.dumps({"stage": name}) + "\n").encode())

        case = task.case if isinstance(task.case, Case) else task.case()
        stage("case")
        case.write(folder)
        res = dict(task.target(case, folder, stage))
        res["case"] = {"family": case.family, "mutation": case.mutation, "source": case.source, "detail": case.detail}
        data = (json.dumps({"result": res}, default=repr) + "\n").encode()
        while data:
            data = data[os.write(w, data):]
    except BaseException as exc:  # noqa: BLE001 - escaped the target: memory, or the harness's own failure
        res = {"cls": "memory", "type": "MemoryError"} if isinstance(exc, MemoryError) else \
            {"cls": "crash", "type": f"harness:{type(exc).__name__}", "where": "conformance/fuzz"}
        try:
            os.write(w, (json.dumps({"result": {**res, "message": str(exc)[:300]}}) + "\n").encode())
        except BaseException:  # noqa: BLE001
            code = 3
    finally:
        try:
            sys.stdout.flush()
            sys.stderr.flush()
        finally:
            os._exit(code)


_MEMORY_WORDS = ("MemoryError", "bad_alloc", "Cannot allocate memory", "out of memory", "std::length_error")


def _faulthandler_where(text: str) -> str:
    """``file:function`` of the innermost frame in a faulthandler dump, and the innermost lockstep one."""
    frames = re.findall(r'File "([^"]+)", line \d+ in (\S+)', text)
    if not frames:
        return "?"
    inner = frames[0]
    ours = next((f for f in frames if "/fuzz/" not in f[0] and any(p in f[0] for p in
                ("/lockstep/", "/reference_runtime/", "/kernels/", "/golden/", "/contracts/"))), None)
    short = lambda f: "/".join(Path(f[0]).parts[-2:]) + ":" + f[1]  # noqa: E731
    return short(inner) if ours is None or ours == inner else f"{short(ours)} > {short(inner)}"


def _finish(status: int, rusage, lines: list[dict], killed: str | None, log: Path) -> dict[str, Any]:
    stages = [d["stage"] for d in lines if "stage" in d]
    result = next((d["result"] for d in reversed(lines) if "result" in d), None)
    out: dict[str, Any]
    text = ""
    try:  # the whole log (bounded): a deep stack's innermost frame is at the top of faulthandler's dump
        text = log.read_text(errors="replace")[-(1 << 20):]
    except OSError:
        pass
    tail = text[-4000:]
    if killed == "timeout":
        out = {"cls": "hang", "type": "timeout", "where": f"stage {stages[-1] if stages else '?'}"}
    elif result is not None:
        out = dict(result)
    elif os.WIFSIGNALED(status):
        sig = os.WTERMSIG(status)
        name = signal.Signals(sig).name if sig in signal.Signals._value2member_map_ else f"signal {sig}"
        if sig == signal.SIGKILL or any(w in text for w in _MEMORY_WORDS):
            cls = "memory"
        else:
            cls = "crash"
        out = {"cls": cls, "type": name, "where": _faulthandler_where(text), "message": tail[-600:]}
    else:
        out = {"cls": "crash", "type": f"exit {os.WEXITSTATUS(status)}", "where": "no outcome reported",
               "message": tail[-600:]}
    out["stage"] = stages[-1] if stages else None
    out["maxrss_mb"] = round(rusage.ru_maxrss / 1024, 1) if rusage is not None else None
    if out["cls"] != "ok" and tail and "traceback" not in out:
        out["log_tail"] = tail[-3000:]
    return out


def run_tasks(tasks: list[Task], *, jobs: int = 0, timeout_s: float = 30.0, mem_bytes: int = 3 * 2**30,
              on_done: Callable[[Task, dict], None] | None = None) -> list[tuple[Task, dict]]:
    """Run every task in its own forked worker; returns (task, outcome) in completion order."""
    jobs = jobs or os.cpu_count() or 1
    preload()
    sys.stdout.flush()
    sys.stderr.flush()
    root = Path(tempfile.mkdtemp(prefix="lockstep-fuzz-"))
    pending = list(reversed(tasks))
    running: dict[int, tuple[Task, int, float, bytearray, Path, Path]] = {}
    done: list[tuple[Task, dict]] = []
    serial = 0
    try:
        while pending or running:
            while pending and len(running) < jobs:
                task = pending.pop()
                serial += 1
                folder, log = root / f"t{serial}", root / f"t{serial}.log"
                r, w = os.pipe()
                pid = os.fork()
                if pid == 0:
                    os.close(r)
                    _child(task, folder, w, mem_bytes, log)
                os.close(w)
                running[r] = (task, pid, time.monotonic(), bytearray(), folder, log)
            ready, _, _ = select.select(list(running), [], [], 0.05)
            now = time.monotonic()
            for r in list(running):
                task, pid, t0, buf, folder, log = running[r]
                killed = None
                if r in ready:
                    chunk = os.read(r, 1 << 16)
                    if chunk:
                        buf += chunk
                        continue
                elif now - t0 > timeout_s:
                    os.kill(pid, signal.SIGKILL)
                    killed = "timeout"
                else:
                    continue
                _, status, rusage = os.wait4(pid, 0)
                os.close(r)
                del running[r]
                lines = []
                for ln in bytes(buf).splitlines():
                    try:
                        lines.append(json.loads(ln))
                    except ValueError:
                        pass
                out = _finish(status, rusage, lines, killed, log)
                out["seconds"] = round(time.monotonic() - t0, 3)
                shutil.rmtree(folder, ignore_errors=True)
                log.unlink(missing_ok=True)
                done.append((task, out))
                if on_done is not None:
                    on_done(task, out)
    finally:
        for r, (_, pid, *_rest) in running.items():
            try:
                os.kill(pid, signal.SIGKILL)
                os.waitpid(pid, 0)
            except OSError:
                pass
            os.close(r)
        shutil.rmtree(root, ignore_errors=True)
    return done
