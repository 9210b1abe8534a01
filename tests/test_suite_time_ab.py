"""scripts/suite_time_ab.py: the A/B timing of a pytest selection in two checkouts."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "scripts" / "suite_time_ab.py"


def _run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(SCRIPT), *args], cwd=ROOT, capture_output=True, text=True, timeout=300)


def test_it_times_both_checkouts_in_alternating_rounds_and_prints_the_ratios():
    """Result: one line per run (ABBA order), medians, per-round ratios and the per-function split."""
    p = _run("--baseline-tree", str(ROOT), "--baseline-python", sys.executable, "--rounds", "2", "--",
             "tests/test_node_case_compare.py")
    assert p.returncode == 0, p.stderr
    lines = p.stdout.splitlines()
    order = [ln.split()[1] for ln in lines if ln[:5].strip().isdigit()]
    assert order == ["baseline", "this", "this", "baseline"], f"result: ABBA order, got {order}"
    assert any(ln.startswith("this / baseline, wall, per round:") and "median" in ln for ln in lines)
    assert any(ln.startswith("this / baseline, cpu, per round:") for ln in lines)
    assert any(ln.startswith("test_the_fast_check_never_passes") for ln in lines), "result: the per-function split"


def test_bad_input_is_a_one_line_usage_error():
    """Result: a path that is no checkout, or no rounds, is a usage error naming it, not a traceback."""
    p = _run("--baseline-tree", "/nonexistent", "--baseline-python", sys.executable, "--", "x")
    assert p.returncode == 2 and "/nonexistent is not a checkout" in p.stderr and "Traceback" not in p.stderr
    p = _run("--baseline-tree", str(ROOT), "--baseline-python", sys.executable, "--rounds", "0")
    assert p.returncode == 2 and "--rounds must be >= 1" in p.stderr
    p = _run("--baseline-tree", str(ROOT), "--baseline-python", sys.executable, "--rounds", "1", "--", "no/such/tests")
    assert p.returncode == 1 and "exited 4, not a test run" in p.stderr and "Traceback" not in p.stderr
