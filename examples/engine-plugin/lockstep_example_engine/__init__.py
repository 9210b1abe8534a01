"""An example out-of-tree lockstep engine.

It stands for a team's own runtime: it implements a subset of ONNX (the operators of the golden
models; every other model is ``Unsupported`` with the operator it lacks), executes through ONNX
Runtime's CPU provider underneath, and has a decode session of its own whose KV cache lives in
numpy arrays between steps. It has no graph capture.

``make_engine`` (entry point ``example``) is the engine as shipped. ``make_buggy_engine`` plants a
realistic bug: decode steps after the first use position ids one too far (an off-by-one in the
position bookkeeping of the incremental path). The prefill is unaffected; the stepwise golden
lock and the tripwire fail, pointing at the first diverging position.

    lockstep check --engines example                                    # passes
    lockstep check --engines lockstep_example_engine:make_buggy_engine  # fails: position ...
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx

from lockstep.engines import CaptureStats, Unsupported

__all__ = ["ExampleEngine", "make_engine", "make_buggy_engine"]

# The operators this runtime implements (domain, op type): those of lockstep's golden models.
SUPPORTED = {("ai.onnx", op) for op in (
    "Add", "And", "Attention", "Cast", "Concat", "Equal", "Expand", "Gather", "Gemm", "LessOrEqual", "MatMul", "Mul",
    "Neg", "Or",
    "RMSNormalization", "Range", "Reciprocal", "ReduceMean", "ReduceSum", "Reshape", "RotaryEmbedding", "Shape",
    "Sigmoid", "Slice", "Softmax", "Sqrt", "Squeeze", "Sub", "TensorScatter", "Transpose", "Unsqueeze", "Where",
)} | {("com.microsoft", op) for op in ("GroupQueryAttention", "MatMulNBits", "SkipSimplifiedLayerNormalization")}


# The tensor element types it implements.
DTYPES = {onnx.TensorProto.FLOAT, onnx.TensorProto.FLOAT16, onnx.TensorProto.INT64, onnx.TensorProto.INT32,
          onnx.TensorProto.INT8, onnx.TensorProto.UINT8, onnx.TensorProto.BOOL}


class ExampleEngine:
    """The engine protocol (``lockstep.engines.protocol``): name, available, prepare, and the
    optional decoder, precision, expectations and describe."""

    precision = {"float32": "fp32", "float16": "fp16"}
    expectations = Path(__file__).with_name("expectations.toml")  # its known node-suite failures

    def __init__(self, *, position_bug: bool = False):
        self.position_bug = position_bug
        self.name = "example-buggy" if position_bug else "example"

    def available(self) -> tuple[bool, str]:
        try:
            import onnxruntime
        except ImportError as exc:
            return False, f"onnxruntime is not importable: {exc}"
        return True, f"example engine on onnxruntime {onnxruntime.__version__} (CPU)"

    def describe(self) -> dict[str, str]:
        import onnxruntime

        return {"onnxruntime": onnxruntime.__version__, "position_bug": str(self.position_bug)}

    def _session(self, model: onnx.ModelProto):
        import onnxruntime as ort

        missing = sorted({(n.domain or "ai.onnx", n.op_type) for n in model.graph.node} - SUPPORTED)
        if missing:
            raise Unsupported(f"{self.name}: no kernel for " + ", ".join(f"{d}::{op}" for d, op in missing))
        g = model.graph
        types = {v.type.tensor_type.elem_type for v in [*g.input, *g.output] if v.type.HasField("tensor_type")}
        types |= {t.data_type for t in g.initializer}
        for n in g.node:
            types |= {a.i for a in n.attribute if a.name == "to"}
        if types - DTYPES:
            names = sorted(onnx.TensorProto.DataType.Name(t) for t in types - DTYPES)
            raise Unsupported(f"{self.name}: tensor type(s) {names} not implemented")
        so = ort.SessionOptions()
        so.log_severity_level = 4
        try:
            return ort.InferenceSession(model.SerializeToString(), so, providers=["CPUExecutionProvider"])
        except Exception as exc:
            if "ir version" in str(exc).lower() or "opset" in str(exc).lower():
                raise Unsupported(f"{self.name}: {str(exc).splitlines()[0][:200]}") from exc
            raise

    def prepare(self, model: onnx.ModelProto):
        sess = self._session(model)
        names = [i.name for i in sess.get_inputs()]

        def run(feeds: dict[str, np.ndarray]) -> list[np.ndarray]:
            return sess.run(None, {n: feeds[n] for n in names})

        return run

    def decoder(self, model: onnx.ModelProto, *, capture: bool = False, io=None) -> "ExampleDecoder":
        """``io`` (lockstep.decoder_io.DecoderIO) says which input plays which role and builds each
        step's ids, mask and positions; lockstep passes it (detected, or from a model card)."""
        if capture:
            raise Unsupported(f"{self.name}: this runtime has no graph capture")
        from lockstep.decoder_io import DecoderIO

        return ExampleDecoder(self._session(model), io or DecoderIO.of(model), position_bug=self.position_bug)


class ExampleDecoder:
    """Prefill and one-token steps with the KV cache in numpy arrays, feeding whatever roles the
    model has (Optimum, GenAI or lockstep's own convention) through ``io.step_feeds``."""

    def __init__(self, sess, io, *, position_bug: bool):
        self.sess = sess
        self.io = io
        self.position_bug = position_bug
        self.outputs = [o.name for o in sess.get_outputs()]
        self.reset()

    def reset(self) -> None:
        self.cache = {p: self.io.empty_cache() for p in self.io.pasts}
        self.position = 0

    def forward(self, ids) -> np.ndarray:
        feeds = self.io.step_feeds(ids, self.position)
        if self.position_bug and len(ids) == 1 and self.position > 1 and self.io.position_ids:
            # the planted bug: the incremental path's position bookkeeping is off by one
            feeds[self.io.position_ids] = feeds[self.io.position_ids] + 1
        out = dict(zip(self.outputs, self.sess.run(None, {**feeds, **self.cache})))
        self.cache = {p: out[self.io.present_of[p]] for p in self.io.pasts}
        self.position += len(ids)
        return out[self.io.logits][0]

    def capture_stats(self) -> CaptureStats:
        return CaptureStats()  # no capture: all zeros


def make_engine() -> ExampleEngine:
    """Entry point ``example``: the engine as shipped."""
    return ExampleEngine()


def make_buggy_engine() -> ExampleEngine:
    """``--engines lockstep_example_engine:make_buggy_engine``: the planted position bug."""
    return ExampleEngine(position_bug=True)
