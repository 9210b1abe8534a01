"""The fp32 oracle and its float64 cross-check.

The oracle is onnx's reference evaluator (numpy, nobody's runtime under test) on the fp32 variant
of a golden model, with the ONNX Runtime contrib ops exporters write added in float64
(``contrib_oracle``): an fp32 export of ONNX Runtime GenAI's builder or Optimum's O2 is its own
oracle. Its logits are cross-checked by lockstep's reference-runtime kernels running the same function in
float64 (``crosscheck``; for a built-in model the decomposed flavour, since the fused opset-23 ops do
not all accept float64); regeneration fails if they disagree. Both stream the model
(``stream``): each weight is read, and converted where the model is a retyped view (an fp16 model
upcast to fp32; float32 made float64), at the node that reads it, never held all at once.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import onnx
from onnx import TensorProto, numpy_helper

from .stream import StreamEvaluator, StreamModel, proto_of, retype_structure

__all__ = ["ORACLE", "oracle_logits", "float64_logits", "as_float64", "retyped", "greedy_oracle", "stepped_greedy",
           "StreamModel"]

ORACLE = {"name": "onnx.reference.ReferenceEvaluator", "version": onnx.__version__}


def _feeds(model, ids: list[int], io=None) -> dict[str, np.ndarray]:
    """A prefill of ``ids`` from position 0 with an empty (or zeroed fixed-capacity) cache."""
    from lockstep.decoder_io import DecoderIO

    io = io or DecoderIO.of(proto_of(model))
    feeds = io.step_feeds(ids, 0)
    feeds.update(io.empty_caches())
    return feeds


def _evaluator(model_fp32: onnx.ModelProto):
    """onnx's reference evaluator with ONNX Runtime's contrib ops added (``contrib_oracle``: float64
    numpy, the default-domain SimplifiedLayerNormalization included), over the whole model, its
    weights loaded (what ``stream.StreamEvaluator`` computes without holding them); a node neither
    implements is ``OracleUnsupported``, one line naming the op and the node, before anything runs."""
    from onnx.reference import ReferenceEvaluator

    from .contrib_oracle import CONTRIB_OPS, check_supported

    check_supported(model_fp32)
    return ReferenceEvaluator(model_fp32, new_ops=CONTRIB_OPS)


def oracle_logits(model_fp32: onnx.ModelProto | StreamModel, ids: list[int], io=None, evaluator: StreamEvaluator | None = None) -> np.ndarray:
    """Logits [len(ids), vocab] of one prefill of ``ids``, from onnx's reference kernels (streamed:
    ``stream.StreamEvaluator``, bit-identical to ``ReferenceEvaluator.run``)."""
    from lockstep.decoder_io import DecoderIO

    io = io or DecoderIO.of(proto_of(model_fp32))
    ev = evaluator or StreamEvaluator(model_fp32)
    (logits,) = ev.run([io.logits], _feeds(model_fp32, ids, io))
    return np.asarray(logits[0], np.float64)


def greedy_oracle(model_fp32: onnx.ModelProto | StreamModel, prompt: list[int], n: int, io=None) -> list[int]:
    """The oracle's greedy continuation (a full prefill per token: slow, exact, no cache involved)."""
    from lockstep.decoder_io import DecoderIO

    io = io or DecoderIO.of(proto_of(model_fp32))
    ev = StreamEvaluator(model_fp32)
    ids = list(prompt)
    for _ in range(n):
        (logits,) = ev.run([io.logits], _feeds(model_fp32, ids, io))
        ids.append(int(np.argmax(logits[0, -1])))
    return ids[len(prompt):]


def stepped_greedy(model_fp32: onnx.ModelProto | StreamModel, prompt: list[int], n: int, io=None) -> list[int] | None:
    """The oracle's greedy continuation with a KV cache: one prefill of the prompt, then one step per
    token, each step's presents fed back as the next step's pasts (``DecoderIO.step_feeds``, as
    ``decoding.HostKVSession`` feeds an engine: a fixed-capacity or shared buffer is fed back whole).
    Its tokens can differ from ``greedy_oracle``'s only at fp32 near-ties (the caller checks each
    choice's margin in one prefill, ``anchors._greedy_prefix``). None where the model cannot be
    stepped as it is (a growing graph given a capacity by its card: the oracle runs it a prefill a token)."""
    from lockstep.decoder_io import DecoderIO
    from lockstep.shared_buffer import appends

    proto = proto_of(model_fp32)
    io = io or DecoderIO.of(proto)
    if io.capacity and appends(proto, io):
        return None
    ev = StreamEvaluator(model_fp32)
    names = [io.logits] + [io.present_of[p] for p in io.pasts]
    cache, position, step, out = io.empty_caches(), 0, list(prompt), []
    for _ in range(n):
        io.check_room(position, len(step))
        logits, *presents = ev.run(names, {**io.step_feeds(step, position), **cache})
        out.append(int(np.argmax(logits[0, -1])))
        cache = dict(zip(io.pasts, presents))
        position, step = position + len(step), [out[-1]]
    return out


def retyped(model: onnx.ModelProto, src: int, dst: int) -> onnx.ModelProto:
    """The same graph with every ``src`` floating-point tensor, value and Cast target made ``dst``
    (float16 -> float32 upcasts an fp16 model's weights exactly: its fp32 computation). A copy of
    the whole proto: the oracle streams ``StreamModel.retyped`` instead (the same function, each
    weight converted where it is read)."""
    np_dst = onnx.helper.tensor_dtype_to_np_dtype(dst)
    m = onnx.ModelProto()
    m.CopyFrom(model)
    for t in m.graph.initializer:
        if t.data_type == src:
            t.CopyFrom(numpy_helper.from_array(numpy_helper.to_array(t).astype(np_dst), t.name))
    retype_structure(m, src, dst)
    return m


def as_float64(model: onnx.ModelProto) -> onnx.ModelProto:
    """The same graph with every float32 tensor, value and Cast target made float64."""
    return retyped(model, TensorProto.FLOAT, TensorProto.DOUBLE)


def float64_logits(model_fp32: onnx.ModelProto | StreamModel, ids: list[int], io=None) -> np.ndarray:
    """Logits of one prefill in float64 on lockstep's reference-runtime kernels, streamed
    (``crosscheck.Float64Stream``: each weight made float64 at the node reading it); a model with
    control flow or host values on the executor, whole (``float64_logits_executor``)."""
    from lockstep.decoder_io import DecoderIO

    from .crosscheck import Float64Stream, streamable

    proto = proto_of(model_fp32)
    io = io or DecoderIO.of(proto)
    if not streamable(proto):
        return float64_logits_executor(model_fp32, ids, io)
    (logits,) = Float64Stream(model_fp32).run([io.logits], _feeds(model_fp32, ids, io))
    return np.asarray(logits[0], np.float64)


def float64_logits_executor(model_fp32: onnx.ModelProto | StreamModel, ids: list[int], io=None) -> np.ndarray:
    """Logits of one prefill on the reference runtime (simulated device) in float64, the whole model
    converted (``as_float64``: a copy of every weight; for the models ``Float64Stream`` does not run)."""
    from lockstep.reference_runtime import Runtime, RuntimeConfig
    from lockstep.reference_runtime.backends.sim import SimDevice
    from lockstep.reference_runtime.executor import Executor

    from lockstep.decoder_io import DecoderIO

    if isinstance(model_fp32, StreamModel):  # (a control-flow or host-value model: whole, as before streaming)
        model_fp32 = model_fp32.whole()
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
