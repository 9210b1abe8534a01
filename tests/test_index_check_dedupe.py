"""Index checks a run already launched are not launched again (``IndexCheck.by``, ``Executor._fresh_checks``):
a decode step's RotaryEmbeddings all check one ``position_ids`` against one cos/sin cache, and the error
latch keeps the first site that flags, so the later checks could never change what a run reports.
Fusion is off here: these are the executor's checks across steps (a fused pair of the two nodes checks
each value once within its step: tests/test_fusion.py). Assertions say whether they encode a contract or
a result."""

from __future__ import annotations

import numpy as np
import pytest
from onnx import TensorProto, helper, numpy_helper

from lockstep.reference_runtime import RuntimeConfig
from lockstep.reference_runtime import steps as steps_mod
from lockstep.reference_runtime.errors import DeviceAssert
from lockstep.reference_runtime.executor import Executor

ROWS, HALF = 6, 4


def _rope_model(shared_cache: bool = True):
    """q_rope then k_rope: RotaryEmbedding (opset 23) of two inputs at the same position_ids; k_rope reads
    the same cos/sin initializers (``shared_cache``) or its own copies (same values, other names)."""
    rng = np.random.default_rng(5)
    cos, sin = rng.standard_normal((ROWS, HALF)).astype(np.float32), rng.standard_normal((ROWS, HALF)).astype(np.float32)
    inits = [numpy_helper.from_array(cos, "cos"), numpy_helper.from_array(sin, "sin")]
    k_cache = ["cos", "sin"]
    if not shared_cache:
        inits += [numpy_helper.from_array(cos.copy(), "cos_k"), numpy_helper.from_array(sin.copy(), "sin_k")]
        k_cache = ["cos_k", "sin_k"]
    nodes = [helper.make_node("RotaryEmbedding", ["xq", "cos", "sin", "pos"], ["yq"], name="q_rope"),
             helper.make_node("RotaryEmbedding", ["xk", *k_cache, "pos"], ["yk"], name="k_rope")]
    f = TensorProto.FLOAT
    g = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("xq", f, [1, 2, 1, 8]),
                                       helper.make_tensor_value_info("xk", f, [1, 1, 1, 8]),
                                       helper.make_tensor_value_info("pos", TensorProto.INT64, [1, 1])],
                          [helper.make_tensor_value_info("yq", f, [1, 2, 1, 8]),
                           helper.make_tensor_value_info("yk", f, [1, 1, 1, 8])], inits)
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", 23)])


def _feeds(pos: int):
    rng = np.random.default_rng(6)
    return {"xq": rng.standard_normal((1, 2, 1, 8)).astype(np.float32),
            "xk": rng.standard_normal((1, 1, 1, 8)).astype(np.float32), "pos": np.array([[pos]], np.int64)}


@pytest.fixture
def counted(monkeypatch):
    """The check launches of each run: ``flag_check`` wrapped where the node kernels call it."""
    calls: list[int] = []
    real = steps_mod.flag_check

    def counting(xp, latch, idx, check, site):
        calls.append(site)
        return real(xp, latch, idx, check, site)

    monkeypatch.setattr(steps_mod, "flag_check", counting)
    return calls


@pytest.mark.parametrize("plans", [True, False], ids=["plans", "no-plans"])
def test_one_position_check_per_run_for_one_cache(make_runtime, counted, plans):
    """result: two RotaryEmbeddings of one position_ids and one cos/sin cache launch one check per run
    (the first run, the planned runs after it), two when their caches are other values; contract: each
    run checks again (the dedupe does not cross runs)."""
    ex = Executor(_rope_model(), make_runtime(RuntimeConfig(execution_plans=plans, fuse_kernels=False)))
    for _ in range(3):
        ex.run(_feeds(2))
    assert len(counted) == 3, f"result: one check a run, got {len(counted)} over 3 runs"
    counted.clear()
    ex = Executor(_rope_model(shared_cache=False), make_runtime(RuntimeConfig(execution_plans=plans, fuse_kernels=False)))
    for _ in range(3):
        ex.run(_feeds(2))
    assert len(counted) == 6, "contract: caches of other names are other bounds as far as the executor knows"


@pytest.mark.contract("latch.first_site")
@pytest.mark.parametrize("plans", [True, False], ids=["plans", "no-plans"])
def test_a_position_past_the_cache_is_still_flagged_at_the_first_node(make_runtime, plans):
    """contract: with the second check not launched, a position past the cache rows is DeviceAssert naming
    the first RotaryEmbedding (the site the latch kept before), on the first run and on planned runs."""
    ex = Executor(_rope_model(), make_runtime(RuntimeConfig(execution_plans=plans, fuse_kernels=False)))
    ex.run(_feeds(1))
    ex.run(_feeds(2))
    with pytest.raises(DeviceAssert, match="q_rope"):
        ex.run(_feeds(ROWS))


def test_a_check_in_a_later_run_is_not_skipped_for_an_earlier_one(make_runtime):
    """contract: a run that flags after clean runs raises (each run has its own record of launched checks)."""
    ex = Executor(_rope_model(), make_runtime(RuntimeConfig(execution_plans=False, fuse_kernels=False)))
    ex.run(_feeds(0))
    with pytest.raises(DeviceAssert, match="q_rope"):
        ex.run(_feeds(-1))
