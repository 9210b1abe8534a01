"""scripts/bench_suite.py: the suite-time benchmark of the README's commands against their targets."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "scripts" / "bench_suite.py"

README = """# fake
```bash
pip install nothing && {py} -c "print('3 passed in 0.01s')"
{install}{py} -c "print('5 passed, 1 skipped in 0.02s')"
```
"""


def _tree(path: Path, py: str = sys.executable, install: str = "") -> Path:
    path.mkdir()
    (path / "README.md").write_text(README.format(py=py, install=install))
    return path


def test_it_runs_each_checkout_s_readme_commands_alternately_and_prints_targets_and_ratios(tmp_path):
    """Result: the commands come from each checkout's README (after the install's &&; the second
    line), runs alternate between the checkouts, and the table has medians, targets and ratios."""
    # this checkout's all-tests line installs first (its README's form since the dev extra), the baseline's not
    a, b = _tree(tmp_path / "a", install="pip install nothing && "), _tree(tmp_path / "b")
    p = subprocess.run([sys.executable, str(SCRIPT), "--tree", str(a), "--only", "conformance,all", "--repeats", "2",
                        "--baseline-tree", str(b), "--baseline-python", sys.executable],
                       cwd=a, capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stdout + p.stderr
    rounds = [ln.split(":")[0] for ln in p.stdout.splitlines() if " round " in ln]
    assert rounds == ["conformance round 1 this", "conformance round 1 baseline", "conformance round 2 baseline",
                      "conformance round 2 this", "all round 1 this", "all round 1 baseline", "all round 2 baseline",
                      "all round 2 this"], rounds
    assert "3 passed in 0.01s" in p.stdout and "5 passed, 1 skipped in 0.02s" in p.stdout
    table = [ln for ln in p.stdout.splitlines() if ln.startswith("| conformance |") or ln.startswith("| all |")]
    assert len(table) == 2 and all("| yes |" in ln and ln.count("|") == 12 for ln in table), table
    assert "peak RSS" in p.stdout and "| peak RSS GiB (largest process) |" in p.stdout


def test_bad_input_is_a_usage_error():
    def run(*args):
        return subprocess.run([sys.executable, str(SCRIPT), *args], capture_output=True, text=True, timeout=60)

    p = run("--only", "lint")
    assert p.returncode == 2 and "--only: one or more of" in p.stderr and "Traceback" not in p.stderr
    p = run("--tree", "/nonexistent")
    assert p.returncode == 2 and "/nonexistent: no README.md" in p.stderr and "Traceback" not in p.stderr
    p = run("--baseline-tree", "/nonexistent", "--baseline-python", sys.executable)
    assert p.returncode == 2 and "/nonexistent: no README.md" in p.stderr and "Traceback" not in p.stderr
