"""The reference runtime's pytest plugin (``lockstep.contracts.pytest_plugin``) and the suite's:
loaded by every pytest run where lockstep is installed, they stay light until a test asks for the
runtime, and the runtime plugin's devices are the runtime's backends."""

from __future__ import annotations

import subprocess
import sys

from lockstep.contracts import pytest_plugin as runtime_plugin
from lockstep.reference_runtime.backends import DEVICES


def test_the_plugin_s_devices_are_the_runtime_s_backends(monkeypatch):
    # contract: --devices knows exactly the backends (a backend added to _BACKENDS is a device, no second list)
    from lockstep.reference_runtime import backends

    assert runtime_plugin._devices() == DEVICES
    monkeypatch.setattr(backends, "DEVICES", (*DEVICES, "rocm"))
    assert runtime_plugin._names("sim,rocm", "--devices") == ["sim", "rocm"]


def test_loading_both_plugins_imports_no_runtime_and_no_onnx():
    """result: a pytest run that never asks for an engine, a device or a golden model pays for
    neither the runtime, the kernels, onnx nor ONNX Runtime (the plugins import them when asked)."""
    code = ("import sys, lockstep.conformance.pytest_plugin, lockstep.contracts.pytest_plugin; "
            "print(sorted(m for m in sys.modules if m.split('.')[0] in ('onnx', 'onnxruntime', 'cupy') "
            "or m.startswith(('lockstep.reference_runtime', 'lockstep.kernels', 'lockstep.golden'))))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True)
    assert out.stdout.strip() == "[]", out.stdout
