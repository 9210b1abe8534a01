"""The reduced cases of ``docs/nxrt-findings.md``, built from code: one ONNX backend node case per finding
(one per mechanism where a finding has several) under ``docs/nxrt-findings/<name>/``, and ``MANIFEST.json``.

Each case is a model of one or a few nodes built here, its inputs written out or drawn from a seeded
generator, and its expected outputs computed by onnx's ``ReferenceEvaluator``: the specification's
arithmetic (ONNX Runtime's contrib operators through lockstep's contrib oracle, ``golden/contrib_oracle.py``,
checked against ONNX Runtime's CPU kernels), never by a runtime under test. ``MANIFEST.json`` says per
case: the finding, what it shows, the engines it fails on with the versions it was recorded on and how
it fails there (a wrong value, or an error and a piece of its message), and what verifies the expected
outputs: ``ort-cpu`` (ONNX Runtime 1.31's CPU provider passes the case) or ``onnx.reference`` where ONNX
Runtime 1.31 cannot run the model (with a piece of its refusal).

    python scripts/nxrt_findings.py           # rewrite every case folder and MANIFEST.json
    python scripts/nxrt_findings.py --check   # exit 1, naming what differs, if the committed files are not
                                              # what this code builds

``tests/test_nxrt_findings.py`` runs each case with lockstep's ``run_case``: it must fail on the engines
the manifest names (at the recorded versions) and pass on ort-cpu. The folders are what
``lockstep cases --cases-dir docs/nxrt-findings/<name> --engine nxrt-cpu`` reads.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import numpy as np
import onnx
from onnx import TensorProto as TP
from onnx import helper, numpy_helper

ROOT = Path(__file__).resolve().parent.parent
OUT = ROOT / "docs" / "nxrt-findings"
# the versions the findings were recorded on (the ``nxrt`` extra pins nxrt and nxrt-ep-cpu 0.1.0.dev6)
NXRT = "0.1.0.dev6"
EP_DEV5, EP_DEV6 = "0.1.0.dev5", "0.1.0.dev6"
RECORDED = {"nxrt": [NXRT], "nxrt-ep-cpu": [EP_DEV5, EP_DEV6], "onnxruntime": "1.31.1", "onnx": "1.23.2"}
MS = "com.microsoft"


@dataclass(frozen=True)
class Fails:
    """A case fails on ``engine`` (at ``versions`` of ``dist``) as ``outcome``: ``failed`` (a wrong value)
    or ``error`` (its message holds ``message``)."""

    engine: str
    dist: str
    versions: tuple[str, ...]
    outcome: str
    message: str = ""

    def record(self) -> dict:
        out = {"engine": self.engine, "dist": self.dist, "versions": list(self.versions), "outcome": self.outcome}
        if self.message:
            out["message"] = self.message
        return out


def cpu(outcome: str, message: str = "") -> Fails:
    return Fails("nxrt-cpu", "nxrt", (NXRT,), outcome, message)


def ep(outcome: str, message: str = "", versions: tuple[str, ...] = (EP_DEV5, EP_DEV6)) -> Fails:
    return Fails("nxrt-ep-cpu", "nxrt-ep-cpu", versions, outcome, message)


@dataclass(frozen=True)
class Case:
    name: str
    finding: str
    shows: str
    fails: tuple[Fails, ...]
    build: Callable[[], tuple[onnx.ModelProto, list[np.ndarray]]]
    verified: str = "ort-cpu"  # or "onnx.reference" (ONNX Runtime 1.31 cannot run it: ``ort_refuses``)
    ort_refuses: str = ""
    atol: float | None = None  # data.json's atol where onnx's default (1e-7) is below float32 rounding
    # the expected outputs written out, where onnx.reference does not implement the operator's version
    written: Callable[[], list[np.ndarray]] | None = None

    def record(self) -> dict:
        out = {"name": self.name, "finding": self.finding, "shows": self.shows,
               "fails": [f.record() for f in self.fails], "verified": self.verified,
               "expected": "written out" if self.written else "onnx.reference"}
        if self.ort_refuses:
            out["ort_refuses"] = self.ort_refuses
        return out


# --------------------------------------------------------------------------------------------------
# building blocks


def vi(name: str, elem: int, shape) -> onnx.ValueInfoProto:
    return helper.make_tensor_value_info(name, elem, shape)


def model(name: str, nodes, inputs, outputs, opset: int, inits=(), ms: bool = False) -> onnx.ModelProto:
    opsets = [helper.make_opsetid("", opset)] + ([helper.make_opsetid(MS, 1)] if ms else [])
    graph = helper.make_graph(nodes, name, inputs, outputs, initializer=list(inits))
    m = helper.make_model(graph, opset_imports=opsets, producer_name="scripts/nxrt_findings.py")
    m.ir_version = helper.find_min_ir_version_for([helper.make_opsetid("", opset)])
    return m


def const(name: str, values, dtype) -> onnx.TensorProto:
    return numpy_helper.from_array(np.asarray(values, dtype=dtype), name)


def rand(seed: int, *shape: int) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal(shape).astype(np.float32)


# --------------------------------------------------------------------------------------------------
# the cases, in the order of docs/nxrt-findings.md


def attention_window():
    """Attention-25, is_causal=1, left_window_size=1: query i sees keys i-1 and i. Q = K = 0 makes the
    weights uniform over what a query sees, so each output row is the mean of the visible V rows."""
    node = helper.make_node("Attention", ["Q", "K", "V"], ["Y"], name="attention", is_causal=1, left_window_size=1)
    shape = [1, 1, 4, 2]
    m = model("attention-window", [node], [vi(n, TP.FLOAT, shape) for n in "QKV"], [vi("Y", TP.FLOAT, shape)], 25)
    v = np.array([[0, 0], [1, 10], [2, 20], [3, 30]], np.float32).reshape(shape)
    return m, [np.zeros(shape, np.float32), np.zeros(shape, np.float32), v]


def spacetodepth_crd():
    node = helper.make_node("SpaceToDepth", ["x"], ["y"], name="space_to_depth", blocksize=2, mode="CRD")
    m = model("spacetodepth-crd", [node], [vi("x", TP.FLOAT, [1, 2, 2, 2])], [vi("y", TP.FLOAT, [1, 8, 1, 1])], 28)
    return m, [np.arange(8, dtype=np.float32).reshape(1, 2, 2, 2)]


def averagepool_ceil():
    """Windows [1, 2] and [3] (ceil_mode's extra window runs past the input's end): 1.5 and 3."""
    node = helper.make_node("AveragePool", ["x"], ["y"], name="average_pool", kernel_shape=[2], strides=[2],
                            ceil_mode=1, count_include_pad=1)
    m = model("averagepool-ceil-count-include-pad", [node], [vi("x", TP.FLOAT, [1, 1, 3])],
              [vi("y", TP.FLOAT, [1, 1, 2])], 19)
    return m, [np.array([[[1, 2, 3]]], np.float32)]


def ep_constantofshape():
    node = helper.make_node("ConstantOfShape", ["shape"], ["y"], name="constant_of_shape",
                            value=const("value", [1.0], np.float32))
    m = model("ep-constantofshape-value", [node], [vi("shape", TP.INT64, [2])], [vi("y", TP.FLOAT, [2, 3])], 21)
    return m, [np.array([2, 3], np.int64)]


def expand_runtime_shape():
    """Expand to a shape given at run time, read by the next node (Neg): the model's output is declared rank 2."""
    nodes = [helper.make_node("Expand", ["x", "shape"], ["expanded"], name="expand"),
             helper.make_node("Neg", ["expanded"], ["y"], name="neg")]
    m = model("expand-runtime-shape", nodes, [vi("x", TP.FLOAT, [1, 3]), vi("shape", TP.INT64, [2])],
              [vi("y", TP.FLOAT, ["a", "b"])], 21)
    return m, [np.array([[1, 2, 3]], np.float32), np.array([2, 3], np.int64)]


def expand_bool_runtime_shape():
    """Optimum's /model/Expand: a bool mask expanded to a shape computed at run time, read by the next node."""
    nodes = [helper.make_node("Expand", ["mask", "shape"], ["expanded"], name="expand"),
             helper.make_node("Not", ["expanded"], ["y"], name="not")]
    m = model("expand-bool-runtime-shape", nodes, [vi("mask", TP.BOOL, [1, 3]), vi("shape", TP.INT64, [2])],
              [vi("y", TP.BOOL, ["a", "b"])], 21)
    return m, [np.array([[True, False, True]]), np.array([2, 3], np.int64)]


def reshape_runtime_shape():
    """The builder's fp16 attn_mask_reformat: positions reshaped to [n, 1] (a shape computed at run time)
    and compared with the positions: a causal [n, n] mask."""
    nodes = [helper.make_node("Reshape", ["positions", "shape"], ["column"], name="reshape"),
             helper.make_node("Less", ["positions", "column"], ["y"], name="less")]
    m = model("reshape-runtime-shape", nodes, [vi("positions", TP.INT64, ["n"]), vi("shape", TP.INT64, [2])],
              [vi("y", TP.BOOL, ["n", "n"])], 21)
    return m, [np.arange(3, dtype=np.int64), np.array([3, 1], np.int64)]


def tensorscatter_write_indices():
    """lockstep's shared-buffer rewrite: write index = Squeeze(Slice(position_ids)[:, :1]), int64 throughout."""
    nodes = [helper.make_node("Slice", ["position_ids", "zero", "one", "one"], ["first"], name="first_position"),
             helper.make_node("Squeeze", ["first", "one"], ["write_index"], name="write_index"),
             helper.make_node("TensorScatter", ["past", "new", "write_index"], ["present"], name="present", axis=1)]
    inputs = [vi("past", TP.FLOAT, [1, 4, 2]), vi("new", TP.FLOAT, [1, 1, 2]), vi("position_ids", TP.INT64, [1, "s"])]
    m = model("tensorscatter-write-indices", nodes, inputs, [vi("present", TP.FLOAT, [1, 4, 2])], 24,
              inits=[const("zero", [0], np.int64), const("one", [1], np.int64)])
    past = np.arange(8, dtype=np.float32).reshape(1, 4, 2)
    return m, [past, np.full((1, 1, 2), -1, np.float32), np.array([[2]], np.int64)]


def constantofshape_runtime_shape():
    """LayerNormalization's expansion: an int64 ConstantOfShape of a computed shape, read by the next node."""
    nodes = [helper.make_node("ConstantOfShape", ["shape"], ["ones"], name="constant_of_shape",
                              value=const("value", [1], np.int64)),
             helper.make_node("Add", ["ones", "ones"], ["y"], name="add")]
    m = model("constantofshape-runtime-shape", nodes, [vi("shape", TP.INT64, [1])], [vi("y", TP.INT64, ["a"])], 21)
    return m, [np.array([3], np.int64)]


def reduce_runtime_axes(op: str, name: str):
    def build():
        nodes = [helper.make_node(op, ["x", "axes"], ["reduced"], name=op.lower(), keepdims=1),
                 helper.make_node("Neg", ["reduced"], ["y"], name="neg")]
        m = model(name, nodes, [vi("x", TP.FLOAT, [3, 4]), vi("axes", TP.INT64, [1])], [vi("y", TP.FLOAT, ["a", "b"])], 18)
        return m, [np.arange(12, dtype=np.float32).reshape(3, 4), np.array([1], np.int64)]

    return build


def squeeze_runtime_axes():
    nodes = [helper.make_node("Squeeze", ["x", "axes"], ["squeezed"], name="squeeze"),
             helper.make_node("Neg", ["squeezed"], ["y"], name="neg")]
    m = model("squeeze-runtime-axes", nodes, [vi("x", TP.FLOAT, [3, 1]), vi("axes", TP.INT64, [1])],
              [vi("y", TP.FLOAT, ["a"])], 21)
    return m, [np.array([[1], [2], [3]], np.float32), np.array([1], np.int64)]


def range_runtime_limit():
    """The window functions' expansion: Range(0, n, 1) with n computed at run time, then scaled."""
    nodes = [helper.make_node("Range", ["zero", "n", "one"], ["r"], name="range"),
             helper.make_node("Mul", ["r", "n"], ["y"], name="mul")]
    m = model("range-runtime-limit", nodes, [vi("n", TP.FLOAT, [])], [vi("y", TP.FLOAT, ["a"])], 21,
              inits=[const("zero", 0, np.float32), const("one", 1, np.float32)])
    return m, [np.array(4, np.float32)]


def unique():
    node = helper.make_node("Unique", ["x"], ["y"], name="unique")
    m = model("unique", [node], [vi("x", TP.INT64, [4])], [vi("y", TP.INT64, ["a"])], 21)
    return m, [np.array([2, 1, 1, 3], np.int64)]


def clip_min_above_max():
    node = helper.make_node("Clip", ["x", "min", "max"], ["y"], name="clip")
    m = model("clip-min-greater-than-max", [node],
              [vi("x", TP.FLOAT, [3]), vi("min", TP.FLOAT, []), vi("max", TP.FLOAT, [])], [vi("y", TP.FLOAT, [3])], 13)
    return m, [np.array([-1, 0, 1], np.float32), np.array(2, np.float32), np.array(1, np.float32)]


def scan_sequence_lens():
    """Scan-8 (a running sum) with its optional first input, sequence_lens, omitted. Expected outputs
    written out (``scan_sums``): onnx.reference runs Scan-9's signature, without sequence_lens."""
    body = helper.make_graph(
        [helper.make_node("Add", ["sum_in", "x_t"], ["sum_out"], name="add"),
         helper.make_node("Identity", ["sum_out"], ["y_t"], name="identity")], "body",
        [vi("sum_in", TP.FLOAT, [1]), vi("x_t", TP.FLOAT, [1])], [vi("sum_out", TP.FLOAT, [1]), vi("y_t", TP.FLOAT, [1])])
    node = helper.make_node("Scan", ["", "initial", "x"], ["total", "partial"], name="scan", num_scan_inputs=1,
                            body=body)
    m = model("scan-sequence-lens", [node], [vi("initial", TP.FLOAT, [1, 1]), vi("x", TP.FLOAT, [1, 3, 1])],
              [vi("total", TP.FLOAT, [1, 1]), vi("partial", TP.FLOAT, [1, 3, 1])], 8)
    return m, [np.zeros((1, 1), np.float32), np.array([1, 2, 3], np.float32).reshape(1, 3, 1)]


def scan_sums() -> list[np.ndarray]:
    return [np.array([[6]], np.float32), np.array([1, 3, 6], np.float32).reshape(1, 3, 1)]


def matmulnbits_float_zero_points():
    """4-bit weights, N=2, K=16, one block per column, float zero points (ONNX Runtime's schema: T1 or uint8)."""
    n, k, block = 2, 16, 16
    weights = np.random.default_rng(11).integers(0, 256, (n, k // block, block // 2), dtype=np.uint8)
    node = helper.make_node("MatMulNBits", ["A", "B", "scales", "zero_points"], ["Y"], name="matmul_nbits",
                            domain=MS, K=k, N=n, bits=4, block_size=block)
    inits = [numpy_helper.from_array(weights, "B"), const("scales", [0.5, 0.25], np.float32),
             const("zero_points", [8.0, 7.5], np.float32)]
    m = model("matmulnbits-float-zero-points", [node], [vi("A", TP.FLOAT, [1, k])], [vi("Y", TP.FLOAT, [1, n])], 21,
              inits=inits, ms=True)
    return m, [rand(12, 1, k)]


def ep_gqa_shared_buffer():
    """One decode step into a 4-row shared past/present buffer holding 2 rows (ONNX Runtime's
    past_present_share_buffer form: the present is the buffer, 4 rows)."""
    nq, nkv, head, s, past, cap = 2, 1, 8, 1, 2, 4
    node = helper.make_node("GroupQueryAttention", ["q", "k", "v", "past_key", "past_value", "seqlens_k",
                                                    "total_sequence_length"], ["y", "present_key", "present_value"],
                            name="group_query_attention", domain=MS, num_heads=nq, kv_num_heads=nkv)
    cache = [1, nkv, cap, head]
    inputs = [vi("q", TP.FLOAT, [1, s, nq * head]), vi("k", TP.FLOAT, [1, s, nkv * head]),
              vi("v", TP.FLOAT, [1, s, nkv * head]), vi("past_key", TP.FLOAT, cache), vi("past_value", TP.FLOAT, cache),
              vi("seqlens_k", TP.INT32, [1]), vi("total_sequence_length", TP.INT32, [])]
    outputs = [vi("y", TP.FLOAT, [1, s, nq * head]), vi("present_key", TP.FLOAT, cache),
               vi("present_value", TP.FLOAT, cache)]
    m = model("ep-gqa-shared-buffer", [node], inputs, outputs, 21, ms=True)
    past_k, past_v = np.zeros(cache, np.float32), np.zeros(cache, np.float32)
    past_k[:, :, :past], past_v[:, :, :past] = rand(21, 1, nkv, past, head), rand(22, 1, nkv, past, head)
    feeds = [rand(23, 1, s, nq * head), rand(24, 1, s, nkv * head), rand(25, 1, s, nkv * head), past_k, past_v,
             np.array([past + s - 1], np.int32), np.array(past + s, np.int32)]
    return m, feeds


def ep_empty_output():
    node = helper.make_node("Slice", ["x", "starts", "ends", "axes"], ["y"], name="slice")
    m = model("ep-empty-output", [node], [vi("x", TP.FLOAT, [2, 3])], [vi("y", TP.FLOAT, [2, 0])], 13,
              inits=[const("starts", [5], np.int64), const("ends", [10], np.int64), const("axes", [1], np.int64)])
    return m, [np.arange(6, dtype=np.float32).reshape(2, 3)]


def causalconv_present_state():
    """CausalConvWithState-27, kernel 3, no past: present_state keeps the last kernel-1 = 2 steps."""
    node = helper.make_node("CausalConvWithState", ["input", "weight"], ["output", "present_state"],
                            name="causal_conv")
    m = model("causalconv-present-state", [node], [vi("input", TP.FLOAT, [1, 2, 4]), vi("weight", TP.FLOAT, [2, 1, 3])],
              [vi("output", TP.FLOAT, [1, 2, 4]), vi("present_state", TP.FLOAT, [1, 2, 2])], 27)
    return m, [np.arange(8, dtype=np.float32).reshape(1, 2, 4), np.array([1, 0, 0, 0, 1, 1], np.float32).reshape(2, 1, 3)]


def linearattention_omitted_past():
    """LinearAttention-27, gated rule, its optional past_state omitted ("") and decay given."""
    node = helper.make_node("LinearAttention", ["query", "key", "value", "", "decay"], ["output", "present_state"],
                            name="linear_attention", q_num_heads=1, kv_num_heads=1, update_rule="gated")
    shape = [1, 2, 2]
    inputs = [vi(n, TP.FLOAT, shape) for n in ("query", "key", "value", "decay")]
    m = model("linearattention-omitted-past-state", [node], inputs,
              [vi("output", TP.FLOAT, shape), vi("present_state", TP.FLOAT, [1, 1, 2, 2])], 27)
    decay = np.full(shape, -0.5, np.float32)
    return m, [rand(31, *shape), rand(32, *shape), rand(33, *shape), decay]


def ep_matmul_1d():
    node = helper.make_node("MatMul", ["a", "b"], ["c"], name="matmul")
    m = model("ep-matmul-1d", [node], [vi("a", TP.FLOAT, [2]), vi("b", TP.FLOAT, [1, 2, 1])],
              [vi("c", TP.FLOAT, [1, 1])], 13)
    return m, [np.array([1, 2], np.float32), np.array([3, 4], np.float32).reshape(1, 2, 1)]


def ep_gathernd_batch_dims():
    node = helper.make_node("GatherND", ["data", "indices"], ["y"], name="gather_nd", batch_dims=1)
    m = model("ep-gathernd-batch-dims", [node], [vi("data", TP.FLOAT, [2, 2, 2]), vi("indices", TP.INT64, [2, 1])],
              [vi("y", TP.FLOAT, [2, 2])], 13)
    return m, [np.arange(8, dtype=np.float32).reshape(2, 2, 2), np.array([[1], [0]], np.int64)]


def ep_reshape_allowzero():
    node = helper.make_node("Reshape", ["data", "shape"], ["y"], name="reshape", allowzero=1)
    m = model("ep-reshape-allowzero", [node], [vi("data", TP.FLOAT, [0, 3, 4])], [vi("y", TP.FLOAT, [3, 4, 0])], 21,
              inits=[const("shape", [3, 4, 0], np.int64)])
    return m, [np.zeros((0, 3, 4), np.float32)]


def ep_dropout_mask():
    node = helper.make_node("Dropout", ["x"], ["y", "mask"], name="dropout")
    m = model("ep-dropout-mask", [node], [vi("x", TP.FLOAT, [2, 3])],
              [vi("y", TP.FLOAT, [2, 3]), vi("mask", TP.BOOL, [2, 3])], 22)
    return m, [np.arange(6, dtype=np.float32).reshape(2, 3)]


ORT_OPSET = "newer than this engine accepts"  # ONNX Runtime 1.31 refuses the opset (27, 28) or its IR version (13, 14)

CASES: tuple[Case, ...] = (
    Case("attention-window", "F1", "Attention-25's left_window_size (and right_window_size) ignored: nxrt-cpu "
         "attends to every causal key, [0, 0.5, 1, 1.5] where the window gives [0, 0.5, 1.5, 2.5]",
         (cpu("failed"),), attention_window, "onnx.reference", "Unrecognized attribute: left_window_size"),
    Case("spacetodepth-crd", "F2", "SpaceToDepth-28 mode=CRD computed as DCR: [0, 4, 1, 5, 2, 6, 3, 7] where CRD "
         "gives [0, 1, ..., 7]", (cpu("failed"),), spacetodepth_crd, "onnx.reference", ORT_OPSET),
    Case("averagepool-ceil-count-include-pad", "F3", "AveragePool ceil_mode=1, count_include_pad=1: the window "
         "ceil_mode adds past the input's end divided by the whole kernel, 1.5 where the spec (and ORT) give 3",
         (cpu("failed"),), averagepool_ceil),
    Case("ep-constantofshape-value", "F4", "nxrt-ep-cpu 0.1.0.dev6's ConstantOfShape ignores `value`: zeros where "
         "value=1.0 gives ones", (ep("failed", versions=(EP_DEV6,)),), ep_constantofshape),
    Case("expand-runtime-shape", "F5", "Expand to a shape given at run time, then Neg: a 0-d tensor [-1.0] "
         "where the spec gives [[-1, -2, -3], [-1, -2, -3]]", (cpu("failed"),), expand_runtime_shape),
    Case("expand-bool-runtime-shape", "F5", "a bool Expand to a run-time shape typed float32, rank 0 by nxrt's "
         "inference: the error every Optimum export hits at /model/Expand",
         (cpu("error", "output byte count 4 does not match produced 1"),), expand_bool_runtime_shape),
    Case("reshape-runtime-shape", "F6", "an int64 Reshape of a symbolic-length input to a run-time shape typed "
         "float32: the next node refuses the mixed dtypes (the builder's fp16 CPU attn_mask_reformat)",
         (cpu("error", "all operands must share one dtype"),), reshape_runtime_shape),
    Case("tensorscatter-write-indices", "F7", "TensorScatter's int64 write index (Squeeze of a Slice of position_ids "
         "with a symbolic length) typed float32 by nxrt: the model is refused",
         (cpu("error", "write_indices must have Int64 dtype, got Float32"),), tensorscatter_write_indices),
    Case("constantofshape-runtime-shape", "F8", "an int64 ConstantOfShape of a run-time shape typed float32, rank 0 "
         "(LayerNormalization's expansion)", (cpu("error", "ConstantOfShape"),), constantofshape_runtime_shape),
    Case("reducesum-runtime-axes", "F8", "ReduceSum with its axes given as an input gets a rank-0 output "
         "(ReduceL2/LogSum/LogSumExp's expansions)", (cpu("error", "output element count 1 does not match produced 3"),),
         reduce_runtime_axes("ReduceSum", "reducesum-runtime-axes")),
    Case("reducemean-runtime-axes", "F8", "ReduceMean-18 with its axes given as an input gets a rank-0 output "
         "(RMSNormalization's expansion)", (cpu("error", "output element count 1 does not match produced 3"),),
         reduce_runtime_axes("ReduceMean", "reducemean-runtime-axes")),
    Case("squeeze-runtime-axes", "F8", "Squeeze with its axes given as an input gets a rank-0 output",
         (cpu("error", "output byte count 4 does not match produced 12"),), squeeze_runtime_axes),
    Case("range-runtime-limit", "F8", "Range whose limit is known only at run time: no shape to run it with "
         "(the window functions' expansions)", (cpu("error", "no inferred shape for value r produced by op Range"),),
         range_runtime_limit),
    Case("unique", "F8", "Unique, whose output length depends on the data, never runs",
         (cpu("error", "no inferred shape for value y produced by op Unique"),), unique),
    Case("clip-min-greater-than-max", "F9", "Clip with min > max raises where the spec gives max (1, 1, 1)",
         (cpu("error", "Clip: min must not exceed max"), ep("error", "Clip: min must not exceed max")),
         clip_min_above_max),
    Case("scan-sequence-lens", "F10", "Scan-8's omitted sequence_lens (its first input, \"\") read as an omitted "
         "initial state", (cpu("error", "an initial-state input is omitted"),), scan_sequence_lens,
         written=scan_sums),
    Case("matmulnbits-float-zero-points", "F11", "MatMulNBits with float zero points refused at run time, where "
         "ONNX Runtime's schema allows them and its CPU provider runs them",
         (cpu("error", "zero_points must have dtype Uint8, got Float32"),), matmulnbits_float_zero_points),
    Case("ep-gqa-shared-buffer", "F12", "GroupQueryAttention over a shared past/present buffer: nxrt-ep-cpu "
         "allocates a present of past + new rows, its kernel writes the buffer's 4",
         (ep("error", "output element count 40 does not match produced 32", versions=(EP_DEV6,)),),
         ep_gqa_shared_buffer, atol=1e-6),
    Case("ep-empty-output", "F13", "a node whose output is empty (Slice past the end: [2, 0]) fails in "
         "nxrt-ep-cpu's Compute", (ep("error", "data pointer is null"),), ep_empty_output),
    Case("causalconv-present-state", "F14", "CausalConvWithState-27's present_state inferred with the input's "
         "length (4) instead of kernel_size - 1 (2)", (cpu("error", "output element count 8 does not match produced 4"),),
         causalconv_present_state, "onnx.reference", ORT_OPSET),
    Case("linearattention-omitted-past-state", "F15", "LinearAttention-27 with past_state omitted (\"\") and decay "
         "given: the empty input is read as a past_state", (cpu("error", "past_state must be"),),
         linearattention_omitted_past, "onnx.reference", ORT_OPSET),
    Case("ep-matmul-1d", "F16", "MatMul of a 1-D by a 3-D tensor panics in nxrt-ep-cpu's shape inference",
         (ep("error", "internal panic"),), ep_matmul_1d),
    Case("ep-gathernd-batch-dims", "F17", "GatherND batch_dims=1: nxrt-ep-cpu allocates the batch_dims=0 output",
         (ep("error", "output byte count 32 does not match produced 16"),), ep_gathernd_batch_dims),
    Case("ep-reshape-allowzero", "F18", "Reshape allowzero=1 to a shape holding 0 refused by nxrt-ep-cpu's shape "
         "inference", (ep("error", "Reshape: invalid shape value 0"),), ep_reshape_allowzero),
    Case("ep-dropout-mask", "F19", "Dropout's mask output comes back empty (None) from nxrt-ep-cpu, all True by "
         "the spec", (ep("failed"),), ep_dropout_mask),
)


# --------------------------------------------------------------------------------------------------
# writing and checking


def expected(m: onnx.ModelProto, inputs: list[np.ndarray]) -> list[np.ndarray]:
    """The spec's outputs: onnx's ReferenceEvaluator (ONNX Runtime's contrib ops from lockstep's oracle)."""
    from onnx.reference import ReferenceEvaluator

    new_ops = None
    if any(n.domain == MS for n in m.graph.node):
        from lockstep.golden.contrib_oracle import contrib_ops

        new_ops = list(contrib_ops().values())
    names = [i.name for i in m.graph.input]
    return [np.asarray(x) for x in ReferenceEvaluator(m, new_ops=new_ops).run(None, dict(zip(names, inputs)))]


def write_case(case: Case, root: Path) -> None:
    m, inputs = case.build()
    onnx.checker.check_model(m)
    d = root / case.name
    data = d / "test_data_set_0"
    data.mkdir(parents=True)
    (d / "model.onnx").write_bytes(m.SerializeToString())
    for i, (v, x) in enumerate(zip(m.graph.input, inputs)):
        (data / f"input_{i}.pb").write_bytes(numpy_helper.from_array(x, v.name).SerializeToString())
    outputs = case.written() if case.written else expected(m, inputs)
    for i, (v, y) in enumerate(zip(m.graph.output, outputs)):
        (data / f"output_{i}.pb").write_bytes(numpy_helper.from_array(y, v.name).SerializeToString())
    if case.atol is not None:
        (d / "data.json").write_text(json.dumps({"rtol": 1e-3, "atol": case.atol}) + "\n")


def manifest() -> str:
    return json.dumps({"recorded": RECORDED, "cases": [c.record() for c in CASES]}, indent=1) + "\n"


def build(root: Path) -> None:
    for case in CASES:
        write_case(case, root)
    (root / "MANIFEST.json").write_text(manifest())


def _same(a: Path, b: Path) -> bool:
    """Byte-equal, or for expected outputs the same tensor up to float rounding (another numpy's arithmetic)."""
    x, y = a.read_bytes(), b.read_bytes()
    if x == y:
        return True
    if not a.name.startswith("output_"):
        return False
    ta, tb = onnx.TensorProto(), onnx.TensorProto()
    ta.ParseFromString(x)
    tb.ParseFromString(y)
    u, v = numpy_helper.to_array(ta), numpy_helper.to_array(tb)
    return (ta.name == tb.name and u.dtype == v.dtype and u.shape == v.shape
            and bool(np.allclose(u, v, rtol=1e-6, atol=0, equal_nan=True)))


def differences(committed: Path = OUT) -> list[str]:
    """What differs between ``committed`` and what this code builds (empty: nothing)."""
    with tempfile.TemporaryDirectory() as tmp:
        fresh = Path(tmp) / "cases"
        fresh.mkdir()
        build(fresh)
        want = {p.relative_to(fresh).as_posix() for p in fresh.rglob("*") if p.is_file()}
        have = {p.relative_to(committed).as_posix() for p in committed.rglob("*") if p.is_file()} \
            if committed.is_dir() else set()
        out = [f"missing: {p}" for p in sorted(want - have)] + [f"not built by this script: {p}" for p in sorted(have - want)]
        out += [f"differs: {p}" for p in sorted(want & have) if not _same(fresh / p, committed / p)]
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--check", action="store_true", help="compare with the committed folders instead of writing")
    args = ap.parse_args(argv)
    if args.check:
        diff = differences()
        for line in diff:
            print(f"nxrt_findings: {line}")
        print(f"nxrt_findings: {len(CASES)} cases, {'up to date' if not diff else f'{len(diff)} difference(s)'}")
        return 1 if diff else 0
    if OUT.exists():
        shutil.rmtree(OUT)
    OUT.mkdir(parents=True)
    build(OUT)
    print(f"nxrt_findings: wrote {len(CASES)} cases and MANIFEST.json under {OUT.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
