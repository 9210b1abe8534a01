"""``lockstep mutants``: run the contract tests against every mutant runtime.

A mutant is killed when at least one contract test fails against it. The run fails if the real
runtime does not pass every contract test, if any mutant survives, or (on the whole catalogue) if a
contract test is not killed by a mutant of the guarantee it names (its ``contract`` mark, a mutant's
``breaks``): a test that can never fail, or fails only where some other guarantee's mutant breaks its
readback (seed 000's "drain after every call" test), is not a test of its guarantee.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from .mutants import MUTANTS

__all__ = ["run_mutants", "contract_tests_dir"]


def contract_tests_dir() -> Path:
    """The packaged contract tests (``lockstep.contracts.suite.runtime``)."""
    from lockstep.paths import package_path

    return package_path("lockstep.contracts.suite.runtime")


def _run(mutant: str | None, device: str, tests: Path, extra: list[str], timeout_s: float = 600) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        report = Path(tmp) / "report.json"
        cmd = [
            sys.executable, "-m", "pytest", str(tests), "-m", "contract", "-q", "-p", "no:cacheprovider",
            "-o", "addopts=", f"--devices={device}", f"--lockstep-report={report}", *extra,
        ]
        if mutant:
            cmd.append(f"--lockstep-mutant={mutant}")
        # the child selects its device itself: the outer run's requirements and PYTEST_ADDOPTS are not its own
        env = {k: v for k, v in os.environ.items() if not k.startswith("LOCKSTEP_REQUIRE_") and k != "PYTEST_ADDOPTS"}
        env["PYTHONUNBUFFERED"] = "1"
        try:
            proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=timeout_s,
                                  cwd=tests.parents[2])
            returncode, tail = proc.returncode, proc.stdout[-2000:] + proc.stderr[-2000:]
        except subprocess.TimeoutExpired as exc:
            returncode, tail = None, f"timed out after {timeout_s}s\n{exc.stdout!r}"[-2000:]
        if not report.exists():
            raise RuntimeError(f"pytest produced no report for mutant {mutant!r}:\n{tail}")
        outcomes = json.loads(report.read_text())
    return {"outcomes": outcomes, "returncode": returncode, "tail": tail}


def run_mutants(device: str = "sim", names: list[str] | None = None, extra: list[str] | None = None,
                jobs: int | None = None, timeout_s: float = 600, out=sys.stdout,
                summary: dict | None = None, tests: Path | None = None) -> int:
    """Run the contract tests against the named mutants (all by default); 0 when every one is killed
    (and, for the whole catalogue, every contract test is killed by a mutant of the guarantee it
    names). ``summary`` gets the counts; ``tests``: another folder of contract tests (the rule's own
    tests plant one)."""
    tests = tests or contract_tests_dir()
    extra = extra or []
    full = not names  # the every-test-kills-a-mutant rule needs the whole catalogue
    names = names or list(MUTANTS)
    unknown = [n for n in names if n not in MUTANTS]
    if unknown:
        print(f"unknown mutant(s) {unknown}; known: {sorted(MUTANTS)}", file=sys.stderr)
        return 2
    jobs = jobs or max(1, min(len(names) + 1, os.cpu_count() or 1))
    with ThreadPoolExecutor(jobs) as pool:
        futures = {m: pool.submit(_run, m, device, tests, extra, timeout_s) for m in [None, *names]}
        results = {m: f.result() for m, f in futures.items()}

    base = results[None]["outcomes"]
    ran = {t for t, o in base.items() if o["outcome"] != "skipped"}
    broken = sorted(t for t in ran if base[t]["outcome"] != "passed")
    print(f"lockstep mutants on device {device!r}: {len(ran)} contract tests, {len(names)} mutants", file=out)
    if not ran:
        print("no contract test ran (device unavailable?)", file=out)
        return 1
    if broken:
        print("the real runtime FAILS contract tests (fix these first):", file=out)
        for t in broken:
            print(f"  {t}", file=out)
        print(results[None]["tail"], file=out)
        return 1

    kills: dict[str, list[str]] = {t: [] for t in sorted(ran)}
    survivors = []
    width = max(len(n) for n in names)
    for m in names:
        outcomes = results[m]["outcomes"]
        killed_by = sorted(t for t in ran if outcomes.get(t, {}).get("outcome") == "failed")
        for t in killed_by:
            kills[t].append(m)
        status = "killed" if killed_by else "SURVIVED"
        if not killed_by:
            survivors.append(m)
        short = ", ".join(sorted({base[t]["contract"] or t.split("::")[-1] for t in killed_by}))
        print(f"  {m:<{width}}  {status:8}  {len(killed_by):2d} test(s): {short}", file=out)
        doc = (MUTANTS[m].__doc__ or "").strip().splitlines()[0]
        print(f"  {'':<{width}}            {doc}", file=out)
    def own(t: str) -> list[str]:  # the mutants that break the guarantee test t names
        contract = base[t].get("contract") or ""
        return [m for m in names if contract in getattr(MUTANTS[m], "breaks", ())]

    def tag(t: str, ms: list[str]) -> str:
        if not full:
            return "ok" if ms else "-"
        if not own(t):
            return "NO MUTANT"  # a guarantee no mutant breaks: nothing shows this test can fail for it
        return "ok" if set(ms) & set(own(t)) else ("OTHERS ONLY" if ms else "KILLS NONE")

    idle = [t for t, ms in kills.items() if tag(t, ms) != "ok"] if full else []
    print("", file=out)
    for t, ms in kills.items():
        contract = base[t].get("contract") or "?"
        print(f"  {tag(t, ms):11}  {t.split('::')[-1]} [{contract}]  <- {', '.join(ms) or '-'}", file=out)
    print("", file=out)
    verdict = not survivors and not idle
    if summary is not None:
        summary.update(killed=len(names) - len(survivors), total=len(names))
    rule = (f"{len(kills) - len(idle)}/{len(kills)} contract tests killed by a mutant of the guarantee they name"
            if full else "named mutants only: each test's own-guarantee rule is checked on the full catalogue")
    print(f"{'PASS' if verdict else 'FAIL'}: {len(names) - len(survivors)}/{len(names)} mutants killed; {rule}", file=out)
    return 0 if verdict else 1
