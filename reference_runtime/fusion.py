"""Kernel fusion at load: groups of nodes a decode step runs back to back become one step, one launch.

A real runtime's graph optimizer fuses what its kernels can do in one pass (ONNX Runtime's
SkipSimplifiedLayerNormalization, its SwiGLU and packed QKV products); here the fused step gives
the **same bits** as the nodes it replaces, so capture on/off identity, golden locks and every
engine comparison see one model whether fusion is on or off (``RuntimeConfig.fuse_kernels``):

- ``SiluMul``: ``Sigmoid(g) -> s; Mul(g, s) -> m; Mul(m, u) -> y`` (either operand order) -> ``y``;
- ``AddRMSNorm``: ``Add(a, b) -> s; RMSNormalization(s, scale)`` with a constant scale -> the norm,
  and ``s`` too when anything else reads it (the residual stream);
- ``MatMulGroup``: MatMuls of one A by constant 2-D Bs (q/k/v, gate/up) -> their outputs, by up to
  ``GROUP_MAX`` per step.
- ``RotaryPair``, ``ScatterPair``: two RotaryEmbeddings (a step's q and k) or two TensorScatters (its
  key and value caches) next to each other in the step list, of equal attributes, the second not
  reading the first -> both outputs, one launch (CuPy: ``rope_pair_into`` when they share one cos/sin
  cache and position_ids; ``tensor_scatter_pair_into`` when both caches are bound in place). Their
  index checks are the two nodes' checks, one of each value and bounds.

A group fuses only when its intermediates are read by nothing else and are no graph output (a model
with its intermediates exposed, as ``lockstep locate`` runs it, fuses nothing it exposes), and
every value in it is float32 by onnx's inference (a pair: the two nodes' values of one type each, a
RotaryEmbedding's input float32). The fused step's kernel takes its one-launch fast
path (``kernels._fused.silu_mul_into``, ``add_rms_norm_into``, ``rope_pair_into``,
``tensor_scatter_pair_into``, ``kernels._linalg.matmul_group_into``: CuPy) when the run's operands allow it; otherwise (and always on the simulated device) it runs the
original nodes' own kernel bodies one after another (``steps._node_kernel``: each node's ``into``
or ``compute``, as unfused), so its bytes are the unfused bytes by construction. The fast paths
are checked against that chain on the GPU (tests/test_fusion.py).

A fused step is named after its nodes (``a+b+c``: a DeviceAssert from its index checks names it so)
and carries a synthetic node of its op type (``FUSED_OPS``) in the ``lockstep.fused`` domain, with
the group's external inputs and outputs, for the capture planner and error messages.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import numpy as np
import onnx
from onnx import helper

from lockstep.kernels import NodeInfo, OpKernel, Spec
from lockstep.kernels._attention import _rope_dims
from lockstep.kernels._fused import add_rms_norm_into, rope_pair_into, silu_mul_into, tensor_scatter_pair_into
from lockstep.kernels._latch import as_check
from lockstep.kernels._linalg import GROUP_MAX, matmul_group_into
from lockstep.kernels._nn_util import stash_dtype
from lockstep.kernels._op import normalize_axis

from .steps import _node_kernel, _Step

__all__ = ["DOMAIN", "fuse_steps", "FUSED_OPS"]

DOMAIN = "lockstep.fused"
FUSED_OPS = ("SiluMul", "AddRMSNorm", "MatMulGroup", "RotaryPair", "ScatterPair")
PAIRS = {"RotaryEmbedding": "RotaryPair", "TensorScatter": "ScatterPair"}  # op -> its pair's fused op


@dataclass(frozen=True)
class _Part:
    """One original node inside a fused step: its kernel, its NodeInfo, its wiring and its body."""

    kernel: OpKernel
    info: NodeInfo
    inputs: tuple[str, ...]
    outputs: tuple[str, ...]
    body: Callable[..., None]


def _part(step: _Step) -> _Part:
    present = tuple(bool(i) for i in step.inputs)
    return _Part(step.kernel, step.info, step.inputs, step.outputs,
                 _node_kernel(step.kernel, step.info, present, len(step.outputs)).body)


def _chain(parts: tuple[_Part, ...], inputs: tuple[str, ...], outputs: tuple[str, ...]):
    """The parts' own bodies one after another (each takes its ``into`` or ``compute``, as unfused):
    the fused step's reference and its fallback. Intermediates are allocated; outputs written."""

    def shapes(node, specs):
        env: dict[str, Spec] = dict(zip(inputs, specs))
        for p in parts:
            out = p.kernel.shapes(p.info, [env[i] if i else None for i in p.inputs])
            env.update(zip(p.outputs, out))
        return [env[o] for o in outputs]

    def run(xp, outs, ins) -> None:
        env: dict[str, Any] = dict(zip(inputs, ins))
        given = dict(zip(outputs, outs))
        for p in parts:
            args = [env[i] if i else None for i in p.inputs]
            specs = [None if a is None else Spec(tuple(a.shape), a.dtype) for a in args]
            out_specs = tuple(p.kernel.shapes(p.info, specs))
            mine = [given[o] if o in given else xp.empty(s.shape, s.dtype) for o, s in zip(p.outputs, out_specs)]
            p.body(xp, *mine, *[a for a in args if a is not None], node=p.info.for_run(out_specs, {}))
            env.update(zip(p.outputs, mine))

    return shapes, run


def _fused_kernel(op_type: str, parts: tuple[_Part, ...], inputs: tuple[str, ...], outputs: tuple[str, ...]
                  ) -> tuple[OpKernel, Callable[..., None]]:
    """The fused step's kernel (its ``into``: the one-launch kernel, else the chain) and the chain."""
    shapes, run = _chain(parts, inputs, outputs)

    def compute(xp, node, *ins):  # never reached (``into`` always writes); the chain, for completeness
        specs = shapes(node, [Spec(tuple(a.shape), a.dtype) for a in ins])
        outs = [xp.empty(s.shape, s.dtype) for s in specs]
        run(xp, outs, ins)
        return tuple(outs)

    into = {"SiluMul": _silu_mul, "AddRMSNorm": _add_rms_norm, "MatMulGroup": _matmul_group,
            "RotaryPair": _rotary_pair, "ScatterPair": _scatter_pair}[op_type]
    checks = _part_checks(parts, inputs) if any(p.kernel.index_checks for p in parts) else None
    return OpKernel(op_type, shapes, compute, domain=DOMAIN, into=into, index_checks=checks, capture="safe"), run


def _part_checks(parts: tuple[_Part, ...], inputs: tuple[str, ...]):
    """The parts' index checks (pairs: RotaryEmbedding's, TensorScatter's) on the fused step's inputs
    (each part's inputs follow the previous part's), one per value and bounds: two checks of one value against the same bounds in one step
    are one check (the latch names the fused step either way)."""

    def checks(node, specs):
        out, seen, off = [], set(), 0
        for p in parts:
            n = len(p.inputs)
            if p.kernel.index_checks is not None:
                for c in p.kernel.index_checks(p.info, specs[off:off + n]):
                    c = as_check(c)
                    c = c._replace(input=c.input + off, by=None if c.by is None else tuple(i + off for i in c.by))
                    key = (inputs[c.input], c.lo, c.hi, c.ignore)
                    if key not in seen:
                        seen.add(key)
                        out.append(c)
            off += n
        return out

    return checks


def _silu_mul(xp, node, outs, g, u) -> bool:
    if not silu_mul_into(xp, outs[0], g, u):
        node.attrs["chain"](xp, outs, (g, u))
    return True


def _add_rms_norm(xp, node, outs, a, b, scale) -> bool:
    a_ = node.attrs
    done = False
    if stash_dtype(a_["stash_type"], a.dtype) == np.float32:
        axis = normalize_axis(node, a_["axis"], a.ndim)
        s, y = (outs[0], outs[1]) if len(outs) == 2 else (None, outs[0])
        done = add_rms_norm_into(xp, s, y, a, b, scale, axis, a_["epsilon"])
    if not done:
        a_["chain"](xp, outs, (a, b, scale))
    return True


def _matmul_group(xp, node, outs, a, *bs) -> bool:
    if not matmul_group_into(xp, list(outs), a, list(bs)):
        node.attrs["chain"](xp, outs, (a, *bs))
    return True


def _rotary_pair(xp, node, outs, *ins) -> bool:
    a_ = node.attrs
    n = len(ins) // 2
    first, (x0, x1) = a_["first"], (ins[0], ins[n])
    done = False
    if a_["shared"] and x0.ndim == x1.ndim:
        cos, sin, pos = ins[1], ins[2], (ins[3] if n > 3 else None)
        _, h0, _, _, rd = _rope_dims(first, [Spec(tuple(x0.shape), x0.dtype)])
        _, h1, _, _, rd1 = _rope_dims(first, [Spec(tuple(x1.shape), x1.dtype)])
        done = rd == rd1 and rope_pair_into(xp, outs[0], x0, h0, outs[1], x1, h1, cos, sin, pos, rd,
                                            bool(int(first.attr("interleaved", 0))))
    if not done:
        a_["chain"](xp, outs, ins)
    return True


def _scatter_pair(xp, node, outs, *ins) -> bool:
    first = node.attrs["first"]
    n = len(ins) // 2
    a, b = ins[:n], ins[n:]
    axis = int(first.attr("axis", -2)) % a[0].ndim
    circular = first.attr("mode", "linear") == "circular"
    if not tensor_scatter_pair_into(xp, outs[0], a[0], a[1], a[2] if n > 2 else None,
                                    outs[1], b[0], b[1], b[2] if n > 2 else None, axis, circular):
        node.attrs["chain"](xp, outs, ins)
    return True


def _same_attrs(a: dict[str, Any], b: dict[str, Any]) -> bool:
    try:
        return a.keys() == b.keys() and all(bool(np.all(a[k] == b[k])) for k in a)
    except Exception:  # attributes that do not compare (graphs): not a pair
        return False


def _typed(op_type: str, members: list[_Step], ins, outs, elem: dict[str, int]) -> bool:
    """A group's types: every value float32, or for a pair the two nodes' values of one type each
    (a RotaryEmbedding's input float32: the pair kernel's)."""
    if op_type in PAIRS.values():
        a, b = members
        pairs = list(zip(a.inputs, b.inputs)) + list(zip(a.outputs, b.outputs))
        if any(elem.get(x) is None or elem.get(x) != elem.get(y) for x, y in pairs):
            return False
        return op_type != "RotaryPair" or elem.get(a.inputs[0]) == onnx.TensorProto.FLOAT
    return _f32(elem, *ins, *outs, *(o for st in members for o in st.outputs))


def _f32(types: dict[str, int], *names: str) -> bool:
    return all(types.get(n) == onnx.TensorProto.FLOAT for n in names if n)


def _other(mul: _Step, name: str) -> str | None:
    """The Mul's other input when one of its two inputs is ``name`` (and the other is not)."""
    a, b = mul.inputs[0], mul.inputs[1]
    if a == name and b != name:
        return b
    if b == name and a != name:
        return a
    return None


def fuse_steps(steps: list[_Step], graph_outputs: set[str], constants: dict[str, np.ndarray],
               types: Callable[[], dict[str, int]]) -> tuple[list[_Step], tuple[str, ...]]:
    """``steps`` (topological, pruned) with fusable groups replaced by fused steps, and the names of
    the fused steps made. ``types()``: each value's onnx elem type (called once, only when a group
    matched by structure)."""
    readers: dict[str, list[int]] = {}
    for k, st in enumerate(steps):
        for name in st.inputs:
            if name:
                readers.setdefault(name, []).append(k)

    def only_reader(name: str, k: int) -> bool:
        return name not in graph_outputs and readers.get(name) == [k]

    def plain(st: _Step, op: str, n_in: int) -> bool:
        return (st.kernel is not None and st.info.op_type == op and st.info.domain == ""
                and len(st.inputs) == n_in and all(st.inputs) and len(st.outputs) == 1 and st.outputs[0] != "")

    groups: list[tuple[str, list[int], tuple[str, ...], tuple[str, ...], int]] = []  # op, members, ins, outs, at
    used: set[int] = set()
    for k, st in enumerate(steps):
        # SiluMul: Sigmoid(g) -> s, Mul(g, s) -> m, Mul(m, u) -> y
        if plain(st, "Sigmoid", 1) and k not in used:
            g, s = st.inputs[0], st.outputs[0]
            r = readers.get(s, [])
            if len(r) != 1 or s in graph_outputs or not plain(steps[r[0]], "Mul", 2) or _other(steps[r[0]], s) != g:
                continue
            m_k = r[0]
            m = steps[m_k].outputs[0]
            r2 = readers.get(m, [])
            if len(r2) != 1 or m in graph_outputs or not plain(steps[r2[0]], "Mul", 2):
                continue
            y_k = r2[0]
            u = _other(steps[y_k], m)
            if u is None or {k, m_k, y_k} & used:
                continue
            groups.append(("SiluMul", [k, m_k, y_k], (g, u), (steps[y_k].outputs[0],), y_k))
            used.update((k, m_k, y_k))
        # AddRMSNorm: Add(a, b) -> s, RMSNormalization(s, scale const)
        elif plain(st, "Add", 2) and k not in used:
            s = st.outputs[0]
            norms = [j for j in readers.get(s, []) if j not in used and plain(steps[j], "RMSNormalization", 2)
                     and steps[j].inputs[0] == s and steps[j].inputs[1] in constants and steps[j].inputs[1] != s]
            if len(norms) != 1:
                continue
            n_k = norms[0]
            keep = not only_reader(s, n_k)
            outs = (s, steps[n_k].outputs[0]) if keep else (steps[n_k].outputs[0],)
            groups.append(("AddRMSNorm", [k, n_k], (st.inputs[0], st.inputs[1], steps[n_k].inputs[1]), outs, k))
            used.update((k, n_k))
    # MatMulGroup: MatMuls of one A by constant 2-D Bs, by A (in step order)
    by_a: dict[str, list[int]] = {}
    for k, st in enumerate(steps):
        if (k not in used and plain(st, "MatMul", 2) and st.inputs[1] in constants
                and np.ndim(constants[st.inputs[1]]) == 2 and st.inputs[0] != st.inputs[1]):
            by_a.setdefault(st.inputs[0], []).append(k)
    for a, ks in by_a.items():
        for at in range(0, len(ks), GROUP_MAX):
            chunk = ks[at:at + GROUP_MAX]
            if len(chunk) < 2:
                continue
            ins = (a,) + tuple(steps[j].inputs[1] for j in chunk)
            outs = tuple(steps[j].outputs[0] for j in chunk)
            groups.append(("MatMulGroup", chunk, ins, outs, chunk[0]))
            used.update(chunk)
    # RotaryPair, ScatterPair: two nodes of one op next to each other, the second not reading the first
    for k in range(len(steps) - 1):
        a, b = steps[k], steps[k + 1]
        op = a.info.op_type
        if (k in used or k + 1 in used or op not in PAIRS or a.kernel is None or b.kernel is None
                or b.info.op_type != op or a.info.domain != "" or b.info.domain != ""
                or len(a.inputs) != len(b.inputs) or not all(a.inputs) or not all(b.inputs)
                or len(a.outputs) != 1 or len(b.outputs) != 1 or not a.outputs[0] or not b.outputs[0]
                or a.outputs[0] in b.inputs or not _same_attrs(a.info.attrs, b.info.attrs)):
            continue
        groups.append((PAIRS[op], [k, k + 1], a.inputs + b.inputs, a.outputs + b.outputs, k))
        used.update((k, k + 1))
    if not groups:
        return steps, ()
    elem = types()
    groups = [gr for gr in groups if _typed(gr[0], [steps[j] for j in gr[1]], gr[2], gr[3], elem)]
    if not groups:
        return steps, ()
    replace: dict[int, _Step] = {}
    drop: set[int] = set()
    for op_type, members, ins, outs, at in groups:
        parts = tuple(_part(steps[j]) for j in members)
        name = "+".join(steps[j].info.name for j in members)
        kernel, chain = _fused_kernel(op_type, parts, ins, outs)
        attrs: dict[str, Any] = {"parts": tuple(steps[j].info.name for j in members), "chain": chain}
        if op_type == "AddRMSNorm":
            norm = steps[members[1]].info
            attrs.update(axis=int(norm.attr("axis", -1)), epsilon=float(norm.attr("epsilon", 1e-5)),
                         stash_type=int(norm.attr("stash_type", 1)))
        if op_type in PAIRS.values():
            a, b = steps[members[0]], steps[members[1]]
            attrs.update(first=a.info, shared=a.inputs[1:] == b.inputs[1:])
        info = NodeInfo(name, op_type, DOMAIN, 1, attrs, len(ins), len(outs))
        node = helper.make_node(op_type, list(ins), list(outs), name=name, domain=DOMAIN)
        replace[at] = _Step(node, info, kernel, _node_kernel(kernel, info, (True,) * len(ins), len(outs)),
                            False, ins, outs)
        drop.update(j for j in members if j != at)
    fused = [replace.get(k, st) for k, st in enumerate(steps) if k not in drop]
    return fused, tuple(st.info.name for st in replace.values())
