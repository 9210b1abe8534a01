"""The READMEs' recipes are true when followed literally: the kernel recipe's code block
(kernels/README.md) registers, runs on the simulated device, and passes the sync audit; the plugin
recipe (README.md, "Testing your own runtime") fails closed, then one command makes it green."""

from __future__ import annotations

import importlib.util
import os
import re
import subprocess
import sys
import tomllib
from pathlib import Path

import numpy as np
from onnx import TensorProto, helper

import lockstep
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


def _extras(install: str) -> set[str]:
    """The extras of an editable install command (``pip install -e '.[a,b]'``)."""
    return set(re.search(r"'\.\[([^]]+)\]'", install).group(1).split(","))


def test_ci_runs_the_readme_s_test_command_on_a_fresh_install():
    """Contract (the brief): README.md starts with the install-and-main-job command and the
    install-and-all-tests command; the second installs what the first does, the dev extra in place of
    the test extra (dev brings test: a user's machine never needs dev's tools); `.ci/run` installs the
    second's extras with no pip cache and runs exactly its test command, last."""
    block = re.search(r"```bash\n(.*?)```", (ROOT / "README.md").read_text(), re.S).group(1)
    install_and_main, install_and_all = [ln.strip() for ln in block.splitlines() if ln.strip()][:2]
    install, main_job = (part.strip() for part in install_and_main.split("&&"))
    assert main_job.startswith("pytest ") and main_job.endswith(" conformance/") and "-n auto" in main_job
    install_all, all_tests = (part.strip() for part in install_and_all.split("&&"))
    assert all_tests.startswith("pytest ") and "-n auto" in all_tests and "conformance/" not in all_tests
    user, dev = _extras(install), _extras(install_all)
    assert "test" in user and "dev" not in user, f"contract: the main job installs the user's extras, got {user}"
    assert dev == user - {"test"} | {"dev"}, f"contract: all tests install the main job's extras with dev, got {dev}"
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    assert "lockstep-conformance[test,audit]" in extras["dev"], "contract: dev brings the test extra"
    ci = [ln.strip() for ln in (ROOT / ".ci" / "run").read_text().splitlines() if ln.strip() and not ln.startswith("#")]
    assert ci[-1] == all_tests, f"contract: .ci/run's last command is the README's {all_tests!r}, got {ci[-1]!r}"
    installs = [ln for ln in ci if "pip install" in ln and "-e" in ln.split()]
    assert [_extras(ln) for ln in installs] == [dev], f"contract: .ci/run installs the README's extras: {installs}"
    assert "--no-cache-dir" in installs[0], "contract: no pip cache"
    assert "export PIP_NO_CACHE_DIR=1" in ci, "contract: the packaging test's own installs inherit no cache"
    assert "export LOCKSTEP_REQUIRE_DEV_TOOLS=1" in ci, "contract: a dev tool missing in CI is a failure, not a skip"


def test_the_test_extra_keeps_the_dev_tools_off_a_user_s_machine():
    """Contract (issue 54): the extra a user installs to run the suite (test, and nxrt, which brings
    test) has none of the tools only lockstep's own tests use: ruff, import-linter, cuda-bindings and
    the 142 MB NVRTC wheel are the dev extra's."""
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    tools = ("ruff", "import-linter", "cuda-bindings", "nvidia-cuda-nvrtc")

    def names(extra: str) -> set[str]:
        return {re.split(r"[<>=!~;\[ ]", req, maxsplit=1)[0].strip() for req in extras[extra]}

    for extra in ("test", "nxrt"):
        assert not names(extra) & set(tools), f"contract: the {extra} extra brings {names(extra) & set(tools)}"
    assert names("dev") >= set(tools), names("dev")
    assert "lockstep-conformance[test,ort,models]" in extras["nxrt"], "contract: nxrt stays self-contained"


def _plugin_recipe() -> tuple[str, list[tuple[str, list[str]]]]:
    """README "Testing your own runtime": the engine file (the ```python block opening with
    ``# myengine.py``) and the ```bash block after it as (command, output lines shown under it)."""
    text = (ROOT / "README.md").read_text()
    section = text.split("## Testing your own runtime\n", 1)[1].split("\n## ", 1)[0]
    code = re.search(r"```python\n(# myengine\.py\n.*?)```", section, re.DOTALL).group(1)
    bash = re.search(r"```bash\n(.*?)```", section[section.index(code) + len(code):], re.DOTALL).group(1)
    steps: list[tuple[str, list[str]]] = []
    for line in bash.splitlines():
        if line.startswith("#"):
            steps[-1][1].append(line.lstrip("#").strip())
        elif line.strip():
            steps.append((line.strip(), []))
    return code, steps


def test_the_plugin_recipe_fails_closed_then_one_command_makes_it_green(tmp_path):
    """Contract (README, "Testing your own runtime"): its engine file and commands, run literally in an
    empty folder with the installed `lockstep`, do what it shows: the first check fails
    closed and prints the one command that records what the engine cannot run, that command writes
    the engine's expectations, and the next check is green; every output line the README shows
    under a command is in that command's output ("..." standing for anything)."""
    code, steps = _plugin_recipe()
    assert [cmd.split()[:3] for cmd, _ in steps] == [["lockstep", "check", "--engines"],
                                                     ["lockstep", "expectations", "--from-report"],
                                                     ["lockstep", "check", "--engines"]], steps
    (tmp_path / "myengine.py").write_text(code)
    # the console script beside this python (a venv) or beside the package (an install by --target, as on
    # the GPU lane, whose PYTHONPATH names it)
    env = {k: v for k, v in os.environ.items() if not k.startswith("LOCKSTEP_REQUIRE_")}
    scripts = [Path(sys.executable).parent, Path(lockstep.__file__).resolve().parents[1] / "bin"]
    env["PATH"] = os.pathsep.join([*(str(s) for s in scripts if s.is_dir()), env.get("PATH", "")])
    for n, (cmd, shown) in enumerate(steps):
        proc = subprocess.run(["bash", "-c", cmd], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600,
                              check=False)
        out = proc.stdout + proc.stderr
        assert proc.returncode == (1 if n == 0 else 0), f"{cmd}: exit {proc.returncode}\n{out[-3000:]}"
        for line in shown:
            pattern = re.escape(line).replace(re.escape("..."), ".*")
            assert re.search(pattern, out), f"contract: README shows {line!r} under `{cmd}`; its output:\n{out[-3000:]}"
        if n == 1:
            written = (tmp_path / "myengine.toml").read_text()
            assert written.count("[[expect]]") > 100 and "engine =" not in written, written[:500]
