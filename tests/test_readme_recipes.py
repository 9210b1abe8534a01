"""The folder READMEs' recipes are true when followed literally: the kernel recipe's code block
(kernels/README.md) registers, runs on the simulated device, and passes the sync audit."""

from __future__ import annotations

import importlib.util
import re
import sys
from pathlib import Path

import numpy as np
from onnx import TensorProto, helper

from lockstep.contracts.audit import audit
from lockstep.kernels.registry import MODULES, Registry
from lockstep.reference_runtime import Runtime, RuntimeConfig
from lockstep.reference_runtime.backends.sim import SimDevice
from lockstep.reference_runtime.executor import Executor

ROOT = Path(__file__).resolve().parent.parent


def _recipe_block(readme: Path) -> str:
    (block,) = re.findall(r"```python\n(.*?)```", readme.read_text(), re.S)
    return block


def test_the_kernel_recipe_registers_runs_and_audits(tmp_path, monkeypatch):
    source = _recipe_block(ROOT / "kernels" / "README.md")
    # the recipe's module lives in kernels/ (relative import of ._op): load it as lockstep.kernels.ops_mine
    path = tmp_path / "ops_mine.py"
    path.write_text(source)
    spec = importlib.util.spec_from_file_location("lockstep.kernels.ops_mine", path)
    mod = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, "lockstep.kernels.ops_mine", mod)
    spec.loader.exec_module(mod)
    registry = Registry.from_modules((*MODULES, "lockstep.kernels.ops_mine"))
    node = helper.make_node("Scale", ["x"], ["y"], domain="com.example", alpha=2.5)
    graph = helper.make_graph([node], "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [3])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [3])])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21), helper.make_opsetid("com.example", 1)],
                              ir_version=10)
    ex = Executor(model, Runtime(SimDevice(), RuntimeConfig()), registry=registry)
    x = np.array([1.0, -2.0, 4.0], np.float32)
    np.testing.assert_array_equal(ex.run({"x": x})["y"], 2.5 * x)
    res = audit([str(path)], allowlist=None)
    assert not res.findings and len(res.entries) == 1, "result: the recipe's kernel is an audit entry, clean"


def test_ci_runs_the_readme_s_test_command_on_a_fresh_install():
    """Contract (the brief): README.md starts with the install-and-main-job command and the all-tests
    command; `.ci/run` installs the first's extras with no pip cache and runs exactly the second."""
    block = re.search(r"```bash\n(.*?)```", (ROOT / "README.md").read_text(), re.S).group(1)
    install_and_main, all_tests = [ln.strip() for ln in block.splitlines() if ln.strip()][:2]
    install, main_job = (part.strip() for part in install_and_main.split("&&"))
    assert main_job.startswith("pytest ") and main_job.endswith(" conformance/") and "-n auto" in main_job
    ci = [ln.strip() for ln in (ROOT / ".ci" / "run").read_text().splitlines() if ln.strip() and not ln.startswith("#")]
    assert ci[-1] == all_tests, f"contract: .ci/run's last command is the README's {all_tests!r}, got {ci[-1]!r}"
    extras = re.search(r"'(\.\[[^]]+\])'", install).group(1)
    assert any(extras in ln and "--no-cache-dir" in ln for ln in ci), "contract: the README's extras, no pip cache"
    assert "export PIP_NO_CACHE_DIR=1" in ci, "contract: the packaging test's own installs inherit no cache"
