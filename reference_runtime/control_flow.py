"""Control flow with subgraphs, run by the executor: If, Loop, Scan, and FlexAttention's modifiers.

A node with graph attributes is not a kernel: the executor runs it itself (``CONTROL_OPS``). At
load, each subgraph becomes a ``Body``: a nested ``Executor`` over the subgraph wrapped as a model
whose inputs are the subgraph's formal inputs followed by the outer-scope names it reads
(``free_names``, nested subgraphs included). Its nodes are matched to kernels and validated then,
so an unsupported op or a bad attribute inside a body is refused when the enclosing model loads,
naming the node. The enclosing step lists those outer-scope names after its own inputs
(``implicit_inputs``): they order the graph, keep their producers alive through pruning, and reach
the body as the very value objects of the enclosing run (host values, when known, included).

At run time everything stays on the runtime's compute stream:

- If reads its condition on the host (a host seam: a synchronising read unless the value is
  host-known) and runs one branch;
- Loop reads its trip count and, after each iteration, the body's condition on the host; the
  iteration number is uploaded as a host-known int64 scalar; scan outputs are stacked on the
  device when the loop ends;
- Scan (opsets 8 and 9+) slices its scan inputs and writes each iteration's scan outputs into the
  stacked outputs on the device (``_TAKE``/``_PUT`` launches); its trip count is a shape;
- FlexAttention (ai.onnx.preview) launches Q·K^T, softmax and the product with V as kernels and
  runs ``score_mod``/``prob_mod`` as bodies on the scores and probabilities.

Host control flow is a capture seam (``capture_plan``'s "host control flow"), except a Scan or a
Loop whose trip count is fixed and whose body is capture-safe (and a FlexAttention whose modifiers
are): the plan admits it into a segment and its iterations are recorded like any launches (a
Loop's iteration number and condition are then written by a fill kernel, not a host copy). An executor with a control-flow node runs node
by node (no execution plan: a branch may change its outputs' shapes). Values a body creates are
handed to the enclosing run (freed with its temporaries); every other temporary (slices,
superseded loop-carried values) is freed stream-ordered as soon as it is dead, except while a
segment records the node: then nothing is freed (the graph bakes every address it touched) and
the node's temporaries are retained with the segment's (``segments``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import math
from typing import Any

import numpy as np
import onnx
from lockstep.kernels import (
    SMALL_DTYPES,
    flex_output,
    flex_precision,
    flex_scores,
    flex_softmax,
    Kernel,
    NodeInfo,
    primitives,
    Seq,
    Spec,
)

from .control_body import (
    _CAST,
    CONTROL_OPS,
    Body,
    _check_io,
    _Control,
    _host,
    _scalar_bool,
    free_names,
    _tensors,
    implicit_inputs,
    is_control,
)
from .values import Value
from lockstep.loading import UnsupportedModel

if TYPE_CHECKING:  # the executor imports this module (it builds a node's subgraphs with it)
    from .executor import Executor

__all__ = ["CONTROL_OPS", "Body", "build_control", "free_names", "implicit_inputs", "is_control"]



class _If(_Control):
    def __init__(self, executor: Executor, info: NodeInfo, n_formal: int):
        super().__init__(executor, info, n_formal)
        if n_formal != 1:
            raise info.error(f"If takes one input (the condition), got {n_formal}")
        self.then = self._body(executor, "then_branch")
        self.otherwise = self._body(executor, "else_branch")
        for attr, body in (("then_branch", self.then), ("else_branch", self.otherwise)):
            _check_io(info, body, attr, 0, info.n_outputs)

    def execute(self, formal, outer, owned):
        cond = _scalar_bool(_host(self.runtime, formal[0], self.info), "the condition", self.info)
        return (self.then if cond else self.otherwise).call([], outer, owned)


class _Loop(_Control):
    def __init__(self, executor: Executor, info: NodeInfo, n_formal: int):
        super().__init__(executor, info, n_formal)
        if n_formal < 2:
            raise info.error(f"Loop takes the trip count and the condition (either may be empty), got {n_formal} inputs")
        self.n_carried = n_formal - 2
        self.body = self._body(executor, "body")
        _check_io(info, self.body, "body", 2 + self.n_carried, None)
        self.n_scan = len(self.body.outputs) - 1 - self.n_carried
        if self.n_scan < 0 or info.n_outputs > self.n_carried + self.n_scan:
            raise info.error(f"attribute 'body': {len(self.body.outputs)} outputs for {self.n_carried} "
                             f"loop-carried values and {info.n_outputs} node outputs")

    def execute(self, formal, outer, owned):
        rt, info = self.runtime, self.info
        trip = None
        if formal[0] is not None:
            m = _host(rt, formal[0], info)
            if m.size != 1:
                raise info.error(f"the trip count M must hold one element, got shape {tuple(m.shape)}")
            trip = int(m.reshape(()))
        budget = rt.config.max_loop_iterations
        if trip is not None and trip > budget:
            raise info.error(f"trip count {trip} is over the runtime's loop budget of {budget} iterations "
                             "(RuntimeConfig.max_loop_iterations, LOCKSTEP_MAX_LOOP_ITERATIONS)")
        cond = True
        if formal[1] is not None:
            cond = _scalar_bool(_host(rt, formal[1], info), "the condition", info)
        carried = list(formal[2:])
        scans: list[list[Value]] = [[] for _ in range(self.n_scan)]
        in_scans: set[int] = set()  # the scan parts' tensors, kept as they come (not rebuilt each iteration)
        it = 0
        while cond and (trip is None or it < trip):
            if it >= budget:
                raise info.error(f"still running after the runtime's loop budget of {budget} iterations "
                                 "(RuntimeConfig.max_loop_iterations, LOCKSTEP_MAX_LOOP_ITERATIONS)")
            num = np.array(it, dtype=np.int64)
            it_v = Value(self._new((), np.int64, f"{info.name}:iteration", owned), Spec((), num.dtype, num))
            cond_arr = np.array(cond, dtype=np.bool_)
            cond_v = Value(self._new((), np.bool_, f"{info.name}:cond", owned), Spec((), cond_arr.dtype, cond_arr))
            if rt.is_capturing:  # recorded: a fill kernel holds the value (a host write is not captured)
                rt.launch(primitives.fill, it_v.tensor, value=it)  # Python scalars: no host array to copy
                rt.launch(primitives.fill, cond_v.tensor, value=bool(cond))
            else:
                rt.write(it_v.tensor, num)
                rt.write(cond_v.tensor, cond_arr)
            outs = self.body.call([it_v, cond_v, *carried], outer, owned)
            cond = _scalar_bool(_host(rt, outs[0], info), "the body's condition output", info)
            new = outs[1:1 + self.n_carried]
            for k in range(self.n_scan):
                part = outs[1 + self.n_carried + k]
                first = scans[k][0].spec if scans[k] else None
                if first is not None and isinstance(part, Value) and (
                        part.spec.shape != first.shape or part.spec.dtype != first.dtype):
                    raise info.error(f"scan output {info.name!r} changes between iterations: {first.dtype}"
                                     f"{list(first.shape)} then {part.spec.dtype}{list(part.spec.shape)} at "
                                     f"iteration {it}")
                scans[k].append(part)
                in_scans.update(id(x) for x in _tensors(part))
            for v in (it_v, cond_v, outs[0], *carried):
                self._drop(v, owned, new, in_scans)
            carried = new
            it += 1
        stacked = [self._stack(parts, 0, None, self.info.name, owned,
                               self.body.out_spec(1 + self.n_carried + k)) for k, parts in enumerate(scans)]
        for parts in scans:
            for p in parts:
                self._drop(p, owned, carried)
        return (carried + stacked)[:info.n_outputs]


def _int_list(info: NodeInfo, attr: str, n: int, default: int, allowed: "tuple[int, ...] | None" = None) -> list[int]:
    v = info.attrs.get(attr)
    if v is None:
        return [default] * n
    v = [int(x) for x in v]
    if len(v) != n:
        raise info.error(f"attribute {attr!r} has {len(v)} entries, {n} expected")
    if allowed is not None and any(x not in allowed for x in v):
        raise info.error(f"attribute {attr!r} must hold values in {list(allowed)}, got {v}")
    return v


class _Scan(_Control):
    def __init__(self, executor: Executor, info: NodeInfo, n_formal: int):
        super().__init__(executor, info, n_formal)
        m = info.attrs.get("num_scan_inputs")
        if m is None:
            raise info.error("attribute 'num_scan_inputs' is required")
        self.batched = info.opset < 9  # opset 8: sequence_lens first, a batch axis 0 everywhere
        n_in = n_formal - (1 if self.batched else 0)
        if not isinstance(m, int) or not 1 <= m <= n_in:
            raise info.error(f"attribute 'num_scan_inputs' must be in [1, {n_in}], got {m!r}")
        self.m, self.n = m, n_in - m
        self.body = self._body(executor, "body")
        _check_io(info, self.body, "body", self.n + m, info.n_outputs)
        self.k = info.n_outputs - self.n
        if self.k < 0:
            raise info.error(f"{info.n_outputs} outputs for {self.n} state variables")
        if self.batched:
            self.in_dirs = _int_list(info, "directions", m, 0, (0, 1))
            self.in_axes, self.out_axes, self.out_dirs = [0] * m, [0] * self.k, [0] * self.k
        else:
            self.in_dirs = _int_list(info, "scan_input_directions", m, 0, (0, 1))
            self.in_axes = _int_list(info, "scan_input_axes", m, 0)
            self.out_dirs = _int_list(info, "scan_output_directions", self.k, 0, (0, 1))
            self.out_axes = _int_list(info, "scan_output_axes", self.k, 0)

    def execute(self, formal, outer, owned):
        if not self.batched:
            return self._scan(formal, outer, owned)
        info, rt = self.info, self.runtime
        values = formal[1:]
        for v in values:
            if len(v.spec.shape) < 1:
                raise info.error("opset-8 Scan inputs need a batch axis")
        if formal[0] is not None:  # lengths other than the scan axis's leave outputs the spec does not define
            lens = _host(rt, formal[0], info).reshape(-1)
            full = values[self.n].spec.shape[1] if len(values[self.n].spec.shape) > 1 else None
            if full is None or any(int(x) != full for x in lens):
                raise info.error(f"input 'sequence_lens' {lens.tolist()}: only the full length ({full}) is supported")
        batch = values[0].spec.shape[0]
        if any(v.spec.shape[0] != batch for v in values):
            raise info.error(f"batch sizes differ: {[v.spec.shape[0] for v in values]}")
        per: list[list[Value]] = [[] for _ in range(info.n_outputs)]
        for b in range(batch):
            sliced = [self._take(v, 0, b, owned) for v in values]
            outs = self._scan(sliced, outer, owned)
            for k, o in enumerate(outs):
                per[k].append(o)
            for s in sliced:
                self._drop(s, owned, outs)
        stacked = [self._stack(parts, 0, None, info.name, owned, (None, None)) for parts in per]
        for parts in per:
            for p in parts:
                self._drop(p, owned, [])
        return stacked

    def _scan(self, formal, outer, owned):
        info = self.info
        states, xs = list(formal[:self.n]), formal[self.n:]
        axes = []
        for v, a in zip(xs, self.in_axes):
            r = len(v.spec.shape)
            if not -r <= a < r:
                raise info.error(f"attribute 'scan_input_axes': axis {a} out of range for rank {r}")
            axes.append(a % r)
        lengths = {v.spec.shape[a] for v, a in zip(xs, axes)}
        if len(lengths) != 1:
            raise info.error(f"scan inputs disagree on the sequence length: {sorted(lengths)}")
        steps = lengths.pop()
        parts: list[list[Value]] = [[] for _ in range(self.k)]
        for t in range(steps):
            sliced = [self._take(v, a, t if d == 0 else steps - 1 - t, owned)
                      for v, a, d in zip(xs, axes, self.in_dirs)]
            outs = self.body.call([*states, *sliced], outer, owned)
            new = outs[:self.n]
            for k in range(self.k):
                parts[k].append(outs[self.n + k])
            keep = [*new, *[p for s in parts for p in s]]
            for v in (*sliced, *states):
                self._drop(v, owned, keep)
            states = new
        result = list(states)
        for k in range(self.k):
            rank = len(parts[k][0].spec.shape) + 1 if parts[k] else 1
            a = self.out_axes[k]
            if not -rank <= a < rank:
                raise info.error(f"attribute 'scan_output_axes': axis {a} out of range for rank {rank}")
            idx = list(range(steps)) if self.out_dirs[k] == 0 else list(range(steps - 1, -1, -1))
            result.append(self._stack(parts[k], a % rank, idx, info.name, owned, self.body.out_spec(self.n + k)))
            for p in parts[k]:
                self._drop(p, owned, result)
        return result


# -- FlexAttention (ai.onnx.preview): Q·K^T, softmax and ·V on the device, the modifiers as bodies
_PRECISION = {onnx.TensorProto.FLOAT: "float32", onnx.TensorProto.FLOAT16: "float16",
              onnx.TensorProto.BFLOAT16: "bfloat16", onnx.TensorProto.DOUBLE: "float64"}


def _scores_body(xp, out, q, k, *, node):
    out[...] = flex_scores(xp, node, q, k)


def _softmax_body(xp, out, s):
    out[...] = flex_softmax(xp, s)


def _pv_body(xp, out, p, v):
    out[...] = flex_output(xp, p, v)


_SCORES = Kernel("FlexAttention:scores", _scores_body, writes=(0,))
_SOFTMAX = Kernel("FlexAttention:softmax", _softmax_body, writes=(0,))
_PV = Kernel("FlexAttention:pv", _pv_body, writes=(0,))


class _FlexAttention(_Control):
    def __init__(self, executor: Executor, info: NodeInfo, n_formal: int):
        super().__init__(executor, info, n_formal)
        if n_formal != 3 or info.n_outputs != 1:
            raise info.error(f"FlexAttention takes Q, K, V and gives Y, got {n_formal} inputs, {info.n_outputs} outputs")
        p = info.attrs.get("softmax_precision")
        if p is not None and p not in _PRECISION:
            raise info.error(f"attribute 'softmax_precision' must be one of {sorted(_PRECISION)} "
                             f"(float, float16, bfloat16, double), got {p!r}")
        scale = info.attrs.get("scale")
        if scale is not None and not (math.isfinite(scale) and scale > 0):
            raise info.error(f"attribute 'scale' must be a finite positive number, got {scale!r}")
        self.mods = []
        for attr in ("score_mod", "prob_mod"):
            body = self._body(executor, attr, required=False)
            if body is not None:
                _check_io(info, body, attr, 1, 1)
            self.mods.append(body)

    def _modify(self, body: "Body | None", v: Value, outer, owned) -> Value:
        if body is None:
            return v
        out = body.call([v], outer, owned)[0]
        if out.spec.shape != v.spec.shape:
            raise self.info.error(f"a modifier changed the shape {list(v.spec.shape)} to {list(out.spec.shape)}")
        if out.spec.dtype != v.spec.dtype:
            cast = self._new(v.spec.shape, v.spec.dtype, f"{self.info.name}:cast", owned)
            self.runtime.launch(_CAST, cast, out.tensor)
            self._drop(out, owned, [])
            out = Value(cast, Spec(v.spec.shape, v.spec.dtype))
        return out

    def execute(self, formal, outer, owned):
        info, rt = self.info, self.runtime
        q, k, v = formal
        small = sorted({str(x.spec.dtype) for x in formal if str(x.spec.dtype) in SMALL_DTYPES})
        if small and rt.device.RAW_STORAGE:
            # the stage kernels and the modifier subgraphs would see storage bits, not values
            raise UnsupportedModel("FlexAttention with score_mod/prob_mod on a raw-bit device",
                                   [f"{info.name}: inputs of type {', '.join(small)} (stored as raw bits here)"])
        shapes = [x.spec.shape for x in formal]
        if any(len(s) != 4 for s in shapes):
            raise info.error(f"Q, K and V must be rank 4, got {[list(s) for s in shapes]}")
        (b, hq, lq, e), (bk, hk, s, ek), (bv, hv, sv, ev) = shapes
        if ek != e or sv != s or hv != hk or not (b == bk == bv):
            raise info.error(f"Q {list(shapes[0])}, K {list(shapes[1])} and V {list(shapes[2])} do not agree")
        if hk <= 0 or hq % hk:
            raise info.error(f"q_num_heads ({hq}) must be a multiple of kv_num_heads ({hk})")
        cdt = flex_precision(info, q.spec.dtype)
        shape = (b, hq, lq, s)
        scores = Value(self._new(shape, cdt, f"{info.name}:scores", owned), Spec(shape, cdt))
        rt.launch(_SCORES, scores.tensor, q.tensor, k.tensor, node=info)
        modded = self._modify(self.mods[0], scores, outer, owned)
        self._drop(scores, owned, [modded])
        probs = Value(self._new(shape, cdt, f"{info.name}:probs", owned), Spec(shape, cdt))
        rt.launch(_SOFTMAX, probs.tensor, modded.tensor)
        self._drop(modded, owned, [probs])
        final = self._modify(self.mods[1], probs, outer, owned)
        self._drop(probs, owned, [final])
        yshape = (b, hq, lq, ev)
        y = Value(self._new(yshape, v.spec.dtype, info.name, owned), Spec(yshape, v.spec.dtype))
        rt.launch(_PV, y.tensor, final.tensor, v.tensor)
        self._drop(final, owned, [y])
        return [y]


class _SequenceMap(_Control):
    """SequenceMap: the body once per element of the input sequence; additional inputs that are
    sequences (of the same length) give their element, tensors are passed whole. Each body output
    is collected into an output sequence."""

    def __init__(self, executor: Executor, info: NodeInfo, n_formal: int):
        super().__init__(executor, info, n_formal)
        if n_formal < 1:
            raise info.error("SequenceMap takes an input sequence")
        self.body = self._body(executor, "body")
        _check_io(info, self.body, "body", n_formal, info.n_outputs)

    def execute(self, formal, outer, owned):
        info = self.info
        if not isinstance(formal[0], Seq):
            raise info.error(f"input 0 must be a sequence, got {type(formal[0]).__name__}")
        n = len(formal[0])
        for k, x in enumerate(formal[1:], 1):
            if isinstance(x, Seq) and len(x) != n:
                raise info.error(f"input {k} is a sequence of {len(x)} elements, input 0 has {n}")
        collected: list[list[Any]] = [[] for _ in range(info.n_outputs)]
        for i in range(n):
            args = [x.items[i] if isinstance(x, Seq) else x for x in formal]
            for k, v in enumerate(self.body.call(args, outer, owned)):
                collected[k].append(v)
        out = []
        for k, items in enumerate(collected):
            dtype = items[0].spec.dtype if items else self.body.out_spec(k)[1]
            if dtype is None:
                raise info.error(f"output {k} of an empty sequence: the body does not declare its element type")
            out.append(Seq(tuple(items), np.dtype(dtype)))
        return out


_BUILDERS = {"If": _If, "Loop": _Loop, "Scan": _Scan, "SequenceMap": _SequenceMap, "FlexAttention": _FlexAttention}


def build_control(executor: Executor, info: NodeInfo, node: onnx.NodeProto, implicit: tuple[str, ...]) -> _Control:
    """The control-flow step of ``node`` (its subgraphs built and checked now)."""
    control = _BUILDERS[info.op_type](executor, info, len(node.input))
    control.outer_names = implicit
    control.input_names = tuple(node.input)
    return control
