"""Wall and CPU time of the three commands a user waits for, against their targets (issue 28).

    python scripts/bench_suite.py [--only check,conformance,all] [--repeats 3] [--cold]
        [--baseline-tree ../old --baseline-python ../old/.venv/bin/python]

The commands are each checkout's own README ones (read from its first ``bash`` block: the main
job after the install's ``&&``, then the line that runs all tests, after its install's ``&&`` where it
has one), so a baseline checkout from before a change runs what its README said then:

- ``check``: ``lockstep check`` on the default engines, from an empty folder, report in it;
- ``conformance``: the README's first command without its install (``pytest ... conformance/``);
- ``all``: the README's second command (``pytest ...``), what ``.ci/run`` runs.

Each run starts the command in a new process group from the checkout (``check``: from a new
empty folder) with that checkout's interpreter first on PATH, and records its wall time, the CPU
time of it and its children (user + system), its exit status and pytest's summary line. Runs
alternate between this checkout and the baseline (ABAB...), so a ratio compares runs made under
the same conditions; the table shows medians and, with a baseline, each round's ratio and their
median. Memory: the peak of the command's process tree (its session: pytest, its xdist workers, the
processes they start), the sum of their resident sets sampled every 0.5 s, and the largest single
process's peak in that sampling. Conditions printed first: machine, cores, load average, commit, library versions, and the
cache state:

- warm (default): lockstep's cache as it is (node cases, built models, oracle results);
- ``--cold``: each run gets an empty ``LOCKSTEP_CACHE_DIR`` holding only a link to the built
  trained models (``models/``: SmolLM2's conversion needs its GGUF, a download), so node cases
  and oracle results are recomputed, as on a new machine that has the models.

Targets (2-core machine): check <= 120 s, conformance <= 240 s, all <= 600 s. Results go in
docs/benchmarks.md with the conditions.
"""

from __future__ import annotations

import argparse
import os
import platform
import re
import resource
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
TARGETS = {"check": 120.0, "conformance": 240.0, "all": 600.0}


def readme_commands(tree: Path) -> dict[str, list[str]]:
    """The checkout's README commands: its first ``bash`` block's two first lines."""
    try:
        text = (tree / "README.md").read_text()
    except OSError as exc:
        raise ValueError(f"{tree}: no README.md ({exc.strerror})") from None
    block = re.search(r"```bash\n(.*?)```", text, re.S)
    if not block:
        raise ValueError(f"{tree}/README.md: no ```bash block")
    lines = [ln.strip() for ln in block.group(1).splitlines() if ln.strip() and not ln.strip().startswith("#")]
    if len(lines) < 2 or "&&" not in lines[0]:
        raise ValueError(f"{tree}/README.md: its first bash block is not `install && main job` then `all tests`")
    # the second line may install first too (`pip install -e '.[dev,...]' && pytest -n auto`): its test command
    return {"check": ["lockstep", "check"], "conformance": shlex.split(lines[0].split("&&", 1)[1]),
            "all": shlex.split(lines[1].split("&&")[-1])}


def _cpu_children() -> float:
    r = resource.getrusage(resource.RUSAGE_CHILDREN)
    return r.ru_utime + r.ru_stime


def _summary(out: str) -> str:
    lines = [ln.strip("= ").strip() for ln in out.splitlines() if re.search(r"\d+ (passed|failed|error)", ln)]
    return lines[-1] if lines else "(no pytest summary)"


def _session_rss(sid: int) -> tuple[int, int]:
    """(sum, largest) resident set in bytes of the processes of session ``sid`` (Linux /proc)."""
    page, total, largest = os.sysconf("SC_PAGE_SIZE"), 0, 0
    for d in Path("/proc").iterdir():
        if not d.name.isdigit():
            continue
        try:
            stat = (d / "stat").read_text()
            if int(stat.rsplit(")", 1)[1].split()[3]) != sid:  # fields after the name: state ppid pgrp session
                continue
            rss = int((d / "statm").read_text().split()[1]) * page
        except (OSError, ValueError, IndexError):
            continue
        total, largest = total + rss, max(largest, rss)
    return total, largest


def _run_sampled(command, cwd, env) -> tuple[subprocess.CompletedProcess, int, int]:
    """The command run to its end in a new session, with the peak (sum, largest) resident set of it."""
    with tempfile.TemporaryFile("w+") as out:
        proc = subprocess.Popen(command, cwd=cwd, env=env, stdout=out, stderr=subprocess.STDOUT, text=True,
                                start_new_session=True)
        peak_sum = peak_one = 0
        while proc.poll() is None:
            total, one = _session_rss(proc.pid)
            peak_sum, peak_one = max(peak_sum, total), max(peak_one, one)
            time.sleep(0.5)
        out.seek(0)
        return subprocess.CompletedProcess(command, proc.returncode, out.read(), ""), peak_sum, peak_one


def run_once(tree: Path, python: Path, which: str, command: list[str], cold_models: Path | None) -> dict:
    env = dict(os.environ)
    env["PATH"] = f"{python.parent}{os.pathsep}{env.get('PATH', '')}"
    env.pop("PYTHONPATH", None)
    with tempfile.TemporaryDirectory(prefix="bench-suite-") as tmp:
        cwd = tree
        if which == "check":
            cwd = Path(tmp) / "work"
            cwd.mkdir()
            command = [*command, "--report-dir", str(cwd / "reports")]
        if cold_models is not None:
            cache = Path(tmp) / "cache"
            cache.mkdir()
            if cold_models.is_dir():
                (cache / "models").symlink_to(cold_models)
            env["LOCKSTEP_CACHE_DIR"] = str(cache)
        load = os.getloadavg()[0]
        cpu0, t0 = _cpu_children(), time.perf_counter()
        proc, peak_sum, peak_one = _run_sampled(command, cwd, env)
        wall, cpu = time.perf_counter() - t0, _cpu_children() - cpu0
    return {"wall": wall, "cpu": cpu, "rc": proc.returncode, "load": load, "rss": peak_sum, "rss_one": peak_one,
            "summary": _summary(proc.stdout + proc.stderr), "tail": (proc.stdout + proc.stderr)[-3000:]}


def _git(tree: Path, *args: str) -> str:
    out = subprocess.run(["git", "-C", str(tree), *args], capture_output=True, text=True)
    return out.stdout.strip() or "?"


def _versions(python: Path) -> str:
    code = ("import importlib\nfor n in ('numpy','onnx','ml_dtypes','onnxruntime','pytest','xdist'):\n"
            "    try: print(n, importlib.import_module(n).__version__)\n    except Exception as e: print(n, 'absent')")
    out = subprocess.run([str(python), "-c", code], capture_output=True, text=True)
    return ", ".join(ln.replace(" ", " ") for ln in out.stdout.splitlines())


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "?"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--only", default="check,conformance,all", help="comma-separated: check, conformance, all")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--cold", action="store_true", help="empty lockstep cache per run (built models linked in)")
    ap.add_argument("--tree", type=Path, default=ROOT, help="the checkout to time (default: this script's)")
    ap.add_argument("--python", type=Path, default=Path(sys.executable), help="its interpreter (default: this one)")
    ap.add_argument("--baseline-tree", type=Path)
    ap.add_argument("--baseline-python", type=Path)
    args = ap.parse_args(argv)
    which = [w for w in args.only.split(",") if w]
    if not which or any(w not in TARGETS for w in which):
        ap.error(f"--only: one or more of {list(TARGETS)}")
    if args.repeats < 1:
        ap.error("--repeats must be >= 1")
    trees = [("this", args.tree.resolve(), args.python)]
    if args.baseline_tree:
        if not args.baseline_python:
            ap.error("--baseline-tree needs --baseline-python (that checkout's editable install)")
        trees.append(("baseline", args.baseline_tree.resolve(), args.baseline_python))
    models = None
    if args.cold:
        import platformdirs

        models = Path(os.environ.get("LOCKSTEP_CACHE_DIR") or platformdirs.user_cache_dir("lockstep")) / "models"
    print(f"# machine: {platform.node()} {platform.machine()}, {os.cpu_count()} cores ({_cpu_model()}), "
          f"load average {os.getloadavg()[0]:.2f} at start; {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}")
    print(f"# cache: {'cold (empty LOCKSTEP_CACHE_DIR per run, built models linked)' if args.cold else 'warm'}")
    try:
        commands = {label: readme_commands(tree) for label, tree, _ in trees}
    except ValueError as exc:
        ap.error(str(exc))
    for label, tree, python in trees:
        cmds = commands[label]
        print(f"# {label}: {tree} at {_git(tree, 'rev-parse', '--short', 'HEAD')}"
              f"{' (+ uncommitted changes)' if _git(tree, 'status', '--porcelain') not in ('', '?') else ''}; "
              f"{_versions(python)}")
        for w in which:
            print(f"#   {w}: {' '.join(cmds[w])}")
    rows = {}
    for w in which:
        runs: dict[str, list[dict]] = {label: [] for label, _, _ in trees}
        for r in range(args.repeats):
            order = trees if r % 2 == 0 else trees[::-1]
            for label, tree, python in order:
                res = run_once(tree, python, w, commands[label][w], models)
                runs[label].append(res)
                print(f"{w} round {r + 1} {label}: {res['wall']:.1f} s wall, {res['cpu']:.1f} s CPU, peak RSS "
                      f"{res['rss'] / 2**30:.2f} GiB (largest process {res['rss_one'] / 2**30:.2f}), rc {res['rc']}, "
                      f"load {res['load']:.2f}: {res['summary']}", flush=True)
                if res["rc"] != 0:
                    print(res["tail"])
        rows[w] = runs
    print()
    head = ("| command | target | median wall s | median CPU s | peak RSS GiB (largest process) | runs (wall s) "
            "| exit codes | met |")
    if len(trees) > 1:
        head = head[:-1] + "baseline median wall s | ratios (this / baseline) | median ratio |"
    print(head)
    print("|" + "---|" * (head.count("|") - 1))
    for w, runs in rows.items():
        mine = runs["this"]
        med = statistics.median(r["wall"] for r in mine)
        walls = ", ".join(f"{r['wall']:.0f}" for r in mine)
        codes = ", ".join(str(r["rc"]) for r in mine)
        met = "yes" if med <= TARGETS[w] and all(r["rc"] == 0 for r in mine) else "NO"
        rss = f"{max(r['rss'] for r in mine) / 2**30:.2f} ({max(r['rss_one'] for r in mine) / 2**30:.2f})"
        line = (f"| {w} | <= {TARGETS[w]:.0f} s | {med:.1f} | {statistics.median(r['cpu'] for r in mine):.1f} | {rss} | "
                f"{walls} | {codes} | {met} |")
        if len(trees) > 1:
            base = runs["baseline"]
            ratios = [a["wall"] / b["wall"] for a, b in zip(mine, base)]
            line += (f" {statistics.median(r['wall'] for r in base):.1f} | {', '.join(f'{x:.2f}' for x in ratios)} | "
                     f"{statistics.median(ratios):.2f} |")
        print(line)
    return 0 if all(all(r["rc"] == 0 for r in runs["this"]) for runs in rows.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
