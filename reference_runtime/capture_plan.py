"""The capture plan: which nodes of a model may be recorded into CUDA graphs, and why not.

One admission point decides every node, in this order (the first failing check is the seam's
reason):
1. structure: control flow or a sequence op runs on the host — "host control flow" (If: its
   branch is a host read; SequenceMap and the sequence ops), except a
   Scan or Loop whose trip count is fixed (``_control_seam``): a Scan (its trip count is a shape;
   at opset 8, ``sequence_lens`` absent or host-known) or a Loop (its trip count M host-known, its
   condition absent or host-known and passed through by the body) whose body is capture-safe
   (every body node, nested bodies too, a capture-safe kernel or an Identity, reading nothing on
   the host the host does not know) is admitted, its iterations recorded into the segment (so is
   a FlexAttention whose ``score_mod``/``prob_mod`` bodies are capture-safe); its
   reason otherwise names the body node, e.g. "host control flow: Scan (body node 'n': kernel:
   ...)" or "host control flow: Loop (trip count read on the host)". An admitted one then passes
   the checks below on its inputs (outer-scope reads included; its outputs' shapes follow from
   them), and the classifier also vetoes one whose input *values* grow (a trip count). A node whose
   shape inference needs a value only the device holds (a ``host_inputs`` entry that is not
   host-known: not a constant, not shape arithmetic the executor folds) is a host seam —
   "host read"; a node that runs on the host on sequences, optionals or string tensors
   (``host_values``: a host kernel, or a device kernel given strings) is "host values"; a node
   with an input or output whose shape the model's shape inference could not resolve (e.g. a
   contrib op onnx does not know) cannot be shown fixed — "unresolved shape";
   an op type whose recording failed earlier in the session — "recording failed" (quarantine);
   a node that has not run eagerly in this session — "kernel not warmed";
2. the growing-symbol classifier, a hard veto: a node with any input or output dim that grows
   with the KV length is "classifier: grows with <symbol>". Growing symbols are the sequence axes
   of the KV inputs/outputs (the decoder's past/present roles, ``Executor.kv_roles``, whatever its card
   names them; without a decoder, ``past_key_values.*`` and ``present.*``), closed over
   unifications (elementwise broadcasting, MatMul batch dims, Concat and Expand alignment) and
   derivations (a symbol derived from a growing one, e.g. by Reshape/Flatten products or Concat
   sums, is growing: ``Symbol.roots``). A node whose output *values* depend on a growing symbol
   (shape arithmetic such as ``past_len + seq_len``, which the executor folds on the host) is
   vetoed too: a replay recomputes it on the device but would leave the host's folded copy stale. A symbol born on a node output from no symbolic parent
   (a Range whose length comes from values) is growing if those values depend on a growing symbol
   (value-level provenance through Shape and shape arithmetic) or on device data (unknown
   provenance: fail-safe). The same holds for a symbol inference derived from input symbols on a
   node whose output shape depends on input values (``host_inputs``: NonZero's count): derived
   or not, a dim that device data decides is growing;
3. the kernel's own declaration: "kernel: <reason>" for ``unsupported`` or a ``conditional`` whose
   ``capture_ok`` says no (asked only after the veto, so a kernel that wrongly says "safe" cannot
   bypass it).
Admitted nodes form maximal segments in execution order; every other node is an eager seam.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import onnx
from lockstep.kernels import Spec

from .symbols import Symbol

__all__ = ["CapturePlan", "plan_capture", "growing_symbols"]


@dataclass
class CapturePlan:
    decisions: list[tuple[str, str | None]]  # (node name, seam reason or None when admitted)
    growing: frozenset[str] = field(default_factory=frozenset)

    @property
    def segments(self) -> list[list[str]]:
        out: list[list[str]] = []
        current: list[str] = []
        for name, reason in self.decisions:
            if reason is None:
                current.append(name)
            elif current:
                out.append(current)
                current = []
        if current:
            out.append(current)
        return out

    def census(self) -> dict[str, Any]:
        reasons = Counter(r.split(":")[0] for _, r in self.decisions if r is not None)
        return {
            "nodes": len(self.decisions),
            "captured_nodes": sum(1 for _, r in self.decisions if r is None),
            "segments": len(self.segments),
            "seams_by_reason": dict(sorted(reasons.items())),
            "growing_symbols": sorted(self.growing),
        }


class _UnionFind:
    def __init__(self) -> None:
        self.parent: dict[Symbol, Symbol] = {}

    def find(self, s: Symbol) -> Symbol:
        self.parent.setdefault(s, s)
        while self.parent[s] is not s:
            self.parent[s] = self.parent[self.parent[s]]
            s = self.parent[s]
        return s

    def union(self, a: Symbol, b: Symbol) -> None:
        self.parent[self.find(a)] = self.find(b)


_BROADCASTING = {"Add", "Sub", "Mul", "Div", "Pow", "Where", "Equal", "Less", "LessOrEqual", "Greater",
                 "GreaterOrEqual", "And", "Or", "Xor", "Max", "Min", "Sum", "Mean", "PRelu", "Mod"}


def _memo(executor, key: str, compute):
    """``compute()``, once per executor: what it computes is a function of the executor's graph,
    constants and symbolic shapes, which do not change after load (a capture session, each of its
    plans and the execution plans ask for the same analyses)."""
    memo = executor.__dict__.setdefault("_capture_plan_memo", {})
    if key not in memo:
        memo[key] = compute()
    return memo[key]


def _value_provenance(executor) -> tuple[dict[str, set[Symbol]], dict[Symbol, "onnx.NodeProto"]]:
    """Value-level provenance of host-known values (shape arithmetic): for each value computed
    from constants and shapes only, the symbols its contents depend on; and the node each root
    symbol was born on. Computed once per executor (callers only read it)."""
    return _memo(executor, "provenance", lambda: _compute_value_provenance(executor))


def _compute_value_provenance(executor) -> tuple[dict[str, set[Symbol]], dict[Symbol, "onnx.NodeProto"]]:
    shapes: dict[str, tuple] = executor.symbolic_shapes
    deps: dict[str, set[Symbol]] = {name: set() for name in executor.constants}
    born: dict[Symbol, "onnx.NodeProto"] = {}
    for step in executor.steps:
        node = step.node
        if step.control is not None:
            value_deps = None  # computed by subgraphs on the device
        elif node.op_type in ("Shape", "Size") and node.input[0] in shapes:
            value_deps = {d for d in shapes[node.input[0]] if isinstance(d, Symbol)}
        elif all(i in deps for i in node.input if i):
            value_deps = set().union(*[deps[i] for i in node.input if i]) if node.input else set()
        else:
            value_deps = None  # depends on device data
        for o in node.output:
            if o and value_deps is not None:
                deps[o] = value_deps
            for d in shapes.get(o, ()) if o else ():
                if isinstance(d, Symbol) and d.is_root and d.producer and d not in born:
                    born[d] = node

    return deps, born


def growing_symbols(executor) -> frozenset[Symbol]:
    """Every symbol that may grow with the KV length (see the module docstring). Computed once per
    executor."""
    return _memo(executor, "growing", lambda: frozenset(_compute_growing_symbols(executor)))


def _compute_growing_symbols(executor) -> set[Symbol]:
    shapes: dict[str, tuple] = executor.symbolic_shapes
    uf = _UnionFind()
    seeds: set[Symbol] = set()
    # the decoder's past/present roles and their sequence axis (``Executor.kv_roles``, set by the decoder
    # from its DecoderIO: a card may name the caches anything); else the default names, axis 2 (BNSH)
    roles = getattr(executor, "kv_roles", None) or {
        name: 2 for name, dims in shapes.items()
        if (name.startswith("past_key_values.") or name.startswith("present.")) and len(dims) == 4}
    for name, axis in roles.items():
        dims = shapes.get(name, ())
        if len(dims) > axis and isinstance(dims[axis], Symbol):
            seeds.add(dims[axis])
    for step in executor.steps:
        node = step.node
        ins = [shapes.get(i) for i in node.input if i]
        outs = [shapes.get(o) for o in node.output if o]
        aligned: list[tuple] = []
        if node.op_type in _BROADCASTING or node.op_type == "Expand":
            aligned = [s for s in ins + outs if s is not None]
        elif node.op_type == "MatMul":  # batch dims (all but the last two) unify
            aligned = [s[:-2] for s in ins + outs if s is not None and len(s) > 2]
        elif node.op_type == "Concat":  # every non-axis dim unifies
            axis = next((a.i for a in node.attribute if a.name == "axis"), 0)
            aligned = [tuple(d for k, d in enumerate(s) if k != axis % max(len(s), 1)) for s in ins + outs if s]
        if aligned:
            width = max(len(s) for s in aligned)
            for k in range(1, width + 1):  # right-aligned, as broadcasting aligns
                syms = [s[-k] for s in aligned if len(s) >= k and isinstance(s[-k], Symbol)]
                for a, b in zip(syms, syms[1:]):
                    uf.union(a, b)
    grown_roots = {uf.find(s) for s in seeds}

    def grows(sym: Symbol) -> bool:
        return any(uf.find(s) in grown_roots for s in {sym} | set(sym.roots()))

    deps, born = _value_provenance(executor)
    value_shaped = _value_shaped_symbols(executor, deps, grows)

    growing: set[Symbol] = set(value_shaped)
    everything = set(executor.symbols.values()) | {d for dims in shapes.values() for d in dims if isinstance(d, Symbol)}
    fixed = _fixed_trip_controls(executor)
    for sym in everything:
        if grows(sym):
            growing.add(sym)
        elif sym in born:
            # born on a node output from no symbolic parent (e.g. a Range whose length comes from
            # values): growing if the values it came from depend on a growing symbol, or on device
            # data (unknown provenance: fail-safe)
            node = born[sym]
            inputs = [i for i in node.input if i]
            step = fixed.get(id(node))
            if step is not None:
                # a Scan or Loop whose trip count is fixed (``_control_seam``): its outputs' dims
                # follow from its inputs' shapes and its host-known trip count values alone
                inputs = [i for i in step.inputs[:2] if i] if node.op_type == "Loop" else []
                if any(grows(d) for i in step.inputs if i for d in shapes.get(i, ()) if isinstance(d, Symbol)):
                    growing.add(sym)
                    continue
            if not all(i in deps for i in inputs) or any(grows(d) for i in inputs for d in deps[i]):
                growing.add(sym)
    return growing


def _fixed_trip_controls(executor) -> dict[int, Any]:
    """The Scan and Loop steps the plan may admit (``_control_seam``), by their node's id."""
    controls = [st for st in executor.steps if st.control is not None and st.node.op_type in ("Scan", "Loop")]
    if not controls:
        return {}
    known = _host_known(executor)
    return {id(st.node): st for st in controls if _control_seam(executor, st, known) is None}


def _value_shaped_symbols(executor, deps: dict[str, set[Symbol]], grows) -> set[Symbol]:
    """Symbols introduced on the output of a node whose output shape depends on input *values*
    (its kernel's ``host_inputs``: NonZero, Range, Reshape, ...) where those values are device
    data (not host-known shape arithmetic) or depend on a growing symbol. Such a dim can change
    from one step to the next under the same feed shapes (NonZero's count), so it is growing
    (fail-safe) even when onnx's inference derived it from input symbols: a segment that baked
    it would be replayed on a stale shape."""
    out: set[Symbol] = set()
    for step in executor.steps:
        node, k = step.node, step.kernel
        if k is None or not k.host_inputs:
            continue
        reads = [node.input[i] for i in k.host_inputs if i < len(node.input) and node.input[i]]
        if all(r in deps for r in reads) and not any(grows(d) for r in reads for d in deps[r]):
            continue  # host-known values that do not grow: the dim is fixed with the feed shapes
        for o in node.output:
            for d in executor.symbolic_shapes.get(o, ()) if o else ():
                if isinstance(d, Symbol) and d.producer == step.info.name:
                    out.add(d)
    return out


def _host_known(executor, outer: "set[str] | frozenset[str]" = frozenset()) -> "set[str] | frozenset[str]":
    """Values whose contents the host knows without reading the device (constants, shapes, and
    small shape arithmetic over them, which the executor folds); ``outer``: names known already
    (a body's host-known outer-scope values). Without ``outer``, computed once per executor."""
    if not outer:
        return _memo(executor, "host_known", lambda: frozenset(_compute_host_known(executor)))
    return _compute_host_known(executor, outer)


def _compute_host_known(executor, outer: "set[str] | frozenset[str]" = frozenset()) -> set[str]:
    known = set(executor.constants) | set(outer)
    for step in executor.steps:
        node = step.node
        if node.op_type in ("Shape", "Size"):
            known.update(o for o in node.output if o)
        elif step.kernel is not None and step.kernel.capture == "safe" and all(i in known for i in node.input if i):
            known.update(o for o in node.output if o)
    return known


def _conditional_ok(executor, step) -> bool:
    """A ``conditional`` kernel's ``capture_ok``: constants keep their values (Dropout's
    training_mode=False is inference mode); the rest are placeholders, so a kernel's capture_ok
    must not rely on their shapes."""
    consts = executor.constants
    specs = [None if not i else Spec(np.shape(consts[i]), np.asarray(consts[i]).dtype, np.asarray(consts[i]))
             if i in consts else Spec(tuple(), np.dtype(np.float32)) for i in step.node.input]
    return bool(step.kernel.capture_ok(step.info, specs))  # type: ignore[misc]


def _body_seam(body, outer_known: set[str]) -> "str | None":
    """Why a control-flow body cannot be recorded inside a segment, or None when it can: every
    body node (nested bodies too) is a capture-safe kernel, an Identity or an admissible Scan,
    Loop or FlexAttention, and reads nothing on the host that the host does not know. Its shapes follow from the
    node's inputs' (fixed by the step signature) and host-known values, so one recording replays."""
    ex = body.executor
    if ex.paged_inputs and any(ex.paged_inputs.values()):
        return "its weights are paged (a replay cannot page them in)"
    known = _host_known(ex, {n for n in body.outer if n in outer_known})
    for step in ex.steps:
        node, name = step.node, step.info.name
        if step.control is not None or node.op_type in _HOST_CONTROL:
            inner = _control_seam(ex, step, known)
            if inner is not None:
                return f"body node {name!r}: {inner}"
            continue
        if step.kernel is None:  # Identity: an alias, no launch
            continue
        if step.kernel.host is not None or name in ex.host_steps:  # sequences, optionals, strings (as it ran)
            return f"body node {name!r}: host values: {node.op_type}"
        reads = [node.input[k] for k in step.kernel.host_inputs if k < len(node.input) and node.input[k]]
        unknown = [r for r in reads if r not in known]
        if unknown:
            return f"body node {name!r}: host read: {unknown[0]}"
        kernel = step.kernel
        if kernel.capture == "unsupported" or (kernel.capture == "conditional" and not _conditional_ok(ex, step)):
            return f"body node {name!r}: kernel: {kernel.reason}"
    return None


def _passes_condition_through(body) -> bool:
    """Whether a Loop body's condition output is its condition input (directly or through
    Identity nodes): then the condition never changes and no iteration reads it on the host."""
    target = body.outputs[0]
    made = {o: st for st in body.executor.steps for o in st.outputs if o}
    seen = 0
    while target in made and seen <= len(made):
        st = made[target]
        if st.node.op_type != "Identity" or st.kernel is not None or st.control is not None:
            return False
        target, seen = st.inputs[0], seen + 1
    return len(body.formal) > 1 and target == body.formal[1]


# a Loop is recorded iteration by iteration: past this many, it stays a seam (a graph of millions
# of nodes, each iteration's temporaries retained while the graph lives)
MAX_CAPTURED_TRIPS = 4096


def _control_seam(executor, step, known: set[str]) -> "str | None":
    """The seam reason of a control-flow (or sequence) node, or None when it may be recorded in a
    segment: a Scan (its trip count is a shape) whose body is capture-safe (``_body_seam``) and,
    at opset 8, whose ``sequence_lens`` is absent or host-known; a Loop whose trip count M is
    host-known (a constant one at most ``MAX_CAPTURED_TRIPS``), whose condition input is absent or
    host-known and whose body passes its condition through; a FlexAttention whose modifier bodies
    are capture-safe (each runs once). If (a branch chosen on the host), SequenceMap and the
    sequence ops stay host control flow."""
    node, control = step.node, step.control
    op = node.op_type
    if control is not None and op == "FlexAttention":  # its modifiers run once, on the scores
        why = next((w for b in control.mods if b is not None for w in [_body_seam(b, known)] if w), None)
        return None if why is None else f"host control flow: FlexAttention ({why})"
    if control is None or op not in ("Scan", "Loop"):
        return f"host control flow: {op}"
    ins = step.inputs
    if op == "Scan":
        if control.batched and ins[0] and ins[0] not in known:
            return "host control flow: Scan (sequence_lens read on the host)"
        why = _body_seam(control.body, known)
        return None if why is None else f"host control flow: Scan ({why})"
    if not ins[0] or ins[0] not in known:
        return "host control flow: Loop (trip count read on the host)"
    if ins[1] and ins[1] not in known:
        return "host control flow: Loop (condition read on the host)"
    if not _passes_condition_through(control.body):
        return "host control flow: Loop (the body's condition read on the host each iteration)"
    m = np.asarray(executor.constants[ins[0]]) if ins[0] in executor.constants else None
    if m is not None and (m.size != 1 or int(m.reshape(())) > MAX_CAPTURED_TRIPS):
        return f"host control flow: Loop (trip count past {MAX_CAPTURED_TRIPS})"
    why = _body_seam(control.body, known)
    return None if why is None else f"host control flow: Loop ({why})"


_HOST_CONTROL = {"If", "Loop", "Scan", "SequenceAt", "SequenceConstruct", "SequenceEmpty", "SequenceErase",
                 "SequenceInsert", "SequenceLength", "SequenceMap", "SplitToSequence", "ConcatFromSequence"}


def plan_capture(executor, *, quarantined: "frozenset[str] | set[str]" = frozenset(),
                 warmed: "set[str] | None" = None) -> CapturePlan:
    """The plan for ``executor``'s graph. ``quarantined``: op types whose recording failed in this
    session; ``warmed``: names of the nodes that have run eagerly (None: treat all as warmed)."""
    growing = growing_symbols(executor)
    deps, _ = _value_provenance(executor)
    known = _host_known(executor)
    shapes = executor.symbolic_shapes
    decisions: list[tuple[str, str | None]] = []
    for step in executor.steps:
        node, name = step.node, step.info.name
        control = node.op_type in _HOST_CONTROL or step.control is not None  # (FlexAttention with subgraphs too)
        if control:
            seam = _control_seam(executor, step, known)
            if seam is not None:
                decisions.append((name, seam))
                continue
        elif step.kernel is None:  # executor-handled aliasing (Identity): no launch, nothing to capture
            decisions.append((name, None))
            continue
        elif step.kernel.host is not None or name in executor.host_steps:  # sequences, optionals, strings
            decisions.append((name, f"host values: {node.op_type}"))
            continue
        if control:  # an admitted Scan or Loop: its host reads were checked by _control_seam
            reads = []
        else:
            reads = [node.input[i] for i in step.kernel.host_inputs if i < len(node.input) and node.input[i]]
        unknown = [r for r in reads if r not in known]
        if unknown:
            decisions.append((name, f"host read: {unknown[0]}"))
            continue
        # (an admitted Scan or Loop: its outputs' shapes follow from its inputs' and a host-known trip
        # count, which the step signature fixes, so only its inputs need resolving)
        unresolved = [v for v in [*step.inputs, *node.output] if v and v not in shapes and v not in executor.constants
                      and not (control and v in step.outputs)]
        if unresolved:
            decisions.append((name, f"unresolved shape: {unresolved[0]}"))
            continue
        if node.op_type in quarantined:
            decisions.append((name, f"recording failed: {node.op_type} quarantined"))
            continue
        if warmed is not None and name not in warmed:
            decisions.append((name, "kernel not warmed"))
            continue
        touched = [d for v in [*step.inputs, *node.output] if v for d in shapes.get(v, ()) if isinstance(d, Symbol)]
        hit = next((d for d in touched if d in growing), None)
        if hit is None:
            # value-level: shape arithmetic whose *contents* grow (past_len + seq_len) is folded on
            # the host at eager time; a replay would not refresh the host's copy, so it stays eager
            hit = next((d for o in node.output if o for d in sorted(deps.get(o, ()), key=lambda d: d.name)
                        if d in growing), None)
        if hit is None and control:
            # a trip count, or a value a body folds on the host (a Reshape's shape), that grows: the
            # recording would bake this step's iterations and shapes
            grown = [d for i in step.inputs if i for d in deps.get(i, ()) if d in growing]
            hit = min(grown, key=lambda d: d.name) if grown else None
        if hit is not None:
            decisions.append((name, f"classifier: grows with {hit.name}"))
            continue
        k = step.kernel
        if k is None:  # an admitted Scan or Loop: its body's kernels were checked by _control_seam
            decisions.append((name, None))
            continue
        if k.capture == "unsupported":
            decisions.append((name, f"kernel: {k.reason}"))
            continue
        if k.capture == "conditional" and not _conditional_ok(executor, step):
            decisions.append((name, f"kernel: {k.reason}"))
            continue
        decisions.append((name, None))
    return CapturePlan(decisions, frozenset(s.name for s in growing))
