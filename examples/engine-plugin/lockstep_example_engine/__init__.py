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

Two more switches (``BUGS``), each a bug that only some checks can see:
``make_mask_buggy_engine``: a decode step's attention mask is built from the cache before the
step's own key is in it, so it excludes the newest key; only a model whose mask reaches the
softmax without a query-attends-itself escape shows it (the golden ``*-mask`` models).
``make_gemm_buggy_engine``: a Gemm whose output is square comes back transposed (a row/column-major
mix-up the shapes cannot show); the square-products check (conformance/node_suite) fails.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx

from lockstep.engines import CaptureStats, Unsupported

__all__ = ["BUGS", "ExampleEngine", "make_buggy_engine", "make_engine", "make_gemm_buggy_engine",
           "make_mask_buggy_engine"]

# The operators this runtime implements (domain, op type): those of lockstep's golden models.
SUPPORTED = {("ai.onnx", op) for op in (
    "Add", "And", "Attention", "Cast", "Concat", "Equal", "Expand", "Gather", "Gemm", "LessOrEqual", "MatMul", "Mul",
    "Neg", "Or",
    "RMSNormalization", "Range", "Reciprocal", "ReduceMean", "ReduceSum", "Reshape", "RotaryEmbedding", "Shape",
    "Sigmoid", "Slice", "Softmax", "Sqrt", "Squeeze", "Sub", "TensorScatter", "Transpose", "Unsqueeze", "Where",
)} | {("com.microsoft", op) for op in ("GroupQueryAttention", "MatMulNBits", "SkipSimplifiedLayerNormalization")}


# The planted bugs (``ExampleEngine(bug=...)``), and the engine's name with each.
BUGS = {
    "position": ("example-buggy", "decode steps after the first use position ids one too far"),
    "mask": ("example-buggy-mask", "a decode step's attention mask excludes the newest key"),
    "gemm": ("example-buggy-gemm", "a Gemm whose output is square comes back transposed"),
}

# The tensor element types it implements.
DTYPES = {onnx.TensorProto.FLOAT, onnx.TensorProto.FLOAT16, onnx.TensorProto.INT64, onnx.TensorProto.INT32,
          onnx.TensorProto.INT8, onnx.TensorProto.UINT8, onnx.TensorProto.BOOL}


class ExampleEngine:
    """The engine protocol (``lockstep.engines.protocol``): name, available, prepare, and the
    optional decoder, precision, expectations and describe."""

    precision = {"float32": "fp32", "float16": "fp16"}
    expectations = Path(__file__).with_name("expectations.toml")  # its known node-suite failures

    def __init__(self, *, bug: str | None = None):
        if bug is not None and bug not in BUGS:
            raise ValueError(f"bug must be one of {sorted(BUGS)} or None, got {bug!r}")
        self.bug = bug
        self.name = BUGS[bug][0] if bug else "example"

    def available(self) -> tuple[bool, str]:
        try:
            import onnxruntime
        except ImportError as exc:
            return False, f"onnxruntime is not importable: {exc}"
        return True, f"example engine on onnxruntime {onnxruntime.__version__} (CPU)"

    def describe(self) -> dict[str, str]:
        import onnxruntime

        return {"onnxruntime": onnxruntime.__version__, "planted_bug": BUGS[self.bug][1] if self.bug else "none"}

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
        if self.bug == "gemm":
            model = _transpose_square_gemms(model)
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

        return ExampleDecoder(self._session(model), io or DecoderIO.of(model), bug=self.bug)


class ExampleDecoder:
    """Prefill and one-token steps with the KV cache in numpy arrays, feeding whatever roles the
    model has (Optimum, GenAI or lockstep's own convention) through ``io.step_feeds``."""

    def __init__(self, sess, io, *, bug: str | None = None):
        self.sess = sess
        self.io = io
        self.bug = bug
        self.outputs = [o.name for o in sess.get_outputs()]
        self.reset()

    def reset(self) -> None:
        self.cache = self.io.empty_caches()
        self.position = 0

    def forward(self, ids) -> np.ndarray:
        feeds = self.io.step_feeds(ids, self.position)
        if self.bug == "position" and len(ids) == 1 and self.position > 1 and self.io.position_ids:
            # the planted bug: the incremental path's position bookkeeping is off by one
            feeds[self.io.position_ids] = feeds[self.io.position_ids] + 1
        if self.bug == "mask" and len(ids) == 1 and self.position > 0 and self.io.attention_mask:
            # the planted bug: the step's mask counts the keys in the cache before its own is appended
            # (ones for the past, a zero for the step's own key)
            mask = feeds[self.io.attention_mask].copy()
            mask[:, self.position:] = 0
            feeds[self.io.attention_mask] = mask
        out = dict(zip(self.outputs, self.sess.run(None, {**feeds, **self.cache})))
        self.cache = {p: out[self.io.present_of[p]] for p in self.io.pasts}
        self.position += len(ids)
        return out[self.io.logits][0]

    def capture_stats(self) -> CaptureStats:
        return CaptureStats()  # no capture: all zeros


def _transpose_square_gemms(model: onnx.ModelProto) -> onnx.ModelProto:
    """The planted Gemm bug, as a graph rewrite: each Gemm's output goes through an If that
    transposes it when it is square (the shape of the result is right either way)."""
    from onnx import helper, shape_inference

    m = onnx.ModelProto()
    m.CopyFrom(model)
    g = m.graph
    inferred = shape_inference.infer_shapes(model).graph
    types = {vi.name: vi.type.tensor_type.elem_type for vi in [*g.output, *inferred.value_info]}

    def branch(op: str, src: str, out: str, elem: int) -> onnx.GraphProto:  # an If branch: op(src)
        return helper.make_graph([helper.make_node(op, [src], [out])], op.lower(), [],
                                 [helper.make_tensor_value_info(out, elem, None)])

    nodes = []
    for i, n in enumerate(g.node):
        nodes.append(n)
        if n.op_type != "Gemm" or n.domain not in ("", "ai.onnx"):
            continue
        y, raw = n.output[0], f"{n.output[0]}/example_gemm_{i}"
        n.output[0] = raw
        elem = types.get(y, onnx.TensorProto.FLOAT)
        index = [helper.make_tensor(f"{raw}/axis{d}", onnx.TensorProto.INT64, [], [d]) for d in (0, 1)]
        nodes += [
            helper.make_node("Shape", [raw], [f"{raw}/shape"]),
            *[helper.make_node("Constant", [], [f"{raw}/i{d}"], value=index[d]) for d in (0, 1)],
            *[helper.make_node("Gather", [f"{raw}/shape", f"{raw}/i{d}"], [f"{raw}/d{d}"]) for d in (0, 1)],
            helper.make_node("Equal", [f"{raw}/d0", f"{raw}/d1"], [f"{raw}/square"]),
            helper.make_node("If", [f"{raw}/square"], [y], then_branch=branch("Transpose", raw, f"{y}/t", elem),
                             else_branch=branch("Identity", raw, f"{y}/i", elem)),
        ]
    del g.node[:]
    g.node.extend(nodes)
    return m


def make_engine() -> ExampleEngine:
    """Entry point ``example``: the engine as shipped."""
    return ExampleEngine()


def make_buggy_engine() -> ExampleEngine:
    """``--engines lockstep_example_engine:make_buggy_engine``: the planted position bug."""
    return ExampleEngine(bug="position")


def make_mask_buggy_engine() -> ExampleEngine:
    """``--engines lockstep_example_engine:make_mask_buggy_engine``: decode steps mask out the newest key."""
    return ExampleEngine(bug="mask")


def make_gemm_buggy_engine() -> ExampleEngine:
    """``--engines lockstep_example_engine:make_gemm_buggy_engine``: square Gemm outputs come back transposed."""
    return ExampleEngine(bug="gemm")
