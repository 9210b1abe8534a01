"""The device memory budget (issue 15): ``RuntimeConfig.device_memory_limit`` and ``MemoryAllocation``.

Every allocation is refused by name *before* anything is allocated when it would pass the budget or
its size is not one (a negative dim, a byte count past int64); the runtime stays usable afterwards.
Device tests are parametrized over ``device_name`` (sim here, cupy on the GPU lane), with explicit
budgets so both devices refuse the same requests.
"""

from __future__ import annotations

import numpy as np
import pytest
from lockstep.reference_runtime import RuntimeConfig
from lockstep.reference_runtime.errors import MemoryAllocation, from_cuda_status
from lockstep.reference_runtime.executor import Executor
from lockstep.reference_runtime.pager import WeightPager
from onnx import TensorProto, helper, numpy_helper

MiB = 1 << 20
BUDGET = 64 * MiB


def _rt(make_runtime, limit=BUDGET):
    return make_runtime(RuntimeConfig(device_memory_limit=limit))


# ---------------------------------------------------------------- configuration and the error class


def test_budget_is_read_from_the_environment_with_a_suffix():
    cfg = RuntimeConfig.from_env({"LOCKSTEP_DEVICE_MEMORY_LIMIT": "1.5G"})
    assert cfg.device_memory_limit == 3 << 29
    assert cfg.vram_limit is None
    assert RuntimeConfig.from_env({}).device_memory_limit is None


@pytest.mark.parametrize("raw", ["lots", "-4M", "0", "inf"])
def test_a_bad_budget_in_the_environment_names_the_variable(raw):
    with pytest.raises(ValueError, match="LOCKSTEP_DEVICE_MEMORY_LIMIT"):
        RuntimeConfig.from_env({"LOCKSTEP_DEVICE_MEMORY_LIMIT": raw})


def test_a_pager_budget_larger_than_the_device_budget_is_refused():
    with pytest.raises(ValueError, match="vram_limit=.* exceeds device_memory_limit"):
        RuntimeConfig(vram_limit=2 * BUDGET, device_memory_limit=BUDGET)
    with pytest.raises(ValueError, match="device_memory_limit=0"):
        RuntimeConfig(device_memory_limit=0)


def test_cuda_status_2_is_memory_allocation_and_not_sticky():
    err = from_cuda_status(2, "cudaMalloc: out of memory")
    assert type(err) is MemoryAllocation
    assert err.cuda_name == "cudaErrorMemoryAllocation" and not err.sticky


def test_the_simulated_device_default_budget_is_bounded():
    from lockstep.reference_runtime.backends.sim import DEFAULT_MEMORY_CAP, SimDevice

    limit = SimDevice().default_memory_limit()
    assert 0 < limit <= DEFAULT_MEMORY_CAP


# ---------------------------------------------------------------- the runtime's allocations


def test_the_budget_defaults_to_the_device_and_follows_the_config(make_runtime, device):
    assert make_runtime().memory_limit == device.default_memory_limit()
    assert _rt(make_runtime).memory_limit == BUDGET


def test_an_allocation_past_the_budget_is_refused_before_allocating(make_runtime):
    rt = _rt(make_runtime)
    held = rt.device.allocated_bytes
    with pytest.raises(MemoryAllocation, match=r"value 'big' float32\[32, 1048576\]: 134217728 bytes") as exc:
        rt.empty((32, MiB), np.float32, name="big")
    e = exc.value
    assert (e.value, e.nbytes, e.limit, e.in_use) == ("big", 128 * MiB, BUDGET, held)
    assert rt.device.allocated_bytes == held  # nothing was allocated
    t = rt.upload(np.arange(6, dtype=np.float32), name="after")  # the runtime stays usable
    np.testing.assert_array_equal(rt.download(t), np.arange(6, dtype=np.float32))


def test_the_refusal_names_the_node_running(make_runtime):
    rt = _rt(make_runtime)
    rt.current_node = "mul_7"
    with pytest.raises(MemoryAllocation, match=r"^cudaErrorMemoryAllocation: node 'mul_7': value 'y'") as exc:
        rt.empty((BUDGET,), np.float32, name="y")
    assert exc.value.node == "mul_7"


@pytest.mark.parametrize("shape, why", [
    ((4, -3), "a negative dim is not a size"),
    ((2**32, 2**32), "its byte count overflows int64"),
    ((0, 2**62, 2**62), "its byte count overflows int64"),  # no element, but numpy cannot describe it
])
def test_a_shape_that_is_no_size_is_refused_in_python_ints(make_runtime, shape, why):
    rt = _rt(make_runtime)
    with pytest.raises(MemoryAllocation, match=why) as exc:
        rt.empty(shape, np.float32, name="v")
    if why.startswith("its byte count"):
        assert exc.value.nbytes == int(np.prod(shape, dtype=object)) * 4  # exact, not wrapped
    assert rt.download(rt.upload(np.ones(2, np.float32))).tolist() == [1.0, 1.0]


def test_pending_frees_are_given_back_before_refusing(make_runtime):
    """Contract (Runtime.check_allocation): memory held only by pending frees is given back (a drain)
    before an allocation is refused for the budget. A spin kernel keeps the free pending on a GPU too,
    where the queued work would otherwise be done before the next allocation looks."""
    from lockstep.contracts.suite.runtime._busy import busy

    rt = _rt(make_runtime)
    a = rt.empty((BUDGET * 3 // 4,), np.uint8, name="a")
    busy(rt)
    rt.free(a)
    assert rt.pending_frees == 1  # stream-ordered: not given back until its queued readers ran
    b = rt.empty((BUDGET * 3 // 4,), np.uint8, name="b")  # fits only once the pending free went back
    assert rt.pending_frees == 0 and not b.freed


def test_the_device_refusing_is_named_too(make_runtime):
    # No budget in the way: the device itself (CuPy's pool, the simulator's host) cannot hold 4 EiB.
    rt = make_runtime(RuntimeConfig(device_memory_limit=(1 << 63) - 1))
    with pytest.raises(MemoryAllocation, match=r"value 'huge' uint8\[4611686018427387904\].*the device refused it"):
        rt.empty((1 << 62,), np.uint8, name="huge")
    assert rt.download(rt.upload(np.ones(3, np.int32))).tolist() == [1, 1, 1]


def test_pager_page_ins_count_against_the_device_budget(make_runtime):
    rt = _rt(make_runtime, limit=8 * MiB)
    pager = WeightPager(rt, 8 * MiB)
    gran = pager.span_of(1)
    n_fit = (rt.memory_limit - rt.device.allocated_bytes) // gran
    keys = [f"w{i}" for i in range(n_fit + 1)]
    for k in keys:
        pager.register(k, np.zeros(gran // 4, np.float32))
    pager.ensure(keys[:n_fit])
    with pytest.raises(MemoryAllocation, match=f"value 'weight:{keys[-1]}'"):
        pager.ensure([keys[-1]])  # within the pager's budget, past the device's
    assert not pager.is_resident(keys[-1])
    pager.close()


# ---------------------------------------------------------------- the executor, end to end


def _model(nodes, inputs, outputs, inits=(), opset=21):
    g = helper.make_graph(nodes, "g", inputs, outputs, initializer=list(inits))
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", opset)], ir_version=10 if opset < 23 else 11)


def _vi(name, shape, elem=TensorProto.FLOAT):
    return helper.make_tensor_value_info(name, elem, shape)


def _out(rank):
    return [_vi("y", [f"d{i}" for i in range(rank)])]


def _c(name, value):
    return numpy_helper.from_array(np.asarray(value), name)


I64 = np.int64
F1 = {"x": np.ones((1,), np.float32)}
F4 = {"x": np.ones((1, 1, 2, 2), np.float32)}
X1 = [_vi("x", [1])]
X4 = [_vi("x", [1, 1, 2, 2])]

# (case, model, feeds, what the refusal names): the ops the fuzzer saw ask for 8 GiB to 256 TiB
CASES = {
    "ConstantOfShape": (_model([helper.make_node("ConstantOfShape", ["s"], ["y"], name="cos")], [], _out(2),
                               [_c("s", np.array([2**20, 2**20], I64))]), {}, "'y' float32[1048576, 1048576]"),
    "Expand": (_model([helper.make_node("Expand", ["x", "s"], ["y"], name="exp")], X1, _out(1),
                      [_c("s", np.array([2**40], I64))]), F1, "'y' float32[1099511627776]"),
    "Expand-int64-overflow": (_model([helper.make_node("Expand", ["x", "s"], ["y"], name="exp")], X1, _out(3),
                                     [_c("s", np.array([2**32, 2**32, 2**32], I64))]), F1,
                              "byte count overflows int64"),
    "Resize": (_model([helper.make_node("Resize", ["x", "", "sc"], ["y"], name="rs", mode="nearest")], X4, _out(4),
                      [_c("sc", np.array([1, 1, 1e6, 1e6], np.float32))]), F4, "'y' float32[1, 1, 2000000, 2000000]"),
    "OneHot": (_model([helper.make_node("OneHot", ["i", "d", "v"], ["y"], name="oh")],
                      [_vi("i", [2], TensorProto.INT64)], _out(2),
                      [_c("d", np.array(2**40, I64)), _c("v", np.array([0, 1], np.float32))]),
               {"i": np.array([0, 1], I64)}, "'y' float32[2, 1099511627776]"),
    "Pad": (_model([helper.make_node("Pad", ["x", "p"], ["y"], name="pad")], X1, _out(1),
                   [_c("p", np.array([0, 2**40], I64))]), F1, "'y' float32[1099511627777]"),
    "CenterCropPad": (_model([helper.make_node("CenterCropPad", ["x", "s"], ["y"], name="ccp")], X1, _out(1),
                             [_c("s", np.array([2**40], I64))]), F1, "'y' float32[1099511627776]"),
    "MaxPool": (_model([helper.make_node("MaxPool", ["x"], ["y"], name="mp", kernel_shape=[1, 1],
                                         pads=[2**20] * 4)], X4, _out(4)), F4, "'y' float32[1, 1, 2097154, 2097154]"),
    "HannWindow": (_model([helper.make_node("HannWindow", ["n"], ["y"], name="hw")], [], _out(1),
                          [_c("n", np.array(2**40, I64))]), {}, "'y' float32[1099511627776]"),
    # kernels whose temporaries dwarf their inputs and outputs: refused before the launch
    "DFT-matrix": (_model([helper.make_node("DFT", ["x", "l"], ["y"], name="dft")], [_vi("x", [1, 4, 1])], _out(3),
                          [_c("l", np.array(2**16, I64))]), {"x": np.ones((1, 4, 1), np.float32)},
                   "'dft:workspace' (kernel temporaries)"),
    "Resize-up-then-down": (_model([helper.make_node("Resize", ["x", "", "sc"], ["y"], name="rs", mode="nearest")],
                                   [_vi("x", [1, 1, 4, 2**16])], _out(4),
                                   [_c("sc", np.array([1, 1, 2**16, 2**-16], np.float32))]),
                            {"x": np.ones((1, 1, 4, 2**16), np.float32)}, "'rs:workspace' (kernel temporaries)"),
    "Attention-scores": (_model([helper.make_node("Attention", ["q", "k", "v"], ["y"], name="attn")],
                                [_vi(n, [1, 1, 2**15, 1]) for n in "qkv"], _out(4), opset=23),
                         {n: np.ones((1, 1, 2**15, 1), np.float32) for n in "qkv"},
                         "'attn:workspace' (kernel temporaries)"),
    "MaxPool-strided-pads": (_model([helper.make_node("MaxPool", ["x"], ["y"], name="mp", kernel_shape=[1, 1],
                                                      pads=[2**20] * 4, strides=[2**20] * 2)], X4, _out(4)), F4,
                             "'mp:workspace' (kernel temporaries)"),
}


def _add_model():
    return _model([helper.make_node("Add", ["a", "b"], ["y"], name="add")],
                  [_vi("a", ["n"]), _vi("b", ["n"])], [_vi("y", ["n"])])


@pytest.mark.parametrize("case", list(CASES))
def test_huge_outputs_are_refused_by_name_and_the_runtime_stays_usable(make_runtime, case):
    model, feeds, names = CASES[case]
    rt = _rt(make_runtime, limit=256 * MiB)
    ex = Executor(model, rt)
    held = rt.device.allocated_bytes
    node = model.graph.node[0].name
    launches = rt.counters.launches
    with pytest.raises(MemoryAllocation, match=rf"^cudaErrorMemoryAllocation: node '{node}': value .*") as exc:
        ex.run(feeds)
    assert exc.value.node == node
    assert rt.counters.launches == launches, "contract: refused before its launch (a GPU with room would run it)"
    assert names in str(exc.value)
    rt.drain_for_unmap()
    assert rt.device.allocated_bytes == held  # the failed run's temporaries went back
    a = np.arange(4, dtype=np.float32)
    got = Executor(_add_model(), rt).run({"a": a, "b": a})["y"]  # a following normal run succeeds
    np.testing.assert_array_equal(got, 2 * a)


def test_a_large_feed_is_refused_naming_the_input_not_the_last_node(make_runtime):
    rt = _rt(make_runtime, limit=8 * MiB)
    ex = Executor(_add_model(), rt)
    small = np.ones(4, np.float32)
    ex.run({"a": small, "b": small})
    rt.current_node = "Add_of_another_executor"  # prefill and decode executors share one runtime
    big = np.ones(4 * MiB, np.float32)  # 16 MiB
    with pytest.raises(MemoryAllocation, match=r"^cudaErrorMemoryAllocation: value 'a' float32\[4194304\]") as exc:
        ex.run({"a": big, "b": big})
    assert exc.value.node is None
    np.testing.assert_array_equal(ex.run({"a": small, "b": small})["y"], 2 * small)


def test_an_allocation_that_exactly_fills_the_budget_is_allowed(make_runtime):
    """Guarantee (Runtime.empty): the budget is inclusive: an allocation bringing the bytes in use
    to exactly ``memory_limit`` is allowed, one byte more is refused."""
    rt = _rt(make_runtime)
    room = rt.memory_limit - rt.device.allocated_bytes
    with pytest.raises(MemoryAllocation):
        rt.empty(room + 1, np.uint8, name="one_byte_too_many")
    t = rt.empty(room, np.uint8, name="exact")
    assert rt.device.allocated_bytes == rt.memory_limit
    rt.free(t)


# ---------------------------------------------------------------- the default budget under the process's limits

_UNDER_RLIMIT = r"""
import resource, sys
import numpy as np
from onnx import TensorProto, helper, numpy_helper
from lockstep.host_memory import _vm_size
from lockstep.reference_runtime.config import RuntimeConfig
from lockstep.reference_runtime.engine import RefEngine
from lockstep.reference_runtime.errors import MemoryAllocation

n = 32 << 20  # 128 MiB of float32 per output; eight outputs, all kept (graph outputs): 1 GiB
shape = numpy_helper.from_array(np.array([n], np.int64), "shape")
nodes = [helper.make_node("Expand", ["x", "shape"], ["e0"])]
nodes += [helper.make_node("Add", [f"e{i}", "x"], [f"e{i + 1}"]) for i in range(7)]
g = helper.make_graph(nodes, "expand_chain", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1])],
                      [helper.make_tensor_value_info(f"e{i}", TensorProto.FLOAT, [n]) for i in range(8)], [shape])
model = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])
engine = RefEngine("sim", RuntimeConfig())  # the default budget: what this issue is about
run = engine.prepare(model)
soft = _vm_size() + (512 << 20)  # 512 MiB of address space above what the process maps now
resource.setrlimit(resource.RLIMIT_AS, (soft, resource.getrlimit(resource.RLIMIT_AS)[1]))
run = RefEngine("sim", RuntimeConfig()).prepare(model)  # a runtime built under the limit
try:
    run({"x": np.ones(1, np.float32)})
    print("ran")
except MemoryAllocation as exc:
    print("refused:", exc)
except MemoryError as exc:
    print("host MemoryError:", exc)
"""


def test_the_default_budget_refuses_before_an_address_space_limit_does():
    """Guarantee (SimDevice.default_memory_limit under RLIMIT_AS, issue 29): with 512 MiB of
    address space left, a model that holds 1 GiB of device values is refused by the device budget
    (``MemoryAllocation`` naming the budget and what bounds it), not ended by the host's
    ``MemoryError`` (what a budget of a quarter of the host's RAM did)."""
    import os
    import subprocess
    import sys

    env = {**os.environ, "OPENBLAS_NUM_THREADS": "1", "OMP_NUM_THREADS": "1"}
    env.pop("LOCKSTEP_DEVICE_MEMORY_LIMIT", None)
    proc = subprocess.run([sys.executable, "-c", _UNDER_RLIMIT], capture_output=True, text=True, env=env, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    out = proc.stdout.strip().splitlines()[-1]
    assert out.startswith("refused:") and "device memory budget" in out, \
        f"contract: the device budget refuses first (not the host: 'cannot back it', MemoryError); got {out!r}"
    assert "address space left under RLIMIT_AS" in out, f"result: the refusal says what bounds the budget: {out}"
