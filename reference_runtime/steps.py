"""A model's nodes as the executor's steps, built once at load: ``_Step`` (a node, its kernel and
launch, its inputs and outputs), the node attributes as values (``node_attrs``), a topological order
that counts a subgraph's outer-scope reads (``_topological``), and a node's launch kernel
(``_node_kernel``)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import onnx
from lockstep.kernels import flag_check, Kernel, NodeInfo, OpKernel, run_small, Spec
from onnx import helper

from lockstep.loading import ModelError, tensor_to_numpy


__all__ = ["ALIAS_OPS", "node_attrs"]


@dataclass(frozen=True, init=False)
class _Step:
    node: onnx.NodeProto
    info: NodeInfo
    kernel: OpKernel | None  # None: handled by the executor (Identity, control flow)
    launch: Kernel | None
    alias: bool = False  # the output may be a view of input 0 (``is_view``): no allocation, no launch
    # node.input and node.output, read once: each read of a protobuf repeated field builds new strings
    # (a control-flow node's inputs are followed by the outer-scope names its subgraphs read)
    inputs: tuple[str, ...] = ()
    outputs: tuple[str, ...] = ()
    control: Any = None  # control_flow's step object (If, Loop, Scan, FlexAttention): run by the executor

    def __init__(self, node: onnx.NodeProto, info: NodeInfo, kernel: OpKernel | None, launch: Kernel | None,
                 alias: bool = False, inputs: tuple[str, ...] | None = None, outputs: tuple[str, ...] | None = None,
                 control: Any = None):
        d = self.__dict__  # one per node at load: the frozen fields written directly (as kernels' Spec)
        d["node"], d["info"], d["kernel"], d["launch"], d["alias"] = node, info, kernel, launch, alias
        d["inputs"] = tuple(node.input) if inputs is None else inputs
        d["outputs"] = tuple(node.output) if outputs is None else outputs
        d["control"] = control

    def is_view(self, spec: "Spec | None") -> bool:
        """Whether this run's output is a view of input 0 (of ``spec``): always for the Reshape
        family; for a Transpose when the permutation moves only dims of size 1 (the elements keep
        their memory order: a decode step's [1, 1, H, D] -> [1, H, 1, D])."""
        if not self.alias or spec is None:
            return False
        if self.info.op_type != "Transpose":
            return True
        perm = self.info.attrs.get("perm")
        perm = list(perm) if perm is not None else list(range(len(spec.shape)))[::-1]
        moved = [a for a in perm if spec.shape[a] != 1]
        return moved == sorted(moved)


# Ops whose output is the input's bytes under another shape: the executor makes it a view (as a
# real runtime does) when the input is an intermediate or a constant and the output is not a graph
# output (a graph output is the caller's, and a view of a feed could be overwritten in place).
# A Transpose is one when it moves only dims of size 1 (``_Step.is_view``).
ALIAS_OPS = frozenset({"Reshape", "Squeeze", "Unsqueeze", "Flatten", "Transpose"})


def node_attrs(node: onnx.NodeProto, base_dir: str | None) -> dict[str, Any]:
    """A node's attributes as kernels read them: tensors as numpy (external data from ``base_dir``),
    strings decoded."""
    out: dict[str, Any] = {}
    for a in node.attribute:
        v = helper.get_attribute_value(a)
        if isinstance(v, onnx.TensorProto):
            v = tensor_to_numpy(v, base_dir)
        elif isinstance(v, bytes):
            v = v.decode("utf-8")
        elif isinstance(v, list) and v and isinstance(v[0], bytes):
            v = [x.decode("utf-8") for x in v]
        out[a.name] = v
    return out


def _topological(graph: onnx.GraphProto, known: set[str], io: list[tuple[tuple[str, ...], tuple[str, ...]]]
                 ) -> list[int]:
    """The indices of the graph's nodes in waves: each wave is every node (in graph order) whose
    inputs are all known or produced by earlier waves. Linear in nodes and edges (a chain of n
    nodes is n waves). ``io``: each node's (inputs, outputs), read from the protobuf once."""
    produced = set(known)
    waiting: dict[str, list[int]] = {}  # a value not produced yet -> the nodes waiting for it
    missing = [0] * len(io)  # per node: how many of its (distinct) inputs are not produced yet
    wave: list[int] = []
    for k, (ins, _) in enumerate(io):
        need = {i for i in ins if i and i not in produced}
        missing[k] = len(need)
        for i in need:
            waiting.setdefault(i, []).append(k)
        if not need:
            wave.append(k)
    order: list[int] = []
    while wave:
        following: list[int] = []
        for k in wave:
            order.append(k)
            for o in io[k][1]:
                if o and o not in produced:
                    produced.add(o)
                    for j in waiting.pop(o, ()):
                        missing[j] -= 1
                        if not missing[j]:
                            following.append(j)
        wave = sorted(following)
    if len(order) < len(io):
        scheduled = set(order)
        missing_names = sorted({i for k, (ins, _) in enumerate(io) if k not in scheduled
                                for i in ins if i and i not in produced})
        raise ModelError(f"graph {graph.name!r}: inputs {missing_names[:5]} are never produced (cycle or dangling edge)")
    return order


def _node_kernel(op: OpKernel, info: NodeInfo, present: tuple[bool, ...], n_out: int) -> Kernel:
    """Wrap an op into a launchable kernel: outputs first, then the present inputs."""
    into = op.into

    def body(xp, *arrays, node, site=0):
        if node.index_checks:
            arrays, latch = arrays[:-1], arrays[-1]
        outs, ins = arrays[:n_out], iter(arrays[n_out:])
        args = [next(ins) if p else None for p in present]
        for check in node.index_checks:  # IndexCheck entries (kernels/_latch.py)
            if args[check.input] is not None:
                flag_check(xp, latch, args[check.input], check, site)
        if node.in_dtypes:  # a raw-bit device, and a small type among the node's values
            results = run_small(op, xp, node, outs, args)
            if results is None:
                return  # written in place by the op's ``into`` (on the storage bits)
        elif into is not None and into(xp, node, outs, *args):
            return  # written in place: one launch, no copy
        else:
            results = op.compute(xp, node, *args)
        if len(results) < n_out:
            raise node.error(f"compute returned {len(results)} outputs, {n_out} expected")
        for out, res in zip(outs, results):
            res = xp.asarray(res)
            if tuple(res.shape) != tuple(out.shape):
                raise node.error(f"compute gave shape {tuple(res.shape)}, shapes() promised {tuple(out.shape)}")
            xp.copyto(out, res, casting="unsafe")

    capture = "safe" if op.capture == "safe" else "unsupported"
    # The error latch, when passed, is the last array and is written too.
    return Kernel(f"{info.op_type}:{info.name}", body, writes=tuple(range(n_out)) + (-1,), capture=capture,
                  reason=op.reason or "")
