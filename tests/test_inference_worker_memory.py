"""The shape-inference worker is forked before a model's weights are read (``lockstep.inference.prefork``).

Contract: loading a model file leaves an inference worker whose resident memory does not hold the
model's weights (a worker forked after them counts the parent's pages, copy-on-write, as its own:
issue 51 measured 4.8 GiB beside an 0.5B model)."""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

MB = 1 << 20

CHILD = r"""
import sys
from lockstep.loading import load_model
from lockstep import inference
load_model(sys.argv[1])
inference.infer(load_model(sys.argv[1])[0])  # a request: the worker exists and has served
pid = inference._WORKER.pid
rss = next(int(line.split()[1]) for line in open(f"/proc/{pid}/status") if line.startswith("VmRSS:"))
print(rss * 1024)
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/<pid>/status")
def test_the_inference_worker_does_not_hold_the_weights(tmp_path):
    weights = numpy_helper.from_array(np.ones((64, MB // 4), np.float32), "w")  # 64 MiB
    graph = helper.make_graph([helper.make_node("Add", ["x", "w"], ["y"])], "g",
                              [helper.make_tensor_value_info("x", TensorProto.FLOAT, [64, MB // 4])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [64, MB // 4])], [weights])
    path = tmp_path / "big.onnx"
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21)], ir_version=10), path)
    out = subprocess.run([sys.executable, "-c", CHILD, str(path)], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    rss = int(out.stdout.strip().splitlines()[-1])
    assert rss < 48 * MB, f"result: the worker holds {rss / MB:.0f} MiB beside a 64 MiB model"
