"""The floors point one way (import-linter's contracts in pyproject.toml) and ruff passes.

import-linter reads a package from its folder; the installed layout maps the top-level folders
(reference_runtime/, kernels/, golden/, ...) under ``lockstep.*`` (``[tool.setuptools.package-dir]``),
which an editable install resolves through a finder, not a folder. The tests lay the tree out as the
wheel does (its ``.py`` files, in a temporary folder) and run ``lint-imports`` there.
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


def _tool(name: str) -> str:
    path = BIN / name
    if not path.exists():  # the test extra installs both: a missing one is a broken environment, not a skip
        pytest.fail(f"{name} is not installed beside {sys.executable} (pip install -e '.[test]')")
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
    # reference runtime and ONNX Runtime's engines are independent
    r = _lint(_layout(tmp_path))
    assert r.returncode == 0, r.stdout + r.stderr
    assert "2 kept, 0 broken" in r.stdout, r.stdout


def test_an_upward_import_breaks_the_contract(tmp_path):
    # contract: the check can fail: a ground-floor module importing the CLI inside a function is named
    tree = _layout(tmp_path)
    planted = tree / "lockstep" / "decoder_io.py"
    planted.write_text(planted.read_text() + "\n\ndef _planted():\n    from lockstep import cli  # noqa: F401\n")
    r = _lint(tree)
    assert r.returncode != 0, r.stdout
    assert "lockstep's floors point one way BROKEN" in r.stdout, r.stdout
    assert "lockstep.decoder_io -> lockstep.cli" in r.stdout, r.stdout


def test_ruff_passes():
    # result: the rule set in pyproject.toml ([tool.ruff.lint]) holds on the whole tree
    r = subprocess.run([_tool("ruff"), "check", "--no-cache", "."], cwd=ROOT, capture_output=True, text=True,
                       timeout=300)
    assert r.returncode == 0, r.stdout[-4000:] + r.stderr[-2000:]
