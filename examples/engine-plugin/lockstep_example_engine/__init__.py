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
``make_kv_buggy_engine``: the decode session stores each call's new cache rows one slot late (the
graph is right; ``prepare`` locates nothing): the stepwise lock fails and the ``locate --session``
command it prints names the first cache tensor fed out of band, at the first step after the prefill.
``make_softmax_buggy_engine``: a float16 Softmax without the max subtracted overflows where a score
passes 11.09 (``exp`` past float16's 65504: inf / inf); ``make_rope_buggy_engine``: RotaryEmbedding
with the halves of ``rotate_half`` swapped (the rotation runs backwards). The failing locks name the
Softmax and the RotaryEmbedding node.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx

from lockstep.engines import CaptureStats, Unsupported

__all__ = ["BUGS", "ExampleEngine", "make_buggy_engine", "make_engine", "make_gemm_buggy_engine",
           "make_kv_buggy_engine", "make_mask_buggy_engine", "make_rope_buggy_engine", "make_softmax_buggy_engine"]

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
    "kv-late": ("example-buggy-kv", "the decode session writes each call's new keys and values one slot late"),
    "softmax": ("example-buggy-softmax", "a float16 Softmax computes exp(x) / sum(exp(x)) without subtracting the max"),
    "rope": ("example-buggy-rope", "RotaryEmbedding rotates by the wrong half: concat(x2, -x1) for concat(-x2, x1)"),
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
        if self.bug in ("softmax", "rope"):
            model = _rewritten(model, self.bug)
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
        self._values: dict = {}

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
        if self.bug == "kv-late":
            self.cache = {p: _one_slot_late(c, self.position, len(ids), self.io.seq_axis) for p, c in self.cache.items()}
        self.position += len(ids)
        self._values = self.io.others(out)
        return out[self.io.logits][0]

    def values(self) -> dict:
        """The last call's outputs other than the logits and presents (optional in the protocol:
        ``lockstep locate --session`` judges them, with the caches fed and written)."""
        return dict(self._values)

    def capture_stats(self) -> CaptureStats:
        return CaptureStats()  # no capture: all zeros


def _one_slot_late(cache: np.ndarray, position: int, n: int, axis: int) -> np.ndarray:
    """The planted KV bug: the ``n`` rows written at ``position`` moved one slot later (the first
    stays empty; past the cache's end the last falls off)."""
    c = np.moveaxis(np.array(cache), axis, 0)
    new = c[position:position + n].copy()
    c[position] = 0
    end = min(position + n + 1, len(c))
    c[position + 1:end] = new[:end - position - 1]
    return np.moveaxis(c, 0, axis)


def _rewritten(model: onnx.ModelProto, bug: str) -> onnx.ModelProto:
    """The planted Softmax and RoPE bugs, as graph rewrites of the model the runtime executes."""
    from onnx import helper

    m = onnx.ModelProto()
    m.CopyFrom(model)
    g = m.graph
    fp16 = {v.name for v in [*g.input, *g.output, *g.value_info]
            if v.type.tensor_type.elem_type == onnx.TensorProto.FLOAT16}
    fp16 |= {t.name for t in g.initializer if t.data_type == onnx.TensorProto.FLOAT16}
    for n in g.node:  # float16 values downstream of a float16 value or a Cast to float16
        if any(i in fp16 for i in n.input) and n.op_type not in ("Cast", "Shape") or (
                n.op_type == "Cast" and any(a.name == "to" and a.i == onnx.TensorProto.FLOAT16 for a in n.attribute)):
            fp16.update(o for o in n.output if o)
    nodes = []
    for i, n in enumerate(g.node):
        if bug == "softmax" and n.op_type == "Softmax" and n.input[0] in fp16:
            axis = next((a.i for a in n.attribute if a.name == "axis"), -1)
            x, y, t = n.input[0], n.output[0], f"example_softmax_{i}"
            h = onnx.TensorProto.FLOAT16
            # exp(x) held in float16 (ONNX Runtime's CPU provider computes a float16 Exp in float: the
            # overflow a float16 kernel makes is written out), then summed and divided
            nodes += [helper.make_node("Exp", [x], [f"{t}/exp32"]),
                      helper.make_node("Constant", [], [f"{t}/max"], value=helper.make_tensor(f"{t}/m", h, [], [65504.0])),
                      helper.make_node("Constant", [], [f"{t}/inf"], value=helper.make_tensor(f"{t}/i", h, [], [np.inf])),
                      helper.make_node("Greater", [f"{t}/exp32", f"{t}/max"], [f"{t}/over"]),
                      helper.make_node("Where", [f"{t}/over", f"{t}/inf", f"{t}/exp32"], [f"{t}/exp"]),
                      helper.make_node("Constant", [], [f"{t}/axes"],
                                       value=helper.make_tensor(f"{t}/axes_value", onnx.TensorProto.INT64, [1], [axis])),
                      helper.make_node("ReduceSum", [f"{t}/exp", f"{t}/axes"], [f"{t}/sum"], keepdims=1),
                      helper.make_node("Div", [f"{t}/exp", f"{t}/sum"], [y], name=n.name)]
            continue
        if bug == "rope" and n.op_type == "RotaryEmbedding" and n.domain in ("", "ai.onnx"):
            sin, neg = n.input[2], f"example_rope_{i}/neg_sin"
            nodes.append(helper.make_node("Neg", [sin], [neg]))
            n.input[2] = neg
        nodes.append(n)
    del g.node[:]
    g.node.extend(nodes)
    return m


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


def make_kv_buggy_engine() -> ExampleEngine:
    """``--engines lockstep_example_engine:make_kv_buggy_engine``: new cache rows stored one slot late."""
    return ExampleEngine(bug="kv-late")


def make_softmax_buggy_engine() -> ExampleEngine:
    """``--engines lockstep_example_engine:make_softmax_buggy_engine``: float16 Softmax without the max subtracted."""
    return ExampleEngine(bug="softmax")


def make_rope_buggy_engine() -> ExampleEngine:
    """``--engines lockstep_example_engine:make_rope_buggy_engine``: RoPE's rotate_half with its halves swapped."""
    return ExampleEngine(bug="rope")


def make_gemm_buggy_engine() -> ExampleEngine:
    """``--engines lockstep_example_engine:make_gemm_buggy_engine``: square Gemm outputs come back transposed."""
    return ExampleEngine(bug="gemm")
