"""The floors point one way (import-linter's contracts in pyproject.toml) and ruff passes.

import-linter reads a package from its folder; the installed layout maps the top-level folders
(reference_runtime/, kernels/, golden/, ...) under ``lockstep.*`` (``[tool.setuptools.package-dir]``),
which an editable install resolves through a finder, not a folder. The tests lay the tree out as the
wheel does (its ``.py`` files, in a temporary folder) and run ``lint-imports`` there.

ruff and import-linter (with grimp, its graph) are the dev extra's, not the test extra's: a user who
installed the suite to run it has neither, and these tests are counted skips naming the extra there;
``LOCKSTEP_REQUIRE_DEV_TOOLS=1`` (``.ci/run`` sets it) makes a missing tool a failure.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
BIN = Path(sys.executable).parent


def _missing(what: str) -> None:
    """A dev tool that is not installed: a counted skip naming the extra, a failure where it is required."""
    why = f"{what} is not installed beside {sys.executable} (the dev extra brings it: pip install -e '.[dev]')"
    if os.environ.get("LOCKSTEP_REQUIRE_DEV_TOOLS") == "1":
        pytest.fail(f"{why}, and LOCKSTEP_REQUIRE_DEV_TOOLS=1 requires it")
    pytest.skip(why)


def _tool(name: str) -> str:
    path = BIN / name
    if not path.exists():
        _missing(name)
    return str(path)


def _layout(dest: Path) -> Path:
    """The tree's modules as the wheel installs them, under ``dest``; returns ``dest``."""
    cfg = tomllib.loads((ROOT / "pyproject.toml").read_text())
    for package, folder in cfg["tool"]["setuptools"]["package-dir"].items():
        src = ROOT / folder
        target = dest.joinpath(*package.split("."))
        for path in src.rglob("*.py"):
            rel = path.relative_to(src)
            if "__pycache__" in rel.parts:
                continue
            out = target / rel
            out.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy(path, out)
    shutil.copy(ROOT / "pyproject.toml", dest / "pyproject.toml")
    return dest


def _lint(tree: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(tree)}
    return subprocess.run([_tool("lint-imports"), "pyproject.toml", "--no-cache"], cwd=tree, env=env,
                          capture_output=True, text=True, timeout=300)


def test_the_floors_point_one_way(tmp_path):
    # contract: no module imports from a floor above its own, counting imports inside functions; the
    # reference runtime and ONNX Runtime's engines are independent; no package's modules import each other in a cycle
    r = _lint(_layout(tmp_path))
    assert r.returncode == 0, r.stdout + r.stderr
    assert "4 kept, 0 broken" in r.stdout, r.stdout


def test_an_upward_import_breaks_the_contract(tmp_path):
    # contract: the check can fail: a ground-floor module importing the CLI inside a function is named
    tree = _layout(tmp_path)
    planted = tree / "lockstep" / "decoder_io.py"
    planted.write_text(planted.read_text() + "\n\ndef _planted():\n    from lockstep.conformance import cli  # noqa: F401\n")
    r = _lint(tree)
    assert r.returncode != 0, r.stdout
    assert "lockstep's floors point one way BROKEN" in r.stdout, r.stdout
    assert "lockstep.decoder_io -> lockstep.conformance.cli" in r.stdout, r.stdout


def test_a_cycle_between_sibling_modules_breaks_the_contract(tmp_path):
    # contract: the acyclic-siblings check can fail: the runtime importing the executor (which imports the
    # runtime), inside a function, as the plan and host values once did to dodge the cycle
    tree = _layout(tmp_path)
    planted = tree / "lockstep" / "reference_runtime" / "runtime.py"
    planted.write_text(planted.read_text() + "\n\ndef _planted():\n    from . import executor  # noqa: F401\n")
    r = _lint(tree)
    assert r.returncode != 0, r.stdout
    assert "no cycles among siblings BROKEN" in r.stdout, r.stdout
    assert "No cycles are allowed in lockstep.reference_runtime." in r.stdout, r.stdout
    assert "- .runtime -> .executor (1 import)" in r.stdout, r.stdout


def test_ruff_passes():
    # result: the rule set in pyproject.toml ([tool.ruff.lint]) holds on the whole tree
    r = subprocess.run([_tool("ruff"), "check", "--no-cache", "."], cwd=ROOT, capture_output=True, text=True,
                       timeout=300)
    assert r.returncode == 0, r.stdout[-4000:] + r.stderr[-2000:]


def _folder_edges(tree: Path) -> dict[tuple[str, str], list[str]]:
    """(importer folder, imported folder) -> the module imports between two top-level folders of the
    tree, every import counted (inside functions too), from grimp's graph of the laid-out tree."""
    try:
        import grimp  # noqa: F401  (import-linter's graph library)
    except ImportError:
        _missing("grimp (import-linter's)")
    code = (
        "import json, sys, grimp\n"
        "g = grimp.build_graph('lockstep', cache_dir=None)\n"
        "mapped = json.loads(sys.argv[1])\n"
        "def folder(m):\n"
        "    for pkg, f in sorted(mapped.items(), key=lambda kv: -len(kv[0])):\n"
        "        if m == pkg or m.startswith(pkg + '.'):\n"
        "            return f\n"
        "out = {}\n"
        "for m in g.modules - {'lockstep.__main__'}:  # an entry point (python -m lockstep), imported by none\n"
        "    for i in g.find_modules_directly_imported_by(m):\n"
        "        a, b = folder(m), folder(i)\n"
        "        if a != b:\n"
        "            out.setdefault(a + ' ' + b, []).append(m + ' -> ' + i)\n"
        "print(json.dumps(out))\n")
    cfg = tomllib.loads((ROOT / "pyproject.toml").read_text())
    mapped = cfg["tool"]["setuptools"]["package-dir"]
    import json

    r = subprocess.run([sys.executable, "-c", code, json.dumps(mapped)], cwd=tree,
                       env={**os.environ, "PYTHONPATH": str(tree)}, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    return {tuple(k.split(" ")): v for k, v in json.loads(r.stdout).items()}


def test_no_two_top_level_folders_import_each_other(tmp_path):
    # contract (issue 31's acceptance): between the top-level folders (lockstep/, reference_runtime/, kernels/,
    # golden/, contracts/, conformance/) imports go one way only, counting imports inside functions
    edges = _folder_edges(_layout(tmp_path))
    assert edges, "result: the folders do import each other (the graph was read)"
    both = {(a, b): (edges[(a, b)][:3], edges[(b, a)][:3]) for (a, b) in edges if (b, a) in edges and a < b}
    assert not both, f"top-level folders importing each other both ways: {both}"


def test_a_planted_cycle_between_folders_is_found(tmp_path):
    # contract: the folder check can fail: the ground importing golden inside a function is a cycle
    tree = _layout(tmp_path)
    planted = tree / "lockstep" / "decoder_io.py"
    planted.write_text(planted.read_text() + "\n\ndef _planted():\n    from lockstep.golden import catalog  # noqa: F401\n")
    edges = _folder_edges(tree)
    assert ("lockstep", "golden") in edges and ("golden", "lockstep") in edges
    assert "lockstep.decoder_io -> lockstep.golden.catalog" in edges[("lockstep", "golden")]
