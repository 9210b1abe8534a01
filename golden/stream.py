"""The oracle's streaming evaluator: onnx's reference kernels, scheduled one node at a time with the
weights read where they are used.

``ReferenceEvaluator(model).run`` holds every initializer as a numpy array for as long as it lives
(and needs external data loaded into the proto first, or a ``ModelContainer``): an 0.5B model's
oracle took 12.8 GiB. Here the evaluator is built once over the model's *structure* (``StreamModel``:
its nodes, I/O and value types, every initializer a stub with a name, type and dims but no data) and
this module's loop drives its ``rt_nodes_``, the very kernel objects ``ReferenceEvaluator.run``
would call, in the same order on the same inputs:

- each node's inputs are looked up among the feeds and the values computed so far; an initializer
  is read only at a node that reads it (``StreamModel.weight``: ``lockstep.loading.tensor_to_numpy``,
  a view of the proto's bytes or a memory map of the external data file, converted when the model
  is a retyped view) and dropped after that node;
- every value is dropped after its last reader (liveness), and nodes that no requested output
  depends on are not run (their values could not reach the outputs).

So the peak is the live activations plus the weights of one node, and the outputs are bit-identical
to ``ReferenceEvaluator(model, new_ops=CONTRIB_OPS).run`` on the same (retyped) model
(``tests/test_oracle_stream.py``). A retyped view (``StreamModel.retyped``: an fp16 model upcast to
fp32, the float64 cross-check's float32 -> float64) changes the structure as ``oracle.retyped``
changes the whole proto (values, Cast targets, tensor attributes) and each weight as it is read.
"""

from __future__ import annotations

import mmap
from dataclasses import dataclass, field
from typing import Any, Mapping, Sequence

import numpy as np
import onnx
from onnx import numpy_helper

from lockstep.loading import copy_fields

__all__ = ["StreamModel", "StreamEvaluator", "retype_structure", "schedule", "proto_of"]


def retype_structure(m: onnx.ModelProto, src: int, dst: int) -> None:
    """Make every ``src`` value type, Cast target (attribute ``to``) and tensor attribute of ``m``'s
    graph ``dst``, in place (``oracle.retyped`` without the initializers: the one definition)."""
    np_dst = onnx.helper.tensor_dtype_to_np_dtype(dst)
    g = m.graph
    for vi in [*g.input, *g.output, *g.value_info]:
        if vi.type.tensor_type.elem_type == src:
            vi.type.tensor_type.elem_type = dst
    for n in g.node:
        for a in n.attribute:
            if a.name == "to" and a.i == src:
                a.i = dst
            if a.type == onnx.AttributeProto.TENSOR and a.t.data_type == src:
                a.t.CopyFrom(numpy_helper.from_array(numpy_helper.to_array(a.t).astype(np_dst), a.t.name))


def _skeleton(model: onnx.ModelProto) -> onnx.ModelProto:
    """``model`` with every initializer a stub (name, type, dims; no data): nothing of the weights
    is copied, and ``DecoderIO.of``, ``ModelShape.of`` and ``check_supported`` read it as the model."""
    m = onnx.ModelProto()
    copy_fields(model, m, "graph")
    copy_fields(model.graph, m.graph, "initializer")
    for t in model.graph.initializer:
        m.graph.initializer.add(name=t.name, data_type=t.data_type, dims=t.dims)
    return m


def _base_dir(model: onnx.ModelProto) -> str | None:
    from lockstep.model_source import source_of

    src = source_of(model)
    return str(src.parent) if src is not None else None


@dataclass(frozen=True)
class StreamModel:
    """A model as the oracle streams it: ``proto`` (its structure, initializers as stubs),
    ``tensors`` (each initializer's TensorProto in the source model, never copied), ``base_dir``
    (where external data lives) and ``retype`` (source element type -> the type ``proto`` declares)."""

    proto: onnx.ModelProto
    tensors: Mapping[str, onnx.TensorProto]
    base_dir: str | None = None
    retype: tuple[tuple[int, int], ...] = ()
    # initializers read as views of a memory-mapped external data file: kept (they hold no memory of
    # their own; the pages are the file's), so a decode step does not look each one up again
    _mapped: dict[str, np.ndarray] = field(default_factory=dict, compare=False, repr=False)

    @classmethod
    def of(cls, model: "onnx.ModelProto | StreamModel", base_dir: str | None = None) -> "StreamModel":
        """``model`` itself when it is one; else a view of the proto (``base_dir``: given, else the
        folder of the file it was loaded from, ``lockstep.model_source``)."""
        if isinstance(model, StreamModel):
            return model
        return cls(_skeleton(model), {t.name: t for t in model.graph.initializer},
                   base_dir if base_dir is not None else _base_dir(model))

    def retyped(self, src: int, dst: int) -> "StreamModel":
        """This model with every ``src`` tensor, value and Cast target ``dst`` (``oracle.retyped``'s
        function): the structure now, each weight when it is read."""
        m = onnx.ModelProto()
        m.CopyFrom(self.proto)  # stubs and structure only
        retype_structure(m, src, dst)
        for t in m.graph.initializer:
            if t.data_type == src:
                t.data_type = dst
        old = dict(self.retype)
        new = {s: (dst if d == src else d) for s, d in old.items()}
        if src not in old:
            new[src] = dst
        return StreamModel(m, self.tensors, self.base_dir, tuple(sorted((s, d) for s, d in new.items() if s != d)),
                           self._mapped)

    def source(self, name: str) -> np.ndarray:
        """Initializer ``name`` as stored (``lockstep.loading.tensor_to_numpy``: a view where it can be)."""
        arr = self._mapped.get(name)
        if arr is None:
            from lockstep.loading import tensor_to_numpy

            arr = tensor_to_numpy(self.tensors[name], self.base_dir)
            if _file_mapped(arr):
                self._mapped[name] = arr
        return arr

    def dtype_of(self, name: str) -> np.dtype:
        """The numpy type ``proto`` declares for initializer ``name`` (its stored type, retyped)."""
        t = self.tensors[name].data_type
        return onnx.helper.tensor_dtype_to_np_dtype(dict(self.retype).get(t, t))

    def weight(self, name: str) -> np.ndarray:
        """Initializer ``name``'s value in the type ``proto`` declares (read now; not kept here)."""
        arr = self.source(name)
        dst = dict(self.retype).get(self.tensors[name].data_type)
        return arr if dst is None else arr.astype(onnx.helper.tensor_dtype_to_np_dtype(dst))

    def whole(self) -> onnx.ModelProto:
        """The proto with every initializer's data in the type it declares: a copy of every weight, for
        the few models only a whole-model path runs (``oracle.float64_logits_executor``)."""
        m = onnx.ModelProto()
        m.CopyFrom(self.proto)
        del m.graph.initializer[:]
        m.graph.initializer.extend(numpy_helper.from_array(np.ascontiguousarray(self.weight(t.name)), t.name)
                                   for t in self.proto.graph.initializer)
        return m

    def bare(self) -> onnx.ModelProto:
        """The structure without the initializer stubs (what the reference evaluator is built on)."""
        m = onnx.ModelProto()
        copy_fields(self.proto, m, "graph")
        copy_fields(self.proto.graph, m.graph, "initializer")
        return m


def _file_mapped(arr: np.ndarray) -> bool:
    """Whether ``arr`` is a view of a memory map (its bytes are a file's pages, not its own)."""
    base = arr
    while isinstance(base, np.ndarray):
        base = base.base
    return isinstance(base, mmap.mmap)


def proto_of(model: "onnx.ModelProto | StreamModel") -> onnx.ModelProto:
    """The proto to read roles and shapes from (a ``StreamModel``'s structure)."""
    return model.proto if isinstance(model, StreamModel) else model


def implicit_reads(node: onnx.NodeProto) -> tuple[str, ...]:
    """Outer-scope names a node's subgraphs read (If, Loop, Scan bodies), recursively."""
    out: list[str] = []
    for a in node.attribute:
        for g in ([a.g] if a.type == onnx.AttributeProto.GRAPH else list(a.graphs)):
            local = {v.name for v in g.input} | {t.name for t in g.initializer}
            for n in g.node:
                for name in [*n.input, *implicit_reads(n)]:
                    if name and name not in local and name not in out:
                        out.append(name)
                local.update(n.output)
    return tuple(out)


def transposed_tables(nodes: Sequence[onnx.NodeProto], tensors: Mapping[str, Any],
                      outputs: Sequence[str]) -> tuple[set[int], dict[int, str]]:
    """The builder's tied embedding, ``Gather(Transpose(W), ids)`` with ``W`` the LM head's [hidden, vocab]
    weight: (the Transposes not to run, {Gather node: W}) for every 2-D initializer transposed only to be
    read by axis-0 Gathers (not an output). Such a Gather is ``W[:, ids]`` with its first axis moved
    last (``gather_columns``): the same values, without transposing the whole table each run (a 151,936
    x 896 table: 11 of a 0.5B export's 26 s of ``golden add``, and a float64 copy of it)."""
    readers: dict[str, list[int]] = {}
    for j, n in enumerate(nodes):
        for x in n.input:
            readers.setdefault(x, []).append(j)

    def axis0_gather(j: int, x: str) -> bool:
        n = nodes[j]
        return (n.op_type == "Gather" and n.domain in ("", "ai.onnx") and list(n.input[:1]) == [x]
                and x not in n.input[1:] and all(a.i == 0 for a in n.attribute if a.name == "axis"))

    skip: set[int] = set()
    gathers: dict[int, str] = {}
    for i, n in enumerate(nodes):
        if n.op_type != "Transpose" or n.domain not in ("", "ai.onnx") or not n.input or n.input[0] not in tensors:
            continue
        perm = next((list(a.ints) for a in n.attribute if a.name == "perm"), [1, 0])
        t, out = tensors[n.input[0]], n.output[0]
        if len(t.dims) != 2 or perm != [1, 0] or out in outputs or not readers.get(out):
            continue
        if all(axis0_gather(j, out) for j in readers[out]):
            skip.add(i)
            gathers.update({j: n.input[0] for j in readers[out]})
    return skip, gathers


def gather_columns(table: np.ndarray, ids: np.ndarray) -> np.ndarray:
    """``Gather(Transpose(table), ids)`` (axis 0) without the transposed table: ``table[:, ids]``, its
    first axis moved last (negative ids count from the end, as Gather's)."""
    return np.ascontiguousarray(np.moveaxis(np.take(table, np.asarray(ids, np.int64), axis=1), 0, -1))


@dataclass(frozen=True)
class Schedule:
    """Which nodes run for some outputs, in graph order, and what is dropped after each."""

    order: tuple[int, ...]
    drop: dict[int, tuple[str, ...]]


def schedule(reads: Sequence[Sequence[str]], writes: Sequence[Sequence[str]], want: Sequence[str]) -> Schedule:
    """The nodes ``want`` depends on (``reads``/``writes``: each node's input and output names, in
    graph order) and, after each, the values no later node of the schedule reads (``want`` kept)."""
    needed, order = set(want), []
    for i in range(len(reads) - 1, -1, -1):
        if any(o in needed for o in writes[i] if o):
            order.append(i)
            needed.update(n for n in reads[i] if n)
    order.reverse()
    last: dict[str, int] = {}
    for i in order:
        for n in [*writes[i], *reads[i]]:
            if n:
                last[n] = i
    keep = set(want)
    drop: dict[int, list[str]] = {}
    for n, i in last.items():
        if n not in keep:
            drop.setdefault(i, []).append(n)
    return Schedule(tuple(order), {i: tuple(v) for i, v in drop.items()})


class StreamEvaluator:
    """onnx's ``ReferenceEvaluator`` (with ``CONTRIB_OPS``) built once over a ``StreamModel``'s
    structure, run by the loop above: ``run(output_names, feeds)`` returns what
    ``ReferenceEvaluator.run`` returns for the same model and feeds (see the module docstring)."""

    def __init__(self, model: "onnx.ModelProto | StreamModel"):
        from onnx.reference import ReferenceEvaluator

        from .contrib_oracle import CONTRIB_OPS, check_supported

        self.model = StreamModel.of(model)
        check_supported(self.model.proto)
        self.evaluator = ReferenceEvaluator(self.model.bare(), new_ops=CONTRIB_OPS)
        self.nodes = self.evaluator.rt_nodes_
        self.reads = [tuple(n.onnx_node.input) + implicit_reads(n.onnx_node) for n in self.nodes]
        self.writes = [tuple(n.onnx_node.output) for n in self.nodes]
        self._schedules: dict[tuple[str, ...], Schedule] = {}
        retyped = {t for t, _ in self.model.retype}
        self._gathers = {i: n.onnx_node.input[0] for i, n in enumerate(self.nodes)
                         if n.onnx_node.op_type == "Gather" and n.onnx_node.domain in ("", "ai.onnx")
                         and all(a.i == 0 for a in n.onnx_node.attribute if a.name == "axis")
                         and n.onnx_node.input[0] in self.model.tensors
                         and self.model.tensors[n.onnx_node.input[0]].data_type in retyped}
        self._skip, self._columns = transposed_tables([n.onnx_node for n in self.nodes], self.model.tensors,
                                                      [o.name for o in self.model.proto.graph.output])

    def run(self, output_names: Sequence[str], feeds: Mapping[str, Any]) -> list[Any]:
        want = tuple(output_names)
        plan = self._schedules.get(want)
        if plan is None:
            plan = self._schedules[want] = schedule(self.reads, self.writes, want)
        sm, results = self.model, {"": None}
        results.update(feeds)  # a feed shadows an initializer of its name, as in ReferenceEvaluator.run
        for i in plan.order:
            node = self.nodes[i]
            if i in self._skip or i in self._columns:  # a table transposed only for Gathers: they read
                if i in self._columns:                    # its columns (transposed_tables)
                    table, ids = self._columns[i], node.input[1]
                    out = gather_columns(sm.source(table), results[ids] if ids in results else sm.weight(ids))
                    results[node.output[0]] = out.astype(sm.dtype_of(table), copy=False)
                for name in plan.drop.get(i, ()):
                    if name:
                        results.pop(name, None)
                continue
            after = self._gathers.get(i)  # a Gather of a retyped table: its rows, converted after
            weights = {n: sm.source(n) if n == after else sm.weight(n)
                       for n in dict.fromkeys(self.reads[i]) if n not in results and n in sm.tensors}
            after = after if after in weights else None
            missing = [n for n in self.reads[i] if n not in results and n not in weights]
            if missing:
                raise RuntimeError(f"node {node.onnx_node.name!r} ({node.op_type}): input {missing[0]!r} is neither "
                                   "fed, an initializer nor computed before it")
            if node.need_context():  # If/Loop/Scan read the outer scope: their weights join it for the call
                results.update(weights)
                outputs = node.run(*[results[n] for n in node.input], context=results, bindings=None)
                for n in weights:
                    results.pop(n, None)
            else:
                outputs = node.run(*[results[n] if n in results else weights[n] for n in node.input])
            del weights  # this node's weights go now (a memory map's pages stay the kernel's file cache)
            if after is not None:  # (the same values as the kernel on the converted table: a conversion is exact)
                outputs = tuple(o.astype(sm.dtype_of(after)) for o in outputs)
            for name, value in zip(node.output, outputs):
                results[name] = value
            for name in plan.drop.get(i, ()):
                if name:
                    results.pop(name, None)
        return [results[n] if n in results else sm.weight(n) for n in want]
