"""The oracle's float64 cross-check, streamed: lockstep's reference-runtime kernels (``lockstep.kernels``,
the ones ref-sim launches) run node by node in float64 on the host, each weight read and converted to
float64 at the node that reads it and dropped after it.

Independence from the oracle: the oracle computes with onnx's reference kernels (and the float64
contrib ops of ``contrib_oracle``); this computes with lockstep's own kernels, which share no code
with either (``kernels/``, registered in ``kernels.registry``), in float64, on the float64 retyping
of the same model (``oracle.retyped``'s function: values, Cast targets, tensor attributes). The
schedule (graph order, only the nodes the logits depend on, each value dropped after its last
reader) is the oracle's (``stream.schedule``); what it leaves out of a ref-sim run is the simulated
device itself (its allocator, streams, ordering checks and fusion), which decides no value: a kernel
computes the same numpy expression on the device's memory as here. A node with a subgraph or a
host kernel (sequences, strings) is not streamed: such a model takes the executor's whole-model path
(``oracle.float64_logits_executor``), as every model did before.
"""

from __future__ import annotations

from typing import Any, Mapping, Sequence

import numpy as np
import onnx
from onnx import TensorProto

from lockstep.reference_runtime.steps import node_attrs

from .stream import StreamModel, gather_columns, implicit_reads, schedule, transposed_tables

__all__ = ["Float64Stream", "streamable"]


def _constant(attrs: dict[str, Any]) -> np.ndarray:
    if "value" in attrs:
        return np.asarray(attrs["value"])
    for key, dt in (("value_float", np.float32), ("value_floats", np.float32), ("value_int", np.int64),
                    ("value_ints", np.int64)):
        if key in attrs:
            return np.asarray(attrs[key], dtype=dt)
    raise NotImplementedError(f"Constant with attributes {sorted(attrs)}")


def streamable(model: onnx.ModelProto) -> bool:
    """Whether every node is one this module runs (no subgraph; a kernel that is not a host kernel)."""
    from lockstep.kernels.registry import EXECUTOR_OPS, REGISTRY

    opsets = {("" if o.domain == "ai.onnx" else o.domain): o.version for o in model.opset_import}
    for n in model.graph.node:
        domain = "" if n.domain == "ai.onnx" else n.domain
        if implicit_reads(n) or any(a.type in (onnx.AttributeProto.GRAPH, onnx.AttributeProto.GRAPHS)
                                    for a in n.attribute):
            return False
        if (domain, n.op_type) in EXECUTOR_OPS:
            continue
        k = REGISTRY.lookup(domain, n.op_type, opsets.get(domain, 0))
        if k is None or k.host is not None:
            return False
    return True


class Float64Stream:
    """The float64 retyping of a model (``StreamModel.retyped(FLOAT, DOUBLE)``) on lockstep's kernels,
    one node at a time: ``run(output_names, feeds)`` (float32 feeds are made float64)."""

    def __init__(self, model: "onnx.ModelProto | StreamModel"):
        from lockstep.kernels import NodeInfo, validate_node
        from lockstep.kernels.registry import EXECUTOR_OPS, REGISTRY

        self.model = StreamModel.of(model).retyped(TensorProto.FLOAT, TensorProto.DOUBLE)
        g = self.model.proto.graph
        opsets = {("" if o.domain == "ai.onnx" else o.domain): o.version for o in self.model.proto.opset_import}
        self.steps: list[tuple[Any, Any, tuple[str, ...], tuple[str, ...]]] = []
        for k, n in enumerate(g.node):
            domain = "" if n.domain == "ai.onnx" else n.domain
            attrs = node_attrs(n, self.model.base_dir)
            info = NodeInfo(n.name or f"{n.op_type}_{k}", n.op_type, domain, opsets.get(domain, 0), attrs,
                            len(n.input), len(n.output))
            kernel = None
            if (domain, n.op_type) not in EXECUTOR_OPS:
                kernel = REGISTRY.lookup(domain, n.op_type, info.opset)
                if kernel is None or kernel.host is not None:
                    raise NotImplementedError(f"{info.name}: {REGISTRY.why_not(domain, n.op_type, info.opset)}")
                validate_node(kernel, info, tuple(i for i, x in enumerate(n.input) if not x))
            self.steps.append((info, kernel, tuple(n.input), tuple(n.output)))
        self._schedules: dict[tuple[str, ...], Any] = {}
        self._skip, self._columns = transposed_tables(list(g.node), self.model.tensors, [o.name for o in g.output])

    def _run_node(self, info, kernel, args: list[Any]) -> tuple[Any, ...]:
        from lockstep.kernels import Spec

        if kernel is None:  # the executor's own: Constant (a value), Identity (its input)
            return (_constant(info.attrs),) if info.op_type == "Constant" else (args[0],)
        specs = [None if a is None else Spec(tuple(a.shape), a.dtype, a) for a in args]
        out_specs = tuple(kernel.shapes(info, specs))
        host = {k: args[k] for k in kernel.host_inputs if k < len(args) and args[k] is not None}
        results = kernel.compute(np, info.for_run(out_specs, host), *args)
        outs = []
        for spec, res in zip(out_specs, results):
            res = np.asarray(res)
            if tuple(res.shape) != tuple(spec.shape):
                raise info.error(f"compute gave shape {tuple(res.shape)}, shapes() promised {tuple(spec.shape)}")
            outs.append(res.astype(spec.dtype, copy=False))  # the executor's copy into the output, unsafe casting
        return tuple(outs)

    CHUNK_BYTES = 64 << 20  # a float64 weight past this is split along its output columns (N)

    def _weights(self, info, ins: tuple[str, ...], env: dict[str, Any]) -> tuple[list[Any], bool]:
        """The node's inputs, weights read now; (args, gathered): a Gather of a weight gathers its rows
        in the stored type (its outputs converted after: the same values, not the table converted)."""
        sm = self.model
        gather = (info.op_type == "Gather" and not info.domain and int(info.attrs.get("axis", 0)) == 0
                  and ins and ins[0] not in env and ins[0] in sm.tensors)
        args = []
        for k, n in enumerate(ins):
            if not n:
                args.append(None)
            elif n in env:
                args.append(env[n])
            else:
                args.append(sm.source(n) if gather and k == 0 else sm.weight(n))
        return args, gather

    def _split(self, info, ins: tuple[str, ...], env: dict[str, Any]) -> int | None:
        """Rows of output columns per chunk for a product whose weight is a large initializer
        (MatMul, Gemm, MatMulNBits: each chunk's weight converted alone, ``_chunks``); else None."""
        sm, op = self.model, info.op_type
        name = ins[1] if len(ins) > 1 else ""
        if op not in ("MatMul", "Gemm", "MatMulNBits") or not name or name in env or name not in sm.tensors:
            return None
        t = sm.tensors[name]
        if op == "MatMulNBits":
            n, row_bytes = int(info.attrs["N"]), 8 * int(info.attrs["K"])
        elif len(t.dims) != 2:
            return None
        else:
            trans = op == "Gemm" and bool(info.attrs.get("transB", 0))
            n, row_bytes = int(t.dims[0 if trans else 1]), 8 * int(t.dims[1 if trans else 0])
        rows = max(1, self.CHUNK_BYTES // max(row_bytes, 1))
        return rows if n > rows else None

    def _chunks(self, info, ins: tuple[str, ...], env: dict[str, Any], rows: int):
        """(node info, args) per chunk of ``rows`` output columns, made one at a time."""
        from lockstep.kernels import NodeInfo

        sm, op, name = self.model, info.op_type, ins[1]
        full = [None if not x else env[x] if x in env else sm.weight(x) if x != name else None for x in ins]
        src = sm.source(name)  # the stored weight (a view): each chunk converted as it is used
        trans = op == "Gemm" and bool(info.attrs.get("transB", 0))
        n = int(info.attrs["N"]) if op == "MatMulNBits" else src.shape[0 if trans else 1]
        for start in range(0, n, rows):
            cut = slice(start, min(n, start + rows))
            args = list(full)
            if op == "MatMulNBits":
                nb = -(-int(info.attrs["K"]) // int(info.attrs["block_size"]))
                args[1] = src.reshape(n, -1)[cut].reshape(-1, *src.shape[1:])
                args[2] = args[2].reshape(n, nb)[cut]
                if len(args) > 3 and args[3] is not None:
                    args[3] = args[3].reshape(n, -1)[cut]
                if len(args) > 5 and args[5] is not None:
                    args[5] = args[5].reshape(n)[cut]
                part = NodeInfo(info.name, op, info.domain, info.opset, {**info.attrs, "N": cut.stop - cut.start},
                                info.n_inputs, info.n_outputs)
            else:
                args[1] = (src[cut] if trans else src[:, cut]).astype(sm.dtype_of(name))
                if op == "Gemm" and len(args) > 2 and args[2] is not None and args[2].ndim and args[2].shape[-1] == n:
                    args[2] = args[2][..., cut]
                part = info
            yield part, args

    def run(self, output_names: Sequence[str], feeds: Mapping[str, np.ndarray]) -> list[np.ndarray]:
        want = tuple(output_names)
        plan = self._schedules.get(want)
        if plan is None:
            plan = self._schedules[want] = schedule([s[2] for s in self.steps], [s[3] for s in self.steps], want)
        sm = self.model
        env: dict[str, Any] = {k: (v.astype(np.float64) if v.dtype == np.float32 else v) for k, v in feeds.items()}
        for i in plan.order:
            info, kernel, ins, outs = self.steps[i]
            if i in self._skip or i in self._columns:  # a table transposed only for Gathers: they read
                if i in self._columns:                    # its columns (transposed_tables)
                    table, ids = self._columns[i], ins[1]
                    out = gather_columns(sm.source(table), env[ids] if ids in env else sm.weight(ids))
                    env[outs[0]] = out.astype(sm.dtype_of(table), copy=False)
                for name in plan.drop.get(i, ()):
                    env.pop(name, None)
                continue
            rows = self._split(info, ins, env) if kernel is not None else None
            if rows is not None:  # the output columns chunk by chunk (each its own kernel call)
                results = (np.concatenate([self._run_node(part, kernel, args)[0]
                                           for part, args in self._chunks(info, ins, env, rows)], axis=-1),)
            else:
                args, gathered = self._weights(info, ins, env)
                results = self._run_node(info, kernel, args)
                del args  # this node's float64 weights go now
                if gathered:
                    results = tuple(r.astype(sm.dtype_of(ins[0])) for r in results)
            for name, value in zip(outs, results):
                if name:
                    env[name] = value
            for name in plan.drop.get(i, ()):
                env.pop(name, None)
        return [env[n] if n in env else sm.weight(n) for n in want]
