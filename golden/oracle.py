"""The fp32 oracle and its float64 cross-check.

The oracle is onnx's reference evaluator (numpy, nobody's runtime under test) on the fp32 variant
of a golden model, with the ONNX Runtime contrib ops exporters write added in float64
(``contrib_oracle``): an fp32 export of ONNX Runtime GenAI's builder or Optimum's O2 is its own
oracle. Its logits are cross-checked by lockstep's reference runtime on the simulated device running
the same function in float64 (the decomposed flavour, converted to float64, since the fused
opset-23 ops do not all accept float64); regeneration fails if they disagree.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import onnx
from onnx import TensorProto, numpy_helper

__all__ = ["ORACLE", "oracle_logits", "float64_logits", "as_float64", "retyped", "greedy_oracle"]

ORACLE = {"name": "onnx.reference.ReferenceEvaluator", "version": onnx.__version__}


def _feeds(model: onnx.ModelProto, ids: list[int], io=None) -> dict[str, np.ndarray]:
    """A prefill of ``ids`` from position 0 with an empty (or zeroed fixed-capacity) cache."""
    from lockstep.decoder_io import DecoderIO

    io = io or DecoderIO.of(model)
    feeds = io.step_feeds(ids, 0)
    feeds.update(io.empty_caches())
    return feeds


def _evaluator(model_fp32: onnx.ModelProto):
    """onnx's reference evaluator with ONNX Runtime's contrib ops added (``contrib_oracle``: float64
    numpy, the default-domain SimplifiedLayerNormalization included); a node neither implements is
    ``OracleUnsupported``, one line naming the op and the node, before anything runs."""
    from onnx.reference import ReferenceEvaluator

    from .contrib_oracle import CONTRIB_OPS, check_supported

    check_supported(model_fp32)
    return ReferenceEvaluator(model_fp32, new_ops=CONTRIB_OPS)


def oracle_logits(model_fp32: onnx.ModelProto, ids: list[int], io=None) -> np.ndarray:
    """Logits [len(ids), vocab] of one prefill of ``ids``, from onnx's reference evaluator."""
    from lockstep.decoder_io import DecoderIO

    io = io or DecoderIO.of(model_fp32)
    (logits,) = _evaluator(model_fp32).run([io.logits], _feeds(model_fp32, ids, io))
    return np.asarray(logits[0], np.float64)


def greedy_oracle(model_fp32: onnx.ModelProto, prompt: list[int], n: int, io=None) -> list[int]:
    """The oracle's greedy continuation (a full prefill per token: slow, exact, no cache involved)."""
    from lockstep.decoder_io import DecoderIO

    io = io or DecoderIO.of(model_fp32)
    ev = _evaluator(model_fp32)
    ids = list(prompt)
    for _ in range(n):
        (logits,) = ev.run([io.logits], _feeds(model_fp32, ids, io))
        ids.append(int(np.argmax(logits[0, -1])))
    return ids[len(prompt):]


def retyped(model: onnx.ModelProto, src: int, dst: int) -> onnx.ModelProto:
    """The same graph with every ``src`` floating-point tensor, value and Cast target made ``dst``
    (float16 -> float32 upcasts an fp16 model's weights exactly: its fp32 computation)."""
    np_dst = onnx.helper.tensor_dtype_to_np_dtype(dst)
    m = onnx.ModelProto()
    m.CopyFrom(model)
    g = m.graph
    for t in g.initializer:
        if t.data_type == src:
            t.CopyFrom(numpy_helper.from_array(numpy_helper.to_array(t).astype(np_dst), t.name))
    for vi in [*g.input, *g.output, *g.value_info]:
        if vi.type.tensor_type.elem_type == src:
            vi.type.tensor_type.elem_type = dst
    for n in g.node:
        for a in n.attribute:
            if a.name == "to" and a.i == src:
                a.i = dst
            if a.type == onnx.AttributeProto.TENSOR and a.t.data_type == src:
                a.t.CopyFrom(numpy_helper.from_array(numpy_helper.to_array(a.t).astype(np_dst), a.t.name))
    return m


def as_float64(model: onnx.ModelProto) -> onnx.ModelProto:
    """The same graph with every float32 tensor, value and Cast target made float64."""
    return retyped(model, TensorProto.FLOAT, TensorProto.DOUBLE)


def float64_logits(model_fp32: onnx.ModelProto, ids: list[int], io=None) -> np.ndarray:
    """Logits of one prefill on the reference runtime (simulated device) in float64."""
    from lockstep.reference_runtime import Runtime, RuntimeConfig
    from lockstep.reference_runtime.backends.sim import SimDevice
    from lockstep.reference_runtime.executor import Executor

    from lockstep.decoder_io import DecoderIO

    model = as_float64(model_fp32)
    io = io or DecoderIO.of(model_fp32)
    budget = RuntimeConfig.from_env().device_memory_limit  # LOCKSTEP_DEVICE_MEMORY_LIMIT, for large models
    ex = Executor(model, Runtime(SimDevice(), RuntimeConfig(device_memory_limit=budget)))
    feeds = {k: (v.astype(np.float64) if v.dtype == np.float32 else v) for k, v in _feeds(model_fp32, ids, io).items()}
    return np.asarray(ex.run(feeds)[io.logits][0], np.float64)


def decomposed_twin(spec):
    """The fp32, decomposed-flavour model computing the same function as ``spec``."""
    from .models.build import build

    return build(dataclasses.replace(spec, dtype="float32", flavour="decomposed", near_tie=spec.near_tie))
