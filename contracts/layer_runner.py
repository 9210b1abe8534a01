"""``lockstep mutants --layer ...``: run the source-mutant catalogue and score each layer.

For every distinct set of tests the selected mutants name, a baseline run without any mutant must
pass (a failing baseline would make every kill meaningless). Then each mutant runs in its own
child process (``python -m lockstep.contracts.mutation``) against its tests:

- killed: at least one test failed (or the run failed to collect, or timed out: said so);
- SURVIVED: every test passed; a gap, unless the mutant is recorded ``equivalent`` with its argument;
- STALE: its snippet no longer occurs exactly once (the code changed under it);
- NO TESTS: its selection collected nothing.

The run passes when every non-equivalent mutant is killed and nothing is stale, unexercised or
empty. The score of a layer is killed / (mutants - equivalent). The ``runtime`` layer is the
class-based catalogue of :mod:`lockstep.contracts.mutant_runner`, run the same way as before.
"""

from __future__ import annotations

import io
import json
import os
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from pathlib import Path

from lockstep.errors import LockstepError
from .layers import SOURCE_LAYERS, catalogue
from .mutation import Mutant, StaleMutant, mutated_source, to_json

__all__ = ["find_checkout", "run_layers", "select_mutants", "Outcome"]


class CheckoutNotFound(LockstepError, LookupError):
    pass


def find_checkout(start: Path | None = None) -> Path:
    """The lockstep checkout whose tests the catalogue names (they are not in the wheel)."""
    env = os.environ.get("LOCKSTEP_CHECKOUT")
    candidates = [Path(env)] if env else []
    here = (start or Path.cwd()).resolve()
    candidates += [here, *here.parents]
    src = Path(__file__).resolve().parent.parent  # contracts/ of an editable install
    candidates.append(src)
    for c in candidates:
        if (c / "tests").is_dir() and (c / "conformance").is_dir() and (c / "contracts" / "layers").is_dir():
            return c
    raise CheckoutNotFound("the source-mutant layers run the tests of a lockstep checkout (tests/ is not in "
                           "the wheel): run from a checkout or set LOCKSTEP_CHECKOUT")


def select_mutants(layers: list[str] | None = None, names: list[str] | None = None,
                   ci_only: bool = False) -> list[Mutant]:
    cat = catalogue(SOURCE_LAYERS)
    unknown_layers = [la for la in layers or [] if la not in SOURCE_LAYERS]
    if unknown_layers:
        raise KeyError(f"unknown layer(s) {unknown_layers}; layers: {', '.join(SOURCE_LAYERS)}")
    if names:
        unknown = [n for n in names if n not in cat]
        if unknown:
            raise KeyError(f"unknown mutant(s) {unknown}; e.g. {', '.join(list(cat)[:3])} "
                           "(`lockstep mutants --list`)")
        chosen = [cat[n] for n in names]
    else:
        wanted = set(layers or SOURCE_LAYERS)
        chosen = [m for m in cat.values() if m.layer in wanted]
    if ci_only:
        chosen = [m for m in chosen if m.ci]
    return chosen


@dataclass
class Outcome:
    key: str
    layer: str
    status: str                 # killed | SURVIVED | equivalent | STALE | NO TESTS | ERROR
    breaks: str
    killed_by: list[str] = field(default_factory=list)
    detail: str = ""
    seconds: float = 0.0

    @property
    def ok(self) -> bool:
        return self.status in ("killed", "equivalent")


def _pytest_cmd(args: list[str], device: str, report: Path) -> list[str]:
    from lockstep.reference_runtime.engine import ENGINE_OF_DEVICE

    return ["-q", "-p", "no:cacheprovider", "-o", "addopts=", f"--devices={device}",
            f"--engines={ENGINE_OF_DEVICE[device]}", f"--lockstep-report={report}", *args]


def _env() -> dict[str, str]:
    # the child's options are the runner's own: the outer run's requirements and PYTEST_ADDOPTS (a CI's
    # `-n auto` there made every child a pytest-xdist run, and each mutant read as survived) are not its own
    env = {k: v for k, v in os.environ.items() if not k.startswith("LOCKSTEP_REQUIRE_") and k != "PYTEST_ADDOPTS"}
    env["PYTHONUNBUFFERED"] = "1"
    # bytecode caches stay on: a mutated module never reads or writes one (mutation._Loader), and without
    # them every child compiled pytest's assertion rewrite of lockstep's 138 modules again (3 s each)
    env.pop("PYTHONDONTWRITEBYTECODE", None)
    return env


def _run(cmd: list[str], root: Path, timeout_s: float) -> tuple[int | None, str, float]:
    t0 = time.perf_counter()
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, env=_env(), timeout=timeout_s, cwd=root)
        return proc.returncode, (proc.stdout[-3000:] + proc.stderr[-2000:]), time.perf_counter() - t0
    except subprocess.TimeoutExpired:
        return None, f"timed out after {timeout_s:.0f}s", time.perf_counter() - t0


def _outcomes(report: Path) -> dict:
    return json.loads(report.read_text()) if report.exists() else {}


def _baseline(target: tuple, sample: Mutant, device: str, root: Path, timeout_s: float) -> tuple[bool, str, set]:
    with tempfile.TemporaryDirectory() as tmp:
        report = Path(tmp) / "r.json"
        rc, tail, _ = _run([sys.executable, "-m", "pytest", *_pytest_cmd(sample.pytest_args(), device, report)],
                           root, timeout_s)
        outcomes = _outcomes(report)
    ran = {t for t, o in outcomes.items() if o["outcome"] in ("passed", "failed")}
    failed = sorted(t for t, o in outcomes.items() if o["outcome"] == "failed")
    if rc != 0 or failed or not ran:
        why = ("no test ran" if not ran and rc in (0, 5) else
               f"failing without any mutant: {', '.join(failed[:5]) or f'pytest exit {rc}'}")
        return False, f"{why}\n{tail}", ran
    return True, "", ran


def _baseline_targets(mutants: list[Mutant]) -> dict[tuple, Mutant]:
    """One baseline per (test files, -m, extra options), selecting the union of the mutants' -k
    selections in them (None, a whole-file selection, wins): a mutant's tests are a subset of its
    baseline's, so a passing baseline vouches for each (a selection that collects nothing is the
    mutant run's NO TESTS)."""
    import dataclasses

    groups: dict[tuple, list[Mutant]] = {}
    for m in mutants:
        groups.setdefault((m.tests, m.marks, m.extra), []).append(m)
    out: dict[tuple, Mutant] = {}
    for _key, ms in groups.items():
        selects = sorted({m.select for m in ms}, key=str)
        select = None if None in selects else " or ".join(f"({k})" for k in selects) if len(selects) > 1 else selects[0]
        rep = dataclasses.replace(ms[0], select=select)
        out[rep.target()] = rep
    return out


def _mutant(m: Mutant, device: str, root: Path, timeout_s: float, extra: list[str] = ()) -> Outcome:
    out = Outcome(m.key, m.layer, "", m.breaks)
    try:
        mutated_source(m)
    except StaleMutant as exc:
        out.status, out.detail = "STALE", str(exc)
        return out
    with tempfile.TemporaryDirectory() as tmp:
        report, result, spec = Path(tmp) / "r.json", Path(tmp) / "applied.json", Path(tmp) / "mutant.json"
        spec.write_text(to_json(m))
        cmd = [sys.executable, "-m", "lockstep.contracts.mutation", str(spec), str(result), "--",
               *_pytest_cmd([*m.pytest_args(), *extra], device, report)]
        rc, tail, out.seconds = _run(cmd, root, timeout_s)
        outcomes = _outcomes(report)
        applied = json.loads(result.read_text())["applied"] if result.exists() else None
    failed = sorted(t for t, o in outcomes.items() if o["outcome"] == "failed")
    if rc is None:
        out.status, out.detail = "killed", f"timed out after {timeout_s:.0f}s (a hang is a failure)"
    elif rc == 5:
        out.status, out.detail = "NO TESTS", "its selection collected no test"
    elif failed:
        out.status, out.killed_by = "killed", failed
        out.detail = outcomes[failed[0]].get("message", "")
    elif rc not in (0, None):
        out.status = "killed" if applied is not None else "ERROR"
        out.detail = f"pytest exit {rc} without a failed test (collection or plugin error): " + tail.strip()[-300:]
    else:
        out.status = "SURVIVED"
    if m.equivalent:
        out.status, out.detail = ("equivalent", m.equivalent) if out.status == "SURVIVED" else (
            "ERROR", f"recorded equivalent but {out.status}: {out.detail or ', '.join(out.killed_by)}")
    return out


def _runtime_layer(device: str, jobs: int | None, timeout_s: float, out) -> tuple[int, int, int]:
    """(killed, total, rc) of the class-based Runtime catalogue."""
    from .mutant_runner import run_mutants

    buf, summary = io.StringIO(), {}
    rc = run_mutants(device, None, jobs=jobs, timeout_s=timeout_s, out=buf, summary=summary)
    text = buf.getvalue().strip()
    print("[runtime] " + (text.splitlines()[-1] if text else "no output"), file=out)
    if rc != 0:
        print(text, file=out)
    return summary.get("killed", 0), summary.get("total", 0), rc


def run_layers(layers: list[str] | None = None, names: list[str] | None = None, *, device: str = "sim",
               ci_only: bool = False, jobs: int | None = None, timeout_s: float = 300,
               root: Path | None = None, json_path: Path | None = None, markdown_path: Path | None = None,
               out=sys.stdout,
               mutants: list[Mutant] | None = None) -> int:
    """Run the selected layers (``mutants`` overrides the catalogue: the runner's own tests)."""
    layers = list(layers or SOURCE_LAYERS)
    root = root or find_checkout()
    source_layers = [la for la in layers if la in SOURCE_LAYERS]
    if mutants is None:
        mutants = select_mutants(source_layers, names, ci_only) if (source_layers or names) else []
    elsewhere = [m.key for m in mutants if device not in m.devices]
    if elsewhere:
        print(f"not judged on device {device} (their edits matter on other devices): {', '.join(elsewhere)}",
              file=out)
    mutants = [m for m in mutants if device in m.devices]
    jobs = jobs or max(1, os.cpu_count() or 1)
    t0 = time.perf_counter()
    scores: dict[str, dict] = {}
    rc_all = 0
    if "runtime" in layers and not names and not ci_only:  # the class-based Runtime catalogue
        killed, total, rc = _runtime_layer(device, jobs, timeout_s, out)
        scores["runtime"] = {"killed": killed, "equivalent": 0, "total": total}
        rc_all |= rc

    # baselines: one run per distinct set of test files and options, of every selection the mutants
    # make in them (their -k expressions or'ed: it passes only if each selection passes)
    targets = _baseline_targets(mutants)
    with ThreadPoolExecutor(jobs) as pool:
        base = dict(zip(targets, pool.map(lambda t: _baseline(t, targets[t], device, root, timeout_s), targets)))
    bad = {t: why for t, (ok, why, _) in base.items() if not ok}
    if bad:
        print("baseline FAILS (no mutant applied): fix these before judging any mutant", file=out)
        for t, why in bad.items():
            print(f"  tests {' '.join(targets[t].pytest_args())}: {why.splitlines()[0]}", file=out)
            print("    " + "\n    ".join(why.splitlines()[1:][-15:]), file=out)
        return 1

    # a CI run stops each mutant's tests at the first failure: one kill is the verdict
    first_failure = ["-x"] if ci_only else []
    with ThreadPoolExecutor(jobs) as pool:
        results: list[Outcome] = list(pool.map(lambda m: _mutant(m, device, root, timeout_s, first_failure),
                                               mutants))

    width = max((len(r.key) for r in results), default=10)
    current = None
    for r in results:
        if r.layer != current:
            current = r.layer
            print(f"\n[{current}]", file=out)
        n = len(r.killed_by)
        how = f"{n} test(s): {r.killed_by[0].split('::')[-1]}{' ...' if n > 1 else ''}" if n and r.status == "killed" else r.detail[:160]
        print(f"  {r.key:<{width}}  {r.status:13} {how}", file=out)
        if r.status not in ("killed",):
            print(f"  {'':<{width}}  breaks: {r.breaks}", file=out)
    for r in results:
        s = scores.setdefault(r.layer, {"killed": 0, "equivalent": 0, "total": 0})
        s["total"] += 1
        s["killed"] += r.status == "killed"
        s["equivalent"] += r.status == "equivalent"
    print("\nlayer          killed  equivalent  mutants  score", file=out)
    for layer in sorted(scores, key=lambda la: (SOURCE_LAYERS.index(la) if la in SOURCE_LAYERS else len(SOURCE_LAYERS), la)):
        if layer in scores:
            s = scores[layer]
            denom = s["total"] - s["equivalent"]
            score = f"{s['killed'] / denom:.0%}" if denom else "-"
            print(f"  {layer:<12} {s['killed']:6d}  {s['equivalent']:10d}  {s['total']:7d}  {score:>5}", file=out)
    failing = [r for r in results if not r.ok]
    verdict = not failing and rc_all == 0
    print(f"\n{'PASS' if verdict else 'FAIL'}: {sum(r.status == 'killed' for r in results)} killed, "
          f"{sum(r.status == 'equivalent' for r in results)} equivalent, {len(failing)} not ok "
          f"(device {device}, {jobs} jobs, {time.perf_counter() - t0:.0f} s)", file=out)
    payload = {"device": device, "scores": scores, "mutants": [asdict(r) for r in results]}
    if json_path:
        from lockstep.paths import atomic_write

        atomic_write(Path(json_path), json.dumps(payload, indent=1))
    if markdown_path:
        from lockstep.paths import atomic_write

        atomic_write(Path(markdown_path), markdown(payload))
    return 0 if verdict else 1


def markdown(payload: dict) -> str:
    """The scores and every source mutant's outcome as Markdown tables (for docs and CI summaries)."""
    lines = [f"Device `{payload['device']}`.", "", "| layer | killed | equivalent | mutants | score |",
             "|---|---:|---:|---:|---:|"]
    for layer, s in payload["scores"].items():
        denom = s["total"] - s["equivalent"]
        score = f"{s['killed'] / denom:.0%}" if denom else "-"
        lines.append(f"| {layer} | {s['killed']} | {s['equivalent']} | {s['total']} | {score} |")
    lines += ["", "| mutant | breaks | outcome | killed by |", "|---|---|---|---|"]
    for m in payload["mutants"]:
        by = m["killed_by"]
        first = by[0].split("::")[-1] if by else ""
        how = f"`{first}`" + (f" (+{len(by) - 1})" if len(by) > 1 else "") if by else m["detail"][:120]
        lines.append(f"| `{m['key']}` | {m['breaks']} | {m['status']} | {how.replace('|', '/')} |")
    return "\n".join(lines) + "\n"
