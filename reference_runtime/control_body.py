"""What every control-flow op shares (``control_flow`` holds the ops): a subgraph as a ``Body``
(a nested executor built and validated at load, its outer-scope names as extra inputs), the
outer-scope names a node's subgraphs read (``free_names``, ``implicit_inputs``), which nodes are
control flow (``is_control``), the ``_Control`` base an op implements, and the device copies
bodies need (``_TAKE``/``_PUT``/``_CAST``/``_ROWS``), and ``ScanOutput``: one Loop or Scan scan output
written on the device iteration by iteration."""

from __future__ import annotations

from typing import TYPE_CHECKING

import abc
from typing import Any

import numpy as np
import onnx
from lockstep.kernels import Kernel, NodeInfo, OpError, primitives, Seq, Spec

from .errors import MemoryAllocation
from .values import Run, Value
from lockstep.loading import np_dtype
from .runtime import Tensor

if TYPE_CHECKING:  # the executor imports this module, through control_flow
    from .executor import Executor

__all__ = ["Body", "ScanOutput", "free_names", "implicit_inputs", "is_control"]

CONTROL_OPS = frozenset({("", "If"), ("", "Loop"), ("", "Scan"), ("", "SequenceMap"), ("ai.onnx.preview", "FlexAttention")})

_GRAPH_TYPES = (onnx.AttributeProto.GRAPH, onnx.AttributeProto.GRAPHS)


def _subgraphs(node: onnx.NodeProto) -> list[onnx.GraphProto]:
    out: list[onnx.GraphProto] = []
    for a in node.attribute:
        if a.type == onnx.AttributeProto.GRAPH:
            out.append(a.g)
        elif a.type == onnx.AttributeProto.GRAPHS:
            out.extend(a.graphs)
    return out


def free_names(graph: onnx.GraphProto) -> list[str]:
    """The names ``graph`` (and the subgraphs of its nodes) reads but does not define: its
    outer-scope references, in first-use order."""
    bound = {vi.name for vi in graph.input} | {t.name for t in graph.initializer}
    bound |= {t.values.name for t in graph.sparse_initializer}
    seen: dict[str, None] = {}
    for node in graph.node:
        refs = list(node.input)
        for g in _subgraphs(node):
            refs.extend(free_names(g))
        for name in refs:
            if name and name not in bound:
                seen.setdefault(name, None)
        bound.update(o for o in node.output if o)
    for vi in graph.output:  # an output may be an outer value passed straight through
        if vi.name not in bound:
            seen.setdefault(vi.name, None)
    return list(seen)


def is_control(domain: str, op_type: str, node: onnx.NodeProto) -> bool:
    """Whether the executor runs ``node`` itself: If, Loop, Scan, SequenceMap, and a FlexAttention with a
    score_mod or prob_mod subgraph (without one it is an ordinary kernel, ``kernels._attention``)."""
    if (domain, op_type) not in CONTROL_OPS:
        return False
    return op_type != "FlexAttention" or bool(_subgraphs(node))


def implicit_inputs(node: onnx.NodeProto) -> tuple[str, ...]:
    """The outer-scope names a node's subgraphs read, not among its own inputs ((): no subgraph)."""
    graphs = _subgraphs(node)
    if not graphs:
        return ()
    own = set(node.input)
    names: dict[str, None] = {}
    for g in graphs:
        for n in free_names(g):
            if n not in own:
                names.setdefault(n, None)
    return tuple(names)


# -- device kernels (capture-safe: basic indexing and copies on the arrays the runtime gives)
def _take_body(xp, out, src, *, axis, index):
    out[...] = src[(slice(None),) * axis + (index,)]


def _put_body(xp, dst, src, *, axis, index):
    dst[(slice(None),) * axis + (index,)] = src


def _cast_body(xp, out, src):
    out[...] = src.astype(out.dtype)


def _rows_body(xp, dst, src, *, start, count):
    dst[start:start + count] = src[:count]


_TAKE = Kernel("control_flow:take", _take_body, writes=(0,))
_PUT = Kernel("control_flow:put", _put_body, writes=(0,))
_CAST = Kernel("control_flow:cast", _cast_body, writes=(0,))
_ROWS = Kernel("control_flow:rows", _rows_body, writes=(0,))  # a Loop's chunks into its stacked scan output


def _tensors(v: Any):
    """The device tensors a value holds: a tensor value's own, each element's of a sequence (``Seq``)."""
    if isinstance(v, Seq):
        for item in v.items:
            yield from _tensors(item)
        return
    t = getattr(v, "tensor", None)
    if t is not None:
        yield t


class Body:
    """A subgraph built once at load: ``call`` runs it on value objects and returns its outputs."""

    def __init__(self, graph: onnx.GraphProto, parent: Executor, where: str):
        self.where = where
        self.formal = [vi.name for vi in graph.input]
        self.outer = [n for n in free_names(graph) if n not in self.formal]
        self.declared = list(graph.output)
        wrapped = onnx.GraphProto()
        wrapped.CopyFrom(graph)
        for name in self.outer:
            wrapped.input.append(onnx.ValueInfoProto(name=name))
        model = onnx.helper.make_model(wrapped, opset_imports=list(parent.model.opset_import),
                                       ir_version=parent.model.ir_version)
        self.executor = parent.body(model)
        self.outputs = list(self.executor.outputs)

    def out_spec(self, k: int) -> "tuple[tuple[int, ...] | None, np.dtype | None]":
        """Output ``k``'s declared static shape and dtype (None where the graph does not say)."""
        tt = self.declared[k].type.tensor_type if self.declared[k].type.HasField("tensor_type") else None
        if tt is None:
            return None, None
        dtype = np_dtype(tt.elem_type) if tt.elem_type else None
        if not tt.HasField("shape") or any(not d.HasField("dim_value") for d in tt.shape.dim):
            return None, dtype
        return tuple(d.dim_value for d in tt.shape.dim), dtype

    def call(self, formal: list[Any], outer: dict[str, Any], owned: dict[int, Tensor]) -> list[Any]:
        """Run the body: ``formal`` values for its inputs, ``outer`` the enclosing scope's. Tensors
        the body creates for its outputs are added to ``owned`` (by id); outputs that are inputs or
        the body's constants come back as they are."""
        ex = self.executor
        rt = ex.runtime
        run = Run(dict(ex._const_values), [], frozenset(), {})
        env = run.env
        for name in self.outer:
            env[name] = outer[name]
        for name, v in zip(self.formal, formal):
            if v is not None:
                env[name] = v
        # the values the body did not make (its inputs, the outer scope's, its constants): passed as they are
        passed = {id(t) for v in env.values() for t in _tensors(v)}
        try:
            for i in range(len(ex.steps)):
                ex.step(run, i)
            temps = {id(t) for t in run.temps}

            def hand_over(v: Any, o: str) -> Any:
                """``v`` made the caller's: its tensors (a sequence's elements too) handed over or copied."""
                if isinstance(v, Seq):
                    return Seq(tuple(hand_over(item, o) for item in v.items), v.dtype)
                t = getattr(v, "tensor", None)
                if t is not None and id(t) in temps:
                    run.handed.add(id(t))
                    owned[id(t)] = t
                elif t is not None and id(t) not in passed:  # a view of a temporary: its own copy
                    own = rt.empty(t.shape, t.dtype, name=o)
                    rt.launch(primitives.copy, own, t)
                    owned[id(own)] = own
                    v = Value(own, v.spec)
                return v

            result = []
            for o in self.outputs:
                if o not in env:
                    raise OpError(f"{self.where}: body output {o!r} was never produced")
                result.append(hand_over(env[o], o))
            return result
        finally:
            if rt.is_capturing:  # recorded in a segment: the graph bakes every temporary's address
                retained: list[Tensor] = []
                ex.release(run, retain=retained)
                owned.update((id(t), t) for t in retained)  # retained by the node, with the segment
            else:
                ex.release(run)


def _host(rt, v: Value, info: NodeInfo) -> np.ndarray:
    """A value on the host: its known host value, else a synchronising read (the node's host seam)."""
    if v.spec.value is not None:
        return np.asarray(v.spec.value)
    rt.current_node = info.name
    return rt.download(v.tensor)


def _scalar_bool(arr: np.ndarray, what: str, info: NodeInfo) -> bool:
    if arr.size != 1:
        raise info.error(f"{what} must hold one element, got shape {tuple(arr.shape)}")
    return bool(arr.reshape(()))


class _Control(abc.ABC):
    """One control-flow node: built at load (subgraphs, attribute checks), run per step."""

    def __init__(self, executor: Executor, info: NodeInfo, n_formal: int):
        self.info = info
        self.n_formal = n_formal
        self.runtime = executor.runtime

    def _body(self, executor: Executor, attr: str, *, required: bool = True) -> "Body | None":
        g = self.info.attrs.get(attr)
        if g is None:
            if required:
                raise self.info.error(f"attribute {attr!r} (a graph) is required")
            return None
        if not isinstance(g, onnx.GraphProto):
            raise self.info.error(f"attribute {attr!r} must be a graph, got {type(g).__name__}")
        return Body(g, executor, f"node {self.info.name!r} ({self.info.op_type}) attribute {attr!r}")

    def run(self, executor: Executor, run: Run, values: list[Any], temps: list[Tensor],
            persist: "dict[str, Tensor] | None", outputs: tuple[str, ...]) -> None:
        rt = self.runtime
        rt.current_node = self.info.name
        formal, outer_vals = values[:self.n_formal], values[self.n_formal:]
        owned: dict[int, Tensor] = {}
        outer = {n: v for n, v in zip(self.input_names, formal) if n}  # a body may read the node's inputs too
        outer.update(zip(self.outer_names, outer_vals))
        kept: set[int] = set()  # owned tensors that became the node's outputs: the run's temporaries
        try:
            results = self.execute(formal, outer, owned)
            if len(results) != len(outputs):
                raise self.info.error(f"produced {len(results)} outputs, the node has {len(outputs)}")
            for name, v in zip(outputs, results):
                if not name:
                    continue
                t = getattr(v, "tensor", None)  # (other value kinds pass through as they are)
                target = run.bind.get(name) or (persist.get(name) if persist else None)
                if target is not None and t is not target:
                    if t is None or tuple(target.shape) != tuple(v.spec.shape) or target.dtype != v.spec.dtype:
                        raise self.info.error(f"output {name!r} is {getattr(v, 'spec', v)} but its buffer is {target!r}")
                    rt.launch(primitives.copy, target, t)  # on the compute stream, in order: no sync
                    v = Value(target, Spec(v.spec.shape, v.spec.dtype))
                else:  # the tensors it holds (a sequence's elements too) become the run's temporaries
                    kept.update(id(x) for x in _tensors(v) if id(x) in owned)
                run.env[name] = v
        finally:
            capturing = rt.is_capturing
            for key, t in owned.items():
                if key in kept or (capturing and not t.freed):
                    temps.append(t)  # an output, or (recording) a temporary the segment's graph bakes
                elif not t.freed:
                    rt.free(t)

    outer_names: tuple[str, ...] = ()  # the outer-scope names the subgraphs read (after the node's inputs)
    input_names: tuple[str, ...] = ()

    @abc.abstractmethod
    def execute(self, formal: list[Any], outer: dict[str, Any], owned: dict[int, Tensor]) -> list[Any]:
        """The node's output values from its inputs (``formal``) and the outer scope's; every tensor
        it allocates goes into ``owned`` (``run`` hands the outputs over and frees the rest)."""

    # -- helpers on the device
    def _drop(self, v: Any, owned: dict[int, Tensor], live: "list[Any]", held: "set[int] | None" = None) -> None:
        """Free ``v``'s tensors (a sequence's elements too) that this node owns and no value in
        ``live`` (or, by id, ``held``: a set kept up to date by a caller with many live values) still
        holds. While a segment records the node, nothing is freed: the graph bakes
        every address it touched, so ``run`` retains them with the segment (freed when its graph is
        dropped); a free then would let the replay touch released memory."""
        if self.runtime.is_capturing:
            return
        keep = {id(x) for lv in live for x in _tensors(lv)}
        held = held or ()  # looked up, never copied: a loop's set of scan parts grows with its iterations
        for t in list(_tensors(v)):
            if id(t) in owned and id(t) not in keep and id(t) not in held:
                del owned[id(t)]
                self.runtime.free(t)

    def _new(self, shape: tuple[int, ...], dtype: Any, name: str, owned: dict[int, Tensor]) -> Tensor:
        t = self.runtime.empty(tuple(int(d) for d in shape), dtype, name=name)
        owned[id(t)] = t
        return t

    def _take(self, v: Value, axis: int, index: int, owned: dict[int, Tensor]) -> Value:
        shape = v.spec.shape[:axis] + v.spec.shape[axis + 1:]
        out = self._new(shape, v.spec.dtype, f"{self.info.name}:slice", owned)
        self.runtime.launch(_TAKE, out, v.tensor, axis=axis, index=index)
        return Value(out, Spec(shape, v.spec.dtype))

    def _free_owned(self, t: Tensor, owned: dict[int, Tensor]) -> None:
        """Free a tensor this node allocated for itself (nothing while a segment records the node)."""
        if not self.runtime.is_capturing and owned.pop(id(t), None) is not None:
            self.runtime.free(t)

    def _stack(self, parts: list[Value], axis: int, indices: "list[int] | None", name: str,
               owned: dict[int, Tensor], empty: "tuple[tuple[int, ...] | None, Any]") -> Value:
        """The ``parts`` stacked along a new ``axis`` (part k at ``indices[k]``, default k)."""
        if not parts:
            shape, dtype = empty
            if dtype is None:
                raise self.info.error(f"output {name!r} of zero iterations: the body does not declare its "
                                      f"element type")
            shape = (0,) + tuple(shape or ())
            return Value(self._new(shape, dtype, name, owned), Spec(shape, np.dtype(dtype)))
        first = parts[0].spec
        for p in parts[1:]:
            if p.spec.shape != first.shape or p.spec.dtype != first.dtype:
                raise self.info.error(f"scan output {name!r} changes between iterations: "
                                      f"{first.dtype}{list(first.shape)} then {p.spec.dtype}{list(p.spec.shape)}")
        shape = first.shape[:axis] + (len(parts),) + first.shape[axis:]
        out = self._new(shape, first.dtype, name, owned)
        for k, p in enumerate(parts):
            self.runtime.launch(_PUT, out, p.tensor, axis=axis, index=k if indices is None else indices[k])
        return Value(out, Spec(shape, first.dtype))


class ScanOutput:
    """One scan output of a Loop or a Scan, written on the device as each iteration gives its part:
    the part goes into a buffer at once (a ``_PUT`` launch) and the caller drops it, so the loop
    holds a few buffers, not one tensor per iteration, and an iteration costs the same whatever
    the count (with a part alive per iteration, every allocation's bookkeeping grows with them).

    The first part fixes the shape and the type; a later one that differs is refused at that
    iteration (``OpError`` naming the node, the output, both shapes and the iteration).

    ``steps`` known (a Scan; a Loop whose trip count is known and small, ``PREALLOCATE_*``): one
    buffer of ``steps`` parts along ``axis``, allocated at the first part, part t at ``index``
    (a Scan's direction), and it is the stacked output itself. Otherwise (a Loop, axis 0): chunks
    of ``FIRST_CHUNK`` parts, then each as many as all before it (O(log n) buffers, no chunk copied
    while the loop runs), copied once into the stacked output by ``finish`` (one ``_ROWS`` launch a
    chunk). Before a chunk is allocated, chunks plus the stacked output of at least the parts so
    far past the device memory budget (``Runtime.memory_limit``) are refused with
    ``MemoryAllocation`` naming the node, the output and the iteration: the device refuses before
    the host's memory runs out."""

    FIRST_CHUNK = 64
    PREALLOCATE_STEPS = 1 << 16  # a Loop's known trip count up to this many parts ...
    PREALLOCATE_BYTES = 64 << 20  # ... of at most this many bytes in all is allocated whole at once

    def __init__(self, ctl: "_Control", output: str, owned: dict[int, Tensor], *, axis: int = 0,
                 steps: "int | None" = None, empty: "tuple[tuple[int, ...] | None, Any]" = (None, None),
                 bounded: bool = False):
        self.ctl, self.output, self.owned, self.axis, self.empty = ctl, output, owned, axis, empty
        self.steps = steps  # an exact count (a Scan's), or a Loop's known trip count (None: unknown)
        self.bounded = bounded  # steps is the exact number of parts (a Scan): one buffer, whatever its size
        self.first: "Spec | None" = None
        self.chunks: list[tuple[Tensor, int]] = []  # (buffer, parts it holds room for)
        self.count = 0
        self._room = 0  # parts left in the last chunk
        self.part_bytes = 0

    def add(self, part: Any, it: int, index: "int | None" = None) -> None:
        """Write iteration ``it``'s part (at ``index`` along the axis: a Scan's direction; default ``it``)."""
        info = self.ctl.info
        if not isinstance(part, Value):
            raise info.error(f"scan output {self.output!r} must be a tensor, got {type(part).__name__} at "
                             f"iteration {it}")
        spec = part.spec
        if self.first is None:
            self.first = spec
            self.part_bytes = int(np.prod(spec.shape, dtype=np.int64)) * np.dtype(spec.dtype).itemsize
            rank = len(spec.shape) + 1
            if not -rank <= self.axis < rank:
                raise info.error(f"attribute 'scan_output_axes': axis {self.axis} out of range for rank {rank}")
            self.axis %= rank
        elif spec.shape != self.first.shape or spec.dtype != self.first.dtype:
            raise info.error(f"scan output {self.output!r} changes between iterations: {self.first.dtype}"
                             f"{list(self.first.shape)} then {spec.dtype}{list(spec.shape)} at iteration {it}")
        if not self._room:
            self._grow(it)
        buf, rows = self.chunks[-1]
        at = rows - self._room if index is None else index
        self.ctl.runtime.launch(_PUT, buf, part.tensor, axis=self.axis, index=at)
        self._room -= 1
        self.count += 1

    def _grow(self, it: int) -> None:
        ctl, first = self.ctl, self.first
        assert first is not None
        known_small = self.steps is not None and (self.bounded or (
            self.steps <= self.PREALLOCATE_STEPS and self.steps * self.part_bytes <= self.PREALLOCATE_BYTES))
        if not self.chunks and known_small:
            rows = self.steps
        else:
            rows = max(self.FIRST_CHUNK, self.count)
            if self.steps is not None:
                rows = min(rows, self.steps - self.count)
        limit = ctl.runtime.memory_limit
        held = sum(r for _, r in self.chunks) * self.part_bytes
        # past the first chunk, ``finish`` copies them all: it needs the chunks and the stacked copy at once
        need = held + rows * self.part_bytes + (self.count + 1) * self.part_bytes
        if self.chunks and need > limit:
            raise MemoryAllocation(
                f"node {ctl.info.name!r} ({ctl.info.op_type}): scan output {self.output!r} at iteration {it}: "
                f"{self.count + 1} parts of {first.dtype}{list(first.shape)} ({self.part_bytes} bytes each) in "
                f"chunks of {held + rows * self.part_bytes} bytes, and their stacked copy, need {need} bytes: past "
                f"the device memory budget of {limit} bytes", node=ctl.info.name, value=self.output, nbytes=need,
                limit=limit)
        shape = first.shape[:self.axis] + (rows,) + first.shape[self.axis:]
        ctl.runtime.current_node = ctl.info.name  # a refusal names this node, not the body's last
        self.chunks.append((ctl._new(shape, first.dtype, self.output, self.owned), rows))
        self._room = rows

    def finish(self) -> Value:
        """The stacked output: the one buffer when full, else one copy of the chunks' parts."""
        ctl, first = self.ctl, self.first
        if first is None:
            return ctl._stack([], self.axis, None, self.output, self.owned, self.empty)
        shape = first.shape[:self.axis] + (self.count,) + first.shape[self.axis:]
        if len(self.chunks) == 1 and self.chunks[0][1] == self.count:
            return Value(self.chunks[0][0], Spec(shape, first.dtype))
        ctl.runtime.current_node = ctl.info.name
        out = ctl._new(shape, first.dtype, self.output, self.owned)
        start = 0
        for buf, rows in self.chunks:
            n = min(rows, self.count - start)
            if n:
                ctl.runtime.launch(_ROWS, out, buf, start=start, count=n)
            start += n
            ctl._free_owned(buf, self.owned)
        self.chunks = []
        return Value(out, Spec(shape, first.dtype))


def _check_io(info: NodeInfo, body: Body, attr: str, n_in: int | None, n_out: int | None) -> None:
    if n_in is not None and len(body.formal) != n_in:
        raise info.error(f"attribute {attr!r}: the body has {len(body.formal)} inputs, {n_in} expected")
    if n_out is not None and len(body.outputs) != n_out:
        raise info.error(f"attribute {attr!r}: the body has {len(body.outputs)} outputs, {n_out} expected")
