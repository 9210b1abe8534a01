"""The fp32 oracle and its float64 cross-check.

The oracle is onnx's reference evaluator (numpy, nobody's runtime under test) on the fp32 variant
of a golden model. Its logits are cross-checked by lockstep's reference runtime on the simulated
device running the same function in float64 (the decomposed flavour, converted to float64, since
the fused opset-23 ops do not all accept float64); regeneration fails if they disagree.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import onnx
from onnx import TensorProto, numpy_helper

__all__ = ["ORACLE", "oracle_logits", "float64_logits", "as_float64", "greedy_oracle"]

ORACLE = {"name": "onnx.reference.ReferenceEvaluator", "version": onnx.__version__}


def _feeds(model: onnx.ModelProto, ids: list[int]) -> dict[str, np.ndarray]:
    feeds: dict[str, np.ndarray] = {
        "input_ids": np.asarray([ids], np.int64),
        "position_ids": np.arange(len(ids), dtype=np.int64)[None, :],
    }
    for vi in model.graph.input:
        if vi.name.startswith("past_key_values."):
            dims = [d.dim_value for d in vi.type.tensor_type.shape.dim]
            dtype = onnx.helper.tensor_dtype_to_np_dtype(vi.type.tensor_type.elem_type)
            feeds[vi.name] = np.zeros((1, dims[1], dims[2], dims[3]), dtype)  # dims[2]: capacity, or 0 (growing)
    return feeds


def oracle_logits(model_fp32: onnx.ModelProto, ids: list[int]) -> np.ndarray:
    """Logits [len(ids), vocab] of one prefill of ``ids``, from onnx's reference evaluator."""
    from onnx.reference import ReferenceEvaluator

    ev = ReferenceEvaluator(model_fp32)
    (logits,) = ev.run(["logits"], _feeds(model_fp32, ids))
    return np.asarray(logits[0], np.float64)


def greedy_oracle(model_fp32: onnx.ModelProto, prompt: list[int], n: int) -> list[int]:
    """The oracle's greedy continuation (a full prefill per token: slow, exact, no cache involved)."""
    from onnx.reference import ReferenceEvaluator

    ev = ReferenceEvaluator(model_fp32)
    ids = list(prompt)
    for _ in range(n):
        (logits,) = ev.run(["logits"], _feeds(model_fp32, ids))
        ids.append(int(np.argmax(logits[0, -1])))
    return ids[len(prompt):]


def as_float64(model: onnx.ModelProto) -> onnx.ModelProto:
    """The same graph with every float32 tensor, value and Cast target made float64."""
    m = onnx.ModelProto()
    m.CopyFrom(model)
    g = m.graph
    for t in g.initializer:
        if t.data_type == TensorProto.FLOAT:
            t.CopyFrom(numpy_helper.from_array(numpy_helper.to_array(t).astype(np.float64), t.name))
    for vi in [*g.input, *g.output, *g.value_info]:
        if vi.type.tensor_type.elem_type == TensorProto.FLOAT:
            vi.type.tensor_type.elem_type = TensorProto.DOUBLE
    for n in g.node:
        for a in n.attribute:
            if a.name == "to" and a.i == TensorProto.FLOAT:
                a.i = TensorProto.DOUBLE
            if a.type == onnx.AttributeProto.TENSOR and a.t.data_type == TensorProto.FLOAT:
                a.t.CopyFrom(numpy_helper.from_array(numpy_helper.to_array(a.t).astype(np.float64), a.t.name))
    return m


def float64_logits(decomposed_fp32: onnx.ModelProto, ids: list[int]) -> np.ndarray:
    """Logits of one prefill on the reference runtime (simulated device) in float64."""
    from lockstep.reference_runtime import Runtime, RuntimeConfig
    from lockstep.reference_runtime.backends.sim import SimDevice
    from lockstep.reference_runtime.executor import Executor

    model = as_float64(decomposed_fp32)
    ex = Executor(model, Runtime(SimDevice(), RuntimeConfig()))
    return np.asarray(ex.run(_feeds(model, ids))["logits"][0], np.float64)


def decomposed_twin(spec):
    """The fp32, decomposed-flavour model computing the same function as ``spec``."""
    from .models.build import build

    return build(dataclasses.replace(spec, dtype="float32", flavour="decomposed", near_tie=spec.near_tie))
