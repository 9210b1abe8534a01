"""The installed package, as a user gets it: build the wheel, install it with the example engine
plugin into a fresh virtual environment with no pip cache (what a new machine resolves: the newest
versions the metadata allows), and run lockstep from an empty directory (no source checkout, no
PYTHONPATH). The node suite runs with those newest versions and with the oldest allowed of the
packages that change its cases' expected outputs (onnx, ml_dtypes, numpy). Slow (a virtual
environment and its dependencies, downloaded): marked ``packaging``; CI runs it (``pytest``);
deselect it locally with ``-m "not packaging"``. It needs pip to reach an index (as CI does)."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import tomllib
import zipfile
from pathlib import Path

import pytest
from packaging.version import Version

ROOT = Path(__file__).resolve().parent.parent
EXAMPLE = ROOT / "examples" / "engine-plugin"
# The packages whose versions change the node cases' expected outputs (node_cases.CASE_PACKAGES).
CASE_PACKAGES = ("onnx", "ml_dtypes", "numpy")
PIP = ("-m", "pip", "--no-cache-dir")  # a new machine's pip: nothing from an earlier run's cache

# one pytest-xdist worker runs this module (--dist loadgroup): its module fixtures are built once
pytestmark = [pytest.mark.packaging, pytest.mark.xdist_group("test_packaging")]


def test_every_package_folder_is_listed_in_pyproject():
    cfg = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    listed = set(cfg["packages"])
    mapping = cfg["package-dir"]
    found = set()
    for pkg, folder in mapping.items():
        for init in (ROOT / folder).rglob("__init__.py"):
            rel = init.parent.relative_to(ROOT / folder)
            found.add(".".join([pkg, *rel.parts]))
    assert found == listed, f"contract: pyproject lists every package (missing {found - listed}, extra {listed - found})"


def _run(cmd, cwd, env, timeout=600):
    proc = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)
    return proc.returncode, proc.stdout + proc.stderr


@pytest.fixture(scope="module")
def installed(tmp_path_factory):
    """(bin dir, empty working dir, environment) of a fresh venv holding the wheel and the example."""
    tmp = tmp_path_factory.mktemp("packaging")
    dist = tmp / "dist"
    # built from a private copy of the tree: setuptools builds in the source's build/ folder, which two
    # builds at once (this module's tests on two pytest-xdist workers: pytest 9.2 ignores xdist_group,
    # see docs/benchmarks.md) or a stale one left behind break ('File exists: build/bdist...')
    src = tmp / "src"
    shutil.copytree(ROOT, src, ignore=shutil.ignore_patterns(".git", ".venv", "build", "*.egg-info", "__pycache__",
                                                              ".whl", ".chunks", "reports", ".pytest_cache"))
    rc, out = _run([sys.executable, *PIP, "wheel", "-q", "--no-deps", "-w", str(dist), str(src)], src,
                   dict(os.environ), timeout=900)
    assert rc == 0, f"building the wheel failed:\n{out[-3000:]}"
    (wheel,) = dist.glob("lockstep_conformance-*.whl")
    venv = tmp / "venv"
    rc, out = _run([sys.executable, "-m", "venv", str(venv)], tmp, dict(os.environ))
    assert rc == 0, out
    bindir = venv / "bin"
    # the outer run's own requirements (a CI lane's LOCKSTEP_REQUIRE_*) are not the fresh install's, whose
    # runs select engines of their own: this module's fixtures run before tests/conftest.py drops them
    env = {k: v for k, v in os.environ.items()
           if k not in ("PYTHONPATH", "VIRTUAL_ENV", "LOCKSTEP_CACHE_DIR", "LOCKSTEP_REQUIRE_MODELS",
                        "LOCKSTEP_REQUIRE_ENGINES", "LOCKSTEP_REQUIRE_DEVICES")}
    # bytecode caches on (in the venv): each lockstep call would compile pytest's assertion rewrite of
    # lockstep's modules again (3 s a call)
    env.pop("PYTHONDONTWRITEBYTECODE", None)
    env.update(PATH=f"{bindir}{os.pathsep}{env.get('PATH', '')}", XDG_CACHE_HOME=str(tmp / "cache"))
    rc, out = _run([str(bindir / "python"), *PIP, "install", "-q", f"{wheel}[test,ort]", str(src / EXAMPLE.relative_to(ROOT))],
                   tmp, env, timeout=1800)
    assert rc == 0, f"installing the wheel and the example plugin failed:\n{out[-3000:]}"
    work = tmp / "empty"
    work.mkdir()
    return bindir, work, env, wheel


def test_the_wheel_holds_what_the_suite_needs(installed):
    names = zipfile.ZipFile(installed[3]).namelist()
    for needed in ("lockstep/golden/models/tiny-fp32-standard.onnx", "lockstep/golden/models/manifest.json",
                   "lockstep/golden/snapshots/tiny-fp32-standard.json", "lockstep/contracts/sync_allowlist.toml",
                   "lockstep/golden/exports/snapshots/genai-llama-fp32-cpu.json",
                   "lockstep/golden/exports/genai/llama-fp32-cpu/model.onnx.data",
                   "lockstep/golden/exports/genai/llama-fp32-cpu/genai_config.json",
                   "lockstep/golden/exports/optimum/llama-fp32/tokenizer.json",
                   "lockstep/conformance/node_suite/expectations.toml",
                   "lockstep/contracts/suite/__snapshots__/test_capture_census.ambr",
                   "lockstep/contracts/suite/runtime/test_sync_contracts.py", "lockstep/contracts/pytest_plugin.py",
                   "lockstep/conformance/golden/test_golden_locks.py", "lockstep/conformance/pytest_plugin.py"):
        assert needed in names, f"contract: the wheel carries {needed}"
    assert not [n for n in names if n.startswith(("tests/", "kernels/", "golden/"))], "only the lockstep namespace"
    entry_points = next(n for n in names if n.endswith("entry_points.txt"))
    text = zipfile.ZipFile(installed[3]).read(entry_points).decode()
    assert "[pytest11]" in text and "[lockstep.engines]" in text and "ref-sim = " in text


def test_golden_locks_decode_and_audit_run_from_an_empty_directory(installed):
    bindir, work, env, _ = installed
    rc, out = _run([str(bindir / "lockstep"), "check", "--engines", "ref-sim", "-m", "golden", "-q"], work, env)
    # 6 golden tests (prefill, stepwise and verify lock, tripwire, neighbouring sessions, a batch) on each built-in model and its three shared-buffer
    # forms (15 models); the trained ones and the real exports need the models extra (a checkpoint; tokenizers
    # for the exports' prompts): counted skips here
    assert rc == 0 and "| ref-sim | 90 | 0 |" in out, out[-3000:]
    assert "needs the tokenizers package" in out, f"result: the exports are a counted skip with the reason\n{out[-3000:]}"
    rc, out = _run([str(bindir / "pytest"), "--pyargs", "lockstep.conformance", "--engines", "ref-sim,ort-cpu",
                    "-m", "golden", "-q", "-k", "tiny-fp32-standard and not kv64"], work, env)
    # 6 golden tests on each engine
    assert rc == 0 and "12 passed" in out, f"plain pytest with the pytest11 plugin:\n{out[-3000:]}"
    # the reference runtime's own suite, installed: the built-in snapshot's oracle check
    rc, out = _run([str(bindir / "pytest"), "--pyargs", "lockstep.contracts.suite", "--engines", "ref-sim",
                    "-m", "golden", "-q", "-k", "tiny-fp32-standard and not kv64"], work, env)
    assert rc == 0 and "1 passed" in out, f"the reference runtime's suite, installed:\n{out[-3000:]}"
    rc, out = _run([str(bindir / "lockstep"), "decode", "tiny-fp32-standard", "--prompt", "The quick", "--tokens", "4"],
                   work, env)
    assert rc == 0 and "tokens: [" in out, out[-2000:]
    rc, out = _run([str(bindir / "lockstep"), "audit"], work, env)
    _, tree = _run([sys.executable, "-m", "lockstep", "audit"], ROOT, dict(os.environ))
    entries = re.search(r"(\d+) capture entry points", tree)
    assert entries and rc == 0 and " 0 unsafe" in out and f"{entries.group(1)} capture entry points" in out, (
        f"contract: the packaged allowlist's runtime entries are in force (as many entry points as the "
        f"source tree's audit finds):\n{out[-2000:]}\nsource tree: {tree[-500:]}")
    rc, out = _run([str(bindir / "lockstep"), "golden", "regenerate", "--dry-run", "--model", "tiny-fp32-standard"],
                   work, env)
    assert rc == 0 and "tiny-fp32-standard: unchanged" in out, out[-2000:]
    # the runtime catalogue runs from the wheel alone: one of its mutants shows it (all twelve run from the
    # checkout in tests/test_cli_and_mutants.py, which reads the same packaged tests)
    rc, out = _run([str(bindir / "lockstep"), "mutants", "--mutant", "drain_defers"], work, env)
    assert rc == 0 and "PASS: 1/1 mutants killed" in out, out[-3000:]
    rc, out = _run([str(bindir / "lockstep"), "mutants", "--layer", "sim"], work, env)
    assert rc == 2 and "run from a checkout or set LOCKSTEP_CHECKOUT" in out, (
        f"contract: the source layers need the checkout's tests: one usage line from the wheel:\n{out[-2000:]}")
    assert sorted(p.name for p in work.iterdir()) == [".pytest_cache", "reports"], "nothing else left behind"


def test_the_example_plugin_passes_clean_and_fails_on_its_planted_bug(installed):
    bindir, work, env, _ = installed
    rc, out = _run([str(bindir / "lockstep"), "check", "--engines", "example", "--report-dir", "clean", "-q",
                    "-m", "node_suite or golden or capture"], work, env)
    assert rc == 0, out[-4000:]
    import json

    counts = json.loads((work / "clean" / "report.json").read_text())["summary"]["engines"]["example"]
    assert counts["failed"] == 0 and counts["passed"] > 280 and counts["xfailed"] == 15, (
        f"result: node cases, locks and capture checks ran: {counts}")
    rc, out = _run([str(bindir / "lockstep"), "check", "--engines", "lockstep_example_engine:make_buggy_engine",
                    "--report-dir", "buggy", "-q", "-m", "golden"], work, env)
    assert rc == 1, out[-4000:]
    assert "example-buggy (fp32) breaks the lock on tiny-fp32-standard (stepwise): first divergence at position 18" in out
    assert "diverges from the recorded stream of tiny-fp32-standard at position 19, not a near-tie" in out


def _versions(bindir: Path, env: dict) -> dict[str, str]:
    """The installed versions of ``CASE_PACKAGES`` in the venv."""
    code = "import importlib, json; print(json.dumps({n: importlib.import_module(n).__version__ for n in %r}))"
    rc, out = _run([str(bindir / "python"), "-c", code % (CASE_PACKAGES,)], bindir, env)
    assert rc == 0, out[-2000:]
    return json.loads(out.strip().splitlines()[-1])


def lower_bounds() -> dict[str, str]:
    """The ``>=`` bound of each of ``CASE_PACKAGES`` in pyproject.toml's dependencies."""
    from packaging.requirements import Requirement
    from packaging.utils import canonicalize_name

    deps = [Requirement(d) for d in tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]]
    out = {}
    for name in CASE_PACKAGES:
        (req,) = [r for r in deps if canonicalize_name(r.name) == canonicalize_name(name)]
        (low,) = [s.version for s in req.specifier if s.operator == ">="]
        out[name] = low
    return out


def test_the_newest_allowed_versions_run_the_node_suite(installed, tmp_path):
    """The fresh install is what a new machine gets: no newer onnx, ml_dtypes or numpy within the
    metadata's bounds (pip, asked to upgrade everything, would change none of them), and with those
    the node suite passes on ref-sim and ort-cpu. Before the oldest-versions test (which downgrades)."""
    bindir, work, env, wheel = installed
    report = tmp_path / "upgrade.json"
    rc, out = _run([str(bindir / "python"), *PIP, "install", "-q", "--dry-run", "--upgrade", "--upgrade-strategy",
                    "eager", "--report", str(report), f"{wheel}[test,ort]"], work, env, timeout=900)
    assert rc == 0, out[-2000:]
    from packaging.utils import canonicalize_name

    would = {canonicalize_name(i["metadata"]["name"]): i["metadata"]["version"]
             for i in json.loads(report.read_text())["install"]}
    newer = {n: would[canonicalize_name(n)] for n in CASE_PACKAGES if canonicalize_name(n) in would}
    got = _versions(bindir, env)
    assert not newer, f"contract: the fresh install has the newest allowed versions ({got}); pip would upgrade {newer}"
    rc, out = _run([str(bindir / "lockstep"), "check", "--engines", "ref-sim,ort-cpu", "--report-dir", "newest",
                    "-q", "-m", "node_suite"], work, env)
    assert rc == 0, f"result: the node suite with the newest allowed versions {got}:\n{out[-4000:]}"
    text = (work / "newest" / "report.md").read_text()
    assert all(f"| {n} | {v} |" in text for n, v in got.items()), f"contract: the report names {got}"


def test_the_oldest_allowed_versions_run_the_suite(installed):
    """Any version the metadata allows must run the suite (the expectations describe its cases): the
    oldest onnx, ml_dtypes and numpy (pyproject's lower bounds, installed together: a consistent
    environment), with ref-sim and ort-cpu on the node suite and the golden locks. Runs last: it
    changes the module's venv."""
    bindir, work, env, _ = installed
    low = lower_bounds()
    rc, out = _run([str(bindir / "python"), *PIP, "install", "-q", *(f"{n}=={v}" for n, v in low.items())],
                   work, env, timeout=900)
    assert rc == 0, out[-2000:]
    rc, out = _run([str(bindir / "python"), "-m", "pip", "check"], work, env)
    assert rc == 0, f"contract: the oldest allowed versions {low} install together with the rest:\n{out[-2000:]}"
    got = _versions(bindir, env)
    assert all(Version(got[n]) == Version(v) for n, v in low.items()), f"contract: {got} are the lower bounds {low}"
    rc, out = _run([str(bindir / "lockstep"), "check", "--engines", "ref-sim,ort-cpu", "--report-dir", "oldest",
                    "-q", "-m", "node_suite or golden"], work, env)
    assert rc == 0, f"result: the suite with the oldest allowed versions {got}:\n{out[-4000:]}"
    text = (work / "oldest" / "report.md").read_text()
    assert all(f"| {n} | {v} |" in text for n, v in got.items()), f"contract: the report names {got}"
