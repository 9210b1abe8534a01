"""A fuzz run: cases through the runner, the class tables, crash signatures, reproducers, JSON.

``fuzz(seed, n)`` makes cases ``start .. start+n-1`` of ``seed``, runs each on the reference runtime
(sim device) and, unless ``ort=False``, on ONNX Runtime's CPU provider, each in its own worker;
writes a reproducer folder for every reference crash, hang and memory case into ``repro_dir``; and
returns a ``FuzzRun`` (tables, signatures, ``to_json``).
"""

from __future__ import annotations

import functools
import json
import shlex
import sys
import time
from collections import Counter, defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .case import Case
from .mutations import family_of, make_case, warm
from .runner import Task, run_tasks
from .targets import CLASSES, run_cli, run_ort, run_ref

__all__ = ["FuzzRun", "fuzz", "replay", "BAD"]

BAD = ("crash", "hang", "memory")


def replay_command(folder: Path) -> str:
    return f"{shlex.quote(sys.executable)} -m lockstep fuzz --replay {shlex.quote(str(folder))}"


def signature(mutation: str, out: dict[str, Any]) -> str:
    return f"{out.get('type', '?')} @ {out.get('where', '?')} [{mutation.split('.')[0]}]"


@dataclass
class FuzzRun:
    seed: int
    start: int
    n: int
    jobs: int
    timeout_s: float
    mem_bytes: int
    seconds: float = 0.0
    cases: list[dict[str, Any]] = field(default_factory=list)   # in index order

    # -- tables ------------------------------------------------------------------------------------
    def counts(self, engine: str = "ref") -> Counter:
        return Counter(c[engine]["cls"] for c in self.cases if engine in c)

    def bad(self) -> list[dict[str, Any]]:
        return [c for c in self.cases if c["ref"]["cls"] in BAD]

    def signatures(self) -> dict[str, dict[str, Any]]:
        """Distinct crash/hang/memory signatures: count, mutations, a reproducer."""
        sig: dict[str, dict[str, Any]] = {}
        for c in self.bad():
            s = signature(c["mutation"], c["ref"])
            e = sig.setdefault(s, {"cls": c["ref"]["cls"], "count": 0, "mutations": Counter(), "example": c["index"],
                                   "message": (c["ref"].get("message") or "")[:200], "repro": c.get("repro")})
            e["count"] += 1
            e["mutations"][c["mutation"]] += 1
        return dict(sorted(sig.items(), key=lambda kv: -kv[1]["count"]))

    def table(self, by: str = "family") -> str:
        """Markdown: rows by ``family`` or ``mutation``; reference classes, then ORT's."""
        rows: dict[str, dict[str, Counter]] = defaultdict(lambda: {"ref": Counter(), "ort": Counter()})
        for c in self.cases:
            rows[c[by]]["ref"][c["ref"]["cls"]] += 1
            if "ort" in c:
                rows[c[by]]["ort"][c["ort"]["cls"]] += 1
        head = [by, "cases", *CLASSES, *(f"ort {k}" for k in CLASSES)]
        lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
        total = {"ref": Counter(), "ort": Counter()}
        for key in sorted(rows):
            r = rows[key]
            total["ref"].update(r["ref"])
            total["ort"].update(r["ort"])
            lines.append("| " + " | ".join([key, str(sum(r["ref"].values())), *(str(r["ref"][k]) for k in CLASSES),
                                            *(str(r["ort"][k]) for k in CLASSES)]) + " |")
        lines.append("| " + " | ".join(["**all**", str(sum(total["ref"].values())),
                                        *(str(total["ref"][k]) for k in CLASSES),
                                        *(str(total["ort"][k]) for k in CLASSES)]) + " |")
        return "\n".join(lines)

    def host_errors(self) -> list[dict[str, Any]]:
        """Named outcomes that are a kernel's own exception (``KernelHostError``): named, but the
        wrong name, since an input error should be a load-time or shape check's ``OpError``."""
        return [c for c in self.cases if c["ref"]["cls"] == "named" and c["ref"].get("type") == "KernelHostError"]

    def summary(self) -> str:
        ref, ort = self.counts("ref"), self.counts("ort")
        rate = len(self.cases) / self.seconds if self.seconds else 0.0
        host = len(self.host_errors())
        return (f"fuzz: seed {self.seed}, cases {self.start}..{self.start + self.n - 1}: "
                + ", ".join(f"{ref[k]} {k}" + (f" ({host} of them KernelHostError)" if k == "named" else "")
                            for k in CLASSES)
                + ("; ONNX Runtime: " + ", ".join(f"{ort[k]} {k}" for k in CLASSES) if ort else "")
                + f"; {self.seconds:.1f} s, {rate:.1f} cases/s on {self.jobs} worker(s)")

    def signature_lines(self) -> list[str]:
        out = []
        for s, e in self.signatures().items():
            muts = ", ".join(f"{m} x{k}" for m, k in e["mutations"].most_common(4))
            out.append(f"- {e['cls']} x{e['count']}: {s} ({muts}); replay: "
                       + (replay_command(Path(e["repro"])) if e["repro"] else f"case {e['example']}"))
        return out

    def to_json(self) -> dict[str, Any]:
        return {"seed": self.seed, "start": self.start, "n": self.n, "jobs": self.jobs, "timeout_s": self.timeout_s,
                "mem_bytes": self.mem_bytes, "seconds": round(self.seconds, 2),
                "cases_per_s": round(len(self.cases) / self.seconds, 2) if self.seconds else None,
                "classes": dict(self.counts("ref")), "ort_classes": dict(self.counts("ort")),
                "kernel_host_errors": [{"index": c["index"], "mutation": c["mutation"],
                                        "message": c["ref"].get("message", "")[:200]} for c in self.host_errors()],
                "signatures": {s: {**e, "mutations": dict(e["mutations"])} for s, e in self.signatures().items()},
                "cases": self.cases}


def _targets(family: str, ort: bool) -> list[tuple[str, Any]]:
    if family == "cli":
        return [("ref", run_cli)]
    return [("ref", run_ref)] + ([("ort", run_ort)] if ort else [])


def write_repro(case: Case, outcome: dict[str, Any], repro_dir: Path) -> Path:
    folder = repro_dir / f"{outcome['cls']}-{case.name}"
    case.write(folder)
    meta = json.loads((folder / "case.json").read_text())
    meta["outcome"] = outcome
    meta["command"] = replay_command(folder)
    (folder / "case.json").write_text(json.dumps(meta, indent=1, default=repr) + "\n")
    return folder


def fuzz(seed: int, n: int, *, start: int = 0, jobs: int = 0, timeout_s: float = 30.0, mem_bytes: int = 3 * 2**30,
         ort: bool = True, repro_dir: str | Path | None = None, progress: Any = None) -> FuzzRun:
    """Run cases ``start .. start+n-1`` of ``seed``; see the module docstring."""
    import os

    jobs = jobs or os.cpu_count() or 1
    warm()
    # the worker makes its case from (seed, index): the parent holds no model bytes; a reproducer
    # is made again here, from the same pair
    tasks = [Task((i, eng), functools.partial(make_case, seed, i), fn)
             for i in range(start, start + n) for eng, fn in _targets(family_of(seed, i), ort)]
    run = FuzzRun(seed, start, n, jobs, timeout_s, mem_bytes)
    repro = Path(repro_dir) if repro_dir is not None else None
    records: dict[int, dict[str, Any]] = {i: {"index": i} for i in range(start, start + n)}

    def done(task: Task, out: dict[str, Any]) -> None:
        index, eng = task.key
        rec = records[index]
        rec.update(out.pop("case", None) or {})
        if eng == "ref" and out["cls"] in BAD and repro is not None:
            rec["repro"] = str(write_repro(make_case(seed, index), out, repro))
        if eng == "ref" and out["cls"] in ("ok", "named"):
            out.pop("traceback", None)  # kept only where it is a finding
        rec[eng] = out
        if progress is not None:
            progress(index, eng, out)

    t0 = time.monotonic()
    run_tasks(tasks, jobs=jobs, timeout_s=timeout_s, mem_bytes=mem_bytes, on_done=done)
    run.seconds = time.monotonic() - t0
    for i, rec in records.items():  # a worker that died before reporting its case: named from (seed, index)
        if "mutation" not in rec:
            c = make_case(seed, i)
            rec.update({"family": c.family, "mutation": c.mutation, "source": c.source, "detail": c.detail})
    run.cases = [records[i] for i in sorted(records)]
    return run


def replay(folder: str | Path, *, timeout_s: float = 60.0, mem_bytes: int = 3 * 2**30, ort: bool = True) -> dict[str, Any]:
    """Run a reproducer folder again (isolated, the same limits); returns {engine: outcome}."""
    case = Case.read(folder)
    tasks = [Task(eng, case, fn) for eng, fn in _targets(case.family, ort)]
    return {t.key: out for t, out in run_tasks(tasks, jobs=len(tasks), timeout_s=timeout_s, mem_bytes=mem_bytes)}
